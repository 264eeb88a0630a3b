//! `bench step`: one training step of the same model under several configurations, each in a
//! fresh launch of forked ranks. By default DDP against FSDP full shard (one root unit, and
//! one unit per layer); with `--parallel tp` DDP against tensor parallelism (with and without
//! sequence parallelism), with `--parallel ep` DDP against expert parallelism of the
//! mixture-of-experts decoder — those two also count the bytes each step communicates.

use super::gpt::Clocked;
use super::{results_path, BenchError, GptDims};
use crate::runner::hand_back::{hand_back_json, RankError};
use lockstep_core::comm::{Backend, CollectiveCounts, CountingGroup, ExternalLaunch, ProcessGroup};
use lockstep_core::expert_parallel::{check_expert_plan, Dispatcher, EpOptions};
use lockstep_core::record::{CollectiveEntry, RunRecord};
use lockstep_core::tensor_parallel::{check_plan, TpOptions};
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use lockstep_models::{Model, ModelError};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// Which comparison `bench step` runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StepParallel {
    /// DDP against FSDP full shard, one root unit and one unit per layer ([`run_step`]).
    #[default]
    Fsdp,
    /// DDP against tensor parallelism over the whole world (tp = world size), without and
    /// with sequence parallelism ([`run_parallel_step`]).
    Tp,
    /// DDP against expert parallelism over the whole world (ep = world size, all-to-all
    /// dispatcher) of the mixture-of-experts decoder ([`run_parallel_step`]).
    Ep,
}

/// What `bench step` runs.
#[derive(Clone, Debug)]
pub struct StepBenchOptions {
    /// Ranks to launch, one process each.
    pub world_size: usize,
    /// `gpt` (the benchmark decoder, sized by `dims`; its mixture-of-experts variant under
    /// `--parallel ep`) or any other zoo model name (as built).
    pub model: String,
    /// The decoder's size when `model` is `gpt`.
    pub dims: GptDims,
    /// Timed steps (after one warm-up step); the median is reported.
    pub steps: usize,
    /// The comparison: DDP against FSDP (default), tensor or expert parallelism.
    pub parallel: StepParallel,
}

impl Default for StepBenchOptions {
    fn default() -> Self {
        StepBenchOptions {
            world_size: 2,
            model: "gpt".into(),
            dims: GptDims::BENCH,
            steps: 5,
            parallel: StepParallel::Fsdp,
        }
    }
}

/// The result of `bench step` (one JSON object with `--json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct StepResult {
    /// The model trained (`gpt` for the benchmark decoder, else the zoo name).
    pub model: String,
    /// Ranks each run used.
    pub world_size: usize,
    /// Median seconds per DDP training step (forward, backward, gradient sync, optimizer).
    pub ddp_seconds: f64,
    /// Median seconds per FSDP full-shard step (unshard, forward, backward, reduce-scatter,
    /// sharded optimizer step).
    pub fsdp_seconds: f64,
    /// `fsdp_seconds / ddp_seconds`.
    pub ratio: f64,
    /// Median seconds per FSDP full-shard step with one unit per layer, freed after its
    /// forward and re-gathered (prefetched) for backward: the configuration that saves memory.
    pub fsdp_per_layer_seconds: f64,
    /// `fsdp_per_layer_seconds / ddp_seconds`.
    pub per_layer_ratio: f64,
    /// Trainable parameters of the model.
    pub parameters: i64,
    /// Timed steps per run (the medians are over these).
    pub steps: usize,
}

/// The result of `bench step --parallel tp|ep` (one JSON object with `--json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParallelStepResult {
    /// The model trained: `gpt` / `gpt_moe` for the benchmark decoder, else the zoo name.
    pub model: String,
    /// `tp` or `ep`.
    pub parallel: String,
    /// Ranks each run used.
    pub world_size: usize,
    /// Trainable parameters of the (whole) model.
    pub parameters: i64,
    /// Timed steps per run (medians and means are over these).
    pub steps: usize,
    /// One entry per configuration, `ddp` first.
    pub runs: Vec<ParallelStepRun>,
}

