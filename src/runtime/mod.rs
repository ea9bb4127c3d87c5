//! The runtime shared by [`crate::CompiledFn`] and [`crate::train::TrainStep`]: device-resident
//! variables, the executable cache, transfers and metrics.
//!
//! Variables (parameters, buffers, optimizer state) are uploaded once and then live on the
//! device as backend buffers. Executables that update them return the new values, which
//! replace the old buffers (donated, so XLA updates in place); the
//! [`crate::nn::ParamStore`] is refreshed only on request ([`Runtime::sync_to_store`]).
//!
//! A runtime is used through `&self` and locks its variable table inside, so one runtime can
//! serve several threads ([`crate::SharedFn`]); it is `Sync` when the backend's buffers are.

mod cache;
pub(crate) mod exec;
mod metrics;
mod outputs;
pub(crate) mod shard;

pub use cache::ExecutableCache;
pub use metrics::{Metrics, Stats};
pub use outputs::DeviceOutputs;
pub(crate) use outputs::DeviceResult;

use crate::backend::{Backend, HostTensor};
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph};
use crate::trace::Tensor;
use exec::VarId;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::Arc;

pub(crate) struct Resident<Buf> {
    pub(crate) buffer: Buf,
    /// The device copy is newer than the store's.
    dirty: bool,
}

/// Device copies of variables, by variable id (looked up for every argument of every call:
/// foldhash, not SipHash).
pub(crate) type VarTable<Buf> = foldhash::HashMap<VarId, Resident<Buf>>;

