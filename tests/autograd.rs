//! Autograd tests: every op's VJP against float64 central finite differences and tch autograd
//! (and the joint graph on XLA against the eager interpreter); joint graphs of traced models
//! against tch autograd; partition and dedup.
//!
//! Measured errors are printed (`cargo test --release --test autograd -- --nocapture`).

mod common;

use common::{floats, rel_err, run, xla, SplitMix64};
use kiln::autograd::{joint, partition, BackwardInput, Builder, SavePolicy, Split};
use kiln::backend::eager::{eval_op, EagerBackend};
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, InputKind, Literal, NodeId, Op,
    ReduceKind, Shape, TensorType, UnaryOp, WindowAttrs,
};
use kiln::passes::{dedup_outputs, Dce, OutputSource, Pass};
use kiln::Result;
use std::collections::{HashMap, HashSet};

// ----- helpers ----------------------------------------------------------------------------

fn randn(shape: &[usize], seed: u64) -> HostTensor {
    let mut r = SplitMix64::raw(seed);
    floats(shape, DType::F64, || r.normal())
}

/// Uniform in `[lo, hi)`.
fn uniform(shape: &[usize], lo: f64, hi: f64, seed: u64) -> HostTensor {
    let mut r = SplitMix64::raw(seed);
    floats(shape, DType::F64, || lo + (hi - lo) * r.uniform())
}

fn to_f32(h: &HostTensor) -> HostTensor {
    let v: Vec<f32> = h.to_f64_vec().iter().map(|&x| x as f32).collect();
    HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
}

/// Gradients by tch autograd, interpreting `g` node by node with the eager backend's op
/// definitions on tensors that require grad. `g`'s first output must be the scalar loss.
fn tch_grads(g: &Graph, inputs: &[HostTensor], wrt: &[usize]) -> Vec<HostTensor> {
    let leaves: Vec<tch::Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, h)| {
            let t = h.to_tch().unwrap();
            if wrt.contains(&i) {
                t.set_requires_grad(true)
            } else {
                t
            }
        })
        .collect();
    let mut env: HashMap<NodeId, tch::Tensor> = HashMap::new();
    for id in g.topo_order() {
        let n = g.node(id);
        let v = match &n.op {
            Op::Input(i) => leaves[*i].shallow_clone(),
            op => {
                let args: Vec<&tch::Tensor> = n.operands.iter().map(|o| &env[o]).collect();
                let tys: Vec<&TensorType> = n.operands.iter().map(|&o| &g.node(o).ty).collect();
                eval_op(op, &args, &tys, &n.ty).unwrap()
            }
        };
        env.insert(id, v);
    }
    env[&g.outputs()[0]].backward();
    wrt.iter()
        .map(|&i| {
            let gr = leaves[i].grad();
            let gr = if gr.defined() {
                gr
            } else {
                leaves[i].zeros_like()
            };
            HostTensor::from_tch(&gr, inputs[i].ty().dtype).unwrap()
        })
        .collect()
}

/// Central finite differences of `g`'s first output (a scalar) w.r.t. input `i`.
fn finite_diff(g: &Graph, inputs: &[HostTensor], i: usize, h: f64) -> HostTensor {
    let eager = EagerBackend::new();
    let exe = eager.compile(g).unwrap();
    let eval = |ins: &[HostTensor]| -> f64 {
        let ts: Vec<tch::Tensor> = ins.iter().map(|h| h.to_tch().unwrap()).collect();
        let refs: Vec<&tch::Tensor> = ts.iter().collect();
        let out = eager.run_tch(&exe, &refs).unwrap();
        out[0].double_value(&[])
    };
    let base = inputs[i].to_f64_vec();
    let shape = inputs[i].ty().shape.dims().to_vec();
    let mut ins = inputs.to_vec();
    let mut grad = vec![0.0; base.len()];
    for (k, gk) in grad.iter_mut().enumerate() {
        let mut v = base.clone();
        v[k] = base[k] + h;
        ins[i] = HostTensor::from_slice(&shape, &v).unwrap();
        let up = eval(&ins);
        v[k] = base[k] - h;
        ins[i] = HostTensor::from_slice(&shape, &v).unwrap();
        let down = eval(&ins);
        *gk = (up - down) / (2.0 * h);
    }
    HostTensor::from_slice(&shape, &grad).unwrap()
}

/// Maximum errors seen, for the printed summary.
#[derive(Default, Debug)]
struct MaxErr {
    fd: f64,
    tch: f64,
    xla: f64,
}

/// Builds an op's graph from its input nodes.
type BuildFn = dyn Fn(&mut Graph, &[NodeId]) -> Result<NodeId>;

/// One op under test: inputs (f64 data, or integer indices), which inputs to differentiate, and
/// the graph of the op applied to them. The loss is `sum(op(...) * r)` with a random `r`.
struct Case {
    name: String,
    inputs: Vec<HostTensor>,
    wrt: Vec<usize>,
    build: Box<BuildFn>,
    /// Finite-difference step and tolerance.
    fd: (f64, f64),
    /// Tolerance against tch autograd and XLA (f64 everywhere: near machine precision).
    tol: f64,
    /// Inputs whose tch-autograd gradient is not available (the eager reference reads them as
    /// plain numbers, e.g. the padding value).
    no_tch: Vec<usize>,
}

impl Case {
    fn new(
        name: impl Into<String>,
        inputs: Vec<HostTensor>,
        wrt: &[usize],
        build: impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId> + 'static,
    ) -> Self {
        Case {
            name: name.into(),
            inputs,
            wrt: wrt.to_vec(),
            build: Box::new(build),
            fd: (1e-6, 1e-6),
            tol: 1e-9,
            no_tch: vec![],
        }
    }
    fn fd(mut self, h: f64, tol: f64) -> Self {
        self.fd = (h, tol);
        self
    }
    fn tol(mut self, tol: f64) -> Self {
        self.tol = tol;
        self
    }
    fn no_tch(mut self, inputs: &[usize]) -> Self {
        self.no_tch = inputs.to_vec();
        self
    }
}

/// The loss graph of a case and its inputs (the case's inputs ++ `r`).
fn loss_graph(c: &Case, seed: u64) -> (Graph, Vec<HostTensor>) {
    let mut g = Graph::new();
    let ids: Vec<NodeId> = c
        .inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.add_input(InputKind::Data, format!("in{i}"), h.ty().clone()))
        .collect();
    let y = (c.build)(&mut g, &ids).unwrap_or_else(|e| panic!("{}: build: {e}", c.name));
    let yt = g.node(y).ty.clone();
    let r = g.add_input(InputKind::Data, "r", yt.clone());
    let mut b = Builder::new(&mut g);
    let p = b.mul(y, r).unwrap();
    let l = b.sum_all(p).unwrap();
    g.set_outputs(vec![l]).unwrap();
    let mut inputs = c.inputs.clone();
    let rh = randn(yt.shape.dims(), seed);
    inputs.push(if yt.dtype == DType::F32 {
        to_f32(&rh)
    } else {
        rh
    });
    (g, inputs)
}

fn check_case(c: &Case, seed: u64, errs: &mut MaxErr) {
    let (g, inputs) = loss_graph(c, seed);
    let j = joint(&g, 0, &c.wrt).unwrap_or_else(|e| panic!("{}: joint: {e}\n{g}", c.name));
    let mut jin = inputs.clone();
    jin.push(HostTensor::from_slice(&[], &[1.0f64]).unwrap());
    let eager = run(&EagerBackend::new(), &j, &jin);
    let xla_out = run(xla(), &j, &jin);
    let tch = tch_grads(&g, &inputs, &c.wrt);
    for (k, &i) in c.wrt.iter().enumerate() {
        let ours = &eager[1 + k];
        let fd = finite_diff(&g, &inputs, i, c.fd.0);
        let e_fd = rel_err(ours, &fd);
        let e_tch = if c.no_tch.contains(&i) {
            0.0
        } else {
            rel_err(ours, &tch[k])
        };
        let e_xla = rel_err(&xla_out[1 + k], ours);
        assert!(
            e_fd <= c.fd.1,
            "{}: d/d in{i} vs finite differences: rel err {e_fd:.3e}\nours {ours:?}\nfd   {fd:?}\n{j}",
            c.name
        );
        assert!(
            e_tch <= c.tol,
            "{}: d/d in{i} vs tch autograd: rel err {e_tch:.3e}\nours {ours:?}\ntch  {:?}",
            c.name,
            tch[k]
        );
        assert!(
            e_xla <= c.tol,
            "{}: d/d in{i} XLA vs eager: rel err {e_xla:.3e}\nxla {:?}\neager {ours:?}",
            c.name,
            xla_out[1 + k]
        );
        errs.fd = errs.fd.max(e_fd);
        errs.tch = errs.tch.max(e_tch);
        errs.xla = errs.xla.max(e_xla);
    }
}

fn check_all(group: &str, cases: Vec<Case>) {
    let mut errs = MaxErr::default();
    for (k, c) in cases.iter().enumerate() {
        check_case(c, 1000 + k as u64, &mut errs);
    }
    eprintln!(
        "[{group}] {} cases: max rel err vs finite differences {:.2e}, vs tch autograd {:.2e}, XLA vs eager {:.2e}",
        cases.len(),
        errs.fd,
        errs.tch,
        errs.xla
    );
    for d in [DType::BF16, DType::F16] {
        check_half(group, &cases, d);
    }
}

