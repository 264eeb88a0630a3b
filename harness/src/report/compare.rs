//! Comparing two reports: did a change make any configuration numerically worse?
//!
//! Configurations are matched by model × config × reference. A configuration regresses when
//! its run **errored** in the new report (listed among its errors: it crashed or hung, so
//! nothing was compared), it **vanished** (in the base, missing from the new report),
//! **crossed tolerance** (passed before, fails now), or its error **grew** more than the
//! factor.
//!
//! Growth is measured on the maximum absolute error of every quantity with a drift figure:
//! the loss, the gradient norm, each parameter's gradients (over the run) and each final
//! parameter and buffer, which does not change meaning when a tolerance policy is edited
//! between the two reports. Every quantity that regressed is listed, not only the worst: a
//! change that moves the loss a little and one gradient a lot must name that gradient.
//!
//! A quantity regresses when it passed and now fails, when its error grew by more than the
//! factor, when its error was noise (at or below `zero_floor`, or subnormal) and no longer
//! is, or when its error became NaN or infinite. A growth factor is only ever computed from a
//! base error that is finite and above the floor: a ratio over zero (or over a subnormal)
//! says nothing but how small the base was, so such a change reads "new (was 0)". So a
//! bitwise-identical configuration (base error exactly 0) that now differs by 1e-6 is flagged
//! as new, while one going from 0 to 1e-15 is not. A NaN error counts as infinite; a base
//! that was already non-finite cannot grow.

use super::{fmt_num, read_report_or_baseline, Report, ReportError, RunError};
use crate::parity::{Comparison, Quantity, Stats};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

/// How strict a report comparison is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompareOptions {
    /// Flag errors that grew by more than this factor (default 10).
    pub factor: f64,
    /// Errors at or below this are noise (default 1e-12); see the module docs.
    pub zero_floor: f64,
}

impl Default for CompareOptions {
    fn default() -> Self {
        CompareOptions {
            factor: 10.0,
            zero_floor: 1e-12,
        }
    }
}

/// The verdict on one configuration, most severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum RowTrend {
    /// Its run failed in the new report (crashed, hung): nothing was compared, which is
    /// never better than a failing comparison.
    Errored,
    /// In the base report, missing from the new one.
    Vanished,
    /// Passed in the base report, fails in the new one.
    CrossedTolerance,
    /// Error grew past the factor.
    Grew,
    /// Failed before and still fails, without growing past the factor.
    StillFailing,
    /// Failed before, passes now.
    Fixed,
    /// Only in the new report.
    Added,
    /// No change worth flagging.
    Ok,
}

impl RowTrend {
    /// Whether this status fails the comparison.
    pub fn is_regression(self) -> bool {
        matches!(
            self,
            RowTrend::Errored | RowTrend::Vanished | RowTrend::CrossedTolerance | RowTrend::Grew
        )
    }
}

impl std::fmt::Display for RowTrend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RowTrend::Errored => "ERRORED",
            RowTrend::Vanished => "VANISHED",
            RowTrend::CrossedTolerance => "CROSSED TOLERANCE",
            RowTrend::Grew => "GREW",
            RowTrend::StillFailing => "still failing",
            RowTrend::Fixed => "fixed",
            RowTrend::Added => "added",
            RowTrend::Ok => "ok",
        })
    }
}

/// How one quantity's error moved between the two reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Change {
    /// `new / base`, both finite and the base above the noise floor: the only case a growth
    /// factor means anything.
    Factor(f64),
    /// The base error was noise (0, subnormal, or at most the floor) and the new one is not:
    /// no ratio exists ("new (was 0)").
    FromNoise {
        /// The base error.
        base: f64,
    },
    /// The new error is NaN or infinite where the base was finite.
    NonFinite,
    /// Nothing to measure: both errors are noise, or the base was already non-finite.
    Unmeasured,
}

