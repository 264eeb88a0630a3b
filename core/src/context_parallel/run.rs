//! Training a model under context parallelism on one rank: its replica's batch cut along the
//! sequence (labels shifted before the cut, as the model's batch already holds them), the
//! model's own forward through the CP hooks (global positions, attention across the CP
//! group, the loss as this shard's share of the whole mean), gradients scaled by the CP size
//! and averaged over `dp × cp` (the sum over the shards, averaged over the replicas: exact,
//! as torchtitan averages CP-scaled gradients), replicated or one FSDP unit sharded over
//! `dp × cp`. Both data dimensions reduce the same elements in the same order, so FSDP×CP is
//! bitwise CP.
//!
//! With `tp` > 1 each sequence shard is also split by the model's tensor-parallel plan (mesh
//! `[dp, cp, tp]`, torchtitan's order): the plan's hooks run inside the CP hooks, each rank
//! trains its TP shards, and gradients are reduced over `dp × cp` within each TP coordinate.
//!
//! With `ep` > 1 each mixture's experts are spread over `ep` ranks of `dp × cp` (within a TP
//! coordinate), the plan's hooks dispatching every shard's tokens to them
//! (`expert_parallel::borrowed`); the
//! dense parameters are kept by the data dimension as before, the experts whole beside it.
//! At CP size 1 (the sequence whole: attention, positions and the loss the model's own) the
//! same loop trains every composition without a pipeline: TP, EP and both with DDP, FSDP or
//! HSDP (`compose::train_composed`), bit for bit as TP's and EP's own loops train them.

