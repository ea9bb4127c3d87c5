//! Stochastic gradient descent, as `torch.optim.SGD`.

use super::math::UpdateMath;
use super::{eager_update, traced_update, Optimizer};
use crate::error::{Error, Result};
use crate::ir::{Graph, NodeId, TensorType};

/// `torch.optim.SGD`:
///
/// ```text
/// g = grad + weight_decay * p                        (if weight_decay != 0)
/// if momentum != 0:
///     buf = g                                        (first step)
///     buf = momentum * buf + (1 - dampening) * g     (later steps)
///     g = g + momentum * buf  if nesterov  else  buf
/// p = p - lr * g
/// ```
///
/// State: `momentum_buffer` (only when `momentum != 0`), starting as zeros; the first step is
/// recognised from the `step` input (`step <= 1`), so zeros are a valid initial state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Momentum factor (0: plain SGD, no state).
    pub momentum: f64,
    /// Dampening of the momentum (must be 0 with Nesterov).
    pub dampening: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`).
    pub nesterov: bool,
}

impl Default for Sgd {
    fn default() -> Self {
        Sgd {
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

impl Sgd {
    /// Plain SGD (no momentum, no weight decay).
    pub fn new() -> Self {
        Self::default()
    }

    /// With momentum `m`.
    pub fn momentum(mut self, m: f64) -> Self {
        self.momentum = m;
        self
    }

    /// With dampening `d`.
    pub fn dampening(mut self, d: f64) -> Self {
        self.dampening = d;
        self
    }

    /// With weight decay `w`.
    pub fn weight_decay(mut self, w: f64) -> Self {
        self.weight_decay = w;
        self
    }

    /// With Nesterov momentum on or off.
    pub fn nesterov(mut self, on: bool) -> Self {
        self.nesterov = on;
        self
    }

    /// Checks the hyper-parameters (PyTorch's rules).
    pub fn validate(&self) -> Result<()> {
        if self.momentum.is_nan()
            || self.momentum < 0.0
            || self.weight_decay.is_nan()
            || self.weight_decay < 0.0
        {
            return Err(Error::Invalid(format!(
                "sgd: momentum {} and weight decay {} must be >= 0",
                self.momentum, self.weight_decay
            )));
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Invalid(
                "sgd: Nesterov momentum requires a momentum and zero dampening".into(),
            ));
        }
        Ok(())
    }

    fn num_states(&self) -> usize {
        usize::from(self.momentum != 0.0)
    }

    /// The update, once for both executions (`torch.optim.sgd._single_tensor_sgd`). The
    /// momentum buffer starts as zeros; on the first step (`step <= 1`) it becomes the gradient
    /// (`momentum * 0 + 1 * g`), later `momentum * buf + (1 - dampening) * g`.
    fn apply<M: UpdateMath>(
        &self,
        m: &mut M,
        param: &mut M::Tensor,
        grad: &M::Tensor,
        state: &mut [M::Tensor],
        lr: M::Scalar,
        step: M::Scalar,
    ) -> Result<()> {
        let mut d = m.alias(grad);
        if self.weight_decay != 0.0 {
            let wd = m.constant(self.weight_decay)?;
            d = m.add(&d, param, wd)?;
        }
        if self.momentum != 0.0 {
            let buf = &mut state[0];
            let momentum = m.constant(self.momentum)?;
            let one = m.constant(1.0)?;
            let later = m.constant(1.0 - self.dampening)?;
            let alpha = m.s_select_le(step, 1.0, one, later)?;
            m.mul_(buf, momentum)?;
            m.add_(buf, &d, alpha)?;
            d = if self.nesterov {
                m.add(&d, buf, momentum)?
            } else {
                m.alias(buf)
            };
        }
        let minus_one = m.constant(-1.0)?;
        let neg_lr = m.s_mul(lr, minus_one)?;
        m.add_(param, &d, neg_lr)
    }
}

impl Optimizer for Sgd {
    fn state_shapes(&self, param: &TensorType) -> Vec<(&'static str, TensorType)> {
        if self.momentum != 0.0 {
            vec![("momentum_buffer", param.clone())]
        } else {
            vec![]
        }
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
        self.validate()?;
        let n = self.num_states();
        traced_update(
            g,
            "sgd",
            param,
            grad,
            state,
            n,
            [lr, step],
            |m, p, gr, st, lr, step| self.apply(m, p, gr, st, lr, step),
        )
    }

    fn update_eager(
        &self,
        param: &tch::Tensor,
        grad: &tch::Tensor,
        state: &mut [tch::Tensor],
        lr: f64,
        step: u64,
    ) -> Result<()> {
        self.validate()?;
        let n = self.num_states();
        eager_update(
            "sgd",
            (param, grad),
            state,
            n,
            (lr, step),
            |m, p, gr, st, lr, step| self.apply(m, p, gr, st, lr, step),
        )
    }
}
