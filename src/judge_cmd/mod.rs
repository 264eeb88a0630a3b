//! `lockstep judge`: Lockstep's verdict on a training job it did not run. A PyTorch job
//! recorded with `python/lockstep_probe` (or any program writing Lockstep's run record) is
//! judged against its single-device fp32 reference by the fp64 arbiter when the float64
//! shadow is given (else by the fp32 dtype table), with the same engine, reports and exit
//! codes as the matrix (docs/judge.md).

pub mod binding;
pub mod forward;
pub mod loss_scale;
pub mod metrics;
pub mod skipped;
mod tensor_file;
pub mod training;
pub mod verdict;

use binding::{check_bound, Provenance};
use lockstep_core::record::{NamedTensor, RunRecord};
use lockstep_harness::parity::{
    arbitrate, compare, Comparison, FailurePoint, Quantity, TolerancePolicy, ENVELOPE,
};
use lockstep_harness::report::{prepare_dir, write_all, Report, ReportError, ReportFiles};
use std::path::{Path, PathBuf};

/// What `lockstep judge` reads and where it writes.
#[derive(Clone, Debug)]
pub struct JudgeOptions {
    /// The job's record: a directory holding `record.json`, or the file itself.
    pub run: PathBuf,
    /// The single-device fp32 reference's record, from the same start and batches.
    pub reference: PathBuf,
    /// The reference's float64 shadow: with it the fp64 arbiter judges.
    pub shadow: Option<PathBuf>,
    /// Where the report set goes (`report.json`, `.md`, `.html`, `junit.xml`).
    pub out: PathBuf,
}

/// Why a job could not be judged (bad input: exit 2).
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    /// A record could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A record is not Lockstep's run record (damaged, truncated, another format).
    #[error("{path}: not a Lockstep run record: {detail}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        detail: String,
    },
    /// A record's tensor file is missing, damaged, or lacks a tensor the record names.
    #[error("{path}: {detail}")]
    Tensors {
        /// The tensor file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
    },
    /// The records do not describe the same training (other world size or step count).
    #[error("{0}")]
    Mismatch(String),
    /// A reference or shadow not trained from this run, of the wrong kind or dtype
    /// ([`binding::check_bound`]).
    #[error("{0}")]
    Unbound(String),
    /// A job resumed from a checkpoint whose optimizer state the record does not carry: its
    /// references cannot start where it did (not a numerical verdict).
    #[error("{0}")]
    ResumedOptimizer(String),
    /// The reference's model differs from the run's (a tensor missing on one side, or of
    /// another shape): not a numerical verdict.
    #[error("the run and its references are not the same model: {0}")]
    Structure(String),
    /// The report could not be written.
    #[error(transparent)]
    Report(#[from] ReportError),
}

/// A run record from `path` (a directory's `record.json`, or the file), its tensors' values
/// read from the tensor file it names, if any (docs/judge.md, "The record format"); or an
/// error naming the file and what is wrong with it.
pub fn read_record(path: &Path) -> Result<RunRecord, JudgeError> {
    read_bound_record(path).map(|(record, _)| record)
}

/// [`read_record`] with what the record says about where it comes from.
pub fn read_bound_record(path: &Path) -> Result<(RunRecord, Provenance), JudgeError> {
    read_full_record(path).map(|(record, provenance, _)| (record, provenance))
}

/// [`read_bound_record`] with the module outputs the record kept, in execution order, and
/// the gradients backward brought to them.
pub fn read_full_record(
    path: &Path,
) -> Result<(RunRecord, Provenance, forward::ModuleProbes), JudgeError> {
    let file = match path.is_dir() {
        true => path.join("record.json"),
        false => path.to_owned(),
    };
    let text = std::fs::read_to_string(&file).map_err(|source| JudgeError::Read {
        path: file.clone(),
        source,
    })?;
    let parse = |e: serde_json::Error| JudgeError::Parse {
        path: file.clone(),
        detail: e.to_string(),
    };
    let mut record: serde_json::Value = serde_json::from_str(&text).map_err(parse)?;
    let provenance = Provenance::read(&file, &record)?;
    tensor_file::fill_values(&mut record, file.parent().unwrap_or(Path::new(".")))?;
    let outputs = forward::ModuleProbes {
        outputs: forward::read_outputs(&record),
        output_grads: forward::read_output_grads(&record),
    };
    Ok((
        serde_json::from_value(record).map_err(parse)?,
        provenance,
        outputs,
    ))
}

