//! Functional ops and layers: the eager fast path (libtorch's fused kernels, i.e. PyTorch's own
//! semantics) against the traced decomposition into primitives, run on the eager interpreter
//! and on XLA.
//!
//! Tolerances: a well-conditioned setup. Each check is one layer on seeded O(1) data, so both
//! sides compute the same formula with different float32 summation orders over at most a few
//! hundred terms; their difference is bounded by about `K * 2^-24` of the terms' magnitude,
//! below the `atol 1e-5 / rtol 1e-4` used here on any instruction set (`scripts/test_isa.sh`).

mod common;

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::nn::{
    BatchNorm2d, Conv2d, Conv2dConfig, EncoderLayerConfig, LayerNorm, Module, MultiheadAttention,
    ParamStore, TransformerEncoderLayer,
};
use kiln::{compile, DType, Result, Tensor};
use std::sync::{Arc, Mutex};

/// A handle on the test binary's one XLA backend.
fn xla() -> XlaBackend {
    common::xla().clone()
}

fn close(what: &str, a: &Tensor, b: &Tensor, atol: f64, rtol: f64) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes differ");
    let (x, y) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        assert!(
            (p - q).abs() <= atol + rtol * q.abs(),
            "{what}: element {i}: {p} vs {q} (|diff| {})",
            (p - q).abs()
        );
    }
}

type F = Arc<dyn Fn(&[Tensor]) -> Result<Tensor> + Send + Sync>;

/// Runs `f` eagerly (fast path), traced on the eager interpreter and traced on XLA; checks the
/// three agree. Returns the eager result.
fn check(what: &str, f: F, inputs: &[Tensor]) -> Tensor {
    check_tol(what, f, inputs, 1e-5, 1e-4)
}

fn check_tol(what: &str, f: F, inputs: &[Tensor], atol: f64, rtol: f64) -> Tensor {
    let eager = f(inputs).unwrap_or_else(|e| panic!("{what}: eager: {e}"));
    let g = f.clone();
    let mut interp = compile(EagerBackend::new(), move |xs: &[Tensor]| Ok(vec![g(xs)?]));
    let traced = interp
        .run(inputs)
        .unwrap_or_else(|e| panic!("{what}: traced eager: {e}"))
        .remove(0);
    close(
        &format!("{what} (traced, interpreter)"),
        &traced,
        &eager,
        atol,
        rtol,
    );
    let g = f.clone();
    let mut x = compile(xla(), move |xs: &[Tensor]| Ok(vec![g(xs)?]));
    let compiled = x
        .run(inputs)
        .unwrap_or_else(|e| panic!("{what}: xla: {e}"))
        .remove(0);
    close(&format!("{what} (xla)"), &compiled, &eager, atol, rtol);
    eager
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, seed).unwrap()
}

#[test]
fn conv2d_variants() {
    let x = randn(&[2, 4, 9, 11], 1);
    // (name, weight shape, stride, padding, dilation, groups, bias)
    type Case = (
        &'static str,
        [usize; 4],
        [usize; 2],
        [usize; 2],
        [usize; 2],
        usize,
        bool,
    );
    #[rustfmt::skip]
    let cases: [Case; 6] = [
        ("plain", [6, 4, 3, 3], [1, 1], [0, 0], [1, 1], 1, true),
        ("stride2 pad1", [6, 4, 3, 3], [2, 2], [1, 1], [1, 1], 1, true),
        ("asymmetric stride", [5, 4, 3, 1], [2, 1], [1, 0], [1, 1], 1, false),
        ("dilation2", [6, 4, 3, 3], [1, 1], [2, 2], [2, 2], 1, true),
        ("groups2", [6, 2, 3, 3], [1, 2], [1, 1], [1, 1], 2, true),
        ("depthwise", [4, 1, 5, 5], [2, 2], [2, 2], [1, 1], 4, false),
    ];
    for (i, (name, w, s, p, d, g, bias)) in cases.into_iter().enumerate() {
        let wt = randn(&w, 10 + i as u64);
        let b = randn(&[w[0]], 20 + i as u64);
        let f: F = Arc::new(move |xs| xs[0].conv2d(&xs[1], bias.then_some(&xs[2]), s, p, d, g));
        check(&format!("conv2d {name}"), f, &[x.clone(), wt, b]);
    }
}

#[test]
fn conv2d_shape_error_is_an_error() {
    let x = randn(&[1, 3, 8, 8], 0);
    let w = randn(&[4, 2, 3, 3], 1);
    let e = x
        .conv2d(&w, None, [1, 1], [0, 0], [1, 1], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("conv"), "{e}");
}

