//! The compact baseline: what a repository keeps of a report so that a later run can be
//! compared against it (`lockstep compare BASELINE NEW`).
//!
//! A full report carries every step, every tensor and every chart's data (tens of MB for
//! the default matrix); a baseline keeps, per comparison, its verdict, how it was judged,
//! and each quantity's figures (loss, gradient norm, gradients, final parameters: the
//! largest error, ULP distance and margin), plus the environment that produced it. It is
//! JSON Lines: a header line, then one line per comparison (errors and skipped ones too)
//! sorted by model, configuration and reference, numbers to four significant digits. So a
//! change to one configuration is a one-line diff, and the default matrix's baseline is
//! well under 1 MB.
//!
//! Comparing against a baseline measures the same quantities as comparing two reports,
//! except that gradients and final parameters are each one figure over all tensors instead
//! of one per tensor ([`super::compare_reports`] falls back to that when either side has
//! no per-tensor figures).

use super::{write_atomic, Environment, Report, ReportError, RunError, Skipped, Summary};
use crate::parity::{Comparison, Mode, Stats};
use lockstep_core::num;
use lockstep_core::record::RunSpec;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The baseline layout's version, in its header line; readers refuse others.
pub const BASELINE_VERSION: u32 = 1;

/// The file name `lockstep matrix` writes its baseline under, beside the report.
pub const BASELINE_FILE: &str = "baseline.jsonl";

/// The first line of a baseline: what wrote it, where, and the totals.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Header {
    /// Always [`BASELINE_VERSION`] when written by this build; names the format too.
    lockstep_baseline: u32,
    /// The program and version that wrote it.
    tool: String,
    /// Where the numbers were computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    environment: Option<Environment>,
    /// The report's totals.
    summary: Summary,
}

/// One quantity's figures.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
struct Figures {
    /// Largest absolute error.
    #[serde(with = "num")]
    err: f64,
    /// Largest ULP distance (`u64::MAX`: NaN involved).
    ulp: u64,
    /// Largest error over the allowed one (at most 1 passes).
    #[serde(with = "num")]
    margin: f64,
    /// Whether every value passed.
    pass: bool,
}

/// One comparison's line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Line {
    model: String,
    config: String,
    reference: String,
    /// `pass`, `fail`, `error` (a run it needed failed) or `skip` (its reference cannot
    /// exist for the model).
    status: String,
    /// How it was judged (compared lines only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mode: Option<Mode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    loss: Option<Figures>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grad_norm: Option<Figures>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    grads: Option<Figures>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    params: Option<Figures>,
    /// Where it first failed, why it errored or was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    note: Option<String>,
}

/// `x` to four significant digits: stable against noise in the last bits, exact for 0,
/// infinities and NaN.
fn rounded(x: f64) -> f64 {
    if !x.is_finite() || x == 0.0 {
        return x;
    }
    format!("{x:.3e}").parse().unwrap_or(x)
}

impl Figures {
    fn of(s: &Stats) -> Figures {
        Figures {
            err: rounded(s.max_abs_err),
            ulp: s.max_ulp,
            margin: rounded(s.margin),
            pass: s.passed,
        }
    }

    fn stats(self) -> Stats {
        Stats {
            compared: 1,
            max_abs_err: self.err,
            max_rel_err: 0.0,
            max_ulp: self.ulp,
            margin: self.margin,
            passed: self.pass,
            first_failure: None,
        }
    }
}

impl Line {
    fn bare(model: &str, config: &str, reference: &str, status: &str) -> Line {
        Line {
            model: model.to_owned(),
            config: config.to_owned(),
            reference: reference.to_owned(),
            status: status.to_owned(),
            mode: None,
            loss: None,
            grad_norm: None,
            grads: None,
            params: None,
            note: None,
        }
    }

    fn of(c: &Comparison) -> Line {
        let note = c.first_failure.as_ref().map(|f| f.to_string());
        Line {
            mode: Some(c.mode),
            loss: Some(Figures::of(&c.losses)),
            grad_norm: Some(Figures::of(&c.grad_norms)),
            grads: c.grads.as_ref().map(Figures::of),
            params: Some(Figures::of(&c.params)),
            note,
            ..Line::bare(
                &c.model,
                &c.config,
                &c.reference,
                if c.passed { "pass" } else { "fail" },
            )
        }
    }