// ----- the same VJPs in bf16 / f16 ------------------------------------------------------------
//
// Each case is rounded to the 16-bit dtype (inputs and `r`) and differentiated there, on the
// eager interpreter and on XLA; the float64 gradients of the same rounded values are the
// reference, and libtorch's autograd in the 16-bit dtype (through the eager op definitions)
// measures what the dtype allows. Rule, normwise per gradient:
//     max |ours - ref| <= 8 * max(max |libtorch - ref|, u * max |ref|, tiny)
// with u the unit roundoff (2^-8 bf16, 2^-11 f16) and tiny the smallest normal number: an
// op's VJP here is a chain of up to a few primitive ops (tanh' = 1 - y², erf' = 2/√π·e^(-x²),
// ...), each rounding once to the dtype, where libtorch's fused backward kernels round once;
// 8 allows that chain. Finite differences are meaningless at 8 significant bits and are not
// used. Cases whose graph does not build in the dtype (f64-only constants) are skipped.

fn round_to(h: &HostTensor, d: DType) -> HostTensor {
    if h.ty().dtype.is_float() {
        let mut v = h.to_f64_vec().into_iter();
        floats(h.ty().shape.dims(), d, move || v.next().unwrap())
    } else {
        h.clone()
    }
}

/// `sum(build(inputs) * r)` over `inputs`' types; `None` if the case does not build there.
fn half_loss_graph(c: &Case, inputs: &[HostTensor]) -> Option<(Graph, TensorType)> {
    let mut g = Graph::new();
    let ids: Vec<NodeId> = inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.add_input(InputKind::Data, format!("in{i}"), h.ty().clone()))
        .collect();
    let y = (c.build)(&mut g, &ids).ok()?;
    let yt = g.node(y).ty.clone();
    if !yt.dtype.is_float() {
        return None;
    }
    let r = g.add_input(InputKind::Data, "r", yt.clone());
    let mut b = Builder::new(&mut g);
    let p = b.mul(y, r).ok()?;
    let l = b.sum_all(p).ok()?;
    g.set_outputs(vec![l]).ok()?;
    Some((g, yt))
}

fn check_half(group: &str, cases: &[Case], d: DType) {
    let u = d.epsilon().unwrap() / 2.0;
    let tiny = if d == DType::F16 {
        2f64.powi(-14)
    } else {
        f32::MIN_POSITIVE as f64
    };
    let (mut ours_worst, mut torch_worst, mut checked) = (0.0f64, 0.0f64, 0);
    for (k, c) in cases.iter().enumerate() {
        let ins: Vec<HostTensor> = c.inputs.iter().map(|h| round_to(h, d)).collect();
        let Some((g, yt)) = half_loss_graph(c, &ins) else {
            continue;
        };
        let mut ins = ins;
        ins.push(round_to(&randn(yt.shape.dims(), 1000 + k as u64), yt.dtype));
        // The float64 twin on the same (exactly representable) values.
        let ins64: Vec<HostTensor> = ins.iter().map(|h| round_to(h, DType::F64)).collect();
        let (g64, _) = half_loss_graph(c, &ins64[..c.inputs.len()])
            .unwrap_or_else(|| panic!("{}: the f64 graph", c.name));
        let seed = |dt: DType| round_to(&HostTensor::from_slice(&[], &[1.0f64]).unwrap(), dt);
        let j64 = joint(&g64, 0, &c.wrt).unwrap();
        let mut jin64 = ins64.clone();
        jin64.push(seed(DType::F64));
        let reference = run(&EagerBackend::new(), &j64, &jin64);
        let j = joint(&g, 0, &c.wrt).unwrap_or_else(|e| panic!("{} {d}: joint: {e}", c.name));
        let mut jin = ins.clone();
        jin.push(seed(yt.dtype));
        let eager = run(&EagerBackend::new(), &j, &jin);
        let xla_out = run(xla(), &j, &jin);
        let tch = tch_grads(&g, &ins, &c.wrt);
        for (n, &i) in c.wrt.iter().enumerate() {
            let r = reference[1 + n].to_f64_vec();
            let dist = |h: &HostTensor| {
                h.to_f64_vec()
                    .iter()
                    .zip(&r)
                    .map(|(a, b)| (a - b).abs())
                    .fold(
                        0.0f64,
                        |m, e| if e.is_nan() { f64::INFINITY } else { m.max(e) },
                    )
            };
            let scale = r.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let e_tch = if c.no_tch.contains(&i) {
                0.0
            } else {
                dist(&tch[n])
            };
            let bound = 8.0 * e_tch.max(u * scale).max(tiny);
            for (backend, got) in [("eager", &eager[1 + n]), ("xla", &xla_out[1 + n])] {
                assert_eq!(got.ty(), ins[i].ty(), "{} {d}: gradient type", c.name);
                let e = dist(got);
                assert!(
                    e <= bound,
                    "{} {d} [{backend}]: d/d in{i}: max error {e:.3e} vs float64, libtorch's \
                     {e_tch:.3e}, bound {bound:.3e}\nours {got:?}\nref  {:?}",
                    c.name,
                    reference[1 + n]
                );
                ours_worst = ours_worst.max(e / scale.max(tiny));
            }
            torch_worst = torch_worst.max(e_tch / scale.max(tiny));
        }
        checked += 1;
    }
    eprintln!(
        "[{group}] {d}: {checked} of {} cases: max error relative to max |grad|: kiln {ours_worst:.2e}, libtorch {torch_worst:.2e}",
        cases.len()
    );
}

fn t64(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F64, shape)
}

fn op1(op: Op) -> impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId> {
    move |g, x| g.add(op.clone(), &[x[0]])
}

fn op2(op: Op) -> impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId> {
    move |g, x| g.add(op.clone(), &[x[0], x[1]])
}

// ----- per-op VJPs ----------------------------------------------------------------------------

#[test]
fn vjp_unary_ops() {
    let s = [3, 4];
    let mut cases = Vec::new();
    for (k, u) in [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Tanh,
        UnaryOp::Logistic,
        UnaryOp::Erf,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Sign,
    ]
    .into_iter()
    .enumerate()
    {
        cases.push(Case::new(
            u.name(),
            vec![randn(&s, k as u64)],
            &[0],
            op1(Op::Unary(u)),
        ));
    }
    for (k, u) in [UnaryOp::Log, UnaryOp::Log1p, UnaryOp::Sqrt, UnaryOp::Rsqrt]
        .into_iter()
        .enumerate()
    {
        cases.push(Case::new(
            u.name(),
            vec![uniform(&s, 0.5, 3.0, 50 + k as u64)],
            &[0],
            op1(Op::Unary(u)),
        ));
    }
    check_all("unary", cases);
}

#[test]
fn vjp_binary_ops() {
    let s = [2, 5];
    let mut cases = Vec::new();
    for (k, b) in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Max,
        BinaryOp::Min,
    ]
    .into_iter()
    .enumerate()
    {
        cases.push(Case::new(
            b.name(),
            vec![randn(&s, 2 * k as u64), randn(&s, 2 * k as u64 + 1)],
            &[0, 1],
            op2(Op::Binary(b)),
        ));
    }
    cases.push(Case::new(
        "div",
        vec![randn(&s, 20), uniform(&s, 0.5, 2.0, 21)],
        &[0, 1],
        op2(Op::Binary(BinaryOp::Div)),
    ));
    cases.push(Case::new(
        "pow",
        vec![uniform(&s, 0.5, 2.0, 22), randn(&s, 23)],
        &[0, 1],
        op2(Op::Binary(BinaryOp::Pow)),
    ));
    // fmod with quotients away from integers (the gradient w.r.t. b jumps there).
    let a = HostTensor::from_slice(&[4], &[5.3f64, -7.4, 2.2, -0.35]).unwrap();
    let b = HostTensor::from_slice(&[4], &[1.5f64, 2.0, -0.9, 0.4]).unwrap();
    cases.push(Case::new(
        "rem",
        vec![a, b],
        &[0, 1],
        op2(Op::Binary(BinaryOp::Rem)),
    ));
    // x * x: both operand slots accumulate into one input.
    cases.push(Case::new("square", vec![randn(&s, 24)], &[0], |g, x| {
        g.add(Op::Binary(BinaryOp::Mul), &[x[0], x[0]])
    }));
    // Ties: max/min split the gradient evenly, like torch.maximum (and central differences).
    let a = HostTensor::from_slice(&[6], &[1.0f64, 2.0, -1.0, 0.5, 3.0, -2.0]).unwrap();
    let b = HostTensor::from_slice(&[6], &[1.0f64, 1.0, -1.0, 0.7, 3.0, -3.0]).unwrap();
    for op in [BinaryOp::Max, BinaryOp::Min] {
        cases.push(Case::new(
            format!("{} with ties", op.name()),
            vec![a.clone(), b.clone()],
            &[0, 1],
            op2(Op::Binary(op)),
        ));
    }
    check_all("binary", cases);
}

#[test]
fn vjp_ties_of_binary_max() {
    // Against a constant (relu = max(x, 0)): no gradient at the threshold, like torch.relu.
    // Between two variables: split evenly, like torch.maximum.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t64(&[3]));
    let v = g.add_input(InputKind::Data, "v", t64(&[3]));
    let mut b = Builder::new(&mut g);
    let z = b.zeros(&t64(&[3])).unwrap();
    let relu = b.binary(BinaryOp::Max, x, z).unwrap();
    let both = b.binary(BinaryOp::Max, x, v).unwrap();
    let s = b.add(relu, both).unwrap();
    let l = b.sum_all(s).unwrap();
    g.set_outputs(vec![l]).unwrap();
    let j = joint(&g, 0, &[0, 1]).unwrap();
    let out = run(
        &EagerBackend::new(),
        &j,
        &[
            HostTensor::from_slice(&[3], &[-1.0f64, 0.0, 2.0]).unwrap(),
            HostTensor::from_slice(&[3], &[-1.0f64, 1.0, 5.0]).unwrap(),
            HostTensor::from_slice(&[], &[1.0f64]).unwrap(),
        ],
    );
    // d/dx: relu part [0, 0, 1] + max(x, v) part [1/2, 0, 0].
    assert_eq!(out[1].to_f64_vec(), vec![0.5, 0.0, 1.0]);
    assert_eq!(out[2].to_f64_vec(), vec![0.5, 1.0, 1.0]);
}

