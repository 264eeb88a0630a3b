//! Training a model through a pipeline on one rank: groups, the per-step shape handshake,
//! the schedule's actions, tied-weight and data-parallel gradient reduction, the optimizer
//! step on the parameters this rank holds, and a record comparable with any other run.

use super::dataflow::{probe, TensorMeta};
use super::executor::{Executor, StepData};
use super::executor::{LossFn, ShardingFn};
use super::handshake::handshake;
use super::microbatch;
use super::options::{PipelineFault, PipelineOptions};
use super::plan::{plan_pipeline, PipelinePlan};
use super::schedule::{Action, ActionKind};
use super::stage_parallel::{full_values, insert_sharding_actions, StageParallel, StageTp};
use super::trace::RankStepTrace;
use super::PipelineError;
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::compose::data::DataLayer;
use crate::compose::DataParallel;
use crate::consistency::{StateKind, StateProbe};
use crate::fsdp::Fsdp;
use crate::record::{CollectiveEntry, RunRecord};
use crate::train::{
    parameters_device, train_from, GradientView, Optimizer, StepHooks, StepLoss, TrainConfig,
    TrainError, TrainStart,
};
use lockstep_models::{Batch, Model};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

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
    let tp = within.tp.max(1);
    let (plan, sharded) = plan_within(model, world_size, opts, within)?;
    let counts = CollectiveCounts::new();
    let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
        Arc::new(CountingGroup::new(g, counts.clone()))
    };
    let composed = tp > 1 || sharded;
    let PipelineMesh {
        pp,
        dp: dpg,
        tp: tpg,
        rank,
        replica,
        tp_rank,
    } = PipelineMesh::new(world, &plan, tp, &counted)?;
    let (edge_groups, holder_groups) = pipeline_groups(world, &plan, tp, &counted)?;
    // The tensors this rank computes with: the model's own, or its TP shards.
    let model_params = model.named_parameters();
    let stage_tp = match &tpg {
        Some(group) => Some(StageTp::new(model, world_size, tp, tp_rank, group.clone())?),
        None => None,
    };
    let local = stage_tp.as_ref().map_or(&model_params, |s| &s.local);
    let named: Vec<(String, Tensor)> = local.iter().map(handle).collect();
    // Where this rank computes: every buffer it creates (handshakes, tokens, the loss and
    // norm scalars, the record's gathers) goes there, as its groups take tensors on it.
    let device = parameters_device(&named)?;
    let held = held_by(&plan, rank, named.len());
    let replicas = (plan.data_parallel > 1).then_some(dpg.as_ref());
    broadcast_initial(&plan, &named, &held, &holder_groups, replicas)?;

    let stage_params = stage_parameters(model, &plan, &named);
    let data_ranks = plan.data_ranks(replica, world_size);
    let metas_by_size = probe_shapes(model, &data_ranks, plan.microbatches)?;
    let mut actions = rank_actions(&plan, rank, opts);
    let held_params: Vec<(String, Tensor)> = held.iter().map(|&i| handle(&named[i])).collect();
    let data = stage_data(&plan, rank, &mut actions, &held_params, &dpg, opts, sharded)?;
    let skip_tied = opts.fault == Some(PipelineFault::SkipTiedReduce);
    let reduce_tied = || reduce_tied_parts(&plan, &held, &named, &holder_groups, skip_tied);
    let sharding = |action: &Action| apply_sharding(action, &data, &reduce_tied);
    let loss_fn = stage_tp
        .as_ref()
        .map(|s| move |batch: &Batch, output: &Tensor| s.loss(model, batch, output));
    let executor = Executor {
        compute: stage_tp.as_ref().map(|s| &s.hooks),
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
    let tp_part = tp_coordinate_part(stage_tp.is_some() && tp > 1, tp_rank, tp);
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
        dp: dpg.as_ref(),
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
        stage_tp: stage_tp.as_ref(),
        tp_part: &tp_part,
    };
    let (mut record, traces) = PipelineStrategy::new(steps, metas_by_size).train(cfg)?;
    record.placements = placement_table(&plan, &stage_params, stage_tp.as_ref(), sharded);
    Ok(PipelineRun {
        record,
        traces,
        plan,
    })
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
    dp: &Arc<dyn ProcessGroup>,
    opts: &PipelineOptions,
    sharded: bool,
) -> Result<DataLayer, PipelineError> {
    let data = match sharded {
        true => {
            let unit = stage_unit(plan, rank, actions, held_params, dp, opts)?;
            DataLayer::new(Some(unit), Vec::new())
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
) -> Result<HashMap<Vec<i64>, Arc<Vec<TensorMeta>>>, PipelineError> {
    let mut metas_by_size = HashMap::new();
    let first = microbatch::split(model, data_ranks, 0, microbatches)?;
    step_metas(model, &first.batches, &mut metas_by_size, false, 0)?;
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
    edge_groups: &'a HashMap<(usize, usize), Arc<dyn ProcessGroup>>,
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
    stage_tp: Option<&StageTp>,
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
            if let Some(tp) = stage_tp.filter(|s| s.group_size() > 1) {
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

/// Tied weights: every holder of each held tied weight ends with the sum of every holder's
/// part of its gradient (nothing with the planted `skip` fault).
fn reduce_tied_parts(
    plan: &PipelinePlan,
    held: &[usize],
    named: &[(String, Tensor)],
    holder_groups: &BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
    skip: bool,
) -> Result<(), PipelineError> {
    for &i in held {
        let (name, t) = &named[i];
        let g = grad_or_zeros(t)?;
        if let Some(group) = holder_groups.get(&holder_set(plan, i)).filter(|_| !skip) {
            group
                .all_reduce(&g, ReduceOp::Sum)
                .map_err(|e| PipelineError::Execution(format!("reducing tied `{name}`: {e}")))?;
        }
    }
    Ok(())
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
    if !world_size.is_multiple_of(tp) {
        return Err(PipelineError::InvalidPlan(format!(
            "tensor-parallel size {tp} does not divide world size {world_size}"
        )));
    }
    let plan = plan_pipeline(model, world_size / tp, opts)?;
    let sharded = match within.data {
        DataParallel::Replicate => false,
        DataParallel::Shard => true,
        DataParallel::HybridShard { .. } | DataParallel::HybridReplicate { .. } => {
            return Err(PipelineError::InvalidPlan(
                "a pipeline's replicas are replicated or sharded, not hybrid-sharded".into(),
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

/// What one pipeline rank's steps work with, set up once by [`train_pipeline_with`].
struct StepLoop<'a> {
    model: &'a dyn Model,
    plan: &'a PipelinePlan,
    opts: &'a PipelineOptions,
    executor: &'a Executor<'a>,
    actions: &'a [Action],
    named: &'a [(String, Tensor)],
    held: &'a [usize],
    held_params: &'a [(String, Tensor)],
    /// The data dimension over the held parameters: replicated, or (PP×FSDP) the stage's
    /// unit, which the schedule's actions drive.
    data: &'a DataLayer,
    pp: &'a dyn ProcessGroup,
    dp: &'a dyn ProcessGroup,
    edge_groups: &'a HashMap<(usize, usize), Arc<dyn ProcessGroup>>,
    counts: &'a CollectiveCounts,
    data_ranks: &'a [usize],
    rank: usize,
    /// The parameters' device, where every tensor this rank creates lives.
    device: Device,
    global_rank: usize,
    sharded: bool,
    composed: bool,
    reduce_tied: &'a dyn Fn() -> Result<(), PipelineError>,
    model_params: &'a [(String, Tensor)],
    stage_tp: Option<&'a StageTp>,
    tp_part: &'a str,
}

impl StepLoop<'_> {
    /// The record's view: every parameter's value (data or gradient) at full size on every
    /// rank (gathered over dp and tp when composed, then from its owning stage).
    fn recorded(
        &self,
        value: &dyn Fn(&Tensor) -> Tensor,
    ) -> Result<Vec<(String, Tensor)>, PipelineError> {
        let full = full_values(
            self.named,
            self.model_params,
            self.data.unit(),
            self.stage_tp,
            value,
        )?;
        gather_owned(self.plan, self.rank, self.pp, &full, self.device)
    }

    /// Which copy of `name` this rank holds: tied copies keep one name on every stage that
    /// holds them, so they compare; TP shards say which shard they are.
    fn tp_coord(&self, name: &str) -> String {
        self.stage_tp.map_or(String::new(), |s| s.coordinate(name))
    }
}

/// A pipeline rank as a strategy of the one training loop: its executor runs the schedule
/// (forward and backward of every microbatch) in place of the loop's forward and backward;
/// the loop's setup, gradient record, clipping, optimizer step, state check and record tail
/// are every parallelism's.
struct PipelineStrategy<'a> {
    steps: StepLoop<'a>,
    /// The shapes of each microbatch size's activations, probed once.
    metas_by_size: HashMap<Vec<i64>, Arc<Vec<TensorMeta>>>,
    /// This rank's timeline, one entry per step.
    traces: Vec<RankStepTrace>,
    /// The f64 buffer the gradient norm squares into, kept across steps (owned_grad_norm).
    norm_scratch: Option<Tensor>,
    /// The full parameters, gathered before the stage's unit is gathered again for the model.
    final_params: Option<Vec<(String, Tensor)>>,
}

impl<'a> PipelineStrategy<'a> {
    fn new(
        steps: StepLoop<'a>,
        metas_by_size: HashMap<Vec<i64>, Arc<Vec<TensorMeta>>>,
    ) -> PipelineStrategy<'a> {
        PipelineStrategy {
            steps,
            metas_by_size,
            traces: Vec::new(),
            norm_scratch: None,
            final_params: None,
        }
    }

    /// Runs the one training loop with this rank's pipeline as its strategy: the record and
    /// this rank's timeline.
    fn train(
        mut self,
        cfg: &TrainConfig,
    ) -> Result<(RunRecord, Vec<RankStepTrace>), PipelineError> {
        let model = self.steps.model;
        let (record, _) = train_from(model, cfg, &mut self, None, &TrainStart::default())
            .map_err(TrainError::into_strategy::<PipelineError>)?;
        Ok((record, self.traces))
    }
}

/// A named tensor's handle (the same storage, a new name string).
fn handle((name, t): &(String, Tensor)) -> (String, Tensor) {
    (name.clone(), t.shallow_clone())
}

impl StepHooks for PipelineStrategy<'_> {
    fn parameters(&self, _model: &dyn Model) -> Vec<(String, Tensor)> {
        self.steps.named.iter().map(handle).collect()
    }

    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        let _ = self.steps.counts.take();
        Ok(())
    }

    fn forward_backward(
        &mut self,
        _model: &dyn Model,
        _data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let s = &self.steps;
        let mut run = || -> Result<f64, PipelineError> {
            let split = microbatch::split(s.model, s.data_ranks, step, s.plan.microbatches)?;
            let metas = step_metas(
                s.model,
                &split.batches,
                &mut self.metas_by_size,
                s.sharded,
                step,
            )?;
            handshake(
                s.plan,
                s.rank,
                s.edge_groups,
                &metas[0],
                s.device,
                s.opts.fault == Some(PipelineFault::WrongShape),
            )?;
            let data = StepData {
                batches: split.batches,
                scales: split.scales,
                metas,
            };
            let outcome = s.executor.run_step(s.actions, &data)?;
            self.traces.push(RankStepTrace {
                rank: s.global_rank,
                step,
                events: outcome.events,
            });
            Ok(outcome.objective)
        };
        Ok(StepLoss {
            value: run().map_err(TrainError::strategy)?,
            device: s.device,
        })
    }

    fn local_gradients(
        &mut self,
        _params: &[(String, Tensor)],
        _step: usize,
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        // A stage holds some parameters (and under PP×FSDP its unit frees them): reduced
        // where they live by `sync_gradients`, seen by the record through `gradient_view`.
        Ok(Vec::new())
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        let s = &self.steps;
        let sync = || -> Result<(), PipelineError> {
            if !s.sharded {
                (s.reduce_tied)()?;
            }
            if s.plan.data_parallel > 1 && !s.held.is_empty() && !s.sharded {
                let grads: Vec<Tensor> = s.held.iter().map(|&i| s.named[i].1.grad()).collect();
                average_flat(&grads, s.dp)?;
            }
            Ok(())
        };
        sync().map_err(TrainError::strategy)
    }

    fn step_collectives(&mut self) -> Option<Vec<CollectiveEntry>> {
        Some(CollectiveEntry::from_counts(self.steps.counts.take()))
    }

    fn mean_loss(
        &mut self,
        local: StepLoss,
        _metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        // Each stage holding the last one contributes its microbatches' losses.
        let loss = Tensor::from_slice(&[local.value]).f_to_device(local.device)?;
        self.steps.pp.all_reduce(&loss, ReduceOp::Sum)?;
        if self.steps.plan.data_parallel > 1 {
            self.steps.dp.all_reduce(&loss, ReduceOp::Avg)?;
        }
        Ok(loss.f_double_value(&[0])?)
    }

    fn gradient_view(
        &mut self,
        _grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<GradientView, TrainError> {
        let s = &self.steps;
        if s.composed || keep {
            let full = s
                .recorded(&|t: &Tensor| t.grad())
                .map_err(TrainError::strategy)?;
            return GradientView::of_full(full, keep);
        }
        // Only the norm is recorded: computed by the owners, without gathering.
        let norm = owned_grad_norm(
            s.plan,
            s.rank,
            s.pp,
            s.named,
            s.device,
            &mut self.norm_scratch,
        )
        .map_err(TrainError::strategy)?;
        Ok(GradientView { norm, full: None })
    }

    fn clip_gradients(
        &mut self,
        max_norm: f64,
        total: f64,
        _grads: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        self.steps.data.clip(max_norm, total)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        self.steps.data.step(optimizer)
    }

    fn observe_state(
        &mut self,
        step: usize,
        _params: &[(String, Tensor)],
        optimizer: &dyn Optimizer,
        _rank_local: &dyn Fn(&str) -> bool,
        probe: &StateProbe,
    ) -> Result<(), TrainError> {
        let s = &self.steps;
        s.data.observe(
            probe,
            step,
            optimizer,
            &|name: &str| s.tp_coord(name),
            s.tp_part,
        )
    }

    fn before_record(&mut self) -> Result<(), TrainError> {
        let _ = self.steps.counts.take();
        let params = tch::no_grad(|| self.steps.recorded(&Tensor::shallow_clone))
            .map_err(TrainError::strategy)?;
        self.final_params = Some(params);
        // The model holds its trained stage again for whoever reads it next.
        self.steps.data.gather()
    }

    fn observe_final(&mut self, steps: usize, probe: &StateProbe) -> Result<(), TrainError> {
        let s = &self.steps;
        let coord = |name: &str| s.tp_coord(name);
        Ok(probe.observe_all(steps, StateKind::Final, s.held_params, &coord)?)
    }

    fn full_parameters(
        &mut self,
        _params: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        self.final_params
            .take()
            .ok_or_else(|| TrainError::InvalidConfig("the pipeline's record tail ran twice".into()))
    }
}

/// A tied weight starts from its lowest holder's value; replicas (`replicas`, when the
/// pipeline has several) from replica 0's.
fn broadcast_initial(
    plan: &PipelinePlan,
    named: &[(String, Tensor)],
    held: &[usize],
    holder_groups: &BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
    replicas: Option<&dyn ProcessGroup>,
) -> Result<(), PipelineError> {
    let _guard = tch::no_grad_guard();
    for &i in held {
        if let Some(g) = holder_groups.get(&holder_set(plan, i)) {
            g.broadcast(&named[i].1, 0)?;
        }
    }
    if let Some(group) = replicas {
        for &i in held {
            group.broadcast(&named[i].1, 0)?;
        }
    }
    Ok(())
}

/// The ranks holding parameter `i` (several for a tied weight), as its group's key.
fn holder_set(plan: &PipelinePlan, i: usize) -> Vec<usize> {
    plan.holders[i].iter().copied().collect()
}

/// `t`'s gradient, set to zeros first when this stage's backward left it undefined (a tied
/// copy the stage did not use this step), so every holder takes part in the reduction.
fn grad_or_zeros(t: &Tensor) -> Result<Tensor, PipelineError> {
    let g = t.grad();
    if g.defined() {
        return Ok(g);
    }
    let zeros = t.f_zeros_like()?;
    crate::autograd::set_grad(t, Some(&zeros))?;
    Ok(zeros)
}

/// PP×FSDP: this rank's stage's parameters as one unit sharded over the replicas, and the
/// schedule's actions extended with its unshard/reshard/reduce steps.
fn stage_unit(
    plan: &PipelinePlan,
    rank: usize,
    actions: &mut Vec<Action>,
    held_params: &[(String, Tensor)],
    dp: &Arc<dyn ProcessGroup>,
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
        dp.clone(),
        None,
    )?)
}

/// The pipeline's groups on this rank: the stage-to-stage one (`pp`), the replicas' (`dp`),
/// the stage's tensor-parallel one when `tp > 1`, and this rank's coordinates.
struct PipelineMesh {
    pp: Arc<dyn ProcessGroup>,
    dp: Arc<dyn ProcessGroup>,
    tp: Option<Arc<dyn ProcessGroup>>,
    rank: usize,
    replica: usize,
    tp_rank: usize,
}

impl PipelineMesh {
    /// `[dp, pp, tp]` over `world` (a plain pipeline keeps its historical two-dimensional
    /// mesh and group names); `counted` wraps the groups whose traffic the record counts.
    fn new(
        world: &World,
        plan: &PipelinePlan,
        tp: usize,
        counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
    ) -> Result<Self, PipelineError> {
        let (p, dp) = (plan.ranks, plan.data_parallel);
        if tp > 1 {
            let mesh = DeviceMesh::new(world, &[("dp", dp), ("pp", p), ("tp", tp)])?;
            Ok(PipelineMesh {
                pp: mesh.group("pp")?,
                dp: counted(mesh.group("dp")?),
                tp: Some(counted(mesh.group("tp")?)),
                rank: mesh.coordinate("pp")?,
                replica: mesh.coordinate("dp")?,
                tp_rank: mesh.coordinate("tp")?,
            })
        } else {
            let mesh = DeviceMesh::new(world, &[("dp", dp), ("pp", p)])?;
            Ok(PipelineMesh {
                pp: mesh.group("pp")?,
                dp: counted(mesh.group("dp")?),
                tp: None,
                rank: mesh.coordinate("pp")?,
                replica: mesh.coordinate("dp")?,
                tp_rank: 0,
            })
        }
    }
}

/// Groups between stages that exchange activations (by edge) and among the stages that hold
/// one tied weight (by holder set), created in the same order on every rank.
type StageGroups = (
    HashMap<(usize, usize), Arc<dyn ProcessGroup>>,
    BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
);

/// The edge and tied-weight groups of `plan`, one per (replica, TP rank).
fn pipeline_groups(
    world: &World,
    plan: &PipelinePlan,
    tp: usize,
    counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
) -> Result<StageGroups, PipelineError> {
    let (p, dp) = (plan.ranks, plan.data_parallel);
    let global = |d: usize, r: usize, t: usize| (d * p + r) * tp + t;
    let mut edge_groups = HashMap::new();
    for e in &plan.flow.edges {
        let (a, b) = (plan.stage_ranks[e.from], plan.stage_ranks[e.to]);
        if a == b {
            continue;
        }
        let partition: Vec<Vec<usize>> = (0..dp)
            .flat_map(|d| (0..tp).map(move |t| vec![global(d, a, t), global(d, b, t)]))
            .collect();
        if let Some(g) = world.new_groups(&partition, "pp-edge")? {
            edge_groups.insert((e.from, e.to), counted(g));
        }
    }
    let mut holder_sets: Vec<Vec<usize>> = plan
        .holders
        .iter()
        .filter(|h| h.len() > 1)
        .map(|h| h.iter().copied().collect())
        .collect();
    holder_sets.sort();
    holder_sets.dedup();
    let mut holder_groups = BTreeMap::new();
    for set in &holder_sets {
        let partition: Vec<Vec<usize>> = (0..dp)
            .flat_map(|d| (0..tp).map(move |t| set.iter().map(|&r| global(d, r, t)).collect()))
            .collect();
        if let Some(g) = world.new_groups(&partition, "pp-tied")? {
            holder_groups.insert(set.clone(), counted(g));
        }
    }
    Ok((edge_groups, holder_groups))
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

/// The boundary tensors of every microbatch of step `step`, probed once per input shape
/// (PP×FSDP probes every shape before sharding: a new one is an error there).
fn step_metas(
    model: &dyn Model,
    batches: &[Batch],
    metas_by_size: &mut HashMap<Vec<i64>, Arc<Vec<TensorMeta>>>,
    sharded: bool,
    step: usize,
) -> Result<Vec<Arc<Vec<TensorMeta>>>, PipelineError> {
    let mut metas = Vec::with_capacity(batches.len());
    for b in batches {
        let key: Vec<i64> = b.inputs.iter().flat_map(|t| t.size()).collect();
        let m = match metas_by_size.get(&key) {
            Some(m) => m.clone(),
            None if sharded => {
                return Err(PipelineError::InvalidPlan(format!(
                    "step {step} brings a microbatch of a new shape {key:?}; PP×FSDP \
                     probes every shape before sharding"
                )))
            }
            None => {
                let m = Arc::new(probe(model, b)?.outputs);
                metas_by_size.insert(key, m.clone());
                m
            }
        };
        metas.push(m);
    }
    Ok(metas)
}

/// Averages `grads` over `group` in one all-reduce of their concatenation (DDP's single
/// bucket), copied back in place.
fn average_flat(grads: &[Tensor], group: &dyn ProcessGroup) -> Result<(), PipelineError> {
    let flat = Tensor::f_cat(
        &grads
            .iter()
            .map(|g| g.f_view([-1]))
            .collect::<Result<Vec<_>, _>>()?,
        0,
    )?;
    group.all_reduce(&flat, ReduceOp::Avg)?;
    let mut offset = 0;
    for g in grads {
        let n = g.numel() as i64;
        g.shallow_clone()
            .f_copy_(&flat.f_narrow(0, offset, n)?.f_view(g.size().as_slice())?)?;
        offset += n;
    }
    Ok(())
}

/// The gradient norm without gathering the gradients: each owner computes its parameters'
/// squared norms in f64 exactly as `train::grad_norm` does, one all-reduce of that vector (one
/// non-zero contribution per element, so the sum is exact) gives every rank all of them, and
/// they are summed in parameter order — the same bits as the norm of the gathered gradients.
///
/// Each gradient is converted and squared in `scratch`, one f64 buffer on `device` (the
/// gradients') the size of the largest parameter kept across steps: the same values as
/// `to_kind(Double).square()` summed in the same order, without two fresh f64 copies of every
/// gradient per step (their page faults made this norm ~9 ms of a ~120 ms `bench pipeline`
/// step on the 3.3 M-parameter decoder; ~1.7 ms with the buffer).
fn owned_grad_norm(
    plan: &PipelinePlan,
    rank: usize,
    pp: &dyn ProcessGroup,
    named: &[(String, Tensor)],
    device: Device,
    scratch: &mut Option<Tensor>,
) -> Result<f64, PipelineError> {
    let largest = named
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .max()
        .unwrap_or(0);
    let buffer = match scratch.take() {
        Some(b) if b.numel() as i64 == largest => b,
        _ => Tensor::f_empty([largest], (Kind::Double, device))?,
    };
    let mut squares = vec![0f64; named.len()];
    for (i, (_, t)) in named.iter().enumerate() {
        let g = t.grad();
        if plan.owner(i) == rank && g.defined() {
            let mut d = buffer.f_narrow(0, 0, g.numel() as i64)?;
            d.f_copy_(&g.f_reshape([-1])?)?;
            let _ = d.f_square_()?;
            squares[i] = d.f_sum(Kind::Double)?.f_double_value(&[])?;
        }
    }
    *scratch = Some(buffer);
    let all = Tensor::from_slice(&squares).f_to_device(device)?;
    pp.all_reduce(&all, ReduceOp::Sum)?;
    let squares: Vec<f64> = Vec::try_from(&all)?;
    Ok(squares.iter().fold(0.0, |sum, s| sum + s).sqrt())
}

/// Every tensor of `named` (one per parameter, at full size) as its owner (lowest holder) has
/// it, on every pipeline rank: one all-gather of flat buffers in which each rank fills the
/// parameters it owns, so the values arrive bit for bit. The buffers live on `device`, the
/// parameters' (the record moves what it keeps to the host itself).
fn gather_owned(
    plan: &PipelinePlan,
    rank: usize,
    pp: &dyn ProcessGroup,
    named: &[(String, Tensor)],
    device: Device,
) -> Result<Vec<(String, Tensor)>, PipelineError> {
    let total: i64 = named.iter().map(|(_, t)| t.numel() as i64).sum();
    let local = Tensor::f_zeros([total], (Kind::Float, device))?;
    let mut offset = 0;
    for (i, (_, t)) in named.iter().enumerate() {
        let n = t.numel() as i64;
        if plan.owner(i) == rank && t.defined() {
            local
                .f_narrow(0, offset, n)?
                .f_copy_(&t.f_detach()?.f_to_kind(Kind::Float)?.f_view([-1])?)?;
        }
        offset += n;
    }
    let all = Tensor::f_zeros([total * plan.ranks as i64], (Kind::Float, device))?;
    pp.all_gather(&all, &local)?;
    let mut out = Vec::with_capacity(named.len());
    let mut offset = 0;
    for (i, (name, t)) in named.iter().enumerate() {
        let n = t.numel() as i64;
        let start = plan.owner(i) as i64 * total + offset;
        out.push((
            name.clone(),
            all.f_narrow(0, start, n)?.f_view(t.size().as_slice())?,
        ));
        offset += n;
    }
    Ok(out)
}
