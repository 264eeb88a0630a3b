//! The optimizers every rank and reference steps with: SGD with momentum and Adam, written
//! as PyTorch's `torch.optim` computes them so results match bit for bit.

use super::TrainError;
use crate::autograd::scaled::{add_scaled_, addcdiv_, addcmul_};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tch::Tensor;

/// Which optimizer to train with. SGD with momentum is the default because Adam normalizes
/// gradient scale away and would hide divisor bugs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD(lr, momentum)` (no dampening, weight decay or Nesterov).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0 for plain SGD).
        momentum: f64,
    },
    /// `torch.optim.Adam(lr, betas, eps)` (no weight decay, no amsgrad).
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first-moment (mean) estimate.
        beta1: f64,
        /// Decay of the second-moment (uncentered variance) estimate.
        beta2: f64,
        /// Added to the denominator for numerical stability.
        eps: f64,
    },
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Sgd {
            lr: 0.01,
            momentum: 0.9,
        }
    }
}

impl OptimizerConfig {
    /// PyTorch's Adam defaults with learning rate `lr`.
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// A fresh optimizer (no state yet).
    pub fn build(&self) -> Box<dyn Optimizer> {
        match *self {
            OptimizerConfig::Sgd { lr, momentum } => Box::new(Sgd::new(lr, momentum)),
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => Box::new(Adam::new(lr, beta1, beta2, eps)),
        }
    }
}

/// Updates parameters in place from their `.grad`, keeping per-parameter state by name.
pub trait Optimizer: Send {
    /// One update. Parameters without a gradient are skipped, as in PyTorch.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError>;

    /// The optimizer's state as named tensors (PyTorch's per-parameter `state`, keyed
    /// `<parameter>.<entry>`), so a checkpoint can carry it and a continued run step exactly
    /// as an uninterrupted one. The tensors are copies. The default refuses: an optimizer
    /// that cannot export its state must say so rather than let a resumed run drift.
    fn state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        Err(TrainError::InvalidConfig(
            "this optimizer cannot export its state".into(),
        ))
    }

    /// Replaces the optimizer's state with `state`, as [`Optimizer::state`] returned it.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), TrainError> {
        let _ = state;
        Err(TrainError::InvalidConfig(
            "this optimizer cannot load a saved state".into(),
        ))
    }
}

/// `torch.optim.SGD` with momentum: `buf = grad` on the first step, then
/// `buf = momentum·buf + grad`; `p += (-lr)·buf` rounded once, as libtorch's `add_` with
/// `alpha` does.
#[derive(Debug)]
pub struct Sgd {
    lr: f64,
    momentum: f64,
    buffers: HashMap<String, Tensor>,
}

impl Sgd {
    /// `momentum = 0` is plain SGD (no buffer kept).
    pub fn new(lr: f64, momentum: f64) -> Self {
        Sgd {
            lr,
            momentum,
            buffers: HashMap::new(),
        }
    }
}