use super::hooks::CpHooks;
use super::layout::{chunk_count, chunks_of, layout_blocker, shard_sequence};
use super::options::{CpError, CpFault, CpOptions, SequenceLayout};
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::compose::data::{DataLayer, SplitState};
use crate::compose::DataParallel;
use crate::expert_parallel::borrowed::BorrowedExperts;
use crate::expert_parallel::check_expert_plan_with;
use crate::fsdp::Fsdp;
use crate::record::{RunRecord, TensorPlacement};
use crate::tensor_parallel::hooks::PlanHooks;
use crate::tensor_parallel::run::{
    aliases, full_tensors, global_batch, local_parameters, model_plan, placement_text,
    tp_coordinate,
};
use crate::tensor_parallel::{check_plan, Placement, TpFault, TpOptions};
use crate::train::{
    train_from, GradientView, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::{Batch, LossReduction, Model};
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// Checks, before any rank starts, that `model` can be trained under `opts` at `world_size`:
/// the CP size divides the world, the model routes its attention and positions through the
/// hooks, and its sequence divides into the layout's chunks.
pub fn check_context_parallel(
    model: &dyn Model,
    world_size: usize,
    opts: &CpOptions,
) -> Result<(), CpError> {
    if matches!(opts.data_parallel, DataParallel::HybridReplicate { .. }) && opts.cp > 1 {
        return Err(CpError::Invalid(format!(
            "the data dimension beside context parallelism is replicated (ddp), sharded over \
             dp × cp (fsdp) or hybrid-sharded over dp_shard × cp (hsdp), not {}",
            opts.data_parallel.label()
        )));
    }
    if opts.tp > 1 && (opts.cp == 0 || !world_size.is_multiple_of(opts.cp * opts.tp)) {
        return Err(CpError::Invalid(format!(
            "cp={} × tp={} does not divide world size {world_size}",
            opts.cp, opts.tp
        )));
    }
    if opts.tp == 0 || opts.cp == 0 || world_size == 0 || !world_size.is_multiple_of(opts.cp) {
        return Err(CpError::Invalid(format!(
            "context-parallel size {} does not divide world size {world_size}",
            opts.cp
        )));
    }
    if opts.cp == 1 {
        // The sequence is whole: attention, positions and the loss are the model's own, so
        // any model runs (TP, EP and the data dimension are the only splits).
        return check_splits(model, world_size, opts);
    }
    if let Some(why) = model.context_parallel_blocker() {
        return Err(CpError::Invalid(why));
    }
    if model.loss_reduction() != LossReduction::Mean {
        return Err(CpError::Invalid(format!(
            "{} sums its loss over samples; context parallelism splits a mean over tokens",
            model.name()
        )));
    }
    let seq = model
        .input(0, 0)?
        .inputs
        .first()
        .map_or(0, |t| t.size().get(1).copied().unwrap_or(0));
    if let Some(why) = layout_blocker(opts.layout, opts.cp, seq) {
        return Err(CpError::Invalid(format!("{}: {why}", model.name())));
    }
    check_splits(model, world_size, opts)
}

/// A failure of the `part` (`TP`, `EP`) beside the sequence split, named as the composition
/// the user runs: `CP × TP: …` beside context parallelism, `TP: …` at CP size 1.
fn part_failure(opts: &CpOptions, part: &str, e: impl std::fmt::Display) -> CpError {
    match opts.cp {
        1 => CpError::Part(format!("{part}: {e}")),
        _ => CpError::Part(format!("CP × {part}: {e}")),
    }
}

/// The splits beside CP fit `model`: its TP plan at `opts.tp`, its experts over `opts.ep`
/// ranks, and the data dimension the rest of the world.
fn check_splits(model: &dyn Model, world_size: usize, opts: &CpOptions) -> Result<(), CpError> {
    opts.data_parallel
        .dims(world_size / (opts.cp * opts.tp))
        .map_err(|e| CpError::Invalid(e.to_string()))?;
    if opts.tp > 1 {
        check_plan(model, world_size, &tensor_options(opts))
            .map_err(|e| part_failure(opts, "TP", e))?;
    }
    if opts.ep > 1 {
        expert_count(model, world_size, opts)?;
    }
    Ok(())
}

/// The experts of each of `model`'s mixtures, checked to divide over `opts.ep` ranks, and
/// `opts.ep` to divide the `dp × cp` ranks it borrows from.
fn expert_count(model: &dyn Model, world_size: usize, opts: &CpOptions) -> Result<usize, CpError> {
    let data_cp = world_size / opts.tp;
    if opts.ep == 0 || !data_cp.is_multiple_of(opts.ep) {
        return Err(CpError::Invalid(format!(
            "ep={} borrows from dp × cp = {} × {} ranks, which do not divide by it",
            opts.ep,
            data_cp / opts.cp,
            opts.cp
        )));
    }
    let plan = match opts.tp {
        1 => model.parallel_plan(false),
        _ => Some(
            model_plan(model, &tensor_options(opts)).map_err(|e| part_failure(opts, "TP", e))?,
        ),
    };
    let ep_opts = crate::compose::Composition::ep_options(opts.ep, DataParallel::Replicate);
    let (_, experts) = check_expert_plan_with(model, data_cp, &ep_opts, plan)
        .map_err(|e| CpError::Invalid(e.to_string()))?;
    Ok(experts)
}

/// The tensor-parallel options of a CP × TP run's plan (no sequence parallelism: CP holds
/// the sequence shards; the data dimension is CP's own).
fn tensor_options(opts: &CpOptions) -> TpOptions {
    TpOptions {
        tp: opts.tp,
        sequence_parallel: false,
        data_parallel: DataParallel::Replicate,
        fault: None,
    }
}

/// Trains `model` (built whole on every rank) under context parallelism for
/// `cfg.spec.steps` steps. The world is a `[dp, cp]` mesh (CP innermost, as torchtitan lays
/// it out); each CP group trains on the concatenation of its replica's share of the world's
/// data ranks, so the objective is the single-device reference's.
pub fn train_context_parallel(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &CpOptions,
) -> Result<RunRecord, CpError> {
    check_context_parallel(model, world.size(), opts)?;
    let mut run = CpRun::new(model, world, opts)?;
    let mut record = train_from(model, cfg, &mut run, None, &TrainStart::default())
        .map(|(record, _)| record)
        .map_err(TrainError::into_strategy::<CpError>)?;
    let dp = world.size() / (opts.cp * opts.tp);
    let over_cp = match opts.data_parallel {
        DataParallel::Shard => format!(
            "sharded over dp × cp = {dp} × {}, gradient summed over the sequence shards",
            opts.cp
        ),
        _ => format!(
            "replicated, gradient summed over cp={} (sequence shards)",
            opts.cp
        ),
    };
    record.placements = model
        .named_parameters()
        .into_iter()
        .map(|(tensor, _)| {
            if let Some(placement) = run.experts.as_ref().and_then(|e| e.placement(&tensor)) {
                return TensorPlacement { tensor, placement };
            }
            let placement = match run.tp.as_ref() {
                Some(tp) => format!(
                    "{}; {over_cp}",
                    placement_text(tp.placements.get(&tensor), opts.tp)
                ),
                None => over_cp.clone(),
            };
            TensorPlacement { tensor, placement }
        })
        .collect();
    Ok(record)
}

/// The tensor-parallel part of a CP × TP rank.
struct CpTensorParallel {
    group: Arc<dyn ProcessGroup>,
    /// This rank's TP coordinate.
    rank: usize,
    /// Where the plan puts every parameter.
    placements: HashMap<String, Placement>,
}

/// One rank's context-parallel run.
struct CpRun<'a> {
    opts: &'a CpOptions,
    cp: Arc<dyn ProcessGroup>,
    /// The data dimension's groups, averaged over in turn: `dp`, or HSDP's `dp_shard` then
    /// `dp_replicate`.
    dp: Vec<Arc<dyn ProcessGroup>>,
    /// What gradients are averaged (or sharded) over: `dp × cp` (every rank, or under CP ×
    /// TP the ranks of this TP coordinate), or under HSDP `dp_shard × cp`.
    everyone: Arc<dyn ProcessGroup>,
    /// HSDP's replicated twin: the replicas, averaged over after `everyone`.
    replicas: Option<Arc<dyn ProcessGroup>>,
    /// CP × TP: the TP group and the plan's placements.
    tp: Option<CpTensorParallel>,
    /// CP × EP: the EP group, this rank's experts and how their gradients reduce.
    experts: Option<BorrowedExperts>,
    rank: usize,
    hooks: CpHooks,
    data_ranks: Vec<usize>,
    /// What this rank computes with (the model's parameters, TP's shards, its experts), the
    /// data dimension over it (replicated, or one FSDP unit over `dp × cp`), its collectives'
    /// counts.
    split: SplitState,
}

