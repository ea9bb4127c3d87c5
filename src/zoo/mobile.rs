//! torchvision's MobileNetV2 and MNASNet 1.0.

use super::blocks::{conv_fan_out, linear_init, Act, ConvBnAct};
use super::NUM_CLASSES;
use crate::error::Result;
use crate::nn::{BatchNorm2d, Conv2d, Dropout, Init, Linear, Module, Path};
use crate::trace::Tensor;

/// MobileNetV2's inverted residual: `conv` = [expand 1x1 (if t != 1)], depthwise 3x3, linear
/// 1x1 conv + BN; residual when the stride is 1 and the channels match.
struct InvertedResidual {
    units: Vec<ConvBnAct>,
    project: Conv2d,
    bn: BatchNorm2d,
    residual: bool,
}

impl InvertedResidual {
    fn new(path: &Path, inp: usize, oup: usize, stride: usize, t: usize) -> Result<Self> {
        let hidden = inp * t;
        let c = path.sub("conv");
        let mut units = Vec::new();
        let mut i = 0;
        if t != 1 {
            units.push(ConvBnAct::seq(&c.sub(i), inp, hidden, 1, 1, 1, Act::Relu6)?);
            i += 1;
        }
        units.push(ConvBnAct::seq(
            &c.sub(i),
            hidden,
            hidden,
            3,
            stride,
            hidden,
            Act::Relu6,
        )?);
        Ok(InvertedResidual {
            units,
            project: conv_fan_out(&c.sub(i + 1), hidden, oup, 1, 1, 0, 1)?,
            bn: BatchNorm2d::new(&c.sub(i + 2), oup)?,
            residual: stride == 1 && inp == oup,
        })
    }
}

impl Module for InvertedResidual {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for u in &self.units {
            h = u.forward_t(&h, train)?;
        }
        let h = self
            .bn
            .forward_t(&self.project.forward_t(&h, train)?, train)?;
        if self.residual {
            h.add(x)
        } else {
            Ok(h)
        }
    }
}

/// `features`, global average pool, `classifier = [Dropout, Linear]`.
pub(crate) struct Mobile {
    stem: ConvBnAct,
    blocks: Vec<Box<dyn Module>>,
    head: ConvBnAct,
    dropout: f64,
    fc: Linear,
}

impl Module for Mobile {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = self.stem.forward_t(x, train)?;
        for b in &self.blocks {
            h = b.forward_t(&h, train)?;
        }
        let h = self.head.forward_t(&h, train)?;
        let h = h.adaptive_avg_pool2d([1, 1])?.flatten(1, -1)?;
        let h = Dropout::new(self.dropout).forward_t(&h, train)?;
        self.fc.forward_t(&h, train)
    }
}

/// torchvision's `mobilenet_v2` (width 1.0; 3,504,872 parameters). Initialisation as
/// torchvision's: conv `kaiming_normal_(fan_out)`, BN `1`/`0`, linear `normal(0, 0.01)`, zero
/// bias.
pub(crate) fn mobilenet_v2(root: &Path) -> Result<Mobile> {
    let f = root.sub("features");
    let stem = ConvBnAct::seq(&f.sub(0), 3, 32, 3, 2, 1, Act::Relu6)?;
    let settings: [(usize, usize, usize, usize); 7] = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ];
    let mut blocks: Vec<Box<dyn Module>> = Vec::new();
    let mut cin = 32;
    let mut idx = 1;
    for (t, c, n, s) in settings {
        for i in 0..n {
            let stride = if i == 0 { s } else { 1 };
            blocks.push(Box::new(InvertedResidual::new(
                &f.sub(idx),
                cin,
                c,
                stride,
                t,
            )?));
            cin = c;
            idx += 1;
        }
    }
    let head = ConvBnAct::seq(&f.sub(idx), cin, 1280, 1, 1, 1, Act::Relu6)?;
    let fc = linear_init(
        &root.sub("classifier").sub(1),
        1280,
        NUM_CLASSES,
        Init::Normal {
            mean: 0.0,
            std: 0.01,
        },
        Init::Const(0.0),
    )?;
    Ok(Mobile {
        stem,
        blocks,
        head,
        dropout: 0.2,
        fc,
    })
}

