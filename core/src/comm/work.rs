//! `Work`: the handle an asynchronous collective returns so communication overlaps compute.

use crate::comm::CommError;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// How a backend reports that an operation finished.
pub trait Completion: Send + Sync {
    /// Blocks until the operation finished; returns its outcome (every call returns the same).
    fn wait(&self) -> Result<(), CommError>;
    /// Whether the operation already finished (successfully or not).
    fn is_completed(&self) -> bool;
}

/// A pending operation. Tensors passed to it must not be read or written until `wait` returns.
#[derive(Clone)]
pub struct Work {
    inner: Arc<dyn Completion>,
}

impl Work {
    /// Wraps a backend's completion.
    pub fn new(inner: Arc<dyn Completion>) -> Self {
        Work { inner }
    }

    /// A work that is already finished with this outcome.
    pub fn done(result: Result<(), CommError>) -> Self {
        let latch = Latch::new();
        latch.complete(result);
        Work::new(latch)
    }

    /// Blocks until the operation finished and returns its outcome.
    pub fn wait(&self) -> Result<(), CommError> {
        self.inner.wait()
    }

    /// Whether the operation already finished.
    pub fn is_completed(&self) -> bool {
        self.inner.is_completed()
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

/// A one-shot completion a backend thread fills in; the simplest `Completion`.
pub struct Latch {
    state: Mutex<Option<Result<(), String>>>,
    error: Mutex<Option<CommError>>,
    cv: Condvar,
}

impl Latch {
    /// A latch nobody has completed yet.
    pub fn new() -> Arc<Self> {
        Arc::new(Latch {
            state: Mutex::new(None),
            error: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    /// Records the outcome and wakes every waiter. Later calls are ignored.
    pub fn complete(&self, result: Result<(), CommError>) {
        let mut state = lock(&self.state);
        if state.is_some() {
            return;
        }
        *state = Some(match result {
            Ok(()) => Ok(()),
            Err(e) => {
                let text = e.to_string();
                *lock(&self.error) = Some(e);
                Err(text)
            }
        });
        self.cv.notify_all();
    }

    /// Waits at most `timeout`; `None` if the latch is still open.
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), CommError>> {
        let state = lock(&self.state);
        let (state, _) = self
            .cv
            .wait_timeout_while(state, timeout, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        state.as_ref().map(|r| self.outcome(r))
    }

    fn outcome(&self, state: &Result<(), String>) -> Result<(), CommError> {
        match state {
            Ok(()) => Ok(()),
            Err(text) => Err(lock(&self.error)
                .take()
                .unwrap_or_else(|| CommError::Failed(text.clone()))),
        }
    }
}

impl Completion for Latch {
    fn wait(&self) -> Result<(), CommError> {
        let state = lock(&self.state);
        let state = self
            .cv
            .wait_while(state, |s| s.is_none())
            .unwrap_or_else(|p| p.into_inner());
        match state.as_ref() {
            Some(r) => self.outcome(r),
            None => Ok(()),
        }
    }

    fn is_completed(&self) -> bool {
        lock(&self.state).is_some()
    }
}

/// Locks a mutex, recovering the data if another thread panicked while holding it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
