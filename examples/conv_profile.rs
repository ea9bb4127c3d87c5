//! Where XLA spends a convnet's time, and what the XLA backend's options change.
//!
//! Two parts, both interleaving the variants they compare (round-robin repetitions, median):
//!
//! - `convs` (default): captures every convolution of a zoo model's fused training step
//!   (forward, input-gradient and weight-gradient convolutions) and times each alone: libtorch
//!   (the eager interpreter running the same one-op graph), XLA direct
//!   (`stablehlo.convolution`) and XLA im2col, plus the choice of [`ConvStrategy::Auto`].
//! - `--e2e`: inference and fused training step of the model: eager (libtorch, tch autograd)
//!   vs XLA with [`XlaOptions::plain`] (before) vs XLA with the given options (after).
//!
//! ```text
//! cargo run --release --example conv_profile -- resnet18
//! cargo run --release --example conv_profile -- resnet18 --opt xla_cpu_use_xnnpack=false
//! cargo run --release --example conv_profile -- resnet18 --e2e --reps 7
//! ```
//!
//! `--filter SUBSTR` (repeatable) keeps only convolutions whose row contains SUBSTR;
//! `--no-torch` skips the libtorch column. `--opt NAME=VALUE` adds an XLA debug option override (`true`/`false`, an integer, a float,
//! else a string) to the "after" options; `--conv direct|im2col|auto` sets their strategy.

#[path = "common/profile.rs"]
mod profile;

use kiln::backend::eager::EagerBackend;
use kiln::backend::xla::{ConvLowering, ConvStrategy, OptionValue, XlaBackend, XlaOptions};
use kiln::ir::{ConvAttrs, Graph, InputKind, Op, TensorType};
use kiln::optim::Sgd;
use kiln::train::EagerTrainStep;
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, Tensor};
use profile::recorder::Recorder;
use profile::{interleaved, median, random, runner, train_step};
use std::collections::BTreeMap;
use std::time::Instant;

struct Args {
    model: String,
    e2e: bool,
    reps: usize,
    after: XlaOptions,
    filter: Vec<String>,
    torch: bool,
}

fn parse() -> kiln::Result<Args> {
    let mut a = Args {
        model: "resnet18".into(),
        e2e: false,
        reps: 5,
        after: XlaOptions::default(),
        filter: Vec::new(),
        torch: true,
    };
    let mut it = std::env::args().skip(1);
    let bad = |m: String| kiln::Error::Invalid(m);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--e2e" => a.e2e = true,
            "--no-torch" => a.torch = false,
            "--filter" => a
                .filter
                .push(it.next().ok_or_else(|| bad("--filter SUBSTR".into()))?),
            "--reps" => {
                a.reps = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| bad("--reps N".into()))?
            }
            "--conv" => {
                let s = match it.next().as_deref() {
                    Some("direct") => ConvStrategy::Direct,
                    Some("im2col") => ConvStrategy::Im2col,
                    Some("auto") => ConvStrategy::Auto,
                    v => return Err(bad(format!("--conv direct|im2col|auto, got {v:?}"))),
                };
                a.after = a.after.clone().conv(s);
            }
            "--opt" => {
                let kv = it.next().ok_or_else(|| bad("--opt NAME=VALUE".into()))?;
                let (k, v) = kv
                    .split_once('=')
                    .ok_or_else(|| bad(format!("--opt NAME=VALUE, got {kv}")))?;
                let value = match v {
                    "true" => OptionValue::Bool(true),
                    "false" => OptionValue::Bool(false),
                    _ => match (v.parse::<i64>(), v.parse::<f64>()) {
                        (Ok(i), _) => OptionValue::Int(i),
                        (_, Ok(f)) => OptionValue::Double(f),
                        _ => OptionValue::Str(v.to_string()),
                    },
                };
                a.after = a.after.clone().debug_option(k, value);
            }
            m => a.model = m.to_string(),
        }
    }
    Ok(a)
}

