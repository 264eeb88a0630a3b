//! The [`ProcessGroup`] surface of [`CpuGroup`]: the collectives (asynchronous, and
//! blocking ones that may run inline) and point to point, whose receive completes lazily in
//! [`PendingRecv`] when the caller waits.
//!
//! Apart from the group's queue ([`super::group`]): this file only maps trait calls onto the
//! group's jobs and handles sends and receives, which bypass the queue.

use super::exchange::{copy_bytes, Shared};
use super::group::{finish, CpuGroup};
use super::link::Payload;
use super::pool;
use super::tensor::Staged;
use super::wire::{Channel, Header};
use crate::comm::flight::{self, OpState};
use crate::comm::work::{lock, Completion, Latch};
use crate::comm::{CommError, OpKind, PointToPoint, ProcessGroup, ReduceOp, Work};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tch::Tensor;

/// A receive whose data is copied into the tensor when the caller waits for it.
struct PendingRecv {
    shared: Arc<Shared>,
    src: usize,
    seq: u64,
    tag: u64,
    target: Mutex<Option<Staged>>,
    latch: Arc<Latch>,
    flight_id: u64,
}

impl PendingRecv {
    fn receive(&self, t: &Staged) -> Result<(), CommError> {
        let sh = &self.shared;
        let msg = sh.link(self.src)?.inbox.take(
            (Channel::PointToPoint, self.seq, 0),
            self.src,
            sh.timeout,
        )?;
        let h = &msg.header;
        if msg.truncated {
            return Err(CommError::PeerLost {
                rank: self.src,
                reason: format!(
                    "rank {}'s connection broke in the middle of message #{}",
                    self.src, self.seq
                ),
            });
        }
        if h.tag != self.tag || h.dtype != Some(t.dtype) || h.elems as usize != t.numel() {
            return Err(CommError::Mismatch(format!(
                "group {} message #{} from rank {} to rank {} (this rank): expected tag {} with {}[{}] ({} elements), got tag {} with {} ({} elements)",
                sh.name,
                self.seq,
                self.src,
                sh.rank,
                self.tag,
                t.dtype,
                t.shape().iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
                t.numel(),
                h.tag,
                h.describe(),
                h.elems
            )));
        }
        // SAFETY: the staged tensor holds exactly msg.data.len() bytes (element count checked).
        unsafe { copy_bytes(msg.data.as_ptr(), t.ptr(), msg.data.len()) };
        pool::give(msg.data);
        Ok(())
    }
}

impl Completion for PendingRecv {
    fn wait(&self) -> Result<(), CommError> {
        let mut target = lock(&self.target);
        if let Some(t) = target.take() {
            flight::update(self.flight_id, OpState::Started);
            let result = self.receive(&t).and_then(|_| t.finish());
            finish(self.flight_id, &self.latch, result);
        }
        drop(target);
        self.latch.wait()
    }

    fn is_completed(&self) -> bool {
        self.latch.is_completed()
            || self
                .shared
                .link(self.src)
                .map(|l| l.inbox.contains((Channel::PointToPoint, self.seq, 0)))
                .unwrap_or(true)
    }
}

/// A send under [`PointToPoint::Rendezvous`]: its bytes are already on their way, and it
/// completes once the receiver's notice that it posted the matching receive arrives.
struct PendingSend {
    shared: Arc<Shared>,
    dst: usize,
    seq: u64,
    tag: u64,
    /// The write of the bytes, when the link's writer thread does it.
    written: Option<Arc<Latch>>,
    latch: Arc<Latch>,
    flight_id: u64,
    /// Held by the one waiter that takes the notice (a second waiter finds the latch done).
    waiting: Mutex<()>,
}

impl PendingSend {
    fn await_posted(&self) -> Result<(), CommError> {
        let sh = &self.shared;
        let notice = sh
            .link(self.dst)?
            .inbox
            .take((Channel::Posted, self.seq, 0), self.dst, sh.timeout)
            .map_err(|e| match e {
                CommError::Timeout { seconds, .. } => CommError::Timeout {
                    what: format!(
                        "rank {} to post the receive of message #{} (tag {}) that rank {} \
                         (this rank) sent in group {}: point-to-point is in rendezvous mode \
                         (as NCCL), so a send waits for its receive, and code that sends \
                         before receiving on both sides hangs",
                        self.dst, self.seq, self.tag, sh.rank, sh.name
                    ),
                    seconds,
                },
                other => other,
            })?;
        let h = &notice.header;
        if h.tag != self.tag {
            return Err(CommError::Mismatch(format!(
                "group {} message #{} from rank {} (this rank) to rank {}: sent with tag {}, \
                 but rank {} posted its receive with tag {}",
                sh.name, self.seq, sh.rank, self.dst, self.tag, self.dst, h.tag
            )));
        }
        pool::give(notice.data);
        match &self.written {
            Some(written) => written.wait(),
            None => Ok(()),
        }
    }
}

