//! The dot kernel ([`DOT_TARGET`](super::DOT_TARGET)): `Op::DotGeneral` as one `mm`/`bmm`
//! into XLA's result buffer.

use super::onednn;
use super::SERIAL_ATTR;
use super::{torch_lock, DOT_TARGET};
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::backend::xla::pjrt::handoff;
use crate::error::{Error, Result};
use crate::ir::{DType, DotDims};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::rc::Rc;
use tch::Tensor;

/// The dot kernel ([`DOT_TARGET`]).
pub(crate) struct DotKernel;

impl FfiKernel for DotKernel {
    const TARGET: &'static str = DOT_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        call.expect_arity(2, 1)?;
        let dims = call.attr_ints("dims")?;
        let (ab, bb, ob) = (call.arg(0)?, call.arg(1)?, call.ret(0)?);
        let plan = cached_plan(dims, ab.dims, bb.dims)?;
        if plan.out_dims != ob.dims {
            let d = dot_dims_of(dims)?;
            return Err(Error::Invalid(format!(
                "dot of {:?} by {:?} with {d:?} gives {:?}, the result buffer is {:?}",
                ab.dims, bb.dims, plan.out_dims, ob.dims
            )));
        }
        if let Some(tiny) = plan.tiny() {
            return match ab.dtype {
                DType::F32 => tiny.run(
                    ab.as_slice::<f32>()?,
                    bb.as_slice()?,
                    call.ret_slice_mut(0)?,
                ),
                _ => tiny.run(
                    ab.as_slice::<f64>()?,
                    bb.as_slice()?,
                    call.ret_slice_mut(0)?,
                ),
            };
        }
        handoff::run_kernel(call.flag(SERIAL_ATTR), plan.flops(), || {
            let _guard = torch_lock();
            let (a, b, out) = (ab.tensor()?, bb.tensor()?, ob.tensor()?);
            plan.run_into(&a, &b, &out)
        })
    }
}

/// At most this many rows on the left for [`DotPlan::run_into`] to multiply a transposed
/// right operand as `(B · Aᵀ)ᵀ`.
const SWAP_MAX_ROWS: i64 = 64;

/// At most this many plans are kept per thread by [`cached_plan`] (then it starts over).
const PLAN_CACHE_SIZE: usize = 256;

thread_local! {
    /// The plans of the products this (XLA worker) thread ran, keyed by the `dims` attribute
    /// and the operand dims, `-1`-separated: planning allocates a dozen small vectors, which
    /// costs more than a tiny product itself.
    static PLANS: RefCell<Vec<(Vec<i64>, Rc<DotPlan>)>> = const { RefCell::new(Vec::new()) };
}

/// The plan of a product (`dims` as in the kernel's attribute), from this thread's cache.
fn cached_plan(dims: &[i64], a: &[i64], b: &[i64]) -> Result<Rc<DotPlan>> {
    // Built once and compared as slices (comparing chained iterators element by element was
    // 1.3 % of the LinearModel's call).
    let key: SmallVec<[i64; 32]> = dims
        .iter()
        .chain([&-1])
        .chain(a)
        .chain([&-1])
        .chain(b)
        .copied()
        .collect();
    PLANS.with_borrow_mut(|plans| {
        if let Some((_, p)) = plans.iter().find(|(k, _)| k[..] == key[..]) {
            return Ok(p.clone());
        }
        let plan = Rc::new(DotPlan::new(&dot_dims_of(dims)?, a, b)?);
        if plans.len() >= PLAN_CACHE_SIZE {
            plans.clear();
        }
        plans.push((key.into_vec(), plan.clone()));
        Ok(plan)
    })
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
    /// Element strides of `a` along its batch, free and contracting groups, and of `b` along
    /// its batch, contracting and free groups, where each group is one strided run in memory.
    strides: Option<([usize; 3], [usize; 3])>,
    /// The result dims: batch, lhs free, rhs free.
    pub out_dims: Vec<i64>,
}

