//! Parity reports: what a matrix of comparisons leaves behind for people and machines.
//!
//! One [`Report`] renders to a versioned JSON (the machine-readable record, and the input of
//! [`compare_reports`]), a Markdown summary, JUnit XML (for CI dashboards) and a
//! self-contained HTML page with plots. Every file is written atomically, so a crashed or
//! failed write never leaves a file that looks complete.

mod atomic;
mod baseline;
mod compare;
mod html;
mod json;
mod junit;
mod markdown;
mod tensors;
pub(crate) use crate::parity::fmt_num;
pub use lockstep_core::num;

pub use atomic::write_atomic;
pub use baseline::{
    read_report_or_baseline, render_baseline, write_baseline, BASELINE_FILE, BASELINE_VERSION,
};
pub use compare::{
    compare_report_files, compare_reports, Change, CompareOptions, CompareRow, Drift,
    ReportComparison, RowTrend,
};
pub use html::render_html;
pub use json::{read_json, render_json};
pub use junit::render_junit;
pub(crate) use junit::xml_escape;
pub use markdown::{render_markdown, LARGE_DISTANCES_NOTE};
pub use tensors::{cross_rank_line, param_rows, ParamRow, MAX_PARAM_ROWS};

use crate::parity::{Comparison, StepComparison};
pub use lockstep_core::machine::Environment;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Version of the JSON layout. Bump it on any change a reader could trip over; readers
/// refuse versions they do not know instead of misreading them. Version 2 added run errors
/// (`complete`, `errors`, `summary.errors`): a version-1 reader must not take a report with
/// errored runs for a complete one, so it refuses it.
pub const SCHEMA_VERSION: u32 = 2;

/// The versions [`read_json`] accepts. A version-1 report has no errors (version 1 wrote no
/// report when a run failed), so it reads as complete.
pub const READABLE_SCHEMA_VERSIONS: [u32; 2] = [1, 2];

/// Totals over a report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Summary {
    /// Comparisons (model × config × reference) in the report.
    pub comparisons: usize,
    /// How many passed.
    pub passed: usize,
    /// How many failed.
    pub failed: usize,
    /// Comparisons that could not be made because a run they needed failed (crashed, hung,
    /// could not start): listed in [`Report::errors`].
    #[serde(default)]
    pub errors: usize,
    /// Comparisons not made though their configuration ran (its reference cannot exist for
    /// the model): listed in [`Report::skipped`] with the reason.
    #[serde(default)]
    pub skipped: usize,
    /// Pairs whose configuration cannot run the model at that world size at all (a mesh
    /// that does not divide, a model without the layers it splits): counted, not listed.
    #[serde(default)]
    pub inapplicable: usize,
}

/// A comparison that was not made, though the configuration under test ran, and why (the
/// model has no single-device reference, no independent mixed-precision one...).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    /// Model zoo name.
    pub model: String,
    /// The configuration under test (`ddp@4`).
    pub config: String,
    /// The reference it would have been compared with.
    pub reference: String,
    /// Why it was not.
    pub reason: String,
}

/// A comparison that could not be made because a run it needed failed. Its row stands in
/// the report as an error, so a report with failed runs never looks complete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunError {
    /// Model zoo name.
    pub model: String,
    /// The configuration under test (`fsdp.hybrid_shard@4`).
    pub config: String,
    /// The reference it was to be compared with.
    pub reference: String,
    /// One line: what failed.
    pub message: String,
    /// The launcher's whole account: the failing rank, its message and stderr tail, and on a
    /// timeout every rank's flight recorder with the desync diagnosis.
    pub details: String,
}

/// One step of one comparison: the per-step record of the JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// Model zoo name.
    pub model: String,
    /// The run's configuration.
    pub config: String,
    /// The reference's configuration.
    pub reference: String,
    /// The step's values and verdict.
    #[serde(flatten)]
    pub step: StepComparison,
}

