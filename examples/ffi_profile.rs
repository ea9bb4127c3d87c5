//! Times every convolution and dot of zoo models' training steps alone, lowered each way the
//! XLA backend can: XLA native (`stablehlo.convolution` / `dot_general`), im2col (convs),
//! and libtorch through an FFI custom call ([`FfiMode::All`]); plus the eager interpreter
//! (libtorch called directly) for reference. Interleaved round-robin repetitions; each
//! figure is the best round (µs per call), the least disturbed by other processes on a
//! shared machine. The `ffi?` column is the choice of [`FfiMode::Auto`].
//!
//! Convolutions: each distinct forward convolution of the model (`fwd`) and, for training,
//! its input gradient (`dx`) and weight gradient (`dw`), each built alone by kiln's autograd
//! (so with the reversed kernel / transposed operands the training graph has, which the FFI
//! lowering reads through). Rows show the forward convolution's input, kernel, stride,
//! padding and groups. Dots: every distinct `dot_general` of the training step.
//!
//! `--e2e` instead times whole models (inference and the fused training step): eager
//! (libtorch), XLA without kernels, XLA with [`FfiMode::Auto`] and with [`FfiMode::All`].
//!
//! ```text
//! cargo run --release --example ffi_profile -- resnet18 mobilenet_v2 vgg16 bert vit
//! cargo run --release --example ffi_profile -- resnet18 --ops conv --filter "dw "
//! cargo run --release --example ffi_profile -- vgg16 --inference --ops dot
//! cargo run --release --example ffi_profile -- resnet18 --threads 1 --no-lock
//! cargo run --release --example ffi_profile -- resnet18 mobilenet_v2 --e2e --reps 7
//! ```
//!
//! `--inference` captures the inference graph instead of the fused training step; `--ops
//! conv|dot` keeps one kind; `--filter SUBSTR` (repeatable) keeps rows containing SUBSTR;
//! `--reps N` (default 5); `--threads N` sets libtorch's intra-op threads inside the kernels
//! ([`kernels::set_threads`]); `--no-lock` lets kernels run concurrently
//! ([`kernels::set_serialized`]); `--no-torch` drops the eager column.

#[path = "common/profile.rs"]
mod profile;

use kiln::autograd::vjp;
use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{kernels, ConvStrategy, FfiMode, XlaBackend, XlaOptions};
use kiln::backend::HostTensor;
use kiln::ir::{ConvAttrs, DotDims, Graph, InputKind, NodeId, Op, TensorType};
use kiln::optim::Sgd;
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, Tensor};
use profile::recorder::Recorder;
use profile::{best, interleaved, median, random, runner, train_step};
use std::collections::BTreeMap;
use std::time::Instant;

struct Args {
    models: Vec<String>,
    inference: bool,
    reps: usize,
    ops: Option<String>,
    filter: Vec<String>,
    torch: bool,
    e2e: bool,
}

fn parse() -> kiln::Result<Args> {
    let mut a = Args {
        models: Vec::new(),
        inference: false,
        reps: 5,
        ops: None,
        filter: Vec::new(),
        torch: true,
        e2e: false,
    };
    let mut it = std::env::args().skip(1);
    let bad = |m: &str| kiln::Error::Invalid(m.to_string());
    while let Some(x) = it.next() {
        match x.as_str() {
            "--inference" => a.inference = true,
            "--e2e" => a.e2e = true,
            "--no-torch" => a.torch = false,
            "--no-lock" => kernels::set_serialized(false),
            "--threads" => {
                let n = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| bad("--threads N"))?;
                kernels::set_threads(n);
            }
            "--ops" => a.ops = Some(it.next().ok_or_else(|| bad("--ops conv|dot"))?),
            "--filter" => a
                .filter
                .push(it.next().ok_or_else(|| bad("--filter SUBSTR"))?),
            "--reps" => {
                a.reps = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| bad("--reps N"))?
            }
            m => a.models.push(m.to_string()),
        }
    }
    if a.models.is_empty() {
        a.models.push("resnet18".into());
    }
    Ok(a)
}

/// What of a forward convolution a timed graph computes.
#[derive(Clone, Copy, PartialEq)]
enum Part {
    Forward,
    /// The input gradient (autograd's graph: reversed kernel + convolution).
    InputGrad,
    /// The weight gradient (autograd's graph: transposes + convolution + transpose).
    WeightGrad,
}

/// One distinct convolution (part) or dot of a model.
#[derive(Clone)]
enum Item {
    Conv(Part, ConvAttrs, TensorType, TensorType),
    Dot(DotDims, TensorType, TensorType),
}

