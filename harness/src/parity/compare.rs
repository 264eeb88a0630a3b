//! The tolerance engine: one run against one reference, value by value under a
//! [`TolerancePolicy`], with the numbers a person needs to judge the verdict (how far off,
//! relative to what was allowed, and where it first went wrong). The result types live in
//! [`super::comparison`] and the verdict and its diagnosis in [`super::verdict`].

use super::tolerance::{looser_dtype, ulp_distance, Check, Quantity, TolerancePolicy};
use super::verdict::{conclude, fold_summaries, structural_mismatches, Against, Measured};
use lockstep_core::comm::DType;
use lockstep_core::record::{NamedTensor, RunRecord};
use std::collections::HashMap;

// The result types were defined here before they moved to their own module: their paths
// through this module keep working.
pub use super::comparison::{
    location, unravel, Comparison, FailurePoint, ParamSummary, ScalarDiff, Stats, StepComparison,
};

/// The judgement of one value pair.
struct Element {
    abs_err: f64,
    rel_err: f64,
    ulp: u64,
    margin: f64,
    allowed: Option<f64>,
    passed: bool,
}

fn judge(actual: f64, expected: f64, dtype: DType, check: &Check) -> Element {
    let ulp = ulp_distance(actual, expected, dtype);
    let identical = actual.to_bits() == expected.to_bits();
    // In bitwise mode two NaNs are the same value whatever their sign and payload: which NaN
    // an invalid operation yields, and which operand's payload propagates, is the CPU's
    // choice (x86 and Arm differ), so a verdict that looked at NaN bits would change with the
    // machine. (A tolerance never accepts a NaN.)
    let same_bits = identical || (actual.is_nan() && expected.is_nan());
    // Equal values (including equal infinities and ±0) have no error; NaN or a non-finite
    // mismatch is an infinite one, which no tolerance accepts.
    let abs_err = if actual == expected || identical {
        0.0
    } else if actual.is_finite() && expected.is_finite() {
        (actual - expected).abs()
    } else {
        f64::INFINITY
    };
    let rel_err = if abs_err == 0.0 {
        0.0
    } else if expected == 0.0 || !expected.is_finite() {
        f64::INFINITY
    } else {
        abs_err / expected.abs()
    };
    match check {
        Check::Bitwise => Element {
            abs_err,
            rel_err,
            ulp,
            margin: if same_bits { 0.0 } else { f64::INFINITY },
            allowed: None,
            passed: same_bits,
        },
        Check::Close(tol) => {
            let allowed = if expected.is_finite() {
                tol.allowed(expected)
            } else {
                0.0
            };
            let margin = if abs_err == 0.0 {
                0.0
            } else if allowed == 0.0 {
                f64::INFINITY
            } else {
                abs_err / allowed
            };
            Element {
                abs_err,
                rel_err,
                ulp,
                margin,
                allowed: Some(allowed),
                passed: abs_err <= allowed,
            }
        }
    }
}

/// Where a value sits, for failure reports.
#[derive(Clone)]
struct At<'a> {
    quantity: Quantity,
    step: Option<usize>,
    tensor: Option<&'a str>,
    /// The tensor's shape, to name a failing element per dimension.
    shape: &'a [i64],
}

impl Stats {
    fn observe(
        &mut self,
        actual: f64,
        expected: f64,
        dtype: DType,
        check: &Check,
        at: &At<'_>,
        index: Option<usize>,
    ) -> Element {
        let e = judge(actual, expected, dtype, check);
        self.compared += 1;
        self.max_abs_err = self.max_abs_err.max(e.abs_err);
        self.max_rel_err = self.max_rel_err.max(e.rel_err);
        self.max_ulp = self.max_ulp.max(e.ulp);
        self.margin = self.margin.max(e.margin);
        if !e.passed {
            self.passed = false;
            if self.first_failure.is_none() {
                self.first_failure = Some(FailurePoint {
                    quantity: at.quantity,
                    step: at.step,
                    tensor: at.tensor.map(str::to_owned),
                    index,
                    element: at.tensor.and(index).and_then(|i| unravel(i, at.shape)),
                    actual,
                    expected,
                    abs_err: e.abs_err,
                    allowed: e.allowed,
                    ulp: e.ulp,
                    dtype,
                    envelope: None,
                });
            }
        }
        e
    }
}

fn diff_scalar(
    stats: &mut Stats,
    run: f64,
    reference: f64,
    dtype: DType,
    check: &Check,
    at: &At<'_>,
) -> ScalarDiff {
    let e = stats.observe(run, reference, dtype, check, at, None);
    ScalarDiff {
        run,
        reference,
        abs_err: e.abs_err,
        rel_err: e.rel_err,
        ulp: e.ulp,
        margin: e.margin,
        passed: e.passed,
        envelope: None,
    }
}

fn numel(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| {
        usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
    })
}

