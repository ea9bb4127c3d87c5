//! Packed convolutions and linears (frozen weights, oneDNN, fused epilogues) end to end: zoo
//! models' compiled inference against their float64 twins, and packed weights that follow
//! every change of the variables they were made from.
//!
//! A test binary of its own: the packed-weight cache's counters are process-wide.

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::kernels::{self, PACKED_CONV_TARGET, PACKED_LINEAR_TARGET};
use kiln::backend::xla::{FfiMode, XlaBackend, XlaOptions};
use kiln::ir::DType;
use kiln::nn::{Linear, Module, MultiheadAttention, ParamStore};
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, Tensor};
use std::sync::Mutex;

/// Held by each test while it reads the cache's counters.
static SERIAL: Mutex<()> = Mutex::new(());

fn xla() -> XlaBackend {
    let b = XlaBackend::new().expect("the CPU plugin");
    assert_eq!(b.ffi_status(), Ok(()), "the CPU plugin runs kiln's kernels");
    b
}

/// `model`'s inference compiled on XLA under `mode`, and the StableHLO it lowers to for `xs`.
fn inference_under(
    model: &SharedModel,
    mode: FfiMode,
    xs: &[Tensor],
) -> (kiln::CompiledFn<XlaBackend>, String) {
    let m = model.clone();
    let be = xla().with_options(XlaOptions::default().ffi(mode));
    let f = compile(be, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]));
    let text = f
        .inspect(xs)
        .unwrap()
        .text("stablehlo")
        .unwrap()
        .to_string();
    (f, text)
}

/// Non-trivial BatchNorm statistics and affine parameters (fresh ones are the identity, which
/// would hide a wrong scale or shift).
fn randomize_batch_norm(model: &dyn Model, seed: u64) {
    let vars = model.store().vars();
    for (i, (name, t)) in vars.into_iter().enumerate() {
        let Some((prefix, leaf)) = name.rsplit_once('.') else {
            continue;
        };
        if !model
            .store()
            .vars()
            .iter()
            .any(|(n, _)| *n == format!("{prefix}.running_mean"))
        {
            continue;
        }
        let c = t.dims().first().copied().unwrap_or(0);
        let r = Tensor::randn(&[c], seed + i as u64).unwrap();
        let v = match leaf {
            "running_mean" => r.mul_scalar(0.1).unwrap(),
            "running_var" => r
                .abs()
                .unwrap()
                .mul_scalar(0.5)
                .unwrap()
                .add_scalar(0.5)
                .unwrap(),
            "weight" => r.mul_scalar(0.2).unwrap().add_scalar(1.0).unwrap(),
            "bias" => r.mul_scalar(0.1).unwrap(),
            _ => continue,
        };
        model.store().set(&name, &v.to_host().unwrap()).unwrap();
    }
}

/// The float64 twin of `model` (same values, an f64 store).
fn f64_twin(name: &str, model: &dyn Model) -> SharedModel {
    let store = ParamStore::with_seed(0)
        .with_float_dtype(DType::F64)
        .unwrap();
    let twin = zoo::build_in(name, store).unwrap();
    twin.store().copy_from(model.store()).unwrap();
    SharedModel::new(twin)
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_host().unwrap().to_f64_vec()
}

/// Largest absolute difference, relative to the largest absolute reference value.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    assert!(scale > 0.0, "the reference is zero");
    got.iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()))
        / scale
}

