//! What goes wrong on a rank's side of a launched run, typed: the launcher quotes it (the
//! harness turns a rank's `Err` into its failure message), and callers can still match on
//! it. Also the one way a rank hands a file back to the launching process.

use lockstep_core::comm::CommError;
use lockstep_models::ModelError;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Why a rank could not do its part of a run.
#[derive(Debug, thiserror::Error)]
pub enum RankError {
    /// The rank's model could not be built (or moved to its device).
    #[error("building the model: {0}")]
    Model(#[from] ModelError),
    /// Training failed (the configuration's or the user's training function's error).
    #[error("{0}")]
    Train(String),
    /// A collective between configurations (the barrier ending one) failed.
    #[error("{what}: {source}")]
    Comm {
        /// What the collective was for.
        what: String,
        /// The backend's error.
        #[source]
        source: CommError,
    },
    /// The rank was asked to run something that is not launched in ranks.
    #[error("`{0}` is not a launched configuration")]
    NotLaunched(String),
    /// A file handed back to the launching process could not be encoded.
    #[error("encoding {what}: {source}")]
    Encode {
        /// What was being written (the record, the state digest...).
        what: &'static str,
        /// The encoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// A file handed back to the launching process could not be written.
    #[error("writing {what} to {}: {source}", path.display())]
    Write {
        /// What was being written.
        what: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A value handed back through the run's store (under an external launch) could not be
    /// put there.
    #[error("handing back {what} through the store: {source}")]
    Publish {
        /// What was being handed back.
        what: &'static str,
        /// The store's error.
        #[source]
        source: Box<lockstep_core::comm::RunStoreError>,
    },
}

impl From<String> for RankError {
    fn from(reason: String) -> Self {
        RankError::Train(reason)
    }
}

/// Writes `value` as JSON at `path`, where the launching process reads it back (`what` names
/// it in an error); under an external launch, puts it in the run's store instead, under the
/// file's name ([`crate::external`]).
pub fn hand_back_json<T: Serialize + ?Sized>(
    what: &'static str,
    path: &Path,
    value: &T,
) -> Result<(), RankError> {
    let json = serde_json::to_vec(value).map_err(|source| RankError::Encode { what, source })?;
    if let Some(published) = crate::external::publish(what, path, &json) {
        return published;
    }
    std::fs::write(path, json).map_err(|source| RankError::Write {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Takes (reads and removes) what a launch handed back at `path`: the file, or under an
/// external launch the value every rank received through the store. `None` when nothing
/// was handed back there.
pub fn take_handed_back(path: &Path) -> Option<Vec<u8>> {
    if let Some(received) = crate::external::take(path) {
        return received;
    }
    let read = std::fs::read(path).ok();
    let _ = std::fs::remove_file(path);
    read
}
