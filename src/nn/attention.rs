//! Multi-head attention and the transformer encoder layer, with PyTorch's structure and names.

use super::{Dropout, Init, LayerNorm, Linear, Module, Path};
use crate::error::{Error, Result};
use crate::trace::Tensor;

/// Multi-head attention (PyTorch's `nn.MultiheadAttention` with `batch_first=True`):
/// packed `in_proj_weight [3E, E]` / `in_proj_bias [3E]` and `out_proj.{weight,bias}`.
///
/// Initialisation as PyTorch's: Xavier-uniform `in_proj_weight`, zero biases, `out_proj.weight`
/// with `Linear`'s default.
#[derive(Debug, Clone)]
pub struct MultiheadAttention {
    /// `[3E, E]`: query, key and value projections stacked.
    pub in_proj_weight: Tensor,
    /// `[3E]`, if present.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection `E -> E`.
    pub out_proj: Linear,
    /// Embedding size `E`.
    pub embed_dim: usize,
    /// Number of heads (`E` divisible by it).
    pub num_heads: usize,
    /// Dropout on the attention weights (training only).
    pub dropout: f64,
}

impl MultiheadAttention {
    /// Attention over `embed_dim` features split into `num_heads` heads.
    pub fn new(
        path: &Path,
        embed_dim: usize,
        num_heads: usize,
        dropout: f64,
        bias: bool,
    ) -> Result<Self> {
        if num_heads == 0 || embed_dim % num_heads != 0 {
            return Err(Error::Invalid(format!(
                "{}: embed_dim {embed_dim} must be divisible by num_heads {num_heads}",
                path.prefix()
            )));
        }
        let e = embed_dim;
        let bound = (6.0 / (e + 3 * e) as f64).sqrt();
        let in_proj_weight = path.param(
            "in_proj_weight",
            &[3 * e, e],
            Init::Uniform {
                lo: -bound,
                hi: bound,
            },
        )?;
        let in_proj_bias = if bias {
            Some(path.param("in_proj_bias", &[3 * e], Init::Const(0.0))?)
        } else {
            None
        };
        let op = path.sub("out_proj");
        let out_proj = Linear {
            weight: op.param("weight", &[e, e], Init::KaimingUniform)?,
            bias: if bias {
                Some(op.param("bias", &[e], Init::Const(0.0))?)
            } else {
                None
            },
        };
        Ok(MultiheadAttention {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            embed_dim,
            num_heads,
            dropout,
        })
    }

    /// `[B, S, E] -> [B, H, S, D]`.
    fn heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, s) = (x.dims()[0] as isize, x.dims()[1] as isize);
        let h = self.num_heads as isize;
        let d = (self.embed_dim / self.num_heads) as isize;
        x.reshape(&[b, s, h, d])?.permute(&[0, 2, 1, 3])
    }

    fn check(&self, x: &Tensor) -> Result<()> {
        if x.rank() != 3 || x.dims()[2] != self.embed_dim {
            return Err(Error::type_error(
                "MultiheadAttention",
                format!("expects [batch, seq, {}] (batch_first)", self.embed_dim),
                &[x.ty()],
            ));
        }
        Ok(())
    }

    /// Self-attention of `x` (`[B, S, E]`), with an optional additive mask broadcastable to
    /// `[B, H, S, S]`. Returns `[B, S, E]`.
    pub fn self_attention(&self, x: &Tensor, mask: Option<&Tensor>, train: bool) -> Result<Tensor> {
        self.check(x)?;
        let (b, s, e) = (x.dims()[0], x.dims()[1], self.embed_dim);
        let qkv = x.linear(&self.in_proj_weight, self.in_proj_bias.as_ref())?;
        let h = self.num_heads;
        let d = e / h;
        // [B, S, 3, H, D] -> [3, B, H, S, D]
        let qkv = qkv
            .reshape(&[b as isize, s as isize, 3, h as isize, d as isize])?
            .permute(&[2, 0, 3, 1, 4])?;
        let part = |i: usize| -> Result<Tensor> { qkv.narrow(0, i, 1)?.squeeze(0) };
        let (q, k, v) = (part(0)?, part(1)?, part(2)?);
        self.finish(&q, &k, &v, mask, train, b, s)
    }

    /// Attention of `query` (`[B, L, E]`) over `key`/`value` (`[B, S, E]`), PyTorch's
    /// `forward(query, key, value, attn_mask=mask, need_weights=False)`. Returns `[B, L, E]`.
    pub fn attend(
        &self,
        query: &Tensor,
        key: &Tensor,
        value: &Tensor,
        mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        for t in [query, key, value] {
            self.check(t)?;
        }
        let e = self.embed_dim;
        let proj = |x: &Tensor, i: usize| -> Result<Tensor> {
            let w = self.in_proj_weight.narrow(0, i * e, e)?;
            let b = self
                .in_proj_bias
                .as_ref()
                .map(|b| b.narrow(0, i * e, e))
                .transpose()?;
            self.heads(&x.linear(&w, b.as_ref())?)
        };
        let (q, k, v) = (proj(query, 0)?, proj(key, 1)?, proj(value, 2)?);
        self.finish(&q, &k, &v, mask, train, query.dims()[0], query.dims()[1])
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        train: bool,
        b: usize,
        l: usize,
    ) -> Result<Tensor> {
        let o = Tensor::scaled_dot_product_attention(q, k, v, mask, self.dropout, train)?;
        let o = o.permute(&[0, 2, 1, 3])?.reshape(&[
            b as isize,
            l as isize,
            self.embed_dim as isize,
        ])?;
        self.out_proj.forward(&o)
    }
}

