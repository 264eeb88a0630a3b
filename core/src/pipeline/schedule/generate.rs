//! The built-in schedules: their names, placements and the (p, v, m) rules each enforces,
//! and [`generate`], which turns a choice into compute-only action lists with chain edges.
//!
//! The orders themselves live in [`super::loop_orders`] (stages placed round-robin) and
//! [`super::v_orders`] (stages placed in a V). Every order runs each stage's microbatches in
//! increasing order for F, for B/I and for W: the executor's channels are FIFO per edge.

use super::error::ScheduleError;
use super::ir::{Schedule, StageLayout};
use super::{loop_orders, v_orders};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// A built-in schedule (the ones `torch.distributed.pipelining` ships).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// Fill-drain: every forward, then every backward.
    #[serde(rename = "gpipe")]
    GPipe,
    /// One forward, one backward in steady state, after `p-1-r` warmup forwards.
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron's interleaved (depth-first) 1F1B over `v` looped stages per rank.
    #[serde(rename = "interleaved_1f1b", alias = "interleaved-1f1b")]
    Interleaved1F1B,
    /// Breadth-first: all microbatches of one local stage before the next.
    #[serde(rename = "looped_bfs", alias = "looped-bfs")]
    LoopedBfs,
    /// Interleaved 1F1B with the backward split into I and W (ZB-H1 style: W fills bubbles).
    #[serde(rename = "interleaved_zb", alias = "interleaved-zb")]
    InterleavedZeroBubble,
    /// Zero-bubble V: two stages per rank in a V, backward split into I and W.
    #[serde(rename = "zbv")]
    Zbv,
    /// DeepSeek's DualPipeV: two stages per rank in a V, overlapped F and B of different
    /// microbatches (listed here as adjacent actions), partly split backward.
    #[serde(rename = "dualpipev")]
    DualPipeV,
}

impl ScheduleKind {
    /// Every built-in schedule.
    pub fn all() -> [ScheduleKind; 7] {
        [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved1F1B,
            ScheduleKind::LoopedBfs,
            ScheduleKind::InterleavedZeroBubble,
            ScheduleKind::Zbv,
            ScheduleKind::DualPipeV,
        ]
    }

    /// The name used on the command line, in CSV plans and in error messages: the spelling
    /// of the `pp.*` configurations (`interleaved_1f1b`), so one name works everywhere.
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved1F1B => "interleaved_1f1b",
            ScheduleKind::LoopedBfs => "looped_bfs",
            ScheduleKind::InterleavedZeroBubble => "interleaved_zb",
            ScheduleKind::Zbv => "zbv",
            ScheduleKind::DualPipeV => "dualpipev",
        }
    }

    /// How the schedule lays its stages on ranks.
    pub fn placement(self) -> StageLayout {
        match self {
            ScheduleKind::Zbv | ScheduleKind::DualPipeV => StageLayout::V,
            _ => StageLayout::Loop,
        }
    }

    /// Stages per rank when none is asked for: 1 for the single-stage schedules, 2 otherwise.
    pub fn default_virtual(self) -> usize {
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB => 1,
            _ => 2,
        }
    }

    /// Whether the schedule splits backward into I and W (so W can fill bubbles).
    pub fn splits_backward(self) -> bool {
        matches!(
            self,
            ScheduleKind::InterleavedZeroBubble | ScheduleKind::Zbv | ScheduleKind::DualPipeV
        )
    }

    /// Checks the (p, v, m) rules of this schedule, as PyTorch enforces them (and the
    /// multiple-of-ranks rule ANCHORS fixes for the interleaved schedules).
    pub fn check(self, p: usize, v: usize, m: usize) -> Result<(), ScheduleError> {
        let name = self.name();
        let err = |rule: String| Err(ScheduleError::config(name, rule));
        if p == 0 {
            return err("needs at least one rank".into());
        }
        if m == 0 {
            return err("needs at least one microbatch".into());
        }
        if v == 0 {
            return err("needs at least one stage per rank (v ≥ 1)".into());
        }
        let stages = p * v;
        match self {
            ScheduleKind::GPipe | ScheduleKind::OneFOneB if v != 1 => {
                err(format!("runs one stage per rank (v = 1), got v = {v}"))
            }
            ScheduleKind::OneFOneB if m < stages => err(format!(
                "needs at least as many microbatches as stages: {m} microbatches, {stages} stages"
            )),
            ScheduleKind::Interleaved1F1B | ScheduleKind::InterleavedZeroBubble
                if !m.is_multiple_of(p) =>
            {
                err(format!(
                    "needs microbatches ({m}) to be a multiple of ranks ({p})"
                ))
            }
            ScheduleKind::Zbv | ScheduleKind::DualPipeV if v != 2 => {
                err(format!("needs exactly 2 stages per rank, got v = {v}"))
            }
            ScheduleKind::DualPipeV if m < stages => err(format!(
                "needs at least as many microbatches as stages: {m} microbatches, {stages} stages"
            )),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// Accepts the names of [`ScheduleKind::name`], case-insensitively, with hyphens or
    /// underscores (`interleaved-1f1b` is `interleaved_1f1b`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let want = s.trim().to_ascii_lowercase().replace('-', "_");
        ScheduleKind::all()
            .into_iter()
            .find(|k| k.name() == want)
            .ok_or_else(|| {
                let known: Vec<&str> = ScheduleKind::all().iter().map(|k| k.name()).collect();
                ScheduleError::parse(s, format!("unknown schedule; known: {}", known.join(", ")))
            })
    }
}

