//! `lockstep bench`: communication, start-up, training-step and pipeline benchmarks. Speed
//! targets are measured here, never by timed assertions in tests.
//!
//! One file per concern: `comm` (collectives), `spawn` (launch + rendezvous), `gpt` (the
//! zoo decoder at the size the training benchmarks train), `step` (DDP against FSDP, tensor
//! or expert parallelism, steps and bytes) and `pipeline` (pipeline parallelism against one
//! process). This module holds what they share: the error type, the per-launch results file,
//! and the fork entry point.

mod comm;
mod gpt;
mod pipeline;
mod spawn;
mod step;
pub mod text;

pub use comm::{run_comm, BenchOp, CommBenchOptions, CommPoint};
pub use gpt::GptDims;
pub use pipeline::{run_pipeline, PipelineBenchOptions, PipelineBenchResult};
pub use spawn::{run_spawn, spawn_probe, SpawnBenchMode, SpawnResult, SPAWN_PROBE_COMMAND};
pub use step::{
    run_parallel_step, run_step, ParallelStepResult, ParallelStepRun, StepBenchOptions,
    StepParallel, StepResult,
};

use lockstep_core::comm::{ProcessGroup, ReduceOp};
use lockstep_core::CommError;
use lockstep_harness::{LaunchError, RankCtx};
use std::path::PathBuf;
use tch::Tensor;

/// Why a benchmark could not produce figures.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The options cannot describe a run (the CLI exits 2 on this: bad input, not a failure).
    #[error("invalid benchmark option: {0}")]
    Invalid(String),
    /// The run started but produced no usable figures.
    #[error("benchmark failed: {0}")]
    Failed(String),
    /// A benchmark rank failed (the launcher's report says which and how).
    #[error("benchmark ranks failed:\n{0}")]
    Launch(#[from] LaunchError),
    /// The ranks' result files could not be read.
    #[error("reading benchmark results: {0}")]
    Io(#[from] std::io::Error),
    /// A rank's result file is not the JSON it should be.
    #[error("parsing benchmark results: {0}")]
    Parse(#[from] serde_json::Error),
    /// Under an external launch, joining the run or a collective failed.
    #[error("benchmark rank: {0}")]
    Comm(#[from] CommError),
}

/// A forked rank's body run to its exit code (the harness's fork entry point).
fn rank_exit_code(
    info: lockstep_harness::RankInfo,
    body: &dyn Fn(&RankCtx) -> Result<(), CommError>,
) -> i32 {
    lockstep_harness::execute_forked_rank(info, body)
}

/// A fresh temporary file through which rank 0 hands its figures to the parent (forked ranks
/// share no memory with it).
fn results_path(what: &str) -> PathBuf {
    let nonce: u64 = rand_nonce();
    std::env::temp_dir().join(format!(
        "lockstep-bench-{what}-{}-{nonce:x}.jsonl",
        std::process::id()
    ))
}

/// Distinguishes result files of benchmarks started in the same process.
fn rand_nonce() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Agrees on one value across ranks: the maximum.
fn max_across(group: &dyn ProcessGroup, value: f64) -> Result<f64, CommError> {
    let t = Tensor::from_slice(&[value]);
    group.all_reduce(&t, ReduceOp::Max)?;
    Ok(t.double_value(&[0]))
}
