//! A composition as data, its named mesh at a world size, and the checks that refuse it
//! before any rank starts.

use super::data_parallel::{DataParallel, HybridMeshError};
use crate::context_parallel::{check_context_parallel, CpError, CpOptions};
use crate::expert_parallel::EpError;
use crate::expert_parallel::{check_expert_plan, Dispatcher, EpOptions};
use crate::pipeline::{
    plan_pipeline, PartitionMethod, PipelineError, PipelineOptions, PipelinePlan, ScheduleChoice,
    ScheduleKind,
};
use crate::tensor_parallel::{check_plan, TpError, TpOptions};
use lockstep_models::Model;

/// A bug planted in the seam between two parallelisms (checker tests only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeamFault {
    /// FSDP×TP: the gradients of TP-sharded parameters are also summed over `dp` before
    /// FSDP's reduce-scatter averages them there: reduced over `dp` twice.
    ShardedGradsReducedOverDpTwice,
    /// PP×FSDP: each stage's `REDUCE_GRAD` runs right after its first backward instead of
    /// after its last, so later microbatches' gradients never reach the shards.
    ReduceGradBeforeLastMicrobatch,
    /// EP×FSDP: the experts are sharded over `dp` with the dense parameters, so a gather
    /// assembles one expert from different ranks' experts.
    ExpertsShardedOverDp,
}

/// One composition of parallelisms. Sizes not named here (the data dimension) take the
/// rest of the world.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Composition {
    /// Tensor parallelism of size `tp` inside; the data dimension (`world / tp` ranks)
    /// outside: FSDP×TP, HSDP×TP (mesh `[dp, tp]` or `[dp_replicate, dp_shard, tp]`).
    TensorData {
        /// Tensor-parallel size.
        tp: usize,
        /// How the data dimension keeps parameters and reduces gradients.
        data: DataParallel,
    },
    /// A pipeline of `pp` ranks whose stages are tensor-parallel of size `tp` (1: none),
    /// replicated or sharded over the data dimension (`world / (pp·tp)` ranks, at least
    /// `min_data`): PP×DP, PP×TP, PP×TP×DP, PP×FSDP (mesh `[dp, pp, tp]`).
    Pipeline {
        /// Pipeline ranks.
        pp: usize,
        /// Tensor-parallel size inside each stage.
        tp: usize,
        /// Context-parallel size inside each stage (1: none; mesh `[dp, pp, cp, tp]`).
        cp: usize,
        /// Expert-parallel size inside each stage (1: experts replicated), borrowed from the
        /// stage's data group (`dp × cp`).
        ep: usize,
        /// The data dimension (under CP, sharded over `dp × cp`).
        data: DataParallel,
        /// The pipeline schedule (one stage per rank under FSDP).
        schedule: ScheduleKind,
        /// The least data-parallel size the composition is meant for (2 for PP×TP×DP).
        min_data: usize,
        /// Activation checkpointing: each stage recomputes every `k` layers in backward
        /// (between TP and FSDP in torchtitan's order); `None` keeps activations.
        checkpoint_every: Option<usize>,
    },
    /// Context parallelism of size `cp` (ring attention, load-balanced), each sequence shard
    /// tensor-parallel of size `tp` (1: none) inside it; the data dimension (`world / (cp·tp)`
    /// ranks) outside, replicated or, as torchtitan shards, one FSDP unit over `dp × cp`
    /// (mesh `[dp, cp]`, or `[dp, cp, tp]`).
    ContextData {
        /// Ranks each sequence is split over.
        cp: usize,
        /// Tensor-parallel size inside each sequence shard.
        tp: usize,
        /// Expert-parallel size (1: experts replicated): each mixture's experts spread over
        /// `ep` ranks borrowed from `dp × cp`, as torchtitan borrows them from
        /// `dp_shard × cp`.
        ep: usize,
        /// How the data dimension keeps parameters (the dense ones, under EP).
        data: DataParallel,
    },
    /// Expert parallelism of size `ep`, every rank its own batch; the dense parameters
    /// replicated or sharded over the whole world (mesh `[edp, ep]`, dense `dp` = world).
    ExpertData {
        /// Ranks each MoE layer's experts are spread over.
        ep: usize,
        /// How the dense (non-expert) parameters are kept.
        data: DataParallel,
    },
}

