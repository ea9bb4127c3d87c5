//! The closed set of graph operations and their type rules.
//!
//! Ops are close to StableHLO's so that lowering is direct and every backend interprets the
//! same small set. Higher-level functions (softmax, layer norm, matmul with broadcasting,
//! mean, ...) are compositions built by [`crate::Tensor`]. Every op produces exactly one value.
//!
//! Layout conventions fixed by the IR: convolutions and windowed reductions use
//! `[batch, feature, spatial...]` for activations and `[out_feature, in_feature, spatial...]` for
//! kernels (PyTorch's NCHW / OIHW).

use super::{DType, Shape, TensorType};
use crate::error::{Error, Result};
use std::fmt;
use std::sync::Arc;

/// Elementwise functions of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `|x|`
    Abs,
    /// `e^x`
    Exp,
    /// natural log
    Log,
    /// `log(1 + x)`
    Log1p,
    /// square root
    Sqrt,
    /// `1 / sqrt(x)`
    Rsqrt,
    /// hyperbolic tangent
    Tanh,
    /// `1 / (1 + e^-x)`
    Logistic,
    /// error function
    Erf,
    /// sine
    Sin,
    /// cosine
    Cos,
    /// round toward -inf
    Floor,
    /// round toward +inf
    Ceil,
    /// -1, 0 or 1; for floats ±0 and NaN are returned unchanged (StableHLO: `sign(-0.0)` is
    /// `-0.0`)
    Sign,
    /// logical not (bool) or bitwise not (integers)
    Not,
}

impl UnaryOp {
    /// Name as printed in the text form.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Log1p => "log1p",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Logistic => "logistic",
            UnaryOp::Erf => "erf",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Sign => "sign",
            UnaryOp::Not => "not",
        }
    }

    fn accepts(self, d: DType) -> bool {
        match self {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign => d != DType::Bool && d != DType::U32,
            UnaryOp::Not => !d.is_float(),
            _ => d.is_float(),
        }
    }
}

/// Elementwise functions of two operands of the same type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b` (integers wrap)
    Add,
    /// `a - b` (integers wrap)
    Sub,
    /// `a * b` (integers wrap)
    Mul,
    /// `a / b`. Integers truncate toward zero, and division is total as in XLA: `x / 0` is -1
    /// (all bits set, `u32::MAX` for `U32`) and `MIN / -1` is `MIN`.
    Div,
    /// Remainder with the sign of the dividend (C `fmod`). Integers: `x % 0` is `x` and
    /// `MIN % -1` is 0 (as in XLA).
    Rem,
    /// `a ^ b` (floats)
    Pow,
    /// Elementwise maximum; NaN propagates (if either operand is NaN the result is NaN).
    Max,
    /// Elementwise minimum; NaN propagates.
    Min,
    /// logical/bitwise and
    And,
    /// logical/bitwise or
    Or,
    /// logical/bitwise xor
    Xor,
    /// `a << b` (integers). A shift amount that is `>=` the bit width when read as unsigned
    /// (so also a negative one) gives 0 (StableHLO).
    ShiftLeft,
    /// Logical `a >> b` (integers, signed ones too: zeros are shifted in). Amounts `>=` the bit
    /// width (as unsigned) give 0.
    ShiftRightLogical,
}

impl BinaryOp {
    /// Name as printed in the text form.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Rem => "rem",
            BinaryOp::Pow => "pow",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::ShiftLeft => "shift_left",
            BinaryOp::ShiftRightLogical => "shift_right_logical",
        }
    }

    fn accepts(self, d: DType) -> bool {
        match self {
            BinaryOp::Add
            | BinaryOp::Sub
            | BinaryOp::Mul
            | BinaryOp::Div
            | BinaryOp::Rem
            | BinaryOp::Max
            | BinaryOp::Min => d != DType::Bool,
            BinaryOp::Pow => d.is_float(),
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => !d.is_float(),
            BinaryOp::ShiftLeft | BinaryOp::ShiftRightLogical => d.is_int(),
        }
    }
}

/// Elementwise comparisons; the result is `Bool`. Floats compare as IEEE 754 (every
/// comparison with NaN is false except `Ne`), `U32` compares unsigned, `Bool` as 0 < 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CompareOp {
    /// `==`
    Eq,
    /// `!=`
    Ne,
    /// `<`
    Lt,
    /// `<=`
    Le,
    /// `>`
    Gt,
    /// `>=`
    Ge,
}

impl CompareOp {
    /// Name as printed in the text form (also StableHLO's comparison direction, lowercased).
    pub fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "eq",
            CompareOp::Ne => "ne",
            CompareOp::Lt => "lt",
            CompareOp::Le => "le",
            CompareOp::Gt => "gt",
            CompareOp::Ge => "ge",
        }
    }
}

/// The combining function of a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    /// Sum; identity 0.
    Sum,
    /// Maximum; identity -inf (or the type's minimum).
    Max,
    /// Minimum; identity +inf (or the type's maximum).
    Min,
}

impl ReduceKind {
    /// Name as printed in the text form.
    pub fn name(self) -> &'static str {
        match self {
            ReduceKind::Sum => "sum",
            ReduceKind::Max => "max",
            ReduceKind::Min => "min",
        }
    }
}

/// Dimension numbers of a [`Op::DotGeneral`]: batch and contracting dimensions of each side.
///
/// The result's dimensions are: batch dims, then lhs free dims, then rhs free dims (StableHLO).
// Equality is field by field as derived (written out for speed, see `same_dims`), so it agrees
// with the derived `Hash`.
#[allow(clippy::derived_hash_with_manual_eq)]
#[derive(Clone, Debug, Eq, Hash, Default)]
pub struct DotDims {
    /// Batch dimensions of the left operand.
    pub lhs_batch: Vec<usize>,
    /// Batch dimensions of the right operand (paired with `lhs_batch`).
    pub rhs_batch: Vec<usize>,
    /// Contracting dimensions of the left operand.
    pub lhs_contract: Vec<usize>,
    /// Contracting dimensions of the right operand (paired with `lhs_contract`).
    pub rhs_contract: Vec<usize>,
}

