//! `lockstep matrix`: every (model × parallel configuration × world size) the tool knows, run
//! on the CPU backend and judged against its references, with one report set at the end.
//!
//! A configuration under test is compared against every reference that applies to it:
//!
//! - `ddp@N` against `single@N` (the single-device reference over the same global batch)
//!   under the fp32 dtype table, and against a second, freshly launched `ddp@N` in bitwise
//!   mode: the CPU backend reduces in rank order, so a repeat must be bit-identical;
//! - `single@N` against a repeat of itself in bitwise mode: a reference that is not
//!   deterministic would make every verdict against it meaningless;
//! - every FSDP configuration against `ddp@N` in bitwise mode (FSDP's reduce-scatter yields
//!   exactly DDP's averaged gradients on the CPU backend) and against `single@N` under the
//!   fp32 dtype table. The exception is hybrid shard (`fsdp.hybrid_shard*`), whose two-stage
//!   average sums in a different order than DDP's all-reduce: it is held to the fp32 dtype
//!   table against DDP through a tolerance override whose reason
//!   ([`HYBRID_VS_DDP_REASON`]) is in its row notes and in every report;
//! - every mixed-precision FSDP configuration (`fsdp.*.bf16`, `fsdp.*.fp16`) against DDP
//!   under the same policy (`ddp.bf16@N`, `ddp.fp16@N`) in bitwise mode: the same casts of
//!   the same fp32 masters and the same rank-order reduction. These configurations have **no
//!   row** against `single@N` (the row is omitted, not skipped): the fp32 single-device
//!   reference differs from a bf16 or fp16 run by low-precision rounding by design, and no
//!   per-element tolerance bounds that ([`MIXED_VS_SINGLE_REASON`], printed by `--list`);
//! - `ddp.bf16@N` and `ddp.fp16@N` (DDP under [`Precision`]'s policy), when selected
//!   themselves, against a fresh repeat of themselves in bitwise mode, and likewise not
//!   against `single@N`. Rank-local parameters (`moe`'s expert), which FSDP ignores, are
//!   cast to the compute dtype for forward like every other parameter, so every model runs.
//!
//! The FSDP configurations are a table ([`fsdp_configs`]): name, description, options,
//! layout (flat or hybrid), how it is judged against DDP and its mixed-precision policy;
//! `--configs 'fsdp.*'` selects them all (`'fsdp.*.bf16'` the bf16 ones). Hybrid shard runs 2 replicas of `N/2` ranks; at world sizes that do not split
//! so (1, odd) its rows are skipped with that reason and nothing is launched. Rows carry the
//! run's memory figures (FSDP's full-parameter peak and shard bytes on rank 0; DDP's whole
//! model), shown in the table and the reports.
//!
//! References are run whenever a selected configuration needs them, whether or not their own
//! configuration was selected: `single` once for `ddp` or an fp32 FSDP launch, `ddp` once for
//! an fp32 FSDP launch, `ddp.bf16` once for a bf16 FSDP launch (and so on per policy); a
//! selected reference runs twice, the second launch being its repeat. Models whose ranks
//! differ by construction (per-rank experts, BatchNorm statistics) have no single-device
//! reference; their rows against it are skipped with the model's own reason.
//!
//! Parallel runs are launched with [`RankSpawn::Fork`] (the process never touches CUDA), rank
//! 0 hands its [`RunRecord`] back through a temporary JSON file, and the single-device runs
//! happen in this process. Nothing is written until every run is done, and stale report
//! files in the output directory are removed before the first run. A run that fails (a rank
//! error, crash or timeout) does not lose the matrix: its rows are `ERROR` with the
//! launcher's whole account (on a timeout every rank's flight recorder and the desync
//! diagnosis), and the report set is written with them as errors, marked incomplete
//! (`complete: false`, an INCOMPLETE headline, JUnit `<error>`s), so it never looks complete.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, DdpOptions, Fault};
use lockstep_core::fsdp::{
    train_fsdp, train_fsdp_hybrid, BackwardPrefetch, FsdpOptions, ShardingStrategy, WrapPolicy,
};
use lockstep_core::precision::MixedPrecision;
use lockstep_core::record::{MemoryStats, RunRecord, RunSpec};
use lockstep_core::replica::distinct_parameters;
use lockstep_core::train::{single_device_reference, OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{
    compare, Comparison, FailurePoint, Mode, Override, Tolerance, TolerancePolicy,
};
use lockstep_harness::report::{self, Report, ReportError, ReportFiles, RunError};
use lockstep_harness::{launch, LaunchError, LaunchOptions, RankCtx, RankSpawn};
use lockstep_models::{zoo, LayerKind, Model, ModelError};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// World size when none is given: four ranks exercise uneven reduction trees while still
/// fitting a small machine.
pub const DEFAULT_WORLD_SIZE: usize = 4;

/// Ranks are processes on this host, each with a full mesh of TCP links to the others; past
/// this many the run measures the machine, not the parallelism.
pub const MAX_WORLD_SIZE: usize = 64;

/// How a row skipped for want of a single-device reference begins its note.
const NO_SINGLE: &str = "no single-device reference";

/// How a row note names the tolerance override in force (followed by `: reason`).
const OVERRIDE: &str = "tolerance override";

/// Where reports go unless `--out` says otherwise.
pub const DEFAULT_OUT_DIR: &str = "target/lockstep/matrix";

/// The files a matrix writes (and removes before running, so none is ever stale).
pub const REPORT_FILES: [&str; 4] = ["report.json", "report.md", "junit.xml", "report.html"];

/// Why a matrix could not be planned, run or written.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A `--models` pattern matched no zoo model.
    #[error("unknown model `{pattern}`; known models: {}", known.join(", "))]
    UnknownModel { pattern: String, known: Vec<String> },
    /// A `--configs` pattern matched no configuration.
    #[error("unknown config `{pattern}`; known configs: {}", known.join(", "))]
    UnknownConfig { pattern: String, known: Vec<String> },
    /// A world size no run can use (0, too many ranks, or one the model rejects).
    #[error("invalid world size {world_size}: {reason}")]
    InvalidWorldSize { world_size: usize, reason: String },
    /// Any other option out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// The output directory cannot be created or written; checked before anything runs.
    #[error("output directory {}: {source}", path.display())]
    OutDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model could not be built while planning.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Writing the report set failed.
    #[error(transparent)]
    Report(#[from] ReportError),
}

/// Replicas `fsdp.hybrid_shard*` runs: shard groups of `world / 2` ranks. Two is the fewest
/// that exercise the cross-replica all-reduce, and it fits every even world size.
pub const HYBRID_REPLICAS: usize = 2;

/// The layer kinds `fsdp.full_shard.blocks` wraps: the zoo's transformer blocks, as
/// PyTorch's `ModuleWrapPolicy({TransformerEncoderLayer, ...})` is used. Models without such
/// layers keep everything in the root unit.
pub const BLOCK_KINDS: [LayerKind; 4] = [
    LayerKind::EncoderLayer,
    LayerKind::DecoderLayer,
    LayerKind::DecoderBlock,
    LayerKind::MoeDecoderBlock,
];

/// The threshold of `fsdp.full_shard.min_params` (PyTorch's `size_based_auto_wrap_policy`).
/// PyTorch's default (1e8) would leave every zoo model one root unit; 100 parameters gives 3
/// to 6 units on each zoo model, small neighbouring layers grouped into one unit (`nested`:
/// `module.0+module.1.0`; `transformer`: `encoder.norm+decoder.layers.0`).
pub const MIN_PARAMS: i64 = 100;

/// Why hybrid shard is held to the fp32 dtype table against DDP instead of bitwise: the
/// override reason recorded in every hybrid row and report.
pub const HYBRID_VS_DDP_REASON: &str = "hybrid shard averages in two stages (reduce-scatter \
     within each shard group, then all-reduce across the 2 replicas), so at world 4 a gradient \
     element is ((g0+g1)/2 + (g2+g3)/2)/2, the sum (g0+g1)+(g2+g3), while the CPU backend's \
     all-reduce in DDP sums in rank order, ((g0+g1)+g2)+g3, then divides by 4; float addition \
     is not associative, so the bits may differ: judged under the fp32 dtype table instead of \
     bitwise";

/// Why mixed-precision configurations (`ddp.bf16`, `fsdp.*.bf16`, ...) have no row against
/// `single@N`: they are judged against DDP under the same policy instead.
pub const MIXED_VS_SINGLE_REASON: &str = "mixed precision is checked against DDP under the \
     same policy, bitwise; the fp32 single-device reference differs from a bf16 or fp16 run \
     by low-precision rounding by design, and no per-element tolerance bounds that (a \
     low-precision backward has no per-element relative bound), so there is no row against \
     single";

/// A mixed-precision policy the matrix runs: the presets of [`MixedPrecision`] (low-precision
/// compute; fp32 gradient reduction and buffers; BatchNorm in fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    /// [`MixedPrecision::bf16`].
    Bf16,
    /// [`MixedPrecision::fp16`].
    Fp16,
}

