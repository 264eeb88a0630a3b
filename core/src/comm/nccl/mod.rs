//! The NCCL backend (cargo feature `nccl`): the engine for CUDA tensors on GPU runners.
//!
//! One NCCL communicator per [`NcclGroup`]. Group rank 0 creates the NCCL unique id and
//! publishes it through the rendezvous store; every member then joins with
//! `ncclCommInitRank` on its CUDA device. Collectives map one to one onto NCCL calls;
//! `all_to_all` with uneven splits is a grouped set of `ncclSend`/`ncclRecv`, and the barrier is
//! an all-reduce of one element.
//!
//! # Synchronization (interim scheme)
//!
//! The design enqueues NCCL work on libtorch's *current* stream, but the C++ bridge that hands
//! us that stream does not exist yet. Until it does, this backend is synchronized conservatively
//! instead, so it is correct whatever stream libtorch used:
//!
//! 1. before enqueuing, the whole device is synchronized (`torch::cuda::synchronize`), so every
//!    kernel libtorch issued that produces the inputs has finished;
//! 2. the NCCL call is enqueued on a stream the group owns, created on the device's *primary*
//!    context (the one libtorch's runtime API uses), and a CUDA event is recorded after it;
//! 3. the returned [`Work`] completes once that event has completed; it keeps the tensors alive
//!    until then, so libtorch's caching allocator cannot recycle memory NCCL still uses, and
//!    dropping an unfinished `Work` waits for it for the same reason.
//!
//! The cost: each new operation waits for everything already queued on the device, including
//! the previous collective, so collectives overlap with compute issued after them but not with
//! each other. Waiting polls the event and `ncclCommGetAsyncError`; an asynchronous NCCL error
//! (a peer died, a network failure) aborts the communicator and fails this and every later
//! operation of the group instead of hanging.
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

pub use api::nccl_version;
pub use group::NcclGroup;
