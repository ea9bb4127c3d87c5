//! Per-node choice of lowering by measurement (autotune).
//!
//! Each convolution and dot of a graph can be lowered several ways by the XLA backend
//! ([`Lowering`]): XLA's own `stablehlo.convolution` / `dot_general`, the im2col expansion of a
//! convolution ([`crate::passes::im2col()`], pad + strided slices + one `dot_general`), or a
//! custom call to kiln's libtorch kernels ([`super::kernels`]). Which is fastest depends on the
//! shapes, the plugin and the CPU, and no fixed rule got it right everywhere (the rule of
//! [`FfiMode::Auto`] made resnet18 and squeezenet1_1 slower than pure XLA). So at compile time
//! the backend times the candidates on each node's own shapes and picks the fastest:
//!
//! - **What is timed.** For each node a *site* is cut out of the graph: the node, the chain of
//!   layout ops between it and the values it really reads (the reversed, regrouped kernel of an
//!   input-gradient convolution; the regrouped input and transposed cotangent of a
//!   weight-gradient convolution, and the transposes that turn its result into the weight
//!   gradient), those values as inputs. Each candidate lowering of that small graph is compiled
//!   to its own executable and run on seeded random data: two warm-ups, then up to
//!   [`Autotune::reps`] timed runs, median. A candidate whose best of two runs is already
//!   slower than twice the best median so far stops there.
//! - **Fusion, and why whole graphs are checked too.** A node timed alone is not the node
//!   inside the model: XLA fuses elementwise neighbours into its own ops but not into a
//!   custom call, and a libtorch kernel runs slower inside a large executable than alone (see
//!   `kernels/threads.rs`). Three things account for it. The site includes the layout ops
//!   each lowering would read through or materialize, so those costs are measured, not
//!   guessed. A lowering other than XLA's own must beat the ones before it in the order XLA,
//!   im2col, libtorch by [`Autotune::margin`] (default 25 %) to be chosen: small wins, which
//!   fusion and the in-graph slowdown eat, stay with XLA. And, since per-node sums still
//!   mispredicted whole models (squeezenet1_1: the measured choices were 20 % slower than pure
//!   XLA end to end), the rewrite then compiles the whole graph under the measured choices,
//!   under the rule's and under pure XLA's (those of the three that differ), times them
//!   interleaved (after a warm-up, [`Autotune::reps`] to 25 rounds, about a second per
//!   variant; median) and keeps the fastest
//!   ([`Variant`], [`Autotune::check_graphs`]). So an autotuned graph is never compiled with
//!   choices slower than the rule's or pure XLA's *as measured at compile time*; that
//!   decision is cached like the per-node ones.
//! - **Cost.** Nodes below [`Autotune::min_flops`] keep the rule's choice (the choice cannot
//!   matter much there) except grouped convolutions, which are always timed (XLA's grouped
//!   convolutions are slow even when tiny). Identical sites (same ops, shapes and dtypes) are
//!   timed once per process: the choices live in a table keyed by the site's structure and by
//!   the plugin, its compile options, the CPU model and count, and the kernels' thread
//!   setting. A graph's measurements stop after [`Autotune::budget`]; the nodes left get the
//!   rule's choice.
//! - **Persistence.** Measured choices are written to `autotune-v1.txt` in
//!   [`Autotune::dir`] (by default `KILN_CACHE_DIR`, beside the cached executables) and read
//!   back by later processes, so a warm cache neither re-measures nor changes its choices.
//! - **Cache keys.** The choices a graph's nodes got are part of its executable's cache key
//!   ([`crate::backend::Backend::graph_cache_key`]): a changed choice compiles anew.
//!
//! `KILN_AUTOTUNE=off` (or [`Autotune::off`] in [`super::XlaOptions`]) turns measurement off:
//! every node then gets the deterministic rule ([`FfiMode::auto_conv`],
//! [`FfiMode::auto_dot`], [`ConvStrategy::auto_rule`]). `KILN_AUTOTUNE_LOG=1` prints each
//! choice to stderr as it is made (also logged at `info` level, target `kiln::autotune`);
//! [`super::XlaBackend::autotune_report`] returns them.

use super::kernels::{
    conv_flops, conv_supported, dot_flops, dot_supported, forward_weight_of, rule_selection,
    weight_gradient_operands_of, FfiMode, CONV_TARGET, DOT_TARGET,
};
use super::{ConvLowering, ConvStrategy};
use crate::error::{Error, Result};
use crate::ir::{DType, Graph, InputKind, NodeId, Op};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How one convolution or dot node is lowered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lowering {
    /// XLA's own op (`stablehlo.convolution`, `stablehlo.dot_general`).
    Xla,
    /// The im2col expansion of a convolution ([`crate::passes::im2col()`]).
    Im2col,
    /// A custom call to kiln's libtorch kernel ([`super::kernels`]).
    Ffi,
}

impl Lowering {
    /// Every lowering, in order of preference (see [`decide`]).
    pub const ALL: [Lowering; 3] = [Lowering::Xla, Lowering::Im2col, Lowering::Ffi];

