//! What a finished matrix produced: its rows, the report with errored rows, and the table.

use super::*;

/// How one row of the matrix ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RowStatus {
    /// The comparison passed.
    Pass,
    /// The comparison failed: the numbers differ beyond what the policy allows.
    Fail,
    /// Not applicable to this model (the reason says why).
    Skip,
    /// A run it needed failed, so nothing was compared.
    Error,
}

impl RowStatus {
    pub(super) fn label(self) -> &'static str {
        match self {
            RowStatus::Pass => "PASS",
            RowStatus::Fail => "FAIL",
            RowStatus::Skip => "skip",
            RowStatus::Error => "ERROR",
        }
    }
}

/// One line of the summary: a configuration against one reference.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Zoo model.
    pub model: String,
    /// The configuration under test at its world size (`ddp@4`).
    pub config: String,
    /// The reference configuration (`single@4`, `ddp@4`).
    pub reference: String,
    /// Ranks of the run.
    pub world_size: usize,
    /// Verdict.
    pub status: RowStatus,
    /// `bitwise`, `arbiter` (the fp64 arbiter) or `tolerance` (a table with a reasoned
    /// override).
    pub mode: &'static str,
    /// Largest absolute error over every compared quantity.
    #[serde(with = "report::num::opt")]
    pub max_abs_err: Option<f64>,
    /// Largest ULP distance over every compared quantity.
    pub max_ulp: Option<u64>,
    /// Largest error / allowed error (at most 1 passes).
    #[serde(with = "report::num::opt")]
    pub margin: Option<f64>,
    /// The run's memory figures (rank 0's): FSDP's measured full-parameter peak and shard
    /// bytes; for DDP the whole model's parameter bytes, which every rank keeps. `None` for
    /// the single-device reference and for runs that did not finish.
    pub memory: Option<MemoryStats>,
    /// Where it first failed, why it was skipped, or why a run failed; a tolerance override
    /// in force is named here with its reason.
    pub note: Option<String>,
    /// For `Error` rows: the launcher's whole account of the failed run (the failing rank's
    /// message and stderr; on a timeout every rank's flight recorder and the desync
    /// diagnosis).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<String>,
    /// For `arbiter` rows: the constants and the quantity that came closest to its envelope,
    /// with the run's and the fp32 reference's distances to float64 there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub arbiter: Option<lockstep_harness::parity::ArbiterSummary>,
    /// For `Error` rows: whether the run failed by outliving its timeout (a hang).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub timed_out: bool,
    /// For `Skip` rows: the configuration never ran on this model at this world size (it
    /// cannot: the note says why), so the pair is inapplicable rather than a comparison left
    /// out. The table and the report files count these instead of listing them.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub inapplicable: bool,
}

pub use crate::runner::RunFailed;

/// Everything a finished matrix produced.
#[derive(Debug, Default)]
pub struct MatrixResult {
    /// One row per model × config × reference × world size, in run order.
    pub rows: Vec<Row>,
    /// The comparisons behind the `Pass`/`Fail` rows, in row order.
    pub comparisons: Vec<Comparison>,
    /// Training runs performed (single-device and DDP launches).
    pub runs: usize,
    /// Runs that failed (hung ones included).
    pub failed_runs: usize,
    /// Runs that outlived the timeout.
    pub hung_runs: usize,
    /// Measured wall time of the whole matrix.
    pub elapsed: Duration,
}

impl MatrixResult {
    /// Whether every run completed and every comparison passed.
    pub fn passed(&self) -> bool {
        self.failed_runs == 0 && self.rows.iter().all(|r| r.status != RowStatus::Fail)
    }

