//! libtorch kernels inside XLA executables (PJRT FFI custom calls) against XLA's own lowering
//! and a float64 reference.
//!
//! Each f32 case runs three ways: XLA native (`stablehlo.convolution` / `dot_general`), the
//! FFI kernel, and the same graph in float64 on the eager interpreter (libtorch). The FFI
//! result's error against the float64 result must be at most a small multiple of XLA native's
//! error plus a floor: both are float32 computations of the same sums, in different orders.
//! f64 cases must agree with the float64 reference to 1e-12 (relative to the largest value).

mod common;

use common::{autograd_conv_layers, conv_cases, conv_graph, floats, run, xla, SplitMix64, FFI};
use kiln::autograd::vjp;
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::kernels::{
    AFTER_TARGET, COLUMN_SUM_TARGET, CONV_TARGET, DOT_TARGET, PACKED_LINEAR_TARGET,
    SELECT_SCATTER_TARGET, TRANSPOSE_TARGET,
};
use kiln::backend::xla::{pjrt, FfiMode, XlaBackend, XlaOptions};
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{
    BinaryOp, ConvAttrs, DType, DotDims, Graph, InputKind, Op, ReduceKind, TensorType, UnaryOp,
    WindowAttrs,
};

fn native() -> XlaBackend {
    xla().with_options(XlaOptions::plain())
}

fn ffi() -> XlaBackend {
    let b = xla().with_options(XlaOptions::plain().ffi(FfiMode::All));
    assert_eq!(b.ffi_status(), Ok(()), "the CPU plugin runs kiln's kernels");
    b
}

/// Seeded uniform values in [-1, 1).
fn random(ty: &TensorType, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    floats(ty.shape.dims(), ty.dtype, || r.uniform() * 2.0 - 1.0)
}

fn to_f64(h: &HostTensor) -> HostTensor {
    HostTensor::from_slice(h.ty().shape.dims(), &h.to_f64_vec()).unwrap()
}

/// The graph with every input and node in f64 (same ops; f32 constants converted).
fn graph_f64(g: &Graph) -> Graph {
    let mut h = Graph::new();
    let mut map = std::collections::HashMap::new();
    for id in g.topo_order() {
        let n = g.node(id);
        let new = match &n.op {
            Op::Input(i) => {
                let inp = &g.inputs()[*i];
                let ty = TensorType::new(DType::F64, inp.ty.shape.dims());
                h.add_input(inp.kind.clone(), &inp.name, ty)
            }
            // f32 constants (a traced scale) keep their value, widened.
            op @ Op::Constant(_) if n.ty.dtype == DType::F32 => {
                let c = h.add(op.clone(), &[]).unwrap();
                h.add(Op::Convert(DType::F64), &[c]).unwrap()
            }
            op => {
                let ops: Vec<_> = n.operands.iter().map(|o| map[o]).collect();
                h.add(op.clone(), &ops).unwrap()
            }
        };
        map.insert(id, new);
    }
    h.set_outputs(g.outputs().iter().map(|o| map[o]).collect())
        .unwrap();
    h
}

fn max_err(got: &HostTensor, want: &[f64]) -> f64 {
    got.to_f64_vec()
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()))
}

/// Checks `g` (f32 or f64) with FFI kernels against XLA native and the float64 reference;
/// returns `(ffi error, native error)` of the worst output, relative to its scale.
fn check(what: &str, g: &Graph, ins: &[HostTensor], target: &str) -> (f64, f64) {
    check_on(&ffi(), what, g, ins, target)
}

/// [`check`] with the kernels of `backend`'s FFI mode.
fn check_on(
    backend: &XlaBackend,
    what: &str,
    g: &Graph,
    ins: &[HostTensor],
    target: &str,
) -> (f64, f64) {
    let lowered = backend.lower(g).unwrap();
    assert!(
        lowered.contains(target),
        "{what}: the FFI lowering has no {target} custom call:\n{lowered}"
    );
    let ins64: Vec<HostTensor> = ins.iter().map(to_f64).collect();
    let want = run(&EagerBackend::new(), &graph_f64(g), &ins64);
    let got = run(backend, g, ins);
    let nat = run(&native(), g, ins);
    let mut worst = (0.0f64, 0.0f64);
    for (j, w) in want.iter().enumerate() {
        assert_eq!(got[j].ty(), nat[j].ty(), "{what}: output {j} type");
        let w = w.to_f64_vec();
        let scale = w.iter().fold(1.0f64, |m, a| m.max(a.abs()));
        let (ef, en) = (max_err(&got[j], &w) / scale, max_err(&nat[j], &w) / scale);
        let f32_graph = got[j].ty().dtype == DType::F32;
        let bound = if f32_graph { 4.0 * en + 1e-6 } else { 1e-12 };
        assert!(
            ef <= bound,
            "{what}: output {j}: FFI error {ef:.3e} (relative), XLA native {en:.3e}, bound {bound:.3e}"
        );
        worst = (worst.0.max(ef), worst.1.max(en));
    }
    worst
}

