//! Sensitivity analysis: proof that a parity test can fail. A dry run records every collective
//! call of the configuration under test; then, one run per site and fault, one call on one
//! rank is corrupted ([`lockstep_core::comm::FaultyGroup`]) and the run is judged exactly as
//! the test judges it. A fault the verdict does not notice is a *miss*: a bug of that shape at
//! that place would pass the test.
//!
//! Sites are `(step, call index, rank)` (see [`lockstep_core::comm::faulty`]). The analysis
//! takes the calls of the steps in [`SensitivityOptions::site_steps`] (step 0, where the
//! parameters are broadcast and the first gradients reduced, and step 1, where stale results
//! of step 0 exist), and on each rank: every point-to-point call, and every collective of
//! which the rank is the group's first or last member. Faults act on one rank's local result,
//! and a group's first and last members bracket the two positions a rank-order reduction
//! treats differently; the ranks in between would repeat them at the cost of a run each.
//!
//! Verdicts: *caught* (the comparison failed), *error* and *hang* (the run failed or outlived
//! the short per-run timeout: also caught, with the reason), *missed* (every check passed
//! though some rank trained to other bits), *inert* (every check passed and every rank
//! trained to the bits of the run without the fault: the fault touched nothing the training
//! depends on, judged by a hash of each rank's final parameters and buffers), *n/a* (the fault cannot
//! apply to the call: an all-reduce has no peer to mistake), *same* (it applied and changed no
//! bit: doubling zeros), and *moved* (the faulted run did not issue the recorded call at that
//! site: the call order is not deterministic, which is itself worth knowing). For
//! [`FaultKind::Perturb`] the analysis bisects ε over the decades 1e-1 … 1e-8 and reports
//! the smallest caught.

mod render;

use crate::runner::faults::read_logs;
use crate::runner::FaultPlan;
use crate::runner::RecordResult;
use crate::runner::{PlantedFault, RunFailed, RunSettings};
use indicatif::ProgressBar;
use lockstep_core::comm::{applicability, CallRecord, FaultKind, FaultLog, FaultMode, Injection};
use lockstep_core::field_bugs::FieldBug;
use lockstep_core::record::RunRecord;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The ε decades a perturbation is bisected over, largest first.
pub const PERTURB_DECADES: [f64; 8] = [1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8];

/// Why an analysis could not run (nothing was judged).
#[derive(Debug, thiserror::Error)]
pub enum SensitivityError {
    /// An option out of range or inconsistent.
    #[error("invalid option: {0}")]
    Invalid(String),
    /// The matrix could not plan the configuration.
    #[error(transparent)]
    Matrix(#[from] crate::matrix::MatrixError),
    /// The configuration cannot run where asked (the matrix skips it there).
    #[error("{config} does not run on {model} at world size {world_size}: {reason}")]
    NotRunnable {
        /// The configuration.
        config: String,
        /// The model.
        model: String,
        /// The world size.
        world_size: usize,
        /// The matrix's reason.
        reason: String,
    },
    /// The dry run (no fault) failed, so there are no sites.
    #[error("the run without a fault failed: {0}")]
    RecordRun(String),
    /// The configuration fails its checks without any fault: nothing can be learned from
    /// faults until it passes.
    #[error(
        "{config} fails its parity check without a fault, so no fault can be judged: {reason}"
    )]
    FailsWithoutFault {
        /// The configuration.
        config: String,
        /// The failing check.
        reason: String,
    },
    /// A directory or file could not be created or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The path.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
}

/// What the analysis tries.
#[derive(Clone, Debug)]
pub struct SensitivityOptions {
    /// Faults tried at every site; a [`FaultKind::Perturb`] entry (whatever its ε) means
    /// "bisect ε over [`PERTURB_DECADES`]".
    pub kinds: Vec<FaultKind>,
    /// Steps whose calls are sites; steps the run does not have are dropped.
    pub site_steps: Vec<usize>,
    /// How long one faulted run may take before it counts as a hang (short: a fault that
    /// hangs should cost little).
    pub timeout: Duration,
}

impl Default for SensitivityOptions {
    fn default() -> Self {
        SensitivityOptions {
            kinds: FaultKind::all(1e-3),
            site_steps: vec![0, 1],
            timeout: Duration::from_secs(20),
        }
    }
}

