//! kiln's own grouped convolution: a 2-d [`CONV_TARGET`](super::CONV_TARGET) call with
//! feature groups of a few channels each (depthwise ones included: one input channel per
//! group), without kernel dilation, in each of the forms kiln's autograd gives it, computed
//! in Rust on the XLA worker that calls the kernel instead of by libtorch: the forward
//! convolution ([`ConvForm::Plain`]), its input gradient ([`ConvForm::ForwardWeight`], the
//! forward weight read reversed, input-dilated by the stride) and its weight gradient
//! ([`ConvForm::WeightGradient`] and its transposed form).
//!
//! Why: a libtorch call has a large fixed cost on a grouped convolution (dispatch, oneDNN's
//! primitive and its layout reorders, a loop over the groups for the weight gradient), and
//! inside an executable each call also pays for running libtorch on XLA's worker; that
//! dominates the small ones of a training step. mobilenet_v2's training step runs 51
//! depthwise kernels (forward, input and weight gradients), which took 13–15 ms of its
//! ~52 ms in libtorch. 2-vCPU AMD EPYC (Zen 2), batch 4 at 64×64, `TrainStep` in a loop of
//! 20 steps, medians, ms, libtorch / these loops: mobilenet_v2 split 52.6 / 37.6 (8.4 ms a
//! step in kernel calls, 16.4 before); in the harness (`--training --all --mode once`, eager
//! at 2 threads) 0.89× / 0.94× → 1.15× / 1.20× of eager (split / fused), mnasnet1_0 (5×5
//! windows too) 0.99× / 1.02× → 1.36× / 1.35×. Alone, one thread each, µs a call, these
//! loops / libtorch (forward, input gradient, weight gradient): 32 channels on 32×32 93 /
//! 181, 104 / 220, 133 / 187; 144 on 16×16 117 / 187, 132 / 245, 177 / 191; 192 on 8×8 58 /
//! 122, 64 / 162, 84 / 127; 384 on 4×4 72 / 103, 77 / 137, 90 / 110; 960 on 2×2 55 / 120, 76
//! / 145, 82 / 687; stride 2, 96 on 32×32 219 / 216, 264 / 351, 252 / 221; 5×5, 240 on 8×8
//! 200 / 153, 213 / 227, 332 / 2,286. resnext50_32x4d's groups of 4 and 8 channels (see
//! [`Grouped::pays`] for which groups run here): its training step in a loop, split, 203–219
//! → 188–203 ms (three alternating runs).
//!
//! How: a chunk of groups of every image (sized to stay in L2) is copied once into a
//! zero-padded layout split into *phases* (the padded plane by row and column modulo the
//! stride, so that each tap of a strided window reads a contiguous run), one channel's
//! images after another (rows by vector copies; planes of short rows element by element
//! through a precomputed map, as a copy's fixed cost would dominate). Then each pass is a
//! few long contiguous loops over the whole chunk (compiled for AVX2 + FMA where the CPU has
//! them): the forward pass sums the taps' shifted runs of the group's input channels in
//! registers, computing "wide" rows (the phase's width; the columns past the output's are
//! discarded): a matrix product whose right operand (the im2col matrix) is never built, one
//! run per input channel and tap; the input gradient is the same correlation of the
//! cotangent's wide layout with each phase's taps, read backwards; and the weight gradient
//! is a dot product of the cotangent with each channel's and tap's run (in f32 lanes, added
//! up in f64). Nothing here calls libtorch: the kernel runs right on the XLA worker that
//! calls it, without the kernel lock.

use super::dot::Real;
use super::ConvForm;
use crate::ir::ConvAttrs;
use multiversion::multiversion;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static OWN: OnceLock<AtomicBool> = OnceLock::new();

fn own() -> &'static AtomicBool {
    OWN.get_or_init(|| {
        let torch = std::env::var("KILN_GROUPED_CONV").is_ok_and(|v| v == "libtorch");
        AtomicBool::new(!torch)
    })
}

/// Whether grouped convolutions of a few channels per group (depthwise ones included) run
/// as kiln's own loops (the default) rather than as libtorch's; for comparisons (also
/// `KILN_GROUPED_CONV=libtorch` in the environment). Takes effect at the next kernel call,
/// in executables compiled before too.
pub fn set_own_grouped_conv(on: bool) {
    own().store(on, Ordering::Relaxed);
}

/// See [`set_own_grouped_conv`].
pub fn own_grouped_conv() -> bool {
    own().load(Ordering::Relaxed)
}

/// The most input channels per group, times the window's taps, that these loops take
/// (resnext50_32x4d's widest groups: 32 channels, 3×3).
const MAX_GROUP_TAPS: usize = 32 * 9;
/// The most output channels per group these loops take.
const MAX_GROUP_OUTPUTS: usize = 32;

/// The most output channels per group of a convolution on which these loops beat
/// libtorch's (see [`Grouped::pays`]).
const FEW_OUTPUTS: usize = 8;
/// The most positions of the wide rows per output position of a convolution on which these
/// loops beat libtorch's (see [`Grouped::pays`]).
const MAX_WIDE: f64 = 1.6;
/// The most output positions per image of a convolution whose weight gradient runs here
/// over those positions alone where the wide rows do not pay (see [`Grouped::pays`]).
const MAX_COMPACT_OUTPUTS: usize = 4;

/// Which pass of a grouped convolution a call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// `y = x ⋆ k`: operands `x` `[n, g·ci, h, w]` and `k` `[g·co, ci, kh, kw]`, result `y`
    /// `[n, g·co, oh, ow]`.
    Forward,
    /// `dx`: operands the cotangent `dy` `[n, g·co, oh, ow]` and the forward weight `k`,
    /// result `[n, g·ci, h, w]`.
    InputGradient,
    /// `dk`: operands the forward input `x` and the cotangent `dy`, result `[ci, g·co, kh,
    /// kw]`, or the weight's `[g·co, ci, kh, kw]` when `transposed` (the same array for a
    /// depthwise convolution).
    WeightGradient {
        /// The result in the weight's layout.
        transposed: bool,
    },
}

/// The geometry of a 2-d grouped convolution, forward: `g` groups, input `[n, g·ci, h, w]`,
/// kernel `[g·co, ci, kh, kw]`, output `[n, g·co, oh, ow]`; output `o` of group `G` is
/// `y[n][G·co + o][i][j] = Σ_c Σ_(a,b) k[G·co + o][c][a][b] · x[n][G·ci + c][i·s₀ + a −
/// p₀][j·s₁ + b − p₁]` over the taps that fall inside the input.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Grouped {
    n: usize,
    /// Feature groups.
    groups: usize,
    /// Input channels per group.
    ci: usize,
    /// Output channels per group.
    co: usize,
    h: usize,
    w: usize,
    kh: usize,
    kw: usize,
    oh: usize,
    ow: usize,
    stride: [usize; 2],
    /// Low padding (negative: the first rows or columns are never read).
    pad: [i64; 2],
}

