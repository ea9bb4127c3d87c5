//! The eager backend: interprets graphs op by op with libtorch (tch).
//!
//! [`eval_op`] gives every [`Op`] its meaning on tch tensors. It is used twice: by
//! [`EagerBackend`] to run whole graphs, and by [`crate::Tensor`] when no trace is active, so
//! eager-mode model code and compiled graphs share one definition of each primitive.
//!
//! `U32` values are held in `Int64` tensors (libtorch's unsigned 32-bit support is partial) and
//! re-wrapped to 32 bits after every op that can overflow, so the threefry generator's integer
//! arithmetic gives the same bits here as in XLA.

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, NodeId, Op, ReduceKind, TensorType,
    UnaryOp, WindowAttrs,
};
use std::collections::HashMap;
use tch::{Kind, Tensor};

/// The tch kind that holds values of `d`.
pub fn kind_of(d: DType) -> Kind {
    match d {
        DType::Bool => Kind::Bool,
        DType::U32 | DType::I64 => Kind::Int64,
        DType::I32 => Kind::Int,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::BF16 => Kind::BFloat16,
        DType::F16 => Kind::Half,
    }
}

const U32_MASK: i64 = 0xFFFF_FFFF;

fn wrap_u32(t: Tensor, d: DType) -> Result<Tensor> {
    if d == DType::U32 {
        Ok(t.f_bitwise_and(U32_MASK)?)
    } else {
        Ok(t)
    }
}

fn scalar_like(value: f64, d: DType) -> Result<Tensor> {
    Ok(Tensor::f_scalar_tensor(
        value,
        (kind_of(d), tch::Device::Cpu),
    )?)
}

