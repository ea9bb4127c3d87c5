//! `TrainStep`: ahead-of-time compiled training steps (forward, backward, optimizer).
//!
//! A loss function over a model is traced once per input signature, differentiated with
//! [`crate::autograd`], and compiled either as three executables ([`TrainMode::Split`], as
//! AOTAutograd does: forward, backward, optimizer) or as one ([`TrainMode::Fused`]: forward,
//! backward and update in a single XLA program).
//!
//! Everything a step reads besides the batch lives on the device: parameters, buffers (BatchNorm
//! running statistics), optimizer state, the step count, the learning rate, the random-number
//! key. Graphs update them as extra outputs whose inputs are donated, so a steady-state step
//! transfers only the batch to the device and, when asked, the loss back. The stages run on the
//! runtime's executor ([`crate::runtime`]), the same one [`crate::CompiledFn`] uses.
//!
//! # Data parallelism
//!
//! On a backend of N replicas ([`crate::backend::xla::XlaBackend::replicated`]) a step is
//! data-parallel: every input is split along its first dimension into N equal shards (else an
//! [`Error`]), each replica runs the step on its shard, and the gradients, the loss and the new
//! values of the variables the loss function assigns (BatchNorm running statistics) are
//! averaged across replicas inside the compiled graphs ([`crate::ir::Op::AllReduce`]), so every
//! replica applies the same update and parameters and optimizer state stay identical (and
//! resident, donated per device). For a loss that is a mean over the batch, N replicas on B
//! rows each step exactly like one device on the N·B rows. BatchNorm normalizes with each
//! replica's own batch statistics, as PyTorch's `DistributedDataParallel` does; dropout draws
//! the same mask pattern on every replica.

use crate::autograd::{joint, partition, BackwardInput, SavePolicy};
use crate::backend::{Backend, HostTensor};
use crate::compile::TraceMode;
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, DType, Fingerprint, Graph, InputKind, Literal, NodeId, Op, TensorType};
use crate::nn::{Init, ParamStore};
use crate::optim::Optimizer;
use crate::passes::autocast_graph;
use crate::runtime::exec::{Arg, Dest, Plan, PlanBuilder, StepBuilder, VarId};
use crate::runtime::{ExecutableCache, Runtime, Stats};
use crate::trace::{trace, Binding, LatestTraces, Retrace, Tensor, Traced};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

mod checkpoint;
mod replicas;
use replicas::replica_mean;

/// How a training step is split into executables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrainMode {
    /// Three executables per step: forward (loss + saved activations), backward (gradients),
    /// optimizer (parameter and state updates), as AOTAutograd produces them.
    Split,
    /// One executable per step: forward, backward and update fused (XLA prefers one big graph).
    Fused,
}

/// Dynamic loss scaling for [`TrainStep::with_mixed_precision`] in `f16`, as PyTorch's
/// `torch.cuda.amp.GradScaler` does it: the loss's cotangent seed is `scale` instead of 1, so
/// small gradients survive f16's narrow exponent range (below 6e-8 they round to zero, below
/// 6.1e-5 where subnormals are flushed, as on XLA:CPU); the
/// optimizer update divides the gradients by `scale` first. If any gradient is inf or NaN (the
/// scaled backward pass overflowed), the step is skipped (parameters, optimizer state and step
/// count unchanged) and the scale is multiplied by `backoff_factor`; after `growth_interval`
/// good steps in a row it is multiplied by `growth_factor`. The check, the skip and the scale
/// update are part of the compiled step: no host synchronisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaling {
    /// The first scale (PyTorch: 2^16).
    pub init_scale: f64,
    /// Multiplier after `growth_interval` good steps (PyTorch: 2).
    pub growth_factor: f64,
    /// Multiplier after an overflow (PyTorch: 0.5).
    pub backoff_factor: f64,
    /// Good steps in a row before growing (PyTorch: 2000).
    pub growth_interval: u32,
}

