//! The measurement loop shared by inference and training (see the module docs of
//! [`crate`]).

use super::accuracy::{
    compare, compare_updates, Accuracy, AccuracyStatus, Reference, Tolerance, UPDATE_RTOL,
};
use super::memory;
use super::report::{ModelRow, Report, VariantResult};
use super::stats::{median, welch_t_test};
use super::{default_batch_size, infer, train, BenchOptions, Experiment, ModelSource, Variant};
use crate::error::Result;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln::backend::registry::BackendEntry;
use kiln::runtime::Stats;
use kiln::zoo::Model;
use kiln::zoo::SharedModel;
use kiln::Tensor;
use std::time::Instant;

/// Something timed against eager: an eager baseline or a compiled variant.
pub(crate) trait Contender {
    /// Runs `iterations` iterations on `inputs`, then syncs once by reading the last result
    /// back to the host (inference: the flattened output; training: the loss).
    fn run(&mut self, inputs: &[Tensor], iterations: usize) -> Result<Vec<f64>>;

    /// The runtime counters, for compiled contenders.
    fn stats(&self) -> Option<Stats> {
        None
    }

    /// Copies state kept on a device back to the model's store (training steps), so that the
    /// workload can read the parameters.
    fn sync_to_store(&mut self) -> Result<()> {
        Ok(())
    }
}

/// What is measured for one model: inference or training. It builds the contenders.
pub(crate) trait Workload {
    /// The eager baseline.
    fn eager(&self) -> Result<Box<dyn Contender>>;

    /// A compiled variant on `backend`.
    fn compiled(&self, backend: &BackendEntry, variant: &Variant) -> Result<Box<dyn Contender>>;

    /// Puts the model back in its initial state before a contender's warm-up (training:
    /// restores the parameters, so that every contender's checked steps start alike).
    fn reset(&self) -> Result<()> {
        Ok(())
    }

    /// Is every call's result comparable with eager's (inference), or only the first call's
    /// from the same start (training: later steps amplify rounding, see
    /// [`super::UPDATE_RTOL`])?
    fn compare_each_call(&self) -> bool;

    /// Should eager run twice in performance mode too, to see whether it repeats itself?
    fn check_eager_determinism(&self) -> bool {
        false
    }

    /// Can [`Workload::deterministic_reference`] build anything?
    fn has_deterministic_reference(&self) -> bool {
        false
    }

    /// A fresh reference to use when eager does not repeat itself (dropout drawn by libtorch).
    fn deterministic_reference(&self) -> Result<Box<dyn Contender>> {
        Err(crate::Error::Invalid(
            "internal: this workload has no deterministic reference".into(),
        ))
    }

    /// What the calls so far changed in the model (training: each trainable parameter's change
    /// since the initial state); `None` when there is nothing to compare.
    fn update(&self) -> Result<Option<Vec<tch::Tensor>>> {
        Ok(None)
    }
}

/// Two runs of the same deterministic computation agree to this relative error at least
/// (float32 rounding); more means randomness (dropout).
const REPEAT_RTOL: f64 = 1e-4;

/// The relative size of the input perturbation that measures the update's rounding noise.
const PERTURBATION: f64 = 1e-7;

/// The update check tolerates this many times the reference's own rounding noise.
pub(crate) const UPDATE_NOISE_FACTOR: f64 = 5.0;

/// `inputs` with every float element multiplied by `1 + 1e-7·ξ` (ξ standard normal, seeded):
/// a change the size of float32 rounding. Integer inputs are kept.
fn perturbed(inputs: &[Tensor], seed: u64) -> kiln::Result<Vec<Tensor>> {
    inputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.dtype().is_float() {
                let xi = Tensor::randn_dtype(t.dims(), t.dtype(), seed ^ (0xC0FFEE + i as u64))?;
                t * &xi.mul_scalar(PERTURBATION)?.add_scalar(1.0)?
            } else {
                Ok(t.clone())
            }
        })
        .collect()
}

