//! The page's charts: per-step line plots as inline SVG, drawn here for the rows a reader
//! needs first, or handed to the page's script as data (the same series) to draw when a
//! reader opens any other row.

use super::super::junit::xml_escape;
use super::super::{fmt_num, StepRow};
use crate::parity::StepComparison;
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

/// One kind of chart: its title (before the row's name), its y axis, whether that axis is
/// logarithmic, and its series (label, colour, dashed) in the order the points come. The
/// page's script reads the same table ([`script_constants`]), so the data a row carries is
/// its points only.
struct Kind {
    key: &'static str,
    title: &'static str,
    y_label: &'static str,
    log: bool,
    series: &'static [(&'static str, &'static str, bool)],
}

/// The loss curves of the run and its reference.
const LOSS: Kind = Kind {
    key: "loss",
    title: "loss",
    y_label: "loss",
    log: false,
    series: &[("run", "#1f77b4", false), ("reference", "#ff7f0e", true)],
};

/// The errors per step (the gradients' only where the run recorded them).
const ERRORS: Kind = Kind {
    key: "err",
    title: "error per step",
    y_label: "abs error (log)",
    log: true,
    series: &[
        ("loss |Δ|", "#1f77b4", false),
        ("grad norm |Δ|", "#2ca02c", false),
        ("grads max |Δ|", "#d62728", true),
    ],
};

/// The fp64 arbiter's view: per step, the run's and the fp32 reference's largest distance
/// to the float64 shadow (relative to each tensor's magnitude); a correct run's line
/// follows the reference's, a fault stands above it.
const ENVELOPE: Kind = Kind {
    key: "env",
    title: "distance to fp64 per step",
    y_label: "rel. distance (log)",
    log: true,
    series: &[
        ("run to fp64", "#d62728", false),
        ("fp32 ref to fp64", "#1f77b4", true),
    ],
};

/// The JavaScript constants the page's script draws with: the plot's geometry and every
/// [`Kind`], from the same definitions the SVG drawn here uses.
pub(super) fn script_constants() -> String {
    let kinds: Vec<String> = [&LOSS, &ERRORS, &ENVELOPE]
        .iter()
        .map(|k| {
            let series: Vec<String> = k
                .series
                .iter()
                .map(|(label, color, dashed)| {
                    format!("[{},\"{color}\",{dashed}]", serde_json::Value::from(*label))
                })
                .collect();
            format!(
                "\"{}\":[\"{}\",\"{}\",{},[{}]]",
                k.key,
                k.title,
                k.y_label,
                k.log,
                series.join(",")
            )
        })
        .collect();
    format!(
        "var GEOMETRY = [{WIDTH}, {HEIGHT}, {LEFT}, {RIGHT}, {TOP}, {BOTTOM}];\n\
         var KINDS = {{{}}};\n",
        kinds.join(",")
    )
}

/// One chart of one row: its kind and each series' points.
pub(super) struct Chart {
    kind: &'static Kind,
    /// The row it belongs to, for the title.
    name: String,
    points: Vec<Vec<(f64, f64)>>,
}

impl Chart {
    /// The chart as one inline SVG element.
    pub(super) fn svg(&self) -> String {
        let series: Vec<Series> = self
            .kind
            .series
            .iter()
            .zip(&self.points)
            .map(|(&(label, color, dashed), points)| Series {
                label: label.to_owned(),
                color,
                dashed,
                points: points.clone(),
            })
            .collect();
        let title = format!("{}: {}", self.kind.title, self.name);
        svg_plot(&title, self.kind.y_label, &series, self.kind.log)
    }

    /// The chart as compact JSON for the page's script: its kind and each series' points
    /// (values to four significant digits; non-finite ones `null`, drawn as gaps).
    pub(super) fn data(&self) -> String {
        let series: Vec<String> = self
            .points
            .iter()
            .map(|points| {
                let points: Vec<String> = points
                    .iter()
                    .map(|&(x, y)| match y.is_finite() {
                        true => format!("[{x},{}]", short(y)),
                        false => format!("[{x},null]"),
                    })
                    .collect();
                format!("[{}]", points.join(","))
            })
            .collect();
        format!(
            "{{\"k\":\"{}\",\"p\":[{}]}}",
            self.kind.key,
            series.join(",")
        )
    }
}

/// `x` to four significant digits, as a short JSON number (`1.2e-7`, `0`).
fn short(x: f64) -> String {
    if x == 0.0 {
        return "0".into();
    }
    let text = format!("{x:.3e}");
    match text.split_once('e') {
        Some((mantissa, exponent)) => {
            let mantissa = mantissa.trim_end_matches('0').trim_end_matches('.');
            match exponent {
                "0" => mantissa.to_owned(),
                _ => format!("{mantissa}e{exponent}"),
            }
        }
        None => text,
    }
}

/// The `(step, value)` points of `steps` where `pick` finds a value.
fn points(steps: &[&StepRow], pick: impl Fn(&StepComparison) -> Option<f64>) -> Vec<(f64, f64)> {
    steps
        .iter()
        .filter_map(|s| pick(&s.step).map(|v| (s.step.step as f64, v)))
        .collect()
}

/// The charts of one comparison named `name` over its `steps`: the loss curves, then the
/// fp64 arbiter's distances per step (`arbiter`), else the errors per step.
pub(super) fn charts(name: &str, arbiter: bool, steps: &[&StepRow]) -> Vec<Chart> {
    let loss = Chart {
        kind: &LOSS,
        name: name.to_owned(),
        points: vec![
            points(steps, |s| s.loss.as_ref().map(|l| l.run)),
            points(steps, |s| s.loss.as_ref().map(|l| l.reference)),
        ],
    };
    let second = match arbiter {
        true => Chart {
            kind: &ENVELOPE,
            name: name.to_owned(),
            points: vec![
                points(steps, |s| s.envelope.as_ref().map(|e| e.run_to_f64)),
                points(steps, |s| s.envelope.as_ref().map(|e| e.reference_to_f64)),
            ],
        },
        false => {
            let mut errors = vec![
                points(steps, |s| s.loss.as_ref().map(|d| d.abs_err)),
                points(steps, |s| s.grad_norm.as_ref().map(|d| d.abs_err)),
            ];
            let grads = points(steps, |s| s.grads.as_ref().map(|g| g.max_abs_err));
            if !grads.is_empty() {
                errors.push(grads);
            }
            Chart {
                kind: &ERRORS,
                name: name.to_owned(),
                points: errors,
            }
        }
    };
    vec![loss, second]
}
