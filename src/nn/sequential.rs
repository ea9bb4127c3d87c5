//! `Sequential`: modules applied in order (PyTorch's `nn.Sequential`).

use super::Module;
use crate::error::Result;
use crate::trace::Tensor;

/// Modules applied in order.
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Module>>,
}

impl Sequential {
    /// An empty sequence.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a module.
    #[allow(clippy::should_implement_trait)]
    pub fn add(mut self, m: impl Module + 'static) -> Self {
        self.layers.push(Box::new(m));
        self
    }

    /// Appends a boxed module.
    pub fn push(&mut self, m: Box<dyn Module>) {
        self.layers.push(m);
    }

    /// Number of modules.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// No modules?
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl Module for Sequential {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for l in &self.layers {
            h = l.forward_t(&h, train)?;
        }
        Ok(h)
    }
}
