//! Running a plan: references in process, parallel configurations in forked launches,
//! then the comparisons that make the rows.

use super::*;
use crate::runner::RecordResult;

/// The progress bar the CLI shows on stderr: drawn only on a terminal and only from this
/// thread (no ticker thread, so a forked rank never inherits a lock held by one).
pub fn progress_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed:>4} [{bar:30.cyan/blue}] {pos}/{len} runs  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Tracks runs for the progress display; prints one line per run when stderr is no
/// terminal (CI logs), where the bar is hidden.
struct Progress<'a> {
    bar: &'a ProgressBar,
    done: usize,
    total: usize,
    /// Print a line per run where the bar is hidden (CI logs); off for repeated runs.
    log_runs: bool,
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

/// Runs the plan: per model and world size the references the selected configurations need
/// (`Plan::runs_per_cell`: the single-device reference in process, fresh DDP launches fp32
/// and per mixed-precision policy), the FSDP launches, then the comparisons. Run
/// failures become `Error` rows; the matrix always finishes.
///
/// libtorch is set to one intra-op thread in this process (forked ranks must not inherit an
/// OpenMP pool); the references computed here run with the ranks' count
/// ([`lockstep_harness::threads`]), so no verdict depends on the machine's core count.
pub fn run(plan: &Plan, bar: &ProgressBar) -> MatrixResult {
    run_logged(plan, bar, true)
}

/// [`run`] with no progress output at all (for callers that repeat a matrix and report per
/// repetition, like `lockstep stress`).
pub fn run_quietly(plan: &Plan) -> MatrixResult {
    run_logged(plan, &ProgressBar::hidden(), false)
}

fn run_logged(plan: &Plan, bar: &ProgressBar, log_runs: bool) -> MatrixResult {
    // This process forks every rank: one thread (`lockstep_harness::threads`); references
    // computed here take the ranks' count through `runner::in_process_reference`.
    lockstep_harness::threads::use_launcher_threads();
    let started = Instant::now();
    // A measurement aid: a log that cannot be created is reported and the matrix goes on.
    let mut arbiter_log =
        plan.arbiter_log
            .as_ref()
            .and_then(|path| match std::fs::File::create(path) {
                Ok(f) => Some(std::io::BufWriter::new(f)),
                Err(e) => {
                    eprintln!(
                        "lockstep: cannot write the arbiter log {}: {e}",
                        path.display()
                    );
                    None
                }
            });
    let mut tally = Tally {
        progress: Progress {
            bar,
            done: 0,
            total: plan.run_count(),
            log_runs,
        },
        result: MatrixResult::default(),
    };
    'cells: for (m, (model, blocker)) in plan.models.iter().zip(&plan.blockers).enumerate() {
        for &world in &plan.world_sizes {
            // Under an external launch only its WORLD_SIZE runs: the other sizes' rows are
            // skipped with that reason (`Config::world_blocker`), and nothing is launched.
            let runs = if crate::runner::external::world_blocker(world).is_some() {
                CellRuns::default()
            } else {
                run_cell(plan, m, world, &mut tally)
            };
            let cell = Cell {
                index: m,
                model,
                world,
                blocker: blocker.as_deref(),
            };
            judge_cell(plan, &cell, &runs, &mut tally.result, &mut arbiter_log);
            // A rank failed under an external launch: its communicators may be broken and
            // nothing more runs (`crate::external`); the caller reports it.
            if crate::runner::external::stopped().is_some() {
                break 'cells;
            }
        }
    }
    bar.finish_and_clear();
    tally.result.elapsed = started.elapsed();
    tally.result
}

