//! Fully sharded data parallel (FSDP1-style flat parameters), first slice: the whole model is
//! **one root unit** with one flat parameter.
//!
//! * **Flat parameter**: the unit's parameters (tied ones once, rank-local ones left out)
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
//! Between a reshard and the next unshard the model's parameters have no memory: nothing may
//! read them (forward, or `Model::save`) until [`Fsdp::unshard`] (or `before_forward` /
//! `before_record`) ran. [`train`] keeps that order. Dropping an [`Fsdp`] while resharded
//! refills the parameters with NaN so they stay safe to touch, and visibly invalid.

use crate::autograd::{
    free_storage, is_storage_freed, refill_storage, set_grad, storage_nbytes, AutogradError,
};
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use crate::record::RunRecord;
use crate::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep_models::Model;
use std::collections::HashSet;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The optimizer-state name of the root unit's flat parameter shard.
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
    /// A planted bug, for checker tests only.
    pub fault: Option<FsdpFault>,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            strategy: ShardingStrategy::FullShard,
            reshard_after_forward: true,
            sync_module_states: true,
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
}

/// One managed parameter's place in the flat parameter.
struct Slot {
    name: String,
    /// The model's own tensor (the "view" the flat parameter is copied into).
    param: Tensor,
    offset: i64,
    numel: i64,
}

/// FSDP over one data-parallel group, the whole model as one unit. Plug it into [`train`]
/// as its [`StepHooks`], or use [`train_fsdp`].
pub struct Fsdp {
    group: Arc<dyn ProcessGroup>,
    opts: FsdpOptions,
    slots: Vec<Slot>,
    /// Parameters never sharded nor reduced (rank-local experts).
    ignored: Vec<(String, Tensor)>,
    kind: Kind,
    /// Elements of the flat parameter before padding.
    numel: i64,
    /// Elements after padding (a multiple of `shard_world`).
    padded: i64,
    /// Ranks the flat parameter is split over (1 for `NoShard`).
    shard_world: usize,
    /// This rank's master copy of its part of the flat parameter.
    shard: Tensor,
    /// Whether the model's full parameters currently hold memory and current values.
    unsharded: bool,
    full_bytes: usize,
    full_bytes_alive: usize,
    full_bytes_peak: usize,
    counts: CollectiveCounts,
}

