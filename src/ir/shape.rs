//! Shapes and tensor types.

use super::DType;
use smallvec::SmallVec;
use std::fmt;

/// A static tensor shape (dimension sizes, outermost first). Rank 0 is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(SmallVec<[usize; 6]>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: &[usize]) -> Self {
        Shape(SmallVec::from_slice(dims))
    }

    /// The scalar shape `[]`.
    pub fn scalar() -> Self {
        Shape(SmallVec::new())
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Size of dimension `i` (panics on a bad index: callers check ranks first).
    pub fn dim(&self, i: usize) -> usize {
        self.0[i]
    }

    /// The dimensions as `i64`, as C APIs and tch want them.
    pub fn to_i64(&self) -> Vec<i64> {
        self.0.iter().map(|&d| d as i64).collect()
    }
}

impl From<&[usize]> for Shape {
    fn from(d: &[usize]) -> Self {
        Shape::new(d)
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(d: [usize; N]) -> Self {
        Shape::new(&d)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(d: Vec<usize>) -> Self {
        Shape(SmallVec::from_vec(d))
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

/// The static type of a graph value: element type and shape.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Shape,
}

impl TensorType {
    /// A tensor type.
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    /// A scalar of `dtype`.
    pub fn scalar(dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: Shape::scalar(),
        }
    }

    /// Size of the data in bytes.
    pub fn size_in_bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size_in_bytes()
    }

    /// Size of the data in bytes, or `None` if it overflows `usize` (a shape no buffer can
    /// hold; [`TensorType::size_in_bytes`] would wrap).
    pub fn checked_size_in_bytes(&self) -> Option<usize> {
        self.shape
            .dims()
            .iter()
            .try_fold(self.dtype.size_in_bytes(), |n, &d| n.checked_mul(d))
    }

    /// The same shape with another element type.
    pub fn with_dtype(&self, dtype: DType) -> Self {
        TensorType {
            dtype,
            shape: self.shape.clone(),
        }
    }
}

impl fmt::Debug for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
