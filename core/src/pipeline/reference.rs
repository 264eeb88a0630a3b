//! The single-device run a pipeline must equal bit for bit where the math allows: one
//! process, the whole model, the same microbatches with the same loss scales, backward per
//! microbatch in order (gradients accumulating in `.grad` as a pipeline stage's do).

use super::microbatch;
use super::PipelineError;
use crate::record::{RunRecord, RunSpec};
use crate::train::{capture, clip_coefficient, grad_norm, scale_gradients, OptimizerConfig};
use lockstep_models::Model;

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
    let params = model.named_parameters();
    let mut opt = optimizer.build();
    let ranks: Vec<usize> = (0..world_size).collect();
    let spec = RunSpec {
        model: model.name().to_owned(),
        config: format!("single.mb{microbatches}"),
        world_size,
        backend: "none".into(),
        dtype: "fp32".into(),
        steps,
        seed: model.seed(),
    };
    let mut record = RunRecord::start(spec, record_grads);
    for step in 0..steps {
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        let split = microbatch::split(model, &ranks, step, microbatches)?;
        let mut objective = 0.0;
        for (batch, scale) in split.batches.iter().zip(&split.scales) {
            let loss = model.loss(batch)?.f_mul_scalar(*scale)?;
            objective += loss.f_double_value(&[])?;
            loss.f_backward()?;
        }
        let grads: Vec<(String, tch::Tensor)> = params
            .iter()
            .map(|(n, p)| {
                let g = p.grad();
                Ok((n.clone(), if g.defined() { g } else { p.f_zeros_like()? }))
            })
            .collect::<Result<_, tch::TchError>>()?;
        record.losses.push(objective);
        let norm = grad_norm(&grads)?;
        record.grad_norms.push(norm);
        if let Some(all) = record.grads.as_mut() {
            all.push(capture(&grads)?);
        }
        if let Some(max_norm) = model.max_grad_norm() {
            scale_gradients(
                grads.iter().map(|(_, g)| g),
                clip_coefficient(max_norm, norm),
            )?;
        }
        opt.step(&params)?;
    }
    record.params = capture(&params)?;
    record.buffers = capture(&model.named_buffers())?;
    Ok(record)
}