impl Default for LossScaling {
    fn default() -> Self {
        LossScaling {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Resident variables of loss scaling (f32 scalars).
struct Scaler {
    cfg: LossScaling,
    scale: Tensor,
    good: Tensor,
    skipped: Tensor,
}

/// The compiled stages of one traced loss, and which temporary holds the loss.
struct TrainProgram<B: Backend> {
    plan: Plan<B>,
    loss_temp: usize,
}

/// A traced loss differentiated w.r.t. the trained parameters, before it is cut into steps.
struct Differentiated {
    /// Inputs: the traced graph's (`num_inputs`) ++ the loss cotangent; outputs: the loss, the
    /// assigned variables' new values (`updates` order), then one gradient per parameter.
    joint: Graph,
    num_inputs: usize,
    loss_dtype: DType,
    /// What each of the traced graph's inputs is bound to.
    args: Vec<Arg>,
    /// The trained parameters: traced input index and variable.
    params: Vec<(usize, Tensor)>,
    /// The variables the loss function assigns.
    updates: Vec<VarId>,
    /// The traced input holding the random key, if the loss draws random numbers.
    rng_input: Option<usize>,
    key_var: VarId,
}

type LossFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send>;

/// A compiled training step; see the module docs.
///
/// A `TrainStep` is `Send`: it can be built on one thread and driven from another.
///
/// ```no_run
/// use kiln::backend::xla::XlaBackend;
/// use kiln::nn::{Linear, Module, ParamStore};
/// use kiln::optim::Sgd;
/// use kiln::train::{TrainMode, TrainStep};
/// use kiln::Tensor;
///
/// let store = ParamStore::with_seed(0);
/// let fc = Linear::new(&store.root().sub("fc"), 10, 1, true)?;
/// let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new().momentum(0.9), move |xs: &[Tensor]| {
///     fc.forward_t(&xs[0], true)?.sub(&xs[1])?.square()?.mean_all()
/// })?
/// .with_mode(TrainMode::Fused)
/// .with_lr(0.01);
/// let x = Tensor::randn(&[8, 10], 1)?;
/// let y = Tensor::randn(&[8, 1], 2)?;
/// for _ in 0..10 {
///     let loss = step.step(&[x.clone(), y.clone()])?;
///     println!("{loss}");
/// }
/// step.sync_to_store()?; // parameters back into `store`
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct TrainStep<B: Backend> {
    rt: Runtime<B>,
    /// The store whose trainable parameters this step trains.
    store: ParamStore,
    loss_fn: LossFn,
    opt: Box<dyn Optimizer>,
    /// The optimizer's type name, recorded in checkpoints.
    opt_kind: &'static str,
    mode: TrainMode,
    trace_mode: TraceMode,
    policy: SavePolicy,
    /// Internal variables: optimizer state, step count, lr, rng key, cotangent seed.
    state: ParamStore,
    opt_state: HashMap<u64, Vec<Tensor>>,
    step_var: Tensor,
    lr_var: Tensor,
    key_var: Tensor,
    one_var: Vec<Tensor>,
    lr: f64,
    lr_uploaded: Option<f64>,
    programs: Vec<TrainProgram<B>>,
    by_signature: foldhash::HashMap<Vec<TensorType>, usize>,
    by_fingerprint: HashMap<Fingerprint, usize>,
    /// Trace every time: each signature's latest trace and its program, checked before the
    /// fingerprint.
    latest: LatestTraces<usize>,
    /// The last step's program and its per-step device values (the loss among them).
    last: Option<(usize, Vec<Option<B::Buffer>>)>,
    steps: u64,
    /// The compute dtype of mixed-precision training (`None`: the model's own dtypes).
    mixed: Option<DType>,
    scaler: Option<Scaler>,
}

/// Dropping a step waits for its last step's device work (see [`TrainStep::synchronize`]):
/// the values it produced, then (the runtime's own drop) the variables it updated.
impl<B: Backend> Drop for TrainStep<B> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_for_last_values() {
            log::warn!("dropping a training step: waiting for its values failed: {e}");
        }
    }
}

impl<B: Backend> TrainStep<B> {
    /// A training step for the trainable parameters of `store`, minimising the scalar returned
    /// by `loss_fn` (which runs the model in training mode on the batch it is given).
    ///
    /// The step updates the parameters of `store` that the loss reads. Parameters of other
    /// stores the loss reads are constants to it (like a PyTorch optimizer built over one
    /// model's parameters); buffers the loss assigns (BatchNorm statistics) are updated
    /// whatever their store.
    pub fn new<O, F>(backend: B, store: &ParamStore, opt: O, loss_fn: F) -> Result<Self>
    where
        O: Optimizer + 'static,
        F: Fn(&[Tensor]) -> Result<Tensor> + Send + 'static,
    {
        let state = ParamStore::new();
        let root = state.root();
        // Float64, so that the step count is exact far beyond 2^24 steps and a float64 model
        // trains with exactly the learning rate asked for; graphs convert to the parameters'
        // dtype.
        let step_var = root.buffer("step", &[], Init::Const(0.0), DType::F64)?;
        let lr_var = root.buffer("lr", &[], Init::Const(0.0), DType::F64)?;
        let key_var = root.buffer("rng_key", &[2], Init::Const(0.0), DType::U32)?;
        Ok(TrainStep {
            rt: Runtime::new(backend),
            store: store.clone(),
            loss_fn: Box::new(loss_fn),
            opt: Box::new(opt),
            opt_kind: std::any::type_name::<O>(),
            mode: TrainMode::Split,
            trace_mode: TraceMode::Once,
            policy: SavePolicy::RecomputeElementwise,
            state,
            opt_state: HashMap::new(),
            step_var,
            lr_var,
            key_var,
            one_var: Vec::new(),
            lr: 1e-3,
            lr_uploaded: None,
            programs: Vec::new(),
            by_signature: Default::default(),
            by_fingerprint: HashMap::new(),
            latest: LatestTraces::new(),
            last: None,
            steps: 0,
            mixed: None,
            scaler: None,
        })
    }

    /// Mixed-precision training: matrix products and convolutions (forward and backward) run
    /// in `dtype` (`BF16` or `F16`) while the parameters, their gradients as the optimizer sees
    /// them, the optimizer state and the buffers stay `f32` and resident ("master weights").
    /// The traced loss graph is cast as PyTorch's autocast casts
    /// ([`crate::passes::autocast_graph`]): each product or convolution converts its `f32`
    /// operands (parameters among them) to `dtype` where it reads them; sums, `exp`, `log`,
    /// `log1p`, `rsqrt` and `pow` (so softmax, cross-entropy and normalisation statistics) run
    /// in `f32`; other ops follow their operands. The gradient of each conversion brings the
    /// parameters' gradients back to `f32`.
    ///
    /// For `F16` this also turns on dynamic [`LossScaling`] with PyTorch's defaults (replace
    /// them with [`TrainStep::with_loss_scaling`]); bf16 has f32's exponent range and needs
    /// none. Call before the first step.
    pub fn with_mixed_precision(mut self, dtype: DType) -> Result<Self> {
        if !dtype.is_half() {
            return Err(Error::Invalid(format!(
                "with_mixed_precision: the compute dtype must be bf16 or f16, got {dtype}"
            )));
        }
        if !self.programs.is_empty() {
            return Err(Error::Invalid(
                "with_mixed_precision must be called before the first step".into(),
            ));
        }
        self.mixed = Some(dtype);
        if dtype == DType::F16 && self.scaler.is_none() {
            self = self.with_loss_scaling(LossScaling::default())?;
        }
        Ok(self)
    }

    /// Dynamic loss scaling (see [`LossScaling`]); normally set by
    /// [`TrainStep::with_mixed_precision`] for f16, usable with any dtype. Call before the
    /// first step.
    pub fn with_loss_scaling(mut self, cfg: LossScaling) -> Result<Self> {
        if !self.programs.is_empty() {
            return Err(Error::Invalid(
                "with_loss_scaling must be called before the first step".into(),
            ));
        }
        let valid = (cfg.init_scale as f32).is_finite()
            && cfg.init_scale > 0.0
            && cfg.growth_factor.is_finite()
            && cfg.growth_factor >= 1.0
            && cfg.backoff_factor > 0.0
            && cfg.backoff_factor < 1.0
            && cfg.growth_interval > 0;
        if !valid {
            return Err(Error::Invalid(format!(
                "with_loss_scaling: {cfg:?}: need 0 < init_scale < f32::MAX, growth_factor >= 1, \
                 0 < backoff_factor < 1 and growth_interval >= 1"
            )));
        }
        let root = self.state.root().sub("loss_scaling");
        let f = DType::F32;
        let (scale, good, skipped) = match self.scaler.take() {
            Some(old) => {
                let h = HostTensor::from_slice(&[], &[cfg.init_scale as f32])?;
                old.scale.assign(&Tensor::from_host(&h)?)?;
                (old.scale, old.good, old.skipped)
            }
            None => (
                root.buffer("scale", &[], Init::Const(cfg.init_scale), f)?,
                root.buffer("good_steps", &[], Init::Const(0.0), f)?,
                root.buffer("skipped_steps", &[], Init::Const(0.0), f)?,
            ),
        };
        self.scaler = Some(Scaler {
            cfg,
            scale,
            good,
            skipped,
        });
        Ok(self)
    }

    /// The compute dtype of mixed-precision training, if on.
    pub fn mixed_precision(&self) -> Option<DType> {
        self.mixed
    }

