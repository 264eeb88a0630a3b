//! The NCCL backend (cargo feature `nccl`): the engine for CUDA tensors on GPU runners.
//!
//! One NCCL communicator per [`NcclGroup`]. Group rank 0 creates the NCCL unique id and
//! publishes it through the rendezvous store; every member then joins with
//! `ncclCommInitRank` on its CUDA device. Collectives map one to one onto NCCL calls;
//! `all_to_all` with uneven splits is a grouped set of `ncclSend`/`ncclRecv`, and the barrier is
//! an all-reduce of one element.
//!
//! # Synchronization
//!
//! 1. before enqueuing, libtorch's current stream on the device is synchronized (read through
//!    the C++ bridge, `autograd::current_cuda_stream`), so every kernel libtorch issued that
//!    produces the inputs has finished; the groups' own streams are not waited for, so an
//!    operation still pending on one of them (a send whose receive the peer has not posted)
//!    never blocks the next operation on another group;
//! 2. the NCCL call is enqueued on a stream the group owns (non-blocking, created on the
//!    device's *primary* context, the one libtorch's runtime API uses), and a CUDA event is
//!    recorded after it;
//! 3. the returned [`Work`] completes once that event has completed; it keeps the tensors alive
//!    until then, so libtorch's caching allocator cannot recycle memory NCCL still uses, and
//!    dropping an unfinished `Work` waits for it for the same reason.
//!
//! Operations of one group run in issue order on its stream; sends and receives issued
//! together go through [`crate::comm::p2p::post_batch`], one `ncclGroupStart` …
//! `ncclGroupEnd` across groups. Waiting polls the event and `ncclCommGetAsyncError`; an
//! asynchronous NCCL error (a peer died, a network failure) aborts the communicator and
//! fails this and every later operation of the group instead of hanging.
//!
//! Unlike the CPU backend, mismatched shapes across ranks are not detected here (NCCL has no
//! cheap way to compare them): they hang or produce garbage, and the flight recorder is what
//! explains them. Two ranks of one group must be on different GPUs (an NCCL rule).
//!
//! # Finding libnccl
//!
//! See [`nccl_version`] and `load_api`: cudarc's dynamic loader never tries `libnccl.so.2`, so
//! this module loads NCCL itself and calls it through its own table of entry points, using
//! cudarc's `nccl::sys` definitions for the ABI types and cudarc's driver API for contexts,
//! streams and events.
//!
//! This backend has been compiled but never run on a GPU: the machines that build it have none.
//!
//! [`Work`]: crate::comm::Work

mod api;
mod collectives;
mod communicator;
mod completion;
mod group;
mod grouped;

pub use api::nccl_version;
pub use group::NcclGroup;
pub(crate) use grouped::grouped_p2p;
