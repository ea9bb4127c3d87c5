//! Tests of the libtorch FFI kernels against XLA's own lowering and a float64 libtorch
//! reference.

use super::*;
use crate::backend::xla::pjrt::handoff::TeamUse;
use crate::backend::xla::{team_use, XlaBackend, XlaOptions};
use std::sync::OnceLock;
use tch::Tensor;

fn backend() -> &'static XlaBackend {
    static B: OnceLock<XlaBackend> = OnceLock::new();
    B.get_or_init(|| XlaBackend::new().expect("XLA backend"))
}

#[test]
fn self_test_passes_on_the_cpu_plugin() {
    let b = backend();
    assert_eq!(b.ffi_status(), Ok(()));
    assert_eq!(
        b.with_options(XlaOptions::default().ffi(FfiMode::All))
            .effective_ffi(),
        FfiMode::All
    );
}

fn seeded(dims: &[i64], seed: i64) -> Tensor {
    let n: i64 = dims.iter().product();
    Tensor::arange(n, (tch::Kind::Double, tch::Device::Cpu))
        .f_mul_scalar(0.618_033_988_75 * (seed as f64 + 1.0))
        .unwrap()
        .sin()
        .reshape(dims)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    a.f_sub(b).unwrap().abs().max().double_value(&[])
}

/// The forward-weight form equals the plain form on the materialized kernel, on the
/// transposed-convolution route and on the fallback that materializes it.
#[test]
fn forward_weight_form_equals_plain_form() {
    let mut cases = Vec::new();
    for (ld, st, pad, g) in [
        (2, 1, (1, 2), 1), // stride-2 input gradient, output padding 1
        (2, 1, (1, 1), 2), // grouped, output padding 0
        (1, 1, (1, 1), 4), // stride-1 input gradient (no dilation), depthwise-like
        (2, 2, (1, 1), 1), // window stride 2: fallback
        (2, 1, (3, 0), 1), // padding beyond the kernel: fallback
        (3, 1, (2, 0), 2), // high < low: narrowed
    ] {
        let mut c = ConvAttrs::plain(2);
        c.lhs_dilation = vec![ld, ld];
        c.strides = vec![st, 1];
        c.padding = vec![pad, pad];
        c.feature_groups = g;
        cases.push(c);
    }
    for (i, c) in cases.iter().enumerate() {
        let g = c.feature_groups as i64;
        // x has C = 4 channels; the forward weight is [C, O/g, 3, 3] with O = 8 (dims of a
        // forward conv from O channels to C).
        let x = seeded(&[2, 4, 5, 4], i as i64);
        let w = seeded(&[4, 8 / g, 3, 3], 10 + i as i64);
        let k = transposed_weight(&w, g).unwrap();
        assert_eq!(k.size(), vec![8, 4 / g, 3, 3]);
        assert_eq!(
            effective_kernel_dims(&w.size(), ConvForm::ForwardWeight, g).unwrap(),
            k.size()
        );
        let plain = conv(c, &x, &k).unwrap();
        let fw = conv_form(c, &x, &w, ConvForm::ForwardWeight).unwrap();
        let d = max_diff(&plain, &fw);
        assert!(d < 1e-12, "case {i} {c:?}: differ by {d}");
        // The plain form against libtorch's own convolution of the explicitly padded input.
        if c.lhs_dilation == [1, 1] && c.strides == [1, 1] {
            let p = c.padding[0].0;
            let want = x
                .f_conv2d(&k, None::<Tensor>, [1i64, 1], [p, p], [1i64, 1], g)
                .unwrap();
            assert!(max_diff(&plain, &want) < 1e-12);
        }
    }
}

