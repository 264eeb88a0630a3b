//! The one place a launch's mode is chosen. A run's ranks are:
//!
//! - **one rank each in this process** under an external launch (torchrun, srun: every
//!   process runs the body as its own rank, [`super::external`]);
//! - **exec'd programs** when the caller gives a command (`lockstep rank …`: the only way to
//!   NCCL, since CUDA cannot be used in a forked child);
//! - **re-runs of the calling test** where fork is not safe (a multi-threaded `cargo test`),
//!   where ranks compute on CUDA, or inside such a re-run ([`super::self_exec`]);
//! - **forked children** otherwise, the fast path.
//!
//! Whatever the mode, rank 0 hands its record back at the launch's `out`
//! ([`super::hand_back`]) and a failure comes back as [`RunFailed`] with the launcher's
//! whole account.

use super::failed::{launch_failed, RunFailed};
use super::hand_back::RankError;
use super::{external, launch, self_exec, LaunchOptions, RankCommand, RankSpawn};
use crate::RankCtx;
use lockstep_core::comm::Backend;
use std::path::Path;
use std::time::Duration;

/// Why a training closure (a user's configuration, or subtests sharing one launch) cannot
/// run on NCCL, for every refusal to say the same thing.
pub const NCCL_RUNS_MISSING: &str = "a training closure runs in forked ranks, and CUDA cannot \
     be used in a forked child: on NCCL only built-in configurations of zoo models run, in \
     exec'd ranks (see docs/gpu.md)";

/// What every rank runs: its part of the run, handing its results back.
pub type RankBody<'a> = dyn Fn(&RankCtx) -> Result<(), RankError> + Sync + 'a;

/// The command every exec'd rank runs, asked for only when ranks are exec'd (under an
/// external launch this process runs the body instead).
pub type ExecCommand<'a> = dyn Fn() -> Result<RankCommand, RunFailed> + 'a;

/// One launch of a run's ranks: what the mode is chosen from.
pub struct RankLaunch<'a> {
    /// How many ranks.
    pub world_size: usize,
    /// How long the whole launch may take before it is declared hung.
    pub timeout: Duration,
    /// The backend the ranks' groups use.
    pub backend: Backend,
    /// Names the launch, in failures and for a re-run test to find its launch.
    pub label: &'a str,
    /// Where rank 0 hands its record back.
    pub out: &'a Path,
    /// A fault plan numbers this run's calls (forked ranks only).
    pub fault_plan: bool,
    /// The ranks compute on CUDA (never forked).
    pub cuda: bool,
    /// Exec this command per rank instead of running the body in a child.
    pub exec: Option<&'a ExecCommand<'a>>,
}

/// Runs `body` on `req.world_size` ranks in the mode this process and the request call
/// for (see the module's list). A closure is refused on NCCL, whose ranks must be exec'd.
pub fn run_ranks(req: &RankLaunch<'_>, body: &RankBody<'_>) -> Result<(), RunFailed> {
    if req.exec.is_none() && req.backend != Backend::Cpu {
        return Err(RunFailed::simple(NCCL_RUNS_MISSING));
    }
    if let Some(external) = external::launch() {
        return external::run(
            external,
            req.world_size,
            req.backend,
            req.label,
            req.timeout,
            body,
        );
    }
    if let Some(command) = req.exec {
        return exec_ranks(req, &command()?);
    }
    if let Some(launched) = self_exec::launch_without_fork(
        req.world_size,
        req.timeout,
        req.label,
        req.out,
        req.fault_plan,
        req.cuda,
        body,
    ) {
        return launched;
    }
    fork_ranks(req, body)
}

/// Whether several runs can share one launch here (PyTorch's `run_subtests`): with forked
/// ranks, or as one rank of an external launch; never inside a test's re-run or where the
/// test would be re-run per rank.
pub fn shares_one_launch() -> bool {
    self_exec::serving().is_none()
        && (external::launch().is_some() || !self_exec::execs_here().unwrap_or(true))
}

/// `command` exec'd once per rank.
fn exec_ranks(req: &RankLaunch<'_>, command: &RankCommand) -> Result<(), RunFailed> {
    let opts = LaunchOptions {
        world_size: req.world_size,
        timeout: req.timeout,
        backend: req.backend.name().into(),
    };
    let command = |_rank: usize| command.clone();
    launch(&opts, RankSpawn::Exec(&command))
        .map(drop)
        .map_err(launch_failed)
}

/// `body` in `req.world_size` forked children on the CPU backend.
fn fork_ranks(req: &RankLaunch<'_>, body: &RankBody<'_>) -> Result<(), RunFailed> {
    let opts = LaunchOptions {
        world_size: req.world_size,
        timeout: req.timeout,
        backend: "cpu".into(),
    };
    launch(
        &opts,
        RankSpawn::Fork(&|info| crate::execute_forked_rank(info, body)),
    )
    .map(drop)
    .map_err(launch_failed)
}