/// MNASNet's batch-norm momentum (`1 - 0.9997`).
const MNAS_BN_MOMENTUM: f64 = 1.0 - 0.9997;

/// MNASNet's `_InvertedResidual`: `layers` = 1x1 expand, depthwise kxk, 1x1 project (each with
/// BN; ReLU after the first two).
struct MnasBlock {
    units: Vec<ConvBnAct>,
    residual: bool,
}

impl MnasBlock {
    fn new(
        path: &Path,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        exp: usize,
    ) -> Result<Self> {
        let l = path.sub("layers");
        let mid = cin * exp;
        let unit =
            |c: usize, b: usize, i: usize, o: usize, k: usize, s: usize, g: usize, a: Act| {
                ConvBnAct::named(&l.sub(c), &l.sub(b), i, o, k, s, g, a, MNAS_BN_MOMENTUM)
            };
        Ok(MnasBlock {
            units: vec![
                unit(0, 1, cin, mid, 1, 1, 1, Act::Relu)?,
                unit(3, 4, mid, mid, k, stride, mid, Act::Relu)?,
                unit(6, 7, mid, cout, 1, 1, 1, Act::None)?,
            ],
            residual: cin == cout && stride == 1,
        })
    }
}

impl Module for MnasBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for u in &self.units {
            h = u.forward_t(&h, train)?;
        }
        if self.residual {
            h.add(x)
        } else {
            Ok(h)
        }
    }
}

/// A stem of two conv units (MNASNet's layers 0-7) as one module.
struct Units(Vec<ConvBnAct>);

impl Module for Units {
    fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for u in &self.0 {
            h = u.forward_t(&h, train)?;
        }
        Ok(h)
    }
}

/// torchvision's `mnasnet1_0` (4,383,312 parameters). Initialisation as torchvision's: conv
/// `kaiming_normal_(fan_out, relu)`, BN `1`/`0`, linear `kaiming_uniform_(fan_out, sigmoid)`
/// with zero bias.
pub(crate) fn mnasnet1_0(root: &Path) -> Result<Mobile> {
    let l = root.sub("layers");
    let d = [32, 16, 24, 40, 80, 96, 192, 320];
    let m = MNAS_BN_MOMENTUM;
    let stem = ConvBnAct::named(&l.sub(0), &l.sub(1), 3, d[0], 3, 2, 1, Act::Relu, m)?;
    let sep = Units(vec![
        ConvBnAct::named(&l.sub(3), &l.sub(4), d[0], d[0], 3, 1, d[0], Act::Relu, m)?,
        ConvBnAct::named(&l.sub(6), &l.sub(7), d[0], d[1], 1, 1, 1, Act::None, m)?,
    ]);
    let mut blocks: Vec<Box<dyn Module>> = vec![Box::new(sep)];
    // (kernel, stride, expansion, repeats) of the six stacks, layers 8..=13.
    let stacks = [
        (3, 2, 3, 3),
        (5, 2, 3, 3),
        (5, 2, 6, 3),
        (3, 1, 6, 2),
        (5, 2, 6, 4),
        (3, 1, 6, 1),
    ];
    for (si, (k, s, e, n)) in stacks.into_iter().enumerate() {
        let p = l.sub(8 + si);
        for r in 0..n {
            let (cin, stride) = if r == 0 {
                (d[si + 1], s)
            } else {
                (d[si + 2], 1)
            };
            blocks.push(Box::new(MnasBlock::new(
                &p.sub(r),
                cin,
                d[si + 2],
                k,
                stride,
                e,
            )?));
        }
    }
    let head = ConvBnAct::named(&l.sub(14), &l.sub(15), d[7], 1280, 1, 1, 1, Act::Relu, m)?;
    let bound = (3.0 / NUM_CLASSES as f64).sqrt();
    let fc = linear_init(
        &root.sub("classifier").sub(1),
        1280,
        NUM_CLASSES,
        Init::Uniform {
            lo: -bound,
            hi: bound,
        },
        Init::Const(0.0),
    )?;
    Ok(Mobile {
        stem,
        blocks,
        head,
        dropout: 0.2,
        fc,
    })
}
