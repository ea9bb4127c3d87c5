//! torchvision's AlexNet, VGG16 and SqueezeNet 1.1.

use super::blocks::linear_init;
use super::NUM_CLASSES;
use crate::error::Result;
use crate::nn::{
    AdaptiveAvgPool2d, Conv2d, Conv2dConfig, Dropout, Flatten, Init, Linear, MaxPool2d, Module,
    Path, Relu, Sequential,
};
use crate::trace::Tensor;

/// A plain convolution with PyTorch's default init.
fn conv(
    path: &Path,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> Result<Conv2d> {
    Conv2d::new(
        path,
        cin,
        cout,
        k,
        Conv2dConfig::default().stride(stride).padding(pad),
    )
}

/// Features, adaptive pool, flatten, classifier: the shape of AlexNet and VGG.
pub(crate) struct FeaturesClassifier {
    features: Sequential,
    pool: [usize; 2],
    classifier: Sequential,
}

impl Module for FeaturesClassifier {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.features.forward_t(x, train)?;
        let h = AdaptiveAvgPool2d(self.pool).forward_t(&h, train)?;
        let h = Flatten::default().forward_t(&h, train)?;
        self.classifier.forward_t(&h, train)
    }
}

/// torchvision's `alexnet` (61,100,840 parameters; PyTorch's default initialisation). At 64x64
/// the features end at 1x1, which the adaptive pool spreads to 6x6 as torchvision's does.
pub(crate) fn alexnet(root: &Path) -> Result<FeaturesClassifier> {
    let f = root.sub("features");
    let features = Sequential::new()
        .add(conv(&f.sub(0), 3, 64, 11, 4, 2)?)
        .add(Relu)
        .add(MaxPool2d::new(3, 2, 0))
        .add(conv(&f.sub(3), 64, 192, 5, 1, 2)?)
        .add(Relu)
        .add(MaxPool2d::new(3, 2, 0))
        .add(conv(&f.sub(6), 192, 384, 3, 1, 1)?)
        .add(Relu)
        .add(conv(&f.sub(8), 384, 256, 3, 1, 1)?)
        .add(Relu)
        .add(conv(&f.sub(10), 256, 256, 3, 1, 1)?)
        .add(Relu)
        .add(MaxPool2d::new(3, 2, 0));
    let c = root.sub("classifier");
    let classifier = Sequential::new()
        .add(Dropout::new(0.5))
        .add(Linear::new(&c.sub(1), 256 * 6 * 6, 4096, true)?)
        .add(Relu)
        .add(Dropout::new(0.5))
        .add(Linear::new(&c.sub(4), 4096, 4096, true)?)
        .add(Relu)
        .add(Linear::new(&c.sub(6), 4096, NUM_CLASSES, true)?);
    Ok(FeaturesClassifier {
        features,
        pool: [6, 6],
        classifier,
    })
}

/// torchvision's `vgg16` (configuration D without batch norm; 138,357,544 parameters).
/// Initialisation as torchvision's: conv `kaiming_normal_(fan_out, relu)` with zero bias,
/// linear `normal(0, 0.01)` with zero bias.
pub(crate) fn vgg16(root: &Path) -> Result<FeaturesClassifier> {
    const CFG: [usize; 18] = [
        64, 64, 0, 128, 128, 0, 256, 256, 256, 0, 512, 512, 512, 0, 512, 512, 512, 0,
    ];
    let f = root.sub("features");
    let mut features = Sequential::new();
    let mut cin = 3;
    let mut idx = 0;
    for &v in &CFG {
        if v == 0 {
            features = features.add(MaxPool2d::new(2, 2, 0));
            idx += 1;
        } else {
            let c = Conv2d::new(
                &f.sub(idx),
                cin,
                v,
                3,
                Conv2dConfig::default()
                    .padding(1)
                    .weight_init(Init::KaimingNormalFanOut)
                    .bias_init(Init::Const(0.0)),
            )?;
            features = features.add(c).add(Relu);
            idx += 2;
            cin = v;
        }
    }
    let c = root.sub("classifier");
    let lin = |i: usize, cin: usize, cout: usize| {
        linear_init(
            &c.sub(i),
            cin,
            cout,
            Init::Normal {
                mean: 0.0,
                std: 0.01,
            },
            Init::Const(0.0),
        )
    };
    let classifier = Sequential::new()
        .add(lin(0, 512 * 7 * 7, 4096)?)
        .add(Relu)
        .add(Dropout::new(0.5))
        .add(lin(3, 4096, 4096)?)
        .add(Relu)
        .add(Dropout::new(0.5))
        .add(lin(6, 4096, NUM_CLASSES)?);
    Ok(FeaturesClassifier {
        features,
        pool: [7, 7],
        classifier,
    })
}