    /// The current loss scale, if loss scaling is on (reads the device value: one sync).
    pub fn loss_scale(&self) -> Result<Option<f64>> {
        self.scaler_value(|s| &s.scale)
    }

    /// How many steps loss scaling has skipped because of inf/NaN gradients (one sync).
    pub fn skipped_steps(&self) -> Result<Option<u64>> {
        Ok(self.scaler_value(|s| &s.skipped)?.map(|v| v as u64))
    }

    fn scaler_value(&self, which: impl Fn(&Scaler) -> &Tensor) -> Result<Option<f64>> {
        let Some(sc) = &self.scaler else {
            return Ok(None);
        };
        let t = which(sc);
        // Resident after the first step; before it, the store holds the value.
        let h = match self.rt.read_var(t) {
            Ok(h) => h,
            Err(_) => t.to_host()?,
        };
        Ok(Some(h.to_f64_vec()[0]))
    }

    /// Uses `cache` for executables (e.g. an on-disk [`ExecutableCache::with_dir`], or one shared
    /// with other steps). Call before the first step.
    pub fn with_cache(mut self, cache: ExecutableCache<B>) -> Self {
        self.rt.set_cache(cache);
        self
    }

    /// Split or fused (default [`TrainMode::Split`]).
    pub fn with_mode(mut self, mode: TrainMode) -> Self {
        self.mode = mode;
        self
    }

    /// Trace once per input signature (default) or on every step.
    pub fn with_trace_mode(mut self, mode: TraceMode) -> Self {
        self.trace_mode = mode;
        self
    }

    /// What the forward graph saves for the backward graph (Split mode; default
    /// [`SavePolicy::RecomputeElementwise`]).
    ///
    /// Why recompute by default: each saved value is one more output of the forward program,
    /// which XLA's CPU compiler materialises in its own fusion, and XLA:CPU pays tens of µs per
    /// fusion; recomputed elementwise chains fuse into the backward program's consumers
    /// instead. mobilenet_v2's forward program had 709 fusions saving everything against 399
    /// computing only the loss. Split steps, 2-vCPU Xeon, batch 4, two interleaved rounds of
    /// 15 steps in one process, median ms, [`SavePolicy::SaveAll`] / recompute: mobilenet_v2
    /// 74.7 / 65.0 and 75.4 / 66.4, resnet18 83.0 / 76.1 and 76.7 / 71.3, vit 54.0 / 50.2
    /// and 53.4 / 50.5, bert 61.0 / 59.8 and 61.3 / 61.6, squeezenet1_1 22.4 / 19.4 and
    /// 20.6 / 21.4.
    pub fn with_save_policy(mut self, policy: SavePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The learning rate (changing it later never recompiles).
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }

    /// Sets the learning rate for the following steps (no recompilation).
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// The learning rate of the following steps.
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Seeds the random-number key (dropout masks).
    pub fn with_seed(self, seed: u32) -> Result<Self> {
        let key = HostTensor::from_slice(&[2], &[seed, 0u32])?;
        self.key_var.assign(&Tensor::from_host(&key)?)?;
        Ok(self)
    }

    /// The mode.
    pub fn mode(&self) -> TrainMode {
        self.mode
    }

    /// The store whose trainable parameters this step trains.
    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// Executables run per step (3 split, 1 fused), once compiled.
    pub fn executables_per_step(&self) -> Option<usize> {
        self.last
            .as_ref()
            .map(|(p, _)| self.programs[*p].plan.steps.len())
    }

    /// Steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// A snapshot of the runtime counters.
    pub fn stats(&self) -> Stats {
        self.rt.stats()
    }

    /// The runtime.
    pub fn runtime(&self) -> &Runtime<B> {
        &self.rt
    }

    /// Runs one step and returns the loss (one device→host sync).
    pub fn step(&mut self, inputs: &[Tensor]) -> Result<f64> {
        self.step_async(inputs)?;
        self.last_loss()
    }

