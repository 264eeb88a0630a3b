//! The training loop every run shares: references and parallel configurations differ only
//! in which ranks' batches a process consumes and in the gradient-synchronization closure
//! called between backward and the optimizer step.
//!
//! A DDP run builds the model with the same seed on every rank, broadcasts parameters,
//! trains on `data_ranks = [rank]` with an all-reduce-average closure and reports losses
//! averaged over its group. The single-device reference trains one process on every rank's
//! batch with the mean of the per-rank losses as objective, which equals the DDP objective.

mod forced;
mod optim;
mod strategy;
mod update;

use crate::autograd::AutogradError;
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use crate::consistency::StateProbe;
use crate::record::{CollectiveEntry, NamedTensor, RunRecord, RunSpec};
use lockstep_models::{LayerHooks, Model, ModelError};
use tch::{Device, Kind, TchError, Tensor};

/// Everything a training run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The model refused a batch, a reference, or failed in forward.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A collective (gradient sync, loss averaging) failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tensor operation (backward, optimizer arithmetic) failed.
    #[error("libtorch: {0}")]
    Torch(#[from] TchError),
    /// An optimizer op run through the bridge (libtorch's `add_` with `alpha`…) failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A parameter got no gradient: synchronizing a partial set would desynchronize ranks.
    #[error("parameter `{name}` has no gradient after backward at step {step}")]
    MissingGrad {
        /// The parameter's name.
        name: String,
        /// The step, 0-based.
        step: usize,
    },
    /// The run was configured in a way no loop can execute.
    #[error("invalid training config: {0}")]
    InvalidConfig(String),
    /// The parameters name no single device to train on (none is defined, or two live on
    /// different devices, a model half moved): a strategy creates its buffers where the
    /// parameters are rather than guessing the CPU.
    #[error("no single training device: {0}")]
    Device(String),
    /// A parallelism's own step failed (a tensor-parallel gather, an expert dispatch…); its
    /// runner takes its typed error back out ([`TrainError::into_strategy`]).
    #[error(transparent)]
    Strategy(Box<dyn std::error::Error + Send + Sync + 'static>),
}

impl TrainError {
    /// A parallelism's typed error carried through the loop (taken back out by
    /// [`TrainError::into_strategy`]).
    pub fn strategy<E: std::error::Error + Send + Sync + 'static>(e: E) -> TrainError {
        TrainError::Strategy(Box::new(e))
    }

    /// A parallelism's typed error `E` back out of the loop's error: the one the strategy
    /// raised, or this error wrapped by `E`'s `From<TrainError>`.
    pub fn into_strategy<E>(self) -> E
    where
        E: std::error::Error + Send + Sync + From<TrainError> + 'static,
    {
        match self {
            TrainError::Strategy(inner) => match inner.downcast::<E>() {
                Ok(e) => *e,
                Err(other) => E::from(TrainError::Strategy(other)),
            },
            other => E::from(other),
        }
    }
}

pub use forced::{teacher_forced, teacher_forced_reference};
pub use optim::{Adam, Optimizer, OptimizerConfig, Sgd, MOMENTUM_SUFFIX};
pub use strategy::{no_sync, observe_replicated, GradSync, GradientView, StepHooks, StepLoss};
pub use update::{clip_coefficient, observe_stepped, scale_gradients};

/// How one process trains.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// What the record says was run; `spec.steps` is the number of steps.
    pub spec: RunSpec,
    /// The optimizer every rank (and the reference) steps with.
    pub optimizer: OptimizerConfig,
    /// The ranks whose batches this process consumes each step; its objective is the mean
    /// of their losses. `[rank]` for a parallel rank, `0..world_size` for the reference.
    pub data_ranks: Vec<usize>,
    /// Capture every gradient at every step (after synchronization) into the record.
    pub record_grads: bool,
    /// Where the loop reports, after every step, the state other ranks must hold bit for
    /// bit (and ticks the step clock); `None` checks nothing. Launchers set it.
    pub probe: Option<StateProbe>,
}

/// Where a run picks up instead of step 0 with a fresh optimizer: batches depend on the step
/// index and SGD's update on its momentum, so continuing a checkpointed run exactly needs both.
#[derive(Debug, Default)]
pub struct TrainStart {
    /// The index of the first step: its batches are those an uninterrupted run would train
    /// on at that step.
    pub step: usize,
    /// The optimizer's state to start from ([`Optimizer::state`]); empty means fresh.
    pub optimizer_state: Vec<(String, Tensor)>,
}

/// Trains `model` in place for `cfg.spec.steps` steps and records the run.
///
/// Each step: zero gradients, mean loss over `cfg.data_ranks`' batches, backward, `sync`,
/// record the loss (averaged over `metrics` when given) and the gradient norm (tied
/// parameters once), optimizer step (the hooks' [`StepHooks::optimizer_step`] when it takes
/// it). After [`StepHooks::before_record`], the record ends with every parameter.
pub fn train(
    model: &dyn Model,
    cfg: &TrainConfig,
    sync: &mut dyn StepHooks,
    metrics: Option<&dyn ProcessGroup>,
) -> Result<RunRecord, TrainError> {
    train_from(model, cfg, sync, metrics, &TrainStart::default()).map(|(record, _)| record)
}