    /// A short stable name (`xla`, `im2col`, `ffi`), as in the choice files.
    pub fn name(&self) -> &'static str {
        match self {
            Lowering::Xla => "xla",
            Lowering::Im2col => "im2col",
            Lowering::Ffi => "ffi",
        }
    }

    /// The lowering named `s` ([`Lowering::name`]).
    pub fn parse(s: &str) -> Option<Lowering> {
        Lowering::ALL.into_iter().find(|l| l.name() == s)
    }
}

impl fmt::Display for Lowering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Autotune settings, part of [`super::XlaOptions`].
///
/// **Default: off** (the rule), unless `KILN_AUTOTUNE` is set to `on` (or `1`, `true`,
/// anything but `off`, `0`, `false`, `no`, `rule`); choices stored under `KILN_CACHE_DIR`
/// when that is set. [`Autotune::on`] / [`Autotune::off`] set it in code.
///
/// Why off by default: measurement costs compile time and its outcome depends on the machine's
/// load at that moment. Measured on the 2-vCPU AMD EPYC (xla-cpu-pjrt 0.0.1, batch 4 at 64×64;
/// a machine shared with other jobs; libtorch with `OMP_WAIT_POLICY=PASSIVE` as the benchmark
/// harness ran it then; `examples/autotune_report.rs --e2e`), ms per run, median / best of 21
/// interleaved rounds in rotating order, and the first call (trace + measure + compile);
/// "kept" is the whole-graph check's pick. Inference at load average ~7:
///
/// | model | pure XLA | rule | autotune (kept) | first call: rule → autotune |
/// |---|---|---|---|---|
/// | resnet18 | 29.1 / 19.7 | 21.5 / 17.9 | 20.3 / 17.0 (per node) | 0.6 s → 10.4 s |
/// | resnet18 (again) | 30.0 / 22.2 | 21.9 / 20.0 | 20.3 / 17.9 (per node) | 0.6 s → 8.6 s |
/// | mobilenet_v2 | 56.4 / 53.8 | 14.8 / 13.6 | 14.6 / 13.2 (the rule's) | 1.4 s → 12.9 s |
/// | squeezenet1_1 | 4.9 / 4.4 | 6.0 / 5.2 | 4.8 / 3.9 (pure XLA's) | 0.8 s → 6.1 s |
/// | bert | 30.4 / 29.4 | 30.6 / 28.9 | 27.5 / 24.3 (per node) | 1.0 s → 3.9 s |
/// | vgg16 (9 rounds) | 603 / 584 | 164 / 159 | 163 / 158 (the rule's) | 1.1 s → 22.6 s |
/// | resnet18, fused training step (9 rounds) | 202 / 188 | 125 / 121 | 128 / 101 (the rule's) | 4.6 s → 38 s |
///
/// and at load average 12–15 (7 rounds; the machine several times slower than quiet):
///
/// | model | pure XLA | rule | autotune (kept) | first call: rule → autotune |
/// |---|---|---|---|---|
/// | resnet18, fused training step | 532 / 416 | 312 / 236 | 228 / 100 (per node) | 18 s → 89 s |
/// | vgg16 | 1821 / 1444 | 494 / 316 | 500 / 188 (the rule's) | 11 s → 140 s |
///
/// Autotune was at least as fast as the better of the rule and pure XLA everywhere, within
/// this machine's noise (±15 % between identical executables), and 10 % faster on bert (and
/// on resnet18's training step under heavy load, where the check kept the per-node choices),
/// at 4–20× the first call's time (a second process with
/// the same `KILN_CACHE_DIR` measures nothing). The whole-graph check decides on about a
/// second of runs per variant; an earlier version deciding on 5 rounds once kept per-node
/// choices for resnet18 (22.6 ms vs the rule's 26.0 ms at compile time, load ~13) that then
/// ran at 39.5 ms median against the rule's 20.8 ms.
///
/// On a loaded machine, without passive OpenMP waiting, a libtorch kernel timed 100 ms instead
/// of 0.3 ms, so choices made then differ from choices made on a quiet machine: a library
/// default should not make compiled code depend on that, nor make every test and one-off
/// script pay the measurement. Turn it on (`KILN_AUTOTUNE=on` with `KILN_CACHE_DIR` set) for
/// long runs and benchmarks, where it is paid once.
#[derive(Clone, Debug, PartialEq)]
pub struct Autotune {
    /// Measure (true) or use the rule (false).
    pub enabled: bool,
    /// Ungrouped convolutions and dots below this many floating-point operations keep the
    /// rule's choice without being timed.
    pub min_flops: f64,
    /// Timed runs per candidate (after one warm-up); the median counts.
    pub reps: usize,
    /// How much faster (a fraction) a lowering must be than the one before it in the order
    /// XLA, im2col, libtorch to be chosen.
    pub margin: f64,
    /// Measurement time allowed per graph; nodes left when it is spent get the rule's choice.
    pub budget: Duration,
    /// Where choices are stored across processes (`None`: memory only).
    pub dir: Option<PathBuf>,
    /// Check whole graphs: compile and time the graph under the measured choices, the rule's
    /// and pure XLA's (where they differ) and keep the fastest.
    pub check_graphs: bool,
}