/// A whole parity matrix's results, as written to and read from disk.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Always [`SCHEMA_VERSION`] when written by this build.
    pub schema_version: u32,
    /// The program and version that wrote it.
    pub tool: String,
    /// Measured wall time of the whole matrix, set by the caller that ran it.
    #[serde(with = "num::opt", default)]
    pub wall_time_seconds: Option<f64>,
    /// Totals.
    pub summary: Summary,
    /// One record per model × config × reference × step.
    pub steps: Vec<StepRow>,
    /// One summary per model × config × reference (their `steps` are moved to
    /// [`Report::steps`] and left empty here), with final-parameter summaries.
    pub comparisons: Vec<Comparison>,
    /// False when some comparisons are missing because their runs failed: always
    /// `errors.is_empty()`, stored for readers of the JSON ([`Report::with_errors`] sets it).
    #[serde(default = "complete_by_default")]
    pub complete: bool,
    /// The comparisons that could not be made, with why.
    #[serde(default)]
    pub errors: Vec<RunError>,
    /// The comparisons not made though their configuration ran, with why.
    #[serde(default)]
    pub skipped: Vec<Skipped>,
    /// Where the numbers were computed (CPU capability, intra-op threads, libtorch): two
    /// reports that differ here may differ in bits without a bug. Optional, so reports
    /// written before it existed still read (same schema version).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<Environment>,
    /// What regressed against the baseline the run was compared with
    /// ([`Report::with_regressions`]), for the pages and summaries to list first; empty
    /// when none was given or nothing regressed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regressions: Vec<Regression>,
}

/// One comparison that regressed against a baseline: what a reader must see first.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Regression {
    /// Model zoo name.
    pub model: String,
    /// The configuration under test (`ddp@4`).
    pub config: String,
    /// Its reference.
    pub reference: String,
    /// How it regressed (`CROSSED TOLERANCE`, `GREW`, `VANISHED`, `ERRORED`).
    pub status: String,
    /// The quantity and the move (``gradient of `w`: 3.1e-7 -> 4.2e-5 (135x)``).
    pub what: String,
}

/// The [`Environment`] every run of this process is computed in: libtorch's CPU capability
/// and version, and the intra-op thread count the ranks and in-process references use
/// ([`crate::threads::rank_threads`]; the launching process itself runs one thread). What
/// `lockstep env` prints and every report records.
pub fn environment() -> Environment {
    Environment {
        intra_op_threads: crate::threads::rank_threads(),
        ..lockstep_core::machine::environment()
    }
}

fn complete_by_default() -> bool {
    true
}

impl Report {
    /// A report over `comparisons`, in the given order.
    pub fn new(comparisons: Vec<Comparison>) -> Self {
        let mut steps = Vec::new();
        let mut summaries = Vec::with_capacity(comparisons.len());
        for mut c in comparisons {
            for step in std::mem::take(&mut c.steps) {
                steps.push(StepRow {
                    model: c.model.clone(),
                    config: c.config.clone(),
                    reference: c.reference.clone(),
                    step,
                });
            }
            summaries.push(c);
        }
        let passed = summaries.iter().filter(|c| c.passed).count();
        Report {
            schema_version: SCHEMA_VERSION,
            tool: format!("lockstep {}", env!("CARGO_PKG_VERSION")),
            wall_time_seconds: None,
            summary: Summary {
                comparisons: summaries.len(),
                passed,
                failed: summaries.len() - passed,
                errors: 0,
                skipped: 0,
                inapplicable: 0,
            },
            steps,
            comparisons: summaries,
            complete: true,
            errors: Vec::new(),
            skipped: Vec::new(),
            environment: Some(environment()),
            regressions: Vec::new(),
        }
    }

    /// Records what regressed in `against` (this report compared with a baseline).
    pub fn with_regressions(mut self, against: &ReportComparison) -> Self {
        self.regressions = against.regressions().map(Regression::of).collect();
        self
    }

    /// Adds the comparisons that could not be made; any makes the report incomplete.
    pub fn with_errors(mut self, errors: Vec<RunError>) -> Self {
        self.summary.errors = errors.len();
        self.complete = errors.is_empty();
        self.errors = errors;
        self
    }

    /// Adds the comparisons skipped though their configuration ran, and the count of pairs
    /// that cannot run at all; neither makes the report incomplete.
    pub fn with_skipped(mut self, skipped: Vec<Skipped>, inapplicable: usize) -> Self {
        self.summary.skipped = skipped.len();
        self.summary.inapplicable = inapplicable;
        self.skipped = skipped;
        self
    }

    /// Records the measured wall time of the matrix.
    pub fn with_wall_time(mut self, elapsed: Duration) -> Self {
        self.wall_time_seconds = Some(elapsed.as_secs_f64());
        self
    }

    /// The report with `environment` recorded instead of this process's (`None` drops it).
    pub fn with_environment(mut self, environment: Option<Environment>) -> Self {
        self.environment = environment;
        self
    }

    /// The one line reports open with about where the numbers were computed, if recorded.
    pub fn environment_line(&self) -> Option<String> {
        self.environment
            .as_ref()
            .map(|e| format!("Computed with {e}."))
    }

