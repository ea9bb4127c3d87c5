//! Reverse-mode rules: for every [`Op`], the cotangents of its operands given the cotangent of
//! its value, built as graph nodes.
//!
//! The match in [`vjp`] is exhaustive (no catch-all arm): adding an op to the IR fails to compile
//! here until it has a rule.
//!
//! # Conventions and decisions
//!
//! - Only float values carry gradients. Integer and bool values (indices, masks, comparison
//!   results, the random-number generator's bits) never receive a cotangent; a float operand of
//!   an op whose result is not float (`compare`, `convert` to an integer) gets a zero gradient,
//!   like PyTorch, where such results do not require grad.
//! - Piecewise-constant functions (`floor`, `ceil`, `sign`) have a zero gradient (PyTorch's
//!   choice). `abs` has gradient `sign(x)`, 0 at 0.
//! - **Ties, binary `max`/`min` of two variables:** the gradient is split evenly between the
//!   operands where they are equal, as `torch.maximum`/`torch.minimum` do (and JAX).
//! - **Ties, binary `max`/`min` against a constant** (how ReLU, ReLU6, hardtanh, hardsigmoid
//!   and clamp are traced: `max(x, 0)`, `min(max(x, 0), 6)`): a threshold. The variable
//!   operand gets the gradient only where it strictly wins and nothing at the threshold itself,
//!   like `torch.relu`'s and `hardtanh`'s backward (and JAX's `relu`). This matters: exact
//!   zeros reach ReLUs routinely (a bias-free convolution over zero padding or over a window of
//!   ReLU zeros), and splitting there would give 1/2 where PyTorch gives 0. (`torch.clamp`
//!   itself passes the gradient at the bounds; kiln follows the activations' convention.)
//! - **Ties, `reduce` max/min:** the gradient is split evenly among all positions equal to the
//!   extremum (`torch.amax`/`amin`).
//! - **Ties, `reduce_window` max/min (pooling):** the whole gradient goes to the *first* extremal
//!   position of each window in row-major window order, like `torch.nn.functional.max_pool2d`
//!   (this is [`Op::SelectAndScatter`]'s semantics; a NaN counts as the maximum). Windows overlap
//!   freely; padding is never selected. Min pooling is routed through `-x`.
//! - `pow(a, b)`: as PyTorch, the gradient w.r.t. `a` is 0 where `b == 0`, and the gradient
//!   w.r.t. `b` is 0 where `a == 0 && b >= 0`.
//! - Indices of `take`/`scatter_add` are clamped into range by the ops; the gradients use the
//!   same clamped positions (gather ↔ scatter-add are each other's transpose).
//! - `select_and_scatter`: zero w.r.t. the operand (the selection is locally constant); w.r.t.
//!   the source, the cotangent gathered at the selected positions (so max pooling can be
//!   differentiated twice).
//! - Convolutions of any stride, padding (also negative), lhs/rhs dilation, feature groups
//!   (depthwise included) and batch groups; the gradients are convolutions again.
//! - Errors: every op has a rule, so differentiating a well-typed graph does not fail. [`vjp`]
//!   returns an error naming the op when the cotangent's type does not match the value (or a
//!   rule would build a gradient of the wrong type); [`super::joint`] rejects non-scalar or
//!   non-float losses and non-float `wrt` inputs.

use super::builder::{inverse_perm, Builder};
use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, ConvAttrs, DotDims, Graph, NodeId, Op, ReduceKind, TensorType, UnaryOp,
    WindowAttrs,
};

