//! A pipeline rank as a strategy of the one training loop: its executor runs the schedule
//! in place of the loop's forward and backward; tied and replicated gradients are reduced
//! where they live; the record sees full tensors gathered from their owning stages.

use super::dataflow::{probe, TensorMeta};
use super::edges::EdgeGroups;
use super::executor::{Executor, StepData};
use super::handshake::handshake;
use super::microbatch;
use super::options::{PipelineFault, PipelineOptions};
use super::plan::PipelinePlan;
use super::schedule::Action;
use super::stage_parallel::{full_values, StageSplit};
use super::trace::RankStepTrace;
use super::PipelineError;
use crate::comm::{CollectiveCounts, ProcessGroup, ReduceOp};
use crate::compose::data::DataLayer;
use crate::consistency::{StateKind, StateProbe};
use crate::expert_parallel::borrowed::BorrowedExperts;
use crate::record::{CollectiveEntry, RunRecord};
use crate::train::{
    train_from, GradientView, Optimizer, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::{Batch, Model};
use std::collections::HashMap;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// What one pipeline rank's steps work with, set up once by [`train_pipeline_with`].
pub(super) struct StepLoop<'a> {
    pub(super) model: &'a dyn Model,
    pub(super) plan: &'a PipelinePlan,
    pub(super) opts: &'a PipelineOptions,
    pub(super) executor: &'a Executor<'a>,
    pub(super) actions: &'a [Action],
    pub(super) named: &'a [(String, Tensor)],
    pub(super) held: &'a [usize],
    pub(super) held_params: &'a [(String, Tensor)],
    /// The data dimension over the held parameters: replicated, or (PP×FSDP) the stage's
    /// unit, which the schedule's actions drive.
    pub(super) data: &'a DataLayer,
    pub(super) pp: &'a dyn ProcessGroup,
    pub(super) dp: &'a dyn ProcessGroup,
    /// HSDP: the replicas of the data group's shards, averaged over after it.
    pub(super) replicate: Option<&'a dyn ProcessGroup>,
    pub(super) edge_groups: &'a EdgeGroups,
    pub(super) counts: &'a CollectiveCounts,
    pub(super) data_ranks: &'a [usize],
    pub(super) rank: usize,
    /// The parameters' device, where every tensor this rank creates lives.
    pub(super) device: Device,
    pub(super) global_rank: usize,
    pub(super) sharded: bool,
    pub(super) composed: bool,
    pub(super) reduce_tied: &'a dyn Fn() -> Result<(), PipelineError>,
    pub(super) model_params: &'a [(String, Tensor)],
    pub(super) stage_split: Option<&'a StageSplit>,
    /// PP × EP: this rank's experts, reduced over their holders instead of the data group.
    pub(super) experts: Option<&'a BorrowedExperts>,
    pub(super) tp_part: &'a str,
}

impl StepLoop<'_> {
    /// The record's view: every parameter's value (data or gradient) at full size on every
    /// rank (gathered over dp and tp when composed, then from its owning stage).
    fn recorded(
        &self,
        value: &dyn Fn(&Tensor) -> Tensor,
    ) -> Result<Vec<(String, Tensor)>, PipelineError> {
        let mut full = full_values(
            self.named,
            self.model_params,
            self.data.unit(),
            self.stage_split,
            value,
        )?;
        if let Some(experts) = self.experts {
            // Each of the stage's experts from the EP rank that trains it.
            full = experts.full(full)?;
        }
        gather_owned(self.plan, self.rank, self.pp, &full, self.device)
    }

    /// Which copy of `name` this rank holds: tied copies keep one name on every stage that
    /// holds them, so they compare; TP shards say which shard they are.
    fn tp_coord(&self, name: &str) -> String {
        self.stage_split
            .map_or(String::new(), |s| s.coordinate(name))
    }
}

/// A pipeline rank as a strategy of the one training loop: its executor runs the schedule
/// (forward and backward of every microbatch) in place of the loop's forward and backward;
/// the loop's setup, gradient record, clipping, optimizer step, state check and record tail
/// are every parallelism's.
pub(super) struct PipelineStrategy<'a> {
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
    pub(super) fn new(
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
    pub(super) fn train(
        mut self,
        cfg: &TrainConfig,
    ) -> Result<(RunRecord, Vec<RankStepTrace>), PipelineError> {
        let model = self.steps.model;
        let (record, _) = train_from(model, cfg, &mut self, None, &TrainStart::default())
            .map_err(TrainError::into_strategy::<PipelineError>)?;
        Ok((record, self.traces))
    }
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
            let mut split = microbatch::split(s.model, s.data_ranks, step, s.plan.microbatches)?;
            if let Some(stage) = s.stage_split {
                // Under CP each rank holds its shard of every microbatch's sequences.
                split.batches = split
                    .batches
                    .into_iter()
                    .map(|b| stage.cut(b))
                    .collect::<Result<_, _>>()?;
            }
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

    fn data_layer(&self) -> Option<&DataLayer> {
        Some(self.steps.data)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        let s = &self.steps;
        let sync = || -> Result<(), PipelineError> {
            if !s.sharded {
                (s.reduce_tied)()?;
            }
            let expert = |i: &usize| s.experts.is_some_and(|e| e.is_expert(&s.named[*i].0));
            let dense: Vec<Tensor> = s
                .held
                .iter()
                .filter(|i| !expert(i))
                .map(|&i| s.named[i].1.grad())
                .collect();
            if s.dp.size() > 1 && !dense.is_empty() && !s.sharded {
                average_flat(&dense, s.dp)?;
            }
            if let Some(experts) = s.experts {
                experts.reduce(s.held_params)?;
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
        // Over the data group: the replicas (and under CP the shards, whose losses carry
        // the CP size, so their average is their sum).
        if self.steps.dp.size() > 1 {
            self.steps.dp.all_reduce(&loss, ReduceOp::Avg)?;
        }
        if let Some(replicas) = self.steps.replicate {
            replicas.all_reduce(&loss, ReduceOp::Avg)?;
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

/// Averages `grads` over `group` in one all-reduce of their concatenation (DDP's single
/// bucket), copied back in place.
pub(super) fn average_flat(
    grads: &[Tensor],
    group: &dyn ProcessGroup,
) -> Result<(), PipelineError> {
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
pub(super) fn owned_grad_norm(
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
pub(super) fn gather_owned(
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

/// A named tensor's handle (the same storage, a new name string).
pub(super) fn handle((name, t): &(String, Tensor)) -> (String, Tensor) {
    (name.clone(), t.shallow_clone())
}

/// The boundary tensors of every microbatch of step `step`, probed once per input shape
/// (PP×FSDP probes every shape before sharding: a new one is an error there).
pub(super) fn step_metas(
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

/// `t`'s gradient, set to zeros first when this stage's backward left it undefined (a tied
/// copy the stage did not use this step), so every holder takes part in the reduction.
pub(super) fn grad_or_zeros(t: &Tensor) -> Result<Tensor, PipelineError> {
    let g = t.grad();
    if g.defined() {
        return Ok(g);
    }
    let zeros = t.f_zeros_like()?;
    crate::autograd::set_grad(t, Some(&zeros))?;
    Ok(zeros)
}