impl<'a> CpRun<'a> {
    fn new(model: &dyn Model, world: &World, opts: &'a CpOptions) -> Result<Self, CpError> {
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let groups = CpGroups::new(world, opts, &counted)?;
        let tp = match opts.tp {
            1 => None,
            _ => Some(CpTensorParallel {
                group: counted(groups.mesh.group("tp")?),
                rank: groups.mesh.coordinate("tp")?,
                placements: check_plan(model, world.size(), &tensor_options(opts))
                    .map_err(|e| part_failure(opts, "TP", e))?,
            }),
        };
        let experts = match opts.ep {
            1 => None,
            _ => Some(borrowed_experts(model, world, opts, &counted)?),
        };
        let trained: Vec<(String, Tensor)> = match &tp {
            Some(tp) => local_parameters(model, &tp.placements, tp.rank, opts.tp)
                .map_err(|e| part_failure(opts, "TP", e))?,
            None => model.named_parameters(),
        }
        .into_iter()
        .filter(|(n, _)| experts.as_ref().is_none_or(|e| e.holds(n)))
        .collect();
        // HSDP's replicated twin (DDP averaged over dp_shard, then across the replicas)
        // averages over the replicas itself; sharded HSDP's unit does.
        let replicas = match opts.data_parallel {
            DataParallel::HybridReplicate { .. } => groups.replicate.clone(),
            _ => None,
        };
        let data = data_layer(&trained, experts.as_ref(), opts, &groups)?;
        let mut hooks = CpHooks::new(groups.cp.clone(), groups.rank, opts.clone());
        if let Some(inner) =
            plan_hooks(model, world, opts, tp.as_ref(), experts.as_ref(), &trained)?
        {
            hooks = hooks.around(Box::new(inner));
        }
        let per = opts.cp * opts.tp;
        let replica = world.rank() / per;
        Ok(CpRun {
            opts,
            hooks,
            cp: groups.cp,
            dp: groups.dp,
            everyone: groups.everyone,
            replicas,
            tp,
            experts,
            rank: groups.rank,
            data_ranks: (replica * per..(replica + 1) * per).collect(),
            split: SplitState::new(trained, data, counts),
        })
    }

