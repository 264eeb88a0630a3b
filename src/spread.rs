//! The spread of correct fp32 arithmetic: the single-device reference's training executed
//! again in other summation orders, so the fp64 arbiter measures how far correct fp32 runs
//! stray from float64 on more than one sample (docs/parity.md, "More than one correct fp32
//! run").
//!
//! A variant splits each step's batch into microbatches and accumulates their scaled
//! gradients, as the microbatched reference the pipelines are held to does: the same
//! mathematics as the single-device step (equal by the math, and already trusted as a
//! reference), another order of every batch reduction. Not every model admits it: BatchNorm
//! normalizes with each microbatch's own statistics (another function), and a model that
//! routes tokens by top-k may choose differently at a near-tie in another order (another
//! training, not rounding). Such models get no variant (their rows keep the single sample and
//! the step-local check); a variant that took a discrete decision anyway (a user's model
//! routing without an MoE layer) is not used.

use crate::runner::{in_process_reference, run_spec, ModelBuilder, RunFailed, RunSettings};
use lockstep_core::pipeline::microbatched_reference;
use lockstep_core::record::RunRecord;
use lockstep_models::{decisions, LayerKind, Model, OnDevice};

/// The microbatch counts of the variants: two orders besides the reference's own. Two, not
/// one, so a single variant landing close to float64 by chance does not stand for the spread.
pub const SPLITS: [usize; 2] = [2, 3];

/// The fp32 variants of the single-device reference of `model_name` over `world_size` ranks'
/// batches (configurations `single.mb2@N`, `single.mb3@N`), each run like the reference (in
/// process, at the ranks' thread count, on the reference's device). Variants the model does
/// not admit ([`splits`]) are left out, as are all of them in an exec'd rank, which judges
/// nothing; a variant that fails to train is returned as its failure, since a failing
/// microbatched reference is a defect in Lockstep, not noise to ignore.
pub fn run_spread(
    model_name: &str,
    build: &ModelBuilder<'_>,
    world_size: usize,
    settings: &RunSettings,
) -> Vec<Result<RunRecord, RunFailed>> {
    if crate::runner::self_exec::serving().is_some() {
        return Vec::new();
    }
    let model = match build(settings.seed, 0) {
        Ok(model) => model,
        Err(e) => return vec![Err(RunFailed::simple(format!("fp32 variant: {e}")))],
    };
    splits(model.as_ref(), world_size)
        .into_iter()
        .filter_map(|m| {
            let run = run_variant(model_name, build, world_size, m, settings);
            // A variant that took discrete decisions is another training, not a sample.
            match run {
                Ok(r) if r.routing_min_gap.is_some() => None,
                other => Some(other),
            }
        })
        .collect()
}

/// The microbatch counts of the variants `model` admits over `world_size` ranks' batches:
/// those of [`SPLITS`] its step has samples for; none when its mathematics depends on the
/// batch split (BatchNorm), it routes tokens (an MoE layer), or it has no single-device
/// reference. The matrix counts its runs with it.
pub fn splits(model: &dyn Model, world_size: usize) -> Vec<usize> {
    let split_sensitive = model
        .layers()
        .iter()
        .any(|l| matches!(l.kind, LayerKind::BatchNorm | LayerKind::MoeDecoderBlock));
    if split_sensitive || model.single_device_reference_blocker().is_some() {
        return Vec::new();
    }
    // A model whose first batch cannot be read has no variant; its runs report why.
    let per_rank = model.input(0, 0).ok().and_then(|batch| {
        let first = batch.inputs.first()?;
        let dim = usize::try_from(model.batch_dim()).ok()?;
        first.size().get(dim).copied()
    });
    let samples = per_rank.map_or(0, |n| usize::try_from(n).unwrap_or(0) * world_size);
    SPLITS.into_iter().filter(|&m| m <= samples).collect()
}

/// One variant: the reference's training with each step's batch in `microbatches` parts.
/// Its record's `routing_min_gap` is set when it took discrete decisions.
fn run_variant(
    model_name: &str,
    build: &ModelBuilder<'_>,
    world_size: usize,
    microbatches: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    let config = format!("single.mb{microbatches}@{world_size}");
    let failed = |e: String| RunFailed::simple(format!("fp32 variant {config}: {e}"));
    in_process_reference(settings, &|| {
        let built = build(settings.seed, 0).map_err(|e| failed(e.to_string()))?;
        let built =
            OnDevice::new(built, settings.reference_device()).map_err(|e| failed(e.to_string()))?;
        let (record, tape) = decisions::recording(|| {
            microbatched_reference(
                &built,
                world_size,
                microbatches,
                settings.steps,
                settings.optimizer,
                settings.record_grads,
            )
            .map_err(|e| e.to_string())
        });
        let mut record = record.map_err(failed)?;
        record.spec = run_spec(model_name, &config, world_size, "fp32", settings);
        record.routing_min_gap = (!tape.is_empty()).then_some(tape.min_gap);
        Ok(record)
    })
}

/// The records of `spread` for the arbiter, or the first variant's failure to train.
pub fn trained(spread: &[Result<RunRecord, RunFailed>]) -> Result<Vec<&RunRecord>, &RunFailed> {
    spread.iter().map(|r| r.as_ref()).collect()
}
