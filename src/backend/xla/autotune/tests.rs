//! Autotune's decisions with an injected timer (no plugin needed), its choice file and keys.

use super::*;
use crate::backend::xla::kernels::serial_kernels;
use crate::ir::{ConvAttrs, DotDims, TensorType};
use std::cell::RefCell;

fn t(d: &[usize]) -> TensorType {
    TensorType::new(DType::F32, d)
}

fn padded(groups: usize) -> ConvAttrs {
    let mut c = ConvAttrs::plain(2);
    c.padding = vec![(1, 1), (1, 1)];
    c.feature_groups = groups;
    c
}

/// Two identical 3x3 64->64 convolutions on 16x16 (75 MFLOP each), a tiny one (0.3 MFLOP,
/// below the threshold), a tiny depthwise one (grouped: timed however small) and a
/// `Linear`-layout dot (2 MFLOP). The kernels are passed per call (`Data`), as a training
/// step's updated weights are: frozen ones would make every convolution a packed one.
fn graph() -> (Graph, [NodeId; 5]) {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t(&[4, 64, 16, 16]));
    let w = g.add_input(InputKind::Data, "w", t(&[64, 64, 3, 3]));
    let w2 = g.add_input(InputKind::Data, "w2", t(&[64, 64, 3, 3]));
    let small_x = g.add_input(InputKind::Data, "sx", t(&[1, 4, 8, 8]));
    let small_w = g.add_input(InputKind::Data, "sw", t(&[4, 4, 3, 3]));
    let dw_w = g.add_input(InputKind::Data, "dw", t(&[64, 1, 3, 3]));
    let a = g.add_input(InputKind::Data, "a", t(&[4, 1024]));
    let l = g.add_input(InputKind::Parameter, "l", t(&[256, 1024]));
    let c1 = g.add(Op::Conv(padded(1)), &[x, w]).unwrap();
    let c2 = g.add(Op::Conv(padded(1)), &[c1, w2]).unwrap();
    let c3 = g.add(Op::Conv(padded(1)), &[small_x, small_w]).unwrap();
    let c4 = g.add(Op::Conv(padded(64)), &[c2, dw_w]).unwrap();
    let dims = DotDims {
        lhs_batch: vec![],
        rhs_batch: vec![],
        lhs_contract: vec![1],
        rhs_contract: vec![1],
    };
    let d = g.add(Op::DotGeneral(dims), &[a, l]).unwrap();
    g.set_outputs(vec![c4, c3, d]).unwrap();
    (g, [c1, c2, c3, c4, d])
}

fn caps() -> Caps {
    Caps {
        ffi: FfiMode::Auto,
        conv: ConvStrategy::Auto,
    }
}

fn settings() -> Autotune {
    Autotune {
        enabled: true,
        min_flops: 2e6,
        reps: 3,
        margin: 0.25,
        budget: Duration::from_secs(3600),
        dir: None,
        check_graphs: true,
    }
}

