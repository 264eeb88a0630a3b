//! The validator: the rules a schedule must keep for the executor to run it, checked before
//! any rank starts. Errors name the rank, the action (PyTorch notation) and the rule.
//!
//! Rules: every action's stage lives on the rank that lists it; every (stage, microbatch) has
//! exactly one F and exactly one of {B} or {I and W}; F before its B/I, I before its W; each
//! stage runs F, B/I and W in increasing microbatch order; a stage's F comes after the F of
//! its producers on the same rank (and its B/I before theirs). A lowered schedule must also
//! have every send and receive its edges need, and no other; sends after the compute that
//! produces them, receives before the compute that uses them; and on every channel the
//! receiver takes the microbatches in the order the sender sends them.

use super::error::ScheduleError;
use super::ir::{Action, ActionKind, Schedule};
use std::collections::{HashMap, HashSet};

use ActionKind::{
    BackwardInput as I, BackwardWeight as W, Forward as F, FullBackward as B, RecvB, RecvF, SendB,
    SendF,
};

/// Checks every rule; `Ok` means the executor can run the schedule (a lowered one) without
/// an action lacking its inputs. Deadlock freedom is the simulator's job ([`super::simulate()`]).
pub fn validate(schedule: &Schedule) -> Result<(), ScheduleError> {
    check_structure(schedule)?;
    let at = Positions::new(schedule)?;
    check_compute(schedule, &at)?;
    check_local_dataflow(schedule, &at)?;
    if schedule.is_lowered() {
        check_comm(schedule, &at)?;
    }
    Ok(())
}

fn invalid(message: String) -> ScheduleError {
    ScheduleError::Invalid(message)
}

/// The shape rules the simulator needs too: counts agree, edges are forward, chain edges
/// are present, and every action names an existing stage held by its rank and a valid
/// microbatch (or none, for UNSHARD/RESHARD/REDUCE_GRAD).
pub(super) fn check_structure(s: &Schedule) -> Result<(), ScheduleError> {
    let stages = s.stages();
    if s.ranks == 0 {
        return Err(invalid("the schedule has no ranks".into()));
    }
    if s.actions.len() != s.ranks {
        return Err(invalid(format!(
            "the schedule declares {} ranks but lists actions for {}",
            s.ranks,
            s.actions.len()
        )));
    }
    if stages == 0 {
        return Err(invalid("the schedule has no stages".into()));
    }
    if s.microbatches == 0 {
        return Err(invalid("the schedule has no microbatches".into()));
    }
    if let Some((st, r)) = s
        .stage_ranks
        .iter()
        .enumerate()
        .find(|(_, &r)| r >= s.ranks)
    {
        return Err(invalid(format!(
            "stage {st} is placed on rank {r}, but the schedule has {} ranks",
            s.ranks
        )));
    }
    let mut seen = HashSet::new();
    for &(a, b) in &s.edges {
        if a >= stages || b >= stages {
            return Err(invalid(format!(
                "edge ({a}, {b}) names a stage beyond the last (the schedule has {stages} stages)"
            )));
        }
        if a >= b {
            return Err(invalid(format!(
                "edge ({a}, {b}) does not go forward: a producer comes before its consumer"
            )));
        }
        if !seen.insert((a, b)) {
            return Err(invalid(format!("edge ({a}, {b}) is listed twice")));
        }
    }
    if let Some(t) = (1..stages).find(|&t| !seen.contains(&(t - 1, t))) {
        return Err(invalid(format!(
            "the edges lack the chain edge ({}, {t}): every stage feeds the next",
            t - 1
        )));
    }
    for (r, list) in s.actions.iter().enumerate() {
        for a in list {
            let Some(owner) = s.rank_of(a.stage) else {
                return Err(invalid(format!(
                    "rank {r}: {a} names stage {}, but the schedule has {stages} stages",
                    a.stage
                )));
            };
            if owner != r {
                return Err(invalid(format!(
                    "rank {r}: {a} runs stage {}, which lives on rank {owner}",
                    a.stage
                )));
            }
            match (a.kind.has_microbatch(), a.microbatch) {
                (true, None) => {
                    return Err(invalid(format!("rank {r}: {a} has no microbatch index")))
                }
                (false, Some(_)) => {
                    return Err(invalid(format!("rank {r}: {a} takes no microbatch index")))
                }
                (true, Some(mb)) if mb >= s.microbatches => {
                    return Err(invalid(format!(
                        "rank {r}: {a} names microbatch {mb}, but the schedule has {} \
                         microbatches",
                        s.microbatches
                    )))
                }
                _ => {}
            }
        }
    }
    Ok(())
}

