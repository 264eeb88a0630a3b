//! The HTML page: one self-contained file (inline CSS, SVG and one small script, nothing
//! fetched) so it opens offline, as a CI artifact or an e-mail attachment.
//!
//! The first screen is the overview ([`overview`]): per world size, a grid of models by
//! configurations coloured by verdict, with what needs a reader (regressions, failures,
//! errors) listed above it. Every cell links to its detail: each comparison's verdict,
//! first failing tensor, plan placements, collectives and per-step charts. Charts are drawn
//! into the page ([`plot`]) only for the rows a reader needs first (failed, regressed and
//! the closest to their envelope); every other row carries its chart data, which the
//! script draws when the row is opened. So the default matrix's page stays small and opens
//! at once, and any row's charts are one click away.

mod overview;
mod plot;

use super::junit::xml_escape;
use super::tensors::{
    collectives_line, cross_rank_line, more_rows_line, param_headers, param_rows, plan_line,
    MAX_PARAM_ROWS,
};
use super::{fmt_kib, fmt_num, Report, StepRow};
use crate::parity::Comparison;
use overview::{Cell, Overview};
use std::collections::HashSet;
use std::fmt::Write as _;

/// Reports with at most this many cells open every detail.
const OPEN_ALL_CELLS: usize = 6;