impl Optimizer for Sgd {
    /// `torch.optim.SGD`'s single-tensor step, op for op (what it runs on CPU, where the
    /// default `foreach` path is not taken; the `foreach` kernels' CPU fallback runs the same
    /// ops): `buf = grad.detach().clone()` on the first step, else
    /// `buf.mul_(momentum).add_(grad)`; then `param.add_(buf, alpha=-lr)`, one fused
    /// multiply-add through the bridge.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError> {
        tch::no_grad(|| {
            for (name, p) in params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let update = if self.momentum == 0.0 {
                    grad
                } else {
                    let buf = match self.buffers.remove(name) {
                        None => grad.f_detach_copy()?,
                        Some(mut buf) => {
                            let _ = buf.f_mul_scalar_(self.momentum)?.f_add_(&grad)?;
                            buf
                        }
                    };
                    let update = buf.shallow_clone();
                    self.buffers.insert(name.clone(), buf);
                    update
                };
                add_scaled_(p, &update, -self.lr)?;
            }
            Ok(())
        })
    }

    /// Each momentum buffer under `<parameter>.momentum_buffer` (PyTorch's entry name),
    /// sorted by key; none before the first step or without momentum.
    fn state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let mut out = Vec::with_capacity(self.buffers.len());
        for (name, buf) in &self.buffers {
            out.push((
                format!("{name}{MOMENTUM_SUFFIX}"),
                tch::no_grad(|| buf.f_detach_copy())?,
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Takes momentum buffers keyed `<parameter>.momentum_buffer`; with `momentum = 0` only
    /// an empty state fits (plain SGD keeps none).
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), TrainError> {
        if self.momentum == 0.0 && !state.is_empty() {
            return Err(TrainError::InvalidConfig(
                "SGD without momentum keeps no state, but a state was given".into(),
            ));
        }
        let mut buffers = HashMap::with_capacity(state.len());
        for (key, t) in state {
            let Some(name) = key.strip_suffix(MOMENTUM_SUFFIX) else {
                return Err(TrainError::InvalidConfig(format!(
                    "SGD state key `{key}` does not end in `{MOMENTUM_SUFFIX}`"
                )));
            };
            buffers.insert(name.to_owned(), tch::no_grad(|| t.f_detach_copy())?);
        }
        self.buffers = buffers;
        Ok(())
    }
}

/// The suffix of an SGD momentum buffer's key in [`Optimizer::state`]: PyTorch's name for
/// the entry in `optimizer.state[param]`.
pub const MOMENTUM_SUFFIX: &str = ".momentum_buffer";

/// `torch.optim.Adam`: `m = lerp(m, g, 1-β1)`, `v = β2·v + (1-β2)·g²`,
/// `p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)`, in PyTorch's ops and order.
#[derive(Debug)]
pub struct Adam {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    state: HashMap<String, AdamState>,
}

#[derive(Debug)]
struct AdamState {
    step: i32,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl Adam {
    /// Torch's defaults are `beta1 = 0.9`, `beta2 = 0.999`, `eps = 1e-8`
    /// ([`OptimizerConfig::adam`]).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64) -> Self {
        Adam {
            lr,
            beta1,
            beta2,
            eps,
            state: HashMap::new(),
        }
    }
}

impl Optimizer for Adam {
    /// `torch.optim.Adam`'s single-tensor step (`capturable=False`), op for op:
    /// `exp_avg.lerp_(grad, 1-β1)`, `exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1-β2)`,
    /// the bias corrections in f64 with the float step count as Python computes them
    /// (`β**step`, `bc2**0.5`), `denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)`,
    /// `param.addcdiv_(exp_avg, denom, value=-lr/bc1)`.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError> {
        tch::no_grad(|| {
            for (name, p) in params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let st = match self.state.remove(name) {
                    Some(st) => st,
                    None => AdamState {
                        step: 0,
                        exp_avg: grad.f_zeros_like()?,
                        exp_avg_sq: grad.f_zeros_like()?,
                    },
                };
                let AdamState {
                    mut step,
                    mut exp_avg,
                    mut exp_avg_sq,
                } = st;
                step += 1;
                let _ = exp_avg.f_lerp_(&grad, 1.0 - self.beta1)?;
                let _ = exp_avg_sq.f_mul_scalar_(self.beta2)?;
                addcmul_(&exp_avg_sq, &grad, &grad, 1.0 - self.beta2)?;
                // PyTorch keeps the step as a float tensor and raises Python floats to it.
                let t = f64::from(step);
                let bias1 = 1.0 - self.beta1.powf(t);
                let bias2 = 1.0 - self.beta2.powf(t);
                let step_size = self.lr / bias1;
                let mut denom = exp_avg_sq.f_sqrt()?.f_div_scalar(bias2.powf(0.5))?;
                let _ = denom.f_add_scalar_(self.eps)?;
                addcdiv_(p, &exp_avg, &denom, -step_size)?;
                self.state.insert(
                    name.clone(),
                    AdamState {
                        step,
                        exp_avg,
                        exp_avg_sq,
                    },
                );
            }
            Ok(())
        })
    }
}
