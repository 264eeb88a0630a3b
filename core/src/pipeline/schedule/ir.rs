//! The schedule IR: a schedule is data — per rank, the list of actions it runs in order.
//!
//! Actions print and parse in PyTorch's notation (`torch.distributed.pipelining`'s `_Action`):
//! stage index, label, microbatch index (absent for `UNSHARD`, `RESHARD`, `REDUCE_GRAD`),
//! e.g. `0F1`, `3SEND_B2`, `1UNSHARD`, so schedules can be exchanged with PyTorch as CSV.

use serde::{Deserialize, Serialize};
use std::fmt;

/// What an action does. Compute: F, B (full backward), I (input gradient only), W (weight
/// gradient only). Communication: sends and receives of activations (F) and gradients (B).
/// FSDP×PP bookkeeping: UNSHARD, RESHARD, REDUCE_GRAD (no microbatch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ActionKind {
    /// `F`: a stage's forward for one microbatch (the loss stage also computes the loss).
    Forward,
    /// `B`: the whole backward (input and weight gradients).
    FullBackward,
    /// `I`: the input-gradient half of the backward (what the previous stage waits for).
    BackwardInput,
    /// `W`: the weight-gradient half, deferrable to fill bubbles.
    BackwardWeight,
    /// `SEND_F`: send the stage's activations to its consumers on other ranks.
    SendF,
    /// `RECV_F`: receive the stage's inputs from its producers on other ranks.
    RecvF,
    /// `SEND_B`: send the stage's input gradients to its producers on other ranks.
    SendB,
    /// `RECV_B`: receive the stage's output gradients from its consumers on other ranks.
    RecvB,
    /// `UNSHARD`: gather an FSDP-sharded stage's parameters (FSDP×PP).
    Unshard,
    /// `RESHARD`: free the gathered parameters again (FSDP×PP).
    Reshard,
    /// `REDUCE_GRAD`: reduce the stage's accumulated gradients across data-parallel ranks.
    ReduceGrad,
}

impl ActionKind {
    /// Every kind, for parsing and exhaustive tests.
    pub const ALL: [ActionKind; 11] = [
        ActionKind::Forward,
        ActionKind::FullBackward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::SendF,
        ActionKind::RecvF,
        ActionKind::SendB,
        ActionKind::RecvB,
        ActionKind::Unshard,
        ActionKind::Reshard,
        ActionKind::ReduceGrad,
    ];

    /// PyTorch's label (`_ComputationType` value), used in the text format.
    pub fn label(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::FullBackward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendF => "SEND_F",
            ActionKind::RecvF => "RECV_F",
            ActionKind::SendB => "SEND_B",
            ActionKind::RecvB => "RECV_B",
            ActionKind::Unshard => "UNSHARD",
            ActionKind::Reshard => "RESHARD",
            ActionKind::ReduceGrad => "REDUCE_GRAD",
        }
    }

    /// F, B, I or W: the actions that take time in a simulation.
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::FullBackward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }

    /// Point-to-point sends and receives: what lowering inserts.
    pub fn is_comm(self) -> bool {
        matches!(
            self,
            ActionKind::SendF | ActionKind::RecvF | ActionKind::SendB | ActionKind::RecvB
        )
    }

    /// Whether the text format carries a microbatch index for this kind.
    pub fn has_microbatch(self) -> bool {
        !matches!(
            self,
            ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad
        )
    }
}

