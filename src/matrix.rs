//! `lockstep matrix`: every (model × parallel configuration × world size) the tool knows, run
//! on the CPU backend and judged against its references, with one report set at the end.
//!
//! A configuration under test is compared against every reference that applies to it:
//!
//! - `ddp@N` against `single@N` (the single-device reference over the same global batch)
//!   under the fp32 dtype table, and against a second, freshly launched `ddp@N` in bitwise
//!   mode: the CPU backend reduces in rank order, so a repeat must be bit-identical;
//! - `single@N` against a repeat of itself in bitwise mode: a reference that is not
//!   deterministic would make every verdict against it meaningless;
//! - every FSDP configuration (`fsdp.full_shard`, `fsdp.shard_grad_op`, `fsdp.no_shard` as one
//!   root unit, `fsdp.full_shard.per_layer` with one unit per layer) against `ddp@N` in
//!   bitwise mode (FSDP's reduce-scatter yields exactly DDP's averaged gradients on the CPU
//!   backend) and against `single@N` under the fp32 dtype table.
//!
//! References are run whenever a selected configuration needs them, whether or not their own
//! configuration was selected. Models whose ranks differ by construction (per-rank experts,
//! BatchNorm statistics) have no single-device reference; their rows against it are skipped
//! with the model's own reason.
//!
//! Parallel runs are launched with [`RankSpawn::Fork`] (the process never touches CUDA), rank
//! 0 hands its [`RunRecord`] back through a temporary JSON file, and the single-device runs
//! happen in this process. Nothing is written until every run is done: a matrix whose runs
//! failed (as opposed to failing a parity check) writes no report at all, and stale report
//! files in the output directory are removed before the first run, so a `report.json` there
//! always belongs to one complete matrix.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, DdpOptions, Fault};
use lockstep_core::fsdp::{train_fsdp, FsdpOptions, ShardingStrategy, WrapPolicy};
use lockstep_core::record::{RunRecord, RunSpec};
use lockstep_core::train::{single_device_reference, OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{compare, Comparison, FailurePoint, TolerancePolicy};
use lockstep_harness::report::{self, Report, ReportError, ReportFiles};
use lockstep_harness::{launch, LaunchError, LaunchOptions, RankCtx, RankSpawn};
use lockstep_models::{zoo, Model, ModelError};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// World size when none is given: four ranks exercise uneven reduction trees while still
/// fitting a small machine.
pub const DEFAULT_WORLD_SIZE: usize = 4;

/// Ranks are processes on this host, each with a full mesh of TCP links to the others; past
/// this many the run measures the machine, not the parallelism.
pub const MAX_WORLD_SIZE: usize = 64;

/// How a row skipped for want of a single-device reference begins its note.
const NO_SINGLE: &str = "no single-device reference";

/// Where reports go unless `--out` says otherwise.
pub const DEFAULT_OUT_DIR: &str = "target/lockstep/matrix";

/// The files a matrix writes (and removes before running, so none is ever stale).
pub const REPORT_FILES: [&str; 4] = ["report.json", "report.md", "junit.xml", "report.html"];

/// Why a matrix could not be planned, run or written.
#[derive(Debug, thiserror::Error)]
pub enum MatrixError {
    /// A `--models` pattern matched no zoo model.
    #[error("unknown model `{pattern}`; known models: {}", known.join(", "))]
    UnknownModel { pattern: String, known: Vec<String> },
    /// A `--configs` pattern matched no configuration.
    #[error("unknown config `{pattern}`; known configs: {}", known.join(", "))]
    UnknownConfig { pattern: String, known: Vec<String> },
    /// A world size no run can use (0, too many ranks, or one the model rejects).
    #[error("invalid world size {world_size}: {reason}")]
    InvalidWorldSize { world_size: usize, reason: String },
    /// Any other option out of range.
    #[error("invalid option: {0}")]
    InvalidOption(String),
    /// The output directory cannot be created or written; checked before anything runs.
    #[error("output directory {}: {source}", path.display())]
    OutDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model could not be built while planning.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Writing the report set failed.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// Some runs failed (crashed, errored, timed out), so the report would be incomplete.
    #[error("{failed} of {total} runs failed; no report was written")]
    RunsFailed { failed: usize, total: usize },
}

/// A parallel configuration the matrix knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Config {
    /// One process, every rank's batch, mean of the per-rank losses.
    Single,
    /// DistributedDataParallel over the CPU backend.
    Ddp,
    /// FSDP, one root unit, parameters, gradients and optimizer state sharded (ZeRO-3).
    FsdpFullShard,
    /// FSDP, one root unit, full parameters kept from forward to backward (ZeRO-2-like).
    FsdpShardGradOp,
    /// FSDP, one root unit, nothing sharded (gradients all-reduced through FSDP's path).
    FsdpNoShard,
    /// FSDP full shard with one unit per layer (tied parameters stay in the root unit).
    FsdpFullShardPerLayer,
}

