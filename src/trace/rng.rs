//! Random numbers inside graphs: threefry2x32 built from `u32` graph ops.
//!
//! A trace that draws random numbers gets one `u32[2]` [`crate::ir::InputKind::RngKey`] input.
//! Each draw site in the trace uses its own counter block, and the runtime passes a new key on
//! every call. Because the generator is ordinary integer ops, the eager interpreter and XLA
//! produce the same bits for the same key (the dropout-seed mismatch of
//! torch_xla's trace-once bridge, pytorch#90097, cannot happen).

use super::{apply, context::is_tracing, with_ctx, Repr, Tensor};
use crate::error::{Error, Result};
use crate::ir::{DType, Op, TensorType};

const ROTATIONS: [u32; 8] = [13, 15, 26, 6, 17, 29, 16, 24];

fn u32c(v: u32) -> Result<Tensor> {
    Tensor::scalar(v as f64, DType::U32)
}

fn rotl(x: &Tensor, r: u32) -> Result<Tensor> {
    x.shift_left(&u32c(r)?)?
        .or(&x.shift_right_logical(&u32c(32 - r)?)?)
}

impl Tensor {
    /// The threefry2x32 block cipher (20 rounds, Random123 / JAX): encrypts the counter pair
    /// `(c0, c1)` (same-shaped `u32` tensors) under `key` (`u32[2]`), returning two `u32`
    /// tensors of random bits.
    pub fn threefry2x32(key: &Tensor, c0: &Tensor, c1: &Tensor) -> Result<(Tensor, Tensor)> {
        if key.ty != TensorType::new(DType::U32, [2]) || c0.dtype() != DType::U32 || c0.ty != c1.ty
        {
            return Err(Error::type_error(
                "threefry2x32",
                "expects key u32[2] and two counters of one u32 type",
                &[&key.ty, &c0.ty, &c1.ty],
            ));
        }
        let k0 = key.slice(0, 0, 1, 1)?.reshape(&[])?;
        let k1 = key.slice(0, 1, 2, 1)?.reshape(&[])?;
        let k2 = k0.xor(&k1)?.xor(&u32c(0x1BD1_1BDA)?)?;
        let ks = [k0, k1, k2];
        let mut x0 = c0.add(&ks[0])?;
        let mut x1 = c1.add(&ks[1])?;
        for i in 0..5usize {
            for r in 0..4 {
                x0 = x0.add(&x1)?;
                x1 = rotl(&x1, ROTATIONS[(i % 2) * 4 + r])?;
                x1 = x1.xor(&x0)?;
            }
            x0 = x0.add(&ks[(i + 1) % 3])?;
            x1 = x1.add(&ks[(i + 2) % 3])?.add(&u32c(i as u32 + 1)?)?;
        }
        Ok((x0, x1))
    }

    /// Random `u32` bits of `shape` from `key`, using counter block `site` (distinct sites give
    /// independent streams under one key).
    pub fn random_bits(key: &Tensor, site: u32, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let idx = apply(
            Op::Iota {
                ty: TensorType::new(DType::U32, [n]),
                dim: 0,
            },
            &[],
        )?;
        let hi = u32c(site)?.broadcast_to(&[n])?;
        let (bits, _) = Tensor::threefry2x32(key, &hi, &idx)?;
        let dims: Vec<isize> = shape.iter().map(|&d| d as isize).collect();
        bits.reshape(&dims)
    }

    /// Uniform `[0, 1)` floats of `dtype` from 24 random bits per element.
    pub fn uniform_from_bits(bits: &Tensor, dtype: DType) -> Result<Tensor> {
        bits.shift_right_logical(&u32c(8)?)?
            .to_dtype(dtype)?
            .mul_scalar(1.0 / (1u32 << 24) as f64)
    }

    /// Dropout: in training, zeroes each element with probability `p` and scales the rest by
    /// `1 / (1 - p)`; otherwise the identity.
    ///
    /// Eagerly this is libtorch's dropout. In a trace the mask comes from threefry on the
    /// trace's rng key, so every backend draws the same mask for the same key.
    pub fn dropout(&self, p: f64, train: bool) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            return Err(Error::Invalid(format!(
                "dropout probability {p} not in [0, 1)"
            )));
        }
        if !train || p == 0.0 {
            return Ok(self.clone());
        }
        if !is_tracing() {
            if let Repr::Eager { t, .. } = &self.repr {
                return Ok(Tensor::from_tch_typed(t.f_dropout(p, true)?, self.dtype()));
            }
        }
        let (key, site) = with_ctx(|ctx| {
            let k = ctx.rng_key();
            let site = ctx.rng_draws;
            ctx.rng_draws += 1;
            Ok((ctx.tensor(k), site))
        })?;
        let bits = Tensor::random_bits(&key, site, self.dims())?;
        let u = Tensor::uniform_from_bits(&bits, self.dtype())?;
        let keep = u.ge(&self.scalar_like(p)?)?;
        let scaled = self.mul_scalar(1.0 / (1.0 - p))?;
        keep.select(&scaled, &self.scalar_like(0.0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u32s(v: &[u32]) -> Tensor {
        Tensor::from_slice(&[v.len()], v).unwrap()
    }

    #[test]
    fn threefry_known_answers() {
        // Random123 known-answer vectors (counter, key -> output), as JAX's tests use them.
        let cases: [([u32; 2], [u32; 2], [u32; 2]); 3] = [
            ([0, 0], [0, 0], [0x6b20_0159, 0x99ba_4efe]),
            (
                [0xffff_ffff, 0xffff_ffff],
                [0xffff_ffff, 0xffff_ffff],
                [0x1cb9_96fc, 0xbb00_2be7],
            ),
            (
                [0x243f_6a88, 0x85a3_08d3],
                [0x1319_8a2e, 0x0370_7344],
                [0xc492_3a9c, 0x483d_f7a0],
            ),
        ];
        for (ctr, key, want) in cases {
            let (a, b) =
                Tensor::threefry2x32(&u32s(&key), &u32s(&[ctr[0]]), &u32s(&[ctr[1]])).unwrap();
            let got = [
                a.to_host().unwrap().to_vec::<u32>().unwrap()[0],
                b.to_host().unwrap().to_vec::<u32>().unwrap()[0],
            ];
            assert_eq!(got, want, "counter {ctr:x?} key {key:x?}");
        }
    }
}
