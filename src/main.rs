//! The `lockstep` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lockstep::bench::{self, BenchOp, CommBenchOptions, SpawnBenchMode};
use lockstep::harness::report::{compare_report_files, CompareOptions};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Proves distributed training is numerically right"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print libtorch, CUDA, GPU and NCCL availability and the built backends.
    Env {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure communication and start-up speed.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Compare two parity reports (JSON); exit 1 if a configuration regressed, 2 on bad input.
    ///
    /// A configuration regresses when it vanished from NEW, passed in BASE but fails in NEW,
    /// or its max abs error grew more than FACTOR times. Errors at or below FLOOR count as
    /// noise, so growth from exactly 0 is flagged only above it.
    Compare {
        /// The earlier report (e.g. from main).
        base: PathBuf,
        /// The report to check.
        new: PathBuf,
        /// Flag errors that grew more than this many times.
        #[arg(long, default_value_t = 10.0)]
        factor: f64,
        /// Errors at or below this are treated as noise.
        #[arg(long, default_value_t = 1e-12)]
        floor: f64,
    },
    /// A rank of `bench spawn --mode exec` (started by the launcher, not by hand).
    #[command(name = "__spawn-probe", hide = true)]
    SpawnProbe,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Latency and bus bandwidth per collective and message size.
    Comm {
        #[arg(long, default_value = "cpu")]
        backend: String,
        #[arg(long, default_value_t = 2)]
        world_size: usize,
        /// Collectives to measure (default: all).
        #[arg(long, value_delimiter = ',')]
        ops: Vec<BenchOp>,
        /// Message sizes in bytes (default: 4, 1 KiB, 64 KiB, 1 MiB, 16 MiB).
        #[arg(long, value_delimiter = ',')]
        sizes: Vec<usize>,
        /// Seconds of timed work per point.
        #[arg(long, default_value_t = 0.3)]
        seconds: f64,
        /// Print JSON lines (op, bytes, world_size, seconds, busbw_gbps, ...).
        #[arg(long)]
        json: bool,
    },
    /// Spawn + rendezvous + first all_reduce, end to end.
    Spawn {
        #[arg(long, default_value_t = 4)]
        world_size: usize,
        #[arg(long, default_value_t = 5)]
        repeats: usize,
        /// How ranks start: fork (the harness default on CPU) or exec.
        #[arg(long, value_enum, default_value = "fork")]
        mode: SpawnBenchMode,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> Result<ExitCode> {
    let cli = Cli::parse();
    match cli.command {
        Command::Compare {
            base,
            new,
            factor,
            floor,
        } => {
            let options = CompareOptions {
                factor,
                zero_floor: floor,
            };
            // Exit 2 on an unusable input, so CI can tell "regressed" (1) from "could not judge".
            let result = match compare_report_files(&base, &new, &options) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: comparing parity reports: {e}");
                    return Ok(ExitCode::from(2));
                }
            };
            print!("{}", result.render_table());
            if result.has_regression() {
                return Ok(ExitCode::FAILURE);
            }
        }
        Command::Env { json } => {
            let report = lockstep::env_report::collect();
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
        }
        Command::SpawnProbe => lockstep::harness::rank_main(bench::spawn_probe),
        Command::Bench { what } => run_bench(what)?,
    }
    Ok(ExitCode::SUCCESS)
}

fn run_bench(what: BenchCommand) -> Result<()> {
    match what {
        BenchCommand::Comm {
            backend,
            world_size,
            ops,
            sizes,
            seconds,
            json,
        } => {
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
            if !json {
                eprintln!(
                    "measuring {} collectives x {} sizes on {} ranks ({} backend)...",
                    opts.ops.len(),
                    opts.sizes.len(),
                    opts.world_size,
                    opts.backend
                );
            }
            let points = bench::run_comm(&opts).context("communication benchmark")?;
            if json {
                for p in &points {
                    println!("{}", serde_json::to_string(p)?);
                }
            } else {
                println!(
                    "{:<15} {:>12} {:>6} {:>12} {:>12} {:>12}",
                    "op", "bytes", "world", "latency", "algbw GB/s", "busbw GB/s"
                );
                for p in &points {
                    println!(
                        "{:<15} {:>12} {:>6} {:>12} {:>12.3} {:>12.3}",
                        p.op,
                        p.bytes,
                        p.world_size,
                        format_seconds(p.seconds),
                        p.algbw_gbps,
                        p.busbw_gbps
                    );
                }
            }
        }
        BenchCommand::Spawn {
            world_size,
            repeats,
            mode,
            json,
        } => {
            let r = bench::run_spawn(world_size, repeats, mode).context("spawn benchmark")?;
            if json {
                println!("{}", serde_json::to_string(&r)?);
            } else {
                println!(
                    "spawn + rendezvous + first all_reduce, {} ranks ({:?}): median {} (min {}, max {}, {} runs)",
                    r.world_size,
                    r.mode,
                    format_seconds(r.seconds),
                    format_seconds(r.min_seconds),
                    format_seconds(r.max_seconds),
                    r.repeats
                );
            }
        }
    }
    Ok(())
}

fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}
