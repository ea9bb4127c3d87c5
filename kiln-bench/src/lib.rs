//! kiln's benchmark harness: PyTorch's `benchmarks/dynamo/torchbench.py` for kiln.
//!
//! It runs models eagerly (libtorch, the baseline) and compiled on a backend, in one or more
//! *variants* (trace once / trace every call; for training also split / fused graphs), and
//! reports per model the speedup of each variant over eager, eager's time per iteration, the
//! compile time and an accuracy check. The `kiln-bench` binary is its command line
//! (`cargo run --release -p kiln-bench -- --help`); this crate is the library underneath, so
//! your own binary can bench your own models in a few lines:
//!
//! ```no_run
//! use kiln::zoo;
//! use kiln_bench::{run_benchmark, BenchOptions};
//!
//! let models = vec![zoo::build("linear", 0)?];
//! let report = run_benchmark(models, &BenchOptions::default())?;
//! println!("{report}");
//! report.write_csv("linear.csv")?;
//! # Ok::<(), kiln_bench::Error>(())
//! ```
//!
//! Backends are picked by name from a [`BackendRegistry`] (kiln's
//! [`kiln::backend::registry`]): `--backend xla` (default) or `eager`, or your own through
//! [`cli::main_with`].
//!
//! # Method (torchbench.py's `speedup_experiment`)
//!
//! For each model:
//!
//! 1. **Warm-up** (`warmup` calls, at least one; excluded from the timings): eager first, then
//!    each variant from a fresh compiled function (or training step). A variant's first call
//!    traces and compiles: its wall time is the reported *compile s*. The warm-up results are
//!    the accuracy check against eager's under [`Tolerance`]: inference, every call's output;
//!    training, the first step from the same initial parameters, its loss and its parameter
//!    update ([`UPDATE_RTOL`]).
//! 2. **Timed repetitions** (`repeat`): each run is `iterations_per_run` iterations with one
//!    sync (reading the result back) at the end. Every model's eager repetitions run first,
//!    before any compiled run in the process (kiln's libtorch kernels used to start OpenMP
//!    teams on XLA's threads, which slowed eager libtorch down in the same process, see
//!    `examples/eager_interference.rs`; eager is still timed as a user runs it, in a process
//!    that has not run compiled code); then each model's variants, their repetitions
//!    interleaved so that frequency scaling and background load hit all of them alike, each
//!    timed run preceded by `switch_in` untimed calls of the same contender (default 1; the
//!    first call after a switch pays for the other side's use of the caches). With `randomize_input`, every repetition draws fresh seeded inputs (integer inputs
//!    such as token ids are kept), and inference results are checked again.
//! 3. **Result**: per-iteration medians; `speedup = median(eager) / median(variant)`; the
//!    p-value of Welch's t-test on the two samples (`SAME` when above 0.1: no evidence of a
//!    difference); a `geomean` row over the models.
//!
//! With [`Experiment::Accuracy`] only the checks run: eager twice (a disagreement is reported
//! as `eager_variation`), then each variant, with no timing.

mod accuracy;
pub mod cli;
mod error;
mod infer;
mod memory;
mod report;
mod runner;
pub mod stats;
pub mod threads;
mod train;
pub mod user;

pub use accuracy::{
    compare, Accuracy, AccuracyStatus, Reference, Tolerance, NORM_RTOL, UPDATE_RTOL,
};
pub use error::{Error, Result};
pub use kiln::backend::registry::{BackendEntry, BackendRegistry};
pub use report::{Column, ModelRow, Report, VariantResult};
pub use user::{ModelSpec, UserModelSpec};

use kiln::compile::TraceMode;
use kiln::zoo::{self, Model};

/// What a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Experiment {
    /// Speedups over eager, with the accuracy check of the warm-up results (default).
    Performance,
    /// Only the accuracy checks, in more detail (eager variation too).
    Accuracy,
}

/// How a compiled training step is split into executables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrainGraphs {
    /// Forward, backward and optimizer graphs, three executables (as AOTAutograd does).
    Split,
    /// Forward, backward and update in one executable.
    Fused,
}

/// One compiled configuration a model is measured in: a column of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Trace once per input signature, or every call.
    pub mode: TraceMode,
    /// Training only: split or fused graphs.
    pub graphs: Option<TrainGraphs>,
}