/// One configuration of `bench step --parallel tp|ep`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParallelStepRun {
    /// `ddp`, `tp` (tp = world size), `tp+sp` (with sequence parallelism) or `ep` (ep = world
    /// size, all-to-all dispatcher).
    pub config: String,
    /// Median seconds per training step on rank 0.
    pub seconds: f64,
    /// `seconds` over DDP's.
    pub ratio: f64,
    /// Bytes rank 0 handed to collectives per training step, mean over the timed steps (as
    /// `CountingGroup` counts them: an all-reduce's tensor, an all-gather's input shard, a
    /// reduce-scatter's or all-to-all's full input). DDP: everything its step communicates
    /// (gradient buckets and the 8-byte loss average); TP and EP: the training collectives
    /// their run records keep, without the gathers that assemble full gradients for the
    /// record's norm (see `RunRecord.collectives`).
    pub bytes_per_step: f64,
    /// Collective calls rank 0 issued per training step, mean over the timed steps.
    pub calls_per_step: f64,
    /// The first timed step's collectives on rank 0 per (operation, group).
    pub collectives: Vec<CollectiveEntry>,
}

/// What one benchmark launch trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepRun {
    Ddp,
    FsdpFullShard,
    FsdpPerLayer,
    /// Tensor parallel over the whole world.
    Tp {
        sequence_parallel: bool,
    },
    /// Expert parallel over the whole world, all-to-all dispatcher.
    Ep,
}

impl StepRun {
    fn label(self) -> &'static str {
        match self {
            StepRun::Ddp => "ddp",
            StepRun::FsdpFullShard => "fsdp",
            StepRun::FsdpPerLayer => "fsdp-per-layer",
            StepRun::Tp {
                sequence_parallel: false,
            } => "tp",
            StepRun::Tp {
                sequence_parallel: true,
            } => "tp+sp",
            StepRun::Ep => "ep",
        }
    }

    fn tp_options(world_size: usize, sequence_parallel: bool) -> TpOptions {
        TpOptions {
            tp: world_size,
            sequence_parallel,
            data_parallel: Default::default(),
            fault: None,
        }
    }

    fn ep_options(world_size: usize) -> EpOptions {
        EpOptions {
            ep: world_size,
            dispatcher: Dispatcher::AllToAll,
            capacity_factor: None,
            data_parallel: Default::default(),
            fault: None,
        }
    }
}

/// Rejects options that cannot describe a run (before any rank starts).
fn check_options(opts: &StepBenchOptions) -> Result<(), BenchError> {
    if opts.world_size < 2 {
        return Err(BenchError::Invalid(
            "the step benchmark needs --world-size 2 or more".into(),
        ));
    }
    if opts.steps == 0 {
        return Err(BenchError::Invalid("--steps must be at least 1".into()));
    }
    if opts.model == "gpt" {
        opts.dims
            .config()
            .check()
            .map_err(|e| BenchError::Invalid(format!("decoder dims {:?}: {e}", opts.dims)))?;
    } else if !lockstep_models::zoo::names().contains(&opts.model.as_str()) {
        return Err(BenchError::Invalid(format!(
            "unknown model `{}`; known: gpt (the benchmark decoder) and the zoo: {}",
            opts.model,
            lockstep_models::zoo::names().join(", ")
        )));
    }
    Ok(())
}

/// Times training steps under DDP and FSDP full shard on the CPU backend, each in a fresh
/// launch of `world_size` forked ranks (one libtorch thread each). A step is timed from one
/// step's batch request to the next one's on rank 0 (so it spans forward, backward, gradient
/// synchronization, the loss all-reduce, the optimizer step and FSDP's unshard before the
/// next forward); the first (warm-up) step is dropped and the median of the rest reported.
/// `opts.parallel` is ignored (see [`run_parallel_step`]).
pub fn run_step(opts: &StepBenchOptions) -> Result<StepResult, BenchError> {
    check_options(opts)?;
    lockstep_harness::threads::use_launcher_threads();
    let ddp = time_steps(opts, StepRun::Ddp)?;
    let fsdp = time_steps(opts, StepRun::FsdpFullShard)?;
    let per_layer = time_steps(opts, StepRun::FsdpPerLayer)?;
    Ok(StepResult {
        model: opts.model.clone(),
        world_size: opts.world_size,
        ddp_seconds: ddp.seconds,
        fsdp_seconds: fsdp.seconds,
        ratio: fsdp.seconds / ddp.seconds,
        fsdp_per_layer_seconds: per_layer.seconds,
        per_layer_ratio: per_layer.seconds / ddp.seconds,
        parameters: ddp.parameters,
        steps: opts.steps,
    })
}

