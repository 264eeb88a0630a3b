//! The CPU backend: collectives in Rust over TCP, deterministic by construction.
//!
//! * **Transport**: one TCP connection per pair of group members (full mesh after
//!   rendezvous), loopback by default, any address for multi-node. See [`link`].
//! * **Order**: each group runs its collectives one at a time in issue order on a worker
//!   thread (`*_async` returns at once with a [`Work`]); a blocking call with nothing queued
//!   runs on the caller's thread to save a thread hop.
//! * **Algorithms**: messages up to [`SMALL_MESSAGE`] bytes use direct exchanges (one round
//!   trip). Larger all-gathers use a ring and larger broadcasts a pipelined chain. Reductions
//!   use a pairwise-exchange reduce-scatter (each rank receives its chunk from every peer and
//!   combines them in rank order) followed by a ring all-gather: the same bytes on the wire
//!   per rank as a ring reduce-scatter, but every element is summed in rank order, which a
//!   ring (whose partial sums start at a different rank for every chunk) cannot give.
//! * **Determinism**: the result's bits depend only on the inputs, never on timing, message
//!   size or chunking ([`reduce`]).
//! * **Safety net**: every message carries the sender's operation, dtype, reduction and shape;
//!   a mismatch fails with [`CommError::Mismatch`] naming both ranks.

pub mod chaos;
pub mod link;
mod pool;
pub mod reduce;
mod shm;
mod tensor;
pub mod wire;

use crate::comm::flight::{self, OpState};
use crate::comm::work::{lock, Completion, Latch};
use crate::comm::{CommError, DType, OpKind, ProcessGroup, ReduceOp, Work};
use link::{Link, Message, Payload};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tch::Tensor;
use tensor::Staged;
use wire::{Channel, Header};

/// Messages up to this many bytes take the direct (latency-optimal) algorithms.
pub const SMALL_MESSAGE: usize = 64 << 10;
/// Messages from this many bytes go through shared memory when every peer is on this host.
pub const SHM_MESSAGE: usize = 256 << 10;
/// Segment size of the pipelined broadcast.
const BROADCAST_SEGMENT: usize = 1 << 20;

type Job = Box<dyn FnOnce(&Shared, u64) -> Result<(), CommError> + Send>;

struct Queued {
    job: Job,
    seq: u64,
    latch: Arc<Latch>,
    flight_id: u64,
}

/// What every operation of a group reads: identity, links and timeout.
struct Shared {
    name: String,
    rank: usize,
    size: usize,
    links: Vec<Option<Link>>,
    timeout: Duration,
    /// The shared-memory data path, when every member runs on this host.
    shm: Option<Mutex<shm::ShmArea>>,
}

/// The local side of one collective, compared against every message a peer sends for it.
struct Desc {
    op: OpKind,
    dtype: Option<DType>,
    reduce: Option<ReduceOp>,
    shape: Vec<i64>,
    /// Whether peers must pass the same shape (all but all-to-all).
    same_shape: bool,
}

impl Desc {
    fn describe(&self) -> String {
        wire::describe(self.op, self.reduce, self.dtype, &self.shape)
    }
}

