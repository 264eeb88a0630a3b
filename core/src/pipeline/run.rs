//! Training a model through a pipeline on one rank: groups, the per-step shape handshake,
//! the schedule's actions, tied-weight and data-parallel gradient reduction, the optimizer
//! step on the parameters this rank holds, and a record comparable with any other run.

use super::dataflow::TensorMeta;
use super::edges::EdgeGroups;
use super::executor::Executor;
use super::executor::{LossFn, ShardingFn};
use super::groups::{broadcast_initial, pipeline_groups, reduce_tied_parts, PipelineMesh};
use super::microbatch;
use super::options::{PipelineFault, PipelineOptions};
use super::plan::{plan_pipeline, PipelinePlan};
use super::schedule::{Action, ActionKind};
use super::stage_parallel::{insert_sharding_actions, StageParallel, StageSplit};
use super::strategy::{handle, step_metas, PipelineStrategy, StepLoop};
use super::trace::RankStepTrace;
use super::PipelineError;
use crate::comm::{CollectiveCounts, CountingGroup, ProcessGroup, World};
use crate::compose::data::DataLayer;
use crate::compose::DataParallel;
use crate::expert_parallel::borrowed::BorrowedExperts;
use crate::fsdp::Fsdp;
use crate::record::RunRecord;
use crate::train::{parameters_device, TrainConfig};
use lockstep_models::{Batch, Model};
use std::collections::HashMap;
use std::sync::Arc;
use tch::{Device, Tensor};

/// One rank's pipeline run: the record (full model and gradients, the same on every rank)
/// and this rank's measured timeline.
#[derive(Debug)]
pub struct PipelineRun {
    /// Losses, gradients and parameters, comparable against the reference run.
    pub record: RunRecord,
    /// This rank's timeline, one entry per step.
    pub traces: Vec<RankStepTrace>,
    /// The plan that was run (stages, schedule, simulation).
    pub plan: PipelinePlan,
}

/// Trains `model` (built whole on every rank; each rank computes only its stages) through
/// the pipeline `opts` describes over `world`, for `cfg.spec.steps` steps. The objective is
/// the reference's: the mean over the world's data ranks of each rank's loss
/// (`cfg.data_ranks` is not used: replicas split the world's ranks).
pub fn train_pipeline(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &PipelineOptions,
) -> Result<PipelineRun, PipelineError> {
    train_pipeline_with(model, world, cfg, opts, StageParallel::default())
}

