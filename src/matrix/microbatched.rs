//! The microbatched single-device reference a pipeline row is held to, run in process.

use super::*;
use lockstep_core::pipeline::microbatched_reference;
use lockstep_models::OnDevice;

/// The microbatched reference of `model` (the plan's steps, seed and the model's optimizer).
fn train_microbatched(
    model: &dyn Model,
    world_size: usize,
    microbatches: usize,
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    microbatched_reference(
        model,
        world_size,
        microbatches,
        plan.steps,
        optimizer_for(model.name()),
        plan.record_grads,
    )
    .map_err(|e| RunFailed::simple(format!("microbatched reference: {e}")))
}

/// The float64 shadow of the microbatched reference (see [`runner::shadow_f64`]).
pub(super) fn run_microbatched_f64(
    model: &str,
    world_size: usize,
    microbatches: usize,
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    let build = runner::zoo_builder(model);
    let train =
        |built: Box<dyn Model>| train_microbatched(built.as_ref(), world_size, microbatches, plan);
    // Under an external launch rank 0 computes it for every rank.
    runner::shared_reference(&|| {
        let mut record =
            runner::shadow_f64(&build, plan.seed, plan.settings().reference_device(), train)?;
        record.spec.config = format!("{}.f64@{world_size}", microbatched_name(microbatches));
        record.spec.dtype = "fp64".into();
        Ok(record)
    })
}

/// The in-process microbatched reference.
pub(super) fn run_microbatched(
    model: &str,
    world_size: usize,
    microbatches: usize,
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    // With the ranks' thread count, like every reference (`runner::in_process_reference`).
    crate::runner::in_process_reference(&plan.settings_for(model), &|| {
        let built = zoo::build(model, plan.seed, 0)
            .and_then(|m| OnDevice::new(m, plan.settings().reference_device()))
            .map_err(|e| RunFailed::simple(e.to_string()))?;
        let mut record = train_microbatched(&built, world_size, microbatches, plan)?;
        record.spec.config = format!("{}@{world_size}", microbatched_name(microbatches));
        Ok(record)
    })
}