impl Config {
    /// Every configuration, in the order rows are listed.
    pub const ALL: [Config; 6] = [
        Config::Single,
        Config::Ddp,
        Config::FsdpFullShard,
        Config::FsdpShardGradOp,
        Config::FsdpNoShard,
        Config::FsdpFullShardPerLayer,
    ];

    /// The FSDP configurations, in row order.
    pub const FSDP: [Config; 4] = [
        Config::FsdpFullShard,
        Config::FsdpShardGradOp,
        Config::FsdpNoShard,
        Config::FsdpFullShardPerLayer,
    ];

    /// The name patterns and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Config::Single => "single",
            Config::Ddp => "ddp",
            Config::FsdpFullShard => "fsdp.full_shard",
            Config::FsdpShardGradOp => "fsdp.shard_grad_op",
            Config::FsdpNoShard => "fsdp.no_shard",
            Config::FsdpFullShardPerLayer => "fsdp.full_shard.per_layer",
        }
    }

    /// Whether this is one of the FSDP configurations.
    pub fn is_fsdp(self) -> bool {
        Config::FSDP.contains(&self)
    }

    /// The FSDP options this configuration runs with (`None` for single and DDP).
    pub fn fsdp_options(self) -> Option<FsdpOptions> {
        let (strategy, wrap) = match self {
            Config::Single | Config::Ddp => return None,
            Config::FsdpFullShard => (ShardingStrategy::FullShard, WrapPolicy::Root),
            Config::FsdpShardGradOp => (ShardingStrategy::ShardGradOp, WrapPolicy::Root),
            Config::FsdpNoShard => (ShardingStrategy::NoShard, WrapPolicy::Root),
            Config::FsdpFullShardPerLayer => (ShardingStrategy::FullShard, WrapPolicy::PerLayer),
        };
        Some(FsdpOptions {
            strategy,
            wrap,
            ..FsdpOptions::default()
        })
    }

    /// One line for `--list`.
    pub fn description(self) -> &'static str {
        match self {
            Config::Single => {
                "single-device reference: one process trains on every rank's batch (the global \
                 batch); checked against a repeat of itself, bitwise"
            }
            Config::Ddp => {
                "DDP on the CPU backend, one forked process per rank; checked against single \
                 (fp32 dtype table) and a fresh repeat of itself (bitwise)"
            }
            Config::FsdpFullShard => {
                "FSDP FULL_SHARD, the model as one root unit; checked against ddp (bitwise) \
                 and single (fp32 dtype table)"
            }
            Config::FsdpShardGradOp => {
                "FSDP SHARD_GRAD_OP, one root unit; checked against ddp (bitwise) and single \
                 (fp32 dtype table)"
            }
            Config::FsdpNoShard => {
                "FSDP NO_SHARD, one root unit; checked against ddp (bitwise) and single (fp32 \
                 dtype table)"
            }
            Config::FsdpFullShardPerLayer => {
                "FSDP FULL_SHARD, one unit per layer (tied parameters in the root); checked \
                 against ddp (bitwise) and single (fp32 dtype table)"
            }
        }
    }

    /// The row name at a world size (`ddp@4`): unique per world size in the report.
    pub fn at(self, world_size: usize) -> String {
        format!("{}@{world_size}", self.name())
    }

    /// Why this configuration cannot run `model`, if it cannot.
    fn blocker(self, model: &dyn Model) -> Option<String> {
        match self {
            Config::Single => model.single_device_reference_blocker(),
            _ => None,
        }
    }
}