/// Compiled inference of zoo models whose convolutions and linears are packed (BatchNorm
/// folded, ReLU / ReLU6 / GELU, biases and residual sums fused) against the float64 twin:
/// the error is bounded by a small multiple of what float32 costs eager libtorch on the same
/// model, plus a floor.
///
/// Under the default rule a linear with many rows is packed only where oneDNN has AVX-512
/// ([`kernels::onednn_avx512`]); [`FfiMode::All`] packs every one, so the transformers'
/// epilogues (GELU, residual sums) are checked on every CPU.
#[test]
fn zoo_models_with_packed_kernels_match_float64() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let wide = kernels::onednn_avx512();
    // (model, packed convolutions: all of them, those in runs the default rule packs,
    // packed linears: all of them, those with few rows). vit's patch embedding is a kernel
    // under the rule only beside its packed linears: without AVX-512 they stay in XLA, the
    // program's kernels would run serially, and ungrouped convolutions then go back to XLA
    // (`kernels::rule_selection`).
    //
    // Packed linear calls: all of them, those with few rows; a transformer's feed-forward
    // pair (fc1, fc2) is one call (alexnet's three linears in a row stay three).
    for (name, all_convs, auto_convs, linears, few_row_linears) in [
        ("resnet18", 20, 20, 1, 1),
        ("mobilenet_v2", 52, 52, 1, 1),
        ("squeezenet1_1", 26, 0, 0, 0),
        ("resnext50_32x4d", 53, 53, 1, 1),
        ("alexnet", 5, 4, 3, 3),
        ("bert", 0, 0, 16 - 4, 0),
        ("vit", 1, usize::from(wide), 17 - 4, 1),
    ] {
        let model = SharedModel::new(zoo::build(name, 0).unwrap());
        randomize_batch_norm(&model, 77);
        let twin = f64_twin(name, &model);
        let xs = model.example_inputs(2, 5).unwrap();
        let xs64: Vec<Tensor> = xs
            .iter()
            .map(|x| {
                if x.dtype().is_float() {
                    x.to_dtype(DType::F64).unwrap()
                } else {
                    x.clone()
                }
            })
            .collect();
        let want = values(&twin.forward(&xs64, false).unwrap());
        let eager = values(&model.forward(&xs, false).unwrap());

        let auto = if wide { linears } else { few_row_linears };
        let mut modes = vec![(FfiMode::Auto, auto_convs, auto)];
        if (auto_convs, auto) != (all_convs, linears) {
            modes.push((FfiMode::All, all_convs, linears));
        }
        for (mode, convs, linears) in modes {
            let (mut f, text) = inference_under(&model, mode, &xs);
            assert_eq!(
                (
                    text.matches(PACKED_CONV_TARGET).count(),
                    text.matches(PACKED_LINEAR_TARGET).count()
                ),
                (convs, linears),
                "{name} {mode:?}: packed convolutions and linears"
            );
            if convs == all_convs {
                assert!(!text.contains("stablehlo.convolution"), "{name}");
            }
            for call in 0..3 {
                let got = values(&f.run(&xs).unwrap()[0]);
                let (e_xla, e_eager) = (rel_err(&got, &want), rel_err(&eager, &want));
                println!(
                    "{name} {mode:?} call {call}: vs float64 compiled {e_xla:.2e}, eager {e_eager:.2e}"
                );
                assert!(
                    e_xla <= 4.0 * e_eager + 2e-6,
                    "{name} {mode:?} call {call}: compiled error {e_xla:.2e}, eager float32's {e_eager:.2e}"
                );
            }
        }
    }
}

/// A packed weight is made from the values the variables hold when a call runs: after
/// `set_var`, after a refresh from the store, and after a call in training mode updated the
/// BatchNorm statistics in place (donated), the next inference call packs again and agrees
/// with eager libtorch on the new values. Between such changes, nothing is packed again.
#[test]
fn packed_weights_follow_every_change_of_their_variables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let name = "resnet18";
    let model = SharedModel::new(zoo::build(name, 0).unwrap());
    randomize_batch_norm(&model, 5);
    let xs = model.example_inputs(2, 9).unwrap();
    let train_xs = model.example_inputs(4, 10).unwrap();
    let m = model.clone();
    // Batch 4 is traced in training mode (BatchNorm updates its running statistics, donated
    // in place), batch 2 in evaluation mode (packed convolutions on the frozen weights).
    let mut f = compile(xla(), move |xs: &[Tensor]| {
        let train = xs[0].dims()[0] == 4;
        Ok(vec![m.forward(xs, train)?])
    });
    let check = |f: &mut kiln::CompiledFn<XlaBackend>, what: &str| {
        let want = values(&model.forward(&xs, false).unwrap());
        let got = values(&f.run(&xs).unwrap()[0]);
        let e = rel_err(&got, &want);
        assert!(e < 1e-4, "{what}: compiled differs from eager by {e:.2e}");
    };
    // Two calls first: a variable whose upload is still in flight when a call starts is
    // registered on the next one (the first call then packs without keeping the result).
    check(&mut f, "first call");
    check(&mut f, "second call");
    let packs = kernels::weight_cache_stats().packs;
    for _ in 0..3 {
        check(&mut f, "repeated call");
    }
    let s = kernels::weight_cache_stats();
    assert_eq!(s.packs, packs, "repeated calls pack nothing: {s:?}");
    assert!(s.cached >= 21, "{s:?}");

    // New weights through the runtime: a convolution's and the classifier's (a linear).
    for name in ["layer2.0.conv1.weight", "fc.weight"] {
        let (wname, w) = model
            .store()
            .vars()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap();
        let packs = kernels::weight_cache_stats().packs;
        let new = w.mul_scalar(-1.5).unwrap().to_host().unwrap();
        model.store().set(&wname, &new).unwrap();
        f.runtime().set_var(&w, &new).unwrap();
        check(&mut f, &format!("after set_var of {name}"));
        assert_eq!(kernels::weight_cache_stats().packs, packs + 1, "{name}");
    }

    // New BatchNorm statistics through the store.
    randomize_batch_norm(&model, 11);
    f.refresh_from_store().unwrap();
    check(&mut f, "after refresh_from_store");

    // A training-mode call updates the running statistics on the device (donating their
    // buffers); eager does the same on its side.
    f.run(&train_xs).unwrap();
    model.forward(&train_xs, true).unwrap();
    check(&mut f, "after a training-mode call");
    let packs = kernels::weight_cache_stats().packs;
    check(&mut f, "again");
    assert_eq!(kernels::weight_cache_stats().packs, packs);
}