/// Refuses records that cannot describe the same training: a reference standing for another
/// world size, or another number of steps.
fn same_training(run: &RunRecord, reference: &RunRecord, what: &str) -> Result<(), JudgeError> {
    let (a, b) = (&run.spec, &reference.spec);
    if a.world_size != b.world_size || a.steps != b.steps {
        return Err(JudgeError::Mismatch(format!(
            "the run ({}, world {}, {} steps) and the {what} ({}, world {}, {} steps) are not \
             the same training: record the {what} from the run's own start and batches",
            a.config, a.world_size, a.steps, b.config, b.world_size, b.steps
        )));
    }
    Ok(())
}

/// The verdict on the job: the fp64 arbiter's with a shadow, else the fp32 dtype table's.
pub fn judge_records(
    run: &RunRecord,
    reference: &RunRecord,
    shadow: Option<&RunRecord>,
) -> Result<Comparison, JudgeError> {
    same_training(run, reference, "reference")?;
    Ok(match shadow {
        Some(shadow) => {
            same_training(run, shadow, "shadow")?;
            arbitrate(run, reference, shadow, &ENVELOPE, None)
        }
        None => compare(
            run,
            reference,
            &TolerancePolicy::dtype_table(lockstep_core::comm::DType::F32),
        ),
    })
}

/// A module output out of its envelope fails the job and leads the diagnosis: it is where the
/// forward went wrong, before any gradient showed it. Failing that, the first output whose
/// gradient left its envelope names the module whose backward went wrong.
/// When the step before the forward finding's was recorded and judged within, the parameters
/// that step's update left are what went wrong, and the diagnosis says so; unless a
/// parameter's gradient had already left its envelope at such a step (a reduction left out,
/// gradients not zeroed): then that gradient leads, the forward being its consequence.
fn name_the_culprit(
    comparison: &mut Comparison,
    forward: Option<forward::ForwardFinding>,
    backward: Option<forward::ForwardFinding>,
    recorded: &[usize],
) {
    let found = match first_to_show(forward, backward) {
        Some(Culprit::Forward(f)) => {
            let step = forward::step_of(&f.name).unwrap_or(0);
            // A parameter's gradient out of its envelope at an earlier step whose module
            // outputs, and the gradients reaching them, were all within: that gradient is the
            // culprit, and this forward only its consequence through the update.
            if let Some((at, tensor)) = first_wrong_gradient(comparison)
                .filter(|(at, _)| *at < step && recorded.contains(at))
            {
                lead_diagnosis(
                    comparison,
                    format!(
                        "gradient: the gradient of `{tensor}` left its envelope at step {at}, \
                         while step {at}'s module outputs and the gradients backward brought \
                         to them were all within: a parameter's gradient itself went wrong, \
                         in a module's backward for its weights or after it (a reduction \
                         across ranks left out or done twice, gradients not zeroed between \
                         steps, clipping or scaling before rec.step); the update after step \
                         {at} carried it into step {step}'s forward, whose first module \
                         output out of its envelope is {} (margin {:.3e}; {} outputs judged)",
                        f.name, f.margin, f.judged
                    ),
                );
                comparison.passed = false;
                return;
            }
            let cause = match step.checked_sub(1) {
                Some(before) if recorded.contains(&before) => format!(
                    ": step {before}'s module outputs and their gradients were all within, so \
                     what step {step} began from went wrong: the update after step {before} \
                     (the optimizer, clipping, a gradient changed after rec.step) or a state \
                     the forward keeps between steps"
                ),
                _ => String::new(),
            };
            format!(
                "forward: the first module output out of its envelope, in execution order, is \
                 {} (margin {:.3e}; {} outputs judged){cause}",
                f.name, f.margin, f.judged
            )
        }
        Some(Culprit::Backward(b)) => {
            let culprit = match &b.previous {
                Some(p) => format!(
                    "the backward of `{}` went wrong (the gradient it received at its output \
                     was within)",
                    forward::module_of(p)
                ),
                None => "the first gradient backward produced is already wrong: the loss's \
                         own backward went wrong"
                    .to_owned(),
            };
            format!(
                "backward: the first gradient out of its envelope, in backward order, is the \
                 one reaching the output of {} (margin {:.3e}; {} judged): {culprit}",
                b.name, b.margin, b.judged
            )
        }
        None => return,
    };
    lead_diagnosis(comparison, found);
    comparison.passed = false;
}