impl fmt::Display for ActionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One step of one rank: `kind` on `stage` for `microbatch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Action {
    /// The stage (global index) the action runs on; its rank must hold it.
    pub stage: usize,
    /// What the action does.
    pub kind: ActionKind,
    /// `None` only for UNSHARD, RESHARD and REDUCE_GRAD.
    pub microbatch: Option<usize>,
}

impl Action {
    /// An action; `microbatch` should be `None` exactly for kinds without one.
    pub fn new(stage: usize, kind: ActionKind, microbatch: Option<usize>) -> Self {
        Action {
            stage,
            kind,
            microbatch,
        }
    }

    /// `kind` on `stage` for microbatch `mb` (every kind but the FSDP ones).
    pub fn mb(stage: usize, kind: ActionKind, mb: usize) -> Self {
        Action::new(stage, kind, Some(mb))
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.stage, self.kind.label())?;
        if let Some(mb) = self.microbatch {
            write!(f, "{mb}")?;
        }
        Ok(())
    }
}

/// A pipeline schedule as data: which rank holds each stage, how stages feed each other, and
/// what every rank runs, in order.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Schedule {
    /// The generator (`1f1b`, `gpipe`, …) or `csv` for a loaded schedule.
    pub name: String,
    /// Pipeline ranks (`p`).
    pub ranks: usize,
    /// Microbatches per step (`m`).
    pub microbatches: usize,
    /// Stage index → rank; its length is the number of stages. The highest stage computes
    /// the loss.
    pub stage_ranks: Vec<usize>,
    /// Stage dataflow `(producer, consumer)` with producer < consumer. Always holds the chain
    /// `(s, s + 1)`; skip connections add edges to later, non-adjacent stages.
    pub edges: Vec<(usize, usize)>,
    /// Per rank, its actions in execution order.
    pub actions: Vec<Vec<Action>>,
}

/// The chain edges `(s, s + 1)` of `stages` stages: every stage feeds the next.
pub fn chain_edges(stages: usize) -> Vec<(usize, usize)> {
    (1..stages).map(|s| (s - 1, s)).collect()
}

impl Schedule {
    /// A schedule with the chain edges.
    pub fn new(
        name: impl Into<String>,
        ranks: usize,
        microbatches: usize,
        stage_ranks: Vec<usize>,
        actions: Vec<Vec<Action>>,
    ) -> Self {
        let edges = chain_edges(stage_ranks.len());
        Schedule {
            name: name.into(),
            ranks,
            microbatches,
            stage_ranks,
            edges,
            actions,
        }
    }

    /// Number of stages (`p × v` for built-in schedules).
    pub fn stages(&self) -> usize {
        self.stage_ranks.len()
    }

    /// The stage that computes the loss: the highest index.
    pub fn loss_stage(&self) -> usize {
        self.stages().saturating_sub(1)
    }

    /// The stages rank `r` holds, in increasing order.
    pub fn stages_of_rank(&self, r: usize) -> Vec<usize> {
        (0..self.stages())
            .filter(|&s| self.stage_ranks[s] == r)
            .collect()
    }

    /// The rank holding `stage`, if the stage exists.
    pub fn rank_of(&self, stage: usize) -> Option<usize> {
        self.stage_ranks.get(stage).copied()
    }

    /// The stages `stage` takes inputs from.
    pub fn producers(&self, stage: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .edges
            .iter()
            .filter(|e| e.1 == stage)
            .map(|e| e.0)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The stages that take inputs from `stage`.
    pub fn consumers(&self, stage: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .edges
            .iter()
            .filter(|e| e.0 == stage)
            .map(|e| e.1)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether edge `(a, b)` crosses ranks (and so needs a send and a receive).
    pub fn is_remote(&self, a: usize, b: usize) -> bool {
        self.rank_of(a) != self.rank_of(b)
    }

    /// Producers of `stage` on another rank: `stage` needs RECV_F and SEND_B.
    pub fn remote_producers(&self, stage: usize) -> Vec<usize> {
        let mut v = self.producers(stage);
        v.retain(|&s| self.is_remote(s, stage));
        v
    }

    /// Consumers of `stage` on another rank: `stage` needs SEND_F and RECV_B.
    pub fn remote_consumers(&self, stage: usize) -> Vec<usize> {
        let mut v = self.consumers(stage);
        v.retain(|&t| self.is_remote(stage, t));
        v
    }

    /// Whether communication has been inserted (any SEND or RECV present).
    pub fn is_lowered(&self) -> bool {
        self.actions.iter().flatten().any(|a| a.kind.is_comm())
    }

    /// The schedule with its sends and receives removed.
    pub fn compute_only(&self) -> Schedule {
        let mut s = self.clone();
        for list in &mut s.actions {
            list.retain(|a| !a.kind.is_comm());
        }
        s
    }
}

impl fmt::Display for Schedule {
    /// One line per rank: `rank 0: 0F0 0F1 0B0 …`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, list) in self.actions.iter().enumerate() {
            write!(f, "rank {r}:")?;
            for a in list {
                write!(f, " {a}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

/// How stages are laid out on ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum StageLayout {
    /// Rank `r` holds stages `r, r + p, r + 2p, …` (interleaved / looped schedules).
    Loop,
    /// Zig-zag: chunk `c` of `p` consecutive stages runs on ranks `0..p` when `c` is even and
    /// `p-1..=0` when odd. For `v = 2`, rank `r` holds stages `r` and `2p-1-r`, so the first
    /// and last stage share rank 0 and the turn (stages `p-1`, `p`) needs no communication.
    V,
}

impl StageLayout {
    /// The rank holding `stage` with `p` ranks.
    pub fn rank_of(self, stage: usize, p: usize) -> usize {
        let (chunk, offset) = (stage / p, stage % p);
        match self {
            StageLayout::Loop => offset,
            StageLayout::V if chunk % 2 == 0 => offset,
            StageLayout::V => p - 1 - offset,
        }
    }

    /// Stage index → rank for `p` ranks with `v` stages each.
    pub fn stage_ranks(self, p: usize, v: usize) -> Vec<usize> {
        if p == 0 {
            return Vec::new();
        }
        (0..p * v).map(|s| self.rank_of(s, p)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_print_and_parse_in_pytorch_format() {
        for (text, action) in [
            ("0F1", Action::mb(0, ActionKind::Forward, 1)),
            ("3SEND_B2", Action::mb(3, ActionKind::SendB, 2)),
            ("12RECV_F10", Action::mb(12, ActionKind::RecvF, 10)),
            ("2I0", Action::mb(2, ActionKind::BackwardInput, 0)),
            ("2W7", Action::mb(2, ActionKind::BackwardWeight, 7)),
            ("1B3", Action::mb(1, ActionKind::FullBackward, 3)),
            ("1UNSHARD", Action::new(1, ActionKind::Unshard, None)),
            ("0RESHARD", Action::new(0, ActionKind::Reshard, None)),
            ("4REDUCE_GRAD", Action::new(4, ActionKind::ReduceGrad, None)),
        ] {
            assert_eq!(action.to_string(), text);
            assert_eq!(text.parse::<Action>().unwrap(), action);
        }
        for kind in ActionKind::ALL {
            let a = Action::new(5, kind, kind.has_microbatch().then_some(9));
            assert_eq!(a.to_string().parse::<Action>().unwrap(), a);
        }
    }

    #[test]
    fn parse_errors_name_the_text() {
        for (text, why) in [
            ("F1", "stage index"),
            ("0X1", "unknown action label"),
            ("0F", "needs a microbatch"),
            ("0UNSHARD3", "takes no microbatch"),
            ("0F1x", "not a microbatch index"),
            ("(0F1;1B0)OVERLAP_F_B", "OVERLAP_F_B"),
        ] {
            let e = text.parse::<Action>().unwrap_err().to_string();
            assert!(e.contains(&format!("`{text}`")), "{e}");
            assert!(e.contains(why), "{e}");
        }
    }

    #[test]
    fn kinds_classify() {
        let compute: Vec<_> = ActionKind::ALL.iter().filter(|k| k.is_compute()).collect();
        let comm: Vec<_> = ActionKind::ALL.iter().filter(|k| k.is_comm()).collect();
        assert_eq!(compute.len(), 4);
        assert_eq!(comm.len(), 4);
        assert!(!ActionKind::Unshard.is_compute() && !ActionKind::Unshard.is_comm());
    }

    #[test]
    fn schedules_serialize() {
        let s = Schedule::new(
            "t",
            2,
            1,
            vec![0, 1],
            vec![
                vec![Action::mb(0, ActionKind::Forward, 0)],
                vec![Action::mb(1, ActionKind::Forward, 0)],
            ],
        );
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<Schedule>(&json).unwrap(), s);
        assert_eq!(s.to_string(), "rank 0: 0F0\nrank 1: 1F0\n");
    }

    #[test]
    fn placements() {
        assert_eq!(StageLayout::Loop.stage_ranks(3, 2), vec![0, 1, 2, 0, 1, 2]);
        assert_eq!(StageLayout::V.stage_ranks(3, 2), vec![0, 1, 2, 2, 1, 0]);
        assert_eq!(
            StageLayout::V.stage_ranks(2, 4),
            vec![0, 1, 1, 0, 0, 1, 1, 0]
        );
        assert_eq!(StageLayout::Loop.stage_ranks(4, 1), vec![0, 1, 2, 3]);
        let s = Schedule::new("t", 3, 1, StageLayout::V.stage_ranks(3, 2), vec![vec![]; 3]);
        assert_eq!(s.stages(), 6);
        assert_eq!(s.stages_of_rank(1), vec![1, 4]);
        assert_eq!(s.loss_stage(), 5);
        assert_eq!(s.edges, chain_edges(6));
        assert_eq!(s.remote_consumers(2), Vec::<usize>::new());
        assert_eq!(s.remote_consumers(1), vec![2]);
    }
}
