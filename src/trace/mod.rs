//! Tracing: [`Tensor`] runs eagerly on tch tensors, or records into the active trace.
//!
//! The same model code does both. Outside [`trace`], a `Tensor` op executes immediately with
//! libtorch (and takes part in tch's autograd, which is the eager training baseline). Inside
//! `trace`, it appends a typed node to the trace's [`crate::ir::Graph`] instead.
//!
//! Every op is type-checked by [`crate::ir::Op::infer`] in both modes, so a shape error is the
//! same [`crate::Error`] whether it happens eagerly or at trace time, and never a panic.

mod context;
mod ops;
mod rng;

pub use context::{is_tracing, trace, Binding, Traced};
pub(crate) use context::{var_input, with_ctx, LatestTraces, Retrace};

use crate::backend::eager::{eval_op, kind_of};
use crate::backend::HostTensor;
use crate::error::{Error, Result};
use crate::ir::{DType, Literal, Op, Shape, TensorType};
use std::sync::Arc;

/// Whether a variable is trained (a parameter) or only carried (a buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VarKind {
    /// A trainable parameter.
    Parameter,
    /// A non-trainable variable: frozen parameters, running statistics, counters.
    Buffer,
}

/// Identity of a variable of a [`crate::nn::ParamStore`]; carried by its eager tensor so that
/// tracing can lift it to a graph input.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct VarInfo {
    /// Process-unique id.
    pub id: u64,
    /// Hierarchical name, e.g. `layer1.0.conv1.weight`.
    pub name: String,
    /// Parameter or buffer.
    pub kind: VarKind,
}

pub(crate) enum Repr {
    Eager {
        t: tch::Tensor,
        var: Option<Arc<VarInfo>>,
    },
    Traced {
        trace: u64,
        node: crate::ir::NodeId,
    },
}

/// A tensor: a concrete libtorch tensor, or a symbolic value inside a trace.
///
/// Cloning is cheap (shares storage). Operations return [`Result`]; operators (`&a + &b`) do
/// too, in the style of candle: `(&a + &b)?`.
pub struct Tensor {
    pub(crate) ty: TensorType,
    pub(crate) repr: Repr,
}

impl Clone for Tensor {
    fn clone(&self) -> Self {
        Tensor {
            ty: self.ty.clone(),
            repr: match &self.repr {
                Repr::Eager { t, var } => Repr::Eager {
                    t: t.shallow_clone(),
                    var: var.clone(),
                },
                Repr::Traced { trace, node } => Repr::Traced {
                    trace: *trace,
                    node: *node,
                },
            },
        }
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.repr {
            Repr::Eager { var: Some(v), .. } => write!(f, "Tensor({}, var {:?})", self.ty, v.name),
            Repr::Eager { .. } => write!(f, "Tensor({})", self.ty),
            Repr::Traced { trace, node } => {
                write!(
                    f,
                    "Tensor({}, traced %{} in trace {trace})",
                    self.ty,
                    node.index()
                )
            }
        }
    }
}

fn dtype_of_kind(k: tch::Kind) -> Result<DType> {
    Ok(match k {
        tch::Kind::Bool => DType::Bool,
        tch::Kind::Int => DType::I32,
        tch::Kind::Int64 => DType::I64,
        tch::Kind::Float => DType::F32,
        tch::Kind::Double => DType::F64,
        tch::Kind::BFloat16 => DType::BF16,
        tch::Kind::Half => DType::F16,
        other => {
            return Err(Error::Invalid(format!(
            "tch kind {other:?} has no kiln dtype (supported: bool, i32, i64, f32, f64, bf16, f16)"
        )))
        }
    })
}

impl Tensor {
    // ----- construction and access -------------------------------------------------------

    /// Wraps an eager tch tensor (bool, i32, i64, f32, f64, bf16 or f16).
    pub fn from_tch(t: tch::Tensor) -> Result<Tensor> {
        let dtype = dtype_of_kind(t.f_kind()?)?;
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        Ok(Tensor {
            ty: TensorType::new(dtype, shape),
            repr: Repr::Eager { t, var: None },
        })
    }

    /// Wraps a tch tensor holding values of `dtype` (for `U32`, an `Int64` tensor).
    pub(crate) fn from_tch_typed(t: tch::Tensor, dtype: DType) -> Tensor {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        Tensor::from_tch_with_type(t, TensorType::new(dtype, shape))
    }

