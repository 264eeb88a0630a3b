//! `lockstep bench pipeline`: the benchmark decoder trained through a pipeline on forked
//! ranks (one libtorch thread each), against the same training in one process on one core.
//! Reports the median step time of both, their ratio, and the bubble twice: measured (the
//! share of each step's span every rank spent outside F/B/I/W, from the real run's trace)
//! and simulated (the schedule's exact fraction with F = I = W = 1).

use super::{results_path, BenchError, GptDims};
use crate::runner::hand_back::{hand_back_json, RankError};
use lockstep_core::pipeline::trace::{chrome_trace, measured_bubble, RankStepTrace};
use lockstep_core::pipeline::{train_pipeline, PipelineOptions, ScheduleChoice, ScheduleKind};
use lockstep_core::record::RunSpec;
use lockstep_core::train::{OptimizerConfig, TrainConfig};
use lockstep_harness::{launch, LaunchOptions, RankCtx, RankSpawn};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What `bench pipeline` runs.
#[derive(Clone, Debug)]
pub struct PipelineBenchOptions {
    /// A built-in schedule's name (`1f1b`, `gpipe`, `interleaved_1f1b`, ...).
    pub schedule: String,
    /// Pipeline ranks (processes).
    pub stages: usize,
    /// Microbatches per step (the global batch is every rank's batch, split this many ways).
    pub microbatches: usize,
    /// Stages per rank (`None`: the schedule's default).
    pub virtual_stages: Option<usize>,
    /// Timed steps (after one warm-up step); medians are reported.
    pub steps: usize,
    /// The decoder's size; its layer list (`layers + 4` entries) bounds `stages · v`.
    pub dims: GptDims,
    /// Where to write the Chrome trace of the timed steps, if anywhere.
    pub trace: Option<PathBuf>,
}

impl Default for PipelineBenchOptions {
    fn default() -> Self {
        PipelineBenchOptions {
            schedule: "1f1b".into(),
            stages: 2,
            microbatches: 8,
            virtual_stages: None,
            steps: 5,
            dims: GptDims::BENCH,
            trace: None,
        }
    }
}

/// The result of `bench pipeline` (one JSON object with `--json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PipelineBenchResult {
    /// The options the figures belong to: schedule, ranks `p`, stages per rank `v` (as the
    /// plan resolved it) and microbatches `m`.
    pub schedule: String,
    /// Pipeline ranks `p`.
    pub stages: usize,
    /// Stages per rank `v`, as the plan resolved it.
    pub virtual_stages: usize,
    /// Microbatches per step `m`.
    pub microbatches: usize,
    /// Median seconds per pipeline step: from the step's first action on any rank to the next
    /// step's, so the gradient reductions, norm and optimizer step between them count.
    pub pipeline_seconds: f64,
    /// Median seconds per step of the same training in one process on one core.
    pub single_seconds: f64,
    /// `pipeline_seconds / single_seconds` (target at p = 2, m = 8, 1F1B: ≤ 0.7).
    pub ratio: f64,
    /// Median over the timed steps of the measured bubble fraction.
    pub measured_bubble: f64,
    /// The schedule's simulated bubble fraction with unit costs (F = I = W = 1, the plan's
    /// own simulation): the closed form for balanced stages.
    pub simulated_bubble: f64,
    /// `|measured − simulated| / simulated` against the unit-cost simulation: how far this
    /// model on this transport is from the textbook schedule (uneven stages count here).
    pub bubble_relative_difference_unit_costs: f64,
    /// The schedule simulated with each stage's measured median F, B, I and W durations and
    /// the measured cost of a send (a receive costs what the matching send did): what the
    /// schedule promises for these stages on this transport.
    pub simulated_bubble_measured_costs: f64,
    /// `|measured − simulated with measured costs| / simulated with measured costs`: what
    /// the executor loses to communication and overhead (target: ≤ 0.1).
    pub bubble_relative_difference: f64,
    /// Trainable parameters of the decoder (what the step times are for).
    pub parameters: i64,
    /// Timed steps the medians are over.
    pub steps: usize,
}

