//! The command line: every command and its flags (clap), and the parsers of their values.

use anyhow::Result;
use clap::{Parser, Subcommand};
use lockstep::bench::{self, BenchOp, SpawnBenchMode};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "lockstep",
    version,
    about = "Proves distributed training is numerically right"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// Compare two parity reports; exit 1 if a configuration regressed, 2 on bad input.
    ///
    /// Either side is a full report (report.json) or a compact baseline (baseline.jsonl, the
    /// file a repository keeps: see `lockstep baseline update`). A configuration regresses
    /// when it vanished from NEW, errored in NEW, passed in BASE but fails in NEW, or its max
    /// abs error grew more than FACTOR times. Errors at or below FLOOR count as noise, so
    /// growth from exactly 0 is flagged only above it.
    Compare {
        /// The earlier report or baseline (e.g. the one committed on main).
        base: PathBuf,
        /// The report or baseline to check.
        new: PathBuf,
        /// Flag errors that grew more than this many times.
        #[arg(long, default_value_t = 10.0)]
        factor: f64,
        /// Errors at or below this are treated as noise.
        #[arg(long, default_value_t = 1e-12)]
        floor: f64,
    },
    /// The compact baseline a repository keeps beside its code (docs/matrix.md).
    Baseline {
        #[command(subcommand)]
        what: BaselineCommand,
    },
    /// Judge a training job Lockstep did not run (a PyTorch job recorded with
    /// python/lockstep_probe): its record against the single-device reference trained from the
    /// same start and batches, by the fp64 arbiter when the float64 shadow is given (else the
    /// fp32 dtype table). Writes report.json, report.md, junit.xml and report.html into --out;
    /// exit 0 passed, 1 a check failed, 2 bad input (nothing written). See docs/judge.md.
    Judge {
        /// The job's record (a directory with record.json, or the file).
        #[arg(long)]
        run: PathBuf,
        /// The fp32 single-device reference's record.
        #[arg(long)]
        reference: PathBuf,
        /// The reference's float64 shadow's record: the fp64 arbiter judges with it.
        #[arg(long)]
        shadow: Option<PathBuf>,
        /// Where the reports go.
        #[arg(long, default_value = "lockstep-judge")]
        out: PathBuf,
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
pub(crate) struct SelectionArgs {
    /// Models to run: names or patterns with `*` (e.g. `nested,gpt*`); default all.
    #[arg(long, value_delimiter = ',')]
    pub(crate) models: Vec<String>,
    /// Configs to check: names or patterns (e.g. `ddp*`); default all.
    #[arg(long, value_delimiter = ',')]
    pub(crate) configs: Vec<String>,
    /// World sizes (repeatable or comma-separated, e.g. `2,4`); default 4, or the size of
    /// the --mesh given.
    #[arg(long = "world-size", value_delimiter = ',')]
    pub(crate) world_sizes: Vec<usize>,
    /// Your own device mesh, as torchtitan describes it (repeatable): e.g. `--mesh
    /// pp=2,dp_shard=2,tp=2` or `--mesh cp=2,tp=2` (dimensions pp, dp_replicate, dp_shard,
    /// cp, tp, ep; without dp_replicate and dp_shard, dp_shard takes the rest of the world).
    /// Its row is `mesh.<sizes>` (`mesh.cp2.tp2`), judged against single; alone, it is the
    /// only configuration run, at its own size when the mesh fixes one.
    #[arg(long = "mesh")]
    pub(crate) meshes: Vec<String>,
    /// Training steps per run.
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
    /// Run seed for parameters and batches.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
}

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// The zoo model (`lockstep matrix --list` names them).
    #[arg(long)]
    pub(crate) model: String,
    /// The configuration (`lockstep matrix --list` names them), e.g. single, ddp.
    #[arg(long)]
    pub(crate) config: String,
    /// Ranks (for single: how many ranks' batches form the global batch); default 2, or
    /// `WORLD_SIZE` under an external launch (torchrun, srun).
    #[arg(long = "world-size")]
    pub(crate) world_size: Option<usize>,
    /// Training steps.
    #[arg(long, default_value_t = 5)]
    pub(crate) steps: usize,
    /// Run seed for parameters and batches (default: the checkpoint's when continuing one,
    /// else 0).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Start every rank from this state dict (safetensors, PyTorch's parameter names).
    #[arg(long)]
    pub(crate) init: Option<PathBuf>,
    /// With --init: use only the weights, at step 0 with a fresh optimizer, even when the
    /// file carries an optimizer state.
    #[arg(long, requires = "init")]
    pub(crate) restart: bool,
    /// Write the initial full state dict here (safetensors).
    #[arg(long = "save-init")]
    pub(crate) save_init: Option<PathBuf>,
    /// Write the final full state dict here (and, from single or ddp*, its optimizer state
    /// next to it as NAME.optim.safetensors).
    #[arg(long = "save-final")]
    pub(crate) save_final: Option<PathBuf>,
    /// Seconds the launch may take before it is declared hung.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) timeout: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
}