impl DotDims {
    /// Dims from their lists: batch dims of the left and right operands (paired in order),
    /// then their contracting dims (paired in order).
    pub fn new(
        lhs_batch: &[usize],
        rhs_batch: &[usize],
        lhs_contract: &[usize],
        rhs_contract: &[usize],
    ) -> DotDims {
        DotDims {
            lhs_batch: lhs_batch.to_vec(),
            rhs_batch: rhs_batch.to_vec(),
            lhs_contract: lhs_contract.to_vec(),
            rhs_contract: rhs_contract.to_vec(),
        }
    }
}

impl PartialEq for DotDims {
    fn eq(&self, other: &DotDims) -> bool {
        same_dims(&self.lhs_batch, &other.lhs_batch)
            && same_dims(&self.rhs_batch, &other.rhs_batch)
            && same_dims(&self.lhs_contract, &other.lhs_contract)
            && same_dims(&self.rhs_contract, &other.rhs_contract)
    }
}

/// `a == b` for dimension lists, element by element. A slice comparison calls `memcmp`, and
/// for an empty `Vec` (whose pointer is dangling) glibc's AVX-512 `memcmp` makes a masked
/// load from that address which costs ~120 ns (a fault-suppression assist) on CPUs with
/// AVX-512, against ~3 ns for a non-empty one. Dots without batch dims and broadcasts of
/// scalars have empty lists, and comparing a trace with the latest one meets them on every
/// call.
pub(crate) fn same_dims<T: PartialEq>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x == y)
}

/// Attributes of a [`Op::Conv`] (layout: input `[N, C, *spatial]`, kernel `[O, C/groups, *k]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ConvAttrs {
    /// Window strides, one per spatial dim.
    pub strides: Vec<usize>,
    /// Padding `(low, high)` per spatial dim; may be negative (cropping).
    pub padding: Vec<(i64, i64)>,
    /// Input (lhs) dilation: zeros inserted between input elements (transposed convolution).
    pub lhs_dilation: Vec<usize>,
    /// Kernel (rhs) dilation (atrous convolution).
    pub rhs_dilation: Vec<usize>,
    /// Feature groups (`groups` in PyTorch; `C` for depthwise).
    pub feature_groups: usize,
    /// Batch groups (used by the weight gradient of grouped convolutions), as StableHLO's
    /// `batch_group_count`: the input batch is split into `batch_groups` contiguous blocks and
    /// the output features into as many blocks; block `g` of the batch is convolved with block
    /// `g` of the kernel's output features, and the results are concatenated along the
    /// features. The result batch is `N / batch_groups`.
    pub batch_groups: usize,
}

impl ConvAttrs {
    /// Plain convolution attributes for `n` spatial dims: stride 1, no padding, no dilation.
    pub fn plain(n: usize) -> Self {
        ConvAttrs {
            strides: vec![1; n],
            padding: vec![(0, 0); n],
            lhs_dilation: vec![1; n],
            rhs_dilation: vec![1; n],
            feature_groups: 1,
            batch_groups: 1,
        }
    }
}

/// Attributes of windowed ops ([`Op::ReduceWindow`], [`Op::SelectAndScatter`]) over the
/// trailing spatial dims of a `[N, C, *spatial]` operand.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WindowAttrs {
    /// Window size per spatial dim.
    pub window: Vec<usize>,
    /// Stride per spatial dim.
    pub strides: Vec<usize>,
    /// Padding `(low, high)` per spatial dim (padded elements are the reduction's identity).
    pub padding: Vec<(usize, usize)>,
}

/// A constant tensor: its type and little-endian, row-major bytes.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Literal {
    ty: TensorType,
    bytes: Arc<[u8]>,
}

impl Literal {
    /// A literal from raw little-endian, row-major bytes.
    ///
    /// Rejects bytes that do not encode exactly one value of `ty`: a length other than
    /// `numel × dtype size` (or a type too large to exist), and `Bool` bytes other than 0 or 1.
    /// Every later read of the literal can therefore rely on its bytes.
    pub fn from_bytes(ty: TensorType, bytes: impl Into<Arc<[u8]>>) -> Result<Self> {
        let bytes = bytes.into();
        let Some(need) = ty.checked_size_in_bytes() else {
            return Err(Error::Invalid(format!(
                "literal of type {ty}: too large (its size in bytes overflows usize)"
            )));
        };
        if bytes.len() != need {
            return Err(Error::Invalid(format!(
                "literal of type {ty} needs {need} bytes ({} elements of {} bytes), got {}",
                ty.shape.numel(),
                ty.dtype.size_in_bytes(),
                bytes.len()
            )));
        }
        if ty.dtype == DType::Bool {
            if let Some((i, b)) = bytes.iter().enumerate().find(|(_, &b)| b > 1) {
                return Err(Error::Invalid(format!(
                    "literal of type {ty}: element {i} is the byte {b}, a bool must be 0 or 1"
                )));
            }
        }
        Ok(Literal { ty, bytes })
    }

    /// A scalar of `dtype` holding `v` converted to that type (`v != 0` for `Bool`).
    pub fn scalar(dtype: DType, v: f64) -> Self {
        let bytes: Vec<u8> = match dtype {
            DType::Bool => vec![(v != 0.0) as u8],
            DType::U32 => (v as u32).to_le_bytes().to_vec(),
            DType::I32 => (v as i32).to_le_bytes().to_vec(),
            DType::I64 => (v as i64).to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
            DType::F64 => v.to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(v).to_le_bytes().to_vec(),
            DType::F16 => half::f16::from_f64(v).to_le_bytes().to_vec(),
        };
        Literal {
            ty: TensorType::scalar(dtype),
            bytes: bytes.into(),
        }
    }