impl Change {
    /// Whether this change alone is a regression under `factor`.
    pub fn is_growth(self, factor: f64) -> bool {
        match self {
            Change::Factor(g) => g > factor,
            Change::FromNoise { .. } | Change::NonFinite => true,
            Change::Unmeasured => false,
        }
    }

    /// The ratio, when one exists.
    pub fn factor(self) -> Option<f64> {
        match self {
            Change::Factor(g) => Some(g),
            _ => None,
        }
    }

    /// Orders changes by severity: non-finite, then from noise, then by factor.
    fn cmp_severity(self, other: Change) -> std::cmp::Ordering {
        let rank = |c: Change| match c {
            Change::NonFinite => (3, 0.0),
            Change::FromNoise { .. } => (2, 0.0),
            Change::Factor(g) => (1, g),
            Change::Unmeasured => (0, 0.0),
        };
        let (a, b) = (rank(self), rank(other));
        a.0.cmp(&b.0).then(a.1.total_cmp(&b.1))
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Factor(g) => write!(f, "{}x", fmt_num(*g)),
            Change::FromNoise { base } if *base == 0.0 => f.write_str("new (was 0)"),
            Change::FromNoise { base } => write!(f, "new (was {})", fmt_num(*base)),
            Change::NonFinite => f.write_str("now non-finite"),
            Change::Unmeasured => f.write_str("-"),
        }
    }
}

/// One quantity with a drift figure in both reports: the loss, the gradient norm, one
/// parameter's gradients or one final value (or, for reports without per-tensor figures,
/// all gradients or all final values together).
#[derive(Clone, Debug, PartialEq)]
pub struct Drift {
    /// `loss`, `grad_norm`, ``gradient of `w` ``, ``final value of `w` ``, `grads`, `params`.
    pub what: String,
    /// Which series it belongs to.
    pub quantity: Quantity,
    /// The tensor, for a per-tensor figure.
    pub tensor: Option<String>,
    /// Max abs error in the base report.
    pub base_err: f64,
    /// Max abs error in the new report.
    pub new_err: f64,
    /// How it moved.
    pub change: Change,
    /// Whether it passed in the base report.
    pub base_passed: bool,
    /// Whether it passes in the new report.
    pub new_passed: bool,
    /// It crossed tolerance or grew (see [`Change::is_growth`]).
    pub regressed: bool,
}

/// One configuration across the two reports.
#[derive(Clone, Debug, PartialEq)]
pub struct CompareRow {
    /// Model zoo name.
    pub model: String,
    /// The run's configuration.
    pub config: String,
    /// The reference's configuration.
    pub reference: String,
    /// The quantity the error columns describe: the worst regressed one, else the one that
    /// grew the most.
    pub quantity: Option<Quantity>,
    /// Its max abs error in the base report.
    pub base_err: Option<f64>,
    /// Its max abs error in the new report.
    pub new_err: Option<f64>,
    /// `new / base`, only when the base error is finite and above the noise floor (see
    /// [`Change`]).
    pub growth: Option<f64>,
    /// How that quantity moved.
    pub change: Option<Change>,
    /// Every quantity that regressed, worst first (the first is the one the columns
    /// describe).
    pub regressed: Vec<Drift>,
    /// Verdict in the base report.
    pub base_passed: Option<bool>,
    /// Verdict in the new report.
    pub new_passed: Option<bool>,
    /// Whether the error grew past the factor (also set when the status is the more severe
    /// crossed tolerance).
    pub grew: bool,
    /// The most severe finding.
    pub status: RowTrend,
}

/// The outcome of [`compare_reports`].
#[derive(Clone, Debug, PartialEq)]
pub struct ReportComparison {
    /// The options used.
    pub options: CompareOptions,
    /// One row per configuration in either report, most severe first.
    pub rows: Vec<CompareRow>,
}

impl ReportComparison {
    /// The rows that fail the comparison.
    pub fn regressions(&self) -> impl Iterator<Item = &CompareRow> {
        self.rows.iter().filter(|r| r.status.is_regression())
    }

