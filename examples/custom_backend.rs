//! A user-defined backend, written against kiln's public `Backend` trait only.
//!
//! `OpCounter<B>` wraps any backend: at compile time it counts the graph's ops by name and
//! prints a histogram; it counts executions; everything else it delegates. The same pattern
//! fits a backend that dispatches some graphs to an engine of your own.
//!
//! `cargo run --release --example custom_backend`

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{Graph, Op, TensorType};
use kiln::nn::{Linear, Module, ParamStore, Relu, Sequential};
use kiln::{compile, Tensor};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Counts and logs ops, then delegates to `inner`.
struct OpCounter<B> {
    inner: B,
    label: String,
    executions: Arc<AtomicU64>,
}

impl<B: Backend> Backend for OpCounter<B> {
    type Buffer = B::Buffer;
    type Executable = B::Executable;

    fn name(&self) -> &str {
        &self.label
    }

    fn compile(&self, graph: &Graph) -> kiln::Result<B::Executable> {
        let mut histogram: BTreeMap<&str, usize> = BTreeMap::new();
        for id in graph.topo_order() {
            let op = &graph.node(id).op;
            if !matches!(op, Op::Input(_)) {
                *histogram.entry(op.name()).or_default() += 1;
            }
        }
        println!(
            "[{}] compiling {} nodes, fingerprint {}",
            self.label,
            graph.len(),
            &graph.fingerprint().to_hex()[..16]
        );
        for (op, n) in &histogram {
            println!("[{}]   {op:<12} x{n}", self.label);
        }
        self.inner.compile(graph)
    }

    fn execute(&self, exe: &B::Executable, inputs: &[&B::Buffer]) -> kiln::Result<Vec<B::Buffer>> {
        self.executions.fetch_add(1, Ordering::Relaxed);
        self.inner.execute(exe, inputs)
    }

    fn to_device(&self, t: &HostTensor) -> kiln::Result<B::Buffer> {
        self.inner.to_device(t)
    }

    fn to_host(&self, b: &B::Buffer) -> kiln::Result<HostTensor> {
        self.inner.to_host(b)
    }

    fn buffer_type(&self, b: &B::Buffer) -> kiln::Result<TensorType> {
        self.inner.buffer_type(b)
    }

    fn sync(&self, b: &B::Buffer) -> kiln::Result<()> {
        self.inner.sync(b)
    }

    fn cache_key(&self) -> String {
        format!("op-counter/{}", self.inner.cache_key())
    }
}

fn run<B: Backend>(inner: B, label: &str) -> kiln::Result<Vec<f64>> {
    let store = ParamStore::with_seed(7);
    let root = store.root();
    let model = Sequential::new()
        .add(Linear::new(&root.sub("0"), 10, 16, true)?)
        .add(Relu)
        .add(Linear::new(&root.sub("2"), 16, 4, true)?);
    let executions = Arc::new(AtomicU64::new(0));
    let backend = OpCounter {
        inner,
        label: label.to_string(),
        executions: executions.clone(),
    };
    let mut f = compile(backend, move |xs: &[Tensor]| {
        Ok(vec![model.forward(&xs[0])?.softmax(-1)?])
    });
    let x = Tensor::randn(&[3, 10], 1)?;
    let mut out = Vec::new();
    for _ in 0..3 {
        out = f.run(std::slice::from_ref(&x))?[0].to_f64_vec()?;
    }
    println!(
        "[{label}] executions counted by the custom backend: {}, compiles: {}",
        executions.load(Ordering::Relaxed),
        f.stats().compiles
    );
    Ok(out)
}

fn main() -> kiln::Result<()> {
    let a = run(EagerBackend::new(), "counter+eager")?;
    let b = run(XlaBackend::new()?, "counter+xla")?;
    let diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    println!("max |eager - xla| through the custom backend: {diff:.2e}");
    if diff > 1e-5 {
        return Err(kiln::Error::Invalid(format!("backends disagree by {diff}")));
    }
    Ok(())
}
