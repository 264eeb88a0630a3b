//! What one matrix cell (model × world size) runs: its configurations under test (in one
//! shared launch where it can), the references their judging edges use, the float64
//! shadows and fp32 variants; and the progress and counts of every run.

use super::ring_ordered::run_ring_ordered;
use super::*;
use crate::runner::RecordResult;
use lockstep_core::context_parallel::{ring_ordered_name, SequenceLayout};

/// Tracks runs for the progress display; prints one line per run when stderr is no
/// terminal (CI logs), where the bar is hidden.
pub(super) struct Progress<'a> {
    pub(super) bar: &'a ProgressBar,
    pub(super) done: usize,
    pub(super) total: usize,
    /// Print a line per run where the bar is hidden (CI logs); off for repeated runs.
    pub(super) log_runs: bool,
}

impl Progress<'_> {
    fn start(&self, label: &str) {
        self.bar.set_message(label.to_owned());
    }

    fn finish(&mut self, label: &str, took: Duration, error: Option<&str>) {
        self.done += 1;
        self.bar.inc(1);
        if self.log_runs && self.bar.is_hidden() {
            let status = error.map_or("ok".to_owned(), |e| format!("FAILED: {e}"));
            eprintln!(
                "[{}/{}] {label}: {:.2} s {status}",
                self.done,
                self.total,
                took.as_secs_f64()
            );
        }
    }
}

/// Progress and the run counters, shared by every run of the matrix.
pub(super) struct Tally<'a> {
    pub(super) progress: Progress<'a>,
    pub(super) result: MatrixResult,
}

impl Tally<'_> {
    /// Counts `outcome` (failed and hung runs too).
    fn count(&mut self, outcome: &RecordResult) {
        self.result.runs += 1;
        if outcome.is_err() {
            self.result.failed_runs += 1;
        }
        if outcome.as_ref().is_err_and(|e| e.timed_out) {
            self.result.hung_runs += 1;
        }
    }

    /// Runs `run` in this process under `label`, shown and counted.
    fn in_process(&mut self, label: String, run: impl FnOnce() -> RecordResult) -> RecordResult {
        self.progress.start(&label);
        let t0 = Instant::now();
        let outcome = run();
        self.count(&outcome);
        let err = outcome.as_ref().err().map(|e| e.line.as_str());
        self.progress.finish(&label, t0.elapsed(), err);
        outcome
    }
}

/// Everything one cell (model × world size) ran, by role (nothing, by default).
#[derive(Default)]
pub(super) struct CellRuns {
    /// Each reference's runs (the first is the reference, a second its repeat).
    pub(super) references: Vec<(Config, Vec<RecordResult>)>,
    pub(super) fsdp: Vec<(Config, RecordResult)>,
    pub(super) pipelines: Vec<(Config, RecordResult)>,
    /// Tensor/expert parallelism and compositions, with the simpler configurations they
    /// reduce to.
    pub(super) model_parallel: Vec<(Config, RecordResult)>,
    /// Per microbatch count: the microbatched reference and its float64 shadow (run only
    /// where a pipeline row is judged by the arbiter).
    pub(super) microbatched: Vec<(usize, (RecordResult, Option<RecordResult>))>,
    /// Per ring `(cp, layout)` of a ring row: the single device computing attention in the
    /// ring's merge order (`single.cpN@N`).
    pub(super) ring_ordered: Vec<((usize, SequenceLayout), RecordResult)>,
    /// Per capacity factor of an expert-parallel launch: the single-device reference that
    /// drops at it (`single.cap<F>@N`) and its float64 shadow.
    pub(super) dropping: Vec<(f64, (RecordResult, RecordResult))>,
    /// Per policy whose DDP row is selected: its independent single-device reference
    /// (`single.bf16@N`, `single.fp16@N`).
    pub(super) mixed: Vec<(Precision, RecordResult)>,
    /// The single-device reference's float64 shadow, when a row needs it.
    pub(super) single_f64: Option<RecordResult>,
    /// The fp32 variants of the single-device reference ([`crate::spread`]), run with its
    /// shadow: with it, they measure how far correct fp32 runs stray from float64.
    pub(super) spread: Vec<RecordResult>,
}

impl CellRuns {
    /// The `i`-th run of reference `config` (0: the reference, 1: its repeat).
    pub(super) fn reference(&self, config: Config, i: usize) -> Option<&RecordResult> {
        self.references
            .iter()
            .find(|(c, _)| *c == config)
            .and_then(|(_, runs)| runs.get(i))
    }