/// With the FFI kernels off, nothing is packed, and the eager interpreter never packs.
#[test]
fn no_packed_convolutions_without_kernels() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let model = SharedModel::new(zoo::build("squeezenet1_1", 0).unwrap());
    let xs = model.example_inputs(2, 1).unwrap();
    let (mut f, text) = inference_under(&model, FfiMode::Off, &xs);
    assert!(!text.contains(PACKED_CONV_TARGET));
    let want = values(&model.forward(&xs, false).unwrap());
    assert!(rel_err(&values(&f.run(&xs).unwrap()[0]), &want) < 1e-4);
    let m = model.clone();
    let mut e = compile(EagerBackend::new(), move |xs: &[Tensor]| {
        Ok(vec![m.forward(xs, false)?])
    });
    assert!(rel_err(&values(&e.run(&xs).unwrap()[0]), &want) < 1e-5);
}

/// Functions compiled one after another on models of the same shapes with other values get
/// their buffers at addresses earlier, dropped ones had: each must see its own weights, never
/// packed weights left from before.
#[test]
fn fresh_functions_on_reused_memory_see_their_own_weights() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = xla();
    for round in 0..12u64 {
        let model = SharedModel::new(zoo::build("squeezenet1_1", round).unwrap());
        let xs = model.example_inputs(2, 3).unwrap();
        let want = values(&model.forward(&xs, false).unwrap());
        let m = model.clone();
        let mut f = compile(b.clone(), move |xs: &[Tensor]| {
            Ok(vec![m.forward(xs, false)?])
        });
        for call in 0..2 {
            let got = values(&f.run(&xs).unwrap()[0]);
            let e = rel_err(&got, &want);
            assert!(
                e < 1e-4,
                "round {round} call {call}: differs from eager by {e:.2e}"
            );
        }
    }
}

/// A feed-forward pair, `fc2(act(fc1(x)))` with fc2's optional residual sum, runs as one
/// packed linear call (fc1's result never leaves libtorch) and matches float64 within what
/// float32 costs eager libtorch, for each epilogue of the first linear and of the second.
#[test]
fn feed_forward_pairs_are_one_call_and_match_float64() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (case, (bias1, act, residual)) in [
        (true, "gelu", true),
        (false, "relu", false),
        (true, "none", true),
        (false, "gelu", false),
    ]
    .into_iter()
    .enumerate()
    {
        let store = ParamStore::with_seed(40 + case as u64);
        let root = store.root();
        let fc1 = Linear::new(&root.sub("fc1"), 64, 96, bias1).unwrap();
        let fc2 = Linear::new(&root.sub("fc2"), 96, 48, true).unwrap();
        let store64 = ParamStore::with_seed(0)
            .with_float_dtype(DType::F64)
            .unwrap();
        let root64 = store64.root();
        let fc1_64 = Linear::new(&root64.sub("fc1"), 64, 96, bias1).unwrap();
        let fc2_64 = Linear::new(&root64.sub("fc2"), 96, 48, true).unwrap();
        store64.copy_from(&store).unwrap();
        let ffn = move |fc1: &Linear, fc2: &Linear, xs: &[Tensor]| -> kiln::Result<Tensor> {
            let h = fc1.forward(&xs[0])?;
            let h = match act {
                "gelu" => h.gelu(false)?,
                "relu" => h.relu()?,
                _ => h,
            };
            let y = fc2.forward(&h)?;
            if residual {
                y.add(&xs[1])
            } else {
                Ok(y)
            }
        };
        let xs = vec![
            Tensor::randn(&[3, 40, 64], 7 + case as u64).unwrap(),
            Tensor::randn(&[3, 40, 48], 8 + case as u64).unwrap(),
        ];
        let xs64: Vec<Tensor> = xs.iter().map(|x| x.to_dtype(DType::F64).unwrap()).collect();
        let want = values(&ffn(&fc1_64, &fc2_64, &xs64).unwrap());
        let eager = values(&ffn(&fc1, &fc2, &xs).unwrap());
        let be = xla().with_options(XlaOptions::default().ffi(FfiMode::All));
        let mut f = compile(be, move |xs: &[Tensor]| Ok(vec![ffn(&fc1, &fc2, xs)?]));
        let text = f
            .inspect(&xs)
            .unwrap()
            .text("stablehlo")
            .unwrap()
            .to_string();
        let pre = if bias1 { 2 } else { 0 };
        assert_eq!(
            (
                text.matches(PACKED_LINEAR_TARGET).count(),
                text.matches(&format!("pre_epilogue = {pre} : i64")).count()
            ),
            (1, 1),
            "case {case}: one paired call:\n{text}"
        );
        let got = values(&f.run(&xs).unwrap()[0]);
        let (e_xla, e_eager) = (rel_err(&got, &want), rel_err(&eager, &want));
        println!("case {case}: vs float64 compiled {e_xla:.2e}, eager {e_eager:.2e}");
        assert!(
            e_xla <= 4.0 * e_eager + 2e-6,
            "case {case}: compiled error {e_xla:.2e}, eager float32's {e_eager:.2e}"
        );
    }
}

