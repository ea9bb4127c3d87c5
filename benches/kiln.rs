//! Micro-benchmarks (criterion): the costs that the harness's table sums up.
//!
//! - `replay/*`: one call of torchbench.py's example LinearModel, eager (libtorch) vs compiled
//!   XLA replay (trace once) vs trace-every-call.
//! - `trace/*`, `compile/*`: tracing and XLA compilation of a small conv model (resnet18 when
//!   the zoo has it).
//! - `fingerprint/*`: the structural graph hash that keys the executable cache.
//! - `interp/*`: kiln's eager graph interpreter (`EagerBackend`) vs the same model run op by op
//!   on kiln tensors vs raw tch calls.
//!
//! `cargo bench --bench kiln` (all), `cargo bench --bench kiln -- replay` (one group). Each
//! group measures for about 3 s.

use criterion::{criterion_group, criterion_main, Criterion};
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::XlaBackend;
use kiln::backend::Backend;
use kiln::compile::Program;
use kiln::nn::{Linear, Module, ParamStore, Sequential};
use kiln::{compile, trace, zoo, Tensor, TensorType, TraceMode};
use std::hint::black_box;
use std::time::Duration;

fn configured<'a>(
    c: &'a mut Criterion,
    name: &str,
) -> criterion::BenchmarkGroup<'a, criterion::measurement::WallTime> {
    let mut g = c.benchmark_group(name);
    g.measurement_time(Duration::from_secs(3))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    g
}

/// torchbench.py's example LinearModel: two Linear(10, 10), input randn(2, 10). Seeded: every
/// call builds the same model (compiled closures own theirs: they must be `Send`).
fn linear_model() -> (Sequential, Tensor) {
    let store = ParamStore::with_seed(0);
    let p = store.root().sub("layers");
    let model = Sequential::new()
        .add(Linear::new(&p.sub(0), 10, 10, true).expect("layer"))
        .add(Linear::new(&p.sub(1), 10, 10, true).expect("layer"));
    (model, Tensor::randn(&[2, 10], 1).expect("input"))
}

/// A small conv model and its input: resnet18 if the zoo has it, else the zoo's first model.
fn conv_model() -> (Box<dyn zoo::Model>, Vec<Tensor>) {
    let name = if zoo::NAMES.contains(&"resnet18") {
        "resnet18"
    } else {
        zoo::NAMES[0]
    };
    let model = zoo::build(name, 0).expect("zoo model");
    let inputs = model.example_inputs(1, 0).expect("inputs");
    (model, inputs)
}

fn replay(c: &mut Criterion) {
    let (model, x) = linear_model();
    let mut g = configured(c, "replay");
    g.bench_function("linear/eager", |b| {
        b.iter(|| tch::no_grad(|| model.forward(black_box(&x))).expect("eager"))
    });
    let Ok(xla) = XlaBackend::new() else {
        eprintln!("replay: no PJRT plugin; skipping the XLA cases");
        return;
    };
    for (label, mode) in [
        ("linear/xla_trace_once", TraceMode::Once),
        ("linear/xla_trace_every_call", TraceMode::EveryCall),
    ] {
        let m = linear_model().0;
        let mut f = compile(xla.clone(), move |xs: &[Tensor]| {
            Ok(vec![m.forward(&xs[0])?])
        })
        .with_mode(mode);
        f.run(std::slice::from_ref(&x)).expect("first call");
        g.bench_function(label, |b| {
            b.iter(|| f.run(black_box(std::slice::from_ref(&x))).expect("replay"))
        });
    }
    g.finish();
}

fn trace_and_compile(c: &mut Criterion) {
    let (model, inputs) = conv_model();
    let name = model.name().to_string();
    let sig: Vec<TensorType> = inputs.iter().map(|t| t.ty().clone()).collect();
    let traced = |backend: &dyn Fn(kiln::trace::Traced) -> kiln::Result<Program>| {
        let t = trace(&sig, |xs| Ok(vec![model.forward(xs, false)?])).expect("trace");
        backend(t).expect("program")
    };
    // Preparation without a backend rewrite (the eager backend has none).
    let eager = EagerBackend::new();
    let for_eager = |t| Program::new(t, &eager);
    let mut g = configured(c, "trace");
    g.bench_function(format!("{name}/trace+prepare"), |b| {
        b.iter(|| black_box(traced(&for_eager)))
    });
    g.finish();

    let Ok(xla) = XlaBackend::new() else {
        eprintln!("compile: no PJRT plugin; skipping");
        return;
    };
    let program = traced(&|t| Program::new(t, &xla));
    let mut g = configured(c, "compile");
    g.sample_size(10);
    g.bench_function(format!("{name}/xla_compile"), |b| {
        b.iter(|| xla.compile(black_box(&program.graph)).expect("compile"))
    });
    g.finish();

    let mut g = configured(c, "fingerprint");
    g.bench_function(format!("{name}/graph_{}_nodes", program.graph.len()), |b| {
        b.iter(|| black_box(&program.graph).fingerprint())
    });
    if name != "linear" {
        let (lin, x) = linear_model();
        let small = Program::new(
            trace(&[x.ty().clone()], |xs| Ok(vec![lin.forward(&xs[0])?])).expect("trace"),
            &xla,
        )
        .expect("program");
        g.bench_function(format!("linear/graph_{}_nodes", small.graph.len()), |b| {
            b.iter(|| black_box(&small.graph).fingerprint())
        });
    }
    g.finish();
}

fn interpreter(c: &mut Criterion) {
    let (model, x) = linear_model();
    let mut g = configured(c, "interp");
    g.bench_function("linear/kiln_tensors_eager", |b| {
        b.iter(|| tch::no_grad(|| model.forward(black_box(&x))).expect("eager"))
    });
    let m = linear_model().0;
    let mut f = compile(EagerBackend::new(), move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    });
    f.run(std::slice::from_ref(&x)).expect("first call");
    g.bench_function("linear/eager_backend_replay", |b| {
        b.iter(|| f.run(black_box(std::slice::from_ref(&x))).expect("replay"))
    });
    // The same two layers as raw tch calls: the floor of any libtorch-based path.
    let w: Vec<tch::Tensor> = (0..2)
        .map(|i| {
            tch::Tensor::randn([10, 10], (tch::Kind::Float, tch::Device::Cpu)) * (0.1 + i as f64)
        })
        .collect();
    let bias = tch::Tensor::zeros([10], (tch::Kind::Float, tch::Device::Cpu));
    let xt = x.as_tch().expect("eager input").shallow_clone();
    g.bench_function("linear/raw_tch", |b| {
        b.iter(|| {
            tch::no_grad(|| {
                let h = black_box(&xt).linear(&w[0], Some(&bias));
                h.linear(&w[1], Some(&bias))
            })
        })
    });
    g.finish();
}

criterion_group!(benches, replay, trace_and_compile, interpreter);
criterion_main!(benches);
