//! The packed convolution ([`PACKED_CONV_TARGET`]): a 2-d f32 convolution whose weight is a
//! function of frozen variables, run by oneDNN on channels-last activations with its weight
//! packed once ([`super::weights`]) and its epilogue fused, the way PyTorch's inductor runs
//! frozen CPU convolutions.
//!
//! In the graph, a convolution `conv(x, w)` and the elementwise ops after it become one call
//! when they have this shape, each step optional, in this order:
//!
//! ```text
//! y = conv(x, w)                 w: computed from variables only (weights, frozen statistics)
//! y = y * broadcast(scale[O])    scale: from variables only (BatchNorm's w / sqrt(var + eps))
//! y = y + broadcast(shift[O])    a bias, or BatchNorm's shift
//! y = y + residual               any tensor of y's type
//! y = max(y, 0)  |  min(max(y, lo), hi)     ReLU, or ReLU6 / clamp without a residual
//! ```
//!
//! `scale` is folded into the packed weight (`w · scale` per output channel), `shift`
//! becomes oneDNN's bias, the residual its binary post-op and the activation its eltwise
//! post-op. Each intermediate must have that one user and not be a graph output. The call
//! takes and returns NHWC arrays; the lowering wraps it in transposes, which XLA cancels
//! between consecutive calls, so chains of convolutions stay channels-last.
//!
//! "From variables only" means the node's inputs are all graph inputs of kind
//! [`InputKind::Parameter`] or [`InputKind::Buffer`] that neither the graph updates (no
//! alias) nor other programs between its calls ([`crate::ir::Input::updated_between_calls`]):
//! true of every weight in a compiled inference function, false in a training step's
//! programs, whose optimizer replaces the weights every step (packing them every step would
//! cost more than it saves). Those inputs are passed to the call too, as *sources*: the kernel reads
//! only their addresses, which key the packed weight.
//!
//! NaN: oneDNN's fused ReLU and clamp map a NaN to 0 (or to `lo`), where the IR's float
//! `max`/`min` propagate it (PyTorch's frozen CPU code does the same as oneDNN).

use super::onednn::{self, Activation, Geometry};
use super::weights::{self, WeightKey};
use super::SERIAL_ATTR;
use super::{torch_lock, FfiLowering};
use crate::backend::xla::lower::tensor_type;
use crate::backend::xla::pjrt::ffi::{BufferRef, Call, FfiKernel};
use crate::backend::xla::pjrt::handoff;
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, DType, Graph, InputKind, NodeId, Op, Shape, TensorType};
use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::OnceLock;
use tch::Tensor;

/// The custom call target of the packed convolution.
pub const PACKED_CONV_TARGET: &str = "kiln_conv_packed_v1";

/// Whether the XLA backend uses the packed convolution: yes, unless the environment says
/// `KILN_PACKED_CONV=off` (read once; for comparisons).
pub fn packed_conv_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        !std::env::var("KILN_PACKED_CONV").is_ok_and(|v| v.eq_ignore_ascii_case("off"))
    })
}

/// At most this many nodes in the computation of a weight from its sources (a weight is
/// usually an input, or an input scaled by a few per-channel ops).
const MAX_CONE: usize = 64;

/// A convolution and its fused epilogue (see the module notes).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PackedConv {
    pub conv: NodeId,
    pub x: NodeId,
    pub weight: NodeId,
    pub scale: Option<NodeId>,
    pub shift: Option<NodeId>,
    pub residual: Option<NodeId>,
    pub act: Activation,
    /// The last node of the chain: the call stands for it.
    pub tail: NodeId,
    /// The chain's other nodes (the convolution first): nothing is emitted for them.
    pub absorbed: Vec<NodeId>,
    /// The variable inputs `weight` and `scale` are computed from, in order.
    pub sources: Vec<NodeId>,
    /// A digest of how the packed weight follows from the sources (the nodes between them,
    /// the geometry, the input type).
    pub digest: u64,
}