/// The environment variable that turns autotune off (`off`, `0`, `false`, `rule`) or on.
pub const ENV: &str = "KILN_AUTOTUNE";
/// The environment variable that prints each choice to stderr (`1`).
pub const LOG_ENV: &str = "KILN_AUTOTUNE_LOG";
/// The file (in [`Autotune::dir`]) holding the measured choices.
pub const FILE_NAME: &str = "autotune-v1.txt";

impl Default for Autotune {
    fn default() -> Self {
        let enabled = enabled_by(std::env::var(ENV).ok().as_deref());
        let dir = match std::env::var_os("KILN_CACHE_DIR") {
            Some(d) if d != "off" && !d.is_empty() => Some(PathBuf::from(d)),
            _ => None,
        };
        Autotune {
            enabled,
            min_flops: 2e6,
            reps: 5,
            margin: 0.25,
            budget: Duration::from_secs(60),
            dir,
            check_graphs: true,
        }
    }
}

/// Does a `KILN_AUTOTUNE` value (`None`: unset) turn autotune on? Off when unset or empty
/// and for `off`, `0`, `false`, `no`, `rule` (any case); on for anything else (`on`, `1`).
pub fn enabled_by(value: Option<&str>) -> bool {
    match value.map(|v| v.trim().to_ascii_lowercase()) {
        Some(v) => !matches!(v.as_str(), "" | "off" | "0" | "false" | "rule" | "no"),
        None => false,
    }
}

/// A digest of a graph's measured choices (site keys and lowerings, in any order): what
/// [`crate::backend::Backend::graph_cache_key`] adds to an executable's key under autotune.
pub fn choices_digest(choices: &[([u8; 32], Lowering)]) -> String {
    let mut keyed = choices.to_vec();
    keyed.sort();
    keyed.dedup();
    let mut h = blake3::Hasher::new();
    for (k, l) in &keyed {
        h.update(k);
        h.update(l.name().as_bytes());
    }
    format!("tune:{}", &h.finalize().to_hex()[..32])
}

impl Autotune {
    /// The deterministic rule, no measurement.
    pub fn off() -> Self {
        Autotune {
            enabled: false,
            ..Autotune::default()
        }
    }

    /// Measurement on, other settings as [`Autotune::default`].
    pub fn on() -> Self {
        Autotune {
            enabled: true,
            ..Autotune::default()
        }
    }

    /// Stores choices under `dir`.
    pub fn dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// A short text naming the settings that change which nodes are timed and how a winner is
    /// picked (part of the backend's cache key).
    pub fn key(&self) -> String {
        if self.enabled {
            format!(
                "tune1-f{:e}-m{}{}",
                self.min_flops,
                self.margin,
                if self.check_graphs { "-g" } else { "" }
            )
        } else {
            "rule".into()
        }
    }
}

/// What the backend can do for a graph's nodes: its lowering options once the plugin's
/// abilities are known.
#[derive(Clone, Debug)]
pub struct Caps {
    /// The FFI mode in effect ([`FfiMode::Off`] when the plugin cannot run the kernels).
    pub ffi: FfiMode,
    /// The convolution strategy.
    pub conv: ConvStrategy,
}

impl Caps {
    /// Does autotune choose among lowerings under these options? Not when the user fixed the
    /// choice: [`FfiMode::All`], or a convolution strategy other than [`ConvStrategy::Auto`]
    /// with no kernels to choose.
    pub fn tunable(&self) -> bool {
        self.ffi != FfiMode::All
            && (matches!(self.conv, ConvStrategy::Auto) || self.ffi == FfiMode::Auto)
    }
}

/// Where a choice came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Timed in this process.
    Measured,
    /// Timed earlier (this process, or a previous one through the choice file).
    Cached,
    /// The rule (autotune off, node below the threshold, budget spent, or nothing to choose).
    Rule,
}

/// One convolution or dot node's lowering, as [`super::XlaBackend::autotune_report`] returns
/// it.
#[derive(Clone, Debug)]
pub struct NodeChoice {
    /// The node in the graph that was tuned (before the im2col rewrite).
    pub node: NodeId,
    /// `conv`, `conv dx` (input gradient), `conv dw` (weight gradient) or `dot`.
    pub op: &'static str,
    /// Operand and result types, e.g. `f32[4,64,16,16] f32[64,64,3,3] -> f32[4,64,16,16]`,
    /// and the convolution's stride, padding and groups.
    pub shapes: String,
    /// Floating-point operations of the node.
    pub flops: f64,
    /// The chosen lowering.
    pub lowering: Lowering,
    /// Where the choice came from.
    pub source: Source,
    /// Measured µs per call of each timed candidate (empty for the rule).
    pub micros: Vec<(Lowering, f64)>,
}

