//! Runtime behaviour: resident variables, donation, trace modes, the on-disk executable cache,
//! and sharing across threads. Checked through the runtime's metrics.

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{XlaBackend, XlaOptions};
use kiln::backend::Backend;
use kiln::nn::{Init, Linear, Module, ParamStore, Relu, Sequential};
use kiln::runtime::ExecutableCache;
use kiln::{compile, compile_with, DType, Runtime, SharedFn, Tensor, TraceMode};
use std::path::PathBuf;

fn mlp(seed: u64) -> kiln::Result<(ParamStore, Sequential)> {
    let store = ParamStore::with_seed(seed);
    let root = store.root();
    let m = Sequential::new()
        .add(Linear::new(&root.sub("0"), 10, 32, true)?)
        .add(Relu)
        .add(Linear::new(&root.sub("2"), 32, 10, true)?);
    Ok((store, m))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (a.to_f64_vec().unwrap(), b.to_f64_vec().unwrap());
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn parameters_stay_on_the_device() -> kiln::Result<()> {
    let (store, m) = mlp(1)?;
    let param_bytes: usize = store
        .vars()
        .iter()
        .map(|(_, t)| t.ty().size_in_bytes())
        .sum();
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    });
    let x = Tensor::randn(&[4, 10], 2)?;
    f.run(std::slice::from_ref(&x))?;
    let first = f.stats();
    assert_eq!(
        first.h2d_bytes as usize,
        param_bytes + x.ty().size_in_bytes()
    );
    for _ in 0..5 {
        f.run(std::slice::from_ref(&x))?;
    }
    let d = f.stats().since(&first);
    // Per call: only the batch goes in, only the output comes out.
    assert_eq!(d.h2d_bytes as usize, 5 * x.ty().size_in_bytes());
    assert_eq!(d.h2d_transfers, 5);
    assert_eq!(d.d2h_bytes as usize, 5 * 4 * 10 * 4);
    assert_eq!((d.executions, d.compiles, d.traces), (5, 0, 0));
    Ok(())
}

/// A call reads its inputs' current values, also where it keeps an input's buffer for the
/// next call with the same tensor: values changed in place between calls (through libtorch),
/// and a new tensor where a dropped one was, are read anew. Each result is compared with the
/// same function's result on a fresh copy of the input.
#[test]
fn inputs_changed_between_calls_are_read_anew() -> kiln::Result<()> {
    let (_store, m) = mlp(4)?;
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    })
    .shared();
    let on_copy = |t: &tch::Tensor| -> kiln::Result<Vec<f64>> {
        f.run(&[Tensor::from_tch(t.copy())?])?
            .remove(0)
            .to_f64_vec()
    };
    let mut raw = tch::Tensor::randn([4, 10], (tch::Kind::Float, tch::Device::Cpu));
    let x = Tensor::from_tch(raw.shallow_clone())?;
    let mut previous = f.run(std::slice::from_ref(&x))?.remove(0).to_f64_vec()?;
    for step in 0..3 {
        // In place: the tensor kiln was given keeps its address.
        let _ = raw.f_mul_scalar_(1.5)?;
        let _ = raw.f_add_scalar_(step as f64)?;
        let got = f.run(std::slice::from_ref(&x))?.remove(0).to_f64_vec()?;
        assert_eq!(got, on_copy(&raw)?, "step {step}");
        assert_ne!(got, previous, "step {step}: the old values were read");
        previous = got;
    }
    // Tensors made and dropped one after another, each called once.
    for seed in 0..4 {
        let raw = tch::Tensor::randn([4, 10], (tch::Kind::Float, tch::Device::Cpu)) + seed;
        let got = f
            .run(&[Tensor::from_tch(raw.shallow_clone())?])?
            .remove(0)
            .to_f64_vec()?;
        assert_eq!(got, on_copy(&raw)?, "seed {seed}");
    }
    Ok(())
}

