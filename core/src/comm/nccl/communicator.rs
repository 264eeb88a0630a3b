//! The communicator a group and its pending work share: the raw NCCL handle behind one
//! lock, aborted on an asynchronous error and destroyed when the last user lets go.
//!
//! Apart from the group because it outlives it: every [`super::completion::NcclWork`] holds
//! an `Arc<Shared>`, so the communicator stays alive until the last operation finished.

use super::api::{describe, NcclApi, NCCL_IN_PROGRESS};
use crate::comm::work::lock;
use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::sys::ncclComm_t;
use std::ffi::c_int;
use std::sync::{Arc, Mutex, TryLockError};

/// A raw NCCL communicator; only ever used under `Shared::state`'s lock.
pub(super) struct CommHandle(pub(super) ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// serialized, which the mutex around `CommState` guarantees.
unsafe impl Send for CommHandle {}

/// Mutable per-group state, behind one lock so that every rank enqueues in program order.
pub(super) struct CommState {
    /// Null once aborted.
    pub(super) comm: CommHandle,
    /// Why the communicator was aborted; every later operation fails with it.
    pub(super) aborted: Option<String>,
    /// Collective sequence number (flight recorder).
    pub(super) seq: u64,
    /// Point-to-point counters per peer (flight recorder): sends to, receives from.
    pub(super) send_seq: Vec<u64>,
    pub(super) recv_seq: Vec<u64>,
}

/// What pending work needs from its group; outlives the `NcclGroup` while work is pending.
pub(super) struct Shared {
    pub(super) name: String,
    pub(super) api: &'static NcclApi,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) stream: Arc<CudaStream>,
    pub(super) state: Mutex<CommState>,
}

impl Shared {
    /// Checks the communicator for an asynchronous error; on one, aborts it (so its kernels
    /// exit and the stream drains) and returns the reason. With `blocking == false` it gives
    /// up (returns `None`) when another thread holds the lock, e.g. while enqueuing.
    pub(super) fn poll_async_error(&self, blocking: bool) -> Option<String> {
        let mut state = if blocking {
            lock(&self.state)
        } else {
            match self.state.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return None,
            }
        };
        if let Some(reason) = &state.aborted {
            return Some(reason.clone());
        }
        let comm = state.comm.0;
        let mut code: c_int = 0;
        // SAFETY: `comm` is a live communicator (not aborted, under the lock).
        let rc = unsafe { (self.api.comm_get_async_error)(comm, &mut code) };
        let reason = if rc != 0 {
            format!(
                "ncclCommGetAsyncError failed: {}",
                describe(self.api, rc, Some(comm))
            )
        } else if code != 0 && code != NCCL_IN_PROGRESS {
            format!(
                "asynchronous NCCL error on group {}: {}",
                self.name,
                describe(self.api, code, Some(comm))
            )
        } else {
            return None;
        };
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `comm` is live; after this call it is never used again (nulled below).
        let abort_rc = unsafe { (self.api.comm_abort)(comm) };
        if abort_rc != 0 {
            tracing::warn!(group = %self.name, "ncclCommAbort failed with code {abort_rc}");
        }
        state.comm = CommHandle(std::ptr::null_mut());
        state.aborted = Some(reason.clone());
        Some(reason)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if state.comm.0.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the communicator is live and no work references it any more (every `Work`
        // holds an `Arc<Shared>`).
        let rc = unsafe { (self.api.comm_destroy)(state.comm.0) };
        if rc != 0 {
            tracing::warn!(group = %self.name, "ncclCommDestroy failed: {}", describe(self.api, rc, None));
        }
        state.comm = CommHandle(std::ptr::null_mut());
    }
}
