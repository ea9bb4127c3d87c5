//! The model zoo (placeholder until the full zoo lands: only the seeds' `LinearModel`).

use crate::error::{Error, Result};
use crate::nn::{Linear, Module, ParamStore, Sequential};
use crate::trace::Tensor;

/// A model of the zoo: parameters, example inputs, forward and a scalar training loss.
pub trait Model: Send {
    /// The zoo name (`"resnet18"`, ...).
    fn name(&self) -> &str;

    /// The model's parameters and buffers.
    fn store(&self) -> &ParamStore;

    /// Example inputs at the zoo's default size for `batch`; seeded.
    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>>;

    /// The forward pass; `train` selects training behaviour (dropout, batch statistics).
    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor>;

    /// A scalar training loss from the output. The default is the seeds'
    /// `reduce_to_scalar_loss`: the mean of the output.
    fn loss(&self, output: &Tensor, inputs: &[Tensor]) -> Result<Tensor> {
        let _ = inputs;
        output.mean_all()
    }
}

/// The zoo's model names, in the benchmark's order.
pub const NAMES: &[&str] = &["linear"];

/// Builds the zoo model `name` with parameters initialised from `seed`.
pub fn build(name: &str, seed: u64) -> Result<Box<dyn Model>> {
    let store = ParamStore::with_seed(seed);
    match name {
        "linear" => Ok(Box::new(LinearModel::new(store)?)),
        other => Err(Error::Invalid(format!(
            "unknown zoo model {other:?}; known: {}",
            NAMES.join(", ")
        ))),
    }
}

/// The seeds' `LinearModel`: `layers = Sequential(Linear(10, 10), Linear(10, 10))`, input
/// `randn(2, 10)`.
struct LinearModel {
    store: ParamStore,
    net: Sequential,
}

impl LinearModel {
    fn new(store: ParamStore) -> Result<Self> {
        let p = store.root().sub("layers");
        let net = Sequential::new()
            .add(Linear::new(&p.sub(0), 10, 10, true)?)
            .add(Linear::new(&p.sub(1), 10, 10, true)?);
        Ok(LinearModel { store, net })
    }
}

impl Model for LinearModel {
    fn name(&self) -> &str {
        "linear"
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(&[batch, 10], seed)?])
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        match inputs {
            [x] => self.net.forward_t(x, train),
            _ => Err(Error::Invalid(format!(
                "linear takes one input, got {}",
                inputs.len()
            ))),
        }
    }
}
