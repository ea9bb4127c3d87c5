//! The benchmark's command line (the `kiln-bench` binary, and the `main` of user-model scratch
//! crates). `cargo run --release -p kiln-bench -- --help` explains every flag.

use super::user::{forward_args, run_user_model, ModelSpec, Workspace};
use super::{
    default_models, run_sources, BackendRegistry, BenchOptions, Experiment, ModelSource,
    TrainGraphs,
};
use crate::error::{Error, Result};
use crate::threads;
use clap::{Parser, ValueEnum};
use kiln::backend::xla::XlaBackend;
use kiln::compile::TraceMode;
use kiln::nn::ParamStore;
use kiln::zoo::{self, Model};
use std::cell::OnceCell;
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;

/// Which trace modes to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ModeArg {
    /// Trace once per input signature, then replay (column "XLA (trace once)").
    Once,
    /// Trace every call, look the executable up by graph fingerprint (column "XLA (trace
    /// everytime)").
    Every,
    /// Both columns.
    Both,
}

const AFTER_HELP: &str = "\
Method (PyTorch's torchbench.py): warm-up calls are excluded from the timings (a variant's
first call, which traces and compiles, is reported as `compile s`); every model's eager
repetitions run first, then each model's compiled variants, interleaved with each other (see
Threads), each timed over --iterations-per-run iterations with one sync at the end; speedup = median(eager) / median(compiled), with the p-value of Welch's t-test (SAME:
p > 0.1); a geomean row closes the table. Accuracy: each compiled result is checked against
eager: inference outputs allclose(rtol=1e-3, atol=1e-3) or (cosine >= 0.999 and norms within
1%); training, the first step from the same initial parameters: its loss allclose(rtol=1e-3,
atol=1e-5) and its parameter update: relative L2 error over all parameters within
max(1e-2, 5x the reference update's own change when its inputs move by float32 rounding;
torchbench's mean-of-logits loss is ill-conditioned through deep batch-norm networks). Later
steps amplify rounding chaotically, so they are not compared. Models with dropout are checked against
kiln's eager graph interpreter (libtorch draws other masks), marked `vs graph interp`.

Threads: by default each side runs as a user would run it: libtorch at its default intra-op
threads (one per core) and the XLA CPU plugin's pool (one per CPU the process may use).
--threads N puts both on N: libtorch's set_num_threads(N) (in eager and in the libtorch kernels
inside XLA executables), and the process's CPU affinity
restricted to N CPUs before the PJRT client is created. The XLA CPU plugin has no thread-count
option and keeps its pool's size (4 threads on 2 vCPUs); the affinity confines those threads
to the N CPUs, so both sides get N cores of compute. OpenMP waits as libtorch's users have it
(libgomp's default unless OMP_WAIT_POLICY is set). Every model's eager runs are timed first,
before any compiled run in the process: libtorch kernels inside XLA executables start OpenMP
teams on XLA's worker threads, and with more OpenMP threads than CPUs libgomp stops spinning at
every team's barriers, eager's included (resnet18 eager 12.4 ms before, 19.5 ms after). The
compiled variants are then timed interleaved with each other. The table header and CSV say
each side's threads and which PJRT plugin ran (--plugin PATH).

Training timer: a compiled run stops the clock after waiting for all of its last step's device
work (updated parameters and optimizer state, not just the loss, which in split mode comes out
of the forward executable). Inference timer: a compiled run leaves each iteration's outputs on
the device (no per-iteration download), then waits for all of them and reads the last one back:
one sync per run of --iterations-per-run iterations.

User models: --only path:FILE,class:NAME builds a scratch crate that includes FILE (a Rust file
defining `NAME: kiln::zoo::Model` with `fn new(store: &kiln::nn::ParamStore) ->
kiln::Result<NAME>`; relative to the current directory), depending on kiln and kiln-bench in
kiln's workspace and sharing its target directory, and runs it with the other flags. The
workspace is --workspace DIR, else $KILN_BENCH_WORKSPACE, else the directory above this binary
(<workspace>/target/release/kiln-bench) or above the current directory. See
benches/user_models/linear_model.rs.

Examples:
  cargo run --release -p kiln-bench                           # default subset, inference
  cargo run --release -p kiln-bench -- --training             # default subset, training
  cargo run --release -p kiln-bench -- --only resnet18,bert --repeat 5 --csv out.csv
  cargo run --release -p kiln-bench -- --accuracy --all
  cargo run --release -p kiln-bench -- --only path:my_model.rs,class:MyModel --backend eager
  target/release/kiln-bench --only path:my_model.rs,class:MyModel   # from any directory";

/// kiln's benchmark harness: eager (libtorch) against compiled (trace once / trace every call)
/// on the model zoo or on your own model, with torchbench.py's method and table.
#[derive(Parser, Debug, Clone)]
#[command(name = "bench", version, after_long_help = AFTER_HELP)]
pub struct Cli {
    /// Measure speedups over eager (the default experiment).
    #[arg(long, conflicts_with = "accuracy")]
    pub performance: bool,

    /// Only check compiled results against eager (eager twice, to detect eager variation; no
    /// timing). Exits with status 1 if a check fails.
    #[arg(long)]
    pub accuracy: bool,

    /// Benchmark training steps (forward, loss, backward, SGD update) instead of inference.
    #[arg(long)]
    pub training: bool,

    /// The compiled backend: `xla` (PJRT), `eager` (kiln's graph interpreter on libtorch), or a
    /// name registered through kiln::backend::registry::BackendRegistry.
    #[arg(long, default_value = "xla", value_name = "NAME")]
    pub backend: String,

    /// Trace once per input signature, trace every call, or both (two columns).
    #[arg(long, value_enum, default_value_t = ModeArg::Both)]
    pub mode: ModeArg,

    /// Training: measure split steps (forward, backward and optimizer executables). With
    /// neither --split nor --fused, both are measured as separate columns.
    #[arg(long)]
    pub split: bool,

    /// Training: measure fused steps (one executable for forward, backward and update).
    #[arg(long)]
    pub fused: bool,

    /// Iterations in each timed run, with one sync (result read back) at its end. Training:
    /// compiled steps before the last run without waiting. Inference: a compiled call returns
    /// host tensors, so every call waits for its result.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub iterations_per_run: usize,

    /// Fresh seeded random inputs for every repetition (integer inputs such as token ids are
    /// kept); inference results are checked against eager on each.
    #[arg(long)]
    pub randomize_input: bool,

    /// Timed repetitions (each: one eager run, then one run of each variant).
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub repeat: usize,

    /// Warm-up calls per contender, excluded from the timings (at least 1: the first traces,
    /// compiles and is checked against eager).
    #[arg(long, default_value_t = 3, value_name = "N")]
    pub warmup: usize,

    /// Untimed calls of a contender right before each of its timed runs, after the other
    /// contenders ran (0: strict alternation, as torchbench.py times; the first call after a
    /// switch meets caches the other side filled).
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub switch_in: usize,

    /// Batch size (default: 2 for `linear`, as in torchbench.py's example, 4 for the others).
    #[arg(long, value_name = "N")]
    pub batch_size: Option<usize>,

    /// Zoo models to run, comma-separated, or a model in your own Rust file:
    /// `path:FILE,class:NAME` (FILE relative to the current directory or absolute).
    #[arg(long, value_name = "NAMES | path:FILE,class:NAME")]
    pub only: Option<String>,

    /// Run the whole zoo (default: a representative subset that finishes in a few minutes on
    /// 2 cores).
    #[arg(long, conflicts_with = "only")]
    pub all: bool,

    /// Also write the table as CSV (one row per model, the table's columns plus detail
    /// columns).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,

    /// Seed of parameters and inputs.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,

    /// Learning rate of the training steps (SGD).
    #[arg(long, default_value_t = 0.01)]
    pub lr: f64,

    /// Threads for BOTH sides; 0 (the default) = each side's own default: libtorch's
    /// intra-op threads (one per core) and the XLA CPU plugin's pool. N > 0 sets libtorch's
    /// intra-op threads to N and restricts the whole process to N CPUs (sched_setaffinity)
    /// before XLA's client exists. The XLA CPU plugin has no thread-count option; its pool
    /// gets one thread per CPU the process may use (kiln asks for at most one CPU device per
    /// CPU), so N threads on the N CPUs. For single-core comparisons: 1.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub threads: usize,

    /// The PJRT plugin (.so) of the `xla` backend. Default: $KILN_PJRT_PLUGIN, else the
    /// plugin kiln's bootstrap installed. The table header and the CSV name the plugin that
    /// ran and its platform version.
    #[arg(long, value_name = "PATH")]
    pub plugin: Option<PathBuf>,

    /// No progress on stderr.
    #[arg(long)]
    pub quiet: bool,

    /// List the zoo, the default subset and the backends, then exit.
    #[arg(long)]
    pub list: bool,

    /// kiln's workspace (the directory with kiln's Cargo.toml and kiln-bench/), which
    /// `--only path:` models are built against. Default: $KILN_BENCH_WORKSPACE, else found
    /// above this binary or the current directory.
    #[arg(long, value_name = "DIR")]
    pub workspace: Option<PathBuf>,
}

impl Cli {
    /// The options these flags give.
    pub fn options(&self) -> BenchOptions {
        let modes = match self.mode {
            ModeArg::Once => vec![TraceMode::Once],
            ModeArg::Every => vec![TraceMode::EveryCall],
            ModeArg::Both => vec![TraceMode::Once, TraceMode::EveryCall],
        };
        let train_graphs = match (self.split, self.fused) {
            (true, false) => vec![TrainGraphs::Split],
            (false, true) => vec![TrainGraphs::Fused],
            _ => vec![TrainGraphs::Split, TrainGraphs::Fused],
        };
        BenchOptions {
            experiment: if self.accuracy {
                Experiment::Accuracy
            } else {
                Experiment::Performance
            },
            training: self.training,
            backend: self.backend.clone(),
            modes,
            train_graphs,
            iterations_per_run: self.iterations_per_run,
            randomize_input: self.randomize_input,
            repeat: self.repeat,
            warmup: self.warmup,
            switch_in: self.switch_in,
            batch_size: self.batch_size,
            seed: self.seed,
            lr: self.lr,
            tolerance: None,
            progress: !self.quiet,
            threads: (self.threads > 0).then_some(self.threads),
        }
    }
}

/// The `xla` backend the harness made, shared with the registry entry, so that the report can
/// name the plugin that ran.
type XlaCell = Rc<OnceCell<XlaBackend>>;

/// The built-in backends, with `xla` made through `cell` (on first use, from
/// `$KILN_PJRT_PLUGIN` or the bootstrap's plugin: `--plugin` sets the variable).
fn builtins_with(cell: &XlaCell) -> BackendRegistry {
    let mut registry = BackendRegistry::with_builtins();
    let c = cell.clone();
    registry.register("xla", "XLA", move || {
        if let Some(b) = c.get() {
            return Ok(b.clone());
        }
        let b = XlaBackend::new()?;
        Ok(c.get_or_init(|| b).clone())
    });
    registry
}

/// The plugin that ran: `plugin PATH, cpu VERSION, PJRT API 0.N`.
fn xla_detail(b: &XlaBackend) -> String {
    let (major, minor) = b.api_version();
    format!(
        "plugin {}, platform {} version {:?}, PJRT C API {major}.{minor}",
        b.plugin_path().display(),
        b.platform(),
        b.platform_version()
    )
}

/// Before anything starts: `--plugin` in `$KILN_PJRT_PLUGIN`.
fn prepare_process(cli: &Cli) {
    if let Some(p) = &cli.plugin {
        let abs = std::path::absolute(p).unwrap_or_else(|_| p.clone());
        std::env::set_var("KILN_PJRT_PLUGIN", abs);
    }
}

/// Runs the report for `sources`, prints it, writes the CSV; the exit code.
fn report_and_exit(
    cli: &Cli,
    sources: Vec<ModelSource>,
    registry: &BackendRegistry,
    xla: Option<&XlaCell>,
) -> Result<ExitCode> {
    if let Some(p) = &cli.plugin {
        if !p.is_file() {
            return Err(Error::Invalid(format!(
                "--plugin {}: no such file",
                p.display()
            )));
        }
    }
    if cli.threads > 0 {
        // Before the PJRT client exists: the XLA CPU plugin sizes its pool from the affinity.
        threads::limit_cpus(cli.threads)?;
    }
    let opts = cli.options();
    let mut report = run_sources(sources, &opts, registry)?;
    if cli.backend == "xla" {
        report.compiled_detail = xla.and_then(|c| c.get()).map(xla_detail);
    }
    print!("{report}");
    if let Some(path) = &cli.csv {
        report.write_csv(path)?;
        eprintln!("wrote {}", path.display());
    }
    let all_failed = report
        .rows
        .iter()
        .all(|r| r.error.is_some() || r.results.iter().all(|v| v.error.is_some()));
    Ok(
        if all_failed || (opts.experiment == Experiment::Accuracy && !report.all_passed()) {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        },
    )
}

fn exit_with(r: Result<ExitCode>) -> ExitCode {
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn list(registry: &BackendRegistry) {
    println!("zoo models: {}", zoo::NAMES.join(", "));
    println!("default subset: {}", default_models().join(", "));
    println!("backends: {}", registry.names().join(", "));
}

/// The `kiln-bench` binary's `main`: the zoo (or `--only path:`) with the built-in backends.
pub fn main() -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let cli = Cli::parse_from(&args);
    prepare_process(&cli);
    let cell = XlaCell::default();
    let registry = builtins_with(&cell);
    exit_with(run(&cli, &args[1..], &registry, Some(&cell)))
}

/// Like [`main`], with your own backends (`--backend NAME` picks one of `registry`).
pub fn main_with(registry: BackendRegistry) -> ExitCode {
    let args: Vec<OsString> = std::env::args_os().collect();
    let cli = Cli::parse_from(&args);
    prepare_process(&cli);
    exit_with(run_cli(&cli, &args[1..], &registry))
}

/// Runs parsed flags: `args` are the raw arguments (without the program name), forwarded to a
/// user-model build.
pub fn run_cli(cli: &Cli, args: &[OsString], registry: &BackendRegistry) -> Result<ExitCode> {
    run(cli, args, registry, None)
}

fn run(
    cli: &Cli,
    args: &[OsString],
    registry: &BackendRegistry,
    xla: Option<&XlaCell>,
) -> Result<ExitCode> {
    if cli.list {
        list(registry);
        return Ok(ExitCode::SUCCESS);
    }
    // Fail fast on a bad backend name, before building anything.
    registry.get(&cli.backend)?;
    let names: Vec<String> = match cli.only.as_deref().map(ModelSpec::parse).transpose()? {
        Some(ModelSpec::User(spec)) => {
            let workspace = Workspace::locate(cli.workspace.as_deref())?;
            let status = run_user_model(&spec, &workspace, &forward_args(args))?;
            return Ok(match status.code() {
                Some(0) => ExitCode::SUCCESS,
                Some(c) => ExitCode::from(u8::try_from(c).unwrap_or(1)),
                None => ExitCode::FAILURE,
            });
        }
        Some(ModelSpec::Zoo(names)) => {
            let unknown: Vec<&String> = names
                .iter()
                .filter(|n| !zoo::NAMES.contains(&n.as_str()))
                .collect();
            if !unknown.is_empty() {
                return Err(Error::Invalid(format!(
                    "unknown zoo model(s) {}; known: {} (or --only path:FILE,class:NAME)",
                    unknown
                        .iter()
                        .map(|n| format!("{n:?}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    zoo::NAMES.join(", ")
                )));
            }
            names
        }
        None if cli.all => zoo::NAMES.iter().map(|s| s.to_string()).collect(),
        None => default_models().iter().map(|s| s.to_string()).collect(),
    };
    let sources = names
        .iter()
        .map(|n| ModelSource::zoo(n, cli.seed))
        .collect();
    report_and_exit(cli, sources, registry, xla)
}

/// The `main` of a user-model scratch crate (see [`crate::user`]): benchmarks the one
/// model `make` builds (named `class` if it fails to build), with the command-line flags.
pub fn user_main<F>(class: &str, make: F) -> ExitCode
where
    F: FnOnce(&ParamStore) -> kiln::Result<Box<dyn Model>> + 'static,
{
    let cli = Cli::parse();
    prepare_process(&cli);
    if cli.only.is_some() || cli.all {
        eprintln!("error: --only/--all select zoo models; this binary benchmarks {class}");
        return ExitCode::FAILURE;
    }
    if cli.list {
        list(&BackendRegistry::with_builtins());
        return ExitCode::SUCCESS;
    }
    let seed = cli.seed;
    let source = ModelSource::new(class, move || make(&ParamStore::with_seed(seed)));
    let cell = XlaCell::default();
    exit_with(report_and_exit(
        &cli,
        vec![source],
        &builtins_with(&cell),
        Some(&cell),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_match_bench_options() {
        let cli = Cli::parse_from(["bench"]);
        let o = cli.options();
        let d = BenchOptions {
            progress: true,
            ..BenchOptions::default()
        };
        assert_eq!(format!("{o:?}"), format!("{d:?}"));
    }

    #[test]
    fn flags_map_to_options() {
        let cli = Cli::parse_from([
            "bench",
            "--training",
            "--fused",
            "--mode",
            "once",
            "--iterations-per-run",
            "4",
            "--randomize-input",
            "--repeat",
            "7",
            "--batch-size",
            "8",
            "--accuracy",
        ]);
        let o = cli.options();
        assert!(o.training && o.randomize_input);
        assert_eq!(o.experiment, Experiment::Accuracy);
        assert_eq!(o.modes, vec![TraceMode::Once]);
        assert_eq!(o.train_graphs, vec![TrainGraphs::Fused]);
        assert_eq!((o.iterations_per_run, o.repeat), (4, 7));
        assert_eq!(o.batch_size, Some(8));
        assert!(Cli::try_parse_from(["bench", "--accuracy", "--performance"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--all", "--only", "linear"]).is_err());
        assert!(Cli::try_parse_from(["bench", "--mode", "sometimes"]).is_err());
    }
}
