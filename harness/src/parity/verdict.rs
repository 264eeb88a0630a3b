//! The verdict of a measured comparison and its diagnosis: whether it passed, which tensor
//! is the culprit, and the sentences that say so. One place for the tolerance and the fp64
//! arbiter paths.

use super::comparison::{Comparison, FailurePoint, ParamSummary, Stats, StepComparison};
use super::envelope::ArbiterSummary;
use super::tolerance::Mode;
use lockstep_core::consistency::CrossRankMismatch;
use lockstep_core::record::{RunRecord, RunSpec};

/// Everything one comparison measured, before its verdict.
pub(super) struct Measured {
    /// Structural mismatches.
    pub structural: Vec<String>,
    /// Loss series.
    pub losses: Stats,
    /// Gradient-norm series.
    pub grad_norms: Stats,
    /// All final parameters and buffers.
    pub params: Stats,
    /// All per-step gradients, when compared.
    pub grads: Option<Stats>,
    /// Per final parameter and buffer.
    pub param_summaries: Vec<ParamSummary>,
    /// Per parameter's gradients over every step.
    pub grad_summaries: Vec<ParamSummary>,
    /// Per step.
    pub steps: Vec<StepComparison>,
}

/// What the run was judged against, and how.
pub(super) struct Against {
    /// The reference's row name.
    pub reference: String,
    /// The reference's identity.
    pub reference_spec: RunSpec,
    /// How values were judged.
    pub mode: Mode,
    /// The override that applied, if any.
    pub override_reason: Option<String>,
}

/// The verdict of a measured comparison, the one place the tolerance and arbiter paths decide
/// it: it passes when every value passed, everything lined up and the ranks agreed; its first
/// failure is the culprit (see [`culprit`]) and its diagnosis says so ([`diagnosis_parts`],
/// then `extra`, a sentence of the caller's).
pub(super) fn conclude(
    run: &RunRecord,
    against: Against,
    m: Measured,
    extra: Option<String>,
    arbiter: Option<ArbiterSummary>,
) -> Comparison {
    let mismatch = cross_rank_mismatch(run);
    let passed = m.structural.is_empty()
        && mismatch.is_none()
        && m.steps.iter().all(|s| s.passed)
        && m.losses.passed
        && m.grad_norms.passed
        && m.params.passed
        && m.grads.as_ref().is_none_or(|g| g.passed);
    let (first_failure, derived_failure) =
        culprit(&m.grad_summaries, &m.params, &m.losses, &m.grad_norms);
    let diagnosis = (!passed).then(|| {
        let mut parts = diagnosis_parts(&Findings {
            structural: &m.structural,
            cross_rank: mismatch,
            first_failure: first_failure.as_ref(),
            derived_failure: derived_failure.as_ref(),
            grads_compared: m.grads.is_some(),
        });
        parts.extend(extra);
        parts.join(". ")
    });
    Comparison {
        model: run.spec.model.clone(),
        config: run.spec.config.clone(),
        reference: against.reference,
        run_spec: run.spec.clone(),
        reference_spec: against.reference_spec,
        mode: against.mode,
        override_reason: against.override_reason,
        passed,
        diagnosis,
        structural: m.structural,
        first_failure,
        derived_failure,
        losses: m.losses,
        grad_norms: m.grad_norms,
        params: m.params,
        grads: m.grads,
        param_summaries: m.param_summaries,
        grad_summaries: m.grad_summaries,
        cross_rank: run.cross_rank.clone(),
        steps: m.steps,
        memory: run.memory,
        arbiter,
        placements: run.placements.clone(),
        collectives_per_step: run.collectives.as_ref().and_then(|c| c.first().cloned()),
    }
}

/// What does not line up between two records before any value is compared: the model, the
/// per-step series' lengths.
pub(super) fn structural_mismatches(run: &RunRecord, reference: &RunRecord) -> Vec<String> {
    let mut structural = Vec::new();
    if run.spec.model != reference.spec.model {
        structural.push(format!(
            "the run trained model `{}` but the reference trained `{}`",
            run.spec.model, reference.spec.model
        ));
    }
    for (what, a, b) in [
        ("loss", run.losses.len(), reference.losses.len()),
        (
            "gradient norm",
            run.grad_norms.len(),
            reference.grad_norms.len(),
        ),
    ] {
        if a != b {
            structural.push(format!(
                "the run recorded {a} {what} steps but the reference {b}"
            ));
        }
    }
    if let (Some(a), Some(b)) = (&run.grads, &reference.grads) {
        if a.len() != b.len() {
            structural.push(format!(
                "the run recorded gradients for {} steps but the reference for {}",
                a.len(),
                b.len()
            ));
        }
    }
    structural
}

