//! The flight recorder: every process keeps a ring of its last collectives so a hang or a
//! desync can be explained afterwards (which rank stopped where, on what shapes).

use crate::comm::work::lock;
use crate::comm::{DType, OpKind};
use serde::Serialize;
use std::collections::VecDeque;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// How many operations the ring keeps.
pub const CAPACITY: usize = 64;

/// Where an operation got to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum OpState {
    /// Queued behind earlier asynchronous work.
    Scheduled,
    /// Exchanging data with peers.
    Started,
    /// Finished successfully.
    Completed,
    /// Failed with this error.
    Failed(String),
}

/// One operation as the recorder saw it.
#[derive(Clone, Debug, Serialize)]
pub struct OpRecord {
    /// Process-wide record id, increasing.
    pub id: u64,
    /// The group's name.
    pub group: String,
    /// Collective sequence number within the group (point-to-point: per-peer counter).
    pub seq: u64,
    pub op: OpKind,
    /// Shapes of the tensors involved (input first, then output where they differ).
    pub shapes: Vec<Vec<i64>>,
    pub dtype: Option<DType>,
    /// Peer for point-to-point operations (group rank).
    pub peer: Option<usize>,
    pub state: OpState,
    /// Milliseconds since the Unix epoch when the operation was issued.
    pub issued_ms: u128,
    /// Milliseconds spent from issue to the last state change.
    pub elapsed_ms: u128,
}

struct Recorder {
    next_id: u64,
    ring: VecDeque<OpRecord>,
}

fn recorder() -> &'static Mutex<Recorder> {
    static RECORDER: OnceLock<Mutex<Recorder>> = OnceLock::new();
    RECORDER.get_or_init(|| {
        Mutex::new(Recorder {
            next_id: 0,
            ring: VecDeque::with_capacity(CAPACITY),
        })
    })
}

fn now_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// Records a new operation and returns its id for later state changes.
pub fn record(
    group: &str,
    seq: u64,
    op: OpKind,
    shapes: Vec<Vec<i64>>,
    dtype: Option<DType>,
    peer: Option<usize>,
) -> u64 {
    let mut rec = lock(recorder());
    let id = rec.next_id;
    rec.next_id += 1;
    if rec.ring.len() == CAPACITY {
        rec.ring.pop_front();
    }
    rec.ring.push_back(OpRecord {
        id,
        group: group.to_owned(),
        seq,
        op,
        shapes,
        dtype,
        peer,
        state: OpState::Scheduled,
        issued_ms: now_ms(),
        elapsed_ms: 0,
    });
    id
}

/// Moves operation `id` to `state` (ignored once the record left the ring).
pub fn update(id: u64, state: OpState) {
    let mut rec = lock(recorder());
    if let Some(r) = rec.ring.iter_mut().rev().find(|r| r.id == id) {
        r.state = state;
        r.elapsed_ms = now_ms().saturating_sub(r.issued_ms);
    }
}

/// The ring's current contents, oldest first.
pub fn snapshot() -> Vec<OpRecord> {
    lock(recorder()).ring.iter().cloned().collect()
}

/// A human-readable table of the ring, newest last; what the launcher prints on a hang.
pub fn render(records: &[OpRecord]) -> String {
    if records.is_empty() {
        return "  (no collectives issued)\n".to_owned();
    }
    let mut out = String::new();
    for r in records {
        let shapes: Vec<String> = r.shapes.iter().map(|s| format!("{s:?}")).collect();
        let dtype = r.dtype.map(|d| d.to_string()).unwrap_or_else(|| "-".into());
        let peer = r.peer.map(|p| format!(" peer={p}")).unwrap_or_default();
        out.push_str(&format!(
            "  #{:<4} {:<10} seq={:<4} {:<15} {:<5} {}{} {:?} ({} ms)\n",
            r.id,
            r.group,
            r.seq,
            r.op.to_string(),
            dtype,
            shapes.join(" -> "),
            peer,
            r.state,
            r.elapsed_ms
        ));
    }
    out
}
