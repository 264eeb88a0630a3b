//! FSDP's face: its options (sharding strategy, prefetching, resharding, mixed precision),
//! the bugs it can plant on purpose and its collective tally (its error type: `error.rs`).

use super::WrapPolicy;
use crate::precision::MixedPrecision;

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
    /// Needs [`Fsdp::new_hybrid`](super::Fsdp::new_hybrid).
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