/// Self-attention whose q, k and v are views of one frozen input projection: the attention
/// call runs the projection itself (its result never goes to XLA), XLA drops the projection's
/// own call, and the result matches float64 within what float32 costs eager libtorch, with
/// and without biases and a mask.
#[test]
fn attention_runs_its_input_projection() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for (case, (bias, masked)) in [(true, false), (false, true)].into_iter().enumerate() {
        let store = ParamStore::with_seed(60 + case as u64);
        let mha = MultiheadAttention::new(&store.root().sub("attn"), 48, 4, 0.0, bias).unwrap();
        let store64 = ParamStore::with_seed(0)
            .with_float_dtype(DType::F64)
            .unwrap();
        let mha64 = MultiheadAttention::new(&store64.root().sub("attn"), 48, 4, 0.0, bias).unwrap();
        store64.copy_from(&store).unwrap();
        // Non-zero biases (fresh ones are zero).
        for (name, t) in store.vars() {
            if name.ends_with("bias") {
                let r = Tensor::randn(t.dims(), 61)
                    .unwrap()
                    .mul_scalar(0.3)
                    .unwrap();
                store.set(&name, &r.to_host().unwrap()).unwrap();
                store64
                    .set(&name, &r.to_dtype(DType::F64).unwrap().to_host().unwrap())
                    .unwrap();
            }
        }
        let xs = vec![
            Tensor::randn(&[3, 20, 48], 62 + case as u64).unwrap(),
            Tensor::randn(&[3, 4, 20, 20], 63).unwrap(),
        ];
        let xs64: Vec<Tensor> = xs.iter().map(|x| x.to_dtype(DType::F64).unwrap()).collect();
        let attend = move |m: &MultiheadAttention, xs: &[Tensor]| -> kiln::Result<Tensor> {
            m.self_attention(&xs[0], masked.then_some(&xs[1]), false)
        };
        let want = values(&attend(&mha64, &xs64).unwrap());
        let eager = values(&attend(&mha, &xs).unwrap());
        let be = xla().with_options(XlaOptions::default().ffi(FfiMode::All));
        let mut f = compile(be, move |xs: &[Tensor]| Ok(vec![attend(&mha, xs)?]));
        let inspected = f.inspect(&xs).unwrap();
        let text = inspected.text("stablehlo").unwrap().to_string();
        let optimized = inspected.text("optimized_hlo").unwrap().to_string();
        assert!(
            text.contains("pre_epilogue"),
            "case {case}: the attention call runs the projection:\n{text}"
        );
        // Only the output projection's call is left.
        assert_eq!(
            optimized
                .matches(&format!("\"{PACKED_LINEAR_TARGET}\""))
                .count(),
            1,
            "case {case}:\n{optimized}"
        );
        for call in 0..2 {
            let got = values(&f.run(&xs).unwrap()[0]);
            let (e_xla, e_eager) = (rel_err(&got, &want), rel_err(&eager, &want));
            println!(
                "case {case} call {call}: vs float64 compiled {e_xla:.2e}, eager {e_eager:.2e}"
            );
            assert!(
                e_xla <= 4.0 * e_eager + 2e-6,
                "case {case}: compiled error {e_xla:.2e}, eager float32's {e_eager:.2e}"
            );
        }
    }
}