impl fmt::Display for NodeChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "node {:>5} {:<8} {:<7} {:?} ({:.1} MFLOP): {}",
            self.node.index(),
            self.op,
            self.lowering.name(),
            self.source,
            self.flops * 1e-6,
            self.shapes
        )?;
        for (l, us) in &self.micros {
            write!(f, " {l}={us:.0}us")?;
        }
        Ok(())
    }
}

/// A stored choice.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Entry {
    pub lowering: Lowering,
    pub micros: Vec<(Lowering, f64)>,
    /// Measured (and so worth writing to disk), not a budget fallback.
    pub measured: bool,
    /// Human-readable description (op and shapes), written beside the key.
    pub desc: String,
}

/// The winner among timed candidates (µs each; infinite or NaN for a candidate that failed):
/// candidates in the order of [`Lowering::ALL`] (XLA, im2col, libtorch); a later one replaces
/// the current winner only if it is faster by more than `margin` (a fraction). `None` when no
/// candidate has a finite time. Deterministic for given times.
pub fn decide(times: &[(Lowering, f64)], margin: f64) -> Option<Lowering> {
    let mut sorted: Vec<(Lowering, f64)> = times
        .iter()
        .copied()
        .filter(|(_, t)| t.is_finite())
        .collect();
    sorted.sort_by_key(|(l, _)| *l);
    let mut it = sorted.into_iter();
    let (mut best, mut best_t) = it.next()?;
    for (l, t) in it {
        if t < best_t * (1.0 - margin) {
            best = l;
            best_t = t;
        }
    }
    Some(best)
}

/// A node's site: what is cut out of the graph to time it, and what its key is built from.
#[derive(Clone, Debug)]
pub(crate) struct Site {
    pub node: NodeId,
    pub op: &'static str,
    /// Values the site reads (the micro graph's inputs), in order.
    pub leaves: Vec<NodeId>,
    /// The micro graph's outputs: the node, or the transposes that absorb it.
    pub outputs: Vec<NodeId>,
    pub flops: f64,
    pub grouped: bool,
    pub dtype: DType,
}

impl Site {
    /// Operand and result types (and a convolution's stride, padding and groups), for
    /// reports: formatted only when needed (the rewrite runs on every traced call).
    pub fn shapes(&self, g: &Graph) -> String {
        let n = g.node(self.node);
        let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
        match &n.op {
            Op::Conv(c) => format!(
                "{a} {b} -> {} stride {:?} pad {:?} groups {}/{}",
                n.ty, c.strides, c.padding, c.feature_groups, c.batch_groups
            ),
            _ => format!("{a} {b} -> {}", n.ty),
        }
    }
}

/// The site of convolution or dot `id` of `g` (`None` for other nodes).
pub(crate) fn site(g: &Graph, id: NodeId) -> Option<Site> {
    let n = g.node(id);
    if n.operands.len() != 2 {
        return None;
    }
    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    match &n.op {
        Op::DotGeneral(d) => Some(Site {
            node: id,
            op: "dot",
            leaves: n.operands.to_vec(),
            outputs: vec![id],
            flops: dot_flops(d, a, b),
            grouped: false,
            dtype: n.ty.dtype,
        }),
        Op::Conv(c) => {
            let mut s = Site {
                node: id,
                op: "conv",
                leaves: n.operands.to_vec(),
                outputs: vec![id],
                flops: conv_flops(c, a, b),
                grouped: c.feature_groups > 1 || c.batch_groups > 1,
                dtype: n.ty.dtype,
            };
            if let Some((x, ct)) = weight_gradient_operands_of(g, id) {
                s.op = "conv dw";
                s.leaves = vec![x, ct];
                let users = g.users(id);
                let mut p = vec![1, 0];
                p.extend(2..n.ty.shape.rank());
                let absorbed = !users.is_empty()
                    && !g.outputs().contains(&id)
                    && users
                        .iter()
                        .all(|&u| matches!(&g.node(u).op, Op::Transpose(q) if *q == p));
                if absorbed {
                    s.outputs = users;
                }
            } else if let Some(w) = forward_weight_of(g, n.operands[1], c) {
                s.op = "conv dx";
                s.leaves = vec![n.operands[0], w];
            }
            Some(s)
        }
        _ => None,
    }
}

/// The site cut out as a graph of its own: inputs the leaves (all `Data`), outputs the site's
/// outputs. Returns the graph and the id of the site's node in it.
pub(crate) fn micro_graph(g: &Graph, s: &Site) -> Result<(Graph, NodeId)> {
    let mut m = Graph::new();
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    for (i, &l) in s.leaves.iter().enumerate() {
        if let std::collections::hash_map::Entry::Vacant(v) = map.entry(l) {
            v.insert(m.add_input(InputKind::Data, format!("in{i}"), g.node(l).ty.clone()));
        }
    }
    fn copy(
        g: &Graph,
        m: &mut Graph,
        map: &mut HashMap<NodeId, NodeId>,
        id: NodeId,
    ) -> Result<NodeId> {
        if let Some(&c) = map.get(&id) {
            return Ok(c);
        }
        let n = g.node(id);
        if matches!(n.op, Op::Input(_)) {
            return Err(Error::Internal(format!(
                "autotune: site reaches graph input {id:?} that is not one of its leaves"
            )));
        }
        let ops: Vec<NodeId> = n
            .operands
            .iter()
            .map(|&o| copy(g, m, map, o))
            .collect::<Result<_>>()?;
        let c = m.add(n.op.clone(), &ops)?;
        map.insert(id, c);
        Ok(c)
    }
    let node = copy(g, &mut m, &mut map, s.node)?;
    let outs: Vec<NodeId> = s
        .outputs
        .iter()
        .map(|&o| copy(g, &mut m, &mut map, o))
        .collect::<Result<_>>()?;
    m.set_outputs(outs)?;
    Ok((m, node))
}

