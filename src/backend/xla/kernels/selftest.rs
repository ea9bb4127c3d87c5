//! Registering the kernels with a plugin and checking them once.

use super::{
    conv_call_mlir, dot_call_mlir, AfterKernel, AttentionKernel, ColumnSumKernel, ConvKernel,
    DotKernel, PackedConvKernel, PackedLinearKernel, SelectScatterKernel, TransposeKernel,
};
use crate::backend::xla::lower::tensor_type;
use crate::error::{Error, Result};
use crate::ir::{ConvAttrs, DType, DotDims, TensorType};
use tch::Tensor;

/// Registers the kernels with `backend`'s plugin and checks them by compiling and running a
/// small graph (a strided, padded convolution and a `Linear`-layout dot through the kernels)
/// against libtorch run directly. `Err` says why the kernels cannot be used.
pub(crate) fn enable(backend: &crate::backend::xla::XlaBackend) -> std::result::Result<(), String> {
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
        .and_then(|()| api.register_ffi_kernel::<PackedConvKernel>())
        .and_then(|()| api.register_ffi_kernel::<PackedLinearKernel>())
        .and_then(|()| api.register_ffi_kernel::<AfterKernel>())
        .and_then(|()| api.register_ffi_kernel::<AttentionKernel>())
        .and_then(|()| api.register_ffi_kernel::<TransposeKernel>())
        .and_then(|()| api.register_ffi_kernel::<ColumnSumKernel>())
        .and_then(|()| api.register_ffi_kernel::<SelectScatterKernel>())
        .map_err(|e| format!("registering the FFI handlers failed: {e}"))?;
    self_test(backend).map_err(|e| format!("the FFI self-test failed: {e}"))
}

fn self_test(backend: &crate::backend::xla::XlaBackend) -> Result<()> {
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
    let read = |b: &crate::backend::xla::pjrt::Buffer| -> Result<Vec<f32>> {
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
