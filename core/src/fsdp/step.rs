//! The wrapper as the training loop's strategy ([`StepHooks`]) and FSDP's entry points.

use super::core::Gather;
use super::{Fsdp, FsdpError, FsdpOptions};
use crate::comm::{DeviceMesh, ProcessGroup};
use crate::consistency::{StateKind, StateProbe};
use crate::record::{CollectiveEntry, RunRecord};
use crate::train::observe_stepped;
use crate::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep_models::{LayerHooks, Model};
use std::sync::Arc;
use tch::Tensor;

impl StepHooks for Fsdp {
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        self.core().unshard_for_forward().map_err(into_train)
    }

    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        Some(self)
    }

    fn step_collectives(&mut self) -> Option<Vec<CollectiveEntry>> {
        let counts = self.counts.as_ref()?;
        Some(CollectiveEntry::from_counts(counts.take()))
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        let mut core = self.core();
        if !core.sync_grads {
            // `no_sync`: the full gradients accumulate in the model's `.grad`s and the full
            // parameters stay, so the next micro-step needs no collective.
            return Ok(());
        }
        core.finish_gradients().map_err(into_train)?;
        core.reshard_all().map_err(into_train)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        if !self.requires_gradient_sync() {
            return Err(TrainError::InvalidConfig(
                "fsdp: optimizer step inside no_sync (gradients not reduced yet)".into(),
            ));
        }
        let max_norm = self.core().max_grad_norm;
        if let Some(max_norm) = max_norm {
            self.clip_grad_norm(max_norm).map_err(into_train)?;
        }
        self.step(optimizer).map_err(into_train)?;
        Ok(true)
    }

    fn before_record(&mut self) -> Result<(), TrainError> {
        // The record needs every full parameter at once; that is lockstep's view, not
        // training's memory, so it does not count towards the peak.
        let mut core = self.core();
        let peak = core.full_bytes_peak;
        core.unshard_all(Gather::Params).map_err(into_train)?;
        core.full_bytes_peak = peak;
        Ok(())
    }

    /// Clips the shards' gradients by the norm FSDP computes over them (the reduced
    /// gradients are on the shards now, not in the model's `.grad`s).
    fn clip_gradients(
        &mut self,
        max_norm: f64,
        _total: f64,
        _grads: &[(String, Tensor)],
    ) -> Result<(), TrainError> {
        self.clip_grad_norm(max_norm).map(drop).map_err(into_train)
    }

    /// Each unit's shard (with its optimizer state) under its shard coordinate: replicas of
    /// one shard (hybrid shard's replicate dimension, or every rank under `NoShard`) must
    /// agree. Ignored (rank-local) parameters are this rank's alone.
    fn observe_state(
        &mut self,
        step: usize,
        _params: &[(String, Tensor)],
        optimizer: &dyn Optimizer,
        _rank_local: &dyn Fn(&str) -> bool,
        probe: &StateProbe,
    ) -> Result<(), TrainError> {
        let core = self.core();
        let stepped = core.stepped_tensors();
        let coord = |name: &str| core.state_coordinate(name, probe);
        Ok(observe_stepped(probe, step, &stepped, optimizer, &coord)?)
    }

    /// The gathered parameters every rank now holds (replicated), and each unit's gathered
    /// flat parameter cut at this rank's shard next to the shard itself: the shards and the
    /// gathered view must be one state.
    fn observe_final(&mut self, steps: usize, probe: &StateProbe) -> Result<(), TrainError> {
        let core = self.core();
        for (u, unit) in core.units.iter().enumerate() {
            for slot in &unit.slots {
                probe.observe(steps, StateKind::Final, &slot.name, "", &slot.param)?;
            }
            let flat = unit
                .flatten(|slot| Ok(slot.param.shallow_clone()))
                .map_err(into_train)?;
            let len = unit.padded / core.shard_world as i64;
            let mine = flat.f_narrow(0, core.shard_rank as i64 * len, len)?;
            let name = core.flat_name(u);
            let coord = core.state_coordinate(&name, probe);
            probe.observe(steps, StateKind::Final, &name, &coord, &mine)?;
            probe.observe(steps, StateKind::Final, &name, &coord, &unit.shard)?;
        }
        Ok(())
    }
}

fn into_train(e: FsdpError) -> TrainError {
    match e {
        FsdpError::Comm(c) => TrainError::Comm(c),
        FsdpError::Train(t) => t,
        FsdpError::Torch(t) => TrainError::Torch(t),
        other => TrainError::InvalidConfig(other.to_string()),
    }
}

/// The `replicate × shard` mesh hybrid shard runs on: `world_size / shard_size` replicas of
/// `shard_size` ranks each (replica-major: ranks `0..shard_size` are replica 0). Errors,
/// naming both numbers, when the world does not split into whole shard groups.
pub fn hybrid_mesh(world: &crate::comm::World, shard_size: usize) -> Result<DeviceMesh, FsdpError> {
    let size = world.size();
    if shard_size == 0 || !size.is_multiple_of(shard_size) {
        return Err(FsdpError::Invalid(format!(
            "world size {size} does not fit a hybrid mesh with shard groups of {shard_size} \
             ranks ({size} is not a multiple of {shard_size})"
        )));
    }
    Ok(DeviceMesh::new(
        world,
        &[("replicate", size / shard_size), ("shard", shard_size)],
    )?)
}

/// Trains `model` (built identically on every rank, rank-local parameters aside) with FSDP
/// over `group` and returns this rank's record (losses averaged over the group; full
/// parameters gathered at the end; ignored parameters as this rank holds them).
pub fn train_fsdp(
    model: &dyn Model,
    group: Arc<dyn ProcessGroup>,
    cfg: &TrainConfig,
    opts: FsdpOptions,
) -> Result<RunRecord, FsdpError> {
    let mut fsdp = Fsdp::new(model, group.clone(), opts)?;
    let record = train(model, cfg, &mut fsdp, Some(group.as_ref()))?;
    Ok(fsdp.with_memory(record))
}

/// [`train_fsdp`] with [`ShardingStrategy::HybridShard`](super::ShardingStrategy::HybridShard) on a [`hybrid_mesh`] of
/// `shard_size`-rank groups; losses are averaged over `world_group`.
pub fn train_fsdp_hybrid(
    model: &dyn Model,
    world: &crate::comm::World,
    world_group: Arc<dyn ProcessGroup>,
    shard_size: usize,
    cfg: &TrainConfig,
    opts: FsdpOptions,
) -> Result<RunRecord, FsdpError> {
    let mesh = hybrid_mesh(world, shard_size)?;
    let mut fsdp = Fsdp::new_hybrid(model, &mesh, opts)?;
    let record = train(model, cfg, &mut fsdp, Some(world_group.as_ref()))?;
    Ok(fsdp.with_memory(record))
}
