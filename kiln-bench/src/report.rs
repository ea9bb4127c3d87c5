//! The report: rows per model, torchbench.py's table layout and CSV.

use super::accuracy::{Accuracy, Reference, Tolerance, UPDATE_RTOL};
use super::runner::UPDATE_NOISE_FACTOR;
use super::stats::{geomean, SAME_THRESHOLD};
use super::{Experiment, Variant};
use crate::error::{Error, Result};
use kiln::runtime::Stats;
use std::path::Path;

/// One variant (column) of one model.
#[derive(Clone, Debug, PartialEq)]
pub struct VariantResult {
    /// What was measured.
    pub variant: Variant,
    /// `median(eager) / median(this)`.
    pub speedup: Option<f64>,
    /// Welch's t-test p-value of eager vs this.
    pub p_value: Option<f64>,
    /// Median milliseconds per iteration.
    pub median_ms: Option<f64>,
    /// Wall seconds of the first call (trace + compile + one run).
    pub compile_s: Option<f64>,
    /// The accuracy check (worst over all checks).
    pub accuracy: Option<Accuracy>,
    /// The runtime counters at the end (traces, compiles, executions, transfers...).
    pub stats: Option<Stats>,
    /// Peak resident-memory growth of one call in bytes (see [`ModelRow::eager_peak_bytes`]).
    pub peak_bytes: Option<u64>,
    /// Why this variant has no result.
    pub error: Option<String>,
}

impl VariantResult {
    pub(crate) fn new(variant: Variant) -> Self {
        VariantResult {
            variant,
            speedup: None,
            p_value: None,
            median_ms: None,
            compile_s: None,
            accuracy: None,
            stats: None,
            peak_bytes: None,
            error: None,
        }
    }
}

/// One model's results.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelRow {
    /// The model's name.
    pub model: String,
    /// The batch size it ran at.
    pub batch_size: usize,
    /// Eager's median milliseconds per iteration, the speedups' numerator: the lower of
    /// [`ModelRow::eager_alone_ms`] and [`ModelRow::eager_interleaved_ms`].
    pub eager_ms: Option<f64>,
    /// Eager's median timed alone, before any compiled run in the process (how a user who
    /// never ran kiln sees it).
    pub eager_alone_ms: Option<f64>,
    /// Eager's median timed interleaved with the compiled variants (each repetition runs
    /// eager, then every variant: the same machine load as theirs).
    pub eager_interleaved_ms: Option<f64>,
    /// Eager's peak resident-memory growth during one call in bytes: what the call touched
    /// beyond the memory resident before it (parameters and executables are in neither side's
    /// figure). Measured once, outside the timed runs; `None` where the system cannot measure
    /// it. The method is in the harness's `memory` module docs.
    pub eager_peak_bytes: Option<u64>,
    /// Why the model has no result at all (it failed to build or to run eagerly).
    pub error: Option<String>,
    /// Training: the reference's own rounding noise in the first step's update (its relative
    /// L2 change when the inputs move by 1e-7 relative); the update check allows five times
    /// this, or [`super::UPDATE_RTOL`] if larger.
    pub update_noise: Option<f64>,
    /// One entry per variant, in [`Report::variants`] order.
    pub results: Vec<VariantResult>,
}

/// One column of the table (and of the CSV).
#[derive(Clone, Debug, PartialEq)]
pub struct Column {
    /// The heading.
    pub header: String,
    /// Is it drawn in the table (every column is in the CSV)?
    pub in_table: bool,
    /// Right-aligned in the table?
    pub numeric: bool,
}

