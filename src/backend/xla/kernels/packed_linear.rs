//! The packed linear ([`PACKED_LINEAR_TARGET`]): `x · Wᵀ` (a torch `Linear` layout) on a
//! frozen f32 weight, run by oneDNN's matrix product with the weight packed once
//! ([`super::weights`]) and its epilogue fused, as PyTorch's inductor runs frozen CPU
//! linears (`mkldnn::_linear_pointwise`).
//!
//! In the graph, a dot and the elementwise ops after it become one call when they have this
//! shape, each step optional, in this order:
//!
//! ```text
//! y = dot(x[.., K], W[N, K]) contracting K      W: a variable the program never updates
//! y = y + broadcast(bias[N])
//! y = y + residual                               any tensor of y's type (then no activation)
//! y = max(y, 0)  |  gelu(y)                      GELU as kiln traces it: y·(erf(y/√2)+1)·½
//! ```
//!
//! Two such chains in a row, the second reading the first's result alone (a transformer's
//! feed-forward block), run as one call: the first's result stays libtorch's tensor instead
//! of being copied into XLA's buffer and read back (see [`packed_linear_chain_of`]; bert's
//! inference on a 2-vCPU AMD EPYC Zen 4, one process alternating, ms, paired / not: 11.97 /
//! 12.19, 11.90 / 12.13, 11.14 / 11.31, 11.38 / 11.65, 11.84 / 12.12, once 13.20 / 12.67).
//!
//! `W` must be the variable itself (a graph input), so XLA computes nothing from it per
//! call; the frozen-variable rules are the packed convolution's (see [`super::packed`]).
//! Products of at most [`TINY_DOT_MAX_FLOPS`](super::TINY_DOT_MAX_FLOPS) stay with the dot
//! kernel's own loop, which costs less than a oneDNN call.
//!
//! Why: on a 2-vCPU AMD EPYC (Zen 5), µs, libtorch's `linear` (MKL) / oneDNN on the packed
//! weight: `[260, 256]·[768, 256]ᵀ` 584 / 277, `[260, 1024]·[256, 1024]ᵀ` 749 / 335,
//! `[4, 256]·[1000, 256]ᵀ` 56 / 27, `[4, 25088]·[4096, 25088]ᵀ` 41,016 / 10,419; with GELU
//! fused the product costs what it does without. Without AVX-512 the many-row ones gain
//! nothing, and [`FfiMode::Auto`](super::FfiMode::Auto) leaves them to XLA
//! ([`auto_packed_linear`](super::FfiMode::auto_packed_linear)).

use super::onednn::{self, Activation};
use super::packed::{frozen_sources, other_operand, single_user, splat};
use super::weights::{self, WeightKey};
use super::SERIAL_ATTR;
use super::{torch_lock, DotPlan, FfiLowering};
use crate::backend::xla::pjrt::ffi::{BufferRef, Call, FfiKernel};
use crate::backend::xla::pjrt::handoff;
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, UnaryOp};
use std::collections::HashSet;

/// The custom call target of the packed linear.
pub const PACKED_LINEAR_TARGET: &str = "kiln_linear_packed_v1";

/// A dot and its fused epilogue (see the module notes).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PackedLinear {
    pub dot: NodeId,
    pub x: NodeId,
    pub weight: NodeId,
    pub bias: Option<NodeId>,
    pub residual: Option<NodeId>,
    pub act: Activation,
    /// The last node of the chain: the call stands for it.
    pub tail: NodeId,
    /// The chain's other nodes (the dot first): nothing is emitted for them.
    pub absorbed: Vec<NodeId>,
    /// The packed linear whose result is `x` and is read by nothing else, run in the same
    /// call (see [`packed_linear_chain_of`]); its nodes are absorbed too.
    pub pre: Option<Box<PackedLinear>>,
}

/// If `b` broadcasts an `[N]` vector along the last dim of its result, that vector.
fn per_last(g: &Graph, b: NodeId) -> Option<NodeId> {
    let n = g.node(b);
    let Op::Broadcast { shape, dims } = &n.op else {
        return None;
    };
    let r = shape.rank();
    let v = n.operands[0];
    (r >= 1 && dims[..] == [r - 1] && g.node(v).ty.shape.dims() == [shape.dim(r - 1)]).then_some(v)
}