/// Where runs compute (shared by `matrix`, `run` and the hidden `rank`): see docs/gpu.md.
#[derive(clap::Args, Clone, Copy)]
pub(crate) struct ComputeArgs {
    /// cpu or cuda. cuda on the CPU backend: ranks spread over the visible GPUs round robin
    /// (several ranks may share one), collectives staged through host memory, the
    /// single-device reference on GPU 0. NCCL always computes on CUDA. Every CUDA process runs
    /// with deterministic kernels, a fixed cuBLAS workspace and TF32 off. Refused before
    /// anything runs (exit 2) without a GPU.
    #[arg(long, value_parser = lockstep::device::ComputeDevice::parse)]
    pub(crate) device: Option<lockstep::device::ComputeDevice>,
    /// Allow TF32 matrix products and convolutions on CUDA (off by default: fp32 arithmetic).
    #[arg(long)]
    pub(crate) tf32: bool,
}

impl ComputeArgs {
    /// The device runs compute on with `backend`, or why that cannot be.
    pub(crate) fn device(
        self,
        backend: lockstep_core::comm::Backend,
    ) -> anyhow::Result<lockstep::device::ComputeDevice> {
        lockstep::device::ComputeDevice::resolve(self.device, backend).map_err(anyhow::Error::msg)
    }
}

/// What a sensitivity analysis tries (shared by `sensitivity` and `matrix --sensitivity`).
#[derive(clap::Args)]
pub(crate) struct FaultArgs {
    /// Faults to try at every site: skip, double, zero, wrong_peer, permuted, stale, perturb
    /// (its ε bisected over 1e-1..1e-8), bf16. Default: all of them (`matrix --sensitivity`:
    /// the six math-changing ones).
    #[arg(long, value_delimiter = ',')]
    pub(crate) faults: Vec<String>,
    /// Steps whose calls are sites. Default: 0,1 (`matrix --sensitivity`: 0).
    #[arg(long = "site-steps", value_delimiter = ',')]
    pub(crate) site_steps: Vec<usize>,
    /// Seconds one faulted run may take before it counts as a hang (caught).
    #[arg(long = "run-timeout", default_value_t = 20.0)]
    pub(crate) run_timeout: f64,
}

#[derive(clap::Args)]
pub(crate) struct SensitivityArgs {
    /// The zoo model.
    #[arg(long)]
    pub(crate) model: String,
    /// The configuration (`lockstep matrix --list` names them).
    #[arg(long)]
    pub(crate) config: String,
    /// Ranks.
    #[arg(long = "world-size", default_value_t = 2)]
    pub(crate) world_size: usize,
    /// Training steps per run.
    #[arg(long, default_value_t = 3)]
    pub(crate) steps: usize,
    /// Run seed for parameters and batches.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    #[command(flatten)]
    pub(crate) faults: FaultArgs,
    /// Seconds the references and the dry run may take.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) timeout: f64,
    /// Directory for sensitivity.json and sensitivity.md (created if missing).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
    /// Print the report as JSON instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
}

#[derive(clap::Args)]
pub(crate) struct ScheduleArgs {
    /// A built-in schedule (ignored with --csv).
    #[arg(long, default_value = "1f1b")]
    pub(crate) schedule: String,
    /// Pipeline ranks (processes); each holds `--virtual` stages. `--stages` is the old name.
    #[arg(long = "pipeline-ranks", alias = "stages", default_value_t = 4)]
    pub(crate) stages: usize,
    /// Microbatches per step.
    #[arg(long, default_value_t = 8)]
    pub(crate) microbatches: usize,
    /// Stages per rank (default: the schedule's own, 1 or 2).
    #[arg(long = "virtual")]
    pub(crate) virtual_stages: Option<usize>,
    /// Load the schedule from a CSV file instead (one row of actions per rank).
    #[arg(long)]
    pub(crate) csv: Option<PathBuf>,
    /// Write the schedule's compute actions as CSV to this file.
    #[arg(long)]
    pub(crate) export: Option<PathBuf>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Subcommand)]
