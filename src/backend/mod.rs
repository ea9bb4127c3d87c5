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
/// - [`Backend::compile`] receives a verified graph. It may reject ops it does not support with
///   [`crate::Error::Unsupported`].
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
    /// plugin version, compile options). Part of persistent-cache keys.
    fn cache_key(&self) -> String {
        self.name().to_string()
    }
}