/// What the user asked for; [`plan`] validates it.
#[derive(Clone, Debug)]
pub struct MatrixOptions {
    /// Model name patterns (exact or with `*`); empty means every zoo model.
    pub models: Vec<String>,
    /// Configuration name patterns; empty means every configuration.
    pub configs: Vec<String>,
    /// World sizes; empty means [`DEFAULT_WORLD_SIZE`].
    pub world_sizes: Vec<usize>,
    /// Training steps per run.
    pub steps: usize,
    /// The run seed every model and batch derives from.
    pub seed: u64,
    /// Longest one launch may take before it is declared hung.
    pub timeout: Duration,
    /// Record per-step gradients, so a failure names the first step and tensor that drifted
    /// (not just the final parameters).
    pub record_grads: bool,
    /// A bug planted in every DDP run, to show the matrix catches it (checker tests only).
    pub fault: Option<Fault>,
}

impl Default for MatrixOptions {
    fn default() -> Self {
        MatrixOptions {
            models: Vec::new(),
            configs: Vec::new(),
            world_sizes: Vec::new(),
            steps: 5,
            seed: 0,
            timeout: Duration::from_secs(300),
            record_grads: true,
            fault: None,
        }
    }
}

/// A validated matrix: what will run, in order.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Selected zoo models, in zoo order.
    pub models: Vec<String>,
    /// Selected configurations under test, in [`Config::ALL`] order.
    pub configs: Vec<Config>,
    /// World sizes, in the order given (duplicates dropped).
    pub world_sizes: Vec<usize>,
    /// Steps per run.
    pub steps: usize,
    /// Run seed.
    pub seed: u64,
    /// Per-launch timeout.
    pub timeout: Duration,
    /// Whether runs record per-step gradients.
    pub record_grads: bool,
    /// The planted bug every DDP run carries, if any.
    pub fault: Option<Fault>,
    /// Per model: why it has no single-device reference, if it has none.
    blockers: Vec<Option<String>>,
}

impl Plan {
    /// How many training runs the plan performs (single-device ones included).
    pub fn run_count(&self) -> usize {
        let mut n = 0;
        for blocker in &self.blockers {
            for _ in &self.world_sizes {
                let (singles, ddps) = self.runs_per_cell(blocker.is_none());
                n += singles + ddps + self.fsdp_runs_per_cell();
            }
        }
        n
    }

    /// (single-device runs, DDP launches) for one model at one world size. FSDP launches
    /// come on top, one per selected FSDP configuration.
    fn runs_per_cell(&self, has_single: bool) -> (usize, usize) {
        let single = self.configs.contains(&Config::Single);
        let ddp = self.configs.contains(&Config::Ddp);
        let fsdp = self.configs.iter().any(|c| c.is_fsdp());
        let singles = match (has_single, single, ddp || fsdp) {
            (false, _, _) => 0,
            (true, true, _) => 2,
            (true, false, true) => 1,
            (true, false, false) => 0,
        };
        // DDP checks itself against a repeat; FSDP needs one DDP run as its reference.
        let ddps = match (ddp, fsdp) {
            (true, _) => 2,
            (false, true) => 1,
            (false, false) => 0,
        };
        (singles, ddps)
    }

    /// FSDP launches per model and world size.
    fn fsdp_runs_per_cell(&self) -> usize {
        self.configs.iter().filter(|c| c.is_fsdp()).count()
    }
}

