//! Backends by name, for an application that picks its backend from configuration (and for the
//! benchmark harness's `--backend NAME`).
//!
//! [`Backend`] has associated types (its buffers and executables), so two backends cannot share
//! a collection or a `Box<dyn Backend>`. [`DynBackend`] is its object-safe face: it compiles a
//! traced function ([`DynBackend::compile`]) or builds a training step
//! ([`DynBackend::train_step`]) and returns them type-erased ([`DynCompiledFn`],
//! [`DynTrainStep`], which [`CompiledFn`] and [`TrainStep`] implement). Every cloneable
//! [`Backend`] is a [`DynBackend`]; a [`BackendRegistry`] maps names to them.
//!
//! ```no_run
//! use kiln::backend::registry::{BackendRegistry, DynBackend};
//! use kiln::nn::{Init, Linear, Module, ParamStore};
//! use kiln::optim::Sgd;
//! use kiln::train::TrainMode;
//! use kiln::{Tensor, TraceMode};
//!
//! // `xla` (PJRT) and `eager` (kiln's graph interpreter), plus any you register.
//! let registry = BackendRegistry::with_builtins();
//! let name = std::env::var("MY_APP_BACKEND").unwrap_or_else(|_| "xla".into());
//! let backend = registry.get(&name)?; // an unknown name is an error listing the known ones
//!
//! // A compiled function.
//! let store = ParamStore::with_seed(0);
//! let layer = Linear::new(&store.root().sub("fc"), 10, 10, true)?;
//! let mut f = backend.compile(
//!     Box::new(move |xs: &[Tensor]| Ok(vec![layer.forward(&xs[0])?])),
//!     TraceMode::Once,
//! )?;
//! let y = f.run(&[Tensor::randn(&[2, 10], 0)?])?;
//!
//! // A training step.
//! let w = store.root().param("w", &[10], Init::Normal { mean: 0.0, std: 1.0 })?;
//! let mut step = backend.train_step(
//!     &store,
//!     Box::new(Sgd::new()),
//!     Box::new(move |xs: &[Tensor]| (&xs[0] * &w)?.mean_all()),
//!     TrainMode::Fused,
//!     TraceMode::Once,
//! )?;
//! step.set_lr(0.1);
//! let loss = step.step(&[Tensor::randn(&[4, 10], 1)?])?;
//! step.sync_to_store()?; // the new parameters back into `store`
//! # Ok::<(), kiln::Error>(())
//! ```

use super::eager::EagerBackend;
use super::xla::XlaBackend;
use super::Backend;
use crate::compile::{compile, CompiledFn, TraceMode};
use crate::error::{Error, Result};
use crate::inspect::Inspection;
use crate::nn::ParamStore;
use crate::optim::Optimizer;
use crate::runtime::{DeviceOutputs, Stats};
use crate::trace::Tensor;
use crate::train::{TrainMode, TrainStep};
use once_cell::unsync::OnceCell;

/// A function of input tensors to output tensors, to be traced and compiled.
pub type TracedFn = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

/// A training loss: the scalar a training step minimises, from the batch it is given.
pub type LossFn = Box<dyn Fn(&[Tensor]) -> Result<Tensor> + Send>;

/// A [`Backend`] behind a trait object: what an application needs from a backend it chose by
/// name. Every `Backend + Clone` implements it (each call compiles on a clone).
pub trait DynBackend {
    /// Compiles `f` (as [`crate::compile()`] does) in trace `mode`. Nothing is traced until the
    /// first call.
    fn compile(&self, f: TracedFn, mode: TraceMode) -> Result<Box<dyn DynCompiledFn>>;

    /// A training step for the trainable parameters of `store`, minimising `loss_fn` with
    /// `opt` (as [`TrainStep::new`] with [`TrainStep::with_mode`] and
    /// [`TrainStep::with_trace_mode`]).
    fn train_step(
        &self,
        store: &ParamStore,
        opt: Box<dyn Optimizer>,
        loss_fn: LossFn,
        mode: TrainMode,
        trace_mode: TraceMode,
    ) -> Result<Box<dyn DynTrainStep>>;
}

