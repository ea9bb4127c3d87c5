//! Max pooling's gradient ([`SELECT_SCATTER_TARGET`]): `Op::SelectAndScatter` on a float
//! `[N, C, *spatial]` operand (1 to 3 spatial dims), with the IR's selection rule: in each
//! window padding is never selected, a NaN beats any number, then the larger value wins, and
//! ties go to the first element in row-major order; each source element is added at its
//! window's selected position, and a window of pure padding drops its element.
//!
//! Why: XLA's `select_and_scatter` leaves the scan order of a window to the implementation,
//! so the lowering spells the rule out as a variadic `reduce_window` over (value, index)
//! pairs and a scatter-add at the winners (`Emitter::select_and_scatter`), which XLA's CPU
//! compiler runs as scalar loops. resnet18's stem pool (3×3, stride 2, padding 1, on `[4, 64,
//! 32, 32]`) with its gradient and an SGD update as one fused step: 2.55–2.76 ms with this
//! kernel against 3.40–3.61 ms with XLA's lowering (eager 1.67–1.71; one process, the two
//! alternating, 2-vCPU Zen 4). Whole training steps the same way (16 rounds of 3 steps,
//! medians, ms, kernel / XLA's): resnet18 fused 64.8 / 68.1, split 57.8 / 61.7;
//! squeezenet1_1 fused 15.1 / 17.3, split 11.7 / 12.9.
//!
//! Plain Rust on the XLA worker that calls it (no libtorch, no kernel lock, no hand-over);
//! the sums at a position shared by overlapping windows are added in the windows' row-major
//! order.

use super::mlir::i64_array;
use super::SELECT_SCATTER_TARGET;
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::{Error, Result};
use crate::ir::{DType, Graph, NodeId, Op, WindowAttrs};

/// The handler of [`SELECT_SCATTER_TARGET`]: operands `x` (`[N, C, *spatial]`) and `source`
/// (the pooled shape), result shaped like `x`. Attributes (one entry per spatial dim):
/// `window`, `strides`, and `padding` as flattened `(low, high)` pairs.
pub(crate) struct SelectScatterKernel;

impl FfiKernel for SelectScatterKernel {
    const TARGET: &'static str = SELECT_SCATTER_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        call.expect_arity(2, 1)?;
        let (x, s, y) = (call.arg(0)?, call.arg(1)?, call.ret(0)?);
        let w = Windows::new(
            x.dims,
            s.dims,
            call.attr_ints("window")?,
            call.attr_ints("strides")?,
            call.attr_ints("padding")?,
        )?;
        if y.dims != x.dims || s.dtype != x.dtype || y.dtype != x.dtype {
            return Err(Error::Invalid(format!(
                "select-and-scatter of {} {:?} with source {} {:?} into {} {:?}",
                x.dtype, x.dims, s.dtype, s.dims, y.dtype, y.dims
            )));
        }
        match x.dtype {
            DType::F32 => w.scatter(x.as_slice::<f32>()?, s.as_slice()?, call.ret_slice_mut(0)?),
            DType::F64 => w.scatter(x.as_slice::<f64>()?, s.as_slice()?, call.ret_slice_mut(0)?),
            d => Err(Error::Invalid(format!(
                "select-and-scatter of {d}: f32 and f64 only"
            ))),
        }
    }
}

/// Is select-and-scatter node `id` one the kernel runs (a float operand with 1 to 3 spatial
/// dims, nothing empty)?
pub(crate) fn runs_select_scatter(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    let Op::SelectAndScatter(w) = &n.op else {
        return false;
    };
    let (x, s) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    matches!(x.dtype, DType::F32 | DType::F64)
        && (1..=MAX_SPATIAL).contains(&w.window.len())
        && x.shape.numel() > 0
        && s.shape.numel() > 0
}

