//! The FSDP table: each FSDP configuration of the matrix as a row (its options, layout and
//! how it is judged against DDP), kept as data so adding an FSDP option is one entry.

use super::*;

/// How an FSDP configuration places its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsdpLayout {
    /// One sharding group over the whole world ([`train_fsdp`](lockstep_core::fsdp::train_fsdp)).
    Flat,
    /// Hybrid shard ([`train_fsdp_hybrid`](lockstep_core::fsdp::train_fsdp_hybrid)): `replicas` replicas of `world / replicas` ranks
    /// each; world sizes that do not split that way are skipped with the reason.
    Hybrid {
        /// Replicas; each shards over `world / replicas` ranks.
        replicas: usize,
    },
}

impl FsdpLayout {
    /// The shard-group size of a hybrid layout at `world_size` (`None` when flat), or why it
    /// cannot run there.
    pub fn shard_size(self, world_size: usize) -> Result<Option<usize>, String> {
        match self {
            FsdpLayout::Flat => Ok(None),
            FsdpLayout::Hybrid { replicas } => {
                if replicas > 0 && world_size >= replicas && world_size.is_multiple_of(replicas) {
                    Ok(Some(world_size / replicas))
                } else {
                    Err(format!(
                        "hybrid shard needs {replicas} replicas of equal shard groups; world \
                         size {world_size} does not split into {replicas}"
                    ))
                }
            }
        }
    }
}

/// How an FSDP configuration is judged against `ddp@N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DdpCheck {
    /// Bit for bit: the reduce-scatter yields exactly the elements of DDP's all-reduce on the
    /// CPU backend (both reduce in rank order with one kernel), so any difference is a bug.
    Bitwise,
    /// Under the fp32 dtype table, as an override of the bitwise DDP policy whose reason is
    /// recorded in the row note and in every report: for configurations whose reduction
    /// order differs from DDP's by design.
    DtypeTable {
        /// Why the reduction order differs from DDP's, shown in notes and reports.
        reason: &'static str,
    },
}

/// One FSDP configuration of the matrix: a row of [`fsdp_configs`]. Kept as data (not one
/// enum variant each) so that adding an FSDP option to the matrix is one table entry, and
/// `--list`, `--configs` and the reference policy all follow from it.
#[derive(Clone, Debug)]
pub struct FsdpConfig {
    /// The name users select with `--configs` (`fsdp.full_shard.per_layer`).
    pub name: &'static str,
    /// What runs, for `--list`.
    pub description: &'static str,
    /// The FSDP options of every rank.
    pub options: FsdpOptions,
    /// Flat or hybrid.
    pub layout: FsdpLayout,
    /// How it is judged against its DDP reference (against `single@N` it is always the fp32
    /// table).
    pub vs_ddp: DdpCheck,
    /// The mixed-precision policy, if any (`options.mixed_precision` is its
    /// [`Precision::policy`]): its DDP reference is then `ddp.<label>`, and it has no row
    /// against `single@N` ([`MIXED_VS_SINGLE_REASON`]).
    pub precision: Option<Precision>,
}

impl FsdpConfig {
    /// The DDP configuration it is compared against: `ddp`, DDP under the same
    /// mixed-precision policy, or for a hybrid layout `ddp.hybrid_order` (DDP averaging in
    /// hybrid shard's two stages, [`HYBRID_VS_DDP_REASON`]).
    pub fn ddp_reference(&self) -> Config {
        match (self.precision, self.layout) {
            (Some(p), _) => Config::DdpMixed(p),
            (None, FsdpLayout::Hybrid { .. }) => Config::DdpHybridOrder,
            (None, FsdpLayout::Flat) => Config::Ddp,
        }
    }
}

/// FSDP options with `strategy` and `wrap`, everything else PyTorch's defaults.
fn with(strategy: ShardingStrategy, wrap: WrapPolicy) -> FsdpOptions {
    FsdpOptions {
        strategy,
        wrap,
        ..FsdpOptions::default()
    }
}

/// A flat (one process group) fp32 row, bitwise equal to DDP.
fn flat(name: &'static str, description: &'static str, options: FsdpOptions) -> FsdpConfig {
    FsdpConfig {
        name,
        description,
        options,
        layout: FsdpLayout::Flat,
        vs_ddp: DdpCheck::Bitwise,
        precision: None,
    }
}

/// A flat row under a mixed-precision policy, bitwise equal to DDP under the same policy.
fn mixed(
    name: &'static str,
    description: &'static str,
    options: FsdpOptions,
    precision: Precision,
) -> FsdpConfig {
    FsdpConfig {
        name,
        description,
        options: FsdpOptions {
            mixed_precision: Some(precision.policy()),
            ..options
        },
        layout: FsdpLayout::Flat,
        vs_ddp: DdpCheck::Bitwise,
        precision: Some(precision),
    }
}

