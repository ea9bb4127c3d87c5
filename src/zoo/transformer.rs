//! The transformer models: a vision transformer with torchvision's `VisionTransformer`
//! structure and names, and a BERT-style encoder built from PyTorch's
//! `nn.TransformerEncoderLayer`.

use super::blocks::linear_init;
use super::{one_input, Model, IMAGE_SIZE, NUM_CLASSES};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::nn::{
    Activation, Conv2d, Conv2dConfig, EncoderLayerConfig, Init, LayerNorm, Linear, Module,
    MultiheadAttention, ParamStore, Path, TransformerEncoderLayer,
};
use crate::trace::Tensor;

/// ViT size: patch 8 on 64x64 images gives 64 patches + the class token.
const VIT_PATCH: usize = 8;
const VIT_HIDDEN: usize = 256;
const VIT_LAYERS: usize = 4;
const VIT_HEADS: usize = 4;
const VIT_MLP: usize = 1024;

/// torchvision's `EncoderBlock`: pre-norm attention (`ln_1`, `self_attention`) and MLP
/// (`ln_2`, `mlp.0`, GELU, `mlp.3`), LayerNorm eps 1e-6.
struct EncoderBlock {
    ln_1: LayerNorm,
    self_attention: MultiheadAttention,
    ln_2: LayerNorm,
    mlp_0: Linear,
    mlp_3: Linear,
}

impl EncoderBlock {
    fn new(path: &Path) -> Result<Self> {
        let mlp = path.sub("mlp");
        // MLPBlock init: xavier_uniform_ weights, normal(std=1e-6) biases.
        let xavier = |i: usize, o: usize| {
            let b = (6.0 / (i + o) as f64).sqrt();
            Init::Uniform { lo: -b, hi: b }
        };
        let small = Init::Normal {
            mean: 0.0,
            std: 1e-6,
        };
        Ok(EncoderBlock {
            ln_1: LayerNorm::new(&path.sub("ln_1"), &[VIT_HIDDEN], 1e-6)?,
            self_attention: MultiheadAttention::new(
                &path.sub("self_attention"),
                VIT_HIDDEN,
                VIT_HEADS,
                0.0,
                true,
            )?,
            ln_2: LayerNorm::new(&path.sub("ln_2"), &[VIT_HIDDEN], 1e-6)?,
            mlp_0: linear_init(
                &mlp.sub(0),
                VIT_HIDDEN,
                VIT_MLP,
                xavier(VIT_HIDDEN, VIT_MLP),
                small,
            )?,
            mlp_3: linear_init(
                &mlp.sub(3),
                VIT_MLP,
                VIT_HIDDEN,
                xavier(VIT_MLP, VIT_HIDDEN),
                small,
            )?,
        })
    }
}

impl Module for EncoderBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.ln_1.forward_t(x, train)?;
        let h = self.self_attention.self_attention(&h, None, train)?;
        let x = h.add(x)?;
        let y = self.ln_2.forward_t(&x, train)?;
        let y = self.mlp_0.forward_t(&y, train)?.gelu(false)?;
        let y = self.mlp_3.forward_t(&y, train)?;
        x.add(&y)
    }
}

/// torchvision's `VisionTransformer` at image 64, patch 8, hidden 256, 4 layers, 4 heads,
/// MLP 1024, 1000 classes: `conv_proj`, `class_token`, `encoder.pos_embedding`,
/// `encoder.layers.encoder_layer_{i}`, `encoder.ln`, `heads.head`.
///
/// Initialisation as torchvision's except `heads.head`, which torchvision zero-initialises
/// (every logit would be 0, which makes eager-vs-compiled checks vacuous); here it has
/// PyTorch's `Linear` default.
pub(crate) struct Vit {
    conv_proj: Conv2d,
    class_token: Tensor,
    pos_embedding: Tensor,
    layers: Vec<EncoderBlock>,
    ln: LayerNorm,
    head: Linear,
}

pub(crate) fn vit(root: &Path) -> Result<Vit> {
    let fan_in = 3 * VIT_PATCH * VIT_PATCH;
    let conv_proj = Conv2d::new(
        &root.sub("conv_proj"),
        3,
        VIT_HIDDEN,
        VIT_PATCH,
        Conv2dConfig {
            stride: [VIT_PATCH, VIT_PATCH],
            // trunc_normal_(std=sqrt(1/fan_in)) truncates at ±2, i.e. ±28 std: a normal.
            weight_init: Init::Normal {
                mean: 0.0,
                std: (1.0 / fan_in as f64).sqrt(),
            },
            bias_init: Some(Init::Const(0.0)),
            ..Default::default()
        },
    )?;
    let class_token = root.param("class_token", &[1, 1, VIT_HIDDEN], Init::Const(0.0))?;
    let seq = (IMAGE_SIZE / VIT_PATCH).pow(2) + 1;
    let enc = root.sub("encoder");
    let pos_embedding = enc.param(
        "pos_embedding",
        &[1, seq, VIT_HIDDEN],
        Init::Normal {
            mean: 0.0,
            std: 0.02,
        },
    )?;
    let layers = (0..VIT_LAYERS)
        .map(|i| EncoderBlock::new(&enc.sub("layers").sub(format!("encoder_layer_{i}"))))
        .collect::<Result<Vec<_>>>()?;
    let ln = LayerNorm::new(&enc.sub("ln"), &[VIT_HIDDEN], 1e-6)?;
    let head = Linear::new(
        &root.sub("heads").sub("head"),
        VIT_HIDDEN,
        NUM_CLASSES,
        true,
    )?;
    Ok(Vit {
        conv_proj,
        class_token,
        pos_embedding,
        layers,
        ln,
        head,
    })
}

