//! TEMPORARY stand-in until the real schedule module lands.
#![allow(dead_code, missing_docs)]
use serde::Serialize;
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum ActionKind { Forward, FullBackward, BackwardInput, BackwardWeight, SendF, RecvF, SendB, RecvB, Unshard, Reshard, ReduceGrad }
impl ActionKind {
    pub fn is_compute(self) -> bool { matches!(self, ActionKind::Forward | ActionKind::FullBackward | ActionKind::BackwardInput | ActionKind::BackwardWeight) }
    pub fn is_comm(self) -> bool { matches!(self, ActionKind::SendF | ActionKind::RecvF | ActionKind::SendB | ActionKind::RecvB) }
}
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct Action { pub stage: usize, pub kind: ActionKind, pub microbatch: Option<usize> }
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let k = match self.kind { ActionKind::Forward => "F", ActionKind::FullBackward => "B", ActionKind::BackwardInput => "I", ActionKind::BackwardWeight => "W", ActionKind::SendF => "SEND_F", ActionKind::RecvF => "RECV_F", ActionKind::SendB => "SEND_B", ActionKind::RecvB => "RECV_B", ActionKind::Unshard => "UNSHARD", ActionKind::Reshard => "RESHARD", ActionKind::ReduceGrad => "REDUCE_GRAD" };
        write!(f, "{}{}", self.stage, k)?;
        if let Some(m) = self.microbatch { write!(f, "{m}")?; }
        Ok(())
    }
}
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Schedule { pub name: String, pub ranks: usize, pub microbatches: usize, pub stage_ranks: Vec<usize>, pub edges: Vec<(usize, usize)>, pub actions: Vec<Vec<Action>> }
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ScheduleKind { GPipe, OneFOneB, Interleaved1F1B, LoopedBfs, InterleavedZeroBubble, Zbv, DualPipeV }
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError { #[error("{0}")] InvalidConfig(String) }
#[derive(Clone, Copy, Debug, Default)]
pub struct Costs;
#[derive(Clone, Debug, Serialize)]
pub struct Simulation;
pub fn generate(_k: ScheduleKind, p: usize, v: usize, m: usize) -> Result<Schedule, ScheduleError> {
    let stages = p * v;
    let stage_ranks: Vec<usize> = (0..stages).map(|s| s % p).collect();
    let mut actions = vec![Vec::new(); p];
    for s in 0..stages { for i in 0..m { actions[s % p].push(Action { stage: s, kind: ActionKind::Forward, microbatch: Some(i) }); } }
    for s in (0..stages).rev() { for i in 0..m { actions[s % p].push(Action { stage: s, kind: ActionKind::FullBackward, microbatch: Some(i) }); } }
    Ok(Schedule { name: "gpipe".into(), ranks: p, microbatches: m, stage_ranks, edges: (1..stages).map(|s| (s - 1, s)).collect(), actions })
}
pub fn lower(s: &Schedule) -> Schedule {
    let mut out = s.clone();
    for (r, list) in s.actions.iter().enumerate() {
        let mut l = Vec::new();
        for a in list {
            let remote_in = s.edges.iter().any(|&(f, t)| t == a.stage && s.stage_ranks[f] != r);
            let remote_out = s.edges.iter().any(|&(f, t)| f == a.stage && s.stage_ranks[t] != r);
            match a.kind {
                ActionKind::Forward => { if remote_in { l.push(Action { kind: ActionKind::RecvF, ..*a }); } l.push(*a); if remote_out { l.push(Action { kind: ActionKind::SendF, ..*a }); } }
                _ => { if remote_out { l.push(Action { kind: ActionKind::RecvB, ..*a }); } l.push(*a); if remote_in { l.push(Action { kind: ActionKind::SendB, ..*a }); } }
            }
        }
        out.actions[r] = l;
    }
    out
}
pub fn validate(_s: &Schedule) -> Result<(), ScheduleError> { Ok(()) }
pub fn simulate(_s: &Schedule, _c: Costs) -> Result<Simulation, ScheduleError> { Ok(Simulation) }
