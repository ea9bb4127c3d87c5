//! `Linear`, `Sequential` and `Relu`.

use super::{Init, Module, Path};
use crate::error::Result;
use crate::trace::Tensor;

/// `y = x W^T + b` with `W: [out, in]` (PyTorch's `nn.Linear`, same init and names
/// `weight`/`bias`).
#[derive(Debug, Clone)]
pub struct Linear {
    /// `[out, in]`.
    pub weight: Tensor,
    /// `[out]`, if present.
    pub bias: Option<Tensor>,
}

impl Linear {
    /// A linear layer under `path` with PyTorch's default initialisation.
    pub fn new(path: &Path, in_features: usize, out_features: usize, bias: bool) -> Result<Self> {
        let weight = path.param("weight", &[out_features, in_features], Init::KaimingUniform)?;
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let bias = if bias {
            Some(path.param(
                "bias",
                &[out_features],
                Init::Uniform {
                    lo: -bound,
                    hi: bound,
                },
            )?)
        } else {
            None
        };
        Ok(Linear { weight, bias })
    }
}

impl Module for Linear {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.linear(&self.weight, self.bias.as_ref())
    }
}

/// The rectifier `max(x, 0)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Relu;

impl Module for Relu {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.relu()
    }
}

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
