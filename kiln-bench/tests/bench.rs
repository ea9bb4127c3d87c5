//! The benchmark harness end to end: the library on the zoo's linear model (rows, columns,
//! CSV), and `--only path:FILE,class:NAME` on model files written outside the repository.

use kiln::compile::TraceMode;
use kiln::zoo;
use kiln::Tensor;
use kiln_bench::user::{run_user_model, ModelSpec, UserModelSpec, Workspace, WORKSPACE_ENV};
use kiln_bench::{
    run_benchmark, run_sources, BackendRegistry, BenchOptions, Experiment, ModelSource,
};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

fn quick() -> BenchOptions {
    BenchOptions {
        repeat: 3,
        warmup: 1,
        ..BenchOptions::default()
    }
}

/// Runs `cmd`, asserts that it succeeded (showing its output if not), returns its stdout.
fn stdout_of_success(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn csv_rows(text: &str) -> Vec<Vec<String>> {
    let mut r = csv::Reader::from_reader(text.as_bytes());
    let mut rows = vec![r.headers().unwrap().iter().map(String::from).collect()];
    for rec in r.records() {
        rows.push(rec.unwrap().iter().map(String::from).collect());
    }
    rows
}

#[test]
fn inference_report_rows_columns_and_csv() {
    let report = run_benchmark(vec![zoo::build("linear", 0).unwrap()], &quick()).unwrap();
    assert_eq!(report.rows.len(), 1);
    let row = &report.rows[0];
    assert_eq!(row.model, "linear");
    assert_eq!(row.batch_size, 2);
    assert!(row.error.is_none(), "{:?}", row.error);
    // Eager timed alone first and interleaved with the variants; the numerator is the
    // faster of the two.
    let (alone, inter) = (
        row.eager_alone_ms.unwrap(),
        row.eager_interleaved_ms.unwrap(),
    );
    assert!(alone > 0.0 && inter > 0.0);
    assert_eq!(row.eager_ms, Some(alone.min(inter)));
    let text = report.to_string();
    assert!(text.contains("geomean eager ms alone"), "{text}");
    assert_eq!(row.results.len(), 2);
    for r in &row.results {
        assert!(r.error.is_none(), "{:?}", r.error);
        assert!(r.speedup.is_some_and(|s| s > 0.0));
        assert!(r.p_value.is_some_and(|p| (0.0..=1.0).contains(&p)));
        assert!(r.compile_s.is_some());
        assert!(r.accuracy.is_some_and(|a| a.passed()), "{:?}", r.accuracy);
    }
    // Trace once traces once; trace every call traces on every call (1 warm-up, 1 call
    // measuring peak memory, 3 reps each after 1 untimed switch-in call).
    let once = row.results[0].stats.as_ref().unwrap();
    let every = row.results[1].stats.as_ref().unwrap();
    assert_eq!((once.traces, once.compiles), (1, 1));
    assert_eq!((every.traces, every.compiles), (1 + 1 + 3 * 2, 1));
    assert!(report.all_passed());

    // The table: torch_xla's trace-once/everytime columns, a geomean row.
    let table = report.to_string();
    for h in [
        "| Model",
        "XLA (trace once)",
        "XLA (trace everytime)",
        "eager ms",
        "compile s",
        "accuracy",
        "| geomean",
        "| linear",
    ] {
        assert!(table.contains(h), "{h} missing from\n{table}");
    }
    assert!(table.lines().next().unwrap().starts_with("+--"));
    assert!(table.contains("+=="));

    // The CSV: one row per model, every table column among its columns.
    let rows = csv_rows(&report.to_csv().unwrap());
    assert_eq!(rows.len(), 2, "{rows:?}");
    let header = &rows[0];
    let table_header: Vec<String> = report.table_rows()[0].clone();
    for h in &table_header {
        assert!(header.contains(h), "CSV lacks {h}: {header:?}");
    }
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    assert_eq!(rows[1][col("Model")], "linear");
    assert_eq!(rows[1][col("accuracy")], "pass");
    let speedup: f64 = rows[1][col("XLA (trace once)")].parse().unwrap();
    assert!((speedup - row.results[0].speedup.unwrap()).abs() < 1e-3);
    // Each side's threads: eager at libtorch's default unless told, in the header and CSV.
    assert!(report.threads.eager_default);
    assert_eq!(report.threads.eager as i32, tch::get_num_threads());
    assert_eq!(
        rows[1][col("eager threads")],
        report.threads.eager.to_string()
    );
    assert_eq!(
        rows[1][col("compiled cpus")],
        report.threads.cpus.to_string()
    );
    assert!(report.threads.cpus >= 1);
    assert!(
        table.contains(&format!(
            "eager: libtorch {} intra-op thread(s) (libtorch's default)",
            report.threads.eager
        )),
        "{table}"
    );

    let path = std::env::temp_dir().join(format!("kiln-bench-{}.csv", std::process::id()));
    report.write_csv(&path).unwrap();
    assert_eq!(csv_rows(&std::fs::read_to_string(&path).unwrap()), rows);
    std::fs::remove_file(&path).ok();
}

#[test]
fn accuracy_mode_and_eager_backend_and_randomized_inputs() {
    let opts = BenchOptions {
        experiment: Experiment::Accuracy,
        backend: "eager".into(),
        modes: vec![TraceMode::Once],
        ..quick()
    };
    let report = run_benchmark(vec![zoo::build("linear", 1).unwrap()], &opts).unwrap();
    assert!(report.all_passed(), "{report}");
    let table = report.to_string();
    assert!(table.contains("Eager graph (trace once)"), "{table}");
    assert!(table.contains("pass"), "{table}");
    assert!(!table.contains("geomean"));

    let opts = BenchOptions {
        randomize_input: true,
        iterations_per_run: 2,
        modes: vec![TraceMode::EveryCall],
        batch_size: Some(3),
        ..quick()
    };
    let report = run_benchmark(vec![zoo::build("linear", 2).unwrap()], &opts).unwrap();
    assert_eq!(report.rows[0].batch_size, 3);
    assert!(report.all_passed(), "{report}");
}

#[test]
fn failures_are_rows_not_aborts() {
    let mut registry = BackendRegistry::with_builtins();
    registry.register(
        "broken",
        "Broken",
        || -> kiln::Result<kiln::backend::eager::EagerBackend> {
            Err(kiln::Error::Invalid("this backend is out of order".into()))
        },
    );
    let opts = BenchOptions {
        backend: "broken".into(),
        ..quick()
    };
    let sources = vec![
        ModelSource::zoo("linear", 0),
        ModelSource::zoo("no_such_model", 0),
    ];
    let report = run_sources(sources, &opts, &registry).unwrap();
    assert_eq!(report.rows.len(), 2);
    assert!(report.rows[0].results[0]
        .error
        .as_deref()
        .unwrap()
        .contains("out of order"));
    assert!(report.rows[1]
        .error
        .as_deref()
        .unwrap()
        .contains("unknown zoo model"));
    assert!(!report.all_passed());
    let table = report.to_string();
    assert!(
        table.contains("ERROR") && table.contains("error: linear"),
        "{table}"
    );

    let unknown = BenchOptions {
        backend: "nope".into(),
        ..quick()
    };
    let e = run_benchmark(vec![], &unknown).unwrap_err().to_string();
    assert!(e.contains("unknown backend") && e.contains("xla"), "{e}");
}

/// A user model defined in the test: the library entry point benches it like a zoo model.
struct Scaled {
    store: kiln::nn::ParamStore,
    w: Tensor,
    panic_in_forward: bool,
}

impl Scaled {
    fn new(panic_in_forward: bool) -> Scaled {
        let store = kiln::nn::ParamStore::with_seed(3);
        let w = store
            .root()
            .param(
                "w",
                &[4],
                kiln::nn::Init::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            )
            .unwrap();
        Scaled {
            store,
            w,
            panic_in_forward,
        }
    }
}

impl zoo::Model for Scaled {
    fn name(&self) -> &str {
        if self.panic_in_forward {
            "panicky"
        } else {
            "scaled"
        }
    }
    fn store(&self) -> &kiln::nn::ParamStore {
        &self.store
    }
    fn example_inputs(&self, batch: usize, seed: u64) -> kiln::Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(&[batch, 4], seed)?])
    }
    fn forward(&self, inputs: &[Tensor], _train: bool) -> kiln::Result<Tensor> {
        if self.panic_in_forward {
            panic!("model bug");
        }
        (&inputs[0] * &self.w)?.tanh()
    }
}

