//! How the XLA backend lowers convolutions: a per-node choice between StableHLO's
//! `convolution` and an im2col expansion into pad + strided slices + concat + one `dot_general`.
//!
//! XLA:CPU's own convolution kernels are fast for few channels but 1.5–9× slower than
//! libtorch (oneDNN) at 128–512 channels on small images; the same convolution written as one
//! matrix product over gathered patches runs through XLA's matmul path, which is on par with
//! libtorch. [`ConvStrategy`] decides per `Op::Conv` node, from its attributes and operand
//! types, which [`ConvLowering`] the backend emits; [`ConvStrategy::Auto`] is the measured
//! default (see [`ConvStrategy::auto_rule`]).
//!
//! [`im2col`] builds the expansion as ordinary graph ops, so it can also be run on any other
//! backend (the tests compare it with the direct convolution on the eager backend and on XLA).

use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DotDims, Graph, NodeId, Op, Shape, TensorType};
use std::fmt;

/// The two ways to lower one convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvLowering {
    /// One `stablehlo.convolution` (XLA's convolution emitter).
    Direct,
    /// Patches gathered with strided slices and concatenated, then one `dot_general`
    /// (see [`im2col`]).
    Im2col,
}

/// A user-supplied rule: given a convolution's attributes, its input type `[N, C, *spatial]`
/// and kernel type `[O, C/groups, *k]`, which lowering to emit.
pub type ConvRule = fn(&ConvAttrs, &TensorType, &TensorType) -> ConvLowering;

/// Chooses the lowering of each convolution node; part of
/// [`XlaOptions`](super::XlaOptions) and so of the backend's cache key.
#[derive(Clone, Default)]
pub enum ConvStrategy {
    /// Always `stablehlo.convolution` (kiln's lowering before 0.1 performance work).
    Direct,
    /// Always im2col.
    Im2col,
    /// The measured default rule, [`ConvStrategy::auto_rule`].
    #[default]
    Auto,
    /// A custom rule. `name` identifies it in the backend's cache key: give different rules
    /// different names.
    Custom {
        /// Stable name of the rule (part of the compile-cache key).
        name: String,
        /// The rule.
        rule: ConvRule,
    },
}

impl fmt::Debug for ConvStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key())
    }
}

impl ConvStrategy {
    /// The lowering of one convolution with attributes `c`, input type `x` and kernel type `k`.
    pub fn choose(&self, c: &ConvAttrs, x: &TensorType, k: &TensorType) -> ConvLowering {
        match self {
            ConvStrategy::Direct => ConvLowering::Direct,
            ConvStrategy::Im2col => ConvLowering::Im2col,
            ConvStrategy::Auto => Self::auto_rule(c, x, k),
            ConvStrategy::Custom { rule, .. } => rule(c, x, k),
        }
    }

    /// A short stable text naming the strategy (used in cache keys).
    pub fn key(&self) -> String {
        match self {
            ConvStrategy::Direct => "direct".into(),
            ConvStrategy::Im2col => "im2col".into(),
            ConvStrategy::Auto => "auto2".into(),
            ConvStrategy::Custom { name, .. } => format!("custom:{name}"),
        }
    }