impl SensitivityOptions {
    /// Only the math-changing faults ([`FaultKind::MATH_CHANGING`]) at step 0's sites: what
    /// `lockstep matrix --sensitivity` asserts.
    pub fn math_changing() -> Self {
        SensitivityOptions {
            kinds: FaultKind::MATH_CHANGING.to_vec(),
            site_steps: vec![0],
            ..Self::default()
        }
    }
}

/// How the test under analysis judged one run.
#[derive(Clone, Debug)]
pub enum Judgement {
    /// Every check passed.
    Passed,
    /// A check failed: which, and its first failure.
    Failed(String),
    /// The run failed (an error, a crash, a hang).
    RunFailed(RunFailed),
}

/// The configuration under analysis, as its test sees it: how it runs (with the settings the
/// analysis chooses, a fault plan among them) and how a run of it is judged.
pub trait Subject {
    /// The configuration's name, for the report.
    fn config(&self) -> String;
    /// The model's name, for the report.
    fn model(&self) -> String;
    /// Ranks of a run.
    fn world_size(&self) -> usize;
    /// The settings every run shares (the analysis adds the fault plan and its timeout).
    fn settings(&self) -> RunSettings;
    /// One run of the configuration under `settings`.
    fn run(&self, settings: &RunSettings) -> Result<RunRecord, RunFailed>;
    /// The test's verdict on `run` (against the references the subject holds).
    fn judge(&self, run: &Result<RunRecord, RunFailed>) -> Judgement;
    /// Whether the configuration trains through Lockstep's own model-splitting loops in
    /// forked ranks, where [`FieldBug`]s can be planted (a built-in TP, EP, CP or composed
    /// configuration). Others are not tried with them.
    fn plants_field_bugs(&self) -> bool {
        false
    }
}

/// One fault's fate at one site.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    /// The comparison failed: the first failing check.
    Caught {
        /// Which check failed, and where first.
        by: String,
    },
    /// The run failed (a rank's error or crash): caught.
    Error {
        /// The launcher's first line.
        reason: String,
    },
    /// The run outlived the per-run timeout: caught.
    Hang {
        /// The launcher's first line.
        reason: String,
    },
    /// Every check passed with the fault in place, and the training ended differently: the
    /// ranks in `diverged` trained to other bits than without the fault.
    Missed {
        /// What the fault did.
        detail: String,
        /// The ranks whose final state (parameters and buffers in their own record) differs
        /// from the run without a fault. Without rank 0, only a comparison of the ranks'
        /// states with each other can see it.
        diverged: Vec<usize>,
    },
    /// Every check passed, and the training did not change: every rank ended with the bits
    /// of the run without a fault. The fault altered only something the training does not
    /// depend on (a loss only the faulted rank's own record reads, a broadcast value the rank
    /// then discards for its shard).
    Inert {
        /// What the fault did.
        detail: String,
    },
    /// The fault cannot apply to this call.
    NotApplicable {
        /// Why.
        reason: String,
    },
    /// The fault applied and changed no bit.
    Same,
    /// The faulted run did not issue the recorded call at this site.
    Moved {
        /// What it issued instead, or that the site never came.
        detail: String,
    },
}

impl Verdict {
    /// Whether the test noticed (a failed check, an error or a hang).
    pub fn caught(&self) -> bool {
        matches!(
            self,
            Verdict::Caught { .. } | Verdict::Error { .. } | Verdict::Hang { .. }
        )
    }

    /// The table cell.
    pub fn cell(&self) -> &'static str {
        match self {
            Verdict::Caught { .. } => "caught",
            Verdict::Error { .. } => "error",
            Verdict::Hang { .. } => "hang",
            Verdict::Missed { .. } => "MISSED",
            Verdict::Inert { .. } => "inert",
            Verdict::NotApplicable { .. } => "n/a",
            Verdict::Same => "same",
            Verdict::Moved { .. } => "MOVED",
        }
    }
}