impl Variant {
    /// The column heading, e.g. `XLA (trace once)` or `XLA fused (trace everytime)` (torch_xla's
    /// wording).
    pub fn label(&self, backend_label: &str) -> String {
        let mode = match self.mode {
            TraceMode::Once => "trace once",
            TraceMode::EveryCall => "trace everytime",
        };
        match self.graphs {
            None => format!("{backend_label} ({mode})"),
            Some(TrainGraphs::Split) => format!("{backend_label} split ({mode})"),
            Some(TrainGraphs::Fused) => format!("{backend_label} fused ({mode})"),
        }
    }

    /// A short name for secondary columns: `once`, `every`, `split once`, ...
    pub fn short(&self) -> String {
        let mode = match self.mode {
            TraceMode::Once => "once",
            TraceMode::EveryCall => "every",
        };
        match self.graphs {
            None => mode.to_string(),
            Some(TrainGraphs::Split) => format!("split {mode}"),
            Some(TrainGraphs::Fused) => format!("fused {mode}"),
        }
    }
}

/// Options of a benchmark run; [`Default`] gives the command line's defaults.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Performance (default) or accuracy only.
    pub experiment: Experiment,
    /// Benchmark training steps instead of inference.
    pub training: bool,
    /// The backend's name in the registry (default `xla`).
    pub backend: String,
    /// Trace modes to measure (default both).
    pub modes: Vec<TraceMode>,
    /// Training graph layouts to measure (default both); ignored for inference.
    pub train_graphs: Vec<TrainGraphs>,
    /// Iterations per timed run, with one sync at its end (default 1).
    pub iterations_per_run: usize,
    /// Fresh random inputs for every repetition.
    pub randomize_input: bool,
    /// Timed repetitions (default 10).
    pub repeat: usize,
    /// Warm-up calls per contender (default 3; at least 1: the first is the compile and the
    /// accuracy check).
    pub warmup: usize,
    /// Untimed calls of a contender right before each of its timed runs in the interleaved
    /// phase (default 1; 0: strict alternation, as torchbench.py times).
    ///
    /// Why: the first call after another contender ran meets caches that contender filled
    /// (each side holds its own copy of the weights and activations). On a 2-vCPU Zen 3,
    /// bert inference, one eager call and K compiled calls in turn, the K-th compiled call
    /// took 22.2 / 26.5 ms (median) for K = 1 and 17.2 / 19.5 ms for K = 5, while eager's
    /// took 17.4 ms either way; K = 2 recovered most of it (21.0–22.6 vs 25.8–26.9 ms). A user
    /// runs one of the two, so neither side's timed call should follow the other's.
    pub switch_in: usize,
    /// Batch size; `None` uses [`default_batch_size`].
    pub batch_size: Option<usize>,
    /// Seed of the inputs (parameters are seeded by whoever builds the model).
    pub seed: u64,
    /// Learning rate of the training steps (SGD).
    pub lr: f64,
    /// The accuracy criterion; `None` picks [`Tolerance::INFERENCE`] or
    /// [`Tolerance::TRAINING`].
    pub tolerance: Option<Tolerance>,
    /// Show progress on stderr (a bar on a terminal, a line per model otherwise).
    pub progress: bool,
    /// libtorch's intra-op threads for eager (`None`: libtorch's default, one per core). The
    /// compiled side's threads are set by the process's CPU affinity (see [`threads`]), which
    /// the command line restricts to the same number.
    pub threads: Option<usize>,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions {
            experiment: Experiment::Performance,
            training: false,
            backend: "xla".into(),
            modes: vec![TraceMode::Once, TraceMode::EveryCall],
            train_graphs: vec![TrainGraphs::Split, TrainGraphs::Fused],
            iterations_per_run: 1,
            randomize_input: false,
            repeat: 10,
            warmup: 3,
            switch_in: 1,
            batch_size: None,
            seed: 0,
            lr: 0.01,
            tolerance: None,
            progress: false,
            threads: None,
        }
    }
}

impl BenchOptions {
    /// The variants (table columns) these options measure, in column order: modes outer,
    /// split before fused.
    pub fn variants(&self) -> Vec<Variant> {
        let mut out = Vec::new();
        for &mode in &self.modes {
            if self.training {
                for &g in &self.train_graphs {
                    out.push(Variant {
                        mode,
                        graphs: Some(g),
                    });
                }
            } else {
                out.push(Variant { mode, graphs: None });
            }
        }
        out
    }

