//! The trace context: a thread-local stack of graphs under construction.
//!
//! Tensors never point into a graph. A traced tensor holds the id of its trace and a node id;
//! operations look the active trace up here. Using a tensor from a finished or different trace
//! is an [`Error::Trace`], not undefined behaviour.

use super::{Repr, Tensor, VarKind};
use crate::backend::HostTensor;
use crate::error::{Error, Result};
use crate::ir::{Graph, GraphSize, InputKind, Literal, NodeId, Op, TensorType};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

/// What a graph input of a traced function is bound to.
#[derive(Clone, Debug)]
pub enum Binding {
    /// The caller's `i`-th argument.
    Data(usize),
    /// A variable (parameter or buffer) of a [`crate::nn::ParamStore`]; the tensor shares the
    /// store's storage, so it always reads the variable's current value.
    Var(Tensor),
    /// The random-number key, advanced by the runtime on every call.
    RngKey,
}

/// The position of the input bound to variable `var`, if any.
pub(crate) fn var_input(bindings: &[Binding], var: &Tensor) -> Option<usize> {
    let id = var.variable()?.id;
    bindings
        .iter()
        .position(|b| matches!(b, Binding::Var(t) if t.variable().map(|v| v.id) == Some(id)))
}

pub(crate) struct TraceCtx {
    pub(crate) id: u64,
    /// The nodes recorded so far; empty while the trace follows `expect`.
    graph: Graph,
    /// The earlier trace this one is checked against, and how far it has followed it.
    expect: Option<Expect>,
    bindings: Vec<Binding>,
    /// The node holding each variable's current value: its input, or what it was assigned.
    pub(crate) lifted: Lifted,
    /// Variables assigned during the trace (last assignment wins), in first-assignment order.
    pub(crate) assigns: Vec<(Tensor, NodeId)>,
    pub(crate) rng_key: Option<NodeId>,
    pub(crate) rng_draws: u32,
}

thread_local! {
    static STACK: RefCell<Vec<TraceCtx>> = const { RefCell::new(Vec::new()) };
}

static NEXT_TRACE: AtomicU64 = AtomicU64::new(1);

/// A trace's map from variable id to the node holding its value.
pub(crate) type Lifted = foldhash::HashMap<u64, NodeId>;

/// Storage a trace that repeated an earlier one did not keep, for the next trace: its graph
/// (unused) and its variable map (emptied), so a repeat allocates neither.
pub(crate) struct Spare {
    graph: Graph,
    lifted: Lifted,
}

/// Is a trace active on this thread?
pub fn is_tracing() -> bool {
    STACK.with(|s| !s.borrow().is_empty())
}

/// Records `op` on `operands` in the innermost active trace (one look at the thread's
/// stack: `apply` runs for every op); gives `op` back when no trace is active.
pub(crate) fn record(op: Op, operands: &[&Tensor]) -> std::result::Result<Result<Tensor>, Op> {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        let Some(ctx) = s.last_mut() else {
            return Err(op);
        };
        let add = || {
            let mut ids = smallvec::SmallVec::<[NodeId; 3]>::new();
            for t in operands {
                ids.push(ctx.node_of(t)?);
            }
            let node = ctx.add(op, &ids)?;
            Ok(ctx.tensor(node))
        };
        Ok(add())
    })
}

/// Runs `f` on the innermost active trace.
pub(crate) fn with_ctx<R>(f: impl FnOnce(&mut TraceCtx) -> Result<R>) -> Result<R> {
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        match s.last_mut() {
            Some(ctx) => f(ctx),
            None => Err(Error::Trace("no active trace".into())),
        }
    })
}

/// A graph input being declared, and what it is bound to (a borrowed [`Binding`]: checking a
/// repeated trace's inputs clones no tensor).
enum NewInput<'a> {
    Data(usize),
    Var(&'a Tensor),
    RngKey,
}

impl NewInput<'_> {
    fn is(&self, b: &Binding) -> bool {
        match (self, b) {
            (NewInput::Data(i), Binding::Data(j)) => i == j,
            (NewInput::Var(x), Binding::Var(y)) => same_var(x, y),
            (NewInput::RngKey, Binding::RngKey) => true,
            _ => false,
        }
    }

    fn binding(&self) -> Binding {
        match self {
            NewInput::Data(i) => Binding::Data(*i),
            NewInput::Var(t) => Binding::Var((*t).clone()),
            NewInput::RngKey => Binding::RngKey,
        }
    }
}