/// A pipeline whose stages are tensor-parallel and whose data dimension is replicated or
/// sharded ([`StageParallel`]): PP×TP, PP×TP×DP, PP×FSDP. The mesh is `[dp, pp, tp]`; the
/// pipeline itself spans `world / tp` ranks (`opts.data_parallel` replicas of it). With
/// `tp = 1` and replicated data this is [`train_pipeline`].
pub fn train_pipeline_with(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &PipelineOptions,
    within: StageParallel,
) -> Result<PipelineRun, PipelineError> {
    let world_size = world.size();
    let RankPipeline {
        plan,
        sharded,
        composed,
        counts,
        pp,
        data_group,
        replicate,
        rank,
        replica,
        tp_rank,
        tp,
        experts,
        stage_split,
        edge_groups,
        holder_groups,
        model_params,
        named,
        device,
        held,
    } = RankPipeline::new(model, world, opts, within)?;
    let stage_params = stage_parameters(model, &plan, &named);
    let data_ranks = plan.data_ranks(replica, world_size);
    let metas_by_size = probe_shapes(model, &data_ranks, plan.microbatches, stage_split.as_ref())?;
    let mut actions = rank_actions(&plan, rank, opts);
    let held_params: Vec<(String, Tensor)> = held.iter().map(|&i| handle(&named[i])).collect();
    let data = stage_data(
        &plan,
        rank,
        &mut actions,
        &held_params,
        (&data_group, replicate.as_ref()),
        opts,
        (sharded, experts.as_ref()),
    )?;
    let skip_tied = opts.fault == Some(PipelineFault::SkipTiedReduce);
    let reduce_tied = || reduce_tied_parts(&plan, &held, &named, &holder_groups, skip_tied);
    let sharding = |action: &Action| apply_sharding(action, &data, &reduce_tied);
    let loss_fn = stage_split
        .as_ref()
        .map(|s| move |batch: &Batch, output: &Tensor| s.loss(model, batch, output));
    let executor = Executor {
        compute: stage_split.as_ref().map(|s| &s.hooks),
        loss: loss_fn.as_ref().map(|f| f as &LossFn<'_>),
        sharding: data.unit().map(|_| &sharding as &ShardingFn<'_>),
        ..stage_executor(
            model,
            &plan,
            rank,
            device,
            &edge_groups,
            &stage_params,
            opts,
        )
    };
    let tp_part = tp_coordinate_part(stage_split.is_some() && tp > 1, tp_rank, tp);
    let steps = StepLoop {
        model,
        plan: &plan,
        opts,
        executor: &executor,
        actions: &actions,
        named: &named,
        held: &held,
        held_params: &held_params,
        data: &data,
        pp: pp.as_ref(),
        dp: data_group.as_ref(),
        replicate: replicate.as_deref(),
        edge_groups: &edge_groups,
        counts: &counts,
        data_ranks: &data_ranks,
        rank,
        device,
        global_rank: world.rank(),
        sharded,
        composed,
        reduce_tied: &reduce_tied,
        model_params: &model_params,
        stage_split: stage_split.as_ref(),
        experts: experts.as_ref(),
        tp_part: &tp_part,
    };
    let (mut record, traces) = PipelineStrategy::new(steps, metas_by_size).train(cfg)?;
    record.placements = placement_table(&plan, &stage_params, stage_split.as_ref(), sharded);
    place_experts(&mut record.placements, experts.as_ref());
    Ok(PipelineRun {
        record,
        traces,
        plan,
    })
}

/// One rank's pipeline as it stands before training: its plan, its groups (each counted), what
/// splits its stage, and the tensors it holds and trains.
struct RankPipeline {
    plan: PipelinePlan,
    /// The data dimension shards the stage's parameters (PP×FSDP).
    sharded: bool,
    /// Anything beside the pipeline (TP, CP, EP or a sharded data dimension).
    composed: bool,
    counts: CollectiveCounts,
    pp: Arc<dyn ProcessGroup>,
    data_group: Arc<dyn ProcessGroup>,
    replicate: Option<Arc<dyn ProcessGroup>>,
    /// This rank's stage rank, its pipeline replica, and its TP coordinate of `tp`.
    rank: usize,
    replica: usize,
    tp_rank: usize,
    tp: usize,
    experts: Option<BorrowedExperts>,
    stage_split: Option<StageSplit>,
    edge_groups: EdgeGroups,
    holder_groups: std::collections::BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
    /// The model's own parameters, and the tensors this rank computes with (its TP shards
    /// where a plan splits them), on `device`.
    model_params: Vec<(String, Tensor)>,
    named: Vec<(String, Tensor)>,
    device: Device,
    /// Which of `named` this rank trains: its stage's, under EP its own experts only.
    held: Vec<usize>,
}

impl RankPipeline {
    /// Plans the pipeline on `world`, builds its mesh's groups and the stage's split, and
    /// gives every stage its initial parameters from their first holder.
    fn new(
        model: &dyn Model,
        world: &World,
        opts: &PipelineOptions,
        within: StageParallel,
    ) -> Result<RankPipeline, PipelineError> {
        let world_size = world.size();
        let tp = within.tp.max(1);
        let cp = within.cp.max(1);
        let (plan, sharded) = plan_within(model, world_size, opts, within)?;
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let ep = within.ep.max(1);
        let composed = tp > 1 || cp > 1 || ep > 1 || sharded;
        let PipelineMesh {
            pp,
            dp: dpg,
            data: data_group,
            replicate,
            tp: tpg,
            cp: cpg,
            rank,
            replica,
            tp_rank,
            cp_rank,
            experts: expert_groups,
        } = PipelineMesh::new(world, &plan, tp, cp, within.data.replicas(), ep, &counted)?;
        let experts = match expert_groups {
            Some((group, holders)) => Some(pipeline_experts(
                model,
                (group, holders),
                (&data_group, replicate.as_ref()),
                opts,
                &within,
                world_size,
            )?),
            None => None,
        };
        let stage_split = stage_split(
            model,
            world,
            (tpg.as_ref(), tp_rank),
            (cpg.as_ref(), cp_rank),
            experts.as_ref(),
            within.cp_fault,
        )?;
        let (edge_groups, holder_groups) = pipeline_groups(world, &plan, cp * tp, &counted)?;
        // The tensors this rank computes with: the model's own, or its TP shards.
        let model_params = model.named_parameters();
        let local = stage_split.as_ref().map_or(&model_params, |s| &s.local);
        let named: Vec<(String, Tensor)> = local.iter().map(handle).collect();
        // Where this rank computes: every buffer it creates (handshakes, tokens, the loss and
        // norm scalars, the record's gathers) goes there, as its groups take tensors on it.
        let device = parameters_device(&named)?;
        let stage_held = held_by(&plan, rank, named.len());
        // Each stage's EP group assembles its own experts only.
        let experts = experts.map(|e| e.within(stage_held.iter().map(|&i| named[i].0.clone())));
        let replicas = (plan.data_parallel > 1).then_some(dpg.as_ref());
        broadcast_initial(&plan, &named, &stage_held, &holder_groups, replicas)?;
        // Under EP this rank trains its stage's dense parameters and its own experts.
        let held: Vec<usize> = stage_held
            .into_iter()
            .filter(|&i| experts.as_ref().is_none_or(|e| e.holds(&named[i].0)))
            .collect();

        Ok(RankPipeline {
            plan,
            sharded,
            composed,
            counts,
            pp,
            data_group,
            replicate,
            rank,
            replica,
            tp_rank,
            tp,
            experts,
            stage_split,
            edge_groups,
            holder_groups,
            model_params,
            named,
            device,
            held,
        })
    }
}

/// PP × EP: this stage's experts spread over `group`, each one's gradient summed over its
/// `holders` and averaged like every other gradient (over the data group and HSDP's
/// replicas; planted faults scale it otherwise).
fn pipeline_experts(
    model: &dyn Model,
    (group, holders): (Arc<dyn ProcessGroup>, Arc<dyn ProcessGroup>),
    (data_group, replicate): (&Arc<dyn ProcessGroup>, Option<&Arc<dyn ProcessGroup>>),
    opts: &PipelineOptions,
    within: &StageParallel,
    world_size: usize,
) -> Result<BorrowedExperts, PipelineError> {
    let ep = within.ep.max(1);
    let averaged = match opts.fault {
        Some(PipelineFault::ExpertGradsScaledByWorld) => world_size,
        _ => data_group.size() * replicate.map_or(1, |r| r.size()),
    };
    let count = expert_count(model, data_group.size(), ep)?;
    // Planted (a field bug): each expert's gradient counted once per EP rank.
    let counted_per_ep_rank = match within.cp_fault {
        Some(crate::context_parallel::CpFault::ExpertGradsPerEpRank) => ep as f64,
        _ => 1.0,
    };
    Ok(BorrowedExperts::new(
        model,
        group,
        holders,
        count,
        counted_per_ep_rank / averaged as f64,
    ))
}

/// What splits this rank's stage (TP on `tp`'s group, CP on `cp`'s, EP's dispatch), or none
/// when nothing does. EP without TP runs the plan's other rules on a group of this rank alone.
fn stage_split(
    model: &dyn Model,
    world: &World,
    (tpg, tp_rank): (Option<&Arc<dyn ProcessGroup>>, usize),
    (cpg, cp_rank): (Option<&Arc<dyn ProcessGroup>>, usize),
    experts: Option<&BorrowedExperts>,
    cp_fault: Option<crate::context_parallel::CpFault>,
) -> Result<Option<StageSplit>, PipelineError> {
    if tpg.is_none() && cpg.is_none() && experts.is_none() {
        return Ok(None);
    }
    let alone = match (experts, tpg) {
        (Some(_), None) => {
            let singles: Vec<Vec<usize>> = (0..world.size()).map(|r| vec![r]).collect();
            world.new_groups(&singles, "pp-ep-self")?
        }
        _ => None,
    };
    let dispatch = match experts {
        Some(e) => match alone.or_else(|| tpg.cloned()) {
            Some(group) => Some((e.dispatch(), group)),
            None => {
                return Err(PipelineError::InvalidPlan(
                    "PP×EP: no group for the plan's other rules".into(),
                ))
            }
        },
        None => None,
    };
    Ok(Some(StageSplit::new(
        model,
        world.size(),
        tpg.cloned().map(|g| (g, tp_rank)),
        cpg.cloned().map(|g| (g, cp_rank)),
        cp_fault,
        dispatch,
    )?))
}

/// Each expert's placement in the record: the stage it belongs to, then where its EP group
/// keeps it.
fn place_experts(
    placements: &mut [crate::record::TensorPlacement],
    experts: Option<&BorrowedExperts>,
) {
    let Some(experts) = experts else {
        return;
    };
    for p in placements {
        if let Some(text) = experts.placement(&p.tensor) {
            let stage = p.placement.split(", ").next().unwrap_or_default();
            p.placement = format!("{stage}, {text}");
        }
    }
}

/// The experts of each of `model`'s mixtures, checked to divide over `ep` ranks of a data
/// group of `data` ranks, which must divide by it too.
fn expert_count(model: &dyn Model, data: usize, ep: usize) -> Result<usize, PipelineError> {
    if !data.is_multiple_of(ep) {
        return Err(PipelineError::InvalidPlan(format!(
            "ep={ep} borrows from each stage's data group of {data} ranks (dp × cp), which do \
             not divide by it"
        )));
    }
    let opts = crate::compose::Composition::ep_options(ep, DataParallel::Replicate);
    let (_, experts) = crate::expert_parallel::check_expert_plan(model, data, &opts)
        .map_err(|e| PipelineError::InvalidPlan(format!("PP×EP: {e}")))?;
    Ok(experts)
}

/// The tensor-parallel part of a stage's shard coordinates (`tp0/2.`), empty when the stages
/// are not split.
fn tp_coordinate_part(split: bool, tp_rank: usize, tp: usize) -> String {
    match split {
        true => format!("tp{tp_rank}/{tp}."),
        false => String::new(),
    }
}

/// The indices of the parameters this rank's stages hold.
fn held_by(plan: &PipelinePlan, rank: usize, count: usize) -> Vec<usize> {
    (0..count)
        .filter(|&i| plan.holders[i].contains(&rank))
        .collect()
}

/// The data dimension over the held parameters: replicated, or (PP×FSDP) this rank's
/// stage's parameters as one unit sharded over dp, driven by the schedule's actions (which
/// gain its unshard, reshard and reduce steps).
fn stage_data(
    plan: &PipelinePlan,
    rank: usize,
    actions: &mut Vec<Action>,
    held_params: &[(String, Tensor)],
    groups: (&Arc<dyn ProcessGroup>, Option<&Arc<dyn ProcessGroup>>),
    opts: &PipelineOptions,
    (sharded, experts): (bool, Option<&BorrowedExperts>),
) -> Result<DataLayer, PipelineError> {
    let data = match sharded {
        true => {
            // Experts stay whole on their ranks beside the unit (their data dimension is
            // their holders).
            let expert = |n: &str| experts.is_some_and(|e| e.is_expert(n));
            let (whole, dense): (Vec<_>, Vec<_>) =
                held_params.iter().map(handle).partition(|(n, _)| expert(n));
            let unit = stage_unit(plan, rank, actions, &dense, groups, opts)?;
            DataLayer::new(Some(unit), whole)
        }
        false => DataLayer::new(None, held_params.iter().map(handle).collect()),
    };
    Ok(data.freed_by_schedule())
}

/// Every microbatch shape's activations, probed before any parameter is sharded (a probe runs
/// the model's own forward).
fn probe_shapes(
    model: &dyn Model,
    data_ranks: &[usize],
    microbatches: usize,
    split: Option<&StageSplit>,
) -> Result<HashMap<Vec<i64>, Arc<Vec<TensorMeta>>>, PipelineError> {
    let mut metas_by_size = HashMap::new();
    let first = microbatch::split(model, data_ranks, 0, microbatches)?;
    let batches = match split {
        Some(s) => first
            .batches
            .into_iter()
            .map(|b| s.cut(b))
            .collect::<Result<Vec<_>, _>>()?,
        None => first.batches,
    };
    step_metas(model, &batches, &mut metas_by_size, false, 0)?;
    Ok(metas_by_size)
}

/// This rank's actions of the schedule (less the one a planted fault drops).
fn rank_actions(plan: &PipelinePlan, rank: usize, opts: &PipelineOptions) -> Vec<Action> {
    let mut actions: Vec<Action> = plan.schedule.actions[rank].clone();
    if let Some(PipelineFault::DropAction(label)) = &opts.fault {
        actions.retain(|a| a.to_string() != *label);
    }
    actions
}

/// What one of FSDP's schedule actions (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`) does to the
/// stage's unit under PP×FSDP; nothing without one.
fn apply_sharding(
    action: &Action,
    data: &DataLayer,
    reduce_tied: &dyn Fn() -> Result<(), PipelineError>,
) -> Result<(), PipelineError> {
    let Some(unit) = data.unit() else {
        return Ok(());
    };
    let mut unit = unit.borrow_mut();
    match action.kind {
        ActionKind::Unshard => unit.unshard()?,
        ActionKind::Reshard => unit.reshard()?,
        ActionKind::ReduceGrad => {
            // In DDP's order: tied parts summed across stages, then averaged over dp.
            reduce_tied()?;
            unit.reduce_gradients()?;
        }
        _ => {}
    }
    Ok(())
}

/// The executor of this rank's stages, with the model computing its own layers and loss and
/// no sharding actions (the caller sets those under TP and FSDP).
fn stage_executor<'a>(
    model: &'a dyn Model,
    plan: &'a PipelinePlan,
    rank: usize,
    device: Device,
    edge_groups: &'a EdgeGroups,
    stage_params: &'a [Vec<(usize, Tensor)>],
    opts: &PipelineOptions,
) -> Executor<'a> {
    Executor {
        model,
        flow: &plan.flow,
        deps: &plan.dataflow.deps,
        output_deps: &plan.dataflow.output_deps,
        stage_ranks: &plan.stage_ranks,
        rank,
        device,
        edge_groups,
        stage_params,
        checkpoint_every: opts.checkpoint_every,
        unscaled_loss: opts.fault == Some(PipelineFault::UnscaledLoss),
        swap_first_microbatches: opts.fault == Some(PipelineFault::SwapMicrobatches),
        overwrite_boundary_grads: opts.fault == Some(PipelineFault::OverwriteSavedBoundaryGrad),
        compute: None,
        loss: None,
        sharding: None,
    }
}

