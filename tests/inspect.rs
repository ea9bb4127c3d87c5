//! Every stage of a compiled program as text (`CompiledFn::inspect`, `TrainStep::inspect`,
//! `KILN_DUMP`'s writer), and results left on the device (`CompiledFn::run_on_device`).

use kiln::backend::eager::EagerBackend;
use kiln::backend::registry::{BackendRegistry, DynBackend};
use kiln::backend::xla::{FfiMode, XlaBackend, XlaOptions};
use kiln::backend::Backend;
use kiln::nn::{Init, Linear, Module, ParamStore};
use kiln::optim::Sgd;
use kiln::runtime::ExecutableCache;
use kiln::train::{TrainMode, TrainStep};
use kiln::{compile, compile_with, DType, Runtime, Tensor, TraceMode};
use std::path::PathBuf;

fn tmpdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kiln-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `relu(x · w)` with `w` a parameter stored `[in, out]`, on plain XLA (every dot a
/// `stablehlo.dot_general`, no libtorch kernels).
fn matmul_fn() -> kiln::Result<kiln::CompiledFn<XlaBackend>> {
    let store = ParamStore::with_seed(3);
    let w = store.root().param(
        "w",
        &[8, 4],
        Init::Normal {
            mean: 0.0,
            std: 1.0,
        },
    )?;
    let backend = XlaBackend::new()?.with_options(XlaOptions::plain());
    Ok(compile(backend, move |xs: &[Tensor]| {
        Ok(vec![xs[0].matmul(&w)?.relu()?])
    }))
}

#[test]
fn a_compiled_function_shows_every_stage() -> kiln::Result<()> {
    let f = matmul_fn()?;
    let x = Tensor::randn(&[2, 8], 1)?;
    let i = f.inspect(std::slice::from_ref(&x))?;
    // Inspecting compiles but runs nothing.
    assert_eq!((f.stats().compiles, f.stats().executions), (1, 0));
    assert_eq!(i.name(), "function");
    assert_eq!(
        i.stage_names(),
        vec!["graph", "dot", "stablehlo", "optimized_hlo"]
    );
    assert!(
        i.text("graph")?.contains("dot_general"),
        "{}",
        i.text("graph")?
    );
    let dot = i.text("dot")?;
    assert!(
        dot.starts_with("digraph") && dot.trim_end().ends_with('}'),
        "{dot}"
    );
    let mlir = i.text("stablehlo")?;
    assert!(mlir.contains("stablehlo.dot_general"), "{mlir}");
    assert!(mlir.contains("func.func"), "{mlir}");
    let hlo = i.text("optimized_hlo")?;
    println!("{hlo}");
    assert!(hlo.starts_with("HloModule "), "{hlo}");
    assert!(hlo.contains("\nENTRY %"), "{hlo}");
    assert!(hlo.contains(" parameter(0)"), "{hlo}");
    assert!(hlo.contains("ROOT %"), "{hlo}");
    // XLA keeps a dot (possibly inside a fusion) and fuses the relu: `maximum` somewhere.
    assert!(
        hlo.contains(" dot(") && hlo.contains("lhs_contracting_dims={1}"),
        "{hlo}"
    );
    assert!(hlo.contains("maximum("), "{hlo}");
    // The same program is the one the function then runs: its fingerprint is the cache key.
    let y = f.run_on_device(std::slice::from_ref(&x))?.to_host()?;
    assert_eq!(y[0].dims(), &[2, 4]);
    assert_eq!(f.stats().compiles, 1);
    assert_eq!(
        f.program(&[x.ty().clone()]).unwrap().fingerprint,
        i.fingerprint()
    );
    // An unknown stage names the known ones.
    let err = i.text("llvm").unwrap_err().to_string();
    assert!(err.contains("optimized_hlo"), "{err}");
    Ok(())
}

/// With every dot on libtorch's kernels, both the StableHLO and the optimized HLO show the
/// custom call (on a plugin that runs them; otherwise the backend lowers to XLA and says why).
#[test]
fn libtorch_kernels_appear_as_custom_calls() -> kiln::Result<()> {
    let backend = XlaBackend::new()?.with_options(XlaOptions::default().ffi(FfiMode::All));
    if let Err(why) = backend.ffi_status() {
        println!("skipped: the plugin does not run kiln's kernels: {why}");
        return Ok(());
    }
    let store = ParamStore::with_seed(3);
    let fc = Linear::new(&store.root().sub("fc"), 8, 4, false)?;
    let f = compile(backend, move |xs: &[Tensor]| Ok(vec![fc.forward(&xs[0])?]));
    let i = f.inspect(&[Tensor::randn(&[2, 8], 1)?])?;
    let mlir = i.text("stablehlo")?;
    assert!(
        mlir.contains("call_target_name = \"kiln_dot_v1\""),
        "{mlir}"
    );
    let hlo = i.text("optimized_hlo")?;
    assert!(
        hlo.contains(" custom-call(") && hlo.contains("custom_call_target=\"kiln_dot_v1\""),
        "{hlo}"
    );
    assert!(hlo.contains("api_version=API_VERSION_TYPED_FFI"), "{hlo}");
    Ok(())
}

#[test]
fn writing_an_inspection_leaves_one_file_per_stage() -> kiln::Result<()> {
    let f = matmul_fn()?;
    let x = Tensor::randn(&[2, 8], 1)?;
    let i = f.inspect(&[x])?;
    let dir = tmpdir("inspect-dump");
    let files = i.write_to(&dir)?;
    let fp = i.fingerprint().to_hex();
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec![
            format!("{fp}.graph.txt"),
            format!("{fp}.dot"),
            format!("{fp}.stablehlo.mlir"),
            format!("{fp}.optimized.hlo.txt"),
        ]
    );
    for (file, stage) in files.iter().zip(i.stages()) {
        let on_disk = std::fs::read_to_string(file).unwrap();
        assert_eq!(&on_disk, stage.text.as_ref().unwrap());
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn the_dump_function_writes_what_kiln_dump_would() -> kiln::Result<()> {
    let backend = XlaBackend::new()?.with_options(XlaOptions::plain());
    let f = matmul_fn()?;
    let x = Tensor::randn(&[2, 8], 1)?;
    let program = {
        f.inspect(std::slice::from_ref(&x))?;
        f.program(&[x.ty().clone()]).unwrap()
    };
    // An executable compiled by another backend instance of the same plugin and options.
    let exe = Backend::compile(&backend, &program.graph)?;
    let dir = tmpdir("kiln-dump");
    let files = kiln::inspect::dump(&backend, &dir, &program.graph, program.fingerprint, &exe)?;
    assert_eq!(files.len(), 4);
    let mlir = std::fs::read_to_string(dir.join(format!("{}.stablehlo.mlir", program.fingerprint)))
        .unwrap();
    assert!(mlir.contains("stablehlo.dot_general"));
    // A directory that cannot be created is an error naming it (KILN_DUMP logs it instead).
    let blocked = files[0].join("below-a-file");
    let err = kiln::inspect::dump(
        &backend,
        &blocked,
        &program.graph,
        program.fingerprint,
        &exe,
    )
    .unwrap_err();
    assert!(err.to_string().contains("below-a-file"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn an_executable_loaded_from_the_disk_cache_shows_every_stage() -> kiln::Result<()> {
    let dir = tmpdir("inspect-disk-cache");
    let x = Tensor::randn(&[2, 8], 1)?;
    let build = || -> kiln::Result<_> {
        let store = ParamStore::with_seed(3);
        let w = store.root().param(
            "w",
            &[8, 4],
            Init::Normal {
                mean: 0.0,
                std: 1.0,
            },
        )?;
        let backend = XlaBackend::new()?.with_options(XlaOptions::plain());
        let rt = Runtime::with_cache(backend, ExecutableCache::with_dir(&dir)?);
        Ok(compile_with(rt, move |xs: &[Tensor]| {
            Ok(vec![xs[0].matmul(&w)?.relu()?])
        }))
    };
    let compiled = build()?.inspect(std::slice::from_ref(&x))?;
    let f = build()?;
    let loaded = f.inspect(std::slice::from_ref(&x))?;
    assert_eq!((f.stats().compiles, f.stats().disk_hits), (0, 1));
    // The StableHLO is lowered again from the graph (the cache keeps only the executable).
    for stage in ["graph", "stablehlo", "optimized_hlo"] {
        assert_eq!(loaded.text(stage)?, compiled.text(stage)?, "{stage}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

/// A least-squares loss over one `Linear`.
fn train_step(mode: TrainMode) -> kiln::Result<TrainStep<XlaBackend>> {
    let store = ParamStore::with_seed(5);
    let fc = Linear::new(&store.root().sub("fc"), 6, 3, true)?;
    TrainStep::new(
        XlaBackend::new()?,
        &store,
        Sgd::new(),
        move |xs: &[Tensor]| {
            fc.forward_t(&xs[0], true)?
                .sub(&xs[1])?
                .square()?
                .mean_all()
        },
    )
    .map(|s| s.with_mode(mode))
}

#[test]
fn a_train_step_shows_each_of_its_programs() -> kiln::Result<()> {
    let batch = [Tensor::randn(&[4, 6], 1)?, Tensor::randn(&[4, 3], 2)?];
    for (mode, names) in [
        (TrainMode::Split, vec!["forward", "backward", "optimizer"]),
        (TrainMode::Fused, vec!["fused"]),
    ] {
        let mut step = train_step(mode)?;
        let programs = step.inspect(&batch)?;
        let got: Vec<&str> = programs.iter().map(|p| p.name()).collect();
        assert_eq!(got, names);
        for p in &programs {
            assert!(p.text("graph")?.starts_with("graph("), "{}", p.name());
            assert!(p.text("stablehlo")?.contains("func.func"), "{}", p.name());
            assert!(p.text("optimized_hlo")?.contains("ENTRY"), "{}", p.name());
        }
        // The optimizer's update donates the parameters: XLA aliases them.
        let last = programs.last().unwrap().text("optimized_hlo")?;
        assert!(last.contains("input_output_alias="), "{last}");
        // A step after inspecting reuses the programs.
        step.step(&batch)?;
        assert_eq!(step.stats().compiles as usize, names.len());
    }
    Ok(())
}

#[test]
fn through_the_registry_and_on_the_eager_backend() -> kiln::Result<()> {
    let registry = BackendRegistry::with_builtins();
    let x = Tensor::randn(&[2, 5], 3)?;
    let f = registry.get("eager")?.compile(
        Box::new(|xs: &[Tensor]| Ok(vec![xs[0].exp()?])),
        TraceMode::Once,
    )?;
    let i = f.inspect(std::slice::from_ref(&x))?;
    assert_eq!(i.stage_names(), vec!["graph", "dot"]);
    let y = f.run_on_device(std::slice::from_ref(&x))?;
    assert_eq!(y.len(), 1);
    y.synchronize()?;
    let y = y.to_host()?;
    assert_eq!(y[0].to_f64_vec()?, x.exp()?.to_f64_vec()?);
    Ok(())
}

/// `state += sum(x)` and returns `(x * state, 2 * state, x, x * state)`: a variable update, the
/// caller's argument returned unchanged, and one value returned twice.
fn accumulator<B: Backend>(backend: B) -> kiln::Result<(ParamStore, kiln::CompiledFn<B>)> {
    let store = ParamStore::new();
    let state = store
        .root()
        .buffer("state", &[], Init::Const(1.0), DType::F32)?;
    let f = compile(backend, move |xs: &[Tensor]| {
        state.assign(&state.add(&xs[0].sum_all()?)?)?;
        let y = xs[0].mul(&state)?;
        Ok(vec![y.clone(), state.mul_scalar(2.0)?, xs[0].clone(), y])
    });
    Ok((store, f))
}

fn device_runs_match_host_runs<B: Backend>(make: impl Fn() -> kiln::Result<B>) -> kiln::Result<()> {
    let x = Tensor::randn(&[3, 4], 7)?;
    let xs = std::slice::from_ref(&x);
    let (_s1, mut host) = accumulator(make()?)?;
    let (_s2, device) = accumulator(make()?)?;
    // One call each: the same values, bit for bit.
    let a = host.run(xs)?;
    let b = device.run_on_device(xs)?;
    assert_eq!(b.len(), 4);
    assert!(b.buffer(0).is_some() && b.buffer(2).is_none());
    let b = b.to_host()?;
    for (p, q) in a.iter().zip(&b) {
        assert_eq!(p.to_f64_vec()?, q.to_f64_vec()?);
    }
    // N calls, fetching only the last: the same as N host calls (the state advanced N times).
    let n = 5;
    let before = device.stats();
    // Each call's outputs replace the previous ones, which are dropped while they may still
    // be being computed.
    let mut last = device.run_on_device(xs)?;
    for _ in 1..n {
        last = device.run_on_device(xs)?;
    }
    assert_eq!(device.stats().since(&before).d2h_transfers, 0);
    let fetched = last.to_host()?;
    let mut expect = Vec::new();
    for _ in 0..n {
        expect = host.run(xs)?;
    }
    for (p, q) in expect.iter().zip(&fetched) {
        assert_eq!(p.to_f64_vec()?, q.to_f64_vec()?);
    }
    let d = device.stats().since(&before);
    // Three downloads (the repeated value is downloaded once per result; the argument never).
    assert_eq!((d.executions, d.d2h_transfers), (n as u64, 3));
    assert!(last.get(4).is_err());
    Ok(())
}

#[test]
fn device_outputs_equal_run_on_xla() -> kiln::Result<()> {
    device_runs_match_host_runs(XlaBackend::new)
}

#[test]
fn device_outputs_equal_run_on_eager() -> kiln::Result<()> {
    device_runs_match_host_runs(|| Ok(EagerBackend::new()))
}

/// On the CPU plugin a graph whose reductions all run along short trailing rows (a layer
/// norm) compiles without XLA's tree reductions (no `reduce-window` in its optimized HLO),
/// one that also reduces over a leading dim keeps them; both agree with float64 eager.
#[test]
fn short_row_reductions_compile_without_the_tree() -> kiln::Result<()> {
    let backend = XlaBackend::new()?;
    if backend.platform() != "cpu" {
        println!("skipped: not the CPU plugin ({})", backend.platform());
        return Ok(());
    }
    let x = Tensor::randn(&[64, 256], 7)?
        .mul_scalar(3.0)?
        .add_scalar(1.5)?;
    fn ln(x: &Tensor) -> kiln::Result<Tensor> {
        x.layer_norm(&[256], None, None, 1e-5)
    }
    fn columns(x: &Tensor) -> kiln::Result<Tensor> {
        ln(x)?.mul(x)?.sum(&[0], false)
    }
    type Program = fn(&Tensor) -> kiln::Result<Tensor>;
    let cases: [(&str, Program, bool); 2] = [
        ("layer norm", ln, false),
        ("layer norm, then a column sum", columns, true),
    ];
    for (name, f, tree) in cases {
        let mut c = compile(backend.clone(), move |xs: &[Tensor]| Ok(vec![f(&xs[0])?]));
        let inspection = c.inspect(std::slice::from_ref(&x))?;
        let hlo = inspection.text("optimized_hlo")?;
        assert_eq!(hlo.contains("reduce-window"), tree, "{name}:\n{hlo}");
        let got = c.run(std::slice::from_ref(&x))?.remove(0).to_f64_vec()?;
        let want = f(&x.to_dtype(DType::F64)?)?.to_f64_vec()?;
        // Float32 rounding through 256-element reductions, worst case, at the output's scale.
        let scale = want.iter().fold(1.0f64, |m, v| m.max(v.abs()));
        let tol = 256.0 * f64::from(f32::EPSILON) * scale;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= tol, "{name}: [{i}] {g} vs {w}");
        }
    }
    Ok(())
}
