//! The training loop every run shares: references and parallel configurations differ only
//! in which ranks' batches a process consumes and in the gradient-synchronization closure
//! called between backward and the optimizer step.
//!
//! A DDP run builds the model with the same seed on every rank, broadcasts parameters,
//! trains on `data_ranks = [rank]` with an all-reduce-average closure and reports losses
//! averaged over its group. The single-device reference trains one process on every rank's
//! batch with the mean of the per-rank losses as objective, which equals the DDP objective.

use crate::autograd::scaled::{add_scaled_, addcdiv_, addcmul_};
use crate::autograd::AutogradError;
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use crate::consistency::{observe_stepped, StateProbe};
use crate::record::{NamedTensor, RunRecord, RunSpec};
use lockstep_models::{LayerHooks, Model, ModelError, NoHooks};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use tch::{Kind, TchError, Tensor};

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
}

/// Which optimizer to train with. SGD with momentum is the default because Adam normalizes
/// gradient scale away and would hide divisor bugs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum OptimizerConfig {
    /// `torch.optim.SGD(lr, momentum)` (no dampening, weight decay or Nesterov).
    Sgd {
        /// Learning rate.
        lr: f64,
        /// Momentum factor (0 for plain SGD).
        momentum: f64,
    },
    /// `torch.optim.Adam(lr, betas, eps)` (no weight decay, no amsgrad).
    Adam {
        /// Learning rate.
        lr: f64,
        /// Decay of the first-moment (mean) estimate.
        beta1: f64,
        /// Decay of the second-moment (uncentered variance) estimate.
        beta2: f64,
        /// Added to the denominator for numerical stability.
        eps: f64,
    },
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig::Sgd {
            lr: 0.01,
            momentum: 0.9,
        }
    }
}

impl OptimizerConfig {
    /// PyTorch's Adam defaults with learning rate `lr`.
    pub fn adam(lr: f64) -> Self {
        OptimizerConfig::Adam {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    /// A fresh optimizer (no state yet).
    pub fn build(&self) -> Box<dyn Optimizer> {
        match *self {
            OptimizerConfig::Sgd { lr, momentum } => Box::new(Sgd::new(lr, momentum)),
            OptimizerConfig::Adam {
                lr,
                beta1,
                beta2,
                eps,
            } => Box::new(Adam::new(lr, beta1, beta2, eps)),
        }
    }
}

/// Updates parameters in place from their `.grad`, keeping per-parameter state by name.
pub trait Optimizer: Send {
    /// One update. Parameters without a gradient are skipped, as in PyTorch.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError>;

    /// The optimizer's state as named tensors (PyTorch's per-parameter `state`, keyed
    /// `<parameter>.<entry>`), so a checkpoint can carry it and a continued run step exactly
    /// as an uninterrupted one. The tensors are copies. The default refuses: an optimizer
    /// that cannot export its state must say so rather than let a resumed run drift.
    fn state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        Err(TrainError::InvalidConfig(
            "this optimizer cannot export its state".into(),
        ))
    }

    /// Replaces the optimizer's state with `state`, as [`Optimizer::state`] returned it.
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), TrainError> {
        let _ = state;
        Err(TrainError::InvalidConfig(
            "this optimizer cannot load a saved state".into(),
        ))
    }
}

/// `torch.optim.SGD` with momentum: `buf = grad` on the first step, then
/// `buf = momentum·buf + grad`; `p += (-lr)·buf` rounded once, as libtorch's `add_` with
/// `alpha` does.
#[derive(Debug)]
pub struct Sgd {
    lr: f64,
    momentum: f64,
    buffers: HashMap<String, Tensor>,
}

impl Sgd {
    /// `momentum = 0` is plain SGD (no buffer kept).
    pub fn new(lr: f64, momentum: f64) -> Self {
        Sgd {
            lr,
            momentum,
            buffers: HashMap::new(),
        }
    }
}

