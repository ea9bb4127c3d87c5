//! bf16 and f16: transfers, safetensors, traced models, and mixed-precision training (f32
//! master weights, 16-bit compute, dynamic loss scaling for f16).
//!
//! Tolerances. A 16-bit model is compared with the same model in float64 (never with a fixed
//! tolerance against libtorch in the 16-bit dtype, which rounds at other points): its error is
//! bounded by a multiple of libtorch's own error in that dtype, as `tests/ops.rs` does per op.
//! Mixed-precision training is judged by its result: the test accuracy of the digits CNN
//! within 1 point of float32 training from the same initial weights and batches.

#[path = "../examples/common/digits.rs"]
mod digits;

use digits::{permutation, Digits};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::nn::{Conv2d, Conv2dConfig, Flatten, Linear, Module, ParamStore, Sequential, Shared};
use kiln::optim::Sgd;
use kiln::train::{LossScaling, TrainMode, TrainStep};
use kiln::{compile, DType, Tensor, TensorType};
use std::time::Instant;

fn xla() -> XlaBackend {
    XlaBackend::new().expect("the PJRT CPU plugin (run scripts/bootstrap.sh)")
}

/// Every 16-bit pattern (NaNs with payloads, infinities, subnormals, ±0) survives host →
/// device → host unchanged, on both backends.
#[test]
fn every_bf16_and_f16_bit_pattern_round_trips_bit_exactly() -> kiln::Result<()> {
    let bits: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
    for d in [DType::BF16, DType::F16] {
        let h = HostTensor::from_bytes(TensorType::new(d, [256, 256]), bits.clone())?;
        let x = xla();
        let back = x.to_host(&x.to_device(&h)?)?;
        assert_eq!(back.ty(), h.ty());
        assert!(
            back.bytes() == h.bytes(),
            "{d}: xla round trip changed bits"
        );
        let e = EagerBackend::new();
        let back = e.to_host(&e.to_device(&h)?)?;
        assert!(
            back.bytes() == h.bytes(),
            "{d}: eager round trip changed bits"
        );
        // And through an eager tensor (tch BFloat16 / Half).
        let back = Tensor::from_host(&h)?.to_host()?;
        assert!(
            back.bytes() == h.bytes(),
            "{d}: tch round trip changed bits"
        );
    }
    // The host element types are the `half` crate's.
    let v = [half::bf16::from_f32(1.5), half::bf16::NEG_INFINITY];
    let h = HostTensor::from_slice(&[2], &v)?;
    assert_eq!(h.ty().dtype, DType::BF16);
    assert_eq!(h.to_vec::<half::bf16>()?, v);
    assert_eq!(h.to_f64_vec(), [1.5, f64::NEG_INFINITY]);
    Ok(())
}

/// A bf16 / f16 store saves as safetensors BF16 / F16 and loads back bit for bit; loading it
/// into an f32 store is a clear dtype error.
#[test]
fn half_stores_round_trip_through_safetensors() -> kiln::Result<()> {
    let dir = std::env::temp_dir().join(format!("kiln-half-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for d in [DType::BF16, DType::F16] {
        let a = ParamStore::with_seed(3).with_float_dtype(d)?;
        Linear::new(&a.root().sub("fc"), 5, 4, true)?;
        let path = dir.join(format!("{d}.safetensors"));
        a.save_safetensors(&path)?;
        let raw = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
        let want = if d == DType::BF16 {
            safetensors::Dtype::BF16
        } else {
            safetensors::Dtype::F16
        };
        assert_eq!(st.tensor("fc.weight").unwrap().dtype(), want);
        let b = ParamStore::with_seed(4).with_float_dtype(d)?;
        Linear::new(&b.root().sub("fc"), 5, 4, true)?;
        assert_ne!(a.state_dict()?, b.state_dict()?);
        b.load_safetensors(&path)?;
        assert_eq!(a.state_dict()?, b.state_dict()?);
        let c = ParamStore::with_seed(4);
        Linear::new(&c.root().sub("fc"), 5, 4, true)?;
        let e = c.load_safetensors(&path).unwrap_err().to_string();
        assert!(e.contains("fc.") && e.contains(&format!("{want:?}")), "{e}");
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

/// A small CNN traced in bf16/f16 and compiled to XLA, against the eager run in the same dtype
/// and the float64 model: XLA's error is at most 4× libtorch's (normwise, plus one rounding).
#[test]
fn a_traced_half_cnn_matches_float64_within_libtorchs_error() -> kiln::Result<()> {
    for d in [DType::BF16, DType::F16] {
        let store = ParamStore::with_seed(5).with_float_dtype(d)?;
        let model = Shared::new(digits::cnn(&store)?);
        let x = Tensor::randn_dtype(&[4, 1, 8, 8], d, 6)?;
        let eager = tch::no_grad(|| model.forward(&x))?;
        let m = model.clone();
        let mut f = compile(xla(), move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]));
        let compiled = f.run(std::slice::from_ref(&x))?.remove(0);
        assert_eq!(compiled.dtype(), d);
        // The float64 twin: the same (rounded) weights and input.
        let s64 = ParamStore::with_seed(5).with_float_dtype(DType::F64)?;
        let m64 = digits::cnn(&s64)?;
        s64.copy_from(&store)?;
        let want = tch::no_grad(|| m64.forward(&x.to_dtype(DType::F64)?))?.to_f64_vec()?;
        let err = |t: &Tensor| -> kiln::Result<f64> {
            let v = t.to_f64_vec()?;
            Ok(v.iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max))
        };
        let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        let (e_torch, e_xla) = (err(&eager)?, err(&compiled)?);
        let u = d.epsilon().unwrap() / 2.0;
        eprintln!(
            "{d} cnn: max error vs float64 relative to max |y|: libtorch {:.2e}, xla {:.2e}",
            e_torch / scale,
            e_xla / scale
        );
        assert!(
            e_xla <= 4.0 * e_torch.max(u * scale),
            "{d}: xla error {e_xla:e}, libtorch {e_torch:e}"
        );
    }
    Ok(())
}

