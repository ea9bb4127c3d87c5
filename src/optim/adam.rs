//! Adam and AdamW, as `torch.optim.Adam` / `torch.optim.AdamW` (single-tensor implementation).

use super::math::UpdateMath;
use super::{eager_update, traced_update, Optimizer};
use crate::error::{Error, Result};
use crate::ir::{Graph, NodeId, TensorType};

/// `torch.optim.Adam` (weight decay as an L2 term added to the gradient):
///
/// ```text
/// g = grad + weight_decay * p                      (if weight_decay != 0)
/// m = lerp(m, g, 1 - beta1)
/// v = beta2 * v + (1 - beta2) * g * g
/// v_max = max(v_max, v)                            (amsgrad)
/// denom = sqrt(v or v_max) / sqrt(1 - beta2^step) + eps
/// p = p - lr / (1 - beta1^step) * m / denom
/// ```
///
/// State: `exp_avg`, `exp_avg_sq` (and `max_exp_avg_sq` with AMSGrad), zeros initially.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// L2 penalty added to the gradient (default 0).
    pub weight_decay: f64,
    /// Use the maximum of past second moments (default false).
    pub amsgrad: bool,
}

/// `torch.optim.AdamW`: Adam with decoupled weight decay, applied to the parameter before the
/// Adam step: `p = p * (1 - lr * weight_decay)`; the gradient is not modified.
///
/// State: as [`Adam`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Decay of the first moment (default 0.9).
    pub beta1: f64,
    /// Decay of the second moment (default 0.999).
    pub beta2: f64,
    /// Added to the denominator (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.01, as PyTorch).
    pub weight_decay: f64,
    /// Use the maximum of past second moments (default false).
    pub amsgrad: bool,
}

impl Default for Adam {
    fn default() -> Self {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            amsgrad: false,
        }
    }
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            amsgrad: false,
        }
    }
}

macro_rules! builder_methods {
    ($t:ident) => {
        impl $t {
            /// PyTorch's defaults.
            pub fn new() -> Self {
                Self::default()
            }
            /// With moment decays `beta1`, `beta2`.
            pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
                self.beta1 = beta1;
                self.beta2 = beta2;
                self
            }
            /// With `eps`.
            pub fn eps(mut self, eps: f64) -> Self {
                self.eps = eps;
                self
            }
            /// With weight decay `w`.
            pub fn weight_decay(mut self, w: f64) -> Self {
                self.weight_decay = w;
                self
            }
            /// With AMSGrad on or off.
            pub fn amsgrad(mut self, on: bool) -> Self {
                self.amsgrad = on;
                self
            }
            fn core(&self) -> Core {
                Core {
                    name: stringify!($t),
                    beta1: self.beta1,
                    beta2: self.beta2,
                    eps: self.eps,
                    weight_decay: self.weight_decay,
                    amsgrad: self.amsgrad,
                    decoupled: stringify!($t) == "AdamW",
                }
            }
        }

        impl Optimizer for $t {
            fn state_shapes(&self, param: &TensorType) -> Vec<(&'static str, TensorType)> {
                self.core().state_shapes(param)
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
                self.core().update(g, param, grad, state, lr, step)
            }
            fn update_eager(
                &self,
                param: &tch::Tensor,
                grad: &tch::Tensor,
                state: &mut [tch::Tensor],
                lr: f64,
                step: u64,
            ) -> Result<()> {
                self.core().update_eager(param, grad, state, lr, step)
            }
        }
    };
}
builder_methods!(Adam);
builder_methods!(AdamW);

/// The shared implementation; `decoupled` selects AdamW.
struct Core {
    name: &'static str,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    amsgrad: bool,
    decoupled: bool,
}

impl Core {
    fn validate(&self) -> Result<()> {
        let ok = (0.0..1.0).contains(&self.beta1)
            && (0.0..1.0).contains(&self.beta2)
            && self.eps >= 0.0
            && self.weight_decay >= 0.0;
        if !ok {
            return Err(Error::Invalid(format!(
                "{}: need 0 <= beta1, beta2 < 1 and eps, weight_decay >= 0 (got betas ({}, {}), \
                 eps {}, weight_decay {})",
                self.name, self.beta1, self.beta2, self.eps, self.weight_decay
            )));
        }
        Ok(())
    }

    fn num_states(&self) -> usize {
        if self.amsgrad {
            3
        } else {
            2
        }
    }

    fn state_shapes(&self, param: &TensorType) -> Vec<(&'static str, TensorType)> {
        let mut v = vec![("exp_avg", param.clone()), ("exp_avg_sq", param.clone())];
        if self.amsgrad {
            v.push(("max_exp_avg_sq", param.clone()));
        }
        v
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
            self.name,
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
            self.name,
            (param, grad),
            state,
            n,
            (lr, step),
            |m, p, gr, st, lr, step| self.apply(m, p, gr, st, lr, step),
        )
    }

    /// The update, once for both executions (`torch.optim.adam._single_tensor_adam` and
    /// AdamW's decoupled decay). Scalar factors are float64, as PyTorch's Python floats: in
    /// float32, `1 - 0.999^t` would lose ~1e-5 of relative precision to cancellation.
    fn apply<M: UpdateMath>(
        &self,
        m: &mut M,
        param: &mut M::Tensor,
        grad: &M::Tensor,
        state: &mut [M::Tensor],
        lr: M::Scalar,
        step: M::Scalar,
    ) -> Result<()> {
        let one = m.constant(1.0)?;
        let mut gr = m.alias(grad);
        if self.weight_decay != 0.0 {
            let wd = m.constant(self.weight_decay)?;
            if self.decoupled {
                // param.mul_(1 - lr * weight_decay)
                let lw = m.s_mul(lr, wd)?;
                let f = m.s_sub(one, lw)?;
                m.mul_(param, f)?;
            } else {
                gr = m.add(&gr, param, wd)?;
            }
        }
        let (exp_avg, exp_avg_sq, max_exp_avg_sq) = match state {
            [a, b] => (a, b, None),
            [a, b, c] => (a, b, Some(c)),
            _ => {
                return Err(Error::Internal(format!(
                    "{}: {} state tensors reached the update",
                    self.name,
                    state.len()
                )))
            }
        };
        m.lerp_(exp_avg, &gr, 1.0 - self.beta1)?;
        let beta2 = m.constant(self.beta2)?;
        let w2 = m.constant(1.0 - self.beta2)?;
        m.mul_(exp_avg_sq, beta2)?;
        m.addcmul_(exp_avg_sq, &gr, &gr, w2)?;
        let beta1 = m.constant(self.beta1)?;
        let b1t = m.s_pow(beta1, step)?;
        let b2t = m.s_pow(beta2, step)?;
        let bias_correction1 = m.s_sub(one, b1t)?;
        let bias_correction2 = m.s_sub(one, b2t)?;
        let step_size = m.s_div(lr, bias_correction1)?;
        let bc2_sqrt = m.s_sqrt(bias_correction2)?;
        let second = match max_exp_avg_sq {
            Some(max_sq) => {
                m.maximum_(max_sq, exp_avg_sq)?;
                m.alias(max_sq)
            }
            None => m.alias(exp_avg_sq),
        };
        let mut denom = m.sqrt(&second)?;
        m.div_scalar_(&mut denom, bc2_sqrt)?;
        let eps = m.constant(self.eps)?;
        m.add_scalar_(&mut denom, eps)?;
        let minus_one = m.constant(-1.0)?;
        let neg_step_size = m.s_mul(step_size, minus_one)?;
        m.addcdiv_(param, exp_avg, &denom, neg_step_size)
    }
}