impl Optimizer for Sgd {
    /// `torch.optim.SGD`'s single-tensor step, op for op (what it runs on CPU, where the
    /// default `foreach` path is not taken; the `foreach` kernels' CPU fallback runs the same
    /// ops): `buf = grad.detach().clone()` on the first step, else
    /// `buf.mul_(momentum).add_(grad)`; then `param.add_(buf, alpha=-lr)`, one fused
    /// multiply-add through the bridge.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError> {
        tch::no_grad(|| {
            for (name, p) in params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let update = if self.momentum == 0.0 {
                    grad
                } else {
                    let buf = match self.buffers.remove(name) {
                        None => grad.f_detach_copy()?,
                        Some(mut buf) => {
                            let _ = buf.f_mul_scalar_(self.momentum)?.f_add_(&grad)?;
                            buf
                        }
                    };
                    let update = buf.shallow_clone();
                    self.buffers.insert(name.clone(), buf);
                    update
                };
                add_scaled_(p, &update, -self.lr)?;
            }
            Ok(())
        })
    }

    /// Each momentum buffer under `<parameter>.momentum_buffer` (PyTorch's entry name),
    /// sorted by key; none before the first step or without momentum.
    fn state(&self) -> Result<Vec<(String, Tensor)>, TrainError> {
        let mut out = Vec::with_capacity(self.buffers.len());
        for (name, buf) in &self.buffers {
            out.push((
                format!("{name}{MOMENTUM_SUFFIX}"),
                tch::no_grad(|| buf.f_detach_copy())?,
            ));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
    }

    /// Takes momentum buffers keyed `<parameter>.momentum_buffer`; with `momentum = 0` only
    /// an empty state fits (plain SGD keeps none).
    fn load_state(&mut self, state: &[(String, Tensor)]) -> Result<(), TrainError> {
        if self.momentum == 0.0 && !state.is_empty() {
            return Err(TrainError::InvalidConfig(
                "SGD without momentum keeps no state, but a state was given".into(),
            ));
        }
        let mut buffers = HashMap::with_capacity(state.len());
        for (key, t) in state {
            let Some(name) = key.strip_suffix(MOMENTUM_SUFFIX) else {
                return Err(TrainError::InvalidConfig(format!(
                    "SGD state key `{key}` does not end in `{MOMENTUM_SUFFIX}`"
                )));
            };
            buffers.insert(name.to_owned(), tch::no_grad(|| t.f_detach_copy())?);
        }
        self.buffers = buffers;
        Ok(())
    }
}

/// The suffix of an SGD momentum buffer's key in [`Optimizer::state`]: PyTorch's name for
/// the entry in `optimizer.state[param]`.
pub const MOMENTUM_SUFFIX: &str = ".momentum_buffer";

/// `torch.optim.Adam`: `m = lerp(m, g, 1-β1)`, `v = β2·v + (1-β2)·g²`,
/// `p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)`, in PyTorch's ops and order.
#[derive(Debug)]
pub struct Adam {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    state: HashMap<String, AdamState>,
}

#[derive(Debug)]
struct AdamState {
    step: i32,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl Adam {
    /// Torch's defaults are `beta1 = 0.9`, `beta2 = 0.999`, `eps = 1e-8`
    /// ([`OptimizerConfig::adam`]).
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64) -> Self {
        Adam {
            lr,
            beta1,
            beta2,
            eps,
            state: HashMap::new(),
        }
    }
}