/// The graph inputs node `id` is computed from, if all are variables the graph does not
/// update (and constants), appended to `out` once each; `false` otherwise.
pub(super) fn frozen_sources(
    g: &Graph,
    id: NodeId,
    seen: &mut HashSet<NodeId>,
    out: &mut Vec<NodeId>,
) -> bool {
    if !seen.insert(id) {
        return true;
    }
    if seen.len() > MAX_CONE {
        return false;
    }
    let n = g.node(id);
    match &n.op {
        Op::Input(i) => {
            let Some(inp) = g.inputs().get(*i) else {
                return false;
            };
            let frozen = matches!(inp.kind, InputKind::Parameter | InputKind::Buffer)
                && !inp.updated_between_calls
                && !g.aliases().iter().any(|&(a, _)| a == *i);
            if frozen {
                out.push(id);
            }
            frozen
        }
        Op::Constant(_) | Op::Iota { .. } => true,
        _ => n
            .operands
            .clone()
            .iter()
            .all(|&o| frozen_sources(g, o, seen, out)),
    }
}

/// The only user of `id`, if it has exactly one, uses it once, and `id` is not an output.
pub(super) fn single_user(g: &Graph, id: NodeId) -> Option<NodeId> {
    if g.outputs().contains(&id) {
        return None;
    }
    match g.users(id)[..] {
        [u] if g.node(u).operands.iter().filter(|&&o| o == id).count() == 1 => Some(u),
        _ => None,
    }
}

/// If `b` broadcasts a `[C]` vector along dim 1 of a rank-4 result (`broadcast(v, dims=[1])`
/// or `broadcast(reshape(v) to [1, C, 1, 1], dims=[0, 1, 2, 3])`), that vector.
fn per_channel(g: &Graph, b: NodeId) -> Option<NodeId> {
    let n = g.node(b);
    let Op::Broadcast { shape, dims } = &n.op else {
        return None;
    };
    if shape.rank() != 4 {
        return None;
    }
    let c = shape.dim(1);
    let src = n.operands[0];
    let s = g.node(src);
    let vec_ok = |v: NodeId| g.node(v).ty.shape.dims() == [c];
    if dims[..] == [1] && vec_ok(src) {
        return Some(src);
    }
    if dims[..] == [0, 1, 2, 3] && s.ty.shape.dims() == [1, c, 1, 1] {
        if let Op::Reshape(_) = s.op {
            let v = s.operands[0];
            return vec_ok(v).then_some(v);
        }
    }
    None
}

/// If `b` is a broadcast of a scalar constant (or a splat constant), its value.
pub(super) fn splat(g: &Graph, b: NodeId) -> Option<f64> {
    let n = g.node(b);
    match &n.op {
        Op::Constant(l) => l.splat_value(),
        Op::Broadcast { dims, .. } if dims.is_empty() => match &g.node(n.operands[0]).op {
            Op::Constant(l) => l.splat_value(),
            _ => None,
        },
        _ => None,
    }
}

/// The operand of binary node `u` other than `cur`, if `u` is `op`.
pub(super) fn other_operand(g: &Graph, u: NodeId, cur: NodeId, op: BinaryOp) -> Option<NodeId> {
    let n = g.node(u);
    match n.op {
        Op::Binary(b) if b == op => match n.operands[..] {
            [a, o] if a == cur => Some(o),
            [o, a] if a == cur => Some(o),
            _ => None,
        },
        _ => None,
    }
}

