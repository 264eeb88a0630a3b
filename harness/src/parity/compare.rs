//! The parity engine: one run against one reference, value by value, with the numbers a
//! person needs to judge the verdict (how far off, relative to what was allowed, and where it
//! first went wrong).

use super::envelope::{ArbiterSummary, EnvelopePoint, StepEnvelope};
use super::tolerance::{looser_dtype, ulp_distance, Check, Mode, Quantity, TolerancePolicy};
use crate::report::{fmt_num, num};
use lockstep_core::comm::DType;
use lockstep_core::consistency::{CrossRankCheck, CrossRankMismatch};
use lockstep_core::record::{MemoryStats, NamedTensor, RunRecord, RunSpec};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::fmt;

/// Where a value first failed its check, with the values themselves so the report needs no
/// second look at the records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FailurePoint {
    /// Which series failed.
    pub quantity: Quantity,
    /// Training step (0-based); `None` for the final parameters.
    pub step: Option<usize>,
    /// Tensor name, for parameters and gradients.
    pub tensor: Option<String>,
    /// Flat element index inside the tensor.
    pub index: Option<usize>,
    /// The same element as an index per dimension (`[3, 1]` in a `[4, 2]` tensor), so a
    /// person can find it without unravelling the flat index. Absent in reports written
    /// before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub element: Option<Vec<usize>>,
    /// The run's value.
    #[serde(with = "num")]
    pub actual: f64,
    /// The reference's value.
    #[serde(with = "num")]
    pub expected: f64,
    /// `|actual − expected|` (infinite when either is NaN).
    #[serde(with = "num")]
    pub abs_err: f64,
    /// The error the tolerance allowed here; `None` in bitwise mode.
    #[serde(with = "num::opt")]
    pub allowed: Option<f64>,
    /// Distance in ULPs in `dtype`.
    pub ulp: u64,
    /// The dtype the pair was judged in.
    pub dtype: DType,
    /// Under the fp64 arbiter: the distances the verdict weighed (`actual` and `expected` are
    /// then the run's and the float64 shadow's values at the worst element).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envelope: Option<EnvelopePoint>,
}

impl fmt::Display for FailurePoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&location(self.quantity, self.tensor.as_deref(), self.step))?;
        match (&self.element, self.index) {
            (Some(e), _) if !e.is_empty() => {
                let dims: Vec<String> = e.iter().map(usize::to_string).collect();
                write!(f, ", element [{}]", dims.join(","))?;
            }
            (None, Some(i)) => write!(f, ", element [{i}] (flat)")?,
            _ => {}
        }
        let ulp = if self.ulp == u64::MAX {
            "NaN involved".to_owned()
        } else {
            format!("{} ULP in {}", self.ulp, self.dtype)
        };
        if let Some(e) = &self.envelope {
            write!(
                f,
                ": |run − fp64| {} > {} × |fp32 reference − fp64| {} + floor {} (margin {:.1})",
                fmt_num(e.run_to_f64),
                fmt_num(e.k),
                fmt_num(e.reference_to_f64),
                fmt_num(e.floor),
                e.margin
            )?;
            return write!(
                f,
                "; there {} vs fp64 {} ({ulp})",
                self.actual, self.expected
            );
        }
        write!(
            f,
            ": {} vs reference {} (|Δ| {}",
            self.actual,
            self.expected,
            fmt_num(self.abs_err)
        )?;
        match self.allowed {
            Some(a) => write!(f, " > allowed {}", fmt_num(a))?,
            None => write!(f, ", bitwise mode")?,
        }
        write!(f, ", {ulp})")
    }
}

/// Where a compared value sits, in the words every diagnosis uses: `gradient of `w` at step
/// 3`, `final value of `w``, `loss at step 0`, `grad_norm at step 0`. Tensors are named by
/// what they are (a gradient, a parameter's final value) because that is where a person
/// starts looking for the bug.
pub fn location(quantity: Quantity, tensor: Option<&str>, step: Option<usize>) -> String {
    let when = step.map_or_else(
        || " after the last step".to_owned(),
        |s| format!(" at step {s}"),
    );
    match (quantity, tensor) {
        (Quantity::Grads, Some(t)) => format!("gradient of `{t}`{when}"),
        (Quantity::Params, Some(t)) => format!("final value of `{t}`"),
        (q, Some(t)) => format!("{q} `{t}`{when}"),
        (q, None) => format!("{q}{when}"),
    }
}

