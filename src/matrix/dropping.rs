//! The single-device reference that drops tokens at a capacity (`single.cap<F>@N`), and its
//! float64 shadow, for the expert-parallel rows with a capacity factor.

use super::*;
use crate::runner::{ModelBuilder, RunSettings};
use lockstep_core::train::single_device_reference;
use lockstep_models::decisions;

/// `single.cap<F>@N` in fp32 and its float64 shadow: the single-device reference with every
/// mixture dropping the choices over capacity of each rank's batch
/// ([`decisions::dropping`]), as an expert-parallel rank with that factor drops its own. The
/// shadow replays the fp32 run's choices, so it drops the same ones. Both records count the
/// choices dropped (`tokens_dropped`) and are named after the reference.
pub fn dropping_reference(
    build: &ModelBuilder<'_>,
    capacity_factor: f64,
    world_size: usize,
    settings: &RunSettings,
) -> Result<(RunRecord, RunRecord), RunFailed> {
    let name = dropping_reference_name(capacity_factor);
    let train = |m: Box<dyn Model>| {
        let (record, dropped) = decisions::dropping(capacity_factor, || {
            single_device_reference(
                m.as_ref(),
                world_size,
                settings.steps,
                settings.optimizer,
                settings.record_grads,
            )
        });
        let mut record = record.map_err(|e| RunFailed::simple(format!("{name}: {e}")))?;
        record.tokens_dropped = Some(dropped as u64);
        Ok(record)
    };
    let (mut fp32, mut fp64) =
        runner::shadow_pair(build, settings.seed, settings.reference_device(), train)?;
    fp32.spec.config = format!("{name}@{world_size}");
    fp64.spec.config = format!("{name}.f64@{world_size}");
    fp64.spec.dtype = "fp64".into();
    Ok((fp32, fp64))
}

/// [`dropping_reference`] of zoo model `model` for a matrix cell; under an external launch
/// rank 0 computes the pair once and every rank receives both records.
pub(super) fn run_dropping_reference(
    model: &str,
    capacity_factor: f64,
    world_size: usize,
    plan: &Plan,
) -> (Result<RunRecord, RunFailed>, Result<RunRecord, RunFailed>) {
    let settings = plan.settings_for(model);
    let build = runner::zoo_builder(model);
    let pair = std::sync::OnceLock::new();
    let computed = || {
        pair.get_or_init(|| dropping_reference(&build, capacity_factor, world_size, &settings))
            .clone()
    };
    let fp32 = runner::shared_reference(&|| computed().map(|(fp32, _)| fp32));
    let fp64 = runner::shared_reference(&|| computed().map(|(_, fp64)| fp64));
    (fp32, fp64)
}