#[test]
fn own_models_through_the_library_and_panics_become_errors() {
    let models: Vec<Box<dyn zoo::Model>> =
        vec![Box::new(Scaled::new(false)), Box::new(Scaled::new(true))];
    let report = run_benchmark(models, &quick()).unwrap();
    assert_eq!(report.rows.len(), 2);
    assert_eq!(report.rows[0].model, "scaled");
    assert!(report.rows[0].error.is_none(), "{report}");
    assert!(report.rows[0]
        .results
        .iter()
        .all(|r| r.accuracy.is_some_and(|a| a.passed())));
    let e = report.rows[1].error.as_deref().unwrap_or_default();
    assert!(e.contains("panicked: model bug"), "{e}");
}

#[test]
fn training_report_split_and_fused() {
    let opts = BenchOptions {
        training: true,
        warmup: 2,
        iterations_per_run: 2,
        ..quick()
    };
    let report = run_benchmark(vec![zoo::build("linear", 0).unwrap()], &opts).unwrap();
    let row = &report.rows[0];
    assert!(row.error.is_none(), "{report}");
    assert_eq!(row.results.len(), 4);
    for r in &row.results {
        assert!(r.error.is_none(), "{report}");
        assert!(r.speedup.is_some_and(|s| s > 0.0));
        assert!(r.accuracy.is_some_and(|a| a.passed()), "{report}");
    }
    let table = report.to_string();
    for h in [
        "XLA split (trace once)",
        "XLA fused (trace once)",
        "XLA split (trace everytime)",
        "XLA fused (trace everytime)",
        "| geomean",
    ] {
        assert!(table.contains(h), "{h} missing from\n{table}");
    }
    // Fused runs one executable per step, split three; trace once compiles once.
    let split_once = row.results[0].stats.as_ref().unwrap();
    let fused_once = row.results[1].stats.as_ref().unwrap();
    assert_eq!(split_once.traces, 1);
    // warm-up + the peak-memory step + repeat x (switch-in + iterations)
    let steps = 2 + 1 + 3 * (1 + 2);
    assert_eq!(split_once.executions, 3 * steps);
    assert_eq!(fused_once.executions, steps);
    let rows = csv_rows(&report.to_csv().unwrap());
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1][0], "linear");
    assert!(rows[0].contains(&"compile s (fused every)".to_string()));
}

