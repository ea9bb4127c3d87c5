//! The compile cache (trace once per signature, replay) and graph fingerprints.

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::Backend;
use kiln::ir::{
    BinaryOp, ConvAttrs, DotDims, Graph, InputKind, Literal, Op, ReduceKind, Shape, UnaryOp,
};
use kiln::{compile, trace, DType, Tensor, TensorType, TraceMode};

fn f32t(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape)
}

fn model(xs: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let x = &xs[0];
    Ok(vec![x.exp()?.add_scalar(1.0)?.log()?.sum(&[-1], false)?])
}

fn eager_model(x: &Tensor) -> Vec<f64> {
    tch::no_grad(|| model(std::slice::from_ref(x)))
        .unwrap()
        .remove(0)
        .to_f64_vec()
        .unwrap()
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
}

fn cache_behaviour<B: Backend>(backend: B) {
    let mut f = compile(backend, model);
    let x = Tensor::randn(&[2, 5], 1).unwrap();
    let y = f.run(std::slice::from_ref(&x)).unwrap();
    assert!(close(&y[0].to_f64_vec().unwrap(), &eager_model(&x)));
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (1, 1, 1), "{s:?}");
    // Same signature: no trace, no compile, a cache hit; new values are used.
    let x2 = Tensor::randn(&[2, 5], 2).unwrap();
    let y2 = f.run(std::slice::from_ref(&x2)).unwrap();
    assert!(close(&y2[0].to_f64_vec().unwrap(), &eager_model(&x2)));
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (1, 1, 2), "{s:?}");
    assert_eq!(s.cache_hits, 1, "{s:?}");
    // A new shape traces and compiles again.
    let x3 = Tensor::randn(&[3, 4], 3).unwrap();
    let y3 = f.run(std::slice::from_ref(&x3)).unwrap();
    assert!(close(&y3[0].to_f64_vec().unwrap(), &eager_model(&x3)));
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (2, 2, 3), "{s:?}");
    // A new dtype too.
    let x4 = Tensor::randn_dtype(&[2, 5], DType::F64, 4).unwrap();
    let y4 = f.run(std::slice::from_ref(&x4)).unwrap();
    assert_eq!(y4[0].dtype(), DType::F64);
    let s = f.stats();
    assert_eq!((s.traces, s.compiles), (3, 3), "{s:?}");
    // Both earlier signatures are still cached.
    f.run(std::slice::from_ref(&x)).unwrap();
    f.run(std::slice::from_ref(&x3)).unwrap();
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (3, 3, 6), "{s:?}");
    assert_eq!(s.cache_hits, 3, "{s:?}");
}

#[test]
fn trace_once_caches_per_signature_xla() {
    cache_behaviour(XlaBackend::new().unwrap());
}

#[test]
fn trace_once_caches_per_signature_eager() {
    cache_behaviour(EagerBackend::new());
}

#[test]
fn trace_every_call_traces_every_call_and_compiles_once() {
    let mut f = compile(XlaBackend::new().unwrap(), model).with_mode(TraceMode::EveryCall);
    for i in 0..4 {
        let x = Tensor::randn(&[2, 5], 10 + i).unwrap();
        let y = f.run(std::slice::from_ref(&x)).unwrap();
        assert!(close(&y[0].to_f64_vec().unwrap(), &eager_model(&x)));
    }
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (4, 1, 4), "{s:?}");
    assert_eq!(s.cache_hits, 3, "{s:?}");
    // A new shape: traced (as always) and compiled once more.
    f.run(&[Tensor::randn(&[1, 5], 0).unwrap()]).unwrap();
    let s = f.stats();
    assert_eq!((s.traces, s.compiles), (5, 2), "{s:?}");
}

