//! `bench comm`: latency and bus bandwidth of each collective per message size, measured on
//! freshly launched ranks, or as one rank per process under torchrun/srun across hosts
//! (nccl-tests' definitions of algorithm and bus bandwidth).

use super::{max_across, rank_exit_code, results_path, BenchError};
use lockstep_core::comm::{Backend, ExternalLaunch, ProcessGroup, ReduceOp, World};
use lockstep_core::CommError;
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use serde::Serialize;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// The collectives `bench comm` measures (`--ops all-reduce` or `all_reduce`, the spelling
/// its JSON output uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    /// All-reduce (sum); bus factor 2(n-1)/n.
    #[value(alias = "all_reduce")]
    AllReduce,
    /// All-gather; the size counted is the gathered output.
    #[value(alias = "all_gather")]
    AllGather,
    /// Reduce-scatter (sum); the size counted is the full input.
    #[value(alias = "reduce_scatter")]
    ReduceScatter,
    /// Broadcast from rank 0.
    Broadcast,
    /// All-to-all with equal chunks per peer.
    #[value(alias = "all_to_all")]
    AllToAll,
}

impl BenchOp {
    /// nccl-tests' bus-bandwidth factor: what each rank's links carry relative to the message.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::AllToAll => "all_to_all",
        }
    }
}

/// One measured point (one JSON line of `bench comm --json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct CommPoint {
    /// The collective's snake_case name, e.g. `all_reduce`.
    pub op: String,
    /// Message size as nccl-tests counts it (the full tensor; all-gather: the output).
    pub bytes: usize,
    /// Ranks taking part.
    pub world_size: usize,
    /// Mean seconds per operation (the slowest rank's).
    pub seconds: f64,
    /// Algorithm bandwidth, `bytes / seconds`, in GB/s (10^9 bytes).
    pub algbw_gbps: f64,
    /// Bus bandwidth, algbw times [`BenchOp::bus_factor`], in GB/s: comparable across ops.
    pub busbw_gbps: f64,
    /// Timed iterations the mean is over (warm-up excluded).
    pub iterations: usize,
}

/// What `bench comm` runs.
#[derive(Clone, Debug)]
pub struct CommBenchOptions {
    /// Ranks to launch, one process each.
    pub world_size: usize,
    /// Process-group backend name (`cpu` or `nccl`).
    pub backend: String,
    /// Collectives to measure, each over every size.
    pub ops: Vec<BenchOp>,
    /// Message sizes in bytes (rounded to whole fp32 elements divisible by the world size).
    pub sizes: Vec<usize>,
    /// Seconds of timed work per point (more iterations for small messages).
    pub seconds_per_point: f64,
}

/// Runs the collectives benchmark on freshly launched ranks and returns every point.
pub fn run_comm(opts: &CommBenchOptions) -> Result<Vec<CommPoint>, BenchError> {
    if opts.world_size < 2 {
        return Err(BenchError::Invalid(
            "the communication benchmark needs --world-size 2 or more".into(),
        ));
    }
    if opts.backend != "cpu" {
        return Err(BenchError::Invalid(format!(
            "backend {:?}: this benchmark drives the cpu backend (nccl runs need GPUs and `--features nccl`)",
            opts.backend
        )));
    }
    if let Some(external) = crate::runner::external::launch() {
        return run_comm_external(external, opts);
    }
    let out = results_path("comm");
    let launch_opts = LaunchOptions {
        world_size: opts.world_size,
        timeout: Duration::from_secs(600),
        backend: opts.backend.clone(),
    };
    let body = |ctx: &RankCtx| -> Result<(), CommError> {
        let points = measure_comm(ctx, opts)?;
        if ctx.rank() == 0 {
            let lines: Vec<String> = points
                .iter()
                .filter_map(|p| serde_json::to_string(p).ok())
                .collect();
            std::fs::write(&out, lines.join("\n"))
                .map_err(|e| CommError::io("write results", e))?;
        }
        Ok(())
    };
    launch(
        &launch_opts,
        RankSpawn::Fork(&|info| rank_exit_code(info, &body)),
    )?;
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_file(&out);
    text.lines()
        .map(|l| serde_json::from_str(l).map_err(BenchError::from))
        .collect()
}

/// `bench comm` as this process's rank of an external launch (torchrun, srun): ranks on other
/// hosts measure the links between hosts. Every rank returns the same points (each one's time
/// is the slowest rank's).
fn run_comm_external(
    external: &ExternalLaunch,
    opts: &CommBenchOptions,
) -> Result<Vec<CommPoint>, BenchError> {
    if opts.world_size != external.world_size {
        return Err(BenchError::Invalid(format!(
            "--world-size {} under an external launch of WORLD_SIZE={}: the launcher decides \
             the world size",
            opts.world_size, external.world_size
        )));
    }
    lockstep_harness::threads::use_rank_threads();
    let world = World::from_env_for(Backend::Cpu, "bench comm")?;
    let ctx = RankCtx::new(world, external.local_rank);
    Ok(measure_comm(&ctx, opts)?)
}

fn measure_comm(ctx: &RankCtx, opts: &CommBenchOptions) -> Result<Vec<CommPoint>, CommError> {
    let group = ctx.group();
    let n = ctx.world_size();
    let mut points = Vec::new();
    for &op in &opts.ops {
        for &bytes in &opts.sizes {
            // Gathers, scatters and all-to-all split the tensor evenly over the ranks.
            let elems = match op {
                BenchOp::AllReduce | BenchOp::Broadcast => (bytes / 4).max(1),
                _ => (bytes / 4).max(1).div_ceil(n) * n,
            };
            let run = prepare(op, elems, n, ctx.rank())?;
            for _ in 0..2 {
                run(group.as_ref())?;
            }
            let t0 = Instant::now();
            run(group.as_ref())?;
            let one = max_across(group.as_ref(), t0.elapsed().as_secs_f64())?;
            let iterations = ((opts.seconds_per_point / one.max(1e-7)) as usize).clamp(3, 20_000);
            group.barrier()?;
            let t0 = Instant::now();
            for _ in 0..iterations {
                run(group.as_ref())?;
            }
            let total = max_across(group.as_ref(), t0.elapsed().as_secs_f64())?;
            let seconds = total / iterations as f64;
            let size = elems * 4;
            let algbw = size as f64 / seconds / 1e9;
            points.push(CommPoint {
                op: op.name().into(),
                bytes: size,
                world_size: n,
                seconds,
                algbw_gbps: algbw,
                busbw_gbps: algbw * op.bus_factor(n),
                iterations,
            });
        }
    }
    Ok(points)
}

type Step = Box<dyn Fn(&dyn ProcessGroup) -> Result<(), CommError>>;

fn prepare(op: BenchOp, elems: usize, n: usize, rank: usize) -> Result<Step, CommError> {
    let opts = (Kind::Float, Device::Cpu);
    let full = Tensor::f_ones([elems as i64], opts)? * (rank as f64 + 1.0);
    let part = Tensor::f_ones([(elems / n) as i64], opts)?;
    Ok(match op {
        BenchOp::AllReduce => Box::new(move |g| g.all_reduce(&full, ReduceOp::Sum)),
        BenchOp::AllGather => Box::new(move |g| g.all_gather(&full, &part)),
        BenchOp::ReduceScatter => Box::new(move |g| g.reduce_scatter(&part, &full, ReduceOp::Sum)),
        BenchOp::Broadcast => Box::new(move |g| g.broadcast(&full, 0)),
        BenchOp::AllToAll => {
            let out = full.f_zeros_like()?;
            Box::new(move |g| g.all_to_all(&out, &full, &[], &[]))
        }
    })
}
