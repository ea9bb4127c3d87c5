//! libtorch kernels inside XLA executables: convolutions and matrix products lowered to
//! `stablehlo.custom_call`s that XLA runs through kiln's FFI handlers (registered with the
//! plugin's PJRT FFI extension by the crate-internal `pjrt::ffi` module), on XLA's own
//! buffers, while everything around them (elementwise ops, reductions, normalisation) stays
//! in XLA and is fused there.
//!
//! Why: on the CPU plugin (xla-cpu-pjrt 0.0.1) XLA's convolution emitter is several times
//! slower than libtorch (oneDNN) for grouped and depthwise convolutions and for 3×3 layers at
//! 128–512 channels on small images, and its dot is ~7× slower than MKL for a torch `Linear`
//! weight layout (`x[N, in] · W[out, in]ᵀ`). Which nodes go to libtorch is [`FfiMode`]'s
//! choice ([`FfiMode::auto_conv`] / [`FfiMode::auto_dot`] by default) or, with autotune on,
//! the measured one ([`super::autotune`], through [`FfiSelect`]), and how each is lowered is
//! [`ffi_lowering`]'s.
//!
//! Two custom call targets, both taking f32 or f64 buffers:
//!
//! - [`CONV_TARGET`]: `Op::Conv` with kiln's semantics (input `[N, C, *sp]`, kernel
//!   `[O, C/g, *k]`, output `[N, O, *sp']`; strides, possibly asymmetric or negative padding,
//!   input and kernel dilation, feature and batch groups), attributes `strides`, `padding`
//!   (flattened `(low, high)` pairs), `lhs_dilation`, `rhs_dilation` (`array<i64>`),
//!   `feature_groups`, `batch_groups` and `form` (`i64`, a [`ConvForm`]). Forward
//!   convolutions (grouped and depthwise included) run as one `at::convolution`;
//!   input-dilated ones as a transposed convolution; what fits neither is padded and dilated
//!   explicitly first. The gradients kiln's autograd builds are recognized in the graph and
//!   read their sources directly: an input gradient the forward weight (no reversed copy),
//!   a weight gradient the forward input and the cotangent (no transposed copies), writing
//!   the weight gradient in the weight's layout.
//! - [`DOT_TARGET`]: `Op::DotGeneral`, attribute `dims = array<i64: nb, nc, lhs_batch...,
//!   rhs_batch..., lhs_contract..., rhs_contract...>`: operands are viewed (no copy where
//!   strides allow) as `[B, M, K]` and `[B, K, N]` and multiplied by `mm`/`bmm` straight into
//!   the result buffer.
//!
//! Threads: XLA calls handlers from its worker threads, possibly several at once. A handler
//! hands its kernel body to the thread waiting for the execution's results, which runs it
//! with its own libtorch threads (no OpenMP team per XLA worker: see the `threads` notes);
//! with nobody waiting, the body runs on the worker with one libtorch thread. Kernel bodies
//! run one at a time under a process-wide lock (each libtorch kernel already spreads over all
//! cores with OpenMP; two at once would oversubscribe them), with libtorch's default thread
//! count unless [`set_threads`] says otherwise — see [`torch_lock`].
//!
//! Three more are not libtorch's but kiln's own, plain Rust where XLA's code is slow:
//! [`TRANSPOSE_TARGET`], the block transpose of a product's operand that XLA would otherwise
//! copy into its canonical layout with a strided loop that is ~10× slow on rows of 4 KiB (the
//! `transpose` module), [`COLUMN_SUM_TARGET`], a sum over leading dims (a training
//! step's bias gradients), which XLA computes as a tree of windowed reductions (the `colsum`
//! module), and [`SELECT_SCATTER_TARGET`], max pooling's gradient, which the lowering
//! otherwise spells out as a variadic `reduce_window` and a scatter (the `select_scatter`
//! module).
//!
//! Besides these, fused kernels stand for several nodes each: packed convolutions and linears
//! on frozen weights with their epilogues (the `packed` and `packed_linear` modules) and
//! scaled dot-product attention in inference graphs ([`ATTENTION_TARGET`], the `attention`
//! module), which reads its operands and writes its result through strided views of other
//! nodes' buffers where the graph only moves data in between (the `view` module).
//!
//! A plugin without the FFI extension, or not a CPU plugin, gets pure XLA lowering (see
//! `XlaBackend::ffi_status`).

mod after;
mod attention;
mod colsum;
mod conv;
mod dot;
mod grouped;
mod mlir;
pub(crate) mod onednn;
mod packed;
mod packed_linear;
mod select_scatter;
mod selftest;
mod threads;
mod transpose;
mod view;
pub(crate) mod weights;

pub use conv::{
    conv, conv_form, conv_out_dims, effective_dims, effective_kernel_dims, weight_gradient_direct,
};
pub use dot::{DotPlan, TinyDot, TINY_DOT_MAX_FLOPS};
pub use grouped::{own_grouped_conv, set_own_grouped_conv};
pub use mlir::{
    conv_call_attrs, conv_call_attrs_form, conv_call_mlir, dot_call_attrs, dot_call_mlir,
};
pub(crate) use mlir::{custom_call_attrs, mark_serial};
pub use onednn::avx512 as onednn_avx512;
pub use packed::{packed_conv_enabled, PACKED_CONV_TARGET};
pub use packed_linear::PACKED_LINEAR_TARGET;
pub use threads::{
    handoff, idle_pause, local_max_flops, process_cpus, reset_stats, serialized, set_handoff,
    set_idle_pause, set_local_max_flops, set_serialized, set_spin_throttle, set_threads,
    spin_throttle, stats, threads, torch_lock, IdlePause, KernelGuard, KernelStats,
};
pub use transpose::{
    dot_operand_transposes, DotOperandTransposes, OperandTranspose, MIN_TRANSPOSE_BYTES,
};
pub use weights::{clear_weight_cache, weight_cache_stats, WeightCacheStats};

pub(crate) use after::AfterKernel;
pub use after::AFTER_TARGET;
pub(crate) use attention::AttentionKernel;
pub use attention::ATTENTION_TARGET;
pub(crate) use colsum::{column_sum_lead, ColumnSumKernel};
pub(crate) use conv::ConvKernel;
pub(crate) use dot::DotKernel;
pub(crate) use packed::{packed_conv, PackedConvKernel};
pub(crate) use packed_linear::{packed_linear, PackedLinearKernel};
pub(crate) use select_scatter::{runs_select_scatter, select_scatter_config, SelectScatterKernel};
pub(crate) use selftest::enable;
pub(crate) use transpose::{dot_operand_transposes_in, TransposeKernel};