/// What a list of tensors being compared is and how it is judged.
#[derive(Clone, Copy)]
struct TensorSet<'a> {
    /// Human name for diagnoses ("final parameters", "gradients at step 3").
    what: &'a str,
    step: Option<usize>,
    quantity: Quantity,
    policy: &'a TolerancePolicy,
    config: &'a str,
}

/// Compares two tensor lists by name. Structural problems go to `structural` (prefixed with
/// `set.what`); matching tensors are judged element by element.
fn diff_tensors(
    run: &[NamedTensor],
    reference: &[NamedTensor],
    set: &TensorSet<'_>,
    structural: &mut Vec<String>,
) -> (Stats, Vec<ParamSummary>) {
    let TensorSet {
        what,
        step,
        quantity,
        policy,
        config,
    } = *set;
    let by_name: HashMap<&str, &NamedTensor> = run.iter().map(|t| (t.name.as_str(), t)).collect();
    let ref_names: std::collections::HashSet<&str> =
        reference.iter().map(|t| t.name.as_str()).collect();
    let mut total = Stats::default();
    let mut summaries = Vec::new();
    for want in reference {
        let Some(have) = by_name.get(want.name.as_str()) else {
            structural.push(format!(
                "{what}: `{}` is in the reference but missing from the run",
                want.name
            ));
            total.passed = false;
            continue;
        };
        if have.shape != want.shape {
            structural.push(format!(
                "{what}: `{}` has shape {:?} in the run but {:?} in the reference",
                want.name, have.shape, want.shape
            ));
            total.passed = false;
            continue;
        }
        let expected_len = numel(&want.shape);
        if expected_len != Some(want.values.len()) || expected_len != Some(have.values.len()) {
            structural.push(format!(
                "{what}: `{}` of shape {:?} holds {} values in the run and {} in the reference",
                want.name,
                want.shape,
                have.values.len(),
                want.values.len()
            ));
            total.passed = false;
            continue;
        }
        let dtype = looser_dtype(have.dtype, want.dtype);
        let check = policy.check(config, quantity, dtype);
        let at = At {
            quantity,
            step,
            tensor: Some(&want.name),
            shape: &want.shape,
        };
        let mut stats = Stats::default();
        for (i, (&a, &b)) in have.values.iter().zip(&want.values).enumerate() {
            stats.observe(a, b, dtype, &check, &at, Some(i));
        }
        total.merge(&stats);
        summaries.push(ParamSummary {
            name: want.name.clone(),
            dtype,
            shape: want.shape.clone(),
            stats,
        });
    }
    for have in run {
        if !ref_names.contains(have.name.as_str()) {
            structural.push(format!(
                "{what}: `{}` is in the run but not in the reference",
                have.name
            ));
            total.passed = false;
        }
    }
    (total, summaries)
}

/// Compares `run` against `reference` under `policy`. Never panics on mismatched records:
/// structural differences become failures with a diagnosis, and whatever still lines up is
/// compared so the numbers stay informative.
pub fn compare(run: &RunRecord, reference: &RunRecord, policy: &TolerancePolicy) -> Comparison {
    let mut comparing = ToleranceRun::new(run, reference, policy);
    let steps = (0..comparing.step_count())
        .map(|step| comparing.compare_step(step))
        .collect();
    let final_state = comparing.compare_final_state();
    comparing.finish(steps, final_state)
}

/// One scalar series (the loss or the gradient norm) under comparison: how its values are
/// judged and what they measured so far, so each step's pair is one call.
struct ScalarSeries {
    quantity: Quantity,
    check: Check,
    stats: Stats,
}

impl ScalarSeries {
    /// Compares the series' values at `step`; `None` when a side has no value there.
    fn diff_at(
        &mut self,
        run: &[f64],
        reference: &[f64],
        step: usize,
        dtype: DType,
    ) -> Option<ScalarDiff> {
        let (&a, &b) = (run.get(step)?, reference.get(step)?);
        let at = At {
            quantity: self.quantity,
            step: Some(step),
            tensor: None,
            shape: &[],
        };
        Some(diff_scalar(&mut self.stats, a, b, dtype, &self.check, &at))
    }
}

/// Both sides' per-step gradients, when both recorded them.
type GradsPair<'a> = Option<(&'a Vec<Vec<NamedTensor>>, &'a Vec<Vec<NamedTensor>>)>;

/// One tolerance comparison in progress: what it compares and under which policy, and what
/// the steps measured so far, shared by the per-step and the final-state passes of
/// [`compare`].
struct ToleranceRun<'a> {
    run: &'a RunRecord,
    reference: &'a RunRecord,
    policy: &'a TolerancePolicy,
    config: &'a str,
    grads_pair: GradsPair<'a>,
    /// The dtype the scalars are judged in.
    scalar: DType,
    structural: Vec<String>,
    losses: ScalarSeries,
    grad_norms: ScalarSeries,
    grads_total: Option<Stats>,
    grad_summaries: Vec<ParamSummary>,
}

