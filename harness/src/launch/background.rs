//! Work the launching process can do while its ranks run.
//!
//! A forked launch leaves the launching process waiting, and with one core per rank busy
//! the machine often has a core to spare; the matrix used it for nothing while it judged a
//! cell, then launched the next. [`defer`] hands a task to the next launch: it runs on a
//! thread started once every rank is forked and is joined before the launch returns, so,
//! like the store and output threads, it never exists at a fork. Without a launch to run
//! it, [`finish`] runs it here. Tasks run one at a time, in the order they were deferred.

use super::lock;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Task = Box<dyn FnOnce() + Send>;

static PENDING: Mutex<Option<Task>> = Mutex::new(None);

fn take() -> Option<Task> {
    lock(&PENDING).take()
}

/// Runs `task` during the next launch (or at [`finish`]); one deferred earlier and not yet
/// run runs first, here, so the order holds.
pub fn defer(task: impl FnOnce() + Send + 'static) {
    finish();
    *lock(&PENDING) = Some(Box::new(task));
}

/// Runs the deferred task here, if one is waiting.
pub fn finish() {
    if let Some(task) = take() {
        task();
    }
}

/// The deferred task, started on a thread (by a launch whose ranks are all forked).
pub(super) fn start() -> Option<JoinHandle<()>> {
    let slot = Arc::new(Mutex::new(Some(take()?)));
    let handed = Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("lockstep-deferred".into())
        .spawn(move || {
            if let Some(task) = lock(&handed).take() {
                task();
            }
        });
    match spawned {
        Ok(handle) => Some(handle),
        // No thread: the task waits for the next launch, or for `finish`.
        Err(_) => {
            *lock(&PENDING) = lock(&slot).take();
            None
        }
    }
}

/// Waits for the task [`start`] started; its panic goes on in the caller.
pub(super) fn join(handle: Option<JoinHandle<()>>) {
    if let Some(handle) = handle {
        if let Err(panic) = handle.join() {
            std::panic::resume_unwind(panic);
        }
    }
}