#[derive(Serialize, Deserialize)]
struct RankTraces {
    traces: Vec<RankStepTrace>,
    simulated_bubble: f64,
    virtual_stages: usize,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Runs the benchmark: one launch of `stages` forked ranks, then the one-process baseline.
pub fn run_pipeline(opts: &PipelineBenchOptions) -> Result<PipelineBenchResult, BenchError> {
    let (popts, plan) = plan_bench(opts)?;
    lockstep_harness::threads::use_launcher_threads();
    let out = results_path("pipeline");
    let body = |ctx: &RankCtx| -> Result<(), RankError> { trace_rank(opts, &popts, ctx, &out) };
    let launched = launch(
        &LaunchOptions {
            world_size: opts.stages,
            timeout: Duration::from_secs(600),
            backend: "cpu".into(),
        },
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, &body)),
    );
    let gathered = gather_traces(opts.stages, &out, popts.virtual_stages)?;
    launched?;
    if let Some(e) = gathered.read_error {
        return Err(e.into());
    }
    let timed: Vec<RankStepTrace> = gathered
        .all
        .into_iter()
        .filter(|t| t.step >= 1 && t.step <= opts.steps)
        .collect();
    let (step_seconds, bubbles) = step_figures(opts.steps, &gathered.starts, &timed);
    if let Some(path) = &opts.trace {
        std::fs::write(path, chrome_trace(&timed).to_string())?;
    }
    let pipeline_seconds =
        median(step_seconds).ok_or_else(|| BenchError::Failed("no step was traced".into()))?;
    let measured =
        median(bubbles).ok_or_else(|| BenchError::Failed("no step's bubble was traced".into()))?;
    let with_costs = simulate_measured(&plan, &timed)?;
    let (single_seconds, parameters) = single_process_step(opts)?;
    let simulated = gathered.simulated;
    Ok(PipelineBenchResult {
        schedule: opts.schedule.clone(),
        stages: opts.stages,
        virtual_stages: gathered.virtual_stages,
        microbatches: opts.microbatches,
        pipeline_seconds,
        single_seconds,
        ratio: pipeline_seconds / single_seconds,
        measured_bubble: measured,
        simulated_bubble: simulated,
        bubble_relative_difference_unit_costs: (measured - simulated).abs() / simulated,
        simulated_bubble_measured_costs: with_costs,
        bubble_relative_difference: (measured - with_costs).abs() / with_costs,
        parameters,
        steps: opts.steps,
    })
}

/// Checks the options and plans on a probe decoder, refusing a bad plan before any rank starts.
fn plan_bench(
    opts: &PipelineBenchOptions,
) -> Result<(PipelineOptions, lockstep_core::pipeline::PipelinePlan), BenchError> {
    let kind: ScheduleKind = opts
        .schedule
        .parse()
        .map_err(|e| BenchError::Invalid(format!("{e}")))?;
    if opts.stages < 2 || opts.steps == 0 {
        return Err(BenchError::Invalid(
            "the pipeline benchmark needs --stages 2 or more and --steps 1 or more".into(),
        ));
    }
    let v = opts
        .virtual_stages
        .unwrap_or_else(|| kind.default_virtual());
    let popts = PipelineOptions {
        schedule: ScheduleChoice::Builtin(kind),
        virtual_stages: v,
        microbatches: opts.microbatches,
        ..PipelineOptions::default()
    };
    // Reject a plan that cannot work before any rank starts.
    let probe_model = opts
        .dims
        .build(0, 0, false)
        .map_err(|e| BenchError::Invalid(format!("building the decoder: {e}")))?;
    let plan = lockstep_core::pipeline::plan_pipeline(&probe_model, opts.stages, &popts)
        .map_err(|e| BenchError::Invalid(e.to_string()))?;
    Ok((popts, plan))
}