    /// The literal's type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The `N` bytes of element `i` (`N` = the dtype's size). Panics if `i` is out of range,
    /// like slice indexing; the length is right by construction ([`Literal::from_bytes`]).
    pub(crate) fn element_bytes<const N: usize>(&self, i: usize) -> [u8; N] {
        debug_assert_eq!(N, self.ty.dtype.size_in_bytes());
        let mut a = [0u8; N];
        a.copy_from_slice(&self.bytes[i * N..(i + 1) * N]);
        a
    }

    /// Element `i` converted to `f64` (for printing and constant folding). Panics if `i` is
    /// not below the number of elements.
    pub fn get_f64(&self, i: usize) -> f64 {
        match self.ty.dtype {
            DType::Bool => self.bytes[i] as f64,
            DType::U32 => u32::from_le_bytes(self.element_bytes(i)) as f64,
            DType::I32 => i32::from_le_bytes(self.element_bytes(i)) as f64,
            DType::I64 => i64::from_le_bytes(self.element_bytes(i)) as f64,
            DType::F32 => f32::from_le_bytes(self.element_bytes(i)) as f64,
            DType::F64 => f64::from_le_bytes(self.element_bytes(i)),
            DType::BF16 => half::bf16::from_le_bytes(self.element_bytes(i)).to_f64(),
            DType::F16 => half::f16::from_le_bytes(self.element_bytes(i)).to_f64(),
        }
    }

    /// If every element equals the first, that value as `f64`.
    pub fn splat_value(&self) -> Option<f64> {
        let s = self.ty.dtype.size_in_bytes();
        let first = self.bytes.get(..s)?;
        self.bytes
            .chunks(s)
            .all(|c| c == first)
            .then(|| self.get_f64(0))
    }
}

impl fmt::Debug for Literal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.splat_value() {
            Some(v) if self.ty.shape.rank() == 0 => write!(f, "{v}"),
            Some(v) => write!(f, "splat({v})"),
            None => write!(f, "<{} bytes>", self.bytes.len()),
        }
    }
}

/// A graph operation. Closed: every pass, rule and backend matches on it exhaustively.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// The `index`-th graph input (see [`crate::ir::Graph::inputs`]).
    Input(usize),
    /// A constant.
    Constant(Literal),
    /// `0, 1, 2, ...` along `dim` of a tensor of type `ty`.
    Iota {
        /// Result type.
        ty: TensorType,
        /// The counting dimension.
        dim: usize,
    },
    /// Elementwise unary function.
    Unary(UnaryOp),
    /// Elementwise binary function of two operands of identical type.
    Binary(BinaryOp),
    /// Elementwise comparison of two operands of identical type; yields `Bool`.
    Compare(CompareOp),
    /// `select(pred, on_true, on_false)`; `pred` is `Bool` of the same shape.
    Select,
    /// Element type conversion, as StableHLO/XLA define it: float→integer truncates toward zero
    /// and saturates at the target's range (NaN gives 0); integer→integer wraps (two's
    /// complement); to `Bool` is `!= 0` (NaN gives true); from `Bool` is 0 or 1; float→float
    /// rounds to nearest even.
    Convert(DType),
    /// `broadcast_in_dim`: operand dim `i` becomes result dim `dims[i]` (size equal or 1).
    Broadcast {
        /// Result shape.
        shape: Shape,
        /// Where each operand dimension goes, strictly increasing.
        dims: Vec<usize>,
    },
    /// Row-major reshape to a shape with the same element count.
    Reshape(Shape),
    /// Dimension permutation: result dim `i` is operand dim `perm[i]`.
    Transpose(Vec<usize>),
    /// Strided slice `[start, limit)` per dim.
    Slice {
        /// Start index per dim.
        start: Vec<usize>,
        /// Exclusive end per dim.
        limit: Vec<usize>,
        /// Step per dim (>= 1).
        stride: Vec<usize>,
    },
    /// Concatenation of any number of operands along `axis`.
    Concat {
        /// The joining dimension.
        axis: usize,
    },
    /// Padding with the value of a scalar second operand: `low`/`high` edges (may be negative)
    /// and `interior` elements inserted between neighbours.
    Pad {
        /// Edge padding before each dim.
        low: Vec<i64>,
        /// Edge padding after each dim.
        high: Vec<i64>,
        /// Interior padding per dim.
        interior: Vec<usize>,
    },
    /// Reversal along `dims`.
    Reverse(Vec<usize>),
    /// Generalized matrix product.
    DotGeneral(DotDims),
    /// Reduction over `axes` (removed from the shape). Integer sums wrap; float max/min
    /// propagate NaN; reducing zero elements gives the identity (0, -inf/+inf, or the integer
    /// type's minimum/maximum).
    Reduce {
        /// Combining function.
        kind: ReduceKind,
        /// Reduced dims, strictly increasing.
        axes: Vec<usize>,
    },
    /// Windowed reduction over the spatial dims of `[N, C, *spatial]` (pooling). Padding holds
    /// the reduction's identity, so a window of pure padding gives the identity.
    ReduceWindow {
        /// Combining function.
        kind: ReduceKind,
        /// Window geometry.
        attrs: WindowAttrs,
    },
    /// Max pooling's gradient: operands `(operand, source)`; each `source` element is added at
    /// the position of its window's maximum in a zero tensor shaped like `operand`.
    ///
    /// The selection is deterministic (StableHLO leaves it to the implementation): padding is
    /// never selected (a window of pure padding drops its source element); among the real
    /// elements a NaN beats any number, then the larger value wins, and ties go to the element
    /// first in row-major order. Without NaNs this is "first maximum", as in PyTorch.
    SelectAndScatter(WindowAttrs),
    /// N-d convolution (cross-correlation, as PyTorch and StableHLO define it).
    Conv(ConvAttrs),
    /// Take slices of operand 0 along `axis` at the integer indices of operand 1; result shape
    /// is `x[..axis] ++ indices.shape ++ x[axis+1..]`. Indices are clamped into range. An
    /// empty `axis` is allowed only when the result is empty (there is nothing to take).
    Take {
        /// The indexed dimension.
        axis: usize,
    },
    /// Inverse of `Take`: operands `(base, indices, updates)`; adds each slice of `updates` into
    /// `base` at its index along `axis` (duplicates accumulate, integers wrap). Indices are
    /// clamped into range, as in `Take`. Result type is `base`'s.
    ScatterAdd {
        /// The indexed dimension.
        axis: usize,
    },
    /// Cross-replica reduction (`stablehlo.all_reduce` over all replicas): in a program compiled
    /// for N data-parallel replicas ([`crate::backend::xla::Replicated`]), every replica gets
    /// the combination of all replicas' operand values. A program of one replica (every
    /// single-device compile, and the eager interpreter) is its own only replica: the identity.
    /// Float max/min across replicas follow the device's collective, which need not propagate
    /// NaN as [`Op::Reduce`] does.
    AllReduce(ReduceKind),
    /// Operand 0, available only once every operand is computed (`stablehlo.optimization_barrier`
    /// in meaning; the XLA backend lowers it to a custom call of its own, since XLA's CPU
    /// compiler drops optimization barriers before copy insertion): an ordering, not a
    /// computation. A fused training step's update reads a large weight through one whose
    /// other operands are the weight's gradient and the products that read it, so that XLA can
    /// update the donated buffer in place; without it the input gradient's product, which also
    /// reads the weight, is unordered with the update, and XLA copies the weight on entry.
    /// Result type is operand 0's.
    Barrier,
    /// The operand's value, through which no gradient flows (JAX's `stop_gradient`, what a
    /// traced [`Tensor::detach`](crate::Tensor::detach) records): autograd treats the result
    /// as a constant. An identity everywhere else; [`crate::passes::StripStopGradients`]
    /// removes it once a graph is differentiated (and from graphs `compile` does not
    /// differentiate), so a backend sees one only in a graph handed to it directly.
    StopGradient,
}

