//! Pipeline parallelism on plain models.
//!
//! A [`plan_pipeline`] cuts a zoo model's ordered layer list into stages ([`partition`]),
//! places them on ranks (one or several virtual stages each, loop- or V-style), learns from
//! one probe forward which layer outputs each stage needs from earlier ones ([`dataflow`]),
//! and builds the schedule as data: per-rank action lists, lowered with their sends and
//! receives, validated and simulated before any rank starts ([`schedule`]).
//! [`train_pipeline`] then runs the actions on every rank (`executor`): each stage runs the
//! model's own forward with the other stages' layers substituted (`stage`), so no model
//! learns that it is pipelined. Tied weights live on every stage that uses them, start from
//! the lowest holder's value and have their gradients summed among holders after the last
//! backward; microbatch losses are scaled so the accumulated gradient is the reference's
//! ([`microbatch`]); [`microbatched_reference`] is the one-process run a pipeline equals bit
//! for bit where the math allows.

pub mod dataflow;
mod executor;
mod handshake;
pub mod microbatch;
pub mod partition;
pub mod plan;
pub mod reference;
pub mod run;
pub mod schedule;
mod stage;
pub mod stage_parallel;
pub mod trace;

pub use partition::PartitionMethod;
pub use plan::{plan_pipeline, PipelineFault, PipelineOptions, PipelinePlan, ScheduleChoice};
pub use reference::{microbatched_reference, teacher_forced_microbatched};
pub use run::{train_pipeline, train_pipeline_with, PipelineRun};
pub use schedule::{ScheduleError, ScheduleKind};
pub use stage_parallel::StageParallel;

use crate::autograd::AutogradError;
use crate::comm::CommError;
use crate::train::TrainError;
use lockstep_models::ModelError;

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
    /// Building, splitting or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A send, receive or collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// The autograd bridge failed (backward across a stage boundary).
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// The optimizer step or gradient handling failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// FSDP's sharding of a stage (PP×FSDP) failed.
    #[error(transparent)]
    Shard(#[from] crate::fsdp::FsdpError),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