/// Evaluates one op on tch tensors. `out` is the op's inferred result type (the caller has
/// already type-checked the operands).
pub fn eval_op(
    op: &Op,
    args: &[&Tensor],
    arg_types: &[&TensorType],
    out: &TensorType,
) -> Result<Tensor> {
    let t = match op {
        Op::Input(i) => {
            return Err(Error::Graph(format!(
                "input {i} cannot be evaluated as an op; bind it to a value"
            )))
        }
        Op::Constant(lit) => {
            HostTensor::from_bytes(lit.ty().clone(), lit.bytes().to_vec())?.to_tch()?
        }
        Op::Iota { ty, dim } => {
            let n = ty.shape.dim(*dim) as i64;
            let mut view = vec![1i64; ty.shape.rank()];
            view[*dim] = n;
            Tensor::f_arange(n, (kind_of(ty.dtype), tch::Device::Cpu))?
                .f_reshape(&view)?
                .f_expand(ty.shape.to_i64(), false)?
                .f_contiguous()?
        }
        Op::Unary(u) => unary(*u, args[0], out.dtype)?,
        Op::Binary(b) => binary(*b, args[0], args[1], out.dtype)?,
        Op::Compare(c) => {
            let (a, b) = (args[0], args[1]);
            match c {
                CompareOp::Eq => a.f_eq_tensor(b)?,
                CompareOp::Ne => a.f_ne_tensor(b)?,
                CompareOp::Lt => a.f_lt_tensor(b)?,
                CompareOp::Le => a.f_le_tensor(b)?,
                CompareOp::Gt => a.f_gt_tensor(b)?,
                CompareOp::Ge => a.f_ge_tensor(b)?,
            }
        }
        Op::Select => args[1].f_where_self(args[0], args[2])?,
        Op::Convert(d) => convert(args[0], arg_types[0].dtype, *d)?,
        Op::Broadcast { shape, dims } => {
            let mut view = vec![1i64; shape.rank()];
            for (i, &d) in dims.iter().enumerate() {
                view[d] = arg_types[0].shape.dim(i) as i64;
            }
            args[0].f_reshape(&view)?.f_expand(shape.to_i64(), false)?
        }
        Op::Reshape(shape) => args[0].f_reshape(shape.to_i64())?,
        Op::Transpose(perm) => {
            let p: Vec<i64> = perm.iter().map(|&p| p as i64).collect();
            args[0].f_permute(&p)?
        }
        Op::Slice {
            start,
            limit,
            stride,
        } => {
            let mut t = args[0].shallow_clone();
            for d in 0..start.len() {
                let full = start[d] == 0 && stride[d] == 1 && limit[d] == arg_types[0].shape.dim(d);
                if !full {
                    t = t.f_slice(
                        d as i64,
                        Some(start[d] as i64),
                        Some(limit[d] as i64),
                        stride[d] as i64,
                    )?;
                }
            }
            t
        }
        Op::Concat { axis } => Tensor::f_cat(args, *axis as i64)?,
        Op::Pad {
            low,
            high,
            interior,
        } => pad(
            args[0],
            args[1],
            low,
            high,
            interior,
            &arg_types[0].shape.to_i64(),
        )?,
        Op::Reverse(dims) => {
            let d: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
            args[0].f_flip(&d)?
        }
        Op::DotGeneral(d) => dot_general(d, args[0], args[1], arg_types[0], arg_types[1], out)?,
        Op::Reduce { kind, axes } => {
            if axes.is_empty() {
                args[0].shallow_clone()
            } else {
                let a: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
                reduce(*kind, args[0], &a, out)?
            }
        }
        Op::ReduceWindow { kind, attrs } => {
            reduce_window(*kind, attrs, args[0], arg_types[0], out)?
        }
        Op::SelectAndScatter(attrs) => {
            select_and_scatter(attrs, args[0], args[1], arg_types[0], arg_types[1])?
        }
        Op::Conv(c) => conv(c, args[0], args[1], arg_types[0])?,
        // The interpreter runs one replica: combining it with itself alone is the identity.
        Op::AllReduce(_) => args[0].f_contiguous()?.copy(),
        // An ordering for the compiler; eagerly, every operand is computed already.
        Op::Barrier => args[0].shallow_clone(),
        Op::StopGradient => args[0].detach(),
        // Nothing to gather (the type rule rejects a non-empty result from an empty axis).
        Op::Take { .. } if out.shape.numel() == 0 => {
            Tensor::f_zeros(out.shape.to_i64(), (kind_of(out.dtype), tch::Device::Cpu))?
        }
        Op::Take { axis } => {
            let x = args[0];
            let n = arg_types[0].shape.dim(*axis) as i64;
            let idx = args[1]
                .f_to_kind(Kind::Int64)?
                .f_clamp(0, (n - 1).max(0))?
                .f_reshape([-1])?;
            x.f_index_select(*axis as i64, &idx)?
                .f_reshape(out.shape.to_i64())?
        }
        // No updates, or nowhere to add them (libtorch's index_add rejects both).
        Op::ScatterAdd { .. }
            if arg_types[0].shape.numel() == 0 || arg_types[2].shape.numel() == 0 =>
        {
            args[0].shallow_clone()
        }
        Op::ScatterAdd { axis } => {
            let (base, ty) = (args[0], arg_types[0]);
            let n = ty.shape.dim(*axis) as i64;
            let idx = args[1]
                .f_to_kind(Kind::Int64)?
                .f_clamp(0, (n - 1).max(0))?
                .f_reshape([-1])?;
            let mut flat = ty.shape.to_i64()[..*axis].to_vec();
            flat.push(arg_types[1].shape.numel() as i64);
            flat.extend_from_slice(&ty.shape.to_i64()[axis + 1..]);
            let upd = args[2].f_reshape(&flat)?;
            wrap_u32(base.f_index_add(*axis as i64, &idx, &upd)?, ty.dtype)?
        }
    };
    Ok(t)
}

fn unary(u: UnaryOp, a: &Tensor, d: DType) -> Result<Tensor> {
    Ok(match u {
        UnaryOp::Neg => a.f_neg()?,
        UnaryOp::Abs => a.f_abs()?,
        UnaryOp::Exp => a.f_exp()?,
        UnaryOp::Log => a.f_log()?,
        UnaryOp::Log1p => a.f_log1p()?,
        UnaryOp::Sqrt => a.f_sqrt()?,
        UnaryOp::Rsqrt => a.f_rsqrt()?,
        UnaryOp::Tanh => a.f_tanh()?,
        UnaryOp::Logistic => a.f_sigmoid()?,
        UnaryOp::Erf => a.f_erf()?,
        UnaryOp::Sin => a.f_sin()?,
        UnaryOp::Cos => a.f_cos()?,
        UnaryOp::Floor => a.f_floor()?,
        UnaryOp::Ceil => a.f_ceil()?,
        // StableHLO: ±0 and NaN are returned unchanged (libtorch gives +0 for both).
        UnaryOp::Sign if d.is_float() => a
            .f_sign()?
            .f_where_self(&a.f_ne(0.0)?.f_logical_and(&a.f_eq_tensor(a)?)?, a)?,
        UnaryOp::Sign => a.f_sign()?,
        UnaryOp::Not if d == DType::Bool => a.f_logical_not()?,
        UnaryOp::Not => wrap_u32(a.f_bitwise_not()?, d)?,
    })
}

