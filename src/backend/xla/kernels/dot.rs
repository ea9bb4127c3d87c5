//! The dot kernel ([`DOT_TARGET`](super::DOT_TARGET)): `Op::DotGeneral` as one `mm`/`bmm`
//! into XLA's result buffer.

use super::{torch_lock, DOT_TARGET};
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::{Error, Result};
use crate::ir::DotDims;
use tch::Tensor;

/// The dot kernel ([`DOT_TARGET`]).
pub(crate) struct DotKernel;

impl FfiKernel for DotKernel {
    const TARGET: &'static str = DOT_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        call.expect_arity(2, 1)?;
        let dims = call.attr_ints("dims")?;
        let d = dot_dims_of(dims)?;
        let (ab, bb, ob) = (call.arg(0)?, call.arg(1)?, call.ret(0)?);
        let plan = DotPlan::new(&d, ab.dims, bb.dims)?;
        if plan.out_dims != ob.dims {
            return Err(Error::Invalid(format!(
                "dot of {:?} by {:?} with {d:?} gives {:?}, the result buffer is {:?}",
                ab.dims, bb.dims, plan.out_dims, ob.dims
            )));
        }
        let _guard = torch_lock();
        let (a, b, out) = (ab.tensor()?, bb.tensor()?, ob.tensor()?);
        plan.run_into(&a, &b, &out)
    }
}

pub(crate) fn dot_dims_of(dims: &[i64]) -> Result<DotDims> {
    let bad = || Error::Invalid(format!("attribute dims: malformed {dims:?}"));
    if dims.len() < 2 || dims.iter().any(|&v| v < 0) {
        return Err(bad());
    }
    let (nb, nc) = (dims[0] as usize, dims[1] as usize);
    if dims.len() != 2 + 2 * nb + 2 * nc {
        return Err(bad());
    }
    let v: Vec<usize> = dims[2..].iter().map(|&x| x as usize).collect();
    Ok(DotDims {
        lhs_batch: v[..nb].to_vec(),
        rhs_batch: v[nb..2 * nb].to_vec(),
        lhs_contract: v[2 * nb..2 * nb + nc].to_vec(),
        rhs_contract: v[2 * nb + nc..].to_vec(),
    })
}

/// How one `DotGeneral` maps onto `bmm`: permutations of both operands to `[batch, free,
/// contract]` / `[batch, contract, free]` and the flattened sizes.
pub struct DotPlan {
    perm_a: Vec<i64>,
    perm_b: Vec<i64>,
    bmk: [i64; 3],
    kn: i64,
    /// The result dims: batch, lhs free, rhs free.
    pub out_dims: Vec<i64>,
}

impl DotPlan {
    /// Checks `d` against the operand dims and plans the product.
    pub fn new(d: &DotDims, a: &[i64], b: &[i64]) -> Result<DotPlan> {
        let bad = |m: &str| Error::Invalid(format!("dot of {a:?} by {b:?} with {d:?}: {m}"));
        if d.lhs_batch.len() != d.rhs_batch.len() || d.lhs_contract.len() != d.rhs_contract.len() {
            return Err(bad("unpaired dimensions"));
        }
        let check = |dims: &[usize], r: usize| {
            let mut seen = vec![false; r];
            for &x in dims {
                if x >= r || seen[x] {
                    return false;
                }
                seen[x] = true;
            }
            true
        };
        let la: Vec<usize> = d.lhs_batch.iter().chain(&d.lhs_contract).copied().collect();
        let lb: Vec<usize> = d.rhs_batch.iter().chain(&d.rhs_contract).copied().collect();
        if !check(&la, a.len()) || !check(&lb, b.len()) {
            return Err(bad("dimension out of range or repeated"));
        }
        for (x, y) in d
            .lhs_batch
            .iter()
            .zip(&d.rhs_batch)
            .chain(d.lhs_contract.iter().zip(&d.rhs_contract))
        {
            if a[*x] != b[*y] {
                return Err(bad("paired dimensions differ in size"));
            }
        }
        let a_free: Vec<usize> = (0..a.len()).filter(|i| !la.contains(i)).collect();
        let b_free: Vec<usize> = (0..b.len()).filter(|i| !lb.contains(i)).collect();
        let prod = |dims: &[i64], idx: &[usize]| idx.iter().map(|&i| dims[i]).product::<i64>();
        let bsz = prod(a, &d.lhs_batch);
        let m = prod(a, &a_free);
        let k = prod(a, &d.lhs_contract);
        let n = prod(b, &b_free);
        let to64 = |v: Vec<usize>| v.into_iter().map(|x| x as i64).collect::<Vec<_>>();
        let perm_a = to64(
            d.lhs_batch
                .iter()
                .chain(&a_free)
                .chain(&d.lhs_contract)
                .copied()
                .collect(),
        );
        let perm_b = to64(
            d.rhs_batch
                .iter()
                .chain(&d.rhs_contract)
                .chain(&b_free)
                .copied()
                .collect(),
        );
        let mut out_dims: Vec<i64> = d.lhs_batch.iter().map(|&i| a[i]).collect();
        out_dims.extend(a_free.iter().map(|&i| a[i]));
        out_dims.extend(b_free.iter().map(|&i| b[i]));
        Ok(DotPlan {
            perm_a,
            perm_b,
            bmk: [bsz, m, k],
            kn: n,
            out_dims,
        })
    }

    /// Multiplies `a` by `b` into `out` (contiguous, dims [`DotPlan::out_dims`]).
    pub fn run_into(&self, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        let [bs, m, k] = self.bmk;
        let n = self.kn;
        let a = a.f_permute(&self.perm_a)?.f_reshape([bs, m, k])?;
        let b = b.f_permute(&self.perm_b)?.f_reshape([bs, k, n])?;
        let o = out.f_view([bs, m, n])?;
        if bs == 1 {
            let o2 = o.f_select(0, 0)?;
            let _ = a.f_select(0, 0)?.f_mm_out(&o2, &b.f_select(0, 0)?)?;
        } else {
            let _ = a.f_bmm_out(&o, &b)?;
        }
        Ok(())
    }
}
