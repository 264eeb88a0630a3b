//! The `lockstep` command line.

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use lockstep::bench::{self, BenchOp, CommBenchOptions, SpawnBenchMode, StepBenchOptions};
use lockstep::harness::report::{compare_report_files, CompareOptions};
use lockstep_harness::report::plural;
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
    /// Set up your own crate for parity tests (run it in the crate): `.cargo/config.toml`
    /// pointing LIBTORCH at libtorch, a `build.rs` linking tests with an rpath to it, and
    /// `lockstep`, `tch` and `lockstep-linkage` in Cargo.toml. Then `cargo test` works.
    ///
    /// Example: `cargo run --manifest-path ~/lockstep/Cargo.toml -- setup`.
    Setup {
        /// The crate to set up (the directory holding its Cargo.toml).
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// libtorch's root (default: $LIBTORCH, else the libtorch lockstep was built with).
        #[arg(long)]
        libtorch: Option<PathBuf>,
        /// The lockstep checkout to depend on (default: the one this binary was built from).
        #[arg(long)]
        lockstep: Option<PathBuf>,
        /// Resolve `tch` from the local registry cache only (`cargo add --offline`).
        #[arg(long)]
        offline: bool,
    },
    /// Print libtorch, CUDA, GPU and NCCL availability and the built backends.
    Env {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Measure communication, start-up and training-step speed.
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
    /// Run every model x config at each world size on the CPU backend and check parity.
    ///
    /// DDP is compared with the single-device reference (fp64 arbiter) and with a fresh
    /// repeat of itself (bitwise); the single-device reference with a repeat of itself
    /// (bitwise). Writes report.json, report.md, junit.xml and report.html into --out. Exit 1
    /// if a parity check or a run failed (failed runs are the report's errors, and the report
    /// says it is incomplete), 2 on bad
    /// input.
    Matrix(MatrixArgs),
    /// One exec'd rank of a launched run (started by the launcher, not by hand).
    #[command(hide = true)]
    Rank(RankArgs),
    /// Run a matrix selection N times under injected load (busy threads, random message
    /// delays) and count the hangs; exit 1 if any run hung or failed.
    ///
    /// A hang prints the first hung run's flight recorders and desync diagnosis. Example:
    /// `lockstep stress --configs 'fsdp.hybrid*' --world-size 4 --repeat 200`.
    Stress(StressArgs),
    /// Show a pipeline schedule before it runs: the rank × time-step table of its simulation,
    /// the bubble fraction, and the validator's verdict; exit 1 if it is invalid or
    /// deadlocks, 2 on bad input.
    ///
    /// Example: `lockstep schedule --schedule interleaved_1f1b --pipeline-ranks 4
    /// --microbatches 8 --virtual 2`. Schedules (the `pp.*` configurations' spelling; hyphens
    /// work too): gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb, zbv, dualpipev;
    /// or `--csv FILE` (one row per rank, PyTorch's action notation).
    Schedule(ScheduleArgs),
    /// Train one model x config from a PyTorch state dict or from its seed, and write the
    /// initial and final full state dicts under PyTorch's names; exit 1 if the run failed, 2
    /// on bad input (nothing run, nothing written).
    ///
    /// Per-step losses and gradient norms are printed (one JSON object with --json). A state
    /// written by --save-final from single or ddp* carries the optimizer state and step, so
    /// --init from it continues exactly (docs/checkpoints.md). Example: `lockstep run --model
    /// nested --config ddp --world-size 2 --steps 5 --init model.safetensors --save-final
    /// out.safetensors`.
    Run(RunArgs),
    /// Prove a configuration's parity check can fail: corrupt one collective call at a time
    /// (skip, double, zero, wrong peer, permuted chunks, stale, a perturbation, bf16
    /// rounding) and judge each run as `lockstep matrix` judges the configuration.
    ///
    /// A dry run records every call; the sites are the calls of --site-steps (point to point
    /// on every rank, collectives on their group's first and last rank). Prints a table of
    /// site x fault (caught / MISSED / error / hang / n/a / same), the smallest perturbation
    /// caught per site, and writes sensitivity.json and sensitivity.md to --out. Exit 1 when
    /// a math-changing fault (skip, double, zero, wrong_peer, permuted, stale) was missed, 2
    /// on bad input. Example: `lockstep sensitivity --model mlp --config ddp --world-size 2`.
    Sensitivity(SensitivityArgs),
    /// A rank of `bench spawn --mode exec` (started by the launcher, not by hand).
    #[command(name = "__spawn-probe", hide = true)]
    SpawnProbe,
}