/// The result of a benchmark run. `Display` draws torchbench.py's table.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Performance or accuracy.
    pub experiment: Experiment,
    /// Training steps (else inference).
    pub training: bool,
    /// The backend's label (`XLA`).
    pub backend: String,
    /// The columns measured.
    pub variants: Vec<Variant>,
    /// One row per model, in the order run.
    pub rows: Vec<ModelRow>,
    /// The accuracy criterion.
    pub tolerance: Tolerance,
    /// Iterations per timed run.
    pub iterations_per_run: usize,
    /// Timed repetitions.
    pub repeat: usize,
    /// Warm-up calls.
    pub warmup: usize,
    /// Untimed calls before each timed run ([`crate::BenchOptions::switch_in`]).
    pub switch_in: usize,
    /// Were inputs randomized per repetition?
    pub randomize_input: bool,
    /// The threads each side ran on.
    pub threads: crate::threads::Threads,
    /// What ran the compiled side, for people: the PJRT plugin's path and platform version
    /// (filled in by the command line for the built-in `xla` backend).
    pub compiled_detail: Option<String>,
}

/// `v` in scientific notation with 3 decimals, or empty.
fn fmt_sci(v: Option<f64>) -> String {
    v.map(|x| format!("{x:.3e}")).unwrap_or_default()
}

/// The detail cells both experiments report per variant: max abs diff, relative error and
/// the training update's relative error (empty where not measured).
fn accuracy_details(r: &VariantResult) -> [String; 3] {
    let a = r.accuracy.as_ref();
    [
        fmt_sci(a.map(|a| a.max_abs_diff)),
        fmt_sci(a.map(|a| a.rel_err)),
        fmt_sci(a.and_then(|a| a.update_rel_err)),
    ]
}