    /// Runs one step without waiting for it.
    pub fn step_async(&mut self, inputs: &[Tensor]) -> Result<()> {
        // On a data-parallel backend each replica's program sees its shard of every input.
        let signature: Vec<TensorType> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.rt.replica_type(i, t.ty()))
            .collect::<Result<_>>()?;
        let program = self.program(&signature)?;
        if self.lr_uploaded != Some(self.lr) {
            let lr = HostTensor::from_slice(&[], &[self.lr])?;
            self.rt.set_var(&self.lr_var, &lr)?;
            self.lr_uploaded = Some(self.lr);
        }
        let data: Vec<B::Buffer> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.rt.upload_batch(i, t, false))
            .collect::<Result<_>>()?;
        // The previous step's values are no longer needed: free them before this step runs.
        self.last = None;
        let temps = self.rt.run_plan(&self.programs[program].plan, &data)?.temps;
        self.steps += 1;
        self.last = Some((program, temps));
        Ok(())
    }

    /// The loss of the last step (waits for it: one sync).
    pub fn last_loss(&self) -> Result<f64> {
        let (p, temps) = self
            .last
            .as_ref()
            .ok_or_else(|| Error::Invalid("no step has run yet".into()))?;
        let buf = temps[self.programs[*p].loss_temp]
            .as_ref()
            .ok_or_else(|| Error::Internal("the step did not compute its loss".into()))?;
        let h = self.rt.download(buf)?;
        Ok(h.to_f64_vec()[0])
    }

    /// Waits until all device work of the last step is done: every value it produced (the
    /// loss and the other values it kept) and every variable it updated (parameters, buffers,
    /// optimizer state, the step count). [`TrainStep::step`] only waits for the loss, which
    /// in [`TrainMode::Split`] comes out of the forward executable while the backward and
    /// optimizer executables may still run; time a step with this (one sync point).
    pub fn synchronize(&self) -> Result<()> {
        self.wait_for_last_values()?;
        self.rt.synchronize()
    }

    /// Waits for the values the last step produced (not the variables it updated).
    fn wait_for_last_values(&self) -> Result<()> {
        match &self.last {
            Some((_, temps)) => self.rt.wait_for(temps.iter().flatten()),
            None => Ok(()),
        }
    }

    /// Every stage of each program a step on `inputs` (their dtypes and shapes) runs, in
    /// order: `forward`, `backward`, `optimizer` ([`TrainMode::Split`]) or `fused`. Traces,
    /// differentiates and compiles if this signature has not been yet; runs nothing. See
    /// [`crate::inspect`].
    pub fn inspect(&mut self, inputs: &[Tensor]) -> Result<Vec<crate::inspect::Inspection>> {
        let signature: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
        let p = self.program(&signature)?;
        let backend = self.rt.backend();
        Ok(self.programs[p]
            .plan
            .steps
            .iter()
            .map(|s| {
                crate::inspect::Inspection::new(backend, s.name, &s.graph, s.fingerprint, &s.exe)
            })
            .collect())
    }

    /// Copies parameters, buffers and optimizer state updated on the device back to their
    /// stores.
    pub fn sync_to_store(&mut self) -> Result<()> {
        self.rt.sync_to_store()
    }

    /// The optimizer state tensors of parameter `param` (after [`TrainStep::sync_to_store`]).
    pub fn optimizer_state(&self, param: &Tensor) -> Option<&[Tensor]> {
        let id = param.variable()?.id;
        self.opt_state.get(&id).map(|v| v.as_slice())
    }

    /// The program for `signature` (an index into `programs`): prepared before, or traced,
    /// differentiated and compiled now.
    fn program(&mut self, signature: &[TensorType]) -> Result<usize> {
        if self.trace_mode == TraceMode::Once {
            if let Some(&p) = self.by_signature.get(signature) {
                return Ok(p);
            }
        }
        let t0 = Instant::now();
        let every = self.trace_mode == TraceMode::EveryCall;
        let loss_fn = &self.loss_fn;
        let loss = |xs: &[Tensor]| Ok(vec![loss_fn(xs)?]);
        let traced = if every {
            match self.latest.trace(signature, loss)? {
                // The common case: the same program as this signature's latest trace.
                Retrace::Repeat(p) => {
                    self.rt.metrics().traced(t0.elapsed());
                    return Ok(p);
                }
                Retrace::New(traced) => traced,
            }
        } else {
            trace(signature, loss)?
        };
        let loss_ty = traced.graph.node(traced.graph.outputs()[0]).ty.clone();
        if loss_ty.shape.rank() != 0 || !loss_ty.dtype.is_float() {
            return Err(Error::Invalid(format!(
                "the loss function must return a float scalar, got {loss_ty}"
            )));
        }
        // Key: the raw traced graph plus which variables it reads, so trace-every-time can
        // reuse a prepared program. (The raw graph, not a simplified copy: simplifying bert's
        // training graph took 6 ms a call, and the same code traces the same raw graph.)
        let mut h = blake3::Hasher::new();
        h.update(&traced.graph.fingerprint().0);
        for b in &traced.bindings {
            if let Binding::Var(t) = b {
                h.update(&t.variable().map(|v| v.id).unwrap_or(0).to_le_bytes());
            }
        }
        for (var, _) in &traced.state_updates {
            h.update(&var.variable().map(|v| v.id).unwrap_or(0).to_le_bytes());
        }
        h.update(&[self.mode as u8]);
        h.update(format!("{:?}", self.mixed).as_bytes());
        h.update(format!("{:?}", self.scaler.as_ref().map(|s| s.cfg)).as_bytes());
        let fp = Fingerprint(*h.finalize().as_bytes());
        self.rt.metrics().traced(t0.elapsed());
        if let Some(&p) = self.by_fingerprint.get(&fp) {
            self.by_signature.insert(signature.to_vec(), p);
            if every {
                self.latest.insert(signature, traced, p);
            }
            return Ok(p);
        }
        let latest = every.then(|| traced.clone());
        let program = self.build(traced)?;
        self.programs.push(program);
        let p = self.programs.len() - 1;
        self.by_fingerprint.insert(fp, p);
        self.by_signature.insert(signature.to_vec(), p);
        if let Some(traced) = latest {
            self.latest.insert(signature, traced, p);
        }
        Ok(p)
    }

    /// Optimizer state variables for a parameter, created on first use (zeros).
    fn state_for(&mut self, param: &Tensor) -> Result<Vec<Tensor>> {
        let info = param
            .variable()
            .cloned()
            .ok_or_else(|| Error::Internal("a trained parameter is not a variable".into()))?;
        if let Some(s) = self.opt_state.get(&info.id) {
            return Ok(s.clone());
        }
        let root = self.state.root().sub("opt");
        let mut v = Vec::new();
        for (name, ty) in self.opt.state_shapes(param.ty()) {
            v.push(root.sub(&info.name).buffer(
                name,
                ty.shape.dims(),
                Init::Const(0.0),
                ty.dtype,
            )?);
        }
        self.opt_state.insert(info.id, v.clone());
        Ok(v)
    }

    /// The cotangent seed `1` of the loss, of the loss's dtype.
    fn one(&mut self, dtype: DType) -> Result<Tensor> {
        if let Some(o) = self.one_var.iter().find(|o| o.dtype() == dtype) {
            return Ok(o.clone());
        }
        let o = self.state.root().buffer(
            &format!("loss_seed_{dtype}"),
            &[],
            Init::Const(1.0),
            dtype,
        )?;
        self.one_var.push(o.clone());
        Ok(o)
    }

    /// Differentiates a traced loss and compiles its stages.
    ///
    /// The traced graph's outputs are the loss and then the new values of the variables the
    /// loss function assigned (`state_updates`). Fused: one step computes all of them, the
    /// gradients and the optimizer update. Split: the forward step computes them plus the
    /// values saved for the backward step, which computes the gradients the optimizer step
    /// consumes.
    fn build(&mut self, traced: Traced) -> Result<TrainProgram<B>> {
        let loss = self.differentiate(traced)?;
        let mut plan = PlanBuilder::new();
        let loss_temp = plan.temp();
        match self.mode {
            TrainMode::Fused => self.fused(loss, &mut plan, loss_temp)?,
            TrainMode::Split => self.split(loss, &mut plan, loss_temp)?,
        }
        Ok(TrainProgram {
            plan: plan.finish()?,
            loss_temp,
        })
    }

    /// The joint graph of a traced loss, with what its inputs and outputs are bound to.
    fn differentiate(&mut self, traced: Traced) -> Result<Differentiated> {
        let Traced {
            graph,
            bindings,
            num_outputs,
            state_updates,
        } = traced;
        if num_outputs != 1 || graph.outputs().len() != 1 + state_updates.len() {
            return Err(Error::Internal(format!(
                "a traced loss has {num_outputs} outputs and {} state updates in {} graph outputs",
                state_updates.len(),
                graph.outputs().len()
            )));
        }
        let key_var = self.rt.register(&self.key_var)?;
        let args: Vec<Arg> = bindings
            .iter()
            .map(|b| {
                Ok(match b {
                    Binding::Data(i) => Arg::Data(*i),
                    Binding::Var(t) => Arg::Var(self.rt.register(t)?),
                    Binding::RngKey => Arg::Var(key_var),
                })
            })
            .collect::<Result<_>>()?;
        // The parameters trained: those of the step's store that the loss reads.
        let trainable: HashSet<u64> = self
            .store
            .trainable()
            .iter()
            .filter_map(|t| t.variable().map(|v| v.id))
            .collect();
        let params: Vec<(usize, Tensor)> = bindings
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match b {
                Binding::Var(t) if t.variable().is_some_and(|v| trainable.contains(&v.id)) => {
                    Some((i, t.clone()))
                }
                _ => None,
            })
            .collect();
        if params.is_empty() {
            return Err(Error::Invalid(
                "the loss does not depend on any trainable parameter of the step's store".into(),
            ));
        }
        // Variables the loss function assigns; a trained parameter is the optimizer's alone.
        let mut updates: Vec<VarId> = Vec::with_capacity(state_updates.len());
        for (var, _) in &state_updates {
            let id = self.rt.register(var)?;
            if trainable.contains(&id) {
                return Err(Error::Invalid(format!(
                    "the loss function assigns {var:?}, a parameter the optimizer updates"
                )));
            }
            updates.push(id);
        }
        let wrt: Vec<usize> = params.iter().map(|p| p.0).collect();
        let graph = match self.mixed {
            Some(dt) => autocast_graph(&graph, DType::F32, dt)?,
            None => graph,
        };
        Ok(Differentiated {
            joint: joint(&graph, 0, &wrt)?,
            num_inputs: graph.inputs().len(),
            loss_dtype: graph.node(graph.outputs()[0]).ty.dtype,
            rng_input: bindings.iter().position(|b| matches!(b, Binding::RngKey)),
            key_var,
            args,
            params,
            updates,
        })
    }

    /// One step: forward, backward and update.
    fn fused(
        &mut self,
        d: Differentiated,
        plan: &mut PlanBuilder<B>,
        loss_temp: usize,
    ) -> Result<()> {
        let n_in = d.num_inputs;
        let mut g = d.joint;
        let mut args = d.args;
        let scale_var = match &self.scaler {
            Some(sc) => Some(self.rt.register(&sc.scale)?),
            None => None,
        };
        match scale_var {
            // The cotangent of the loss is the loss scale, a resident variable.
            Some(v) if d.loss_dtype == DType::F32 => args.push(Arg::Var(v)),
            Some(_) => {
                return Err(Error::Invalid(format!(
                    "loss scaling needs an f32 loss, got {}",
                    d.loss_dtype
                )))
            }
            None => {
                // The cotangent of the loss is 1: a constant, not an input.
                let cot = g.inputs()[n_in].node;
                let one = g.add(Op::Constant(Literal::scalar(d.loss_dtype, 1.0)), &[])?;
                g.replace_uses(cot, one)?;
                g.retain_inputs(|i, _| i != n_in)?;
            }
        }
        // Data-parallel: the loss, the assigned variables and the gradients are averaged over
        // the replicas (an all-reduce), so every replica applies the same update.
        let n = self.rt.backend().replicas();
        let outs: Vec<NodeId> = g
            .outputs()
            .to_vec()
            .into_iter()
            .map(|o| replica_mean(&mut g, o, n))
            .collect::<Result<_>>()?;
        let mut s = StepBuilder::new("fused", g, args)?;
        let scale_node = scale_var.map(|_| s.input_node(n_in));
        s.output(outs[0], Dest::Temp(loss_temp));
        for (k, &var) in d.updates.iter().enumerate() {
            s.update(outs[1 + k], var)?;
        }
        let grads = &outs[1 + d.updates.len()..];
        let mut params = Vec::with_capacity(d.params.len());
        for ((i, t), &grad) in d.params.iter().zip(grads) {
            let input = s.input_node(*i);
            let read = ordered_read(s.graph(), input, grad, t.ty().shape.numel())?;
            params.push(UpdatedParam {
                input,
                read,
                tensor: t.clone(),
                read_elsewhere: true,
            });
        }
        self.add_updates(&mut s, &params, grads, scale_node)?;
        if let Some(ri) = d.rng_input {
            advance_key(&mut s, ri, d.key_var)?;
        }
        plan.push(s.finish(&self.rt)?);
        Ok(())
    }

    /// Three steps, as AOTAutograd partitions: forward, backward, optimizer.
    fn split(
        &mut self,
        d: Differentiated,
        plan: &mut PlanBuilder<B>,
        loss_temp: usize,
    ) -> Result<()> {
        let n_out = 1 + d.updates.len();
        let split = partition(&d.joint, d.num_inputs, n_out, self.policy)?;
        // Forward: the loss, the assigned variables' new values, the saved values.
        let replicas = self.rt.backend().replicas();
        let local_outs: Vec<NodeId> = split.forward.outputs().to_vec();
        let mut fwd = StepBuilder::new("forward", split.forward, d.args.clone())?;
        // Data-parallel: the loss and the assigned variables are averaged over the replicas;
        // the saved values stay each replica's own.
        let mut f_outs = local_outs.clone();
        for o in &mut f_outs[..n_out] {
            *o = replica_mean(fwd.graph(), *o, replicas)?;
        }
        fwd.output(f_outs[0], Dest::Temp(loss_temp));
        let mut forward_value: Vec<Arg> = vec![Arg::Temp(loss_temp)];
        for (k, &var) in d.updates.iter().enumerate() {
            fwd.update(f_outs[1 + k], var)?;
            forward_value.push(Arg::Var(var));
        }
        for &node in &f_outs[n_out..] {
            let t = plan.temp();
            fwd.output(node, Dest::Temp(t));
            forward_value.push(Arg::Temp(t));
        }
        if let Some(ri) = d.rng_input {
            advance_key(&mut fwd, ri, d.key_var)?;
        }
        // Backward: saved values, forward inputs, the cotangent -> gradients.
        let one = match &self.scaler {
            Some(sc) if d.loss_dtype == DType::F32 => sc.scale.clone(),
            Some(_) => {
                return Err(Error::Invalid(format!(
                    "loss scaling needs an f32 loss, got {}",
                    d.loss_dtype
                )))
            }
            None => self.one(d.loss_dtype)?,
        };
        let one = Arg::Var(self.rt.register(&one)?);
        let mut b_args = Vec::with_capacity(split.backward_inputs.len());
        for bi in &split.backward_inputs {
            b_args.push(match *bi {
                // The backward step differentiates this replica's loss: it reads the replica's
                // own values, not their averages.
                BackwardInput::Saved(k) if k < n_out && f_outs[k] != local_outs[k] => {
                    let t = plan.temp();
                    fwd.output(local_outs[k], Dest::Temp(t));
                    Arg::Temp(t)
                }
                BackwardInput::Saved(k) => forward_value[k],
                // A variable the forward step replaces: the backward step needs the value the
                // forward step read, so the forward step hands on a copy.
                BackwardInput::ForwardInput(i) => match d.args[i] {
                    Arg::Var(v) if fwd.updated().contains(&v) => {
                        let t = plan.temp();
                        let node = fwd.input_node(i);
                        fwd.output(node, Dest::Temp(t));
                        Arg::Temp(t)
                    }
                    a => a,
                },
                BackwardInput::Cotangent(_) => one,
            });
        }
        plan.push(fwd.finish(&self.rt)?);
        let grads: Vec<usize> = d.params.iter().map(|_| plan.temp()).collect();
        let b_outs: Vec<NodeId> = split.backward.outputs().to_vec();
        let mut bwd = StepBuilder::new("backward", split.backward, b_args)?;
        // Data-parallel: the gradients are averaged over the replicas.
        let b_outs: Vec<NodeId> = b_outs
            .into_iter()
            .map(|o| replica_mean(bwd.graph(), o, replicas))
            .collect::<Result<_>>()?;
        for (&node, &t) in b_outs.iter().zip(&grads) {
            bwd.output(node, Dest::Temp(t));
        }
        plan.push(bwd.finish(&self.rt)?);
        // Optimizer: params, grads, states, lr, step -> new params, states, step.
        let mut s = StepBuilder::new("optimizer", Graph::new(), Vec::new())?;
        let mut params = Vec::with_capacity(d.params.len());
        let mut grad_nodes = Vec::with_capacity(d.params.len());
        for ((_, t), &g) in d.params.iter().zip(&grads) {
            let id = self.rt.register(t)?;
            let ty = t.ty().clone();
            let pn = s.input(InputKind::Parameter, name_of(t), ty.clone(), Arg::Var(id));
            let gn = s.input(
                InputKind::Saved,
                format!("grad.{}", name_of(t)),
                ty,
                Arg::Temp(g),
            );
            params.push(UpdatedParam {
                input: pn,
                read: pn,
                tensor: t.clone(),
                read_elsewhere: false,
            });
            grad_nodes.push(gn);
        }
        self.add_updates(&mut s, &params, &grad_nodes, None)?;
        plan.push(s.finish(&self.rt)?);
        Ok(())
    }

    /// Adds the optimizer update of every parameter (`params`, `grads`: its gradient's node)
    /// to `s`, with the step count and learning rate as resident inputs. With loss scaling,
    /// the gradients are unscaled first and the update is skipped on inf/NaN (`scale_node`:
    /// the step's input holding the loss scale, if it has one already).
    fn add_updates(
        &mut self,
        s: &mut StepBuilder,
        params: &[UpdatedParam],
        grads: &[NodeId],
        scale_node: Option<NodeId>,
    ) -> Result<()> {
        let scalar = TensorType::scalar(DType::F64);
        let lr_id = self.rt.register(&self.lr_var)?;
        let step_id = self.rt.register(&self.step_var)?;
        let lr = s.input(InputKind::Scalar, "lr", scalar.clone(), Arg::Var(lr_id));
        let step_in = s.input(InputKind::OptimizerState, "step", scalar, Arg::Var(step_id));
        let one = s
            .graph()
            .add(Op::Constant(Literal::scalar(DType::F64, 1.0)), &[])?;
        let step = s.graph().add(Op::Binary(BinaryOp::Add), &[step_in, one])?;
        let scaled = match &self.scaler {
            Some(_) => Some(self.unscale(s, grads, scale_node)?),
            None => None,
        };
        let grads: Vec<NodeId> = match &scaled {
            Some((_, g)) => g.clone(),
            None => grads.to_vec(),
        };
        let keep = |s: &mut StepBuilder, new: NodeId, old: NodeId| -> Result<NodeId> {
            match &scaled {
                Some((ok, _)) => select_if(s.graph(), *ok, new, old),
                None => Ok(new),
            }
        };
        let step_kept = keep(s, step, step_in)?;
        s.update(step_kept, step_id)?;
        for (p, &gn) in params.iter().zip(&grads) {
            let (pn, pt) = (&p.read, &p.tensor);
            let state = self.state_for(pt)?;
            let mut state_nodes = Vec::with_capacity(state.len());
            let mut state_ids = Vec::with_capacity(state.len());
            for st in &state {
                let id = self.rt.register(st)?;
                state_nodes.push(s.input(
                    InputKind::OptimizerState,
                    name_of(st),
                    st.ty().clone(),
                    Arg::Var(id),
                ));
                state_ids.push(id);
            }
            let (new_p, new_s) = self
                .opt
                .update(s.graph(), *pn, gn, &state_nodes, lr, step)?;
            let new_p = keep(s, new_p, *pn)?;
            let var = self.rt.register(pt)?;
            if p.in_place(s.graph(), new_p) {
                s.update(new_p, var)?;
            } else {
                s.update_in_new_buffer(new_p, var)?;
            }
            for ((ns, id), &old) in new_s.into_iter().zip(state_ids).zip(&state_nodes) {
                let ns = keep(s, ns, old)?;
                s.update(ns, id)?;
            }
        }
        Ok(())
    }

    /// Loss scaling in the optimizer graph: returns `(ok, unscaled gradients)`, where `ok` is
    /// a bool scalar, true when every gradient is finite, and updates the scale, the good-step
    /// count and the skipped-step count (see [`LossScaling`]).
    fn unscale(
        &mut self,
        s: &mut StepBuilder,
        grads: &[NodeId],
        scale_node: Option<NodeId>,
    ) -> Result<(NodeId, Vec<NodeId>)> {
        let sc = self
            .scaler
            .as_ref()
            .ok_or_else(|| Error::Internal("unscale without loss scaling".into()))?;
        let cfg = sc.cfg;
        let (scale_t, good_t, skipped_t) = (sc.scale.clone(), sc.good.clone(), sc.skipped.clone());
        let f = TensorType::scalar(DType::F32);
        let scale_id = self.rt.register(&scale_t)?;
        let good_id = self.rt.register(&good_t)?;
        let skipped_id = self.rt.register(&skipped_t)?;
        let scale = match scale_node {
            Some(n) => n,
            None => s.input(
                InputKind::OptimizerState,
                "loss_scale",
                f.clone(),
                Arg::Var(scale_id),
            ),
        };
        let good = s.input(
            InputKind::OptimizerState,
            "good_steps",
            f.clone(),
            Arg::Var(good_id),
        );
        let skipped = s.input(
            InputKind::OptimizerState,
            "skipped_steps",
            f,
            Arg::Var(skipped_id),
        );
        let g = s.graph();
        let c = |g: &mut Graph, v: f64| g.add(Op::Constant(Literal::scalar(DType::F32, v)), &[]);
        let bin = |g: &mut Graph, b: BinaryOp, x: NodeId, y: NodeId| g.add(Op::Binary(b), &[x, y]);
        let one = c(g, 1.0)?;
        let inv = bin(g, BinaryOp::Div, one, scale)?;
        // Σ sum(g · 0) is 0 when every gradient is finite and NaN otherwise (inf · 0 = NaN).
        let mut bad = c(g, 0.0)?;
        let mut unscaled = Vec::with_capacity(grads.len());
        for &gn in grads {
            let ty = g.node(gn).ty.clone();
            let inv_d = if ty.dtype == DType::F32 {
                inv
            } else {
                g.add(Op::Convert(ty.dtype), &[inv])?
            };
            let inv_b = broadcast_scalar(g, inv_d, &ty)?;
            unscaled.push(bin(g, BinaryOp::Mul, gn, inv_b)?);
            let zero = g.add(Op::Constant(Literal::scalar(ty.dtype, 0.0)), &[])?;
            let zero = broadcast_scalar(g, zero, &ty)?;
            let z = bin(g, BinaryOp::Mul, gn, zero)?;
            let axes: Vec<usize> = (0..ty.shape.rank()).collect();
            let z = g.add(
                Op::Reduce {
                    kind: crate::ir::ReduceKind::Sum,
                    axes,
                },
                &[z],
            )?;
            let z = if ty.dtype == DType::F32 {
                z
            } else {
                g.add(Op::Convert(DType::F32), &[z])?
            };
            bad = bin(g, BinaryOp::Add, bad, z)?;
        }
        let zero = c(g, 0.0)?;
        let ok = g.add(Op::Compare(crate::ir::CompareOp::Eq), &[bad, zero])?;
        // Scale and counters.
        let good1 = bin(g, BinaryOp::Add, good, one)?;
        let interval = c(g, cfg.growth_interval as f64)?;
        let due = g.add(Op::Compare(crate::ir::CompareOp::Ge), &[good1, interval])?;
        let gf = c(g, cfg.growth_factor)?;
        let bf = c(g, cfg.backoff_factor)?;
        let grown = bin(g, BinaryOp::Mul, scale, gf)?;
        // Never grow to inf (with all-zero gradients nothing overflows): an infinite scale
        // would make every later step overflow and never back off.
        let max = c(g, f32::MAX as f64)?;
        let finite = g.add(Op::Compare(crate::ir::CompareOp::Le), &[grown, max])?;
        let grow = bin(g, BinaryOp::And, ok, due)?;
        let grow = bin(g, BinaryOp::And, grow, finite)?;
        let backed = bin(g, BinaryOp::Mul, scale, bf)?;
        let kept = select_if(g, grow, grown, scale)?;
        let new_scale = select_if(g, ok, kept, backed)?;
        let zero_g = c(g, 0.0)?;
        let good_next = select_if(g, grow, zero_g, good1)?;
        let new_good = select_if(g, ok, good_next, zero_g)?;
        let skipped1 = bin(g, BinaryOp::Add, skipped, one)?;
        let new_skipped = select_if(g, ok, skipped, skipped1)?;
        s.update(new_scale, scale_id)?;
        s.update(new_good, good_id)?;
        s.update(new_skipped, skipped_id)?;
        Ok((ok, unscaled))
    }
}

