//! The executor shared by [`crate::CompiledFn`] and [`crate::train::TrainStep`]: one or more
//! executables run in sequence, with where each input comes from and where each output goes.
//!
//! A [`Plan`] is a list of [`Step`]s. A step's inputs are the caller's per-call buffers
//! ([`Arg::Data`]), resident variables ([`Arg::Var`]) or values an earlier step produced
//! ([`Arg::Temp`]); each of its graph's outputs (before [dedup](crate::passes::dedup_outputs)) goes
//! to a temporary or replaces a variable ([`Dest`]). The routing rules live here, once:
//!
//! - An output that is an input returned unchanged is copied (or, for the host, downloaded)
//!   *before* the executable runs, as the run may donate that input's buffer; a variable
//!   "updated" to its own value is left alone. So `var.assign(&x)` with `x` the function's
//!   argument or another variable gives `var` a copy of `x`.
//! - Values for the host ([`Dest::Host`]) are downloaded before any buffer moves. An executable
//!   output that several places must own (two variables assigned one value) gives the last of
//!   them the buffer and the others copies.
//! - Variable updates replace the resident buffers after the step, so a later step reads the
//!   new values.
//!
//! [`StepBuilder`] assembles a step's graph together with its inputs, outputs and donations;
//! [`PlanBuilder`] numbers the temporaries that connect steps.

use super::Runtime;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::ir::{Fingerprint, Graph, InputKind, NodeId, Op, TensorType};
use crate::passes::{dedup_outputs, simplify, OutputSource};
use crate::Tensor;
use smallvec::SmallVec;
use std::collections::HashSet;
use std::sync::Arc;

/// A variable's process-unique id ([`crate::trace::VarInfo::id`]).
pub(crate) type VarId = u64;

/// Where an executable input comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    /// The caller's `i`-th per-call buffer.
    Data(usize),
    /// A resident variable.
    Var(VarId),
    /// A value an earlier step of the plan produced.
    Temp(usize),
}

/// Where a value a step produces goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Dest {
    /// A temporary of the plan (read by a later step, or by the caller after the run).
    Temp(usize),
    /// The new value of a resident variable.
    Var(VarId),
    /// A value the caller reads on the host after the run (downloaded: one sync).
    Host(usize),
}

/// One executable with its input bindings and output routes.
pub(crate) struct Step<B: Backend> {
    pub(crate) name: &'static str,
    pub(crate) exe: Arc<B::Executable>,
    /// One per executable input.
    pub(crate) args: Vec<Arg>,
    /// One per output of the step's graph before dedup: where the executable delivers it, and
    /// where it goes.
    pub(crate) routes: Vec<(OutputSource, Dest)>,
    /// The graph `exe` was compiled from and its fingerprint (for [`crate::inspect`]).
    pub(crate) graph: Arc<Graph>,
    pub(crate) fingerprint: Fingerprint,
}

/// What a run of a [`Plan`] produced.
pub(crate) struct Values<B: Backend> {
    /// The plan's temporaries ([`Dest::Temp`]).
    pub(crate) temps: Vec<Option<B::Buffer>>,
    /// Values downloaded for the caller ([`Dest::Host`]).
    pub(crate) hosts: Vec<Option<Tensor>>,
}

/// Steps run in order, connected by temporaries. Holds no tensors (variables are ids), so a
/// plan can be shared between threads.
pub(crate) struct Plan<B: Backend> {
    pub(crate) steps: Vec<Step<B>>,
    pub(crate) num_temps: usize,
    num_hosts: usize,
    /// Every variable the plan reads (made resident before it runs; a variable only written
    /// needs no upload).
    vars: Vec<VarId>,
    /// Does any step write a variable?
    writes: bool,
}

impl<B: Backend> Plan<B> {
    /// Checks the wiring: indices in range, every temporary written before it is read.
    pub(crate) fn new(steps: Vec<Step<B>>, num_temps: usize, num_hosts: usize) -> Result<Self> {
        let mut written = vec![false; num_temps];
        let mut vars = Vec::new();
        let mut writes = false;
        for s in &steps {
            for a in &s.args {
                match *a {
                    Arg::Temp(k) if !written.get(k).copied().unwrap_or(false) => {
                        return Err(Error::Internal(format!(
                            "{} reads temporary {k} before any step writes it",
                            s.name
                        )))
                    }
                    Arg::Var(v) => vars.push(v),
                    _ => {}
                }
            }
            for (src, dest) in &s.routes {
                if let OutputSource::Input(i) = *src {
                    if i >= s.args.len() {
                        return Err(Error::Internal(format!(
                            "{} forwards input {i} of {}",
                            s.name,
                            s.args.len()
                        )));
                    }
                }
                match *dest {
                    Dest::Temp(k) => match written.get_mut(k) {
                        Some(w) => *w = true,
                        None => {
                            return Err(Error::Internal(format!(
                                "{} writes temporary {k} of {num_temps}",
                                s.name
                            )))
                        }
                    },
                    Dest::Var(_) => writes = true,
                    Dest::Host(k) if k >= num_hosts => {
                        return Err(Error::Internal(format!(
                            "{} writes host value {k} of {num_hosts}",
                            s.name
                        )))
                    }
                    Dest::Host(_) => {}
                }
            }
        }
        vars.sort_unstable();
        vars.dedup();
        Ok(Plan {
            steps,
            num_temps,
            num_hosts,
            vars,
            writes,
        })
    }
}