#[test]
fn vjp_threshold_activations_match_torch_at_the_kinks() {
    // Exact zeros and sixes: relu and relu6 (traced as max(x, 0) and min(max(x, 0), 6)) get
    // torch.relu's and torch.nn.functional.relu6's gradients at the thresholds.
    let x = HostTensor::from_slice(&[2, 4], &[0.0f64, -1.0, 0.0, 3.0, 6.0, 7.5, 0.0, 6.0]).unwrap();
    let relu = |g: &mut Graph, t: &[NodeId]| {
        let mut b = Builder::new(g);
        let z = b.zeros(&t64(&[2, 4]))?;
        b.binary(BinaryOp::Max, t[0], z)
    };
    let e1 = native_check("relu at 0", std::slice::from_ref(&x), relu, |t| t[0].relu());
    let e2 = native_check(
        "relu6 at 0 and 6",
        std::slice::from_ref(&x),
        |g, t| {
            let mut b = Builder::new(g);
            let z = b.zeros(&t64(&[2, 4]))?;
            let six = b.full(&t64(&[2, 4]), 6.0)?;
            let m = b.binary(BinaryOp::Max, t[0], z)?;
            b.binary(BinaryOp::Min, m, six)
        },
        |t| t[0].relu6(),
    );
    eprintln!(
        "[thresholds] relu/relu6 at the kinks vs torch: {:.2e}",
        e1.max(e2)
    );
}

#[test]
fn vjp_select_compare_convert() {
    let s = [3, 4];
    let cases = vec![
        Case::new(
            "select",
            vec![randn(&s, 1), randn(&s, 2), randn(&s, 3)],
            &[1, 2],
            |g, x| {
                let p = g.add(Op::Compare(CompareOp::Gt), &[x[0], x[1]])?;
                g.add(Op::Select, &[p, x[1], x[2]])
            },
        ),
        // f64 -> f32 -> f64: the gradient is converted back; finite differences see f32
        // rounding, hence the larger step and tolerance.
        Case::new("convert f64->f32->f64", vec![randn(&s, 4)], &[0], |g, x| {
            let a = g.add(Op::Convert(DType::F32), &[x[0]])?;
            let a = g.add(Op::Unary(UnaryOp::Tanh), &[a])?;
            g.add(Op::Convert(DType::F64), &[a])
        })
        .fd(1e-3, 1e-4)
        .tol(1e-6),
        // Through an integer conversion: no gradient (piecewise constant).
        Case::new("convert to int", vec![randn(&s, 5)], &[0], |g, x| {
            let s3 = g.add(Op::Constant(Literal::scalar(DType::F64, 3.0)), &[])?;
            let s3 = g.add(
                Op::Broadcast {
                    shape: Shape::new(&[3, 4]),
                    dims: vec![],
                },
                &[s3],
            )?;
            let a = g.add(Op::Binary(BinaryOp::Mul), &[x[0], s3])?;
            let i = g.add(Op::Convert(DType::I64), &[a])?;
            let f = g.add(Op::Convert(DType::F64), &[i])?;
            g.add(Op::Binary(BinaryOp::Mul), &[f, x[0]])
        }),
    ];
    check_all("select/compare/convert", cases);
}

#[test]
fn vjp_layout_ops() {
    let cases = vec![
        Case::new(
            "broadcast [3] -> [2,3,4]",
            vec![randn(&[3], 1)],
            &[0],
            op1(Op::Broadcast {
                shape: Shape::new(&[2, 3, 4]),
                dims: vec![1],
            }),
        ),
        Case::new(
            "broadcast [1,4] -> [3,4] (size-1 expand)",
            vec![randn(&[1, 4], 2)],
            &[0],
            op1(Op::Broadcast {
                shape: Shape::new(&[3, 4]),
                dims: vec![0, 1],
            }),
        ),
        Case::new(
            "broadcast [2,1] -> [2,5,3]",
            vec![randn(&[2, 1], 3)],
            &[0],
            op1(Op::Broadcast {
                shape: Shape::new(&[2, 5, 3]),
                dims: vec![0, 2],
            }),
        ),
        Case::new(
            "broadcast scalar",
            vec![randn(&[], 4)],
            &[0],
            op1(Op::Broadcast {
                shape: Shape::new(&[2, 3]),
                dims: vec![],
            }),
        ),
        Case::new(
            "reshape",
            vec![randn(&[2, 6], 5)],
            &[0],
            op1(Op::Reshape(Shape::new(&[3, 2, 2]))),
        ),
        Case::new(
            "transpose",
            vec![randn(&[2, 3, 4], 6)],
            &[0],
            op1(Op::Transpose(vec![2, 0, 1])),
        ),
        Case::new(
            "slice strided",
            vec![randn(&[7, 9], 7)],
            &[0],
            op1(Op::Slice {
                start: vec![1, 2],
                limit: vec![7, 9],
                stride: vec![2, 3],
            }),
        ),
        Case::new(
            "slice plain",
            vec![randn(&[5, 4], 8)],
            &[0],
            op1(Op::Slice {
                start: vec![1, 0],
                limit: vec![3, 4],
                stride: vec![1, 1],
            }),
        ),
        Case::new(
            "concat",
            vec![randn(&[2, 3], 9), randn(&[2, 1], 10), randn(&[2, 4], 11)],
            &[0, 1, 2],
            |g, x| g.add(Op::Concat { axis: 1 }, &[x[0], x[1], x[2]]),
        ),
        Case::new(
            "pad edges+interior, value",
            vec![randn(&[3, 4], 12), randn(&[], 13)],
            &[0, 1],
            op2(Op::Pad {
                low: vec![1, 2],
                high: vec![2, 0],
                interior: vec![1, 2],
            }),
        )
        .no_tch(&[1]),
        Case::new(
            "pad negative (crop)",
            vec![randn(&[5, 6], 14), randn(&[], 15)],
            &[0, 1],
            op2(Op::Pad {
                low: vec![-1, 2],
                high: vec![1, -2],
                interior: vec![0, 1],
            }),
        )
        .no_tch(&[1]),
        Case::new(
            "reverse",
            vec![randn(&[3, 4, 2], 16)],
            &[0],
            op1(Op::Reverse(vec![0, 2])),
        ),
    ];
    check_all("layout", cases);
}

fn dot(lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> Op {
    Op::DotGeneral(DotDims {
        lhs_batch: lb.to_vec(),
        rhs_batch: rb.to_vec(),
        lhs_contract: lc.to_vec(),
        rhs_contract: rc.to_vec(),
    })
}

#[test]
fn vjp_dot_general() {
    let cases = vec![
        Case::new(
            "matmul",
            vec![randn(&[3, 4], 1), randn(&[4, 5], 2)],
            &[0, 1],
            op2(dot(&[], &[], &[1], &[0])),
        ),
        Case::new(
            "x w^T",
            vec![randn(&[3, 4], 3), randn(&[5, 4], 4)],
            &[0, 1],
            op2(dot(&[], &[], &[1], &[1])),
        ),
        Case::new(
            "batched",
            vec![randn(&[2, 3, 4], 5), randn(&[2, 4, 5], 6)],
            &[0, 1],
            op2(dot(&[0], &[0], &[2], &[1])),
        ),
        Case::new(
            "batch dims in the middle",
            vec![randn(&[4, 2, 3], 7), randn(&[3, 5, 2], 8)],
            &[0, 1],
            op2(dot(&[1], &[2], &[2], &[0])),
        ),
        Case::new(
            "two contracting dims, crossed order",
            vec![randn(&[2, 3, 4], 9), randn(&[4, 3, 5], 10)],
            &[0, 1],
            op2(dot(&[], &[], &[1, 2], &[1, 0])),
        ),
        Case::new(
            "two batch dims, reversed pairing",
            vec![randn(&[2, 3, 4, 2], 11), randn(&[3, 2, 2, 5], 12)],
            &[0, 1],
            op2(dot(&[0, 1], &[1, 0], &[3], &[2])),
        ),
        Case::new(
            "outer product",
            vec![randn(&[3], 13), randn(&[4], 14)],
            &[0, 1],
            op2(dot(&[], &[], &[], &[])),
        ),
        Case::new(
            "vector dot",
            vec![randn(&[6], 15), randn(&[6], 16)],
            &[1],
            op2(dot(&[], &[], &[0], &[0])),
        ),
    ];
    check_all("dot_general", cases);
}

#[test]
fn vjp_reductions() {
    // Two-way ties: central differences and torch.amax both give 1/2 to each tied position.
    let tied =
        HostTensor::from_slice(&[2, 4], &[1.0f64, 3.0, 3.0, -1.0, 0.5, -2.0, 0.25, -2.0]).unwrap();
    let cases = vec![
        Case::new(
            "sum",
            vec![randn(&[2, 3, 4], 1)],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![0, 2],
            }),
        ),
        Case::new(
            "sum all",
            vec![randn(&[2, 3], 2)],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Sum,
                axes: vec![0, 1],
            }),
        ),
        Case::new(
            "max",
            vec![randn(&[3, 5, 2], 3)],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Max,
                axes: vec![1],
            }),
        ),
        Case::new(
            "min",
            vec![randn(&[3, 5, 2], 4)],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Min,
                axes: vec![0, 2],
            }),
        ),
        Case::new(
            "max with ties",
            vec![tied.clone()],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Max,
                axes: vec![1],
            }),
        ),
        Case::new(
            "min with ties",
            vec![tied],
            &[0],
            op1(Op::Reduce {
                kind: ReduceKind::Min,
                axes: vec![1],
            }),
        ),
    ];
    check_all("reduce", cases);
    // A single replica's all-reduce is the identity; so is its gradient (the multi-replica
    // meaning is checked in tests/data_parallel.rs).
    check_all(
        "all_reduce",
        vec![Case::new(
            "all_reduce sum, one replica",
            vec![randn(&[3, 4], 5)],
            &[0],
            op1(Op::AllReduce(ReduceKind::Sum)),
        )],
    );
}

