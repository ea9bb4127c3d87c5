//! Optimizers as graph builders (the third graph of a training step) and as eager in-place
//! updates on tch tensors (the eager baseline), with PyTorch's update formulas. Each update is
//! written once over [`math::UpdateMath`] and run both ways ([`math::EagerMath`],
//! [`math::GraphMath`]).
//!
//! The learning rate and the step count are *inputs* of the optimizer graph (`f32` scalars), so
//! a learning-rate schedule or the bias correction of Adam never recompiles anything.
//!
//! - [`Sgd`]: `torch.optim.SGD` (momentum, dampening, Nesterov, weight decay).
//! - [`Adam`]: `torch.optim.Adam` (L2 weight decay added to the gradient, optional AMSGrad).
//! - [`AdamW`]: `torch.optim.AdamW` (decoupled weight decay, optional AMSGrad).
//! - [`optimizer_graph`]: the whole update of a list of parameters as one graph, with every
//!   parameter and state input donated to its new value.

mod adam;
pub mod math;
mod sgd;

pub use adam::{Adam, AdamW};
pub use sgd::Sgd;

use crate::error::{Error, Result};
use crate::ir::{DType, Graph, InputKind, NodeId, TensorType};

/// A first-order optimizer: a per-parameter update with some state tensors.
pub trait Optimizer: Send + Sync {
    /// State tensors kept per parameter (e.g. Adam: `exp_avg`, `exp_avg_sq`), with names and
    /// types. Every state starts as zeros.
    fn state_shapes(&self, param: &TensorType) -> Vec<(&'static str, TensorType)>;

    /// Builds the update of one parameter into `g`: given the nodes of the parameter, its
    /// gradient (same type), its state (as [`Optimizer::state_shapes`] lists it) and the scalar
    /// inputs `lr` and `step` (`f64[]`; `step` is 1-based: 1 on the
    /// first update), returns the
    /// new parameter and the new state, in the same order.
    fn update(
        &self,
        g: &mut Graph,
        param: NodeId,
        grad: NodeId,
        state: &[NodeId],
        lr: NodeId,
        step: NodeId,
    ) -> Result<(NodeId, Vec<NodeId>)>;

    /// The same update applied eagerly to tch tensors, in place, under `no_grad` (for the eager
    /// baseline). `step` is 1-based.
    fn update_eager(
        &self,
        param: &tch::Tensor,
        grad: &tch::Tensor,
        state: &mut [tch::Tensor],
        lr: f64,
        step: u64,
    ) -> Result<()>;
}

/// A boxed optimizer is an optimizer (so one chosen at run time, e.g. by name, can be passed
/// where an `impl Optimizer` is expected).
impl<O: Optimizer + ?Sized> Optimizer for Box<O> {
    fn state_shapes(&self, param: &TensorType) -> Vec<(&'static str, TensorType)> {
        (**self).state_shapes(param)
    }

    fn update(
        &self,
        g: &mut Graph,
        param: NodeId,
        grad: NodeId,
        state: &[NodeId],
        lr: NodeId,
        step: NodeId,
    ) -> Result<(NodeId, Vec<NodeId>)> {
        (**self).update(g, param, grad, state, lr, step)
    }

