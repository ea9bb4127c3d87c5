//! Autograd tests: every op's VJP against float64 central finite differences and tch autograd
//! (and the joint graph on XLA against the eager interpreter); joint graphs of traced models
//! against tch autograd; partition and dedup.
//!
//! Measured errors are printed (`cargo test --release --test autograd -- --nocapture`).

use kiln::autograd::{joint, partition, BackwardInput, Builder, SavePolicy, Split};
use kiln::backend::eager::{eval_op, EagerBackend};
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, InputKind, Literal, NodeId, Op,
    ReduceKind, Shape, TensorType, UnaryOp, WindowAttrs,
};
use kiln::passes::{dedup_outputs, Dce, OutputSource, Pass};
use kiln::Result;
use std::collections::{HashMap, HashSet};
use std::sync::OnceLock;

// ----- helpers ----------------------------------------------------------------------------

fn xla() -> &'static XlaBackend {
    static X: OnceLock<XlaBackend> = OnceLock::new();
    X.get_or_init(|| XlaBackend::new().expect("PJRT CPU plugin"))
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

fn randn(shape: &[usize], seed: u64) -> HostTensor {
    let mut r = Rng(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| r.normal()).collect();
    HostTensor::from_slice(shape, &v).unwrap()
}

/// Uniform in `[lo, hi)`.
fn uniform(shape: &[usize], lo: f64, hi: f64, seed: u64) -> HostTensor {
    let mut r = Rng(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n).map(|_| lo + (hi - lo) * r.uniform()).collect();
    HostTensor::from_slice(shape, &v).unwrap()
}

fn to_f32(h: &HostTensor) -> HostTensor {
    let v: Vec<f32> = h.to_f64_vec().iter().map(|&x| x as f32).collect();
    HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
}

fn run<B: Backend>(b: &B, g: &Graph, inputs: &[HostTensor]) -> Vec<HostTensor> {
    let exe = b
        .compile(g)
        .unwrap_or_else(|e| panic!("{} compile: {e}\n{g}", b.name()));
    let bufs: Vec<B::Buffer> = inputs.iter().map(|h| b.to_device(h).unwrap()).collect();
    let refs: Vec<&B::Buffer> = bufs.iter().collect();
    let outs = b
        .execute(&exe, &refs)
        .unwrap_or_else(|e| panic!("{} execute: {e}\n{g}", b.name()));
    outs.iter().map(|o| b.to_host(o).unwrap()).collect()
}

/// `max |a - b| / max(1, max |b|)`.
fn rel_err(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.ty().shape, b.ty().shape, "shape mismatch");
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    let scale = b.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
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

/// One op under test: inputs (f64 data, or integer indices), which inputs to differentiate, and
/// the graph of the op applied to them. The loss is `sum(op(...) * r)` with a random `r`.
struct Case {
    name: String,
    inputs: Vec<HostTensor>,
    wrt: Vec<usize>,
    build: Box<dyn Fn(&mut Graph, &[NodeId]) -> Result<NodeId>>,
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
fn vjp_ties_of_binary_max_split_evenly() {
    // relu as max(x, 0) at exactly 0: half of the gradient (documented), like torch.maximum.
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t64(&[3]));
    let mut b = Builder::new(&mut g);
    let z = b.zeros(&t64(&[3])).unwrap();
    let y = b.binary(BinaryOp::Max, x, z).unwrap();
    let l = b.sum_all(y).unwrap();
    g.set_outputs(vec![l]).unwrap();
    let j = joint(&g, 0, &[0]).unwrap();
    let out = run(
        &EagerBackend::new(),
        &j,
        &[
            HostTensor::from_slice(&[3], &[-1.0f64, 0.0, 2.0]).unwrap(),
            HostTensor::from_slice(&[], &[1.0f64]).unwrap(),
        ],
    );
    assert_eq!(out[1].to_f64_vec(), vec![0.0, 0.5, 1.0]);
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