fn conv_key(c: &ConvAttrs, x: &TensorType, w: &TensorType) -> String {
    let kind = if c.lhs_dilation.iter().any(|&d| d > 1) {
        "dx/s2"
    } else if c.batch_groups > 1 || x.shape.dim(1) != w.shape.dim(1) * c.feature_groups {
        "?"
    } else if w.shape.dims()[2..].iter().product::<usize>() > 9 {
        "dw"
    } else {
        "fwd|dx"
    };
    format!(
        "{kind:<6} x{:?} w{:?} s{:?} p{:?} ld{:?} rd{:?} g{} bg{}",
        x.shape.dims(),
        w.shape.dims(),
        c.strides,
        c.padding,
        c.lhs_dilation,
        c.rhs_dilation,
        c.feature_groups,
        c.batch_groups
    )
}

fn convs(args: &Args, xla: &XlaBackend) -> kiln::Result<()> {
    let model: SharedModel = SharedModel::new(zoo::build(&args.model, 0)?);
    let inputs = model.example_inputs(4, 1)?;
    let (rec, graphs) = Recorder::new(xla.with_options(XlaOptions::plain()));
    let mut step = train_step(rec, &model)?;
    step.step(&inputs)?;
    let mut found: BTreeMap<String, (ConvAttrs, TensorType, TensorType, usize)> = BTreeMap::new();
    for g in graphs.lock().unwrap().iter() {
        for id in g.topo_order() {
            let n = g.node(id);
            if let Op::Conv(c) = &n.op {
                let xt = g.node(n.operands[0]).ty.clone();
                let wt = g.node(n.operands[1]).ty.clone();
                let e = found
                    .entry(conv_key(c, &xt, &wt))
                    .or_insert((c.clone(), xt, wt, 0));
                e.3 += 1;
            }
        }
    }
    let direct = xla.with_options(args.after.clone().conv(ConvStrategy::Direct));
    let im2col = xla.with_options(args.after.clone().conv(ConvStrategy::Im2col));
    let plain = xla.with_options(XlaOptions::plain());
    println!(
        "{} training step: {} distinct convolutions; ms per call (median of {} interleaved rounds)",
        args.model,
        found.len(),
        args.reps
    );
    println!(
        "{:<82} {:>3} {:>8} {:>8} {:>8} {:>8} {:>6}",
        "conv", "n", "torch", "plain", "direct", "im2col", "auto"
    );
    println!("(plain: no debug options, direct; direct/im2col: the chosen options; auto: the choice of ConvStrategy::Auto)");
    let mut tot = [0.0f64; 6];
    for (key, (c, xt, wt, count)) in &found {
        if !args.filter.is_empty() && !args.filter.iter().any(|f| key.contains(f.as_str())) {
            continue;
        }
        let mut g = Graph::new();
        let a = g.add_input(InputKind::Data, "x", xt.clone());
        let b = g.add_input(InputKind::Data, "w", wt.clone());
        let y = g.add(Op::Conv(c.clone()), &[a, b])?;
        g.set_outputs(vec![y])?;
        let ins = vec![random(xt, 1)?, random(wt, 2)?];
        let mut rs = vec![
            runner(plain.clone(), &g, &ins)?,
            runner(direct.clone(), &g, &ins)?,
            runner(im2col.clone(), &g, &ins)?,
        ];
        rs.push(runner(
            plain.with_options(XlaOptions::plain().conv(ConvStrategy::Im2col)),
            &g,
            &ins,
        )?);
        if args.torch {
            rs.push(runner(EagerBackend::new(), &g, &ins)?);
        }
        let mut t = interleaved(&mut rs, args.reps, median)?;
        if !args.torch {
            t.push(f64::NAN);
        }
        t.rotate_right(1);
        // t = [torch, plain direct, direct, im2col, plain im2col]
        let plain_im2col = t.pop().unwrap_or(f64::NAN);
        tot[5] += plain_im2col * *count as f64;
        let auto = ConvStrategy::Auto.choose(c, xt, wt);
        let chosen = if auto == ConvLowering::Im2col {
            t[3]
        } else {
            t[2]
        };
        for (i, v) in t.iter().chain([chosen].iter()).enumerate() {
            tot[i] += v * *count as f64;
        }
        println!(
            "{key:<82} {count:>3} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>6}",
            t[0] * 1e3,
            t[1] * 1e3,
            t[2] * 1e3,
            t[3] * 1e3,
            if auto == ConvLowering::Im2col {
                "im2col"
            } else {
                "direct"
            }
        );
    }
    println!(
        "{:<82} {:>3} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>6.2}",
        "total (weighted by count), ms",
        "",
        tot[0] * 1e3,
        tot[1] * 1e3,
        tot[2] * 1e3,
        tot[3] * 1e3,
        tot[4] * 1e3
    );
    println!(
        "im2col with plain options (no debug overrides), total ms: {:.2}",
        tot[5] * 1e3
    );
    Ok(())
}

