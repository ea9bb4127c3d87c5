//! Fuzzing with proptest.
//!
//! 1. Random well-typed graphs over the whole [`Op`] set (random shapes including empty and
//!    size-1 dims, every dtype, broadcasting, negative padding, strides, dilations, groups,
//!    out-of-range indices, special float values): each must pass `verify`, survive kiln's
//!    simplification and the XLA backend's rewrite, lower, compile and run on XLA, and run on
//!    the eager interpreter. Every node is a graph output, and each node's XLA value is compared
//!    with the eager interpreter's value of that one op applied to XLA's values of its operands:
//!    errors do not accumulate along a chain, and a discontinuous op (floor, compare, max
//!    pooling's selection) sees the same inputs on both sides. Tolerances fit the dtype and the
//!    op (see [`tolerance`]): exact for data movement, selection, integers and bools; a few ulps
//!    for IEEE arithmetic; the condition number times a few ulps for transcendental functions;
//!    `n` ulps of the sum of absolute terms for sums of `n` terms (reductions, dots,
//!    convolutions, scatters).
//! 2. Random calls of the public tensor operations (mostly ill-typed: wrong dtypes, ranks,
//!    shapes, dims, attributes), eagerly and traced: each returns `Ok` or `Err`, never panics,
//!    and eager and traced agree on `Ok`/`Err` and on the result type.
//!
//! Case counts: 64 graphs and 1024 calls by default (about 20 s in release);
//! `KILN_FUZZ_CASES=N` runs `N` of each, `KILN_FUZZ_SEED` draws other cases (see [`config`]).
//! Failures found so far are kept as regression tests at the end of this file.

mod common;

use common::{run_graph, xla, SplitMix64};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, InputKind, Literal, NodeId, Op,
    ReduceKind, Shape, TensorType, UnaryOp, WindowAttrs,
};
use proptest::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The proptest configuration: `cases` cases (or `KILN_FUZZ_CASES`), drawn from a fixed seed so
/// that CI runs the same cases every time; `KILN_FUZZ_SEED=N` draws from seed `N`,
/// `KILN_FUZZ_SEED=random` from a new one each run (proptest prints a failing case in full).
fn config(cases_default: u32) -> ProptestConfig {
    let rng_seed = match std::env::var("KILN_FUZZ_SEED").ok().as_deref() {
        Some("random") => proptest::test_runner::RngSeed::Random,
        Some(s) => proptest::test_runner::RngSeed::Fixed(
            s.parse().expect("KILN_FUZZ_SEED: a number or `random`"),
        ),
        None => proptest::test_runner::RngSeed::Fixed(0x6b69_6c6e),
    };
    ProptestConfig {
        cases: cases(cases_default),
        failure_persistence: None,
        rng_seed,
        ..ProptestConfig::default()
    }
}

fn cases(default: u32) -> u32 {
    std::env::var("KILN_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

// ----- op kinds and coverage -------------------------------------------------------------------

/// What the generator can be asked to produce: one entry per [`Op`] variant, with the
/// elementwise, comparison and reduction functions spelled out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Kind {
    Input,
    Constant,
    Iota,
    Unary(UnaryOp),
    Binary(BinaryOp),
    Compare(CompareOp),
    Select,
    Convert,
    Broadcast,
    Reshape,
    Transpose,
    Slice,
    Concat,
    Pad,
    Reverse,
    DotGeneral,
    Reduce(ReduceKind),
    ReduceWindow(ReduceKind),
    SelectAndScatter,
    Conv,
    Take,
    ScatterAdd,
    AllReduce(ReduceKind),
    Barrier,
    StopGradient,
}

/// The kind of an op. Exhaustive: a new `Op` variant does not compile here until it has a
/// `Kind`, a place in [`all_kinds`] and a generator in [`Gen::op`].
fn kind_of(op: &Op) -> Kind {
    match op {
        Op::Input(_) => Kind::Input,
        Op::Constant(_) => Kind::Constant,
        Op::Iota { .. } => Kind::Iota,
        Op::Unary(u) => Kind::Unary(*u),
        Op::Binary(b) => Kind::Binary(*b),
        Op::Compare(c) => Kind::Compare(*c),
        Op::Select => Kind::Select,
        Op::Convert(_) => Kind::Convert,
        Op::Broadcast { .. } => Kind::Broadcast,
        Op::Reshape(_) => Kind::Reshape,
        Op::Transpose(_) => Kind::Transpose,
        Op::Slice { .. } => Kind::Slice,
        Op::Concat { .. } => Kind::Concat,
        Op::Pad { .. } => Kind::Pad,
        Op::Reverse(_) => Kind::Reverse,
        Op::DotGeneral(_) => Kind::DotGeneral,
        Op::Reduce { kind, .. } => Kind::Reduce(*kind),
        Op::ReduceWindow { kind, .. } => Kind::ReduceWindow(*kind),
        Op::SelectAndScatter(_) => Kind::SelectAndScatter,
        Op::Conv(_) => Kind::Conv,
        Op::Take { .. } => Kind::Take,
        Op::ScatterAdd { .. } => Kind::ScatterAdd,
        Op::AllReduce(r) => Kind::AllReduce(*r),
        Op::Barrier => Kind::Barrier,
        Op::StopGradient => Kind::StopGradient,
    }
}

const UNARY: [UnaryOp; 16] = [
    UnaryOp::Neg,
    UnaryOp::Abs,
    UnaryOp::Exp,
    UnaryOp::Log,
    UnaryOp::Log1p,
    UnaryOp::Sqrt,
    UnaryOp::Rsqrt,
    UnaryOp::Tanh,
    UnaryOp::Logistic,
    UnaryOp::Erf,
    UnaryOp::Sin,
    UnaryOp::Cos,
    UnaryOp::Floor,
    UnaryOp::Ceil,
    UnaryOp::Sign,
    UnaryOp::Not,
];
const BINARY: [BinaryOp; 13] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Rem,
    BinaryOp::Pow,
    BinaryOp::Max,
    BinaryOp::Min,
    BinaryOp::And,
    BinaryOp::Or,
    BinaryOp::Xor,
    BinaryOp::ShiftLeft,
    BinaryOp::ShiftRightLogical,
];
const COMPARE: [CompareOp; 6] = [
    CompareOp::Eq,
    CompareOp::Ne,
    CompareOp::Lt,
    CompareOp::Le,
    CompareOp::Gt,
    CompareOp::Ge,
];
const REDUCE: [ReduceKind; 3] = [ReduceKind::Sum, ReduceKind::Max, ReduceKind::Min];

/// Fails to compile when one of the op enums gains a variant: add it to the lists above.
#[allow(dead_code)]
fn lists_are_complete(u: UnaryOp, b: BinaryOp, c: CompareOp, r: ReduceKind) {
    use BinaryOp as B;
    use UnaryOp as U;
    match u {
        U::Neg | U::Abs | U::Exp | U::Log | U::Log1p | U::Sqrt | U::Rsqrt | U::Tanh => {}
        U::Logistic | U::Erf | U::Sin | U::Cos | U::Floor | U::Ceil | U::Sign | U::Not => {}
    }
    match b {
        B::Add | B::Sub | B::Mul | B::Div | B::Rem | B::Pow | B::Max | B::Min => {}
        B::And | B::Or | B::Xor | B::ShiftLeft | B::ShiftRightLogical => {}
    }
    match c {
        CompareOp::Eq | CompareOp::Ne | CompareOp::Lt | CompareOp::Le => {}
        CompareOp::Gt | CompareOp::Ge => {}
    }
    match r {
        ReduceKind::Sum | ReduceKind::Max | ReduceKind::Min => {}
    }
}

