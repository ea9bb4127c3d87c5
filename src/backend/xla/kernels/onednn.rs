//! libtorch's oneDNN convolution on weights packed ahead of time, with its epilogue fused:
//! `mkldnn::_convolution_pointwise` (bias, then an activation) and its `.binary` overload
//! (bias, then the sum with another tensor, then an activation), the ops PyTorch's inductor
//! calls for frozen CPU convolutions. libtorch exports both as plain C functions, the shim
//! AOTInductor's compiled models link against (`torch/csrc/inductor/aoti_torch/c/
//! shim_cpu.h`, a C ABI libtorch keeps stable); their handles are `at::Tensor*`, which is
//! what a `tch::Tensor` holds.
//!
//! Why: with the weight packed in oneDNN's blocked layout for the convolution's shape
//! (`mkldnn_reorder_conv2d_weight` with the input size) and activations channels-last, oneDNN
//! picks its fastest (brgemm) kernels; libtorch's plain `conv2d` on NCHW tensors does not.
//! Measured on a 2-vCPU AMD EPYC (Zen 5, AVX-512), batch 4, µs, `conv2d` NCHW / packed
//! channels-last: 3→64 7×7/2 on 64×64 1174 / 258, 64→64 3×3 on 16×16 298 / 204, 256→256
//! 3×3 on 4×4 519 / 337, 512→512 3×3 on 2×2 933 / 332, 1×1 64→128/2 81 / 46, depthwise
//! 144 ch 3×3 on 16×16 100 / 49. Packing itself is slow (0.03–2 ms, more for large
//! weights), so packed weights are kept (see `weights.rs`) rather than packed per call.
//!
//! This module is the crate's one binding to libtorch outside tch (the C shim above), so,
//! like the PJRT bindings, it is allowed `unsafe`; each block says why it is sound. Besides
//! the oneDNN ops, it makes the tensors that compiled calls return (`empty_cpu`, the shim's
//! `empty_strided`, cheaper than tch's `empty`).
#![allow(unsafe_code)]

use crate::backend::xla::pjrt::ffi::Call;
use crate::error::{Error, Result};
use std::ffi::{c_char, c_void};
use tch::Tensor;

/// `AtenTensorHandle`: an `at::Tensor*`.
type Handle = *mut c_void;

