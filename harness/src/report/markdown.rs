//! The Markdown summary: one table a person reads in a pull request or a CI log.

use super::tensors::{
    collectives_line, cross_rank_line, more_rows_line, param_headers, param_rows, plan_line,
    MAX_PARAM_ROWS,
};
use super::{fmt_kib, fmt_num, fmt_ulp, xml_escape, Report};
use crate::parity::Comparison;
use std::fmt::Write as _;

/// Up to this many comparisons, every one gets its per-parameter section; beyond (a whole
/// matrix), only the failing ones, so the summary stays readable (report.html has them all).
const ALL_SECTIONS_UP_TO: usize = 16;

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The summary table (with memory columns when runs measured memory), the per-parameter
/// sections (culprit, cross-rank check, per-parameter table), and the overrides and their
/// reasons.
pub fn render_markdown(report: &Report) -> String {
    let mut out = String::new();
    render_header(report, &mut out);
    render_summary_table(report, &mut out);
    render_errors(report, &mut out);
    render_sections(report, &mut out);
    render_overrides(report, &mut out);
    out
}

/// The title, the environment and the headline with the tool that wrote the report.
fn render_header(report: &Report, out: &mut String) {
    let _ = writeln!(out, "# Lockstep parity report\n");
    if let Some(line) = report.environment_line() {
        let _ = writeln!(out, "{line}\n");
    }
    let _ = write!(out, "{}", report.headline());
    if let Some(t) = report.wall_time_seconds {
        let _ = write!(out, "; wall time {t:.2} s");
    }
    let _ = writeln!(
        out,
        " ({}, schema {}).\n",
        report.tool, report.schema_version
    );
}

/// The summary table: one line per comparison, then per run that errored or was skipped.
fn render_summary_table(report: &Report, out: &mut String) {
    // Memory columns only when some run measured memory (FSDP, and DDP in the matrix).
    let memory = report.has_memory();
    let _ = writeln!(
        out,
        "| model | config | reference | result | max abs err | max rel err | max ULP | margin | to fp64: run / fp32 ref | {}first failure |",
        if memory { "peak full params (KiB) | shard (KiB) | " } else { "" }
    );
    let _ = writeln!(
        out,
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- | {}--- |",
        if memory { "---: | ---: | " } else { "" }
    );
    for c in &report.comparisons {
        render_summary_row(c, memory, out);
    }
    for e in &report.errors {
        let _ = writeln!(
            out,
            "| {} | {} | {} | **ERROR** | - | - | - | - | - | {}{} |",
            cell(&e.model),
            cell(&e.config),
            cell(&e.reference),
            if memory { "- | - | " } else { "" },
            cell(&e.message)
        );
    }
    for k in &report.skipped {
        let _ = writeln!(
            out,
            "| {} | {} | {} | skip | - | - | - | - | - | {}{} |",
            cell(&k.model),
            cell(&k.config),
            cell(&k.reference),
            if memory { "- | - | " } else { "" },
            cell(&k.reason)
        );
    }
    if report.comparisons.iter().any(passed_with_large_distances) {
        let _ = writeln!(out, "\n{LARGE_DISTANCES_NOTE}");
    }
}

/// ULP counts from which a passing row's columns look alarming to a reader.
const ALARMING_ULP: u64 = 1000;

/// Why a passing arbiter row may show a large error or ULP count: the columns are maxima over
/// every tensor and step, and on a value whose true value is near zero they measure nothing.
pub const LARGE_DISTANCES_NOTE: &str = "Reading a passing row with large error or ULP columns: \
under the fp64 arbiter the margin is the verdict. The error and ULP columns are the largest \
over every tensor and step, and on a value whose true value is near zero (a bias gradient \
averaging to 0, a parameter AdamW moves by its full step whatever the gradient's size) a tiny \
absolute error is a huge relative error or ULP count, which says nothing about correctness. \
The arbiter instead compares each tensor's distance to the float64 shadow with the fp32 \
reference's own distance, which rounding alone gives (docs/parity.md, the fp64 arbiter).";

/// An arbiter row that passed while its error columns would alarm a reader.
pub(super) fn passed_with_large_distances(c: &Comparison) -> bool {
    c.passed && c.mode == crate::parity::Mode::Arbiter && c.overall().max_ulp >= ALARMING_ULP
}