/// [`check_on`] for one of kiln's own kernels, which only the lowering with kernels calls:
/// the lowering without them must not name `target`. Prints both errors.
fn check_own_kernel(backend: &XlaBackend, what: &str, g: &Graph, ins: &[HostTensor], target: &str) {
    assert!(
        !native().lower(g).unwrap().contains(target),
        "{what}: the lowering without kernels calls {target}"
    );
    let (ef, en) = check_on(backend, what, g, ins, target);
    println!("{what}: relative error with the kernel {ef:.2e}, XLA {en:.2e}");
}

#[test]
fn conv_kernel_matches_xla_and_f64_reference() {
    for (i, c) in conv_cases(FFI).iter().enumerate() {
        for d in [DType::F32, DType::F64] {
            let (xt, kt, g) = c.graph(d);
            let ins = [random(&xt, i as u64), random(&kt, 1000 + i as u64)];
            let what = format!("case {i} {d} x{:?} k{:?} {:?}", c.x, c.k, c.attrs);
            let (ef, en) = check(&what, &g, &ins, CONV_TARGET);
            println!("{what}: relative error FFI {ef:.2e}, XLA {en:.2e}");
        }
    }
}

/// Forward, input-gradient and weight-gradient convolutions as kiln's autograd builds them
/// (resnet- and mobilenet-like layers), all through the kernel.
#[test]
fn autograd_convs_through_the_kernel() {
    for (i, layer) in autograd_conv_layers(FFI).iter().enumerate() {
        let (g, tys) = layer.grad_graph(DType::F32);
        let ins: Vec<_> = (tys.iter().zip([0, 50, 99]))
            .map(|(t, seed)| random(t, seed + i as u64))
            .collect();
        let lowered = ffi().lower(&g).unwrap();
        assert_eq!(
            lowered.matches(CONV_TARGET).count(),
            3,
            "layer {i}: all three convolutions through the kernel"
        );
        assert_eq!(
            lowered.matches("form = 1").count(),
            1,
            "layer {i}: the input gradient reads the forward weight:\n{lowered}"
        );
        // 2-d weight gradients read the forward input and cotangent directly and write the
        // weight gradient itself (convolution and transpose as one call).
        assert_eq!(
            lowered.matches("form = 3").count(),
            1,
            "layer {i}: weight gradient form:\n{lowered}"
        );
        assert!(!lowered.contains("form = 2"));
        let what = format!("layer {i} x{:?} k{:?} {:?}", layer.x, layer.k, layer.attrs);
        let (ef, en) = check(&what, &g, &ins, CONV_TARGET);
        println!("{what}: relative error FFI {ef:.2e}, XLA {en:.2e}");
    }
}

/// The graph of one product of inputs `a` and `b` (dims `a`, `b`, type `dt`), with their types.
fn one_dot(dt: DType, a: &[usize], b: &[usize], d: &DotDims) -> (TensorType, TensorType, Graph) {
    let at = TensorType::new(dt, a);
    let bt = TensorType::new(dt, b);
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "a", at.clone());
    let y = g.add_input(InputKind::Data, "b", bt.clone());
    let z = g.add(Op::DotGeneral(d.clone()), &[x, y]).unwrap();
    g.set_outputs(vec![z]).unwrap();
    (at, bt, g)
}

