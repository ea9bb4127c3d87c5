//! Soak tests: long replay loops must not leak, and threads sharing one backend and one
//! executable cache must compute what one thread computes alone.
//!
//! - 10,000 inference replays (the `LinearModel` also traced anew on every call) and 1,000
//!   training steps (split and fused) of the zoo's `LinearModel` and of a small CNN (conv,
//!   batch norm, ReLU, max pool, linear): after a
//!   warm-up, the number of live PJRT buffers ([`kiln::backend::xla::pjrt::live_buffers`]) is
//!   exactly where it was, and resident memory (`VmRSS`) grows by less than a bound that a
//!   per-call leak of one tensor (a few hundred bytes) would exceed.
//! - Two threads, each training its own CNN on one shared `XlaBackend` (one PJRT client) and
//!   one shared in-memory `ExecutableCache` (so both run the same executables concurrently),
//!   1,000 steps each: losses and final parameters bit-identical to each model trained alone.
//!
//! The loops are sized to run in well under two minutes together (release build, 2 cores);
//! `KILN_SOAK_SCALE=N` multiplies every loop by `N` for a longer run. Each test prints its
//! figures (`cargo test --release --test soak -- --nocapture`).
//!
//! The tests of this file run one at a time (a process-wide lock): the buffer count and the
//! resident memory are process-wide, so a test running alongside would disturb them.

use kiln::backend::xla::pjrt::live_buffers;
use kiln::backend::xla::XlaBackend;
use kiln::backend::HostTensor;
use kiln::nn::{
    BatchNorm2d, Conv2d, Conv2dConfig, Flatten, Linear, MaxPool2d, Module, ParamStore, Relu,
    Sequential,
};
use kiln::optim::{AdamW, Sgd};
use kiln::runtime::{ExecutableCache, Runtime};
use kiln::train::{TrainMode, TrainStep};
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile_with, Tensor, TraceMode};
use std::sync::Mutex;
use std::time::Instant;

/// Serializes the tests of this binary (see the module docs).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `KILN_SOAK_SCALE` (default 1): multiplies every loop.
fn scale() -> usize {
    std::env::var("KILN_SOAK_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .filter(|&n: &usize| n >= 1)
        .unwrap_or(1)
}

/// Resident memory of this process in bytes (`VmRSS` of `/proc/self/status`).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmRSS value");
    kib * 1024
}

/// Resident memory may grow by at most [`RSS_SLACK`] over a whole soak loop after its warm-up,
/// and by at most [`RSS_SLACK_QUARTER`] over some quarter of the loop after its first (a leak
/// grows in every quarter; allocators and thread pools settle in steps: glibc's arenas and
/// XLA's workers can take a megabyte or two once, anywhere in the loop), plus
/// [`RSS_PER_CALL`] per iteration (for loops scaled up by `KILN_SOAK_SCALE`). Leaking one
/// tensor or host copy per call costs ≥ 300 bytes (libtorch's `TensorImpl` and storage alone
/// are larger): ≥ 750 KB in each quarter of 10,000 calls.
const RSS_SLACK: u64 = 4 << 20;
const RSS_SLACK_QUARTER: u64 = 512 << 10;
const RSS_PER_CALL: u64 = 16;

/// Live buffers and resident memory at one point of a loop.
#[derive(Clone, Copy, Debug)]
struct Probe {
    buffers: usize,
    rss: u64,
}

fn probe() -> Probe {
    Probe {
        buffers: live_buffers(),
        rss: rss_bytes(),
    }
}