    /// The comparison this line stands for, as [`super::compare_reports`] reads it.
    fn comparison(&self) -> Comparison {
        let spec = |config: &str| RunSpec {
            model: self.model.clone(),
            config: config.to_owned(),
            world_size: super::split_world(config).1,
            backend: "unknown".into(),
            dtype: "unknown".into(),
            steps: 0,
            seed: 0,
        };
        let stats = |f: Option<Figures>| f.map(Figures::stats).unwrap_or_default();
        Comparison {
            model: self.model.clone(),
            config: self.config.clone(),
            reference: self.reference.clone(),
            run_spec: spec(&self.config),
            reference_spec: spec(&self.reference),
            mode: self.mode.unwrap_or(Mode::Tolerance),
            override_reason: None,
            passed: self.status == "pass",
            diagnosis: self.note.clone(),
            structural: Vec::new(),
            first_failure: None,
            derived_failure: None,
            losses: stats(self.loss),
            grad_norms: stats(self.grad_norm),
            params: stats(self.params),
            grads: self.grads.map(Figures::stats),
            param_summaries: Vec::new(),
            grad_summaries: Vec::new(),
            cross_rank: None,
            steps: Vec::new(),
            memory: None,
            arbiter: None,
            placements: Vec::new(),
            collectives_per_step: None,
        }
    }
}

/// The baseline of `report` as text: the header line, then one line per comparison, error
/// and skipped comparison, sorted by model, configuration and reference.
pub fn render_baseline(report: &Report) -> Result<String, ReportError> {
    let header = Header {
        lockstep_baseline: BASELINE_VERSION,
        tool: report.tool.clone(),
        environment: report.environment.clone(),
        summary: report.summary.clone(),
    };
    let mut lines: Vec<Line> = report.comparisons.iter().map(Line::of).collect();
    lines.extend(report.errors.iter().map(|e| Line {
        note: Some(e.message.clone()),
        ..Line::bare(&e.model, &e.config, &e.reference, "error")
    }));
    lines.extend(report.skipped.iter().map(|s| Line {
        note: Some(s.reason.clone()),
        ..Line::bare(&s.model, &s.config, &s.reference, "skip")
    }));
    lines.sort_by(|a, b| {
        (&a.model, &a.config, &a.reference).cmp(&(&b.model, &b.config, &b.reference))
    });
    let mut out = serde_json::to_string(&header).map_err(ReportError::Serialize)?;
    out.push('\n');
    for line in &lines {
        out.push_str(&serde_json::to_string(line).map_err(ReportError::Serialize)?);
        out.push('\n');
    }
    Ok(out)
}

/// Writes the baseline of `report` to `path` atomically.
pub fn write_baseline(report: &Report, path: &Path) -> Result<(), ReportError> {
    write_atomic(path, render_baseline(report)?.as_bytes())
}

/// Whether `text` is a baseline (its first line is a baseline header), not a full report.
fn is_baseline(text: &str) -> bool {
    text.lines()
        .next()
        .is_some_and(|l| l.trim_start().starts_with("{\"lockstep_baseline\""))
}

/// The report a baseline stands for: its comparisons with their figures (no steps, no
/// per-tensor figures), errors and skipped ones, the environment and totals it recorded.
fn parse_baseline(path: &Path, text: &str) -> Result<Report, ReportError> {
    let json = |source| ReportError::Json {
        path: path.to_owned(),
        source,
    };
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let first = lines.next().unwrap_or_default();
    let version: serde_json::Value = serde_json::from_str(first).map_err(json)?;
    let found = version
        .get("lockstep_baseline")
        .and_then(serde_json::Value::as_u64);
    if found != Some(u64::from(BASELINE_VERSION)) {
        return Err(ReportError::UnsupportedBaseline {
            path: path.to_owned(),
            found,
        });
    }
    let header: Header = serde_json::from_value(version).map_err(json)?;
    let mut report = Report::new(Vec::new());
    let mut errors = Vec::new();
    let mut skipped = Vec::new();
    for text in lines {
        let line: Line = serde_json::from_str(text).map_err(json)?;
        let note = line.note.clone().unwrap_or_default();
        match line.status.as_str() {
            "error" => errors.push(RunError {
                model: line.model,
                config: line.config,
                reference: line.reference,
                message: note,
                details: String::new(),
            }),
            "skip" => skipped.push(Skipped {
                model: line.model,
                config: line.config,
                reference: line.reference,
                reason: note,
            }),
            _ => report.comparisons.push(line.comparison()),
        }
    }
    report.summary = header.summary;
    report.tool = header.tool;
    report.environment = header.environment;
    report.complete = errors.is_empty();
    report.errors = errors;
    report.skipped = skipped;
    Ok(report)
}

/// Reads either a full report (`report.json`) or a baseline (`baseline.jsonl`), told apart
/// by their content: what `lockstep compare` accepts on either side.
pub fn read_report_or_baseline(path: &Path) -> Result<Report, ReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Io {
        path: path.to_owned(),
        source,
    })?;
    match is_baseline(&text) {
        true => parse_baseline(path, &text),
        false => super::json::parse_json(path, &text),
    }
}
