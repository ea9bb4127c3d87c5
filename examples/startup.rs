//! Start-up and tracing costs, the figures of the device-residency issue:
//!
//! - cold vs warm start of resnet18 with the on-disk executable cache: time from a fresh
//!   runtime to the first result (inference) and to the first training step (fused), once
//!   with an empty cache directory (compiles and writes) and once with a fresh in-memory cache
//!   over the same directory (what a new process sees: loads, compiles nothing);
//! - per-step time of training with trace once vs trace every time, for LinearModel and
//!   resnet18.
//!
//! `cargo run --release --example startup [-- --steps N]`

use kiln::backend::xla::XlaBackend;
use kiln::optim::Sgd;
use kiln::runtime::ExecutableCache;
use kiln::train::{TrainMode, TrainStep};
use kiln::zoo::{self, Model};
use kiln::{compile_with, Runtime, Tensor, TraceMode};
use std::time::Instant;

fn infer_start(cache: ExecutableCache<XlaBackend>) -> kiln::Result<(f64, kiln::Stats)> {
    let t0 = Instant::now();
    let model: zoo::SharedModel = zoo::SharedModel::new(zoo::build("resnet18", 0)?);
    let x = model.example_inputs(4, 1)?;
    let m = model.clone();
    let mut f = compile_with(
        Runtime::with_cache(XlaBackend::new()?, cache),
        move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]),
    );
    f.run(&x)?;
    Ok((t0.elapsed().as_secs_f64(), f.stats()))
}

fn train_step(name: &str, mode: TraceMode) -> kiln::Result<TrainStep<XlaBackend>> {
    let model: zoo::SharedModel = zoo::SharedModel::new(zoo::build(name, 0)?);
    let m = model.clone();
    let store = model.store().clone();
    TrainStep::new(
        XlaBackend::new()?,
        &store,
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| {
            let out = m.forward(xs, true)?;
            m.loss(&out, xs)
        },
    )
    .map(|s| {
        s.with_mode(TrainMode::Fused)
            .with_trace_mode(mode)
            .with_lr(1e-3)
    })
}

fn train_start(dir: &std::path::Path) -> kiln::Result<(f64, kiln::Stats)> {
    let t0 = Instant::now();
    let model: zoo::SharedModel = zoo::SharedModel::new(zoo::build("resnet18", 0)?);
    let x = model.example_inputs(4, 1)?;
    let m = model.clone();
    let store = model.store().clone();
    let loss = move |xs: &[Tensor]| {
        let out = m.forward(xs, true)?;
        m.loss(&out, xs)
    };
    // A new cache over the directory: what a fresh process sees.
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), loss)?
        .with_mode(TrainMode::Fused)
        .with_cache(ExecutableCache::with_dir(dir)?);
    step.step(&x)?;
    Ok((t0.elapsed().as_secs_f64(), step.stats()))
}

fn per_step(name: &str, mode: TraceMode, steps: usize) -> kiln::Result<f64> {
    let model = zoo::build(name, 0)?;
    let batch = if name == "linear" { 2 } else { 4 };
    let x = model.example_inputs(batch, 1)?;
    drop(model);
    let mut step = train_step(name, mode)?;
    step.step(&x)?;
    step.step(&x)?;
    let t0 = Instant::now();
    for _ in 0..steps {
        step.step_async(&x)?;
    }
    step.last_loss()?;
    Ok(t0.elapsed().as_secs_f64() / steps as f64)
}

fn main() -> kiln::Result<()> {
    let steps: usize = std::env::args()
        .skip_while(|a| a != "--steps")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    let dir = std::env::temp_dir().join(format!("kiln-startup-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);

    let (cold, s1) = infer_start(ExecutableCache::with_dir(&dir)?)?;
    let (warm, s2) = infer_start(ExecutableCache::with_dir(&dir)?)?;
    println!("resnet18 inference, first result: cold {cold:.2} s (compiles {}, {:.2} s compiling), warm {warm:.2} s (compiles {}, disk hits {})",
        s1.compiles, s1.compile_time.as_secs_f64(), s2.compiles, s2.disk_hits);
    let (cold, s1) = train_start(&dir)?;
    let (warm, s2) = train_start(&dir)?;
    println!("resnet18 fused training, first step: cold {cold:.2} s (compiles {}, {:.2} s compiling), warm {warm:.2} s (compiles {}, disk hits {})",
        s1.compiles, s1.compile_time.as_secs_f64(), s2.compiles, s2.disk_hits);
    let _ = std::fs::remove_dir_all(&dir);

    for name in ["linear", "resnet18"] {
        let n = if name == "linear" { steps * 200 } else { steps };
        let once = per_step(name, TraceMode::Once, n)?;
        let every = per_step(name, TraceMode::EveryCall, n)?;
        println!(
            "{name} fused training step: trace once {:.3} ms, trace every time {:.3} ms (ratio {:.2})",
            once * 1e3,
            every * 1e3,
            every / once
        );
    }
    Ok(())
}