fn window(w: &[usize], s: &[usize], p: &[(usize, usize)]) -> WindowAttrs {
    WindowAttrs {
        window: w.to_vec(),
        strides: s.to_vec(),
        padding: p.to_vec(),
    }
}

#[test]
fn vjp_windows() {
    let mut cases = Vec::new();
    for (k, (w, kind)) in [
        (window(&[3, 3], &[2, 2], &[(1, 1), (1, 1)]), ReduceKind::Max),
        (window(&[2, 2], &[2, 2], &[(0, 0), (0, 0)]), ReduceKind::Max),
        (window(&[3, 2], &[1, 2], &[(1, 0), (0, 1)]), ReduceKind::Max),
        (window(&[3, 3], &[2, 2], &[(1, 1), (1, 1)]), ReduceKind::Min),
        (window(&[3, 3], &[2, 2], &[(1, 1), (1, 1)]), ReduceKind::Sum),
        (window(&[2, 3], &[3, 1], &[(0, 2), (2, 1)]), ReduceKind::Sum),
        (window(&[3], &[2], &[(1, 1)]), ReduceKind::Max),
    ]
    .into_iter()
    .enumerate()
    {
        let shape: Vec<usize> = if w.window.len() == 1 {
            vec![2, 3, 9]
        } else {
            vec![2, 3, 7, 6]
        };
        cases.push(Case::new(
            format!("reduce_window {} {:?}", kind.name(), w),
            vec![randn(&shape, k as u64)],
            &[0],
            op1(Op::ReduceWindow { kind, attrs: w }),
        ));
    }
    // select_and_scatter itself (max pooling's gradient): linear in the source.
    let w = window(&[3, 3], &[2, 2], &[(1, 1), (1, 1)]);
    cases.push(Case::new(
        "select_and_scatter",
        vec![randn(&[2, 2, 7, 6], 20), randn(&[2, 2, 4, 3], 21)],
        &[0, 1],
        op2(Op::SelectAndScatter(w)),
    ));
    // Its source transpose with ties (first maximum wins) and with -inf values next to padding
    // (padding never wins): only the source is differentiated, as the selection jumps at ties.
    let mut r = SplitMix64::raw(31);
    let tied: Vec<f64> = (0..2 * 2 * 7 * 6)
        .map(|_| (r.uniform() * 3.0).floor())
        .collect();
    cases.push(Case::new(
        "select_and_scatter with ties",
        vec![
            HostTensor::from_slice(&[2, 2, 7, 6], &tied).unwrap(),
            randn(&[2, 2, 4, 3], 22),
        ],
        &[1],
        op2(Op::SelectAndScatter(window(
            &[3, 3],
            &[2, 2],
            &[(1, 1), (1, 1)],
        ))),
    ));
    let inf = f64::NEG_INFINITY;
    cases.push(Case::new(
        "select_and_scatter -inf and padding",
        vec![
            HostTensor::from_slice(&[1, 1, 4], &[inf, inf, 1.0, inf]).unwrap(),
            randn(&[1, 1, 3], 23),
        ],
        &[1],
        op2(Op::SelectAndScatter(window(&[2], &[2], &[(1, 1)]))),
    ));
    check_all("windows", cases);
}

fn conv(
    strides: &[usize],
    padding: &[(i64, i64)],
    lhs_dil: &[usize],
    rhs_dil: &[usize],
    fg: usize,
    bg: usize,
) -> Op {
    Op::Conv(ConvAttrs {
        strides: strides.to_vec(),
        padding: padding.to_vec(),
        lhs_dilation: lhs_dil.to_vec(),
        rhs_dilation: rhs_dil.to_vec(),
        feature_groups: fg,
        batch_groups: bg,
    })
}

#[test]
fn vjp_conv() {
    let cases = vec![
        Case::new(
            "conv1d plain",
            vec![randn(&[2, 3, 8], 1), randn(&[4, 3, 3], 2)],
            &[0, 1],
            op2(conv(&[1], &[(0, 0)], &[1], &[1], 1, 1)),
        ),
        Case::new(
            "conv2d stride 2 pad 1",
            vec![randn(&[2, 3, 7, 6], 3), randn(&[4, 3, 3, 3], 4)],
            &[0, 1],
            op2(conv(&[2, 2], &[(1, 1), (1, 1)], &[1, 1], &[1, 1], 1, 1)),
        ),
        Case::new(
            "conv2d dilation 2, asymmetric padding, stride 3",
            vec![randn(&[1, 2, 9, 8], 5), randn(&[3, 2, 2, 3], 6)],
            &[0, 1],
            op2(conv(&[3, 1], &[(2, 0), (1, 2)], &[1, 1], &[2, 2], 1, 1)),
        ),
        Case::new(
            "conv2d groups 2",
            vec![randn(&[2, 4, 6, 6], 7), randn(&[6, 2, 3, 3], 8)],
            &[0, 1],
            op2(conv(&[1, 2], &[(1, 1), (0, 1)], &[1, 1], &[1, 1], 2, 1)),
        ),
        Case::new(
            "conv2d depthwise x2",
            vec![randn(&[2, 3, 6, 5], 9), randn(&[6, 1, 3, 3], 10)],
            &[0, 1],
            op2(conv(&[2, 1], &[(1, 1), (1, 1)], &[1, 1], &[1, 1], 3, 1)),
        ),
        Case::new(
            "conv2d transposed (lhs dilation)",
            vec![randn(&[1, 2, 4, 3], 11), randn(&[3, 2, 3, 3], 12)],
            &[0, 1],
            op2(conv(&[1, 1], &[(2, 1), (2, 2)], &[2, 3], &[1, 1], 1, 1)),
        ),
        Case::new(
            "conv2d negative padding",
            vec![randn(&[1, 2, 8, 7], 13), randn(&[2, 2, 2, 2], 14)],
            &[0, 1],
            op2(conv(&[2, 1], &[(-1, 0), (1, -2)], &[1, 1], &[1, 2], 1, 1)),
        ),
        Case::new(
            "conv2d batch groups 2",
            vec![randn(&[4, 3, 5, 5], 15), randn(&[4, 3, 2, 2], 16)],
            &[0, 1],
            op2(conv(&[1, 1], &[(0, 0), (1, 0)], &[1, 1], &[1, 1], 1, 2)),
        ),
        Case::new(
            "conv3d",
            vec![randn(&[1, 2, 4, 5, 4], 17), randn(&[2, 2, 2, 3, 2], 18)],
            &[0, 1],
            op2(conv(
                &[1, 2, 1],
                &[(0, 1), (1, 1), (0, 0)],
                &[1, 1, 1],
                &[1, 1, 2],
                1,
                1,
            )),
        ),
    ];
    check_all("conv", cases);
}

#[test]
fn vjp_take_scatter() {
    let idx = HostTensor::from_slice(&[5], &[2i64, 0, 2, 3, 2]).unwrap();
    let idx2 = HostTensor::from_slice(&[2, 3], &[1i64, 0, 3, 3, 1, 1]).unwrap();
    let cases = vec![
        Case::new(
            "take axis 0 (embedding, repeated indices)",
            vec![randn(&[4, 3], 1), idx.clone()],
            &[0],
            op2(Op::Take { axis: 0 }),
        ),
        Case::new(
            "take axis 1, 2-d indices",
            vec![randn(&[2, 4, 3], 2), idx2.clone()],
            &[0],
            op2(Op::Take { axis: 1 }),
        ),
        Case::new(
            "scatter_add",
            vec![randn(&[4, 3], 3), idx, randn(&[5, 3], 4)],
            &[0, 2],
            |g, x| g.add(Op::ScatterAdd { axis: 0 }, &[x[0], x[1], x[2]]),
        ),
        Case::new(
            "scatter_add axis 1, 2-d indices",
            vec![randn(&[2, 4, 3], 5), idx2, randn(&[2, 2, 3, 3], 6)],
            &[0, 2],
            |g, x| g.add(Op::ScatterAdd { axis: 1 }, &[x[0], x[1], x[2]]),
        ),
    ];
    check_all("take/scatter", cases);
}

#[test]
fn vjp_composite_chain() {
    // A chain mixing many rules, values used several times (fan-out accumulation).
    let cases = vec![Case::new(
        "softmax-like chain",
        vec![randn(&[3, 5], 1), randn(&[5], 2)],
        &[0, 1],
        |g, x| {
            let mut b = Builder::new(g);
            let bb = b.broadcast(x[1], &Shape::new(&[3, 5]), vec![1])?;
            let z = b.add(x[0], bb)?;
            let m = b.op(
                Op::Reduce {
                    kind: ReduceKind::Max,
                    axes: vec![1],
                },
                &[z],
            )?;
            let mb = b.broadcast(m, &Shape::new(&[3, 5]), vec![0])?;
            let s = b.sub(z, mb)?;
            let e = b.unary(UnaryOp::Exp, s)?;
            let d = b.sum(e, &[1])?;
            let db = b.broadcast(d, &Shape::new(&[3, 5]), vec![0])?;
            let p = b.div(e, db)?;
            let t = b.unary(UnaryOp::Tanh, z)?;
            b.mul(p, t)
        },
    )];
    check_all("composite", cases);
}

