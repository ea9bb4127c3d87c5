//! How the XLA backend lowers convolutions: a per-node choice between StableHLO's
//! `convolution` and the im2col expansion ([`crate::passes::im2col()`]: pad + strided slices +
//! concat + one `dot_general`).
//!
//! XLA:CPU's own convolution kernels are fast for few channels but 1.5–9× slower than
//! libtorch (oneDNN) at 128–512 channels on small images; the same convolution written as one
//! matrix product over gathered patches runs through XLA's matmul path, which is on par with
//! libtorch. [`ConvStrategy`] decides per `Op::Conv` node, from its attributes and operand
//! types, which [`ConvLowering`] it gets; [`ConvStrategy::Auto`] is the measured default (see
//! [`ConvStrategy::auto_rule`]; with autotune on, [`super::autotune`] times both instead).
//! The backend applies the choice as a graph rewrite
//! ([`Backend::rewrite`](crate::backend::Backend::rewrite) with
//! [`im2col_nodes`](crate::passes::im2col_nodes)) before the graph is fingerprinted and
//! compiled; the emitter writes every convolution left in the graph as one
//! `stablehlo.convolution`, or as a call to kiln's libtorch kernel where
//! [`FfiMode`](super::FfiMode) (or autotune) picks it (those are never rewritten to im2col).

use crate::ir::{ConvAttrs, TensorType};
use crate::passes::is_full_window;
use std::fmt;

/// The two ways to lower one convolution.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConvLowering {
    /// One `stablehlo.convolution` (XLA's convolution emitter).
    Direct,
    /// Patches gathered with strided slices and concatenated, then one `dot_general`
    /// (see [`crate::passes::im2col()`]).
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
            ConvStrategy::Auto => "auto3".into(),
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
    ///
    /// **Full-window convolutions** ([`is_full_window`]: one output position, the window the
    /// whole input; autograd's weight gradients of 1×1 stride-1 convolutions) are always
    /// im2col, whose expansion of them is a single product on the operands as they lie
    /// (measured alone on a 2-vCPU Zen 3: mobilenet_v2's 34 such weight gradients took
    /// 21.3 ms as convolutions, 15.2 ms as products).
    pub fn auto_rule(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> ConvLowering {
        if is_full_window(c, x, k) {
            return ConvLowering::Im2col;
        }
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
