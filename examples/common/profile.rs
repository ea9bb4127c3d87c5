//! What the profiling examples (`conv_profile`, `ffi_profile`, `autotune_report`) share: the
//! recording backend ([`recorder::Recorder`]), one-graph runners and the interleaved timing loop, seeded
//! inputs, and a zoo model's fused training step.
//!
//! Each example includes this module with `#[path]` and uses part of it.
#![allow(dead_code)]

#[path = "recorder.rs"]
pub mod recorder;

use kiln::backend::{Backend, HostTensor};
use kiln::ir::{Graph, TensorType};
use kiln::optim::Sgd;
use kiln::train::{TrainMode, TrainStep};
use kiln::zoo::{Model, SharedModel};
use kiln::Tensor;
use std::time::Instant;

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The smallest value of `v` (the least disturbed run on a shared machine).
pub fn best(v: Vec<f64>) -> f64 {
    v.into_iter().fold(f64::INFINITY, f64::min)
}

/// Seeded float32 values in `[-0.5, 0.5)` of shape `ty` (an LCG: cheap for large inputs).
pub fn random(ty: &TensorType, seed: u64) -> kiln::Result<HostTensor> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let vals: Vec<f32> = (0..ty.shape.numel())
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect();
    HostTensor::from_slice(ty.shape.dims(), &vals)
}

/// A prepared run: `f()` runs it once and waits.
pub type Runner = Box<dyn FnMut() -> kiln::Result<()>>;

/// `g` compiled on `b` with `inputs` uploaded: each call executes it and waits for the outputs.
pub fn runner<B: Backend + 'static>(
    b: B,
    g: &Graph,
    inputs: &[HostTensor],
) -> kiln::Result<Runner> {
    let exe = b.compile(g)?;
    let bufs: Vec<B::Buffer> = inputs
        .iter()
        .map(|h| b.to_device(h))
        .collect::<kiln::Result<_>>()?;
    Ok(Box::new(move || {
        let refs: Vec<&B::Buffer> = bufs.iter().collect();
        let out = b.execute(&exe, &refs)?;
        for o in &out {
            b.sync(o)?;
        }
        Ok(())
    }))
}

/// Times the runners round-robin: `reps` rounds, each call repeated to take >= 20 ms; each
/// runner's seconds per call, its rounds reduced by `summary` ([`median`], [`best`]).
pub fn interleaved(
    rs: &mut [Runner],
    reps: usize,
    summary: fn(Vec<f64>) -> f64,
) -> kiln::Result<Vec<f64>> {
    let mut iters = Vec::new();
    for r in rs.iter_mut() {
        r()?;
        let t = Instant::now();
        r()?;
        let dt = t.elapsed().as_secs_f64();
        iters.push(((0.02 / dt).ceil() as usize).clamp(1, 200));
    }
    let mut times = vec![Vec::new(); rs.len()];
    for _ in 0..reps {
        for (i, r) in rs.iter_mut().enumerate() {
            let t = Instant::now();
            for _ in 0..iters[i] {
                r()?;
            }
            times[i].push(t.elapsed().as_secs_f64() / iters[i] as f64);
        }
    }
    Ok(times.into_iter().map(summary).collect())
}

/// `model`'s fused training step on `backend`: its loss on its own inputs, SGD with momentum
/// 0.9, learning rate 1e-3.
pub fn train_step<B: Backend + 'static>(
    backend: B,
    model: &SharedModel,
) -> kiln::Result<TrainStep<B>> {
    let m = model.clone();
    Ok(TrainStep::new(
        backend,
        model.store(),
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| {
            let out = m.forward(xs, true)?;
            m.loss(&out, xs)
        },
    )?
    .with_mode(TrainMode::Fused)
    .with_lr(1e-3))
}
