//! `bench spawn`: what it costs to start ranks (fork or exec), rendezvous and run one
//! collective, end to end.

use super::{rank_exit_code, BenchError};
use lockstep_core::comm::ReduceOp;
use lockstep_core::CommError;
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use serde::Serialize;
use std::time::{Duration, Instant};
use tch::Tensor;

/// How `bench spawn` starts ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SpawnBenchMode {
    /// Fork the launcher (the harness's default on the CPU backend).
    Fork,
    /// Execute a fresh `lockstep` process per rank.
    Exec,
}

/// The result of `bench spawn`.
#[derive(Clone, Debug, Serialize)]
pub struct SpawnResult {
    /// Ranks launched per repeat.
    pub world_size: usize,
    /// Median over the repeats: spawn, rendezvous, one all_reduce, every rank exited.
    pub seconds: f64,
    /// Fastest repeat, in seconds.
    pub min_seconds: f64,
    /// Slowest repeat, in seconds.
    pub max_seconds: f64,
    /// Launches measured.
    pub repeats: usize,
    /// How ranks were started.
    pub mode: SpawnBenchMode,
}

/// The hidden subcommand a rank of `bench spawn --mode exec` runs.
pub const SPAWN_PROBE_COMMAND: &str = "__spawn-probe";

/// The work of one spawn-benchmark rank: one all_reduce of one fp32.
pub fn spawn_probe(ctx: &RankCtx) -> Result<(), CommError> {
    let t = Tensor::from_slice(&[1.0f32]);
    ctx.group().all_reduce(&t, ReduceOp::Sum)
}

/// Measures spawn + rendezvous + first all_reduce, `repeats` times.
pub fn run_spawn(
    world_size: usize,
    repeats: usize,
    mode: SpawnBenchMode,
) -> Result<SpawnResult, BenchError> {
    if world_size == 0 || repeats == 0 {
        return Err(BenchError::Invalid(
            "world size and repeats must be at least 1".into(),
        ));
    }
    let opts = LaunchOptions {
        world_size,
        timeout: Duration::from_secs(120),
        backend: "cpu".into(),
    };
    let exe = std::env::current_exe()?;
    let command = |_| lockstep_harness::RankCommand {
        program: exe.clone(),
        args: vec![SPAWN_PROBE_COMMAND.into()],
        env: vec![],
    };
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        match mode {
            SpawnBenchMode::Fork => launch(
                &opts,
                RankSpawn::Fork(&|info| rank_exit_code(info, &spawn_probe)),
            )?,
            SpawnBenchMode::Exec => launch(&opts, RankSpawn::Exec(&command))?,
        };
        times.push(t0.elapsed().as_secs_f64());
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(SpawnResult {
        world_size,
        seconds: sorted[sorted.len() / 2],
        min_seconds: sorted[0],
        max_seconds: sorted[sorted.len() - 1],
        repeats,
        mode,
    })
}