/// If `y`'s users compute kiln's traced GELU of it, `y · (erf(y · 1/√2) + 1) · ½`: its nodes
/// (the four before the result) and the result.
fn gelu_of(g: &Graph, y: NodeId) -> Option<([NodeId; 4], NodeId)> {
    if g.outputs().contains(&y) {
        return None;
    }
    let users = g.users(y);
    let [u0, u1] = users[..] else {
        return None;
    };
    let near = |v: Option<f64>, want: f64| v.is_some_and(|v| (v - want).abs() <= 1e-6 * want);
    // m1 = y · 1/√2, then erf, then + 1.
    let is_scale = |m: NodeId| {
        other_operand(g, m, y, BinaryOp::Mul)
            .is_some_and(|c| near(splat(g, c), std::f64::consts::FRAC_1_SQRT_2))
    };
    let (m1, m2) = if is_scale(u0) { (u0, u1) } else { (u1, u0) };
    if !is_scale(m1) {
        return None;
    }
    let e = single_user(g, m1)?;
    if !matches!(g.node(e).op, Op::Unary(UnaryOp::Erf)) {
        return None;
    }
    let a = single_user(g, e)?;
    if !other_operand(g, a, e, BinaryOp::Add).is_some_and(|c| near(splat(g, c), 1.0)) {
        return None;
    }
    // m2 = y · a, then · ½.
    if single_user(g, a) != Some(m2) || other_operand(g, m2, y, BinaryOp::Mul) != Some(a) {
        return None;
    }
    let out = single_user(g, m2)?;
    other_operand(g, out, m2, BinaryOp::Mul)
        .is_some_and(|c| near(splat(g, c), 0.5))
        .then_some(([m1, e, a, m2], out))
}

/// Can dot node `id` run as a packed linear, and with which epilogue? `None` if not (see
/// the module notes), or packed kernels are switched off
/// ([`super::packed_conv_enabled`]).
pub(crate) fn packed_linear(g: &Graph, id: NodeId) -> Option<PackedLinear> {
    if !super::packed_conv_enabled() {
        return None;
    }
    let n = g.node(id);
    let Op::DotGeneral(d) = &n.op else {
        return None;
    };
    let [x, w] = n.operands[..] else {
        return None;
    };
    let (xt, wt) = (&g.node(x).ty, &g.node(w).ty);
    let r = xt.shape.rank();
    let eligible = xt.dtype == DType::F32
        && wt.dtype == DType::F32
        && r >= 2
        && wt.shape.rank() == 2
        && d.lhs_batch.is_empty()
        && d.rhs_batch.is_empty()
        && d.lhs_contract == [r - 1]
        && d.rhs_contract == [1]
        && n.ty.shape.numel() > 0
        && matches!(g.node(w).op, Op::Input(_));
    if !eligible {
        return None;
    }
    let tiny =
        DotPlan::new(d, &xt.shape.to_i64(), &wt.shape.to_i64()).is_ok_and(|p| p.tiny().is_some());
    let mut sources = Vec::new();
    if tiny || !frozen_sources(g, w, &mut HashSet::new(), &mut sources) {
        return None;
    }
    let mut p = PackedLinear {
        dot: id,
        x,
        weight: w,
        bias: None,
        residual: None,
        act: Activation::None,
        tail: id,
        absorbed: Vec::new(),
        pre: None,
    };
    let ty = n.ty.clone();
    let mut stage = 0;
    loop {
        let cur = p.tail;
        if stage < 2 {
            // A GELU reads `y` twice: it is looked for before the single-user steps.
            if let Some((nodes, out)) = gelu_of(g, cur) {
                p.absorbed.push(cur);
                p.absorbed.extend(nodes);
                p.tail = out;
                p.act = Activation::Gelu;
                break;
            }
        }
        let Some(u) = single_user(g, cur) else { break };
        if stage < 1 {
            if let Some(b) = other_operand(g, u, cur, BinaryOp::Add).and_then(|b| per_last(g, b)) {
                p.bias = Some(b);
                p.absorbed.push(cur);
                p.tail = u;
                stage = 1;
                continue;
            }
        }
        if stage < 2 {
            let residual = other_operand(g, u, cur, BinaryOp::Add)
                .filter(|&o| g.node(o).ty == ty && per_last(g, o).is_none());
            if let Some(o) = residual {
                p.residual = Some(o);
                p.absorbed.push(cur);
                p.tail = u;
                break;
            }
            let relu = other_operand(g, u, cur, BinaryOp::Max).and_then(|z| splat(g, z));
            if relu == Some(0.0) {
                p.absorbed.push(cur);
                p.tail = u;
                p.act = Activation::Relu;
            }
        }
        break;
    }
    Some(p)
}