/// Runs `iters` iterations of `body` after `warmup` ones and checks that live buffers are
/// unchanged and resident memory flat; prints the figures.
fn soak(name: &str, warmup: usize, iters: usize, mut body: impl FnMut(usize)) {
    let warmup = warmup.max(iters / 10);
    for i in 0..warmup {
        body(i);
    }
    let before = probe();
    let t0 = Instant::now();
    // Midway probes show a trend (a leak grows steadily, allocator noise does not).
    let mut mid = Vec::new();
    for i in 0..iters {
        body(warmup + i);
        if (i + 1) % (iters / 4).max(1) == 0 {
            mid.push(rss_bytes());
        }
    }
    let elapsed = t0.elapsed();
    let after = probe();
    let growth = after.rss as i64 - before.rss as i64;
    println!(
        "{name}: {iters} iterations in {:.2} s ({:.1} us each); live PJRT buffers {} -> {}; \
         RSS {:.1} MiB -> {:.1} MiB ({growth:+} bytes, {:+.1} bytes/iteration; at each quarter: \
         {} MiB)",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / iters as f64,
        before.buffers,
        after.buffers,
        before.rss as f64 / 1048576.0,
        after.rss as f64 / 1048576.0,
        growth as f64 / iters as f64,
        mid.iter()
            .map(|r| format!("{:.1}", *r as f64 / 1048576.0))
            .collect::<Vec<_>>()
            .join(", "),
    );
    assert_eq!(
        after.buffers, before.buffers,
        "{name}: live PJRT buffers changed over {iters} iterations"
    );
    let limit = RSS_SLACK + RSS_PER_CALL * iters as u64;
    assert!(
        growth < limit as i64,
        "{name}: resident memory grew by {growth} bytes over {iters} iterations (limit {limit})"
    );
    // The quarters after the first: a leak grows in each, a one-time step in one.
    let quarters: Vec<i64> = mid.windows(2).map(|w| w[1] as i64 - w[0] as i64).collect();
    let flattest = quarters.iter().copied().min().unwrap_or(0);
    let limit = RSS_SLACK_QUARTER + RSS_PER_CALL * (iters / 4) as u64;
    assert!(
        flattest < limit as i64,
        "{name}: resident memory grew by at least {flattest} bytes in each of the last three \
         quarters of {iters} iterations (limit {limit} per quarter)"
    );
}

/// A small CNN: two conv + batch norm + ReLU + max-pool blocks and a linear classifier, on
/// `[N, 3, 16, 16]` images, 10 classes.
fn small_cnn(store: &ParamStore) -> kiln::Result<Sequential> {
    let r = store.root();
    let pad1 = Conv2dConfig::default().padding(1);
    Ok(Sequential::new()
        .add(Conv2d::new(&r.sub("conv1"), 3, 8, 3, pad1)?)
        .add(BatchNorm2d::new(&r.sub("bn1"), 8)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Conv2d::new(&r.sub("conv2"), 8, 16, 3, pad1)?)
        .add(BatchNorm2d::new(&r.sub("bn2"), 16)?)
        .add(Relu)
        .add(MaxPool2d::new(2, 2, 0))
        .add(Flatten::default())
        .add(Linear::new(&r.sub("fc"), 16 * 4 * 4, 10, true)?))
}

fn cnn_batch(seed: u64) -> kiln::Result<Vec<Tensor>> {
    Ok(vec![
        Tensor::randn(&[4, 3, 16, 16], seed)?,
        Tensor::randint(&[4], 10, seed + 1)?,
    ])
}

fn host_bytes(t: &Tensor) -> Vec<u8> {
    t.to_host().unwrap().bytes().to_vec()
}

/// An inference loop: `f.run` on the same input `iters` times; every result equals the first.
fn inference_soak<F>(name: &str, f: F, input: Tensor, iters: usize, mode: TraceMode)
where
    F: Fn(&[Tensor]) -> kiln::Result<Vec<Tensor>> + Send + 'static,
{
    let rt = Runtime::with_cache(XlaBackend::new().unwrap(), ExecutableCache::in_memory());
    let mut f = compile_with(rt, f).with_mode(mode);
    let first = host_bytes(&f.run(std::slice::from_ref(&input)).unwrap()[0]);
    soak(name, 100, iters, |i| {
        let y = f.run(std::slice::from_ref(&input)).unwrap();
        // Compare a sample of the results: a download per call would dominate the loop.
        if i % 997 == 0 {
            assert_eq!(host_bytes(&y[0]), first, "{name}: replay {i} differs");
        }
    });
    let s = f.stats();
    assert_eq!(s.compiles, 1, "{name}: {s}");
}

