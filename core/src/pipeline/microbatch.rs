//! Splitting a step's data into microbatches and scaling their losses, so that the gradient
//! accumulated over the microbatches is the gradient of the reference objective: the mean
//! over the data ranks of each rank's loss (what DDP and the single-device reference train).

use super::PipelineError;
use lockstep_models::{Batch, LossReduction, Model};
use tch::Tensor;

/// One step's microbatches and the factor each one's loss is multiplied by.
#[derive(Debug)]
pub struct Microbatches {
    /// In schedule order (microbatch `i` is `batches[i]`).
    pub batches: Vec<Batch>,
    /// `loss_i · scale_i` summed over `i` is the reference objective.
    pub scales: Vec<f64>,
}

/// The batches of `data_ranks` at `step`, concatenated along the model's batch dimension and
/// split into `count` microbatches as evenly as possible (the first ones one sample larger).
///
/// Scales: a mean loss weighs microbatch `i` by its share of the samples (`1/m` when even),
/// a sum loss by `1/R` for `R` data ranks (the reference averages the ranks' sums).
pub fn split(
    model: &dyn Model,
    data_ranks: &[usize],
    step: usize,
    count: usize,
) -> Result<Microbatches, PipelineError> {
    if data_ranks.is_empty() || count == 0 {
        return Err(PipelineError::InvalidPlan(
            "a step needs at least one data rank and one microbatch".into(),
        ));
    }
    let dim = model.batch_dim();
    let batches = data_ranks
        .iter()
        .map(|&r| model.input(r, step))
        .collect::<Result<Vec<_>, _>>()?;
    let cat = |pick: &dyn Fn(&Batch) -> Option<&Tensor>| -> Result<Option<Tensor>, PipelineError> {
        let parts: Vec<&Tensor> = batches.iter().filter_map(pick).collect();
        if parts.is_empty() {
            return Ok(None);
        }
        Ok(Some(Tensor::f_cat(&parts, dim)?))
    };
    let arity = batches[0].inputs.len();
    let inputs = (0..arity)
        .map(|k| cat(&|b: &Batch| b.inputs.get(k)))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .flatten()
        .collect::<Vec<_>>();
    let target = cat(&|b: &Batch| b.target.as_ref())?;
    let samples = inputs
        .first()
        .and_then(|t| t.size().get(dim as usize).copied())
        .unwrap_or(0) as usize;
    if count > samples {
        return Err(PipelineError::InvalidPlan(format!(
            "{count} microbatches need at least {count} samples; model `{}` has {samples} per \
             step over {} data rank(s)",
            model.name(),
            data_ranks.len()
        )));
    }
    let sizes: Vec<usize> = (0..count)
        .map(|i| samples / count + usize::from(i < samples % count))
        .collect();
    let mut out = Vec::with_capacity(count);
    let mut start = 0i64;
    for &n in &sizes {
        // Contiguous, as a data loader hands a batch over: a slice along a sequence-first
        // model's batch dimension (1) is a strided view that `view` cannot reshape.
        let take = |t: &Tensor| t.f_narrow(dim, start, n as i64)?.f_contiguous();
        out.push(Batch {
            inputs: inputs.iter().map(take).collect::<Result<Vec<_>, _>>()?,
            target: target.as_ref().map(take).transpose()?,
        });
        start += n as i64;
    }
    let scales = match model.loss_reduction() {
        LossReduction::Mean => sizes.iter().map(|&n| n as f64 / samples as f64).collect(),
        LossReduction::Sum => vec![1.0 / data_ranks.len() as f64; count],
    };
    Ok(Microbatches {
        batches: out,
        scales,
    })
}
