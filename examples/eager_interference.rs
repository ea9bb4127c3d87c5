//! Does running kiln in a process slow eager libtorch down in that process? Times a zoo
//! model's eager inference (libtorch, its default threads) alone, then after compiled runs
//! of the same model without libtorch kernels in the executable ([`FfiMode::Off`]), then
//! after compiled runs with them ([`FfiMode::Auto`]), each phase's median, with the number
//! of threads the process has.
//!
//! Why: XLA calls kiln's libtorch kernels from its worker threads. Each worker that ran one
//! used to start an OpenMP team of its own; once the process held more OpenMP threads than
//! CPUs, libgomp stopped spinning at barriers in every team (its "throttled" spin count),
//! and eager's parallel ops then waited for their workers to wake instead. Measured on a
//! 2-vCPU Zen 4 EPYC (batch 4), alone / after `Off` / after `Auto`: resnet18 12.1 / 14.8 /
//! 22.7 ms, mobilenet_v2 10.4 / 9.0 / 32.1 ms (2 / 13 / 25 threads). Kernels now run on the
//! thread waiting for the results, in its own team (`kernels::set_handoff`); on a 2-vCPU
//! Xeon: resnet18 22.0 / 22.0 / 21.4 ms, mobilenet_v2 17.3 / 17.2 / 20.3 ms (2 / 13 / 21
//! threads; one run each on a noisy machine, where eager alone moved between 15 and 22 ms
//! for resnet18 within minutes). `KILN_KERNEL_HANDOFF=off` shows the old behaviour. The
//! benchmark harness still times eager before any compiled run.
//!
//! ```text
//! cargo run --release --example eager_interference            # resnet18, 20 calls a phase
//! cargo run --release --example eager_interference -- mobilenet_v2 40
//! ```

use kiln::backend::xla::kernels::FfiMode;
use kiln::backend::xla::XlaBackend;
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, CompiledFn, Tensor};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn main() -> kiln::Result<()> {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "resnet18".into());
    let calls: usize = args
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20)
        .max(1);
    let model = SharedModel::new(zoo::build(&name, 0)?);
    let xs = model.example_inputs(4, 0)?;

    // Per-call milliseconds of `calls` eager calls (after 3 warm-up calls).
    let eager = || -> kiln::Result<f64> {
        let mut t = Vec::with_capacity(calls);
        for i in 0..calls + 3 {
            let t0 = Instant::now();
            tch::no_grad(|| model.forward(&xs, false))?;
            if i >= 3 {
                t.push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(median(t))
    };
    // Per-call milliseconds of `calls` compiled calls (after the compiling one), and the
    // function: kept alive, as its backend's threads are.
    let compiled = |ffi: FfiMode| -> kiln::Result<(f64, CompiledFn<XlaBackend>)> {
        let backend = XlaBackend::new()?;
        let mut options = backend.options().clone();
        options.ffi = ffi;
        let m = model.clone();
        let mut f = compile(backend.with_options(options), move |xs: &[Tensor]| {
            Ok(vec![m.forward(xs, false)?])
        });
        f.run(&xs)?;
        let mut t = Vec::with_capacity(calls);
        for _ in 0..calls {
            let t0 = Instant::now();
            f.run(&xs)?;
            t.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        Ok((median(t), f))
    };

    println!(
        "{name}, batch 4, libtorch {} intra-op threads, OMP_WAIT_POLICY {}",
        tch::get_num_threads(),
        std::env::var("OMP_WAIT_POLICY").unwrap_or_else(|_| "unset".into())
    );
    println!(
        "eager alone:                        {:7.2} ms  ({} threads)",
        eager()?,
        threads()
    );
    let (off, _f_off) = compiled(FfiMode::Off)?;
    println!(
        "eager after XLA without kernels:    {:7.2} ms  ({} threads; compiled {off:.2} ms)",
        eager()?,
        threads()
    );
    let (auto, _f_auto) = compiled(FfiMode::Auto)?;
    println!(
        "eager after XLA with kernels:       {:7.2} ms  ({} threads; compiled {auto:.2} ms)",
        eager()?,
        threads()
    );
    Ok(())
}
