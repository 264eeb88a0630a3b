//! The independent mixed-precision reference a `ddp.<policy>` row is held to, run in process.

use super::*;
use lockstep_core::mixed_reference::mixed_precision_reference;
use lockstep_models::OnDevice;

/// `single.bf16@N` or `single.fp16@N` of `model` (the plan's steps, seed and the model's
/// optimizer), with the ranks' thread count like every reference.
pub(super) fn run_mixed_reference(
    model: &str,
    precision: Precision,
    world_size: usize,
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    let settings = plan.settings_for(model);
    crate::runner::in_process_reference(&settings, &|| {
        let built = zoo::build(model, plan.seed, 0)
            .and_then(|m| OnDevice::new(m, plan.settings().reference_device()))
            .map_err(|e| RunFailed::simple(e.to_string()))?;
        let half = precision.half_type();
        let mut record = mixed_precision_reference(
            &built,
            half,
            world_size,
            plan.steps,
            settings.optimizer,
            plan.record_grads,
        )
        .map_err(|e| RunFailed::simple(format!("{}: {e}", half.reference_name())))?;
        record.spec.config = format!("{}@{world_size}", half.reference_name());
        Ok(record)
    })
}
