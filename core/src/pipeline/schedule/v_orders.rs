//! Orders of the schedules that place two stages per rank in a V (rank `r` holds stages `r`
//! and `2p-1-r`, so rank 0 holds the first and the loss stage): ZBV and DualPipeV. Callers
//! have checked the rules (v = 2; DualPipeV also m ≥ 2p).

use super::ir::{Action, ActionKind};
use super::rank_ops::RankOps;
use std::collections::VecDeque;

use ActionKind::{BackwardInput as I, BackwardWeight as W, Forward as F, FullBackward as B};

/// ZBV (zero bubble, V shape; PyTorch's `ScheduleZBVZeroBubble`). With `c0 = r` and
/// `c1 = 2p-1-r`, rank `r` warms up with `2(p-r)-1` forwards of `c0`, then `r` pairs
/// `F c1, F c0`, then `p-r` triples `F c1, I c1, W c1`; in steady state it runs
/// `F c0, I c0, W c0, F c1, I c1, W c1`; it cools down with `r` pairs `I c0, I c1`, `p-r` pairs
/// `I c0, W c0`, then the deferred W. The order is built for `max(2p-1, m)` microbatches (the
/// fewest that fill the V) and the actions of microbatches `≥ m` are dropped, which keeps it
/// valid: microbatches never depend on each other.
pub(super) fn zbv(p: usize, m: usize) -> Vec<Vec<Action>> {
    let n = m.max(2 * p - 1);
    (0..p)
        .map(|r| {
            let (c0, c1) = (r, 2 * p - 1 - r);
            let mut ops = RankOps::default();
            for _ in 0..2 * (p - r) - 1 {
                ops.push(c0, F);
            }
            for _ in 0..r {
                ops.push(c1, F);
                ops.push(c0, F);
            }
            for _ in 0..p - r {
                ops.push(c1, F);
                ops.push(c1, I);
                ops.push(c1, W);
            }
            while ops.count(c1, F) < ops.count(c0, F) || ops.count(c0, F) < n {
                if ops.count(c0, F) < n {
                    ops.push(c0, F);
                }
                ops.push(c0, I);
                ops.push(c0, W);
                ops.push(c1, F);
                ops.push(c1, I);
                ops.push(c1, W);
            }
            for _ in 0..r {
                ops.push(c0, I);
                ops.push(c1, I);
            }
            for _ in 0..p - r {
                ops.push(c0, I);
                ops.push(c0, W);
            }
            for c in [c1, c0] {
                while ops.count(c, W) < ops.count(c, I) {
                    ops.push(c, W);
                }
            }
            let mut actions = ops.actions;
            actions.retain(|a| a.microbatch.is_some_and(|mb| mb < m));
            actions
        })
        .collect()
}

/// DualPipeV (PyTorch's `ScheduleDualPipeV`, after DeepSeek's DualPipe). With `s0 = r` and
/// `s1 = 2p-1-r`, rank `r` runs: `2(p-r-1)` × `F s0`; `r+1` × `F s0, F s1`; `p-r-1` ×
/// `I s1, W (oldest pending), F s1`; the main phase, `m-2p+r+1` × `F s0, B s1, F s1, B s0`
/// (PyTorch overlaps each F with the B of another microbatch; here they are adjacent
/// actions); `p-r-1` × `B s1, F s1, B s0`; `r+1` × `B s1, B s0`, switching to I halfway (W
/// deferred); `p-r-1` × `W (pending), I s0`; then the pending W, oldest first.
pub(super) fn dualpipev(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|r| {
            let (s0, s1) = (r, 2 * p - 1 - r);
            let mut d = DualRank::default();
            for _ in 0..2 * (p - r - 1) {
                d.forward(s0);
            }
            for _ in 0..r + 1 {
                d.forward(s0);
                d.forward(s1);
            }
            for _ in 0..p - r - 1 {
                d.backward(s1, true);
                d.weight();
                d.forward(s1);
            }
            for _ in 0..(m + r + 1 - 2 * p) {
                d.forward(s0);
                d.backward(s1, false);
                d.forward(s1);
                d.backward(s0, false);
            }
            for _ in 0..p - r - 1 {
                d.backward(s1, false);
                d.forward(s1);
                d.backward(s0, false);
            }
            let mut split = false;
            let half = r.div_ceil(2); // (r + 1) / 2, rounded down
            for i in 0..r + 1 {
                split |= i == half && r % 2 == 1;
                d.backward(s1, split);
                split |= i == half && r % 2 == 0;
                d.backward(s0, split);
            }
            for _ in 0..p - r - 1 {
                d.weight();
                d.backward(s0, split);
            }
            for _ in 0..r + 1 {
                d.weight();
            }
            d.ops.actions
        })
        .collect()
}

/// One DualPipeV rank under construction: the action list and the W still owed, oldest
/// first.
#[derive(Default)]
struct DualRank {
    ops: RankOps,
    pending: VecDeque<(usize, usize)>,
}

impl DualRank {
    fn forward(&mut self, stage: usize) {
        self.ops.push(stage, F);
    }

    /// B, or I (owing a W) when `split`.
    fn backward(&mut self, stage: usize, split: bool) {
        if split {
            let mb = self.ops.push(stage, I);
            self.pending.push_back((stage, mb));
        } else {
            self.ops.push(stage, B);
        }
    }

    /// The oldest owed W, if any.
    fn weight(&mut self) {
        if let Some((stage, mb)) = self.pending.pop_front() {
            self.ops.actions.push(Action::mb(stage, W, mb));
        }
    }
}
