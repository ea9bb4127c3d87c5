//! The model zoo shared by the examples and the benchmark harness: torchvision's CNNs
//! (identical architectures, parameter names and counts), a BERT-style encoder, a vision
//! transformer (torchvision's `VisionTransformer` structure) and torchbench.py's `LinearModel`.
//!
//! Every model runs eagerly and traced from the same code, so it can be compiled with
//! [`crate::compile()`]:
//!
//! ```no_run
//! use kiln::backend::xla::XlaBackend;
//! use kiln::zoo::{self, Model, SharedModel};
//! use kiln::{compile, Tensor};
//!
//! // Shared (Arc + Mutex) so that the compiled closure, which must be `Send`, can hold it.
//! let model = SharedModel::new(zoo::build("resnet18", 0)?);
//! let inputs = model.example_inputs(4, 0)?;
//! let eager = tch::no_grad(|| model.forward(&inputs, false))?;
//! let m = model.clone();
//! let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]));
//! let compiled = f.run(&inputs)?;
//! # Ok::<(), kiln::Error>(())
//! ```
//!
//! Default example inputs: batch 4 of `3x64x64` images (seeded normal values) for the image
//! models, `i64` token ids `[batch, 64]` for `bert`, `randn(2, 10)`-shaped `[batch, 10]` for
//! `linear`. Parameter names of the CNNs are torchvision's `state_dict` keys, so torchvision
//! weights saved as safetensors load with [`crate::nn::ParamStore::load_safetensors`].

mod blocks;
mod cnn;
mod mobile;
mod resnet;
mod transformer;

use crate::error::{Error, Result};
use crate::nn::{Module, ParamStore};
use crate::trace::Tensor;
use parking_lot::Mutex;
use std::sync::Arc;

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

    /// A scalar training loss from the output. The default is torchbench's
    /// `reduce_to_scalar_loss`: the mean of the output.
    fn loss(&self, output: &Tensor, inputs: &[Tensor]) -> Result<Tensor> {
        let _ = inputs;
        output.mean_all()
    }
}

/// A model shared by several closures (an eager reference and a compiled function, say):
/// cheap to clone and `Send`, so it can be captured by [`crate::compile()`]'s and
/// [`crate::train::TrainStep`]'s closures, which must be `Send`.
///
/// A model holds tensors, which are `Send` but not `Sync`, so `Arc<dyn Model>` is not `Send`;
/// this handle keeps the model behind a mutex instead (each call locks it; tracing and eager
/// calls are never concurrent on one model anyway).
///
/// ```no_run
/// use kiln::backend::xla::XlaBackend;
/// use kiln::zoo::{self, Model, SharedModel};
/// use kiln::{compile, Tensor};
///
/// let model = SharedModel::new(zoo::build("linear", 0)?);
/// let m = model.clone();
/// let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]));
/// let inputs = model.example_inputs(4, 0)?;
/// let (eager, compiled) = (model.forward(&inputs, false)?, f.run(&inputs)?);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Clone)]
pub struct SharedModel {
    model: Arc<Mutex<Box<dyn Model>>>,
    name: String,
    store: ParamStore,
}

impl SharedModel {
    /// Shares `model`.
    pub fn new(model: Box<dyn Model>) -> Self {
        SharedModel {
            name: model.name().to_string(),
            store: model.store().clone(),
            model: Arc::new(Mutex::new(model)),
        }
    }
}

impl std::fmt::Debug for SharedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedModel({})", self.name)
    }
}

impl Model for SharedModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        self.model.lock().example_inputs(batch, seed)
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        self.model.lock().forward(inputs, train)
    }

    fn loss(&self, output: &Tensor, inputs: &[Tensor]) -> Result<Tensor> {
        self.model.lock().loss(output, inputs)
    }
}

/// The zoo's model names, in the benchmark's order.
pub const NAMES: &[&str] = &[
    "resnet18",
    "resnet50",
    "resnext50_32x4d",
    "alexnet",
    "mobilenet_v2",
    "mnasnet1_0",
    "squeezenet1_1",
    "vgg16",
    "bert",
    "vit",
    "linear",
];

