//! The column sum ([`COLUMN_SUM_TARGET`]): a float sum over an array's leading dims, the
//! shape of a training step's bias gradients (`Σ dy` over batch and sequence) and of a
//! `LayerNorm`'s weight gradients.
//!
//! XLA's CPU compiler rewrites such a sum into a `reduce-window` over 32-row windows and a
//! sum of the partial results (its tree-reduction pass, kept for training graphs: see the
//! `reductions` module); each half is a kernel of its own, and the windowed one reads its
//! rows with the operand's row stride, which is slow on 4 KiB rows. xla-cpu-pjrt 0.0.1 on a
//! 2-vCPU Zen 2, µs a call (one-op programs, best of 9 rounds), XLA / this kernel: `[4, 65,
//! 256]` 82 / 12, `[4, 65, 768]` 189 / 31, `[4, 65, 1024]` 1,037 / 39, `[64, 1024]` 31 / 13.
//! vit's training step has 34 such sums and bert's alike; alternating processes of 10
//! steps, ms, without / with the kernel: vit split 69.6–72.4 / 65.0–67.5, fused 71.6–74.7
//! / 65.3–68.5; bert split 76.5–77.2 / 69.2–74.5, fused 72.2–74.8 / 67.1–71.4 (eager 58–64
//! and 85–90). Compiling those graphs without the tree pass as well (their other
//! reductions are rows) was no better: vit split 64.5–64.6, fused 69.2–70.4.
//!
//! The kernel adds rows in blocks of 32 in the operand's type, and the blocks' sums in f64:
//! at least as accurate as XLA's tree of 32-element windows. It is plain Rust on the XLA
//! worker that calls it (no libtorch, no kernel lock, no hand-over).

use super::dot::Real;
use super::COLUMN_SUM_TARGET;
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::{Error, Result};
use crate::ir::{DType, Graph, NodeId, Op, ReduceKind};

/// The handler of [`COLUMN_SUM_TARGET`]: operand `[lead..., rest...]` (attribute `lead`: the
/// number of leading dims summed over), result `[rest...]`.
pub(crate) struct ColumnSumKernel;

impl FfiKernel for ColumnSumKernel {
    const TARGET: &'static str = COLUMN_SUM_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        call.expect_arity(1, 1)?;
        let lead = usize::try_from(call.attr_int("lead")?)
            .map_err(|_| Error::Invalid("negative lead".into()))?;
        let (x, y) = (call.arg(0)?, call.ret(0)?);
        if lead > x.dims.len() || y.dims != &x.dims[lead..] || y.dtype != x.dtype {
            return Err(Error::Invalid(format!(
                "summing the {lead} leading dims of {:?} does not give {:?}",
                x.dims, y.dims
            )));
        }
        let c = y.numel();
        match x.dtype {
            DType::F32 => column_sums(x.as_slice::<f32>()?, call.ret_slice_mut(0)?, c),
            _ => column_sums(x.as_slice::<f64>()?, call.ret_slice_mut(0)?, c),
        }
        Ok(())
    }
}

/// Rows summed in the operand's type before the partial sum joins the f64 total (also the
/// fewest rows the lowering hands to the kernel).
const BLOCK_ROWS: usize = 32;

/// `out[j] = Σ_i x[i][j]` for `x` of `[rows, c]` (row-major).
fn column_sums<T: Real>(x: &[T], out: &mut [T], c: usize) {
    if c == 0 {
        return;
    }
    let mut total = vec![0f64; c];
    let mut part = vec![T::default(); c];
    for block in x.chunks(BLOCK_ROWS * c) {
        part.fill(T::default());
        for row in block.chunks_exact(c) {
            for (p, &v) in part.iter_mut().zip(row) {
                *p = *p + v;
            }
        }
        for (t, &p) in total.iter_mut().zip(&part) {
            *t += p.into();
        }
    }
    for (o, &t) in out.iter_mut().zip(&total) {
        *o = T::from_f64(t);
    }
}

