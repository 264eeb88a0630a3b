//! The configuration catalog: every built-in parallel configuration (`ddp`, the FSDP,
//! pipeline, tensor/expert-parallel and composition tables), what blocks it on a model or a
//! world size, how it trains, and the policy each of its references is judged by. It sits
//! below the commands: the matrix, `ParityTest`, `lockstep run` and `lockstep rank` all read
//! it, so one (configuration, reference) pair gets one verdict and one refusal message
//! everywhere.

use lockstep_core::comm::DType;
use lockstep_core::fsdp::{BackwardPrefetch, FsdpOptions, ShardingStrategy, WrapPolicy};
use lockstep_core::mixed_reference::HalfType;
use lockstep_core::precision::MixedPrecision;
use lockstep_core::tensor_parallel::TpOptions;
use lockstep_harness::parity::{Override, Tolerance, TolerancePolicy};
use lockstep_models::{LayerKind, Model};
use std::sync::LazyLock;

/// Ranks are processes on this host, each with a full mesh of TCP links to the others; past
/// this many the run measures the machine, not the parallelism.
pub const MAX_WORLD_SIZE: usize = 64;

/// Replicas `fsdp.hybrid_shard*` runs: shard groups of `world / 2` ranks. Two is the fewest
/// that exercise the cross-replica all-reduce, and it fits every even world size.
pub const HYBRID_REPLICAS: usize = 2;

/// The layer kinds `fsdp.full_shard.blocks` wraps: the zoo's transformer blocks and a user's
/// generic `LayerKind::Block`, as
/// PyTorch's `ModuleWrapPolicy({TransformerEncoderLayer, ...})` is used. Models without such
/// layers keep everything in the root unit.
pub const BLOCK_KINDS: [LayerKind; 5] = [
    LayerKind::EncoderLayer,
    LayerKind::DecoderLayer,
    LayerKind::DecoderBlock,
    LayerKind::MoeDecoderBlock,
    LayerKind::Block,
];

/// The threshold of `fsdp.full_shard.min_params` (PyTorch's `size_based_auto_wrap_policy`).
/// PyTorch's default (1e8) would leave every zoo model one root unit; 100 parameters gives 3
/// to 6 units on each zoo model, small neighbouring layers grouped into one unit (`nested`:
/// `module.0+module.1.0`; `transformer`: `encoder.norm+decoder.layers.0`).
pub const MIN_PARAMS: i64 = 100;

/// Why hybrid shard's DDP reference is `ddp.hybrid_order`, not `ddp`: printed by `--list`
/// and in the docs.
pub const HYBRID_VS_DDP_REASON: &str = "hybrid shard averages in two stages (reduce-scatter \
     within each shard group, then all-reduce across the 2 replicas), so at world 4 a gradient \
     element is ((g0+g1)/2 + (g2+g3)/2)/2, while plain DDP's all-reduce sums in rank order, \
     (((g0+g1)+g2)+g3)/4; float addition is not associative, so the bits differ. Its reference \
     is ddp.hybrid_order, DDP whose buckets are averaged in the same two stages on the same \
     mesh, and against it hybrid shard is bitwise";

/// Why mixed-precision configurations (`fsdp.*.bf16`, ...) are judged against `single@N`
/// with their DDP reference's noise as the envelope, and `ddp.bf16` itself has no such row
/// (it is held bitwise to `single.bf16@N` instead).
pub const MIXED_VS_SINGLE_REASON: &str = "a bf16 or fp16 run is farther from the float64 \
     training than the fp32 reference by low-precision rounding by design, so its envelope is \
     the noise of DDP under the same policy (the configuration's own reference, itself held \
     bitwise to its repeat and to the independent mixed-precision reference single.bf16 or \
     single.fp16); DDP under a policy, being that envelope, has no row against single";

mod catalog;
mod compositions;
mod edges;
mod fsdp;
mod model_parallel;
#[cfg(test)]
mod option_coverage;
mod pipeline;

pub use catalog::*;
pub use compositions::*;
pub use edges::*;
pub use fsdp::*;
pub use model_parallel::*;
pub use pipeline::*;
