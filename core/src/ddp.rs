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
//! * **Average**: `ReduceOp::Avg`, the rank-order sum divided by the world size once.
//! * **Buffers** are broadcast from rank 0 before every forward (PyTorch's default).
//! * **Communication hooks** replace the per-bucket reduction; [`MarkedReduction`] also
//!   reduces parameters marked for other groups (tensor or context parallel) there.
//! * **Faults** plant the classic bugs on purpose, so tests prove the parity checker catches
//!   them.

use crate::autograd::{register_post_accumulate_grad_hook, AutogradError, HookHandle};
use crate::comm::work::lock;
use crate::comm::{CommError, ProcessGroup, ReduceOp, Work};
use crate::record::RunRecord;
use crate::replica::{broadcast_from_rank0, distinct_parameters};
use crate::train::{train, StepHooks, TrainConfig, TrainError};
use lockstep_models::Model;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// What DDP can fail with.
#[derive(Debug, thiserror::Error)]
pub enum DdpError {
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error("ddp: {0}")]
    Invalid(String),
}

/// A bug planted on purpose, to prove the parity checker catches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Gradients summed across ranks instead of averaged (a divisor bug).
    SumInsteadOfAverage,
    /// This parameter's gradient is never reduced.
    SkipParameter(String),
    /// Buffers are never broadcast (neither at init nor before forward).
    NoBufferBroadcast,
    /// Rank-local (expert) parameters are averaged like the others.
    ReduceExperts,
}

/// How DDP runs.
#[derive(Clone)]
pub struct DdpOptions {
    /// Largest bucket in bytes (PyTorch's default: 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Broadcast rank 0's buffers before every forward.
    pub broadcast_buffers: bool,
    /// Launch bucket all-reduces from backward hooks instead of after backward.
    pub overlap: bool,
    /// Replaces the per-bucket all-reduce (runs after backward, in bucket order).
    pub comm_hook: Option<Arc<dyn CommHook>>,
    /// A planted bug, for checker tests only.
    pub fault: Option<Fault>,
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: 25 << 20,
            broadcast_buffers: true,
            overlap: true,
            comm_hook: None,
            fault: None,
        }
    }
}

impl std::fmt::Debug for DdpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpOptions")
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("overlap", &self.overlap)
            .field("comm_hook", &self.comm_hook.is_some())
            .field("fault", &self.fault)
            .finish()
    }
}

/// One bucket as a communication hook sees it: the flat gradient buffer and where each
/// parameter's gradient lies in it.
pub struct GradBucket<'a> {
    pub index: usize,
    /// The flat gradients; the hook reduces it in place.
    pub buffer: &'a Tensor,
    /// (parameter name, offset, element count) of every gradient in `buffer`.
    pub entries: &'a [(String, usize, usize)],
}

/// Replaces DDP's reduction of one bucket. Called on every rank, in bucket order.
pub trait CommHook: Send + Sync {
    /// Reduces `bucket.buffer` in place over `dp` (and anything else the hook needs).
    fn reduce(&self, bucket: &GradBucket<'_>, dp: &dyn ProcessGroup) -> Result<(), CommError>;
}

/// The hook of a model split over more groups than data parallel: average every gradient
/// over the data-parallel group, then sum the gradients of parameters marked for another
/// group (tensor or context parallel) over that group as well.
pub struct MarkedReduction {
    marks: Vec<(Arc<dyn ProcessGroup>, HashSet<String>)>,
}

impl MarkedReduction {
    /// No marks yet: behaves like plain DDP.
    pub fn new() -> Self {
        MarkedReduction { marks: Vec::new() }
    }

