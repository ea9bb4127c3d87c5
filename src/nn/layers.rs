//! Layers with PyTorch's parameter names, shapes and default initialisation, so that a
//! PyTorch `state_dict` maps onto a [`super::ParamStore`] one to one.

use super::{Init, Module, Path};
use crate::error::{Error, Result};
use crate::ir::DType;
use crate::trace::Tensor;

/// Options of a [`Conv2d`]; `Default` is PyTorch's (stride 1, no padding, no dilation, one
/// group, with bias, default initialisation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Conv2dConfig {
    /// Stride per spatial dim.
    pub stride: [usize; 2],
    /// Symmetric zero padding per spatial dim.
    pub padding: [usize; 2],
    /// Kernel dilation per spatial dim.
    pub dilation: [usize; 2],
    /// Channel groups (`in_channels` for depthwise).
    pub groups: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Weight initialiser (PyTorch's default: [`Init::KaimingUniform`]).
    pub weight_init: Init,
    /// Bias initialiser; `None` is PyTorch's default, uniform in `±1/sqrt(fan_in)`.
    pub bias_init: Option<Init>,
}

impl Default for Conv2dConfig {
    fn default() -> Self {
        Conv2dConfig {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
            bias: true,
            weight_init: Init::KaimingUniform,
            bias_init: None,
        }
    }
}

impl Conv2dConfig {
    /// Sets a square stride.
    pub fn stride(mut self, s: usize) -> Self {
        self.stride = [s, s];
        self
    }
    /// Sets a square padding.
    pub fn padding(mut self, p: usize) -> Self {
        self.padding = [p, p];
        self
    }
    /// Sets the number of groups.
    pub fn groups(mut self, g: usize) -> Self {
        self.groups = g;
        self
    }
    /// With or without bias.
    pub fn bias(mut self, b: bool) -> Self {
        self.bias = b;
        self
    }
    /// Sets the weight initialiser.
    pub fn weight_init(mut self, init: Init) -> Self {
        self.weight_init = init;
        self
    }
    /// Sets the bias initialiser.
    pub fn bias_init(mut self, init: Init) -> Self {
        self.bias_init = Some(init);
        self
    }
}

/// 2-D convolution (PyTorch's `nn.Conv2d`): parameters `weight [out, in/groups, k, k]` and
/// optional `bias [out]`.
#[derive(Debug, Clone)]
pub struct Conv2d {
    /// `[out, in/groups, kH, kW]`.
    pub weight: Tensor,
    /// `[out]`, if present.
    pub bias: Option<Tensor>,
    /// Geometry and options.
    pub config: Conv2dConfig,
}

impl Conv2d {
    /// A square-kernel convolution under `path`.
    pub fn new(
        path: &Path,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        config: Conv2dConfig,
    ) -> Result<Self> {
        let g = config.groups;
        if g == 0 || in_channels % g != 0 || out_channels % g != 0 {
            return Err(Error::Invalid(format!(
                "{}: Conv2d({in_channels}, {out_channels}) with {g} groups: channels must be \
                 divisible by groups",
                path.prefix()
            )));
        }
        let shape = [out_channels, in_channels / g, kernel, kernel];
        let weight = path.param("weight", &shape, config.weight_init)?;
        let bias = if config.bias {
            let fan_in = (in_channels / g) * kernel * kernel;
            let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
            let init = config.bias_init.unwrap_or(Init::Uniform {
                lo: -bound,
                hi: bound,
            });
            Some(path.param("bias", &[out_channels], init)?)
        } else {
            None
        };
        Ok(Conv2d {
            weight,
            bias,
            config,
        })
    }
}

impl Module for Conv2d {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        let c = &self.config;
        x.conv2d(
            &self.weight,
            self.bias.as_ref(),
            c.stride,
            c.padding,
            c.dilation,
            c.groups,
        )
    }
}