    /// The accuracy criterion in force.
    pub fn tolerance(&self) -> Tolerance {
        self.tolerance.unwrap_or(if self.training {
            Tolerance::TRAINING
        } else {
            Tolerance::INFERENCE
        })
    }

    fn validate(&self) -> Result<()> {
        if self.modes.is_empty() {
            return Err(Error::Invalid("no trace mode to benchmark".into()));
        }
        if self.training && self.train_graphs.is_empty() {
            return Err(Error::Invalid(
                "no training graph layout (split/fused) to benchmark".into(),
            ));
        }
        if self.iterations_per_run == 0 {
            return Err(Error::Invalid(
                "--iterations-per-run must be at least 1".into(),
            ));
        }
        if self.experiment == Experiment::Performance && self.repeat < 2 {
            return Err(Error::Invalid(
                "--repeat must be at least 2 (medians and a t-test need two samples)".into(),
            ));
        }
        if self.threads == Some(0) {
            return Err(Error::Invalid("--threads must be at least 1".into()));
        }
        if self.batch_size == Some(0) {
            return Err(Error::Invalid("--batch-size must be at least 1".into()));
        }
        Ok(())
    }
}

/// The batch size used when none is given: 2 for `linear` (torchbench's `randn(2, 10)`), 4 for
/// the other zoo models and for user models.
pub fn default_batch_size(model: &str) -> usize {
    match model {
        "linear" => 2,
        _ => 4,
    }
}

/// The representative subset of the zoo that the command line runs by default: a residual CNN,
/// a mobile (depthwise) CNN, a small plain CNN, both transformers and torchbench's
/// `LinearModel`, chosen so that inference and training together take under two minutes on
/// 2 idle CPU cores (1 min 40 s measured). `--all` adds resnet50, resnext50_32x4d,
/// alexnet, mnasnet1_0 and vgg16. Names not in the zoo are skipped.
pub const DEFAULT_SUBSET: &[&str] = &[
    "resnet18",
    "mobilenet_v2",
    "squeezenet1_1",
    "bert",
    "vit",
    "linear",
];

/// The default subset, restricted to models the zoo has.
pub fn default_models() -> Vec<&'static str> {
    DEFAULT_SUBSET
        .iter()
        .copied()
        .filter(|n| zoo::NAMES.contains(n))
        .collect()
}

/// A model to benchmark, built when its turn comes, so that only one model's parameters are in
/// memory at a time (the whole zoo at once would not fit everywhere).
pub struct ModelSource {
    name: String,
    build: Box<dyn FnOnce() -> kiln::Result<Box<dyn Model>>>,
}

impl ModelSource {
    /// A model built by `build` when its turn comes; `name` labels its row if building fails.
    pub fn new(
        name: impl Into<String>,
        build: impl FnOnce() -> kiln::Result<Box<dyn Model>> + 'static,
    ) -> Self {
        ModelSource {
            name: name.into(),
            build: Box::new(build),
        }
    }

    /// A model that is already built.
    pub fn ready(model: Box<dyn Model>) -> Self {
        let name = model.name().to_string();
        ModelSource::new(name, move || Ok(model))
    }

    /// The zoo model `name`, parameters seeded with `seed`.
    pub fn zoo(name: &str, seed: u64) -> Self {
        let n = name.to_string();
        ModelSource::new(name, move || zoo::build(&n, seed))
    }

    /// The model's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn build(self) -> kiln::Result<Box<dyn Model>> {
        (self.build)()
    }
}

impl std::fmt::Debug for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ModelSource({:?})", self.name)
    }
}

/// Runs the benchmark on `models` with the built-in backends; see the module docs.
///
/// A model that fails (to run eagerly, to compile, to run compiled) does not stop the run: its
/// row reports the error.
pub fn run_benchmark(models: Vec<Box<dyn Model>>, opts: &BenchOptions) -> Result<Report> {
    let sources = models.into_iter().map(ModelSource::ready).collect();
    run_sources(sources, opts, &BackendRegistry::with_builtins())
}

/// Runs the benchmark on models built one at a time, with backends from `registry`
/// (`opts.backend` names one).
pub fn run_sources(
    sources: Vec<ModelSource>,
    opts: &BenchOptions,
    registry: &BackendRegistry,
) -> Result<Report> {
    opts.validate()?;
    let backend = registry.get(&opts.backend)?;
    runner::run(sources, opts, backend)
}