fn dot(lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> DotDims {
    DotDims::new(lb, rb, lc, rc)
}

/// A post-LN residual chain (bert's shape of layer: `y = norm(y + y · w)`, the norm a
/// row-centred `tanh`) whose links the lowering writes once (`materialize.rs`): the same values
/// as XLA alone, which recomputes them, and as the float64 reference.
#[test]
fn values_written_once_keep_their_values() {
    let mut g = Graph::new();
    let t = TensorType::new(DType::F32, [4, 16, 32]);
    let x = g.add_input(InputKind::Data, "x", t.clone());
    let w = g.add_input(
        InputKind::Parameter,
        "w",
        TensorType::new(DType::F32, [32, 32]),
    );
    let mut y = g.add(Op::Unary(UnaryOp::Tanh), &[x]).unwrap();
    for _ in 0..4 {
        let p = g
            .add(Op::DotGeneral(dot(&[], &[], &[2], &[0])), &[y, w])
            .unwrap();
        let s = g.add(Op::Binary(BinaryOp::Add), &[y, p]).unwrap();
        let m = g
            .add(
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: vec![2],
                },
                &[s],
            )
            .unwrap();
        let m = g
            .add(
                Op::Broadcast {
                    shape: t.shape.clone(),
                    dims: vec![0, 1],
                },
                &[m],
            )
            .unwrap();
        let c = g.add(Op::Binary(BinaryOp::Sub), &[s, m]).unwrap();
        y = g.add(Op::Unary(UnaryOp::Tanh), &[c]).unwrap();
    }
    g.set_outputs(vec![y]).unwrap();
    let ins = [
        random(&t, 7),
        random(&TensorType::new(DType::F32, [32, 32]), 8),
    ];
    let lowered = xla().lower(&g).unwrap();
    assert_eq!(lowered.matches(AFTER_TARGET).count(), 3, "{lowered}");
    assert!(!native().lower(&g).unwrap().contains(AFTER_TARGET));
    check("post-LN chain", &g, &ins, AFTER_TARGET);
}

#[test]
fn dot_kernel_matches_xla_and_f64_reference() {
    let cases: Vec<(Vec<usize>, Vec<usize>, DotDims)> = vec![
        // torch Linear layout: x[N, in] . W[out, in]^T
        (vec![4, 96], vec![40, 96], dot(&[], &[], &[1], &[1])),
        // the same, above the tiny-product loop's size: oneDNN's linear for float32
        (vec![8, 256], vec![64, 256], dot(&[], &[], &[1], &[1])),
        // plain matmul, matrix-vector, vector-vector, outer product
        (vec![5, 7], vec![7, 3], dot(&[], &[], &[1], &[0])),
        (vec![5, 7], vec![7], dot(&[], &[], &[1], &[0])),
        (vec![7], vec![7], dot(&[], &[], &[0], &[0])),
        (vec![3], vec![4], dot(&[], &[], &[], &[])),
        // attention: [B, H, S, D] x [B, H, S, D] contracting D, batch (B, H)
        (
            vec![2, 3, 5, 8],
            vec![2, 3, 6, 8],
            dot(&[0, 1], &[0, 1], &[3], &[3]),
        ),
        // batch dims not leading, two contracting dims in swapped order
        (
            vec![3, 2, 4, 5],
            vec![5, 4, 2, 6],
            dot(&[1], &[2], &[2, 3], &[1, 0]),
        ),
        // 3-d activations through a Linear weight
        (vec![2, 5, 16], vec![12, 16], dot(&[], &[], &[2], &[1])),
        // weight gradient of a Linear: ct[N, out]^T . x[N, in]
        (vec![6, 10], vec![6, 9], dot(&[], &[], &[0], &[0])),
    ];
    for (i, (a, b, d)) in cases.into_iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            let (at, bt, g) = one_dot(dt, &a, &b, &d);
            let ins = [random(&at, i as u64), random(&bt, 77 + i as u64)];
            let what = format!("dot {i} {dt} {a:?} {b:?} {d:?}");
            let (ef, en) = check(&what, &g, &ins, DOT_TARGET);
            println!("{what}: relative error FFI {ef:.2e}, XLA {en:.2e}");
        }
    }
}

