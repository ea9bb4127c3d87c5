//! kiln's own depthwise convolution: a 2-d depthwise [`CONV_TARGET`](super::CONV_TARGET)
//! call (one input and one output channel per group, no kernel dilation) in each of the
//! forms kiln's autograd gives it, computed in Rust on the XLA worker that calls the kernel
//! instead of by libtorch: the forward convolution ([`ConvForm::Plain`]), its input gradient
//! ([`ConvForm::ForwardWeight`], the forward weight read reversed, input-dilated by the
//! stride) and its weight gradient ([`ConvForm::WeightGradient`] and its transposed form,
//! the same array for one channel per group).
//!
//! Why: a libtorch call has a large fixed cost on a depthwise convolution (dispatch,
//! oneDNN's primitive and its layout reorders), and inside an executable each call also pays
//! for running libtorch on XLA's worker; that dominates the small ones of a training step.
//! mobilenet_v2's training step runs 51 depthwise kernels (forward, input and weight
//! gradients), which took 13–15 ms of its ~52 ms in libtorch. 2-vCPU AMD EPYC (Zen 2),
//! batch 4 at 64×64, `TrainStep` in a loop of 20 steps, medians, ms, libtorch / these
//! loops: mobilenet_v2 split 52.6 / 37.6 (8.4 ms a step in kernel calls, 16.4 before); in
//! the harness (`--training --all --mode once`, eager at 2 threads) 0.89× / 0.94× → 1.15× /
//! 1.20× of eager (split / fused), mnasnet1_0 (5×5 windows too) 0.99× / 1.02× → 1.36× /
//! 1.35×. Alone, one thread each, µs
//! a call, these loops / libtorch (forward, input gradient, weight gradient): 32 channels on
//! 32×32 93 / 181, 104 / 220, 133 / 187; 144 on 16×16 117 / 187, 132 / 245, 177 / 191; 192
//! on 8×8 58 / 122, 64 / 162, 84 / 127; 384 on 4×4 72 / 103, 77 / 137, 90 / 110; 960 on 2×2
//! 55 / 120, 76 / 145, 82 / 687; stride 2, 96 on 32×32 219 / 216, 264 / 351, 252 / 221; 5×5,
//! 240 on 8×8 200 / 153, 213 / 227, 332 / 2,286.
//!
//! How: a group of channels of every image (sized to stay in L2) is copied once into a
//! zero-padded layout split into *phases* (the padded plane by row and column modulo the
//! stride, so that each tap of a strided window reads a contiguous run), one channel's
//! images after another (rows by vector copies; planes of short rows element by element
//! through a precomputed map, as a copy's fixed cost would dominate). Then each pass is a few
//! long contiguous loops over the whole group (32 results at a time, compiled for AVX2 + FMA
//! where the CPU has them): the forward pass
//! sums the taps' shifted runs in registers, computing "wide" rows (the phase's width; the
//! columns past the output's are discarded); the input gradient is the same correlation of
//! the cotangent's wide layout with each phase's taps, read backwards; and the weight
//! gradient is a dot product of the cotangent with each tap's run (in f32 lanes, added up in
//! f64). Nothing here calls libtorch: the kernel runs right on the XLA worker that calls it,
//! without the kernel lock.

use super::dot::Real;
use super::ConvForm;
use crate::ir::ConvAttrs;
use multiversion::multiversion;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

static OWN: OnceLock<AtomicBool> = OnceLock::new();

fn own() -> &'static AtomicBool {
    OWN.get_or_init(|| {
        let torch = std::env::var("KILN_DEPTHWISE").is_ok_and(|v| v == "libtorch");
        AtomicBool::new(!torch)
    })
}

/// Whether depthwise convolutions run as kiln's own loops (the default) rather than as
/// libtorch's; for comparisons (also `KILN_DEPTHWISE=libtorch` in the environment). Takes
/// effect at the next kernel call, in executables compiled before too.
pub fn set_own_depthwise(on: bool) {
    own().store(on, Ordering::Relaxed);
}

/// See [`set_own_depthwise`].
pub fn own_depthwise() -> bool {
    own().load(Ordering::Relaxed)
}

