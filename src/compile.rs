//! `compile`: trace a function once per input signature, compile it on a backend, replay.

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph, InputKind, TensorType};
use crate::passes::{dedup_outputs, simplify, OutputSource};
use crate::trace::{trace, Binding, Tensor, Traced};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// Counters of a compiled function. All counts are since creation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stats {
    /// Times the Rust function was traced.
    pub traces: u64,
    /// Backend compilations.
    pub compiles: u64,
    /// Calls that found their executable in the in-memory cache.
    pub cache_hits: u64,
    /// Calls that had to compile.
    pub cache_misses: u64,
    /// Executable runs.
    pub executions: u64,
    /// Host→device transfers and bytes.
    pub h2d_transfers: u64,
    /// Bytes moved host→device.
    pub h2d_bytes: u64,
    /// Device→host transfers.
    pub d2h_transfers: u64,
    /// Bytes moved device→host.
    pub d2h_bytes: u64,
    /// Time spent tracing.
    pub trace_time: Duration,
    /// Time spent compiling.
    pub compile_time: Duration,
}

/// A traced graph prepared for one input signature: simplified, unused variables dropped,
/// outputs deduplicated, state updates aliased to their inputs.
pub struct Program {
    /// The graph that is compiled.
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
    /// Prepares a traced function for compilation.
    pub fn new(traced: Traced) -> Result<Program> {
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
            let id = var.variable().map(|v| v.id);
            let pos = bindings
                .iter()
                .position(|b| matches!(b, Binding::Var(t) if t.variable().map(|v| v.id) == id));
            if let Some(i) = pos {
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

/// A function compiled for a backend; see [`compile`].
pub struct CompiledFn<B: Backend> {
    backend: B,
    f: UserFn,
    mode: TraceMode,
    programs: HashMap<Vec<TensorType>, Arc<Program>>,
    executables: HashMap<Fingerprint, Arc<B::Executable>>,
    /// Device copies of variables, by variable id.
    resident: HashMap<u64, B::Buffer>,
    /// Variables whose device copy is newer than the store.
    dirty: HashMap<u64, Tensor>,
    rng: (u32, u32),
    stats: Stats,
}

/// Compiles `f` for `backend`. Nothing happens until the first call.
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
    CompiledFn {
        backend,
        f: Box::new(f),
        mode: TraceMode::Once,
        programs: HashMap::new(),
        executables: HashMap::new(),
        resident: HashMap::new(),
        dirty: HashMap::new(),
        rng: (0, 0),
        stats: Stats::default(),
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

    /// The counters.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The prepared program for an input signature, if it has been traced.
    pub fn program(&self, signature: &[TensorType]) -> Option<&Program> {
        self.programs.get(signature).map(|p| p.as_ref())
    }

    /// Number of distinct executables compiled.
    pub fn num_executables(&self) -> usize {
        self.executables.len()
    }

    fn prepare(&mut self, signature: &[TensorType]) -> Result<(Arc<Program>, Arc<B::Executable>)> {
        if self.mode == TraceMode::Once {
            if let Some(p) = self.programs.get(signature) {
                let exe = self.executables[&p.fingerprint].clone();
                self.stats.cache_hits += 1;
                return Ok((p.clone(), exe));
            }
        }
        let t0 = Instant::now();
        let traced = trace(signature, |xs| (self.f)(xs))?;
        let program = Arc::new(Program::new(traced)?);
        self.stats.traces += 1;
        self.stats.trace_time += t0.elapsed();
        let exe = match self.executables.get(&program.fingerprint) {
            Some(e) => {
                self.stats.cache_hits += 1;
                e.clone()
            }
            None => {
                self.stats.cache_misses += 1;
                let t1 = Instant::now();
                let e = Arc::new(self.backend.compile(&program.graph)?);
                self.stats.compiles += 1;
                self.stats.compile_time += t1.elapsed();
                self.executables.insert(program.fingerprint, e.clone());
                e
            }
        };
        self.programs.insert(signature.to_vec(), program.clone());
        Ok((program, exe))
    }

    fn upload(&mut self, h: &HostTensor) -> Result<B::Buffer> {
        self.stats.h2d_transfers += 1;
        self.stats.h2d_bytes += h.bytes().len() as u64;
        self.backend.to_device(h)
    }

    fn download(&mut self, b: &B::Buffer) -> Result<HostTensor> {
        let h = self.backend.to_host(b)?;
        self.stats.d2h_transfers += 1;
        self.stats.d2h_bytes += h.bytes().len() as u64;
        Ok(h)
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
        for b in &program.bindings {
            match b {
                Binding::Data(i) => {
                    let h = inputs[*i].to_host()?;
                    temps.push(Some(self.upload(&h)?));
                }
                Binding::Var(t) => {
                    let id = var_id(t)?;
                    if !self.resident.contains_key(&id) {
                        let h = t.to_host()?;
                        let buf = self.upload(&h)?;
                        self.resident.insert(id, buf);
                    }
                    temps.push(None);
                }
                Binding::RngKey => {
                    let key = HostTensor::from_slice(&[2], &[self.rng.0, self.rng.1])?;
                    self.rng.1 = self.rng.1.wrapping_add(1);
                    temps.push(Some(self.upload(&key)?));
                }
            }
        }
        // Phase 2: execute.
        let outs = {
            let mut args: Vec<&B::Buffer> = Vec::with_capacity(temps.len());
            for (b, tmp) in program.bindings.iter().zip(&temps) {
                match (b, tmp) {
                    (_, Some(buf)) => args.push(buf),
                    (Binding::Var(t), None) => args.push(&self.resident[&var_id(t)?]),
                    _ => return Err(Error::Invalid("internal: unbound input".into())),
                }
            }
            self.backend.execute(&exe, &args)?
        };
        self.stats.executions += 1;
        // Phase 3: read the function's outputs, then keep state updates on the device.
        let mut results = Vec::with_capacity(program.num_outputs);
        for src in &program.outputs[..program.num_outputs] {
            let t = match *src {
                OutputSource::Output(j) => {
                    let h = self.download(&outs[j])?;
                    Tensor::from_host(&h)?
                }
                OutputSource::Input(i) => match &program.bindings[i] {
                    Binding::Data(d) => inputs[*d].clone(),
                    Binding::Var(t) => {
                        let id = var_id(t)?;
                        let h = self.backend.to_host(&self.resident[&id])?;
                        Tensor::from_host(&h)?
                    }
                    Binding::RngKey => {
                        let k = HostTensor::from_slice(
                            &[2],
                            &[self.rng.0, self.rng.1.wrapping_sub(1)],
                        )?;
                        Tensor::from_host(&k)?
                    }
                },
            };
            results.push(t);
        }
        let mut outs: Vec<Option<B::Buffer>> = outs.into_iter().map(Some).collect();
        for (var, k) in &program.state_updates {
            let id = var_id(var)?;
            if let OutputSource::Output(j) = program.outputs[*k] {
                let buf = match outs[j].take() {
                    Some(b) => b,
                    // Two variables assigned the same value: give the second its own copy.
                    None => {
                        let h = self.backend.to_host(&self.resident[&id])?;
                        self.backend.to_device(&h)?
                    }
                };
                self.resident.insert(id, buf);
                self.dirty.insert(id, var.clone());
            }
        }
        Ok(results)
    }

    /// Copies variables updated on the device back into their [`crate::nn::ParamStore`].
    pub fn sync_to_store(&mut self) -> Result<()> {
        let dirty: Vec<(u64, Tensor)> = self.dirty.drain().collect();
        for (id, var) in dirty {
            let h = self.backend.to_host(&self.resident[&id])?;
            self.stats.d2h_transfers += 1;
            self.stats.d2h_bytes += h.bytes().len() as u64;
            var.assign(&Tensor::from_host(&h)?)?;
        }
        Ok(())
    }

    /// Forgets the device copies of variables, so the next call uploads the store's current
    /// values (call after changing the store eagerly, e.g. loading weights). Pending device
    /// updates are synced to the store first.
    pub fn refresh_from_store(&mut self) -> Result<()> {
        self.sync_to_store()?;
        self.resident.clear();
        Ok(())
    }
}

fn var_id(t: &Tensor) -> Result<u64> {
    t.variable()
        .map(|v| v.id)
        .ok_or_else(|| Error::Invalid("internal: variable binding without a variable".into()))
}