impl Grouped {
    /// The grouped convolution and pass that a [`CONV_TARGET`](super::CONV_TARGET) call of
    /// operand dims `x`, `k`, result dims `out` and form `form` computes, if this module runs
    /// it: 2-d, at least two feature groups of at most [`MAX_GROUP_OUTPUTS`] output channels
    /// and [`MAX_GROUP_TAPS`] input channels × taps each, no batch groups, no kernel
    /// dilation, and (but for the input gradient's, which is the forward stride) no input
    /// dilation. The kernel checks the result dims against the convolution's before.
    pub(crate) fn of(
        c: &ConvAttrs,
        x: &[i64],
        k: &[i64],
        out: &[i64],
        form: ConvForm,
    ) -> Option<(Grouped, Pass)> {
        // (Empty arrays and windows stay with libtorch.)
        let u = |v: i64| usize::try_from(v).ok().filter(|&v| v > 0);
        if x.len() != 4 || k.len() != 4 || out.len() != 4 || c.strides.len() != 2 {
            return None;
        }
        let ones = |v: &[usize]| v.iter().all(|&d| d == 1);
        let groups = c.feature_groups;
        if groups < 2 || c.batch_groups != 1 {
            return None;
        }
        // Channels per group, from the whole input's `cin` and output's `cout`.
        let per_group = |cin: i64, cout: i64| {
            let (cin, cout) = (u(cin)?, u(cout)?);
            (cin % groups == 0 && cout % groups == 0).then(|| (cin / groups, cout / groups))
        };
        let geometry =
            |n, [h, w]: [i64; 2], [kh, kw]: [i64; 2], [oh, ow]: [i64; 2], stride, pad| {
                Some((
                    u(n)?,
                    [u(h)?, u(w)?],
                    [u(kh)?, u(kw)?],
                    [u(oh)?, u(ow)?],
                    stride,
                    pad,
                ))
            };
        let ((ci, co), (n, [h, w], [kh, kw], [oh, ow], stride, pad), pass) = match form {
            ConvForm::Plain => {
                let ok = k[1] * groups as i64 == x[1] && x[0] == out[0] && k[0] == out[1];
                if !ok || !ones(&c.lhs_dilation) || !ones(&c.rhs_dilation) {
                    return None;
                }
                let g = geometry(
                    x[0],
                    [x[2], x[3]],
                    [k[2], k[3]],
                    [out[2], out[3]],
                    [c.strides[0], c.strides[1]],
                    [c.padding[0].0, c.padding[1].0],
                )?;
                (per_group(x[1], k[0])?, g, Pass::Forward)
            }
            ConvForm::ForwardWeight => {
                // The transposed convolution of `dy` by the forward weight: window stride 1,
                // input dilation = the forward stride, low padding `kh − 1 − p`.
                let ok = k[0] == x[1] && k[1] * groups as i64 == out[1] && x[0] == out[0];
                if !ok || !ones(&c.strides) || !ones(&c.rhs_dilation) {
                    return None;
                }
                let g = geometry(
                    x[0],
                    [out[2], out[3]],
                    [k[2], k[3]],
                    [x[2], x[3]],
                    [c.lhs_dilation[0], c.lhs_dilation[1]],
                    [k[2] - 1 - c.padding[0].0, k[3] - 1 - c.padding[1].0],
                )?;
                (per_group(out[1], x[1])?, g, Pass::InputGradient)
            }
            ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
                // Operands `x` and `dy`; window strides = the forward kernel dilation (1),
                // kernel dilation = the forward stride.
                let transposed = form == ConvForm::WeightGradientTransposed;
                let (ci, co) = per_group(x[1], k[1])?;
                // `[ci, g·co, ..]`, or the weight's `[g·co, ci, ..]`.
                let (cin, cout) = (ci as i64, k[1]);
                let want = if transposed { [cout, cin] } else { [cin, cout] };
                if k[0] != x[0] || out[..2] != want || !ones(&c.strides) || !ones(&c.lhs_dilation) {
                    return None;
                }
                let g = geometry(
                    x[0],
                    [x[2], x[3]],
                    [out[2], out[3]],
                    [k[2], k[3]],
                    [c.rhs_dilation[0], c.rhs_dilation[1]],
                    [c.padding[0].0, c.padding[1].0],
                )?;
                ((ci, co), g, Pass::WeightGradient { transposed })
            }
        };
        if ci * kh * kw > MAX_GROUP_TAPS || co > MAX_GROUP_OUTPUTS {
            return None;
        }
        let d = Grouped {
            n,
            groups,
            ci,
            co,
            h,
            w,
            kh,
            kw,
            oh,
            ow,
            stride,
            pad,
        };
        Some((d, pass))
    }

    /// Whether these loops beat libtorch's on this pass of this convolution: always on
    /// depthwise ones (one input and one output channel per group, see the module docs); on
    /// groups of several channels where a group has at most [`FEW_OUTPUTS`] outputs and the
    /// wide rows compute at most [`MAX_WIDE`] times the output positions (the product's work
    /// grows with both; libtorch's fixed costs do not), and for the weight gradient also
    /// where an image has at most [`MAX_COMPACT_OUTPUTS`] output positions (computed over
    /// those alone, see [`Compact`]; libtorch's grouped weight gradient is slowest there).
    /// Measured per call alone, one thread, 2-vCPU Zen 2, batch 4, 3×3, µs, these loops /
    /// libtorch (forward, input gradient, weight gradient): resnext50_32x4d's 128 channels
    /// in 32 groups on 16×16 302 / 994, 315 / 1,786, 260 / 2,085; 256 on 8×8 362 / 438, 379 /
    /// 335, 341 / 229 (in the training graph libtorch's take 662, 629, 285); but 512 on 4×4
    /// 608 / 319, 675 / 240, 703 / 269 and 1,024 on 2×2 1,052 / 349, 1,301 / 311, 1,638 /
    /// 1,555. The weight gradient over the output positions alone: 1,024 on 2×2 359 (1,692
    /// in the graph), 1,024 on 4×4 with stride 2 419 / 546 (649 in the graph); but 512 on
    /// 4×4 440 / 269 and on 8×8 with stride 2 541 / 317.
    pub(crate) fn pays(&self, pass: Pass) -> bool {
        let weight_gradient = matches!(pass, Pass::WeightGradient { .. });
        self.wide_pays() || (weight_gradient && self.oh * self.ow <= MAX_COMPACT_OUTPUTS)
    }

    /// Whether the wide rows' products beat libtorch's on every pass (see [`Grouped::pays`]).
    fn wide_pays(&self) -> bool {
        let (hq, wq) = Layout::phase_plane(self);
        let wide = (hq * wq) as f64;
        let depthwise = self.ci == 1 && self.co == 1;
        depthwise || (self.co <= FEW_OUTPUTS && wide <= MAX_WIDE * (self.oh * self.ow) as f64)
    }

    /// Computes `pass` of operands `a`, `b` into `out` (dense row-major, of the dims
    /// [`Grouped::of`] was given).
    pub(crate) fn run<T: Real>(&self, pass: Pass, a: &[T], b: &[T], out: &mut [T]) {
        self.run_as(pass, a, b, out, !self.wide_pays());
    }

    /// [`Grouped::run`], the weight gradient over the output positions alone ([`Compact`])
    /// or not.
    fn run_as<T: Real>(&self, pass: Pass, a: &[T], b: &[T], out: &mut [T], compact: bool) {
        let planes = Layout::new(self);
        match pass {
            Pass::Forward => forward(self, &planes, a, b, out),
            Pass::InputGradient => input_gradient(self, &planes, a, b, out),
            Pass::WeightGradient { transposed } => {
                weight_gradient(self, &planes, a, b, out, transposed, compact)
            }
        }
    }
}

/// Lanes of the inner loops (one AVX register of f32).
const LANES: usize = 8;
/// Results of a depthwise channel computed together (four registers).
const BLOCK: usize = 4 * LANES;
/// Results of a row of a group's matrix product computed together (two registers, for
/// four rows at a time).
const ROW_BLOCK: usize = 2 * LANES;
/// Positions of a group's matrix product computed before the next rows: its runs of all the
/// group's channels and taps stay in L2.
const TILE: usize = 512;
/// About how many elements the phases of a chunk of groups hold (within L2).
const CHUNK_ELEMENTS: usize = 1 << 14;

