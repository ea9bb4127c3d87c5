//! [`DeviceOutputs`]: a compiled function's results left on the device.

use super::Runtime;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::trace::Tensor;

/// Where one result of a device run is.
pub(crate) enum DeviceResult {
    /// The caller's own argument, returned unchanged (it never left the host).
    Input(Tensor),
    /// A buffer of the run, by index.
    Buffer(usize),
}

/// The results of [`crate::CompiledFn::run_on_device`]: the backend's buffers, typed, still on
/// the device and possibly still being computed. Fetch them with [`DeviceOutputs::to_host`]
/// (waits), or wait without copying with [`DeviceOutputs::synchronize`].
///
/// Borrows the compiled function's runtime (the device the buffers live on); dropping it frees
/// the buffers (the backend keeps their memory until computations using them are done).
pub struct DeviceOutputs<'a, B: Backend> {
    rt: &'a Runtime<B>,
    buffers: Vec<B::Buffer>,
    results: Vec<DeviceResult>,
}

impl<'a, B: Backend> DeviceOutputs<'a, B> {
    pub(crate) fn new(
        rt: &'a Runtime<B>,
        buffers: Vec<B::Buffer>,
        results: Vec<DeviceResult>,
    ) -> Self {
        DeviceOutputs {
            rt,
            buffers,
            results,
        }
    }

    /// The number of results (the function's outputs).
    pub fn len(&self) -> usize {
        self.results.len()
    }

    /// Whether the function returned nothing.
    pub fn is_empty(&self) -> bool {
        self.results.is_empty()
    }

    /// The device buffer of result `i`; `None` if `i` is out of range or the result is the
    /// caller's own argument returned unchanged (kept on the host, never computed). Several
    /// results may share a buffer (a function returning one value twice).
    pub fn buffer(&self, i: usize) -> Option<&B::Buffer> {
        match self.results.get(i)? {
            DeviceResult::Buffer(k) => self.buffers.get(*k),
            DeviceResult::Input(_) => None,
        }
    }

    /// Are all results computed already (no wait)? `false` where the backend cannot tell
    /// ([`Backend::is_computed`]). A loop that keeps many calls' results until one final
    /// sync may drop those already computed at once.
    pub fn is_ready(&self) -> bool {
        let backend = self.rt.backend();
        self.buffers.iter().all(|b| backend.is_computed(b))
    }

    /// Waits until every result is computed, without copying (one sync point in the
    /// counters).
    pub fn synchronize(&self) -> Result<()> {
        let backend = self.rt.backend();
        for b in &self.buffers {
            backend.sync(b)?;
        }
        self.rt.metrics().synced();
        Ok(())
    }

    /// Result `i` on the host (waits for it).
    ///
    /// # Errors
    /// [`Error::Invalid`] if `i` is out of range; the backend's error if the download fails.
    pub fn get(&self, i: usize) -> Result<Tensor> {
        match self.results.get(i) {
            Some(DeviceResult::Input(t)) => Ok(t.clone()),
            Some(DeviceResult::Buffer(k)) => {
                let b = self.buffers.get(*k).ok_or_else(|| {
                    Error::Internal(format!("device result {i} refers to buffer {k}"))
                })?;
                self.rt.download_tensor(b)
            }
            None => Err(Error::Invalid(format!(
                "result {i} of a function with {} results",
                self.results.len()
            ))),
        }
    }

    /// Every result on the host (waits for them), as [`crate::CompiledFn::run`] returns them.
    pub fn to_host(&self) -> Result<Vec<Tensor>> {
        (0..self.results.len()).map(|i| self.get(i)).collect()
    }
}
