//! DistributedDataParallel: every rank holds the whole model, trains on its own batch, and
//! averages gradients so every replica takes the same step.
//!
//! * **Init**: parameters and buffers are broadcast from rank 0, except rank-local parameters
//!   (experts placed on one rank), which stay as each rank made them.
//! * **Buckets**: gradients are packed, in reverse parameter order (the order backward
//!   produces them), into flat buckets of up to `bucket_cap_bytes`; each bucket is one
//!   all-reduce.
//! * **Overlap**: a post-accumulate-grad hook (from [`crate::autograd`]) on every parameter
//!   launches a bucket's asynchronous all-reduce as soon as its last gradient is complete,
//!   while backward continues. Buckets launch strictly in index order on every rank, so the
//!   collectives match across ranks whatever the hook order.
//! * **Average**: `ReduceOp::Avg`, the rank-order sum divided by the world size once; or,
//!   with [`GradReduction::Hierarchical`], hybrid shard's two stages (the average within a
//!   shard group, then the average of those across replicas), so DDP can be the bitwise
//!   reference of hybrid-sharded FSDP.
//! * **Buffers** are broadcast from rank 0 before every forward (PyTorch's default).
//! * **Communication hooks** replace the per-bucket reduction; [`MarkedReduction`] also
//!   reduces parameters marked for other groups (tensor or context parallel) there.
//! * **Mixed precision** ([`DdpOptions::mixed_precision`], PyTorch DDP's semantics): the fp32
//!   parameters stay the optimizer's master copy. Before each forward every low-precision
//!   parameter's data is swapped (`set_data`, same autograd leaf) for a `param_dtype` copy of
//!   its master, and [`CastInputs`] casts each layer's inputs to the layer's compute dtype;
//!   forward and backward run in low precision, so gradients arrive in `param_dtype`. A
//!   bucket holds its gradients in `reduce_dtype` (packing casts them), is all-reduced
//!   (`Avg`) in it, and the reduced gradients are cast to fp32. After backward every parameter
//!   gets its fp32 master data back and an fp32 `.grad`, so the optimizer and the record see
//!   fp32 only. Floating buffers are cast to `buffer_dtype` once, at construction.
//! * **Faults** plant the classic bugs on purpose, so tests prove the parity checker catches
//!   them.

mod buckets;
mod options;

pub use options::{
    CommHook, DdpError, DdpFault, DdpOptions, GradBucket, GradReduction, MarkedReduction,
};

use crate::autograd::{register_post_accumulate_grad_hook, set_grad, AutogradError, HookHandle};
use crate::comm::work::lock;
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp};
use crate::precision::{
    cast_buffers, low_precision_params, CastInputs, MixedPrecision, PrecisionError,
};
use crate::record::{CollectiveEntry, RunRecord};
use crate::replica::{broadcast_named_from_rank0, distinct_parameters};
use crate::train::{train, StepHooks, TrainConfig, TrainError};
use buckets::*;
use lockstep_models::{LayerHooks, Model};
use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex};
use tch::{Kind, Tensor};

/// A parameter that computes in low precision under a mixed-precision policy.
struct LowParam {
    /// Index into `State::params`.
    index: usize,
    /// The parameter itself (a handle on the model's leaf).
    param: Tensor,
    /// Its fp32 data: the master copy the optimizer updates, which the parameter holds
    /// again after every backward.
    master: Tensor,
}

/// DDP's mixed-precision state: the policy, its input casts and the swapped parameters.
struct Precision {
    policy: MixedPrecision,
    cast: CastInputs,
    low: Vec<LowParam>,
    /// `low` index of each entry of `State::params` (`None`: computes in its own dtype).
    low_of: Vec<Option<usize>>,
}

/// DDP over one data-parallel group. Plug it into [`train`] as its [`StepHooks`].
pub struct Ddp {
    state: Arc<Mutex<State>>,
    buffers: Vec<(String, Tensor)>,
    /// What DDP's groups ran since the last step was recorded (a communication hook's own
    /// groups aside).
    counts: CollectiveCounts,
    opts: DdpOptions,
    precision: Option<Precision>,
    _hooks: Vec<HookHandle>,
}