/// A compiled function whose backend type is erased; see [`CompiledFn`].
pub trait DynCompiledFn {
    /// Runs the function ([`CompiledFn::run`]).
    fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;

    /// The runtime's counters ([`CompiledFn::stats`]).
    fn stats(&self) -> Stats;

    /// Copies variables updated on the device back into their store
    /// ([`CompiledFn::sync_to_store`]).
    fn sync_to_store(&mut self) -> Result<()>;

    /// Forgets the device copies of variables ([`CompiledFn::refresh_from_store`]).
    fn refresh_from_store(&mut self) -> Result<()>;

    /// Runs the function and leaves its results on the device
    /// ([`CompiledFn::run_on_device`]).
    fn run_on_device<'a>(&'a self, inputs: &[Tensor]) -> Result<Box<dyn DynDeviceOutputs + 'a>>;

    /// Every stage of the program compiled for `inputs` ([`CompiledFn::inspect`]).
    fn inspect(&self, inputs: &[Tensor]) -> Result<Inspection>;
}

/// Results left on the device, whose backend type is erased; see [`DeviceOutputs`].
pub trait DynDeviceOutputs {
    /// The number of results ([`DeviceOutputs::len`]).
    fn len(&self) -> usize;

    /// Whether there are no results ([`DeviceOutputs::is_empty`]).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Are all results computed already, without waiting ([`DeviceOutputs::is_ready`])?
    fn is_ready(&self) -> bool;

    /// Waits until every result is computed ([`DeviceOutputs::synchronize`]).
    fn synchronize(&self) -> Result<()>;

    /// Every result on the host ([`DeviceOutputs::to_host`]).
    fn to_host(&self) -> Result<Vec<Tensor>>;
}

impl<B: Backend> DynDeviceOutputs for DeviceOutputs<'_, B> {
    fn len(&self) -> usize {
        DeviceOutputs::len(self)
    }

    fn is_ready(&self) -> bool {
        DeviceOutputs::is_ready(self)
    }

    fn synchronize(&self) -> Result<()> {
        DeviceOutputs::synchronize(self)
    }

    fn to_host(&self) -> Result<Vec<Tensor>> {
        DeviceOutputs::to_host(self)
    }
}

/// A compiled training step whose backend type is erased; see [`TrainStep`].
pub trait DynTrainStep {
    /// One step; returns the loss ([`TrainStep::step`]).
    fn step(&mut self, inputs: &[Tensor]) -> Result<f64>;

    /// One step without waiting for it ([`TrainStep::step_async`]).
    fn step_async(&mut self, inputs: &[Tensor]) -> Result<()>;

    /// The last step's loss ([`TrainStep::last_loss`]).
    fn last_loss(&self) -> Result<f64>;

    /// Waits for all device work of the last step ([`TrainStep::synchronize`]).
    fn synchronize(&self) -> Result<()>;

    /// Sets the learning rate for the following steps ([`TrainStep::set_lr`]).
    fn set_lr(&mut self, lr: f64);

    /// Steps taken ([`TrainStep::steps`]).
    fn steps(&self) -> u64;

    /// The runtime's counters ([`TrainStep::stats`]).
    fn stats(&self) -> Stats;

    /// Copies the parameters (and buffers) back into the store ([`TrainStep::sync_to_store`]).
    fn sync_to_store(&mut self) -> Result<()>;

    /// Every stage of each program a step on `inputs` runs ([`TrainStep::inspect`]).
    fn inspect(&mut self, inputs: &[Tensor]) -> Result<Vec<Inspection>>;
}

impl<B: Backend> DynCompiledFn for CompiledFn<B> {
    fn run(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        CompiledFn::run(self, inputs)
    }

    fn stats(&self) -> Stats {
        CompiledFn::stats(self)
    }

    fn sync_to_store(&mut self) -> Result<()> {
        CompiledFn::sync_to_store(self)
    }