fn same_var(a: &Tensor, b: &Tensor) -> bool {
    matches!((a.variable(), b.variable()), (Some(x), Some(y)) if x.id == y.id)
}

/// Trace every time: a trace checked, op by op, against the latest trace of its signature.
///
/// While each recorded input and op is the one the earlier trace recorded at that position
/// (same op, same operand ids, same binding), the new trace records nothing: it hands out the
/// earlier trace's node ids and counts. A trace that ends so has recorded the same program
/// ([`Traced::same_program`]) without building a graph, inferring a type or comparing two
/// graphs afterwards. At the first difference the matched prefix is copied into the graph
/// (same ids) and the trace goes on recording.
struct Expect {
    traced: Traced,
    /// Still following: every input and op so far matched.
    following: bool,
    /// Nodes matched (ids `0..nodes`: a trace's ids are dense, in insertion order).
    nodes: usize,
    /// Inputs (and bindings) matched.
    inputs: usize,
}

impl Expect {
    fn next_input(&mut self, kind: &InputKind, ty: &TensorType, new: &NewInput) -> Option<NodeId> {
        let id = NodeId::new(self.nodes);
        let g = &self.traced.graph;
        let matches = matches!(g.get(id)?.op, Op::Input(k) if k == self.inputs)
            && g.inputs()
                .get(self.inputs)
                .is_some_and(|i| i.kind == *kind && i.ty == *ty)
            && new.is(self.traced.bindings.get(self.inputs)?);
        matches.then(|| {
            self.nodes += 1;
            self.inputs += 1;
            id
        })
    }

    fn next_node(&mut self, op: &Op, operands: &[NodeId]) -> Option<NodeId> {
        let id = NodeId::new(self.nodes);
        let node = self.traced.graph.get(id)?;
        // Same op on the same operands (hence of the same types): the same, well-typed node.
        let matches = !matches!(node.op, Op::Input(_))
            && node.operands[..] == *operands
            && node.op.same_as(op);
        matches.then(|| {
            self.nodes += 1;
            id
        })
    }

    /// Has the trace ended as the earlier one did: every node and input matched, the same
    /// outputs, and the same variables assigned from the same nodes?
    fn is_complete(&self, outputs: &[NodeId], assigns: &[(Tensor, NodeId)]) -> bool {
        let t = &self.traced;
        let n = t.num_outputs;
        self.following
            && self.nodes == t.graph.len()
            && self.inputs == t.graph.inputs().len()
            && outputs.len() == n
            && assigns.len() == t.state_updates.len()
            && t.graph.outputs().len() == n + assigns.len()
            && t.graph.outputs()[..n] == *outputs
            && assigns
                .iter()
                .zip(&t.state_updates)
                .zip(&t.graph.outputs()[n..])
                .all(|(((var, node), (earlier, _)), out)| node == out && same_var(var, earlier))
    }
}

impl TraceCtx {
    /// A context tracing into `graph` (empty), with `lifted` (empty) as its variable map,
    /// checked against `expect` if given.
    fn new(graph: Graph, mut lifted: Lifted, expect: Option<Traced>) -> Self {
        let num_inputs = match &expect {
            Some(t) => t.graph.inputs().len(),
            None => graph.capacity().inputs,
        };
        let expect = expect.map(|traced| Expect {
            // Only a trace with dense node ids can be followed by id (a trace's always are).
            following: petgraph::visit::NodeIndexable::node_bound(traced.graph.petgraph())
                == traced.graph.len(),
            traced,
            nodes: 0,
            inputs: 0,
        });
        let repeat = expect.as_ref().is_some_and(|e| e.following);
        lifted.reserve(num_inputs);
        TraceCtx {
            id: NEXT_TRACE.fetch_add(1, Ordering::Relaxed),
            graph,
            expect,
            // A repeat records no binding; a trace that diverges allocates then.
            bindings: Vec::with_capacity(if repeat { 0 } else { num_inputs }),
            lifted,
            assigns: Vec::new(),
            rng_key: None,
            rng_draws: 0,
        }
    }

    /// Stops following the earlier trace: records the prefix matched so far (same ids).
    fn diverge(&mut self) {
        let Some(e) = self.expect.as_mut().filter(|e| e.following) else {
            return;
        };
        e.following = false;
        let g = &e.traced.graph;
        for i in 0..e.nodes {
            let node = g.node(NodeId::new(i));
            match node.op {
                Op::Input(k) => {
                    let input = &g.inputs()[k];
                    self.graph
                        .add_input(input.kind.clone(), input.name.clone(), input.ty.clone());
                }
                _ => {
                    self.graph
                        .add_typed(node.op.clone(), node.ty.clone(), &node.operands);
                }
            }
        }
        self.bindings
            .extend(e.traced.bindings[..e.inputs].iter().cloned());
    }

