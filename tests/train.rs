//! `TrainStep`: parity with the eager (libtorch autograd) baseline, executables per step,
//! device residency, donation, state updates and randomness.
//!
//! Tolerances: a well-conditioned setup. The model is a small MLP with a tanh (smooth: no kink
//! whose side float32 rounding could flip), losses and parameters are O(1), and each value is a
//! sum of a few dozen products, so kiln and libtorch differ by a few float32 ulps (~1e-7); the
//! limits (1e-5 relative) leave two orders of magnitude on any instruction set
//! (`scripts/test_isa.sh`). Large models are judged against float64 in `zoo_grad.rs`.

mod common;

use common::{batch, donated_per_step, mse, rel_err_l2, sgd_step, store_values, Net};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{FfiMode, XlaBackend, XlaOptions};
use kiln::backend::Backend;
use kiln::nn::{Init, Linear, Module, ParamStore};
use kiln::optim::{AdamW, Optimizer, Sgd};
use kiln::train::{EagerTrainStep, TrainMode, TrainStep};
use kiln::{trace, DType, Tensor, TensorType, TraceMode};

fn compare_with_eager<O: Optimizer + Copy + 'static>(
    opt: O,
    mode: TrainMode,
    lr: f64,
) -> kiln::Result<()> {
    let eager_store = ParamStore::with_seed(3);
    let eager_net = Net::new(&eager_store, 0.0)?;
    let mut eager =
        EagerTrainStep::new(&eager_store, opt, move |xs| mse(&eager_net, xs))?.with_lr(lr);

    let store = ParamStore::with_seed(3);
    let net = Net::new(&store, 0.0)?;
    let mut step = TrainStep::new(XlaBackend::new()?, &store, opt, move |xs| mse(&net, xs))?
        .with_mode(mode)
        .with_lr(lr);
    for s in 0..5 {
        let b = batch(8, s)?;
        let le = eager.step(&b)?;
        let lc = step.step(&b)?;
        assert!(
            (le - lc).abs() <= 1e-5 * le.abs().max(1.0),
            "{mode:?} step {s}: loss {lc} vs eager {le}"
        );
    }
    step.sync_to_store()?;
    for ((name, got), (_, want)) in store_values(&store).iter().zip(store_values(&eager_store)) {
        let e = rel_err_l2(got, &want);
        assert!(e < 1e-5, "{mode:?}: {name} differs from eager by {e:e}");
    }
    assert_eq!(
        step.executables_per_step(),
        Some(if mode == TrainMode::Split { 3 } else { 1 })
    );
    Ok(())
}

#[test]
fn sgd_momentum_nesterov_matches_eager_split_and_fused() -> kiln::Result<()> {
    let opt = Sgd::new().momentum(0.9).nesterov(true).weight_decay(1e-2);
    compare_with_eager(opt, TrainMode::Split, 0.05)?;
    compare_with_eager(opt, TrainMode::Fused, 0.05)
}

#[test]
fn adamw_matches_eager_split_and_fused() -> kiln::Result<()> {
    let opt = AdamW::default();
    compare_with_eager(opt, TrainMode::Split, 1e-2)?;
    compare_with_eager(opt, TrainMode::Fused, 1e-2)
}