/// Progress and the run counters, shared by every run of the matrix.
struct Tally<'a> {
    progress: Progress<'a>,
    result: MatrixResult,
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
    references: Vec<(Config, Vec<RecordResult>)>,
    fsdp: Vec<(Config, RecordResult)>,
    pipelines: Vec<(Config, RecordResult)>,
    /// Tensor/expert parallelism and compositions, with the simpler configurations they
    /// reduce to.
    model_parallel: Vec<(Config, RecordResult)>,
    /// Per microbatch count: the microbatched reference and its float64 shadow (run only
    /// where a pipeline row is judged by the arbiter).
    microbatched: Vec<(usize, (RecordResult, Option<RecordResult>))>,
    /// Per capacity factor of an expert-parallel launch: the single-device reference that
    /// drops at it (`single.cap<F>@N`) and its float64 shadow.
    dropping: Vec<(f64, (RecordResult, RecordResult))>,
    /// Per policy whose DDP row is selected: its independent single-device reference
    /// (`single.bf16@N`, `single.fp16@N`).
    mixed: Vec<(Precision, RecordResult)>,
    /// The single-device reference's float64 shadow, when a row needs it.
    single_f64: Option<RecordResult>,
    /// The fp32 variants of the single-device reference ([`crate::spread`]), run with its
    /// shadow: with it, they measure how far correct fp32 runs stray from float64.
    spread: Vec<RecordResult>,
}

impl CellRuns {
    /// The `i`-th run of reference `config` (0: the reference, 1: its repeat).
    fn reference(&self, config: Config, i: usize) -> Option<&RecordResult> {
        self.references
            .iter()
            .find(|(c, _)| *c == config)
            .and_then(|(_, runs)| runs.get(i))
    }

    /// The run that stands for `config` in its own rows (a DDP-family reference's first run,
    /// a launched configuration's run), to be replaced by a faulted one.
    fn run_mut(&mut self, config: Config) -> Option<&mut RecordResult> {
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
    fn run_of(&self, config: Config) -> Option<&RecordResult> {
        self.reference(config, 0).or_else(|| self.launched(config))
    }

    /// The fp32 run that reference `against` of `config` names.
    fn fp32(&self, config: Config, against: Against) -> Option<&RecordResult> {
        match against {
            Against::Repeat => self.reference(config, 1),
            Against::Config(c) => self.run_of(c),
            Against::Single => self.reference(Config::Single, 0),
            Against::Mixed(p) => self.mixed.iter().find(|(q, _)| *q == p).map(|(_, r)| r),
            Against::Dropping(f) => self.dropping_pair(f).map(|(fp32, _)| fp32),
            Against::Microbatched(m) => self.microbatched_pair(m).map(|(fp32, _)| fp32),
        }
    }

    /// The float64 shadow of reference `against`, where it ran.
    fn shadow(&self, against: Against) -> Option<&RecordResult> {
        match against {
            Against::Single => self.single_f64.as_ref(),
            Against::Dropping(f) => self.dropping_pair(f).map(|(_, fp64)| fp64),
            Against::Microbatched(m) => self
                .microbatched_pair(m)
                .and_then(|(_, fp64)| fp64.as_ref()),
            _ => None,
        }
    }

    fn dropping_pair(&self, factor: f64) -> Option<&(RecordResult, RecordResult)> {
        self.dropping
            .iter()
            .find(|(g, _)| *g == factor)
            .map(|(_, p)| p)
    }

    fn microbatched_pair(&self, m: usize) -> Option<&(RecordResult, Option<RecordResult>)> {
        self.microbatched
            .iter()
            .find(|(n, _)| *n == m)
            .map(|(_, p)| p)
    }

    /// The fp64 arbiter's runs for an edge of `config`: the envelope run, the shadow, and the
    /// other correct fp32 runs that widen the envelope.
    fn arbiter(&self, config: Config, a: Arbiter) -> Judge<'_> {
        let envelope = self.fp32(config, a.envelope);
        let spread = match a.spread {
            Spread::None => Vec::new(),
            Spread::VariantsAndSingle => {
                let single = self.reference(Config::Single, 0);
                self.spread
                    .iter()
                    .chain(single.filter(|s| !same_run(Some(s), envelope)))
                    .collect()
            }
            Spread::Variants => self
                .spread
                .iter()
                .filter(|v| match (v, envelope) {
                    (Ok(v), Some(Ok(r))) => v.spec.config != r.spec.config,
                    _ => true,
                })
                .collect(),
        };
        Judge::Arbiter {
            fp32: envelope,
            fp64: self.shadow(a.shadow),
            spread,
        }
    }