/// Every kind, in order. The `match` makes a new `Kind` a compile error until it is listed.
fn all_kinds() -> Vec<Kind> {
    let mut v = Vec::new();
    let mut k = Some(Kind::Input);
    while let Some(cur) = k {
        v.push(cur);
        k = match cur {
            Kind::Input => Some(Kind::Constant),
            Kind::Constant => Some(Kind::Iota),
            Kind::Iota => Some(Kind::Unary(UNARY[0])),
            Kind::Unary(u) => Some(match UNARY.iter().position(|&x| x == u).unwrap() + 1 {
                i if i < UNARY.len() => Kind::Unary(UNARY[i]),
                _ => Kind::Binary(BINARY[0]),
            }),
            Kind::Binary(b) => Some(match BINARY.iter().position(|&x| x == b).unwrap() + 1 {
                i if i < BINARY.len() => Kind::Binary(BINARY[i]),
                _ => Kind::Compare(COMPARE[0]),
            }),
            Kind::Compare(c) => Some(match COMPARE.iter().position(|&x| x == c).unwrap() + 1 {
                i if i < COMPARE.len() => Kind::Compare(COMPARE[i]),
                _ => Kind::Select,
            }),
            Kind::Select => Some(Kind::Convert),
            Kind::Convert => Some(Kind::Broadcast),
            Kind::Broadcast => Some(Kind::Reshape),
            Kind::Reshape => Some(Kind::Transpose),
            Kind::Transpose => Some(Kind::Slice),
            Kind::Slice => Some(Kind::Concat),
            Kind::Concat => Some(Kind::Pad),
            Kind::Pad => Some(Kind::Reverse),
            Kind::Reverse => Some(Kind::DotGeneral),
            Kind::DotGeneral => Some(Kind::Reduce(REDUCE[0])),
            Kind::Reduce(r) => Some(match REDUCE.iter().position(|&x| x == r).unwrap() + 1 {
                i if i < REDUCE.len() => Kind::Reduce(REDUCE[i]),
                _ => Kind::ReduceWindow(REDUCE[0]),
            }),
            Kind::ReduceWindow(r) => Some(match REDUCE.iter().position(|&x| x == r).unwrap() + 1 {
                i if i < REDUCE.len() => Kind::ReduceWindow(REDUCE[i]),
                _ => Kind::SelectAndScatter,
            }),
            Kind::SelectAndScatter => Some(Kind::Conv),
            Kind::Conv => Some(Kind::Take),
            Kind::Take => Some(Kind::ScatterAdd),
            Kind::ScatterAdd => Some(Kind::AllReduce(REDUCE[0])),
            Kind::AllReduce(r) => Some(
                REDUCE
                    .get(REDUCE.iter().position(|&x| x == r).unwrap() + 1)
                    .map_or(Kind::Barrier, |&r| Kind::AllReduce(r)),
            ),
            Kind::Barrier => Some(Kind::StopGradient),
            Kind::StopGradient => None,
        };
    }
    v
}

// ----- the graph generator ---------------------------------------------------------------------

/// Builds one random graph. Operands are taken from the nodes built so far when one of a
/// fitting type exists (so ops chain), or else are new graph inputs of a random fitting type
/// with random data.
struct Gen {
    rng: SplitMix64,
    g: Graph,
    /// Every node, in creation order.
    pool: Vec<NodeId>,
    /// One host value per graph input.
    inputs: Vec<HostTensor>,
}

impl Gen {
    fn new(seed: u64) -> Gen {
        Gen {
            rng: SplitMix64::mixed(seed),
            g: Graph::new(),
            pool: Vec::new(),
            inputs: Vec::new(),
        }
    }