/// A timer with fixed µs per (op of the site's node, lowering), counting calls.
struct FakeTimer {
    calls: RefCell<Vec<(String, Lowering)>>,
    table: Vec<(&'static str, Lowering, f64)>,
}

impl FakeTimer {
    fn new(table: Vec<(&'static str, Lowering, f64)>) -> Self {
        FakeTimer {
            calls: RefCell::new(Vec::new()),
            table,
        }
    }

    fn time(&self, g: &Graph, node: NodeId, l: Lowering) -> Result<f64> {
        let kind = match &g.node(node).op {
            Op::Conv(c) if c.feature_groups > 1 => "depthwise",
            Op::Conv(_) => "conv",
            Op::DotGeneral(_) => "dot",
            o => panic!("timed a {}", o.name()),
        };
        self.calls.borrow_mut().push((kind.to_string(), l));
        self.table
            .iter()
            .find(|(k, x, _)| *k == kind && *x == l)
            .map(|e| e.2)
            .ok_or_else(|| Error::Invalid(format!("no time for {kind} {l}")))
    }
}

fn choose(
    tuner: &mut Tuner,
    g: &Graph,
    s: &Autotune,
    timer: &FakeTimer,
) -> HashMap<NodeId, (Lowering, Option<[u8; 32]>)> {
    let mut f = |g: &Graph, n: NodeId, l: Lowering, _cap: f64| timer.time(g, n, l);
    tuner
        .choose(g, &caps(), s, "test-context", &mut f, &|_| true)
        .unwrap()
        .into_iter()
        .map(|(n, l, k)| (n, (l, k)))
        .collect()
}

fn times() -> Vec<(&'static str, Lowering, f64)> {
    vec![
        ("conv", Lowering::Xla, 1000.0),
        ("conv", Lowering::Im2col, 900.0),
        ("conv", Lowering::Ffi, 400.0),
        ("depthwise", Lowering::Xla, 800.0),
        ("depthwise", Lowering::Ffi, 700.0),
        ("dot", Lowering::Xla, 300.0),
        ("dot", Lowering::Ffi, 100.0),
    ]
}

#[test]
fn decide_keeps_earlier_lowerings_unless_beaten_by_the_margin() {
    use Lowering::*;
    assert_eq!(decide(&[(Xla, 100.0), (Ffi, 80.0)], 0.25), Some(Xla));
    assert_eq!(decide(&[(Xla, 100.0), (Ffi, 74.0)], 0.25), Some(Ffi));
    assert_eq!(
        decide(&[(Ffi, 10.0), (Xla, 100.0), (Im2col, 50.0)], 0.25),
        Some(Ffi)
    );
    // im2col wins over XLA, then libtorch must beat im2col by the margin too.
    assert_eq!(
        decide(&[(Xla, 100.0), (Im2col, 50.0), (Ffi, 45.0)], 0.25),
        Some(Im2col)
    );
    assert_eq!(
        decide(&[(Xla, f64::INFINITY), (Ffi, 45.0)], 0.25),
        Some(Ffi)
    );
    assert_eq!(decide(&[(Xla, f64::NAN)], 0.25), None);
    assert_eq!(decide(&[], 0.25), None);
    assert_eq!(
        decide_variant(&[
            (Variant::PureXla, 5.0),
            (Variant::Tuned, 5.0),
            (Variant::Rule, 6.0)
        ]),
        Some(Variant::Tuned)
    );
    assert_eq!(
        decide_variant(&[(Variant::Tuned, f64::INFINITY), (Variant::Rule, 6.0)]),
        Some(Variant::Rule)
    );
}

#[test]
fn tuner_times_each_distinct_site_once_and_picks_deterministically() {
    let (g, [c1, c2, c3, c4, d]) = graph();
    let timer = FakeTimer::new(times());
    let mut tuner = Tuner::default();
    let got = choose(&mut tuner, &g, &settings(), &timer);
    // c1 and c2 have the same site (input of the same type, same weights' type): timed once,
    // with all three candidates; the tiny convolution is not timed.
    let calls = timer.calls.borrow().clone();
    let count = |k: &str| calls.iter().filter(|c| c.0 == k).count();
    assert_eq!(count("conv"), 3, "{calls:?}");
    assert_eq!(count("depthwise"), 2, "{calls:?}");
    assert_eq!(count("dot"), 2, "{calls:?}");
    assert_eq!(got[&c1].0, Lowering::Ffi);
    assert_eq!(got[&c2].0, Lowering::Ffi);
    assert_eq!(got[&c1].1, got[&c2].1);
    assert!(got[&c1].1.is_some());
    // Below the threshold: the rule (XLA), no key.
    assert_eq!(got[&c3], (Lowering::Xla, None));
    // 700 vs 800 is within the margin: XLA.
    assert_eq!(got[&c4].0, Lowering::Xla);
    assert_eq!(got[&d].0, Lowering::Ffi);
    let sources: Vec<Source> = tuner.report.iter().map(|c| c.source).collect();
    assert_eq!(
        sources,
        [
            Source::Measured,
            Source::Cached,
            Source::Rule,
            Source::Measured,
            Source::Measured
        ]
    );
    assert_eq!(tuner.report[0].micros.len(), 3);
    // Same timings, fresh table: same choices.
    let again = choose(
        &mut Tuner::default(),
        &g,
        &settings(),
        &FakeTimer::new(times()),
    );
    assert_eq!(again, got);
    // Other timings change the choice: libtorch no longer beats XLA by the margin...
    let mut other = times();
    other[2].2 = 800.0;
    let changed = choose(
        &mut Tuner::default(),
        &g,
        &settings(),
        &FakeTimer::new(other.clone()),
    );
    assert_eq!(changed[&c1].0, Lowering::Xla);
    // ... or im2col does, and libtorch does not beat im2col by the margin.
    other[1].2 = 500.0;
    other[2].2 = 450.0;
    let changed = choose(
        &mut Tuner::default(),
        &g,
        &settings(),
        &FakeTimer::new(other),
    );
    assert_eq!(changed[&c1].0, Lowering::Im2col);
    // A candidate that fails to time is skipped.
    let mut failing = times();
    failing.retain(|e| !(e.0 == "dot" && e.1 == Lowering::Ffi));
    let f = choose(
        &mut Tuner::default(),
        &g,
        &settings(),
        &FakeTimer::new(failing),
    );
    assert_eq!(f[&d].0, Lowering::Xla);
}

#[test]
fn rule_mode_and_spent_budget_give_the_rules_choices_without_timing() {
    let (g, nodes) = graph();
    let rule = |id: NodeId| {
        let n = g.node(id);
        let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        match &n.op {
            Op::Conv(_) if rule_selection(&g, FfiMode::Auto).contains(&id) => Lowering::Ffi,
            Op::Conv(c) if ConvStrategy::auto_rule(c, a, b) == ConvLowering::Im2col => {
                Lowering::Im2col
            }
            Op::DotGeneral(d) if FfiMode::Auto.dot(d, a, b) => Lowering::Ffi,
            _ => Lowering::Xla,
        }
    };
    for s in [
        Autotune {
            enabled: false,
            ..settings()
        },
        Autotune {
            budget: Duration::ZERO,
            ..settings()
        },
    ] {
        let timer = FakeTimer::new(Vec::new());
        let got = choose(&mut Tuner::default(), &g, &s, &timer);
        assert!(timer.calls.borrow().is_empty());
        for id in nodes {
            assert_eq!(got[&id].0, rule(id), "node {id:?} under {s:?}");
        }
    }
    // The rule of this graph: the depthwise convolution and the large ungrouped forward one
    // (3×3, 75 MFLOP) to libtorch; the small one stays in XLA.
    assert_eq!(rule(nodes[0]), Lowering::Ffi);
    assert_eq!(rule(nodes[2]), Lowering::Xla);
    assert_eq!(rule(nodes[3]), Lowering::Ffi);
    // FfiMode::All fixes every choice: nothing to tune.
    let all = Caps {
        ffi: FfiMode::All,
        conv: ConvStrategy::Auto,
    };
    assert!(!all.tunable());
    assert!(caps().tunable());
}

/// Where the rule's kernels would run serially (here: beside a 2 GFLOP product XLA keeps),
/// its ungrouped convolutions go to XLA; the depthwise one and the dot stay kernels.
#[test]
fn rule_keeps_only_grouped_convolutions_among_serial_kernels() {
    let rule = Autotune {
        enabled: false,
        ..settings()
    };
    for big_dot in [false, true] {
        let (mut g, [c1, c2, c3, c4, d]) = graph();
        if big_dot {
            let a = g.add_input(InputKind::Data, "ba", t(&[1024, 1024]));
            let b = g.add_input(InputKind::Data, "bb", t(&[1024, 1024]));
            let dims = DotDims {
                lhs_batch: vec![],
                rhs_batch: vec![],
                lhs_contract: vec![1],
                rhs_contract: vec![0],
            };
            let p = g.add(Op::DotGeneral(dims), &[a, b]).unwrap();
            let mut outs = g.outputs().to_vec();
            outs.push(p);
            g.set_outputs(outs).unwrap();
        }
        let got = choose(
            &mut Tuner::default(),
            &g,
            &rule,
            &FakeTimer::new(Vec::new()),
        );
        let kernels: HashSet<NodeId> = got
            .iter()
            .filter(|(_, c)| c.0 == Lowering::Ffi)
            .map(|(&n, _)| n)
            .collect();
        let conv = if big_dot {
            Lowering::Xla
        } else {
            Lowering::Ffi
        };
        let want = [conv, conv, Lowering::Xla, Lowering::Ffi, Lowering::Ffi];
        for (id, want) in [c1, c2, c3, c4, d].into_iter().zip(want) {
            assert_eq!(got[&id].0, want, "node {id:?}, big product: {big_dot}");
        }
        // Serial still: the depthwise convolution and the dot are a small share.
        assert_eq!(serial_kernels(&g, &kernels), big_dot);
    }
}

#[test]
fn choices_round_trip_through_the_file_and_are_not_timed_again() {
    let dir = std::env::temp_dir().join(format!("kiln-autotune-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (g, [c1, _, _, c4, d]) = graph();
    let mut first = Tuner::default();
    let got = choose(&mut first, &g, &settings(), &FakeTimer::new(times()));
    first.save(&dir);
    let text = std::fs::read_to_string(dir.join(FILE_NAME)).unwrap();
    assert_eq!(
        text.lines().filter(|l| !l.starts_with("//")).count(),
        3,
        "{text}"
    );
    assert!(
        text.contains("ffi xla=1000.0,im2col=900.0,ffi=400.0 # conv "),
        "{text}"
    );
    // A malformed line is skipped, not fatal.
    std::fs::write(dir.join(FILE_NAME), format!("{text}garbage line\n")).unwrap();
    let mut second = Tuner::default();
    second.load(&dir);
    let timer = FakeTimer::new(Vec::new());
    let again = choose(&mut second, &g, &settings(), &timer);
    assert!(
        timer.calls.borrow().is_empty(),
        "{:?}",
        timer.calls.borrow()
    );
    assert_eq!(again, got);
    assert_eq!(second.report[0].source, Source::Cached);
    assert_eq!(second.report[0].micros, first.report[0].micros);
    // Another context (plugin, CPU, options) has other keys: timed anew.
    let timer = FakeTimer::new(times());
    let mut f = |g: &Graph, n: NodeId, l: Lowering, _cap: f64| timer.time(g, n, l);
    second
        .choose(&g, &caps(), &settings(), "other", &mut f, &|_| false)
        .unwrap();
    assert_eq!(timer.calls.borrow().len(), 7);
    let _ = (c1, c4, d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_digest_changes_when_a_choice_changes() {
    let k1 = [1u8; 32];
    let k2 = [2u8; 32];
    let a = choices_digest(&[(k1, Lowering::Ffi), (k2, Lowering::Xla)]);
    assert_eq!(
        a,
        choices_digest(&[(k2, Lowering::Xla), (k1, Lowering::Ffi)])
    );
    assert_ne!(
        a,
        choices_digest(&[(k1, Lowering::Xla), (k2, Lowering::Xla)])
    );
    assert_ne!(a, choices_digest(&[(k1, Lowering::Ffi)]));
    assert_ne!(Autotune::on().key(), Autotune::off().key());
}

#[test]
fn env_values_turn_autotune_on_or_off() {
    assert!(!enabled_by(None));
    for off in ["off", "OFF", "0", "false", "no", "rule", ""] {
        assert!(!enabled_by(Some(off)), "{off}");
    }
    for on in ["on", "1", "true", "yes"] {
        assert!(enabled_by(Some(on)), "{on}");
    }
}

#[test]
fn weight_gradient_sites_cover_the_transposes_that_absorb_them() {
    let mut g = Graph::new();
    let x = g.add_input(InputKind::Data, "x", t(&[2, 16, 8, 8]));
    let w = g.add_input(InputKind::Parameter, "w", t(&[16, 16, 3, 3]));
    let y = g.add(Op::Conv(padded(1)), &[x, w]).unwrap();
    let ct = g.add_input(InputKind::Cotangent, "ct", g.node(y).ty.clone());
    let grads = crate::autograd::vjp(&mut g, y, ct, &[true, true]).unwrap();
    let (dx, dw) = (grads[0].unwrap(), grads[1].unwrap());
    g.set_outputs(vec![y, dx, dw]).unwrap();
    let sites: Vec<Site> = g
        .topo_order()
        .into_iter()
        .filter_map(|n| site(&g, n))
        .collect();
    let ops: Vec<&str> = sites.iter().map(|s| s.op).collect();
    assert_eq!(ops.len(), 3, "{ops:?}");
    assert!(ops.contains(&"conv") && ops.contains(&"conv dx") && ops.contains(&"conv dw"));
    for s in &sites {
        let (m, node) = micro_graph(&g, s).unwrap();
        m.verify().unwrap();
        assert!(matches!(m.node(node).op, Op::Conv(_)));
        match s.op {
            // Reads x and the cotangent; outputs the weight gradient (the transpose).
            "conv dw" => {
                assert_eq!(s.leaves, vec![x, ct]);
                assert_eq!(m.output_types()[0], g.node(w).ty);
            }
            // Reads the forward weight itself.
            "conv dx" => assert_eq!(s.leaves[1], w),
            _ => assert_eq!(s.leaves, vec![x, w]),
        }
    }
}
