//! `lockstep bench`: each benchmark run and printed (text or JSON).

use super::args::BenchCommand;
use anyhow::{Context, Result};
use lockstep::bench::{self, BenchOp, CommBenchOptions, SpawnBenchMode, StepBenchOptions};
use lockstep_harness::report::plural;

pub(crate) fn run_bench(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::Comm {
            backend,
            world_size,
            ops,
            sizes,
            seconds,
            json,
        } => bench_comm(backend, world_size, ops, sizes, seconds, json),
        BenchCommand::Spawn {
            world_size,
            repeats,
            mode,
            json,
        } => bench_spawn(world_size, repeats, mode, json),
        BenchCommand::Pipeline {
            schedule,
            stages,
            microbatches,
            virtual_stages,
            steps,
            trace,
            json,
        } => bench_pipeline(
            bench::PipelineBenchOptions {
                schedule,
                stages,
                microbatches,
                virtual_stages,
                steps,
                trace,
                ..bench::PipelineBenchOptions::default()
            },
            json,
        ),
        BenchCommand::Step {
            world_size,
            model,
            steps,
            parallel,
            json,
        } => bench_step(
            StepBenchOptions {
                world_size: world_size
                    .or(lockstep::runner::external::launch().map(|e| e.world_size))
                    .unwrap_or(2),
                model,
                steps,
                parallel,
                ..StepBenchOptions::default()
            },
            json,
        ),
    }
}

/// `lockstep bench comm`: busbw per collective and size.
pub(crate) fn bench_comm(
    backend: String,
    world_size: Option<usize>,
    ops: Vec<BenchOp>,
    sizes: Vec<usize>,
    seconds: f64,
    json: bool,
) -> Result<()> {
    // Under torchrun/srun this process is one rank; rank 0 prints the figures.
    let external = lockstep::runner::external::detect().map_err(|e| anyhow::anyhow!(e))?;
    let world_size = world_size.or(external.map(|e| e.world_size)).unwrap_or(2);
    let quiet_rank = external
        .filter(|e| e.rank != 0)
        .map(|e| (e.rank, e.world_size));
    let opts = CommBenchOptions {
        world_size,
        backend,
        ops: if ops.is_empty() {
            vec![
                BenchOp::AllReduce,
                BenchOp::AllGather,
                BenchOp::ReduceScatter,
                BenchOp::Broadcast,
                BenchOp::AllToAll,
            ]
        } else {
            ops
        },
        sizes: if sizes.is_empty() {
            vec![4, 1 << 10, 64 << 10, 1 << 20, 16 << 20]
        } else {
            sizes
        },
        seconds_per_point: seconds,
    };
    if !json && quiet_rank.is_none() {
        eprintln!(
            "measuring {} x {} on {} ({} backend)...",
            plural(opts.ops.len(), "collective"),
            plural(opts.sizes.len(), "size"),
            plural(opts.world_size, "rank"),
            opts.backend
        );
    }
    let points = bench::run_comm(&opts).context("communication benchmark")?;
    if let Some((rank, size)) = quiet_rank {
        println!(
            "lockstep bench comm rank {rank} of {size}: {} measured (rank 0 prints them)",
            plural(points.len(), "point")
        );
        return Ok(());
    }
    if json {
        for p in &points {
            println!("{}", serde_json::to_string(p)?);
        }
    } else {
        print!("{}", bench::text::comm_table(&points));
    }
    Ok(())
}

/// `lockstep bench spawn`: the launcher's start-up cost.
pub(crate) fn bench_spawn(
    world_size: usize,
    repeats: usize,
    mode: SpawnBenchMode,
    json: bool,
) -> Result<()> {
    let r = bench::run_spawn(world_size, repeats, mode).context("spawn benchmark")?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print!("{}", bench::text::spawn_line(&r));
    }
    Ok(())
}

/// `lockstep bench pipeline`: step time and measured bubble against the simulated one.
pub(crate) fn bench_pipeline(opts: bench::PipelineBenchOptions, json: bool) -> Result<()> {
    let r = match bench::run_pipeline(&opts) {
        Ok(r) => r,
        // Bad input (an unknown schedule, stages that do not fit the decoder's layers,
        // microbatches the schedule refuses) exits 2 like `lockstep schedule`, so a
        // script tells it from a run that failed.
        Err(bench::BenchError::Invalid(why)) => {
            eprintln!("error: pipeline benchmark: {why}");
            std::process::exit(2);
        }
        Err(e) => return Err(anyhow::Error::new(e).context("pipeline benchmark")),
    };
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print!("{}", bench::text::pipeline_table(&r));
    }
    Ok(())
}

/// `lockstep bench step`: one training step under DDP/FSDP, or a TP/EP plan.
pub(crate) fn bench_step(opts: StepBenchOptions, json: bool) -> Result<()> {
    let parallel = opts.parallel;
    // Under torchrun/srun this process is one rank: rank 0 prints, the others one line.
    let external = lockstep::runner::external::detect().map_err(|e| anyhow::anyhow!(e))?;
    let quiet = external
        .filter(|e| e.rank != 0)
        .map(|e| (e.rank, e.world_size));
    // Bad input (a world of one, a plan the sizes do not fit) exits 2, as for
    // `bench pipeline`.
    let bad_input = |e: bench::BenchError| -> anyhow::Error {
        if let bench::BenchError::Invalid(why) = &e {
            eprintln!("error: step benchmark: {why}");
            std::process::exit(2);
        }
        anyhow::Error::new(e).context("step benchmark")
    };
    if parallel != bench::StepParallel::Fsdp {
        let r = bench::run_parallel_step(&opts).map_err(bad_input)?;
        if let Some((rank, size)) = quiet {
            println!("lockstep bench step rank {rank} of {size}: done (rank 0 prints the times)");
        } else if json {
            println!("{}", serde_json::to_string(&r)?);
        } else {
            print!("{}", bench::text::parallel_step_table(&r));
        }
        return Ok(());
    }
    let r = bench::run_step(&opts).map_err(bad_input)?;
    if let Some((rank, size)) = quiet {
        println!("lockstep bench step rank {rank} of {size}: done (rank 0 prints the times)");
    } else if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print!("{}", bench::text::step_line(&r));
    }
    Ok(())
}