/// `x` (a scalar) broadcast to `ty`'s shape.
fn broadcast_scalar(g: &mut Graph, x: NodeId, ty: &TensorType) -> Result<NodeId> {
    if ty.shape.rank() == 0 {
        return Ok(x);
    }
    g.add(
        Op::Broadcast {
            shape: ty.shape.clone(),
            dims: Vec::new(),
        },
        &[x],
    )
}

/// `ok ? new : old` for a bool scalar `ok`.
fn select_if(g: &mut Graph, ok: NodeId, new: NodeId, old: NodeId) -> Result<NodeId> {
    let ty = g.node(new).ty.clone();
    let p = broadcast_scalar(g, ok, &ty.with_dtype(DType::Bool))?;
    g.add(Op::Select, &[p, new, old])
}

fn name_of(t: &Tensor) -> String {
    t.variable().map(|v| v.name.clone()).unwrap_or_default()
}

/// Adds `key' = [key[0], key[1] + 1]` as the new value of the rng key variable (`key_input`:
/// the step's input bound to it).
fn advance_key(s: &mut StepBuilder, key_input: usize, key_var: VarId) -> Result<()> {
    let key = s.input_node(key_input);
    let inc = Literal::from_bytes(
        TensorType::new(DType::U32, [2]),
        [0u32, 1u32]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )?;
    let inc = s.graph().add(Op::Constant(inc), &[])?;
    let next = s.graph().add(Op::Binary(BinaryOp::Add), &[key, inc])?;
    s.update(next, key_var)
}