/// Whether `name` matches `pattern`: exact, or with `*` standing for any run of characters
/// (`ddp*`, `*moe`, `*`).
pub fn matches(pattern: &str, name: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == name;
    };
    let Some(mut tail) = name.strip_prefix(head) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    let Some((last, middle)) = parts.split_last() else {
        return true;
    };
    for part in middle {
        match tail.find(part) {
            Some(i) => tail = &tail[i + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

/// The items of `known` selected by `patterns` (all of them for no pattern), in `known`'s
/// order; the first pattern that selects nothing is returned as the error.
fn select<'a>(patterns: &[String], known: &[&'a str]) -> Result<Vec<&'a str>, String> {
    let patterns: Vec<&str> = patterns
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if patterns.is_empty() {
        return Ok(known.to_vec());
    }
    for p in &patterns {
        if !known.iter().any(|k| matches(p, k)) {
            return Err((*p).to_owned());
        }
    }
    Ok(known
        .iter()
        .copied()
        .filter(|k| patterns.iter().any(|p| matches(p, k)))
        .collect())
}

/// Validates `opts` against the zoo: names, world sizes and steps. Builds each selected model
/// once (to learn whether it has a single-device reference and that it accepts the largest
/// rank of every world size); runs nothing.
pub fn plan(opts: &MatrixOptions) -> Result<Plan, MatrixError> {
    let zoo_names = zoo::names();
    let models = select(&opts.models, &zoo_names).map_err(|pattern| MatrixError::UnknownModel {
        pattern,
        known: zoo_names.iter().map(|s| (*s).to_owned()).collect(),
    })?;
    let config_names: Vec<&str> = Config::ALL.iter().map(|c| c.name()).collect();
    let selected =
        select(&opts.configs, &config_names).map_err(|pattern| MatrixError::UnknownConfig {
            pattern,
            known: config_names.iter().map(|s| (*s).to_owned()).collect(),
        })?;
    let configs: Vec<Config> = Config::ALL
        .into_iter()
        .filter(|c| selected.contains(&c.name()))
        .collect();
    let mut world_sizes = Vec::new();
    for &w in if opts.world_sizes.is_empty() {
        &[DEFAULT_WORLD_SIZE][..]
    } else {
        &opts.world_sizes[..]
    } {
        if w == 0 {
            return Err(MatrixError::InvalidWorldSize {
                world_size: 0,
                reason: "a run needs at least one rank".into(),
            });
        }
        if w > MAX_WORLD_SIZE {
            return Err(MatrixError::InvalidWorldSize {
                world_size: w,
                reason: format!(
                    "ranks are processes on this host; at most {MAX_WORLD_SIZE} are supported"
                ),
            });
        }
        if !world_sizes.contains(&w) {
            world_sizes.push(w);
        }
    }
    if opts.steps == 0 {
        return Err(MatrixError::InvalidOption(
            "--steps must be at least 1".into(),
        ));
    }
    if opts.timeout.is_zero() {
        return Err(MatrixError::InvalidOption(
            "--timeout must be positive".into(),
        ));
    }
    let mut blockers = Vec::with_capacity(models.len());
    for name in &models {
        let model = zoo::build(name, opts.seed, 0)?;
        for &w in &world_sizes {
            // Every rank of the run must get a batch; a model that cannot serve rank w-1
            // cannot run at world size w.
            let last = zoo::build(name, opts.seed, w - 1)?;
            if let Err(e) = last.input(w - 1, 0) {
                return Err(MatrixError::InvalidWorldSize {
                    world_size: w,
                    reason: format!("model `{name}` cannot run on {w} ranks: {e}"),
                });
            }
        }
        blockers.push(Config::Single.blocker(model.as_ref()));
    }
    Ok(Plan {
        models: models.into_iter().map(str::to_owned).collect(),
        configs,
        world_sizes,
        steps: opts.steps,
        seed: opts.seed,
        timeout: opts.timeout,
        record_grads: opts.record_grads,
        fault: opts.fault.clone(),
        blockers,
    })
}

