//! The im2col lowering of `Op::Conv` against the direct one (`stablehlo.convolution`) and the
//! eager interpreter (libtorch), on the attribute combinations forward and backward
//! convolutions use: stride, padding (asymmetric, negative), kernel and input dilation, feature
//! groups (grouped, depthwise), batch groups, 1-3 spatial dims; and on the convolutions
//! kiln's autograd derives (input gradient, weight gradient) for resnet-like layers. Also: the
//! backend applies the choice as a graph rewrite before fingerprinting, in compiled functions
//! and training steps.

mod common;

use common::recorder::Recorder;
use common::{autograd_conv_layers, conv_cases, conv_graph, run, xla, LOWERING};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{ConvLowering, ConvStrategy, XlaOptions};
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{ConvAttrs, DType, Graph, Op, TensorType};
use kiln::nn::{Init, ParamStore};
use kiln::optim::Sgd;
use kiln::passes::im2col_graph;
use kiln::train::TrainStep;
use kiln::{compile, Tensor};

fn random(ty: &TensorType, seed: u64) -> HostTensor {
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let v: Vec<f64> = (0..ty.shape.numel())
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    match ty.dtype {
        DType::F32 => {
            let f: Vec<f32> = v.iter().map(|&a| a as f32).collect();
            HostTensor::from_slice(ty.shape.dims(), &f).unwrap()
        }
        _ => HostTensor::from_slice(ty.shape.dims(), &v).unwrap(),
    }
}

fn assert_close(what: &str, got: &HostTensor, want: &HostTensor, tol: f64) {
    assert_eq!(got.ty(), want.ty(), "{what}: types");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let scale = w.iter().fold(1.0f64, |m, a| m.max(a.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * scale,
            "{what}: element {i}: got {a}, want {b} (scale {scale})"
        );
    }
}

#[test]
fn im2col_matches_direct_and_eager() {
    let direct = xla().with_options(XlaOptions::plain().conv(ConvStrategy::Direct));
    let im2col = xla().with_options(XlaOptions::plain().conv(ConvStrategy::Im2col));
    let eager = EagerBackend::new();
    for (i, c) in conv_cases(LOWERING).iter().enumerate() {
        for d in [DType::F32, DType::F64] {
            let (xt, kt, g) = c.graph(d);
            let ins = [random(&xt, i as u64), random(&kt, 1000 + i as u64)];
            let want = run(&eager, &g, &ins).remove(0);
            let tol = if d == DType::F32 { 1e-5 } else { 1e-12 };
            let what = |w: &str| format!("case {i} {d} {:?} {:?} {:?}: {w}", c.x, c.k, c.attrs);
            let lowered = im2col.lower(&g).unwrap();
            assert!(
                !lowered.contains("stablehlo.convolution") && lowered.contains("dot_general"),
                "{}",
                what("im2col lowering emits a convolution")
            );
            assert_close(&what("xla direct"), &run(&direct, &g, &ins)[0], &want, tol);
            assert_close(&what("xla im2col"), &run(&im2col, &g, &ins)[0], &want, tol);
            // The expansion itself, interpreted by libtorch op by op.
            let ig = im2col_graph(&c.attrs, &xt, &kt).unwrap();
            assert_close(
                &what("eager im2col"),
                &run(&eager, &ig, &ins)[0],
                &want,
                tol,
            );
        }
    }
}

/// Forward, input-gradient and weight-gradient convolutions as kiln's autograd builds them,
/// compiled with each strategy.
#[test]
fn autograd_convs_match_under_every_strategy() {
    let eager = EagerBackend::new();
    let strategies = [
        ConvStrategy::Direct,
        ConvStrategy::Im2col,
        ConvStrategy::Auto,
        ConvStrategy::Custom {
            name: "by-kernel".into(),
            rule: |_, _, k| {
                if k.shape.dim(2) > 1 {
                    ConvLowering::Im2col
                } else {
                    ConvLowering::Direct
                }
            },
        },
    ];
    for (i, layer) in autograd_conv_layers(LOWERING).iter().enumerate() {
        let (xs, ks) = (&layer.x, &layer.k);
        let (g, tys) = layer.grad_graph(DType::F32);
        assert_eq!(num_convs(&g), 3, "forward + two backward convolutions");
        let ins: Vec<_> = (tys.iter().zip([0, 50, 99]))
            .map(|(t, seed)| random(t, seed + i as u64))
            .collect();
        let want = run(&eager, &g, &ins);
        for s in &strategies {
            let b = xla().with_options(XlaOptions::plain().conv(s.clone()));
            let got = run(&b, &g, &ins);
            for (j, name) in ["y", "dx", "dw"].iter().enumerate() {
                assert_close(
                    &format!("layer {i} {xs:?} {ks:?} {s:?} {name}"),
                    &got[j],
                    &want[j],
                    2e-5,
                );
            }
        }
    }
}

#[test]
fn strategies_have_distinct_cache_keys() {
    let keys: Vec<String> = [
        XlaOptions::plain(),
        XlaOptions::default(),
        XlaOptions::default().conv(ConvStrategy::Im2col),
        XlaOptions::default().debug_option(
            "xla_cpu_enable_fast_math",
            kiln::backend::xla::OptionValue::Bool(false),
        ),
    ]
    .into_iter()
    .map(|o| xla().with_options(o).cache_key())
    .collect();
    for i in 0..keys.len() {
        for j in 0..i {
            assert_ne!(keys[i], keys[j]);
        }
    }
}

