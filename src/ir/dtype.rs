//! Element types.

use std::fmt;

/// The element type of a tensor.
///
/// `U32` exists for the counter-based random number generator (threefry), whose integer
/// arithmetic must wrap at 32 bits identically in every backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean (predicate).
    Bool,
    /// Unsigned 32-bit integer.
    U32,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 6] = [
        DType::Bool,
        DType::U32,
        DType::I32,
        DType::I64,
        DType::F32,
        DType::F64,
    ];

    /// Bytes per element in host memory (`Bool` is one byte).
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool => 1,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Floating point?
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    /// Integer (signed or unsigned)?
    pub fn is_int(self) -> bool {
        matches!(self, DType::U32 | DType::I32 | DType::I64)
    }

    /// Short lowercase name, as printed in types (`f32`, `i64`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U32 => "u32",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