#[test]
fn executables_transfers_and_donation_per_step() -> kiln::Result<()> {
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(1);
        let net = Net::new(&store, 0.0)?;
        let n_params = store.trainable().len() as u64;
        let mut step = sgd_step(XlaBackend::new()?, &store, net, mode, 0.01)?;
        let b = batch(8, 0)?;
        let batch_bytes: usize = b.iter().map(|t| t.ty().size_in_bytes()).sum();
        step.step(&b)?;
        step.step(&b)?;
        let before = step.stats();
        for _ in 0..10 {
            step.step(&b)?;
        }
        let d = step.stats().since(&before);
        let per_step = if mode == TrainMode::Split { 3 } else { 1 };
        assert_eq!(d.executions, 10 * per_step, "{mode:?}");
        // Steady state: only the batch goes in, only the loss comes out.
        assert_eq!(d.h2d_bytes as usize, 10 * batch_bytes, "{mode:?}: {d}");
        assert_eq!(d.d2h_bytes, 10 * 4, "{mode:?}: {d}");
        assert_eq!(d.syncs, 10, "{mode:?}");
        assert_eq!((d.traces, d.compiles), (0, 0));
        assert_eq!(
            d.donated,
            10 * donated_per_step(mode, n_params),
            "{mode:?}: {d}"
        );
        // And XLA copies no input of the fused step on entry.
        if mode == TrainMode::Fused {
            let programs = step.inspect(&b)?;
            let hlo = programs[0].text("optimized_hlo")?;
            let entry = hlo.split("ENTRY").nth(1).unwrap_or_default();
            let copies: Vec<&str> = entry
                .lines()
                .filter(|l| l.contains(" copy(%Arg_"))
                .collect();
            assert!(copies.is_empty(), "{copies:#?}");
        }
        // Without reading the loss there is no sync at all.
        let before = step.stats();
        for _ in 0..5 {
            step.step_async(&b)?;
        }
        let d = step.stats().since(&before);
        assert_eq!((d.syncs, d.d2h_bytes), (0, 0), "{mode:?}");
        step.last_loss()?;
    }
    Ok(())
}

#[test]
fn synchronize_waits_for_the_whole_step_without_transfers() -> kiln::Result<()> {
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let make = |store: &ParamStore| -> kiln::Result<TrainStep<XlaBackend>> {
            sgd_step(XlaBackend::new()?, store, Net::new(store, 0.0)?, mode, 0.05)
        };
        let (a, b) = (ParamStore::with_seed(4), ParamStore::with_seed(4));
        let (mut sa, mut sb) = (make(&a)?, make(&b)?);
        // Nothing has run: nothing to wait for.
        sa.synchronize()?;
        let x = batch(8, 7)?;
        let before = sa.stats();
        for _ in 0..4 {
            sa.step_async(&x)?;
        }
        sa.synchronize()?;
        let d = sa.stats().since(&before);
        // One sync point, nothing copied to the host.
        assert_eq!((d.syncs, d.d2h_bytes), (1, 0), "{mode:?}: {d}");
        let loss_a = sa.last_loss()?;
        let mut loss_b = f64::NAN;
        for _ in 0..4 {
            loss_b = sb.step(&x)?;
        }
        assert_eq!(loss_a, loss_b, "{mode:?}");
        sa.sync_to_store()?;
        sb.sync_to_store()?;
        assert_eq!(store_values(&a), store_values(&b), "{mode:?}");
    }
    Ok(())
}

#[test]
fn state_updates_match_eager_and_lr_changes_do_not_recompile() -> kiln::Result<()> {
    let eager_store = ParamStore::with_seed(4);
    let en = Net::new(&eager_store, 0.0)?;
    let mut eager =
        EagerTrainStep::new(&eager_store, Sgd::new(), move |xs| mse(&en, xs))?.with_lr(0.1);
    let store = ParamStore::with_seed(4);
    let net = Net::new(&store, 0.0)?;
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
        mse(&net, xs)
    })?
    .with_mode(TrainMode::Fused)
    .with_lr(0.1);
    for s in 0..6 {
        let lr = 0.1 / (1.0 + s as f64);
        eager.set_lr(lr);
        step.set_lr(lr);
        let b = batch(8, 10 + s)?;
        eager.step(&b)?;
        step.step(&b)?;
    }
    assert_eq!(step.stats().compiles, 1);
    // The store is refreshed only on request.
    assert_eq!(store.get("running").unwrap().to_f64_vec()?, vec![0.0; 16]);
    step.sync_to_store()?;
    let got = store.get("running").unwrap().to_f64_vec()?;
    let want = eager_store.get("running").unwrap().to_f64_vec()?;
    assert!(rel_err_l2(&got, &want) < 1e-5);
    let got = store.get("l1.weight").unwrap().to_f64_vec()?;
    let want = eager_store.get("l1.weight").unwrap().to_f64_vec()?;
    assert!(rel_err_l2(&got, &want) < 1e-5);
    Ok(())
}