    /// The run of launched configuration `config`, wherever it ran.
    fn launched(&self, config: Config) -> Option<&RecordResult> {
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
fn run_cell(plan: &Plan, m: usize, world: usize, tally: &mut Tally<'_>) -> CellRuns {
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
        dropping,
        mixed,
        single_f64,
        spread,
    }
}

/// The first run of every configuration and DDP-family reference of cell `m` × `world` in
/// one launch (subtests), when the plan asks for it and ranks fork; repeats stay fresh
/// launches of their own, since they check that a fresh process reproduces the bits.
fn shared_launch(
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
fn run_microbatched_references(
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

/// The cell's dropping references (`single.cap<F>`), each with its float64 shadow.
fn run_dropping_references(
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
fn run_mixed_references(
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
fn run_spread(plan: &Plan, m: usize, world: usize, tally: &mut Tally<'_>) -> Vec<RecordResult> {
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

/// A cell run once, whose configuration under test can then be judged with its run replaced
/// (a faulted run, for a sensitivity analysis) by exactly the matrix's verdict.
pub(super) struct CellBaseline {
    plan: Plan,
    runs: CellRuns,
}

impl CellBaseline {
    /// Runs every run of cell (model 0 of `plan`, `world`) quietly.
    pub(super) fn run(plan: &Plan, world: usize) -> Self {
        let bar = ProgressBar::hidden();
        let mut tally = Tally {
            progress: Progress {
                bar: &bar,
                done: 0,
                total: 0,
                log_runs: false,
            },
            result: MatrixResult::default(),
        };
        let runs = run_cell(plan, 0, world, &mut tally);
        CellBaseline {
            plan: plan.clone(),
            runs,
        }
    }

    /// The matrix's rows for `config` at `world`, with `run` standing in for its own run when
    /// given.
    pub(super) fn rows(
        &mut self,
        config: Config,
        world: usize,
        run: Option<RecordResult>,
    ) -> Vec<Row> {
        let saved = match (run, self.runs.run_mut(config)) {
            (Some(run), Some(slot)) => Some(std::mem::replace(slot, run)),
            _ => None,
        };
        let cell = Cell {
            index: 0,
            model: &self.plan.models[0],
            world,
            blocker: self.plan.blockers[0].as_deref(),
        };
        let mut result = MatrixResult {
            rows: Vec::new(),
            comparisons: Vec::new(),
            runs: 0,
            failed_runs: 0,
            hung_runs: 0,
            elapsed: Duration::ZERO,
        };
        judge_cell(&self.plan, &cell, &self.runs, &mut result, &mut None);
        if let (Some(saved), Some(slot)) = (saved, self.runs.run_mut(config)) {
            *slot = saved;
        }
        result.rows.retain(|r| r.config == config.at(world));
        result.rows
    }
}

/// Judges every selected configuration of one cell against each of its references (the
/// catalog's edges, [`Config::edges`]), pushing one row per edge (and the comparison behind
/// it) into `result`.
fn judge_cell(
    plan: &Plan,
    cell: &Cell<'_>,
    runs: &CellRuns,
    result: &mut MatrixResult,
    log: &mut Option<std::io::BufWriter<std::fs::File>>,
) {
    let world = cell.world;
    for &config in &plan.configs {
        let run = runs.run_of(config);
        let blocked = plan.blocker(cell.index, world, config);
        for edge in config.edges(world) {
            let skip = blocked
                .clone()
                .or_else(|| plan.reference_blocker(cell.index, world, edge.against));
            let judge = resolve_edge(plan, cell, runs, config, edge);
            let log = log.as_mut().map(|w| w as &mut dyn std::io::Write);
            let reference = edge.against.at(config, world);
            let (r, c) = judge_row(plan, cell, config, reference, judge, skip, run, log);
            result.comparisons.extend(c);
            result.rows.push(r);
        }
    }
}

/// The runs edge `edge` of `config` is judged with, and how.
fn resolve_edge<'r>(
    plan: &Plan,
    cell: &Cell<'_>,
    runs: &'r CellRuns,
    config: Config,
    edge: Edge,
) -> Judge<'r> {
    let policy = || Judge::Policy {
        policy: config.edge_policy(edge.against, cell.world, plan.backend),
        against: runs.fp32(config, edge.against),
    };
    match edge.judged {
        Judged::Policy => policy(),
        Judged::Arbiter(a) if a.else_policy && runs.shadow(a.shadow).is_none() => policy(),
        Judged::Arbiter(a) => runs.arbiter(config, a),
        Judged::BitwiseUnlessPlanBlocks(a) => {
            let planned = plan.pipeline_plans.get(&(cell.index, cell.world, config));
            let blocked = matches!(planned, Some(Ok(p)) if p.bitwise_blocker.is_some());
            match blocked && runs.fp32(config, a.envelope).is_some() {
                true => runs.arbiter(config, a),
                false => policy(),
            }
        }
    }
}

/// Whether `a` and `b` are the same run (both absent counts).
fn same_run(a: Option<&RecordResult>, b: Option<&RecordResult>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// How a row is judged.
enum Judge<'a> {
    /// Under a tolerance policy (bitwise, or a table with a reasoned override) against
    /// `against`.
    Policy {
        policy: Result<TolerancePolicy, String>,
        against: Option<&'a Result<RunRecord, RunFailed>>,
    },
    /// By the fp64 arbiter: the run's distance to `fp64` within the envelope of `fp32`'s,
    /// widened to the largest distance among the `spread` (other correct fp32 runs).
    Arbiter {
        fp32: Option<&'a Result<RunRecord, RunFailed>>,
        fp64: Option<&'a Result<RunRecord, RunFailed>>,
        spread: Vec<&'a Result<RunRecord, RunFailed>>,
    },
}

/// The matrix cell a row belongs to.
struct Cell<'a> {
    /// The model's index in the plan.
    index: usize,
    model: &'a str,
    world: usize,
    /// Why the model has no single-device reference, if it has none.
    blocker: Option<&'a str>,
}

/// One row: its verdict and, when values were compared, the comparison behind it.
#[allow(clippy::too_many_arguments)]
fn judge_row(
    plan: &Plan,
    cell: &Cell<'_>,
    config: Config,
    reference_name: String,
    judge: Judge<'_>,
    skip: Option<String>,
    run: Option<&Result<RunRecord, RunFailed>>,
    log: ArbiterLog<'_>,
) -> (Row, Option<Comparison>) {
    let mut r = empty_row(cell, config, reference_name, &judge, run);
    if let Some(reason) = skip {
        // No run: the configuration cannot run here at all.
        r.inapplicable = run.is_none();
        r.note = Some(reason);
        return (r, None);
    }
    if let Some(e) = first_failed_run(&judge, run) {
        r.status = RowStatus::Error;
        r.note = Some(e.line.clone());
        r.details = Some(e.details.clone());
        r.timed_out = e.timed_out;
        return (r, None);
    }
    let dropped = ok(judge.against()).and_then(|b| b.tokens_dropped);
    let c = match (judge, ok(run)) {
        (
            Judge::Policy {
                policy: Err(e),
                against,
            },
            Some(_),
        ) if ok(against).is_some() => {
            r.status = RowStatus::Error;
            r.note = Some(e);
            return (r, None);
        }
        (
            Judge::Policy {
                policy: Ok(p),
                against,
            },
            Some(a),
        ) if ok(against).is_some() => ok(against).map(|b| compare(a, b, &p)),
        (Judge::Arbiter { fp32, fp64, spread }, Some(a)) => match (ok(fp32), ok(fp64)) {
            (Some(b), Some(wide)) => {
                let spread: Vec<&RunRecord> =
                    spread.into_iter().filter_map(|o| ok(Some(o))).collect();
                let build = runner::zoo_builder(cell.model);
                let settings = plan.settings_for(cell.model);
                let launch = (&build as &runner::ModelBuilder<'_>, cell.world, &settings);
                let mut c = runner::arbiter_verdict(launch, a, (b, &spread, wide), log);
                // Named after the row: a simpler configuration's envelope keeps its own key.
                c.reference.clone_from(&r.reference);
                Some(c)
            }
            _ => None,
        },
        _ => None,
    };
    let Some(c) = c else {
        r.note = Some(not_run(cell));
        return (r, None);
    };
    record_verdict(&mut r, &c, dropped);
    (r, Some(c))
}

/// A row's record, when it has one.
fn ok(o: Option<&Result<RunRecord, RunFailed>>) -> Option<&RunRecord> {
    o.and_then(|o| o.as_ref().ok())
}

impl<'a> Judge<'a> {
    /// The run the row is named against: the policy's reference, or the arbiter's envelope.
    fn against(&self) -> Option<&'a Result<RunRecord, RunFailed>> {
        match self {
            Judge::Policy { against, .. } => *against,
            Judge::Arbiter { fp32, .. } => *fp32,
        }
    }
}

/// A row of `config` against `reference_name` in `cell`, judged as `judge` says, before any
/// verdict (skipped until one is reached).
fn empty_row(
    cell: &Cell<'_>,
    config: Config,
    reference_name: String,
    judge: &Judge<'_>,
    run: Option<&Result<RunRecord, RunFailed>>,
) -> Row {
    let row_name = config.at(cell.world);
    let mode = match judge {
        Judge::Arbiter { .. } => "arbiter",
        Judge::Policy { policy: Ok(p), .. }
            if p.mode() == Mode::Bitwise && p.override_for(&row_name).is_none() =>
        {
            "bitwise"
        }
        Judge::Policy { .. } => "tolerance",
    };
    Row {
        model: cell.model.to_owned(),
        config: row_name,
        reference: reference_name,
        world_size: cell.world,
        status: RowStatus::Skip,
        mode,
        max_abs_err: None,
        max_ulp: None,
        margin: None,
        memory: ok(run).and_then(|r| r.memory),
        note: None,
        details: None,
        arbiter: None,
        timed_out: false,
        inapplicable: false,
    }
}

/// The first run a row reads that failed: the run itself, its reference, the shadow, a
/// spread run.
fn first_failed_run<'a>(
    judge: &Judge<'a>,
    run: Option<&'a Result<RunRecord, RunFailed>>,
) -> Option<&'a RunFailed> {
    let (extra, spread) = match judge {
        Judge::Policy { .. } => (None, &[][..]),
        Judge::Arbiter { fp64, spread, .. } => (*fp64, &spread[..]),
    };
    [run, judge.against(), extra]
        .into_iter()
        .flatten()
        .chain(spread.iter().copied())
        .find_map(|o| o.as_ref().err())
}

/// `r` with the verdict of comparison `c`: status, worst errors, and a note saying where it
/// first failed, why a tolerance was overridden, whether the step-local check decided it,
/// and how many token choices the reference dropped.
fn record_verdict(r: &mut Row, c: &Comparison, dropped: Option<u64>) {
    let overall = c.overall();
    r.status = if c.passed {
        RowStatus::Pass
    } else {
        RowStatus::Fail
    };
    r.max_abs_err = Some(overall.max_abs_err);
    r.max_ulp = Some(overall.max_ulp);
    r.margin = Some(overall.margin);
    r.arbiter.clone_from(&c.arbiter);
    let found = short_failure(c);
    r.note = match (found, &c.override_reason) {
        (Some(f), Some(o)) => Some(format!("{f}; {OVERRIDE}: {o}")),
        (None, Some(o)) => Some(format!("{OVERRIDE}: {o}")),
        (found, None) => found,
    };
    if let Some(left) = c.arbiter.as_ref().and_then(|a| a.trajectory_left.as_ref()) {
        r.note = Some(format!(
            "step-local: the trajectory left its envelope at {left}; every step is within \
             the envelope from the run's own state"
        ));
    }
    if let Some(n) = dropped {
        // Says the row exercised dropping (the run must have dropped the same choices).
        let said = format!("{} dropped {n} token choices", r.reference);
        r.note = Some(match r.note.take() {
            Some(note) => format!("{note}; {said}"),
            None => said,
        });
    }
}

/// Why a row has nothing to compare: no single-device reference, or a run that never ran.
fn not_run(cell: &Cell<'_>) -> String {
    match cell.blocker {
        Some(reason) => format!("{NO_SINGLE}: {reason}"),
        None => "not run".into(),
    }
}