impl<B: Backend> Runtime<B> {
    /// Runs `plan` with `data` as its per-call buffers; returns its temporaries and host
    /// values.
    ///
    /// A plan that writes variables holds the variable table exclusively while it runs (other
    /// runs wait); one that only reads them runs concurrently with other readers.
    pub(crate) fn run_plan(&self, plan: &Plan<B>, data: &[B::Buffer]) -> Result<Values<B>> {
        self.run_plan_with(plan, data, false)
    }

    /// [`Runtime::run_plan`] for a caller that waits for the plan's results (or knows them
    /// computed) before it drops any of `data`: every step runs as
    /// [`Backend::execute_awaited`].
    pub(crate) fn run_plan_awaited(&self, plan: &Plan<B>, data: &[B::Buffer]) -> Result<Values<B>> {
        self.run_plan_with(plan, data, true)
    }

    fn run_plan_with(
        &self,
        plan: &Plan<B>,
        data: &[B::Buffer],
        caller_awaits: bool,
    ) -> Result<Values<B>> {
        let mut out = Values {
            temps: (0..plan.num_temps).map(|_| None).collect(),
            hosts: vec![None; plan.num_hosts],
        };
        if plan.writes {
            let mut vars = self.vars.write();
            self.make_resident(&mut vars, &plan.vars)?;
            for step in &plan.steps {
                let updates = self.run_step(step, data, &vars, &mut out, caller_awaits)?;
                for (v, buf) in updates {
                    self.replace_resident(&mut vars, v, buf)?;
                }
            }
        } else {
            let mut vars = self.vars.read();
            if !plan.vars.iter().all(|v| vars.contains_key(v)) {
                drop(vars);
                let mut w = self.vars.write();
                self.make_resident(&mut w, &plan.vars)?;
                vars = parking_lot::RwLockWriteGuard::downgrade(w);
            }
            for step in &plan.steps {
                if !self
                    .run_step(step, data, &vars, &mut out, caller_awaits)?
                    .is_empty()
                {
                    return Err(Error::Internal(format!(
                        "{} updated a variable in a read-only plan",
                        step.name
                    )));
                }
            }
        }
        Ok(out)
    }