impl Item {
    /// The one-op graph (dots, forward convolutions) or the autograd graph of one gradient,
    /// with the convolution node that lowering decides on.
    fn graph(&self) -> kiln::Result<(Graph, NodeId)> {
        let mut g = Graph::new();
        let (op, at, bt) = match self {
            Item::Conv(_, c, x, w) => (Op::Conv(c.clone()), x, w),
            Item::Dot(d, a, b) => (Op::DotGeneral(d.clone()), a, b),
        };
        let a = g.add_input(InputKind::Data, "a", at.clone());
        let b = g.add_input(InputKind::Parameter, "b", bt.clone());
        let y = g.add(op, &[a, b])?;
        let part = match self {
            Item::Conv(p, ..) => *p,
            Item::Dot(..) => Part::Forward,
        };
        if part == Part::Forward {
            g.set_outputs(vec![y])?;
            return Ok((g, y));
        }
        let yt = g.node(y).ty.clone();
        let ct = g.add_input(InputKind::Cotangent, "ct", yt);
        let need = [part == Part::InputGrad, part == Part::WeightGrad];
        let grads = vjp(&mut g, y, ct, &need)?;
        let out = grads[usize::from(part == Part::WeightGrad)]
            .ok_or_else(|| kiln::Error::Invalid("no gradient".into()))?;
        g.set_outputs(vec![out])?;
        kiln::passes::simplify(&mut g)?;
        // The gradient's convolution (the last one in topological order).
        let conv = g
            .topo_order()
            .into_iter()
            .rev()
            .find(|&n| matches!(g.node(n).op, Op::Conv(_)))
            .ok_or_else(|| kiln::Error::Invalid("no convolution".into()))?;
        Ok((g, conv))
    }
}

fn conv_key(part: Part, c: &ConvAttrs, x: &TensorType, w: &TensorType) -> String {
    let kind = match part {
        Part::Forward => "fwd",
        Part::InputGrad => "dx",
        Part::WeightGrad => "dw",
    };
    let sq = |v: &[usize]| {
        if v.iter().all(|&a| a == v[0]) {
            v[0].to_string()
        } else {
            format!("{v:?}")
        }
    };
    let pads: Vec<String> = c.padding.iter().map(|(l, h)| format!("{l},{h}")).collect();
    format!(
        "conv {kind:<3} x{:?} w{:?} s{} p{} g{}",
        x.shape.dims(),
        w.shape.dims(),
        sq(&c.strides),
        if pads.iter().all(|p| *p == pads[0]) {
            pads[0].clone()
        } else {
            pads.join("/")
        },
        c.feature_groups,
    )
}

fn dot_key(d: &DotDims, a: &TensorType, b: &TensorType) -> String {
    format!(
        "dot  {:?}x{:?} b{:?}{:?} c{:?}{:?}",
        a.shape.dims(),
        b.shape.dims(),
        d.lhs_batch,
        d.rhs_batch,
        d.lhs_contract,
        d.rhs_contract
    )
}

/// The distinct convolutions and dots of `model`'s training step (or inference), with counts.
fn capture(
    name: &str,
    inference: bool,
    xla: &XlaBackend,
) -> kiln::Result<BTreeMap<String, (Item, usize)>> {
    let model: SharedModel = SharedModel::new(zoo::build(name, 0)?);
    let inputs = model.example_inputs(4, 1)?;
    let record = |train: bool| -> kiln::Result<Vec<Graph>> {
        let (rec, graphs) = Recorder::new(xla.with_options(XlaOptions::plain()));
        if train {
            train_step(rec, &model)?.step(&inputs)?;
        } else {
            let m = model.clone();
            let mut f = compile(rec, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]));
            f.run(&inputs)?;
        }
        let g = graphs.lock().unwrap().clone();
        Ok(g)
    };
    let mut found: BTreeMap<String, (Item, usize)> = BTreeMap::new();
    let mut add = |key: String, item: Item| found.entry(key).or_insert((item, 0)).1 += 1;
    // Forward convolutions from the inference graph; their gradients built alone.
    for g in record(false)? {
        for id in g.topo_order() {
            let n = g.node(id);
            if let Op::Conv(c) = &n.op {
                let (x, w) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
                let mut parts = vec![Part::Forward];
                if !inference {
                    // The stem's input is data: no input gradient in training.
                    if !matches!(g.node(n.operands[0]).op, Op::Input(_)) {
                        parts.push(Part::InputGrad);
                    }
                    parts.push(Part::WeightGrad);
                }
                for p in parts {
                    add(
                        conv_key(p, c, x, w),
                        Item::Conv(p, c.clone(), x.clone(), w.clone()),
                    );
                }
            }
            if let (true, Op::DotGeneral(d)) = (inference, &n.op) {
                let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
                add(dot_key(d, a, b), Item::Dot(d.clone(), a.clone(), b.clone()));
            }
        }
    }
    if !inference {
        for g in record(true)? {
            for id in g.topo_order() {
                let n = g.node(id);
                if let Op::DotGeneral(d) = &n.op {
                    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
                    add(dot_key(d, a, b), Item::Dot(d.clone(), a.clone(), b.clone()));
                }
            }
        }
    }
    Ok(found)
}