/// How many of the passing rows closest to their envelope get their charts drawn and are
/// listed under the overview.
const CLOSEST_ROWS: usize = 10;

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:1em 1.5em;color:#222}\
h1{font-size:22px;margin:.2em 0}p{margin:.4em 0}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}\
td.num{text-align:right;font-family:monospace}.pass{color:#176317}.fail{color:#b00020;font-weight:bold}\
h2{font-size:15px;margin:.8em 0 .2em}svg.plot{margin-right:1em}svg text{font-size:11px}\
svg text.t{font-size:13px;font-weight:bold}svg text.n{font-size:9px;fill:#777}.diag{font-family:monospace;white-space:pre-wrap}\
table.params{margin:1em 0}tr.fail td{color:#b00020}\
table.grid td,table.grid th{padding:0;border:1px solid #fff}table.grid td{width:11px;height:11px}\
table.grid td a{display:block;width:11px;height:11px}table.grid th.m{text-align:right;padding-right:6px;font-weight:normal;font-size:12px}\
table.grid th.v{vertical-align:bottom;font-weight:normal;font-size:9px}\
table.grid th.v span{writing-mode:vertical-rl;transform:rotate(180deg);white-space:nowrap;\
display:inline-block;max-height:130px;overflow:hidden;text-overflow:ellipsis}\
.s-pass{background:#2e7d32}.s-close{background:#f9a825}.s-fail{background:#c62828}\
.s-error{background:#6a1b9a}.s-skip{background:#bdbdbd}.na{background:#f3f3f3}\
.key{display:inline-block;width:11px;height:11px;margin-left:10px;vertical-align:middle}\
.legend{font-size:12px}details.cell{border-top:1px solid #ddd;padding:.3em 0}\
details.cell summary{cursor:pointer}details.cell:target{background:#fffde7}\
div.row{margin:.6em 0 1em 1.2em}h3{font-size:14px;margin:.6em 0 .2em}";

/// The page's script: opens the detail a link or the address names and draws the charts of
/// every row opened (the chart data in `data-chart`), as the SVG [`plot`] draws, with the
/// geometry and chart kinds [`plot::script_constants`] puts before it.
const SCRIPT: &str = include_str!("script.js");

/// The page: the headline, what needs a reader, the overview grids, the closest rows, then
/// each cell's detail (every row of the report is in one; report.md lists them as a table).
pub fn render_html(report: &Report) -> String {
    let mut out =
        String::from("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n");
    let _ = writeln!(
        out,
        "<title>Lockstep parity report</title>\n<style>{STYLE}</style>\n</head>\n<body>"
    );
    render_headline(report, &mut out);
    let overview = Overview::of(report);
    let closest = closest(report);
    let drawn = drawn_rows(report, &closest);
    render_attention(report, &overview, &mut out);
    overview.render(&mut out);
    render_closest(report, &overview, &closest, &mut out);
    if report
        .comparisons
        .iter()
        .any(super::markdown::passed_with_large_distances)
    {
        let _ = writeln!(
            out,
            "<p class=\"note\">{}</p>",
            xml_escape(super::markdown::LARGE_DISTANCES_NOTE)
        );
    }
    out.push_str("<section id=\"details\">\n<h2>Details</h2>\n");
    // A small report (a parity test's, a judged job's) shows every detail at once.
    let open_all = overview.cells.len() <= OPEN_ALL_CELLS;
    for cell in &overview.cells {
        render_cell_detail(report, cell, (&drawn, open_all), &mut out);
    }
    out.push_str("</section>\n");
    let _ = writeln!(
        out,
        "<script>//<![CDATA[\n{}{SCRIPT}//]]></script>",
        plot::script_constants()
    );
    out.push_str("</body>\n</html>\n");
    out
}

/// The comparisons whose charts are drawn into the page: failed, regressed, and the
/// `closest` passing ones.
fn drawn_rows(report: &Report, closest: &[usize]) -> HashSet<usize> {
    let regressed = |c: &Comparison| {
        report
            .regressions
            .iter()
            .any(|r| r.model == c.model && r.config == c.config && r.reference == c.reference)
    };
    let mut drawn: HashSet<usize> = report
        .comparisons
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.passed || regressed(c))
        .map(|(i, _)| i)
        .collect();
    drawn.extend(closest);
    drawn
}

/// The passing comparisons closest to their envelope (largest finite margin above 0),
/// closest first.
fn closest(report: &Report) -> Vec<usize> {
    let mut passing: Vec<(usize, f64)> = report
        .comparisons
        .iter()
        .enumerate()
        .filter(|(_, c)| c.passed)
        .map(|(i, c)| (i, c.overall().margin))
        .filter(|(_, m)| m.is_finite() && *m > 0.0)
        .collect();
    passing.sort_by(|a, b| b.1.total_cmp(&a.1));
    passing
        .into_iter()
        .take(CLOSEST_ROWS)
        .map(|(i, _)| i)
        .collect()
}

/// The page's heading, the environment and the headline with the tool that wrote it.
fn render_headline(report: &Report, out: &mut String) {
    let _ = writeln!(out, "<h1>Lockstep parity report</h1>");
    if let Some(line) = report.environment_line() {
        let _ = writeln!(out, "<p class=\"environment\">{}</p>", xml_escape(&line));
    }
    let _ = write!(
        out,
        "<p class=\"{}\">{}",
        if report.errors.is_empty() {
            "summary"
        } else {
            "fail"
        },
        xml_escape(&report.headline())
    );
    if let Some(t) = report.wall_time_seconds {
        let _ = write!(out, "; wall time {t:.2} s");
    }
    let _ = writeln!(
        out,
        " ({}, schema {}).</p>",
        xml_escape(&report.tool),
        report.schema_version
    );
}

/// A link to the detail of `model` × `config`, or the plain text when it has none.
fn cell_link(overview: &Overview, model: &str, config: &str, text: &str) -> String {
    match overview.cell_of(model, config) {
        Some(cell) => format!("<a href=\"#{}\">{}</a>", cell.id, xml_escape(text)),
        None => xml_escape(text),
    }
}

/// What a reader must see before the grid: regressions against the baseline, failed
/// comparisons and errored runs, each linked to its detail.
fn render_attention(report: &Report, overview: &Overview, out: &mut String) {
    let failed: Vec<&Comparison> = report.comparisons.iter().filter(|c| !c.passed).collect();
    if report.regressions.is_empty() && failed.is_empty() && report.errors.is_empty() {
        return;
    }
    out.push_str("<section id=\"attention\">\n<h2>Needs attention</h2>\n<ul>\n");
    for r in &report.regressions {
        let name = format!("{} {} vs {}", r.model, r.config, r.reference);
        let _ = writeln!(
            out,
            "<li class=\"fail\">regressed ({}): {}: {}</li>",
            xml_escape(&r.status),
            cell_link(overview, &r.model, &r.config, &name),
            xml_escape(&r.what)
        );
    }
    for c in failed {
        let name = format!("{} {} vs {}", c.model, c.config, c.reference);
        let _ = writeln!(
            out,
            "<li class=\"fail\">FAIL {}: {}</li>",
            cell_link(overview, &c.model, &c.config, &name),
            xml_escape(c.diagnosis.as_deref().unwrap_or("(no diagnosis)"))
        );
    }
    for e in &report.errors {
        let name = format!("{} {} vs {}", e.model, e.config, e.reference);
        let _ = writeln!(
            out,
            "<li class=\"fail\">ERROR {}: {}</li>",
            cell_link(overview, &e.model, &e.config, &name),
            xml_escape(&e.message)
        );
    }
    out.push_str("</ul>\n</section>\n");
}

/// The passing comparisons closest to their envelope (`closest`), with links to their
/// details.
fn render_closest(report: &Report, overview: &Overview, closest: &[usize], out: &mut String) {
    if closest.is_empty() {
        return;
    }
    out.push_str(
        "<section id=\"closest\">\n<h2>Closest to their envelope</h2>\n<table>\n\
         <tr><th>comparison</th><th>margin</th><th>mode</th></tr>\n",
    );
    for &i in closest {
        let c = &report.comparisons[i];
        let name = format!("{} {} vs {}", c.model, c.config, c.reference);
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
            cell_link(overview, &c.model, &c.config, &name),
            fmt_num(c.overall().margin),
            match c.mode {
                crate::parity::Mode::Bitwise => "bitwise",
                crate::parity::Mode::Tolerance => "tolerance",
                crate::parity::Mode::Arbiter => "fp64 arbiter",
            }
        );
    }
    out.push_str("</table>\n</section>\n");
}

/// One cell's detail: collapsed unless it needs a reader or `open_all`, opened by its grid
/// link; the comparisons in `drawn` get their charts drawn into the page.
fn render_cell_detail(
    report: &Report,
    cell: &Cell,
    (drawn, open_all): (&HashSet<usize>, bool),
    out: &mut String,
) {
    let open = if open_all || cell.state >= overview::CellState::Fail {
        " open=\"open\""
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "<details class=\"cell\" id=\"{}\"{open}><summary>{} {}: <span class=\"{}\">{}</span></summary>",
        cell.id,
        xml_escape(&cell.model),
        xml_escape(&cell.config),
        if cell.state >= overview::CellState::Fail {
            "fail"
        } else {
            "pass"
        },
        cell.state.name()
    );
    let draw_any = cell.comparisons.iter().any(|i| drawn.contains(i));
    if let Some(&first) = cell.comparisons.first() {
        render_run(&report.comparisons[first], draw_any, out);
    }
    for &i in &cell.comparisons {
        render_comparison(report, &report.comparisons[i], drawn.contains(&i), out);
    }
    for &i in &cell.errors {
        let e = &report.errors[i];
        let _ = writeln!(
            out,
            "<div class=\"row\"><h3>vs {}</h3>\n<p><span class=\"fail\">ERROR</span>: {}</p>\n<pre class=\"diag\">{}</pre></div>",
            xml_escape(&e.reference),
            xml_escape(&e.message),
            xml_escape(&e.details)
        );
    }
    for &i in &cell.skipped {
        let s = &report.skipped[i];
        let _ = writeln!(
            out,
            "<div class=\"row\"><h3>vs {}</h3>\n<p><span class=\"skip\">skip</span>: {}</p></div>",
            xml_escape(&s.reference),
            xml_escape(&s.reason)
        );
    }
    out.push_str("</details>\n");
}

/// What a cell's run did, said once above its comparisons (every reference judges the same
/// run): the cross-rank check, the plan's placements, the collectives per step (whole when
/// `whole`, else cut short) and rank 0's memory.
fn render_run(c: &Comparison, whole: bool, out: &mut String) {
    if let Some(line) = cross_rank_line(c) {
        let class = if c.cross_rank.as_ref().is_some_and(|x| x.mismatch.is_some()) {
            "fail"
        } else {
            "pass"
        };
        let _ = writeln!(
            out,
            "<p class=\"cross-rank {class}\">{}</p>",
            xml_escape(&line)
        );
    }
    for line in [plan_line(c), collectives_line(c)].into_iter().flatten() {
        let line = match whole {
            true => line,
            false => shortened(line),
        };
        let _ = writeln!(out, "<p class=\"plan\">{}</p>", xml_escape(&line));
    }
    if let Some(m) = c.memory {
        let _ = writeln!(
            out,
            "<p class=\"memory\">memory (rank 0): peak full params {} KiB, shard {} KiB</p>",
            fmt_kib(Some(m.full_param_bytes_peak)),
            fmt_kib(Some(m.shard_bytes))
        );
    }
}

/// One comparison in its cell's detail: its verdict and diagnosis, the per-parameter table
/// and the charts (drawn when `draw`, else left to the script).
fn render_comparison(report: &Report, c: &Comparison, draw: bool, out: &mut String) {
    let name = format!("{} / {} vs {}", c.model, c.config, c.reference);
    let _ = writeln!(
        out,
        "<div class=\"row\" data-name=\"{}\">\n<h3>vs {}</h3>\n<p class=\"{}\">{}</p>",
        xml_escape(&name),
        xml_escape(&c.reference),
        if c.passed { "pass" } else { "fail" },
        if c.passed { "passed" } else { "FAILED" }
    );
    if let Some(d) = &c.diagnosis {
        let _ = writeln!(out, "<p class=\"diag\">{}</p>", xml_escape(d));
    }
    if draw {
        out.push_str(&param_table(c));
    }
    if c.arbiter.is_some() {
        let _ = writeln!(
            out,
            "<p>fp64 arbiter: run / fp32 reference distance to float64 {}</p>",
            xml_escape(&super::arbiter_cell(c))
        );
    }
    if let Some(r) = &c.override_reason {
        let _ = writeln!(out, "<p>Tolerance override: {}</p>", xml_escape(r));
    }
    let steps: Vec<&StepRow> = report.steps_of(c).collect();
    for chart in plot::charts(&name, c.arbiter.is_some(), &steps) {
        match draw {
            true => out.push_str(&chart.svg()),
            false => {
                let _ = writeln!(
                    out,
                    "<div class=\"chart\" data-chart='{}'></div>",
                    single_quoted(&chart.data())
                );
            }
        }
    }
    out.push_str("</div>\n");
}

/// The longest a plan or collectives line is on a row whose detail is not drawn in full.
const SHORT_LINE: usize = 120;

/// `line` cut to [`SHORT_LINE`] characters, saying where the whole line is: a plan that
/// lists every tensor's placement is most of a large page, and the rows a reader needs
/// first keep theirs whole.
fn shortened(line: String) -> String {
    match line.char_indices().nth(SHORT_LINE) {
        Some((at, _)) => format!("{}… (whole line in report.md)", &line[..at]),
        None => line,
    }
}

/// `s` escaped for an attribute in single quotes: JSON's double quotes stay as they are.
fn single_quoted(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('\'', "&#39;")
}

/// The per-parameter table of one comparison (failing parameters first, capped at
/// [`MAX_PARAM_ROWS`] rows); empty when it compared no tensor.
fn param_table(c: &Comparison) -> String {
    let rows = param_rows(c);
    if rows.is_empty() {
        return String::new();
    }
    let mut out = String::from("<table class=\"params\">\n<tr><th>parameter</th>");
    for h in param_headers(c) {
        let _ = write!(out, "<th>{}</th>", xml_escape(&h));
    }
    out.push_str("</tr>\n");
    for r in rows.iter().take(MAX_PARAM_ROWS) {
        let class = if r.failed() { "fail" } else { "pass" };
        let _ = write!(out, "<tr class=\"{class}\"><td>{}</td>", xml_escape(r.name));
        for (i, text) in r.cells().iter().enumerate() {
            let num = if i % 3 == 0 { "" } else { " class=\"num\"" };
            let _ = write!(out, "<td{num}>{}</td>", xml_escape(text));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</table>\n");
    if let Some(line) = more_rows_line(&rows) {
        let _ = writeln!(out, "<p>{}</p>", xml_escape(&line));
    }
    out
}
