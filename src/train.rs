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
//! transfers only the batch to the device and, when asked, the loss back.

use crate::autograd::{joint, partition, BackwardInput, SavePolicy};
use crate::backend::{Backend, HostTensor};
use crate::compile::TraceMode;
use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, DType, Fingerprint, Graph, InputKind, Literal, NodeId, Op, Shape, TensorType,
};
use crate::nn::{Init, ParamStore};
use crate::optim::Optimizer;
use crate::passes::{dedup_outputs, simplify, OutputSource};
use crate::runtime::{ExecutableCache, Runtime, Stats};
use crate::trace::{trace, var_input, Binding, Tensor, VarKind};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

/// How a training step is split into executables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrainMode {
    /// Three executables per step: forward (loss + saved activations), backward (gradients),
    /// optimizer (parameter and state updates), as AOTAutograd produces them.
    Split,
    /// One executable per step: forward, backward and update fused (XLA prefers one big graph).
    Fused,
}

/// Where a stage input comes from / a stage output goes.
#[derive(Clone, Debug)]
enum Slot {
    /// The caller's `i`-th batch tensor (uploaded once per step).
    Data(usize),
    /// A resident variable (parameter, buffer, optimizer state, step, lr, rng key, constant).
    Var(Tensor),
    /// A per-step device value passed between stages (loss, saved activations, gradients).
    Temp(usize),
}

struct Stage<B: Backend> {
    name: &'static str,
    exe: Arc<B::Executable>,
    inputs: Vec<Slot>,
    /// For each output of the (pre-dedup) stage graph: where the executable delivers it, and
    /// the slot it fills.
    outputs: Vec<(OutputSource, Slot)>,
}

struct TrainProgram<B: Backend> {
    stages: Vec<Stage<B>>,
    num_temps: usize,
    loss_temp: usize,
}

type LossFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor>>;
type Temps<B> = Vec<Option<Rc<<B as Backend>::Buffer>>>;

/// A compiled training step; see the module docs.
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
    loss_fn: LossFn,
    opt: Box<dyn Optimizer>,
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
    by_signature: HashMap<Vec<TensorType>, Rc<TrainProgram<B>>>,
    by_fingerprint: HashMap<Fingerprint, Rc<TrainProgram<B>>>,
    /// The last step's program and its per-step device values (the loss among them).
    last: Option<(Rc<TrainProgram<B>>, Temps<B>)>,
    steps: u64,
}