/// Generates `kind` for `p` ranks, `v` stages per rank and `m` microbatches: compute actions
/// only (F and B, or F, I and W for the zero-bubble schedules), chain edges, the kind's
/// placement. Lower it with [`super::lower()`] before running it.
pub fn generate(
    kind: ScheduleKind,
    p: usize,
    v: usize,
    m: usize,
) -> Result<Schedule, ScheduleError> {
    kind.check(p, v, m)?;
    let actions = match kind {
        ScheduleKind::GPipe => loop_orders::gpipe(p, m),
        ScheduleKind::OneFOneB => loop_orders::one_f_one_b(p, m),
        ScheduleKind::LoopedBfs => loop_orders::looped_bfs(p, v, m),
        ScheduleKind::Interleaved1F1B => loop_orders::interleaved(p, v, m, false),
        ScheduleKind::InterleavedZeroBubble => loop_orders::interleaved(p, v, m, true),
        ScheduleKind::Zbv => v_orders::zbv(p, m),
        ScheduleKind::DualPipeV => v_orders::dualpipev(p, m),
    };
    Ok(Schedule::new(
        kind.name(),
        p,
        m,
        kind.placement().stage_ranks(p, v),
        actions,
    ))
}

#[cfg(test)]
mod tests {
    use super::super::ir::ActionKind;
    use super::super::{lower, simulate, validate, Costs};
    use super::*;