/// Creates `dir` and proves it writable with a probe file, before any run starts, and
/// removes report files a previous matrix left there (so none can pass for this run's).
pub fn prepare_out_dir(dir: &Path) -> Result<(), MatrixError> {
    let err = |source| MatrixError::OutDir {
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
    fn label(self) -> &'static str {
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
    /// `tolerance` or `bitwise`.
    pub mode: &'static str,
    /// Largest absolute error over every compared quantity.
    #[serde(with = "report::num::opt")]
    pub max_abs_err: Option<f64>,
    /// Largest ULP distance over every compared quantity.
    pub max_ulp: Option<u64>,
    /// Largest error / allowed error (at most 1 passes).
    #[serde(with = "report::num::opt")]
    pub margin: Option<f64>,
    /// Where it first failed, why it was skipped, or why a run failed.
    pub note: Option<String>,
}

/// Everything a finished matrix produced.
#[derive(Debug)]
pub struct MatrixResult {
    /// One row per model × config × reference × world size, in run order.
    pub rows: Vec<Row>,
    /// The comparisons behind the `Pass`/`Fail` rows, in row order.
    pub comparisons: Vec<Comparison>,
    /// Training runs performed (single-device and DDP launches).
    pub runs: usize,
    /// Runs that failed.
    pub failed_runs: usize,
    /// Measured wall time of the whole matrix.
    pub elapsed: Duration,
}

impl MatrixResult {
    /// Whether every run completed and every comparison passed.
    pub fn passed(&self) -> bool {
        self.failed_runs == 0 && self.rows.iter().all(|r| r.status != RowStatus::Fail)
    }

    /// The report over every comparison, with the matrix's wall time. `Err` when some runs
    /// failed: a report missing their rows would look complete, so none is produced.
    pub fn report(&self) -> Result<Report, MatrixError> {
        if self.failed_runs > 0 {
            return Err(MatrixError::RunsFailed {
                failed: self.failed_runs,
                total: self.runs,
            });
        }
        Ok(Report::new(self.comparisons.clone()).with_wall_time(self.elapsed))
    }

    /// Writes the report set (`report.json` last) into `dir`; see [`MatrixResult::report`].
    pub fn write_report(&self, dir: &Path) -> Result<ReportFiles, MatrixError> {
        Ok(report::write_all(&self.report()?, dir)?)
    }

    /// The summary table, followed by the diagnosis of every failed row and the total time.
    pub fn render_table(&self) -> String {
        let headers = [
            "model",
            "config",
            "reference",
            "world",
            "result",
            "max abs err",
            "max ULP",
            "margin",
            "first failure / note",
        ];
        let cells: Vec<[String; 9]> = self
            .rows
            .iter()
            .map(|r| {
                [
                    r.model.clone(),
                    r.config.clone(),
                    r.reference.clone(),
                    r.world_size.to_string(),
                    r.status.label().to_owned(),
                    r.max_abs_err.map_or("-".into(), fmt_num),
                    r.max_ulp.map_or("-".into(), fmt_ulp),
                    r.margin.map_or("-".into(), fmt_num),
                    match (&r.status, &r.note) {
                        // The model's reason is a sentence: printed once below the table.
                        (RowStatus::Skip, Some(n)) if n.starts_with(NO_SINGLE) => {
                            format!("{NO_SINGLE} (see below)")
                        }
                        (_, note) => note.clone().unwrap_or_default(),
                    },
                ]
            })
            .collect();
        let mut widths = headers.map(str::len);
        for row in &cells {
            for (w, c) in widths.iter_mut().zip(row.iter()).take(8) {
                *w = (*w).max(c.chars().count());
            }
        }
        let mut out = String::new();
        let line = |out: &mut String, row: &[&str]| {
            let mut text = String::new();
            for (i, cell) in row.iter().enumerate() {
                if i == 8 {
                    text.push_str(cell);
                } else if (3..8).contains(&i) && i != 4 {
                    let _ = write!(text, "{cell:>w$}  ", w = widths[i]);
                } else {
                    let _ = write!(text, "{cell:<w$}  ", w = widths[i]);
                }
            }
            out.push_str(text.trim_end());
            out.push('\n');
        };
        line(&mut out, &headers);
        for row in &cells {
            let refs: Vec<&str> = row.iter().map(String::as_str).collect();
            line(&mut out, &refs);
        }
        let mut explained: Vec<&str> = Vec::new();
        for r in &self.rows {
            if let (RowStatus::Skip, Some(note)) = (r.status, &r.note) {
                if note.starts_with(NO_SINGLE) && !explained.contains(&r.model.as_str()) {
                    explained.push(&r.model);
                    let _ = writeln!(out, "\nskipped: model `{}` has {note}", r.model);
                }
            }
        }
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
        let skipped = self
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Skip)
            .count();
        let _ = writeln!(
            out,
            "\n{passed} passed, {failed} failed, {skipped} skipped, {} run errors",
            self.failed_runs
        );
        let _ = writeln!(
            out,
            "matrix: {} runs in {:.1} s",
            self.runs,
            self.elapsed.as_secs_f64()
        );
        out
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

/// A short "where" for the table: quantity, tensor and step of the first failure.
fn short_failure(f: &FailurePoint) -> String {
    let mut s = f.quantity.to_string();
    if let Some(t) = &f.tensor {
        let _ = write!(s, " {t}");
    }
    if let Some(i) = f.index {
        let _ = write!(s, "[{i}]");
    }
    match f.step {
        Some(step) => {
            let _ = write!(s, " @ step {step}");
        }
        None => s.push_str(" (final)"),
    }
    s
}

/// The progress bar the CLI shows on stderr: drawn only on a terminal and only from this
/// thread (no ticker thread, so a forked rank never inherits a lock held by one).
pub fn progress_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed:>4} [{bar:30.cyan/blue}] {pos}/{len} runs  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Tracks runs for the progress display; prints one line per run when stderr is no
/// terminal (CI logs), where the bar is hidden.
struct Progress<'a> {
    bar: &'a ProgressBar,
    done: usize,
    total: usize,
}