/// Times training steps of one model under DDP and under tensor parallelism (`tp`: tp = world
/// size, then with sequence parallelism when the plan has it) or expert parallelism (`ep`:
/// ep = world size, all-to-all dispatcher; the benchmark decoder becomes its mixture-of-experts
/// variant), each in a fresh launch of forked ranks timed as [`run_step`] times them, and
/// counts the bytes rank 0 hands to collectives per step. The plan is checked before any rank
/// starts: a world of one, heads or vocabulary that tp does not divide, experts that ep does
/// not divide are [`BenchError::Invalid`].
pub fn run_parallel_step(opts: &StepBenchOptions) -> Result<ParallelStepResult, BenchError> {
    check_options(opts)?;
    let probe = build_model(opts, 0).map_err(|e| BenchError::Invalid(e.to_string()))?;
    let world = opts.world_size;
    let mut configs = vec![StepRun::Ddp];
    let parallel = match opts.parallel {
        StepParallel::Fsdp => {
            return Err(BenchError::Invalid(
                "run_parallel_step compares DDP with --parallel tp or ep".into(),
            ))
        }
        StepParallel::Tp => {
            check_plan(probe.as_ref(), world, &StepRun::tp_options(world, false))
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            configs.push(StepRun::Tp {
                sequence_parallel: false,
            });
            // Sequence parallelism too where the plan has it (the decoder's does).
            if check_plan(probe.as_ref(), world, &StepRun::tp_options(world, true)).is_ok() {
                configs.push(StepRun::Tp {
                    sequence_parallel: true,
                });
            }
            "tp"
        }
        StepParallel::Ep => {
            check_expert_plan(probe.as_ref(), world, &StepRun::ep_options(world))
                .map_err(|e| BenchError::Invalid(e.to_string()))?;
            configs.push(StepRun::Ep);
            "ep"
        }
    };
    let model = probe.name().to_owned();
    let parameters = probe.num_parameters();
    drop(probe);
    lockstep_harness::threads::use_launcher_threads();
    let mut runs: Vec<ParallelStepRun> = Vec::with_capacity(configs.len());
    for config in configs {
        let t = time_steps(opts, config)?;
        let n = t.traffic.len().max(1) as f64;
        let total = |f: fn(&CollectiveEntry) -> u64| -> f64 {
            t.traffic.iter().flatten().map(f).sum::<u64>() as f64 / n
        };
        let ddp_seconds = runs.first().map_or(t.seconds, |d| d.seconds);
        runs.push(ParallelStepRun {
            config: config.label().to_owned(),
            seconds: t.seconds,
            ratio: t.seconds / ddp_seconds,
            bytes_per_step: total(|e| e.bytes),
            calls_per_step: total(|e| e.calls),
            collectives: t.traffic.first().cloned().unwrap_or_default(),
        });
    }
    Ok(ParallelStepResult {
        model,
        parallel: parallel.to_owned(),
        world_size: world,
        parameters,
        steps: opts.steps,
        runs,
    })
}

/// The model a rank trains: the benchmark decoder at `opts.dims` (its mixture-of-experts
/// variant under `--parallel ep`) or the zoo model as built.
fn build_model(opts: &StepBenchOptions, rank: usize) -> Result<Box<dyn Model>, ModelError> {
    let seed = 0;
    if opts.model == "gpt" {
        let moe = opts.parallel == StepParallel::Ep;
        Ok(Box::new(opts.dims.build(seed, rank, moe)?))
    } else {
        lockstep_models::zoo::build(&opts.model, seed, rank)
    }
}