fn binary(b: BinaryOp, x: &Tensor, y: &Tensor, d: DType) -> Result<Tensor> {
    let boolean = d == DType::Bool;
    Ok(match b {
        BinaryOp::Add => wrap_u32(x.f_add(y)?, d)?,
        BinaryOp::Sub => wrap_u32(x.f_sub(y)?, d)?,
        BinaryOp::Mul => wrap_u32(x.f_mul(y)?, d)?,
        BinaryOp::Div if d.is_float() => x.f_div(y)?,
        BinaryOp::Rem if d.is_float() => x.f_fmod_tensor(y)?,
        BinaryOp::Div | BinaryOp::Rem => int_div_rem(b, x, y, d)?,
        BinaryOp::Pow => x.f_pow(y)?,
        BinaryOp::Max => x.f_maximum(y)?,
        BinaryOp::Min => x.f_minimum(y)?,
        BinaryOp::And if boolean => x.f_logical_and(y)?,
        BinaryOp::Or if boolean => x.f_logical_or(y)?,
        BinaryOp::Xor if boolean => x.f_logical_xor(y)?,
        BinaryOp::And => x.f_bitwise_and_tensor(y)?,
        BinaryOp::Or => x.f_bitwise_or_tensor(y)?,
        BinaryOp::Xor => x.f_bitwise_xor_tensor(y)?,
        BinaryOp::ShiftLeft | BinaryOp::ShiftRightLogical => shift(b, x, y, d)?,
    })
}

/// Integer division and remainder with StableHLO/XLA's total semantics: truncation toward
/// zero, remainder with the dividend's sign, `x / 0 = -1` (all ones), `x % 0 = x`,
/// `MIN / -1 = MIN` and `MIN % -1 = 0`. libtorch raises on a zero divisor and traps on
/// `MIN / -1`, so those divisors are replaced by 1 before dividing and the results patched.
fn int_div_rem(b: BinaryOp, x: &Tensor, y: &Tensor, d: DType) -> Result<Tensor> {
    let zero = y.f_eq(0)?;
    let bad = match d {
        DType::I32 => zero.f_logical_or(&x.f_eq(i32::MIN as i64)?.f_logical_and(&y.f_eq(-1)?)?)?,
        DType::I64 => zero.f_logical_or(&x.f_eq(i64::MIN)?.f_logical_and(&y.f_eq(-1)?)?)?,
        // U32 values are non-negative in their Int64 carrier: no overflow.
        _ => zero.shallow_clone(),
    };
    let safe = y.f_ones_like()?.f_where_self(&bad, y)?;
    Ok(if b == BinaryOp::Div {
        let all_ones: i64 = if d == DType::U32 { U32_MASK } else { -1 };
        x.f_full_like(all_ones)?
            .f_where_self(&zero, &x.f_div_tensor_mode(&safe, "trunc")?)?
    } else {
        x.f_where_self(&zero, &x.f_fmod_tensor(&safe)?)?
    })
}

