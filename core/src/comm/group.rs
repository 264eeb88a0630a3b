//! The `ProcessGroup` trait: the collectives every parallelism is written against.

use crate::comm::{CommError, ReduceOp, Work};
use tch::Tensor;

/// A set of ranks that run collectives together, whatever the backend.
///
/// Every rank of the group must call the same collectives in the same order with matching
/// shapes and dtypes; a backend reports a mismatch as [`CommError::Mismatch`] naming both
/// ranks rather than hanging. In-place operations write into the tensor passed; the `*_async`
/// forms return a [`Work`] and the tensors must not be touched until it completes.
pub trait ProcessGroup: Send + Sync {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// A name for errors and flight records (e.g. `world`, `dp[0,2]`).
    fn name(&self) -> &str;
    /// Global (world) ranks of the members, indexed by group rank.
    fn global_ranks(&self) -> &[usize];
    /// The backend's name (`cpu`, `nccl`).
    fn backend(&self) -> &'static str;
    /// The backend's own group this is, for a backend that issues operations on several of
    /// its groups as one call (NCCL's grouped point-to-point,
    /// [`crate::comm::p2p::batch_isend_irecv`], downcasts it to its group). `None` for every
    /// other group, wrappers included (they then see each operation through their own
    /// methods). Typed as `Any` so this trait names no backend.
    fn backend_group(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// Reduces `tensor` across the group in place.
    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work, CommError>;
    /// Concatenates every rank's `input` along dim 0 into `output` (rank order).
    /// `output` holds `size()` times `input`'s elements.
    fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, CommError>;
    /// Reduces `input` across ranks and leaves chunk `rank()` (split on dim 0) in `output`.
    /// `input` holds `size()` times `output`'s elements.
    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work, CommError>;
    /// Copies `root`'s tensor into every rank's `tensor`.
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work, CommError>;
    /// Sends rows `input_splits[j]` of `input` (dim 0) to rank `j` and receives
    /// `output_splits[j]` rows from rank `j` into `output`, in rank order. Splits may be uneven
    /// or zero; empty split lists mean equal splits.
    fn all_to_all_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work, CommError>;
    /// Sends `tensor` to group rank `dst`. Messages between two ranks arrive in the order sent;
    /// `tag` must match the receiver's.
    fn send_async(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<Work, CommError>;
    /// Receives into `tensor` from group rank `src`.
    fn recv_async(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<Work, CommError>;
    /// Completes once every rank entered the barrier.
    fn barrier_async(&self) -> Result<Work, CommError>;

    /// Blocking [`ProcessGroup::all_reduce_async`].
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_async(tensor, op)?.wait()
    }
    /// Blocking [`ProcessGroup::all_gather_async`].
    fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        self.all_gather_async(output, input)?.wait()
    }
    /// Blocking [`ProcessGroup::reduce_scatter_async`].
    fn reduce_scatter(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        self.reduce_scatter_async(output, input, op)?.wait()
    }
    /// Blocking [`ProcessGroup::broadcast_async`].
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        self.broadcast_async(tensor, root)?.wait()
    }
    /// Blocking [`ProcessGroup::all_to_all_async`].
    fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        self.all_to_all_async(output, input, output_splits, input_splits)?
            .wait()
    }
    /// Blocking [`ProcessGroup::send_async`].
    fn send(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<(), CommError> {
        self.send_async(tensor, dst, tag)?.wait()
    }
    /// Blocking [`ProcessGroup::recv_async`].
    fn recv(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<(), CommError> {
        self.recv_async(tensor, src, tag)?.wait()
    }
    /// Blocking [`ProcessGroup::barrier_async`].
    fn barrier(&self) -> Result<(), CommError> {
        self.barrier_async()?.wait()
    }
}
