//! What a comparison reports: the [`Comparison`] of one run against one reference and its
//! parts (per-series [`Stats`], per-step and per-tensor verdicts, the [`FailurePoint`] where
//! it first went wrong), shared by the tolerance and the fp64 arbiter paths.

use super::envelope::{ArbiterSummary, EnvelopePoint, StepEnvelope};
use super::fmt_num;
use super::tolerance::{Mode, Quantity};
use lockstep_core::comm::DType;
use lockstep_core::consistency::CrossRankCheck;
use lockstep_core::num;
use lockstep_core::record::{MemoryStats, RunSpec};
use serde::{Deserialize, Serialize};
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

impl Stats {
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