#[test]
fn dropout_masks_are_identical_on_both_backends_and_change_per_key() -> kiln::Result<()> {
    let traced = trace(&[TensorType::new(DType::F32, [64, 32])], |xs| {
        Ok(vec![xs[0].dropout(0.5, true)?])
    })?;
    let g = &traced.graph;
    let x = Tensor::randn(&[64, 32], 5)?.to_host()?;
    let run = |key: [u32; 2]| -> kiln::Result<(Vec<f64>, Vec<f64>)> {
        let k = kiln::backend::HostTensor::from_slice(&[2], &key)?;
        let inputs = [x.clone(), k];
        let e = EagerBackend::new();
        let ee = e.compile(g)?;
        let eb: Vec<_> = inputs
            .iter()
            .map(|h| e.to_device(h))
            .collect::<kiln::Result<_>>()?;
        let eo = e.execute(&ee, &eb.iter().collect::<Vec<_>>())?;
        let xla = XlaBackend::new()?;
        let xe = xla.compile(g)?;
        let xb: Vec<_> = inputs
            .iter()
            .map(|h| xla.to_device(h))
            .collect::<kiln::Result<_>>()?;
        let xo = xla.execute(&xe, &xb.iter().collect::<Vec<_>>())?;
        Ok((
            e.to_host(&eo[0])?.to_f64_vec(),
            xla.to_host(&xo[0])?.to_f64_vec(),
        ))
    };
    let (e1, x1) = run([7, 0])?;
    let mask = |v: &[f64]| v.iter().map(|&a| a != 0.0).collect::<Vec<bool>>();
    assert_eq!(
        mask(&e1),
        mask(&x1),
        "eager interpreter and XLA draw different masks"
    );
    let max = e1
        .iter()
        .zip(&x1)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(max < 1e-6);
    let kept = mask(&e1).iter().filter(|&&k| k).count() as f64 / e1.len() as f64;
    assert!((kept - 0.5).abs() < 0.06, "kept fraction {kept}");
    let (e2, x2) = run([7, 1])?;
    assert_eq!(mask(&e2), mask(&x2));
    assert_ne!(mask(&e1), mask(&e2), "a new key must give a new mask");
    Ok(())
}

#[test]
fn dropout_training_split_and_fused_draw_the_same_masks() -> kiln::Result<()> {
    let mut losses = Vec::new();
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(9);
        let net = Net::new(&store, 0.3)?;
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
            mse(&net, xs)
        })?
        .with_mode(mode)
        .with_lr(0.05)
        .with_seed(123)?;
        let mut l = Vec::new();
        for s in 0..4 {
            l.push(step.step(&batch(8, s)?)?);
        }
        losses.push(l);
    }
    for (a, b) in losses[0].iter().zip(&losses[1]) {
        assert!((a - b).abs() < 1e-5, "{losses:?}");
    }
    // Masks change between steps: same batch, different dropout -> losses differ.
    let store = ParamStore::with_seed(9);
    let net = Net::new(&store, 0.3)?;
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
        mse(&net, xs)
    })?
    .with_lr(0.0)
    .with_seed(5)?;
    let b = batch(8, 0)?;
    let (l1, l2) = (step.step(&b)?, step.step(&b)?);
    assert!(
        (l1 - l2).abs() > 1e-7,
        "lr 0, same batch: only the mask can change the loss"
    );
    Ok(())
}

#[test]
fn trace_every_step_retraces_but_compiles_once() -> kiln::Result<()> {
    let store = ParamStore::with_seed(2);
    let net = Net::new(&store, 0.0)?;
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
        mse(&net, xs)
    })?
    .with_trace_mode(TraceMode::EveryCall)
    .with_lr(0.01);
    let b = batch(8, 1)?;
    for _ in 0..5 {
        step.step(&b)?;
    }
    let s = step.stats();
    assert_eq!(s.traces, 5);
    assert_eq!(
        s.compiles, 3,
        "forward, backward, optimizer compiled once each"
    );
    Ok(())
}

