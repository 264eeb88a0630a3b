//! Expert parallelism's face: its options (the EP size, the dispatcher, the capacity, the
//! data dimension stacked on it), the bugs it can plant on purpose, and its error type.

use super::moe::Dispatcher;
use crate::compose::DataParallel;
use crate::failure::{split_failure_from, SplitFailure};

/// How an expert-parallel run is configured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpOptions {
    /// Ranks the experts of a layer are spread over; the world is `world / ep` replicas.
    pub ep: usize,
    /// How tokens reach their experts' ranks (two implementations, cross-checked).
    pub dispatcher: Dispatcher,
    /// `None`: no token is dropped (the zoo's dense layer computes every choice).
    pub capacity_factor: Option<f64>,
    /// How the dense (non-expert) parameters are kept over the world: replicated and
    /// all-reduced (DDP), or sharded (EP×FSDP: one FSDP unit over every rank).
    pub data_parallel: DataParallel,
    /// A planted bug (checker tests only).
    pub fault: Option<EpFault>,
}

/// A planted expert-parallel bug.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EpFault {
    /// Expert gradients counted once per `ep` rank, as if reduced over `ep` as well (EP = 2
    /// doubles them).
    ExpertGradsReducedOverEp,
    /// The capacity check off by one: every expert takes one choice more than its
    /// capacity, so a rank drops one token choice fewer per overflowing expert.
    CapacityOffByOne,
    /// The gradient norm (and so clipping) counts this rank's own experts only, not summed
    /// over the EP group (Megatron-LM#5916, #7165).
    NormOverOwnExperts,
}

/// Everything an expert-parallel run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum EpError {
    /// The options cannot run (e.g. an `ep` that does not divide the experts or world).
    #[error("expert parallel: {0}")]
    Invalid(String),
    /// Routing or dispatching tokens failed.
    #[error(transparent)]
    Moe(#[from] super::moe::MoeError),
    /// A parallel layer could not be built from the model's layer.
    #[error(transparent)]
    Layers(#[from] crate::tensor_parallel::layers::TpLayerError),
    /// What any model-splitting run can fail with (the model, a collective, the loop...).
    #[error(transparent)]
    Failed(Box<SplitFailure>),
}

split_failure_from!(EpError);
