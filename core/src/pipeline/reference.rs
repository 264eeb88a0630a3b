//! The single-device run a pipeline must equal bit for bit where the math allows: one
//! process, the whole model, the same microbatches with the same loss scales, backward per
//! microbatch in order (gradients accumulating in `.grad` as a pipeline stage's do).

use super::microbatch;
use super::PipelineError;
use crate::record::RunRecord;
use crate::train::{
    train_from, OptimizerConfig, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::Model;
use tch::Tensor;

/// Trains `model` on `world_size` ranks' batches per step, split into `microbatches`, each
/// microbatch's scaled loss backpropagated on its own, in order.
pub fn microbatched_reference(
    model: &dyn Model,
    world_size: usize,
    microbatches: usize,
    steps: usize,
    optimizer: OptimizerConfig,
    record_grads: bool,
) -> Result<RunRecord, PipelineError> {
    model.check_single_device_reference()?;
    let config = format!("single.mb{microbatches}");
    let cfg = TrainConfig::one_process(model, &config, world_size, steps, optimizer, record_grads);
    let mut strategy = Microbatched { microbatches };
    train_from(model, &cfg, &mut strategy, None, &TrainStart::default())
        .map(|(record, _)| record)
        .map_err(TrainError::into_strategy::<PipelineError>)
}

/// [`microbatched_reference`] forced along `run`'s trajectory (the step-local check's
/// reference for a row held to the microbatched reference; see
/// [`crate::train::teacher_forced`]).
pub fn teacher_forced_microbatched(
    model: &dyn Model,
    world_size: usize,
    microbatches: usize,
    run: &RunRecord,
    optimizer: OptimizerConfig,
) -> Result<RunRecord, PipelineError> {
    model.check_single_device_reference()?;
    let config = format!("single.mb{microbatches}.forced");
    let steps = run.losses.len();
    let cfg = TrainConfig::one_process(model, &config, world_size, steps, optimizer, true);
    let mut strategy = Microbatched { microbatches };
    crate::train::teacher_forced(model, &cfg, &mut strategy, run)
        .map_err(TrainError::into_strategy::<PipelineError>)
}

/// One process's step as a pipeline computes it: the data ranks' batches split into
/// microbatches, each one's scaled loss backpropagated on its own, in order.
struct Microbatched {
    microbatches: usize,
}

impl StepHooks for Microbatched {
    fn forward_backward(
        &mut self,
        model: &dyn Model,
        data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let split = microbatch::split(model, data_ranks, step, self.microbatches)
            .map_err(TrainError::strategy)?;
        let mut objective = 0.0;
        // Where the losses were computed (the model's device): a split has at least one
        // microbatch, so this is never left unset.
        let mut device = None;
        for (batch, scale) in split.batches.iter().zip(&split.scales) {
            let loss = model.loss(batch)?.f_mul_scalar(*scale)?;
            objective += loss.f_double_value(&[])?;
            device = Some(loss.device());
            loss.f_backward()?;
        }
        let device = device
            .ok_or_else(|| TrainError::InvalidConfig("a step split into no microbatch".into()))?;
        Ok(StepLoss {
            value: objective,
            device,
        })
    }

    fn local_gradients(
        &mut self,
        params: &[(String, Tensor)],
        _step: usize,
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        // A parameter no microbatch reached has a zero gradient, as on a pipeline stage.
        params
            .iter()
            .map(|(n, p)| {
                let g = p.grad();
                Ok((n.clone(), if g.defined() { g } else { p.f_zeros_like()? }))
            })
            .collect()
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        Ok(())
    }
}