#[test]
fn linear_model_inference_replays_are_flat() {
    let _g = serial();
    let model = SharedModel::new(zoo::build("linear", 0).unwrap());
    let x = model.example_inputs(2, 1).unwrap().remove(0);
    for (name, mode) in [
        ("linear inference", TraceMode::Once),
        // Traced, fingerprinted and looked up on every call: the tracing path must not leak.
        ("linear inference, traced every call", TraceMode::EveryCall),
    ] {
        let m = model.clone();
        inference_soak(
            name,
            move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]),
            x.clone(),
            10_000 * scale(),
            mode,
        );
    }
}

#[test]
fn small_cnn_inference_replays_are_flat() {
    let _g = serial();
    let store = ParamStore::with_seed(0);
    let net = small_cnn(&store).unwrap();
    let x = cnn_batch(1).unwrap().remove(0);
    inference_soak(
        "cnn inference",
        move |xs: &[Tensor]| Ok(vec![net.forward_t(&xs[0], false)?]),
        x,
        10_000 * scale(),
        TraceMode::Once,
    );
}

/// A training loop of `iters` steps on alternating batches; losses must stay finite.
fn training_soak(name: &str, mut step: TrainStep<XlaBackend>, batches: [Vec<Tensor>; 2]) {
    let iters = 1_000 * scale();
    soak(name, 20, iters, |i| {
        let loss = step.step(&batches[i % 2]).unwrap();
        assert!(loss.is_finite(), "{name}: step {i}: loss {loss}");
    });
    step.sync_to_store().unwrap();
    let s = step.stats();
    let per_step = step.executables_per_step().unwrap();
    assert_eq!(s.compiles as usize, per_step, "{name}: {s}");
}

#[test]
fn linear_model_training_steps_are_flat() {
    let _g = serial();
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let model = SharedModel::new(zoo::build("linear", 0).unwrap());
        let m = model.clone();
        let step = TrainStep::new(
            XlaBackend::new().unwrap(),
            model.store(),
            Sgd::new().momentum(0.9),
            move |xs: &[Tensor]| m.forward(&xs[..1], true)?.mse_loss(&xs[1]),
        )
        .unwrap()
        .with_cache(ExecutableCache::in_memory())
        .with_mode(mode)
        .with_lr(1e-3);
        let batches = [0u64, 10].map(|s| {
            vec![
                Tensor::randn(&[2, 10], s).unwrap(),
                Tensor::randn(&[2, 10], s + 1).unwrap(),
            ]
        });
        training_soak(&format!("linear training {mode:?}"), step, batches);
    }
}

#[test]
fn small_cnn_training_steps_are_flat() {
    let _g = serial();
    for mode in [TrainMode::Split, TrainMode::Fused] {
        let store = ParamStore::with_seed(0);
        let net = small_cnn(&store).unwrap();
        let step = TrainStep::new(
            XlaBackend::new().unwrap(),
            &store,
            AdamW::default(),
            move |xs: &[Tensor]| net.forward_t(&xs[0], true)?.cross_entropy(&xs[1]),
        )
        .unwrap()
        .with_cache(ExecutableCache::in_memory())
        .with_mode(mode)
        .with_lr(1e-3);
        let batches = [cnn_batch(1).unwrap(), cnn_batch(3).unwrap()];
        training_soak(&format!("cnn training {mode:?}"), step, batches);
    }
}

/// What a training run produced: every step's loss and the final parameters and buffers.
#[derive(Debug, PartialEq)]
struct Run {
    losses: Vec<f64>,
    state: Vec<(String, HostTensor)>,
}

