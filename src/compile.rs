//! `compile`: trace a function once per input signature, compile it on a backend, replay.

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::inspect::Inspection;
use crate::ir::{Fingerprint, Graph, InputKind, TensorType};
use crate::passes::{dedup_outputs, simplify, OutputSource, Pass, StripStopGradients};
use crate::runtime::exec::{Arg, Dest, Plan, Step, Values};
use crate::runtime::{DeviceOutputs, DeviceResult, Runtime, Stats};
use crate::trace::{trace, var_input, Binding, LatestTraces, Retrace, Tensor, Traced};
use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// When a compiled function traces its Rust code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TraceMode {
    /// Trace on the first call for each input signature (dtypes and shapes); later calls with
    /// that signature only bind inputs and replay (torch_xla's dynamo "trace once" bridge).
    Once,
    /// Trace on every call, fingerprint the graph and look the executable up by fingerprint
    /// (torch_xla's "trace everytime", lazy-tensor style). Compiles once per distinct graph.
    EveryCall,
}

/// A traced graph prepared for one input signature and backend: simplified, unused variables
/// dropped, outputs deduplicated, state updates aliased to their inputs, rewritten by the
/// backend ([`Backend::rewrite`]).
#[derive(Clone, Debug)]
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
        Self::with_layouts(traced, backend, &mut |_, _| Ok(false))
    }

    /// [`Program::new`], with device layouts for the variables: `transposed(var, wanted)`
    /// says whether `var` lives transposed on the device, given whether the backend would like
    /// it to ([`Backend::prefers_transposed`]; never for a variable the function updates).
    /// Inputs of transposed variables get their device type and a transpose for their users;
    /// their new values are transposed back.
    pub(crate) fn with_layouts<B: Backend>(
        traced: Traced,
        backend: &B,
        transposed: &mut dyn FnMut(&Tensor, bool) -> Result<bool>,
    ) -> Result<Program> {
        let Traced {
            mut graph,
            bindings,
            num_outputs,
            state_updates,
        } = traced;
        // Nothing differentiates this graph.
        StripStopGradients.run(&mut graph)?;
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
        let id_of = |t: &Tensor| t.variable().map(|v| v.id);
        for (i, b) in bindings.iter().enumerate() {
            let Binding::Var(var) = b else { continue };
            let updates: Vec<usize> = state_updates
                .iter()
                .filter(|(v, _)| id_of(v) == id_of(var))
                .map(|&(_, out)| out)
                .collect();
            let wanted = updates.is_empty() && backend.prefers_transposed(&graph, i);
            if transposed(var, wanted)? {
                graph.transpose_input(i)?;
                for out in updates {
                    graph.transpose_output(out)?;
                }
            }
        }
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

type UserFn = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

/// A function compiled for a backend; see [`compile`].
///
/// `CompiledFn` is `Send` (a model compiled on one thread can move to a worker thread or into
/// an async task). To call one compiled model from several threads at once, turn it into a
/// [`SharedFn`] with [`CompiledFn::shared`].
pub struct CompiledFn<B: Backend> {
    inner: FnState<B>,
}

/// A compiled function that several threads call at once: cheap to clone (`Arc` inside), `Sync`
/// when the backend's buffers are (XLA's are; the eager backend's tch tensors are not).
///
/// All clones share one runtime: one executable per input signature and one set of resident
/// variables. Calls that only read variables (inference) run concurrently: the executable is
/// run by several threads at once, which PJRT allows. A call of a program that writes variables
/// (a buffer assigned in the function, e.g. BatchNorm statistics in training mode) holds the
/// variables exclusively while it runs, so such calls are serialized and each sees the
/// previous one's updates (in the order the threads got there). Tracing and compiling a new
/// signature happens once, under a lock; other signatures keep running meanwhile. Random draws
/// (dropout) use one counter for all clones: every call gets its own key.
///
/// ```no_run
/// use kiln::backend::xla::XlaBackend;
/// use kiln::nn::{Linear, Module, ParamStore};
/// use kiln::{compile, Tensor};
///
/// let store = ParamStore::new();
/// let layer = Linear::new(&store.root().sub("fc"), 10, 10, true)?;
/// let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![layer.forward(&xs[0])?]))
///     .shared();
/// let workers: Vec<_> = (0..4)
///     .map(|i| {
///         let f = f.clone();
///         std::thread::spawn(move || f.run(&[Tensor::randn(&[2, 10], i)?]))
///     })
///     .collect();
/// for w in workers {
///     let y = w.join().unwrap()?;
/// }
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct SharedFn<B: Backend> {
    inner: Arc<FnState<B>>,
}

impl<B: Backend> Clone for SharedFn<B> {
    fn clone(&self) -> Self {
        SharedFn {
            inner: self.inner.clone(),
        }
    }
}

/// What a call needs for one input signature: the plan, and where each result comes from.
struct FnPlan<B: Backend> {
    plan: Plan<B>,
    /// The same executable with the function's results left on the device: what `plan`
    /// downloads as host value `k` is temporary `k` here.
    device_plan: Plan<B>,
    results: Vec<ResultSource>,
    uses_rng: bool,
    /// Does `plan` wait for its execution (it downloads a computed result), so that nothing
    /// reads the call's inputs once it returns?
    awaited: bool,
    /// Were `device_plan`'s results computed when its latest run returned (the backend ran
    /// it inside the launch, [`Backend::is_computed`])? Then the next `run_on_device` lends
    /// its inputs as `run` does.
    device_inline: AtomicBool,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum ResultSource {
    /// The caller's argument, returned unchanged (no transfer).
    Data(usize),
    /// A value the plan downloads (host value `k`; temporary `k` of the device plan).
    Host(usize),
}

/// The user's function and its traced programs (touched only when tracing).
struct Tracer<B: Backend> {
    f: UserFn,
    programs: HashMap<Vec<TensorType>, Program>,
    /// Trace every time: the plan for each distinct trace seen before, so that a call whose
    /// trace repeats an earlier one pays the trace and a fingerprint, not the preparation
    /// (simplification, the backend's rewrites, binding) again.
    seen: HashMap<TraceKey, (Program, Arc<FnPlan<B>>)>,
    /// Trace every time: each signature's latest trace and its plan, checked before `seen`.
    latest: LatestTraces<Arc<FnPlan<B>>>,
}

/// What identifies a trace: the raw graph's structure and what its inputs and outputs are
/// bound to (a graph that reads another variable is another program).
#[derive(Clone, PartialEq, Eq, Hash)]
struct TraceKey {
    graph: Fingerprint,
    bindings: Vec<BindingKey>,
    num_outputs: usize,
    state_updates: Vec<(u64, usize)>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
enum BindingKey {
    Data(usize),
    Var(u64),
    RngKey,
}

impl TraceKey {
    /// `None` for a trace that binds a variable without an id (not memoized).
    fn of(t: &Traced) -> Option<TraceKey> {
        let bindings = t
            .bindings
            .iter()
            .map(|b| match b {
                Binding::Data(i) => Some(BindingKey::Data(*i)),
                Binding::Var(v) => Some(BindingKey::Var(v.variable()?.id)),
                Binding::RngKey => Some(BindingKey::RngKey),
            })
            .collect::<Option<Vec<_>>>()?;
        let state_updates = t
            .state_updates
            .iter()
            .map(|(v, out)| Some((v.variable()?.id, *out)))
            .collect::<Option<Vec<_>>>()?;
        Some(TraceKey {
            graph: t.graph.fingerprint(),
            bindings,
            num_outputs: t.num_outputs,
            state_updates,
        })
    }
}

/// The state of a compiled function, shared by [`CompiledFn`] and [`SharedFn`].
struct FnState<B: Backend> {
    rt: Runtime<B>,
    mode: TraceMode,
    tracer: Mutex<Tracer<B>>,
    plans: RwLock<foldhash::HashMap<Vec<TensorType>, Arc<FnPlan<B>>>>,
    seed: u32,
    draws: AtomicU32,
    /// The latest [`CompiledFn::run`]'s small inputs, where their buffers read the tensors'
    /// memory in place: the next call with the same tensors lends them again without asking
    /// the backend (see [`LentInput`]).
    lent: Mutex<SmallVec<[Option<LentInput<B>>; 4]>>,
}

/// Inputs of at most this many bytes keep their lent buffers between calls (see
/// [`LentInput`]); larger ones are not kept alive past their call.
const KEPT_LENT_BYTES: usize = 1 << 16;

/// A buffer lent from the caller's tensor that reads the tensor's memory in place
/// ([`Backend::lends_in_place`]), kept after the call for the next one: a call given a
/// tensor with the same data address and type reads the same memory, whose current values
/// the buffer holds (the buffer keeps that memory allocated, so no other tensor can take
/// its address meanwhile).
///
/// Why: lending a buffer and destroying it is a good part of a tiny model's call (the
/// LinearModel's on the CPU plugin: ~1 µs of ~6 µs, the plugin's buffer objects and events).
/// Only a call that waited for its execution keeps its buffers (see `FnPlan::awaited`): no
/// execution reads them once it returns, so the caller may change the tensors.
struct LentInput<B: Backend> {
    address: usize,
    ty: TensorType,
    buffer: B::Buffer,
}

impl<B: Backend> LentInput<B> {
    /// Does tensor `t` lie where this buffer reads, with its type?
    fn serves(&self, t: &Tensor) -> bool {
        t.as_tch()
            .is_ok_and(|tt| tt.data_ptr() as usize == self.address && tt.is_contiguous())
            && *t.ty() == self.ty
    }
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
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static,
{
    compile_with(Runtime::new(backend), f)
}

/// Like [`compile`], on a given runtime (e.g. one whose [`crate::runtime::ExecutableCache`] is
/// shared).
pub fn compile_with<B, F>(rt: Runtime<B>, f: F) -> CompiledFn<B>
where
    B: Backend,
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static,
{
    CompiledFn {
        inner: FnState {
            rt,
            mode: TraceMode::Once,
            tracer: Mutex::new(Tracer {
                f: Box::new(f),
                programs: HashMap::new(),
                seen: HashMap::new(),
                latest: LatestTraces::new(),
            }),
            plans: RwLock::new(Default::default()),
            seed: 0,
            draws: AtomicU32::new(0),
            lent: Mutex::new(SmallVec::new()),
        },
    }
}

impl<B: Backend> CompiledFn<B> {
    /// Sets the trace mode (default [`TraceMode::Once`]).
    pub fn with_mode(mut self, mode: TraceMode) -> Self {
        self.inner.mode = mode;
        self
    }

    /// Seeds the random-number key passed to graphs that draw random numbers (dropout).
    pub fn with_seed(mut self, seed: u32) -> Self {
        self.inner.seed = seed;
        self.inner.draws = AtomicU32::new(0);
        self
    }

    /// A handle that several threads can call at once, sharing this function's executables and
    /// resident variables; see [`SharedFn`].
    pub fn shared(self) -> SharedFn<B> {
        SharedFn {
            inner: Arc::new(self.inner),
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.inner.rt.stats()
    }

    /// The runtime (backend, cache, resident variables, metrics).
    pub fn runtime(&self) -> &Runtime<B> {
        &self.inner.rt
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.inner.rt.backend()
    }

    /// The prepared program for an input signature (a copy), if it has been traced.
    pub fn program(&self, signature: &[TensorType]) -> Option<Program> {
        self.inner.program(signature)
    }

    /// Runs the function on eager tensors; returns eager tensors.
    ///
    /// Variables (parameters, buffers) are uploaded on first use and then stay on the device;
    /// variables the function assigns are updated there (donating the old buffer) and copied
    /// back to the [`crate::nn::ParamStore`] only by [`CompiledFn::sync_to_store`].
    ///
    /// The inputs are read in place where the backend can ([`Backend::lend_to_device`]). An
    /// input of at most 64 KiB read so stays referenced (its memory allocated) until the next
    /// call, which reads it through the same device buffer when given the same tensor again;
    /// values changed in place between calls are read anew.
    pub fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.inner.run(inputs)
    }

    /// Runs the function like [`CompiledFn::run`] but leaves its results on the device: no
    /// download and no wait (the backend may still be computing them when this returns).
    /// [`DeviceOutputs::to_host`] fetches them, [`DeviceOutputs::synchronize`] waits for them.
    ///
    /// A loop of N calls that fetches only the last results syncs once instead of N times;
    /// the values are those [`CompiledFn::run`] returns. The inputs are copied to the
    /// device, as the execution may outlive the call, except where the previous call's
    /// results were computed when it returned (the backend ran the program inside the
    /// launch, as the CPU plugin does with a program of a few thousand flops): then they
    /// are read in place as [`CompiledFn::run`] reads them, and a call that finds its
    /// execution unfinished waits for it. One case still goes through the host
    /// on every call: a result that is also the new value of a variable the function assigns
    /// (`v.assign(&y)?` and `y` returned) is copied, as the next call donates the variable's
    /// buffer and the [`Backend`] trait has no device-to-device copy.
    ///
    /// ```no_run
    /// # use kiln::backend::xla::XlaBackend;
    /// # use kiln::nn::{Linear, Module, ParamStore};
    /// # use kiln::{compile, Tensor};
    /// # let store = ParamStore::new();
    /// # let layer = Linear::new(&store.root().sub("fc"), 10, 10, true)?;
    /// let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![layer.forward(&xs[0])?]));
    /// let x = Tensor::randn(&[2, 10], 0)?;
    /// let mut last = f.run_on_device(&[x.clone()])?;
    /// for _ in 1..100 {
    ///     last = f.run_on_device(&[x.clone()])?;
    /// }
    /// let y = last.to_host()?; // the one sync
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn run_on_device(&self, inputs: &[Tensor]) -> Result<DeviceOutputs<'_, B>> {
        self.inner.run_on_device(inputs)
    }

    /// Every stage of the program this function compiles for `inputs` (their dtypes and
    /// shapes): the traced graph as text and DOT, and the backend's views (on XLA the StableHLO
    /// kiln emitted and the plugin's optimized HLO). Traces and compiles if this signature has
    /// not been yet; runs nothing. See [`crate::inspect`].
    pub fn inspect(&self, inputs: &[Tensor]) -> Result<Inspection> {
        self.inner.inspect(inputs)
    }

    /// Copies variables updated on the device back into their [`crate::nn::ParamStore`].
    pub fn sync_to_store(&mut self) -> Result<()> {
        self.inner.rt.sync_to_store()
    }

    /// Forgets the device copies of variables, so the next call uploads the store's current
    /// values (call after changing the store eagerly, e.g. loading weights). Pending device
    /// updates are synced to the store first.
    pub fn refresh_from_store(&mut self) -> Result<()> {
        self.inner.rt.refresh_from_store()
    }
}

impl<B: Backend> SharedFn<B> {
    /// Runs the function; see [`CompiledFn::run`] and the type's docs for what concurrent calls
    /// share.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.inner.run(inputs)
    }

    /// Runs the function and leaves its results on the device; see
    /// [`CompiledFn::run_on_device`].
    pub fn run_on_device(&self, inputs: &[Tensor]) -> Result<DeviceOutputs<'_, B>> {
        self.inner.run_on_device(inputs)
    }

    /// Every stage of the program compiled for `inputs`; see [`CompiledFn::inspect`].
    pub fn inspect(&self, inputs: &[Tensor]) -> Result<Inspection> {
        self.inner.inspect(inputs)
    }

    /// A snapshot of the counters (of all clones together).
    pub fn stats(&self) -> Stats {
        self.inner.rt.stats()
    }

    /// The runtime (backend, cache, resident variables, metrics).
    pub fn runtime(&self) -> &Runtime<B> {
        &self.inner.rt
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        self.inner.rt.backend()
    }

    /// The prepared program for an input signature (a copy), if it has been traced.
    pub fn program(&self, signature: &[TensorType]) -> Option<Program> {
        self.inner.program(signature)
    }

    /// Copies variables updated on the device back into their [`crate::nn::ParamStore`]
    /// (waits for running calls that write variables).
    pub fn sync_to_store(&self) -> Result<()> {
        self.inner.rt.sync_to_store()
    }

    /// Forgets the device copies of variables; see [`CompiledFn::refresh_from_store`]. Waits
    /// for running calls.
    pub fn refresh_from_store(&self) -> Result<()> {
        self.inner.rt.refresh_from_store()
    }
}

impl<B: Backend> FnState<B> {
    fn program(&self, signature: &[TensorType]) -> Option<Program> {
        self.tracer.lock().programs.get(signature).cloned()
    }

    /// The plan for `signature`: prepared before (trace once), or traced now.
    fn plan(&self, signature: &[TensorType]) -> Result<Arc<FnPlan<B>>> {
        let cached = || {
            let p = self.plans.read().get(signature).cloned();
            if p.is_some() {
                // A replay is a cache hit (the executable is not looked up again).
                self.rt.metrics().cache_hit();
            }
            p
        };
        if self.mode == TraceMode::Once {
            if let Some(p) = cached() {
                return Ok(p);
            }
        }
        let mut tracer = self.tracer.lock();
        if self.mode == TraceMode::Once {
            // Another thread may have traced this signature while this one waited.
            if let Some(p) = cached() {
                return Ok(p);
            }
        }
        let tracer = &mut *tracer; // borrow its fields apart
        let t0 = Instant::now();
        let every = self.mode == TraceMode::EveryCall;
        let traced = if every {
            match tracer.latest.trace(signature, |xs| (tracer.f)(xs))? {
                // The common case: the same program as this signature's latest trace.
                Retrace::Repeat(plan) => {
                    self.rt.metrics().traced(t0.elapsed());
                    self.rt.metrics().cache_hit();
                    return Ok(plan);
                }
                Retrace::New(traced) => traced,
            }
        } else {
            trace(signature, |xs| (tracer.f)(xs))?
        };
        let key = if every { TraceKey::of(&traced) } else { None };
        if let Some((program, plan)) = key.as_ref().and_then(|k| tracer.seen.get(k)) {
            let plan = plan.clone();
            self.rt.metrics().traced(t0.elapsed());
            self.rt.metrics().cache_hit();
            // The signature's latest program changed back to one seen before.
            let program = program.clone();
            tracer.programs.insert(signature.to_vec(), program);
            self.plans.write().insert(signature.to_vec(), plan.clone());
            tracer.latest.insert(signature, traced, plan.clone());
            return Ok(plan);
        }
        let latest = every.then(|| traced.clone());
        let rt = &self.rt;
        let program = Program::with_layouts(traced, rt.backend(), &mut |var, wanted| {
            rt.transposed_layout(var, wanted)
        })?;
        self.rt.metrics().traced(t0.elapsed());
        let exe = self.rt.executable(&program.graph, program.fingerprint)?;
        let plan = Arc::new(self.bind(&program, exe, signature.len())?);
        if let Some(k) = key {
            tracer.seen.insert(k, (program.clone(), plan.clone()));
        }
        if let Some(traced) = latest {
            tracer.latest.insert(signature, traced, plan.clone());
        }
        tracer.programs.insert(signature.to_vec(), program);
        self.plans.write().insert(signature.to_vec(), plan.clone());
        Ok(plan)
    }

    /// Wires a program's inputs and outputs: the caller's arguments are data `0..n`, the
    /// random key (if drawn) data `n`; results go to temporaries, variable updates to the
    /// variables.
    fn bind(&self, p: &Program, exe: Arc<B::Executable>, num_inputs: usize) -> Result<FnPlan<B>> {
        let mut uses_rng = false;
        let mut args = Vec::with_capacity(p.bindings.len());
        for b in &p.bindings {
            args.push(match b {
                Binding::Data(i) => Arg::Data(*i),
                Binding::Var(t) => Arg::Var(self.rt.register(t)?),
                Binding::RngKey => {
                    uses_rng = true;
                    Arg::Data(num_inputs)
                }
            });
        }
        let mut routes = Vec::new();
        let mut results = Vec::with_capacity(p.num_outputs);
        let mut temp_of: HashMap<usize, usize> = HashMap::new();
        for &src in &p.outputs[..p.num_outputs] {
            let reused = match src {
                // The caller's own argument: handed back without a transfer.
                OutputSource::Input(i) => match args[i] {
                    Arg::Data(d) if d < num_inputs => Some(ResultSource::Data(d)),
                    _ => None,
                },
                // A value already returned: downloaded again, not routed twice.
                OutputSource::Output(j) => temp_of.get(&j).map(|&k| ResultSource::Host(k)),
            };
            let result = match reused {
                Some(r) => r,
                None => {
                    let k = routes.len();
                    routes.push((src, Dest::Host(k)));
                    if let OutputSource::Output(j) = src {
                        temp_of.insert(j, k);
                    }
                    ResultSource::Host(k)
                }
            };
            results.push(result);
        }
        let num_hosts = routes.len();
        // The device plan keeps each downloaded result as a temporary instead.
        let mut device_routes: Vec<(OutputSource, Dest)> = routes
            .iter()
            .map(|&(src, dest)| match dest {
                Dest::Host(k) => (src, Dest::Temp(k)),
                other => (src, other),
            })
            .collect();
        for (var, out) in &p.state_updates {
            let src = *p.outputs.get(*out).ok_or_else(|| {
                Error::Internal(format!(
                    "state update to output {out} of {}",
                    p.outputs.len()
                ))
            })?;
            let dest = Dest::Var(self.rt.register(var)?);
            routes.push((src, dest));
            device_routes.push((src, dest));
        }
        let graph = Arc::new(p.graph.clone());
        let device_step = Step {
            name: "function",
            exe: exe.clone(),
            args: args.clone(),
            routes: device_routes,
            graph: graph.clone(),
            fingerprint: p.fingerprint,
        };
        let step = Step {
            name: "function",
            exe,
            args,
            routes,
            graph,
            fingerprint: p.fingerprint,
        };
        let awaited = step
            .routes
            .iter()
            .any(|r| matches!(r, (OutputSource::Output(_), Dest::Host(_))));
        Ok(FnPlan {
            plan: Plan::new(vec![step], 0, num_hosts)?,
            device_plan: Plan::new(vec![device_step], num_hosts, 0)?,
            results,
            uses_rng,
            awaited,
            device_inline: AtomicBool::new(false),
        })
    }

    /// Uploads `inputs` (and the random key) and runs the plan for their signature (the device
    /// plan if `on_device`).
    fn call(&self, inputs: &[Tensor], on_device: bool) -> Result<(Arc<FnPlan<B>>, Values<B>)> {
        // On a data-parallel backend each replica's program sees its shard of every input.
        // Inline for up to 4 inputs: a tiny model's call is a few microseconds.
        let signature: SmallVec<[TensorType; 4]> = inputs
            .iter()
            .enumerate()
            .map(|(i, t)| self.rt.replica_type(i, t.ty()))
            .collect::<Result<_>>()?;
        let p = self.plan(&signature)?;
        let mut data = SmallVec::<[B::Buffer; 4]>::with_capacity(inputs.len() + 1);
        // `run` drops `data` before returning (a lent buffer's drop waits for the execution
        // reading it) or keeps it where nothing reads it any more, so its inputs are lent
        // (maybe without a copy); `run_on_device` hands the execution over unfinished, so it
        // copies, unless its latest run was done when launched (a tiny program the backend
        // runs inside the launch): then it lends too, and waits if this run was not done.
        let lend = !on_device || p.device_inline.load(Ordering::Relaxed);
        // The kept buffers serving these tensors, and their keys for `keep_lent`.
        let mut keys = SmallVec::<[Option<(usize, TensorType)>; 4]>::new();
        {
            let mut lent = lend.then(|| self.lent.lock());
            for (i, t) in inputs.iter().enumerate() {
                let again = lent
                    .as_mut()
                    .and_then(|l| l.get_mut(i))
                    .and_then(Option::take)
                    .filter(|l| l.serves(t));
                data.push(match again {
                    Some(LentInput {
                        address,
                        ty,
                        buffer,
                    }) => {
                        // Counted as a lend is: the call reads the input's bytes.
                        self.rt.count_upload(t.ty().size_in_bytes());
                        self.rt.metrics().h2d_reused();
                        keys.push(Some((address, ty)));
                        buffer
                    }
                    None => {
                        keys.push(None);
                        self.rt.upload_batch(i, t, lend)?
                    }
                });
            }
        }
        if p.uses_rng {
            let draw = self.draws.fetch_add(1, Ordering::Relaxed);
            let k = HostTensor::from_slice(&[2], &[self.seed, draw])?;
            data.push(self.rt.upload(&k)?);
        }
        let plan = if on_device { &p.device_plan } else { &p.plan };
        // A device run's lent inputs are not read after this call (see below), so its
        // execution need not track its use of them (`run`'s plan decides that by itself).
        let values = if on_device && lend {
            self.rt.run_plan_awaited(plan, &data)?
        } else {
            self.rt.run_plan(plan, &data)?
        };
        let done = if on_device {
            let backend = self.rt.backend();
            // Done once every result is computed; a plan without computed results (only
            // variable updates) never counts as done.
            let mut results = values.temps.iter().flatten().peekable();
            let done = results.peek().is_some() && results.all(|b| backend.is_computed(b));
            p.device_inline.store(done, Ordering::Relaxed);
            if lend && !done {
                // Lent inputs must not be read after this call returns.
                for b in values.temps.iter().flatten() {
                    backend.sync(b)?;
                }
            }
            done
        } else {
            p.awaited
        };
        if lend && done {
            self.keep_lent(inputs, data, keys);
        }
        Ok((p, values))
    }

    /// Keeps the buffers a finished call lent from small `inputs` where they read the
    /// tensors in place (known already where `keys` has the kept buffer's key), for the next
    /// call (see [`LentInput`]); drops the others.
    fn keep_lent(
        &self,
        inputs: &[Tensor],
        data: SmallVec<[B::Buffer; 4]>,
        keys: SmallVec<[Option<(usize, TensorType)>; 4]>,
    ) {
        let backend = self.rt.backend();
        if backend.replicas() != 1 {
            return;
        }
        let mut lent = self.lent.lock();
        lent.resize_with(inputs.len(), || None);
        for (((t, buffer), key), slot) in inputs.iter().zip(data).zip(keys).zip(lent.iter_mut()) {
            let key = match key {
                Some(key) => Some(key),
                None if t.ty().size_in_bytes() <= KEPT_LENT_BYTES
                    && backend.lends_in_place(&buffer, t) =>
                {
                    t.as_tch()
                        .ok()
                        .map(|tt| (tt.data_ptr() as usize, t.ty().clone()))
                }
                None => None,
            };
            *slot = match key {
                Some((address, ty)) if backend.is_donated(&buffer).ok() == Some(false) => {
                    Some(LentInput {
                        address,
                        ty,
                        buffer,
                    })
                }
                _ => None,
            };
        }
    }

    fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let (p, mut values) = self.call(inputs, false)?;
        let mut results = Vec::with_capacity(p.results.len());
        for (i, r) in p.results.iter().enumerate() {
            results.push(match *r {
                ResultSource::Data(d) => inputs[d].clone(),
                // Several results may be one downloaded value (a function returning the same
                // value twice): each gets its own tensor, the last one the downloaded one.
                ResultSource::Host(k) => {
                    let used_again = p.results[i + 1..].contains(&ResultSource::Host(k));
                    let h = values.hosts[k]
                        .as_ref()
                        .ok_or_else(|| Error::Internal(format!("result {k} not computed")))?;
                    if used_again {
                        Tensor::from_host(&h.to_host()?)?
                    } else {
                        values.hosts[k]
                            .take()
                            .ok_or_else(|| Error::Internal(format!("result {k} not computed")))?
                    }
                }
            });
        }
        Ok(results)
    }

    fn run_on_device(&self, inputs: &[Tensor]) -> Result<DeviceOutputs<'_, B>> {
        let (p, values) = self.call(inputs, true)?;
        let buffers = values
            .temps
            .into_iter()
            .enumerate()
            .map(|(k, b)| b.ok_or_else(|| Error::Internal(format!("result {k} not computed"))))
            .collect::<Result<Vec<_>>>()?;
        let results = p
            .results
            .iter()
            .map(|r| match *r {
                ResultSource::Data(d) => DeviceResult::Input(inputs[d].clone()),
                ResultSource::Host(k) => DeviceResult::Buffer(k),
            })
            .collect();
        Ok(DeviceOutputs::new(&self.rt, buffers, results))
    }

    fn inspect(&self, inputs: &[Tensor]) -> Result<Inspection> {
        let signature: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
        let p = self.plan(&signature)?;
        let step = p
            .plan
            .steps
            .first()
            .ok_or_else(|| Error::Internal("a function plan without a step".into()))?;
        Ok(Inspection::new(
            self.rt.backend(),
            "function",
            &step.graph,
            step.fingerprint,
            &step.exe,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::xla::XlaBackend;
    use crate::nn::{Linear, Module, ParamStore};

    fn linear_fn(k: usize) -> CompiledFn<XlaBackend> {
        let store = ParamStore::with_seed(3);
        let layer = Linear::new(&store.root().sub("fc"), k, 8, true).unwrap();
        compile(XlaBackend::new().unwrap(), move |xs: &[Tensor]| {
            Ok(vec![layer.forward(&xs[0])?])
        })
    }

    /// The address each input slot's kept buffer reads (`None`: nothing kept).
    fn kept(f: &CompiledFn<XlaBackend>) -> Vec<Option<usize>> {
        let lent = f.inner.lent.lock();
        lent.iter().map(|l| l.as_ref().map(|l| l.address)).collect()
    }

    fn address(t: &Tensor) -> usize {
        t.as_tch().unwrap().data_ptr() as usize
    }

    /// `run` keeps a small input's buffer, serves the same tensor from it, and replaces it
    /// for another tensor; a large input and `run_on_device` keep nothing.
    #[test]
    fn run_keeps_small_lent_inputs_for_the_same_tensor() {
        let mut f = linear_fn(10);
        let x = Tensor::randn(&[4, 10], 1).unwrap();
        let y = f.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(kept(&f), [Some(address(&x))]);
        let again = f.run(std::slice::from_ref(&x)).unwrap();
        assert_eq!(kept(&f), [Some(address(&x))]);
        assert_eq!(y[0].to_f64_vec().unwrap(), again[0].to_f64_vec().unwrap());
        let z = Tensor::randn(&[4, 10], 2).unwrap();
        f.run(std::slice::from_ref(&z)).unwrap();
        assert_eq!(kept(&f), [Some(address(&z))]);
        // A view of another shape at the same address is another input type: a new plan,
        // and a buffer of its own type.
        let flat = z.reshape(&[2, 20]).unwrap();
        assert_eq!(address(&flat), address(&z));
        let mut g = linear_fn(20);
        g.run(std::slice::from_ref(&flat)).unwrap();
        g.run(std::slice::from_ref(&flat)).unwrap();
        assert_eq!(kept(&g), [Some(address(&z))]);

        f.run_on_device(std::slice::from_ref(&x)).unwrap();
        assert_eq!(kept(&f), [Some(address(&z))], "run_on_device lends nothing");
        let big = Tensor::randn(&[KEPT_LENT_BYTES / 40 + 1, 10], 3).unwrap();
        f.run(std::slice::from_ref(&big)).unwrap();
        assert_eq!(kept(&f), [None]);
    }
}