#[test]
fn joint_errors_are_reported() {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t64(&[3]));
    let i = g.add_input(InputKind::Data, "i", TensorType::new(DType::I64, [3]));
    let y = Builder::new(&mut g).sum_all(x).unwrap();
    g.set_outputs(vec![y, x]).unwrap();
    let e = joint(&g, 1, &[0]).unwrap_err().to_string();
    assert!(e.contains("scalar"), "{e}");
    let e = joint(&g, 0, &[1]).unwrap_err().to_string();
    assert!(e.contains("non-float"), "{e}");
    let e = joint(&g, 0, &[5]).unwrap_err().to_string();
    assert!(e.contains("out of range"), "{e}");
    let _ = i;
    // An unused input gets a zero gradient; the joint keeps the original outputs first.
    let mut g2 = Graph::new();
    let a = g2.add_input(InputKind::Parameter, "a", t64(&[2]));
    let b = g2.add_input(InputKind::Parameter, "b", t64(&[2, 2]));
    let l = Builder::new(&mut g2).sum_all(a).unwrap();
    g2.set_outputs(vec![l]).unwrap();
    let j = joint(&g2, 0, &[1, 0]).unwrap();
    assert_eq!(j.inputs().len(), 3);
    assert_eq!(j.inputs()[2].kind, InputKind::Cotangent);
    let out = run(
        &EagerBackend::new(),
        &j,
        &[
            randn(&[2], 1),
            randn(&[2, 2], 2),
            HostTensor::from_slice(&[], &[2.0f64]).unwrap(),
        ],
    );
    assert_eq!(out[1].to_f64_vec(), vec![0.0; 4]);
    assert_eq!(out[2].to_f64_vec(), vec![2.0; 2]);
    let _ = b;
}

// ----- native tch references for the tricky ops -----------------------------------------------

/// `sum(f(x, w) * r)` built in the graph, gradients from the joint graph on eager and XLA (f64),
/// compared with tch autograd through libtorch's own kernels (`conv2d`, `max_pool2d`, ...).
fn native_check(
    name: &str,
    inputs: &[HostTensor],
    build: impl Fn(&mut Graph, &[NodeId]) -> Result<NodeId>,
    reference: impl Fn(&[tch::Tensor]) -> tch::Tensor,
) -> f64 {
    let mut g = Graph::new();
    let ids: Vec<NodeId> = inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.add_input(InputKind::Parameter, format!("p{i}"), h.ty().clone()))
        .collect();
    let y = build(&mut g, &ids).unwrap();
    let yt = g.node(y).ty.clone();
    let r = g.add_input(InputKind::Data, "r", yt.clone());
    let mut b = Builder::new(&mut g);
    let p = b.mul(y, r).unwrap();
    let l = b.sum_all(p).unwrap();
    g.set_outputs(vec![l]).unwrap();
    let wrt: Vec<usize> = (0..inputs.len()).collect();
    let j = joint(&g, 0, &wrt).unwrap();
    let rh = randn(yt.shape.dims(), 77);
    let mut jin = inputs.to_vec();
    jin.push(rh.clone());
    jin.push(HostTensor::from_slice(&[], &[1.0f64]).unwrap());
    let eager = run(&EagerBackend::new(), &j, &jin);
    let xl = run(xla(), &j, &jin);
    let leaves: Vec<tch::Tensor> = inputs
        .iter()
        .map(|h| h.to_tch().unwrap().set_requires_grad(true))
        .collect();
    let out = reference(&leaves);
    assert_eq!(
        out.size(),
        yt.shape.to_i64(),
        "{name}: reference output shape"
    );
    (out * rh.to_tch().unwrap()).sum(None).backward();
    let mut worst: f64 = 0.0;
    for (k, leaf) in leaves.iter().enumerate() {
        let t = HostTensor::from_tch(&leaf.grad(), DType::F64).unwrap();
        let e1 = rel_err(&eager[1 + k], &t);
        let e2 = rel_err(&xl[1 + k], &t);
        assert!(
            e1 <= 1e-9 && e2 <= 1e-9,
            "{name}: gradient {k} vs tch: eager {e1:.3e}, xla {e2:.3e}\nours {:?}\ntch  {t:?}",
            eager[1 + k]
        );
        worst = worst.max(e1).max(e2);
    }
    worst
}

/// (x shape, w shape, stride, padding, dilation, groups)
type ConvCfg = (
    [usize; 4],
    [usize; 4],
    [usize; 2],
    [usize; 2],
    [usize; 2],
    usize,
);

#[test]
fn vjp_conv_matches_torch_conv2d() {
    let mut worst: f64 = 0.0;
    // (x shape, w shape, stride, padding, dilation, groups)
    let configs: [ConvCfg; 5] = [
        ([2, 3, 8, 7], [4, 3, 3, 3], [1, 1], [1, 1], [1, 1], 1),
        ([2, 3, 9, 9], [5, 3, 3, 2], [2, 3], [1, 0], [1, 1], 1),
        ([1, 4, 9, 8], [6, 2, 3, 3], [2, 1], [2, 1], [2, 2], 2),
        ([2, 4, 7, 7], [4, 1, 3, 3], [2, 2], [1, 1], [1, 1], 4),
        ([2, 3, 6, 6], [6, 1, 5, 5], [1, 1], [2, 2], [1, 1], 3),
    ];
    for (k, (xs, ws, s, p, d, gr)) in configs.into_iter().enumerate() {
        let x = randn(&xs, 10 + k as u64);
        let w = randn(&ws, 20 + k as u64);
        worst = worst.max(native_check(
            &format!("conv2d {xs:?} {ws:?} s{s:?} p{p:?} d{d:?} g{gr}"),
            &[x, w],
            |g, v| {
                g.add(
                    conv(
                        &s,
                        &[(p[0] as i64, p[0] as i64), (p[1] as i64, p[1] as i64)],
                        &[1, 1],
                        &d,
                        gr,
                        1,
                    ),
                    &[v[0], v[1]],
                )
            },
            |t| {
                let si: Vec<i64> = s.iter().map(|&v| v as i64).collect();
                let pi: Vec<i64> = p.iter().map(|&v| v as i64).collect();
                let di: Vec<i64> = d.iter().map(|&v| v as i64).collect();
                t[0].conv2d(&t[1], None::<tch::Tensor>, si, pi, di, gr as i64)
            },
        ));
    }
    eprintln!("[native conv2d] max rel err vs torch conv2d autograd: {worst:.2e}");
}

#[test]
fn vjp_pooling_matches_torch() {
    // Integer-valued data: many ties inside windows. max_pool2d sends the gradient to the first
    // maximum of each window, and so does kiln (select_and_scatter).
    let mut r = SplitMix64::raw(5);
    let v: Vec<f64> = (0..2 * 3 * 9 * 8)
        .map(|_| (r.uniform() * 4.0).floor())
        .collect();
    let x = HostTensor::from_slice(&[2, 3, 9, 8], &v).unwrap();
    let mut worst: f64 = 0.0;
    for (k, s, p) in [(3usize, 2usize, 1usize), (2, 1, 1), (3, 3, 0), (2, 2, 0)] {
        worst = worst.max(native_check(
            &format!("max_pool2d k{k} s{s} p{p} with ties"),
            std::slice::from_ref(&x),
            |g, t| {
                g.add(
                    Op::ReduceWindow {
                        kind: ReduceKind::Max,
                        attrs: window(&[k, k], &[s, s], &[(p, p), (p, p)]),
                    },
                    &[t[0]],
                )
            },
            |t| {
                let (k, s, p) = (k as i64, s as i64, p as i64);
                t[0].max_pool2d([k, k], [s, s], [p, p], [1, 1], false)
            },
        ));
    }
    // Average pooling (count_include_pad = true) = windowed sum / k^2.
    let xr = randn(&[2, 3, 9, 8], 6);
    for (k, s, p) in [(3usize, 2usize, 1usize), (2, 2, 0), (3, 1, 1)] {
        worst = worst.max(native_check(
            &format!("avg_pool2d k{k} s{s} p{p}"),
            std::slice::from_ref(&xr),
            |g, t| {
                let sum = g.add(
                    Op::ReduceWindow {
                        kind: ReduceKind::Sum,
                        attrs: window(&[k, k], &[s, s], &[(p, p), (p, p)]),
                    },
                    &[t[0]],
                )?;
                Builder::new(g).mul_scalar(sum, 1.0 / (k * k) as f64)
            },
            |t| {
                let (k, s, p) = (k as i64, s as i64, p as i64);
                t[0].avg_pool2d([k, k], [s, s], [p, p], false, true, None::<i64>)
            },
        ));
    }
    eprintln!("[native pooling] max rel err vs torch max_pool2d/avg_pool2d autograd: {worst:.2e}");
}

#[test]
fn vjp_dot_and_gather_match_torch() {
    let mut worst: f64 = 0.0;
    worst = worst.max(native_check(
        "batched matmul",
        &[randn(&[3, 4, 5], 1), randn(&[3, 5, 2], 2)],
        |g, t| g.add(dot(&[0], &[0], &[2], &[1]), &[t[0], t[1]]),
        |t| t[0].matmul(&t[1]),
    ));
    worst = worst.max(native_check(
        "einsum bij,kjb->bik",
        &[randn(&[2, 3, 4], 3), randn(&[5, 4, 2], 4)],
        |g, t| g.add(dot(&[0], &[2], &[2], &[1]), &[t[0], t[1]]),
        |t| tch::Tensor::einsum("bij,kjb->bik", &[&t[0], &t[1]], None::<i64>),
    ));
    let idx = tch::Tensor::from_slice(&[3i64, 0, 3, 1, 1, 2]);
    let idx_h = HostTensor::from_slice(&[6], &[3i64, 0, 3, 1, 1, 2]).unwrap();
    worst = worst.max(native_check(
        "embedding (take axis 0)",
        &[randn(&[4, 5], 5)],
        move |g, t| {
            let lit = Literal::from_bytes(idx_h.ty().clone(), idx_h.bytes().to_vec())?;
            let i = g.add(Op::Constant(lit), &[])?;
            g.add(Op::Take { axis: 0 }, &[t[0], i])
        },
        move |t| tch::Tensor::embedding(&t[0], &idx, -1, false, false),
    ));
    eprintln!("[native dot/gather] max rel err vs torch autograd: {worst:.2e}");
}

