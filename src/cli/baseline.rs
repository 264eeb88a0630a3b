//! `lockstep baseline update`: the one way a repository's baseline changes, on purpose.

use super::args::BaselineCommand;
use super::bad_input;
use anyhow::Result;
use lockstep::harness::report::{
    compare_reports, plural, read_report_or_baseline, write_baseline, CompareOptions, Report,
    ReportError, BASELINE_FILE,
};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Runs a `lockstep baseline` command.
pub(crate) fn run_baseline(what: BaselineCommand) -> Result<ExitCode> {
    match what {
        BaselineCommand::Update {
            baseline,
            from,
            allow_incomplete,
        } => update(&baseline, &from, allow_incomplete),
    }
}

/// The run's file `from` names: itself, or in a report directory its baseline (else its
/// report.json).
fn run_file(from: &Path) -> PathBuf {
    if !from.is_dir() {
        return from.to_owned();
    }
    let baseline = from.join(BASELINE_FILE);
    match baseline.exists() {
        true => baseline,
        false => from.join("report.json"),
    }
}

/// Replaces `baseline` with the run in `from`, printing what changed against the old one.
fn update(baseline: &Path, from: &Path, allow_incomplete: bool) -> Result<ExitCode> {
    let source = run_file(from);
    let new = match read_report_or_baseline(&source) {
        Ok(r) => r,
        Err(e) => return Ok(bad_input(format!("reading the run: {e}"))),
    };
    if !new.errors.is_empty() && !allow_incomplete {
        return Ok(bad_input(format!(
            "{}: {} errored (a run failed), so it is no baseline; rerun, or pass \
             --allow-incomplete to record the errors; {} left as it was",
            source.display(),
            plural(new.errors.len(), "comparison"),
            baseline.display()
        )));
    }
    match read_old(baseline) {
        Ok(Some(old)) => {
            let changes = match compare_reports(&old, &new, &CompareOptions::default()) {
                Ok(c) => c,
                Err(e) => return Ok(bad_input(format!("comparing with the old baseline: {e}"))),
            };
            let changed: Vec<_> = changes
                .rows
                .iter()
                .filter(|r| r.status != lockstep::harness::report::RowTrend::Ok)
                .collect();
            for r in &changed {
                println!(
                    "{:<17} {} {} vs {}",
                    r.status.to_string(),
                    r.model,
                    r.config,
                    r.reference
                );
            }
            println!(
                "against the old baseline: {} changed ({} regressed), {} in all",
                plural(changed.len(), "comparison"),
                changes.regressions().count(),
                plural(changes.rows.len(), "comparison")
            );
        }
        Ok(None) => println!(
            "no baseline at {} yet: writing the first",
            baseline.display()
        ),
        Err(e) => return Ok(bad_input(format!("reading the old baseline: {e}"))),
    }
    if let Some(dir) = baseline.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    write_baseline(&new, baseline)?;
    let bytes = std::fs::metadata(baseline).map_or(0, |m| m.len());
    println!(
        "baseline: {} written from {} ({}, {:.0} KiB)",
        baseline.display(),
        source.display(),
        plural(new.summary.comparisons, "comparison"),
        bytes as f64 / 1024.0
    );
    Ok(ExitCode::SUCCESS)
}

/// The baseline at `path`, `None` when there is none yet.
fn read_old(path: &Path) -> Result<Option<Report>, ReportError> {
    match path.exists() {
        true => read_report_or_baseline(path).map(Some),
        false => Ok(None),
    }
}