/// [`train`] from `start`: steps `start.step .. start.step + cfg.spec.steps` (the record's
/// losses and norms are those steps', in order) with the optimizer loaded from
/// `start.optimizer_state`. Returns the optimizer too, so its final state can be saved.
pub fn train_from(
    model: &dyn Model,
    cfg: &TrainConfig,
    sync: &mut dyn StepHooks,
    metrics: Option<&dyn ProcessGroup>,
    start: &TrainStart,
) -> Result<(RunRecord, Box<dyn Optimizer>), TrainError> {
    if cfg.data_ranks.is_empty() {
        return Err(TrainError::InvalidConfig(
            "data_ranks is empty: a process must train on at least one rank's batch".into(),
        ));
    }
    let params = sync.parameters(model);
    let mut optimizer = cfg.optimizer.build();
    if !start.optimizer_state.is_empty() {
        optimizer.load_state(&start.optimizer_state)?;
    }
    let mut record = RunRecord::start(cfg.spec.clone(), cfg.record_grads);
    let mut collectives = Vec::with_capacity(cfg.spec.steps);
    let tags = model.tags();
    let rank_local = |name: &str| tags.is_rank_local(name);
    if let Some(probe) = &cfg.probe {
        // The state every rank starts from, checked as every later step is: a rank that
        // begins from other values is named at the tensor that differs, before a step spreads
        // the difference into tensors computed from it.
        probe.observe_start(|| {
            sync.observe_state(start.step, &params, optimizer.as_ref(), &rank_local, probe)
        })?;
    }
    for step in start.step..start.step + cfg.spec.steps {
        if let Some(probe) = &cfg.probe {
            probe.start_step(step);
        }
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        sync.before_forward(step)?;
        let loss = sync.forward_backward(model, &cfg.data_ranks, step)?;
        let grads = sync.local_gradients(&params, step)?;
        sync.sync_gradients(&grads)?;
        let synchronized = sync.step_collectives();
        // A wrapper may have replaced a `.grad` rather than written into it (mixed precision
        // hands back the reduced fp32 gradient in place of the low-precision one backward
        // produced): record what the optimizer will see.
        let grads = sync.local_gradients(&params, step)?;
        record.losses.push(sync.mean_loss(loss, metrics)?);
        let view = sync.gradient_view(&grads, record.grads.is_some())?;
        record.grad_norms.push(view.norm);
        if let (Some(all), Some(full)) = (record.grads.as_mut(), view.full) {
            all.push(capture(&full)?);
        }
        // The record keeping above (the loss average, full gradients) is not the step's
        // traffic: drop what it counted.
        sync.step_collectives();
        if let Some(max_norm) = model.max_grad_norm() {
            sync.clip_gradients(max_norm, view.norm, &grads)?;
        }
        if !sync.optimizer_step(optimizer.as_mut(), &params)? {
            optimizer.step(&params)?;
        }
        // The step's traffic: the synchronization, then clipping's and the optimizer's.
        if let Some(entries) = synchronized {
            collectives.push(merge_collectives(entries, sync.step_collectives()));
        }
        if let Some(probe) = &cfg.probe {
            sync.observe_state(step, &params, optimizer.as_ref(), &rank_local, probe)?;
        }
    }
    sync.before_record()?;
    if let Some(probe) = &cfg.probe {
        sync.observe_final(start.step + cfg.spec.steps, probe)?;
    }
    let full = tch::no_grad(|| sync.full_parameters(&params))?;
    record.params = capture(&full)?;
    record.buffers = capture(&model.named_buffers())?;
    if !collectives.is_empty() {
        record.collectives = Some(collectives);
    }
    Ok((record, optimizer))
}

/// One step's tallies, `later` added into `first` by (operation, group).
fn merge_collectives(
    first: Vec<CollectiveEntry>,
    later: Option<Vec<CollectiveEntry>>,
) -> Vec<CollectiveEntry> {
    let mut merged: std::collections::BTreeMap<(String, String), CollectiveEntry> = first
        .into_iter()
        .map(|e| ((e.op.clone(), e.group.clone()), e))
        .collect();
    for e in later.into_iter().flatten() {
        merged
            .entry((e.op.clone(), e.group.clone()))
            .and_modify(|m| {
                m.calls += e.calls;
                m.bytes += e.bytes;
            })
            .or_insert(e);
    }
    merged.into_values().collect()
}