/// The earliest step at which a parameter's gradient left its envelope, and that
/// parameter's name: the comparison's first failure when it is a gradient, else the earliest
/// among the per-parameter gradient verdicts (the first failure may be the copy check's).
fn first_wrong_gradient(comparison: &Comparison) -> Option<(usize, String)> {
    let named = |f: &FailurePoint| Some((f.step?, f.tensor.clone()?));
    if let Some(f) = comparison
        .first_failure
        .as_ref()
        .filter(|f| f.quantity == Quantity::Grads)
    {
        return named(f);
    }
    comparison
        .grad_summaries
        .iter()
        .filter_map(|p| p.stats.first_failure.as_ref().and_then(named))
        .min_by_key(|(step, _)| *step)
}

/// Where a job first went wrong, by its module outputs.
#[derive(Debug, PartialEq)]
enum Culprit {
    /// A module's output.
    Forward(forward::ForwardFinding),
    /// The gradient reaching a module's output.
    Backward(forward::ForwardFinding),
}

/// The finding at the first step either shows: a step's forward runs before its backward,
/// and a backward bug at one step makes every later step's forward wrong, so a forward
/// finding at a later step than the backward's is only its consequence.
fn first_to_show(
    forward: Option<forward::ForwardFinding>,
    backward: Option<forward::ForwardFinding>,
) -> Option<Culprit> {
    match (forward, backward) {
        (Some(f), Some(b)) if forward::step_of(&b.name) < forward::step_of(&f.name) => {
            Some(Culprit::Backward(b))
        }
        (Some(f), _) => Some(Culprit::Forward(f)),
        (None, b) => b.map(Culprit::Backward),
    }
}

/// Puts `found` at the head of the comparison's diagnosis: it says where what follows began.
fn lead_diagnosis(comparison: &mut Comparison, found: String) {
    comparison.diagnosis = Some(match comparison.diagnosis.take() {
        Some(rest) => format!("{found}. {rest}"),
        None => found,
    });
}

/// A failure no module output placed: the diagnosis gains [`no_module_shows`]'s word.
fn explain_a_failure_no_module_shows(
    comparison: &mut Comparison,
    recorded: &[usize],
    judged: &[usize],
) {
    if comparison.passed {
        return;
    }
    let Some(step) = comparison.first_failure.as_ref().and_then(|f| f.step) else {
        return;
    };
    let Some(hint) = no_module_shows(step, recorded, judged) else {
        return;
    };
    comparison.diagnosis = Some(match comparison.diagnosis.take() {
        Some(failure) => format!("{failure}. {hint}"),
        None => hint,
    });
}

/// What a failure first seen at `step` that no module output placed means: at a step whose
/// module outputs were judged and all within, a parameter's gradient itself went wrong; at a
/// step not recorded, which steps to record to place it. `None` at a step recorded but not
/// judged (the outputs' shapes differ from the references').
fn no_module_shows(step: usize, recorded: &[usize], judged: &[usize]) -> Option<String> {
    if judged.contains(&step) {
        return Some(format!(
            "step {step}'s module outputs and the gradients backward brought to them were all \
             within: what went wrong is a parameter's gradient itself, in a module's backward \
             for its weights or after it (their reduction across ranks, clipping or scaling \
             before rec.step)"
        ));
    }
    if recorded.contains(&step) {
        return None;
    }
    let mut steps = recorded.to_vec();
    steps.push(step);
    let list: Vec<String> = steps.iter().map(usize::to_string).collect();
    Some(format!(
        "module outputs were not recorded at step {step}, where the first failure is: to name \
         the module, record the job again with Recorder(..., activations=[{}])",
        list.join(", ")
    ))
}

/// A job whose data the recorder found wrong, or that does not train, fails whatever its
/// numbers: the references trained on the same wrong data, or the same untrainable model, so
/// they cannot see it. The findings, under `label`, lead the diagnosis.
fn fail_on_findings(comparison: &mut Comparison, label: &str, findings: &[String]) {
    if findings.is_empty() {
        return;
    }
    lead_diagnosis(comparison, format!("{label}: {}", findings.join("; ")));
    comparison.passed = false;
}

/// A judged job: its report, the files written, and what the verdict set aside (steps a
/// loss scaler skipped), in words.
pub struct Judged {
    /// The report (one comparison).
    pub report: Report,
    /// Where it was written.
    pub files: ReportFiles,
    /// What was left out of the comparison and why, for the reader.
    pub notes: Vec<String>,
}

