//! The Markdown summary: one table a person reads in a pull request or a CI log.

use super::{fmt_kib, fmt_num, fmt_ulp, xml_escape, Report};
use std::fmt::Write as _;

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The summary table (with memory columns when runs measured memory), with the overrides
/// and their reasons listed under it.
pub fn render_markdown(report: &Report) -> String {
    let mut out = String::new();
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
    if !report.errors.is_empty() {
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
    // Each reason once (a matrix applies one override to many rows), with the rows it
    // governed.
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
    out
}