extern "C" {
    // From libtorch_cpu (shim_cpu.h). Return 0 on success; on failure libtorch logs the
    // exception's message to stderr and returns 1.
    fn aoti_torch_cpu_mkldnn__convolution_pointwise(
        x: Handle,
        w: Handle,
        b: *mut Handle,
        padding: *const i64,
        padding_len: i64,
        stride: *const i64,
        stride_len: i64,
        dilation: *const i64,
        dilation_len: i64,
        groups: i64,
        attr: *const c_char,
        scalars: *const *const f64,
        scalars_len: i64,
        algorithm: *const *const c_char,
        ret0: *mut Handle,
    ) -> i32;

    fn aoti_torch_cpu_mkldnn__convolution_pointwise_binary(
        x: Handle,
        other: Handle,
        w: Handle,
        b: *mut Handle,
        padding: *const i64,
        padding_len: i64,
        stride: *const i64,
        stride_len: i64,
        dilation: *const i64,
        dilation_len: i64,
        groups: i64,
        binary_attr: *const c_char,
        alpha: *mut f64,
        unary_attr: *const *const c_char,
        unary_scalars: *const *const f64,
        unary_scalars_len: i64,
        unary_algorithm: *const *const c_char,
        ret0: *mut Handle,
    ) -> i32;

    fn aoti_torch_cpu__linear_pointwise(
        x: Handle,
        w: Handle,
        b: *mut Handle,
        attr: *const c_char,
        scalars: *const *const f64,
        scalars_len: i64,
        algorithm: *const *const c_char,
        ret0: *mut Handle,
    ) -> i32;

    fn aoti_torch_cpu__linear_pointwise_binary(
        x: Handle,
        other: Handle,
        w: Handle,
        b: *mut Handle,
        attr: *const c_char,
        ret0: *mut Handle,
    ) -> i32;

    fn aoti_torch_cpu_convolution_backward(
        grad_output: Handle,
        input: Handle,
        weight: Handle,
        bias_sizes: *const *const i64,
        bias_sizes_len: i64,
        stride: *const i64,
        stride_len: i64,
        padding: *const i64,
        padding_len: i64,
        dilation: *const i64,
        dilation_len: i64,
        transposed: i32,
        output_padding: *const i64,
        output_padding_len: i64,
        groups: i64,
        output_mask: *const i32,
        output_mask_len: i64,
        ret0: *mut Handle,
        ret1: *mut Handle,
        ret2: *mut Handle,
    ) -> i32;

    fn aoti_torch_new_tensor_handle(orig: Handle, new: *mut Handle) -> i32;

    fn aoti_torch_empty_strided(
        ndim: i64,
        sizes: *const i64,
        strides: *const i64,
        dtype: i32,
        device_type: i32,
        device_index: i32,
        ret: *mut Handle,
    ) -> i32;
    fn aoti_torch_device_type_cpu() -> i32;
    fn aoti_torch_dtype_float32() -> i32;
    fn aoti_torch_dtype_float64() -> i32;
    fn aoti_torch_dtype_int32() -> i32;
    fn aoti_torch_dtype_int64() -> i32;

    /// Calls an operator by name with a stack of `StableIValue`s (u64): a tensor argument is
    /// an owning handle the call consumes, `None` is 0; the results replace the arguments,
    /// each tensor a new owning handle.
    fn aoti_torch_call_dispatcher(
        op: *const c_char,
        overload: *const c_char,
        stack: *mut u64,
    ) -> i32;
}

/// The geometry of a 2-d convolution oneDNN runs: symmetric padding, window strides, kernel
/// dilation, feature groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Geometry {
    pub padding: [i64; 2],
    pub stride: [i64; 2],
    pub dilation: [i64; 2],
    pub groups: i64,
}

/// The activation applied last.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Activation {
    None,
    /// `max(x, 0)`.
    Relu,
    /// `min(max(x, lo), hi)` (oneDNN's "hardtanh"; ReLU6 is `(0, 6)`).
    Clamp(f64, f64),
    /// `x · (1 + erf(x / √2)) / 2` (linear only).
    Gelu,
}

impl Activation {
    /// The code a kernel call's activation attribute carries (a clamp's bounds go in the
    /// attributes `lo` and `hi`); read back by [`Activation::from_call`].
    pub(crate) fn code(&self) -> i64 {
        match self {
            Activation::None => 0,
            Activation::Relu => 1,
            Activation::Clamp(..) => 2,
            Activation::Gelu => 3,
        }
    }

    /// The activation a kernel call's attribute `name` names (see [`Activation::code`]).
    pub(crate) fn from_call(call: &Call<'_>, name: &str) -> Result<Activation> {
        match call.attr_int(name)? {
            0 => Ok(Activation::None),
            1 => Ok(Activation::Relu),
            2 => Ok(Activation::Clamp(
                call.attr_f64("lo")?,
                call.attr_f64("hi")?,
            )),
            3 => Ok(Activation::Gelu),
            a => Err(Error::Invalid(format!("unknown activation {a} ({name})"))),
        }
    }

    /// The pointwise op's `attr`, scalars and algorithm.
    fn attr(
        &self,
    ) -> (
        &'static std::ffi::CStr,
        Vec<f64>,
        Option<&'static std::ffi::CStr>,
    ) {
        match *self {
            Activation::None => (c"none", vec![], None),
            Activation::Relu => (c"relu", vec![], None),
            Activation::Clamp(lo, hi) => (c"hardtanh", vec![lo, hi], None),
            Activation::Gelu => (c"gelu", vec![], Some(c"none")),
        }
    }
}