/// Trace every step with a loss whose graph changes between steps in a constant only: each
/// step computes its own loss (two programs, each prepared once).
#[test]
fn trace_every_step_follows_a_changing_constant() -> kiln::Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Repeats (the latest trace again) and switches back (a program seen before).
    const SCALES: [f64; 6] = [1.0, 3.0, 3.0, 1.0, 1.0, 3.0];
    let store = ParamStore::new();
    let w = store.root().param("w", &[3], Init::Const(0.5))?;
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let wl = w.clone();
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
        let scale = SCALES[c.fetch_add(1, Ordering::Relaxed)];
        xs[0].mul(&wl)?.square()?.sum_all()?.mul_scalar(scale)
    })?
    .with_trace_mode(TraceMode::EveryCall)
    .with_lr(0.0);
    let x = Tensor::from_slice(&[3], &[1.0f32, -2.0, 4.0])?;
    // sum((x * 0.5)^2) = 0.25 * (1 + 4 + 16)
    let base = 0.25 * 21.0;
    for (i, scale) in SCALES.iter().enumerate() {
        let loss = step.step(std::slice::from_ref(&x))?;
        let want = scale * base;
        assert!((loss - want).abs() < 1e-5, "step {i}: {loss} vs {want}");
    }
    let s = step.stats();
    assert_eq!(s.traces, 6, "{s:?}");
    // Two programs of three executables each, sharing the optimizer's (the same graph).
    assert_eq!((s.compiles, s.cache_hits), (5, 1), "{s:?}");
    Ok(())
}

#[test]
fn a_loss_without_parameters_is_an_error() -> kiln::Result<()> {
    let store = ParamStore::new();
    let mut step = TrainStep::new(
        EagerBackend::new(),
        &store,
        Sgd::new(),
        |xs: &[Tensor]| xs[0].sum_all(),
    )?;
    let err = step
        .step(&[Tensor::randn(&[3], 0)?])
        .unwrap_err()
        .to_string();
    assert!(err.contains("trainable parameter"), "{err}");
    Ok(())
}

/// A loss that assigns buffers from the batch, from another variable, and one value to two
/// buffers: after the step the buffers hold those values, in both modes.
#[test]
fn a_loss_assigning_buffers_from_inputs_variables_and_one_value() -> kiln::Result<()> {
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(4);
        let r = store.root();
        let fc = Linear::new(&r.sub("fc"), 3, 1, true)?;
        let last_x = r.buffer("last_x", &[2, 3], Init::Const(0.0), DType::F32)?;
        let bias_copy = r.buffer("bias_copy", &[1], Init::Const(0.0), DType::F32)?;
        let twin_a = r.buffer("twin_a", &[], Init::Const(0.0), DType::F32)?;
        let twin_b = r.buffer("twin_b", &[], Init::Const(0.0), DType::F32)?;
        let bias0 = store.get("fc.bias").unwrap().to_f64_vec()?;
        let (lx, bc, a, b) = (
            last_x.clone(),
            bias_copy.clone(),
            twin_a.clone(),
            twin_b.clone(),
        );
        let bias = store.get("fc.bias").unwrap();
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
            lx.assign(&xs[0])?;
            bc.assign(&bias)?;
            let s = xs[0].sum_all()?.detach()?;
            a.assign(&s)?;
            b.assign(&s)?;
            fc.forward(&xs[0])?.square()?.mean_all()
        })?
        .with_mode(mode)
        .with_lr(0.1);
        let x = Tensor::from_slice(&[2, 3], &[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0])?;
        step.step(std::slice::from_ref(&x))?;
        step.sync_to_store()?;
        assert_eq!(last_x.to_f64_vec()?, x.to_f64_vec()?, "{mode:?}");
        // The bias before the update (the loss reads the parameter's value at the step's start).
        assert_eq!(bias_copy.to_f64_vec()?, bias0, "{mode:?}");
        assert_eq!(twin_a.to_f64_vec()?, vec![21.0], "{mode:?}");
        assert_eq!(twin_b.to_f64_vec()?, vec![21.0], "{mode:?}");
    }
    Ok(())
}

