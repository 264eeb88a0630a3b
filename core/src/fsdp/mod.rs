//! Fully sharded data parallel (FSDP1-style flat parameters): each unit's parameters are
//! one flat parameter sharded over the group, gathered only while a layer of the unit runs.
//!
//! * **Units** ([`WrapPolicy`]): the root unit (parameters no wrapped layer owns alone, such
//!   as tied embeddings) and one unit per wrapped layer group, planned by `fsdp/wrap.rs`.
//! * **Flat parameter** (`fsdp/unit.rs`): a unit's parameters (tied ones once, rank-local
//!   ones left out) flattened and concatenated in `named_parameters` order, zero-padded to a
//!   multiple of the sharding world size. Rank `r` keeps elements `[r·s, (r+1)·s)`
//!   (`s = padded / world`) as its **master copy**; the optimizer (and its state) lives on
//!   that shard only.
//! * **Forward** (models with layer hooks, [`Model::supports_layer_hooks`]): the root is
//!   gathered before forward; each unit is all-gathered in the pre-forward hook of its first
//!   layer (or prefetched one unit ahead with `forward_prefetch`) by copying the gathered
//!   slices into the model's own parameter storages, refilled in place; with
//!   [`ShardingStrategy::FullShard`] and `reshard_after_forward` its storages are freed again
//!   after its last layer, while autograd still holds them. Models without layer hooks get
//!   every unit gathered before forward.
//! * **Backward**: a hook on every output of a unit's layers re-gathers the unit (refilling
//!   the same storages autograd saved, so the saved tensors read the gathered values) before
//!   its backward runs, and prefetches the next unit backward needs ([`BackwardPrefetch`]).
//!   A post-accumulate-grad hook on each parameter launches the unit's asynchronous
//!   reduce-scatter (`Avg`) as soon as its last gradient is complete, and frees the unit.
//! * **Gradients**: the reduce-scatter of the flat gradient gives this rank's shard of the
//!   average, bit-identical to the same elements of DDP's all-reduce; it becomes the shard's
//!   `.grad`. Hybrid shard all-reduces it across replicas too.
//! * **Record view** (not part of FSDP's math): so the run's record holds the same full
//!   averaged gradients (and gradient norm) as DDP's, the reduced gradient shards are
//!   all-gathered back into the model's `.grad`s — one extra all-gather per unit and step
//!   that real FSDP does not pay, counted apart in [`FsdpCallCounts`].
//! * **Optimizer step**: through [`StepHooks::optimizer_step`](crate::train::StepHooks::optimizer_step), the run's optimizer steps the
//!   shards (each under `_fsdp_flat_param.<unit>`) and the ignored parameters.
//! * **Ignored parameters**: rank-local ones (the experts of `MixtureOfExperts`) are never
//!   broadcast, sharded nor reduced; the optimizer steps them in place.
//! * [`ShardingStrategy::NoShard`]: the "shard" is the whole flat parameter, gradients are
//!   all-reduced (Avg), and no storage is ever freed.
//! * **Memory accounting**: [`Fsdp::full_param_bytes`] and [`Fsdp::full_param_bytes_peak`]
//!   count the bytes of full parameters alive (gathered or being gathered) on this rank.
//! * **State dicts, clipping, accumulation** (`fsdp/state.rs`): full and sharded state dicts
//!   saved as safetensors and loaded back bitwise ([`Fsdp::save_full`], [`Fsdp::load_full`],
//!   [`Fsdp::save_sharded`], [`Fsdp::load_sharded`]); [`Fsdp::clip_grad_norm`] over the
//!   global norm; [`Fsdp::no_sync`] gradient accumulation without collectives;
//!   [`Fsdp::summon_full_params`].
//! * **Compositions** ([`Fsdp::over_tensors`]): the data dimension of FSDP×TP, HSDP×TP,
//!   PP×FSDP and EP×FSDP is this engine too, one unit over the tensors the other parallelism
//!   left on the rank, without hooks, driven by the composition's own step.
//!
//! Between a reshard and the next unshard the model's parameters have no memory: nothing may
//! read them (forward, or `Model::save`) until [`Fsdp::unshard`] (or `before_forward` /
//! `before_record`) ran. [`train`](crate::train::train) keeps that order. Dropping an [`Fsdp`] while resharded
//! refills the parameters with NaN so they stay safe to touch, and visibly invalid.