    /// An eager tensor whose type the caller knows: `t` must have `ty`'s shape and the
    /// libtorch kind of its dtype (saves asking libtorch for the sizes).
    pub(crate) fn from_tch_with_type(t: tch::Tensor, ty: TensorType) -> Tensor {
        Tensor {
            ty,
            repr: Repr::Eager { t, var: None },
        }
    }

    /// A tensor owned by a variable store: tracing lifts it to a graph input.
    pub(crate) fn new_var(t: tch::Tensor, dtype: DType, var: Arc<VarInfo>) -> Tensor {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        Tensor {
            ty: TensorType::new(dtype, shape),
            repr: Repr::Eager { t, var: Some(var) },
        }
    }

    /// An eager tensor from a host tensor.
    pub fn from_host(h: &HostTensor) -> Result<Tensor> {
        Ok(Tensor::from_tch_typed(h.to_tch()?, h.ty().dtype))
    }

    /// An eager `f32` tensor from values and a shape.
    pub fn from_slice<T: crate::backend::Element>(shape: &[usize], values: &[T]) -> Result<Tensor> {
        Tensor::from_host(&HostTensor::from_slice(shape, values)?)
    }

    /// Standard-normal `f32` values from a seeded generator (eager; for inputs and tests).
    pub fn randn(shape: &[usize], seed: u64) -> Result<Tensor> {
        Tensor::randn_dtype(shape, DType::F32, seed)
    }