/// The candidates of a site under `caps`, in the order of [`Lowering::ALL`], and the rule's
/// choice (`kernels`: the nodes the FFI rule hands to libtorch, [`rule_selection`]).
pub(crate) fn candidates(
    g: &Graph,
    s: &Site,
    caps: &Caps,
    kernels: &HashSet<NodeId>,
) -> (Vec<Lowering>, Lowering) {
    let n = g.node(s.node);
    let (a, b) = (&g.node(n.operands[0]).ty, &g.node(n.operands[1]).ty);
    let mut out = Vec::new();
    let rule = match &n.op {
        Op::Conv(c) => {
            let strategy = caps.conv.choose(c, a, b);
            let ffi_ok = caps.ffi != FfiMode::Off && conv_supported(c, a, b);
            if matches!(caps.conv, ConvStrategy::Auto) {
                out.push(Lowering::Xla);
                if c.feature_groups == 1 && c.batch_groups == 1 {
                    out.push(Lowering::Im2col);
                }
            } else {
                out.push(match strategy {
                    ConvLowering::Direct => Lowering::Xla,
                    ConvLowering::Im2col => Lowering::Im2col,
                });
            }
            if ffi_ok {
                out.push(Lowering::Ffi);
            }
            if kernels.contains(&s.node) {
                Lowering::Ffi
            } else if strategy == ConvLowering::Im2col {
                Lowering::Im2col
            } else {
                Lowering::Xla
            }
        }
        Op::DotGeneral(d) => {
            out.push(Lowering::Xla);
            if caps.ffi != FfiMode::Off && dot_supported(d, a, b) {
                out.push(Lowering::Ffi);
            }
            if kernels.contains(&s.node) {
                Lowering::Ffi
            } else {
                Lowering::Xla
            }
        }
        _ => Lowering::Xla,
    };
    (out, rule)
}

/// Times one candidate lowering of a micro graph (its site node given): µs per call, the
/// median of the runs; may stop early once the candidate is clearly slower than `cap` (µs).
pub(crate) type Timer<'a> = dyn FnMut(&Graph, NodeId, Lowering, f64) -> Result<f64> + 'a;

/// A whole graph's set of choices, among which the whole-graph check picks
/// ([`super::XlaBackend`]'s rewrite under autotune).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Variant {
    /// Every node's measured choice.
    Tuned,
    /// The rule's choices ([`FfiMode::auto_conv`], [`FfiMode::auto_dot`],
    /// [`ConvStrategy::auto_rule`]).
    Rule,
    /// No libtorch kernels: XLA and the im2col rule ([`ConvStrategy::auto_rule`]).
    PureXla,
}

impl Variant {
    /// Every variant, in order of preference on ties.
    pub const ALL: [Variant; 3] = [Variant::Tuned, Variant::Rule, Variant::PureXla];

    /// A short stable name (`tuned`, `rule`, `xla`).
    pub fn name(&self) -> &'static str {
        match self {
            Variant::Tuned => "tuned",
            Variant::Rule => "rule",
            Variant::PureXla => "xla",
        }
    }

    /// The variant named `s` ([`Variant::name`]).
    pub fn parse(s: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.name() == s)
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The whole-graph check's outcome for one graph, as
/// [`super::XlaBackend::autotune_graph_report`] returns it.
#[derive(Clone, Debug)]
pub struct GraphChoice {
    /// Convolution and dot nodes of the graph.
    pub nodes: usize,
    /// The variant used.
    pub variant: Variant,
    /// Where the decision came from ([`Source::Rule`]: the variants did not differ).
    pub source: Source,
    /// Measured ms per run of each distinct variant (empty unless measured now or cached).
    pub millis: Vec<(Variant, f64)>,
}

impl fmt::Display for GraphChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "graph of {} conv/dot nodes: {} ({:?})",
            self.nodes, self.variant, self.source
        )?;
        for (v, ms) in &self.millis {
            write!(f, " {v}={ms:.2}ms")?;
        }
        Ok(())
    }
}