impl Op {
    /// `self == other`, comparing the dimension lists of broadcasts without `memcmp` (see
    /// [`same_dims`]); what [`crate::ir::Graph::same_structure`] compares nodes with, and a
    /// trace every time its ops with the latest trace's.
    pub(crate) fn same_as(&self, other: &Op) -> bool {
        match (self, other) {
            (
                Op::Broadcast { shape, dims },
                Op::Broadcast {
                    shape: shape2,
                    dims: dims2,
                },
            ) => shape == shape2 && same_dims(dims, dims2),
            _ => self == other,
        }
    }

    /// Is this an elementwise op, a layout op (reshape, transpose, slice, pad, concatenation,
    /// reversal) or a constant: cheap to compute again from its operands, what a fusing
    /// compiler inlines into its consumers? Recomputing training steps recompute these in the
    /// backward graph (`SavePolicy::RecomputeElementwise`); the XLA lowering finds the chains
    /// XLA would recompute through them (`backend/xla/materialize.rs`).
    pub fn is_elementwise_or_layout(&self) -> bool {
        match self {
            Op::Unary(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Select
            | Op::Convert(_)
            | Op::Broadcast { .. }
            | Op::Reshape(_)
            | Op::Transpose(_)
            | Op::Reverse(_)
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Concat { .. }
            | Op::Constant(_)
            | Op::Iota { .. }
            | Op::StopGradient => true,
            Op::Input(_)
            | Op::DotGeneral(_)
            | Op::Reduce { .. }
            | Op::ReduceWindow { .. }
            | Op::SelectAndScatter(_)
            | Op::Conv(_)
            | Op::Take { .. }
            | Op::ScatterAdd { .. }
            | Op::AllReduce(_)
            | Op::Barrier => false,
        }
    }

    /// Short name of the op, as printed.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input(_) => "input",
            Op::Constant(_) => "constant",
            Op::Iota { .. } => "iota",
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Compare(_) => "compare",
            Op::Select => "select",
            Op::Convert(_) => "convert",
            Op::Broadcast { .. } => "broadcast",
            Op::Reshape(_) => "reshape",
            Op::Transpose(_) => "transpose",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Pad { .. } => "pad",
            Op::Reverse(_) => "reverse",
            Op::DotGeneral(_) => "dot_general",
            Op::Reduce { .. } => "reduce",
            Op::ReduceWindow { .. } => "reduce_window",
            Op::SelectAndScatter(_) => "select_and_scatter",
            Op::Conv(_) => "conv",
            Op::Take { .. } => "take",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::AllReduce(_) => "all_reduce",
            Op::Barrier => "barrier",
            Op::StopGradient => "stop_gradient",
        }
    }

    /// Does the op's result depend only on its operands (no side effects, no randomness)?
    /// All ops are pure today; randomness is built from integer ops on an explicit key input.
    pub fn is_pure(&self) -> bool {
        true
    }

    /// Infers the result type from the operand types, or explains why they are invalid.
    ///
    /// `Input` cannot be inferred (its type is declared with the graph input).
    pub fn infer(&self, operands: &[&TensorType]) -> Result<TensorType> {
        let err = |msg: String| Err(Error::type_error(self.name(), msg, operands));
        let arity = |n: usize| -> Result<()> {
            if operands.len() != n {
                return Err(Error::type_error(
                    self.name(),
                    format!("expects {n} operand(s), got {}", operands.len()),
                    operands,
                ));
            }
            Ok(())
        };
        match self {
            Op::Input(_) => err("the type of an input is declared with the graph input".into()),
            Op::Constant(lit) => {
                arity(0)?;
                Ok(lit.ty().clone())
            }
            Op::Iota { ty, dim } => {
                arity(0)?;
                if *dim >= ty.shape.rank() {
                    return err(format!("iota dim {dim} out of range for {ty}"));
                }
                if ty.dtype == DType::Bool {
                    return err("iota of bool".into());
                }
                Ok(ty.clone())
            }
            Op::Unary(u) => {
                arity(1)?;
                let a = operands[0];
                if !u.accepts(a.dtype) {
                    return err(format!("not defined for {}", a.dtype));
                }
                Ok(a.clone())
            }
            Op::Binary(b) => {
                arity(2)?;
                let (a, c) = (operands[0], operands[1]);
                if a != c {
                    return err("operands must have identical types (broadcast first)".into());
                }
                if !b.accepts(a.dtype) {
                    return err(format!("not defined for {}", a.dtype));
                }
                Ok(a.clone())
            }
            Op::Compare(_) => {
                arity(2)?;
                let (a, c) = (operands[0], operands[1]);
                if a != c {
                    return err("operands must have identical types (broadcast first)".into());
                }
                Ok(a.with_dtype(DType::Bool))
            }
            Op::Select => {
                arity(3)?;
                let (p, t, f) = (operands[0], operands[1], operands[2]);
                if p.dtype != DType::Bool || p.shape != t.shape || t != f {
                    return err(
                        "expects (bool[S], T[S], T[S]): a bool predicate and two branches of one type"
                            .into(),
                    );
                }
                Ok(t.clone())
            }
            Op::Convert(d) => {
                arity(1)?;
                Ok(operands[0].with_dtype(*d))
            }
            Op::Broadcast { shape, dims } => {
                arity(1)?;
                let a = operands[0];
                if dims.len() != a.shape.rank() {
                    return err(format!(
                        "dims {dims:?} must name one result dim per operand dim"
                    ));
                }
                for (i, &d) in dims.iter().enumerate() {
                    if d >= shape.rank() || (i > 0 && dims[i - 1] >= d) {
                        return err(format!(
                            "dims {dims:?} must be strictly increasing and < {}",
                            shape.rank()
                        ));
                    }
                    let (src, dst) = (a.shape.dim(i), shape.dim(d));
                    if src != dst && src != 1 {
                        return err(format!(
                            "cannot broadcast dim {i} of size {src} to size {dst} (result {shape})"
                        ));
                    }
                }
                Ok(TensorType::new(a.dtype, shape.clone()))
            }
            Op::Reshape(shape) => {
                arity(1)?;
                let a = operands[0];
                if a.shape.numel() != shape.numel() {
                    return err(format!(
                        "cannot reshape {} elements to {shape}",
                        a.shape.numel()
                    ));
                }
                Ok(TensorType::new(a.dtype, shape.clone()))
            }
            Op::Transpose(perm) => {
                arity(1)?;
                let a = operands[0];
                if !is_permutation(perm, a.shape.rank()) {
                    return err(format!(
                        "{perm:?} is not a permutation of rank {}",
                        a.shape.rank()
                    ));
                }
                let dims: Vec<usize> = perm.iter().map(|&p| a.shape.dim(p)).collect();
                Ok(TensorType::new(a.dtype, dims))
            }
            Op::Slice {
                start,
                limit,
                stride,
            } => {
                arity(1)?;
                let a = operands[0];
                let r = a.shape.rank();
                if start.len() != r || limit.len() != r || stride.len() != r {
                    return err(format!("start/limit/stride need {r} entries"));
                }
                let mut dims = Vec::with_capacity(r);
                for i in 0..r {
                    if stride[i] == 0 || start[i] > limit[i] || limit[i] > a.shape.dim(i) {
                        return err(format!(
                            "bad slice [{}:{}:{}] of dim {i} (size {})",
                            start[i],
                            limit[i],
                            stride[i],
                            a.shape.dim(i)
                        ));
                    }
                    dims.push((limit[i] - start[i]).div_ceil(stride[i]));
                }
                Ok(TensorType::new(a.dtype, dims))
            }
            Op::Concat { axis } => {
                if operands.is_empty() {
                    return err("needs at least one operand".into());
                }
                let first = operands[0];
                if *axis >= first.shape.rank() {
                    return err(format!("axis {axis} out of range"));
                }
                let mut dims = first.shape.dims().to_vec();
                dims[*axis] = 0;
                for o in operands {
                    let same = o.dtype == first.dtype
                        && o.shape.rank() == first.shape.rank()
                        && (0..first.shape.rank())
                            .all(|i| i == *axis || o.shape.dim(i) == first.shape.dim(i));
                    if !same {
                        return err(format!("operands differ outside axis {axis}"));
                    }
                    dims[*axis] += o.shape.dim(*axis);
                }
                Ok(TensorType::new(first.dtype, dims))
            }
            Op::Pad {
                low,
                high,
                interior,
            } => {
                arity(2)?;
                let (a, v) = (operands[0], operands[1]);
                let r = a.shape.rank();
                if v.shape.rank() != 0 || v.dtype != a.dtype {
                    return err("the padding value must be a scalar of the operand's dtype".into());
                }
                if low.len() != r || high.len() != r || interior.len() != r {
                    return err(format!("low/high/interior need {r} entries"));
                }
                let mut dims = Vec::with_capacity(r);
                for i in 0..r {
                    let n = a.shape.dim(i) as i64;
                    let inner = if n == 0 {
                        0
                    } else {
                        n + (n - 1) * interior[i] as i64
                    };
                    let size = inner + low[i] + high[i];
                    if size < 0 {
                        return err(format!("padding makes dim {i} negative"));
                    }
                    dims.push(size as usize);
                }
                Ok(TensorType::new(a.dtype, dims))
            }
            Op::Reverse(dims) => {
                arity(1)?;
                let a = operands[0];
                if dims.iter().any(|&d| d >= a.shape.rank()) {
                    return err(format!("dims {dims:?} out of range"));
                }
                if !distinct(dims) {
                    return err(format!("dims {dims:?} repeat a dimension"));
                }
                Ok(a.clone())
            }
            Op::DotGeneral(d) => {
                arity(2)?;
                infer_dot(d, operands[0], operands[1]).or_else(&err)
            }
            Op::Reduce { axes, .. } => {
                arity(1)?;
                let a = operands[0];
                if a.dtype == DType::Bool {
                    return err("reduction of bool".into());
                }
                for (i, &ax) in axes.iter().enumerate() {
                    if ax >= a.shape.rank() || (i > 0 && axes[i - 1] >= ax) {
                        return err(format!(
                            "axes {axes:?} must be strictly increasing and < rank {}",
                            a.shape.rank()
                        ));
                    }
                }
                let dims: Vec<usize> = (0..a.shape.rank())
                    .filter(|i| !axes.contains(i))
                    .map(|i| a.shape.dim(i))
                    .collect();
                Ok(TensorType::new(a.dtype, dims))
            }
            Op::ReduceWindow { attrs, .. } => {
                arity(1)?;
                let a = operands[0];
                infer_window(attrs, a).or_else(&err)
            }
            Op::SelectAndScatter(attrs) => {
                arity(2)?;
                let (a, s) = (operands[0], operands[1]);
                let out = infer_window(attrs, a).or_else(&err)?;
                if *s != out {
                    return err(format!("source must be {out} (the pooled shape)"));
                }
                Ok(a.clone())
            }
            Op::Conv(c) => {
                arity(2)?;
                infer_conv(c, operands[0], operands[1]).or_else(&err)
            }
            Op::Take { axis } => {
                arity(2)?;
                let (x, idx) = (operands[0], operands[1]);
                if !matches!(idx.dtype, DType::I32 | DType::I64) {
                    return err("indices must be i32 or i64".into());
                }
                if *axis >= x.shape.rank() {
                    return err(format!("axis {axis} out of range"));
                }
                let mut dims = x.shape.dims()[..*axis].to_vec();
                dims.extend_from_slice(idx.shape.dims());
                dims.extend_from_slice(&x.shape.dims()[axis + 1..]);
                if x.shape.dim(*axis) == 0 && dims.iter().product::<usize>() > 0 {
                    return err(format!(
                        "axis {axis} is empty: there is no slice to take for a non-empty result"
                    ));
                }
                Ok(TensorType::new(x.dtype, dims))
            }
            Op::ScatterAdd { axis } => {
                arity(3)?;
                let (base, idx, upd) = (operands[0], operands[1], operands[2]);
                if !matches!(idx.dtype, DType::I32 | DType::I64) {
                    return err("indices must be i32 or i64".into());
                }
                if *axis >= base.shape.rank() {
                    return err(format!("axis {axis} out of range"));
                }
                let mut dims = base.shape.dims()[..*axis].to_vec();
                dims.extend_from_slice(idx.shape.dims());
                dims.extend_from_slice(&base.shape.dims()[axis + 1..]);
                if upd.dtype != base.dtype || upd.shape.dims() != dims.as_slice() {
                    return err(format!(
                        "updates must be {}",
                        TensorType::new(base.dtype, dims)
                    ));
                }
                Ok(base.clone())
            }
            Op::AllReduce(_) => {
                arity(1)?;
                if operands[0].dtype == DType::Bool {
                    return err("not defined for bool".into());
                }
                Ok(operands[0].clone())
            }
            Op::Barrier => match operands.first() {
                Some(t) => Ok((*t).clone()),
                None => err("needs at least one operand".into()),
            },
            Op::StopGradient => {
                arity(1)?;
                Ok(operands[0].clone())
            }
        }
    }
}

