//! libtorch kernels inside XLA executables: convolutions and matrix products lowered to
//! `stablehlo.custom_call`s that XLA runs through kiln's FFI handlers (the crate-private
//! `pjrt::ffi` module), on XLA's own buffers, while everything around them
//! (elementwise ops, reductions, normalisation) stays in XLA and is fused there.
//!
//! Why: on the CPU plugin (xla-cpu-pjrt 0.0.1) XLA's convolution emitter is several times
//! slower than libtorch (oneDNN) for grouped and depthwise convolutions and for 3×3 layers at
//! 128–512 channels on small images, and its dot is ~7× slower than MKL for a torch `Linear`
//! weight layout (`x[N, in] · W[out, in]ᵀ`). The measured per-node rule is
//! [`FfiMode::auto_conv`] / [`FfiMode::auto_dot`].
//!
//! Two custom call targets, both taking f32 or f64 buffers:
//!
//! - [`CONV_TARGET`]: `Op::Conv` with kiln's semantics (input `[N, C, *sp]`, kernel
//!   `[O, C/g, *k]`, output `[N, O, *sp']`; strides, possibly asymmetric or negative padding,
//!   input and kernel dilation, feature and batch groups), attributes `strides`, `padding`
//!   (flattened `(low, high)` pairs), `lhs_dilation`, `rhs_dilation` (`array<i64>`),
//!   `feature_groups`, `batch_groups` (`i64`). Forward convolutions (grouped and depthwise
//!   included) run as one `at::convolution`; input-dilated ones (the input gradients kiln's
//!   autograd emits) as a transposed convolution on the un-reversed kernel; what fits neither
//!   is padded and dilated explicitly first.
//! - [`DOT_TARGET`]: `Op::DotGeneral`, attribute `dims = array<i64: nb, nc, lhs_batch...,
//!   rhs_batch..., lhs_contract..., rhs_contract...>`: operands are viewed (no copy where
//!   strides allow) as `[B, M, K]` and `[B, K, N]` and multiplied by `mm`/`bmm` straight into
//!   the result buffer.
//!
//! Threads: XLA calls handlers from its worker threads, possibly several at once. Every kernel
//! body runs under one process-wide lock (libtorch parallelises each kernel over all cores with
//! OpenMP; two kernels at once would oversubscribe them) — see [`torch_lock`].

use crate::backend::xla::lower::tensor_type;
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DType, DotDims, Graph, NodeId, Op, TensorType};
use parking_lot::{Mutex, MutexGuard};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use tch::Tensor;

/// The custom call target of kiln's convolution kernel.
pub const CONV_TARGET: &str = "kiln_conv_v1";
/// The custom call target of kiln's dot kernel.
pub const DOT_TARGET: &str = "kiln_dot_v1";

/// Which convolutions and dots the XLA backend hands to libtorch through FFI custom calls.
///
/// Part of [`XlaOptions`](super::XlaOptions) and so of the backend's cache key. On a plugin
/// without the PJRT FFI extension (or not a CPU plugin), every mode lowers like
/// [`FfiMode::Off`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FfiMode {
    /// Pure XLA lowering.
    #[default]
    Off,
    /// The measured per-node rule ([`FfiMode::auto_conv`], [`FfiMode::auto_dot`]).
    Auto,
    /// Every f32/f64 convolution and dot the kernels support.
    All,
}

impl FfiMode {
    /// A short stable text naming the mode (part of cache keys; bump the version when the
    /// rule or the kernels' semantics change).
    pub fn key(&self) -> &'static str {
        match self {
            FfiMode::Off => "off",
            FfiMode::Auto => "auto1",
            FfiMode::All => "all1",
        }
    }

    /// Should this convolution (attributes `c`, input type `x`, kernel type `k`) be lowered to
    /// the libtorch kernel?
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

    /// The measured rule for convolutions (see `examples/ffi_profile.rs`).
    pub fn auto_conv(_c: &ConvAttrs, _x: &TensorType, _k: &TensorType) -> bool {
        true
    }

    /// The measured rule for dots (see `examples/ffi_profile.rs`).
    pub fn auto_dot(_d: &DotDims, _a: &TensorType, _b: &TensorType) -> bool {
        true
    }
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

fn i64_array(v: impl IntoIterator<Item = i64>) -> String {
    let items: Vec<String> = v.into_iter().map(|x| x.to_string()).collect();
    if items.is_empty() {
        "array<i64>".into()
    } else {
        format!("array<i64: {}>", items.join(", "))
    }
}

/// Row-major layout attribute of a rank-`r` array (`minor_to_major = [r-1, ..., 0]`).
fn row_major(r: usize) -> String {
    if r == 0 {
        return "dense<> : tensor<0xindex>".into();
    }
    let v: Vec<String> = (0..r).rev().map(|d| d.to_string()).collect();
    format!("dense<[{}]> : tensor<{r}xindex>", v.join(", "))
}

