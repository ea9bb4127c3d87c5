//! Batches on data-parallel backends ([`Backend::replicas`] > 1): split along the first
//! dimension, one shard per replica.

use super::Runtime;
use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::TensorType;
use crate::trace::Tensor;

impl<B: Backend> Runtime<B> {
    /// The type each replica sees of batch input `index` of type `ty`: `ty` itself on one
    /// replica, else `ty` with its first dimension divided by the replica count.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the input, its type and the replica count if the input has no
    /// first dimension or the count does not divide it.
    pub(crate) fn replica_type(&self, index: usize, ty: &TensorType) -> Result<TensorType> {
        let n = self.backend().replicas();
        if n == 1 {
            return Ok(ty.clone());
        }
        let dims = ty.shape.dims();
        match dims.first() {
            Some(&b) if b % n == 0 => {
                let mut d = dims.to_vec();
                d[0] = b / n;
                Ok(TensorType::new(ty.dtype, d))
            }
            Some(&b) => Err(Error::Invalid(format!(
                "data-parallel over {n} replicas: input {index} ({ty}) has batch size {b}, \
                 which {n} replicas cannot split evenly"
            ))),
            None => Err(Error::Invalid(format!(
                "data-parallel over {n} replicas: input {index} is a scalar ({ty}); every input \
                 is split along its first dimension"
            ))),
        }
    }

    /// Uploads batch input `index`: whole on one replica, else split along its first dimension
    /// into one shard per replica (replica `r` gets rows `r·B/N .. (r+1)·B/N`). With `lend`,
    /// the buffer is for one synchronous use ([`Runtime::lend_tensor`] on one replica; shards
    /// are copies anyway).
    pub(crate) fn upload_batch(&self, index: usize, t: &Tensor, lend: bool) -> Result<B::Buffer> {
        let n = self.backend().replicas();
        if n == 1 && lend {
            return self.lend_tensor(t);
        }
        if n == 1 {
            return self.upload_tensor(t);
        }
        let shard_ty = self.replica_type(index, t.ty())?;
        let host = t.to_host()?;
        let shards = split_rows(&host, &shard_ty, n)?;
        let buf = self.backend().to_device_shards(&shards)?;
        for s in &shards {
            self.metrics.h2d(s.bytes().len());
        }
        Ok(buf)
    }

    /// A result for the caller: downloaded whole on one replica, else every replica's value
    /// joined along the first dimension (the inverse of [`Runtime::upload_batch`]).
    pub(crate) fn download_result(&self, b: &B::Buffer) -> Result<Tensor> {
        if self.backend().replicas() == 1 {
            return self.download_tensor(b);
        }
        let shards = self.backend().to_host_shards(b)?;
        for s in &shards {
            self.metrics.d2h(s.bytes().len());
        }
        Tensor::from_host(&concat_rows(&shards)?)
    }

    /// [`Runtime::download_result`] of a buffer nothing else reads
    /// ([`Backend::to_tensor_owned`]).
    pub(crate) fn download_result_owned(&self, b: B::Buffer) -> Result<Tensor> {
        if self.backend().replicas() != 1 {
            return self.download_result(&b);
        }
        let t = self.backend().to_tensor_owned(b)?;
        self.metrics.d2h(t.ty().size_in_bytes());
        Ok(t)
    }

    /// A new buffer with `b`'s value on every replica (through the host: the [`Backend`]
    /// trait has no device copy).
    pub(crate) fn copy_buffer(&self, b: &B::Buffer) -> Result<B::Buffer> {
        if self.backend().replicas() == 1 {
            let h = self.download(b)?;
            return self.upload(&h);
        }
        let shards = self.backend().to_host_shards(b)?;
        for s in &shards {
            self.metrics.d2h(s.bytes().len());
        }
        let buf = self.backend().to_device_shards(&shards)?;
        for s in &shards {
            self.metrics.h2d(s.bytes().len());
        }
        Ok(buf)
    }
}

/// `host` cut into `n` row blocks of type `shard_ty` (a row-major tensor's first dimension is
/// its outermost, so each block is a contiguous byte range).
fn split_rows(host: &HostTensor, shard_ty: &TensorType, n: usize) -> Result<Vec<HostTensor>> {
    let bytes = host.bytes();
    let chunk = bytes.len() / n;
    (0..n)
        .map(|r| {
            HostTensor::from_bytes(shard_ty.clone(), bytes[r * chunk..(r + 1) * chunk].to_vec())
        })
        .collect()
}

/// Joins per-replica values along their first dimension (the inverse of the batch split).
/// A scalar cannot be joined: a data-parallel function's outputs are batches.
fn concat_rows(shards: &[HostTensor]) -> Result<HostTensor> {
    let first = shards
        .first()
        .ok_or_else(|| Error::Internal("no replica values to join".into()))?;
    let ty = first.ty();
    let Some(&rows) = ty.shape.dims().first() else {
        return Err(Error::Invalid(format!(
            "a data-parallel function returned a scalar ({ty}); each replica's outputs are \
             joined along their first dimension"
        )));
    };
    let mut dims = ty.shape.dims().to_vec();
    dims[0] = rows * shards.len();
    let mut data = Vec::with_capacity(first.bytes().len() * shards.len());
    for s in shards {
        data.extend_from_slice(s.bytes());
    }
    HostTensor::from_bytes(TensorType::new(ty.dtype, dims), data)
}