fn megabytes(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// torchbench.py's `compression_ratio`: eager's peak memory over the compiled side's. Both are
/// at least one page when measured; a zero (nothing touched) has no meaningful ratio.
fn compression(eager: Option<u64>, compiled: Option<u64>) -> Option<f64> {
    match (eager, compiled) {
        (Some(e), Some(c)) if e > 0 && c > 0 => Some(e as f64 / c as f64),
        _ => None,
    }
}

fn fmt_opt(v: Option<f64>, prec: usize) -> String {
    match v {
        Some(x) => format!("{x:.prec$}"),
        None => String::new(),
    }
}

fn speedup_cell(r: &VariantResult) -> String {
    if r.error.is_some() {
        return "ERROR".into();
    }
    match (r.speedup, r.p_value) {
        (Some(s), Some(p)) if p > SAME_THRESHOLD => format!("{s:.3}x SAME p={p:.2}"),
        (Some(s), Some(p)) => format!("{s:.3}x p={p:.2}"),
        (Some(s), None) => format!("{s:.3}x"),
        _ => String::new(),
    }
}

fn accuracy_cell(r: &VariantResult) -> String {
    if r.error.is_some() {
        return "fail_to_run".into();
    }
    match &r.accuracy {
        Some(a) => {
            let numbers = match a.update_rel_err {
                Some(u) => format!("loss |Δ| {:.1e}, update rel err {u:.1e}", a.max_abs_diff),
                None => format!("rel err {:.1e}, max|Δ| {:.1e}", a.rel_err, a.max_abs_diff),
            };
            let interp = if a.reference == Reference::GraphInterpreter {
                ", vs graph interp"
            } else {
                ""
            };
            format!("{} ({numbers}{interp})", a.status)
        }
        None => String::new(),
    }
}

impl Report {
    /// The column headings of this report's table and CSV.
    pub fn columns(&self) -> Vec<Column> {
        let col = |h: String, in_table: bool, numeric: bool| Column {
            header: h,
            in_table,
            numeric,
        };
        let mut c = vec![col("Model".into(), true, false)];
        match self.experiment {
            Experiment::Performance => {
                for v in &self.variants {
                    c.push(col(v.label(&self.backend), true, true));
                }
                c.push(col("eager ms".into(), true, true));
                // One column, the variants' values in column order, keeps the table narrow.
                c.push(col("compile s".into(), true, true));
                // Same layout: the variants' compression ratios in column order.
                c.push(col("compression".into(), true, true));
                c.push(col("accuracy".into(), true, false));
                c.push(col("batch size".into(), false, true));
                c.push(col("update noise".into(), false, true));
                c.push(col("eager alone ms".into(), false, true));
                c.push(col("eager interleaved ms".into(), false, true));
                c.push(col("eager peak MB".into(), false, true));
                for v in &self.variants {
                    let s = v.short();
                    c.push(col(format!("compression ({s})"), false, true));
                    c.push(col(format!("peak MB ({s})"), false, true));
                    c.push(col(format!("compile s ({s})"), false, true));
                    c.push(col(format!("p ({s})"), false, true));
                    c.push(col(format!("ms ({s})"), false, true));
                    c.push(col(format!("max abs diff ({s})"), false, true));
                    c.push(col(format!("rel err ({s})"), false, true));
                    c.push(col(format!("update rel err ({s})"), false, true));
                    c.push(col(format!("traces ({s})"), false, true));
                    c.push(col(format!("compiles ({s})"), false, true));
                }
            }
            Experiment::Accuracy => {
                for v in &self.variants {
                    c.push(col(v.label(&self.backend), true, false));
                }
                c.push(col("batch size".into(), false, true));
                c.push(col("update noise".into(), false, true));
                for v in &self.variants {
                    c.push(col(format!("max abs diff ({})", v.short()), false, true));
                    c.push(col(format!("rel err ({})", v.short()), false, true));
                    c.push(col(format!("update rel err ({})", v.short()), false, true));
                    c.push(col(format!("cosine ({})", v.short()), false, true));
                }
            }
        }
        c.push(col("eager threads".into(), false, true));
        c.push(col("compiled cpus".into(), false, true));
        c.push(col("compiled".into(), false, false));
        c
    }

    /// One model's cells, `(table text, CSV value)` per column of [`Report::columns`].
    fn cells(&self, row: &ModelRow) -> Vec<(String, String)> {
        let same = |s: String| (s.clone(), s);
        let mut out = vec![same(row.model.clone())];
        let results = &row.results;
        let model_err = row.error.is_some();
        match self.experiment {
            Experiment::Performance => {
                for r in results {
                    let table = if model_err {
                        "ERROR".into()
                    } else {
                        speedup_cell(r)
                    };
                    let csv = if r.error.is_some() || model_err {
                        "ERROR".into()
                    } else {
                        fmt_opt(r.speedup, 4)
                    };
                    out.push((table, csv));
                }
                out.push((fmt_opt(row.eager_ms, 3), fmt_opt(row.eager_ms, 5)));
                let compile: Vec<String> = results
                    .iter()
                    .map(|r| match r.compile_s {
                        Some(c) => format!("{c:.2}"),
                        None => "-".into(),
                    })
                    .collect();
                let compile = if results.iter().all(|r| r.compile_s.is_none()) {
                    String::new()
                } else {
                    compile.join(" / ")
                };
                out.push(same(compile));
                let ratios: Vec<Option<f64>> = results
                    .iter()
                    .map(|r| compression(row.eager_peak_bytes, r.peak_bytes))
                    .collect();
                let compression_cell = if ratios.iter().all(Option::is_none) {
                    String::new()
                } else {
                    ratios
                        .iter()
                        .map(|c| c.map(|c| format!("{c:.2}x")).unwrap_or_else(|| "-".into()))
                        .collect::<Vec<_>>()
                        .join(" / ")
                };
                out.push(same(compression_cell));
                out.push(same(self.accuracy_summary(row)));
                out.push(same(row.batch_size.to_string()));
                out.push(same(fmt_sci(row.update_noise)));
                out.push(same(fmt_opt(row.eager_alone_ms, 5)));
                out.push(same(fmt_opt(row.eager_interleaved_ms, 5)));
                out.push(same(fmt_opt(row.eager_peak_bytes.map(megabytes), 3)));
                for (r, ratio) in results.iter().zip(&ratios) {
                    out.push(same(fmt_opt(*ratio, 4)));
                    out.push(same(fmt_opt(r.peak_bytes.map(megabytes), 3)));
                    out.push(same(fmt_opt(r.compile_s, 4)));
                    out.push(same(fmt_opt(r.p_value, 4)));
                    out.push(same(fmt_opt(r.median_ms, 5)));
                    out.extend(accuracy_details(r).map(same));
                    let st = r.stats.as_ref();
                    out.push(same(st.map(|s| s.traces.to_string()).unwrap_or_default()));
                    out.push(same(st.map(|s| s.compiles.to_string()).unwrap_or_default()));
                }
            }
            Experiment::Accuracy => {
                for r in results {
                    let s = if model_err {
                        "fail_to_run".into()
                    } else {
                        accuracy_cell(r)
                    };
                    let csv = if model_err || r.error.is_some() {
                        "fail_to_run".into()
                    } else {
                        r.accuracy.map(|a| a.status.to_string()).unwrap_or_default()
                    };
                    out.push((s, csv));
                }
                out.push(same(row.batch_size.to_string()));
                out.push(same(fmt_sci(row.update_noise)));
                for r in results {
                    out.extend(accuracy_details(r).map(same));
                    out.push(same(
                        r.accuracy
                            .map(|a| format!("{:.7}", a.cosine))
                            .unwrap_or_default(),
                    ));
                }
            }
        }
        out.push(same(self.threads.eager.to_string()));
        out.push(same(self.threads.cpus.to_string()));
        out.push(same(format!(
            "{}{}",
            self.backend,
            self.compiled_detail
                .as_deref()
                .map(|d| format!(" ({d})"))
                .unwrap_or_default()
        )));
        out
    }

    /// `pass` when every variant passed, else the failing variants, each with its figures
    /// (as in the accuracy table).
    fn accuracy_summary(&self, row: &ModelRow) -> String {
        if row.error.is_some() {
            return "fail_to_run".into();
        }
        let mut bad = Vec::new();
        for r in &row.results {
            let s = r.variant.short();
            if r.error.is_some() {
                bad.push(format!("{s}: fail_to_run"));
            } else if let Some(a) = &r.accuracy {
                // With its figures and reference, so a failure in a timing table can be
                // told apart (a wrong update, a loss off, a reference of its own).
                if !a.passed() {
                    bad.push(format!("{s}: {}", accuracy_cell(r)));
                }
            }
        }
        if bad.is_empty() {
            let interp = row.results.iter().any(|r| {
                r.accuracy
                    .is_some_and(|a| a.reference == Reference::GraphInterpreter)
            });
            if interp {
                "pass (vs graph interp)".into()
            } else {
                "pass".into()
            }
        } else {
            bad.join(", ")
        }
    }

    /// ` (geomean eager ms alone, before any compiled run: A; interleaved: B)`, over the
    /// models where both were timed (empty if none).
    fn eager_alone_line(&self) -> String {
        let (alone, interleaved): (Vec<f64>, Vec<f64>) = self
            .rows
            .iter()
            .filter_map(|r| Some((r.eager_alone_ms?, r.eager_interleaved_ms?)))
            .filter(|&(a, b)| a > 0.0 && b > 0.0)
            .unzip();
        match (geomean(&alone), geomean(&interleaved)) {
            (Some(a), Some(b)) => format!(
                " (geomean eager ms alone, before any compiled run: {a:.3}; interleaved: {b:.3})"
            ),
            _ => String::new(),
        }
    }

    /// The header line saying what ran on how many threads: `eager: libtorch 2 intra-op
    /// thread(s) (libtorch's default), timed interleaved with the compiled runs (geomean eager
    /// ms alone, before any compiled run: 8.120; interleaved: 7.950); compiled: XLA (plugin
    /// ...), its threads confined to 2 CPU(s) ...` (plus `OMP_WAIT_POLICY` when set).
    pub fn threads_line(&self) -> String {
        let t = &self.threads;
        let eager = format!(
            "eager: libtorch {} intra-op thread(s) ({}){}, timed interleaved with the compiled runs{}",
            t.eager,
            if t.eager_default {
                "libtorch's default"
            } else {
                "--threads"
            },
            t.omp_wait_policy
                .as_deref()
                .map(|p| format!(", OMP_WAIT_POLICY={p}"))
                .unwrap_or_default(),
            self.eager_alone_line()
        );
        let detail = self
            .compiled_detail
            .as_deref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        let pool = crate::threads::xla_pool_threads()
            .filter(|&n| n > 0)
            .map(|n| format!(" (XLA's intra-op pool: {n} thread(s))"))
            .unwrap_or_default();
        format!(
            "{eager}; compiled: {}{detail}, its threads confined to {} CPU(s) by the process's \
             CPU affinity{pool}",
            self.backend, t.cpus
        )
    }

    /// The geometric mean of a variant's speedups over the models that have one.
    pub fn geomean(&self, variant: usize) -> Option<f64> {
        let v: Vec<f64> = self
            .rows
            .iter()
            .filter(|r| r.error.is_none())
            .filter_map(|r| r.results.get(variant).and_then(|x| x.speedup))
            .collect();
        geomean(&v)
    }

    /// Does every model pass the accuracy check in every variant (and run)?
    pub fn all_passed(&self) -> bool {
        self.rows.iter().all(|r| {
            r.error.is_none()
                && r.results
                    .iter()
                    .all(|v| v.error.is_none() && v.accuracy.is_some_and(|a| a.passed()))
        })
    }

    /// The table as rows of cells (header first; the `geomean` row last in performance mode),
    /// table columns only.
    pub fn table_rows(&self) -> Vec<Vec<String>> {
        let cols = self.columns();
        let keep: Vec<usize> = (0..cols.len()).filter(|&i| cols[i].in_table).collect();
        let mut rows = vec![keep.iter().map(|&i| cols[i].header.clone()).collect()];
        for row in &self.rows {
            let cells = self.cells(row);
            rows.push(keep.iter().map(|&i| cells[i].0.clone()).collect());
        }
        if self.experiment == Experiment::Performance && !self.rows.is_empty() {
            let mut g = vec![String::new(); keep.len()];
            g[0] = "geomean".into();
            for (vi, _) in self.variants.iter().enumerate() {
                // Speedup columns follow "Model" directly.
                g[1 + vi] = self
                    .geomean(vi)
                    .map(|x| format!("{x:.4}x"))
                    .unwrap_or_default();
            }
            rows.push(g);
        }
        rows
    }

    /// The CSV: one header line with every column (the table's and the detail columns), then
    /// one line per model.
    pub fn to_csv(&self) -> Result<String> {
        let mut w = csv::Writer::from_writer(Vec::new());
        let csv_err = |e: csv::Error| Error::Invalid(format!("writing CSV: {e}"));
        w.write_record(self.columns().iter().map(|c| c.header.as_str()))
            .map_err(csv_err)?;
        for row in &self.rows {
            w.write_record(self.cells(row).iter().map(|c| c.1.as_str()))
                .map_err(csv_err)?;
        }
        let bytes = w
            .into_inner()
            .map_err(|e| Error::Invalid(format!("writing CSV: {e}")))?;
        String::from_utf8(bytes).map_err(|e| Error::Invalid(format!("CSV is not UTF-8: {e}")))
    }

    /// Writes [`Report::to_csv`] to `path`.
    pub fn write_csv(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_csv()?).map_err(|e| Error::io(path, e))
    }

    /// The errors of failed models and variants, one line each.
    pub fn errors(&self) -> Vec<String> {
        let mut out = Vec::new();
        for row in &self.rows {
            if let Some(e) = &row.error {
                out.push(format!("{}: {e}", row.model));
            }
            for r in &row.results {
                if let Some(e) = &r.error {
                    out.push(format!(
                        "{} [{}]: {e}",
                        row.model,
                        r.variant.label(&self.backend)
                    ));
                }
            }
        }
        out
    }
}