    /// The report over every comparison, with the matrix's wall time. Rows whose runs
    /// failed are the report's errors (with the launcher's whole account), which mark it
    /// incomplete: it is written all the same, and never looks complete.
    pub fn report(&self) -> Report {
        let errors = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Error)
            .map(|r| RunError {
                model: r.model.clone(),
                config: r.config.clone(),
                reference: r.reference.clone(),
                message: r.note.clone().unwrap_or_else(|| "run failed".into()),
                details: r
                    .details
                    .clone()
                    .or_else(|| r.note.clone())
                    .unwrap_or_default(),
            })
            .collect();
        let skipped = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Skip && !r.inapplicable)
            .map(|r| report::Skipped {
                model: r.model.clone(),
                config: r.config.clone(),
                reference: r.reference.clone(),
                reason: r.note.clone().unwrap_or_else(|| "not compared".into()),
            })
            .collect();
        Report::new(self.comparisons.clone())
            .with_wall_time(self.elapsed)
            .with_errors(errors)
            .with_skipped(skipped, self.inapplicable())
    }

    /// How many rows are inapplicable pairs (see [`Row::inapplicable`]).
    pub fn inapplicable(&self) -> usize {
        self.rows.iter().filter(|r| r.inapplicable).count()
    }

    /// The summary table, followed by the reasons it refers to (models without a
    /// single-device reference, tolerance overrides), the diagnosis of every failed row and
    /// the total time. Memory columns are KiB of rank 0's full parameters at their peak and
    /// of its shards (DDP: the whole model, kept on every rank).
    pub fn render_table(&self) -> String {
        let cells: Vec<[String; 11]> = self
            .rows
            .iter()
            .filter(|r| !r.inapplicable)
            .map(table_cells)
            .collect();
        let mut out = String::new();
        write_grid(&mut out, &cells);
        self.write_notes(&mut out);
        self.write_totals(&mut out);
        out
    }

    /// The lines below the table's notes: verdict counts, inapplicable pairs, runs and time.
    pub(super) fn write_totals(&self, out: &mut String) {
        let passed = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Pass)
            .count();
        let failed = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Fail)
            .count();
        let inapplicable = self.inapplicable();
        let skipped = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Skip)
            .count()
            - inapplicable;
        let _ = writeln!(
            out,
            "\n{passed} passed, {failed} failed, {skipped} skipped, {}",
            lockstep_harness::report::plural(self.failed_runs, "run error")
        );
        if inapplicable > 0 {
            let _ = writeln!(
                out,
                "{} not listed: configurations that cannot run that model at that world size \
                 (`--json` lists each with its reason)",
                lockstep_harness::report::plural(inapplicable, "inapplicable pair")
            );
        }
        let _ = writeln!(
            out,
            "matrix: {} in {:.1} s",
            lockstep_harness::report::plural(self.runs, "run"),
            self.elapsed.as_secs_f64()
        );
    }

    /// What the table's rows refer to, below it: each model's reason for a skip once, each
    /// tolerance override's reason once, every failed comparison's diagnosis and every
    /// failed run's whole account.
    fn write_notes(&self, out: &mut String) {
        // Each model's reason once per kind of skip.
        let mut explained: Vec<(&str, &str)> = Vec::new();
        for r in &self.rows {
            let (RowStatus::Skip, Some(note)) = (r.status, &r.note) else {
                continue;
            };
            for kind in [NO_SINGLE] {
                if note.starts_with(kind) && !explained.contains(&(r.model.as_str(), kind)) {
                    explained.push((&r.model, kind));
                    let _ = writeln!(out, "\nskipped: model `{}` has {note}", r.model);
                }
            }
        }
        // Each override reason once, with the configurations (without `@N`) it governs.
        let mut overrides: Vec<(&str, Vec<String>)> = Vec::new();
        for c in &self.comparisons {
            let Some(reason) = c.override_reason.as_deref() else {
                continue;
            };
            let base = |name: &str| name.rsplit_once('@').map_or(name, |(b, _)| b).to_owned();
            let pair = format!("{} vs {}", base(&c.config), base(&c.reference));
            match overrides.iter_mut().find(|(r, _)| *r == reason) {
                Some((_, pairs)) if !pairs.contains(&pair) => pairs.push(pair),
                Some(_) => {}
                None => overrides.push((reason, vec![pair])),
            }
        }
        for (reason, pairs) in overrides {
            let _ = writeln!(out, "\n{OVERRIDE} ({}): {reason}", pairs.join(", "));
        }
        self.write_failures(out);
    }

    /// Every failed comparison's diagnosis and every failed run's whole account.
    pub(super) fn write_failures(&self, out: &mut String) {
        for c in self.comparisons.iter().filter(|c| !c.passed) {
            let _ = writeln!(
                out,
                "\nFAIL {} {} vs {}: {}",
                c.model,
                c.config,
                c.reference,
                c.diagnosis.as_deref().unwrap_or("(no diagnosis)")
            );
        }
        // Each failed run's whole account once (a run serves several rows).
        let mut told: Vec<&str> = Vec::new();
        for r in self.rows.iter().filter(|r| r.status == RowStatus::Error) {
            let details = r.details.as_deref().or(r.note.as_deref()).unwrap_or("");
            if told.contains(&details) {
                continue;
            }
            told.push(details);
            let _ = writeln!(out, "\nERROR {} {} vs {}:", r.model, r.config, r.reference);
            for l in details.lines() {
                let _ = writeln!(out, "  {l}");
            }
        }
    }
}