/// Trains a fresh small CNN (parameters from `seed`) for `steps` steps on `backend` and
/// `cache`, on batches drawn from `seed`.
fn train_cnn(
    backend: XlaBackend,
    cache: ExecutableCache<XlaBackend>,
    seed: u64,
    steps: usize,
) -> kiln::Result<Run> {
    let store = ParamStore::with_seed(seed);
    let net = small_cnn(&store)?;
    let mut step = TrainStep::new(backend, &store, Sgd::new().momentum(0.9), move |xs| {
        net.forward_t(&xs[0], true)?.cross_entropy(&xs[1])
    })?
    .with_cache(cache)
    .with_lr(1e-2);
    let batches = [cnn_batch(100 * seed)?, cnn_batch(100 * seed + 7)?];
    let mut losses = Vec::with_capacity(steps);
    for i in 0..steps {
        losses.push(step.step(&batches[i % 2])?);
    }
    step.sync_to_store()?;
    Ok(Run {
        losses,
        state: store.state_dict()?,
    })
}

#[test]
fn two_threads_on_one_backend_and_cache_match_one_thread() {
    let _g = serial();
    let steps = 1_000 * scale();
    let seeds = [1u64, 2];
    // Each model alone, on its own backend and cache.
    let t0 = Instant::now();
    let alone: Vec<Run> = seeds
        .iter()
        .map(|&s| {
            train_cnn(
                XlaBackend::new().unwrap(),
                ExecutableCache::in_memory(),
                s,
                steps,
            )
            .unwrap()
        })
        .collect();
    let t_alone = t0.elapsed();
    // Both at once on one backend (one PJRT client) and one cache.
    let backend = XlaBackend::new().unwrap();
    let cache = ExecutableCache::in_memory();
    let t0 = Instant::now();
    let together: Vec<Run> = std::thread::scope(|s| {
        let workers: Vec<_> = seeds
            .iter()
            .map(|&seed| {
                let (b, c) = (backend.clone(), cache.clone());
                s.spawn(move || train_cnn(b, c, seed, steps))
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap().unwrap())
            .collect()
    });
    let t_together = t0.elapsed();
    println!(
        "two threads x {steps} cnn training steps: one after the other {:.2} s, together {:.2} s; \
         shared cache holds {} executables",
        t_alone.as_secs_f64(),
        t_together.as_secs_f64(),
        cache.len()
    );
    // The two threads ran the same graphs: one set of executables in the shared cache.
    assert_eq!(cache.len(), 3, "split mode: forward, backward, optimizer");
    for ((seed, a), t) in seeds.iter().zip(&alone).zip(&together) {
        assert!(
            a.losses[0] != a.losses[steps - 1],
            "seed {seed}: the loss never changed"
        );
        if let Some(i) = (0..steps).find(|&i| a.losses[i].to_bits() != t.losses[i].to_bits()) {
            panic!(
                "seed {seed}: step {i}: loss {} alone, {} with another thread",
                a.losses[i], t.losses[i]
            );
        }
        for ((name, x), (_, y)) in a.state.iter().zip(&t.state) {
            assert_eq!(
                x.bytes(),
                y.bytes(),
                "seed {seed}: {name} differs after {steps} steps"
            );
        }
    }
}

#[test]
fn live_buffer_count_follows_uploads_and_drops() {
    let _g = serial();
    use kiln::backend::Backend;
    let b = XlaBackend::new().unwrap();
    let n0 = live_buffers();
    let h = HostTensor::from_slice(&[3], &[1.0f32, 2.0, 3.0]).unwrap();
    let x = b.to_device(&h).unwrap();
    let y = b.to_device(&h).unwrap();
    assert_eq!(live_buffers(), n0 + 2);
    drop(x);
    assert_eq!(live_buffers(), n0 + 1);
    drop(y);
    assert_eq!(live_buffers(), n0);
}
