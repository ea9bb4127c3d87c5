//! Helpers shared by the integration tests (`mod common;` in each test file): the XLA backend,
//! running a graph on a backend, seeded data and relative errors, the convolution cases of the
//! convolution suites, and the small MLP of the training tests.
//!
//! Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use kiln::autograd::vjp;
use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, Element, HostTensor};
use kiln::ir::{ConvAttrs, DType, Graph, InputKind, Op, TensorType};
use kiln::nn::{Init, Linear, Module, ParamStore};
use kiln::optim::Sgd;
use kiln::train::{TrainMode, TrainStep};
use kiln::Tensor;
use std::sync::OnceLock;

/// The backend that records the graphs kiln compiles on it (shared with the examples).
#[path = "../../examples/common/recorder.rs"]
pub mod recorder;

/// One XLA backend (PJRT CPU plugin) per test binary: loading the plugin costs a second.
pub fn xla() -> &'static XlaBackend {
    static X: OnceLock<XlaBackend> = OnceLock::new();
    X.get_or_init(|| XlaBackend::new().expect("the PJRT CPU plugin (run scripts/bootstrap.sh)"))
}

/// Compiles `g` on `b`, uploads `inputs`, executes and downloads the outputs.
pub fn run_graph<B: Backend>(
    b: &B,
    g: &Graph,
    inputs: &[HostTensor],
) -> kiln::Result<Vec<HostTensor>> {
    let exe = b.compile(g)?;
    let bufs = inputs
        .iter()
        .map(|h| b.to_device(h))
        .collect::<kiln::Result<Vec<_>>>()?;
    let refs: Vec<&B::Buffer> = bufs.iter().collect();
    let outs = b.execute(&exe, &refs)?;
    outs.iter().map(|o| b.to_host(o)).collect()
}

/// [`run_graph`], panicking with the backend's name and the graph on error.
pub fn run<B: Backend>(b: &B, g: &Graph, inputs: &[HostTensor]) -> Vec<HostTensor> {
    run_graph(b, g, inputs).unwrap_or_else(|e| panic!("{}: {e}\n{g}", b.name()))
}