/// The kernel's attributes (inside `backend_config = {...}`) for window attributes `w`.
pub(crate) fn select_scatter_config(w: &WindowAttrs) -> String {
    let list = |v: &[usize]| i64_array(v.iter().map(|&d| d as i64));
    let padding = i64_array(
        w.padding
            .iter()
            .flat_map(|&(lo, hi)| [lo as i64, hi as i64]),
    );
    format!(
        "padding = {padding}, strides = {}, window = {}",
        list(&w.strides),
        list(&w.window)
    )
}

/// Spatial dims the kernel handles (1-, 2- and 3-d pooling).
const MAX_SPATIAL: usize = 3;

/// The geometry of one call, spatial dims left-padded to three with size-1 dims (window 1,
/// stride 1, no padding).
#[derive(Debug)]
struct Windows {
    /// `N · C`.
    planes: usize,
    input: [usize; 3],
    output: [usize; 3],
    window: [usize; 3],
    strides: [usize; 3],
    pad_low: [usize; 3],
}

impl Windows {
    /// Checks the operand dims `x`, source dims `s` and the attributes against each other.
    fn new(x: &[i64], s: &[i64], window: &[i64], strides: &[i64], padding: &[i64]) -> Result<Self> {
        let bad = |m: &str| {
            Error::Invalid(format!(
                "select-and-scatter of {x:?} with source {s:?}, window {window:?}, strides \
                 {strides:?}, padding {padding:?}: {m}"
            ))
        };
        let k = window.len();
        if !(1..=MAX_SPATIAL).contains(&k) || x.len() != k + 2 || s.len() != k + 2 {
            return Err(bad("needs [N, C, *spatial] with 1 to 3 spatial dims"));
        }
        if strides.len() != k || padding.len() != 2 * k {
            return Err(bad(
                "one window, stride and (low, high) padding per spatial dim",
            ));
        }
        let u = |v: i64| usize::try_from(v).map_err(|_| bad("negative size"));
        if s[..2] != x[..2] {
            return Err(bad("the source's [N, C] differ"));
        }
        let mut w = Windows {
            planes: u(x[0])? * u(x[1])?,
            input: [1; 3],
            output: [1; 3],
            window: [1; 3],
            strides: [1; 3],
            pad_low: [0; 3],
        };
        for i in 0..k {
            let j = MAX_SPATIAL - k + i;
            let (n, win, st) = (u(x[2 + i])?, u(window[i])?, u(strides[i])?);
            let (lo, hi) = (u(padding[2 * i])?, u(padding[2 * i + 1])?);
            let padded = n + lo + hi;
            if win == 0 || st == 0 || padded < win {
                return Err(bad("a window does not fit its padded dim"));
            }
            if u(s[2 + i])? != (padded - win) / st + 1 {
                return Err(bad("the source is not the pooled shape"));
            }
            (
                w.input[j],
                w.output[j],
                w.window[j],
                w.strides[j],
                w.pad_low[j],
            ) = (n, u(s[2 + i])?, win, st, lo);
        }
        Ok(w)
    }

    /// The input positions `[from, to)` along dim `d` of output position `o`'s window.
    fn span(&self, d: usize, o: usize) -> (usize, usize) {
        let (start, n) = (o * self.strides[d], self.input[d]);
        let from = start.saturating_sub(self.pad_low[d]).min(n);
        let to = (start + self.window[d])
            .saturating_sub(self.pad_low[d])
            .min(n);
        (from, to.max(from))
    }