/// The table's columns; the last ([`NOTE_COLUMN`]) is free text, left unpadded.
const TABLE_HEADERS: [&str; 11] = [
    "model",
    "config",
    "reference",
    "world",
    "result",
    "max abs err",
    "max ULP",
    "margin",
    "peak params KiB",
    "shard KiB",
    "first failure / note",
];

/// Index of the note column in [`TABLE_HEADERS`].
const NOTE_COLUMN: usize = 10;

/// One table row's cells, in [`TABLE_HEADERS`] order, with long reasons left for below.
pub(super) fn table_cells(r: &Row) -> [String; 11] {
    let kib =
        |bytes: Option<u64>| bytes.map_or("-".into(), |b| format!("{:.1}", b as f64 / 1024.0));
    [
        r.model.clone(),
        r.config.clone(),
        r.reference.clone(),
        r.world_size.to_string(),
        r.status.label().to_owned(),
        r.max_abs_err.map_or("-".into(), fmt_num),
        r.max_ulp.map_or("-".into(), fmt_ulp),
        r.margin.map_or("-".into(), fmt_num),
        kib(r.memory.map(|m| m.full_param_bytes_peak)),
        kib(r.memory.map(|m| m.shard_bytes)),
        match (&r.status, &r.note) {
            // The model's reason is a sentence: printed once below the table.
            (RowStatus::Skip, Some(n)) if n.starts_with(NO_SINGLE) => {
                format!("{NO_SINGLE} (see below)")
            }
            // So is an override's reason.
            (_, Some(n)) if n.contains(OVERRIDE) => {
                let at = n.find(OVERRIDE).unwrap_or(0);
                format!("{}{OVERRIDE} (see below)", &n[..at])
            }
            (_, note) => note.clone().unwrap_or_default(),
        },
    ]
}