/// The eager baseline of a training step: libtorch autograd and the optimizer's eager update.
pub struct EagerTrainStep {
    params: Vec<Tensor>,
    state: Vec<Vec<tch::Tensor>>,
    opt: Box<dyn Optimizer>,
    loss_fn: LossFn,
    lr: f64,
    steps: u64,
}

impl EagerTrainStep {
    /// An eager step over the trainable parameters of `store`.
    pub fn new<O, F>(store: &ParamStore, opt: O, loss_fn: F) -> Result<Self>
    where
        O: Optimizer + 'static,
        F: Fn(&[Tensor]) -> Result<Tensor> + Send + 'static,
    {
        let params = store.trainable();
        let mut state = Vec::new();
        for p in &params {
            let mut s = Vec::new();
            for (_, ty) in opt.state_shapes(p.ty()) {
                let dims = ty.shape.to_i64();
                s.push(tch::Tensor::f_zeros(
                    &dims,
                    (crate::backend::eager::kind_of(ty.dtype), tch::Device::Cpu),
                )?);
            }
            state.push(s);
        }
        Ok(EagerTrainStep {
            params,
            state,
            opt: Box::new(opt),
            loss_fn: Box::new(loss_fn),
            lr: 1e-3,
            steps: 0,
        })
    }

    /// Sets the learning rate.
    pub fn with_lr(mut self, lr: f64) -> Self {
        self.lr = lr;
        self
    }

