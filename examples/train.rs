//! Trains a small CNN on the 8x8 handwritten digits that scikit-learn ships inside its package
//! (no download), three ways: eagerly (libtorch autograd), and compiled to XLA with split
//! (forward, backward, optimizer executables) and fused (one executable) training steps.
//! Prints the loss per epoch, the time per epoch and the final test accuracy of each.
//!
//! With `--mixed bf16` or `--mixed f16`, the compiled runs train in mixed precision (f32
//! master weights, products and convolutions in the 16-bit dtype, loss scaling for f16; see
//! `TrainStep::with_mixed_precision`).
//!
//! `cargo run --release --example train [-- --epochs N] [--mixed bf16|f16]`

#[path = "common/digits.rs"]
mod digits;

use digits::{permutation, Digits};
use kiln::backend::xla::XlaBackend;
use kiln::nn::{Module, ParamStore, Shared};
use kiln::optim::Sgd;
use kiln::train::{EagerTrainStep, TrainMode, TrainStep};
use kiln::Tensor;
use std::time::Instant;

const BATCH: usize = 64;

enum Trainer {
    Eager(EagerTrainStep),
    Xla(Box<TrainStep<XlaBackend>>),
}

fn main() -> kiln::Result<()> {
    let epochs: usize = std::env::args()
        .skip_while(|a| a != "--epochs")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let mixed = match std::env::args()
        .skip_while(|a| a != "--mixed")
        .nth(1)
        .as_deref()
    {
        None => None,
        Some("bf16") => Some(kiln::DType::BF16),
        Some("f16") => Some(kiln::DType::F16),
        Some(other) => {
            return Err(kiln::Error::Invalid(format!(
                "--mixed {other}: expected bf16 or f16"
            )))
        }
    };
    let data = Digits::load()?;
    let order = permutation(data.len(), 0);
    let (test_idx, train_idx) = order.split_at(data.len() / 5);
    println!(
        "digits: {} train / {} test images of 8x8; batch {BATCH}, {epochs} epochs, SGD momentum 0.9, lr 0.05{}",
        train_idx.len(),
        test_idx.len(),
        mixed.map(|d| format!("; compiled runs in mixed precision ({d})")).unwrap_or_default()
    );
    let mut summary = Vec::new();
    for mode in ["eager", "xla split", "xla fused"] {
        // The same seed gives every run the same initial weights.
        let store = ParamStore::with_seed(1);
        let model = Shared::new(digits::cnn(&store)?);
        let m = model.clone();
        let loss_fn = move |xs: &[Tensor]| m.forward_t(&xs[0], true)?.cross_entropy(&xs[1]);
        let opt = Sgd::new().momentum(0.9);
        let mut trainer = match mode {
            "eager" => Trainer::Eager(EagerTrainStep::new(&store, opt, loss_fn)?.with_lr(0.05)),
            _ => {
                let tm = if mode == "xla split" {
                    TrainMode::Split
                } else {
                    TrainMode::Fused
                };
                let mut step = TrainStep::new(XlaBackend::new()?, &store, opt, loss_fn)?
                    .with_mode(tm)
                    .with_lr(0.05);
                if let Some(d) = mixed {
                    step = step.with_mixed_precision(d)?;
                }
                Trainer::Xla(Box::new(step))
            }
        };
        let mut times = Vec::new();
        let mut last_loss = 0.0;
        for epoch in 0..epochs {
            let perm = permutation(train_idx.len(), 100 + epoch as u64);
            let t0 = Instant::now();
            let mut total = 0.0;
            let mut n = 0;
            // Whole batches only: one input signature, one compilation.
            for chunk in perm.chunks_exact(BATCH) {
                let idx: Vec<usize> = chunk.iter().map(|&i| train_idx[i]).collect();
                let (x, y) = data.batch(&idx)?;
                total += match &mut trainer {
                    Trainer::Eager(s) => s.step(&[x, y])?,
                    Trainer::Xla(s) => s.step(&[x, y])?,
                };
                n += 1;
            }
            let dt = t0.elapsed().as_secs_f64();
            times.push(dt);
            last_loss = total / n as f64;
            println!(
                "{mode:>9}  epoch {:>2}  loss {last_loss:.4}  {:.0} ms",
                epoch + 1,
                dt * 1e3
            );
        }
        if let Trainer::Xla(s) = &mut trainer {
            s.sync_to_store()?;
            println!(
                "{mode:>9}  {} executables per step; {}",
                s.executables_per_step().unwrap_or(0),
                s.stats()
            );
        }
        let acc = digits::accuracy(&model, &data, test_idx)?;
        // Epoch 1 includes compilation; report the median of the rest too.
        let mut steady = times[1.min(times.len() - 1)..].to_vec();
        steady.sort_by(f64::total_cmp);
        summary.push((mode, last_loss, acc, times[0], steady[steady.len() / 2]));
    }
    println!(
        "\n{:<10} {:>10} {:>14} {:>14} {:>16}",
        "mode", "final loss", "test accuracy", "epoch 1 (ms)", "median epoch (ms)"
    );
    for (mode, loss, acc, first, med) in &summary {
        println!(
            "{mode:<10} {loss:>10.4} {:>13.1}% {:>14.0} {:>16.0}",
            acc * 100.0,
            first * 1e3,
            med * 1e3
        );
    }
    for (mode, _, acc, _, _) in &summary {
        if *acc < 0.9 {
            return Err(kiln::Error::Invalid(format!(
                "{mode}: test accuracy {acc:.3} below 0.9"
            )));
        }
    }
    Ok(())
}
