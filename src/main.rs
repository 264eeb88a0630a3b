//! The `lockstep` command line.

mod cli;

use anyhow::Result;
use clap::Parser;
use cli::args::{Cli, Command, RunArgs, ScheduleArgs};
use cli::bad_input;
use cli::baseline::run_baseline;
use cli::bench::run_bench;
use cli::judge::run_judge;
use cli::matrix::{run_matrix, run_stress};
use cli::sensitivity::run_sensitivity;
use cli::setup::run_setup;
use lockstep::bench::{self};
use lockstep::harness::report::{compare_report_files, CompareOptions};
use std::process::ExitCode;

/// With the `jemalloc` feature (`ci/lockstep` builds with it), jemalloc, built unprefixed,
/// serves libtorch's `malloc` and `posix_memalign` too, in this process and every rank it
/// forks: under glibc's allocator, fragmented by libtorch's aligned allocations of small
/// tensors, allocation took a seventh of the matrix's time (docs/benchmarks.md, "Where the
/// default matrix's time goes"). Numbers are unchanged: libtorch asks for 64-byte alignment
/// and gets it from either.
#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
        Command::Setup {
            dir,
            libtorch,
            lockstep,
            offline,
        } => return Ok(run_setup(dir, libtorch, lockstep, offline)),
        Command::Env { json } => {
            let report = lockstep::env_report::collect();
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                println!("{report}");
            }
        }
        Command::Matrix(args) => return run_matrix(args),
        Command::Baseline { what } => return run_baseline(what),
        Command::Judge {
            run,
            reference,
            shadow,
            out,
        } => {
            return Ok(run_judge(lockstep::judge_cmd::JudgeOptions {
                run,
                reference,
                shadow,
                out,
            }))
        }
        Command::Rank(args) => {
            lockstep::runner::rank_cmd::rank_main(lockstep::runner::rank_cmd::RankRun {
                model: args.model,
                config: args.config,
                steps: args.steps,
                seed: args.seed,
                record_grads: args.record_grads,
                backend: args.backend,
                device: args.compute.device(args.backend)?,
                tf32: args.compute.tf32,
                out: args.out,
                optimizer: args.optimizer.unwrap_or_default(),
                faults: args.fault_plan,
            })
        }
        Command::Stress(args) => return run_stress(args),
        Command::Schedule(args) => return run_schedule(args),
        Command::Run(args) => return run_one(args),
        Command::Sensitivity(args) => return run_sensitivity(args),
        Command::SpawnProbe => lockstep::harness::rank_main(bench::spawn_probe),
        Command::Bench { what } => run_bench(what)?,
    }
    Ok(ExitCode::SUCCESS)
}

/// `lockstep run`: exit 0 when the run finished and its files are written, 1 when it failed,
/// 2 on bad input (nothing run, nothing written).
fn run_one(args: RunArgs) -> Result<ExitCode> {
    use lockstep::run_cmd;
    let timeout = match std::time::Duration::try_from_secs_f64(args.timeout) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!(
                "error: invalid option: --timeout {}: must be a positive number of seconds",
                args.timeout
            );
            return Ok(ExitCode::from(2));
        }
    };
    // Under torchrun/srun this process is one rank (`lockstep::runner::external`): checkpoint files
    // would be written and read on every rank's own host, so they are refused for now.
    let external = match lockstep::runner::external::detect() {
        Ok(external) => external,
        Err(e) => return Ok(bad_input(e)),
    };
    if external.is_some()
        && (args.init.is_some()
            || args.restart
            || args.save_init.is_some()
            || args.save_final.is_some())
    {
        eprintln!(
            "error: checkpoints (--init, --restart, --save-init, --save-final) have no external \
             mode yet (under torchrun/srun each rank's files would stay on its own host)"
        );
        return Ok(ExitCode::from(2));
    }
    let opts = run_cmd::RunOptions {
        model: args.model,
        config: args.config,
        world_size: args
            .world_size
            .unwrap_or(external.map_or(2, |l| l.world_size)),
        steps: args.steps,
        seed: args.seed,
        init: args.init,
        restart: args.restart,
        save_init: args.save_init,
        save_final: args.save_final,
        timeout,
        device: args
            .compute
            .device(lockstep_core::comm::Backend::Cpu)
            .unwrap_or_default(),
        tf32: args.compute.tf32,
    };
    match run_cmd::run(&opts) {
        Ok(outcome) => {
            if let Some(launch) = external.filter(|l| l.rank != 0) {
                println!(
                    "lockstep run rank {} of {}: done (rank 0 prints the outcome)",
                    launch.rank, launch.world_size
                );
            } else if args.json {
                println!("{}", serde_json::to_string(&outcome)?);
                for note in &outcome.notes {
                    eprintln!("note: {note}");
                }
            } else {
                print!("{}", run_cmd::render(&outcome));
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(ExitCode::from(e.exit_code()))
        }
    }
}

/// `lockstep schedule`: exit 0 for a valid, deadlock-free schedule, 1 otherwise, 2 on bad
/// input.
fn run_schedule(args: ScheduleArgs) -> Result<ExitCode> {
    let opts = lockstep::schedule::ScheduleOptions {
        schedule: args.schedule,
        stages: args.stages,
        microbatches: args.microbatches,
        virtual_stages: args.virtual_stages,
        csv: args.csv,
        export: args.export,
    };
    let report = match lockstep::schedule::run_schedule(&opts) {
        Ok(r) => r,
        Err(e) => return Ok(bad_input(e)),
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", lockstep::schedule::render_schedule(&report));
    }
    Ok(if report.simulation.is_some() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
