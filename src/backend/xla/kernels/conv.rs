//! The convolution kernel ([`CONV_TARGET`](super::CONV_TARGET)): `Op::Conv` computed by
//! libtorch, in each [`ConvForm`]; those of small feature groups (depthwise included) by
//! kiln's own loops (the `grouped` module).

use super::grouped::{self, Grouped};
use super::onednn::{self, Activation, Geometry};
use super::threads::own_kernel_guard;
use super::SERIAL_ATTR;
use super::{torch_lock, ConvForm, CONV_TARGET};
use crate::backend::eager::batch_groups_to_channels;
use crate::backend::xla::pjrt::ffi::{Call, FfiKernel};
use crate::backend::xla::pjrt::handoff;
use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DType, TensorType};
use tch::Tensor;

/// The convolution kernel ([`CONV_TARGET`]).
pub(crate) struct ConvKernel;

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
        call.expect_arity(2, 1)?;
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
        // Groups of a few channels (depthwise too): kiln's own loops, right here on XLA's
        // worker (see `grouped`).
        if let Some((d, pass)) =
            Grouped::of(&c, xb.dims, kb.dims, ob.dims, form).filter(|(d, pass)| {
                grouped::own_grouped_conv()
                    && matches!(xb.dtype, DType::F32 | DType::F64)
                    && d.pays(*pass)
            })
        {
            let _counted = own_kernel_guard();
            match xb.dtype {
                DType::F32 => d.run(
                    pass,
                    xb.as_slice::<f32>()?,
                    kb.as_slice::<f32>()?,
                    call.ret_slice_mut(0)?,
                ),
                _ => d.run(
                    pass,
                    // (f64, checked above.)
                    xb.as_slice::<f64>()?,
                    kb.as_slice::<f64>()?,
                    call.ret_slice_mut(0)?,
                ),
            }
            return Ok(());
        }
        let flops = super::window_flops(ob.dims, &kdims);
        handoff::run_kernel(call.flag(SERIAL_ATTR), flops, || {
            let _guard = torch_lock();
            let (x, k, out) = (xb.tensor()?, kb.tensor()?, ob.tensor()?);
            match form {
                ConvForm::WeightGradient | ConvForm::WeightGradientTransposed => {
                    let transposed = form == ConvForm::WeightGradientTransposed;
                    weight_gradient_into(&c, &x, &k, &out, transposed)
                }
                _ => {
                    let r = conv_form(&c, &x, &k, form)?;
                    // A second handle on the same storage: `copy_` takes `&mut`.
                    out.shallow_clone().f_copy_(&r)?;
                    Ok(())
                }
            }
        })
    }
}

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
    // A plain convolution without input dilation: libtorch's own padding where it applies.
    let plain = form == ConvForm::Plain && c.lhs_dilation.iter().all(|&d| d == 1);
    // Symmetric padding of `low` computes a prefix-extended result whenever high <= low.
    if plain && c.padding.iter().all(|&(l, h)| l >= 0 && h <= l) {
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
    // Input-dilated (or given as a forward weight): a transposed convolution.
    if let Some((tpad, opad)) = transposed_params(c, &ks).filter(|_| !plain) {
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
    // Otherwise: padded (and input-dilated) explicitly, then a plain convolution.
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
/// (oneDNN's, or im2col and one matrix product as `_slow_conv2d_backward` does: 2-d, no
/// forward kernel dilation, and the forward convolution's padding recoverable as
/// symmetric; any number of feature groups)?
fn slow_weight_gradient(c: &ConvAttrs, lhs: &[i64], rhs: &[i64]) -> bool {
    let n = c.strides.len();
    let Ok(out) = conv_out_dims(c, lhs, rhs) else {
        return false;
    };
    n == 2
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

/// From this many output positions per image (`H' · W'` of the cotangent) an f32 2-d weight
/// gradient runs on oneDNN's own weight-gradient kernel; below, as im2col and one oneDNN
/// matrix product. Measured on a 2-vCPU Zen 5, batch 4, µs, oneDNN / im2col + product:
/// 3→64 7×7/2 at 32×32 outputs 353 / 3,418, 64→64 3×3 at 16×16 330 / 940, 128→128 at 8×8
/// 364 / 556, 128→256/2 at 4×4 327 / 186, 256→512/2 at 2×2 707 / 265, 512→512 at 2×2
/// 9,454 / 455 (oneDNN's kernel is poor with many channels on few positions).
const ONEDNN_WEIGHT_GRADIENT_MIN_OUTPUTS: i64 = 64;

/// From this many input positions per image (`H · W`), an f32 2-d *grouped* (depthwise)
/// weight gradient with a window of at most 3×3 runs on oneDNN's own weight-gradient kernel;
/// smaller ones, and larger windows, as the convolution of the regrouped input by the
/// transposed cotangent (oneDNN has a fast depthwise kernel for 3×3 windows only). Measured
/// inside mobilenet_v2's and mnasnet1_0's training graphs (`examples/ffi_profile.rs --ops
/// conv --filter "dw "`, 2-vCPU Zen 5, batch 4, best of 3, µs, oneDNN / regrouped): 3×3 at
/// 32×32 87–91 / 621–682, 144 ch at 16×16 98–100 / 843–867, 384 ch at 4×4 58–62 / 200–323,
/// 576 ch at 4×4 stride 2 60–61 / 153–172; 960 ch at 2×2 420–474 / 213–363; 5×5 windows
/// 226–823 / 198–491.
const ONEDNN_GROUPED_WEIGHT_GRADIENT_MIN_INPUTS: i64 = 16;

/// The largest window (`kh · kw`) of [`ONEDNN_GROUPED_WEIGHT_GRADIENT_MIN_INPUTS`].
const ONEDNN_GROUPED_WEIGHT_GRADIENT_MAX_WINDOW: i64 = 9;

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
        let fwd_stride: Vec<i64> = c.rhs_dilation.iter().map(|&v| v as i64).collect();
        let pad: Vec<i64> = c.padding.iter().map(|p| p.0).collect();
        let ksz: Vec<i64> = want[2..].to_vec();
        let cg = xs[1] / g;
        let (nb, o, ck, l) = (xs[0], cs[1], cg * ksz[0] * ksz[1], cs[2] * cs[3]);
        let write = |dw: &Tensor, out: &mut Tensor| -> Result<()> {
            // dw: [O, C/g*kh*kw] in the weight's layout.
            if transposed {
                out.f_view([o, ck])?.f_copy_(&dw.f_view([o, ck])?)?;
            } else {
                out.f_copy_(&dw.f_view([o, cg, ksz[0], ksz[1]])?.f_transpose(0, 1)?)?;
            }
            Ok(())
        };
        let onednn = if g == 1 {
            l >= ONEDNN_WEIGHT_GRADIENT_MIN_OUTPUTS
        } else {
            xs[2] * xs[3] >= ONEDNN_GROUPED_WEIGHT_GRADIENT_MIN_INPUTS
                && ksz[0] * ksz[1] <= ONEDNN_GROUPED_WEIGHT_GRADIENT_MAX_WINDOW
        };
        if x.kind() == tch::Kind::Float && onednn {
            // oneDNN's weight gradient, as eager autograd runs it.
            let geo = Geometry {
                padding: [pad[0], pad[1]],
                stride: [fwd_stride[0], fwd_stride[1]],
                dilation: [1, 1],
                groups: g,
            };
            let dw = onednn::conv_weight_gradient(x, ct, [o, cg, ksz[0], ksz[1]], &geo)?;
            return write(&dw, &mut out);
        }
        if g == 1 {
            // libtorch's own CPU weight gradient (as `_slow_conv2d_backward` computes it):
            // patches [N, C*kh*kw, L] of the padded input times the cotangent [N, O, L], as
            // one matrix product over N*L: dW [O, C*kh*kw], the transposed result (oneDNN's
            // matrix product for f32, MKL's for f64).
            let cols = x.f_im2col(&ksz, [1i64, 1], &pad, &fwd_stride)?;
            let a = ct
                .f_reshape([nb, o, l])?
                .f_permute([1i64, 0, 2])?
                .f_reshape([o, nb * l])?;
            let b = cols.f_permute([1i64, 0, 2])?.f_reshape([ck, nb * l])?;
            if x.kind() == tch::Kind::Float {
                let dw = onednn::linear_pointwise(&a, &b, None, None, Activation::None)?;
                return write(&dw, &mut out);
            }
            if transposed {
                let _ = a.f_mm_out(&out.f_view([o, ck])?, &b.f_tr()?)?;
            } else {
                let dw = a.f_mm(&b.f_tr()?)?;
                out.f_copy_(&dw.f_view([o, xs[1], ksz[0], ksz[1]])?.f_transpose(0, 1)?)?;
            }
            return Ok(());
        }
    }
    // Otherwise (a grouped one on few positions or in f64, or another geometry): the
    // convolution of the regrouped input by the transposed cotangent.
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
pub(crate) fn transposed_weight(k: &Tensor, g: i64) -> Result<Tensor> {
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
    let xg = batch_groups_to_channels(x, c.batch_groups as i64)?;
    let mut c2 = c.clone();
    c2.batch_groups = 1;
    c2.feature_groups = c.batch_groups;
    let y = conv(&c2, &xg, k)?;
    narrow_to(y, want)
}
