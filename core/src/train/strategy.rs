//! What a parallelism does around each step of the one training loop ([`super::train_from`]).
//!
//! Every parallelism is a [`StepHooks`]: DDP and FSDP, tensor and expert parallelism, the
//! pipeline (whose executor is its forward and backward) and a user's gradient closure. The
//! loop owns the order (zero, forward and backward, synchronize, record, clip, step, check);
//! a strategy says which tensors this rank trains, how its objective is computed, how
//! gradients are reduced and how the record sees full tensors. Each hook's default is what a
//! replicating wrapper (DDP) needs.

use super::optim::Optimizer;
use super::update::{clip_coefficient, observe_stepped, scale_gradients};
use super::{global_mean, grad_norm, gradients, mean_loss, TrainError};
use crate::comm::ProcessGroup;
use crate::compose::data::{DataLayer, SplitState};
use crate::consistency::{StateKind, StateProbe};
use crate::record::CollectiveEntry;
use lockstep_models::{LayerHooks, Model, NoHooks};
use tch::Tensor;

/// This rank's objective for one step, after its backward: its value and the device it was
/// computed on (the loss average over ranks is reduced there).
#[derive(Clone, Copy, Debug)]
pub struct StepLoss {
    /// The objective's value on this rank.
    pub value: f64,
    /// Where the objective lived (NCCL reduces CUDA tensors only).
    pub device: tch::Device,
}

impl StepLoss {
    /// Runs `loss`'s backward and returns it as this step's objective.
    pub fn backward(loss: &Tensor) -> Result<StepLoss, TrainError> {
        loss.f_backward()?;
        Ok(StepLoss {
            value: loss.f_double_value(&[])?,
            device: loss.device(),
        })
    }

    /// The value as a one-element tensor on its device, for reducing over ranks.
    pub fn tensor(&self) -> Result<Tensor, TrainError> {
        Ok(Tensor::from_slice(&[self.value]).f_to_device(self.device)?)
    }
}

/// The record's view of one step's gradients: their global norm, and every gradient at full
/// size when the record keeps them.
pub struct GradientView {
    /// The L2 norm over every parameter's full gradient (tied ones once), in f64.
    pub norm: f64,
    /// Every parameter's full gradient, when asked for.
    pub full: Option<Vec<(String, Tensor)>>,
}

impl GradientView {
    /// The view of gradients a strategy assembled at full size: their norm, and the
    /// gradients themselves when `keep`.
    pub fn of_full(full: Vec<(String, Tensor)>, keep: bool) -> Result<GradientView, TrainError> {
        Ok(GradientView {
            norm: grad_norm(&full)?,
            full: keep.then_some(full),
        })
    }

    /// [`GradientView::of_full`] with the norm taken over the gradients `counted` names only:
    /// a planted undercount (`NormOverOwnExperts`: experts held by other ranks left out, as
    /// a norm reduced over the wrong group leaves them). The gradients kept are all of them.
    pub(crate) fn of_full_counting(
        full: Vec<(String, Tensor)>,
        keep: bool,
        counted: &dyn Fn(&str) -> bool,
    ) -> Result<GradientView, TrainError> {
        let some: Vec<(String, Tensor)> = full
            .iter()
            .filter(|(n, _)| counted(n))
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        Ok(GradientView {
            norm: grad_norm(&some)?,
            full: keep.then_some(full),
        })
    }
}

/// Gradient synchronization between backward and the optimizer step. It receives every
/// parameter's gradient by name (the tensors `.grad` holds, so in-place collectives update
/// them) and must leave them as the optimizer should see them.
pub type GradSync<'a> = dyn FnMut(&[(String, Tensor)]) -> Result<(), TrainError> + 'a;

/// What a parallel wrapper (DDP, FSDP…) does around each training step. A plain gradient
/// synchronization closure is one (its `before_forward` does nothing).
pub trait StepHooks {
    /// The tensors this rank trains: zeroed before each step, handed to the optimizer,
    /// reported to the probe. The model's parameters by default; a tensor-parallel rank's
    /// shards stand in for the parameters it splits.
    fn parameters(&self, model: &dyn Model) -> Vec<(String, Tensor)> {
        match self.split_state() {
            Some(split) => split
                .trained
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect(),
            None => model.named_parameters(),
        }
    }

