//! Ranks for a training closure (a user's, or an in-process reference isolated in a child):
//! forked, or where fork is not safe the calling test re-run per rank, or under an external
//! launch this process as its own rank.

use super::hand_back::RankError;
use super::settings::{launch_failed, RunFailed, RunSettings};
use lockstep_core::comm::Backend;
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use std::path::Path;

/// Why a training closure (a user's configuration, or subtests sharing one launch) cannot
/// run on NCCL, for every refusal to say the same thing.
pub const NCCL_RUNS_MISSING: &str = "a training closure runs in forked ranks, and CUDA cannot \
     be used in a forked child: on NCCL only built-in configurations of zoo models run, in \
     exec'd ranks (see docs/gpu.md)";

/// Forks `world_size` ranks on the CPU backend, each running `body`; a failed launch comes
/// back with the launcher's whole account. An NCCL run is refused, not forked: CUDA cannot
/// be used in a forked child (built-in configurations exec their ranks instead: `run_exec`).
/// Where fork is not safe (a multi-threaded `cargo test`), the ranks are re-runs of the
/// calling test instead ([`super::self_exec`]; `label` names the launch for them, `out` is
/// where rank 0 writes its record). Under an external launch (torchrun, srun) nothing is
/// started: this process runs `body` as its own rank ([`super::external`]).
pub(super) fn launch_forked(
    world_size: usize,
    settings: &RunSettings,
    label: &str,
    out: &Path,
    body: &(dyn Fn(&RankCtx) -> Result<(), RankError> + Sync),
) -> Result<(), RunFailed> {
    if settings.backend != Backend::Cpu {
        return Err(RunFailed::simple(NCCL_RUNS_MISSING));
    }
    if let Some(external) = super::external::launch() {
        return super::external::run(
            external,
            world_size,
            settings.backend,
            label,
            settings.timeout,
            body,
        );
    }
    if let Some(launched) = super::self_exec::launch_without_fork(
        world_size,
        settings.timeout,
        label,
        out,
        settings.faults.is_some(),
        settings.computes_on_cuda(),
        body,
    ) {
        return launched;
    }
    let opts = LaunchOptions {
        world_size,
        timeout: settings.timeout,
        backend: "cpu".into(),
    };
    launch(
        &opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, body)),
    )
    .map(drop)
    .map_err(launch_failed)
}
