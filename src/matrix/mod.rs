//! `lockstep matrix`: every (model × parallel configuration × world size) the tool knows, run
//! on the CPU backend and judged against its references, with one report set at the end.
//!
//! Each selected configuration gets one row per judging edge of the catalog
//! ([`Config::edges`]: which references it is measured against, and how: its policy against a
//! repeat of itself or DDP, the fp64 arbiter against `single@N`, bitwise or the arbiter
//! against a pipeline's microbatched reference, and so on; `--list` prints every edge). The
//! why of each pairing is in docs/matrix.md; [`HYBRID_VS_DDP_REASON`] and
//! [`MIXED_VS_SINGLE_REASON`] are the two that `--list` spells out.
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
//! a flat fp32 FSDP launch, `ddp.hybrid_order` once for a hybrid one, `ddp.bf16` once for a bf16 FSDP launch (and so on per policy); a
//! selected reference runs twice, the second launch being its repeat. Models whose ranks
//! differ by construction (per-rank experts, BatchNorm statistics) have no single-device
//! reference; their rows against it are skipped with the model's own reason.
//!
//! Parallel runs are launched with [`RankSpawn::Fork`](lockstep_harness::RankSpawn::Fork) (the process never touches CUDA), rank
//! 0 hands its [`RunRecord`] back through a scratch file (CBOR, `/dev/shm` where it has room), and the single-device runs
//! happen in this process (under an external launch, torchrun or srun, each process is one
//! rank instead: records go through the store, rank 0 computes the references for every
//! rank, and a rank's failure stops the matrix on every rank: see [`crate::runner::external`]).
//! Nothing is written until every run is done, and stale report
//! files in the output directory are removed before the first run. A run that fails (a rank
//! error, crash or timeout) does not lose the matrix: its rows are `ERROR` with the
//! launcher's whole account (on a timeout every rank's flight recorder and the desync
//! diagnosis), and the report set is written with them as errors, marked incomplete
//! (`complete: false`, an INCOMPLETE headline, JUnit `<error>`s), so it never looks complete.

use crate::runner;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lockstep_core::pipeline::PipelinePlan;
use lockstep_core::record::{MemoryStats, RunRecord};
use lockstep_harness::parity::{
    compare, ArbiterLog, Comparison, FailurePoint, TolerancePolicy, ENVELOPE,
};
use lockstep_harness::report::{self, Report, ReportError, RunError};
use lockstep_models::{zoo, Model, ModelError};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// World size when none is given: four ranks exercise uneven reduction trees while still
/// fitting a small machine.
pub const DEFAULT_WORLD_SIZE: usize = 4;

/// How a row skipped for want of a single-device reference begins its note.
const NO_SINGLE: &str = "no single-device reference";

/// How a row note names the tolerance override in force (followed by `: reason`).
const OVERRIDE: &str = "tolerance override";

/// Where reports go unless `--out` says otherwise.
pub const DEFAULT_OUT_DIR: &str = "target/lockstep/matrix";

/// The files a matrix writes (and removes before running, so none is ever stale).
pub use lockstep_harness::report::REPORT_FILES;

/// Why a matrix could not be planned, run or written.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A `--models` pattern matched no zoo model.
    #[error("unknown model `{pattern}`{}; known models: {}", crate::suggest::did_you_mean(pattern, known), known.join(", "))]
    UnknownModel {
        /// The pattern as given.
        pattern: String,
        /// Every zoo model name, for the message.
        known: Vec<String>,
    },
    /// A `--configs` pattern matched no configuration.
    #[error("unknown config `{pattern}`{}; known configs: {}", crate::suggest::did_you_mean(pattern, known), known.join(", "))]
    UnknownConfig {
        /// The pattern as given.
        pattern: String,
        /// Every configuration name, for the message.
        known: Vec<String>,
    },
    /// A world size no run can use (0, too many ranks, or one the model rejects).
    #[error("invalid world size {world_size}: {reason}")]
    InvalidWorldSize {
        /// The world size asked for.
        world_size: usize,
        /// Why it cannot be used.
        reason: String,
    },
    /// Any other option out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// The backend or device cannot run here (`--backend nccl` without the feature or one
    /// GPU per rank, `--device cuda` without a GPU, a configuration that does not train on
    /// CUDA); nothing was run.
    #[error("{backend} cannot run this matrix here: {}", reasons.join("; "))]
    BackendUnavailable {
        /// What was asked for, as the message names it: `the nccl backend`, `--device cuda`.
        backend: &'static str,
        /// Every missing requirement, so one message lists them all.
        reasons: Vec<String>,
    },
    /// The output directory cannot be created or written; checked before anything runs.
    #[error("output directory {}: {source}", path.display())]
    OutDir {
        /// The output directory.
        path: PathBuf,
        /// The operating system's error.
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

mod backend;
mod cell_runs;
mod dropping;
mod execute;
mod judge;
mod list;
mod microbatched;
mod mixed;
mod needs;
mod plan;
mod result;
mod ring_ordered;
mod sensitivity;
mod summary;

use crate::configs::*;
pub use backend::*;
pub use dropping::dropping_reference;
use dropping::*;
pub use execute::*;
pub use list::*;
use microbatched::*;
use mixed::*;
pub use plan::*;
pub use result::*;
pub use sensitivity::*;
pub use summary::render_regressions;
