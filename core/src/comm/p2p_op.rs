//! One send or receive of a grouped point-to-point batch ([`super::p2p`]), in a file of its
//! own: the backends that issue batches (NCCL's grouped calls) take these operations, and the
//! batch function dispatches to them, so neither needs the other.

use crate::comm::ProcessGroup;
use tch::Tensor;

/// Which half of a point-to-point transfer an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum P2pKind {
    /// Sends the tensor to the peer.
    Send,
    /// Receives into the tensor from the peer.
    Recv,
}

/// One send or receive of a batch.
pub struct P2pOp<'a> {
    /// The group the peer is named in.
    pub group: &'a dyn ProcessGroup,
    /// Send or receive.
    pub kind: P2pKind,
    /// What is sent, or where the received bytes go.
    pub tensor: &'a Tensor,
    /// The peer's rank in `group`.
    pub peer: usize,
    /// Matched against the peer's tag by backends that have tags.
    pub tag: u64,
}