use crate::autograd::{set_grad, storage_nbytes, HookHandle};
use crate::comm::work::lock;
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup};
use crate::precision::{cast_buffers, low_precision_params, CastInputs};
use crate::record::{MemoryStats, RunRecord};
use crate::replica::distinct_parameters;
use crate::train::Optimizer;
use lockstep_models::Model;
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Device, Tensor};

mod core;
mod error;
mod hooks;
mod options;
mod state;
mod step;
mod unit;
mod wrap;

use self::core::{Core, Gather};
use hooks::register_post_backward;
use unit::{Residency, Slot, Unit};

pub use error::FsdpError;
pub use options::{BackwardPrefetch, FsdpCallCounts, FsdpFault, FsdpOptions, ShardingStrategy};
pub use state::{ShardedLayout, ShardedParamMeta, ShardedStateDict, ShardedUnitMeta};
pub use step::{hybrid_mesh, train_fsdp, train_fsdp_hybrid};
pub use wrap::WrapPolicy;

/// The optimizer-state name prefix of the flat parameter shards (`_fsdp_flat_param.<unit>`).
pub const FLAT_PARAM_NAME: &str = "_fsdp_flat_param";

/// FSDP over one data-parallel group (or a hybrid mesh). Plug it into [`train`](crate::train::train) as its
/// [`StepHooks`](crate::train::StepHooks) (it is also the [`LayerHooks`](lockstep_models::LayerHooks) `train` runs forward through), or use
/// [`train_fsdp`].
pub struct Fsdp {
    core: Arc<Mutex<Core>>,
    /// Mixed precision: casts each layer's inputs to the dtype it computes in.
    cast: Option<CastInputs>,
    /// Post-accumulate-grad hooks (post-backward), removed on drop.
    post_backward: Vec<HookHandle>,
    /// What training ran on FSDP's groups since the record last took it (a wrapper over a
    /// model only: a composition counts its own groups).
    counts: Option<CollectiveCounts>,
}

