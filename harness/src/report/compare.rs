//! Comparing two reports: did a change make any configuration numerically worse?
//!
//! Configurations are matched by model × config × reference. A configuration regresses when
//! its run **errored** in the new report (listed among its errors: it crashed or hung, so
//! nothing was compared), it **vanished** (in the base, missing from the new report),
//! **crossed tolerance** (passed before, fails now), or its error **grew** more than the
//! factor.
//!
//! Growth is measured on the maximum absolute error of each quantity (loss, gradient norm,
//! gradients, final parameters), which does not change meaning when a tolerance policy is
//! edited between the two reports. Errors at or below `zero_floor` are treated as noise: the
//! ratio is `new / max(base, zero_floor)`, and growth is flagged only when the new error is
//! also above the floor. So a bitwise-identical configuration (base error exactly 0) that
//! now differs by 1e-6 is flagged (1e-6 / 1e-12 ≫ 10), while one going from 0 to 1e-15 is
//! not. A NaN error counts as infinite.

use super::{fmt_num, read_json, Report, ReportError, RunError};
use crate::parity::{Comparison, Quantity};
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
pub enum RowStatus {
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

impl RowStatus {
    /// Whether this status fails the comparison.
    pub fn is_regression(self) -> bool {
        matches!(
            self,
            RowStatus::Errored
                | RowStatus::Vanished
                | RowStatus::CrossedTolerance
                | RowStatus::Grew
        )
    }
}

impl std::fmt::Display for RowStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RowStatus::Errored => "ERRORED",
            RowStatus::Vanished => "VANISHED",
            RowStatus::CrossedTolerance => "CROSSED TOLERANCE",
            RowStatus::Grew => "GREW",
            RowStatus::StillFailing => "still failing",
            RowStatus::Fixed => "fixed",
            RowStatus::Added => "added",
            RowStatus::Ok => "ok",
        })
    }
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
    /// The quantity whose error grew the most (the one the error columns describe).
    pub quantity: Option<Quantity>,
    /// Its max abs error in the base report.
    pub base_err: Option<f64>,
    /// Its max abs error in the new report.
    pub new_err: Option<f64>,
    /// `new / max(base, zero_floor)`.
    pub growth: Option<f64>,
    /// Verdict in the base report.
    pub base_passed: Option<bool>,
    /// Verdict in the new report.
    pub new_passed: Option<bool>,
    /// Whether the error grew past the factor (also set when the status is the more severe
    /// crossed tolerance).
    pub grew: bool,
    /// The most severe finding.
    pub status: RowStatus,
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

    /// A fixed-width table for terminals and CI logs, with a closing verdict line.
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
        ];
        let opt = |x: Option<f64>| x.map_or_else(|| "-".to_owned(), fmt_num);
        let verdict = |p: Option<bool>| match p {
            Some(true) => "pass".to_owned(),
            Some(false) => "FAIL".to_owned(),
            None => "-".to_owned(),
        };
        let body: Vec<[String; 10]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.model.clone(),
                    r.config.clone(),
                    r.reference.clone(),
                    r.quantity.map_or_else(|| "-".to_owned(), |q| q.to_string()),
                    opt(r.base_err),
                    opt(r.new_err),
                    r.growth
                        .map_or_else(|| "-".to_owned(), |g| format!("{}x", fmt_num(g))),
                    verdict(r.base_passed),
                    verdict(r.new_passed),
                    if r.grew && r.status != RowStatus::Grew {
                        format!("{} (and grew)", r.status)
                    } else {
                        r.status.to_string()
                    },
                ]
            })
            .collect();
        let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
        for row in &body {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let line = |cells: &[&str], out: &mut String| {
            let parts: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(c, w)| format!("{c:<w$}"))
                .collect();
            let _ = writeln!(out, "{}", parts.join("  ").trim_end());
        };
        line(&header, &mut out);
        for row in &body {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&cells, &mut out);
        }
        let n = self.regressions().count();
        if n == 0 {
            let _ = writeln!(
                out,
                "no regression ({} configurations, factor {}x)",
                self.rows.len(),
                self.options.factor
            );
        } else {
            let _ = writeln!(
                out,
                "{n} regression(s) among {} configurations (factor {}x)",
                self.rows.len(),
                self.options.factor
            );
        }
        out
    }
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