/// The layout of a chunk of groups of every image, zero-padded and split into phases, and
/// where each tap reads in it.
struct Layout {
    /// Columns of a phase row.
    wq: usize,
    /// Elements of one image's part of a phase (`hq · wq`).
    img: usize,
    /// Elements of one channel's part of a phase (every image's, rounded up to a block).
    span: usize,
    /// Groups in a chunk.
    chunk: usize,
    /// Elements of one phase (every channel's part, and slack for the last taps' runs).
    phase: usize,
    /// For each tap `(a, b)`, where its run starts.
    taps: Vec<usize>,
    /// For each input row, the place of its column `−p₁` (phase 0's) from its channel's and
    /// image's start, if some tap reads the row.
    rows: Vec<Option<usize>>,
    /// The input columns some tap reads.
    cols: std::ops::Range<usize>,
    /// The column stride.
    s1: usize,
    /// The padded column of the first read one.
    q0: usize,
    /// For planes of short rows, which the row copies' fixed costs dominate: each read
    /// input element's index in its plane and place from its channel's and image's start.
    small_input: Option<Vec<(usize, usize)>>,
    /// Likewise each result element's index in its plane and place in the wide layout.
    small_result: Option<Vec<(usize, usize)>>,
}

/// Rows shorter than this are copied element by element through a map (see
/// [`Layout::small_input`]).
const SHORT_ROW: usize = LANES;

/// Channels `c0..c0 + len` of an array of `of` channels.
#[derive(Clone, Copy)]
struct Channels {
    of: usize,
    c0: usize,
    len: usize,
}

impl Layout {
    /// Rows and columns of a phase: of the padded plane (every row and column some output
    /// reads, from −p) by the stride.
    fn phase_plane(d: &Grouped) -> (usize, usize) {
        let [s0, s1] = d.stride;
        let (hp, wp) = ((d.oh.max(1) - 1) * s0 + d.kh, (d.ow.max(1) - 1) * s1 + d.kw);
        (hp.div_ceil(s0), wp.div_ceil(s1))
    }

    fn new(d: &Grouped) -> Layout {
        let [s0, s1] = d.stride;
        let (hq, wq) = Layout::phase_plane(d);
        let img = hq * wq;
        let span = (d.n * img).div_ceil(BLOCK) * BLOCK;
        let per_group = span * s0 * s1 * d.ci.max(d.co);
        let chunk = (CHUNK_ELEMENTS / per_group).clamp(1, d.groups);
        let phase = chunk * d.ci * span + ((d.kh - 1) / s0 + 1) * wq + BLOCK;
        let taps = (0..d.kh)
            .flat_map(|a| (0..d.kw).map(move |b| (a, b)))
            .map(|(a, b)| ((a % s0) * s1 + b % s1) * phase + (a / s0) * wq + b / s1)
            .collect();
        let rows: Vec<Option<usize>> = (0..d.h)
            .map(|i| {
                let r = usize::try_from(i as i64 + d.pad[0]).ok()?;
                (r / s0 < hq).then(|| (r % s0) * s1 * phase + (r / s0) * wq)
            })
            .collect();
        let j0 = (-d.pad[1]).max(0) as usize;
        let j1 = ((wq * s1) as i64 - d.pad[1]).clamp(0, d.w as i64) as usize;
        let cols = j0..j1.max(j0);
        let q0 = (j0 as i64 + d.pad[1]) as usize;
        let small_input = (cols.len() < SHORT_ROW).then(|| {
            let rows = &rows;
            cols.clone()
                .flat_map(|j| (0..d.h).map(move |i| (i, j)))
                .filter_map(|(i, j)| {
                    let q = q0 + (j - j0);
                    let at = rows[i]? + (q % s1) * phase + q / s1;
                    Some((i * d.w + j, at))
                })
                .collect()
        });
        let small_result = (d.ow < SHORT_ROW).then(|| {
            (0..d.oh * d.ow)
                .map(|e| (e, (e / d.ow) * wq + e % d.ow))
                .collect()
        });
        Layout {
            wq,
            img,
            span,
            chunk,
            phase,
            taps,
            rows,
            q0,
            cols,
            s1,
            small_input,
            small_result,
        }
    }

    /// Elements of all the phases together.
    fn len(&self, d: &Grouped) -> usize {
        self.phase * d.stride[0] * d.stride[1]
    }

    /// The chunks of groups: `(first group, groups)`.
    fn chunks(&self, groups: usize) -> impl Iterator<Item = (usize, usize)> {
        let g = self.chunk;
        (0..groups)
            .step_by(g)
            .map(move |g0| (g0, g.min(groups - g0)))
    }

    /// Copies channels `ch` of every image of `x` (`[n, ch.of, h, w]`) into the phases
    /// `buf`, writing only the input elements' places (the rest stays zero).
    fn fill<T: Real>(&self, d: &Grouped, x: &[T], ch: Channels, buf: &mut [T]) {
        if let Some(map) = &self.small_input {
            self.each_plane(d, d.h * d.w, ch, |plane, base| {
                let (src, dst) = (&x[plane..][..d.h * d.w], &mut buf[base..]);
                for &(e, at) in map {
                    dst[at] = src[e];
                }
            });
            return;
        }
        self.each_row(d, ch, |i, base, at| {
            let src = &x[base + i * d.w..][self.cols.clone()];
            self.put(src, &mut buf[at..]);
        });
    }

    /// Copies the phases `buf` out into channels `ch` of `x` (zero where no tap reads).
    fn gather<T: Real>(&self, d: &Grouped, buf: &[T], ch: Channels, x: &mut [T]) {
        let hw = d.h * d.w;
        if let Some(map) = &self.small_input {
            self.each_plane(d, hw, ch, |plane, base| {
                let (src, dst) = (&buf[base..], &mut x[plane..][..hw]);
                dst.fill(T::default());
                for &(e, at) in map {
                    dst[e] = src[at];
                }
            });
            return;
        }
        self.each_plane(d, hw, ch, |plane, _| x[plane..][..hw].fill(T::default()));
        self.each_row(d, ch, |i, base, at| {
            let dst = &mut x[base + i * d.w..][self.cols.clone()];
            self.take(&buf[at..], dst);
        });
    }

    /// Calls `f(plane start, its place)` for channels `ch` of every image, planes of `len`
    /// elements.
    fn each_plane(&self, d: &Grouped, len: usize, ch: Channels, mut f: impl FnMut(usize, usize)) {
        for n in 0..d.n {
            for c in 0..ch.len {
                f((n * ch.of + ch.c0 + c) * len, c * self.span + n * self.img);
            }
        }
    }

    /// Calls `f(row, plane start, place of the row's column −p₁)` for every input row of
    /// channels `ch` of every image that some tap reads.
    fn each_row(&self, d: &Grouped, ch: Channels, mut f: impl FnMut(usize, usize, usize)) {
        if self.cols.is_empty() {
            return;
        }
        self.each_plane(d, d.h * d.w, ch, |plane, base| {
            for (i, r) in self.rows.iter().enumerate() {
                if let Some(r) = r {
                    f(i, plane, base + r);
                }
            }
        });
    }