impl Progress<'_> {
    fn start(&self, label: &str) {
        self.bar.set_message(label.to_owned());
    }

    fn finish(&mut self, label: &str, took: Duration, error: Option<&str>) {
        self.done += 1;
        self.bar.inc(1);
        if self.bar.is_hidden() {
            let status = error.map_or("ok".to_owned(), |e| format!("FAILED: {e}"));
            eprintln!(
                "[{}/{}] {label}: {:.2} s {status}",
                self.done,
                self.total,
                took.as_secs_f64()
            );
        }
    }
}

/// Runs the plan: per model and world size the single-device reference (in process) and two
/// fresh DDP launches as the selected configurations need, then the comparisons. Run
/// failures become `Error` rows; the matrix always finishes.
///
/// libtorch is set to one intra-op thread in this process: forked ranks must not inherit an
/// OpenMP pool, and the zoo's models are too small to gain from more.
pub fn run(plan: &Plan, bar: &ProgressBar) -> MatrixResult {
    tch::set_num_threads(1);
    let started = Instant::now();
    let mut progress = Progress {
        bar,
        done: 0,
        total: plan.run_count(),
    };
    let mut result = MatrixResult {
        rows: Vec::new(),
        comparisons: Vec::new(),
        runs: 0,
        failed_runs: 0,
        elapsed: Duration::ZERO,
    };
    let tolerance = TolerancePolicy::dtype_table(DType::F32);
    let bitwise = TolerancePolicy::bitwise(DType::F32);
    for (model, blocker) in plan.models.iter().zip(&plan.blockers) {
        for &world in &plan.world_sizes {
            let (singles, ddps) = plan.runs_per_cell(blocker.is_none());
            let mut run_one = |config: Config, attempt: usize, of: usize| {
                let label = if of > 1 {
                    format!("{model} {} (run {attempt}/{of})", config.at(world))
                } else {
                    format!("{model} {}", config.at(world))
                };
                progress.start(&label);
                let t0 = Instant::now();
                let outcome = match config {
                    Config::Single => run_single(model, world, plan),
                    _ => run_parallel(model, config, world, plan),
                };
                result.runs += 1;
                let err = outcome.as_ref().err().map(String::as_str);
                if err.is_some() {
                    result.failed_runs += 1;
                }
                progress.finish(&label, t0.elapsed(), err);
                outcome
            };
            let single: Vec<Result<RunRecord, String>> = (1..=singles)
                .map(|i| run_one(Config::Single, i, singles))
                .collect();
            let ddp: Vec<Result<RunRecord, String>> =
                (1..=ddps).map(|i| run_one(Config::Ddp, i, ddps)).collect();
            let fsdp: Vec<(Config, Result<RunRecord, String>)> = plan
                .configs
                .iter()
                .filter(|c| c.is_fsdp())
                .map(|&c| (c, run_one(c, 1, 1)))
                .collect();
            let mut row = |config: Config,
                           reference: Config,
                           policy: &TolerancePolicy,
                           run: Option<&Result<RunRecord, String>>,
                           against: Option<&Result<RunRecord, String>>| {
                let mut r = Row {
                    model: model.clone(),
                    config: config.at(world),
                    reference: reference.at(world),
                    world_size: world,
                    status: RowStatus::Skip,
                    mode: match policy.mode() {
                        lockstep_harness::parity::Mode::Tolerance => "tolerance",
                        lockstep_harness::parity::Mode::Bitwise => "bitwise",
                    },
                    max_abs_err: None,
                    max_ulp: None,
                    margin: None,
                    note: None,
                };
                match (run, against) {
                    (Some(Ok(a)), Some(Ok(b))) => {
                        let c = compare(a, b, policy);
                        let overall = c.overall();
                        r.status = if c.passed {
                            RowStatus::Pass
                        } else {
                            RowStatus::Fail
                        };
                        r.max_abs_err = Some(overall.max_abs_err);
                        r.max_ulp = Some(overall.max_ulp);
                        r.margin = Some(overall.margin);
                        r.note = match (&c.first_failure, c.structural.first()) {
                            (Some(f), _) => Some(short_failure(f)),
                            (None, Some(s)) => Some(s.clone()),
                            (None, None) => None,
                        };
                        result.comparisons.push(c);
                    }
                    (Some(Err(e)), _) | (_, Some(Err(e))) => {
                        r.status = RowStatus::Error;
                        r.note = Some(e.clone());
                    }
                    _ => {
                        r.note = Some(match blocker {
                            Some(reason) => format!("{NO_SINGLE}: {reason}"),
                            None => "not run".into(),
                        });
                    }
                }
                result.rows.push(r);
            };
            if plan.configs.contains(&Config::Single) {
                row(
                    Config::Single,
                    Config::Single,
                    &bitwise,
                    single.first(),
                    single.get(1),
                );
            }
            if plan.configs.contains(&Config::Ddp) {
                row(
                    Config::Ddp,
                    Config::Single,
                    &tolerance,
                    ddp.first(),
                    single.first(),
                );
                row(Config::Ddp, Config::Ddp, &bitwise, ddp.first(), ddp.get(1));
            }
            for (config, run) in &fsdp {
                row(*config, Config::Ddp, &bitwise, Some(run), ddp.first());
                row(
                    *config,
                    Config::Single,
                    &tolerance,
                    Some(run),
                    single.first(),
                );
            }
        }
    }
    bar.finish_and_clear();
    result.elapsed = started.elapsed();
    result
}

