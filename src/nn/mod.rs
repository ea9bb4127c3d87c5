//! Neural-network building blocks over [`Tensor`]: the [`Module`] trait, [`ParamStore`],
//! layers, functional ops ([`functional`]) and safetensors weights I/O. Every module runs
//! eagerly (the baseline) and traced (compiled) from the same code.
//!
//! Layers use PyTorch's parameter names, shapes and default initialisation, so a PyTorch
//! `state_dict` saved as safetensors loads into a [`ParamStore`] unchanged
//! ([`ParamStore::load_safetensors`]).

mod attention;
pub mod functional;
mod layers;
mod linear;
mod relu;
mod sequential;
pub(crate) mod store;

pub use attention::{Activation, EncoderLayerConfig, MultiheadAttention, TransformerEncoderLayer};
pub use layers::{
    AdaptiveAvgPool2d, AvgPool2d, BatchNorm2d, Conv2d, Conv2dConfig, Dropout, Embedding, Flatten,
    Func, Gelu, Hardsigmoid, Hardswish, Identity, LayerNorm, LeakyRelu, MaxPool2d, Relu6, Sigmoid,
    Silu, Tanh,
};
pub use linear::Linear;
pub use relu::Relu;
pub use sequential::Sequential;
pub use store::{Init, ParamStore, Path};

use crate::error::Result;
use crate::trace::Tensor;

/// A layer or model: a function of one tensor with parameters in a [`ParamStore`].
pub trait Module: Send {
    /// Applies the module. `train` selects training behaviour: dropout active, batch
    /// statistics in batch norm (whose running statistics are then updated).
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor>;

    /// Applies the module in evaluation mode.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_t(x, false)
    }
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (**self).forward_t(x, train)
    }
}

/// A module shared by several closures (an eager reference and a compiled function, say):
/// cheap to clone, and `Send` as the closures given to [`crate::compile()`] and
/// [`crate::train::TrainStep`] must be.
///
/// A module holds tensors, which are `Send` but not `Sync`, so `Arc<M>` is not `Send`; `Shared`
/// keeps the module behind a mutex instead (each call locks it, uncontended in the usual case
/// where one thread traces or runs it at a time).
///
/// ```no_run
/// use kiln::backend::xla::XlaBackend;
/// use kiln::nn::{Linear, Module, ParamStore, Shared};
/// use kiln::{compile, Tensor};
///
/// let store = ParamStore::new();
/// let model = Shared::new(Linear::new(&store.root().sub("fc"), 4, 2, true)?);
/// let m = model.clone();
/// let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]));
/// let x = Tensor::randn(&[3, 4], 0)?;
/// let (eager, compiled) = (model.forward(&x)?, f.run(&[x])?);
/// # Ok::<(), kiln::Error>(())
/// ```
pub struct Shared<M: ?Sized>(std::sync::Arc<parking_lot::Mutex<M>>);

impl<M> Shared<M> {
    /// Shares `module`.
    pub fn new(module: M) -> Self {
        Shared(std::sync::Arc::new(parking_lot::Mutex::new(module)))
    }
}

impl<M: ?Sized> Shared<M> {
    /// Locks the module for direct access (e.g. to call its own methods).
    pub fn lock(&self) -> parking_lot::MutexGuard<'_, M> {
        self.0.lock()
    }
}

impl<M: ?Sized> Clone for Shared<M> {
    fn clone(&self) -> Self {
        Shared(self.0.clone())
    }
}

impl<M: ?Sized> std::fmt::Debug for Shared<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Shared(..)")
    }
}

impl<M: Module + ?Sized> Module for Shared<M> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.0.lock().forward_t(x, train)
    }
}

impl<M: Module + Sync + ?Sized> Module for std::sync::Arc<M> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (**self).forward_t(x, train)
    }
}
