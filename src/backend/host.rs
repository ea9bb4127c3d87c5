//! Host tensors: typed bytes in host memory, the currency between backends and the caller.

use crate::error::{Error, Result};
use crate::ir::{DType, TensorType};

/// A dense row-major tensor in host memory (little-endian bytes).
#[derive(Clone, PartialEq)]
pub struct HostTensor {
    ty: TensorType,
    data: Vec<u8>,
}

/// Rust element types that map to a [`DType`].
pub trait Element: Copy + 'static {
    /// The matching dtype.
    const DTYPE: DType;
    /// Appends the little-endian bytes of `self`.
    fn put(self, out: &mut Vec<u8>);
    /// Reads one element from little-endian bytes.
    fn get(b: &[u8]) -> Self;
}

macro_rules! element {
    ($t:ty, $d:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn put(self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(b: &[u8]) -> Self {
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_le_bytes(a)
            }
        }
    };
}
element!(f32, DType::F32);
element!(f64, DType::F64);
element!(i32, DType::I32);
element!(i64, DType::I64);
element!(u32, DType::U32);
element!(half::bf16, DType::BF16);
element!(half::f16, DType::F16);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn put(self, out: &mut Vec<u8>) {
        out.push(self as u8);
    }
    fn get(b: &[u8]) -> Self {
        b[0] != 0
    }
}

impl HostTensor {
    /// A tensor from raw little-endian, row-major bytes: exactly `numel × dtype size` of them
    /// (a type whose size overflows `usize` is rejected), and for `Bool` each 0 or 1.
    pub fn from_bytes(ty: TensorType, data: Vec<u8>) -> Result<Self> {
        let Some(need) = ty.checked_size_in_bytes() else {
            return Err(Error::Invalid(format!(
                "host tensor {ty}: too large (its size in bytes overflows usize)"
            )));
        };
        if data.len() != need {
            return Err(Error::Invalid(format!(
                "host tensor {ty} needs {need} bytes, got {}",
                data.len()
            )));
        }
        if ty.dtype == DType::Bool {
            if let Some((i, b)) = data.iter().enumerate().find(|(_, &b)| b > 1) {
                return Err(Error::Invalid(format!(
                    "host tensor {ty}: element {i} is the byte {b}, a bool must be 0 or 1"
                )));
            }
        }
        Ok(HostTensor { ty, data })
    }

    /// A tensor from elements and a shape.
    pub fn from_slice<T: Element>(shape: &[usize], values: &[T]) -> Result<Self> {
        let ty = TensorType::new(T::DTYPE, shape);
        if values.len() != ty.shape.numel() {
            return Err(Error::Invalid(format!(
                "{} values for shape {}",
                values.len(),
                ty.shape
            )));
        }
        let mut data = Vec::with_capacity(ty.size_in_bytes());
        for &v in values {
            v.put(&mut data);
        }
        Ok(HostTensor { ty, data })
    }

