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
    trace_sized(inputs, GraphSize::default(), f)
}

/// [`trace`] into a graph with room for `size` (the size of an earlier trace of the same
/// function, which a repeated trace is likely to reach again).
pub(crate) fn trace_sized<F>(inputs: &[TensorType], size: GraphSize, f: F) -> Result<Traced>
where
    F: FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
{
    let id = NEXT_TRACE.fetch_add(1, Ordering::Relaxed);
    let mut ctx = TraceCtx {
        id,
        graph: Graph::with_capacity(size),
        bindings: Vec::with_capacity(size.inputs),
        lifted: HashMap::with_capacity(size.inputs),
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
