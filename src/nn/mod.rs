//! Neural-network building blocks over [`Tensor`]: the [`Module`] trait, [`ParamStore`],
//! layers. Every module runs eagerly (the baseline) and traced (compiled) from the same code.

mod linear;
mod store;

pub use linear::{Linear, Relu, Sequential};
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