/// Which pass of a depthwise convolution a call computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pass {
    /// `y = x ⋆ k`: operands `x` `[n, c, h, w]` and `k` `[c, 1, kh, kw]`, result `y`
    /// `[n, c, oh, ow]`.
    Forward,
    /// `dx`: operands the cotangent `dy` `[n, c, oh, ow]` and the forward weight `k`, result
    /// `[n, c, h, w]`.
    InputGradient,
    /// `dk`: operands the forward input `x` and the cotangent `dy`, result `[c, kh, kw]`
    /// (as `[1, c, kh, kw]` or `[c, 1, kh, kw]`).
    WeightGradient,
}

/// The geometry of a 2-d depthwise convolution, forward: input `[n, c, h, w]`, kernel
/// `[c, 1, kh, kw]`, output `[n, c, oh, ow]`, `y[n][c][i][j] = Σ k[c][a][b] ·
/// x[n][c][i·s₀ + a − p₀][j·s₁ + b − p₁]` over the taps that fall inside the input.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Depthwise {
    n: usize,
    c: usize,
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

impl Depthwise {
    /// The depthwise convolution and pass that a [`CONV_TARGET`](super::CONV_TARGET) call of
    /// operand dims `x`, `k`, result dims `out` and form `form` computes, if this module runs
    /// it: 2-d, one input and one output channel per group, no batch groups, no kernel
    /// dilation, and (but for the input gradient's, which is the forward stride) no input
    /// dilation. The kernel checks the result dims against the convolution's before.
    pub(crate) fn of(
        c: &ConvAttrs,
        x: &[i64],
        k: &[i64],
        out: &[i64],
        form: ConvForm,
    ) -> Option<(Depthwise, Pass)> {
        // (Empty arrays and windows stay with libtorch.)
        let u = |v: i64| usize::try_from(v).ok().filter(|&v| v > 0);
        if x.len() != 4 || k.len() != 4 || out.len() != 4 || c.strides.len() != 2 {
            return None;
        }
        let ones = |v: &[usize]| v.iter().all(|&d| d == 1);
        let channels = u(x[1]).filter(|&ch| c.feature_groups == ch)?;
        if c.batch_groups != 1 {
            return None;
        }
        let geometry =
            |n, [h, w]: [i64; 2], [kh, kw]: [i64; 2], [oh, ow]: [i64; 2], stride, pad| {
                Some(Depthwise {
                    n: u(n)?,
                    c: channels,
                    h: u(h)?,
                    w: u(w)?,
                    kh: u(kh)?,
                    kw: u(kw)?,
                    oh: u(oh)?,
                    ow: u(ow)?,
                    stride,
                    pad,
                })
            };
        let same = x[0] == out[0] && x[1] == out[1];
        match form {
            ConvForm::Plain => {
                let ok = k[0] == x[1] && k[1] == 1 && same;
                if !ok || !ones(&c.lhs_dilation) || !ones(&c.rhs_dilation) {
                    return None;
                }
                let d = geometry(
                    x[0],
                    [x[2], x[3]],
                    [k[2], k[3]],
                    [out[2], out[3]],
                    [c.strides[0], c.strides[1]],
                    [c.padding[0].0, c.padding[1].0],
                )?;
                Some((d, Pass::Forward))
            }
            ConvForm::ForwardWeight => {
                // The transposed convolution of `dy` by the forward weight: window stride 1,
                // input dilation = the forward stride, low padding `kh − 1 − p`.
                let ok = k[0] == x[1] && k[1] == 1 && same;
                if !ok || !ones(&c.strides) || !ones(&c.rhs_dilation) {
                    return None;
                }
                let d = geometry(
                    x[0],
                    [out[2], out[3]],
                    [k[2], k[3]],
                    [x[2], x[3]],
                    [c.lhs_dilation[0], c.lhs_dilation[1]],
                    [k[2] - 1 - c.padding[0].0, k[3] - 1 - c.padding[1].0],
                )?;
                Some((d, Pass::InputGradient))
            }
            ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
                // Operands `x` and `dy`; window strides = the forward kernel dilation (1),
                // kernel dilation = the forward stride.
                let ok = k[0] == x[0] && k[1] == x[1] && out[0] * out[1] == x[1];
                if !ok || !ones(&c.strides) || !ones(&c.lhs_dilation) {
                    return None;
                }
                let d = geometry(
                    x[0],
                    [x[2], x[3]],
                    [out[2], out[3]],
                    [k[2], k[3]],
                    [c.rhs_dilation[0], c.rhs_dilation[1]],
                    [c.padding[0].0, c.padding[1].0],
                )?;
                Some((d, Pass::WeightGradient))
            }
        }
    }

    /// Computes `pass` of operands `a`, `b` into `out` (dense row-major, of the dims
    /// [`Depthwise::of`] was given).
    pub(crate) fn run<T: Real>(&self, pass: Pass, a: &[T], b: &[T], out: &mut [T]) {
        let planes = Layout::new(self);
        match pass {
            Pass::Forward => forward(self, &planes, a, b, out),
            Pass::InputGradient => input_gradient(self, &planes, a, b, out),
            Pass::WeightGradient => weight_gradient(self, &planes, a, b, out),
        }
    }
}