#[test]
fn forward_weight_is_found_only_in_the_autograd_pattern() {
    use crate::ir::{Graph, InputKind};
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    let xt = TensorType::new(DType::F32, [2, 3, 6, 6]);
    let wt = TensorType::new(DType::F32, [5, 3, 3, 3]);
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", xt);
    // Passed per call, as in a training step (a frozen weight's forward convolution is a
    // packed one).
    let w = g.add_input(InputKind::Data, "w", wt.clone());
    let y = g.add(Op::Conv(c.clone()), &[x, w]).unwrap();
    let ct = g.add_input(InputKind::Cotangent, "ct", g.node(y).ty.clone());
    let grads = crate::autograd::vjp(&mut g, y, ct, &[true, false]).unwrap();
    let dx = grads[0].unwrap();
    let (dc, kernel) = match &g.node(dx).op {
        Op::Conv(dc) => (dc.clone(), g.node(dx).operands[1]),
        op => panic!("input gradient is {op:?}"),
    };
    assert_eq!(forward_weight_of(&g, kernel, &dc), Some(w));
    // The weight gradient: transpose(conv(regrouped x, transposed ct)).
    let grads = crate::autograd::vjp(&mut g, y, ct, &[false, true]).unwrap();
    let dw = grads[1].unwrap();
    let wconv = g.node(dw).operands[0];
    assert!(matches!(g.node(wconv).op, Op::Conv(_)));
    assert_eq!(weight_gradient_operands_of(&g, wconv), Some((x, ct)));
    assert_eq!(weight_gradient_operands_of(&g, y), None);
    assert_eq!(weight_gradient_operands_of(&g, dx), None);
    // Lowering: the transpose becomes the call, the convolution is absorbed unless something
    // else reads it; nothing is a call when FFI is off.
    let call_form = |l: Option<FfiLowering>| match l {
        Some(FfiLowering::Call { operands, attrs }) => {
            let f = attrs
                .split("form = ")
                .nth(1)
                .unwrap()
                .chars()
                .next()
                .unwrap();
            Some((operands, f))
        }
        _ => None,
    };
    assert_eq!(
        call_form(ffi_lowering(&g, dw, &FfiMode::All)),
        Some((vec![x, ct], '3'))
    );
    assert_eq!(
        ffi_lowering(&g, wconv, &FfiMode::All),
        Some(FfiLowering::Absorbed)
    );
    assert_eq!(
        call_form(ffi_lowering(&g, dx, &FfiMode::All)),
        Some((vec![ct, w], '1'))
    );
    assert_eq!(
        call_form(ffi_lowering(&g, y, &FfiMode::All)),
        Some((vec![x, w], '0'))
    );
    g.set_outputs(vec![dw, wconv]).unwrap();
    assert_eq!(
        call_form(ffi_lowering(&g, wconv, &FfiMode::All)),
        Some((vec![x, ct], '2'))
    );
    for id in [y, dx, dw, wconv] {
        assert_eq!(ffi_lowering(&g, id, &FfiMode::Off), None);
    }
    // A reversed input is not a forward weight; nor is the forward convolution's kernel.
    let r = g.add(Op::Reverse(vec![2, 3]), &[w]).unwrap();
    assert_eq!(forward_weight_of(&g, r, &dc), None);
    assert_eq!(forward_weight_of(&g, w, &c), None);
}

/// The rule's choices on a forward graph and on its gradients: small products stay in XLA,
/// `Off` hands over none and `All` every one; which graphs compute gradients, and how their
/// kernels use the serving thread's OpenMP team.
#[test]
fn rule_on_forward_and_gradient_graphs() {
    use crate::ir::{DotDims, Graph, InputKind};
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    let mut g = Graph::new();
    let x = g.add_input(
        InputKind::Data,
        "x",
        TensorType::new(DType::F32, [2, 3, 6, 6]),
    );
    let w = g.add_input(
        InputKind::Data,
        "w",
        TensorType::new(DType::F32, [5, 3, 3, 3]),
    );
    let a = g.add_input(InputKind::Data, "a", TensorType::new(DType::F32, [8, 32]));
    let l = g.add_input(InputKind::Data, "l", TensorType::new(DType::F32, [16, 32]));
    let y = g.add(Op::Conv(c), &[x, w]).unwrap();
    let linear = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let z = g.add(Op::DotGeneral(linear), &[a, l]).unwrap();
    g.set_outputs(vec![y, z]).unwrap();
    // Forward only (these small products stay in XLA).
    assert!(!computes_gradients(&g));
    // An inference program's kernels keep the serving thread's OpenMP team spinning; a
    // program without products (an optimizer's update) has no kernels to say anything of.
    assert_eq!(team_use(&g), TeamUse::Spinning);
    let mut update = Graph::new();
    let p = update.add_input(InputKind::Parameter, "p", TensorType::new(DType::F32, [4]));
    let d = update.add_input(InputKind::Data, "d", TensorType::new(DType::F32, [4]));
    let next = update
        .add(Op::Binary(crate::ir::BinaryOp::Sub), &[p, d])
        .unwrap();
    update.set_outputs(vec![next]).unwrap();
    assert_eq!(team_use(&update), TeamUse::None);
    assert!(!rule_selection(&g, FfiMode::Auto).contains(&y));
    // With the gradients of both products.
    let cy = g.add_input(InputKind::Cotangent, "cy", g.node(y).ty.clone());
    let cz = g.add_input(InputKind::Cotangent, "cz", g.node(z).ty.clone());
    let gy = crate::autograd::vjp(&mut g, y, cy, &[true, true]).unwrap();
    let gz = crate::autograd::vjp(&mut g, z, cz, &[false, true]).unwrap();
    let mut outs = vec![y, z];
    outs.extend(gy.into_iter().chain(gz).flatten());
    g.set_outputs(outs).unwrap();
    assert!(computes_gradients(&g));
    assert_eq!(team_use(&g), TeamUse::Pausing);
    let all: HashSet<NodeId> = products(&g).collect();
    assert!(all.len() >= 5, "{} products", all.len());
    let auto = rule_selection(&g, FfiMode::Auto);
    assert!(auto.len() < all.len() && auto.is_subset(&all));
    assert!(rule_selection(&g, FfiMode::Off).is_empty());
    assert_eq!(rule_selection(&g, FfiMode::All), all);
}