/// If node `id` belongs to a packed linear's chain whose dot `picks` accepts, that chain,
/// paired with its neighbour where two such chains follow each other alone.
///
/// A pair is two chains `a` and `b` where `b`'s input `x` is `a`'s result and nothing else
/// reads it (a transformer's feed-forward block: `fc2(gelu(fc1(x)))`), `a` has no residual,
/// and neither has another such neighbour (three in a row stay single). Both run in one call
/// (`b` with `pre = a`): `a`'s result stays a libtorch tensor instead of being copied into
/// a buffer of XLA's and read back (see [`PackedLinearKernel`]).
pub(crate) fn packed_linear_chain_of(
    g: &Graph,
    id: NodeId,
    picks: &dyn Fn(NodeId) -> bool,
) -> Option<PackedLinear> {
    let p = single_chain_of(g, id, picks)?;
    if let Some(mut b) = consumer(g, &p, picks) {
        if producer(g, &p, picks).is_none() && consumer(g, &b, picks).is_none() {
            b.pre = Some(Box::new(p));
            return Some(b);
        }
        return Some(p);
    }
    match producer(g, &p, picks) {
        Some(a) if producer(g, &a, picks).is_none() => Some(PackedLinear {
            pre: Some(Box::new(a)),
            ..p
        }),
        _ => Some(p),
    }
}

/// The picked chain whose result is `p`'s input and is read by `p` alone, if it has no
/// residual.
fn producer(g: &Graph, p: &PackedLinear, picks: &dyn Fn(NodeId) -> bool) -> Option<PackedLinear> {
    if g.outputs().contains(&p.x) || g.users(p.x)[..] != [p.dot] {
        return None;
    }
    single_chain_of(g, p.x, picks).filter(|a| a.tail == p.x && a.residual.is_none())
}

/// The picked chain whose input is `p`'s result, if nothing else reads it.
fn consumer(g: &Graph, p: &PackedLinear, picks: &dyn Fn(NodeId) -> bool) -> Option<PackedLinear> {
    if p.residual.is_some() {
        return None;
    }
    let u = single_user(g, p.tail)?;
    packed_linear(g, u).filter(|b| b.x == p.tail && picks(b.dot))
}

/// The single (unpaired) chain `id` belongs to, as [`packed_linear_chain_of`] without the
/// pairing.
fn single_chain_of(g: &Graph, id: NodeId, picks: &dyn Fn(NodeId) -> bool) -> Option<PackedLinear> {
    if !super::packed_conv_enabled() {
        return None;
    }
    // Back from an epilogue node to its dot: through the bias, the residual sum, the ReLU,
    // or the GELU's nodes (at most 6 steps).
    let mut frontier = vec![id];
    let mut seen = HashSet::new();
    for _ in 0..=6 {
        let mut next = Vec::new();
        for cur in frontier {
            if !seen.insert(cur) {
                continue;
            }
            let n = g.node(cur);
            match &n.op {
                Op::DotGeneral(_) => {
                    if let Some(p) = packed_linear(g, cur).filter(|p| picks(p.dot)) {
                        if p.tail == id || p.absorbed.contains(&id) {
                            return Some(p);
                        }
                    }
                }
                Op::Binary(BinaryOp::Add | BinaryOp::Mul | BinaryOp::Max)
                | Op::Unary(UnaryOp::Erf) => next.extend(n.operands.iter().copied()),
                _ => {}
            }
        }
        frontier = next;
    }
    None
}