/// Trains differently eagerly and compiled: eagerly its output carries a zero gradient, so
/// eager never updates the weight while compiled steps do. The loss moves too little to notice; the check
/// of the parameter updates catches it.
struct FrozenWhenEager {
    store: kiln::nn::ParamStore,
    w: Tensor,
}

impl zoo::Model for FrozenWhenEager {
    fn name(&self) -> &str {
        "frozen_when_eager"
    }
    fn store(&self) -> &kiln::nn::ParamStore {
        &self.store
    }
    fn example_inputs(&self, batch: usize, seed: u64) -> kiln::Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(&[batch, 4], seed)?])
    }
    fn forward(&self, inputs: &[Tensor], _train: bool) -> kiln::Result<Tensor> {
        let y = (&inputs[0] * &self.w)?;
        if y.is_traced() {
            Ok(y)
        } else {
            // Same value, zero gradient.
            &y.mul_scalar(0.0)? + &y.detach()?
        }
    }
}

#[test]
fn training_check_catches_wrong_updates() {
    let store = kiln::nn::ParamStore::with_seed(5);
    let w = store
        .root()
        .param(
            "w",
            &[4],
            kiln::nn::Init::Normal {
                mean: 0.0,
                std: 1.0,
            },
        )
        .unwrap();
    let opts = BenchOptions {
        training: true,
        experiment: Experiment::Accuracy,
        modes: vec![TraceMode::Once],
        train_graphs: vec![kiln_bench::TrainGraphs::Fused],
        lr: 1e-4,
        ..quick()
    };
    let model: Box<dyn zoo::Model> = Box::new(FrozenWhenEager {
        store: store.clone(),
        w: w.clone(),
    });
    let report = run_benchmark(vec![model], &opts).unwrap();
    let a = report.rows[0].results[0].accuracy.expect("checked");
    assert!(!a.passed(), "{report}");
    assert!(report.to_string().contains("FAIL"), "{report}");
    // A timing table names the failing variant with its figures.
    let model: Box<dyn zoo::Model> = Box::new(FrozenWhenEager { store, w });
    let timed = BenchOptions {
        experiment: Experiment::Performance,
        ..opts
    };
    let report = run_benchmark(vec![model], &timed).unwrap();
    let table = report.to_string();
    assert!(
        table.contains("fused once: FAIL (loss |Δ| ") && table.contains("update rel err"),
        "{table}"
    );
}