/// Shifts with StableHLO's semantics: an amount outside `[0, bit width)` (as unsigned) gives 0;
/// `ShiftRightLogical` shifts zeros in for signed types too.
fn shift(b: BinaryOp, x: &Tensor, y: &Tensor, d: DType) -> Result<Tensor> {
    let bits = (d.size_in_bytes() * 8) as i64;
    let valid = y.f_ge(0)?.f_logical_and(&y.f_lt(bits)?)?;
    // In-range amounts keep libtorch's shifts well defined; the rest are zeroed below.
    let s = y.f_clamp(0, bits - 1)?;
    let shifted = match (b, d) {
        (BinaryOp::ShiftLeft, _) => wrap_u32(x.f_bitwise_left_shift(&s)?, d)?,
        // U32 values are non-negative in their Int64 carrier: arithmetic == logical.
        (_, DType::U32) => x.f_bitwise_right_shift(&s)?,
        (_, DType::I32) => x
            .f_to_kind(Kind::Int64)?
            .f_bitwise_and(U32_MASK)?
            .f_bitwise_right_shift(&s.f_to_kind(Kind::Int64)?)?
            .f_to_kind(Kind::Int)?,
        _ => {
            // i64: arithmetic shift, then clear the sign-extended top `s` bits with the mask
            // !((-1 << (63 - s)) << 1), which is all ones for s = 0 and never shifts by 64.
            let ones = x.f_full_like(-1i64)?;
            let mask = ones
                .f_bitwise_left_shift(&s.f_neg()?.f_add_scalar(63)?)?
                .f_bitwise_left_shift_tensor_scalar(1)?
                .f_bitwise_not()?;
            x.f_bitwise_right_shift(&s)?.f_bitwise_and_tensor(&mask)?
        }
    };
    Ok(shifted.f_where_self(&valid, &x.f_zeros_like()?)?)
}

/// Element type conversion with StableHLO/XLA's semantics: float to integer truncates toward
/// zero and saturates at the target's range (NaN gives 0); integer to integer wraps; to `Bool`
/// is `!= 0` (NaN is true); between floats rounds to nearest.
fn convert(a: &Tensor, from: DType, to: DType) -> Result<Tensor> {
    if from == to {
        return Ok(a.shallow_clone());
    }
    if from.is_float() && to.is_int() {
        // libtorch's float->int casts are undefined out of range: saturate explicitly.
        let (lo, hi): (f64, f64) = match to {
            DType::U32 => (0.0, u32::MAX as f64),
            DType::I32 => (i32::MIN as f64, i32::MAX as f64),
            _ => (i64::MIN as f64, i64::MAX as f64),
        };
        let x = a.f_to_kind(Kind::Double)?;
        // `hi` may round up (i64::MAX as f64 == 2^63): treat `>= hi` as saturated.
        let high = x.f_ge(hi)?;
        let low = x.f_le(lo)?;
        let nan = x.f_isnan()?;
        let out = high.f_logical_or(&low)?.f_logical_or(&nan)?;
        let safe = x.f_zeros_like()?.f_where_self(&out, &x)?.f_trunc()?;
        let max = match to {
            DType::U32 => U32_MASK,
            DType::I32 => i32::MAX as i64,
            _ => i64::MAX,
        };
        let min = match to {
            DType::U32 => 0,
            DType::I32 => i32::MIN as i64,
            _ => i64::MIN,
        };
        let k = kind_of(to);
        let r = safe.f_to_kind(k)?;
        let r = r.f_full_like(max)?.f_where_self(&high, &r)?;
        return Ok(r.f_full_like(min)?.f_where_self(&low, &r)?);
    }
    Ok(match to {
        DType::Bool => a.f_ne(0)?,
        DType::U32 => a.f_to_kind(Kind::Int64)?.f_bitwise_and(U32_MASK)?,
        _ => a.f_to_kind(kind_of(to))?,
    })
}

/// StableHLO `pad`: interior padding, then edge padding (negative edges crop). Exact for every
/// dtype: the result starts as the padding value expanded (never converted through `f64`) and
/// the operand elements that survive are copied into a strided view of it.
fn pad(
    x: &Tensor,
    value: &Tensor,
    low: &[i64],
    high: &[i64],
    interior: &[usize],
    dims: &[i64],
) -> Result<Tensor> {
    let r = dims.len();
    let mut out_sizes = Vec::with_capacity(r);
    for k in 0..r {
        let n = dims[k];
        let inner = if n == 0 {
            0
        } else {
            n + (n - 1) * interior[k] as i64
        };
        out_sizes.push(inner + low[k] + high[k]);
    }
    let out = value.f_expand(&out_sizes, false)?.f_contiguous()?;
    let mut src = x.shallow_clone();
    let mut dst = out.shallow_clone();
    for k in 0..r {
        let step = interior[k] as i64 + 1;
        // Operand element j lands at low + j * step; keep those inside [0, out).
        let first = if low[k] >= 0 {
            0
        } else {
            (-low[k] + step - 1) / step
        };
        let last_pos = out_sizes[k] - 1 - low[k];
        let end = if last_pos < 0 {
            0
        } else {
            (last_pos / step + 1).min(dims[k])
        };
        let count = end - first;
        if count <= 0 {
            return Ok(out);
        }
        src = src.f_narrow(k as i64, first, count)?;
        let start = low[k] + first * step;
        dst = dst.f_slice(
            k as i64,
            Some(start),
            Some(start + (count - 1) * step + 1),
            step,
        )?;
    }
    dst.f_copy_(&src)?;
    Ok(out)
}