/// What rank 0 of one launch reports.
#[derive(Serialize, Deserialize)]
struct StepTimes {
    seconds: Vec<f64>,
    parameters: i64,
    /// Each timed step's collectives (empty for FSDP, which is not counted).
    traffic: Vec<Vec<CollectiveEntry>>,
}

/// One launch's figures: the median step time, the parameter count, each timed step's
/// collectives on rank 0.
struct RunTimes {
    seconds: f64,
    parameters: i64,
    traffic: Vec<Vec<CollectiveEntry>>,
}

/// One launch of `opts.world_size` forked ranks training under `run`.
fn time_steps(opts: &StepBenchOptions, run: StepRun) -> Result<RunTimes, BenchError> {
    // Under an external launch (torchrun, srun) the "file" is a store key every rank names
    // alike; otherwise a fresh file the forked rank 0 writes.
    let external = crate::runner::external::launch();
    let out = crate::runner::external::scratch_path("step").unwrap_or_else(|| results_path("step"));
    let body = |ctx: &RankCtx| -> Result<(), RankError> { time_rank(opts, run, ctx, &out) };
    let launched = launch_ranks(opts, run, external, &body);
    let read = crate::runner::hand_back::take_handed_back(&out);
    launched?;
    let read = read.ok_or_else(|| BenchError::Failed("rank 0 handed back no step times".into()))?;
    median_times(&read)
}

/// One rank's share of a launch: trains under `run`; rank 0 hands its step times to `out`.
fn time_rank(
    opts: &StepBenchOptions,
    run: StepRun,
    ctx: &RankCtx,
    out: &Path,
) -> Result<(), RankError> {
    let rank = ctx.rank();
    let counts = (run == StepRun::Ddp).then(CollectiveCounts::new);
    let clocked = Clocked::new(build_model(opts, rank)?, counts.clone());
    let model: &dyn Model = &clocked;
    let cfg = step_train_config(opts, run, model, ctx);
    let recorded = train_under(run, model, ctx, &cfg, counts.as_ref())?;
    if rank == 0 {
        let times = rank_zero_times(opts, &clocked, counts.is_some(), recorded)?;
        hand_back_json("the step times", out, &times)?;
    }
    Ok(())
}

/// The training configuration every rank of a benchmark launch shares (on its own batch).
fn step_train_config(
    opts: &StepBenchOptions,
    run: StepRun,
    model: &dyn Model,
    ctx: &RankCtx,
) -> lockstep_core::train::TrainConfig {
    use lockstep_core::record::RunSpec;
    use lockstep_core::train::{OptimizerConfig, TrainConfig};

    // Warm-up, the timed steps, and one more whose batch request ends the last.
    let steps = opts.steps + 2;
    TrainConfig {
        spec: RunSpec {
            model: model.name().to_owned(),
            config: run.label().to_owned(),
            world_size: ctx.world_size(),
            backend: "cpu".into(),
            dtype: "fp32".into(),
            steps,
            seed: 0,
        },
        optimizer: OptimizerConfig::default(),
        data_ranks: vec![ctx.rank()],
        record_grads: false,
        probe: None,
    }
}