    /// The per-step records of `c` (matched by model, config and reference).
    pub fn steps_of<'a>(&'a self, c: &'a Comparison) -> impl Iterator<Item = &'a StepRow> + 'a {
        self.steps.iter().filter(move |s| {
            s.model == c.model && s.config == c.config && s.reference == c.reference
        })
    }

    /// Whether every comparison passed and none is missing.
    pub fn passed(&self) -> bool {
        self.summary.failed == 0 && self.errors.is_empty()
    }

    /// The sentence every human format opens with: the counts, preceded by INCOMPLETE when
    /// runs failed, so an incomplete report never reads as a complete one.
    pub fn headline(&self) -> String {
        let s = &self.summary;
        let mut counts = format!(
            "{}: {} passed, {} failed",
            plural(s.comparisons, "comparison"),
            s.passed,
            s.failed
        );
        if s.skipped > 0 {
            counts.push_str(&format!("; {} skipped (listed with why)", s.skipped));
        }
        if s.inapplicable > 0 {
            counts.push_str(&format!(
                "; {} (a configuration that cannot run that model at that world size)",
                plural(s.inapplicable, "inapplicable pair")
            ));
        }
        if self.errors.is_empty() {
            counts
        } else if s.comparisons == 0 {
            format!(
                "INCOMPLETE: no comparison was made; {} could not be, because their runs failed \
                 (listed as errors)",
                plural(s.errors, "comparison")
            )
        } else {
            format!(
                "INCOMPLETE: {} could not be made because their runs failed (listed as \
                 errors). {counts}, {}",
                plural(s.errors, "comparison"),
                plural(s.errors, "error")
            )
        }
    }

    /// Whether any comparison carries memory figures: the human formats add their memory
    /// columns only then, so reports of configurations that measure none look as before.
    pub fn has_memory(&self) -> bool {
        self.comparisons.iter().any(|c| c.memory.is_some())
    }
}

/// Why a report could not be written, read or compared.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// A file could not be written or read.
    #[error("{path}: {source}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A report file is not valid report JSON.
    #[error("{path}: not a parity report: {source}")]
    Json {
        /// The file concerned.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// A report of a layout this build does not know.
    #[error(
        "{path}: schema_version {found:?} is not supported (this build reads {SCHEMA_VERSION})"
    )]
    UnsupportedSchema {
        /// The file concerned.
        path: PathBuf,
        /// The version found, if any.
        found: Option<u64>,
    },
    /// A baseline of a layout this build does not know.
    #[error(
        "{path}: lockstep_baseline {found:?} is not supported (this build reads {BASELINE_VERSION})"
    )]
    UnsupportedBaseline {
        /// The file concerned.
        path: PathBuf,
        /// The version found, if any.
        found: Option<u64>,
    },
    /// Rendering a report to JSON failed (a bug, not a user error).
    #[error("cannot serialize the report: {0}")]
    Serialize(#[source] serde_json::Error),
    /// The growth factor of a report comparison is not a finite number ≥ 1.
    #[error("growth factor {0} must be a finite number of at least 1")]
    InvalidFactor(f64),
    /// A report lists the same model × config × reference twice, so it is ambiguous which
    /// one to compare.
    #[error("{which} report lists {model} / {config} vs {reference} more than once")]
    DuplicateComparison {
        /// `base` or `new`.
        which: &'static str,
        /// Model of the duplicate.
        model: String,
        /// Config of the duplicate.
        config: String,
        /// Reference of the duplicate.
        reference: String,
    },
}

/// The files [`write_all`] produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReportFiles {
    /// `report.json`.
    pub json: PathBuf,
    /// `report.md`.
    pub markdown: PathBuf,
    /// `junit.xml`.
    pub junit: PathBuf,
    /// `report.html`.
    pub html: PathBuf,
    /// `baseline.jsonl`: the compact baseline a repository keeps
    /// ([`render_baseline`]).
    pub baseline: PathBuf,
}

impl ReportFiles {
    /// Where [`write_all`] puts each file in `dir`.
    pub fn in_dir(dir: &Path) -> ReportFiles {
        ReportFiles {
            json: dir.join("report.json"),
            markdown: dir.join("report.md"),
            junit: dir.join("junit.xml"),
            html: dir.join("report.html"),
            baseline: dir.join(BASELINE_FILE),
        }
    }
}

/// Writes the JSON to `path` atomically.
pub fn write_json(report: &Report, path: &Path) -> Result<(), ReportError> {
    write_atomic(path, render_json(report)?.as_bytes())
}

/// Writes the Markdown summary to `path` atomically.
pub fn write_markdown(report: &Report, path: &Path) -> Result<(), ReportError> {
    write_atomic(path, render_markdown(report).as_bytes())
}