/// Where every parameter lived, for the record (and so the report): the stages that use it
/// and their pipeline ranks (a tied weight on several, its gradient parts summed), its
/// split under the stages' TP plan, and how the pipeline's replicas hold it.
fn placement_table(
    plan: &PipelinePlan,
    stage_params: &[Vec<(usize, Tensor)>],
    stage_split: Option<&StageSplit>,
    sharded: bool,
) -> Vec<crate::record::TensorPlacement> {
    let dp = plan.data_parallel;
    plan.params
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let stages: Vec<String> = (0..plan.stages.len())
                .filter(|&s| stage_params[s].iter().any(|(j, _)| *j == i))
                .map(|s| format!("stage {s} (pipeline rank {})", plan.stage_ranks[s]))
                .collect();
            let mut placement = match stages.len() {
                1 => stages.join(""),
                _ => format!("tied: {}, gradient parts summed", stages.join(", ")),
            };
            if let Some(tp) = stage_split.filter(|s| s.splits()) {
                placement.push_str(&format!(", {}", tp.placement_text(name)));
            }
            match (dp, sharded) {
                (1, _) => {}
                (_, true) => placement.push_str(&format!(", sharded over dp={dp}")),
                (_, false) => placement.push_str(&format!(", replicated over dp={dp}")),
            }
            crate::record::TensorPlacement {
                tensor: name.clone(),
                placement,
            }
        })
        .collect()
}