/// Does a second run of eager's first call, from the same start, repeat the first (each run
/// given as its result and its parameter update, if any): both within [`REPEAT_RTOL`]?
///
/// Why the update too: dropout drawn by libtorch changes both, but a loss that averages many
/// outputs can land within `REPEAT_RTOL` of the first by chance (squeezenet1_1: 2 of 299
/// redraws), and then eager, with a mask of its own, was taken as the reference and every
/// compiled variant failed the update check (seen once in a `--training` run). The update of
/// the weights behind a dropout moves with the mask far more than the loss.
fn eager_repeats(
    first: (&[f64], &Option<Vec<tch::Tensor>>),
    second: (&[f64], &Option<Vec<tch::Tensor>>),
    tol: &Tolerance,
) -> bool {
    compare(first.0, second.0, tol).rel_err <= REPEAT_RTOL
        && noise(first.1, second.1).is_none_or(|e| e <= REPEAT_RTOL)
}

/// The relative L2 difference of two parameter updates, if both exist.
fn noise(a: &Option<Vec<tch::Tensor>>, b: &Option<Vec<tch::Tensor>>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => compare_updates(a, b, f64::INFINITY).update_rel_err,
        _ => None,
    }
}

/// Draws fresh float inputs like `base` (integer inputs are kept, as in torchbench).
fn randomized(base: &[Tensor], seed: u64) -> kiln::Result<Vec<Tensor>> {
    base.iter()
        .enumerate()
        .map(|(i, t)| {
            if t.dtype().is_float() {
                Tensor::randn_dtype(
                    t.dims(),
                    t.dtype(),
                    seed.wrapping_mul(0x9E37_79B9).wrapping_add(i as u64),
                )
            } else {
                Ok(t.clone())
            }
        })
        .collect()
}

struct Progress {
    bar: ProgressBar,
    plain: bool,
}

impl Progress {
    fn new(enabled: bool, total: u64) -> Self {
        let bar = if enabled {
            ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr())
        } else {
            ProgressBar::hidden()
        };
        if let Ok(style) =
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}")
        {
            bar.set_style(style);
        }
        // Not a terminal (CI logs): one plain line per event instead of a bar.
        let plain = enabled && bar.is_hidden();
        Progress { bar, plain }
    }

    fn message(&self, msg: String) {
        if self.plain {
            eprintln!("{msg}");
        }
        self.bar.set_message(msg);
    }

    /// A message for the bar only (too frequent for plain lines).
    fn detail(&self, msg: String) {
        self.bar.set_message(msg);
    }

    fn note(&self, msg: String) {
        if self.plain {
            eprintln!("{msg}");
        } else {
            self.bar.println(msg);
        }
    }

    fn inc(&self, n: u64) {
        self.bar.inc(n);
    }
}

/// Progress units of one model: eager warm-up, each variant's warm-up, each repetition.
fn units_per_model(opts: &BenchOptions, variants: usize) -> u64 {
    1 + variants as u64
        + match opts.experiment {
            Experiment::Performance => opts.repeat as u64,
            Experiment::Accuracy => 0,
        }
}

fn error_text(e: &dyn std::fmt::Display) -> String {
    e.to_string()
}