/// One fault tried at one site.
#[derive(Clone, Debug, Serialize)]
pub struct FaultResult {
    /// The kind's name (`skip`, `perturb`, …).
    pub fault: &'static str,
    /// Its fate; for a perturbation, at the smallest ε caught (or at 1e-1 when none was).
    #[serde(flatten)]
    pub verdict: Verdict,
    /// For a perturbation: the smallest ε of [`PERTURB_DECADES`] caught, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smallest_eps_caught: Option<f64>,
    /// For a perturbation: every ε tried, with its verdict's cell.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tried: Vec<(f64, &'static str)>,
}

/// Every fault tried at one site.
#[derive(Clone, Debug, Serialize)]
pub struct SiteResult {
    /// The recorded call at the site.
    pub site: CallRecord,
    /// One per fault kind, in the options' order.
    pub faults: Vec<FaultResult>,
}

/// A published bug's mechanism planted in the configuration's own loops (docs/bugs.md).
#[derive(Clone, Debug, Serialize)]
pub struct FieldBugResult {
    /// The bug's name (as `matrix --fault` takes it).
    pub bug: &'static str,
    /// Its fate: caught, missed, or not applicable (every rank trained to the bits of the
    /// run without it and the check passed: the configuration does not run that code).
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// A finished analysis of one configuration.
#[derive(Clone, Debug, Serialize)]
pub struct SensitivityReport {
    /// The model.
    pub model: String,
    /// The configuration under analysis.
    pub config: String,
    /// Ranks.
    pub world_size: usize,
    /// Training steps per run.
    pub steps: usize,
    /// Steps whose calls were sites.
    pub site_steps: Vec<usize>,
    /// Calls the dry run recorded over every rank and step.
    pub calls_recorded: usize,
    /// The sites analysed, in (step, rank, index) order.
    pub sites: Vec<SiteResult>,
    /// Runs performed (the dry run included).
    pub runs: usize,
    /// Measured wall time of the analysis.
    pub wall_time_seconds: f64,
    /// Anything the reader must know to read the table (a clock that never ticked).
    pub notes: Vec<String>,
    /// Each [`FieldBug`] planted in the configuration's own loops, where it can be
    /// ([`Subject::plants_field_bugs`]); empty otherwise.
    pub field_bugs: Vec<FieldBugResult>,
}

/// A miss: a fault at a site the test did not notice.
#[derive(Clone, Debug)]
pub struct Miss<'a> {
    /// The site.
    pub site: &'a CallRecord,
    /// The fault.
    pub fault: &'static str,
    /// What happened.
    pub verdict: &'a Verdict,
}

impl SensitivityReport {
    /// The field bugs planted and missed.
    pub fn field_bugs_missed(&self) -> Vec<&FieldBugResult> {
        self.field_bugs
            .iter()
            .filter(|b| matches!(b.verdict, Verdict::Missed { .. }))
            .collect()
    }

    /// Every site × fault whose verdict is missed (or moved, which means the fault could not
    /// be placed), the math-changing kinds only when `math_only`. Inert faults (the training
    /// ended with the same bits) are not misses: [`SensitivityReport::inert`] lists them.
    pub fn misses(&self, math_only: bool) -> Vec<Miss<'_>> {
        let math = |label: &str| FaultKind::MATH_CHANGING.iter().any(|k| k.label() == label);
        self.sites
            .iter()
            .flat_map(|s| s.faults.iter().map(move |f| (s, f)))
            .filter(|(_, f)| matches!(f.verdict, Verdict::Missed { .. } | Verdict::Moved { .. }))
            .filter(|(_, f)| !math_only || math(f.fault))
            .map(|(s, f)| Miss {
                site: &s.site,
                fault: f.fault,
                verdict: &f.verdict,
            })
            .collect()
    }

    /// Every site × fault that passed every check without changing the training's outcome.
    pub fn inert(&self) -> Vec<Miss<'_>> {
        self.sites
            .iter()
            .flat_map(|s| s.faults.iter().map(move |f| (s, f)))
            .filter(|(_, f)| matches!(f.verdict, Verdict::Inert { .. }))
            .map(|(s, f)| Miss {
                site: &s.site,
                fault: f.fault,
                verdict: &f.verdict,
            })
            .collect()
    }

    /// Writes `sensitivity.json` and `sensitivity.md` (the table) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), SensitivityError> {
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| SensitivityError::Io { path, source }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let json = serde_json::to_vec_pretty(self).map_err(|e| SensitivityError::Io {
            path: dir.join("sensitivity.json"),
            source: std::io::Error::other(e),
        })?;
        let path = dir.join("sensitivity.json");
        std::fs::write(&path, json).map_err(io(&path))?;
        let path = dir.join("sensitivity.md");
        std::fs::write(&path, format!("```text\n{self}```\n")).map_err(io(&path))
    }
}

