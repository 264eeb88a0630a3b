//! The pipeline's face: its options (the schedule, the stages and microbatches, the
//! partition, checkpointing), the bugs it can plant on purpose, and its error type.

use super::partition::PartitionMethod;
use super::schedule::{Schedule, ScheduleKind};

/// Which schedule a pipeline runs.
#[derive(Clone, Debug, PartialEq)]
pub enum ScheduleChoice {
    /// A built-in schedule, generated for the run's (p, v, m).
    Builtin(ScheduleKind),
    /// A schedule given as data (loaded from CSV): ranks, stages and microbatches are its own.
    Custom(Schedule),
}

/// A bug a checker test plants in a pipeline run, to prove the parity engine (or the
/// simulator and the timeout) catches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PipelineFault {
    /// Tied weights' gradients are not all-reduced among the stages holding them.
    SkipTiedReduce,
    /// Microbatch losses are not scaled (a mean loss is not divided by `m`).
    UnscaledLoss,
    /// The first stage feeds microbatch 1's inputs as microbatch 0 and the reverse.
    SwapMicrobatches,
    /// The named action (`1SEND_B0`) is removed from the rank's list after validation.
    DropAction(String),
    /// The first cross-rank edge announces a wrong shape in the per-step handshake.
    WrongShape,
    /// PP×FSDP: each stage's `REDUCE_GRAD` runs right after its first backward instead of
    /// after its last, so later microbatches' gradients never reach the shards.
    ReduceGradBeforeLastMicrobatch,
    /// Checkpoint recompute keeps only the last gradient of a saved boundary that several
    /// later segments of its stage consume (an encoder output feeding every decoder layer), so
    /// the others are lost: overwriting instead of accumulating.
    OverwriteSavedBoundaryGrad,
    /// PP × EP: expert gradients, summed over their holders, divided by the world size (as
    /// expert parallelism alone divides them) instead of the stage's data group: a divisor
    /// from the wrong mesh dimension, `pp` times too small.
    ExpertGradsScaledByWorld,
}

/// How a pipeline run is configured.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineOptions {
    /// A built-in schedule or one loaded from CSV.
    pub schedule: ScheduleChoice,
    /// Stages per rank (`v`); built-in schedules only.
    pub virtual_stages: usize,
    /// Microbatches per step (`m`); built-in schedules only.
    pub microbatches: usize,
    /// How layers are assigned to stages.
    pub partition: PartitionMethod,
    /// Recompute every `k` layers of a stage in backward instead of keeping activations.
    pub checkpoint_every: Option<usize>,
    /// Data-parallel replicas of the whole pipeline (PP×DP); 1 for a pure pipeline.
    pub data_parallel: usize,
    /// A planted bug (checker tests only).
    pub fault: Option<PipelineFault>,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            schedule: ScheduleChoice::Builtin(ScheduleKind::OneFOneB),
            virtual_stages: 1,
            microbatches: 4,
            partition: PartitionMethod::Uniform,
            checkpoint_every: None,
            data_parallel: 1,
            fault: None,
        }
    }
}