/// Compares `new` against `base` configuration by configuration.
pub fn compare_reports(
    base: &Report,
    new: &Report,
    options: &CompareOptions,
) -> Result<ReportComparison, ReportError> {
    if !(options.factor.is_finite() && options.factor >= 1.0) {
        return Err(ReportError::InvalidFactor(options.factor));
    }
    let floor = if options.zero_floor.is_finite() && options.zero_floor > 0.0 {
        options.zero_floor
    } else {
        f64::MIN_POSITIVE
    };
    let base_map = index(base, "base")?;
    let new_map = index(new, "new")?;
    let errored: BTreeMap<Key, &RunError> = new
        .errors
        .iter()
        .map(|e| ((e.model.clone(), e.config.clone(), e.reference.clone()), e))
        .collect();
    let mut rows = Vec::new();
    for key in errored.keys() {
        let (model, config, reference) = key.clone();
        let b = base_map.get(key);
        rows.push(CompareRow {
            model,
            config,
            reference,
            quantity: None,
            base_err: b.map(|b| b.overall().max_abs_err),
            new_err: None,
            growth: None,
            base_passed: b.map(|b| b.passed),
            new_passed: None,
            grew: false,
            status: RowStatus::Errored,
        });
    }
    for (key, b) in &base_map {
        let (model, config, reference) = key.clone();
        if errored.contains_key(key) {
            continue;
        }
        let Some(n) = new_map.get(key) else {
            rows.push(CompareRow {
                model,
                config,
                reference,
                quantity: None,
                base_err: Some(b.overall().max_abs_err),
                new_err: None,
                growth: None,
                base_passed: Some(b.passed),
                new_passed: None,
                grew: false,
                status: RowStatus::Vanished,
            });
            continue;
        };
        // The quantity with the largest growth describes the row.
        let mut worst: Option<(Quantity, f64, f64, f64)> = None;
        for q in Quantity::ALL {
            let (Some(bs), Some(ns)) = (b.stats(q), n.stats(q)) else {
                continue;
            };
            let (be, ne) = (nan_as_inf(bs.max_abs_err), nan_as_inf(ns.max_abs_err));
            let growth = if ne <= floor {
                0.0
            } else if be.is_infinite() {
                // Already infinitely wrong (NaN or a non-finite mismatch): staying so is no
                // growth, and anything finite is an improvement.
                if ne.is_infinite() {
                    1.0
                } else {
                    0.0
                }
            } else {
                ne / be.max(floor)
            };
            if worst.is_none_or(|w| growth > w.3) {
                worst = Some((q, be, ne, growth));
            }
        }
        let grew = worst.is_some_and(|w| w.2 > floor && w.3 > options.factor);
        let status = if b.passed && !n.passed {
            RowStatus::CrossedTolerance
        } else if grew {
            RowStatus::Grew
        } else if !b.passed && n.passed {
            RowStatus::Fixed
        } else if !n.passed {
            RowStatus::StillFailing
        } else {
            RowStatus::Ok
        };
        rows.push(CompareRow {
            model,
            config,
            reference,
            quantity: worst.map(|w| w.0),
            base_err: worst.map(|w| w.1),
            new_err: worst.map(|w| w.2),
            growth: worst.map(|w| w.3),
            base_passed: Some(b.passed),
            new_passed: Some(n.passed),
            grew,
            status,
        });
    }
    for (key, n) in &new_map {
        if !base_map.contains_key(key) && !errored.contains_key(key) {
            let (model, config, reference) = key.clone();
            rows.push(CompareRow {
                model,
                config,
                reference,
                quantity: None,
                base_err: None,
                new_err: Some(n.overall().max_abs_err),
                growth: None,
                base_passed: None,
                new_passed: Some(n.passed),
                grew: false,
                status: RowStatus::Added,
            });
        }
    }
    rows.sort_by_key(|r| r.status);
    Ok(ReportComparison {
        options: *options,
        rows,
    })
}

/// Reads two report files and compares them.
pub fn compare_report_files(
    base: &Path,
    new: &Path,
    options: &CompareOptions,
) -> Result<ReportComparison, ReportError> {
    let base = read_json(base)?;
    let new = read_json(new)?;
    compare_reports(&base, &new, options)
}
