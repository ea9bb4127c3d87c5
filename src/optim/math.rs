//! One update formula, two executions.
//!
//! Each optimizer writes its update once, generically over [`UpdateMath`], in the in-place
//! style of PyTorch's single-tensor optimizers (`param.add_(grad, alpha=-lr)`,
//! `exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`). Two implementations run it:
//!
//! - [`EagerMath`] applies it to libtorch tensors, truly in place, as `torch.optim` does: the
//!   eager baseline pays no copies for sharing the formula with the compiler.
//! - [`GraphMath`] traces it into a [`Graph`]: each in-place operation becomes a new node and
//!   the tensor handle is rebound to it (functionalization, as AOTAutograd does with
//!   `torch.optim`'s in-place code). The graph's outputs are the final handles.
//!
//! Scalars that depend on the learning rate or the step count (Adam's bias corrections, the
//! momentum's first step) are [`UpdateMath::Scalar`]s: plain `f64` eagerly, `f64[]` graph nodes
//! when traced, so a learning-rate schedule never recompiles. They are computed in float64, as
//! PyTorch computes them in Python floats.

use crate::autograd::Builder;
use crate::error::Result;
use crate::ir::{BinaryOp, CompareOp, DType, Graph, NodeId, TensorType, UnaryOp};

/// The operations an optimizer's update is written in (see the [module docs](self)).
///
/// Methods ending in `_` update their first operand in place; the others return a new tensor
/// and leave their operands alone.
pub trait UpdateMath {
    /// A tensor: parameter, gradient, optimizer state or intermediate.
    type Tensor;
    /// A float64 scalar known only when the step runs (learning rate, step count, factors
    /// derived from them) or a constant.
    type Scalar: Copy;

    /// The constant `v`.
    fn constant(&mut self, v: f64) -> Result<Self::Scalar>;
    /// `a + b`.
    fn s_add(&mut self, a: Self::Scalar, b: Self::Scalar) -> Result<Self::Scalar>;
    /// `a - b`.
    fn s_sub(&mut self, a: Self::Scalar, b: Self::Scalar) -> Result<Self::Scalar>;
    /// `a * b`.
    fn s_mul(&mut self, a: Self::Scalar, b: Self::Scalar) -> Result<Self::Scalar>;
    /// `a / b`.
    fn s_div(&mut self, a: Self::Scalar, b: Self::Scalar) -> Result<Self::Scalar>;
    /// `a ^ b`.
    fn s_pow(&mut self, a: Self::Scalar, b: Self::Scalar) -> Result<Self::Scalar>;
    /// `sqrt(a)`.
    fn s_sqrt(&mut self, a: Self::Scalar) -> Result<Self::Scalar>;
    /// `if x <= bound { then } else { otherwise }`.
    fn s_select_le(
        &mut self,
        x: Self::Scalar,
        bound: f64,
        then: Self::Scalar,
        otherwise: Self::Scalar,
    ) -> Result<Self::Scalar>;

    /// Another handle to the same tensor (no copy).
    fn alias(&mut self, t: &Self::Tensor) -> Self::Tensor;
    /// `a + alpha * b` (`torch.add(a, b, alpha=alpha)`).
    fn add(
        &mut self,
        a: &Self::Tensor,
        b: &Self::Tensor,
        alpha: Self::Scalar,
    ) -> Result<Self::Tensor>;
    /// `sqrt(a)`.
    fn sqrt(&mut self, a: &Self::Tensor) -> Result<Self::Tensor>;
    /// `a += alpha * b`.
    fn add_(&mut self, a: &mut Self::Tensor, b: &Self::Tensor, alpha: Self::Scalar) -> Result<()>;
    /// `a *= s`.
    fn mul_(&mut self, a: &mut Self::Tensor, s: Self::Scalar) -> Result<()>;
    /// `a /= s`.
    fn div_scalar_(&mut self, a: &mut Self::Tensor, s: Self::Scalar) -> Result<()>;
    /// `a += s`.
    fn add_scalar_(&mut self, a: &mut Self::Tensor, s: Self::Scalar) -> Result<()>;
    /// `a += value * t1 * t2`.
    fn addcmul_(
        &mut self,
        a: &mut Self::Tensor,
        t1: &Self::Tensor,
        t2: &Self::Tensor,
        value: Self::Scalar,
    ) -> Result<()>;
    /// `a += value * t1 / t2`.
    fn addcdiv_(
        &mut self,
        a: &mut Self::Tensor,
        t1: &Self::Tensor,
        t2: &Self::Tensor,
        value: Self::Scalar,
    ) -> Result<()>;
    /// `a = a + weight * (end - a)`, with libtorch's formula (exact at both ends).
    fn lerp_(&mut self, a: &mut Self::Tensor, end: &Self::Tensor, weight: f64) -> Result<()>;
    /// `a = max(a, b)` elementwise.
    fn maximum_(&mut self, a: &mut Self::Tensor, b: &Self::Tensor) -> Result<()>;
}