    /// Standard-normal values of a float `dtype` from a seeded generator (eager).
    pub fn randn_dtype(shape: &[usize], dtype: DType, seed: u64) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::Invalid(format!("randn of {dtype}")));
        }
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        // A private generator per call keeps seeds independent of libtorch's global RNG.
        let g = seeded_normal(shape.iter().product(), seed);
        let t = tch::Tensor::f_from_slice(&g)?
            .f_reshape(&dims)?
            .f_to_kind(kind_of(dtype))?;
        Ok(Tensor::from_tch_typed(t, dtype))
    }

    /// Uniform integers in `[0, high)` (`i64`, eager, seeded).
    pub fn randint(shape: &[usize], high: i64, seed: u64) -> Result<Tensor> {
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let mut s = SplitMix(seed);
        let v: Vec<i64> = (0..shape.iter().product::<usize>())
            .map(|_| (s.next() % high.max(1) as u64) as i64)
            .collect();
        Ok(Tensor::from_tch_typed(
            tch::Tensor::f_from_slice(&v)?.f_reshape(&dims)?,
            DType::I64,
        ))
    }

    /// A tensor filled with `value` (a constant when tracing).
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        let s = Tensor::scalar(value, dtype)?;
        s.broadcast_to(shape)
    }

    /// Zeros.
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype)
    }

    /// Ones.
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }

    /// A scalar constant.
    pub fn scalar(value: f64, dtype: DType) -> Result<Tensor> {
        apply(Op::Constant(Literal::scalar(dtype, value)), &[])
    }

    /// `0, 1, ..., n-1` as `dtype`.
    pub fn arange(n: usize, dtype: DType) -> Result<Tensor> {
        apply(
            Op::Iota {
                ty: TensorType::new(dtype, [n]),
                dim: 0,
            },
            &[],
        )
    }

    /// The static type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.ty.shape
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.ty.shape.dims()
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.ty.shape.rank()
    }

    /// Is this a symbolic (traced) tensor?
    pub fn is_traced(&self) -> bool {
        matches!(self.repr, Repr::Traced { .. })
    }

    /// The variable this tensor belongs to, if it came from a parameter store.
    pub fn variable(&self) -> Option<&Arc<VarInfo>> {
        match &self.repr {
            Repr::Eager { var, .. } => var.as_ref(),
            Repr::Traced { .. } => None,
        }
    }

    /// The underlying tch tensor (eager tensors only; `U32` is held as `Int64`).
    pub fn as_tch(&self) -> Result<&tch::Tensor> {
        match &self.repr {
            Repr::Eager { t, .. } => Ok(t),
            Repr::Traced { .. } => Err(Error::Trace(format!(
                "{self:?} is symbolic: it has no value until the traced graph runs"
            ))),
        }
    }

    /// Copies the values to a host tensor (eager tensors only).
    pub fn to_host(&self) -> Result<HostTensor> {
        HostTensor::from_tch(self.as_tch()?, self.ty.dtype)
    }

    /// The values as `f64` (eager tensors only).
    pub fn to_f64_vec(&self) -> Result<Vec<f64>> {
        Ok(self.to_host()?.to_f64_vec())
    }

    /// The value of a one-element tensor as `f64`.
    pub fn to_scalar(&self) -> Result<f64> {
        let v = self.to_f64_vec()?;
        if v.len() != 1 {
            return Err(Error::Invalid(format!(
                "to_scalar on {} (needs one element)",
                self.ty
            )));
        }
        Ok(v[0])
    }

    /// The same value without gradient history: eagerly libtorch's `detach` (sharing the
    /// memory); in a trace an [`Op::StopGradient`], so that kiln's autograd treats it as a
    /// constant, as libtorch's does. A parameter detached in a
    /// trace stays the graph's input (read anew at every call), not its value at trace time.
    pub fn detach(&self) -> Result<Tensor> {
        match &self.repr {
            Repr::Eager { t, .. } if !context::is_tracing() => {
                Ok(Tensor::from_tch_typed(t.detach(), self.ty.dtype))
            }
            _ => apply(Op::StopGradient, &[self]),
        }
    }

    /// Assigns a new value to this variable: an in-place update of a parameter store entry
    /// (BatchNorm's running statistics, for example).
    ///
    /// Eagerly the store's tensor is overwritten (outside autograd). In a trace the new value
    /// becomes an extra graph output that the runtime writes back after each call.
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        let Some(var) = self.variable().cloned() else {
            return Err(Error::Invalid(format!(
                "assign: {self:?} is not a variable of a parameter store"
            )));
        };
        if value.ty != self.ty {
            return Err(Error::type_error(
                "assign",
                format!("value must be {}", self.ty),
                &[&self.ty, &value.ty],
            ));
        }
        if context::is_tracing() {
            with_ctx(|ctx| {
                let node = ctx.node_of(value)?;
                let found = ctx
                    .assigns
                    .iter_mut()
                    .find(|(v, _)| v.variable().map(|i| i.id) == Some(var.id));
                match found {
                    Some(slot) => slot.1 = node,
                    None => ctx.assigns.push((self.clone(), node)),
                }
                // Later reads of the variable in this trace see the new value, as they do
                // eagerly.
                ctx.lifted.insert(var.id, node);
                Ok(())
            })
        } else {
            let src = value.as_tch()?;
            let dst = self.as_tch()?;
            tch::no_grad(|| dst.shallow_clone().f_copy_(src))?;
            Ok(())
        }
    }
}

/// Applies a primitive op: records it when a trace is active, otherwise evaluates it with tch.
pub(crate) fn apply(op: Op, operands: &[&Tensor]) -> Result<Tensor> {
    let op = match context::record(op, operands) {
        Ok(traced) => return traced,
        Err(op) => op,
    };
    let types: Vec<&TensorType> = operands.iter().map(|t| &t.ty).collect();
    let out = op.infer(&types)?;
    let args = operands
        .iter()
        .map(|t| t.as_tch())
        .collect::<Result<Vec<_>>>()?;
    let t = eval_op(&op, &args, &types, &out)?;
    Ok(Tensor {
        ty: out,
        repr: Repr::Eager { t, var: None },
    })
}

/// A small deterministic generator for seeded eager initialisation (independent of libtorch's
/// global RNG, so results do not depend on what ran before).
pub(crate) struct SplitMix(pub u64);

impl SplitMix {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub(crate) fn uniform(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n` standard-normal samples (Box-Muller) from a seed.
pub(crate) fn seeded_normal(n: usize, seed: u64) -> Vec<f64> {
    let mut s = SplitMix(seed ^ 0x6B69_6C6E);
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let u1 = 1.0 - s.uniform();
        let u2 = s.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        out.push(r * (2.0 * std::f64::consts::PI * u2).cos());
        out.push(r * (2.0 * std::f64::consts::PI * u2).sin());
    }
    out.truncate(n);
    out
}
