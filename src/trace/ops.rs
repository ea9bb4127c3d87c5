//! Tensor operations: primitives with numpy-style broadcasting, and compositions of them.
//!
//! Compositions (mean, softmax, matmul with batch broadcasting, ...) are written once over the
//! primitives, so a trace records primitives only. Where libtorch has a fused kernel that
//! PyTorch's eager mode would use, the eager path calls it directly, so the eager baseline is as
//! fast as PyTorch's; tests check that both paths agree.

use super::{apply, context::is_tracing, Repr, Tensor};
use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, DType, DotDims, Literal, Op, ReduceKind, Shape, TensorType, UnaryOp,
};
use smallvec::SmallVec;

/// The broadcast shape of two shapes (numpy rules), or an error naming `op`.
pub(crate) fn broadcast_shapes(
    op: &str,
    a: &TensorType,
    b: &TensorType,
) -> Result<SmallVec<[usize; 6]>> {
    let (ra, rb) = (a.shape.rank(), b.shape.rank());
    let r = ra.max(rb);
    let mut out = smallvec::smallvec![0; r];
    for (i, o) in out.iter_mut().enumerate() {
        let da = if i + ra >= r {
            a.shape.dim(i + ra - r)
        } else {
            1
        };
        let db = if i + rb >= r {
            b.shape.dim(i + rb - r)
        } else {
            1
        };
        *o = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::type_error(
                op,
                "shapes cannot be broadcast together",
                &[a, b],
            ));
        };
    }
    Ok(out)
}

fn axis(op: &str, d: isize, rank: usize) -> Result<usize> {
    let r = rank as isize;
    let a = if d < 0 { d + r } else { d };
    if a < 0 || a >= r.max(1) {
        return Err(Error::Invalid(format!(
            "{op}: dim {d} out of range for rank {rank}"
        )));
    }
    Ok(a as usize)
}