pub(crate) fn run(
    sources: Vec<ModelSource>,
    opts: &BenchOptions,
    backend: &BackendEntry,
) -> Result<Report> {
    if let Some(t) = opts.threads {
        tch::set_num_threads(i32::try_from(t).unwrap_or(i32::MAX));
        // libtorch kernels inside XLA executables run on XLA's worker threads, which apply
        // their own setting: give them the same N.
        kiln::backend::xla::kernels::set_threads(t);
    }
    let variants = opts.variants();
    let total = units_per_model(opts, variants.len()) * sources.len() as u64;
    let progress = Progress::new(opts.progress, total);
    let n = sources.len();
    // Phase 1, eager: every model's eager warm-up, reference and timed repetitions ("eager
    // alone"), before any compiled contender runs in this process: as a user who never ran
    // kiln sees eager. Phase 2 times eager again, interleaved with the compiled variants, as
    // torchbench.py does: those timings see the same machine load as the compiled ones (on
    // a shared machine the load drifts between phases; eager alone moved 1.5-2x from one run
    // to the next). Interleaved, eager inference takes about what it takes alone (geomeans
    // within ~5 %; `examples/eager_interference.rs`: resnet18 12.35 ms alone, 12.08 ms after
    // compiled runs), but eager training steps between compiled ones were up to ~1.7x
    // slower. So each speedup divides the faster of the two eager medians by the compiled
    // one: never flattered by either method.
    let mut started = Vec::with_capacity(n);
    for (i, source) in sources.into_iter().enumerate() {
        let name = source.name().to_string();
        progress.message(format!("[{}/{n}] {name}: eager", i + 1));
        let batch = opts.batch_size.unwrap_or_else(|| default_batch_size(&name));
        let mut row = ModelRow {
            update_noise: None,
            batch_size: batch,
            model: name,
            eager_ms: None,
            eager_alone_ms: None,
            eager_interleaved_ms: None,
            eager_peak_bytes: None,
            error: None,
            results: variants.iter().map(|v| VariantResult::new(*v)).collect(),
        };
        let eager = match source.build() {
            Ok(model) => {
                let model = SharedModel::new(model);
                guarded(&mut row, |row| bench_eager(&model, opts, row, &progress))
            }
            Err(e) => {
                row.error = Some(error_text(&e));
                None
            }
        };
        started.push((row, eager));
    }
    // Phase 2, compiled: each model's variants against the eager figures of phase 1.
    let mut rows = Vec::with_capacity(n);
    for (i, (mut row, eager)) in started.into_iter().enumerate() {
        progress.message(format!("[{}/{n}] {}", i + 1, row.model));
        if let Some(eager) = eager {
            guarded(&mut row, |row| {
                bench_compiled(eager, opts, backend, row, &progress).map(Some)
            });
        }
        // Keep the bar's count right whatever was skipped (phase 1's steps included).
        progress
            .bar
            .set_position((i as u64 + 1) * units_per_model(opts, variants.len()));
        progress.note(summary_line(&row, backend.label()));
        rows.push(row);
    }
    progress.bar.finish_and_clear();
    Ok(Report {
        experiment: opts.experiment,
        training: opts.training,
        backend: backend.label().to_string(),
        variants,
        rows,
        tolerance: opts.tolerance(),
        iterations_per_run: opts.iterations_per_run,
        repeat: opts.repeat,
        warmup: opts.warmup,
        switch_in: opts.switch_in,
        randomize_input: opts.randomize_input,
        threads: crate::threads::Threads::current(opts.threads.is_none()),
        compiled_detail: None,
    })
}

/// torchbench.py's one line per model: `cpu  eval  name  1.380x p=0.00 ...`.
fn summary_line(row: &ModelRow, label: &str) -> String {
    let mut s = format!("{:<20}", row.model);
    if let Some(e) = &row.error {
        s.push_str(&format!(" ERROR: {e}"));
        return s;
    }
    if let Some(ms) = row.eager_ms {
        s.push_str(&format!(" eager {ms:.3} ms"));
    }
    for r in &row.results {
        let v = r.variant.label(label);
        match (&r.error, r.speedup, r.p_value, &r.accuracy) {
            (Some(_), ..) => s.push_str(&format!(" | {v}: ERROR")),
            (None, Some(sp), p, acc) => {
                let p = p.map(|p| format!(" p={p:.2}")).unwrap_or_default();
                let a = acc.map(|a| format!(" {}", a.status)).unwrap_or_default();
                s.push_str(&format!(" | {v}: {sp:.3}x{p}{a}"));
            }
            (None, None, _, Some(a)) => s.push_str(&format!(" | {v}: {}", a.status)),
            _ => {}
        }
    }
    s
}

/// Runs `f` on `row`; an error or a panic in model code (a user model indexing past its
/// inputs, say) becomes the row's error instead of ending the run.
fn guarded<T>(row: &mut ModelRow, f: impl FnOnce(&mut ModelRow) -> Result<Option<T>>) -> Option<T> {
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(row)));
    match run {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            row.error = Some(error_text(&e));
            None
        }
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            row.error = Some(format!("panicked: {msg}"));
            None
        }
    }
}

fn workload_for(model: &SharedModel, opts: &BenchOptions) -> Result<Box<dyn Workload>> {
    if opts.training {
        Ok(Box::new(train::TrainWorkload::new(model.clone(), opts)?))
    } else {
        Ok(Box::new(infer::InferenceWorkload::new(model.clone())))
    }
}

/// What phase 1 leaves for phase 2 of one model: the reference results, eager's contender
/// and its timings alone.
struct EagerPart {
    /// Keeps the model alive (the workload shares it).
    _model: SharedModel,
    workload: Box<dyn Workload>,
    /// Eager, to time again interleaved with the variants (`None` in accuracy mode).
    eager: Option<Box<dyn Contender>>,
    /// Eager's seconds per iteration alone (before any compiled run), one per repetition.
    alone_times: Vec<f64>,
    inputs: Vec<Tensor>,
    reference: Vec<f64>,
    reference_update: Option<Vec<tch::Tensor>>,
    reference_kind: Reference,
    eager_variation: bool,
    update_rtol: f64,
    /// Eager's result for each repetition's input (with `--randomize-input`, where each
    /// repetition's input differs and the compiled results are compared with these).
    expected: Vec<Vec<f64>>,
}