pub(crate) enum BaselineCommand {
    /// Replace BASELINE with a run's results, on purpose: prints what changed against the
    /// current one (regressions first), then writes it. Refuses an incomplete run (a run
    /// errored) unless --allow-incomplete. Exit 0 written, 2 bad input (nothing written).
    ///
    /// Example: `lockstep baseline update parity/baseline.jsonl --from lockstep-report`.
    Update {
        /// The baseline file the repository keeps (created if missing).
        baseline: PathBuf,
        /// The run to take it from: a report directory, its report.json or baseline.jsonl.
        #[arg(long)]
        from: PathBuf,
        /// Write it even though some of the run's comparisons errored.
        #[arg(long)]
        allow_incomplete: bool,
    },
}

#[derive(clap::Args)]
pub(crate) struct StressArgs {
    #[command(flatten)]
    pub(crate) selection: SelectionArgs,
    /// How many times to run the whole selection.
    #[arg(long, default_value_t = 20)]
    pub(crate) repeat: usize,
    /// Busy threads spinning in the launcher for the whole stress (CPU contention).
    #[arg(long = "busy-threads", default_value_t = 2)]
    pub(crate) busy_threads: usize,
    /// Longest random delay, in microseconds, before every message a rank sends.
    #[arg(long = "send-delay-us", default_value_t = 200)]
    pub(crate) send_delay_us: u64,
    /// Seconds one launch may take before it counts as a hang.
    #[arg(long, default_value_t = 60.0)]
    pub(crate) timeout: f64,
    /// Plant a bug in every DDP run (as `matrix --fault`), e.g. `stall` to prove a hang is
    /// found.
    #[arg(long, hide = true, value_parser = parse_fault)]
    pub(crate) fault: Option<lockstep::runner::PlantedFault>,
}

#[derive(clap::Args)]
pub(crate) struct MatrixArgs {
    #[command(flatten)]
    pub(crate) selection: SelectionArgs,
    /// Directory for the report set (created if missing).
    #[arg(long, default_value = lockstep::matrix::DEFAULT_OUT_DIR)]
    pub(crate) out: PathBuf,
    /// Seconds one launch may take before it is declared hung.
    #[arg(long, default_value_t = 300.0)]
    pub(crate) timeout: f64,
    /// Plant a bug to see the matrix catch it. In every DDP run: sum (gradients summed, not
    /// averaged), no-buffer-broadcast, reduce-experts, stall (the last rank hangs before its
    /// first gradient reduction), or skip=PARAM. A published bug's mechanism in every loop
    /// that has it (docs/bugs.md): expert-grads-per-ep-rank, norm-over-own-experts,
    /// loss-not-reduced-over-cp, kv-grads-not-returned, tp-input-grad-not-reduced.
    #[arg(long, hide = true, value_parser = parse_fault)]
    pub(crate) fault: Option<lockstep::runner::PlantedFault>,
    /// List the configs (with the models each applies to) and the models, then exit.
    #[arg(long)]
    pub(crate) list: bool,
    /// Give every run a launch of its own instead of running a model's configurations one
    /// after another in one launch per world size (slower; for bisecting a suspect run).
    #[arg(long)]
    pub(crate) isolated: bool,
    /// Print the summary rows as JSON lines instead of the summary.
    #[arg(long)]
    pub(crate) json: bool,
    /// Print every row (the full table) instead of the compact summary (on stderr with
    /// `--json`).
    #[arg(long)]
    pub(crate) rows: bool,
    /// Compare the results with this baseline (baseline.jsonl, or a report.json) and list
    /// what regressed; a regression fails the matrix (exit 1). Read before anything runs.
    #[arg(long, value_name = "FILE")]
    pub(crate) baseline: Option<PathBuf>,
    /// The backend launched ranks use: cpu (forked ranks), or nccl: exec'd ranks, each on
    /// the GPU of its LOCAL_RANK, where every configuration trains, the single-device
    /// reference on GPU 0; refused before anything runs (exit 2) without the `nccl` feature
    /// or one GPU per rank (docs/gpu.md).
    #[arg(long, default_value = "cpu", value_parser = parse_backend)]
    pub(crate) backend: lockstep_core::comm::Backend,
    /// When a send completes on the CPU backend: buffered (when its bytes are handed over),
    /// or rendezvous (only once the receiver posted the matching receive, as NCCL does), which
    /// proves on the CPU that no configuration relies on buffered sends; a run that does
    /// fails naming the send. Default: the LOCKSTEP_P2P variable, else buffered.
    #[arg(long, value_parser = parse_p2p)]
    pub(crate) p2p: Option<lockstep_core::comm::PointToPoint>,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    /// Exec every rank as a fresh `lockstep rank` process instead of forking (what NCCL
    /// does); on the CPU backend it checks the exec'd path against the forked one.
    #[arg(long)]
    pub(crate) exec_ranks: bool,
    /// Write every quantity the fp64 arbiter judges (row, step, quantity, tensor, the run's
    /// and the fp32 reference's distance to float64, the tensor's scale) to this CSV file:
    /// the measurements the arbiter's constants come from (docs/parity.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) arbiter_log: Option<std::path::PathBuf>,
    /// Instead of the matrix: a sensitivity analysis of every selected configuration at
    /// every world size, each on the first of mlp, gpt, gpt_moe, transformer (or of --models) it runs
    /// on; exit 1 naming every (config, site, fault) where a math-changing fault was missed.
    /// Writes sensitivity.json to --out.
    #[arg(long)]
    pub(crate) sensitivity: bool,
    #[command(flatten)]
    pub(crate) faults: FaultArgs,
}

