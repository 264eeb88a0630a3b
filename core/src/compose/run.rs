//! Running a composition: each one is a parallelism's own training loop with its data
//! dimension (and, for pipelines, the stages' tensor parallelism) given as options.

use super::plan::{check_mesh, Composition, CompositionError, SeamFault};
use crate::comm::World;
use crate::context_parallel::train_context_parallel;
use crate::expert_parallel::{train_expert_parallel, EpFault, EpOptions};
use crate::pipeline::{train_pipeline_with, PipelineFault, StageParallel};
use crate::record::RunRecord;
use crate::tensor_parallel::{train_tensor_parallel, TpFault};
use crate::train::TrainConfig;
use lockstep_models::Model;

/// Trains `model` (built whole on every rank) under `composition` on `world`, with an
/// optional planted seam bug. Each rank checks the mesh and the model's rank-local
/// parameters first, and each parallelism's loop its own plan (so nothing is planned twice);
/// [`check_composition`](super::check_composition) checks all of it once before spawn. A
/// fault that does not belong to the composition is refused.
pub fn train_composed(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    composition: Composition,
    fault: Option<SeamFault>,
) -> Result<RunRecord, CompositionError> {
    let world_size = world.size();
    check_mesh(model, world_size, composition)?;
    let misplaced = |f: SeamFault| {
        CompositionError::Invalid(format!(
            "the planted fault {f:?} has no seam in {composition:?}"
        ))
    };
    match composition {
        Composition::TensorData { tp, data } => {
            let fault = match fault {
                None => None,
                Some(SeamFault::ShardedGradsReducedOverDpTwice) => {
                    Some(TpFault::ShardedGradsReducedOverDpTwice)
                }
                Some(f) => return Err(misplaced(f)),
            };
            let opts = crate::tensor_parallel::TpOptions {
                fault,
                ..Composition::tp_options(tp, data)
            };
            Ok(train_tensor_parallel(model, world, cfg, &opts)?)
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
            let fault = match fault {
                None => None,
                Some(SeamFault::ReduceGradBeforeLastMicrobatch) => {
                    Some(PipelineFault::ReduceGradBeforeLastMicrobatch)
                }
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
                cp_fault: None,
                data,
            };
            Ok(train_pipeline_with(model, world, cfg, &opts, stage)?.record)
        }
        Composition::ContextData { cp, tp, ep, data } => {
            if let Some(f) = fault {
                return Err(misplaced(f));
            }
            Ok(train_context_parallel(
                model,
                world,
                cfg,
                &Composition::cp_options(cp, tp, ep, data),
            )?)
        }
        Composition::ExpertData { ep, data } => {
            let fault = match fault {
                None => None,
                Some(SeamFault::ExpertsShardedOverDp) => Some(EpFault::ExpertsShardedOverDp),
                Some(f) => return Err(misplaced(f)),
            };
            let opts = EpOptions {
                fault,
                ..Composition::ep_options(ep, data)
            };
            Ok(train_expert_parallel(model, world, cfg, &opts)?)
        }
    }
}