    /// Writes a row's read columns `src` to their places in its phase rows (`dst` from the
    /// row's start).
    #[inline(always)]
    fn put<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        let q0 = self.q0;
        match self.s1 {
            1 => copy(&mut dst[q0..q0 + src.len()], src),
            2 => {
                // Pairs of columns (even, odd) to the two phases, as the vectorizer likes.
                let (even, odd) = dst.split_at_mut(self.phase);
                let (mut src, mut e) = (src, q0 / 2);
                if q0 % 2 == 1 {
                    odd[e] = src[0];
                    (src, e) = (&src[1..], e + 1);
                }
                let pairs = src.chunks_exact(2);
                let last = pairs.remainder().first().copied();
                let np = pairs.len();
                for ((de, dodd), p) in even[e..e + np]
                    .iter_mut()
                    .zip(&mut odd[e..e + np])
                    .zip(pairs)
                {
                    *de = p[0];
                    *dodd = p[1];
                }
                if let Some(v) = last {
                    even[e + np] = v;
                }
            }
            s1 => {
                for (j, &v) in src.iter().enumerate() {
                    let q = q0 + j;
                    dst[(q % s1) * self.phase + q / s1] = v;
                }
            }
        }
    }

    /// Copies channels `ch` of a result `y` (`[n, ch.of, oh, ow]`) into the wide
    /// layout, from `wide`'s start (only the result elements' places are written).
    fn widen<T: Real>(&self, d: &Grouped, y: &[T], ch: Channels, wide: &mut [T]) {
        let ohw = d.oh * d.ow;
        if let Some(map) = &self.small_result {
            self.each_plane(d, ohw, ch, |plane, base| {
                let (src, dst) = (&y[plane..][..ohw], &mut wide[base..]);
                for &(e, at) in map {
                    dst[at] = src[e];
                }
            });
            return;
        }
        self.each_plane(d, ohw, ch, |plane, base| {
            let rows = wide[base..].chunks_mut(self.wq);
            for (src, dst) in y[plane..][..ohw].chunks_exact(d.ow).zip(rows) {
                copy(&mut dst[..d.ow], src);
            }
        });
    }

    /// The reverse of [`Layout::widen`].
    fn narrow<T: Real>(&self, d: &Grouped, wide: &[T], ch: Channels, y: &mut [T]) {
        let ohw = d.oh * d.ow;
        if let Some(map) = &self.small_result {
            self.each_plane(d, ohw, ch, |plane, base| {
                let (src, dst) = (&wide[base..], &mut y[plane..][..ohw]);
                for &(e, at) in map {
                    dst[e] = src[at];
                }
            });
            return;
        }
        self.each_plane(d, ohw, ch, |plane, base| {
            let rows = wide[base..].chunks(self.wq);
            for (dst, src) in y[plane..][..ohw].chunks_exact_mut(d.ow).zip(rows) {
                copy(dst, &src[..d.ow]);
            }
        });
    }

    /// The reverse of [`Layout::put`].
    #[inline(always)]
    fn take<T: Copy>(&self, src: &[T], dst: &mut [T]) {
        let q0 = self.q0;
        match self.s1 {
            1 => copy(dst, &src[q0..q0 + dst.len()]),
            2 => {
                let (even, odd) = src.split_at(self.phase);
                let (mut dst, mut e) = (dst, q0 / 2);
                if q0 % 2 == 1 {
                    dst[0] = odd[e];
                    (dst, e) = (&mut dst[1..], e + 1);
                }
                let mut pairs = dst.chunks_exact_mut(2);
                let np = pairs.len();
                for ((se, so), p) in even[e..e + np].iter().zip(&odd[e..e + np]).zip(&mut pairs) {
                    p[0] = *se;
                    p[1] = *so;
                }
                if let Some(v) = pairs.into_remainder().first_mut() {
                    *v = even[e + np];
                }
            }
            s1 => {
                for (j, v) in dst.iter_mut().enumerate() {
                    let q = q0 + j;
                    *v = src[(q % s1) * self.phase + q / s1];
                }
            }
        }
    }
}

impl Grouped {
    /// The input channels of groups `g0..g0 + len`.
    fn inputs(&self, groups: (usize, usize)) -> Channels {
        self.channels(self.ci, groups)
    }

    /// The output channels of groups `g0..g0 + len`.
    fn outputs(&self, groups: (usize, usize)) -> Channels {
        self.channels(self.co, groups)
    }

    /// The channels of groups `g0..g0 + len` in an array of `per` channels a group.
    fn channels(&self, per: usize, (g0, len): (usize, usize)) -> Channels {
        Channels {
            of: self.groups * per,
            c0: g0 * per,
            len: len * per,
        }
    }

    /// Elements of one group's weights.
    fn group_weights(&self) -> usize {
        self.co * self.ci * self.kh * self.kw
    }
}

fn forward<T: Real>(d: &Grouped, l: &Layout, x: &[T], k: &[T], y: &mut [T]) {
    let wg = d.group_weights();
    let mut buf = vec![T::default(); l.len(d)];
    let mut wide = vec![T::default(); l.chunk * d.co * l.span];
    for (g0, ng) in l.chunks(d.groups) {
        l.fill(d, x, d.inputs((g0, ng)), &mut buf);
        let w = &k[g0 * wg..][..ng * wg];
        let out = &mut wide[..ng * d.co * l.span];
        correlate(&buf, &l.taps, w, [d.ci, d.co], l.span, out);
        l.narrow(d, &wide, d.outputs((g0, ng)), y);
    }
}

fn input_gradient<T: Real>(d: &Grouped, l: &Layout, dy: &[T], k: &[T], dx: &mut [T]) {
    let khw = d.kh * d.kw;
    let (ci, co) = (d.ci, d.co);
    let [s0, s1] = d.stride;
    // dx's phase φ at m: Σ over φ's taps t and the group's outputs o of w[o][t] · dy's wide
    // layout of o at m − off[t], read from a copy shifted by the largest offset (`margin`)
    // as a correlation of the group's outputs into its inputs.
    let off = |t: usize| l.taps[t] % l.phase;
    let margin = (0..khw).map(off).max().unwrap_or(0);
    let mut wide = vec![T::default(); margin + l.chunk * co * l.span + BLOCK];
    let mut buf = vec![T::default(); l.len(d)];
    let phases: Vec<(Vec<usize>, Vec<usize>)> = (0..s0 * s1)
        .map(|p| {
            (0..khw)
                .filter(|&t| l.taps[t] / l.phase == p)
                .map(|t| (t, margin - off(t)))
                .unzip()
        })
        .collect();
    let mut w = vec![T::default(); l.chunk * d.group_weights()];
    for (g0, ng) in l.chunks(d.groups) {
        l.widen(d, dy, d.outputs((g0, ng)), &mut wide[margin..]);
        for (p, (ts, taps)) in phases.iter().enumerate() {
            // The phase's taps of the forward weight `[g·co][ci][t]`, as `[g·ci][co][t]`.
            let kt = ts.len();
            for g in 0..ng {
                for c in 0..ci {
                    for o in 0..co {
                        let from = &k[(((g0 + g) * co + o) * ci + c) * khw..][..khw];
                        let to = &mut w[((g * ci + c) * co + o) * kt..][..kt];
                        for (v, &t) in to.iter_mut().zip(ts) {
                            *v = from[t];
                        }
                    }
                }
            }
            let out = &mut buf[p * l.phase..][..ng * ci * l.span];
            correlate(&wide, taps, &w[..ng * ci * co * kt], [co, ci], l.span, out);
        }
        l.gather(d, &buf, d.inputs((g0, ng)), dx);
    }
}

fn weight_gradient<T: Real>(
    d: &Grouped,
    l: &Layout,
    x: &[T],
    dy: &[T],
    dk: &mut [T],
    transposed: bool,
    compact: bool,
) {
    let (khw, wg) = (d.kh * d.kw, d.group_weights());
    let mut buf = vec![T::default(); l.len(d)];
    let mut wide = vec![T::default(); if compact { 0 } else { l.chunk * d.co * l.span }];
    // `[ci, g·co, kh, kw]` differs from the weight's layout but for one input channel.
    let direct = transposed || d.ci == 1;
    let mut local = vec![T::default(); if direct { 0 } else { l.chunk * wg }];
    let mut products = Compact::new(d, l, compact);
    for (g0, ng) in l.chunks(d.groups) {
        l.fill(d, x, d.inputs((g0, ng)), &mut buf);
        let out = if direct {
            &mut dk[g0 * wg..][..ng * wg]
        } else {
            &mut local[..ng * wg]
        };
        if let Some(p) = &mut products {
            p.weight_gradient(d, l, &buf, dy, (g0, ng), out);
        } else {
            l.widen(d, dy, d.outputs((g0, ng)), &mut wide);
            let a = &wide[..ng * d.co * l.span];
            dots(a, &buf, &l.taps, [d.ci, d.co], l.span, out);
        }
        if direct {
            continue;
        }
        let outputs = d.groups * d.co;
        for (o, w) in local[..ng * wg].chunks_exact(d.ci * khw).enumerate() {
            for (c, w) in w.chunks_exact(khw).enumerate() {
                dk[(c * outputs + g0 * d.co + o) * khw..][..khw].copy_from_slice(w);
            }
        }
    }
}