/// Which part of the matrix to run (shared by `matrix` and `stress`).
#[derive(clap::Args, Clone)]
struct SelectionArgs {
    /// Models to run: names or patterns with `*` (e.g. `nested,gpt*`); default all.
    #[arg(long, value_delimiter = ',')]
    models: Vec<String>,
    /// Configs to check: names or patterns (e.g. `ddp*`); default all.
    #[arg(long, value_delimiter = ',')]
    configs: Vec<String>,
    /// World sizes (repeatable or comma-separated, e.g. `2,4`); default 4.
    #[arg(long = "world-size", value_delimiter = ',')]
    world_sizes: Vec<usize>,
    /// Training steps per run.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Run seed for parameters and batches.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The zoo model (`lockstep matrix --list` names them).
    #[arg(long)]
    model: String,
    /// The configuration (`lockstep matrix --list` names them), e.g. single, ddp.
    #[arg(long)]
    config: String,
    /// Ranks (for single: how many ranks' batches form the global batch); default 2, or
    /// `WORLD_SIZE` under an external launch (torchrun, srun).
    #[arg(long = "world-size")]
    world_size: Option<usize>,
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Run seed for parameters and batches (default: the checkpoint's when continuing one,
    /// else 0).
    #[arg(long)]
    seed: Option<u64>,
    /// Start every rank from this state dict (safetensors, PyTorch's parameter names).
    #[arg(long)]
    init: Option<PathBuf>,
    /// With --init: use only the weights, at step 0 with a fresh optimizer, even when the
    /// file carries an optimizer state.
    #[arg(long, requires = "init")]
    restart: bool,
    /// Write the initial full state dict here (safetensors).
    #[arg(long = "save-init")]
    save_init: Option<PathBuf>,
    /// Write the final full state dict here (and, from single or ddp*, its optimizer state
    /// next to it as NAME.optim.safetensors).
    #[arg(long = "save-final")]
    save_final: Option<PathBuf>,
    /// Seconds the launch may take before it is declared hung.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    compute: ComputeArgs,
}

/// Where runs compute (shared by `matrix`, `run` and the hidden `rank`): see docs/gpu.md.
#[derive(clap::Args, Clone, Copy)]
struct ComputeArgs {
    /// cpu or cuda. cuda on the CPU backend: ranks spread over the visible GPUs round robin
    /// (several ranks may share one), collectives staged through host memory, the
    /// single-device reference on GPU 0. NCCL always computes on CUDA. Every CUDA process runs
    /// with deterministic kernels, a fixed cuBLAS workspace and TF32 off. Refused before
    /// anything runs (exit 2) without a GPU.
    #[arg(long, value_parser = lockstep::device::ComputeDevice::parse)]
    device: Option<lockstep::device::ComputeDevice>,
    /// Allow TF32 matrix products and convolutions on CUDA (off by default: fp32 arithmetic).
    #[arg(long)]
    tf32: bool,
}

impl ComputeArgs {
    /// The device runs compute on with `backend`, or why that cannot be.
    fn device(
        self,
        backend: lockstep_core::comm::Backend,
    ) -> anyhow::Result<lockstep::device::ComputeDevice> {
        lockstep::device::ComputeDevice::resolve(self.device, backend).map_err(anyhow::Error::msg)
    }
}

/// What a sensitivity analysis tries (shared by `sensitivity` and `matrix --sensitivity`).
#[derive(clap::Args)]
struct FaultArgs {
    /// Faults to try at every site: skip, double, zero, wrong_peer, permuted, stale, perturb
    /// (its ε bisected over 1e-1..1e-8), bf16. Default: all of them (`matrix --sensitivity`:
    /// the six math-changing ones).
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Steps whose calls are sites. Default: 0,1 (`matrix --sensitivity`: 0).
    #[arg(long = "site-steps", value_delimiter = ',')]
    site_steps: Vec<usize>,
    /// Seconds one faulted run may take before it counts as a hang (caught).
    #[arg(long = "run-timeout", default_value_t = 20.0)]
    run_timeout: f64,
}

#[derive(clap::Args)]
struct SensitivityArgs {
    /// The zoo model.
    #[arg(long)]
    model: String,
    /// The configuration (`lockstep matrix --list` names them).
    #[arg(long)]
    config: String,
    /// Ranks.
    #[arg(long = "world-size", default_value_t = 2)]
    world_size: usize,
    /// Training steps per run.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Run seed for parameters and batches.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    faults: FaultArgs,
    /// Seconds the references and the dry run may take.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Directory for sensitivity.json and sensitivity.md (created if missing).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    compute: ComputeArgs,
}

#[derive(clap::Args)]
struct ScheduleArgs {
    /// A built-in schedule (ignored with --csv).
    #[arg(long, default_value = "1f1b")]
    schedule: String,
    /// Pipeline ranks (processes); each holds `--virtual` stages. `--stages` is the old name.
    #[arg(long = "pipeline-ranks", alias = "stages", default_value_t = 4)]
    stages: usize,
    /// Microbatches per step.
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Stages per rank (default: the schedule's own, 1 or 2).
    #[arg(long = "virtual")]
    virtual_stages: Option<usize>,
    /// Load the schedule from a CSV file instead (one row of actions per rank).
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Write the schedule's compute actions as CSV to this file.
    #[arg(long)]
    export: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct StressArgs {
    #[command(flatten)]
    selection: SelectionArgs,
    /// How many times to run the whole selection.
    #[arg(long, default_value_t = 20)]
    repeat: usize,
    /// Busy threads spinning in the launcher for the whole stress (CPU contention).
    #[arg(long = "busy-threads", default_value_t = 2)]
    busy_threads: usize,
    /// Longest random delay, in microseconds, before every message a rank sends.
    #[arg(long = "send-delay-us", default_value_t = 200)]
    send_delay_us: u64,
    /// Seconds one launch may take before it counts as a hang.
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Plant a bug in every DDP run (as `matrix --fault`), e.g. `stall` to prove a hang is
    /// found.
    #[arg(long, hide = true, value_parser = parse_fault)]
    fault: Option<lockstep_core::ddp::Fault>,
}

#[derive(clap::Args)]
struct MatrixArgs {
    #[command(flatten)]
    selection: SelectionArgs,
    /// Directory for the report set (created if missing).
    #[arg(long, default_value = lockstep::matrix::DEFAULT_OUT_DIR)]
    out: PathBuf,
    /// Seconds one launch may take before it is declared hung.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Plant a bug in every DDP run to see the matrix catch it: sum (gradients summed, not
    /// averaged), no-buffer-broadcast, reduce-experts, stall (the last rank hangs before its
    /// first gradient reduction), or skip=PARAM.
    #[arg(long, hide = true, value_parser = parse_fault)]
    fault: Option<lockstep_core::ddp::Fault>,
    /// List the configs (with the models each applies to) and the models, then exit.
    #[arg(long)]
    list: bool,
    /// Give every run a launch of its own instead of running a model's configurations one
    /// after another in one launch per world size (slower; for bisecting a suspect run).
    #[arg(long)]
    isolated: bool,
    /// Print the summary rows as JSON lines instead of the table.
    #[arg(long)]
    json: bool,
    /// The backend launched ranks use: cpu (forked ranks), or nccl: exec'd ranks, each on
    /// the GPU of its LOCAL_RANK, the single-device reference on GPU 0, for DDP and FSDP
    /// configurations (the others keep CPU buffers); refused before anything runs (exit 2)
    /// without the `nccl` feature or one GPU per rank (docs/gpu.md).
    #[arg(long, default_value = "cpu", value_parser = parse_backend)]
    backend: lockstep_core::comm::Backend,
    #[command(flatten)]
    compute: ComputeArgs,
    /// Exec every rank as a fresh `lockstep rank` process instead of forking (what NCCL
    /// does); on the CPU backend it checks the exec'd path against the forked one.
    #[arg(long)]
    exec_ranks: bool,
    /// Write every quantity the fp64 arbiter judges (row, step, quantity, tensor, the run's
    /// and the fp32 reference's distance to float64, the tensor's scale) to this CSV file:
    /// the measurements the arbiter's constants come from (docs/parity.md).
    #[arg(long, value_name = "FILE")]
    arbiter_log: Option<std::path::PathBuf>,
    /// Instead of the matrix: a sensitivity analysis of every selected configuration at
    /// every world size, each on the first of mlp, gpt, gpt_moe, transformer (or of --models) it runs
    /// on; exit 1 naming every (config, site, fault) where a math-changing fault was missed.
    /// Writes sensitivity.json to --out.
    #[arg(long)]
    sensitivity: bool,
    #[command(flatten)]
    faults: FaultArgs,
}

/// `lockstep rank`: what the launcher tells every exec'd rank (see `lockstep::runner::rank_cmd`).
#[derive(clap::Args)]
struct RankArgs {
    /// The zoo model.
    #[arg(long)]
    model: String,
    /// The built-in configuration.
    #[arg(long)]
    config: String,
    /// Training steps.
    #[arg(long)]
    steps: usize,
    /// Run seed.
    #[arg(long)]
    seed: u64,
    /// Keep every step's gradients in the record.
    #[arg(long)]
    record_grads: bool,
    /// The backend the ranks communicate over.
    #[arg(long, value_parser = parse_backend)]
    backend: lockstep_core::comm::Backend,
    #[command(flatten)]
    compute: ComputeArgs,
    /// Where rank 0 writes its record.
    #[arg(long)]
    out: PathBuf,
    /// The optimizer, as JSON (`{"Adam":{"lr":0.001,…}}`); SGD with momentum if absent.
    #[arg(long, value_parser = parse_optimizer_json)]
    optimizer: Option<lockstep_core::train::OptimizerConfig>,
    /// A fault plan (sensitivity analysis), as JSON.
    #[arg(long, value_parser = parse_fault_plan_json)]
    fault_plan: Option<lockstep::runner::FaultPlan>,
}

/// A fault plan as the JSON exec'd ranks are given.
fn parse_fault_plan_json(s: &str) -> Result<lockstep::runner::FaultPlan, String> {
    serde_json::from_str(s).map_err(|e| format!("not a fault plan: {e}"))
}

/// An optimizer as the JSON exec'd ranks are given.
fn parse_optimizer_json(s: &str) -> Result<lockstep_core::train::OptimizerConfig, String> {
    serde_json::from_str(s).map_err(|e| format!("not an optimizer: {e}"))
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Train the benchmark decoder through a pipeline: step time against one process on one
    /// core, and the measured bubble against the schedule's simulated one.
    ///
    /// Example: `lockstep bench pipeline --schedule 1f1b --pipeline-ranks 2 --microbatches 8`.
    Pipeline {
        /// A built-in schedule (gpipe, 1f1b, interleaved_1f1b, looped_bfs, interleaved_zb,
        /// zbv, dualpipev; hyphens work too).
        #[arg(long, default_value = "1f1b")]
        schedule: String,
        /// Pipeline ranks (processes). `--stages` is the old name.
        #[arg(long = "pipeline-ranks", alias = "stages", default_value_t = 2)]
        stages: usize,
        #[arg(long, default_value_t = 8)]
        microbatches: usize,
        /// Stages per rank (default: the schedule's own).
        #[arg(long = "virtual")]
        virtual_stages: Option<usize>,
        /// Timed steps (after one warm-up step).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Write the timed steps' Chrome trace (one track per rank) to this file.
        #[arg(long)]
        trace: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Latency and bus bandwidth per collective and message size.
    Comm {
        #[arg(long, default_value = "cpu")]
        backend: String,
        /// Ranks (default 2; under torchrun/srun the launcher's WORLD_SIZE).
        #[arg(long)]
        world_size: Option<usize>,
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
    /// One training step (forward, backward, sync, optimizer) under DDP and FSDP full shard,
    /// or (--parallel tp|ep) under DDP and tensor or expert parallelism, with bytes per step.
    ///
    /// Every configuration runs on the CPU backend at the same world size, one libtorch
    /// thread per rank; each time is the median over --steps steps after one warm-up step.
    ///
    /// Example: `lockstep bench step --parallel tp --world-size 2`.
    Step {
        /// Ranks (default 2; under torchrun/srun the launcher's WORLD_SIZE).
        #[arg(long)]
        world_size: Option<usize>,
        /// `gpt`: the zoo's GPT-style decoder sized for the benchmark (vocab 512, dim 256, 8
        /// heads, 4 layers, 8 x 32 tokens per rank; under --parallel ep its top-2 of 8
        /// experts variant); any other zoo model runs at its zoo size.
        #[arg(long, default_value = "gpt")]
        model: String,
        /// Timed steps per run (after one warm-up step).
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// fsdp: DDP vs FSDP full shard; tp: DDP vs tensor parallel (tp = world size, with and
        /// without sequence parallelism); ep: DDP vs expert parallel (ep = world size).
        #[arg(long, value_enum, default_value = "fsdp")]
        parallel: bench::StepParallel,
        /// Print one JSON object (fsdp: model, world_size, ddp_seconds, fsdp_seconds, ratio,
        /// ...; tp/ep: model, parallel, world_size, parameters, steps, runs[config, seconds,
        /// ratio, bytes_per_step, calls_per_step, collectives]).
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
        Command::Setup {
            dir,
            libtorch,
            lockstep,
            offline,
        } => {
            use lockstep::setup_cmd;
            let Some(libtorch) = libtorch
                .or_else(|| std::env::var_os("LIBTORCH").map(PathBuf::from))
                .or_else(setup_cmd::built_libtorch)
            else {
                eprintln!("error: no libtorch known: pass --libtorch DIR or set LIBTORCH");
                return Ok(ExitCode::from(2));
            };
            let opts = setup_cmd::SetupOptions {
                dir,
                lockstep: lockstep.unwrap_or_else(setup_cmd::built_checkout),
                libtorch,
                offline,
            };
            match setup_cmd::setup(&opts) {
                Ok(report) => {
                    for change in &report.changes {
                        println!("set up: {change}");
                    }
                    for todo in &report.todo {
                        println!("to do: {todo}");
                    }
                    if report.changes.is_empty() && report.todo.is_empty() {
                        println!("already set up: nothing to change");
                    }
                }
                Err(e) => return Ok(bad_input(e)),
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
        Command::Matrix(args) => return run_matrix(args),
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

/// `lockstep matrix`: exit 0 when everything passed, 1 when a parity check or a run failed,
/// 2 when the input was unusable (nothing ran).
fn run_matrix(args: MatrixArgs) -> Result<ExitCode> {
    use lockstep::matrix;
    if args.list {
        return Ok(match matrix::render_list(args.selection.seed) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => bad_input(e),
        });
    }
    // Under torchrun/srun this process is one rank (`lockstep::runner::external`).
    let external = match lockstep::runner::external::detect() {
        Ok(external) => external,
        Err(e) => return Ok(bad_input(e)),
    };
    let opts = match matrix_run_options(&args, external) {
        Ok(opts) => opts,
        Err(code) => return Ok(code),
    };
    if args.sensitivity {
        if let Err(e) = matrix::check_backend(&opts) {
            return Ok(bad_input(e));
        }
        lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
        return run_matrix_sensitivity(&opts, &args.faults, &args.out);
    }
    // Only rank 0 of an external launch writes reports (the others may share its disk).
    let reporting = external.is_none_or(|l| l.rank == 0);
    let plan = match matrix::check_backend(&opts)
        .and_then(|()| matrix::plan(&opts))
        .and_then(|plan| {
            if reporting {
                matrix::prepare_out_dir(&args.out)?;
            }
            Ok(plan)
        }) {
        Ok(plan) => plan,
        Err(e) => return Ok(bad_input(e)),
    };
    // The references run in this process: on CUDA they need the same numerics as the ranks.
    lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
    if let (Some(launch), false) = (external, reporting) {
        return Ok(external_rank_summary(launch, &matrix::run_quietly(&plan)));
    }
    let bar = matrix::progress_bar(plan.run_count());
    let result = matrix::run(&plan, &bar);
    report_matrix(&result, &args)
}

/// Prints `error: <e>` and gives bad input's exit code (nothing run).
fn bad_input(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}

/// The matrix's options from the command line (an external launch's world size when none
/// is given), or the exit code of the bad input that prevents them.
fn matrix_run_options(
    args: &MatrixArgs,
    external: Option<&lockstep_core::comm::ExternalLaunch>,
) -> Result<lockstep::matrix::MatrixOptions, ExitCode> {
    let mut selection = args.selection.clone();
    if let Some(launch) = external {
        if let Some(refused) = external_refusal(args) {
            return Err(bad_input(format!(
                "{refused} has no external mode yet (under torchrun/srun every process is one rank)"
            )));
        }
        if selection.world_sizes.is_empty() {
            selection.world_sizes = vec![launch.world_size];
        }
    }
    let mut opts = matrix_options(selection, args.timeout).ok_or(ExitCode::from(2))?;
    opts.fault = args.fault.clone();
    opts.subtests = !args.isolated;
    opts.backend = args.backend;
    opts.device = args.compute.device(args.backend).map_err(bad_input)?;
    opts.tf32 = args.compute.tf32;
    opts.exec_ranks = args.exec_ranks;
    opts.arbiter_log = args.arbiter_log.clone();
    Ok(opts)
}

/// Prints the matrix's rows (and JSON lines with `--json`), writes its report set, and gives
/// the exit code: 0 passed, 1 a row failed, a run failed or the external launch stopped.
fn report_matrix(result: &lockstep::matrix::MatrixResult, args: &MatrixArgs) -> Result<ExitCode> {
    if args.json {
        for row in &result.rows {
            println!("{}", serde_json::to_string(row)?);
        }
        eprint!("{}", result.render_table());
    } else {
        print!("{}", result.render_table());
    }
    match result.write_report(&args.out) {
        Ok(files) if result.failed_runs > 0 => eprintln!(
            "report: {} (INCOMPLETE: {} of {} failed; their rows are errors)",
            files.json.display(),
            result.failed_runs,
            lockstep_harness::report::plural(result.runs, "run")
        ),
        Ok(files) => eprintln!("report: {}", files.json.display()),
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::FAILURE);
        }
    }
    if let Some(stopped) = lockstep::runner::external::stopped() {
        eprintln!("error: the external launch stopped: {}", stopped.line);
        return Ok(ExitCode::FAILURE);
    }
    Ok(if result.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The matrix option that has no external mode yet, if `args` uses one. (`--backend nccl`
/// and `--exec-ranks` have one: every process trains as an exec'd rank would.)
fn external_refusal(args: &MatrixArgs) -> Option<&'static str> {
    args.sensitivity
        .then_some("`lockstep matrix --sensitivity`")
}

/// What a rank other than 0 of an external launch says of a matrix it ran with every other
/// rank: one line (rank 0 prints the table and writes the report), and the exit code every
/// rank shares, since every rank judged the same records.
fn external_rank_summary(
    launch: &lockstep_core::comm::ExternalLaunch,
    result: &lockstep::matrix::MatrixResult,
) -> ExitCode {
    if let Some(stopped) = lockstep::runner::external::stopped() {
        eprintln!(
            "error: rank {} of {}: the external launch stopped: {}",
            launch.rank, launch.world_size, stopped.line
        );
        return ExitCode::FAILURE;
    }
    let verdict = if result.passed() { "passed" } else { "FAILED" };
    println!(
        "lockstep matrix rank {} of {}: {verdict} ({}; rank 0 prints the table and writes the report)",
        launch.rank,
        launch.world_size,
        lockstep_harness::report::plural(result.rows.len(), "row")
    );
    if result.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The analysis `faults` asks for, over `defaults` where it names nothing; `None` (after
/// saying why) for an unknown fault or a bad timeout.
fn sensitivity_options(
    faults: &FaultArgs,
    defaults: lockstep::sensitivity::SensitivityOptions,
) -> Option<lockstep::sensitivity::SensitivityOptions> {
    let mut opts = defaults;
    if !faults.faults.is_empty() {
        let mut kinds = Vec::new();
        for name in &faults.faults {
            // `perturb` alone: its ε is bisected anyway.
            let parsed = match name.as_str() {
                "perturb" => Ok(lockstep::comm::FaultKind::Perturb(1e-3)),
                other => other.parse(),
            };
            match parsed {
                Ok(kind) => kinds.push(kind),
                Err(e) => {
                    eprintln!("error: invalid option: --faults: {e}");
                    return None;
                }
            }
        }
        opts.kinds = kinds;
    }
    if !faults.site_steps.is_empty() {
        opts.site_steps.clone_from(&faults.site_steps);
    }
    opts.timeout = match std::time::Duration::try_from_secs_f64(faults.run_timeout) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!(
                "error: invalid option: --run-timeout {}: must be a positive number of seconds",
                faults.run_timeout
            );
            return None;
        }
    };
    Some(opts)
}

/// `lockstep sensitivity`: exit 0 when every math-changing fault was caught, 1 when one was
/// missed, 2 on bad input or a configuration that cannot be analysed.
fn run_sensitivity(args: SensitivityArgs) -> Result<ExitCode> {
    use lockstep::sensitivity::SensitivityOptions;
    let selection = SelectionArgs {
        models: vec![args.model.clone()],
        configs: vec![args.config.clone()],
        world_sizes: vec![args.world_size],
        steps: args.steps,
        seed: args.seed,
    };
    let (Some(mut opts), Some(analysis)) = (
        matrix_options(selection, args.timeout),
        sensitivity_options(&args.faults, SensitivityOptions::default()),
    ) else {
        return Ok(ExitCode::from(2));
    };
    opts.device = args
        .compute
        .device(lockstep_core::comm::Backend::Cpu)
        .unwrap_or_default();
    opts.tf32 = args.compute.tf32;
    if let Err(e) = lockstep::matrix::check_backend(&opts) {
        return Ok(bad_input(e));
    }
    lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
    let bar = lockstep::matrix::progress_bar(1);
    let report = match lockstep::matrix::sensitivity(
        &args.model,
        &args.config,
        args.world_size,
        &opts,
        &analysis,
        &bar,
    ) {
        Ok(r) => r,
        Err(e) => {
            bar.finish_and_clear();
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    if let Some(dir) = &args.out {
        report
            .write(dir)
            .context("writing the sensitivity report")?;
        eprintln!("report: {}", dir.join("sensitivity.json").display());
    }
    Ok(if report.misses(true).is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `lockstep matrix --sensitivity`: exit 0 when every math-changing fault was caught at every
/// site of every configuration analysed, 1 otherwise, 2 on bad input.
fn run_matrix_sensitivity(
    opts: &lockstep::matrix::MatrixOptions,
    faults: &FaultArgs,
    out: &std::path::Path,
) -> Result<ExitCode> {
    use lockstep::matrix;
    let Some(analysis) = sensitivity_options(
        faults,
        lockstep::sensitivity::SensitivityOptions::math_changing(),
    ) else {
        return Ok(ExitCode::from(2));
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("error: output directory {}: {e}", out.display());
        return Ok(ExitCode::from(2));
    }
    let started = std::time::Instant::now();
    let bar = matrix::progress_bar(1);
    let entries = match matrix::sensitivity_matrix(opts, &analysis, &bar) {
        Ok(entries) => entries,
        Err(e) => {
            bar.finish_and_clear();
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    bar.finish_and_clear();
    print!("{}", matrix::render_sensitivity_matrix(&entries));
    println!(
        "matrix --sensitivity: {} in {:.1} s",
        lockstep_harness::report::plural(entries.len(), "configuration"),
        started.elapsed().as_secs_f64()
    );
    let path = out.join("sensitivity.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&entries)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("report: {}", path.display());
    Ok(if matrix::sensitivity_matrix_passed(&entries) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The matrix options a selection describes; `None` (after saying why) for a timeout that is
/// not a positive number of seconds.
fn matrix_options(
    selection: SelectionArgs,
    timeout: f64,
) -> Option<lockstep::matrix::MatrixOptions> {
    let timeout = match std::time::Duration::try_from_secs_f64(timeout) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!(
                "error: invalid option: --timeout {timeout}: must be a positive number of seconds"
            );
            return None;
        }
    };
    Some(lockstep::matrix::MatrixOptions {
        models: selection.models,
        configs: selection.configs,
        world_sizes: selection.world_sizes,
        steps: selection.steps,
        seed: selection.seed,
        timeout,
        ..lockstep::matrix::MatrixOptions::default()
    })
}

/// `lockstep stress`: exit 0 when no run hung or failed, 1 otherwise, 2 on bad input.
fn run_stress(args: StressArgs) -> Result<ExitCode> {
    let Some(mut opts) = matrix_options(args.selection, args.timeout) else {
        return Ok(ExitCode::from(2));
    };
    opts.fault = args.fault;
    if args.repeat == 0 {
        eprintln!("error: invalid option: --repeat 0: must be at least 1");
        return Ok(ExitCode::from(2));
    }
    let plan = match lockstep::matrix::plan(&opts) {
        Ok(plan) => plan,
        Err(e) => return Ok(bad_input(e)),
    };
    let stress = lockstep::stress::StressOptions {
        repeat: args.repeat,
        busy_threads: args.busy_threads,
        max_send_delay: std::time::Duration::from_micros(args.send_delay_us),
    };
    eprintln!(
        "stress: {} per iteration, {}, {}, send delays up to {} us, timeout {:.0} s",
        plural(plan.run_count(), "run"),
        plural(stress.repeat, "iteration"),
        plural(stress.busy_threads, "busy thread"),
        args.send_delay_us,
        args.timeout
    );
    let outcome = lockstep::stress::run(&plan, &stress, |line| eprintln!("{line}"));
    print!("{}", outcome.render());
    Ok(if outcome.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `--backend`: the names `lockstep env` lists (cpu, nccl).
fn parse_backend(text: &str) -> Result<lockstep_core::comm::Backend, String> {
    text.parse()
        .map_err(|e: lockstep_core::CommError| e.to_string())
}

fn parse_fault(text: &str) -> Result<lockstep_core::ddp::Fault, String> {
    use lockstep_core::ddp::Fault;
    match text {
        "sum" => Ok(Fault::SumInsteadOfAverage),
        "no-buffer-broadcast" => Ok(Fault::NoBufferBroadcast),
        "reduce-experts" => Ok(Fault::ReduceExperts),
        "stall" => Ok(Fault::StallLastRank),
        "other-half" => Ok(Fault::ComputeInOtherHalf),
        "reduce-in-half" => Ok(Fault::ReduceInComputeDtype),
        "half-master" => Ok(Fault::HalfPrecisionMaster),
        _ => match text.strip_prefix("skip=") {
            Some(param) if !param.is_empty() => Ok(Fault::SkipParameter(param.to_owned())),
            _ => Err(
                "expected sum, no-buffer-broadcast, reduce-experts, stall, other-half, \
                     reduce-in-half, half-master or skip=PARAM"
                    .into(),
            ),
        },
    }
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
fn bench_comm(
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
fn bench_spawn(world_size: usize, repeats: usize, mode: SpawnBenchMode, json: bool) -> Result<()> {
    let r = bench::run_spawn(world_size, repeats, mode).context("spawn benchmark")?;
    if json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        print!("{}", bench::text::spawn_line(&r));
    }
    Ok(())
}

/// `lockstep bench pipeline`: step time and measured bubble against the simulated one.
fn bench_pipeline(opts: bench::PipelineBenchOptions, json: bool) -> Result<()> {
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
fn bench_step(opts: StepBenchOptions, json: bool) -> Result<()> {
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