impl Ddp {
    /// Wraps `model` (built identically on every rank): broadcasts its parameters and buffers
    /// from rank 0 and prepares the buckets. Under a mixed-precision policy it first checks
    /// the policy and that the model runs layer hooks (before any collective, so every rank
    /// fails alike), then casts the model's floating buffers to `buffer_dtype`.
    pub fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        mut opts: DdpOptions,
    ) -> Result<Ddp, DdpError> {
        if let (Some(fault), Some(policy)) = (&opts.fault, opts.mixed_precision) {
            opts.mixed_precision = Some(fault.planted_in(policy));
        }
        let tags = model.tags();
        let rank_local: HashSet<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| tags.is_rank_local(n))
            .collect();
        let precision = match &opts.mixed_precision {
            None => None,
            Some(policy) => {
                let cast = CastInputs::for_model(model, policy)?;
                cast_buffers(model, policy)?;
                Some((cast, low_precision_params(model, policy)))
            }
        };
        Self::build(
            model.named_parameters(),
            model.named_buffers(),
            &rank_local,
            group,
            opts,
            precision,
        )
    }

    /// As [`Ddp::new`] for parameters that are not a zoo model (`rank_local` are never
    /// broadcast nor reduced). Mixed precision is refused here: without a layer list nothing
    /// says which dtype each layer's inputs need.
    pub fn from_parts(
        params: Vec<(String, Tensor)>,
        buffers: Vec<(String, Tensor)>,
        rank_local: &HashSet<String>,
        group: Arc<dyn ProcessGroup>,
        opts: DdpOptions,
    ) -> Result<Ddp, DdpError> {
        if let Some(policy) = &opts.mixed_precision {
            policy.validate()?;
            return Err(PrecisionError::NoModel(
                "Ddp::from_parts has parameters only; wrap a model with Ddp::new".into(),
            )
            .into());
        }
        Self::build(params, buffers, rank_local, group, opts, None)
    }

    fn build(
        params: Vec<(String, Tensor)>,
        buffers: Vec<(String, Tensor)>,
        rank_local: &HashSet<String>,
        group: Arc<dyn ProcessGroup>,
        opts: DdpOptions,
        precision: Option<(CastInputs, BTreeSet<String>)>,
    ) -> Result<Ddp, DdpError> {
        let (bucket_group, replicate) = reduction_groups(&opts, &group)?;
        // Every group DDP talks over counts into one tally, which the record takes per step.
        let counts = CollectiveCounts::new();
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let (group, bucket_group) = (counted(group), counted(bucket_group));
        let replicate = replicate.map(counted);
        let fault = opts.fault.clone();
        let excluded = |name: &str| match &fault {
            Some(DdpFault::SkipParameter(p)) if p == name => true,
            Some(DdpFault::ReduceExperts) => false,
            _ => rank_local.contains(name),
        };
        let params = distinct_parameters(params);
        broadcast_initial(&group, &params, &buffers, rank_local, &fault)?;
        let precision = precision_state(&params, precision, opts.mixed_precision);
        // Low-precision gradients are reduced in `reduce_dtype`; the others (BatchNorm kept
        // in fp32) in their own dtype, as FSDP leaves those modules out of its policy.
        let reduce_kind = |i: usize| match &precision {
            Some(mp) if mp.low_of[i].is_some() => mp.policy.reduce_dtype,
            _ => params[i].1.kind(),
        };
        let buckets = plan_buckets(&params, &excluded, &reduce_kind, opts.bucket_cap_bytes)?;
        let mut bucket_of = vec![None; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in &bucket.members {
                bucket_of[i] = Some(b);
            }
        }
        let op = if fault == Some(DdpFault::SumInsteadOfAverage) {
            ReduceOp::Sum
        } else {
            ReduceOp::Avg
        };
        let state = Arc::new(Mutex::new(State {
            params,
            bucket_of,
            buckets,
            next_launch: 0,
            op,
            group,
            bucket_group,
            replicate,
        }));
        let hooks = match opts.overlap && opts.comm_hook.is_none() {
            true => launch_hooks(&state)?,
            false => Vec::new(),
        };
        // The construction's broadcasts are set-up, not a step's traffic.
        counts.take();
        Ok(Ddp {
            state,
            buffers,
            counts,
            opts,
            precision,
            _hooks: hooks,
        })
    }

    /// Number of buckets, and the parameter names in each (for tests and diagnostics).
    pub fn buckets(&self) -> Vec<Vec<String>> {
        lock(&self.state)
            .buckets
            .iter()
            .map(|b| b.entries.iter().map(|e| e.0.clone()).collect())
            .collect()
    }

    /// The dtype each bucket is reduced in, in bucket order: `reduce_dtype` for buckets of
    /// low-precision parameters under a policy, the parameters' dtype otherwise.
    pub fn bucket_dtypes(&self) -> Vec<Kind> {
        lock(&self.state)
            .buckets
            .iter()
            .map(|b| b.flat.kind())
            .collect()
    }

    /// How many buckets' all-reduces are already in flight: right after backward with
    /// `overlap`, all of them (they launched from the backward hooks).
    pub fn launched_buckets(&self) -> usize {
        lock(&self.state).next_launch
    }

    /// The mixed-precision policy this DDP trains under, if any.
    pub fn mixed_precision(&self) -> Option<&MixedPrecision> {
        self.precision.as_ref().map(|p| &p.policy)
    }

    /// The input casts run around every layer under a policy (what
    /// [`StepHooks::layer_hooks`] returns), so an observer can be chained behind them.
    pub fn cast_inputs(&self) -> Option<&CastInputs> {
        self.precision.as_ref().map(|p| &p.cast)
    }

    /// The parameters computing in `param_dtype` under the policy (none without one).
    pub fn low_precision_params(&self) -> Vec<String> {
        let state = lock(&self.state);
        self.precision.as_ref().map_or_else(Vec::new, |mp| {
            mp.low
                .iter()
                .map(|lp| state.params[lp.index].0.clone())
                .collect()
        })
    }

    /// Before forward under a policy: clears every low-precision parameter's `.grad` (so
    /// backward produces it in `param_dtype`) and swaps the parameter's data for a
    /// `param_dtype` copy of its fp32 master. Without a policy it does nothing.
    pub fn swap_in_low_precision(&self) -> Result<(), DdpError> {
        let Some(mp) = &self.precision else {
            return Ok(());
        };
        let _guard = tch::no_grad_guard();
        for lp in &mp.low {
            set_grad(&lp.param, None)?;
            let low = lp.master.f_to_kind(mp.policy.param_dtype)?;
            if self.opts.fault == Some(DdpFault::HalfPrecisionMaster) {
                lp.master.shallow_clone().f_copy_(&low)?;
            }
            lp.param.shallow_clone().f_set_data(&low)?;
        }
        Ok(())
    }

    /// Finishes gradient averaging after backward: launches what the hooks did not, waits,
    /// and writes the averaged values back into every parameter's `.grad`. Under a policy it
    /// also gives every low-precision parameter its fp32 master data back, with the reduced
    /// gradient cast to fp32 as its `.grad`.
    pub fn finish_gradients(&mut self) -> Result<(), DdpError> {
        let mut state = lock(&self.state);
        let (rank, size) = (state.group.rank(), state.group.size());
        if self.opts.fault == Some(DdpFault::StallLastRank) && size > 1 && rank == size - 1 {
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        if let Some(hook) = self.opts.comm_hook.clone() {
            for b in 0..state.buckets.len() {
                state.pack(b)?;
                let bucket = &state.buckets[b];
                let view = GradBucket {
                    index: b,
                    buffer: &bucket.flat,
                    entries: &bucket.entries,
                };
                hook.reduce(&view, state.group.as_ref())?;
            }
        } else {
            for bucket in &mut state.buckets {
                bucket.ready = bucket.members.len();
            }
            state.launch_ready()?;
            for bucket in &mut state.buckets {
                if let Some(work) = bucket.work.take() {
                    work.wait()?;
                }
            }
            // Hierarchical: the shard groups' averages, averaged across replicas, in bucket
            // order on every rank.
            if let Some(replicate) = &state.replicate {
                for bucket in &state.buckets {
                    replicate.all_reduce(&bucket.flat, state.op)?;
                }
            }
        }
        let _guard = tch::no_grad_guard();
        let State {
            params, buckets, ..
        } = &mut *state;
        // Reduced gradients of low-precision parameters, already in the master's dtype,
        // indexed like `Precision::low`.
        let mut reduced_low: Vec<Option<Tensor>> = self
            .precision
            .as_ref()
            .map_or_else(Vec::new, |mp| mp.low.iter().map(|_| None).collect());
        for bucket in buckets.iter_mut() {
            for (&i, (_, offset, numel)) in bucket.members.iter().zip(&bucket.entries) {
                let reduced = bucket.flat.narrow(0, *offset as i64, *numel as i64);
                let low = self
                    .precision
                    .as_ref()
                    .and_then(|mp| mp.low_of[i].map(|l| (l, &mp.low[l])));
                match low {
                    Some((l, lp)) => {
                        // A fresh tensor of its own (not a view: `flat` is overwritten at the
                        // next step, and the next `zero_grad` detaches `.grad` in place).
                        let fp32 = reduced.f_view_as(&lp.master)?.f_to_dtype(
                            lp.master.kind(),
                            false,
                            true,
                        )?;
                        reduced_low[l] = Some(fp32);
                    }
                    None => {
                        let mut grad = params[i].1.grad();
                        grad.f_copy_(&reduced.f_view_as(&grad)?)?;
                    }
                }
            }
            bucket.ready = 0;
        }
        state.next_launch = 0;
        drop(state);
        if let Some(mp) = &self.precision {
            for (lp, reduced) in mp.low.iter().zip(reduced_low) {
                // Parameters in no bucket (rank-local) keep their own gradient, in fp32.
                let grad = match reduced {
                    Some(g) => Some(g),
                    None => {
                        let g = lp.param.grad();
                        if g.defined() {
                            Some(g.f_to_kind(lp.master.kind())?)
                        } else {
                            None
                        }
                    }
                };
                lp.param.shallow_clone().f_set_data(&lp.master)?;
                if let Some(g) = grad {
                    set_grad(&lp.param, Some(&g))?;
                }
            }
        }
        Ok(())
    }

    /// Copies rank 0's buffers to every rank.
    pub fn broadcast_buffers(&self) -> Result<(), DdpError> {
        let state = lock(&self.state);
        broadcast_named_from_rank0(
            state.group.as_ref(),
            self.buffers.iter().map(|(n, b)| (n.as_str(), b)),
        )?;
        Ok(())
    }
}