/// [`UpdateMath`] on libtorch tensors, in place, under `no_grad` (the caller holds the guard).
#[derive(Debug, Default)]
pub struct EagerMath;

impl UpdateMath for EagerMath {
    type Tensor = tch::Tensor;
    type Scalar = f64;

    fn constant(&mut self, v: f64) -> Result<f64> {
        Ok(v)
    }
    fn s_add(&mut self, a: f64, b: f64) -> Result<f64> {
        Ok(a + b)
    }
    fn s_sub(&mut self, a: f64, b: f64) -> Result<f64> {
        Ok(a - b)
    }
    fn s_mul(&mut self, a: f64, b: f64) -> Result<f64> {
        Ok(a * b)
    }
    fn s_div(&mut self, a: f64, b: f64) -> Result<f64> {
        Ok(a / b)
    }
    fn s_pow(&mut self, a: f64, b: f64) -> Result<f64> {
        Ok(a.powf(b))
    }
    fn s_sqrt(&mut self, a: f64) -> Result<f64> {
        Ok(a.sqrt())
    }
    fn s_select_le(&mut self, x: f64, bound: f64, then: f64, otherwise: f64) -> Result<f64> {
        Ok(if x <= bound { then } else { otherwise })
    }

    fn alias(&mut self, t: &tch::Tensor) -> tch::Tensor {
        t.shallow_clone()
    }
    fn add(&mut self, a: &tch::Tensor, b: &tch::Tensor, alpha: f64) -> Result<tch::Tensor> {
        Ok(if alpha == 1.0 {
            a.f_add(b)?
        } else {
            a.f_add(&b.f_mul_scalar(alpha)?)?
        })
    }
    fn sqrt(&mut self, a: &tch::Tensor) -> Result<tch::Tensor> {
        Ok(a.f_sqrt()?)
    }
    fn add_(&mut self, a: &mut tch::Tensor, b: &tch::Tensor, alpha: f64) -> Result<()> {
        if alpha == 1.0 {
            let _ = a.f_add_(b)?;
        } else {
            let _ = a.f_add_(&b.f_mul_scalar(alpha)?)?;
        }
        Ok(())
    }
    fn mul_(&mut self, a: &mut tch::Tensor, s: f64) -> Result<()> {
        let _ = a.f_mul_scalar_(s)?;
        Ok(())
    }
    fn div_scalar_(&mut self, a: &mut tch::Tensor, s: f64) -> Result<()> {
        let _ = a.f_div_scalar_(s)?;
        Ok(())
    }
    fn add_scalar_(&mut self, a: &mut tch::Tensor, s: f64) -> Result<()> {
        let _ = a.f_add_scalar_(s)?;
        Ok(())
    }
    fn addcmul_(
        &mut self,
        a: &mut tch::Tensor,
        t1: &tch::Tensor,
        t2: &tch::Tensor,
        value: f64,
    ) -> Result<()> {
        let _ = a.f_add_(&t1.f_mul(t2)?.f_mul_scalar(value)?)?;
        Ok(())
    }
    fn addcdiv_(
        &mut self,
        a: &mut tch::Tensor,
        t1: &tch::Tensor,
        t2: &tch::Tensor,
        value: f64,
    ) -> Result<()> {
        let _ = a.f_add_(&t1.f_div(t2)?.f_mul_scalar(value)?)?;
        Ok(())
    }
    fn lerp_(&mut self, a: &mut tch::Tensor, end: &tch::Tensor, weight: f64) -> Result<()> {
        let _ = a.f_lerp_(end, weight)?;
        Ok(())
    }
    fn maximum_(&mut self, a: &mut tch::Tensor, b: &tch::Tensor) -> Result<()> {
        let m = a.f_maximum(b)?;
        a.f_copy_(&m)?;
        Ok(())
    }
}

/// [`UpdateMath`] traced into a graph: tensors and scalars are nodes; in-place operations
/// rebind the handle to a new node.
pub struct GraphMath<'g> {
    b: Builder<'g>,
    ty: TensorType,
}