    /// Whether any configuration regressed (the CLI's non-zero exit).
    pub fn has_regression(&self) -> bool {
        self.regressions().next().is_some()
    }

    /// A fixed-width table for terminals and CI logs, with a closing verdict line: one line
    /// per configuration (its worst regressed quantity), then one indented line per further
    /// quantity that regressed.
    pub fn render_table(&self) -> String {
        let header = [
            "model",
            "config",
            "reference",
            "quantity",
            "base err",
            "new err",
            "growth",
            "base",
            "new",
            "status",
        ]
        .map(str::to_owned);
        let mut body: Vec<[String; 10]> = Vec::new();
        for r in &self.rows {
            body.push(row_cells(r));
            for d in r.regressed.iter().skip(1) {
                body.push(drift_cells(d, self.options.factor));
            }
        }
        let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
        for row in &body {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        for cells in std::iter::once(&header).chain(&body) {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            let _ = writeln!(out, "{}", parts.join("  ").trim_end());
        }
        let n = self.regressions().count();
        if n == 0 {
            let _ = writeln!(
                out,
                "no regression ({}, factor {}x)",
                super::plural(self.rows.len(), "configuration"),
                self.options.factor
            );
        } else {
            let _ = writeln!(
                out,
                "{} among {} (factor {}x)",
                super::plural(n, "regression"),
                super::plural(self.rows.len(), "configuration"),
                self.options.factor
            );
        }
        out
    }
}

impl super::Regression {
    /// The regression row `r` as reports list it.
    pub fn of(r: &CompareRow) -> super::Regression {
        let cells = row_cells(r);
        let what = match (&r.base_err, &r.new_err) {
            (Some(_), Some(_)) => {
                format!("{}: {} -> {} ({})", cells[3], cells[4], cells[5], cells[6])
            }
            _ => format!("{}: base {}, new {}", cells[3], cells[7], cells[8]),
        };
        super::Regression {
            model: r.model.clone(),
            config: r.config.clone(),
            reference: r.reference.clone(),
            status: cells[9].clone(),
            what,
        }
    }
}

fn verdict(p: Option<bool>) -> String {
    match p {
        Some(true) => "pass".to_owned(),
        Some(false) => "FAIL".to_owned(),
        None => "-".to_owned(),
    }
}

fn opt_num(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), fmt_num)
}

/// The line of one configuration: its worst quantity and its status.
fn row_cells(r: &CompareRow) -> [String; 10] {
    let what = r.regressed.first().map_or_else(
        || r.quantity.map_or_else(|| "-".to_owned(), |q| q.to_string()),
        |d| d.what.clone(),
    );
    [
        r.model.clone(),
        r.config.clone(),
        r.reference.clone(),
        what,
        opt_num(r.base_err),
        opt_num(r.new_err),
        r.change.map_or_else(|| "-".to_owned(), |c| c.to_string()),
        verdict(r.base_passed),
        verdict(r.new_passed),
        if r.grew && r.status != RowTrend::Grew {
            format!("{} (and grew)", r.status)
        } else {
            r.status.to_string()
        },
    ]
}

/// The indented line of one more regressed quantity under its configuration's line.
fn drift_cells(d: &Drift, factor: f64) -> [String; 10] {
    let crossed = d.base_passed && !d.new_passed;
    let status = match (crossed, d.change.is_growth(factor)) {
        (true, true) => "crossed tolerance (and grew)",
        (true, false) => "crossed tolerance",
        _ => "grew",
    };
    [
        String::new(),
        String::new(),
        String::new(),
        format!("  {}", d.what),
        fmt_num(d.base_err),
        fmt_num(d.new_err),
        d.change.to_string(),
        verdict(Some(d.base_passed)),
        verdict(Some(d.new_passed)),
        status.to_owned(),
    ]
}

type Key = (String, String, String);