/// The weight gradient of groups of many outputs on few positions as a product over the
/// output positions alone: each group's im2col matrix, transposed (`[positions][ci · taps]`,
/// rows rounded up to a block), and its cotangent `[co][positions]`, both gathered from
/// their layouts; the wide rows' positions past the outputs are not computed.
struct Compact<T> {
    /// For each output position (image, row, column), its place in the wide layout.
    wide: Vec<usize>,
    /// Where each (channel, tap) run of a group starts (see [`group_offsets`]).
    offs: Vec<usize>,
    /// Columns of a row of `cols` (`ci · taps` rounded up to a block).
    row: usize,
    /// The chunk's im2col matrices, transposed.
    cols: Vec<T>,
    /// The chunk's cotangents.
    dy: Vec<T>,
    /// The chunk's products `[co][row]`.
    out: Vec<T>,
}

impl<T: Real> Compact<T> {
    fn new(d: &Grouped, l: &Layout, on: bool) -> Option<Compact<T>> {
        if !on {
            return None;
        }
        let wide: Vec<usize> = (0..d.n)
            .flat_map(|n| (0..d.oh).flat_map(move |i| (0..d.ow).map(move |j| (n, i, j))))
            .map(|(n, i, j)| n * l.img + i * l.wq + j)
            .collect();
        let offs = group_offsets(&l.taps, d.ci, l.span);
        let row = offs.len().div_ceil(ROW_BLOCK) * ROW_BLOCK;
        let positions = wide.len();
        Some(Compact {
            cols: vec![T::default(); l.chunk * positions * row],
            dy: vec![T::default(); l.chunk * d.co * positions],
            out: vec![T::default(); l.chunk * d.co * row],
            wide,
            offs,
            row,
        })
    }

    /// The weight gradients `[co][ci][taps]` of groups `g0..g0 + ng` into `dk`, from their
    /// inputs' phases `buf` and the cotangent `dy` (`[n, g·co, oh, ow]`).
    fn weight_gradient(
        &mut self,
        d: &Grouped,
        l: &Layout,
        buf: &[T],
        dy: &[T],
        (g0, ng): (usize, usize),
        dk: &mut [T],
    ) {
        let (p, row, k) = (self.wide.len(), self.row, self.offs.len());
        let ohw = d.oh * d.ow;
        for g in 0..ng {
            let src = &buf[g * d.ci * l.span..];
            let cols = &mut self.cols[g * p * row..][..p * row];
            for (r, &at) in cols.chunks_exact_mut(row).zip(&self.wide) {
                for (v, &off) in r.iter_mut().zip(&self.offs) {
                    *v = src[off + at];
                }
            }
            let dyg = &mut self.dy[g * d.co * p..][..d.co * p];
            for (o, to) in dyg.chunks_exact_mut(p).enumerate() {
                for (n, to) in to.chunks_exact_mut(ohw).enumerate() {
                    let plane = (n * d.groups * d.co + (g0 + g) * d.co + o) * ohw;
                    to.copy_from_slice(&dy[plane..][..ohw]);
                }
            }
        }
        // `out[o][r] = Σ_p dy[o][p] · cols[p][r]`: a correlation with the positions as input
        // channels of one tap each.
        let out = &mut self.out[..ng * d.co * row];
        correlate(
            &self.cols[..ng * p * row],
            &[0],
            &self.dy[..ng * d.co * p],
            [p, d.co],
            row,
            out,
        );
        for (to, from) in dk.chunks_exact_mut(k).zip(out.chunks_exact(row)) {
            to.copy_from_slice(&from[..k]);
        }
    }
}

/// For each group (`[ci, co]` channels; `co` spans of `out`, `ci` of `src`) and output `o`
/// of it: `out[o][i] = Σ_c Σ_t w[o][c][t] · src[c][taps[t] + i]`.
fn correlate<T: Real>(
    src: &[T],
    taps: &[usize],
    w: &[T],
    [ci, co]: [usize; 2],
    span: usize,
    out: &mut [T],
) {
    if taps.is_empty() {
        out.fill(T::default());
    } else if ci == 1 && co == 1 {
        depthwise_correlate(src, taps, w, span, out);
    } else {
        group_correlate(src, taps, w, [ci, co], span, out);
    }
}

/// [`correlate`] of depthwise groups (a function of its own, as [`depthwise_dots`]).
#[multiversion(targets("x86_64+avx2+fma"))]
fn depthwise_correlate<T: Real>(src: &[T], taps: &[usize], w: &[T], span: usize, out: &mut [T]) {
    let k = taps.len();
    for (c, (o, w)) in out
        .chunks_exact_mut(span)
        .zip(w.chunks_exact(k))
        .enumerate()
    {
        let src = &src[c * span..];
        match k {
            9 => correlate_k::<T, 9>(src, taps, w, o),
            25 => correlate_k::<T, 25>(src, taps, w, o),
            _ => correlate_n(src, taps, w, o),
        }
    }
}

/// [`correlate`] of groups of several channels.
#[multiversion(targets("x86_64+avx2+fma"))]
fn group_correlate<T: Real>(
    src: &[T],
    taps: &[usize],
    w: &[T],
    [ci, co]: [usize; 2],
    span: usize,
    out: &mut [T],
) {
    let k = taps.len();
    let offs = group_offsets(taps, ci, span);
    let mut wt = Vec::new();
    for (g, (o, w)) in out
        .chunks_exact_mut(co * span)
        .zip(w.chunks_exact(co * ci * k))
        .enumerate()
    {
        let src = &src[g * ci * span..];
        // The weights by offset, every output's together.
        let n = offs.len();
        wt.clear();
        for r in 0..n {
            wt.extend(w[r..].iter().step_by(n).take(co));
        }
        for i0 in (0..span).step_by(TILE) {
            let positions = i0..(i0 + TILE).min(span);
            let mut o0 = 0;
            while o0 < co {
                let rows = match co - o0 {
                    1 => 1,
                    2 | 3 => 2,
                    _ => 4,
                };
                let (out, i) = (&mut o[o0 * span..], positions.clone());
                match rows {
                    4 => product_rows::<T, 4>(src, &offs, &wt, [co, o0], span, i, out),
                    2 => product_rows::<T, 2>(src, &offs, &wt, [co, o0], span, i, out),
                    _ => product_rows::<T, 1>(src, &offs, &wt, [co, o0], span, i, out),
                }
                o0 += rows;
            }
        }
    }
}

/// Where each (channel, tap) run of a group starts: `c · span + taps[t]`.
fn group_offsets(taps: &[usize], ci: usize, span: usize) -> Vec<usize> {
    (0..ci)
        .flat_map(|c| taps.iter().map(move |&t| c * span + t))
        .collect()
}

/// Rows `o0..o0 + R` of a group's product at `positions` (from `out`'s start, rows `span`
/// apart): `out[o][i] = Σ_r wt[r][o] · src[offs[r] + i]` (`wt` rows of `co`).
#[inline(always)]
fn product_rows<T: Real, const R: usize>(
    src: &[T],
    offs: &[usize],
    wt: &[T],
    [co, o0]: [usize; 2],
    span: usize,
    positions: std::ops::Range<usize>,
    out: &mut [T],
) {
    for i in positions.step_by(ROW_BLOCK) {
        let mut acc = [[T::default(); ROW_BLOCK]; R];
        for (r, &off) in offs.iter().enumerate() {
            let run: &[T; ROW_BLOCK] = src[off + i..][..ROW_BLOCK].try_into().unwrap();
            let w: &[T; R] = wt[r * co + o0..][..R].try_into().unwrap();
            for (acc, &w) in acc.iter_mut().zip(w) {
                *acc = scale_add(*acc, w, run);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            out[j * span + i..][..ROW_BLOCK].copy_from_slice(acc);
        }
    }
}

/// [`correlate`] of one depthwise channel, for any number of taps.
#[inline(always)]
fn correlate_n<T: Real>(buf: &[T], taps: &[usize], w: &[T], o: &mut [T]) {
    for (i, o) in o.chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [T::default(); BLOCK];
        for (&tap, &wt) in taps.iter().zip(w) {
            let src = &buf[tap + i * BLOCK..][..BLOCK];
            for (a, &v) in acc.iter_mut().zip(src) {
                *a = *a + wt * v;
            }
        }
        o.copy_from_slice(&acc);
    }
}

