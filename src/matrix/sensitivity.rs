//! Sensitivity of the matrix's own verdicts: `lockstep sensitivity` analyses one model ×
//! configuration × world size, judging every faulted run exactly as `lockstep matrix` judges
//! that configuration (every row of it against its references, the fp64 arbiter and bitwise
//! repeats included); `lockstep matrix --sensitivity` does so for every selected
//! configuration on one small model each and asserts that every math-changing fault is caught.

use super::*;
use crate::sensitivity::{
    analyse, Judgement, SensitivityError, SensitivityOptions, SensitivityReport, Subject,
};
use std::cell::RefCell;

/// The models `matrix --sensitivity` analyses a configuration on, in order of preference: the
/// first that the configuration runs at the world size (the smallest zoo model of each
/// family: `mlp` for data parallelism and pipelines, `gpt` for tensor parallelism and the
/// compositions, `gpt_moe` for expert parallelism, `transformer` for pipelines of more
/// stages than the others have layers).
pub const SENSITIVITY_MODELS: [&str; 4] = ["mlp", "gpt", "gpt_moe", "transformer"];

/// One configuration of the matrix under analysis: its cell's references run once, each
/// faulted run of the configuration then judged by the matrix's rows for it.
pub struct MatrixSubject {
    plan: Plan,
    config: Config,
    world: usize,
    baseline: RefCell<CellBaseline>,
}

impl MatrixSubject {
    /// Plans `config` on `model` at `world_size` as the matrix would (with `steps`, `seed`
    /// and `timeout` for the references and the dry run) and runs the cell's references.
    /// Errors when the matrix would not run it there, or when its rows do not pass without a
    /// fault.
    pub fn new(
        model: &str,
        config: &str,
        world_size: usize,
        opts: &MatrixOptions,
    ) -> Result<Self, SensitivityError> {
        let opts = MatrixOptions {
            models: vec![model.to_owned()],
            configs: vec![config.to_owned()],
            world_sizes: vec![world_size],
            ..opts.clone()
        };
        let plan = plan(&opts)?;
        let &[config] = plan.configs.as_slice() else {
            return Err(SensitivityError::Invalid(format!(
                "`{config}` names {} configurations; give exactly one",
                plan.configs.len()
            )));
        };
        let not_runnable = |reason: String| SensitivityError::NotRunnable {
            config: config.name().to_owned(),
            model: model.to_owned(),
            world_size,
            reason,
        };
        if config == Config::Single {
            return Err(not_runnable(
                "the single-device reference runs in one process: it has no collectives".into(),
            ));
        }
        if let Some(reason) = plan.blocker(0, world_size, config) {
            return Err(not_runnable(reason));
        }
        let mut baseline = CellBaseline::run(&plan, world_size);
        let rows = baseline.rows(config, world_size, None);
        if let Some(failed) = rows
            .iter()
            .find(|r| matches!(r.status, RowStatus::Fail | RowStatus::Error))
        {
            return Err(SensitivityError::FailsWithoutFault {
                config: config.at(world_size),
                reason: row_line(failed),
            });
        }
        if !rows.iter().any(|r| r.status == RowStatus::Pass) {
            let why = rows.iter().find_map(|r| r.note.clone()).unwrap_or_default();
            return Err(not_runnable(format!("no row of it is judged here ({why})")));
        }
        Ok(MatrixSubject {
            plan,
            config,
            world: world_size,
            baseline: RefCell::new(baseline),
        })
    }
}

/// A row's verdict in one line: the reference and the first failure (or the run's error).
fn row_line(r: &Row) -> String {
    format!(
        "{} vs {}: {}",
        r.config,
        r.reference,
        r.note.as_deref().unwrap_or("failed")
    )
}

