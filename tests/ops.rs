//! Every `Op` on both backends against an independent reference.
//!
//! Each case is one op applied to graph inputs, built with [`Graph`] directly and run on the
//! XLA backend (PJRT CPU plugin) and on the eager interpreter; both results are compared with a
//! reference computed in this file, never with `kiln::backend::eager::eval_op`: direct tch calls
//! (einsum, pooling with indices, convolution / transposed convolution, ...), byte-level index
//! maps for data movement, and plain Rust for integer semantics libtorch leaves undefined
//! (wrapping `u32`, division by zero, shifts past the bit width, saturating conversions).
//! Inputs are seeded random data plus special values (NaN, ±inf, ±0, integer extremes).
//!
//! An XLA compilation costs tens of milliseconds per kernel here, so the cases of a test are
//! compiled together: one graph whose independent one-op subgraphs each have their own inputs
//! and output, compared one by one (a failing batch is re-run case by case to name the culprit).
//!
//! The second half checks tensor-level compositions (matmul, softmax, ...) eagerly and traced +
//! compiled with `kiln::compile` on both backends, and runs proptests over random shapes.

mod common;

use common::{conv_cases, floats, host, numel, run_graph, xla, SplitMix64, OPS};
use kiln::backend::eager::{kind_of, EagerBackend};
use kiln::backend::HostTensor;
use kiln::ir::{
    BinaryOp, CompareOp, ConvAttrs, DType, DotDims, Graph, InputKind, Literal, Op, ReduceKind,
    Shape, TensorType, UnaryOp, WindowAttrs,
};
use proptest::prelude::*;
use tch::{Kind, Tensor as T};

// ----- harness ---------------------------------------------------------------------------------

/// A graph with one input per host tensor and a single `op` node as its output.
fn one_op(op: &Op, inputs: &[HostTensor]) -> Graph {
    let mut g = Graph::new();
    let ids: Vec<_> = inputs
        .iter()
        .enumerate()
        .map(|(i, h)| g.add_input(InputKind::Data, format!("x{i}"), h.ty().clone()))
        .collect();
    let y = g
        .add(op.clone(), &ids)
        .unwrap_or_else(|e| panic!("building {op:?}: {e}"));
    g.set_outputs(vec![y]).unwrap();
    g
}

/// How results are compared with the reference.
#[derive(Clone, Copy, Debug)]
enum Tol {
    /// Same bytes (integers, bools, and floats whose sign of zero matters).
    Bits,
    /// Floats: `|got - want| <= atol + rtol * |want|`, NaN where NaN, same infinities.
    Close(f64, f64),
    /// Floats: equal values, NaN where NaN, and the same sign of zero.
    Exact,
}

const F32: Tol = Tol::Close(1e-5, 1e-6);
const F64: Tol = Tol::Close(1e-12, 1e-13);

fn default_tol(d: DType) -> Tol {
    match d {
        DType::F32 => F32,
        DType::F64 => F64,
        // Where a 16-bit result is compared with a fixed tolerance, it must be exact (rounded
        // results go through `check_derived`); NaN payloads may differ.
        DType::BF16 | DType::F16 => Tol::Exact,
        _ => Tol::Bits,
    }
}