const BATCH: usize = 64;

struct Run {
    accuracy: f64,
    final_loss: f64,
    ms_per_step: f64,
    skipped: Option<u64>,
    scale: Option<f64>,
}

/// Trains the digits CNN for `epochs` from seed 1 (as `examples/train.rs`), in `mixed`
/// precision if given; returns the f32 test accuracy of the (f32 master) weights.
fn train_digits(
    data: &Digits,
    mode: TrainMode,
    mixed: Option<DType>,
    epochs: usize,
) -> kiln::Result<Run> {
    let order = permutation(data.len(), 0);
    let (test_idx, train_idx) = order.split_at(data.len() / 5);
    let store = ParamStore::with_seed(1);
    let model = Shared::new(digits::cnn(&store)?);
    let m = model.clone();
    let loss_fn = move |xs: &[Tensor]| m.forward_t(&xs[0], true)?.cross_entropy(&xs[1]);
    let mut step = TrainStep::new(xla(), &store, Sgd::new().momentum(0.9), loss_fn)?
        .with_mode(mode)
        .with_lr(0.05);
    if let Some(d) = mixed {
        step = step.with_mixed_precision(d)?;
    }
    let (mut total, mut n, mut timed, mut steps) = (0.0, 0, 0.0, 0);
    for epoch in 0..epochs {
        let perm = permutation(train_idx.len(), 100 + epoch as u64);
        total = 0.0;
        n = 0;
        let t0 = Instant::now();
        for chunk in perm.chunks_exact(BATCH) {
            let idx: Vec<usize> = chunk.iter().map(|&i| train_idx[i]).collect();
            let (x, y) = data.batch(&idx)?;
            total += step.step(&[x, y])?;
            n += 1;
        }
        // Epoch 1 compiles.
        if epoch > 0 {
            timed += t0.elapsed().as_secs_f64();
            steps += n;
        }
    }
    step.sync_to_store()?;
    Ok(Run {
        accuracy: digits::accuracy(&model, data, test_idx)?,
        final_loss: total / n as f64,
        ms_per_step: timed * 1e3 / steps.max(1) as f64,
        skipped: step.skipped_steps()?,
        scale: step.loss_scale()?,
    })
}

