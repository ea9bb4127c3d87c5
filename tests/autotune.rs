//! The XLA backend's autotune end to end: a small resnet-like graph compiled with measured
//! per-node choices against a float64 eager reference, the rule mode, and a changed choice
//! changing the executable's cache key.

mod common;

use common::{floats, run, xla, SplitMix64};
use kiln::autograd::vjp;
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{Autotune, FfiMode, Lowering, XlaBackend, XlaOptions};
use kiln::backend::{Backend, HostTensor};
use kiln::ir::{ConvAttrs, DType, DotDims, Graph, InputKind, Op, Shape, TensorType, UnaryOp};
use kiln::runtime::ExecutableCache;

fn random(ty: &TensorType, seed: u64) -> HostTensor {
    let mut r = SplitMix64::mixed(seed);
    floats(ty.shape.dims(), ty.dtype, || r.uniform() * 2.0 - 1.0)
}

/// Measurement settings for tests: every node timed, few runs, memory only.
fn quick() -> Autotune {
    Autotune {
        min_flops: 0.0,
        reps: 2,
        dir: None,
        ..Autotune::on()
    }
}

fn conv(pad: i64, stride: usize, groups: usize) -> ConvAttrs {
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(pad, pad), (pad, pad)];
    c.strides = vec![stride, stride];
    c.feature_groups = groups;
    c
}

/// conv 3x3 16->32, tanh, depthwise 3x3, conv 1x1 stride 2 -> 64, flatten, `Linear` to 10;
/// and the first convolution's input and weight gradients for a given cotangent.
fn net(dtype: DType) -> Graph {
    let t = |d: &[usize]| TensorType::new(dtype, d);
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 12, 12]));
    let w1 = g.add_input(InputKind::Parameter, "w1", t(&[32, 16, 3, 3]));
    let w2 = g.add_input(InputKind::Parameter, "w2", t(&[32, 1, 3, 3]));
    let w3 = g.add_input(InputKind::Parameter, "w3", t(&[64, 32, 1, 1]));
    let l = g.add_input(InputKind::Parameter, "l", t(&[10, 64 * 36]));
    let y1 = g.add(Op::Conv(conv(1, 1, 1)), &[x, w1]).unwrap();
    let a1 = g.add(Op::Unary(UnaryOp::Tanh), &[y1]).unwrap();
    let y2 = g.add(Op::Conv(conv(1, 1, 32)), &[a1, w2]).unwrap();
    let y3 = g.add(Op::Conv(conv(0, 2, 1)), &[y2, w3]).unwrap();
    let f = g
        .add(Op::Reshape(Shape::from(vec![2usize, 64 * 36])), &[y3])
        .unwrap();
    let dims = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let out = g.add(Op::DotGeneral(dims), &[f, l]).unwrap();
    let ct = g.add_input(InputKind::Cotangent, "ct", g.node(y1).ty.clone());
    let grads = vjp(&mut g, y1, ct, &[true, true]).unwrap();
    g.set_outputs(vec![out, y2, grads[0].unwrap(), grads[1].unwrap()])
        .unwrap();
    g
}

fn inputs(g: &Graph) -> Vec<HostTensor> {
    g.inputs()
        .iter()
        .enumerate()
        .map(|(i, inp)| random(&inp.ty, 7 + i as u64))
        .collect()
}

fn max_rel_err(got: &[HostTensor], want: &[HostTensor]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| {
            let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
            let scale = b.iter().fold(1.0f64, |m, v| m.max(v.abs()));
            a.iter()
                .zip(&b)
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()))
                / scale
        })
        .fold(0.0, f64::max)
}