fn spec(model: &str, config: Config, world_size: usize, plan: &Plan) -> RunSpec {
    RunSpec {
        model: model.to_owned(),
        config: config.at(world_size),
        world_size,
        backend: match config {
            Config::Single => "none".into(),
            _ => "cpu".into(),
        },
        dtype: "fp32".into(),
        steps: plan.steps,
        seed: plan.seed,
    }
}

/// The single-device reference over `world_size` ranks' batches, in this process.
fn run_single(model: &str, world_size: usize, plan: &Plan) -> Result<RunRecord, String> {
    let built = zoo::build(model, plan.seed, 0).map_err(|e| e.to_string())?;
    let mut record = single_device_reference(
        built.as_ref(),
        world_size,
        plan.steps,
        OptimizerConfig::default(),
        plan.record_grads,
    )
    .map_err(|e| format!("single-device reference: {e}"))?;
    record.spec = spec(model, Config::Single, world_size, plan);
    Ok(record)
}

/// One fresh DDP or FSDP launch; rank 0's record comes back through a temporary JSON file.
/// The planted fault (if any) goes into DDP runs only: FSDP runs are checked against DDP.
fn run_parallel(
    model: &str,
    config: Config,
    world_size: usize,
    plan: &Plan,
) -> Result<RunRecord, String> {
    let out = scratch_path(model, world_size);
    let cfg_spec = spec(model, config, world_size, plan);
    let body = |ctx: &RankCtx| -> Result<(), String> {
        let rank = ctx.rank();
        let built = zoo::build(model, plan.seed, rank).map_err(|e| e.to_string())?;
        let cfg = TrainConfig {
            spec: cfg_spec.clone(),
            optimizer: OptimizerConfig::default(),
            data_ranks: vec![rank],
            record_grads: plan.record_grads,
        };
        let record = match config.fsdp_options() {
            Some(opts) => train_fsdp(built.as_ref(), ctx.group(), &cfg, opts)
                .map_err(|e| format!("{}: {e}", config.name()))?,
            None => {
                let opts = DdpOptions {
                    fault: plan.fault.clone(),
                    ..DdpOptions::default()
                };
                train_ddp(built.as_ref(), ctx.group(), &cfg, opts)
                    .map_err(|e| format!("ddp: {e}"))?
            }
        };
        if rank == 0 {
            let json = serde_json::to_vec(&record).map_err(|e| format!("encoding record: {e}"))?;
            std::fs::write(&out, json)
                .map_err(|e| format!("writing the record to {}: {e}", out.display()))?;
        }
        Ok(())
    };
    let opts = LaunchOptions {
        world_size,
        timeout: plan.timeout,
        backend: "cpu".into(),
    };
    let launched = launch(
        &opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, &body)),
    );
    let read = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    launched.map_err(|e: LaunchError| one_line(&e.to_string()))?;
    let bytes = read.map_err(|e| format!("reading rank 0's record: {e}"))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        format!("rank 0's record is unreadable ({e}); a non-finite value (a diverged run) cannot be carried in RunRecord JSON")
    })
}