/// At most this many floating-point operations (multiply-adds × 2) for [`DotPlan::tiny`]: a
/// product this small runs as a plain loop in the kernel, without libtorch.
///
/// Measured (`examples/zz_linprof`, torchbench's LinearModel, AMD EPYC Zen 4, xla-cpu-pjrt
/// 0.0.1): XLA's own dot of `[2, 10]·[10, 10]ᵀ` costs ~1.5 µs a call (Eigen's contraction
/// through oneDNN, which allocates a workspace each call), libtorch's `mm` through the kernel
/// ~10 µs (tensor views and dispatch), this loop well under 1 µs.
pub const TINY_DOT_MAX_FLOPS: f64 = 32768.0;

/// A product small enough for the kernel's own loop ([`DotPlan::tiny`]).
#[derive(Clone, Copy, Debug)]
pub struct TinyDot {
    bmkn: [usize; 4],
    sa: [usize; 3],
    sb: [usize; 3],
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
        let group_a = [&d.lhs_batch[..], &a_free, &d.lhs_contract];
        let group_b = [&d.rhs_batch[..], &d.rhs_contract, &b_free];
        let strides = group_strides(a, group_a).zip(group_strides(b, group_b));
        Ok(DotPlan {
            perm_a,
            perm_b,
            bmk: [bsz, m, k],
            kn: n,
            strides,
            out_dims,
        })
    }

    /// The product as the kernel's own loop, when it has at most [`TINY_DOT_MAX_FLOPS`] and
    /// each operand's groups are strided runs (no copy needed).
    pub fn tiny(&self) -> Option<TinyDot> {
        let [bs, m, k] = self.bmk.map(|v| v as usize);
        let n = self.kn as usize;
        let (sa, sb) = self.strides?;
        (self.flops() <= TINY_DOT_MAX_FLOPS).then_some(TinyDot {
            bmkn: [bs, m, k, n],
            sa,
            sb,
        })
    }

    /// Multiply-adds × 2.
    pub fn flops(&self) -> f64 {
        let [bs, m, k] = self.bmk.map(|v| v as f64);
        2.0 * bs * m * k * self.kn as f64
    }

    /// Multiplies `a` by `b` into `out` (contiguous, dims [`DotPlan::out_dims`]).
    pub fn run_into(&self, a: &Tensor, b: &Tensor, out: &Tensor) -> Result<()> {
        let [bs, m, k] = self.bmk;
        let n = self.kn;
        let a = a.f_permute(&self.perm_a)?.f_reshape([bs, m, k])?;
        let b = b.f_permute(&self.perm_b)?.f_reshape([bs, k, n])?;
        let o = out.f_view([bs, m, n])?;
        if bs == 1 {
            let mut o2 = o.f_select(0, 0)?;
            let (a2, b2) = (a.f_select(0, 0)?, b.f_select(0, 0)?);
            let linear_layout = k > 1 && n > 1 && b2.stride() == [1, k];
            if a2.kind() == tch::Kind::Float && m > 0 && linear_layout {
                // f32 with `b2` a torch `Linear` weight `[n, k]` read transposed (so `bᵀ` is
                // contiguous: no copy; other layouts, not measured, keep MKL's `mm` below):
                // oneDNN's product `a · (bᵀ)ᵀ`. 2-vCPU Zen 5, µs, MKL's
                // `(W · aᵀ)ᵀ` (below) / oneDNN: `[4, 25088]·[4096, 25088]ᵀ` 27,709 / 12,916,
                // `[4, 4096]·[4096, 4096]ᵀ` 4,533 / 2,295, `[64, 4096]·[4096, 4096]ᵀ` 13,549 /
                // 6,376, `[4, 512]·[1000, 512]ᵀ` 55 / 48.
                let bt = b2.f_tr()?.f_contiguous()?;
                let y = onednn::linear_pointwise(
                    &a2.f_contiguous()?,
                    &bt,
                    None,
                    None,
                    onednn::Activation::None,
                )?;
                o2.f_copy_(&y)?;
            } else if m <= SWAP_MAX_ROWS && linear_layout {
                // (f64) `b2` is a torch `Linear` weight `[n, k]` read transposed: MKL computes
                // `(W · aᵀ)ᵀ` 1.2–1.9× faster than `a · Wᵀ` for few rows (vgg16's
                // `[4, 25088]·[4096, 25088]ᵀ` 35 ms vs 60–69 ms, `[16, 4096]·[4096, 4096]ᵀ` 7.5
                // vs 9.4 ms, `[64, 4096]·[4096, 4096]ᵀ` 16.0 vs 18.4 ms on the Zen 4).
                let t = b2.f_tr()?.f_mm(&a2.f_tr()?)?;
                o2.f_copy_(&t.f_tr()?)?;
            } else {
                let _ = a2.f_mm_out(&o2, &b2)?;
            }
        } else {
            let _ = a.f_bmm_out(&o, &b)?;
        }
        Ok(())
    }
}