#[test]
fn malformed_attributes_and_shapes_are_errors() {
    assert!(dot_dims_of(&[1]).is_err());
    assert!(dot_dims_of(&[1, 1, 0, 0, 1]).is_err());
    assert!(dot_dims_of(&[0, 1, -1, 0]).is_err());
    let d = dot_dims_of(&[1, 1, 0, 2, 2, 1]).unwrap();
    assert_eq!(
        (d.lhs_batch, d.rhs_batch, d.lhs_contract, d.rhs_contract),
        (vec![0], vec![2], vec![2], vec![1])
    );
    let lin = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    assert_eq!(
        DotPlan::new(&lin, &[4, 8], &[3, 8]).unwrap().out_dims,
        vec![4, 3]
    );
    let e = DotPlan::new(&lin, &[4, 8], &[3, 7])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("[4, 8]") && e.contains("[3, 7]"), "{e}");
    assert!(DotPlan::new(&lin, &[4, 8], &[8]).is_err());
    let c = ConvAttrs::plain(2);
    let e = conv_out_dims(&c, &[1, 4, 5, 5], &[2, 3, 3, 3])
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("channels"), "{e}");
    assert!(conv_out_dims(&c, &[1, 4, 5], &[2, 4, 3, 3]).is_err());
    assert_eq!(
        conv_out_dims(&c, &[1, 4, 5, 5], &[2, 4, 3, 3]).unwrap(),
        vec![1, 2, 3, 3]
    );
}

/// The weight-gradient form (input and cotangent as they are) equals the plain convolution of
/// the regrouped input by the transposed cotangent, on libtorch's weight-gradient route and
/// on the fallback; the route is taken exactly when `weight_gradient_direct` says so.
#[test]
fn weight_gradient_form_equals_plain_form() {
    // (input [N, C, H, W], kernel k, forward stride, forward padding (lo, hi), groups)
    let cases = [
        ([2i64, 4, 8, 8], 3i64, 1usize, (1i64, 1i64), 1usize, true),
        ([2, 4, 8, 7], 3, 2, (1, 1), 1, true),
        ([2, 4, 7, 7], 1, 2, (0, 0), 1, true),
        ([1, 3, 13, 13], 7, 2, (3, 3), 1, true),
        ([2, 4, 8, 8], 3, 1, (1, 1), 2, true),  // grouped
        ([2, 4, 2, 2], 3, 1, (1, 1), 4, true),  // depthwise on few positions
        ([2, 4, 8, 8], 3, 1, (0, 2), 1, false), // asymmetric forward padding: fallback
    ];
    for (i, (xs, k, s, (lo, hi), g, direct)) in cases.into_iter().enumerate() {
        let sp: Vec<i64> = (0..2)
            .map(|d| (xs[d + 2] + lo + hi - k) / s as i64 + 1)
            .collect();
        let o = 12i64;
        let x = seeded(&xs, i as i64);
        let ct = seeded(&[xs[0], o, sp[0], sp[1]], 20 + i as i64);
        // The weight-gradient convolution kiln's autograd builds (conv_vjp).
        let mut c = ConvAttrs::plain(2);
        c.strides = vec![1, 1];
        c.rhs_dilation = vec![s, s];
        c.feature_groups = g;
        c.padding = (0..2)
            .map(|d| {
                let (xd, kd, od) = (xs[d + 2], k, (sp[d] - 1) * s as i64 + 1);
                (lo, od - xd + kd - lo - 1)
            })
            .collect();
        let gi = g as i64;
        let lhs = x
            .reshape([xs[0], gi, xs[1] / gi, xs[2], xs[3]])
            .permute([2, 1, 0, 3, 4])
            .reshape([xs[1] / gi, gi * xs[0], xs[2], xs[3]]);
        let rhs = ct.permute([1, 0, 2, 3]).contiguous();
        let lt = TensorType::new(
            DType::F64,
            lhs.size().iter().map(|&d| d as usize).collect::<Vec<_>>(),
        );
        let rt = TensorType::new(
            DType::F64,
            rhs.size().iter().map(|&d| d as usize).collect::<Vec<_>>(),
        );
        assert_eq!(
            weight_gradient_direct(&c, &lt, &rt),
            direct,
            "case {i} {c:?}"
        );
        let plain = conv(&c, &lhs, &rhs).unwrap();
        assert_eq!(plain.size(), vec![xs[1] / gi, o, k, k]);
        let wg = conv_form(&c, &x, &ct, ConvForm::WeightGradient).unwrap();
        let d = max_diff(&plain, &wg);
        assert!(d < 1e-10, "case {i} {c:?}: differ by {d}");
        let wt = conv_form(&c, &x, &ct, ConvForm::WeightGradientTransposed).unwrap();
        let d = max_diff(&plain.transpose(0, 1), &wt);
        assert!(d < 1e-10, "case {i} {c:?}: transposed form differs by {d}");
    }
}