#[test]
fn autotuned_resnet_like_net_matches_the_f64_reference() {
    let b = xla().with_options(XlaOptions::default().autotune(quick()));
    assert!(b.autotuning() || b.ffi_status().is_err());
    let g = net(DType::F32);
    let ins = inputs(&g);
    let want = run(
        &EagerBackend::new(),
        &net(DType::F64),
        &ins.iter()
            .map(|h| HostTensor::from_slice(h.ty().shape.dims(), &h.to_f64_vec()).unwrap())
            .collect::<Vec<_>>(),
    );
    b.clear_autotune_report();
    // As kiln's runtime does: rewrite, then compile the rewritten graph.
    let mut r = g.clone();
    b.rewrite(&mut r).unwrap();
    r.verify().unwrap();
    // Rewriting the same graph again (trace every time) measures and reports nothing new
    // and gives the same graph.
    let (n, spent) = (b.autotune_report().len(), b.autotune_time());
    let mut again = g.clone();
    b.rewrite(&mut again).unwrap();
    assert_eq!(again.fingerprint(), r.fingerprint());
    assert_eq!(b.autotune_report().len(), n);
    assert_eq!(b.autotune_time(), spent);
    let got = run(&b, &r, &ins);
    let err = max_rel_err(&got, &want);
    assert!(err < 1e-4, "autotuned vs f64 eager: {err:.3e}");
    let report = b.autotune_report();
    // Forward convolutions (3), the input and weight gradients, the dot.
    let ops: Vec<&str> = report.iter().map(|c| c.op).collect();
    for op in ["conv", "conv dx", "conv dw", "dot"] {
        assert!(ops.contains(&op), "{op} missing from {ops:?}");
    }
    assert!(
        report.iter().any(|c| !c.micros.is_empty()),
        "nothing measured: {report:?}"
    );
    for c in &report {
        println!("{c}");
    }
    for c in b.autotune_graph_report() {
        println!("{c}");
    }
    // The graph compiled without the runtime's rewrite gets the same choices.
    let direct = run(&b, &g, &ins);
    assert!(max_rel_err(&direct, &want) < 1e-4);
    assert_eq!(b.lower(&g).unwrap(), b.lower(&r).unwrap());
}

#[test]
fn autotune_off_is_the_rule() {
    let off = xla().with_options(XlaOptions::default().autotune(Autotune::off()));
    assert!(!off.autotuning());
    assert!(off.cache_key().ends_with("/rule"), "{}", off.cache_key());
    let g = net(DType::F32);
    let ffi = off.effective_ffi();
    let kernels = kiln::backend::xla::kernels::rule_selection(&g, ffi);
    for (id, l) in off.choices(&g).unwrap() {
        let n = g.node(id);
        let (a, w) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        let want = match &n.op {
            // The rule in its graph (frozen weights make packed convolutions and linears).
            Op::Conv(_) | Op::DotGeneral(_) if kernels.contains(&id) => Lowering::Ffi,
            Op::Conv(c)
                if kiln::backend::xla::ConvStrategy::auto_rule(c, a, w)
                    == kiln::backend::xla::ConvLowering::Im2col =>
            {
                Lowering::Im2col
            }
            _ => Lowering::Xla,
        };
        assert_eq!(l, want, "node {id:?}: {}", n.op.name());
    }
    // Rule mode lowers exactly as the FFI rule did before autotune existed.
    let before = kiln::backend::xla::lower::lower_with_ffi(&g, ffi).unwrap();
    if ffi == FfiMode::Auto {
        // The rule's im2col convolutions (none here: few channels) would differ.
        assert_eq!(off.lower(&g).unwrap(), before);
    }
}