/// Builds into `g` the cotangents of `node`'s operands, given `ct`, the cotangent of `node`'s
/// value (same type as `node`).
///
/// `needs[i]` says whether operand `i` needs a gradient; rules skip the work for the others.
/// Returns one entry per operand: `Some(cotangent)` (same type as the operand) or `None` for a
/// zero / non-differentiable contribution.
pub fn vjp(g: &mut Graph, node: NodeId, ct: NodeId, needs: &[bool]) -> Result<Vec<Option<NodeId>>> {
    let n = g
        .get(node)
        .ok_or_else(|| Error::Graph(format!("vjp: node {node:?} is not in the graph")))?
        .clone();
    let ops: Vec<NodeId> = n.operands.to_vec();
    if needs.len() != ops.len() {
        return Err(Error::Invalid(format!(
            "vjp of {}: {} `needs` flags for {} operands",
            n.op.name(),
            needs.len(),
            ops.len()
        )));
    }
    let ct_ty = &g
        .get(ct)
        .ok_or_else(|| Error::Graph(format!("vjp: cotangent {ct:?} is not in the graph")))?
        .ty;
    if *ct_ty != n.ty {
        return Err(Error::type_error(
            format!("vjp of {}", n.op.name()),
            format!("cotangent must have the value's type {}", n.ty),
            &[ct_ty],
        ));
    }
    let none = vec![None; ops.len()];
    // Only float values carry gradients; a non-float result contributes nothing.
    if !n.ty.dtype.is_float() || !needs.iter().any(|&x| x) {
        return Ok(none);
    }
    let tys: Vec<TensorType> = ops.iter().map(|&o| g.node(o).ty.clone()).collect();
    let need = |i: usize| needs[i] && tys[i].dtype.is_float();
    let mut b = Builder::new(g);
    let y = node;
    let r: Vec<Option<NodeId>> = match &n.op {
        Op::Input(_) | Op::Constant(_) | Op::Iota { .. } => none,
        Op::Unary(u) => {
            let x = ops[0];
            let d = match u {
                UnaryOp::Neg => Some(b.neg(ct)?),
                UnaryOp::Abs => {
                    let s = b.unary(UnaryOp::Sign, x)?;
                    Some(b.mul(ct, s)?)
                }
                UnaryOp::Exp => Some(b.mul(ct, y)?),
                UnaryOp::Log => Some(b.div(ct, x)?),
                UnaryOp::Log1p => {
                    let x1 = b.add_scalar(x, 1.0)?;
                    Some(b.div(ct, x1)?)
                }
                UnaryOp::Sqrt => {
                    // grad / (2 * result), as PyTorch.
                    let y2 = b.mul_scalar(y, 2.0)?;
                    Some(b.div(ct, y2)?)
                }
                UnaryOp::Rsqrt => {
                    // -0.5 * grad * result^3
                    let y2 = b.mul(y, y)?;
                    let y3 = b.mul(y2, y)?;
                    let t = b.mul(ct, y3)?;
                    Some(b.mul_scalar(t, -0.5)?)
                }
                UnaryOp::Tanh => {
                    let y2 = b.mul(y, y)?;
                    let one_m = b.rsub_scalar(1.0, y2)?;
                    Some(b.mul(ct, one_m)?)
                }
                UnaryOp::Logistic => {
                    let one_m = b.rsub_scalar(1.0, y)?;
                    let s = b.mul(y, one_m)?;
                    Some(b.mul(ct, s)?)
                }
                UnaryOp::Erf => {
                    // 2/sqrt(pi) * exp(-x^2)
                    let x2 = b.mul(x, x)?;
                    let nx2 = b.neg(x2)?;
                    let e = b.unary(UnaryOp::Exp, nx2)?;
                    let s = b.mul_scalar(e, std::f64::consts::FRAC_2_SQRT_PI)?;
                    Some(b.mul(ct, s)?)
                }
                UnaryOp::Sin => {
                    let c = b.unary(UnaryOp::Cos, x)?;
                    Some(b.mul(ct, c)?)
                }
                UnaryOp::Cos => {
                    let s = b.unary(UnaryOp::Sin, x)?;
                    let t = b.mul(ct, s)?;
                    Some(b.neg(t)?)
                }
                // Piecewise constant: zero gradient (PyTorch's convention).
                UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Sign => None,
                // Bool/integer only; never reached for float results.
                UnaryOp::Not => None,
            };
            vec![d]
        }
        Op::Binary(op) => {
            let (a, c) = (ops[0], ops[1]);
            binary_vjp(&mut b, *op, a, c, y, ct, [need(0), need(1)])?
        }
        // Bool result: handled above (never reached with a float result).
        Op::Compare(_) => none,
        Op::Select => {
            let p = ops[0];
            let mut r = vec![None, None, None];
            if need(1) || need(2) {
                let z = b.zeros(&n.ty)?;
                if need(1) {
                    r[1] = Some(b.select(p, ct, z)?);
                }
                if need(2) {
                    r[2] = Some(b.select(p, z, ct)?);
                }
            }
            r
        }
        Op::Convert(_) => {
            if need(0) {
                vec![Some(b.convert(ct, tys[0].dtype)?)]
            } else {
                none
            }
        }
        Op::Broadcast { shape, dims } => {
            let xt = &tys[0];
            let mut axes: Vec<usize> = (0..shape.rank()).filter(|d| !dims.contains(d)).collect();
            for (i, &d) in dims.iter().enumerate() {
                if xt.shape.dim(i) == 1 && shape.dim(d) != 1 {
                    axes.push(d);
                }
            }
            let s = b.sum(ct, &axes)?;
            vec![Some(b.reshape(s, xt.shape.dims())?)]
        }
        Op::Reshape(_) => vec![Some(b.reshape(ct, tys[0].shape.dims())?)],
        Op::Transpose(perm) => vec![Some(b.transpose(ct, &inverse_perm(perm))?)],
        Op::Slice {
            start,
            limit: _,
            stride,
        } => {
            let xt = &tys[0];
            if n.ty.shape.numel() == 0 {
                vec![None]
            } else {
                let r = xt.shape.rank();
                let mut low = Vec::with_capacity(r);
                let mut high = Vec::with_capacity(r);
                let mut interior = Vec::with_capacity(r);
                for i in 0..r {
                    let out = n.ty.shape.dim(i);
                    let last = start[i] + (out - 1) * stride[i];
                    low.push(start[i] as i64);
                    high.push(xt.shape.dim(i) as i64 - last as i64 - 1);
                    interior.push(stride[i] - 1);
                }
                vec![Some(b.pad_zero(ct, low, high, interior)?)]
            }
        }
        Op::Concat { axis } => {
            let r = n.ty.shape.rank();
            let mut off = 0;
            let mut out = Vec::with_capacity(ops.len());
            for (i, t) in tys.iter().enumerate() {
                let len = t.shape.dim(*axis);
                if need(i) {
                    let mut start = vec![0; r];
                    let mut limit = n.ty.shape.dims().to_vec();
                    start[*axis] = off;
                    limit[*axis] = off + len;
                    out.push(Some(b.slice(ct, start, limit, vec![1; r])?));
                } else {
                    out.push(None);
                }
                off += len;
            }
            out
        }
        Op::Pad {
            low,
            high,
            interior,
        } => {
            let xt = &tys[0];
            let r = xt.shape.rank();
            // Undo the edge padding (negative edges become zero fill), then drop the interior.
            let nl: Vec<i64> = low.iter().map(|&l| -l).collect();
            let nh: Vec<i64> = high.iter().map(|&h| -h).collect();
            let un = b.pad_zero(ct, nl, nh, vec![0; r])?;
            let inner = b.ty(un).shape.dims().to_vec();
            let stride: Vec<usize> = interior.iter().map(|&i| i + 1).collect();
            let dx = b.slice(un, vec![0; r], inner, stride)?;
            let dv = if need(1) {
                // The padding value's gradient: everything that did not land on the operand.
                let t = b.sum_all(ct)?;
                let s = b.sum_all(dx)?;
                Some(b.sub(t, s)?)
            } else {
                None
            };
            vec![need(0).then_some(dx), dv]
        }
        Op::Reverse(dims) => vec![Some(b.op(Op::Reverse(dims.clone()), &[ct])?)],
        Op::DotGeneral(d) => dot_vjp(&mut b, d, ops[0], ops[1], ct, [need(0), need(1)])?,
        Op::Reduce { kind, axes } => {
            let x = ops[0];
            let xt = &tys[0];
            let kept: Vec<usize> = (0..xt.shape.rank()).filter(|i| !axes.contains(i)).collect();
            let dx = match kind {
                ReduceKind::Sum => b.broadcast(ct, &xt.shape, kept)?,
                ReduceKind::Max | ReduceKind::Min => {
                    // Split evenly among the positions equal to the extremum (torch.amax).
                    let yb = b.broadcast(y, &xt.shape, kept.clone())?;
                    let eq = b.compare(CompareOp::Eq, x, yb)?;
                    let mask = b.convert(eq, xt.dtype)?;
                    let count = b.sum(mask, axes)?;
                    let share = b.div(ct, count)?;
                    let sb = b.broadcast(share, &xt.shape, kept)?;
                    b.mul(sb, mask)?
                }
            };
            vec![Some(dx)]
        }
        Op::ReduceWindow { kind, attrs } => {
            let x = ops[0];
            let dx = match kind {
                ReduceKind::Sum => reduce_window_sum_transpose(&mut b, attrs, &tys[0], ct)?,
                ReduceKind::Max => b.op(Op::SelectAndScatter(attrs.clone()), &[x, ct])?,
                ReduceKind::Min => {
                    // min-pool(x) = -max-pool(-x): route to the first minimum.
                    let nx = b.neg(x)?;
                    b.op(Op::SelectAndScatter(attrs.clone()), &[nx, ct])?
                }
            };
            vec![Some(dx)]
        }
        Op::SelectAndScatter(attrs) => {
            // Locally constant in the operand (the selection does not move under small
            // perturbations); linear in the source, whose transpose gathers the cotangent at the
            // selected positions.
            let ds = if need(1) {
                Some(select_and_scatter_source_transpose(
                    &mut b, attrs, ops[0], &tys[0], &tys[1], ct,
                )?)
            } else {
                None
            };
            vec![None, ds]
        }
        Op::Conv(c) => {
            let (dx, dw) = conv_vjp(&mut b, c, ops[0], ops[1], ct, [need(0), need(1)])?;
            vec![dx, dw]
        }
        Op::Take { axis } => {
            let dx = if need(0) {
                let z = b.zeros(&tys[0])?;
                Some(b.op(Op::ScatterAdd { axis: *axis }, &[z, ops[1], ct])?)
            } else {
                None
            };
            vec![dx, None]
        }
        Op::ScatterAdd { axis } => {
            let du = if need(2) {
                Some(b.op(Op::Take { axis: *axis }, &[ct, ops[1]])?)
            } else {
                None
            };
            vec![need(0).then_some(ct), None, du]
        }
        // Every replica's loss reads the sum, so each operand's gradient sums the replicas'
        // cotangents.
        Op::AllReduce(ReduceKind::Sum) => vec![Some(b.op(Op::AllReduce(ReduceKind::Sum), &[ct])?)],
        // The value is operand 0's; the others only order it.
        Op::Barrier => (0..ops.len())
            .map(|i| (i == 0 && need(0)).then_some(ct))
            .collect(),
        // The operand is a constant as far as gradients go.
        Op::StopGradient => none,
        Op::AllReduce(kind @ (ReduceKind::Max | ReduceKind::Min)) => {
            return Err(Error::Unsupported {
                backend: "autograd".into(),
                what: format!("the gradient of a cross-replica {}", kind.name()),
            })
        }
    };
    // Drop contributions to operands that do not need them, and check types.
    let mut out = Vec::with_capacity(r.len());
    for (i, d) in r.into_iter().enumerate() {
        match d {
            Some(d) if need(i) => {
                let t = &b.graph().node(d).ty;
                if *t != tys[i] {
                    return Err(Error::type_error(
                        format!("vjp of {}", n.op.name()),
                        format!("rule produced {t} for operand {i} of type {}", tys[i]),
                        &[&tys[i]],
                    ));
                }
                out.push(Some(d));
            }
            _ => out.push(None),
        }
    }
    Ok(out)
}