/// Runs the analysis of `subject`: the dry run, then every site × fault, showing progress on
/// `bar`. Errors when the dry run fails or its run fails the test's checks.
pub fn analyse(
    subject: &dyn Subject,
    opts: &SensitivityOptions,
    bar: &ProgressBar,
) -> Result<SensitivityReport, SensitivityError> {
    if opts.kinds.is_empty() {
        return Err(SensitivityError::Invalid("no fault kind to try".into()));
    }
    let started = Instant::now();
    let logs = LogDir::new()?;
    let base = subject.settings();
    let mut runner = FaultRunner {
        subject,
        clean: Vec::new(),
        base: &base,
        logs: &logs,
        timeout: opts.timeout,
        runs: 0,
        bar,
    };
    bar.set_message(format!("{} dry run", subject.config()));
    let (calls, clean) = runner.record()?;
    if let Judgement::Failed(reason) | Judgement::RunFailed(RunFailed { line: reason, .. }) =
        subject.judge(&clean)
    {
        return Err(SensitivityError::FailsWithoutFault {
            config: subject.config(),
            reason,
        });
    }
    if calls.iter().all(Vec::is_empty) {
        return Err(SensitivityError::Invalid(format!(
            "{} made no collective call: a configuration that runs in one process has \
             nothing to corrupt",
            subject.config()
        )));
    }
    let steps = base.steps;
    let site_steps: Vec<usize> = opts
        .site_steps
        .iter()
        .copied()
        .filter(|&s| s < steps)
        .collect();
    let sites = select_sites(&calls, &site_steps);
    let mut notes = Vec::new();
    if steps > 1 && calls.iter().flatten().all(|c| c.step == 0) {
        notes.push(
            "the training loop never ticked the step clock (StateProbe::start_step): every \
             call of the run is numbered in step 0, so the sites are the whole run's"
                .to_owned(),
        );
    }
    let per_site = opts.kinds.len() + usize::from(has_perturb(opts)) * 3;
    let field_bugs: &[FieldBug] = match subject.plants_field_bugs() {
        true => &FieldBug::ALL,
        false => &[],
    };
    bar.set_length((sites.len() * per_site + field_bugs.len() + 1) as u64);
    bar.set_position(1);
    let mut results = Vec::with_capacity(sites.len());
    for (rank, at) in sites {
        let call = &calls[rank][at];
        bar.set_message(format!("{} {}", call.site(), call.describe()));
        let earlier = &calls[rank][..at];
        let faults = opts
            .kinds
            .iter()
            .map(|&kind| runner.try_fault(call, earlier, kind))
            .collect();
        results.push(SiteResult {
            site: call.clone(),
            faults,
        });
    }
    let field_bugs = field_bugs
        .iter()
        .map(|&bug| {
            bar.set_message(format!("{} with {}", subject.config(), bug.name()));
            runner.field_bug(bug)
        })
        .collect();
    Ok(SensitivityReport {
        model: subject.model(),
        config: subject.config(),
        world_size: subject.world_size(),
        steps,
        site_steps,
        calls_recorded: calls.iter().map(Vec::len).sum(),
        sites: results,
        runs: runner.runs,
        wall_time_seconds: started.elapsed().as_secs_f64(),
        notes,
        field_bugs,
    })
}

fn has_perturb(opts: &SensitivityOptions) -> bool {
    opts.kinds
        .iter()
        .any(|k| matches!(k, FaultKind::Perturb(_)))
}