fn index<'a>(
    report: &'a Report,
    which: &'static str,
) -> Result<BTreeMap<Key, &'a Comparison>, ReportError> {
    let mut map = BTreeMap::new();
    for c in &report.comparisons {
        let key = (c.model.clone(), c.config.clone(), c.reference.clone());
        if map.insert(key, c).is_some() {
            return Err(ReportError::DuplicateComparison {
                which,
                model: c.model.clone(),
                config: c.config.clone(),
                reference: c.reference.clone(),
            });
        }
    }
    Ok(map)
}

fn nan_as_inf(x: f64) -> f64 {
    if x.is_nan() {
        f64::INFINITY
    } else {
        x
    }
}

/// How an error moved from `base` to `new`, never as a ratio over noise (see [`Change`]).
fn change(base: f64, new: f64, floor: f64) -> Change {
    let (base, new) = (nan_as_inf(base), nan_as_inf(new));
    // Zero and subnormals are noise whatever the floor: a ratio over them is meaningless.
    let noise = |x: f64| x <= floor || !x.is_normal();
    if base.is_infinite() {
        Change::Unmeasured
    } else if new.is_infinite() {
        Change::NonFinite
    } else if !noise(base) {
        Change::Factor(new / base)
    } else if noise(new) {
        Change::Unmeasured
    } else {
        Change::FromNoise { base }
    }
}

/// Every quantity of one configuration with a drift figure in both reports: loss, gradient
/// norm, each parameter's gradients and final value (all gradients or all final values
/// together when a report has no per-tensor figures for them).
fn drifts(b: &Comparison, n: &Comparison, floor: f64, factor: f64) -> Vec<Drift> {
    let mut out = Vec::new();
    let mut push =
        |what: String, quantity: Quantity, tensor: Option<&str>, bs: &Stats, ns: &Stats| {
            let change = change(bs.max_abs_err, ns.max_abs_err, floor);
            out.push(Drift {
                what,
                quantity,
                tensor: tensor.map(str::to_owned),
                base_err: nan_as_inf(bs.max_abs_err),
                new_err: nan_as_inf(ns.max_abs_err),
                change,
                base_passed: bs.passed,
                new_passed: ns.passed,
                regressed: (bs.passed && !ns.passed) || change.is_growth(factor),
            });
        };
    push("loss".into(), Quantity::Loss, None, &b.losses, &n.losses);
    push(
        "grad_norm".into(),
        Quantity::GradNorm,
        None,
        &b.grad_norms,
        &n.grad_norms,
    );
    let per_tensor = [
        (
            Quantity::Grads,
            "gradient of",
            &b.grad_summaries,
            &n.grad_summaries,
        ),
        (
            Quantity::Params,
            "final value of",
            &b.param_summaries,
            &n.param_summaries,
        ),
    ];
    for (quantity, label, base, new) in per_tensor {
        if base.is_empty() || new.is_empty() {
            if let (Some(bs), Some(ns)) = (b.stats(quantity), n.stats(quantity)) {
                push(quantity.to_string(), quantity, None, bs, ns);
            }
            continue;
        }
        for ns in new {
            if let Some(bs) = base.iter().find(|t| t.name == ns.name) {
                let what = format!("{label} `{}`", ns.name);
                push(what, quantity, Some(&ns.name), &bs.stats, &ns.stats);
            }
        }
    }
    out
}