#[test]
fn a_changed_choice_changes_the_cache_key() {
    let dir = std::env::temp_dir().join(format!("kiln-autotune-key-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = XlaOptions::default().autotune(Autotune {
        dir: Some(dir.clone()),
        check_graphs: false,
        reps: 1,
        ..quick()
    });
    let t = |d: &[usize]| TensorType::new(DType::F32, d);
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 8, 8]));
    let w = g.add_input(InputKind::Parameter, "w", t(&[16, 16, 3, 3]));
    let y = g.add(Op::Conv(conv(1, 1, 1)), &[x, w]).unwrap();
    g.set_outputs(vec![y]).unwrap();
    let cache: ExecutableCache<XlaBackend> = ExecutableCache::with_dir(dir.join("exe")).unwrap();

    // A fresh client (its own choice table) measures and stores the choice.
    let a = XlaBackend::new().unwrap().with_options(opts.clone());
    if a.ffi_status().is_err() {
        return; // no kernels on this plugin: XLA vs im2col only, covered by unit tests
    }
    let mut ga = g.clone();
    a.rewrite(&mut ga).unwrap();
    let path_a = cache
        .entry_path(&a, &ga, &ga.fingerprint())
        .unwrap()
        .unwrap();
    let file = dir.join(kiln::backend::xla::autotune::FILE_NAME);
    let text = std::fs::read_to_string(&file).unwrap();
    // The convolution's line (an im2col choice adds its product's).
    let line = text
        .lines()
        .find(|l| l.contains(" # conv "))
        .unwrap_or_else(|| panic!("no convolution choice in {text}"));
    let was = Lowering::parse(line.split_whitespace().nth(1).unwrap()).unwrap();
    let flipped = if was == Lowering::Ffi {
        Lowering::Xla
    } else {
        Lowering::Ffi
    };
    let edited = text.replacen(
        line,
        &line.replacen(&format!(" {was} "), &format!(" {flipped} "), 1),
        1,
    );
    std::fs::write(&file, edited).unwrap();

    // Another process (here: another client) reads the edited choice and keys accordingly.
    let b = XlaBackend::new().unwrap().with_options(opts);
    let mut gb = g.clone();
    b.rewrite(&mut gb).unwrap();
    let report = b.autotune_report();
    let conv_choice = report.iter().find(|c| c.op == "conv").unwrap();
    assert_eq!(conv_choice.lowering, flipped);
    assert_eq!(
        conv_choice.source,
        kiln::backend::xla::autotune::Source::Cached
    );
    let path_b = cache
        .entry_path(&b, &gb, &gb.fingerprint())
        .unwrap()
        .unwrap();
    assert_ne!(
        path_a, path_b,
        "a changed choice must not reuse the executable"
    );
    let lowered = b.lower(&gb).unwrap();
    assert_eq!(lowered.contains("custom_call"), flipped == Lowering::Ffi);
    // Same choices, same key: a third client with the same file reuses b's entry.
    let c = XlaBackend::new().unwrap().with_options(b.options().clone());
    let mut gc = g.clone();
    c.rewrite(&mut gc).unwrap();
    assert_eq!(
        cache
            .entry_path(&c, &gc, &gc.fingerprint())
            .unwrap()
            .unwrap(),
        path_b
    );
    let ins = inputs(&g);
    let want = run(&a, &ga, &ins);
    let got = run(&b, &gb, &ins);
    assert!(max_rel_err(&got, &want) < 1e-5);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The whole-graph check times a frozen-weight graph as a compiled function runs it: the
/// packed weights of its convolutions are kept after the first run and reused (they used
/// to be packed afresh on every timed run, which made the rule's graph look 3-5x slower
/// than it runs: resnet18 inference 26-41 ms against 6.5 ms).
#[test]
fn the_whole_graph_check_reuses_packed_weights() {
    use kiln::backend::xla::kernels;
    if !kernels::packed_conv_enabled() {
        return;
    }
    let t = |d: &[usize]| TensorType::new(DType::F32, d);
    let mut g = Graph::new();
    // 3x3 64->64 on 16x16, batch 2: 38 MFLOP each, enough for the rule to pack them.
    let x = g.add_input(InputKind::Data, "x", t(&[2, 64, 16, 16]));
    let mut h = x;
    for i in 0..3 {
        let w = g.add_input(InputKind::Parameter, format!("w{i}"), t(&[64, 64, 3, 3]));
        let y = g.add(Op::Conv(conv(1, 1, 1)), &[h, w]).unwrap();
        h = g.add(Op::Unary(UnaryOp::Tanh), &[y]).unwrap();
    }
    g.set_outputs(vec![h]).unwrap();
    let b = XlaBackend::new()
        .unwrap()
        .with_options(XlaOptions::default().autotune(quick()));
    let before = kernels::weight_cache_stats();
    b.compile(&g).unwrap();
    let after = kernels::weight_cache_stats();
    let report = b.autotune_graph_report();
    assert!(
        report.iter().any(|c| c.millis.len() > 1),
        "the whole graph was timed under several choices: {report:?}"
    );
    let packs = after.packs - before.packs;
    let uncached = after.uncached - before.uncached;
    assert!(packs > 0, "the check ran packed convolutions");
    // Each timed variant's first run packs (and keeps) its three weights; other tests of
    // this binary running meanwhile may pack a few without keeping them.
    assert!(
        uncached <= 6,
        "{uncached} of {packs} packs during the whole-graph check were not kept"
    );
}