/// No value occurs twice.
fn distinct(xs: &[usize]) -> bool {
    xs.iter().enumerate().all(|(i, x)| !xs[..i].contains(x))
}

fn is_permutation(perm: &[usize], rank: usize) -> bool {
    let mut seen = vec![false; rank];
    perm.len() == rank
        && perm
            .iter()
            .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true))
}

fn infer_dot(
    d: &DotDims,
    a: &TensorType,
    b: &TensorType,
) -> std::result::Result<TensorType, String> {
    if a.dtype != b.dtype {
        return Err(format!("dtypes differ: {} vs {}", a.dtype, b.dtype));
    }
    if a.dtype == DType::Bool {
        return Err("dot of bool".into());
    }
    if d.lhs_batch.len() != d.rhs_batch.len() || d.lhs_contract.len() != d.rhs_contract.len() {
        return Err(format!("unpaired dimension numbers {d:?}"));
    }
    let check = |dims: &[usize], ty: &TensorType| dims.iter().all(|&x| x < ty.shape.rank());
    if !check(&d.lhs_batch, a)
        || !check(&d.lhs_contract, a)
        || !check(&d.rhs_batch, b)
        || !check(&d.rhs_contract, b)
    {
        return Err(format!("dimension numbers {d:?} out of range"));
    }
    // Each dimension of a side is a batch dim, a contracting dim, or neither, once.
    let lhs: Vec<usize> = d.lhs_batch.iter().chain(&d.lhs_contract).copied().collect();
    let rhs: Vec<usize> = d.rhs_batch.iter().chain(&d.rhs_contract).copied().collect();
    if !distinct(&lhs) || !distinct(&rhs) {
        return Err(format!(
            "dimension numbers {d:?} use a dimension twice (batch and contracting dims must be \
             distinct)"
        ));
    }
    for (&l, &r) in d.lhs_batch.iter().zip(&d.rhs_batch) {
        if a.shape.dim(l) != b.shape.dim(r) {
            return Err(format!(
                "batch dims differ: lhs dim {l} = {} vs rhs dim {r} = {}",
                a.shape.dim(l),
                b.shape.dim(r)
            ));
        }
    }
    for (&l, &r) in d.lhs_contract.iter().zip(&d.rhs_contract) {
        if a.shape.dim(l) != b.shape.dim(r) {
            return Err(format!(
                "contracting dims differ: lhs dim {l} = {} vs rhs dim {r} = {}",
                a.shape.dim(l),
                b.shape.dim(r)
            ));
        }
    }
    let mut dims: Vec<usize> = d.lhs_batch.iter().map(|&i| a.shape.dim(i)).collect();
    for i in 0..a.shape.rank() {
        if !d.lhs_batch.contains(&i) && !d.lhs_contract.contains(&i) {
            dims.push(a.shape.dim(i));
        }
    }
    for i in 0..b.shape.rank() {
        if !d.rhs_batch.contains(&i) && !d.rhs_contract.contains(&i) {
            dims.push(b.shape.dim(i));
        }
    }
    Ok(TensorType::new(a.dtype, dims))
}