/// Device state and services for running compiled graphs on one backend.
pub struct Runtime<B: Backend> {
    backend: B,
    cache: ExecutableCache<B>,
    vars: RwLock<VarTable<B::Buffer>>,
    /// The store tensor of every variable seen: uploaded when it is not resident, written by
    /// [`Runtime::sync_to_store`]. Apart from the buffers because a tensor is `Send` but not
    /// `Sync`.
    handles: Mutex<HashMap<VarId, Tensor>>,
    /// Whether each variable lives transposed on the device (decided before its first upload,
    /// see [`Backend::prefers_transposed`]); absent: not yet decided, PyTorch's layout.
    layouts: Mutex<HashMap<VarId, bool>>,
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
            vars: RwLock::new(Default::default()),
            handles: Mutex::new(HashMap::new()),
            layouts: Mutex::new(HashMap::new()),
            metrics: Arc::new(Metrics::default()),
        }
    }

    /// Uses `cache` for executables from now on (executables compiled before stay in the
    /// previous cache); the resident variables stay.
    pub fn set_cache(&mut self, cache: ExecutableCache<B>) {
        self.cache = cache;
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
    ///
    /// With `KILN_DUMP=DIR` set, every stage of the program is written to `DIR` the first time
    /// this process gets it ([`crate::inspect`]).
    pub fn executable(&self, graph: &Graph, fp: Fingerprint) -> Result<Arc<B::Executable>> {
        let exe = self
            .cache
            .get_or_compile(&self.backend, graph, fp, &self.metrics)?;
        crate::inspect::dump_if_enabled(&self.backend, graph, fp, &exe);
        Ok(exe)
    }

    /// Copies a host tensor to the device (to every replica's device on a data-parallel
    /// backend: one transfer each).
    pub fn upload(&self, h: &HostTensor) -> Result<B::Buffer> {
        let b = self.backend.to_device(h)?;
        self.count_upload(h.bytes().len());
        Ok(b)
    }

    /// Copies an eager tensor to the device ([`Backend::tensor_to_device`]).
    pub fn upload_tensor(&self, t: &Tensor) -> Result<B::Buffer> {
        let b = self.backend.tensor_to_device(t)?;
        self.count_upload(t.ty().size_in_bytes());
        Ok(b)
    }

    /// An eager tensor's values on the device for one synchronous use
    /// ([`Backend::lend_to_device`]: maybe without a copy). The caller must drop the buffer
    /// before the tensor can change.
    pub fn lend_tensor(&self, t: &Tensor) -> Result<B::Buffer> {
        let b = self.backend.lend_to_device(t)?;
        self.count_upload(t.ty().size_in_bytes());
        Ok(b)
    }

    /// Counts an upload of `bytes` to every replica's device (one transfer each).
    pub(crate) fn count_upload(&self, bytes: usize) {
        for _ in 0..self.backend.replicas() {
            self.metrics.h2d(bytes);
        }
    }

    /// Copies a buffer to the host, waiting for it (one sync point).
    pub fn download(&self, b: &B::Buffer) -> Result<HostTensor> {
        let h = self.backend.to_host(b)?;
        self.metrics.d2h(h.bytes().len());
        Ok(h)
    }

    /// Copies a buffer into a new eager tensor, waiting for it (one sync point); see
    /// [`Backend::to_tensor`].
    pub fn download_tensor(&self, b: &B::Buffer) -> Result<Tensor> {
        let t = self.backend.to_tensor(b)?;
        self.metrics.d2h(t.ty().size_in_bytes());
        Ok(t)
    }

    /// Waits for `b` to be computed without copying it (one sync point).
    pub fn sync(&self, b: &B::Buffer) -> Result<()> {
        self.backend.sync(b)?;
        self.metrics.synced();
        Ok(())
    }

    /// Waits until the device value of every resident variable is computed, i.e. until
    /// every execution that updates a variable has finished (one sync point in the counters).
    /// Values donated to a later execution are skipped: that execution's outputs are waited
    /// for instead.
    pub fn synchronize(&self) -> Result<()> {
        self.wait_for_vars()?;
        self.metrics.synced();
        Ok(())
    }

    /// [`Runtime::synchronize`] without counting a sync point.
    fn wait_for_vars(&self) -> Result<()> {
        self.wait_for(self.vars.read().values().map(|r| &r.buffer))
    }

    /// Waits until each of `buffers` is computed, skipping those donated to a later
    /// execution (whose own outputs are then the ones to wait for).
    pub(crate) fn wait_for<'a>(
        &self,
        buffers: impl IntoIterator<Item = &'a B::Buffer>,
    ) -> Result<()>
    where
        B::Buffer: 'a,
    {
        for b in buffers {
            if !self.backend.is_donated(b)? {
                self.backend.sync(b)?;
            }
        }
        Ok(())
    }

    /// Runs an executable.
    pub fn execute(&self, exe: &B::Executable, args: &[&B::Buffer]) -> Result<Vec<B::Buffer>> {
        let outs = self.backend.execute(exe, args)?;
        self.metrics.executed();
        Ok(outs)
    }

    /// Runs an executable whose outputs the caller waits for before it drops any argument
    /// ([`Backend::execute_awaited`]).
    pub(crate) fn execute_awaited(
        &self,
        exe: &B::Executable,
        args: &[&B::Buffer],
    ) -> Result<Vec<B::Buffer>> {
        let outs = self.backend.execute_awaited(exe, args)?;
        self.metrics.executed();
        Ok(outs)
    }

    /// Records `var` as a variable of this runtime (uploaded when first needed); returns its
    /// id.
    pub(crate) fn register(&self, var: &Tensor) -> Result<VarId> {
        let id = var_id(var)?;
        self.handles.lock().entry(id).or_insert_with(|| var.clone());
        Ok(id)
    }

    /// Uploads variable `var` unless it is already resident.
    pub fn ensure_var(&self, var: &Tensor) -> Result<()> {
        let id = self.register(var)?;
        self.make_resident(&mut self.vars.write(), &[id])
    }

    /// Uploads the store values of the variables in `ids` that are not resident.
    pub(crate) fn make_resident(
        &self,
        vars: &mut VarTable<B::Buffer>,
        ids: &[VarId],
    ) -> Result<()> {
        for &id in ids {
            if vars.contains_key(&id) {
                continue;
            }
            let host = match self.handles.lock().get(&id) {
                Some(t) => t.to_host()?,
                None => {
                    return Err(Error::Internal(format!(
                        "variable {id} used before it was registered"
                    )))
                }
            };
            let buffer = self.upload(&self.device_layout(id, host)?)?;
            vars.insert(
                id,
                Resident {
                    buffer,
                    dirty: false,
                },
            );
        }
        Ok(())
    }

    /// Makes `value` the device copy of variable `var` (uploading it).
    pub fn set_var(&self, var: &Tensor, value: &HostTensor) -> Result<()> {
        let id = self.register(var)?;
        let buffer = self.upload(&self.device_layout(id, value.clone())?)?;
        self.replace_resident(&mut self.vars.write(), id, buffer)
    }

    /// Whether `var` lives transposed on the device: decided now from `wanted` if it has not
    /// been (and only before its first upload: a resident value keeps its layout).
    pub(crate) fn transposed_layout(&self, var: &Tensor, wanted: bool) -> Result<bool> {
        let id = self.register(var)?;
        let mut layouts = self.layouts.lock();
        if let Some(&t) = layouts.get(&id) {
            return Ok(t);
        }
        let t = wanted && !self.vars.read().contains_key(&id);
        layouts.insert(id, t);
        Ok(t)
    }

    /// `value` (in the store's layout) as variable `id` lives on the device.
    fn device_layout(&self, id: VarId, value: HostTensor) -> Result<HostTensor> {
        match self.layouts.lock().get(&id) {
            Some(true) => value.transposed_2d(),
            _ => Ok(value),
        }
    }

    /// A device value of variable `id` in the store's layout.
    fn store_layout(&self, id: VarId, value: HostTensor) -> Result<HostTensor> {
        self.device_layout(id, value)
    }

    /// The device copy of a resident variable, downloaded.
    pub fn read_var(&self, var: &Tensor) -> Result<HostTensor> {
        let id = var_id(var)?;
        let vars = self.vars.read();
        let r = vars
            .get(&id)
            .ok_or_else(|| Error::Invalid(format!("variable {var:?} is not resident")))?;
        self.store_layout(id, self.download(&r.buffer)?)
    }

    /// Replaces the device copy of `var` by `buffer` (a newer value computed on the device).
    pub fn replace_var(&self, var: &Tensor, buffer: B::Buffer) -> Result<()> {
        let id = self.register(var)?;
        self.replace_resident(&mut self.vars.write(), id, buffer)
    }

    pub(crate) fn replace_resident(
        &self,
        vars: &mut VarTable<B::Buffer>,
        id: VarId,
        buffer: B::Buffer,
    ) -> Result<()> {
        let old = vars.insert(
            id,
            Resident {
                buffer,
                dirty: true,
            },
        );
        if let Some(old) = old {
            if self.backend.is_donated(&old.buffer)? {
                self.metrics.donation();
            }
        }
        Ok(())
    }

    /// Number of resident variables.
    pub fn num_resident(&self) -> usize {
        self.vars.read().len()
    }

    /// Copies every variable updated on the device back into its store.
    pub fn sync_to_store(&self) -> Result<()> {
        self.sync_table(&mut self.vars.write())
    }

    fn sync_table(&self, vars: &mut VarTable<B::Buffer>) -> Result<()> {
        let handles = self.handles.lock();
        for (id, r) in vars.iter_mut().filter(|(_, r)| r.dirty) {
            let var = handles
                .get(id)
                .ok_or_else(|| Error::Internal(format!("resident variable {id} has no handle")))?;
            let h = self.store_layout(*id, self.download(&r.buffer)?)?;
            var.assign(&Tensor::from_host(&h)?)?;
            r.dirty = false;
        }
        Ok(())
    }

    /// Drops the device copies (after syncing pending updates to the store), so the next use
    /// uploads the store's current values. Call after changing the store eagerly.
    pub fn refresh_from_store(&self) -> Result<()> {
        let mut vars = self.vars.write();
        self.sync_table(&mut vars)?;
        vars.clear();
        Ok(())
    }
}

pub(crate) fn var_id(t: &Tensor) -> Result<u64> {
    t.variable()
        .map(|v| v.id)
        .ok_or_else(|| Error::Invalid(format!("{t:?} is not a variable of a parameter store")))
}

/// Dropping a runtime waits for the executions that write its variables.
///
/// Why: executions run asynchronously (a training step returns once its loss is computed),
/// and a process that ends while one still runs (`main` returns right after its last step)
/// tears the plugin down under it: the CPU plugin's global destructors unmap the oneDNN code
/// its worker threads are running (SIGSEGV at exit, 4 in 6 runs of a loop of split vit steps
/// on a 2-vCPU Zen 4).
impl<B: Backend> Drop for Runtime<B> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_for_vars() {
            log::warn!("dropping a runtime: waiting for its variables failed: {e}");
        }
    }
}
