//! Lockstep's harness: run a test body on N ranks, one process each, like PyTorch's
//! `MultiProcessTestCase` but fast and explicit about failures.
//!
//! ```no_run
//! # use lockstep_core::comm::ReduceOp;
//! #[test]
//! fn sums_across_ranks() {
//!     lockstep_harness::run(4, |ctx| {
//!         let t = tch::Tensor::from_slice(&[ctx.rank() as f32]);
//!         ctx.group().all_reduce(&t, ReduceOp::Sum)?;
//!         assert_eq!(t.double_value(&[0]), 6.0);
//!         Ok::<(), lockstep_core::CommError>(())
//!     });
//! }
//! ```
//!
//! The test process becomes the launcher: it hosts the store and re-executes its own test
//! binary once per rank, filtered to this one test. Works under `cargo test` and
//! `cargo nextest run`. The first failing rank stops the run; the panic names the rank, its
//! message and its stderr tail; a hang times out (default 300 s) and prints every rank's
//! flight recorder.
#![warn(missing_docs)]

mod error;
pub mod launch;
pub mod parity;
mod rank;
pub mod report;
pub mod stress;
pub mod threads;

pub use error::{signal_name, FailureReport, LaunchError, RankEnd, RankReport};
pub use launch::{launch, LaunchOptions, LaunchSummary, RankCommand, RankInfo, RankSpawn};
pub use rank::{execute_forked_rank, rank_main, RankCtx, RankResult};

use std::time::Duration;

/// Default time a whole multi-rank test may take before it is declared hung.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// How a launched test ended when it did not fail.
#[derive(Debug)]
pub enum Outcome {
    /// Every rank succeeded.
    Passed(LaunchSummary),
    /// Not run, for the given reason (too few GPUs, missing backend).
    Skipped(String),
}

/// A multi-rank test run, configured builder-style.
#[derive(Clone, Debug)]
pub struct Run {
    world_size: usize,
    timeout: Duration,
    gpus: usize,
    backend: String,
    name: Option<String>,
    spawn: Option<SpawnMode>,
    any_world_size: bool,
}

/// Whether this test process runs one test with uncaptured output (see `Run::spawn_mode`).
fn fork_is_safe() -> bool {
    if std::env::var("NEXTEST_EXECUTION_MODE").is_ok_and(|m| m == "process-per-test") {
        return true;
    }
    let args: Vec<String> = std::env::args().collect();
    let env_flag = |name: &str, value: &str| std::env::var(name).is_ok_and(|v| v == value);
    let nocapture = args.iter().any(|a| a == "--nocapture")
        || std::env::var("RUST_TEST_NOCAPTURE").is_ok_and(|v| v != "0");
    let one_thread = args
        .windows(2)
        .any(|w| w[0] == "--test-threads" && w[1] == "1")
        || args.iter().any(|a| a == "--test-threads=1")
        || env_flag("RUST_TEST_THREADS", "1");
    nocapture && one_thread
}

/// Whether this process may fork rank processes for a launch it makes itself (the matrix,
/// the parity-test API): under nextest (one test per process), on a program's main thread
/// (a binary, or libtest running one test on its main thread), or in a test run with one
/// test thread and uncaptured output. A multi-threaded `cargo test` run is not: a forked
/// child would inherit locks other test threads hold.
pub fn fork_is_safe_here() -> bool {
    fork_is_safe() || std::thread::current().name() == Some("main")
}

/// How the harness starts rank processes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpawnMode {
    /// Fork the test process per rank: ranks start in milliseconds, sharing the already
    /// loaded libtorch. CPU backend only.
    Fork,
    /// Re-execute the test binary per rank, filtered to this test: a fresh process image.
    Exec,
}

/// Runs `body` on `world_size` ranks with the defaults; panics with the failure report (at
/// the caller's line).
#[track_caller]
pub fn run<F, R>(world_size: usize, body: F)
where
    F: Fn(&RankCtx) -> R,
    R: RankResult,
{
    Run::new(world_size).run(body);
}

impl Run {
    /// A run of `world_size` ranks on the CPU backend with the default timeout.
    pub fn new(world_size: usize) -> Self {
        Run {
            world_size,
            timeout: DEFAULT_TIMEOUT,
            gpus: 0,
            backend: "cpu".into(),
            name: None,
            spawn: None,
            any_world_size: false,
        }
    }

    /// Under an external launch, run at whatever `WORLD_SIZE` the launcher chose instead of
    /// skipping when it differs from the declared size (for bodies written for any size).
    pub fn any_world_size(mut self) -> Self {
        self.any_world_size = true;
        self
    }

    /// How long the whole run may take before it is declared hung.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Requires `n` CUDA devices; with fewer the run is skipped with a `SKIP:` line.
    pub fn gpus(mut self, n: usize) -> Self {
        self.gpus = n;
        self
    }

    /// Selects the backend (`cpu` or `nccl`). NCCL implies one GPU per rank.
    pub fn backend(mut self, backend: &str) -> Self {
        self.backend = backend.to_owned();
        if backend == "nccl" {
            self.gpus = self.gpus.max(self.world_size);
        }
        self
    }

    /// How ranks are started (default: fork under nextest on CPU, else exec).
    pub fn spawn(mut self, mode: SpawnMode) -> Self {
        self.spawn = Some(mode);
        self
    }

