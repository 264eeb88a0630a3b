//! Training a model under its tensor (and sequence) parallel plan on one rank: shards cut
//! from the full parameters every rank builds, the model's own forward through the plan's
//! module hooks (`PlanHooks`), its loss through the same hooks (loss parallel), partial
//! gradients summed over TP, replicas averaged over data parallelism, the optimizer on this
//! rank's shards, and a record of full tensors.

use super::hooks::PlanHooks;
use super::options::{TpError, TpFault, TpOptions};
use super::plan::{placements, Placement, TpPlan, TpPlanError};
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::compose::data::{DataLayer, SplitState};
use crate::compose::DataParallel;
use crate::fsdp::Fsdp;
use crate::record::RunRecord;
use crate::train::{
    train_from, GradientView, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::{Batch, LayerHooks, LossReduction, Model, ModelError, NoHooks};
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// The plan `model` offers for `opts` (its [`Model::parallel_plan`]), or the one clear
/// refusal of a model that offers none.
pub fn model_plan(model: &dyn Model, opts: &TpOptions) -> Result<TpPlan, TpPlanError> {
    match model.parallel_plan(opts.sequence_parallel) {
        Some(plan) => Ok(plan),
        None if opts.sequence_parallel && model.parallel_plan(false).is_some() => Err(
            TpPlanError::Unsupported(format!("{} with sequence parallelism", model.name())),
        ),
        None => Err(TpPlanError::Unsupported(model.name().to_owned())),
    }
}

/// Checks, before any rank starts, that the model's own plan fits `world_size` ranks at TP
/// size `opts.tp`; returns every parameter's placement.
pub fn check_plan(
    model: &dyn Model,
    world_size: usize,
    opts: &TpOptions,
) -> Result<HashMap<String, Placement>, TpError> {
    check_plan_with(model, world_size, opts, &model_plan(model, opts)?)
}

/// [`check_plan`] for a plan the caller passes (a user's, or the model's edited).
pub fn check_plan_with(
    model: &dyn Model,
    world_size: usize,
    opts: &TpOptions,
    plan: &TpPlan,
) -> Result<HashMap<String, Placement>, TpError> {
    if opts.tp == 0 || world_size == 0 || !world_size.is_multiple_of(opts.tp) {
        return Err(TpPlanError::Size(opts.tp).into());
    }
    opts.data_parallel
        .dims(world_size / opts.tp)
        .map_err(|e| TpError::Invalid(e.to_string()))?;
    if opts.sequence_parallel {
        let seq = model.input(0, 0)?.inputs.first().map_or(0, |t| t.size()[1]);
        if seq % opts.tp as i64 != 0 {
            return Err(TpError::Invalid(format!(
                "sequence parallelism splits the {seq} positions of a sequence, which do not \
                 divide by the tensor-parallel size {}",
                opts.tp
            )));
        }
    }
    Ok(placements(plan, model, opts.tp)?.into_iter().collect())
}

/// The groups of a tensor-parallel run on its mesh (`[dp, tp]`, or
/// `[dp_replicate, dp_shard, tp]` under hybrid sharding), every one counted.
struct TpMesh {
    tp: Arc<dyn ProcessGroup>,
    /// The group the data dimension shards over (or all-reduces over, replicated).
    dp: Arc<dyn ProcessGroup>,
    /// Hybrid sharding: the group shards are replicated across.
    replicate: Option<Arc<dyn ProcessGroup>>,
    /// This rank's TP rank.
    rank: usize,
    /// The data-parallel replica this rank trains for (its index in the data dimension).
    replica: usize,
}

impl TpMesh {
    fn new(world: &World, opts: &TpOptions, counts: &CollectiveCounts) -> Result<TpMesh, TpError> {
        let dp = world.size() / opts.tp;
        let mut dims = opts
            .data_parallel
            .dims(dp)
            .map_err(|e| TpError::Invalid(e.to_string()))?;
        dims.push(("tp", opts.tp));
        let mesh = DeviceMesh::new(world, &dims)?;
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let (dp_group, replicate) = match opts.data_parallel {
            DataParallel::HybridShard { .. } | DataParallel::HybridReplicate { .. } => (
                counted(mesh.group("dp_shard")?),
                Some(counted(mesh.group("dp_replicate")?)),
            ),
            _ => (counted(mesh.group("dp")?), None),
        };
        Ok(TpMesh {
            tp: counted(mesh.group("tp")?),
            dp: dp_group,
            replicate,
            rank: mesh.coordinate("tp")?,
            replica: world.rank() / opts.tp,
        })
    }

    /// Averages `t` over the whole data dimension.
    fn average_over_data(&self, t: &Tensor) -> Result<(), TpError> {
        if self.dp.size() > 1 {
            self.dp.all_reduce(t, ReduceOp::Avg)?;
        }
        if let Some(r) = &self.replicate {
            if r.size() > 1 {
                r.all_reduce(t, ReduceOp::Avg)?;
            }
        }
        Ok(())
    }
}

/// Trains `model` (built whole on every rank) under its own plan ([`Model::parallel_plan`])
/// for `cfg.spec.steps` steps; see [`train_tensor_parallel_with_plan`].
pub fn train_tensor_parallel(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &TpOptions,
) -> Result<RunRecord, TpError> {
    // A TP group of one splits nothing: no plan is applied and the model computes its own
    // layers and loss (as torchtitan skips parallelizing at degree 1), so FSDP×TP at TP = 1
    // is FSDP and DDP×TP at TP = 1 is DDP.
    let plan = if opts.tp == 1 {
        TpPlan::default()
    } else {
        model_plan(model, opts)?
    };
    train_tensor_parallel_with_plan(model, world, cfg, opts, &plan)
}

/// Trains `model` under tensor parallelism by `plan`. Each TP group trains on the
/// concatenation of its replica's share of the world's data ranks, so the objective is the
/// reference's. The data dimension follows `opts.data_parallel`: under FSDP×TP the tensors a
/// rank computes with (its TP shards and replicated parameters) are one FSDP unit over
/// `dp`, gathered before forward, their gradients reduce-scattered after backward and freed
/// after the optimizer steps the shards (TP → FSDP, torchtitan's order).
pub fn train_tensor_parallel_with_plan(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &TpOptions,
    plan: &TpPlan,
) -> Result<RunRecord, TpError> {
    let mut run = TpRun::new(model, world, opts, plan)?;
    let mut record = train_from(model, cfg, &mut run, None, &TrainStart::default())
        .map(|(record, _)| record)
        .map_err(TrainError::into_strategy::<TpError>)?;
    record.placements = run.placement_table();
    Ok(record)
}

/// One rank's tensor-parallel run: its groups, its tensors, the hooks applying the plan.
struct TpRun<'a> {
    model: &'a dyn Model,
    opts: &'a TpOptions,
    groups: TpMesh,
    placements: HashMap<String, Placement>,
    /// What this rank computes with (shards where the plan splits), the data dimension over
    /// it (replicated, or under FSDP×TP one unit sharded over it), its collectives' counts.
    split: SplitState,
    hooks: Box<dyn LayerHooks>,
    /// The data ranks whose batches this replica trains on.
    data_ranks: Vec<usize>,
}

