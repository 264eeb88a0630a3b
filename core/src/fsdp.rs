//! Fully sharded data parallel (FSDP1-style flat parameters), first slice: the model is one
//! root unit ([`WrapPolicy::Root`]) or one unit per layer ([`WrapPolicy::PerLayer`]), each
//! unit with one flat parameter.
//!
//! Per-layer units are gathered together before forward (this slice has no per-layer forward
//! hook yet, so no forward prefetch or reshard between layers): they shard, reduce and step
//! per unit but do not lower the peak of full parameters below the root unit's.
//!
//! * **Flat parameter**: a unit's parameters (tied ones once, rank-local ones left out)
//!   flattened and concatenated in `named_parameters` order, zero-padded to a multiple of the
//!   sharding world size. Rank `r` keeps elements `[r·s, (r+1)·s)` (`s = padded / world`) as
//!   its **master copy**; the optimizer (and its momentum state) lives on that shard only.
//! * **Unshard** (before forward, and before the record is captured): all-gather the shards
//!   into a full flat buffer and copy each slice into the model's own parameter tensor, whose
//!   storage was freed at the last reshard and is refilled here.
//! * **Gradients** (after backward): flatten and pad the full `.grad`s, `reduce_scatter(Avg)`
//!   into this rank's gradient shard (bit-identical to the same elements of DDP's all-reduce),
//!   which becomes the shard's `.grad`.
//! * **Reshard** (after the gradients are reduced): the model's full parameter storages are
//!   freed. As PyTorch does for the root unit, the root is not resharded between forward and
//!   backward, so in this one-unit slice `reshard_after_forward` and
//!   [`ShardingStrategy::ShardGradOp`] change nothing yet (see [`FsdpOptions`]).
//! * **Optimizer step**: through [`StepHooks::optimizer_step`], the run's optimizer steps the
//!   shard (under one name for the whole flat parameter) and the ignored parameters; the next
//!   unshard rebuilds the full parameters from the updated shards.
//! * **Record view** (not part of FSDP's math): so the run's record holds the same full
//!   averaged gradients (and gradient norm) as DDP's, the reduced gradient shards are
//!   all-gathered back into the model's `.grad`s. The optimizer never reads them. This is one
//!   extra all-gather per step that real FSDP does not pay.
//! * **Ignored parameters**: rank-local ones (the experts of `MixtureOfExperts`) are never
//!   broadcast, sharded nor reduced; the optimizer steps them in place.
//! * [`ShardingStrategy::NoShard`]: the "shard" is the whole flat parameter, gradients are
//!   all-reduced (Avg), and no storage is ever freed.
//!
//! * **State dicts, clipping, accumulation** (`fsdp/state.rs`): full and sharded state dicts
//!   saved as safetensors and loaded back bitwise ([`Fsdp::save_full`], [`Fsdp::load_full`],
//!   [`Fsdp::save_sharded`], [`Fsdp::load_sharded`]); [`Fsdp::clip_grad_norm`] over the
//!   global norm; [`Fsdp::no_sync`] gradient accumulation without collectives.
//!
//! Between a reshard and the next unshard the model's parameters have no memory: nothing may
//! read them (forward, or `Model::save`) until [`Fsdp::unshard`] (or `before_forward` /
//! `before_record`) ran. [`train`] keeps that order. Dropping an [`Fsdp`] while resharded
//! refills the parameters with NaN so they stay safe to touch, and visibly invalid.

use crate::autograd::{
    free_storage, is_storage_freed, refill_storage, set_grad, storage_nbytes, AutogradError,
};
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use crate::record::RunRecord;
use crate::replica::{broadcast_from_rank0, distinct_parameters};
use crate::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep_models::Model;
use lockstep_models::{Misshaped, ParamTags};
use std::collections::HashSet;
use std::sync::Arc;
use tch::{Kind, Tensor};

mod state;

pub use state::{ShardedLayout, ShardedParamMeta, ShardedStateDict, ShardedUnitMeta};

/// The optimizer-state name prefix of the flat parameter shards (`_fsdp_flat_param.<unit>`).
pub const FLAT_PARAM_NAME: &str = "_fsdp_flat_param";