/// Batch normalisation over channels (PyTorch's `nn.BatchNorm2d`): parameters `weight`,
/// `bias`; buffers `running_mean`, `running_var` and `num_batches_tracked` (`i64`).
///
/// In training mode it normalises with batch statistics and updates the buffers (eagerly in
/// place; traced as state outputs written back by the runtime).
#[derive(Debug, Clone)]
pub struct BatchNorm2d {
    /// Scale `[C]` (init 1).
    pub weight: Tensor,
    /// Shift `[C]` (init 0).
    pub bias: Tensor,
    /// Running mean `[C]` (init 0).
    pub running_mean: Tensor,
    /// Running variance `[C]` (init 1).
    pub running_var: Tensor,
    /// Number of training batches seen (`i64` scalar).
    pub num_batches_tracked: Tensor,
    /// Running-statistics momentum (PyTorch default 0.1).
    pub momentum: f64,
    /// Added to the variance (PyTorch default 1e-5).
    pub eps: f64,
}

impl BatchNorm2d {
    /// A batch norm over `channels` with PyTorch's defaults (momentum 0.1, eps 1e-5).
    pub fn new(path: &Path, channels: usize) -> Result<Self> {
        Self::with_config(path, channels, 0.1, 1e-5)
    }

    /// A batch norm with explicit momentum and eps.
    pub fn with_config(path: &Path, channels: usize, momentum: f64, eps: f64) -> Result<Self> {
        Ok(BatchNorm2d {
            weight: path.param("weight", &[channels], Init::Const(1.0))?,
            bias: path.param("bias", &[channels], Init::Const(0.0))?,
            running_mean: path.float_buffer("running_mean", &[channels], Init::Const(0.0))?,
            running_var: path.float_buffer("running_var", &[channels], Init::Const(1.0))?,
            num_batches_tracked: path.buffer(
                "num_batches_tracked",
                &[],
                Init::Const(0.0),
                DType::I64,
            )?,
            momentum,
            eps,
        })
    }
}

impl Module for BatchNorm2d {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if x.rank() != 4 {
            return Err(Error::type_error(
                "BatchNorm2d",
                "expects an [N, C, H, W] input",
                &[x.ty()],
            ));
        }
        let y = x.batch_norm(
            Some(&self.running_mean),
            Some(&self.running_var),
            Some(&self.weight),
            Some(&self.bias),
            train,
            self.momentum,
            self.eps,
        )?;
        if train {
            let n = self.num_batches_tracked.add_scalar(1.0)?;
            self.num_batches_tracked.assign(&n)?;
        }
        Ok(y)
    }
}

/// Layer normalisation over trailing dims (PyTorch's `nn.LayerNorm`): `weight` (init 1),
/// `bias` (init 0).
#[derive(Debug, Clone)]
pub struct LayerNorm {
    /// Scale.
    pub weight: Tensor,
    /// Shift.
    pub bias: Tensor,
    /// The normalised trailing shape.
    pub shape: Vec<usize>,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// A layer norm over the trailing `shape` with the given eps (PyTorch's default 1e-5).
    pub fn new(path: &Path, shape: &[usize], eps: f64) -> Result<Self> {
        Ok(LayerNorm {
            weight: path.param("weight", shape, Init::Const(1.0))?,
            bias: path.param("bias", shape, Init::Const(0.0))?,
            shape: shape.to_vec(),
            eps,
        })
    }
}

impl Module for LayerNorm {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.layer_norm(&self.shape, Some(&self.weight), Some(&self.bias), self.eps)
    }
}