fn axes(op: &str, ds: &[isize], rank: usize) -> Result<Vec<usize>> {
    if rank == 0 {
        // Dim 0 (or -1) of a scalar is accepted, as in PyTorch, but names no dimension.
        for &d in ds {
            axis(op, d, rank)?;
        }
        return Ok(Vec::new());
    }
    let mut v = ds
        .iter()
        .map(|&d| axis(op, d, rank))
        .collect::<Result<Vec<_>>>()?;
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

impl Tensor {
    // ----- elementwise, with broadcasting ------------------------------------------------

    fn binary(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        self.broadcast_pair(op.name(), other, |a, b| apply(Op::Binary(op), &[a, b]))
    }

    /// Broadcasts `self` and `other` to a common shape and applies `f`. Eagerly, tch broadcasts
    /// by itself, so only the type check runs on expanded types.
    fn broadcast_pair(
        &self,
        name: &str,
        other: &Tensor,
        f: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if self.ty.dtype != other.ty.dtype {
            return Err(Error::type_error(
                name,
                "operands must have the same dtype (use to_dtype)",
                &[&self.ty, &other.ty],
            ));
        }
        if self.ty.shape == other.ty.shape {
            return f(self, other);
        }
        let shape = broadcast_shapes(name, &self.ty, &other.ty)?;
        if !is_tracing() {
            if let (Repr::Eager { t: a, .. }, Repr::Eager { t: b, .. }) = (&self.repr, &other.repr)
            {
                // Same result as broadcasting explicitly, without materialising the views.
                let full = TensorType::new(self.ty.dtype, shape.as_slice());
                let wrap = |t: &tch::Tensor| Tensor {
                    ty: full.clone(),
                    repr: Repr::Eager {
                        t: t.shallow_clone(),
                        var: None,
                    },
                };
                let r = f(&wrap(a), &wrap(b))?;
                return Ok(r);
            }
        }
        let a = self.broadcast_to(&shape)?;
        let b = other.broadcast_to(&shape)?;
        f(&a, &b)
    }

    /// `self + other` (broadcasting).
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Add, other)
    }
    /// `self - other` (broadcasting).
    pub fn sub(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, other)
    }
    /// `self * other` (broadcasting).
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, other)
    }
    /// `self / other` (broadcasting; integers truncate).
    pub fn div(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Div, other)
    }
    /// Remainder with the dividend's sign (broadcasting).
    pub fn rem(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Rem, other)
    }
    /// `self ^ other` (broadcasting, floats).
    pub fn pow(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Pow, other)
    }
    /// Elementwise maximum (broadcasting).
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Max, other)
    }
    /// Elementwise minimum (broadcasting).
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Min, other)
    }
    /// Logical/bitwise and (broadcasting).
    pub fn and(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::And, other)
    }
    /// Logical/bitwise or (broadcasting).
    pub fn or(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Or, other)
    }
    /// Logical/bitwise xor (broadcasting).
    pub fn xor(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Xor, other)
    }
    /// `self << other` (integers, broadcasting).
    pub fn shift_left(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::ShiftLeft, other)
    }
    /// Logical `self >> other` (integers, broadcasting).
    pub fn shift_right_logical(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::ShiftRightLogical, other)
    }

    /// A scalar constant of this tensor's dtype.
    pub fn scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::scalar(v, self.ty.dtype)
    }
    /// `self + v`.
    pub fn add_scalar(&self, v: f64) -> Result<Tensor> {
        self.add(&self.scalar_like(v)?)
    }
    /// `self - v`.
    pub fn sub_scalar(&self, v: f64) -> Result<Tensor> {
        self.sub(&self.scalar_like(v)?)
    }
    /// `self * v`.
    pub fn mul_scalar(&self, v: f64) -> Result<Tensor> {
        self.mul(&self.scalar_like(v)?)
    }
    /// `self / v`.
    pub fn div_scalar(&self, v: f64) -> Result<Tensor> {
        self.div(&self.scalar_like(v)?)
    }
    /// `self ^ v`.
    pub fn pow_scalar(&self, v: f64) -> Result<Tensor> {
        self.pow(&self.scalar_like(v)?)
    }
    /// `max(self, v)`.
    pub fn maximum_scalar(&self, v: f64) -> Result<Tensor> {
        self.maximum(&self.scalar_like(v)?)
    }
    /// `min(self, v)`.
    pub fn minimum_scalar(&self, v: f64) -> Result<Tensor> {
        self.minimum(&self.scalar_like(v)?)
    }
    /// `min(max(self, lo), hi)`.
    pub fn clamp(&self, lo: f64, hi: f64) -> Result<Tensor> {
        self.maximum_scalar(lo)?.minimum_scalar(hi)
    }

    fn compare(&self, c: CompareOp, other: &Tensor) -> Result<Tensor> {
        self.broadcast_pair(c.name(), other, |a, b| apply(Op::Compare(c), &[a, b]))
    }
    /// `self == other` as bool (broadcasting).
    pub fn eq(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Eq, other)
    }
    /// `self != other` as bool (broadcasting).
    pub fn ne(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Ne, other)
    }
    /// `self < other` as bool (broadcasting).
    pub fn lt(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Lt, other)
    }
    /// `self <= other` as bool (broadcasting).
    pub fn le(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Le, other)
    }
    /// `self > other` as bool (broadcasting).
    pub fn gt(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Gt, other)
    }
    /// `self >= other` as bool (broadcasting).
    pub fn ge(&self, other: &Tensor) -> Result<Tensor> {
        self.compare(CompareOp::Ge, other)
    }

    /// `cond ? on_true : on_false` elementwise, with `self` as the bool condition
    /// (all three broadcast).
    pub fn select(&self, on_true: &Tensor, on_false: &Tensor) -> Result<Tensor> {
        if self.ty.dtype != DType::Bool {
            return Err(Error::type_error(
                "select",
                "condition must be bool",
                &[&self.ty],
            ));
        }
        let s1 = broadcast_shapes("select", &self.ty, &on_true.ty)?;
        let s = broadcast_shapes(
            "select",
            &TensorType::new(DType::F32, s1.as_slice()),
            &on_false.ty,
        )?;
        let c = self.broadcast_to(&s)?;
        let t = on_true.broadcast_to(&s)?;
        let f = on_false.broadcast_to(&s)?;
        apply(Op::Select, &[&c, &t, &f])
    }

    fn unary(&self, u: UnaryOp) -> Result<Tensor> {
        apply(Op::Unary(u), &[self])
    }
    /// `-x`.
    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    /// `|x|`.
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    /// `e^x`.
    pub fn exp(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Exp)
    }
    /// Natural logarithm.
    pub fn log(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log)
    }
    /// `log(1 + x)`.
    pub fn log1p(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Log1p)
    }
    /// Square root.
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sqrt)
    }
    /// `1 / sqrt(x)`.
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Rsqrt)
    }
    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Tanh)
    }
    /// Logistic sigmoid.
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Logistic)
    }
    /// Error function.
    pub fn erf(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Erf)
    }
    /// Sine.
    pub fn sin(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sin)
    }
    /// Cosine.
    pub fn cos(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Cos)
    }
    /// Round down.
    pub fn floor(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Floor)
    }
    /// Round up.
    pub fn ceil(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Ceil)
    }
    /// Sign (-1, 0, 1).
    pub fn sign(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sign)
    }
    /// Logical not (bool) or bitwise not (integers).
    pub fn not(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Not)
    }
    /// `x * x`.
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }
    /// `1 / x`.
    pub fn recip(&self) -> Result<Tensor> {
        self.scalar_like(1.0)?.div(self)
    }

    /// Element type conversion.
    pub fn to_dtype(&self, d: DType) -> Result<Tensor> {
        if d == self.ty.dtype {
            return Ok(self.clone());
        }
        apply(Op::Convert(d), &[self])
    }

    // ----- shape ---------------------------------------------------------------------------

    /// Broadcasts to `shape` (numpy rules: align trailing dims; size-1 dims stretch).
    pub fn broadcast_to(&self, shape: &[usize]) -> Result<Tensor> {
        if self.dims() == shape {
            return Ok(self.clone());
        }
        let r = self.rank();
        if r > shape.len() {
            return Err(Error::type_error(
                "broadcast",
                format!("cannot broadcast to lower rank {}", Shape::new(shape)),
                &[&self.ty],
            ));
        }
        let offset = shape.len() - r;
        let dims: Vec<usize> = (offset..shape.len()).collect();
        apply(
            Op::Broadcast {
                shape: Shape::new(shape),
                dims,
            },
            &[self],
        )
    }

    /// Broadcasts with an explicit dim map (`broadcast_in_dim`).
    pub fn broadcast_in_dim(&self, shape: &[usize], dims: &[usize]) -> Result<Tensor> {
        apply(
            Op::Broadcast {
                shape: Shape::new(shape),
                dims: dims.to_vec(),
            },
            &[self],
        )
    }

    /// Reshape; one entry may be `-1` (inferred).
    pub fn reshape(&self, shape: &[isize]) -> Result<Tensor> {
        let numel = self.ty.shape.numel();
        let known: usize = shape
            .iter()
            .filter(|&&d| d >= 0)
            .map(|&d| d as usize)
            .product();
        let holes = shape.iter().filter(|&&d| d < 0).count();
        let bad = || {
            Error::type_error(
                "reshape",
                format!("cannot reshape to {shape:?}"),
                &[&self.ty],
            )
        };
        if holes > 1 || (holes == 1 && (known == 0 || numel % known != 0)) {
            return Err(bad());
        }
        let dims: Vec<usize> = shape
            .iter()
            .map(|&d| {
                if d < 0 {
                    numel / known.max(1)
                } else {
                    d as usize
                }
            })
            .collect();
        if dims.as_slice() == self.dims() {
            return Ok(self.clone());
        }
        apply(Op::Reshape(Shape::new(&dims)), &[self])
    }

    /// Flattens dims `start..=end` into one.
    pub fn flatten(&self, start: isize, end: isize) -> Result<Tensor> {
        if self.rank() == 0 {
            return self.reshape(&[1]);
        }
        let (s, e) = (
            axis("flatten", start, self.rank())?,
            axis("flatten", end, self.rank())?,
        );
        if s > e {
            return Err(Error::Invalid(format!(
                "flatten: start dim {start} comes after end dim {end} (rank {})",
                self.rank()
            )));
        }
        let mut dims: Vec<isize> = self.dims()[..s].iter().map(|&d| d as isize).collect();
        dims.push(self.dims()[s..=e].iter().product::<usize>() as isize);
        dims.extend(self.dims()[e + 1..].iter().map(|&d| d as isize));
        self.reshape(&dims)
    }

    /// Inserts a size-1 dim at `d`.
    pub fn unsqueeze(&self, d: isize) -> Result<Tensor> {
        let a = axis("unsqueeze", d, self.rank() + 1)?;
        let mut dims: Vec<isize> = self.dims().iter().map(|&x| x as isize).collect();
        dims.insert(a, 1);
        self.reshape(&dims)
    }

    /// Removes the size-1 dim `d`.
    pub fn squeeze(&self, d: isize) -> Result<Tensor> {
        let a = axis("squeeze", d, self.rank())?;
        if self.rank() == 0 {
            // PyTorch: squeezing a scalar returns it.
            return Ok(self.clone());
        }
        if self.dims()[a] != 1 {
            return Err(Error::type_error(
                "squeeze",
                format!("dim {d} is not 1"),
                &[&self.ty],
            ));
        }
        let mut dims: Vec<isize> = self.dims().iter().map(|&x| x as isize).collect();
        dims.remove(a);
        self.reshape(&dims)
    }

    /// Permutes dims: result dim `i` is `self` dim `perm[i]`.
    pub fn permute(&self, perm: &[usize]) -> Result<Tensor> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) && perm.len() == self.rank() {
            return Ok(self.clone());
        }
        apply(Op::Transpose(perm.to_vec()), &[self])
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Tensor> {
        let (a, b) = (
            axis("transpose", d0, self.rank())?,
            axis("transpose", d1, self.rank())?,
        );
        if self.rank() == 0 {
            return Ok(self.clone());
        }
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Transpose of a matrix (swaps the last two dims).
    pub fn t(&self) -> Result<Tensor> {
        self.transpose(-2, -1)
    }

    /// `self[.., start..end:step, ..]` along `dim`.
    pub fn slice(&self, dim: isize, start: usize, end: usize, step: usize) -> Result<Tensor> {
        let a = axis("slice", dim, self.rank())?;
        if self.rank() == 0 {
            return Err(Error::type_error(
                "slice",
                "cannot slice a 0-dim tensor",
                &[&self.ty],
            ));
        }
        let mut s = vec![0; self.rank()];
        let mut l = self.dims().to_vec();
        let mut st = vec![1; self.rank()];
        s[a] = start;
        l[a] = end.min(self.dims()[a]);
        st[a] = step;
        if s[a] == 0 && l[a] == self.dims()[a] && step == 1 {
            return Ok(self.clone());
        }
        apply(
            Op::Slice {
                start: s,
                limit: l,
                stride: st,
            },
            &[self],
        )
    }

    /// `len` elements of `dim` from `start`.
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Tensor> {
        self.slice(dim, start, start + len, 1)
    }

    /// Joins tensors along `dim`.
    pub fn cat(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let first = tensors
            .first()
            .ok_or_else(|| Error::Invalid("cat of no tensors".into()))?;
        let a = axis("cat", dim, first.rank())?;
        if tensors.len() == 1 {
            return Ok(first.clone());
        }
        let refs: Vec<&Tensor> = tensors.iter().collect();
        apply(Op::Concat { axis: a }, &refs)
    }

    /// Stacks tensors along a new dim.
    pub fn stack(tensors: &[Tensor], dim: isize) -> Result<Tensor> {
        let r = tensors.first().map(|t| t.rank()).unwrap_or(0);
        let a = axis("stack", dim, r + 1)? as isize;
        let parts = tensors
            .iter()
            .map(|t| t.unsqueeze(a))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, a)
    }

    /// Pads each dim with `low`/`high` copies of `value` (negative amounts crop).
    pub fn pad(&self, low: &[i64], high: &[i64], value: f64) -> Result<Tensor> {
        let v = Tensor::scalar(value, self.ty.dtype)?;
        apply(
            Op::Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: vec![0; self.rank()],
            },
            &[self, &v],
        )
    }

    /// Reverses the order of elements along `dims`.
    pub fn flip(&self, dims: &[isize]) -> Result<Tensor> {
        let d = axes("flip", dims, self.rank())?;
        apply(Op::Reverse(d), &[self])
    }

    /// Takes slices along `dim` at integer `indices` (embedding lookup is `take(0)`).
    pub fn take(&self, indices: &Tensor, dim: isize) -> Result<Tensor> {
        let a = axis("take", dim, self.rank())?;
        apply(Op::Take { axis: a }, &[self, indices])
    }

    // ----- reductions ----------------------------------------------------------------------

    fn reduce(&self, kind: ReduceKind, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let a = axes(kind.name(), dims, self.rank())?;
        let r = apply(
            Op::Reduce {
                kind,
                axes: a.clone(),
            },
            &[self],
        )?;
        if keepdim {
            let mut shape: Vec<isize> = self.dims().iter().map(|&d| d as isize).collect();
            for &i in &a {
                shape[i] = 1;
            }
            r.reshape(&shape)
        } else {
            Ok(r)
        }
    }

    /// Sum over `dims`.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceKind::Sum, dims, keepdim)
    }
    /// Maximum over `dims`.
    pub fn max(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceKind::Max, dims, keepdim)
    }
    /// Minimum over `dims`.
    pub fn min(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceKind::Min, dims, keepdim)
    }
    /// Mean over `dims` (floats).
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let a = axes("mean", dims, self.rank())?;
        let n: usize = a.iter().map(|&i| self.dims()[i]).product();
        self.sum(dims, keepdim)?.div_scalar(n as f64)
    }
    /// Variance over `dims` (`unbiased`: divide by n-1).
    pub fn var(&self, dims: &[isize], unbiased: bool, keepdim: bool) -> Result<Tensor> {
        let a = axes("var", dims, self.rank())?;
        let n: usize = a.iter().map(|&i| self.dims()[i]).product();
        let mu = self.mean(dims, true)?;
        let d = self.sub(&mu)?;
        let denom = if unbiased {
            n.saturating_sub(1).max(1)
        } else {
            n.max(1)
        };
        d.square()?.sum(dims, keepdim)?.div_scalar(denom as f64)
    }
    /// Sum of all elements (a scalar).
    pub fn sum_all(&self) -> Result<Tensor> {
        let all: Vec<isize> = (0..self.rank() as isize).collect();
        self.sum(&all, false)
    }
    /// Mean of all elements (a scalar).
    pub fn mean_all(&self) -> Result<Tensor> {
        let all: Vec<isize> = (0..self.rank() as isize).collect();
        self.mean(&all, false)
    }

    // ----- linear algebra ------------------------------------------------------------------

    /// General dot product with explicit dimension numbers.
    pub fn dot_general(&self, other: &Tensor, dims: DotDims) -> Result<Tensor> {
        apply(Op::DotGeneral(dims), &[self, other])
    }

    /// Matrix product with `torch.matmul` semantics: 1-D operands are promoted; leading batch
    /// dims broadcast.
    pub fn matmul(&self, other: &Tensor) -> Result<Tensor> {
        let (ra, rb) = (self.rank(), other.rank());
        if ra == 0 || rb == 0 {
            return Err(Error::type_error(
                "matmul",
                "operands must be at least 1-D",
                &[&self.ty, &other.ty],
            ));
        }
        // Checked up front so that a mismatch names `matmul` in both modes (traced, it would
        // otherwise surface from the `dot_general` the product is built from).
        let out = matmul_type(&self.ty, &other.ty)?;
        if !is_tracing() {
            if let (Repr::Eager { t: a, .. }, Repr::Eager { t: b, .. }) = (&self.repr, &other.repr)
            {
                let t = a.f_matmul(b)?;
                return Ok(Tensor::from_tch_typed(t, out.dtype));
            }
        }
        if ra == 1 && rb == 1 {
            // Vector dot product: a scalar.
            return self.dot_general(
                other,
                DotDims {
                    lhs_contract: vec![0],
                    rhs_contract: vec![0],
                    ..Default::default()
                },
            );
        }
        if ra == 1 {
            return self.unsqueeze(0)?.matmul(other)?.squeeze(-2);
        }
        if rb == 1 {
            return self.matmul(&other.unsqueeze(1)?)?.squeeze(-1);
        }
        if rb == 2 {
            // [.., M, K] x [K, N]: contract directly, no batch broadcast needed.
            return self.dot_general(
                other,
                DotDims {
                    lhs_contract: vec![ra - 1],
                    rhs_contract: vec![0],
                    ..Default::default()
                },
            );
        }
        // Broadcast the batch dims, then a batched dot.
        let ba = &self.dims()[..ra - 2];
        let bb = &other.dims()[..rb - 2];
        let batch = broadcast_shapes(
            "matmul",
            &TensorType::new(self.dtype(), ba),
            &TensorType::new(other.dtype(), bb),
        )?;
        let mut sa = batch.clone();
        sa.extend_from_slice(&self.dims()[ra - 2..]);
        let mut sb = batch.clone();
        sb.extend_from_slice(&other.dims()[rb - 2..]);
        let a = self.broadcast_to(&sa)?;
        let b = other.broadcast_to(&sb)?;
        let nb = batch.len();
        a.dot_general(
            &b,
            DotDims {
                lhs_batch: (0..nb).collect(),
                rhs_batch: (0..nb).collect(),
                lhs_contract: vec![nb + 1],
                rhs_contract: vec![nb],
            },
        )
    }

    /// `x @ w^T + b` with `w` of shape `[out, in]` (PyTorch's `Linear`).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        if weight.rank() != 2
            || self.rank() == 0
            || self.dims()[self.rank() - 1] != weight.dims()[1]
            || self.dtype() != weight.dtype()
            || self.dtype() == DType::Bool
            || bias.is_some_and(|b| b.dtype() != self.dtype())
        {
            let mut ops = vec![&self.ty, &weight.ty];
            if let Some(b) = bias {
                ops.push(&b.ty);
            }
            return Err(Error::type_error(
                "linear",
                "expects x[.., in], weight[out, in], bias[out] of one non-bool dtype",
                &ops,
            ));
        }
        if !is_tracing() {
            if let (Repr::Eager { t: x, .. }, Repr::Eager { t: w, .. }) = (&self.repr, &weight.repr)
            {
                let b = bias.map(|b| b.as_tch()).transpose()?;
                let t = x.f_linear(w, b)?;
                return Tensor::from_tch(t);
            }
        }
        let y = self.dot_general(
            weight,
            DotDims {
                lhs_contract: vec![self.rank() - 1],
                rhs_contract: vec![1],
                ..Default::default()
            },
        )?;
        match bias {
            Some(b) => y.add(b),
            None => Ok(y),
        }
    }

    // ----- activations and normalisations ----------------------------------------------------

    /// `max(x, 0)`.
    pub fn relu(&self) -> Result<Tensor> {
        if let (false, Repr::Eager { t, .. }) = (is_tracing(), &self.repr) {
            return Ok(Tensor::from_tch_typed(t.f_relu()?, self.dtype()));
        }
        self.maximum_scalar(0.0)
    }

    /// Softmax along `dim` (max-subtracted, numerically stable).
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        let a = axis("softmax", dim, self.rank())?;
        if !self.dtype().is_float() {
            return Err(Error::type_error(
                "softmax",
                "expects a float tensor",
                &[&self.ty],
            ));
        }
        if let (false, Repr::Eager { t, .. }) = (is_tracing(), &self.repr) {
            return Ok(Tensor::from_tch_typed(
                t.f_softmax(a as i64, None)?,
                self.dtype(),
            ));
        }
        let m = self.max(&[a as isize], true)?.detach()?;
        let e = self.sub(&m)?.exp()?;
        e.div(&e.sum(&[a as isize], true)?)
    }

    /// Log-softmax along `dim` (numerically stable).
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        let a = axis("log_softmax", dim, self.rank())?;
        if !self.dtype().is_float() {
            return Err(Error::type_error(
                "log_softmax",
                "expects a float tensor",
                &[&self.ty],
            ));
        }
        if let (false, Repr::Eager { t, .. }) = (is_tracing(), &self.repr) {
            return Ok(Tensor::from_tch_typed(
                t.f_log_softmax(a as i64, None)?,
                self.dtype(),
            ));
        }
        let m = self.max(&[a as isize], true)?.detach()?;
        let s = self.sub(&m)?;
        let lse = s.exp()?.sum(&[a as isize], true)?.log()?;
        s.sub(&lse)
    }

    /// Builds a constant tensor from raw values (eager or traced).
    pub fn constant(ty: TensorType, bytes: Vec<u8>) -> Result<Tensor> {
        apply(Op::Constant(Literal::from_bytes(ty, bytes)?), &[])
    }
}