/// Phase 1 for one model: eager's warm-up (its results are the reference), the determinism
/// and noise probes, eager's peak memory and its timed repetitions (not in accuracy mode).
fn bench_eager(
    model: &SharedModel,
    opts: &BenchOptions,
    row: &mut ModelRow,
    progress: &Progress,
) -> Result<Option<EagerPart>> {
    let name = model.name().to_string();
    let tol: Tolerance = opts.tolerance();
    let inputs = model.example_inputs(row.batch_size, opts.seed)?;
    let workload = workload_for(model, opts)?;
    let warmup = opts.warmup.max(1);

    // Warm-up of eager: its results are the reference (inference: every call's output, which
    // repeats; training: the first step's loss and parameter update).
    progress.detail(format!("{name}: eager warm-up"));
    workload.reset()?;
    let mut eager = workload.eager()?;
    let mut reference = Vec::new();
    let mut reference_update = None;
    for k in 0..warmup {
        let out = eager.run(&inputs, 1)?;
        if k == 0 {
            reference = out;
            reference_update = workload.update()?;
        }
    }
    let mut eager_variation = false;
    let mut reference_kind = Reference::Eager;
    let mut update_rtol = UPDATE_RTOL;
    if opts.experiment == Experiment::Accuracy || workload.check_eager_determinism() {
        // The first call again, from the same start: a result that moves more than rounding
        // can (dropout drawn by libtorch) means eager is no reference.
        workload.reset()?;
        let second = workload.eager()?.run(&inputs, 1)?;
        let second_update = workload.update()?;
        if !eager_repeats(
            (&reference, &reference_update),
            (&second, &second_update),
            &tol,
        ) {
            if workload.has_deterministic_reference() {
                progress.detail(format!("{name}: reference run (kiln graph interpreter)"));
                workload.reset()?;
                let mut r = workload.deterministic_reference()?;
                reference = r.run(&inputs, 1)?;
                r.sync_to_store()?;
                reference_update = workload.update()?;
                reference_kind = Reference::GraphInterpreter;
            } else {
                eager_variation = true;
            }
        }
        // How far rounding-sized changes move the update: the reference again on inputs
        // perturbed at float32 rounding level. This is the noise floor of the update check.
        if reference_update.is_some() && !eager_variation {
            workload.reset()?;
            let mut r = match reference_kind {
                Reference::Eager => workload.eager()?,
                Reference::GraphInterpreter => workload.deterministic_reference()?,
            };
            r.run(&perturbed(&inputs, opts.seed)?, 1)?;
            r.sync_to_store()?;
            let probe = workload.update()?;
            let floor = noise(&reference_update, &probe);
            update_rtol = UPDATE_RTOL.max(UPDATE_NOISE_FACTOR * floor.unwrap_or(0.0));
            row.update_noise = floor;
        }
    }
    progress.inc(1);

    let mut eager_times = Vec::with_capacity(opts.repeat);
    let mut expected = Vec::new();
    if opts.experiment != Experiment::Accuracy {
        // Peak memory of one call, outside the timed runs (see crate::memory).
        let (out, peak) = memory::peak_growth(|| eager.run(&inputs, 1));
        out?;
        row.eager_peak_bytes = peak;
        let iters = opts.iterations_per_run;
        for rep in 0..opts.repeat {
            progress.detail(format!(
                "{name}: eager repetition {}/{}",
                rep + 1,
                opts.repeat
            ));
            let rep_inputs = repetition_inputs(&inputs, opts, rep)?;
            let t0 = Instant::now();
            let out = eager.run(&rep_inputs, iters)?;
            eager_times.push(t0.elapsed().as_secs_f64() / iters as f64);
            if opts.randomize_input && workload.compare_each_call() {
                expected.push(out);
            }
        }
        row.eager_alone_ms = median(&eager_times).map(|m| m * 1e3);
    }
    Ok(Some(EagerPart {
        _model: model.clone(),
        eager: (opts.experiment != Experiment::Accuracy).then_some(eager),
        alone_times: eager_times,
        workload,
        inputs,
        reference,
        reference_update,
        reference_kind,
        eager_variation,
        update_rtol,
        expected,
    }))
}

