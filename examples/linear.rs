//! The `LinearModel` of PyTorch's `benchmarks/dynamo/torchbench.py` example (pytorch#89028):
//! two `Linear(10, 10)` layers on a `randn(2, 10)` input, run eagerly (libtorch) and compiled
//! to XLA. Prints both outputs, their max abs difference, the compile
//! time and the per-call time of eager vs XLA replay.
//!
//! `cargo run --release --example linear`

use kiln::backend::xla::XlaBackend;
use kiln::nn::{Linear, Module, ParamStore, Sequential};
use kiln::{compile, Tensor};
use std::time::Instant;

fn main() -> kiln::Result<()> {
    let store = ParamStore::with_seed(0);
    let root = store.root();
    let model = Sequential::new()
        .add(Linear::new(&root.sub("layers.0"), 10, 10, true)?)
        .add(Linear::new(&root.sub("layers.1"), 10, 10, true)?);
    // Shared by the eager calls and the compiled closure (which must be `Send`).
    let model = kiln::nn::Shared::new(model);
    let x = Tensor::randn(&[2, 10], 42)?;

    let eager = tch::no_grad(|| model.forward(&x))?;

    let backend = XlaBackend::new()?;
    println!(
        "PJRT plugin: {} (platform {}, C API {:?})",
        backend.plugin_path().display(),
        backend.platform(),
        backend.api_version()
    );
    let m = model.clone();
    let mut f = compile(backend, move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]));
    let t0 = Instant::now();
    let compiled = f.run(std::slice::from_ref(&x))?.remove(0);
    let first_call = t0.elapsed();

    let e = eager.to_f64_vec()?;
    let c = compiled.to_f64_vec()?;
    let max_diff = e
        .iter()
        .zip(&c)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("eager    : {:?}", &e[..5]);
    println!("xla      : {:?}", &c[..5]);
    println!("max |eager - xla| = {max_diff:.3e}");
    println!(
        "first call {:.1} ms (trace {:.2} ms, compile {:.1} ms)",
        first_call.as_secs_f64() * 1e3,
        f.stats().trace_time.as_secs_f64() * 1e3,
        f.stats().compile_time.as_secs_f64() * 1e3
    );

    // Per-call times: median of interleaved batches of calls.
    let iters = 2000;
    let mut eager_t = Vec::new();
    let mut xla_t = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            let _ = tch::no_grad(|| model.forward(&x))?;
        }
        eager_t.push(t.elapsed().as_secs_f64() / iters as f64);
        let t = Instant::now();
        for _ in 0..iters {
            let _ = f.run(std::slice::from_ref(&x))?;
        }
        xla_t.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (me, mx) = (median(&mut eager_t), median(&mut xla_t));
    println!(
        "per call: eager {:.1} us, xla replay {:.1} us (speedup {:.2}x)",
        me * 1e6,
        mx * 1e6,
        me / mx
    );
    println!("stats: {}", f.stats());
    if max_diff > 1e-5 {
        return Err(kiln::Error::Invalid(format!(
            "eager and XLA differ by {max_diff}"
        )));
    }
    Ok(())
}
