//! The rectifier module `Relu` (PyTorch's `nn.ReLU`).

use super::Module;
use crate::error::Result;
use crate::trace::Tensor;

/// The rectifier `max(x, 0)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Relu;

impl Module for Relu {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.relu()
    }
}