/// Products whose operand XLA would copy slowly into its canonical layout (rows of 4 KiB: a
/// weight gradient `dyᵀ · x` of a 1024-wide layer, `x · Wᵀ` of a 1024-wide weight) take it
/// transposed by kiln's block transpose under the default rule, and match XLA native and the
/// float64 reference; the lowering without kernels keeps XLA's own copy.
#[test]
fn slow_layout_operands_go_through_the_transpose_kernel() {
    let auto = xla().with_options(XlaOptions::plain().ffi(FfiMode::Auto));
    let cases: Vec<(DType, Vec<usize>, Vec<usize>, DotDims)> = vec![
        // dyᵀ · x: the left operand contracts its leading dims; 52 rows (not a multiple of
        // the kernel's 8-row tiles).
        (
            DType::F32,
            vec![4, 13, 1024],
            vec![4, 13, 24],
            dot(&[], &[], &[0, 1], &[0, 1]),
        ),
        // x · Wᵀ with W [16, 1024] (few rows on the left: not a libtorch product).
        (
            DType::F32,
            vec![5, 1024],
            vec![16, 1024],
            dot(&[], &[], &[1], &[1]),
        ),
        // the left operand only, batch dims leading.
        (
            DType::F32,
            vec![2, 16, 1024],
            vec![2, 3, 16],
            dot(&[0], &[0], &[1], &[2]),
        ),
        // both operands (f64 rows of 512 elements are 4 KiB too).
        (
            DType::F64,
            vec![2, 512, 512],
            vec![2, 8, 512],
            dot(&[0], &[0], &[1], &[2]),
        ),
        (
            DType::F64,
            vec![16, 512],
            vec![16, 8],
            dot(&[], &[], &[0], &[0]),
        ),
    ];
    for (i, (dt, a, b, d)) in cases.into_iter().enumerate() {
        let (at, bt, g) = one_dot(dt, &a, &b, &d);
        let ins = [random(&at, 300 + i as u64), random(&bt, 400 + i as u64)];
        let what = format!("transposed dot {i} {dt} {a:?} {b:?} {d:?}");
        check_own_kernel(&auto, &what, &g, &ins, TRANSPOSE_TARGET);
    }
}

/// Float sums over leading dims (bias gradients) run as kiln's column sum under the default
/// rule, and match XLA native and the float64 reference; the lowering without kernels keeps
/// XLA's reduction.
#[test]
fn leading_dim_sums_go_through_the_column_sum_kernel() {
    let auto = xla().with_options(XlaOptions::plain().ffi(FfiMode::Auto));
    let cases: Vec<(DType, Vec<usize>, Vec<usize>)> = vec![
        (DType::F32, vec![4, 65, 1024], vec![0, 1]),
        (DType::F32, vec![64, 24], vec![0]),
        (DType::F64, vec![40, 3, 7], vec![0]),
    ];
    for (i, (dt, dims, axes)) in cases.into_iter().enumerate() {
        let xt = TensorType::new(dt, dims.as_slice());
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", xt.clone());
        let y = g
            .add(
                Op::Reduce {
                    kind: ReduceKind::Sum,
                    axes: axes.clone(),
                },
                &[x],
            )
            .unwrap();
        g.set_outputs(vec![y]).unwrap();
        let ins = [random(&xt, 500 + i as u64)];
        let what = format!("column sum {i} {dt} {dims:?} over {axes:?}");
        check_own_kernel(&auto, &what, &g, &ins, COLUMN_SUM_TARGET);
    }
}

/// `x` and its max-pooling gradient for window attributes `w`: `SelectAndScatter(x, s)`.
fn select_scatter_graph(xt: &TensorType, w: &WindowAttrs) -> (Graph, TensorType) {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", xt.clone());
    let pooled = g
        .add(
            Op::ReduceWindow {
                kind: ReduceKind::Max,
                attrs: w.clone(),
            },
            &[x],
        )
        .unwrap();
    let st = g.node(pooled).ty.clone();
    let s = g.add_input(InputKind::Data, "s", st.clone());
    let y = g.add(Op::SelectAndScatter(w.clone()), &[x, s]).unwrap();
    g.set_outputs(vec![y]).unwrap();
    (g, st)
}