/// One comparison's line of the summary table (`memory`: with the memory columns).
fn render_summary_row(c: &Comparison, memory: bool, out: &mut String) {
    let all = c.overall();
    let failure = c.diagnosis.as_deref().unwrap_or("");
    let memory_cells = if memory {
        format!(
            "{} | {} | ",
            fmt_kib(c.memory.map(|m| m.full_param_bytes_peak)),
            fmt_kib(c.memory.map(|m| m.shard_bytes))
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {memory_cells}{} |",
        cell(&c.model),
        cell(&c.config),
        cell(&c.reference),
        if c.passed { "pass" } else { "**FAIL**" },
        fmt_num(all.max_abs_err),
        fmt_num(all.max_rel_err),
        fmt_ulp(all.max_ulp),
        fmt_num(all.margin),
        cell(&super::arbiter_cell(c)),
        cell(failure)
    );
}

/// The errored runs' details, folded, when any run errored.
fn render_errors(report: &Report, out: &mut String) {
    if report.errors.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n## Errors\n");
    for e in &report.errors {
        let _ = writeln!(
            out,
            "<details><summary>{} / {} vs {}: {}</summary>\n<pre>{}</pre>\n</details>\n",
            xml_escape(&e.model),
            xml_escape(&e.config),
            xml_escape(&e.reference),
            xml_escape(&e.message),
            xml_escape(&e.details)
        );
    }
}

/// The tolerance overrides, each reason once (a matrix applies one override to many rows),
/// with the rows it governed.
fn render_overrides(report: &Report, out: &mut String) {
    let mut overrides: Vec<(&str, Vec<String>)> = Vec::new();
    for c in &report.comparisons {
        let Some(reason) = c.override_reason.as_deref() else {
            continue;
        };
        let row = format!("{} / {} vs {}", c.model, c.config, c.reference);
        match overrides.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, rows)) => rows.push(row),
            None => overrides.push((reason, vec![row])),
        }
    }
    if !overrides.is_empty() {
        let _ = writeln!(out, "\nTolerance overrides:\n");
        for (reason, rows) in overrides {
            let _ = writeln!(out, "- {} (for {})", cell(reason), cell(&rows.join(", ")));
        }
    }
}

/// One section per comparison (failing ones first; passing ones only in small reports): the
/// diagnosis, the cross-rank check and the per-parameter table.
fn render_sections(report: &Report, out: &mut String) {
    let all = report.comparisons.len() <= ALL_SECTIONS_UP_TO;
    let shown: Vec<&Comparison> = report
        .comparisons
        .iter()
        .filter(|c| !c.passed)
        .chain(report.comparisons.iter().filter(|c| all && c.passed))
        .collect();
    if shown.is_empty() {
        return;
    }
    let _ = writeln!(out, "\n## Per parameter\n");
    if !all {
        let passing = report.comparisons.iter().filter(|c| c.passed).count();
        let _ = writeln!(
            out,
            "Failing comparisons only; the {passing} passing ones are in report.html.\n"
        );
    }
    for c in shown {
        render_section(c, out);
    }
}

/// One comparison's section.
fn render_section(c: &Comparison, out: &mut String) {
    let _ = writeln!(
        out,
        "### {} / {} vs {}: {}\n",
        cell(&c.model),
        cell(&c.config),
        cell(&c.reference),
        if c.passed { "pass" } else { "**FAIL**" }
    );
    if let Some(d) = &c.diagnosis {
        let _ = writeln!(out, "{}\n", cell(d));
    }
    for line in [cross_rank_line(c), plan_line(c), collectives_line(c)]
        .into_iter()
        .flatten()
    {
        let _ = writeln!(out, "{}\n", cell(&line));
    }
    let rows = param_rows(c);
    if rows.is_empty() {
        return;
    }
    let headers = param_headers(c).map(|h| cell(&h));
    let _ = writeln!(out, "| parameter | {} |", headers.join(" | "));
    let _ = writeln!(out, "| --- | --- | ---: | ---: | --- | ---: | ---: |");
    for r in rows.iter().take(MAX_PARAM_ROWS) {
        let cells = r.cells().map(|c| cell(&c));
        let _ = writeln!(out, "| `{}` | {} |", cell(r.name), cells.join(" | "));
    }
    if let Some(line) = more_rows_line(&rows) {
        let _ = writeln!(out, "\n{line}");
    }
    let _ = writeln!(out);
}