impl Module for Vit {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let n = x.dims()[0] as isize;
        let seq = self.pos_embedding.dims()[1];
        // [N, 3, H, W] -> [N, hidden, H/p, W/p] -> [N, patches, hidden]
        let h = self.conv_proj.forward_t(x, train)?;
        let h = h
            .reshape(&[n, VIT_HIDDEN as isize, -1])?
            .permute(&[0, 2, 1])?;
        if h.dims()[1] + 1 != seq {
            return Err(Error::type_error(
                "vit",
                format!("expects {IMAGE_SIZE}x{IMAGE_SIZE} images (patch {VIT_PATCH})"),
                &[x.ty()],
            ));
        }
        let cls = self
            .class_token
            .broadcast_to(&[n as usize, 1, VIT_HIDDEN])?;
        let mut h = Tensor::cat(&[cls, h], 1)?.add(&self.pos_embedding)?;
        for l in &self.layers {
            h = l.forward_t(&h, train)?;
        }
        let h = self.ln.forward_t(&h, train)?;
        let cls = h.narrow(1, 0, 1)?.squeeze(1)?;
        self.head.forward_t(&cls, train)
    }
}

/// BERT size: hidden 256, 4 layers, 4 heads, FFN 1024, sequence 64.
const BERT_VOCAB: usize = 30522;
const BERT_MAX_POS: usize = 512;
const BERT_HIDDEN: usize = 256;
const BERT_LAYERS: usize = 4;
const BERT_HEADS: usize = 4;
const BERT_FFN: usize = 1024;
/// Sequence length of the example inputs.
pub(crate) const BERT_SEQ: usize = 64;

/// A BERT-style encoder: word + position + token-type embeddings (`embeddings.*`, as Hugging
/// Face's `BertModel` names them), LayerNorm (eps 1e-12), dropout 0.1, then 4 post-norm
/// `nn.TransformerEncoderLayer`s (`encoder.layers.{i}`, GELU). Input: `i64` token ids
/// `[batch, seq]` (token type 0 throughout); output: the last hidden state
/// `[batch, seq, 256]`. Initialisation: PyTorch's defaults (`N(0, 1)` embeddings).
pub(crate) struct Bert {
    store: ParamStore,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    ln: LayerNorm,
    layers: Vec<TransformerEncoderLayer>,
}

impl Bert {
    pub(crate) fn new(store: ParamStore) -> Result<Self> {
        let root = store.root();
        let e = root.sub("embeddings");
        let normal = Init::Normal {
            mean: 0.0,
            std: 1.0,
        };
        let word = e
            .sub("word_embeddings")
            .param("weight", &[BERT_VOCAB, BERT_HIDDEN], normal)?;
        let position =
            e.sub("position_embeddings")
                .param("weight", &[BERT_MAX_POS, BERT_HIDDEN], normal)?;
        let token_type =
            e.sub("token_type_embeddings")
                .param("weight", &[2, BERT_HIDDEN], normal)?;
        let ln = LayerNorm::new(&e.sub("LayerNorm"), &[BERT_HIDDEN], 1e-12)?;
        let cfg = EncoderLayerConfig {
            dim_feedforward: BERT_FFN,
            dropout: 0.1,
            activation: Activation::Gelu,
            layer_norm_eps: 1e-12,
            norm_first: false,
        };
        let layers = (0..BERT_LAYERS)
            .map(|i| {
                TransformerEncoderLayer::new(
                    &root.sub("encoder").sub("layers").sub(i),
                    BERT_HIDDEN,
                    BERT_HEADS,
                    cfg,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Bert {
            store,
            word,
            position,
            token_type,
            ln,
            layers,
        })
    }
}

impl Model for Bert {
    fn name(&self) -> &str {
        "bert"
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    /// Token ids uniform in `[0, 30522)`, `[batch, 64]`.
    fn example_inputs(&self, batch: usize, seed: u64) -> Result<Vec<Tensor>> {
        Ok(vec![Tensor::randint(
            &[batch, BERT_SEQ],
            BERT_VOCAB as i64,
            seed,
        )?])
    }

    fn forward(&self, inputs: &[Tensor], train: bool) -> Result<Tensor> {
        let ids = one_input("bert", inputs)?;
        if ids.rank() != 2 || ids.dims()[1] > BERT_MAX_POS {
            return Err(Error::type_error(
                "bert",
                format!("expects token ids [batch, seq <= {BERT_MAX_POS}]"),
                &[ids.ty()],
            ));
        }
        let s = ids.dims()[1];
        let positions = Tensor::arange(s, DType::I64)?;
        let pos = Tensor::embedding(&self.position, &positions)?;
        let tt = self.token_type.narrow(0, 0, 1)?;
        let h = Tensor::embedding(&self.word, ids)?.add(&pos)?.add(&tt)?;
        let mut h = self.ln.forward_t(&h, train)?.dropout(0.1, train)?;
        for l in &self.layers {
            h = l.forward_t(&h, train)?;
        }
        Ok(h)
    }
}