/// `run_on_device` of a program the CPU plugin runs inside the launch (the LinearModel's
/// size: two 10x10 linears on 2 rows, whose tiny products are kiln's own kernel) reads its
/// inputs in place from the second call on, as `run` does, and still sees values changed in
/// place between calls; a program the plugin runs on its pool (products of 256x256 on 256
/// rows) keeps copying its inputs, as its results may still be computed when the call
/// returns.
#[test]
fn run_on_device_reads_inputs_in_place_where_the_program_runs_inline() -> kiln::Result<()> {
    let tiny = || -> kiln::Result<Sequential> {
        let store = ParamStore::with_seed(8);
        let root = store.root();
        Ok(Sequential::new()
            .add(Linear::new(&root.sub("0"), 10, 10, true)?)
            .add(Relu)
            .add(Linear::new(&root.sub("2"), 10, 10, true)?))
    };
    let (m, twin) = (tiny()?, tiny()?);
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    });
    // The same program on a copy of the input, in a function of its own.
    let reference = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![twin.forward(&xs[0])?])
    });
    let on_copy = |t: &tch::Tensor| -> kiln::Result<Vec<f64>> {
        reference
            .run_on_device(&[Tensor::from_tch(t.copy())?])?
            .get(0)?
            .to_f64_vec()
    };
    let mut raw = tch::Tensor::randn([2, 10], (tch::Kind::Float, tch::Device::Cpu));
    let x = Tensor::from_tch(raw.shallow_clone())?;
    let before = f.stats();
    let mut previous = Vec::new();
    for step in 0..4 {
        let _ = raw.f_mul_scalar_(1.5)?;
        let _ = raw.f_add_scalar_(step as f64)?;
        let got = f
            .run_on_device(std::slice::from_ref(&x))?
            .get(0)?
            .to_f64_vec()?;
        assert_eq!(got, on_copy(&raw)?, "step {step}");
        assert_ne!(got, previous, "step {step}: the old values were read");
        previous = got;
    }
    let d = f.stats().since(&before);
    // Call 1 copies (nothing known yet), call 2 lends and keeps the buffer, calls 3 and 4
    // reuse it.
    assert_eq!(d.h2d_reused, 2, "{d}");

    let store = ParamStore::with_seed(9);
    let big = Linear::new(&store.root().sub("0"), 256, 256, false)?;
    let g = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![big.forward(&big.forward(&xs[0])?.tanh()?)?])
    });
    let x = Tensor::randn(&[256, 256], 3)?;
    let want = g
        .run_on_device(std::slice::from_ref(&x))?
        .get(0)?
        .to_f64_vec()?;
    let before = g.stats();
    for _ in 0..4 {
        let got = g
            .run_on_device(std::slice::from_ref(&x))?
            .get(0)?
            .to_f64_vec()?;
        assert_eq!(got, want);
    }
    assert_eq!(g.stats().since(&before).h2d_reused, 0);
    Ok(())
}

/// A module with a buffer that counts calls: `count += 1` each forward (like BatchNorm's
/// `num_batches_tracked`), plus a running sum of the input.
struct Counter {
    count: Tensor,
    total: Tensor,
}

impl Counter {
    /// Both buffers start at zero in `store`'s root: `count` as f32, `total` as f64.
    fn new(store: &ParamStore) -> kiln::Result<Self> {
        Ok(Counter {
            count: store
                .root()
                .buffer("count", &[], Init::Const(0.0), DType::F32)?,
            total: store
                .root()
                .buffer("total", &[], Init::Const(0.0), DType::F64)?,
        })
    }
}

impl Module for Counter {
    fn forward_t(&self, x: &Tensor, _train: bool) -> kiln::Result<Tensor> {
        self.count.assign(&self.count.add_scalar(1.0)?)?;
        self.total.assign(&self.total.add(&x.sum_all()?)?)?;
        x.mul_scalar(2.0)
    }
}