/// The sites among every rank's calls: `(rank, index into its calls)` for the calls of
/// `site_steps`, point to point on every rank, collectives on their group's first and last
/// members (see the module documentation), ordered by step, rank and call.
fn select_sites(calls: &[Vec<CallRecord>], site_steps: &[usize]) -> Vec<(usize, usize)> {
    let mut sites: Vec<(usize, usize)> = calls
        .iter()
        .enumerate()
        .flat_map(|(rank, log)| log.iter().enumerate().map(move |(i, c)| (rank, i, c)))
        .filter(|(_, _, c)| site_steps.contains(&c.step))
        .filter(|(_, _, c)| {
            use lockstep_core::comm::OpKind::{Recv, Send};
            matches!(c.op, Send | Recv) || c.group_rank == 0 || c.group_rank + 1 == c.group_size
        })
        .map(|(rank, i, _)| (rank, i))
        .collect();
    sites.sort_by_key(|&(rank, i)| (calls[rank][i].step, rank, calls[rank][i].index));
    sites
}

/// A scratch directory for the ranks' fault logs, removed when dropped.
struct LogDir(PathBuf);

impl LogDir {
    fn new() -> Result<Self, SensitivityError> {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path =
            std::env::temp_dir().join(format!("lockstep-faults-{}-{nonce:x}", std::process::id()));
        std::fs::create_dir_all(&path).map_err(|source| SensitivityError::Io {
            path: path.clone(),
            source,
        })?;
        Ok(LogDir(path))
    }
}

impl Drop for LogDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the subject under fault plans and turns each run into a verdict.
struct FaultRunner<'a> {
    subject: &'a dyn Subject,
    /// Each rank's final-state hash in the run without a fault.
    clean: Vec<Option<u64>>,
    base: &'a RunSettings,
    logs: &'a LogDir,
    timeout: Duration,
    runs: usize,
    bar: &'a ProgressBar,
}

