//! Zoo models trained through kiln's AOT autograd on XLA vs libtorch autograd (the eager
//! oracle): gradients of a scalar loss w.r.t. every trainable parameter, and BatchNorm running
//! statistics and parameters after a few training steps, in Split and Fused modes.
//!
//! How the XLA gradient is read: a [`TrainStep`] in Split mode (forward, backward and optimizer
//! executables, exactly the user's path) with `Sgd::new().momentum(0.9)` and learning rate 0.
//! On the first step the momentum buffer becomes `0.9 * 0 + g`, which is `g` bit for bit, and
//! the parameters stay unchanged; after `sync_to_store` the buffer is the backward graph's
//! gradient. (Recovering `g` from a parameter delta `p - lr * g` instead would lose digits to
//! cancellation whenever `lr * |g|` is small against `|p|`.)
//!
//! The oracle: `loss.backward()` with libtorch on the very same model object (same weights),
//! run eagerly before the `TrainStep` is built; its `.grad` tensors are copied.
//!
//! Criterion: `||g_xla - g_tch|| / ||g_tch||` over all parameters at once (global norm, f64
//! accumulation) at most 1e-3. The worst single parameter is printed too, for information.
//!
//! Loss: `mean(out * r)` with a fixed random `r` of the output's shape. With the zoo's default
//! loss (the mean of the output) bert's gradients are zero for almost every parameter: its
//! output comes out of a LayerNorm whose weight is all ones at initialisation, so its mean is
//! the mean of the LayerNorm bias whatever comes before. A random projection exercises every
//! output element.
//!
//! Modes: dropout masks differ between libtorch's generator (eager) and kiln's counter-based
//! one (traced), so models with dropout run in eval mode. See each test for its reasons. Run
//! with `--nocapture` for per-model errors and timings.

use kiln::backend::xla::XlaBackend;
use kiln::optim::Sgd;
use kiln::train::{EagerTrainStep, TrainMode, TrainStep};
use kiln::zoo::{self, Model, SharedModel};
use kiln::Tensor;
use std::time::Instant;

/// `sum (a - b)^2` and `sum b^2`, in f64.
fn sq_diff_and_norm(a: &tch::Tensor, b: &tch::Tensor) -> (f64, f64) {
    let a = a.to_kind(tch::Kind::Double);
    let b = b.to_kind(tch::Kind::Double);
    let d = (&a - &b).square().sum(tch::Kind::Double).double_value(&[]);
    let n = b.square().sum(tch::Kind::Double).double_value(&[]);
    (d, n)
}

fn rel(d: f64, n: f64) -> f64 {
    d.sqrt() / n.sqrt().max(1e-300)
}

/// Checks the XLA gradients of `mean(model(inputs) * r)` against libtorch autograd.
/// `inputs`: `None` for the zoo's example inputs at `batch`. Returns the global relative error.
fn check_grads(name: &str, train: bool, batch: usize, inputs: Option<Vec<Tensor>>) -> f64 {
    let t0 = Instant::now();
    let model: SharedModel = SharedModel::new(zoo::build(name, 0).unwrap());
    let inputs = match inputs {
        Some(x) => x,
        None => model.example_inputs(batch, 1).unwrap(),
    };
    let params = model.store().trainable();
    let n_elems: usize = params.iter().map(|p| p.shape().numel()).sum();

    // Oracle: libtorch autograd on the eager model.
    let out = model.forward(&inputs, train).unwrap();
    let r = Tensor::randn(out.dims(), 99).unwrap();
    let loss = out.mul(&r).unwrap().mean_all().unwrap();
    let eager_loss = loss.to_f64_vec().unwrap()[0];
    loss.as_tch().unwrap().backward();
    let reference: Vec<tch::Tensor> = params
        .iter()
        .map(|p| {
            let t = p.as_tch().unwrap();
            let g = t.grad();
            if g.defined() {
                g.copy()
            } else {
                t.zeros_like()
            }
        })
        .collect();
    drop((out, loss));
    let t_eager = t0.elapsed();

    // kiln: trace, joint graph, partition, XLA (Split mode), one step.
    let t1 = Instant::now();
    let m = model.clone();
    let mut step = TrainStep::new(
        XlaBackend::new().unwrap(),
        model.store(),
        Sgd::new().momentum(0.9),
        move |xs: &[Tensor]| m.forward(xs, train)?.mul(&r)?.mean_all(),
    )
    .unwrap()
    .with_mode(TrainMode::Split)
    .with_lr(0.0);
    let xla_loss = step.step(&inputs).unwrap();
    step.sync_to_store().unwrap();
    assert_eq!(step.executables_per_step(), Some(3));
    let t_xla = t1.elapsed();

    assert!(
        (xla_loss - eager_loss).abs() <= 1e-4 * eager_loss.abs().max(1e-6),
        "{name}: loss {xla_loss} (XLA) vs {eager_loss} (eager)"
    );
    let (mut d_all, mut n_all) = (0.0, 0.0);
    let mut worst = (0.0f64, String::new());
    for (p, want) in params.iter().zip(&reference) {
        let pname = p.variable().unwrap().name.clone();
        let got = step
            .optimizer_state(p)
            .unwrap_or_else(|| panic!("{name}: no gradient for {pname}"));
        let got = got[0].as_tch().unwrap();
        assert_eq!(got.size(), want.size(), "{name}: {pname}");
        let (d, n) = sq_diff_and_norm(got, want);
        assert!(d.is_finite() && n.is_finite(), "{name}: {pname} not finite");
        d_all += d;
        n_all += n;
        let e = rel(d, n);
        if e > worst.0 {
            worst = (e, pname);
        }
    }
    let err = rel(d_all, n_all);
    println!(
        "{name:<16} {} batch {batch}: {} params ({n_elems} elements), grad rel err {err:.2e} \
         (worst tensor {:.2e} {}), |g| {:.2e}, eager {:.1}s, trace+compile+run XLA {:.1}s",
        if train { "train" } else { "eval " },
        params.len(),
        worst.0,
        worst.1,
        n_all.sqrt(),
        t_eager.as_secs_f64(),
        t_xla.as_secs_f64()
    );
    assert!(n_all > 0.0, "{name}: the reference gradient is zero");
    assert!(err <= 1e-3, "{name}: gradient relative error {err:.3e}");
    err
}