#[test]
fn max_pool2d_including_ceil_mode() {
    // (input hw, kernel, stride, padding, ceil_mode)
    let cases = [
        (16, 3, 2, 1, false), // resnet stem
        (31, 3, 2, 0, true),  // squeezenet
        (32, 3, 2, 0, true),
        (5, 2, 2, 1, true), // last window would start in the right padding: dropped
        (6, 3, 3, 1, true),
        (7, 2, 2, 0, false), // vgg on odd sizes
        (4, 2, 2, 1, true),
    ];
    for (i, (n, k, s, p, ceil)) in cases.into_iter().enumerate() {
        let x = randn(&[2, 3, n, n + 1], 30 + i as u64);
        let f: F = Arc::new(move |xs| xs[0].max_pool2d([k, k], [s, s], [p, p], ceil));
        check(
            &format!("max_pool2d {n} k{k} s{s} p{p} ceil {ceil}"),
            f,
            &[x],
        );
    }
}

#[test]
fn avg_pool2d_padding_and_ceil_mode() {
    for (i, (n, k, s, p, ceil)) in [
        (8, 2, 2, 0, false),
        (9, 3, 2, 1, false),
        (9, 3, 2, 1, true),
        (5, 2, 2, 1, true),
        (10, 3, 3, 1, true),
    ]
    .into_iter()
    .enumerate()
    {
        for include in [true, false] {
            let x = randn(&[2, 3, n, n + 2], 40 + i as u64);
            let f: F = Arc::new(move |xs| xs[0].avg_pool2d([k, k], [s, s], [p, p], ceil, include));
            check(
                &format!("avg_pool2d {n} k{k} s{s} p{p} ceil {ceil} include_pad {include}"),
                f,
                &[x],
            );
        }
    }
}

#[test]
fn adaptive_avg_pool2d_any_size() {
    for (i, (h, w, oh, ow)) in [
        (7, 7, 1, 1),
        (2, 2, 7, 7), // vgg16 at 64x64
        (1, 1, 6, 6), // alexnet at 64x64
        (7, 7, 3, 3), // non-divisible
        (8, 8, 2, 4), // divisible
        (8, 7, 5, 3),
        (5, 5, 5, 5),
    ]
    .into_iter()
    .enumerate()
    {
        let x = randn(&[2, 3, h, w], 50 + i as u64);
        let f: F = Arc::new(move |xs| xs[0].adaptive_avg_pool2d([oh, ow]));
        check(
            &format!("adaptive_avg_pool2d {h}x{w} -> {oh}x{ow}"),
            f,
            &[x],
        );
    }
}

#[test]
fn batch_norm_and_layer_norm_eval() {
    let x = randn(&[3, 4, 5, 6], 60);
    let rm = randn(&[4], 61);
    let rv = randn(&[4], 62).abs().unwrap().add_scalar(0.5).unwrap();
    let w = randn(&[4], 63);
    let b = randn(&[4], 64);
    let f: F = Arc::new(|xs| {
        xs[0].batch_norm(
            Some(&xs[1]),
            Some(&xs[2]),
            Some(&xs[3]),
            Some(&xs[4]),
            false,
            0.1,
            1e-5,
        )
    });
    check("batch_norm eval", f, &[x.clone(), rm, rv, w, b]);
    // Training-mode normalisation without running statistics (pure function of the batch).
    let f: F = Arc::new(|xs| xs[0].batch_norm(None, None, Some(&xs[1]), None, true, 0.1, 1e-5));
    check("batch_norm train", f, &[x, randn(&[4], 65)]);

    let x = randn(&[2, 5, 16], 66);
    let f: F = Arc::new(|xs| xs[0].layer_norm(&[16], Some(&xs[1]), Some(&xs[2]), 1e-5));
    check(
        "layer_norm",
        f,
        &[x.clone(), randn(&[16], 67), randn(&[16], 68)],
    );
    let f: F = Arc::new(|xs| xs[0].layer_norm(&[5, 16], None, None, 1e-6));
    check("layer_norm 2 dims no affine", f, &[x]);
}

