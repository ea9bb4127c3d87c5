//! The runtime shared by [`crate::CompiledFn`] and [`crate::train::TrainStep`]: device-resident
//! variables, the executable cache, transfers and metrics.
//!
//! Variables (parameters, buffers, optimizer state) are uploaded once and then live on the
//! device as backend buffers. Executables that update them return the new values, which
//! replace the old buffers (donated, so XLA updates in place); the
//! [`crate::nn::ParamStore`] is refreshed only on request ([`Runtime::sync_to_store`]).

mod cache;
mod metrics;

pub use cache::ExecutableCache;
pub use metrics::{Metrics, Stats};

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph};
use crate::trace::Tensor;
use std::collections::HashMap;
use std::sync::Arc;

struct Resident<Buf> {
    var: Tensor,
    buffer: Buf,
    /// The device copy is newer than the store's.
    dirty: bool,
}

/// Device state and services for running compiled graphs on one backend.
pub struct Runtime<B: Backend> {
    backend: B,
    cache: ExecutableCache<B>,
    vars: HashMap<u64, Resident<B::Buffer>>,
    metrics: Arc<Metrics>,
}

impl<B: Backend> Runtime<B> {
    /// A runtime with a cache configured by the environment ([`ExecutableCache::from_env`]).
    pub fn new(backend: B) -> Self {
        Self::with_cache(backend, ExecutableCache::from_env())
    }

    /// A runtime using `cache` (which may be shared with other runtimes).
    pub fn with_cache(backend: B, cache: ExecutableCache<B>) -> Self {
        Runtime {
            backend,
            cache,
            vars: HashMap::new(),
            metrics: Arc::new(Metrics::default()),
        }
    }

    /// Gives the backend back (dropping the device state).
    pub fn into_backend(self) -> B {
        self.backend
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The executable cache.
    pub fn cache(&self) -> &ExecutableCache<B> {
        &self.cache
    }

    /// The live counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        self.metrics.snapshot()
    }

    /// The executable for `graph`: cached in memory, on disk, or compiled now.
    pub fn executable(&self, graph: &Graph, fp: Fingerprint) -> Result<Arc<B::Executable>> {
        self.cache
            .get_or_compile(&self.backend, graph, fp, &self.metrics)
    }

    /// Copies a host tensor to the device.
    pub fn upload(&self, h: &HostTensor) -> Result<B::Buffer> {
        let b = self.backend.to_device(h)?;
        self.metrics.h2d(h.bytes().len());
        Ok(b)
    }

    /// Copies an eager tensor to the device.
    pub fn upload_tensor(&self, t: &Tensor) -> Result<B::Buffer> {
        self.upload(&t.to_host()?)
    }

    /// Copies a buffer to the host, waiting for it (one sync point).
    pub fn download(&self, b: &B::Buffer) -> Result<HostTensor> {
        let h = self.backend.to_host(b)?;
        self.metrics.d2h(h.bytes().len());
        Ok(h)
    }

    /// Waits for `b` to be computed without copying it (one sync point).
    pub fn sync(&self, b: &B::Buffer) -> Result<()> {
        self.backend.sync(b)?;
        self.metrics.synced();
        Ok(())
    }

    /// Runs an executable.
    pub fn execute(&self, exe: &B::Executable, args: &[&B::Buffer]) -> Result<Vec<B::Buffer>> {
        let outs = self.backend.execute(exe, args)?;
        self.metrics.executed();
        Ok(outs)
    }

    /// Uploads variable `var` unless it is already resident.
    pub fn ensure_var(&mut self, var: &Tensor) -> Result<()> {
        let id = var_id(var)?;
        if !self.vars.contains_key(&id) {
            let buffer = self.upload_tensor(var)?;
            self.vars.insert(
                id,
                Resident {
                    var: var.clone(),
                    buffer,
                    dirty: false,
                },
            );
        }
        Ok(())
    }

    /// Makes `value` the device copy of variable `var` (uploading it).
    pub fn set_var(&mut self, var: &Tensor, value: &HostTensor) -> Result<()> {
        let buffer = self.upload(value)?;
        self.replace_var(var, buffer)
    }

    /// The device buffer of a resident variable.
    pub fn var_buffer(&self, var: &Tensor) -> Result<&B::Buffer> {
        let id = var_id(var)?;
        self.vars
            .get(&id)
            .map(|r| &r.buffer)
            .ok_or_else(|| Error::Invalid(format!("variable {var:?} is not resident")))
    }

    /// Replaces the device copy of `var` by `buffer` (a newer value computed on the device).
    pub fn replace_var(&mut self, var: &Tensor, buffer: B::Buffer) -> Result<()> {
        let id = var_id(var)?;
        if let Some(old) = self.vars.get(&id) {
            if self.backend.is_donated(&old.buffer)? {
                self.metrics.donation();
            }
        }
        self.vars.insert(
            id,
            Resident {
                var: var.clone(),
                buffer,
                dirty: true,
            },
        );
        Ok(())
    }

    /// Number of resident variables.
    pub fn num_resident(&self) -> usize {
        self.vars.len()
    }

    /// Copies every variable updated on the device back into its store.
    pub fn sync_to_store(&mut self) -> Result<()> {
        for r in self.vars.values_mut().filter(|r| r.dirty) {
            let h = self.backend.to_host(&r.buffer)?;
            self.metrics.d2h(h.bytes().len());
            r.var.assign(&Tensor::from_host(&h)?)?;
            r.dirty = false;
        }
        Ok(())
    }

    /// Drops the device copies (after syncing pending updates to the store), so the next use
    /// uploads the store's current values. Call after changing the store eagerly.
    pub fn refresh_from_store(&mut self) -> Result<()> {
        self.sync_to_store()?;
        self.vars.clear();
        Ok(())
    }
}

pub(crate) fn var_id(t: &Tensor) -> Result<u64> {
    t.variable()
        .map(|v| v.id)
        .ok_or_else(|| Error::Invalid(format!("{t:?} is not a variable of a parameter store")))
}
