//! Counting collectives, as PyTorch's `CommDebugMode` does: wrap a group in a
//! [`CountingGroup`] and every collective it runs is tallied per (operation, group name) in a
//! shared [`CollectiveCounts`].
//!
//! Tests use the tallies to prove a parallel layer communicates exactly as designed (one
//! all-reduce per row-parallel forward, none extra), and training loops record them per step
//! so a report shows what each configuration costs on the wire.
//!
//! What `bytes` counts is the tensor this rank hands to the operation: the tensor of an
//! all-reduce or broadcast, the input shard of an all-gather, the full input of a
//! reduce-scatter or all-to-all, the tensor sent or received point to point, nothing for a
//! barrier. A call is counted when it is issued, whether or not it then succeeds.

use crate::comm::{CommError, OpKind, ProcessGroup, ReduceOp, Work};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use tch::Tensor;

/// How often one operation ran on one group, and how many bytes it carried.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveCount {
    /// Calls issued (blocking and asynchronous alike).
    pub calls: u64,
    /// Bytes of the tensors this rank handed in (see the module documentation).
    pub bytes: u64,
}

/// Tallies keyed by (operation name, group name), e.g. `("all_reduce", "tp[0,1]")`; the
/// operation name is [`OpKind`]'s display form.
pub type CountMap = BTreeMap<(String, String), CollectiveCount>;

/// A shared tally of collectives: cheap to clone (every clone adds to the same counts), so
/// one handle can sit in several [`CountingGroup`]s and another in the training loop.
#[derive(Clone, Debug, Default)]
pub struct CollectiveCounts {
    inner: Arc<Mutex<CountMap>>,
}

impl CollectiveCounts {
    /// An empty tally.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one call of `op` on `group` carrying `bytes`.
    pub fn record(&self, op: OpKind, group: &str, bytes: u64) {
        let mut map = self.lock();
        let entry = map.entry((op.to_string(), group.to_owned())).or_default();
        entry.calls += 1;
        entry.bytes += bytes;
    }

    /// The counts so far, which keep accumulating.
    pub fn snapshot(&self) -> CountMap {
        self.lock().clone()
    }

    /// The counts so far, resetting them to empty (one step's worth at a time).
    pub fn take(&self) -> CountMap {
        std::mem::take(&mut *self.lock())
    }

    /// Calls of `op` on any group so far (for assertions that do not care about names).
    pub fn calls(&self, op: OpKind) -> u64 {
        let name = op.to_string();
        self.lock()
            .iter()
            .filter(|((o, _), _)| *o == name)
            .map(|(_, c)| c.calls)
            .sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CountMap> {
        // Counting never leaves the map half-updated, so a poisoned lock is still consistent.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A [`ProcessGroup`] that delegates every operation to the group it wraps and counts it:
/// drop it in wherever a group is expected to see what a piece of code communicates.
pub struct CountingGroup {
    inner: Arc<dyn ProcessGroup>,
    counts: CollectiveCounts,
}

impl CountingGroup {
    /// Wraps `inner`, adding every operation to `counts`.
    pub fn new(inner: Arc<dyn ProcessGroup>, counts: CollectiveCounts) -> Self {
        CountingGroup { inner, counts }
    }

    /// The shared tally this group adds to.
    pub fn counts(&self) -> &CollectiveCounts {
        &self.counts
    }

    /// The wrapped group, for calls that must not be counted.
    pub fn inner(&self) -> &Arc<dyn ProcessGroup> {
        &self.inner
    }

    fn count(&self, op: OpKind, tensor: Option<&Tensor>) {
        let bytes = tensor.map_or(0, |t| t.numel() * t.kind().elt_size_in_bytes());
        self.counts.record(op, self.inner.name(), bytes as u64);
    }
}

impl ProcessGroup for CountingGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn global_ranks(&self) -> &[usize] {
        self.inner.global_ranks()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work, CommError> {
        self.count(OpKind::AllReduce, Some(tensor));
        self.inner.all_reduce_async(tensor, op)
    }
    fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, CommError> {
        self.count(OpKind::AllGather, Some(input));
        self.inner.all_gather_async(output, input)
    }
    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        self.count(OpKind::ReduceScatter, Some(input));
        self.inner.reduce_scatter_async(output, input, op)
    }
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work, CommError> {
        self.count(OpKind::Broadcast, Some(tensor));
        self.inner.broadcast_async(tensor, root)
    }
    fn all_to_all_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work, CommError> {
        self.count(OpKind::AllToAll, Some(input));
        self.inner
            .all_to_all_async(output, input, output_splits, input_splits)
    }
    fn send_async(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<Work, CommError> {
        self.count(OpKind::Send, Some(tensor));
        self.inner.send_async(tensor, dst, tag)
    }
    fn recv_async(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<Work, CommError> {
        self.count(OpKind::Recv, Some(tensor));
        self.inner.recv_async(tensor, src, tag)
    }
    fn barrier_async(&self) -> Result<Work, CommError> {
        self.count(OpKind::Barrier, None);
        self.inner.barrier_async()
    }

    // The blocking forms delegate to the wrapped group's own blocking forms (a backend may
    // implement them apart from the asynchronous ones), counting once.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.count(OpKind::AllReduce, Some(tensor));
        self.inner.all_reduce(tensor, op)
    }
    fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        self.count(OpKind::AllGather, Some(input));
        self.inner.all_gather(output, input)
    }
    fn reduce_scatter(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.count(OpKind::ReduceScatter, Some(input));
        self.inner.reduce_scatter(output, input, op)
    }
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        self.count(OpKind::Broadcast, Some(tensor));
        self.inner.broadcast(tensor, root)
    }
    fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        self.count(OpKind::AllToAll, Some(input));
        self.inner
            .all_to_all(output, input, output_splits, input_splits)
    }
    fn send(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<(), CommError> {
        self.count(OpKind::Send, Some(tensor));
        self.inner.send(tensor, dst, tag)
    }
    fn recv(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<(), CommError> {
        self.count(OpKind::Recv, Some(tensor));
        self.inner.recv(tensor, src, tag)
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.count(OpKind::Barrier, None);
        self.inner.barrier()
    }
}