fn binary_vjp(
    b: &mut Builder<'_>,
    op: BinaryOp,
    a: NodeId,
    c: NodeId,
    y: NodeId,
    ct: NodeId,
    need: [bool; 2],
) -> Result<Vec<Option<NodeId>>> {
    let mut r = vec![None, None];
    match op {
        BinaryOp::Add => {
            r = vec![Some(ct), Some(ct)];
        }
        BinaryOp::Sub => {
            r[0] = Some(ct);
            if need[1] {
                r[1] = Some(b.neg(ct)?);
            }
        }
        BinaryOp::Mul => {
            if need[0] {
                r[0] = Some(b.mul(ct, c)?);
            }
            if need[1] {
                r[1] = Some(b.mul(ct, a)?);
            }
        }
        BinaryOp::Div => {
            if need[0] {
                r[0] = Some(b.div(ct, c)?);
            }
            if need[1] {
                // -grad * a / (b * b)
                let num = b.mul(ct, a)?;
                let den = b.mul(c, c)?;
                let q = b.div(num, den)?;
                r[1] = Some(b.neg(q)?);
            }
        }
        BinaryOp::Rem => {
            r[0] = Some(ct);
            if need[1] {
                // -grad * trunc(a / b)
                let q = b.div(a, c)?;
                let fl = b.unary(UnaryOp::Floor, q)?;
                let ce = b.unary(UnaryOp::Ceil, q)?;
                let z = b.full_like(q, 0.0)?;
                let neg = b.compare(CompareOp::Lt, q, z)?;
                let tr = b.select(neg, ce, fl)?;
                let t = b.mul(ct, tr)?;
                r[1] = Some(b.neg(t)?);
            }
        }
        BinaryOp::Pow => {
            let zero = b.full_like(a, 0.0)?;
            if need[0] {
                // where(b == 0, 0, grad * b * a^(b - 1))
                let bm1 = b.add_scalar(c, -1.0)?;
                let p = b.binary(BinaryOp::Pow, a, bm1)?;
                let t = b.mul(c, p)?;
                let t = b.mul(ct, t)?;
                let is0 = b.compare(CompareOp::Eq, c, zero)?;
                r[0] = Some(b.select(is0, zero, t)?);
            }
            if need[1] {
                // where(a == 0 && b >= 0, 0, grad * y * log(a))
                let la = b.unary(UnaryOp::Log, a)?;
                let t = b.mul(y, la)?;
                let t = b.mul(ct, t)?;
                let a0 = b.compare(CompareOp::Eq, a, zero)?;
                let bge = b.compare(CompareOp::Ge, c, zero)?;
                let cond = b.binary(BinaryOp::And, a0, bge)?;
                r[1] = Some(b.select(cond, zero, t)?);
            }
        }
        BinaryOp::Max | BinaryOp::Min => {
            let (win, lose) = if op == BinaryOp::Max {
                (CompareOp::Gt, CompareOp::Lt)
            } else {
                (CompareOp::Lt, CompareOp::Gt)
            };
            let zero = b.full_like(ct, 0.0)?;
            let (ca, cc) = (is_constant(b, a), is_constant(b, c));
            if ca != cc {
                // A threshold against a constant (relu = max(x, 0), relu6/hardtanh = clamp):
                // the gradient passes only where x strictly wins, none at the threshold itself,
                // like torch.relu / torch.nn.functional.hardtanh (and JAX's relu).
                let (x, k, i) = if ca { (c, a, 1) } else { (a, c, 0) };
                if need[i] {
                    let w = b.compare(win, x, k)?;
                    r[i] = Some(b.select(w, ct, zero)?);
                }
            } else {
                // torch.maximum: where(a == b, grad / 2, grad), zeroed where the operand lost.
                let half = b.mul_scalar(ct, 0.5)?;
                let eq = b.compare(CompareOp::Eq, a, c)?;
                let shared = b.select(eq, half, ct)?;
                if need[0] {
                    let l = b.compare(lose, a, c)?;
                    r[0] = Some(b.select(l, zero, shared)?);
                }
                if need[1] {
                    let l = b.compare(lose, c, a)?;
                    r[1] = Some(b.select(l, zero, shared)?);
                }
            }
        }
        // Integer/bool only; never reached with float operands.
        BinaryOp::And
        | BinaryOp::Or
        | BinaryOp::Xor
        | BinaryOp::ShiftLeft
        | BinaryOp::ShiftRightLogical => {}
    }
    Ok(r)
}