#[cfg(test)]
use conv::transposed_weight;
#[cfg(test)]
use dot::dot_dims_of;

use crate::ir::{ConvAttrs, DType, DotDims, Graph, NodeId, Op, TensorType};
use std::collections::HashSet;

/// The custom call target of kiln's convolution kernel.
pub const CONV_TARGET: &str = "kiln_conv_v1";
/// The custom call target of kiln's dot kernel.
pub const DOT_TARGET: &str = "kiln_dot_v1";
/// The custom call target of kiln's block transpose of a product's operand (the
/// `transpose` module; [`dot_operand_transposes`]).
pub const TRANSPOSE_TARGET: &str = "kiln_transpose_v1";
/// The custom call target of kiln's sum over leading dims (the `colsum` module).
pub const COLUMN_SUM_TARGET: &str = "kiln_column_sum_v1";
/// The custom call target of kiln's max-pooling gradient, `Op::SelectAndScatter` (the
/// `select_scatter` module).
pub const SELECT_SCATTER_TARGET: &str = "kiln_select_and_scatter_v1";

/// Which convolutions and dots the XLA backend hands to libtorch through FFI custom calls.
///
/// Part of [`XlaOptions`](super::XlaOptions) and so of the backend's cache key. On a plugin
/// without the PJRT FFI extension (or not a CPU plugin), every mode lowers like
/// [`FfiMode::Off`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FfiMode {
    /// Pure XLA lowering.
    Off,
    /// The measured per-node rule ([`FfiMode::auto_conv`], [`FfiMode::auto_dot`]); with one
    /// CPU, every supported convolution and dot of a graph that computes gradients
    /// ([`rule_selection`]). The default.
    #[default]
    Auto,
    /// Every f32/f64 convolution and dot the kernels support.
    All,
}

impl FfiMode {
    /// A short stable text naming the mode (part of cache keys; bump the version when the
    /// rule or the kernels' semantics change).
    pub fn key(&self) -> String {
        let rule = match self {
            FfiMode::Off => return "off".into(),
            FfiMode::All if packed_conv_enabled() => return "all10".into(),
            FfiMode::All => return "all10-unpacked".into(),
            // The rule's packed linears depend on oneDNN's ISA (`auto_packed_linear`).
            FfiMode::Auto if !packed_conv_enabled() => "auto18-unpacked",
            FfiMode::Auto if onednn::avx512() => "auto18-avx512",
            FfiMode::Auto => "auto18",
        };
        rule.into()
    }

    /// Should this convolution (attributes `c`, input type `x`, kernel type `k`) be lowered to
    /// the libtorch kernel? The choice depends on the node alone (not on its role in the
    /// graph), so the XLA backend's im2col rewrite, which sees single convolutions, leaves
    /// exactly these to the kernels.
    pub fn conv(&self, c: &ConvAttrs, x: &TensorType, k: &TensorType) -> bool {
        match self {
            FfiMode::Off => false,
            FfiMode::All => conv_supported(c, x, k),
            FfiMode::Auto => conv_supported(c, x, k) && Self::auto_conv(c, x, k),
        }
    }

    /// Should this dot (dimension numbers `d`, operand types `a`, `b`) be lowered to the
    /// libtorch kernel?
    pub fn dot(&self, d: &DotDims, a: &TensorType, b: &TensorType) -> bool {
        match self {
            FfiMode::Off => false,
            FfiMode::All => dot_supported(d, a, b),
            FfiMode::Auto => dot_supported(d, a, b) && Self::auto_dot(d, a, b),
        }
    }