impl Precision {
    /// Every policy, in row order.
    pub const ALL: [Precision; 2] = [Precision::Bf16, Precision::Fp16];

    /// The policy every rank trains under.
    pub fn policy(self) -> MixedPrecision {
        match self {
            Precision::Bf16 => MixedPrecision::bf16(),
            Precision::Fp16 => MixedPrecision::fp16(),
        }
    }

    /// The policy's label ([`MixedPrecision::label`]): the suffix of configuration names and
    /// the `dtype` of run specs.
    pub fn label(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The DDP reference configuration under this policy: `ddp.bf16`, `ddp.fp16`.
    pub fn ddp_name(self) -> &'static str {
        match self {
            Precision::Bf16 => "ddp.bf16",
            Precision::Fp16 => "ddp.fp16",
        }
    }
}

/// How an FSDP configuration places its ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsdpLayout {
    /// One sharding group over the whole world ([`train_fsdp`]).
    Flat,
    /// Hybrid shard ([`train_fsdp_hybrid`]): `replicas` replicas of `world / replicas` ranks
    /// each; world sizes that do not split that way are skipped with the reason.
    Hybrid { replicas: usize },
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
    DtypeTable { reason: &'static str },
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
    /// The DDP configuration it is compared against: `ddp`, or DDP under the same
    /// mixed-precision policy.
    pub fn ddp_reference(&self) -> Config {
        match self.precision {
            None => Config::Ddp,
            Some(p) => Config::DdpMixed(p),
        }
    }
}

/// Every FSDP configuration, in row order. The first four are the original names, kept
/// stable because users and CI jobs select them by name; the mixed-precision ones come last.
pub fn fsdp_configs() -> &'static [FsdpConfig] {
    static TABLE: LazyLock<Vec<FsdpConfig>> = LazyLock::new(|| {
        let full = FsdpOptions::default();
        let with = |strategy, wrap| FsdpOptions {
            strategy,
            wrap,
            ..FsdpOptions::default()
        };
        let per_layer = with(ShardingStrategy::FullShard, WrapPolicy::PerLayer);
        let flat = |name, description, options| FsdpConfig {
            name,
            description,
            options,
            layout: FsdpLayout::Flat,
            vs_ddp: DdpCheck::Bitwise,
            precision: None,
        };
        let mixed = |name, description, options: FsdpOptions, precision: Precision| FsdpConfig {
            name,
            description,
            options: FsdpOptions {
                mixed_precision: Some(precision.policy()),
                ..options
            },
            layout: FsdpLayout::Flat,
            vs_ddp: DdpCheck::Bitwise,
            precision: Some(precision),
        };
        let hybrid = |name, description, wrap| FsdpConfig {
            name,
            description,
            options: with(ShardingStrategy::HybridShard, wrap),
            layout: FsdpLayout::Hybrid {
                replicas: HYBRID_REPLICAS,
            },
            vs_ddp: DdpCheck::DtypeTable {
                reason: HYBRID_VS_DDP_REASON,
            },
            precision: None,
        };
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
            flat(
                "fsdp.full_shard.blocks",
                "FULL_SHARD, one unit per transformer block (encoder/decoder layers, \
                 decoder blocks, MoE decoder blocks); the rest, and models without blocks, \
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
    });
    &TABLE
}

/// Which FSDP configuration: an index into [`fsdp_configs`], obtainable only from the table
/// (so it always names a row).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FsdpId(usize);

impl FsdpId {
    /// The configuration's table row.
    pub fn get(self) -> &'static FsdpConfig {
        &fsdp_configs()[self.0]
    }
}

/// A parallel configuration the matrix knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Config {
    /// One process, every rank's batch, mean of the per-rank losses.
    Single,
    /// DistributedDataParallel over the CPU backend.
    Ddp,
    /// DDP under a mixed-precision policy: the reference of the FSDP configurations under
    /// the same policy.
    DdpMixed(Precision),
    /// One row of the FSDP table.
    Fsdp(FsdpId),
}