/// Max pooling's gradient (1-, 2- and 3-d windows, padded, overlapping, f32 and f64) runs as
/// kiln's select-and-scatter kernel and matches XLA's lowering of the same rule and the
/// float64 reference; with ties and NaNs it picks the elements the eager interpreter picks.
#[test]
fn max_pool_gradients_go_through_the_select_and_scatter_kernel() {
    let auto = xla().with_options(XlaOptions::plain().ffi(FfiMode::Auto));
    let wa = |window: &[usize], strides: &[usize], padding: &[(usize, usize)]| WindowAttrs {
        window: window.to_vec(),
        strides: strides.to_vec(),
        padding: padding.to_vec(),
    };
    let cases = [
        (vec![2, 3, 9, 8], wa(&[3, 3], &[2, 2], &[(1, 1), (1, 1)])),
        (vec![1, 4, 8, 8], wa(&[2, 2], &[2, 2], &[(0, 0), (0, 0)])),
        (vec![2, 2, 11], wa(&[3], &[1], &[(2, 0)])),
        (
            vec![1, 2, 4, 5, 6],
            wa(&[2, 3, 2], &[1, 2, 2], &[(0, 1), (1, 1), (0, 0)]),
        ),
    ];
    for (i, (dims, w)) in cases.iter().enumerate() {
        for dt in [DType::F32, DType::F64] {
            let xt = TensorType::new(dt, dims.as_slice());
            let (g, st) = select_scatter_graph(&xt, w);
            let ins = [random(&xt, 700 + i as u64), random(&st, 800 + i as u64)];
            let what = format!("select-and-scatter {i} {dt} {dims:?} {w:?}");
            check_own_kernel(&auto, &what, &g, &ins, SELECT_SCATTER_TARGET);
        }
    }
    // Ties (a ReLU'd grid of few values) and NaNs: the same selection as the interpreter, so
    // the same result up to the order of additions at positions shared by windows.
    let (dims, w) = &cases[0];
    let xt = TensorType::new(DType::F32, dims.as_slice());
    let (g, st) = select_scatter_graph(&xt, w);
    let mut r = SplitMix64::mixed(9);
    let mut k = 0;
    let x = floats(xt.shape.dims(), DType::F32, || {
        k += 1;
        if k % 37 == 0 {
            f64::NAN
        } else {
            ((r.uniform() * 4.0).floor() - 1.0).max(0.0)
        }
    });
    let ins = [x, random(&st, 11)];
    let want = run(&EagerBackend::new(), &g, &ins)[0].to_f64_vec();
    for (name, b) in [("kernel", &auto), ("XLA", &native())] {
        let got = run(b, &g, &ins)[0].to_f64_vec();
        for (j, (a, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - e).abs() <= 1e-6 * e.abs().max(1.0),
                "{name}: element {j}: {a} vs the interpreter's {e}"
            );
        }
    }
}

/// Scaled dot-product attention as the tracer records it (scale, products, softmax, optional
/// additive mask) becomes one attention call, and matches the float64 reference and XLA.
#[test]
fn attention_kernel_matches_xla_and_f64_reference() {
    use kiln::backend::xla::kernels::ATTENTION_TARGET;
    // (q, k, v): 4-d with heads, 3-d, and one where L != S and Dv != D.
    let cases: [[&[usize]; 3]; 3] = [
        [&[2, 4, 65, 16], &[2, 4, 65, 16], &[2, 4, 65, 16]],
        [&[3, 7, 8], &[3, 9, 8], &[3, 9, 8]],
        [&[1, 2, 5, 8], &[1, 2, 11, 8], &[1, 2, 11, 6]],
    ];
    for (i, [q, k, v]) in cases.into_iter().enumerate() {
        for mask in [false, true] {
            let r = q.len();
            let mut tys: Vec<TensorType> = [q, k, v]
                .iter()
                .map(|d| TensorType::new(DType::F32, *d))
                .collect();
            if mask {
                let scores: Vec<usize> = q[..r - 1].iter().copied().chain([k[r - 2]]).collect();
                tys.push(TensorType::new(DType::F32, scores));
            }
            let g = kiln::trace(&tys, |xs| {
                Ok(vec![kiln::Tensor::scaled_dot_product_attention(
                    &xs[0],
                    &xs[1],
                    &xs[2],
                    xs.get(3),
                    0.0,
                    false,
                )?])
            })
            .unwrap()
            .graph;
            // Inputs in [-3, 3): scores of a few units, a softmax far from uniform.
            let ins: Vec<HostTensor> = tys
                .iter()
                .enumerate()
                .map(|(j, t)| {
                    let mut r = SplitMix64::mixed(31 * i as u64 + j as u64);
                    floats(t.shape.dims(), DType::F32, || r.uniform() * 6.0 - 3.0)
                })
                .collect();
            for (g, dt) in [(g.clone(), DType::F32), (graph_f64(&g), DType::F64)] {
                let ins: Vec<HostTensor> = ins
                    .iter()
                    .map(|h| {
                        if dt == DType::F64 {
                            to_f64(h)
                        } else {
                            h.clone()
                        }
                    })
                    .collect();
                let what = format!("attention {i} {q:?} {k:?} {v:?} mask {mask} {dt}");
                let (ef, en) = check(&what, &g, &ins, ATTENTION_TARGET);
                println!("{what}: relative error FFI {ef:.2e}, XLA {en:.2e}");
            }
        }
    }
}

