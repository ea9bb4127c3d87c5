//! A small typed builder over [`Graph`] for writing rules: scalar constants broadcast to the
//! right shape, arithmetic on same-typed values, and the shape bookkeeping (sum over broadcast
//! dims, inverse permutations, ...) that VJP rules and optimizer updates need.

use crate::error::{Error, Result};
use crate::ir::{
    BinaryOp, CompareOp, DType, Graph, Literal, NodeId, Op, ReduceKind, Shape, TensorType, UnaryOp,
};

/// Appends typed nodes to a [`Graph`]. Every method type-checks through [`Graph::add`], so a
/// mistake in a rule is an [`Error::Type`] naming the op, never a malformed graph.
pub struct Builder<'g> {
    g: &'g mut Graph,
}

impl<'g> Builder<'g> {
    /// A builder appending to `g`.
    pub fn new(g: &'g mut Graph) -> Self {
        Builder { g }
    }

    /// The graph being built.
    pub fn graph(&mut self) -> &mut Graph {
        self.g
    }

    /// The type of `x`.
    pub fn ty(&self, x: NodeId) -> TensorType {
        self.g.node(x).ty.clone()
    }

    /// Adds `op(xs)`.
    pub fn op(&mut self, op: Op, xs: &[NodeId]) -> Result<NodeId> {
        self.g.add(op, xs)
    }

    /// A scalar constant of `dtype`.
    pub fn scalar(&mut self, dtype: DType, v: f64) -> Result<NodeId> {
        self.g.add(Op::Constant(Literal::scalar(dtype, v)), &[])
    }

    /// A constant tensor of type `ty` filled with `v` (a broadcast scalar).
    pub fn full(&mut self, ty: &TensorType, v: f64) -> Result<NodeId> {
        let s = self.scalar(ty.dtype, v)?;
        self.splat(s, &ty.shape)
    }

    /// A tensor shaped like `x` filled with `v`.
    pub fn full_like(&mut self, x: NodeId, v: f64) -> Result<NodeId> {
        let ty = self.ty(x);
        self.full(&ty, v)
    }

    /// Zeros of type `ty`.
    pub fn zeros(&mut self, ty: &TensorType) -> Result<NodeId> {
        self.full(ty, 0.0)
    }

    /// Broadcasts the scalar `s` to `shape` (identity for a scalar shape).
    pub fn splat(&mut self, s: NodeId, shape: &Shape) -> Result<NodeId> {
        if shape.rank() == 0 {
            return Ok(s);
        }
        self.g.add(
            Op::Broadcast {
                shape: shape.clone(),
                dims: vec![],
            },
            &[s],
        )
    }

    /// `broadcast_in_dim(x, shape, dims)`.
    pub fn broadcast(&mut self, x: NodeId, shape: &Shape, dims: Vec<usize>) -> Result<NodeId> {
        if self.g.node(x).ty.shape == *shape && dims.iter().enumerate().all(|(i, &d)| i == d) {
            return Ok(x);
        }
        self.g.add(
            Op::Broadcast {
                shape: shape.clone(),
                dims,
            },
            &[x],
        )
    }

    /// Elementwise unary op.
    pub fn unary(&mut self, u: UnaryOp, x: NodeId) -> Result<NodeId> {
        self.g.add(Op::Unary(u), &[x])
    }

    /// Elementwise binary op (operands of identical type).
    pub fn binary(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.g.add(Op::Binary(b), &[x, y])
    }