/// Why a composition cannot run.
#[derive(Debug, thiserror::Error)]
pub enum CompositionError {
    /// The world does not fit the mesh.
    #[error("mesh: {0}")]
    Mesh(String),
    /// The tensor-parallel plan does not fit.
    #[error(transparent)]
    Tp(Box<TpError>),
    /// The pipeline does not fit, or failed.
    #[error(transparent)]
    Pipeline(Box<PipelineError>),
    /// The expert-parallel plan does not fit, or failed.
    #[error(transparent)]
    Ep(Box<EpError>),
    /// Context parallelism does not fit, or failed.
    #[error(transparent)]
    Cp(Box<CpError>),
    /// The parallelisms cannot be composed as asked.
    #[error("composition: {0}")]
    Invalid(String),
}

impl From<HybridMeshError> for CompositionError {
    fn from(e: HybridMeshError) -> Self {
        CompositionError::Mesh(e.to_string())
    }
}

impl From<TpError> for CompositionError {
    fn from(e: TpError) -> Self {
        CompositionError::Tp(Box::new(e))
    }
}

impl From<PipelineError> for CompositionError {
    fn from(e: PipelineError) -> Self {
        CompositionError::Pipeline(Box::new(e))
    }
}

impl From<EpError> for CompositionError {
    fn from(e: EpError) -> Self {
        CompositionError::Ep(Box::new(e))
    }
}

impl From<CpError> for CompositionError {
    fn from(e: CpError) -> Self {
        CompositionError::Cp(Box::new(e))
    }
}

fn shape(dims: &[(&str, usize)]) -> String {
    let parts: Vec<String> = dims.iter().map(|(n, s)| format!("{n}={s}")).collect();
    format!("[{}]", parts.join(", "))
}