/// Attention as `nn::MultiheadAttention` feeds it: q, k and v sliced out of one fused
/// projection (`reshape → permute → narrow → reshape`), the heads merged back after it
/// (`permute → reshape`). The call reads q, k and v in the projection's buffer and writes its
/// result through the permuted view (no copies in between), and matches the float64
/// reference and XLA.
#[test]
fn attention_kernel_reads_and_writes_through_views() {
    use kiln::backend::xla::kernels::ATTENTION_TARGET;
    let (b, l, h, d) = (2usize, 9usize, 3usize, 8usize);
    let e = (h * d) as isize;
    for (mask, tail_op) in [(false, false), (true, true)] {
        let mut tys = vec![TensorType::new(DType::F32, [b, l, 3 * h * d])];
        if mask {
            tys.push(TensorType::new(DType::F32, [b, h, l, l]));
        }
        let g = kiln::trace(&tys, |xs| {
            let qkv = xs[0]
                .reshape(&[b as isize, l as isize, 3, h as isize, d as isize])?
                .permute(&[2, 0, 3, 1, 4])?;
            let part = |i: usize| {
                qkv.narrow(0, i, 1)?
                    .reshape(&[b as isize, h as isize, l as isize, d as isize])
            };
            let o = kiln::Tensor::scaled_dot_product_attention(
                &part(0)?,
                &part(1)?,
                &part(2)?,
                xs.get(1),
                0.0,
                false,
            )?;
            let merged = o
                .permute(&[0, 2, 1, 3])?
                .reshape(&[b as isize, l as isize, e])?;
            Ok(vec![if tail_op { merged.tanh()? } else { merged }])
        })
        .unwrap()
        .graph;
        let lowered = ffi().lower(&g).unwrap();
        for attr in ["q_view", "k_view", "v_view", "o_view"] {
            assert!(lowered.contains(attr), "no {attr} in\n{lowered}");
        }
        let ins: Vec<HostTensor> = tys
            .iter()
            .enumerate()
            .map(|(j, t)| {
                let mut r = SplitMix64::mixed(71 + j as u64);
                floats(t.shape.dims(), DType::F32, || r.uniform() * 6.0 - 3.0)
            })
            .collect();
        let what = format!("attention through views, mask {mask}, op after {tail_op}");
        let (ef, en) = check(&what, &g, &ins, ATTENTION_TARGET);
        println!("{what}: relative error FFI {ef:.2e}, XLA {en:.2e}");
    }
}

/// Kernels fused between XLA ops, several independent calls (which XLA may run concurrently),
/// run from several threads at once.
#[test]
fn kernels_inside_a_larger_graph_from_many_threads() {
    let xt = TensorType::new(DType::F32, [2, 8, 6, 6]);
    let kt = TensorType::new(DType::F32, [8, 1, 3, 3]);
    let wt = TensorType::new(DType::F32, [10, 8 * 36]);
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    c.feature_groups = 8;
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", xt.clone());
    let k = g.add_input(InputKind::Parameter, "k", kt.clone());
    let w = g.add_input(InputKind::Parameter, "w", wt.clone());
    let e = g.add(Op::Unary(kiln::ir::UnaryOp::Exp), &[x]).unwrap();
    let c1 = g.add(Op::Conv(c.clone()), &[x, k]).unwrap();
    let c2 = g.add(Op::Conv(c.clone()), &[e, k]).unwrap();
    let s = g
        .add(Op::Binary(kiln::ir::BinaryOp::Add), &[c1, c2])
        .unwrap();
    let f = g
        .add(
            Op::Reshape(kiln::ir::Shape::from(vec![2usize, 8 * 36])),
            &[s],
        )
        .unwrap();
    let y = g
        .add(Op::DotGeneral(dot(&[], &[], &[1], &[1])), &[f, w])
        .unwrap();
    let t = g.add(Op::Unary(kiln::ir::UnaryOp::Tanh), &[y]).unwrap();
    g.set_outputs(vec![t, c1]).unwrap();
    let ins = [random(&xt, 1), random(&kt, 2), random(&wt, 3)];
    check("fused graph", &g, &ins, DOT_TARGET);
    let want = run(&native(), &g, &ins);
    let b = ffi();
    let exe = b.compile(&g).unwrap();
    let bufs: Vec<_> = ins.iter().map(|h| b.to_device(h).unwrap()).collect();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..20 {
                    let refs: Vec<_> = bufs.iter().collect();
                    let out = b.execute(&exe, &refs).unwrap();
                    for (o, w) in out.iter().zip(&want) {
                        let o = b.to_host(o).unwrap();
                        let err = max_err(&o, &w.to_f64_vec());
                        assert!(err < 1e-4, "concurrent run differs by {err}");
                    }
                }
            });
        }
    });
}