    fn refresh_from_store(&mut self) -> Result<()> {
        CompiledFn::refresh_from_store(self)
    }

    fn run_on_device<'a>(&'a self, inputs: &[Tensor]) -> Result<Box<dyn DynDeviceOutputs + 'a>> {
        Ok(Box::new(CompiledFn::run_on_device(self, inputs)?))
    }

    fn inspect(&self, inputs: &[Tensor]) -> Result<Inspection> {
        CompiledFn::inspect(self, inputs)
    }
}

impl<B: Backend> DynTrainStep for TrainStep<B> {
    fn step(&mut self, inputs: &[Tensor]) -> Result<f64> {
        TrainStep::step(self, inputs)
    }

    fn step_async(&mut self, inputs: &[Tensor]) -> Result<()> {
        TrainStep::step_async(self, inputs)
    }

    fn last_loss(&self) -> Result<f64> {
        TrainStep::last_loss(self)
    }

    fn synchronize(&self) -> Result<()> {
        TrainStep::synchronize(self)
    }

    fn set_lr(&mut self, lr: f64) {
        TrainStep::set_lr(self, lr)
    }

    fn steps(&self) -> u64 {
        TrainStep::steps(self)
    }

    fn stats(&self) -> Stats {
        TrainStep::stats(self)
    }

    fn sync_to_store(&mut self) -> Result<()> {
        TrainStep::sync_to_store(self)
    }

    fn inspect(&mut self, inputs: &[Tensor]) -> Result<Vec<Inspection>> {
        TrainStep::inspect(self, inputs)
    }
}

/// Compiles on `backend` (the backend object is consumed by the runtime it goes into).
fn compile_on<B: Backend>(
    backend: B,
    f: TracedFn,
    mode: TraceMode,
) -> Result<Box<dyn DynCompiledFn>> {
    Ok(Box::new(compile(backend, f).with_mode(mode)))
}

fn train_step_on<B: Backend>(
    backend: B,
    store: &ParamStore,
    opt: Box<dyn Optimizer>,
    loss_fn: LossFn,
    mode: TrainMode,
    trace_mode: TraceMode,
) -> Result<Box<dyn DynTrainStep>> {
    let step = TrainStep::new(backend, store, opt, loss_fn)?
        .with_mode(mode)
        .with_trace_mode(trace_mode);
    Ok(Box::new(step))
}

impl<B: Backend + Clone> DynBackend for B {
    fn compile(&self, f: TracedFn, mode: TraceMode) -> Result<Box<dyn DynCompiledFn>> {
        compile_on(self.clone(), f, mode)
    }

    fn train_step(
        &self,
        store: &ParamStore,
        opt: Box<dyn Optimizer>,
        loss_fn: LossFn,
        mode: TrainMode,
        trace_mode: TraceMode,
    ) -> Result<Box<dyn DynTrainStep>> {
        train_step_on(self.clone(), store, opt, loss_fn, mode, trace_mode)
    }
}

/// A backend made by a factory for each function or step (see [`BackendRegistry::register`]).
struct Factory<B, F> {
    make: F,
    /// The backend type the factory makes.
    _marker: std::marker::PhantomData<fn() -> B>,
}

impl<B, F> DynBackend for Factory<B, F>
where
    B: Backend,
    F: Fn() -> Result<B>,
{
    fn compile(&self, f: TracedFn, mode: TraceMode) -> Result<Box<dyn DynCompiledFn>> {
        compile_on((self.make)()?, f, mode)
    }

    fn train_step(
        &self,
        store: &ParamStore,
        opt: Box<dyn Optimizer>,
        loss_fn: LossFn,
        mode: TrainMode,
        trace_mode: TraceMode,
    ) -> Result<Box<dyn DynTrainStep>> {
        train_step_on((self.make)()?, store, opt, loss_fn, mode, trace_mode)
    }
}

/// One named backend of a [`BackendRegistry`]; it is a [`DynBackend`].
pub struct BackendEntry {
    name: String,
    label: String,
    imp: Box<dyn DynBackend>,
}