fn dot_general(
    d: &DotDims,
    a: &Tensor,
    b: &Tensor,
    at: &TensorType,
    bt: &TensorType,
    out: &TensorType,
) -> Result<Tensor> {
    let free = |rank: usize, batch: &[usize], contract: &[usize]| -> Vec<usize> {
        (0..rank)
            .filter(|i| !batch.contains(i) && !contract.contains(i))
            .collect()
    };
    let af = free(at.shape.rank(), &d.lhs_batch, &d.lhs_contract);
    let bf = free(bt.shape.rank(), &d.rhs_batch, &d.rhs_contract);
    let prod =
        |t: &TensorType, ds: &[usize]| ds.iter().map(|&i| t.shape.dim(i) as i64).product::<i64>();
    let (nb, m, k, n) = (
        prod(at, &d.lhs_batch),
        prod(at, &af),
        prod(at, &d.lhs_contract),
        prod(bt, &bf),
    );
    let perm_a: Vec<i64> = d
        .lhs_batch
        .iter()
        .chain(&af)
        .chain(&d.lhs_contract)
        .map(|&i| i as i64)
        .collect();
    let perm_b: Vec<i64> = d
        .rhs_batch
        .iter()
        .chain(&d.rhs_contract)
        .chain(&bf)
        .map(|&i| i as i64)
        .collect();
    let a3 = a.f_permute(&perm_a)?.f_reshape([nb, m, k])?;
    let b3 = b.f_permute(&perm_b)?.f_reshape([nb, k, n])?;
    let r = if out.dtype.is_float() {
        a3.f_bmm(&b3)?
    } else {
        // libtorch's CPU bmm does not cover every integer kind: multiply and sum instead.
        a3.f_unsqueeze(3)?
            .f_mul(&b3.f_unsqueeze(1)?)?
            .f_sum_dim_intlist([2i64].as_slice(), false, kind_of(out.dtype))?
    };
    wrap_u32(r.f_reshape(out.shape.to_i64())?, out.dtype)
}

/// Pads the spatial dims of `[N, C, *spatial]` with the scalar `value` and unfolds windows:
/// the result is `[N, C, *out_spatial, *window]`.
fn windows(x: &Tensor, w: &WindowAttrs, value: &Tensor) -> Result<Tensor> {
    let n = w.window.len();
    let mut t = if w.padding.iter().any(|&(l, h)| l != 0 || h != 0) {
        let mut low = vec![0i64; 2];
        let mut high = vec![0i64; 2];
        low.extend(w.padding.iter().map(|p| p.0 as i64));
        high.extend(w.padding.iter().map(|p| p.1 as i64));
        pad(x, value, &low, &high, &vec![0; n + 2], &x.size())?
    } else {
        x.shallow_clone()
    };
    for k in 0..n {
        t = t.f_unfold((k + 2) as i64, w.window[k] as i64, w.strides[k] as i64)?;
    }
    Ok(t)
}

/// The identity of a reduction as a scalar tensor of `d`'s kind, exact for every dtype
/// (`i64::MAX` does not survive a trip through `f64`).
fn identity(kind: ReduceKind, d: DType) -> Result<Tensor> {
    let t = match (kind, d) {
        (ReduceKind::Sum, _) => return scalar_like(0.0, d),
        (ReduceKind::Max, d) if d.is_float() => return scalar_like(f64::NEG_INFINITY, d),
        (ReduceKind::Min, d) if d.is_float() => return scalar_like(f64::INFINITY, d),
        (ReduceKind::Max, DType::I32) => Tensor::f_from_slice(&[i32::MIN])?,
        (ReduceKind::Min, DType::I32) => Tensor::f_from_slice(&[i32::MAX])?,
        (ReduceKind::Max, DType::I64) => Tensor::f_from_slice(&[i64::MIN])?,
        (ReduceKind::Min, DType::I64) => Tensor::f_from_slice(&[i64::MAX])?,
        (ReduceKind::Max, _) => Tensor::f_from_slice(&[0i64])?,
        (ReduceKind::Min, _) => Tensor::f_from_slice(&[U32_MASK])?,
    };
    Ok(t.f_reshape([0i64; 0])?)
}