/// A lookup table (PyTorch's `nn.Embedding`): `weight [num, dim]`, initialised `N(0, 1)`.
/// Its input is integer ids.
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[num_embeddings, dim]`.
    pub weight: Tensor,
}

impl Embedding {
    /// An embedding of `num` rows of size `dim`.
    pub fn new(path: &Path, num: usize, dim: usize) -> Result<Self> {
        Ok(Embedding {
            weight: path.param(
                "weight",
                &[num, dim],
                Init::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            )?,
        })
    }
}

impl Module for Embedding {
    fn forward_t(&self, ids: &Tensor, _train: bool) -> Result<Tensor> {
        Tensor::embedding(&self.weight, ids)
    }
}

/// Dropout with probability `p` in training mode; the identity in evaluation.
#[derive(Debug, Clone, Copy)]
pub struct Dropout {
    /// Drop probability.
    pub p: f64,
}

impl Dropout {
    /// Dropout with probability `p`.
    pub fn new(p: f64) -> Self {
        Dropout { p }
    }
}

impl Module for Dropout {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        x.dropout(self.p, train)
    }
}

/// 2-D max pooling (PyTorch's `nn.MaxPool2d`).
#[derive(Debug, Clone, Copy)]
pub struct MaxPool2d {
    /// Window size.
    pub kernel: [usize; 2],
    /// Stride (PyTorch defaults it to the kernel size).
    pub stride: [usize; 2],
    /// Padding.
    pub padding: [usize; 2],
    /// Round the output size up.
    pub ceil_mode: bool,
}

impl MaxPool2d {
    /// Square window `k`, stride `s`, padding `p`, floor mode.
    pub fn new(k: usize, s: usize, p: usize) -> Self {
        MaxPool2d {
            kernel: [k, k],
            stride: [s, s],
            padding: [p, p],
            ceil_mode: false,
        }
    }

    /// With ceil mode on or off.
    pub fn ceil_mode(mut self, on: bool) -> Self {
        self.ceil_mode = on;
        self
    }
}

impl Module for MaxPool2d {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.max_pool2d(self.kernel, self.stride, self.padding, self.ceil_mode)
    }
}

/// 2-D average pooling (PyTorch's `nn.AvgPool2d`; `count_include_pad` defaults to true).
#[derive(Debug, Clone, Copy)]
pub struct AvgPool2d {
    /// Window size.
    pub kernel: [usize; 2],
    /// Stride.
    pub stride: [usize; 2],
    /// Padding.
    pub padding: [usize; 2],
    /// Round the output size up.
    pub ceil_mode: bool,
    /// Count padding in the divisor.
    pub count_include_pad: bool,
}

impl AvgPool2d {
    /// Square window `k`, stride `s`, padding `p`, floor mode, padding counted.
    pub fn new(k: usize, s: usize, p: usize) -> Self {
        AvgPool2d {
            kernel: [k, k],
            stride: [s, s],
            padding: [p, p],
            ceil_mode: false,
            count_include_pad: true,
        }
    }
}

impl Module for AvgPool2d {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.avg_pool2d(
            self.kernel,
            self.stride,
            self.padding,
            self.ceil_mode,
            self.count_include_pad,
        )
    }
}

/// Adaptive average pooling to a fixed output size (PyTorch's `nn.AdaptiveAvgPool2d`).
#[derive(Debug, Clone, Copy)]
pub struct AdaptiveAvgPool2d(pub [usize; 2]);

impl Module for AdaptiveAvgPool2d {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.adaptive_avg_pool2d(self.0)
    }
}

/// Flattens dims `start..=end` (PyTorch's `nn.Flatten`, default `1..=-1`).
#[derive(Debug, Clone, Copy)]
pub struct Flatten {
    /// First dim.
    pub start: isize,
    /// Last dim (inclusive; negative counts from the end).
    pub end: isize,
}

impl Default for Flatten {
    fn default() -> Self {
        Flatten { start: 1, end: -1 }
    }
}

impl Module for Flatten {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.flatten(self.start, self.end)
    }
}

macro_rules! activation {
    ($(#[$doc:meta])* $name:ident, |$x:ident| $body:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $name;

        impl Module for $name {
            fn forward_t(&self, $x: &Tensor, _train: bool) -> Result<Tensor> {
                $body
            }
        }
    };
}

activation!(
    /// `min(max(x, 0), 6)` (PyTorch's `nn.ReLU6`).
    Relu6,
    |x| x.relu6()
);
activation!(
    /// `x * sigmoid(x)` (PyTorch's `nn.SiLU`).
    Silu,
    |x| x.silu()
);
activation!(
    /// `x * relu6(x + 3) / 6` (PyTorch's `nn.Hardswish`).
    Hardswish,
    |x| x.hardswish()
);
activation!(
    /// `relu6(x + 3) / 6` (PyTorch's `nn.Hardsigmoid`).
    Hardsigmoid,
    |x| x.hardsigmoid()
);
activation!(
    /// The logistic function (PyTorch's `nn.Sigmoid`).
    Sigmoid,
    |x| x.sigmoid()
);
activation!(
    /// Hyperbolic tangent (PyTorch's `nn.Tanh`).
    Tanh,
    |x| x.tanh()
);
activation!(
    /// The identity (PyTorch's `nn.Identity`).
    Identity,
    |x| Ok(x.clone())
);

/// GELU (PyTorch's `nn.GELU`): exact by default, tanh approximation if `approximate`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Gelu {
    /// Use the tanh approximation.
    pub approximate: bool,
}

impl Module for Gelu {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.gelu(self.approximate)
    }
}

/// Leaky ReLU (PyTorch's `nn.LeakyReLU`, default slope 0.01).
#[derive(Debug, Clone, Copy)]
pub struct LeakyRelu {
    /// Slope for negative inputs.
    pub negative_slope: f64,
}

impl Default for LeakyRelu {
    fn default() -> Self {
        LeakyRelu {
            negative_slope: 0.01,
        }
    }
}

impl Module for LeakyRelu {
    fn forward_t(&self, x: &Tensor, _train: bool) -> Result<Tensor> {
        x.leaky_relu(self.negative_slope)
    }
}

/// A module from a function (for glue such as reshapes inside a [`super::Sequential`]).
pub struct Func<F>(pub F);

impl<F> Module for Func<F>
where
    F: Fn(&Tensor, bool) -> Result<Tensor> + Send,
{
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        (self.0)(x, train)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::ParamStore;

    #[test]
    fn batch_norm_has_pytorch_state_dict_entries() {
        let s = ParamStore::new();
        BatchNorm2d::new(&s.root().sub("bn"), 5).unwrap();
        let vars: Vec<(String, Vec<usize>, DType)> = s
            .vars()
            .into_iter()
            .map(|(n, t)| (n, t.dims().to_vec(), t.dtype()))
            .collect();
        assert_eq!(
            vars,
            [
                ("bn.weight".to_string(), vec![5], DType::F32),
                ("bn.bias".to_string(), vec![5], DType::F32),
                ("bn.running_mean".to_string(), vec![5], DType::F32),
                ("bn.running_var".to_string(), vec![5], DType::F32),
                ("bn.num_batches_tracked".to_string(), vec![], DType::I64),
            ]
        );
        // Buffers are not parameters.
        assert_eq!(s.num_parameters(), 10);
    }

    #[test]
    fn conv_rejects_bad_groups_and_pools_check_padding() {
        let s = ParamStore::new();
        let cfg = Conv2dConfig::default().groups(3);
        assert!(Conv2d::new(&s.root().sub("c"), 4, 6, 3, cfg).is_err());
        let x = Tensor::randn(&[1, 1, 8, 8], 0).unwrap();
        // PyTorch: padding must be at most half the kernel.
        assert!(x.max_pool2d([2, 2], [2, 2], [2, 2], false).is_err());
        assert!(MaxPool2d::new(3, 2, 1).forward(&x).is_ok());
        let y = AvgPool2d::new(2, 2, 0).forward(&x).unwrap();
        assert_eq!(y.dims(), &[1, 1, 4, 4]);
    }

    #[test]
    fn dropout_is_identity_in_eval_and_flatten_keeps_batch() {
        let x = Tensor::randn(&[2, 3, 4], 1).unwrap();
        let y = Dropout::new(0.5).forward(&x).unwrap();
        assert_eq!(y.to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
        assert_eq!(Flatten::default().forward(&x).unwrap().dims(), &[2, 12]);
    }
}
