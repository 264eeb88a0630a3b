//! What a record says about where it comes from, beside its numbers: what ties a reference
//! to the run it judges, and what the recorder found wrong with the run's data.
//!
//! What ties a reference to the run it judges: a job's record carries the digests of its
//! initial state, of every step's batches and of its configuration (`binding`); a reference's
//! and a shadow's carry the digests of the run they were trained from (`trained_from`), and
//! their kind. A reference of another run, the run's own folder given as its reference, or
//! an fp32 record given as the shadow would otherwise be judged as if they fit, and a buggy
//! job could pass.

use super::JudgeError;
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The digests one record is bound to (SHA-256, hexadecimal).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Digests {
    /// Of the initial state (every name, dtype, shape and byte).
    pub init: String,
    /// Of each step's batches (every rank's, in rank order); `null` when none were kept.
    pub batches: Option<Vec<String>>,
    /// Of the model, world size, step count and seed.
    pub config: String,
}

/// What a record says about where it comes from, read beside the run record itself.
#[derive(Clone, Debug)]
pub struct Provenance {
    /// The record file, for messages.
    pub path: PathBuf,
    /// `run`, `reference` or `shadow`; `None` for a record that does not say.
    pub kind: Option<String>,
    /// A run's own digests.
    pub binding: Option<Digests>,
    /// A reference's or shadow's: the run's digests it was trained from.
    pub trained_from: Option<Digests>,
    /// The record's dtype (`fp32`, `fp64`, `bf16`, …).
    pub dtype: String,
    /// Every how many steps the record holds the full gradients (`Recorder(every=k)`; 1
    /// when it does not say): a reference must hold them at the same steps.
    pub grads_every: u64,
    /// The steps a job's loss scaler skipped (a run's), or that a reference skipped to
    /// replay them: they must be the same.
    pub skipped_steps: Vec<usize>,
    /// The steps whose module outputs (and their gradients) the record kept.
    pub activation_steps: Vec<usize>,
    /// A run's data findings (the same batch on every rank, a batch repeated from an earlier
    /// step), in words: each fails the job.
    pub data_findings: Vec<String>,
    /// Parameters that do not train on purpose (`Recorder(frozen=...)`, and those without
    /// `requires_grad`): the training check leaves them out.
    pub frozen: Vec<String>,
    /// How a run's optimizer started (`fresh`, `recorded`: a resumed job's state saved for
    /// the references, `unrecorded`: a resumed job's state not saved); `None` for a record
    /// that does not say.
    pub optimizer_start: Option<String>,
    /// A float64 shadow's casts to a narrower dtype that it widened, by the module that made
    /// them (the job's fp32 islands: a `.float()` on the logits, an RMSNorm in fp32).
    pub widened_casts: Vec<(String, u64)>,
    /// The evaluation metrics the record holds: a job's as it reported them, a
    /// reference's as it computed them at the same points.
    pub metrics: Vec<super::metrics::MetricPoint>,
}

