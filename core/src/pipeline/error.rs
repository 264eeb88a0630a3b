//! Everything planning or running a pipeline can fail with, in a file of its own: the options
//! hold a partition method, and partitioning fails with this error, so neither file needs
//! the other.

use super::schedule::ScheduleError;
use crate::failure::{split_failure_from, SplitFailure};

/// Everything planning or running a pipeline can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// The layers cannot be cut as asked.
    #[error("partition: {0}")]
    Partition(String),
    /// The pipeline does not fit the model, the world or the data.
    #[error("pipeline plan: {0}")]
    InvalidPlan(String),
    /// The schedule breaks a rule, is invalid, or deadlocks.
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    /// Two stages disagree on what crosses between them.
    #[error(
        "stage {producer} and stage {consumer} disagree on the tensors between them: stage \
         {producer} announced {announced}; stage {consumer} expects {expected}"
    )]
    ShapeMismatch {
        /// The stage that sends the tensors.
        producer: usize,
        /// The stage that receives them.
        consumer: usize,
        /// Shapes and dtypes the producer announced.
        announced: String,
        /// Shapes and dtypes the consumer's model stage takes.
        expected: String,
    },
    /// An action could not run (its inputs are missing: the schedule is wrong).
    #[error("pipeline execution: {0}")]
    Execution(String),
    /// What any model-splitting run can fail with (the model, a collective, the loop...).
    #[error(transparent)]
    Failed(Box<SplitFailure>),
}

split_failure_from!(PipelineError);