/// What FSDP can fail with.
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Freeing or refilling storage, or setting a gradient, failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// The training loop failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A tensor operation failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The model cannot be wrapped as asked (mixed dtypes, parameters sharing storage...).
    #[error("fsdp: {0}")]
    Invalid(String),
    /// A parameter had no gradient when gradients were reduced.
    #[error("fsdp: parameter `{0}` has no gradient")]
    MissingGrad(String),
    /// A checkpoint does not fit this wrapper: every missing, misshaped (wrong shape or dtype)
    /// and unexpected key is named. Nothing was loaded.
    #[error(
        "fsdp: {path}: state does not match: missing [{}]; misshaped [{}]; unexpected [{}]",
        missing.join(", "),
        misshaped.iter().map(|m| format!("{}: expected {}, found {}", m.name, m.expected, m.found)).collect::<Vec<_>>().join("; "),
        unexpected.join(", ")
    )]
    StateMismatch {
        path: String,
        missing: Vec<String>,
        misshaped: Vec<Misshaped>,
        unexpected: Vec<String>,
    },
    /// A sharded checkpoint was written for another sharding layout (world size, strategy,
    /// wrap policy or model). Nothing was loaded.
    #[error("fsdp: {path}: sharded checkpoint layout differs: {reason}")]
    ShardLayout { path: String, reason: String },
    /// Reading or writing a checkpoint file failed.
    #[error("fsdp: {path}: {reason}")]
    Checkpoint { path: String, reason: String },
    /// Another rank failed the same collective checkpoint operation (its own error is
    /// reported there); this rank changed nothing.
    #[error("fsdp: {0} failed on another rank")]
    PeerFailed(String),
}

/// How parameters, gradients and optimizer state are split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer state sharded; full parameters gathered for
    /// forward and backward only (ZeRO-3).
    FullShard,
    /// As `FullShard`, but full parameters stay alive from forward to backward (ZeRO-2-like).
    /// Identical to `FullShard` for a root unit, the only unit this slice has.
    ShardGradOp,
    /// Nothing sharded: every rank keeps the full flat parameter and optimizer state, and
    /// gradients are all-reduced (DDP's math through FSDP's code path).
    NoShard,
}

/// A bug planted on purpose, to prove the parity checker catches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsdpFault {
    /// Gradients summed across ranks instead of averaged (a divisor bug).
    SumInsteadOfAverage,
}

/// How FSDP runs.
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    /// What is sharded.
    pub strategy: ShardingStrategy,
    /// Free full parameters after forward (re-gathering them for backward). Applies to
    /// non-root units; the root unit — the only one in this slice — keeps them, as PyTorch's
    /// root does, so this changes nothing yet.
    pub reshard_after_forward: bool,
    /// Broadcast rank 0's (non-ignored) parameters and buffers at construction, so ranks that
    /// built the model differently start equal (PyTorch's `sync_module_states`).
    pub sync_module_states: bool,
    /// Which modules become units.
    pub wrap: WrapPolicy,
    /// A planted bug, for checker tests only.
    pub fault: Option<FsdpFault>,
}

/// Which modules get their own FSDP unit (flat parameter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WrapPolicy {
    /// The whole model is one root unit.
    Root,
    /// Every layer of [`Model::layers`] with parameters is a unit ("wrap everything"); tied
    /// parameters (used by several layers) and parameters of no layer stay in the root unit.
    PerLayer,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            strategy: ShardingStrategy::FullShard,
            reshard_after_forward: true,
            sync_module_states: true,
            wrap: WrapPolicy::Root,
            fault: None,
        }
    }
}

/// Collectives FSDP issued since construction (the initial broadcasts aside), by purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollectiveCounts {
    /// All-gathers of the flat parameter (unshard before forward and before the record).
    pub param_all_gathers: usize,
    /// Reduce-scatters of the flat gradient (sharded strategies).
    pub grad_reduce_scatters: usize,
    /// All-reduces of the flat gradient (`NoShard`).
    pub grad_all_reduces: usize,
    /// All-gathers of reduced gradient shards for the record view only.
    pub record_grad_all_gathers: usize,
}

/// What a gather is for (which counter it bumps).
#[derive(Clone, Copy)]
enum Gather {
    Params,
    RecordGrads,
    /// State dicts and checkpoint loads: not a training collective, not counted.
    Checkpoint,
}