#[test]
fn unknown_debug_option_is_a_compile_error() {
    let b = xla().with_options(XlaOptions::default().debug_option(
        "xla_cpu_no_such_option",
        kiln::backend::xla::OptionValue::Bool(true),
    ));
    let xt = TensorType::new(DType::F32, [1, 1, 3, 3]);
    let g = conv_graph(&ConvAttrs::plain(2), &xt, &xt);
    let e = b
        .compile(&g)
        .err()
        .expect("unknown option rejected")
        .to_string();
    assert!(e.contains("xla_cpu_no_such_option"), "{e}");
}

fn num_convs(g: &Graph) -> usize {
    g.topo_order()
        .into_iter()
        .filter(|&n| matches!(g.node(n).op, Op::Conv(_)))
        .count()
}

/// `relu(conv3x3(x, w, pad 1))` then a strided 1x1 convolution.
fn two_convs(xs: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let y = xs[0]
        .conv2d(&xs[1], None, [1, 1], [1, 1], [1, 1], 1)?
        .relu()?;
    Ok(vec![y.conv2d(&xs[2], None, [2, 2], [0, 0], [1, 1], 1)?])
}

/// A compiled function's program holds the graph after the backend's rewrite: that graph is
/// fingerprinted and compiled, and its results are those of the direct convolutions.
#[test]
fn compiled_programs_hold_the_rewritten_graph() {
    let inputs = [
        Tensor::randn(&[2, 8, 6, 6], 1).unwrap(),
        Tensor::randn(&[8, 8, 3, 3], 2).unwrap(),
        Tensor::randn(&[4, 8, 1, 1], 3).unwrap(),
    ];
    let sig: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
    let want = tch::no_grad(|| two_convs(&inputs)).unwrap().remove(0);
    let want = want.to_host().unwrap();
    for (strategy, convs) in [(ConvStrategy::Direct, 2), (ConvStrategy::Im2col, 0)] {
        let (rec, graphs) =
            Recorder::new(xla().with_options(XlaOptions::plain().conv(strategy.clone())));
        let mut f = compile(rec, two_convs);
        let got = f.run(&inputs).unwrap().remove(0).to_host().unwrap();
        assert_close(&format!("{strategy:?}"), &got, &want, 1e-5);
        let p = f.program(&sig).expect("traced");
        assert_eq!(num_convs(&p.graph), convs, "{strategy:?}");
        assert_eq!(p.fingerprint, p.graph.fingerprint());
        let compiled = graphs.lock().unwrap();
        assert_eq!(compiled.len(), 1);
        assert_eq!(compiled[0].fingerprint(), p.fingerprint, "{strategy:?}");
    }
    // The eager backend rewrites nothing.
    let mut f = compile(EagerBackend::new(), two_convs);
    f.run(&inputs).unwrap();
    assert_eq!(num_convs(&f.program(&sig).unwrap().graph), 2);
}

/// `XlaBackend::lower` gives the same text for a graph and for its rewritten form.
#[test]
fn lowering_a_rewritten_graph_changes_nothing() {
    let b = xla().with_options(XlaOptions::plain().conv(ConvStrategy::Im2col));
    let c = conv_cases(LOWERING).remove(1);
    let g = conv_graph(
        &c.attrs,
        &TensorType::new(DType::F32, c.x),
        &TensorType::new(DType::F32, c.k),
    );
    let mut r = g.clone();
    b.rewrite(&mut r).unwrap();
    assert_eq!(num_convs(&r), 0);
    let text = b.lower(&r).unwrap();
    assert_eq!(b.lower(&g).unwrap(), text);
    assert_eq!(kiln::backend::xla::lower::lower(&r).unwrap(), text);
}

/// The forward, input-gradient and weight-gradient convolutions of a training step are all
/// rewritten under `Im2col`; the losses are those of the direct lowering.
#[test]
fn train_stages_are_rewritten() {
    let run = |strategy: ConvStrategy| {
        let store = ParamStore::with_seed(3);
        let w = store
            .root()
            .param(
                "w",
                &[6, 4, 3, 3],
                Init::Normal {
                    mean: 0.0,
                    std: 0.3,
                },
            )
            .unwrap();
        let (rec, graphs) = Recorder::new(xla().with_options(XlaOptions::plain().conv(strategy)));
        let mut step = TrainStep::new(rec, &store, Sgd::new(), move |xs: &[Tensor]| {
            let y = xs[0].conv2d(&w, None, [2, 2], [1, 1], [1, 1], 1)?;
            y.mul(&y)?.mean_all()
        })
        .unwrap()
        .with_lr(0.1);
        let losses: Vec<f64> = (0..3)
            .map(|s| {
                step.step(&[Tensor::randn(&[2, 4, 7, 7], 10 + s).unwrap()])
                    .unwrap()
            })
            .collect();
        let convs: usize = graphs.lock().unwrap().iter().map(num_convs).sum();
        (losses, convs)
    };
    let (direct, convs) = run(ConvStrategy::Direct);
    assert!(convs >= 2, "forward and backward convolutions: {convs}");
    let (im2col, convs) = run(ConvStrategy::Im2col);
    assert_eq!(convs, 0);
    for (a, b) in im2col.iter().zip(&direct) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{im2col:?} vs {direct:?}"
        );
    }
}
