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
            let microbatched: Vec<(usize, Result<RunRecord, RunFailed>)> = plan
                .microbatch_references(m, world)
                .into_iter()
                .map(|mb| {
                    let label = format!("{model} {}@{world}", microbatched_name(mb));
                    progress.start(&label);
                    let t0 = Instant::now();
                    let outcome = run_microbatched(model, world, mb, plan);
                    result.runs += 1;
                    let err = outcome.as_ref().err().map(|e| e.line.as_str());
                    if err.is_some() {
                        result.failed_runs += 1;
                    }
                    progress.finish(&label, t0.elapsed(), err);
                    (mb, outcome)
                })
                .collect();
            let mut row =
                |config: Config,
                 reference_name: String,
                 policy: Result<TolerancePolicy, String>,
                 skip: Option<String>,
                 run: Option<&Result<RunRecord, RunFailed>>,
                 against: Option<&Result<RunRecord, RunFailed>>| {
                    let overridden = policy
                        .as_ref()
                        .ok()
                        .and_then(|p| p.override_for(&config.at(world)))
                        .map(|o| o.reason().to_owned());
                    let mut r = Row {
                        model: model.clone(),
                        config: config.at(world),
                        reference: reference_name,
                        world_size: world,
                        status: RowStatus::Skip,
                        mode: match (&policy, &overridden) {
                            (Ok(p), None) if p.mode() == Mode::Bitwise => "bitwise",
                            _ => "tolerance",
                        },
                        max_abs_err: None,
                        max_ulp: None,
                        margin: None,
                        memory: run.and_then(|r| r.as_ref().ok()).and_then(|r| r.memory),
                        note: None,
                        details: None,
                        timed_out: false,
                    };
                    match (skip, run, against, policy) {
                        (Some(reason), _, _, _) => r.note = Some(reason),
                        (None, Some(Ok(a)), Some(Ok(b)), Ok(policy)) => {
                            let c = compare(a, b, &policy);
                            let overall = c.overall();
                            r.status = if c.passed {
                                RowStatus::Pass
                            } else {
                                RowStatus::Fail
                            };
                            r.max_abs_err = Some(overall.max_abs_err);
                            r.max_ulp = Some(overall.max_ulp);
                            r.margin = Some(overall.margin);
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
                            result.comparisons.push(c);
                        }
                        (None, Some(Err(e)), _, _) | (None, _, Some(Err(e)), _) => {
                            r.status = RowStatus::Error;
                            r.note = Some(e.line.clone());
                            r.details = Some(e.details.clone());
                            r.timed_out = e.timed_out;
                        }
                        (None, Some(Ok(_)), Some(Ok(_)), Err(e)) => {
                            r.status = RowStatus::Error;
                            r.note = Some(e);
                        }
                        (None, _, _, _) => {
                            r.note = Some(match blocker {
                                Some(reason) => format!("{NO_SINGLE}: {reason}"),
                                None => "not run".into(),
                            });
                        }
                    }
                    result.rows.push(r);
                };
            // The `i`-th run of reference `config` (0: the reference, 1: its repeat).
            let reference = |config: Config, i: usize| {
                references
                    .iter()
                    .find(|(c, _)| *c == config)
                    .and_then(|(_, runs)| runs.get(i))
            };
            // A row against a configuration reference: its policy and skip reason follow
            // from the configuration.
            let against_config = |config: Config, reference: Config| {
                (
                    reference.at(world),
                    with_backend_override(
                        with_drift_override(
                            config.policy(reference, world),
                            model,
                            config,
                            reference,
                            world,
                        ),
                        config,
                        reference,
                        world,
                        plan.backend,
                    ),
                    config.world_blocker(world),
                )
            };
            for &config in &plan.configs {
                match config {
                    // `ddp.hybrid_order` is never selected (a reference only); were it, its
                    // row would be its repeat's, like the other DDP references.
                    Config::Single | Config::DdpMixed(_) | Config::DdpHybridOrder => {
                        let (name, policy, skip) = against_config(config, config);
                        row(
                            config,
                            name,
                            policy,
                            skip,
                            reference(config, 0),
                            reference(config, 1),
                        );
                    }
                    Config::Ddp => {
                        let ddp = reference(Config::Ddp, 0);
                        let (name, policy, skip) = against_config(config, Config::Single);
                        row(
                            config,
                            name,
                            policy,
                            skip,
                            ddp,
                            reference(Config::Single, 0),
                        );
                        let (name, policy, skip) = against_config(config, config);
                        row(config, name, policy, skip, ddp, reference(Config::Ddp, 1));
                    }
                    Config::Fsdp(id) => {
                        let run = fsdp.iter().find(|(c, _)| *c == config).map(|(_, r)| r);
                        let ddp = id.get().ddp_reference();
                        let (name, policy, skip) = against_config(config, ddp);
                        row(config, name, policy, skip, run, reference(ddp, 0));
                        // Mixed precision has no row against single (module doc).
                        if config.precision().is_none() {
                            let (name, policy, skip) = against_config(config, Config::Single);
                            row(
                                config,
                                name,
                                policy,
                                skip,
                                run,
                                reference(Config::Single, 0),
                            );
                        }
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
                            let reference = model_parallel
                                .iter()
                                .chain(&pipelines)
                                .find(|(c, _)| *c == simpler)
                                .map(|(_, r)| r);
                            let (name, policy, skip) = against_config(config, simpler);
                            let simpler_blocked = simpler
                                .world_blocker(world)
                                .or_else(|| {
                                    plan.model_parallel_blockers
                                        .get(&(m, world, simpler))
                                        .cloned()
                                        .flatten()
                                })
                                .map(|reason| format!("{}: {reason}", simpler.name()));
                            row(
                                config,
                                name,
                                policy,
                                skip.or_else(|| blocked.clone()).or(simpler_blocked),
                                run,
                                reference,
                            );
                        }
                        let (name, policy, skip) = against_config(config, Config::Single);
                        let skip = skip.or_else(|| {
                            plan.model_parallel_blockers
                                .get(&(m, world, config))
                                .cloned()
                                .flatten()
                        });
                        row(
                            config,
                            name,
                            policy,
                            skip,
                            run,
                            reference(Config::Single, 0),
                        );
                    }
                    Config::Pipeline(id) => {
                        let run = pipelines.iter().find(|(c, _)| *c == config).map(|(_, r)| r);
                        let planned = plan.pipeline_plans.get(&(m, world, config));
                        let skip = config.world_blocker(world).or_else(|| match planned {
                            Some(Err(reason)) => Some(reason.clone()),
                            _ => None,
                        });
                        let (name, policy, _) = against_config(config, Config::Single);
                        row(
                            config,
                            name,
                            policy,
                            skip.clone(),
                            run,
                            reference(Config::Single, 0),
                        );
                        match planned {
                            Some(Ok(p)) if p.data_parallel == 1 => {
                                let mb = microbatched
                                    .iter()
                                    .find(|(n, _)| *n == p.microbatches)
                                    .map(|(_, r)| r);
                                let policy = policy_vs_microbatched(&config.at(world), p);
                                row(
                                    config,
                                    format!("{}@{world}", microbatched_name(p.microbatches)),
                                    policy,
                                    None,
                                    run,
                                    mb,
                                );
                            }
                            Some(Ok(_)) => {}
                            _ => {
                                let id_m = id.get().ranks(world).map_or(0, |p| 2 * p);
                                row(
                                    config,
                                    format!("{}@{world}", microbatched_name(id_m)),
                                    Ok(TolerancePolicy::bitwise(DType::F32)),
                                    skip,
                                    None,
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
