//! Trains a small CNN on the 8x8 handwritten digits that scikit-learn ships inside its package
//! (no download), three ways: eagerly (libtorch autograd), and compiled to XLA with split
//! (forward, backward, optimizer executables) and fused (one executable) training steps.
//! Prints the loss per epoch, the time per epoch and the final test accuracy of each.
//!
//! `cargo run --release --example train [-- --epochs N]`

#[path = "common/digits.rs"]
mod digits;

use digits::{permutation, Digits};
use kiln::backend::xla::XlaBackend;
use kiln::nn::{
    Conv2d, Conv2dConfig, Flatten, Linear, MaxPool2d, Module, ParamStore, Relu, Sequential, Shared,
};
use kiln::optim::Sgd;
use kiln::train::{EagerTrainStep, TrainMode, TrainStep};
use kiln::Tensor;
use std::time::Instant;

const BATCH: usize = 64;

fn cnn(store: &ParamStore) -> kiln::Result<Sequential> {
    let r = store.root();
    let pad1 = Conv2dConfig {
        padding: [1, 1],
        ..Default::default()
    };
    Ok(Sequential::new()
        .add(Conv2d::new(&r.sub("conv1"), 1, 16, 3, pad1)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Conv2d::new(&r.sub("conv2"), 16, 32, 3, pad1)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Flatten::default())
        .add(Linear::new(&r.sub("fc"), 32 * 2 * 2, 10, true)?))
}

fn accuracy(model: &impl Module, data: &Digits, idx: &[usize]) -> kiln::Result<f64> {
    let (x, y) = data.batch(idx)?;
    let logits = tch::no_grad(|| model.forward(&x))?;
    let pred = logits.as_tch()?.f_argmax(-1, false)?;
    let correct = pred
        .f_eq_tensor(y.as_tch()?)?
        .f_sum(tch::Kind::Int64)?
        .int64_value(&[]);
    Ok(correct as f64 / idx.len() as f64)
}

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
    let data = Digits::load()?;
    let order = permutation(data.len(), 0);
    let (test_idx, train_idx) = order.split_at(data.len() / 5);
    println!(
        "digits: {} train / {} test images of 8x8; batch {BATCH}, {epochs} epochs, SGD momentum 0.9, lr 0.05",
        train_idx.len(),
        test_idx.len()
    );
    let mut summary = Vec::new();
    for mode in ["eager", "xla split", "xla fused"] {
        // The same seed gives every run the same initial weights.
        let store = ParamStore::with_seed(1);
        let model = Shared::new(cnn(&store)?);
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
                Trainer::Xla(Box::new(
                    TrainStep::new(XlaBackend::new()?, &store, opt, loss_fn)?
                        .with_mode(tm)
                        .with_lr(0.05),
                ))
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
        let acc = accuracy(&model, &data, test_idx)?;
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