/// The plan of a pipeline whose stages are `within.tp`-way tensor parallel over
/// `world_size` ranks, and whether its replicas are sharded (PP×FSDP, one stage per rank).
fn plan_within(
    model: &dyn Model,
    world_size: usize,
    opts: &PipelineOptions,
    within: StageParallel,
) -> Result<(PipelinePlan, bool), PipelineError> {
    let tp = within.tp.max(1);
    let cp = within.cp.max(1);
    if !world_size.is_multiple_of(tp * cp) {
        return Err(PipelineError::InvalidPlan(format!(
            "cp={cp} × tp={tp} inside the stages does not divide world size {world_size}"
        )));
    }
    let plan = plan_pipeline(model, world_size / (tp * cp), opts)?;
    let sharded = match within.data {
        DataParallel::Replicate => false,
        DataParallel::Shard => true,
        DataParallel::HybridShard { replicas } => {
            if replicas == 0 || !plan.data_parallel.is_multiple_of(replicas) {
                return Err(PipelineError::InvalidPlan(format!(
                    "HSDP needs {replicas} replicas of equal shard groups; the pipeline has {} \
                     data-parallel copies",
                    plan.data_parallel
                )));
            }
            true
        }
        DataParallel::HybridReplicate { .. } => {
            return Err(PipelineError::InvalidPlan(
                "a pipeline's replicas are replicated, sharded or hybrid-sharded, not \
                 replicated in hybrid order"
                    .into(),
            ))
        }
    };
    if sharded && plan.stages.len() != plan.ranks {
        return Err(PipelineError::InvalidPlan(format!(
            "PP×FSDP runs one stage per rank; this schedule places {} stages on {} ranks",
            plan.stages.len(),
            plan.ranks
        )));
    }
    Ok((plan, sharded))
}

