//! Functional neural-network ops on [`Tensor`]: convolution, pooling, normalisation,
//! activations, embedding lookup and losses.
//!
//! Every op has two implementations that tests keep in agreement:
//!
//! - **eager** (no trace active, all operands eager): libtorch's fused kernel, exactly the call
//!   PyTorch's eager mode makes, so the eager baseline is as fast as PyTorch eager and takes part
//!   in tch's autograd;
//! - **traced**: a composition of kiln's primitive [`crate::ir::Op`]s (convolution,
//!   `reduce_window`, reductions, elementwise ops, `dot_general`), so that the compiled graph is
//!   differentiable by kiln's VJP rules and XLA can fuse the pieces.
//!
//! Layouts are PyTorch's: activations `[N, C, H, W]`, kernels `[O, C/groups, kH, kW]`.

use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DType, DotDims, Op, ReduceKind, TensorType, WindowAttrs};
use crate::trace::{apply, is_tracing, Tensor};

/// The tch tensors of `ts` if no trace is active and every tensor is eager (the fast path).
fn eager<'a>(ts: &[&'a Tensor]) -> Option<Vec<&'a tch::Tensor>> {
    if is_tracing() {
        return None;
    }
    ts.iter().map(|t| t.as_tch().ok()).collect()
}

fn wrap(t: tch::Tensor, dtype: DType) -> Tensor {
    Tensor::from_tch_typed(t, dtype)
}

fn i64s(v: &[usize]) -> Vec<i64> {
    v.iter().map(|&x| x as i64).collect()
}

/// The output size of one spatial dim of a pooling window, exactly as PyTorch computes it
/// (`pooling_output_shape`): with `ceil_mode` the size rounds up, except that the last window
/// must start inside the input or its left padding.
pub fn pool_output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
    ceil_mode: bool,
) -> Result<usize> {
    if kernel == 0 || stride == 0 || dilation == 0 {
        return Err(Error::Invalid(format!(
            "pool: kernel {kernel}, stride {stride} and dilation {dilation} must be positive"
        )));
    }
    let (i, k, s, p, d) = (
        input as i64,
        kernel as i64,
        stride as i64,
        padding as i64,
        dilation as i64,
    );
    let num = i + 2 * p - d * (k - 1) - 1 + if ceil_mode { s - 1 } else { 0 };
    // Division rounding toward -inf (PyTorch's div_rtn).
    let mut out = num.div_euclid(s) + 1;
    if ceil_mode && (out - 1) * s >= i + p {
        out -= 1;
    }
    if out < 1 {
        return Err(Error::Invalid(format!(
            "pool: input size {input} with kernel {kernel}, stride {stride}, padding {padding} \
             gives output size {out}, which is too small"
        )));
    }
    Ok(out as usize)
}

/// Output size and `(low, high)` window padding per spatial dim.
type PoolGeometry = ([usize; 2], [(usize, usize); 2]);

/// Checks a `[N, C, H, W]` operand and pooling geometry; returns the output `[OH, OW]` and the
/// `(low, high)` padding per spatial dim that makes a `reduce_window` produce exactly that size.
fn pool_geometry(
    op: &str,
    x: &Tensor,
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    ceil_mode: bool,
) -> Result<PoolGeometry> {
    if x.rank() != 4 {
        return Err(Error::type_error(
            op,
            "expects an [N, C, H, W] input",
            &[x.ty()],
        ));
    }
    let mut out = [0; 2];
    let mut pads = [(0, 0); 2];
    for i in 0..2 {
        if padding[i] * 2 > kernel[i] {
            return Err(Error::type_error(
                op,
                format!(
                    "padding {:?} must be at most half the kernel {:?}",
                    padding, kernel
                ),
                &[x.ty()],
            ));
        }
        let n = x.dims()[i + 2];
        let o = pool_output_size(n, kernel[i], stride[i], padding[i], 1, ceil_mode)
            .map_err(|e| Error::type_error(op, e.to_string(), &[x.ty()]))?;
        out[i] = o;
        // The last window ends at (o-1)*s + k - p in input coordinates.
        let end = (o - 1) * stride[i] + kernel[i];
        let high = end.saturating_sub(n + padding[i]);
        pads[i] = (padding[i], high);
    }
    Ok((out, pads))
}