/// Trains `model` under `run` on this rank (DDP through a counting group given `counts`).
fn train_under(
    run: StepRun,
    model: &dyn Model,
    ctx: &RankCtx,
    cfg: &lockstep_core::train::TrainConfig,
    counts: Option<&CollectiveCounts>,
) -> Result<RunRecord, RankError> {
    use lockstep_core::ddp::{train_ddp, DdpOptions};
    use lockstep_core::expert_parallel::train_expert_parallel;
    use lockstep_core::fsdp::{train_fsdp, FsdpOptions, ShardingStrategy, WrapPolicy};
    use lockstep_core::tensor_parallel::train_tensor_parallel;

    let world = ctx.world_size();
    let recorded = match run {
        StepRun::Ddp => {
            let group: Arc<dyn ProcessGroup> = match counts {
                Some(c) => Arc::new(CountingGroup::new(ctx.group(), c.clone())),
                None => ctx.group(),
            };
            train_ddp(model, group, cfg, DdpOptions::default()).map_err(|e| format!("ddp: {e}"))?
        }
        StepRun::FsdpFullShard | StepRun::FsdpPerLayer => {
            let fsdp = FsdpOptions {
                strategy: ShardingStrategy::FullShard,
                wrap: if run == StepRun::FsdpPerLayer {
                    WrapPolicy::PerLayer
                } else {
                    WrapPolicy::Root
                },
                ..FsdpOptions::default()
            };
            train_fsdp(model, ctx.group(), cfg, fsdp).map_err(|e| format!("fsdp: {e}"))?
        }
        StepRun::Tp { sequence_parallel } => train_tensor_parallel(
            model,
            ctx.world(),
            cfg,
            &StepRun::tp_options(world, sequence_parallel),
        )
        .map_err(|e| format!("tp: {e}"))?,
        StepRun::Ep => train_expert_parallel(model, ctx.world(), cfg, &StepRun::ep_options(world))
            .map_err(|e| format!("ep: {e}"))?,
    };
    Ok(recorded)
}

/// Rank 0's figures: each timed step's duration and collectives (clocked or recorded).
fn rank_zero_times(
    opts: &StepBenchOptions,
    clocked: &Clocked,
    counted: bool,
    recorded: RunRecord,
) -> Result<StepTimes, RankError> {
    let starts = clocked
        .starts
        .lock()
        .map_err(|_| "step clock poisoned".to_owned())?
        .clone();
    // Drop the warm-up step; the last instant only closes the last timed step.
    let seconds: Vec<f64> = starts
        .windows(2)
        .skip(1)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .collect();
    let timed = 1..=opts.steps;
    let traffic: Vec<Vec<CollectiveEntry>> = if counted {
        // Tally `i + 1` is what step `i` communicated (tally 0: set-up).
        let tallies = clocked
            .traffic
            .lock()
            .map_err(|_| "step traffic poisoned".to_owned())?;
        timed
            .filter_map(|s| tallies.get(s + 1).cloned())
            .map(CollectiveEntry::from_counts)
            .collect()
    } else {
        let per_step = recorded.collectives.unwrap_or_default();
        timed.filter_map(|s| per_step.get(s).cloned()).collect()
    };
    Ok(StepTimes {
        seconds,
        parameters: clocked.num_parameters(),
        traffic,
    })
}

/// Runs `body` as this process's rank of an external launch, else in freshly forked ranks.
fn launch_ranks(
    opts: &StepBenchOptions,
    run: StepRun,
    external: Option<&ExternalLaunch>,
    body: &(dyn Fn(&RankCtx) -> Result<(), RankError> + Sync),
) -> Result<(), BenchError> {
    let timeout = Duration::from_secs(600);
    match external {
        // This process is one rank: ranks on several hosts time the step across them.
        Some(external) => {
            let label = format!("bench step {}", run.label());
            crate::runner::external::run(
                external,
                opts.world_size,
                Backend::Cpu,
                &label,
                timeout,
                body,
            )
            .map_err(|e| BenchError::Failed(format!("{}\n{}", e.line, e.details)))
        }
        None => {
            let launch_opts = LaunchOptions {
                world_size: opts.world_size,
                timeout,
                backend: "cpu".into(),
            };
            launch(
                &launch_opts,
                RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, body)),
            )
            .map(drop)
            .map_err(BenchError::from)
        }
    }
}

/// The median step time of what rank 0 handed back (the warm-up step already dropped).
fn median_times(read: &[u8]) -> Result<RunTimes, BenchError> {
    let times: StepTimes = serde_json::from_slice(read)?;
    let mut sorted = times.seconds;
    if sorted.is_empty() {
        return Err(BenchError::Failed("no step times were recorded".into()));
    }
    sorted.sort_by(f64::total_cmp);
    Ok(RunTimes {
        seconds: sorted[sorted.len() / 2],
        parameters: times.parameters,
        traffic: times.traffic,
    })
}