impl<'a> TpRun<'a> {
    fn new(
        model: &'a dyn Model,
        world: &World,
        opts: &'a TpOptions,
        plan: &TpPlan,
    ) -> Result<Self, TpError> {
        let world_size = world.size();
        let identity = opts.tp == 1;
        let placements = if identity {
            opts.data_parallel
                .dims(world_size)
                .map_err(|e| TpError::Invalid(e.to_string()))?;
            HashMap::new()
        } else {
            check_plan_with(model, world_size, opts, plan)?
        };
        let counts = CollectiveCounts::new();
        let groups = TpMesh::new(world, opts, &counts)?;
        let trained = local_parameters(model, &placements, groups.rank, opts.tp)?;
        let unit = match opts.data_parallel {
            DataParallel::Replicate | DataParallel::HybridReplicate { .. } => None,
            DataParallel::Shard | DataParallel::HybridShard { .. } => Some(Fsdp::over_tensors(
                "tp_local",
                trained
                    .iter()
                    .map(|(n, t)| (n.clone(), t.shallow_clone()))
                    .collect(),
                groups.dp.clone(),
                groups.replicate.clone(),
            )?),
        };
        let hooks: Box<dyn LayerHooks> = if identity {
            Box::new(NoHooks)
        } else {
            let hooks = PlanHooks::new(
                groups.tp.clone(),
                groups.rank,
                &trained,
                &aliases(model),
                plan.clone(),
                &model.layers(),
            );
            Box::new(hooks.with_fault(opts.fault))
        };
        let whole = match unit {
            None => trained
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
            Some(_) => Vec::new(),
        };
        let data = DataLayer::new(unit, whole);
        let dp = world_size / opts.tp;
        let per = world_size / dp;
        let data_ranks = (groups.replica * per..(groups.replica + 1) * per).collect();
        Ok(TpRun {
            model,
            opts,
            groups,
            placements,
            split: SplitState::new(trained, data, counts),
            hooks,
            data_ranks,
        })
    }