/// Is `x` a constant: a literal or an iota, possibly broadcast, reshaped, transposed or
/// converted (how scalars such as the 0 of a ReLU appear in traced graphs)?
fn is_constant(b: &mut Builder<'_>, x: NodeId) -> bool {
    let mut cur = x;
    loop {
        let n = b.graph().node(cur);
        match &n.op {
            Op::Constant(_) | Op::Iota { .. } => return true,
            Op::Broadcast { .. } | Op::Reshape(_) | Op::Transpose(_) | Op::Convert(_) => {
                cur = n.operands[0];
            }
            _ => return false,
        }
    }
}

/// Gradients of `dot_general(a, b)`: each is a `dot_general` of the cotangent with the other
/// operand over that operand's free dims, transposed back to the operand's layout.
fn dot_vjp(
    bd: &mut Builder<'_>,
    d: &DotDims,
    a: NodeId,
    c: NodeId,
    ct: NodeId,
    need: [bool; 2],
) -> Result<Vec<Option<NodeId>>> {
    let (at, ct_ty) = (bd.ty(a), bd.ty(c));
    let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
        (0..rank)
            .filter(|i| !batch.contains(i) && !contract.contains(i))
            .collect()
    };
    let af = free(at.shape.rank(), &d.lhs_batch, &d.lhs_contract);
    let bf = free(ct_ty.shape.rank(), &d.rhs_batch, &d.rhs_contract);
    let nb = d.lhs_batch.len();
    let mut r = vec![None, None];
    // Gradient of one side. `own_*` describe the side being differentiated, `other` the other
    // operand; the cotangent's dims are [batch, lhs free, rhs free].
    let side = |bd: &mut Builder<'_>,
                own_rank: usize,
                own_batch: &[usize],
                own_contract: &[usize],
                own_free: &[usize],
                other: NodeId,
                other_batch: &[usize],
                other_contract: &[usize],
                other_free: &[usize],
                ct_free_offset: usize|
     -> Result<NodeId> {
        let dims = DotDims {
            lhs_batch: (0..nb).collect(),
            rhs_batch: other_batch.to_vec(),
            lhs_contract: (0..other_free.len()).map(|j| ct_free_offset + j).collect(),
            rhs_contract: other_free.to_vec(),
        };
        let g = bd.op(Op::DotGeneral(dims), &[ct, other])?;
        // Result dims: [batch, own free, other's contracting dims in increasing order].
        let mut sorted_other: Vec<usize> = other_contract.to_vec();
        sorted_other.sort_unstable();
        let mut perm = vec![0; own_rank];
        for (k, &dim) in own_batch.iter().enumerate() {
            perm[dim] = k;
        }
        for (j, &dim) in own_free.iter().enumerate() {
            perm[dim] = nb + j;
        }
        for (k, &dim) in own_contract.iter().enumerate() {
            let partner = other_contract[k];
            let pos = sorted_other.iter().position(|&x| x == partner).unwrap_or(0);
            perm[dim] = nb + own_free.len() + pos;
        }
        bd.transpose(g, &perm)
    };
    if need[0] {
        r[0] = Some(side(
            bd,
            at.shape.rank(),
            &d.lhs_batch,
            &d.lhs_contract,
            &af,
            c,
            &d.rhs_batch,
            &d.rhs_contract,
            &bf,
            nb + af.len(),
        )?);
    }
    if need[1] {
        r[1] = Some(side(
            bd,
            ct_ty.shape.rank(),
            &d.rhs_batch,
            &d.rhs_contract,
            &bf,
            a,
            &d.lhs_batch,
            &d.lhs_contract,
            &af,
            nb,
        )?);
    }
    Ok(r)
}