    fn below(&mut self, n: usize) -> usize {
        (self.rng.next_u64() % n.max(1) as u64) as usize
    }

    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        self.rng.range(lo, hi)
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.uniform() < p
    }

    fn choose<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    fn ty(&self, n: NodeId) -> TensorType {
        self.g.node(n).ty.clone()
    }

    /// A dim size: mostly 1..=4, sometimes 0.
    fn dim(&mut self) -> usize {
        if self.chance(0.04) {
            0
        } else {
            1 + self.below(4)
        }
    }

    fn shape(&mut self, min_rank: usize, max_rank: usize) -> Vec<usize> {
        let r = min_rank + self.below(max_rank - min_rank + 1);
        (0..r).map(|_| self.dim()).collect()
    }

    /// Random data of type `ty`: small integers with the occasional extreme, floats of a random
    /// scale with the occasional special value (NaN, ±inf, ±0).
    fn data(&mut self, ty: &TensorType) -> HostTensor {
        let n = ty.shape.numel();
        let dims = ty.shape.dims().to_vec();
        let special = self.chance(0.3);
        let scale = self.choose(&[0.1, 1.0, 1.0, 10.0, 1000.0]);
        let float = |g: &mut Gen| -> f64 {
            if special && g.chance(0.1) {
                g.choose(&[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0, 1.0])
            } else {
                g.rng.normal() * scale
            }
        };
        match ty.dtype {
            DType::Bool => {
                let v: Vec<bool> = (0..n).map(|_| self.chance(0.5)).collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::U32 => {
                let v: Vec<u32> = (0..n)
                    .map(|_| match self.below(10) {
                        0 => self.rng.next_u64() as u32,
                        1 => u32::MAX,
                        _ => self.below(40) as u32,
                    })
                    .collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::I32 => {
                let v: Vec<i32> = (0..n)
                    .map(|_| match self.below(12) {
                        0 => self.rng.next_u64() as i32,
                        1 => self.choose(&[i32::MIN, i32::MAX, -1]),
                        _ => self.range(-20, 40) as i32,
                    })
                    .collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::I64 => {
                let v: Vec<i64> = (0..n)
                    .map(|_| match self.below(12) {
                        0 => self.rng.next_u64() as i64,
                        1 => self.choose(&[i64::MIN, i64::MAX, -1]),
                        _ => self.range(-20, 70),
                    })
                    .collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::F32 => {
                let v: Vec<f32> = (0..n).map(|_| float(self) as f32).collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::F64 => {
                let v: Vec<f64> = (0..n).map(|_| float(self)).collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::BF16 => {
                let v: Vec<half::bf16> =
                    (0..n).map(|_| half::bf16::from_f64(float(self))).collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
            DType::F16 => {
                let v: Vec<half::f16> = (0..n).map(|_| half::f16::from_f64(float(self))).collect();
                HostTensor::from_slice(&dims, &v).unwrap()
            }
        }
    }

    /// A new graph input of type `ty` with random data.
    fn fresh(&mut self, ty: TensorType) -> NodeId {
        let h = self.data(&ty);
        self.fresh_with(h)
    }

    fn fresh_with(&mut self, h: HostTensor) -> NodeId {
        let i = self.inputs.len();
        let n = self
            .g
            .add_input(InputKind::Data, format!("x{i}"), h.ty().clone());
        self.inputs.push(h);
        self.pool.push(n);
        n
    }

    /// A node whose type satisfies `ok` (three times in four, if one exists), else a new input
    /// of type `make()`.
    fn operand(
        &mut self,
        ok: impl Fn(&TensorType) -> bool,
        make: impl FnOnce(&mut Gen) -> TensorType,
    ) -> NodeId {
        let fits: Vec<NodeId> = self
            .pool
            .iter()
            .copied()
            .filter(|&n| ok(&self.g.node(n).ty))
            .collect();
        if !fits.is_empty() && !self.chance(0.25) {
            return self.choose(&fits);
        }
        let ty = make(self);
        self.fresh(ty)
    }

    /// A node of exactly type `ty`: an existing one (half the time, if any), else a new input.
    fn of_type(&mut self, ty: &TensorType) -> NodeId {
        let ty2 = ty.clone();
        let fits: Vec<NodeId> = self
            .pool
            .iter()
            .copied()
            .filter(|&n| self.g.node(n).ty == *ty)
            .collect();
        if !fits.is_empty() && self.chance(0.5) {
            return self.choose(&fits);
        }
        self.fresh(ty2)
    }

    fn dtype_from(&mut self, ok: impl Fn(DType) -> bool) -> DType {
        let ds: Vec<DType> = DType::ALL.iter().copied().filter(|&d| ok(d)).collect();
        self.choose(&ds)
    }

    /// An operand with a dtype satisfying `dt` and a rank in `lo..=hi`.
    fn operand_where(&mut self, dt: impl Fn(DType) -> bool + Copy, lo: usize, hi: usize) -> NodeId {
        self.operand(
            |t| dt(t.dtype) && (lo..=hi).contains(&t.shape.rank()) && t.shape.numel() <= 256,
            |g| {
                let d = g.dtype_from(dt);
                let s = g.shape(lo, hi);
                TensorType::new(d, s)
            },
        )
    }

    fn window(&mut self, spatial: &[usize]) -> WindowAttrs {
        let mut w = WindowAttrs {
            window: vec![],
            strides: vec![],
            padding: vec![],
        };
        for &s in spatial {
            let win = 1 + self.below(3);
            let (mut lo, hi) = (self.below(3), self.below(3));
            if s + lo + hi < win {
                lo += win - (s + lo + hi);
            }
            w.window.push(win);
            w.strides.push(1 + self.below(3));
            w.padding.push((lo, hi));
        }
        w
    }

    /// One random op of kind `k` and its operands (creating inputs as needed).
    fn op(&mut self, k: Kind) -> (Op, Vec<NodeId>) {
        let any = |_: DType| true;
        match k {
            Kind::Input => {
                let ty = {
                    let d = self.dtype_from(any);
                    TensorType::new(d, self.shape(0, 4))
                };
                let n = self.fresh(ty);
                (self.g.node(n).op.clone(), vec![])
            }
            Kind::Constant => {
                let d = self.dtype_from(any);
                let ty = TensorType::new(d, self.shape(0, 3));
                let h = self.data(&ty);
                let lit = Literal::from_bytes(ty, h.bytes().to_vec()).unwrap();
                (Op::Constant(lit), vec![])
            }
            Kind::Iota => {
                let d = self.dtype_from(|d| d != DType::Bool);
                let s = self.shape(1, 3);
                let dim = self.below(s.len());
                (
                    Op::Iota {
                        ty: TensorType::new(d, s),
                        dim,
                    },
                    vec![],
                )
            }
            Kind::Unary(u) => {
                let ok = move |d: DType| match u {
                    UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => {
                        d != DType::Bool && d != DType::U32
                    }
                    UnaryOp::Not => !d.is_float(),
                    _ => d.is_float(),
                };
                let a = self.operand_where(ok, 0, 4);
                (Op::Unary(u), vec![a])
            }
            Kind::Binary(b) => {
                let ok = move |d: DType| match b {
                    BinaryOp::Pow => d.is_float(),
                    BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => !d.is_float(),
                    BinaryOp::ShiftLeft | BinaryOp::ShiftRightLogical => d.is_int(),
                    _ => d != DType::Bool,
                };
                let a = self.operand_where(ok, 0, 4);
                let t = self.ty(a);
                let c = self.of_type(&t);
                let (a, c) = if self.chance(0.5) { (a, c) } else { (c, a) };
                (Op::Binary(b), vec![a, c])
            }
            Kind::Compare(c) => {
                let a = self.operand_where(any, 0, 4);
                let t = self.ty(a);
                let b = self.of_type(&t);
                (Op::Compare(c), vec![a, b])
            }
            Kind::Select => {
                let t = {
                    let a = self.operand_where(any, 0, 4);
                    self.ty(a)
                };
                let on_true = self.of_type(&t);
                let on_false = self.of_type(&t);
                let p = self.of_type(&t.with_dtype(DType::Bool));
                (Op::Select, vec![p, on_true, on_false])
            }
            Kind::Convert => {
                let a = self.operand_where(any, 0, 4);
                let d = self.dtype_from(any);
                (Op::Convert(d), vec![a])
            }
            Kind::Broadcast => {
                let a = self.operand_where(any, 0, 3);
                let src = self.ty(a).shape.dims().to_vec();
                let mut shape = Vec::new();
                let mut dims = Vec::new();
                for &s in &src {
                    while shape.len() < 5 && self.chance(0.3) {
                        shape.push(self.dim());
                    }
                    dims.push(shape.len());
                    shape.push(if s == 1 && self.chance(0.5) {
                        self.dim()
                    } else {
                        s
                    });
                }
                while shape.len() < 5 && self.chance(0.3) {
                    shape.push(self.dim());
                }
                (
                    Op::Broadcast {
                        shape: Shape::new(&shape),
                        dims,
                    },
                    vec![a],
                )
            }
            Kind::Reshape => {
                let a = self.operand_where(any, 0, 4);
                let src = self.ty(a).shape.dims().to_vec();
                // Merge neighbours, split a dim into a factor pair, insert ones.
                let mut out: Vec<usize> = Vec::new();
                for &s in &src {
                    match out.last_mut() {
                        Some(last) if self.chance(0.3) => *last *= s,
                        _ => {
                            let f = (2..=s).find(|f| s % f == 0 && s > *f);
                            match f {
                                Some(f) if self.chance(0.3) => out.extend([f, s / f]),
                                _ => out.push(s),
                            }
                        }
                    }
                    if self.chance(0.15) {
                        out.push(1);
                    }
                }
                (Op::Reshape(Shape::new(&out)), vec![a])
            }
            Kind::Transpose => {
                let a = self.operand_where(any, 0, 4);
                let r = self.ty(a).shape.rank();
                let mut perm: Vec<usize> = (0..r).collect();
                for i in (1..r).rev() {
                    let j = self.below(i + 1);
                    perm.swap(i, j);
                }
                (Op::Transpose(perm), vec![a])
            }
            Kind::Slice => {
                let a = self.operand_where(any, 0, 4);
                let dims = self.ty(a).shape.dims().to_vec();
                let (mut start, mut limit, mut stride) = (vec![], vec![], vec![]);
                for d in dims {
                    let s = self.below(d + 1);
                    let l = s + self.below(d - s + 1);
                    start.push(s);
                    limit.push(l);
                    stride.push(1 + self.below(3));
                }
                (
                    Op::Slice {
                        start,
                        limit,
                        stride,
                    },
                    vec![a],
                )
            }
            Kind::Concat => {
                let a = self.operand_where(any, 1, 4);
                let t = self.ty(a);
                let axis = self.below(t.shape.rank());
                let mut ops = vec![a];
                for _ in 0..self.below(4) {
                    if self.chance(0.3) {
                        ops.push(a);
                    } else {
                        let mut dims = t.shape.dims().to_vec();
                        dims[axis] = self.below(4);
                        let n = self.of_type(&TensorType::new(t.dtype, dims));
                        ops.push(n);
                    }
                }
                (Op::Concat { axis }, ops)
            }
            Kind::Pad => {
                let a = self.operand_where(any, 0, 4);
                let t = self.ty(a);
                let v = self.of_type(&TensorType::scalar(t.dtype));
                let (mut low, mut high, mut interior) = (vec![], vec![], vec![]);
                for &n in t.shape.dims() {
                    let i = self.below(3);
                    let inner = if n == 0 { 0 } else { (n + (n - 1) * i) as i64 };
                    let lo = self.range(-inner, 2);
                    let hi = self.range(-(inner + lo), 2);
                    low.push(lo);
                    high.push(hi);
                    interior.push(i);
                }
                (
                    Op::Pad {
                        low,
                        high,
                        interior,
                    },
                    vec![a, v],
                )
            }
            Kind::Reverse => {
                let a = self.operand_where(any, 0, 4);
                let r = self.ty(a).shape.rank();
                let dims: Vec<usize> = (0..r).filter(|_| self.chance(0.5)).collect();
                (Op::Reverse(dims), vec![a])
            }
            Kind::DotGeneral => {
                let a = self.operand_where(|d| d != DType::Bool, 0, 4);
                let t = self.ty(a);
                // Each lhs dim is a batch, contracting or free dim; rhs gets the batch and
                // contracting dims (same sizes) and free dims of its own, in a random order.
                let mut d = DotDims::default();
                let mut rhs_parts: Vec<(u8, usize, usize)> = Vec::new(); // (role, lhs dim, size)
                for (i, &s) in t.shape.dims().iter().enumerate() {
                    match self.below(3) {
                        0 => rhs_parts.push((0, i, s)),
                        1 => rhs_parts.push((1, i, s)),
                        _ => {}
                    }
                }
                for _ in 0..self.below(3) {
                    let s = self.dim();
                    rhs_parts.push((2, 0, s));
                }
                for i in (1..rhs_parts.len()).rev() {
                    let j = self.below(i + 1);
                    rhs_parts.swap(i, j);
                }
                let mut rdims = Vec::new();
                for (j, &(role, li, s)) in rhs_parts.iter().enumerate() {
                    rdims.push(s);
                    match role {
                        0 => {
                            d.lhs_batch.push(li);
                            d.rhs_batch.push(j);
                        }
                        1 => {
                            d.lhs_contract.push(li);
                            d.rhs_contract.push(j);
                        }
                        _ => {}
                    }
                }
                let b = self.of_type(&TensorType::new(t.dtype, rdims));
                (Op::DotGeneral(d), vec![a, b])
            }
            Kind::Reduce(kind) => {
                let a = self.operand_where(|d| d != DType::Bool, 0, 4);
                let r = self.ty(a).shape.rank();
                let axes: Vec<usize> = (0..r).filter(|_| self.chance(0.5)).collect();
                (Op::Reduce { kind, axes }, vec![a])
            }
            Kind::ReduceWindow(kind) => {
                let a = self.operand_where(|d| d != DType::Bool, 3, 4);
                let dims = self.ty(a).shape.dims().to_vec();
                let attrs = self.window(&dims[2..]);
                (Op::ReduceWindow { kind, attrs }, vec![a])
            }
            Kind::SelectAndScatter => {
                let a = self.operand_where(|d| d != DType::Bool, 3, 4);
                let t = self.ty(a);
                let attrs = self.window(&t.shape.dims()[2..]);
                let out = Op::ReduceWindow {
                    kind: ReduceKind::Max,
                    attrs: attrs.clone(),
                }
                .infer(&[&t])
                .unwrap();
                let s = self.of_type(&out);
                (Op::SelectAndScatter(attrs), vec![a, s])
            }
            Kind::Conv => self.conv(),
            Kind::Take => {
                let a = self.operand_where(any, 1, 3);
                let axis = self.below(self.ty(a).shape.rank());
                let n = self.ty(a).shape.dim(axis) as i64;
                let i = self.indices(n);
                (Op::Take { axis }, vec![a, i])
            }
            Kind::ScatterAdd => {
                let a = self.operand_where(|d| d != DType::Bool, 1, 3);
                let t = self.ty(a);
                let axis = self.below(t.shape.rank());
                let i = self.indices(t.shape.dim(axis) as i64);
                let it = self.ty(i);
                let mut dims = t.shape.dims()[..axis].to_vec();
                dims.extend_from_slice(it.shape.dims());
                dims.extend_from_slice(&t.shape.dims()[axis + 1..]);
                let u = self.of_type(&TensorType::new(t.dtype, dims));
                (Op::ScatterAdd { axis }, vec![a, i, u])
            }
            // One replica: the identity on both backends (the multi-replica meaning is
            // tested in tests/data_parallel.rs).
            Kind::AllReduce(r) => {
                let a = self.operand_where(|d| d != DType::Bool, 0, 3);
                (Op::AllReduce(r), vec![a])
            }
            // The value of its first operand, ordered after the others (of any types).
            Kind::Barrier => {
                let a = self.operand_where(|_| true, 0, 3);
                let b = self.operand_where(|_| true, 0, 3);
                let c = self.operand_where(|_| true, 0, 2);
                (Op::Barrier, vec![a, b, c])
            }
            // The operand's value (gradients are not fuzzed).
            Kind::StopGradient => {
                let a = self.operand_where(|_| true, 0, 3);
                (Op::StopGradient, vec![a])
            }
        }
    }

    /// An index tensor for a dim of size `n`: mostly in range, sometimes out of range either
    /// way (clamped by the op), rank 0 to 2; sometimes an existing integer node.
    fn indices(&mut self, n: i64) -> NodeId {
        if n == 0 {
            // Taking from an empty axis is well-typed only for an empty result.
            return self.fresh(TensorType::new(DType::I64, [0usize].as_slice()));
        }
        let existing: Vec<NodeId> = self
            .pool
            .iter()
            .copied()
            .filter(|&x| {
                let t = &self.g.node(x).ty;
                matches!(t.dtype, DType::I32 | DType::I64) && t.shape.rank() <= 2
            })
            .collect();
        if !existing.is_empty() && self.chance(0.2) {
            return self.choose(&existing);
        }
        let shape = self.shape(0, 2);
        let count: usize = shape.iter().product();
        let v: Vec<i64> = (0..count)
            .map(|_| {
                if self.chance(0.1) {
                    self.range(-3, n + 3)
                } else {
                    self.range(0, (n - 1).max(0))
                }
            })
            .collect();
        let h = if self.chance(0.5) {
            HostTensor::from_slice(&shape, &v).unwrap()
        } else {
            let v: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            HostTensor::from_slice(&shape, &v).unwrap()
        };
        self.fresh_with(h)
    }

    fn conv(&mut self) -> (Op, Vec<NodeId>) {
        let n = 1 + self.below(2);
        let dtype = self.choose(&[DType::F32, DType::F64]);
        let mut c = ConvAttrs::plain(n);
        let grouped = self.below(3);
        let groups = 1 + self.below(3);
        let (fg, bg) = match grouped {
            1 => (groups, 1),
            2 => (1, groups),
            _ => (1, 1),
        };
        c.feature_groups = fg;
        c.batch_groups = bg;
        let kin = 1 + self.below(3);
        let cin = kin * fg;
        let cout = fg * bg * (1 + self.below(2));
        let batch = bg * (1 + self.below(2));
        let mut xdims = vec![batch, cin];
        let mut kdims = vec![cout, kin];
        for i in 0..n {
            let x = 1 + self.below(6);
            let k = 1 + self.below(3);
            c.strides[i] = 1 + self.below(3);
            c.lhs_dilation[i] = if self.chance(0.2) { 2 } else { 1 };
            c.rhs_dilation[i] = if self.chance(0.2) { 2 } else { 1 };
            let xd = ((x - 1) * c.lhs_dilation[i] + 1) as i64;
            let kd = ((k - 1) * c.rhs_dilation[i] + 1) as i64;
            let lo = self.range(-1, 2);
            let mut hi = self.range(-1, 2);
            if xd + lo + hi < kd {
                hi = kd - xd - lo;
            }
            c.padding[i] = (lo, hi);
            xdims.push(x);
            kdims.push(k);
        }
        let x = self.of_type(&TensorType::new(dtype, xdims));
        let k = self.of_type(&TensorType::new(dtype, kdims));
        (Op::Conv(c), vec![x, k])
    }

    /// Adds `count` random ops; each kind from `kinds`. Returns the graph with every node as
    /// an output, the input values, and the kinds of the ops added.
    fn build(mut self, kinds: &[Kind], count: usize) -> Result<(Graph, Vec<HostTensor>), String> {
        for _ in 0..count {
            let k = self.choose(kinds);
            let (op, operands) = self.op(k);
            if let Op::Input(_) = op {
                continue;
            }
            let types: Vec<TensorType> = operands.iter().map(|&o| self.ty(o)).collect();
            let n = self.g.add(op.clone(), &operands).map_err(|e| {
                format!(
                    "generator: {op:?} on {types:?} is ill-typed: {e}\n{}",
                    self.g
                )
            })?;
            self.pool.push(n);
        }
        let outs: Vec<NodeId> = self.pool.clone();
        self.g.set_outputs(outs).map_err(|e| e.to_string())?;
        Ok((self.g, self.inputs))
    }
}

// ----- checking one graph ----------------------------------------------------------------------

/// Machine epsilon and smallest normal number of a float dtype (`None` for others).
fn float_params(d: DType) -> Option<(f64, f64)> {
    match d {
        DType::F32 => Some((f32::EPSILON as f64, f32::MIN_POSITIVE as f64)),
        DType::F64 => Some((f64::EPSILON, f64::MIN_POSITIVE)),
        DType::BF16 => Some((
            half::bf16::EPSILON.to_f64(),
            half::bf16::MIN_POSITIVE.to_f64(),
        )),
        DType::F16 => Some((
            half::f16::EPSILON.to_f64(),
            half::f16::MIN_POSITIVE.to_f64(),
        )),
        DType::Bool | DType::U32 | DType::I32 | DType::I64 => None,
    }
}

fn is_subnormal(v: f64, d: DType) -> bool {
    match float_params(d) {
        Some((_, tiny)) => v != 0.0 && v.abs() < tiny,
        None => false,
    }
}

/// How an op's float result is compared with the reference.
enum Tol {
    /// Same value (NaN where NaN; results below the smallest normal may be flushed to zero).
    Exact,
    /// `ulps` ulps of the result.
    Ulps(f64),
    /// `ulps` ulps of `|result| + |x f'(x)|` (the condition of a unary function at `x`), four
    /// times that for float64.
    Cond(f64, fn(f64) -> f64),
    /// `ulps` ulps of `|a^b| (1 + |b ln a|)`.
    Pow,
    /// A sum of `terms` terms: `2 (terms + 1)` ulps of the sum of absolute terms (`scale`).
    Sum { terms: usize },
}

fn tolerance(op: &Op, operand_types: &[&TensorType]) -> Tol {
    let prod = |v: &[usize]| v.iter().product::<usize>();
    match op {
        Op::Input(_)
        | Op::Constant(_)
        | Op::Iota { .. }
        | Op::Compare(_)
        | Op::Select
        | Op::Convert(_)
        | Op::Broadcast { .. }
        | Op::Reshape(_)
        | Op::Transpose(_)
        | Op::Slice { .. }
        | Op::Concat { .. }
        | Op::Pad { .. }
        | Op::Reverse(_)
        | Op::Take { .. }
        | Op::AllReduce(_)
        | Op::Barrier
        | Op::StopGradient => Tol::Exact,
        Op::Unary(u) => match u {
            UnaryOp::Neg
            | UnaryOp::Abs
            | UnaryOp::Floor
            | UnaryOp::Ceil
            | UnaryOp::Sign
            | UnaryOp::Not => Tol::Exact,
            UnaryOp::Sqrt => Tol::Ulps(2.0),
            UnaryOp::Exp => Tol::Cond(16.0, |x| (x * x.exp()).abs()),
            UnaryOp::Log => Tol::Cond(16.0, |_| 1.0),
            UnaryOp::Log1p => Tol::Cond(16.0, |x| (x / (1.0 + x)).abs()),
            UnaryOp::Rsqrt => Tol::Cond(16.0, |x| 0.5 / x.abs().sqrt()),
            UnaryOp::Tanh => Tol::Cond(16.0, |x| (x * (1.0 - x.tanh().powi(2))).abs()),
            UnaryOp::Logistic => Tol::Cond(16.0, |x| {
                let s = 1.0 / (1.0 + (-x).exp());
                (x * s * (1.0 - s)).abs()
            }),
            UnaryOp::Erf => Tol::Cond(16.0, |x| {
                (x * 2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp()).abs()
            }),
            UnaryOp::Sin => Tol::Cond(16.0, |x| (x * x.cos()).abs().max(x.abs() * 1e-3)),
            UnaryOp::Cos => Tol::Cond(16.0, |x| (x * x.sin()).abs().max(x.abs() * 1e-3)),
        },
        Op::Binary(b) => match b {
            BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Div => Tol::Ulps(2.0),
            BinaryOp::Pow => Tol::Pow,
            BinaryOp::Rem | BinaryOp::Max | BinaryOp::Min => Tol::Exact,
            BinaryOp::And
            | BinaryOp::Or
            | BinaryOp::Xor
            | BinaryOp::ShiftLeft
            | BinaryOp::ShiftRightLogical => Tol::Exact,
        },
        Op::Reduce { kind, axes } => match kind {
            ReduceKind::Sum => Tol::Sum {
                terms: axes
                    .iter()
                    .map(|&a| operand_types[0].shape.dim(a))
                    .product(),
            },
            ReduceKind::Max | ReduceKind::Min => Tol::Exact,
        },
        Op::ReduceWindow { kind, attrs } => match kind {
            ReduceKind::Sum => Tol::Sum {
                terms: prod(&attrs.window),
            },
            ReduceKind::Max | ReduceKind::Min => Tol::Exact,
        },
        Op::SelectAndScatter(attrs) => Tol::Sum {
            terms: prod(&attrs.window),
        },
        Op::DotGeneral(d) => Tol::Sum {
            terms: d
                .lhs_contract
                .iter()
                .map(|&a| operand_types[0].shape.dim(a))
                .product(),
        },
        Op::Conv(_) => Tol::Sum {
            terms: prod(&operand_types[1].shape.dims()[1..]),
        },
        // Each result element is a base element plus the updates sent to it (at most all).
        Op::ScatterAdd { .. } => Tol::Sum {
            terms: operand_types[2].shape.numel(),
        },
    }
}

fn is_elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Select | Op::Convert(_)
    )
}

/// The operands whose absolute values give the scale of a sum (`Tol::Sum`).
fn abs_operands(op: &Op) -> &'static [usize] {
    match op {
        Op::SelectAndScatter(_) => &[1],
        Op::ScatterAdd { .. } => &[0, 2],
        _ => &[0, 1],
    }
}

fn abs_host(h: &HostTensor) -> HostTensor {
    match h.ty().dtype {
        DType::F32 => {
            let v: Vec<f32> = h.to_vec::<f32>().unwrap().iter().map(|x| x.abs()).collect();
            HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
        }
        DType::F64 => {
            let v: Vec<f64> = h.to_vec::<f64>().unwrap().iter().map(|x| x.abs()).collect();
            HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
        }
        DType::BF16 => {
            let v: Vec<half::bf16> = h
                .to_vec::<half::bf16>()
                .unwrap()
                .iter()
                .map(|x| half::bf16::from_bits(x.to_bits() & 0x7fff))
                .collect();
            HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
        }
        DType::F16 => {
            let v: Vec<half::f16> = h
                .to_vec::<half::f16>()
                .unwrap()
                .iter()
                .map(|x| half::f16::from_bits(x.to_bits() & 0x7fff))
                .collect();
            HostTensor::from_slice(h.ty().shape.dims(), &v).unwrap()
        }
        // Sums of integers are exact: no scale needed.
        DType::Bool | DType::U32 | DType::I32 | DType::I64 => h.clone(),
    }
}

/// A graph applying `op` to fresh inputs of `types`.
fn one_op(op: &Op, types: &[&TensorType]) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<NodeId> = types
        .iter()
        .enumerate()
        .map(|(i, t)| g.add_input(InputKind::Data, format!("x{i}"), (*t).clone()))
        .collect();
    let y = g.add(op.clone(), &ids).unwrap();
    g.set_outputs(vec![y]).unwrap();
    g
}

/// Compares XLA's value of one node (`got`) with the eager interpreter's value of the op on
/// XLA's operand values (`want`).
///
/// `nan_ok`: a NaN from XLA is accepted where the reference is a number. Two places where XLA
/// legitimately differs on non-finite inputs: a convolution whose operands hold ±inf or NaN
/// (XLA multiplies padding zeros, and the other groups' masked-out terms of a batch-grouped
/// convolution, by them: `0 · inf = NaN`; libtorch skips both), and `log(pow(a, b))`, which
/// XLA's algebraic simplifier rewrites to `b · log|a|` (a number where `pow` is NaN).
fn compare_node(
    op: &Op,
    args: &[&HostTensor],
    got: &HostTensor,
    want: &HostTensor,
    nan_ok: bool,
) -> Result<(), String> {
    if got.ty() != want.ty() {
        return Err(format!(
            "type {} but the reference is {}",
            got.ty(),
            want.ty()
        ));
    }
    let dtype = want.ty().dtype;
    let n = want.ty().shape.numel();
    // Elements whose operands hold subnormal floats are skipped: XLA's CPU runtime treats
    // subnormal inputs as zero (denormals-are-zero), libtorch does not.
    let mut skip = vec![false; n];
    if is_elementwise(op) {
        for a in args {
            let d = a.ty().dtype;
            if d.is_float() {
                for (i, v) in a.to_f64_vec().into_iter().enumerate() {
                    if is_subnormal(v, d) {
                        skip[i] = true;
                    }
                }
            }
        }
    }
    let types: Vec<&TensorType> = args.iter().map(|a| a.ty()).collect();
    let Some((eps, tiny)) = float_params(dtype) else {
        let s = dtype.size_in_bytes();
        for (i, &skipped) in skip.iter().enumerate() {
            if !skipped && got.bytes()[i * s..(i + 1) * s] != want.bytes()[i * s..(i + 1) * s] {
                return Err(format!(
                    "element {i} is {}, expected {}",
                    got.to_f64_vec()[i],
                    want.to_f64_vec()[i]
                ));
            }
        }
        return Ok(());
    };
    let tol = tolerance(op, &types);
    let scale = match tol {
        Tol::Sum { .. } => {
            let idx = abs_operands(op);
            let abs: Vec<HostTensor> = args
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    if idx.contains(&i) {
                        abs_host(a)
                    } else {
                        (*a).clone()
                    }
                })
                .collect();
            let out = run_graph(&EagerBackend::new(), &one_op(op, &types), &abs)
                .map_err(|e| format!("reference scale: {e}"))?;
            Some(out[0].to_f64_vec())
        }
        _ => None,
    };
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let x0 = args.first().map(|a| a.to_f64_vec());
    let x1 = args.get(1).map(|a| a.to_f64_vec());
    for i in 0..n {
        if skip[i] {
            continue;
        }
        let (a, b) = (g[i], w[i]);
        let allowed = match &tol {
            Tol::Exact => tiny,
            Tol::Ulps(u) => u * eps * b.abs() + tiny,
            Tol::Cond(u, cond) => {
                let x = x0.as_ref().unwrap()[i];
                // XLA's float64 elementary functions are less exact than its float32 ones
                // relative to the precision: `log1p` near -0.4 is ~60 ulps off (found here).
                let u = if dtype == DType::F64 { 4.0 * u } else { *u };
                u * eps * (b.abs() + cond(x)) + tiny
            }
            Tol::Pow => {
                let (x, y) = (x0.as_ref().unwrap()[i], x1.as_ref().unwrap()[i]);
                16.0 * eps * b.abs() * (1.0 + (y * x.abs().ln()).abs()) + tiny
            }
            Tol::Sum { terms } => {
                let s = scale.as_ref().unwrap()[i];
                if !s.is_finite() {
                    // An infinite sum of absolute terms: overflow or inf - inf depends on the
                    // order of the additions.
                    continue;
                }
                2.0 * (*terms as f64 + 1.0) * eps * s + tiny
            }
        };
        let ok = if b.is_nan() || (nan_ok && a.is_nan()) {
            a.is_nan() || nan_ok
        } else if b.is_infinite() || a.is_infinite() {
            a == b || (allowed.is_infinite() || allowed.is_nan())
        } else {
            !a.is_nan() && ((a - b).abs() <= allowed || allowed.is_nan())
        };
        if !ok {
            return Err(format!(
                "element {i} is {a:e}, expected {b:e} (allowed difference {allowed:e})"
            ));
        }
    }
    Ok(())
}