fn compare(what: &str, got: &HostTensor, want: &HostTensor, tol: Tol) -> Result<(), String> {
    if got.ty() != want.ty() {
        return Err(format!(
            "{what}: type {} but expected {}",
            got.ty(),
            want.ty()
        ));
    }
    let tol = match (tol, want.ty().dtype.is_float()) {
        (Tol::Close(..), false) => Tol::Bits,
        (t, _) => t,
    };
    match tol {
        Tol::Bits => {
            if got.bytes() != want.bytes() {
                let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
                let s = want.ty().dtype.size_in_bytes();
                let i = (0..g.len())
                    .find(|&i| got.bytes()[i * s..(i + 1) * s] != want.bytes()[i * s..(i + 1) * s])
                    .unwrap_or(0);
                return Err(format!(
                    "{what}: element {i} is {:?}, expected {:?} ({} of {} elements differ)",
                    g[i],
                    w[i],
                    (0..g.len())
                        .filter(|&i| got.bytes()[i * s..(i + 1) * s]
                            != want.bytes()[i * s..(i + 1) * s])
                        .count(),
                    g.len()
                ));
            }
        }
        Tol::Exact => {
            let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
            for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
                let ok = (a.is_nan() && b.is_nan())
                    || (a == b && a.is_sign_negative() == b.is_sign_negative());
                if !ok {
                    return Err(format!("{what}: element {i} is {a:?}, expected {b:?}"));
                }
            }
        }
        Tol::Close(rtol, atol) => {
            let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
            for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
                let ok = if b.is_nan() {
                    a.is_nan()
                } else if b.is_infinite() {
                    a == b
                } else {
                    (a - b).abs() <= atol + rtol * b.abs()
                };
                if !ok {
                    return Err(format!(
                        "{what}: element {i} is {a:e}, expected {b:e} (rtol {rtol:e}, atol {atol:e})"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// One expected result: `op` applied to `inputs` should give `want`.
struct Case {
    name: String,
    op: Op,
    inputs: Vec<HostTensor>,
    want: HostTensor,
    tol: Tol,
    /// For 16-bit floats: the bound derived from libtorch's own error (see [`check_derived`]);
    /// replaces `want`/`tol`.
    bound: Option<Bound>,
}

thread_local! {
    static PENDING: std::cell::RefCell<Vec<Case>> = const { std::cell::RefCell::new(Vec::new()) };
    static FAILURES: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn fail(msg: String) {
    FAILURES.with(|f| f.borrow_mut().push(msg));
}

/// Queues a check of `op` on both backends against `want`. Cases are batched (see [`flush`]).
fn check(name: &str, op: Op, inputs: &[HostTensor], want: &HostTensor, tol: Tol) {
    let n = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.push(Case {
            name: name.to_string(),
            op,
            inputs: inputs.to_vec(),
            want: want.clone(),
            tol,
            bound: None,
        });
        p.len()
    });
    if n >= 256 {
        flush();
    }
}

/// Runs the queued cases. An XLA compilation costs ~30 ms on this machine, far more than
/// running a small op, so the queued cases become one graph: each case is its own one-op
/// subgraph on its own inputs, with its own output, and is compared separately.
fn flush() {
    let cases = PENDING.with(|p| std::mem::take(&mut *p.borrow_mut()));
    if cases.is_empty() {
        return;
    }
    let mut g = Graph::new();
    let mut inputs = Vec::new();
    let mut built = Vec::new();
    let mut outs = Vec::new();
    for c in &cases {
        let ids: Vec<_> = c
            .inputs
            .iter()
            .map(|h| {
                inputs.push(h.clone());
                g.add_input(
                    InputKind::Data,
                    format!("x{}", inputs.len()),
                    h.ty().clone(),
                )
            })
            .collect();
        match g.add(c.op.clone(), &ids) {
            Ok(y) => {
                outs.push(y);
                built.push(c);
            }
            Err(e) => fail(format!("{}: building {:?}: {e}", c.name, c.op)),
        }
    }
    g.set_outputs(outs).unwrap();
    let what = |c: &Case, b: &str| {
        let shapes: Vec<String> = c.inputs.iter().map(|h| h.ty().to_string()).collect();
        format!("{} [{b}] {:?} on ({})", c.name, c.op, shapes.join(", "))
    };
    let t0 = std::time::Instant::now();
    let rx = run_graph(xla(), &g, &inputs);
    let t1 = std::time::Instant::now();
    let re = run_graph(&EagerBackend::new(), &g, &inputs);
    if std::env::var("KILN_TEST_TIMING").is_ok() {
        eprintln!(
            "{} cases ({} nodes): xla {:?}, eager {:?}",
            built.len(),
            g.len(),
            t1 - t0,
            t1.elapsed()
        );
    }
    for (backend, result) in [("xla", rx), ("eager", re)] {
        match result {
            Ok(out) => {
                for (c, o) in built.iter().zip(&out) {
                    let r = match &c.bound {
                        Some(b) => b.compare(&what(c, backend), backend, o),
                        None => compare(&what(c, backend), o, &c.want, c.tol),
                    };
                    if let Err(e) = r {
                        fail(e);
                    }
                }
            }
            Err(e) => {
                // Find the culprit by running the cases one by one.
                let e = e.to_string();
                let first = e.lines().next().unwrap_or("").to_string();
                for c in &built {
                    let one = one_op(&c.op, &c.inputs);
                    let r = if backend == "xla" {
                        run_graph(xla(), &one, &c.inputs)
                    } else {
                        run_graph(&EagerBackend::new(), &one, &c.inputs)
                    };
                    if let Err(e) = r {
                        let e = e.to_string();
                        fail(format!(
                            "{}: {}",
                            what(c, backend),
                            e.lines().next().unwrap_or("")
                        ));
                    }
                }
                fail(format!("{backend}: the batch failed: {first}"));
            }
        }
    }
}

/// Runs the remaining cases of one test (each test runs on its own thread) and reports every
/// failure when dropped at the end of the test.
struct Report;

impl Drop for Report {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        flush();
        report_half_errors();
        let f = FAILURES.with(|f| std::mem::take(&mut *f.borrow_mut()));
        if !f.is_empty() {
            panic!("{} failure(s):\n{}", f.len(), f.join("\n"));
        }
    }
}

// ----- 16-bit floats: tolerances derived from libtorch's own error ---------------------------
//
// A bf16 or f16 result cannot be compared with a fixed tolerance against libtorch in the same
// dtype: the two may round at different points (XLA CPU computes most bf16/f16 elementwise ops
// in f32 and rounds once; libtorch sometimes does too, sometimes accumulates in the narrow
// type), so neither is "the" answer. Both are compared with the float64 result on the same
// (already rounded) inputs instead, and kiln (each backend) may be at most a small multiple of
// libtorch's own error in that dtype, with a floor of what correct rounding allows:
//
// - elementwise ops, per element: |got - ref| <= 2 * max(|torch - ref|, u * |ref|, tiny)
// - contractions and sums (dot, conv, reductions, pooling, scatter-add), normwise over the
//   output: max |got - ref| <= 4 * max(max |torch - ref|, u * max |ref|, tiny)
//
// where u is the unit roundoff (half the machine epsilon: 2^-8 = 3.9e-3 for bf16, 2^-11 =
// 4.9e-4 for f16; one correctly rounded operation errs by at most u relative) and tiny is the
// smallest normal number of the dtype (a result flushed to zero, or a subnormal rounded
// differently, may lose that much). The factor 2 elementwise allows a second rounding (an f32
// intermediate, then the output); 4 for sums allows a different summation order (the error
// bound of a sum grows with the number of terms and depends on the order). A NaN reference
// must give NaN, an infinite one the same infinity; a finite reference may give an infinity
// only where the reference rounded to the dtype overflows too.

/// The elementwise or normwise rule above.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Rule {
    Elementwise,
    Normwise,
}

#[derive(Clone)]
struct Bound {
    dtype: DType,
    rule: Rule,
    /// The float64 result on the rounded inputs.
    reference: Vec<f64>,
    /// The reference rounded to the dtype (for overflow).
    rounded: Vec<f64>,
    /// The allowed absolute error per element.
    allowed: Vec<f64>,
    /// Per element: the magnitude errors are reported relative to.
    scale: Vec<f64>,
    /// libtorch's largest relative error (reported).
    torch_err: f64,
}

fn unit_roundoff(d: DType) -> f64 {
    d.epsilon().unwrap() / 2.0
}

fn smallest_normal(d: DType) -> f64 {
    match d {
        DType::BF16 => f32::MIN_POSITIVE as f64,
        DType::F16 => 2f64.powi(-14),
        DType::F32 => f32::MIN_POSITIVE as f64,
        _ => f64::MIN_POSITIVE,
    }
}

impl Bound {
    fn new(dtype: DType, rule: Rule, reference: &T, torch: &T) -> Bound {
        let r = th(reference, DType::F64).to_f64_vec();
        let t = th(torch, dtype).to_f64_vec();
        assert_eq!(r.len(), t.len(), "reference and libtorch result sizes");
        let rounded = th(reference, dtype).to_f64_vec();
        let (u, tiny) = (unit_roundoff(dtype), smallest_normal(dtype));
        let terr = |a: f64, b: f64| {
            if a.is_finite() && b.is_finite() {
                (a - b).abs()
            } else {
                0.0
            }
        };
        let (allowed, scale): (Vec<f64>, Vec<f64>) = match rule {
            Rule::Elementwise => r
                .iter()
                .zip(&t)
                .map(|(&r, &t)| {
                    let a = 2.0 * terr(t, r).max(u * r.abs()).max(tiny);
                    (a, r.abs().max(tiny))
                })
                .unzip(),
            Rule::Normwise => {
                let finite = |v: &f64| v.is_finite();
                let rmax = r
                    .iter()
                    .filter(|v| finite(v))
                    .fold(0.0f64, |m, v| m.max(v.abs()));
                let tmax = r
                    .iter()
                    .zip(&t)
                    .fold(0.0f64, |m, (&r, &t)| m.max(terr(t, r)));
                let a = 4.0 * tmax.max(u * rmax).max(tiny);
                (vec![a; r.len()], vec![rmax.max(tiny); r.len()])
            }
        };
        let torch_err = r
            .iter()
            .zip(&t)
            .zip(&scale)
            .fold(0.0f64, |m, ((&r, &t), &s)| m.max(terr(t, r) / s));
        Bound {
            dtype,
            rule,
            reference: r,
            rounded,
            allowed,
            scale,
            torch_err,
        }
    }

    fn compare(&self, what: &str, backend: &str, got: &HostTensor) -> Result<(), String> {
        if got.ty().dtype != self.dtype || got.ty().shape.numel() != self.reference.len() {
            return Err(format!(
                "{what}: type {}, expected {}",
                got.ty(),
                self.dtype
            ));
        }
        let g = got.to_f64_vec();
        let mut worst = 0.0f64;
        for (i, &a) in g.iter().enumerate() {
            let (r, rr) = (self.reference[i], self.rounded[i]);
            let ok = if r.is_nan() {
                a.is_nan()
            } else if r.is_infinite() {
                a == r
            } else if a.is_infinite() {
                a == rr
            } else {
                let e = (a - r).abs();
                worst = worst.max(e / self.scale[i]);
                e <= self.allowed[i]
            };
            if !ok {
                return Err(format!(
                    "{what}: element {i} is {a:e}, float64 reference {r:e}, allowed error {:e} \
                     ({:?} rule)",
                    self.allowed[i], self.rule
                ));
            }
        }
        HALF_ERRORS.with(|h| {
            let mut h = h.borrow_mut();
            let e = h.entry(self.dtype.name()).or_insert((0.0, 0.0, 0.0));
            match backend {
                "xla" => e.0 = e.0.max(worst),
                _ => e.1 = e.1.max(worst),
            }
            e.2 = e.2.max(self.torch_err);
        });
        Ok(())
    }
}

thread_local! {
    /// Per dtype: the largest relative error seen (xla, eager, libtorch).
    static HALF_ERRORS: std::cell::RefCell<std::collections::BTreeMap<&'static str, (f64, f64, f64)>> =
        const { std::cell::RefCell::new(std::collections::BTreeMap::new()) };
}

fn report_half_errors() {
    let h = HALF_ERRORS.with(|h| std::mem::take(&mut *h.borrow_mut()));
    for (d, (x, e, t)) in h {
        eprintln!(
            "{} {d}: max relative error vs float64: xla {x:.3e}, eager {e:.3e}, libtorch {t:.3e}",
            std::thread::current().name().unwrap_or("?"),
        );
    }
}

/// Queues a check of `op` in a 16-bit float dtype: `reference` is the float64 result on the
/// same inputs, `torch` libtorch's result in the dtype; the bound follows `rule` (see above).
fn check_derived(name: &str, op: Op, inputs: &[HostTensor], reference: &T, torch: &T, rule: Rule) {
    let d = inputs
        .iter()
        .map(|h| h.ty().dtype)
        .find(|d| d.is_half())
        .expect("a 16-bit float input");
    let bound = Bound::new(d, rule, reference, torch);
    let want = th(torch, d);
    let n = PENDING.with(|p| {
        let mut p = p.borrow_mut();
        p.push(Case {
            name: format!("{name} {d}"),
            op,
            inputs: inputs.to_vec(),
            want,
            tol: Tol::Exact,
            bound: Some(bound),
        });
        p.len()
    });
    if n >= 256 {
        flush();
    }
}

/// The 16-bit float dtypes.
const HALVES: [DType; 2] = [DType::BF16, DType::F16];

// ----- data ------------------------------------------------------------------------------------

fn randn(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    floats(shape, dtype, || r.normal())
}

fn normal(shape: &[usize], dtype: DType, scale: f64, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    floats(shape, dtype, || scale * r.normal())
}

fn uniform(shape: &[usize], dtype: DType, lo: f64, hi: f64, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    floats(shape, dtype, || lo + (hi - lo) * r.uniform())
}

/// Integers of `dtype` in `[lo, hi]` (bools: `lo`/`hi` ignored).
fn ints(shape: &[usize], dtype: DType, lo: i64, hi: i64, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    let n = numel(shape);
    match dtype {
        DType::Bool => host(
            shape,
            &(0..n).map(|_| r.next_u64() & 1 == 1).collect::<Vec<_>>(),
        ),
        DType::U32 => host(
            shape,
            &(0..n).map(|_| r.range(lo, hi) as u32).collect::<Vec<_>>(),
        ),
        DType::I32 => host(
            shape,
            &(0..n).map(|_| r.range(lo, hi) as i32).collect::<Vec<_>>(),
        ),
        DType::I64 => host(shape, &(0..n).map(|_| r.range(lo, hi)).collect::<Vec<_>>()),
        _ => floats(shape, dtype, || r.range(lo, hi) as f64),
    }
}

/// Full-range bit patterns of an integer dtype.
fn bits(shape: &[usize], dtype: DType, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    let n = numel(shape);
    match dtype {
        DType::U32 => host(
            shape,
            &(0..n).map(|_| r.next_u64() as u32).collect::<Vec<_>>(),
        ),
        DType::I32 => host(
            shape,
            &(0..n).map(|_| r.next_u64() as i32).collect::<Vec<_>>(),
        ),
        DType::I64 => host(
            shape,
            &(0..n).map(|_| r.next_u64() as i64).collect::<Vec<_>>(),
        ),
        DType::Bool => ints(shape, dtype, 0, 1, seed),
        d => panic!("bits of {d}"),
    }
}

/// A tch tensor holding the host tensor's values (`U32` in an `Int64` tensor).
fn tt(h: &HostTensor) -> T {
    let dims = h.ty().shape.to_i64();
    let t = match h.ty().dtype {
        DType::Bool => T::from_slice(&h.to_vec::<bool>().unwrap()),
        DType::U32 => T::from_slice(
            &h.to_vec::<u32>()
                .unwrap()
                .into_iter()
                .map(i64::from)
                .collect::<Vec<_>>(),
        ),
        DType::I32 => T::from_slice(&h.to_vec::<i32>().unwrap()),
        DType::I64 => T::from_slice(&h.to_vec::<i64>().unwrap()),
        DType::F32 => T::from_slice(&h.to_vec::<f32>().unwrap()),
        DType::F64 => T::from_slice(&h.to_vec::<f64>().unwrap()),
        // Exact: every bf16 and f16 value is an f32 value.
        DType::BF16 | DType::F16 => T::from_slice(
            &h.to_f64_vec()
                .into_iter()
                .map(|x| x as f32)
                .collect::<Vec<_>>(),
        )
        .to_kind(kind_of(h.ty().dtype)),
    };
    t.reshape(&dims)
}

/// A host tensor of `dtype` from a tch tensor (`U32` read from any integer kind, wrapped).
fn th(t: &T, dtype: DType) -> HostTensor {
    let shape: Vec<usize> = t.size().iter().map(|&d| d as usize).collect();
    let flat = t.contiguous().reshape([-1]);
    match dtype {
        DType::Bool => host(
            &shape,
            &Vec::<bool>::try_from(&flat.to_kind(Kind::Bool)).unwrap(),
        ),
        DType::U32 => host(
            &shape,
            &Vec::<i64>::try_from(&flat.to_kind(Kind::Int64))
                .unwrap()
                .into_iter()
                .map(|x| x as u32)
                .collect::<Vec<_>>(),
        ),
        DType::I32 => host(
            &shape,
            &Vec::<i32>::try_from(&flat.to_kind(Kind::Int)).unwrap(),
        ),
        DType::I64 => host(
            &shape,
            &Vec::<i64>::try_from(&flat.to_kind(Kind::Int64)).unwrap(),
        ),
        DType::F32 => host(
            &shape,
            &Vec::<f32>::try_from(&flat.to_kind(Kind::Float)).unwrap(),
        ),
        DType::F64 => host(
            &shape,
            &Vec::<f64>::try_from(&flat.to_kind(Kind::Double)).unwrap(),
        ),
        // Rounded once from the tensor's values (exact when it already holds `dtype`).
        DType::BF16 | DType::F16 => floats(&shape, dtype, {
            let mut v = Vec::<f64>::try_from(&flat.to_kind(Kind::Double))
                .unwrap()
                .into_iter();
            move || v.next().unwrap()
        }),
    }
}

/// Elementwise reference in Rust over `i64` views of integer values (bools as 0/1).
fn map_ints(out: DType, shape: &[usize], v: Vec<i64>) -> HostTensor {
    match out {
        DType::Bool => host(shape, &v.iter().map(|&x| x != 0).collect::<Vec<_>>()),
        DType::U32 => host(shape, &v.iter().map(|&x| x as u32).collect::<Vec<_>>()),
        DType::I32 => host(shape, &v.iter().map(|&x| x as i32).collect::<Vec<_>>()),
        DType::I64 => host(shape, &v),
        d => panic!("map_ints to {d}"),
    }
}

fn int_values(h: &HostTensor) -> Vec<i64> {
    match h.ty().dtype {
        DType::Bool => h
            .to_vec::<bool>()
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect(),
        DType::U32 => h
            .to_vec::<u32>()
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect(),
        DType::I32 => h
            .to_vec::<i32>()
            .unwrap()
            .into_iter()
            .map(i64::from)
            .collect(),
        DType::I64 => h.to_vec::<i64>().unwrap(),
        d => panic!("int_values of {d}"),
    }
}

/// Replaces some elements by special float values (NaN, ±inf, ±0).
fn with_specials(h: &HostTensor, seed: u64) -> HostTensor {
    let specials = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0];
    let mut r = SplitMix64::mixed(seed);
    let mut v = h.to_f64_vec();
    for (k, s) in specials.iter().enumerate() {
        if k < v.len() {
            let i = (r.next_u64() as usize) % v.len();
            v[i] = *s;
        }
    }
    let shape = h.ty().shape.dims().to_vec();
    floats(&shape, h.ty().dtype, {
        let mut v = v.into_iter();
        move || v.next().unwrap()
    })
}

/// Shapes for elementwise ops: a scalar, a vector and a rank-3 tensor (odd sizes, so vectorised loops
/// have tails). Each case is one XLA kernel (~20 ms to compile here), so shapes are few and the
/// values carry the coverage (specials, extremes).
const SHAPES: [&[usize]; 3] = [&[], &[7], &[2, 3, 5]];
const FLOATS: [DType; 2] = [DType::F32, DType::F64];
const INTS: [DType; 3] = [DType::U32, DType::I32, DType::I64];

// ----- elementwise -----------------------------------------------------------------------------

fn unary_ref(u: UnaryOp, x: &T) -> T {
    match u {
        UnaryOp::Neg => x.neg(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Log1p => x.log1p(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => x.rsqrt(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Logistic => x.sigmoid(),
        UnaryOp::Erf => x.erf(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        // StableHLO: ±0 and NaN are returned unchanged.
        UnaryOp::Sign => x
            .sign()
            .where_self(&x.ne(0.0).logical_and(&x.eq_tensor(x)), x),
        UnaryOp::Not => x.bitwise_not(),
    }
}

#[test]
fn unary_float() {
    let _r = Report;
    use UnaryOp::*;
    let ops = [
        Neg, Abs, Exp, Log, Log1p, Sqrt, Rsqrt, Tanh, Logistic, Erf, Sin, Cos, Floor, Ceil, Sign,
    ];
    for (k, u) in ops.into_iter().enumerate() {
        for d in FLOATS {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s) as u64;
                let x = match u {
                    Log | Sqrt | Rsqrt => uniform(shape, d, 0.01, 20.0, seed),
                    Log1p => uniform(shape, d, -0.99, 20.0, seed),
                    Exp => uniform(shape, d, -20.0, 20.0, seed),
                    _ => normal(shape, d, 3.0, seed),
                };
                let x = if numel(shape) >= 5 {
                    with_specials(&x, seed)
                } else {
                    x
                };
                let want = th(&unary_ref(u, &tt(&x)), d);
                let tol = match u {
                    Sign | Floor | Ceil | Neg | Abs => Tol::Exact,
                    _ => default_tol(d),
                };
                check(u.name(), Op::Unary(u), &[x], &want, tol);
            }
        }
    }
}

#[test]
fn unary_half() {
    let _r = Report;
    use UnaryOp::*;
    let ops = [
        Neg, Abs, Exp, Log, Log1p, Sqrt, Rsqrt, Tanh, Logistic, Erf, Sin, Cos, Floor, Ceil, Sign,
    ];
    for (k, u) in ops.into_iter().enumerate() {
        for d in HALVES {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s) as u64;
                let x = match u {
                    Log | Sqrt | Rsqrt => uniform(shape, d, 0.01, 20.0, seed),
                    Log1p => uniform(shape, d, -0.99, 20.0, seed),
                    // Past 11.1, exp overflows f16: the overflow rule is exercised.
                    Exp => uniform(shape, d, -20.0, 20.0, seed),
                    _ => normal(shape, d, 3.0, seed),
                };
                let x = if numel(shape) >= 5 {
                    with_specials(&x, seed)
                } else {
                    x
                };
                let xt = tt(&x);
                match u {
                    Sign | Floor | Ceil | Neg | Abs => {
                        let want = th(&unary_ref(u, &xt), d);
                        check(u.name(), Op::Unary(u), &[x], &want, Tol::Exact);
                    }
                    _ => check_derived(
                        u.name(),
                        Op::Unary(u),
                        &[x],
                        &unary_ref(u, &xt.to_kind(Kind::Double)),
                        &unary_ref(u, &xt),
                        Rule::Elementwise,
                    ),
                }
            }
        }
    }
}

fn int_unary(u: UnaryOp, d: DType, x: i64) -> i64 {
    macro_rules! go {
        ($t:ty) => {{
            let x = x as $t;
            #[allow(unused_comparisons)]
            let r: $t = match u {
                UnaryOp::Not => !x,
                UnaryOp::Neg => (0 as $t).wrapping_sub(x),
                UnaryOp::Abs => {
                    if x < 0 {
                        (0 as $t).wrapping_sub(x)
                    } else {
                        x
                    }
                }
                UnaryOp::Sign => {
                    if x > 0 {
                        1
                    } else if x == 0 {
                        0
                    } else {
                        (0 as $t).wrapping_sub(1)
                    }
                }
                u => panic!("{u:?} on ints"),
            };
            r as i64
        }};
    }
    match d {
        DType::Bool => (x == 0) as i64,
        DType::U32 => go!(u32),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
        d => panic!("{d}"),
    }
}

#[test]
fn unary_int() {
    let _r = Report;
    let cases = [
        (UnaryOp::Neg, &[DType::I32, DType::I64][..]),
        (UnaryOp::Abs, &[DType::I32, DType::I64]),
        (UnaryOp::Sign, &[DType::I32, DType::I64]),
        (
            UnaryOp::Not,
            &[DType::Bool, DType::U32, DType::I32, DType::I64],
        ),
    ];
    for (k, (u, dtypes)) in cases.into_iter().enumerate() {
        for &d in dtypes {
            for (s, shape) in SHAPES.iter().enumerate() {
                let x = bits(shape, d, (k * 10 + s) as u64);
                let mut v = int_values(&x);
                // The extremes: MIN (whose negation wraps), 0, -1.
                let extremes = match d {
                    DType::I32 => vec![i32::MIN as i64, 0, -1, i32::MAX as i64],
                    DType::I64 => vec![i64::MIN, 0, -1, i64::MAX],
                    DType::U32 => vec![0, u32::MAX as i64],
                    _ => vec![],
                };
                for (i, e) in extremes.into_iter().enumerate() {
                    if i + 1 < v.len() {
                        v[i] = e;
                    }
                }
                let x = map_ints(d, shape, v.clone());
                let want = map_ints(d, shape, v.iter().map(|&a| int_unary(u, d, a)).collect());
                check(u.name(), Op::Unary(u), &[x], &want, Tol::Bits);
            }
        }
    }
}

fn float_binary_ref(b: BinaryOp, x: &T, y: &T) -> T {
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Rem => x.fmod_tensor(y),
        BinaryOp::Pow => x.pow(y),
        BinaryOp::Max => x.maximum(y),
        BinaryOp::Min => x.minimum(y),
        b => panic!("{b:?} on floats"),
    }
}

