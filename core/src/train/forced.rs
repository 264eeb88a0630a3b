//! The teacher-forced reference: the single-device training fed another run's gradients, so
//! that a run can be judged step by step from its own state.
//!
//! Judging a whole trajectory against a reference fails in a chaotic phase of training: two
//! correct fp32 runs that round differently separate, and a kink (a ReLU pre-activation near
//! zero) can land on different sides for them, a jump no rounding envelope covers. Here the
//! reference computes each step's loss and gradients as usual (what its record keeps), then
//! steps its optimizer with the *run's* recorded gradients of that step instead of its own.
//! Its parameters therefore follow the run's trajectory (bit for bit wherever the run's
//! optimizer step is the same elementwise fp32 arithmetic: DDP, FSDP, TP), and its record's
//! gradients are the reference's gradients at the run's state: judged against them, with the
//! float64 version of the same forcing as the shadow, a step carries one step of rounding
//! noise however chaotic the training. Its final parameters are the run's gradients replayed
//! through the reference optimizer, which catches an optimizer or update bug in the run.

use super::{
    clip_coefficient, no_sync, scale_gradients, train, OptimizerConfig, StepHooks, TrainConfig,
    TrainError,
};
use crate::record::{NamedTensor, RunRecord};
use lockstep_models::Model;
use std::collections::HashMap;
use tch::Tensor;

/// The [`StepHooks`] of a teacher-forced reference: the reference's own strategy (`inner`:
/// no synchronization for the single-device reference, microbatching for the microbatched
/// one) computes each step, then the optimizer steps on the run's gradients of that step
/// (clipped with the run's recorded norm where the model clips).
struct ForcedGradients<'a> {
    inner: &'a mut dyn StepHooks,
    run_grads: &'a [Vec<NamedTensor>],
    run_norms: &'a [f64],
    max_norm: Option<f64>,
    step: usize,
}

impl StepHooks for ForcedGradients<'_> {
    fn parameters(&self, model: &dyn Model) -> Vec<(String, Tensor)> {
        self.inner.parameters(model)
    }

    fn before_forward(&mut self, step: usize) -> Result<(), TrainError> {
        self.step = step;
        self.inner.before_forward(step)
    }

    fn layer_hooks(&mut self) -> Option<&mut dyn lockstep_models::LayerHooks> {
        self.inner.layer_hooks()
    }

    fn forward_backward(
        &mut self,
        model: &dyn Model,
        data_ranks: &[usize],
        step: usize,
    ) -> Result<super::StepLoss, TrainError> {
        self.inner.forward_backward(model, data_ranks, step)
    }

    fn local_gradients(
        &mut self,
        params: &[(String, Tensor)],
        step: usize,
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        self.inner.local_gradients(params, step)
    }

    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.inner.sync_gradients(grads)
    }

    fn gradient_view(
        &mut self,
        grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<super::GradientView, TrainError> {
        self.inner.gradient_view(grads, keep)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn super::Optimizer,
        params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        let missing = |what: String| TrainError::InvalidConfig(format!("teacher forcing: {what}"));
        let step = self.step;
        let recorded = self
            .run_grads
            .get(step)
            .ok_or_else(|| missing(format!("the run recorded no gradients at step {step}")))?;
        let by_name: HashMap<&str, &NamedTensor> =
            recorded.iter().map(|t| (t.name.as_str(), t)).collect();
        let mut grads = Vec::with_capacity(params.len());
        tch::no_grad(|| -> Result<(), TrainError> {
            for (name, p) in params {
                let run = by_name.get(name.as_str()).ok_or_else(|| {
                    missing(format!(
                        "the run recorded no gradient of `{name}` at step {step}"
                    ))
                })?;
                let grad = p.grad();
                if !grad.defined() || grad.size() != run.shape {
                    return Err(missing(format!(
                        "`{name}` has shape {:?} here and {:?} in the run at step {step}",
                        p.size(),
                        run.shape
                    )));
                }
                let forced = Tensor::f_from_slice(&run.values)?
                    .f_reshape(run.shape.as_slice())?
                    .f_to_kind(grad.kind())?
                    .f_to_device(grad.device())?;
                grad.shallow_clone().f_copy_(&forced)?;
                grads.push(grad);
            }
            Ok(())
        })?;
        if let Some(max_norm) = self.max_norm {
            let total = *self.run_norms.get(step).ok_or_else(|| {
                missing(format!("the run recorded no gradient norm at step {step}"))
            })?;
            scale_gradients(grads.iter(), clip_coefficient(max_norm, total))?;
        }
        optimizer.step(params)?;
        Ok(true)
    }
}

/// The single-device reference for `world_size` ranks, forced along `run`'s trajectory: each
/// step computes its own loss and gradients (the record's) at the state the run's gradients
/// led to, then steps on the run's gradients. `run` must have recorded every step's
/// gradients, under the model's parameter names.
pub fn teacher_forced_reference(
    model: &dyn Model,
    world_size: usize,
    run: &RunRecord,
    optimizer: OptimizerConfig,
) -> Result<RunRecord, TrainError> {
    model.check_single_device_reference()?;
    let cfg = TrainConfig::one_process(
        model,
        "single.forced",
        world_size,
        run.losses.len(),
        optimizer,
        true,
    );
    teacher_forced(model, &cfg, &mut no_sync, run)
}

/// Trains `model` under `cfg` with the one-process strategy `inner` (a reference's own),
/// forced along `run`'s trajectory: each step is `inner`'s, then the optimizer steps on the
/// run's gradients of that step. `run` must have recorded every step's gradients, under the
/// model's parameter names.
pub fn teacher_forced(
    model: &dyn Model,
    cfg: &TrainConfig,
    inner: &mut dyn StepHooks,
    run: &RunRecord,
) -> Result<RunRecord, TrainError> {
    let run_grads = run.grads.as_deref().ok_or_else(|| {
        TrainError::InvalidConfig(
            "teacher forcing needs the run's per-step gradients (record_grads)".into(),
        )
    })?;
    let mut hooks = ForcedGradients {
        inner,
        run_grads,
        run_norms: &run.grad_norms,
        max_norm: model.max_grad_norm(),
        step: 0,
    };
    train(model, cfg, &mut hooks, None)
}
