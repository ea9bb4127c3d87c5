//! Data-parallel training of the digits CNN (see `examples/train.rs`) on 1, 2 and 4 PJRT CPU
//! devices of one client (`XlaBackend::replicated`): each of N replicas gets B images of every
//! N·B batch, and the gradients are averaged across the replicas with `stablehlo.all_reduce`
//! inside the compiled step.
//!
//! Checks that the first step on N replicas equals one device's step on the whole N·B batch
//! (loss and every parameter within 1e-5 relative; exits non-zero otherwise), in split and fused
//! mode, then trains for a few epochs from the same initial parameters and reports samples per
//! second for each N. The CPU devices share the machine's cores (and the client's thread pool
//! has at least one thread per device), so more devices need not be faster: the figures are
//! reported, not asserted.
//!
//! `cargo run --release --example data_parallel [-- --epochs N]`

#[path = "common/digits.rs"]
mod digits;

use digits::{permutation, Digits};
use kiln::backend::xla::{default_plugin_path, pjrt::NamedValue, XlaBackend};
use kiln::backend::Backend;
use kiln::nn::{Module, ParamStore, Shared};
use kiln::optim::Sgd;
use kiln::train::{TrainMode, TrainStep};
use kiln::Tensor;
use std::time::Instant;

/// Images per replica per step.
const PER_REPLICA: usize = 16;
const LR: f64 = 0.05;

/// A training step of the CNN on `backend`, from the initial parameters of seed 1.
fn step_on<B: Backend>(backend: B, mode: TrainMode) -> kiln::Result<(TrainStep<B>, ParamStore)> {
    let store = ParamStore::with_seed(1);
    let model = Shared::new(digits::cnn(&store)?);
    let step = TrainStep::new(
        backend,
        &store,
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| model.forward_t(&xs[0], true)?.cross_entropy(&xs[1]),
    )?
    .with_mode(mode)
    .with_lr(LR);
    Ok((step, store))
}

fn flat(store: &ParamStore) -> kiln::Result<Vec<f64>> {
    let mut v = Vec::new();
    for (_, t) in store.vars() {
        v.extend(t.to_f64_vec()?);
    }
    Ok(v)
}

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().max(1e-24);
    (num / den).sqrt()
}

/// The first step on `replicas` devices vs one device on the same whole batch: the larger of
/// the loss's and the parameters' relative errors.
fn first_step_error(
    xla: &XlaBackend,
    data: &Digits,
    idx: &[usize],
    replicas: usize,
    mode: TrainMode,
) -> kiln::Result<f64> {
    let (x, y) = data.batch(&idx[..replicas * PER_REPLICA])?;
    let (mut one, one_store) = step_on(xla.clone(), mode)?;
    let (mut dp, dp_store) = step_on(xla.replicated(replicas)?, mode)?;
    let (l1, ln) = (one.step(&[x.clone(), y.clone()])?, dp.step(&[x, y])?);
    one.sync_to_store()?;
    dp.sync_to_store()?;
    let loss_err = ((ln - l1) / l1).abs();
    let param_err = rel_err(&flat(&dp_store)?, &flat(&one_store)?);
    Ok(loss_err.max(param_err))
}

fn main() -> kiln::Result<()> {
    let epochs: usize = std::env::args()
        .skip_while(|a| a != "--epochs")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    // 4 CPU devices whatever the core count (`XlaBackend::new` makes one per core, at most 4).
    let xla = XlaBackend::from_plugin_with(
        default_plugin_path()?,
        &[("cpu_device_count".to_string(), NamedValue::Int(4))],
    )?;
    let devices = xla.client().addressable_device_count();
    let data = Digits::load()?;
    let order = permutation(data.len(), 0);
    let train_idx = &order[data.len() / 5..];
    let counts: Vec<usize> = [1, 2, 4].into_iter().filter(|&n| n <= devices).collect();
    println!(
        "digits CNN, SGD momentum 0.9, lr {LR}; {PER_REPLICA} images per replica per step; \
         {devices} PJRT {} devices, {} CPU cores",
        xla.platform(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    println!("\nfirst step on N devices (B = {PER_REPLICA} each) vs one device on the N·B batch:");
    let mut worst: f64 = 0.0;
    for &n in &counts {
        for mode in [TrainMode::Split, TrainMode::Fused] {
            let e = first_step_error(&xla, &data, train_idx, n, mode)?;
            println!("  N = {n}  {mode:?}: rel err {e:.2e}");
            worst = worst.max(e);
        }
    }

    println!("\ntraining {epochs} epochs (fused), same initial parameters:");
    println!(
        "{:>3} {:>7} {:>11} {:>12}",
        "N", "batch", "final loss", "samples/s"
    );
    let mut rows = Vec::new();
    for &n in &counts {
        let global = n * PER_REPLICA;
        let (mut step, _) = step_on(xla.replicated(n)?, TrainMode::Fused)?;
        // One step to compile, outside the timing.
        let (x, y) = data.batch(&train_idx[..global])?;
        step.step(&[x, y])?;
        let (mut samples, mut loss, mut secs) = (0usize, 0.0, 0.0);
        for epoch in 0..epochs {
            let perm = permutation(train_idx.len(), 100 + epoch as u64);
            let (mut total, mut batches) = (0.0, 0);
            let t0 = Instant::now();
            for chunk in perm.chunks_exact(global) {
                let idx: Vec<usize> = chunk.iter().map(|&i| train_idx[i]).collect();
                let (x, y) = data.batch(&idx)?;
                total += step.step(&[x, y])?;
                batches += 1;
                samples += global;
            }
            secs += t0.elapsed().as_secs_f64();
            loss = total / batches as f64;
        }
        let rate = samples as f64 / secs;
        println!("{n:>3} {global:>7} {loss:>11.4} {rate:>12.0}");
        rows.push((n, rate));
    }
    if let Some(&(_, base)) = rows.first() {
        let scaling: Vec<String> = rows
            .iter()
            .map(|(n, r)| format!("N={n}: {:.2}x", r / base))
            .collect();
        println!("throughput vs N = 1 (not asserted): {}", scaling.join(", "));
    }
    if worst > 1e-5 {
        return Err(kiln::Error::Invalid(format!(
            "data-parallel first step differs from one device on the whole batch: rel err {worst:.2e} > 1e-5"
        )));
    }
    println!("first-step check passed (worst rel err {worst:.2e} <= 1e-5)");
    Ok(())
}
