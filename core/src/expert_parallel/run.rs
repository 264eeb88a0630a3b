//! Training the zoo's `gpt_moe` with its experts sharded over an `ep` group: every rank
//! trains on its own batch (data parallel), attention and router are replicated and averaged
//! like DDP, each rank holds `E / ep` experts of every MoE layer, token-choices travel to
//! their experts through a dispatcher, and expert gradients are summed over the
//! expert-data-parallel group only and divided by the world size. The model's own forward
//! runs; its plan's [`ParallelStyle::Expert`] modules run through the expert-parallel
//! dispatch (`PlanHooks`), sized by what the model passes them, so any model whose plan
//! names its mixtures trains expert-parallel; every step's collectives are counted into the
//! run record.

use super::options::{EpError, EpFault, EpOptions};
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::compose::data::{DataLayer, SplitState};
use crate::compose::DataParallel;
use crate::fsdp::Fsdp;
use crate::record::RunRecord;
use crate::tensor_parallel::hooks::{ExpertsParallel, PlanHooks};
use crate::tensor_parallel::run::aliases;
use crate::train::{
    train_from, GradientView, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::plan::ParallelStyle;
use lockstep_models::{LayerHooks, Model, ParallelPlan};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use tch::Tensor;

/// Checks before any rank starts that `model` can run expert-parallel at `world_size`: its
/// plan names a mixture of experts ([`ParallelStyle::Expert`]) whose experts divide by the
/// expert-parallel size. Returns the plan and the experts per mixture.
pub fn check_expert_plan(
    model: &dyn Model,
    world_size: usize,
    opts: &EpOptions,
) -> Result<(ParallelPlan, usize), EpError> {
    check_expert_plan_with(model, world_size, opts, model.parallel_plan(false))
}

/// [`check_expert_plan`] for a plan the caller passes (`None`: the model has none).
pub fn check_expert_plan_with(
    model: &dyn Model,
    world_size: usize,
    opts: &EpOptions,
    plan: Option<ParallelPlan>,
) -> Result<(ParallelPlan, usize), EpError> {
    let plan = plan.filter(|p| p.rules.iter().any(|r| r.style == ParallelStyle::Expert));
    let experts = model.tags().experts.iter().map(|e| e.expert + 1).max();
    let (Some(plan), Some(experts)) = (plan, experts) else {
        return Err(EpError::Invalid(format!(
            "model `{}` has no mixture-of-experts layer to distribute (its parallel plan \
             names none with the Expert style, or it tags no expert parameters)",
            model.name()
        )));
    };
    if opts.ep == 0 || world_size == 0 || !world_size.is_multiple_of(opts.ep) {
        return Err(EpError::Invalid(format!(
            "expert-parallel size {} does not divide world size {world_size}",
            opts.ep
        )));
    }
    if !experts.is_multiple_of(opts.ep) {
        return Err(EpError::Invalid(format!(
            "{experts} experts do not divide over an expert-parallel group of {}",
            opts.ep
        )));
    }
    Ok((plan, experts))
}

/// Trains `model` (built whole on every rank) expert-parallel by its plan. `RunRecord.collectives` holds each step's training collectives on this
/// rank (dispatch forward and backward, gradient reductions); the broadcasts that assemble
/// full gradients for the record's norm and the loss average are record keeping, not counted.
pub fn train_expert_parallel(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &EpOptions,
) -> Result<RunRecord, EpError> {
    train_expert_parallel_with_plan(model, world, cfg, opts, model.parallel_plan(false))
}

/// [`train_expert_parallel`] by a plan the caller passes: its `Expert` modules are
/// distributed, its other rules apply on a TP group of one.
pub fn train_expert_parallel_with_plan(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &EpOptions,
    plan: Option<ParallelPlan>,
) -> Result<RunRecord, EpError> {
    let mut run = EpRun::new(model, world, opts, plan)?;
    let mut record = train_from(model, cfg, &mut run, None, &TrainStart::default())
        .map(|(record, _)| record)
        .map_err(TrainError::into_strategy::<EpError>)?;
    record.placements = run.placement_table(opts.ep);
    Ok(record)
}

impl EpRun {
    /// Where every parameter lived, for the record (and so the report): each expert's on the
    /// `ep` rank holding it, the rest replicated.
    fn placement_table(&self, ep: usize) -> Vec<crate::record::TensorPlacement> {
        self.named
            .iter()
            .map(|(tensor, _)| {
                let placement = match self.expert_of.get(tensor) {
                    Some(&e) => format!("expert {e} on ep rank {} of {ep}", e / self.per),
                    None => "replicated".to_owned(),
                };
                crate::record::TensorPlacement {
                    tensor: tensor.clone(),
                    placement,
                }
            })
            .collect()
    }
}

/// One rank's expert-parallel run: its groups, the experts it holds, the dense parameters'
/// unit under EP×FSDP, and the plan's hooks with the dispatcher.
struct EpRun {
    rank: usize,
    ep_group: Arc<dyn ProcessGroup>,
    edp_group: Arc<dyn ProcessGroup>,
    everyone: Arc<dyn ProcessGroup>,
    ep_rank: usize,
    /// Experts per rank.
    per: usize,
    expert_of: HashMap<String, usize>,
    /// Every parameter of the whole model (the record's names).
    named: Vec<(String, Tensor)>,
    /// What this rank trains (the dense parameters and its own experts), the data dimension
    /// over it (every tensor replicated, or under EP×FSDP the dense parameters one unit
    /// sharded over the world, the experts whole beside it), its collectives' counts.
    split: SplitState,
    hooks: PlanHooks,
    /// What an expert's summed gradient is scaled by (1 / world; a planted fault's other).
    expert_scale: f64,
    /// Planted: the gradient norm counts this rank's own experts only.
    norm_over_own_experts: bool,
}

impl EpRun {
    fn new(
        model: &dyn Model,
        world: &World,
        opts: &EpOptions,
        plan: Option<ParallelPlan>,
    ) -> Result<EpRun, EpError> {
        let world_size = world.size();
        let (plan, experts) = check_expert_plan_with(model, world_size, opts, plan)?;
        let ep = opts.ep;
        let mesh = DeviceMesh::new(world, &[("edp", world_size / ep), ("ep", ep)])?;
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let ep_group = counted(mesh.group("ep")?);
        let edp_group = counted(mesh.group("edp")?);
        let everyone = counted(world.group());
        let singles: Vec<Vec<usize>> = (0..world_size).map(|r| vec![r]).collect();
        let alone = world
            .new_groups(&singles, "ep-self")?
            .ok_or_else(|| EpError::Invalid("no single-rank group".into()))?;
        let ep_rank = mesh.coordinate("ep")?;
        let per = experts / ep;
        let first = ep_rank * per;
        let expert_of: HashMap<String, usize> = model
            .tags()
            .experts
            .iter()
            .map(|e| (e.name.clone(), e.expert))
            .collect();
        let named = model.named_parameters();
        let mine = |name: &str| {
            expert_of
                .get(name)
                .is_none_or(|&e| (first..first + per).contains(&e))
        };
        let trained: Vec<(String, Tensor)> = named
            .iter()
            .filter(|(n, _)| mine(n))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let (unit, unsharded) = split_dense(&trained, &expert_of, opts, &everyone)?;
        // The plan's other rules apply on a TP group of one (every tensor whole): the same
        // functions, so EP runs the model as TP does.
        let hooks = PlanHooks::new(alone, 0, &named, &aliases(model), plan, &model.layers())
            .with_experts(ExpertsParallel {
                group: ep_group.clone(),
                dispatcher: opts.dispatcher,
                capacity_factor: opts.capacity_factor,
                first,
                per,
                extra_slot: opts.fault == Some(EpFault::CapacityOffByOne),
            });
        let expert_scale = if opts.fault == Some(EpFault::ExpertGradsReducedOverEp) {
            ep as f64 / world_size as f64
        } else {
            1.0 / world_size as f64
        };
        Ok(EpRun {
            rank: world.rank(),
            ep_group,
            edp_group,
            everyone,
            ep_rank,
            per,
            expert_of,
            named,
            split: SplitState::new(trained, DataLayer::new(unit, unsharded), counts),
            hooks,
            expert_scale,
            norm_over_own_experts: opts.fault == Some(EpFault::NormOverOwnExperts),
        })
    }

    /// Every parameter at full size from this rank's `value` of it: the unit's gathered, each
    /// expert's from the rank holding it.
    fn full(&self, value: impl Fn(&Tensor) -> Tensor) -> Result<Vec<(String, Tensor)>, EpError> {
        let unit = self.split.data.unit().map(|u| u.borrow());
        let local = local_values(&self.named, unit.as_deref(), value)?;
        Ok(full_expert_tensors(
            &local,
            &self.expert_of,
            self.per,
            self.ep_rank,
            self.ep_group.as_ref(),
        )?)
    }
}

/// An expert-parallel rank as a strategy of the one training loop: every rank its own batch
/// through the plan's hooks (tokens dispatched to their experts), expert gradients summed over
/// the ranks holding the same experts, dense ones averaged (or reduce-scattered) over the world.
impl StepHooks for EpRun {
    fn split_state(&self) -> Option<&SplitState> {
        Some(&self.split)
    }

    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        Some(&mut self.hooks)
    }

    fn forward_backward(
        &mut self,
        model: &dyn Model,
        _data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let batch = model.input(self.rank, step)?;
        let loss = model.loss_hooked(&batch, &mut self.hooks)?;
        StepLoss::backward(&loss)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        reduce_grads(
            self.split.data.whole(),
            &self.expert_of,
            &self.edp_group,
            &self.everyone,
            self.expert_scale,
        )
        .map_err(TrainError::strategy)?;
        self.split
            .data
            .reduce_gradients()
            .map_err(TrainError::strategy)
    }

    fn mean_loss(
        &mut self,
        local: StepLoss,
        _metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        // On the loss's device: the groups reduce tensors where the training computes.
        let value = local.tensor()?;
        self.everyone.all_reduce(&value, ReduceOp::Avg)?;
        Ok(value.f_double_value(&[0])?)
    }

    fn gradient_view(
        &mut self,
        _grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<GradientView, TrainError> {
        let full = self.full(|t| t.grad()).map_err(TrainError::strategy)?;
        if self.norm_over_own_experts {
            let own = |name: &str| {
                self.expert_of
                    .get(name)
                    .is_none_or(|&e| e / self.per == self.ep_rank)
            };
            return GradientView::of_full_counting(full, keep, &own);
        }
        GradientView::of_full(full, keep)
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

/// EP×FSDP: the dense parameters become one unit sharded over the world (experts stay whole
/// on their rank: their data dimension is edp). Returns the unit and what the optimizer steps
/// besides its shard.
#[allow(clippy::type_complexity)]
fn split_dense(
    trained: &[(String, Tensor)],
    expert_of: &HashMap<String, usize>,
    opts: &EpOptions,
    everyone: &Arc<dyn ProcessGroup>,
) -> Result<(Option<Fsdp>, Vec<(String, Tensor)>), EpError> {
    let in_unit: HashSet<String> = match opts.data_parallel {
        DataParallel::Replicate => HashSet::new(),
        DataParallel::Shard => trained
            .iter()
            .filter(|(n, _)| !expert_of.contains_key(n))
            .map(|(n, _)| n.clone())
            .collect(),
        DataParallel::HybridShard { .. } | DataParallel::HybridReplicate { .. } => {
            return Err(EpError::Invalid(
                "the dense parameters are replicated or sharded over the world, not hybrid".into(),
            ))
        }
    };
    let pick = |inside: bool| -> Vec<(String, Tensor)> {
        trained
            .iter()
            .filter(|(n, _)| in_unit.contains(n) == inside)
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    };
    let unit = if in_unit.is_empty() {
        None
    } else {
        Some(Fsdp::over_tensors(
            "ep_dense",
            pick(true),
            everyone.clone(),
            None,
        )?)
    };
    Ok((unit, pick(false)))
}

/// Reduces the gradients of the tensors outside the unit: experts summed over `edp` (the
/// ranks holding the same experts) and scaled by `expert_scale`, dense ones averaged over the
/// world.
fn reduce_grads(
    unsharded: &[(String, Tensor)],
    expert_of: &HashMap<String, usize>,
    edp_group: &Arc<dyn ProcessGroup>,
    everyone: &Arc<dyn ProcessGroup>,
    expert_scale: f64,
) -> Result<(), EpError> {
    for (name, t) in unsharded {
        let mut g = t.grad();
        if !g.defined() {
            g = t.f_zeros_like()?;
            crate::autograd::set_grad(t, Some(&g)).map_err(|e| EpError::Invalid(e.to_string()))?;
        }
        if expert_of.contains_key(name) {
            // A group of one (ep = world) has nothing to sum: no collective.
            if edp_group.size() > 1 {
                edp_group.all_reduce(&g, ReduceOp::Sum)?;
            }
            let _ = g.f_mul_scalar_(expert_scale)?;
        } else {
            everyone.all_reduce(&g, ReduceOp::Avg)?;
        }
    }
    Ok(())
}

/// Every parameter's `value` on this rank (its data or gradient; zeros where undefined),
/// with the sharded unit's parameters gathered from their shards (the compute tensors may be
/// freed).
fn local_values(
    named: &[(String, Tensor)],
    unit: Option<&Fsdp>,
    value: impl Fn(&Tensor) -> Tensor,
) -> Result<Vec<(String, Tensor)>, EpError> {
    let gathered: HashMap<String, Tensor> = match unit {
        Some(u) => u.full_values(&value)?.into_iter().collect(),
        None => HashMap::new(),
    };
    named
        .iter()
        .map(|(name, t)| {
            if let Some(v) = gathered.get(name) {
                return Ok((name.clone(), v.shallow_clone()));
            }
            let v = value(t);
            let v = if v.defined() {
                v.f_detach_copy()?
            } else {
                t.f_zeros_like()?
            };
            Ok((name.clone(), v))
        })
        .collect()
}

/// Every parameter as a whole model has it: dense ones as they are, each expert's from the
/// `ep` rank holding it (a broadcast over the `ep` group keeps the bits).
pub(crate) fn full_expert_tensors(
    local: &[(String, Tensor)],
    expert_of: &HashMap<String, usize>,
    per: usize,
    ep_rank: usize,
    ep_group: &dyn ProcessGroup,
) -> Result<Vec<(String, Tensor)>, crate::failure::SplitFailure> {
    local
        .iter()
        .map(|(name, v)| {
            if let Some(&e) = expert_of.get(name) {
                let owner = e / per;
                let buf = if owner == ep_rank {
                    v.shallow_clone()
                } else {
                    v.f_zeros_like()?
                };
                let buf = buf.f_contiguous()?;
                ep_group.broadcast(&buf, owner)?;
                return Ok((name.clone(), buf));
            }
            Ok((name.clone(), v.shallow_clone()))
        })
        .collect()
}
