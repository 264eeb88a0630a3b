//! What the human formats say per tensor: the per-parameter table (gradients over the run
//! and the final value of each parameter, failing ones first) and the cross-rank line.
//!
//! A loss or a gradient norm says *that* a run went wrong; the per-parameter table says
//! *where*, which is what a person fixing the bug needs first. Markdown and HTML render the
//! same rows, so they cannot disagree.

use super::{fmt_num, fmt_ulp};
use crate::parity::{Comparison, FailurePoint, Mode, Stats};

/// Rows shown per table before the rest is summed up in one "… N more" line: the failing
/// parameters come first, so the cap only ever hides passing ones unless more than this many
/// fail (report.json keeps them all).
pub const MAX_PARAM_ROWS: usize = 20;

/// One parameter (or buffer) of a comparison: its gradients over every step and its final
/// value, whichever were compared.
#[derive(Clone, Copy, Debug)]
pub struct ParamRow<'a> {
    /// The tensor's name.
    pub name: &'a str,
    /// Its gradients' statistics over every step, when per-step gradients were compared.
    pub grads: Option<&'a Stats>,
    /// Its final value's statistics, when compared.
    pub final_value: Option<&'a Stats>,
}

impl ParamRow<'_> {
    /// Whether any of its values failed.
    pub fn failed(&self) -> bool {
        [self.grads, self.final_value]
            .into_iter()
            .flatten()
            .any(|s| !s.passed)
    }

    /// The cells after the name: gradient first failure, max |Δ|, max ULP, then the same for
    /// the final value (`n/a` where that side was not compared, `—` where nothing failed).
    pub fn cells(&self) -> [String; 6] {
        let side = |s: Option<&Stats>, first: fn(&FailurePoint) -> String| match s {
            None => ["n/a".to_owned(), "n/a".to_owned(), "n/a".to_owned()],
            Some(s) => [
                s.first_failure
                    .as_ref()
                    .map_or_else(|| "—".to_owned(), first),
                fmt_num(s.max_abs_err),
                fmt_ulp(s.max_ulp),
            ],
        };
        let [g0, g1, g2] = side(self.grads, |f| {
            let step = f.step.map_or_else(|| "?".to_owned(), |s| s.to_string());
            format!("step {step}{}", at_element(f))
        });
        let [f0, f1, f2] = side(self.final_value, |f| format!("FAIL{}", at_element(f)));
        [g0, g1, g2, f0, f1, f2]
    }
}

/// ` at [3,1]` for a failure with a known element, else nothing.
fn at_element(f: &FailurePoint) -> String {
    match (&f.element, f.index) {
        (Some(e), _) if !e.is_empty() => {
            let dims: Vec<String> = e.iter().map(usize::to_string).collect();
            format!(" at [{}]", dims.join(","))
        }
        (None, Some(i)) => format!(" at flat [{i}]"),
        _ => String::new(),
    }
}

/// The column headers of the per-parameter table (after `parameter`); `|Δ|` is the distance
/// to the float64 shadow under the arbiter.
pub fn param_headers(c: &Comparison) -> [String; 6] {
    let d = if c.mode == Mode::Arbiter {
        "max |Δ| to fp64"
    } else {
        "max |Δ|"
    };
    [
        "gradient: first failure".to_owned(),
        format!("gradient: {d}"),
        "gradient: max ULP".to_owned(),
        "final value: first failure".to_owned(),
        format!("final value: {d}"),
        "final value: max ULP".to_owned(),
    ]
}