/// The float constant `[rows, cols]` matrix of `values` (row-major) in `dtype`, each value
/// rounded to `dtype` once.
fn constant_matrix(dtype: DType, shape: &[usize], values: &[f64]) -> Result<Tensor> {
    if !dtype.is_float() {
        return Err(Error::Internal(format!(
            "float constant matrix of dtype {dtype}"
        )));
    }
    let mut bytes = Vec::with_capacity(values.len() * dtype.size_in_bytes());
    for &v in values {
        bytes.extend_from_slice(crate::ir::Literal::scalar(dtype, v).bytes());
    }
    Tensor::constant(TensorType::new(dtype, shape), bytes)
}

/// Reshapes a per-channel `[C]` tensor to broadcast against `[N, C, ...]` of rank `rank`.
fn per_channel(t: &Tensor, rank: usize) -> Result<Tensor> {
    let mut dims = vec![1isize; rank];
    dims[1] = t.dims()[0] as isize;
    t.reshape(&dims)
}

impl Tensor {
    // ----- convolution ------------------------------------------------------------------------

    /// 2-D convolution (cross-correlation), PyTorch's `F.conv2d`: `self` is `[N, C, H, W]`,
    /// `weight` `[O, C/groups, kH, kW]`, `bias` `[O]`. Symmetric zero `padding`; `groups == C`
    /// with `O == C` is a depthwise convolution.
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
        groups: usize,
    ) -> Result<Tensor> {
        let attrs = ConvAttrs {
            strides: stride.to_vec(),
            padding: padding.iter().map(|&p| (p as i64, p as i64)).collect(),
            lhs_dilation: vec![1, 1],
            rhs_dilation: dilation.to_vec(),
            feature_groups: groups,
            batch_groups: 1,
        };
        let op = Op::Conv(attrs);
        // Type-check first, so both paths report shape errors identically.
        let out = op.infer(&[self.ty(), weight.ty()])?;
        if let Some(b) = bias {
            if b.rank() != 1 || b.dims()[0] != weight.dims()[0] || b.dtype() != self.dtype() {
                return Err(Error::type_error(
                    "conv2d",
                    "bias must be [out_channels] of the input's dtype",
                    &[self.ty(), weight.ty(), b.ty()],
                ));
            }
        }
        if let Some(ts) = eager(&[self, weight]) {
            let b = bias.map(|b| b.as_tch()).transpose()?;
            let t = ts[0].f_conv2d(
                ts[1],
                b,
                i64s(&stride),
                i64s(&padding),
                i64s(&dilation),
                groups as i64,
            )?;
            return Ok(wrap(t, out.dtype));
        }
        let y = apply(op, &[self, weight])?;
        match bias {
            Some(b) => y.add(&per_channel(b, 4)?),
            None => Ok(y),
        }
    }

    // ----- pooling ----------------------------------------------------------------------------

    /// 2-D max pooling, PyTorch's `F.max_pool2d` (dilation 1): padded positions never win; with
    /// `ceil_mode` the output size rounds up as PyTorch's does (see [`pool_output_size`]).
    pub fn max_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
    ) -> Result<Tensor> {
        let (_, pads) = pool_geometry("max_pool2d", self, kernel, stride, padding, ceil_mode)?;
        if let Some(ts) = eager(&[self]) {
            let t = ts[0].f_max_pool2d(
                i64s(&kernel),
                i64s(&stride),
                i64s(&padding),
                [1i64, 1],
                ceil_mode,
            )?;
            return Ok(wrap(t, self.dtype()));
        }
        apply(
            Op::ReduceWindow {
                kind: ReduceKind::Max,
                attrs: WindowAttrs {
                    window: kernel.to_vec(),
                    strides: stride.to_vec(),
                    padding: pads.to_vec(),
                },
            },
            &[self],
        )
    }

    /// 2-D average pooling, PyTorch's `F.avg_pool2d`. With `count_include_pad` the divisor
    /// counts the zero padding (but not the extra positions `ceil_mode` adds past it); without,
    /// only input elements are counted.
    pub fn avg_pool2d(
        &self,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 2],
        ceil_mode: bool,
        count_include_pad: bool,
    ) -> Result<Tensor> {
        let (out, pads) = pool_geometry("avg_pool2d", self, kernel, stride, padding, ceil_mode)?;
        if !self.dtype().is_float() {
            return Err(Error::type_error(
                "avg_pool2d",
                "expects a float input",
                &[self.ty()],
            ));
        }
        if let Some(ts) = eager(&[self]) {
            let t = ts[0].f_avg_pool2d(
                i64s(&kernel),
                i64s(&stride),
                i64s(&padding),
                ceil_mode,
                count_include_pad,
                None::<i64>,
            )?;
            return Ok(wrap(t, self.dtype()));
        }
        let sum = apply(
            Op::ReduceWindow {
                kind: ReduceKind::Sum,
                attrs: WindowAttrs {
                    window: kernel.to_vec(),
                    strides: stride.to_vec(),
                    padding: pads.to_vec(),
                },
            },
            &[self],
        )?;
        // PyTorch's divisor per output position (avg_pool2d's CPU kernel).
        let (h, w) = (self.dims()[2] as i64, self.dims()[3] as i64);
        let extent = |o: usize, i: usize, n: i64| -> i64 {
            let (k, s, p) = (kernel[i] as i64, stride[i] as i64, padding[i] as i64);
            let start = o as i64 * s - p;
            let end = (start + k).min(n + p);
            if count_include_pad {
                end - start
            } else {
                end.min(n) - start.max(0)
            }
        };
        let mut divisors = Vec::with_capacity(out[0] * out[1]);
        for oh in 0..out[0] {
            for ow in 0..out[1] {
                divisors.push((extent(oh, 0, h) * extent(ow, 1, w)) as f64);
            }
        }
        let first = divisors[0];
        if divisors.iter().all(|&d| d == first) {
            return sum.div_scalar(first);
        }
        let inv: Vec<f64> = divisors.iter().map(|&d| 1.0 / d.max(1.0)).collect();
        sum.mul(&constant_matrix(self.dtype(), &out, &inv)?)
    }

    /// Adaptive average pooling to `out_hw`, PyTorch's `F.adaptive_avg_pool2d`: output cell
    /// `i` averages input rows `floor(i*H/OH) .. ceil((i+1)*H/OH)` (and likewise for columns),
    /// for any sizes, including output larger than input.
    ///
    /// Traced, evenly divisible sizes become one `reduce_window`; other sizes become two
    /// `dot_general`s with constant averaging matrices.
    pub fn adaptive_avg_pool2d(&self, out_hw: [usize; 2]) -> Result<Tensor> {
        if self.rank() != 4
            || !self.dtype().is_float()
            || out_hw.contains(&0)
            || self.dims()[2] == 0
            || self.dims()[3] == 0
        {
            return Err(Error::type_error(
                "adaptive_avg_pool2d",
                format!(
                    "expects a float [N, C, H, W] input with H, W > 0 and a positive size, got \
                     {out_hw:?}"
                ),
                &[self.ty()],
            ));
        }
        if let Some(ts) = eager(&[self]) {
            let t = ts[0].f_adaptive_avg_pool2d(i64s(&out_hw))?;
            return Ok(wrap(t, self.dtype()));
        }
        let (h, w) = (self.dims()[2], self.dims()[3]);
        if out_hw == [1, 1] {
            return self.mean(&[2, 3], true);
        }
        if (h, w) == (out_hw[0], out_hw[1]) {
            return Ok(self.clone());
        }
        if h % out_hw[0] == 0 && w % out_hw[1] == 0 {
            let k = [h / out_hw[0], w / out_hw[1]];
            return apply(
                Op::ReduceWindow {
                    kind: ReduceKind::Sum,
                    attrs: WindowAttrs {
                        window: k.to_vec(),
                        strides: k.to_vec(),
                        padding: vec![(0, 0); 2],
                    },
                },
                &[self],
            )?
            .div_scalar((k[0] * k[1]) as f64);
        }
        let matrix = |o: usize, n: usize| -> Result<Tensor> {
            let mut v = vec![0.0; o * n];
            for i in 0..o {
                let start = i * n / o;
                let end = ((i + 1) * n).div_ceil(o);
                for j in start..end {
                    v[i * n + j] = 1.0 / (end - start) as f64;
                }
            }
            constant_matrix(self.dtype(), &[o, n], &v)
        };
        let contract = |lhs: usize| DotDims {
            lhs_contract: vec![lhs],
            rhs_contract: vec![1],
            ..Default::default()
        };
        // [N, C, H, W] x [OW, W] -> [N, C, H, OW]; x [OH, H] -> [N, C, OW, OH].
        let t = self.dot_general(&matrix(out_hw[1], w)?, contract(3))?;
        let t = t.dot_general(&matrix(out_hw[0], h)?, contract(2))?;
        t.permute(&[0, 1, 3, 2])
    }

    // ----- normalisation ----------------------------------------------------------------------

    /// Batch normalisation over dim 1 of an `[N, C, ...]` input, PyTorch's `F.batch_norm`.
    ///
    /// - Evaluation (`train == false`): normalises with `running_mean` / `running_var`
    ///   (required).
    /// - Training: normalises with the batch's mean and biased variance; if running statistics
    ///   are given they are updated in place (through [`Tensor::assign`]) as
    ///   `r = (1 - momentum) * r + momentum * s`, with the *unbiased* batch variance for
    ///   `running_var`, as PyTorch does.
    ///
    /// Traced, it is decomposed into reductions and elementwise ops (XLA fuses them); in
    /// evaluation the per-channel scale and shift are folded first.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        train: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<Tensor> {
        let r = self.rank();
        if r < 2 || !self.dtype().is_float() {
            return Err(Error::type_error(
                "batch_norm",
                "expects a float [N, C, ...] input",
                &[self.ty()],
            ));
        }
        let c = self.dims()[1];
        for t in [running_mean, running_var, weight, bias]
            .into_iter()
            .flatten()
        {
            if t.dims() != [c] || t.dtype() != self.dtype() {
                return Err(Error::type_error(
                    "batch_norm",
                    format!("per-channel tensors must be [{c}] of the input's dtype"),
                    &[self.ty(), t.ty()],
                ));
            }
        }
        if !train && (running_mean.is_none() || running_var.is_none()) {
            return Err(Error::Invalid(
                "batch_norm: evaluation mode needs running_mean and running_var".into(),
            ));
        }
        if let Some(x) = eager(&[self]) {
            fn opt(t: Option<&Tensor>) -> Result<Option<&tch::Tensor>> {
                t.map(|t| t.as_tch()).transpose()
            }
            let (w, b, rm, rv) = (
                opt(weight)?,
                opt(bias)?,
                opt(running_mean)?,
                opt(running_var)?,
            );
            // libtorch updates the running statistics in place, like PyTorch.
            let t = x[0].f_batch_norm(w, b, rm, rv, train, momentum, eps, false)?;
            return Ok(wrap(t, self.dtype()));
        }
        let axes: Vec<isize> = (0..r as isize).filter(|&a| a != 1).collect();
        if train {
            let n: usize = axes.iter().map(|&a| self.dims()[a as usize]).product();
            if n < 2 {
                return Err(Error::type_error(
                    "batch_norm",
                    "training needs more than one value per channel",
                    &[self.ty()],
                ));
            }
            let mean = self.mean(&axes, false)?;
            let centred = self.sub(&per_channel(&mean, r)?)?;
            let var = centred.square()?.mean(&axes, false)?;
            let inv = var.add_scalar(eps)?.rsqrt()?;
            let mut y = centred.mul(&per_channel(&inv, r)?)?;
            if let Some(w) = weight {
                y = y.mul(&per_channel(w, r)?)?;
            }
            if let Some(b) = bias {
                y = y.add(&per_channel(b, r)?)?;
            }
            if let Some(rm) = running_mean {
                let upd = rm
                    .mul_scalar(1.0 - momentum)?
                    .add(&mean.mul_scalar(momentum)?)?;
                rm.assign(&upd)?;
            }
            if let Some(rv) = running_var {
                let unbiased = var.mul_scalar(n as f64 / (n - 1) as f64)?;
                let upd = rv
                    .mul_scalar(1.0 - momentum)?
                    .add(&unbiased.mul_scalar(momentum)?)?;
                rv.assign(&upd)?;
            }
            return Ok(y);
        }
        let (Some(rm), Some(rv)) = (running_mean, running_var) else {
            return Err(Error::Invalid(
                "batch_norm: evaluation mode needs running_mean and running_var".into(),
            ));
        };
        // y = x * scale + shift with scale = w / sqrt(var + eps), shift = b - mean * scale.
        let mut scale = rv.add_scalar(eps)?.rsqrt()?;
        if let Some(w) = weight {
            scale = scale.mul(w)?;
        }
        let mut shift = rm.mul(&scale)?.neg()?;
        if let Some(b) = bias {
            shift = shift.add(b)?;
        }
        self.mul(&per_channel(&scale, r)?)?
            .add(&per_channel(&shift, r)?)
    }

    /// Layer normalisation over the trailing dims `normalized_shape`, PyTorch's
    /// `F.layer_norm`: `(x - mean) / sqrt(var + eps) * weight + bias` with the biased
    /// variance.
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        let r = self.rank();
        let k = normalized_shape.len();
        if k == 0 || k > r || &self.dims()[r - k..] != normalized_shape || !self.dtype().is_float()
        {
            return Err(Error::type_error(
                "layer_norm",
                format!("normalized_shape {normalized_shape:?} must be the input's trailing dims"),
                &[self.ty()],
            ));
        }
        for t in [weight, bias].into_iter().flatten() {
            if t.dims() != normalized_shape || t.dtype() != self.dtype() {
                return Err(Error::type_error(
                    "layer_norm",
                    format!("weight and bias must be {normalized_shape:?}"),
                    &[self.ty(), t.ty()],
                ));
            }
        }
        if let Some(x) = eager(&[self]) {
            let w = weight.map(|t| t.as_tch()).transpose()?;
            let b = bias.map(|t| t.as_tch()).transpose()?;
            let t = x[0].f_layer_norm(i64s(normalized_shape), w, b, eps, false)?;
            return Ok(wrap(t, self.dtype()));
        }
        let axes: Vec<isize> = ((r - k) as isize..r as isize).collect();
        let mean = self.mean(&axes, true)?;
        let centred = self.sub(&mean)?;
        let var = centred.square()?.mean(&axes, true)?;
        let mut y = centred.mul(&var.add_scalar(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(w)?;
        }
        if let Some(b) = bias {
            y = y.add(b)?;
        }
        Ok(y)
    }

    // ----- activations ------------------------------------------------------------------------

    fn float_only(&self, op: &str) -> Result<()> {
        if self.dtype().is_float() {
            Ok(())
        } else {
            Err(Error::type_error(op, "expects a float input", &[self.ty()]))
        }
    }

    /// GELU: `x * Φ(x)` with the exact normal CDF (`0.5 x (1 + erf(x / √2))`), or with
    /// `approximate` the tanh form `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`.
    pub fn gelu(&self, approximate: bool) -> Result<Tensor> {
        self.float_only("gelu")?;
        if let Some(x) = eager(&[self]) {
            let t = x[0].f_gelu(if approximate { "tanh" } else { "none" })?;
            return Ok(wrap(t, self.dtype()));
        }
        let inner = if approximate {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            self.add(&self.square()?.mul(self)?.mul_scalar(0.044715)?)?
                .mul_scalar(c)?
                .tanh()?
        } else {
            self.mul_scalar(std::f64::consts::FRAC_1_SQRT_2)?.erf()?
        };
        self.mul(&inner.add_scalar(1.0)?)?.mul_scalar(0.5)
    }

    /// SiLU (swish): `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Tensor> {
        self.float_only("silu")?;
        if let Some(x) = eager(&[self]) {
            return Ok(wrap(x[0].f_silu()?, self.dtype()));
        }
        self.mul(&self.sigmoid()?)
    }

    /// `min(max(x, 0), 6)`.
    pub fn relu6(&self) -> Result<Tensor> {
        self.float_only("relu6")?;
        if let Some(x) = eager(&[self]) {
            return Ok(wrap(x[0].f_relu6()?, self.dtype()));
        }
        self.clamp(0.0, 6.0)
    }

    /// Hard sigmoid: `relu6(x + 3) / 6`.
    pub fn hardsigmoid(&self) -> Result<Tensor> {
        self.float_only("hardsigmoid")?;
        if let Some(x) = eager(&[self]) {
            return Ok(wrap(x[0].f_hardsigmoid()?, self.dtype()));
        }
        self.add_scalar(3.0)?.clamp(0.0, 6.0)?.div_scalar(6.0)
    }

    /// Hard swish: `x * relu6(x + 3) / 6`.
    pub fn hardswish(&self) -> Result<Tensor> {
        self.float_only("hardswish")?;
        if let Some(x) = eager(&[self]) {
            return Ok(wrap(x[0].f_hardswish()?, self.dtype()));
        }
        self.mul(&self.add_scalar(3.0)?.clamp(0.0, 6.0)?)?
            .div_scalar(6.0)
    }

    /// Leaky ReLU: `x` where `x > 0`, else `negative_slope * x`.
    pub fn leaky_relu(&self, negative_slope: f64) -> Result<Tensor> {
        self.float_only("leaky_relu")?;
        if let Some(x) = eager(&[self]) {
            let t = if negative_slope == 0.01 {
                x[0].f_leaky_relu()?
            } else {
                let neg = x[0].f_mul_scalar(negative_slope)?;
                x[0].f_where_self(&x[0].f_gt(0.0)?, &neg)?
            };
            return Ok(wrap(t, self.dtype()));
        }
        let pos = self.gt(&self.scalar_like(0.0)?)?;
        pos.select(self, &self.mul_scalar(negative_slope)?)
    }

    // ----- attention --------------------------------------------------------------------------

    /// Scaled dot-product attention, PyTorch's `F.scaled_dot_product_attention`:
    /// `softmax(q kᵀ / √d + mask) v` over `[.., L, d]` queries and `[.., S, d]` keys/values.
    /// `mask` (optional) is added to the scores (use large negative values to mask out).
    /// Dropout with probability `dropout_p` applies to the attention weights when `train`.
    pub fn scaled_dot_product_attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        dropout_p: f64,
        train: bool,
    ) -> Result<Tensor> {
        let r = q.rank();
        if r < 2
            || k.rank() != r
            || v.rank() != r
            || q.dims()[r - 1] != k.dims()[r - 1]
            || k.dims()[r - 2] != v.dims()[r - 2]
        {
            return Err(Error::type_error(
                "scaled_dot_product_attention",
                "expects q [.., L, d], k [.., S, d], v [.., S, dv]",
                &[q.ty(), k.ty(), v.ty()],
            ));
        }
        if let Some(m) = mask {
            if m.dtype() != q.dtype() {
                return Err(Error::type_error(
                    "scaled_dot_product_attention",
                    "the mask is additive: it must have the queries' float dtype",
                    &[q.ty(), m.ty()],
                ));
            }
        }
        let d = q.dims()[r - 1];
        let scale = 1.0 / (d as f64).sqrt();
        if let Some(ts) = eager(&[q, k, v]) {
            let m = mask.map(|m| m.as_tch()).transpose()?;
            let p = if train { dropout_p } else { 0.0 };
            let t = tch::Tensor::f_scaled_dot_product_attention(
                ts[0], ts[1], ts[2], m, p, false, scale, false,
            )?;
            return Ok(wrap(t, q.dtype()));
        }
        let mut scores = q.mul_scalar(scale)?.matmul(&k.t()?)?;
        if let Some(m) = mask {
            scores = scores.add(m)?;
        }
        let attn = scores.softmax(-1)?.dropout(dropout_p, train)?;
        attn.matmul(v)
    }

    // ----- embedding and losses ---------------------------------------------------------------

    /// Embedding lookup, PyTorch's `F.embedding(ids, weight)`: rows of `weight` (`[num, dim]`)
    /// at the integer `ids` (any shape); the result is `ids.shape ++ [dim]`.
    ///
    /// Out-of-range ids are an error eagerly (libtorch checks them); a compiled graph cannot
    /// report errors, so there they are clamped into range (the `Take` primitive's rule).
    pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        if weight.rank() != 2 || !matches!(ids.dtype(), DType::I32 | DType::I64) {
            return Err(Error::type_error(
                "embedding",
                "expects weight [num, dim] and i32/i64 ids",
                &[weight.ty(), ids.ty()],
            ));
        }
        if let Some(ts) = eager(&[weight, ids]) {
            let t = tch::Tensor::f_embedding(ts[0], ts[1], -1, false, false)?;
            return Ok(wrap(t, weight.dtype()));
        }
        weight.take(ids, 0)
    }

    /// Cross-entropy of `self` (logits `[N, C]`) against class indices `targets` (`i64 [N]`),
    /// averaged over the batch (PyTorch's `F.cross_entropy` with mean reduction). Traced, it is
    /// `-mean(sum(log_softmax(x) * one_hot(targets)))` with the stable log-softmax.
    pub fn cross_entropy(&self, targets: &Tensor) -> Result<Tensor> {
        if self.rank() != 2
            || !self.dtype().is_float()
            || targets.dims() != [self.dims()[0]]
            || !matches!(targets.dtype(), DType::I32 | DType::I64)
        {
            return Err(Error::type_error(
                "cross_entropy",
                "expects float logits [N, C] and integer targets [N]",
                &[self.ty(), targets.ty()],
            ));
        }
        if let Some(ts) = eager(&[self, targets]) {
            let tgt = ts[1].f_to_kind(tch::Kind::Int64)?;
            let t = ts[0].f_cross_entropy_loss(
                &tgt,
                None::<tch::Tensor>,
                tch::Reduction::Mean,
                -100,
                0.0,
            )?;
            return Ok(wrap(t, self.dtype()));
        }
        let (n, c) = (self.dims()[0], self.dims()[1]);
        let classes = Tensor::arange(c, targets.dtype())?.reshape(&[1, c as isize])?;
        let one_hot = targets
            .reshape(&[n as isize, 1])?
            .eq(&classes)?
            .to_dtype(self.dtype())?;
        self.log_softmax(1)?
            .mul(&one_hot)?
            .sum_all()?
            .div_scalar(-(n as f64))
    }

    /// Mean squared error between `self` and `target` (same shape), PyTorch's `F.mse_loss`.
    pub fn mse_loss(&self, target: &Tensor) -> Result<Tensor> {
        if self.ty() != target.ty() || !self.dtype().is_float() {
            return Err(Error::type_error(
                "mse_loss",
                "expects two float tensors of one type",
                &[self.ty(), target.ty()],
            ));
        }
        if let Some(ts) = eager(&[self, target]) {
            let t = ts[0].f_mse_loss(ts[1], tch::Reduction::Mean)?;
            return Ok(wrap(t, self.dtype()));
        }
        self.sub(target)?.square()?.mean_all()
    }
}

#[cfg(test)]
mod tests {
    use super::pool_output_size;

    #[test]
    fn ceil_mode_output_sizes_match_pytorch() {
        // squeezenet: 31 -> 15 with k3 s2 ceil.
        assert_eq!(pool_output_size(31, 3, 2, 0, 1, true).unwrap(), 15);
        assert_eq!(pool_output_size(32, 3, 2, 0, 1, true).unwrap(), 16);
        assert_eq!(pool_output_size(32, 3, 2, 0, 1, false).unwrap(), 15);
        // Last window would start in the right padding: dropped.
        assert_eq!(pool_output_size(5, 2, 2, 1, 1, true).unwrap(), 3);
        assert_eq!(pool_output_size(4, 2, 2, 1, 1, true).unwrap(), 3);
        assert_eq!(pool_output_size(6, 3, 3, 1, 1, true).unwrap(), 3);
        assert!(pool_output_size(1, 3, 1, 0, 1, false).is_err());
    }
}