    /// Every parameter at full size from this rank's `value` of it (gathered from the unit
    /// when sharded).
    fn full(&self, value: impl Fn(&Tensor) -> Tensor) -> Result<Vec<(String, Tensor)>, CpError> {
        let gathered: HashMap<String, Tensor> = match self.split.data.unit() {
            Some(u) => u.borrow().full_values(&value)?.into_iter().collect(),
            None => HashMap::new(),
        };
        let mut local = self
            .split
            .trained
            .iter()
            .map(|(n, t)| {
                if let Some(v) = gathered.get(n) {
                    return Ok((n.clone(), v.shallow_clone()));
                }
                let v = value(t);
                Ok((n.clone(), if v.defined() { v } else { t.f_zeros_like()? }))
            })
            .collect::<Result<Vec<_>, CpError>>()?;
        if let Some(experts) = &self.experts {
            local = experts.full(local)?;
        }
        match &self.tp {
            Some(tp) => full_tensors(
                &local,
                &tp.placements,
                tp.group.as_ref(),
                Tensor::shallow_clone,
            )
            .map_err(|e| part_failure(self.opts, "TP", e)),
            None => Ok(local),
        }
    }

    /// Which copy of `name` this rank holds, for the cross-rank check: its TP shard under
    /// CP × TP, none otherwise.
    fn coordinate(&self, name: &str) -> String {
        match &self.tp {
            Some(tp) => tp_coordinate(&tp.placements, name, tp.rank, self.opts.tp),
            None => String::new(),
        }
    }

    /// Each gradient scaled by the CP size (the shards' parts are summed, not averaged), then
    /// averaged over `dp × cp`: all-reduced when replicated, reduce-scattered into the
    /// unit's shards when sharded (the same elements).
    fn reduce(&mut self) -> Result<(), CpError> {
        let scale = match self.opts.fault {
            Some(CpFault::ScaledByDpSize) => self.dp.iter().map(|g| g.size()).product(),
            _ => self.cp.size(),
        } as f64;
        if let Some(tp) = &self.tp {
            // Partial gradients (none without sequence parallelism) summed over TP first.
            for (name, t) in &self.split.trained {
                if tp.placements.get(name) == Some(&Placement::PartialGrad) {
                    tp.group.all_reduce(&t.grad(), ReduceOp::Sum)?;
                }
            }
        }
        if let (Some(CpFault::ShardedGradsReducedOverDpTwice), Some(tp)) =
            (self.opts.fault, &self.tp)
        {
            // The planted seam bug: TP-sharded gradients summed over dp before the average.
            for (name, t) in &self.split.trained {
                let sharded = matches!(tp.placements.get(name), Some(Placement::Shard { .. }));
                if sharded && self.everyone.size() > 1 {
                    self.everyone.all_reduce(&t.grad(), ReduceOp::Sum)?;
                }
            }
        }
        if let Some(experts) = &self.experts {
            // The experts beside the unit (a planted fault puts them in it).
            experts.reduce(self.split.data.whole())?;
        }
        // Experts beside the unit are the experts' to reduce; in it (the planted fault),
        // the unit's.
        let experts_in_unit = self.split.data.unit().is_some()
            && self.opts.fault == Some(CpFault::ExpertsShardedOverDp);
        let reduced_by_experts =
            |n: &str| !experts_in_unit && self.experts.as_ref().is_some_and(|e| e.is_expert(n));
        for (_, t) in self
            .split
            .trained
            .iter()
            .filter(|(n, _)| !reduced_by_experts(n))
        {
            let g = t.grad();
            if !g.defined() {
                continue;
            }
            if self.opts.fault == Some(CpFault::GradsNotReducedOverCp) {
                for group in self.dp.iter().filter(|g| g.size() > 1) {
                    group.all_reduce(&g, ReduceOp::Avg)?;
                }
                continue;
            }
            if scale != 1.0 {
                let _ = g.shallow_clone().f_mul_scalar_(scale)?;
            }
            if self.split.data.unit().is_none() {
                for group in std::iter::once(&self.everyone).chain(&self.replicas) {
                    if group.size() > 1 {
                        group.all_reduce(&g, ReduceOp::Avg)?;
                    }
                }
            }
        }
        if self.opts.fault != Some(CpFault::GradsNotReducedOverCp) {
            self.split.data.reduce_gradients()?;
        }
        Ok(())
    }