fn custom_call_attrs(
    target: &str,
    config: &str,
    operands: &[&TensorType],
    out: &TensorType,
) -> String {
    let ol: Vec<String> = operands.iter().map(|t| row_major(t.shape.rank())).collect();
    format!(
        "call_target_name = \"{target}\", api_version = 4 : i32, backend_config = {{{config}}}, operand_layouts = [{}], result_layouts = [{}]",
        ol.join(", "),
        row_major(out.shape.rank())
    )
}

/// The attributes (inside `{...}`) of a `stablehlo.custom_call` running `Op::Conv(c)` on
/// operands of types `x`, `k` with result type `out` through [`CONV_TARGET`].
pub fn conv_call_attrs(c: &ConvAttrs, x: &TensorType, k: &TensorType, out: &TensorType) -> String {
    conv_call_attrs_form(c, x, k, out, ConvForm::Plain)
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
    /// window strides are `r` and its kernel dilation `s`. 2-d ungrouped ones run as
    /// libtorch's CPU weight gradient does (im2col of `x`, one matrix product with `ct`).
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
}

/// Whether node `id` of `g` becomes a libtorch kernel call under `mode`, and how:
/// convolutions ([`CONV_TARGET`], reading through autograd's kernel reversal and operand
/// transposes, see [`ConvForm`]), the transpose that turns a weight-gradient convolution into
/// the weight gradient, and dots ([`DOT_TARGET`]). `None`: XLA lowers the node.
pub fn ffi_lowering(g: &Graph, id: NodeId, mode: FfiMode) -> Option<FfiLowering> {
    if mode == FfiMode::Off {
        return None;
    }
    let n = g.node(id);
    let ty = |o: NodeId| &g.node(o).ty;
    match &n.op {
        Op::DotGeneral(d) if n.operands.len() == 2 => {
            let (a, b) = (ty(n.operands[0]), ty(n.operands[1]));
            mode.dot(d, a, b).then(|| FfiLowering::Call {
                operands: n.operands.to_vec(),
                attrs: dot_call_attrs(d, a, b, &n.ty),
            })
        }
        Op::Conv(c) if n.operands.len() == 2 => {
            let (a, b) = (ty(n.operands[0]), ty(n.operands[1]));
            if !mode.conv(c, a, b) {
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
fn direct_weight_gradient(g: &Graph, conv: NodeId, mode: FfiMode) -> Option<(NodeId, NodeId)> {
    let n = g.node(conv);
    let Op::Conv(c) = &n.op else {
        return None;
    };
    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    if !mode.conv(c, a, b) || !weight_gradient_direct(c, a, b) {
        return None;
    }
    weight_gradient_operands_of(g, conv)
}

/// Is node `t` a `transpose(1, 0, ...)` of a weight-gradient convolution that
/// [`direct_weight_gradient`] accepts?
fn absorbs_weight_gradient(g: &Graph, t: NodeId, mode: FfiMode) -> bool {
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

/// [`conv_call_attrs`] with the kernel operand (of type `k`) in form `form`.
pub fn conv_call_attrs_form(
    c: &ConvAttrs,
    x: &TensorType,
    k: &TensorType,
    out: &TensorType,
    form: ConvForm,
) -> String {
    let config = format!(
        "batch_groups = {} : i64, feature_groups = {} : i64, form = {} : i64, lhs_dilation = {}, padding = {}, rhs_dilation = {}, strides = {}",
        c.batch_groups,
        c.feature_groups,
        form as i64,
        i64_array(c.lhs_dilation.iter().map(|&v| v as i64)),
        i64_array(c.padding.iter().flat_map(|&(l, h)| [l, h])),
        i64_array(c.rhs_dilation.iter().map(|&v| v as i64)),
        i64_array(c.strides.iter().map(|&v| v as i64)),
    );
    custom_call_attrs(CONV_TARGET, &config, &[x, k], out)
}

/// The attributes of a `stablehlo.custom_call` running `Op::DotGeneral(d)` through
/// [`DOT_TARGET`].
pub fn dot_call_attrs(d: &DotDims, a: &TensorType, b: &TensorType, out: &TensorType) -> String {
    let mut dims = vec![d.lhs_batch.len() as i64, d.lhs_contract.len() as i64];
    for v in [&d.lhs_batch, &d.rhs_batch, &d.lhs_contract, &d.rhs_contract] {
        dims.extend(v.iter().map(|&x| x as i64));
    }
    let config = format!("dims = {}", i64_array(dims));
    custom_call_attrs(DOT_TARGET, &config, &[a, b], out)
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

/// One full `stablehlo.custom_call` line (for tests and tools): `%res = ... : (x, k) -> out`.
pub fn conv_call_mlir(
    res: &str,
    args: [&str; 2],
    c: &ConvAttrs,
    x: &TensorType,
    k: &TensorType,
    out: &TensorType,
) -> String {
    format!(
        "{res} = \"stablehlo.custom_call\"({}, {}) {{{}}} : ({}, {}) -> {}",
        args[0],
        args[1],
        conv_call_attrs(c, x, k, out),
        tensor_type(x),
        tensor_type(k),
        tensor_type(out)
    )
}

/// [`conv_call_mlir`] for a dot.
pub fn dot_call_mlir(
    res: &str,
    args: [&str; 2],
    d: &DotDims,
    a: &TensorType,
    b: &TensorType,
    out: &TensorType,
) -> String {
    format!(
        "{res} = \"stablehlo.custom_call\"({}, {}) {{{}}} : ({}, {}) -> {}",
        args[0],
        args[1],
        dot_call_attrs(d, a, b, out),
        tensor_type(a),
        tensor_type(b),
        tensor_type(out)
    )
}

// ------------------------------------------------------------------------------------------
// Threads.
// ------------------------------------------------------------------------------------------

static THREADS: AtomicUsize = AtomicUsize::new(0);
static SERIALIZED: AtomicBool = AtomicBool::new(true);

thread_local! {
    /// The libtorch thread count last applied on this (XLA worker) thread; 0 = none.
    static APPLIED: Cell<usize> = const { Cell::new(0) };
}

/// Sets libtorch's intra-op thread count inside the kernels (0: libtorch's default, one per
/// core). Applied by each XLA worker thread before its next kernel, with
/// `at::set_num_threads`, which also changes the default of threads libtorch has not used
/// yet (process-wide).
pub fn set_threads(n: usize) {
    THREADS.store(n, Ordering::Relaxed);
}

/// The thread count set by [`set_threads`] (`None`: libtorch's default).
pub fn threads() -> Option<usize> {
    match THREADS.load(Ordering::Relaxed) {
        0 => None,
        n => Some(n),
    }
}

/// Whether kernels run one at a time (default `true`; see [`torch_lock`]).
pub fn set_serialized(on: bool) {
    SERIALIZED.store(on, Ordering::Relaxed);
}

/// See [`set_serialized`].
pub fn serialized() -> bool {
    SERIALIZED.load(Ordering::Relaxed)
}

/// Prepares the calling thread to run one kernel: applies [`set_threads`] and, when
/// [`serialized`], takes the process-wide kernel lock.
///
/// XLA's CPU runtime runs independent thunks concurrently on its worker threads (4 on 2
/// cores), so two custom calls can start at once. Each libtorch kernel already spreads over
/// all cores (OpenMP, one thread per core by default); two at once would oversubscribe them
/// with two OpenMP teams. With the lock, at most one libtorch kernel runs at a time.
pub fn torch_lock() -> Option<MutexGuard<'static, ()>> {
    static LOCK: Mutex<()> = Mutex::new(());
    let n = THREADS.load(Ordering::Relaxed);
    if n != 0 && APPLIED.get() != n {
        tch::set_num_threads(n as i32);
        APPLIED.set(n);
    }
    if SERIALIZED.load(Ordering::Relaxed) {
        Some(LOCK.lock())
    } else {
        None
    }
}

// ------------------------------------------------------------------------------------------
// Kernels.
// ------------------------------------------------------------------------------------------

/// The convolution kernel ([`CONV_TARGET`]).
pub(crate) struct ConvKernel;

/// The dot kernel ([`DOT_TARGET`]).
pub(crate) struct DotKernel;

fn usizes(call: &Call<'_>, name: &str) -> Result<Vec<usize>> {
    call.attr_ints(name)?
        .iter()
        .map(|&v| {
            usize::try_from(v).map_err(|_| Error::Invalid(format!("attribute {name}: {v} < 0")))
        })
        .collect()
}

fn conv_attrs_of(call: &Call<'_>) -> Result<ConvAttrs> {
    let pad = call.attr_ints("padding")?;
    if pad.len() % 2 != 0 {
        return Err(Error::Invalid(format!(
            "padding {pad:?} is not (low, high) pairs"
        )));
    }
    let c = ConvAttrs {
        strides: usizes(call, "strides")?,
        padding: pad.chunks(2).map(|p| (p[0], p[1])).collect(),
        lhs_dilation: usizes(call, "lhs_dilation")?,
        rhs_dilation: usizes(call, "rhs_dilation")?,
        feature_groups: call.attr_int("feature_groups")?.max(0) as usize,
        batch_groups: call.attr_int("batch_groups")?.max(0) as usize,
    };
    let n = c.strides.len();
    if c.padding.len() != n || c.lhs_dilation.len() != n || c.rhs_dilation.len() != n {
        return Err(Error::Invalid(format!(
            "inconsistent convolution attributes {c:?}"
        )));
    }
    Ok(c)
}

impl FfiKernel for ConvKernel {
    const TARGET: &'static str = CONV_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        if call.num_args() != 2 || call.num_rets() != 1 {
            return Err(Error::Invalid(format!(
                "expected 2 operands and 1 result, got {} and {}",
                call.num_args(),
                call.num_rets()
            )));
        }
        let c = conv_attrs_of(call)?;
        let form = match call.attr_int("form")? {
            0 => ConvForm::Plain,
            1 => ConvForm::ForwardWeight,
            2 => ConvForm::WeightGradient,
            3 => ConvForm::WeightGradientTransposed,
            f => return Err(Error::Invalid(format!("unknown form {f}"))),
        };
        let (xb, kb, ob) = (call.arg(0)?, call.arg(1)?, call.ret(0)?);
        let (xdims, kdims) = effective_dims(xb.dims, kb.dims, form, c.feature_groups as i64)?;
        let mut want = conv_out_dims(&c, &xdims, &kdims)?;
        if form == ConvForm::WeightGradientTransposed {
            want.swap(0, 1);
        }
        if want != ob.dims {
            return Err(Error::Invalid(format!(
                "convolution of {:?} by {:?} ({form:?}) with {c:?} gives {want:?}, the result buffer is {:?}",
                xb.dims, kb.dims, ob.dims
            )));
        }
        let _guard = torch_lock();
        let (x, k, out) = (xb.tensor()?, kb.tensor()?, ob.tensor()?);
        match form {
            ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
                weight_gradient_into(&c, &x, &k, &out, form == ConvForm::WeightGradientTransposed)
            }
            _ => {
                let r = conv_form(&c, &x, &k, form)?;
                // A second handle on the same storage: `copy_` takes `&mut`.
                out.shallow_clone().f_copy_(&r)?;
                Ok(())
            }
        }
    }
}

impl FfiKernel for DotKernel {
    const TARGET: &'static str = DOT_TARGET;

    fn run(call: &Call<'_>) -> Result<()> {
        if call.num_args() != 2 || call.num_rets() != 1 {
            return Err(Error::Invalid(format!(
                "expected 2 operands and 1 result, got {} and {}",
                call.num_args(),
                call.num_rets()
            )));
        }
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

fn dot_dims_of(dims: &[i64]) -> Result<DotDims> {
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

// ------------------------------------------------------------------------------------------
// Convolution on tch tensors (safe; used by the handler and by tests).
// ------------------------------------------------------------------------------------------

/// Extent of `size` elements dilated by `d` (zeros inserted between them).
fn dilated(size: i64, d: i64) -> i64 {
    if size == 0 {
        0
    } else {
        (size - 1) * d + 1
    }
}

/// The output dims of `Op::Conv(c)` on an input of dims `x` and a kernel of dims `k`, with
/// the checks StableHLO's `convolution` makes.
pub fn conv_out_dims(c: &ConvAttrs, x: &[i64], k: &[i64]) -> Result<Vec<i64>> {
    let n = c.strides.len();
    let bad = |m: &str| Error::Invalid(format!("convolution of {x:?} by {k:?} with {c:?}: {m}"));
    if x.len() != n + 2 || k.len() != n + 2 {
        return Err(bad("ranks do not match the spatial attributes"));
    }
    let (g, bg) = (c.feature_groups as i64, c.batch_groups as i64);
    if g < 1
        || bg < 1
        || c.strides
            .iter()
            .chain(&c.lhs_dilation)
            .chain(&c.rhs_dilation)
            .any(|&v| v < 1)
    {
        return Err(bad("groups, strides and dilations must be >= 1"));
    }
    if x[1] != k[1] * g || x[0] % bg != 0 || k[0] % g != 0 || k[0] % bg != 0 {
        return Err(bad("channels or batch do not divide into the groups"));
    }
    let mut out = vec![x[0] / bg, k[0]];
    for i in 0..n {
        let xd = dilated(x[i + 2], c.lhs_dilation[i] as i64) + c.padding[i].0 + c.padding[i].1;
        let kd = dilated(k[i + 2], c.rhs_dilation[i] as i64);
        let o = if xd < kd || xd < 0 {
            0
        } else {
            (xd - kd) / c.strides[i] as i64 + 1
        };
        out.push(o);
    }
    Ok(out)
}

/// The dims of the input and kernel a [`CONV_TARGET`] call convolves, given its operands'
/// dims and form.
pub fn effective_dims(
    x: &[i64],
    k: &[i64],
    form: ConvForm,
    groups: i64,
) -> Result<(Vec<i64>, Vec<i64>)> {
    if !matches!(
        form,
        ConvForm::WeightGradient | ConvForm::WeightGradientTransposed
    ) {
        return Ok((x.to_vec(), effective_kernel_dims(k, form, groups)?));
    }
    // x [N, C, *sp] -> [C/g, g*N, *sp]; ct [N, O, *sp'] -> [O, N, *sp'].
    if x.len() < 3 || k.len() != x.len() || k[0] != x[0] || groups < 1 || x[1] % groups != 0 {
        return Err(Error::Invalid(format!(
            "weight gradient of input {x:?} and cotangent {k:?} with {groups} groups: shapes do not match"
        )));
    }
    let mut xd = vec![x[1] / groups, groups * x[0]];
    xd.extend_from_slice(&x[2..]);
    let mut kd = vec![k[1], k[0]];
    kd.extend_from_slice(&k[2..]);
    Ok((xd, kd))
}

/// The dims of the kernel a [`CONV_TARGET`] call convolves with, given its kernel operand's
/// dims and form ([`ConvForm::Plain`] or [`ConvForm::ForwardWeight`]).
pub fn effective_kernel_dims(k: &[i64], form: ConvForm, groups: i64) -> Result<Vec<i64>> {
    match form {
        ConvForm::Plain | ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
            Ok(k.to_vec())
        }
        ConvForm::ForwardWeight => {
            if k.len() < 3 || groups < 1 || k[0] % groups != 0 {
                return Err(Error::Invalid(format!(
                    "forward weight {k:?} does not split into {groups} groups"
                )));
            }
            let mut d = vec![k[1] * groups, k[0] / groups];
            d.extend_from_slice(&k[2..]);
            Ok(d)
        }
    }
}

/// `Op::Conv(c)` of `x` by `k` with libtorch (the result may be a non-contiguous view).
pub fn conv(c: &ConvAttrs, x: &Tensor, k: &Tensor) -> Result<Tensor> {
    conv_form(c, x, k, ConvForm::Plain)
}

/// `Op::Conv(c)` of the input and kernel that operands `x` and `k` give in form `form`.
pub fn conv_form(c: &ConvAttrs, x: &Tensor, k: &Tensor, form: ConvForm) -> Result<Tensor> {
    if matches!(
        form,
        ConvForm::WeightGradient | ConvForm::WeightGradientTransposed
    ) {
        let t = form == ConvForm::WeightGradientTransposed;
        let (xd, kd) = effective_dims(&x.size(), &k.size(), form, c.feature_groups as i64)?;
        let mut dims = conv_out_dims(c, &xd, &kd)?;
        if t {
            dims.swap(0, 1);
        }
        let out = Tensor::f_empty(&dims, (x.kind(), x.device()))?;
        weight_gradient_into(c, x, k, &out, t)?;
        return Ok(out);
    }
    if form == ConvForm::ForwardWeight {
        // Without the transposed-convolution route below, materialize the kernel.
        let g = c.feature_groups as i64;
        if c.batch_groups > 1
            || transposed_params(c, &effective_kernel_dims(&k.size(), form, g)?).is_none()
        {
            let kk = transposed_weight(k, g)?;
            return conv_form(c, x, &kk, ConvForm::Plain);
        }
    }
    let xs = x.size();
    let ks = effective_kernel_dims(&k.size(), form, c.feature_groups as i64)?;
    let want = conv_out_dims(c, &xs, &ks)?;
    if want.contains(&0) {
        return Ok(Tensor::f_zeros(&want, (x.kind(), x.device()))?);
    }
    if c.batch_groups > 1 {
        return batch_grouped(c, x, k, &want);
    }
    let n = c.strides.len();
    let i64s = |v: &[usize]| -> Vec<i64> { v.iter().map(|&s| s as i64).collect() };
    let stride = i64s(&c.strides);
    let rdil = i64s(&c.rhs_dilation);
    let g = c.feature_groups as i64;
    let no_lhs_dil = c.lhs_dilation.iter().all(|&d| d == 1);
    if no_lhs_dil && form == ConvForm::Plain {
        // Symmetric padding of `low` computes a prefix-extended result whenever high <= low.
        if c.padding.iter().all(|&(l, h)| l >= 0 && h <= l) {
            let pad: Vec<i64> = c.padding.iter().map(|p| p.0).collect();
            let y = x.f_convolution(
                k,
                None::<Tensor>,
                &stride,
                &pad,
                &rdil,
                false,
                vec![0; n],
                g,
            )?;
            return narrow_to(y, &want);
        }
        let xp = pad_dilate(x, c)?;
        let y = xp.f_convolution(
            k,
            None::<Tensor>,
            &stride,
            vec![0; n],
            &rdil,
            false,
            vec![0; n],
            g,
        )?;
        return narrow_to(y, &want);
    }
    // Input-dilated (or given as a forward weight): a transposed convolution.
    if let Some((tpad, opad)) = transposed_params(c, &ks) {
        let w = match form {
            ConvForm::Plain | ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
                transposed_weight(k, g)?
            }
            ConvForm::ForwardWeight => k.shallow_clone(),
        };
        let ld = i64s(&c.lhs_dilation);
        let y = x.f_convolution(&w, None::<Tensor>, &ld, &tpad, &rdil, true, &opad, g)?;
        return narrow_to(y, &want);
    }
    let xp = pad_dilate(x, c)?;
    let y = xp.f_convolution(
        k,
        None::<Tensor>,
        &stride,
        vec![0; n],
        &rdil,
        false,
        vec![0; n],
        g,
    )?;
    narrow_to(y, &want)
}

/// Does a weight-gradient convolution with attributes `c`, input dims `lhs` (`[C/g, g*N,
/// *sp]`) and kernel dims `rhs` (`[O, N, *sp']`) run as libtorch's own weight gradient
/// (im2col and one matrix product, as `_slow_conv2d_backward` does: 2-d, one group, no
/// forward kernel dilation, and the forward convolution's padding recoverable as symmetric)?
fn slow_weight_gradient(c: &ConvAttrs, lhs: &[i64], rhs: &[i64]) -> bool {
    let n = c.strides.len();
    let Ok(out) = conv_out_dims(c, lhs, rhs) else {
        return false;
    };
    n == 2
        && c.feature_groups == 1
        && c.batch_groups == 1
        && c.strides.iter().all(|&s| s == 1)
        && c.lhs_dilation.iter().all(|&d| d == 1)
        && (0..n).all(|i| {
            // The forward convolution: stride = this one's kernel dilation, padding = its
            // low padding on both sides; its output must be the cotangent's extent.
            let (p, s, k) = (c.padding[i].0, c.rhs_dilation[i] as i64, out[i + 2]);
            let ext = lhs[i + 2] + 2 * p;
            p >= 0 && ext >= k && (ext - k) / s + 1 == rhs[i + 2]
        })
}

/// Whether the [`ConvForm::WeightGradient`] form of this convolution (operand types `x`,
/// `k` as in the graph) saves work: only when it runs as libtorch's weight gradient.
pub fn weight_gradient_direct(c: &ConvAttrs, x: &TensorType, k: &TensorType) -> bool {
    slow_weight_gradient(c, &x.shape.to_i64(), &k.shape.to_i64())
}

/// The [`ConvForm::WeightGradient`] convolution of input `x` and cotangent `ct`, written
/// into `out` (contiguous; `[C/g, O, *k]`, or `[O, C/g, *k]` when `transposed`).
fn weight_gradient_into(
    c: &ConvAttrs,
    x: &Tensor,
    ct: &Tensor,
    out: &Tensor,
    transposed: bool,
) -> Result<()> {
    let g = c.feature_groups as i64;
    let (xs, cs) = (x.size(), ct.size());
    let (lhs_dims, rhs_dims) = effective_dims(&xs, &cs, ConvForm::WeightGradient, g)?;
    let want = conv_out_dims(c, &lhs_dims, &rhs_dims)?;
    let n = c.strides.len();
    let mut out = out.shallow_clone();
    if slow_weight_gradient(c, &lhs_dims, &rhs_dims) {
        // libtorch's own CPU weight gradient (as `_slow_conv2d_backward` computes it):
        // patches [N, C*kh*kw, L] of the padded input times the cotangent [N, O, L], as one
        // matrix product over N*L: dW [O, C*kh*kw], the transposed result.
        let fwd_stride: Vec<i64> = c.rhs_dilation.iter().map(|&v| v as i64).collect();
        let pad: Vec<i64> = c.padding.iter().map(|p| p.0).collect();
        let ksz: Vec<i64> = want[2..].to_vec();
        let cols = x.f_im2col(&ksz, [1i64, 1], &pad, &fwd_stride)?;
        let (nb, o, ck, l) = (xs[0], cs[1], xs[1] * ksz[0] * ksz[1], cs[2] * cs[3]);
        let a = ct
            .f_reshape([nb, o, l])?
            .f_permute([1i64, 0, 2])?
            .f_reshape([o, nb * l])?;
        let b = cols.f_permute([1i64, 0, 2])?.f_reshape([ck, nb * l])?;
        if transposed {
            let _ = a.f_mm_out(&out.f_view([o, ck])?, &b.f_tr()?)?;
        } else {
            let dw = a.f_mm(&b.f_tr()?)?;
            out.f_copy_(&dw.f_view([o, xs[1], ksz[0], ksz[1]])?.f_transpose(0, 1)?)?;
        }
        return Ok(());
    }
    let mut grouped = vec![xs[0], g, xs[1] / g];
    grouped.extend_from_slice(&xs[2..]);
    let mut perm = vec![2i64, 1, 0];
    perm.extend(3..n as i64 + 3);
    let lhs = x
        .f_reshape(&grouped)?
        .f_permute(&perm)?
        .f_reshape(&lhs_dims)?;
    let mut p2 = vec![1i64, 0];
    p2.extend(2..n as i64 + 2);
    let rhs = ct.f_permute(&p2)?.f_contiguous()?;
    let r = conv_form(c, &lhs, &rhs, ConvForm::Plain)?;
    if transposed {
        out.f_copy_(&r.f_permute(&p2)?)?;
    } else {
        out.f_copy_(&r)?;
    }
    Ok(())
}

/// A convolution with window stride 1 (and no batch groups) is a transposed convolution with
/// stride `lhs_dilation`, when its padding maps onto torch's `(padding, output_padding)`:
/// returns them, for a kernel of dims `ks`.
fn transposed_params(c: &ConvAttrs, ks: &[i64]) -> Option<(Vec<i64>, Vec<i64>)> {
    if c.batch_groups > 1 || c.strides.iter().any(|&s| s != 1) {
        return None;
    }
    let n = c.strides.len();
    let mut tpad = Vec::with_capacity(n);
    let mut opad = Vec::with_capacity(n);
    for i in 0..n {
        let (lo, hi) = c.padding[i];
        let r = c.rhs_dilation[i] as i64;
        let p = r * (ks[i + 2] - 1) - lo;
        let d = c.lhs_dilation[i] as i64;
        // torch requires 0 <= output_padding < max(stride, dilation); a smaller high padding
        // gives a longer result whose prefix is the answer.
        let op = (hi - lo).max(0);
        if p < 0 || op >= d.max(r) {
            return None;
        }
        tpad.push(p);
        opad.push(op);
    }
    Some((tpad, opad))
}

/// The weight of the transposed convolution equal to a convolution by `k` (`[O, C/g, *k]`):
/// spatially reversed, with in and out channels swapped within each group (`[C, O/g, *k]`).
fn transposed_weight(k: &Tensor, g: i64) -> Result<Tensor> {
    let s = k.size();
    let n = s.len() - 2;
    let sp: Vec<i64> = (2..s.len() as i64).collect();
    let f = k.f_flip(&sp)?;
    let mut grouped = vec![g, s[0] / g, s[1]];
    grouped.extend_from_slice(&s[2..]);
    let mut perm = vec![0i64, 2, 1];
    perm.extend((3..n as i64 + 3).collect::<Vec<_>>());
    let mut merged = vec![s[1] * g, s[0] / g];
    merged.extend_from_slice(&s[2..]);
    Ok(f.f_reshape(&grouped)?
        .f_permute(&perm)?
        .f_reshape(&merged)?)
}

/// `x` with `lhs_dilation - 1` zeros between elements and then `padding` (negative: crop) on
/// each spatial dim.
fn pad_dilate(x: &Tensor, c: &ConvAttrs) -> Result<Tensor> {
    let n = c.strides.len();
    let s = x.size();
    let mut x = x.shallow_clone();
    if c.lhs_dilation.iter().any(|&d| d > 1) {
        let mut ds = s[..2].to_vec();
        for i in 0..n {
            ds.push(dilated(s[i + 2], c.lhs_dilation[i] as i64));
        }
        let z = Tensor::f_zeros(&ds, (x.kind(), x.device()))?;
        let mut view = z.shallow_clone();
        for i in 0..n {
            let d = c.lhs_dilation[i] as i64;
            view = view.f_slice((i + 2) as i64, 0, ds[i + 2], d)?;
        }
        view.f_copy_(&x)?;
        x = z;
    }
    // constant_pad_nd takes (low, high) pairs from the last dim backwards.
    let mut pads = Vec::with_capacity(2 * n);
    for i in (0..n).rev() {
        pads.push(c.padding[i].0);
        pads.push(c.padding[i].1);
    }
    if pads.iter().any(|&p| p != 0) {
        x = x.f_constant_pad_nd(&pads)?;
    }
    Ok(x)
}

/// The leading `want` elements of `y` along every dim (a view).
fn narrow_to(y: Tensor, want: &[i64]) -> Result<Tensor> {
    let s = y.size();
    if s.len() != want.len() || s.iter().zip(want).any(|(a, b)| a < b) {
        return Err(Error::Invalid(format!(
            "libtorch convolution gave {s:?}, expected at least {want:?}"
        )));
    }
    let mut y = y;
    for (i, (&have, &w)) in s.iter().zip(want).enumerate() {
        if have != w {
            y = y.f_narrow(i as i64, 0, w)?;
        }
    }
    Ok(y)
}

/// A batch-grouped convolution: batch block `g` of the input with output-feature block `g` of
/// the kernel, as one feature-grouped convolution over the blocks moved into channels.
fn batch_grouped(c: &ConvAttrs, x: &Tensor, k: &Tensor, want: &[i64]) -> Result<Tensor> {
    let bg = c.batch_groups as i64;
    let s = x.size();
    let mut grouped = vec![bg, s[0] / bg];
    grouped.extend_from_slice(&s[1..]);
    let mut perm: Vec<i64> = vec![1, 0];
    perm.extend(2..(grouped.len() as i64));
    let mut merged = vec![s[0] / bg, bg * s[1]];
    merged.extend_from_slice(&s[2..]);
    let xg = x
        .f_reshape(&grouped)?
        .f_permute(&perm)?
        .f_reshape(&merged)?;
    let mut c2 = c.clone();
    c2.batch_groups = 1;
    c2.feature_groups = c.batch_groups;
    let y = conv(&c2, &xg, k)?;
    narrow_to(y, want)
}

// ------------------------------------------------------------------------------------------
// Dot on tch tensors.
// ------------------------------------------------------------------------------------------

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

// ------------------------------------------------------------------------------------------
// Registration and self-test.
// ------------------------------------------------------------------------------------------

/// Registers the kernels with `backend`'s plugin and checks them by compiling and running a
/// small graph (a strided, padded convolution and a `Linear`-layout dot through the kernels)
/// against libtorch run directly. `Err` says why the kernels cannot be used.
pub(crate) fn enable(backend: &super::XlaBackend) -> std::result::Result<(), String> {
    if backend.platform() != "cpu" {
        return Err(format!(
            "platform {:?} is not cpu (the kernels work on host memory)",
            backend.platform()
        ));
    }
    let api = &backend.inner.api;
    if !api.has_ffi_extension() {
        return Err("the plugin has no PJRT FFI extension".into());
    }
    api.register_ffi_kernel::<ConvKernel>()
        .and_then(|()| api.register_ffi_kernel::<DotKernel>())
        .map_err(|e| format!("registering the FFI handlers failed: {e}"))?;
    self_test(backend).map_err(|e| format!("the FFI self-test failed: {e}"))
}

fn self_test(backend: &super::XlaBackend) -> Result<()> {
    use crate::backend::{Backend, HostTensor};
    let xt = TensorType::new(DType::F32, [1, 2, 5, 5]);
    let kt = TensorType::new(DType::F32, [4, 1, 3, 3]);
    let c = ConvAttrs {
        strides: vec![2, 1],
        padding: vec![(1, 0), (1, 1)],
        lhs_dilation: vec![1, 1],
        rhs_dilation: vec![1, 1],
        feature_groups: 2,
        batch_groups: 1,
    };
    let ot = TensorType::new(DType::F32, [1, 4, 2, 5]);
    let at = TensorType::new(DType::F32, [3, 4]);
    let wt = TensorType::new(DType::F32, [2, 4]);
    let d = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let dt = TensorType::new(DType::F32, [3, 2]);
    let mlir = format!(
        "module @kiln_ffi_selftest {{\n  func.func public @main(%x: {}, %k: {}, %a: {}, %w: {}) -> ({}, {}) {{\n    {}\n    {}\n    \"func.return\"(%c, %d) : ({}, {}) -> ()\n  }}\n}}\n",
        tensor_type(&xt),
        tensor_type(&kt),
        tensor_type(&at),
        tensor_type(&wt),
        tensor_type(&ot),
        tensor_type(&dt),
        conv_call_mlir("%c", ["%x", "%k"], &c, &xt, &kt, &ot),
        dot_call_mlir("%d", ["%a", "%w"], &d, &at, &wt, &dt),
        tensor_type(&ot),
        tensor_type(&dt),
    );
    let exe = backend.compile_mlir(&mlir)?;
    let vals = |n: usize, s: f32| -> Vec<f32> {
        (0..n).map(|i| ((i * 7 % 11) as f32 - 5.0) * s).collect()
    };
    let inputs = [
        HostTensor::from_slice(xt.shape.dims(), &vals(50, 0.25))?,
        HostTensor::from_slice(kt.shape.dims(), &vals(36, 0.5))?,
        HostTensor::from_slice(at.shape.dims(), &vals(12, 1.0))?,
        HostTensor::from_slice(wt.shape.dims(), &vals(8, 0.75))?,
    ];
    let bufs: Vec<_> = inputs
        .iter()
        .map(|h| backend.to_device(h))
        .collect::<Result<_>>()?;
    let raw: Vec<_> = bufs.iter().map(|b| b.raw()).collect();
    let outs = exe.execute(&raw)?;
    if outs.len() != 2 {
        return Err(Error::Invalid(format!(
            "{} outputs, expected 2",
            outs.len()
        )));
    }
    let read = |b: &super::pjrt::Buffer| -> Result<Vec<f32>> {
        let bytes = b.to_host_vec()?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    };
    let (got_c, got_d) = (read(&outs[0])?, read(&outs[1])?);
    let t = |v: Vec<f32>, ty: &TensorType| -> Result<Tensor> {
        Ok(Tensor::from_slice(&v).f_reshape(ty.shape.to_i64())?)
    };
    let x = t(vals(50, 0.25), &xt)?;
    let k = t(vals(36, 0.5), &kt)?;
    let a = t(vals(12, 1.0), &at)?;
    let w = t(vals(8, 0.75), &wt)?;
    let want_c = x.f_constant_pad_nd([1i64, 1, 1, 0])?.f_conv2d(
        &k,
        None::<Tensor>,
        [2i64, 1],
        [0i64, 0],
        [1i64, 1],
        2,
    )?;
    let want_d = a.f_matmul(&w.f_tr()?)?;
    for (name, got, want) in [("convolution", got_c, want_c), ("dot", got_d, want_d)] {
        let want: Vec<f32> = Vec::<f32>::try_from(want.f_flatten(0, -1)?)?;
        if got.len() != want.len()
            || got
                .iter()
                .zip(&want)
                .any(|(g, w)| (g - w).abs() > 1e-4 * (1.0 + w.abs()))
        {
            return Err(Error::Invalid(format!(
                "{name} through the kernel gave {got:?}, libtorch gives {want:?}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "kernels_tests.rs"]
mod tests;