/// Train mode: batch statistics, so BatchNorm's training-mode gradient (through the batch mean
/// and variance) is checked here. No dropout in ResNets. Measured 8e-6, at f32's noise floor:
/// libtorch's own gradients move by 6e-6 under a 1e-7 input perturbation.
#[test]
fn resnet18_grads() {
    check_grads("resnet18", true, 2, None);
}

/// Eval mode: in train mode at batch 2 the last stage's BatchNorms normalise over 2x2x2 = 8
/// values per channel and the gradient is ill-conditioned: libtorch's own gradients move by 2%
/// under a 1e-7 input perturbation (resnext50: 1%), so any difference in f32 summation order
/// shows up at that size. resnet18 covers the training-mode BatchNorm gradient. In eval mode
/// measured 4e-5, again libtorch's own change under a 1e-7 input perturbation.
#[test]
fn resnet50_grads() {
    check_grads("resnet50", false, 2, None);
}

/// Eval mode: as resnet50 (ill-conditioned in train mode at small batch).
#[test]
fn resnext50_32x4d_grads() {
    check_grads("resnext50_32x4d", false, 2, None);
}

/// Eval mode: the classifier has dropout (p = 0.5).
#[test]
fn alexnet_grads() {
    check_grads("alexnet", false, 2, None);
}

/// Eval mode: the classifier has dropout (p = 0.2).
#[test]
fn mobilenet_v2_grads() {
    check_grads("mobilenet_v2", false, 2, None);
}

/// Eval mode: the classifier has dropout (p = 0.2).
#[test]
fn mnasnet1_0_grads() {
    check_grads("mnasnet1_0", false, 2, None);
}

/// Eval mode: the classifier has dropout (p = 0.5).
#[test]
fn squeezenet1_1_grads() {
    check_grads("squeezenet1_1", false, 2, None);
}

/// Eval mode: the classifier has dropout (p = 0.5). Batch 1 and 32x32 images, the smallest
/// input VGG16 accepts (five 2x2 max pools down to 1x1; the adaptive pool then replicates it to
/// 7x7), to keep the 138M-parameter model's time and memory modest.
#[test]
fn vgg16_grads() {
    let x = Tensor::randn(&[1, 3, 32, 32], 1).unwrap();
    check_grads("vgg16", false, 1, Some(vec![x]));
}

/// Eval mode: dropout (p = 0.1) after the embeddings and in every layer.
#[test]
fn bert_grads() {
    check_grads("bert", false, 2, None);
}

/// Train mode: the ViT has neither dropout nor BatchNorm, so train and eval are the same
/// computation.
#[test]
fn vit_grads() {
    check_grads("vit", true, 2, None);
}

/// Train mode: two linear layers, no mode-dependent behaviour.
#[test]
fn linear_grads() {
    check_grads("linear", true, 2, None);
}

/// Every zoo model has a gradient test above.
#[test]
fn every_zoo_model_is_covered() {
    let covered = [
        "resnet18",
        "resnet50",
        "resnext50_32x4d",
        "alexnet",
        "mobilenet_v2",
        "mnasnet1_0",
        "squeezenet1_1",
        "vgg16",
        "bert",
        "vit",
        "linear",
    ];
    for name in zoo::NAMES {
        assert!(
            covered.contains(name),
            "no gradient test for zoo model {name}"
        );
    }
}

