//! A backend that records the graphs kiln compiles on it and leaves everything else to an XLA
//! backend, its rewrite included: the profiling examples capture a model's convolutions and
//! dots with it, and `tests/conv_lowering.rs` checks what a compiled function hands the
//! backend. Included with `#[path]` by the examples that use it and by `tests/common`.

use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{Graph, TensorType};
use std::sync::{Arc, Mutex};

/// Records every graph it compiles (after the inner backend's rewrite), then delegates.
pub struct Recorder {
    inner: XlaBackend,
    graphs: Arc<Mutex<Vec<Graph>>>,
}

impl Recorder {
    /// A recorder over `inner`, and the list the compiled graphs are appended to.
    pub fn new(inner: XlaBackend) -> (Self, Arc<Mutex<Vec<Graph>>>) {
        let graphs = Arc::new(Mutex::new(Vec::new()));
        let r = Recorder {
            inner,
            graphs: graphs.clone(),
        };
        (r, graphs)
    }
}

impl Backend for Recorder {
    type Buffer = <XlaBackend as Backend>::Buffer;
    type Executable = <XlaBackend as Backend>::Executable;
    fn name(&self) -> &str {
        "recorder"
    }
    fn rewrite(&self, graph: &mut Graph) -> kiln::Result<()> {
        self.inner.rewrite(graph)
    }
    fn compile(&self, graph: &Graph) -> kiln::Result<Self::Executable> {
        self.graphs.lock().unwrap().push(graph.clone());
        self.inner.compile(graph)
    }
    fn execute(
        &self,
        exe: &Self::Executable,
        inputs: &[&Self::Buffer],
    ) -> kiln::Result<Vec<Self::Buffer>> {
        self.inner.execute(exe, inputs)
    }
    fn to_device(&self, t: &HostTensor) -> kiln::Result<Self::Buffer> {
        self.inner.to_device(t)
    }
    fn to_host(&self, b: &Self::Buffer) -> kiln::Result<HostTensor> {
        self.inner.to_host(b)
    }
    fn buffer_type(&self, b: &Self::Buffer) -> kiln::Result<TensorType> {
        self.inner.buffer_type(b)
    }
    fn sync(&self, b: &Self::Buffer) -> kiln::Result<()> {
        self.inner.sync(b)
    }
}
