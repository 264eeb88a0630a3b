//! The HTML page: one self-contained file (inline CSS and SVG, no scripts, no external
//! resources) so it opens offline, as a CI artifact or an e-mail attachment.

use super::junit::xml_escape;
use super::tensors::{
    collectives_line, cross_rank_line, more_rows_line, param_headers, param_rows, plan_line,
    MAX_PARAM_ROWS,
};
use super::{fmt_kib, fmt_num, fmt_ulp, Report, StepRow};
use crate::parity::{Comparison, StepEnvelope};
use std::fmt::Write as _;

const WIDTH: f64 = 600.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 30.0;
const BOTTOM: f64 = 40.0;

/// One line of a plot.
struct Series {
    label: String,
    color: &'static str,
    dashed: bool,
    points: Vec<(f64, f64)>,
}

/// Maps data to pixels; on a log axis values are log10'd (zeros are drawn at `floor`).
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    floor: f64,
}

impl Axis {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Self {
        let finite: Vec<f64> = values.filter(|v| v.is_finite()).collect();
        let floor = if log {
            let min_pos = finite
                .iter()
                .copied()
                .filter(|&v| v > 0.0)
                .fold(f64::INFINITY, f64::min);
            if min_pos.is_finite() {
                min_pos / 10.0
            } else {
                1e-17
            }
        } else {
            0.0
        };
        let t = |v: f64| if log { v.max(floor).log10() } else { v };
        let (mut lo, mut hi) = finite
            .iter()
            .map(|&v| t(v))
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
                (lo.min(v), hi.max(v))
            });
        if !lo.is_finite() {
            (lo, hi) = (0.0, 1.0);
        }
        if log {
            lo = lo.floor();
            hi = hi.ceil();
        }
        if hi - lo < 1e-300 || hi - lo < lo.abs() * 1e-12 {
            let pad = if lo == 0.0 { 1.0 } else { lo.abs() * 0.05 };
            lo -= pad;
            hi += pad;
        }
        Axis { lo, hi, log, floor }
    }

    fn transform(&self, v: f64) -> f64 {
        if self.log {
            v.max(self.floor).log10()
        } else {
            v
        }
    }

    /// 0 at `lo`, 1 at `hi`.
    fn unit(&self, v: f64) -> f64 {
        (self.transform(v) - self.lo) / (self.hi - self.lo)
    }

    fn ticks(&self) -> Vec<(f64, String)> {
        if self.log {
            let (lo, hi) = (self.lo.floor() as i32, self.hi.ceil() as i32);
            let stride = ((hi - lo) / 6).max(1);
            (lo..=hi)
                .step_by(stride as usize)
                .map(|e| ((e as f64 - self.lo) / (self.hi - self.lo), format!("1e{e}")))
                .collect()
        } else {
            (0..=4)
                .map(|i| {
                    let f = i as f64 / 4.0;
                    (f, format!("{:.4}", self.lo + f * (self.hi - self.lo)))
                })
                .collect()
        }
    }
}