    /// Every kind over a grid of valid (p, v, m): validates unlowered and lowered and
    /// simulates without deadlock, lowered and not, with the same timings.
    #[test]
    fn every_schedule_validates_and_simulates_over_a_grid() {
        let mut checked = 0;
        for kind in ScheduleKind::all() {
            for p in [1, 2, 3, 4, 8] {
                for v in [1, 2, 3, 4] {
                    for m in [1, 2, 3, 4, 5, 6, 8, 12, 16, 32] {
                        if kind.check(p, v, m).is_err() {
                            continue;
                        }
                        let s = generate(kind, p, v, m).unwrap();
                        let tag = format!("{kind} p={p} v={v} m={m}");
                        assert_eq!(s.stages(), p * v, "{tag}");
                        assert!(!s.is_lowered(), "{tag}");
                        validate(&s).unwrap_or_else(|e| panic!("{tag}: {e}\n{s}"));
                        let l = lower(&s);
                        validate(&l).unwrap_or_else(|e| panic!("{tag} lowered: {e}\n{l}"));
                        let a =
                            simulate(&s, Costs::default()).unwrap_or_else(|e| panic!("{tag}: {e}"));
                        let b = simulate(&l, Costs::default())
                            .unwrap_or_else(|e| panic!("{tag} lowered: {e}"));
                        assert_eq!(a.timeline, b.timeline, "{tag}");
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 150, "{checked}");
    }

    #[test]
    fn invalid_combinations_name_the_rule() {
        for (kind, p, v, m, want) in [
            (
                ScheduleKind::Interleaved1F1B,
                4,
                2,
                6,
                "interleaved_1f1b needs microbatches (6) to be a multiple of ranks (4)",
            ),
            (
                ScheduleKind::InterleavedZeroBubble,
                4,
                2,
                2,
                "interleaved_zb needs microbatches (2) to be a multiple of ranks (4)",
            ),
            (
                ScheduleKind::OneFOneB,
                4,
                1,
                3,
                "1f1b needs at least as many microbatches as stages: 3 microbatches, 4 stages",
            ),
            (
                ScheduleKind::Zbv,
                2,
                3,
                4,
                "zbv needs exactly 2 stages per rank, got v = 3",
            ),
            (
                ScheduleKind::DualPipeV,
                2,
                1,
                4,
                "dualpipev needs exactly 2 stages per rank, got v = 1",
            ),
            (
                ScheduleKind::DualPipeV,
                4,
                2,
                6,
                "dualpipev needs at least as many microbatches as stages: 6 microbatches, 8 stages",
            ),
            (
                ScheduleKind::GPipe,
                2,
                2,
                4,
                "gpipe runs one stage per rank (v = 1), got v = 2",
            ),
            (
                ScheduleKind::OneFOneB,
                2,
                3,
                4,
                "1f1b runs one stage per rank (v = 1), got v = 3",
            ),
            (
                ScheduleKind::LoopedBfs,
                0,
                2,
                4,
                "looped_bfs needs at least one rank",
            ),
            (
                ScheduleKind::GPipe,
                2,
                1,
                0,
                "gpipe needs at least one microbatch",
            ),
            (
                ScheduleKind::LoopedBfs,
                2,
                0,
                4,
                "looped_bfs needs at least one stage per rank",
            ),
        ] {
            let e = generate(kind, p, v, m).unwrap_err();
            assert!(matches!(e, ScheduleError::InvalidConfig { .. }), "{e:?}");
            assert!(e.to_string().starts_with(want), "{e}");
        }
    }

    #[test]
    fn names_parse_back_and_unknown_names_list_the_known_ones() {
        for kind in ScheduleKind::all() {
            assert_eq!(kind.name().parse::<ScheduleKind>().unwrap(), kind);
            assert_eq!(
                kind.to_string()
                    .to_uppercase()
                    .parse::<ScheduleKind>()
                    .unwrap(),
                kind
            );
            let json = serde_json::to_string(&kind).unwrap();
            assert_eq!(json, format!("\"{}\"", kind.name()));
            assert_eq!(serde_json::from_str::<ScheduleKind>(&json).unwrap(), kind);
        }
        let e = "zb-h2".parse::<ScheduleKind>().unwrap_err().to_string();
        assert!(e.contains("`zb-h2`"), "{e}");
        for kind in ScheduleKind::all() {
            assert!(e.contains(kind.name()), "{e}");
        }
    }

    #[test]
    fn placements_and_defaults() {
        assert_eq!(ScheduleKind::Zbv.placement(), StageLayout::V);
        assert_eq!(ScheduleKind::DualPipeV.placement(), StageLayout::V);
        assert_eq!(ScheduleKind::Interleaved1F1B.placement(), StageLayout::Loop);
        for kind in ScheduleKind::all() {
            let v = kind.default_virtual();
            let single = matches!(kind, ScheduleKind::GPipe | ScheduleKind::OneFOneB);
            assert_eq!(v, if single { 1 } else { 2 });
            let s = generate(kind, 2, v, 4).unwrap();
            assert_eq!(s.stage_ranks, kind.placement().stage_ranks(2, v));
            let split = s
                .actions
                .iter()
                .flatten()
                .any(|a| a.kind == ActionKind::BackwardInput);
            assert_eq!(split, kind.splits_backward(), "{kind}");
        }
    }

    fn compute(s: &Schedule, r: usize) -> Vec<String> {
        s.actions[r].iter().map(|a| a.to_string()).collect()
    }

    #[test]
    fn single_stage_orders_match_the_papers() {
        let g = generate(ScheduleKind::GPipe, 2, 1, 3).unwrap();
        assert_eq!(compute(&g, 1), ["1F0", "1F1", "1F2", "1B0", "1B1", "1B2"]);
        let s = generate(ScheduleKind::OneFOneB, 4, 1, 6).unwrap();
        // Rank r warms up with p-1-r forwards, then alternates F and B.
        assert_eq!(
            compute(&s, 1),
            ["1F0", "1F1", "1F2", "1B0", "1F3", "1B1", "1F4", "1B2", "1F5", "1B3", "1B4", "1B5"]
        );
        assert_eq!(compute(&s, 3)[..4], ["3F0", "3B0", "3F1", "3B1"]);
        let b = generate(ScheduleKind::LoopedBfs, 2, 2, 2).unwrap();
        assert_eq!(
            compute(&b, 0),
            ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"]
        );
    }

    #[test]
    fn interleaved_orders_follow_megatron() {
        // p = 2, v = 2, m = 4: rank 0 warms up (v-1)p + 2(p-1-r) = 4 forwards, looping over
        // its stages every p microbatches.
        let s = generate(ScheduleKind::Interleaved1F1B, 2, 2, 4).unwrap();
        assert_eq!(
            compute(&s, 0),
            [
                "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1", "2F2", "0B0", "2F3", "0B1",
                "2B2", "2B3", "0B2", "0B3"
            ]
        );
        let z = generate(ScheduleKind::InterleavedZeroBubble, 2, 2, 4).unwrap();
        let r1 = compute(&z, 1);
        assert_eq!(r1[..4], ["1F0", "1F1", "3F0", "3I0"]);
        assert!(r1.contains(&"3W0".to_owned()));
    }

    #[test]
    fn v_orders_put_both_ends_on_rank_zero() {
        let z = generate(ScheduleKind::Zbv, 2, 2, 4).unwrap();
        assert_eq!(z.stage_ranks, vec![0, 1, 1, 0]);
        // Rank 0 warms up with 2p-1 forwards of its first stage, then runs the loss stage.
        assert_eq!(
            compute(&z, 0)[..6],
            ["0F0", "0F1", "0F2", "3F0", "3I0", "3W0"]
        );
        let d = generate(ScheduleKind::DualPipeV, 2, 2, 4).unwrap();
        assert_eq!(compute(&d, 0)[..4], ["0F0", "0F1", "0F2", "3F0"]);
    }
}
