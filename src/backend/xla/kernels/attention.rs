//! The attention kernel ([`ATTENTION_TARGET`]): `softmax(q·kᵀ·scale + mask)·v` as one call of
//! libtorch's `scaled_dot_product_attention`, as eager runs
//! [`Tensor::scaled_dot_product_attention`](crate::Tensor::scaled_dot_product_attention).
//!
//! In the graph, these nodes become one call (`r` = rank ≥ 3, batch dims `0..r-2`), as the
//! tracer records scaled dot-product attention:
//!
//! ```text
//! qs = q · broadcast(c)                     optional: else the scale is 1
//! kt = transpose(k, swapping the last two)  or a product contracting k's last dim
//! s  = dot_general(qs, kt)                  [.., L, S]
//! s  = s + mask                             optional: any tensor of s's type
//! p  = exp(s - bcast(max(s))) / bcast(sum(exp(...)))   max and sum over the last dim
//! o  = dot_general(p, v)                    [.., L, Dv]: the call stands for it
//! ```
//!
//! Every node between `s` and `o` must be read only inside the pattern (an inference graph:
//! a training graph keeps `p` for the backward pass, and stays in XLA).
//!
//! The call reads q, k and v where they lie when they are views (reshapes, transposes,
//! slices) of another node, such as the fused input projection of
//! `nn::MultiheadAttention`, and writes its result through a view when a transpose (and a
//! reshape) follows it, as the heads are merged back: XLA then copies none of them (see the
//! `view` module).
//!
//! When q, k and v are all views of one packed linear's result (a fused input projection on
//! frozen weights, as in an inference graph) that nothing else reads, the call runs that
//! linear itself (see [`linear_source`]): its result stays libtorch's tensor, and the
//! linear's own call, which nothing reads any more, is removed by XLA. Inference on a 2-vCPU
//! AMD EPYC Zen 4, one process alternating, ms, with / without: bert 11.37 / 11.55, 13.28 /
//! 13.38, 13.17 / 13.25, 13.27 / 13.61; vit 12.92 / 13.02, 12.53 / 12.95, 12.78 / 13.16,
//! 12.43 / 12.79.
//!
//! Why: XLA's CPU compiler runs this as two batched products and a softmax in several
//! passes. 2-vCPU Intel Xeon (AVX-512), one head block of vit/bert (`[4, 4, 65, 64]` each,
//! no mask), µs a call including the inputs' upload: 755–899 compiled through XLA against
//! 132–272 for libtorch's attention alone.

use super::{torch_lock, SERIAL_ATTR};
use crate::backend::xla::pjrt::ffi::{view_fits, BufferRef, Call, FfiKernel};
use crate::backend::xla::pjrt::handoff;
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, DType, Graph, NodeId, Op, ReduceKind, UnaryOp};

use super::onednn::Activation;
use super::packed::{single_user, splat};
use super::packed_linear::{packed_linear_chain_of, packed_product, weight_key, PackedLinear};
use super::view::{self, StridedView};
use super::weights::WeightKey;
use super::FfiLowering;

/// The custom call target of the attention kernel.
pub const ATTENTION_TARGET: &str = "kiln_attention_v1";

/// A matched scaled dot-product attention (see the module notes).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Attention {
    /// `[.., L, D]`, before the scale.
    pub q: NodeId,
    /// `[.., S, D]` (not transposed).
    pub k: NodeId,
    /// `[.., S, Dv]`.
    pub v: NodeId,
    /// Added to the scores, of their type.
    pub mask: Option<NodeId>,
    /// The scores' scale.
    pub scale: f64,
    /// The product with `v`.
    pub tail: NodeId,
    /// The pattern's other nodes: nothing is emitted for them.
    pub absorbed: Vec<NodeId>,
    /// For q, k and v: the node whose buffer holds it and its view there, where it is a view
    /// of another node (see [`view::source_view`]).
    pub views: [Option<(NodeId, StridedView)>; 3],
    /// The transpose (and reshape) after `tail` that the call absorbs, and `tail`'s view in
    /// the last one's buffer (see [`view::result_view`]); the call stands for that node.
    pub out: Option<(Vec<NodeId>, StridedView)>,
}

