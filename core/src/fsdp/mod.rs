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
//! * **Optimizer step**: through [`StepHooks::optimizer_step`], the run's optimizer steps the
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
//! `before_record`) ran. [`train`] keeps that order. Dropping an [`Fsdp`] while resharded
//! refills the parameters with NaN so they stay safe to touch, and visibly invalid.

use crate::autograd::{
    is_storage_freed, refill_storage, register_hook, register_post_accumulate_grad_hook, set_grad,
    storage_nbytes, AutogradError, HookHandle,
};
use crate::comm::work::lock;
use crate::comm::{CollectiveCounts, CommError, CountingGroup, DeviceMesh, ProcessGroup};
use crate::consistency::{StateKind, StateProbe};
use crate::precision::{
    cast_buffers, low_precision_params, CastInputs, MixedPrecision, PrecisionError,
};
use crate::record::{CollectiveEntry, MemoryStats, RunRecord};
use crate::replica::distinct_parameters;
use crate::train::observe_stepped;
use crate::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep_models::{LayerHooks, Misshaped, Model, ModelError};
use std::sync::{Arc, Mutex, MutexGuard};
use tch::{Device, Tensor};

mod core;
mod state;
mod unit;
mod wrap;

use self::core::{Core, Gather};
use unit::{Residency, Slot, Unit};

pub use state::{ShardedLayout, ShardedParamMeta, ShardedStateDict, ShardedUnitMeta};
pub use wrap::WrapPolicy;

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
    /// The mixed-precision policy is invalid or the model cannot run under it.
    #[error(transparent)]
    Precision(#[from] PrecisionError),
    /// The model cannot be wrapped as asked (mixed dtypes, parameters sharing storage...).
    #[error("fsdp: {0}")]
    Invalid(String),
    /// An explicit wrap names a layer the model does not have.
    #[error("fsdp: no layer `{layer}` to wrap; the model's layers: {}", known.join(", "))]
    UnknownLayer {
        /// The layer the wrap names.
        layer: String,
        /// The model's layer names, for the message.
        known: Vec<String>,
    },
    /// An explicit wrap puts one layer into two units.
    #[error("fsdp: layer `{layer}` wrapped twice: in unit `{first}` and in unit `{second}`")]
    WrappedTwice {
        /// The layer named twice.
        layer: String,
        /// The first unit that wraps it.
        first: String,
        /// The second unit that wraps it.
        second: String,
    },
    /// A parameter is used by modules of two different units (one flat parameter cannot live
    /// in two units): wrap both modules in one unit, or leave one unwrapped.
    #[error(
        "fsdp: parameter `{param}` is shared by `{first}` and `{second}`, which are wrapped in \
         different units; wrap them in one unit"
    )]
    SharedAcrossUnits {
        /// The shared parameter's name.
        param: String,
        /// One module using it.
        first: String,
        /// Another module using it, in a different unit.
        second: String,
    },
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
        /// The checkpoint file or directory.
        path: String,
        /// The wrapper's keys the checkpoint lacks.
        missing: Vec<String>,
        /// Keys present in both but with another shape or dtype.
        misshaped: Vec<Misshaped>,
        /// The checkpoint's keys the wrapper does not have.
        unexpected: Vec<String>,
    },
    /// A sharded checkpoint was written for another sharding layout (world size, strategy,
    /// wrap policy or model). Nothing was loaded.
    #[error("fsdp: {path}: sharded checkpoint layout differs: {reason}")]
    ShardLayout {
        /// The checkpoint directory.
        path: String,
        /// Which part of the layout differs.
        reason: String,
    },
    /// Reading or writing a checkpoint file failed.
    #[error("fsdp: {path}: {reason}")]
    Checkpoint {
        /// The file that failed.
        path: String,
        /// The underlying error, in words.
        reason: String,
    },
    /// Another rank failed the same collective checkpoint operation (its own error is
    /// reported there); this rank changed nothing.
    #[error("fsdp: {0} failed on another rank")]
    PeerFailed(String),
}

/// How parameters, gradients and optimizer state are split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShardingStrategy {
    /// Parameters, gradients and optimizer state sharded; full parameters gathered for
    /// forward and again for backward (ZeRO-3).
    FullShard,
    /// As `FullShard`, but a unit's full parameters stay alive from its forward to its
    /// backward (ZeRO-2-like): one all-gather per unit and step.
    ShardGradOp,
    /// Nothing sharded: every rank keeps the full flat parameter and optimizer state, and
    /// gradients are all-reduced (DDP's math through FSDP's code path).
    NoShard,
    /// `FullShard` within each group of the mesh's `shard` dimension, replicated across its
    /// `replicate` dimension (gradients reduce-scattered, then all-reduced across replicas).
    /// Needs [`Fsdp::new_hybrid`].
    HybridShard,
}