    /// Declares a graph input bound to `new` (its name made only if it is recorded).
    fn add_input(
        &mut self,
        kind: InputKind,
        name: impl FnOnce() -> String,
        ty: &TensorType,
        new: NewInput,
    ) -> NodeId {
        if let Some(e) = self.expect.as_mut().filter(|e| e.following) {
            if let Some(id) = e.next_input(&kind, ty, &new) {
                return id;
            }
            self.diverge();
        }
        self.bindings.push(new.binding());
        self.graph.add_input(kind, name(), ty.clone())
    }

    /// Records `op` applied to `operands` ([`Graph::add`]: type inference and its errors).
    pub(crate) fn add(&mut self, op: Op, operands: &[NodeId]) -> Result<NodeId> {
        if let Some(e) = self.expect.as_mut().filter(|e| e.following) {
            if let Some(id) = e.next_node(&op, operands) {
                return Ok(id);
            }
            self.diverge();
        }
        self.graph.add(op, operands)
    }

    /// The node holding `t`'s value in this trace: traced tensors must belong to it; eager
    /// variables are lifted to inputs (once each); other eager tensors become constants.
    pub(crate) fn node_of(&mut self, t: &Tensor) -> Result<NodeId> {
        match &t.repr {
            Repr::Traced { trace, node } => {
                if *trace != self.id {
                    return Err(Error::Trace(format!(
                        "a {} tensor from another trace (or one that has finished) was used in trace {}",
                        t.ty, self.id
                    )));
                }
                Ok(*node)
            }
            Repr::Eager { var: Some(v), .. } => {
                if let Some(&n) = self.lifted.get(&v.id) {
                    return Ok(n);
                }
                let kind = match v.kind {
                    VarKind::Parameter => InputKind::Parameter,
                    VarKind::Buffer => InputKind::Buffer,
                };
                let n = self.add_input(kind, || v.name.clone(), &t.ty, NewInput::Var(t));
                self.lifted.insert(v.id, n);
                Ok(n)
            }
            Repr::Eager { t: et, var: None } => {
                let host = HostTensor::from_tch(&et.detach(), t.ty.dtype)?;
                let lit = Literal::from_bytes(host.ty().clone(), host.into_bytes())?;
                self.add(Op::Constant(lit), &[])
            }
        }
    }

    pub(crate) fn tensor(&self, node: NodeId) -> Tensor {
        let graph = match &self.expect {
            Some(e) if e.following => &e.traced.graph,
            _ => &self.graph,
        };
        Tensor {
            ty: graph.node(node).ty.clone(),
            repr: Repr::Traced {
                trace: self.id,
                node,
            },
        }
    }

    /// The rng key input (`u32[2]`), created on first use.
    pub(crate) fn rng_key(&mut self) -> NodeId {
        if let Some(k) = self.rng_key {
            return k;
        }
        let k = self.add_input(
            InputKind::RngKey,
            || "rng_key".into(),
            &TensorType::new(crate::ir::DType::U32, [2]),
            NewInput::RngKey,
        );
        self.rng_key = Some(k);
        k
    }
}

/// A traced function: its graph and what each graph input and output means.
///
/// Graph outputs are the function's outputs (`num_outputs` of them) followed by one output per
/// variable assigned during the trace ([`Traced::state_updates`]).
#[derive(Clone, Debug)]
pub struct Traced {
    /// The graph.
    pub graph: Graph,
    /// One binding per graph input, in order.
    pub bindings: Vec<Binding>,
    /// How many leading graph outputs are the function's own outputs.
    pub num_outputs: usize,
    /// Variables the function assigned, with the graph output holding each new value.
    pub state_updates: Vec<(Tensor, usize)>,
}