impl Attention {
    /// The node the call stands for: the end of the absorbed result chain, else `tail`.
    pub fn stands_for(&self) -> NodeId {
        self.out
            .as_ref()
            .and_then(|(nodes, _)| nodes.last().copied())
            .unwrap_or(self.tail)
    }

    /// The call's operands: q, k and v (their buffers' nodes where they are views), then the
    /// mask.
    pub fn operands(&self) -> Vec<NodeId> {
        let mut ops: Vec<NodeId> = [self.q, self.k, self.v]
            .iter()
            .zip(&self.views)
            .map(|(&x, v)| v.as_ref().map_or(x, |(src, _)| *src))
            .collect();
        ops.extend(self.mask);
        ops
    }
}

/// If `b` is `broadcast(reshape(reduce(x, kind, [r-1])))` back to `x`'s shape (the tracer's
/// keep-dim reduction over the last dim), its three nodes.
fn last_dim_reduction(g: &Graph, b: NodeId, x: NodeId, kind: ReduceKind) -> Option<[NodeId; 3]> {
    let r = g.node(x).ty.shape.rank();
    let bn = g.node(b);
    let Op::Broadcast { dims, .. } = &bn.op else {
        return None;
    };
    if bn.ty.shape != g.node(x).ty.shape || dims[..] != (0..r).collect::<Vec<_>>()[..] {
        return None;
    }
    let rs = bn.operands[0];
    if !matches!(g.node(rs).op, Op::Reshape(_)) {
        return None;
    }
    let rd = g.node(rs).operands[0];
    let rn = g.node(rd);
    match &rn.op {
        Op::Reduce { kind: k, axes } if *k == kind && axes[..] == [r - 1] => {
            (rn.operands[0] == x).then_some([b, rs, rd])
        }
        _ => None,
    }
}

/// Is `d` a batched product over dims `0..r-2` contracting the left's last dim with the
/// right's dim `rhs`?
fn batched(d: &crate::ir::DotDims, r: usize, rhs: usize) -> bool {
    let batch: Vec<usize> = (0..r - 2).collect();
    d.lhs_batch == batch
        && d.rhs_batch == batch
        && d.lhs_contract == [r - 1]
        && d.rhs_contract == [rhs]
}