impl<B: Backend> TrainStep<B> {
    /// A training step for the trainable parameters of `store`, minimising the scalar returned
    /// by `loss_fn` (which runs the model in training mode on the batch it is given).
    pub fn new<O, F>(backend: B, store: &ParamStore, opt: O, loss_fn: F) -> Result<Self>
    where
        O: Optimizer + 'static,
        F: Fn(&[Tensor]) -> Result<Tensor> + 'static,
    {
        let _ = store;
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
            loss_fn: Box::new(loss_fn),
            opt: Box::new(opt),
            mode: TrainMode::Split,
            trace_mode: TraceMode::Once,
            policy: SavePolicy::SaveAll,
            state,
            opt_state: HashMap::new(),
            step_var,
            lr_var,
            key_var,
            one_var: Vec::new(),
            lr: 1e-3,
            lr_uploaded: None,
            by_signature: HashMap::new(),
            by_fingerprint: HashMap::new(),
            last: None,
            steps: 0,
        })
    }

    /// Uses `cache` for executables (e.g. an on-disk [`ExecutableCache::with_dir`], or one shared
    /// with other steps). Call before the first step.
    pub fn with_cache(mut self, cache: ExecutableCache<B>) -> Self {
        self.rt = Runtime::with_cache(self.rt.into_backend(), cache);
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

    /// What the forward graph saves for the backward graph (Split mode).
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

    /// Executables run per step (3 split, 1 fused), once compiled.
    pub fn executables_per_step(&self) -> Option<usize> {
        self.last.as_ref().map(|(p, _)| p.stages.len())
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
        let signature: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
        let program = self.program(&signature)?;
        if self.lr_uploaded != Some(self.lr) {
            let lr = HostTensor::from_slice(&[], &[self.lr])?;
            self.rt.set_var(&self.lr_var, &lr)?;
            self.lr_uploaded = Some(self.lr);
        }
        let data: Vec<B::Buffer> = inputs
            .iter()
            .map(|t| self.rt.upload_tensor(t))
            .collect::<Result<_>>()?;
        let mut temps: Vec<Option<Rc<B::Buffer>>> = vec![None; program.num_temps];
        for stage in &program.stages {
            self.run_stage(stage, &data, &mut temps)?;
        }
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
        let buf = temps[p.loss_temp]
            .as_ref()
            .ok_or_else(|| Error::Invalid("internal: loss not computed".into()))?;
        let h = self.rt.download(buf)?;
        Ok(h.to_f64_vec()[0])
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

    fn run_stage(
        &mut self,
        stage: &Stage<B>,
        data: &[B::Buffer],
        temps: &mut [Option<Rc<B::Buffer>>],
    ) -> Result<()> {
        for s in &stage.inputs {
            if let Slot::Var(v) = s {
                self.rt.ensure_var(v)?;
            }
        }
        let outs = {
            let mut args: Vec<&B::Buffer> = Vec::with_capacity(stage.inputs.len());
            for s in &stage.inputs {
                args.push(match s {
                    Slot::Data(i) => &data[*i],
                    Slot::Var(v) => self.rt.var_buffer(v)?,
                    Slot::Temp(k) => temps[*k].as_deref().ok_or_else(|| {
                        Error::Invalid(format!("internal: {} reads an unset value", stage.name))
                    })?,
                });
            }
            self.rt.execute(&stage.exe, &args)?
        };
        let mut outs: Vec<Option<B::Buffer>> = outs.into_iter().map(Some).collect();
        let mut shared: Vec<Option<Rc<B::Buffer>>> = vec![None; outs.len()];
        for (src, slot) in &stage.outputs {
            match (*src, slot) {
                (OutputSource::Output(j), Slot::Temp(k)) => {
                    if shared[j].is_none() {
                        shared[j] = outs[j].take().map(Rc::new);
                    }
                    temps[*k] = shared[j].clone();
                }
                (OutputSource::Output(j), Slot::Var(v)) => {
                    let buf = match outs[j].take() {
                        Some(b) => b,
                        None => {
                            // The same value also fills another slot: give this one a copy.
                            let b = shared[j]
                                .as_deref()
                                .map(|b| self.rt.download(b))
                                .transpose()?;
                            match b {
                                Some(h) => self.rt.upload(&h)?,
                                None => {
                                    return Err(Error::Invalid(
                                        "internal: output taken twice".into(),
                                    ))
                                }
                            }
                        }
                    };
                    self.rt.replace_var(v, buf)?;
                }
                (OutputSource::Input(i), Slot::Temp(k)) => {
                    temps[*k] = match &stage.inputs[i] {
                        Slot::Temp(k2) => temps[*k2].clone(),
                        Slot::Data(d) => {
                            let h = self.rt.download(&data[*d])?;
                            Some(Rc::new(self.rt.upload(&h)?))
                        }
                        Slot::Var(v) => {
                            let h = self.rt.download(self.rt.var_buffer(v)?)?;
                            Some(Rc::new(self.rt.upload(&h)?))
                        }
                    };
                }
                // A variable "updated" to its own value: nothing to do.
                (OutputSource::Input(_), Slot::Var(_)) => {}
                (_, Slot::Data(_)) => {
                    return Err(Error::Invalid("internal: output to a data slot".into()))
                }
            }
        }
        Ok(())
    }

    fn program(&mut self, signature: &[TensorType]) -> Result<Rc<TrainProgram<B>>> {
        if self.trace_mode == TraceMode::Once {
            if let Some(p) = self.by_signature.get(signature) {
                return Ok(p.clone());
            }
        }
        let t0 = Instant::now();
        let traced = trace(signature, |xs| Ok(vec![(self.loss_fn)(xs)?]))?;
        let loss_ty = traced.graph.node(traced.graph.outputs()[0]).ty.clone();
        if loss_ty.shape.rank() != 0 || !loss_ty.dtype.is_float() {
            return Err(Error::Invalid(format!(
                "the loss function must return a float scalar, got {loss_ty}"
            )));
        }
        // Key: the traced graph plus which variables it reads, so trace-every-time can reuse a
        // prepared program.
        let mut key_graph = traced.graph.clone();
        simplify(&mut key_graph)?;
        let mut h = blake3::Hasher::new();
        h.update(&key_graph.fingerprint().0);
        for b in &traced.bindings {
            if let Binding::Var(t) = b {
                h.update(&t.variable().map(|v| v.id).unwrap_or(0).to_le_bytes());
            }
        }
        h.update(&[self.mode as u8]);
        let fp = Fingerprint(*h.finalize().as_bytes());
        self.rt.metrics().traced(t0.elapsed());
        if let Some(p) = self.by_fingerprint.get(&fp) {
            let p = p.clone();
            self.by_signature.insert(signature.to_vec(), p.clone());
            return Ok(p);
        }
        let program = Rc::new(self.build(traced)?);
        self.by_fingerprint.insert(fp, program.clone());
        self.by_signature
            .insert(signature.to_vec(), program.clone());
        Ok(program)
    }

    /// Optimizer state variables for a parameter, created on first use (zeros).
    fn state_for(&mut self, param: &Tensor) -> Result<Vec<Tensor>> {
        let info = param
            .variable()
            .cloned()
            .ok_or_else(|| Error::Invalid("internal: parameter without variable".into()))?;
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

    fn build(&mut self, traced: crate::trace::Traced) -> Result<TrainProgram<B>> {
        let crate::trace::Traced {
            graph,
            bindings,
            num_outputs,
            state_updates,
        } = traced;
        let loss_dtype = graph.node(graph.outputs()[0]).ty.dtype;
        let n_in = graph.inputs().len();
        let n_out = graph.outputs().len();
        let _ = num_outputs;
        // Input slots of the traced graph.
        let in_slots: Vec<Slot> = bindings
            .iter()
            .map(|b| match b {
                Binding::Data(i) => Slot::Data(*i),
                Binding::Var(t) => Slot::Var(t.clone()),
                Binding::RngKey => Slot::Var(self.key_var.clone()),
            })
            .collect();
        let params: Vec<(usize, Tensor)> = bindings
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match b {
                Binding::Var(t) if t.variable().map(|v| v.kind) == Some(VarKind::Parameter) => {
                    Some((i, t.clone()))
                }
                _ => None,
            })
            .collect();
        if params.is_empty() {
            return Err(Error::Invalid(
                "the loss does not depend on any trainable parameter".into(),
            ));
        }
        let wrt: Vec<usize> = params.iter().map(|p| p.0).collect();
        let joint_graph = joint(&graph, 0, &wrt)?;
        // Output slots of the traced graph: loss, then variable updates.
        let mut temps = 0usize;
        let mut new_temp = || {
            temps += 1;
            temps - 1
        };
        let loss_temp = new_temp();
        let mut out_slots: Vec<Slot> = vec![Slot::Temp(loss_temp)];
        for (var, _) in &state_updates {
            out_slots.push(Slot::Var(var.clone()));
        }
        debug_assert_eq!(out_slots.len(), n_out);
        let rng_input = bindings.iter().position(|b| matches!(b, Binding::RngKey));
        let mut stages = Vec::new();
        match self.mode {
            TrainMode::Fused => {
                let mut g = joint_graph;
                // The cotangent of the loss is 1: a constant, not an input.
                let cot = g.inputs()[n_in].node;
                let one = g.add(Op::Constant(Literal::scalar(loss_dtype, 1.0)), &[])?;
                g.replace_uses(cot, one)?;
                g.retain_inputs(|i, _| i != n_in)?;
                let grads: Vec<NodeId> = g.outputs()[n_out..].to_vec();
                let mut outputs: Vec<NodeId> = g.outputs()[..n_out].to_vec();
                let mut inputs = in_slots.clone();
                let mut slots = out_slots.clone();
                let mut aliases = Vec::new();
                for (k, (var, _)) in state_updates.iter().enumerate() {
                    if let Some(i) = var_input(&bindings, var) {
                        aliases.push((i, 1 + k));
                    }
                }
                let param_nodes: Vec<(NodeId, Tensor)> = params
                    .iter()
                    .map(|(i, t)| (g.inputs()[*i].node, t.clone()))
                    .collect();
                self.add_updates(
                    &mut g,
                    &param_nodes,
                    &grads,
                    &mut inputs,
                    &mut outputs,
                    &mut slots,
                    &mut aliases,
                )?;
                if let Some(ri) = rng_input {
                    advance_key(
                        &mut g,
                        ri,
                        &mut outputs,
                        &mut slots,
                        &mut aliases,
                        &self.key_var,
                    )?;
                }
                stages.push(self.stage("fused", g, inputs, outputs, slots, aliases)?);
            }
            TrainMode::Split => {
                let split = partition(&joint_graph, n_in, n_out, self.policy)?;
                // Forward: original outputs, then saved values.
                let mut fwd = split.forward;
                let mut f_outputs: Vec<NodeId> = fwd.outputs().to_vec();
                let mut f_slots = out_slots.clone();
                let saved_base = temps;
                for _ in 0..split.num_saved {
                    f_slots.push(Slot::Temp(saved_base + f_slots.len() - out_slots.len()));
                }
                temps += split.num_saved;
                // Inputs the backward graph reads directly must survive the forward stage:
                // never donate them there.
                let kept_alive: Vec<usize> = split
                    .backward_inputs
                    .iter()
                    .filter_map(|b| match b {
                        BackwardInput::ForwardInput(i) => Some(*i),
                        _ => None,
                    })
                    .collect();
                let mut f_aliases = Vec::new();
                for (k, (var, _)) in state_updates.iter().enumerate() {
                    if let Some(i) = var_input(&bindings, var).filter(|i| !kept_alive.contains(i)) {
                        f_aliases.push((i, 1 + k));
                    }
                }
                if let Some(ri) = rng_input.filter(|i| !kept_alive.contains(i)) {
                    advance_key(
                        &mut fwd,
                        ri,
                        &mut f_outputs,
                        &mut f_slots,
                        &mut f_aliases,
                        &self.key_var,
                    )?;
                } else if let Some(ri) = rng_input {
                    let mut no_alias = Vec::new();
                    advance_key(
                        &mut fwd,
                        ri,
                        &mut f_outputs,
                        &mut f_slots,
                        &mut no_alias,
                        &self.key_var,
                    )?;
                }
                let forward_slots = f_slots.clone();
                stages.push(self.stage(
                    "forward",
                    fwd,
                    in_slots.clone(),
                    f_outputs,
                    f_slots,
                    f_aliases,
                )?);
                // Backward: saved values, forward inputs, the cotangent -> gradients.
                let one = self.one(loss_dtype)?;
                let b_inputs: Vec<Slot> = split
                    .backward_inputs
                    .iter()
                    .map(|bi| match bi {
                        // An index into all forward outputs (user outputs, then saved values).
                        BackwardInput::Saved(k) => forward_slots[*k].clone(),
                        BackwardInput::ForwardInput(i) => in_slots[*i].clone(),
                        BackwardInput::Cotangent(_) => Slot::Var(one.clone()),
                    })
                    .collect();
                let grad_base = temps;
                temps += params.len();
                let b_outputs = split.backward.outputs().to_vec();
                let b_slots: Vec<Slot> = (0..params.len())
                    .map(|p| Slot::Temp(grad_base + p))
                    .collect();
                stages.push(self.stage(
                    "backward",
                    split.backward,
                    b_inputs,
                    b_outputs,
                    b_slots,
                    vec![],
                )?);
                // Optimizer: params, grads, states, lr, step -> new params, states, step.
                let mut g = Graph::new();
                let mut inputs = Vec::new();
                let mut grads = Vec::new();
                let mut opt_params = Vec::new();
                for (p, (_, t)) in params.iter().enumerate() {
                    let n = g.add_input(InputKind::Parameter, name_of(t), t.ty().clone());
                    inputs.push(Slot::Var(t.clone()));
                    opt_params.push((n, t.clone()));
                    let gn = g.add_input(
                        InputKind::Saved,
                        format!("grad.{}", name_of(t)),
                        t.ty().clone(),
                    );
                    inputs.push(Slot::Temp(grad_base + p));
                    grads.push(gn);
                }
                let mut outputs = Vec::new();
                let mut slots = Vec::new();
                let mut aliases = Vec::new();
                self.add_updates(
                    &mut g,
                    &opt_params,
                    &grads,
                    &mut inputs,
                    &mut outputs,
                    &mut slots,
                    &mut aliases,
                )?;
                stages.push(self.stage("optimizer", g, inputs, outputs, slots, aliases)?);
            }
        }
        Ok(TrainProgram {
            stages,
            num_temps: temps,
            loss_temp,
        })
    }

    /// Adds the optimizer update of every parameter (`params`: its node in `g` and its
    /// variable) to `g`, with the step count and learning rate as resident inputs.
    #[allow(clippy::too_many_arguments)]
    fn add_updates(
        &mut self,
        g: &mut Graph,
        params: &[(NodeId, Tensor)],
        grads: &[NodeId],
        inputs: &mut Vec<Slot>,
        outputs: &mut Vec<NodeId>,
        slots: &mut Vec<Slot>,
        aliases: &mut Vec<(usize, usize)>,
    ) -> Result<()> {
        let scalar = TensorType::scalar(DType::F64);
        let lr = g.add_input(InputKind::Scalar, "lr", scalar.clone());
        inputs.push(Slot::Var(self.lr_var.clone()));
        let step_in = g.add_input(InputKind::OptimizerState, "step", scalar);
        let step_idx = inputs.len();
        inputs.push(Slot::Var(self.step_var.clone()));
        let one = g.add(Op::Constant(Literal::scalar(DType::F64, 1.0)), &[])?;
        let step = g.add(Op::Binary(BinaryOp::Add), &[step_in, one])?;
        aliases.push((step_idx, outputs.len()));
        outputs.push(step);
        slots.push(Slot::Var(self.step_var.clone()));
        for ((pn, pt), &gn) in params.iter().zip(grads) {
            let state = self.state_for(pt)?;
            let mut state_nodes = Vec::new();
            let mut state_idx = Vec::new();
            for s in &state {
                state_idx.push(inputs.len());
                state_nodes.push(g.add_input(
                    InputKind::OptimizerState,
                    name_of(s),
                    s.ty().clone(),
                ));
                inputs.push(Slot::Var(s.clone()));
            }
            let (new_p, new_s) = self.opt.update(g, *pn, gn, &state_nodes, lr, step)?;
            if let Op::Input(i) = g.node(*pn).op {
                aliases.push((i, outputs.len()));
            }
            outputs.push(new_p);
            slots.push(Slot::Var(pt.clone()));
            for ((ns, s), si) in new_s.into_iter().zip(&state).zip(state_idx) {
                aliases.push((si, outputs.len()));
                outputs.push(ns);
                slots.push(Slot::Var(s.clone()));
            }
        }
        Ok(())
    }

    /// Finishes a stage graph: outputs, donation aliases, simplification, dedup, the backend's
    /// rewrite, compile.
    fn stage(
        &self,
        name: &'static str,
        mut g: Graph,
        inputs: Vec<Slot>,
        outputs: Vec<NodeId>,
        slots: Vec<Slot>,
        aliases: Vec<(usize, usize)>,
    ) -> Result<Stage<B>> {
        g.set_outputs(outputs)?;
        for (i, o) in aliases {
            // Only donate what the stage really replaces (types must match; each once).
            let _ = g.add_alias(i, o);
        }
        simplify(&mut g)?;
        let map = dedup_outputs(&mut g)?;
        self.rt.backend().rewrite(&mut g)?;
        g.verify()?;
        let fp = g.fingerprint();
        let exe = self.rt.executable(&g, fp)?;
        if inputs.len() != g.inputs().len() || map.len() != slots.len() {
            return Err(Error::Invalid(format!(
                "internal: {name} stage slots do not match its graph"
            )));
        }
        Ok(Stage {
            name,
            exe,
            inputs,
            outputs: map.into_iter().zip(slots).collect(),
        })
    }
}

fn name_of(t: &Tensor) -> String {
    t.variable().map(|v| v.name.clone()).unwrap_or_default()
}

/// Adds `key' = [key[0], key[1] + 1]` as an output updating the rng key variable in place.
fn advance_key(
    g: &mut Graph,
    key_input: usize,
    outputs: &mut Vec<NodeId>,
    slots: &mut Vec<Slot>,
    aliases: &mut Vec<(usize, usize)>,
    key_var: &Tensor,
) -> Result<()> {
    let key = g.inputs()[key_input].node;
    let inc = Literal::from_bytes(
        TensorType::new(DType::U32, [2]),
        [0u32, 1u32]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )?;
    let inc = g.add(Op::Constant(inc), &[])?;
    let next = g.add(Op::Binary(BinaryOp::Add), &[key, inc])?;
    let _ = Shape::scalar();
    aliases.push((key_input, outputs.len()));
    outputs.push(next);
    slots.push(Slot::Var(key_var.clone()));
    Ok(())
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
        F: Fn(&[Tensor]) -> Result<Tensor> + 'static,
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