/// A directory outside the repository, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("kiln-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn linear_model_source() -> String {
    let p = workspace_root().join("benches/user_models/linear_model.rs");
    std::fs::read_to_string(p).unwrap()
}

/// The workspace this test was built in (kiln-bench's parent).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .canonicalize()
        .unwrap()
}

fn args(a: &[&str]) -> Vec<OsString> {
    a.iter().map(OsString::from).collect()
}

/// Builds scratch crates with cargo: the first build of any user model compiles kiln once more
/// (about a minute on 2 cores); the rest reuse it.
#[test]
fn user_model_file_outside_the_repository() {
    let dir = TempDir::new("user-model");
    let file = dir.0.join("model_collection.rs");
    std::fs::write(&file, linear_model_source()).unwrap();

    // A missing file and a missing class fail before anything is built.
    let missing = UserModelSpec {
        path: dir.0.join("missing.rs"),
        class: "LinearModel".into(),
    };
    let ws = Workspace::locate(None).unwrap();
    assert_eq!(ws.root, workspace_root());
    let e = run_user_model(&missing, &ws, &[]).unwrap_err().to_string();
    assert!(e.contains("does not exist"), "{e}");
    let spec = format!("path:{},class:LinearModl", file.display());
    let ModelSpec::User(typo) = ModelSpec::parse(&spec).unwrap() else {
        panic!("not a user spec")
    };
    let e = run_user_model(&typo, &ws, &[]).unwrap_err().to_string();
    assert!(
        e.contains("no `struct LinearModl`") && e.contains("LinearModel"),
        "{e}"
    );

    // torchbench.py's example LinearModel: builds, runs, writes the CSV.
    let csv = dir.0.join("out.csv");
    let ModelSpec::User(good) =
        ModelSpec::parse(&format!("path:{},class:LinearModel", file.display())).unwrap()
    else {
        panic!("not a user spec")
    };
    let status = run_user_model(
        &good,
        &ws,
        &args(&[
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--quiet",
            "--csv",
            csv.to_str().unwrap(),
        ]),
    )
    .unwrap();
    assert!(status.success(), "{status:?}");
    let rows = csv_rows(&std::fs::read_to_string(&csv).unwrap());
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[1][0], "LinearModel");

    // A broken file: the compiler's message comes back.
    let broken = dir.0.join("broken.rs");
    std::fs::write(
        &broken,
        linear_model_source().replace(
            "Linear::new(&p.sub(1), 10, 10, true)?",
            "Linear::new(&p.sub(1), 10, 10)?",
        ),
    )
    .unwrap();
    let bad = UserModelSpec {
        path: broken.clone(),
        class: "LinearModel".into(),
    };
    let e = run_user_model(&bad, &ws, &args(&["--quiet"]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("compiling") && e.contains("failed"), "{e}");
    assert!(e.contains("error[E0061]"), "{e}");
    assert!(e.contains("broken.rs"), "{e}");
}

