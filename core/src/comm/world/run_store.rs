//! [`RunStore`]: bytes under one run's key prefix in the store, for ranks to hand each
//! other what a run produced, with its size limit and errors.
//!
//! Apart from [`World`](super::World) because it outlives the world: it holds its own
//! handle to the store connection and needs nothing else of it.

use crate::comm::{CommError, StoreClient};
use std::sync::Arc;
use std::time::Duration;

/// Largest value [`RunStore::put`] accepts: the store's frame limit.
pub const RUN_STORE_MAX_VALUE: usize = 64 << 20;

/// Why a [`RunStore`] operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RunStoreError {
    /// The value is larger than the store carries in one frame.
    #[error("store key {key:?}: {bytes} bytes is over the store's {max}-byte limit")]
    TooLarge {
        /// The run-relative key.
        key: String,
        /// The value's size.
        bytes: usize,
        /// [`RUN_STORE_MAX_VALUE`].
        max: usize,
    },
    /// The store could not be reached, refused, or the key did not appear in time.
    #[error("store key {key:?} of run {namespace}: {source}")]
    Comm {
        /// The run-relative key.
        key: String,
        /// The run's key prefix.
        namespace: String,
        /// The store's error.
        #[source]
        source: CommError,
    },
}

/// Bytes under one run's key prefix in the store ([`World::run_store`]): what ranks on
/// different hosts hand each other (rank 0's record, every rank's digest and outcome).
///
/// [`World::run_store`]: super::World::run_store
#[derive(Clone)]
pub struct RunStore {
    pub(super) store: Arc<StoreClient>,
    pub(super) namespace: String,
    pub(super) timeout: Duration,
}

impl RunStore {
    /// Sets run-relative `key` to `value`.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), RunStoreError> {
        if value.len() > RUN_STORE_MAX_VALUE {
            return Err(RunStoreError::TooLarge {
                key: key.to_owned(),
                bytes: value.len(),
                max: RUN_STORE_MAX_VALUE,
            });
        }
        self.store
            .set(&self.full(key), value)
            .map_err(|source| self.err(key, source))
    }

    /// The value of run-relative `key`, waiting for it at most the collective timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, RunStoreError> {
        self.store
            .wait_get(&self.full(key), self.timeout)
            .map_err(|source| self.err(key, source))
    }

    /// Whether run-relative `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool, RunStoreError> {
        self.store
            .check(&self.full(key))
            .map_err(|source| self.err(key, source))
    }

    /// Adds `delta` to the counter at run-relative `key` and returns its new value: gives
    /// events on different ranks one order (which rank failed first).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, RunStoreError> {
        self.store
            .add(&self.full(key), delta)
            .map_err(|source| self.err(key, source))
    }

    /// How long [`RunStore::get`] waits.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The run's key prefix (`lockstep/run{n}/` under an external launch).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn full(&self, key: &str) -> String {
        format!("{}x/{key}", self.namespace)
    }

    fn err(&self, key: &str, source: CommError) -> RunStoreError {
        RunStoreError::Comm {
            key: key.to_owned(),
            namespace: self.namespace.clone(),
            source,
        }
    }
}