#[test]
fn binary_float() {
    let _r = Report;
    use BinaryOp::*;
    for (k, b) in [Add, Sub, Mul, Div, Rem, Pow, Max, Min]
        .into_iter()
        .enumerate()
    {
        for d in FLOATS {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s * 10) as u64;
                let (x, y) = match b {
                    Pow => {
                        // Positive bases with any exponent; negative bases with integer ones.
                        let mut r = SplitMix64::mixed(seed);
                        let n = numel(shape);
                        let mut base = Vec::with_capacity(n);
                        let mut exp = Vec::with_capacity(n);
                        for i in 0..n {
                            if i % 2 == 0 {
                                base.push(0.1 + 3.0 * r.uniform());
                                exp.push(2.0 * r.normal());
                            } else {
                                base.push(2.0 * r.normal());
                                exp.push(r.range(-3, 4) as f64);
                            }
                        }
                        let (mut bi, mut ei) = (base.into_iter(), exp.into_iter());
                        (
                            floats(shape, d, || bi.next().unwrap()),
                            floats(shape, d, || ei.next().unwrap()),
                        )
                    }
                    _ => (normal(shape, d, 3.0, seed), normal(shape, d, 2.0, seed + 1)),
                };
                let (x, y) = if numel(shape) >= 5 {
                    (with_specials(&x, seed + 2), with_specials(&y, seed + 3))
                } else {
                    (x, y)
                };
                let want = th(&float_binary_ref(b, &tt(&x), &tt(&y)), d);
                let tol = match b {
                    Max | Min => Tol::Exact,
                    Pow if d == DType::F32 => Tol::Close(1e-5, 1e-5),
                    _ => default_tol(d),
                };
                check(b.name(), Op::Binary(b), &[x, y], &want, tol);
            }
        }
    }
}

#[test]
fn binary_half() {
    let _r = Report;
    use BinaryOp::*;
    for (k, b) in [Add, Sub, Mul, Div, Rem, Pow, Max, Min]
        .into_iter()
        .enumerate()
    {
        for d in HALVES {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s * 10) as u64;
                let (x, y) = match b {
                    // Positive bases (negative ones with real exponents are NaN).
                    Pow => (
                        uniform(shape, d, 0.1, 3.1, seed),
                        normal(shape, d, 2.0, seed + 1),
                    ),
                    _ => (normal(shape, d, 3.0, seed), normal(shape, d, 2.0, seed + 1)),
                };
                let (x, y) = if numel(shape) >= 5 {
                    (with_specials(&x, seed + 2), with_specials(&y, seed + 3))
                } else {
                    (x, y)
                };
                let (xt, yt) = (tt(&x), tt(&y));
                if matches!(b, Max | Min) {
                    let want = th(&float_binary_ref(b, &xt, &yt), d);
                    check(b.name(), Op::Binary(b), &[x, y], &want, Tol::Exact);
                } else {
                    let r =
                        float_binary_ref(b, &xt.to_kind(Kind::Double), &yt.to_kind(Kind::Double));
                    let t = float_binary_ref(b, &xt, &yt);
                    check_derived(b.name(), Op::Binary(b), &[x, y], &r, &t, Rule::Elementwise);
                }
            }
        }
    }
}

/// StableHLO's integer semantics in Rust: wrapping arithmetic; division truncates, `x / 0` is
/// all ones, `x % 0` is `x`, `MIN / -1` is `MIN`, `MIN % -1` is 0; shifts by amounts that are
/// `>=` the bit width (as unsigned) give 0.
fn int_binary(b: BinaryOp, d: DType, x: i64, y: i64) -> i64 {
    macro_rules! go {
        ($t:ty, $u:ty) => {{
            let (x, y) = (x as $t, y as $t);
            let width = <$t>::BITS as $u;
            let r: $t = match b {
                BinaryOp::Add => x.wrapping_add(y),
                BinaryOp::Sub => x.wrapping_sub(y),
                BinaryOp::Mul => x.wrapping_mul(y),
                BinaryOp::Div => {
                    if y == 0 {
                        !0
                    } else {
                        x.wrapping_div(y)
                    }
                }
                BinaryOp::Rem => {
                    if y == 0 {
                        x
                    } else {
                        x.wrapping_rem(y)
                    }
                }
                BinaryOp::Max => x.max(y),
                BinaryOp::Min => x.min(y),
                BinaryOp::And => x & y,
                BinaryOp::Or => x | y,
                BinaryOp::Xor => x ^ y,
                BinaryOp::ShiftLeft => {
                    if y as $u >= width {
                        0
                    } else {
                        x << (y as u32)
                    }
                }
                BinaryOp::ShiftRightLogical => {
                    if y as $u >= width {
                        0
                    } else {
                        ((x as $u) >> (y as u32)) as $t
                    }
                }
                BinaryOp::Pow => panic!("pow on ints"),
            };
            r as i64
        }};
    }
    match d {
        DType::Bool => match b {
            BinaryOp::And => x & y,
            BinaryOp::Or => x | y,
            BinaryOp::Xor => x ^ y,
            b => panic!("{b:?} on bool"),
        },
        DType::U32 => go!(u32, u32),
        DType::I32 => go!(i32, u32),
        DType::I64 => go!(i64, u64),
        d => panic!("{d}"),
    }
}

#[test]
fn binary_int() {
    let _r = Report;
    use BinaryOp::*;
    let ops = [
        Add,
        Sub,
        Mul,
        Div,
        Rem,
        Max,
        Min,
        And,
        Or,
        Xor,
        ShiftLeft,
        ShiftRightLogical,
    ];
    for (k, b) in ops.into_iter().enumerate() {
        for d in INTS {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s * 10) as u64;
                let width = (d.size_in_bytes() * 8) as i64;
                let (x, y) = match b {
                    Div | Rem => {
                        // Small magnitudes (incl. zero divisors) and the MIN / -1 overflow.
                        let lo = if d == DType::U32 { 0 } else { -9 };
                        let x = ints(shape, d, 3 * lo, 30, seed);
                        let y = ints(shape, d, lo, 9, seed + 1);
                        let (mut xv, mut yv) = (int_values(&x), int_values(&y));
                        if xv.len() >= 3 {
                            let min = match d {
                                DType::I32 => i32::MIN as i64,
                                DType::I64 => i64::MIN,
                                _ => u32::MAX as i64,
                            };
                            xv[0] = min;
                            yv[0] = if d == DType::U32 { 7 } else { -1 };
                            xv[1] = min;
                            yv[1] = 0;
                            yv[2] = 0;
                        }
                        (map_ints(d, shape, xv), map_ints(d, shape, yv))
                    }
                    ShiftLeft | ShiftRightLogical => {
                        let lo = if d == DType::U32 { 0 } else { -3 };
                        (
                            bits(shape, d, seed),
                            ints(shape, d, lo, width + 4, seed + 1),
                        )
                    }
                    _ => (bits(shape, d, seed), bits(shape, d, seed + 1)),
                };
                let (xv, yv) = (int_values(&x), int_values(&y));
                let want = map_ints(
                    d,
                    shape,
                    xv.iter()
                        .zip(&yv)
                        .map(|(&a, &c)| int_binary(b, d, a, c))
                        .collect(),
                );
                check(b.name(), Op::Binary(b), &[x, y], &want, Tol::Bits);
            }
        }
    }
    for b in [And, Or, Xor] {
        for (s, shape) in SHAPES.iter().enumerate() {
            let x = bits(shape, DType::Bool, s as u64);
            let y = bits(shape, DType::Bool, 50 + s as u64);
            let (xv, yv) = (int_values(&x), int_values(&y));
            let want = map_ints(
                DType::Bool,
                shape,
                xv.iter()
                    .zip(&yv)
                    .map(|(&a, &c)| int_binary(b, DType::Bool, a, c))
                    .collect(),
            );
            check(b.name(), Op::Binary(b), &[x, y], &want, Tol::Bits);
        }
    }
}