/// Repetition `rep`'s input: the example input, or (`--randomize-input`) a fresh one.
fn repetition_inputs(inputs: &[Tensor], opts: &BenchOptions, rep: usize) -> Result<Vec<Tensor>> {
    Ok(if opts.randomize_input {
        randomized(inputs, opts.seed.wrapping_add(1 + rep as u64))?
    } else {
        inputs.to_vec()
    })
}

/// Phase 2 for one model: each variant's warm-up (compile) and accuracy check from a fresh
/// start, peak memory and timed repetitions, and the speedups over phase 1's eager timings.
fn bench_compiled(
    part: EagerPart,
    opts: &BenchOptions,
    backend: &BackendEntry,
    row: &mut ModelRow,
    progress: &Progress,
) -> Result<()> {
    let EagerPart {
        workload,
        mut eager,
        alone_times,
        inputs,
        reference,
        reference_update,
        reference_kind,
        eager_variation,
        update_rtol,
        expected,
        ..
    } = part;
    let name = row.model.clone();
    let tol: Tolerance = opts.tolerance();
    let warmup = opts.warmup.max(1);
    // Warm-up (compile) and accuracy check of each variant, from a fresh start.
    let mut contenders: Vec<Option<Box<dyn Contender>>> = Vec::new();
    for v in row.results.iter_mut() {
        let label = v.variant.label(backend.label());
        progress.message(format!("{name}: compiling {label}"));
        let r = (|| -> Result<Box<dyn Contender>> {
            workload.reset()?;
            let mut c = workload.compiled(backend, &v.variant)?;
            let mut acc: Option<Accuracy> = None;
            let mut merge = |a: Accuracy| {
                acc = Some(match acc {
                    Some(prev) => prev.merge(a),
                    None => a,
                });
            };
            for k in 0..warmup {
                let t0 = Instant::now();
                let out = c.run(&inputs, 1)?;
                if k == 0 {
                    v.compile_s = Some(t0.elapsed().as_secs_f64());
                }
                if k == 0 || workload.compare_each_call() {
                    merge(compare(&reference, &out, &tol));
                }
                if k == 0 {
                    if let Some(expected) = &reference_update {
                        c.sync_to_store()?;
                        if let Some(got) = workload.update()? {
                            merge(compare_updates(expected, &got, update_rtol));
                        }
                    }
                }
            }
            if let Some(mut a) = acc {
                a.reference = reference_kind;
                if eager_variation {
                    a.status = AccuracyStatus::EagerVariation;
                }
                v.accuracy = Some(a);
            }
            v.stats = c.stats();
            Ok(c)
        })();
        match r {
            Ok(c) => contenders.push(Some(c)),
            Err(e) => {
                v.error = Some(error_text(&e));
                contenders.push(None);
            }
        }
        progress.inc(1);
    }
    if opts.experiment == Experiment::Accuracy {
        return Ok(());
    }

    // Peak memory of one call per contender, outside the timed runs (see crate::memory).
    for (vi, slot) in contenders.iter_mut().enumerate() {
        let Some(c) = slot else { continue };
        let (out, peak) = memory::peak_growth(|| c.run(&inputs, 1));
        match out {
            Ok(_) => row.results[vi].peak_bytes = peak,
            Err(e) => {
                row.results[vi].error = Some(error_text(&e));
                *slot = None;
            }
        }
    }

    // Timed repetitions: eager, then each variant, in every repetition.
    let iters = opts.iterations_per_run;
    let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(opts.repeat); contenders.len()];
    let mut eager_times = Vec::with_capacity(opts.repeat);
    for rep in 0..opts.repeat {
        progress.detail(format!("{name}: repetition {}/{}", rep + 1, opts.repeat));
        let rep_inputs = repetition_inputs(&inputs, opts, rep)?;
        if let Some(e) = eager.as_mut() {
            for _ in 0..opts.switch_in {
                e.run(&rep_inputs, 1)?;
            }
            let t0 = Instant::now();
            e.run(&rep_inputs, iters)?;
            eager_times.push(t0.elapsed().as_secs_f64() / iters as f64);
        }
        for (vi, slot) in contenders.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            // Untimed calls first: the first call after another contender ran meets caches
            // that contender filled (see `BenchOptions::switch_in`).
            let switched_in = (0..opts.switch_in).try_for_each(|_| c.run(&rep_inputs, 1).map(drop));
            if let Err(e) = switched_in {
                row.results[vi].error = Some(error_text(&e));
                *slot = None;
                continue;
            }
            let t0 = Instant::now();
            match c.run(&rep_inputs, iters) {
                Ok(out) => {
                    times[vi].push(t0.elapsed().as_secs_f64() / iters as f64);
                    if let Some(expected) = expected.get(rep) {
                        let a = compare(expected, &out, &tol);
                        let r = &mut row.results[vi];
                        r.accuracy = Some(match r.accuracy {
                            Some(prev) => prev.merge(a),
                            None => a,
                        });
                    }
                }
                Err(e) => {
                    row.results[vi].error = Some(error_text(&e));
                    *slot = None;
                }
            }
        }
        progress.inc(1);
    }

    row.eager_interleaved_ms = median(&eager_times).map(|m| m * 1e3);
    // The speedups' numerator: the faster of eager's two timings, alone and interleaved (in
    // training, compiled steps in between slowed eager's by up to ~1.7x: the ratio must not
    // gain from that; alone, it may have met another load than the compiled runs).
    let base = match (median(&alone_times), median(&eager_times)) {
        (Some(a), Some(i)) if a < i => &alone_times,
        (Some(_), None) => &alone_times,
        _ => &eager_times,
    };
    let eager_median = median(base);
    row.eager_ms = eager_median.map(|m| m * 1e3);
    for (vi, slot) in contenders.iter().enumerate() {
        let r = &mut row.results[vi];
        let Some(c) = slot else { continue };
        r.stats = c.stats();
        let m = median(&times[vi]);
        r.median_ms = m.map(|m| m * 1e3);
        if let (Some(e), Some(m)) = (eager_median, m) {
            if m > 0.0 {
                r.speedup = Some(e / m);
            }
        }
        r.p_value = welch_t_test(base, &times[vi]).map(|t| t.p);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln::ir::DType;

    #[test]
    fn eager_repeats_needs_the_loss_and_the_update_to_repeat() {
        let tol = Tolerance::TRAINING;
        let update = |seed: u64| -> Option<Vec<tch::Tensor>> {
            Some(vec![
                tch::Tensor::randn([3, 4], (tch::Kind::Float, tch::Device::Cpu))
                    * (1.0 + seed as f64),
            ])
        };
        tch::manual_seed(7);
        let u = update(0);
        let same = u.as_ref().map(|v| v.iter().map(|t| t.copy()).collect());
        let loss = [0.3065537];
        // Same loss, same update: a deterministic model.
        assert!(eager_repeats((&loss, &u), (&loss, &same), &tol));
        // Rounding-sized differences still repeat.
        let close = [0.3065537 * (1.0 + 1e-7)];
        let nudged = u
            .as_ref()
            .map(|v| v.iter().map(|t| t * (1.0 + 1e-7)).collect());
        assert!(eager_repeats((&loss, &u), (&close, &nudged), &tol));
        // Dropout: a loss that happens to agree, an update that does not.
        let other = update(1);
        assert!(!eager_repeats((&loss, &u), (&loss, &other), &tol));
        // A loss that moves (what the loss-only check caught).
        let moved = [0.3065537 * (1.0 + 4.3e-4)];
        assert!(!eager_repeats((&loss, &u), (&moved, &same), &tol));
        // Inference: no update to compare.
        assert!(eager_repeats((&loss, &None), (&loss, &None), &tol));
    }

    #[test]
    fn randomized_keeps_integer_inputs() {
        let x = Tensor::randn(&[2, 3], 1).unwrap();
        let ids = Tensor::randint(&[2, 4], 10, 2).unwrap();
        let r = randomized(&[x.clone(), ids.clone()], 5).unwrap();
        assert_eq!(r[0].dims(), &[2, 3]);
        assert_eq!(r[0].dtype(), DType::F32);
        assert_ne!(r[0].to_f64_vec().unwrap(), x.to_f64_vec().unwrap());
        assert_eq!(r[1].to_f64_vec().unwrap(), ids.to_f64_vec().unwrap());
        // Seeded: the same seed gives the same inputs.
        let again = randomized(&[x], 5).unwrap();
        assert_eq!(again[0].to_f64_vec().unwrap(), r[0].to_f64_vec().unwrap());
    }
}