/// Can convolution node `id` run as a packed convolution, and with which epilogue? `None`
/// if it is not such a convolution (see the module notes), or the packed convolution is
/// switched off ([`packed_conv_enabled`]).
pub(crate) fn packed_conv(g: &Graph, id: NodeId) -> Option<PackedConv> {
    if !packed_conv_enabled() {
        return None;
    }
    let n = g.node(id);
    let Op::Conv(c) = &n.op else {
        return None;
    };
    let [x, w] = n.operands[..] else {
        return None;
    };
    let (xt, wt) = (&g.node(x).ty, &g.node(w).ty);
    let eligible = xt.dtype == DType::F32
        && wt.dtype == DType::F32
        && xt.shape.rank() == 4
        && wt.shape.rank() == 4
        && c.strides.len() == 2
        && c.lhs_dilation == [1, 1]
        && c.batch_groups == 1
        && c.padding.iter().all(|&(l, h)| l == h && l >= 0)
        && n.ty.shape.numel() > 0
        && xt.shape.numel() > 0;
    if !eligible {
        return None;
    }
    let mut seen = HashSet::new();
    let mut sources = Vec::new();
    if !frozen_sources(g, w, &mut seen, &mut sources) {
        return None;
    }
    let mut p = PackedConv {
        conv: id,
        x,
        weight: w,
        scale: None,
        shift: None,
        residual: None,
        act: Activation::None,
        tail: id,
        absorbed: Vec::new(),
        sources,
        digest: 0,
    };
    let ty = n.ty.clone();
    // Each stage at most once, in order: scale, shift, residual, activation.
    let mut stage = 0;
    while let Some(u) = single_user(g, p.tail) {
        let cur = p.tail;
        if stage < 1 {
            let scale = other_operand(g, u, cur, BinaryOp::Mul).and_then(|b| per_channel(g, b));
            if let Some(s) = scale {
                let mut found = Vec::new();
                if !frozen_sources(g, s, &mut HashSet::new(), &mut found) {
                    break;
                }
                for f in found {
                    if !p.sources.contains(&f) {
                        p.sources.push(f);
                    }
                }
                p.scale = Some(s);
                p.absorbed.push(cur);
                p.tail = u;
                stage = 1;
                continue;
            }
        }
        if stage < 2 {
            let shift = other_operand(g, u, cur, BinaryOp::Add).and_then(|b| per_channel(g, b));
            if let Some(t) = shift {
                p.shift = Some(t);
                p.absorbed.push(cur);
                p.tail = u;
                stage = 2;
                continue;
            }
        }
        if stage < 3 {
            // Of two chains meeting in one sum (a residual block with a downsampling
            // convolution), the chain on the left takes it.
            let left_takes = |r: NodeId| {
                g.node(u).operands[0] == r
                    && packed_chain_of(g, r, &|_| true)
                        .is_some_and(|q| q.tail == u || q.absorbed.contains(&u))
            };
            let residual = other_operand(g, u, cur, BinaryOp::Add)
                .filter(|&r| g.node(r).ty == ty && per_channel(g, r).is_none() && !left_takes(r));
            if let Some(r) = residual {
                p.residual = Some(r);
                p.absorbed.push(cur);
                p.tail = u;
                stage = 3;
                continue;
            }
        }
        // The activation: max(y, lo), then maybe min(., hi); always the end of the chain.
        let Some(lo) = other_operand(g, u, cur, BinaryOp::Max).and_then(|b| splat(g, b)) else {
            break;
        };
        let clamp = single_user(g, u).and_then(|v| {
            let hi = other_operand(g, v, u, BinaryOp::Min).and_then(|b| splat(g, b))?;
            (lo.is_finite() && hi.is_finite() && lo <= hi).then_some((v, hi))
        });
        match clamp {
            // oneDNN fuses no clamp after the residual's sum.
            Some(_) if p.residual.is_some() => {}
            Some((v, hi)) => {
                p.absorbed.extend([cur, u]);
                p.tail = v;
                p.act = Activation::Clamp(lo, hi);
            }
            None if lo == 0.0 => {
                p.absorbed.push(cur);
                p.tail = u;
                p.act = Activation::Relu;
            }
            None => {}
        }
        break;
    }
    p.digest = digest(g, &p, c, xt);
    Some(p)
}