impl Fsdp {
    /// Wraps `model` (built identically on every rank except its rank-local parameters):
    /// optionally broadcasts rank 0's state, builds the flat parameter, keeps this rank's
    /// shard and (unless `NoShard`) frees the model's full parameters until the next unshard.
    pub fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        opts: FsdpOptions,
    ) -> Result<Fsdp, FsdpError> {
        let tags = model.tags();
        // One entry per distinct tensor: tied parameters are one tensor with one gradient.
        let mut seen = HashSet::new();
        let mut managed = Vec::new();
        let mut ignored = Vec::new();
        for (name, t) in model.named_parameters() {
            if !seen.insert(t.data_ptr() as usize) {
                continue;
            }
            if tags.is_rank_local(&name) {
                ignored.push((name, t));
            } else {
                managed.push((name, t));
            }
        }
        let Some(kind) = managed.first().map(|(_, t)| t.kind()) else {
            return Err(FsdpError::Invalid(
                "no parameter to shard (every parameter is ignored)".into(),
            ));
        };
        let mut slots = Vec::with_capacity(managed.len());
        let mut offset = 0i64;
        let mut full_bytes = 0usize;
        for (name, param) in managed {
            if param.kind() != kind {
                return Err(FsdpError::Invalid(format!(
                    "parameter `{name}` is {:?} but the flat parameter is {kind:?}",
                    param.kind()
                )));
            }
            let numel = param.numel() as i64;
            let bytes = param.numel() * kind.elt_size_in_bytes();
            // Freeing a storage frees every alias: each parameter must own its storage alone.
            if !param.is_contiguous() || storage_nbytes(&param)? != bytes {
                return Err(FsdpError::Invalid(format!(
                    "parameter `{name}` does not own its storage (a view or a shared buffer)"
                )));
            }
            full_bytes += bytes;
            slots.push(Slot {
                name,
                param,
                offset,
                numel,
            });
            offset += numel;
        }
        let (shard_world, shard_rank) = match opts.strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (group.size(), group.rank()),
        };
        let world = shard_world as i64;
        let padded = (offset + world - 1) / world * world;
        let _guard = tch::no_grad_guard();
        if opts.sync_module_states {
            for slot in &slots {
                group.broadcast(&slot.param, 0)?;
            }
            for (_, b) in model.named_buffers() {
                group.broadcast(&b, 0)?;
            }
        }
        let flat = Self::flatten(&slots, padded, |s| Ok(s.param.shallow_clone()))?;
        let shard_size = padded / world;
        let shard = flat
            .f_narrow(0, shard_rank as i64 * shard_size, shard_size)?
            .f_detach_copy()?
            .set_requires_grad(true);
        let mut fsdp = Fsdp {
            group,
            opts,
            slots,
            ignored,
            kind,
            numel: offset,
            padded,
            shard_world,
            shard,
            unsharded: true,
            full_bytes,
            full_bytes_alive: full_bytes,
            full_bytes_peak: full_bytes,
            counts: CollectiveCounts::default(),
        };
        fsdp.reshard()?;
        Ok(fsdp)
    }

    /// The strategy this wrapper runs.
    pub fn strategy(&self) -> ShardingStrategy {
        self.opts.strategy
    }

    /// Names of the parameters in the flat parameter, in flat order.
    pub fn flat_param_names(&self) -> Vec<String> {
        self.slots.iter().map(|s| s.name.clone()).collect()
    }

    /// Names of the ignored (rank-local) parameters, never sharded nor reduced.
    pub fn ignored_param_names(&self) -> Vec<String> {
        self.ignored.iter().map(|(n, _)| n.clone()).collect()
    }

    /// Elements of the flat parameter: (unpadded, padded).
    pub fn flat_numel(&self) -> (usize, usize) {
        (self.numel as usize, self.padded as usize)
    }

    /// This rank's master shard of the flat parameter (a copy: the optimizer owns it).
    pub fn local_shard(&self) -> Result<Tensor, FsdpError> {
        Ok(self.shard.f_detach_copy()?)
    }

    /// Whether the model's full parameters currently hold memory and current values.
    pub fn is_unsharded(&self) -> bool {
        self.unsharded
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

    /// Bytes of this rank's master shard (what stays alive between steps).
    pub fn shard_bytes(&self) -> usize {
        self.shard.numel() * self.kind.elt_size_in_bytes()
    }

    /// Collectives issued since construction, by purpose (one unit: per `FullShard` step one
    /// parameter all-gather, one gradient reduce-scatter and one record all-gather).
    pub fn collective_counts(&self) -> CollectiveCounts {
        self.counts
    }

    /// `slots`' tensors (chosen by `pick`) flattened, concatenated and zero-padded to
    /// `padded` elements.
    fn flatten(
        slots: &[Slot],
        padded: i64,
        pick: impl Fn(&Slot) -> Result<Tensor, FsdpError>,
    ) -> Result<Tensor, FsdpError> {
        let mut parts = Vec::with_capacity(slots.len() + 1);
        let mut numel = 0;
        let mut kind = None;
        for slot in slots {
            let t = pick(slot)?;
            kind = Some(t.kind());
            numel += slot.numel;
            parts.push(t.f_reshape([-1])?);
        }
        if padded > numel {
            let k = kind.unwrap_or(Kind::Float);
            let device = slots.first().map_or(tch::Device::Cpu, |s| s.param.device());
            parts.push(Tensor::f_zeros([padded - numel], (k, device))?);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }

    /// The full flat tensor from every rank's `local` part (rank order).
    fn gather(&mut self, local: &Tensor, purpose: Gather) -> Result<Tensor, FsdpError> {
        if self.shard_world == 1 {
            return Ok(local.shallow_clone());
        }
        let full = Tensor::f_empty([self.padded], (self.kind, local.device()))?;
        self.group.all_gather(&full, local)?;
        match purpose {
            Gather::Params => self.counts.param_all_gathers += 1,
            Gather::RecordGrads => self.counts.record_grad_all_gathers += 1,
        }
        Ok(full)
    }

    /// Makes the model's full parameters current: all-gathers the shards and copies each
    /// slice into its parameter (refilling freed storage). A no-op when already unsharded.
    pub fn unshard(&mut self) -> Result<(), FsdpError> {
        if self.unsharded {
            return Ok(());
        }
        let _guard = tch::no_grad_guard();
        let local = self.shard.f_detach()?;
        let full = self.gather(&local, Gather::Params)?;
        for slot in &self.slots {
            let src = full
                .f_narrow(0, slot.offset, slot.numel)?
                .f_view(slot.param.size().as_slice())?;
            if is_storage_freed(&slot.param)? {
                refill_storage(&slot.param, Some(&src))?;
            } else {
                slot.param.shallow_clone().f_copy_(&src)?;
            }
        }
        self.unsharded = true;
        self.full_bytes_alive = self.full_bytes;
        self.full_bytes_peak = self.full_bytes_peak.max(self.full_bytes_alive);
        Ok(())
    }

    /// Frees the model's full parameters (not for `NoShard`, whose parameters stay). Until
    /// the next [`Fsdp::unshard`] nothing may read them.
    pub fn reshard(&mut self) -> Result<(), FsdpError> {
        if !self.unsharded || self.opts.strategy == ShardingStrategy::NoShard {
            return Ok(());
        }
        for slot in &self.slots {
            // SAFETY: every parameter owns its storage alone (checked in `new`), so only the
            // parameter and autograd's saved tensors alias it. Reshard runs after backward (no
            // graph left) or at construction; `self.unsharded = false` makes every path that
            // reads parameters through this wrapper (`before_forward`, `before_record`) refill
            // them first, and `Drop` refills them if no unshard comes.
            unsafe { free_storage(&slot.param)? };
        }
        self.unsharded = false;
        self.full_bytes_alive = 0;
        Ok(())
    }

    /// Reduces the full gradients into this rank's gradient shard (the shard's `.grad`), then
    /// writes the averaged full gradients back into the model's `.grad`s for the record.
    pub fn reduce_gradients(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let op = match self.opts.fault {
            Some(FsdpFault::SumInsteadOfAverage) => ReduceOp::Sum,
            None => ReduceOp::Avg,
        };
        let flat = Self::flatten(&self.slots, self.padded, |s| {
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
                [self.padded / self.shard_world as i64],
                (self.kind, flat.device()),
            )?;
            self.group.reduce_scatter(&shard, &flat, op)?;
            self.counts.grad_reduce_scatters += 1;
            shard
        };
        // Record view only: the optimizer reads the shard's gradient, never these.
        let full = self.gather(&grad_shard, Gather::RecordGrads)?;
        for slot in &self.slots {
            let mut g = slot.param.grad();
            g.f_copy_(&full.f_narrow(0, slot.offset, slot.numel)?.f_view_as(&g)?)?;
        }
        set_grad(&self.shard, Some(&grad_shard))?;
        Ok(())
    }

    /// Steps the shard and the ignored parameters with `optimizer`; for `NoShard` copies the
    /// updated flat parameter straight into the model.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<(), FsdpError> {
        let mut params = vec![(FLAT_PARAM_NAME.to_owned(), self.shard.shallow_clone())];
        params.extend(
            self.ignored
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone())),
        );
        optimizer.step(&params)?;
        set_grad(&self.shard, None)?;
        if self.opts.strategy == ShardingStrategy::NoShard {
            // Nothing is gathered; the parameters must follow the master copy now.
            self.unsharded = false;
            self.unshard()?;
        }
        Ok(())
    }
}

impl Drop for Fsdp {
    fn drop(&mut self) {
        if self.unsharded {
            return;
        }
        for slot in &self.slots {
            if matches!(is_storage_freed(&slot.param), Ok(true))
                && refill_storage(&slot.param, None).is_ok()
            {
                let _guard = tch::no_grad_guard();
                let _ = slot.param.shallow_clone().f_fill_(f64::NAN);
            }
        }
    }
}

impl StepHooks for Fsdp {
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        self.unshard().map_err(into_train)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.reduce_gradients().map_err(into_train)?;
        self.reshard().map_err(into_train)
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        _params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
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