    /// The libtest name of the test calling this; needed only where the thread name is not
    /// the test name (a test that spawns its own thread).
    pub fn test_name(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Runs `body` on every rank and panics with the failure report if a rank fails. Returns
    /// in the launcher (the test process) once every rank is done or the run was skipped.
    /// The panic points at the caller's line.
    #[track_caller]
    pub fn run<F, R>(self, body: F) -> Outcome
    where
        F: Fn(&RankCtx) -> R,
        R: RankResult,
    {
        match self.try_run(body) {
            Ok(outcome) => outcome,
            Err(e) => panic!("multi-rank test failed:\n{e}"),
        }
    }

    /// As [`Run::run`], returning the failure instead of panicking (tests of the harness
    /// itself assert on it).
    pub fn try_run<F, R>(self, body: F) -> Result<Outcome, LaunchError>
    where
        F: Fn(&RankCtx) -> R,
        R: RankResult,
    {
        let name = self
            .name
            .clone()
            .or_else(|| std::thread::current().name().map(str::to_owned))
            .filter(|n| n != "main")
            .ok_or_else(|| {
                LaunchError::Invalid(
                    "cannot tell which test is running: call Run::test_name".into(),
                )
            })?;
        if let Some(rank_env) = rank::RankEnv::for_test(&name) {
            rank::run_rank(rank_env, &body);
        }
        if let Some(rank_env) = rank::RankEnv::external(&name) {
            if let Some(reason) = self.external_size_mismatch() {
                println!("SKIP: {reason}");
                eprintln!("SKIP: {reason}");
                return Ok(Outcome::Skipped(reason));
            }
            rank::run_external(rank_env, &body);
            return Ok(Outcome::Passed(LaunchSummary {
                elapsed: Duration::ZERO,
                ranks: vec![],
            }));
        }
        if let Some(reason) = self.skip_reason() {
            println!("SKIP: {reason}");
            eprintln!("SKIP: {reason}");
            return Ok(Outcome::Skipped(reason));
        }
        let opts = LaunchOptions {
            world_size: self.world_size,
            timeout: self.timeout,
            backend: self.backend.clone(),
        };
        let summary = match self.spawn_mode()? {
            SpawnMode::Fork => launch(
                &opts,
                RankSpawn::Fork(&|info| rank::execute_rank(rank::RankEnv::from_info(&info), &body)),
            )?,
            SpawnMode::Exec => {
                let exe = std::env::current_exe().map_err(|e| {
                    LaunchError::Invalid(format!("cannot find the test binary: {e}"))
                })?;
                let command = |_| RankCommand {
                    program: exe.clone(),
                    args: vec![
                        name.clone(),
                        "--exact".into(),
                        "--nocapture".into(),
                        "--test-threads".into(),
                        "1".into(),
                    ],
                    env: vec![(launch::env::TEST.into(), name.clone())],
                };
                launch(&opts, RankSpawn::Exec(&command))?
            }
        };
        Ok(Outcome::Passed(summary))
    }

    /// Fork where it is safe and loses nothing: the CPU backend (CUDA is not fork-safe), one
    /// test per process (no other test's thread can hold a lock the child inherits) and
    /// uncaptured output (a forked rank would print into libtest's in-memory capture). That is
    /// nextest, or `cargo test -- --nocapture --test-threads 1`. Exec otherwise.
    /// `LOCKSTEP_SPAWN=exec|fork` or [`Run::spawn`] overrides.
    fn spawn_mode(&self) -> Result<SpawnMode, LaunchError> {
        if let Some(mode) = self.spawn {
            return Ok(mode);
        }
        match std::env::var("LOCKSTEP_SPAWN").ok().as_deref() {
            Some("exec") => Ok(SpawnMode::Exec),
            Some("fork") => Ok(SpawnMode::Fork),
            Some(other) => Err(LaunchError::Invalid(format!(
                "LOCKSTEP_SPAWN={other:?}: expected exec or fork"
            ))),
            None if self.backend == "nccl" => Ok(SpawnMode::Exec),
            None if fork_is_safe() => Ok(SpawnMode::Fork),
            None => Ok(SpawnMode::Exec),
        }
    }

    /// Why an externally launched test cannot run at the launch's `WORLD_SIZE`: it declared
    /// another size (every rank sees the same `WORLD_SIZE`, so all skip alike and no run
    /// number is used up).
    fn external_size_mismatch(&self) -> Option<String> {
        if self.any_world_size {
            return None;
        }
        let launched = std::env::var("WORLD_SIZE").ok()?;
        match launched.trim().parse::<usize>() {
            Ok(n) if n == self.world_size => None,
            _ => Some(format!(
                "this test declares world size {}, but the external launch has WORLD_SIZE={launched} \
                 (Run::any_world_size runs a body at any size)",
                self.world_size
            )),
        }
    }

    fn skip_reason(&self) -> Option<String> {
        if self.backend == "nccl" && !cfg!(feature = "nccl") {
            return Some("needs the NCCL backend, but this build has no `nccl` feature".into());
        }
        if self.gpus > 0 {
            let found = tch::Cuda::device_count().max(0) as usize;
            if found < self.gpus {
                return Some(format!("needs {} GPUs, found {found}", self.gpus));
            }
        }
        None
    }
}