impl Optimizer for Adam {
    /// `torch.optim.Adam`'s single-tensor step (`capturable=False`), op for op:
    /// `exp_avg.lerp_(grad, 1-β1)`, `exp_avg_sq.mul_(β2).addcmul_(grad, grad, value=1-β2)`,
    /// the bias corrections in f64 with the float step count as Python computes them
    /// (`β**step`, `bc2**0.5`), `denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)`,
    /// `param.addcdiv_(exp_avg, denom, value=-lr/bc1)`.
    fn step(&mut self, params: &[(String, Tensor)]) -> Result<(), TrainError> {
        tch::no_grad(|| {
            for (name, p) in params {
                let grad = p.grad();
                if !grad.defined() {
                    continue;
                }
                let st = match self.state.remove(name) {
                    Some(st) => st,
                    None => AdamState {
                        step: 0,
                        exp_avg: grad.f_zeros_like()?,
                        exp_avg_sq: grad.f_zeros_like()?,
                    },
                };
                let AdamState {
                    mut step,
                    mut exp_avg,
                    mut exp_avg_sq,
                } = st;
                step += 1;
                let _ = exp_avg.f_lerp_(&grad, 1.0 - self.beta1)?;
                let _ = exp_avg_sq.f_mul_scalar_(self.beta2)?;
                addcmul_(&exp_avg_sq, &grad, &grad, 1.0 - self.beta2)?;
                // PyTorch keeps the step as a float tensor and raises Python floats to it.
                let t = f64::from(step);
                let bias1 = 1.0 - self.beta1.powf(t);
                let bias2 = 1.0 - self.beta2.powf(t);
                let step_size = self.lr / bias1;
                let mut denom = exp_avg_sq.f_sqrt()?.f_div_scalar(bias2.powf(0.5))?;
                let _ = denom.f_add_scalar_(self.eps)?;
                addcdiv_(p, &exp_avg, &denom, -step_size)?;
                self.state.insert(
                    name.clone(),
                    AdamState {
                        step,
                        exp_avg,
                        exp_avg_sq,
                    },
                );
            }
            Ok(())
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
    /// Runs before the step's forward pass (DDP broadcasts buffers here).
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        Ok(())
    }

    /// Hooks to run around every layer during forward (FSDP's per-unit gather and free,
    /// mixed precision's casts), if the wrapper has any.
    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        None
    }

    /// Makes the gradients of this rank the synchronized ones, after backward.
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError>;

    /// Runs the optimizer step itself, if the wrapper owns the parameters the optimizer must
    /// update (FSDP steps its shard). Returns `false` (the default) to let [`train`] step the
    /// model's parameters as usual.
    fn optimizer_step(
        &mut self,
        _optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        Ok(false)
    }

    /// Runs after the last step, before the record captures parameters and buffers: a wrapper
    /// that keeps parameters sharded makes the model's full parameters current here.
    fn before_record(&mut self) -> Result<(), TrainError> {
        Ok(())
    }

    /// Clips this step's gradients for [`Model::max_grad_norm`] `max_norm`, `total` being
    /// the global gradient norm the record reports and `grads` this rank's full gradients.
    /// The default scales `grads` ([`clip_coefficient`]); a sharding wrapper clips its shards
    /// by the norm it computes over them.
    fn clip_gradients(
        &mut self,
        max_norm: f64,
        total: f64,
        grads: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
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
        observe_replicated(step, params, optimizer, rank_local, probe)
    }

    /// Reports to `probe`, after [`StepHooks::before_record`], the full parameters every rank
    /// now holds, when they are a different view from what [`StepHooks::observe_state`]
    /// reported (a sharding wrapper's gathered parameters). The default reports nothing.
    fn observe_final(&mut self, _steps: usize, _probe: &StateProbe) -> Result<(), TrainError> {
        Ok(())
    }
}

/// The factor gradient clipping at `max_norm` scales gradients by when their global norm is
/// `total`: `max_norm / (total + 1e-6)` rounded to fp32 (PyTorch's `clip_grad_norm_` computes
/// it as an fp32 tensor), or `None` when it is not below 1 and nothing is clipped.
pub fn clip_coefficient(max_norm: f64, total: f64) -> Option<f64> {
    let coef = f64::from((max_norm / (total + 1e-6)) as f32);
    (coef < 1.0).then_some(coef)
}

/// Multiplies every defined tensor of `grads` in place by `coef` (nothing for `None`).
pub fn scale_gradients<'a>(
    grads: impl IntoIterator<Item = &'a Tensor>,
    coef: Option<f64>,
) -> Result<(), TrainError> {
    let Some(coef) = coef else {
        return Ok(());
    };
    for g in grads.into_iter().filter(|g| g.defined()) {
        let _ = g.shallow_clone().f_mul_scalar_(coef)?;
    }
    Ok(())
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
    let params = model.named_parameters();
    let mut optimizer = cfg.optimizer.build();
    if !start.optimizer_state.is_empty() {
        optimizer.load_state(&start.optimizer_state)?;
    }
    let mut record = RunRecord::start(cfg.spec.clone(), cfg.record_grads);
    let tags = model.tags();
    let rank_local = |name: &str| tags.is_rank_local(name);
    for step in start.step..start.step + cfg.spec.steps {
        if let Some(probe) = &cfg.probe {
            probe.start_step(step);
        }
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        sync.before_forward(step)?;
        let objective = match sync.layer_hooks() {
            Some(hooks) => mean_loss(model, &cfg.data_ranks, step, hooks)?,
            None => mean_loss(model, &cfg.data_ranks, step, &mut NoHooks)?,
        };
        objective.f_backward()?;
        let grads = gradients(&params, step)?;
        sync.sync_gradients(&grads)?;
        // A wrapper may have replaced a `.grad` rather than written into it (mixed precision
        // hands back the reduced fp32 gradient in place of the low-precision one backward
        // produced): record what the optimizer will see.
        let grads = gradients(&params, step)?;
        record.losses.push(global_mean(
            objective.f_double_value(&[])?,
            objective.device(),
            metrics,
        )?);
        let norm = grad_norm(&grads)?;
        record.grad_norms.push(norm);
        if let Some(all) = record.grads.as_mut() {
            all.push(capture(&grads)?);
        }
        if let Some(max_norm) = model.max_grad_norm() {
            sync.clip_gradients(max_norm, norm, &grads)?;
        }
        if !sync.optimizer_step(optimizer.as_mut(), &params)? {
            optimizer.step(&params)?;
        }
        if let Some(probe) = &cfg.probe {
            sync.observe_state(step, &params, optimizer.as_ref(), &rank_local, probe)?;
        }
    }
    sync.before_record()?;
    if let Some(probe) = &cfg.probe {
        sync.observe_final(start.step + cfg.spec.steps, probe)?;
    }
    record.params = capture(&params)?;
    record.buffers = capture(&model.named_buffers())?;
    Ok((record, optimizer))
}

/// Every parameter's current `.grad`, by name; a missing one is an error (synchronizing a
/// partial set would desynchronize ranks).
fn gradients(
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
fn mean_loss(
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
    let cfg = TrainConfig {
        spec: RunSpec {
            model: model.name().to_owned(),
            config: "single".into(),
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
    };
    train(model, &cfg, &mut no_sync, None)
}

/// The mean of `local` over `group`, reduced on `device` (the training's: NCCL takes CUDA
/// tensors only; the CPU backend any, with the same bits).
fn global_mean(
    local: f64,
    device: tch::Device,
    group: Option<&dyn ProcessGroup>,
) -> Result<f64, TrainError> {
    let Some(group) = group else {
        return Ok(local);
    };
    let t = Tensor::from_slice(&[local]).f_to_device(device)?;
    group.all_reduce(&t, ReduceOp::Avg)?;
    Ok(t.f_double_value(&[0])?)
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