impl Fsdp {
    /// Wraps `model` (built identically on every rank except its rank-local parameters) over
    /// `group`: optionally broadcasts rank 0's state, builds the units' flat parameters, keeps
    /// this rank's shards and (unless `NoShard`) frees the model's full parameters until they
    /// are gathered.
    pub fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        opts: FsdpOptions,
    ) -> Result<Fsdp, FsdpError> {
        if opts.strategy == ShardingStrategy::HybridShard {
            return Err(FsdpError::Invalid(
                "hybrid shard needs a 2-D mesh (replicate × shard): use Fsdp::new_hybrid".into(),
            ));
        }
        Self::build(model, group, None, opts)
    }

    /// Wraps `model` for [`ShardingStrategy::HybridShard`] on `mesh`, whose dimensions must be
    /// `replicate` and `shard` (see [`hybrid_mesh`]).
    pub fn new_hybrid(
        model: &dyn Model,
        mesh: &DeviceMesh,
        opts: FsdpOptions,
    ) -> Result<Fsdp, FsdpError> {
        if opts.strategy != ShardingStrategy::HybridShard {
            return Err(FsdpError::Invalid(format!(
                "Fsdp::new_hybrid needs ShardingStrategy::HybridShard, not {:?}",
                opts.strategy
            )));
        }
        if mesh.names() != ["replicate", "shard"] {
            return Err(FsdpError::Invalid(format!(
                "hybrid shard needs a mesh with dimensions [replicate, shard], not [{}]",
                mesh.names().join(", ")
            )));
        }
        let shard = mesh.group("shard")?;
        let replicate = mesh.group("replicate")?;
        Self::build(model, shard, Some(replicate), opts)
    }

    fn build(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
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
        let layers = model.layers();
        let sizes: Vec<(String, i64)> = managed
            .iter()
            .map(|(n, t)| (n.clone(), t.numel() as i64))
            .collect();
        let (cast, isolate) = match &opts.mixed_precision {
            None => (None, Vec::new()),
            Some(mp) => {
                let cast = CastInputs::for_model(model, mp)?;
                cast_buffers(model, mp)?;
                // Layers computing in another dtype than `param_dtype` (BatchNorm kept in
                // fp32) need units of their own: a unit is gathered in one dtype.
                let isolate = (0..layers.len())
                    .filter(|&l| mp.compute_dtype(layers[l].kind) != mp.param_dtype)
                    .collect();
                (Some(cast), isolate)
            }
        };
        let plan = wrap::plan_units(&opts.wrap, &layers, &tags, &sizes, &isolate)?;
        let world = match opts.strategy {
            ShardingStrategy::NoShard => 1,
            _ => group.size() as i64,
        };
        // The units gather, reduce and compute where the managed parameters are.
        let compute_device = crate::train::parameters_device(&managed)?;
        let mut by_name: std::collections::HashMap<String, Tensor> = managed.into_iter().collect();
        let mut units = Vec::new();
        let mut unit_of_layer = vec![None; layers.len()];
        for planned in plan {
            let layers_of_unit = planned.layers.clone();
            let Some(unit) = unit_from_plan(planned, &mut by_name, &isolate, &opts, world)? else {
                continue;
            };
            for &l in &layers_of_unit {
                unit_of_layer[l] = Some(units.len());
            }
            units.push(unit);
        }
        let ignored_compute = match &opts.mixed_precision {
            Some(mp) => {
                let low = low_precision_params(model, mp);
                ignored
                    .iter()
                    .map(|(n, _)| low.contains(n).then_some(mp.param_dtype))
                    .collect()
            }
            None => vec![None; ignored.len()],
        };
        // Training's collectives count into one tally the record takes per step; the
        // record's own gathers go over the group uncounted.
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let uncounted = group.clone();
        let mut core = Core::new(
            counted(group),
            replicate.map(counted),
            opts,
            units,
            compute_device,
        );
        core.record_group = uncounted;
        core.ignored_masters = ignored.iter().map(|_| None).collect();
        core.ignored = ignored;
        core.ignored_compute = ignored_compute;
        core.buffers = model.named_buffers();
        core.order = order;
        core.tags = tags;
        core.unit_of_layer = unit_of_layer;
        core.per_layer = model.supports_layer_hooks();
        let mut fsdp = Self::assemble(core, cast)?;
        // The construction's broadcasts and first resharding are set-up, not a step's.
        counts.take();
        fsdp.counts = Some(counts);
        Ok(fsdp)
    }

    /// Shards `tensors` (one dtype, each owning its storage, the same shapes on every rank of
    /// `group` and `replicate`) as one unit named `name` over `group`, hybrid-sharded across
    /// `replicate` when given: the data dimension of a composition, where another parallelism
    /// decided what each rank computes with (TP shards, a pipeline stage, the dense part of
    /// an expert-parallel model), so there is no model to wrap. The tensors are taken as
    /// they are (no broadcast) and freed until [`Fsdp::unshard`]. No hook is registered: the
    /// composition gathers ([`Fsdp::unshard`]), reduces ([`Fsdp::reduce_gradients`], after
    /// its own partial sums or its last microbatch), frees ([`Fsdp::reshard`]) and steps
    /// ([`Fsdp::stepped`]) when its schedule says so, and reads full values through
    /// [`Fsdp::full_values`].
    pub fn over_tensors(
        name: &str,
        tensors: Vec<(String, Tensor)>,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<Fsdp, FsdpError> {
        let opts = FsdpOptions {
            strategy: match replicate {
                Some(_) => ShardingStrategy::HybridShard,
                None => ShardingStrategy::FullShard,
            },
            sync_module_states: false,
            ..FsdpOptions::default()
        };
        let planned = wrap::PlannedUnit {
            name: name.to_owned(),
            layers: Vec::new(),
            params: tensors.iter().map(|(n, _)| n.clone()).collect(),
        };
        let order = planned.params.clone();
        // Checked once the unit is known to hold a tensor (an empty one is refused by name).
        let compute_device = crate::train::parameters_device(&tensors);
        let mut by_name = tensors.into_iter().collect();
        let world = group.size() as i64;
        let Some(unit) = unit_from_plan(planned, &mut by_name, &[], &opts, world)? else {
            return Err(FsdpError::Invalid(format!(
                "unit `{name}` has no tensor to shard"
            )));
        };
        let mut core = Core::new(group, replicate, opts, vec![unit], compute_device?);
        core.order = order;
        core.composed = true;
        Self::assemble(core, None)
    }

    /// Finishes construction: broadcasts rank 0's state if asked, cuts this rank's master
    /// shards, frees the full parameters and (for a model) hooks the post-backward.
    fn assemble(mut core: Core, cast: Option<CastInputs>) -> Result<Fsdp, FsdpError> {
        let world = core.shard_world as i64;
        let master_device = if core.opts.offload_params {
            Device::Cpu
        } else {
            core.compute_device
        };
        {
            let _guard = tch::no_grad_guard();
            if core.opts.sync_module_states {
                let params: Vec<Tensor> = core
                    .units
                    .iter()
                    .flat_map(|u| u.slots.iter().map(|s| s.param.shallow_clone()))
                    .collect();
                core.broadcast_world(params.iter())?;
                core.broadcast_world(core.buffers.iter().map(|(_, b)| b))?;
            }
            for unit in &mut core.units {
                let size = unit.padded / world;
                unit.shard = unit
                    .flatten(|s| Ok(s.param.shallow_clone()))?
                    .f_narrow(0, core.shard_rank as i64 * size, size)?
                    .f_to_device(master_device)?
                    .f_detach_copy()?
                    .set_requires_grad(true);
                unit.alive_bytes = unit.full_bytes(unit.kind);
                core.full_bytes_alive += unit.alive_bytes;
            }
        }
        core.reshard_all()?;
        // Construction held the model's own full parameters; training peaks start here.
        core.full_bytes_peak = core.full_bytes_alive;
        let composed = core.composed;
        let core = Arc::new(Mutex::new(core));
        // A composition reduces when its own step says so, never from autograd's hooks.
        let post_backward = match composed {
            true => Vec::new(),
            false => register_post_backward(&core)?,
        };
        Ok(Fsdp {
            core,
            cast,
            post_backward,
            counts: None,
        })
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// The strategy this wrapper runs.
    pub fn strategy(&self) -> ShardingStrategy {
        self.core().opts.strategy
    }

    /// Every unit's name and the parameters in its flat parameter, in flat order.
    pub fn units(&self) -> Vec<(String, Vec<String>)> {
        self.core()
            .units
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
        self.core()
            .units
            .iter()
            .flat_map(|u| u.slots.iter().map(|s| s.name.clone()))
            .collect()
    }

    /// Names of the ignored (rank-local) parameters, never sharded nor reduced.
    pub fn ignored_param_names(&self) -> Vec<String> {
        self.core().ignored_param_names()
    }

    /// Elements of each unit's flat parameter: (unpadded, padded).
    pub fn flat_numels(&self) -> Vec<(usize, usize)> {
        self.core()
            .units
            .iter()
            .map(|u| (u.numel() as usize, u.padded as usize))
            .collect()
    }

    /// Bytes of each unit's full parameters in their master dtype, in unit order.
    pub fn unit_full_bytes(&self) -> Vec<usize> {
        self.core()
            .units
            .iter()
            .map(|u| u.full_bytes(u.kind))
            .collect()
    }

    /// This rank's master shard of each unit's flat parameter (copies: the optimizer owns
    /// them).
    pub fn local_shards(&self) -> Result<Vec<Tensor>, FsdpError> {
        self.core()
            .units
            .iter()
            .map(|u| Ok(u.shard.f_detach_copy()?))
            .collect()
    }

    /// Whether the model's full parameters currently hold memory and current values.
    pub fn is_unsharded(&self) -> bool {
        self.core()
            .units
            .iter()
            .all(|u| u.residency == Residency::Unsharded)
    }

    /// Bytes of full (unsharded) managed parameters alive on this rank right now: the
    /// model's parameter storages of gathered units and the buffers of gathers in flight,
    /// not the ignored parameters nor the shards.
    pub fn full_param_bytes(&self) -> usize {
        self.core().full_bytes_alive
    }

    /// The most bytes of full managed parameters alive at once on this rank during training
    /// (from construction on; the gather for the run's record is not counted).
    pub fn full_param_bytes_peak(&self) -> usize {
        self.core().full_bytes_peak
    }

    /// This rank's memory figures, for the record.
    pub fn memory_stats(&self) -> MemoryStats {
        let core = self.core();
        MemoryStats {
            full_param_bytes_peak: core.full_bytes_peak as u64,
            shard_bytes: core.shard_bytes() as u64,
            model_param_bytes: core.units.iter().map(|u| u.full_bytes(u.kind) as u64).sum(),
        }
    }

    /// `record` with this rank's memory figures attached.
    fn with_memory(&self, mut record: RunRecord) -> RunRecord {
        record.memory = Some(self.memory_stats());
        record.placements = self.placement_table();
        record
    }

    /// Where every parameter lived, for the record (and so the report): its unit, sharded
    /// over the shard group or whole on every rank (NO_SHARD, a group of one); ignored ones
    /// (rank-local) as such.
    fn placement_table(&self) -> Vec<crate::record::TensorPlacement> {
        let over = self.core().shard_world;
        let mut out = Vec::new();
        for (unit, params) in self.units() {
            let placement = match over {
                1 => format!("replicated (FSDP unit `{unit}`, not sharded)"),
                n => format!("FSDP unit `{unit}`, sharded over {n} ranks"),
            };
            out.extend(
                params
                    .into_iter()
                    .map(|tensor| crate::record::TensorPlacement {
                        tensor,
                        placement: placement.clone(),
                    }),
            );
        }
        out.extend(self.ignored_param_names().into_iter().map(|tensor| {
            crate::record::TensorPlacement {
                tensor,
                placement: "replicated (ignored by FSDP: rank-local)".into(),
            }
        }));
        out
    }

    /// Bytes of this rank's master shards (what stays alive between steps).
    pub fn shard_bytes(&self) -> usize {
        self.core().shard_bytes()
    }

    /// Collectives issued since construction, by purpose.
    pub fn collective_counts(&self) -> FsdpCallCounts {
        self.core().counts
    }

    /// Makes every unit's full parameters current (all-gathers every resharded unit, in unit
    /// order), as the record and checkpoints need them.
    pub fn unshard(&mut self) -> Result<(), FsdpError> {
        self.core().unshard_all(Gather::Params)
    }

    /// Frees the model's full parameters (not for `NoShard`, whose parameters stay). Until
    /// the next [`Fsdp::unshard`] nothing may read them.
    pub fn reshard(&mut self) -> Result<(), FsdpError> {
        self.core().reshard_all()
    }

    /// Reduces every unit's full gradients into this rank's gradient shards (the shards'
    /// `.grad`), finishing what the post-backward hooks launched, then writes the averaged
    /// full gradients back into the model's `.grad`s for the record (over tensors
    /// ([`Fsdp::over_tensors`]) drops them instead: [`Fsdp::full_values`] reads them).
    pub fn reduce_gradients(&mut self) -> Result<(), FsdpError> {
        self.core().finish_gradients()
    }

    /// What the optimizer steps, under the names its state is keyed by: each unit's shard
    /// (`_fsdp_flat_param.<unit>`, or the unit's own name over tensors), then the ignored
    /// parameters. For a composition that runs its own optimizer step.
    pub fn stepped(&self) -> Vec<(String, Tensor)> {
        self.core().stepped_tensors()
    }

    /// Which copy of the content the shards are, for the cross-rank check
    /// ([`crate::consistency`]): the shard index, the same on every replica of it (empty when
    /// every rank holds the whole flat parameter).
    pub fn shard_coordinate(&self) -> String {
        self.core().shard_coordinate()
    }

    /// Every sharded tensor's full `value` (its data, or its `.grad`; undefined reads as
    /// zeros) gathered from the shards: a composition's record view, read on demand without
    /// touching the full parameters (which may be freed) and not counted in
    /// [`FsdpCallCounts`]. Collective over the shard group.
    pub fn full_values(
        &self,
        value: impl Fn(&Tensor) -> Tensor,
    ) -> Result<Vec<(String, Tensor)>, FsdpError> {
        let mut core = self.core();
        let mut out = Vec::new();
        for u in 0..core.units.len() {
            let shard = &core.units[u].shard;
            let v = value(shard);
            let local = match v.defined() {
                true => v.f_detach()?.f_contiguous()?,
                false => shard.f_zeros_like()?,
            };
            let full = match core.shard_world {
                1 => local.f_detach_copy()?,
                _ => core.gather(u, &local, Gather::Checkpoint)?,
            };
            for slot in &core.units[u].slots {
                let part = full.f_narrow(0, slot.offset, slot.numel)?;
                out.push((
                    slot.name.clone(),
                    part.f_view(slot.param.size().as_slice())?,
                ));
            }
        }
        Ok(out)
    }

    /// Steps the shards and the ignored parameters with `optimizer`; for `NoShard` copies the
    /// updated flat parameters straight into the model.
    pub fn step(&mut self, optimizer: &mut dyn Optimizer) -> Result<(), FsdpError> {
        let mut core = self.core();
        let params = core.stepped_tensors();
        optimizer.step(&params)?;
        for unit in &mut core.units {
            set_grad(&unit.shard, None)?;
        }
        if core.opts.strategy == ShardingStrategy::NoShard {
            // Nothing is gathered; the parameters must follow the master copy now.
            for u in 0..core.units.len() {
                core.release(u);
                let kind = core.units[u].compute_kind;
                core.unshard_unit(u, Gather::Params, kind)?;
            }
        }
        Ok(())
    }

    /// Runs `f` with every unit's full parameters gathered in their master dtype (PyTorch's
    /// `summon_full_params`). With `writeback`, changes `f` made to the parameters are copied
    /// back into this rank's shards afterwards. Units that were sharded before are freed
    /// again. Collective: every rank must call it.
    pub fn summon_full_params<R>(
        &mut self,
        writeback: bool,
        f: impl FnOnce() -> R,
    ) -> Result<R, FsdpError> {
        let was_sharded: Vec<bool> = {
            let mut core = self.core();
            let sharded = core
                .units
                .iter()
                .map(|u| u.residency != Residency::Unsharded)
                .collect();
            core.unshard_all(Gather::Checkpoint)?;
            sharded
        };
        let out = f();
        let mut core = self.core();
        if writeback {
            core.write_back()?;
        }
        for (u, sharded) in was_sharded.into_iter().enumerate() {
            if sharded {
                core.reshard_unit(u)?;
            }
        }
        Ok(out)
    }

    /// Saves the full state dict; see `fsdp/state.rs`.
    pub fn full_state_dict(&mut self) -> Result<Vec<(String, Tensor)>, FsdpError> {
        self.core().full_state_dict()
    }

    /// Gathers the full state dict (collective) and writes it on rank 0 to `path`
    /// (safetensors, PyTorch names, the format `Model::save` writes).
    pub fn save_full(&mut self, path: &std::path::Path) -> Result<(), FsdpError> {
        self.core().save_full(path)
    }

    /// Loads a full state dict file into this rank's shards, ignored parameters and buffers.
    /// Collective; on any error nothing changes on any rank.
    pub fn load_full(&mut self, path: &std::path::Path) -> Result<(), FsdpError> {
        self.core().load_full(path)
    }

    /// This rank's layout: units, their shards and which parameter ranges each holds.
    pub fn sharded_layout(&self) -> ShardedLayout {
        self.core().sharded_layout()
    }

    /// This rank's shards (copies), ignored parameters and buffers, with their layout.
    pub fn sharded_state_dict(&self) -> Result<ShardedStateDict, FsdpError> {
        self.core().sharded_state_dict()
    }

    /// Writes this rank's sharded state dict into `dir`. Collective.
    pub fn save_sharded(&self, dir: &std::path::Path) -> Result<(), FsdpError> {
        self.core().save_sharded(dir)
    }

    /// Loads this rank's files from a [`Fsdp::save_sharded`] directory. Collective; on any
    /// error nothing changes on any rank.
    pub fn load_sharded(&mut self, dir: &std::path::Path) -> Result<(), FsdpError> {
        self.core().load_sharded(dir)
    }

    /// Clips gradients to `max_norm` over the global norm (see `fsdp/state.rs`); returns the
    /// total norm before clipping. Collective.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, FsdpError> {
        self.core().clip_grad_norm(max_norm)
    }

    /// Clip to `max_norm` with [`Fsdp::clip_grad_norm`] before every optimizer step the
    /// training hooks run (`None`: no clipping, the default).
    pub fn set_max_grad_norm(&mut self, max_norm: Option<f64>) {
        self.core().max_grad_norm = max_norm;
    }

    /// The total norm the last [`Fsdp::clip_grad_norm`] computed (before clipping).
    pub fn last_total_norm(&self) -> Option<f64> {
        self.core().last_total_norm
    }

    /// Turns gradient synchronization off (`false`) or back on. While off, gradients are
    /// neither reduced nor resharded: each rank's full gradients accumulate in the model's
    /// `.grad`s across backward passes (the caller does not zero them) and the full
    /// parameters stay gathered, so micro-steps after the first issue no collective at all
    /// (PyTorch's `no_sync`, with `SHARD_GRAD_OP`'s memory). The first synchronized step
    /// then reduces the accumulated sums: its gradient is the mean over ranks of each rank's
    /// summed micro-step gradients. The `optimizer_step` hook refuses to run while off.
    pub fn set_requires_gradient_sync(&mut self, sync: bool) {
        self.core().sync_grads = sync;
    }

    /// Whether gradients are synchronized (see [`Fsdp::set_requires_gradient_sync`]).
    pub fn requires_gradient_sync(&self) -> bool {
        self.core().sync_grads
    }

    /// Runs `f` with gradient synchronization off, restoring the previous setting after.
    pub fn no_sync<R>(&mut self, f: impl FnOnce(&mut Fsdp) -> R) -> R {
        let before = self.requires_gradient_sync();
        self.set_requires_gradient_sync(false);
        let out = f(self);
        self.set_requires_gradient_sync(before);
        out
    }
}

