//! One entry point for every parallelism: a [`Parallelism`] says, as data, how a model is
//! split and replicated, and [`train_parallel`] trains the model under it on this rank
//! through the one training loop. Each parallelism's own `train_*` function stays for what
//! only it offers (a pipeline's timeline, FSDP over a group that is not the world's, a plan
//! other than the model's own); the CLI's configurations and a user's code reach every
//! parallelism through this one door.

use crate::comm::World;
use crate::compose::{train_composed, ComposedFault, Composition, CompositionError};
use crate::context_parallel::{train_context_parallel, CpError, CpOptions};
use crate::ddp::{train_ddp, DdpError, DdpOptions};
use crate::expert_parallel::{train_expert_parallel, EpError, EpOptions};
use crate::field_bugs::FieldBug;
use crate::fsdp::{train_fsdp, train_fsdp_hybrid, FsdpError, FsdpOptions};
use crate::pipeline::{train_pipeline, PipelineError, PipelineOptions};
use crate::record::RunRecord;
use crate::tensor_parallel::{train_tensor_parallel, TpError, TpOptions};
use crate::train::TrainConfig;
use lockstep_models::Model;

/// How a model is trained across the world's ranks.
#[derive(Clone)]
pub enum Parallelism {
    /// Every rank a replica, gradients all-reduced in buckets.
    Ddp(DdpOptions),
    /// Parameters sharded over the world, or (`shard_size`) hybrid shard: sharded within
    /// groups of that many ranks and replicated across them.
    Fsdp {
        /// The wrapper's options.
        options: FsdpOptions,
        /// Hybrid shard's shard group size; `None` shards over the whole world.
        shard_size: Option<usize>,
    },
    /// Tensor (and sequence) parallelism under the model's own plan.
    Tensor(TpOptions),
    /// Expert parallelism under the model's own plan.
    Expert(EpOptions),
    /// Context parallelism: every sequence split over a group of ranks.
    Context(CpOptions),
    /// The model's layers as pipeline stages.
    Pipeline(PipelineOptions),
    /// Model-splitting and data parallelism composed on a named mesh.
    Composed(Composition),
}

/// What training under a [`Parallelism`] can fail with: the parallelism's own error, boxed.
#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    /// DDP failed.
    #[error(transparent)]
    Ddp(Box<DdpError>),
    /// FSDP failed.
    #[error(transparent)]
    Fsdp(Box<FsdpError>),
    /// Tensor parallelism failed.
    #[error(transparent)]
    Tensor(Box<TpError>),
    /// Expert parallelism failed.
    #[error(transparent)]
    Expert(Box<EpError>),
    /// Context parallelism failed.
    #[error(transparent)]
    Context(Box<CpError>),
    /// The pipeline failed.
    #[error(transparent)]
    Pipeline(Box<PipelineError>),
    /// The composition failed.
    #[error(transparent)]
    Composed(Box<CompositionError>),
}

/// Each parallelism's error converts into [`ParallelError`], boxed (they are large).
macro_rules! boxed_from {
    ($($variant:ident($error:ty)),* $(,)?) => {
        $(impl From<$error> for ParallelError {
            fn from(e: $error) -> Self {
                ParallelError::$variant(Box::new(e))
            }
        })*
    };
}

boxed_from!(
    Ddp(DdpError),
    Fsdp(FsdpError),
    Tensor(TpError),
    Expert(EpError),
    Context(CpError),
    Pipeline(PipelineError),
    Composed(CompositionError),
);

/// Trains `model` on this rank of `world` under `parallelism` for `cfg.spec.steps` steps:
/// the run's record (full tensors, the same on every rank).
pub fn train_parallel(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    parallelism: &Parallelism,
) -> Result<RunRecord, ParallelError> {
    train_parallel_planted(model, world, cfg, parallelism, None)
}

/// [`train_parallel`] with a published bug's mechanism planted in every loop `parallelism`
/// runs that has it (checker tests only: `lockstep matrix --fault`). A parallelism without
/// the mechanism trains as it would without it.
pub fn train_parallel_planted(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    parallelism: &Parallelism,
    bug: Option<FieldBug>,
) -> Result<RunRecord, ParallelError> {
    if let Some(bug) = bug {
        let planted = match parallelism {
            Parallelism::Tensor(o) => bug.tp().map(|f| {
                Parallelism::Tensor(TpOptions {
                    fault: Some(f),
                    ..o.clone()
                })
            }),
            Parallelism::Expert(o) => bug.ep().map(|f| {
                Parallelism::Expert(EpOptions {
                    fault: Some(f),
                    ..*o
                })
            }),
            Parallelism::Context(o) => bug.cp().map(|f| {
                Parallelism::Context(CpOptions {
                    fault: Some(f),
                    ..o.clone()
                })
            }),
            Parallelism::Composed(composition) => {
                return Ok(train_composed(
                    model,
                    world,
                    cfg,
                    *composition,
                    bug.cp().map(ComposedFault::Split),
                )?)
            }
            _ => None,
        };
        if let Some(planted) = planted {
            return train_parallel_planted(model, world, cfg, &planted, None);
        }
    }
    Ok(match parallelism {
        Parallelism::Ddp(options) => train_ddp(model, world.group(), cfg, options.clone())?,
        Parallelism::Fsdp {
            options,
            shard_size: None,
        } => train_fsdp(model, world.group(), cfg, options.clone())?,
        Parallelism::Fsdp {
            options,
            shard_size: Some(shard),
        } => train_fsdp_hybrid(model, world, world.group(), *shard, cfg, options.clone())?,
        Parallelism::Tensor(options) => train_tensor_parallel(model, world, cfg, options)?,
        Parallelism::Expert(options) => train_expert_parallel(model, world, cfg, options)?,
        Parallelism::Context(options) => train_context_parallel(model, world, cfg, options)?,
        Parallelism::Pipeline(options) => train_pipeline(model, world, cfg, options)?.record,
        Parallelism::Composed(composition) => {
            train_composed(model, world, cfg, *composition, None)?
        }
    })
}