#[test]
fn compare_all_dtypes() {
    let _r = Report;
    use CompareOp::*;
    for (k, c) in [Eq, Ne, Lt, Le, Gt, Ge].into_iter().enumerate() {
        for d in DType::ALL {
            for (s, shape) in SHAPES.iter().enumerate() {
                let seed = (k * 100 + s * 10) as u64;
                // Few distinct values so that equality occurs; u32 values above 2^31 (unsigned!).
                let (x, y) = match d {
                    d if d.is_float() => {
                        let x = ints(shape, d, -2, 2, seed);
                        let y = ints(shape, d, -2, 2, seed + 1);
                        if numel(shape) >= 5 {
                            (with_specials(&x, seed), with_specials(&y, seed + 1))
                        } else {
                            (x, y)
                        }
                    }
                    DType::U32 => {
                        let mut r = SplitMix64::mixed(seed);
                        let pick = [0u32, 1, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFF];
                        let mut gen = || {
                            (0..numel(shape))
                                .map(|_| pick[(r.next_u64() % 5) as usize])
                                .collect::<Vec<_>>()
                        };
                        (host(shape, &gen()), host(shape, &gen()))
                    }
                    DType::Bool => (bits(shape, d, seed), bits(shape, d, seed + 1)),
                    _ => (ints(shape, d, -2, 2, seed), ints(shape, d, -2, 2, seed + 1)),
                };
                let want = if d.is_float() {
                    let (a, b) = (tt(&x), tt(&y));
                    let r = match c {
                        Eq => a.eq_tensor(&b),
                        Ne => a.ne_tensor(&b),
                        Lt => a.lt_tensor(&b),
                        Le => a.le_tensor(&b),
                        Gt => a.gt_tensor(&b),
                        Ge => a.ge_tensor(&b),
                    };
                    th(&r, DType::Bool)
                } else {
                    let (xv, yv) = (int_values(&x), int_values(&y));
                    let v = xv
                        .iter()
                        .zip(&yv)
                        .map(|(a, b)| {
                            (match c {
                                Eq => a == b,
                                Ne => a != b,
                                Lt => a < b,
                                Le => a <= b,
                                Gt => a > b,
                                Ge => a >= b,
                            }) as i64
                        })
                        .collect();
                    map_ints(DType::Bool, shape, v)
                };
                check(c.name(), Op::Compare(c), &[x, y], &want, Tol::Bits);
            }
        }
    }
}

#[test]
fn select() {
    let _r = Report;
    for d in DType::ALL {
        for (s, shape) in SHAPES.iter().enumerate() {
            let p = bits(shape, DType::Bool, s as u64);
            let (a, b) = match d {
                d if d.is_float() => (randn(shape, d, 1), randn(shape, d, 2)),
                _ => (bits(shape, d, 3), bits(shape, d, 4)),
            };
            let want = th(&tt(&a).where_self(&tt(&p), &tt(&b)), d);
            check("select", Op::Select, &[p, a, b], &want, Tol::Bits);
        }
    }
}

/// Conversion reference: Rust's `as` casts, which are what StableHLO/XLA specify: float to
/// integer truncates toward zero and saturates (NaN gives 0), integer to integer wraps, to bool
/// is `!= 0` (NaN is true), from bool is 0/1, between floats rounds to nearest.
fn convert_ref(x: &HostTensor, to: DType) -> HostTensor {
    let shape = x.ty().shape.dims().to_vec();
    let from = x.ty().dtype;
    if from.is_float() {
        let v = x.to_f64_vec();
        match to {
            DType::Bool => host(&shape, &v.iter().map(|&a| a != 0.0).collect::<Vec<_>>()),
            DType::U32 => host(&shape, &v.iter().map(|&a| a as u32).collect::<Vec<_>>()),
            DType::I32 => host(&shape, &v.iter().map(|&a| a as i32).collect::<Vec<_>>()),
            DType::I64 => host(&shape, &v.iter().map(|&a| a as i64).collect::<Vec<_>>()),
            // Rounded once (from f64, which holds every source value exactly).
            d => floats(&shape, d, {
                let mut v = v.into_iter();
                move || v.next().unwrap()
            }),
        }
    } else {
        let v = int_values(x);
        match to {
            DType::F32 => host(&shape, &v.iter().map(|&a| a as f32).collect::<Vec<_>>()),
            DType::F64 => host(&shape, &v.iter().map(|&a| a as f64).collect::<Vec<_>>()),
            // Through f64: a second rounding only for integers beyond 2^53 that land on a
            // 16-bit midpoint (none in this data).
            d if d.is_float() => floats(&shape, d, {
                let mut v = v.into_iter();
                move || v.next().unwrap() as f64
            }),
            _ => map_ints(to, &shape, v),
        }
    }
}

#[test]
fn convert_all_pairs() {
    let _r = Report;
    let specials = [
        0.5,
        -0.5,
        -1.5,
        2.7,
        -2.7,
        3e9,
        -3e9,
        4.5e9,
        2147483648.0,
        -2147483648.0,
        2147483520.0,
        1e19,
        -1e19,
        9.3e18,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        255.9,
    ];
    for from in DType::ALL {
        for to in DType::ALL {
            if from == to {
                continue;
            }
            for (s, shape) in [&[][..], &[4, 5]].iter().enumerate() {
                let seed = s as u64 * 7 + from as u64 * 100 + to as u64;
                let x = match from {
                    d if d.is_float() => {
                        let mut r = SplitMix64::mixed(seed);
                        let mut k = 0;
                        floats(shape, from, || {
                            k += 1;
                            if numel(shape) > 1 && k <= specials.len() {
                                specials[k - 1]
                            } else {
                                10.0 * r.normal()
                            }
                        })
                    }
                    _ => bits(shape, from, seed),
                };
                let want = convert_ref(&x, to);
                check(
                    &format!("convert {from}->{to}"),
                    Op::Convert(to),
                    &[x],
                    &want,
                    Tol::Exact,
                );
            }
        }
    }
}

// ----- data movement ---------------------------------------------------------------------------

fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// Reference for pure data movement, on raw bytes (exact for every dtype): output element
/// `idx` is element `src(idx) = Some((operand, index))` of `operands`, or `fill` when `None`.
fn gather_ref(
    operands: &[&HostTensor],
    fill: Option<&HostTensor>,
    out_shape: &[usize],
    src: impl Fn(&[usize]) -> Option<(usize, Vec<usize>)>,
) -> HostTensor {
    let d = operands[0].ty().dtype;
    let s = d.size_in_bytes();
    let mut bytes = Vec::with_capacity(numel(out_shape) * s);
    for i in 0..numel(out_shape) {
        match src(&unravel(i, out_shape)) {
            Some((k, idx)) => {
                let o = operands[k];
                let j = ravel(&idx, o.ty().shape.dims());
                bytes.extend_from_slice(&o.bytes()[j * s..(j + 1) * s]);
            }
            None => bytes.extend_from_slice(fill.expect("fill value").bytes()),
        }
    }
    HostTensor::from_bytes(TensorType::new(d, out_shape), bytes).unwrap()
}

/// Random data of any dtype (normal floats, full-range integers, random bools).
fn any_data(shape: &[usize], d: DType, seed: u64) -> HostTensor {
    if d.is_float() {
        randn(shape, d, seed)
    } else {
        bits(shape, d, seed)
    }
}

fn scalar_of(d: DType, seed: u64) -> HostTensor {
    any_data(&[], d, seed)
}

#[test]
fn constant_and_iota() {
    let _r = Report;
    for d in DType::ALL {
        for (s, shape) in [&[][..], &[4], &[2, 3]].iter().enumerate() {
            // Non-splat random values (bit patterns for integers: u32 above 2^31, i64 extremes).
            let data = any_data(shape, d, 40 + s as u64);
            let lit = Literal::from_bytes(data.ty().clone(), data.bytes().to_vec()).unwrap();
            check("constant", Op::Constant(lit), &[], &data, Tol::Exact);
            // Splat.
            let one = scalar_of(d, 7);
            let splat = gather_ref(&[&one], None, shape, |_| Some((0, vec![])));
            let lit = Literal::from_bytes(splat.ty().clone(), splat.bytes().to_vec()).unwrap();
            check("constant splat", Op::Constant(lit), &[], &splat, Tol::Exact);
        }
        if d == DType::Bool {
            continue;
        }
        for (shape, dim) in [
            (&[5][..], 0),
            (&[2, 3, 4], 0),
            (&[2, 3, 4], 1),
            (&[2, 3, 4], 2),
        ] {
            let v: Vec<i64> = (0..numel(shape))
                .map(|i| unravel(i, shape)[dim] as i64)
                .collect();
            let want = convert_ref(&map_ints(DType::I64, shape, v), d);
            let ty = TensorType::new(d, shape);
            check("iota", Op::Iota { ty, dim }, &[], &want, Tol::Exact);
        }
    }
}

#[test]
fn broadcast() {
    let _r = Report;
    let cases: [(&[usize], &[usize], &[usize]); 6] = [
        (&[], &[2, 3], &[]),
        (&[3], &[2, 3], &[1]),
        (&[2], &[2, 3], &[0]),
        (&[3, 1], &[3, 4], &[0, 1]),
        (&[2, 3], &[2, 4, 3], &[0, 2]),
        (&[1, 3, 1], &[2, 3, 4], &[0, 1, 2]),
    ];
    for d in [DType::F32, DType::I64, DType::Bool, DType::U32, DType::BF16] {
        for (k, &(from, to, dims)) in cases.iter().enumerate() {
            let x = any_data(from, d, k as u64);
            let want = gather_ref(&[&x], None, to, |o| {
                Some((
                    0,
                    dims.iter()
                        .enumerate()
                        .map(|(i, &dd)| if from[i] == 1 { 0 } else { o[dd] })
                        .collect(),
                ))
            });
            let op = Op::Broadcast {
                shape: Shape::new(to),
                dims: dims.to_vec(),
            };
            check("broadcast", op, &[x], &want, Tol::Exact);
        }
    }
}

fn reshape_case(x: &HostTensor, to: &[usize]) {
    // Row-major data is unchanged by a reshape.
    let want =
        HostTensor::from_bytes(TensorType::new(x.ty().dtype, to), x.bytes().to_vec()).unwrap();
    check(
        "reshape",
        Op::Reshape(Shape::new(to)),
        std::slice::from_ref(x),
        &want,
        Tol::Exact,
    );
}

fn transpose_ref(x: &HostTensor, perm: &[usize]) -> HostTensor {
    let dims = x.ty().shape.dims();
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    gather_ref(&[x], None, &out, |o| {
        let mut idx = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            idx[p] = o[i];
        }
        Some((0, idx))
    })
}

fn slice_ref(x: &HostTensor, start: &[usize], limit: &[usize], stride: &[usize]) -> HostTensor {
    let out: Vec<usize> = (0..start.len())
        .map(|i| (limit[i] - start[i]).div_ceil(stride[i]))
        .collect();
    gather_ref(&[x], None, &out, |o| {
        Some((
            0,
            (0..o.len()).map(|i| start[i] + o[i] * stride[i]).collect(),
        ))
    })
}

#[test]
fn reshape_transpose_slice_reverse() {
    let _r = Report;
    for d in [DType::F32, DType::I32, DType::Bool, DType::F16] {
        let x = any_data(&[2, 3, 4], d, 1);
        for to in [&[24][..], &[4, 6], &[2, 1, 12, 1], &[4, 3, 2]] {
            reshape_case(&x, to);
        }
        reshape_case(&any_data(&[], d, 2), &[1, 1]);
        reshape_case(&any_data(&[1, 1], d, 3), &[]);
        for perm in [&[0, 1, 2][..], &[2, 0, 1], &[1, 0, 2], &[2, 1, 0]] {
            let want = transpose_ref(&x, perm);
            check(
                "transpose",
                Op::Transpose(perm.to_vec()),
                std::slice::from_ref(&x),
                &want,
                Tol::Exact,
            );
        }
        let slices: [(&[usize], &[usize], &[usize]); 4] = [
            (&[0, 0, 0], &[2, 3, 4], &[1, 1, 1]),
            (&[1, 0, 1], &[2, 3, 4], &[1, 2, 2]),
            (&[0, 1, 0], &[1, 3, 3], &[2, 1, 3]),
            (&[0, 2, 3], &[2, 2, 4], &[1, 1, 1]),
        ];
        for (start, limit, stride) in slices {
            let want = slice_ref(&x, start, limit, stride);
            let op = Op::Slice {
                start: start.to_vec(),
                limit: limit.to_vec(),
                stride: stride.to_vec(),
            };
            check("slice", op, std::slice::from_ref(&x), &want, Tol::Exact);
        }
        for dims in [&[][..], &[0], &[2], &[0, 1, 2]] {
            let want = gather_ref(&[&x], None, &[2, 3, 4], |o| {
                let mut idx = o.to_vec();
                for &k in dims {
                    idx[k] = [2, 3, 4][k] - 1 - o[k];
                }
                Some((0, idx))
            });
            check(
                "reverse",
                Op::Reverse(dims.to_vec()),
                std::slice::from_ref(&x),
                &want,
                Tol::Exact,
            );
        }
    }
}