/// Compares `new` against `base` configuration by configuration.
pub fn compare_reports(
    base: &Report,
    new: &Report,
    options: &CompareOptions,
) -> Result<ReportComparison, ReportError> {
    if !(options.factor.is_finite() && options.factor >= 1.0) {
        return Err(ReportError::InvalidFactor(options.factor));
    }
    let floor = noise_floor(options);
    let base_map = index(base, "base")?;
    let new_map = index(new, "new")?;
    let errored: BTreeMap<Key, &RunError> = new
        .errors
        .iter()
        .map(|e| ((e.model.clone(), e.config.clone(), e.reference.clone()), e))
        .collect();
    let mut rows = Vec::new();
    for key in errored.keys() {
        let b = base_map.get(key).copied();
        rows.push(uncompared_row(key, RowTrend::Errored, b, None));
    }
    for (key, b) in &base_map {
        if errored.contains_key(key) {
            continue;
        }
        rows.push(match new_map.get(key) {
            Some(n) => compared_row(key, b, n, floor, options.factor),
            None => uncompared_row(key, RowTrend::Vanished, Some(b), None),
        });
    }
    for (key, n) in &new_map {
        if !base_map.contains_key(key) && !errored.contains_key(key) {
            rows.push(uncompared_row(key, RowTrend::Added, None, Some(n)));
        }
    }
    rows.sort_by_key(|r| r.status);
    Ok(ReportComparison {
        options: *options,
        rows,
    })
}

/// The error at or below which a drift is noise: the options' floor, or the smallest normal
/// number when that is not a positive finite value.
fn noise_floor(options: &CompareOptions) -> f64 {
    if options.zero_floor.is_finite() && options.zero_floor > 0.0 {
        options.zero_floor
    } else {
        f64::MIN_POSITIVE
    }
}

/// The row of a configuration whose values were not compared (it errored, vanished or was
/// added): each side's overall error and verdict where that side has a comparison.
fn uncompared_row(
    key: &Key,
    status: RowTrend,
    base: Option<&Comparison>,
    new: Option<&Comparison>,
) -> CompareRow {
    let (model, config, reference) = key.clone();
    CompareRow {
        model,
        config,
        reference,
        quantity: None,
        base_err: base.map(|b| b.overall().max_abs_err),
        new_err: new.map(|n| n.overall().max_abs_err),
        growth: None,
        change: None,
        regressed: Vec::new(),
        base_passed: base.map(|b| b.passed),
        new_passed: new.map(|n| n.passed),
        grew: false,
        status,
    }
}

/// The row of a configuration in both reports: every quantity's drift, the worst regressed
/// one (else the one that grew the most) in the columns, and the most severe status.
fn compared_row(key: &Key, b: &Comparison, n: &Comparison, floor: f64, factor: f64) -> CompareRow {
    let (model, config, reference) = key.clone();
    let all = drifts(b, n, floor, factor);
    let mut regressed: Vec<Drift> = all.iter().filter(|d| d.regressed).cloned().collect();
    // Worst first; a stable sort keeps model order among equals.
    regressed.sort_by(|x, y| y.change.cmp_severity(x.change));
    let headline = regressed.first().cloned().or_else(|| {
        all.iter()
            .max_by(|x, y| x.change.cmp_severity(y.change))
            .cloned()
    });
    let grew = all.iter().any(|d| d.change.is_growth(factor));
    let status = if b.passed && !n.passed {
        RowTrend::CrossedTolerance
    } else if grew {
        RowTrend::Grew
    } else if !b.passed && n.passed {
        RowTrend::Fixed
    } else if !n.passed {
        RowTrend::StillFailing
    } else {
        RowTrend::Ok
    };
    CompareRow {
        model,
        config,
        reference,
        quantity: headline.as_ref().map(|d| d.quantity),
        base_err: headline.as_ref().map(|d| d.base_err),
        new_err: headline.as_ref().map(|d| d.new_err),
        growth: headline.as_ref().and_then(|d| d.change.factor()),
        change: headline.as_ref().map(|d| d.change),
        regressed,
        base_passed: Some(b.passed),
        new_passed: Some(n.passed),
        grew,
        status,
    }
}

/// Reads two report files and compares them: either side a full report (`report.json`) or a
/// compact baseline (`baseline.jsonl`).
pub fn compare_report_files(
    base: &Path,
    new: &Path,
    options: &CompareOptions,
) -> Result<ReportComparison, ReportError> {
    let base = read_report_or_baseline(base)?;
    let new = read_report_or_baseline(new)?;
    compare_reports(&base, &new, options)
}