// ----- traced models: joint graph vs tch autograd on the eager model ---------------------------

use kiln::nn::{Linear, Module, ParamStore, Relu, Sequential};
use kiln::trace::Binding;
use kiln::{trace, Tensor};

/// Host values of a traced graph's inputs: data from `data`, variables from their tensors.
fn bind(bindings: &[Binding], data: &[HostTensor]) -> Vec<HostTensor> {
    bindings
        .iter()
        .map(|b| match b {
            Binding::Data(i) => data[*i].clone(),
            Binding::Var(t) => t.detach().unwrap().to_host().unwrap(),
            Binding::RngKey => HostTensor::from_slice(&[2], &[1u32, 2]).unwrap(),
        })
        .collect()
}

fn one_hot(n: usize, classes: usize, seed: u64) -> HostTensor {
    let mut r = SplitMix64::raw(seed);
    let mut v = vec![0.0f32; n * classes];
    for i in 0..n {
        v[i * classes + (r.next_u64() % classes as u64) as usize] = 1.0;
    }
    HostTensor::from_slice(&[n, classes], &v).unwrap()
}

/// Cross entropy of logits `[N, K]` against one-hot targets (mean over the batch).
fn cross_entropy(logits: &Tensor, target: &Tensor) -> Result<Tensor> {
    let n = logits.dims()[0] as f64;
    logits
        .log_softmax(1)?
        .mul(target)?
        .sum_all()?
        .div_scalar(-n)
}

struct Model {
    graph: Graph,
    inputs: Vec<HostTensor>,
    params: Vec<usize>,
    /// tch autograd gradients of the eager model, one per `params` entry.
    reference: Vec<HostTensor>,
}

fn mlp_model() -> Model {
    let store = ParamStore::with_seed(3);
    let root = store.root();
    let model = Sequential::new()
        .add(Linear::new(&root.sub("0"), 12, 16, true).unwrap())
        .add(Relu)
        .add(Linear::new(&root.sub("2"), 16, 16, true).unwrap())
        .add(Relu)
        .add(Linear::new(&root.sub("4"), 16, 5, true).unwrap());
    let x = to_f32(&randn(&[8, 12], 9));
    let target = one_hot(8, 5, 10);
    // Eager: tch autograd through the same model code.
    let xe = Tensor::from_host(&x).unwrap();
    let te = Tensor::from_host(&target).unwrap();
    let loss = cross_entropy(&model.forward(&xe).unwrap(), &te).unwrap();
    loss.as_tch().unwrap().backward();
    let traced = trace(&[x.ty().clone(), target.ty().clone()], |xs| {
        Ok(vec![cross_entropy(&model.forward(&xs[0])?, &xs[1])?])
    })
    .unwrap();
    let inputs = bind(&traced.bindings, &[x, target]);
    let params: Vec<usize> = traced
        .graph
        .inputs()
        .iter()
        .enumerate()
        .filter(|(_, i)| i.kind == InputKind::Parameter)
        .map(|(k, _)| k)
        .collect();
    let reference = params
        .iter()
        .map(|&k| match &traced.bindings[k] {
            Binding::Var(t) => {
                HostTensor::from_tch(&t.as_tch().unwrap().grad(), DType::F32).unwrap()
            }
            _ => panic!("parameter input {k} is not a variable"),
        })
        .collect();
    Model {
        graph: traced.graph,
        inputs,
        params,
        reference,
    }
}

/// A conv + batch-norm (batch statistics) + relu + max-pool + grouped conv + global average
/// pool + linear + cross-entropy network, written directly with graph primitives; the reference
/// is the same network with libtorch's kernels and tch autograd.
fn conv_bn_model() -> Model {
    let (n, c, h) = (4usize, 3usize, 8usize);
    let f32t = |s: &[usize]| TensorType::new(DType::F32, s);
    let x = to_f32(&randn(&[n, c, h, h], 1));
    let target = one_hot(n, 5, 2);
    let w1 = to_f32(&uniform(&[8, 3, 3, 3], -0.4, 0.4, 3));
    let gamma = to_f32(&uniform(&[8], 0.5, 1.5, 4));
    let beta = to_f32(&uniform(&[8], -0.2, 0.2, 5));
    let w2 = to_f32(&uniform(&[8, 4, 3, 3], -0.3, 0.3, 6));
    let wl = to_f32(&uniform(&[5, 8], -0.5, 0.5, 7));
    let bl = to_f32(&uniform(&[5], -0.1, 0.1, 8));
    let mut g = Graph::new();
    let xi = g.add_input(InputKind::Data, "x", x.ty().clone());
    let ti = g.add_input(InputKind::Data, "target", target.ty().clone());
    let pw1 = g.add_input(InputKind::Parameter, "conv1.weight", w1.ty().clone());
    let pg = g.add_input(InputKind::Parameter, "bn.weight", gamma.ty().clone());
    let pb = g.add_input(InputKind::Parameter, "bn.bias", beta.ty().clone());
    let pw2 = g.add_input(InputKind::Parameter, "conv2.weight", w2.ty().clone());
    let pwl = g.add_input(InputKind::Parameter, "fc.weight", wl.ty().clone());
    let pbl = g.add_input(InputKind::Parameter, "fc.bias", bl.ty().clone());
    let mut b = Builder::new(&mut g);
    let act = Shape::new(&[n, 8, h, h]);
    let c1 = b
        .op(
            conv(&[1, 1], &[(1, 1), (1, 1)], &[1, 1], &[1, 1], 1, 1),
            &[xi, pw1],
        )
        .unwrap();
    let cnt = (n * h * h) as f64;
    let s = b.sum(c1, &[0, 2, 3]).unwrap();
    let mean = b.mul_scalar(s, 1.0 / cnt).unwrap();
    let mb = b.broadcast(mean, &act, vec![1]).unwrap();
    let d = b.sub(c1, mb).unwrap();
    let d2 = b.mul(d, d).unwrap();
    let vs = b.sum(d2, &[0, 2, 3]).unwrap();
    let var = b.mul_scalar(vs, 1.0 / cnt).unwrap();
    let ve = b.add_scalar(var, 1e-5).unwrap();
    let inv = b.unary(UnaryOp::Rsqrt, ve).unwrap();
    let ib = b.broadcast(inv, &act, vec![1]).unwrap();
    let xh = b.mul(d, ib).unwrap();
    let gb = b.broadcast(pg, &act, vec![1]).unwrap();
    let bb = b.broadcast(pb, &act, vec![1]).unwrap();
    let y = b.mul(xh, gb).unwrap();
    let y = b.add(y, bb).unwrap();
    let z = b.zeros(&f32t(&[n, 8, h, h])).unwrap();
    let r = b.binary(BinaryOp::Max, y, z).unwrap();
    let p = b
        .op(
            Op::ReduceWindow {
                kind: ReduceKind::Max,
                attrs: window(&[3, 3], &[2, 2], &[(1, 1), (1, 1)]),
            },
            &[r],
        )
        .unwrap();
    let c2 = b
        .op(
            conv(&[1, 1], &[(1, 1), (1, 1)], &[1, 1], &[1, 1], 2, 1),
            &[p, pw2],
        )
        .unwrap();
    let c2 = b.unary(UnaryOp::Tanh, c2).unwrap();
    let gs = b.sum(c2, &[2, 3]).unwrap();
    let gp = b.mul_scalar(gs, 1.0 / 16.0).unwrap();
    let lo = b.op(dot(&[], &[], &[1], &[1]), &[gp, pwl]).unwrap();
    let blb = b.broadcast(pbl, &Shape::new(&[n, 5]), vec![1]).unwrap();
    let logits = b.add(lo, blb).unwrap();
    let m = b
        .op(
            Op::Reduce {
                kind: ReduceKind::Max,
                axes: vec![1],
            },
            &[logits],
        )
        .unwrap();
    let mb = b.broadcast(m, &Shape::new(&[n, 5]), vec![0]).unwrap();
    let sh = b.sub(logits, mb).unwrap();
    let e = b.unary(UnaryOp::Exp, sh).unwrap();
    let se = b.sum(e, &[1]).unwrap();
    let lse = b.unary(UnaryOp::Log, se).unwrap();
    let lb = b.broadcast(lse, &Shape::new(&[n, 5]), vec![0]).unwrap();
    let logp = b.sub(sh, lb).unwrap();
    let pt = b.mul(logp, ti).unwrap();
    let tot = b.sum_all(pt).unwrap();
    let loss = b.mul_scalar(tot, -1.0 / n as f64).unwrap();
    g.set_outputs(vec![loss, logits]).unwrap();

    // Reference.
    let leaves: Vec<tch::Tensor> = [&w1, &gamma, &beta, &w2, &wl, &bl]
        .iter()
        .map(|h| h.to_tch().unwrap().set_requires_grad(true))
        .collect();
    let xt = x.to_tch().unwrap();
    let tt = target.to_tch().unwrap();
    let c1 = xt.conv2d(&leaves[0], None::<tch::Tensor>, [1, 1], [1, 1], [1, 1], 1);
    let mean = c1.mean_dim([0i64, 2, 3].as_slice(), true, None);
    let d = &c1 - &mean;
    let var = (&d * &d).mean_dim([0i64, 2, 3].as_slice(), true, None);
    let xh = &d * (var + 1e-5).rsqrt();
    let y = xh * leaves[1].view([1, 8, 1, 1]) + leaves[2].view([1, 8, 1, 1]);
    let p = y.relu().max_pool2d([3, 3], [2, 2], [1, 1], [1, 1], false);
    let c2 = p
        .conv2d(&leaves[3], None::<tch::Tensor>, [1, 1], [1, 1], [1, 1], 2)
        .tanh();
    let gp = c2.mean_dim([2i64, 3].as_slice(), false, None);
    let logits = gp.linear(&leaves[4], Some(&leaves[5]));
    let loss = -(logits.log_softmax(1, None) * tt).sum(None) / n as f64;
    loss.backward();
    let reference = leaves
        .iter()
        .map(|l| HostTensor::from_tch(&l.grad(), DType::F32).unwrap())
        .collect();
    let _ = f32t;
    Model {
        graph: g,
        inputs: vec![x, target, w1, gamma, beta, w2, wl, bl],
        params: vec![2, 3, 4, 5, 6, 7],
        reference,
    }
}