/// A line plot of `series` over the steps, as one inline SVG element (`log`: a log y axis).
fn svg_plot(title: &str, y_label: &str, series: &[Series], log: bool) -> String {
    let frame = Frame::new(series, log);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg class=\"plot\" role=\"img\" viewBox=\"0 0 {WIDTH} {HEIGHT}\" width=\"{WIDTH}\" height=\"{HEIGHT}\">"
    );
    plot_title(&mut out, title);
    frame.draw_axes(&mut out, y_label);
    for (i, s) in series.iter().enumerate() {
        frame.draw_series(&mut out, i, s);
    }
    if log {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" class=\"n\">zero drawn at {}</text>",
            LEFT + frame.plot_w + 10.0,
            TOP + frame.plot_h,
            fmt_num(frame.y.floor)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// A plot's title: as a tooltip, and drawn over the plot.
fn plot_title(out: &mut String, title: &str) {
    let _ = writeln!(out, "<title>{}</title>", xml_escape(title));
    // Left-aligned from the edge, and squeezed to the width when long: a centred long title
    // (a matrix row's name) ran off the left edge.
    let room = WIDTH - 16.0;
    let squeeze = if title.chars().count() as f64 * 7.0 > room {
        format!(" textLength=\"{room}\" lengthAdjust=\"spacingAndGlyphs\"")
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "<text x=\"8\" y=\"18\" text-anchor=\"start\" class=\"t\"{squeeze}>{}</text>",
        xml_escape(title)
    );
}

/// Where a plot's data lands: the plotting area and both axes' ranges, shared by everything
/// drawn in it.
struct Frame {
    plot_w: f64,
    plot_h: f64,
    /// The last step drawn (at least 1).
    x_max: f64,
    y: Axis,
}

impl Frame {
    /// The frame that holds every point of `series`.
    fn new(series: &[Series], log: bool) -> Self {
        let x_max = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0))
            .fold(0.0f64, f64::max)
            .max(1.0);
        let y = Axis::new(
            series.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
            log,
        );
        Frame {
            plot_w: WIDTH - LEFT - RIGHT,
            plot_h: HEIGHT - TOP - BOTTOM,
            x_max,
            y,
        }
    }

    /// The pixel column of step `x`.
    fn px(&self, x: f64) -> f64 {
        LEFT + x / self.x_max * self.plot_w
    }

    /// The pixel row of value `v`.
    fn py(&self, v: f64) -> f64 {
        TOP + (1.0 - self.y.unit(v)) * self.plot_h
    }

    /// The plotting area's border, grid lines, ticks and axis labels.
    fn draw_axes(&self, out: &mut String, y_label: &str) {
        let (plot_w, plot_h) = (self.plot_w, self.plot_h);
        let _ = writeln!(
            out,
            "<rect x=\"{LEFT}\" y=\"{TOP}\" width=\"{plot_w}\" height=\"{plot_h}\" fill=\"none\" stroke=\"#999\"/>"
        );
        for (f, label) in self.y.ticks() {
            let yy = TOP + (1.0 - f) * plot_h;
            let _ = writeln!(
                out,
                "<line x1=\"{LEFT}\" x2=\"{}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
                LEFT + plot_w,
                LEFT - 4.0,
                yy + 4.0,
                xml_escape(&label)
            );
        }
        let x_ticks = (self.x_max as usize).clamp(1, 10);
        for i in 0..=x_ticks {
            let x = self.x_max * i as f64 / x_ticks as f64;
            let _ = writeln!(
                out,
                "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
                self.px(x),
                TOP + plot_h + 14.0,
                x.round()
            );
        }
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>",
            LEFT + plot_w / 2.0,
            HEIGHT - 6.0
        );
        let _ = writeln!(
            out,
            "<text transform=\"translate(14 {}) rotate(-90)\" text-anchor=\"middle\">{}</text>",
            TOP + plot_h / 2.0,
            xml_escape(y_label)
        );
    }

    /// Series `s` (the `i`-th): its line, its non-finite values marked on the top edge, and
    /// its legend entry.
    fn draw_series(&self, out: &mut String, i: usize, s: &Series) {
        let dash = if s.dashed {
            " stroke-dasharray=\"5 3\""
        } else {
            ""
        };
        for seg in self.segments(out, s).iter().filter(|seg| !seg.is_empty()) {
            let pts: Vec<String> = seg.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let _ = writeln!(
                out,
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.8\"{dash} points=\"{}\"/>",
                s.color,
                pts.join(" ")
            );
            if seg.len() == 1 {
                let (x, y) = seg[0];
                let _ = writeln!(
                    out,
                    "<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2.5\" fill=\"{}\"/>",
                    s.color
                );
            }
        }
        let ly = TOP + 12.0 + i as f64 * 16.0;
        let lx = LEFT + self.plot_w + 10.0;
        let _ = writeln!(
            out,
            "<line x1=\"{lx}\" x2=\"{}\" y1=\"{ly}\" y2=\"{ly}\" stroke=\"{}\" stroke-width=\"2\"{dash}/><text x=\"{}\" y=\"{}\">{}</text>",
            lx + 18.0,
            s.color,
            lx + 22.0,
            ly + 4.0,
            xml_escape(&s.label)
        );
    }

    /// The pixel runs of `s` between its non-finite values (a line is broken there instead of
    /// drawn through them), writing to `out` the marks of those values on the top edge, so a
    /// diverged run is visible.
    fn segments(&self, out: &mut String, s: &Series) -> Vec<Vec<(f64, f64)>> {
        let mut segments: Vec<Vec<(f64, f64)>> = vec![Vec::new()];
        for &(x, v) in &s.points {
            if v.is_finite() {
                if let Some(seg) = segments.last_mut() {
                    seg.push((self.px(x), self.py(v)));
                }
            } else {
                let _ = writeln!(
                    out,
                    "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\" fill=\"{}\">{}</text>",
                    self.px(x),
                    TOP - 2.0,
                    s.color,
                    if v.is_nan() { "NaN" } else { "inf" }
                );
                if segments.last().is_some_and(|seg| !seg.is_empty()) {
                    segments.push(Vec::new());
                }
            }
        }
        segments
    }
}

