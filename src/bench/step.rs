//! `bench step`: one training step of the same model under DDP, FSDP full shard (one root
//! unit) and FSDP full shard per layer, each in a fresh launch of forked ranks.

use super::gpt::{BenchGpt, Clocked};
use super::{results_path, BenchError, GptDims};
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use serde::Serialize;
use std::time::Duration;

/// What `bench step` runs.
#[derive(Clone, Debug)]
pub struct StepBenchOptions {
    pub world_size: usize,
    /// `gpt` (the benchmark decoder, sized by `dims`) or any other zoo model name (as built).
    pub model: String,
    /// The decoder's size when `model` is `gpt`.
    pub dims: GptDims,
    /// Timed steps (after one warm-up step); the median is reported.
    pub steps: usize,
}

impl Default for StepBenchOptions {
    fn default() -> Self {
        StepBenchOptions {
            world_size: 2,
            model: "gpt".into(),
            dims: GptDims::BENCH,
            steps: 5,
        }
    }
}

/// The result of `bench step` (one JSON object with `--json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct StepResult {
    pub model: String,
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

/// Which data-parallel wrapper a step-benchmark run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepWrapper {
    Ddp,
    FsdpFullShard,
    FsdpPerLayer,
}

/// Times training steps under DDP and FSDP full shard on the CPU backend, each in a fresh
/// launch of `world_size` forked ranks (one libtorch thread each). A step is timed from one
/// step's batch request to the next one's on rank 0 (so it spans forward, backward, gradient
/// synchronization, the loss all-reduce, the optimizer step and FSDP's unshard before the
/// next forward); the first (warm-up) step is dropped and the median of the rest reported.
pub fn run_step(opts: &StepBenchOptions) -> Result<StepResult, BenchError> {
    if opts.world_size < 2 {
        return Err(BenchError::Invalid(
            "the step benchmark needs --world-size 2 or more".into(),
        ));
    }
    if opts.steps == 0 {
        return Err(BenchError::Invalid("--steps must be at least 1".into()));
    }
    let d = opts.dims;
    if opts.model == "gpt" && (d.dim % d.heads != 0 || d.layers == 0 || d.seq < 1) {
        return Err(BenchError::Invalid(format!(
            "decoder dims {d:?}: dim must be a multiple of heads, with at least one layer"
        )));
    }
    if opts.model != "gpt" && !lockstep_models::zoo::names().contains(&opts.model.as_str()) {
        return Err(BenchError::Invalid(format!(
            "unknown model `{}`; known: gpt (the benchmark decoder) and the zoo: {}",
            opts.model,
            lockstep_models::zoo::names().join(", ")
        )));
    }
    tch::set_num_threads(1);
    let (ddp, parameters) = time_steps(opts, StepWrapper::Ddp)?;
    let (fsdp, _) = time_steps(opts, StepWrapper::FsdpFullShard)?;
    let (per_layer, _) = time_steps(opts, StepWrapper::FsdpPerLayer)?;
    Ok(StepResult {
        model: opts.model.clone(),
        world_size: opts.world_size,
        ddp_seconds: ddp,
        fsdp_seconds: fsdp,
        ratio: fsdp / ddp,
        fsdp_per_layer_seconds: per_layer,
        per_layer_ratio: per_layer / ddp,
        parameters,
        steps: opts.steps,
    })
}

#[derive(serde::Serialize, serde::Deserialize)]
struct StepTimes {
    seconds: Vec<f64>,
    parameters: i64,
}

/// One launch; returns the median step time and the parameter count.
fn time_steps(opts: &StepBenchOptions, wrapper: StepWrapper) -> Result<(f64, i64), BenchError> {
    use lockstep_core::ddp::{train_ddp, DdpOptions};
    use lockstep_core::fsdp::{train_fsdp, FsdpOptions, ShardingStrategy, WrapPolicy};
    use lockstep_core::record::RunSpec;
    use lockstep_core::train::{OptimizerConfig, TrainConfig};
    use lockstep_models::Model;

    let out = results_path("step");
    let seed = 0;
    let body = |ctx: &RankCtx| -> Result<(), String> {
        let rank = ctx.rank();
        let inner: Box<dyn Model> = if opts.model == "gpt" {
            Box::new(BenchGpt::new(opts.dims, seed, rank).map_err(|e| e.to_string())?)
        } else {
            lockstep_models::zoo::build(&opts.model, seed, rank).map_err(|e| e.to_string())?
        };
        let clocked = Clocked {
            inner,
            starts: std::sync::Mutex::new(Vec::new()),
        };
        let model: &dyn Model = &clocked;
        let cfg = TrainConfig {
            spec: RunSpec {
                model: opts.model.clone(),
                config: format!("{wrapper:?}"),
                world_size: ctx.world_size(),
                backend: "cpu".into(),
                dtype: "fp32".into(),
                // Warm-up, the timed steps, and one more whose batch request ends the last.
                steps: opts.steps + 2,
                seed,
            },
            optimizer: OptimizerConfig::default(),
            data_ranks: vec![rank],
            record_grads: false,
        };
        match wrapper {
            StepWrapper::Ddp => train_ddp(model, ctx.group(), &cfg, DdpOptions::default())
                .map(drop)
                .map_err(|e| format!("ddp: {e}"))?,
            StepWrapper::FsdpFullShard | StepWrapper::FsdpPerLayer => {
                let fsdp = FsdpOptions {
                    strategy: ShardingStrategy::FullShard,
                    wrap: if wrapper == StepWrapper::FsdpPerLayer {
                        WrapPolicy::PerLayer
                    } else {
                        WrapPolicy::Root
                    },
                    ..FsdpOptions::default()
                };
                train_fsdp(model, ctx.group(), &cfg, fsdp)
                    .map(drop)
                    .map_err(|e| format!("fsdp: {e}"))?
            }
        }
        if rank == 0 {
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
            let times = StepTimes {
                seconds,
                parameters: model.num_parameters(),
            };
            let json = serde_json::to_vec(&times).map_err(|e| e.to_string())?;
            std::fs::write(&out, json).map_err(|e| format!("writing results: {e}"))?;
        }
        Ok(())
    };
    let launch_opts = LaunchOptions {
        world_size: opts.world_size,
        timeout: Duration::from_secs(600),
        backend: "cpu".into(),
    };
    let launched = launch(
        &launch_opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, &body)),
    );
    let read = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    launched?;
    let times: StepTimes = serde_json::from_slice(&read?)?;
    let mut sorted = times.seconds;
    if sorted.is_empty() {
        return Err(BenchError::Invalid("no step times were recorded".into()));
    }
    sorted.sort_by(f64::total_cmp);
    Ok((sorted[sorted.len() / 2], times.parameters))
}