/// bf16 and f16 (with loss scaling) mixed-precision training reach float32's test accuracy
/// within 1 point; prints time per step (reported, not asserted).
#[test]
fn mixed_precision_digits_cnn_reaches_f32_accuracy() -> kiln::Result<()> {
    let data = Digits::load()?;
    let epochs = 10;
    let f32_run = train_digits(&data, TrainMode::Fused, None, epochs)?;
    eprintln!(
        "f32  fused: accuracy {:.2}%, final loss {:.4}, {:.2} ms/step",
        f32_run.accuracy * 100.0,
        f32_run.final_loss,
        f32_run.ms_per_step
    );
    assert!(f32_run.accuracy > 0.9, "f32 accuracy {}", f32_run.accuracy);
    for (mode, d) in [
        (TrainMode::Fused, DType::BF16),
        (TrainMode::Split, DType::BF16),
        (TrainMode::Fused, DType::F16),
    ] {
        let r = train_digits(&data, mode, Some(d), epochs)?;
        eprintln!(
            "{d} {mode:?}: accuracy {:.2}%, final loss {:.4}, {:.2} ms/step, loss scale {:?}, \
             skipped steps {:?}",
            r.accuracy * 100.0,
            r.final_loss,
            r.ms_per_step,
            r.scale,
            r.skipped
        );
        assert!(
            (r.accuracy - f32_run.accuracy).abs() <= 0.01,
            "{d} {mode:?}: accuracy {} vs f32 {}",
            r.accuracy,
            f32_run.accuracy
        );
        assert_eq!(r.scale.is_some(), d == DType::F16);
    }
    Ok(())
}

/// f16 with an injected overflow: a loss scale of 2^24 makes the cotangent entering the f16
/// classifier about 2^24 / 64 · |p - onehot| > 65504 (f16's largest value), so the first step's
/// gradients are inf: the step is skipped (parameters and momentum unchanged, checked here) and
/// the scale halves; it keeps halving on overflow until steps go through, training proceeds,
/// and the scale grows again after `growth_interval` good steps.
#[test]
fn f16_loss_scaling_skips_an_overflowing_step_and_recovers() -> kiln::Result<()> {
    let data = Digits::load()?;
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(1);
        let model = Shared::new(digits::cnn(&store)?);
        let m = model.clone();
        let loss_fn = move |xs: &[Tensor]| m.forward_t(&xs[0], true)?.cross_entropy(&xs[1]);
        let cfg = LossScaling {
            init_scale: 16777216.0,
            growth_interval: 4,
            ..LossScaling::default()
        };
        let mut step = TrainStep::new(xla(), &store, Sgd::new().momentum(0.9), loss_fn)?
            .with_mode(mode)
            .with_lr(0.05)
            .with_mixed_precision(DType::F16)?
            .with_loss_scaling(cfg)?;
        let before = store.state_dict()?;
        let idx: Vec<usize> = (0..BATCH).collect();
        let (x, y) = data.batch(&idx)?;
        let first = step.step(&[x.clone(), y.clone()])?;
        assert!(first.is_finite(), "the loss itself is finite: {first}");
        assert_eq!(step.skipped_steps()?, Some(1), "{mode:?}");
        assert_eq!(step.loss_scale()?, Some(8388608.0), "{mode:?}");
        step.sync_to_store()?;
        assert!(
            store.state_dict()? == before,
            "{mode:?}: a skipped step changed parameters"
        );
        for p in store.trainable() {
            for s in step.optimizer_state(&p).unwrap_or(&[]) {
                assert!(
                    s.to_f64_vec()?.iter().all(|&v| v == 0.0),
                    "{mode:?}: momentum"
                );
            }
        }
        // Recovery: the same batch, repeatedly.
        let mut last = first;
        let mut scales = Vec::new();
        for _ in 0..30 {
            last = step.step(&[x.clone(), y.clone()])?;
            scales.push(step.loss_scale()?.unwrap());
        }
        let skipped = step.skipped_steps()?.unwrap();
        eprintln!(
            "{mode:?}: loss {first:.4} -> {last:.4}, scales {scales:?}, skipped {skipped} of 31"
        );
        assert!(last < 0.9 * first, "{mode:?}: loss {first} -> {last}");
        assert!(skipped < 20, "{mode:?}: {skipped} skipped");
        assert!(
            scales.windows(2).any(|w| w[1] > w[0]),
            "{mode:?}: the scale never grew: {scales:?}"
        );
        step.sync_to_store()?;
        assert!(store.state_dict()? != before);
    }
    Ok(())
}

#[test]
fn mixed_precision_rejects_non_16_bit_dtypes_and_late_calls() -> kiln::Result<()> {
    let store = ParamStore::with_seed(1);
    let fc = Linear::new(&store.root().sub("fc"), 3, 1, true)?;
    let loss_fn = move |xs: &[Tensor]| fc.forward(&xs[0])?.square()?.mean_all();
    let step = TrainStep::new(xla(), &store, Sgd::new(), loss_fn)?;
    let e = step
        .with_mixed_precision(DType::F64)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("bf16 or f16"), "{e}");
    let store = ParamStore::with_seed(1);
    let fc = Linear::new(&store.root().sub("fc"), 3, 1, true)?;
    let loss_fn = move |xs: &[Tensor]| fc.forward(&xs[0])?.square()?.mean_all();
    let mut step = TrainStep::new(xla(), &store, Sgd::new(), loss_fn)?;
    step.step(&[Tensor::randn(&[2, 3], 0)?])?;
    let e = step
        .with_mixed_precision(DType::BF16)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("before the first step"), "{e}");
    Ok(())
}