#[test]
fn ffi_modes_have_distinct_cache_keys_and_off_is_pure_xla() {
    let keys: Vec<String> = [FfiMode::Off, FfiMode::Auto, FfiMode::All]
        .into_iter()
        .map(|m| xla().with_options(XlaOptions::plain().ffi(m)).cache_key())
        .collect();
    assert_ne!(keys[0], keys[1]);
    assert_ne!(keys[1], keys[2]);
    assert_ne!(keys[0], keys[2]);
    let xt = TensorType::new(DType::F32, [1, 2, 5, 5]);
    let kt = TensorType::new(DType::F32, [3, 2, 3, 3]);
    let g = conv_graph(&ConvAttrs::plain(2), &xt, &kt);
    let off = xla().with_options(XlaOptions::plain()).lower(&g).unwrap();
    assert!(!off.contains("custom_call") && off.contains("stablehlo.convolution"));
    // Integer products are not the kernels' business, whatever the mode.
    let it = TensorType::new(DType::I32, [3, 4]);
    let mut gi = Graph::new();
    let a = gi.add_input(InputKind::Data, "a", it.clone());
    let b = gi.add_input(InputKind::Data, "b", it.clone());
    let z = gi
        .add(Op::DotGeneral(dot(&[], &[], &[1], &[1])), &[a, b])
        .unwrap();
    gi.set_outputs(vec![z]).unwrap();
    let lowered = ffi().lower(&gi).unwrap();
    assert!(!lowered.contains("custom_call") && lowered.contains("dot_general"));
}

/// A custom call whose result type does not match its operands is an execution error that
/// names the kernel and the shapes, not a crash.
/// The error of running `exe` on `args`, which must fail (at launch or in its result).
fn call_error(exe: &pjrt::LoadedExecutable, args: &[&pjrt::Buffer]) -> String {
    match exe.execute(args) {
        Ok(outs) => outs[0].ready().expect_err("the call fails"),
        Err(e) => e,
    }
    .to_string()
}

#[test]
fn wrong_result_shape_is_an_error_with_a_message() {
    let b = ffi();
    let xt = TensorType::new(DType::F32, [1, 2, 5, 5]);
    let kt = TensorType::new(DType::F32, [3, 2, 3, 3]);
    let bad = TensorType::new(DType::F32, [1, 3, 4, 4]);
    let line = kiln::backend::xla::kernels::conv_call_mlir(
        "%y",
        ["%x", "%k"],
        &ConvAttrs::plain(2),
        &xt,
        &kt,
        &bad,
    );
    let mlir = format!(
        "module @m {{\n func.func public @main(%x: tensor<1x2x5x5xf32>, %k: tensor<3x2x3x3xf32>) -> tensor<1x3x4x4xf32> {{\n  {line}\n  \"func.return\"(%y) : (tensor<1x3x4x4xf32>) -> ()\n }}\n}}\n"
    );
    let exe = b.compile_mlir(&mlir).unwrap();
    let ins = [random(&xt, 1), random(&kt, 2)];
    let bufs: Vec<_> = ins.iter().map(|h| b.to_device(h).unwrap()).collect();
    let raw: Vec<_> = bufs.iter().map(|x| x.raw()).collect();
    let e = call_error(&exe, &raw);
    assert!(
        e.contains(CONV_TARGET) && e.contains("[1, 3, 3, 3]") && e.contains("[1, 3, 4, 4]"),
        "{e}"
    );

    // kiln's own kernels check their result buffers too.
    let run_one = |target: &str, config: &str, out: &str, want: &[&str]| {
        let mlir = format!(
            "module @m {{\n func.func public @main(%x: tensor<8x6xf32>) -> tensor<{out}xf32> {{\n  %y = \"stablehlo.custom_call\"(%x) {{call_target_name = \"{target}\", api_version = 4 : i32, backend_config = {{{config}}}}} : (tensor<8x6xf32>) -> tensor<{out}xf32>\n  \"func.return\"(%y) : (tensor<{out}xf32>) -> ()\n }}\n}}\n"
        );
        let exe = b.compile_mlir(&mlir).unwrap();
        let x = b
            .to_device(&random(&TensorType::new(DType::F32, [8, 6]), 3))
            .unwrap();
        let e = call_error(&exe, &[x.raw()]);
        assert!(e.contains(target), "{e}");
        for w in want {
            assert!(e.contains(w), "{w}: {e}");
        }
    };
    run_one(
        TRANSPOSE_TARGET,
        "split = array<i64: 0, 1>",
        "8x6",
        &["[6, 8]", "[8, 6]"],
    );
    run_one(
        TRANSPOSE_TARGET,
        "split = array<i64: 2, 1>",
        "6x8",
        &["split"],
    );
    run_one(COLUMN_SUM_TARGET, "lead = 1 : i64", "8", &["[8, 6]", "[8]"]);

    // The packed linear pair: the first linear takes a bias at most (no residual).
    let mlir = format!(
        "module @m {{\n func.func public @main(%x: tensor<8x6xf32>, %w0: tensor<5x6xf32>, %w: tensor<4x5xf32>) -> tensor<8x4xf32> {{\n  %y = \"stablehlo.custom_call\"(%x, %w0, %w) {{call_target_name = \"{PACKED_LINEAR_TARGET}\", api_version = 4 : i32, backend_config = {{act = 0 : i64, epilogue = 0 : i64, pre_act = 0 : i64, pre_epilogue = 4 : i64}}}} : (tensor<8x6xf32>, tensor<5x6xf32>, tensor<4x5xf32>) -> tensor<8x4xf32>\n  \"func.return\"(%y) : (tensor<8x4xf32>) -> ()\n }}\n}}\n"
    );
    let exe = b.compile_mlir(&mlir).unwrap();
    let bufs: Vec<_> = [[8, 6], [5, 6], [4, 5]]
        .iter()
        .enumerate()
        .map(|(i, d)| {
            b.to_device(&random(&TensorType::new(DType::F32, *d), 10 + i as u64))
                .unwrap()
        })
        .collect();
    let raw: Vec<_> = bufs.iter().map(|x| x.raw()).collect();
    let e = call_error(&exe, &raw);
    assert!(
        e.contains(PACKED_LINEAR_TARGET) && e.contains("[5, 6]") && e.contains("epilogue 4"),
        "{e}"
    );
}