    /// The measured rule for convolutions, on the node alone: libtorch for every supported
    /// grouped or depthwise convolution, and for every other one of at least
    /// [`AUTO_MIN_CONV_FLOPS`]. In a graph ([`FfiSelect::picks`]) an ungrouped one must also
    /// be a gradient convolution (input or weight gradient of autograd) or a forward one of at
    /// least [`AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS`] (windows larger than 1×1) or
    /// [`AUTO_MIN_FORWARD_CONV_FLOPS`] (1×1): smaller forward ones stay in XLA.
    ///
    /// Measured with `examples/ffi_profile.rs --e2e` (2-vCPU AMD EPYC, xla-cpu-pjrt 0.0.1,
    /// batch 4 at 64×64, libtorch at its default 2 threads inside the kernels; best of 5–7
    /// interleaved runs; differences under ~15 % are noise on this shared machine). Whole
    /// models, ms, inference / fused training step, with the node rule (and
    /// [`FfiMode::auto_dot`]), on a quiet machine, before kernels ran on the waiting thread:
    ///
    /// | model | eager | XLA only | this rule |
    /// |---|---|---|---|
    /// | resnet18 | 20.8 / 80.9 | 13.2 / 94.1 | 16.1 / 73.0 |
    /// | mobilenet_v2 | 17.1 / 117 | 36.7 / 122 | 14.4 / 52.0 |
    /// | squeezenet1_1 | 12.2 / 49.8 | 3.8 / 16.3 | 4.4 / 17.6 |
    /// | alexnet | 36.9 / 380 | 152 / 273 | 33.0 / 178 |
    /// | vgg16 | 135 / 944 | 308 / 784 | 122 / 640 |
    ///
    /// and with the ungrouped threshold at 1, 30 and 100 MFLOP under load (other jobs on the
    /// machine): squeezenet1_1 7.9 / 29.1, 5.4 / 21.9, 4.7 / 13.7 (XLA only 4.0 / 20.4);
    /// resnet18 15.8 / 102, 13.6 / 86.1, 27.2 / 142 (XLA only 14.7 / 140).
    ///
    /// Alone, libtorch is on par with XLA or faster for almost every convolution of these
    /// models and 3–60× faster where XLA is weak (grouped and depthwise convolutions and their
    /// gradients; 3×3 at 256–512 channels on 2×2–4×4 images, and their input gradients: 39 ms
    /// vs 0.8 ms); inside a graph each call costs more than alone (see `threads.rs`), which
    /// small convolutions (squeezenet's, 1×1 ones) do not earn back. Grouped ones go to
    /// libtorch however small: XLA takes 0.8–1.1 ms for a 960-channel depthwise 3×3 on 2×2
    /// and its gradient (0.28 MFLOP), libtorch 0.16–0.2 ms; keeping small ones in XLA made
    /// mobilenet_v2 2.8× slower. Convolutions over non-overlapping windows (a patch
    /// embedding) go to libtorch from [`AUTO_MIN_PATCH_CONV_FLOPS`].
    pub fn auto_conv(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> bool {
        let min = if non_overlapping(c, k) {
            AUTO_MIN_PATCH_CONV_FLOPS
        } else {
            AUTO_MIN_CONV_FLOPS
        };
        c.feature_groups > 1 || conv_flops(c, x, k) >= min
    }

    /// The measured rule for dots: libtorch (MKL) for a dot whose right operand contracts its
    /// last dim (a torch `Linear` weight `[out, in]`) with at most [`AUTO_MAX_DOT_ROWS`] rows
    /// on the left (batch dims included) and at least [`AUTO_MIN_DOT_FLOPS`]; XLA for the
    /// rest.
    ///
    /// That layout with few rows is where XLA's dot is slowest: vgg16's classifier
    /// `[4, 25088]·[4096, 25088]ᵀ` 179–327 ms vs 46–54 ms, `[4, 4096]·[4096, 4096]ᵀ` 57–99 ms
    /// vs 8.8 ms (alone); vgg16 inference 369 ms (XLA only) vs 127 ms, alexnet 148 ms vs
    /// 33 ms (eager 175 and 35 ms). With many rows (transformers' linears at 256 tokens) MKL
    /// is 1.3–2.4× faster alone, but inside the graph the calls gave no gain (bert training
    /// 63–67 ms either way, vit 56 ms in XLA vs 58–65 ms with every linear in libtorch:
    /// libtorch kernels run slower inside an executable than alone, see `threads.rs`), and
    /// the products of the im2col rewrite, also many-row, were better left to XLA
    /// (squeezenet1_1 inference 4.4 ms vs 5.1 ms).
    ///
    /// Tiny products ([`DotPlan::tiny`], at most [`TINY_DOT_MAX_FLOPS`]) go to the kernel too,
    /// which runs them as its own loop: torchbench's LinearModel (`[4, 10]·[10, 10]ᵀ` twice)
    /// replays in 10–12 µs instead of 31–46 µs. Besides the dot's own cost, XLA's CPU client
    /// runs a program of 1,000 flops or more on its thread pool while the caller waits, and its
    /// cost analysis counts a custom call as no flops: such a model's program becomes cheap
    /// enough to run on the calling thread.
    pub fn auto_dot(d: &DotDims, a: &TensorType, b: &TensorType) -> bool {
        let (ad, bd) = (a.shape.to_i64(), b.shape.to_i64());
        if DotPlan::new(d, &ad, &bd).is_ok_and(|p| p.tiny().is_some()) {
            return true;
        }
        let rb = b.shape.rank();
        // Rows of every product in the batch together: attention's batched `q · kᵀ`
        // (`[4, 4, 64, 64]` twice, bert's training step) has the weight-like layout and 64
        // rows per product, but 1,024 in all; as eight kernel calls in XLA's graph it made
        // the step slower than XLA alone (fused, 3 interleaved rounds on a 2-vCPU Zen 3:
        // 149.9 / 144.6 / 142.5 ms against 120.7 / 112.7 / 126.7 ms).
        rb > 0
            && d.rhs_contract.contains(&(rb - 1))
            && lhs_rows(d, a) <= AUTO_MAX_DOT_ROWS
            && dot_flops(d, a, b) >= AUTO_MIN_DOT_FLOPS
    }

    /// Does dot node `id` run as a packed linear (a frozen `Linear` weight packed for oneDNN,
    /// its epilogue fused; see `packed_linear.rs`)? Under [`FfiMode::All`] wherever it can;
    /// under [`FfiMode::Auto`] by [`FfiMode::auto_packed_linear`].
    pub(crate) fn packs_linear(&self, g: &Graph, id: NodeId) -> bool {
        let Op::DotGeneral(d) = &g.node(id).op else {
            return false;
        };
        let Some(p) = (*self != FfiMode::Off)
            .then(|| packed_linear(g, id))
            .flatten()
        else {
            return false;
        };
        *self == FfiMode::All || Self::auto_packed_linear(lhs_rows(d, &g.node(p.x).ty))
    }

    /// Is dot node `id` the end of a scaled dot-product attention that runs as one call
    /// ([`ATTENTION_TARGET`])? Under [`FfiMode::Auto`] and [`FfiMode::All`] wherever the
    /// pattern matches (an inference graph's attention; see the `attention` module for the
    /// measurements).
    pub(crate) fn attends(&self, g: &Graph, id: NodeId) -> bool {
        *self != FfiMode::Off && attention::attention(g, id).is_some()
    }

    /// The rule for packed linears with `rows` rows (the activation's elements over its last
    /// dim, as [`FfiMode::auto_dot`] counts them): always where oneDNN has AVX-512
    /// ([`onednn_avx512`]), else only with at most [`AUTO_MAX_DOT_ROWS`] rows.
    ///
    /// With AVX-512 oneDNN's packed product is ~2× faster than MKL's (2-vCPU Zen 5, µs:
    /// `[260, 256]·[768, 256]ᵀ` 277 vs 584) and bert / vit inference took 9.5 / 11.5 ms
    /// against eager's 11.9 / 15.6. With AVX2 only (2-vCPU Zen 3) it is level with MKL alone
    /// (`[256, 256]·[1024, 256]ᵀ` 928 vs 1,137 µs, `[256, 1024]·[256, 1024]ᵀ` 1,142 vs 973),
    /// which does not pay for running beside XLA's threads: bert inference 21.3–22.5 ms with
    /// its linears packed against 14.9–15.8 ms with them in XLA (on the transposed device
    /// layout), eager 14.4. Few rows keep it on every CPU: XLA's dot is slowest there
    /// (vgg16's `[4, 25088]·[4096, 25088]ᵀ` 329 ms in XLA, 30 ms packed on the Zen 3).
    pub fn auto_packed_linear(rows: usize) -> bool {
        rows <= AUTO_MAX_DOT_ROWS || onednn_avx512()
    }
}

impl FfiMode {
    /// The rule for packed convolutions under [`FfiMode::Auto`]: one that would earn its call
    /// by itself ([`FfiMode::auto_packed_conv_alone`]), or one connected to such a one
    /// through a run of packed convolutions, each reading its neighbour's result (through its
    /// fused epilogue, or as its residual; [`packed::neighbours`]).
    ///
    /// Why: a packed call costs more than XLA's own convolution on small ones, but each call
    /// also switches the activations to NHWC and back, which XLA cancels only between
    /// consecutive calls. 2-vCPU Zen 3, inference compiled alone, batch 4 at 64×64, ms:
    /// squeezenet1_1's 26 convolutions (1–37 MFLOP, in runs of at most three) took 8.7–10.5
    /// packed against 7.0–9.7 in XLA (eager 11.0); mobilenet_v2's 1×1 convolutions sit
    /// between its depthwise ones, and taking them out of the NHWC run made it slower
    /// (10.6–11.4 → 13.6–13.7); resnet50 with its four 1×1 downsampling convolutions (34
    /// MFLOP each, their neighbours 1×1 too) in XLA: 34–40 → 49–50.
    pub(crate) fn auto_packed_conv(g: &Graph, p: &packed::PackedConv) -> bool {
        if Self::auto_packed_conv_alone(g, p.conv) {
            return true;
        }
        // Breadth-first over the run, stopping at the first convolution that earns its call.
        let mut seen = vec![p.conv];
        let mut queue = std::collections::VecDeque::from([p.clone()]);
        while let Some(q) = queue.pop_front() {
            for c in packed::neighbours(g, &q) {
                if seen.contains(&c) {
                    continue;
                }
                if Self::auto_packed_conv_alone(g, c) {
                    return true;
                }
                seen.push(c);
                queue.extend(packed_conv(g, c));
            }
        }
        false
    }