#[test]
fn state_updates_are_donated_and_synced_on_request() -> kiln::Result<()> {
    let store = ParamStore::new();
    let c = Counter::new(&store)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![c.forward(&xs[0])?])
    });
    let x = Tensor::from_slice(&[3], &[1.0f64, 2.0, 3.5])?;
    for _ in 0..4 {
        let y = f.run(std::slice::from_ref(&x))?;
        assert_eq!(y[0].to_f64_vec()?, vec![2.0, 4.0, 7.0]);
    }
    // The store still holds the initial values: updates live on the device.
    assert_eq!(store.get("count").unwrap().to_scalar()?, 0.0);
    f.sync_to_store()?;
    assert_eq!(store.get("count").unwrap().to_scalar()?, 4.0);
    assert_eq!(store.get("total").unwrap().to_scalar()?, 4.0 * 6.5);
    // Each call after the first replaced two donated buffers (the first call's inputs were the
    // uploaded initial values, donated too).
    assert_eq!(f.stats().donated, 2 * 4);
    Ok(())
}

#[test]
fn trace_every_call_compiles_once() -> kiln::Result<()> {
    let (_s, m) = mlp(3)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    })
    .with_mode(TraceMode::EveryCall);
    let x = Tensor::randn(&[2, 10], 4)?;
    for _ in 0..6 {
        f.run(std::slice::from_ref(&x))?;
    }
    let s = f.stats();
    assert_eq!((s.traces, s.compiles, s.executions), (6, 1, 6));
    assert_eq!(s.cache_hits, 5);
    Ok(())
}

fn run_with_cache(
    cache: ExecutableCache<XlaBackend>,
    seed: u64,
) -> kiln::Result<(kiln::Stats, Tensor, Tensor)> {
    let (_s, m) = mlp(seed)?;
    let x = Tensor::randn(&[3, 10], 9)?;
    let eager = tch::no_grad(|| m.forward(&x))?;
    let rt = Runtime::with_cache(XlaBackend::new()?, cache);
    let mut f = compile_with(rt, move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]));
    let y = f.run(&[x])?.remove(0);
    Ok((f.stats(), y, eager))
}

#[test]
fn disk_cache_serves_a_fresh_cache_and_survives_corruption() -> kiln::Result<()> {
    let dir = tmpdir("disk");
    let (s1, y1, e1) = run_with_cache(ExecutableCache::with_dir(&dir)?, 5)?;
    assert_eq!((s1.compiles, s1.disk_hits, s1.disk_writes), (1, 0, 1));
    assert!(max_diff(&y1, &e1) < 1e-5);
    // A fresh in-memory cache over the same directory (what a new process sees).
    let (s2, y2, e2) = run_with_cache(ExecutableCache::with_dir(&dir)?, 5)?;
    assert_eq!((s2.compiles, s2.disk_hits), (0, 1));
    assert!(max_diff(&y2, &e2) < 1e-5);
    // Truncate the entry: detected, recompiled, rewritten, still correct.
    let entry = std::fs::read_dir(&dir)
        .map_err(|e| kiln::Error::io(&dir, e))?
        .filter_map(|e| e.ok())
        .find(|e| e.path().extension().is_some_and(|x| x == "kxe"))
        .expect("a cache entry")
        .path();
    let len = std::fs::metadata(&entry).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&entry)
        .unwrap();
    f.set_len(len / 2).unwrap();
    drop(f);
    let (s3, y3, e3) = run_with_cache(ExecutableCache::with_dir(&dir)?, 5)?;
    assert_eq!(
        (s3.compiles, s3.disk_hits, s3.disk_rejected, s3.disk_writes),
        (1, 0, 1, 1)
    );
    assert!(max_diff(&y3, &e3) < 1e-5);
    // Garbage of the right length is rejected by the checksum.
    let mut bytes = std::fs::read(&entry).unwrap();
    let n = bytes.len();
    bytes[n - 10] ^= 0xFF;
    std::fs::write(&entry, &bytes).unwrap();
    let (s4, _, _) = run_with_cache(ExecutableCache::with_dir(&dir)?, 5)?;
    assert_eq!((s4.compiles, s4.disk_rejected), (1, 1));
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Run by `a_second_process_compiles_nothing` in a child process.
#[test]
fn child_process_entry() -> kiln::Result<()> {
    let Ok(dir) = std::env::var("KILN_TEST_CHILD_CACHE") else {
        return Ok(());
    };
    let (s, y, e) = run_with_cache(ExecutableCache::with_dir(dir)?, 11)?;
    println!(
        "CHILD compiles={} disk_hits={} diff={:e}",
        s.compiles,
        s.disk_hits,
        max_diff(&y, &e)
    );
    Ok(())
}