/// A reduction over `axes` (non-empty); reductions of nothing give the identity.
fn reduce(kind: ReduceKind, x: &Tensor, axes: &[i64], out: &TensorType) -> Result<Tensor> {
    if x.numel() == 0 && kind != ReduceKind::Sum {
        // libtorch refuses max/min over an empty dim; StableHLO returns the init value.
        return Ok(identity(kind, out.dtype)?
            .f_expand(out.shape.to_i64(), false)?
            .f_contiguous()?);
    }
    Ok(match kind {
        ReduceKind::Sum => wrap_u32(
            x.f_sum_dim_intlist(axes, false, kind_of(out.dtype))?,
            out.dtype,
        )?,
        ReduceKind::Max => x.f_amax(axes, false)?,
        ReduceKind::Min => x.f_amin(axes, false)?,
    })
}

fn reduce_window(
    kind: ReduceKind,
    w: &WindowAttrs,
    x: &Tensor,
    xt: &TensorType,
    out: &TensorType,
) -> Result<Tensor> {
    let n = w.window.len();
    let t = windows(x, w, &identity(kind, xt.dtype)?)?;
    let axes: Vec<i64> = (0..n).map(|k| (2 + n + k) as i64).collect();
    reduce(kind, &t, &axes, out)
}

/// Max pooling's gradient with the IR's selection rule (see [`Op::SelectAndScatter`]): in each
/// window, padding is never selected; a NaN beats any number, then the larger value wins, and
/// ties go to the first element in row-major order. Each `source` element is added at its
/// window's selected position; a window of pure padding drops its element.
fn select_and_scatter(
    w: &WindowAttrs,
    x: &Tensor,
    source: &Tensor,
    xt: &TensorType,
    st: &TensorType,
) -> Result<Tensor> {
    if xt.shape.numel() == 0 || st.shape.numel() == 0 {
        // No source elements to scatter (and the reshapes below cannot infer sizes of 0).
        return Ok(Tensor::f_zeros(
            xt.shape.to_i64(),
            (kind_of(xt.dtype), tch::Device::Cpu),
        )?);
    }
    let n = w.window.len();
    let (batch, chan) = (xt.shape.dim(0) as i64, xt.shape.dim(1) as i64);
    let out_sp: Vec<i64> = (0..n).map(|k| st.shape.dim(k + 2) as i64).collect();
    let win: Vec<i64> = w.window.iter().map(|&k| k as i64).collect();
    let padded: Vec<i64> = (0..n)
        .map(|k| (xt.shape.dim(k + 2) + w.padding[k].0 + w.padding[k].1) as i64)
        .collect();
    let mut flat_shape = vec![batch, chan];
    flat_shape.extend_from_slice(&out_sp);
    flat_shape.push(win.iter().product());
    let vals = windows(x, w, &identity(ReduceKind::Max, xt.dtype)?)?.f_reshape(&flat_shape)?;
    let real = Tensor::f_ones(xt.shape.to_i64(), (Kind::Bool, tch::Device::Cpu))?;
    let no = Tensor::f_zeros([0i64; 0], (Kind::Bool, tch::Device::Cpu))?;
    let valid = windows(&real, w, &no)?.f_reshape(&flat_shape)?;
    // Candidates: the NaNs if the window has any, else the elements equal to its maximum.
    let max = vals.f_amax([-1i64].as_slice(), true)?;
    let mut hit = vals.f_eq_tensor(&max)?;
    if xt.dtype.is_float() {
        let nan = vals.f_isnan()?.f_logical_and(&valid)?;
        let any_nan = nan.f_any_dim(-1, true)?;
        hit = nan.f_where_self(&any_nan, &hit)?;
    }
    let hit = hit.f_logical_and(&valid)?;
    let found = hit.f_any_dim(-1, false)?;
    // The first candidate (argmax returns the first maximal index).
    let sel = hit.f_to_kind(Kind::Int)?.f_argmax(-1, false)?;
    let source = source.f_where_self(&found, &source.f_zeros_like()?)?;
    // Unravel the window offset and turn it into a linear index in the padded input.
    let mut rem = sel;
    let mut lin = Tensor::f_zeros_like(&rem)?;
    let mut stride_in = 1i64;
    for k in (0..n).rev() {
        let off = rem.f_remainder(win[k])?;
        rem = rem.f_div_scalar_mode(win[k], "trunc")?;
        let mut view = vec![1i64; n + 2];
        view[k + 2] = out_sp[k];
        let o = Tensor::f_arange(out_sp[k], (Kind::Int64, tch::Device::Cpu))?
            .f_mul_scalar(w.strides[k] as i64)?
            .f_reshape(&view)?;
        let pos = off.f_add(&o)?;
        lin = lin.f_add(&pos.f_mul_scalar(stride_in)?)?;
        stride_in *= padded[k];
    }
    let lin = lin.f_reshape([batch, chan, -1])?;
    let src = source.f_reshape([batch, chan, -1])?;
    let zeros = Tensor::f_zeros(
        [batch, chan, stride_in],
        (kind_of(xt.dtype), tch::Device::Cpu),
    )?;
    let mut full_shape = vec![batch, chan];
    full_shape.extend_from_slice(&padded);
    let mut r = zeros.f_scatter_add(2, &lin, &src)?.f_reshape(&full_shape)?;
    for k in 0..n {
        let lo = w.padding[k].0 as i64;
        r = r.f_slice(
            (k + 2) as i64,
            Some(lo),
            Some(lo + xt.shape.dim(k + 2) as i64),
            1,
        )?;
    }
    wrap_u32(r, xt.dtype)
}