/// Trace every time with a function whose graph changes from call to call at one signature:
/// each call runs the graph it traced (a repeated trace reuses its prepared plan, a changed one
/// is prepared and compiled once).
#[test]
fn trace_every_call_follows_a_changing_graph() {
    use kiln::nn::ParamStore;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let store = ParamStore::new();
    let w = store
        .root()
        .param("w", &[3], kiln::nn::Init::Const(0.5))
        .unwrap();
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let wf = w;
    let mut f = compile(XlaBackend::new().unwrap(), move |xs: &[Tensor]| {
        // Odd calls add the variable, even calls scale by 2.
        Ok(vec![if c.fetch_add(1, Ordering::Relaxed) % 2 == 1 {
            xs[0].add(&wf)?
        } else {
            xs[0].mul_scalar(2.0)?
        }])
    })
    .with_mode(TraceMode::EveryCall);
    let x = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
    for i in 0..6 {
        let y = f.run(std::slice::from_ref(&x)).unwrap()[0]
            .to_f64_vec()
            .unwrap();
        let want: Vec<f64> = [1.0, 2.0, 3.0]
            .iter()
            .map(|v| if i % 2 == 1 { v + 0.5 } else { 2.0 * v })
            .collect();
        assert_eq!(y, want, "call {i}");
    }
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (6, 2, 6), "{s:?}");
    assert_eq!(s.cache_hits, 4, "{s:?}");
}

/// Trace every time where only a constant changes between calls (the same ops, types and
/// operands): each call runs its own constant, never the plan of a structurally similar trace.
#[test]
fn trace_every_call_runs_each_calls_constant() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let scales = [1.0, 2.0, 1.0, 3.0, 3.0, 2.0];
    let calls = std::sync::Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let mut f = compile(XlaBackend::new().unwrap(), move |xs: &[Tensor]| {
        let scale = scales[c.fetch_add(1, Ordering::Relaxed)];
        Ok(vec![xs[0].mul_scalar(scale)?.add(&xs[0])?])
    })
    .with_mode(TraceMode::EveryCall);
    let x = Tensor::from_slice(&[3], &[1.0f32, -2.0, 0.25]).unwrap();
    for (i, scale) in scales.iter().enumerate() {
        let y = f.run(std::slice::from_ref(&x)).unwrap()[0]
            .to_f64_vec()
            .unwrap();
        let want: Vec<f64> = [1.0, -2.0, 0.25].iter().map(|v| v * scale + v).collect();
        assert_eq!(y, want, "call {i}, scale {scale}");
    }
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (6, 3, 6), "{s:?}");
}

/// `Tensor::cat` of 300 slices: more operands than fit in a byte (operand positions once were
/// `u8` edge weights, and this graph failed to verify).
fn cat_300(xs: &[Tensor]) -> kiln::Result<Vec<Tensor>> {
    let parts = (0..300)
        .rev()
        .map(|i| xs[0].slice(0, 2 * i, 2 * i + 2, 1))
        .collect::<kiln::Result<Vec<_>>>()?;
    Ok(vec![Tensor::cat(&parts, 0)?.mul_scalar(2.0)?])
}

fn cat_300_on<B: Backend>(backend: B) {
    let x = Tensor::randn(&[600], 7).unwrap();
    let want = tch::no_grad(|| cat_300(std::slice::from_ref(&x)))
        .unwrap()
        .remove(0)
        .to_f64_vec()
        .unwrap();
    let xv = x.to_f64_vec().unwrap();
    assert_eq!(want[..2], [2.0 * xv[598], 2.0 * xv[599]], "eager reference");
    let mut f = compile(backend, cat_300);
    let y = f.run(std::slice::from_ref(&x)).unwrap();
    assert_eq!(y[0].to_f64_vec().unwrap(), want);
}

#[test]
fn cat_of_300_slices_compiles_xla() {
    cat_300_on(XlaBackend::new().unwrap());
}

#[test]
fn cat_of_300_slices_compiles_eager() {
    cat_300_on(EagerBackend::new());
}

/// A small graph exercising inputs of two kinds, constants, attributes and two outputs.
/// A function returning one value several times (and a value CSE makes equal to another):
/// every result is delivered. The executor once handed the shared download to the first
/// result only ("result 5 not computed").
fn returns_one_value_twice_on<B: Backend>(backend: B) {
    let mut f = compile(backend, |xs: &[Tensor]| {
        let y = xs[0].exp()?;
        Ok(vec![
            y.clone(),
            xs[0].sum_all()?,
            y,
            xs[0].sum(&[0, 1], false)?,
        ])
    });
    let x = Tensor::randn(&[3, 4], 5).unwrap();
    let out = f.run(std::slice::from_ref(&x)).unwrap();
    assert_eq!(out.len(), 4);
    let want = x.exp().unwrap().to_f64_vec().unwrap();
    assert!(close(&out[0].to_f64_vec().unwrap(), &want));
    assert!(close(&out[2].to_f64_vec().unwrap(), &want));
    let s = x.sum_all().unwrap().to_f64_vec().unwrap();
    assert!(close(&out[1].to_f64_vec().unwrap(), &s));
    assert!(close(&out[3].to_f64_vec().unwrap(), &s));
}