    /// Marks `names` for an extra sum reduction over `group`.
    pub fn mark(mut self, group: Arc<dyn ProcessGroup>, names: &[&str]) -> Self {
        self.marks
            .push((group, names.iter().map(|n| (*n).to_owned()).collect()));
        self
    }
}

impl Default for MarkedReduction {
    fn default() -> Self {
        Self::new()
    }
}

impl CommHook for MarkedReduction {
    fn reduce(&self, bucket: &GradBucket<'_>, dp: &dyn ProcessGroup) -> Result<(), CommError> {
        dp.all_reduce(bucket.buffer, ReduceOp::Avg)?;
        for (group, names) in &self.marks {
            let slices: Vec<Tensor> = bucket
                .entries
                .iter()
                .filter(|(name, _, _)| names.contains(name))
                .map(|(_, offset, numel)| bucket.buffer.narrow(0, *offset as i64, *numel as i64))
                .collect();
            if slices.is_empty() {
                continue;
            }
            let packed = Tensor::f_cat(&slices, 0)?;
            group.all_reduce(&packed, ReduceOp::Sum)?;
            let mut offset = 0;
            for mut slice in slices {
                let n = slice.numel() as i64;
                slice.f_copy_(&packed.narrow(0, offset, n))?;
                offset += n;
            }
        }
        Ok(())
    }
}

struct Bucket {
    /// Indices into `State::params`.
    members: Vec<usize>,
    entries: Vec<(String, usize, usize)>,
    flat: Tensor,
    ready: usize,
    work: Option<Work>,
}

/// What the backward hooks and the step share.
struct State {
    params: Vec<(String, Tensor)>,
    /// Bucket of each parameter (`None`: not reduced).
    bucket_of: Vec<Option<usize>>,
    buckets: Vec<Bucket>,
    next_launch: usize,
    op: ReduceOp,
    group: Arc<dyn ProcessGroup>,
}

impl State {
    fn pack(&mut self, b: usize) -> Result<(), DdpError> {
        let _guard = tch::no_grad_guard();
        let bucket = &mut self.buckets[b];
        for (&i, (name, offset, numel)) in bucket.members.iter().zip(&bucket.entries) {
            let grad = self.params[i].1.grad();
            if !grad.defined() {
                return Err(DdpError::Invalid(format!(
                    "parameter `{name}` has no gradient"
                )));
            }
            bucket
                .flat
                .narrow(0, *offset as i64, *numel as i64)
                .f_copy_(&grad.f_reshape([-1])?)?;
        }
        Ok(())
    }

    /// Launches every complete bucket whose predecessors are launched.
    fn launch_ready(&mut self) -> Result<(), DdpError> {
        while self.next_launch < self.buckets.len() {
            let b = self.next_launch;
            if self.buckets[b].ready < self.buckets[b].members.len() {
                break;
            }
            self.pack(b)?;
            let work = self
                .group
                .all_reduce_async(&self.buckets[b].flat, self.op)?;
            self.buckets[b].work = Some(work);
            self.next_launch += 1;
        }
        Ok(())
    }