/// The unit `planned` describes, its parameters taken out of `by_name` (those another unit
/// took already are skipped): `None` when none is left. Its flat parameter has one dtype and
/// owns its parameters' storages, padded to a multiple of `world`.
fn unit_from_plan(
    planned: wrap::PlannedUnit,
    by_name: &mut std::collections::HashMap<String, Tensor>,
    isolate: &[usize],
    opts: &FsdpOptions,
    world: i64,
) -> Result<Option<Unit>, FsdpError> {
    let mut slots = Vec::with_capacity(planned.params.len());
    let mut offset = 0i64;
    let mut kind = None;
    for pname in planned.params {
        let Some(param) = by_name.remove(&pname) else {
            continue;
        };
        let k = *kind.get_or_insert(param.kind());
        if param.kind() != k {
            return Err(FsdpError::Invalid(format!(
                "parameter `{pname}` is {:?} but unit `{}`'s flat parameter is {k:?}",
                param.kind(),
                planned.name
            )));
        }
        let bytes = param.numel() * k.elt_size_in_bytes();
        // Freeing a storage frees every alias: each parameter must own its storage.
        if !param.is_contiguous() || storage_nbytes(&param)? != bytes {
            return Err(FsdpError::Invalid(format!(
                "parameter `{pname}` does not own its storage (a view or a shared buffer)"
            )));
        }
        let numel = param.numel() as i64;
        slots.push(Slot {
            name: pname,
            param,
            offset,
            numel,
        });
        offset += numel;
    }
    let Some(kind) = kind else { return Ok(None) };
    let full_precision =
        !planned.layers.is_empty() && planned.layers.iter().all(|l| isolate.contains(l));
    let (compute_kind, reduce_kind) = match &opts.mixed_precision {
        Some(mp) if !full_precision => (mp.param_dtype, mp.reduce_dtype),
        _ => (kind, kind),
    };
    Ok(Some(Unit {
        name: planned.name,
        layers: planned.layers,
        slots,
        kind,
        compute_kind,
        reduce_kind,
        padded: (offset + world - 1) / world * world,
        shard: Tensor::new(),
        residency: Residency::Unsharded,
        pending_gather: None,
        alive_bytes: 0,
        ready: 0,
        pending_reduce: None,
        reduced: false,
    }))
}