/// The per-dimension index of flat (row-major) index `flat` in a tensor of `shape`; `None`
/// when the shape has a negative dimension or does not hold `flat`.
pub fn unravel(flat: usize, shape: &[i64]) -> Option<Vec<usize>> {
    let dims: Vec<usize> = shape
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<_>>()?;
    if flat >= dims.iter().product::<usize>() {
        return None;
    }
    let mut rest = flat;
    let mut index = vec![0; dims.len()];
    for (slot, &d) in index.iter_mut().zip(&dims).rev() {
        *slot = rest % d;
        rest /= d;
    }
    Some(index)
}

/// Error statistics of one series (or one tensor): the worst value of each measure, which
/// need not all come from the same element.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Values compared.
    pub compared: usize,
    /// Largest `|a − b|`.
    #[serde(with = "num")]
    pub max_abs_err: f64,
    /// Largest `|a − b| / |b|` (infinite where `b` is 0 and `a` is not).
    #[serde(with = "num")]
    pub max_rel_err: f64,
    /// Largest ULP distance in the judged dtype (`u64::MAX` for NaN).
    pub max_ulp: u64,
    /// Largest error / allowed error: at most 1 passes. In bitwise mode 0 or infinite.
    #[serde(with = "num")]
    pub margin: f64,
    /// Every value passed.
    pub passed: bool,
    /// The first value that failed, in checking order.
    pub first_failure: Option<FailurePoint>,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            compared: 0,
            max_abs_err: 0.0,
            max_rel_err: 0.0,
            max_ulp: 0,
            margin: 0.0,
            passed: true,
            first_failure: None,
        }
    }
}

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

    /// Folds `other` into `self`: worst of each measure; the earlier first failure is kept.
    pub fn merge(&mut self, other: &Stats) {
        self.compared += other.compared;
        self.max_abs_err = self.max_abs_err.max(other.max_abs_err);
        self.max_rel_err = self.max_rel_err.max(other.max_rel_err);
        self.max_ulp = self.max_ulp.max(other.max_ulp);
        self.margin = self.margin.max(other.margin);
        self.passed &= other.passed;
        if self.first_failure.is_none() {
            self.first_failure.clone_from(&other.first_failure);
        }
    }
}

/// One scalar (a loss or a gradient norm) against its reference.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ScalarDiff {
    /// The run's value.
    #[serde(with = "num")]
    pub run: f64,
    /// The reference's value.
    #[serde(with = "num")]
    pub reference: f64,
    /// `|run − reference|`.
    #[serde(with = "num")]
    pub abs_err: f64,
    /// `|run − reference| / |reference|`.
    #[serde(with = "num")]
    pub rel_err: f64,
    /// ULP distance in the policy's scalar dtype.
    pub ulp: u64,
    /// Error / allowed error.
    #[serde(with = "num")]
    pub margin: f64,
    /// Within tolerance.
    pub passed: bool,
    /// Under the fp64 arbiter: the distances behind the verdict (`reference` is then the
    /// float64 shadow's value).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envelope: Option<EnvelopePoint>,
}

/// Everything compared at one training step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepComparison {
    /// 0-based step.
    pub step: usize,
    /// The loss pair; `None` when one side has no value for this step.
    pub loss: Option<ScalarDiff>,
    /// The gradient-norm pair; `None` when one side has no value for this step.
    pub grad_norm: Option<ScalarDiff>,
    /// All gradients of this step, when both runs recorded them.
    pub grads: Option<Stats>,
    /// Every value of this step passed and both sides have it.
    pub passed: bool,
    /// Under the fp64 arbiter: the step's distances to float64, run and fp32 reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub envelope: Option<StepEnvelope>,
}

