// torchbench.py's example `LinearModel` (pytorch#89028) as a user model for the benchmark harness:
//
//     cargo run --release -p kiln-bench -- --only path:benches/user_models/linear_model.rs,class:LinearModel
//
// The harness `include!`s this file into a scratch crate that depends on kiln, so it is plain
// Rust with `use kiln::...` imports: a type implementing `kiln::zoo::Model`, and a constructor
// `fn new(store: &ParamStore) -> kiln::Result<Self>` that creates the parameters in `store`.
// (No `fn main` and no `//!` comments: the file is included into a crate root.)

use kiln::nn::{Linear, Module, ParamStore, Sequential};
use kiln::zoo::Model;
use kiln::{Result, Tensor};

/// Two `Linear(10, 10)` layers (the example's `nlayer=2`: AOTAutograd skips graphs with under
/// two call nodes).
pub struct LinearModel {
    store: ParamStore,
    layers: Sequential,
}

impl LinearModel {
    pub fn new(store: &ParamStore) -> Result<Self> {
        let p = store.root().sub("layers");
        let layers = Sequential::new()
            .add(Linear::new(&p.sub(0), 10, 10, true)?)
            .add(Linear::new(&p.sub(1), 10, 10, true)?);
        Ok(LinearModel {
            store: store.clone(),
            layers,
        })
    }
}

impl Model for LinearModel {
    fn name(&self) -> &str {
        "LinearModel"
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    /// The example's `get_example_inputs`: `(torch.randn(2, 10),)`, here `batch` rows.
    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(&[batch, 10], seed)?])
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        self.layers.forward_t(&inputs[0], train)
    }
}