/// Runs `g` (every node an output) on XLA (after kiln's simplification and the backend's
/// rewrite, as the runtime prepares graphs) and on the eager interpreter, and compares every
/// node's XLA value with the eager interpreter's value of that op on XLA's operand values.
fn check_graph(g: &Graph, inputs: &[HostTensor]) -> Result<(), String> {
    g.verify().map_err(|e| format!("verify: {e}"))?;
    let eager = EagerBackend::new();
    run_graph(&eager, g, inputs).map_err(|e| format!("eager interpreter: {e}"))?;
    let x: &XlaBackend = xla();
    let mut prepared = g.clone();
    kiln::passes::simplify(&mut prepared).map_err(|e| format!("simplify: {e}"))?;
    x.rewrite(&mut prepared)
        .map_err(|e| format!("xla rewrite: {e}"))?;
    prepared
        .verify()
        .map_err(|e| format!("verify after simplify + rewrite: {e}"))?;
    let got = run_graph(x, &prepared, inputs).map_err(|e| format!("xla: {e}"))?;
    if got.len() != g.outputs().len() {
        return Err(format!(
            "xla returned {} values for {} outputs",
            got.len(),
            g.outputs().len()
        ));
    }
    // Every node is an output: node -> its XLA value.
    let value = |n: NodeId| -> &HostTensor {
        let i = g.outputs().iter().position(|&o| o == n).unwrap();
        &got[i]
    };
    for (i, &n) in g.outputs().iter().enumerate() {
        let node = g.node(n);
        if let Op::Input(j) = node.op {
            if got[i].bytes() != inputs[j].bytes() {
                return Err(format!("input {j} came back changed"));
            }
            continue;
        }
        let args: Vec<&HostTensor> = node.operands.iter().map(|&o| value(o)).collect();
        let types: Vec<&TensorType> = args.iter().map(|a| a.ty()).collect();
        let want = run_graph(
            &eager,
            &one_op(&node.op, &types),
            &args.iter().map(|a| (*a).clone()).collect::<Vec<_>>(),
        )
        .map_err(|e| format!("eager {:?} on {types:?}: {e}", node.op))?;
        let nonfinite = args
            .iter()
            .any(|a| a.ty().dtype.is_float() && a.to_f64_vec().iter().any(|v| !v.is_finite()));
        let log_of_pow = matches!(node.op, Op::Unary(UnaryOp::Log))
            && matches!(g.node(node.operands[0]).op, Op::Binary(BinaryOp::Pow));
        let nan_ok = (matches!(node.op, Op::Conv(_)) && nonfinite) || log_of_pow;
        compare_node(&node.op, &args, &got[i], &want[0], nan_ok).map_err(|e| {
            format!(
                "node {n:?} = {:?} on {}: {e}\noperands: {:?}",
                node.op,
                types
                    .iter()
                    .map(|t| t.to_string())
                    .collect::<Vec<_>>()
                    .join(", "),
                args.iter()
                    .map(|a| {
                        let v = a.to_f64_vec();
                        format!("{:?}", &v[..v.len().min(16)])
                    })
                    .collect::<Vec<_>>()
            )
        })?;
    }
    Ok(())
}