/// Side of the zoo's square example images.
pub const IMAGE_SIZE: usize = 64;
/// Classes of the zoo's classifiers (ImageNet's).
pub const NUM_CLASSES: usize = 1000;

/// Builds the zoo model `name` with parameters initialised from `seed` (PyTorch's / torchvision's
/// initialisation schemes; see each model's docs for deviations).
pub fn build(name: &str, seed: u64) -> Result<Box<dyn Model>> {
    build_in(name, ParamStore::with_seed(seed))
}

/// Builds the zoo model `name` in `store` (which must be empty), e.g. a store made with
/// [`ParamStore::with_float_dtype`] for a float64 twin of a model.
pub fn build_in(name: &str, store: ParamStore) -> Result<Box<dyn Model>> {
    if !store.is_empty() {
        return Err(Error::Invalid(format!(
            "zoo::build_in({name}): the store already holds {} variables",
            store.len()
        )));
    }
    let root = store.root();
    let image = |net: Box<dyn Module>, name: &'static str| -> Box<dyn Model> {
        Box::new(ImageModel {
            name,
            store: store.clone(),
            net,
        })
    };
    Ok(match name {
        "resnet18" => image(Box::new(resnet::resnet18(&root)?), "resnet18"),
        "resnet50" => image(Box::new(resnet::resnet50(&root)?), "resnet50"),
        "resnext50_32x4d" => image(Box::new(resnet::resnext50_32x4d(&root)?), "resnext50_32x4d"),
        "alexnet" => image(Box::new(cnn::alexnet(&root)?), "alexnet"),
        "vgg16" => image(Box::new(cnn::vgg16(&root)?), "vgg16"),
        "squeezenet1_1" => image(Box::new(cnn::squeezenet1_1(&root)?), "squeezenet1_1"),
        "mobilenet_v2" => image(Box::new(mobile::mobilenet_v2(&root)?), "mobilenet_v2"),
        "mnasnet1_0" => image(Box::new(mobile::mnasnet1_0(&root)?), "mnasnet1_0"),
        "vit" => image(Box::new(transformer::vit(&root)?), "vit"),
        "bert" => Box::new(transformer::Bert::new(store.clone())?),
        "linear" => Box::new(LinearModel::new(store.clone())?),
        other => {
            return Err(Error::Invalid(format!(
                "unknown zoo model {other:?}; known: {}",
                NAMES.join(", ")
            )))
        }
    })
}

fn one_input<'a>(name: &str, inputs: &'a [Tensor]) -> Result<&'a Tensor> {
    match inputs {
        [x] => Ok(x),
        _ => Err(Error::Invalid(format!(
            "{name} takes one input, got {}",
            inputs.len()
        ))),
    }
}

/// An image classifier: one `[N, 3, H, W]` input, `[N, 1000]` logits.
struct ImageModel {
    name: &'static str,
    store: ParamStore,
    net: Box<dyn Module>,
}

impl Model for ImageModel {
    fn name(&self) -> &str {
        self.name
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(
            &[batch, 3, IMAGE_SIZE, IMAGE_SIZE],
            seed,
        )?])
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        let x = one_input(self.name, inputs)?;
        if x.rank() != 4 || x.dims()[1] != 3 {
            return Err(Error::type_error(
                self.name,
                "expects [N, 3, H, W] images",
                &[x.ty()],
            ));
        }
        self.net.forward_t(x, train)
    }
}

/// The `LinearModel` of PyTorch's `benchmarks/dynamo/torchbench.py` example (pytorch#89028):
/// `layers = Sequential(Linear(10, 10), Linear(10, 10))`, input
/// `randn(2, 10)`.
struct LinearModel {
    store: ParamStore,
    net: crate::nn::Sequential,
}

impl LinearModel {
    fn new(store: ParamStore) -> Result<Self> {
        let p = store.root().sub("layers");
        let net = crate::nn::Sequential::new()
            .add(crate::nn::Linear::new(&p.sub(0), 10, 10, true)?)
            .add(crate::nn::Linear::new(&p.sub(1), 10, 10, true)?);
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

    /// `randn(batch, 10)`; torchbench.py's example uses batch 2.
    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::randn(&[batch, 10], seed)?])
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        self.net.forward_t(one_input("linear", inputs)?, train)
    }
}