impl Traced {
    /// Does `other` record the same program, built the same way: the same graph
    /// ([`Graph::same_structure`]), reading the same arguments and variables, returning as
    /// many outputs and assigning the same variables? Then whatever was prepared for one
    /// serves the other.
    pub fn same_program(&self, other: &Traced) -> bool {
        self.num_outputs == other.num_outputs
            && self.bindings.len() == other.bindings.len()
            && self.state_updates.len() == other.state_updates.len()
            && self
                .bindings
                .iter()
                .zip(&other.bindings)
                .all(|(a, b)| match (a, b) {
                    (Binding::Data(i), Binding::Data(j)) => i == j,
                    (Binding::Var(x), Binding::Var(y)) => same_var(x, y),
                    (Binding::RngKey, Binding::RngKey) => true,
                    _ => false,
                })
            && self
                .state_updates
                .iter()
                .zip(&other.state_updates)
                .all(|((x, i), (y, j))| i == j && same_var(x, y))
            && self.graph.same_structure(&other.graph)
    }
}

/// Trace every time: the latest trace of each input signature and what was prepared for it
/// (a plan, a program's index). A function usually traces the same program call after call;
/// [`LatestTraces::trace`] checks each new trace against the signature's latest one as it is
/// recorded ([`Expect`]), so a repeat builds no graph at all, where a fingerprint sorts,
/// serialises and hashes one. A trace that differs is recorded into storage with room for the
/// latest trace's size (growing it step by step took a quarter of the LinearModel's trace).
pub(crate) struct LatestTraces<T> {
    by_signature: foldhash::HashMap<Vec<TensorType>, (Traced, T)>,
    /// The entry of the signature traced last, kept out of `by_signature` (a signature is in
    /// one of the two): a function called with the same signature call after call finds it
    /// without hashing the signature twice a call.
    last: Option<(Vec<TensorType>, Traced, T)>,
    spare: Option<Spare>,
    /// The size of the latest trace, which a trace without spare storage starts with room for.
    last_size: GraphSize,
}

/// What [`LatestTraces::trace`] found.
pub(crate) enum Retrace<T> {
    /// The same program as the signature's latest trace, prepared as `T`.
    Repeat(T),
    /// Another program (or the signature's first).
    New(Traced),
}

impl<T: Clone> LatestTraces<T> {
    pub(crate) fn new() -> Self {
        LatestTraces {
            by_signature: Default::default(),
            last: None,
            spare: None,
            last_size: GraphSize::default(),
        }
    }

    /// Traces `f` on inputs of `signature`, checked against the signature's latest trace.
    pub(crate) fn trace<F>(&mut self, signature: &[TensorType], f: F) -> Result<Retrace<T>>
    where
        F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
    {
        let storage = self.spare.take().unwrap_or_else(|| Spare {
            graph: Graph::with_capacity(self.last_size),
            lifted: Lifted::default(),
        });
        // The latest trace moves into the trace context (tensors are not `Sync`, so it cannot
        // be shared) and back with its key, as the last entry: no allocation. If `f` panics
        // the entry is gone, and the next trace is prepared as a new one.
        let (key, expect, value) = match self.take_entry(signature) {
            Some((key, traced, value)) => (Some(key), Some(traced), Some(value)),
            None => (None, None, None),
        };
        let (checked, expect) = trace_checked(signature, storage, expect, f);
        if let (Some(key), Some(traced), Some(value)) = (key, expect, value.clone()) {
            self.last = Some((key, traced, value));
        }
        match checked? {
            Checked::Repeat(mut storage) => {
                storage.lifted.clear();
                self.spare = Some(storage);
                // Only a trace checked against an earlier one repeats it.
                value.map(Retrace::Repeat).ok_or_else(|| {
                    Error::Internal("a repeated trace without an earlier one".into())
                })
            }
            Checked::New(traced) => {
                self.last_size = traced.graph.size();
                Ok(Retrace::New(traced))
            }
        }
    }

    /// Records `traced` as `signature`'s latest trace, prepared as `value`.
    pub(crate) fn insert(&mut self, signature: &[TensorType], traced: Traced, value: T) {
        // Out of the slot or the map (and the slot emptied): one entry per signature.
        drop(self.take_entry(signature));
        self.last = Some((signature.to_vec(), traced, value));
    }

    /// Takes `signature`'s entry out of the last slot or the map; the last slot's entry of
    /// another signature goes back into the map.
    fn take_entry(&mut self, signature: &[TensorType]) -> Option<(Vec<TensorType>, Traced, T)> {
        if self
            .last
            .as_ref()
            .is_some_and(|(key, ..)| key[..] == *signature)
        {
            return self.last.take();
        }
        self.stash_last();
        self.by_signature
            .remove_entry(signature)
            .map(|(key, (traced, value))| (key, traced, value))
    }