impl Config {
    /// Every configuration, in the order rows are listed.
    pub fn all() -> Vec<Config> {
        let mut all = vec![Config::Single, Config::Ddp];
        all.extend(Precision::ALL.map(Config::DdpMixed));
        all.extend(Config::fsdp());
        all
    }

    /// The FSDP configurations, in row order.
    pub fn fsdp() -> Vec<Config> {
        (0..fsdp_configs().len())
            .map(|i| Config::Fsdp(FsdpId(i)))
            .collect()
    }

    /// The configuration called `name` exactly, if any.
    pub fn by_name(name: &str) -> Option<Config> {
        Config::all().into_iter().find(|c| c.name() == name)
    }

    /// The name patterns and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Config::Single => "single",
            Config::Ddp => "ddp",
            Config::DdpMixed(p) => p.ddp_name(),
            Config::Fsdp(id) => id.get().name,
        }
    }

    /// The mixed-precision policy it trains under (`None`: fp32).
    pub fn precision(self) -> Option<Precision> {
        match self {
            Config::Single | Config::Ddp => None,
            Config::DdpMixed(p) => Some(p),
            Config::Fsdp(id) => id.get().precision,
        }
    }

    /// The DDP configuration an FSDP configuration is compared against (`ddp`, `ddp.bf16`,
    /// ...); `None` for the others.
    pub fn ddp_reference(self) -> Option<Config> {
        self.fsdp_config().map(FsdpConfig::ddp_reference)
    }

    /// Whether this is one of the FSDP configurations.
    pub fn is_fsdp(self) -> bool {
        matches!(self, Config::Fsdp(_))
    }

    /// The FSDP table row (`None` for single and DDP).
    pub fn fsdp_config(self) -> Option<&'static FsdpConfig> {
        match self {
            Config::Fsdp(id) => Some(id.get()),
            Config::Single | Config::Ddp | Config::DdpMixed(_) => None,
        }
    }

    /// The FSDP options this configuration runs with (`None` for single and DDP).
    pub fn fsdp_options(self) -> Option<FsdpOptions> {
        self.fsdp_config().map(|f| f.options.clone())
    }

    /// One line for `--list`: what runs, and what it is checked against (derived from the
    /// reference policy, so the two cannot disagree).
    pub fn description(self) -> String {
        match self {
            Config::Single => "single-device reference: one process trains on every rank's \
                               batch (the global batch); checked against a repeat of itself, \
                               bitwise"
                .into(),
            Config::Ddp => "DDP on the CPU backend, one forked process per rank; checked \
                            against single (fp32 dtype table) and a fresh repeat of itself \
                            (bitwise)"
                .into(),
            Config::DdpMixed(p) => format!(
                "DDP under the {label} mixed-precision policy ({label} compute, fp32 reduction \
                 and buffers, BatchNorm in fp32), one forked process per rank: the reference of \
                 the {label} FSDP configs; checked against a fresh repeat of itself (bitwise), \
                 not against single (mixed precision)",
                label = p.label()
            ),
            Config::Fsdp(id) => {
                let f = id.get();
                let reference = f.ddp_reference().name();
                let vs_ddp = match f.vs_ddp {
                    DdpCheck::Bitwise => format!("{reference} (bitwise)"),
                    DdpCheck::DtypeTable { .. } => {
                        format!("{reference} (fp32 dtype table, a recorded tolerance override)")
                    }
                };
                match f.precision {
                    None => format!(
                        "{}; checked against {vs_ddp} and single (fp32 dtype table)",
                        f.description
                    ),
                    Some(_) => format!(
                        "{}; checked against {vs_ddp}, not against single (mixed precision)",
                        f.description
                    ),
                }
            }
        }
    }

    /// The row name at a world size (`ddp@4`): unique per world size in the report.
    pub fn at(self, world_size: usize) -> String {
        format!("{}@{world_size}", self.name())
    }

    /// Why this configuration cannot run `model`, if it cannot.
    fn blocker(self, model: &dyn Model) -> Option<String> {
        match self {
            Config::Single => model.single_device_reference_blocker(),
            _ => None,
        }
    }

    /// Why this configuration cannot run at `world_size` (hybrid shard at an odd size), if
    /// it cannot: its rows are skipped with this reason and nothing is launched.
    pub fn world_blocker(self, world_size: usize) -> Option<String> {
        self.fsdp_config()
            .and_then(|f| f.layout.shard_size(world_size).err())
    }

    /// The policy against `reference` at `world_size`: bitwise against a repeat of itself
    /// or against DDP (unless the FSDP row overrides it, with its reason), the fp32 dtype
    /// table against the single-device reference, and no policy for mixed precision against
    /// the single-device reference (the matrix has no such row). Records hold fp32 masters
    /// and fp32 gradients under every policy, so bitwise is over fp32 values.
    fn policy(self, reference: Config, world_size: usize) -> Result<TolerancePolicy, String> {
        match (self, reference) {
            (_, Config::Single) if self.precision().is_some() => Err(format!(
                "{} is not compared with single: {MIXED_VS_SINGLE_REASON}",
                self.name()
            )),
            (_, Config::Single) if self != Config::Single => {
                Ok(TolerancePolicy::dtype_table(DType::F32))
            }
            (Config::Fsdp(id), Config::Ddp | Config::DdpMixed(_)) => {
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                match id.get().vs_ddp {
                    DdpCheck::Bitwise => Ok(bitwise),
                    // Only fp32 configurations override (hybrid shard), so the fp32 row of
                    // the table is the tolerance for every quantity.
                    DdpCheck::DtypeTable { reason } => {
                        let ov = Override::new(Tolerance::for_dtype(DType::F32), reason)
                            .map_err(|e| format!("{}: {e}", self.name()))?;
                        Ok(bitwise.with_override(&self.at(world_size), ov))
                    }
                }
            }
            _ => Ok(TolerancePolicy::bitwise(DType::F32)),
        }
    }
}

/// What the user asked for; [`plan`] validates it.
#[derive(Clone, Debug)]
pub struct MatrixOptions {
    /// Model name patterns (exact or with `*`); empty means every zoo model.
    pub models: Vec<String>,
    /// Configuration name patterns; empty means every configuration.
    pub configs: Vec<String>,
    /// World sizes; empty means [`DEFAULT_WORLD_SIZE`].
    pub world_sizes: Vec<usize>,
    /// Training steps per run.
    pub steps: usize,
    /// The run seed every model and batch derives from.
    pub seed: u64,
    /// Longest one launch may take before it is declared hung.
    pub timeout: Duration,
    /// Record per-step gradients, so a failure names the first step and tensor that drifted
    /// (not just the final parameters).
    pub record_grads: bool,
    /// A bug planted in every DDP run, to show the matrix catches it (checker tests only).
    pub fault: Option<Fault>,
}