    /// `x + y`.
    pub fn add(&mut self, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Add, x, y)
    }

    /// `x - y`.
    pub fn sub(&mut self, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Sub, x, y)
    }

    /// `x * y`.
    pub fn mul(&mut self, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Mul, x, y)
    }

    /// `x / y`.
    pub fn div(&mut self, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.binary(BinaryOp::Div, x, y)
    }

    /// `-x`.
    pub fn neg(&mut self, x: NodeId) -> Result<NodeId> {
        self.unary(UnaryOp::Neg, x)
    }

    /// `x op v` with the constant `v` broadcast to `x`'s type.
    pub fn binary_scalar(&mut self, b: BinaryOp, x: NodeId, v: f64) -> Result<NodeId> {
        let c = self.full_like(x, v)?;
        self.binary(b, x, c)
    }

    /// `x * v`.
    pub fn mul_scalar(&mut self, x: NodeId, v: f64) -> Result<NodeId> {
        self.binary_scalar(BinaryOp::Mul, x, v)
    }

    /// `x + v`.
    pub fn add_scalar(&mut self, x: NodeId, v: f64) -> Result<NodeId> {
        self.binary_scalar(BinaryOp::Add, x, v)
    }

    /// `v - x`.
    pub fn rsub_scalar(&mut self, v: f64, x: NodeId) -> Result<NodeId> {
        let c = self.full_like(x, v)?;
        self.sub(c, x)
    }

    /// Elementwise comparison (bool result).
    pub fn compare(&mut self, c: CompareOp, x: NodeId, y: NodeId) -> Result<NodeId> {
        self.g.add(Op::Compare(c), &[x, y])
    }

    /// `select(pred, on_true, on_false)`.
    pub fn select(&mut self, pred: NodeId, t: NodeId, f: NodeId) -> Result<NodeId> {
        self.g.add(Op::Select, &[pred, t, f])
    }

    /// Element type conversion (identity if the type already matches).
    pub fn convert(&mut self, x: NodeId, d: DType) -> Result<NodeId> {
        if self.g.node(x).ty.dtype == d {
            return Ok(x);
        }
        self.g.add(Op::Convert(d), &[x])
    }

    /// Reshape (identity if the shape already matches).
    pub fn reshape(&mut self, x: NodeId, dims: &[usize]) -> Result<NodeId> {
        if self.g.node(x).ty.shape.dims() == dims {
            return Ok(x);
        }
        self.g.add(Op::Reshape(Shape::new(dims)), &[x])
    }

    /// Transpose (identity for the identity permutation).
    pub fn transpose(&mut self, x: NodeId, perm: &[usize]) -> Result<NodeId> {
        if perm.iter().enumerate().all(|(i, &p)| i == p) {
            return Ok(x);
        }
        self.g.add(Op::Transpose(perm.to_vec()), &[x])
    }

    /// Sum over `axes` (any order; identity when empty).
    pub fn sum(&mut self, x: NodeId, axes: &[usize]) -> Result<NodeId> {
        if axes.is_empty() {
            return Ok(x);
        }
        let mut a = axes.to_vec();
        a.sort_unstable();
        a.dedup();
        self.g.add(
            Op::Reduce {
                kind: ReduceKind::Sum,
                axes: a,
            },
            &[x],
        )
    }

    /// Sum of all elements (a scalar).
    pub fn sum_all(&mut self, x: NodeId) -> Result<NodeId> {
        let r = self.g.node(x).ty.shape.rank();
        let axes: Vec<usize> = (0..r).collect();
        self.sum(x, &axes)
    }

    /// Pads with zeros (`low`/`high` may be negative: cropping).
    pub fn pad_zero(
        &mut self,
        x: NodeId,
        low: Vec<i64>,
        high: Vec<i64>,
        interior: Vec<usize>,
    ) -> Result<NodeId> {
        if low.iter().chain(&high).all(|&p| p == 0) && interior.iter().all(|&i| i == 0) {
            return Ok(x);
        }
        let z = self.scalar(self.g.node(x).ty.dtype, 0.0)?;
        self.g.add(
            Op::Pad {
                low,
                high,
                interior,
            },
            &[x, z],
        )
    }

    /// Pads with the constant `v`.
    pub fn pad_value(
        &mut self,
        x: NodeId,
        v: f64,
        low: Vec<i64>,
        high: Vec<i64>,
    ) -> Result<NodeId> {
        if low.iter().chain(&high).all(|&p| p == 0) {
            return Ok(x);
        }
        let r = low.len();
        let c = self.scalar(self.g.node(x).ty.dtype, v)?;
        self.g.add(
            Op::Pad {
                low,
                high,
                interior: vec![0; r],
            },
            &[x, c],
        )
    }

    /// Strided slice (identity for the full range).
    pub fn slice(
        &mut self,
        x: NodeId,
        start: Vec<usize>,
        limit: Vec<usize>,
        stride: Vec<usize>,
    ) -> Result<NodeId> {
        let dims = self.g.node(x).ty.shape.dims().to_vec();
        let full = (0..dims.len()).all(|i| start[i] == 0 && limit[i] == dims[i] && stride[i] == 1);
        if full {
            return Ok(x);
        }
        self.g.add(
            Op::Slice {
                start,
                limit,
                stride,
            },
            &[x],
        )
    }

    /// `x` converted to a float dtype `d`, erroring on non-float targets (used for scalars such as
    /// the learning rate, which may be `f32` while a parameter is `f64`).
    pub fn to_float(&mut self, x: NodeId, d: DType) -> Result<NodeId> {
        if !d.is_float() {
            return Err(Error::Invalid(format!("expected a float dtype, got {d}")));
        }
        self.convert(x, d)
    }
}

/// The inverse of a permutation.
pub(crate) fn inverse_perm(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}