/// A new dense CPU tensor of `kind` and `dims` with uninitialized values, as
/// `Tensor::empty`, made by `at::detail::empty_strided_cpu` (the shim's
/// `aoti_torch_empty_strided`) rather than through the dispatcher: 250 ns against tch's 490
/// for a `[2, 10]` f32 tensor (2-vCPU Xeon), paid once per result a compiled call returns.
/// Kinds other than f32, f64, i32 and i64 take tch's path.
pub(crate) fn empty_cpu(kind: tch::Kind, dims: &[i64]) -> Result<Tensor> {
    // SAFETY: the dtype functions only return constants.
    let dtype = unsafe {
        match kind {
            tch::Kind::Float => aoti_torch_dtype_float32(),
            tch::Kind::Double => aoti_torch_dtype_float64(),
            tch::Kind::Int => aoti_torch_dtype_int32(),
            tch::Kind::Int64 => aoti_torch_dtype_int64(),
            _ => return Ok(Tensor::f_empty(dims, (kind, tch::Device::Cpu))?),
        }
    };
    let mut strides = smallvec::SmallVec::<[i64; 6]>::from_elem(1, dims.len());
    for k in (0..dims.len().saturating_sub(1)).rev() {
        strides[k] = strides[k + 1] * dims[k + 1].max(1);
    }
    let mut out: Handle = std::ptr::null_mut();
    // SAFETY: `dims` and `strides` hold `dims.len()` values each; the shim writes a new
    // owning handle to `out` on success (0) and nothing on failure.
    let status = unsafe {
        aoti_torch_empty_strided(
            dims.len() as i64,
            dims.as_ptr(),
            strides.as_ptr(),
            dtype,
            aoti_torch_device_type_cpu(),
            0,
            &mut out,
        )
    };
    if status != 0 || out.is_null() {
        return Err(Error::Invalid(format!(
            "libtorch could not make an empty {kind:?} tensor of dims {dims:?} (its message is on stderr)"
        )));
    }
    // SAFETY: `out` is a new owning `at::Tensor*`, the handle type `tch::Tensor` wraps; the
    // returned tensor owns it.
    Ok(unsafe { Tensor::from_ptr(out.cast()) })
}

fn handle(t: &Tensor) -> Handle {
    t.as_ptr().cast::<c_void>().cast_mut()
}

/// Packs an f32 weight `[O, C/g, kh, kw]` (dense) into oneDNN's layout for a convolution of
/// geometry `geo` on inputs of dims `input` (`[N, C, H, W]`), channels-last activations.
pub(crate) fn pack_weight(w: &Tensor, geo: &Geometry, input: [i64; 4]) -> Result<Tensor> {
    let w = w.f_contiguous()?.f_to_mkldnn(None)?;
    Ok(w.f_mkldnn_reorder_conv2d_weight(
        geo.padding,
        geo.stride,
        geo.dilation,
        geo.groups,
        Some(&input[..]),
    )?)
}