/// A digest of the computation from the sources to the packed weight: the nodes of
/// `weight` and `scale` (sources named by position), the convolution's attributes and the
/// input type.
fn digest(g: &Graph, p: &PackedConv, c: &crate::ir::ConvAttrs, xt: &TensorType) -> u64 {
    fn walk(g: &Graph, id: NodeId, p: &PackedConv, seen: &mut Vec<NodeId>, text: &mut String) {
        if seen.contains(&id) {
            return;
        }
        let n = g.node(id);
        if !matches!(n.op, Op::Input(_)) {
            for &o in n.operands.iter() {
                walk(g, o, p, seen, text);
            }
        }
        seen.push(id);
        let pos = |o: &NodeId| seen.iter().position(|s| s == o).unwrap_or(usize::MAX);
        let ops: Vec<usize> = n.operands.iter().map(pos).collect();
        match &n.op {
            Op::Input(_) => {
                let k = p
                    .sources
                    .iter()
                    .position(|&s| s == id)
                    .unwrap_or(usize::MAX);
                let _ = writeln!(text, "source {k} {}", n.ty);
            }
            op => {
                let _ = writeln!(text, "{op:?} {} {ops:?}", n.ty);
            }
        }
    }
    let mut text = format!("packed conv v1 {c:?} {xt}\n");
    let mut seen = Vec::new();
    walk(g, p.weight, p, &mut seen, &mut text);
    let _ = writeln!(text, "weight {}", seen.len());
    if let Some(s) = p.scale {
        walk(g, s, p, &mut seen, &mut text);
        let _ = writeln!(text, "scale");
    }
    let h = blake3::hash(text.as_bytes());
    u64::from_le_bytes(h.as_bytes()[..8].try_into().unwrap_or_default())
}

/// If node `id` belongs to a packed convolution's chain (a convolution, or an epilogue op
/// after one) whose convolution `picks` accepts, that chain.
pub(crate) fn packed_chain_of(
    g: &Graph,
    id: NodeId,
    picks: &dyn Fn(NodeId) -> bool,
) -> Option<PackedConv> {
    if !packed_conv_enabled() {
        return None;
    }
    // Back from an epilogue op to its convolution: at most 5 steps (scale, shift, residual,
    // max, min). Every operand that may lead there is followed: in a residual sum, the
    // first one can be the other branch (not packed, or taking no part in this chain).
    fn back(
        g: &Graph,
        id: NodeId,
        cur: NodeId,
        steps: usize,
        picks: &dyn Fn(NodeId) -> bool,
    ) -> Option<PackedConv> {
        let n = g.node(cur);
        match n.op {
            Op::Conv(_) => {
                let p = packed_conv(g, cur).filter(|p| picks(p.conv))?;
                (p.tail == id || p.absorbed.contains(&id)).then_some(p)
            }
            Op::Binary(BinaryOp::Mul | BinaryOp::Add | BinaryOp::Max | BinaryOp::Min)
                if steps > 0 =>
            {
                n.operands.iter().find_map(|&o| {
                    let leads = matches!(
                        g.node(o).op,
                        Op::Conv(_)
                            | Op::Binary(
                                BinaryOp::Mul | BinaryOp::Add | BinaryOp::Max | BinaryOp::Min
                            )
                    ) && single_user(g, o) == Some(cur);
                    if leads {
                        back(g, id, o, steps - 1, picks)
                    } else {
                        None
                    }
                })
            }
            _ => None,
        }
    }
    back(g, id, id, 5, picks)
}

/// The convolutions of the packed chains next to packed convolution `p`: the one whose
/// result `p` reads, those that read `p`'s result, and the one whose sum takes `p`'s result
/// as its residual. Between neighbours the activations stay NHWC (XLA cancels the
/// transposes of consecutive calls).
pub(crate) fn neighbours(g: &Graph, p: &PackedConv) -> Vec<NodeId> {
    let mut out: Vec<NodeId> = packed_chain_of(g, p.x, &|_| true)
        .filter(|q| q.tail == p.x)
        .map(|q| q.conv)
        .into_iter()
        .collect();
    for u in g.users(p.tail) {
        let q = match g.node(u).op {
            Op::Conv(_) if g.node(u).operands[0] == p.tail => packed_conv(g, u),
            _ => packed_chain_of(g, u, &|_| true).filter(|q| q.residual == Some(p.tail)),
        };
        if let Some(q) = q.filter(|q| q.conv != p.conv) {
            out.push(q.conv);
        }
    }
    out
}