/// A hybrid-shard row (shards within a replica, replicas averaged), bitwise equal to
/// `ddp.hybrid_order`.
fn hybrid(name: &'static str, description: &'static str, wrap: WrapPolicy) -> FsdpConfig {
    FsdpConfig {
        name,
        description,
        options: with(ShardingStrategy::HybridShard, wrap),
        layout: Config::hybrid_layout(),
        vs_ddp: DdpCheck::Bitwise,
        precision: None,
    }
}

/// The rows that came first (their names are kept stable: users and CI jobs select them).
fn first_fsdp_rows() -> Vec<FsdpConfig> {
    let mut rows = root_strategy_rows();
    rows.extend(per_layer_rows());
    rows.extend(grouped_unit_rows());
    rows.extend(root_option_rows());
    rows.extend(first_hybrid_rows());
    rows
}

/// The three sharding strategies with the model as one root unit.
fn root_strategy_rows() -> Vec<FsdpConfig> {
    let full = FsdpOptions::default();
    vec![
        flat(
            "fsdp.full_shard",
            "FSDP FULL_SHARD, the model as one root unit (ZeRO-3)",
            full.clone(),
        ),
        flat(
            "fsdp.shard_grad_op",
            "FSDP SHARD_GRAD_OP, one root unit (full parameters kept from forward to \
         backward)",
            with(ShardingStrategy::ShardGradOp, WrapPolicy::Root),
        ),
        flat(
            "fsdp.no_shard",
            "FSDP NO_SHARD, one root unit (gradients all-reduced through FSDP's path)",
            with(ShardingStrategy::NoShard, WrapPolicy::Root),
        ),
    ]
}

/// One unit per layer: both sharding strategies, then FULL_SHARD's reshard and prefetch options.
fn per_layer_rows() -> Vec<FsdpConfig> {
    let per_layer = with(ShardingStrategy::FullShard, WrapPolicy::PerLayer);
    vec![
        flat(
            "fsdp.full_shard.per_layer",
            "FSDP FULL_SHARD, one unit per layer (tied parameters in the root)",
            per_layer.clone(),
        ),
        flat(
            "fsdp.shard_grad_op.per_layer",
            "FSDP SHARD_GRAD_OP, one unit per layer",
            with(ShardingStrategy::ShardGradOp, WrapPolicy::PerLayer),
        ),
        flat(
            "fsdp.full_shard.per_layer.no_reshard",
            "FULL_SHARD per layer with reshard_after_forward off (units stay gathered \
         from forward to backward)",
            FsdpOptions {
                reshard_after_forward: false,
                ..per_layer.clone()
            },
        ),
        flat(
            "fsdp.full_shard.per_layer.prefetch_post",
            "FULL_SHARD per layer, backward prefetch in post-backward (BACKWARD_POST)",
            FsdpOptions {
                backward_prefetch: BackwardPrefetch::Post,
                ..per_layer.clone()
            },
        ),
        flat(
            "fsdp.full_shard.per_layer.no_prefetch",
            "FULL_SHARD per layer, no backward prefetch",
            FsdpOptions {
                backward_prefetch: BackwardPrefetch::None,
                ..per_layer.clone()
            },
        ),
        flat(
            "fsdp.full_shard.per_layer.forward_prefetch",
            "FULL_SHARD per layer, forward prefetch on (next unit gathered when a unit's \
         forward starts)",
            FsdpOptions {
                forward_prefetch: true,
                ..per_layer.clone()
            },
        ),
    ]
}

/// FULL_SHARD with layers grouped into units by block kind, then by size.
fn grouped_unit_rows() -> Vec<FsdpConfig> {
    vec![
        flat(
            "fsdp.full_shard.blocks",
            "FULL_SHARD, one unit per transformer block (encoder/decoder layers, \
         decoder blocks, MoE decoder blocks, a user's `Block`s); the rest, and models without blocks, \
         in the root",
            with(
                ShardingStrategy::FullShard,
                WrapPolicy::ByKind(BLOCK_KINDS.to_vec()),
            ),
        ),
        flat(
            "fsdp.full_shard.min_params",
            "FULL_SHARD, consecutive layers grouped into units of at least 100 parameters \
         (size-based wrap); a smaller remainder in the root",
            with(
                ShardingStrategy::FullShard,
                WrapPolicy::MinParams(MIN_PARAMS),
            ),
        ),
    ]
}

/// FULL_SHARD with one root unit under the construction and offload options.
fn root_option_rows() -> Vec<FsdpConfig> {
    let full = FsdpOptions::default();
    vec![
        flat(
            "fsdp.full_shard.offload",
            "FULL_SHARD, one root unit, master shards (gradients, optimizer state) \
         offloaded to the CPU",
            FsdpOptions {
                offload_params: true,
                ..full.clone()
            },
        ),
        flat(
            "fsdp.full_shard.no_sync_module_states",
            "FULL_SHARD, one root unit, without broadcasting rank 0's parameters and \
         buffers at construction (every rank builds the same model)",
            FsdpOptions {
                sync_module_states: false,
                ..full.clone()
            },
        ),
    ]
}

