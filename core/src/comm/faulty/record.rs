//! What an injector saw and decided: one [`CallRecord`] per data-carrying call, the rule
//! that says whether a fault applies to a call ([`applicability`]), what became of the fault
//! ([`Injection`]) and a rank's whole log ([`FaultLog`]).
//!
//! Apart from the injector because a planner reads these from a recorded run, with no
//! group running: they are data and one pure function.

use super::kind::{FaultKind, FaultSite};
use crate::comm::OpKind;
use serde::{Deserialize, Serialize};

/// One data-carrying call as a rank issued it: enough to name a site in a table and to decide
/// whether a fault applies to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The step the loop was in.
    pub step: usize,
    /// Its position in the step on this rank (see [`FaultSite::index`]).
    pub index: usize,
    /// The issuing global rank.
    pub rank: usize,
    /// The operation.
    pub op: OpKind,
    /// The group's name (`world`, `dp[0,2]`, `pp-edge[0,1]`).
    pub group: String,
    /// This rank's rank in the group.
    pub group_rank: usize,
    /// The group's size.
    pub group_size: usize,
    /// The broadcast root, the send's destination or the receive's source (group ranks).
    pub peer: Option<usize>,
    /// Shape of the tensor a fault alters: the in-place tensor of an all-reduce, broadcast,
    /// send or receive; the output of an all-gather, reduce-scatter or all-to-all.
    pub shape: Vec<i64>,
    /// Its element type (`f32`, `i64`, …).
    pub dtype: String,
}

impl CallRecord {
    /// The site this call is.
    pub fn site(&self) -> FaultSite {
        FaultSite {
            step: self.step,
            index: self.index,
            rank: self.rank,
        }
    }

    /// Elements of the altered tensor.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// A short description: `all_reduce world [719] f32`, with the peer for point to point
    /// and broadcast.
    pub fn describe(&self) -> String {
        let peer = match (self.op, self.peer) {
            (OpKind::Broadcast, Some(p)) => format!(" root {p}"),
            (OpKind::Send, Some(p)) => format!(" to {p}"),
            (OpKind::Recv, Some(p)) => format!(" from {p}"),
            _ => String::new(),
        };
        format!(
            "{} {}{peer} {:?} {}",
            self.op, self.group, self.shape, self.dtype
        )
    }

    fn is_float(&self) -> bool {
        matches!(self.dtype.as_str(), "f32" | "f64" | "bf16" | "f16")
    }

    /// Whether `other` is the same call in content (a site found again in another run).
    pub fn same_call(&self, other: &CallRecord) -> bool {
        self.op == other.op
            && self.group == other.group
            && self.shape == other.shape
            && self.dtype == other.dtype
            && self.peer == other.peer
    }
}

/// Whether `kind` can alter `call`, given the calls this rank issued before it (`earlier`, in
/// order): `Err` says why not. The injector decides by this at run time; a planner can decide
/// by it on a recorded log and skip runs that could not inject anything.
pub fn applicability(
    kind: FaultKind,
    call: &CallRecord,
    earlier: &[CallRecord],
) -> Result<(), String> {
    if call.numel() == 0 {
        return Err("the tensor is empty".into());
    }
    let chunked = matches!(
        call.op,
        OpKind::AllGather | OpKind::AllToAll | OpKind::ReduceScatter
    );
    match kind {
        FaultKind::Skip if call.op == OpKind::Send => Err(
            "a send has no local result, and not sending would leave its receiver waiting".into(),
        ),
        FaultKind::Skip | FaultKind::Zero => Ok(()),
        FaultKind::Double if call.dtype == "bool" => Err("a bool tensor cannot double".into()),
        FaultKind::Double => Ok(()),
        FaultKind::Perturb(_) | FaultKind::Bf16Reduction if !call.is_float() => {
            Err(format!("{} is not a floating-point type", call.dtype))
        }
        FaultKind::Bf16Reduction if call.dtype == "bf16" => {
            Err("the result is bf16 already".into())
        }
        FaultKind::Perturb(_) | FaultKind::Bf16Reduction => Ok(()),
        FaultKind::PermutedChunks | FaultKind::WrongPeer if chunked && call.group_size < 2 => {
            Err("a group of one rank has one chunk".into())
        }
        FaultKind::PermutedChunks if chunked => Ok(()),
        FaultKind::PermutedChunks => Err(format!("{} has no chunks to permute", call.op)),
        FaultKind::WrongPeer => match call.op {
            OpKind::AllGather | OpKind::AllToAll => Ok(()),
            OpKind::Broadcast => {
                let root = call.peer.unwrap_or(0);
                if call.group_size > 1
                    && call.group_rank != root
                    && call.group_rank == (root + 1) % call.group_size
                {
                    Ok(())
                } else {
                    Err(format!(
                        "only group rank {} holds root + 1's tensor",
                        (root + 1) % call.group_size.max(1)
                    ))
                }
            }
            OpKind::Recv => {
                if earlier.iter().any(|e| wrong_peer_source(call, e)) {
                    Ok(())
                } else {
                    Err("no message of this shape came from another peer on this group".into())
                }
            }
            OpKind::Send => Err("a send's peer is for its receiver to mistake".into()),
            op => Err(format!(
                "{op} combines every rank: there is no peer to mistake"
            )),
        },
        FaultKind::Stale => {
            if earlier.iter().any(|e| stale_source(call, e)) {
                Ok(())
            } else {
                Err("no earlier call on this group had this shape and dtype".into())
            }
        }
    }
}

/// Whether `earlier`'s tensor can stand in for `call`'s as a stale result.
pub(super) fn stale_source(call: &CallRecord, earlier: &CallRecord) -> bool {
    earlier.group == call.group && earlier.shape == call.shape && earlier.dtype == call.dtype
}

/// Whether `earlier` is a receive from another peer that can answer `call` (a receive).
pub(super) fn wrong_peer_source(call: &CallRecord, earlier: &CallRecord) -> bool {
    earlier.op == OpKind::Recv && earlier.peer != call.peer && stale_source(call, earlier)
}

/// What became of the fault an injector was asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Injection {
    /// The call's result was altered.
    Applied {
        /// The call.
        call: CallRecord,
        /// What changed (the perturbed element, the stale source, …).
        detail: String,
    },
    /// The fault applied but left every bit as it was (doubling zeros, skipping a broadcast
    /// on its root): nothing for a test to catch.
    NoChange {
        /// The call.
        call: CallRecord,
    },
    /// The fault cannot apply to this call ([`applicability`]'s reason).
    NotApplicable {
        /// The call.
        call: CallRecord,
        /// Why.
        reason: String,
    },
}

impl Injection {
    /// The call the fault was aimed at.
    pub fn call(&self) -> &CallRecord {
        match self {
            Injection::Applied { call, .. }
            | Injection::NoChange { call }
            | Injection::NotApplicable { call, .. } => call,
        }
    }
}

/// Everything one rank's injector saw: its calls in order and the fate of its fault.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultLog {
    /// The global rank.
    pub rank: usize,
    /// Every data-carrying call, in issue order.
    pub calls: Vec<CallRecord>,
    /// The injected fault's outcome: `None` in record mode, or when the site never came (on
    /// this rank, or at all).
    pub injection: Option<Injection>,
    /// A hash of the state this rank ended the run with, when the launcher adds one: two runs
    /// whose ranks all hash equal trained to the same bits, so a fault that changed none of
    /// them had no effect on the training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_hash: Option<u64>,
}