/// `[N, C, H, W]` → `[N, H, W, C]`.
fn nhwc(t: &TensorType) -> TensorType {
    let d = t.shape.dims();
    TensorType::new(t.dtype, Shape::new(&[d[0], d[2], d[3], d[1]]))
}

/// The lowering of node `id` as part of packed convolution `p`.
pub(crate) fn lowering(g: &Graph, id: NodeId, p: &PackedConv) -> FfiLowering {
    if id != p.tail {
        return FfiLowering::Absorbed;
    }
    let Op::Conv(c) = &g.node(p.conv).op else {
        return FfiLowering::Absorbed;
    };
    let mut operands = vec![p.x, p.weight];
    let mut nhwc_operands = vec![true, false];
    let mut flags = 0;
    for (bit, o, layout) in [
        (1, p.scale, false),
        (2, p.shift, false),
        (4, p.residual, true),
    ] {
        if let Some(o) = o {
            flags |= bit;
            operands.push(o);
            nhwc_operands.push(layout);
        }
    }
    for &s in &p.sources {
        operands.push(s);
        nhwc_operands.push(false);
    }
    let (lo, hi) = match p.act {
        Activation::Clamp(lo, hi) => (lo, hi),
        _ => (0.0, 0.0),
    };
    let act = p.act.code();
    let ints = |v: &[i64]| super::mlir::i64_array(v.iter().copied());
    let padding: Vec<i64> = c.padding.iter().map(|&(l, _)| l).collect();
    let strides: Vec<i64> = c.strides.iter().map(|&s| s as i64).collect();
    let dilation: Vec<i64> = c.rhs_dilation.iter().map(|&d| d as i64).collect();
    let config = format!(
        "act = {act} : i64, digest = {} : i64, dilation = {}, epilogue = {flags} : i64, groups = {} : i64, hi = {hi:.17e} : f64, lo = {lo:.17e} : f64, padding = {}, sources = {} : i64, strides = {}",
        p.digest as i64,
        ints(&dilation),
        c.feature_groups,
        ints(&padding),
        p.sources.len(),
        ints(&strides),
    );
    let tys: Vec<TensorType> = operands
        .iter()
        .zip(&nhwc_operands)
        .map(|(&o, &t)| {
            let ty = &g.node(o).ty;
            if t {
                nhwc(ty)
            } else {
                ty.clone()
            }
        })
        .collect();
    let out = nhwc(&g.node(p.tail).ty);
    let layouts = |ts: &mut dyn Iterator<Item = &TensorType>| -> String {
        let v: Vec<String> = ts.map(|t| super::mlir::row_major(t.shape.rank())).collect();
        v.join(", ")
    };
    let attrs = format!(
        "call_target_name = \"{PACKED_CONV_TARGET}\", api_version = 4 : i32, backend_config = {{{config}}}, operand_layouts = [{}], result_layouts = [{}]",
        layouts(&mut tys.iter()),
        super::mlir::row_major(4)
    );
    FfiLowering::Nhwc {
        operands,
        nhwc: nhwc_operands,
        attrs,
        result: tensor_type(&out),
    }
}

/// The packed convolution kernel ([`PACKED_CONV_TARGET`]).
pub(crate) struct PackedConvKernel;

/// A channels-last view `[N, C, H, W]` of an NHWC buffer.
fn nhwc_view(b: &BufferRef<'_>) -> Result<Tensor> {
    let d = b.dims;
    if d.len() != 4 {
        return Err(Error::Invalid(format!(
            "expected an NHWC buffer, got {d:?}"
        )));
    }
    let (n, h, w, c) = (d[0], d[1], d[2], d[3]);
    b.tensor_strided(&[n, c, h, w], &[h * w * c, 1, w * c, c])
}