/// The lowering of node `id` as part of packed linear `p`.
pub(crate) fn lowering(g: &Graph, id: NodeId, p: &PackedLinear) -> FfiLowering {
    if id != p.tail {
        return FfiLowering::Absorbed;
    }
    // The first linear of a pair: its input, weight and bias come first.
    let mut operands = Vec::new();
    let (mut pre_act, mut pre_flags) = (0, -1);
    if let Some(a) = &p.pre {
        operands.extend([a.x, a.weight]);
        pre_flags = 0;
        if let Some(b) = a.bias {
            pre_flags |= 2;
            operands.push(b);
        }
        pre_act = a.act.code();
        operands.push(p.weight);
    } else {
        operands.extend([p.x, p.weight]);
    }
    let mut flags = 0;
    for (bit, o) in [(2, p.bias), (4, p.residual)] {
        if let Some(o) = o {
            flags |= bit;
            operands.push(o);
        }
    }
    let act = p.act.code();
    let config = format!(
        "act = {act} : i64, epilogue = {flags} : i64, pre_act = {pre_act} : i64, pre_epilogue = {pre_flags} : i64"
    );
    let tys: Vec<&crate::ir::TensorType> = operands.iter().map(|&o| &g.node(o).ty).collect();
    FfiLowering::Call {
        attrs: super::mlir::custom_call_attrs(
            PACKED_LINEAR_TARGET,
            &config,
            &tys,
            &g.node(p.tail).ty,
        ),
        operands,
    }
}

/// The packed-weight cache's key of the `[n, k]` linear weight that is operand `at` of
/// `call` (its address and a digest of its dims).
pub(crate) fn weight_key(call: &Call<'_>, at: usize, k: i64, n: i64) -> Result<WeightKey> {
    Ok(WeightKey {
        digest: 0x6c69_6e65_6172_0001 ^ ((k as u64) << 20) ^ (n as u64),
        sources: [call.arg_address(at)?].into_iter().collect(),
    })
}

/// `act(x · Wᵀ + bias [+ other])` by oneDNN for `x` `[m, k]`, with the weight `wb` packed once
/// and kept under `key` (see [`weight_key`]). The result is libtorch's `[m, n]` tensor. Every
/// packed linear runs this: the packed linear's call, a pair's first product, and the
/// attention call's input projection.
pub(crate) fn packed_product(
    x: &tch::Tensor,
    wb: &BufferRef<'_>,
    key: &WeightKey,
    bias: Option<&BufferRef<'_>>,
    other: Option<&tch::Tensor>,
    act: Activation,
) -> Result<tch::Tensor> {
    let packed = weights::get_or_pack(key, || onednn::pack_linear_weight(&wb.tensor()?))?;
    let bias = bias.map(|b| b.tensor()).transpose()?;
    onednn::linear_pointwise(x, &packed, bias.as_ref(), other, act)
}

/// The packed linear kernel ([`PACKED_LINEAR_TARGET`]).
pub(crate) struct PackedLinearKernel;

