//! Runs zoo models for inference eagerly (libtorch, the baseline) and compiled to XLA, and
//! prints trace time, compile time, per-iteration times and the eager-vs-XLA difference.
//!
//! ```text
//! cargo run --release --example infer -- resnet18          # one model (default resnet18)
//! cargo run --release --example infer -- --all             # every zoo model
//! cargo run --release --example infer -- vgg16 --batch 2 --seconds 2
//! cargo run --release --example infer -- --all --threads 1  # libtorch intra-op threads
//! ```
//!
//! Timings: a warm-up call, then repeated calls for about `--seconds` (at least 3) on each
//! side; the median per-call time is reported. XLA calls include the input upload and the
//! output download; parameters stay on the device.

use kiln::backend::xla::XlaBackend;
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, Tensor};
use std::time::Instant;

struct Args {
    models: Vec<String>,
    batch: Option<usize>,
    seconds: f64,
    threads: Option<i32>,
}

fn parse() -> kiln::Result<Args> {
    let mut models = Vec::new();
    let mut batch = None;
    let mut seconds = 1.0;
    let mut threads = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .ok_or_else(|| kiln::Error::Invalid(format!("{flag} needs a value")))
        };
        match a.as_str() {
            "--all" => models.extend(zoo::NAMES.iter().map(|s| s.to_string())),
            "--batch" => {
                batch = Some(
                    value("--batch")?
                        .parse()
                        .map_err(|e| kiln::Error::Invalid(format!("--batch: {e}")))?,
                )
            }
            "--seconds" => {
                seconds = value("--seconds")?
                    .parse()
                    .map_err(|e| kiln::Error::Invalid(format!("--seconds: {e}")))?
            }
            "--threads" => {
                threads = Some(
                    value("--threads")?
                        .parse()
                        .map_err(|e| kiln::Error::Invalid(format!("--threads: {e}")))?,
                )
            }
            "-h" | "--help" => {
                println!(
                    "usage: infer [NAME ...|--all] [--batch N] [--seconds S] [--threads N]\nmodels: {}",
                    zoo::NAMES.join(", ")
                );
                std::process::exit(0);
            }
            name => models.push(name.to_string()),
        }
    }
    if models.is_empty() {
        models.push("resnet18".into());
    }
    Ok(Args {
        models,
        batch,
        seconds,
        threads,
    })
}

/// Median seconds per call of `f`, over calls for about `budget` seconds (at least 3).
fn time_it(budget: f64, mut f: impl FnMut() -> kiln::Result<()>) -> kiln::Result<f64> {
    let start = Instant::now();
    let mut times = Vec::new();
    while times.len() < 3 || (start.elapsed().as_secs_f64() < budget && times.len() < 1000) {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

struct Row {
    name: String,
    batch: usize,
    params: usize,
    trace_ms: f64,
    compile_s: f64,
    eager_ms: f64,
    xla_ms: f64,
    max_diff: f64,
    rel_err: f64,
    cosine: f64,
}

fn run(backend: &XlaBackend, name: &str, batch: Option<usize>, seconds: f64) -> kiln::Result<Row> {
    let model: SharedModel = SharedModel::new(zoo::build(name, 0)?);
    let batch = batch.unwrap_or(if name == "linear" { 2 } else { 4 });
    let inputs = model.example_inputs(batch, 1)?;

    let eager = tch::no_grad(|| model.forward(&inputs, false))?;
    let eager_s = time_it(seconds, || {
        tch::no_grad(|| model.forward(&inputs, false)).map(|_| ())
    })?;

    let m = model.clone();
    let mut f = compile(backend.clone(), move |xs: &[Tensor]| {
        Ok(vec![m.forward(xs, false)?])
    });
    let compiled = f.run(&inputs)?.remove(0);
    let xla_s = time_it(seconds, || f.run(&inputs).map(|_| ()))?;
    let stats = f.stats();
    if stats.traces != 1 || stats.compiles != 1 {
        return Err(kiln::Error::Invalid(format!(
            "{name}: expected one trace and one compile, got {stats:?}"
        )));
    }

    let e = eager.to_f64_vec()?;
    let c = compiled.to_f64_vec()?;
    let max_diff = e
        .iter()
        .zip(&c)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let scale = e.iter().map(|a| a.abs()).fold(0.0, f64::max);
    let dot: f64 = e.iter().zip(&c).map(|(a, b)| a * b).sum();
    let norm = |v: &[f64]| v.iter().map(|a| a * a).sum::<f64>().sqrt();
    Ok(Row {
        name: name.to_string(),
        batch,
        params: model.store().num_parameters(),
        trace_ms: stats.trace_time.as_secs_f64() * 1e3,
        compile_s: stats.compile_time.as_secs_f64(),
        eager_ms: eager_s * 1e3,
        xla_ms: xla_s * 1e3,
        max_diff,
        rel_err: max_diff / scale.max(f64::MIN_POSITIVE),
        cosine: dot / (norm(&e) * norm(&c)).max(f64::MIN_POSITIVE),
    })
}

fn main() -> kiln::Result<()> {
    let args = parse()?;
    if let Some(t) = args.threads {
        tch::set_num_threads(t);
    }
    println!(
        "libtorch intra-op threads: {} (eager); XLA uses its own thread pool",
        tch::get_num_threads()
    );
    let backend = XlaBackend::new()?;
    println!(
        "{:<16} {:>5} {:>12} {:>9} {:>10} {:>10} {:>10} {:>8} {:>10} {:>10} {:>12}",
        "model",
        "batch",
        "params",
        "trace ms",
        "compile s",
        "eager ms",
        "xla ms",
        "speedup",
        "max diff",
        "rel err",
        "1-cosine"
    );
    let mut failed = Vec::new();
    for name in &args.models {
        match run(&backend, name, args.batch, args.seconds) {
            Ok(r) => println!(
                "{:<16} {:>5} {:>12} {:>9.1} {:>10.2} {:>10.3} {:>10.3} {:>7.2}x {:>10.2e} {:>10.2e} {:>12.2e}",
                r.name,
                r.batch,
                r.params,
                r.trace_ms,
                r.compile_s,
                r.eager_ms,
                r.xla_ms,
                r.eager_ms / r.xla_ms,
                r.max_diff,
                r.rel_err,
                1.0 - r.cosine
            ),
            Err(e) => {
                println!("{name:<16} FAILED: {e}");
                failed.push(name.clone());
            }
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(kiln::Error::Invalid(format!(
            "failed: {}",
            failed.join(", ")
        )))
    }
}