/// One managed parameter's place in its unit's flat parameter.
struct Slot {
    name: String,
    /// The model's own tensor (the "view" the flat parameter is copied into).
    param: Tensor,
    offset: i64,
    numel: i64,
}

/// One FSDP unit: one flat parameter, sharded over the group.
struct Unit {
    /// The layer it wraps (`root` for the root unit).
    name: String,
    slots: Vec<Slot>,
    kind: Kind,
    /// Elements after padding (a multiple of the sharding world size).
    padded: i64,
    /// This rank's master copy of its part of the flat parameter.
    shard: Tensor,
    /// Whether the model's full parameters of this unit hold memory and current values.
    unsharded: bool,
    full_bytes: usize,
}

impl Unit {
    /// The unit's parameters (chosen by `pick`) flattened, concatenated and zero-padded.
    fn flatten(
        &self,
        pick: impl Fn(&Slot) -> Result<Tensor, FsdpError>,
    ) -> Result<Tensor, FsdpError> {
        let mut parts = Vec::with_capacity(self.slots.len() + 1);
        let mut numel = 0;
        for slot in &self.slots {
            numel += slot.numel;
            parts.push(pick(slot)?.f_reshape([-1])?);
        }
        if self.padded > numel {
            let device = self
                .slots
                .first()
                .map_or(tch::Device::Cpu, |s| s.param.device());
            parts.push(Tensor::f_zeros([self.padded - numel], (self.kind, device))?);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }

    fn numel(&self) -> i64 {
        self.slots.iter().map(|s| s.numel).sum()
    }
}

/// FSDP over one data-parallel group. Plug it into [`train`] as its [`StepHooks`], or use
/// [`train_fsdp`].
pub struct Fsdp {
    group: Arc<dyn ProcessGroup>,
    opts: FsdpOptions,
    /// The root unit first (unless empty), then one unit per wrapped layer in forward order.
    units: Vec<Unit>,
    /// Parameters never sharded nor reduced (rank-local experts).
    ignored: Vec<(String, Tensor)>,
    /// Ranks a flat parameter is split over (1 for `NoShard`).
    shard_world: usize,
    full_bytes_alive: usize,
    full_bytes_peak: usize,
    counts: CollectiveCounts,
    /// The model's buffers (not sharded; part of the state dicts).
    buffers: Vec<(String, Tensor)>,
    /// Every distinct parameter's name in `named_parameters` order (state dict order).
    order: Vec<String>,
    tags: ParamTags,
    /// `false` inside [`Fsdp::no_sync`]: gradients accumulate locally, unreduced.
    sync_grads: bool,
    /// Clip the gradient norm to this before every hooked optimizer step.
    max_grad_norm: Option<f64>,
    /// The total gradient norm the last [`Fsdp::clip_grad_norm`] computed.
    last_total_norm: Option<f64>,
}

impl Fsdp {
    /// Wraps `model` (built identically on every rank except its rank-local parameters):
    /// optionally broadcasts rank 0's state, builds the units' flat parameters, keeps this
    /// rank's shards and (unless `NoShard`) frees the model's full parameters until the next
    /// unshard.
    pub fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        opts: FsdpOptions,
    ) -> Result<Fsdp, FsdpError> {
        let tags = model.tags();
        let mut managed = Vec::new();
        let mut ignored = Vec::new();
        let mut order = Vec::new();
        for (name, t) in distinct_parameters(model.named_parameters()) {
            order.push(name.clone());
            if tags.is_rank_local(&name) {
                ignored.push((name, t));
            } else {
                managed.push((name, t));
            }
        }
        if managed.is_empty() {
            return Err(FsdpError::Invalid(
                "no parameter to shard (every parameter is ignored)".into(),
            ));
        }
        // Which unit each managed parameter joins: the root (0) unless per-layer wrapping
        // gives it to the one layer that uses it. A parameter used by several layers (tied)
        // stays in the root, the smallest unit enclosing every use.
        let mut unit_names = vec!["root".to_owned()];
        let mut unit_of: std::collections::HashMap<String, usize> = Default::default();
        if opts.wrap == WrapPolicy::PerLayer {
            let mut users: std::collections::HashMap<String, HashSet<usize>> = Default::default();
            let layers = model.layers();
            for (l, layer) in layers.iter().enumerate() {
                for p in &layer.params {
                    users
                        .entry(tags.canonical(p).to_owned())
                        .or_default()
                        .insert(l);
                }
            }
            let mut layer_unit: std::collections::HashMap<usize, usize> = Default::default();
            for (name, _) in &managed {
                let Some(ls) = users.get(name) else { continue };
                if ls.len() != 1 {
                    continue;
                }
                let Some(&l) = ls.iter().next() else { continue };
                let u = *layer_unit.entry(l).or_insert_with(|| {
                    unit_names.push(layers[l].name.clone());
                    unit_names.len() - 1
                });
                unit_of.insert(name.clone(), u);
            }
        }
        let (shard_world, shard_rank) = match opts.strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (group.size(), group.rank()),
        };
        let world = shard_world as i64;
        let _guard = tch::no_grad_guard();
        if opts.sync_module_states {
            broadcast_from_rank0(group.as_ref(), managed.iter().map(|(_, p)| p))?;
            broadcast_from_rank0(group.as_ref(), model.named_buffers().iter().map(|(_, b)| b))?;
        }
        let mut members: Vec<Vec<(String, Tensor)>> =
            (0..unit_names.len()).map(|_| Vec::new()).collect();
        for (name, param) in managed {
            let u = unit_of.get(&name).copied().unwrap_or(0);
            members[u].push((name, param));
        }
        let mut units = Vec::new();
        let mut full_bytes_alive = 0;
        for (name, params) in unit_names.into_iter().zip(members) {
            let Some(kind) = params.first().map(|(_, t)| t.kind()) else {
                continue;
            };
            let mut slots = Vec::with_capacity(params.len());
            let mut offset = 0i64;
            let mut full_bytes = 0usize;
            for (pname, param) in params {
                if param.kind() != kind {
                    return Err(FsdpError::Invalid(format!(
                        "parameter `{pname}` is {:?} but unit `{name}`'s flat parameter is {kind:?}",
                        param.kind()
                    )));
                }
                let numel = param.numel() as i64;
                let bytes = param.numel() * kind.elt_size_in_bytes();
                // Freeing a storage frees every alias: each parameter must own its storage.
                if !param.is_contiguous() || storage_nbytes(&param)? != bytes {
                    return Err(FsdpError::Invalid(format!(
                        "parameter `{pname}` does not own its storage (a view or a shared buffer)"
                    )));
                }
                full_bytes += bytes;
                slots.push(Slot {
                    name: pname,
                    param,
                    offset,
                    numel,
                });
                offset += numel;
            }
            let padded = (offset + world - 1) / world * world;
            let mut unit = Unit {
                name,
                slots,
                kind,
                padded,
                shard: Tensor::new(),
                unsharded: true,
                full_bytes,
            };
            let shard_size = padded / world;
            unit.shard = unit
                .flatten(|s| Ok(s.param.shallow_clone()))?
                .f_narrow(0, shard_rank as i64 * shard_size, shard_size)?
                .f_detach_copy()?
                .set_requires_grad(true);
            full_bytes_alive += full_bytes;
            units.push(unit);
        }
        let mut fsdp = Fsdp {
            group,
            opts,
            units,
            ignored,
            shard_world,
            full_bytes_alive,
            full_bytes_peak: full_bytes_alive,
            counts: CollectiveCounts::default(),
            buffers: model.named_buffers(),
            order,
            tags,
            sync_grads: true,
            max_grad_norm: None,
            last_total_norm: None,
        };
        fsdp.reshard()?;
        Ok(fsdp)
    }

    /// The strategy this wrapper runs.
    pub fn strategy(&self) -> ShardingStrategy {
        self.opts.strategy
    }

    /// Every unit's name and the parameters in its flat parameter, in flat order.
    pub fn units(&self) -> Vec<(String, Vec<String>)> {
        self.units
            .iter()
            .map(|u| {
                (
                    u.name.clone(),
                    u.slots.iter().map(|s| s.name.clone()).collect(),
                )
            })
            .collect()
    }

    /// Names of the parameters in the flat parameters, unit by unit.
    pub fn flat_param_names(&self) -> Vec<String> {
        self.units
            .iter()
            .flat_map(|u| u.slots.iter().map(|s| s.name.clone()))
            .collect()
    }

    /// Names of the ignored (rank-local) parameters, never sharded nor reduced.
    pub fn ignored_param_names(&self) -> Vec<String> {
        self.ignored.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Elements of each unit's flat parameter: (unpadded, padded).
    pub fn flat_numels(&self) -> Vec<(usize, usize)> {
        self.units
            .iter()
            .map(|u| (u.numel() as usize, u.padded as usize))
            .collect()
    }

    /// This rank's master shard of each unit's flat parameter (copies: the optimizer owns
    /// them).
    pub fn local_shards(&self) -> Result<Vec<Tensor>, FsdpError> {
        self.units
            .iter()
            .map(|u| Ok(u.shard.f_detach_copy()?))
            .collect()
    }

    /// Whether the model's full parameters currently hold memory and current values.
    pub fn is_unsharded(&self) -> bool {
        self.units.iter().all(|u| u.unsharded)
    }

    /// Bytes of full (unsharded) managed parameters alive on this rank right now. Counts the
    /// model's parameter storages, not the transient all-gather buffer nor ignored parameters.
    pub fn full_param_bytes(&self) -> usize {
        self.full_bytes_alive
    }

    /// The most bytes of full managed parameters ever alive at once on this rank.
    pub fn full_param_bytes_peak(&self) -> usize {
        self.full_bytes_peak
    }

    /// Bytes of this rank's master shards (what stays alive between steps).
    pub fn shard_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| u.shard.numel() * u.kind.elt_size_in_bytes())
            .sum()
    }

    /// Collectives issued since construction, by purpose (per `FullShard` step and unit: one
    /// parameter all-gather, one gradient reduce-scatter and one record all-gather).
    pub fn collective_counts(&self) -> CollectiveCounts {
        self.counts
    }

    /// Unit `u`'s full flat tensor from every rank's `local` part (rank order).
    fn gather(&mut self, u: usize, local: &Tensor, purpose: Gather) -> Result<Tensor, FsdpError> {
        if self.shard_world == 1 {
            return Ok(local.shallow_clone());
        }
        let unit = &self.units[u];
        let full = Tensor::f_empty([unit.padded], (unit.kind, local.device()))?;
        self.group.all_gather(&full, local)?;
        match purpose {
            Gather::Params => self.counts.param_all_gathers += 1,
            Gather::RecordGrads => self.counts.record_grad_all_gathers += 1,
            Gather::Checkpoint => {}
        }
        Ok(full)
    }

    /// Makes the model's full parameters current: all-gathers every resharded unit, in unit
    /// order, and copies each slice into its parameter (refilling freed storage).
    pub fn unshard(&mut self) -> Result<(), FsdpError> {
        self.unshard_for(Gather::Params)
    }

    fn unshard_for(&mut self, purpose: Gather) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        for u in 0..self.units.len() {
            if self.units[u].unsharded {
                continue;
            }
            let local = self.units[u].shard.f_detach()?;
            let full = self.gather(u, &local, purpose)?;
            let unit = &mut self.units[u];
            for slot in &unit.slots {
                let src = full
                    .f_narrow(0, slot.offset, slot.numel)?
                    .f_view(slot.param.size().as_slice())?;
                if is_storage_freed(&slot.param)? {
                    refill_storage(&slot.param, Some(&src))?;
                } else {
                    slot.param.shallow_clone().f_copy_(&src)?;
                }
            }
            unit.unsharded = true;
            self.full_bytes_alive += unit.full_bytes;
            self.full_bytes_peak = self.full_bytes_peak.max(self.full_bytes_alive);
        }
        Ok(())
    }

    /// Frees the model's full parameters (not for `NoShard`, whose parameters stay). Until
    /// the next [`Fsdp::unshard`] nothing may read them.
    pub fn reshard(&mut self) -> Result<(), FsdpError> {
        if self.opts.strategy == ShardingStrategy::NoShard {
            return Ok(());
        }
        for unit in &mut self.units {
            if !unit.unsharded {
                continue;
            }
            for slot in &unit.slots {
                // SAFETY: every parameter owns its storage alone (checked in `new`), so only
                // the parameter and autograd's saved tensors alias it. Reshard runs after
                // backward (no graph left) or at construction; `unsharded = false` makes every
                // path that reads parameters through this wrapper (`before_forward`,
                // `before_record`) refill them first, and `Drop` refills them if no unshard
                // comes.
                unsafe { free_storage(&slot.param)? };
            }
            unit.unsharded = false;
            self.full_bytes_alive -= unit.full_bytes;
        }
        Ok(())
    }

    /// Reduces every unit's full gradients (last unit first, the order backward finishes
    /// them) into this rank's gradient shards (the shards' `.grad`), then writes the averaged
    /// full gradients back into the model's `.grad`s for the record.
    pub fn reduce_gradients(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let op = match self.opts.fault {
            Some(FsdpFault::SumInsteadOfAverage) => ReduceOp::Sum,
            None => ReduceOp::Avg,
        };
        for u in (0..self.units.len()).rev() {
            let unit = &self.units[u];
            let flat = unit.flatten(|s| {
                let g = s.param.grad();
                if g.defined() {
                    Ok(g)
                } else {
                    Err(FsdpError::MissingGrad(s.name.clone()))
                }
            })?;
            let grad_shard = if self.shard_world == 1 {
                self.group.all_reduce(&flat, op)?;
                self.counts.grad_all_reduces += 1;
                flat
            } else {
                let shard = Tensor::f_empty(
                    [unit.padded / self.shard_world as i64],
                    (unit.kind, flat.device()),
                )?;
                self.group.reduce_scatter(&shard, &flat, op)?;
                self.counts.grad_reduce_scatters += 1;
                shard
            };
            // Record view only: the optimizer reads the shard's gradient, never these.
            let full = self.gather(u, &grad_shard, Gather::RecordGrads)?;
            let unit = &self.units[u];
            for slot in &unit.slots {
                let mut g = slot.param.grad();
                g.f_copy_(&full.f_narrow(0, slot.offset, slot.numel)?.f_view_as(&g)?)?;
            }
            set_grad(&unit.shard, Some(&grad_shard))?;
        }
        Ok(())
    }

    /// Steps the shards and the ignored parameters with `optimizer`; for `NoShard` copies the
    /// updated flat parameters straight into the model.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<(), FsdpError> {
        let mut params: Vec<(String, Tensor)> = self
            .units
            .iter()
            .enumerate()
            .map(|(u, unit)| (format!("{FLAT_PARAM_NAME}.{u}"), unit.shard.shallow_clone()))
            .collect();
        params.extend(
            self.ignored
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone())),
        );
        optimizer.step(&params)?;
        for unit in &mut self.units {
            set_grad(&unit.shard, None)?;
            if self.opts.strategy == ShardingStrategy::NoShard {
                // Nothing is gathered; the parameters must follow the master copy now.
                unit.unsharded = false;
                self.full_bytes_alive -= unit.full_bytes;
            }
        }
        self.unshard()
    }
}