/// Is dot node `tail` the end of a scaled dot-product attention whose inner nodes only the
/// pattern reads? `None` if not (see the module notes).
pub(crate) fn attention(g: &Graph, tail: NodeId) -> Option<Attention> {
    let n = g.node(tail);
    let Op::DotGeneral(d2) = &n.op else {
        return None;
    };
    let [p, v] = n.operands[..] else {
        return None;
    };
    let r = n.ty.shape.rank();
    let float = |id: NodeId| matches!(g.node(id).ty.dtype, DType::F32 | DType::F64);
    if r < 3 || !batched(d2, r, r - 2) || !float(tail) || n.ty.shape.numel() == 0 {
        return None;
    }
    // p = e / bcast(sum(e)), e = exp(s2 - bcast(max(s2))).
    let pn = g.node(p);
    let (Op::Binary(BinaryOp::Div), [e, sum_b]) = (&pn.op, &pn.operands[..]) else {
        return None;
    };
    let sum = last_dim_reduction(g, *sum_b, *e, ReduceKind::Sum)?;
    let en = g.node(*e);
    let (Op::Unary(UnaryOp::Exp), [sub]) = (&en.op, &en.operands[..]) else {
        return None;
    };
    let sn = g.node(*sub);
    let (Op::Binary(BinaryOp::Sub), [s2, max_b]) = (&sn.op, &sn.operands[..]) else {
        return None;
    };
    let max = last_dim_reduction(g, *max_b, *s2, ReduceKind::Max)?;
    // s2 = s (+ mask).
    let scores = |id: NodeId| match &g.node(id).op {
        Op::DotGeneral(d1) if batched(d1, r, r - 2) || batched(d1, r, r - 1) => Some(id),
        _ => None,
    };
    let (s, mask) = match scores(*s2) {
        Some(s) => (s, None),
        None => {
            let an = g.node(*s2);
            let (Op::Binary(BinaryOp::Add), [a, b]) = (&an.op, &an.operands[..]) else {
                return None;
            };
            let (s, m) = match (scores(*a), scores(*b)) {
                (Some(s), _) => (s, *b),
                (None, Some(s)) => (s, *a),
                _ => return None,
            };
            if g.node(m).ty != g.node(s).ty {
                return None;
            }
            (s, Some(m))
        }
    };
    let Op::DotGeneral(d1) = &g.node(s).op else {
        return None;
    };
    let [qs, kt] = g.node(s).operands[..] else {
        return None;
    };
    let mut inner = vec![s, *e, *sub, p];
    inner.extend(sum);
    inner.extend(max);
    if mask.is_some() {
        inner.push(*s2);
    }
    // Everything from the scores on is read only by the pattern.
    let ours = |u: &NodeId| *u == tail || inner.contains(u);
    if inner
        .iter()
        .any(|&i| g.outputs().contains(&i) || !g.users(i).iter().all(ours))
    {
        return None;
    }
    let mut absorbed = inner.clone();
    // The key, untransposed.
    let k = if d1.rhs_contract == [r - 1] {
        kt
    } else {
        let swap: Vec<usize> = (0..r - 2).chain([r - 1, r - 2]).collect();
        match &g.node(kt).op {
            Op::Transpose(perm) if *perm == swap => {
                if single_user(g, kt) == Some(s) {
                    absorbed.push(kt);
                }
                g.node(kt).operands[0]
            }
            _ => return None,
        }
    };
    // The query, before its scale.
    let scaled = match &g.node(qs).op {
        Op::Binary(BinaryOp::Mul) if single_user(g, qs) == Some(s) => {
            let [a, b] = g.node(qs).operands[..] else {
                return None;
            };
            [(a, b), (b, a)]
                .into_iter()
                .find_map(|(x, c)| splat(g, c).map(|v| (x, v)))
        }
        _ => None,
    };
    let (q, scale) = match scaled {
        Some((q, c)) => {
            absorbed.push(qs);
            (q, c)
        }
        None => (qs, 1.0),
    };
    let dtype = g.node(tail).ty.dtype;
    let same = [q, k, v]
        .iter()
        .chain(&mask)
        .all(|&o| g.node(o).ty.dtype == dtype);
    let shapes_ok = [q, k].iter().all(|&o| g.node(o).ty.shape.rank() == r);
    if !(same && shapes_ok) {
        return None;
    }
    let views = [q, k, v].map(|x| view::source_view(g, x));
    let out = view::result_view(g, tail);
    if out.is_some() {
        absorbed.push(tail);
        absorbed.extend(out.iter().flat_map(|(nodes, _)| &nodes[..nodes.len() - 1]));
    }
    Some(Attention {
        q,
        k,
        v,
        mask,
        scale,
        tail,
        absorbed,
        views,
        out,
    })
}

/// If node `id` belongs to an attention whose tail `picks` accepts, that attention. Looks
/// at most 14 steps forward from `id` (the pattern's longest path from a node to its tail).
pub(crate) fn attention_chain_of(
    g: &Graph,
    id: NodeId,
    picks: &dyn Fn(NodeId) -> bool,
) -> Option<Attention> {
    // The transpose and reshape after the tail: look back to it.
    let mut back = id;
    for _ in 0..2 {
        if !matches!(g.node(back).op, Op::Transpose(_) | Op::Reshape(_)) {
            break;
        }
        back = g.node(back).operands[0];
        if matches!(g.node(back).op, Op::DotGeneral(_)) {
            let found = attention(g, back).filter(|a| {
                let chain = a.out.as_ref().map_or(&[][..], |(nodes, _)| &nodes[..]);
                chain.contains(&id) && picks(a.tail)
            });
            if found.is_some() {
                return found;
            }
            break;
        }
    }
    if !may_belong(g, id) {
        return None;
    }
    let mut frontier = vec![id];
    let mut seen = std::collections::HashSet::new();
    for _ in 0..14 {
        let mut next = Vec::new();
        for cur in frontier {
            if !seen.insert(cur) || seen.len() > 64 {
                continue;
            }
            if matches!(g.node(cur).op, Op::DotGeneral(_)) {
                // Membership first: `picks` may match the pattern again (`FfiMode::attends`).
                let member = |a: &Attention| a.stands_for() == id || a.absorbed.contains(&id);
                if let Some(a) = attention(g, cur).filter(|a| member(a) && picks(a.tail)) {
                    return Some(a);
                }
            }
            // The path from a pattern node to its tail runs through pattern nodes only.
            if may_belong(g, cur) {
                next.extend(g.users(cur));
            }
        }
        frontier = next;
    }
    None
}