#[test]
fn a_value_returned_twice_reaches_both_results_xla() {
    returns_one_value_twice_on(XlaBackend::new().unwrap());
}

#[test]
fn a_value_returned_twice_reaches_both_results_eager() {
    returns_one_value_twice_on(EagerBackend::new());
}

fn build(variant: &str) -> Graph {
    let mut g = Graph::new();
    let xs = if variant == "shape" { [2, 4] } else { [2, 3] };
    let x = g.add_input(InputKind::Data, "x", f32t(&xs));
    let wk = if variant == "kind" {
        InputKind::Buffer
    } else {
        InputKind::Parameter
    };
    let w = g.add_input(wk, "w", f32t(&[xs[1], 4]));
    let d = DotDims {
        lhs_contract: vec![1],
        rhs_contract: vec![0],
        ..Default::default()
    };
    let y = g.add(Op::DotGeneral(d), &[x, w]).unwrap();
    let c = if variant == "constant" { 0.5 } else { 0.25 };
    let k = g
        .add(Op::Constant(Literal::scalar(DType::F32, c)), &[])
        .unwrap();
    let kb = g
        .add(
            Op::Broadcast {
                shape: Shape::new(&[2, 4]),
                dims: vec![],
            },
            &[k],
        )
        .unwrap();
    let ops = if variant == "order" { [kb, y] } else { [y, kb] };
    let z = g.add(Op::Binary(BinaryOp::Sub), &ops).unwrap();
    let axes = if variant == "attr" { vec![0] } else { vec![1] };
    let r = g
        .add(
            Op::Reduce {
                kind: ReduceKind::Max,
                axes,
            },
            &[z],
        )
        .unwrap();
    let e = g.add(Op::Unary(UnaryOp::Exp), &[z]).unwrap();
    let outs = if variant == "outputs" {
        vec![e, r]
    } else {
        vec![r, e]
    };
    g.set_outputs(outs).unwrap();
    g
}

