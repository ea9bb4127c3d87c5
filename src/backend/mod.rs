//! Backends: compile a [`Graph`] once, run it many times on backend buffers.
//!
//! The trait is deliberately small, like PJRT itself: compile, execute, and move data between
//! host and device. It is not a trait per op: a backend receives whole graphs over the closed
//! [`crate::ir::Op`] set. Two backends are built in:
//!
//! - [`eager::EagerBackend`]: interprets the graph op by op with libtorch (tch). It is the
//!   reference every compiled result is checked against.
//! - [`xla::XlaBackend`]: lowers the graph to StableHLO text and compiles it with a PJRT plugin.
//!
//! A user implements [`Backend`] in their own crate to plug in another engine; the
//! `custom_backend` example shows one. [`registry`] picks a backend by name (e.g. from a
//! configuration file) behind an object-safe wrapper, [`registry::DynBackend`].

pub mod eager;
mod host;
pub mod registry;
pub mod xla;

pub use host::{Element, HostTensor};

use crate::error::Result;
use crate::ir::{Graph, TensorType};

/// A compile-and-run engine for graphs.
///
/// Contract:
/// - [`Backend::rewrite`] runs once on every graph kiln prepares for this backend, before the
///   graph is fingerprinted (the compile-cache key) and compiled: what is compiled is what was
///   fingerprinted.
/// - [`Backend::compile`] receives a verified graph (from kiln's runtime: one already
///   rewritten). It may reject ops it does not support with [`crate::Error::Unsupported`].
/// - [`Backend::execute`] receives one buffer per graph input, in order, with the declared types,
///   and returns one buffer per graph output, in order. Inputs listed in
///   [`Graph::aliases`] are *donated*: the backend may reuse their memory for the aliased
///   output, and the caller must not use a donated buffer afterwards.
/// - Execution may be asynchronous: `execute` may return before the results are computed;
///   [`Backend::to_host`] and [`Backend::sync`] wait for them.
pub trait Backend: Send + Sync + 'static {
    /// A tensor resident on the backend's device.
    type Buffer: Send;
    /// A compiled graph.
    type Executable: Send + Sync + 'static;

    /// A short name (`"eager"`, `"xla"`), used in messages and tables.
    fn name(&self) -> &str;

    /// Rewrites `graph` into the form this backend compiles (e.g. ops it implements better
    /// as other ops: [`crate::passes::Im2col`]). The default changes nothing.
    ///
    /// The rewrite must keep the graph's signature (inputs, outputs, their order and types,
    /// aliases) and its values, and should be idempotent. It runs after kiln's own
    /// simplification, and the result is verified before it is fingerprinted; the compile
    /// cache key is the rewritten graph's fingerprint plus [`Backend::cache_key`].
    fn rewrite(&self, graph: &mut Graph) -> Result<()> {
        let _ = graph;
        Ok(())
    }

    /// Should the variable bound to rank-2 input `input` of `graph` live on the device
    /// transposed (`[d1, d0]`), as this backend's kernels run the graph faster that way? The
    /// runtime asks once per variable, before its first upload, and keeps the answer: the
    /// [`crate::nn::ParamStore`] and every value the caller sees keep PyTorch's layout, and
    /// every graph reading the variable gets a transpose of the device value (which a compiler
    /// folds into its consumers). The default says no.
    fn prefers_transposed(&self, graph: &Graph, input: usize) -> bool {
        let _ = (graph, input);
        false
    }

    /// Compiles `graph`.
    fn compile(&self, graph: &Graph) -> Result<Self::Executable>;

    /// Runs a compiled graph.
    fn execute(
        &self,
        exe: &Self::Executable,
        inputs: &[&Self::Buffer],
    ) -> Result<Vec<Self::Buffer>>;

    /// [`Backend::execute`] for a caller that waits for the outputs (reads one back) before
    /// it drops any input, as kiln's runtime does for a step that returns host values. A
    /// backend may skip bookkeeping that only matters for inputs dropped while the graph
    /// runs; the default is [`Backend::execute`].
    fn execute_awaited(
        &self,
        exe: &Self::Executable,
        inputs: &[&Self::Buffer],
    ) -> Result<Vec<Self::Buffer>> {
        self.execute(exe, inputs)
    }

    /// Copies a host tensor to the device.
    fn to_device(&self, t: &HostTensor) -> Result<Self::Buffer>;

    /// Copies an eager tensor to the device. The default goes through a host copy
    /// ([`Backend::to_device`]); a backend may read the tensor's memory directly.
    fn tensor_to_device(&self, t: &crate::Tensor) -> Result<Self::Buffer> {
        self.to_device(&t.to_host()?)
    }

    /// An eager tensor's values on the device for one synchronous use: the caller drops the
    /// buffer before the tensor can change (kiln lends the inputs of
    /// [`CompiledFn::run`](crate::CompiledFn::run) this way: the call reads them, waits for
    /// its results and drops them). A backend may use the tensor's memory as the buffer's
    /// storage instead of copying it, holding a handle on the tensor while the buffer lives;
    /// the default copies ([`Backend::tensor_to_device`]).
    fn lend_to_device(&self, t: &crate::Tensor) -> Result<Self::Buffer> {
        self.tensor_to_device(t)
    }

    /// Does `b`, lent from `t` by [`Backend::lend_to_device`], read `t`'s memory in place?
    /// Then it holds `t`'s values whenever no execution is running, changes included, and
    /// may serve again for the same tensor (see [`CompiledFn::run`](crate::CompiledFn::run)).
    /// The default: no (its lend copies).
    fn lends_in_place(&self, b: &Self::Buffer, t: &crate::Tensor) -> bool {
        let _ = (b, t);
        false
    }

    /// Copies a buffer to the host (waits for it to be computed).
    fn to_host(&self, b: &Self::Buffer) -> Result<HostTensor>;

    /// Copies a buffer into a new eager tensor (waits for it). The default goes through
    /// [`Backend::to_host`]; a backend may write the tensor's memory directly.
    fn to_tensor(&self, b: &Self::Buffer) -> Result<crate::Tensor> {
        crate::Tensor::from_host(&self.to_host(b)?)
    }

    /// [`Backend::to_tensor`] of a buffer the caller gives up (an execution's result that
    /// nothing else reads), which a backend may copy with fewer checks. The default copies
    /// it as `to_tensor` does.
    fn to_tensor_owned(&self, b: Self::Buffer) -> Result<crate::Tensor> {
        self.to_tensor(&b)
    }

    /// The type of a buffer.
    fn buffer_type(&self, b: &Self::Buffer) -> Result<TensorType>;

    /// Waits until `b` is computed. The default does nothing (synchronous backends).
    fn sync(&self, b: &Self::Buffer) -> Result<()> {
        let _ = b;
        Ok(())
    }

    /// Is `b` computed already (no wait)? `false` where the backend cannot tell, the default.
    /// kiln asks it of the results of [`CompiledFn::run_on_device`](crate::CompiledFn::run_on_device)
    /// right after the execution is launched: a program the backend ran to completion inside
    /// the launch can read its next call's inputs in place, as [`CompiledFn::run`](crate::CompiledFn::run) does.
    fn is_computed(&self, b: &Self::Buffer) -> bool {
        let _ = b;
        false
    }

    /// Has `b` been consumed by an execution that donated it (its memory now belongs to an
    /// output)? Backends without donation return `false`.
    fn is_donated(&self, b: &Self::Buffer) -> Result<bool> {
        let _ = b;
        Ok(false)
    }

    /// Text views of `exe`, compiled from `graph`, that only this backend has, in pipeline
    /// order after kiln's graph (see [`crate::inspect`]): XLA's are the StableHLO kiln emitted
    /// and the plugin's optimized HLO. A view the backend cannot produce holds the reason as
    /// its error. The default has none (a backend that runs the graph as it is).
    fn stages(&self, graph: &Graph, exe: &Self::Executable) -> Vec<crate::inspect::Stage> {
        let _ = (graph, exe);
        Vec::new()
    }

    /// Serializes a compiled executable for an on-disk cache; `None` if this backend cannot.
    fn serialize_executable(&self, exe: &Self::Executable) -> Result<Option<Vec<u8>>> {
        let _ = exe;
        Ok(None)
    }

    /// Loads an executable that [`Backend::serialize_executable`] produced for `graph`;
    /// `None` if this backend cannot.
    fn deserialize_executable(
        &self,
        graph: &Graph,
        bytes: &[u8],
    ) -> Result<Option<Self::Executable>> {
        let _ = (graph, bytes);
        Ok(None)
    }

    /// Identifies everything besides the graph that determines compiled code (platform,
    /// plugin version, compile options). Part of every executable cache key, in memory and on
    /// disk.
    fn cache_key(&self) -> String {
        self.name().to_string()
    }

    /// What besides the graph's fingerprint and [`Backend::cache_key`] determines the code
    /// compiled for `graph` (whose fingerprint is `fp`), e.g. per-node lowering choices made
    /// by measurement (the XLA backend's autotune). Part of the graph's executable cache key,
    /// so a changed choice compiles anew. The default, empty, says nothing does.
    fn graph_cache_key(&self, graph: &Graph, fp: &crate::ir::Fingerprint) -> Result<String> {
        let _ = (graph, fp);
        Ok(String::new())
    }

    /// Identifies the device context this backend's executables and buffers belong to (for
    /// PJRT: the client). Backends that return the same id can run each other's executables;
    /// an in-memory [`crate::runtime::ExecutableCache`] shared by several backends keys its
    /// entries by it (with [`Backend::cache_key`]). Clones of one backend return the same id.
    ///
    /// The default, `0`, says that executables are not tied to an instance (any instance with
    /// the same `cache_key` can run them), which is right for a backend whose executables are
    /// self-contained, like [`eager::EagerBackend`]'s. A backend whose executables hold device
    /// handles must return an id unique to its context, e.g. from a global counter.
    fn instance_id(&self) -> u64 {
        0
    }

    /// The number of data-parallel replicas every executable of this backend runs as (1 for a
    /// single-device backend). With N > 1 (e.g. [`xla::Replicated`]) a buffer holds one value
    /// per replica: variables hold the same value on every replica, batches one shard each
    /// ([`Backend::to_device_shards`]); [`Backend::to_device`] replicates and
    /// [`Backend::to_host`] reads replica 0.
    fn replicas(&self) -> usize {
        1
    }

    /// A buffer holding `shards[r]` on replica `r` (one shard per replica, all of one type).
    /// The default handles one replica.
    fn to_device_shards(&self, shards: &[HostTensor]) -> Result<Self::Buffer> {
        match shards {
            [one] => self.to_device(one),
            _ => Err(crate::Error::Unsupported {
                backend: self.name().to_string(),
                what: format!(
                    "{} shards on a backend of {} replica(s)",
                    shards.len(),
                    self.replicas()
                ),
            }),
        }
    }

    /// Every replica's value of `b`, in replica order. The default handles one replica.
    fn to_host_shards(&self, b: &Self::Buffer) -> Result<Vec<HostTensor>> {
        Ok(vec![self.to_host(b)?])
    }
}