    /// Does packed convolution `conv` earn its call by itself: grouped, or at least
    /// [`AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS`] (windows larger than 1×1) or
    /// [`AUTO_MIN_FORWARD_CONV_FLOPS`] (1×1), as for unpacked forward convolutions?
    fn auto_packed_conv_alone(g: &Graph, conv: NodeId) -> bool {
        let n = g.node(conv);
        let Op::Conv(c) = &n.op else {
            return false;
        };
        let (x, k) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        c.feature_groups > 1 || conv_flops(c, x, k) >= forward_conv_min_flops(c, k)
    }
}

/// The rows of a dot's left operand `a`: the product of its dims that `d` does not contract,
/// batch dims included (every product in the batch together).
fn lhs_rows(d: &DotDims, a: &TensorType) -> usize {
    (0..a.shape.rank())
        .filter(|i| !d.lhs_contract.contains(i))
        .map(|i| a.shape.dim(i))
        .product()
}

/// The custom-call attribute (`serial = 1 : i64`) that runs a kernel with libtorch on one
/// thread; see [`serial_kernels`].
pub const SERIAL_ATTR: &str = "serial";

/// Below this share of a program's convolution and dot flops, its kernels run with libtorch
/// on one thread (see [`serial_kernels`]).
pub const SERIAL_KERNEL_SHARE: f64 = 0.25;

/// Do the kernels of `g` under `sel` run with libtorch on one thread? Yes when they compute
/// less than [`SERIAL_KERNEL_SHARE`] of the graph's convolution and dot flops (the rest is
/// XLA's).
///
/// Why: a kernel on libtorch's threads wakes the OpenMP team of the thread running it, whose
/// other threads then spin for milliseconds (libgomp's default wait policy) on the CPUs XLA's
/// workers need. Where kernels follow each other closely (mobilenet_v2: 53 kernels in a
/// 8 ms program) the spinning team is ready for the next one; where a few kernels sit
/// among XLA's work it only takes CPU from XLA. vit inference (2 kernels, 3 % of its
/// flops; 2-vCPU Zen 3, compiled alone, ms): 23.0 / 23.3 on the team, 16.3 / 16.4 serial
/// (perf: its team's spinning thread 19.5 % of all samples). Serial everywhere instead:
/// mobilenet_v2 8.3 / 8.9 → 13.7 / 14.8, resnet18 13.7 / 14.3 → 21.7 / 23.8.
pub fn serial_kernels<S: FfiSelect + ?Sized>(g: &Graph, sel: &S) -> bool {
    let (mut kernels, mut all) = (0.0, 0.0);
    for id in g.petgraph().node_indices() {
        let n = g.node(id);
        if n.operands.len() != 2 {
            continue;
        }
        let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        let flops = match &n.op {
            Op::Conv(c) => conv_flops(c, a, b),
            Op::DotGeneral(d) => dot_flops(d, a, b),
            _ => continue,
        };
        all += flops;
        if picked(g, id, sel) {
            kernels += flops;
        }
    }
    kernels > 0.0 && kernels < SERIAL_KERNEL_SHARE * all
}

/// Below this many floating-point operations (multiply-adds × 2), [`FfiMode::Auto`] leaves an
/// ungrouped convolution to XLA (see [`FfiMode::auto_conv`]).
pub const AUTO_MIN_CONV_FLOPS: f64 = 3e7;

/// Below this many floating-point operations, [`FfiMode::Auto`] leaves an ungrouped 1×1
/// *forward* convolution to XLA (gradient convolutions go to libtorch from
/// [`AUTO_MIN_CONV_FLOPS`], larger windows from [`AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS`]).
/// Set when kernels still ran on XLA's workers: resnet18's forward convolutions (33–77
/// MFLOP at batch 4, 64×64) ran faster in XLA then (inference 13.3 ms vs 15.3 ms), vgg16's
/// (302 MFLOP–1.2 GFLOP) faster in libtorch (inference 122 ms vs 148 ms).
pub const AUTO_MIN_FORWARD_CONV_FLOPS: f64 = 2e8;

/// Below this many floating-point operations, [`FfiMode::Auto`] leaves an ungrouped
/// forward convolution with a spatial window larger than 1 (3×3, 7×7, ...) to XLA; 1×1 ones
/// keep [`AUTO_MIN_FORWARD_CONV_FLOPS`]. Since kernels run on the waiting thread (no
/// throttled OpenMP teams, see `threads.rs`), resnet18's forward 3×3 convolutions (33–77
/// MFLOP at batch 4, 64×64) are faster in libtorch: 2-vCPU Xeon, 3 alternating runs of 30
/// calls, median ms, old rule / this one: resnet18 inference 29.4 / 20.7, 25.2 / 14.4,
/// 26.6 / 22.8; alexnet 33.0 / 26.8, 28.9 / 33.4, 34.7 / 27.7; fused training of resnet18
/// unchanged (118 / 111, 124 / 137, 119 / 119). squeezenet1_1's 1×1 classifier (37 MFLOP)
/// took 1.3–3.5 ms as a kernel and made the model 30–60 % slower, hence 1×1 is left out.
pub const AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS: f64 = 3e7;

/// Below this many floating-point operations, [`FfiMode::Auto`] leaves an ungrouped forward
/// convolution over non-overlapping windows (stride = window, no padding: a vision transformer's
/// patch embedding) to XLA. XLA's CPU convolution is slow on them: vit's 8×8 stride-8
/// patch embedding (`[4, 3, 64, 64]` by `[256, 3, 8, 8]`, 25 MFLOP), 2-vCPU Xeon, µs a call,
/// best of 5: XLA 435, im2col 291, libtorch's kernel 224 (eager 149).
pub const AUTO_MIN_PATCH_CONV_FLOPS: f64 = 1e6;

/// Does convolution `c` with kernel type `k` read each input element once (stride equal to
/// the window in every spatial dim, windows larger than 1, no padding or dilation, one
/// group)?
fn non_overlapping(c: &ConvAttrs, k: &TensorType) -> bool {
    let window = &k.shape.dims()[2.min(k.shape.rank())..];
    !window.is_empty()
        && window.iter().any(|&w| w > 1)
        && c.strides[..] == *window
        && c.padding.iter().all(|&p| p == (0, 0))
        && c.lhs_dilation
            .iter()
            .chain(&c.rhs_dilation)
            .all(|&d| d == 1)
        && c.feature_groups == 1
        && c.batch_groups == 1
}

/// The forward-convolution threshold of [`FfiMode::Auto`] for convolution `c` with a kernel
/// of type `k`.
fn forward_conv_min_flops(c: &ConvAttrs, k: &TensorType) -> f64 {
    if non_overlapping(c, k) {
        AUTO_MIN_PATCH_CONV_FLOPS
    } else if k.shape.dims().iter().skip(2).any(|&d| d > 1) {
        AUTO_MIN_FORWARD_SPATIAL_CONV_FLOPS
    } else {
        AUTO_MIN_FORWARD_CONV_FLOPS
    }
}

/// Below this many floating-point operations, [`FfiMode::Auto`] leaves a dot to XLA: a
/// libtorch call has a fixed cost of tens of µs and XLA can fuse small ops with their
/// neighbours.
pub const AUTO_MIN_DOT_FLOPS: f64 = 1e6;

/// At most this many rows (elements of the left operand's free dims) for [`FfiMode::Auto`]
/// to hand a dot to libtorch (see [`FfiMode::auto_dot`]).
pub const AUTO_MAX_DOT_ROWS: usize = 64;

/// Multiply-add count × 2 of a convolution (of its output, over its kernel window).
pub fn conv_flops(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> f64 {
    let out = conv_out_dims(c, &x.shape.to_i64(), &k.shape.to_i64()).unwrap_or_default();
    window_flops(&out, &k.shape.to_i64())
}

/// [`conv_flops`] from the dims of a convolution's result (in any dim order) and of its
/// kernel (`[out channels, in channels per group, window..]`).
pub(crate) fn window_flops(out: &[i64], kernel: &[i64]) -> f64 {
    let prod = |d: &[i64]| d.iter().map(|&v| v as f64).product::<f64>();
    2.0 * prod(out) * prod(kernel.get(1..).unwrap_or_default())
}

/// Multiply-add count × 2 of a dot.
pub fn dot_flops(d: &DotDims, a: &TensorType, b: &TensorType) -> f64 {
    let prod = |t: &TensorType| t.shape.dims().iter().map(|&v| v as f64).product::<f64>();
    let shared: f64 = d
        .rhs_batch
        .iter()
        .chain(&d.rhs_contract)
        .map(|&i| b.shape.dim(i) as f64)
        .product();
    // (all of a) x (b's free dims) x 2.
    2.0 * prod(a) * prod(b) / shared.max(1.0)
}

/// Can [`CONV_TARGET`] run this convolution? f32/f64 with at least one spatial dim.
pub fn conv_supported(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> bool {
    let n = c.strides.len();
    matches!(x.dtype, DType::F32 | DType::F64)
        && k.dtype == x.dtype
        && n >= 1
        && x.shape.rank() == n + 2
        && k.shape.rank() == n + 2
        && !(c.batch_groups > 1 && c.feature_groups > 1)
}

/// Can [`DOT_TARGET`] run this dot? f32/f64 operands of the same type.
pub fn dot_supported(_d: &DotDims, a: &TensorType, b: &TensorType) -> bool {
    matches!(a.dtype, DType::F32 | DType::F64) && b.dtype == a.dtype
}

/// How the operands of a [`CONV_TARGET`] call relate to the convolution's input and kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvForm {
    /// The operands are the input and the kernel, `[N, C, *sp]` and `[O, C/g, *k]`.
    Plain = 0,
    /// The operand is a forward weight `w` (`[C, O/g, *k]`, C being the channels of this
    /// convolution's *output*) and the kernel is `w` spatially reversed with in and out
    /// channels swapped within each group: the input-gradient convolution of kiln's autograd,
    /// which libtorch runs as a transposed convolution on `w` itself.
    ForwardWeight = 1,
    /// The weight-gradient convolution of kiln's autograd for a forward convolution of `x`
    /// (`[N, C, *sp]`) with `g` feature groups, stride `s`, kernel dilation `r`: the operands
    /// are `x` and the cotangent `ct` (`[N, O, *sp']`), and the convolution's input and kernel
    /// are `x` regrouped to `[C/g, g*N, *sp]` and `ct` transposed to `[O, N, *sp']`; its
    /// window strides are `r` and its kernel dilation `s`. 2-d ones run as libtorch's CPU
    /// weight gradient does (oneDNN's kernel, or im2col of `x` and one matrix product with
    /// `ct`; grouped ones on few positions as the convolution of the regrouped operands).
    WeightGradient = 2,
    /// [`ConvForm::WeightGradient`] with the result transposed to the weight's layout
    /// `[O, C/g, *k]`: the weight gradient itself (the convolution and the transpose autograd
    /// puts after it, as one call).
    WeightGradientTransposed = 3,
}

/// How the XLA backend lowers one node to a libtorch kernel ([`ffi_lowering`]).
#[derive(Clone, Debug, PartialEq)]
pub enum FfiLowering {
    /// A `stablehlo.custom_call` on these operand nodes with these attributes (inside
    /// `{...}`), of the node's result type.
    Call {
        /// The operands, in order.
        operands: Vec<NodeId>,
        /// The custom call's attributes.
        attrs: String,
    },
    /// Nothing: every user of the node is lowered to a call that reads the node's operands
    /// itself.
    Absorbed,
    /// A `stablehlo.custom_call` on NHWC arrays ([`PACKED_CONV_TARGET`]): the operands marked
    /// in `nhwc` are transposed from NCHW first, and the call's result (of MLIR type
    /// `result`, NHWC) is transposed back to the node's NCHW type.
    Nhwc {
        /// The operands, in order.
        operands: Vec<NodeId>,
        /// Which operands are transposed to NHWC.
        nhwc: Vec<bool>,
        /// The custom call's attributes.
        attrs: String,
        /// The MLIR type of the call's (NHWC) result.
        result: String,
    },
}

/// Which convolution and dot nodes [`ffi_lowering`] hands to libtorch: an [`FfiMode`]'s
/// rule, or an explicit set of nodes (the XLA backend's per-node choices, see
/// [`super::autotune`]).
pub trait FfiSelect {
    /// Does convolution or dot node `id` of `g` run as a libtorch kernel? Only asked for
    /// `Op::Conv` and `Op::DotGeneral` nodes with two operands; a node the kernels do not
    /// support ([`conv_supported`], [`dot_supported`]) is never handed to them whatever this
    /// says.
    fn picks(&self, g: &Graph, id: NodeId) -> bool;

    /// Does an [`Op::Barrier`] lower to kiln's ordering call ([`AFTER_TARGET`]), which needs
    /// the kernels registered in the plugin? Otherwise it lowers to its first operand (the
    /// order is dropped, the value is the same). Sets of nodes are chosen among the kernels,
    /// so they say yes.
    fn orders(&self) -> bool {
        true
    }

    /// May kiln's own kernels (plain Rust, no libtorch) stand in for XLA's code where that
    /// is slow: the block transpose of a product's operand ([`TRANSPOSE_TARGET`],
    /// [`dot_operand_transposes`]), the sum over leading dims ([`COLUMN_SUM_TARGET`]) and max
    /// pooling's gradient ([`SELECT_SCATTER_TARGET`])?
    /// Needs the kernels registered, like [`FfiSelect::orders`].
    fn own_kernels(&self) -> bool {
        self.orders()
    }
}

impl FfiSelect for FfiMode {
    fn orders(&self) -> bool {
        *self != FfiMode::Off
    }

    fn picks(&self, g: &Graph, id: NodeId) -> bool {
        let n = g.node(id);
        if n.operands.len() != 2 {
            return false;
        }
        let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        match &n.op {
            Op::Conv(c) => {
                let packed = || match *self {
                    FfiMode::Off => false,
                    FfiMode::All => packed_conv(g, id).is_some(),
                    FfiMode::Auto => {
                        packed_conv(g, id).is_some_and(|p| Self::auto_packed_conv(g, &p))
                    }
                };
                (self.conv(c, a, b)
                    && (*self != FfiMode::Auto
                        || c.feature_groups > 1
                        || conv_flops(c, a, b) >= forward_conv_min_flops(c, b)
                        || is_gradient_conv(g, id, c)))
                    || packed()
            }
            Op::DotGeneral(d) => {
                self.dot(d, a, b) || self.packs_linear(g, id) || self.attends(g, id)
            }
            _ => false,
        }
    }
}

/// The nodes of `g` that `mode`'s rule hands to libtorch: those [`FfiSelect::picks`] accepts
/// node by node (and the kernels support), then one look at the whole graph: where those
/// kernels would run serially ([`serial_kernels`]: a few kernels among much of XLA's work),
/// ungrouped convolutions go back to XLA; grouped ones, and dots, stay kernels. The XLA
/// backend lowers by this set under its rule (autotune off).
///
/// Why: a serial kernel has one libtorch thread where XLA's convolution has the whole pool,
/// and XLA is within about 2× of libtorch's two threads on ungrouped convolutions (3–60×
/// behind on grouped ones). squeezenet1_1's fused training step (2-vCPU Zen 3, compiled
/// alone, ms): 34.1 / 31.2 / 36.6 / 52.0 / 40.2 with its six gradient-convolution kernels
/// (9–14 ms of it in them) against 28.4 / 25.0 / 27.1 / 34.5 / 27.8 without; its split
/// step 44.3 / 37.1 → 42.4 / 25.8. mobilenet_v2's and mnasnet1_0's steps (whose kernels
/// are all grouped) and vit's do not change.
///
/// Until 2026-12-06 a process on one CPU ([`process_cpus`]) also handed every supported
/// convolution and dot of a graph that computes gradients to libtorch: measured when XLA's
/// pool ran 4 threads on that CPU (2-vCPU Xeon, fused steps on one CPU, ms: vit 51.8 vs 75.8,
/// bert 65–73 vs 88.9). With XLA's pool at one thread per CPU (`XlaBackend::new`) that rule
/// made the steps slower: harness `--threads 1 --training`, default subset, 2-vCPU Zen 2,
/// without / with it, split and fused: geomean 1.52× / 1.36× and 1.75× / 1.48× of eager
/// (squeezenet1_1 1.29× / 0.96× and 1.31× / 0.85×, mobilenet_v2 1.33× / 1.13× and 1.33× /
/// 1.07×, bert 1.32× / 1.21× and 1.46× / 1.28×, vit 1.13× / 1.02× and 1.17× / 1.01×,
/// resnet18 level). So the CPU count no longer enters the rule.
pub fn rule_selection(g: &Graph, mode: FfiMode) -> HashSet<NodeId> {
    let mut set: HashSet<NodeId> = products(g).filter(|&id| picked(g, id, &mode)).collect();
    if mode == FfiMode::Auto && serial_kernels(g, &set) {
        set.retain(|&id| match &g.node(id).op {
            Op::Conv(c) => c.feature_groups > 1 || c.batch_groups > 1,
            _ => true,
        });
    }
    set
}

/// The convolution and dot nodes of `g`: those a rule chooses a lowering for.
pub(crate) fn products(g: &Graph) -> impl Iterator<Item = NodeId> + '_ {
    g.petgraph()
        .node_indices()
        .filter(|&id| matches!(g.node(id).op, Op::Conv(_) | Op::DotGeneral(_)))
}

/// Does `g` compute gradients: does it hold one of autograd's gradient convolutions (an
/// input gradient reading a reversed forward weight, or a weight gradient; see
/// [`forward_weight_of`] and [`weight_gradient_operands_of`]) or a weight-gradient product
/// (a dot without batch dims that contracts the leading dim of both operands, as autograd
/// builds `dW = ctᵀ · x` for a product `x · Wᵀ`; see `dot_vjp`)? Forward products contract
/// the features instead.
pub fn computes_gradients(g: &Graph) -> bool {
    g.petgraph().node_indices().any(|id| {
        let n = g.node(id);
        match &n.op {
            Op::Conv(c) if n.operands.len() == 2 => is_gradient_conv(g, id, c),
            Op::DotGeneral(d) => {
                d.lhs_batch.is_empty() && d.lhs_contract.contains(&0) && d.rhs_contract.contains(&0)
            }
            _ => false,
        }
    })
}

/// Is convolution `id` (attributes `c`) one of autograd's gradient convolutions: an input
/// gradient (its kernel is a forward weight reversed, [`forward_weight_of`]) or a weight
/// gradient ([`weight_gradient_operands_of`])? [`FfiMode::Auto`] hands ungrouped forward
/// convolutions to XLA: on a quiet 2-vCPU machine resnet18 inference took 12.8 ms with XLA's
/// convolutions and 15.3 ms with its large ones in libtorch (eager 17.8 ms), while its fused
/// training step took 76 ms with the gradient convolutions in libtorch and 97 ms without.
fn is_gradient_conv(g: &Graph, id: NodeId, c: &ConvAttrs) -> bool {
    let n = g.node(id);
    forward_weight_of(g, n.operands[1], c).is_some() || weight_gradient_operands_of(g, id).is_some()
}

impl FfiSelect for HashSet<NodeId> {
    fn picks(&self, _g: &Graph, id: NodeId) -> bool {
        self.contains(&id)
    }
}

/// Does `sel` hand node `id` (a two-operand convolution or dot) to libtorch, and can the
/// kernels run it?
fn picked<S: FfiSelect + ?Sized>(g: &Graph, id: NodeId, sel: &S) -> bool {
    supported(g, id) && sel.picks(g, id)
}

/// Is node `id` of `g` a convolution or dot (of two operands) that the kernels support?
fn supported(g: &Graph, id: NodeId) -> bool {
    let n = g.node(id);
    if n.operands.len() != 2 {
        return false;
    }
    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    match &n.op {
        Op::Conv(c) => conv_supported(c, a, b),
        Op::DotGeneral(d) => dot_supported(d, a, b),
        _ => false,
    }
}

/// Whether node `id` of `g` becomes a libtorch kernel call under `sel`, and how:
/// convolutions and `Linear` products whose weight comes from frozen variables, with the
/// elementwise ops after them ([`PACKED_CONV_TARGET`], [`PACKED_LINEAR_TARGET`], see the
/// `packed` and `packed_linear` modules), scaled dot-product attention whose last product
/// `sel` picks ([`ATTENTION_TARGET`]), other convolutions ([`CONV_TARGET`],
/// reading through autograd's kernel reversal and operand transposes, see [`ConvForm`]), the
/// transpose that turns a weight-gradient convolution into the weight gradient, and dots
/// ([`DOT_TARGET`]). `None`: XLA lowers the node.
pub fn ffi_lowering<S: FfiSelect + ?Sized>(g: &Graph, id: NodeId, mode: &S) -> Option<FfiLowering> {
    let n = g.node(id);
    let ty = |o: NodeId| &g.node(o).ty;
    if matches!(n.op, Op::Conv(_) | Op::Binary(_)) {
        if let Some(p) = packed::packed_chain_of(g, id, &|c| picked(g, c, mode)) {
            return Some(packed::lowering(g, id, &p));
        }
    }
    if matches!(
        n.op,
        Op::DotGeneral(_) | Op::Binary(_) | Op::Unary(crate::ir::UnaryOp::Erf)
    ) {
        if let Some(p) = packed_linear::packed_linear_chain_of(g, id, &|d| picked(g, d, mode)) {
            return Some(packed_linear::lowering(g, id, &p));
        }
    }
    if let Some(a) = attention::attention_chain_of(g, id, &|t| picked(g, t, mode)) {
        let emitted =
            |src: NodeId| !matches!(ffi_lowering(g, src, mode), Some(FfiLowering::Absorbed));
        let pre = (id == a.stands_for())
            .then(|| attention::linear_source(g, &a, &|d| picked(g, d, mode)))
            .flatten();
        return Some(attention::lowering(g, id, &a, &emitted, pre.as_ref()));
    }
    match &n.op {
        Op::DotGeneral(d) if n.operands.len() == 2 => {
            let (a, b) = (ty(n.operands[0]), ty(n.operands[1]));
            picked(g, id, mode).then(|| FfiLowering::Call {
                operands: n.operands.to_vec(),
                attrs: dot_call_attrs(d, a, b, &n.ty),
            })
        }
        Op::Conv(c) if n.operands.len() == 2 => {
            let (a, b) = (ty(n.operands[0]), ty(n.operands[1]));
            if !picked(g, id, mode) {
                return None;
            }
            if let Some((x, ct)) = direct_weight_gradient(g, id, mode) {
                let users = g.users(id);
                let absorbed = !users.is_empty()
                    && !g.outputs().contains(&id)
                    && users.iter().all(|&u| absorbs_weight_gradient(g, u, mode));
                if absorbed {
                    return Some(FfiLowering::Absorbed);
                }
                return Some(FfiLowering::Call {
                    operands: vec![x, ct],
                    attrs: conv_call_attrs_form(c, ty(x), ty(ct), &n.ty, ConvForm::WeightGradient),
                });
            }
            if let Some(w) = forward_weight_of(g, n.operands[1], c) {
                return Some(FfiLowering::Call {
                    operands: vec![n.operands[0], w],
                    attrs: conv_call_attrs_form(c, a, ty(w), &n.ty, ConvForm::ForwardWeight),
                });
            }
            Some(FfiLowering::Call {
                operands: n.operands.to_vec(),
                attrs: conv_call_attrs(c, a, b, &n.ty),
            })
        }
        Op::Transpose(_) if absorbs_weight_gradient(g, id, mode) => {
            let conv = n.operands[0];
            let (x, ct) = direct_weight_gradient(g, conv, mode)?;
            let Op::Conv(c) = &g.node(conv).op else {
                return None;
            };
            Some(FfiLowering::Call {
                operands: vec![x, ct],
                attrs: conv_call_attrs_form(
                    c,
                    ty(x),
                    ty(ct),
                    &n.ty,
                    ConvForm::WeightGradientTransposed,
                ),
            })
        }
        _ => None,
    }
}

/// The forward input and cotangent of convolution `conv` if it is a weight-gradient
/// convolution that `mode` hands to libtorch and that runs as libtorch's weight gradient.
fn direct_weight_gradient<S: FfiSelect + ?Sized>(
    g: &Graph,
    conv: NodeId,
    mode: &S,
) -> Option<(NodeId, NodeId)> {
    let n = g.node(conv);
    let Op::Conv(c) = &n.op else {
        return None;
    };
    if n.operands.len() != 2 {
        return None;
    }
    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    if !picked(g, conv, mode) || !weight_gradient_direct(c, a, b) {
        return None;
    }
    weight_gradient_operands_of(g, conv)
}

/// Is node `t` a `transpose(1, 0, ...)` of a weight-gradient convolution that
/// [`direct_weight_gradient`] accepts?
fn absorbs_weight_gradient<S: FfiSelect + ?Sized>(g: &Graph, t: NodeId, mode: &S) -> bool {
    let n = g.node(t);
    let Op::Transpose(p) = &n.op else {
        return false;
    };
    let r = p.len();
    r >= 3
        && p[0] == 1
        && p[1] == 0
        && p[2..].iter().copied().eq(2..r)
        && direct_weight_gradient(g, n.operands[0], mode).is_some()
}

/// If `kernel` (the kernel operand of a convolution with attributes `c` in graph `g`) is the
/// spatially reversed, group-transposed copy of a forward weight `w` that kiln's autograd
/// builds for an input gradient (`reverse(reshape(transpose(reshape(w))))`, see `conv_vjp`),
/// returns `w`: the kernel can then read `w` directly ([`ConvForm::ForwardWeight`]) and
/// XLA need not materialize the copy.
pub fn forward_weight_of(g: &Graph, kernel: NodeId, c: &ConvAttrs) -> Option<NodeId> {
    let n = c.strides.len();
    let gr = c.feature_groups;
    if c.batch_groups != 1 {
        return None;
    }
    let rev = g.node(kernel);
    let kt = rev.ty.shape.dims();
    match &rev.op {
        Op::Reverse(dims) if dims.len() == n && dims.iter().copied().eq(2..n + 2) => {}
        _ => return None,
    }
    // [C, O/g, *k] <- reshape <- [g, C/g, O/g, *k] <- transpose(0, 2, 1) <- [g, O/g, C/g, *k]
    // <- reshape <- w [O, C/g, *k].
    let mut cur = rev.operands[0];
    if matches!(g.node(cur).op, Op::Reshape(_)) {
        cur = g.node(cur).operands[0];
    }
    let tr = g.node(cur);
    let mut perm = vec![0, 2, 1];
    perm.extend(3..n + 3);
    match &tr.op {
        Op::Transpose(p) if *p == perm => {}
        _ => return None,
    }
    let mut w = tr.operands[0];
    if matches!(g.node(w).op, Op::Reshape(_)) {
        w = g.node(w).operands[0];
    }
    let wt = &g.node(w).ty;
    let wd = wt.shape.dims();
    if wt.dtype != rev.ty.dtype || wd.len() != n + 2 || wd[0] % gr != 0 {
        return None;
    }
    let mut grouped = vec![gr, wd[0] / gr, wd[1]];
    grouped.extend_from_slice(&wd[2..]);
    let mut expect = vec![wd[1] * gr, wd[0] / gr];
    expect.extend_from_slice(&wd[2..]);
    (g.node(tr.operands[0]).ty.shape.dims() == grouped.as_slice() && kt == expect.as_slice())
        .then_some(w)
}

/// If convolution `conv` of graph `g` is the weight-gradient convolution kiln's autograd
/// builds (see `conv_vjp`) for a forward input `x` and cotangent `ct` — its input is `x`
/// regrouped by `reshape(transpose(reshape(x)))` and its kernel `transpose(ct)` — returns
/// `(x, ct)` ([`ConvForm::WeightGradient`]).
pub fn weight_gradient_operands_of(g: &Graph, conv: NodeId) -> Option<(NodeId, NodeId)> {
    let node = g.node(conv);
    let c = match &node.op {
        Op::Conv(c) => c,
        _ => return None,
    };
    let n = c.strides.len();
    let gr = c.feature_groups;
    if c.batch_groups != 1 || node.operands.len() != 2 {
        return None;
    }
    // rhs: transpose(1, 0, ...) of ct [N, O, *sp'].
    let rt = g.node(node.operands[1]);
    let mut p2 = vec![1, 0];
    p2.extend(2..n + 2);
    match &rt.op {
        Op::Transpose(p) if *p == p2 => {}
        _ => return None,
    }
    let ct = rt.operands[0];
    // lhs: reshape [C/g, g*N, *sp] <- transpose(2, 1, 0, ...) <- reshape [N, g, C/g, *sp] <- x.
    let mut cur = node.operands[0];
    if matches!(g.node(cur).op, Op::Reshape(_)) {
        cur = g.node(cur).operands[0];
    }
    let tr = g.node(cur);
    let mut perm = vec![2, 1, 0];
    perm.extend(3..n + 3);
    match &tr.op {
        Op::Transpose(p) if *p == perm => {}
        _ => return None,
    }
    let mut x = tr.operands[0];
    if matches!(g.node(x).op, Op::Reshape(_)) {
        x = g.node(x).operands[0];
    }
    let (xt, ctt) = (&g.node(x).ty, &g.node(ct).ty);
    let (xd, cd) = (xt.shape.dims(), ctt.shape.dims());
    if xd.len() != n + 2 || cd.len() != n + 2 || xd[0] != cd[0] || xd[1] % gr != 0 {
        return None;
    }
    let mut grouped = vec![xd[0], gr, xd[1] / gr];
    grouped.extend_from_slice(&xd[2..]);
    let mut lhs = vec![xd[1] / gr, gr * xd[0]];
    lhs.extend_from_slice(&xd[2..]);
    let ok = g.node(tr.operands[0]).ty.shape.dims() == grouped.as_slice()
        && g.node(node.operands[0]).ty.shape.dims() == lhs.as_slice()
        && xt.dtype == ctt.dtype;
    ok.then_some((x, ct))
}

#[cfg(test)]
mod tests;