    /// The default rule, derived from timing every convolution of resnet18's training step
    /// (forward, input-gradient and weight-gradient convolutions, batch 4 at 64×64) alone on
    /// the CPU plugin, both ways (`examples/conv_profile.rs`):
    ///
    /// **im2col when the convolution has one feature group, at least
    /// [`AUTO_MIN_CHANNELS`] (64) input channels, and every spatial extent of its padded (and
    /// input-dilated) input is at most [`AUTO_MAX_EXTENT`] (6), or
    /// [`AUTO_MAX_EXTENT_1X1`] (16) for a 1×1 kernel**; else direct.
    ///
    /// Measured (ms per call, direct → im2col): 3×3 512→512 on 2×2 41 → 0.75; 3×3 256→256 on
    /// 4×4 1.23 → 0.94; 3×3 stride 2 256→512 1.67 → 0.42; the input gradient of the stride-2
    /// 512 layer 10.2 → 1.9; 1×1 stride-2 downsamples 1.3–2× faster. Direct stays better for
    /// 3×3 at 8×8 and larger (128→128: 0.66 vs 1.08; 64→64 on 16×16: 0.70 vs 1.52), for the
    /// input gradients of strided 3×3 layers at 4×4 and up (input dilation 2 makes 3/4 of
    /// the patches zeros: 0.78 vs 1.79), and for weight-gradient convolutions, whose
    /// contraction runs over the batch (4 "channels"; 0.87 vs 2.03 for the 64-channel layer).
    /// Grouped and depthwise convolutions stay direct: their per-group products are tiny.
    pub fn auto_rule(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> ConvLowering {
        if c.feature_groups != 1 || x.shape.dim(1) < AUTO_MIN_CHANNELS {
            return ConvLowering::Direct;
        }
        let one_by_one = k.shape.dims()[2..].iter().all(|&d| d == 1);
        let max = if one_by_one {
            AUTO_MAX_EXTENT_1X1
        } else {
            AUTO_MAX_EXTENT
        };
        let small = x.shape.dims()[2..].iter().enumerate().all(|(i, &s)| {
            let dilated = if s == 0 {
                0
            } else {
                (s as i64 - 1) * c.lhs_dilation[i] as i64 + 1
            };
            dilated + c.padding[i].0 + c.padding[i].1 <= max
        });
        if small {
            ConvLowering::Im2col
        } else {
            ConvLowering::Direct
        }
    }
}

/// The fewest input channels [`ConvStrategy::auto_rule`] lowers as im2col.
pub const AUTO_MIN_CHANNELS: usize = 64;
/// The largest padded spatial extent [`ConvStrategy::auto_rule`] lowers as im2col.
pub const AUTO_MAX_EXTENT: i64 = 6;
/// The largest padded spatial extent [`ConvStrategy::auto_rule`] lowers as im2col for a 1×1
/// kernel (a plain matrix product).
pub const AUTO_MAX_EXTENT_1X1: i64 = 16;

fn reshape(g: &mut Graph, x: NodeId, dims: &[usize]) -> Result<NodeId> {
    g.add(Op::Reshape(Shape::new(dims)), &[x])
}

/// Adds to `g` the im2col expansion of `Op::Conv(c)` on input `x` `[N, C, *spatial]` and
/// kernel `w` `[O, C/groups, *k]`, and returns the node holding the result, of exactly the
/// type `Op::Conv(c)` would have.
///
/// The expansion, for `n` spatial dims, `T = prod(k)` kernel taps and `Y` output positions:
///
/// 1. the input goes channels-first, `[C, N, *spatial]`, and is padded (edges, possibly
///    negative, and interior zeros for `lhs_dilation`);
/// 2. patches `[C, T, N, Y]` are cut out with strided slices and concatenated: one slice per
///    kernel tap (each covers every output position) or one per output position (each covers
///    the whole window), whichever are fewer (the weight gradient's convolution has a large
///    "kernel" and few outputs);
/// 3. one `dot_general` multiplies the kernel as it lies in memory, `[O, C * T]`, with the
///    patches `[C * T, N * Y]` (no copy of the kernel; feature groups and batch groups become
///    a batch dimension of the product);
/// 4. the result `[O, N, Y]` goes back to `[N, O, *Y]`.
pub fn im2col(g: &mut Graph, c: &ConvAttrs, x: NodeId, w: NodeId) -> Result<NodeId> {
    let xt = g.node(x).ty.clone();
    let wt = g.node(w).ty.clone();
    let out_ty = {
        // Type check up front, so errors name the convolution.
        let mut probe = Graph::new();
        let a = probe.add_input(crate::ir::InputKind::Data, "x", xt.clone());
        let b = probe.add_input(crate::ir::InputKind::Data, "w", wt.clone());
        let r = probe.add(Op::Conv(c.clone()), &[a, b])?;
        probe.node(r).ty.clone()
    };
    let n = c.strides.len();
    let xd = xt.shape.dims().to_vec();
    let wd = wt.shape.dims().to_vec();
    let (batch, cin) = (xd[0], xd[1]);
    let (cout, cin_g) = (wd[0], wd[1]);
    let ksp: Vec<usize> = wd[2..].to_vec();
    let ysp: Vec<usize> = out_ty.shape.dims()[2..].to_vec();
    let taps: usize = ksp.iter().product();
    let npos: usize = ysp.iter().product();
    let (fg, bg) = (c.feature_groups, c.batch_groups);
    if fg > 1 && bg > 1 {
        return Err(Error::Invalid(
            "im2col: feature and batch groups both > 1".into(),
        ));
    }

    // 1. Channels first, padded: [C, N, *P].
    let mut perm = vec![1, 0];
    perm.extend(2..n + 2);
    let mut xc = g.add(Op::Transpose(perm), &[x])?;
    let needs_pad =
        c.lhs_dilation.iter().any(|&d| d > 1) || c.padding.iter().any(|&(l, h)| l != 0 || h != 0);
    if needs_pad {
        let zero = g.add(Op::Constant(crate::ir::Literal::scalar(xt.dtype, 0.0)), &[])?;
        let mut low = vec![0i64, 0];
        let mut high = vec![0i64, 0];
        let mut interior = vec![0usize, 0];
        for i in 0..n {
            low.push(c.padding[i].0);
            high.push(c.padding[i].1);
            interior.push(c.lhs_dilation[i] - 1);
        }
        xc = g.add(
            Op::Pad {
                low,
                high,
                interior,
            },
            &[xc, zero],
        )?;
    }
    let pd = g.node(xc).ty.shape.dims().to_vec();

    // 2. Patches [C, T, N, Y].
    let slice = |g: &mut Graph, start: Vec<usize>, limit: Vec<usize>, stride: Vec<usize>| {
        let mut st = vec![0, 0];
        st.extend(start);
        let mut li = vec![cin, batch];
        li.extend(limit);
        let mut sd = vec![1, 1];
        sd.extend(stride);
        g.add(
            Op::Slice {
                start: st,
                limit: li,
                stride: sd,
            },
            &[xc],
        )
    };
    let patches = if taps == 1 && (0..n).all(|i| ysp[i] == pd[i + 2]) {
        // 1x1 kernel, stride 1, nothing cropped: the padded input is the patch tensor.
        xc
    } else if taps <= npos {
        let mut parts = Vec::with_capacity(taps);
        for t in 0..taps {
            let tap = unravel(t, &ksp);
            let start: Vec<usize> = (0..n).map(|i| tap[i] * c.rhs_dilation[i]).collect();
            let limit: Vec<usize> = (0..n)
                .map(|i| start[i] + (ysp[i] - 1) * c.strides[i] + 1)
                .collect();
            let s = slice(g, start, limit, c.strides.clone())?;
            parts.push(reshape(g, s, &[cin, 1, batch * npos])?);
        }
        if parts.len() == 1 {
            parts[0]
        } else {
            g.add(Op::Concat { axis: 1 }, &parts)?
        }
    } else {
        let mut parts = Vec::with_capacity(npos);
        let mut to_last = vec![0];
        to_last.extend(2..n + 2);
        to_last.push(1);
        for p in 0..npos {
            let pos = unravel(p, &ysp);
            let start: Vec<usize> = (0..n).map(|i| pos[i] * c.strides[i]).collect();
            let limit: Vec<usize> = (0..n)
                .map(|i| start[i] + (ksp[i] - 1) * c.rhs_dilation[i] + 1)
                .collect();
            // [C, N, *k] -> [C, *k, N] -> [C, T, N, 1]
            let s = slice(g, start, limit, c.rhs_dilation.clone())?;
            let s = g.add(Op::Transpose(to_last.clone()), &[s])?;
            parts.push(reshape(g, s, &[cin, taps, batch, 1])?);
        }
        if parts.len() == 1 {
            parts[0]
        } else {
            g.add(Op::Concat { axis: 3 }, &parts)?
        }
    };

    // 3. The product, 4. back to [N, O, *Y].
    let mut out_dims = vec![batch / bg, cout];
    out_dims.extend_from_slice(&ysp);
    if fg == 1 && bg == 1 {
        // [O, C * T] x [C * T, N * Y]: a plain matrix product.
        let lhs = reshape(g, w, &[cout, cin * taps])?;
        let rhs = reshape(g, patches, &[cin * taps, batch * npos])?;
        let dims = DotDims {
            lhs_contract: vec![1],
            rhs_contract: vec![0],
            ..Default::default()
        };
        let y = g.add(Op::DotGeneral(dims), &[lhs, rhs])?;
        let y = reshape(g, y, &[cout, batch, npos])?;
        let y = g.add(Op::Transpose(vec![1, 0, 2]), &[y])?;
        return reshape(g, y, &out_dims);
    }
    // Groups: G blocks of the product. Feature groups split the channels, batch groups split
    // the batch; both split the kernel's output features.
    let groups = fg.max(bg);
    let og = cout / groups;
    // Kernel [G, O/G, C/G, T].
    let lhs = reshape(g, w, &[groups, og, cin_g, taps])?;
    let (rhs, dims) = if fg > 1 {
        // [G, C/G, T, N, Y]
        let rhs = reshape(g, patches, &[fg, cin_g, taps, batch, npos])?;
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![0],
            lhs_contract: vec![2, 3],
            rhs_contract: vec![1, 2],
        };
        (rhs, dims)
    } else {
        // [C, T, G, N/G, Y]
        let rhs = reshape(g, patches, &[cin, taps, bg, batch / bg, npos])?;
        let dims = DotDims {
            lhs_batch: vec![0],
            rhs_batch: vec![2],
            lhs_contract: vec![2, 3],
            rhs_contract: vec![0, 1],
        };
        (rhs, dims)
    };
    // [G, O/G, N', Y] -> [N', G, O/G, Y] -> [N', O, *Y].
    let y = g.add(Op::DotGeneral(dims), &[lhs, rhs])?;
    let y = g.add(Op::Transpose(vec![2, 0, 1, 3]), &[y])?;
    reshape(g, y, &out_dims)
}

/// Row-major multi-index of the flat index `i` in `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for d in (0..dims.len()).rev() {
        idx[d] = i % dims[d];
        i /= dims[d];
    }
    idx
}

/// A graph of one convolution lowered as im2col: inputs `x`, `w`; one output. For tests and
/// measurements.
pub fn im2col_graph(c: &ConvAttrs, x: &TensorType, w: &TensorType) -> Result<Graph> {
    let mut g = Graph::new();
    let a = g.add_input(crate::ir::InputKind::Data, "x", x.clone());
    let b = g.add_input(crate::ir::InputKind::Data, "w", w.clone());
    let y = im2col(&mut g, c, a, b)?;
    g.set_outputs(vec![y])?;
    Ok(g)
}
