//! The per-unit mechanics every FSDP entry point shares: gather a unit's full parameters
//! (synchronously or prefetched), free them, and reduce its gradients into this rank's
//! shard. [`super::Fsdp`] drives these from the training hooks, the layer hooks and the
//! autograd hooks, which all reach this state through one lock.

use super::unit::{PendingGather, PendingReduce, Residency, Unit};
use super::FLAT_PARAM_NAME;
use super::{FsdpCallCounts, FsdpError, FsdpFault, FsdpOptions, ShardingStrategy};
use crate::autograd::{free_storage, is_storage_freed, refill_storage, set_grad};
use crate::comm::{ProcessGroup, ReduceOp, Work};
use crate::consistency::StateProbe;
use lockstep_models::ParamTags;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

/// What a gather is for (which counter it bumps).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Gather {
    Params,
    RecordGrads,
    /// State dicts, checkpoint loads, `summon_full_params`: not a training collective.
    Checkpoint,
}

/// Everything FSDP's hooks share.
pub(crate) struct Core {
    /// The group a flat parameter is sharded over (the whole data-parallel group, or the
    /// shard dimension of a hybrid mesh).
    pub(super) group: Arc<dyn ProcessGroup>,
    /// `group` for what is not training (the record's gradient gathers, checkpoints): the
    /// same group, but left out of the per-step collective tally when `group` counts.
    pub(super) record_group: Arc<dyn ProcessGroup>,
    /// Hybrid shard: the group the shards are replicated over (gradients all-reduced there).
    pub(super) replicate: Option<Arc<dyn ProcessGroup>>,
    pub(super) opts: FsdpOptions,
    /// The root unit first (when it has parameters), then the wrapped units in forward order.
    pub(super) units: Vec<Unit>,
    /// Parameters never sharded nor reduced (rank-local experts).
    pub(super) ignored: Vec<(String, Tensor)>,
    /// Mixed precision: the dtype ignored parameters compute in (by index into `ignored`;
    /// `None` keeps them as they are), and their fp32 masters while swapped out for a
    /// forward and backward.
    pub(super) ignored_compute: Vec<Option<Kind>>,
    pub(super) ignored_masters: Vec<Option<Tensor>>,
    /// Ranks a flat parameter is split over (1 for `NoShard`).
    pub(super) shard_world: usize,
    pub(super) shard_rank: usize,
    /// Where the model computes (the master shards live on the CPU with offload).
    pub(super) compute_device: Device,
    pub(super) full_bytes_alive: usize,
    pub(super) full_bytes_peak: usize,
    pub(super) counts: FsdpCallCounts,
    /// The model's buffers (not sharded; part of the state dicts).
    pub(super) buffers: Vec<(String, Tensor)>,
    /// Every distinct parameter's name in `named_parameters` order (state dict order).
    pub(super) order: Vec<String>,
    pub(super) tags: ParamTags,
    /// `false` inside [`super::Fsdp::no_sync`]: gradients accumulate locally, unreduced.
    pub(super) sync_grads: bool,
    /// Clip the gradient norm to this before every hooked optimizer step.
    pub(super) max_grad_norm: Option<f64>,
    /// The total gradient norm the last `clip_grad_norm` computed.
    pub(super) last_total_norm: Option<f64>,
    /// Unit of each layer of `Model::layers()` (`None`: its parameters are in the root).
    pub(super) unit_of_layer: Vec<Option<usize>>,
    /// Whether the model calls the layer hooks (so units gather lazily, per layer).
    pub(super) per_layer: bool,
    /// Built by [`super::Fsdp::over_tensors`] for a composition, whose own step decides when
    /// to reduce: a missing gradient reduces as zeros, the spent compute gradients are
    /// dropped instead of refilled for a record view (the composition gathers full values on
    /// demand), and the shard's optimizer state is named after the unit.
    pub(super) composed: bool,
}