    /// The run that stands for `config` in its own rows (a DDP-family reference's first run,
    /// a launched configuration's run), to be replaced by a faulted one.
    pub(super) fn run_mut(&mut self, config: Config) -> Option<&mut RecordResult> {
        if let Some((_, runs)) = self.references.iter_mut().find(|(c, _)| *c == config) {
            return runs.first_mut();
        }
        self.fsdp
            .iter_mut()
            .chain(&mut self.pipelines)
            .chain(&mut self.model_parallel)
            .find(|(c, _)| *c == config)
            .map(|(_, r)| r)
    }

    /// The run that stands for `config` in its own rows: a reference's first run, or a
    /// launched configuration's.
    pub(super) fn run_of(&self, config: Config) -> Option<&RecordResult> {
        self.reference(config, 0).or_else(|| self.launched(config))
    }

    /// The run of launched configuration `config`, wherever it ran.
    pub(super) fn launched(&self, config: Config) -> Option<&RecordResult> {
        self.fsdp
            .iter()
            .chain(&self.pipelines)
            .chain(&self.model_parallel)
            .find(|(c, _)| *c == config)
            .map(|(_, r)| r)
    }
}

/// Runs every run cell `m` × `world` needs: the first run of every launched configuration in
/// one launch (subtests; repeats of references stay fresh launches of their own, since they
/// check that a fresh process reproduces the bits), the in-process references and the float64
/// shadows.
pub(super) fn run_cell(plan: &Plan, m: usize, world: usize, tally: &mut Tally<'_>) -> CellRuns {
    let model = plan.models[m].as_str();
    let settings = plan.settings_for(model);
    let build = runner::zoo_builder(model);
    let mut together = shared_launch(plan, m, world, tally);
    let mut run_one = |config: Config, attempt: usize, of: usize| {
        let outcome = match together.remove(&config).filter(|_| attempt == 1) {
            Some(outcome) => {
                tally.count(&outcome);
                outcome
            }
            None => {
                let label = if of > 1 {
                    format!("{model} {} (run {attempt}/{of})", config.at(world))
                } else {
                    format!("{model} {}", config.at(world))
                };
                tally.in_process(label, || {
                    runner::run_config(model, &build, config, world, &settings)
                })
            }
        };
        outcome
    };
    let references = plan
        .runs_per_cell(m, world)
        .into_iter()
        .map(|(c, n)| (c, (1..=n).map(|i| run_one(c, i, n)).collect()))
        .collect();
    let mut launch_each = |configs: Vec<Config>| -> Vec<(Config, RecordResult)> {
        configs.into_iter().map(|c| (c, run_one(c, 1, 1))).collect()
    };
    let fsdp = launch_each(plan.fsdp_launches(world));
    let pipelines = launch_each(
        plan.pipeline_launches(m, world)
            .into_iter()
            .map(|(c, _)| c)
            .collect(),
    );
    let mut model_parallel_configs = plan.model_parallel_launches(m, world);
    model_parallel_configs.extend(plan.simpler_references(m, world));
    let model_parallel = launch_each(model_parallel_configs);
    let microbatched = run_microbatched_references(plan, m, world, tally);
    let dropping = run_dropping_references(plan, m, world, tally);
    let ring_ordered = run_ring_ordered_references(plan, m, world, tally);
    let mixed = run_mixed_references(plan, m, world, tally);
    let single_f64 = plan.needs_f64(m, world).then(|| {
        tally.in_process(format!("{model} single.f64@{world}"), || {
            runner::run_single_f64(model, &build, world, &settings)
        })
    });
    let spread = run_spread(plan, m, world, tally);
    CellRuns {
        references,
        fsdp,
        pipelines,
        model_parallel,
        microbatched,
        ring_ordered,
        dropping,
        mixed,
        single_f64,
        spread,
    }
}

