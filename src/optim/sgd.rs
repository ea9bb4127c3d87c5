//! Stochastic gradient descent, as `torch.optim.SGD`.

use super::{check_eager, check_update, Optimizer};
use crate::autograd::Builder;
use crate::error::{Error, Result};
use crate::ir::{CompareOp, Graph, NodeId, TensorType};

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
        let pt = check_update(g, "sgd", param, grad, state, self.num_states(), [lr, step])?;
        let mut b = Builder::new(g);
        let mut d = grad;
        if self.weight_decay != 0.0 {
            let wp = b.mul_scalar(param, self.weight_decay)?;
            d = b.add(d, wp)?;
        }
        let mut new_state = Vec::new();
        if self.momentum != 0.0 {
            let buf = state[0];
            let mb = b.mul_scalar(buf, self.momentum)?;
            let new_buf = if self.dampening == 0.0 {
                // With zero dampening, momentum * 0 + g == g: zeros are the first-step state.
                b.add(mb, d)?
            } else {
                let dd = b.mul_scalar(d, 1.0 - self.dampening)?;
                let later = b.add(mb, dd)?;
                let s = b.to_float(step, pt.dtype)?;
                let one = b.scalar(pt.dtype, 1.0)?;
                let first = b.compare(CompareOp::Le, s, one)?;
                let first = b.splat(first, &pt.shape)?;
                b.select(first, d, later)?
            };
            d = if self.nesterov {
                let m = b.mul_scalar(new_buf, self.momentum)?;
                b.add(d, m)?
            } else {
                new_buf
            };
            new_state.push(new_buf);
        }
        let lr = b.to_float(lr, pt.dtype)?;
        let lr = b.splat(lr, &pt.shape)?;
        let step_d = b.mul(lr, d)?;
        let p = b.sub(param, step_d)?;
        Ok((p, new_state))
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
        check_eager("sgd", param, grad, state, self.num_states(), step)?;
        let _guard = tch::no_grad_guard();
        let mut d = grad.shallow_clone();
        if self.weight_decay != 0.0 {
            d = d.f_add(&param.f_mul_scalar(self.weight_decay)?)?;
        }
        if self.momentum != 0.0 {
            let buf = &mut state[0];
            if step <= 1 {
                buf.f_copy_(&d)?;
            } else {
                let _ = buf.f_mul_scalar_(self.momentum)?;
                let _ = buf.f_add_(&d.f_mul_scalar(1.0 - self.dampening)?)?;
            }
            d = if self.nesterov {
                d.f_add(&buf.f_mul_scalar(self.momentum)?)?
            } else {
                buf.shallow_clone()
            };
        }
        let mut p = param.shallow_clone();
        let _ = p.f_sub_(&d.f_mul_scalar(lr)?)?;
        Ok(())
    }
}