/// SqueezeNet's Fire module: `squeeze` 1x1, then `expand1x1` and `expand3x3` concatenated.
struct Fire {
    squeeze: Conv2d,
    expand1x1: Conv2d,
    expand3x3: Conv2d,
}

/// SqueezeNet's default conv init: `kaiming_uniform_` (a = 0), zero bias.
fn squeeze_conv(
    path: &Path,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    pad: usize,
) -> Result<Conv2d> {
    let fan_in = (cin * k * k) as f64;
    let bound = (6.0 / fan_in).sqrt();
    Conv2d::new(
        path,
        cin,
        cout,
        k,
        Conv2dConfig::default()
            .stride(stride)
            .padding(pad)
            .weight_init(Init::Uniform {
                lo: -bound,
                hi: bound,
            })
            .bias_init(Init::Const(0.0)),
    )
}

impl Fire {
    fn new(path: &Path, cin: usize, squeeze: usize, e1: usize, e3: usize) -> Result<Self> {
        Ok(Fire {
            squeeze: squeeze_conv(&path.sub("squeeze"), cin, squeeze, 1, 1, 0)?,
            expand1x1: squeeze_conv(&path.sub("expand1x1"), squeeze, e1, 1, 1, 0)?,
            expand3x3: squeeze_conv(&path.sub("expand3x3"), squeeze, e3, 3, 1, 1)?,
        })
    }
}

impl Module for Fire {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let s = self.squeeze.forward_t(x, train)?.relu()?;
        let a = self.expand1x1.forward_t(&s, train)?.relu()?;
        let b = self.expand3x3.forward_t(&s, train)?.relu()?;
        Tensor::cat(&[a, b], 1)
    }
}

/// torchvision's `squeezenet1_1` (1,235,496 parameters): ceil-mode max pools, Fire modules,
/// a 1x1 conv classifier (`normal(0, 0.01)` init) and global average pooling.
pub(crate) fn squeezenet1_1(root: &Path) -> Result<Sequential> {
    let f = root.sub("features");
    let pool = || MaxPool2d::new(3, 2, 0).ceil_mode(true);
    let features = Sequential::new()
        .add(squeeze_conv(&f.sub(0), 3, 64, 3, 2, 0)?)
        .add(Relu)
        .add(pool())
        .add(Fire::new(&f.sub(3), 64, 16, 64, 64)?)
        .add(Fire::new(&f.sub(4), 128, 16, 64, 64)?)
        .add(pool())
        .add(Fire::new(&f.sub(6), 128, 32, 128, 128)?)
        .add(Fire::new(&f.sub(7), 256, 32, 128, 128)?)
        .add(pool())
        .add(Fire::new(&f.sub(9), 256, 48, 192, 192)?)
        .add(Fire::new(&f.sub(10), 384, 48, 192, 192)?)
        .add(Fire::new(&f.sub(11), 384, 64, 256, 256)?)
        .add(Fire::new(&f.sub(12), 512, 64, 256, 256)?);
    let final_conv = Conv2d::new(
        &root.sub("classifier").sub(1),
        512,
        NUM_CLASSES,
        1,
        Conv2dConfig::default()
            .weight_init(Init::Normal {
                mean: 0.0,
                std: 0.01,
            })
            .bias_init(Init::Const(0.0)),
    )?;
    Ok(Sequential::new()
        .add(features)
        .add(Dropout::new(0.5))
        .add(final_conv)
        .add(Relu)
        .add(AdaptiveAvgPool2d([1, 1]))
        .add(Flatten::default()))
}
