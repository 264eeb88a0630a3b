//! What runs inside a pipeline's stages and across its replicas when parallelisms compose
//! ([`StageParallel`]): each stage's tensor parallelism (this rank's TP shards, the hooks that
//! compute the stage's layers with them, the vocabulary-parallel loss) and context
//! parallelism (each microbatch cut along the sequence, attention across the CP ranks of the
//! stage, global positions, the loss as the shard's share), FSDP's schedule actions for a
//! sharded data dimension, and the full-size values a composed run records.

use super::schedule::{Action, ActionKind};
use super::PipelineError;
use crate::comm::ProcessGroup;
use crate::compose::DataParallel;
use crate::context_parallel::{CpHooks, CpOptions};
use crate::fsdp::Fsdp;
use crate::tensor_parallel::hooks::{ExpertsParallel, PlanHooks};
use crate::tensor_parallel::run::{aliases, local_parameters, placement_text, tp_coordinate};
use crate::tensor_parallel::{check_plan, model_plan, Placement};
use lockstep_models::{Batch, LayerHooks, Model};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// What runs inside each pipeline stage and across its replicas: context and tensor
/// parallelism of the stage's layers (`cp · tp` ranks compute each stage together, the mesh
/// `[dp, pp, cp, tp]`) and the data dimension (replicas all-reduce, or FSDP shards each
/// stage's parameters over `dp` (`dp × cp` with CP) through the schedule's `UNSHARD`,
/// `RESHARD` and `REDUCE_GRAD` actions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageParallel {
    /// Tensor-parallel size inside each stage (1: none).
    pub tp: usize,
    /// Context-parallel size inside each stage (1: none): ring attention, load-balanced.
    pub cp: usize,
    /// Expert-parallel size inside each stage (1: experts replicated): each mixture's experts
    /// spread over `ep` ranks borrowed from the stage's data group (`dp × cp`, or under HSDP
    /// `dp_shard × cp`), as torchtitan borrows them from `dp_shard × cp`.
    pub ep: usize,
    /// A context-parallel bug planted in the stages' attention or positions (tests only).
    pub cp_fault: Option<crate::context_parallel::CpFault>,
    /// How replicas keep parameters and reduce gradients.
    pub data: DataParallel,
}

impl Default for StageParallel {
    fn default() -> Self {
        StageParallel {
            tp: 1,
            cp: 1,
            ep: 1,
            cp_fault: None,
            data: DataParallel::Replicate,
        }
    }
}

/// Inserts FSDP's actions for this rank's `stage` into its action list: `UNSHARD` before its
/// first action; `REDUCE_GRAD` and then `RESHARD` after its last. Past every send, the
/// tied-weight reduction inside `REDUCE_GRAD` never waits on a rank that waits on this one:
/// every rank's remaining sends are issued before it, and the backends' sends complete
/// without the receiver (buffered), so no rank blocks in a send while its peer sits in the
/// all-reduce. `early` plants the bug of reducing right after the first backward (after that
/// backward's `SEND_B`, so a model with tied weights is caught, not hung).
pub(super) fn insert_sharding_actions(actions: &mut Vec<Action>, stage: usize, early: bool) {
    actions.insert(0, Action::new(stage, ActionKind::Unshard, None));
    let reduce = Action::new(stage, ActionKind::ReduceGrad, None);
    let first_backward = actions.iter().position(|a| {
        a.stage == stage
            && matches!(
                a.kind,
                ActionKind::FullBackward | ActionKind::BackwardWeight
            )
    });
    match (early, first_backward) {
        (true, Some(i)) => {
            let microbatch = actions[i].microbatch;
            let after = actions[i..]
                .iter()
                .position(|a| {
                    a.stage == stage && a.kind == ActionKind::SendB && a.microbatch == microbatch
                })
                .map_or(i, |j| i + j);
            actions.insert(after + 1, reduce);
        }
        _ => actions.push(reduce),
    }
    actions.push(Action::new(stage, ActionKind::Reshard, None));
}

/// The context-parallel side of a PP×CP stage: which shard of each sequence this rank holds.
pub(super) struct StageCp {
    opts: CpOptions,
    rank: usize,
}

/// What splits a PP×TP or PP×CP stage inside it: this rank's TP shards and the hooks that
/// run the stage's modules with them by the model's plan (the loss too: loss parallel), and
/// under CP the hooks around them that bring the other shards' keys and values, give global
/// positions and make each microbatch's loss the shard's share.
pub(super) struct StageSplit {
    /// Every parameter as this rank computes with it (TP shards where the plan splits).
    pub(super) local: Vec<(String, Tensor)>,
    placements: HashMap<String, Placement>,
    pub(super) hooks: RefCell<Box<dyn LayerHooks>>,
    /// The stage's TP group (`None` without TP).
    group: Option<Arc<dyn ProcessGroup>>,
    rank: usize,
    cp: Option<StageCp>,
}