/// One rank's share of the launch: trains its stages, hands its traces back next to `out`.
fn trace_rank(
    opts: &PipelineBenchOptions,
    popts: &PipelineOptions,
    ctx: &RankCtx,
    out: &Path,
) -> Result<(), RankError> {
    // Warm-up, the timed steps, and one more whose start ends the last timed step.
    let steps = opts.steps + 2;
    let model = opts.dims.build(0, ctx.rank(), false)?;
    let cfg = TrainConfig {
        spec: RunSpec {
            model: "bench-gpt".into(),
            config: format!("pp.{}", opts.schedule),
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
    };
    let run = train_pipeline(&model, ctx.world(), &cfg, popts)
        .map_err(|e| RankError::Train(e.to_string()))?;
    let mine = RankTraces {
        traces: run.traces,
        simulated_bubble: run.plan.simulation.bubble_fraction,
        virtual_stages: run.plan.stages.len() / run.plan.ranks,
    };
    let path = out.with_extension(format!("rank{}.json", ctx.rank()));
    hand_back_json("the pipeline traces", &path, &mine)
}

/// Every rank's handed-back traces, gathered (and their files removed).
struct GatheredTraces {
    all: Vec<RankStepTrace>,
    /// Per step: the earliest begin of any action on any rank.
    starts: BTreeMap<usize, u64>,
    simulated: f64,
    virtual_stages: usize,
    /// The last rank file that could not be read, reported once the launch's own outcome is.
    read_error: Option<std::io::Error>,
}

/// Reads (and removes) the `stages` rank files next to `out`, noting each step's first action.
fn gather_traces(
    stages: usize,
    out: &Path,
    virtual_stages: usize,
) -> Result<GatheredTraces, BenchError> {
    let mut gathered = GatheredTraces {
        all: Vec::new(),
        starts: BTreeMap::new(),
        simulated: 0.0,
        virtual_stages,
        read_error: None,
    };
    for r in 0..stages {
        let path = out.with_extension(format!("rank{r}.json"));
        match std::fs::read(&path) {
            Ok(bytes) => {
                let mine: RankTraces = serde_json::from_slice(&bytes)?;
                gathered.simulated = mine.simulated_bubble;
                gathered.virtual_stages = mine.virtual_stages;
                for t in &mine.traces {
                    if let Some(first) = t.events.iter().map(|e| e.begin_us).min() {
                        let s = gathered.starts.entry(t.step).or_insert(first);
                        *s = (*s).min(first);
                    }
                }
                gathered.all.extend(mine.traces);
            }
            Err(e) => gathered.read_error = Some(e),
        }
        let _ = std::fs::remove_file(&path);
    }
    Ok(gathered)
}

/// Each timed step's duration in seconds and measured bubble, where the traces have them.
fn step_figures(
    steps: usize,
    starts: &BTreeMap<usize, u64>,
    timed: &[RankStepTrace],
) -> (Vec<f64>, Vec<f64>) {
    let mut step_seconds = Vec::new();
    let mut bubbles = Vec::new();
    for step in 1..=steps {
        let of_step: Vec<&RankStepTrace> = timed.iter().filter(|t| t.step == step).collect();
        if let Some(bubble) = measured_bubble(&of_step) {
            bubbles.push(bubble);
        }
        // A step runs from its first action on any rank to the next step's first action:
        // the gradient reductions, record and optimizer step in between are part of it.
        if let (Some(b), Some(e)) = (starts.get(&step), starts.get(&(step + 1))) {
            step_seconds.push(e.saturating_sub(*b) as f64 / 1e6);
        }
    }
    (step_seconds, bubbles)
}

/// The lowered schedule simulated with every (stage, action kind)'s median measured
/// duration in microseconds.
fn simulate_measured(
    plan: &lockstep_core::pipeline::PipelinePlan,
    traces: &[RankStepTrace],
) -> Result<f64, BenchError> {
    use lockstep_core::pipeline::schedule::{simulate_costed, Action, ActionKind, Costs};
    use std::collections::HashMap;
    let mut durations: HashMap<(usize, ActionKind), Vec<f64>> = HashMap::new();
    for e in traces.iter().flat_map(|t| &t.events) {
        let a: Action = e
            .action
            .parse()
            .map_err(|err| BenchError::Failed(format!("trace action `{}`: {err}", e.action)))?;
        durations
            .entry((a.stage, a.kind))
            .or_default()
            .push(e.duration_us as f64);
    }
    let medians: HashMap<(usize, ActionKind), u64> = durations
        .into_iter()
        .filter_map(|(k, v)| median(v).map(|m| (k, m.max(1.0) as u64)))
        .collect();
    // A receive's measured time is mostly waiting; its own cost is a transfer, which a send's
    // time measures (both copy the same bytes).
    let transfer = |stage: usize, kind: ActionKind| match kind {
        ActionKind::RecvF | ActionKind::RecvB => {
            let send = if kind == ActionKind::RecvF {
                ActionKind::SendF
            } else {
                ActionKind::SendB
            };
            medians
                .iter()
                .filter(|((_, k), _)| *k == send)
                .map(|(_, v)| *v)
                .max()
                .unwrap_or(0)
        }
        _ => medians.get(&(stage, kind)).copied().unwrap_or(0),
    };
    let sim = simulate_costed(&plan.schedule, Costs::default(), &|a: &Action| {
        transfer(a.stage, a.kind)
    })
    .map_err(|e| BenchError::Failed(format!("simulating with measured costs: {e}")))?;
    Ok(sim.bubble_fraction)
}

/// The same training in this process on one core, step for step what
/// `lockstep_core::pipeline::microbatched_reference` does (which cannot be timed per step):
/// every rank's batch, the same microbatches and loss scales, backward per microbatch, the
/// step objective and the f64 gradient norm the run record keeps (computed as the pipeline's
/// ranks compute theirs), and the optimizer step; the median of the timed steps after a
/// warm-up one.
fn single_process_step(opts: &PipelineBenchOptions) -> Result<(f64, i64), BenchError> {
    use lockstep_models::Model;
    use tch::{Kind, Tensor};
    let invalid = |e: String| BenchError::Failed(format!("single-process baseline: {e}"));
    let model = opts
        .dims
        .build(0, 0, false)
        .map_err(|e| invalid(e.to_string()))?;
    let params = model.named_parameters();
    let mut optimizer = OptimizerConfig::default().build();
    let ranks: Vec<usize> = (0..opts.stages).collect();
    // The norm is squared in one f64 buffer, as the pipeline's ranks do (run.rs), so both
    // sides pay the same for it.
    let largest = params
        .iter()
        .map(|(_, t)| t.numel() as i64)
        .max()
        .unwrap_or(0);
    let scratch = Tensor::f_empty([largest], (Kind::Double, tch::Device::Cpu))
        .map_err(|e| invalid(e.to_string()))?;
    let mut seconds = Vec::with_capacity(opts.steps);
    for step in 0..=opts.steps {
        let t0 = Instant::now();
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        let split =
            lockstep_core::pipeline::microbatch::split(&model, &ranks, step, opts.microbatches)
                .map_err(|e| invalid(e.to_string()))?;
        let mut objective = 0.0;
        for (batch, scale) in split.batches.iter().zip(&split.scales) {
            let loss = model
                .loss(batch)
                .and_then(|l| Ok(l.f_mul_scalar(*scale)?))
                .map_err(|e| invalid(e.to_string()))?;
            objective += loss
                .f_double_value(&[])
                .map_err(|e| invalid(e.to_string()))?;
            loss.f_backward().map_err(|e| invalid(e.to_string()))?;
        }
        let mut norm = 0.0;
        for (_, p) in &params {
            let g = p.grad();
            if g.defined() {
                let mut d = scratch
                    .f_narrow(0, 0, g.numel() as i64)
                    .map_err(|e| invalid(e.to_string()))?;
                // `square_` returns the squared view too; `d` itself is what is summed.
                let _ = g
                    .f_reshape([-1])
                    .and_then(|flat| d.f_copy_(&flat))
                    .and_then(|()| d.f_square_())
                    .map_err(|e| invalid(e.to_string()))?;
                norm += d
                    .f_sum(Kind::Double)
                    .and_then(|s| s.f_double_value(&[]))
                    .map_err(|e| invalid(e.to_string()))?;
            }
        }
        std::hint::black_box((objective, norm.sqrt()));
        optimizer
            .step(&params)
            .map_err(|e| invalid(e.to_string()))?;
        if step > 0 {
            seconds.push(t0.elapsed().as_secs_f64());
        }
    }
    let s = median(seconds).ok_or_else(|| BenchError::Failed("no baseline step".into()))?;
    Ok((s, model.num_parameters()))
}