/// `lockstep rank`: what the launcher tells every exec'd rank (see `lockstep::runner::rank_cmd`).
#[derive(clap::Args)]
pub(crate) struct RankArgs {
    /// The zoo model.
    #[arg(long)]
    pub(crate) model: String,
    /// The built-in configuration.
    #[arg(long)]
    pub(crate) config: String,
    /// Training steps.
    #[arg(long)]
    pub(crate) steps: usize,
    /// Run seed.
    #[arg(long)]
    pub(crate) seed: u64,
    /// Keep every step's gradients in the record.
    #[arg(long)]
    pub(crate) record_grads: bool,
    /// The backend the ranks communicate over.
    #[arg(long, value_parser = parse_backend)]
    pub(crate) backend: lockstep_core::comm::Backend,
    #[command(flatten)]
    pub(crate) compute: ComputeArgs,
    /// Where rank 0 writes its record.
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// The optimizer, as JSON (`{"Adam":{"lr":0.001,…}}`); SGD with momentum if absent.
    #[arg(long, value_parser = parse_optimizer_json)]
    pub(crate) optimizer: Option<lockstep_core::train::OptimizerConfig>,
    /// A fault plan (sensitivity analysis), as JSON.
    #[arg(long, value_parser = parse_fault_plan_json)]
    pub(crate) fault_plan: Option<lockstep::runner::FaultPlan>,
}

/// A fault plan as the JSON exec'd ranks are given.
pub(crate) fn parse_fault_plan_json(s: &str) -> Result<lockstep::runner::FaultPlan, String> {
    serde_json::from_str(s).map_err(|e| format!("not a fault plan: {e}"))
}

/// An optimizer as the JSON exec'd ranks are given.
pub(crate) fn parse_optimizer_json(
    s: &str,
) -> Result<lockstep_core::train::OptimizerConfig, String> {
    serde_json::from_str(s).map_err(|e| format!("not an optimizer: {e}"))
}

#[derive(Subcommand)]
pub(crate) enum BenchCommand {
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

/// `--backend`: the names `lockstep env` lists (cpu, nccl).
pub(crate) fn parse_p2p(s: &str) -> Result<lockstep_core::comm::PointToPoint, String> {
    s.parse()
        .map_err(|e: lockstep_core::CommError| e.to_string())
}

fn parse_backend(text: &str) -> Result<lockstep_core::comm::Backend, String> {
    text.parse()
        .map_err(|e: lockstep_core::CommError| e.to_string())
}

pub(crate) fn parse_fault(text: &str) -> Result<lockstep::runner::PlantedFault, String> {
    use lockstep::runner::PlantedFault;
    use lockstep_core::ddp::DdpFault;
    use lockstep_core::field_bugs::FieldBug;
    let ddp = match text {
        "sum" => DdpFault::SumInsteadOfAverage,
        "no-buffer-broadcast" => DdpFault::NoBufferBroadcast,
        "reduce-experts" => DdpFault::ReduceExperts,
        "stall" => DdpFault::StallLastRank,
        "other-half" => DdpFault::ComputeInOtherHalf,
        "reduce-in-half" => DdpFault::ReduceInComputeDtype,
        "half-master" => DdpFault::HalfPrecisionMaster,
        _ => match (text.strip_prefix("skip="), FieldBug::named(text)) {
            (Some(param), _) if !param.is_empty() => DdpFault::SkipParameter(param.to_owned()),
            (_, Some(bug)) => return Ok(PlantedFault::Field(bug)),
            _ => {
                let field: Vec<&str> = FieldBug::ALL.iter().map(|b| b.name()).collect();
                return Err(format!(
                    "expected sum, no-buffer-broadcast, reduce-experts, stall, other-half, \
                     reduce-in-half, half-master, skip=PARAM, or a field bug: {}",
                    field.join(", ")
                ));
            }
        },
    };
    Ok(PlantedFault::Ddp(ddp))
}
