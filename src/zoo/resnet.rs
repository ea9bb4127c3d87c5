//! torchvision's ResNet family: `resnet18` (BasicBlock), `resnet50` and `resnext50_32x4d`
//! (Bottleneck, v1.5: stride on the 3x3 conv). Initialisation as torchvision's: conv weights
//! `kaiming_normal_(fan_out, relu)`, batch norms `1`/`0`, `fc` PyTorch's `Linear` default.

use super::blocks::{conv_fan_out, Act, ConvBnAct};
use super::NUM_CLASSES;
use crate::error::Result;
use crate::nn::{BatchNorm2d, Linear, Module, Path};
use crate::trace::Tensor;

/// `downsample = Sequential(conv1x1(stride), BatchNorm2d)`.
fn downsample(path: &Path, cin: usize, cout: usize, stride: usize) -> Result<ConvBnAct> {
    ConvBnAct::named(
        &path.sub(0),
        &path.sub(1),
        cin,
        cout,
        1,
        stride,
        1,
        Act::None,
        0.1,
    )
}

struct Block {
    /// conv-bn(-relu) units: two for BasicBlock, three for Bottleneck.
    units: Vec<ConvBnAct>,
    downsample: Option<ConvBnAct>,
}

impl Block {
    #[allow(clippy::too_many_arguments)]
    fn unit(
        path: &Path,
        i: usize,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        groups: usize,
        act: Act,
    ) -> Result<ConvBnAct> {
        Ok(ConvBnAct {
            conv: conv_fan_out(
                &path.sub(format!("conv{i}")),
                cin,
                cout,
                k,
                stride,
                k / 2,
                groups,
            )?,
            bn: BatchNorm2d::new(&path.sub(format!("bn{i}")), cout)?,
            act,
        })
    }

    fn basic(path: &Path, inplanes: usize, planes: usize, stride: usize) -> Result<Self> {
        Ok(Block {
            units: vec![
                Self::unit(path, 1, inplanes, planes, 3, stride, 1, Act::Relu)?,
                Self::unit(path, 2, planes, planes, 3, 1, 1, Act::None)?,
            ],
            downsample: if stride != 1 || inplanes != planes {
                Some(downsample(
                    &path.sub("downsample"),
                    inplanes,
                    planes,
                    stride,
                )?)
            } else {
                None
            },
        })
    }

    fn bottleneck(
        path: &Path,
        inplanes: usize,
        planes: usize,
        stride: usize,
        groups: usize,
        base_width: usize,
    ) -> Result<Self> {
        let width = planes * base_width / 64 * groups;
        let out = planes * 4;
        Ok(Block {
            units: vec![
                Self::unit(path, 1, inplanes, width, 1, 1, 1, Act::Relu)?,
                Self::unit(path, 2, width, width, 3, stride, groups, Act::Relu)?,
                Self::unit(path, 3, width, out, 1, 1, 1, Act::None)?,
            ],
            downsample: if stride != 1 || inplanes != out {
                Some(downsample(&path.sub("downsample"), inplanes, out, stride)?)
            } else {
                None
            },
        })
    }
}

impl Module for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for u in &self.units {
            h = u.forward_t(&h, train)?;
        }
        let identity = match &self.downsample {
            Some(d) => d.forward_t(x, train)?,
            None => x.clone(),
        };
        h.add(&identity)?.relu()
    }
}

/// torchvision's `ResNet`.
pub(crate) struct ResNet {
    stem: ConvBnAct,
    layers: Vec<Block>,
    fc: Linear,
}

impl ResNet {
    fn new(
        root: &Path,
        bottleneck: bool,
        blocks: [usize; 4],
        groups: usize,
        width_per_group: usize,
    ) -> Result<Self> {
        let stem = ConvBnAct {
            conv: conv_fan_out(&root.sub("conv1"), 3, 64, 7, 2, 3, 1)?,
            bn: BatchNorm2d::new(&root.sub("bn1"), 64)?,
            act: Act::Relu,
        };
        let expansion = if bottleneck { 4 } else { 1 };
        let mut inplanes = 64;
        let mut layers = Vec::new();
        for (li, (&n, planes)) in blocks.iter().zip([64, 128, 256, 512]).enumerate() {
            let layer = root.sub(format!("layer{}", li + 1));
            for bi in 0..n {
                let stride = if li > 0 && bi == 0 { 2 } else { 1 };
                let p = layer.sub(bi);
                let b = if bottleneck {
                    Block::bottleneck(&p, inplanes, planes, stride, groups, width_per_group)?
                } else {
                    Block::basic(&p, inplanes, planes, stride)?
                };
                layers.push(b);
                inplanes = planes * expansion;
            }
        }
        let fc = Linear::new(&root.sub("fc"), 512 * expansion, NUM_CLASSES, true)?;
        Ok(ResNet { stem, layers, fc })
    }
}

impl Module for ResNet {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = self.stem.forward_t(x, train)?;
        h = h.max_pool2d([3, 3], [2, 2], [1, 1], false)?;
        for b in &self.layers {
            h = b.forward_t(&h, train)?;
        }
        let h = h.adaptive_avg_pool2d([1, 1])?.flatten(1, -1)?;
        self.fc.forward_t(&h, train)
    }
}

/// torchvision's `resnet18` (11,689,512 parameters).
pub(crate) fn resnet18(root: &Path) -> Result<ResNet> {
    ResNet::new(root, false, [2, 2, 2, 2], 1, 64)
}

/// torchvision's `resnet50` (25,557,032 parameters).
pub(crate) fn resnet50(root: &Path) -> Result<ResNet> {
    ResNet::new(root, true, [3, 4, 6, 3], 1, 64)
}

/// torchvision's `resnext50_32x4d` (25,028,904 parameters).
pub(crate) fn resnext50_32x4d(root: &Path) -> Result<ResNet> {
    ResNet::new(root, true, [3, 4, 6, 3], 32, 4)
}
