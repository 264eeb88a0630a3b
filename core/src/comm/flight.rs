//! The flight recorder: every process keeps a ring of its last collectives so a hang or a
//! desync can be explained afterwards (which rank stopped where, on what shapes).

use crate::comm::work::lock;
use crate::comm::{DType, OpKind};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

/// How many operations the ring keeps.
pub const CAPACITY: usize = 64;

/// Where an operation got to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OpRecord {
    /// Process-wide record id, increasing.
    pub id: u64,
    /// The group's name.
    pub group: String,
    /// Collective sequence number within the group (point-to-point: per-peer counter).
    pub seq: u64,
    /// The operation issued.
    pub op: OpKind,
    /// Shapes of the tensors involved (input first, then output where they differ).
    pub shapes: Vec<Vec<i64>>,
    /// Element type (`None` for a barrier).
    pub dtype: Option<DType>,
    /// Peer for point-to-point operations (group rank).
    pub peer: Option<usize>,
    /// What the call carried, when its caller said ([`crate::comm::labelled`]): a hang's
    /// diagnosis then names each rank's tensor, not only a sequence number and a shape.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    /// How far the operation got: what a hang dump reads to find the rank that is stuck.
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
    label: Option<String>,
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
        label,
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
        let label = r
            .label
            .as_ref()
            .map(|l| format!(": {l}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  #{:<4} {:<10} seq={:<4} {:<15} {:<5} {}{} {:?} ({} ms){label}\n",
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

impl OpState {
    /// Whether the operation had not finished (queued or exchanging data).
    pub fn is_pending(&self) -> bool {
        matches!(self, OpState::Scheduled | OpState::Started)
    }
}

impl OpRecord {
    fn is_collective(&self) -> bool {
        !matches!(self.op, OpKind::Send | OpKind::Recv)
    }

    /// `all_reduce f32[3] (Started)`: what the diagnosis says of one operation.
    fn brief(&self) -> String {
        let dtype = self.dtype.map(|d| format!(" {d}")).unwrap_or_default();
        let shape = self
            .shapes
            .first()
            .map(|s| format!("{s:?}"))
            .unwrap_or_default();
        let state = match &self.state {
            OpState::Failed(_) => "Failed".to_owned(),
            s => format!("{s:?}"),
        };
        let carried = self
            .label
            .as_ref()
            .map(|l| format!(", carrying {l}"))
            .unwrap_or_default();
        format!("{}{dtype}{shape} ({state}){carried}", self.op)
    }
}

/// The global ranks a group's name lists (`shard[0,1]` → 0 and 1); `None` for names that do
/// not list them (`world` and user-named groups), whose members are the ranks that used them.
fn members_from_name(name: &str) -> Option<Vec<usize>> {
    let inner = name.strip_suffix(']')?.rsplit_once('[')?.1;
    inner
        .split(',')
        .map(|r| r.trim().parse().ok())
        .collect::<Option<Vec<usize>>>()
}

/// Explains a hang from every rank's flight recorder: per group, the ranks that are inside
/// a collective their peers never issued (a desync), collectives the ranks called
/// differently (a mismatch), and what each rank is waiting in. `ranks[r]` is rank `r`'s
/// recorder (`None`: it left no dump). Returns one sentence per finding, most telling first;
/// when the ranks agree everywhere it says so, since then the hang is not a desync.
pub fn diagnose(ranks: &[Option<Vec<OpRecord>>]) -> Vec<String> {
    let mut findings = Vec::new();
    let silent: Vec<String> = (0..ranks.len())
        .filter(|&r| ranks[r].is_none())
        .map(|r| r.to_string())
        .collect();
    for (group, by_rank) in &newest_collectives(ranks) {
        findings.extend(group_findings(group, by_rank, ranks));
    }
    findings.extend(pending_receives(ranks));
    if !silent.is_empty() {
        findings.push(format!(
            "rank{} {} left no flight recorder (it did not answer the dump request: busy outside \
             any collective, or stopped)",
            if silent.len() > 1 { "s" } else { "" },
            silent.join(", ")
        ));
    }
    if findings.is_empty() {
        findings.push(no_desync(ranks));
    }
    findings
}

/// Group -> rank -> that rank's newest collective on it: where each rank got to per group.
fn newest_collectives(
    ranks: &[Option<Vec<OpRecord>>],
) -> BTreeMap<&str, BTreeMap<usize, &OpRecord>> {
    let mut newest: BTreeMap<&str, BTreeMap<usize, &OpRecord>> = BTreeMap::new();
    for (rank, records) in ranks.iter().enumerate() {
        for rec in records.iter().flatten().filter(|r| r.is_collective()) {
            let slot = newest.entry(rec.group.as_str()).or_default().entry(rank);
            slot.and_modify(|e| {
                if rec.seq >= e.seq {
                    *e = rec;
                }
            })
            .or_insert(rec);
        }
    }
    newest
}

/// The operations `rank` has pending, as the diagnosis names them.
fn waiting_in(ranks: &[Option<Vec<OpRecord>>], rank: usize) -> String {
    let pending: Vec<String> = ranks[rank]
        .iter()
        .flatten()
        .filter(|r| r.state.is_pending())
        .map(|r| format!("{} #{} {}", r.group, r.seq, r.brief()))
        .collect();
    if pending.is_empty() {
        "nothing (no operation pending)".to_owned()
    } else {
        pending.join(", ")
    }
}

/// One group's findings: a desync if some ranks are ahead of others, else any mismatch.
fn group_findings(
    group: &str,
    by_rank: &BTreeMap<usize, &OpRecord>,
    ranks: &[Option<Vec<OpRecord>>],
) -> Vec<String> {
    let members = members_from_name(group)
        .unwrap_or_else(|| {
            if group == "world" {
                (0..ranks.len()).collect()
            } else {
                by_rank.keys().copied().collect()
            }
        })
        .into_iter()
        .filter(|&r| r < ranks.len() && ranks[r].is_some())
        .collect::<Vec<_>>();
    let Some(front) = by_rank.values().max_by_key(|r| r.seq) else {
        return Vec::new();
    };
    match desync(group, front, by_rank, &members, ranks) {
        Some(finding) => vec![finding],
        None => mismatches(group, front, by_rank),
    }
}

/// A desync: ranks inside the group's newest collective (`front`) that other members never issued.
fn desync(
    group: &str,
    front: &OpRecord,
    by_rank: &BTreeMap<usize, &OpRecord>,
    members: &[usize],
    ranks: &[Option<Vec<OpRecord>>],
) -> Option<String> {
    let ahead: Vec<usize> = by_rank
        .iter()
        .filter(|(_, r)| r.seq == front.seq && r.state.is_pending())
        .map(|(&rank, _)| rank)
        .collect();
    let behind: Vec<usize> = members
        .iter()
        .copied()
        .filter(|m| by_rank.get(m).is_none_or(|r| r.seq < front.seq))
        .collect();
    if ahead.is_empty() || behind.is_empty() {
        return None;
    }
    let behind_text: Vec<String> = behind
        .iter()
        .map(|&b| {
            let last = by_rank
                .get(&b)
                .map_or("no collective on this group".to_owned(), |r| {
                    format!("last issued #{} {}", r.seq, r.brief())
                });
            format!("rank {b} ({last}; waiting in: {})", waiting_in(ranks, b))
        })
        .collect();
    Some(format!(
        "desync on group {group}: rank{} {} inside collective #{} {}, which {} never issued: {}",
        if ahead.len() > 1 { "s" } else { "" },
        join_ranks(&ahead),
        front.seq,
        front.brief(),
        join_ranks(&behind),
        behind_text.join("; ")
    ))
}

/// Same collective number everywhere: the ranks that called something else than the first.
fn mismatches(group: &str, front: &OpRecord, by_rank: &BTreeMap<usize, &OpRecord>) -> Vec<String> {
    let mut findings = Vec::new();
    let same_seq: Vec<(usize, &&OpRecord)> = by_rank
        .iter()
        .filter(|(_, r)| r.seq == front.seq)
        .map(|(k, v)| (*k, v))
        .collect();
    if let Some((first_rank, first)) = same_seq.first() {
        for (rank, rec) in &same_seq[1..] {
            if rec.op != first.op || rec.dtype != first.dtype || rec.shapes != first.shapes {
                findings.push(format!(
                    "mismatch on group {group} collective #{}: rank {first_rank} called {} but rank {rank} called {}",
                    front.seq,
                    first.brief(),
                    rec.brief()
                ));
            }
        }
    }
    findings
}

/// Point-to-point: receives whose message the sender never sent.
fn pending_receives(ranks: &[Option<Vec<OpRecord>>]) -> Vec<String> {
    let mut findings = Vec::new();
    for (rank, records) in ranks.iter().enumerate() {
        for recv in records
            .iter()
            .flatten()
            .filter(|r| r.op == OpKind::Recv && r.state.is_pending())
        {
            findings.push(format!(
                "rank {rank} waits to receive message #{} on group {} from its group rank {}",
                recv.seq,
                recv.group,
                recv.peer.map_or("?".into(), |p| p.to_string())
            ));
        }
    }
    findings
}

/// The finding when the ranks agree everywhere: what is still pending, if anything.
fn no_desync(ranks: &[Option<Vec<OpRecord>>]) -> String {
    let stuck: Vec<String> = (0..ranks.len())
        .filter(|&r| ranks[r].iter().flatten().any(|o| o.state.is_pending()))
        .map(|r| format!("rank {r} in {}", waiting_in(ranks, r)))
        .collect();
    if stuck.is_empty() {
        "no desync: every rank issued the same collectives and none is pending (the ranks \
         are busy or blocked outside communication)"
            .to_owned()
    } else {
        format!(
            "no desync: the ranks issued the same collectives on every group; still pending: {}",
            stuck.join("; ")
        )
    }
}

fn join_ranks(ranks: &[usize]) -> String {
    let names: Vec<String> = ranks.iter().map(usize::to_string).collect();
    names.join(", ")
}

#[cfg(test)]
mod diagnose_tests {
    use super::*;

    fn rec(group: &str, seq: u64, op: OpKind, state: OpState) -> OpRecord {
        OpRecord {
            id: seq,
            group: group.into(),
            seq,
            op,
            shapes: vec![vec![3]],
            dtype: Some(DType::F32),
            peer: None,
            label: None,
            state,
            issued_ms: 0,
            elapsed_ms: 0,
        }
    }

    #[test]
    fn names_the_rank_that_never_issued_the_collective() {
        let r0 = vec![
            rec("shard[0,1]", 0, OpKind::AllGather, OpState::Completed),
            rec("shard[0,1]", 1, OpKind::AllReduce, OpState::Started),
        ];
        let r1 = vec![
            rec("shard[0,1]", 0, OpKind::AllGather, OpState::Completed),
            rec("replicate[1,3]", 4, OpKind::Broadcast, OpState::Started),
        ];
        let found = diagnose(&[Some(r0), Some(r1)]);
        assert!(
            found[0]
                .starts_with("desync on group shard[0,1]: rank 0 inside collective #1 all_reduce")
                && found[0].contains("which 1 never issued")
                && found[0].contains("replicate[1,3] #4 broadcast"),
            "{found:?}"
        );
    }

    /// A skipped collective names what each side's call carried: the bucket rank 0 waits in
    /// and the loss average rank 1 went on to.
    #[test]
    fn a_desync_names_the_tensors_each_rank_called_with() {
        let labelled = |seq, op, state, label: &str| OpRecord {
            label: Some(label.to_owned()),
            ..rec("world", seq, op, state)
        };
        let bucket = "DDP gradient bucket 1: `fc.bias`";
        let loss = "the step's loss, averaged over the ranks";
        let r0 = vec![labelled(3, OpKind::AllReduce, OpState::Started, bucket)];
        let r1 = vec![
            labelled(
                2,
                OpKind::AllReduce,
                OpState::Completed,
                "DDP gradient bucket 0: `fc.weight`",
            ),
            OpRecord {
                group: "metrics".into(),
                ..labelled(0, OpKind::AllReduce, OpState::Started, loss)
            },
        ];
        let found = diagnose(&[Some(r0), Some(r1)]);
        assert!(
            found[0].contains(&format!(
                "(Started), carrying {bucket}, which 1 never issued"
            )) && found[0].contains(&format!("carrying {loss}")),
            "{found:?}"
        );
        let table = render(&[labelled(3, OpKind::AllReduce, OpState::Started, bucket)]);
        assert!(
            table.trim_end().ends_with(&format!(": {bucket}")),
            "{table}"
        );
    }

    #[test]
    fn names_a_mismatched_collective_and_agreement() {
        let a = vec![rec("world", 2, OpKind::AllReduce, OpState::Started)];
        let b = vec![rec("world", 2, OpKind::Broadcast, OpState::Started)];
        let found = diagnose(&[Some(a.clone()), Some(b)]);
        assert!(
            found
                .iter()
                .any(|f| f.starts_with("mismatch on group world collective #2")),
            "{found:?}"
        );
        let agree = diagnose(&[Some(a.clone()), Some(a)]);
        assert_eq!(agree.len(), 1, "{agree:?}");
        assert!(agree[0].starts_with("no desync"), "{agree:?}");
    }
}