/// The element stride of each group of dims (listed in the order they flatten) of a
/// row-major array of `dims`, if every group is a single strided run (stride 0 for a group of
/// size 1).
fn group_strides(dims: &[i64], groups: [&[usize]; 3]) -> Option<[usize; 3]> {
    let mut row_major = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        row_major[i] = row_major[i + 1] * dims[i + 1] as usize;
    }
    let mut out = [0usize; 3];
    for (g, group) in groups.iter().enumerate() {
        // The dims of size > 1: each must step exactly over the next one's run.
        let live: Vec<usize> = group.iter().copied().filter(|&i| dims[i] > 1).collect();
        for w in live.windows(2) {
            if row_major[w[0]] != row_major[w[1]] * dims[w[1]] as usize {
                return None;
            }
        }
        out[g] = live.last().map_or(0, |&i| row_major[i]);
    }
    Some(out)
}

/// The scalar arithmetic of [`TinyDot::run`] and of the column sum (`colsum.rs`), which
/// keeps its totals in f64.
pub(crate) trait Real:
    Copy + Default + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + Into<f64>
{
    /// The nearest value of this type.
    fn from_f64(v: f64) -> Self;
}
impl Real for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
}
impl Real for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
}

impl TinyDot {
    /// Multiplies into `out` (`[B, M, N]`, row-major).
    pub(crate) fn run<T: Real>(&self, a: &[T], b: &[T], out: &mut [T]) -> Result<()> {
        let [bs, m, k, n] = self.bmkn;
        let (sa, sb) = (self.sa, self.sb);
        let reach = |s: [usize; 3], d: [usize; 3]| -> usize {
            s.iter()
                .zip(d)
                .map(|(s, d)| s * d.saturating_sub(1))
                .sum::<usize>()
                + 1
        };
        let empty = bs * m * n == 0;
        if out.len() != bs * m * n
            || (!empty
                && k > 0
                && (reach(sa, [bs, m, k]) > a.len() || reach(sb, [bs, k, n]) > b.len()))
        {
            return Err(Error::Invalid(format!(
                "tiny dot {:?}: buffers of {}, {} and {} elements do not fit",
                self,
                a.len(),
                b.len(),
                out.len()
            )));
        }
        let mut o = 0;
        for bi in 0..bs {
            for i in 0..m {
                let a0 = bi * sa[0] + i * sa[1];
                for j in 0..n {
                    let b0 = bi * sb[0] + j * sb[2];
                    out[o] = dot(a, a0, sa[2], b, b0, sb[1], k);
                    o += 1;
                }
            }
        }
        Ok(())
    }
}

/// `Σ_p a[a0 + p·sa] · b[b0 + p·sb]` over `p < k`. Contiguous runs use eight independent
/// accumulators, which the compiler turns into vector lanes.
#[inline]
fn dot<T: Real>(a: &[T], a0: usize, sa: usize, b: &[T], b0: usize, sb: usize, k: usize) -> T {
    if k == 0 {
        return T::default();
    }
    if sa == 1 && sb == 1 {
        let (a, b) = (&a[a0..a0 + k], &b[b0..b0 + k]);
        let mut acc = [T::default(); 8];
        let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
        let (ar, br) = (ac.remainder(), bc.remainder());
        for (x, y) in ac.zip(bc) {
            for l in 0..8 {
                acc[l] = acc[l] + x[l] * y[l];
            }
        }
        let mut tail = T::default();
        for (x, y) in ar.iter().zip(br) {
            tail = tail + *x * *y;
        }
        let pairs = [
            acc[0] + acc[4],
            acc[1] + acc[5],
            acc[2] + acc[6],
            acc[3] + acc[7],
        ];
        (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]) + tail
    } else {
        let mut acc = T::default();
        for p in 0..k {
            acc = acc + a[a0 + p * sa] * b[b0 + p * sb];
        }
        acc
    }
}