/// The first run of every configuration and DDP-family reference of cell `m` × `world` in
/// one launch (subtests), when the plan asks for it and ranks fork; repeats stay fresh
/// launches of their own, since they check that a fresh process reproduces the bits.
pub(super) fn shared_launch(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> BTreeMap<Config, RecordResult> {
    let model = plan.models[m].as_str();
    let settings = plan.settings_for(model);
    let mut together = BTreeMap::new();
    if !plan.subtests || settings.execs_ranks() {
        return together;
    }
    let configs: Vec<Config> = plan
        .runs_per_cell(m, world)
        .into_iter()
        .map(|(c, _)| c)
        .filter(|&c| c != Config::Single)
        .chain(plan.fsdp_launches(world))
        .chain(plan.pipeline_launches(m, world).into_iter().map(|(c, _)| c))
        .chain(plan.model_parallel_launches(m, world))
        .chain(plan.simpler_references(m, world))
        .collect();
    if configs.len() <= 1 {
        return together;
    }
    let build = runner::zoo_builder(model);
    let label = format!("{model} @{world}: {} configs in one launch", configs.len());
    tally.progress.start(&label);
    let t0 = Instant::now();
    let outcomes = runner::run_configs_together(model, &build, &configs, world, &settings);
    let each = t0.elapsed() / configs.len() as u32;
    for (config, outcome) in configs.into_iter().zip(outcomes) {
        tally.progress.finish(
            &format!("{model} {}", config.at(world)),
            each,
            outcome.as_ref().err().map(|e| e.line.as_str()),
        );
        together.insert(config, outcome);
    }
    together
}

/// The cell's microbatched references, each with its float64 shadow where a row needs it.
pub(super) fn run_microbatched_references(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> Vec<(usize, (RecordResult, Option<RecordResult>))> {
    let model = plan.models[m].as_str();
    plan.microbatch_references(m, world)
        .into_iter()
        .map(|mb| {
            let name = microbatched_name(mb);
            let fp32 = tally.in_process(format!("{model} {name}@{world}"), || {
                run_microbatched(model, world, mb, plan)
            });
            let fp64 = plan.microbatch_needs_f64(m, world, mb).then(|| {
                tally.in_process(format!("{model} {name}.f64@{world}"), || {
                    run_microbatched_f64(model, world, mb, plan)
                })
            });
            (mb, (fp32, fp64))
        })
        .collect()
}

/// The cell's ring-ordered references (`single.cpN`), one per ring its rows run.
pub(super) fn run_ring_ordered_references(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> Vec<((usize, SequenceLayout), RecordResult)> {
    let model = plan.models[m].as_str();
    plan.ring_ordered_references(m, world)
        .into_iter()
        .map(|(cp, layout)| {
            let name = ring_ordered_name(cp, layout);
            let run = tally.in_process(format!("{model} {name}@{world}"), || {
                run_ring_ordered(model, world, (cp, layout), plan)
            });
            ((cp, layout), run)
        })
        .collect()
}

/// The cell's dropping references (`single.cap<F>`), each with its float64 shadow.
pub(super) fn run_dropping_references(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> Vec<(f64, (RecordResult, RecordResult))> {
    let model = plan.models[m].as_str();
    plan.dropping_references(m, world)
        .into_iter()
        .map(|f| {
            let name = dropping_reference_name(f);
            let label = format!("{model} {name}@{world} and its float64 shadow");
            tally.progress.start(&label);
            let t0 = Instant::now();
            let (fp32, fp64) = run_dropping_reference(model, f, world, plan);
            for (outcome, of) in [(&fp32, name.clone()), (&fp64, format!("{name}.f64"))] {
                tally.count(outcome);
                let err = outcome.as_ref().err().map(|e| e.line.as_str());
                let label = format!("{model} {of}@{world}");
                tally.progress.finish(&label, t0.elapsed() / 2, err);
            }
            (f, (fp32, fp64))
        })
        .collect()
}

/// The cell's independent mixed-precision references (`single.bf16`, `single.fp16`).
pub(super) fn run_mixed_references(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> Vec<(Precision, RecordResult)> {
    let model = plan.models[m].as_str();
    plan.mixed_references(m, world)
        .into_iter()
        .map(|p| {
            let name = p.half_type().reference_name();
            let run = tally.in_process(format!("{model} {name}@{world}"), || {
                run_mixed_reference(model, p, world, plan)
            });
            (p, run)
        })
        .collect()
}

/// The single-device reference's fp32 variants, where an envelope is widened by them.
pub(super) fn run_spread(
    plan: &Plan,
    m: usize,
    world: usize,
    tally: &mut Tally<'_>,
) -> Vec<RecordResult> {
    if plan.spread_runs(m, world) == 0 {
        return Vec::new();
    }
    let model = plan.models[m].as_str();
    let settings = plan.settings_for(model);
    let build = runner::zoo_builder(model);
    let label = format!("{model} fp32 variants@{world}");
    tally.progress.start(&label);
    let t0 = Instant::now();
    let spread = crate::spread::run_spread(model, &build, world, &settings);
    let took = t0.elapsed() / spread.len().max(1) as u32;
    for outcome in &spread {
        tally.count(outcome);
        let (name, err) = match outcome {
            Ok(r) => (r.spec.config.as_str(), None),
            Err(e) => ("fp32 variant", Some(e.line.as_str())),
        };
        tally.progress.finish(&format!("{model} {name}"), took, err);
    }
    spread
}
