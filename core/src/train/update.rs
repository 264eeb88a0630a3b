//! What every loop does around its optimizer update: clipping's factor, scaling gradients
//! by it, and recording what was stepped. A file of its own so that the data layer
//! (`compose::data`), which clips and steps for the model-splitting strategies, needs
//! nothing of the strategy trait that hands the data layer out.

use super::optim::Optimizer;
use super::TrainError;
use crate::consistency::{StateKind, StateProbe};
use tch::Tensor;

/// The factor gradient clipping at `max_norm` scales gradients by when their global norm is
/// `total`: `max_norm / (total + 1e-6)` rounded to fp32 (PyTorch's `clip_grad_norm_` computes
/// it as an fp32 tensor), or `None` when it is not below 1 and nothing is clipped.
pub fn clip_coefficient(max_norm: f64, total: f64) -> Option<f64> {
    let coef = f64::from((max_norm / (total + 1e-6)) as f32);
    (coef < 1.0).then_some(coef)
}

/// Multiplies every defined tensor of `grads` in place by `coef` (nothing for `None`).
pub fn scale_gradients<'a>(
    grads: impl IntoIterator<Item = &'a Tensor>,
    coef: Option<f64>,
) -> Result<(), TrainError> {
    let Some(coef) = coef else {
        return Ok(());
    };
    for g in grads.into_iter().filter(|g| g.defined()) {
        let _ = g.shallow_clone().f_mul_scalar_(coef)?;
    }
    Ok(())
}

/// Records what an optimizer just stepped, `stepped`, and the optimizer's state (when it
/// exports one), each under the coordinate `coord` gives its (owner's) name: what every loop
/// does after its update.
pub fn observe_stepped(
    probe: &StateProbe,
    step: usize,
    stepped: &[(String, Tensor)],
    optimizer: &dyn Optimizer,
    coord: &dyn Fn(&str) -> String,
) -> Result<(), crate::CommError> {
    probe.observe_all(step, StateKind::Param, stepped, coord)?;
    // An optimizer that cannot export its state has none to compare.
    if let Ok(state) = optimizer.state() {
        probe.observe_optimizer(step, &state, stepped, coord)?;
    }
    Ok(())
}
