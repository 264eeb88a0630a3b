//! The algorithm of each collective on a CPU group: direct exchanges for small messages,
//! a pairwise-exchange reduce-scatter plus ring all-gather for large reductions, a ring for
//! large all-gathers, a pipelined chain for large broadcasts, and the shared-memory variants
//! used when every member is on this host (see the [module documentation](super)).
//!
//! Apart from the primitives they use ([`super::exchange`]) and from the group that queues
//! them ([`super::group`]): each function here is one collective, run once on the group's
//! worker (or the caller's) thread.

use super::exchange::{chunk, copy_bytes, rank_order, recycle, row_elems, wait_all, Desc, Shared};
use super::tensor::Staged;
use super::{pool, reduce, shm, SMALL_MESSAGE};
use crate::comm::{CommError, OpKind, ReduceOp};

/// Segment size of the pipelined broadcast.
const BROADCAST_SEGMENT: usize = 1 << 20;

impl Shared {
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

    pub(super) fn all_reduce(&self, t: &Staged, op: ReduceOp, seq: u64) -> Result<(), CommError> {
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

    pub(super) fn reduce_scatter(
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

    pub(super) fn all_gather(
        &self,
        out: &Staged,
        input: &Staged,
        seq: u64,
    ) -> Result<(), CommError> {
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

    pub(super) fn broadcast(&self, t: &Staged, root: usize, seq: u64) -> Result<(), CommError> {
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

    pub(super) fn all_to_all(
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

    pub(super) fn barrier(&self, seq: u64) -> Result<(), CommError> {
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