/// SplitMix64: seeded data independent of libtorch's global generator.
///
/// Two seedings, both kept because tests compare against data drawn with them:
/// [`SplitMix64::raw`] starts from the seed itself, [`SplitMix64::mixed`] scrambles it first (so
/// that nearby seeds do not start one step apart on the same sequence).
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// The generator whose state is `seed`.
    pub fn raw(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The generator whose state is `seed` scrambled by a multiply and a xor.
    pub fn mixed(seed: u64) -> Self {
        SplitMix64(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ 0x6A09_E667_F3BC_C909)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` from the top 53 bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal by Box–Muller (one draw per two uniforms).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// An integer in `[lo, hi]` (modulo bias is irrelevant for test data).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

pub fn host<E: Element>(shape: &[usize], v: &[E]) -> HostTensor {
    HostTensor::from_slice(shape, v).unwrap()
}

/// Floats of `dtype` from `f` (rounded to f32 for `F32`).
pub fn floats(shape: &[usize], dtype: DType, mut f: impl FnMut() -> f64) -> HostTensor {
    let v: Vec<f64> = (0..numel(shape)).map(|_| f()).collect();
    match dtype {
        DType::F32 => host(shape, &v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        DType::F64 => host(shape, &v),
        // Rounded once, from f64, to nearest even.
        DType::BF16 => host(
            shape,
            &v.iter()
                .map(|&x| half::bf16::from_f64(x))
                .collect::<Vec<_>>(),
        ),
        DType::F16 => host(
            shape,
            &v.iter()
                .map(|&x| half::f16::from_f64(x))
                .collect::<Vec<_>>(),
        ),
        d => panic!("floats of {d}"),
    }
}

/// `max |a - b| / max(1, max |b|)`.
pub fn rel_err(a: &HostTensor, b: &HostTensor) -> f64 {
    assert_eq!(a.ty().shape, b.ty().shape, "shape mismatch");
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    let scale = b.iter().fold(1.0f64, |m, x| m.max(x.abs()));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
        / scale
}

// ----- convolution cases -----------------------------------------------------------------------

/// The suites that run a convolution case ([`ConvCase::suites`], bit flags): the im2col
/// lowering against direct and eager (`conv_lowering.rs`).
pub const LOWERING: u8 = 1;
/// The libtorch FFI kernel against XLA and float64 (`ffi_kernels.rs`).
pub const FFI: u8 = 2;
/// The reference semantics of `Op::Conv` on every backend (`ops.rs`).
pub const OPS: u8 = 4;

/// One convolution: input shape, kernel shape, attributes, and the suites that run it.
#[derive(Clone, Debug)]
pub struct ConvCase {
    /// Input shape `[N, C, *spatial]`.
    pub x: Vec<usize>,
    /// Kernel shape `[O, C / groups, *k]`.
    pub k: Vec<usize>,
    /// The convolution's attributes.
    pub attrs: ConvAttrs,
    /// The suites that run it: [`LOWERING`], [`FFI`], [`OPS`] or'ed.
    pub suites: u8,
}

/// The case of plain attributes for `x.len() - 2` spatial dims as `f` leaves them.
pub fn conv_case(suites: u8, x: &[usize], k: &[usize], f: impl FnOnce(&mut ConvAttrs)) -> ConvCase {
    let mut attrs = ConvAttrs::plain(x.len() - 2);
    f(&mut attrs);
    ConvCase {
        x: x.to_vec(),
        k: k.to_vec(),
        attrs,
        suites,
    }
}

/// The cases of [`conv_cases`] that `suite` runs, in table order.
///
/// Each suite seeds a case's data with the case's position in this list, so a case added to a
/// suite changes the data of the suite's later cases.
pub fn conv_cases(suite: u8) -> Vec<ConvCase> {
    all_conv_cases()
        .into_iter()
        .filter(|c| c.suites & suite != 0)
        .collect()
}

/// Every single-convolution case, on the attribute combinations forward and backward
/// convolutions use: stride, padding (asymmetric, negative, high < low), kernel and input
/// dilation, feature groups (grouped, depthwise), batch groups, 1-3 spatial dims; for the FFI
/// kernel, every path it takes (direct, narrowed, explicit padding, transposed, transposed and
/// narrowed, explicit dilation, batch groups).
fn all_conv_cases() -> Vec<ConvCase> {
    const ALL: u8 = LOWERING | FFI | OPS;
    const LF: u8 = LOWERING | FFI;
    vec![
        conv_case(ALL, &[2, 3, 7, 6], &[4, 3, 3, 2], |_| {}),
        // Forward 3x3, stride 1 and 2, padding 1 (resnet blocks).
        conv_case(LF, &[2, 16, 6, 6], &[8, 16, 3, 3], |a| {
            a.padding = vec![(1, 1), (1, 1)]
        }),
        conv_case(ALL, &[2, 3, 7, 6], &[4, 3, 3, 3], |a| {
            a.strides = vec![2, 1];
            a.padding = vec![(1, 1), (1, 1)];
        }),
        // 1x1 stride 2 (downsample) and 1x1 stride 1 (bottleneck).
        conv_case(LF, &[2, 8, 6, 6], &[5, 8, 1, 1], |a| a.strides = vec![2, 2]),
        conv_case(LOWERING, &[2, 8, 3, 5], &[5, 8, 1, 1], |_| {}),
        // 7x7 stride 2 padding 3 (stem).
        conv_case(LF, &[1, 3, 12, 11], &[4, 3, 7, 7], |a| {
            a.strides = vec![2, 2];
            a.padding = vec![(3, 3), (3, 3)];
        }),
        // Asymmetric padding.
        conv_case(LOWERING | OPS, &[1, 2, 6, 5], &[3, 2, 3, 2], |a| {
            a.padding = vec![(2, 0), (0, 1)]
        }),
        // high < low (symmetric low, then narrowed).
        conv_case(FFI, &[1, 2, 6, 5], &[3, 2, 3, 2], |a| {
            a.padding = vec![(2, 0), (1, -1)]
        }),
        // high > low and negative (cropping) padding (explicit pad / crop).
        conv_case(FFI, &[1, 2, 6, 5], &[3, 2, 3, 2], |a| {
            a.padding = vec![(0, 2), (0, 1)]
        }),
        conv_case(ALL, &[1, 2, 6, 7], &[3, 2, 2, 3], |a| {
            a.padding = vec![(-1, 1), (1, -2)]
        }),
        // Kernel dilation with stride.
        conv_case(ALL, &[2, 2, 8, 7], &[3, 2, 3, 2], |a| {
            a.rhs_dilation = vec![2, 3];
            a.padding = vec![(1, 2), (0, 1)];
            a.strides = vec![1, 2];
        }),
        // Weight-gradient shapes: large "kernel" (the cotangent), dilated by the forward
        // stride, few outputs, negative padding.
        conv_case(LF, &[6, 2, 8, 8], &[5, 2, 4, 4], |a| {
            a.rhs_dilation = vec![2, 2];
            a.padding = vec![(0, -1), (0, -1)];
        }),
        conv_case(LF, &[6, 2, 5, 5], &[5, 2, 5, 5], |a| {
            a.padding = vec![(1, 1), (1, 1)]
        }),
        // Feature groups: grouped and depthwise (channel multiplier 2).
        conv_case(ALL, &[2, 6, 5, 5], &[9, 2, 3, 3], |a| a.feature_groups = 3),
        conv_case(ALL, &[2, 4, 6, 6], &[8, 1, 3, 3], |a| {
            a.feature_groups = 4;
            a.padding = vec![(1, 1), (1, 1)];
        }),
        // Batch groups (weight gradient of grouped convolutions).
        conv_case(ALL, &[4, 3, 5, 5], &[6, 3, 2, 2], |a| a.batch_groups = 2),
        conv_case(ALL, &[3, 2, 6, 5], &[6, 2, 3, 3], |a| {
            a.batch_groups = 3;
            a.strides = vec![2, 1];
            a.padding = vec![(1, 0), (1, 1)];
        }),
        // Input dilation (input gradient of strided convolutions): transposed convolution,
        // lhs dilation 2, p = 1, output padding 1 and 0 ...
        conv_case(LOWERING | OPS, &[1, 3, 4, 4], &[2, 3, 3, 3], |a| {
            a.lhs_dilation = vec![2, 2];
            a.padding = vec![(1, 2), (1, 2)];
        }),
        conv_case(FFI, &[1, 3, 4, 4], &[2, 3, 3, 3], |a| {
            a.lhs_dilation = vec![2, 2];
            a.padding = vec![(1, 2), (1, 1)];
        }),
        conv_case(LF, &[2, 4, 3, 3], &[3, 4, 1, 1], |a| {
            a.lhs_dilation = vec![2, 2];
            a.padding = vec![(0, 1), (0, 1)];
        }),
        // ... with high < low (narrowed), grouped, kernel-dilated ...
        conv_case(FFI, &[2, 4, 4, 3], &[6, 2, 3, 3], |a| {
            a.lhs_dilation = vec![2, 3];
            a.padding = vec![(2, 1), (1, 0)];
            a.feature_groups = 2;
        }),
        conv_case(FFI, &[1, 2, 5, 5], &[2, 2, 3, 2], |a| {
            a.lhs_dilation = vec![2, 2];
            a.rhs_dilation = vec![2, 3];
            a.padding = vec![(3, 4), (2, 2)];
        }),
        // ... and beyond it (explicit dilation): stride > 1, padding wider than the kernel,
        // output padding too large.
        conv_case(FFI, &[1, 2, 5, 5], &[3, 2, 3, 3], |a| {
            a.lhs_dilation = vec![2, 2];
            a.strides = vec![2, 1];
            a.padding = vec![(1, 1), (1, 1)];
        }),
        conv_case(FFI, &[1, 2, 4, 4], &[3, 2, 2, 2], |a| {
            a.lhs_dilation = vec![2, 2];
            a.padding = vec![(3, 0), (0, 3)];
        }),
        // 1-d and 3-d.
        conv_case(ALL, &[2, 3, 10], &[4, 3, 3], |a| {
            a.strides = vec![2];
            a.padding = vec![(1, 2)];
            a.rhs_dilation = vec![2];
        }),
        conv_case(ALL, &[1, 2, 5], &[3, 2, 2], |a| {
            a.lhs_dilation = vec![3];
            a.padding = vec![(1, 1)];
        }),
        conv_case(ALL, &[1, 2, 4, 4, 5], &[2, 2, 2, 2, 3], |a| {
            a.strides = vec![1, 2, 1];
            a.padding = vec![(0, 1), (1, 0), (1, 1)];
        }),
    ]
}

/// Resnet- and mobilenet-like layers whose forward, input-gradient and weight-gradient
/// convolutions (as kiln's autograd builds them: [`ConvCase::grad_graph`]) the suites check: those
/// `suite` runs, in table order (numbered, and seeded, as in [`conv_cases`]).
pub fn autograd_conv_layers(suite: u8) -> Vec<ConvCase> {
    const LF: u8 = LOWERING | FFI;
    vec![
        conv_case(LF, &[2, 16, 8, 8], &[16, 16, 3, 3], |a| {
            a.padding = vec![(1, 1), (1, 1)]
        }),
        conv_case(LF, &[2, 8, 8, 8], &[16, 8, 3, 3], |a| {
            a.strides = vec![2, 2];
            a.padding = vec![(1, 1), (1, 1)];
        }),
        conv_case(LF, &[2, 8, 7, 7], &[16, 8, 1, 1], |a| {
            a.strides = vec![2, 2]
        }),
        conv_case(LF, &[2, 3, 13, 13], &[8, 3, 7, 7], |a| {
            a.strides = vec![2, 2];
            a.padding = vec![(3, 3), (3, 3)];
        }),
        conv_case(LF, &[2, 8, 6, 6], &[8, 1, 3, 3], |a| {
            a.feature_groups = 8;
            a.padding = vec![(1, 1), (1, 1)];
        }),
        // Grouped with stride 2, on an even and an odd input.
        conv_case(LOWERING, &[2, 8, 6, 6], &[8, 2, 3, 3], |a| {
            a.feature_groups = 4;
            a.strides = vec![2, 2];
            a.padding = vec![(1, 1), (1, 1)];
        }),
        conv_case(FFI, &[2, 8, 7, 7], &[8, 2, 3, 3], |a| {
            a.feature_groups = 4;
            a.strides = vec![2, 2];
            a.padding = vec![(1, 1), (1, 1)];
        }),
        // Depthwise weight gradients that do not run on oneDNN's: few input positions, a
        // 5x5 window.
        conv_case(FFI, &[2, 16, 2, 2], &[16, 1, 3, 3], |a| {
            a.feature_groups = 16;
            a.padding = vec![(1, 1), (1, 1)];
        }),
        conv_case(FFI, &[2, 8, 8, 8], &[8, 1, 5, 5], |a| {
            a.feature_groups = 8;
            a.strides = vec![2, 2];
            a.padding = vec![(2, 2), (2, 2)];
        }),
    ]
    .into_iter()
    .filter(|c| c.suites & suite != 0)
    .collect()
}

/// `conv(x, w)`: inputs `x` and `w` (data), one `Op::Conv`.
pub fn conv_graph(c: &ConvAttrs, x: &TensorType, w: &TensorType) -> Graph {
    let mut g = Graph::new();
    let a = g.add_input(InputKind::Data, "x", x.clone());
    let b = g.add_input(InputKind::Data, "w", w.clone());
    let y = g.add(Op::Conv(c.clone()), &[a, b]).unwrap();
    g.set_outputs(vec![y]).unwrap();
    g
}

impl ConvCase {
    /// The case's input and kernel types in `dtype`, and its graph ([`conv_graph`]).
    pub fn graph(&self, dtype: DType) -> (TensorType, TensorType, Graph) {
        let xt = TensorType::new(dtype, self.x.as_slice());
        let kt = TensorType::new(dtype, self.k.as_slice());
        let g = conv_graph(&self.attrs, &xt, &kt);
        (xt, kt, g)
    }

    /// The case's convolution and its gradients as kiln's autograd builds them, in `dtype`:
    /// inputs `x` (data), `w` (a parameter updated between calls, as in a training step)
    /// and the cotangent `ct`; outputs `y`, `dx`, `dw`. Returns the graph and its input types.
    pub fn grad_graph(&self, dtype: DType) -> (Graph, [TensorType; 3]) {
        let xt = TensorType::new(dtype, self.x.as_slice());
        let kt = TensorType::new(dtype, self.k.as_slice());
        let mut g = Graph::new();
        let a = g.add_input(InputKind::Data, "x", xt.clone());
        let b = g.add_input(InputKind::Parameter, "w", kt.clone());
        g.set_updated_between_calls(1, true).unwrap();
        let y = g.add(Op::Conv(self.attrs.clone()), &[a, b]).unwrap();
        let yt = g.node(y).ty.clone();
        let ct = g.add_input(InputKind::Cotangent, "ct", yt.clone());
        let grads = vjp(&mut g, y, ct, &[true, true]).unwrap();
        g.set_outputs(vec![y, grads[0].unwrap(), grads[1].unwrap()])
            .unwrap();
        (g, [xt, kt, yt])
    }
}

// ----- training: a small MLP -------------------------------------------------------------------

/// A 2-layer MLP (6 -> 16 -> 3) with a tanh, a running-mean buffer updated in training mode
/// (the same mechanism BatchNorm uses), and dropout before the second layer (none at 0).
///
/// Well conditioned: smooth (no kink whose side float32 rounding could flip), losses and
/// parameters O(1), each value a sum of a few dozen products.
pub struct Net {
    l1: Linear,
    l2: Linear,
    running: Tensor,
    dropout: f64,
}

impl Net {
    /// The MLP's parameters and buffer in `store` (`l1`, `l2`, `running`).
    pub fn new(store: &ParamStore, dropout: f64) -> kiln::Result<Net> {
        let r = store.root();
        Ok(Net {
            l1: Linear::new(&r.sub("l1"), 6, 16, true)?,
            l2: Linear::new(&r.sub("l2"), 16, 3, true)?,
            running: r.buffer("running", &[16], Init::Const(0.0), DType::F32)?,
            dropout,
        })
    }
}

impl Module for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> kiln::Result<Tensor> {
        let h = self.l1.forward(x)?.tanh()?;
        if train {
            let m = h.mean(&[0], false)?.detach()?;
            self.running
                .assign(&self.running.mul_scalar(0.9)?.add(&m.mul_scalar(0.1)?)?)?;
        }
        let h = h.dropout(self.dropout, train)?;
        self.l2.forward(&h)
    }
}

/// The mean squared error of `net` (training mode) on inputs `xs[0]` and targets `xs[1]`.
pub fn mse(net: &Net, xs: &[Tensor]) -> kiln::Result<Tensor> {
    net.forward_t(&xs[0], true)?
        .sub(&xs[1])?
        .square()?
        .mean_all()
}

/// Buffers a step of [`sgd_step`] on [`Net`] (`n_params` parameters) donates, as PJRT reports
/// the inputs deleted: every momentum buffer, the step count, the running mean, and in the
/// split step every parameter. The fused step updates these small parameters into new buffers
/// (XLA would copy them on entry; see `UpdatedParam` in train.rs).
pub fn donated_per_step(mode: TrainMode, n_params: u64) -> u64 {
    match mode {
        TrainMode::Split => 2 * n_params + 2,
        TrainMode::Fused => n_params + 2,
    }
}

/// A training step of `net` (whose variables `store` holds) on `backend`: [`mse`], SGD with
/// momentum 0.9, learning rate `lr`, in `mode`.
pub fn sgd_step<B: Backend>(
    backend: B,
    store: &ParamStore,
    net: Net,
    mode: TrainMode,
    lr: f64,
) -> kiln::Result<TrainStep<B>> {
    Ok(
        TrainStep::new(backend, store, Sgd::new().momentum(0.9), move |xs| {
            mse(&net, xs)
        })?
        .with_mode(mode)
        .with_lr(lr),
    )
}

/// Seeded inputs `[rows, 6]` and targets `[rows, 3]` for [`Net`].
pub fn batch(rows: usize, seed: u64) -> kiln::Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::randn(&[rows, 6], seed)?,
        Tensor::randn(&[rows, 3], seed + 100)?,
    ])
}

/// Normwise relative error `|a - b|₂ / |b|₂` (denominator at least 1e-12).
pub fn rel_err_l2(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    let den: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt().max(1e-12);
    num / den
}

/// Every variable of a store by name, as float64.
pub type Values = Vec<(String, Vec<f64>)>;

/// The variables of `store` (parameters and buffers) by name, as float64.
pub fn store_values(store: &ParamStore) -> Values {
    store
        .vars()
        .into_iter()
        .map(|(n, t)| (n, t.to_f64_vec().unwrap()))
        .collect()
}