impl StageSplit {
    /// How the stage's TP plan holds `name`, for the record's placements.
    pub(super) fn placement_text(&self, name: &str) -> String {
        let mut text = placement_text(self.placements.get(name), self.group_size());
        if let Some(cp) = &self.cp {
            text.push_str(&format!(
                ", gradient summed over cp={} (sequence shards)",
                cp.opts.cp
            ));
        }
        text
    }

    /// The stage's TP degree.
    pub(super) fn group_size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.size())
    }

    /// Whether anything splits the stage (TP or CP above 1).
    pub(super) fn splits(&self) -> bool {
        self.group_size() > 1 || self.cp.is_some()
    }

    /// Which copy of TP-local tensor `name` this rank holds, for the cross-rank check.
    pub(super) fn coordinate(&self, name: &str) -> String {
        tp_coordinate(&self.placements, name, self.rank, self.group_size())
    }

    /// The split of a stage on this rank: TP rank `rank` of `group` (`None`: no TP), CP
    /// rank `cp_rank` of `cp_group` (`None`: no CP), and how the mixtures dispatch to the
    /// experts spread over the stage's EP group (`None`: no EP; without TP the plan runs on
    /// the group of this rank alone given with it).
    pub(super) fn new(
        model: &dyn Model,
        world_size: usize,
        tp: Option<(Arc<dyn ProcessGroup>, usize)>,
        cp: Option<(Arc<dyn ProcessGroup>, usize)>,
        cp_fault: Option<crate::context_parallel::CpFault>,
        experts: Option<(ExpertsParallel, Arc<dyn ProcessGroup>)>,
    ) -> Result<StageSplit, PipelineError> {
        let invalid = |e: &dyn std::fmt::Display| PipelineError::InvalidPlan(e.to_string());
        let (placements, local, plan_hooks, group, rank) = match tp {
            Some((group, rank)) => {
                let opts = crate::tensor_parallel::TpOptions {
                    tp: group.size(),
                    sequence_parallel: false,
                    data_parallel: DataParallel::Replicate,
                    fault: None,
                };
                let placements = check_plan(model, world_size, &opts).map_err(|e| invalid(&e))?;
                let plan = model_plan(model, &opts).map_err(|e| invalid(&e))?;
                let local = local_parameters(model, &placements, rank, group.size())
                    .map_err(|e| invalid(&e))?;
                let mut hooks = PlanHooks::new(
                    group.clone(),
                    rank,
                    &local,
                    &aliases(model),
                    plan,
                    &model.layers(),
                );
                if let Some((dispatch, _)) = experts {
                    hooks = hooks.with_experts(dispatch);
                }
                hooks = hooks.with_fault(tp_fault_of(cp_fault));
                let hooks: Box<dyn LayerHooks> = Box::new(hooks);
                (placements, local, Some(hooks), Some(group), rank)
            }
            None => {
                let local = model.named_parameters();
                // EP alone: the plan's other rules on a group of one (every tensor whole).
                let hooks = match experts {
                    Some((dispatch, alone)) => {
                        let plan = model.parallel_plan(false).ok_or_else(|| {
                            PipelineError::InvalidPlan(format!(
                                "PP×EP dispatches through the model's plan; `{}` offers none",
                                model.name()
                            ))
                        })?;
                        let hooks = PlanHooks::new(
                            alone,
                            0,
                            &local,
                            &aliases(model),
                            plan,
                            &model.layers(),
                        )
                        .with_experts(dispatch);
                        Some(Box::new(hooks) as Box<dyn LayerHooks>)
                    }
                    None => None,
                };
                (HashMap::new(), local, hooks, None, 0)
            }
        };
        let (hooks, cp): (Box<dyn LayerHooks>, _) = match (cp, plan_hooks) {
            (Some((cp_group, cp_rank)), inner) => {
                let opts = CpOptions {
                    fault: cp_fault,
                    ..CpOptions::ring(cp_group.size())
                };
                let seq = model
                    .input(0, 0)?
                    .inputs
                    .first()
                    .map_or(0, |t| t.size().get(1).copied().unwrap_or(0));
                let mut hooks = CpHooks::new(cp_group, cp_rank, opts.clone()).in_pipeline(seq);
                if let Some(inner) = inner {
                    hooks = hooks.around(inner);
                }
                (
                    Box::new(hooks),
                    Some(StageCp {
                        opts,
                        rank: cp_rank,
                    }),
                )
            }
            (None, Some(inner)) => (inner, None),
            (None, None) => (Box::new(lockstep_models::NoHooks), None),
        };
        Ok(StageSplit {
            local,
            placements,
            hooks: RefCell::new(hooks),
            group,
            rank,
            cp,
        })
    }

    /// This rank's part of a microbatch: under CP its shard of every sequence (tokens and
    /// targets cut alike; labels were shifted before, in the whole batch), else the batch.
    pub(super) fn cut(&self, batch: Batch) -> Result<Batch, PipelineError> {
        let Some(cp) = &self.cp else {
            return Ok(batch);
        };
        let cut = |t: &Tensor| {
            crate::context_parallel::shard_sequence(t, 1, cp.opts.layout, cp.rank, cp.opts.cp)
                .map_err(|e| PipelineError::Execution(e.to_string()))
        };
        Ok(Batch {
            inputs: batch.inputs.iter().map(cut).collect::<Result<_, _>>()?,
            target: batch.target.as_ref().map(cut).transpose()?,
        })
    }

    /// The microbatch's loss through the stage's hooks (this rank's vocabulary slice of the
    /// logits under a vocabulary-parallel plan; its sequence shard's share under CP).
    pub(super) fn loss(
        &self,
        model: &dyn Model,
        batch: &Batch,
        output: &Tensor,
    ) -> Result<Tensor, PipelineError> {
        let mut hooks = self.hooks.borrow_mut();
        Ok(model.loss_of_hooked(batch, output, hooks.as_mut())?)
    }
}

