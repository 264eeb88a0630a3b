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
mod edges;
mod error;
mod executor;
mod groups;
mod handshake;
pub mod microbatch;
pub mod options;
pub mod partition;
pub mod plan;
pub mod reference;
pub mod run;
pub mod schedule;
mod stage;
pub mod stage_parallel;
mod strategy;
pub mod trace;

pub use error::PipelineError;
pub use options::{PipelineFault, PipelineOptions, ScheduleChoice};
pub use partition::PartitionMethod;
pub use plan::{plan_pipeline, PipelinePlan};
pub use reference::{microbatched_reference, teacher_forced_microbatched};
pub use run::{train_pipeline, train_pipeline_with, PipelineRun};
pub use schedule::{ScheduleError, ScheduleKind};
pub use stage_parallel::StageParallel;