    /// This rank's shard of the replica's batch (tokens and targets cut along the sequence)
    /// and the tokens the whole batch's loss averages over.
    fn shard(&self, batch: &Batch) -> Result<(Batch, f64), CpError> {
        let (layout, cp) = (self.opts.layout, self.opts.cp);
        if cp == 1 {
            // The whole sequence (its loss the model's own: no token count needed).
            let whole = Batch {
                inputs: batch.inputs.iter().map(Tensor::shallow_clone).collect(),
                target: batch.target.as_ref().map(Tensor::shallow_clone),
            };
            return Ok((whole, 1.0));
        }
        let cut = |t: &Tensor| shard_sequence(t, 1, layout, self.rank, cp);
        let inputs = batch
            .inputs
            .iter()
            .map(cut)
            .collect::<Result<Vec<_>, _>>()?;
        let whole_target = batch
            .target
            .as_ref()
            .ok_or_else(|| CpError::Invalid("the batch has no target tokens".into()))?;
        if self.opts.fault == Some(CpFault::LabelsShiftedAfterSharding) {
            let tokens = batch
                .inputs
                .first()
                .ok_or_else(|| CpError::Invalid("the batch has no tokens".into()))?;
            let shifted = |r: usize| shifted_after_sharding(tokens, whole_target, layout, r, cp);
            let mut counted = 0.0;
            for r in 0..cp {
                counted += shifted(r)?
                    .f_ne(-100)?
                    .f_sum(tch::Kind::Float)?
                    .f_double_value(&[])?;
            }
            let target = shifted(self.rank)?;
            return Ok((
                Batch {
                    inputs,
                    target: Some(target),
                },
                counted,
            ));
        }
        let tokens = whole_target
            .f_ne(-100)?
            .f_sum(tch::Kind::Float)?
            .f_double_value(&[])?;
        Ok((
            Batch {
                inputs,
                target: Some(cut(whole_target)?),
            },
            tokens,
        ))
    }
}

/// The CP loop's groups on its mesh `[dp…, cp, tp]`, each counted: the CP group and this
/// rank's place in it, the data dimension's groups, and the groups gradients reduce over.
struct CpGroups {
    mesh: DeviceMesh,
    cp: Arc<dyn ProcessGroup>,
    /// This rank's coordinate in `cp`.
    rank: usize,
    /// The data dimension's groups: `dp`, or under HSDP `dp_shard` then `dp_replicate`.
    dp: Vec<Arc<dyn ProcessGroup>>,
    /// What gradients reduce over: `dp × cp` (the world, or flattened within each TP
    /// coordinate), or under HSDP `dp_shard × cp` within each replica.
    everyone: Arc<dyn ProcessGroup>,
    /// Under HSDP, the replicas `everyone` is then reduced across.
    replicate: Option<Arc<dyn ProcessGroup>>,
}

impl CpGroups {
    fn new(
        world: &World,
        opts: &CpOptions,
        counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
    ) -> Result<CpGroups, CpError> {
        let (cp_size, tp_size) = (opts.cp, opts.tp);
        let dp = world.size() / (cp_size * tp_size);
        let mut dims = opts
            .data_parallel
            .dims(dp)
            .map_err(|e| CpError::Invalid(e.to_string()))?;
        let hybrid = dims.len() == 2;
        dims.push(("cp", cp_size));
        if tp_size > 1 {
            dims.push(("tp", tp_size));
        }
        let mesh = DeviceMesh::new(world, &dims)?;
        let cp = counted(mesh.group("cp")?);
        let rank = mesh.coordinate("cp")?;
        let dp_groups = match hybrid {
            true => vec![
                counted(mesh.group("dp_shard")?),
                counted(mesh.group("dp_replicate")?),
            ],
            false => vec![counted(mesh.group("dp")?)],
        };
        // Named for what they span: `dp × cp` under CP, the data dimension alone without.
        let (shards, data) = match cp_size {
            1 => ("dp_shard", "dp"),
            _ => ("dps_cp", "dp_cp"),
        };
        let (everyone, replicate) = if hybrid {
            let mut flat = vec![("dp_replicate", dims[0].1), (shards, dims[1].1 * cp_size)];
            if tp_size > 1 {
                flat.push(("tp", tp_size));
            }
            let flat = DeviceMesh::new(world, &flat)?;
            (
                counted(flat.group(shards)?),
                Some(counted(flat.group("dp_replicate")?)),
            )
        } else if tp_size > 1 {
            let flat = DeviceMesh::new(world, &[(data, dp * cp_size), ("tp", tp_size)])?;
            (counted(flat.group(data)?), None)
        } else {
            (counted(world.group()), None)
        };
        Ok(CpGroups {
            cp,
            rank,
            mesh,
            dp: dp_groups,
            everyone,
            replicate,
        })
    }
}