/// Every parameter and buffer of `c` in the order a person reads them: failing ones first
/// (earliest failing gradient step first, within a step last parameter first as backward
/// computes them, then those failing only in their final value), then the passing ones in
/// model order: the first row is the diagnosis's culprit.
pub fn param_rows(c: &Comparison) -> Vec<ParamRow<'_>> {
    let mut rows: Vec<ParamRow<'_>> = c
        .param_summaries
        .iter()
        .map(|p| ParamRow {
            name: &p.name,
            grads: c
                .grad_summaries
                .iter()
                .find(|g| g.name == p.name)
                .map(|g| &g.stats),
            final_value: Some(&p.stats),
        })
        .collect();
    for g in &c.grad_summaries {
        if !c.param_summaries.iter().any(|p| p.name == g.name) {
            rows.push(ParamRow {
                name: &g.name,
                grads: Some(&g.stats),
                final_value: None,
            });
        }
    }
    // Within a step, gradients fail in backward order (last parameter first), as the
    // diagnosis's culprit does; everything else stays in model order.
    let mut keyed: Vec<(bool, usize, usize, ParamRow<'_>)> = rows
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            let grad_step = r
                .grads
                .and_then(|g| g.first_failure.as_ref())
                .map(|f| f.step.unwrap_or(usize::MAX));
            let within = if grad_step.is_some() {
                usize::MAX - i
            } else {
                i
            };
            (!r.failed(), grad_step.unwrap_or(usize::MAX), within, r)
        })
        .collect();
    keyed.sort_by_key(|(passing, step, within, _)| (*passing, *step, *within));
    keyed.into_iter().map(|(.., r)| r).collect()
}

/// The line closing a capped table: how many rows were left out and how many of them fail.
pub fn more_rows_line(rows: &[ParamRow<'_>]) -> Option<String> {
    let hidden = rows.get(MAX_PARAM_ROWS..)?;
    let failing = hidden.iter().filter(|r| r.failed()).count();
    Some(if failing == 0 {
        format!(
            "… {} more parameters, all passing (report.json lists every one)",
            hidden.len()
        )
    } else {
        format!(
            "… {} more parameters, {failing} of them failing (report.json lists every one)",
            hidden.len()
        )
    })
}

/// What `c`'s run's plan split, in one line, when it had a plan: every tensor not replicated
/// with its placement, then how many were replicated.
pub fn plan_line(c: &Comparison) -> Option<String> {
    if c.placements.is_empty() {
        return None;
    }
    let split: Vec<String> = c
        .placements
        .iter()
        .filter(|p| !p.placement.starts_with("replicated"))
        .map(|p| format!("`{}` {}", p.tensor, p.placement))
        .collect();
    let replicated = c.placements.len() - split.len();
    Some(format!(
        "plan: {} of {} split ({}); {} replicated",
        split.len(),
        super::plural(c.placements.len(), "tensor"),
        if split.is_empty() {
            "none".to_owned()
        } else {
            split.join(", ")
        },
        replicated
    ))
}

/// The collectives `c`'s run issued per step, in one line, when it counted them.
pub fn collectives_line(c: &Comparison) -> Option<String> {
    let entries = c.collectives_per_step.as_ref()?;
    let parts: Vec<String> = entries
        .iter()
        .map(|e| {
            format!(
                "{} on {}: {} of {} B",
                e.op,
                e.group,
                super::plural(e.calls as usize, "call"),
                e.bytes
            )
        })
        .collect();
    Some(format!(
        "collectives per step (rank 0, step 0): {}",
        if parts.is_empty() {
            "none".to_owned()
        } else {
            parts.join("; ")
        }
    ))
}

/// The cross-rank check of `c`'s run in one line, when its launcher made one: how much was
/// compared and that it agreed, or the mismatch (which fails the comparison).
pub fn cross_rank_line(c: &Comparison) -> Option<String> {
    let check = c.cross_rank.as_ref()?;
    if check.compared == 0 && check.mismatch.is_none() {
        // Pipeline stages: every rank holds tensors no other rank does.
        return Some(format!(
            "cross-rank: no tensor is held by more than one of the {}, so none was compared",
            super::plural(check.ranks, "rank")
        ));
    }
    Some(match &check.mismatch {
        None => format!(
            "cross-rank: {} compared across {}, all bitwise equal",
            super::plural(check.compared, "tensor"),
            super::plural(check.ranks, "rank")
        ),
        Some(m) => format!(
            "cross-rank: MISMATCH: {m} ({} compared across {})",
            super::plural(check.compared, "tensor"),
            super::plural(check.ranks, "rank")
        ),
    })
}