impl Drop for Ddp {
    /// Leaves the model with its fp32 parameters even when a step failed between the swap
    /// to low precision and the end of backward.
    fn drop(&mut self) {
        if let Some(mp) = &self.precision {
            for lp in &mp.low {
                if lp.param.kind() != lp.master.kind() {
                    let _ = set_grad(&lp.param, None);
                    let _ = lp.param.shallow_clone().f_set_data(&lp.master);
                }
            }
        }
    }
}

impl StepHooks for Ddp {
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        let broadcast =
            self.opts.broadcast_buffers && self.opts.fault != Some(DdpFault::NoBufferBroadcast);
        if broadcast {
            self.broadcast_buffers().map_err(into_train)?;
        }
        self.swap_in_low_precision().map_err(into_train)
    }

    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        self.precision
            .as_mut()
            .map(|mp| &mut mp.cast as &mut dyn LayerHooks)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.finish_gradients().map_err(into_train)
    }

    fn step_collectives(&mut self) -> Option<Vec<CollectiveEntry>> {
        Some(CollectiveEntry::from_counts(self.counts.take()))
    }
}

fn into_train(e: DdpError) -> TrainError {
    match e {
        DdpError::Comm(c) => TrainError::Comm(c),
        DdpError::Train(t) => t,
        DdpError::Torch(t) => TrainError::Torch(t),
        other => TrainError::InvalidConfig(other.to_string()),
    }
}