impl Module for MultiheadAttention {
    /// Self-attention without a mask.
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.self_attention(x, None, train)
    }
}

/// The feed-forward activation of a [`TransformerEncoderLayer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Activation {
    /// ReLU (PyTorch's default).
    #[default]
    Relu,
    /// Exact GELU.
    Gelu,
}

impl Activation {
    fn apply(self, x: &Tensor) -> Result<Tensor> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(false),
        }
    }
}

/// Options of a [`TransformerEncoderLayer`]; `Default` is PyTorch's (`dim_feedforward` 2048,
/// dropout 0.1, ReLU, eps 1e-5, post-norm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EncoderLayerConfig {
    /// Hidden size of the feed-forward block.
    pub dim_feedforward: usize,
    /// Dropout probability (attention weights, feed-forward, residual branches).
    pub dropout: f64,
    /// Feed-forward activation.
    pub activation: Activation,
    /// LayerNorm eps.
    pub layer_norm_eps: f64,
    /// Pre-norm (`x + f(norm(x))`) instead of post-norm (`norm(x + f(x))`).
    pub norm_first: bool,
}

impl Default for EncoderLayerConfig {
    fn default() -> Self {
        EncoderLayerConfig {
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: Activation::Relu,
            layer_norm_eps: 1e-5,
            norm_first: false,
        }
    }
}

/// PyTorch's `nn.TransformerEncoderLayer` (`batch_first=True`): `self_attn`, `linear1`,
/// `dropout`, `linear2`, `norm1`, `norm2`, `dropout1`, `dropout2`, `activation`.
#[derive(Debug, Clone)]
pub struct TransformerEncoderLayer {
    /// Self-attention.
    pub self_attn: MultiheadAttention,
    /// `d_model -> dim_feedforward`.
    pub linear1: Linear,
    /// `dim_feedforward -> d_model`.
    pub linear2: Linear,
    /// Norm around the attention block.
    pub norm1: LayerNorm,
    /// Norm around the feed-forward block.
    pub norm2: LayerNorm,
    /// Options.
    pub config: EncoderLayerConfig,
}

impl TransformerEncoderLayer {
    /// An encoder layer of width `d_model` with `nhead` heads.
    pub fn new(
        path: &Path,
        d_model: usize,
        nhead: usize,
        config: EncoderLayerConfig,
    ) -> Result<Self> {
        Ok(TransformerEncoderLayer {
            self_attn: MultiheadAttention::new(
                &path.sub("self_attn"),
                d_model,
                nhead,
                config.dropout,
                true,
            )?,
            linear1: Linear::new(&path.sub("linear1"), d_model, config.dim_feedforward, true)?,
            linear2: Linear::new(&path.sub("linear2"), config.dim_feedforward, d_model, true)?,
            norm1: LayerNorm::new(&path.sub("norm1"), &[d_model], config.layer_norm_eps)?,
            norm2: LayerNorm::new(&path.sub("norm2"), &[d_model], config.layer_norm_eps)?,
            config,
        })
    }

    /// Applies the layer to `x` (`[B, S, d_model]`) with an optional additive attention mask.
    pub fn forward_masked(&self, x: &Tensor, mask: Option<&Tensor>, train: bool) -> Result<Tensor> {
        let p = self.config.dropout;
        let sa = |h: &Tensor| -> Result<Tensor> {
            Dropout::new(p).forward_t(&self.self_attn.self_attention(h, mask, train)?, train)
        };
        let ff = |h: &Tensor| -> Result<Tensor> {
            let h = self.config.activation.apply(&self.linear1.forward(h)?)?;
            let h = self.linear2.forward(&h.dropout(p, train)?)?;
            h.dropout(p, train)
        };
        if self.config.norm_first {
            let x = x.add(&sa(&self.norm1.forward(x)?)?)?;
            x.add(&ff(&self.norm2.forward(&x)?)?)
        } else {
            let x = self.norm1.forward(&x.add(&sa(x)?)?)?;
            self.norm2.forward(&x.add(&ff(&x)?)?)
        }
    }
}

impl Module for TransformerEncoderLayer {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        self.forward_masked(x, None, train)
    }
}