/// The step trains the parameters of the store it was given; parameters of another store that
/// the loss reads are constants (as a PyTorch optimizer built over one model's parameters).
#[test]
fn a_train_step_trains_only_the_parameters_of_its_store() -> kiln::Result<()> {
    let trained = ParamStore::with_seed(5);
    let frozen = ParamStore::with_seed(6);
    let a = Linear::new(&trained.root().sub("a"), 4, 4, true)?;
    let b = Linear::new(&frozen.root().sub("b"), 4, 1, true)?;
    let before_a = store_values(&trained);
    let before_b = store_values(&frozen);
    let mut step = TrainStep::new(XlaBackend::new()?, &trained, Sgd::new(), move |xs| {
        b.forward(&a.forward(&xs[0])?.tanh()?)?.square()?.mean_all()
    })?
    .with_lr(0.5);
    step.step(&[Tensor::randn(&[5, 4], 1)?])?;
    step.sync_to_store()?;
    assert_ne!(
        store_values(&trained),
        before_a,
        "the step's own store is trained"
    );
    assert_eq!(
        store_values(&frozen),
        before_b,
        "another store is left alone"
    );
    Ok(())
}

/// The gradient reads a buffer that the same step then updates: the backward pass must see
/// the value the forward pass read, not the new one (Split runs them as two executables).
#[test]
fn the_backward_pass_reads_the_values_the_forward_pass_read() -> kiln::Result<()> {
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::new();
        let r = store.root();
        let p = r.param("p", &[2], Init::Const(1.0))?;
        let v = r.buffer("v", &[2], Init::Const(0.0), DType::F32)?;
        v.assign(&Tensor::from_slice(&[2], &[2.0f32, 3.0])?)?;
        let (pp, vv) = (p.clone(), v.clone());
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |_xs| {
            let y = pp.mul(&vv)?.sum_all()?;
            vv.assign(&vv.add_scalar(1.0)?)?;
            Ok(y)
        })?
        .with_mode(mode)
        .with_lr(1.0);
        let dummy = Tensor::zeros(&[1], DType::F32)?;
        let loss = step.step(std::slice::from_ref(&dummy))?;
        step.sync_to_store()?;
        assert_eq!(loss, 5.0, "{mode:?}");
        // d loss / d p = v before the update = [2, 3].
        assert_eq!(p.to_f64_vec()?, vec![-1.0, -2.0], "{mode:?}");
        assert_eq!(v.to_f64_vec()?, vec![3.0, 4.0], "{mode:?}");
    }
    Ok(())
}

/// A detached value is a constant to autograd, traced as eagerly: `y · detach(y)` and
/// `(p - detach(2p))²` give libtorch's gradients (`x·y` and `-2p`, not `2x·y` and `2p`), and
/// a parameter detached in the trace is read anew at every step (its value at trace time
/// would leave the second term's gradient wrong from the second step on).
#[test]
fn detach_stops_gradients_as_eagerly() -> kiln::Result<()> {
    fn loss(p: &Tensor, x: &Tensor) -> kiln::Result<Tensor> {
        let y = p.mul(x)?;
        let a = y.mul(&y.detach()?)?.sum_all()?;
        let b = p.sub(&p.detach()?.mul_scalar(2.0)?)?.square()?.sum_all()?;
        a.add(&b)
    }
    let init = Init::Normal {
        mean: 0.0,
        std: 1.0,
    };
    let x = Tensor::randn(&[5], 3)?;
    let eager_store = ParamStore::with_seed(7);
    let ep = eager_store.root().param("p", &[5], init)?;
    let mut eager =
        EagerTrainStep::new(&eager_store, Sgd::new(), move |xs| loss(&ep, &xs[0]))?.with_lr(0.1);
    for _ in 0..3 {
        eager.step(std::slice::from_ref(&x))?;
    }
    let want = eager_store.get("p").unwrap().to_f64_vec()?;
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(7);
        let p = store.root().param("p", &[5], init)?;
        let before = p.to_f64_vec()?;
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
            loss(&p, &xs[0])
        })?
        .with_mode(mode)
        .with_lr(0.1);
        for _ in 0..3 {
            step.step(std::slice::from_ref(&x))?;
        }
        step.sync_to_store()?;
        let got = store.get("p").unwrap().to_f64_vec()?;
        assert!(rel_err_l2(&got, &before) > 0.1, "{mode:?}: {got:?}");
        assert!(
            rel_err_l2(&got, &want) < 1e-5,
            "{mode:?}: {got:?} vs {want:?}"
        );
    }
    Ok(())
}

