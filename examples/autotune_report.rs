//! Autotune's per-node choices for zoo models, and whole-model times under each way of
//! choosing: pure XLA ([`FfiMode::Off`], rule), the rule ([`FfiMode::Auto`], autotune off)
//! and autotune.
//!
//! ```text
//! cargo run --release --example autotune_report -- resnet18
//! cargo run --release --example autotune_report -- bert --training
//! cargo run --release --example autotune_report -- squeezenet1_1 --e2e --reps 15
//! ```
//!
//! For each model: the choices autotune made for the inference graph (or, with `--training`,
//! the fused training step's graph): how many nodes got each lowering, and the nodes with the
//! largest measured times (every candidate's µs per call). `--all` lists every node. `--e2e`
//! then times the model under the three ways of choosing, interleaved, `--reps` rounds
//! (default 9), and prints medians and each variant's first-call time (trace + autotune +
//! compile). `--top N` (default 12) sets how many nodes are listed. The whole-graph check's
//! outcome (which set of choices the graph was compiled with: the measured per-node choices,
//! the rule's, or pure XLA's, and each one's ms per run) is printed too.

#[path = "common/profile.rs"]
mod profile;

use kiln::backend::xla::{Autotune, FfiMode, Lowering, NodeChoice, XlaBackend, XlaOptions};
use kiln::zoo::{self, Model, SharedModel};
use kiln::{compile, Tensor};
use profile::{median, train_step, Runner};
use std::collections::BTreeMap;
use std::time::Instant;

struct Args {
    models: Vec<String>,
    training: bool,
    e2e: bool,
    all: bool,
    reps: usize,
    top: usize,
}

fn parse() -> kiln::Result<Args> {
    let mut a = Args {
        models: Vec::new(),
        training: false,
        e2e: false,
        all: false,
        reps: 9,
        top: 12,
    };
    let mut it = std::env::args().skip(1);
    while let Some(s) = it.next() {
        let num = |v: Option<String>, what: &str| -> kiln::Result<usize> {
            v.and_then(|v| v.parse().ok())
                .ok_or_else(|| kiln::Error::Invalid(format!("{what} needs a number")))
        };
        match s.as_str() {
            "--training" => a.training = true,
            "--e2e" => a.e2e = true,
            "--all" => a.all = true,
            "--reps" => a.reps = num(it.next(), "--reps")?,
            "--top" => a.top = num(it.next(), "--top")?,
            m if !m.starts_with('-') => a.models.push(m.to_string()),
            o => return Err(kiln::Error::Invalid(format!("unknown option {o}"))),
        }
    }
    if a.models.is_empty() {
        return Err(kiln::Error::Invalid(
            "usage: autotune_report MODEL... [--training] [--e2e] [--reps N] [--top N] [--all]"
                .into(),
        ));
    }
    Ok(a)
}

/// One way of running the model (a closure that runs it once and waits), and the seconds its
/// first call took.
fn runner(
    b: XlaBackend,
    model: &SharedModel,
    inputs: &[Tensor],
    training: bool,
) -> kiln::Result<(Runner, f64)> {
    let t0 = Instant::now();
    let inputs = inputs.to_vec();
    if training {
        let mut step = train_step(b, model)?;
        step.step(&inputs)?;
        let first = t0.elapsed().as_secs_f64();
        Ok((
            Box::new(move || {
                step.step(&inputs)?;
                Ok(())
            }),
            first,
        ))
    } else {
        let m = model.clone();
        let mut f = compile(b, move |xs: &[Tensor]| Ok(vec![m.forward(xs, false)?]));
        f.run(&inputs)?;
        let first = t0.elapsed().as_secs_f64();
        Ok((
            Box::new(move || {
                f.run(&inputs)?;
                Ok(())
            }),
            first,
        ))
    }
}

fn summary(name: &str, what: &str, report: &[NodeChoice], top: usize, all: bool) {
    let mut counts: BTreeMap<(&str, Lowering), usize> = BTreeMap::new();
    for c in report {
        *counts.entry((c.op, c.lowering)).or_default() += 1;
    }
    let measured = report.iter().filter(|c| !c.micros.is_empty()).count();
    println!(
        "\n{name} {what}: {} convolution/dot nodes, {measured} with measurements (others: rule)",
        report.len()
    );
    for ((op, l), n) in &counts {
        println!("  {op:<8} {l:<7} {n:>4}");
    }
    let mut timed: Vec<&NodeChoice> = report.iter().filter(|c| !c.micros.is_empty()).collect();
    // Largest best time first: where the choice matters most.
    let best = |c: &NodeChoice| c.micros.iter().map(|m| m.1).fold(f64::INFINITY, f64::min);
    timed.sort_by(|a, b| best(b).total_cmp(&best(a)));
    let shown = if all {
        timed.len()
    } else {
        top.min(timed.len())
    };
    println!("  top {shown} nodes by time:");
    for c in &timed[..shown] {
        println!("  {c}");
    }
}

fn main() -> kiln::Result<()> {
    let args = parse()?;
    let xla = XlaBackend::new()?;
    let tuned = xla.with_options(XlaOptions::default().autotune(Autotune::on()));
    let rule = xla.with_options(XlaOptions::default().autotune(Autotune::off()));
    let pure = xla.with_options(
        XlaOptions::default()
            .ffi(FfiMode::Off)
            .autotune(Autotune::off()),
    );
    if let Err(why) = xla.ffi_status() {
        println!("note: libtorch kernels unavailable ({why}): autotune chooses XLA vs im2col");
    }
    let what = if args.training {
        "fused training step"
    } else {
        "inference"
    };
    for name in &args.models {
        let model = SharedModel::new(zoo::build(name, 0)?);
        let inputs = model.example_inputs(4, 1)?;
        tuned.clear_autotune_report();
        let (tuned_run, tuned_first) = runner(tuned.clone(), &model, &inputs, args.training)?;
        summary(name, what, &tuned.autotune_report(), args.top, args.all);
        for g in tuned.autotune_graph_report() {
            println!("  whole-graph check: {g}");
        }
        println!(
            "  first call with autotune (trace, measure, compile): {tuned_first:.2} s, of which \
             measuring {:.2} s",
            tuned.autotune_time().as_secs_f64()
        );
        if !args.e2e {
            continue;
        }
        let (rule_run, rule_first) = runner(rule.clone(), &model, &inputs, args.training)?;
        let (pure_run, pure_first) = runner(pure.clone(), &model, &inputs, args.training)?;
        let mut runs = [pure_run, rule_run, tuned_run];
        let mut times = vec![Vec::new(); 3];
        for round in 0..args.reps {
            // Rotate the order: a run right after one with libtorch kernels can pay for their
            // threads winding down.
            for k in 0..runs.len() {
                let i = (round + k) % runs.len();
                let t = Instant::now();
                runs[i]()?;
                times[i].push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        let best: Vec<f64> = times
            .iter()
            .map(|v| v.iter().copied().fold(f64::INFINITY, f64::min))
            .collect();
        let med: Vec<f64> = times.into_iter().map(median).collect();
        println!(
            "  {name} {what}, ms (median / best of {} interleaved rounds): xla only {:.2} / {:.2}, \
             rule {:.2} / {:.2}, autotune {:.2} / {:.2}; first call s: {pure_first:.2} / \
             {rule_first:.2} / {tuned_first:.2}",
            args.reps, med[0], best[0], med[1], best[1], med[2], best[2]
        );
    }
    Ok(())
}
