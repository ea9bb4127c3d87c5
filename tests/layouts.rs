//! Device layouts of variables: a `Linear` weight read only by XLA dots lives transposed
//! (`[in, out]`) on the device, while every value the caller sees (results, `read_var`, the
//! store after `sync_to_store`) keeps PyTorch's layout.
//!
//! With kiln's kernels on, a compiled function's frozen f32 `Linear` weights go to the packed
//! linear kernel instead (which keeps PyTorch's layout), so XLA's own dots read them only
//! with the kernels off ([`no_kernels`]), in f64, or where the function updates the weight.

use kiln::backend::xla::{FfiMode, XlaBackend, XlaOptions};
use kiln::nn::{Linear, Module, ParamStore};
use kiln::{compile, Tensor, TensorType};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// `relu(x · w1ᵀ + b1) · w2ᵀ + b2` in float64 from the store's values.
fn reference(x: &Tensor, l1: &Linear, l2: &Linear) -> Vec<f64> {
    let d = |t: &Tensor| t.as_tch().unwrap().to_kind(tch::Kind::Double);
    let h = d(x).matmul(&d(&l1.weight).tr()) + d(l1.bias.as_ref().unwrap());
    let y = h.relu().matmul(&d(&l2.weight).tr()) + d(l2.bias.as_ref().unwrap());
    Vec::<f64>::try_from(y.reshape([-1])).unwrap()
}

fn rel_err(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// The XLA backend with kiln's kernels off: every product is XLA's own dot.
fn no_kernels() -> kiln::Result<XlaBackend> {
    Ok(XlaBackend::new()?.with_options(XlaOptions::default().ffi(FfiMode::Off)))
}

fn layers(store: &ParamStore) -> kiln::Result<(Linear, Linear)> {
    Ok((
        Linear::new(&store.root().sub("l1"), 64, 48, true)?,
        Linear::new(&store.root().sub("l2"), 48, 32, true)?,
    ))
}

#[test]
fn linear_weights_live_transposed_and_keep_their_values() -> kiln::Result<()> {
    let store = ParamStore::with_seed(7);
    let (l1, l2) = layers(&store)?;
    // The compiled function owns its layers (same seed, same values): `c1w` is its weight.
    let (c1, c2) = layers(&ParamStore::with_seed(7))?;
    let c1w = c1.weight.clone();
    // XLA's own dot (the kernels are off).
    let x = Tensor::randn(&[96, 64], 3)?;
    let mut f = compile(no_kernels()?, move |xs: &[Tensor]| {
        Ok(vec![c2.forward(&c1.forward(&xs[0])?.relu()?)?])
    });
    let got = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    let want = reference(&x, &l1, &l2);
    let eager = tch::no_grad(|| l2.forward(&l1.forward(&x)?.relu()?))?.to_f64_vec()?;
    // Within a few times eager float32's own error against float64.
    let (e_got, e_eager) = (rel_err(&got, &want), rel_err(&eager, &want));
    assert!(
        e_got <= 4.0 * e_eager + 1e-6,
        "{e_got:e} vs eager {e_eager:e}"
    );

    // The compiled program reads both weights as [in, out]; the biases are unchanged.
    let program = f.program(&[x.ty().clone()]).expect("traced");
    let types: Vec<TensorType> = program
        .graph
        .inputs()
        .iter()
        .map(|i| i.ty.clone())
        .collect();
    for (rows, cols) in [(64, 48), (48, 32)] {
        let t = TensorType::new(kiln::ir::DType::F32, [rows, cols]);
        assert!(types.contains(&t), "no {t} input in {types:?}");
    }
    assert!(types.contains(&TensorType::new(kiln::ir::DType::F32, [48])));

    // The caller's view of the device value is PyTorch's layout.
    let w1 = f.runtime().read_var(&c1w)?;
    assert_eq!(w1.ty().shape.dims(), &[48, 64]);
    assert_eq!(w1.to_f64_vec(), l1.weight.to_f64_vec()?);

    // A value set from the host (PyTorch's layout) is what the next call reads.
    let doubled =
        kiln::backend::HostTensor::from_tch(&(l1.weight.as_tch()? * 2.0), kiln::ir::DType::F32)?;
    f.runtime().set_var(&c1w, &doubled)?;
    l1.weight.assign(&Tensor::from_host(&doubled)?)?;
    let got = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    let want = reference(&x, &l1, &l2);
    assert!(rel_err(&got, &want) <= 4.0 * e_eager + 1e-6);
    Ok(())
}

#[test]
fn a_variable_the_function_updates_keeps_pytorchs_layout() -> kiln::Result<()> {
    let store = ParamStore::with_seed(8);
    let (l1, _) = layers(&store)?;
    let w = l1.weight.clone();
    let x = Tensor::randn(&[96, 64], 4)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        let y = l1.forward(&xs[0])?;
        l1.weight.assign(&l1.weight.mul_scalar(0.5)?)?;
        Ok(vec![y])
    });
    let before = w.to_f64_vec()?;
    f.run(std::slice::from_ref(&x))?;
    let program = f.program(&[x.ty().clone()]).expect("traced");
    assert!(program
        .graph
        .inputs()
        .iter()
        .any(|i| i.ty.shape.dims() == [48, 64]));
    f.sync_to_store()?;
    let after = w.to_f64_vec()?;
    assert!(before
        .iter()
        .zip(&after)
        .all(|(b, a)| (a - b * 0.5).abs() <= 1e-7 * b.abs()));
    Ok(())
}