impl Default for MatrixOptions {
    fn default() -> Self {
        MatrixOptions {
            models: Vec::new(),
            configs: Vec::new(),
            world_sizes: Vec::new(),
            steps: 5,
            seed: 0,
            timeout: Duration::from_secs(300),
            record_grads: true,
            fault: None,
        }
    }
}

/// A validated matrix: what will run, in order.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Selected zoo models, in zoo order.
    pub models: Vec<String>,
    /// Selected configurations under test, in [`Config::all`] order.
    pub configs: Vec<Config>,
    /// World sizes, in the order given (duplicates dropped).
    pub world_sizes: Vec<usize>,
    /// Steps per run.
    pub steps: usize,
    /// Run seed.
    pub seed: u64,
    /// Per-launch timeout.
    pub timeout: Duration,
    /// Whether runs record per-step gradients.
    pub record_grads: bool,
    /// The planted bug every DDP run carries, if any.
    pub fault: Option<Fault>,
    /// Per model: why it has no single-device reference, if it has none.
    blockers: Vec<Option<String>>,
}

impl Plan {
    /// How many training runs the plan performs (single-device ones included).
    pub fn run_count(&self) -> usize {
        let mut n = 0;
        for model in 0..self.models.len() {
            for &world in &self.world_sizes {
                let references: usize = self
                    .runs_per_cell(model, world)
                    .iter()
                    .map(|(_, runs)| runs)
                    .sum();
                n += references + self.fsdp_launches(world).len();
            }
        }
        n
    }

    /// The selected FSDP configurations that run at `world_size`, in row
    /// order.
    fn fsdp_launches(&self, world_size: usize) -> Vec<Config> {
        self.configs
            .iter()
            .copied()
            .filter(|&c| c.is_fsdp() && c.world_blocker(world_size).is_none())
            .collect()
    }

    /// The reference runs for model `model` at one world size, in run order: (configuration,
    /// runs) for `single`, `ddp` and each `ddp.<label>`, those with no run left out. A
    /// selected reference runs twice (its own row checks the repeat); one that is not
    /// selected runs once if a selected configuration needs it: `single` for `ddp` and the
    /// fp32 FSDP launches (if the model has a single-device reference), `ddp` and
    /// `ddp.<label>` for the FSDP launches under that precision. FSDP launches come on top,
    /// one per selected FSDP configuration that runs at this size; a configuration that
    /// launches nothing there needs no reference.
    fn runs_per_cell(&self, model: usize, world_size: usize) -> Vec<(Config, usize)> {
        let has_single = self.blockers[model].is_none();
        let launches = self.fsdp_launches(world_size);
        let runs = |config: Config, needed: bool| {
            if self.configs.contains(&config) {
                2
            } else {
                usize::from(needed)
            }
        };
        let needs_ddp = |reference: Config| {
            launches
                .iter()
                .any(|c| c.ddp_reference() == Some(reference))
        };
        let needs_single =
            self.configs.contains(&Config::Ddp) || launches.iter().any(|c| c.precision().is_none());
        let mut cell = vec![
            (
                Config::Single,
                if has_single {
                    runs(Config::Single, needs_single)
                } else {
                    0
                },
            ),
            (Config::Ddp, runs(Config::Ddp, needs_ddp(Config::Ddp))),
        ];
        for p in Precision::ALL {
            let ddp = Config::DdpMixed(p);
            cell.push((ddp, runs(ddp, needs_ddp(ddp))));
        }
        cell.retain(|&(_, n)| n > 0);
        cell
    }
}

/// Whether `name` matches `pattern`: exact, or with `*` standing for any run of characters
/// (`ddp*`, `*moe`, `*`).
pub fn matches(pattern: &str, name: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == name;
    };
    let Some(mut tail) = name.strip_prefix(head) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    let Some((last, middle)) = parts.split_last() else {
        return true;
    };
    for part in middle {
        match tail.find(part) {
            Some(i) => tail = &tail[i + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

/// The items of `known` selected by `patterns` (all of them for no pattern), in `known`'s
/// order; the first pattern that selects nothing is returned as the error.
fn select<'a>(patterns: &[String], known: &[&'a str]) -> Result<Vec<&'a str>, String> {
    let patterns: Vec<&str> = patterns
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if patterns.is_empty() {
        return Ok(known.to_vec());
    }
    for p in &patterns {
        if !known.iter().any(|k| matches(p, k)) {
            return Err((*p).to_owned());
        }
    }
    Ok(known
        .iter()
        .copied()
        .filter(|k| patterns.iter().any(|p| matches(p, k)))
        .collect())
}

/// Validates `opts` against the zoo: names, world sizes and steps. Builds each selected model
/// once (to learn whether it has a single-device reference and that it accepts the largest
/// rank of every world size); runs nothing.
pub fn plan(opts: &MatrixOptions) -> Result<Plan, MatrixError> {
    let zoo_names = zoo::names();
    let models = select(&opts.models, &zoo_names).map_err(|pattern| MatrixError::UnknownModel {
        pattern,
        known: zoo_names.iter().map(|s| (*s).to_owned()).collect(),
    })?;
    let all_configs = Config::all();
    let config_names: Vec<&str> = all_configs.iter().map(|c| c.name()).collect();
    let selected =
        select(&opts.configs, &config_names).map_err(|pattern| MatrixError::UnknownConfig {
            pattern,
            known: config_names.iter().map(|s| (*s).to_owned()).collect(),
        })?;
    let configs: Vec<Config> = all_configs
        .into_iter()
        .filter(|c| selected.contains(&c.name()))
        .collect();
    let mut world_sizes = Vec::new();
    for &w in if opts.world_sizes.is_empty() {
        &[DEFAULT_WORLD_SIZE][..]
    } else {
        &opts.world_sizes[..]
    } {
        if w == 0 {
            return Err(MatrixError::InvalidWorldSize {
                world_size: 0,
                reason: "a run needs at least one rank".into(),
            });
        }
        if w > MAX_WORLD_SIZE {
            return Err(MatrixError::InvalidWorldSize {
                world_size: w,
                reason: format!(
                    "ranks are processes on this host; at most {MAX_WORLD_SIZE} are supported"
                ),
            });
        }
        if !world_sizes.contains(&w) {
            world_sizes.push(w);
        }
    }
    if opts.steps == 0 {
        return Err(MatrixError::InvalidOption(
            "--steps must be at least 1".into(),
        ));
    }
    if opts.timeout.is_zero() {
        return Err(MatrixError::InvalidOption(
            "--timeout must be positive".into(),
        ));
    }
    let mut blockers = Vec::with_capacity(models.len());
    for name in &models {
        let model = zoo::build(name, opts.seed, 0)?;
        for &w in &world_sizes {
            // Every rank of the run must get a batch; a model that cannot serve rank w-1
            // cannot run at world size w.
            let last = zoo::build(name, opts.seed, w - 1)?;
            if let Err(e) = last.input(w - 1, 0) {
                return Err(MatrixError::InvalidWorldSize {
                    world_size: w,
                    reason: format!("model `{name}` cannot run on {w} ranks: {e}"),
                });
            }
        }
        blockers.push(Config::Single.blocker(model.as_ref()));
    }
    Ok(Plan {
        models: models.into_iter().map(str::to_owned).collect(),
        configs,
        world_sizes,
        steps: opts.steps,
        seed: opts.seed,
        timeout: opts.timeout,
        record_grads: opts.record_grads,
        fault: opts.fault.clone(),
        blockers,
    })
}