    /// Moves the last slot's entry into the map.
    fn stash_last(&mut self) {
        if let Some((key, traced, value)) = self.last.take() {
            self.by_signature.insert(key, (traced, value));
        }
    }
}

/// Traces `f` on symbolic inputs of the given types.
///
/// `f` runs once. Every [`Tensor`] operation inside it is recorded instead of executed;
/// variables of a [`crate::nn::ParamStore`] that `f` touches become graph inputs
/// ([`Binding::Var`]), other eager tensors become constants. Shape errors surface here, naming
/// the op and the shapes.
///
/// ```no_run
/// use kiln::{trace, DType, Tensor, TensorType};
/// let t = trace(&[TensorType::new(DType::F32, [2, 3])], |xs| {
///     Ok(vec![xs[0].exp()?.sum_all()?])
/// })?;
/// println!("{}", t.graph);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn trace<F>(inputs: &[TensorType], f: F) -> Result<Traced>
where
    F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let storage = Spare {
        graph: Graph::new(),
        lifted: Lifted::default(),
    };
    match trace_checked(inputs, storage, None, f).0? {
        Checked::New(traced) => Ok(traced),
        Checked::Repeat(_) => Err(Error::Internal(
            "a trace without an earlier one repeated it".into(),
        )),
    }
}

enum Checked {
    /// The trace repeated the expected one; the storage it did not keep.
    Repeat(Spare),
    New(Traced),
}

/// [`trace`] into `storage` (empty), checked against `expect` as it goes (see [`Expect`]);
/// gives `expect` back (unless `f` panics).
fn trace_checked<F>(
    inputs: &[TensorType],
    storage: Spare,
    expect: Option<Traced>,
    f: F,
) -> (Result<Checked>, Option<Traced>)
where
    F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let Spare { graph, lifted } = storage;
    if !graph.is_empty() || !graph.inputs().is_empty() || !lifted.is_empty() {
        let e = Error::Internal("a trace must start from an empty graph".into());
        return (Err(e), expect);
    }
    let mut ctx = TraceCtx::new(graph, lifted, expect);
    let args: SmallVec<[Tensor; 4]> = inputs
        .iter()
        .enumerate()
        .map(|(i, ty)| {
            let n = ctx.add_input(InputKind::Data, || format!("x{i}"), ty, NewInput::Data(i));
            ctx.tensor(n)
        })
        .collect();
    STACK.with(|s| s.borrow_mut().push(ctx));
    // Pop the context even if `f` panics, so the thread is not left tracing.
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            STACK.with(|s| {
                s.borrow_mut().pop();
            });
        }
    }
    let pop = Pop;
    let result = f(&args).and_then(|outs| {
        with_ctx(|ctx| {
            let mut nodes = SmallVec::<[NodeId; 4]>::new();
            for o in &outs {
                nodes.push(ctx.node_of(o)?);
            }
            Ok(nodes)
        })
    });
    let Some(mut ctx) = STACK.with(|s| s.borrow_mut().pop()) else {
        return (Err(Error::Trace("trace stack corrupted".into())), None);
    };
    std::mem::forget(pop);
    let outputs = result.map(|outputs| {
        if ctx
            .expect
            .as_ref()
            .is_some_and(|e| e.is_complete(&outputs, &ctx.assigns))
        {
            return None;
        }
        ctx.diverge();
        Some(outputs)
    });
    let expect = ctx.expect.take().map(|e| e.traced);
    let checked = match outputs {
        Ok(None) => Ok(Checked::Repeat(Spare {
            graph: ctx.graph,
            lifted: ctx.lifted,
        })),
        Ok(Some(outputs)) => finish(ctx, outputs).map(Checked::New),
        Err(e) => Err(e),
    };
    (checked, expect)
}