/// One way of running a whole model once (borrowing the model and its inputs).
type Run<'a> = Box<dyn FnMut() -> kiln::Result<()> + 'a>;

/// For each run, one value per round.
type PerRound<T> = Vec<Vec<T>>;

/// `reps` rounds of every run in turn: each run's seconds and kernel counters (time inside
/// the kernels, zero for runs without them), one per round.
fn rounds(
    reps: usize,
    runs: &mut [Run<'_>],
) -> kiln::Result<(PerRound<f64>, PerRound<kernels::KernelStats>)> {
    let mut times = vec![Vec::new(); runs.len()];
    let mut kern = vec![Vec::new(); runs.len()];
    for _ in 0..reps {
        for (i, r) in runs.iter_mut().enumerate() {
            kernels::reset_stats();
            let s = Instant::now();
            r()?;
            times[i].push(s.elapsed().as_secs_f64());
            kern[i].push(kernels::stats());
        }
    }
    Ok((times, kern))
}

/// Whole-model times, ms: eager, XLA, XLA + FFI auto, XLA + FFI all; interleaved, best round.
fn e2e(name: &str, reps: usize, xla: &XlaBackend) -> kiln::Result<()> {
    let model: SharedModel = SharedModel::new(zoo::build(name, 0)?);
    let inputs = model.example_inputs(4, 1)?;
    let modes = [FfiMode::Off, FfiMode::Auto, FfiMode::All];
    let want = tch::no_grad(|| model.forward(&inputs, false))?.to_f64_vec()?;
    let mut fns = Vec::new();
    for m in modes {
        let b = xla.with_options(XlaOptions::default().ffi(m));
        let mm = model.clone();
        let mut f = compile(b, move |xs: &[Tensor]| Ok(vec![mm.forward(xs, false)?]));
        let y = f.run(&inputs)?.remove(0).to_f64_vec()?;
        let err = y
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        println!("{name} inference, ffi {m:?}: max |xla - eager| {err:.2e}");
        fns.push(f);
    }
    let mut runs: Vec<Run<'_>> = vec![Box::new(|| {
        tch::no_grad(|| model.forward(&inputs, false))?;
        Ok(())
    })];
    let ins = &inputs;
    for f in fns.iter_mut() {
        runs.push(Box::new(move || f.run(ins).map(drop)));
    }
    let (inf, kern) = rounds(reps, &mut runs)?;
    drop(runs);
    print_kernel_share(name, "inference", &inf, &kern);
    let m = model.clone();
    let mut eager =
        kiln::train::EagerTrainStep::new(model.store(), Sgd::new().momentum(0.9), move |xs| {
            let out = m.forward(xs, true)?;
            m.loss(&out, xs)
        })?
        .with_lr(1e-3);
    let mut steps = Vec::new();
    for m in modes {
        let mut s = train_step(xla.with_options(XlaOptions::default().ffi(m)), &model)?;
        let l = s.step(&inputs)?;
        println!("{name} first training loss, ffi {m:?}: {l:.5}");
        steps.push(s);
    }
    println!(
        "{name} first training loss, eager: {:.5}",
        eager.step(&inputs)?
    );
    let mut runs: Vec<Run<'_>> = vec![Box::new(|| eager.step(&inputs).map(drop))];
    for st in steps.iter_mut() {
        runs.push(Box::new(move || st.step(ins).map(drop)));
    }
    let (tr, kern) = rounds(reps, &mut runs)?;
    drop(runs);
    print_kernel_share(name, "training", &tr, &kern);
    println!(
        "{:<14} {:<18} {:>9} {:>9} {:>9} {:>9}",
        "model", "ms", "eager", "xla", "ffi auto", "ffi all"
    );
    for (what, v) in [("inference", inf), ("train fused", tr)] {
        for (summary, reduce) in [("best", best as fn(Vec<f64>) -> f64), ("median", median)] {
            let v: Vec<f64> = v.iter().cloned().map(reduce).collect();
            println!(
                "{name:<14} {:<18} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                format!("{what} {summary}"),
                v[0] * 1e3,
                v[1] * 1e3,
                v[2] * 1e3,
                v[3] * 1e3
            );
        }
    }
    Ok(())
}