/// Creates `dir` and proves it writable with a probe file, before any run starts, and
/// removes report files a previous matrix left there (so none can pass for this run's).
pub fn prepare_out_dir(dir: &Path) -> Result<(), MatrixError> {
    let err = |source| MatrixError::OutDir {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let probe = dir.join(format!(".lockstep-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(err)?;
    std::fs::remove_file(&probe).map_err(err)?;
    for name in REPORT_FILES {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(())
}

/// How one row of the matrix ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RowStatus {
    /// The comparison passed.
    Pass,
    /// The comparison failed: the numbers differ beyond what the policy allows.
    Fail,
    /// Not applicable to this model (the reason says why).
    Skip,
    /// A run it needed failed, so nothing was compared.
    Error,
}

impl RowStatus {
    fn label(self) -> &'static str {
        match self {
            RowStatus::Pass => "PASS",
            RowStatus::Fail => "FAIL",
            RowStatus::Skip => "skip",
            RowStatus::Error => "ERROR",
        }
    }
}

/// One line of the summary: a configuration against one reference.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Zoo model.
    pub model: String,
    /// The configuration under test at its world size (`ddp@4`).
    pub config: String,
    /// The reference configuration (`single@4`, `ddp@4`).
    pub reference: String,
    /// Ranks of the run.
    pub world_size: usize,
    /// Verdict.
    pub status: RowStatus,
    /// `tolerance` or `bitwise`.
    pub mode: &'static str,
    /// Largest absolute error over every compared quantity.
    #[serde(with = "report::num::opt")]
    pub max_abs_err: Option<f64>,
    /// Largest ULP distance over every compared quantity.
    pub max_ulp: Option<u64>,
    /// Largest error / allowed error (at most 1 passes).
    #[serde(with = "report::num::opt")]
    pub margin: Option<f64>,
    /// The run's memory figures (rank 0's): FSDP's measured full-parameter peak and shard
    /// bytes; for DDP the whole model's parameter bytes, which every rank keeps. `None` for
    /// the single-device reference and for runs that did not finish.
    pub memory: Option<MemoryStats>,
    /// Where it first failed, why it was skipped, or why a run failed; a tolerance override
    /// in force is named here with its reason.
    pub note: Option<String>,
    /// For `Error` rows: the launcher's whole account of the failed run (the failing rank's
    /// message and stderr; on a timeout every rank's flight recorder and the desync
    /// diagnosis).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
}

/// A run that did not produce a record: one line for the table, the whole story for the
/// reports.
#[derive(Clone, Debug)]
pub struct RunFailed {
    /// What failed, in one line.
    pub line: String,
    /// Everything the launcher reported.
    pub details: String,
    /// Whether the run outlived its timeout (a hang), rather than failing.
    pub timed_out: bool,
}

impl RunFailed {
    fn simple(text: impl Into<String>) -> Self {
        let line = text.into();
        RunFailed {
            details: line.clone(),
            line,
            timed_out: false,
        }
    }
}

/// Everything a finished matrix produced.
#[derive(Debug)]
pub struct MatrixResult {
    /// One row per model × config × reference × world size, in run order.
    pub rows: Vec<Row>,
    /// The comparisons behind the `Pass`/`Fail` rows, in row order.
    pub comparisons: Vec<Comparison>,
    /// Training runs performed (single-device and DDP launches).
    pub runs: usize,
    /// Runs that failed (hung ones included).
    pub failed_runs: usize,
    /// Runs that outlived the timeout.
    pub hung_runs: usize,
    /// Measured wall time of the whole matrix.
    pub elapsed: Duration,
}

impl MatrixResult {
    /// Whether every run completed and every comparison passed.
    pub fn passed(&self) -> bool {
        self.failed_runs == 0 && self.rows.iter().all(|r| r.status != RowStatus::Fail)
    }

    /// The report over every comparison, with the matrix's wall time. Rows whose runs
    /// failed are the report's errors (with the launcher's whole account), which mark it
    /// incomplete: it is written all the same, and never looks complete.
    pub fn report(&self) -> Report {
        let errors = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Error)
            .map(|r| RunError {
                model: r.model.clone(),
                config: r.config.clone(),
                reference: r.reference.clone(),
                message: r.note.clone().unwrap_or_else(|| "run failed".into()),
                details: r
                    .details
                    .clone()
                    .or_else(|| r.note.clone())
                    .unwrap_or_default(),
            })
            .collect();
        Report::new(self.comparisons.clone())
            .with_wall_time(self.elapsed)
            .with_errors(errors)
    }

    /// Writes the report set (`report.json` last) into `dir`; see [`MatrixResult::report`].
    pub fn write_report(&self, dir: &Path) -> Result<ReportFiles, MatrixError> {
        Ok(report::write_all(&self.report(), dir)?)
    }

    /// The summary table, followed by the reasons it refers to (models without a
    /// single-device reference, tolerance overrides), the diagnosis of every failed row and
    /// the total time. Memory columns are KiB of rank 0's full parameters at their peak and
    /// of its shards (DDP: the whole model, kept on every rank).
    pub fn render_table(&self) -> String {
        const NOTE: usize = 10;
        let headers = [
            "model",
            "config",
            "reference",
            "world",
            "result",
            "max abs err",
            "max ULP",
            "margin",
            "peak params KiB",
            "shard KiB",
            "first failure / note",
        ];
        let kib =
            |bytes: Option<u64>| bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1024.0));
        let cells: Vec<[String; 11]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.model.clone(),
                    r.config.clone(),
                    r.reference.clone(),
                    r.world_size.to_string(),
                    r.status.label().to_owned(),
                    r.max_abs_err.map_or("-".into(), fmt_num),
                    r.max_ulp.map_or("-".into(), fmt_ulp),
                    r.margin.map_or("-".into(), fmt_num),
                    kib(r.memory.map(|m| m.full_param_bytes_peak)),
                    kib(r.memory.map(|m| m.shard_bytes)),
                    match (&r.status, &r.note) {
                        // The model's reason is a sentence: printed once below the table.
                        (RowStatus::Skip, Some(n)) if n.starts_with(NO_SINGLE) => {
                            format!("{NO_SINGLE} (see below)")
                        }
                        // So is an override's reason.
                        (_, Some(n)) if n.contains(OVERRIDE) => {
                            let at = n.find(OVERRIDE).unwrap_or(0);
                            format!("{}{OVERRIDE} (see below)", &n[..at])
                        }
                        (_, note) => note.clone().unwrap_or_default(),
                    },
                ]
            })
            .collect();
        let mut widths = headers.map(str::len);
        for row in &cells {
            for (w, c) in widths.iter_mut().zip(row.iter()).take(NOTE) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, row: &[&str]| {
            let mut text = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i == NOTE {
                    text.push_str(cell);
                } else if (3..NOTE).contains(&i) && i != 4 {
                    let _ = write!(text, "{cell:>w$}  ", w = widths[i]);
                } else {
                    let _ = write!(text, "{cell:<w$}  ", w = widths[i]);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&mut out, &headers);
        for row in &cells {
            let refs: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&mut out, &refs);
        }
        // Each model's reason once per kind of skip.
        let mut explained: Vec<(&str, &str)> = Vec::new();
        for r in &self.rows {
            let (RowStatus::Skip, Some(note)) = (r.status, &r.note) else {
                continue;
            };
            for kind in [NO_SINGLE] {
                if note.starts_with(kind) && !explained.contains(&(r.model.as_str(), kind)) {
                    explained.push((&r.model, kind));
                    let _ = writeln!(out, "\nskipped: model `{}` has {note}", r.model);
                }
            }
        }
        // Each override reason once, with the configurations (without `@N`) it governs.
        let mut overrides: Vec<(&str, Vec<String>)> = Vec::new();
        for c in &self.comparisons {
            let Some(reason) = c.override_reason.as_deref() else {
                continue;
            };
            let base = |name: &str| name.rsplit_once('@').map_or(name, |(b, _)| b).to_owned();
            let pair = format!("{} vs {}", base(&c.config), base(&c.reference));
            match overrides.iter_mut().find(|(r, _)| *r == reason) {
                Some((_, pairs)) if !pairs.contains(&pair) => pairs.push(pair),
                Some(_) => {}
                None => overrides.push((reason, vec![pair])),
            }
        }
        for (reason, pairs) in overrides {
            let _ = writeln!(out, "\n{OVERRIDE} ({}): {reason}", pairs.join(", "));
        }
        for c in self.comparisons.iter().filter(|c| !c.passed) {
            let _ = writeln!(
                out,
                "\nFAIL {} {} vs {}: {}",
                c.model,
                c.config,
                c.reference,
                c.diagnosis.as_deref().unwrap_or("(no diagnosis)")
            );
        }
        // Each failed run's whole account once (a run serves several rows).
        let mut told: Vec<&str> = Vec::new();
        for r in self.rows.iter().filter(|r| r.status == RowStatus::Error) {
            let details = r.details.as_deref().or(r.note.as_deref()).unwrap_or("");
            if told.contains(&details) {
                continue;
            }
            told.push(details);
            let _ = writeln!(out, "\nERROR {} {} vs {}:", r.model, r.config, r.reference);
            for l in details.lines() {
                let _ = writeln!(out, "  {l}");
            }
        }
        let passed = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Pass)
            .count();
        let failed = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Fail)
            .count();
        let skipped = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Skip)
            .count();
        let _ = writeln!(
            out,
            "\n{passed} passed, {failed} failed, {skipped} skipped, {} run errors",
            self.failed_runs
        );
        let _ = writeln!(
            out,
            "matrix: {} runs in {:.1} s",
            self.runs,
            self.elapsed.as_secs_f64()
        );
        out
    }
}

fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.2e}")
    } else {
        format!("{x}")
    }
}

fn fmt_ulp(u: u64) -> String {
    if u == u64::MAX {
        "NaN".into()
    } else {
        u.to_string()
    }
}

/// A short "where" for the table: quantity, tensor and step of the first failure.
fn short_failure(f: &FailurePoint) -> String {
    let mut s = f.quantity.to_string();
    if let Some(t) = &f.tensor {
        let _ = write!(s, " {t}");
    }
    if let Some(i) = f.index {
        let _ = write!(s, "[{i}]");
    }
    match f.step {
        Some(step) => {
            let _ = write!(s, " @ step {step}");
        }
        None => s.push_str(" (final)"),
    }
    s
}

/// The progress bar the CLI shows on stderr: drawn only on a terminal and only from this
/// thread (no ticker thread, so a forked rank never inherits a lock held by one).
pub fn progress_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed:>4} [{bar:30.cyan/blue}] {pos}/{len} runs  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Tracks runs for the progress display; prints one line per run when stderr is no
/// terminal (CI logs), where the bar is hidden.
struct Progress<'a> {
    bar: &'a ProgressBar,
    done: usize,
    total: usize,
    /// Print a line per run where the bar is hidden (CI logs); off for repeated runs.
    log_runs: bool,
}

impl Progress<'_> {
    fn start(&self, label: &str) {
        self.bar.set_message(label.to_owned());
    }

    fn finish(&mut self, label: &str, took: Duration, error: Option<&str>) {
        self.done += 1;
        self.bar.inc(1);
        if self.log_runs && self.bar.is_hidden() {
            let status = error.map_or("ok".to_owned(), |e| format!("FAILED: {e}"));
            eprintln!(
                "[{}/{}] {label}: {:.2} s {status}",
                self.done,
                self.total,
                took.as_secs_f64()
            );
        }
    }
}

/// Runs the plan: per model and world size the references the selected configurations need
/// (`Plan::runs_per_cell`: the single-device reference in process, fresh DDP launches fp32
/// and per mixed-precision policy), the FSDP launches, then the comparisons. Run
/// failures become `Error` rows; the matrix always finishes.
///
/// libtorch is set to one intra-op thread in this process: forked ranks must not inherit an
/// OpenMP pool, and the zoo's models are too small to gain from more.
pub fn run(plan: &Plan, bar: &ProgressBar) -> MatrixResult {
    run_logged(plan, bar, true)
}