/// When backward gathers the next unit it needs, before that unit's own pre-backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardPrefetch {
    /// No prefetch: each unit is gathered when its backward starts.
    None,
    /// In a unit's pre-backward, after gathering it (PyTorch's `BACKWARD_PRE`, the default):
    /// the next unit's gather overlaps this unit's backward compute.
    Pre,
    /// In a unit's post-backward, after launching its reduce-scatter (`BACKWARD_POST`).
    Post,
}

/// A bug planted on purpose, to prove the parity checker catches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FsdpFault {
    /// Gradients summed across ranks instead of averaged (a divisor bug).
    SumInsteadOfAverage,
    /// A resharded unit's storage is refilled with zeros instead of re-gathered before its
    /// backward (what reading a freed, reused buffer looks like).
    NoRegatherBeforeBackward,
    /// Every rank keeps its neighbour's chunk of the reduced gradient.
    ReduceScatterWrongShard,
    /// Ignored (rank-local expert) parameters are averaged across ranks anyway.
    ReduceIgnored,
}

/// How FSDP runs.
#[derive(Clone, Debug)]
pub struct FsdpOptions {
    /// What is sharded.
    pub strategy: ShardingStrategy,
    /// Free a unit's full parameters after its forward and re-gather them for its backward
    /// (`FullShard` and `HybridShard` only; the root unit always keeps them, as PyTorch's
    /// root does, since backward starts with it).
    pub reshard_after_forward: bool,
    /// Broadcast rank 0's (non-ignored) parameters and buffers at construction, so ranks that
    /// built the model differently start equal (PyTorch's `sync_module_states`).
    pub sync_module_states: bool,
    /// Which modules become units.
    pub wrap: WrapPolicy,
    /// When backward prefetches the next unit's gather.
    pub backward_prefetch: BackwardPrefetch,
    /// Gather the next unit (asynchronously) when a unit's forward starts.
    pub forward_prefetch: bool,
    /// Keep the master shards (and their gradients and optimizer state) on the CPU; the
    /// gathers copy the shard to the compute device first.
    pub offload_params: bool,
    /// Compute in low precision (PyTorch's `MixedPrecision`): units are gathered in
    /// `param_dtype`, gradients reduced in `reduce_dtype`, float buffers kept in
    /// `buffer_dtype`; the shards (and the optimizer) stay in fp32. BatchNorm layers get fp32
    /// units of their own when `keep_batchnorm_fp32`. Needs a model with layer hooks (each
    /// layer's inputs are cast to the dtype it computes in).
    pub mixed_precision: Option<MixedPrecision>,
    /// A planted bug, for checker tests only.
    pub fault: Option<FsdpFault>,
}

impl Default for FsdpOptions {
    fn default() -> Self {
        FsdpOptions {
            strategy: ShardingStrategy::FullShard,
            reshard_after_forward: true,
            sync_module_states: true,
            wrap: WrapPolicy::Root,
            backward_prefetch: BackwardPrefetch::Pre,
            forward_prefetch: false,
            offload_params: false,
            mixed_precision: None,
            fault: None,
        }
    }
}

/// Collectives FSDP issued since construction (the initial broadcasts and checkpoint
/// collectives aside), by purpose; [`crate::comm::CollectiveCounts`] is the per-group tally
/// any wrapped group keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FsdpCallCounts {
    /// All-gathers of a flat parameter (forward, re-gather for backward, record).
    pub param_all_gathers: usize,
    /// Reduce-scatters of a flat gradient (sharded strategies).
    pub grad_reduce_scatters: usize,
    /// All-reduces of a flat gradient (`NoShard`).
    pub grad_all_reduces: usize,
    /// All-reduces of a reduced gradient shard across replicas (`HybridShard`).
    pub replica_grad_all_reduces: usize,
    /// All-gathers of reduced gradient shards for the record view only.
    pub record_grad_all_gathers: usize,
}