#[test]
fn concat() {
    let _r = Report;
    for d in [DType::F64, DType::U32, DType::Bool, DType::BF16] {
        for axis in 0..3 {
            let shapes: Vec<Vec<usize>> = (0..3)
                .map(|k| {
                    let mut s = vec![2, 3, 2];
                    s[axis] = k + 1;
                    s
                })
                .collect();
            let xs: Vec<HostTensor> = shapes
                .iter()
                .enumerate()
                .map(|(k, s)| any_data(s, d, k as u64 + 10))
                .collect();
            let mut out = vec![2, 3, 2];
            out[axis] = 6;
            let refs: Vec<&HostTensor> = xs.iter().collect();
            let want = gather_ref(&refs, None, &out, |o| {
                // Operand k covers [k(k+1)/2, (k+1)(k+2)/2) along the axis.
                let mut p = o[axis];
                for k in 0..3 {
                    if p < k + 1 {
                        let mut idx = o.to_vec();
                        idx[axis] = p;
                        return Some((k, idx));
                    }
                    p -= k + 1;
                }
                unreachable!()
            });
            check("concat", Op::Concat { axis }, &xs, &want, Tol::Exact);
        }
    }
    // One operand, and rank 1.
    let x = any_data(&[5], DType::F32, 3);
    check(
        "concat",
        Op::Concat { axis: 0 },
        std::slice::from_ref(&x),
        &x,
        Tol::Exact,
    );
    // More operands than a byte can number (operand positions were once `u8`).
    let xs: Vec<HostTensor> = (0..300)
        .map(|k| any_data(&[2, 1], DType::I32, 100 + k))
        .collect();
    let refs: Vec<&HostTensor> = xs.iter().collect();
    let want = gather_ref(&refs, None, &[2, 300], |o| Some((o[1], vec![o[0], 0])));
    check("concat300", Op::Concat { axis: 1 }, &xs, &want, Tol::Exact);
}

fn pad_ref(
    x: &HostTensor,
    v: &HostTensor,
    low: &[i64],
    high: &[i64],
    interior: &[usize],
) -> HostTensor {
    let dims = x.ty().shape.dims().to_vec();
    let out: Vec<usize> = (0..dims.len())
        .map(|i| {
            let n = dims[i] as i64;
            let inner = if n == 0 {
                0
            } else {
                n + (n - 1) * interior[i] as i64
            };
            (inner + low[i] + high[i]) as usize
        })
        .collect();
    gather_ref(&[x], Some(v), &out, |o| {
        let mut idx = Vec::with_capacity(o.len());
        for i in 0..o.len() {
            let p = o[i] as i64 - low[i];
            let step = interior[i] as i64 + 1;
            if p < 0 || p % step != 0 || p / step >= dims[i] as i64 {
                return None;
            }
            idx.push((p / step) as usize);
        }
        Some((0, idx))
    })
}

#[test]
fn pad() {
    let _r = Report;
    type PadCase<'a> = (&'a [usize], &'a [i64], &'a [i64], &'a [usize]);
    let cases: [PadCase; 7] = [
        (&[3], &[2], &[1], &[0]),
        (&[2, 3], &[1, 0], &[0, 2], &[0, 0]),
        (&[5], &[-1], &[-2], &[0]),
        (&[4, 3], &[-1, 1], &[2, -1], &[0, 0]),
        (&[3, 2], &[0, 0], &[0, 0], &[2, 1]),
        (&[3, 4], &[1, -2], &[-1, 3], &[1, 2]),
        (&[2, 2, 3], &[0, 1, -1], &[1, 0, 0], &[1, 0, 1]),
    ];
    for d in [DType::F32, DType::I64, DType::U32, DType::Bool, DType::F16] {
        for (k, &(shape, low, high, interior)) in cases.iter().enumerate() {
            let x = any_data(shape, d, k as u64);
            // i64 extremes as padding values must survive exactly.
            let v = match d {
                DType::I64 => host(&[], &[i64::MAX - k as i64]),
                _ => scalar_of(d, 100 + k as u64),
            };
            let want = pad_ref(&x, &v, low, high, interior);
            let op = Op::Pad {
                low: low.to_vec(),
                high: high.to_vec(),
                interior: interior.to_vec(),
            };
            check("pad", op, &[x, v], &want, Tol::Exact);
        }
    }
}

// ----- contractions and reductions -------------------------------------------------------------

fn dd(lb: &[usize], rb: &[usize], lc: &[usize], rc: &[usize]) -> DotDims {
    DotDims::new(lb, rb, lc, rc)
}

#[test]
fn dot_general() {
    let _r = Report;
    type DotCase<'a> = (&'a [usize], &'a [usize], DotDims, &'a str);
    let cases: Vec<DotCase> = vec![
        (&[3, 4], &[4, 5], dd(&[], &[], &[1], &[0]), "ij,jk->ik"),
        (&[4], &[4], dd(&[], &[], &[0], &[0]), "i,i->"),
        (&[3, 4], &[4], dd(&[], &[], &[1], &[0]), "ij,j->i"),
        (&[3], &[4], dd(&[], &[], &[], &[]), "i,j->ij"),
        (&[4, 3], &[4, 5], dd(&[], &[], &[0], &[0]), "ji,jk->ik"),
        (
            &[2, 3, 4],
            &[2, 4, 5],
            dd(&[0], &[0], &[2], &[1]),
            "bij,bjk->bik",
        ),
        // Batch dims that are not leading; result is batch, lhs free, rhs free.
        (
            &[3, 2, 4],
            &[4, 5, 2],
            dd(&[1], &[2], &[2], &[0]),
            "ibj,jkb->bik",
        ),
        (
            &[2, 3, 4],
            &[3, 4, 5],
            dd(&[], &[], &[1, 2], &[0, 1]),
            "ijk,jkl->il",
        ),
        // The same contraction with the pairs listed in the other order.
        (
            &[2, 3, 4],
            &[3, 4, 5],
            dd(&[], &[], &[2, 1], &[1, 0]),
            "ijk,jkl->il",
        ),
        (
            &[2, 2, 3, 4],
            &[2, 2, 4, 5],
            dd(&[0, 1], &[0, 1], &[3], &[2]),
            "abij,abjk->abik",
        ),
        (&[2, 3], &[2, 3], dd(&[0], &[0], &[1], &[1]), "bi,bi->b"),
    ];
    for d in DType::ALL {
        if d == DType::Bool {
            continue;
        }
        for (k, (ls, rs, dims, eq)) in cases.iter().enumerate() {
            if d.is_half() {
                let (a, b) = (randn(ls, d, k as u64), randn(rs, d, 50 + k as u64));
                let ein = |kind: Kind| {
                    T::einsum(
                        eq,
                        &[tt(&a).to_kind(kind), tt(&b).to_kind(kind)],
                        None::<&[i64]>,
                    )
                };
                let (r, t) = (ein(Kind::Double), ein(kind_of(d)));
                let op = Op::DotGeneral(dims.clone());
                check_derived("dot_general", op, &[a, b], &r, &t, Rule::Normwise);
                continue;
            }
            let (a, b) = if d.is_float() {
                (randn(ls, d, k as u64), randn(rs, d, 50 + k as u64))
            } else {
                // Full-range integers: products and sums wrap.
                (bits(ls, d, k as u64), bits(rs, d, 50 + k as u64))
            };
            let want = if d.is_float() {
                let r = T::einsum(
                    eq,
                    &[tt(&a).to_kind(Kind::Double), tt(&b).to_kind(Kind::Double)],
                    None::<&[i64]>,
                );
                th(&r, d)
            } else {
                // Int64 arithmetic wraps modulo 2^64; the low bits are the wrapped result.
                let r = T::einsum(
                    eq,
                    &[tt(&a).to_kind(Kind::Int64), tt(&b).to_kind(Kind::Int64)],
                    None::<&[i64]>,
                );
                th(&r, d)
            };
            let tol = match d {
                DType::F32 => Tol::Close(1e-5, 1e-5),
                _ => default_tol(d),
            };
            check(
                "dot_general",
                Op::DotGeneral(dims.clone()),
                &[a, b],
                &want,
                tol,
            );
        }
    }
}

#[test]
fn reduce() {
    let _r = Report;
    use ReduceKind::*;
    let shape = [2, 3, 4];
    for d in [DType::F32, DType::F64, DType::I32, DType::I64, DType::U32] {
        for (k, kind) in [Sum, Max, Min].into_iter().enumerate() {
            for (j, axes) in [&[0][..], &[1], &[2], &[0, 2], &[0, 1, 2], &[]]
                .iter()
                .enumerate()
            {
                let seed = (k * 10 + j) as u64;
                let x = if d.is_float() {
                    // NaN must propagate through max and min; ±inf through all three.
                    let x = randn(&shape, d, seed);
                    if j % 2 == 0 {
                        with_specials(&x, seed)
                    } else {
                        x
                    }
                } else {
                    bits(&shape, d, seed)
                };
                let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
                let t = if d.is_float() {
                    tt(&x).to_kind(Kind::Double)
                } else {
                    tt(&x)
                };
                let r = if axes.is_empty() {
                    t
                } else {
                    match kind {
                        Sum => t.sum_dim_intlist(ax.as_slice(), false, None::<Kind>),
                        Max => t.amax(ax.as_slice(), false),
                        Min => t.amin(ax.as_slice(), false),
                    }
                };
                let want = th(&r, d);
                let op = Op::Reduce {
                    kind,
                    axes: axes.to_vec(),
                };
                check(
                    &format!("reduce {}", kind.name()),
                    op,
                    &[x],
                    &want,
                    default_tol(d),
                );
            }
        }
    }
    // Reductions over nothing give the identity.
    for d in [DType::F32, DType::I64, DType::U32] {
        for kind in [Sum, Max, Min] {
            let x = any_data(&[0, 3], d, 1);
            let id = match (kind, d) {
                (Sum, _) => 0.0,
                (Max, DType::F32) => f64::NEG_INFINITY,
                (Min, DType::F32) => f64::INFINITY,
                (Max, DType::I64) => i64::MIN as f64,
                (Min, DType::I64) => i64::MAX as f64,
                (Max, _) => 0.0,
                (Min, _) => u32::MAX as f64,
            };
            let want = convert_ref(&host(&[3], &[id; 3]), d);
            let op = Op::Reduce {
                kind,
                axes: vec![0],
            };
            check("reduce of empty", op, &[x], &want, Tol::Exact);
        }
    }
}

#[test]
fn reduce_half() {
    let _r = Report;
    use ReduceKind::*;
    // Longer rows than `reduce` uses: a sum of 64 terms in bf16 shows whether it accumulates
    // in the narrow type.
    let shape = [3, 4, 64];
    for d in HALVES {
        for (k, kind) in [Sum, Max, Min].into_iter().enumerate() {
            for (j, axes) in [&[0][..], &[2], &[0, 2], &[0, 1, 2]].iter().enumerate() {
                let seed = (k * 10 + j) as u64;
                let x = randn(&shape, d, seed);
                let x = if j % 2 == 0 {
                    with_specials(&x, seed)
                } else {
                    x
                };
                let ax: Vec<i64> = axes.iter().map(|&a| a as i64).collect();
                let op = Op::Reduce {
                    kind,
                    axes: axes.to_vec(),
                };
                let name = format!("reduce {}", kind.name());
                let xt = tt(&x);
                match kind {
                    Sum => {
                        let sum = |t: T| t.sum_dim_intlist(ax.as_slice(), false, None::<Kind>);
                        let (r, t) = (sum(xt.to_kind(Kind::Double)), sum(xt));
                        check_derived(&name, op, &[x], &r, &t, Rule::Normwise);
                    }
                    // Exact in any dtype.
                    Max => check(
                        &name,
                        op,
                        &[x],
                        &th(&xt.amax(ax.as_slice(), false), d),
                        Tol::Exact,
                    ),
                    Min => check(
                        &name,
                        op,
                        &[x],
                        &th(&xt.amin(ax.as_slice(), false), d),
                        Tol::Exact,
                    ),
                }
            }
        }
        for kind in [Sum, Max, Min] {
            let x = any_data(&[0, 3], d, 1);
            let id = match kind {
                Sum => 0.0,
                Max => f64::NEG_INFINITY,
                Min => f64::INFINITY,
            };
            let want = convert_ref(&host(&[3], &[id; 3]), d);
            let op = Op::Reduce {
                kind,
                axes: vec![0],
            };
            check("reduce of empty", op, &[x], &want, Tol::Exact);
        }
    }
}

