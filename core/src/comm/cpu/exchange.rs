//! What every collective of a CPU group is built from: the group's shared state
//! ([`Shared`]: identity, links, timeout, shared-memory area), the local description of an
//! operation checked against every peer's message ([`Desc`]), sending, receiving and
//! checking messages, the control rounds and shared-memory publication that delimit the
//! shared-memory algorithms, and the small buffer helpers.
//!
//! Apart from the algorithms ([`super::algorithms`]) so that they read as the sequence of
//! exchanges they are, and from the group ([`super::group`]), which only queues them.

use super::link::{Link, Message, Payload};
use super::wire::{self, Channel, Header};
use super::SHM_MESSAGE;
use super::{pool, shm};
use crate::comm::work::{lock, Completion, Latch};
use crate::comm::{CommError, DType, OpKind, ReduceOp};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What every operation of a group reads: identity, links and timeout.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) links: Vec<Option<Link>>,
    pub(super) timeout: Duration,
    /// The shared-memory data path, when every member runs on this host.
    pub(super) shm: Option<Mutex<shm::ShmArea>>,
}

/// The local side of one collective, compared against every message a peer sends for it.
pub(super) struct Desc {
    pub(super) op: OpKind,
    pub(super) dtype: Option<DType>,
    pub(super) reduce: Option<ReduceOp>,
    pub(super) shape: Vec<i64>,
    /// Whether peers must pass the same shape (all but all-to-all).
    pub(super) same_shape: bool,
}

impl Desc {
    fn describe(&self) -> String {
        wire::describe(self.op, self.reduce, self.dtype, &self.shape)
    }
}