impl<'a> ToleranceRun<'a> {
    /// Starts a comparison with what does not line up before any value is compared.
    fn new(run: &'a RunRecord, reference: &'a RunRecord, policy: &'a TolerancePolicy) -> Self {
        let config = run.spec.config.as_str();
        let grads_pair = match (&run.grads, &reference.grads) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => None,
        };
        let scalar = policy.scalar_dtype();
        let series = |quantity| ScalarSeries {
            quantity,
            check: policy.check(config, quantity, scalar),
            stats: Stats::default(),
        };
        ToleranceRun {
            run,
            reference,
            policy,
            config,
            grads_pair,
            scalar,
            structural: structural_mismatches(run, reference),
            losses: series(Quantity::Loss),
            grad_norms: series(Quantity::GradNorm),
            grads_total: grads_pair.map(|_| Stats::default()),
            grad_summaries: Vec::new(),
        }
    }

    /// The steps to compare: the longest series of either side, so a step one side lacks
    /// fails rather than goes unseen.
    fn step_count(&self) -> usize {
        let (run, reference) = (self.run, self.reference);
        [
            run.losses.len(),
            reference.losses.len(),
            run.grad_norms.len(),
            reference.grad_norms.len(),
            self.grads_pair.map_or(0, |(a, b)| a.len().max(b.len())),
        ]
        .into_iter()
        .max()
        .unwrap_or(0)
    }

    /// Compares everything recorded at `step`: the loss, the gradient norm and, when both
    /// sides recorded them, the gradients. A value one side lacks fails the step.
    fn compare_step(&mut self, step: usize) -> StepComparison {
        let (run, reference) = (self.run, self.reference);
        let loss = self
            .losses
            .diff_at(&run.losses, &reference.losses, step, self.scalar);
        let grad_norm =
            self.grad_norms
                .diff_at(&run.grad_norms, &reference.grad_norms, step, self.scalar);
        let mut passed = [&loss, &grad_norm]
            .into_iter()
            .all(|d| d.as_ref().is_some_and(|d| d.passed));
        let grads = match self.grads_pair {
            Some((a, b)) => {
                let grads = match (a.get(step), b.get(step)) {
                    (Some(a), Some(b)) => Some(self.compare_grads(a, b, step)),
                    _ => None,
                };
                passed &= grads.as_ref().is_some_and(|g| g.passed);
                grads
            }
            None => None,
        };
        StepComparison {
            step,
            loss,
            grad_norm,
            grads,
            passed,
            envelope: None,
        }
    }

    /// Compares one step's gradients tensor by tensor and folds them into the run's totals.
    fn compare_grads(
        &mut self,
        run: &[NamedTensor],
        reference: &[NamedTensor],
        step: usize,
    ) -> Stats {
        let what = format!("gradients at step {step}");
        let set = TensorSet {
            what: &what,
            step: Some(step),
            quantity: Quantity::Grads,
            policy: self.policy,
            config: self.config,
        };
        let (stats, per_tensor) = diff_tensors(run, reference, &set, &mut self.structural);
        fold_summaries(&mut self.grad_summaries, per_tensor);
        if let Some(total) = self.grads_total.as_mut() {
            total.merge(&stats);
        }
        stats
    }

    /// Compares the final parameters and buffers.
    fn compare_final_state(&mut self) -> (Stats, Vec<ParamSummary>) {
        // Buffers are final state too: ranks that disagree on them diverge later (eval,
        // BatchNorm).
        let state = |r: &RunRecord| -> Vec<NamedTensor> {
            r.params.iter().chain(&r.buffers).cloned().collect()
        };
        let (run_state, reference_state) = (state(self.run), state(self.reference));
        let set = TensorSet {
            what: "final parameters and buffers",
            step: None,
            quantity: Quantity::Params,
            policy: self.policy,
            config: self.config,
        };
        diff_tensors(&run_state, &reference_state, &set, &mut self.structural)
    }

    /// The verdict, from the steps and the final state compared.
    fn finish(
        self,
        steps: Vec<StepComparison>,
        (params, param_summaries): (Stats, Vec<ParamSummary>),
    ) -> Comparison {
        let measured = Measured {
            structural: self.structural,
            losses: self.losses.stats,
            grad_norms: self.grad_norms.stats,
            params,
            grads: self.grads_total,
            param_summaries,
            grad_summaries: self.grad_summaries,
            steps,
        };
        let against = Against {
            reference: self.reference.spec.config.clone(),
            reference_spec: self.reference.spec.clone(),
            mode: self.policy.mode(),
            override_reason: self
                .policy
                .override_for(self.config)
                .map(|o| o.reason().to_owned()),
        };
        conclude(self.run, against, measured, None, None)
    }
}