/// A train step is `Send`: built here, driven on another thread, it trains exactly as here.
#[test]
fn a_train_step_moves_to_another_thread() -> kiln::Result<()> {
    let run = |on_worker: bool| -> kiln::Result<Vec<f64>> {
        let store = ParamStore::with_seed(12);
        let net = Net::new(&store, 0.2)?;
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
            mse(&net, xs)
        })?
        .with_lr(0.05)
        .with_seed(3)?;
        let mut steps = move || -> kiln::Result<Vec<f64>> {
            (0..4).map(|s| step.step(&batch(8, s)?)).collect()
        };
        if on_worker {
            std::thread::spawn(steps).join().expect("worker panicked")
        } else {
            steps()
        }
    };
    assert_eq!(run(false)?, run(true)?);
    Ok(())
}

/// A weight of 2^20 elements (4 MiB) is updated in place in the fused step: its update is
/// ordered after the products that read it (`Op::Barrier`, lowered to kiln's ordering call
/// where the kernels are in the plugin), so XLA copies no donated parameter of that size on
/// entry; the step still matches eager.
#[test]
fn a_large_weight_is_updated_in_place_and_matches_eager() -> kiln::Result<()> {
    // l1's weight is read by its product and, for l0's gradient, by its input gradient.
    let loss = |(l0, l1, l2): (Linear, Linear, Linear)| {
        move |xs: &[Tensor]| {
            let h = l0.forward(&xs[0])?.tanh()?;
            l2.forward(&l1.forward(&h)?.tanh()?)?
                .sub(&xs[1])?
                .square()?
                .mean_all()
        }
    };
    let model = |store: &ParamStore| -> kiln::Result<(Linear, Linear, Linear)> {
        let r = store.root();
        Ok((
            Linear::new(&r.sub("l0"), 16, 1024, true)?,
            Linear::new(&r.sub("l1"), 1024, 1024, true)?,
            Linear::new(&r.sub("l2"), 1024, 4, true)?,
        ))
    };
    let opt = Sgd::new().momentum(0.9);
    let xla = XlaBackend::new()?;
    // Without the kernels the barrier is dropped (and the weight copied); same values.
    let off = xla.with_options(XlaOptions::default().ffi(FfiMode::Off));
    for backend in [xla, off] {
        let eager_store = ParamStore::with_seed(5);
        let mut eager =
            EagerTrainStep::new(&eager_store, opt, loss(model(&eager_store)?))?.with_lr(0.1);
        let store = ParamStore::with_seed(5);
        let ordered = backend.effective_ffi() != FfiMode::Off;
        let mut step = TrainStep::new(backend, &store, opt, loss(model(&store)?))?
            .with_mode(TrainMode::Fused)
            .with_lr(0.1);
        for s in 0..3 {
            let xs = [
                Tensor::randn(&[8, 16], s)?,
                Tensor::randn(&[8, 4], s + 100)?,
            ];
            let (le, lc) = (eager.step(&xs)?, step.step(&xs)?);
            assert!(
                (le - lc).abs() <= 1e-5 * le.abs().max(1.0),
                "step {s}: {lc} vs {le}"
            );
        }
        let xs = [Tensor::randn(&[8, 16], 0)?, Tensor::randn(&[8, 4], 100)?];
        let fused = step.inspect(&xs)?.remove(0);
        let barriers = fused
            .graph()
            .petgraph()
            .node_indices()
            .filter(|&n| fused.graph().node(n).op == kiln::ir::Op::Barrier)
            .count();
        if ordered {
            assert_eq!(barriers, 1, "only l1's weight is large enough to order");
            let hlo = fused.text("optimized_hlo")?;
            assert!(!hlo.contains("f32[1024,1024]{1,0} copy("), "{hlo}");
        }
        step.sync_to_store()?;
        for ((name, got), (_, want)) in store_values(&store).iter().zip(store_values(&eager_store))
        {
            let e = rel_err_l2(got, &want);
            assert!(e < 1e-5, "{name} differs from eager by {e:e}");
        }
    }
    Ok(())
}

