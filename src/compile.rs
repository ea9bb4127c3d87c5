//! `compile`: trace a function once per input signature, compile it on a backend, replay.

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph, InputKind, TensorType};
use crate::passes::{dedup_outputs, simplify, OutputSource};
use crate::runtime::{Runtime, Stats};
use crate::trace::{trace, var_input, Binding, Tensor, Traced};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

/// When a compiled function traces its Rust code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceMode {
    /// Trace on the first call for each input signature (dtypes and shapes); later calls with
    /// that signature only bind inputs and replay (the seeds' "trace once").
    Once,
    /// Trace on every call, fingerprint the graph and look the executable up by fingerprint
    /// (the seeds' "trace every time", lazy-tensor style). Compiles once per distinct graph.
    EveryCall,
}

/// A traced graph prepared for one input signature and backend: simplified, unused variables
/// dropped, outputs deduplicated, state updates aliased to their inputs, rewritten by the
/// backend ([`Backend::rewrite`]).
pub struct Program {
    /// The graph that is compiled (and fingerprinted).
    pub graph: Graph,
    /// One binding per graph input.
    pub bindings: Vec<Binding>,
    /// For each of the traced function's outputs plus state updates: where it comes from.
    pub outputs: Vec<OutputSource>,
    /// How many leading entries of `outputs` are the function's own outputs.
    pub num_outputs: usize,
    /// Variables written by the function: `(variable, index into outputs)`.
    pub state_updates: Vec<(Tensor, usize)>,
    /// The graph's fingerprint.
    pub fingerprint: Fingerprint,
}

impl Program {
    /// Prepares a traced function for compilation on `backend`.
    pub fn new<B: Backend>(traced: Traced, backend: &B) -> Result<Program> {
        let Traced {
            mut graph,
            bindings,
            num_outputs,
            state_updates,
        } = traced;
        simplify(&mut graph)?;
        // Drop inputs nothing uses, except the caller's data inputs (their positions are the
        // function's signature).
        let used: HashSet<usize> = graph
            .inputs()
            .iter()
            .enumerate()
            .filter(|(_, inp)| {
                !graph.users(inp.node).is_empty() || graph.outputs().contains(&inp.node)
            })
            .map(|(i, _)| i)
            .collect();
        let kept =
            graph.retain_inputs(|i, inp| inp.kind == InputKind::Data || used.contains(&i))?;
        let bindings: Vec<Binding> = kept.iter().map(|&k| bindings[k].clone()).collect();
        // Donate each updated variable's buffer to its new value: in-place on the device.
        for (var, out) in &state_updates {
            if let Some(i) = var_input(&bindings, var) {
                let is_input = matches!(
                    graph.node(graph.outputs()[*out]).op,
                    crate::ir::Op::Input(_)
                );
                let taken = graph.aliases().iter().any(|&(a, b)| a == i || b == *out);
                if !is_input && !taken {
                    graph.add_alias(i, *out)?;
                }
            }
        }
        let outputs = dedup_outputs(&mut graph)?;
        backend.rewrite(&mut graph)?;
        graph.verify()?;
        let fingerprint = graph.fingerprint();
        Ok(Program {
            graph,
            bindings,
            outputs,
            num_outputs,
            state_updates,
            fingerprint,
        })
    }
}

type UserFn = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>>;
type Prepared<B> = (Rc<Program>, Arc<<B as Backend>::Executable>);

/// A function compiled for a backend; see [`compile`].
pub struct CompiledFn<B: Backend> {
    rt: Runtime<B>,
    f: UserFn,
    mode: TraceMode,
    programs: HashMap<Vec<TensorType>, Prepared<B>>,
    rng: (u32, u32),
}

/// Compiles `f` for `backend`. Nothing happens until the first call.
///
/// The executable cache is configured by the environment (`KILN_CACHE_DIR` for an on-disk
/// cache); use [`compile_with`] to share a cache between functions or threads.
///
/// ```no_run
/// use kiln::backend::xla::XlaBackend;
/// use kiln::nn::{Linear, Module, ParamStore};
/// use kiln::{compile, Tensor};
///
/// let store = ParamStore::new();
/// let layer = Linear::new(&store.root().sub("fc"), 10, 10, true)?;
/// let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![layer.forward(&xs[0])?]));
/// let y = f.run(&[Tensor::randn(&[2, 10], 0)?])?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn compile<B, F>(backend: B, f: F) -> CompiledFn<B>
where
    B: Backend,
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'static,
{
    compile_with(Runtime::new(backend), f)
}

/// Like [`compile`], on a given runtime (e.g. one whose [`crate::runtime::ExecutableCache`] is
/// shared).
pub fn compile_with<B, F>(rt: Runtime<B>, f: F) -> CompiledFn<B>
where
    B: Backend,
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + 'static,
{
    CompiledFn {
        rt,
        f: Box::new(f),
        mode: TraceMode::Once,
        programs: HashMap::new(),
        rng: (0, 0),
    }
}