/// The transpose of a windowed sum: pad the cotangent (interior = stride - 1, edges so that every
/// input position sees the windows covering it) and sum it over stride-1 windows.
fn reduce_window_sum_transpose(
    b: &mut Builder<'_>,
    w: &WindowAttrs,
    xt: &TensorType,
    ct: NodeId,
) -> Result<NodeId> {
    let out = b.ty(ct);
    let n = w.window.len();
    let mut low = vec![0i64, 0];
    let mut high = vec![0i64, 0];
    let mut interior = vec![0usize, 0];
    for i in 0..n {
        let k = w.window[i] as i64;
        let x = xt.shape.dim(i + 2) as i64;
        let od = (out.shape.dim(i + 2) as i64 - 1) * w.strides[i] as i64 + 1;
        let lo = k - 1 - w.padding[i].0 as i64;
        low.push(lo);
        high.push(x + k - 1 - od - lo);
        interior.push(w.strides[i] - 1);
    }
    let p = b.pad_zero(ct, low, high, interior)?;
    b.op(
        Op::ReduceWindow {
            kind: ReduceKind::Sum,
            attrs: WindowAttrs {
                window: w.window.clone(),
                strides: vec![1; n],
                padding: vec![(0, 0); n],
            },
        },
        &[p],
    )
}

