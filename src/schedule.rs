//! `lockstep schedule`: a pipeline schedule as data, before anything runs — its rank ×
//! time-step table, its simulated bubble, and the validator's verdict — for a built-in
//! schedule or one loaded from PyTorch-style CSV; `--export` writes it back as CSV.

use lockstep_core::pipeline::schedule::{
    from_csv, generate, lower, render_table, simulate, to_csv, validate, Costs, Schedule,
    ScheduleError, ScheduleKind, Simulation,
};
use serde::Serialize;
use std::path::PathBuf;

/// What `lockstep schedule` shows.
#[derive(Clone, Debug)]
pub struct ScheduleOptions {
    /// A built-in schedule's name; ignored when `csv` is given.
    pub schedule: String,
    /// Pipeline ranks `p`.
    pub stages: usize,
    /// Microbatches per step `m`.
    pub microbatches: usize,
    /// Stages per rank; `None`: the schedule's default.
    pub virtual_stages: Option<usize>,
    /// Load the schedule from this CSV file (one row per rank) instead.
    pub csv: Option<PathBuf>,
    /// Write the (unlowered) schedule as CSV here.
    pub export: Option<PathBuf>,
}

/// What `lockstep schedule --json` prints.
#[derive(Clone, Debug, Serialize)]
pub struct ScheduleReport {
    /// The schedule's name (built-in, or as the CSV names it).
    pub schedule: String,
    /// Pipeline ranks `p`.
    pub ranks: usize,
    /// Model stages in all: `p` times the virtual stages per rank.
    pub stages: usize,
    /// Microbatches per step `m`.
    pub microbatches: usize,
    /// `valid` or the validator's message.
    pub verdict: String,
    /// The simulation of the lowered schedule (absent when validation failed or it
    /// deadlocked; the verdict says why).
    pub simulation: Option<Simulation>,
    /// The closed form the simulated bubble should equal, where one is known.
    pub closed_form: Option<String>,
    /// Per rank, the lowered actions in PyTorch notation.
    pub actions: Vec<Vec<String>>,
}

/// Why `lockstep schedule` could not build a schedule at all (bad input: exit 2).
#[derive(Debug, thiserror::Error)]
pub enum ScheduleCliError {
    /// The schedule was rejected by its builder or the CSV parser.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// The CSV file could not be read, or the export could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> ScheduleCliError + '_ {
    move |source| ScheduleCliError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Builds (or loads), lowers, validates and simulates the schedule. An invalid or
/// deadlocking schedule is a report with that verdict, not an error.
pub fn run_schedule(opts: &ScheduleOptions) -> Result<ScheduleReport, ScheduleCliError> {
    let (schedule, kind): (Schedule, Option<ScheduleKind>) = match &opts.csv {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(io(path))?;
            (from_csv(&text, None)?, None)
        }
        None => {
            let kind: ScheduleKind = opts.schedule.parse()?;
            let v = opts
                .virtual_stages
                .unwrap_or_else(|| kind.default_virtual());
            (
                generate(kind, opts.stages, v, opts.microbatches)?,
                Some(kind),
            )
        }
    };
    if let Some(path) = &opts.export {
        std::fs::write(path, to_csv(&schedule.compute_only())).map_err(io(path))?;
    }
    let lowered = lower(&schedule);
    let (verdict, simulation) = match validate(&lowered) {
        Err(e) => (e.to_string(), None),
        Ok(()) => match simulate(&lowered, Costs::default()) {
            Ok(sim) => ("valid".to_owned(), Some(sim)),
            Err(e) => (e.to_string(), None),
        },
    };
    let (p, m) = (schedule.ranks, schedule.microbatches);
    let v = schedule.stages() / p.max(1);
    let closed_form = match kind {
        Some(ScheduleKind::GPipe | ScheduleKind::OneFOneB) => {
            Some(format!("(p-1)/(m+p-1) = {}/{}", p - 1, m + p - 1))
        }
        Some(ScheduleKind::Interleaved1F1B) => {
            Some(format!("(p-1)/(v·m+p-1) = {}/{}", p - 1, v * m + p - 1))
        }
        _ => None,
    };
    Ok(ScheduleReport {
        schedule: schedule.name.clone(),
        ranks: p,
        stages: schedule.stages(),
        microbatches: m,
        verdict,
        simulation,
        closed_form,
        actions: lowered
            .actions
            .iter()
            .map(|a| a.iter().map(ToString::to_string).collect())
            .collect(),
    })
}

/// The human rendering: header, table, bubble, verdict.
pub fn render_schedule(report: &ScheduleReport) -> String {
    let mut out = format!(
        "schedule {}: {}, {}, {}\n\n",
        report.schedule,
        lockstep_harness::report::plural(report.ranks, "rank"),
        lockstep_harness::report::plural(report.stages, "stage"),
        lockstep_harness::report::plural(report.microbatches, "microbatch")
    );
    if let Some(sim) = &report.simulation {
        out.push_str(&render_table(sim, Some(160)));
        out.push('\n');
        out.push_str(&format!(
            "simulated bubble: {}/{} = {:.4} (F = 1, I = 1, W = 1, B = 2 time units)\n",
            sim.bubble_numerator, sim.bubble_denominator, sim.bubble_fraction
        ));
    }
    if let Some(cf) = &report.closed_form {
        out.push_str(&format!("closed form:      {cf}\n"));
    }
    out.push_str(&format!("validator:        {}\n", report.verdict));
    out
}