    /// Sets the learning rate for the following steps.
    pub fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    /// One step; returns the loss.
    pub fn step(&mut self, inputs: &[Tensor]) -> Result<f64> {
        let loss = (self.loss_fn)(inputs)?;
        let l = loss.as_tch()?;
        for p in &self.params {
            let mut g = p.as_tch()?.f_grad()?;
            if g.defined() {
                let _ = g.f_zero_()?;
            }
        }
        l.f_backward()?;
        self.steps += 1;
        for (p, s) in self.params.iter().zip(self.state.iter_mut()) {
            let pt = p.as_tch()?;
            let g = pt.f_grad()?;
            let g = if g.defined() { g } else { pt.f_zeros_like()? };
            self.opt.update_eager(pt, &g, s, self.lr, self.steps)?;
        }
        Ok(l.f_double_value(&[])?)
    }
}

/// A parameter as a step's optimizer update reads it.
struct UpdatedParam {
    /// The parameter's input node.
    input: NodeId,
    /// The value the update reads: `input`, or `input` behind an ordering ([`ordered_read`]).
    read: NodeId,
    /// The parameter.
    tensor: Tensor,
    /// Whether the program reads the parameter for more than its update (the fused step's
    /// forward and backward do; the split step's optimizer program does not).
    read_elsewhere: bool,
}