/// Reads the records, judges the job and writes the report set; the report says whether it
/// passed. Nothing is written when an input is bad.
pub fn judge(opts: &JudgeOptions) -> Result<Judged, JudgeError> {
    let (mut run, run_from, mut run_probes) = read_full_record(&opts.run)?;
    let (mut reference, reference_from, mut reference_probes) = read_full_record(&opts.reference)?;
    check_bound(&run_from, &reference_from, "reference")?;
    let (mut shadow, widened, shadow_metrics) = match opts.shadow.as_deref() {
        Some(path) => {
            let (shadow, shadow_from, mut shadow_probes) = read_full_record(path)?;
            skipped::set_aside_output_grads(&mut shadow_probes, &run_from.skipped_steps);
            check_bound(&run_from, &shadow_from, "shadow")?;
            (
                Some((shadow, shadow_probes)),
                binding::widened_note(&shadow_from),
                Some(shadow_from.metrics),
            )
        }
        None => (None, None, None),
    };
    let mut records = vec![&mut run, &mut reference];
    records.extend(shadow.as_mut().map(|(s, _)| s));
    let mut notes: Vec<String> = skipped::set_aside(&mut records, &run_from.skipped_steps)
        .into_iter()
        .collect();
    notes.extend(widened);
    for probes in [&mut run_probes, &mut reference_probes] {
        skipped::set_aside_output_grads(probes, &run_from.skipped_steps);
    }
    let mut comparison = judge_records(&run, &reference, shadow.as_ref().map(|(s, _)| s))?;
    if !comparison.structural.is_empty() {
        return Err(JudgeError::Structure(comparison.structural.join("; ")));
    }
    if let Some((shadow, shadow_probes)) = &shadow {
        let judge_outputs = |pick: fn(&forward::ModuleProbes) -> &[NamedTensor]| {
            forward::judge_outputs(
                (&run, pick(&run_probes)),
                (&reference, pick(&reference_probes)),
                (shadow, pick(shadow_probes)),
            )
        };
        let (forward, backward) = (
            judge_outputs(|p| &p.outputs),
            judge_outputs(|p| &p.output_grads),
        );
        if forward.first_bad.is_none() && backward.first_bad.is_none() {
            explain_a_failure_no_module_shows(
                &mut comparison,
                &run_from.activation_steps,
                &forward.judged_steps,
            );
        }
        let (forward, backward) = (forward.first_bad, backward.first_bad);
        name_the_culprit(
            &mut comparison,
            forward,
            backward,
            &run_from.activation_steps,
        );
    }
    if let Some(found) = loss_scale::finding(&comparison, &run, &reference) {
        lead_diagnosis(&mut comparison, found);
    }
    fail_on_findings(
        &mut comparison,
        "training",
        &training::findings(&run, &run_from.frozen)?,
    );
    fail_on_findings(&mut comparison, "data", &run_from.data_findings);
    fail_on_findings(
        &mut comparison,
        "evaluation",
        &metrics::findings(
            &run_from.metrics,
            &reference_from.metrics,
            shadow_metrics.as_deref(),
        )?,
    );
    let report = Report::new(vec![comparison])
        .with_environment(Some(lockstep_harness::report::environment()));
    prepare_dir(&opts.out)?;
    let files = write_all(&report, &opts.out)?;
    Ok(Judged {
        report,
        files,
        notes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finding(name: &str) -> forward::ForwardFinding {
        forward::ForwardFinding {
            name: name.to_owned(),
            previous: None,
            margin: 2.0,
            judged: 10,
        }
    }

    #[test]
    fn a_backward_bug_is_named_before_the_forward_it_spoils_at_the_next_step() {
        let (f, b) = (finding("step 1, rank 0: 0"), finding("step 0, rank 0: 3"));
        assert_eq!(
            first_to_show(Some(f), Some(b.clone())),
            Some(Culprit::Backward(b))
        );
    }

    #[test]
    fn a_failure_past_the_recorded_steps_asks_for_them_and_one_within_them_blames_a_gradient() {
        let hint = no_module_shows(20, &[0, 1, 2], &[0, 1, 2]).expect("a hint");
        assert!(
            hint.contains("not recorded at step 20")
                && hint.contains("Recorder(..., activations=[0, 1, 2, 20])"),
            "{hint}"
        );
        let within = no_module_shows(1, &[0, 1, 2], &[0, 1, 2]).expect("a word");
        assert!(within.contains("step 1's module outputs"), "{within}");
        // Recorded but not judged (a tensor-parallel layer's local shards): nothing to say.
        assert_eq!(no_module_shows(1, &[0, 1], &[]), None);
    }

    #[test]
    fn at_the_same_step_the_forward_is_named_first() {
        let (f, b) = (finding("step 2, rank 1: 4"), finding("step 2, rank 0: 1"));
        assert_eq!(
            first_to_show(Some(f.clone()), Some(b)),
            Some(Culprit::Forward(f))
        );
        assert_eq!(first_to_show(None, None), None);
    }
}
