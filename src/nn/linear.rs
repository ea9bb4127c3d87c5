//! `Linear` (PyTorch's `nn.Linear`).

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