/// Where each action with a microbatch sits in its rank's list (each at most once).
struct Positions(HashMap<Action, usize>);

impl Positions {
    fn new(s: &Schedule) -> Result<Positions, ScheduleError> {
        let mut map = HashMap::new();
        for (r, list) in s.actions.iter().enumerate() {
            for (k, &a) in list.iter().enumerate() {
                if a.microbatch.is_none() {
                    continue;
                }
                if let Some(first) = map.insert(a, k) {
                    return Err(invalid(format!(
                        "rank {r}: {a} runs twice (positions {first} and {k})"
                    )));
                }
            }
        }
        Ok(Positions(map))
    }

    fn get(&self, stage: usize, kind: ActionKind, mb: usize) -> Option<usize> {
        self.0.get(&Action::mb(stage, kind, mb)).copied()
    }

    /// The B or I of `(stage, mb)`, with its position.
    fn backward(&self, stage: usize, mb: usize) -> Option<(Action, usize)> {
        [B, I].into_iter().find_map(|k| {
            self.get(stage, k, mb)
                .map(|p| (Action::mb(stage, k, mb), p))
        })
    }
}

fn check_compute(s: &Schedule, at: &Positions) -> Result<(), ScheduleError> {
    for stage in 0..s.stages() {
        let r = s.stage_ranks[stage];
        for mb in 0..s.microbatches {
            let a = |k| Action::mb(stage, k, mb);
            let Some(f) = at.get(stage, F, mb) else {
                return Err(invalid(format!(
                    "stage {stage} never runs F for microbatch {mb}"
                )));
            };
            let (b, i, w) = (
                at.get(stage, B, mb),
                at.get(stage, I, mb),
                at.get(stage, W, mb),
            );
            if b.is_some() && i.is_some() {
                return Err(invalid(format!(
                    "rank {r}: stage {stage} runs both {} and {} for microbatch {mb}: a backward \
                     is B, or I and W",
                    a(B),
                    a(I)
                )));
            }
            let Some((back, bp)) = at.backward(stage, mb) else {
                return Err(invalid(format!(
                    "stage {stage} never runs a backward (B or I) for microbatch {mb}"
                )));
            };
            if bp < f {
                return Err(invalid(format!("rank {r}: {back} comes before {}", a(F))));
            }
            match (i, w) {
                (Some(_), None) => {
                    return Err(invalid(format!(
                        "rank {r}: {} has no {}: I leaves the weight gradient to W",
                        a(I),
                        a(W)
                    )))
                }
                (None, Some(_)) => {
                    return Err(invalid(format!(
                        "rank {r}: {} has no {}: W needs the I of its microbatch (B already \
                         computes the weight gradient)",
                        a(W),
                        a(I)
                    )))
                }
                (Some(ip), Some(wp)) if wp < ip => {
                    return Err(invalid(format!("rank {r}: {} comes before {}", a(W), a(I))))
                }
                _ => {}
            }
        }
    }
    // Microbatch order per stage: F, B/I together, W.
    for (r, list) in s.actions.iter().enumerate() {
        let mut last: HashMap<(usize, u8), Action> = HashMap::new();
        for &a in list {
            let class = match a.kind {
                F => 0,
                B | I => 1,
                W => 2,
                _ => continue,
            };
            if let Some(prev) = last.insert((a.stage, class), a) {
                if prev.microbatch > a.microbatch {
                    return Err(invalid(format!(
                        "rank {r}: {prev} comes before {a}: stage {} must run {} in increasing \
                         microbatch order",
                        a.stage,
                        ["F", "B/I", "W"][class as usize]
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Edges within a rank pass data directly, so the list itself must order them.
fn check_local_dataflow(s: &Schedule, at: &Positions) -> Result<(), ScheduleError> {
    for &(p, c) in &s.edges {
        if s.is_remote(p, c) {
            continue;
        }
        let r = s.stage_ranks[p];
        for mb in 0..s.microbatches {
            if let (Some(fp), Some(fc)) = (at.get(p, F, mb), at.get(c, F, mb)) {
                if fc < fp {
                    return Err(invalid(format!(
                        "rank {r}: {} comes before {}, which feeds it",
                        Action::mb(c, F, mb),
                        Action::mb(p, F, mb)
                    )));
                }
            }
            if let (Some((bp_a, bp)), Some((bc_a, bc))) = (at.backward(p, mb), at.backward(c, mb)) {
                if bp < bc {
                    return Err(invalid(format!(
                        "rank {r}: {bp_a} comes before {bc_a}, which gives it its output gradient"
                    )));
                }
            }
        }
    }
    Ok(())
}

fn check_comm(s: &Schedule, at: &Positions) -> Result<(), ScheduleError> {
    let stages = s.stages();
    // No send or receive without a cross-rank edge to carry it.
    for (r, list) in s.actions.iter().enumerate() {
        for a in list {
            let why = match a.kind {
                SendF | RecvB if s.remote_consumers(a.stage).is_empty() => {
                    "no consumer of the stage is on another rank"
                }
                RecvF | SendB if s.remote_producers(a.stage).is_empty() => {
                    "no producer of the stage is on another rank"
                }
                _ => continue,
            };
            return Err(invalid(format!("rank {r}: {a} has no channel: {why}")));
        }
    }
    // Every cross-rank edge carries each microbatch once in each direction, sends after the
    // compute that produces them, receives before the compute that uses them.
    for &(p, c) in &s.edges {
        if !s.is_remote(p, c) {
            continue;
        }
        for mb in 0..s.microbatches {
            pair(s, at, (p, SendF), (c, RecvF), mb)?;
            pair(s, at, (c, SendB), (p, RecvB), mb)?;
        }
    }
    for stage in 0..stages {
        let r = s.stage_ranks[stage];
        for mb in 0..s.microbatches {
            let a = |k| Action::mb(stage, k, mb);
            let f = at.get(stage, F, mb);
            let back = at.backward(stage, mb);
            if let (Some(sp), Some(fp)) = (at.get(stage, SendF, mb), f) {
                if sp < fp {
                    return Err(invalid(format!(
                        "rank {r}: {} comes before {}, which produces it",
                        a(SendF),
                        a(F)
                    )));
                }
            }
            if let (Some(rp), Some(fp)) = (at.get(stage, RecvF, mb), f) {
                if fp < rp {
                    return Err(invalid(format!(
                        "rank {r}: {} comes before {}, which brings its input",
                        a(F),
                        a(RecvF)
                    )));
                }
            }
            if let (Some(sp), Some((ba, bp))) = (at.get(stage, SendB, mb), back) {
                if sp < bp {
                    return Err(invalid(format!(
                        "rank {r}: {} comes before {ba}, which produces it",
                        a(SendB)
                    )));
                }
            }
            if let (Some(rp), Some((ba, bp))) = (at.get(stage, RecvB, mb), back) {
                if bp < rp {
                    return Err(invalid(format!(
                        "rank {r}: {ba} comes before {}, which brings its output gradient",
                        a(RecvB)
                    )));
                }
            }
        }
    }
    // FIFO: on each channel the receiver takes microbatches in the order they are sent.
    for &(p, c) in &s.edges {
        if !s.is_remote(p, c) {
            continue;
        }
        fifo(s, (p, SendF), (c, RecvF), "forward", (p, c))?;
        fifo(s, (c, SendB), (p, RecvB), "backward", (c, p))?;
    }
    Ok(())
}

/// The send and receive of one message: both present, or an error naming the one that is.
fn pair(
    s: &Schedule,
    at: &Positions,
    (from, send): (usize, ActionKind),
    (to, recv): (usize, ActionKind),
    mb: usize,
) -> Result<(), ScheduleError> {
    let (sa, ra) = (Action::mb(from, send, mb), Action::mb(to, recv, mb));
    let (rs, rr) = (s.stage_ranks[from], s.stage_ranks[to]);
    match (at.get(from, send, mb), at.get(to, recv, mb)) {
        (Some(_), Some(_)) => Ok(()),
        (Some(_), None) => Err(invalid(format!(
            "rank {rs}: {sa} has no matching {ra} on rank {rr}"
        ))),
        (None, Some(_)) => Err(invalid(format!(
            "rank {rr}: {ra} has no matching {sa} on rank {rs}"
        ))),
        (None, None) => Err(invalid(format!(
            "stage {from} never sends microbatch {mb} to stage {to}: rank {rs} lacks {sa} and \
             rank {rr} lacks {ra}"
        ))),
    }
}

/// The microbatch order of the sends `from` makes and the receives `to` makes must agree.
fn fifo(
    s: &Schedule,
    (from, send): (usize, ActionKind),
    (to, recv): (usize, ActionKind),
    direction: &str,
    (a, b): (usize, usize),
) -> Result<(), ScheduleError> {
    let (rs, rr) = (s.stage_ranks[from], s.stage_ranks[to]);
    let order = |r: usize, stage: usize, kind: ActionKind| -> Vec<Action> {
        s.actions[r]
            .iter()
            .filter(|x| x.stage == stage && x.kind == kind)
            .copied()
            .collect()
    };
    let (sent, got) = (order(rs, from, send), order(rr, to, recv));
    for (k, (x, y)) in sent.iter().zip(&got).enumerate() {
        if x.microbatch != y.microbatch {
            return Err(invalid(format!(
                "the {direction} channel {a}→{b} delivers in send order: rank {rs}'s message \
                 #{k} is {x}, but rank {rr}'s receive #{k} is {y}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{generate, lower, ScheduleKind};
    use super::*;

    fn one_f_one_b() -> Schedule {
        generate(ScheduleKind::OneFOneB, 2, 1, 4).unwrap()
    }

    fn err(s: &Schedule) -> String {
        validate(s).unwrap_err().to_string()
    }

    fn position(s: &Schedule, r: usize, label: &str) -> usize {
        s.actions[r]
            .iter()
            .position(|a| a.to_string() == label)
            .unwrap()
    }

    #[test]
    fn rejects_a_backward_before_its_forward() {
        let mut s = one_f_one_b();
        let (f, b) = (position(&s, 1, "1F0"), position(&s, 1, "1B0"));
        s.actions[1].swap(f, b);
        assert!(
            err(&s).contains("rank 1: 1B0 comes before 1F0"),
            "{}",
            err(&s)
        );
    }

    #[test]
    fn rejects_a_missing_microbatch() {
        let mut s = one_f_one_b();
        s.actions[1].retain(|a| a.to_string() != "1F3");
        assert!(
            err(&s).contains("stage 1 never runs F for microbatch 3"),
            "{}",
            err(&s)
        );
        let mut s = one_f_one_b();
        s.actions[0].retain(|a| a.to_string() != "0B2");
        assert!(err(&s).contains("stage 0 never runs a backward (B or I) for microbatch 2"));
    }

    #[test]
    fn rejects_an_unmatched_send() {
        let mut l = lower(&one_f_one_b());
        l.actions[0].retain(|a| a.to_string() != "0RECV_B1");
        assert!(
            err(&l).contains("rank 1: 1SEND_B1 has no matching 0RECV_B1 on rank 0"),
            "{}",
            err(&l)
        );
        let mut l = lower(&one_f_one_b());
        l.actions[0].retain(|a| a.to_string() != "0SEND_F2");
        assert!(err(&l).contains("rank 1: 1RECV_F2 has no matching 0SEND_F2 on rank 0"));
    }

    #[test]
    fn rejects_misplaced_and_duplicate_actions() {
        let mut s = one_f_one_b();
        s.actions[0].push(Action::mb(1, W, 0));
        assert!(err(&s).contains("rank 0: 1W0 runs stage 1, which lives on rank 1"));
        let mut s = one_f_one_b();
        s.actions[0].push(Action::mb(0, F, 1));
        assert!(err(&s).contains("rank 0: 0F1 runs twice"), "{}", err(&s));
        let mut s = one_f_one_b();
        s.actions[0].push(Action::mb(0, F, 9));
        assert!(err(&s).contains("rank 0: 0F9 names microbatch 9, but the schedule has 4"));
        let mut s = one_f_one_b();
        s.actions[0].push(Action::mb(7, F, 0));
        assert!(err(&s).contains("rank 0: 7F0 names stage 7"));
    }

    #[test]
    fn rejects_out_of_order_microbatches() {
        let mut s = generate(ScheduleKind::GPipe, 2, 1, 3).unwrap();
        s.actions[0].swap(0, 1);
        assert!(
            err(&s).contains("rank 0: 0F1 comes before 0F0: stage 0 must run F in increasing"),
            "{}",
            err(&s)
        );
    }

    #[test]
    fn rejects_split_backward_mistakes() {
        let z = generate(ScheduleKind::Zbv, 2, 2, 4).unwrap();
        let mut s = z.clone();
        s.actions[0].retain(|a| a.to_string() != "3W1");
        assert!(err(&s).contains("rank 0: 3I1 has no 3W1"), "{}", err(&s));
        let mut s = z.clone();
        let (i, w) = (position(&s, 0, "3I0"), position(&s, 0, "3W0"));
        s.actions[0].swap(i, w);
        assert!(
            err(&s).contains("rank 0: 3W0 comes before 3I0"),
            "{}",
            err(&s)
        );
        let mut s = one_f_one_b();
        s.actions[0].push(Action::mb(0, W, 0));
        assert!(err(&s).contains("rank 0: 0W0 has no 0I0"), "{}", err(&s));
    }

    #[test]
    fn rejects_local_dataflow_out_of_order() {
        // Stages 1 and 2 share rank 1 in a V: 2F0 must follow 1F0 in rank 1's list.
        let mut s = generate(ScheduleKind::Zbv, 2, 2, 3).unwrap();
        let (a, b) = (position(&s, 1, "1F0"), position(&s, 1, "2F0"));
        s.actions[1].swap(a, b);
        assert!(
            err(&s).contains("rank 1: 2F0 comes before 1F0, which feeds it"),
            "{}",
            err(&s)
        );
    }

    #[test]
    fn rejects_bad_edges_and_misplaced_comm() {
        let mut s = one_f_one_b();
        s.edges = vec![];
        assert!(err(&s).contains("lack the chain edge (0, 1)"));
        s.edges = vec![(0, 1), (1, 0)];
        assert!(err(&s).contains("edge (1, 0) does not go forward"));
        let mut l = lower(&one_f_one_b());
        let (f, send) = (position(&l, 0, "0F1"), position(&l, 0, "0SEND_F1"));
        l.actions[0].swap(f, send);
        assert!(err(&l).contains("rank 0: 0SEND_F1 comes before 0F1, which produces it"));
        let mut l = lower(&one_f_one_b());
        l.actions[1].push(Action::mb(1, SendF, 0));
        assert!(
            err(&l).contains("rank 1: 1SEND_F0 has no channel"),
            "{}",
            err(&l)
        );
        let mut l = lower(&one_f_one_b());
        let (a, b) = (position(&l, 1, "1RECV_F1"), position(&l, 1, "1RECV_F2"));
        l.actions[1].swap(a, b);
        let e = err(&l);
        assert!(
            e.contains("rank 1: 1F1 comes before 1RECV_F1") || e.contains("channel"),
            "{e}"
        );
    }
}