#[test]
fn a_second_process_compiles_nothing() -> kiln::Result<()> {
    let dir = tmpdir("proc");
    let child = |dir: &PathBuf| -> String {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_process_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KILN_TEST_CHILD_CACHE", dir)
            .output()
            .expect("spawn child");
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "child failed: {text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The harness may print its own progress on the same line: take what follows CHILD.
        let at = text
            .find("CHILD")
            .unwrap_or_else(|| panic!("no child report in: {text}"));
        text[at..].lines().next().unwrap_or_default().to_string()
    };
    let first = child(&dir);
    assert!(first.contains("compiles=1 disk_hits=0"), "{first}");
    let second = child(&dir);
    assert!(second.contains("compiles=0 disk_hits=1"), "{second}");
    let diff: f64 = second.rsplit("diff=").next().unwrap().parse().unwrap();
    assert!(diff < 1e-5, "{second}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

#[test]
fn two_models_on_two_threads_share_backend_and_cache() -> kiln::Result<()> {
    let backend = XlaBackend::new()?;
    let cache: ExecutableCache<XlaBackend> = ExecutableCache::in_memory();
    let handles: Vec<_> = (0..2u64)
        .map(|t| {
            let (backend, cache) = (backend.clone(), cache.clone());
            std::thread::spawn(move || -> kiln::Result<f64> {
                let (_s, m) = mlp(20 + t)?;
                let x = Tensor::randn(&[2 + t as usize, 10], t)?;
                let eager = tch::no_grad(|| m.forward(&x))?;
                let mut f = compile_with(
                    Runtime::with_cache(backend, cache),
                    move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]),
                );
                let mut worst: f64 = 0.0;
                for _ in 0..20 {
                    let y = f.run(std::slice::from_ref(&x))?.remove(0);
                    worst = worst.max(max_diff(&y, &eager));
                }
                Ok(worst)
            })
        })
        .collect();
    for h in handles {
        let worst = h.join().expect("thread panicked")?;
        assert!(worst < 1e-5, "{worst}");
    }
    // Different batch sizes: two graphs in the shared cache.
    assert_eq!(cache.len(), 2);
    Ok(())
}

#[test]
fn eager_backend_runs_the_same_programs() -> kiln::Result<()> {
    let (_s, m) = mlp(8)?;
    let x = Tensor::randn(&[2, 10], 1)?;
    let eager = tch::no_grad(|| m.forward(&x))?;
    let mut f = compile(EagerBackend::new(), move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    });
    let y = f.run(&[x])?.remove(0);
    assert!(max_diff(&y, &eager) < 1e-6);
    assert_eq!(EagerBackend::new().name(), "eager");
    Ok(())
}

/// Each backend gets executables compiled for its own PJRT client, even when two backends share
/// one in-memory cache (an executable only runs with buffers of its client).
#[test]
fn two_clients_sharing_one_cache_each_run_their_own_executable() -> kiln::Result<()> {
    let cache: ExecutableCache<XlaBackend> = ExecutableCache::in_memory();
    let x = Tensor::randn(&[3, 10], 9)?;
    for seed in [30, 31] {
        let (_s, m) = mlp(seed)?;
        let eager = tch::no_grad(|| m.forward(&x))?;
        let mut f = compile_with(
            Runtime::with_cache(XlaBackend::new()?, cache.clone()),
            move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]),
        );
        let y = f.run(std::slice::from_ref(&x))?.remove(0);
        assert!(max_diff(&y, &eager) < 1e-5);
        assert_eq!(f.stats().compiles, 1, "a new client compiles its own");
    }
    assert_eq!(cache.len(), 2);
    Ok(())
}