impl Core {
    /// A core over `units` with nothing else yet (no ignored parameters, buffers, layers);
    /// the constructors fill in what their source has.
    pub(super) fn new(
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
        opts: FsdpOptions,
        units: Vec<Unit>,
        compute_device: Device,
    ) -> Core {
        let (shard_world, shard_rank) = match opts.strategy {
            ShardingStrategy::NoShard => (1, 0),
            _ => (group.size(), group.rank()),
        };
        Core {
            record_group: group.clone(),
            group,
            replicate,
            opts,
            units,
            ignored: Vec::new(),
            ignored_compute: Vec::new(),
            ignored_masters: Vec::new(),
            shard_world,
            shard_rank,
            compute_device,
            full_bytes_alive: 0,
            full_bytes_peak: 0,
            counts: FsdpCallCounts::default(),
            buffers: Vec::new(),
            order: Vec::new(),
            tags: ParamTags::default(),
            sync_grads: true,
            max_grad_norm: None,
            last_total_norm: None,
            unit_of_layer: Vec::new(),
            per_layer: false,
            composed: false,
        }
    }

    /// The rank's position in the whole data-parallel world (hybrid: replica-major).
    pub(super) fn global_rank(&self) -> usize {
        match &self.replicate {
            Some(r) => r.rank() * self.group.size() + self.group.rank(),
            None => self.group.rank(),
        }
    }

    /// Bytes of this rank's master shards.
    pub(super) fn shard_bytes(&self) -> usize {
        self.units
            .iter()
            .map(|u| u.shard.numel() * u.kind.elt_size_in_bytes())
            .sum()
    }

    /// Ranks in the whole data-parallel world.
    pub(super) fn global_size(&self) -> usize {
        self.group.size() * self.replicate.as_ref().map_or(1, |r| r.size())
    }

    /// All-reduces `t` over every rank of the world (both mesh dimensions for hybrid).
    pub(super) fn all_reduce_world(&self, t: &Tensor, op: ReduceOp) -> Result<(), FsdpError> {
        self.group.all_reduce(t, op)?;
        if let Some(r) = &self.replicate {
            r.all_reduce(t, op)?;
        }
        Ok(())
    }