/// The verdict for one final parameter.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParamSummary {
    /// Parameter name.
    pub name: String,
    /// Dtype it was judged in (the looser of the two sides).
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<i64>,
    /// Its error statistics.
    pub stats: Stats,
}

/// One run against one reference: the unit a parity report is made of.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Model zoo name.
    pub model: String,
    /// The run's parallel configuration.
    pub config: String,
    /// The reference's configuration name (e.g. `ddp`, `single`).
    pub reference: String,
    /// The run's identity.
    pub run_spec: RunSpec,
    /// The reference's identity.
    pub reference_spec: RunSpec,
    /// Mode of the policy.
    pub mode: Mode,
    /// The reason of the override that applied to this configuration, if one did.
    pub override_reason: Option<String>,
    /// The whole comparison passed (values and structure).
    pub passed: bool,
    /// Why it failed, in one paragraph; `None` when it passed.
    pub diagnosis: Option<String>,
    /// Structural mismatches (missing parameters, shapes, step counts).
    pub structural: Vec<String>,
    /// The culprit: the earliest failing tensor by step (per-step gradients when both sides
    /// recorded them, within a step in backward order, last parameter first; final parameters
    /// and buffers count as after the last step), or, when no tensor failed, the earliest
    /// failing loss or gradient norm. A tensor is named first because a loss or norm only
    /// says *that* something went wrong, a tensor says *where*.
    pub first_failure: Option<FailurePoint>,
    /// When [`Comparison::first_failure`] is a tensor: the earliest failing loss or gradient
    /// norm (the loss first at one step), the symptom the culprit caused, or `None` when every
    /// scalar passed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub derived_failure: Option<FailurePoint>,
    /// Loss series.
    pub losses: Stats,
    /// Gradient-norm series.
    pub grad_norms: Stats,
    /// All final parameters together.
    pub params: Stats,
    /// All per-step gradients together, when both sides recorded them.
    pub grads: Option<Stats>,
    /// Per-parameter (and buffer) verdicts on the final values.
    pub param_summaries: Vec<ParamSummary>,
    /// Per-parameter verdicts on the gradients over every step (their first failure is the
    /// earliest failing step), when both sides recorded per-step gradients: what the
    /// per-parameter table and a report comparison's per-tensor drift read. Absent in
    /// reports written before it existed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grad_summaries: Vec<ParamSummary>,
    /// The run's cross-rank check (every rank's copy of each tensor bitwise equal), when its
    /// launcher made one: a mismatch fails the comparison and is its first failure, whatever
    /// rank 0's numbers say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_rank: Option<CrossRankCheck>,
    /// Per-step verdicts.
    pub steps: Vec<StepComparison>,
    /// The run's memory figures (rank 0's), when its wrapper measures any: carried so a
    /// report shows what a sharding configuration saved next to whether it was right.
    /// Absent in reports written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    /// Under the fp64 arbiter (mode `arbiter`): its constants and the quantity that came
    /// closest to its envelope.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arbiter: Option<ArbiterSummary>,
    /// Where the run's plan put each tensor (tensor and expert parallelism): what a report
    /// shows so a user sees their plan split their layers.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placements: Vec<lockstep_core::record::TensorPlacement>,
    /// The collectives the run issued in its first step (calls and bytes per operation and
    /// group), when it counted them; later steps issue the same unless the report says not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collectives_per_step: Option<Vec<lockstep_core::record::CollectiveEntry>>,
}

impl Comparison {
    /// The statistics of `q`, if it was compared.
    pub fn stats(&self, q: Quantity) -> Option<&Stats> {
        match q {
            Quantity::Loss => Some(&self.losses),
            Quantity::GradNorm => Some(&self.grad_norms),
            Quantity::Params => Some(&self.params),
            Quantity::Grads => self.grads.as_ref(),
        }
    }

