//! The trace context: a thread-local stack of graphs under construction.
//!
//! Tensors never point into a graph. A traced tensor holds the id of its trace and a node id;
//! operations look the active trace up here. Using a tensor from a finished or different trace
//! is an [`Error::Trace`], not undefined behaviour.

use super::{Repr, Tensor, VarKind};
use crate::backend::HostTensor;
use crate::error::{Error, Result};
use crate::ir::{Graph, GraphSize, InputKind, Literal, NodeId, Op, TensorType};
use std::cell::RefCell;
use std::collections::HashMap;
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
    pub(crate) graph: Graph,
    pub(crate) bindings: Vec<Binding>,
    /// The node holding each variable's current value: its input, or what it was assigned.
    pub(crate) lifted: HashMap<u64, NodeId>,
    /// Variables assigned during the trace (last assignment wins), in first-assignment order.
    pub(crate) assigns: Vec<(Tensor, NodeId)>,
    pub(crate) rng_key: Option<NodeId>,
    pub(crate) rng_draws: u32,
}

thread_local! {
    static STACK: RefCell<Vec<TraceCtx>> = const { RefCell::new(Vec::new()) };
}

static NEXT_TRACE: AtomicU64 = AtomicU64::new(1);

/// Is a trace active on this thread?
pub fn is_tracing() -> bool {
    STACK.with(|s| !s.borrow().is_empty())
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

impl TraceCtx {
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
                let n = self.graph.add_input(kind, v.name.clone(), t.ty.clone());
                self.bindings.push(Binding::Var(t.clone()));
                self.lifted.insert(v.id, n);
                Ok(n)
            }
            Repr::Eager { t: et, var: None } => {
                let host = HostTensor::from_tch(&et.detach(), t.ty.dtype)?;
                let lit = Literal::from_bytes(host.ty().clone(), host.into_bytes())?;
                self.graph.add(Op::Constant(lit), &[])
            }
        }
    }

    pub(crate) fn tensor(&self, node: NodeId) -> Tensor {
        Tensor {
            ty: self.graph.node(node).ty.clone(),
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
        let k = self.graph.add_input(
            InputKind::RngKey,
            "rng_key",
            TensorType::new(crate::ir::DType::U32, [2]),
        );
        self.bindings.push(Binding::RngKey);
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
        fn same_var(a: &Tensor, b: &Tensor) -> bool {
            matches!((a.variable(), b.variable()), (Some(x), Some(y)) if x.id == y.id)
        }
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
/// recognising it by [`Traced::same_program`] costs one pass over the graph, where a
/// fingerprint sorts, serialises and hashes it. The graph of a trace so recognised can be
/// emptied and kept as the storage of the next one ([`LatestTraces::recycle`]), which then allocates no node or edge
/// storage (allocating it took a quarter of the LinearModel's trace).
pub(crate) struct LatestTraces<T> {
    by_signature: HashMap<Vec<TensorType>, (Traced, T)>,
    spare: Option<Graph>,
    /// The size of the latest trace, which a trace without spare storage starts with room for.
    last_size: GraphSize,
}

impl<T: Clone> LatestTraces<T> {
    pub(crate) fn new() -> Self {
        LatestTraces {
            by_signature: HashMap::new(),
            spare: None,
            last_size: GraphSize::default(),
        }
    }

    /// An empty graph to trace into: a recognised trace's storage, or one with room for the
    /// latest trace's size.
    pub(crate) fn storage(&mut self) -> Graph {
        self.spare
            .take()
            .unwrap_or_else(|| Graph::with_capacity(self.last_size))
    }

    /// What was prepared for `signature`'s latest trace, if `traced` is the same program.
    pub(crate) fn get(&mut self, signature: &[TensorType], traced: &Traced) -> Option<T> {
        self.last_size = traced.graph.size();
        let (latest, value) = self.by_signature.get(signature)?;
        latest.same_program(traced).then(|| value.clone())
    }

    /// Keeps the storage of `traced` (a repeat, which [`LatestTraces::get`] recognised) for
    /// the next trace.
    pub(crate) fn recycle(&mut self, traced: Traced) {
        let mut graph = traced.graph;
        graph.clear();
        self.spare = Some(graph);
    }

    /// Records `traced` as `signature`'s latest trace, prepared as `value`.
    pub(crate) fn insert(&mut self, signature: &[TensorType], traced: Traced, value: T) {
        self.by_signature
            .insert(signature.to_vec(), (traced, value));
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
    trace_into(inputs, Graph::new(), f)
}

/// [`trace`] into `graph`, an empty graph with room for what the trace is likely to reach (the
/// size of an earlier trace of the same function, or its storage: see
/// [`LatestTraces::storage`]).
pub(crate) fn trace_into<F>(inputs: &[TensorType], graph: Graph, f: F) -> Result<Traced>
where
    F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
{
    if !graph.is_empty() || !graph.inputs().is_empty() {
        return Err(Error::Internal(
            "a trace must start from an empty graph".into(),
        ));
    }
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    let num_inputs = graph.capacity().inputs;
    let mut ctx = TraceCtx {
        id,
        graph,
        bindings: Vec::with_capacity(num_inputs),
        lifted: HashMap::with_capacity(num_inputs),
        assigns: Vec::new(),
        rng_key: None,
        rng_draws: 0,
    };
    let args: Vec<Tensor> = inputs
        .iter()
        .enumerate()
        .map(|(i, ty)| {
            let n = ctx
                .graph
                .add_input(InputKind::Data, format!("x{i}"), ty.clone());
            ctx.bindings.push(Binding::Data(i));
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
            let mut nodes = Vec::with_capacity(outs.len() + ctx.assigns.len());
            for o in &outs {
                nodes.push(ctx.node_of(o)?);
            }
            Ok(nodes)
        })
    });
    let ctx = STACK
        .with(|s| s.borrow_mut().pop())
        .ok_or_else(|| Error::Trace("trace stack corrupted".into()))?;
    std::mem::forget(pop);
    let mut outputs = result?;
    let num_outputs = outputs.len();
    let mut graph = ctx.graph;
    let mut state_updates = Vec::new();
    for (var, node) in ctx.assigns {
        state_updates.push((var, outputs.len()));
        outputs.push(node);
    }
    graph.set_outputs(outputs)?;
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

    /// `LatestTraces` answers for the same program only, and a recognised trace's graph
    /// becomes the (empty) storage of the next trace.
    #[test]
    fn latest_traces_recognise_repeats_and_recycle_storage() -> Result<()> {
        let sig = [f32s(&[2, 3])];
        let exp = |g: Graph| trace_into(&sig, g, |xs| Ok(vec![xs[0].exp()?.sum_all()?]));
        let mut latest = LatestTraces::<u32>::new();
        let first = exp(latest.storage())?;
        let size = first.graph.size();
        assert_eq!(latest.get(&sig, &first), None, "nothing recorded yet");
        latest.insert(&sig, first, 7);
        let repeat = exp(latest.storage())?;
        assert_eq!(latest.get(&sig, &repeat), Some(7));
        latest.recycle(repeat);
        let storage = latest.storage();
        assert!(storage.is_empty());
        assert!(storage.capacity().nodes >= size.nodes);
        let again = exp(storage)?;
        assert_eq!(again.graph.size(), size);
        let other = trace(&sig, |xs| Ok(vec![xs[0].sum_all()?]))?;
        assert_eq!(latest.get(&sig, &other), None);
        let other_sig = [f32s(&[4])];
        let exp4 = trace(&other_sig, |xs| Ok(vec![xs[0].exp()?.sum_all()?]))?;
        assert_eq!(latest.get(&other_sig, &exp4), None);
        assert_eq!(latest.get(&sig, &again), Some(7));
        Ok(())
    }
}