/// Could node `id` be one of an attention's nodes (by its own op and operands)? A cheap test
/// before [`attention_chain_of`]'s walk, which the lowering asks about most nodes of a graph:
/// a convolutional network's reductions (over batch and spatial dims) and per-channel
/// reshapes and broadcasts fail it.
fn may_belong(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    let r = n.ty.shape.rank();
    let last_dim_reduce = |x: NodeId| match &g.node(x).op {
        Op::Reduce { kind, axes } => {
            matches!(kind, ReduceKind::Max | ReduceKind::Sum)
                && g.node(g.node(x).operands[0])
                    .ty
                    .shape
                    .rank()
                    .checked_sub(1)
                    .is_some_and(|last| axes[..] == [last])
        }
        _ => false,
    };
    match &n.op {
        Op::DotGeneral(_)
        | Op::Unary(UnaryOp::Exp)
        | Op::Binary(BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub | BinaryOp::Div) => r >= 3,
        Op::Transpose(perm) => r >= 3 && perm[r - 2..] == [r - 1, r - 2],
        Op::Reduce { .. } => last_dim_reduce(id),
        Op::Reshape(_) => last_dim_reduce(n.operands[0]),
        Op::Broadcast { .. } => {
            matches!(g.node(n.operands[0]).op, Op::Reshape(_))
                && last_dim_reduce(g.node(n.operands[0]).operands[0])
        }
        _ => false,
    }
}

/// The packed linear that makes q, k and v (a fused input projection, q, k and v views of
/// its result) when the attention's call can run it itself: the linear is picked, has no
/// residual and no pair, and nothing but the views into the attention reads its result.
/// The call then takes the linear's operands instead of its result, which stays libtorch's
/// tensor; the linear's own call, read by nothing, is dropped by XLA.
pub(crate) fn linear_source(
    g: &Graph,
    a: &Attention,
    picks: &dyn Fn(NodeId) -> bool,
) -> Option<PackedLinear> {
    let [Some((s, _)), Some((sk, _)), Some((sv, _))] = &a.views else {
        return None;
    };
    let s = *s;
    if *sk != s || *sv != s || g.outputs().contains(&s) {
        return None;
    }
    // The view nodes from `s` to q, k and v.
    let mut path = Vec::new();
    for x in [a.q, a.k, a.v] {
        let mut cur = x;
        while cur != s {
            let n = g.node(cur);
            if !matches!(n.op, Op::Reshape(_) | Op::Transpose(_) | Op::Slice { .. })
                || path.len() > 24
            {
                return None;
            }
            path.push(cur);
            cur = n.operands[0];
        }
    }
    let inside = |u: &NodeId| path.contains(u) || a.absorbed.contains(u) || *u == a.tail;
    let alone = g.users(s).iter().all(inside)
        && path
            .iter()
            .all(|&n| !g.outputs().contains(&n) && g.users(n).iter().all(inside));
    if !alone {
        return None;
    }
    packed_linear_chain_of(g, s, picks)
        .filter(|p| p.tail == s && p.pre.is_none() && p.residual.is_none())
}

