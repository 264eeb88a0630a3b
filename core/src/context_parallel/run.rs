//! Training a model under context parallelism on one rank: its replica's batch cut along the
//! sequence (labels shifted before the cut, as the model's batch already holds them), the
//! model's own forward through the CP hooks (global positions, attention across the CP
//! group, the loss as this shard's share of the whole mean), gradients of the replicated
//! parameters summed over CP and averaged over the data ranks.

use super::hooks::CpHooks;
use super::layout::{chunk_count, chunks_of, layout_blocker, shard_sequence};
use super::options::{CpError, CpFault, CpOptions, SequenceLayout};
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::record::{CollectiveEntry, RunRecord, TensorPlacement};
use crate::tensor_parallel::run::global_batch;
use crate::train::{train_from, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart};
use lockstep_models::{Batch, LossReduction, Model};
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
    if opts.cp == 0 || world_size == 0 || !world_size.is_multiple_of(opts.cp) {
        return Err(CpError::Invalid(format!(
            "context-parallel size {} does not divide world size {world_size}",
            opts.cp
        )));
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
    match layout_blocker(opts.layout, opts.cp, seq) {
        Some(why) => Err(CpError::Invalid(format!("{}: {why}", model.name()))),
        None => Ok(()),
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
    let placement = format!(
        "replicated, gradient summed over cp={} (sequence shards)",
        opts.cp
    );
    record.placements = model
        .named_parameters()
        .into_iter()
        .map(|(tensor, _)| TensorPlacement {
            tensor,
            placement: placement.clone(),
        })
        .collect();
    Ok(record)
}

/// One rank's context-parallel run.
struct CpRun<'a> {
    opts: &'a CpOptions,
    cp: Arc<dyn ProcessGroup>,
    dp: Arc<dyn ProcessGroup>,
    rank: usize,
    counts: CollectiveCounts,
    hooks: CpHooks,
    data_ranks: Vec<usize>,
}

impl<'a> CpRun<'a> {
    fn new(_model: &dyn Model, world: &World, opts: &'a CpOptions) -> Result<Self, CpError> {
        let dp = world.size() / opts.cp;
        let mesh = DeviceMesh::new(world, &[("dp", dp), ("cp", opts.cp)])?;
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let cp = counted(mesh.group("cp")?);
        let rank = mesh.coordinate("cp")?;
        let replica = mesh.coordinate("dp")?;
        Ok(CpRun {
            opts,
            hooks: CpHooks::new(cp.clone(), rank, opts.clone()),
            cp,
            dp: counted(mesh.group("dp")?),
            rank,
            counts,
            data_ranks: (replica * opts.cp..(replica + 1) * opts.cp).collect(),
        })
    }

    /// This rank's shard of the replica's batch (tokens and targets cut along the sequence)
    /// and the tokens the whole batch's loss averages over.
    fn shard(&self, batch: &Batch) -> Result<(Batch, f64), CpError> {
        let (layout, cp) = (self.opts.layout, self.opts.cp);
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
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        let _ = self.counts.take();
        Ok(())
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
        let loss = model.loss_of_hooked(&local, &output, &mut self.hooks)?;
        loss.f_backward()?;
        Ok(StepLoss {
            value: loss.f_double_value(&[])?,
            device: loss.device(),
        })
    }

    /// Sums each gradient over the CP ranks (each holds its shard's part), then averages it
    /// over the data ranks.
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        let fault = self.opts.fault;
        for (_, g) in grads {
            if fault != Some(CpFault::GradsNotReducedOverCp) && self.cp.size() > 1 {
                self.cp.all_reduce(g, ReduceOp::Sum)?;
            }
            if self.dp.size() > 1 {
                if fault == Some(CpFault::DividedByCpSize) {
                    self.dp.all_reduce(g, ReduceOp::Sum)?;
                    let _ = g.shallow_clone().f_div_scalar_(self.cp.size() as f64)?;
                } else {
                    self.dp.all_reduce(g, ReduceOp::Avg)?;
                }
            }
        }
        Ok(())
    }

    fn step_collectives(&mut self) -> Option<Vec<CollectiveEntry>> {
        Some(CollectiveEntry::from_counts(self.counts.take()))
    }

    /// The shards' shares summed over CP (the replica's mean), averaged over the replicas.
    fn mean_loss(
        &mut self,
        local: StepLoss,
        _metrics: Option<&dyn ProcessGroup>,
    ) -> Result<f64, TrainError> {
        let value = Tensor::from_slice(&[local.value]).f_to_device(local.device)?;
        if self.opts.fault != Some(CpFault::LossNotReducedOverCp) && self.cp.size() > 1 {
            self.cp.all_reduce(&value, ReduceOp::Sum)?;
        }
        if self.dp.size() > 1 {
            self.dp.all_reduce(&value, ReduceOp::Avg)?;
        }
        Ok(value.f_double_value(&[0])?)
    }
}