/// The data dimension over `trained`: replicated, or one FSDP unit over `dp × cp` (under HSDP
/// within each replica) holding the dense parameters, the experts whole beside it.
fn data_layer(
    trained: &[(String, Tensor)],
    experts: Option<&BorrowedExperts>,
    opts: &CpOptions,
    groups: &CpGroups,
) -> Result<DataLayer, CpError> {
    let experts_in_unit = opts.fault == Some(CpFault::ExpertsShardedOverDp);
    let whole = |n: &str| !experts_in_unit && experts.is_some_and(|e| e.is_expert(n));
    let handles = |sharded: bool| {
        trained
            .iter()
            .filter(|(n, _)| sharded != whole(n))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect::<Vec<_>>()
    };
    Ok(match opts.data_parallel {
        DataParallel::Shard | DataParallel::HybridShard { .. } => DataLayer::new(
            Some(Fsdp::over_tensors(
                "cp_local",
                handles(true),
                groups.everyone.clone(),
                groups.replicate.clone(),
            )?),
            handles(false),
        ),
        _ => DataLayer::new(
            None,
            trained
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
        ),
    })
}

/// The plan's hooks inside CP: TP's shards on the TP group, or (EP alone) every tensor whole
/// on a group of one; with EP, its mixtures dispatched to their experts. None without either.
fn plan_hooks(
    model: &dyn Model,
    world: &World,
    opts: &CpOptions,
    tp: Option<&CpTensorParallel>,
    experts: Option<&BorrowedExperts>,
    trained: &[(String, Tensor)],
) -> Result<Option<PlanHooks>, CpError> {
    if tp.is_none() && experts.is_none() {
        return Ok(None);
    }
    let plan = match tp {
        Some(_) => {
            model_plan(model, &tensor_options(opts)).map_err(|e| part_failure(opts, "TP", e))?
        }
        None => model
            .parallel_plan(false)
            .ok_or_else(|| part_failure(opts, "EP", "the model has no plan"))?,
    };
    let (group, tp_rank) = match tp {
        Some(tp) => (tp.group.clone(), tp.rank),
        None => (alone(world)?, 0),
    };
    let mut inner = PlanHooks::new(
        group,
        tp_rank,
        trained,
        &aliases(model),
        plan,
        &model.layers(),
    );
    if let Some(e) = experts {
        inner = inner.with_experts(e.dispatch());
    }
    if opts.fault == Some(CpFault::TpInputGradNotReduced) {
        inner = inner.with_fault(Some(TpFault::MissingBackwardAllReduce));
    }
    Ok(Some(inner))
}

/// CP × EP: `model`'s experts spread over `ep` ranks borrowed from `dp × cp` within this
/// rank's TP coordinate (world ranks lie `[data…, cp, tp]`, so the flat `dp × cp` index is
/// the rank over `tp`, and EP takes its innermost ranks). An expert's gradient, summed over
/// its holders, is divided by `dp`: each shard's loss is its share of its replica's mean.
fn borrowed_experts(
    model: &dyn Model,
    world: &World,
    opts: &CpOptions,
    counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
) -> Result<BorrowedExperts, CpError> {
    let experts = expert_count(model, world.size(), opts)?;
    let data_cp = world.size() / opts.tp;
    let mut dims = vec![("edp", data_cp / opts.ep), ("ep", opts.ep)];
    if opts.tp > 1 {
        dims.push(("tp", opts.tp));
    }
    let mesh = DeviceMesh::new(world, &dims)?;
    let scale = match opts.fault {
        Some(CpFault::ExpertGradsNotScaledByCp) => 1.0 / data_cp as f64,
        Some(CpFault::ExpertGradsPerEpRank) => (opts.ep * opts.cp) as f64 / data_cp as f64,
        _ => opts.cp as f64 / data_cp as f64,
    };
    Ok(BorrowedExperts::new(
        model,
        counted(mesh.group("ep")?),
        counted(mesh.group("edp")?),
        experts,
        scale,
    ))
}

