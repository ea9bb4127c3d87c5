//! Adam and AdamW, as `torch.optim.Adam` / `torch.optim.AdamW` (single-tensor implementation).

use super::{check_eager, check_update, Optimizer};
use crate::autograd::Builder;
use crate::error::{Error, Result};
use crate::ir::{BinaryOp, DType, Graph, NodeId, TensorType, UnaryOp};

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
        let pt = check_update(
            g,
            self.name,
            param,
            grad,
            state,
            self.num_states(),
            [lr, step],
        )?;
        let d = pt.dtype;
        let mut b = Builder::new(g);
        // Scalar factors are computed in f64, as PyTorch computes them in Python floats: in f32,
        // `1 - 0.999^t` would lose ~1e-5 of relative precision to cancellation.
        let lr64 = b.to_float(lr, DType::F64)?;
        let step64 = b.to_float(step, DType::F64)?;
        let mut p = param;
        let mut gr = grad;
        if self.weight_decay != 0.0 {
            if self.decoupled {
                // p * (1 - lr * wd)
                let wd = b.scalar(DType::F64, self.weight_decay)?;
                let lw = b.mul(lr64, wd)?;
                let f = b.rsub_scalar(1.0, lw)?;
                let f = b.convert(f, d)?;
                let f = b.splat(f, &pt.shape)?;
                p = b.mul(p, f)?;
            } else {
                let wp = b.mul_scalar(p, self.weight_decay)?;
                gr = b.add(gr, wp)?;
            }
        }
        let (m, v) = (state[0], state[1]);
        // exp_avg.lerp_(grad, 1 - beta1), with libtorch's two-sided lerp formula.
        let w = 1.0 - self.beta1;
        let diff = b.sub(gr, m)?;
        let m_new = if w < 0.5 {
            let t = b.mul_scalar(diff, w)?;
            b.add(m, t)?
        } else {
            let t = b.mul_scalar(diff, 1.0 - w)?;
            b.sub(gr, t)?
        };
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value = 1 - beta2)
        let vb = b.mul_scalar(v, self.beta2)?;
        let g2 = b.mul(gr, gr)?;
        let g2 = b.mul_scalar(g2, 1.0 - self.beta2)?;
        let v_new = b.add(vb, g2)?;
        // Bias corrections from the step input.
        let b1 = b.scalar(DType::F64, self.beta1)?;
        let b2 = b.scalar(DType::F64, self.beta2)?;
        let b1t = b.binary(BinaryOp::Pow, b1, step64)?;
        let b2t = b.binary(BinaryOp::Pow, b2, step64)?;
        let bc1 = b.rsub_scalar(1.0, b1t)?;
        let bc2 = b.rsub_scalar(1.0, b2t)?;
        let step_size = b.div(lr64, bc1)?;
        let step_size = b.convert(step_size, d)?;
        let bc2_sqrt = b.unary(UnaryOp::Sqrt, bc2)?;
        let bc2_sqrt = b.convert(bc2_sqrt, d)?;
        let mut new_state = vec![m_new, v_new];
        let second = if self.amsgrad {
            let vmax = b.binary(BinaryOp::Max, state[2], v_new)?;
            new_state.push(vmax);
            vmax
        } else {
            v_new
        };
        let sq = b.unary(UnaryOp::Sqrt, second)?;
        let bc2s = b.splat(bc2_sqrt, &pt.shape)?;
        let denom = b.div(sq, bc2s)?;
        let denom = b.add_scalar(denom, self.eps)?;
        let ratio = b.div(m_new, denom)?;
        let ss = b.splat(step_size, &pt.shape)?;
        let upd = b.mul(ss, ratio)?;
        let p_new = b.sub(p, upd)?;
        Ok((p_new, new_state))
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
        check_eager(self.name, param, grad, state, self.num_states(), step)?;
        let _guard = tch::no_grad_guard();
        let mut p = param.shallow_clone();
        let mut gr = grad.shallow_clone();
        if self.weight_decay != 0.0 {
            if self.decoupled {
                let _ = p.f_mul_scalar_(1.0 - lr * self.weight_decay)?;
            } else {
                gr = gr.f_add(&p.f_mul_scalar(self.weight_decay)?)?;
            }
        }
        let _ = state[0].f_lerp_(&gr, 1.0 - self.beta1)?;
        let _ = state[1].f_mul_scalar_(self.beta2)?;
        let _ = state[1].f_add_(&gr.f_mul(&gr)?.f_mul_scalar(1.0 - self.beta2)?)?;
        let t = step as f64;
        let bc1 = 1.0 - self.beta1.powf(t);
        let bc2 = 1.0 - self.beta2.powf(t);
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let second = if self.amsgrad {
            let vmax = state[2].f_maximum(&state[1])?;
            state[2].f_copy_(&vmax)?;
            vmax
        } else {
            state[1].shallow_clone()
        };
        let denom = second
            .f_sqrt()?
            .f_div_scalar(bc2_sqrt)?
            .f_add_scalar(self.eps)?;
        let _ = p.f_sub_(&state[0].f_div(&denom)?.f_mul_scalar(step_size)?)?;
        Ok(())
    }
}