/// A weight made transposed by a read-only program, then updated by a program of another
/// signature: the new value is transposed back to the device layout, and the store and later
/// calls see the right values.
#[test]
fn a_transposed_variable_updated_later_stays_right() -> kiln::Result<()> {
    let store = ParamStore::with_seed(9);
    let (l1, _) = layers(&store)?;
    let (w, b) = (l1.weight.clone(), l1.bias.clone().unwrap());
    let update = Arc::new(AtomicBool::new(false));
    let flag = update.clone();
    let mut f = compile(no_kernels()?, move |xs: &[Tensor]| {
        let y = l1.forward(&xs[0])?;
        if flag.load(Ordering::SeqCst) {
            l1.weight.assign(&l1.weight.add_scalar(1.0)?)?;
        }
        Ok(vec![y])
    });
    let x = Tensor::randn(&[96, 64], 5)?;
    let lin = |x: &Tensor, w: &[f64]| -> Vec<f64> {
        let wt = tch::Tensor::from_slice(w).reshape([48, 64]);
        let xd = x.as_tch().unwrap().to_kind(tch::Kind::Double);
        let bd = b.as_tch().unwrap().to_kind(tch::Kind::Double);
        Vec::<f64>::try_from((xd.matmul(&wt.tr()) + bd).reshape([-1])).unwrap()
    };
    let w0 = w.to_f64_vec()?;
    let y0 = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    assert!(rel_err(&y0, &lin(&x, &w0)) < 1e-5);
    let program = f.program(&[x.ty().clone()]).expect("traced");
    assert!(program
        .graph
        .inputs()
        .iter()
        .any(|i| i.ty.shape.dims() == [64, 48]));
    // Another signature, which updates the weight.
    update.store(true, Ordering::SeqCst);
    let x2 = Tensor::randn(&[80, 64], 6)?;
    let y1 = f.run(std::slice::from_ref(&x2))?[0].to_f64_vec()?;
    assert!(rel_err(&y1, &lin(&x2, &w0)) < 1e-5);
    let y2 = f.run(std::slice::from_ref(&x2))?[0].to_f64_vec()?;
    let w1: Vec<f64> = w0.iter().map(|v| v + 1.0).collect();
    assert!(rel_err(&y2, &lin(&x2, &w1)) < 1e-5);
    // The first signature's program reads the updated device value too.
    let w2: Vec<f64> = w0.iter().map(|v| v + 2.0).collect();
    let y3 = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    assert!(rel_err(&y3, &lin(&x, &w2)) < 1e-5);
    f.sync_to_store()?;
    let stored = w.to_f64_vec()?;
    assert!(stored.iter().zip(&w2).all(|(a, b)| (a - b).abs() < 1e-5));
    Ok(())
}

/// Products that kiln's kernels take (here tiny ones, the dot kernel's loop; and larger
/// ones with few rows, which every CPU packs, the packed linear) keep the weight in PyTorch's
/// layout.
#[test]
fn weights_of_kernel_products_keep_pytorchs_layout() -> kiln::Result<()> {
    let (c1, _) = layers(&ParamStore::with_seed(10))?;
    let x = Tensor::randn(&[4, 64], 6)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![c1.forward(&xs[0])?])
    });
    f.run(std::slice::from_ref(&x))?;
    let program = f.program(&[x.ty().clone()]).expect("traced");
    let dims: Vec<Vec<usize>> = program
        .graph
        .inputs()
        .iter()
        .map(|i| i.ty.shape.dims().to_vec())
        .collect();
    assert!(dims.contains(&vec![48, 64]), "{dims:?}");

    let (c1, _) = layers(&ParamStore::with_seed(11))?;
    let (w, b) = (c1.weight.clone(), c1.bias.clone().expect("a bias"));
    let x = Tensor::randn(&[32, 64], 7)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![c1.forward(&xs[0])?])
    });
    let text = f
        .inspect(std::slice::from_ref(&x))?
        .text("stablehlo")?
        .to_string();
    assert!(text.contains(kiln::backend::xla::kernels::PACKED_LINEAR_TARGET));
    let got = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    let program = f.program(&[x.ty().clone()]).expect("traced");
    assert!(program
        .graph
        .inputs()
        .iter()
        .any(|i| i.ty.shape.dims() == [48, 64]));
    let d = |t: &Tensor| t.as_tch().unwrap().to_kind(tch::Kind::Double);
    let want = Vec::<f64>::try_from((d(&x).matmul(&d(&w).tr()) + d(&b)).reshape([-1])).unwrap();
    assert!(rel_err(&got, &want) < 1e-5);
    Ok(())
}

