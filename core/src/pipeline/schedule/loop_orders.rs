//! Orders of the schedules that place stages round-robin (rank `r` holds `r, r+p, …`):
//! GPipe, 1F1B, Looped BFS, interleaved 1F1B and interleaved zero bubble. Callers have
//! checked the (p, v, m) rules; each function returns one action list per rank.

use super::ir::{Action, ActionKind};
use super::rank_ops::RankOps;
use std::collections::VecDeque;

use ActionKind::{BackwardInput as I, BackwardWeight as W, Forward as F, FullBackward as B};

/// GPipe: every forward in microbatch order, then every backward.
pub(super) fn gpipe(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|r| {
            let mut ops = RankOps::default();
            (0..m).for_each(|_| {
                ops.push(r, F);
            });
            (0..m).for_each(|_| {
                ops.push(r, B);
            });
            ops.actions
        })
        .collect()
}

/// 1F1B: rank `r` runs `p-1-r` warmup forwards, then one forward and one backward until
/// the forwards run out, then the remaining backwards (PyTorch's `Schedule1F1B` order).
pub(super) fn one_f_one_b(p: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|r| {
            let warmup = (p - 1 - r).min(m);
            let mut ops = RankOps::default();
            for _ in 0..warmup {
                ops.push(r, F);
            }
            for _ in warmup..m {
                ops.push(r, F);
                ops.push(r, B);
            }
            for _ in 0..warmup {
                ops.push(r, B);
            }
            ops.actions
        })
        .collect()
}

/// Looped BFS: all microbatches of a local stage before the next local stage, forwards
/// over stages in increasing order, backwards in decreasing order. PyTorch runs each stage's
/// backwards in decreasing microbatch order; ours are increasing, as the executor's FIFO
/// channels require (the bubble is the same: a stage's backwards all wait on the stage above).
pub(super) fn looped_bfs(p: usize, v: usize, m: usize) -> Vec<Vec<Action>> {
    (0..p)
        .map(|r| {
            let mut ops = RankOps::default();
            let local: Vec<usize> = (0..v).map(|c| c * p + r).collect();
            for &s in &local {
                (0..m).for_each(|_| {
                    ops.push(s, F);
                });
            }
            for &s in local.iter().rev() {
                (0..m).for_each(|_| {
                    ops.push(s, B);
                });
            }
            ops.actions
        })
        .collect()
}

/// Megatron's interleaved 1F1B (`zero_bubble = false`) and PyTorch's interleaved zero bubble
/// (ZB1P, `zero_bubble = true`) for `m` a multiple of `p`.
///
/// Forwards visit the local stages `p` microbatches at a time (depth first); rank `r` warms
/// up with `(v-1)·p + 2·(p-1-r)` forwards (`+ (p-1-r)` for zero bubble, whose input-gradient
/// backward I is shorter), then alternates one forward and one backward (B, or I), visiting
/// the local stages in reverse, then drains the backwards. Zero bubble defers each W: rank
/// `r` runs its first `r` backwards without W, then one W (oldest I first) after every I, and
/// the rest at the end, so the W fill the bubbles of the ranks that wait longest.
pub(super) fn interleaved(p: usize, v: usize, m: usize, zero_bubble: bool) -> Vec<Vec<Action>> {
    (0..p)
        .map(|r| interleaved_rank(p, v, m, r, zero_bubble))
        .collect()
}

fn interleaved_rank(p: usize, v: usize, m: usize, r: usize, zero_bubble: bool) -> Vec<Action> {
    let total = v * m;
    let hops = p - 1 - r;
    let warmup = ((v - 1) * p + if zero_bubble { hops } else { 2 * hops }).min(total);
    let forward_stage = |k: usize| ((k / p) % v) * p + r;
    let backward_stage = |j: usize| (v - 1 - (j / p) % v) * p + r;
    let mut ops = RankOps::default();
    // Stages whose I ran and whose W is still owed, oldest first.
    let mut owed: VecDeque<usize> = VecDeque::new();
    let backward = |ops: &mut RankOps, owed: &mut VecDeque<usize>, j: usize| {
        let s = backward_stage(j);
        if !zero_bubble {
            ops.push(s, B);
            return;
        }
        ops.push(s, I);
        owed.push_back(s);
        if j >= r {
            if let Some(w) = owed.pop_front() {
                ops.push(w, W);
            }
        }
    };
    for k in 0..warmup {
        ops.push(forward_stage(k), F);
    }
    let mut j = 0;
    for k in warmup..total {
        ops.push(forward_stage(k), F);
        backward(&mut ops, &mut owed, j);
        j += 1;
    }
    for j in j..total {
        backward(&mut ops, &mut owed, j);
    }
    for w in owed {
        ops.push(w, W);
    }
    ops.actions
}