#[test]
fn batch_norm_module_training_updates_running_stats() {
    let x = randn(&[4, 3, 5, 5], 70)
        .mul_scalar(2.0)
        .unwrap()
        .add_scalar(1.0)
        .unwrap();
    let eager_store = ParamStore::with_seed(1);
    let bn_e = BatchNorm2d::new(&eager_store.root().sub("bn"), 3).unwrap();
    let xla_store = ParamStore::with_seed(1);
    let bn_x = BatchNorm2d::new(&xla_store.root().sub("bn"), 3).unwrap();

    let mut ye = None;
    for _ in 0..2 {
        ye = Some(tch::no_grad(|| bn_e.forward_t(&x, true)).unwrap());
    }
    let m = bn_x;
    let mut f = compile(xla(), move |xs: &[Tensor]| {
        Ok(vec![m.forward_t(&xs[0], true)?])
    });
    let mut yx = None;
    for _ in 0..2 {
        yx = Some(f.run(std::slice::from_ref(&x)).unwrap().remove(0));
    }
    assert_eq!(f.stats().compiles, 1);
    close("bn train output", &yx.unwrap(), &ye.unwrap(), 1e-5, 1e-4);
    f.sync_to_store().unwrap();
    for name in ["bn.running_mean", "bn.running_var"] {
        let a = xla_store.get(name).unwrap();
        let b = eager_store.get(name).unwrap();
        close(name, &a, &b, 1e-6, 1e-5);
    }
    for s in [&eager_store, &xla_store] {
        let n = s.get("bn.num_batches_tracked").unwrap();
        assert_eq!(n.dtype(), DType::I64);
        assert_eq!(n.to_scalar().unwrap(), 2.0);
    }
}

#[test]
fn activations() {
    let x = randn(&[3, 7, 5], 80).mul_scalar(4.0).unwrap();
    let acts: Vec<(&str, F)> = vec![
        ("gelu", Arc::new(|xs: &[Tensor]| xs[0].gelu(false))),
        ("gelu tanh", Arc::new(|xs: &[Tensor]| xs[0].gelu(true))),
        ("silu", Arc::new(|xs: &[Tensor]| xs[0].silu())),
        ("hardswish", Arc::new(|xs: &[Tensor]| xs[0].hardswish())),
        ("hardsigmoid", Arc::new(|xs: &[Tensor]| xs[0].hardsigmoid())),
        ("relu6", Arc::new(|xs: &[Tensor]| xs[0].relu6())),
        (
            "leaky_relu",
            Arc::new(|xs: &[Tensor]| xs[0].leaky_relu(0.01)),
        ),
        (
            "leaky_relu 0.2",
            Arc::new(|xs: &[Tensor]| xs[0].leaky_relu(0.2)),
        ),
        ("relu", Arc::new(|xs: &[Tensor]| xs[0].relu())),
        ("sigmoid", Arc::new(|xs: &[Tensor]| xs[0].sigmoid())),
        ("tanh", Arc::new(|xs: &[Tensor]| xs[0].tanh())),
    ];
    for (name, f) in acts {
        check(name, f, std::slice::from_ref(&x));
    }
}

#[test]
fn embedding_and_losses() {
    let w = randn(&[11, 4], 90);
    let ids = Tensor::randint(&[3, 5], 11, 91).unwrap();
    let f: F = Arc::new(|xs| Tensor::embedding(&xs[0], &xs[1]));
    let e = check("embedding", f, &[w, ids]);
    assert_eq!(e.dims(), &[3, 5, 4]);

    let logits = randn(&[6, 10], 92).mul_scalar(5.0).unwrap();
    let targets = Tensor::randint(&[6], 10, 93).unwrap();
    let f: F = Arc::new(|xs| xs[0].cross_entropy(&xs[1]));
    check("cross_entropy", f, &[logits, targets]);
    // Large logits: the stable form must not overflow.
    let big = randn(&[4, 3], 94).mul_scalar(1000.0).unwrap();
    let t = Tensor::randint(&[4], 3, 95).unwrap();
    let f: F = Arc::new(|xs| xs[0].cross_entropy(&xs[1]));
    let l = check("cross_entropy large logits", f, &[big, t]);
    assert!(l.to_scalar().unwrap().is_finite());

    let f: F = Arc::new(|xs| xs[0].mse_loss(&xs[1]));
    check("mse_loss", f, &[randn(&[3, 4], 96), randn(&[3, 4], 97)]);
}