/// `x` `[N, C, *spatial]` with its `bg` contiguous batch blocks moved into channels: `[N / bg,
/// bg * C, *spatial]`, block `g` in channels `[g * C, (g+1) * C)`. A feature-grouped convolution
/// (`bg` groups) of the result with the kernel is then the batch-grouped convolution (batch
/// block `g` with output-feature block `g`), for the eager backend and the libtorch kernel.
pub(crate) fn batch_groups_to_channels(x: &Tensor, bg: i64) -> Result<Tensor> {
    let s = x.size();
    let mut grouped = vec![bg, s[0] / bg];
    grouped.extend_from_slice(&s[1..]);
    let mut perm: Vec<i64> = vec![1, 0];
    perm.extend(2..(grouped.len() as i64));
    let mut merged = vec![s[0] / bg, bg * s[1]];
    merged.extend_from_slice(&s[2..]);
    Ok(x.f_reshape(&grouped)?
        .f_permute(&perm)?
        .f_reshape(&merged)?)
}

fn conv(c: &ConvAttrs, x: &Tensor, k: &Tensor, xt: &TensorType) -> Result<Tensor> {
    let n = c.strides.len();
    let mut x = x.shallow_clone();
    if c.lhs_dilation.iter().any(|&d| d > 1) || c.padding.iter().any(|&(l, h)| l != 0 || h != 0) {
        let mut low = vec![0i64, 0];
        let mut high = vec![0i64, 0];
        let mut interior = vec![0usize, 0];
        for i in 0..n {
            low.push(c.padding[i].0);
            high.push(c.padding[i].1);
            interior.push(c.lhs_dilation[i] - 1);
        }
        let zero = scalar_like(0.0, xt.dtype)?;
        x = pad(&x, &zero, &low, &high, &interior, &xt.shape.to_i64())?;
    }
    let stride: Vec<i64> = c.strides.iter().map(|&s| s as i64).collect();
    let dil: Vec<i64> = c.rhs_dilation.iter().map(|&s| s as i64).collect();
    let zeros = vec![0i64; n];
    // Batch group g (a contiguous block of N / bg samples) feeds output features
    // [g * O/bg, (g+1) * O/bg). Move the groups into channels and run a grouped conv.
    let (x, groups) = if c.batch_groups > 1 {
        let bg = c.batch_groups as i64;
        (batch_groups_to_channels(&x, bg)?, bg)
    } else {
        (x, c.feature_groups as i64)
    };
    Ok(x.f_convolution(
        k,
        None::<Tensor>,
        &stride,
        &zeros,
        &dil,
        false,
        &zeros,
        groups,
    )?)
}