/// The lowering of node `id` as part of attention `a`. `emitted` says whether the lowering
/// emits a node's value (not one that every user reads through): a view's source must be.
///
/// With `pre` (see [`linear_source`]) the call's operands are the linear's input, weight and
/// bias, then the mask, and q, k and v are views of the linear's result.
pub(crate) fn lowering(
    g: &Graph,
    id: NodeId,
    a: &Attention,
    emitted: &dyn Fn(NodeId) -> bool,
    pre: Option<&PackedLinear>,
) -> FfiLowering {
    let result = a.stands_for();
    if id != result {
        return FfiLowering::Absorbed;
    }
    let mut a = a.clone();
    if pre.is_none() {
        for v in &mut a.views {
            if v.as_ref().is_some_and(|(src, _)| !emitted(*src)) {
                *v = None;
            }
        }
    }
    let mut attrs = vec![
        ("mask", format!("{} : i64", a.mask.is_some() as i64)),
        ("scale", format!("{:.17e} : f64", a.scale)),
    ];
    let operands = match pre {
        Some(p) => {
            attrs.push(("pre_act", format!("{} : i64", p.act.code())));
            attrs.push((
                "pre_epilogue",
                format!("{} : i64", 2 * p.bias.is_some() as i64),
            ));
            let mut ops = vec![p.x, p.weight];
            ops.extend(p.bias);
            ops.extend(a.mask);
            ops
        }
        None => a.operands(),
    };
    if let Some((_, v)) = &a.out {
        attrs.push(("o_view", v.attr()));
    }
    for (name, v) in ["q_view", "k_view", "v_view"].into_iter().zip(&a.views) {
        if let Some((_, v)) = v {
            attrs.push((name, v.attr()));
        }
    }
    attrs.sort();
    let config: Vec<String> = attrs.iter().map(|(n, v)| format!("{n} = {v}")).collect();
    let config = config.join(", ");
    let tys: Vec<&crate::ir::TensorType> = operands.iter().map(|&o| &g.node(o).ty).collect();
    FfiLowering::Call {
        attrs: super::mlir::custom_call_attrs(ATTENTION_TARGET, &config, &tys, &g.node(result).ty),
        operands,
    }
}

/// The view attribute `name` of a call (`None`: the buffer itself, whole).
fn view_attr(call: &Call<'_>, name: &str) -> Result<Option<StridedView>> {
    if call.attr(name).is_none() {
        return Ok(None);
    }
    let items = call.attr_ints(name)?;
    StridedView::from_attr(items)
        .map(Some)
        .ok_or_else(|| Error::Invalid(format!("attention: malformed {name} {items:?}")))
}

/// The attention kernel ([`ATTENTION_TARGET`]).
pub(crate) struct AttentionKernel;