#[test]
fn attention_and_encoder_layer() {
    let q = randn(&[2, 3, 5, 8], 100);
    let k = randn(&[2, 3, 7, 8], 101);
    let v = randn(&[2, 3, 7, 4], 102);
    let f: F = Arc::new(|xs| {
        Tensor::scaled_dot_product_attention(&xs[0], &xs[1], &xs[2], None, 0.0, false)
    });
    check("sdpa", f, &[q, k, v]);

    let store = ParamStore::with_seed(3);
    let mha = Arc::new(Mutex::new(
        MultiheadAttention::new(&store.root().sub("attn"), 16, 4, 0.0, true).unwrap(),
    ));
    let x = randn(&[2, 6, 16], 103);
    let m = mha.clone();
    check(
        "mha self",
        Arc::new(move |xs| m.lock().unwrap().forward(&xs[0])),
        std::slice::from_ref(&x),
    );
    let m = mha.clone();
    let attend: F = Arc::new(move |xs| {
        m.lock()
            .unwrap()
            .attend(&xs[0], &xs[0], &xs[0], None, false)
    });
    let a = check("mha attend", attend, std::slice::from_ref(&x));
    close(
        "attend == self_attention",
        &a,
        &mha.lock().unwrap().forward(&x).unwrap(),
        1e-5,
        1e-4,
    );
    assert_eq!(store.get("attn.in_proj_weight").unwrap().dims(), &[48, 16]);
    assert_eq!(store.get("attn.out_proj.bias").unwrap().dims(), &[16]);

    for norm_first in [false, true] {
        let store = ParamStore::with_seed(4);
        let cfg = EncoderLayerConfig {
            dim_feedforward: 32,
            norm_first,
            ..Default::default()
        };
        let layer = Arc::new(Mutex::new(
            TransformerEncoderLayer::new(&store.root().sub("l"), 16, 4, cfg).unwrap(),
        ));
        // PyTorch's parameter count for TransformerEncoderLayer(16, 4, 32).
        assert_eq!(
            store.num_parameters(),
            3 * 16 * 16 + 48 + 16 * 16 + 16 + 2 * 16 * 32 + 32 + 16 + 4 * 16
        );
        let l = layer.clone();
        check(
            &format!("encoder layer norm_first {norm_first}"),
            Arc::new(move |xs| l.lock().unwrap().forward(&xs[0])),
            std::slice::from_ref(&x),
        );
    }
}

#[test]
fn conv_and_layer_norm_modules_use_pytorch_names_and_init() {
    let store = ParamStore::with_seed(0);
    let root = store.root();
    let conv = Conv2d::new(&root.sub("c"), 4, 8, 3, Conv2dConfig::default().groups(2)).unwrap();
    LayerNorm::new(&root.sub("ln"), &[8], 1e-5).unwrap();
    let names: Vec<String> = store.vars().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["c.weight", "c.bias", "ln.weight", "ln.bias"]);
    assert_eq!(conv.weight.dims(), &[8, 2, 3, 3]);
    // kaiming_uniform(a=sqrt(5)): |w| <= 1/sqrt(fan_in), fan_in = 2*3*3.
    let bound = 1.0 / 18f64.sqrt();
    let w = conv.weight.to_f64_vec().unwrap();
    assert!(w.iter().all(|v| v.abs() <= bound));
    assert!(w.iter().any(|v| v.abs() > 0.8 * bound));
}

#[test]
fn safetensors_errors_name_file_and_key() {
    let dir = std::env::temp_dir().join(format!("kiln-nn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let a = ParamStore::with_seed(0);
    Conv2d::new(&a.root().sub("c"), 3, 4, 3, Conv2dConfig::default()).unwrap();
    let file = dir.join("a.safetensors");
    a.save_safetensors(&file).unwrap();

    // Same structure, other values: loads and then equals.
    let b = ParamStore::with_seed(9);
    Conv2d::new(&b.root().sub("c"), 3, 4, 3, Conv2dConfig::default()).unwrap();
    b.load_safetensors(&file).unwrap();
    for (n, t) in a.vars() {
        assert_eq!(
            t.to_f64_vec().unwrap(),
            b.get(&n).unwrap().to_f64_vec().unwrap()
        );
    }
    // Wrong shape.
    let c = ParamStore::new();
    Conv2d::new(&c.root().sub("c"), 3, 5, 3, Conv2dConfig::default()).unwrap();
    let e = c.load_safetensors(&file).unwrap_err().to_string();
    assert!(e.contains("a.safetensors") && e.contains("c.weight"), "{e}");
    // Missing key.
    let d = ParamStore::new();
    Conv2d::new(&d.root().sub("other"), 3, 4, 3, Conv2dConfig::default()).unwrap();
    let e = d.load_safetensors(&file).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains("other.weight"), "{e}");
    // Not a file / not safetensors.
    let e = d
        .load_safetensors(dir.join("nope.safetensors"))
        .unwrap_err();
    assert!(matches!(e, kiln::Error::Io { .. }), "{e}");
    std::fs::write(dir.join("bad.safetensors"), b"garbage").unwrap();
    let e = d.load_safetensors(dir.join("bad.safetensors")).unwrap_err();
    assert!(matches!(e, kiln::Error::Format { .. }), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