impl FaultRunner<'_> {
    /// One run under `mode`: its outcome and every rank's log.
    fn run(
        &mut self,
        mode: FaultMode,
        timeout: Duration,
    ) -> (Result<RunRecord, RunFailed>, Vec<FaultLog>) {
        self.run_planted(mode, timeout, None)
    }

    /// [`FaultRunner::run`] with `bug` planted in the configuration's own loops.
    fn run_planted(
        &mut self,
        mode: FaultMode,
        timeout: Duration,
        bug: Option<FieldBug>,
    ) -> (Result<RunRecord, RunFailed>, Vec<FaultLog>) {
        let settings = RunSettings {
            faults: Some(FaultPlan {
                mode,
                log_dir: self.logs.0.clone(),
            }),
            timeout,
            fault: bug.map(PlantedFault::Field).or(self.base.fault.clone()),
            ..self.base.clone()
        };
        let outcome = self.subject.run(&settings);
        self.runs += 1;
        self.bar.inc(1);
        (outcome, read_logs(&self.logs.0, self.subject.world_size()))
    }

    /// The dry run: every rank's calls (indexed by rank) and the clean run's outcome.
    fn record(&mut self) -> Result<(Vec<Vec<CallRecord>>, RecordResult), SensitivityError> {
        let (outcome, logs) = self.run(FaultMode::Record, self.base.timeout);
        if let Err(e) = &outcome {
            return Err(SensitivityError::RecordRun(e.details.clone()));
        }
        let world = self.subject.world_size();
        let mut calls = vec![Vec::new(); world];
        self.clean = vec![None; world];
        for log in logs {
            if log.rank < world {
                self.clean[log.rank] = log.state_hash;
                calls[log.rank] = log.calls;
            }
        }
        Ok((calls, outcome))
    }

    /// `kind` at `call` (with `earlier`, the rank's calls before it): the perturbation
    /// bisected over ε, any other fault once.
    fn try_fault(
        &mut self,
        call: &CallRecord,
        earlier: &[CallRecord],
        kind: FaultKind,
    ) -> FaultResult {
        let result = |verdict, smallest, tried| FaultResult {
            fault: kind.label(),
            verdict,
            smallest_eps_caught: smallest,
            tried,
        };
        if let Err(reason) = applicability(kind, call, earlier) {
            self.bar.inc(1);
            return result(Verdict::NotApplicable { reason }, None, Vec::new());
        }
        if !matches!(kind, FaultKind::Perturb(_)) {
            return result(self.verdict(call, kind), None, Vec::new());
        }
        let (smallest, verdict, tried) = self.bisect(call);
        result(verdict, smallest, tried)
    }

    /// The smallest ε of [`PERTURB_DECADES`] caught at `call` (assuming a larger ε is caught
    /// whenever a smaller one is), the verdict there (or at the largest ε when none is), and
    /// every ε tried.
    fn bisect(&mut self, call: &CallRecord) -> (Option<f64>, Verdict, Vec<(f64, &'static str)>) {
        let mut tried = Vec::new();
        let mut at = |runner: &mut Self, i: usize| {
            let v = runner.verdict(call, FaultKind::Perturb(PERTURB_DECADES[i]));
            tried.push((PERTURB_DECADES[i], v.cell()));
            v
        };
        let first = at(self, 0);
        if !first.caught() {
            return (None, first, tried);
        }
        // Invariant: `lo` is caught; everything past `hi` is unknown or missed.
        let (mut lo, mut hi, mut best) = (0, PERTURB_DECADES.len(), first);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            let v = at(self, mid);
            if v.caught() {
                lo = mid;
                best = v;
            } else {
                hi = mid;
            }
        }
        (Some(PERTURB_DECADES[lo]), best, tried)
    }

    /// The ranks whose final state in `logs` differs from the run without a fault (a rank
    /// whose hash is missing on either side counts as differing).
    fn diverged(&self, logs: &[FaultLog]) -> Vec<usize> {
        (0..self.subject.world_size())
            .filter(|&rank| {
                let faulted = logs
                    .iter()
                    .find(|l| l.rank == rank)
                    .and_then(|l| l.state_hash);
                let clean = self.clean.get(rank).copied().flatten();
                faulted.is_none() || faulted != clean
            })
            .collect()
    }

    /// One run with `bug` planted (every call recorded, none corrupted), judged: a run that
    /// passes with every rank's bits unchanged did not run the bug's code.
    fn field_bug(&mut self, bug: FieldBug) -> FieldBugResult {
        let (outcome, logs) = self.run_planted(FaultMode::Record, self.timeout, Some(bug));
        let diverged = self.diverged(&logs);
        let detail = format!("{} planted", bug.name());
        let verdict = match self.subject.judge(&outcome) {
            Judgement::Passed if diverged.is_empty() => Verdict::NotApplicable {
                reason: "the configuration does not run this code: every rank trained to the \
                         same bits"
                    .into(),
            },
            Judgement::Passed => Verdict::Missed { detail, diverged },
            Judgement::Failed(by) => Verdict::Caught { by },
            Judgement::RunFailed(e) if e.timed_out => Verdict::Hang { reason: e.line },
            Judgement::RunFailed(e) => Verdict::Error { reason: e.line },
        };
        FieldBugResult {
            bug: bug.name(),
            verdict,
        }
    }

    /// One run with `kind` at `call`, judged.
    fn verdict(&mut self, call: &CallRecord, kind: FaultKind) -> Verdict {
        let mode = FaultMode::Inject {
            site: call.site(),
            kind,
        };
        let (outcome, logs) = self.run(mode, self.timeout);
        let diverged = self.diverged(&logs);
        let injection = logs
            .into_iter()
            .find(|l| l.rank == call.rank)
            .and_then(|l| l.injection);
        if let Err(e) = &outcome {
            return if e.timed_out {
                Verdict::Hang {
                    reason: e.line.clone(),
                }
            } else {
                Verdict::Error {
                    reason: e.line.clone(),
                }
            };
        }
        let detail = match injection {
            None => {
                return Verdict::Moved {
                    detail: "the faulted run never reached this site".into(),
                }
            }
            Some(i) if !i.call().same_call(call) => {
                return Verdict::Moved {
                    detail: format!("the faulted run issued {} here", i.call().describe()),
                }
            }
            Some(Injection::NotApplicable { reason, .. }) => {
                return Verdict::NotApplicable { reason }
            }
            Some(Injection::NoChange { .. }) => return Verdict::Same,
            Some(Injection::Applied { detail, .. }) => detail,
        };
        match self.subject.judge(&outcome) {
            Judgement::Passed if diverged.is_empty() => Verdict::Inert { detail },
            Judgement::Passed => Verdict::Missed { detail, diverged },
            Judgement::Failed(by) => Verdict::Caught { by },
            Judgement::RunFailed(e) if e.timed_out => Verdict::Hang { reason: e.line },
            Judgement::RunFailed(e) => Verdict::Error { reason: e.line },
        }
    }
}
