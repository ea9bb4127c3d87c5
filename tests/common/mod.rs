//! Helpers shared by the integration tests (`mod common;` in each test file): the XLA backend,
//! running a graph on a backend, seeded data and relative errors.
//!
//! Each test crate compiles this module on its own and uses only part of it.
#![allow(dead_code)]

use kiln::backend::xla::XlaBackend;
use kiln::backend::{Backend, Element, HostTensor};
use kiln::ir::{DType, Graph};
use std::sync::OnceLock;

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
