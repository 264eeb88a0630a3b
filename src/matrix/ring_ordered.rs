//! The single-device reference a ring row is also judged against (`single.cpN@N`): one
//! process, attention in the ring's merge order, run in process.

use super::*;
use lockstep_core::context_parallel::{ring_ordered_reference, SequenceLayout};
use lockstep_models::OnDevice;

/// `single.cpN@N` of zoo model `model` for a ring of `cp` ranks laid out as `layout` (the
/// plan's steps, seed and the model's optimizer), with the ranks' thread count like every
/// reference; under an external launch rank 0 computes it for every rank.
pub(super) fn run_ring_ordered(
    model: &str,
    world_size: usize,
    (cp, layout): (usize, SequenceLayout),
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    let settings = plan.settings_for(model);
    crate::runner::in_process_reference(&settings, &|| {
        let built = zoo::build(model, plan.seed, 0)
            .and_then(|m| OnDevice::new(m, settings.reference_device()))
            .map_err(|e| RunFailed::simple(e.to_string()))?;
        let mut record = ring_ordered_reference(
            &built,
            world_size,
            (cp, layout),
            settings.steps,
            settings.optimizer,
            settings.record_grads,
        )
        .map_err(|e| RunFailed::simple(format!("ring-ordered reference: {e}")))?;
        record.spec.config = format!("{}@{world_size}", record.spec.config);
        Ok(record)
    })
}