/// [`run`] with no progress output at all (for callers that repeat a matrix and report per
/// repetition, like `lockstep stress`).
pub fn run_quietly(plan: &Plan) -> MatrixResult {
    run_logged(plan, &ProgressBar::hidden(), false)
}

fn run_logged(plan: &Plan, bar: &ProgressBar, log_runs: bool) -> MatrixResult {
    tch::set_num_threads(1);
    let started = Instant::now();
    let mut progress = Progress {
        bar,
        done: 0,
        total: plan.run_count(),
        log_runs,
    };
    let mut result = MatrixResult {
        rows: Vec::new(),
        comparisons: Vec::new(),
        runs: 0,
        failed_runs: 0,
        hung_runs: 0,
        elapsed: Duration::ZERO,
    };
    for (m, (model, blocker)) in plan.models.iter().zip(&plan.blockers).enumerate() {
        for &world in &plan.world_sizes {
            let mut run_one = |config: Config, attempt: usize, of: usize| {
                let label = if of > 1 {
                    format!("{model} {} (run {attempt}/{of})", config.at(world))
                } else {
                    format!("{model} {}", config.at(world))
                };
                progress.start(&label);
                let t0 = Instant::now();
                let outcome = match config {
                    Config::Single => run_single(model, world, plan),
                    _ => run_parallel(model, config, world, plan),
                };
                result.runs += 1;
                let err = outcome.as_ref().err().map(|e| e.line.as_str());
                if err.is_some() {
                    result.failed_runs += 1;
                }
                if outcome.as_ref().is_err_and(|e| e.timed_out) {
                    result.hung_runs += 1;
                }
                progress.finish(&label, t0.elapsed(), err);
                outcome
            };
            let references: Vec<(Config, Vec<Result<RunRecord, RunFailed>>)> = plan
                .runs_per_cell(m, world)
                .into_iter()
                .map(|(c, n)| (c, (1..=n).map(|i| run_one(c, i, n)).collect()))
                .collect();
            let fsdp: Vec<(Config, Result<RunRecord, RunFailed>)> = plan
                .fsdp_launches(world)
                .into_iter()
                .map(|c| (c, run_one(c, 1, 1)))
                .collect();
            let mut row =
                |config: Config,
                 reference: Config,
                 run: Option<&Result<RunRecord, RunFailed>>,
                 against: Option<&Result<RunRecord, RunFailed>>| {
                    let policy = config.policy(reference, world);
                    let overridden = policy
                        .as_ref()
                        .ok()
                        .and_then(|p| p.override_for(&config.at(world)))
                        .map(|o| o.reason().to_owned());
                    let mut r = Row {
                        model: model.clone(),
                        config: config.at(world),
                        reference: reference.at(world),
                        world_size: world,
                        status: RowStatus::Skip,
                        mode: match (&policy, &overridden) {
                            (Ok(p), None) if p.mode() == Mode::Bitwise => "bitwise",
                            _ => "tolerance",
                        },
                        max_abs_err: None,
                        max_ulp: None,
                        margin: None,
                        memory: run.and_then(|r| r.as_ref().ok()).and_then(|r| r.memory),
                        note: None,
                        details: None,
                    };
                    match (config.world_blocker(world), run, against, policy) {
                        (Some(reason), _, _, _) => r.note = Some(reason),
                        (None, Some(Ok(a)), Some(Ok(b)), Ok(policy)) => {
                            let c = compare(a, b, &policy);
                            let overall = c.overall();
                            r.status = if c.passed {
                                RowStatus::Pass
                            } else {
                                RowStatus::Fail
                            };
                            r.max_abs_err = Some(overall.max_abs_err);
                            r.max_ulp = Some(overall.max_ulp);
                            r.margin = Some(overall.margin);
                            let found = match (&c.first_failure, c.structural.first()) {
                                (Some(f), _) => Some(short_failure(f)),
                                (None, Some(s)) => Some(s.clone()),
                                (None, None) => None,
                            };
                            r.note = match (found, &c.override_reason) {
                                (Some(f), Some(o)) => Some(format!("{f}; {OVERRIDE}: {o}")),
                                (None, Some(o)) => Some(format!("{OVERRIDE}: {o}")),
                                (found, None) => found,
                            };
                            result.comparisons.push(c);
                        }
                        (None, Some(Err(e)), _, _) | (None, _, Some(Err(e)), _) => {
                            r.status = RowStatus::Error;
                            r.note = Some(e.line.clone());
                            r.details = Some(e.details.clone());
                        }
                        (None, Some(Ok(_)), Some(Ok(_)), Err(e)) => {
                            r.status = RowStatus::Error;
                            r.note = Some(e);
                        }
                        (None, _, _, _) => {
                            r.note = Some(match blocker {
                                Some(reason) => format!("{NO_SINGLE}: {reason}"),
                                None => "not run".into(),
                            });
                        }
                    }
                    result.rows.push(r);
                };
            // The `i`-th run of reference `config` (0: the reference, 1: its repeat).
            let reference = |config: Config, i: usize| {
                references
                    .iter()
                    .find(|(c, _)| *c == config)
                    .and_then(|(_, runs)| runs.get(i))
            };
            for &config in &plan.configs {
                match config {
                    Config::Single | Config::DdpMixed(_) => {
                        row(config, config, reference(config, 0), reference(config, 1));
                    }
                    Config::Ddp => {
                        let ddp = reference(Config::Ddp, 0);
                        row(config, Config::Single, ddp, reference(Config::Single, 0));
                        row(config, config, ddp, reference(Config::Ddp, 1));
                    }
                    Config::Fsdp(id) => {
                        let run = fsdp.iter().find(|(c, _)| *c == config).map(|(_, r)| r);
                        let ddp = id.get().ddp_reference();
                        row(config, ddp, run, reference(ddp, 0));
                        // Mixed precision has no row against single (module doc).
                        if config.precision().is_none() {
                            row(config, Config::Single, run, reference(Config::Single, 0));
                        }
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    result.elapsed = started.elapsed();
    result
}

fn spec(model: &str, config: Config, world_size: usize, plan: &Plan) -> RunSpec {
    RunSpec {
        model: model.to_owned(),
        config: config.at(world_size),
        world_size,
        backend: match config {
            Config::Single => "none".into(),
            _ => "cpu".into(),
        },
        dtype: config.precision().map_or("fp32", Precision::label).into(),
        steps: plan.steps,
        seed: plan.seed,
    }
}

/// The single-device reference over `world_size` ranks' batches, in this process.
fn run_single(model: &str, world_size: usize, plan: &Plan) -> Result<RunRecord, RunFailed> {
    let built = zoo::build(model, plan.seed, 0).map_err(|e| RunFailed::simple(e.to_string()))?;
    let mut record = single_device_reference(
        built.as_ref(),
        world_size,
        plan.steps,
        OptimizerConfig::default(),
        plan.record_grads,
    )
    .map_err(|e| RunFailed::simple(format!("single-device reference: {e}")))?;
    record.spec = spec(model, Config::Single, world_size, plan);
    Ok(record)
}

/// One fresh DDP or FSDP launch; rank 0's record comes back through a temporary JSON file.
/// The planted fault (if any) goes into DDP runs only (mixed precision included): FSDP runs
/// are checked against DDP.
fn run_parallel(
    model: &str,
    config: Config,
    world_size: usize,
    plan: &Plan,
) -> Result<RunRecord, RunFailed> {
    let out = scratch_path(model, world_size);
    let cfg_spec = spec(model, config, world_size, plan);
    let body = |ctx: &RankCtx| -> Result<(), String> {
        let rank = ctx.rank();
        let built = zoo::build(model, plan.seed, rank).map_err(|e| e.to_string())?;
        let cfg = TrainConfig {
            spec: cfg_spec.clone(),
            optimizer: OptimizerConfig::default(),
            data_ranks: vec![rank],
            record_grads: plan.record_grads,
        };
        let record = match config.fsdp_config() {
            Some(f) => {
                let opts = f.options.clone();
                let fsdp = match f.layout.shard_size(world_size)? {
                    None => train_fsdp(built.as_ref(), ctx.group(), &cfg, opts),
                    Some(shard) => train_fsdp_hybrid(
                        built.as_ref(),
                        ctx.world(),
                        ctx.group(),
                        shard,
                        &cfg,
                        opts,
                    ),
                };
                fsdp.map_err(|e| format!("{}: {e}", config.name()))?
            }
            None => {
                let opts = DdpOptions {
                    fault: plan.fault.clone(),
                    mixed_precision: config.precision().map(Precision::policy),
                    ..DdpOptions::default()
                };
                let mut record = train_ddp(built.as_ref(), ctx.group(), &cfg, opts)
                    .map_err(|e| format!("{}: {e}", config.name()))?;
                record.memory = Some(replica_memory(built.as_ref()));
                record
            }
        };
        if rank == 0 {
            let json = serde_json::to_vec(&record).map_err(|e| format!("encoding record: {e}"))?;
            std::fs::write(&out, json)
                .map_err(|e| format!("writing the record to {}: {e}", out.display()))?;
        }
        Ok(())
    };
    let opts = LaunchOptions {
        world_size,
        timeout: plan.timeout,
        backend: "cpu".into(),
    };
    let launched = launch(
        &opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, &body)),
    );
    let read = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    launched.map_err(|e: LaunchError| {
        let details = e.to_string();
        RunFailed {
            line: one_line(&details),
            details,
            timed_out: matches!(e, LaunchError::Timeout(_)),
        }
    })?;
    let bytes = read.map_err(|e| RunFailed::simple(format!("reading rank 0's record: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        RunFailed::simple(format!("rank 0's record is unreadable ({e}); a non-finite value (a diverged run) cannot be carried in RunRecord JSON"))
    })
}

/// DDP's memory figures, for scale next to FSDP's: every rank keeps the whole model's
/// parameters all the time, so peak and "shard" are both the model's parameter bytes (tied
/// parameters once; rank-local experts included, which FSDP ignores and does not count).
fn replica_memory(model: &dyn Model) -> MemoryStats {
    let bytes: u64 = distinct_parameters(model.named_parameters())
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum();
    MemoryStats {
        full_param_bytes_peak: bytes,
        shard_bytes: bytes,
        model_param_bytes: bytes,
    }
}

/// The launcher's failure report runs over many lines; the table gets its first one and the
/// first line naming a rank's message.
fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("launch failed").to_owned();
    match lines.find(|l| l.contains("failed") || l.contains("error")) {
        Some(detail) if detail != first => format!("{first} {detail}"),
        _ => first,
    }
}

fn scratch_path(model: &str, world_size: usize) -> PathBuf {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "lockstep-matrix-{}-{model}-{world_size}-{nonce:x}.json",
        std::process::id()
    ))
}

/// The `--list` text: every configuration with the models it applies to, then the models.
pub fn render_list(seed: u64) -> Result<String, MatrixError> {
    let mut models = Vec::new();
    for name in zoo::names() {
        let m = zoo::build(name, seed, 0)?;
        models.push((
            name,
            m.num_parameters(),
            m.single_device_reference_blocker(),
        ));
    }
    let configs = Config::all();
    let width = configs.iter().map(|c| c.name().len()).max().unwrap_or(0) + 2;
    let mut out = String::from("configs:\n");
    for &c in &configs {
        let applies: Vec<&str> = models
            .iter()
            .filter(|(_, _, single)| match c {
                Config::Single => single.is_none(),
                _ => true,
            })
            .map(|(n, _, _)| *n)
            .collect();
        let _ = writeln!(out, "  {:<width$}{}", c.name(), c.description());
        let _ = writeln!(out, "  {:<width$}models: {}", "", applies.join(", "));
        if let Some(FsdpLayout::Hybrid { replicas }) = c.fsdp_config().map(|f| f.layout) {
            let _ = writeln!(
                out,
                "  {:<width$}world sizes: multiples of {replicas} ({replicas} replicas of N/{replicas} \
                 ranks; other sizes are skipped)",
                ""
            );
        }
        if let Some(DdpCheck::DtypeTable { reason }) = c.fsdp_config().map(|f| f.vs_ddp) {
            let _ = writeln!(out, "  {:<width$}override vs ddp: {reason}", "");
        }
    }
    let mixed: Vec<&str> = configs
        .iter()
        .filter(|c| c.precision().is_some())
        .map(|c| c.name())
        .collect();
    let _ = writeln!(
        out,
        "mixed precision ({}): not compared with single: {MIXED_VS_SINGLE_REASON}",
        mixed.join(", ")
    );
    out.push_str("models:\n");
    for (name, params, blocker) in &models {
        let note = match blocker {
            None => "single + ddp + fsdp".to_owned(),
            Some(reason) => format!("ddp + fsdp only (no single-device reference: {reason})"),
        };
        let _ = writeln!(out, "  {name:<16}{params:>8} params  {note}");
    }
    Ok(out)
}
