//! The groups a pipeline's stages exchange activations and gradients over: one two-rank
//! group per cross-rank edge and direction.
//!
//! Apart from the groups' creation ([`super::groups`]) so that the executor and the shape
//! handshake, which only use them, need nothing else of the pipeline's setup.

use crate::comm::ProcessGroup;
use std::collections::HashMap;
use std::sync::Arc;

/// Which way a cross-rank edge's messages travel. Each way has a group of its own, so a
/// send left pending one way (the executor never waits for its sends before the step ends)
/// never queues a transfer the other way behind it: on NCCL, operations of one group run in
/// issue order on one stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Way {
    /// Layer outputs, producer to consumer (`pp-edge` groups).
    Activations,
    /// Their gradients, consumer to producer (`pp-grad` groups).
    Gradients,
}

/// The groups of every cross-rank edge this rank is on, by (producer stage, consumer stage,
/// way); the producer is group rank 0 in both.
pub(crate) type EdgeGroups = HashMap<(usize, usize, Way), Arc<dyn ProcessGroup>>;
