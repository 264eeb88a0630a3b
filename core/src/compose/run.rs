//! Running a composition: two loops train every mesh. A pipeline runs its schedule with
//! what splits its stages (TP, CP, EP) and its data dimension given as options; every other
//! composition (TP, CP and EP in any combination, the data dimension stacked on them) is one
//! loop over the sequence-, tensor- and expert-split model (the context-parallel loop, at CP
//! size 1 when the sequence is whole).

use super::plan::{check_mesh, Composition, CompositionError, SeamFault};
use crate::comm::World;
use crate::context_parallel::{train_context_parallel, CpFault, CpOptions};
use crate::pipeline::{train_pipeline_with, PipelineFault, StageParallel};
use crate::record::RunRecord;
use crate::train::TrainConfig;
use lockstep_models::Model;

/// A bug planted in a composition (checker tests only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComposedFault {
    /// At the seam between two parallelisms.
    Seam(SeamFault),
    /// Inside the loop that trains the split model (the context-parallel loop, or a
    /// pipeline stage's TP, CP and EP): a [`crate::field_bugs::FieldBug`]'s mechanism.
    Split(CpFault),
}

/// Trains `model` (built whole on every rank) under `composition` on `world`, with an
/// optional planted bug. Each rank checks the mesh and the model's rank-local
/// parameters first, and each parallelism's loop its own plan (so nothing is planned twice);
/// [`check_composition`](super::check_composition) checks all of it once before spawn. A
/// fault that does not belong to the composition is refused.
pub fn train_composed(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    composition: Composition,
    fault: Option<ComposedFault>,
) -> Result<RunRecord, CompositionError> {
    let world_size = world.size();
    check_mesh(model, world_size, composition)?;
    let misplaced = |f: ComposedFault| {
        CompositionError::Invalid(format!(
            "the planted fault {f:?} has no seam in {composition:?}"
        ))
    };
    match composition {
        Composition::TensorData { .. }
        | Composition::ContextData { .. }
        | Composition::ExpertData { .. } => {
            let (cp, tp, ep, data) = composition.split_sizes();
            let fault = match fault {
                None => None,
                Some(ComposedFault::Seam(SeamFault::ShardedGradsReducedOverDpTwice)) if tp > 1 => {
                    Some(CpFault::ShardedGradsReducedOverDpTwice)
                }
                Some(ComposedFault::Seam(SeamFault::ExpertsShardedOverDp)) if ep > 1 => {
                    Some(CpFault::ExpertsShardedOverDp)
                }
                Some(ComposedFault::Split(f)) => Some(f),
                Some(f) => return Err(misplaced(f)),
            };
            let opts = CpOptions {
                fault,
                ..Composition::cp_options(cp, tp, ep, data)
            };
            Ok(train_context_parallel(model, world, cfg, &opts)?)
        }
        Composition::Pipeline {
            pp,
            tp,
            cp,
            ep,
            data,
            schedule,
            checkpoint_every,
            ..
        } => {
            let (fault, cp_fault) = match fault {
                None => (None, None),
                Some(ComposedFault::Seam(SeamFault::ReduceGradBeforeLastMicrobatch)) => {
                    (Some(PipelineFault::ReduceGradBeforeLastMicrobatch), None)
                }
                Some(ComposedFault::Split(f)) => (None, Some(f)),
                Some(f) => return Err(misplaced(f)),
            };
            let dp = world_size / (pp * tp * cp);
            let opts = crate::pipeline::PipelineOptions {
                fault,
                ..Composition::pipeline_options(pp, dp, schedule, checkpoint_every)
            };
            let stage = StageParallel {
                tp,
                cp,
                ep,
                cp_fault,
                data,
            };
            Ok(train_pipeline_with(model, world, cfg, &opts, stage)?.record)
        }
    }
}