    /// Broadcasts global rank 0's `tensors` to every rank (both mesh dimensions for hybrid).
    pub(super) fn broadcast_world<'a>(
        &self,
        tensors: impl IntoIterator<Item = &'a Tensor> + Clone,
    ) -> Result<(), FsdpError> {
        crate::replica::broadcast_from_rank0(self.group.as_ref(), tensors.clone())?;
        if let Some(r) = &self.replicate {
            crate::replica::broadcast_from_rank0(r.as_ref(), tensors)?;
        }
        Ok(())
    }

    fn count(&mut self, purpose: Gather) {
        match purpose {
            Gather::Params => self.counts.param_all_gathers += 1,
            Gather::RecordGrads => self.counts.record_grad_all_gathers += 1,
            Gather::Checkpoint => {}
        }
    }

    /// Unit `u`'s full flat tensor from every rank's `local` part (rank order), blocking.
    pub(super) fn gather(
        &mut self,
        u: usize,
        local: &Tensor,
        purpose: Gather,
    ) -> Result<Tensor, FsdpError> {
        if self.shard_world == 1 {
            return Ok(local.shallow_clone());
        }
        let full = Tensor::f_empty([self.units[u].padded], (local.kind(), local.device()))?;
        let label = format!("FSDP unit `{}`'s parameters", self.units[u].name);
        let group = match purpose {
            Gather::Params => &self.group,
            Gather::RecordGrads | Gather::Checkpoint => &self.record_group,
        };
        crate::comm::labelled(&label, || group.all_gather(&full, local))?;
        self.count(purpose);
        Ok(full)
    }

    /// This rank's shard of unit `u` as the gather sends it: on the compute device, in `kind`.
    fn send_buffer(&self, u: usize, kind: Kind) -> Result<Tensor, FsdpError> {
        Ok(self.units[u]
            .shard
            .f_detach()?
            .f_to_device(self.compute_device)?
            .f_to_kind(kind)?)
    }

    fn account_gathered(&mut self, u: usize, kind: Kind) {
        let bytes = self.units[u].full_bytes(kind);
        self.units[u].alive_bytes = bytes;
        self.full_bytes_alive += bytes;
        self.full_bytes_peak = self.full_bytes_peak.max(self.full_bytes_alive);
    }

    /// Starts gathering unit `u` for forward or backward (prefetch) unless it is gathered or
    /// gathering already.
    pub(super) fn prefetch(&mut self, u: usize) -> Result<(), FsdpError> {
        if self.units[u].residency != Residency::Sharded || self.shard_world == 1 {
            return Ok(());
        }
        let kind = self.units[u].compute_kind;
        let local = self.send_buffer(u, kind)?;
        let full = Tensor::f_empty([self.units[u].padded], (kind, self.compute_device))?;
        let label = format!("FSDP unit `{}`'s parameters", self.units[u].name);
        let work = crate::comm::labelled(&label, || self.group.all_gather_async(&full, &local))?;
        self.count(Gather::Params);
        self.account_gathered(u, kind);
        let unit = &mut self.units[u];
        unit.pending_gather = Some(PendingGather {
            work,
            full,
            _local: local,
        });
        unit.residency = Residency::Gathering;
        Ok(())
    }

    /// Makes unit `u`'s parameters hold its full current values in `kind`: waits for its
    /// prefetch, or gathers now.
    pub(super) fn unshard_unit(
        &mut self,
        u: usize,
        purpose: Gather,
        kind: Kind,
    ) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let full = match self.units[u].residency {
            Residency::Unsharded => {
                if self.units[u].slots.first().map(|s| s.param.kind()) == Some(kind) {
                    return Ok(());
                }
                // Gathered in another dtype (mixed precision compute vs. the fp32 record).
                self.release(u);
                self.gather_now(u, purpose, kind)?
            }
            Residency::Gathering => {
                let pending = self.units[u].pending_gather.take();
                match pending {
                    Some(p) if p.full.kind() == kind => {
                        p.work.wait()?;
                        p.full
                    }
                    Some(p) => {
                        p.work.wait()?;
                        self.release(u);
                        self.gather_now(u, purpose, kind)?
                    }
                    None => self.gather_now(u, purpose, kind)?,
                }
            }
            Residency::Sharded => self.gather_now(u, purpose, kind)?,
        };
        let unit = &mut self.units[u];
        for slot in &unit.slots {
            let src = full
                .f_narrow(0, slot.offset, slot.numel)?
                .f_view(slot.param.size().as_slice())?;
            if slot.param.kind() != kind {
                // Mixed precision: the parameter computes in another dtype than it last held.
                let mut p = slot.param.shallow_clone();
                p.set_data(&src.f_detach_copy()?);
            } else if is_storage_freed(&slot.param)? {
                refill_storage(&slot.param, Some(&src))?;
            } else {
                slot.param.shallow_clone().f_copy_(&src)?;
            }
        }
        unit.residency = Residency::Unsharded;
        Ok(())
    }

    /// Gathers unit `u` now (blocking) and accounts its bytes.
    fn gather_now(&mut self, u: usize, purpose: Gather, kind: Kind) -> Result<Tensor, FsdpError> {
        let local = self.send_buffer(u, kind)?;
        let full = self.gather(u, &local, purpose)?;
        self.account_gathered(u, kind);
        Ok(full)
    }

    /// Forgets unit `u`'s full parameters' accounting (before a re-gather in another dtype).
    pub(super) fn release(&mut self, u: usize) {
        self.full_bytes_alive -= self.units[u].alive_bytes;
        self.units[u].alive_bytes = 0;
        self.units[u].residency = Residency::Sharded;
    }

    /// Frees unit `u`'s full parameters (never for `NoShard`, whose parameters are the
    /// replica). A prefetch in flight is completed first.
    pub(super) fn reshard_unit(&mut self, u: usize) -> Result<(), FsdpError> {
        if self.opts.strategy == ShardingStrategy::NoShard {
            return Ok(());
        }
        if let Some(p) = self.units[u].pending_gather.take() {
            p.work.wait()?;
        }
        if self.units[u].residency == Residency::Sharded {
            return Ok(());
        }
        for slot in &self.units[u].slots {
            if is_storage_freed(&slot.param)? {
                continue;
            }
            // SAFETY: every parameter owns its storage alone (checked in `Fsdp::new`), so only
            // the parameter and autograd's saved tensors alias it. A unit is freed after its
            // forward (its pre-backward hook refills the same storage before any saved tensor
            // is read), after its backward (every node using it has run), or between steps;
            // every path that reads parameters through this wrapper gathers first, and
            // `Fsdp`'s `Drop` refills what is still freed.
            unsafe { free_storage(&slot.param)? };
        }
        self.release(u);
        Ok(())
    }

    /// Frees every unit.
    pub(super) fn reshard_all(&mut self) -> Result<(), FsdpError> {
        for u in 0..self.units.len() {
            self.reshard_unit(u)?;
        }
        Ok(())
    }

    /// Launches unit `u`'s gradient reduction: flattens the full `.grad`s, casts them to the
    /// reduce dtype and reduce-scatters (`NoShard`: all-reduces) them asynchronously.
    pub(super) fn launch_reduce(&mut self, u: usize) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let op = match self.opts.fault {
            Some(FsdpFault::SumInsteadOfAverage) => ReduceOp::Sum,
            _ => ReduceOp::Avg,
        };
        let reduce_kind = self.units[u].reduce_kind;
        let unit = &self.units[u];
        let mut flat = unit
            .flatten(|s| {
                let g = s.param.grad();
                if g.defined() {
                    Ok(g)
                } else if self.composed {
                    Ok(s.param.f_zeros_like()?)
                } else {
                    Err(FsdpError::MissingGrad(s.name.clone()))
                }
            })?
            .f_to_kind(reduce_kind)?;
        let pending = if self.group.size() == 1 {
            // A group of one has nothing to reduce: the flat gradient is the shard.
            PendingReduce {
                work: Work::done(Ok(())),
                shard: flat.shallow_clone(),
                _flat: flat,
            }
        } else if self.shard_world == 1 {
            let work = self.group.all_reduce_async(&flat, op)?;
            self.counts.grad_all_reduces += 1;
            PendingReduce {
                work,
                shard: flat.shallow_clone(),
                _flat: flat,
            }
        } else {
            let size = unit.padded / self.shard_world as i64;
            if self.opts.fault == Some(FsdpFault::ReduceScatterWrongShard) {
                // Planted: every rank receives its neighbour's chunk.
                flat = flat.f_roll([size], [0])?;
            }
            let shard = Tensor::f_empty([size], (reduce_kind, flat.device()))?;
            let label = format!("FSDP unit `{}`'s gradients", unit.name);
            let work = crate::comm::labelled(&label, || {
                self.group.reduce_scatter_async(&shard, &flat, op)
            })?;
            self.counts.grad_reduce_scatters += 1;
            PendingReduce {
                work,
                shard,
                _flat: flat,
            }
        };
        let unit = &mut self.units[u];
        unit.pending_reduce = Some(pending);
        unit.reduced = true;
        Ok(())
    }

    /// Mixed precision: swaps each low-precision ignored parameter's data for a copy in its
    /// compute dtype (as DDP does for every parameter), keeping the fp32 master. Their
    /// layers' inputs are cast like every other layer's, so they must compute in that dtype.
    pub(super) fn swap_in_ignored(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        for (i, (_, t)) in self.ignored.iter().enumerate() {
            let Some(kind) = self.ignored_compute[i] else {
                continue;
            };
            if self.ignored_masters[i].is_some() {
                continue; // Still swapped (gradient accumulation without sync).
            }
            let g = t.grad();
            if g.defined() && g.kind() != kind {
                set_grad(t, None)?;
            }
            let master = t.f_detach()?;
            let mut p = t.shallow_clone();
            p.set_data(&master.f_to_kind(kind)?);
            self.ignored_masters[i] = Some(master);
        }
        Ok(())
    }

    /// Gives swapped ignored parameters their fp32 masters back, with their low-precision
    /// gradients cast to fp32 (what the optimizer steps).
    pub(super) fn swap_out_ignored(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        for (i, (_, t)) in self.ignored.iter().enumerate() {
            let Some(master) = self.ignored_masters[i].take() else {
                continue;
            };
            let g = t.grad();
            let mut p = t.shallow_clone();
            p.set_data(&master);
            if g.defined() {
                set_grad(t, Some(&g.f_to_kind(master.kind())?))?;
            }
        }
        Ok(())
    }

    /// Finishes the step's gradient reduction: launches what the post-backward hooks did
    /// not (last unit first, the order backward completes them), waits, all-reduces across
    /// replicas (hybrid), sets each shard's `.grad` (in the master dtype, on the master's
    /// device), then writes the averaged full gradients into the model's `.grad`s for the
    /// record (one extra all-gather per unit that real FSDP does not pay).
    pub(super) fn finish_gradients(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        for u in (0..self.units.len()).rev() {
            if !self.units[u].reduced {
                self.launch_reduce(u)?;
            }
        }
        let mut shards = Vec::with_capacity(self.units.len());
        for u in 0..self.units.len() {
            let Some(p) = self.units[u].pending_reduce.take() else {
                return Err(FsdpError::Invalid(format!(
                    "unit `{}` has no gradient reduction in flight",
                    self.units[u].name
                )));
            };
            p.work.wait()?;
            shards.push(p.shard);
        }
        for (u, shard) in shards.iter().enumerate().rev() {
            if let Some(r) = self.replicate.as_ref().filter(|r| r.size() > 1) {
                r.all_reduce(shard, ReduceOp::Avg)?;
                self.counts.replica_grad_all_reduces += 1;
            }
            let master = shard
                .f_to_kind(self.units[u].kind)?
                .f_to_device(self.units[u].shard.device())?;
            // Record view only: the optimizer reads the shard's gradient, never these.
            let full = match self.composed {
                true => None,
                false => Some(self.gather(u, shard, Gather::RecordGrads)?),
            };
            let unit = &mut self.units[u];
            for slot in &unit.slots {
                let Some(full) = &full else {
                    // Spent: a composition gathers full gradients on demand from the shard.
                    set_grad(&slot.param, None)?;
                    continue;
                };
                let src = full
                    .f_narrow(0, slot.offset, slot.numel)?
                    .f_view(slot.param.size().as_slice())?
                    .f_to_kind(unit.kind)?;
                let g = slot.param.grad();
                if g.defined() && g.kind() == unit.kind {
                    g.shallow_clone().f_copy_(&src)?;
                } else {
                    // Mixed precision: the model's `.grad` was the low-precision one. A copy,
                    // not a view of the gathered buffer (`zero_grad` detaches in place).
                    set_grad(&slot.param, Some(&src.f_detach_copy()?))?;
                }
            }
            set_grad(&unit.shard, Some(&master))?;
            unit.reduced = false;
            unit.ready = 0;
        }
        self.swap_out_ignored()?;
        if self.opts.fault == Some(FsdpFault::ReduceIgnored) {
            for (_, t) in &self.ignored {
                let g = t.grad();
                if g.defined() {
                    self.all_reduce_world(&g, ReduceOp::Avg)?;
                }
            }
        }
        Ok(())
    }
}