/// The fastest variant by median time (ms; non-finite: failed), ties to the earlier in
/// [`Variant::ALL`]; `None` if none ran.
pub fn decide_variant(times: &[(Variant, f64)]) -> Option<Variant> {
    let mut v: Vec<(Variant, f64)> = times
        .iter()
        .copied()
        .filter(|(_, t)| t.is_finite())
        .collect();
    v.sort_by_key(|(v, _)| *v);
    v.into_iter()
        .fold(None, |best: Option<(Variant, f64)>, (x, t)| match best {
            Some((_, bt)) if bt <= t => best,
            _ => Some((x, t)),
        })
        .map(|b| b.0)
}

/// One line of the graph choice file: `KEY VARIANT NAME=MS,... # DESCRIPTION`.
pub(crate) fn format_graph_line(k: &[u8; 32], c: &GraphChoice) -> String {
    let ms: Vec<String> = c
        .millis
        .iter()
        .map(|(v, t)| format!("{v}={t:.3}"))
        .collect();
    format!(
        "{} {} {} # {} conv/dot nodes",
        hex(k),
        c.variant,
        if ms.is_empty() {
            "-".to_string()
        } else {
            ms.join(",")
        },
        c.nodes
    )
}

pub(crate) fn parse_graph_line(line: &str) -> Option<([u8; 32], GraphChoice)> {
    let (main, desc) = line.split_once(" # ").unwrap_or((line, ""));
    let mut parts = main.split_whitespace();
    let key = unhex(parts.next()?)?;
    let variant = Variant::parse(parts.next()?)?;
    let millis = match parts.next()? {
        "-" => Vec::new(),
        m => m
            .split(',')
            .map(|kv| {
                let (v, t) = kv.split_once('=')?;
                Some((Variant::parse(v)?, t.parse::<f64>().ok()?))
            })
            .collect::<Option<Vec<_>>>()?,
    };
    let nodes = desc
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    Some((
        key,
        GraphChoice {
            nodes,
            variant,
            source: Source::Cached,
            millis,
        },
    ))
}

/// The file (in [`Autotune::dir`]) holding the whole-graph checks' outcomes.
pub const GRAPH_FILE_NAME: &str = "autotune-graphs-v1.txt";

/// A node, its lowering, and its site key when the choice was autotune's (not the rule's).
pub(crate) type Chosen = (NodeId, Lowering, Option<[u8; 32]>);

/// The choice table and the settings it was built under; one per PJRT client.
#[derive(Default)]
pub(crate) struct Tuner {
    /// Choices by key (site structure + context).
    pub table: HashMap<[u8; 32], Entry>,
    /// Directories whose choice files were read.
    loaded: Vec<PathBuf>,
    /// Entries measured since the last write.
    dirty: bool,
    /// Every choice made or looked up by [`Tuner::choose`] for a rewrite, in order.
    pub report: Vec<NodeChoice>,
    /// Time spent measuring.
    pub spent: Duration,
    /// Whole-graph decisions by key (graph structure, its variants' choices, context).
    pub graphs: HashMap<[u8; 32], GraphChoice>,
    /// The variant each rewritten graph was rewritten under, by its fingerprint and the
    /// backend's cache key (its options).
    pub rewritten: HashMap<(crate::ir::Fingerprint, String), Variant>,
    /// Whole-graph decisions made or looked up, in order.
    pub graph_report: Vec<GraphChoice>,
    /// Graph decisions measured since the last write.
    graphs_dirty: bool,
    /// Graphs (fingerprints before the rewrite) whose choices are in the report already.
    pub reported: std::collections::HashSet<crate::ir::Fingerprint>,
}

/// The key of a site's micro graph under `context`.
pub(crate) fn site_key(context: &str, s: &Site, micro: &Graph) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"kiln-autotune-v1\0");
    h.update(context.as_bytes());
    h.update(b"\0");
    h.update(s.op.as_bytes());
    h.update(&micro.fingerprint().0);
    *h.finalize().as_bytes()
}

/// What besides the site decides a timing: plugin, compile options, CPU, kernel versions and
/// threads.
pub(crate) fn context(plugin: &str, options: &[u8]) -> String {
    format!(
        "{plugin}|opts{options:02x?}|cpu {}|{} cpus|{CONV_TARGET},{DOT_TARGET}|torch threads {:?}|{}",
        cpu_model(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        super::kernels::threads(),
        if super::kernels::own_grouped_conv() { "kiln grouped 2" } else { "libtorch grouped" }
    )
}

/// The CPU's model name (`/proc/cpuinfo` on Linux), else the architecture.
pub fn cpu_model() -> String {
    static MODEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MODEL.get_or_init(read_cpu_model).clone()
}

fn read_cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn hex(k: &[u8; 32]) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut k = [0u8; 32];
    for (i, b) in k.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(k)
}

/// One line of the choice file: `KEY LOWERING CANDIDATE=µS,... # DESCRIPTION`.
fn format_line(k: &[u8; 32], e: &Entry) -> String {
    let micros: Vec<String> = e
        .micros
        .iter()
        .map(|(l, t)| format!("{l}={t:.1}"))
        .collect();
    let micros = if micros.is_empty() {
        "-".to_string()
    } else {
        micros.join(",")
    };
    format!(
        "{} {} {} # {}",
        hex(k),
        e.lowering,
        micros,
        e.desc.replace('\n', " ")
    )
}

