//! The short account of a finished matrix: a grid of models by configuration family with
//! counts, every failure, error and regression in full, and where the reports are. What the
//! terminal prints by default (`--rows` prints every row instead) and what a CI job page
//! shows (`GITHUB_STEP_SUMMARY`, as Markdown).

use super::*;
use lockstep_harness::report::Regression;

/// The family a configuration belongs to, for the summary's columns: its name's first part
/// (`fsdp.full_shard@4` → `fsdp`), `composed` for compositions (`pp2_x_tp2`), `mesh` for a
/// user's mesh.
fn config_family(config: &str) -> &str {
    let name = config.split('@').next().unwrap_or(config);
    if name.starts_with("mesh.") {
        "mesh"
    } else if name.contains("_x_") {
        "composed"
    } else {
        name.split('.').next().unwrap_or(name)
    }
}

/// One (model, family) cell's row counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    pass: usize,
    fail: usize,
    error: usize,
    skip: usize,
}

impl Counts {
    fn add(&mut self, status: RowStatus) {
        match status {
            RowStatus::Pass => self.pass += 1,
            RowStatus::Fail => self.fail += 1,
            RowStatus::Error => self.error += 1,
            RowStatus::Skip => self.skip += 1,
        }
    }

    /// `passed/judged`, then the failures (`✗2`) and errors (`!1`); `skip` when every row
    /// was skipped; `-` when the family has no row for the model.
    fn cell(self) -> String {
        let judged = self.pass + self.fail + self.error;
        if judged == 0 {
            return if self.skip > 0 { "skip" } else { "-" }.to_owned();
        }
        let mut cell = format!("{}/{judged}", self.pass);
        if self.fail > 0 {
            let _ = write!(cell, " ✗{}", self.fail);
        }
        if self.error > 0 {
            let _ = write!(cell, " !{}", self.error);
        }
        cell
    }
}

/// The grid: families in first-row order, and per model (in row order) each family's counts.
struct FamilyGrid {
    families: Vec<String>,
    models: Vec<(String, Vec<Counts>)>,
}

impl FamilyGrid {
    fn of(rows: &[Row]) -> FamilyGrid {
        let mut families: Vec<String> = Vec::new();
        let mut models: Vec<(String, Vec<Counts>)> = Vec::new();
        for r in rows.iter().filter(|r| !r.inapplicable) {
            let family = config_family(&r.config);
            let f = match families.iter().position(|x| x == family) {
                Some(f) => f,
                None => {
                    families.push(family.to_owned());
                    families.len() - 1
                }
            };
            let m = match models.iter().position(|(x, _)| *x == r.model) {
                Some(m) => m,
                None => {
                    models.push((r.model.clone(), Vec::new()));
                    models.len() - 1
                }
            };
            let counts = &mut models[m].1;
            if counts.len() <= f {
                counts.resize(f + 1, Counts::default());
            }
            counts[f].add(r.status);
        }
        for (_, counts) in &mut models {
            counts.resize(families.len(), Counts::default());
        }
        FamilyGrid { families, models }
    }

    /// The header and one line per model, as cells.
    fn cells(&self) -> Vec<Vec<String>> {
        let mut out = vec![std::iter::once("model".to_owned())
            .chain(self.families.iter().cloned())
            .collect::<Vec<_>>()];
        for (model, counts) in &self.models {
            out.push(
                std::iter::once(model.clone())
                    .chain(counts.iter().map(|c| c.cell()))
                    .collect(),
            );
        }
        out
    }
}

/// The regressions against the baseline, one line each under a heading (nothing when none).
pub fn render_regressions(regressions: &[Regression]) -> String {
    let mut out = String::new();
    if !regressions.is_empty() {
        let _ = writeln!(out, "\nregressed against the baseline:");
        for r in regressions {
            let _ = writeln!(
                out,
                "  {} {} {} vs {}: {}",
                r.status, r.model, r.config, r.reference, r.what
            );
        }
    }
    out
}