    /// What a model-splitting strategy (TP, EP, the CP loop) trains, keeps over the data
    /// dimension and counts ([`SplitState`]): with it, the defaults of
    /// [`StepHooks::parameters`], [`StepHooks::before_forward`], [`StepHooks::data_layer`]
    /// and [`StepHooks::step_collectives`] serve the strategy. None by default.
    fn split_state(&self) -> Option<&SplitState> {
        None
    }

    /// Runs before the step's forward pass (DDP broadcasts buffers here; a split strategy's
    /// data dimension gathers its unit, and the step's collective count starts afresh).
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        match self.split_state() {
            Some(split) => {
                let _ = split.counts.take();
                split.data.gather()
            }
            None => Ok(()),
        }
    }

    /// Hooks to run around every layer during forward (FSDP's per-unit gather and free,
    /// mixed precision's casts), if the wrapper has any.
    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        None
    }

    /// This step's forward and backward: the objective (by default the mean over
    /// `data_ranks`' batches of the model's loss, through [`StepHooks::layer_hooks`]) and its
    /// backward. A pipeline's executor runs its schedule here.
    fn forward_backward(
        &mut self,
        model: &dyn Model,
        data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let objective = match self.layer_hooks() {
            Some(hooks) => mean_loss(model, data_ranks, step, hooks)?,
            None => mean_loss(model, data_ranks, step, &mut NoHooks)?,
        };
        objective.f_backward()?;
        Ok(StepLoss {
            value: objective.f_double_value(&[])?,
            device: objective.device(),
        })
    }

    /// The data dimension a model-splitting strategy (tensor, expert or pipeline
    /// parallelism) stacks on the tensors it leaves this rank: the loop then clips and steps
    /// through it, and the strategy reduces gradients where they live. `None` (the default)
    /// for a wrapper over the whole model.
    fn data_layer(&self) -> Option<&DataLayer> {
        self.split_state().map(|split| &split.data)
    }

    /// Every trained tensor's gradient after backward, for [`StepHooks::sync_gradients`]. By
    /// default a tensor without one is an error (synchronizing a partial set would
    /// desynchronize ranks). Under a [`StepHooks::data_layer`] none: the strategy reduces
    /// gradients where they live (its tensors, or the unit's) and the record sees them
    /// through [`StepHooks::gradient_view`].
    fn local_gradients(
        &mut self,
        params: &[(String, Tensor)],
        step: usize,
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        match self.data_layer() {
            Some(_) => Ok(Vec::new()),
            None => gradients(params, step),
        }
    }

    /// Makes the gradients of this rank the synchronized ones, after backward.
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError>;

    /// The collectives this rank ran since the last call, for the record, when the strategy
    /// counts them. The loop calls it right after [`StepHooks::sync_gradients`], again after
    /// its record keeping (full gradients, the loss average: dropped, not the step's
    /// traffic) and after the optimizer step (clipping's norm, a sharded step), and records
    /// the first and last as the step's.
    fn step_collectives(&mut self) -> Option<Vec<CollectiveEntry>> {
        self.split_state()
            .map(|split| CollectiveEntry::from_counts(split.counts.take()))
    }

    /// The loss the record reports for this step: this rank's averaged over `metrics` (the
    /// world) by default; a strategy whose ranks share one objective averages over replicas.
    fn mean_loss(
        &mut self,
        local: StepLoss,
        metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        global_mean(local.value, local.device, metrics)
    }

    /// The record's view of this step's synchronized gradients `grads`: their norm, and full
    /// copies when `keep` (the record keeps every gradient). A strategy holding parts of
    /// tensors (shards, some experts, some stages) assembles them here.
    fn gradient_view(
        &mut self,
        grads: &[(String, Tensor)],
        keep: bool,
    ) -> Result<GradientView, TrainError> {
        Ok(GradientView {
            norm: grad_norm(grads)?,
            full: keep.then(|| {
                grads
                    .iter()
                    .map(|(n, g)| (n.clone(), g.shallow_clone()))
                    .collect()
            }),
        })
    }

    /// Runs the optimizer step itself, if the wrapper owns the parameters the optimizer must
    /// update (FSDP steps its shard, a [`StepHooks::data_layer`] what it holds). Returns
    /// `false` (the default) to let [`train`](super::train) step the model's parameters as
    /// usual.
    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        match self.data_layer() {
            Some(data) => data.step(optimizer),
            None => Ok(false),
        }
    }

    /// Runs after the last step, before the record captures parameters and buffers: a wrapper
    /// that keeps parameters sharded makes the model's full parameters current here.
    fn before_record(&mut self) -> Result<(), TrainError> {
        match self.split_state() {
            // Gathered again: the tensors this rank computed with hold their trained values.
            Some(split) => split.data.gather(),
            None => Ok(()),
        }
    }

    /// Clips this step's gradients for [`Model::max_grad_norm`] `max_norm`, `total` being
    /// the global gradient norm the record reports and `grads` this rank's full gradients.
    /// The default scales `grads` ([`clip_coefficient`]), or under a
    /// [`StepHooks::data_layer`] what it steps; a sharding wrapper clips its shards by the
    /// norm it computes over them.
    fn clip_gradients(
        &mut self,
        max_norm: f64,
        total: f64,
        grads: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        if let Some(data) = self.data_layer() {
            return data.clip(max_norm, total);
        }
        scale_gradients(
            grads.iter().map(|(_, g)| g),
            clip_coefficient(max_norm, total),
        )
    }

    /// Reports to `probe`, after step `step`'s optimizer update, the state this rank holds
    /// that other ranks must hold bit for bit ([`crate::consistency`]). The default suits a
    /// replicating wrapper (DDP, a hand-written gradient all-reduce): every parameter and its
    /// optimizer state replicated, except those `rank_local` names. A sharding wrapper reports
    /// its shards instead.
    fn observe_state(
        &mut self,
        step: usize,
        params: &[(String, Tensor)],
        optimizer: &dyn Optimizer,
        rank_local: &dyn Fn(&str) -> bool,
        probe: &StateProbe,
    ) -> Result<(), TrainError> {
        match self.split_state() {
            Some(split) => split.data.observe(
                probe,
                step,
                optimizer,
                &|name: &str| self.state_coordinate(name),
                &self.state_prefix(),
            ),
            None => observe_replicated(step, params, optimizer, rank_local, probe),
        }
    }

    /// Under a [`SplitState`]: which copy of tensor `name` this rank holds, for the state
    /// checks (its TP shard, or none for a tensor every rank holds whole). Empty by default.
    fn state_coordinate(&self, _name: &str) -> String {
        String::new()
    }

    /// Under a [`SplitState`]: what the data dimension's state names start with on this rank
    /// (its TP coordinate, `tp0/2.`), so TP ranks' shards are never compared as copies.
    /// Empty by default.
    fn state_prefix(&self) -> String {
        String::new()
    }

    /// Reports to `probe`, after [`StepHooks::before_record`], the full parameters every rank
    /// now holds, when they are a different view from what [`StepHooks::observe_state`]
    /// reported (a sharding wrapper's gathered parameters). The default reports nothing.
    fn observe_final(&mut self, steps: usize, probe: &StateProbe) -> Result<(), TrainError> {
        match self.split_state() {
            Some(split) => Ok(probe.observe_all(
                steps,
                StateKind::Final,
                &split.trained,
                &|name: &str| self.state_coordinate(name),
            )?),
            None => Ok(()),
        }
    }

    /// Every parameter at full size for the record's end, after [`StepHooks::before_record`]:
    /// `params` as they are by default.
    fn full_parameters(
        &mut self,
        params: &[(String, Tensor)],
    ) -> Result<Vec<(String, Tensor)>, TrainError> {
        Ok(params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect())
    }
}

/// [`StepHooks::observe_state`] for replicated parameters: each under the empty coordinate,
/// the `rank_local` ones under this rank's, with the optimizer's state (when it exports one)
/// under its parameter's.
pub fn observe_replicated(
    step: usize,
    params: &[(String, Tensor)],
    optimizer: &dyn Optimizer,
    rank_local: &dyn Fn(&str) -> bool,
    probe: &StateProbe,
) -> Result<(), TrainError> {
    let local = probe.rank_local();
    let coord = |name: &str| {
        if rank_local(name) {
            local.clone()
        } else {
            String::new()
        }
    };
    Ok(observe_stepped(probe, step, params, optimizer, &coord)?)
}

impl<F> StepHooks for F
where
    F: FnMut(&[(String, Tensor)]) -> Result<(), TrainError>,
{
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self(grads)
    }
}

/// The closure for runs that synchronize nothing (one process, or rank-local training).
pub fn no_sync(_grads: &[(String, Tensor)]) -> Result<(), TrainError> {
    Ok(())
}
