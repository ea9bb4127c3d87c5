//! Element types.

use std::fmt;

/// The element type of a tensor.
///
/// `U32` exists for the counter-based random number generator (threefry), whose integer
/// arithmetic must wrap at 32 bits identically in every backend.
///
/// `BF16` and `F16` are the 16-bit float formats of mixed-precision training: `BF16` keeps
/// `F32`'s 8-bit exponent with an 8-bit significand (machine epsilon 2^-8 ≈ 3.9e-3), `F16` has a
/// 5-bit exponent (largest finite value 65504) and an 11-bit significand (epsilon 2^-11 ≈
/// 4.9e-4). On the host their values are [`half::bf16`] and [`half::f16`]. They come last so
/// that the older variants keep their order (and their fingerprints).
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
    /// bfloat16: 1 sign, 8 exponent and 7 stored significand bits.
    BF16,
    /// IEEE 754 half precision: 1 sign, 5 exponent and 10 stored significand bits.
    F16,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 8] = [
        DType::Bool,
        DType::U32,
        DType::I32,
        DType::I64,
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
    ];

    /// The floating-point dtypes, narrowest significand first.
    pub const FLOATS: [DType; 4] = [DType::BF16, DType::F16, DType::F32, DType::F64];

    /// Bytes per element in host memory (`Bool` is one byte).
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool => 1,
            DType::BF16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Floating point?
    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32 | DType::F64)
    }

    /// A 16-bit float (`BF16` or `F16`)?
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// For a float dtype, the machine epsilon: the distance from 1 to the next larger value
    /// (2^-7 for `BF16`, 2^-10 for `F16`, 2^-23 for `F32`, 2^-52 for `F64`); the unit roundoff
    /// (the largest relative error of one correctly rounded operation) is half of it. `None`
    /// for other dtypes.
    pub fn epsilon(self) -> Option<f64> {
        match self {
            DType::BF16 => Some(2f64.powi(-7)),
            DType::F16 => Some(2f64.powi(-10)),
            DType::F32 => Some(f32::EPSILON as f64),
            DType::F64 => Some(f64::EPSILON),
            _ => None,
        }
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
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
