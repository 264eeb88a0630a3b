//! Parity: is a parallel run numerically the same training as its reference?
//!
//! [`compare`] judges one [`RunRecord`](lockstep_core::record::RunRecord) against another
//! under a [`TolerancePolicy`] and returns a [`Comparison`] with every number a report needs.
//! Reports over many comparisons live in [`crate::report`].

mod compare;
mod tolerance;

pub use compare::{
    compare, Comparison, FailurePoint, ParamSummary, ScalarDiff, Stats, StepComparison,
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