    /// Binds, runs and routes one step; returns its variable updates (applied by the caller).
    fn run_step(
        &self,
        step: &Step<B>,
        data: &[B::Buffer],
        vars: &super::VarTable<B::Buffer>,
        out: &mut Values<B>,
        caller_awaits: bool,
    ) -> Result<Vec<(VarId, B::Buffer)>> {
        let Values { temps, hosts } = out;
        let (outs, mut forwarded) = {
            // Inline for small steps (a tiny model's call is a few microseconds); the lists
            // below too.
            let mut args: SmallVec<[&B::Buffer; 8]> = SmallVec::with_capacity(step.args.len());
            for a in &step.args {
                args.push(match *a {
                    Arg::Data(i) => data.get(i).ok_or_else(|| {
                        Error::Internal(format!(
                            "{} reads data input {i} of {}",
                            step.name,
                            data.len()
                        ))
                    })?,
                    Arg::Var(v) => {
                        &vars
                            .get(&v)
                            .ok_or_else(|| {
                                Error::Internal(format!(
                                    "{} reads variable {v}, not resident",
                                    step.name
                                ))
                            })?
                            .buffer
                    }
                    Arg::Temp(k) => temps.get(k).and_then(|t| t.as_ref()).ok_or_else(|| {
                        Error::Internal(format!("{} reads temporary {k}, not set", step.name))
                    })?,
                });
            }
            // Inputs returned unchanged: copied (or downloaded) now, as the run may donate them.
            let mut forwarded: SmallVec<[Option<B::Buffer>; 4]> =
                SmallVec::with_capacity(step.routes.len());
            for (src, dest) in &step.routes {
                forwarded.push(match (*src, *dest) {
                    (OutputSource::Input(i), Dest::Var(v)) if step.args[i] == Arg::Var(v) => None,
                    (OutputSource::Input(i), Dest::Host(k)) => {
                        hosts[k] = Some(self.download_result(args[i])?);
                        None
                    }
                    (OutputSource::Input(i), _) => Some(self.copy(args[i])?),
                    (OutputSource::Output(_), _) => None,
                });
            }
            // A step with a host result downloads it below, before any argument can be
            // dropped (data by the caller after the plan, replaced variables after the step).
            let awaited = caller_awaits
                || step.routes.iter().any(|(src, dest)| {
                    matches!((src, dest), (OutputSource::Output(_), Dest::Host(_)))
                });
            let outs = if awaited {
                self.execute_awaited(&step.exe, &args)?
            } else {
                self.execute(&step.exe, &args)?
            };
            (outs, forwarded)
        };
        // Count the owners of each output (device routes, and host routes), then download
        // the host values: an output's last download, where no device route follows, is
        // handed the buffer (and may then copy it with fewer checks).
        let mut uses: SmallVec<[usize; 8]> = smallvec::smallvec![0; outs.len()];
        let mut downloads: SmallVec<[usize; 8]> = smallvec::smallvec![0; outs.len()];
        for (src, dest) in &step.routes {
            if let OutputSource::Output(j) = *src {
                if j >= outs.len() {
                    return Err(Error::Internal(format!(
                        "{} routes output {j} of {}",
                        step.name,
                        outs.len()
                    )));
                }
                match dest {
                    Dest::Host(_) => downloads[j] += 1,
                    Dest::Temp(_) | Dest::Var(_) => uses[j] += 1,
                }
            }
        }
        let mut outs: Vec<Option<B::Buffer>> = outs.into_iter().map(Some).collect();
        for (src, dest) in &step.routes {
            if let (OutputSource::Output(j), Dest::Host(k)) = (*src, *dest) {
                downloads[j] -= 1;
                let value = if uses[j] == 0 && downloads[j] == 0 {
                    outs[j].take().map(|b| self.download_result_owned(b))
                } else {
                    outs[j].as_ref().map(|b| self.download_result(b))
                };
                hosts[k] = Some(value.ok_or_else(|| {
                    Error::Internal(format!("{}: output {j} was moved before", step.name))
                })??);
            }
        }
        let mut updates = Vec::new();
        for (r, (src, dest)) in step.routes.iter().enumerate() {
            if matches!(dest, Dest::Host(_)) {
                continue;
            }
            let buf = match *src {
                OutputSource::Output(j) => {
                    uses[j] -= 1;
                    if uses[j] == 0 {
                        outs[j].take()
                    } else {
                        outs[j].as_ref().map(|b| self.copy(b)).transpose()?
                    }
                }
                OutputSource::Input(_) => forwarded[r].take(),
            };
            match (*dest, buf) {
                (Dest::Temp(k), Some(b)) => temps[k] = Some(b),
                (Dest::Var(v), Some(b)) => updates.push((v, b)),
                // A variable routed to its own unchanged value.
                (Dest::Var(_), None) if matches!(src, OutputSource::Input(_)) => {}
                (Dest::Host(_), _) => {}
                (_, None) => {
                    return Err(Error::Internal(format!(
                        "{}: output {src:?} was moved before its last route",
                        step.name
                    )))
                }
            }
        }
        Ok(updates)
    }

    /// A new buffer with `b`'s value (through the host: the [`Backend`] trait has no device
    /// copy), replica by replica.
    fn copy(&self, b: &B::Buffer) -> Result<B::Buffer> {
        self.copy_buffer(b)
    }
}

/// A step's graph under construction, together with where each of its inputs comes from,
/// where each output goes and which inputs it donates.
pub(crate) struct StepBuilder {
    name: &'static str,
    graph: Graph,
    args: Vec<Arg>,
    outputs: Vec<(NodeId, Dest)>,
    donations: Vec<(usize, usize)>,
    updated: HashSet<VarId>,
}

impl StepBuilder {
    /// Starts from `graph`, whose inputs are bound to `args` (one each); its outputs are
    /// replaced by those added here.
    pub(crate) fn new(name: &'static str, graph: Graph, args: Vec<Arg>) -> Result<Self> {
        if args.len() != graph.inputs().len() {
            return Err(Error::Internal(format!(
                "{name}: {} bindings for {} graph inputs",
                args.len(),
                graph.inputs().len()
            )));
        }
        Ok(StepBuilder {
            name,
            graph,
            args,
            outputs: Vec::new(),
            donations: Vec::new(),
            updated: HashSet::new(),
        })
    }

