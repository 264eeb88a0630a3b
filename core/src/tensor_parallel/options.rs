//! Tensor parallelism's face: its options (the TP size, sequence parallelism, the data
//! dimension stacked on it), the bugs it can plant on purpose, and its error type.

use super::plan::TpPlanError;
use crate::compose::DataParallel;
use crate::failure::{split_failure_from, SplitFailure};

/// A planted tensor-parallel bug (checker tests only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpFault {
    /// The column-parallel entry passes gradients through without the all-reduce, as a
    /// row-parallel pair whose backward lacks its reduction.
    MissingBackwardAllReduce,
    /// Sequence-parallel LayerNorm gradients are not summed over the TP group.
    SkipSequenceGradReduce,
    /// Every TP rank applies the first rank's slice of a split activation's dropout mask
    /// (ranks drawing the same mask where they must differ).
    SameDropoutMask,
}

/// How a tensor-parallel run is configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Tensor-parallel size; the world is `tp × (world / tp)` data-parallel replicas.
    pub tp: usize,
    /// Megatron sequence parallelism: activations between blocks live on sequence shards.
    pub sequence_parallel: bool,
    /// How the data dimension (`world / tp` replicas) keeps parameters and reduces
    /// gradients: replicated (DDP), sharded (FSDP×TP) or hybrid-sharded (HSDP×TP).
    pub data_parallel: DataParallel,
    /// A planted bug (checker tests only).
    pub fault: Option<TpFault>,
}

/// Everything a tensor-parallel run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// The plan does not fit the model or the TP size.
    #[error(transparent)]
    Plan(#[from] TpPlanError),
    /// A parallel layer could not be built from the model's layer.
    #[error(transparent)]
    Layers(#[from] super::layers::TpLayerError),
    /// The run cannot go ahead as configured (a sequence length the TP size does not divide, a
    /// batch without its target).
    #[error("tensor parallel: {0}")]
    Invalid(String),
    /// What any model-splitting run can fail with (the model, a collective, the loop...).
    #[error(transparent)]
    Failed(Box<SplitFailure>),
}

split_failure_from!(TpError);