#[inline(always)]
fn correlate_k<T: Real, const K: usize>(buf: &[T], taps: &[usize], w: &[T], out: &mut [T]) {
    let len = out.len();
    let runs: [&[T]; K] = std::array::from_fn(|t| &buf[taps[t]..taps[t] + len]);
    let w: [T; K] = std::array::from_fn(|t| w[t]);
    for (i, o) in out.chunks_exact_mut(BLOCK).enumerate() {
        let mut acc = [T::default(); BLOCK];
        for t in 0..K {
            let src = &runs[t][i * BLOCK..][..BLOCK];
            for (a, &v) in acc.iter_mut().zip(src) {
                *a = *a + w[t] * v;
            }
        }
        o.copy_from_slice(&acc);
    }
}

/// For each group (`[ci, co]` channels; `co` spans of `a`, `ci` of `b`), each output `o`,
/// channel `c` and tap `t`: `out[o][c][t] = Σ_i a[o][i] · b[c][taps[t] + i]`, summed in f64
/// over lanes.
fn dots<T: Real>(
    a: &[T],
    b: &[T],
    taps: &[usize],
    [ci, co]: [usize; 2],
    span: usize,
    out: &mut [T],
) {
    if ci == 1 && co == 1 {
        depthwise_dots(a, b, taps, span, out);
    } else {
        group_dots(a, b, taps, [ci, co], span, out);
    }
}

/// [`dots`] of depthwise groups. (A function of its own: inside [`group_dots`]'s, its loops
/// compiled 20–25 % slower.)
#[multiversion(targets("x86_64+avx2+fma"))]
fn depthwise_dots<T: Real>(a: &[T], b: &[T], taps: &[usize], span: usize, out: &mut [T]) {
    let k = taps.len();
    for (c, (a, o)) in a
        .chunks_exact(span)
        .zip(out.chunks_exact_mut(k))
        .enumerate()
    {
        let b = &b[c * span..];
        match k {
            9 => dots_k::<T, 9>(a, b, taps, o),
            _ => dots_n(a, b, taps, o),
        }
    }
}

/// [`dots`] of groups of several channels.
#[multiversion(targets("x86_64+avx2+fma"))]
fn group_dots<T: Real>(
    a: &[T],
    b: &[T],
    taps: &[usize],
    [ci, co]: [usize; 2],
    span: usize,
    out: &mut [T],
) {
    let offs = group_offsets(taps, ci, span);
    let n = offs.len();
    for (g, (a, o)) in a
        .chunks_exact(co * span)
        .zip(out.chunks_exact_mut(co * n))
        .enumerate()
    {
        let b = &b[g * ci * span..];
        let mut o0 = 0;
        while o0 < co {
            let rows = if co - o0 >= 4 { 4 } else { 1 };
            let mut r0 = 0;
            while r0 < n {
                let runs = if n - r0 >= 2 { 2 } else { 1 };
                let (a, o) = (&a[o0 * span..], &mut o[o0 * n + r0..]);
                let offs = &offs[r0..];
                match (rows, runs) {
                    (4, 2) => dot_block::<T, 4, 2>(a, b, offs, [span, n], o),
                    (4, _) => dot_block::<T, 4, 1>(a, b, offs, [span, n], o),
                    (_, 2) => dot_block::<T, 1, 2>(a, b, offs, [span, n], o),
                    _ => dot_block::<T, 1, 1>(a, b, offs, [span, n], o),
                }
                r0 += runs;
            }
            o0 += rows;
        }
    }
}

/// `R` rows of `a` (`span` apart) by `Q` runs of `b` at `offs`: `out[j][q] = Σ_i a[j][i] ·
/// b[offs[q] + i]` (`out` rows `n` apart).
#[inline(always)]
fn dot_block<T: Real, const R: usize, const Q: usize>(
    a: &[T],
    b: &[T],
    offs: &[usize],
    [span, n]: [usize; 2],
    out: &mut [T],
) {
    let rows: [&[T]; R] = std::array::from_fn(|j| &a[j * span..][..span]);
    let runs: [&[T]; Q] = std::array::from_fn(|q| &b[offs[q]..][..span]);
    let mut acc = [[[T::default(); LANES]; Q]; R];
    for i in (0..span).step_by(LANES) {
        for (acc, row) in acc.iter_mut().zip(&rows) {
            let x: &[T; LANES] = row[i..i + LANES].try_into().unwrap();
            for (acc, run) in acc.iter_mut().zip(&runs) {
                let y: &[T; LANES] = run[i..i + LANES].try_into().unwrap();
                *acc = multiply_add(*acc, x, y);
            }
        }
    }
    for (j, acc) in acc.iter().enumerate() {
        for (q, s) in acc.iter().enumerate() {
            out[j * n + q] = T::from_f64(s.iter().map(|&v| v.into()).sum());
        }
    }
}

/// `acc + x · y` lane by lane. (Whole arrays in and out keep the accumulators in registers,
/// where updating them in place left them in memory, one lane at a time.)
#[inline(always)]
fn multiply_add<T: Real, const L: usize>(acc: [T; L], x: &[T; L], y: &[T; L]) -> [T; L] {
    std::array::from_fn(|l| acc[l] + x[l] * y[l])
}

/// `acc + w · x` lane by lane (see [`multiply_add`]).
#[inline(always)]
fn scale_add<T: Real, const L: usize>(acc: [T; L], w: T, x: &[T; L]) -> [T; L] {
    std::array::from_fn(|l| acc[l] + w * x[l])
}

/// [`dots`] of one depthwise channel, for any number of taps.
#[inline(always)]
fn dots_n<T: Real>(a: &[T], b: &[T], taps: &[usize], o: &mut [T]) {
    for (o, &tap) in o.iter_mut().zip(taps) {
        let mut acc = [T::default(); BLOCK];
        for (ca, cb) in a.chunks_exact(BLOCK).zip(b[tap..].chunks_exact(BLOCK)) {
            for ((s, &x), &y) in acc.iter_mut().zip(ca).zip(cb) {
                *s = *s + x * y;
            }
        }
        *o = T::from_f64(acc.iter().map(|&v| v.into()).sum());
    }
}

#[inline(always)]
fn dots_k<T: Real, const K: usize>(a: &[T], b: &[T], taps: &[usize], out: &mut [T]) {
    let len = a.len();
    let runs: [&[T]; K] = std::array::from_fn(|t| &b[taps[t]..taps[t] + len]);
    let mut acc = [[T::default(); LANES]; K];
    for (i, ca) in a.chunks_exact(LANES).enumerate() {
        for t in 0..K {
            let cb = &runs[t][i * LANES..][..LANES];
            for ((s, &x), &y) in acc[t].iter_mut().zip(ca).zip(cb) {
                *s = *s + x * y;
            }
        }
    }
    for (o, s) in out.iter_mut().zip(&acc) {
        *o = T::from_f64(s.iter().map(|&v| v.into()).sum());
    }
}