impl Drop for Fsdp {
    fn drop(&mut self) {
        for unit in self.units.iter().filter(|u| !u.unsharded) {
            for slot in &unit.slots {
                if matches!(is_storage_freed(&slot.param), Ok(true))
                    && refill_storage(&slot.param, None).is_ok()
                {
                    let _guard = tch::no_grad_guard();
                    let _ = slot.param.shallow_clone().f_fill_(f64::NAN);
                }
            }
        }
    }
}

impl StepHooks for Fsdp {
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        self.unshard().map_err(into_train)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        if !self.sync_grads {
            // `no_sync`: the full gradients accumulate in the model's `.grad`s and the full
            // parameters stay, so the next micro-step needs no collective.
            return Ok(());
        }
        self.reduce_gradients().map_err(into_train)?;
        self.reshard().map_err(into_train)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        if !self.sync_grads {
            return Err(TrainError::InvalidConfig(
                "fsdp: optimizer step inside no_sync (gradients not reduced yet)".into(),
            ));
        }
        if let Some(max_norm) = self.max_grad_norm {
            self.clip_grad_norm(max_norm).map_err(into_train)?;
        }
        self.step(optimizer).map_err(into_train)?;
        Ok(true)
    }

    fn before_record(&mut self) -> Result<(), TrainError> {
        self.unshard().map_err(into_train)
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
    Ok(train(model, cfg, &mut fsdp, Some(group.as_ref()))?)
}
