//! Grouped point-to-point: several sends and receives, possibly on several groups, posted
//! together and finished together, as PyTorch's `batch_isend_irecv` does.
//!
//! Why: NCCL's `ncclSend` completes only once the peer posted the matching `ncclRecv`
//! (rendezvous). Two ranks that each send before they receive, one operation at a time, hang
//! as soon as the messages are too large for NCCL to buffer. Posting a rank's sends and
//! receives of one moment as one batch (`ncclGroupStart` … `ncclGroupEnd` on NCCL) lets each
//! send meet its receive whatever the order inside the batch. The CPU backend proves code free
//! of that hang in its rendezvous mode ([`crate::comm::PointToPoint::Rendezvous`]).

use crate::comm::{CommError, Work};

pub use super::p2p_op::{P2pKind, P2pOp};

/// A posted batch: what must finish before received tensors are read, and the sends, which
/// a caller may leave running (their bytes are the backend's) and wait for later.
pub struct Posted {
    /// Works covering every receive of the batch (on NCCL, a group's whole share of it).
    pub receives: Vec<Work>,
    /// Works covering only sends.
    pub sends: Vec<Work>,
}

/// Posts every operation of `ops` at once, waiting for none: no operation of the batch
/// needs another to finish first, so a batch never waits on itself. Within one group and
/// direction operations keep their order (messages between two ranks arrive in the order
/// sent). When every group is an NCCL group the batch is one `ncclGroupStart` …
/// `ncclGroupEnd`; elsewhere receives are posted first, then sends, each asynchronously.
///
/// On an error the operations already posted are waited for before it is returned (their
/// tensors must not be touched while a transfer may still use them).
pub fn post_batch(ops: &[P2pOp<'_>]) -> Result<Posted, CommError> {
    let mut posted = Posted {
        receives: Vec::new(),
        sends: Vec::new(),
    };
    if ops.is_empty() {
        return Ok(posted);
    }
    #[cfg(feature = "nccl")]
    {
        let nccl: Option<Vec<_>> = ops
            .iter()
            .map(|op| {
                op.group
                    .backend_group()
                    .and_then(|g| g.downcast_ref::<crate::comm::nccl::NcclGroup>())
            })
            .collect();
        if let Some(groups) = nccl {
            for (receives, work) in crate::comm::nccl::grouped_p2p(ops, &groups)? {
                if receives {
                    posted.receives.push(work);
                } else {
                    posted.sends.push(work);
                }
            }
            return Ok(posted);
        }
    }
    // Receives first: a rendezvous send on this rank can then meet a receive the peer posts in
    // its own batch, whatever order the peer listed them in.
    for kind in [P2pKind::Recv, P2pKind::Send] {
        for op in ops.iter().filter(|op| op.kind == kind) {
            let result = match kind {
                P2pKind::Send => op.group.send_async(op.tensor, op.peer, op.tag),
                P2pKind::Recv => op.group.recv_async(op.tensor, op.peer, op.tag),
            };
            match (result, kind) {
                (Ok(work), P2pKind::Recv) => posted.receives.push(work),
                (Ok(work), P2pKind::Send) => posted.sends.push(work),
                (Err(e), _) => {
                    let _ = wait_all(posted.receives.into_iter().chain(posted.sends));
                    return Err(e);
                }
            }
        }
    }
    Ok(posted)
}

/// [`post_batch`], then waits for every operation of it: PyTorch's `batch_isend_irecv`
/// followed by waiting on its works.
pub fn batch_isend_irecv(ops: &[P2pOp<'_>]) -> Result<(), CommError> {
    let posted = post_batch(ops)?;
    wait_all(posted.receives.into_iter().chain(posted.sends))
}

/// Waits for every work, returning the first error (every work is waited for even after
/// one failed).
pub fn wait_all(works: impl IntoIterator<Item = Work>) -> Result<(), CommError> {
    let mut first_error = None;
    for work in works {
        if let Err(e) = work.wait() {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}