/// In a graph, an ungrouped forward convolution goes to libtorch from 30 MFLOP with a
/// spatial window, from 200 MFLOP as 1×1, from 1 MFLOP over non-overlapping windows,
/// whether its weight is passed per call or frozen (a packed convolution); see
/// `auto_rule_packs_runs_of_convolutions` for packed ones next to others.
#[test]
fn auto_rule_for_forward_convolutions_in_a_graph() {
    use crate::ir::{Graph, InputKind};
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let mut pad = ConvAttrs::plain(2);
    pad.padding = vec![(1, 1), (1, 1)];
    let mut patch = ConvAttrs::plain(2);
    patch.strides = vec![8, 8];
    let mut overlap = ConvAttrs::plain(2);
    overlap.strides = vec![4, 4];
    let cases = [
        // resnet18's 3x3 64->64 on 16x16 (75 MFLOP)
        (pad.clone(), [4, 64, 16, 16], [64, 64, 3, 3], true),
        // 3x3 64->64 on 8x8 (19 MFLOP)
        (pad.clone(), [4, 64, 8, 8], [64, 64, 3, 3], false),
        // squeezenet1_1's 1x1 classifier, 512->1000 on 3x3 (37 MFLOP)
        (
            ConvAttrs::plain(2),
            [4, 512, 3, 3],
            [1000, 512, 1, 1],
            false,
        ),
        // a 1x1 of 268 MFLOP
        (ConvAttrs::plain(2), [4, 512, 8, 8], [1024, 512, 1, 1], true),
        // vit's patch embedding: 8x8 windows at stride 8 (25 MFLOP), from 1 MFLOP (1.6 and
        // 0.003 MFLOP)
        (patch.clone(), [4, 3, 64, 64], [256, 3, 8, 8], true),
        (patch.clone(), [2, 3, 32, 32], [128, 3, 8, 8], true),
        (patch, [1, 3, 8, 8], [8, 3, 8, 8], false),
        // overlapping 8x8 windows at stride 4 (19 MFLOP): XLA
        (overlap, [4, 3, 32, 32], [256, 3, 8, 8], false),
    ];
    for (c, x, k, want) in cases {
        for kind in [InputKind::Data, InputKind::Parameter] {
            let mut g = Graph::new();
            let xi = g.add_input(InputKind::Data, "x", t(&x));
            let ki = g.add_input(kind.clone(), "k", t(&k));
            let y = g.add(Op::Conv(c.clone()), &[xi, ki]).unwrap();
            g.set_outputs(vec![y]).unwrap();
            let flops = conv_flops(&c, &t(&x), &t(&k));
            let packed = kind == InputKind::Parameter && packed_conv_enabled();
            assert_eq!(packed_conv(&g, y).is_some(), packed);
            assert_eq!(
                FfiMode::Auto.picks(&g, y),
                want,
                "x {x:?} k {k:?} ({:.0} MFLOP) {kind:?}",
                flops / 1e6
            );
            assert!(FfiMode::All.picks(&g, y));
            assert!(!FfiMode::Off.picks(&g, y));
        }
    }
}