    /// All compared quantities folded into one: the headline numbers of the comparison.
    pub fn overall(&self) -> Stats {
        let mut all = Stats::default();
        for q in Quantity::ALL {
            if let Some(s) = self.stats(q) {
                all.merge(s);
            }
        }
        all.first_failure.clone_from(&self.first_failure);
        all.passed = self.passed;
        all
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
    let config = run.spec.config.as_str();
    let mut structural = structural_mismatches(run, reference);
    let grads_pair = match (&run.grads, &reference.grads) {
        (Some(a), Some(b)) => Some((a, b)),
        _ => None,
    };

    let scalar = policy.scalar_dtype();
    let loss_check = policy.check(config, Quantity::Loss, scalar);
    let norm_check = policy.check(config, Quantity::GradNorm, scalar);
    let mut losses = Stats::default();
    let mut grad_norms = Stats::default();
    let mut grads_total = grads_pair.map(|_| Stats::default());
    let mut grad_summaries = Vec::new();

    let n_steps = [
        run.losses.len(),
        reference.losses.len(),
        run.grad_norms.len(),
        reference.grad_norms.len(),
        grads_pair.map_or(0, |(a, b)| a.len().max(b.len())),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    let mut steps = Vec::with_capacity(n_steps);
    for step in 0..n_steps {
        let mut passed = true;
        let loss = match (run.losses.get(step), reference.losses.get(step)) {
            (Some(&a), Some(&b)) => {
                let at = At {
                    quantity: Quantity::Loss,
                    step: Some(step),
                    tensor: None,
                    shape: &[],
                };
                let d = diff_scalar(&mut losses, a, b, scalar, &loss_check, &at);
                passed &= d.passed;
                Some(d)
            }
            _ => {
                passed = false;
                None
            }
        };
        let grad_norm = match (run.grad_norms.get(step), reference.grad_norms.get(step)) {
            (Some(&a), Some(&b)) => {
                let at = At {
                    quantity: Quantity::GradNorm,
                    step: Some(step),
                    tensor: None,
                    shape: &[],
                };
                let d = diff_scalar(&mut grad_norms, a, b, scalar, &norm_check, &at);
                passed &= d.passed;
                Some(d)
            }
            _ => {
                passed = false;
                None
            }
        };
        let grads = match grads_pair {
            Some((a, b)) => match (a.get(step), b.get(step)) {
                (Some(a), Some(b)) => {
                    let what = format!("gradients at step {step}");
                    let set = TensorSet {
                        what: &what,
                        step: Some(step),
                        quantity: Quantity::Grads,
                        policy,
                        config,
                    };
                    let (stats, per_tensor) = diff_tensors(a, b, &set, &mut structural);
                    fold_summaries(&mut grad_summaries, per_tensor);
                    if let Some(total) = grads_total.as_mut() {
                        total.merge(&stats);
                    }
                    passed &= stats.passed;
                    Some(stats)
                }
                _ => {
                    passed = false;
                    None
                }
            },
            None => None,
        };
        steps.push(StepComparison {
            step,
            loss,
            grad_norm,
            grads,
            passed,
            envelope: None,
        });
    }

    // Buffers are final state too: ranks that disagree on them diverge later (eval, BatchNorm).
    let run_state: Vec<NamedTensor> = run.params.iter().chain(&run.buffers).cloned().collect();
    let reference_state: Vec<NamedTensor> = reference
        .params
        .iter()
        .chain(&reference.buffers)
        .cloned()
        .collect();
    let set = TensorSet {
        what: "final parameters and buffers",
        step: None,
        quantity: Quantity::Params,
        policy,
        config,
    };
    let (params, param_summaries) =
        diff_tensors(&run_state, &reference_state, &set, &mut structural);

    let measured = Measured {
        structural,
        losses,
        grad_norms,
        params,
        grads: grads_total,
        param_summaries,
        grad_summaries,
        steps,
    };
    let against = Against {
        reference: reference.spec.config.clone(),
        reference_spec: reference.spec.clone(),
        mode: policy.mode(),
        override_reason: policy.override_for(config).map(|o| o.reason().to_owned()),
    };
    conclude(run, against, measured, None, None)
}

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