fn with_ct(inputs: &[HostTensor]) -> Vec<HostTensor> {
    let mut v = inputs.to_vec();
    v.push(HostTensor::from_slice(&[], &[1.0f32]).unwrap());
    v
}

fn check_model(name: &str, m: &Model) {
    let j = joint(&m.graph, 0, &m.params).unwrap();
    let nout = m.graph.outputs().len();
    let jin = with_ct(&m.inputs);
    let eager = run(&EagerBackend::new(), &j, &jin);
    let xl = run(xla(), &j, &jin);
    let (mut we, mut wx) = (0.0f64, 0.0f64);
    for (k, r) in m.reference.iter().enumerate() {
        let e1 = rel_err(&eager[nout + k], r);
        let e2 = rel_err(&xl[nout + k], r);
        assert!(
            e1 <= 1e-3 && e2 <= 1e-3,
            "{name}: param {k} ({}): eager {e1:.3e} xla {e2:.3e}\nours {:?}\ntch {r:?}",
            m.graph.inputs()[m.params[k]].name,
            xl[nout + k]
        );
        we = we.max(e1);
        wx = wx.max(e2);
    }
    eprintln!(
        "[{name}] {} parameter gradients vs tch autograd (f32): max rel err eager {we:.2e}, xla {wx:.2e}",
        m.reference.len()
    );
}

#[test]
fn mlp_gradients_match_tch_autograd() {
    check_model("traced MLP", &mlp_model());
}

#[test]
fn conv_bn_net_gradients_match_tch_autograd() {
    check_model("conv+bn net", &conv_bn_model());
}

// ----- partition ----------------------------------------------------------------------------------

fn check_split(name: &str, m: &Model, split: &Split, joint_grads: &[HostTensor]) {
    let nin = m.graph.inputs().len();
    let nout = m.graph.outputs().len();
    let (f, bw) = (&split.forward, &split.backward);
    assert_eq!(f.inputs().len(), nin);
    assert_eq!(f.outputs().len(), nout + split.num_saved);
    assert_eq!(bw.inputs().len(), split.backward_inputs.len());
    assert_eq!(bw.outputs().len(), m.params.len());
    // No value saved twice; forward inputs are never returned as saved values.
    let saved_nodes: Vec<NodeId> = f.outputs()[nout..].to_vec();
    let uniq: HashSet<NodeId> = saved_nodes.iter().copied().collect();
    assert_eq!(
        uniq.len(),
        saved_nodes.len(),
        "{name}: a value is saved twice"
    );
    for &s in &saved_nodes {
        assert!(
            !matches!(f.node(s).op, Op::Input(_)),
            "{name}: the forward graph returns an input as a saved value"
        );
        assert!(
            !f.outputs()[..nout].contains(&s),
            "{name}: a user output is saved again"
        );
    }
    let uniq: HashSet<BackwardInput> = split.backward_inputs.iter().copied().collect();
    assert_eq!(
        uniq.len(),
        split.backward_inputs.len(),
        "{name}: duplicate backward input"
    );
    // Parameters reach the backward graph as forward inputs, never through the forward graph.
    assert!(split
        .backward_inputs
        .iter()
        .any(|b| matches!(b, BackwardInput::ForwardInput(i) if m.params.contains(i))));
    // Dead-code free: DCE changes nothing, and every backward input but the cotangent is used.
    let (mut f2, mut b2) = (f.clone(), bw.clone());
    assert!(!Dce.run(&mut f2).unwrap(), "{name}: dead code in forward");
    assert!(!Dce.run(&mut b2).unwrap(), "{name}: dead code in backward");
    for (inp, kind) in bw.inputs().iter().zip(&split.backward_inputs) {
        if !matches!(kind, BackwardInput::Cotangent(_)) {
            assert!(
                !bw.users(inp.node).is_empty() || bw.outputs().contains(&inp.node),
                "{name}: backward input {} unused",
                inp.name
            );
        }
    }
    // Forward then backward on XLA gives the joint graph's gradients.
    let fout = run(xla(), f, &m.inputs);
    let ct = HostTensor::from_slice(&[], &[1.0f32]).unwrap();
    let bin: Vec<HostTensor> = split
        .backward_inputs
        .iter()
        .map(|b| match *b {
            BackwardInput::Saved(j) => fout[j].clone(),
            BackwardInput::ForwardInput(i) => m.inputs[i].clone(),
            BackwardInput::Cotangent(_) => ct.clone(),
        })
        .collect();
    let grads = run(xla(), bw, &bin);
    for (k, (a, b)) in grads.iter().zip(joint_grads).enumerate() {
        let e = rel_err(a, b);
        assert!(
            e <= 1e-5,
            "{name}: gradient {k}: split vs joint rel err {e:.3e}"
        );
    }
    for (k, r) in m.reference.iter().enumerate() {
        assert!(rel_err(&grads[k], r) <= 1e-3, "{name}: gradient {k} vs tch");
    }
}

#[test]
fn partition_forward_backward_equals_joint() {
    for (name, m) in [("MLP", mlp_model()), ("conv+bn net", conv_bn_model())] {
        let j = joint(&m.graph, 0, &m.params).unwrap();
        let nin = m.graph.inputs().len();
        let nout = m.graph.outputs().len();
        let joint_out = run(xla(), &j, &with_ct(&m.inputs));
        let joint_grads = &joint_out[nout..];
        let all = partition(&j, nin, nout, SavePolicy::SaveAll).unwrap();
        let rec = partition(&j, nin, nout, SavePolicy::RecomputeElementwise).unwrap();
        check_split(&format!("{name} SaveAll"), &m, &all, joint_grads);
        check_split(
            &format!("{name} RecomputeElementwise"),
            &m,
            &rec,
            joint_grads,
        );
        eprintln!(
            "[partition {name}] SaveAll saves {} values / {} bytes; RecomputeElementwise saves {} values / {} bytes; backward nodes {} vs {}",
            all.num_saved,
            all.saved_bytes(),
            rec.num_saved,
            rec.saved_bytes(),
            all.backward.len(),
            rec.backward.len()
        );
        assert!(
            rec.saved_bytes() < all.saved_bytes(),
            "{name}: recompute should save fewer bytes"
        );
    }
}

#[test]
fn partition_never_recomputes_random_values() {
    // y = x * mask(key) with the mask made of integer ops on an RngKey input (dropout-like).
    let mut g = Graph::new();
    let x = g.add_input(
        InputKind::Parameter,
        "x",
        TensorType::new(DType::F32, [4, 6]),
    );
    let key = g.add_input(
        InputKind::RngKey,
        "rng_key",
        TensorType::new(DType::U32, [2]),
    );
    let mut b = Builder::new(&mut g);
    let k0 = b
        .slice(key, vec![0], vec![1], vec![1])
        .and_then(|k| b.reshape(k, &[]))
        .unwrap();
    let kb = b.splat(k0, &Shape::new(&[4, 6])).unwrap();
    let io = b
        .op(
            Op::Iota {
                ty: TensorType::new(DType::U32, [4, 6]),
                dim: 1,
            },
            &[],
        )
        .unwrap();
    let mix = b.binary(BinaryOp::Xor, kb, io).unwrap();
    let mul = b
        .full(&TensorType::new(DType::U32, [4, 6]), 2654435761.0)
        .unwrap();
    let h = b.binary(BinaryOp::Mul, mix, mul).unwrap();
    let sh = b.full(&TensorType::new(DType::U32, [4, 6]), 16.0).unwrap();
    let h = b.binary(BinaryOp::ShiftRightLogical, h, sh).unwrap();
    let thr = b
        .full(&TensorType::new(DType::U32, [4, 6]), 32768.0)
        .unwrap();
    let keep = b.compare(CompareOp::Lt, h, thr).unwrap();
    let mask = b.convert(keep, DType::F32).unwrap();
    let mask = b.mul_scalar(mask, 2.0).unwrap();
    let y = b.mul(x, mask).unwrap();
    let t = b.unary(UnaryOp::Tanh, y).unwrap();
    let l = b.sum_all(t).unwrap();
    g.set_outputs(vec![l]).unwrap();
    let j = joint(&g, 0, &[0]).unwrap();
    for policy in [SavePolicy::SaveAll, SavePolicy::RecomputeElementwise] {
        let s = partition(&j, 2, 1, policy).unwrap();
        assert!(
            !s.backward_inputs.contains(&BackwardInput::ForwardInput(1)),
            "{policy:?}: the backward graph must not recompute from the rng key"
        );
        assert!(s
            .backward
            .inputs()
            .iter()
            .all(|i| i.kind != InputKind::RngKey));
        // Forward + backward equals the joint graph.
        let xv = to_f32(&randn(&[4, 6], 3));
        let kv = HostTensor::from_slice(&[2], &[12345u32, 678]).unwrap();
        let jo = run(
            &EagerBackend::new(),
            &j,
            &[
                xv.clone(),
                kv.clone(),
                HostTensor::from_slice(&[], &[1.0f32]).unwrap(),
            ],
        );
        let fo = run(xla(), &s.forward, &[xv.clone(), kv]);
        let bin: Vec<HostTensor> = s
            .backward_inputs
            .iter()
            .map(|b| match *b {
                BackwardInput::Saved(k) => fo[k].clone(),
                BackwardInput::ForwardInput(0) => xv.clone(),
                BackwardInput::ForwardInput(_) => panic!("unexpected forward input"),
                BackwardInput::Cotangent(_) => HostTensor::from_slice(&[], &[1.0f32]).unwrap(),
            })
            .collect();
        let go = run(xla(), &s.backward, &bin);
        assert!(rel_err(&go[0], &jo[1]) <= 1e-6);
    }
}