/// FSDP over one data-parallel group (or a hybrid mesh). Plug it into [`train`] as its
/// [`StepHooks`] (it is also the [`LayerHooks`] `train` runs forward through), or use
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

    /// A composition's optimizer step on the shards, which are then freed until the next
    /// step's gather: the data dimension's part of every composed strategy's step.
    pub(crate) fn step_shards(&mut self, optimizer: &mut dyn Optimizer) -> Result<(), TrainError> {
        optimizer.step(&self.stepped())?;
        self.reshard().map_err(TrainError::strategy)
    }

    /// A composition's shards (and their optimizer state) for the cross-rank check, each
    /// under `prefix` (the model-splitting dimension's coordinate, e.g. `tp0/2.`) and this
    /// shard's coordinate: the data dimension's part of every composed strategy's check.
    pub(crate) fn observe_shards(
        &self,
        probe: &StateProbe,
        step: usize,
        optimizer: &dyn Optimizer,
        prefix: &str,
    ) -> Result<(), TrainError> {
        let coord = |_: &str| format!("{prefix}{}", self.shard_coordinate());
        Ok(observe_stepped(
            probe,
            step,
            &self.stepped(),
            optimizer,
            &coord,
        )?)
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

impl Core {
    /// Names of the ignored (rank-local) parameters.
    pub(super) fn ignored_param_names(&self) -> Vec<String> {
        self.ignored.iter().map(|(n, _)| n.clone()).collect()
    }

    /// What the optimizer steps: each unit's shard (under the flat parameter's name), then
    /// the ignored parameters.
    fn stepped_tensors(&self) -> Vec<(String, Tensor)> {
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
    fn state_coordinate(&self, name: &str, probe: &StateProbe) -> String {
        if self.ignored.iter().any(|(n, _)| n == name) {
            probe.rank_local()
        } else {
            self.shard_coordinate()
        }
    }

    /// Which shard of every flat parameter this rank holds (see [`Fsdp::shard_coordinate`]).
    fn shard_coordinate(&self) -> String {
        match self.shard_world {
            1 => String::new(),
            w => format!("shard{}/{w}", self.shard_rank),
        }
    }

    /// The name unit `u`'s shard is stepped (and its optimizer state keyed) under.
    fn flat_name(&self, u: usize) -> String {
        match self.composed {
            true => self.units[u].name.clone(),
            false => format!("{FLAT_PARAM_NAME}.{u}"),
        }
    }

    pub(super) fn unshard_all(&mut self, purpose: Gather) -> Result<(), FsdpError> {
        for u in 0..self.units.len() {
            let kind = self.units[u].kind;
            self.unshard_unit(u, purpose, kind)?;
        }
        Ok(())
    }

    /// Gathers every unit in its compute dtype (before a forward that does not call the
    /// layer hooks, or the root before one that does). Under mixed precision, the fp32
    /// gradients the last record view left in `.grad` are dropped first, so backward
    /// produces fresh low-precision ones (accumulated ones from `no_sync` are kept).
    fn unshard_for_forward(&mut self) -> Result<(), FsdpError> {
        self.swap_in_ignored()?;
        for unit in &self.units {
            if unit.compute_kind == unit.kind {
                continue;
            }
            for slot in &unit.slots {
                let g = slot.param.grad();
                if g.defined() && g.kind() != unit.compute_kind {
                    set_grad(&slot.param, None)?;
                }
            }
        }
        for u in 0..self.units.len() {
            if self.per_layer && !self.units[u].is_root() {
                continue;
            }
            let kind = self.units[u].compute_kind;
            self.unshard_unit(u, Gather::Params, kind)?;
        }
        Ok(())
    }

    /// Copies this rank's slice of the full parameters back into its shards.
    fn write_back(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let world = self.shard_world as i64;
        let rank = self.shard_rank as i64;
        for unit in &self.units {
            let flat = unit.flatten(|s| Ok(s.param.f_detach()?.f_to_kind(unit.kind)?))?;
            let size = unit.padded / world;
            unit.shard
                .f_detach()?
                .f_copy_(&flat.f_narrow(0, rank * size, size)?)?;
        }
        Ok(())
    }

    /// The unit forward needs after unit `u` (`+1`) or backward needs after it (`-1`): the
    /// neighbour in forward order, the root excluded.
    fn neighbour(&self, u: usize, forward: bool) -> Option<usize> {
        let v = if forward {
            u.checked_add(1)?
        } else {
            u.checked_sub(1)?
        };
        (v < self.units.len() && !self.units[v].is_root()).then_some(v)
    }

    /// A unit's layer is about to run.
    fn pre_forward(&mut self, layer: usize) -> Result<(), FsdpError> {
        let Some(u) = self.unit_of_layer.get(layer).copied().flatten() else {
            return Ok(());
        };
        let kind = self.units[u].compute_kind;
        self.unshard_unit(u, Gather::Params, kind)?;
        if self.opts.forward_prefetch {
            if let Some(next) = self.neighbour(u, true) {
                self.prefetch(next)?;
            }
        }
        Ok(())
    }

    /// Whether unit `u` is freed between its forward and its backward.
    fn reshards_after_forward(&self, u: usize) -> bool {
        matches!(
            self.opts.strategy,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        ) && self.opts.reshard_after_forward
            && self.sync_grads
            && !self.units[u].is_root()
    }

    /// A unit's layer ran; frees the unit after its last layer. Returns the unit whose
    /// pre-backward must run before this output's backward.
    fn post_forward(&mut self, layer: usize) -> Result<Option<usize>, FsdpError> {
        let Some(u) = self.unit_of_layer.get(layer).copied().flatten() else {
            return Ok(None);
        };
        if self.units[u].layers.last() == Some(&layer) && self.reshards_after_forward(u) {
            self.reshard_unit(u)?;
        }
        Ok(Some(u))
    }

    /// Unit `u`'s backward is about to run: its parameters must hold the gathered values.
    fn pre_backward(&mut self, u: usize) -> Result<(), FsdpError> {
        let kind = self.units[u].compute_kind;
        if self.opts.fault == Some(FsdpFault::NoRegatherBeforeBackward)
            && self.units[u].residency == Residency::Sharded
        {
            let _guard = tch::no_grad_guard();
            for slot in &self.units[u].slots {
                if is_storage_freed(&slot.param)? {
                    let zeros = Tensor::f_zeros(slot.param.size(), (kind, self.compute_device))?;
                    refill_storage(&slot.param, Some(&zeros))?;
                }
            }
            self.units[u].residency = Residency::Unsharded;
            return Ok(());
        }
        self.unshard_unit(u, Gather::Params, kind)?;
        if self.opts.backward_prefetch == BackwardPrefetch::Pre {
            if let Some(next) = self.neighbour(u, false) {
                self.prefetch(next)?;
            }
        }
        Ok(())
    }

    /// One of unit `u`'s parameters has its complete gradient; after the last one, the unit's
    /// reduction is launched and its parameters freed.
    fn param_grad_ready(&mut self, u: usize) -> Result<(), FsdpError> {
        let unit = &mut self.units[u];
        unit.ready += 1;
        if unit.ready < unit.slots.len() {
            return Ok(());
        }
        unit.ready = 0;
        if !self.sync_grads {
            return Ok(());
        }
        self.launch_reduce(u)?;
        if self.opts.backward_prefetch == BackwardPrefetch::Post {
            if let Some(next) = self.neighbour(u, false) {
                self.prefetch(next)?;
            }
        }
        self.reshard_unit(u)
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

/// Registers the post-backward hook on every managed parameter.
fn register_post_backward(core: &Arc<Mutex<Core>>) -> Result<Vec<HookHandle>, FsdpError> {
    let params: Vec<(usize, Tensor)> = lock(core)
        .units
        .iter()
        .enumerate()
        .flat_map(|(u, unit)| unit.slots.iter().map(move |s| (u, s.param.shallow_clone())))
        .collect();
    let mut handles = Vec::with_capacity(params.len());
    for (u, p) in params {
        let core = core.clone();
        handles.push(register_post_accumulate_grad_hook(&p, move |_| {
            let mut core = lock(&core);
            core.param_grad_ready(u).map_err(|e| {
                AutogradError::msg(format!(
                    "fsdp post-backward of unit `{}`: {e}",
                    core.units[u].name
                ))
            })
        })?);
    }
    Ok(handles)
}

fn hook_error(e: FsdpError) -> ModelError {
    ModelError::Hook(Box::new(e))
}

impl LayerHooks for Fsdp {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.core().pre_forward(index).map_err(hook_error)?;
        match &mut self.cast {
            Some(cast) => cast.pre_forward(index, inputs),
            None => Ok(inputs),
        }
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        let unit = self.core().post_forward(index).map_err(hook_error)?;
        if let Some(u) = unit {
            if output.requires_grad() {
                let core = self.core.clone();
                // The handle is dropped: the hook lives as long as this output's graph.
                register_hook(&output, move |_| {
                    let mut core = lock(&core);
                    core.pre_backward(u).map_err(|e| {
                        AutogradError::msg(format!(
                            "fsdp pre-backward of unit `{}`: {e}",
                            core.units[u].name
                        ))
                    })?;
                    Ok(None)
                })
                .map_err(|e| hook_error(e.into()))?;
            }
        }
        Ok(output)
    }
}

impl Drop for Fsdp {
    fn drop(&mut self) {
        for handle in self.post_backward.drain(..) {
            let _ = handle.remove();
        }
        let mut core = lock(&self.core);
        let _ = core.swap_out_ignored();
        for unit in &mut core.units {
            if let Some(p) = unit.pending_gather.take() {
                let _ = p.work.wait();
            }
            if let Some(p) = unit.pending_reduce.take() {
                let _ = p.work.wait();
            }
            if unit.residency == Residency::Unsharded {
                continue;
            }
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

/// [`train_fsdp`] with [`ShardingStrategy::HybridShard`] on a [`hybrid_mesh`] of
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
