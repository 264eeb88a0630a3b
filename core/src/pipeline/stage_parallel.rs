//! What runs inside a pipeline's stages and across its replicas when parallelisms compose
//! ([`StageParallel`]): each stage's tensor parallelism (this rank's TP shards, the hooks that
//! compute the stage's layers with them, the vocabulary-parallel loss), FSDP's schedule
//! actions for a sharded data dimension, and the full-size values a composed run records.

use super::schedule::{Action, ActionKind};
use super::PipelineError;
use crate::comm::ProcessGroup;
use crate::compose::DataParallel;
use crate::fsdp::Fsdp;
use crate::tensor_parallel::hooks::PlanHooks;
use crate::tensor_parallel::run::{aliases, local_parameters, placement_text, tp_coordinate};
use crate::tensor_parallel::{check_plan, model_plan, Placement};
use lockstep_models::{Batch, LayerHooks, Model};
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// What runs inside each pipeline stage and across its replicas: tensor parallelism of the
/// stage's layers (`tp` ranks compute each stage together) and the data dimension
/// (replicas all-reduce, or FSDP shards each stage's parameters over `dp` through the
/// schedule's `UNSHARD`, `RESHARD` and `REDUCE_GRAD` actions).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageParallel {
    /// Tensor-parallel size inside each stage (1: none).
    pub tp: usize,
    /// How replicas keep parameters and reduce gradients.
    pub data: DataParallel,
}

impl Default for StageParallel {
    fn default() -> Self {
        StageParallel {
            tp: 1,
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

/// The tensor-parallel side of a PP×TP stage: this rank's TP shards and the hooks that run
/// the stage's modules with them by the model's plan (the loss too: loss parallel).
pub(super) struct StageTp {
    /// Every parameter as this rank computes with it (TP shards where the plan splits).
    pub(super) local: Vec<(String, Tensor)>,
    placements: HashMap<String, Placement>,
    pub(super) hooks: RefCell<Box<dyn LayerHooks>>,
    group: Arc<dyn ProcessGroup>,
    rank: usize,
}

impl StageTp {
    /// How the stage's TP plan holds `name`, for the record's placements.
    pub(super) fn placement_text(&self, name: &str) -> String {
        placement_text(self.placements.get(name), self.group.size())
    }

    /// The stage's TP degree.
    pub(super) fn group_size(&self) -> usize {
        self.group.size()
    }

    /// Which copy of TP-local tensor `name` this rank holds, for the cross-rank check.
    pub(super) fn coordinate(&self, name: &str) -> String {
        tp_coordinate(&self.placements, name, self.rank, self.group.size())
    }

    pub(super) fn new(
        model: &dyn Model,
        world_size: usize,
        tp: usize,
        rank: usize,
        group: Arc<dyn ProcessGroup>,
    ) -> Result<StageTp, PipelineError> {
        let tp_error =
            |e: crate::tensor_parallel::TpError| PipelineError::InvalidPlan(e.to_string());
        let opts = crate::tensor_parallel::TpOptions {
            tp,
            sequence_parallel: false,
            data_parallel: DataParallel::Replicate,
            fault: None,
        };
        let placements = check_plan(model, world_size, &opts).map_err(tp_error)?;
        let plan =
            model_plan(model, &opts).map_err(|e| PipelineError::InvalidPlan(e.to_string()))?;
        let local = local_parameters(model, &placements, rank, tp)
            .map_err(|e| PipelineError::InvalidPlan(e.to_string()))?;
        let hooks = PlanHooks::new(
            group.clone(),
            rank,
            &local,
            &aliases(model),
            plan,
            &model.layers(),
        );
        Ok(StageTp {
            local,
            placements,
            hooks: RefCell::new(Box::new(hooks)),
            group,
            rank,
        })
    }

    /// The microbatch's loss through the plan's hooks (this rank's vocabulary slice of the
    /// logits under a vocabulary-parallel plan).
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
    stage_tp: Option<&StageTp>,
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
            let v = match stage_tp.and_then(|s| s.placements.get(name).map(|p| (s, p))) {
                Some((s, Placement::Shard { dim })) => {
                    crate::tensor_parallel::unshard(&v, *dim, s.group.as_ref())
                        .map_err(|e| PipelineError::Execution(e.to_string()))?
                }
                _ => v,
            };
            debug_assert_eq!(v.size(), full.size());
            Ok((name.clone(), v))
        })
        .collect()
}