/// The transpose of `select_and_scatter` w.r.t. its source: for each window, the cotangent at the
/// element the forward op selects (NaN above any number, then the larger value, then the first
/// in row-major window order; padding is never selected and a window of pure padding gets 0).
/// Built from strided slices, one per window offset, and a running comparison.
fn select_and_scatter_source_transpose(
    b: &mut Builder<'_>,
    w: &WindowAttrs,
    x: NodeId,
    xt: &TensorType,
    st: &TensorType,
    ct: NodeId,
) -> Result<NodeId> {
    let n = w.window.len();
    let mut low = vec![0i64, 0];
    let mut high = vec![0i64, 0];
    for &(l, h) in &w.padding {
        low.push(l as i64);
        high.push(h as i64);
    }
    let xp = b.pad_value(x, 0.0, low.clone(), high.clone())?;
    let cp = b.pad_value(ct, 0.0, low.clone(), high.clone())?;
    let ones = b.full(xt, 1.0)?;
    let vp = b.pad_value(ones, 0.0, low, high)?;
    let total: usize = w.window.iter().product();
    // (value, cotangent, is real, is NaN) of the current choice per window.
    let mut best: Option<(NodeId, NodeId, NodeId, NodeId)> = None;
    for flat in 0..total {
        // Row-major window offset.
        let mut off = vec![0usize; n];
        let mut rem = flat;
        for k in (0..n).rev() {
            off[k] = rem % w.window[k];
            rem /= w.window[k];
        }
        let mut start = vec![0usize, 0];
        let mut limit = vec![xt.shape.dim(0), xt.shape.dim(1)];
        let mut stride = vec![1usize, 1];
        for (k, &o) in off.iter().enumerate() {
            let out = st.shape.dim(k + 2);
            start.push(o);
            limit.push(o + (out.max(1) - 1) * w.strides[k] + 1);
            stride.push(w.strides[k]);
        }
        let xs = b.slice(xp, start.clone(), limit.clone(), stride.clone())?;
        let cs = b.slice(cp, start.clone(), limit.clone(), stride.clone())?;
        let vs = b.slice(vp, start, limit, stride)?;
        let half = b.full_like(vs, 0.5)?;
        let real = b.compare(CompareOp::Gt, vs, half)?;
        let nan = b.compare(CompareOp::Ne, xs, xs)?;
        best = Some(match best {
            None => (xs, cs, real, nan),
            Some((bx, bc, breal, bnan)) => {
                // take = real && (!best_real || (nan && !best_nan) || x > best)
                let gt = b.compare(CompareOp::Gt, xs, bx)?;
                let not_bnan = b.unary(UnaryOp::Not, bnan)?;
                let nan_wins = b.binary(BinaryOp::And, nan, not_bnan)?;
                let not_breal = b.unary(UnaryOp::Not, breal)?;
                let better = b.binary(BinaryOp::Or, gt, nan_wins)?;
                let better = b.binary(BinaryOp::Or, better, not_breal)?;
                let take = b.binary(BinaryOp::And, real, better)?;
                (
                    b.select(take, xs, bx)?,
                    b.select(take, cs, bc)?,
                    b.binary(BinaryOp::Or, take, breal)?,
                    b.select(take, nan, bnan)?,
                )
            }
        });
    }
    let (_, c, real, _) =
        best.ok_or_else(|| Error::Invalid("select_and_scatter with an empty window".into()))?;
    let zero = b.full_like(c, 0.0)?;
    b.select(real, c, zero)
}