fn chunk(total: usize, parts: usize, i: usize) -> Range<usize> {
    let base = total / parts;
    let extra = total % parts;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

impl Shared {
    fn link(&self, peer: usize) -> Result<&Link, CommError> {
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

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.size).filter(move |&p| p != self.rank)
    }

    /// Sends `elems` elements at `ptr` to `peer`; a returned latch must complete before the
    /// memory is modified or freed.
    fn send_raw(
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
    fn abort_on_error<R>(&self, result: Result<R, CommError>) -> Result<R, CommError> {
        if result.is_err() {
            for link in self.links.iter().flatten() {
                link.drain();
            }
        }
        result
    }

    /// Exchanges a control message (no elements, `payload` bytes) with every peer: the phase
    /// boundaries of the shared-memory algorithms.
    fn control_round(
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
    fn shm_for(&self, bytes: usize) -> Option<std::sync::MutexGuard<'_, shm::ShmArea>> {
        (bytes >= SHM_MESSAGE && self.size > 1)
            .then_some(self.shm.as_ref())
            .flatten()
            .map(lock)
    }

    /// Publishes `bytes` at `src` in this rank's slot and maps every peer's slot (phase 1 of
    /// every shared-memory algorithm). Returns each rank's slot start, in rank order.
    fn shm_publish(
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

    fn shm_all_reduce(
        &self,
        area: &mut shm::ShmArea,
        desc: &Desc,
        t: &Staged,
        op: ReduceOp,
        seq: u64,
    ) -> Result<(), CommError> {
        let (n, me, esize) = (self.size, self.rank, t.dtype.size());
        let slots = self.shm_publish(area, desc, seq, Some(t.ptr()), t.len())?;
        let mine = chunk(t.numel(), n, me);
        // SAFETY: every slot holds the whole tensor; this rank writes only its own chunk of its
        // own slot, which no peer reads until the next control round.
        unsafe {
            let inputs: Vec<*const u8> = slots
                .iter()
                .map(|s| s.wrapping_add(mine.start * esize) as *const u8)
                .collect();
            reduce::reduce(
                slots[me].wrapping_add(mine.start * esize),
                &inputs,
                mine.len() * esize,
                t.dtype,
                op,
            )?;
        }
        self.control_round(desc, seq, 1, &[]).map(recycle)?;
        area.unlink_own();
        for (q, slot) in slots.iter().enumerate() {
            let c = chunk(t.numel(), n, q);
            // SAFETY: chunk q of slot q holds the reduced values; the tensor has room.
            unsafe {
                copy_bytes(
                    slot.wrapping_add(c.start * esize),
                    t.ptr().wrapping_add(c.start * esize),
                    c.len() * esize,
                )
            };
        }
        self.control_round(desc, seq, 2, &[]).map(recycle)
    }

    /// Receives the message for (`seq`, `tag`) from `peer` and checks it belongs to the same
    /// operation and carries `elems` elements.
    fn expect(
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

    fn all_reduce(&self, t: &Staged, op: ReduceOp, seq: u64) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::AllReduce,
            dtype: Some(t.dtype),
            reduce: Some(op),
            shape: t.shape(),
            same_shape: true,
        };
        if let Some(mut area) = self.shm_for(t.len()) {
            return self.shm_all_reduce(&mut area, &desc, t, op, seq);
        }
        let (n, me, esize) = (self.size, self.rank, t.dtype.size());
        let base = t.ptr();
        if t.len() <= SMALL_MESSAGE {
            let mut sent = Vec::new();
            for p in self.peers() {
                sent.push(self.send_raw(p, &desc, seq, 0, base, t.numel())?);
            }
            let msgs = self.collect(&desc, seq, 0, |_| t.numel())?;
            wait_all(sent)?;
            let inputs = rank_order(me, base, &msgs);
            // SAFETY: every input holds t.len() bytes; `base` aliases input `me` exactly.
            unsafe { reduce::reduce(base, &inputs, t.len(), t.dtype, op)? };
            recycle(msgs);
            return Ok(());
        }
        // Pairwise-exchange reduce-scatter into this rank's chunk of the tensor itself.
        let total = t.numel();
        let mut sent = Vec::new();
        for p in self.peers() {
            let c = chunk(total, n, p);
            sent.push(self.send_raw(
                p,
                &desc,
                seq,
                0,
                base.wrapping_add(c.start * esize),
                c.len(),
            )?);
        }
        let mine = chunk(total, n, me);
        let msgs = self.collect(&desc, seq, 0, |_| mine.len())?;
        wait_all(sent)?;
        // SAFETY: `own` is this rank's chunk; inputs hold mine.len() elements each.
        unsafe {
            let own = base.wrapping_add(mine.start * esize);
            let inputs = rank_order(me, own, &msgs);
            reduce::reduce(own, &inputs, mine.len() * esize, t.dtype, op)?;
        }
        recycle(msgs);
        self.ring_all_gather(&desc, seq, 1, base, total, esize)
    }

    /// Receives one message from every peer (tag `tag`); element counts from `elems(peer)`.
    fn collect(
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

    /// Ring all-gather over `base` (`total` elements in `size` chunks, this rank's chunk
    /// already in place). Tags start at `first_tag`.
    fn ring_all_gather(
        &self,
        desc: &Desc,
        seq: u64,
        first_tag: u64,
        base: *mut u8,
        total: usize,
        esize: usize,
    ) -> Result<(), CommError> {
        let (n, me) = (self.size, self.rank);
        let right = (me + 1) % n;
        let left = (me + n - 1) % n;
        let mut sent = Vec::new();
        for s in 0..n - 1 {
            let send_idx = (me + n - s) % n;
            let recv_idx = (me + 2 * n - s - 1) % n;
            let c = chunk(total, n, send_idx);
            sent.push(self.send_raw(
                right,
                desc,
                seq,
                first_tag + s as u64,
                base.wrapping_add(c.start * esize),
                c.len(),
            )?);
            let r = chunk(total, n, recv_idx);
            let msg = self.expect(left, desc, seq, first_tag + s as u64, r.len())?;
            // SAFETY: the message holds r.len() elements; the destination chunk lies within the buffer.
            unsafe {
                copy_bytes(
                    msg.data.as_ptr(),
                    base.wrapping_add(r.start * esize),
                    msg.data.len(),
                )
            };
            pool::give(msg.data);
        }
        wait_all(sent)
    }

    fn reduce_scatter(
        &self,
        out: &Staged,
        input: &Staged,
        op: ReduceOp,
        seq: u64,
    ) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::ReduceScatter,
            dtype: Some(input.dtype),
            reduce: Some(op),
            shape: input.shape(),
            same_shape: true,
        };
        let (me, esize, m) = (self.rank, input.dtype.size(), out.numel());
        if let Some(mut area) = self.shm_for(input.len()) {
            let slots = self.shm_publish(&mut area, &desc, seq, Some(input.ptr()), input.len())?;
            // SAFETY: every slot holds a whole input; chunk `me` of each is read, `out` written.
            unsafe {
                let inputs: Vec<*const u8> = slots
                    .iter()
                    .map(|s| s.wrapping_add(me * m * esize) as *const u8)
                    .collect();
                reduce::reduce(out.ptr(), &inputs, m * esize, input.dtype, op)?;
            }
            self.control_round(&desc, seq, 1, &[]).map(recycle)?;
            area.unlink_own();
            return Ok(());
        }
        let mut sent = Vec::new();
        for p in self.peers() {
            sent.push(self.send_raw(
                p,
                &desc,
                seq,
                0,
                input.ptr().wrapping_add(p * m * esize),
                m,
            )?);
        }
        let msgs = self.collect(&desc, seq, 0, |_| m)?;
        wait_all(sent)?;
        // SAFETY: every input holds m elements; `out` does not overlap them.
        unsafe {
            let inputs = rank_order(me, input.ptr().wrapping_add(me * m * esize), &msgs);
            reduce::reduce(out.ptr(), &inputs, m * esize, input.dtype, op)?;
        }
        recycle(msgs);
        Ok(())
    }

    fn all_gather(&self, out: &Staged, input: &Staged, seq: u64) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::AllGather,
            dtype: Some(input.dtype),
            reduce: None,
            shape: input.shape(),
            same_shape: true,
        };
        let (me, esize, m) = (self.rank, input.dtype.size(), input.numel());
        // SAFETY: `out` holds size * m elements; chunk `me` receives this rank's input.
        unsafe {
            copy_bytes(
                input.ptr(),
                out.ptr().wrapping_add(me * m * esize),
                m * esize,
            )
        };
        if let Some(mut area) = self.shm_for(out.len()) {
            let slots = self.shm_publish(&mut area, &desc, seq, Some(input.ptr()), input.len())?;
            for (q, slot) in slots.iter().enumerate().filter(|(q, _)| *q != me) {
                // SAFETY: slot q holds rank q's input (m elements); chunk q of `out` has room.
                unsafe { copy_bytes(*slot, out.ptr().wrapping_add(q * m * esize), m * esize) };
            }
            self.control_round(&desc, seq, 1, &[]).map(recycle)?;
            area.unlink_own();
            return Ok(());
        }
        if out.len() > SMALL_MESSAGE {
            // A ring only talks to neighbours: first let every rank check every other's call.
            self.control_round(&desc, seq, 0, &[]).map(recycle)?;
            return self.ring_all_gather(&desc, seq, 1, out.ptr(), out.numel(), esize);
        }
        let mut sent = Vec::new();
        for p in self.peers() {
            sent.push(self.send_raw(p, &desc, seq, 0, input.ptr(), m)?);
        }
        let msgs = self.collect(&desc, seq, 0, |_| m)?;
        for (p, msg) in msgs.into_iter().enumerate() {
            if let Some(msg) = msg {
                // SAFETY: chunk p of `out` holds m elements.
                unsafe {
                    copy_bytes(
                        msg.data.as_ptr(),
                        out.ptr().wrapping_add(p * m * esize),
                        msg.data.len(),
                    )
                };
                pool::give(msg.data);
            }
        }
        wait_all(sent)
    }

    fn broadcast(&self, t: &Staged, root: usize, seq: u64) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::Broadcast,
            dtype: Some(t.dtype),
            reduce: None,
            shape: t.shape(),
            same_shape: true,
        };
        let (n, me, esize) = (self.size, self.rank, t.dtype.size());
        let base = t.ptr();
        if let Some(mut area) = self.shm_for(t.len()) {
            let src = (me == root).then_some(base as *const u8);
            let slots = self.shm_publish(&mut area, &desc, seq, src, t.len())?;
            if me != root {
                // SAFETY: the root's slot holds the tensor's bytes.
                unsafe { copy_bytes(slots[root], base, t.len()) };
            }
            self.control_round(&desc, seq, 1, &[]).map(recycle)?;
            area.unlink_own();
            return Ok(());
        }
        let mut sent = Vec::new();
        if t.len() <= SMALL_MESSAGE {
            if me == root {
                for p in self.peers() {
                    sent.push(self.send_raw(p, &desc, seq, 0, base, t.numel())?);
                }
            } else {
                let msg = self.expect(root, &desc, seq, 0, t.numel())?;
                // SAFETY: the message holds the tensor's bytes.
                unsafe { copy_bytes(msg.data.as_ptr(), base, msg.data.len()) };
                pool::give(msg.data);
            }
            return wait_all(sent);
        }
        // Pipelined chain root -> root+1 -> ...: segments flow while later ones are in transit.
        // A chain only talks to neighbours: first let every rank check every other's call.
        self.control_round(&desc, seq, 0, &[]).map(recycle)?;
        let pos = (me + n - root) % n;
        let prev = (me + n - 1) % n;
        let next = (pos + 1 < n).then_some((me + 1) % n);
        let seg_elems = (BROADCAST_SEGMENT / esize).max(1);
        let segments = t.numel().div_ceil(seg_elems);
        for s in 0..segments {
            let start = s * seg_elems;
            let len = seg_elems.min(t.numel() - start);
            let ptr = base.wrapping_add(start * esize);
            if pos != 0 {
                let msg = self.expect(prev, &desc, seq, 1 + s as u64, len)?;
                // SAFETY: the message holds `len` elements.
                unsafe { copy_bytes(msg.data.as_ptr(), ptr, msg.data.len()) };
                pool::give(msg.data);
            }
            if let Some(next) = next {
                sent.push(self.send_raw(next, &desc, seq, 1 + s as u64, ptr, len)?);
            }
        }
        wait_all(sent)
    }

    fn all_to_all(
        &self,
        out: &Staged,
        input: &Staged,
        out_splits: &[usize],
        in_splits: &[usize],
        seq: u64,
    ) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::AllToAll,
            dtype: Some(input.dtype),
            reduce: None,
            shape: input.shape(),
            same_shape: false,
        };
        let esize = input.dtype.size();
        let in_row = row_elems(&input.shape());
        let out_row = row_elems(&out.shape());
        let offsets = |splits: &[usize], row: usize| -> Vec<usize> {
            splits
                .iter()
                .scan(0, |acc, s| {
                    let start = *acc;
                    *acc += s * row;
                    Some(start)
                })
                .collect()
        };
        let in_off = offsets(in_splits, in_row);
        let out_off = offsets(out_splits, out_row);
        let mut sent = Vec::new();
        for p in self.peers() {
            let ptr = input.ptr().wrapping_add(in_off[p] * esize);
            sent.push(self.send_raw(p, &desc, seq, 0, ptr, in_splits[p] * in_row)?);
        }
        let me = self.rank;
        // SAFETY: own split lies within both tensors (validated), which do not overlap.
        unsafe {
            copy_bytes(
                input.ptr().wrapping_add(in_off[me] * esize),
                out.ptr().wrapping_add(out_off[me] * esize),
                in_splits[me] * in_row * esize,
            )
        };
        let msgs = self.collect(&desc, seq, 0, |p| out_splits[p] * out_row)?;
        for (p, msg) in msgs.into_iter().enumerate() {
            if let Some(msg) = msg {
                // SAFETY: the message holds out_splits[p] rows, validated to fit.
                unsafe {
                    copy_bytes(
                        msg.data.as_ptr(),
                        out.ptr().wrapping_add(out_off[p] * esize),
                        msg.data.len(),
                    )
                };
                pool::give(msg.data);
            }
        }
        wait_all(sent)
    }

    fn barrier(&self, seq: u64) -> Result<(), CommError> {
        let desc = Desc {
            op: OpKind::Barrier,
            dtype: None,
            reduce: None,
            shape: vec![],
            same_shape: true,
        };
        let mut sent = Vec::new();
        for p in self.peers() {
            sent.push(self.send_raw(p, &desc, seq, 0, std::ptr::null(), 0)?);
        }
        let msgs = self.collect(&desc, seq, 0, |_| 0)?;
        recycle(msgs);
        wait_all(sent)
    }
}