impl FfiKernel for AttentionKernel {
    const TARGET: &'static str = ATTENTION_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        let has_mask = call.attr_int("mask")? != 0;
        let scale = call.attr_f64("scale")?;
        // With a linear before it (`pre_epilogue`): q, k and v are views of its result.
        let pre = match call.attr("pre_epilogue") {
            None => None,
            Some(_) => {
                let flags = call.attr_int("pre_epilogue")?;
                let act = Activation::from_call(call, "pre_act")?;
                if flags & !2 != 0 {
                    return Err(Error::Invalid(format!(
                        "attention: the linear before it takes a bias at most, not epilogue {flags}"
                    )));
                }
                Some((flags & 2 != 0, act))
            }
        };
        let inputs = pre.map_or(3, |(bias, _)| 2 + bias as usize);
        call.expect_arity(inputs + has_mask as usize, 1)?;
        let ob = call.ret(0)?;
        let mb = has_mask.then(|| call.arg(inputs)).transpose()?;
        // Each of q, k, v and the result: the buffer whole, or a view in it.
        let views = [
            view_attr(call, "q_view")?,
            view_attr(call, "k_view")?,
            view_attr(call, "v_view")?,
            view_attr(call, "o_view")?,
        ];
        let source = match pre {
            None => Source::Buffers([call.arg(0)?, call.arg(1)?, call.arg(2)?]),
            Some((bias, act)) => {
                let (xb, wb) = (call.arg(0)?, call.arg(1)?);
                let bb = bias.then(|| call.arg(2)).transpose()?;
                let (xd, wd) = (xb.dims, wb.dims);
                let r = xd.len();
                let fits = r >= 1
                    && wd.len() == 2
                    && wd[1] == xd[r - 1]
                    && bb.as_ref().is_none_or(|b| b.dims == [wd[0]])
                    && [&xb, &wb]
                        .iter()
                        .chain(bb.as_ref().as_slice())
                        .all(|b| b.dtype == DType::F32)
                    && views[..3].iter().all(Option::is_some);
                if !fits {
                    return Err(Error::Invalid(format!(
                        "attention after a linear of {xd:?} by {wd:?} (transposed), bias {:?}: the linear must be f32 with q, k and v views of its result",
                        bb.as_ref().map(|b| b.dims)
                    )));
                }
                let key = weight_key(call, 1, wd[1], wd[0])?;
                Source::Linear {
                    xb,
                    wb,
                    bb,
                    act,
                    key,
                }
            }
        };
        let dims = |i: usize, v: &Option<StridedView>| -> Vec<i64> {
            v.as_ref().map_or_else(
                || match &source {
                    Source::Buffers(b) => b[i].dims.to_vec(),
                    Source::Linear { .. } => Vec::new(),
                },
                |v| v.sizes.clone(),
            )
        };
        let (qd, kd, vd, od) = (
            dims(0, &views[0]),
            dims(1, &views[1]),
            dims(2, &views[2]),
            views[3]
                .as_ref()
                .map_or_else(|| ob.dims.to_vec(), |v| v.sizes.clone()),
        );
        let bad = |m: &str| {
            Error::Invalid(format!(
                "attention of q {qd:?}, k {kd:?}, v {vd:?} into {od:?}: {m}"
            ))
        };
        let r = qd.len();
        if r < 3 || [kd.len(), vd.len(), od.len()] != [r; 3] {
            return Err(bad("ranks"));
        }
        let b = &qd[..r - 2];
        let (l, dq, s, dv) = (qd[r - 2], qd[r - 1], kd[r - 2], vd[r - 1]);
        let dims_ok = kd[..r - 2] == *b
            && vd[..r - 2] == *b
            && od[..r - 2] == *b
            && kd[r - 1] == dq
            && vd[r - 2] == s
            && od[r - 2..] == [l, dv];
        if !dims_ok {
            return Err(bad("dims"));
        }
        let scores: Vec<i64> = b.iter().copied().chain([l, s]).collect();
        if mb.as_ref().is_some_and(|m| m.dims != scores) {
            return Err(bad(&format!("the mask is not {scores:?}")));
        }
        let dtype = ob.dtype;
        let mut types: Vec<DType> = match &source {
            Source::Buffers(bs) => bs.iter().map(|b| b.dtype).collect(),
            Source::Linear { .. } => vec![DType::F32],
        };
        types.extend(mb.as_ref().map(|m| m.dtype));
        if !matches!(dtype, DType::F32 | DType::F64) || types.iter().any(|&t| t != dtype) {
            return Err(bad("f32 or f64, all alike"));
        }
        // q·kᵀ and the weights times v (and the linear before them).
        let mut flops = 2.0 * (b.iter().product::<i64>() * l * s * (dq + dv)) as f64;
        if let Source::Linear { xb, wb, .. } = &source {
            flops += 2.0 * xb.dims.iter().product::<i64>() as f64 * wb.dims[0] as f64;
        }
        handoff::run_kernel(call.flag(SERIAL_ATTR), flops, || {
            let _guard = torch_lock();
            let [q, k, v] = match &source {
                Source::Buffers(bs) => {
                    let open = |i: usize| match &views[i] {
                        Some(v) => bs[i].tensor_view(v.offset, &v.sizes, &v.strides),
                        None => bs[i].tensor(),
                    };
                    [open(0)?, open(1)?, open(2)?]
                }
                Source::Linear {
                    xb,
                    wb,
                    bb,
                    act,
                    key,
                } => {
                    let (n, k) = (wb.dims[0], wb.dims[1]);
                    let m = xb.dims.iter().product::<i64>() / k.max(1);
                    let x = xb.tensor()?.f_reshape([m, k])?;
                    let y = packed_product(&x, wb, key, bb.as_ref(), None, *act)?;
                    let open = |v: &Option<StridedView>| -> Result<tch::Tensor> {
                        let v = v
                            .as_ref()
                            .ok_or_else(|| bad("a view of the linear's result"))?;
                        view_of(&y, m * n, v).ok_or_else(|| {
                            bad(&format!(
                                "the view {v:?} does not fit the linear's [{m}, {n}] result"
                            ))
                        })?
                    };
                    [open(&views[0])?, open(&views[1])?, open(&views[2])?]
                }
            };
            let mask = mb.as_ref().map(|m| m.tensor()).transpose()?;
            let y = tch::Tensor::f_scaled_dot_product_attention(
                &q,
                &k,
                &v,
                mask.as_ref(),
                0.0,
                false,
                scale,
                false,
            )?;
            let mut out = match &views[3] {
                Some(v) => ob.tensor_view(v.offset, &v.sizes, &v.strides)?,
                None => ob.tensor()?,
            };
            out.f_copy_(&y)?;
            Ok(())
        })
    }
}