pub(super) fn chunk(total: usize, parts: usize, i: usize) -> Range<usize> {
    let base = total / parts;
    let extra = total % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

impl Shared {
    pub(super) fn link(&self, peer: usize) -> Result<&Link, CommError> {
        self.links
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "rank {peer} is not a peer in group {}",
                    self.name
                ))
            })
    }

    pub(super) fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&p| p != self.rank)
    }

    /// Sends `elems` elements at `ptr` to `peer`; a returned latch must complete before the
    /// memory is modified or freed.
    pub(super) fn send_raw(
        &self,
        peer: usize,
        desc: &Desc,
        seq: u64,
        tag: u64,
        ptr: *const u8,
        elems: usize,
    ) -> Result<Option<Arc<Latch>>, CommError> {
        let len = elems * desc.dtype.map_or(1, DType::size);
        self.send_payload(peer, desc, seq, tag, elems, Payload::Borrowed { ptr, len })
    }

    fn send_payload(
        &self,
        peer: usize,
        desc: &Desc,
        seq: u64,
        tag: u64,
        elems: usize,
        payload: Payload,
    ) -> Result<Option<Arc<Latch>>, CommError> {
        let len = match &payload {
            Payload::Owned(v) => v.len(),
            Payload::Borrowed { len, .. } => *len,
        };
        let header = Header {
            channel: Channel::Collective,
            op: desc.op,
            dtype: desc.dtype,
            reduce: desc.reduce,
            seq,
            tag,
            shape: desc.shape.clone(),
            elems: elems as u64,
            payload: len as u64,
        };
        self.link(peer)?.send(&header, payload)
    }

    /// After a failed collective, waits until no writer still reads the operation's buffers
    /// (the caller is about to free them). Finishing the writes also lets every peer see this
    /// rank's header, so each of them reports the mismatch rather than a lost connection.
    pub(super) fn abort_on_error<R>(&self, result: Result<R, CommError>) -> Result<R, CommError> {
        if result.is_err() {
            for link in self.links.iter().flatten() {
                link.drain();
            }
        }
        result
    }

    /// Exchanges a control message (no elements, `payload` bytes) with every peer: the phase
    /// boundaries of the shared-memory algorithms.
    pub(super) fn control_round(
        &self,
        desc: &Desc,
        seq: u64,
        tag: u64,
        payload: &[u8],
    ) -> Result<Vec<Option<Message>>, CommError> {
        let mut sent = Vec::new();
        for p in self.peers() {
            sent.push(self.send_payload(p, desc, seq, tag, 0, Payload::Owned(payload.to_vec()))?);
        }
        let msgs = self.collect(desc, seq, tag, |_| 0)?;
        wait_all(sent)?;
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(msgs)
    }

    /// The shared-memory area, when this group has one and the message is large enough.
    pub(super) fn shm_for(&self, bytes: usize) -> Option<std::sync::MutexGuard<'_, shm::ShmArea>> {
        (bytes >= SHM_MESSAGE && self.size > 1)
            .then_some(self.shm.as_ref())
            .flatten()
            .map(lock)
    }

    /// Publishes `bytes` at `src` in this rank's slot and maps every peer's slot (phase 1 of
    /// every shared-memory algorithm). Returns each rank's slot start, in rank order.
    pub(super) fn shm_publish(
        &self,
        area: &mut shm::ShmArea,
        desc: &Desc,
        seq: u64,
        src: Option<*const u8>,
        bytes: usize,
    ) -> Result<Vec<*mut u8>, CommError> {
        let own = area.own(bytes)?.ptr();
        if let Some(src) = src {
            // SAFETY: the slot holds at least `bytes`; `src` is a tensor of that size.
            unsafe { copy_bytes(src, own, bytes) };
        }
        let msgs = self.control_round(desc, seq, 0, &area.announce())?;
        let mut slots = vec![own; self.size];
        for (p, msg) in msgs.iter().enumerate() {
            if let Some(msg) = msg {
                slots[p] = area.peer(p, &msg.data)?;
            }
        }
        recycle(msgs);
        Ok(slots)
    }

    /// Receives the message for (`seq`, `tag`) from `peer` and checks it belongs to the same
    /// operation and carries `elems` elements.
    pub(super) fn expect(
        &self,
        peer: usize,
        desc: &Desc,
        seq: u64,
        tag: u64,
        elems: usize,
    ) -> Result<Message, CommError> {
        let msg =
            self.link(peer)?
                .inbox
                .take((Channel::Collective, seq, tag), peer, self.timeout)?;
        let h = &msg.header;
        let same_op = h.op == desc.op && h.dtype == desc.dtype && h.reduce == desc.reduce;
        if !same_op || (desc.same_shape && h.shape != desc.shape) {
            return Err(CommError::Mismatch(format!(
                "group {} collective #{seq}: rank {} (this rank) called {} but rank {peer} called {}",
                self.name,
                self.rank,
                desc.describe(),
                h.describe()
            )));
        }
        if msg.truncated {
            return Err(CommError::PeerLost {
                rank: peer,
                reason: format!(
                    "rank {peer}'s connection broke in the middle of collective #{seq}"
                ),
            });
        }
        if h.elems as usize != elems {
            return Err(CommError::Mismatch(format!(
                "group {} collective #{seq} ({}): rank {} (this rank) expected {elems} elements from rank {peer}, which sent {}",
                self.name,
                desc.op,
                self.rank,
                h.elems
            )));
        }
        Ok(msg)
    }

    /// Receives one message from every peer (tag `tag`); element counts from `elems(peer)`.
    pub(super) fn collect(
        &self,
        desc: &Desc,
        seq: u64,
        tag: u64,
        elems: impl Fn(usize) -> usize,
    ) -> Result<Vec<Option<Message>>, CommError> {
        let mut msgs: Vec<Option<Message>> = (0..self.size).map(|_| None).collect();
        for p in self.peers() {
            msgs[p] = Some(self.expect(p, desc, seq, tag, elems(p))?);
        }
        Ok(msgs)
    }
}

/// Copies `len` bytes; a no-op for empty copies, whose pointers may be null (empty tensors).
///
/// # Safety
/// For `len > 0`, as `std::ptr::copy_nonoverlapping`.
pub(super) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if len > 0 {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

pub(super) fn row_elems(shape: &[i64]) -> usize {
    shape.iter().skip(1).product::<i64>().max(0) as usize
}

/// Pointers to each rank's contribution in rank order: this rank's own, the others' messages.
pub(super) fn rank_order(me: usize, own: *const u8, msgs: &[Option<Message>]) -> Vec<*const u8> {
    msgs.iter()
        .enumerate()
        .map(|(r, m)| {
            if r == me {
                own
            } else {
                m.as_ref().map_or(own, |m| m.data.as_ptr())
            }
        })
        .collect()
}

pub(super) fn recycle(msgs: Vec<Option<Message>>) {
    for m in msgs.into_iter().flatten() {
        pool::give(m.data);
    }
}

pub(super) fn wait_all(latches: Vec<Option<Arc<Latch>>>) -> Result<(), CommError> {
    for latch in latches.into_iter().flatten() {
        latch.wait()?;
    }
    Ok(())
}