/// Writes the JUnit XML to `path` atomically.
pub fn write_junit(report: &Report, path: &Path) -> Result<(), ReportError> {
    write_atomic(path, render_junit(report).as_bytes())
}

/// Writes the HTML page to `path` atomically.
pub fn write_html(report: &Report, path: &Path) -> Result<(), ReportError> {
    write_atomic(path, render_html(report).as_bytes())
}

/// The files [`write_all`] writes into a report directory.
pub const REPORT_FILES: [&str; 5] = [
    "report.json",
    "report.md",
    "junit.xml",
    "report.html",
    BASELINE_FILE,
];

/// Creates `dir` and proves it writable with a probe file, before any run starts, and
/// removes the report files an earlier run left there (so none can pass for this run's).
pub fn prepare_dir(dir: &Path) -> Result<(), ReportError> {
    let err = |source| ReportError::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(err)?;
    let probe = dir.join(format!(".lockstep-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(err)?;
    std::fs::remove_file(&probe).map_err(err)?;
    for name in REPORT_FILES {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
    }
    Ok(())
}

/// Writes every format into the existing directory `dir` (`report.json`, `report.md`,
/// `junit.xml`, `report.html`, `baseline.jsonl`). Each file is atomic on its own; the JSON
/// is written last so its presence means the set is complete.
pub fn write_all(report: &Report, dir: &Path) -> Result<ReportFiles, ReportError> {
    let files = ReportFiles::in_dir(dir);
    write_markdown(report, &files.markdown)?;
    write_baseline(report, &files.baseline)?;
    write_junit(report, &files.junit)?;
    write_html(report, &files.html)?;
    write_json(report, &files.json)?;
    Ok(files)
}

/// `n` and `noun`, in the plural unless `n` is 1 (`1 comparison`, `2 comparisons`): every
/// count printed with a noun goes through it, so no output says "1 comparisons". Nouns
/// ending in s, x, ch or sh take "es".
///
/// ```
/// use lockstep_harness::report::plural;
/// assert_eq!(plural(1, "comparison"), "1 comparison");
/// assert_eq!(plural(0, "comparison"), "0 comparisons");
/// assert_eq!(plural(2, "microbatch"), "2 microbatches");
/// ```
pub fn plural(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else if ["s", "x", "ch", "sh"].iter().any(|e| noun.ends_with(e)) {
        format!("{n} {noun}es")
    } else {
        format!("{n} {noun}s")
    }
}

/// A row's configuration name split at its world size: `ddp@4` → (`ddp`, 4); a name
/// without one (a job `lockstep judge` judged) → (the name, 0).
pub(crate) fn split_world(config: &str) -> (&str, usize) {
    match config.rsplit_once('@') {
        Some((base, n)) => match n.parse() {
            Ok(world) => (base, world),
            Err(_) => (config, 0),
        },
        None => (config, 0),
    }
}

/// Formats a byte count in KiB with one decimal (the zoo's models are a few KiB), or `-`
/// when there is none.
pub(crate) fn fmt_kib(bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!("{:.1}", b as f64 / 1024.0),
        None => "-".into(),
    }
}

/// Formats a ULP distance, where `u64::MAX` stands for "NaN involved".
pub(crate) fn fmt_ulp(u: u64) -> String {
    if u == u64::MAX {
        "NaN".into()
    } else {
        u.to_string()
    }
}

/// The arbiter's figures of a comparison judged by it, for a table cell: the run's and the
/// fp32 reference's distance to float64 where the run came closest to its envelope, and K
/// (`1.2e-6 / 3.4e-7 (K 16) at gradient of `w` at step 3`), then the fp32 variants the noise
/// was measured on too; `-` for other modes.
pub(crate) fn arbiter_cell(c: &crate::parity::Comparison) -> String {
    match &c.arbiter {
        Some(a) => {
            let mut cell = format!(
                "{} / {} (K {}) at {}",
                fmt_num(a.worst.run_to_f64),
                fmt_num(a.worst.reference_to_f64),
                a.constants.k,
                a.worst_at
            );
            if let Some(step) = a.unjudged_from {
                cell.push_str(&format!(
                    "; the fp32 reference left fp32's range at step {step}: not judged from there"
                ));
            }
            if !a.spread_from.is_empty() {
                cell.push_str(&format!(
                    "; noise measured on the reference and {}",
                    a.spread_from.join(", ")
                ));
            }
            if let Some(left) = &a.trajectory_left {
                cell.push_str(&format!(
                    "; judged step-locally (from the run's own state at every step): the \
                     trajectory left its envelope at {left}"
                ));
            }
            cell
        }
        None => "-".into(),
    }
}