// ----- windows ---------------------------------------------------------------------------------

fn wa(window: &[usize], strides: &[usize], padding: &[(usize, usize)]) -> WindowAttrs {
    WindowAttrs {
        window: window.to_vec(),
        strides: strides.to_vec(),
        padding: padding.to_vec(),
    }
}

/// `constant_pad_nd` arguments for the spatial dims (last dim first).
fn spatial_pads<P: Copy + Into<i64>>(padding: &[(P, P)]) -> Vec<i64> {
    padding
        .iter()
        .rev()
        .flat_map(|&(l, h)| [l.into(), h.into()])
        .collect()
}

fn window_cases() -> Vec<(Vec<usize>, WindowAttrs)> {
    vec![
        (vec![2, 3, 10], wa(&[3], &[2], &[(1, 1)])),
        (vec![1, 2, 9], wa(&[4], &[1], &[(0, 0)])),
        (vec![2, 2, 7, 6], wa(&[3, 2], &[2, 1], &[(1, 0), (0, 1)])),
        (vec![1, 3, 5, 5], wa(&[2, 2], &[2, 2], &[(0, 1), (0, 1)])),
        // The first row of windows lies entirely in the padding.
        (vec![1, 1, 3, 3], wa(&[2, 2], &[1, 1], &[(2, 0), (0, 0)])),
        (
            vec![1, 2, 5, 4, 6],
            wa(&[2, 2, 3], &[1, 2, 2], &[(0, 1), (1, 0), (1, 1)]),
        ),
    ]
}

/// torch max pooling (with indices) over 1-3 spatial dims, no padding, `f64`.
fn max_pool(x: &T, w: &WindowAttrs) -> (T, T) {
    let k: Vec<i64> = w.window.iter().map(|&v| v as i64).collect();
    let s: Vec<i64> = w.strides.iter().map(|&v| v as i64).collect();
    let z = vec![0i64; k.len()];
    let one = vec![1i64; k.len()];
    match k.len() {
        1 => x.max_pool1d_with_indices(&k, &s, &z, &one, false),
        2 => x.max_pool2d_with_indices(&k, &s, &z, &one, false),
        _ => x.max_pool3d_with_indices(&k, &s, &z, &one, false),
    }
}

fn sum_pool(x: &T, w: &WindowAttrs) -> T {
    let k: Vec<i64> = w.window.iter().map(|&v| v as i64).collect();
    let s: Vec<i64> = w.strides.iter().map(|&v| v as i64).collect();
    let z = vec![0i64; k.len()];
    let avg = match k.len() {
        1 => x.avg_pool1d(&k, &s, &z, false, true),
        2 => x.avg_pool2d(&k, &s, &z, false, true, None),
        _ => x.avg_pool3d(&k, &s, &z, false, true, None),
    };
    avg * (k.iter().product::<i64>() as f64)
}

#[test]
fn reduce_window() {
    let _r = Report;
    use ReduceKind::*;
    for (c, (shape, w)) in window_cases().into_iter().enumerate() {
        // f32 on every geometry; the other dtypes on a 2-D and a 3-D one (each case is an XLA
        // kernel to compile).
        for d in [
            DType::F32,
            DType::F64,
            DType::I32,
            DType::I64,
            DType::U32,
            DType::BF16,
            DType::F16,
        ] {
            if d != DType::F32 && c != 2 && c != 5 {
                continue;
            }
            let x = if d.is_float() {
                with_specials(&randn(&shape, d, c as u64), c as u64)
            } else {
                ints(&shape, d, 0, 50, c as u64)
            };
            for kind in [Sum, Max, Min] {
                // Reference in f64 with the identity as padding, then converted (saturating, so
                // ±inf windows of pure padding become the integer identities).
                let (fill, sign) = match kind {
                    Sum => (0.0, 1.0),
                    Max => (f64::NEG_INFINITY, 1.0),
                    Min => (f64::NEG_INFINITY, -1.0),
                };
                let xt = tt(&x).to_kind(Kind::Double) * sign;
                let xp = xt.constant_pad_nd(spatial_pads(
                    &w.padding
                        .iter()
                        .map(|&(l, h)| (l as i64, h as i64))
                        .collect::<Vec<_>>(),
                ));
                // constant_pad_nd pads with zeros: mark the padding through a second pass.
                let mask = tt(&x)
                    .ones_like()
                    .to_kind(Kind::Double)
                    .constant_pad_nd(spatial_pads(
                        &w.padding
                            .iter()
                            .map(|&(l, h)| (l as i64, h as i64))
                            .collect::<Vec<_>>(),
                    ));
                let xp = xp.where_self(&mask.ne(0.0), &xp.full_like(fill));
                let r = match kind {
                    Sum => sum_pool(&xp, &w),
                    _ => max_pool(&xp, &w).0 * sign,
                };
                let op = Op::ReduceWindow {
                    kind,
                    attrs: w.clone(),
                };
                if d.is_half() && kind == Sum {
                    // libtorch in the dtype: the same padded average pool times the window
                    // size (one more rounding than a plain sum: part of libtorch's error).
                    // libtorch has no bf16/f16 avg_pool3d on CPU: there it pools in f32 and
                    // rounds once.
                    let t = if w.window.len() == 3 {
                        sum_pool(&xp.to_kind(Kind::Float), &w).to_kind(kind_of(d))
                    } else {
                        sum_pool(&xp.to_kind(kind_of(d)), &w)
                    };
                    let x = std::slice::from_ref(&x);
                    check_derived("reduce_window sum", op, x, &r, &t, Rule::Normwise);
                    continue;
                }
                let want = convert_ref(&th(&r, DType::F64), d);
                let tol = match d {
                    DType::F32 => Tol::Close(1e-5, 1e-5),
                    _ => default_tol(d),
                };
                check(
                    &format!("reduce_window {}", kind.name()),
                    op,
                    std::slice::from_ref(&x),
                    &want,
                    tol,
                );
            }
        }
    }
}

#[test]
fn select_and_scatter() {
    let _r = Report;
    for (c, (shape, w)) in window_cases().into_iter().enumerate() {
        for d in [DType::F32, DType::F64, DType::I32, DType::BF16, DType::F16] {
            if d != DType::F32 && c != 3 && c != 5 {
                continue;
            }
            // Small integer values: many ties, which must go to the first maximum.
            let x = ints(&shape, d, -2, 2, c as u64);
            let pads: Vec<(i64, i64)> = w
                .padding
                .iter()
                .map(|&(l, h)| (l as i64, h as i64))
                .collect();
            let xt = tt(&x).to_kind(Kind::Double);
            let mask = xt.ones_like().constant_pad_nd(spatial_pads(&pads));
            let xp = xt.constant_pad_nd(spatial_pads(&pads));
            let xp = xp.where_self(&mask.ne(0.0), &xp.full_like(f64::NEG_INFINITY));
            let (pooled, idx) = max_pool(&xp, &w);
            let pshape: Vec<usize> = pooled.size().iter().map(|&v| v as usize).collect();
            let src = if d.is_float() {
                randn(&pshape, d, 9 + c as u64)
            } else {
                ints(&pshape, d, -5, 5, 9 + c as u64)
            };
            // Scatter-add the source at torch's argmax positions in the padded input, then crop
            // the padding (a window of pure padding selects nothing: its source is dropped).
            let (n, ch) = (shape[0] as i64, shape[1] as i64);
            let psize = xp.size();
            let grad = xp
                .zeros_like()
                .reshape([n, ch, -1])
                .scatter_add(
                    2,
                    &idx.reshape([n, ch, -1]),
                    &tt(&src).to_kind(Kind::Double).reshape([n, ch, -1]),
                )
                .reshape(&psize);
            let mut g = grad;
            for (k, &(lo, _)) in pads.iter().enumerate() {
                g = g.narrow(k as i64 + 2, lo, shape[k + 2] as i64);
            }
            if d.is_half() {
                // libtorch in the dtype: the same scatter-add of the narrow source.
                let mut t = xp
                    .zeros_like()
                    .to_kind(kind_of(d))
                    .reshape([n, ch, -1])
                    .scatter_add(2, &idx.reshape([n, ch, -1]), &tt(&src).reshape([n, ch, -1]))
                    .reshape(&psize);
                for (k, &(lo, _)) in pads.iter().enumerate() {
                    t = t.narrow(k as i64 + 2, lo, shape[k + 2] as i64);
                }
                let op = Op::SelectAndScatter(w.clone());
                check_derived("select_and_scatter", op, &[x, src], &g, &t, Rule::Normwise);
                continue;
            }
            let want = th(&g, d);
            let tol = match d {
                DType::F32 => Tol::Close(1e-5, 1e-5),
                _ => default_tol(d),
            };
            check(
                "select_and_scatter",
                Op::SelectAndScatter(w.clone()),
                &[x, src],
                &want,
                tol,
            );
        }
    }
    // NaN beats any number (the first NaN wins); padding never wins, not even against -inf.
    let w = wa(&[4], &[4], &[(0, 0)]);
    for (x, want) in [
        ([1.0f32, f32::NAN, 3.0, 2.0], [0.0f32, 5.0, 0.0, 0.0]),
        ([f32::NAN, 1.0, f32::NAN, 0.0], [5.0, 0.0, 0.0, 0.0]),
        ([0.0, 1.0, 2.0, f32::NAN], [0.0, 0.0, 0.0, 5.0]),
        ([2.0, 1.0, 2.0, 2.0], [5.0, 0.0, 0.0, 0.0]),
    ] {
        check(
            "select_and_scatter NaN",
            Op::SelectAndScatter(w.clone()),
            &[host(&[1, 1, 4], &x), host(&[1, 1, 1], &[5.0f32])],
            &host(&[1, 1, 4], &want),
            Tol::Exact,
        );
    }
    let inf = f32::NEG_INFINITY;
    check(
        "select_and_scatter -inf",
        Op::SelectAndScatter(wa(&[2], &[1], &[(1, 1)])),
        &[
            host(&[1, 1, 2], &[inf, inf]),
            host(&[1, 1, 3], &[1.0f32, 10.0, 100.0]),
        ],
        &host(&[1, 1, 2], &[11.0f32, 100.0]),
        Tol::Exact,
    );
}

// ----- convolution -----------------------------------------------------------------------------

/// torch convolution (no bias) with padding, stride and kernel dilation, in `f64`. Edge padding
/// (asymmetric, negative) is applied to the input first.
fn torch_conv(x: &T, k: &T, a: &ConvAttrs) -> T {
    let pads: Vec<(i64, i64)> = a.padding.clone();
    let x = x.constant_pad_nd(spatial_pads(&pads));
    let s: Vec<i64> = a.strides.iter().map(|&v| v as i64).collect();
    let dil: Vec<i64> = a.rhs_dilation.iter().map(|&v| v as i64).collect();
    let z = vec![0i64; s.len()];
    x.convolution(
        k,
        None::<T>,
        &s,
        &z,
        &dil,
        false,
        &z,
        a.feature_groups as i64,
    )
}

/// Independent reference for every `ConvAttrs`, following StableHLO's definition:
/// - `lhs_dilation` through torch's transposed convolution: a convolution of the input dilated
///   by `s` and padded by `(k-1-p, k-1-p+op)` with kernel `K` equals `conv_transpose(x, W,
///   stride s, padding p, output_padding op)` with `W = flip(K)` with in/out swapped;
/// - `batch_group_count = g`: split the input batch into `g` contiguous groups and the output
///   features into `g` groups, convolve group with group, concatenate the features.
fn conv_ref(x: &T, k: &T, a: &ConvAttrs) -> T {
    if a.batch_groups > 1 {
        let g = a.batch_groups as i64;
        let xs = x.chunk(g, 0);
        let ks = k.chunk(g, 0);
        let mut one = a.clone();
        one.batch_groups = 1;
        let parts: Vec<T> = xs
            .iter()
            .zip(&ks)
            .map(|(x, k)| torch_conv(x, k, &one))
            .collect();
        return T::cat(&parts, 1);
    }
    if a.lhs_dilation.iter().any(|&d| d > 1) {
        let n = a.strides.len();
        assert!(a.strides.iter().all(|&s| s == 1) && a.rhs_dilation.iter().all(|&s| s == 1));
        let ksz: Vec<i64> = (0..n).map(|i| k.size()[i + 2]).collect();
        let p: Vec<i64> = (0..n).map(|i| ksz[i] - 1 - a.padding[i].0).collect();
        let op: Vec<i64> = (0..n).map(|i| a.padding[i].1 - a.padding[i].0).collect();
        let s: Vec<i64> = a.lhs_dilation.iter().map(|&v| v as i64).collect();
        let dims: Vec<i64> = (2..2 + n as i64).collect();
        let w = k.flip(&dims).transpose(0, 1);
        let one = vec![1i64; n];
        return x.convolution(&w, None::<T>, &s, &p, &one, true, &op, 1);
    }
    torch_conv(x, k, a)
}