/// `act(conv(x, w) + bias [+ other])` by oneDNN: `x` an f32 `[N, C, H, W]` tensor in
/// channels-last memory, `w` a weight packed by [`pack_weight`] for `x`'s dims, `bias` `[O]`,
/// `other` (added before the activation) shaped like the result, channels-last. The result
/// is a new channels-last `[N, O, H', W']` tensor. After `other`, oneDNN fuses no activation
/// but ReLU: [`Activation::Clamp`] with `other` is an error.
pub(crate) fn conv_pointwise(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    other: Option<&Tensor>,
    geo: &Geometry,
    act: Activation,
) -> Result<Tensor> {
    let fail = |what: &str| {
        Error::Invalid(format!(
            "libtorch's mkldnn::_convolution_pointwise{what} failed on an input of {:?} with a packed weight of {:?}, bias {:?}, {geo:?}, {act:?} (libtorch's message is on stderr)",
            x.size(),
            w.size(),
            bias.map(|b| b.size()),
        ))
    };
    let (attr, scalars, algorithm) = act.attr();
    if algorithm.is_some() {
        return Err(fail(" (no GELU in a convolution's epilogue)"));
    }
    let scalar_ptrs: Vec<*const f64> = scalars.iter().map(std::ptr::from_ref).collect();
    let mut b = bias.map_or(std::ptr::null_mut(), handle);
    let b_ptr: *mut Handle = if b.is_null() {
        std::ptr::null_mut()
    } else {
        &mut b
    };
    let mut ret: Handle = std::ptr::null_mut();
    let status = match other {
        None => {
            // SAFETY: every handle is a live `at::Tensor*` borrowed for the call (the shim
            // copies what it keeps); the arrays hold the lengths passed; `b_ptr` is null
            // (no bias) or points to a live handle; `algorithm` null means none; `ret`
            // receives a new `at::Tensor*` that we own.
            unsafe {
                aoti_torch_cpu_mkldnn__convolution_pointwise(
                    handle(x),
                    handle(w),
                    b_ptr,
                    geo.padding.as_ptr(),
                    2,
                    geo.stride.as_ptr(),
                    2,
                    geo.dilation.as_ptr(),
                    2,
                    geo.groups,
                    attr.as_ptr(),
                    scalar_ptrs.as_ptr(),
                    scalar_ptrs.len() as i64,
                    std::ptr::null(),
                    &mut ret,
                )
            }
        }
        Some(o) => {
            // After the sum oneDNN fuses ReLU only, and "no activation" is a null string.
            let unary: *const c_char = match act {
                Activation::None => std::ptr::null(),
                Activation::Relu => attr.as_ptr(),
                Activation::Clamp(..) | Activation::Gelu => {
                    return Err(fail(".binary (no clamp after a sum)"))
                }
            };
            let mut alpha = 1.0f64;
            // SAFETY: as above; `unary` points to a NUL-terminated string for the call and
            // `alpha` to a live f64.
            unsafe {
                aoti_torch_cpu_mkldnn__convolution_pointwise_binary(
                    handle(x),
                    handle(o),
                    handle(w),
                    b_ptr,
                    geo.padding.as_ptr(),
                    2,
                    geo.stride.as_ptr(),
                    2,
                    geo.dilation.as_ptr(),
                    2,
                    geo.groups,
                    c"add".as_ptr(),
                    &mut alpha,
                    if unary.is_null() {
                        std::ptr::null()
                    } else {
                        &unary
                    },
                    scalar_ptrs.as_ptr(),
                    scalar_ptrs.len() as i64,
                    std::ptr::null(),
                    &mut ret,
                )
            }
        }
    };
    if status != 0 || ret.is_null() {
        return Err(fail(if other.is_some() { ".binary" } else { "" }));
    }
    // SAFETY: on success `ret` is a new heap `at::Tensor*` owned by the caller, exactly what
    // a `tch::Tensor` owns (freed by its drop).
    Ok(unsafe { Tensor::from_ptr(ret.cast()) })
}

