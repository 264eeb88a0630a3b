//! How a rank hands its results back to the launching process, in one place: rank 0's
//! record, every rank's state digest for the cross-rank check, a fault log; as a file beside
//! the record, or under an external launch (ranks on hosts that share no filesystem) as a key
//! of the run's store. Also [`RankError`], what goes wrong on a rank's side, typed: the
//! launcher quotes it.
//!
//! The cross-rank check's launcher side: every rank writes its state digest beside rank 0's
//! record, and the launching process compares them and attaches the verdict to the record, so
//! a rank that diverged fails the run even when rank 0's numbers match the reference
//! ([`lockstep_core::consistency`]).

use super::failed::RunFailed;
use super::lock;
use lockstep_core::comm::{CommError, RunStore};
use lockstep_core::consistency::{check_digests, RankDigest, StateProbe};
use lockstep_core::record::RunRecord;
use lockstep_models::ModelError;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The run whose body is running now under an external launch, and the keys it handed back
/// so far.
static ACTIVE: Mutex<Option<(RunStore, Vec<String>)>> = Mutex::new(None);

/// What finished external launches handed back, by scratch file name, until read; `None`
/// until this process ran one (it reads files then).
static RECEIVED: Mutex<Option<HashMap<String, Vec<u8>>>> = Mutex::new(None);

/// An external launch's body starts: what it hands back goes into `store`.
pub(super) fn begin_store_body(store: RunStore) {
    *lock(&ACTIVE) = Some((store, Vec::new()));
    lock(&RECEIVED).get_or_insert_with(HashMap::new);
}

/// The body ended: the store keys it handed back.
pub(super) fn end_store_body() -> Vec<String> {
    lock(&ACTIVE).take().map(|(_, k)| k).unwrap_or_default()
}

/// What every rank of a finished external launch handed back, read from the store.
pub(super) fn receive_handed_back(got: HashMap<String, Vec<u8>>) {
    lock(&RECEIVED).get_or_insert_with(HashMap::new).extend(got);
}

/// The store key of a handed-back file.
fn key_of(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into(),
    )
}

/// Under an external launch's body, puts `bytes` (what would be written at `path`) into the
/// run's store; `None` when no external body is running (the caller writes the file).
fn publish(what: &'static str, path: &Path, bytes: &[u8]) -> Option<Result<(), RankError>> {
    let mut active = lock(&ACTIVE);
    let (store, keys) = active.as_mut()?;
    let key = key_of(path);
    let put = store.put(&key, bytes).map_err(|source| RankError::Publish {
        what,
        source: Box::new(source),
    });
    if put.is_ok() {
        keys.push(key);
    }
    Some(put)
}

/// Under an external launch, what a finished launch handed back at `path` (taken: read
/// once); `None` when this process ran no external launch (the caller reads the file).
fn take(path: &Path) -> Option<Option<Vec<u8>>> {
    Some(lock(&RECEIVED).as_mut()?.remove(&key_of(path)))
}

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
    /// A record could not be encoded for the launching process.
    #[error("encoding the record: {0}")]
    EncodeRecord(#[source] ciborium::ser::Error<std::io::Error>),
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
/// file's name ([`super::external`]).
pub fn hand_back_json<T: Serialize + ?Sized>(
    what: &'static str,
    path: &Path,
    value: &T,
) -> Result<(), RankError> {
    let json = serde_json::to_vec(value).map_err(|source| RankError::Encode { what, source })?;
    hand_back_bytes(what, path, json)
}

/// Writes `bytes` at `path` (or puts them in the run's store under an external launch).
fn hand_back_bytes(what: &'static str, path: &Path, bytes: Vec<u8>) -> Result<(), RankError> {
    if let Some(published) = publish(what, path, &bytes) {
        return published;
    }
    std::fs::write(path, bytes).map_err(|source| RankError::Write {
        what,
        path: path.to_owned(),
        source,
    })
}

/// Takes (reads and removes) what a launch handed back at `path`: the file, or under an
/// external launch the value every rank received through the store. `None` when nothing
/// was handed back there.
pub fn take_handed_back(path: &Path) -> Option<Vec<u8>> {
    if let Some(received) = take(path) {
        return received;
    }
    let read = std::fs::read(path).ok();
    let _ = std::fs::remove_file(path);
    read
}

/// The probe a launched rank trains with: `None` when `LOCKSTEP_CROSS_RANK=0` turns the
/// check off (to measure what it costs, or for a model too large to hash every step).
pub fn probe_for(rank: usize) -> Option<StateProbe> {
    let off = std::env::var("LOCKSTEP_CROSS_RANK").is_ok_and(|v| v == "0");
    (!off).then(|| StateProbe::new(rank))
}

/// Where rank `rank` leaves its digest for the record at `out`.
fn digest_path(out: &Path, rank: usize) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(format!(".digest{rank}"));
    PathBuf::from(name)
}