fn loss_plot(title: &str, steps: &[&StepRow]) -> String {
    let series = vec![
        Series {
            label: "run".into(),
            color: "#1f77b4",
            dashed: false,
            points: steps
                .iter()
                .filter_map(|s| s.step.loss.as_ref().map(|l| (s.step.step as f64, l.run)))
                .collect(),
        },
        Series {
            label: "reference".into(),
            color: "#ff7f0e",
            dashed: true,
            points: steps
                .iter()
                .filter_map(|s| {
                    s.step
                        .loss
                        .as_ref()
                        .map(|l| (s.step.step as f64, l.reference))
                })
                .collect(),
        },
    ];
    svg_plot(title, "loss", &series, false)
}

fn error_plot(title: &str, steps: &[&StepRow]) -> String {
    let mut series = vec![
        Series {
            label: "loss |Δ|".into(),
            color: "#1f77b4",
            dashed: false,
            points: steps
                .iter()
                .filter_map(|s| {
                    s.step
                        .loss
                        .as_ref()
                        .map(|d| (s.step.step as f64, d.abs_err))
                })
                .collect(),
        },
        Series {
            label: "grad norm |Δ|".into(),
            color: "#2ca02c",
            dashed: false,
            points: steps
                .iter()
                .filter_map(|s| {
                    s.step
                        .grad_norm
                        .as_ref()
                        .map(|d| (s.step.step as f64, d.abs_err))
                })
                .collect(),
        },
    ];
    let grads: Vec<(f64, f64)> = steps
        .iter()
        .filter_map(|s| {
            s.step
                .grads
                .as_ref()
                .map(|g| (s.step.step as f64, g.max_abs_err))
        })
        .collect();
    if !grads.is_empty() {
        series.push(Series {
            label: "grads max |Δ|".into(),
            color: "#d62728",
            dashed: true,
            points: grads,
        });
    }
    svg_plot(title, "abs error (log)", &series, true)
}