/// A checkpoint keeps the loss-scaling state: a resumed f16 step has the same scale and
/// skipped-step count, and its next step equals the original's.
#[test]
fn a_checkpoint_resumes_loss_scaling() -> kiln::Result<()> {
    let data = Digits::load()?;
    let make = || -> kiln::Result<TrainStep<XlaBackend>> {
        let store = ParamStore::with_seed(1);
        let model = Shared::new(digits::cnn(&store)?);
        let loss_fn = move |xs: &[Tensor]| model.forward_t(&xs[0], true)?.cross_entropy(&xs[1]);
        let cfg = LossScaling {
            init_scale: 16777216.0,
            growth_interval: 3,
            ..LossScaling::default()
        };
        TrainStep::new(xla(), &store, Sgd::new().momentum(0.9), loss_fn)?
            .with_mode(TrainMode::Fused)
            .with_lr(0.05)
            .with_mixed_precision(DType::F16)?
            .with_loss_scaling(cfg)
    };
    let batches: Vec<(Tensor, Tensor)> = (0..8)
        .map(|k| data.batch(&(k * BATCH..(k + 1) * BATCH).collect::<Vec<_>>()))
        .collect::<kiln::Result<_>>()?;
    let mut a = make()?;
    for (x, y) in &batches[..6] {
        a.step(&[x.clone(), y.clone()])?;
    }
    let path =
        std::env::temp_dir().join(format!("kiln-mp-ckpt-{}.safetensors", std::process::id()));
    a.save_checkpoint(&path)?;
    let mut b = make()?;
    b.load_checkpoint(&path)?;
    std::fs::remove_file(&path).ok();
    assert_eq!(a.loss_scale()?, b.loss_scale()?);
    assert_eq!(a.skipped_steps()?, b.skipped_steps()?);
    assert!(a.skipped_steps()?.unwrap() > 0);
    for (x, y) in &batches[6..] {
        let (la, lb) = (
            a.step(&[x.clone(), y.clone()])?,
            b.step(&[x.clone(), y.clone()])?,
        );
        assert_eq!(la, lb);
        assert_eq!(a.loss_scale()?, b.loss_scale()?);
    }
    Ok(())
}