/// Checks that `model`'s stages can be tensor-parallel (PP×TP): it offers a plan
/// ([`Model::parallel_plan`]) and runs its layers through hooks.
pub(crate) fn check_stage_tp(model: &dyn Model) -> Result<(), PipelineError> {
    if model.parallel_plan(false).is_none() || !model.supports_layer_hooks() {
        return Err(PipelineError::InvalidPlan(format!(
            "PP×TP splits stages by the model's parallel plan through its layer and module \
             hooks; `{}` offers no plan",
            model.name()
        )));
    }
    if model.batch_dim() != 0 {
        // Not yet supported: a sequence-first model's microbatches (cut along dim 1) fail
        // inside the stages' tensor-parallel layers.
        return Err(PipelineError::InvalidPlan(format!(
            "PP×TP runs batch-first models (microbatches cut along dim 0); `{}` is sequence \
             first",
            model.name()
        )));
    }
    Ok(())
}

/// Every parameter's `value` at its full size on this rank: the sharded unit's gathered over
/// dp, TP shards gathered over tp, the rest as they are (zeros where undefined: parameters
/// this rank does not hold, whose owner's values `gather_owned` takes).
pub(super) fn full_values(
    named: &[(String, Tensor)],
    model_params: &[(String, Tensor)],
    unit: Option<&RefCell<Fsdp>>,
    stage_split: Option<&StageSplit>,
    value: impl Fn(&Tensor) -> Tensor,
) -> Result<Vec<(String, Tensor)>, PipelineError> {
    let gathered: HashMap<String, Tensor> = match unit {
        Some(u) => u.borrow().full_values(&value)?.into_iter().collect(),
        None => HashMap::new(),
    };
    named
        .iter()
        .zip(model_params)
        .map(|((name, t), (_, full))| {
            let v = match gathered.get(name) {
                Some(v) => v.shallow_clone(),
                None => {
                    let v = value(t);
                    if v.defined() {
                        v.f_detach()?
                    } else {
                        t.f_zeros_like()?
                    }
                }
            };
            let split =
                stage_split.and_then(|s| Some((s.placements.get(name)?, s.group.as_ref()?)));
            let v = match split {
                Some((Placement::Shard { dim }, group)) => {
                    crate::tensor_parallel::unshard(&v, *dim, group.as_ref())
                        .map_err(|e| PipelineError::Execution(e.to_string()))?
                }
                _ => v,
            };
            debug_assert_eq!(v.size(), full.size());
            Ok((name.clone(), v))
        })
        .collect()
}

/// The TP fault a stage's TP hooks plant for the stage's planted CP-loop fault (a field bug's
/// mechanism: the column-parallel entry's backward all-reduce skipped).
fn tp_fault_of(
    cp_fault: Option<crate::context_parallel::CpFault>,
) -> Option<crate::tensor_parallel::TpFault> {
    (cp_fault == Some(crate::context_parallel::CpFault::TpInputGradNotReduced))
        .then_some(crate::tensor_parallel::TpFault::MissingBackwardAllReduce)
}