#[test]
fn conv() {
    let _r = Report;
    let cases = conv_cases(OPS);
    for (c, case) in cases.iter().enumerate() {
        for d in FLOATS {
            if d == DType::F64 && c % 3 != 0 {
                continue;
            }
            let x = randn(&case.x, d, c as u64);
            let k = randn(&case.k, d, 100 + c as u64);
            let r = conv_ref(
                &tt(&x).to_kind(Kind::Double),
                &tt(&k).to_kind(Kind::Double),
                &case.attrs,
            );
            let want = th(&r, d);
            let tol = match d {
                DType::F32 => Tol::Close(1e-4, 1e-4),
                _ => Tol::Close(1e-10, 1e-10),
            };
            check("conv", Op::Conv(case.attrs.clone()), &[x, k], &want, tol);
        }
        for d in HALVES {
            let x = randn(&case.x, d, c as u64);
            let k = randn(&case.k, d, 100 + c as u64);
            let conv =
                |kind: Kind| conv_ref(&tt(&x).to_kind(kind), &tt(&k).to_kind(kind), &case.attrs);
            let (r, t) = (conv(Kind::Double), conv(kind_of(d)));
            let op = Op::Conv(case.attrs.clone());
            check_derived("conv", op, &[x, k], &r, &t, Rule::Normwise);
        }
    }
}

// ----- gather / scatter ------------------------------------------------------------------------

/// Splits an index of `x[..axis] ++ idx_shape ++ x[axis+1..]` into (x index with the clamped
/// looked-up position, position in the index tensor).
fn take_index(
    o: &[usize],
    axis: usize,
    idx_rank: usize,
    idx: &[i64],
    idx_shape: &[usize],
    n: usize,
) -> (Vec<usize>, usize) {
    let ipos = ravel(&o[axis..axis + idx_rank], idx_shape);
    let j = idx[ipos].clamp(0, n as i64 - 1) as usize;
    let mut xi = o[..axis].to_vec();
    xi.push(j);
    xi.extend_from_slice(&o[axis + idx_rank..]);
    (xi, ipos)
}

/// `(operand shape, axis, index shape, index values)`.
type TakeCase = (Vec<usize>, usize, Vec<usize>, Vec<i64>);

fn take_cases() -> Vec<TakeCase> {
    vec![
        // Out-of-range indices are clamped.
        (vec![5, 3], 0, vec![6], vec![4, -2, 0, 7, 2, 4]),
        (vec![2, 5, 3], 1, vec![2, 2], vec![1, 4, 9, -1]),
        (vec![4], 0, vec![], vec![2]),
        (vec![3, 4], 1, vec![5], vec![3, 3, 0, -7, 100]),
        (vec![4, 2], 0, vec![], vec![-3]),
    ]
}

#[test]
fn take() {
    let _r = Report;
    for (c, (xs, axis, is, iv)) in take_cases().into_iter().enumerate() {
        for d in [
            DType::F32,
            DType::I64,
            DType::Bool,
            DType::U32,
            DType::BF16,
            DType::F16,
        ] {
            for id in [DType::I32, DType::I64] {
                let x = any_data(&xs, d, c as u64);
                let idx = map_ints(id, &is, iv.clone());
                let mut out = xs[..axis].to_vec();
                out.extend_from_slice(&is);
                out.extend_from_slice(&xs[axis + 1..]);
                let want = gather_ref(&[&x], None, &out, |o| {
                    Some((0, take_index(o, axis, is.len(), &iv, &is, xs[axis]).0))
                });
                check("take", Op::Take { axis }, &[x, idx], &want, Tol::Exact);
            }
        }
    }
}

#[test]
fn scatter_add() {
    let _r = Report;
    for (c, (xs, axis, is, iv)) in take_cases().into_iter().enumerate() {
        for d in [DType::F32, DType::F64, DType::I32, DType::U32] {
            let id = if c % 2 == 0 { DType::I64 } else { DType::I32 };
            let mut us = xs[..axis].to_vec();
            us.extend_from_slice(&is);
            us.extend_from_slice(&xs[axis + 1..]);
            let (base, upd) = if d.is_float() {
                (randn(&xs, d, c as u64), randn(&us, d, 10 + c as u64))
            } else {
                // Full-range values: u32 sums wrap.
                (bits(&xs, d, c as u64), bits(&us, d, 10 + c as u64))
            };
            // Reference: a loop over the updates, accumulating duplicates (f64, or wrapping
            // integers).
            let want = if d.is_float() {
                let mut acc = base.to_f64_vec();
                let u = upd.to_f64_vec();
                for (i, &v) in u.iter().enumerate() {
                    let (xi, _) = take_index(&unravel(i, &us), axis, is.len(), &iv, &is, xs[axis]);
                    acc[ravel(&xi, &xs)] += v;
                }
                floats(&xs, d, {
                    let mut it = acc.into_iter();
                    move || it.next().unwrap()
                })
            } else {
                let mut acc = int_values(&base);
                let u = int_values(&upd);
                for (i, &v) in u.iter().enumerate() {
                    let (xi, _) = take_index(&unravel(i, &us), axis, is.len(), &iv, &is, xs[axis]);
                    let j = ravel(&xi, &xs);
                    acc[j] = int_binary(BinaryOp::Add, d, acc[j], v);
                }
                map_ints(d, &xs, acc)
            };
            let idx = map_ints(id, &is, iv.clone());
            check(
                "scatter_add",
                Op::ScatterAdd { axis },
                &[base, idx, upd],
                &want,
                default_tol(d),
            );
        }
    }
}

#[test]
fn scatter_add_half() {
    let _r = Report;
    for (c, (xs, axis, is, iv)) in take_cases().into_iter().enumerate() {
        for d in HALVES {
            let id = if c % 2 == 0 { DType::I64 } else { DType::I32 };
            let mut us = xs[..axis].to_vec();
            us.extend_from_slice(&is);
            us.extend_from_slice(&xs[axis + 1..]);
            let (base, upd) = (randn(&xs, d, c as u64), randn(&us, d, 10 + c as u64));
            // The float64 sum, and libtorch's `index_put_` with accumulation in the dtype
            // (indices clamped first, as the op does).
            let flat_idx: Vec<i64> = (0..numel(&us))
                .map(|i| {
                    let (xi, _) = take_index(&unravel(i, &us), axis, is.len(), &iv, &is, xs[axis]);
                    ravel(&xi, &xs) as i64
                })
                .collect();
            let idx_t = T::from_slice(&flat_idx);
            let acc = |kind: Kind| {
                tt(&base)
                    .to_kind(kind)
                    .reshape([-1])
                    .index_put(
                        &[Some(idx_t.shallow_clone())],
                        &tt(&upd).to_kind(kind).reshape([-1]),
                        true,
                    )
                    .reshape(xs.iter().map(|&v| v as i64).collect::<Vec<_>>())
            };
            let (r, t) = (acc(Kind::Double), acc(kind_of(d)));
            let idx = map_ints(id, &is, iv.clone());
            let op = Op::ScatterAdd { axis };
            check_derived("scatter_add", op, &[base, idx, upd], &r, &t, Rule::Normwise);
        }
    }
}

// ----- property tests over random shapes -------------------------------------------------------

/// Runs the queued cases now and returns their failures (for proptest, which needs a verdict
/// per case).
fn flush_now() -> Result<(), String> {
    flush();
    let f = FAILURES.with(|f| std::mem::take(&mut *f.borrow_mut()));
    if f.is_empty() {
        Ok(())
    } else {
        Err(f.join("\n"))
    }
}

/// Two shapes that broadcast together: a common shape, each side dropping some leading dims
/// and replacing some dims by 1.
fn broadcast_shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec((1usize..5, any::<bool>(), any::<bool>()), 0..5)
        .prop_flat_map(|v| {
            let n = v.len();
            (Just(v), 0..=n, 0..=n)
        })
        .prop_map(|(v, da, db)| {
            let a = v[da..]
                .iter()
                .map(|&(d, o, _)| if o { 1 } else { d })
                .collect();
            let b = v[db..]
                .iter()
                .map(|&(d, _, o)| if o { 1 } else { d })
                .collect();
            (a, b)
        })
}

/// A shape, a same-size reshape target, a permutation, and a strided slice of it.
#[allow(clippy::type_complexity)]
fn shape_ops() -> impl Strategy<
    Value = (
        Vec<usize>,
        Vec<usize>,
        Vec<usize>,
        Vec<(usize, usize, usize)>,
    ),
> {
    prop::collection::vec(1usize..5, 0..5).prop_flat_map(|dims| {
        let n = dims.len();
        let perm = Just((0..n).collect::<Vec<usize>>()).prop_shuffle();
        let merges = prop::collection::vec(any::<bool>(), n);
        let slices: Vec<_> = dims
            .iter()
            .map(|&d| (0..=d).prop_flat_map(move |s| (Just(s), s..=d, 1usize..4)))
            .collect();
        (Just(dims), perm.clone(), merges, perm, slices).prop_map(
            |(dims, rperm, merges, perm, slices)| {
                // Reshape target: the dims in another order, some neighbours merged, a 1 added.
                let mut target: Vec<usize> = Vec::new();
                for (i, &p) in rperm.iter().enumerate() {
                    match target.last_mut() {
                        Some(last) if merges[i] => *last *= dims[p],
                        _ => target.push(dims[p]),
                    }
                }
                if merges.first() == Some(&true) {
                    target.insert(0, 1);
                }
                (dims, target, perm, slices)
            },
        )
    })
}

fn dtype_strategy() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    /// Reshape, transpose and slice as one-op graphs on random shapes and dtypes.
    #[test]
    fn prop_reshape_transpose_slice((dims, target, perm, slices) in shape_ops(), d in dtype_strategy(), seed in 0u64..1000) {
        let x = any_data(&dims, d, seed);
        let want = HostTensor::from_bytes(TensorType::new(d, target.as_slice()), x.bytes().to_vec()).unwrap();
        check("reshape", Op::Reshape(Shape::new(&target)), std::slice::from_ref(&x), &want, Tol::Exact);
        check("transpose", Op::Transpose(perm.clone()), std::slice::from_ref(&x), &transpose_ref(&x, &perm), Tol::Exact);
        let (start, limit, stride): (Vec<_>, Vec<_>, Vec<_>) = (
            slices.iter().map(|s| s.0).collect(),
            slices.iter().map(|s| s.1).collect(),
            slices.iter().map(|s| s.2).collect(),
        );
        let want = slice_ref(&x, &start, &limit, &stride);
        check("slice", Op::Slice { start, limit, stride }, &[x], &want, Tol::Exact);
        let r = flush_now();
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// Broadcasting binary ops and comparisons at the `Tensor` level: eagerly (libtorch's own
    /// broadcasting), and traced + compiled on both backends (explicit `broadcast` ops), against
    /// libtorch.
    #[test]
    fn prop_broadcasting_binary((sa, sb) in broadcast_shapes(), seed in 0u64..1000) {
        let a = randn(&sa, DType::F32, seed);
        let b = randn(&sb, DType::F32, seed + 1);
        let ia = ints(&sa, DType::I32, -5, 5, seed + 2);
        let ib = ints(&sb, DType::I32, 1, 5, seed + 3);
        let f = |xs: &[kiln::Tensor]| -> kiln::Result<Vec<kiln::Tensor>> {
            let (a, b, ia, ib) = (&xs[0], &xs[1], &xs[2], &xs[3]);
            Ok(vec![
                a.add(b)?, a.sub(b)?, a.mul(b)?, a.div(b)?, a.maximum(b)?, a.minimum(b)?,
                a.lt(b)?, a.ge(b)?, ia.div(ib)?, ia.rem(ib)?, ia.mul(ib)?,
                a.gt(b)?.select(a, &b.neg()?)?,
            ])
        };
        let (ta, tb, tia, tib) = (tt(&a), tt(&b), tt(&ia), tt(&ib));
        let want = vec![
            th(&(&ta + &tb), DType::F32), th(&(&ta - &tb), DType::F32),
            th(&(&ta * &tb), DType::F32), th(&(&ta / &tb), DType::F32),
            th(&ta.maximum(&tb), DType::F32), th(&ta.minimum(&tb), DType::F32),
            th(&ta.lt_tensor(&tb), DType::Bool), th(&ta.ge_tensor(&tb), DType::Bool),
            th(&tia.divide_tensor_mode(&tib, "trunc"), DType::I32),
            th(&tia.fmod_tensor(&tib), DType::I32), th(&(&tia * &tib), DType::I32),
            th(&ta.where_self(&ta.gt_tensor(&tb), &tb.neg()), DType::F32),
        ];
        let r = check_fn("broadcasting binary", &[a, b, ia, ib], f, &want, F32);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }
}

