//! The sensitivity table: one row per site, one column per fault kind, then the counts, every
//! miss with what the fault did, and the reasons of runs that failed.

use super::{SensitivityReport, Verdict};
use std::fmt::Write as _;

impl SensitivityReport {
    /// Counts over every site × fault: caught (errors and hangs included), of those errors and
    /// hangs, missed, not applicable, same bits, moved.
    pub fn counts(&self) -> Counts {
        let mut c = Counts::default();
        for f in self.sites.iter().flat_map(|s| &s.faults) {
            match f.verdict {
                Verdict::Caught { .. } => c.caught += 1,
                Verdict::Error { .. } => {
                    c.caught += 1;
                    c.errors += 1;
                }
                Verdict::Hang { .. } => {
                    c.caught += 1;
                    c.hangs += 1;
                }
                Verdict::Missed { .. } => c.missed += 1,
                Verdict::Inert { .. } => c.inert += 1,
                Verdict::NotApplicable { .. } => c.not_applicable += 1,
                Verdict::Same => c.same += 1,
                Verdict::Moved { .. } => c.moved += 1,
            }
        }
        c
    }
}

/// How a sensitivity analysis's verdicts add up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Caught, errors and hangs included.
    pub caught: usize,
    /// Of the caught: runs that failed.
    pub errors: usize,
    /// Of the caught: runs that hung.
    pub hangs: usize,
    /// Missed, with an effect on the training's outcome.
    pub missed: usize,
    /// Passed every check with no effect on the training's outcome.
    pub inert: usize,
    /// Faults that cannot apply to their call.
    pub not_applicable: usize,
    /// Faults that applied and changed no bit.
    pub same: usize,
    /// Sites the faulted run did not reach with the recorded call.
    pub moved: usize,
}

impl std::fmt::Display for SensitivityReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let steps: Vec<String> = self.site_steps.iter().map(usize::to_string).collect();
        writeln!(
            f,
            "sensitivity of {}@{} on {}: {}; sites of step {} ({} of {}); {} in {:.1} s",
            self.config,
            self.world_size,
            self.model,
            lockstep_harness::report::plural(self.steps, "step"),
            steps.join(", "),
            self.sites.len(),
            lockstep_harness::report::plural(self.calls_recorded, "recorded call"),
            lockstep_harness::report::plural(self.runs, "run"),
            self.wall_time_seconds
        )?;
        f.write_str(&self.table())?;
        let c = self.counts();
        writeln!(
            f,
            "\ncaught {} (of which error {}, hang {}), missed {}, inert {}, n/a {}, same {}, \
             moved {}",
            c.caught, c.errors, c.hangs, c.missed, c.inert, c.not_applicable, c.same, c.moved
        )?;
        let misses = self.misses(false);
        if !misses.is_empty() {
            writeln!(f, "\nmissed (every check passed with the fault in place):")?;
            for m in misses {
                let what = match m.verdict {
                    Verdict::Missed { detail, diverged } => {
                        format!("{detail}; {}", diverged_note(diverged))
                    }
                    Verdict::Moved { detail } => detail.clone(),
                    _ => String::new(),
                };
                writeln!(
                    f,
                    "  {} {} — {}: {what}",
                    m.site.site(),
                    m.site.describe(),
                    m.fault
                )?;
            }
        }
        let inert = self.inert();
        if !inert.is_empty() {
            writeln!(
                f,
                "\ninert (passed, and every rank trained to the bits of the run without a \
                 fault: the fault changed nothing the training depends on):"
            )?;
            let mut sites: Vec<(String, Vec<&str>)> = Vec::new();
            for m in inert {
                let key = format!("{} {}", m.site.site(), m.site.describe());
                match sites.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, faults)) => faults.push(m.fault),
                    None => sites.push((key, vec![m.fault])),
                }
            }
            for (site, faults) in sites {
                writeln!(f, "  {site} — {}", faults.join(", "))?;
            }
        }
        let mut told: Vec<&str> = Vec::new();
        for (site, fault) in self
            .sites
            .iter()
            .flat_map(|s| s.faults.iter().map(move |x| (s, x)))
        {
            let (Verdict::Error { reason } | Verdict::Hang { reason }) = &fault.verdict else {
                continue;
            };
            if told.is_empty() {
                writeln!(f, "\nruns that failed (counted as caught):")?;
            }
            if !told.contains(&reason.as_str()) {
                told.push(reason);
                writeln!(
                    f,
                    "  {} at {}: {} {reason}",
                    fault.fault,
                    site.site.site(),
                    fault.verdict.cell()
                )?;
            }
        }
        f.write_str(&self.field_bug_lines())?;
        for note in &self.notes {
            writeln!(f, "\nnote: {note}")?;
        }
        Ok(())
    }
}

impl SensitivityReport {
    /// The field bugs planted in the configuration's own code, one line each with its verdict
    /// and why (empty when none was tried).
    fn field_bug_lines(&self) -> String {
        if self.field_bugs.is_empty() {
            return String::new();
        }
        let mut text =
            String::from("\nfield bugs planted in the configuration's own code (docs/bugs.md):\n");
        for b in &self.field_bugs {
            let why = match &b.verdict {
                Verdict::Caught { by } => by.clone(),
                Verdict::Error { reason }
                | Verdict::Hang { reason }
                | Verdict::NotApplicable { reason } => reason.clone(),
                Verdict::Missed { diverged, .. } => diverged_note(diverged),
                _ => String::new(),
            };
            let _ = writeln!(text, "  {:<26} {:<7} {why}", b.bug, b.verdict.cell());
        }
        text
    }
}

/// Which ranks a missed fault left with other final state than the run without it.
fn diverged_note(diverged: &[usize]) -> String {
    let ranks: Vec<String> = diverged.iter().map(usize::to_string).collect();
    if diverged.contains(&0) {
        format!(
            "the final state changed on rank(s) {}, rank 0 included",
            ranks.join(",")
        )
    } else {
        format!(
            "rank 0 trained to the bits of the run without a fault, rank(s) {} did not: only \
             a comparison of the ranks' states can see it",
            ranks.join(",")
        )
    }
}

impl SensitivityReport {
    /// The site × fault table.
    fn table(&self) -> String {
        let faults: Vec<&str> = self
            .sites
            .first()
            .map(|s| s.faults.iter().map(|f| f.fault).collect())
            .unwrap_or_default();
        let mut headers = vec!["step", "call", "rank", "operation"];
        headers.extend(&faults);
        let rows: Vec<Vec<String>> =
            self.sites
                .iter()
                .map(|s| {
                    let mut row = vec![
                        s.site.step.to_string(),
                        s.site.index.to_string(),
                        s.site.rank.to_string(),
                        s.site.describe(),
                    ];
                    row.extend(s.faults.iter().map(|f| {
                        match (f.smallest_eps_caught, &f.verdict) {
                            (Some(eps), _) => format!("{eps:.0e}"),
                            (None, v) => v.cell().to_owned(),
                        }
                    }));
                    row
                })
                .collect();
        let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
        for row in &rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let mut line = |cells: &[&str]| {
            let mut text = String::new();
            for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
                if i < 3 {
                    let _ = write!(text, "{cell:>w$}  ");
                } else {
                    let _ = write!(text, "{cell:<w$}  ");
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&headers);
        for row in &rows {
            let cells: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&cells);
        }
        out
    }
}