    fn update_eager(
        &self,
        param: &tch::Tensor,
        grad: &tch::Tensor,
        state: &mut [tch::Tensor],
        lr: f64,
        step: u64,
    ) -> Result<()> {
        (**self).update_eager(param, grad, state, lr, step)
    }
}

/// A whole optimizer graph.
///
/// Inputs: `params` (kind [`InputKind::Parameter`], named `param{i}`) ++ one gradient per
/// parameter (kind [`InputKind::Data`], `grad{i}`) ++ the states of every parameter, flattened
/// parameter by parameter in [`Optimizer::state_shapes`] order (kind
/// [`InputKind::OptimizerState`], `param{i}.{state}`) ++ `[lr, step]` (kind
/// [`InputKind::Scalar`], `f32[]`).
///
/// Outputs: the new parameters ++ the new states (same order as the inputs). Every parameter
/// and state input is aliased (donated) to its new value, so on XLA the update is in place.
pub fn optimizer_graph(opt: &dyn Optimizer, params: &[TensorType]) -> Result<Graph> {
    let mut g = Graph::new();
    for (i, p) in params.iter().enumerate() {
        if !p.dtype.is_float() {
            return Err(Error::Invalid(format!(
                "optimizer_graph: parameter {i} has non-float type {p}"
            )));
        }
    }
    let p_in: Vec<NodeId> = params
        .iter()
        .enumerate()
        .map(|(i, t)| g.add_input(InputKind::Parameter, format!("param{i}"), t.clone()))
        .collect();
    let g_in: Vec<NodeId> = params
        .iter()
        .enumerate()
        .map(|(i, t)| g.add_input(InputKind::Data, format!("grad{i}"), t.clone()))
        .collect();
    let mut s_in: Vec<Vec<NodeId>> = Vec::with_capacity(params.len());
    for (i, t) in params.iter().enumerate() {
        let states = opt
            .state_shapes(t)
            .into_iter()
            .map(|(name, ty)| {
                g.add_input(InputKind::OptimizerState, format!("param{i}.{name}"), ty)
            })
            .collect();
        s_in.push(states);
    }
    let scalar = TensorType::scalar(DType::F64);
    let lr = g.add_input(InputKind::Scalar, "lr", scalar.clone());
    let step = g.add_input(InputKind::Scalar, "step", scalar);
    let mut new_params = Vec::with_capacity(params.len());
    let mut new_states = Vec::new();
    for i in 0..params.len() {
        let (p, s) = opt.update(&mut g, p_in[i], g_in[i], &s_in[i], lr, step)?;
        if s.len() != s_in[i].len() {
            return Err(Error::Invalid(format!(
                "optimizer_graph: update returned {} states for {} state inputs",
                s.len(),
                s_in[i].len()
            )));
        }
        new_params.push(p);
        new_states.extend(s);
    }
    let n = params.len();
    let num_states = new_states.len();
    let mut outputs = new_params;
    outputs.extend(new_states);
    g.set_outputs(outputs)?;
    for i in 0..n {
        g.add_alias(i, i)?;
    }
    for j in 0..num_states {
        g.add_alias(2 * n + j, n + j)?;
    }
    g.verify()?;
    Ok(g)
}

/// Traces one parameter's update into `g` (the [`Optimizer::update`] of an optimizer written
/// over [`math::UpdateMath`]): checks the operands, then runs `apply` on a
/// [`math::GraphMath`] with the parameter, gradient, state, learning rate and step, and returns
/// the final handles of the parameter and the state.
#[allow(clippy::too_many_arguments)]
pub(crate) fn traced_update(
    g: &mut Graph,
    name: &str,
    param: NodeId,
    grad: NodeId,
    state: &[NodeId],
    expected_states: usize,
    [lr, step]: [NodeId; 2],
    apply: impl FnOnce(
        &mut math::GraphMath<'_>,
        &mut NodeId,
        &NodeId,
        &mut [NodeId],
        NodeId,
        NodeId,
    ) -> Result<()>,
) -> Result<(NodeId, Vec<NodeId>)> {
    let pt = check_update(g, name, param, grad, state, expected_states, [lr, step])?;
    let mut m = math::GraphMath::new(g, pt);
    let (lr, step) = (m.scalar(lr)?, m.scalar(step)?);
    let mut p = param;
    let mut st = state.to_vec();
    apply(&mut m, &mut p, &grad, &mut st, lr, step)?;
    Ok((p, st))
}

/// Applies one parameter's update eagerly, in place (the [`Optimizer::update_eager`] of an
/// optimizer written over [`math::UpdateMath`]): checks the operands, then runs `apply` on
/// [`math::EagerMath`] under `no_grad`.
pub(crate) fn eager_update(
    name: &str,
    (param, grad): (&tch::Tensor, &tch::Tensor),
    state: &mut [tch::Tensor],
    expected_states: usize,
    (lr, step): (f64, u64),
    apply: impl FnOnce(
        &mut math::EagerMath,
        &mut tch::Tensor,
        &tch::Tensor,
        &mut [tch::Tensor],
        f64,
        f64,
    ) -> Result<()>,
) -> Result<()> {
    check_eager(name, param, grad, state, expected_states, step)?;
    let _guard = tch::no_grad_guard();
    let mut p = param.shallow_clone();
    apply(&mut math::EagerMath, &mut p, grad, state, lr, step as f64)
}

/// Checks the operands of [`Optimizer::update`] and returns the parameter's type.
pub(crate) fn check_update(
    g: &Graph,
    name: &str,
    param: NodeId,
    grad: NodeId,
    state: &[NodeId],
    expected_states: usize,
    [lr, step]: [NodeId; 2],
) -> Result<TensorType> {
    let ty = |id: NodeId| -> Result<&TensorType> {
        g.get(id)
            .map(|n| &n.ty)
            .ok_or_else(|| Error::Graph(format!("{name}: node {id:?} is not in the graph")))
    };
    let pt = ty(param)?.clone();
    let gt = ty(grad)?;
    if !pt.dtype.is_float() || *gt != pt {
        return Err(Error::type_error(
            name,
            "expects a float parameter and a gradient of the same type",
            &[&pt, gt],
        ));
    }
    if state.len() != expected_states {
        return Err(Error::Invalid(format!(
            "{name}: {} state tensors given, {expected_states} expected",
            state.len()
        )));
    }
    for &s in state {
        let st = ty(s)?;
        if *st != pt {
            return Err(Error::type_error(
                name,
                "state tensors must have the parameter's type",
                &[&pt, st],
            ));
        }
    }
    for (what, s) in [("lr", lr), ("step", step)] {
        let t = ty(s)?;
        if t.shape.rank() != 0 || !t.dtype.is_float() {
            return Err(Error::type_error(
                name,
                format!("{what} must be a float scalar"),
                &[t],
            ));
        }
    }
    Ok(pt)
}

/// Checks the operands of [`Optimizer::update_eager`].
pub(crate) fn check_eager(
    name: &str,
    param: &tch::Tensor,
    grad: &tch::Tensor,
    state: &[tch::Tensor],
    expected_states: usize,
    step: u64,
) -> Result<()> {
    if param.size() != grad.size() {
        return Err(Error::Invalid(format!(
            "{name}: parameter {:?} and gradient {:?} differ in shape",
            param.size(),
            grad.size()
        )));
    }
    if state.len() != expected_states {
        return Err(Error::Invalid(format!(
            "{name}: {} state tensors given, {expected_states} expected",
            state.len()
        )));
    }
    if step == 0 {
        return Err(Error::Invalid(format!("{name}: step is 1-based, got 0")));
    }
    Ok(())
}