/// Copies a short run without a call to `memcpy` (whose fixed cost dominates rows of a few
/// elements).
#[inline(always)]
fn copy<T: Copy>(dst: &mut [T], src: &[T]) {
    let mut d = dst.chunks_exact_mut(LANES);
    let mut s = src.chunks_exact(LANES);
    for (d, s) in (&mut d).zip(&mut s) {
        let v: [T; LANES] = s.try_into().unwrap();
        d.copy_from_slice(&v);
    }
    for (d, s) in d.into_remainder().iter_mut().zip(s.remainder()) {
        *d = *s;
        std::hint::black_box(());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::xla::kernels::conv::{conv_form, conv_out_dims};
    use tch::{Kind, Tensor};

    fn seeded(dims: &[i64], seed: i64) -> Tensor {
        let n: i64 = dims.iter().product();
        (Tensor::arange(n, (Kind::Double, tch::Device::Cpu)) * 0.7 + seed as f64 * 1.3)
            .sin()
            .reshape(dims)
    }

    fn values<T: tch::kind::Element>(t: &Tensor) -> Vec<T> {
        let t = t.contiguous();
        let mut v = vec![T::ZERO; t.numel()];
        t.copy_data(&mut v, t.numel());
        v
    }

    /// A forward convolution: input dims, kernel size, strides, padding, groups, output
    /// channels.
    type Case = ([i64; 4], [i64; 2], [usize; 2], [(i64, i64); 2], i64, i64);

    fn cases() -> Vec<Case> {
        let depthwise = [
            ([2, 3, 7, 6], [3, 3], [1, 1], [(1, 1), (1, 1)]),
            ([2, 3, 8, 9], [3, 3], [2, 2], [(1, 1), (1, 1)]),
            ([2, 3, 9, 8], [3, 3], [2, 2], [(1, 1), (1, 1)]),
            ([1, 4, 9, 9], [5, 5], [1, 2], [(2, 2), (2, 2)]),
            ([1, 4, 11, 10], [5, 5], [2, 2], [(2, 2), (2, 2)]),
            ([2, 5, 4, 4], [3, 3], [1, 1], [(0, 0), (0, 0)]),
            ([2, 3, 6, 5], [3, 2], [2, 1], [(2, 0), (0, 1)]),
            ([1, 2, 2, 2], [3, 3], [1, 1], [(1, 1), (1, 1)]),
            ([2, 7, 2, 2], [3, 3], [2, 2], [(1, 1), (1, 1)]),
            ([1, 2, 6, 6], [3, 3], [1, 1], [(-1, 1), (1, -1)]),
            ([1, 2, 7, 7], [3, 3], [3, 2], [(0, 2), (1, 0)]),
            ([2, 3, 7, 8], [5, 5], [1, 1], [(2, 2), (2, 2)]),
            // Phases no tap reads (a 1×1 window with stride 2).
            ([1, 3, 6, 7], [1, 1], [2, 2], [(0, 0), (0, 0)]),
            // More channels than one chunk of the layout holds (several chunks).
            ([2, 40, 12, 12], [3, 3], [1, 1], [(1, 1), (1, 1)]),
            ([3, 45, 13, 12], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        ];
        let mut cases: Vec<Case> = depthwise
            .into_iter()
            .map(|(x, k, s, p)| (x, k, s, p, x[1], x[1]))
            .collect();
        // Groups of several channels: resnext's (4 → 4, 8 → 8, stride 2), channel
        // multipliers, more outputs than inputs and the reverse, odd counts (a remainder of
        // rows and of runs), 5×5 and 1×2 windows, several chunks.
        cases.extend([
            ([2, 8, 9, 8], [3, 3], [1, 1], [(1, 1), (1, 1)], 2, 8),
            ([2, 16, 8, 8], [3, 3], [2, 2], [(1, 1), (1, 1)], 2, 16),
            ([1, 3, 6, 7], [3, 3], [1, 1], [(1, 1), (1, 1)], 3, 6),
            ([2, 6, 7, 6], [3, 3], [1, 2], [(1, 1), (0, 1)], 2, 10),
            ([1, 10, 6, 6], [3, 3], [2, 1], [(1, 1), (1, 1)], 2, 6),
            ([1, 9, 5, 6], [5, 5], [1, 1], [(2, 2), (2, 2)], 3, 9),
            ([2, 6, 5, 7], [1, 2], [1, 2], [(0, 0), (1, 0)], 3, 15),
            ([2, 64, 4, 4], [3, 3], [1, 1], [(1, 1), (1, 1)], 2, 64),
            ([4, 96, 14, 14], [3, 3], [1, 1], [(1, 1), (1, 1)], 24, 96),
            ([1, 6, 5, 4], [3, 3], [1, 1], [(-1, 0), (1, 2)], 2, 4),
            // resnext's widest groups on 2×2 outputs (the weight gradient over the output
            // positions alone), one of them strided.
            ([2, 64, 2, 2], [3, 3], [1, 1], [(1, 1), (1, 1)], 2, 64),
            ([1, 32, 4, 4], [3, 3], [2, 2], [(1, 1), (1, 1)], 2, 32),
        ]);
        cases
    }

    /// The passes of one case as kiln's autograd gives them to the kernel: (form,
    /// attributes, operands).
    fn calls(
        i: usize,
        &(xd, ks, st, pad, groups, outs): &Case,
    ) -> Vec<(ConvForm, ConvAttrs, Tensor, Tensor)> {
        let mut c = ConvAttrs::plain(2);
        c.strides = st.to_vec();
        c.padding = pad.to_vec();
        c.feature_groups = groups as usize;
        let kd = [outs, xd[1] / groups, ks[0], ks[1]];
        let od = conv_out_dims(&c, &xd, &kd).unwrap();
        let (x, k, dy) = (
            seeded(&xd, i as i64),
            seeded(&kd, 100 + i as i64),
            seeded(&od, 200 + i as i64),
        );
        // The input gradient: `dy` dilated by the stride, padded by `k − 1 − p` low and by
        // what gives back the input's extent high.
        let mut gi = ConvAttrs::plain(2);
        gi.feature_groups = c.feature_groups;
        gi.lhs_dilation = st.to_vec();
        gi.padding = (0..2)
            .map(|a| {
                let lo = kd[a + 2] - 1 - pad[a].0;
                let dilated = (od[a + 2] - 1) * st[a] as i64 + 1;
                (lo, xd[a + 2] + kd[a + 2] - 1 - dilated - lo)
            })
            .collect();
        // The weight gradient: the forward stride as kernel dilation, padded to give the
        // kernel's extent.
        let mut gw = ConvAttrs::plain(2);
        gw.feature_groups = c.feature_groups;
        gw.rhs_dilation = st.to_vec();
        gw.padding = (0..2)
            .map(|a| {
                let reach = (od[a + 2] - 1) * st[a] as i64 + 1;
                (pad[a].0, ks[a] - 1 + reach - xd[a + 2] - pad[a].0)
            })
            .collect();
        vec![
            (ConvForm::Plain, c, x.shallow_clone(), k.shallow_clone()),
            (ConvForm::ForwardWeight, gi, dy.shallow_clone(), k),
            (
                ConvForm::WeightGradient,
                gw.clone(),
                x.shallow_clone(),
                dy.shallow_clone(),
            ),
            (ConvForm::WeightGradientTransposed, gw, x, dy),
        ]
    }

    /// Every pass against libtorch's (the kernel's own `conv_form`) in float64 within twice
    /// float64's rounding of a sum of that many products (both sides round), and in float32
    /// against the float64 result within float32's rounding of it (`γₙ` of the sum of
    /// |products|, from the same convolution of |operands|).
    #[test]
    fn every_pass_matches_libtorch_in_f64_and_f32() {
        for (i, case) in cases().iter().enumerate() {
            for (form, attrs, a, b) in calls(i, case) {
                let want = conv_form(&attrs, &a, &b, form).unwrap().contiguous();
                let od = want.size();
                let what = format!("case {i} {case:?} {form:?}");
                let (d, pass) = Grouped::of(&attrs, &a.size(), &b.size(), &od, form).expect(&what);
                let numel = want.numel();
                let bound = values::<f64>(&conv_form(&attrs, &a.abs(), &b.abs(), form).unwrap());
                let terms = match pass {
                    Pass::WeightGradient { .. } => (d.n * d.oh * d.ow) as f64,
                    Pass::Forward => (d.ci * d.kh * d.kw) as f64,
                    Pass::InputGradient => (d.co * d.kh * d.kw) as f64,
                };
                let want64 = values::<f64>(&want);
                let (a64, b64) = (values::<f64>(&a), values::<f64>(&b));
                let a32 = values::<f32>(&a.to_kind(Kind::Float));
                let b32 = values::<f32>(&b.to_kind(Kind::Float));
                // The weight gradient both ways: over the wide rows and over the output
                // positions alone (`run` takes one of them; the other passes have one).
                let routes: &[bool] = match pass {
                    Pass::WeightGradient { .. } => &[false, true],
                    _ => &[false],
                };
                for &compact in routes {
                    let mut got = vec![0f64; numel];
                    d.run_as(pass, &a64, &b64, &mut got, compact);
                    for (j, ((g, w), b)) in got.iter().zip(&want64).zip(&bound).enumerate() {
                        let tol = 2.0 * (terms + 2.0) * f64::EPSILON * b;
                        assert!(
                            (g - w).abs() <= tol,
                            "{what} {compact} f64 [{j}]: {g} vs {w}"
                        );
                    }
                    let mut got32 = vec![0f32; numel];
                    d.run_as(pass, &a32, &b32, &mut got32, compact);
                    for (j, ((g, w), b)) in got32.iter().zip(&want64).zip(&bound).enumerate() {
                        let tol = (terms + 2.0) * f32::EPSILON as f64 * b;
                        assert!(
                            (*g as f64 - w).abs() <= tol,
                            "{what} {compact} f32 [{j}]: {g} vs {w} (tol {tol})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn takes_only_two_d_calls_of_small_groups_without_kernel_dilation() {
        let mut c = ConvAttrs::plain(2);
        c.feature_groups = 4;
        let (x, k, o) = ([2, 4, 5, 5], [4, 1, 3, 3], [2, 4, 3, 3]);
        let of = |c: &ConvAttrs, x: &[i64], k: &[i64], o: &[i64], form| {
            Grouped::of(c, x, k, o, form).map(|(d, pass)| (d.ci, d.co, pass))
        };
        assert_eq!(
            of(&c, &x, &k, &o, ConvForm::Plain),
            Some((1, 1, Pass::Forward))
        );
        // Two channels per group, a channel multiplier; the weight gradient's two layouts.
        let mut g = c.clone();
        g.feature_groups = 2;
        let (two, ci2) = (Some((2, 2, Pass::Forward)), [4, 2, 3, 3]);
        assert_eq!(of(&g, &x, &ci2, &o, ConvForm::Plain), two);
        let multiplier = of(&c, &x, &[8, 1, 3, 3], &[2, 8, 3, 3], ConvForm::Plain);
        assert_eq!(multiplier, Some((1, 2, Pass::Forward)));
        let dw = |form, out: &[i64]| of(&g, &x, &[2, 6, 3, 3], out, form).map(|d| d.2);
        let (plain, transposed) = (ConvForm::WeightGradient, ConvForm::WeightGradientTransposed);
        let (ci_first, co_first) = ([2, 6, 3, 3], [6, 2, 3, 3]);
        let t = |transposed| Some(Pass::WeightGradient { transposed });
        assert_eq!(dw(plain, &ci_first), t(false));
        assert_eq!(dw(transposed, &co_first), t(true));
        assert_eq!(dw(plain, &co_first), None);
        // One group (a plain convolution), groups too wide, kernel dilation, batch groups.
        let mut one = c.clone();
        one.feature_groups = 1;
        assert!(of(&one, &x, &[4, 4, 3, 3], &o, ConvForm::Plain).is_none());
        let wide = [2, 66, 5, 5];
        g.feature_groups = 2;
        assert!(of(&g, &wide, &[4, 33, 3, 3], &o, ConvForm::Plain).is_none());
        assert!(of(
            &g,
            &[2, 4, 5, 5],
            &[66, 2, 3, 3],
            &[2, 66, 3, 3],
            ConvForm::Plain
        )
        .is_none());
        let mut d = c.clone();
        d.rhs_dilation = vec![2, 2];
        assert!(of(&d, &x, &k, &o, ConvForm::Plain).is_none());
        let mut b = c.clone();
        b.batch_groups = 2;
        assert!(of(&b, &x, &k, &o, ConvForm::Plain).is_none());
        // An input-dilated forward convolution; 1-d.
        let mut l = c.clone();
        l.lhs_dilation = vec![2, 2];
        assert!(of(&l, &x, &k, &o, ConvForm::Plain).is_none());
        let c1 = ConvAttrs {
            feature_groups: 4,
            ..ConvAttrs::plain(1)
        };
        assert!(of(&c1, &[2, 4, 5], &[4, 1, 3], &[2, 4, 3], ConvForm::Plain).is_none());
        // Empty arrays.
        assert!(of(&c, &[0, 4, 5, 5], &k, &[0, 4, 3, 3], ConvForm::Plain).is_none());
        assert!(of(&c, &x, &[4, 1, 0, 3], &[2, 4, 6, 3], ConvForm::Plain).is_none());
        // The weight gradient of a convolution with kernel dilation (window strides > 1).
        let mut w = c.clone();
        w.strides = vec![2, 2];
        let dk = of(
            &w,
            &x,
            &[2, 4, 3, 3],
            &[1, 4, 2, 2],
            ConvForm::WeightGradient,
        );
        assert!(dk.is_none());
    }

    #[test]
    fn runs_depthwise_always_and_small_groups_on_little_waste() {
        let of = |x: [i64; 4], k: [i64; 4], groups, stride: usize| {
            let mut c = ConvAttrs::plain(2);
            c.feature_groups = groups;
            c.strides = vec![stride; 2];
            c.padding = vec![(1, 1); 2];
            let o = conv_out_dims(&c, &x, &k).unwrap();
            Grouped::of(&c, &x, &k, &o, ConvForm::Plain).unwrap().0
        };
        let pays = |x, k, groups, stride| of(x, k, groups, stride).pays(Pass::Forward);
        let dk = Pass::WeightGradient { transposed: true };
        // Depthwise on 2×2 (4 wide positions per output); resnext50_32x4d's groups of 4 on
        // 16×16 and of 8 on 8×8, and its stride-2 one; not its groups of 16 and 32, nor 8
        // on 2×2.
        assert!(pays([4, 960, 2, 2], [960, 1, 3, 3], 960, 1));
        assert!(pays([4, 128, 16, 16], [128, 4, 3, 3], 32, 1));
        assert!(pays([4, 256, 8, 8], [256, 8, 3, 3], 32, 1));
        assert!(pays([4, 256, 16, 16], [256, 8, 3, 3], 32, 2));
        assert!(!pays([4, 512, 4, 4], [512, 16, 3, 3], 32, 1));
        assert!(!pays([4, 1024, 2, 2], [1024, 32, 3, 3], 32, 1));
        assert!(!pays([4, 256, 2, 2], [256, 8, 3, 3], 32, 1));
        // The weight gradients of its groups of 32 on 2×2 outputs, but not of 16 on 4×4.
        assert!(of([4, 1024, 2, 2], [1024, 32, 3, 3], 32, 1).pays(dk));
        assert!(of([4, 1024, 4, 4], [1024, 32, 3, 3], 32, 2).pays(dk));
        assert!(!of([4, 512, 4, 4], [512, 16, 3, 3], 32, 1).pays(dk));
        assert!(!of([4, 512, 8, 8], [512, 16, 3, 3], 32, 2).pays(dk));
    }
}
