//! Running a plan: references in process, parallel configurations in forked launches,
//! then the comparisons that make the rows.

use super::*;

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
    let mut progress = Progress {
        bar,
        done: 0,
        total: plan.run_count(),
        log_runs,
    };
    let mut result = MatrixResult {
        rows: Vec::new(),
        comparisons: Vec::new(),
        runs: 0,
        failed_runs: 0,
        hung_runs: 0,
        elapsed: Duration::ZERO,
    };
    for (m, (model, blocker)) in plan.models.iter().zip(&plan.blockers).enumerate() {
        for &world in &plan.world_sizes {
            let settings = plan.settings();
            let build = runner::zoo_builder(model);
            // The first run of every launched configuration of this cell, in one launch
            // (subtests); repeats of references stay fresh launches of their own, since
            // they check that a fresh process reproduces the bits.
            let mut together: BTreeMap<Config, Result<RunRecord, RunFailed>> = BTreeMap::new();
            if plan.subtests && !settings.execs_ranks() {
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
                if configs.len() > 1 {
                    let label =
                        format!("{model} @{world}: {} configs in one launch", configs.len());
                    progress.start(&label);
                    let t0 = Instant::now();
                    let outcomes =
                        runner::run_configs_together(model, &build, &configs, world, &settings);
                    let each = t0.elapsed() / configs.len() as u32;
                    for (config, outcome) in configs.into_iter().zip(outcomes) {
                        progress.finish(
                            &format!("{model} {}", config.at(world)),
                            each,
                            outcome.as_ref().err().map(|e| e.line.as_str()),
                        );
                        together.insert(config, outcome);
                    }
                }
            }
            let mut run_one = |config: Config, attempt: usize, of: usize| {
                let label = if of > 1 {
                    format!("{model} {} (run {attempt}/{of})", config.at(world))
                } else {
                    format!("{model} {}", config.at(world))
                };
                let outcome = match together.remove(&config).filter(|_| attempt == 1) {
                    Some(outcome) => outcome,
                    None => {
                        progress.start(&label);
                        let t0 = Instant::now();
                        let outcome = runner::run_config(model, &build, config, world, &settings);
                        progress.finish(
                            &label,
                            t0.elapsed(),
                            outcome.as_ref().err().map(|e| e.line.as_str()),
                        );
                        outcome
                    }
                };
                result.runs += 1;
                if outcome.is_err() {
                    result.failed_runs += 1;
                }
                if outcome.as_ref().is_err_and(|e| e.timed_out) {
                    result.hung_runs += 1;
                }
                outcome
            };
            let references: Vec<(Config, Vec<Result<RunRecord, RunFailed>>)> = plan
                .runs_per_cell(m, world)
                .into_iter()
                .map(|(c, n)| (c, (1..=n).map(|i| run_one(c, i, n)).collect()))
                .collect();
            let fsdp: Vec<(Config, Result<RunRecord, RunFailed>)> = plan
                .fsdp_launches(world)
                .into_iter()
                .map(|c| (c, run_one(c, 1, 1)))
                .collect();
            let pipelines: Vec<(Config, Result<RunRecord, RunFailed>)> = plan
                .pipeline_launches(m, world)
                .into_iter()
                .map(|(c, _)| (c, run_one(c, 1, 1)))
                .collect();
            let model_parallel: Vec<(Config, Result<RunRecord, RunFailed>)> = plan
                .model_parallel_launches(m, world)
                .into_iter()
                .chain(plan.simpler_references(m, world))
                .map(|c| (c, run_one(c, 1, 1)))
                .collect();
            let mut in_process = |label: String, run: &dyn Fn() -> Result<RunRecord, RunFailed>| {
                progress.start(&label);
                let t0 = Instant::now();
                let outcome = run();
                result.runs += 1;
                let err = outcome.as_ref().err().map(|e| e.line.as_str());
                if err.is_some() {
                    result.failed_runs += 1;
                }
                progress.finish(&label, t0.elapsed(), err);
                outcome
            };
            // (microbatches, fp32 reference, its float64 shadow)
            type Pair = (Result<RunRecord, RunFailed>, Result<RunRecord, RunFailed>);
            let microbatched: Vec<(usize, Pair)> = plan
                .microbatch_references(m, world)
                .into_iter()
                .map(|mb| {
                    let name = microbatched_name(mb);
                    let fp32 = in_process(format!("{model} {name}@{world}"), &|| {
                        run_microbatched(model, world, mb, plan)
                    });
                    let fp64 = in_process(format!("{model} {name}.f64@{world}"), &|| {
                        run_microbatched_f64(model, world, mb, plan)
                    });
                    (mb, (fp32, fp64))
                })
                .collect();
            let single_f64: Option<Result<RunRecord, RunFailed>> =
                plan.needs_f64(m, world).then(|| {
                    in_process(format!("{model} single.f64@{world}"), &|| {
                        runner::run_single_f64(model, &build, world, &settings)
                    })
                });
            let mut row = |config: Config,
                           reference_name: String,
                           judge: Judge<'_>,
                           skip: Option<String>,
                           run: Option<&Result<RunRecord, RunFailed>>| {
                let cell = Cell {
                    model,
                    world,
                    blocker: blocker.as_deref(),
                };
                let (r, c) = judge_row(&cell, config, reference_name, judge, skip, run, {
                    arbiter_log.as_mut().map(|w| w as &mut dyn std::io::Write)
                });
                result.comparisons.extend(c);
                result.rows.push(r);
            };
            // The `i`-th run of reference `config` (0: the reference, 1: its repeat).
            let reference = |config: Config, i: usize| {
                references
                    .iter()
                    .find(|(c, _)| *c == config)
                    .and_then(|(_, runs)| runs.get(i))
            };
            // A row against a configuration reference under its tolerance policy.
            let policy_against = |config: Config, reference: Config, against| Judge::Policy {
                policy: with_backend_override(
                    config.policy(reference, world),
                    config,
                    reference,
                    world,
                    plan.backend,
                ),
                against,
            };
            // A row judged by the fp64 arbiter around the single-device reference: with
            // the reference's own noise, or (mixed precision) the run's own DDP reference's.
            let arbiter_single = |envelope_of| Judge::Arbiter {
                fp32: envelope_of,
                fp64: single_f64.as_ref(),
            };
            let single_ref = reference(Config::Single, 0);
            for &config in &plan.configs {
                let world_skip = config.world_blocker(world);
                match config {
                    // `ddp.hybrid_order` is never selected (a reference only); were it, its
                    // row would be its repeat's, like the other DDP references.
                    Config::Single | Config::DdpMixed(_) | Config::DdpHybridOrder => {
                        let judge = policy_against(config, config, reference(config, 1));
                        row(
                            config,
                            config.at(world),
                            judge,
                            world_skip,
                            reference(config, 0),
                        );
                    }
                    Config::Ddp => {
                        let ddp = reference(Config::Ddp, 0);
                        let judge = arbiter_single(single_ref);
                        row(
                            config,
                            Config::Single.at(world),
                            judge,
                            world_skip.clone(),
                            ddp,
                        );
                        let judge = policy_against(config, config, reference(Config::Ddp, 1));
                        row(config, config.at(world), judge, world_skip, ddp);
                    }
                    Config::Fsdp(id) => {
                        let run = fsdp.iter().find(|(c, _)| *c == config).map(|(_, r)| r);
                        let ddp = id.get().ddp_reference();
                        let judge = policy_against(config, ddp, reference(ddp, 0));
                        row(config, ddp.at(world), judge, world_skip.clone(), run);
                        // Mixed precision is judged around its own DDP reference's noise.
                        let envelope_of = match config.precision() {
                            None => single_ref,
                            Some(_) => reference(ddp, 0),
                        };
                        let judge = arbiter_single(envelope_of);
                        row(config, Config::Single.at(world), judge, world_skip, run);
                    }
                    Config::ModelParallel(_) | Config::Composed(_) => {
                        let run = model_parallel
                            .iter()
                            .find(|(c, _)| *c == config)
                            .map(|(_, r)| r);
                        let blocked = plan
                            .model_parallel_blockers
                            .get(&(m, world, config))
                            .cloned()
                            .flatten();
                        if let Some(simpler) = config
                            .composition_config()
                            .and_then(CompositionConfig::simpler)
                        {
                            let against = model_parallel
                                .iter()
                                .chain(&pipelines)
                                .find(|(c, _)| *c == simpler)
                                .map(|(_, r)| r);
                            let simpler_blocked = simpler
                                .world_blocker(world)
                                .or_else(|| {
                                    plan.model_parallel_blockers
                                        .get(&(m, world, simpler))
                                        .cloned()
                                        .flatten()
                                })
                                .map(|reason| format!("{}: {reason}", simpler.name()));
                            let judge = match config.policy(simpler, world) {
                                // Not bitwise by the math: the arbiter, with the simpler
                                // configuration's own noise as the envelope.
                                Ok(p)
                                    if p.override_for(&config.at(world)).is_some()
                                        && single_f64.is_some() =>
                                {
                                    arbiter_single(against)
                                }
                                _ => policy_against(config, simpler, against),
                            };
                            let skip = world_skip
                                .clone()
                                .or_else(|| blocked.clone())
                                .or(simpler_blocked);
                            row(config, simpler.at(world), judge, skip, run);
                        }
                        let skip = world_skip.or(blocked);
                        row(
                            config,
                            Config::Single.at(world),
                            arbiter_single(single_ref),
                            skip,
                            run,
                        );
                    }
                    Config::Pipeline(id) => {
                        let run = pipelines.iter().find(|(c, _)| *c == config).map(|(_, r)| r);
                        let planned = plan.pipeline_plans.get(&(m, world, config));
                        let skip = world_skip.or_else(|| match planned {
                            Some(Err(reason)) => Some(reason.clone()),
                            _ => None,
                        });
                        row(
                            config,
                            Config::Single.at(world),
                            arbiter_single(single_ref),
                            skip.clone(),
                            run,
                        );
                        match planned {
                            Some(Ok(p)) if p.data_parallel == 1 => {
                                let mb = microbatched
                                    .iter()
                                    .find(|(n, _)| *n == p.microbatches)
                                    .map(|(_, r)| r);
                                let name = format!("{}@{world}", microbatched_name(p.microbatches));
                                let judge = match (&p.bitwise_blocker, mb) {
                                    // Equal by the math only up to summation order: the arbiter
                                    // around the microbatched reference's own float64 shadow.
                                    (Some(_), Some((fp32, fp64))) => Judge::Arbiter {
                                        fp32: Some(fp32),
                                        fp64: Some(fp64),
                                    },
                                    _ => Judge::Policy {
                                        policy: Ok(TolerancePolicy::bitwise(DType::F32)),
                                        against: mb.map(|(fp32, _)| fp32),
                                    },
                                };
                                row(config, name, judge, None, run);
                            }
                            Some(Ok(_)) => {}
                            _ => {
                                let id_m = id.get().ranks(world).map_or(0, |p| 2 * p);
                                let judge = Judge::Policy {
                                    policy: Ok(TolerancePolicy::bitwise(DType::F32)),
                                    against: None,
                                };
                                row(
                                    config,
                                    format!("{}@{world}", microbatched_name(id_m)),
                                    judge,
                                    skip,
                                    None,
                                );
                            }
                        }
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    result.elapsed = started.elapsed();
    result
}

/// How a row is judged.
enum Judge<'a> {
    /// Under a tolerance policy (bitwise, or a table with a reasoned override) against
    /// `against`.
    Policy {
        policy: Result<TolerancePolicy, String>,
        against: Option<&'a Result<RunRecord, RunFailed>>,
    },
    /// By the fp64 arbiter: the run's distance to `fp64` within the envelope of `fp32`'s.
    Arbiter {
        fp32: Option<&'a Result<RunRecord, RunFailed>>,
        fp64: Option<&'a Result<RunRecord, RunFailed>>,
    },
}

/// The matrix cell a row belongs to.
struct Cell<'a> {
    model: &'a str,
    world: usize,
    /// Why the model has no single-device reference, if it has none.
    blocker: Option<&'a str>,
}

/// One row: its verdict and, when values were compared, the comparison behind it.
fn judge_row(
    cell: &Cell<'_>,
    config: Config,
    reference_name: String,
    judge: Judge<'_>,
    skip: Option<String>,
    run: Option<&Result<RunRecord, RunFailed>>,
    log: ArbiterLog<'_>,
) -> (Row, Option<Comparison>) {
    let row_name = config.at(cell.world);
    let mode = match &judge {
        Judge::Arbiter { .. } => "arbiter",
        Judge::Policy { policy: Ok(p), .. }
            if p.mode() == Mode::Bitwise && p.override_for(&row_name).is_none() =>
        {
            "bitwise"
        }
        Judge::Policy { .. } => "tolerance",
    };
    let mut r = Row {
        model: cell.model.to_owned(),
        config: row_name,
        reference: reference_name,
        world_size: cell.world,
        status: RowStatus::Skip,
        mode,
        max_abs_err: None,
        max_ulp: None,
        margin: None,
        memory: run.and_then(|r| r.as_ref().ok()).and_then(|r| r.memory),
        note: None,
        details: None,
        arbiter: None,
        timed_out: false,
    };
    if let Some(reason) = skip {
        r.note = Some(reason);
        return (r, None);
    }
    let (against, extra) = match &judge {
        Judge::Policy { against, .. } => (*against, None),
        Judge::Arbiter { fp32, fp64 } => (*fp32, Some(*fp64)),
    };
    let failed = [run, against, extra.flatten()]
        .into_iter()
        .flatten()
        .find_map(|o| o.as_ref().err());
    if let Some(e) = failed {
        r.status = RowStatus::Error;
        r.note = Some(e.line.clone());
        r.details = Some(e.details.clone());
        r.timed_out = e.timed_out;
        return (r, None);
    }
    fn ok(o: Option<&Result<RunRecord, RunFailed>>) -> Option<&RunRecord> {
        o.and_then(|o| o.as_ref().ok())
    }
    let c = match (judge, ok(run), ok(against)) {
        (Judge::Policy { policy: Err(e), .. }, Some(_), Some(_)) => {
            r.status = RowStatus::Error;
            r.note = Some(e);
            return (r, None);
        }
        (Judge::Policy { policy: Ok(p), .. }, Some(a), Some(b)) => compare(a, b, &p),
        (Judge::Arbiter { fp64, .. }, Some(a), Some(b)) => match ok(fp64) {
            Some(wide) => arbitrate(a, b, wide, &ENVELOPE, log),
            None => {
                r.note = Some(not_run(cell));
                return (r, None);
            }
        },
        _ => {
            r.note = Some(not_run(cell));
            return (r, None);
        }
    };
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
    let found = match (&c.first_failure, c.structural.first()) {
        (Some(f), _) => Some(short_failure(f)),
        (None, Some(s)) => Some(s.clone()),
        (None, None) => None,
    };
    r.note = match (found, &c.override_reason) {
        (Some(f), Some(o)) => Some(format!("{f}; {OVERRIDE}: {o}")),
        (None, Some(o)) => Some(format!("{OVERRIDE}: {o}")),
        (found, None) => found,
    };
    (r, Some(c))
}

/// Why a row has nothing to compare: no single-device reference, or a run that never ran.
fn not_run(cell: &Cell<'_>) -> String {
    match cell.blocker {
        Some(reason) => format!("{NO_SINGLE}: {reason}"),
        None => "not run".into(),
    }
}
