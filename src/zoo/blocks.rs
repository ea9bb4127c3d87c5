//! Building blocks shared by the zoo's CNNs.

use crate::error::Result;
use crate::nn::{BatchNorm2d, Conv2d, Conv2dConfig, Init, Linear, Module, Path};
use crate::trace::Tensor;

/// A torchvision-style convolution: no bias, `kaiming_normal_(mode="fan_out")` weights.
pub(crate) fn conv_fan_out(
    path: &Path,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    padding: usize,
    groups: usize,
) -> Result<Conv2d> {
    Conv2d::new(
        path,
        cin,
        cout,
        k,
        Conv2dConfig::default()
            .stride(stride)
            .padding(padding)
            .groups(groups)
            .bias(false)
            .weight_init(Init::KaimingNormalFanOut),
    )
}

/// A linear layer with explicit initialisers.
pub(crate) fn linear_init(
    path: &Path,
    cin: usize,
    cout: usize,
    weight: Init,
    bias: Init,
) -> Result<Linear> {
    Ok(Linear {
        weight: path.param("weight", &[cout, cin], weight)?,
        bias: Some(path.param("bias", &[cout], bias)?),
    })
}

/// The activation after a [`ConvBnAct`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    None,
    Relu,
    Relu6,
}

impl Act {
    pub(crate) fn apply(self, x: Tensor) -> Result<Tensor> {
        match self {
            Act::None => Ok(x),
            Act::Relu => x.relu(),
            Act::Relu6 => x.relu6(),
        }
    }
}

/// Convolution (no bias, fan-out init), batch norm, activation: torchvision's
/// `Conv2dNormActivation` when the conv and norm are named `0` and `1`.
pub(crate) struct ConvBnAct {
    pub(crate) conv: Conv2d,
    pub(crate) bn: BatchNorm2d,
    pub(crate) act: Act,
}

impl ConvBnAct {
    /// `Conv2dNormActivation` under `path` (`path.0` conv, `path.1` norm), padding `(k-1)/2`.
    pub(crate) fn seq(
        path: &Path,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        groups: usize,
        act: Act,
    ) -> Result<Self> {
        Self::named(
            &path.sub(0),
            &path.sub(1),
            cin,
            cout,
            k,
            stride,
            groups,
            act,
            0.1,
        )
    }

    /// Conv under `conv_path`, norm under `bn_path` (with `momentum`), padding `(k-1)/2`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn named(
        conv_path: &Path,
        bn_path: &Path,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        groups: usize,
        act: Act,
        momentum: f64,
    ) -> Result<Self> {
        Ok(ConvBnAct {
            conv: conv_fan_out(conv_path, cin, cout, k, stride, (k - 1) / 2, groups)?,
            bn: BatchNorm2d::with_config(bn_path, cout, momentum, 1e-5)?,
            act,
        })
    }
}

impl Module for ConvBnAct {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let y = self.bn.forward_t(&self.conv.forward_t(x, train)?, train)?;
        self.act.apply(y)
    }
}
