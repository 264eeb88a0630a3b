//! Parity: is a parallel run numerically the same training as its reference?
//!
//! [`compare`] judges one [`RunRecord`](lockstep_core::record::RunRecord) against another
//! under a [`TolerancePolicy`] and returns a [`Comparison`] with every number a report needs.
//! Reports over many comparisons live in [`crate::report`].
//!
//! A DDP run whose one loss is a rounding away from the single-device reference passes under
//! the dtype's tolerance and fails a bitwise policy, which names the step:
//!
//! ```
//! use lockstep_core::comm::DType;
//! use lockstep_core::record::{NamedTensor, RunRecord, RunSpec};
//! use lockstep_harness::parity::{compare, TolerancePolicy};
//!
//! let record = |config: &str, loss: f64| {
//!     let spec = RunSpec {
//!         model: "mlp".into(),
//!         config: config.into(),
//!         world_size: 2,
//!         backend: "cpu".into(),
//!         dtype: "fp32".into(),
//!         steps: 1,
//!         seed: 0,
//!     };
//!     let mut r = RunRecord::start(spec, false);
//!     r.losses.push(loss);
//!     r.grad_norms.push(0.5);
//!     let w = tch::Tensor::from_slice(&[1.0f32, 2.0]);
//!     r.params.push(NamedTensor::capture("fc.weight", &w).unwrap());
//!     r
//! };
//! let reference = record("single", 0.25);
//! let ddp = record("ddp", 0.25 + 1e-8);
//!
//! assert!(compare(&ddp, &reference, &TolerancePolicy::dtype_table(DType::F32)).passed);
//! let strict = compare(&ddp, &reference, &TolerancePolicy::bitwise(DType::F32));
//! assert!(!strict.passed);
//! assert_eq!(strict.first_failure.unwrap().step, Some(0));
//! ```

mod arbiter;
mod compare;
mod comparison;
mod envelope;
mod tolerance;
mod verdict;

pub use arbiter::{arbitrate, arbitrate_with_spread, ArbiterLog};
pub use envelope::{ArbiterSummary, Envelope, EnvelopePoint, StepEnvelope, ENVELOPE};

pub use compare::{
    compare, location, unravel, Comparison, FailurePoint, ParamSummary, ScalarDiff, Stats,
    StepComparison,
};
pub use tolerance::{
    looser_dtype, ulp_distance, Check, Mode, Override, Quantity, Reason, Tolerance, TolerancePolicy,
};

/// Why a tolerance policy could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParityError {
    /// An override (or a [`Reason`]) was given an empty or blank justification: loosening a
    /// tolerance silently is exactly what the policy exists to prevent.
    #[error("a tolerance override needs a written reason")]
    MissingReason,
    /// A tolerance part was negative, NaN or infinite.
    #[error("invalid tolerance rtol={rtol}, atol={atol}: both must be finite and non-negative")]
    InvalidTolerance {
        /// The rejected relative tolerance.
        rtol: f64,
        /// The rejected absolute tolerance.
        atol: f64,
    },
}

/// Formats a number for people: `0`, `NaN`, `inf`, or three significant digits (the
/// comparisons' words and the reports' cells alike).
pub(crate) fn fmt_num(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{x:.3e}")
    }
}