/// Backends on one client with different options never share executables.
#[test]
fn backends_with_other_options_sharing_one_cache_compile_their_own() -> kiln::Result<()> {
    let cache: ExecutableCache<XlaBackend> = ExecutableCache::in_memory();
    let be = XlaBackend::new()?;
    let x = Tensor::randn(&[3, 10], 9)?;
    let backends = [be.clone(), be.with_options(XlaOptions::plain()), be.clone()];
    let mut compiles = Vec::new();
    for backend in backends {
        let (_s, m) = mlp(32)?;
        let eager = tch::no_grad(|| m.forward(&x))?;
        let mut f = compile_with(
            Runtime::with_cache(backend, cache.clone()),
            move |xs: &[Tensor]| Ok(vec![m.forward(&xs[0])?]),
        );
        let y = f.run(std::slice::from_ref(&x))?.remove(0);
        assert!(max_diff(&y, &eager) < 1e-5);
        compiles.push(f.stats().compiles);
    }
    // The third backend equals the first (same client, same options): a hit.
    assert_eq!(compiles, vec![1, 1, 0]);
    assert_eq!(cache.len(), 2);
    Ok(())
}

/// Directories a cache cannot write into: one whose permissions forbid it, and `/proc/self`,
/// which refuses new files even to root (who ignores permissions).
fn unwritable_dirs() -> Vec<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let ro = tmpdir("readonly");
    std::fs::create_dir_all(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    let mut dirs = vec![PathBuf::from("/proc/self")];
    // Root writes into the read-only directory anyway: then only `/proc/self` tests anything.
    if std::fs::write(ro.join("probe"), b"").is_err() {
        dirs.push(ro);
    }
    dirs
}

#[test]
fn an_unwritable_cache_directory_costs_only_the_cache() -> kiln::Result<()> {
    for dir in unwritable_dirs() {
        let (s, y, e) = run_with_cache(ExecutableCache::with_dir(&dir)?, 12)?;
        assert!(max_diff(&y, &e) < 1e-5);
        assert_eq!((s.compiles, s.disk_writes), (1, 0), "{}", dir.display());
        // The next compile on the same cache still works.
        let (s, _, _) = run_with_cache(ExecutableCache::with_dir(&dir)?, 12)?;
        assert_eq!((s.compiles, s.disk_writes), (1, 0), "{}", dir.display());
    }
    let _ = std::fs::remove_dir_all(tmpdir("readonly"));
    Ok(())
}