impl Subject for MatrixSubject {
    fn config(&self) -> String {
        self.config.name().to_owned()
    }
    fn model(&self) -> String {
        self.plan.models[0].clone()
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn settings(&self) -> runner::RunSettings {
        self.plan.settings()
    }
    fn run(&self, settings: &runner::RunSettings) -> Result<RunRecord, RunFailed> {
        let model = &self.plan.models[0];
        let build = runner::zoo_builder(model);
        runner::run_config(model, &build, self.config, self.world, settings)
    }
    fn plants_field_bugs(&self) -> bool {
        !self.plan.exec_ranks
            && matches!(self.config, Config::ModelParallel(_) | Config::Composed(_))
    }
    fn judge(&self, run: &Result<RunRecord, RunFailed>) -> Judgement {
        if let Err(e) = run {
            return Judgement::RunFailed(e.clone());
        }
        let rows = self
            .baseline
            .borrow_mut()
            .rows(self.config, self.world, Some(run.clone()));
        match rows
            .iter()
            .find(|r| matches!(r.status, RowStatus::Fail | RowStatus::Error))
        {
            Some(r) => Judgement::Failed(row_line(r)),
            None => Judgement::Passed,
        }
    }
}

/// `lockstep sensitivity`: the analysis of `config` on `model` at `world_size`, the runs
/// planned from `opts` (steps, seed, the dry run's timeout).
pub fn sensitivity(
    model: &str,
    config: &str,
    world_size: usize,
    opts: &MatrixOptions,
    analysis: &SensitivityOptions,
    bar: &ProgressBar,
) -> Result<SensitivityReport, SensitivityError> {
    lockstep_harness::threads::use_launcher_threads();
    bar.set_message(format!("{config}@{world_size} on {model}: references"));
    let subject = MatrixSubject::new(model, config, world_size, opts)?;
    analyse(&subject, analysis, bar)
}

/// What `lockstep matrix --sensitivity` found for one configuration at one world size.
#[derive(Debug, Serialize)]
pub struct SensitivityEntry {
    /// The configuration.
    pub config: String,
    /// The world size.
    pub world_size: usize,
    /// The analysis, or why there is none.
    #[serde(flatten)]
    pub outcome: SensitivityOutcome,
}

/// One configuration's analysis, or why it has none.
#[derive(Debug, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SensitivityOutcome {
    /// The analysis ran.
    Report(SensitivityReport),
    /// No model of [`SENSITIVITY_MODELS`] (or of `--models`) runs it at this size.
    Skipped(String),
    /// It could not be analysed (its rows fail without a fault, its dry run failed).
    Failed(String),
}

/// `lockstep matrix --sensitivity`: every selected configuration (not `single`) at every
/// world size of `opts`, on the first of `--models` (default [`SENSITIVITY_MODELS`]) it runs
/// on, with `analysis`'s faults and sites.
pub fn sensitivity_matrix(
    opts: &MatrixOptions,
    analysis: &SensitivityOptions,
    bar: &ProgressBar,
) -> Result<Vec<SensitivityEntry>, SensitivityError> {
    lockstep_harness::threads::use_launcher_threads();
    let candidates: Vec<String> = if opts.models.is_empty() {
        SENSITIVITY_MODELS.map(str::to_owned).to_vec()
    } else {
        opts.models.clone()
    };
    let whole = plan(&MatrixOptions {
        models: candidates.clone(),
        ..opts.clone()
    })?;
    let mut entries = Vec::new();
    for &world in &whole.world_sizes {
        for &config in whole.configs.iter().filter(|&&c| c != Config::Single) {
            // In the order of the candidates (the plan keeps zoo order): the cheapest model
            // that exercises the family's code comes first.
            let model = candidates
                .iter()
                .flat_map(|pattern| {
                    let models = whole.models.iter().enumerate();
                    models.filter(move |(_, m)| super::plan::matches(pattern, m))
                })
                .map(|(m, _)| m)
                .find(|&m| whole.blocker(m, world, config).is_none());
            let outcome = match model {
                None => SensitivityOutcome::Skipped(format!(
                    "runs on none of {} at world size {world}",
                    whole.models.join(", ")
                )),
                Some(m) => {
                    let model = &whole.models[m];
                    match sensitivity(model, config.name(), world, opts, analysis, bar) {
                        Ok(report) => SensitivityOutcome::Report(report),
                        Err(e) => SensitivityOutcome::Failed(e.to_string()),
                    }
                }
            };
            let entry = SensitivityEntry {
                config: config.name().to_owned(),
                world_size: world,
                outcome,
            };
            if bar.is_hidden() {
                // No bar where stderr is no terminal (CI logs): a line per configuration.
                eprint!("{}", render_entry(&entry, &mut Vec::new()));
            }
            entries.push(entry);
        }
    }
    Ok(entries)
}