impl UpdatedParam {
    /// Does the update `update` go into the parameter's donated buffer? Always where only the
    /// update reads it. Where the program reads it elsewhere too, only a parameter of at least
    /// [`IN_PLACE_MIN_ELEMENTS`] whose every read comes first ([`reads_precede`]); the others
    /// go into new buffers.
    fn in_place(&self, g: &Graph, update: NodeId) -> bool {
        !self.read_elsewhere
            || (self.tensor.ty().shape.numel() >= IN_PLACE_MIN_ELEMENTS
                && reads_precede(g, self.input, update))
    }
}

/// Below this many elements the fused step updates a parameter into a new buffer: donating
/// it saves under 256 KiB (f32), and XLA copies such values on entry even where every read
/// comes first in kiln's graph, when its fusions duplicate a reader (a bias or a norm's scale
/// read by both the loss's and the gradient's fusions; resnet50 kept 95 copies of its batch
/// norms' parameters).
const IN_PLACE_MIN_ELEMENTS: usize = 1 << 16;

/// Does every read of `input` come before `update` (is every user of `input` `update` or
/// one of its operands, transitively)? Then XLA can write `update` into `input`'s donated
/// buffer. Otherwise it copies the donated input on entry, on the step's critical path (the
/// fused step reads a weight for its input gradient, `dy · W`, which the weight's update does
/// not depend on; resnet50 had 139 such copies, 36 MB a step, all but its 22 ordered
/// weights), so the update goes into a new buffer instead: the same memory as the copy, no
/// copying; the old buffer is freed when the variable takes the new one. Fused steps,
/// alternating processes of 10 steps, median ms, new buffers / donated (2-vCPU Zen 2, two
/// pairs each): resnet50 161.1, 163.3 / 188.5, 175.8; resnext50_32x4d 185.3, 176.8 / 193.3,
/// 189.9; vit 54.5, 55.0 / 57.7, 56.0; mobilenet_v2 38.7, 38.8 / 39.9, 40.2; bert 56.0, 62.3 /
/// 57.1, 58.8 and resnet18 73.1, 77.5 / 76.9, 74.3 (level). An embedding updated by a scatter
/// (read by a gather that its gradient depends on) stays in place.
fn reads_precede(g: &Graph, input: NodeId, update: NodeId) -> bool {
    let before = g.ancestors(&[update]);
    g.users(input).iter().all(|u| before.contains(u))
}

/// Parameters of at least this many elements are read by the fused step's update after
/// the products that read them ([`ordered_read`]). Measured (2-vCPU Xeon with AVX-512, fused
/// SGD-momentum step, ms, ordered / not, interleaved in one process): alexnet 142 / 208,
/// vgg16 433 / 650, resnet18 71 / 74; vit, bert, mobilenet_v2 and squeezenet1_1 level. From
/// 2^16 elements on, vit's step was 1–4 % slower: the update of a small weight then waits
/// for its gradient products when it could run beside them.
pub(crate) const ORDERED_UPDATE_MIN_ELEMENTS: usize = 1 << 20;

/// The value the fused step's update reads for parameter `p` (gradient `grad`, `numel`
/// elements): `p` itself, or, for a large one that only convolutions and products read,
/// `p` behind an [`Op::Barrier`] on its gradient and on those products. Why: XLA updates a
/// donated parameter in place only if every other read of it comes first, and the input
/// gradient's product (`dy · W`) does not lead to the weight's update, so XLA copies the
/// weight on entry instead (resnet18: 58 parameters, 47 MB a step; vgg16: 553 MB). Reads
/// other than products (an embedding's gather) stay unordered, and so does the copy.
fn ordered_read(g: &mut Graph, p: NodeId, grad: NodeId, numel: usize) -> Result<NodeId> {
    if numel < ORDERED_UPDATE_MIN_ELEMENTS {
        return Ok(p);
    }
    match products_reading(g, p) {
        Some(products) => {
            let mut deps = vec![p, grad];
            deps.extend(products.into_iter().filter(|&r| r != grad));
            g.add(Op::Barrier, &deps)
        }
        None => Ok(p),
    }
}

/// The convolutions and products that read `p`, directly or through layout ops (transpose,
/// reshape, reverse, convert); `None` if anything else reads it.
fn products_reading(g: &Graph, p: NodeId) -> Option<Vec<NodeId>> {
    let mut out = Vec::new();
    let mut stack = vec![p];
    let mut seen = HashSet::new();
    while let Some(n) = stack.pop() {
        for u in g.users(n) {
            if !seen.insert(u) {
                continue;
            }
            match g.node(u).op {
                Op::Conv(_) | Op::DotGeneral(_) => out.push(u),
                Op::Transpose(_) | Op::Reshape(_) | Op::Reverse(_) | Op::Convert(_) => {
                    stack.push(u)
                }
                _ => return None,
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_precede_the_update_only_when_the_update_depends_on_every_read() -> Result<()> {
        let t = TensorType::new(DType::F32, vec![4]);
        let mut g = Graph::new();
        let p = g.add_input(InputKind::Parameter, "p", t.clone());
        let x = g.add_input(InputKind::Data, "x", t);
        // The forward reads p; the gradient depends on that read; the update reads p again.
        let y = g.add(Op::Binary(BinaryOp::Mul), &[p, x])?;
        let grad = g.add(Op::Binary(BinaryOp::Mul), &[y, x])?;
        let update = g.add(Op::Binary(BinaryOp::Sub), &[p, grad])?;
        assert!(reads_precede(&g, p, update));
        // A read the update does not depend on (an input gradient `dy · W`).
        let dx = g.add(Op::Binary(BinaryOp::Mul), &[p, grad])?;
        assert!(!reads_precede(&g, p, update));
        // Once the update depends on it, it comes first again.
        let ordered = g.add(Op::Binary(BinaryOp::Add), &[update, dx])?;
        assert!(reads_precede(&g, p, ordered));
        Ok(())
    }
}