/// The group each bucket is first all-reduced over, and the replica group of a
/// hierarchical reduction.
type ReductionGroups = (Arc<dyn ProcessGroup>, Option<Arc<dyn ProcessGroup>>);

/// The group each bucket is first all-reduced over, and the replica group of a hierarchical
/// reduction; refuses groups that do not tile `group` (checked before any collective, so
/// every rank fails alike).
fn reduction_groups(
    opts: &DdpOptions,
    group: &Arc<dyn ProcessGroup>,
) -> Result<ReductionGroups, DdpError> {
    match &opts.reduction {
        GradReduction::Flat => Ok((group.clone(), None)),
        GradReduction::Hierarchical { .. } if opts.comm_hook.is_some() => Err(DdpError::Invalid(
            "a communication hook replaces the reduction; set either comm_hook or a \
             hierarchical reduction, not both"
                .into(),
        )),
        GradReduction::Hierarchical { shard, replicate } => {
            if shard.size() * replicate.size() != group.size() {
                return Err(DdpError::Invalid(format!(
                    "a hierarchical reduction over shard groups of {} and {} replicas covers {} \
                     ranks, but DDP's group has {}",
                    shard.size(),
                    replicate.size(),
                    shard.size() * replicate.size(),
                    group.size()
                )));
            }
            Ok((shard.clone(), Some(replicate.clone())))
        }
    }
}