/// The weight gradient of a 2-d convolution (`at::convolution_backward` with only the weight's
/// gradient asked for, which libtorch runs on oneDNN for f32, as eager autograd does): the
/// forward input `x` `[N, C, H, W]`, the cotangent `ct` `[N, O, H', W']`, the weight's dims
/// `[O, C/g, kh, kw]` and the forward geometry. Returns a new `[O, C/g, kh, kw]` tensor.
pub(crate) fn conv_weight_gradient(
    x: &Tensor,
    ct: &Tensor,
    weight_dims: [i64; 4],
    geo: &Geometry,
) -> Result<Tensor> {
    // Only the weight's dims and type are read.
    let w = Tensor::f_empty(weight_dims, (x.kind(), x.device()))?;
    let (x, ct) = (x.f_contiguous()?, ct.f_contiguous()?);
    let zeros = [0i64; 2];
    let mask = [0i32, 1, 0];
    let mut rets: [Handle; 3] = [std::ptr::null_mut(); 3];
    let [r0, r1, r2] = &mut rets;
    // SAFETY: live tensors borrowed for the call; every array holds the length passed; no
    // bias sizes (null); `rets` receive three owned handles (undefined tensors for the
    // gradients not asked for).
    let status = unsafe {
        aoti_torch_cpu_convolution_backward(
            handle(&ct),
            handle(&x),
            handle(&w),
            std::ptr::null(),
            0,
            geo.stride.as_ptr(),
            2,
            geo.padding.as_ptr(),
            2,
            geo.dilation.as_ptr(),
            2,
            0,
            zeros.as_ptr(),
            2,
            geo.groups,
            mask.as_ptr(),
            3,
            r0,
            r1,
            r2,
        )
    };
    let mut owned: Vec<Option<Tensor>> = rets
        .iter()
        .map(|&h| {
            // SAFETY: a non-null handle the call returned is an owned `at::Tensor*`: wrapped
            // so that it is freed.
            (!h.is_null()).then(|| unsafe { Tensor::from_ptr(h.cast()) })
        })
        .collect();
    match owned[1].take() {
        Some(dw) if status == 0 && dw.defined() => Ok(dw),
        _ => Err(Error::Invalid(format!(
            "libtorch's convolution_backward (weight) failed on an input of {:?}, a cotangent of {:?}, weight {weight_dims:?}, {geo:?} (libtorch's message is on stderr)",
            x.size(),
            ct.size()
        ))),
    }
}

/// Whether oneDNN runs its AVX-512 kernels on this machine: the CPU has AVX-512 F, BW, VL
/// and DQ (oneDNN's `avx512_core`), and `ONEDNN_MAX_CPU_ISA` (or its older name
/// `DNNL_MAX_CPU_ISA`), if set, allows them.
///
/// Its packed matrix products are ~2× faster than MKL's with them (2-vCPU Zen 5) and level
/// with MKL without (2-vCPU Zen 3, AVX2): see [`super::FfiMode::auto_packed_linear`].
pub fn avx512() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let limit = std::env::var("ONEDNN_MAX_CPU_ISA")
            .or_else(|_| std::env::var("DNNL_MAX_CPU_ISA"))
            .ok();
        cpu_has_avx512() && limit.as_deref().is_none_or(isa_allows_avx512)
    })
}

/// Does a `ONEDNN_MAX_CPU_ISA` value allow AVX-512 kernels? (oneDNN's names: `SSE41`,
/// `AVX2`, `AVX512_CORE`, `AVX10_1_512`, `AVX512_CORE_AMX`, `ALL`, ...; any case.)
fn isa_allows_avx512(value: &str) -> bool {
    let v = value.trim().to_ascii_uppercase();
    v.is_empty()
        || ["AVX512", "AVX10", "AMX"].iter().any(|p| v.starts_with(p))
        || v == "ALL"
        || v == "DEFAULT"
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512dq")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx512() -> bool {
    false
}

/// Packs an f32 `Linear` weight `[N, K]` (dense) in oneDNN's layout for its matrix product
/// (`mkldnn::_reorder_linear_weight`, called through libtorch's dispatcher).
pub(crate) fn pack_linear_weight(w: &Tensor) -> Result<Tensor> {
    let w = w.f_contiguous()?;
    let mut arg: Handle = std::ptr::null_mut();
    // SAFETY: `w` is a live tensor; `arg` receives a new owning handle on it.
    if unsafe { aoti_torch_new_tensor_handle(handle(&w), &mut arg) } != 0 || arg.is_null() {
        return Err(Error::Invalid("libtorch: no new tensor handle".into()));
    }
    // (weight, batch_size = None)
    let mut stack: [u64; 2] = [arg as u64, 0];
    // SAFETY: the op's schema is `(Tensor self, int? batch_size=None) -> Tensor`; the stack
    // holds its two arguments (an owning handle, consumed by the call, and None) and has room
    // for its one result, a new owning handle.
    let status = unsafe {
        aoti_torch_call_dispatcher(
            c"mkldnn::_reorder_linear_weight".as_ptr(),
            c"".as_ptr(),
            stack.as_mut_ptr(),
        )
    };
    if status != 0 || stack[0] == 0 {
        return Err(Error::Invalid(format!(
            "libtorch's mkldnn::_reorder_linear_weight failed on a weight of {:?} (libtorch's message is on stderr)",
            w.size()
        )));
    }
    // SAFETY: on success `stack[0]` is a new owning `at::Tensor*`.
    Ok(unsafe { Tensor::from_ptr(stack[0] as Handle as *mut _) })
}