impl BackendEntry {
    /// The name it is registered under.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A label for people, e.g. a table heading (`"XLA"`).
    pub fn label(&self) -> &str {
        &self.label
    }
}

impl DynBackend for BackendEntry {
    fn compile(&self, f: TracedFn, mode: TraceMode) -> Result<Box<dyn DynCompiledFn>> {
        self.imp.compile(f, mode)
    }

    fn train_step(
        &self,
        store: &ParamStore,
        opt: Box<dyn Optimizer>,
        loss_fn: LossFn,
        mode: TrainMode,
        trace_mode: TraceMode,
    ) -> Result<Box<dyn DynTrainStep>> {
        self.imp.train_step(store, opt, loss_fn, mode, trace_mode)
    }
}

impl std::fmt::Debug for BackendEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BackendEntry({:?}, {:?})", self.name, self.label)
    }
}

/// Backends by name. [`BackendRegistry::with_builtins`] has `xla` (PJRT, label `XLA`) and
/// `eager` (kiln's graph interpreter on libtorch, label `Eager graph`); add your own with
/// [`BackendRegistry::register`].
///
/// ```
/// use kiln::backend::eager::EagerBackend;
/// use kiln::backend::registry::BackendRegistry;
///
/// let mut registry = BackendRegistry::with_builtins();
/// // Any `kiln::backend::Backend`: e.g. your own, wrapping another engine.
/// registry.register("interp", "Interpreter", || Ok(EagerBackend::new()));
/// assert_eq!(registry.names(), ["xla", "eager", "interp"]);
/// ```
#[derive(Debug, Default)]
pub struct BackendRegistry {
    entries: Vec<BackendEntry>,
}