/// Hybrid shard, one root unit and one unit per layer.
fn first_hybrid_rows() -> Vec<FsdpConfig> {
    vec![
        hybrid(
            "fsdp.hybrid_shard",
            "FSDP HYBRID_SHARD, one root unit: sharded within groups of N/2 ranks, \
         replicated across 2",
            WrapPolicy::Root,
        ),
        hybrid(
            "fsdp.hybrid_shard.per_layer",
            "HYBRID_SHARD with one unit per layer",
            WrapPolicy::PerLayer,
        ),
    ]
}

/// The rest of strategy × wrapping, so every combination runs.
fn strategy_wrap_rows() -> Vec<FsdpConfig> {
    vec![
        // The rest of strategy × wrapping: every strategy under every wrap policy that
        // applies to any model (`Explicit` names one model's layers: core/tests/fsdp_units.rs).
        flat(
            "fsdp.shard_grad_op.blocks",
            "SHARD_GRAD_OP, one unit per transformer block",
            with(
                ShardingStrategy::ShardGradOp,
                WrapPolicy::ByKind(BLOCK_KINDS.to_vec()),
            ),
        ),
        flat(
            "fsdp.shard_grad_op.min_params",
            "SHARD_GRAD_OP, size-based units of at least 100 parameters",
            with(
                ShardingStrategy::ShardGradOp,
                WrapPolicy::MinParams(MIN_PARAMS),
            ),
        ),
        flat(
            "fsdp.no_shard.per_layer",
            "NO_SHARD, one unit per layer",
            with(ShardingStrategy::NoShard, WrapPolicy::PerLayer),
        ),
        flat(
            "fsdp.no_shard.blocks",
            "NO_SHARD, one unit per transformer block",
            with(
                ShardingStrategy::NoShard,
                WrapPolicy::ByKind(BLOCK_KINDS.to_vec()),
            ),
        ),
        flat(
            "fsdp.no_shard.min_params",
            "NO_SHARD, size-based units of at least 100 parameters",
            with(ShardingStrategy::NoShard, WrapPolicy::MinParams(MIN_PARAMS)),
        ),
        hybrid(
            "fsdp.hybrid_shard.blocks",
            "HYBRID_SHARD, one unit per transformer block",
            WrapPolicy::ByKind(BLOCK_KINDS.to_vec()),
        ),
        hybrid(
            "fsdp.hybrid_shard.min_params",
            "HYBRID_SHARD, size-based units of at least 100 parameters",
            WrapPolicy::MinParams(MIN_PARAMS),
        ),
    ]
}

/// The mixed-precision rows.
fn mixed_precision_rows() -> Vec<FsdpConfig> {
    let full = FsdpOptions::default();
    let per_layer = with(ShardingStrategy::FullShard, WrapPolicy::PerLayer);
    vec![
        mixed(
            "fsdp.full_shard.bf16",
            "FULL_SHARD, one root unit, bf16 mixed precision (bf16 compute, fp32 \
         reduction and buffers, BatchNorm in fp32 units)",
            full,
            Precision::Bf16,
        ),
        mixed(
            "fsdp.full_shard.per_layer.bf16",
            "FULL_SHARD per layer, bf16 mixed precision",
            per_layer.clone(),
            Precision::Bf16,
        ),
        mixed(
            "fsdp.shard_grad_op.per_layer.bf16",
            "SHARD_GRAD_OP per layer, bf16 mixed precision",
            with(ShardingStrategy::ShardGradOp, WrapPolicy::PerLayer),
            Precision::Bf16,
        ),
        mixed(
            "fsdp.full_shard.per_layer.fp16",
            "FULL_SHARD per layer, fp16 mixed precision (fp16 compute, fp32 reduction and \
         buffers, BatchNorm in fp32 units)",
            per_layer,
            Precision::Fp16,
        ),
    ]
}

/// Every FSDP configuration, in row order. The first four are the original names, kept
/// stable because users and CI jobs select them by name; the mixed-precision ones come last.
pub fn fsdp_configs() -> &'static [FsdpConfig] {
    static TABLE: LazyLock<Vec<FsdpConfig>> = LazyLock::new(|| {
        let mut rows = first_fsdp_rows();
        rows.extend(strategy_wrap_rows());
        rows.extend(mixed_precision_rows());
        rows
    });
    &TABLE
}

/// Which FSDP configuration: an index into [`fsdp_configs`], obtainable only from the table
/// (so it always names a row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FsdpId(pub(super) usize);

impl FsdpId {
    /// The configuration's table row.
    pub fn get(self) -> &'static FsdpConfig {
        &fsdp_configs()[self.0]
    }
}
