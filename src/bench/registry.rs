//! Named backends for `--backend NAME`.
//!
//! [`Backend`] has associated types, so backends cannot sit in one collection as trait objects.
//! The registry keeps, per name, a factory of a concrete backend and erases its type behind the
//! harness's own small interface (build an inference or a training contender).
//!
//! ```no_run
//! use kiln::backend::eager::EagerBackend;
//! use kiln::bench::BackendRegistry;
//!
//! let mut registry = BackendRegistry::with_builtins();
//! // Any `kiln::backend::Backend`: e.g. your own, wrapping another engine.
//! registry.register("interp", "Interpreter", || Ok(EagerBackend::new()));
//! assert!(registry.names().contains(&"interp"));
//! ```

use super::infer::InferenceContender;
use super::runner::Contender;
use super::train::TrainFactory;
use super::SharedModel;
use super::TrainGraphs;
use crate::backend::eager::EagerBackend;
use crate::backend::xla::XlaBackend;
use crate::backend::Backend;
use crate::compile::{compile, TraceMode};
use crate::error::{Error, Result};
use crate::trace::Tensor;
use once_cell::unsync::OnceCell;

/// A function of input tensors to output tensors, as compiled by the harness.
pub(crate) type InferFn = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send>;

/// A backend as the harness sees it: it builds compiled contenders.
pub(crate) trait BenchBackend {
    /// Compiles `f` in `mode`: an inference contender.
    fn inference(&self, f: InferFn, mode: TraceMode) -> Result<Box<dyn Contender>>;

    /// A compiled training step of `model`.
    fn training(
        &self,
        model: SharedModel,
        graphs: TrainGraphs,
        mode: TraceMode,
        lr: f64,
    ) -> Result<Box<dyn Contender>>;
}

struct Registered<B, F> {
    factory: F,
    /// The backend type the factory makes.
    _marker: std::marker::PhantomData<fn() -> B>,
}

impl<B, F> BenchBackend for Registered<B, F>
where
    B: Backend,
    F: Fn() -> Result<B>,
{
    fn inference(&self, f: InferFn, mode: TraceMode) -> Result<Box<dyn Contender>> {
        let backend = (self.factory)()?;
        let compiled = compile(backend, f).with_mode(mode);
        Ok(Box::new(InferenceContender::new(compiled)))
    }

    fn training(
        &self,
        model: SharedModel,
        graphs: TrainGraphs,
        mode: TraceMode,
        lr: f64,
    ) -> Result<Box<dyn Contender>> {
        let backend = (self.factory)()?;
        TrainFactory::compiled(backend, model, graphs, mode, lr)
    }
}

/// One named backend of a [`BackendRegistry`].
pub struct BackendEntry {
    name: String,
    label: String,
    imp: Box<dyn BenchBackend>,
}

impl BackendEntry {
    /// The name given to `--backend`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The label used in column headings (`"XLA"` gives `"XLA (trace once)"`).
    pub fn label(&self) -> &str {
        &self.label
    }

    pub(crate) fn imp(&self) -> &dyn BenchBackend {
        self.imp.as_ref()
    }
}

impl std::fmt::Debug for BackendEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BackendEntry({:?}, {:?})", self.name, self.label)
    }
}

/// The backends `--backend` can name. [`BackendRegistry::with_builtins`] has `xla` (PJRT,
/// label `XLA`) and `eager` (kiln's graph interpreter on libtorch, label `Eager graph`); add
/// your own with [`BackendRegistry::register`].
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
        // One PJRT client for the whole run, made on first use (so `--backend eager` never
        // needs the plugin).
        let xla: OnceCell<XlaBackend> = OnceCell::new();
        r.register("xla", "XLA", move || {
            xla.get_or_try_init(XlaBackend::new).cloned()
        });
        r.register("eager", "Eager graph", || Ok(EagerBackend::new()));
        r
    }

    /// Registers (or replaces) a backend under `name`. `factory` is called once per compiled
    /// function or training step the harness builds; make it cheap (e.g. clone a backend made
    /// once). `label` heads the table's columns.
    pub fn register<B, F>(&mut self, name: &str, label: &str, factory: F) -> &mut Self
    where
        B: Backend,
        F: Fn() -> Result<B> + 'static,
    {
        let entry = BackendEntry {
            name: name.to_string(),
            label: label.to_string(),
            imp: Box::new(Registered {
                factory,
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