/// Where the attention's q, k and v come from.
enum Source<'a> {
    /// Buffers of their own (or views in them).
    Buffers([BufferRef<'a>; 3]),
    /// Views of the result of a packed linear the call runs first.
    Linear {
        xb: BufferRef<'a>,
        wb: BufferRef<'a>,
        bb: Option<BufferRef<'a>>,
        act: Activation,
        key: WeightKey,
    },
}

/// `v` as a view of the dense tensor `y` of `numel` elements, if it is not empty and lies
/// inside it (the check `BufferRef::tensor_view` makes of a view of a buffer).
fn view_of(y: &tch::Tensor, numel: i64, v: &StridedView) -> Option<Result<tch::Tensor>> {
    let inside = v.sizes.iter().all(|&s| s > 0) && view_fits(v.offset, &v.sizes, &v.strides, numel);
    inside.then(|| Ok(y.f_as_strided(&v.sizes, &v.strides, Some(v.offset))?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::TensorType;
    use crate::passes::{Pass, StripStopGradients};
    use crate::trace::{trace, Tensor};

    fn t(d: &[usize]) -> TensorType {
        TensorType::new(DType::F32, d.to_vec())
    }

    /// The graph of `Tensor::scaled_dot_product_attention` as the tracer records it, then
    /// `extra` applied to the result and the scores' softmax.
    fn traced(mask: bool) -> Graph {
        let mut tys = vec![t(&[2, 3, 5, 8]), t(&[2, 3, 7, 8]), t(&[2, 3, 7, 4])];
        if mask {
            tys.push(t(&[2, 3, 5, 7]));
        }
        let g = trace(&tys, |xs| {
            let o = Tensor::scaled_dot_product_attention(
                &xs[0],
                &xs[1],
                &xs[2],
                xs.get(3),
                0.0,
                false,
            )?;
            Ok(vec![o])
        })
        .unwrap()
        .graph;
        stripped(g)
    }

    /// `g` without its stop-gradients (a softmax's detached maximum), as `compile` hands
    /// graphs to the backend.
    fn stripped(mut g: Graph) -> Graph {
        StripStopGradients.run(&mut g).unwrap();
        g
    }

    #[test]
    fn the_traced_attention_is_one_call() {
        for mask in [false, true] {
            let g = traced(mask);
            let tail = g.outputs()[0];
            let a = attention(&g, tail).unwrap_or_else(|| panic!("mask {mask}:\n{g}"));
            let input = |i: usize| {
                g.petgraph()
                    .node_indices()
                    .find(|&n| g.node(n).op == Op::Input(i))
                    .unwrap()
            };
            assert_eq!((a.q, a.k, a.v), (input(0), input(1), input(2)), "{g}");
            assert_eq!(a.mask, mask.then(|| input(3)));
            // The constant is stored in f32.
            assert!((a.scale - 1.0 / 8f64.sqrt()).abs() < 1e-7, "{}", a.scale);
            // Scale, transpose, scores, [mask sum], six softmax nodes, exp, sub, div.
            assert_eq!(a.absorbed.len(), 12 + mask as usize, "{g}");
            for n in g.petgraph().node_indices() {
                let inside = n == tail || a.absorbed.contains(&n);
                let found = attention_chain_of(&g, n, &|_| true);
                assert_eq!(found.is_some(), inside, "node {n:?} of\n{g}");
                assert!(attention_chain_of(&g, n, &|_| false).is_none());
            }
        }
    }

    /// q, k and v sliced out of one frozen projection: the call runs the projection when
    /// nothing else reads its result, and not when the program returns it too.
    #[test]
    fn a_projection_read_only_by_the_attention_is_run_by_its_call() {
        let store = crate::nn::ParamStore::with_seed(1);
        let mha =
            crate::nn::MultiheadAttention::new(&store.root().sub("a"), 64, 4, 0.0, true).unwrap();
        for also_returned in [false, true] {
            // Large enough a projection to be packed (not a tiny product).
            let g = trace(&[t(&[2, 8, 64])], |xs| {
                let qkv = xs[0].linear(&mha.in_proj_weight, mha.in_proj_bias.as_ref())?;
                let heads = qkv.reshape(&[2, 8, 3, 4, 16])?.permute(&[2, 0, 3, 1, 4])?;
                let part = |i: usize| heads.narrow(0, i, 1)?.squeeze(0);
                let o = Tensor::scaled_dot_product_attention(
                    &part(0)?,
                    &part(1)?,
                    &part(2)?,
                    None,
                    0.0,
                    false,
                )?;
                let mut outs = vec![o];
                if also_returned {
                    outs.push(qkv);
                }
                Ok(outs)
            })
            .unwrap()
            .graph;
            let g = stripped(g);
            let a = attention(&g, g.outputs()[0]).unwrap_or_else(|| panic!("{g}"));
            let pre = linear_source(&g, &a, &|_| true);
            assert_eq!(pre.is_some(), !also_returned, "{g}");
            if let Some(p) = pre {
                assert_eq!(a.views[0].as_ref().map(|(s, _)| *s), Some(p.tail));
                assert!(p.bias.is_some());
                assert!(linear_source(&g, &a, &|_| false).is_none());
            }
        }
    }

    /// The cheap test before the walk admits the pattern's nodes (checked above through
    /// `attention_chain_of`) and turns away a normalisation's reductions over other dims.
    #[test]
    fn batch_norm_reductions_are_not_looked_at() {
        let g = trace(&[t(&[2, 3, 4, 4])], |xs| {
            let m = xs[0].sum(&[0, 2, 3], true)?;
            Ok(vec![xs[0].sub(&m.broadcast_to(&[2, 3, 4, 4])?)?.exp()?])
        })
        .unwrap()
        .graph;
        let kinds: Vec<_> = g
            .petgraph()
            .node_indices()
            .filter(|&n| may_belong(&g, n))
            .map(|n| format!("{:?}", g.node(n).op))
            .collect();
        // Only the rank-4 elementwise ops (sub, exp) pass; the reduction, its reshape and
        // broadcast do not.
        assert_eq!(kinds.len(), 2, "{kinds:?}\n{g}");
    }

    /// A training graph keeps the softmax (or the scores) for the backward pass: no call.
    #[test]
    fn attention_whose_softmax_is_read_elsewhere_stays_in_xla() {
        let tys = [t(&[2, 3, 5, 8]), t(&[2, 3, 7, 8]), t(&[2, 3, 7, 4])];
        let g = trace(&tys, |xs| {
            let d = 8f64.sqrt().recip();
            let s = xs[0].mul_scalar(d)?.matmul(&xs[1].t()?)?;
            let p = s.softmax(-1)?;
            Ok(vec![p.matmul(&xs[2])?, p])
        })
        .unwrap()
        .graph;
        let g = stripped(g);
        assert!(attention(&g, g.outputs()[0]).is_none(), "{g}");
        // Without the second output it is the pattern again.
        let mut h = g.clone();
        h.set_outputs(vec![g.outputs()[0]]).unwrap();
        assert!(attention(&h, h.outputs()[0]).is_some(), "{h}");
    }
}