/// Copies `len` bytes; a no-op for empty copies, whose pointers may be null (empty tensors).
///
/// # Safety
/// For `len > 0`, as `std::ptr::copy_nonoverlapping`.
unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    if len > 0 {
        std::ptr::copy_nonoverlapping(src, dst, len);
    }
}

fn row_elems(shape: &[i64]) -> usize {
    shape.iter().skip(1).product::<i64>().max(0) as usize
}

/// Pointers to each rank's contribution in rank order: this rank's own, the others' messages.
fn rank_order(me: usize, own: *const u8, msgs: &[Option<Message>]) -> Vec<*const u8> {
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

fn recycle(msgs: Vec<Option<Message>>) {
    for m in msgs.into_iter().flatten() {
        pool::give(m.data);
    }
}

fn wait_all(latches: Vec<Option<Arc<Latch>>>) -> Result<(), CommError> {
    for latch in latches.into_iter().flatten() {
        latch.wait()?;
    }
    Ok(())
}

/// Runs a group's collectives one at a time, in issue order.
struct Executor {
    /// Held while issuing: assigns sequence numbers and keeps the queue in issue order.
    submit: Mutex<(u64, Option<mpsc::Sender<Queued>>)>,
    /// Jobs queued or running on the worker.
    pending: Arc<AtomicUsize>,
    /// Held while any job runs (worker or inline).
    running: Arc<Mutex<()>>,
}

/// A process group on the CPU backend. Create it through [`crate::comm::World`].
pub struct CpuGroup {
    shared: Arc<Shared>,
    global_ranks: Vec<usize>,
    exec: Executor,
    send_seq: Vec<AtomicU64>,
    recv_seq: Vec<AtomicU64>,
}

impl CpuGroup {
    /// Builds a group from established links (`links[rank]` is `None`).
    /// `shm_run_tag`: set when every member runs on this machine, so large messages may use
    /// shared memory; slot names start with `/lockstep-{tag}-`, which lets a launcher remove
    /// the slots of ranks that died in the middle of an operation.
    pub(crate) fn new(
        name: String,
        rank: usize,
        global_ranks: Vec<usize>,
        links: Vec<Option<Link>>,
        timeout: Duration,
        shm_run_tag: Option<&str>,
    ) -> Result<Self, CommError> {
        let size = global_ranks.len();
        let shm = shm_run_tag.map(|run| {
            let tag: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
            let nonce: u32 = rand::random();
            Mutex::new(shm::ShmArea::new(
                format!("/lockstep-{run}-{}-{tag}-{nonce:08x}", std::process::id()),
                size,
            ))
        });
        let shared = Arc::new(Shared {
            name,
            rank,
            size,
            links,
            timeout,
            shm,
        });
        let (tx, rx) = mpsc::channel::<Queued>();
        let pending = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(Mutex::new(()));
        let (w_shared, w_pending, w_running) = (shared.clone(), pending.clone(), running.clone());
        std::thread::Builder::new()
            .name(format!("lockstep-pg-{}", shared.name))
            .spawn(move || {
                for q in rx {
                    flight::update(q.flight_id, OpState::Started);
                    let result = {
                        let _guard = lock(&w_running);
                        (q.job)(&w_shared, q.seq)
                    };
                    finish(q.flight_id, &q.latch, result);
                    w_pending.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| CommError::io("spawn group worker", e))?;
        Ok(CpuGroup {
            shared,
            global_ranks,
            exec: Executor {
                submit: Mutex::new((0, Some(tx))),
                pending,
                running,
            },
            send_seq: (0..size).map(|_| AtomicU64::new(0)).collect(),
            recv_seq: (0..size).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Issues a collective. `inline`: run on this thread when nothing is queued (blocking
    /// callers); otherwise queue it on the worker.
    fn issue(
        &self,
        op: OpKind,
        shapes: Vec<Vec<i64>>,
        dtype: Option<DType>,
        job: Job,
        inline: bool,
    ) -> Result<Work, CommError> {
        // What this rank's call carries, named in a mismatch error (the job may run on the
        // group's worker thread, where the caller's label is not in force).
        let label = crate::comm::label::current();
        let flight_label = label.clone();
        let job: Job = match label {
            Some(label) => Box::new(move |sh, seq| {
                job(sh, seq).map_err(|e| crate::comm::label::name_mismatch(e, &label))
            }),
            None => job,
        };
        let mut submit = lock(&self.exec.submit);
        let seq = submit.0;
        submit.0 += 1;
        let flight_id = flight::record(
            &self.shared.name,
            seq,
            op,
            shapes,
            dtype,
            None,
            flight_label,
        );
        let latch = Latch::new();
        if inline && self.exec.pending.load(Ordering::Acquire) == 0 {
            flight::update(flight_id, OpState::Started);
            let result = {
                let _guard = lock(&self.exec.running);
                job(&self.shared, seq)
            };
            drop(submit);
            finish(flight_id, &latch, result);
            return Ok(Work::new(latch));
        }
        let sender = submit
            .1
            .as_ref()
            .ok_or_else(|| CommError::InvalidArgument("group is shut down".into()))?;
        self.exec.pending.fetch_add(1, Ordering::AcqRel);
        sender
            .send(Queued {
                job,
                seq,
                latch: latch.clone(),
                flight_id,
            })
            .map_err(|_| CommError::InvalidArgument("group worker stopped".into()))?;
        Ok(Work::new(latch))
    }

    fn check_root(&self, rank: usize, what: &str) -> Result<(), CommError> {
        if rank >= self.shared.size {
            return Err(CommError::InvalidArgument(format!(
                "{what} rank {rank} is outside group {} of size {}",
                self.shared.name, self.shared.size
            )));
        }
        Ok(())
    }

    fn all_reduce_job(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        inline: bool,
    ) -> Result<Work, CommError> {
        let t = Staged::new(tensor, true)?;
        if op == ReduceOp::Avg && !t.dtype.is_float() {
            return Err(CommError::InvalidArgument(format!(
                "all_reduce avg needs a floating-point tensor, got {}",
                t.dtype
            )));
        }
        let (shape, dtype) = (t.shape(), t.dtype);
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.all_reduce(&t, op, seq))?;
            }
            t.finish()
        });
        self.issue(OpKind::AllReduce, vec![shape], Some(dtype), job, inline)
    }

    fn all_gather_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        self.check_pair(&out, &inp, OpKind::AllGather, out.numel(), inp.numel())?;
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.all_gather(&out, &inp, seq))?;
            out.finish()
        });
        self.issue(OpKind::AllGather, shapes, Some(dtype), job, inline)
    }

    fn reduce_scatter_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        self.check_pair(&out, &inp, OpKind::ReduceScatter, inp.numel(), out.numel())?;
        if op == ReduceOp::Avg && !inp.dtype.is_float() {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter avg needs a floating-point tensor, got {}",
                inp.dtype
            )));
        }
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.reduce_scatter(&out, &inp, op, seq))?;
            out.finish()
        });
        self.issue(OpKind::ReduceScatter, shapes, Some(dtype), job, inline)
    }

    /// Checks dtypes match and `big` holds exactly `size` times `small` elements.
    fn check_pair(
        &self,
        out: &Staged,
        inp: &Staged,
        op: OpKind,
        big: usize,
        small: usize,
    ) -> Result<(), CommError> {
        if out.dtype != inp.dtype {
            return Err(CommError::InvalidArgument(format!(
                "{op}: output is {} but input is {}",
                out.dtype, inp.dtype
            )));
        }
        if big != small * self.shared.size {
            return Err(CommError::InvalidArgument(format!(
                "{op} in group {} of size {}: the larger tensor must hold size × {small} = {} elements, it holds {big} (output {:?}, input {:?})",
                self.shared.name,
                self.shared.size,
                small * self.shared.size,
                out.shape(),
                inp.shape()
            )));
        }
        Ok(())
    }

    fn broadcast_job(&self, tensor: &Tensor, root: usize, inline: bool) -> Result<Work, CommError> {
        self.check_root(root, "broadcast root")?;
        let t = Staged::new(tensor, self.shared.rank != root)?;
        let (shape, dtype) = (t.shape(), t.dtype);
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.broadcast(&t, root, seq))?;
            }
            t.finish()
        });
        self.issue(OpKind::Broadcast, vec![shape], Some(dtype), job, inline)
    }

    fn all_to_all_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        if out.dtype != inp.dtype {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: output is {} but input is {}",
                out.dtype, inp.dtype
            )));
        }
        let n = self.shared.size;
        let splits = |given: &[usize], t: &Staged, which: &str| -> Result<Vec<usize>, CommError> {
            let rows = t.shape().first().copied().unwrap_or(1).max(0) as usize;
            let splits = if given.is_empty() {
                if !rows.is_multiple_of(n) {
                    return Err(CommError::InvalidArgument(format!(
                        "all_to_all: {which} has {rows} rows, not divisible by group size {n}; pass explicit splits"
                    )));
                }
                vec![rows / n; n]
            } else {
                given.to_vec()
            };
            if splits.len() != n {
                return Err(CommError::InvalidArgument(format!(
                    "all_to_all: {} {which} splits given for a group of size {n}",
                    splits.len()
                )));
            }
            if splits.iter().sum::<usize>() != rows {
                return Err(CommError::InvalidArgument(format!(
                    "all_to_all: {which} splits {splits:?} sum to {}, but the {which} has {rows} rows",
                    splits.iter().sum::<usize>()
                )));
            }
            Ok(splits)
        };
        let out_splits = splits(output_splits, &out, "output")?;
        let in_splits = splits(input_splits, &inp, "input")?;
        let me = self.shared.rank;
        if row_elems(&out.shape()) != row_elems(&inp.shape()) || out_splits[me] != in_splits[me] {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: rows of output {:?} and input {:?} must match, and this rank's own split must be equal in both ({} vs {})",
                out.shape(),
                inp.shape(),
                out_splits[me],
                in_splits[me]
            )));
        }
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.all_to_all(&out, &inp, &out_splits, &in_splits, seq))?;
            out.finish()
        });
        self.issue(OpKind::AllToAll, shapes, Some(dtype), job, inline)
    }

    fn barrier_job(&self, inline: bool) -> Result<Work, CommError> {
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.barrier(seq))
            } else {
                Ok(())
            }
        });
        self.issue(OpKind::Barrier, vec![], None, job, inline)
    }
}

fn finish(flight_id: u64, latch: &Latch, result: Result<(), CommError>) {
    flight::update(
        flight_id,
        match &result {
            Ok(()) => OpState::Completed,
            Err(e) => OpState::Failed(e.to_string()),
        },
    );
    latch.complete(result);
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        // Closing the queue ends the worker once queued work is done.
        lock(&self.exec.submit).1 = None;
    }
}

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