/// A tensor held by the eager backend, with its kiln dtype (`U32` lives in an `Int64` tensor).
pub struct EagerBuffer {
    /// The values.
    pub tensor: Tensor,
    /// The kiln dtype.
    pub dtype: DType,
}

/// A graph prepared for interpretation: its topological order and each value's last use.
pub struct EagerExecutable {
    graph: Graph,
    order: Vec<NodeId>,
    last_use: HashMap<NodeId, usize>,
}

impl EagerExecutable {
    /// The graph this executable interprets.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }
}

/// Interprets graphs with libtorch on the CPU. See the module docs.
#[derive(Clone, Debug, Default)]
pub struct EagerBackend;

impl EagerBackend {
    /// A new eager backend.
    pub fn new() -> Self {
        EagerBackend
    }

    /// Runs a graph on tch tensors directly (no buffer wrapping); used by tests and by
    /// [`crate::Tensor`]'s eager mode.
    pub fn run_tch(&self, exe: &EagerExecutable, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let g = &exe.graph;
        if inputs.len() != g.inputs().len() {
            return Err(Error::Invalid(format!(
                "graph has {} inputs, got {}",
                g.inputs().len(),
                inputs.len()
            )));
        }
        let _guard = tch::no_grad_guard();
        let mut env: HashMap<NodeId, Tensor> = HashMap::with_capacity(exe.order.len());
        for (step, &id) in exe.order.iter().enumerate() {
            let node = g.node(id);
            let value = match &node.op {
                Op::Input(i) => inputs[*i].shallow_clone(),
                op => {
                    let args: Vec<&Tensor> = node.operands.iter().map(|o| &env[o]).collect();
                    let types: Vec<&TensorType> =
                        node.operands.iter().map(|&o| &g.node(o).ty).collect();
                    eval_op(op, &args, &types, &node.ty)
                        .map_err(|e| Error::at_op("evaluating", node.op.name(), &node.ty, e))?
                }
            };
            env.insert(id, value);
            // Free operands whose last use was this step.
            for o in &node.operands {
                if exe.last_use.get(o) == Some(&step) && !g.outputs().contains(o) {
                    env.remove(o);
                }
            }
        }
        Ok(g.outputs().iter().map(|o| env[o].shallow_clone()).collect())
    }
}

impl Backend for EagerBackend {
    type Buffer = EagerBuffer;
    type Executable = EagerExecutable;

    fn name(&self) -> &str {
        "eager"
    }

    fn compile(&self, graph: &Graph) -> Result<EagerExecutable> {
        graph.verify()?;
        let order = graph.topo_order();
        let mut last_use = HashMap::new();
        for (step, &id) in order.iter().enumerate() {
            for &o in &graph.node(id).operands {
                last_use.insert(o, step);
            }
        }
        Ok(EagerExecutable {
            graph: graph.clone(),
            order,
            last_use,
        })
    }

    fn execute(&self, exe: &EagerExecutable, inputs: &[&EagerBuffer]) -> Result<Vec<EagerBuffer>> {
        for (i, (b, decl)) in inputs.iter().zip(exe.graph.inputs()).enumerate() {
            let ty = self.buffer_type(b)?;
            if ty != decl.ty {
                return Err(Error::InputMismatch {
                    index: i,
                    name: decl.name.clone(),
                    expected: decl.ty.to_string(),
                    got: ty.to_string(),
                });
            }
        }
        let ts: Vec<&Tensor> = inputs.iter().map(|b| &b.tensor).collect();
        let outs = self.run_tch(exe, &ts)?;
        Ok(outs
            .into_iter()
            .zip(exe.graph.output_types())
            .map(|(tensor, ty)| EagerBuffer {
                tensor,
                dtype: ty.dtype,
            })
            .collect())
    }

    fn to_device(&self, t: &HostTensor) -> Result<EagerBuffer> {
        Ok(EagerBuffer {
            tensor: t.to_tch()?,
            dtype: t.ty().dtype,
        })
    }

    fn to_host(&self, b: &EagerBuffer) -> Result<HostTensor> {
        HostTensor::from_tch(&b.tensor, b.dtype)
    }

    fn buffer_type(&self, b: &EagerBuffer) -> Result<TensorType> {
        let shape: Vec<usize> = b.tensor.size().iter().map(|&d| d as usize).collect();
        Ok(TensorType::new(b.dtype, shape))
    }
}