/// The default options send a large convolution and its input gradient to the kernel and
/// never rewrite them to im2col, while a small forward convolution follows the conv rule
/// (im2col here).
#[test]
fn kernels_take_precedence_over_im2col() {
    // The rule's choices (also when the suite runs with KILN_AUTOTUNE=on).
    let b =
        &xla().with_options(XlaOptions::default().autotune(kiln::backend::xla::Autotune::off()));
    assert_eq!(b.options().ffi, FfiMode::Auto);
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    // 3x3 512 -> 512 on 2x2 (75 MFLOP): the kernel (FfiMode::Auto's forward rule), although
    // the conv rule alone would take im2col.
    let xt = TensorType::new(DType::F32, [4, 512, 2, 2]);
    let kt = TensorType::new(DType::F32, [512, 512, 3, 3]);
    let big = conv_graph(&c, &xt, &kt);
    let text = b.lower(&big).unwrap();
    assert!(
        text.contains(CONV_TARGET) && !text.contains("stablehlo.convolution"),
        "{text}"
    );
    // Its input gradient: the kernel, reading the forward weight (form 1), not rewritten.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", xt.clone());
    let w = g.add_input(InputKind::Parameter, "w", kt.clone());
    // As in a training step (a frozen weight's convolution would be a packed one).
    g.set_updated_between_calls(1, true).unwrap();
    let y = g.add(Op::Conv(c.clone()), &[x, w]).unwrap();
    let yt = g.node(y).ty.clone();
    let ct = g.add_input(InputKind::Cotangent, "ct", yt);
    let grads = vjp(&mut g, y, ct, &[true, false]).unwrap();
    g.set_outputs(vec![grads[0].unwrap()]).unwrap();
    let mut rewritten = g.clone();
    b.rewrite(&mut rewritten).unwrap();
    assert!(rewritten
        .topo_order()
        .iter()
        .any(|&n| matches!(rewritten.node(n).op, Op::Conv(_))));
    let text = b.lower(&g).unwrap();
    assert!(
        text.contains(CONV_TARGET) && text.contains("form = 1"),
        "{text}"
    );
    // 3x3 64 -> 64 on 2x2 (1.2 MFLOP): im2col (whose product may then go to the dot kernel).
    let small = conv_graph(
        &c,
        &TensorType::new(DType::F32, [4, 64, 2, 2]),
        &TensorType::new(DType::F32, [64, 64, 3, 3]),
    );
    let text = b.lower(&small).unwrap();
    assert!(
        !text.contains(CONV_TARGET)
            && !text.contains("stablehlo.convolution")
            && (text.contains("dot_general") || text.contains(DOT_TARGET)),
        "{text}"
    );
}
