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
mod store;

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

impl<M: Module + Sync + ?Sized> Module for std::sync::Arc<M> {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (**self).forward_t(x, train)
    }
}