/// Mixed precision through BatchNorm (running statistics stay f32 buffers), LayerNorm, GELU,
/// dropout (masks from the in-graph generator), average pooling and AdamW, in both modes:
/// every step's loss stays within bf16's reach of the f32 run's, and the buffers move.
#[test]
fn mixed_precision_trains_batchnorm_dropout_adamw_models() -> kiln::Result<()> {
    use kiln::nn::{AdaptiveAvgPool2d, BatchNorm2d, Dropout, Gelu, LayerNorm};
    use kiln::optim::AdamW;
    let build = |store: &ParamStore| -> kiln::Result<Sequential> {
        let r = store.root();
        let pad1 = Conv2dConfig {
            padding: [1, 1],
            ..Default::default()
        };
        Ok(Sequential::new()
            .add(Conv2d::new(&r.sub("conv"), 3, 8, 3, pad1)?)
            .add(BatchNorm2d::new(&r.sub("bn"), 8)?)
            .add(Gelu::default())
            .add(AdaptiveAvgPool2d([2, 2]))
            .add(Flatten::default())
            .add(LayerNorm::new(&r.sub("ln"), &[32], 1e-5)?)
            .add(Dropout::new(0.1))
            .add(Linear::new(&r.sub("fc"), 32, 5, true)?))
    };
    let x = Tensor::randn(&[6, 3, 8, 8], 11)?;
    let y = Tensor::from_slice(&[6], &[0i64, 1, 2, 3, 4, 0])?;
    let mut losses: Vec<(Option<DType>, Vec<f64>)> = Vec::new();
    for (mode, mixed) in [
        (TrainMode::Fused, None),
        (TrainMode::Fused, Some(DType::BF16)),
        (TrainMode::Split, Some(DType::BF16)),
        (TrainMode::Split, Some(DType::F16)),
    ] {
        let store = ParamStore::with_seed(2);
        let model = Shared::new(build(&store)?);
        let m = model.clone();
        let loss_fn = move |xs: &[Tensor]| m.forward_t(&xs[0], true)?.cross_entropy(&xs[1]);
        let mut step = TrainStep::new(xla(), &store, AdamW::default(), loss_fn)?
            .with_mode(mode)
            .with_lr(1e-2)
            .with_seed(7)?;
        if let Some(d) = mixed {
            step = step.with_mixed_precision(d)?;
        }
        let before = store.get("bn.running_mean").unwrap().to_f64_vec()?;
        let mut l = Vec::new();
        for _ in 0..5 {
            l.push(step.step(&[x.clone(), y.clone()])?);
        }
        step.sync_to_store()?;
        let rm = store.get("bn.running_mean").unwrap();
        assert_eq!(rm.dtype(), DType::F32);
        assert_ne!(rm.to_f64_vec()?, before, "{mode:?} {mixed:?}: running mean");
        assert!(l[4] < l[0], "{mode:?} {mixed:?}: losses {l:?}");
        eprintln!("{mode:?} {mixed:?}: losses {l:?}");
        losses.push((mixed, l));
    }
    // Same data, weights and dropout masks: each 16-bit run's losses stay within 4 unit
    // roundoffs (relative) of the f32 run's over 5 steps (measured: 1.5e-3 absolute for bf16,
    // u = 3.9e-3; 1.5e-4 for f16, u = 4.9e-4; losses 0.5..1.7).
    let f32_losses = &losses[0].1;
    for (d, l) in &losses[1..] {
        let u = d.unwrap().epsilon().unwrap() / 2.0;
        for (a, b) in l.iter().zip(f32_losses) {
            assert!(
                (a - b).abs() <= 4.0 * u * b.abs(),
                "{d:?}: {l:?} vs f32 {f32_losses:?}"
            );
        }
    }
    Ok(())
}

fn smallest_normal(d: DType) -> f64 {
    match d {
        DType::F16 => 2f64.powi(-14),
        DType::F64 => f64::MIN_POSITIVE,
        _ => f32::MIN_POSITIVE as f64,
    }
}

/// `Tensor::to_dtype` between every pair of float dtypes, eagerly (libtorch) and traced +
/// compiled (XLA), equals the `half` crate's round-to-nearest-even conversion through f64
/// (exact: f64 holds every value of the other three, and a single rounding follows), except
/// that XLA:CPU flushes subnormals to zero.
#[test]
fn casts_between_all_float_dtypes_agree_eager_and_compiled() -> kiln::Result<()> {
    let values = [
        0.1,
        -2.75,
        1e-3,
        3.0e38,
        -7e-40,
        65504.0,
        65520.0,
        1e5,
        6e-8,
        1.0 / 3.0,
        0.0,
        -0.0,
    ];
    for from in DType::FLOATS {
        let x = Tensor::from_host(&HostTensor::from_slice(&[values.len()], &values)?)?
            .to_dtype(from)?;
        for to in DType::FLOATS {
            let eager = x.to_dtype(to)?.to_host()?;
            let mut f = compile(xla(), move |xs: &[Tensor]| Ok(vec![xs[0].to_dtype(to)?]));
            let compiled = f.run(std::slice::from_ref(&x))?.remove(0).to_host()?;
            let want: Vec<u8> = x
                .to_f64_vec()?
                .into_iter()
                .flat_map(|v| kiln::ir::Literal::scalar(to, v).bytes().to_vec())
                .collect();
            assert_eq!(eager.ty().dtype, to);
            assert!(eager.bytes() == want, "{from}->{to} eager: {eager:?}");
            // XLA:CPU runs with denormals flushed to zero (FTZ/DAZ): a subnormal source or
            // result may come out as a zero of the same sign. Everything else is bit-exact.
            let w = HostTensor::from_bytes(eager.ty().clone(), want.clone())?.to_f64_vec();
            let src = x.to_f64_vec()?;
            let tiny = smallest_normal(from).max(smallest_normal(to));
            for (i, (a, b)) in compiled.to_f64_vec().iter().zip(&w).enumerate() {
                let flushed = src[i].abs() < tiny
                    && *a == 0.0
                    && a.is_sign_negative() == b.is_sign_negative();
                assert!(
                    a.to_bits() == b.to_bits() || flushed,
                    "{from}->{to} xla: element {i} is {a:e}, want {b:e}"
                );
            }
        }
    }
    Ok(())
}