/// resnet18 in train mode (batch statistics, running statistics updated), three SGD+momentum
/// steps in Split and in Fused mode vs the eager `EagerTrainStep`: BatchNorm running mean and
/// variance (rel <= 1e-4 per tensor), `num_batches_tracked` (exact) and parameters (rel <= 1e-3
/// per tensor, and the parameter change over the three steps rel <= 1e-3 globally).
///
/// Loss: the zoo's default (mean of the logits). Learning rate 0.05: the parameters change by
/// about 0.34 in global norm over the three steps (printed). Much larger rates leave the comparison
/// meaningless rather than failing for a kiln reason: at lr 0.5 the first step lands where
/// BatchNorm over 8 values per channel (layer4 is 2x2 at batch 2) is ill-conditioned, and
/// libtorch's own second-step gradient changes by 2.6% between its first-step parameters and
/// XLA's, which differ by 1e-5 of the update (f32 summation order).
#[test]
fn resnet18_batchnorm_running_stats_and_params_match_eager() {
    const STEPS: u64 = 3;
    const BATCH: usize = 2;
    let lr = 0.05;
    let opt = Sgd::new().momentum(0.9);
    let batches: Vec<Vec<Tensor>> = (0..STEPS)
        .map(|s| {
            zoo::build("resnet18", 0)
                .unwrap()
                .example_inputs(BATCH, 10 + s)
                .unwrap()
        })
        .collect();
    let loss_of = |m: &SharedModel, xs: &[Tensor]| -> kiln::Result<Tensor> {
        let out = m.forward(xs, true)?;
        m.loss(&out, xs)
    };

    let t0 = Instant::now();
    let initial: SharedModel = SharedModel::new(zoo::build("resnet18", 0).unwrap());
    let eager_model: SharedModel = SharedModel::new(zoo::build("resnet18", 0).unwrap());
    let em = eager_model.clone();
    let mut eager = EagerTrainStep::new(eager_model.store(), opt, move |xs| loss_of(&em, xs))
        .unwrap()
        .with_lr(lr);
    let eager_losses: Vec<f64> = batches.iter().map(|b| eager.step(b).unwrap()).collect();
    println!(
        "resnet18 eager: {STEPS} steps {:.1}s, losses {eager_losses:?}",
        t0.elapsed().as_secs_f64()
    );
    let want = eager_model.store().vars();
    let init = initial.store().vars();

    for mode in [TrainMode::Split, TrainMode::Fused] {
        let t0 = Instant::now();
        let model: SharedModel = SharedModel::new(zoo::build("resnet18", 0).unwrap());
        let m = model.clone();
        let mut step = TrainStep::new(XlaBackend::new().unwrap(), model.store(), opt, move |xs| {
            loss_of(&m, xs)
        })
        .unwrap()
        .with_mode(mode)
        .with_lr(lr);
        let losses: Vec<f64> = batches.iter().map(|b| step.step(b).unwrap()).collect();
        step.sync_to_store().unwrap();
        let per_step = if mode == TrainMode::Split { 3 } else { 1 };
        assert_eq!(step.executables_per_step(), Some(per_step));
        for (s, (l, le)) in losses.iter().zip(&eager_losses).enumerate() {
            assert!(
                (l - le).abs() <= 1e-4 * le.abs().max(1e-6),
                "{mode:?} step {s}: loss {l} vs eager {le}"
            );
        }
        let got = model.store().vars();
        assert_eq!(got.len(), want.len());
        let (mut n_bn, mut worst_stat, mut worst_param) = (0, 0.0f64, 0.0f64);
        let (mut dd, mut dn) = (0.0, 0.0);
        for (((name, g), (wname, w)), (_, i)) in got.iter().zip(&want).zip(&init) {
            assert_eq!(name, wname);
            let (gt, wt) = (g.as_tch().unwrap(), w.as_tch().unwrap());
            if name.ends_with("num_batches_tracked") {
                assert_eq!(
                    g.to_f64_vec().unwrap(),
                    vec![STEPS as f64],
                    "{mode:?}: {name}"
                );
                assert_eq!(w.to_f64_vec().unwrap(), vec![STEPS as f64], "eager {name}");
                n_bn += 1;
                continue;
            }
            let e = {
                let (d, n) = sq_diff_and_norm(gt, wt);
                rel(d, n)
            };
            if name.ends_with("running_mean") || name.ends_with("running_var") {
                worst_stat = worst_stat.max(e);
                assert!(e <= 1e-4, "{mode:?}: {name} rel err {e:.3e} vs eager");
                // The statistics did move.
                let (moved, _) = sq_diff_and_norm(wt, i.as_tch().unwrap());
                assert!(moved > 0.0, "{name} never updated");
            } else {
                worst_param = worst_param.max(e);
                assert!(e <= 1e-3, "{mode:?}: {name} rel err {e:.3e} vs eager");
                let it = i.as_tch().unwrap();
                let (d, n) = sq_diff_and_norm(&(gt - it), &(wt - it));
                dd += d;
                dn += n;
            }
        }
        assert_eq!(n_bn, 20, "resnet18 has 20 BatchNorms");
        let delta = rel(dd, dn);
        println!(
            "resnet18 {mode:?}: {STEPS} steps {:.1}s, losses {losses:?}; worst running-stat rel \
             err {worst_stat:.2e}, worst parameter rel err {worst_param:.2e}, parameter change \
             rel err {delta:.2e} (|change| {:.2e})",
            t0.elapsed().as_secs_f64(),
            dn.sqrt()
        );
        assert!(dn > 0.0);
        assert!(
            delta <= 1e-3,
            "{mode:?}: parameter change rel err {delta:.3e}"
        );
    }
}