/// The launcher's failure report runs over many lines; the table gets its first one and the
/// first line naming a rank's message.
fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("launch failed").to_owned();
    match lines.find(|l| l.contains("failed") || l.contains("error")) {
        Some(detail) if detail != first => format!("{first} {detail}"),
        _ => first,
    }
}

fn scratch_path(model: &str, world_size: usize) -> PathBuf {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "lockstep-matrix-{}-{model}-{world_size}-{nonce:x}.json",
        std::process::id()
    ))
}

/// The `--list` text: every configuration with the models it applies to, then the models.
pub fn render_list(seed: u64) -> Result<String, MatrixError> {
    let mut models = Vec::new();
    for name in zoo::names() {
        let m = zoo::build(name, seed, 0)?;
        models.push((
            name,
            m.num_parameters(),
            m.single_device_reference_blocker(),
        ));
    }
    let mut out = String::from("configs:\n");
    for c in Config::ALL {
        let applies: Vec<&str> = models
            .iter()
            .filter(|(_, _, blocker)| c != Config::Single || blocker.is_none())
            .map(|(n, _, _)| *n)
            .collect();
        let _ = writeln!(out, "  {:<27}{}", c.name(), c.description());
        let _ = writeln!(out, "  {:<27}models: {}", "", applies.join(", "));
    }
    out.push_str("models:\n");
    for (name, params, blocker) in &models {
        let note = match blocker {
            None => "single + ddp + fsdp".to_owned(),
            Some(reason) => format!("ddp + fsdp only (no single-device reference: {reason})"),
        };
        let _ = writeln!(out, "  {name:<16}{params:>8} params  {note}");
    }
    Ok(out)
}