// ----- tensor-level compositions ---------------------------------------------------------------

/// Runs `f` eagerly (libtorch fast paths), and traced + compiled with `kiln::compile` on the XLA
/// and the eager backend; compares every output of each with `want`.
fn check_fn<F>(
    name: &str,
    inputs: &[HostTensor],
    f: F,
    want: &[HostTensor],
    tol: Tol,
) -> Result<(), String>
where
    F: Fn(&[kiln::Tensor]) -> kiln::Result<Vec<kiln::Tensor>> + Clone + Send + 'static,
{
    let xs: Vec<kiln::Tensor> = inputs
        .iter()
        .map(|h| kiln::Tensor::from_host(h).unwrap())
        .collect();
    let mut errs = Vec::new();
    let mut cmp = |mode: &str, r: kiln::Result<Vec<kiln::Tensor>>| match r {
        Ok(outs) if outs.len() != want.len() => errs.push(format!(
            "{name} [{mode}]: {} outputs, expected {}",
            outs.len(),
            want.len()
        )),
        Ok(outs) => {
            for (i, (o, w)) in outs.iter().zip(want).enumerate() {
                let what = format!("{name} [{mode}] output {i}");
                match o.to_host() {
                    Ok(h) => {
                        if let Err(e) = compare(&what, &h, w, tol) {
                            errs.push(e);
                        }
                    }
                    Err(e) => errs.push(format!("{what}: {e}")),
                }
            }
        }
        Err(e) => errs.push(format!("{name} [{mode}]: {e}")),
    };
    cmp("eager", tch::no_grad(|| f(&xs)));
    cmp("xla", kiln::compile(xla().clone(), f.clone()).run(&xs));
    cmp(
        "eager backend",
        kiln::compile(EagerBackend::new(), f).run(&xs),
    );
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs.join("\n"))
    }
}

/// `check_fn` for a test body: records failures in the test's report.
fn check_fn_report<F>(name: &str, inputs: &[HostTensor], f: F, want: &[T], tol: Tol)
where
    F: Fn(&[kiln::Tensor]) -> kiln::Result<Vec<kiln::Tensor>> + Clone + Send + 'static,
{
    let want: Vec<HostTensor> = want
        .iter()
        .map(|t| {
            let d = match t.kind() {
                Kind::Bool => DType::Bool,
                Kind::Int => DType::I32,
                Kind::Int64 => DType::I64,
                Kind::Double => DType::F64,
                _ => DType::F32,
            };
            th(t, d)
        })
        .collect();
    if let Err(e) = check_fn(name, inputs, f, &want, tol) {
        fail(e);
    }
}

type Outs = kiln::Result<Vec<kiln::Tensor>>;

#[test]
fn matmul_compositions() {
    let _r = Report;
    let tol = Tol::Close(1e-5, 1e-5);
    let pairs: [(&[usize], &[usize]); 9] = [
        (&[4], &[4]),
        (&[3, 4], &[4]),
        (&[4], &[4, 5]),
        (&[3, 4], &[4, 5]),
        (&[2, 3, 4], &[2, 4, 5]),
        (&[2, 1, 3, 4], &[5, 4, 2]),
        (&[2, 3, 4], &[4, 5]),
        (&[4], &[2, 4, 3]),
        (&[2, 3, 4], &[4]),
    ];
    for (k, (sa, sb)) in pairs.into_iter().enumerate() {
        let a = randn(sa, DType::F32, k as u64);
        let b = randn(sb, DType::F32, 20 + k as u64);
        let want = tt(&a)
            .to_kind(Kind::Double)
            .matmul(&tt(&b).to_kind(Kind::Double))
            .to_kind(Kind::Float);
        check_fn_report(
            &format!("matmul {sa:?} x {sb:?}"),
            &[a, b],
            |xs: &[kiln::Tensor]| -> Outs { Ok(vec![xs[0].matmul(&xs[1])?]) },
            &[want],
            tol,
        );
    }
}

#[test]
fn reductions_and_normalisations() {
    let _r = Report;
    let x = randn(&[3, 4, 5], DType::F32, 1);
    let t = tt(&x);
    let tol = Tol::Close(1e-5, 1e-6);
    check_fn_report(
        "softmax / log_softmax",
        std::slice::from_ref(&x),
        |xs: &[kiln::Tensor]| -> Outs {
            let x = &xs[0];
            Ok(vec![
                x.softmax(-1)?,
                x.softmax(0)?,
                x.log_softmax(1)?,
                x.log_softmax(-1)?,
            ])
        },
        &[
            t.softmax(-1, Kind::Float),
            t.softmax(0, Kind::Float),
            t.log_softmax(1, Kind::Float),
            t.log_softmax(-1, Kind::Float),
        ],
        tol,
    );
    check_fn_report(
        "mean / var / sum keepdim",
        std::slice::from_ref(&x),
        |xs: &[kiln::Tensor]| -> Outs {
            let x = &xs[0];
            Ok(vec![
                x.mean(&[-1], false)?,
                x.mean(&[0, 2], true)?,
                x.var(&[1], true, false)?,
                x.var(&[0, 2], false, true)?,
                x.sum(&[1], true)?,
                x.sum(&[0, 1, 2], false)?,
                x.mean_all()?,
                x.sum_all()?,
            ])
        },
        &[
            t.mean_dim([-1i64].as_slice(), false, None::<Kind>),
            t.mean_dim([0i64, 2].as_slice(), true, None::<Kind>),
            t.var_dim([1i64].as_slice(), true, false),
            t.var_dim([0i64, 2].as_slice(), false, true),
            t.sum_dim_intlist([1i64].as_slice(), true, None::<Kind>),
            t.sum(None::<Kind>),
            t.mean(None::<Kind>),
            t.sum(None::<Kind>),
        ],
        tol,
    );
    // Integer sums keep their dtype.
    let i = ints(&[3, 4], DType::I64, -100, 100, 3);
    check_fn_report(
        "int sum keepdim",
        std::slice::from_ref(&i),
        |xs: &[kiln::Tensor]| -> Outs { Ok(vec![xs[0].sum(&[0], true)?, xs[0].max(&[1], false)?]) },
        &[
            tt(&i).sum_dim_intlist([0i64].as_slice(), true, None::<Kind>),
            tt(&i).amax([1i64].as_slice(), false),
        ],
        Tol::Bits,
    );
}

#[test]
fn shape_compositions() {
    let _r = Report;
    let x = randn(&[2, 3, 4], DType::F32, 2);
    let y = randn(&[2, 3, 4], DType::F32, 3);
    let t = tt(&x);
    let u = tt(&y);
    check_fn_report(
        "reshape -1 / flatten / unsqueeze / squeeze / transpose",
        std::slice::from_ref(&x),
        |xs: &[kiln::Tensor]| -> Outs {
            let x = &xs[0];
            Ok(vec![
                x.reshape(&[-1, 4])?,
                x.reshape(&[4, -1])?,
                x.flatten(1, 2)?,
                x.flatten(0, -1)?,
                x.unsqueeze(1)?,
                x.unsqueeze(-1)?,
                x.unsqueeze(0)?.squeeze(0)?,
                x.transpose(0, 2)?,
                x.t()?,
                x.narrow(2, 1, 2)?,
                x.slice(1, 0, 3, 2)?,
                x.flip(&[0, -1])?,
            ])
        },
        &[
            t.reshape([-1, 4]),
            t.reshape([4, -1]),
            t.flatten(1, 2),
            t.flatten(0, -1),
            t.unsqueeze(1),
            t.unsqueeze(-1),
            t.shallow_clone(),
            t.transpose(0, 2),
            t.transpose(-2, -1),
            t.narrow(2, 1, 2),
            t.slice(1, 0, 3, 2),
            t.flip([0i64, 2]),
        ],
        Tol::Exact,
    );
    check_fn_report(
        "cat / stack",
        &[x.clone(), y.clone()],
        |xs: &[kiln::Tensor]| -> Outs {
            let (a, b) = (xs[0].clone(), xs[1].clone());
            Ok(vec![
                kiln::Tensor::cat(&[a.clone(), b.clone(), a.clone()], 1)?,
                kiln::Tensor::cat(&[a.clone(), b.clone()], -1)?,
                kiln::Tensor::stack(&[a.clone(), b.clone()], 0)?,
                kiln::Tensor::stack(&[a, b], 3)?,
            ])
        },
        &[
            T::cat(&[&t, &u, &t], 1),
            T::cat(&[&t, &u], -1),
            T::stack(&[&t, &u], 0),
            T::stack(&[&t, &u], 3),
        ],
        Tol::Exact,
    );
}

#[test]
fn elementwise_compositions() {
    let _r = Report;
    let x = randn(&[3, 4], DType::F32, 4);
    let y = randn(&[4], DType::F32, 5);
    let c = bits(&[3, 1], DType::Bool, 6);
    let (t, u, tc) = (tt(&x), tt(&y), tt(&c));
    check_fn_report(
        "select (where) / clamp / relu / dropout(eval)",
        &[x.clone(), y.clone(), c.clone()],
        |xs: &[kiln::Tensor]| -> Outs {
            let (x, y, c) = (&xs[0], &xs[1], &xs[2]);
            Ok(vec![
                c.select(x, y)?,
                c.select(x, &kiln::Tensor::scalar(0.5, DType::F32)?)?,
                x.clamp(-0.5, 0.7)?,
                x.relu()?,
                x.dropout(0.3, false)?,
                x.sigmoid()?.mul(&x.tanh()?)?.add_scalar(1.0)?,
            ])
        },
        &[
            t.where_self(&tc, &u),
            t.where_self(&tc, &T::from(0.5f32)),
            t.clamp(-0.5, 0.7),
            t.relu(),
            t.shallow_clone(),
            t.sigmoid() * t.tanh() + 1.0,
        ],
        Tol::Close(1e-5, 1e-6),
    );
    let w = randn(&[5, 4], DType::F32, 7);
    let b = randn(&[5], DType::F32, 8);
    let x3 = randn(&[2, 3, 4], DType::F32, 9);
    let (tw, tb, t3) = (tt(&w), tt(&b), tt(&x3));
    check_fn_report(
        "linear",
        &[x.clone(), w, b, x3],
        |xs: &[kiln::Tensor]| -> Outs {
            let (x, w, b, x3) = (&xs[0], &xs[1], &xs[2], &xs[3]);
            Ok(vec![
                x.linear(w, Some(b))?,
                x.linear(w, None)?,
                x3.linear(w, Some(b))?,
            ])
        },
        &[
            t.linear(&tw, Some(&tb)),
            t.linear(&tw, None::<T>),
            t3.linear(&tw, Some(&tb)),
        ],
        Tol::Close(1e-5, 1e-5),
    );
}

/// Dropout in training draws its mask from threefry on the graph's key: XLA and the eager
/// interpreter give bit-identical outputs for the same seed, and about `p` of the elements are
/// zeroed, the rest scaled by `1 / (1 - p)`.
#[test]
fn dropout_train_is_identical_across_backends() {
    let x = kiln::Tensor::from_host(&uniform(&[64, 64], DType::F32, 1.0, 2.0, 1)).unwrap();
    let f = |xs: &[kiln::Tensor]| -> Outs { Ok(vec![xs[0].dropout(0.25, true)?]) };
    let a = kiln::compile(xla().clone(), f)
        .with_seed(7)
        .run(std::slice::from_ref(&x))
        .unwrap();
    let b = kiln::compile(EagerBackend::new(), f)
        .with_seed(7)
        .run(std::slice::from_ref(&x))
        .unwrap();
    let (a, b) = (a[0].to_host().unwrap(), b[0].to_host().unwrap());
    assert_eq!(
        a.bytes(),
        b.bytes(),
        "dropout masks differ between xla and eager"
    );
    let xv = x.to_f64_vec().unwrap();
    let av = a.to_f64_vec();
    let zeros = av.iter().filter(|&&v| v == 0.0).count() as f64 / av.len() as f64;
    assert!((zeros - 0.25).abs() < 0.03, "dropped fraction {zeros}");
    for (o, i) in av.iter().zip(&xv) {
        assert!(*o == 0.0 || (o - i / 0.75).abs() < 1e-5, "{o} vs {i}");
    }
}
