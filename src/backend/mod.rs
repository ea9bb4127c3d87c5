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

    /// Compiles `graph`.
    fn compile(&self, graph: &Graph) -> Result<Self::Executable>;

    /// Runs a compiled graph.
    fn execute(
        &self,
        exe: &Self::Executable,
        inputs: &[&Self::Buffer],
    ) -> Result<Vec<Self::Buffer>>;

    /// Copies a host tensor to the device.
    fn to_device(&self, t: &HostTensor) -> Result<Self::Buffer>;

    /// Copies a buffer to the host (waits for it to be computed).
    fn to_host(&self, b: &Self::Buffer) -> Result<HostTensor>;

    /// The type of a buffer.
    fn buffer_type(&self, b: &Self::Buffer) -> Result<TensorType>;

    /// Waits until `b` is computed. The default does nothing (synchronous backends).
    fn sync(&self, b: &Self::Buffer) -> Result<()> {
        let _ = b;
        Ok(())
    }

    /// Has `b` been consumed by an execution that donated it (its memory now belongs to an
    /// output)? Backends without donation return `false`.
    fn is_donated(&self, b: &Self::Buffer) -> Result<bool> {
        let _ = b;
        Ok(false)
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
}