/// Trains `model` (built identically on every rank) with DDP over `group` and returns this
/// rank's record (losses averaged over the group; parameters as this rank holds them).
pub fn train_ddp(
    model: &dyn Model,
    group: Arc<dyn ProcessGroup>,
    cfg: &TrainConfig,
    opts: DdpOptions,
) -> Result<RunRecord, DdpError> {
    let mut ddp = Ddp::new(model, group.clone(), opts)?;
    Ok(train(model, cfg, &mut ddp, Some(group.as_ref()))?)
}

/// [`train_ddp`] with hybrid shard's reduction ([`GradReduction::Hierarchical`]) on `mesh`, a
/// `[replicate, shard]` mesh such as [`hybrid_mesh`](crate::fsdp::hybrid_mesh) builds:
/// parameters and buffers broadcast and losses averaged over `world_group`, gradients
/// averaged within the shard group, then across replicas. Hybrid shard on the same mesh must
/// equal it bit for bit on the CPU backend.
pub fn train_ddp_hierarchical(
    model: &dyn Model,
    mesh: &DeviceMesh,
    world_group: Arc<dyn ProcessGroup>,
    cfg: &TrainConfig,
    opts: DdpOptions,
) -> Result<RunRecord, DdpError> {
    let opts = DdpOptions {
        reduction: GradReduction::hierarchical(mesh)?,
        ..opts
    };
    train_ddp(model, world_group, cfg, opts)
}

/// Rank 0's parameters (rank-local ones aside) and buffers on every rank, so replicas start
/// equal (a planted fault may skip the buffers).
fn broadcast_initial(
    group: &Arc<dyn ProcessGroup>,
    params: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
    rank_local: &HashSet<String>,
    fault: &Option<DdpFault>,
) -> Result<(), DdpError> {
    broadcast_named_from_rank0(
        group.as_ref(),
        params
            .iter()
            .filter(|(name, _)| !rank_local.contains(name))
            .map(|(n, p)| (n.as_str(), p)),
    )?;
    if *fault != Some(DdpFault::NoBufferBroadcast) {
        broadcast_named_from_rank0(group.as_ref(), buffers.iter().map(|(n, b)| (n.as_str(), b)))?;
    }
    Ok(())
}

/// Mixed precision's bookkeeping: which parameters compute in low precision (their fp32
/// masters kept apart), when both a cast and a policy were given.
fn precision_state(
    params: &[(String, Tensor)],
    precision: Option<(CastInputs, BTreeSet<String>)>,
    policy: Option<MixedPrecision>,
) -> Option<Precision> {
    match (precision, policy) {
        (Some((cast, names)), Some(policy)) => {
            let mut low = Vec::new();
            let mut low_of = vec![None; params.len()];
            for (index, (name, param)) in params.iter().enumerate() {
                if names.contains(name) {
                    low_of[index] = Some(low.len());
                    low.push(LowParam {
                        index,
                        param: param.shallow_clone(),
                        master: param.data(),
                    });
                }
            }
            Some(Precision {
                policy,
                cast,
                low,
                low_of,
            })
        }
        _ => None,
    }
}

/// Post-accumulate-grad hooks that launch a bucket's reduction as soon as its last gradient
/// is ready (overlapping communication with the rest of backward).
fn launch_hooks(state: &Arc<Mutex<State>>) -> Result<Vec<HookHandle>, DdpError> {
    let params: Vec<Tensor> = lock(state)
        .params
        .iter()
        .map(|(_, t)| t.shallow_clone())
        .collect();
    let mut hooks = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let state = state.clone();
        hooks.push(register_post_accumulate_grad_hook(p, move |_| {
            lock(&state)
                .param_ready(i)
                .map_err(|e| AutogradError::msg(format!("ddp bucket launch: {e}")))
        })?);
    }
    Ok(hooks)
}