fn main() -> kiln::Result<()> {
    let args = parse()?;
    let xla = XlaBackend::new()?;
    let native = xla.with_options(XlaOptions::plain());
    let im2col = xla.with_options(XlaOptions::plain().conv(ConvStrategy::Im2col));
    let ffi = xla.with_options(XlaOptions::plain().ffi(FfiMode::All));
    if let Err(why) = ffi.ffi_status() {
        return Err(kiln::Error::Invalid(format!(
            "FFI kernels unavailable: {why}"
        )));
    }
    println!(
        "libtorch threads in kernels: {}, kernels serialized: {}; µs per call, best of {} interleaved rounds",
        kernels::threads().map_or("default".to_string(), |n| n.to_string()),
        kernels::serialized(),
        args.reps
    );
    if args.e2e {
        for name in &args.models {
            e2e(name, args.reps, &xla)?;
        }
        return Ok(());
    }
    for name in &args.models {
        let found = capture(name, args.inference, &xla)?;
        println!(
            "\n{name} {}: {} distinct convolutions and dots",
            if args.inference {
                "inference"
            } else {
                "training step"
            },
            found.len()
        );
        println!(
            "{:<64} {:>3} {:>9} {:>9} {:>9} {:>9} {:>5}",
            "op", "n", "xla", "im2col", "ffi", "eager", "ffi?"
        );
        let mut tot = [0.0f64; 5];
        for (key, (item, count)) in &found {
            if let Some(k) = &args.ops {
                if !key.starts_with(k.as_str()) {
                    continue;
                }
            }
            if !args.filter.is_empty() && !args.filter.iter().any(|f| key.contains(f.as_str())) {
                continue;
            }
            let (g, node) = item.graph()?;
            let auto = kernels::ffi_lowering(&g, node, &FfiMode::Auto).is_some();
            let ins: Vec<HostTensor> = g
                .inputs()
                .iter()
                .enumerate()
                .map(|(i, inp)| random(&inp.ty, i as u64 + 1))
                .collect::<kiln::Result<_>>()?;
            let is_conv = matches!(item, Item::Conv(..));
            let mut rs = vec![runner(native.clone(), &g, &ins)?];
            if is_conv {
                rs.push(runner(im2col.clone(), &g, &ins)?);
            }
            rs.push(runner(ffi.clone(), &g, &ins)?);
            if args.torch {
                rs.push(runner(EagerBackend::new(), &g, &ins)?);
            }
            let mut t = interleaved(&mut rs, args.reps, best)?;
            if !is_conv {
                t.insert(1, f64::NAN);
            }
            if !args.torch {
                t.push(f64::NAN);
            }
            // t = [xla, im2col, ffi, eager]
            let chosen = if auto { t[2] } else { t[0] };
            for (i, v) in t.iter().chain([chosen].iter()).enumerate() {
                if v.is_finite() {
                    tot[i] += v * *count as f64;
                }
            }
            println!(
                "{key:<64} {count:>3} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>5}",
                t[0] * 1e6,
                t[1] * 1e6,
                t[2] * 1e6,
                t[3] * 1e6,
                if auto { "ffi" } else { "xla" }
            );
        }
        println!(
            "{:<64} {:>3} {:>9.0} {:>9.0} {:>9.0} {:>9.0}   (auto: {:.0})",
            "total µs (weighted by count; im2col: convs only)",
            "",
            tot[0] * 1e6,
            tot[1] * 1e6,
            tot[2] * 1e6,
            tot[3] * 1e6,
            tot[4] * 1e6
        );
    }
    Ok(())
}

/// The kernel counters of the fastest run of the two FFI variants (columns 2 and 3 of `times`).
fn print_kernel_share(
    name: &str,
    what: &str,
    times: &[Vec<f64>],
    kern: &[Vec<kernels::KernelStats>],
) {
    for i in [2, 3] {
        let (b, _) = times[i]
            .iter()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(b.1))
            .unwrap_or((0, &0.0));
        let k = kern[i][b];
        println!(
            "{name} {what} ({}): {} kernel calls ({} handed to the waiting thread), {:.2} ms in kernels, {:.2} ms waiting for the lock",
            if i == 2 { "ffi auto" } else { "ffi all" },
            k.calls,
            k.handed_over,
            k.run_ns as f64 * 1e-6,
            k.wait_ns as f64 * 1e-6
        );
    }
}