/// Writes `probe`'s digest where the launcher of the record at `out` reads it (every rank
/// calls it after training, before any barrier that ends the run).
pub fn hand_back_digest(probe: Option<&StateProbe>, out: &Path) -> Result<(), RankError> {
    let Some(probe) = probe else {
        return Ok(());
    };
    let digest = probe.digest();
    let path = digest_path(out, digest.rank);
    hand_back_json("the state digest", &path, &digest)
}

/// Reads (and removes) the `world_size` digests left for the record at `out` and, when every
/// rank left one, attaches their comparison to `record`. A digest missing means a rank did
/// not finish, which the launch has reported already; nothing is attached then.
pub fn attach_cross_rank(record: Option<&mut RunRecord>, out: &Path, world_size: usize) {
    if world_size == 0 {
        return;
    }
    let digests: Vec<Option<RankDigest>> = (0..world_size)
        .map(|rank| {
            let path = digest_path(out, rank);
            take_handed_back(&path).and_then(|bytes| serde_json::from_slice(&bytes).ok())
        })
        .collect();
    let (Some(record), Some(digests)) = (record, digests.into_iter().collect::<Option<Vec<_>>>())
    else {
        return;
    };
    record.cross_rank = Some(check_digests(&digests));
}

/// Rank 0's record from `out` (removed), unless the launch failed, with the comparison of
/// the `world_size` ranks' state digests.
pub fn read_record(
    out: &Path,
    launched: Result<(), RunFailed>,
    world_size: usize,
) -> Result<RunRecord, RunFailed> {
    let read = take_handed_back(out);
    let mut record = None;
    let checked = launched.and_then(|()| {
        let bytes = read.ok_or_else(|| {
            RunFailed::simple(format!(
                "reading rank 0's record: nothing was handed back at {}",
                out.display()
            ))
        })?;
        record = Some(
            decode_record(&bytes)
                .map_err(|e| RunFailed::simple(format!("rank 0's record is unreadable: {e}")))?,
        );
        Ok(())
    });
    attach_cross_rank(record.as_mut(), out, world_size);
    checked?;
    record.ok_or_else(|| RunFailed::simple("rank 0 handed back no record"))
}

/// Rank 0's record, written where the launching process reads it back: in CBOR, where every
/// tensor's values are one byte string of the exact bits ([`lockstep_core::num::vec`]), since
/// records of per-step gradients run to megabytes and a launch hands back dozens (as JSON,
/// rendering and parsing every value was a tenth of the matrix's time). Only
/// [`decode_record`] reads it; what users keep stays JSON.
pub fn hand_back_record(record: &RunRecord, out: &Path) -> Result<(), RankError> {
    let what = "the record";
    let mut bytes = Vec::new();
    ciborium::into_writer(record, &mut bytes).map_err(RankError::EncodeRecord)?;
    hand_back_bytes(what, out, bytes)
}

/// Reads a record [`hand_back_record`] wrote.
pub fn decode_record(bytes: &[u8]) -> Result<RunRecord, ciborium::de::Error<std::io::Error>> {
    ciborium::from_reader(bytes)
}