    /// `out = 0`, then each `source` element added at its window's selected element of `x`.
    fn scatter<T: Copy + PartialOrd + std::ops::Add<Output = T> + Default>(
        &self,
        x: &[T],
        source: &[T],
        out: &mut [T],
    ) -> Result<()> {
        let plane_in: usize = self.input.iter().product();
        let plane_out: usize = self.output.iter().product();
        if x.len() != self.planes * plane_in
            || out.len() != x.len()
            || source.len() != self.planes * plane_out
        {
            return Err(Error::Invalid(format!(
                "select-and-scatter buffers of {} / {} / {} elements for {self:?}",
                x.len(),
                source.len(),
                out.len()
            )));
        }
        out.fill(T::default());
        if plane_in == 0 || plane_out == 0 {
            return Ok(());
        }
        let [_, h, w] = self.input;
        let spans: [Vec<(usize, usize)>; 3] =
            std::array::from_fn(|d| (0..self.output[d]).map(|o| self.span(d, o)).collect());
        for ((xp, sp), op) in x
            .chunks_exact(plane_in)
            .zip(source.chunks_exact(plane_out))
            .zip(out.chunks_exact_mut(plane_in))
        {
            // A plane without NaNs (checked in one vectorised pass) takes the plain maximum.
            #[allow(clippy::eq_op)] // NaN test for any float type
            let nan = xp.iter().any(|&v| v != v);
            let mut src = sp.iter();
            for &(d0, d1) in &spans[0] {
                for &(h0, h1) in &spans[1] {
                    for &(w0, w1) in &spans[2] {
                        let Some(&v) = src.next() else {
                            return Ok(());
                        };
                        let (dd, hh, ww) = ((d0, d1), (h0, h1), (w0, w1));
                        let chosen = if nan {
                            select_nan_first(xp, dd, hh, ww, h, w)
                        } else {
                            select_max(xp, dd, hh, ww, h, w)
                        };
                        if let Some(i) = chosen {
                            op[i] = op[i] + v;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// The index (in the plane) of the window's first maximum (a window without NaNs); `None` for
/// an empty window (pure padding).
fn select_max<T: Copy + PartialOrd>(
    xp: &[T],
    (d0, d1): (usize, usize),
    (h0, h1): (usize, usize),
    (w0, w1): (usize, usize),
    h: usize,
    w: usize,
) -> Option<usize> {
    if d0 == d1 || h0 == h1 || w0 == w1 {
        return None;
    }
    let first = (d0 * h + h0) * w + w0;
    let (mut best, mut top) = (first, xp[first]);
    for d in d0..d1 {
        for r in h0..h1 {
            let row = (d * h + r) * w;
            for (i, &v) in xp[row + w0..row + w1].iter().enumerate() {
                if v > top {
                    (best, top) = (row + w0 + i, v);
                }
            }
        }
    }
    Some(best)
}

/// The index (in the plane) of the window's selected element: the first NaN if there is one,
/// else the first maximum; `None` for an empty window (pure padding).
fn select_nan_first<T: Copy + PartialOrd>(
    xp: &[T],
    dd: (usize, usize),
    hh: (usize, usize),
    (w0, w1): (usize, usize),
    h: usize,
    w: usize,
) -> Option<usize> {
    for d in dd.0..dd.1 {
        for r in hh.0..hh.1 {
            let row = (d * h + r) * w;
            #[allow(clippy::eq_op)] // NaN test for any float type
            if let Some(i) = xp[row + w0..row + w1].iter().position(|&v| v != v) {
                return Some(row + w0 + i);
            }
        }
    }
    select_max(xp, dd, hh, (w0, w1), h, w)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rule spelled out another way: every window element ranked by (NaN, value, -index),
    /// on a 2-d plane with padding.
    fn reference(
        x: &[f64],
        src: &[f64],
        [h, w]: [usize; 2],
        win: [usize; 2],
        st: [usize; 2],
        pad: [usize; 2],
        [oh, ow]: [usize; 2],
    ) -> Vec<f64> {
        let mut out = vec![0.0; h * w];
        for a in 0..oh {
            for b in 0..ow {
                let mut cands = Vec::new();
                for i in 0..win[0] {
                    for j in 0..win[1] {
                        let (r, c) = (
                            (a * st[0] + i) as i64 - pad[0] as i64,
                            (b * st[1] + j) as i64 - pad[1] as i64,
                        );
                        if r >= 0 && c >= 0 && (r as usize) < h && (c as usize) < w {
                            cands.push(r as usize * w + c as usize);
                        }
                    }
                }
                let key = |&i: &usize| (x[i].is_nan(), if x[i].is_nan() { 0.0 } else { x[i] });
                let win_idx = cands.iter().copied().reduce(|best, i| {
                    let (kb, ki) = (key(&best), key(&i));
                    if ki.0 && !kb.0 || (ki.0 == kb.0 && !ki.0 && ki.1 > kb.1) {
                        i
                    } else {
                        best
                    }
                });
                if let Some(i) = win_idx {
                    out[i] += src[a * ow + b];
                }
            }
        }
        out
    }

    #[test]
    fn matches_the_rule_with_ties_nans_and_padding() {
        // 5x6 plane, values with many ties (a ReLU'd grid) and two NaNs.
        let (h, w) = (5, 6);
        let mut x: Vec<f64> = (0..h * w)
            .map(|i| ((i * 7 % 5) as f64 - 2.0).max(0.0))
            .collect();
        x[8] = f64::NAN;
        x[9] = f64::NAN;
        for (win, st, pad) in [
            ([3, 3], [2, 2], [1, 1]),
            ([2, 2], [2, 2], [0, 0]),
            ([3, 2], [1, 3], [2, 1]),
        ] {
            let oh = (h + 2 * pad[0] - win[0]) / st[0] + 1;
            let ow = (w + 2 * pad[1] - win[1]) / st[1] + 1;
            let src: Vec<f64> = (0..oh * ow).map(|i| 1.0 + i as f64 * 0.5).collect();
            let g = Windows::new(
                &[1, 1, h as i64, w as i64],
                &[1, 1, oh as i64, ow as i64],
                &[win[0] as i64, win[1] as i64],
                &[st[0] as i64, st[1] as i64],
                &[pad[0] as i64, pad[0] as i64, pad[1] as i64, pad[1] as i64],
            )
            .unwrap();
            let mut out = vec![f64::NAN; h * w];
            g.scatter(&x, &src, &mut out).unwrap();
            let want = reference(&x, &src, [h, w], win, st, pad, [oh, ow]);
            assert_eq!(out, want, "window {win:?} stride {st:?} padding {pad:?}");
        }
    }

    #[test]
    fn windows_of_padding_drop_their_source_and_planes_stay_apart() {
        // 1-d, two planes: [N=1, C=2, 3], window 2, stride 2, padding (2, 1): windows
        // [-2, -1] (padding only), [0, 1], [2, 3).
        let g = Windows::new(&[1, 2, 3], &[1, 2, 3], &[2], &[2], &[2, 1]).unwrap();
        let x = [1.0f32, 3.0, 2.0, 5.0, 5.0, -1.0];
        let src = [10.0f32, 20.0, 30.0, 40.0, 50.0, 60.0];
        let mut out = [0.0f32; 6];
        g.scatter(&x, &src, &mut out).unwrap();
        assert_eq!(out, [0.0, 20.0, 30.0, 50.0, 0.0, 60.0]);
    }

    #[test]
    fn mismatched_geometry_is_an_error() {
        let e = |x: &[i64], s: &[i64], win: &[i64], st: &[i64], pad: &[i64]| {
            Windows::new(x, s, win, st, pad).unwrap_err().to_string()
        };
        assert!(e(&[1, 1, 4, 4], &[1, 1, 2, 3], &[2, 2], &[2, 2], &[0; 4]).contains("pooled"));
        assert!(e(&[1, 1, 4, 4], &[1, 2, 2, 2], &[2, 2], &[2, 2], &[0; 4]).contains("[N, C]"));
        assert!(e(&[1, 1, 4], &[1, 1, 2], &[2, 2], &[2, 2], &[0; 4]).contains("spatial"));
        assert!(e(&[1, 1, 4], &[1, 1, 2], &[2], &[2], &[0]).contains("padding"));
        assert!(e(&[1, 1, 1], &[1, 1, 1], &[3], &[1], &[0, 0]).contains("fit"));
        let g = Windows::new(&[1, 1, 4], &[1, 1, 2], &[2], &[2], &[0, 0]).unwrap();
        let mut out = [0.0f32; 3];
        assert!(g.scatter(&[0.0f32; 4], &[0.0; 2], &mut out).is_err());
    }
}