/// A small ungrouped packed convolution stays packed when a run of packed convolutions,
/// each reading its neighbour's result (through a fused epilogue, or as a residual), joins it
/// to one that earns its call alone (grouped, or large); runs of small ones stay in XLA.
#[test]
fn auto_rule_packs_runs_of_convolutions() {
    use crate::ir::{BinaryOp, Graph, InputKind, Literal, UnaryOp};
    fn relu(g: &mut Graph, y: NodeId) -> NodeId {
        let k = g
            .add(Op::Constant(Literal::scalar(DType::F32, 0.0)), &[])
            .unwrap();
        let shape = g.node(y).ty.shape.clone();
        let zero = g
            .add(
                Op::Broadcast {
                    shape,
                    dims: vec![],
                },
                &[k],
            )
            .unwrap();
        g.add(Op::Binary(BinaryOp::Max), &[y, zero]).unwrap()
    }
    if !packed_conv_enabled() {
        return;
    }
    let t = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
    let mut pad = ConvAttrs::plain(2);
    pad.padding = vec![(1, 1), (1, 1)];
    let mut dw = pad.clone();
    dw.feature_groups = 32;
    // conv(h, frozen weight of shape k), then ReLU.
    let conv = |g: &mut Graph, h: NodeId, c: &ConvAttrs, k: &[usize], name: &str| {
        let w = g.add_input(InputKind::Parameter, name, t(k));
        let y = g.add(Op::Conv(c.clone()), &[h, w]).unwrap();
        (y, relu(g, y))
    };
    let small = ConvAttrs::plain(2);

    // 1x1 (1 MFLOP) -> depthwise 3x3 -> 1x1 (1 MFLOP) -> tanh -> 1x1: the first two 1x1s
    // neighbour the depthwise one, the last is cut off by the tanh.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t(&[4, 16, 16, 16]));
    let (c1, r1) = conv(&mut g, x, &small, &[32, 16, 1, 1], "w1");
    let (c2, r2) = conv(&mut g, r1, &dw, &[32, 1, 3, 3], "w2");
    let (c3, r3) = conv(&mut g, r2, &small, &[16, 32, 1, 1], "w3");
    let th = g.add(Op::Unary(UnaryOp::Tanh), &[r3]).unwrap();
    let (c4, r4) = conv(&mut g, th, &small, &[16, 16, 1, 1], "w4");
    g.set_outputs(vec![r4]).unwrap();
    let picked: Vec<bool> = [c1, c2, c3, c4]
        .iter()
        .map(|&c| FfiMode::Auto.picks(&g, c))
        .collect();
    assert_eq!(picked, [true, true, true, false]);
    assert!([c1, c2, c3, c4].iter().all(|&c| FfiMode::All.picks(&g, c)));

    // A residual block: a = relu(conv_a(x)); b = conv_b(a); y = relu(b + conv_d(x)),
    // conv_d a small 1x1 whose result is conv_b's residual. With conv_a a large 3x3, conv_b
    // and conv_d (small) join it; with conv_a small, none is packed.
    for big in [true, false] {
        let mut g = Graph::new();
        let ch = if big { 64 } else { 8 };
        let x = g.add_input(InputKind::Data, "x", t(&[4, ch, 16, 16]));
        let (ca, ra) = conv(&mut g, x, &pad, &[ch, ch, 3, 3], "wa");
        let wb = g.add_input(InputKind::Parameter, "wb", t(&[ch, ch, 1, 1]));
        let cb = g.add(Op::Conv(small.clone()), &[ra, wb]).unwrap();
        let wd = g.add_input(InputKind::Parameter, "wd", t(&[ch, ch, 1, 1]));
        let cd = g.add(Op::Conv(small.clone()), &[x, wd]).unwrap();
        let sum = g.add(Op::Binary(BinaryOp::Add), &[cb, cd]).unwrap();
        let y = relu(&mut g, sum);
        g.set_outputs(vec![y]).unwrap();
        let flops = |c: NodeId| {
            let n = g.node(c);
            let Op::Conv(a) = &n.op else { unreachable!() };
            conv_flops(a, &g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty)
        };
        assert_eq!(flops(ca) >= AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS, big);
        assert!(flops(cb) < AUTO_MIN_FORWARD_CONV_FLOPS);
        let picked: Vec<bool> = [ca, cb, cd]
            .iter()
            .map(|&c| FfiMode::Auto.picks(&g, c))
            .collect();
        assert_eq!(picked, [big; 3], "large first convolution: {big}");
    }
}