/// The fp64 arbiter's view of a comparison: per step, the run's and the fp32 reference's
/// largest distance to the float64 shadow (relative to each tensor's magnitude), on a log
/// scale: a correct run's line follows the reference's, a fault stands above it.
fn envelope_plot(title: &str, steps: &[&StepRow]) -> String {
    let series_of =
        |label: &str, color: &'static str, dashed, pick: fn(&StepEnvelope) -> f64| Series {
            label: label.into(),
            color,
            dashed,
            points: steps
                .iter()
                .filter_map(|s| {
                    s.step
                        .envelope
                        .as_ref()
                        .map(|e| (s.step.step as f64, pick(e)))
                })
                .collect(),
        };
    let series = vec![
        series_of("run to fp64", "#d62728", false, |e| e.run_to_f64),
        series_of("fp32 ref to fp64", "#1f77b4", true, |e| e.reference_to_f64),
    ];
    svg_plot(title, "rel. distance (log)", &series, true)
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:2em;color:#222}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}\
td.num{text-align:right;font-family:monospace}.pass{color:#176317}.fail{color:#b00020;font-weight:bold}\
section{margin:2em 0;border-top:1px solid #ddd}svg.plot{margin-right:1em}svg text{font-size:11px}\
svg text.t{font-size:13px;font-weight:bold}svg text.n{font-size:9px;fill:#777}.diag{font-family:monospace;white-space:pre-wrap}\
table.params{margin:1em 0}tr.fail td{color:#b00020}";

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

/// The page: a summary table, then per comparison its verdict, loss curves and errors per
/// step on a log scale.
pub fn render_html(report: &Report) -> String {
    let mut out =
        String::from("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n");
    let _ = writeln!(
        out,
        "<title>Lockstep parity report</title>\n<style>{STYLE}</style>\n</head>\n<body>"
    );
    render_headline(report, &mut out);
    render_summary_table(report, &mut out);
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
    for e in &report.errors {
        let name = format!("{} / {} vs {}", e.model, e.config, e.reference);
        let _ = writeln!(
            out,
            "<section>\n<h2>{}</h2>\n<p class=\"fail\">ERROR: {}</p>\n<pre class=\"diag\">{}</pre>\n</section>",
            xml_escape(&name),
            xml_escape(&e.message),
            xml_escape(&e.details)
        );
    }
    for c in &report.comparisons {
        render_section(report, c, &mut out);
    }
    out.push_str("</body>\n</html>\n");
    out
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

/// The summary table: one row per comparison, then per run that errored or was skipped
/// (with memory columns when runs measured memory).
fn render_summary_table(report: &Report, out: &mut String) {
    let memory = report.has_memory();
    out.push_str("<table>\n<tr><th>model</th><th>config</th><th>reference</th><th>result</th><th>max abs err</th><th>max rel err</th><th>max ULP</th><th>margin</th>");
    if memory {
        out.push_str("<th>peak full params (KiB)</th><th>shard (KiB)</th>");
    }
    out.push_str("</tr>\n");
    for c in &report.comparisons {
        render_summary_row(c, memory, out);
    }
    for e in &report.errors {
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"fail\">ERROR</td><td colspan=\"{}\">{}</td></tr>",
            xml_escape(&e.model),
            xml_escape(&e.config),
            xml_escape(&e.reference),
            if memory { 6 } else { 4 },
            xml_escape(&e.message)
        );
    }
    for k in &report.skipped {
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>skip</td><td colspan=\"{}\">{}</td></tr>",
            xml_escape(&k.model),
            xml_escape(&k.config),
            xml_escape(&k.reference),
            if memory { 6 } else { 4 },
            xml_escape(&k.reason)
        );
    }
    out.push_str("</table>\n");
}

/// One comparison's row of the summary table (`memory`: with the memory columns).
fn render_summary_row(c: &Comparison, memory: bool, out: &mut String) {
    let all = c.overall();
    let _ = write!(
        out,
        "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"{}\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>",
        xml_escape(&c.model),
        xml_escape(&c.config),
        xml_escape(&c.reference),
        if c.passed { "pass" } else { "fail" },
        if c.passed { "pass" } else { "FAIL" },
        fmt_num(all.max_abs_err),
        fmt_num(all.max_rel_err),
        fmt_ulp(all.max_ulp),
        fmt_num(all.margin)
    );
    if memory {
        let _ = write!(
            out,
            "<td class=\"num\">{}</td><td class=\"num\">{}</td>",
            fmt_kib(c.memory.map(|m| m.full_param_bytes_peak)),
            fmt_kib(c.memory.map(|m| m.shard_bytes))
        );
    }
    out.push_str("</tr>\n");
}

/// One comparison's section: its verdict and diagnosis, the cross-rank check, the plan, the
/// per-parameter table, and its plots.
fn render_section(report: &Report, c: &Comparison, out: &mut String) {
    let name = format!("{} / {} vs {}", c.model, c.config, c.reference);
    let _ = writeln!(out, "<section>\n<h2>{}</h2>", xml_escape(&name));
    let _ = writeln!(
        out,
        "<p class=\"{}\">{}</p>",
        if c.passed { "pass" } else { "fail" },
        if c.passed { "passed" } else { "FAILED" }
    );
    if let Some(d) = &c.diagnosis {
        let _ = writeln!(out, "<p class=\"diag\">{}</p>", xml_escape(d));
    }
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
        let _ = writeln!(out, "<p class=\"plan\">{}</p>", xml_escape(&line));
    }
    out.push_str(&param_table(c));
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
    out.push_str(&loss_plot(&format!("loss: {name}"), &steps));
    if c.arbiter.is_some() {
        out.push_str(&envelope_plot(
            &format!("distance to fp64 per step: {name}"),
            &steps,
        ));
    } else {
        out.push_str(&error_plot(&format!("error per step: {name}"), &steps));
    }
    out.push_str("</section>\n");
}