impl Composition {
    /// The named mesh at `world_size` (outermost dimension first), or why the world does not
    /// fit, naming the dimensions.
    pub fn mesh(self, world_size: usize) -> Result<Vec<(&'static str, usize)>, CompositionError> {
        let fixed = |dims: &[(&'static str, usize)]| -> Result<usize, CompositionError> {
            let product: usize = dims.iter().map(|d| d.1).product();
            if dims.iter().any(|d| d.1 == 0) || product == 0 {
                return Err(CompositionError::Mesh(format!(
                    "a dimension of {} is zero",
                    shape(dims)
                )));
            }
            if world_size == 0 || !world_size.is_multiple_of(product) {
                return Err(CompositionError::Mesh(format!(
                    "world size {world_size} does not fit the mesh {} × dp: their product \
                     {product} does not divide it",
                    shape(dims)
                )));
            }
            Ok(world_size / product)
        };
        match self {
            Composition::TensorData { tp, data } => {
                let dp = fixed(&[("tp", tp)])?;
                let mut dims = data.dims(dp)?;
                dims.push(("tp", tp));
                Ok(dims)
            }
            Composition::Pipeline {
                pp,
                tp,
                cp,
                data,
                min_data,
                ..
            } => {
                let dp = fixed(&[("pp", pp), ("cp", cp), ("tp", tp)])?;
                if dp < min_data {
                    return Err(CompositionError::Mesh(format!(
                        "world size {world_size} leaves dp={dp} beside pp={pp}, tp={tp}; this \
                         composition needs dp ≥ {min_data}"
                    )));
                }
                if matches!(data, DataParallel::HybridReplicate { .. }) {
                    return Err(CompositionError::Invalid(
                        "a pipeline's data dimension is replicated (dp), sharded (fsdp) or \
                         hybrid-sharded (hsdp)"
                            .into(),
                    ));
                }
                let mut dims = data.dims(dp)?;
                dims.push(("pp", pp));
                if cp > 1 {
                    dims.push(("cp", cp));
                }
                dims.push(("tp", tp));
                Ok(dims)
            }
            Composition::ContextData { cp, tp, ep, data } => {
                let dp = fixed(&[("cp", cp), ("tp", tp)])?;
                if ep == 0 || !(dp * cp).is_multiple_of(ep) {
                    return Err(CompositionError::Mesh(format!(
                        "ep={ep} borrows from dp × cp = {dp} × {cp} at world size \
                         {world_size}, which does not divide by it"
                    )));
                }
                if matches!(data, DataParallel::HybridReplicate { .. }) {
                    return Err(CompositionError::Invalid(
                        "the data dimension beside context parallelism is replicated (dp), \
                         sharded over dp × cp (fsdp) or hybrid-sharded (hsdp)"
                            .into(),
                    ));
                }
                let mut dims = data.dims(dp)?;
                dims.push(("cp", cp));
                if tp > 1 {
                    dims.push(("tp", tp));
                }
                Ok(dims)
            }
            Composition::ExpertData { ep, data } => {
                let edp = fixed(&[("ep", ep)])?;
                if data.is_hybrid() {
                    return Err(CompositionError::Invalid(
                        "expert parallelism's dense parameters are replicated (dp) or sharded \
                         (fsdp) over the world, not hybrid"
                            .into(),
                    ));
                }
                Ok(vec![("edp", edp), ("ep", ep)])
            }
        }
    }

    /// The sizes `(cp, tp, ep, data)` of a composition without a pipeline, which one loop
    /// trains (CP size 1: the sequence whole). A pipeline's are its stages' (`pp` aside).
    pub(crate) fn split_sizes(self) -> (usize, usize, usize, DataParallel) {
        match self {
            Composition::TensorData { tp, data } => (1, tp, 1, data),
            Composition::ContextData { cp, tp, ep, data } => (cp, tp, ep, data),
            Composition::ExpertData { ep, data } => (1, 1, ep, data),
            Composition::Pipeline {
                tp, cp, ep, data, ..
            } => (cp, tp, ep, data),
        }
    }

    /// The tensor-parallel options a composition's TP part runs with.
    pub(crate) fn tp_options(tp: usize, data: DataParallel) -> TpOptions {
        TpOptions {
            tp,
            sequence_parallel: false,
            data_parallel: data,
            fault: None,
        }
    }

    /// The context-parallel options a composition's CP part runs with (ring attention,
    /// load-balanced).
    /// At CP size 1 (TP × EP, or EP under HSDP, trained by the same loop) the sequence is
    /// one contiguous shard: no chunk count to divide.
    pub(crate) fn cp_options(cp: usize, tp: usize, ep: usize, data: DataParallel) -> CpOptions {
        let layout = match cp {
            1 => crate::context_parallel::SequenceLayout::Contiguous,
            _ => crate::context_parallel::SequenceLayout::Balanced,
        };
        CpOptions {
            tp,
            ep,
            layout,
            data_parallel: data,
            ..CpOptions::ring(cp)
        }
    }

    /// The expert-parallel options a composition's EP part runs with (all-to-all dispatch, no
    /// token dropped).
    pub(crate) fn ep_options(ep: usize, data: DataParallel) -> EpOptions {
        EpOptions {
            ep,
            dispatcher: Dispatcher::AllToAll,
            capacity_factor: None,
            data_parallel: data,
            fault: None,
        }
    }

    /// The pipeline options at `world_size` (the pipeline's own world is `pp · dp`: TP
    /// ranks of a stage run it together).
    pub(crate) fn pipeline_options(
        pp: usize,
        dp: usize,
        schedule: ScheduleKind,
        checkpoint_every: Option<usize>,
    ) -> PipelineOptions {
        PipelineOptions {
            schedule: ScheduleChoice::Builtin(schedule),
            virtual_stages: schedule.default_virtual(),
            microbatches: 2 * pp,
            partition: PartitionMethod::Uniform,
            checkpoint_every,
            data_parallel: dp,
            fault: None,
        }
    }
}

/// The part of [`check_composition`] no parallelism's own loop checks: the mesh fits the
/// world, and the model has no rank-local parameters (which no data dimension may average).
/// Every rank runs it before training; the plans are the loops' own to check.
pub(crate) fn check_mesh(
    model: &dyn Model,
    world_size: usize,
    composition: Composition,
) -> Result<Vec<(&'static str, usize)>, CompositionError> {
    let mesh = composition.mesh(world_size)?;
    if let Some(name) = model.tags().rank_local.first() {
        return Err(CompositionError::Invalid(format!(
            "`{}` has rank-local parameters (`{name}`) that no data dimension may average or \
             shard",
            model.name()
        )));
    }
    Ok(mesh)
}

/// Checks before any rank starts that `composition` can train `model` on `world_size`
/// ranks: the mesh fits, and each parallelism's plan fits the model at its size. Returns the
/// mesh; every error names the dimensions or the plan that does not fit.
pub fn check_composition(
    model: &dyn Model,
    world_size: usize,
    composition: Composition,
) -> Result<Vec<(&'static str, usize)>, CompositionError> {
    let mesh = check_mesh(model, world_size, composition)?;
    match composition {
        Composition::TensorData { tp, data } => {
            if tp > 1 {
                check_plan(model, world_size, &Composition::tp_options(tp, data))?;
            }
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
            if tp > 1 {
                crate::pipeline::stage_parallel::check_stage_tp(model)?;
                check_plan(model, world_size, &Composition::tp_options(tp, data))?;
            }
            if cp > 1 {
                let cp_opts = Composition::cp_options(cp, tp, 1, DataParallel::Replicate);
                check_context_parallel(model, world_size, &cp_opts)?;
            }
            let dp = world_size / (pp * tp * cp);
            if ep > 1 {
                // EP borrows from each stage's data group: dp_shard × cp ranks.
                let shards = dp / data.replicas().max(1);
                let opts = Composition::ep_options(ep, DataParallel::Replicate);
                let group = shards * cp;
                if !group.is_multiple_of(ep) {
                    return Err(CompositionError::Mesh(format!(
                        "ep={ep} borrows from each stage's dp_shard × cp = {shards} × {cp} \
                         ranks, which do not divide by it"
                    )));
                }
                check_expert_plan(model, group, &opts)?;
            }
            let plan = pipeline_plan(model, pp, dp, schedule, checkpoint_every)?;
            let sharded = matches!(data, DataParallel::Shard | DataParallel::HybridShard { .. });
            if sharded && plan.stages.len() != pp {
                return Err(CompositionError::Invalid(format!(
                    "PP×FSDP runs one stage per rank (each stage's parameters one sharded \
                     unit); schedule {schedule} places {} stages on {pp} ranks",
                    plan.stages.len()
                )));
            }
        }
        Composition::ExpertData { ep, data } => {
            check_expert_plan(model, world_size, &Composition::ep_options(ep, data))?;
        }
        Composition::ContextData { cp, tp, ep, data } => {
            check_context_parallel(
                model,
                world_size,
                &Composition::cp_options(cp, tp, ep, data),
            )?;
        }
    }
    Ok(mesh)
}

/// The pipeline plan of a composition's pipeline part (`pp · dp` pipeline ranks).
pub(crate) fn pipeline_plan(
    model: &dyn Model,
    pp: usize,
    dp: usize,
    schedule: ScheduleKind,
    checkpoint_every: Option<usize>,
) -> Result<PipelinePlan, CompositionError> {
    Ok(plan_pipeline(
        model,
        pp * dp,
        &Composition::pipeline_options(pp, dp, schedule, checkpoint_every),
    )?)
}