fn e2e(args: &Args, xla: &XlaBackend) -> kiln::Result<()> {
    let model: SharedModel = SharedModel::new(zoo::build(&args.model, 0)?);
    let inputs = model.example_inputs(4, 1)?;
    let before = xla.with_options(XlaOptions::plain());
    let after = xla.with_options(args.after.clone());
    println!("after options: {:?}", args.after);

    // Inference.
    let mk = |b: XlaBackend| {
        let m = model.clone();
        compile(b, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]))
    };
    let (mut fb, mut fa) = (mk(before.clone()), mk(after.clone()));
    let want = tch::no_grad(|| model.forward(&inputs, false))?.to_f64_vec()?;
    let yb = fb.run(&inputs)?.remove(0).to_f64_vec()?;
    let ya = fa.run(&inputs)?.remove(0).to_f64_vec()?;
    let maxdiff = |a: &[f64]| {
        a.iter()
            .zip(&want)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max)
    };
    println!(
        "inference max |xla - eager|: before {:.2e}, after {:.2e}",
        maxdiff(&yb),
        maxdiff(&ya)
    );
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..args.reps {
        let s = Instant::now();
        tch::no_grad(|| model.forward(&inputs, false))?;
        t[0].push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        fb.run(&inputs)?;
        t[1].push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        fa.run(&inputs)?;
        t[2].push(s.elapsed().as_secs_f64());
    }
    let inf: Vec<f64> = t.into_iter().map(median).collect();

    // Fused training step.
    let m = model.clone();
    let mut eager = EagerTrainStep::new(model.store(), Sgd::new().momentum(0.9), move |xs| {
        let out = m.forward(xs, true)?;
        m.loss(&out, xs)
    })?
    .with_lr(1e-3);
    let mut sb = train_step(before, &model)?;
    let mut sa = train_step(after, &model)?;
    let lb = sb.step(&inputs)?;
    let la = sa.step(&inputs)?;
    let le = eager.step(&inputs)?;
    println!("first training loss: eager {le:.5}, before {lb:.5}, after {la:.5}");
    let mut t = [Vec::new(), Vec::new(), Vec::new()];
    for _ in 0..args.reps {
        let s = Instant::now();
        eager.step(&inputs)?;
        t[0].push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        sb.step(&inputs)?;
        t[1].push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        sa.step(&inputs)?;
        t[2].push(s.elapsed().as_secs_f64());
    }
    let tr: Vec<f64> = t.into_iter().map(median).collect();
    println!(
        "{:<14} {:<10} {:>9} {:>11} {:>10} {:>14} {:>13}",
        "model", "", "eager ms", "before ms", "after ms", "eager/before", "eager/after"
    );
    for (what, v) in [("inference", &inf), ("train fused", &tr)] {
        println!(
            "{:<14} {:<10} {:>9.2} {:>11.2} {:>10.2} {:>13.2}x {:>12.2}x",
            args.model,
            what,
            v[0] * 1e3,
            v[1] * 1e3,
            v[2] * 1e3,
            v[0] / v[1],
            v[0] / v[2]
        );
    }
    Ok(())
}

fn main() -> kiln::Result<()> {
    let args = parse()?;
    let xla = XlaBackend::new()?;
    if args.e2e {
        e2e(&args, &xla)
    } else {
        convs(&args, &xla)
    }
}