    /// Where every parameter lived, for the record (and so the report).
    fn placement_table(&self) -> Vec<crate::record::TensorPlacement> {
        let tp = self.opts.tp;
        self.model
            .named_parameters()
            .into_iter()
            .map(|(tensor, _)| {
                let placement = placement_text(self.placements.get(&tensor), tp);
                crate::record::TensorPlacement { tensor, placement }
            })
            .collect()
    }

    /// Which copy of `name` this rank holds, for the cross-rank check.
    fn coordinate(&self, name: &str) -> String {
        tp_coordinate(&self.placements, name, self.groups.rank, self.opts.tp)
    }

    /// The replica's loss: the model's own forward and loss through the plan's hooks (a
    /// summed loss over the data ranks' concatenated batches divided by their number, so it
    /// is the reference's average).
    fn loss(&mut self, batch: &Batch) -> Result<Tensor, TpError> {
        let output = self.model.forward_hooked(batch, self.hooks.as_mut())?;
        let loss = self
            .model
            .loss_of_hooked(batch, &output, self.hooks.as_mut())?;
        Ok(match self.model.loss_reduction() {
            LossReduction::Mean => loss,
            LossReduction::Sum => loss.f_div_scalar(self.data_ranks.len() as f64)?,
        })
    }

    /// Sums partial gradients over TP, then reduces them over the data dimension (one
    /// average, hybrid shard's two stages, or the unit's reduce-scatter).
    fn reduce(&mut self) -> Result<(), TpError> {
        let tp_group = self.groups.tp.clone();
        // Gradients of parameters used on sequence shards are partial: sum them over TP.
        for (name, t) in &self.split.trained {
            if self.placements.get(name) == Some(&Placement::PartialGrad)
                && self.opts.fault != Some(TpFault::SkipSequenceGradReduce)
            {
                tp_group.all_reduce(&t.grad(), ReduceOp::Sum)?;
            }
        }
        match self.split.data.unit() {
            None => {
                for (_, t) in &self.split.trained {
                    self.groups.average_over_data(&t.grad())?;
                }
            }
            Some(_) => self.split.data.reduce_gradients()?,
        }
        Ok(())
    }

    /// Every parameter at full size from this rank's `value` of it (data or gradient):
    /// gathered from the unit over dp, then from its shards over TP.
    fn full(&self, value: impl Fn(&Tensor) -> Tensor) -> Result<Vec<(String, Tensor)>, TpError> {
        let tp = self.groups.tp.as_ref();
        match self.split.data.unit() {
            None => full_tensors(&self.split.trained, &self.placements, tp, value),
            Some(u) => {
                let local = u.borrow().full_values(value)?;
                full_tensors(&local, &self.placements, tp, Tensor::shallow_clone)
            }
        }
    }
}

/// A tensor-parallel rank as a strategy of the one training loop: it trains its shards, runs
/// the model through the plan's hooks on its replica's batch, sums partial gradients over TP
/// and reduces over the data dimension, and shows the record full tensors.
impl StepHooks for TpRun<'_> {
    fn split_state(&self) -> Option<&SplitState> {
        Some(&self.split)
    }

    fn forward_backward(
        &mut self,
        model: &dyn Model,
        _data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let batch = global_batch(model, &self.data_ranks, step).map_err(TrainError::strategy)?;
        let loss = self.loss(&batch).map_err(TrainError::strategy)?;
        StepLoss::backward(&loss)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.reduce().map_err(TrainError::strategy)
    }

    fn mean_loss(
        &mut self,
        local: StepLoss,
        _metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        // On the loss's device: the groups reduce tensors where the training computes.
        let value = local.tensor()?;
        self.groups
            .average_over_data(&value)
            .map_err(TrainError::strategy)?;
        Ok(value.f_double_value(&[0])?)
    }

    fn gradient_view(
        &mut self,
        _grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<GradientView, TrainError> {
        let full = self.full(|t| t.grad()).map_err(TrainError::strategy)?;
        GradientView::of_full(full, keep)
    }

    fn state_coordinate(&self, name: &str) -> String {
        self.coordinate(name)
    }

    fn state_prefix(&self) -> String {
        let (rank, tp) = (self.groups.rank, self.opts.tp);
        match tp > 1 {
            true => format!("tp{rank}/{tp}."),
            false => String::new(),
        }
    }

    fn full_parameters(
        &mut self,
        _params: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        let _ = self.split.counts.take();
        self.full(Tensor::shallow_clone)
            .map_err(TrainError::strategy)
    }
}