/// The number of leading dims reduce node `id` sums over, if it runs as the column sum: a
/// float sum over leading dims only (some dims kept) of at least [`BLOCK_ROWS`] rows.
pub(crate) fn column_sum_lead(g: &Graph, id: NodeId) -> Option<usize> {
    let n = g.node(id);
    let Op::Reduce {
        kind: ReduceKind::Sum,
        axes,
    } = &n.op
    else {
        return None;
    };
    let x = &g.node(*n.operands.first()?).ty;
    // (An empty result lowers as an empty constant.)
    if !matches!(x.dtype, DType::F32 | DType::F64) || axes.is_empty() || n.ty.shape.numel() == 0 {
        return None;
    }
    let lead = axes.len();
    if axes.iter().enumerate().any(|(i, &a)| a != i) || lead >= x.shape.rank() {
        return None;
    }
    let rows: usize = x.shape.dims()[..lead].iter().product();
    (rows >= BLOCK_ROWS).then_some(lead)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{InputKind, TensorType};

    #[test]
    fn sums_columns_over_blocks_and_a_partial_block() {
        let (rows, c) = (70, 5);
        let x: Vec<f32> = (0..rows * c)
            .map(|v| ((v * 37 % 101) as f32) * 0.25 - 12.0)
            .collect();
        let mut out = vec![0f32; c];
        column_sums(&x, &mut out, c);
        for (j, &o) in out.iter().enumerate() {
            let want: f64 = (0..rows).map(|i| x[i * c + j] as f64).sum();
            assert!(
                (o as f64 - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{j}: {o} vs {want}"
            );
        }
        // f64: exact here (small integers).
        let x: Vec<f64> = (0..rows * c).map(|v| v as f64).collect();
        let mut out = vec![0f64; c];
        column_sums(&x, &mut out, c);
        let want: Vec<f64> = (0..c)
            .map(|j| (0..rows).map(|i| x[i * c + j]).sum())
            .collect();
        assert_eq!(out, want);
    }

    #[test]
    fn only_float_sums_over_enough_leading_rows_run_as_the_kernel() {
        let mut g = Graph::new();
        let f = |d: &[usize]| TensorType::new(DType::F32, d.to_vec());
        let x = g.add_input(InputKind::Data, "x", f(&[4, 65, 256]));
        let sum = |g: &mut Graph, x, kind, axes: &[usize]| {
            g.add(
                Op::Reduce {
                    kind,
                    axes: axes.to_vec(),
                },
                &[x],
            )
            .unwrap()
        };
        let bias_grad = sum(&mut g, x, ReduceKind::Sum, &[0, 1]);
        assert_eq!(column_sum_lead(&g, bias_grad), Some(2));
        // Rows, all dims, a middle dim, a max, and too few rows stay with XLA.
        for (kind, axes) in [
            (ReduceKind::Sum, &[2][..]),
            (ReduceKind::Sum, &[0, 1, 2][..]),
            (ReduceKind::Sum, &[1][..]),
            (ReduceKind::Max, &[0, 1][..]),
            (ReduceKind::Sum, &[0][..]),
        ] {
            let r = sum(&mut g, x, kind, axes);
            assert_eq!(column_sum_lead(&g, r), None, "{kind:?} over {axes:?}");
        }
        let i = g.add_input(
            InputKind::Data,
            "i",
            TensorType::new(DType::I32, vec![64, 8]),
        );
        let r = sum(&mut g, i, ReduceKind::Sum, &[0]);
        assert_eq!(column_sum_lead(&g, r), None, "integer sum");
        let e = g.add_input(InputKind::Data, "e", f(&[64, 0]));
        let r = sum(&mut g, e, ReduceKind::Sum, &[0]);
        assert_eq!(column_sum_lead(&g, r), None, "empty result");
    }
}