fn parse_line(line: &str) -> Option<([u8; 32], Entry)> {
    let (main, desc) = match line.split_once(" # ") {
        Some((m, d)) => (m, d.to_string()),
        None => (line, String::new()),
    };
    let mut parts = main.split_whitespace();
    let key = unhex(parts.next()?)?;
    let lowering = Lowering::parse(parts.next()?)?;
    let micros = match parts.next()? {
        "-" => Vec::new(),
        m => m
            .split(',')
            .map(|kv| {
                let (l, t) = kv.split_once('=')?;
                Some((Lowering::parse(l)?, t.parse::<f64>().ok()?))
            })
            .collect::<Option<Vec<_>>>()?,
    };
    if parts.next().is_some() {
        return None;
    }
    Some((
        key,
        Entry {
            lowering,
            micros,
            measured: true,
            desc,
        },
    ))
}

/// Reads a choice file; `Ok(empty)` when there is none. Malformed lines are skipped (and
/// counted in the warning).
pub(crate) fn read_choices(path: &Path) -> Result<HashMap<[u8; 32], Entry>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(HashMap::new()),
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut out = HashMap::new();
    let mut bad = 0;
    for line in text.lines() {
        let l = line.trim();
        if l.is_empty() || l.starts_with("//") {
            continue;
        }
        match parse_line(l) {
            Some((k, e)) => {
                out.insert(k, e);
            }
            None => bad += 1,
        }
    }
    if bad > 0 {
        log::warn!(
            "kiln: {} malformed line(s) in autotune choice file {} ignored",
            bad,
            path.display()
        );
    }
    Ok(out)
}

/// Writes `entries` (merged over what the file holds now) atomically.
pub(crate) fn write_choices(path: &Path, entries: &HashMap<[u8; 32], Entry>) -> Result<()> {
    let mut all: BTreeMap<[u8; 32], Entry> =
        read_choices(path).unwrap_or_default().into_iter().collect();
    for (k, e) in entries {
        if e.measured {
            all.insert(*k, e.clone());
        }
    }
    let mut text =
        String::from("// kiln autotune choices: key lowering candidate=us,... # op and shapes\n");
    for (k, e) in &all {
        text.push_str(&format_line(k, e));
        text.push('\n');
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let r = std::fs::write(&tmp, text)
        .map_err(|e| Error::io(&tmp, e))
        .and_then(|()| std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e)));
    if r.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    r
}

fn log_choice(c: &NodeChoice) {
    log::info!(target: "kiln::autotune", "{c}");
    if std::env::var(LOG_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
        eprintln!("kiln autotune: {c}");
    }
}

impl Tuner {
    /// Reads `dir`'s choice file into the table, once per directory (entries already in the
    /// table win: they are what this process has been using).
    pub fn load(&mut self, dir: &Path) {
        if self.loaded.iter().any(|d| d == dir) {
            return;
        }
        self.loaded.push(dir.to_path_buf());
        match read_choices(&dir.join(FILE_NAME)) {
            Ok(m) => {
                for (k, e) in m {
                    self.table.entry(k).or_insert(e);
                }
            }
            Err(e) => log::warn!("kiln: autotune choices not read: {e}"),
        }
        if let Ok(text) = std::fs::read_to_string(dir.join(GRAPH_FILE_NAME)) {
            for (k, c) in text.lines().filter_map(|l| parse_graph_line(l.trim())) {
                self.graphs.entry(k).or_insert(c);
            }
        }
    }

    /// Records a measured whole-graph decision.
    pub fn record_graph(&mut self, key: [u8; 32], c: GraphChoice) {
        log::info!(target: "kiln::autotune", "{c}");
        if std::env::var(LOG_ENV).is_ok_and(|v| !v.is_empty() && v != "0") {
            eprintln!("kiln autotune: {c}");
        }
        self.graphs_dirty |= c.source == Source::Measured;
        self.graph_report.push(c.clone());
        self.graphs.insert(key, c);
    }