impl<B: Backend> CompiledFn<B> {
    /// Sets the trace mode (default [`TraceMode::Once`]).
    pub fn with_mode(mut self, mode: TraceMode) -> Self {
        self.mode = mode;
        self
    }

    /// Seeds the random-number key passed to graphs that draw random numbers (dropout).
    pub fn with_seed(mut self, seed: u32) -> Self {
        self.rng = (seed, 0);
        self
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.rt.stats()
    }

    /// The runtime (backend, cache, resident variables, metrics).
    pub fn runtime(&self) -> &Runtime<B> {
        &self.rt
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.rt.backend()
    }

    /// The prepared program for an input signature, if it has been traced.
    pub fn program(&self, signature: &[TensorType]) -> Option<&Program> {
        self.programs.get(signature).map(|p| p.0.as_ref())
    }

    fn prepare(&mut self, signature: &[TensorType]) -> Result<Prepared<B>> {
        if self.mode == TraceMode::Once {
            if let Some((p, e)) = self.programs.get(signature) {
                // A replay is a cache hit (the executable is not looked up again).
                self.rt.metrics().cache_hit();
                return Ok((p.clone(), e.clone()));
            }
        }
        let t0 = Instant::now();
        let traced = trace(signature, |xs| (self.f)(xs))?;
        let program = Rc::new(Program::new(traced, self.rt.backend())?);
        self.rt.metrics().traced(t0.elapsed());
        let exe = self.rt.executable(&program.graph, program.fingerprint)?;
        self.programs
            .insert(signature.to_vec(), (program.clone(), exe.clone()));
        Ok((program, exe))
    }

    /// Runs the function on eager tensors; returns eager tensors.
    ///
    /// Variables (parameters, buffers) are uploaded on first use and then stay on the device;
    /// variables the function assigns are updated there (donating the old buffer) and copied
    /// back to the [`crate::nn::ParamStore`] only by [`CompiledFn::sync_to_store`].
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let signature: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
        let (program, exe) = self.prepare(&signature)?;
        // Phase 1: make every variable resident, and build per-call buffers.
        let mut temps: Vec<Option<B::Buffer>> = Vec::with_capacity(program.bindings.len());
        let mut key = None;
        for b in &program.bindings {
            match b {
                Binding::Data(i) => temps.push(Some(self.rt.upload_tensor(&inputs[*i])?)),
                Binding::Var(t) => {
                    self.rt.ensure_var(t)?;
                    temps.push(None);
                }
                Binding::RngKey => {
                    let k = HostTensor::from_slice(&[2], &[self.rng.0, self.rng.1])?;
                    self.rng.1 = self.rng.1.wrapping_add(1);
                    temps.push(Some(self.rt.upload(&k)?));
                    key = Some(k);
                }
            }
        }
        // Phase 2: execute.
        let outs = {
            let mut args: Vec<&B::Buffer> = Vec::with_capacity(temps.len());
            for (b, tmp) in program.bindings.iter().zip(&temps) {
                match (b, tmp) {
                    (_, Some(buf)) => args.push(buf),
                    (Binding::Var(t), None) => args.push(self.rt.var_buffer(t)?),
                    _ => return Err(Error::Invalid("internal: unbound input".into())),
                }
            }
            self.rt.execute(&exe, &args)?
        };
        // Phase 3: read the function's outputs, then keep state updates on the device.
        let mut results = Vec::with_capacity(program.num_outputs);
        for src in &program.outputs[..program.num_outputs] {
            let t = match *src {
                OutputSource::Output(j) => Tensor::from_host(&self.rt.download(&outs[j])?)?,
                OutputSource::Input(i) => match &program.bindings[i] {
                    Binding::Data(d) => inputs[*d].clone(),
                    Binding::Var(t) => {
                        Tensor::from_host(&self.rt.download(self.rt.var_buffer(t)?)?)?
                    }
                    Binding::RngKey => match &key {
                        Some(k) => Tensor::from_host(k)?,
                        None => return Err(Error::Invalid("internal: rng key not bound".into())),
                    },
                },
            };
            results.push(t);
        }
        let mut outs: Vec<Option<B::Buffer>> = outs.into_iter().map(Some).collect();
        for (var, k) in &program.state_updates {
            if let OutputSource::Output(j) = program.outputs[*k] {
                let buf = match outs[j].take() {
                    Some(b) => b,
                    // Two variables assigned the same value: give the second its own copy.
                    None => {
                        let h = self.rt.download(self.rt.var_buffer(var)?)?;
                        self.rt.upload(&h)?
                    }
                };
                self.rt.replace_var(var, buf)?;
            }
        }
        Ok(results)
    }

    /// Copies variables updated on the device back into their [`crate::nn::ParamStore`].
    pub fn sync_to_store(&mut self) -> Result<()> {
        self.rt.sync_to_store()
    }

    /// Forgets the device copies of variables, so the next call uploads the store's current
    /// values (call after changing the store eagerly, e.g. loading weights). Pending device
    /// updates are synced to the store first.
    pub fn refresh_from_store(&mut self) -> Result<()> {
        self.rt.refresh_from_store()
    }
}