#[test]
fn auto_rule_keeps_small_ungrouped_ops_in_xla() {
    let t = |d: &[usize]| TensorType::new(DType::F32, d);
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    // 3x3 64->64 on 16x16, batch 4: 75 MFLOP.
    let (x, k) = (t(&[4, 64, 16, 16]), t(&[64, 64, 3, 3]));
    assert_eq!(
        conv_flops(&c, &x, &k),
        2.0 * 4.0 * 64.0 * 256.0 * 64.0 * 9.0
    );
    assert!(FfiMode::Auto.conv(&c, &x, &k));
    // 1x1 64->256 on 3x3: 2.4 MFLOP stays in XLA, unless every op is asked for.
    let (x, k) = (t(&[4, 64, 3, 3]), t(&[256, 64, 1, 1]));
    let p = ConvAttrs::plain(2);
    assert!(!FfiMode::Auto.conv(&p, &x, &k));
    assert!(FfiMode::All.conv(&p, &x, &k));
    assert!(!FfiMode::Off.conv(&p, &x, &k));
    // A tiny depthwise convolution goes to libtorch all the same.
    let mut dw = c.clone();
    dw.feature_groups = 960;
    assert!(FfiMode::Auto.conv(&dw, &t(&[4, 960, 2, 2]), &t(&[960, 1, 3, 3])));
    // Integer or mixed dtypes never.
    let xi = TensorType::new(DType::I32, [4, 64, 16, 16]);
    assert!(!FfiMode::All.conv(&c, &xi, &t(&[64, 64, 3, 3])));
    // Dots: the Linear layout of vgg16's classifier vs a tiny pooling product.
    let lin = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    assert_eq!(
        dot_flops(&lin, &t(&[4, 25088]), &t(&[4096, 25088])),
        2.0 * 4.0 * 4096.0 * 25088.0
    );
    assert!(FfiMode::Auto.dot(&lin, &t(&[4, 25088]), &t(&[4096, 25088])));
    // The same layout with many rows (a transformer's linear over 256 tokens) stays in XLA,
    // and so does the [in, out] layout.
    assert!(!FfiMode::Auto.dot(&lin, &t(&[256, 256]), &t(&[768, 256])));
    assert!(FfiMode::All.dot(&lin, &t(&[256, 256]), &t(&[768, 256])));
    let nn = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![0],
    };
    assert!(!FfiMode::Auto.dot(&nn, &t(&[4, 4096]), &t(&[4096, 4096])));
    let pool = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![3],
        rhs_contract: vec![0],
    };
    assert!(!FfiMode::Auto.dot(&pool, &t(&[4, 512, 2, 7]), &t(&[7, 2])));
    assert!(FfiMode::All.dot(&pool, &t(&[4, 512, 2, 7]), &t(&[7, 2])));
    // Attention's batched q·kᵀ (bert: 4 sequences x 4 heads of 64 tokens) has the Linear
    // layout and 64 rows per product, but 1,024 rows in all: XLA keeps it.
    let qk = DotDims {
        lhs_batch: vec![0, 1],
        rhs_batch: vec![0, 1],
        lhs_contract: vec![3],
        rhs_contract: vec![3],
    };
    let heads = t(&[4, 4, 64, 64]);
    assert!(dot_flops(&qk, &heads, &heads) >= AUTO_MIN_DOT_FLOPS);
    assert!(!FfiMode::Auto.dot(&qk, &heads, &heads));
    assert!(FfiMode::All.dot(&qk, &heads, &heads));
    // Tiny products go to the kernel's own loop (torchbench's LinearModel), in any layout.
    assert!(FfiMode::Auto.dot(&lin, &t(&[4, 10]), &t(&[10, 10])));
    assert!(FfiMode::Auto.dot(&nn, &t(&[4, 10]), &t(&[10, 10])));
    assert!(!FfiMode::Off.dot(&lin, &t(&[4, 10]), &t(&[10, 10])));
}