/// Draws `rows` (header first) as torchbench.py's grid: `+---+` rules, `+===+` under the header,
/// text left-aligned and the `numeric` columns right-aligned.
pub fn draw_grid(rows: &[Vec<String>], numeric: &[bool]) -> String {
    let ncol = rows.iter().map(|r| r.len()).max().unwrap_or(0);
    let width = |s: &str| s.chars().count();
    let widths: Vec<usize> = (0..ncol)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| width(s))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let rule = |ch: char| {
        let mut s = String::from("+");
        for w in &widths {
            s.extend(std::iter::repeat_n(ch, w + 2));
            s.push('+');
        }
        s.push('\n');
        s
    };
    let mut out = rule('-');
    for (i, r) in rows.iter().enumerate() {
        out.push('|');
        for (c, w) in widths.iter().enumerate() {
            let cell = r.get(c).map(String::as_str).unwrap_or("");
            let pad = w - width(cell);
            let right = i > 0 && numeric.get(c).copied().unwrap_or(false);
            if right {
                out.push_str(&format!(" {}{} |", " ".repeat(pad), cell));
            } else {
                out.push_str(&format!(" {}{} |", cell, " ".repeat(pad)));
            }
        }
        out.push('\n');
        out.push_str(&rule(if i == 0 { '=' } else { '-' }));
    }
    out
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cols = self.columns();
        let numeric: Vec<bool> = cols
            .iter()
            .filter(|c| c.in_table)
            .map(|c| c.numeric)
            .collect();
        f.write_str(&draw_grid(&self.table_rows(), &numeric))?;
        let what = if self.training {
            "training"
        } else {
            "inference"
        };
        match self.experiment {
            Experiment::Performance => writeln!(
                f,
                "{what}; speedup = eager median / compiled median over {} repetitions of {} \
                 iteration(s) (eager and the variants interleaved, each timed run after {} untimed call(s) of \
                 the same contender; eager's median is the faster of \
                 its interleaved one and its own before any compiled run; {} warm-up call(s) excluded{}); p = Welch's t-test \
                 (SAME: p > {SAME_THRESHOLD}); compile s = each column's first call (trace + compile + \
                 run), in column order; compression = eager peak memory / compiled peak memory, \
                 each the resident-set growth during one call over the resident set before it \
                 (parameters and executables excluded on both sides), in column order",
                self.repeat,
                self.iterations_per_run,
                self.switch_in,
                self.warmup,
                if self.randomize_input {
                    ", fresh inputs per repetition"
                } else {
                    ""
                }
            )?,
            Experiment::Accuracy => writeln!(f, "{what}; accuracy against eager")?,
        }
        writeln!(f, "{}", self.threads_line())?;
        if self.training {
            writeln!(
                f,
                "accuracy: the first step's loss {} and its parameter update (relative L2 error \
                 over all parameters <= max({UPDATE_RTOL:e}, {UPDATE_NOISE_FACTOR} x its change \
                 when the inputs move by float32 rounding, 1e-7 relative))",
                self.tolerance.describe(),
            )?;
        } else {
            writeln!(f, "accuracy: {}", self.tolerance.describe())?;
        }
        let interp = self.rows.iter().any(|r| {
            r.results.iter().any(|v| {
                v.accuracy
                    .is_some_and(|a| a.reference == Reference::GraphInterpreter)
            })
        });
        if interp {
            writeln!(
                f,
                "vs graph interp: libtorch eager draws its own dropout masks, so these models are \
                 checked against kiln's eager graph interpreter (same masks as every backend)"
            )?;
        }
        for e in self.errors() {
            writeln!(f, "error: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_matches_the_seeds_layout() {
        let rows = vec![
            vec!["Model".to_string(), "XLA (trace once)".to_string()],
            vec!["resnet18".to_string(), "1.38".to_string()],
        ];
        let g = draw_grid(&rows, &[false, true]);
        let expected = "\
+----------+------------------+
| Model    | XLA (trace once) |
+==========+==================+
| resnet18 |             1.38 |
+----------+------------------+
";
        assert_eq!(g, expected);
    }
}