impl Completion for PendingSend {
    fn wait(&self) -> Result<(), CommError> {
        let waiting = lock(&self.waiting);
        if !self.latch.is_completed() {
            finish(self.flight_id, &self.latch, self.await_posted());
        }
        drop(waiting);
        self.latch.wait()
    }

    fn is_completed(&self) -> bool {
        self.latch.is_completed()
            || (self.written.as_ref().is_none_or(|w| w.is_completed())
                && self
                    .shared
                    .link(self.dst)
                    .map(|l| l.inbox.contains((Channel::Posted, self.seq, 0)))
                    .unwrap_or(true))
    }
}

impl ProcessGroup for CpuGroup {
    fn rank(&self) -> usize {
        self.shared.rank
    }
    fn size(&self) -> usize {
        self.shared.size
    }
    fn name(&self) -> &str {
        &self.shared.name
    }
    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }
    fn backend(&self) -> &'static str {
        "cpu"
    }

    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work, CommError> {
        self.all_reduce_job(tensor, op, false)
    }
    fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, CommError> {
        self.all_gather_job(output, input, false)
    }
    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        self.reduce_scatter_job(output, input, op, false)
    }
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work, CommError> {
        self.broadcast_job(tensor, root, false)
    }
    fn all_to_all_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work, CommError> {
        self.all_to_all_job(output, input, output_splits, input_splits, false)
    }
    fn barrier_async(&self) -> Result<Work, CommError> {
        self.barrier_job(false)
    }

    fn send_async(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<Work, CommError> {
        self.check_root(dst, "send destination")?;
        if dst == self.shared.rank {
            return Err(CommError::InvalidArgument("send to self".into()));
        }
        let t = Staged::new(tensor, false)?;
        let seq = self.send_seq[dst].fetch_add(1, Ordering::AcqRel);
        let flight_id = flight::record(
            &self.shared.name,
            seq,
            OpKind::Send,
            vec![t.shape()],
            Some(t.dtype),
            Some(dst),
            crate::comm::label::current(),
        );
        // The payload is copied, so the caller may reuse the tensor at once and two ranks that
        // send to each other before receiving cannot deadlock.
        let header = Header {
            channel: Channel::PointToPoint,
            op: OpKind::Send,
            dtype: Some(t.dtype),
            reduce: None,
            seq,
            tag,
            shape: t.shape(),
            elems: t.numel() as u64,
            payload: t.len() as u64,
        };
        let result = self
            .shared
            .link(dst)?
            .send(&header, Payload::Owned(t.bytes().to_vec()));
        let latch = Latch::new();
        if self.p2p == PointToPoint::Rendezvous {
            if let Ok(written) = &result {
                // NCCL's rule: the send is done only once the receiver posted its receive
                // (and, here, once its bytes left this process: a rank may exit after it).
                flight::update(flight_id, OpState::Started);
                return Ok(Work::new(Arc::new(PendingSend {
                    shared: self.shared.clone(),
                    dst,
                    seq,
                    tag,
                    written: written.clone(),
                    latch,
                    flight_id,
                    waiting: Mutex::new(()),
                })));
            }
        }
        finish(flight_id, &latch, result.map(|_| ()));
        Ok(Work::new(latch))
    }

    fn recv_async(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<Work, CommError> {
        self.check_root(src, "recv source")?;
        if src == self.shared.rank {
            return Err(CommError::InvalidArgument("recv from self".into()));
        }
        let t = Staged::new(tensor, true)?;
        let seq = self.recv_seq[src].fetch_add(1, Ordering::AcqRel);
        let flight_id = flight::record(
            &self.shared.name,
            seq,
            OpKind::Recv,
            vec![t.shape()],
            Some(t.dtype),
            Some(src),
            crate::comm::label::current(),
        );
        if self.p2p == PointToPoint::Rendezvous {
            // Tell the sender this receive is posted: under rendezvous that completes its send.
            let notice = Header {
                channel: Channel::Posted,
                op: OpKind::Recv,
                dtype: Some(t.dtype),
                reduce: None,
                seq,
                tag,
                shape: t.shape(),
                elems: 0,
                payload: 0,
            };
            if let Err(e) = self
                .shared
                .link(src)?
                .send(&notice, Payload::Owned(Vec::new()))
            {
                flight::update(flight_id, OpState::Failed(e.to_string()));
                return Err(e);
            }
        }
        Ok(Work::new(Arc::new(PendingRecv {
            shared: self.shared.clone(),
            src,
            seq,
            tag,
            target: Mutex::new(Some(t)),
            latch: Latch::new(),
            flight_id,
        })))
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_job(tensor, op, true)?.wait()
    }
    fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        self.all_gather_job(output, input, true)?.wait()
    }
    fn reduce_scatter(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_job(output, input, op, true)?.wait()
    }
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        self.broadcast_job(tensor, root, true)?.wait()
    }
    fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        self.all_to_all_job(output, input, output_splits, input_splits, true)?
            .wait()
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_job(true)?.wait()
    }
}