/// The summary of `matrix --sensitivity`: one line per configuration, then every missed
/// math-changing fault as (configuration, site, fault).
pub fn render_sensitivity_matrix(entries: &[SensitivityEntry]) -> String {
    let mut out = format!(
        "{:<40} {:>5}  {:<8} {:>5} {:>5} {:>6} {:>6} {:>5} {:>4} {:>4} {:>5} {:>7}\n",
        "config",
        "world",
        "model",
        "sites",
        "runs",
        "caught",
        "missed",
        "inert",
        "n/a",
        "same",
        "moved",
        "time s"
    );
    let mut misses = Vec::new();
    for e in entries {
        out.push_str(&render_entry(e, &mut misses));
    }
    let inert: usize = entries
        .iter()
        .filter_map(|e| match &e.outcome {
            SensitivityOutcome::Report(r) => Some(r.counts().inert),
            _ => None,
        })
        .sum();
    if inert > 0 {
        let _ = writeln!(
            out,
            "\n{} {} inert: every check passed and every rank trained to the bits \
             of the run without the fault (a result only the faulted rank's own record reads, \
             a value the rank then discards); sensitivity.json lists them",
            lockstep_harness::report::plural(inert, "fault"),
            if inert == 1 { "was" } else { "were" }
        );
    }
    if misses.is_empty() {
        out.push_str(
            "\nevery math-changing fault that changed the training was caught at every site\n",
        );
    } else {
        let _ = writeln!(out, "\nmissed math-changing faults ({}):", misses.len());
        for m in misses {
            out.push_str(&m);
            out.push('\n');
        }
    }
    out
}

/// One configuration's line of the summary; its missed math-changing faults are added to
/// `misses`.
fn render_entry(e: &SensitivityEntry, misses: &mut Vec<String>) -> String {
    match &e.outcome {
        SensitivityOutcome::Report(r) => {
            let c = r.counts();
            for m in r.misses(true) {
                let diverged = match m.verdict {
                    crate::sensitivity::Verdict::Missed { diverged, .. }
                        if !diverged.contains(&0) =>
                    {
                        let ranks: Vec<String> = diverged.iter().map(usize::to_string).collect();
                        format!(" (diverges on rank {} only)", ranks.join(","))
                    }
                    crate::sensitivity::Verdict::Moved { .. } => " (moved)".to_owned(),
                    _ => String::new(),
                };
                misses.push(format!(
                    "  {}@{} on {}: {} {} — {}{diverged}",
                    e.config,
                    e.world_size,
                    r.model,
                    m.site.site(),
                    m.site.describe(),
                    m.fault
                ));
            }
            format!(
                "{:<40} {:>5}  {:<8} {:>5} {:>5} {:>6} {:>6} {:>5} {:>4} {:>4} {:>5} {:>7.1}\n",
                e.config,
                e.world_size,
                r.model,
                r.sites.len(),
                r.runs,
                c.caught,
                c.missed,
                c.inert,
                c.not_applicable,
                c.same,
                c.moved,
                r.wall_time_seconds
            )
        }
        SensitivityOutcome::Skipped(why) => {
            format!("{:<40} {:>5}  skip: {why}\n", e.config, e.world_size)
        }
        SensitivityOutcome::Failed(why) => {
            format!("{:<40} {:>5}  FAILED: {why}\n", e.config, e.world_size)
        }
    }
}

/// Whether `matrix --sensitivity` passed: every configuration analysed (or skipped for want
/// of a model) and no math-changing fault missed.
pub fn sensitivity_matrix_passed(entries: &[SensitivityEntry]) -> bool {
    entries.iter().all(|e| match &e.outcome {
        SensitivityOutcome::Report(r) => {
            r.misses(true).is_empty() && r.field_bugs_missed().is_empty()
        }
        SensitivityOutcome::Skipped(_) => true,
        SensitivityOutcome::Failed(_) => false,
    })
}