/// A training step reads a `Linear` weight `[out, in]` as `x · Wᵀ` and forms the weight
/// gradient `dyᵀ · x`; with 1024-wide rows (the second layer's weight, the first layer's
/// output gradient) XLA would copy those operands into its product layout with a slow strided
/// loop, and kiln's tiled transpose takes them instead. A compiled function's weights live
/// transposed, which XLA folds into the product: no transpose call there. The step's updated
/// weights match a float64 reference as closely as eager float32's.
#[test]
fn slow_product_layouts_go_through_the_transpose_kernel_in_training_only() -> kiln::Result<()> {
    use kiln::optim::Sgd;
    use kiln::train::{TrainMode, TrainStep};
    let target = kiln::backend::xla::kernels::TRANSPOSE_TARGET;
    let layers = |seed| -> kiln::Result<(ParamStore, Linear, Linear)> {
        let store = ParamStore::with_seed(seed);
        let l1 = Linear::new(&store.root().sub("l1"), 256, 1024, true)?;
        let l2 = Linear::new(&store.root().sub("l2"), 1024, 256, true)?;
        Ok((store, l1, l2))
    };
    // More rows than the rule hands to libtorch's product: XLA's own dots.
    let x = Tensor::randn(&[128, 256], 12)?;

    let (_, l1, l2) = layers(12)?;
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![l2.forward(&l1.forward(&xs[0])?.relu()?)?])
    });
    let text = f
        .inspect(std::slice::from_ref(&x))?
        .text("stablehlo")?
        .to_string();
    assert!(!text.contains(target), "inference:\n{text}");

    let lr = 0.5;
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let (store, l1, l2) = layers(13)?;
        let params = [
            l1.weight.clone(),
            l1.bias.clone().expect("a bias"),
            l2.weight.clone(),
            l2.bias.clone().expect("a bias"),
        ];
        let start: Vec<tch::Tensor> = params.iter().map(|p| p.as_tch().unwrap().copy()).collect();
        let mut step = TrainStep::new(XlaBackend::new()?, &store, Sgd::new(), move |xs| {
            l2.forward(&l1.forward(&xs[0])?.relu()?)?
                .square()?
                .mean_all()
        })?
        .with_mode(mode)
        .with_lr(lr);
        let programs = step.inspect(std::slice::from_ref(&x))?;
        let calls: usize = programs
            .iter()
            .map(|p| p.text("stablehlo").map_or(0, |t| t.matches(target).count()))
            .sum();
        assert!(calls >= 2, "{mode:?}: {calls} transpose calls");
        step.step(std::slice::from_ref(&x))?;
        step.sync_to_store()?;

        // One SGD step in float64 (the reference) and in eager float32, from the same values.
        let sgd = |kind: tch::Kind| -> Vec<tch::Tensor> {
            let p: Vec<tch::Tensor> = start
                .iter()
                .map(|t| t.to_kind(kind).detach().set_requires_grad(true))
                .collect();
            let x = x.as_tch().unwrap().to_kind(kind);
            let h = (x.matmul(&p[0].tr()) + &p[1]).relu();
            let y = h.matmul(&p[2].tr()) + &p[3];
            y.square().mean(None::<tch::Kind>).backward();
            p.iter()
                .map(|t| (t - t.grad() * lr).detach().to_kind(tch::Kind::Double))
                .collect()
        };
        let (want, eager) = (sgd(tch::Kind::Double), sgd(tch::Kind::Float));
        for (i, p) in params.iter().enumerate() {
            let err = |a: &tch::Tensor| {
                (a - &want[i]).norm().double_value(&[]) / want[i].norm().double_value(&[])
            };
            let got = p.as_tch()?.to_kind(tch::Kind::Double);
            assert!(
                err(&got) <= 4.0 * err(&eager[i]) + 1e-7,
                "{mode:?}: parameter {i} error {:e}, eager float32 {:e}",
                err(&got),
                err(&eager[i])
            );
        }
    }
    Ok(())
}