    /// The graph, to add nodes to.
    pub(crate) fn graph(&mut self) -> &mut Graph {
        &mut self.graph
    }

    /// The node of the graph's `i`-th input.
    pub(crate) fn input_node(&self, i: usize) -> NodeId {
        self.graph.inputs()[i].node
    }

    /// Adds a graph input bound to `arg`.
    pub(crate) fn input(
        &mut self,
        kind: InputKind,
        name: impl Into<String>,
        ty: TensorType,
        arg: Arg,
    ) -> NodeId {
        self.args.push(arg);
        self.graph.add_input(kind, name, ty)
    }

    /// Sends `node`'s value to `dest`.
    pub(crate) fn output(&mut self, node: NodeId, dest: Dest) {
        self.outputs.push((node, dest));
    }

    /// Makes `node` the new value of variable `var`. If `var` is an input of this step, its
    /// buffer is donated to the new value (updated in place on XLA).
    pub(crate) fn update(&mut self, node: NodeId, var: VarId) -> Result<()> {
        self.assign(node, var, true)
    }

    /// Makes `node` the new value of variable `var` in a buffer of its own: `var`'s buffer is
    /// not donated, and is freed once the variable holds the new one. For a value the step
    /// reads in an order XLA cannot tell comes before the update, where it would copy the
    /// donated input on entry instead.
    pub(crate) fn update_in_new_buffer(&mut self, node: NodeId, var: VarId) -> Result<()> {
        self.assign(node, var, false)
    }

    fn assign(&mut self, node: NodeId, var: VarId, donate: bool) -> Result<()> {
        if !self.updated.insert(var) {
            return Err(Error::Internal(format!(
                "{}: variable {var} updated twice",
                self.name
            )));
        }
        let out = self.outputs.len();
        self.outputs.push((node, Dest::Var(var)));
        if !donate {
            return Ok(());
        }
        if let Some(i) = self.args.iter().position(|a| *a == Arg::Var(var)) {
            if !matches!(self.graph.node(node).op, Op::Input(_)) {
                self.donations.push((i, out));
            }
        }
        Ok(())
    }

    /// The variables this step updates.
    pub(crate) fn updated(&self) -> &HashSet<VarId> {
        &self.updated
    }

    /// Finishes the graph (outputs, donations, simplification, dedup) and gets its executable.
    pub(crate) fn finish<B: Backend>(self, rt: &Runtime<B>) -> Result<Step<B>> {
        let StepBuilder {
            name,
            mut graph,
            args,
            outputs,
            donations,
            ..
        } = self;
        let (nodes, dests): (Vec<NodeId>, Vec<Dest>) = outputs.into_iter().unzip();
        graph.set_outputs(nodes)?;
        // A training step's programs update its variables every step.
        for (i, a) in args.iter().enumerate() {
            if matches!(a, Arg::Var(_)) {
                graph.set_updated_between_calls(i, true)?;
            }
        }
        for (i, o) in donations {
            graph.add_alias(i, o)?;
        }
        simplify(&mut graph)?;
        let sources = dedup_outputs(&mut graph)?;
        rt.backend().rewrite(&mut graph)?;
        graph.verify()?;
        if graph.inputs().len() != args.len() || sources.len() != dests.len() {
            return Err(Error::Internal(format!(
                "{name}: the simplified graph no longer matches its bindings"
            )));
        }
        let fingerprint = graph.fingerprint();
        let exe = rt.executable(&graph, fingerprint)?;
        Ok(Step {
            name,
            exe,
            args,
            routes: sources.into_iter().zip(dests).collect(),
            graph: Arc::new(graph),
            fingerprint,
        })
    }
}

/// Steps and the temporaries that connect them.
#[derive(Default)]
pub(crate) struct PlanBuilder<B: Backend> {
    steps: Vec<Step<B>>,
    num_temps: usize,
}

impl<B: Backend> PlanBuilder<B> {
    /// An empty plan.
    pub(crate) fn new() -> Self {
        PlanBuilder {
            steps: Vec::new(),
            num_temps: 0,
        }
    }

    /// A new temporary.
    pub(crate) fn temp(&mut self) -> usize {
        self.num_temps += 1;
        self.num_temps - 1
    }

    /// Appends a step.
    pub(crate) fn push(&mut self, step: Step<B>) {
        self.steps.push(step);
    }

    /// The checked plan.
    pub(crate) fn finish(self) -> Result<Plan<B>> {
        Plan::new(self.steps, self.num_temps, 0)
    }
}