/// Every parameter's current `.grad`, by name; a missing one is an error (synchronizing a
/// partial set would desynchronize ranks).
pub(crate) fn gradients(
    params: &[(String, Tensor)],
    step: usize,
) -> Result<Vec<(String, Tensor)>, TrainError> {
    params
        .iter()
        .map(|(name, p)| {
            let g = p.grad();
            if g.defined() {
                Ok((name.clone(), g))
            } else {
                Err(TrainError::MissingGrad {
                    name: name.clone(),
                    step,
                })
            }
        })
        .collect()
}

/// The mean of `ranks`' losses at `step`, one differentiable scalar.
pub(crate) fn mean_loss(
    model: &dyn Model,
    ranks: &[usize],
    step: usize,
    hooks: &mut dyn LayerHooks,
) -> Result<Tensor, TrainError> {
    let Some((&first, rest)) = ranks.split_first() else {
        return Err(TrainError::InvalidConfig("data_ranks is empty".into()));
    };
    let mut total = model.loss_hooked(&model.input(first, step)?, hooks)?;
    for &rank in rest {
        total = total.f_add(&model.loss_hooked(&model.input(rank, step)?, hooks)?)?;
    }
    Ok(total.f_div_scalar(ranks.len() as f64)?)
}

/// The single-device reference for `world_size` ranks: one process, every rank's batch
/// each step, objective = mean of the per-rank losses, no synchronization. Errors for
/// models whose ranks differ (per-rank experts, BatchNorm statistics).
pub fn single_device_reference(
    model: &dyn Model,
    world_size: usize,
    steps: usize,
    optimizer: OptimizerConfig,
    record_grads: bool,
) -> Result<RunRecord, TrainError> {
    model.check_single_device_reference()?;
    if world_size == 0 {
        return Err(TrainError::InvalidConfig("world size 0".into()));
    }
    let cfg = TrainConfig::one_process(model, "single", world_size, steps, optimizer, record_grads);
    train(model, &cfg, &mut no_sync, None)
}

impl TrainConfig {
    /// A one-process reference's config, named `config` in its record: every one of
    /// `world_size` ranks' batches each step, fp32, no backend, no cross-rank probe.
    pub fn one_process(
        model: &dyn Model,
        config: &str,
        world_size: usize,
        steps: usize,
        optimizer: OptimizerConfig,
        record_grads: bool,
    ) -> TrainConfig {
        TrainConfig {
            spec: RunSpec {
                model: model.name().to_owned(),
                config: config.to_owned(),
                world_size,
                backend: "none".into(),
                dtype: "fp32".into(),
                steps,
                seed: model.seed(),
            },
            optimizer,
            data_ranks: (0..world_size).collect(),
            record_grads,
            probe: None,
        }
    }
}

/// The mean of `local` over `group`, reduced on `device` (the training's: NCCL takes CUDA
/// tensors only; the CPU backend any, with the same bits).
pub(crate) fn global_mean(
    local: f64,
    device: tch::Device,
    group: Option<&dyn ProcessGroup>,
) -> Result<f64, TrainError> {
    let Some(group) = group else {
        return Ok(local);
    };
    let t = Tensor::from_slice(&[local]).f_to_device(device)?;
    crate::comm::labelled("the step's loss, averaged over the ranks", || {
        group.all_reduce(&t, ReduceOp::Avg)
    })?;
    Ok(t.f_double_value(&[0])?)
}

/// The one device `params` live on: where a strategy creates what it computes and
/// communicates with (receive buffers, pipeline tokens, loss and norm scalars), so that a model
/// moved to `cuda:N` never meets a CPU tensor (an NCCL group takes tensors on its own device
/// only). An error rather than a guess when no parameter is defined or two live on different
/// devices: a silent fall back to the CPU would only surface later, as a failed collective.
pub fn parameters_device(params: &[(String, Tensor)]) -> Result<Device, TrainError> {
    let mut defined = params.iter().filter(|(_, t)| t.defined());
    let Some((first, t)) = defined.next() else {
        return Err(TrainError::Device(
            "no defined parameter says where to create buffers".into(),
        ));
    };
    let device = t.device();
    match defined.find(|(_, t)| t.device() != device) {
        Some((other, t)) => Err(TrainError::Device(format!(
            "`{first}` is on {device:?} but `{other}` on {:?}",
            t.device()
        ))),
        None => Ok(device),
    }
}

/// L2 norm over every gradient, in f64 (the list holds each tied parameter once).
pub(crate) fn grad_norm(grads: &[(String, Tensor)]) -> Result<f64, TrainError> {
    let mut sum = 0.0;
    for (_, g) in grads {
        sum += g
            .f_to_kind(Kind::Double)?
            .f_square()?
            .f_sum(Kind::Double)?
            .f_double_value(&[])?;
    }
    Ok(sum.sqrt())
}

pub(crate) fn capture(tensors: &[(String, Tensor)]) -> Result<Vec<NamedTensor>, TrainError> {
    tensors
        .iter()
        .map(|(n, t)| NamedTensor::capture(n, t).map_err(TrainError::from))
        .collect()
}