impl<'g> GraphMath<'g> {
    /// Traces into `g` an update whose tensors all have type `ty` (the parameter's).
    pub fn new(g: &'g mut Graph, ty: TensorType) -> Self {
        GraphMath {
            b: Builder::new(g),
            ty,
        }
    }

    /// A float scalar node of the graph (e.g. the `lr` or `step` input) as a [`Self::Scalar`].
    pub fn scalar(&mut self, node: NodeId) -> Result<NodeId> {
        self.b.to_float(node, DType::F64)
    }

    /// A scalar as a tensor of the update's type (converted, then broadcast).
    fn splat(&mut self, s: NodeId) -> Result<NodeId> {
        let s = self.b.convert(s, self.ty.dtype)?;
        self.b.splat(s, &self.ty.shape)
    }

    fn scaled(&mut self, t: NodeId, s: NodeId) -> Result<NodeId> {
        let s = self.splat(s)?;
        self.b.mul(t, s)
    }
}

impl UpdateMath for GraphMath<'_> {
    type Tensor = NodeId;
    type Scalar = NodeId;

    fn constant(&mut self, v: f64) -> Result<NodeId> {
        self.b.scalar(DType::F64, v)
    }
    fn s_add(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.b.add(a, b)
    }
    fn s_sub(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.b.sub(a, b)
    }
    fn s_mul(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.b.mul(a, b)
    }
    fn s_div(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.b.div(a, b)
    }
    fn s_pow(&mut self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.b.binary(BinaryOp::Pow, a, b)
    }
    fn s_sqrt(&mut self, a: NodeId) -> Result<NodeId> {
        self.b.unary(UnaryOp::Sqrt, a)
    }
    fn s_select_le(
        &mut self,
        x: NodeId,
        bound: f64,
        then: NodeId,
        otherwise: NodeId,
    ) -> Result<NodeId> {
        let bound = self.b.scalar(DType::F64, bound)?;
        let pred = self.b.compare(CompareOp::Le, x, bound)?;
        self.b.select(pred, then, otherwise)
    }

    fn alias(&mut self, t: &NodeId) -> NodeId {
        *t
    }
    fn add(&mut self, a: &NodeId, b: &NodeId, alpha: NodeId) -> Result<NodeId> {
        let sb = self.scaled(*b, alpha)?;
        self.b.add(*a, sb)
    }
    fn sqrt(&mut self, a: &NodeId) -> Result<NodeId> {
        self.b.unary(UnaryOp::Sqrt, *a)
    }
    fn add_(&mut self, a: &mut NodeId, b: &NodeId, alpha: NodeId) -> Result<()> {
        *a = self.add(a, b, alpha)?;
        Ok(())
    }
    fn mul_(&mut self, a: &mut NodeId, s: NodeId) -> Result<()> {
        *a = self.scaled(*a, s)?;
        Ok(())
    }
    fn div_scalar_(&mut self, a: &mut NodeId, s: NodeId) -> Result<()> {
        let s = self.splat(s)?;
        *a = self.b.div(*a, s)?;
        Ok(())
    }
    fn add_scalar_(&mut self, a: &mut NodeId, s: NodeId) -> Result<()> {
        let s = self.splat(s)?;
        *a = self.b.add(*a, s)?;
        Ok(())
    }
    fn addcmul_(&mut self, a: &mut NodeId, t1: &NodeId, t2: &NodeId, value: NodeId) -> Result<()> {
        let prod = self.b.mul(*t1, *t2)?;
        let prod = self.scaled(prod, value)?;
        *a = self.b.add(*a, prod)?;
        Ok(())
    }
    fn addcdiv_(&mut self, a: &mut NodeId, t1: &NodeId, t2: &NodeId, value: NodeId) -> Result<()> {
        let q = self.b.div(*t1, *t2)?;
        let q = self.scaled(q, value)?;
        *a = self.b.add(*a, q)?;
        Ok(())
    }
    fn lerp_(&mut self, a: &mut NodeId, end: &NodeId, weight: f64) -> Result<()> {
        // libtorch: weight < 0.5 ? a + w * (end - a) : end - (end - a) * (1 - w).
        let diff = self.b.sub(*end, *a)?;
        *a = if weight < 0.5 {
            let t = self.b.mul_scalar(diff, weight)?;
            self.b.add(*a, t)?
        } else {
            let t = self.b.mul_scalar(diff, 1.0 - weight)?;
            self.b.sub(*end, t)?
        };
        Ok(())
    }
    fn maximum_(&mut self, a: &mut NodeId, b: &NodeId) -> Result<()> {
        *a = self.b.binary(BinaryOp::Max, *a, *b)?;
        Ok(())
    }
}