/// What the optimizer and the cross-rank check call a unit's shard and the ignored parameters.
impl Core {
    /// Names of the ignored (rank-local) parameters.
    pub(super) fn ignored_param_names(&self) -> Vec<String> {
        self.ignored.iter().map(|(n, _)| n.clone()).collect()
    }

    /// What the optimizer steps: each unit's shard (under the flat parameter's name), then
    /// the ignored parameters.
    pub(super) fn stepped_tensors(&self) -> Vec<(String, Tensor)> {
        let mut params: Vec<(String, Tensor)> = (0..self.units.len())
            .map(|u| (self.flat_name(u), self.units[u].shard.shallow_clone()))
            .collect();
        params.extend(
            self.ignored
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone())),
        );
        params
    }

    /// Which copy of stepped tensor `name` this rank holds: its shard index (none when every
    /// rank holds the whole flat parameter), or this rank alone for an ignored parameter.
    pub(super) fn state_coordinate(&self, name: &str, probe: &StateProbe) -> String {
        if self.ignored.iter().any(|(n, _)| n == name) {
            probe.rank_local()
        } else {
            self.shard_coordinate()
        }
    }

    /// Which shard of every flat parameter this rank holds (see [`Fsdp::shard_coordinate`]).
    pub(super) fn shard_coordinate(&self) -> String {
        match self.shard_world {
            1 => String::new(),
            w => format!("shard{}/{w}", self.shard_rank),
        }
    }

    /// The name unit `u`'s shard is stepped (and its optimizer state keyed) under.
    pub(super) fn flat_name(&self, u: usize) -> String {
        match self.composed {
            true => self.units[u].name.clone(),
            false => format!("{FLAT_PARAM_NAME}.{u}"),
        }
    }
}