impl FfiKernel for PackedLinearKernel {
    const TARGET: &'static str = PACKED_LINEAR_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        let act_of = |name: &str| Activation::from_call(call, name);
        let (flags, act) = (call.attr_int("epilogue")?, act_of("act")?);
        let (pre_flags, pre_act) = (call.attr_int("pre_epilogue")?, act_of("pre_act")?);
        let paired = pre_flags >= 0;
        let has = |f: i64, bit: i64| f >= 0 && f & bit != 0;
        // Operands: [x0, w0, [b0]] of the pair's first linear, then x (unpaired), w, [b], [r].
        let pre_arity = if paired {
            2 + has(pre_flags, 2) as usize
        } else {
            0
        };
        let arity =
            pre_arity + 1 + !paired as usize + has(flags, 2) as usize + has(flags, 4) as usize;
        call.expect_arity(arity, 1)?;
        let xb = call.arg(0)?;
        let (w0b, b0b) = if paired {
            let b0 = has(pre_flags, 2).then(|| call.arg(2)).transpose()?;
            (Some(call.arg(1)?), b0)
        } else {
            (None, None)
        };
        let w0_index = paired.then_some(1);
        let w_index = if paired { pre_arity } else { 1 };
        let wb = call.arg(w_index)?;
        let mut next = w_index + 1;
        let mut take = |on: bool| -> Result<Option<BufferRef<'_>>> {
            if !on {
                return Ok(None);
            }
            next += 1;
            call.arg(next - 1).map(Some)
        };
        let (bias, residual) = (take(has(flags, 2))?, take(has(flags, 4))?);
        let ob = call.ret(0)?;
        let (xd, wd, od) = (xb.dims, wb.dims, ob.dims);
        let w0d = w0b.as_ref().map(|b| b.dims);
        let bad = |m: &str| {
            let pre = w0d.map_or(String::new(), |d| format!(" after one by {d:?}"));
            Error::Invalid(format!(
                "packed linear of {xd:?} by {wd:?} (transposed){pre} into {od:?}: {m}"
            ))
        };
        let r = xd.len();
        if r < 2 || wd.len() != 2 || od.len() != r || w0d.is_some_and(|d| d.len() != 2) {
            return Err(bad("ranks"));
        }
        // The pair's first product `[.., k0] · [k, k0]ᵀ` makes the second's input `[.., k]`.
        let k0 = w0d.map_or(xd[r - 1], |d| d[1]);
        let (k, n) = (wd[1], wd[0]);
        let k_in = w0d.map_or(xd[r - 1], |d| d[0]);
        if xd[r - 1] != k0 || k_in != k || od[r - 1] != n || xd[..r - 1] != od[..r - 1] {
            return Err(bad("dims"));
        }
        if b0b.as_ref().is_some_and(|b| b.dims != [k]) {
            return Err(bad(&format!("the first bias is not [{k}]")));
        }
        if bias.as_ref().is_some_and(|b| b.dims != [n]) {
            return Err(bad(&format!("the bias is not [{n}]")));
        }
        if residual.as_ref().is_some_and(|o| o.dims != od) {
            return Err(bad("the residual is not shaped like the result"));
        }
        if residual.is_some() && act != Activation::None {
            return Err(bad("no activation after the residual sum"));
        }
        if paired && pre_flags & !2 != 0 {
            return Err(bad(&format!(
                "the first linear's epilogue {pre_flags} (a bias at most)"
            )));
        }
        let dtypes = [
            Some(&xb),
            w0b.as_ref(),
            b0b.as_ref(),
            Some(&wb),
            bias.as_ref(),
            residual.as_ref(),
            Some(&ob),
        ];
        if dtypes.iter().flatten().any(|b| b.dtype != DType::F32) {
            return Err(bad("f32 only"));
        }
        let key0 = w0_index.map(|i| weight_key(call, i, k0, k)).transpose()?;
        let key1 = weight_key(call, w_index, k, n)?;
        let m: i64 = xd[..r - 1].iter().product();
        let first = if paired {
            2.0 * (m * k) as f64 * k0 as f64
        } else {
            0.0
        };
        let flops = 2.0 * (m * n) as f64 * k as f64 + first;
        handoff::run_kernel(call.flag(SERIAL_ATTR), flops, || {
            let _guard = torch_lock();
            let x = xb.tensor()?.f_reshape([m, k0])?;
            // The pair's first product: its result stays libtorch's tensor.
            let x = match (&key0, &w0b) {
                (Some(key0), Some(w0b)) => {
                    packed_product(&x, w0b, key0, b0b.as_ref(), None, pre_act)?
                }
                _ => x,
            };
            let o = residual
                .as_ref()
                .map(|o| o.tensor().and_then(|t| Ok(t.f_reshape([m, n])?)))
                .transpose()?;
            let y = packed_product(&x, &wb, &key1, bias.as_ref(), o.as_ref(), act)?;
            ob.tensor()?.f_reshape([m, n])?.f_copy_(&y)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DotDims, InputKind, Literal, Shape, TensorType};

    fn t(d: &[usize]) -> TensorType {
        TensorType::new(DType::F32, d.to_vec())
    }

    fn splat_like(g: &mut Graph, v: f64, like: NodeId) -> NodeId {
        let k = g
            .add(Op::Constant(Literal::scalar(DType::F32, v)), &[])
            .unwrap();
        let shape = g.node(like).ty.shape.clone();
        g.add(
            Op::Broadcast {
                shape,
                dims: vec![],
            },
            &[k],
        )
        .unwrap()
    }

    fn bin(g: &mut Graph, op: BinaryOp, a: NodeId, b: NodeId) -> NodeId {
        g.add(Op::Binary(op), &[a, b]).unwrap()
    }

    /// `x · wᵀ + b` on `[2, 16, k]` activations, as `Tensor::linear` traces it.
    fn linear(g: &mut Graph, x: NodeId, kind: InputKind, n: usize) -> (NodeId, NodeId) {
        let k = g.node(x).ty.shape.dim(2);
        let w = g.add_input(kind, "w", t(&[n, k]));
        let b = g.add_input(InputKind::Parameter, "b", t(&[n]));
        let d = DotDims {
            lhs_contract: vec![2],
            rhs_contract: vec![1],
            ..Default::default()
        };
        let y = g.add(Op::DotGeneral(d), &[x, w]).unwrap();
        let shape = g.node(y).ty.shape.clone();
        let bb = g
            .add(
                Op::Broadcast {
                    shape,
                    dims: vec![2],
                },
                &[b],
            )
            .unwrap();
        (y, bin(g, BinaryOp::Add, y, bb))
    }

    /// kiln's traced GELU (erf form) of `y`.
    fn gelu(g: &mut Graph, y: NodeId) -> NodeId {
        let c = splat_like(g, std::f64::consts::FRAC_1_SQRT_2, y);
        let m1 = bin(g, BinaryOp::Mul, y, c);
        let e = g.add(Op::Unary(UnaryOp::Erf), &[m1]).unwrap();
        let one = splat_like(g, 1.0, y);
        let a = bin(g, BinaryOp::Add, e, one);
        let m2 = bin(g, BinaryOp::Mul, y, a);
        let half = splat_like(g, 0.5, y);
        bin(g, BinaryOp::Mul, m2, half)
    }

    #[test]
    fn transformer_block_linears_and_their_epilogues() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 64]));
        // fc1 + GELU, fc2 + residual, a third linear + ReLU, one on a per-call weight.
        let (d1, b1) = linear(&mut g, x, InputKind::Parameter, 128);
        let h = gelu(&mut g, b1);
        let (d2, b2) = linear(&mut g, h, InputKind::Parameter, 64);
        let r = bin(&mut g, BinaryOp::Add, b2, x);
        let (d3, b3) = linear(&mut g, r, InputKind::Buffer, 64);
        let z = splat_like(&mut g, 0.0, b3);
        let relu = bin(&mut g, BinaryOp::Max, b3, z);
        let (d4, _) = linear(&mut g, relu, InputKind::Data, 64);
        let reshaped = g.add(Op::Reshape(Shape::new(&[32, 64])), &[relu]).unwrap();
        g.set_outputs(vec![reshaped, d4]).unwrap();

        let p1 = packed_linear(&g, d1).unwrap();
        assert_eq!((p1.bias.is_some(), p1.act), (true, Activation::Gelu));
        assert_eq!(p1.absorbed.len(), 6); // dot, bias add, the GELU's four
        let p2 = packed_linear(&g, d2).unwrap();
        assert_eq!((p2.residual, p2.tail), (Some(x), r));
        let p3 = packed_linear(&g, d3).unwrap();
        assert_eq!((p3.act, p3.tail), (Activation::Relu, relu));
        assert!(packed_linear(&g, d4).is_none());
        // fc1 feeds fc2 alone: one call, fc2's with fc1 before it. The third linear reads
        // fc2's residual sum (a chain with a residual is never a pair's first).
        let pair = PackedLinear {
            pre: Some(Box::new(p1.clone())),
            ..p2.clone()
        };
        for (p, want) in [(&p1, &pair), (&p2, &pair), (&p3, &p3)] {
            for &n in p.absorbed.iter().chain([&p.tail]) {
                assert_eq!(
                    packed_linear_chain_of(&g, n, &|_| true).as_ref(),
                    Some(want)
                );
            }
        }
        assert!(matches!(lowering(&g, b1, &pair), FfiLowering::Absorbed));
        let FfiLowering::Call { operands, attrs } = lowering(&g, r, &pair) else {
            panic!("the pair's call");
        };
        assert_eq!(
            operands,
            [
                x,
                g.node(d1).operands[1],
                p1.bias.unwrap(),
                g.node(d2).operands[1],
                p2.bias.unwrap(),
                x
            ]
        );
        assert!(
            attrs.contains("pre_act = 3 : i64, pre_epilogue = 2 : i64"),
            "{attrs}"
        );
        // Unpicked, fc2 leaves fc1 alone.
        let not_fc2 = |d: NodeId| d != d2;
        assert_eq!(packed_linear_chain_of(&g, d1, &not_fc2), Some(p1));
        assert!(packed_linear_chain_of(&g, d4, &|_| true).is_none());
    }

    /// Three linears in a row stay three calls, and a first result that something else also
    /// reads is no pair's.
    #[test]
    fn only_lone_neighbours_pair() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 64]));
        let (_, a) = linear(&mut g, x, InputKind::Parameter, 64);
        let (_, b) = linear(&mut g, a, InputKind::Parameter, 64);
        let (_, c) = linear(&mut g, b, InputKind::Parameter, 64);
        g.set_outputs(vec![c]).unwrap();
        for id in [a, b, c] {
            let p = packed_linear_chain_of(&g, id, &|_| true).unwrap();
            assert_eq!((p.tail, p.pre), (id, None));
        }

        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 64]));
        let (_, a) = linear(&mut g, x, InputKind::Parameter, 64);
        let (_, b) = linear(&mut g, a, InputKind::Parameter, 64);
        g.set_outputs(vec![b, a]).unwrap();
        assert!(packed_linear_chain_of(&g, b, &|_| true)
            .unwrap()
            .pre
            .is_none());

        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 64]));
        let (_, a) = linear(&mut g, x, InputKind::Parameter, 64);
        let (_, b) = linear(&mut g, a, InputKind::Parameter, 32);
        g.set_outputs(vec![b]).unwrap();
        let p = packed_linear_chain_of(&g, a, &|_| true).unwrap();
        assert_eq!((p.tail, p.pre.map(|a| a.tail)), (b, Some(a)));
    }

    /// The rule packs few-row linears on every CPU, many-row ones only where oneDNN has
    /// AVX-512; `All` packs both, `Off` neither.
    #[test]
    fn the_rule_packs_many_rows_only_with_avx512() {
        use super::super::{FfiMode, FfiSelect, AUTO_MAX_DOT_ROWS};
        let wide = super::super::onednn_avx512();
        for (rows, auto) in [(AUTO_MAX_DOT_ROWS, true), (AUTO_MAX_DOT_ROWS + 1, wide)] {
            let mut g = Graph::new();
            // `[rows, 1, 64]`: the rows are the free dims together.
            let x = g.add_input(InputKind::Data, "x", t(&[rows, 1, 64]));
            let (d, y) = linear(&mut g, x, InputKind::Parameter, 128);
            g.set_outputs(vec![y]).unwrap();
            assert!(packed_linear(&g, d).is_some(), "{rows} rows");
            for (mode, want) in [
                (FfiMode::Auto, auto),
                (FfiMode::All, true),
                (FfiMode::Off, false),
            ] {
                assert_eq!(mode.packs_linear(&g, d), want, "{rows} rows, {mode:?}");
                assert_eq!(mode.picks(&g, d), want, "{rows} rows, {mode:?}");
            }
        }
    }

    #[test]
    fn tiny_and_updated_products_are_not_packed() {
        for (m, k, n, updated, want) in [
            (4, 10, 10, false, false), // the LinearModel's: the dot kernel's own loop
            (4, 64, 64, false, false), // 32 KFLOP: still tiny
            (4, 128, 64, false, true),
            (4, 128, 64, true, false),
        ] {
            let mut g = Graph::new();
            let x = g.add_input(InputKind::Data, "x", t(&[m, k]));
            let w = g.add_input(InputKind::Parameter, "w", t(&[n, k]));
            g.set_updated_between_calls(1, updated).unwrap();
            let d = DotDims {
                lhs_contract: vec![1],
                rhs_contract: vec![1],
                ..Default::default()
            };
            let y = g.add(Op::DotGeneral(d), &[x, w]).unwrap();
            g.set_outputs(vec![y]).unwrap();
            assert_eq!(
                packed_linear(&g, y).is_some(),
                want,
                "{m}x{k}x{n} {updated}"
            );
        }
    }
}