    /// The elements, if `T` matches the dtype.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.ty.dtype {
            return Err(Error::Invalid(format!(
                "host tensor is {}, asked for {}",
                self.ty.dtype,
                T::DTYPE
            )));
        }
        let s = self.ty.dtype.size_in_bytes();
        Ok(self.data.chunks_exact(s).map(T::get).collect())
    }

    /// The elements converted to `f64` (any dtype).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let s = self.ty.dtype.size_in_bytes();
        self.data
            .chunks_exact(s)
            .map(|b| match self.ty.dtype {
                DType::Bool => (b[0] != 0) as u8 as f64,
                DType::U32 => u32::get(b) as f64,
                DType::I32 => i32::get(b) as f64,
                DType::I64 => i64::get(b) as f64,
                DType::F32 => f32::get(b) as f64,
                DType::F64 => f64::get(b),
                DType::BF16 => half::bf16::get(b).to_f64(),
                DType::F16 => half::f16::get(b).to_f64(),
            })
            .collect()
    }

    /// The type.
    pub fn ty(&self) -> &TensorType {
        &self.ty
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    /// Consumes the tensor, returning its bytes.
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// Converts to a tch tensor on the CPU. `U32` becomes `Int64` holding the same values
    /// (libtorch's unsigned 32-bit support is partial), see [`crate::backend::eager`].
    pub fn to_tch(&self) -> Result<tch::Tensor> {
        let dims = self.ty.shape.to_i64();
        let t = match self.ty.dtype {
            DType::U32 => {
                let v: Vec<i64> = self.to_vec::<u32>()?.into_iter().map(i64::from).collect();
                tch::Tensor::f_from_slice(&v)?.f_reshape(&dims)?
            }
            d => {
                tch::Tensor::f_from_data_size(&self.data, &dims, crate::backend::eager::kind_of(d))?
            }
        };
        Ok(t)
    }

    /// The transpose of a rank-2 tensor (`[d1, d0]`, row-major).
    pub fn transposed_2d(&self) -> Result<HostTensor> {
        let [d0, d1] = self.ty.shape.dims()[..] else {
            return Err(Error::Invalid(format!(
                "transposed_2d of {}: not rank 2",
                self.ty
            )));
        };
        let e = self.ty.dtype.size_in_bytes();
        let mut data = vec![0u8; self.data.len()];
        for i in 0..d0 {
            for j in 0..d1 {
                let (src, dst) = ((i * d1 + j) * e, (j * d0 + i) * e);
                data[dst..dst + e].copy_from_slice(&self.data[src..src + e]);
            }
        }
        HostTensor::from_bytes(TensorType::new(self.ty.dtype, [d1, d0]), data)
    }

    /// Converts a tch tensor holding values of `dtype` (for `U32`: an `Int64` tensor) to a host
    /// tensor. The tensor is moved to the CPU and made contiguous first.
    pub fn from_tch(t: &tch::Tensor, dtype: DType) -> Result<Self> {
        let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
        let ty = TensorType::new(dtype, shape);
        let want = crate::backend::eager::kind_of(dtype);
        // Most tensors are already CPU, of the wanted kind and contiguous: skip the three
        // dispatched no-op conversions (about a µs of a tiny model's call).
        let converted;
        let t = if t.device() == tch::Device::Cpu && t.kind() == want && t.is_contiguous() {
            t
        } else {
            converted = t
                .f_to_device(tch::Device::Cpu)?
                .f_to_kind(want)?
                .f_contiguous()?;
            &converted
        };
        let numel = ty.shape.numel();
        match dtype {
            DType::U32 => {
                let mut v = vec![0i64; numel];
                t.f_copy_data(&mut v, numel)?;
                let mut data = Vec::with_capacity(numel * 4);
                for x in v {
                    (x as u32).put(&mut data);
                }
                Ok(HostTensor { ty, data })
            }
            _ => {
                let mut data = vec![0u8; ty.size_in_bytes()];
                t.f_copy_data_u8(&mut data, numel)?;
                Ok(HostTensor { ty, data })
            }
        }
    }
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = self.to_f64_vec();
        let shown: Vec<String> = v.iter().take(8).map(|x| format!("{x:.4}")).collect();
        write!(
            f,
            "HostTensor({}, [{}{}])",
            self.ty,
            shown.join(", "),
            if v.len() > 8 { ", ..." } else { "" }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposed_2d_transposes_rank_2_only() {
        let h = HostTensor::from_slice(&[2, 3], &[1.0f64, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let t = h.transposed_2d().unwrap();
        assert_eq!(t.ty().shape.dims(), &[3, 2]);
        assert_eq!(
            t.to_vec::<f64>().unwrap(),
            vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
        );
        assert_eq!(t.transposed_2d().unwrap(), h);
        let v = HostTensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
        assert!(v.transposed_2d().is_err());
    }

    /// Contiguous tensors of the wanted kind are read as they are; transposed, other-kind and
    /// `U32` (stored as `Int64`) ones are converted first: both give the values in row-major
    /// order.
    #[test]
    fn from_tch_reads_contiguous_and_converted_tensors() {
        let t = tch::Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, -6.5]).reshape([2, 3]);
        let h = HostTensor::from_tch(&t, DType::F32).unwrap();
        assert_eq!(
            h.to_vec::<f32>().unwrap(),
            vec![1.5, -2.0, 3.25, 4.0, 5.0, -6.5]
        );
        let tt = t.tr();
        assert!(!tt.is_contiguous());
        let h = HostTensor::from_tch(&tt, DType::F32).unwrap();
        assert_eq!(h.ty().shape.dims(), &[3, 2]);
        assert_eq!(
            h.to_vec::<f32>().unwrap(),
            vec![1.5, 4.0, -2.0, 5.0, 3.25, -6.5]
        );
        let h = HostTensor::from_tch(&t, DType::F64).unwrap();
        assert_eq!(
            h.to_vec::<f64>().unwrap(),
            vec![1.5, -2.0, 3.25, 4.0, 5.0, -6.5]
        );
        let u = tch::Tensor::from_slice(&[7i64, 4_000_000_000]);
        let h = HostTensor::from_tch(&u, DType::U32).unwrap();
        assert_eq!(h.to_vec::<u32>().unwrap(), vec![7, 4_000_000_000]);
    }

    #[test]
    fn from_bytes_rejects_malformed_data() {
        let f = TensorType::new(DType::F32, [3]);
        assert!(HostTensor::from_bytes(f.clone(), vec![0; 11]).is_err());
        assert!(HostTensor::from_bytes(f, vec![0; 12]).is_ok());
        let huge = TensorType::new(DType::I64, [1 << 61, 1 << 3]);
        let e = HostTensor::from_bytes(huge, Vec::new()).unwrap_err();
        assert!(e.to_string().contains("too large"), "{e}");
        let b = TensorType::new(DType::Bool, [2]);
        let e = HostTensor::from_bytes(b.clone(), vec![0, 255]).unwrap_err();
        assert!(e.to_string().contains("element 1"), "{e}");
        assert_eq!(
            HostTensor::from_bytes(b, vec![0, 1])
                .unwrap()
                .to_vec::<bool>()
                .unwrap(),
            [false, true]
        );
    }
}