/// The traced function of a finished trace (recorded in full) and its outputs.
fn finish(ctx: TraceCtx, mut outputs: SmallVec<[NodeId; 4]>) -> Result<Traced> {
    let num_outputs = outputs.len();
    let mut graph = ctx.graph;
    let mut state_updates = Vec::new();
    for (var, node) in ctx.assigns {
        state_updates.push((var, outputs.len()));
        outputs.push(node);
    }
    graph.set_outputs(outputs.into_vec())?;
    Ok(Traced {
        graph,
        bindings: ctx.bindings,
        num_outputs,
        state_updates,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::DType;
    use crate::nn::{Init, ParamStore};

    fn f32s(dims: &[usize]) -> TensorType {
        TensorType::new(DType::F32, dims)
    }

    /// Traces of the same code are the same program; reading another variable, scaling by
    /// another constant, returning more outputs or assigning a variable is another.
    #[test]
    fn same_program_compares_graph_bindings_and_updates() -> Result<()> {
        let store = ParamStore::new();
        let v = store.root().param("v", &[3], Init::Const(0.5))?;
        let w = store.root().param("w", &[3], Init::Const(0.5))?;
        let sig = [f32s(&[3])];
        let add = |var: &Tensor| {
            let var = var.clone();
            trace(&sig, move |xs| Ok(vec![xs[0].add(&var)?]))
        };
        let base = add(&v)?;
        assert!(base.same_program(&add(&v)?));
        assert!(!base.same_program(&add(&w)?));
        let scaled = |c: f64| trace(&sig, move |xs| Ok(vec![xs[0].mul_scalar(c)?]));
        assert!(scaled(2.0)?.same_program(&scaled(2.0)?));
        assert!(!scaled(2.0)?.same_program(&scaled(3.0)?));
        let v2 = v.clone();
        let twice = trace(&sig, move |xs| {
            let y = xs[0].add(&v2)?;
            Ok(vec![y.clone(), y])
        })?;
        assert!(!base.same_program(&twice));
        let v3 = v.clone();
        let assigning = trace(&sig, move |xs| {
            let y = xs[0].add(&v3)?;
            v3.assign(&y)?;
            Ok(vec![y])
        })?;
        assert_eq!(assigning.state_updates.len(), 1);
        assert!(!base.same_program(&assigning));
        assert!(assigning.same_program(&assigning.clone()));
        Ok(())
    }

    fn repeat<T: Copy>(r: Retrace<T>) -> Option<T> {
        match r {
            Retrace::Repeat(v) => Some(v),
            Retrace::New(_) => None,
        }
    }

    fn new_trace<T>(r: Retrace<T>) -> Traced {
        match r {
            Retrace::New(t) => t,
            Retrace::Repeat(_) => panic!("a repeat, where a new program was traced"),
        }
    }

    /// `LatestTraces` answers for the same program only, and a repeat leaves its unused
    /// storage for the next trace.
    #[test]
    fn latest_traces_recognise_repeats_and_keep_storage() -> Result<()> {
        let sig = [f32s(&[2, 3])];
        let exp = |xs: &[Tensor]| Ok(vec![xs[0].exp()?.sum_all()?]);
        let mut latest = LatestTraces::<u32>::new();
        let first = new_trace(latest.trace(&sig, exp)?);
        let size = first.graph.size();
        latest.insert(&sig, first, 7);
        assert_eq!(repeat(latest.trace(&sig, exp)?), Some(7));
        let spare = latest.spare.as_ref().expect("the repeat's storage is kept");
        assert!(spare.graph.is_empty() && spare.graph.capacity().nodes >= size.nodes);
        assert!(spare.lifted.is_empty());
        let other = new_trace(latest.trace(&sig, |xs| Ok(vec![xs[0].sum_all()?]))?);
        assert!(other.same_program(&trace(&sig, |xs| Ok(vec![xs[0].sum_all()?]))?));
        let other_sig = [f32s(&[4])];
        new_trace(latest.trace(&other_sig, exp)?);
        assert_eq!(repeat(latest.trace(&sig, exp)?), Some(7));
        // Signatures taking turns: each finds its own latest trace (in the last slot or the
        // map, never both), variables read included.
        let store = ParamStore::new();
        let v = store.root().param("v", &[4], Init::Const(0.5))?;
        let add_v = |xs: &[Tensor]| Ok(vec![xs[0].add(&v)?.sum_all()?]);
        let t = new_trace(latest.trace(&other_sig, add_v)?);
        latest.insert(&other_sig, t, 8);
        for _ in 0..3 {
            assert_eq!(repeat(latest.trace(&sig, exp)?), Some(7));
            assert_eq!(repeat(latest.trace(&other_sig, add_v)?), Some(8));
            assert_eq!(repeat(latest.trace(&other_sig, add_v)?), Some(8));
            assert!(repeat(latest.trace(&other_sig, exp)?).is_none());
            assert_eq!(latest.by_signature.len() + latest.last.iter().count(), 2);
        }
        Ok(())
    }

    /// A trace that differs from the latest one anywhere (first op, an operand, a constant, a
    /// variable, the outputs, an assignment, a node more or less) is recorded as a fresh trace
    /// would record it: same program, same input names, a valid graph.
    #[test]
    fn a_trace_that_differs_anywhere_is_recorded_as_a_fresh_one() -> Result<()> {
        type Body = Box<dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>>;
        let store = ParamStore::new();
        let v = store.root().param("v", &[3], Init::Const(0.5))?;
        let w = store.root().param("w", &[3], Init::Const(0.25))?;
        let sig = [f32s(&[3]), f32s(&[3])];
        let body = |f: fn(&[Tensor], &Tensor, &Tensor) -> Result<Vec<Tensor>>| -> Body {
            let (v, w) = (v.clone(), w.clone());
            Box::new(move |xs: &[Tensor]| f(xs, &v, &w))
        };
        let base = body(|xs, v, _| Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?]));
        let variants: Vec<(&str, Body)> = vec![
            (
                "first op",
                body(|xs, v, _| Ok(vec![xs[0].sub(v)?.mul_scalar(2.0)?.sub(&xs[1])?])),
            ),
            (
                "operand",
                body(|xs, v, _| Ok(vec![xs[1].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?])),
            ),
            (
                "variable",
                body(|xs, _, w| Ok(vec![xs[0].add(w)?.mul_scalar(2.0)?.sub(&xs[1])?])),
            ),
            (
                "constant",
                body(|xs, v, _| Ok(vec![xs[0].add(v)?.mul_scalar(3.0)?.sub(&xs[1])?])),
            ),
            (
                "last op",
                body(|xs, v, _| Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?.add(&xs[1])?])),
            ),
            (
                "node more",
                body(|xs, v, _| Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?.neg()?])),
            ),
            (
                "node less",
                body(|xs, v, _| Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?])),
            ),
            (
                "unused node",
                body(|xs, v, _| {
                    xs[0].exp()?;
                    Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?])
                }),
            ),
            (
                "variable more",
                body(|xs, v, w| Ok(vec![xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?.add(w)?])),
            ),
            (
                "output more",
                body(|xs, v, _| {
                    let y = xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?;
                    Ok(vec![y.clone(), y])
                }),
            ),
            (
                "other output",
                body(|xs, v, _| {
                    let y = xs[0].add(v)?;
                    y.mul_scalar(2.0)?.sub(&xs[1])?;
                    Ok(vec![y])
                }),
            ),
            (
                "assignment",
                body(|xs, v, _| {
                    let y = xs[0].add(v)?.mul_scalar(2.0)?.sub(&xs[1])?;
                    v.assign(&y)?;
                    Ok(vec![y])
                }),
            ),
        ];
        let mut latest = LatestTraces::<u32>::new();
        let first = new_trace(latest.trace(&sig, &base)?);
        latest.insert(&sig, first, 1);
        for (what, f) in &variants {
            let got = new_trace(latest.trace(&sig, f)?);
            let fresh = trace(&sig, f)?;
            got.graph.verify()?;
            assert!(
                got.same_program(&fresh),
                "{what}: not what a fresh trace records"
            );
            let names = |t: &Traced| {
                t.graph
                    .inputs()
                    .iter()
                    .map(|i| i.name.clone())
                    .collect::<Vec<_>>()
            };
            assert_eq!(names(&got), names(&fresh), "{what}");
            // The latest trace stays the base's: it still repeats.
            assert_eq!(repeat(latest.trace(&sig, &base)?), Some(1), "after {what}");
        }
        // Random draws: the key input and the draw sites repeat too.
        let drop_once = |xs: &[Tensor]| Ok(vec![xs[0].dropout(0.5, true)?]);
        let drop_twice = |xs: &[Tensor]| Ok(vec![xs[0].dropout(0.5, true)?.dropout(0.5, true)?]);
        let t = new_trace(latest.trace(&sig, drop_once)?);
        assert!(t.bindings.iter().any(|b| matches!(b, Binding::RngKey)));
        latest.insert(&sig, t, 3);
        assert_eq!(repeat(latest.trace(&sig, drop_once)?), Some(3));
        let got = new_trace(latest.trace(&sig, drop_twice)?);
        assert!(got.same_program(&trace(&sig, drop_twice)?));
        // A variant recorded as the latest repeats in its turn; the base then differs.
        let (_, assigning) = &variants[variants.len() - 1];
        let t = new_trace(latest.trace(&sig, assigning)?);
        latest.insert(&sig, t, 2);
        assert_eq!(repeat(latest.trace(&sig, assigning)?), Some(2));
        assert!(repeat(latest.trace(&sig, &base)?).is_none());
        Ok(())
    }

    /// One step of a random traced program over two `[3]` inputs and two variables: each
    /// step's value is appended to the program's values.
    #[derive(Clone, Debug, PartialEq)]
    enum Step {
        Exp(usize),
        Neg(usize),
        Add(usize, usize),
        Mul(usize, usize),
        AddVar(usize, usize),
        Scale(usize, u8),
        Assign(usize, usize),
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            (0..8usize).prop_map(Step::Exp),
            (0..8usize).prop_map(Step::Neg),
            (0..8usize, 0..8usize).prop_map(|(a, b)| Step::Add(a, b)),
            (0..8usize, 0..8usize).prop_map(|(a, b)| Step::Mul(a, b)),
            (0..8usize, 0..2usize).prop_map(|(a, v)| Step::AddVar(a, v)),
            (0..8usize, 1..4u8).prop_map(|(a, c)| Step::Scale(a, c)),
            (0..8usize, 0..2usize).prop_map(|(a, v)| Step::Assign(a, v)),
        ]
    }

    /// Runs `steps` on `xs` (operand indices wrap around the values so far) and returns the
    /// values `outs` picks.
    fn run_steps(
        xs: &[Tensor],
        vars: &[Tensor],
        steps: &[Step],
        outs: &[usize],
    ) -> Result<Vec<Tensor>> {
        let mut v: Vec<Tensor> = xs.to_vec();
        for s in steps {
            let at = |i: &usize| &v[i % v.len()];
            let y = match s {
                Step::Exp(a) => at(a).exp()?,
                Step::Neg(a) => at(a).neg()?,
                Step::Add(a, b) => at(a).add(at(b))?,
                Step::Mul(a, b) => at(a).mul(at(b))?,
                Step::AddVar(a, k) => at(a).add(&vars[*k])?,
                Step::Scale(a, c) => at(a).mul_scalar(f64::from(*c))?,
                Step::Assign(a, k) => {
                    vars[*k].assign(at(a))?;
                    at(a).clone()
                }
            };
            v.push(y);
        }
        Ok(outs.iter().map(|i| v[i % v.len()].clone()).collect())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Checked against the latest trace, a trace repeats it exactly when a fresh trace
        /// of it is the same program, and a trace that does not is recorded as a fresh one:
        /// for random programs and random edits of them (one step changed, removed or
        /// added, outputs changed, or none).
        #[test]
        fn a_checked_trace_repeats_exactly_the_same_programs(
            a in proptest::collection::vec(step(), 0..8),
            a_outs in proptest::collection::vec(0..10usize, 1..3),
            edit in (0..5usize, 0..8usize, step()),
            b_outs in proptest::collection::vec(0..10usize, 1..3),
        ) {
            let store = ParamStore::new();
            let vars = [
                store.root().param("v", &[3], Init::Const(0.5))?,
                store.root().param("w", &[3], Init::Const(0.25))?,
            ];
            let (kind, at, new) = edit;
            let mut b = a.clone();
            let mut outs = a_outs.clone();
            match kind {
                0 if !b.is_empty() => {
                    let i = at % b.len();
                    b[i] = new;
                }
                1 if !b.is_empty() => {
                    b.remove(at % b.len());
                }
                2 => b.insert(at % (b.len() + 1), new),
                3 => outs = b_outs,
                _ => {}
            }
            let sig = [f32s(&[3]), f32s(&[3])];
            let fa = |xs: &[Tensor]| run_steps(xs, &vars, &a, &a_outs);
            let fb = |xs: &[Tensor]| run_steps(xs, &vars, &b, &outs);
            let mut latest = LatestTraces::<u32>::new();
            let first = new_trace(latest.trace(&sig, fa)?);
            latest.insert(&sig, first, 1);
            let same = trace(&sig, fb)?.same_program(&trace(&sig, fa)?);
            match latest.trace(&sig, fb)? {
                Retrace::Repeat(v) => proptest::prop_assert!(same && v == 1),
                Retrace::New(t) => {
                    proptest::prop_assert!(!same);
                    t.graph.verify()?;
                    proptest::prop_assert!(t.same_program(&trace(&sig, fb)?));
                }
            }
            // The latest trace is kept either way.
            proptest::prop_assert_eq!(repeat(latest.trace(&sig, fa)?), Some(1));
        }
    }
}