fn infer_window(w: &WindowAttrs, a: &TensorType) -> std::result::Result<TensorType, String> {
    let r = a.shape.rank();
    if r < 3 {
        return Err(format!("needs a [N, C, *spatial] operand, got rank {r}"));
    }
    let n = r - 2;
    if w.window.len() != n || w.strides.len() != n || w.padding.len() != n {
        return Err(format!("window/strides/padding need {n} entries"));
    }
    let mut dims = vec![a.shape.dim(0), a.shape.dim(1)];
    for i in 0..n {
        let padded = a.shape.dim(i + 2) + w.padding[i].0 + w.padding[i].1;
        if w.strides[i] == 0 || w.window[i] == 0 || padded < w.window[i] {
            return Err(format!(
                "window {} with stride {} does not fit padded size {padded} of spatial dim {i}",
                w.window[i], w.strides[i]
            ));
        }
        dims.push((padded - w.window[i]) / w.strides[i] + 1);
    }
    Ok(TensorType::new(a.dtype, dims))
}

fn infer_conv(
    c: &ConvAttrs,
    x: &TensorType,
    k: &TensorType,
) -> std::result::Result<TensorType, String> {
    if x.dtype != k.dtype || !x.dtype.is_float() {
        return Err("input and kernel must share a float dtype".into());
    }
    let r = x.shape.rank();
    if r < 3 || k.shape.rank() != r {
        return Err(
            "input [N, C, *spatial] and kernel [O, C/groups, *k] of equal rank >= 3".into(),
        );
    }
    let n = r - 2;
    if c.strides.len() != n
        || c.padding.len() != n
        || c.lhs_dilation.len() != n
        || c.rhs_dilation.len() != n
    {
        return Err(format!("strides/padding/dilations need {n} entries"));
    }
    let (fg, bg) = (c.feature_groups, c.batch_groups);
    if fg == 0 || bg == 0 || (fg > 1 && bg > 1) {
        return Err("groups must be >= 1 and at most one of feature/batch groups > 1".into());
    }
    let (batch, cin, cout, kin) = (
        x.shape.dim(0),
        x.shape.dim(1),
        k.shape.dim(0),
        k.shape.dim(1),
    );
    if cin != kin * fg {
        return Err(format!(
            "input channels {cin} != kernel in-channels {kin} x feature groups {fg}"
        ));
    }
    if cout % fg != 0 || cout % bg != 0 || batch % bg != 0 {
        return Err(format!(
            "out channels {cout} / batch {batch} not divisible by groups ({fg}, {bg})"
        ));
    }
    let mut dims = vec![batch / bg, cout];
    for i in 0..n {
        let xi = x.shape.dim(i + 2);
        let ki = k.shape.dim(i + 2);
        let xd = if xi == 0 {
            0
        } else {
            (xi - 1) * c.lhs_dilation[i] + 1
        } as i64;
        let kd = if ki == 0 {
            0
        } else {
            (ki - 1) * c.rhs_dilation[i] + 1
        } as i64;
        let padded = xd + c.padding[i].0 + c.padding[i].1;
        if c.strides[i] == 0 || padded < kd {
            return Err(format!(
                "kernel extent {kd} larger than padded input {padded} in spatial dim {i}"
            ));
        }
        dims.push(((padded - kd) / c.strides[i] as i64 + 1) as usize);
    }
    Ok(TensorType::new(x.dtype, dims))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(d: DType, s: &[usize]) -> TensorType {
        TensorType::new(d, s)
    }

    /// `DotDims`' hand-written equality and `Op::same_as` agree with field-by-field equality:
    /// a difference in any list (empty or not) is seen.
    #[test]
    fn dot_dims_and_broadcasts_compare_field_by_field() {
        let base = DotDims {
            lhs_batch: vec![],
            rhs_batch: vec![],
            lhs_contract: vec![1],
            rhs_contract: vec![1],
        };
        assert_eq!(base, base.clone());
        let variants = [
            DotDims {
                lhs_batch: vec![0],
                ..base.clone()
            },
            DotDims {
                rhs_batch: vec![0],
                ..base.clone()
            },
            DotDims {
                lhs_contract: vec![0],
                ..base.clone()
            },
            DotDims {
                rhs_contract: vec![],
                ..base.clone()
            },
        ];
        for v in &variants {
            assert_ne!(&base, v);
            assert!(!Op::DotGeneral(base.clone()).same_as(&Op::DotGeneral(v.clone())));
        }
        let bcast = |shape: &[usize], dims: Vec<usize>| Op::Broadcast {
            shape: Shape::new(shape),
            dims,
        };
        assert!(bcast(&[2, 3], vec![]).same_as(&bcast(&[2, 3], vec![])));
        assert!(bcast(&[2, 3], vec![1]).same_as(&bcast(&[2, 3], vec![1])));
        assert!(!bcast(&[2, 3], vec![]).same_as(&bcast(&[2, 3], vec![1])));
        assert!(!bcast(&[2, 3], vec![0]).same_as(&bcast(&[2, 3], vec![1])));
        assert!(!bcast(&[2, 3], vec![]).same_as(&bcast(&[3, 2], vec![])));
        assert!(!bcast(&[2, 3], vec![]).same_as(&Op::Reshape(Shape::new(&[2, 3]))));
        assert!(Op::Reshape(Shape::new(&[6])).same_as(&Op::Reshape(Shape::new(&[6]))));
    }

    #[test]
    fn dot_general_matmul_type() {
        let d = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let r = Op::DotGeneral(d)
            .infer(&[&t(DType::F32, &[2, 3]), &t(DType::F32, &[3, 5])])
            .unwrap();
        assert_eq!(r, t(DType::F32, &[2, 5]));
    }

    #[test]
    fn shape_mismatch_names_op_and_shapes() {
        let d = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let e = Op::DotGeneral(d)
            .infer(&[&t(DType::F32, &[2, 3]), &t(DType::F32, &[4, 5])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("dot_general"), "{e}");
        assert!(e.contains("f32[2,3]") && e.contains("f32[4,5]"), "{e}");
    }

    #[test]
    fn conv_output_shape_matches_pytorch_formula() {
        // resnet stem: 7x7 stride 2 pad 3 on 64x64 -> 32x32
        let mut c = ConvAttrs::plain(2);
        c.strides = vec![2, 2];
        c.padding = vec![(3, 3), (3, 3)];
        let r = Op::Conv(c)
            .infer(&[
                &t(DType::F32, &[4, 3, 64, 64]),
                &t(DType::F32, &[64, 3, 7, 7]),
            ])
            .unwrap();
        assert_eq!(r, t(DType::F32, &[4, 64, 32, 32]));
    }

    #[test]
    fn repeated_dims_are_rejected() {
        // Found by tests/fuzz.rs: `dot_general` with lhs dim 0 both batch and contracting was
        // accepted (a wrong result type; libtorch failed on it), and so was `reverse` of a dim
        // twice (StableHLO rejects it).
        let d = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![0],
            rhs_contract: vec![1],
        };
        let e = Op::DotGeneral(d)
            .infer(&[&t(DType::F32, &[3, 3]), &t(DType::F32, &[3, 3])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("twice"), "{e}");
        let e = Op::Reverse(vec![1, 1])
            .infer(&[&t(DType::F32, &[2, 3])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("repeat"), "{e}");
        assert!(Op::Reverse(vec![1, 0])
            .infer(&[&t(DType::F32, &[2, 3])])
            .is_ok());
    }

    #[test]
    fn broadcast_rejects_incompatible_sizes() {
        let op = Op::Broadcast {
            shape: Shape::new(&[2, 3]),
            dims: vec![1],
        };
        assert!(op.infer(&[&t(DType::F32, &[3])]).is_ok());
        assert!(op.infer(&[&t(DType::F32, &[2])]).is_err());
    }

    #[test]
    fn window_and_slice_shapes() {
        let w = WindowAttrs {
            window: vec![3, 3],
            strides: vec![2, 2],
            padding: vec![(1, 1), (1, 1)],
        };
        let r = Op::ReduceWindow {
            kind: ReduceKind::Max,
            attrs: w,
        }
        .infer(&[&t(DType::F32, &[1, 2, 32, 32])])
        .unwrap();
        assert_eq!(r.shape.dims(), &[1, 2, 16, 16]);
        let s = Op::Slice {
            start: vec![1],
            limit: vec![10],
            stride: vec![3],
        }
        .infer(&[&t(DType::F32, &[10])])
        .unwrap();
        assert_eq!(s.shape.dims(), &[3]);
    }

    #[test]
    fn literal_bytes_must_match_the_type() {
        // Too few, too many, and not a whole number of elements.
        for n in [0, 7, 9, 10] {
            let e = Literal::from_bytes(t(DType::F32, &[2]), vec![0u8; n])
                .unwrap_err()
                .to_string();
            assert!(e.contains("f32[2]") && e.contains("8 bytes"), "{n}: {e}");
        }
        let lit = Literal::from_bytes(
            t(DType::I64, &[2]),
            [7i64, -3].map(i64::to_le_bytes).concat(),
        )
        .unwrap();
        assert_eq!((lit.get_f64(0), lit.get_f64(1)), (7.0, -3.0));
    }

    #[test]
    fn literal_rejects_a_size_that_overflows() {
        // numel × 4 wraps to 0 in usize: an empty byte string must not pass as that tensor.
        let huge = t(DType::F32, &[1 << 62, 8]);
        let e = Literal::from_bytes(huge, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("too large"), "{e}");
    }

    #[test]
    fn bool_literal_bytes_are_zero_or_one() {
        let e = Literal::from_bytes(t(DType::Bool, &[3]), vec![1, 0, 2])
            .unwrap_err()
            .to_string();
        assert!(e.contains("element 2") && e.contains("0 or 1"), "{e}");
        let ok = Literal::from_bytes(t(DType::Bool, &[3]), vec![1, 0, 1]).unwrap();
        assert_eq!(ok.get_f64(2), 1.0);
    }
}