#[test]
fn an_embedding_under_plain_sgd_is_updated_in_place_and_matches_eager() -> kiln::Result<()> {
    // The gradient of an embedding is a scatter into zeros; plain SGD scales it by -lr, which
    // the XLA backend moves into the scatter's updates (`passes::ScaleScatterUpdates`) so that
    // XLA scatters into the weight itself instead of materialising the dense gradient.
    use kiln::nn::Embedding;
    let (num, dim) = (5000, 64);
    let loss = |(emb, head): (Embedding, Linear)| {
        move |xs: &[Tensor]| {
            let h = emb.forward(&xs[0])?.tanh()?;
            head.forward(&h)?.sub(&xs[1])?.square()?.mean_all()
        }
    };
    let model = |store: &ParamStore| -> kiln::Result<(Embedding, Linear)> {
        let r = store.root();
        Ok((
            Embedding::new(&r.sub("emb"), num, dim)?,
            Linear::new(&r.sub("head"), dim, 3, true)?,
        ))
    };
    let opt = Sgd::new();
    let eager_store = ParamStore::with_seed(9);
    let mut eager =
        EagerTrainStep::new(&eager_store, opt, loss(model(&eager_store)?))?.with_lr(0.5);
    let store = ParamStore::with_seed(9);
    let mut step = TrainStep::new(XlaBackend::new()?, &store, opt, loss(model(&store)?))?
        .with_mode(TrainMode::Fused)
        .with_lr(0.5);
    for s in 0..3 {
        // Repeated ids: their rows accumulate.
        let xs = [
            Tensor::randint(&[8, 12], 40, s)?,
            Tensor::randn(&[8, 12, 3], s + 100)?,
        ];
        let (le, lc) = (eager.step(&xs)?, step.step(&xs)?);
        assert!(
            (le - lc).abs() <= 1e-5 * le.abs().max(1.0),
            "step {s}: {lc} vs {le}"
        );
    }
    let xs = [
        Tensor::randint(&[8, 12], 40, 0)?,
        Tensor::randn(&[8, 12, 3], 100)?,
    ];
    let fused = step.inspect(&xs)?.remove(0);
    let hlo = fused.text("optimized_hlo")?;
    let entry = hlo.split("ENTRY").nth(1).unwrap_or_default();
    let dense = entry
        .lines()
        .filter(|l| l.contains(&format!("= f32[{num},{dim}]")))
        .count();
    // The weight's parameter and the scatter into it; a dense gradient would be a third.
    assert_eq!(dense, 2, "{entry}");
    step.sync_to_store()?;
    for ((name, got), (_, want)) in store_values(&store).iter().zip(store_values(&eager_store)) {
        let e = rel_err_l2(got, &want);
        assert!(e < 1e-5, "{name} differs from eager by {e:e}");
    }
    Ok(())
}

/// Run by `a_process_ending_right_after_a_split_step_exits_cleanly` in a child process: a
/// few split steps of a wide MLP (its backward takes tens of milliseconds), then the test
/// returns and the process exits while nothing but the step's drop waits for that backward.
#[test]
fn exit_child_entry() -> kiln::Result<()> {
    if std::env::var_os("KILN_TEST_EXIT_CHILD").is_none() {
        return Ok(());
    }
    let store = ParamStore::with_seed(5);
    let root = store.root();
    let layers: Vec<Linear> = (0..6)
        .map(|i| Linear::new(&root.sub(i), 512, 512, true))
        .collect::<kiln::Result<_>>()?;
    let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
        let mut h = xs[0].clone();
        for l in &layers {
            h = l.forward(&h)?.tanh()?;
        }
        h.square()?.mean_all()
    })?
    .with_mode(TrainMode::Split)
    .with_lr(1e-3);
    let x = Tensor::randn(&[512, 512], 6)?;
    for _ in 0..3 {
        step.step(std::slice::from_ref(&x))?;
    }
    println!("CHILD stepped");
    Ok(())
}

/// A split step returns once its loss is computed, with the backward and optimizer still
/// running; a process that ends right then (its `main` returns) must not crash. Before
/// dropping a step waited for them, the CPU plugin's exit handlers unmapped the oneDNN code
/// XLA's workers were running: SIGSEGV in 4 of 6 such processes (2-vCPU Zen 4). Three child
/// processes, each of which must exit with status 0.
#[test]
fn a_process_ending_right_after_a_split_step_exits_cleanly() {
    for run in 0..3 {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "exit_child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KILN_TEST_EXIT_CHILD", "1")
            .output()
            .expect("spawn child");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("CHILD stepped"),
            "child {run} ended with {:?}: {text}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