/// Writes the header and `cells` as aligned columns (numbers right-aligned, the note last).
pub(super) fn write_grid(out: &mut String, cells: &[[String; 11]]) {
    let mut widths = TABLE_HEADERS.map(str::len);
    for row in cells {
        for (w, c) in widths.iter_mut().zip(row.iter()).take(NOTE_COLUMN) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |out: &mut String, row: &[&str]| {
        let mut text = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i == NOTE_COLUMN {
                text.push_str(cell);
            } else if (3..NOTE_COLUMN).contains(&i) && i != 4 {
                let _ = write!(text, "{cell:>w$}  ", w = widths[i]);
            } else {
                let _ = write!(text, "{cell:<w$}  ", w = widths[i]);
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(out, &TABLE_HEADERS);
    for row in cells {
        let refs: Vec<&str> = row.iter().map(String::as_str).collect();
        line(out, &refs);
    }
}

fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_finite() {
        format!("{x:.2e}")
    } else {
        format!("{x}")
    }
}

fn fmt_ulp(u: u64) -> String {
    if u == u64::MAX {
        "NaN".into()
    } else {
        u.to_string()
    }
}

/// A short "where" for the table: the culprit (a cross-rank mismatch, else the first failing
/// tensor with its element and step), then the derived scalar it caused, so the row names
/// what went wrong rather than only a loss or a norm.
pub(super) fn short_failure(c: &Comparison) -> Option<String> {
    let mismatch = c.cross_rank.as_ref().and_then(|x| x.mismatch.as_ref());
    let mut parts: Vec<String> = Vec::new();
    if let Some(m) = mismatch {
        parts.push(format!(
            "cross-rank: {} `{}` @ step {} differs on rank(s) {:?}",
            m.kind, m.name, m.step, m.differing
        ));
    }
    if let Some(f) = &c.first_failure {
        parts.push(short_point(f));
    }
    if let Some(d) = &c.derived_failure {
        parts.push(format!("then {}", short_point(d)));
    }
    if parts.is_empty() {
        c.structural.first().cloned()
    } else {
        Some(parts.join("; "))
    }
}

/// Quantity, tensor, element and step of one failing value.
fn short_point(f: &FailurePoint) -> String {
    let mut s = f.quantity.to_string();
    if let Some(t) = &f.tensor {
        let _ = write!(s, " {t}");
    }
    match (&f.element, f.index) {
        (Some(e), _) if !e.is_empty() => {
            let dims: Vec<String> = e.iter().map(usize::to_string).collect();
            let _ = write!(s, "[{}]", dims.join(","));
        }
        (_, Some(i)) if f.tensor.is_some() => {
            let _ = write!(s, "[{i}]");
        }
        _ => {}
    }
    match f.step {
        Some(step) => {
            let _ = write!(s, " @ step {step}");
        }
        None => s.push_str(" (final)"),
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::comm::DType;
    use lockstep_core::consistency::{CrossRankCheck, CrossRankMismatch, StateKind};
    use lockstep_core::record::{NamedTensor, RunSpec};

    /// A run whose `fc0.weight` gradient at step 0 is off in element [1, 0], which shows in
    /// that step's gradient norm; and its reference.
    fn pair() -> (RunRecord, RunRecord) {
        let record = |config: &str, g: f64, norm: f64| {
            let spec = RunSpec {
                model: "mlp".into(),
                config: config.into(),
                world_size: 2,
                backend: "cpu".into(),
                dtype: "fp32".into(),
                steps: 1,
                seed: 0,
            };
            let mut r = RunRecord::start(spec, true);
            r.losses.push(1.0);
            r.grad_norms.push(norm);
            let t = |values: Vec<f64>| NamedTensor {
                name: "fc0.weight".into(),
                dtype: DType::F32,
                shape: vec![2, 2],
                values,
            };
            r.grads = Some(vec![vec![t(vec![0.5, 0.5, g, 0.5])]]);
            r.params.push(t(vec![1.0; 4]));
            r
        };
        (record("tp.2@2", 0.25, 2.0), record("single@2", 0.5, 3.0))
    }

    #[test]
    fn a_rows_failure_names_the_tensor_element_and_step_then_the_scalar() {
        let (run, reference) = pair();
        let c = compare(&run, &reference, &TolerancePolicy::dtype_table(DType::F32));
        assert_eq!(
            short_failure(&c).as_deref(),
            Some("grads fc0.weight[1,0] @ step 0; then grad_norm @ step 0")
        );
    }

    #[test]
    fn a_rows_failure_starts_with_a_cross_rank_mismatch() {
        let (mut run, reference) = pair();
        run.cross_rank = Some(CrossRankCheck {
            ranks: 2,
            compared: 3,
            mismatch: Some(CrossRankMismatch {
                step: 0,
                kind: StateKind::Param,
                name: "fc0.weight".into(),
                coord: String::new(),
                holders: vec![0, 1],
                agreeing: vec![0],
                differing: vec![1],
                sums: vec![4.0, 4.5],
                shapes: vec![vec![2, 2], vec![2, 2]],
            }),
        });
        let c = compare(&run, &reference, &TolerancePolicy::dtype_table(DType::F32));
        let note = short_failure(&c).unwrap_or_default();
        assert!(
            note.starts_with("cross-rank: parameter `fc0.weight` @ step 0 differs on rank(s) [1]; grads fc0.weight[1,0]"),
            "{note}"
        );
    }
}