    fn param_ready(&mut self, i: usize) -> Result<(), DdpError> {
        if let Some(b) = self.bucket_of[i] {
            self.buckets[b].ready += 1;
            self.launch_ready()?;
        }
        Ok(())
    }
}

/// DDP over one data-parallel group. Plug it into [`train`] as its [`StepHooks`].
pub struct Ddp {
    state: Arc<Mutex<State>>,
    buffers: Vec<(String, Tensor)>,
    opts: DdpOptions,
    _hooks: Vec<HookHandle>,
}

impl Ddp {
    /// Wraps `model` (built identically on every rank): broadcasts its parameters and buffers
    /// from rank 0 and prepares the buckets.
    pub fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        opts: DdpOptions,
    ) -> Result<Ddp, DdpError> {
        let tags = model.tags();
        let rank_local: HashSet<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| tags.is_rank_local(n))
            .collect();
        Self::from_parts(
            model.named_parameters(),
            model.named_buffers(),
            &rank_local,
            group,
            opts,
        )
    }

    /// As [`Ddp::new`] for parameters that are not a zoo model (`rank_local` are never
    /// broadcast nor reduced).
    pub fn from_parts(
        params: Vec<(String, Tensor)>,
        buffers: Vec<(String, Tensor)>,
        rank_local: &HashSet<String>,
        group: Arc<dyn ProcessGroup>,
        opts: DdpOptions,
    ) -> Result<Ddp, DdpError> {
        let fault = opts.fault.clone();
        let excluded = |name: &str| match &fault {
            Some(Fault::SkipParameter(p)) if p == name => true,
            Some(Fault::ReduceExperts) => false,
            _ => rank_local.contains(name),
        };
        let params = distinct_parameters(params);
        broadcast_from_rank0(
            group.as_ref(),
            params
                .iter()
                .filter(|(name, _)| !rank_local.contains(name))
                .map(|(_, p)| p),
        )?;
        if fault != Some(Fault::NoBufferBroadcast) {
            broadcast_from_rank0(group.as_ref(), buffers.iter().map(|(_, b)| b))?;
        }
        let buckets = plan_buckets(&params, &excluded, opts.bucket_cap_bytes)?;
        let mut bucket_of = vec![None; params.len()];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in &bucket.members {
                bucket_of[i] = Some(b);
            }
        }
        let op = if fault == Some(Fault::SumInsteadOfAverage) {
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
        }));
        let mut hooks = Vec::new();
        if opts.overlap && opts.comm_hook.is_none() {
            let params: Vec<Tensor> = lock(&state)
                .params
                .iter()
                .map(|(_, t)| t.shallow_clone())
                .collect();
            for (i, p) in params.iter().enumerate() {
                let state = state.clone();
                hooks.push(register_post_accumulate_grad_hook(p, move |_| {
                    lock(&state)
                        .param_ready(i)
                        .map_err(|e| AutogradError::msg(format!("ddp bucket launch: {e}")))
                })?);
            }
        }
        Ok(Ddp {
            state,
            buffers,
            opts,
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

    /// How many buckets' all-reduces are already in flight: right after backward with
    /// `overlap`, all of them (they launched from the backward hooks).
    pub fn launched_buckets(&self) -> usize {
        lock(&self.state).next_launch
    }

    /// Finishes gradient averaging after backward: launches what the hooks did not, waits,
    /// and writes the averaged values back into every parameter's `.grad`.
    pub fn finish_gradients(&mut self) -> Result<(), DdpError> {
        let mut state = lock(&self.state);
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
        }
        let _guard = tch::no_grad_guard();
        let State {
            params, buckets, ..
        } = &mut *state;
        for bucket in buckets.iter_mut() {
            for (&i, (_, offset, numel)) in bucket.members.iter().zip(&bucket.entries) {
                let mut grad = params[i].1.grad();
                let reduced = bucket.flat.narrow(0, *offset as i64, *numel as i64);
                grad.f_copy_(&reduced.f_view_as(&grad)?)?;
            }
            bucket.ready = 0;
        }
        state.next_launch = 0;
        Ok(())
    }

    /// Copies rank 0's buffers to every rank.
    pub fn broadcast_buffers(&self) -> Result<(), DdpError> {
        let state = lock(&self.state);
        broadcast_from_rank0(state.group.as_ref(), self.buffers.iter().map(|(_, b)| b))?;
        Ok(())
    }
}

impl StepHooks for Ddp {
    fn before_forward(&mut self, _step: usize) -> Result<(), TrainError> {
        let broadcast =
            self.opts.broadcast_buffers && self.opts.fault != Some(Fault::NoBufferBroadcast);
        if broadcast {
            self.broadcast_buffers().map_err(into_train)?;
        }
        Ok(())
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.finish_gradients().map_err(into_train)
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

/// Packs parameters, last first, into buckets of one dtype and at most `cap` bytes (a single
/// larger parameter gets a bucket of its own).
fn plan_buckets(
    params: &[(String, Tensor)],
    excluded: &dyn Fn(&str) -> bool,
    cap: usize,
) -> Result<Vec<Bucket>, DdpError> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0;
    let mut kind = None;
    let close = |members: &mut Vec<usize>, buckets: &mut Vec<Bucket>| -> Result<(), DdpError> {
        if members.is_empty() {
            return Ok(());
        }
        let mut entries = Vec::new();
        let mut offset = 0;
        for &i in members.iter() {
            let numel = params[i].1.numel();
            entries.push((params[i].0.clone(), offset, numel));
            offset += numel;
        }
        let k = params[members[0]].1.kind();
        buckets.push(Bucket {
            members: std::mem::take(members),
            entries,
            flat: Tensor::f_zeros([offset as i64], (k, params[0].1.device()))?,
            ready: 0,
            work: None,
        });
        Ok(())
    };
    for i in (0..params.len()).rev() {
        let (name, p) = &params[i];
        if excluded(name) {
            continue;
        }
        let size = p.numel() * p.kind().elt_size_in_bytes();
        if !current.is_empty() && (kind != Some(p.kind()) || bytes + size > cap) {
            close(&mut current, &mut buckets)?;
            bytes = 0;
        }
        kind = Some(p.kind());
        bytes += size;
        current.push(i);
    }
    close(&mut current, &mut buckets)?;
    Ok(buckets)
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