/// The first line of each libtorch error (its C++ backtrace is noise here).
fn short(e: String) -> String {
    e.lines()
        .filter(|l| !l.starts_with("Exception raised from") && !l.starts_with("frame #"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Builds the graph for `seed` and checks it; panics are caught and reported with the case.
fn fuzz_graph(seed: u64, ops: usize, kinds: &[Kind]) -> Result<Graph, String> {
    let r = catch_unwind(AssertUnwindSafe(|| {
        let (g, inputs) = Gen::new(seed).build(kinds, ops)?;
        check_graph(&g, &inputs).map_err(|e| format!("{}\ngraph:\n{g}", short(e)))?;
        Ok(g)
    }));
    match r {
        Ok(r) => r,
        Err(p) => Err(format!(
            "panic: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default()
        )),
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// Random well-typed graphs of 1 to 8 ops over the whole op set.
    #[test]
    fn random_graphs_match_the_eager_interpreter(seed in any::<u64>(), ops in 1usize..9) {
        let kinds = all_kinds();
        let r = fuzz_graph(seed, ops, &kinds);
        prop_assert!(r.is_ok(), "seed {seed}, {ops} ops: {}", r.unwrap_err());
    }
}

/// Every kind, generated on its own (a few seeds each): the generator can build every op, and
/// each passes the check. This is what forces a new `Op` variant to get a generator.
#[test]
fn generator_covers_every_op() {
    let kinds = all_kinds();
    let mut failures = Vec::new();
    for &k in &kinds {
        for seed in 0..4 {
            match fuzz_graph(seed, 1, &[k]) {
                Ok(g) => {
                    if k != Kind::Input {
                        let last = *g.outputs().last().unwrap();
                        assert_eq!(kind_of(&g.node(last).op), k, "seed {seed}");
                    }
                }
                Err(e) => failures.push(format!("{k:?} seed {seed}: {e}")),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

// ----- random calls of the public tensor operations ------------------------------------------

/// Random arguments for one call: small integers (some out of range, some negative, some zero
/// where zero is invalid), shapes, a dtype, floats and flags.
#[derive(Clone, Debug)]
struct Args {
    op: usize,
    ints: Vec<i64>,
    shape: Vec<usize>,
    dtype: DType,
    float: f64,
    flags: [bool; 2],
}

fn args_strategy() -> impl Strategy<Value = Args> {
    (
        0usize..NUM_CALLS,
        prop::collection::vec(-3i64..6, 8),
        prop::collection::vec(0usize..5, 0..5),
        prop::sample::select(DType::ALL.to_vec()),
        prop::sample::select(vec![0.0, 0.5, -1.0, 1.5, f64::NAN, 1e-5]),
        any::<[bool; 2]>(),
    )
        .prop_map(|(op, ints, shape, dtype, float, flags)| Args {
            op,
            ints,
            shape,
            dtype,
            float,
            flags,
        })
}

/// A tensor type for a call's input: any dtype, rank 0 to 4, dims 0 to 4 (mostly 1 to 4).
fn input_type() -> impl Strategy<Value = TensorType> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::collection::vec(prop::sample::select(vec![0usize, 1, 2, 2, 3, 3, 4]), 0..5),
    )
        .prop_map(|(d, s)| TensorType::new(d, s))
}

const NUM_CALLS: usize = 88;

/// Call number `a.op` of the public API on `x` (three tensors), with `a`'s arguments.
fn call(a: &Args, x: &[kiln::Tensor]) -> kiln::Result<Vec<kiln::Tensor>> {
    use kiln::Tensor as T;
    let i = |k: usize| a.ints[k];
    let u = |k: usize| a.ints[k].max(0) as usize;
    let is = |k: usize| a.ints[k] as isize;
    let dims: Vec<isize> = a.ints[..(u(7) % 4)].iter().map(|&v| v as isize).collect();
    let udims: Vec<usize> = a.ints[..(u(7) % 5)]
        .iter()
        .map(|&v| v.max(0) as usize)
        .collect();
    let sh: Vec<isize> = a.shape.iter().map(|&v| v as isize).collect();
    let (x0, x1, x2) = (&x[0], &x[1], &x[2]);
    let one = |t: kiln::Result<T>| t.map(|t| vec![t]);
    match a.op {
        0 => one(x0.add(x1)),
        1 => one(x0.sub(x1)),
        2 => one(x0.mul(x1)),
        3 => one(x0.div(x1)),
        4 => one(x0.rem(x1)),
        5 => one(x0.pow(x1)),
        6 => one(x0.maximum(x1)),
        7 => one(x0.minimum(x1)),
        8 => one(x0.and(x1)),
        9 => one(x0.or(x1)),
        10 => one(x0.xor(x1)),
        11 => one(x0.shift_left(x1)),
        12 => one(x0.shift_right_logical(x1)),
        13 => one(x0.eq(x1)),
        14 => one(x0.ne(x1)),
        15 => one(x0.lt(x1)),
        16 => one(x0.le(x1)),
        17 => one(x0.gt(x1)),
        18 => one(x0.ge(x1)),
        19 => one(x0.select(x1, x2)),
        20 => one(x0.neg()),
        21 => one(x0.abs()),
        22 => one(x0.exp()),
        23 => one(x0.log()),
        24 => one(x0.log1p()),
        25 => one(x0.sqrt()),
        26 => one(x0.rsqrt()),
        27 => one(x0.tanh()),
        28 => one(x0.sigmoid()),
        29 => one(x0.erf()),
        30 => one(x0.sin()),
        31 => one(x0.cos()),
        32 => one(x0.floor()),
        33 => one(x0.ceil()),
        34 => one(x0.sign()),
        35 => one(x0.not()),
        36 => one(x0.square()),
        37 => one(x0.recip()),
        38 => one(x0.to_dtype(a.dtype)),
        39 => one(x0.broadcast_to(&a.shape)),
        40 => one(x0.broadcast_in_dim(&a.shape, &udims)),
        41 => one(x0.reshape(
            &sh.iter()
                .map(|&v| if v == 4 { -1 } else { v })
                .collect::<Vec<_>>(),
        )),
        42 => one(x0.flatten(is(0), is(1))),
        43 => one(x0.unsqueeze(is(0))),
        44 => one(x0.squeeze(is(0))),
        45 => one(x0.permute(&udims)),
        46 => one(x0.transpose(is(0), is(1))),
        47 => one(x0.t()),
        48 => one(x0.slice(is(0), u(1), u(2), u(3))),
        49 => one(x0.narrow(is(0), u(1), u(2))),
        50 => one(T::cat(&[x0.clone(), x1.clone()], is(0))),
        51 => one(T::stack(&[x0.clone(), x1.clone()], is(0))),
        52 => one(x0.pad(&a.ints[..u(5) % 4], &a.ints[4..4 + u(6) % 4], a.float)),
        53 => one(x0.flip(&dims)),
        54 => one(x0.take(x1, is(0))),
        55 => one(x0.sum(&dims, a.flags[0])),
        56 => one(x0.max(&dims, a.flags[0])),
        57 => one(x0.min(&dims, a.flags[0])),
        58 => one(x0.mean(&dims, a.flags[0])),
        59 => one(x0.var(&dims, a.flags[1], a.flags[0])),
        60 => one(x0.sum_all()),
        61 => one(x0.mean_all()),
        62 => {
            let d = DotDims {
                lhs_batch: a.ints[..u(5) % 2]
                    .iter()
                    .map(|&v| v.max(0) as usize)
                    .collect(),
                rhs_batch: a.ints[2..2 + u(6) % 2]
                    .iter()
                    .map(|&v| v.max(0) as usize)
                    .collect(),
                lhs_contract: vec![u(0)],
                rhs_contract: vec![u(1)],
            };
            one(x0.dot_general(x1, d))
        }
        63 => one(x0.matmul(x1)),
        64 => one(x0.linear(x1, a.flags[0].then_some(x2))),
        65 => one(x0.relu()),
        66 => one(x0.softmax(is(0))),
        67 => one(x0.log_softmax(is(0))),
        68 => one(x0.conv2d(
            x1,
            a.flags[0].then_some(x2),
            [u(0), u(1)],
            [u(2), u(3)],
            [u(4), u(5)],
            u(6),
        )),
        69 => one(x0.max_pool2d([u(0), u(1)], [u(2), u(3)], [u(4), u(5)], a.flags[0])),
        70 => one(x0.avg_pool2d(
            [u(0), u(1)],
            [u(2), u(3)],
            [u(4), u(5)],
            a.flags[0],
            a.flags[1],
        )),
        71 => one(x0.adaptive_avg_pool2d([u(0), u(1)])),
        72 => one(x0.batch_norm(
            a.flags[0].then_some(x1),
            a.flags[0].then_some(x1),
            a.flags[1].then_some(x2),
            a.flags[1].then_some(x2),
            false,
            0.1,
            1e-5,
        )),
        73 => one(x0.layer_norm(
            &a.shape,
            a.flags[0].then_some(x1),
            a.flags[1].then_some(x2),
            1e-5,
        )),
        74 => one(x0.gelu(a.flags[0])),
        75 => one(x0.silu()),
        76 => one(x0.hardswish()),
        77 => one(x0.leaky_relu(a.float)),
        78 => one(x0.cross_entropy(x1)),
        79 => one(x0.mse_loss(x1)),
        80 => one(T::embedding(x0, x1)),
        81 => one(x0.clamp(a.float, i(0) as f64)),
        82 => one(x0.add_scalar(a.float)),
        83 => one(x0.pow_scalar(a.float)),
        84 => one(T::constant(
            TensorType::new(a.dtype, a.shape.as_slice()),
            vec![1u8; u(0) * 4],
        )),
        85 => one(T::full(&a.shape, a.float, a.dtype)),
        86 => one(T::arange(u(0), a.dtype)),
        87 => one(T::scaled_dot_product_attention(
            x0, x1, x2, None, 0.0, false,
        )),
        _ => unreachable!("op index below NUM_CALLS"),
    }
}

/// A panic's message.
fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Runs one call eagerly and traced: no panic, and both agree on success and on the result
/// types.
fn check_call(a: &Args, types: &[TensorType], seed: u64) -> Result<(), String> {
    let mut g = Gen::new(seed);
    let hosts: Vec<HostTensor> = types.iter().map(|t| g.data(t)).collect();
    let eager = catch_unwind(AssertUnwindSafe(|| {
        let xs: Vec<kiln::Tensor> = hosts
            .iter()
            .map(|h| kiln::Tensor::from_host(h).unwrap())
            .collect();
        call(a, &xs).map(|ys| ys.iter().map(|y| y.ty().clone()).collect::<Vec<_>>())
    }))
    .map_err(|p| format!("eager call panicked: {}", panic_message(p)))?;
    let traced = catch_unwind(AssertUnwindSafe(|| {
        kiln::trace(types, |xs| call(a, xs))
            .map(|t| t.graph.output_types()[..t.num_outputs].to_vec())
    }))
    .map_err(|p| format!("traced call panicked: {}", panic_message(p)))?;
    let empty = |ts: &[TensorType]| ts.iter().any(|t| t.shape.numel() == 0);
    match (&eager, &traced) {
        (Ok(e), Ok(t)) if e != t => Err(format!("eager gives {e:?}, traced {t:?}")),
        // libtorch's pooling rejects empty channel or batch dims that the traced ops handle
        // (an empty result).
        (Err(kiln::Error::Torch(_)), Ok(t)) if empty(t) && matches!(a.op, 69 | 70) => Ok(()),
        // Ids or targets out of range: libtorch's embedding and cross-entropy fail on the
        // data, the traced ones clamp or match no class (data-dependent, not a type error).
        (Err(kiln::Error::Torch(_)), Ok(_)) if matches!(a.op, 78 | 80) => Ok(()),
        (Ok(e), Err(t)) => Err(format!(
            "eager gives {e:?}, traced fails: {}",
            short(t.to_string())
        )),
        (Err(e), Ok(t)) => Err(format!(
            "eager fails: {}; traced gives {t:?}",
            short(e.to_string())
        )),
        _ => Ok(()),
    }
}

proptest! {
    #![proptest_config(config(1024))]

    /// Random (mostly ill-typed) calls of the public tensor operations never panic, and
    /// eager and traced agree.
    #[test]
    fn random_calls_fail_cleanly(a in args_strategy(), types in prop::collection::vec(input_type(), 3), seed in any::<u64>()) {
        let r = check_call(&a, &types, seed);
        prop_assert!(r.is_ok(), "call {} with {a:?} on {}: {}", a.op,
            types.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", "), r.unwrap_err());
    }
}

/// Exploration, by hand: every call number on `KILN_FUZZ_CASES` random argument sets (default
/// 200 each), printing every failure (`-- --ignored --nocapture explore_calls`).
#[test]
#[ignore]
fn explore_calls() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let strat = (
        args_strategy(),
        prop::collection::vec(input_type(), 3),
        any::<u64>(),
    );
    let mut failures = 0;
    let n = cases(200);
    for op in 0..NUM_CALLS {
        for _ in 0..n {
            let (mut a, types, seed) = strat.new_tree(&mut runner).unwrap().current();
            a.op = op;
            if let Err(e) = check_call(&a, &types, seed) {
                failures += 1;
                println!(
                    "---- call {op} with {a:?} on {}: {e}",
                    types
                        .iter()
                        .map(|t| t.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
    }
    println!("{failures} of {} calls failed", n as usize * NUM_CALLS);
}

/// Exploration, by hand: runs `KILN_FUZZ_CASES` random graphs (default 1000) of up to
/// `KILN_FUZZ_MAX_OPS` ops (default 8) and prints every failure instead of stopping at the
/// first (`-- --ignored --nocapture explore_random_graphs`).
#[test]
#[ignore]
fn explore_random_graphs() {
    let kinds = all_kinds();
    let mut failures = 0;
    let n = cases(1000) as u64;
    // `KILN_FUZZ_MAX_OPS`: longer graphs (default 8 ops at most).
    let max_ops: u64 = std::env::var("KILN_FUZZ_MAX_OPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    for seed in 0..n {
        let ops = 1 + (seed % max_ops) as usize;
        if let Err(e) = fuzz_graph(seed, ops, &kinds) {
            failures += 1;
            println!("---- seed {seed}, {ops} ops: {e}");
        }
    }
    println!("{failures} of {n} graphs failed");
}

// ----- regressions: failures the fuzzers found ---------------------------------------------------

/// A graph of `op` on inputs with the given values, every node an output, through
/// [`check_graph`].
fn check_one(op: Op, inputs: Vec<HostTensor>) -> Result<(), String> {
    let mut g = Graph::new();
    let ids: Vec<NodeId> = inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.add_input(InputKind::Data, format!("x{i}"), h.ty().clone()))
        .collect();
    let y = g.add(op, &ids).map_err(|e| e.to_string())?;
    let mut outs = ids.clone();
    outs.push(y);
    g.set_outputs(outs).unwrap();
    check_graph(&g, &inputs).map_err(short)
}

fn empty(d: DType, shape: &[usize]) -> HostTensor {
    HostTensor::from_bytes(TensorType::new(d, shape), Vec::new()).unwrap()
}

/// XLA lowering wrote an empty constant as `dense<[]>`, whose shape is `[0]`: compiling
/// `bool[0,4,4]` failed ("inferred shape of elements literal ([0]) does not match type").
#[test]
fn regression_empty_constant_compiles() {
    for d in [DType::Bool, DType::F32, DType::I64] {
        let lit = Literal::from_bytes(TensorType::new(d, [0usize, 4, 4]), Vec::new()).unwrap();
        check_one(Op::Constant(lit), vec![]).unwrap();
    }
}

/// `take` from an empty axis: a non-empty result has nothing to take (now a type error; the
/// eager interpreter failed inside libtorch, XLA's gather had no valid slice size), an empty
/// one runs on both backends (XLA's lowering failed: "slice size (1) is out of bounds").
#[test]
fn regression_take_from_an_empty_axis() {
    let idx = HostTensor::from_slice(&[], &[0i64]).unwrap();
    let e = check_one(Op::Take { axis: 0 }, vec![empty(DType::Bool, &[0]), idx]).unwrap_err();
    assert!(e.contains("take") && e.contains("empty"), "{e}");
    check_one(
        Op::Take { axis: 0 },
        vec![empty(DType::Bool, &[0]), empty(DType::I64, &[0])],
    )
    .unwrap();
    // Empty through another dim: [3, 4, 0] from a [0, 4, 0]... axis 2 is empty, result empty.
    let idx = HostTensor::from_slice(&[2], &[1i32, 5]).unwrap();
    check_one(Op::Take { axis: 0 }, vec![empty(DType::F32, &[3, 0]), idx]).unwrap();
}

/// `scatter_add` into an empty base, or of no updates: the eager interpreter failed inside
/// libtorch's `index_add` ("index out of range in self").
#[test]
fn regression_scatter_add_with_nothing_to_add() {
    let idx = HostTensor::from_slice(&[], &[0i64]).unwrap();
    let upd = HostTensor::from_slice(&[], &[1.5f32]).unwrap();
    check_one(
        Op::ScatterAdd { axis: 0 },
        vec![empty(DType::F32, &[0]), idx, upd],
    )
    .unwrap();
    let base = HostTensor::from_slice(&[3], &[1i32, 2, 3]).unwrap();
    check_one(
        Op::ScatterAdd { axis: 0 },
        vec![base, empty(DType::I64, &[0]), empty(DType::I32, &[0])],
    )
    .unwrap();
}

/// `select_and_scatter` on an empty operand: the eager interpreter failed reshaping to
/// `[N, C, -1]` ("the unspecified dimension size -1 can be any value").
#[test]
fn regression_select_and_scatter_on_empty_operands() {
    let attrs = WindowAttrs {
        window: vec![3],
        strides: vec![1],
        padding: vec![(0, 1)],
    };
    check_one(
        Op::SelectAndScatter(attrs),
        vec![empty(DType::F64, &[4, 0, 2]), empty(DType::F64, &[4, 0, 1])],
    )
    .unwrap();
}

/// Public ops that panicked (index out of bounds, slice start > end) or that eager mode
/// accepted while tracing rejected them.
#[test]
fn regression_public_ops_fail_cleanly() {
    use kiln::Tensor as T;
    let scalar = || T::scalar(2.0, DType::F32).unwrap();
    let ints = || T::arange(4, DType::I64).unwrap().reshape(&[2, 2]).unwrap();
    let run = |name: &str, f: &dyn Fn(&[T]) -> kiln::Result<Vec<T>>, xs: Vec<T>, ok: bool| {
        let types: Vec<TensorType> = xs.iter().map(|x| x.ty().clone()).collect();
        let eager = catch_unwind(AssertUnwindSafe(|| f(&xs).map(|_| ())))
            .unwrap_or_else(|p| panic!("{name}: eager panicked: {}", panic_message(p)));
        let traced = catch_unwind(AssertUnwindSafe(|| kiln::trace(&types, f).map(|_| ())))
            .unwrap_or_else(|p| panic!("{name}: traced panicked: {}", panic_message(p)));
        assert_eq!(eager.is_ok(), ok, "{name} eager: {eager:?}");
        assert_eq!(traced.is_ok(), ok, "{name} traced: {traced:?}");
    };
    // Dim 0 of a scalar: reductions and squeeze accept it as PyTorch does; slicing fails.
    run(
        "mean",
        &|x| Ok(vec![x[0].mean(&[0], false)?]),
        vec![scalar()],
        true,
    );
    run(
        "var",
        &|x| Ok(vec![x[0].var(&[0], true, false)?]),
        vec![scalar()],
        true,
    );
    run(
        "squeeze",
        &|x| Ok(vec![x[0].squeeze(0)?]),
        vec![scalar()],
        true,
    );
    run(
        "transpose",
        &|x| Ok(vec![x[0].transpose(0, 0)?]),
        vec![scalar()],
        true,
    );
    run(
        "narrow",
        &|x| Ok(vec![x[0].narrow(0, 0, 1)?]),
        vec![scalar()],
        false,
    );
    run(
        "slice",
        &|x| Ok(vec![x[0].slice(0, 0, 1, 1)?]),
        vec![scalar()],
        false,
    );
    // Start after end.
    run(
        "flatten",
        &|x| Ok(vec![x[0].flatten(1, 0)?]),
        vec![ints()],
        false,
    );
    // Integer softmax, boolean matmul, mixed-dtype linear: eager used to compute them.
    run(
        "softmax",
        &|x| Ok(vec![x[0].softmax(1)?]),
        vec![ints()],
        false,
    );
    run(
        "log_softmax",
        &|x| Ok(vec![x[0].log_softmax(1)?]),
        vec![ints()],
        false,
    );
    let b = || ints().ne(&ints()).unwrap();
    run(
        "matmul",
        &|x| Ok(vec![x[0].matmul(&x[1])?]),
        vec![b(), b()],
        false,
    );
    let f = || T::randn(&[2, 2], 0).unwrap();
    let f64s = || f().to_dtype(DType::F64).unwrap();
    run(
        "linear",
        &|x| Ok(vec![x[0].linear(&x[1], None)?]),
        vec![f(), f64s()],
        false,
    );
    run(
        "linear bias",
        &|x| Ok(vec![x[0].linear(&x[1], Some(&x[2]))?]),
        vec![f(), f(), f64s()],
        false,
    );
    // Adaptive pooling of an empty image.
    let img = || T::zeros(&[2, 1, 0, 2], DType::F64).unwrap();
    run(
        "adaptive_avg_pool2d",
        &|x| Ok(vec![x[0].adaptive_avg_pool2d([5, 4])?]),
        vec![img()],
        false,
    );
}

/// Random graphs that failed while the fuzzer was developed (seed, op count; with this
/// generator): batch-grouped convolutions with infinite operands (574, 668, 731, 972),
/// `log(pow(..))` rewritten by XLA (951), float64 `log1p` accuracy (1166, 1467), empty
/// select-and-scatter operands (100, 145, 157, 207, 284, 310) and takes (54, 70).
#[test]
fn regression_graph_seeds() {
    let kinds = all_kinds();
    let found: [(u64, usize); 16] = [
        (54, 7),
        (70, 7),
        (100, 5),
        (145, 2),
        (157, 6),
        (207, 8),
        (284, 5),
        (310, 7),
        (574, 7),
        (668, 5),
        (731, 4),
        (951, 8),
        (972, 5),
        (1166, 7),
        (1467, 4),
        (2355856507445098718, 2),
    ];
    let failures: Vec<String> = found
        .iter()
        .filter_map(|&(seed, ops)| {
            fuzz_graph(seed, ops, &kinds)
                .err()
                .map(|e| format!("seed {seed}: {e}"))
        })
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