impl MatrixResult {
    /// The rows that need a reader: failed and errored ones, in row order.
    fn troubled(&self) -> impl Iterator<Item = &Row> {
        self.rows
            .iter()
            .filter(|r| matches!(r.status, RowStatus::Fail | RowStatus::Error))
    }

    /// The terminal's account: the headline counts, the grid by model and configuration
    /// family, every failed and errored row (the table's line and its diagnosis or the
    /// run's account), every regression against the baseline, and where the reports are.
    pub fn render_summary(&self, regressions: &[Regression], out_dir: &Path) -> String {
        let mut out = String::new();
        let grid = FamilyGrid::of(&self.rows).cells();
        let widths: Vec<usize> = (0..grid[0].len())
            .map(|i| grid.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
            .collect();
        for line in &grid {
            let cells: Vec<String> = line
                .iter()
                .zip(&widths)
                .enumerate()
                .map(|(i, (c, w))| match i {
                    0 => format!("{c:<w$}"),
                    _ => format!("{c:>w$}"),
                })
                .collect();
            let _ = writeln!(out, "{}", cells.join("  ").trim_end());
        }
        let troubled: Vec<[String; 11]> = self.troubled().map(table_cells).collect();
        if !troubled.is_empty() {
            out.push('\n');
            write_grid(&mut out, &troubled);
            self.write_failures(&mut out);
        }
        out.push_str(&render_regressions(regressions));
        self.write_totals(&mut out);
        let _ = writeln!(
            out,
            "every row: --rows, or {}; charts and details: {}",
            out_dir.join("report.md").display(),
            out_dir.join("report.html").display()
        );
        out
    }

    /// The job page's account (Markdown, for `GITHUB_STEP_SUMMARY`): the counts, the grid,
    /// the failures, errors and regressions, and where the reports are.
    pub fn render_step_summary(&self, regressions: &[Regression], out_dir: &Path) -> String {
        let passed = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Pass)
            .count();
        let troubled: Vec<&Row> = self.troubled().collect();
        let mark = if troubled.is_empty() && regressions.is_empty() {
            "✅"
        } else {
            "❌"
        };
        let mut out = format!(
            "### {mark} Lockstep parity: {passed} passed, {} failed, {} errored, {} regressed\n\n",
            troubled
                .iter()
                .filter(|r| r.status == RowStatus::Fail)
                .count(),
            troubled
                .iter()
                .filter(|r| r.status == RowStatus::Error)
                .count(),
            regressions.len()
        );
        let grid = FamilyGrid::of(&self.rows).cells();
        for (i, line) in grid.iter().enumerate() {
            let _ = writeln!(out, "| {} |", line.join(" | "));
            if i == 0 {
                let _ = writeln!(out, "|{}", " --- |".repeat(line.len()));
            }
        }
        if !troubled.is_empty() {
            let _ = writeln!(out, "\n**Failures and errors**\n");
            for r in troubled {
                let _ = writeln!(
                    out,
                    "- {} `{}` `{}` vs `{}`: {}",
                    r.status.label(),
                    r.model,
                    r.config,
                    r.reference,
                    r.note.as_deref().unwrap_or("-").replace('\n', " ")
                );
            }
        }
        if !regressions.is_empty() {
            let _ = writeln!(out, "\n**Regressed against the baseline**\n");
            for r in regressions {
                let _ = writeln!(
                    out,
                    "- {} `{}` `{}` vs `{}`: {}",
                    r.status, r.model, r.config, r.reference, r.what
                );
            }
        }
        let _ = writeln!(
            out,
            "\n{} in {:.1} s; reports in `{}` (report.html, report.md, baseline.jsonl)\n",
            lockstep_harness::report::plural(self.runs, "run"),
            self.elapsed.as_secs_f64(),
            out_dir.display()
        );
        out
    }
}
