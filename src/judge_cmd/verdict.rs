//! The verdict where the user first looks: the terminal and the CI job page. A failing job's
//! first failure (which tensor, which step, by how much) and its diagnosis (the likely
//! cause) were only in the report files, so a user saw "1 failed" and had to go digging.

use lockstep_harness::report::{Report, ReportFiles};
use std::fmt::Write as _;

/// Structural mismatches shown per comparison before "and N more".
const MAX_STRUCTURAL: usize = 5;

/// Each failed comparison's account, one block per comparison: what failed first, and why
/// it most likely did. Empty when every comparison passed.
pub fn failures(report: &Report) -> Vec<String> {
    report
        .comparisons
        .iter()
        .filter(|c| !c.passed)
        .map(|c| {
            let mut block = format!("FAIL {} vs {}", c.config, c.reference);
            // The diagnosis often quotes the first failure already: say it once.
            let said = |text: &str| c.diagnosis.as_deref().is_some_and(|d| d.contains(text));
            if let Some(first) = c.first_failure.as_ref().map(ToString::to_string) {
                if !said(&first) {
                    let _ = write!(block, "\n  first failure: {first}");
                }
            }
            if let Some(derived) = c.derived_failure.as_ref().map(ToString::to_string) {
                if !said(&derived) {
                    let _ = write!(block, "\n  which then showed in: {derived}");
                }
            }
            for s in c.structural.iter().take(MAX_STRUCTURAL) {
                let _ = write!(block, "\n  structure: {s}");
            }
            if c.structural.len() > MAX_STRUCTURAL {
                let more = c.structural.len() - MAX_STRUCTURAL;
                let _ = write!(
                    block,
                    "\n  structure: and {more} more (report.md lists them)"
                );
            }
            if let Some(d) = &c.diagnosis {
                let _ = write!(block, "\n  diagnosis: {d}");
            }
            block
        })
        .collect()
}

/// What the terminal shows after the notes: the headline, each failure's account, and where
/// the reports are.
pub fn terminal(report: &Report, files: &ReportFiles) -> String {
    let mut out = report.headline();
    out.push('\n');
    for block in failures(report) {
        out.push_str(&block);
        out.push('\n');
    }
    let _ = writeln!(out, "reports: {}", files.markdown.display());
    out
}

/// The same for a CI job page (`GITHUB_STEP_SUMMARY`, Markdown).
pub fn step_summary(report: &Report, files: &ReportFiles) -> String {
    let verdict = if report.passed() {
        "passed"
    } else {
        "**failed**"
    };
    let mut out = format!("### lockstep judge: {verdict}\n\n{}\n\n", report.headline());
    for block in failures(report) {
        let _ = writeln!(out, "```text\n{block}\n```\n");
    }
    let _ = writeln!(out, "Reports: `{}`\n", files.markdown.display());
    out
}