/// `act(x · wᵀ + bias [+ other])` by oneDNN: `x` an f32 `[.., K]` contiguous tensor, `w` a
/// weight packed by [`pack_linear_weight`], `bias` `[N]`, `other` shaped like the result. The
/// result is a new contiguous `[.., N]` tensor. With `other` there is no activation.
pub(crate) fn linear_pointwise(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    other: Option<&Tensor>,
    act: Activation,
) -> Result<Tensor> {
    let fail = |what: &str| {
        Error::Invalid(format!(
            "libtorch's mkldnn::_linear_pointwise{what} failed on an input of {:?} with a packed weight of {:?}, bias {:?}, {act:?} (libtorch's message is on stderr)",
            x.size(),
            w.size(),
            bias.map(|b| b.size()),
        ))
    };
    let (attr, scalars, algorithm) = act.attr();
    let scalar_ptrs: Vec<*const f64> = scalars.iter().map(std::ptr::from_ref).collect();
    let algorithm_ptr: *const c_char = algorithm.map_or(std::ptr::null(), |a| a.as_ptr());
    let mut b = bias.map_or(std::ptr::null_mut(), handle);
    let b_ptr: *mut Handle = if b.is_null() {
        std::ptr::null_mut()
    } else {
        &mut b
    };
    let mut ret: Handle = std::ptr::null_mut();
    let status = match other {
        None => {
            // SAFETY: live handles borrowed for the call; `b_ptr` null or pointing to a live
            // handle; `scalars` holds `scalars_len` pointers to live f64s; `algorithm` null
            // (none) or pointing to a NUL-terminated string; `ret` receives an owned handle.
            unsafe {
                aoti_torch_cpu__linear_pointwise(
                    handle(x),
                    handle(w),
                    b_ptr,
                    attr.as_ptr(),
                    scalar_ptrs.as_ptr(),
                    scalar_ptrs.len() as i64,
                    if algorithm_ptr.is_null() {
                        std::ptr::null()
                    } else {
                        &algorithm_ptr
                    },
                    &mut ret,
                )
            }
        }
        Some(o) => {
            if act != Activation::None {
                return Err(fail(".binary (no activation after a sum)"));
            }
            // SAFETY: as above.
            unsafe {
                aoti_torch_cpu__linear_pointwise_binary(
                    handle(x),
                    handle(o),
                    handle(w),
                    b_ptr,
                    c"add".as_ptr(),
                    &mut ret,
                )
            }
        }
    };
    if status != 0 || ret.is_null() {
        return Err(fail(if other.is_some() { ".binary" } else { "" }));
    }
    // SAFETY: on success `ret` is a new owning `at::Tensor*`.
    Ok(unsafe { Tensor::from_ptr(ret.cast()) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    /// `empty_cpu` makes what `Tensor::empty` makes: the kind, the dims (scalars and empty
    /// dims included), dense row-major strides, its own writable memory.
    #[test]
    fn empty_cpu_is_tch_empty() {
        let shapes: [&[i64]; 5] = [&[], &[7], &[2, 10], &[3, 0, 4], &[2, 3, 4, 5]];
        for kind in [
            Kind::Float,
            Kind::Double,
            Kind::Int,
            Kind::Int64,
            Kind::Half,
            Kind::Bool,
        ] {
            for dims in shapes {
                let t = empty_cpu(kind, dims).unwrap();
                let want = Tensor::empty(dims, (kind, tch::Device::Cpu));
                assert_eq!(t.kind(), kind);
                assert_eq!(t.size(), dims.to_vec(), "{kind:?}");
                assert_eq!(t.stride(), want.stride(), "{kind:?} {dims:?}");
                assert_eq!(t.device(), tch::Device::Cpu);
                assert!(t.is_contiguous());
                if t.numel() > 0 {
                    let mut t = t;
                    let _ = t.fill_(1);
                    assert_eq!(t.sum(Kind::Double).double_value(&[]), t.numel() as f64);
                }
            }
        }
        let err = empty_cpu(Kind::Float, &[2, -1]).unwrap_err();
        assert!(err.to_string().contains("[2, -1]"), "{err}");
    }

    #[test]
    fn isa_limits_that_allow_avx512() {
        for v in [
            "AVX512_CORE",
            "avx512_core_amx",
            "AVX10_1_512",
            "ALL",
            "default",
            "",
        ] {
            assert!(isa_allows_avx512(v), "{v}");
        }
        for v in ["AVX2", "avx2_vnni", "SSE41", "AVX"] {
            assert!(!isa_allows_avx512(v), "{v}");
        }
    }

    /// The same values, channels-last in memory.
    fn channels_last(t: &Tensor) -> Tensor {
        t.permute([0, 2, 3, 1]).contiguous().permute([0, 3, 1, 2])
    }

    fn seeded(dims: &[i64], seed: u64) -> Tensor {
        tch::manual_seed(seed as i64);
        Tensor::randn(dims, (Kind::Double, tch::Device::Cpu))
    }

    /// Each epilogue against a float64 reference, within a bound derived from float32
    /// rounding of the products' magnitudes.
    #[test]
    fn packed_pointwise_convolutions_match_float64() {
        let cases: [(i64, i64, i64, i64, i64, i64, i64); 5] = [
            // (C, O, k, stride, pad, groups, H)
            (3, 8, 7, 2, 3, 1, 19),
            (16, 16, 3, 1, 1, 1, 9),
            (16, 32, 1, 2, 0, 1, 8),
            (24, 24, 3, 1, 1, 24, 7),
            (12, 18, 3, 2, 1, 3, 6),
        ];
        for (i, &(c, o, k, s, p, g, h)) in cases.iter().enumerate() {
            let x64 = seeded(&[2, c, h, h + 1], 3 * i as u64);
            let w64 = seeded(&[o, c / g, k, k], 3 * i as u64 + 1);
            let b64 = seeded(&[o], 3 * i as u64 + 2);
            let geo = Geometry {
                padding: [p, p],
                stride: [s, s],
                dilation: [1, 1],
                groups: g,
            };
            let conv64 = x64.conv2d(&w64, Some(&b64), [s, s], [p, p], [1, 1], g);
            let mag = x64
                .abs()
                .conv2d(&w64.abs(), Some(&b64.abs()), [s, s], [p, p], [1, 1], g);
            let other64 = seeded(&conv64.size(), 99);
            let f32cl = |t: &Tensor| channels_last(&t.to_kind(Kind::Float));
            let x = f32cl(&x64);
            let w = pack_weight(
                &w64.to_kind(Kind::Float),
                &geo,
                x.size().try_into().unwrap(),
            )
            .unwrap();
            let b = b64.to_kind(Kind::Float);
            let other = f32cl(&other64);
            let acts = [
                Activation::None,
                Activation::Relu,
                Activation::Clamp(-0.5, 0.75),
            ];
            for act in acts {
                for with_other in [false, true] {
                    if with_other && matches!(act, Activation::Clamp(..)) {
                        let r = conv_pointwise(&x, &w, Some(&b), Some(&other), &geo, act);
                        assert!(r.is_err());
                        continue;
                    }
                    let sum = if with_other {
                        &conv64 + &other64
                    } else {
                        conv64.copy()
                    };
                    let want = match act {
                        Activation::None => sum,
                        Activation::Relu => sum.relu(),
                        Activation::Clamp(lo, hi) => sum.clamp(lo, hi),
                        Activation::Gelu => sum.gelu("none"),
                    };
                    let got =
                        conv_pointwise(&x, &w, Some(&b), with_other.then_some(&other), &geo, act)
                            .unwrap();
                    assert_eq!(got.size(), want.size());
                    // float32 rounding of inputs and of a sum of |x||w| terms: a few ulps of
                    // the magnitude, times the reduction length's square root (well inside
                    // the worst case, far above a wrong index or a dropped term).
                    let terms = (c / g * k * k) as f64;
                    let bound = (mag.shallow_clone() + other64.abs())
                        * (4.0 * f32::EPSILON as f64 * terms.sqrt())
                        + 1e-30;
                    let err = (got.to_kind(Kind::Double) - &want).abs();
                    let worst = (err / bound).max().double_value(&[]);
                    assert!(
                        worst <= 1.0,
                        "case {i} {act:?} other={with_other}: error {worst} × the bound"
                    );
                }
            }
        }
    }

    #[test]
    fn a_weight_packed_for_other_dims_is_an_error_or_right() {
        // A mismatched weight is not a silent wrong answer: oneDNN repacks or fails.
        let geo = Geometry {
            padding: [1, 1],
            stride: [1, 1],
            dilation: [1, 1],
            groups: 1,
        };
        let w = Tensor::randn([4, 3, 3, 3], (Kind::Float, tch::Device::Cpu));
        let x = channels_last(&Tensor::randn(
            [1, 3, 5, 5],
            (Kind::Float, tch::Device::Cpu),
        ));
        let packed = pack_weight(&w, &geo, [2, 3, 9, 9]).unwrap();
        let got = conv_pointwise(&x, &packed, None, None, &geo, Activation::None).unwrap();
        let want = x.conv2d(&w, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1);
        let d = (got - want).abs().max().double_value(&[]);
        assert!(d < 1e-4, "{d}");
    }

    /// Each linear epilogue against float64, within float32 rounding of the products.
    #[test]
    fn packed_linears_match_float64() {
        for (i, &(m, k, n)) in [(4usize, 40usize, 24usize), (2 * 7, 64, 33), (1, 300, 5)]
            .iter()
            .enumerate()
        {
            let x64 = seeded(&[m as i64, k as i64], 40 + i as u64).reshape([-1, 1, k as i64]);
            let x64 = x64.reshape([m as i64, k as i64]);
            let w64 = seeded(&[n as i64, k as i64], 41 + i as u64);
            let b64 = seeded(&[n as i64], 42 + i as u64);
            let o64 = seeded(&[m as i64, n as i64], 43 + i as u64);
            let lin = x64.linear(&w64, Some(&b64));
            let mag = x64.abs().linear(&w64.abs(), Some(&b64.abs())) + o64.abs();
            let w = pack_linear_weight(&w64.to_kind(Kind::Float)).unwrap();
            let (x, b, o) = (
                x64.to_kind(Kind::Float),
                b64.to_kind(Kind::Float),
                o64.to_kind(Kind::Float),
            );
            for (act, other) in [
                (Activation::None, false),
                (Activation::Relu, false),
                (Activation::Gelu, false),
                (Activation::None, true),
            ] {
                let want = match (act, other) {
                    (_, true) => &lin + &o64,
                    (Activation::Relu, _) => lin.relu(),
                    (Activation::Gelu, _) => lin.gelu("none"),
                    _ => lin.copy(),
                };
                let got = linear_pointwise(&x, &w, Some(&b), other.then_some(&o), act).unwrap();
                let bound = &mag * (4.0 * f32::EPSILON as f64 * (k as f64).sqrt()) + 1e-30;
                let worst = ((got.to_kind(Kind::Double) - &want).abs() / bound)
                    .max()
                    .double_value(&[]);
                assert!(
                    worst <= 1.0,
                    "case {i} {act:?} other={other}: {worst} × the bound"
                );
            }
            assert!(linear_pointwise(&x, &w, None, Some(&o), Activation::Relu).is_err());
        }
    }
}