/// The dot kernel's own loop for tiny products agrees with its libtorch route (and a float64
/// reference) on every grouping of dims it takes, and declines what it cannot view without a
/// copy or what is too large.
#[test]
fn tiny_dot_loop_matches_libtorch() {
    let dd = |lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]| DotDims {
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
        lhs_contract: lc.to_vec(),
        rhs_contract: rc.to_vec(),
    };
    // (a dims, b dims, dims, takes the loop)
    let cases = [
        (
            vec![4i64, 10],
            vec![10i64, 10],
            dd(&[], &[], &[1], &[1]),
            true,
        ), // Linear
        (vec![2, 10], vec![10, 3], dd(&[], &[], &[1], &[0]), true),
        (vec![10, 2], vec![10, 3], dd(&[], &[], &[0], &[0]), true), // weight gradient
        (
            vec![3, 4, 5],
            vec![3, 5, 2],
            dd(&[0], &[0], &[2], &[1]),
            true,
        ),
        (
            vec![4, 3, 5],
            vec![5, 3, 2],
            dd(&[1], &[1], &[2], &[0]),
            true,
        ),
        (
            vec![2, 3, 4],
            vec![3, 4, 5],
            dd(&[], &[], &[1, 2], &[0, 1]),
            true,
        ),
        (
            vec![2, 3, 4],
            vec![4, 3, 5],
            dd(&[], &[], &[1, 2], &[1, 0]),
            false,
        ), // strided mix
        (vec![7], vec![7], dd(&[], &[], &[0], &[0]), true),
        (vec![3], vec![4], dd(&[], &[], &[], &[]), true), // outer product
        (vec![2, 0], vec![0, 3], dd(&[], &[], &[1], &[0]), true), // empty contraction
        (vec![64, 64], vec![64, 64], dd(&[], &[], &[1], &[0]), false), // too large
    ];
    for (i, (ad, bd, d, takes)) in cases.into_iter().enumerate() {
        let plan = DotPlan::new(&d, &ad, &bd).unwrap();
        let tiny = plan.tiny();
        assert_eq!(tiny.is_some(), takes, "case {i}");
        let Some(tiny) = tiny else { continue };
        let (a, b) = (seeded(&ad, 1), seeded(&bd, 2));
        let want = Tensor::zeros(&plan.out_dims, (tch::Kind::Double, tch::Device::Cpu));
        plan.run_into(&a, &b, &want).unwrap();
        let flat = |t: &Tensor| Vec::<f64>::try_from(t.reshape([-1])).unwrap();
        let mut got = vec![0f64; flat(&want).len()];
        tiny.run(&flat(&a), &flat(&b), &mut got).unwrap();
        let got_t = Tensor::from_slice(&got).reshape(&plan.out_dims);
        assert!(max_diff(&got_t, &want) < 1e-12, "case {i} f64");
        let (a32, b32) = (flat(&a), flat(&b));
        let (a32, b32): (Vec<f32>, Vec<f32>) = (
            a32.iter().map(|&v| v as f32).collect(),
            b32.iter().map(|&v| v as f32).collect(),
        );
        let mut got32 = vec![0f32; got.len()];
        tiny.run(&a32, &b32, &mut got32).unwrap();
        // float32 rounding of products of values in [-1, 1] over at most 20 terms.
        for (x, y) in got32.iter().zip(&got) {
            assert!((f64::from(*x) - y).abs() < 1e-5, "case {i} f32: {x} vs {y}");
        }
        // A buffer of the wrong size is an error, not a read out of bounds.
        if !a32.is_empty() && !got32.is_empty() {
            assert!(tiny.run(&a32[1..], &b32, &mut got32).is_err(), "case {i}");
        }
    }
}

/// The libtorch route of the dot kernel, on a `Linear`-layout product with few rows (computed
/// as `(W · xᵀ)ᵀ`) and with many (plain `mm`), against a float64 reference.
#[test]
fn linear_layout_products_match_the_reference() {
    let lin = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    for rows in [1i64, 4, 64, 70] {
        let plan = DotPlan::new(&lin, &[rows, 300], &[200, 300]).unwrap();
        assert!(plan.tiny().is_none());
        let (x, w) = (seeded(&[rows, 300], 3), seeded(&[200, 300], 4));
        let want = x.matmul(&w.tr());
        for kind in [tch::Kind::Double, tch::Kind::Float] {
            let out = Tensor::zeros([rows, 200], (kind, tch::Device::Cpu));
            plan.run_into(&x.to_kind(kind), &w.to_kind(kind), &out)
                .unwrap();
            let tol = if kind == tch::Kind::Double {
                1e-10
            } else {
                1e-3
            };
            assert!(
                max_diff(&out.to_kind(tch::Kind::Double), &want) < tol,
                "{rows} rows {kind:?}"
            );
        }
    }
}