impl FfiKernel for PackedConvKernel {
    const TARGET: &'static str = PACKED_CONV_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        let flags = call.attr_int("epilogue")?;
        let nsources = usize::try_from(call.attr_int("sources")?)
            .map_err(|_| Error::Invalid("attribute sources < 0".into()))?;
        let act = Activation::from_call(call, "act")?;
        let pair = |name: &str| -> Result<[i64; 2]> {
            match call.attr_ints(name)? {
                &[a, b] if a >= 0 && b >= 0 => Ok([a, b]),
                v => Err(Error::Invalid(format!("attribute {name}: {v:?}"))),
            }
        };
        let geo = Geometry {
            padding: pair("padding")?,
            stride: pair("strides")?,
            dilation: pair("dilation")?,
            groups: call.attr_int("groups")?,
        };
        let has = |bit: i64| flags & bit != 0;
        let extra = has(1) as usize + has(2) as usize + has(4) as usize;
        call.expect_arity(2 + extra + nsources, 1)?;
        let (xb, wb, ob) = (call.arg(0)?, call.arg(1)?, call.ret(0)?);
        let mut next = 2;
        let mut take = |on: bool| -> Result<Option<BufferRef<'_>>> {
            if !on {
                return Ok(None);
            }
            next += 1;
            call.arg(next - 1).map(Some)
        };
        let (scale, shift, residual) = (take(has(1))?, take(has(2))?, take(has(4))?);
        let sources = (next..next + nsources)
            .map(|i| call.arg_address(i))
            .collect::<Result<_>>()?;
        // Shapes: x [N, H, W, C], w [O, C/g, kh, kw], out [N, H', W', O].
        let (xd, wd, od) = (xb.dims, wb.dims, ob.dims);
        let bad = |m: &str| {
            Error::Invalid(format!(
                "packed convolution of {xd:?} (NHWC) by {wd:?} with {geo:?} into {od:?}: {m}"
            ))
        };
        if xd.len() != 4 || wd.len() != 4 || od.len() != 4 || geo.groups < 1 {
            return Err(bad("ranks"));
        }
        let o = wd[0];
        if xd[3] != wd[1] * geo.groups || o % geo.groups != 0 || od[3] != o || od[0] != xd[0] {
            return Err(bad("channels"));
        }
        for i in 0..2 {
            let ext = xd[1 + i] + 2 * geo.padding[i];
            let k = (wd[2 + i] - 1) * geo.dilation[i] + 1;
            let want = if ext < k || geo.stride[i] < 1 {
                -1
            } else {
                (ext - k) / geo.stride[i] + 1
            };
            if want != od[1 + i] {
                return Err(bad("spatial dims"));
            }
        }
        for (name, b) in [("scale", &scale), ("shift", &shift)] {
            if b.as_ref().is_some_and(|b| b.dims != [o]) {
                return Err(bad(&format!("{name} is not [{o}]")));
            }
        }
        if residual.as_ref().is_some_and(|r| r.dims != od) {
            return Err(bad("the residual is not shaped like the result"));
        }
        if [xb.dtype, wb.dtype, ob.dtype] != [DType::F32; 3] {
            return Err(bad("f32 only"));
        }
        let key = WeightKey {
            digest: call.attr_int("digest")? as u64,
            sources,
        };
        let input = [xd[0], xd[3], xd[1], xd[2]];
        let flops = super::window_flops(od, wd);
        handoff::run_kernel(call.flag(SERIAL_ATTR), flops, || {
            let _guard = torch_lock();
            let x = nhwc_view(&xb)?;
            let packed = weights::get_or_pack(&key, || {
                let w = wb.tensor()?;
                let w = match &scale {
                    Some(s) => w.f_mul(&s.tensor()?.f_reshape([o, 1, 1, 1])?)?,
                    None => w,
                };
                onednn::pack_weight(&w, &geo, input)
            })?;
            let bias = shift.as_ref().map(|b| b.tensor()).transpose()?;
            let other = residual.as_ref().map(nhwc_view).transpose()?;
            let y = onednn::conv_pointwise(&x, &packed, bias.as_ref(), other.as_ref(), &geo, act)?;
            nhwc_view(&ob)?.f_copy_(&y)?;
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{ConvAttrs, Literal};

    fn t(d: &[usize]) -> TensorType {
        TensorType::new(DType::F32, d.to_vec())
    }

    /// `broadcast(reshape(v) to [1, C, 1, 1])` to `like`'s shape.
    fn per_ch(g: &mut Graph, v: NodeId, like: NodeId) -> NodeId {
        let c = g.node(v).ty.shape.dim(0);
        let r = g.add(Op::Reshape(Shape::new(&[1, c, 1, 1])), &[v]).unwrap();
        let shape = g.node(like).ty.shape.clone();
        g.add(
            Op::Broadcast {
                shape,
                dims: vec![0, 1, 2, 3],
            },
            &[r],
        )
        .unwrap()
    }

    fn splat(g: &mut Graph, v: f64, like: NodeId) -> NodeId {
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

    /// conv → BatchNorm-style scale and shift → `act`, on input `x` and a fresh weight of
    /// kind `kind`. Returns the convolution and the last node.
    fn conv_bn(g: &mut Graph, x: NodeId, kind: InputKind, o: usize) -> (NodeId, NodeId) {
        let c = g.node(x).ty.shape.dim(1);
        let w = g.add_input(kind, "w", t(&[o, c, 3, 3]));
        let s = g.add_input(InputKind::Buffer, "scale", t(&[o]));
        let b = g.add_input(InputKind::Parameter, "shift", t(&[o]));
        let mut a = ConvAttrs::plain(2);
        a.padding = vec![(1, 1), (1, 1)];
        let y = g.add(Op::Conv(a), &[x, w]).unwrap();
        let sb = per_ch(g, s, y);
        let m = bin(g, BinaryOp::Mul, y, sb);
        let bb = per_ch(g, b, y);
        (y, bin(g, BinaryOp::Add, m, bb))
    }

    #[test]
    fn epilogues_are_recognized_in_order_and_stop_where_they_must() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 4, 6, 6]));
        // conv-bn-relu6
        let (c1, bn1) = conv_bn(&mut g, x, InputKind::Parameter, 4);
        let lo = splat(&mut g, 0.0, bn1);
        let hi = splat(&mut g, 6.0, bn1);
        let mx = bin(&mut g, BinaryOp::Max, bn1, lo);
        let r6 = bin(&mut g, BinaryOp::Min, mx, hi);
        // main conv-bn and a downsampling conv-bn, summed, then ReLU
        let (c2, bn2) = conv_bn(&mut g, r6, InputKind::Parameter, 4);
        let (c3, bn3) = conv_bn(&mut g, r6, InputKind::Parameter, 4);
        let sum = bin(&mut g, BinaryOp::Add, bn2, bn3);
        let z = splat(&mut g, 0.0, sum);
        let relu = bin(&mut g, BinaryOp::Max, sum, z);
        // a convolution on a weight passed per call: not packed
        let (c4, _) = conv_bn(&mut g, relu, InputKind::Data, 4);
        g.set_outputs(vec![relu, c4]).unwrap();

        let p1 = packed_conv(&g, c1).unwrap();
        assert_eq!(p1.act, Activation::Clamp(0.0, 6.0));
        assert_eq!(p1.tail, r6);
        assert!(p1.scale.is_some() && p1.shift.is_some() && p1.residual.is_none());
        assert_eq!(p1.absorbed.len(), 4); // conv, mul, add, max
        assert_eq!(p1.sources.len(), 2); // the weight and the scale (the shift is read per call)
                                         // The left one of the two chains takes the sum and the ReLU.
        let p2 = packed_conv(&g, c2).unwrap();
        assert_eq!(
            (p2.residual, p2.tail, p2.act),
            (Some(bn3), relu, Activation::Relu)
        );
        let p3 = packed_conv(&g, c3).unwrap();
        assert_eq!((p3.residual, p3.tail), (None, bn3));
        assert!(packed_conv(&g, c4).is_none());
        // Every node of a chain finds it.
        for p in [&p1, &p2, &p3] {
            for &n in p.absorbed.iter().chain([&p.tail]) {
                assert_eq!(packed_chain_of(&g, n, &|_| true).as_ref(), Some(p));
            }
        }
        assert!(packed_chain_of(&g, c4, &|_| true).is_none());
        assert!(packed_chain_of(&g, c1, &|_| false).is_none());
        // The same computation from other variables: one digest, other sources (which key
        // the packed weights apart).
        assert_eq!(p2.digest, p3.digest);
        assert_ne!(p2.sources, p3.sources);
    }

    #[test]
    fn weights_updated_between_calls_or_by_the_graph_are_not_frozen() {
        for how in 0..3 {
            let mut g = Graph::new();
            let x = g.add_input(InputKind::Data, "x", t(&[1, 3, 5, 5]));
            let w = g.add_input(InputKind::Parameter, "w", t(&[2, 3, 3, 3]));
            let y = g.add(Op::Conv(ConvAttrs::plain(2)), &[x, w]).unwrap();
            let w2 = bin(&mut g, BinaryOp::Mul, w, w);
            g.set_outputs(vec![y, w2]).unwrap();
            match how {
                0 => {}
                1 => g.set_updated_between_calls(1, true).unwrap(),
                _ => g.add_alias(1, 1).unwrap(),
            }
            assert_eq!(packed_conv(&g, y).is_some(), how == 0, "case {how}");
        }
    }

    #[test]
    fn a_clamp_after_a_residual_sum_is_left_to_xla() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 4, 6, 6]));
        let (c, bn) = conv_bn(&mut g, x, InputKind::Parameter, 4);
        let sum = bin(&mut g, BinaryOp::Add, bn, x);
        let lo = splat(&mut g, 0.0, sum);
        let hi = splat(&mut g, 6.0, sum);
        let mx = bin(&mut g, BinaryOp::Max, sum, lo);
        let r6 = bin(&mut g, BinaryOp::Min, mx, hi);
        g.set_outputs(vec![r6]).unwrap();
        let p = packed_conv(&g, c).unwrap();
        assert_eq!(
            (p.residual, p.tail, p.act),
            (Some(x), sum, Activation::None)
        );
    }

    /// A residual sum whose left operand comes from no convolution (e.g. one lowered as
    /// im2col and a dot) through scale and shift ops of its own: the right chain takes the
    /// sum, and every node of that chain finds it (searching back through the left operand
    /// first used to miss it, and the sum was then emitted apart from the chain that had
    /// absorbed its operand).
    #[test]
    fn a_chain_taking_the_sum_on_the_right_is_found_from_every_node() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", t(&[2, 4, 6, 6]));
        let s = g.add_input(InputKind::Buffer, "s", t(&[4]));
        let h = g.add(Op::Unary(crate::ir::UnaryOp::Tanh), &[x]).unwrap();
        let sb = per_ch(&mut g, s, h);
        let m = bin(&mut g, BinaryOp::Mul, h, sb);
        let bb = per_ch(&mut g, s, h);
        let left = bin(&mut g, BinaryOp::Add, m, bb);
        let (c, right) = conv_bn(&mut g, x, InputKind::Parameter, 4);
        let sum = bin(&mut g, BinaryOp::Add, left, right);
        let z = splat(&mut g, 0.0, sum);
        let relu = bin(&mut g, BinaryOp::Max, sum, z);
        g.set_outputs(vec![relu]).unwrap();
        let p = packed_conv(&g, c).unwrap();
        assert_eq!((p.residual, p.tail), (Some(left), relu));
        for &n in p.absorbed.iter().chain([&p.tail]) {
            assert_eq!(
                packed_chain_of(&g, n, &|_| true).as_ref(),
                Some(&p),
                "node {n:?}"
            );
        }
        for n in [h, m, left] {
            assert!(packed_chain_of(&g, n, &|_| true).is_none());
        }
    }
}