/// PP×FSDP: this rank's stage's parameters as one unit sharded over the replicas, and the
/// schedule's actions extended with its unshard/reshard/reduce steps.
fn stage_unit(
    plan: &PipelinePlan,
    rank: usize,
    actions: &mut Vec<Action>,
    held_params: &[(String, Tensor)],
    (shard, replicate): (&Arc<dyn ProcessGroup>, Option<&Arc<dyn ProcessGroup>>),
    opts: &PipelineOptions,
) -> Result<Fsdp, PipelineError> {
    let stage = plan
        .stage_ranks
        .iter()
        .position(|&r| r == rank)
        .unwrap_or(0);
    insert_sharding_actions(
        actions,
        stage,
        opts.fault == Some(PipelineFault::ReduceGradBeforeLastMicrobatch),
    );
    let params = held_params
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    Ok(Fsdp::over_tensors(
        &format!("stage{stage}"),
        params,
        shard.clone(),
        replicate.cloned(),
    )?)
}

/// Each stage's parameters (index into `named`, tensor): those its layers list, plus those
/// no layer lists (used by code between layers: every stage that runs that code adds its
/// part).
fn stage_parameters(
    model: &dyn Model,
    plan: &PipelinePlan,
    named: &[(String, Tensor)],
) -> Vec<Vec<(usize, Tensor)>> {
    let layers = model.layers();
    let tags = model.tags();
    let index_of: HashMap<&str, usize> = named
        .iter()
        .enumerate()
        .map(|(i, (n, _))| (n.as_str(), i))
        .collect();
    let listed: std::collections::HashSet<&str> = layers
        .iter()
        .flat_map(|l| l.params.iter().map(|q| tags.canonical(q)))
        .collect();
    let free: Vec<usize> = (0..named.len())
        .filter(|&i| !listed.contains(named[i].0.as_str()))
        .collect();
    plan.stages
        .iter()
        .map(|r| {
            let mut ids: Vec<usize> = r
                .clone()
                .flat_map(|l| layers[l].params.iter())
                .filter_map(|q| index_of.get(tags.canonical(q)).copied())
                .chain(free.iter().copied())
                .collect();
            ids.sort_unstable();
            ids.dedup();
            ids.into_iter()
                .map(|i| (i, named[i].1.shallow_clone()))
                .collect()
        })
        .collect()
}