/// A graph with one large product and one small one: `(big, small)` dot nodes.
fn big_and_small_products(g: &mut Graph) -> (NodeId, NodeId) {
    use crate::ir::InputKind;
    let f = |d: &[usize]| TensorType::new(DType::F64, d.to_vec());
    let x = g.add_input(InputKind::Data, "x", f(&[64, 256]));
    let w1 = g.add_input(InputKind::Data, "w1", f(&[256, 256]));
    let a = g.add_input(InputKind::Data, "a", f(&[4, 300]));
    let w = g.add_input(InputKind::Data, "w", f(&[200, 300]));
    let plain = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![0],
        ..Default::default()
    };
    let linear = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![1],
        ..Default::default()
    };
    let big = g.add(Op::DotGeneral(plain), &[x, w1]).unwrap();
    let small = g.add(Op::DotGeneral(linear), &[a, w]).unwrap();
    g.set_outputs(vec![big, small]).unwrap();
    (big, small)
}

/// Kernels run serially where they do a small share of the products: one small kernel
/// among XLA's work, not when they do all of it, not without kernels.
#[test]
fn kernels_run_serially_only_among_much_xla_work() {
    let mut g = Graph::new();
    let (big, small) = big_and_small_products(&mut g);
    let set = |ids: &[NodeId]| {
        ids.iter()
            .copied()
            .collect::<std::collections::HashSet<_>>()
    };
    assert!(serial_kernels(&g, &set(&[small])));
    assert!(!serial_kernels(&g, &set(&[big, small])));
    assert!(!serial_kernels(&g, &set(&[big])));
    assert!(!serial_kernels(&g, &set(&[])));
    assert!(!serial_kernels(&g, &FfiMode::All));

    let text = crate::backend::xla::lower::lower_with(&g, &set(&[small])).unwrap();
    assert_eq!(text.matches("serial = 1 : i64").count(), 1, "{text}");
    let text = crate::backend::xla::lower::lower_with(&g, &set(&[big, small])).unwrap();
    assert!(!text.contains("serial"), "{text}");
    assert_eq!(
        mark_serial("backend_config = {}, x = 1"),
        "backend_config = {serial = 1 : i64}, x = 1"
    );
    assert_eq!(
        mark_serial("backend_config = {form = 0 : i64}"),
        "backend_config = {serial = 1 : i64, form = 0 : i64}"
    );
}

/// A program whose kernel runs serially computes what the reference does, and leaves the
/// calling thread's libtorch thread count as it was.
#[test]
fn a_serial_kernel_matches_the_reference_and_restores_threads() {
    use crate::backend::Backend;
    let b = backend();
    assert_eq!(b.ffi_status(), Ok(()));
    let mut g = Graph::new();
    let (_, small) = big_and_small_products(&mut g);
    let sel: std::collections::HashSet<NodeId> = [small].into_iter().collect();
    let text = crate::backend::xla::lower::lower_with(&g, &sel).unwrap();
    assert!(text.contains("serial = 1 : i64"));
    let exe = b.compile_mlir(&text).unwrap();
    let dims = [[64i64, 256], [256, 256], [4, 300], [200, 300]];
    let ins: Vec<Tensor> = dims
        .iter()
        .enumerate()
        .map(|(i, d)| seeded(d, i as i64))
        .collect();
    let bufs: Vec<_> = ins
        .iter()
        .map(|t| {
            let v = Vec::<f64>::try_from(t.reshape([-1])).unwrap();
            let d: Vec<usize> = t.size().iter().map(|&v| v as usize).collect();
            b.to_device(&crate::backend::HostTensor::from_slice(&d, &v).unwrap())
                .unwrap()
        })
        .collect();
    let raw: Vec<_> = bufs.iter().map(|b| b.raw()).collect();
    let before = tch::get_num_threads();
    for _ in 0..3 {
        let outs = exe.execute(&raw).unwrap();
        let got: Vec<f64> = outs[1]
            .to_host_vec()
            .unwrap()
            .chunks_exact(8)
            .map(|c| f64::from_ne_bytes(c.try_into().unwrap()))
            .collect();
        let want = Vec::<f64>::try_from(ins[2].matmul(&ins[3].tr()).reshape([-1])).unwrap();
        let err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(err < 1e-9, "{err}");
    }
    assert_eq!(tch::get_num_threads(), before);
}