    /// Writes the measured choices to `dir` if any are new. A failure only costs the cache
    /// (logged).
    pub fn save(&mut self, dir: &Path) {
        if self.dirty {
            match write_choices(&dir.join(FILE_NAME), &self.table) {
                Ok(()) => self.dirty = false,
                Err(e) => log::warn!("kiln: autotune choices not saved: {e}"),
            }
        }
        if self.graphs_dirty {
            let path = dir.join(GRAPH_FILE_NAME);
            let mut all: BTreeMap<[u8; 32], String> = std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| parse_graph_line(l.trim()).map(|(k, _)| (k, l.to_string())))
                .collect();
            for (k, c) in &self.graphs {
                if c.source == Source::Measured {
                    all.insert(*k, format_graph_line(k, c));
                }
            }
            let mut text = String::from(
                "// kiln autotune whole-graph checks: key variant variant=ms,... # nodes\n",
            );
            for l in all.values() {
                text.push_str(l);
                text.push('\n');
            }
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let r = std::fs::write(&tmp, text)
                .map_err(|e| Error::io(&tmp, e))
                .and_then(|()| std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e)));
            match r {
                Ok(()) => self.graphs_dirty = false,
                Err(e) => {
                    let _ = std::fs::remove_file(&tmp);
                    log::warn!("kiln: autotune graph choices not saved: {e}");
                }
            }
        }
    }

    /// The lowering of every convolution and dot of `g`, by node (and the site key, for
    /// those that are tuned). Under `settings.enabled` and tunable `caps`, sites above the
    /// threshold are looked up in the table and timed with `timer` when new (within the
    /// budget); every other node gets the rule's choice. The choices of the nodes `record`
    /// accepts are added to [`Tuner::report`] and logged.
    pub fn choose(
        &mut self,
        g: &Graph,
        caps: &Caps,
        settings: &Autotune,
        context: &str,
        timer: &mut Timer<'_>,
        record: &dyn Fn(NodeId) -> bool,
    ) -> Result<Vec<Chosen>> {
        let tuning = settings.enabled && caps.tunable();
        let deadline = Instant::now() + settings.budget;
        let mut out = Vec::new();
        let kernels = rule_selection(g, caps.ffi);
        for id in g.topo_order() {
            let Some(s) = site(g, id) else { continue };
            // The rule's choices are reported only where autotune could have chosen.
            let record = tuning && record(id);
            let (cands, rule) = candidates(g, &s, caps, &kernels);
            let timed = tuning
                && cands.len() > 1
                && matches!(s.dtype, DType::F32 | DType::F64)
                && (s.grouped || s.flops >= settings.min_flops);
            if !timed {
                out.push((id, rule, None));
                if record {
                    self.note(g, &s, rule, Source::Rule, Vec::new());
                }
                continue;
            }
            let (micro, mnode) = micro_graph(g, &s)?;
            let key = site_key(context, &s, &micro);
            if let Some(e) = self.table.get(&key) {
                let (l, m) = (e.lowering, e.micros.clone());
                let src = if e.measured {
                    Source::Cached
                } else {
                    Source::Rule
                };
                out.push((id, l, Some(key)));
                if record {
                    self.note(g, &s, l, src, m);
                }
                continue;
            }
            let started = Instant::now();
            let (lowering, micros, measured) = if started >= deadline {
                (rule, Vec::new(), false)
            } else {
                let mut times: Vec<(Lowering, f64)> = Vec::new();
                for &c in &cands {
                    let best = times
                        .iter()
                        .map(|t| t.1)
                        .filter(|t| t.is_finite())
                        .fold(f64::INFINITY, f64::min);
                    let t = match timer(&micro, mnode, c, 2.0 * best) {
                        Ok(t) => t,
                        Err(e) => {
                            log::info!(
                                target: "kiln::autotune",
                                "{} {}: {c} failed: {e}",
                                s.op,
                                s.shapes(g)
                            );
                            f64::INFINITY
                        }
                    };
                    times.push((c, t));
                }
                match decide(&times, settings.margin) {
                    Some(l) => (l, times, true),
                    None => (rule, times, false),
                }
            };
            self.spent += started.elapsed();
            self.table.insert(
                key,
                Entry {
                    lowering,
                    micros: micros.clone(),
                    measured,
                    desc: format!("{} {}", s.op, s.shapes(g)),
                },
            );
            self.dirty |= measured;
            out.push((id, lowering, Some(key)));
            if record {
                let src = if measured {
                    Source::Measured
                } else {
                    Source::Rule
                };
                self.note(g, &s, lowering, src, micros);
            }
        }
        Ok(out)
    }

    fn note(
        &mut self,
        g: &Graph,
        s: &Site,
        lowering: Lowering,
        source: Source,
        micros: Vec<(Lowering, f64)>,
    ) {
        let c = NodeChoice {
            node: s.node,
            op: s.op,
            shapes: s.shapes(g),
            flops: s.flops,
            lowering,
            source,
            micros,
        };
        if source != Source::Rule || lowering != Lowering::Xla {
            log_choice(&c);
        }
        self.report.push(c);
    }
}

/// Seeded values in [-0.5, 0.5) for a timing input.
pub(crate) fn random_input(
    ty: &crate::ir::TensorType,
    seed: u64,
) -> Result<crate::backend::HostTensor> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 11) as f64 / (1u64 << 53) as f64 - 0.5
    };
    let dims = ty.shape.dims();
    match ty.dtype {
        DType::F32 => {
            let v: Vec<f32> = (0..ty.shape.numel()).map(|_| next() as f32).collect();
            crate::backend::HostTensor::from_slice(dims, &v)
        }
        DType::F64 => {
            let v: Vec<f64> = (0..ty.shape.numel()).map(|_| next()).collect();
            crate::backend::HostTensor::from_slice(dims, &v)
        }
        d => Err(Error::Unsupported {
            backend: "xla".into(),
            what: format!("autotune timing inputs of dtype {d}"),
        }),
    }
}

#[cfg(test)]
mod tests;