fn matmul_type(a: &TensorType, b: &TensorType) -> Result<TensorType> {
    let err = || Error::type_error("matmul", "inner dimensions differ", &[a, b]);
    if a.dtype != b.dtype {
        return Err(Error::type_error("matmul", "dtypes differ", &[a, b]));
    }
    if a.dtype == DType::Bool {
        return Err(Error::type_error("matmul", "matmul of bool", &[a, b]));
    }
    let (ra, rb) = (a.shape.rank(), b.shape.rank());
    let k_a = a.shape.dim(ra - 1);
    let k_b = if rb == 1 {
        b.shape.dim(0)
    } else {
        b.shape.dim(rb - 2)
    };
    if k_a != k_b {
        return Err(err());
    }
    let mut dims: Vec<usize> = if ra >= 2 && rb >= 2 {
        broadcast_shapes(
            "matmul",
            &TensorType::new(a.dtype, &a.shape.dims()[..ra - 2]),
            &TensorType::new(b.dtype, &b.shape.dims()[..rb - 2]),
        )?
        .into_vec()
    } else if ra >= 2 {
        a.shape.dims()[..ra - 2].to_vec()
    } else if rb >= 2 {
        b.shape.dims()[..rb - 2].to_vec()
    } else {
        vec![]
    };
    if ra >= 2 {
        dims.push(a.shape.dim(ra - 2));
    }
    if rb >= 2 {
        dims.push(b.shape.dim(rb - 1));
    }
    Ok(TensorType::new(a.dtype, dims))
}

macro_rules! bin_operator {
    ($trait:ident, $method:ident, $call:ident, $scalar:ident) => {
        impl std::ops::$trait<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$call(self, rhs)
            }
        }
        impl std::ops::$trait<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$call(&self, &rhs)
            }
        }
        impl std::ops::$trait<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$call(&self, rhs)
            }
        }
        impl std::ops::$trait<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: f64) -> Result<Tensor> {
                Tensor::$scalar(self, rhs)
            }
        }
        impl std::ops::$trait<f64> for Tensor {
            type Output = Result<Tensor>;
            fn $method(self, rhs: f64) -> Result<Tensor> {
                Tensor::$scalar(&self, rhs)
            }
        }
    };
}
bin_operator!(Add, add, add, add_scalar);
bin_operator!(Sub, sub, sub, sub_scalar);
bin_operator!(Mul, mul, mul, mul_scalar);
bin_operator!(Div, div, div, div_scalar);

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