/// A group of this rank alone (the plan's TP group when only EP splits the model).
fn alone(world: &World) -> Result<Arc<dyn ProcessGroup>, CpError> {
    let singles: Vec<Vec<usize>> = (0..world.size()).map(|r| vec![r]).collect();
    world
        .new_groups(&singles, "cp-ep-self")?
        .ok_or_else(|| CpError::Invalid("no single-rank group".into()))
}

/// [`CpFault::LabelsShiftedAfterSharding`]'s targets on rank `rank`: each of its chunks'
/// inputs shifted by one within the chunk, the last token of every chunk without a label
/// (ignored), except the sequence's last, which keeps its own.
fn shifted_after_sharding(
    tokens: &Tensor,
    target: &Tensor,
    layout: SequenceLayout,
    rank: usize,
    cp: usize,
) -> Result<Tensor, CpError> {
    let seq = tokens.size()[1];
    let chunks = chunk_count(layout, cp) as i64;
    let len = seq / chunks;
    let mut parts = Vec::new();
    for c in chunks_of(layout, rank, cp) {
        let start = c as i64 * len;
        let own = tokens.f_narrow(1, start, len)?;
        let last = if c as i64 == chunks - 1 {
            target.f_narrow(1, seq - 1, 1)?
        } else {
            own.f_narrow(1, 0, 1)?.f_full_like(-100)?
        };
        parts.push(Tensor::f_cat(&[own.f_narrow(1, 1, len - 1)?, last], 1)?);
    }
    Ok(Tensor::f_cat(&parts, 1)?)
}

/// A context-parallel rank as a strategy of the one training loop.
impl StepHooks for CpRun<'_> {
    fn split_state(&self) -> Option<&SplitState> {
        Some(&self.split)
    }

    fn forward_backward(
        &mut self,
        model: &dyn Model,
        _data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let batch = global_batch(model, &self.data_ranks, step)?;
        let seq = batch.inputs.first().map_or(0, |t| t.size()[1]);
        let (local, tokens) = self.shard(&batch).map_err(TrainError::strategy)?;
        self.hooks.set_step(seq, tokens);
        let output = model.forward_hooked(&local, &mut self.hooks)?;
        let mut loss = model.loss_of_hooked(&local, &output, &mut self.hooks)?;
        if model.loss_reduction() == LossReduction::Sum {
            // Only at CP size 1 (CP refuses summed losses): the sum over the replica's data
            // ranks' samples, made a mean over those ranks as every data rank's loss is.
            loss = loss.f_div_scalar(self.data_ranks.len() as f64)?;
        }
        StepLoss::backward(&loss)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.reduce().map_err(TrainError::strategy)
    }

    /// The shards' shares summed over CP (the replica's mean), averaged over the replicas.
    fn mean_loss(
        &mut self,
        local: StepLoss,
        _metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        let value = local.tensor()?;
        if self.opts.fault != Some(CpFault::LossNotReducedOverCp) && self.cp.size() > 1 {
            self.cp.all_reduce(&value, ReduceOp::Sum)?;
        }
        for group in self.dp.iter().filter(|g| g.size() > 1) {
            group.all_reduce(&value, ReduceOp::Avg)?;
        }
        Ok(value.f_double_value(&[0])?)
    }

    fn gradient_view(
        &mut self,
        _grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<GradientView, TrainError> {
        let full = self.full(|t| t.grad()).map_err(TrainError::strategy)?;
        if let (Some(CpFault::NormOverOwnExperts), Some(experts)) = (self.opts.fault, &self.experts)
        {
            return GradientView::of_full_counting(full, keep, &|n| experts.holds(n));
        }
        GradientView::of_full(full, keep)
    }

    fn state_coordinate(&self, name: &str) -> String {
        self.coordinate(name)
    }

    fn state_prefix(&self) -> String {
        match &self.tp {
            Some(tp) => format!("tp{}/{}.", tp.rank, self.opts.tp),
            None => String::new(),
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