/// Gradients of a convolution. A batch-grouped convolution is first rewritten as a
/// feature-grouped one (batch group `g` = a contiguous block of the batch feeding output-feature
/// block `g`), then:
///
/// - input: a convolution of the cotangent with the spatially reversed kernel (in/out features
///   swapped within each group), `lhs_dilation` = forward strides, strides = forward
///   `lhs_dilation`, padding chosen so that the result covers the input exactly;
/// - kernel: a convolution of the input (batch and feature dims swapped, groups moved into the
///   feature dim) with the cotangent as kernel, strides = forward `rhs_dilation` and
///   `rhs_dilation` = forward strides; feature groups only, no batch groups.
fn conv_vjp(
    b: &mut Builder<'_>,
    c: &ConvAttrs,
    x: NodeId,
    w: NodeId,
    ct: NodeId,
    need: [bool; 2],
) -> Result<(Option<NodeId>, Option<NodeId>)> {
    if c.batch_groups > 1 && c.feature_groups > 1 {
        return Err(Error::Invalid(
            "vjp of conv: feature and batch groups both > 1".into(),
        ));
    }
    if c.batch_groups > 1 {
        let bg = c.batch_groups;
        let xt = b.ty(x);
        let d = xt.shape.dims().to_vec();
        let r = d.len();
        let nb = d[0] / bg;
        let mut split = vec![bg, nb];
        split.extend_from_slice(&d[1..]);
        let xs = b.reshape(x, &split)?;
        let mut perm = vec![1, 0];
        perm.extend(2..r + 1);
        let xt2 = b.transpose(xs, &perm)?;
        let mut merged = vec![nb, bg * d[1]];
        merged.extend_from_slice(&d[2..]);
        let x2 = b.reshape(xt2, &merged)?;
        let mut c2 = c.clone();
        c2.batch_groups = 1;
        c2.feature_groups = bg;
        let (dx2, dw) = conv_vjp(b, &c2, x2, w, ct, need)?;
        let dx = match dx2 {
            Some(dx2) => {
                let mut s = vec![nb, bg];
                s.extend_from_slice(&d[1..]);
                let t = b.reshape(dx2, &s)?;
                let t = b.transpose(t, &perm)?;
                Some(b.reshape(t, &d)?)
            }
            None => None,
        };
        return Ok((dx, dw));
    }
    let xt = b.ty(x);
    let wt = b.ty(w);
    let yt = b.ty(ct);
    let n = c.strides.len();
    let g = c.feature_groups;
    let (batch, cin) = (xt.shape.dim(0), xt.shape.dim(1));
    let (cout, cin_g) = (wt.shape.dim(0), wt.shape.dim(1));
    let cout_g = cout / g;
    let ksp: Vec<usize> = wt.shape.dims()[2..].to_vec();
    let xsp: Vec<usize> = xt.shape.dims()[2..].to_vec();
    let ysp: Vec<usize> = yt.shape.dims()[2..].to_vec();
    let dil = |size: usize, d: usize| -> i64 {
        if size == 0 {
            0
        } else {
            ((size - 1) * d + 1) as i64
        }
    };
    let mut dx = None;
    let mut dw = None;
    if need[0] {
        // Kernel [O, C/g, k] -> [g, O/g, C/g, k] -> [g, C/g, O/g, k] -> [C, O/g, k], reversed.
        let mut s = vec![g, cout_g, cin_g];
        s.extend_from_slice(&ksp);
        let k1 = b.reshape(w, &s)?;
        let mut perm = vec![0, 2, 1];
        perm.extend(3..n + 3);
        let k2 = b.transpose(k1, &perm)?;
        let mut s2 = vec![cin, cout_g];
        s2.extend_from_slice(&ksp);
        let k3 = b.reshape(k2, &s2)?;
        let sp: Vec<usize> = (2..n + 2).collect();
        let kr = b.op(Op::Reverse(sp), &[k3])?;
        let mut padding = Vec::with_capacity(n);
        for i in 0..n {
            let xd = dil(xsp[i], c.lhs_dilation[i]);
            let kd = dil(ksp[i], c.rhs_dilation[i]);
            let od = dil(ysp[i], c.strides[i]);
            let before = kd - 1 - c.padding[i].0;
            let after = xd + kd - 1 - od - before;
            padding.push((before, after));
        }
        let attrs = ConvAttrs {
            strides: c.lhs_dilation.clone(),
            padding,
            lhs_dilation: c.strides.clone(),
            rhs_dilation: c.rhs_dilation.clone(),
            feature_groups: g,
            batch_groups: 1,
        };
        dx = Some(b.op(Op::Conv(attrs), &[ct, kr])?);
    }
    if need[1] {
        // Input [N, C, s] -> [N, g, C/g, s] -> [C/g, g, N, s] -> [C/g, g*N, s].
        let mut s = vec![batch, g, cin_g];
        s.extend_from_slice(&xsp);
        let x1 = b.reshape(x, &s)?;
        let mut perm = vec![2, 1, 0];
        perm.extend(3..n + 3);
        let x2 = b.transpose(x1, &perm)?;
        let mut s2 = vec![cin_g, g * batch];
        s2.extend_from_slice(&xsp);
        let lhs = b.reshape(x2, &s2)?;
        // Cotangent [N, O, s'] -> [O, N, s'] used as the kernel.
        let mut p2 = vec![1, 0];
        p2.extend(2..n + 2);
        let rhs = b.transpose(ct, &p2)?;
        let mut padding = Vec::with_capacity(n);
        for i in 0..n {
            let xd = dil(xsp[i], c.lhs_dilation[i]);
            let kd = dil(ksp[i], c.rhs_dilation[i]);
            let od = dil(ysp[i], c.strides[i]);
            let lo = c.padding[i].0;
            padding.push((lo, od - xd + kd - lo - 1));
        }
        let attrs = ConvAttrs {
            strides: c.rhs_dilation.clone(),
            padding,
            lhs_dilation: c.lhs_dilation.clone(),
            rhs_dilation: c.strides.clone(),
            feature_groups: g,
            batch_groups: 1,
        };
        let r = b.op(Op::Conv(attrs), &[lhs, rhs])?;
        // [C/g, O, k] -> [O, C/g, k]
        dw = Some(b.transpose(r, &p2)?);
    }
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, InputKind};

    #[test]
    fn cotangent_type_is_checked() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let y = g.add(Op::Unary(UnaryOp::Exp), &[x]).unwrap();
        let bad = g.add_input(InputKind::Cotangent, "ct", TensorType::new(DType::F32, [4]));
        let e = vjp(&mut g, y, bad, &[true]).unwrap_err().to_string();
        assert!(e.contains("exp"), "{e}");
        assert!(vjp(&mut g, y, bad, &[true, true]).is_err());
    }

    #[test]
    fn integer_results_and_unneeded_operands_get_nothing() {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(DType::F32, [3]));
        let w = g.add_input(InputKind::Data, "w", TensorType::new(DType::F32, [3]));
        let c = g.add(Op::Compare(CompareOp::Lt), &[x, w]).unwrap();
        let ct = g.add_input(
            InputKind::Cotangent,
            "ct",
            TensorType::new(DType::Bool, [3]),
        );
        assert_eq!(vjp(&mut g, c, ct, &[true, true]).unwrap(), vec![None, None]);
        let m = g.add(Op::Binary(BinaryOp::Mul), &[x, w]).unwrap();
        let ct = g.add_input(
            InputKind::Cotangent,
            "ct2",
            TensorType::new(DType::F32, [3]),
        );
        let before = g.len();
        let r = vjp(&mut g, m, ct, &[false, true]).unwrap();
        assert!(r[0].is_none() && r[1].is_some());
        assert_eq!(g.len(), before + 1, "only ct * x is built");
    }
}