impl Provenance {
    /// Reads the provenance fields of a record's JSON (`file` names it in errors).
    pub fn read(file: &Path, record: &serde_json::Value) -> Result<Provenance, JudgeError> {
        let field = |name: &str| -> Result<Option<Digests>, JudgeError> {
            match record.get(name) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => {
                    serde_json::from_value(v.clone())
                        .map(Some)
                        .map_err(|e| JudgeError::Parse {
                            path: file.to_owned(),
                            detail: format!("`{name}`: {e}"),
                        })
                }
            }
        };
        Ok(Provenance {
            path: file.to_owned(),
            kind: record
                .get("kind")
                .and_then(|k| k.as_str())
                .map(str::to_owned),
            binding: field("binding")?,
            trained_from: field("trained_from")?,
            dtype: record
                .pointer("/spec/dtype")
                .and_then(|d| d.as_str())
                .unwrap_or("?")
                .to_owned(),
            grads_every: record
                .get("grads_every")
                .and_then(|k| k.as_u64())
                .unwrap_or(1),
            skipped_steps: match record.get("skipped_steps") {
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(v) => serde_json::from_value(v.clone()).map_err(|e| JudgeError::Parse {
                    path: file.to_owned(),
                    detail: format!("`skipped_steps`: {e}"),
                })?,
            },
            activation_steps: record
                .get("activation_steps")
                .and_then(|v| serde_json::from_value(v.clone()).ok())
                .unwrap_or_default(),
            data_findings: record
                .get("data")
                .and_then(|d| d.as_array())
                .map(|findings| {
                    findings
                        .iter()
                        .filter_map(|f| f.get("text").and_then(|t| t.as_str()))
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
            frozen: match record.get("frozen") {
                None | Some(serde_json::Value::Null) => Vec::new(),
                Some(v) => serde_json::from_value(v.clone()).map_err(|e| JudgeError::Parse {
                    path: file.to_owned(),
                    detail: format!("`frozen`: {e}"),
                })?,
            },
            optimizer_start: record
                .get("optimizer_start")
                .and_then(|s| s.as_str())
                .map(str::to_owned),
            widened_casts: record
                .get("widened_casts")
                .and_then(|w| w.as_object())
                .map(|by_module| {
                    by_module
                        .iter()
                        .map(|(module, n)| (module.clone(), n.as_u64().unwrap_or(0)))
                        .collect()
                })
                .unwrap_or_default(),
            metrics: super::metrics::read(record, file)?,
        })
    }
}

/// What the reader is told of the casts the float64 shadow widened (`None`: it widened none).
pub fn widened_note(shadow: &Provenance) -> Option<String> {
    if shadow.widened_casts.is_empty() {
        return None;
    }
    let total: u64 = shadow.widened_casts.iter().map(|(_, n)| n).sum();
    let places: Vec<String> = shadow
        .widened_casts
        .iter()
        .map(|(module, n)| format!("`{module}` ({n})"))
        .collect();
    Some(format!(
        "the float64 shadow widened {total} cast{} to fp32 or narrower to float64, in {}: the \
         job and its fp32 reference compute those parts in their own precision, the shadow in \
         float64 throughout",
        if total == 1 { "" } else { "s" },
        places.join(", ")
    ))
}

/// A digest as messages show it: its first 12 hexadecimal digits.
fn short(digest: &str) -> &str {
    digest.get(..12).unwrap_or(digest)
}

/// Refuses (bad input, exit 2, naming both sides) a `role` record (`reference` or `shadow`)
/// that was not trained from `run`, is of another kind, or (a shadow) is not float64.
pub fn check_bound(run: &Provenance, other: &Provenance, role: &str) -> Result<(), JudgeError> {
    check_kinds(run, other, role)?;
    let refuse = |why: String| JudgeError::Unbound(why);
    let Some(ours) = &run.binding else {
        return Err(refuse(format!(
            "the run {} carries no binding (the digests of its initial state, batches and \
             configuration), so no reference can be shown to be its: record it with this \
             lockstep_probe (docs/judge.md, \"The record format\")",
            run.path.display()
        )));
    };
    let Some(theirs) = &other.trained_from else {
        return Err(refuse(format!(
            "the {role} {} does not say which run it was trained from: train it with this \
             lockstep_probe's train_references from the run",
            other.path.display()
        )));
    };
    let differences = binding_differences(theirs, ours, run, other);
    if differences.is_empty() {
        return Ok(());
    }
    Err(refuse(format!(
        "the {role} {} was not trained from the run {}: {}; train it from this run \
         (train_references(..., run_dir, ...))",
        other.path.display(),
        run.path.display(),
        differences.join("; ")
    )))
}

/// The part of [`check_bound`] that reads what each record says it is: a job's run with its
/// optimizer recorded, and the reference or shadow `role` names (a shadow in float64).
fn check_kinds(run: &Provenance, other: &Provenance, role: &str) -> Result<(), JudgeError> {
    let refuse = |why: String| JudgeError::Unbound(why);
    if let Some(kind) = run.kind.as_deref().filter(|k| *k != "run") {
        return Err(refuse(format!(
            "--run {} is a {kind} record (trained by train_references), not a job's run",
            run.path.display()
        )));
    }
    if run.optimizer_start.as_deref() == Some("unrecorded") {
        return Err(JudgeError::ResumedOptimizer(format!(
            "{}: the job's optimizer already held state when recording began (a job resumed \
             from a checkpoint), and the record does not carry it: its references started \
             from a fresh optimizer, so their first update is not the job's. Pass the \
             optimizer to the recorder, created after the checkpoint is loaded: \
             `Recorder(..., optimizer=opt)` (docs/judge.md, \"Resumed jobs\")",
            run.path.display()
        )));
    }
    match other.kind.as_deref() {
        Some(kind) if kind == role => {}
        Some("run") => {
            return Err(refuse(format!(
                "the {role} {} is a job's run record, not a single-device {role} trained from \
                 the run (was --{role} pointed at a run's folder?)",
                other.path.display()
            )))
        }
        Some(kind) => {
            return Err(refuse(format!(
                "the {role} {} is a {kind} record: pass the {role} train_references wrote \
                 (out/{role})",
                other.path.display()
            )))
        }
        None => {
            return Err(refuse(format!(
                "the {role} {} does not say what it is (no `kind`): train it with \
                 lockstep_probe.train_references from the run",
                other.path.display()
            )))
        }
    }
    if role == "shadow" && other.dtype != "fp64" {
        return Err(refuse(format!(
            "the shadow {} computes in {}, not float64: the arbiter measures rounding against \
             a float64 shadow (train_references writes it as out/shadow)",
            other.path.display(),
            other.dtype
        )));
    }
    Ok(())
}

/// How the reference or shadow `other`, trained from binding `theirs`, differs from the run
/// bound by `ours`: each difference in words (none when it was trained from this run).
fn binding_differences(
    theirs: &Digests,
    ours: &Digests,
    run: &Provenance,
    other: &Provenance,
) -> Vec<String> {
    let mut differences = Vec::new();
    if theirs.init != ours.init {
        differences.push(format!(
            "another initial state (digest {} against the run's {})",
            short(&theirs.init),
            short(&ours.init)
        ));
    }
    if theirs.batches != ours.batches {
        let step = match (&theirs.batches, &ours.batches) {
            (Some(a), Some(b)) => a.iter().zip(b).position(|(x, y)| x != y).map_or(
                format!("{} steps against {}", a.len(), b.len()),
                |s| {
                    format!(
                        "from step {s} on ({} against the run's {})",
                        short(&a[s]),
                        short(&b[s])
                    )
                },
            ),
            _ => "one side kept none".into(),
        };
        differences.push(format!("other batches: {step}"));
    }
    if theirs.config != ours.config {
        differences.push(format!(
            "another model, world size, step count or seed (digest {} against the run's {})",
            short(&theirs.config),
            short(&ours.config)
        ));
    }
    if other.grads_every != run.grads_every {
        differences.push(format!(
            "its gradients recorded every {} steps, the run's every {}",
            other.grads_every, run.grads_every
        ));
    }
    if other.skipped_steps != run.skipped_steps {
        differences.push(format!(
            "it skipped steps {:?}, the run's loss scaler {:?}",
            other.skipped_steps, run.skipped_steps
        ));
    }
    differences
}