/// `var.assign(x)` inside a compiled function, where `x` is an input of the executable (the
/// function's argument, another variable) rather than a computed value, and two variables
/// assigned one value: after a call the variables hold what running eagerly gives.
#[test]
fn variables_assigned_from_inputs_and_other_variables() -> kiln::Result<()> {
    for backend_is_xla in [true, false] {
        let store = ParamStore::new();
        let r = store.root();
        let from_input = r.buffer("from_input", &[3], Init::Const(0.0), DType::F32)?;
        let from_var = r.buffer("from_var", &[3], Init::Const(0.0), DType::F32)?;
        let source = r.buffer("source", &[3], Init::Const(7.0), DType::F32)?;
        let twin_a = r.buffer("twin_a", &[3], Init::Const(0.0), DType::F32)?;
        let twin_b = r.buffer("twin_b", &[3], Init::Const(0.0), DType::F32)?;
        let f = {
            let (fi, fv, src, a, b) = (
                from_input.clone(),
                from_var.clone(),
                source.clone(),
                twin_a.clone(),
                twin_b.clone(),
            );
            move |xs: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
                fi.assign(&xs[0])?;
                fv.assign(&src)?;
                let y = xs[0].mul_scalar(2.0)?;
                a.assign(&y)?;
                b.assign(&y)?;
                Ok(vec![y])
            }
        };
        let x = Tensor::from_slice(&[3], &[1.0f32, 2.0, 3.0])?;
        let y = if backend_is_xla {
            let mut c = compile(XlaBackend::new()?, f);
            let y = c.run(std::slice::from_ref(&x))?.remove(0);
            c.sync_to_store()?;
            y
        } else {
            let mut c = compile(EagerBackend::new(), f);
            let y = c.run(std::slice::from_ref(&x))?.remove(0);
            c.sync_to_store()?;
            y
        };
        assert_eq!(y.to_f64_vec()?, vec![2.0, 4.0, 6.0]);
        assert_eq!(from_input.to_f64_vec()?, vec![1.0, 2.0, 3.0]);
        assert_eq!(from_var.to_f64_vec()?, vec![7.0; 3]);
        assert_eq!(twin_a.to_f64_vec()?, vec![2.0, 4.0, 6.0]);
        assert_eq!(twin_b.to_f64_vec()?, vec![2.0, 4.0, 6.0]);
    }
    Ok(())
}

/// A variable returned after it was assigned, and returned unchanged while another variable
/// takes its old value: the traced function gives what the eager one gives, and the donated
/// buffer is never read after the call.
#[test]
fn reads_after_assign_see_the_new_value_as_eagerly() -> kiln::Result<()> {
    let make = || -> kiln::Result<(ParamStore, Tensor, Tensor)> {
        let store = ParamStore::new();
        let v = store
            .root()
            .buffer("v", &[2], Init::Const(1.0), DType::F32)?;
        let old = store
            .root()
            .buffer("old", &[2], Init::Const(0.0), DType::F32)?;
        Ok((store, v, old))
    };
    let body = |v: Tensor, old: Tensor| {
        move |xs: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
            old.assign(&v)?;
            let before = v.mul_scalar(1.0)?;
            v.assign(&v.add(&xs[0])?)?;
            Ok(vec![before, v.clone()])
        }
    };
    let x = Tensor::from_slice(&[2], &[0.5f32, 1.5])?;
    let (_es, ev, eold) = make()?;
    let mut eager_out = Vec::new();
    for _ in 0..3 {
        eager_out.push(
            body(ev.clone(), eold.clone())(std::slice::from_ref(&x))?
                .iter()
                .map(|t| t.to_f64_vec().unwrap())
                .collect::<Vec<_>>(),
        );
    }
    let (_s, v, old) = make()?;
    let mut f = compile(XlaBackend::new()?, body(v.clone(), old.clone()));
    for want in &eager_out {
        let got: Vec<Vec<f64>> = f
            .run(std::slice::from_ref(&x))?
            .iter()
            .map(|t| t.to_f64_vec().unwrap())
            .collect();
        assert_eq!(&got, want);
    }
    f.sync_to_store()?;
    assert_eq!(v.to_f64_vec()?, ev.to_f64_vec()?);
    assert_eq!(old.to_f64_vec()?, eold.to_f64_vec()?);
    Ok(())
}

#[test]
fn compiled_models_are_send_and_the_shared_handle_is_sync() -> kiln::Result<()> {
    fn send<T: Send>() {}
    fn shareable<T: Send + Sync + Clone>() {}
    send::<kiln::CompiledFn<XlaBackend>>();
    send::<kiln::CompiledFn<EagerBackend>>();
    send::<kiln::train::TrainStep<XlaBackend>>();
    send::<kiln::train::TrainStep<EagerBackend>>();
    shareable::<SharedFn<XlaBackend>>();
    // Compiled and first run here, run again on another thread.
    let (_s, m) = mlp(40)?;
    let x = Tensor::randn(&[2, 10], 3)?;
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    });
    let here = f.run(std::slice::from_ref(&x))?.remove(0).to_f64_vec()?;
    let there = std::thread::spawn(move || -> kiln::Result<Vec<f64>> {
        f.run(&[Tensor::randn(&[2, 10], 3)?])?
            .remove(0)
            .to_f64_vec()
    })
    .join()
    .expect("worker panicked")?;
    assert_eq!(here, there);
    Ok(())
}