/// The tensors this rank computes with under `placements`: each split parameter's shard
/// along its dimension (a fresh leaf), every other parameter the model's own (a handle), in
/// `named_parameters` order.
pub(crate) fn local_parameters(
    model: &dyn Model,
    placements: &HashMap<String, Placement>,
    rank: usize,
    tp: usize,
) -> Result<Vec<(String, Tensor)>, super::layers::TpLayerError> {
    model
        .named_parameters()
        .into_iter()
        .map(|(name, t)| {
            let local = match placements.get(&name) {
                Some(Placement::Shard { dim }) => super::layers::shard(&t, *dim, rank, tp)?,
                _ => t.shallow_clone(),
            };
            Ok((name, local))
        })
        .collect()
}

/// Which copy of TP-local tensor `name` this rank holds ([`crate::consistency`]): its TP
/// shard, or none when every TP rank holds it whole (norms, row-parallel biases).
pub(crate) fn tp_coordinate(
    placements: &HashMap<String, Placement>,
    name: &str,
    rank: usize,
    tp: usize,
) -> String {
    match placements.get(name) {
        Some(Placement::Shard { .. }) => format!("tp{rank}/{tp}"),
        _ => String::new(),
    }
}

/// The tied aliases of `model` with their canonical names, for the hooks' lookups.
pub(crate) fn aliases(model: &dyn Model) -> Vec<(String, String)> {
    model
        .tags()
        .shared
        .iter()
        .flat_map(|g| g.aliases.iter().map(|a| (a.clone(), g.canonical.clone())))
        .collect()
}

/// The replica's batch: its data ranks' batches concatenated along the batch dimension (a
/// tensor- or context-parallel group trains on them as one).
pub(crate) fn global_batch(
    model: &dyn Model,
    ranks: &[usize],
    step: usize,
) -> Result<Batch, ModelError> {
    let batches = ranks
        .iter()
        .map(|&r| model.input(r, step))
        .collect::<Result<Vec<_>, _>>()?;
    let dim = model.batch_dim();
    let arity = batches.first().map_or(0, |b| b.inputs.len());
    let inputs = (0..arity)
        .map(|k| {
            Tensor::f_cat(
                &batches.iter().map(|b| &b.inputs[k]).collect::<Vec<_>>(),
                dim,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let targets: Vec<&Tensor> = batches.iter().filter_map(|b| b.target.as_ref()).collect();
    let target = if targets.is_empty() {
        None
    } else {
        Some(Tensor::f_cat(&targets, dim)?)
    };
    Ok(Batch { inputs, target })
}

/// Full tensors from this rank's parameters: shards gathered over TP, the rest as they are.
pub(crate) fn full_tensors(
    trained: &[(String, Tensor)],
    placements: &HashMap<String, Placement>,
    group: &dyn ProcessGroup,
    value: impl Fn(&Tensor) -> Tensor,
) -> Result<Vec<(String, Tensor)>, TpError> {
    trained
        .iter()
        .map(|(name, t)| {
            let v = value(t);
            let v = if v.defined() { v } else { t.f_zeros_like()? };
            let full = match placements.get(name) {
                Some(Placement::Shard { dim }) => super::layers::unshard(&v, *dim, group)?,
                _ => v,
            };
            Ok((name.clone(), full))
        })
        .collect()
}

/// How a tensor under a TP plan lives, as reports print it (`None`: the plan does not place
/// it, so it is replicated).
pub(crate) fn placement_text(placement: Option<&Placement>, tp: usize) -> String {
    match placement {
        Some(Placement::Shard { dim }) => format!("shard(dim {dim}) over tp={tp}"),
        Some(Placement::PartialGrad) => {
            format!("replicated, gradient summed over tp={tp} (sequence shards)")
        }
        Some(Placement::Replicated) | None => "replicated".to_owned(),
    }
}