/// The command line from another directory: a relative `path:` is resolved against the current
/// directory, and the workspace is found from the binary's location, or given with
/// `--workspace` / `$KILN_BENCH_WORKSPACE` to a binary outside it (with a clear error without).
#[test]
fn cli_from_another_directory() {
    let dir = TempDir::new("user-model-cli");
    std::fs::write(dir.0.join("my_model.rs"), linear_model_source()).unwrap();
    let bench = |exe: &Path| {
        let mut c = Command::new(exe);
        c.current_dir(&dir.0).env_remove(WORKSPACE_ENV).args([
            "--only",
            "path:my_model.rs,class:LinearModel",
            "--repeat",
            "2",
            "--warmup",
            "1",
            "--quiet",
            "--mode",
            "once",
        ]);
        c
    };
    let exe = Path::new(env!("CARGO_BIN_EXE_kiln-bench"));
    let stdout = stdout_of_success(&mut bench(exe));
    assert!(stdout.contains("| LinearModel"), "{stdout}");

    // A copy of the binary outside the workspace, run outside it: nothing to find.
    let copy = dir.0.join("kiln-bench");
    std::fs::copy(exe, &copy).unwrap();
    let out = bench(&copy).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("cannot find kiln's workspace")
            && stderr.contains("--workspace DIR")
            && stderr.contains(WORKSPACE_ENV),
        "{stderr}"
    );
    // Told where it is, it builds there.
    let out = bench(&copy)
        .arg("--workspace")
        .arg(workspace_root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A wrong override is reported as such.
    let out = bench(&copy).env(WORKSPACE_ENV, &dir.0).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(WORKSPACE_ENV) && stderr.contains("is not kiln's workspace"),
        "{stderr}"
    );
}

/// `--threads 1` puts both sides on one thread (libtorch's intra-op threads, and the process's
/// CPU affinity that sizes XLA's pool: one thread), the header and CSV say so and name the plugin; OpenMP
/// waits passively; a missing `--plugin` file is a clear error.
#[test]
fn cli_threads_and_plugin() {
    let exe = Path::new(env!("CARGO_BIN_EXE_kiln-bench"));
    let csv = std::env::temp_dir().join(format!("kiln-bench-threads-{}.csv", std::process::id()));
    let args = [
        "--only", "linear", "--repeat", "2", "--warmup", "1", "--quiet", "--mode", "once",
    ];
    let stdout = stdout_of_success(
        Command::new(exe)
            .env_remove("OMP_WAIT_POLICY")
            .args(args)
            .args(["--threads", "1", "--csv"])
            .arg(&csv),
    );
    assert!(
        stdout.contains(
            "eager: libtorch 1 intra-op thread(s) (--threads), timed interleaved with the compiled runs"
        ) && stdout.contains("confined to 1 CPU(s)")
            && stdout.contains("XLA's intra-op pool: 1 thread(s)")
            && stdout.contains("plugin ")
            && stdout.contains("PJRT C API"),
        "{stdout}"
    );
    let rows = csv_rows(&std::fs::read_to_string(&csv).unwrap());
    std::fs::remove_file(&csv).ok();
    let col = |name: &str| rows[0].iter().position(|h| h == name).unwrap();
    assert_eq!(rows[1][col("eager threads")], "1");
    assert_eq!(rows[1][col("compiled cpus")], "1");
    assert!(rows[1][col("compiled")].contains("plugin "), "{rows:?}");

    let out = Command::new(exe)
        .args(args)
        .args(["--plugin", "/nonexistent/pjrt_plugin.so"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--plugin /nonexistent/pjrt_plugin.so: no such file"),
        "{stderr}"
    );
}

/// On one CPU (`--threads 1`: XLA's pool one thread, libtorch one thread) the split and
/// fused steps of a convolutional model and of the LinearModel pass the accuracy checks.
#[test]
fn cli_threads_1_training_accuracy() {
    let exe = Path::new(env!("CARGO_BIN_EXE_kiln-bench"));
    let stdout = stdout_of_success(
        Command::new(exe)
            .args([
                "--accuracy",
                "--training",
                "--threads",
                "1",
                "--mode",
                "once",
            ])
            .args(["--only", "squeezenet1_1,linear", "--quiet"]),
    );
    assert!(stdout.contains("confined to 1 CPU(s)"), "{stdout}");
    assert!(!stdout.contains("FAIL"), "{stdout}");
}