// ----- dedup --------------------------------------------------------------------------------------

/// Runs `g` through `dedup_outputs` on XLA and restores the caller's view of the outputs.
fn run_dedup(g: &Graph, inputs: &[HostTensor]) -> (Vec<HostTensor>, Vec<OutputSource>) {
    let mut d = g.clone();
    let map = dedup_outputs(&mut d).unwrap();
    d.verify().unwrap();
    let outs = run(xla(), &d, inputs);
    let restored = map
        .iter()
        .map(|s| match *s {
            OutputSource::Output(j) => outs[j].clone(),
            OutputSource::Input(i) => inputs[i].clone(),
        })
        .collect();
    (restored, map)
}

#[test]
fn dedup_of_forward_and_backward_graphs() {
    // Forward returns: loss, y, y again, and the parameter w unchanged.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3, 4]));
    let w = g.add_input(InputKind::Parameter, "w", TensorType::new(DType::F32, [4]));
    let s = g.add_input(InputKind::Parameter, "s", TensorType::scalar(DType::F32));
    let mut b = Builder::new(&mut g);
    let wb = b.broadcast(w, &Shape::new(&[3, 4]), vec![1]).unwrap();
    let y = b.mul(x, wb).unwrap();
    let y = b.unary(UnaryOp::Sin, y).unwrap();
    let l0 = b.sum_all(y).unwrap();
    let l = b.add(l0, s).unwrap();
    g.set_outputs(vec![l, y, y, w]).unwrap();
    // d/ds loss = the cotangent itself (an input returned unchanged by the backward graph);
    // asking for w twice returns the same gradient twice.
    let j = joint(&g, 0, &[1, 2, 1]).unwrap();
    let split = partition(&j, 3, 4, SavePolicy::SaveAll).unwrap();
    let xv = to_f32(&randn(&[3, 4], 1));
    let wv = to_f32(&randn(&[4], 2));
    let sv = HostTensor::from_slice(&[], &[0.5f32]).unwrap();
    let inputs = vec![xv.clone(), wv.clone(), sv];

    // Forward: y twice and w unchanged go through dedup; restored outputs equal the eager ones.
    let plain = run(&EagerBackend::new(), &split.forward, &inputs);
    let (restored, map) = run_dedup(&split.forward, &inputs);
    assert_eq!(map[1], map[2], "y is returned once");
    assert_eq!(map[3], OutputSource::Input(1), "w bypasses the executable");
    assert_eq!(restored.len(), plain.len());
    for (a, b) in restored.iter().zip(&plain) {
        assert!(rel_err(a, b) <= 1e-6);
    }

    // Backward: the same gradient twice and the cotangent returned unchanged.
    let ct = HostTensor::from_slice(&[], &[1.5f32]).unwrap();
    let bin: Vec<HostTensor> = split
        .backward_inputs
        .iter()
        .map(|b| match *b {
            BackwardInput::Saved(k) => plain[k].clone(),
            BackwardInput::ForwardInput(i) => inputs[i].clone(),
            BackwardInput::Cotangent(_) => ct.clone(),
        })
        .collect();
    let bplain = run(&EagerBackend::new(), &split.backward, &bin);
    let (brest, bmap) = run_dedup(&split.backward, &bin);
    assert_eq!(bmap[0], bmap[2], "the repeated gradient is returned once");
    assert!(matches!(bmap[1], OutputSource::Input(_)), "{bmap:?}");
    for (a, b) in brest.iter().zip(&bplain) {
        assert!(rel_err(a, b) <= 1e-6);
    }
    assert_eq!(brest[1].to_f64_vec(), vec![1.5]);
    // Against the joint graph.
    let mut jin = inputs.clone();
    jin.push(ct);
    let jo = run(&EagerBackend::new(), &j, &jin);
    for k in 0..3 {
        assert!(rel_err(&brest[k], &jo[4 + k]) <= 1e-6);
    }

    // A forward graph built to return a parameter as a "saved" value and a value twice.
    let mut f = Graph::new();
    let p = f.add_input(InputKind::Parameter, "p", TensorType::new(DType::F32, [4]));
    let e = Builder::new(&mut f).unary(UnaryOp::Exp, p).unwrap();
    f.set_outputs(vec![e, p, e, p]).unwrap();
    let (r, map) = run_dedup(&f, std::slice::from_ref(&wv));
    assert_eq!(
        map,
        vec![
            OutputSource::Output(0),
            OutputSource::Input(0),
            OutputSource::Output(0),
            OutputSource::Input(0)
        ]
    );
    assert_eq!(r[1], wv);
    assert!(rel_err(&r[2], &run(&EagerBackend::new(), &f, &[wv])[0]) <= 1e-6);
}

#[test]
fn traced_dropout_mask_is_saved_not_recomputed() {
    let ty = TensorType::new(DType::F32, [6, 5]);
    let t = trace(&[ty.clone(), ty.clone()], |xs| {
        let h = xs[0].mul(&xs[1])?.dropout(0.5, true)?;
        Ok(vec![h.tanh()?.sum_all()?])
    })
    .unwrap();
    let key = t
        .graph
        .inputs()
        .iter()
        .position(|i| i.kind == InputKind::RngKey)
        .expect("dropout adds an rng key input");
    let j = joint(&t.graph, 0, &[1]).unwrap();
    let nin = t.graph.inputs().len();
    let x = to_f32(&randn(&[6, 5], 1));
    let w = to_f32(&randn(&[6, 5], 2));
    let k = HostTensor::from_slice(&[2], &[7u32, 9]).unwrap();
    let mut inputs = vec![x.clone(), w.clone()];
    inputs.insert(key, k);
    let jo = run(xla(), &j, &with_ct(&inputs));
    let je = run(&EagerBackend::new(), &j, &with_ct(&inputs));
    assert!(
        rel_err(&jo[1], &je[1]) <= 1e-6,
        "same mask on both backends"
    );
    // d/dw = x * keep * 2 * (1 - tanh^2): zero exactly where the mask dropped.
    let g = jo[1].to_f64_vec();
    let zeros = g.iter().filter(|v| **v == 0.0).count();
    assert!(zeros > 3 && zeros < 27, "{zeros} dropped of 30");
    for policy in [SavePolicy::SaveAll, SavePolicy::RecomputeElementwise] {
        let s = partition(&j, nin, 1, policy).unwrap();
        assert!(!s
            .backward_inputs
            .contains(&BackwardInput::ForwardInput(key)));
        let saved_types = s.forward.output_types();
        assert!(
            saved_types[1..].iter().any(|t| t.dtype == DType::Bool),
            "{policy:?}: the keep mask is saved: {saved_types:?}"
        );
        let fo = run(xla(), &s.forward, &inputs);
        let bin: Vec<HostTensor> = s
            .backward_inputs
            .iter()
            .map(|b| match *b {
                BackwardInput::Saved(i) => fo[i].clone(),
                BackwardInput::ForwardInput(i) => inputs[i].clone(),
                BackwardInput::Cotangent(_) => HostTensor::from_slice(&[], &[1.0f32]).unwrap(),
            })
            .collect();
        let go = run(xla(), &s.backward, &bin);
        assert!(rel_err(&go[0], &jo[1]) <= 1e-6);
    }
}

#[test]
fn module_doc_example_runs() {
    let t = trace(
        &[
            TensorType::new(DType::F32, [4, 3]),
            TensorType::new(DType::F32, [3]),
        ],
        |xs| Ok(vec![xs[0].matmul(&xs[1])?.tanh()?.sum_all()?]),
    )
    .unwrap();
    let j = joint(&t.graph, 0, &[1]).unwrap();
    let split = partition(&j, 2, 1, SavePolicy::RecomputeElementwise).unwrap();
    let x = to_f32(&randn(&[4, 3], 1));
    let v = to_f32(&randn(&[3], 2));
    let fo = run(xla(), &split.forward, &[x.clone(), v.clone()]);
    let bin: Vec<HostTensor> = split
        .backward_inputs
        .iter()
        .map(|b| match *b {
            BackwardInput::Saved(i) => fo[i].clone(),
            BackwardInput::ForwardInput(0) => x.clone(),
            BackwardInput::ForwardInput(_) => v.clone(),
            BackwardInput::Cotangent(_) => HostTensor::from_slice(&[], &[1.0f32]).unwrap(),
        })
        .collect();
    let g = run(xla(), &split.backward, &bin);
    // Reference: d/dv sum(tanh(x v)) = x^T (1 - tanh^2(x v)).
    let xt = x.to_tch().unwrap();
    let vt = v.to_tch().unwrap().set_requires_grad(true);
    xt.matmul(&vt).tanh().sum(None).backward();
    let want = HostTensor::from_tch(&vt.grad(), DType::F32).unwrap();
    assert!(rel_err(&g[0], &want) <= 1e-5);
}