impl BackendRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The built-in backends: `xla` and `eager`.
    pub fn with_builtins() -> Self {
        let mut r = Self::new();
        // One PJRT client for the whole registry, made on first use (so that a program that
        // only uses `eager` never needs the plugin).
        let xla: OnceCell<XlaBackend> = OnceCell::new();
        r.register("xla", "XLA", move || {
            xla.get_or_try_init(XlaBackend::new).cloned()
        });
        r.register("eager", "Eager graph", || Ok(EagerBackend::new()));
        r
    }

    /// Registers (or replaces) a backend under `name`. `factory` is called once per compiled
    /// function or training step built through the entry; make it cheap (e.g. clone a backend
    /// made once). `label` names the backend for people (the harness's column headings).
    pub fn register<B, F>(&mut self, name: &str, label: &str, factory: F) -> &mut Self
    where
        B: Backend,
        F: Fn() -> Result<B> + 'static,
    {
        let entry = BackendEntry {
            name: name.to_string(),
            label: label.to_string(),
            imp: Box::new(Factory {
                make: factory,
                _marker: std::marker::PhantomData,
            }),
        };
        match self.entries.iter_mut().find(|e| e.name == name) {
            Some(e) => *e = entry,
            None => self.entries.push(entry),
        }
        self
    }

    /// The registered names, in registration order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// The backend called `name`, or an error listing the known names.
    pub fn get(&self, name: &str) -> Result<&BackendEntry> {
        self.entries.iter().find(|e| e.name == name).ok_or_else(|| {
            Error::Invalid(format!(
                "unknown backend {name:?}; registered: {}",
                self.names().join(", ")
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::{Init, ParamStore};
    use crate::optim::Sgd;

    fn registry() -> BackendRegistry {
        let mut r = BackendRegistry::with_builtins();
        r.register("broken", "Broken", || -> Result<EagerBackend> {
            Err(Error::Invalid("this backend is out of order".into()))
        });
        r
    }

    #[test]
    fn names_lookup_and_replacement() {
        let mut r = registry();
        assert_eq!(r.names(), ["xla", "eager", "broken"]);
        assert_eq!(r.get("eager").unwrap().label(), "Eager graph");
        let e = r.get("tpu").unwrap_err().to_string();
        assert!(e.contains("unknown backend \"tpu\""), "{e}");
        assert!(e.contains("xla, eager, broken"), "{e}");
        r.register("broken", "Fixed", || Ok(EagerBackend::new()));
        assert_eq!(r.names(), ["xla", "eager", "broken"]);
        assert_eq!(r.get("broken").unwrap().label(), "Fixed");
    }

    #[test]
    fn a_factory_error_is_the_compile_error() {
        let r = registry();
        let f: TracedFn = Box::new(|xs: &[Tensor]| Ok(vec![xs[0].clone()]));
        let e = r.get("broken").unwrap().compile(f, TraceMode::Once).err();
        let e = e.expect("the factory fails").to_string();
        assert!(e.contains("out of order"), "{e}");
    }

    /// The eager entry by name against the same function run eagerly, and a training step by
    /// name against the same step on the concrete backend.
    #[test]
    fn compile_and_train_by_name() {
        let r = registry();
        let backend: &dyn DynBackend = r.get("eager").unwrap();
        let store = ParamStore::with_seed(1);
        let w = store
            .root()
            .param(
                "w",
                &[3],
                Init::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            )
            .unwrap();
        let x = Tensor::randn(&[2, 3], 2).unwrap();

        let wc = w.clone();
        let mut f = backend
            .compile(
                Box::new(move |xs: &[Tensor]| Ok(vec![(&xs[0] * &wc)?.tanh()?])),
                TraceMode::EveryCall,
            )
            .unwrap();
        let expected = (&x * &w).unwrap().tanh().unwrap().to_f64_vec().unwrap();
        for _ in 0..2 {
            let got = f.run(std::slice::from_ref(&x)).unwrap()[0]
                .to_f64_vec()
                .unwrap();
            for (a, b) in got.iter().zip(&expected) {
                assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
        let stats = f.stats();
        assert_eq!((stats.traces, stats.compiles), (2, 1));

        // A concrete backend boxed: the same result.
        let boxed: Box<dyn DynBackend> = Box::new(EagerBackend::new());
        let wc = w.clone();
        let mut g = boxed
            .compile(
                Box::new(move |xs: &[Tensor]| Ok(vec![(&xs[0] * &wc)?.tanh()?])),
                TraceMode::Once,
            )
            .unwrap();
        let got = g.run(std::slice::from_ref(&x)).unwrap()[0]
            .to_f64_vec()
            .unwrap();
        let via_registry = f.run(std::slice::from_ref(&x)).unwrap()[0]
            .to_f64_vec()
            .unwrap();
        assert_eq!(got, via_registry);

        // One SGD step by name, and the same step on the concrete backend from the same start.
        let initial = w.to_f64_vec().unwrap();
        let initial_host = w.to_host().unwrap();
        let loss_of =
            |w: Tensor| -> LossFn { Box::new(move |xs: &[Tensor]| (&xs[0] * &w)?.mean_all()) };
        let mut by_name = backend
            .train_step(
                &store,
                Box::new(Sgd::new()),
                loss_of(w.clone()),
                TrainMode::Fused,
                TraceMode::Once,
            )
            .unwrap();
        by_name.set_lr(0.5);
        let loss = by_name.step(std::slice::from_ref(&x)).unwrap();
        by_name.sync_to_store().unwrap();
        assert_eq!(by_name.steps(), 1);
        assert!((by_name.last_loss().unwrap() - loss).abs() < 1e-12);
        let after_by_name = w.to_f64_vec().unwrap();

        store.set("w", &initial_host).unwrap();
        let mut direct =
            TrainStep::new(EagerBackend::new(), &store, Sgd::new(), loss_of(w.clone()))
                .unwrap()
                .with_mode(TrainMode::Fused)
                .with_lr(0.5);
        let direct_loss = direct.step(std::slice::from_ref(&x)).unwrap();
        direct.sync_to_store().unwrap();
        assert_eq!(loss, direct_loss);
        assert_eq!(after_by_name, w.to_f64_vec().unwrap());
        assert_ne!(after_by_name, initial);
    }
}