/// Lanes of the inner loops (one AVX register of f32).
const LANES: usize = 8;
/// Results computed together (four registers).
const BLOCK: usize = 4 * LANES;
/// About how many elements the phases of a group of channels hold (within L2).
const GROUP_ELEMENTS: usize = 1 << 14;

/// The layout of a group of channels of every image, zero-padded and split into phases,
/// and where each tap reads in it.
struct Layout {
    /// Columns of a phase row.
    wq: usize,
    /// Elements of one image's part of a phase (`hq · wq`).
    img: usize,
    /// Elements of one channel's part of a phase (every image's, rounded up to a block).
    span: usize,
    /// Channels in a group.
    group: usize,
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

impl Layout {
    fn new(d: &Depthwise) -> Layout {
        let [s0, s1] = d.stride;
        // The padded plane: every row and column some output reads (from −p).
        let (hp, wp) = ((d.oh.max(1) - 1) * s0 + d.kh, (d.ow.max(1) - 1) * s1 + d.kw);
        let (hq, wq) = (hp.div_ceil(s0), wp.div_ceil(s1));
        let img = hq * wq;
        let span = (d.n * img).div_ceil(BLOCK) * BLOCK;
        let group = (GROUP_ELEMENTS / (span * s0 * s1)).clamp(1, d.c.max(1));
        let phase = group * span + ((d.kh - 1) / s0 + 1) * wq + BLOCK;
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
            group,
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
    fn len(&self, d: &Depthwise) -> usize {
        self.phase * d.stride[0] * d.stride[1]
    }

    /// The groups of channels: `(first channel, channels)`.
    fn groups(&self, c: usize) -> impl Iterator<Item = (usize, usize)> {
        let g = self.group;
        (0..c).step_by(g).map(move |c0| (c0, g.min(c - c0)))
    }

    /// Copies channels `c0..c0 + g` of every image of `x` (`[n, c, h, w]`) into the
    /// phases `buf`, writing only the input elements' places (the rest stays zero).
    fn fill<T: Real>(&self, d: &Depthwise, x: &[T], (c0, g): (usize, usize), buf: &mut [T]) {
        if let Some(map) = &self.small_input {
            self.each_plane(d, d.h * d.w, (c0, g), |plane, base| {
                let (src, dst) = (&x[plane..][..d.h * d.w], &mut buf[base..]);
                for &(e, at) in map {
                    dst[at] = src[e];
                }
            });
            return;
        }
        self.each_row(d, (c0, g), |i, base, at| {
            let src = &x[base + i * d.w..][self.cols.clone()];
            self.put(src, &mut buf[at..]);
        });
    }

    /// Copies the phases `buf` out into channels `c0..c0 + g` of `x` (zero where no tap
    /// reads).
    fn gather<T: Real>(&self, d: &Depthwise, buf: &[T], (c0, g): (usize, usize), x: &mut [T]) {
        let hw = d.h * d.w;
        if let Some(map) = &self.small_input {
            self.each_plane(d, hw, (c0, g), |plane, base| {
                let (src, dst) = (&buf[base..], &mut x[plane..][..hw]);
                dst.fill(T::default());
                for &(e, at) in map {
                    dst[e] = src[at];
                }
            });
            return;
        }
        self.each_plane(d, hw, (c0, g), |plane, _| {
            x[plane..][..hw].fill(T::default())
        });
        self.each_row(d, (c0, g), |i, base, at| {
            let dst = &mut x[base + i * d.w..][self.cols.clone()];
            self.take(&buf[at..], dst);
        });
    }

    /// Calls `f(plane start, its place)` for channels `c0..c0 + g` of every image, planes of
    /// `len` elements.
    fn each_plane(
        &self,
        d: &Depthwise,
        len: usize,
        (c0, g): (usize, usize),
        mut f: impl FnMut(usize, usize),
    ) {
        for n in 0..d.n {
            for ci in 0..g {
                f((n * d.c + c0 + ci) * len, ci * self.span + n * self.img);
            }
        }
    }

    /// Calls `f(row, plane start, place of the row's column −p₁)` for every input
    /// row of channels `c0..c0 + g` of every image that some tap reads.
    fn each_row(
        &self,
        d: &Depthwise,
        (c0, g): (usize, usize),
        mut f: impl FnMut(usize, usize, usize),
    ) {
        if self.cols.is_empty() {
            return;
        }
        self.each_plane(d, d.h * d.w, (c0, g), |plane, base| {
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

    /// Copies channels `c0..c0 + g` of a result `y` (`[n, c, oh, ow]`) into the wide
    /// layout, from `wide`'s start (only the result elements' places are written).
    fn widen<T: Real>(&self, d: &Depthwise, y: &[T], (c0, g): (usize, usize), wide: &mut [T]) {
        let ohw = d.oh * d.ow;
        if let Some(map) = &self.small_result {
            self.each_plane(d, ohw, (c0, g), |plane, base| {
                let (src, dst) = (&y[plane..][..ohw], &mut wide[base..]);
                for &(e, at) in map {
                    dst[at] = src[e];
                }
            });
            return;
        }
        self.each_plane(d, ohw, (c0, g), |plane, base| {
            let rows = wide[base..].chunks_mut(self.wq);
            for (src, dst) in y[plane..][..ohw].chunks_exact(d.ow).zip(rows) {
                copy(&mut dst[..d.ow], src);
            }
        });
    }

    /// The reverse of [`Layout::widen`].
    fn narrow<T: Real>(&self, d: &Depthwise, wide: &[T], (c0, g): (usize, usize), y: &mut [T]) {
        let ohw = d.oh * d.ow;
        if let Some(map) = &self.small_result {
            self.each_plane(d, ohw, (c0, g), |plane, base| {
                let (src, dst) = (&wide[base..], &mut y[plane..][..ohw]);
                for &(e, at) in map {
                    dst[e] = src[at];
                }
            });
            return;
        }
        self.each_plane(d, ohw, (c0, g), |plane, base| {
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

fn forward<T: Real>(d: &Depthwise, l: &Layout, x: &[T], k: &[T], y: &mut [T]) {
    let khw = d.kh * d.kw;
    let mut buf = vec![T::default(); l.len(d)];
    let mut wide = vec![T::default(); l.group * l.span];
    for (c0, g) in l.groups(d.c) {
        l.fill(d, x, (c0, g), &mut buf);
        let w = &k[c0 * khw..][..g * khw];
        correlate(&buf, &l.taps, w, l.span, &mut wide[..g * l.span]);
        l.narrow(d, &wide, (c0, g), y);
    }
}

fn input_gradient<T: Real>(d: &Depthwise, l: &Layout, dy: &[T], k: &[T], dx: &mut [T]) {
    let khw = d.kh * d.kw;
    let [s0, s1] = d.stride;
    // dx's phase φ at m: Σ over φ's taps t of w[t] · dy's wide layout at m − off[t], read
    // from a copy shifted by the largest offset (`margin`) as a correlation.
    let off = |t: usize| l.taps[t] % l.phase;
    let margin = (0..khw).map(off).max().unwrap_or(0);
    let mut wide = vec![T::default(); margin + l.group * l.span + BLOCK];
    let mut buf = vec![T::default(); l.len(d)];
    let phases: Vec<(Vec<usize>, Vec<usize>)> = (0..s0 * s1)
        .map(|p| {
            (0..khw)
                .filter(|&t| l.taps[t] / l.phase == p)
                .map(|t| (t, margin - off(t)))
                .unzip()
        })
        .collect();
    let mut w = vec![T::default(); l.group * khw];
    for (c0, g) in l.groups(d.c) {
        l.widen(d, dy, (c0, g), &mut wide[margin..]);
        for (p, (ts, taps)) in phases.iter().enumerate() {
            let kt = ts.len();
            for ci in 0..g {
                for (j, &t) in ts.iter().enumerate() {
                    w[ci * kt + j] = k[(c0 + ci) * khw + t];
                }
            }
            let out = &mut buf[p * l.phase..][..g * l.span];
            correlate(&wide, taps, &w[..g * kt], l.span, out);
        }
        l.gather(d, &buf, (c0, g), dx);
    }
}

fn weight_gradient<T: Real>(d: &Depthwise, l: &Layout, x: &[T], dy: &[T], dk: &mut [T]) {
    let khw = d.kh * d.kw;
    let mut buf = vec![T::default(); l.len(d)];
    let mut wide = vec![T::default(); l.group * l.span];
    for (c0, g) in l.groups(d.c) {
        l.fill(d, x, (c0, g), &mut buf);
        l.widen(d, dy, (c0, g), &mut wide);
        dots(
            &wide[..g * l.span],
            &buf,
            &l.taps,
            l.span,
            &mut dk[c0 * khw..][..g * khw],
        );
    }
}

/// For each channel `ci` (a `span` of `out`): `out[i] = Σ_t w[ci][t] · buf[taps[t] + i]`.
#[multiversion(targets("x86_64+avx2+fma"))]
fn correlate<T: Real>(buf: &[T], taps: &[usize], w: &[T], span: usize, out: &mut [T]) {
    let k = taps.len();
    if k == 0 {
        out.fill(T::default());
        return;
    }
    for (ci, (o, w)) in out
        .chunks_exact_mut(span)
        .zip(w.chunks_exact(k))
        .enumerate()
    {
        let buf = &buf[ci * span..];
        match k {
            9 => correlate_k::<T, 9>(buf, taps, w, o),
            25 => correlate_k::<T, 25>(buf, taps, w, o),
            _ => {
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
        }
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

/// For each channel `ci` (a `span` of `a`) and tap `t`: `out[ci][t] = Σ_i a[i] · b[taps[t] +
/// i]`, summed in f64 over blocks.
#[multiversion(targets("x86_64+avx2+fma"))]
fn dots<T: Real>(a: &[T], b: &[T], taps: &[usize], span: usize, out: &mut [T]) {
    let k = taps.len();
    for (ci, (a, o)) in a
        .chunks_exact(span)
        .zip(out.chunks_exact_mut(k))
        .enumerate()
    {
        let b = &b[ci * span..];
        match k {
            9 => dots_k::<T, 9>(a, b, taps, o),
            _ => dots_n(a, b, taps, o),
        }
    }
}

/// [`dots`] of one channel, for any number of taps.
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

    /// A forward depthwise convolution: input dims, kernel size, strides, padding.
    type Case = ([i64; 4], [i64; 2], [usize; 2], [(i64, i64); 2]);

    fn cases() -> Vec<Case> {
        vec![
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
            // More channels than one group of the layout holds (several groups).
            ([2, 40, 12, 12], [3, 3], [1, 1], [(1, 1), (1, 1)]),
            ([3, 45, 13, 12], [3, 3], [2, 2], [(1, 1), (1, 1)]),
        ]
    }

    /// The passes of one case as kiln's autograd gives them to the kernel: (form,
    /// attributes, operands).
    fn calls(i: usize, (xd, ks, st, pad): &Case) -> Vec<(ConvForm, ConvAttrs, Tensor, Tensor)> {
        let mut c = ConvAttrs::plain(2);
        c.strides = st.to_vec();
        c.padding = pad.to_vec();
        c.feature_groups = xd[1] as usize;
        let kd = [xd[1], 1, ks[0], ks[1]];
        let od = conv_out_dims(&c, xd, &kd).unwrap();
        let (x, k, dy) = (
            seeded(xd, i as i64),
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

    /// Every pass against libtorch's (the kernel's own `conv_form`) in float64, and in
    /// float32 against the float64 result within float32's rounding of a sum of that many
    /// products (`γₙ` of the sum of |products|, from the same convolution of |operands|).
    #[test]
    fn every_pass_matches_libtorch_in_f64_and_f32() {
        for (i, case) in cases().iter().enumerate() {
            for (form, attrs, a, b) in calls(i, case) {
                let want = conv_form(&attrs, &a, &b, form).unwrap().contiguous();
                let od = want.size();
                let what = format!("case {i} {case:?} {form:?}");
                let (d, pass) =
                    Depthwise::of(&attrs, &a.size(), &b.size(), &od, form).expect(&what);
                let numel = want.numel();
                let mut got = vec![0f64; numel];
                d.run(pass, &values::<f64>(&a), &values::<f64>(&b), &mut got);
                let want64 = values::<f64>(&want);
                for (j, (g, w)) in got.iter().zip(&want64).enumerate() {
                    assert!((g - w).abs() <= 1e-12, "{what} f64 [{j}]: {g} vs {w}");
                }
                let bound = values::<f64>(&conv_form(&attrs, &a.abs(), &b.abs(), form).unwrap());
                let terms = match pass {
                    Pass::WeightGradient => (d.n * d.oh * d.ow) as f64,
                    _ => (d.kh * d.kw) as f64,
                };
                let (a32, b32) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
                let mut got32 = vec![0f32; numel];
                d.run(pass, &values::<f32>(&a32), &values::<f32>(&b32), &mut got32);
                for (j, ((g, w), b)) in got32.iter().zip(&want64).zip(&bound).enumerate() {
                    let tol = (terms + 2.0) * f32::EPSILON as f64 * b;
                    assert!(
                        (*g as f64 - w).abs() <= tol,
                        "{what} f32 [{j}]: {g} vs {w} (tol {tol})"
                    );
                }
            }
        }
    }

    #[test]
    fn takes_only_depthwise_two_d_calls_without_kernel_dilation() {
        let mut c = ConvAttrs::plain(2);
        c.feature_groups = 4;
        let (x, k, o) = ([2, 4, 5, 5], [4, 1, 3, 3], [2, 4, 3, 3]);
        assert_eq!(
            Depthwise::of(&c, &x, &k, &o, ConvForm::Plain).map(|d| d.1),
            Some(Pass::Forward)
        );
        // Kernel dilation, batch groups, two channels per group, a channel multiplier.
        let mut d = c.clone();
        d.rhs_dilation = vec![2, 2];
        assert!(Depthwise::of(&d, &x, &k, &o, ConvForm::Plain).is_none());
        let mut b = c.clone();
        b.batch_groups = 2;
        assert!(Depthwise::of(&b, &x, &k, &o, ConvForm::Plain).is_none());
        let mut g = c.clone();
        g.feature_groups = 2;
        assert!(Depthwise::of(&g, &x, &[4, 2, 3, 3], &o, ConvForm::Plain).is_none());
        assert!(Depthwise::of(&c, &x, &[8, 1, 3, 3], &[2, 8, 3, 3], ConvForm::Plain).is_none());
        // An input-dilated forward convolution; 1-d.
        let mut l = c.clone();
        l.lhs_dilation = vec![2, 2];
        assert!(Depthwise::of(&l, &x, &k, &o, ConvForm::Plain).is_none());
        let c1 = ConvAttrs {
            feature_groups: 4,
            ..ConvAttrs::plain(1)
        };
        assert!(Depthwise::of(&c1, &[2, 4, 5], &[4, 1, 3], &[2, 4, 3], ConvForm::Plain).is_none());
        // Empty arrays.
        assert!(Depthwise::of(&c, &[0, 4, 5, 5], &k, &[0, 4, 3, 3], ConvForm::Plain).is_none());
        assert!(Depthwise::of(&c, &x, &[4, 1, 0, 3], &[2, 4, 6, 3], ConvForm::Plain).is_none());
        // The weight gradient of a convolution with kernel dilation (window strides > 1).
        let mut w = c.clone();
        w.strides = vec![2, 2];
        assert!(Depthwise::of(
            &w,
            &x,
            &[2, 4, 3, 3],
            &[1, 4, 2, 2],
            ConvForm::WeightGradient
        )
        .is_none());
    }
}
