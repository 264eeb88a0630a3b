//! Completion of an enqueued NCCL operation: [`NcclWork`] polls the CUDA event recorded
//! after it (and the communicator's asynchronous error), and keeps its tensors alive until
//! it is done.
//!
//! Apart from the group because the work outlives the call that launched it, and the group
//! too.

use super::api::cuda_error;
use super::communicator::Shared;
use crate::comm::flight::{self, OpState};
use crate::comm::work::lock;
use crate::comm::{CommError, Completion};
use cudarc::driver::CudaEvent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tch::Tensor;

/// An enqueued NCCL operation: done when the event recorded after it on the group's stream
/// completed. Holds the tensors so their memory outlives the kernels using it.
pub(super) struct NcclWork {
    pub(super) shared: Arc<Shared>,
    pub(super) event: CudaEvent,
    pub(super) flight_id: u64,
    pub(super) what: String,
    pub(super) keep_alive: Mutex<Vec<Tensor>>,
    /// The outcome once known; its lock also serializes concurrent waiters.
    pub(super) outcome: Mutex<Option<Result<(), String>>>,
    pub(super) done: AtomicBool,
    /// Flight records of further operations this work finishes (a grouped batch's).
    pub(super) also_completes: Vec<u64>,
}

impl NcclWork {
    /// Polls the event until it completes, failing on a CUDA error or an asynchronous NCCL
    /// error (which aborts the communicator so nothing spins forever).
    fn poll(&self) -> Result<(), CommError> {
        self.shared
            .ctx
            .bind_to_thread()
            .map_err(cuda_error("binding the primary context"))?;
        let mut spins = 0u32;
        loop {
            match self.event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(CommError::Nccl(format!(
                        "CUDA error while waiting for {}: {e}",
                        self.what
                    )))
                }
            }
            if let Some(reason) = self.shared.poll_async_error(false) {
                return Err(CommError::Nccl(format!("{} failed: {reason}", self.what)));
            }
            if spins < 1000 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Waits once, records the outcome (flight recorder included) and releases the tensors.
    fn finish(&self) -> Result<(), String> {
        let mut outcome = lock(&self.outcome);
        if let Some(result) = outcome.as_ref() {
            return result.clone();
        }
        let result = self.poll().map_err(|e| e.to_string());
        for id in std::iter::once(self.flight_id).chain(self.also_completes.iter().copied()) {
            match &result {
                Ok(()) => flight::update(id, OpState::Completed),
                Err(e) => flight::update(id, OpState::Failed(e.clone())),
            }
        }
        lock(&self.keep_alive).clear();
        *outcome = Some(result.clone());
        self.done.store(true, Ordering::Release);
        result
    }
}

impl Completion for NcclWork {
    fn wait(&self) -> Result<(), CommError> {
        self.finish().map_err(CommError::Nccl)
    }

    fn is_completed(&self) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        if self.shared.ctx.bind_to_thread().is_err() {
            return true; // `wait` reports the error
        }
        match self.event.try_is_complete() {
            Ok(false) => self.shared.poll_async_error(false).is_some(),
            Ok(true) | Err(_) => true,
        }
    }
}

impl Drop for NcclWork {
    /// Dropping unfinished work waits for it: NCCL may still read or write the tensors, and
    /// releasing them early would let libtorch's allocator hand that memory to other tensors.
    fn drop(&mut self) {
        if !self.done.load(Ordering::Acquire) {
            if let Err(e) = self.finish() {
                tracing::warn!("dropped NCCL work failed: {e}");
            }
        }
    }
}