/// The run's cross-rank mismatch, if its launcher checked and found one.
pub(super) fn cross_rank_mismatch(run: &RunRecord) -> Option<&CrossRankMismatch> {
    run.cross_rank.as_ref().and_then(|c| c.mismatch.as_ref())
}

/// Folds one step's per-tensor verdicts into the run's, by name (first seen first): each
/// tensor's statistics over every step, its first failure the earliest step's.
pub(super) fn fold_summaries(into: &mut Vec<ParamSummary>, step: Vec<ParamSummary>) {
    for (i, s) in step.into_iter().enumerate() {
        // Steps list tensors in the same order, so the same position almost always matches.
        let slot = if into.get(i).is_some_and(|t| t.name == s.name) {
            Some(i)
        } else {
            into.iter().position(|t| t.name == s.name)
        };
        match slot {
            Some(j) => into[j].stats.merge(&s.stats),
            None => into.push(s),
        }
    }
}

/// The culprit and its symptom of a comparison: the earliest failing tensor, and the
/// earliest failing loss or gradient norm (the loss first at one step). Tensors are ordered
/// as they are computed: gradients by step and, within a step, from the last parameter to
/// the first (backward computes them from the output back, so the last parameter off is the
/// one nearest a backward fault); then the final parameters and buffers, after the last step,
/// in model order. With no failing tensor the scalar is the culprit and there is no separate
/// symptom.
pub(super) fn culprit(
    grad_summaries: &[ParamSummary],
    params: &Stats,
    losses: &Stats,
    grad_norms: &Stats,
) -> (Option<FailurePoint>, Option<FailurePoint>) {
    // `min_by_key` keeps the first of equals: reversed, the last parameter of the step.
    let tensor = grad_summaries
        .iter()
        .rev()
        .filter_map(|g| g.stats.first_failure.as_ref())
        .min_by_key(|f| f.step.unwrap_or(usize::MAX))
        .or(params.first_failure.as_ref())
        .cloned();
    let scalar = match (&losses.first_failure, &grad_norms.first_failure) {
        (Some(l), Some(n)) if n.step < l.step => Some(n.clone()),
        (Some(l), _) => Some(l.clone()),
        (None, n) => n.clone(),
    };
    match tensor {
        Some(t) => (Some(t), scalar),
        None => (scalar, None),
    }
}

/// What a failed comparison found, most specific first: the input of its diagnosis, one
/// builder for the tolerance and the arbiter paths.
pub(super) struct Findings<'a> {
    /// What did not line up.
    pub structural: &'a [String],
    /// Two ranks' copies of a tensor that differ: the most specific culprit there is.
    pub cross_rank: Option<&'a CrossRankMismatch>,
    /// The comparison's [`Comparison::first_failure`].
    pub first_failure: Option<&'a FailurePoint>,
    /// The comparison's [`Comparison::derived_failure`].
    pub derived_failure: Option<&'a FailurePoint>,
    /// Whether per-step gradients were compared (else tensors are seen only at the end).
    pub grads_compared: bool,
}

/// The sentences of a failed comparison's diagnosis: a cross-rank mismatch first (it names
/// the tensor, ranks and step), what did not line up, then the culprit tensor with the
/// derived scalar it caused (the arbiter adds its own sentences after these).
pub(super) fn diagnosis_parts(findings: &Findings<'_>) -> Vec<String> {
    let mut parts = Vec::new();
    if let Some(m) = findings.cross_rank {
        parts.push(format!("first failure: {m}"));
    }
    if !findings.structural.is_empty() {
        parts.push(format!(
            "structural mismatch: {}",
            findings.structural.join("; ")
        ));
    }
    if let Some(f) = findings.first_failure {
        let label = if findings.cross_rank.is_some() {
            "rank 0 against the reference"
        } else {
            "first failure"
        };
        let mut text = format!("{label}: {f}");
        if let Some(d) = findings.derived_failure {
            // Final values come after every step.
            let culprit_step = f.step.unwrap_or(usize::MAX);
            if d.step.is_some_and(|s| s >= culprit_step) {
                text.push_str(&format!("; then {d}"));
            } else {
                text.push_str(&format!("; the first failing scalar came earlier: {d}"));
                if !findings.grads_compared {
                    text.push_str(
                        " (per-step gradients were not compared, so tensors are seen only after \
                         the last step)",
                    );
                }
            }
        }
        parts.push(text);
    }
    parts
}