/// Inputs for the shared-handle tests: a few batches, each thread cycles through them.
fn batches() -> kiln::Result<Vec<Tensor>> {
    (0..5).map(|i| Tensor::randn(&[4, 10], 100 + i)).collect()
}

#[test]
fn a_shared_handle_serves_four_threads_with_the_single_threaded_results() -> kiln::Result<()> {
    let (store, m) = mlp(41)?;
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    })
    .shared();
    let inputs = batches()?;
    let want: Vec<Vec<f64>> = inputs
        .iter()
        .map(|x| f.run(std::slice::from_ref(x))?.remove(0).to_f64_vec())
        .collect::<kiln::Result<_>>()?;
    let before = f.stats();
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let (f, want) = (f.clone(), want.clone());
            // Tensors are Send: each worker gets its own handles to the batches.
            let inputs: Vec<Tensor> = inputs.to_vec();
            std::thread::spawn(move || -> kiln::Result<usize> {
                let mut mismatches = 0;
                for i in 0..1000 {
                    let k = (i + t) % inputs.len();
                    let y = f.run(std::slice::from_ref(&inputs[k]))?.remove(0);
                    if y.to_f64_vec()? != want[k] {
                        mismatches += 1;
                    }
                }
                Ok(mismatches)
            })
        })
        .collect();
    for w in workers {
        assert_eq!(w.join().expect("worker panicked")?, 0);
    }
    let d = f.stats().since(&before);
    // One executable, one set of resident weights: nothing traced, compiled or uploaded again
    // besides the batches.
    assert_eq!((d.traces, d.compiles, d.executions), (0, 0, 4000));
    assert_eq!(d.h2d_transfers, 4000);
    assert_eq!(f.runtime().num_resident(), store.len());
    Ok(())
}

/// A function that writes a variable: calls on a shared handle are serialized, none is lost.
#[test]
fn a_shared_handle_serializes_calls_that_write_variables() -> kiln::Result<()> {
    let store = ParamStore::new();
    let c = Counter::new(&store)?;
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![c.forward(&xs[0])?])
    })
    .shared();
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let f = f.clone();
            std::thread::spawn(move || -> kiln::Result<()> {
                let x = Tensor::from_slice(&[2], &[1.0f64, 0.5])?;
                for _ in 0..250 {
                    f.run(std::slice::from_ref(&x))?;
                }
                Ok(())
            })
        })
        .collect();
    for w in workers {
        w.join().expect("worker panicked")?;
    }
    f.sync_to_store()?;
    assert_eq!(store.get("count").unwrap().to_scalar()?, 1000.0);
    assert_eq!(store.get("total").unwrap().to_scalar()?, 1500.0);
    Ok(())
}