#[test]
fn fingerprints_are_structural() {
    let base = build("base");
    assert_eq!(base.fingerprint(), build("base").fingerprint());
    assert_eq!(base.fingerprint(), base.clone().fingerprint());
    for v in ["shape", "kind", "constant", "order", "attr", "outputs"] {
        assert_ne!(base.fingerprint(), build(v).fingerprint(), "variant {v}");
    }
    // Input names are not structure.
    let mut a = Graph::new();
    let x = a.add_input(InputKind::Data, "x", f32t(&[3]));
    let y = a.add(Op::Unary(UnaryOp::Neg), &[x]).unwrap();
    a.set_outputs(vec![y]).unwrap();
    let mut b = Graph::new();
    let x = b.add_input(InputKind::Data, "another name", f32t(&[3]));
    let y = b.add(Op::Unary(UnaryOp::Neg), &[x]).unwrap();
    b.set_outputs(vec![y]).unwrap();
    assert_eq!(a.fingerprint(), b.fingerprint());
    // Other attributes: conv strides, the unary function, the dtype.
    let conv = |stride: usize| {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", f32t(&[1, 2, 5, 5]));
        let k = g.add_input(InputKind::Data, "k", f32t(&[3, 2, 3, 3]));
        let mut c = ConvAttrs::plain(2);
        c.strides = vec![stride, 1];
        let y = g.add(Op::Conv(c), &[x, k]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        g.fingerprint()
    };
    assert_eq!(conv(1), conv(1));
    assert_ne!(conv(1), conv(2));
    let unary = |u: UnaryOp, d: DType| {
        let mut g = Graph::new();
        let x = g.add_input(InputKind::Data, "x", TensorType::new(d, [3]));
        let y = g.add(Op::Unary(u), &[x]).unwrap();
        g.set_outputs(vec![y]).unwrap();
        g.fingerprint()
    };
    assert_ne!(
        unary(UnaryOp::Exp, DType::F32),
        unary(UnaryOp::Log, DType::F32)
    );
    assert_ne!(
        unary(UnaryOp::Exp, DType::F32),
        unary(UnaryOp::Exp, DType::F64)
    );
}

#[test]
fn traced_graphs_have_equal_fingerprints() {
    let a = trace(&[f32t(&[2, 5])], model).unwrap();
    let b = trace(&[f32t(&[2, 5])], model).unwrap();
    assert_eq!(a.graph.fingerprint(), b.graph.fingerprint());
    let c = trace(&[f32t(&[2, 6])], model).unwrap();
    assert_ne!(a.graph.fingerprint(), c.graph.fingerprint());
}

/// The fingerprint is a persistent cache key: it must not change between runs, builds or
/// platforms. If this fails after an intentional change of the IR or the hashing, update the
/// value (and know that on-disk caches are invalidated).
#[test]
fn fingerprint_golden_value() {
    assert_eq!(
        build("base").fingerprint().to_hex(),
        "06aac19be35ac98aeeb0f876d8fbf18fddc1e9cd7342bb18a976c062b9fef925"
    );
}

/// `run` lends its inputs to the device (the XLA CPU plugin reads the tensor's memory in
/// place): a tensor changed in place (through libtorch) between calls gives each call its own values, and an
/// earlier result does not change with it.
#[test]
fn inputs_changed_in_place_between_calls() {
    let mut f = compile(XlaBackend::new().unwrap(), |xs: &[Tensor]| {
        Ok(vec![xs[0].mul_scalar(2.0)?.add(&xs[1])?])
    });
    let x = Tensor::from_slice(&[3], &[1.0f32, -2.0, 0.25]).unwrap();
    let b = Tensor::from_slice(&[3], &[0.5f32, 0.5, 0.5]).unwrap();
    let y1 = f.run(&[x.clone(), b.clone()]).unwrap().remove(0);
    assert_eq!(y1.to_f64_vec().unwrap(), vec![2.5, -3.5, 1.0]);
    x.as_tch()
        .unwrap()
        .shallow_clone()
        .copy_(&tch::Tensor::from_slice(&[4.0f32, 5.0, 6.0]));
    let y2 = f.run(&[x.clone(), b]).unwrap().remove(0);
    assert_eq!(y2.to_f64_vec().unwrap(), vec![8.5, 10.5, 12.5]);
    assert_eq!(y1.to_f64_vec().unwrap(), vec![2.5, -3.5, 1.0]);
    assert_eq!(x.to_f64_vec().unwrap(), vec![4.0, 5.0, 6.0]);
    assert_eq!(f.stats().compiles, 1);
}

/// A detached input or parameter returned as it is, and computed with: a compiled function
/// gives the values eager gives (the stop-gradient leaves the graph before the backend; an
/// output that is then an input is passed through), on both backends.
#[test]
fn detached_values_compile_as_the_values() -> kiln::Result<()> {
    let store = kiln::nn::ParamStore::with_seed(3);
    let p = store.root().param("p", &[4], kiln::nn::Init::Const(1.5))?;
    let x = Tensor::randn(&[4], 9)?;
    let f = |xs: &[Tensor], p: &Tensor| -> kiln::Result<Vec<Tensor>> {
        let d = xs[0].detach()?;
        Ok(vec![d.clone(), d.mul(&p.detach()?)?, p.detach()?])
    };
    let want: Vec<Vec<f64>> = f(std::slice::from_ref(&x), &p)?
        .iter()
        .map(|t| t.to_f64_vec())
        .collect::<kiln::Result<_>>()?;
    let (p1, p2) = (p.clone(), p.clone());
    let mut on_xla = compile(XlaBackend::new()?, move |xs: &[Tensor]| f(xs, &p1));
    let mut on_eager = compile(EagerBackend::new(), move |xs: &[Tensor]| f(xs, &p2));
    for got in [
        on_xla.run(std::slice::from_ref(&x))?,
        on_eager.run(std::slice::from_ref(&x))?,
    ] {
        let got: Vec<Vec<f64>> = got
            .iter()
            .map(|t| t.to_f64_vec())
            .collect::<kiln::Result<_>>()?;
        assert_eq!(got, want);
    }
    Ok(())
}