/// Calls per second on one shared handle from 1 and 2 threads (printed; run with
/// `--nocapture`). No assertion on time: the figures depend on the machine and its load.
#[test]
fn shared_handle_throughput_one_and_two_threads() -> kiln::Result<()> {
    let (_s, m) = mlp(42)?;
    let f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        Ok(vec![m.forward(&xs[0])?])
    })
    .shared();
    let inputs = batches()?;
    for _ in 0..200 {
        f.run(&inputs[..1])?;
    }
    let calls = 2000;
    // Best of three interleaved rounds per thread count (the machine may be shared).
    let mut rates = [0.0f64; 2];
    for _round in 0..3 {
        for (slot, threads) in [1usize, 2].into_iter().enumerate() {
            let t0 = std::time::Instant::now();
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    let f = f.clone();
                    let x = inputs[0].clone();
                    std::thread::spawn(move || -> kiln::Result<()> {
                        for _ in 0..calls / threads {
                            f.run(std::slice::from_ref(&x))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            for w in workers {
                w.join().expect("worker panicked")?;
            }
            rates[slot] = rates[slot].max(calls as f64 / t0.elapsed().as_secs_f64());
        }
    }
    println!(
        "shared handle, mlp 10-32-10 batch 4: {:.0} calls/s on 1 thread, {:.0} calls/s on 2 threads",
        rates[0], rates[1]
    );
    Ok(())
}

/// A value both returned and stored in a variable (a recurrent state, say) costs one download
/// per call and no device copy; the download reads the buffer the variable keeps (it is not
/// handed over, as a result nothing else reads is).
#[test]
fn a_value_returned_and_stored_moves_once() -> kiln::Result<()> {
    let store = ParamStore::new();
    let h = store
        .root()
        .buffer("h", &[3], Init::Const(0.0), DType::F32)?;
    let hh = h.clone();
    let mut f = compile(XlaBackend::new()?, move |xs: &[Tensor]| {
        let y = hh.add(&xs[0])?.tanh()?;
        hh.assign(&y)?;
        Ok(vec![y])
    });
    let x = Tensor::from_slice(&[3], &[0.1f32, 0.2, 0.3])?;
    f.run(std::slice::from_ref(&x))?;
    let before = f.stats();
    let mut eager = vec![0.0f64; 3];
    let mut last = Vec::new();
    for _ in 0..3 {
        last = f.run(std::slice::from_ref(&x))?.remove(0).to_f64_vec()?;
    }
    let d = f.stats().since(&before);
    assert_eq!((d.h2d_transfers, d.d2h_transfers), (3, 3));
    for _ in 0..4 {
        for (e, xi) in eager.iter_mut().zip([0.1f32, 0.2, 0.3]) {
            *e = ((*e as f32) + xi).tanh() as f64;
        }
    }
    for (a, b) in last.iter().zip(&eager) {
        assert!((a - b).abs() < 1e-6, "{last:?} vs {eager:?}");
    }
    f.sync_to_store()?;
    assert_eq!(h.to_f64_vec()?, last);
    Ok(())
}

/// Uploads of eager tensors ([`Backend::tensor_to_device`]): straight from the memory of a
/// contiguous CPU tensor of the element type, through a host copy otherwise (views, `u32`
/// held as `i64`); every case reads back as the tensor's own values and type.
#[test]
fn uploads_of_eager_tensors_read_back_their_values() -> kiln::Result<()> {
    use tch::{Device, Kind};
    let xla = XlaBackend::new()?;
    let base = Tensor::randn(&[6, 5], 3)?;
    let b = base.as_tch()?;
    let cases = [
        ("contiguous f32", base.clone()),
        ("transposed view", Tensor::from_tch(b.tr())?),
        (
            "rows 2..5 (storage offset)",
            Tensor::from_tch(b.narrow(0, 2, 3))?,
        ),
        ("f64", Tensor::from_tch(b.to_kind(Kind::Double))?),
        (
            "i64",
            Tensor::from_tch(tch::Tensor::arange(12, (Kind::Int64, Device::Cpu)).view([3, 4]))?,
        ),
        ("u32", Tensor::from_slice(&[3], &[1u32, 7, u32::MAX])?),
        ("bool", Tensor::from_slice(&[2], &[true, false])?),
        (
            "empty",
            Tensor::from_tch(tch::Tensor::zeros([0, 4], (Kind::Float, Device::Cpu)))?,
        ),
        ("scalar", Tensor::from_slice(&[], &[2.5f32])?),
    ];
    for (name, t) in cases {
        let buf = xla.tensor_to_device(&t)?;
        assert_eq!(xla.buffer_type(&buf)?, *t.ty(), "{name}");
        assert_eq!(
            xla.to_host(&buf)?.bytes(),
            t.to_host()?.bytes(),
            "{name}: the device copy differs"
        );
    }
    Ok(())
}
