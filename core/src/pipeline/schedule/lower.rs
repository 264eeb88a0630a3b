//! Lowering: inserting the point-to-point communication a compute-only schedule implies,
//! from its edges and placement.
//!
//! Semantics (shared with the validator, the simulator and the executor): `SEND_F(s,i)` sends
//! one message on every cross-rank edge `(s,t)`; `RECV_F(t,i)` takes one from every
//! cross-rank edge `(s,t)`; `SEND_B(t,i)` and `RECV_B(s,i)` do the same for gradients in the
//! other direction. Each (edge, direction) is its own FIFO channel. Edges within a rank need
//! no message: the consumer reads the producer's result directly.

use super::ir::{Action, ActionKind, Schedule};

/// Inserts sends and receives: `SEND_F(s,i)` right after `F(s,i)` when a consumer of `s` is
/// on another rank; `RECV_F(t,i)` right before `F(t,i)` when a producer of `t` is; `SEND_B(t,i)`
/// right after the B or I of `t` when a producer of `t` is remote; `RECV_B(s,i)` right before
/// the B or I of `s` when a consumer of `s` is remote. Sends go as soon as the data exists and
/// receives wait as late as possible, so the lowered schedule keeps the compute order's
/// timing. A schedule that already holds sends or receives is taken as lowered and returned
/// unchanged (so lowering is idempotent and a hand-placed CSV keeps its placement).
pub fn lower(schedule: &Schedule) -> Schedule {
    if schedule.is_lowered() {
        return schedule.clone();
    }
    let stages = schedule.stages();
    let remote_in: Vec<bool> = (0..stages)
        .map(|s| !schedule.remote_producers(s).is_empty())
        .collect();
    let remote_out: Vec<bool> = (0..stages)
        .map(|s| !schedule.remote_consumers(s).is_empty())
        .collect();
    let has = |flags: &[bool], s: usize| flags.get(s).copied().unwrap_or(false);
    let mut out = schedule.clone();
    for (list, lowered) in schedule.actions.iter().zip(out.actions.iter_mut()) {
        lowered.clear();
        for &a in list {
            let s = a.stage;
            let with = |kind| Action::new(s, kind, a.microbatch);
            match a.kind {
                ActionKind::Forward => {
                    if has(&remote_in, s) {
                        lowered.push(with(ActionKind::RecvF));
                    }
                    lowered.push(a);
                    if has(&remote_out, s) {
                        lowered.push(with(ActionKind::SendF));
                    }
                }
                ActionKind::FullBackward | ActionKind::BackwardInput => {
                    if has(&remote_out, s) {
                        lowered.push(with(ActionKind::RecvB));
                    }
                    lowered.push(a);
                    if has(&remote_in, s) {
                        lowered.push(with(ActionKind::SendB));
                    }
                }
                _ => lowered.push(a),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::{generate, simulate, validate, Costs, ScheduleKind};
    use super::*;

    fn labels(list: &[Action]) -> Vec<String> {
        list.iter().map(Action::to_string).collect()
    }

    #[test]
    fn one_f_one_b_gets_sends_after_and_receives_before() {
        let s = generate(ScheduleKind::OneFOneB, 2, 1, 2).unwrap();
        let l = lower(&s);
        assert_eq!(
            labels(&l.actions[0]),
            ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
        );
        assert_eq!(
            labels(&l.actions[1]),
            ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
        );
        assert_eq!(lower(&l), l, "lowering is idempotent");
        assert_eq!(l.compute_only(), s);
    }

    #[test]
    fn the_turn_of_a_v_needs_no_message() {
        let s = generate(ScheduleKind::Zbv, 2, 2, 3).unwrap();
        let l = lower(&s);
        // Stages 1 and 2 both live on rank 1: no SEND_F from 1, no RECV_F into 2.
        let r1 = labels(&l.actions[1]);
        assert!(!r1
            .iter()
            .any(|a| a.starts_with("1SEND_F") || a.starts_with("2RECV_F")));
        assert!(r1.iter().any(|a| a.starts_with("2SEND_F")));
        // I produces the input gradient: SEND_B follows it, W sends nothing.
        let i = r1.iter().position(|a| a == "1I0").unwrap();
        assert_eq!(r1[i + 1], "1SEND_B0");
        validate(&l).unwrap();
    }

    #[test]
    fn a_skip_edge_lowers_and_simulates() {
        // Three stages on three ranks, stage 0 also feeding stage 2 directly.
        let mut s = generate(ScheduleKind::OneFOneB, 3, 1, 4).unwrap();
        s.edges.push((0, 2));
        let l = lower(&s);
        validate(&l).unwrap();
        let sim = simulate(&l, Costs::default()).unwrap();
        // Stage 2 receives from both producers in one RECV_F; stage 0 sends once per
        // microbatch on both of its cross-rank edges and waits for both gradients.
        assert!(labels(&l.actions[2]).starts_with(&["2RECV_F0".into(), "2F0".into()]));
        assert_eq!(
            sim.makespan,
            simulate(&s, Costs::default()).unwrap().makespan
        );

        // On a V the skip edge can cross ranks even where the chain does not.
        let mut v = generate(ScheduleKind::Zbv, 2, 2, 4).unwrap();
        v.edges.push((1, 3));
        let lv = lower(&v);
        validate(&lv).unwrap();
        simulate(&lv, Costs::default()).unwrap();
        assert!(labels(&lv.actions[1]).contains(&"1SEND_F0".to_owned()));
        assert!(labels(&lv.actions[0]).contains(&"3SEND_B0".to_owned()));
    }

    /// Skip edges add no ordering a built-in schedule lacks (the chain already orders every
    /// F after its producers' and every B/I before theirs), so even the densest DAG — every
    /// stage feeding every later one — keeps each schedule valid and deadlock free, with the
    /// same timing as the chain.
    #[test]
    fn skip_edges_keep_every_builtin_schedule_valid() {
        for kind in ScheduleKind::all() {
            for (p, m) in [(2, 4), (3, 6), (4, 8)] {
                let chain = generate(kind, p, kind.default_virtual(), m).unwrap();
                let n = chain.stages();
                let mut dense = chain.clone();
                dense.edges = (0..n)
                    .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
                    .collect();
                let l = lower(&dense);
                validate(&l).unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"));
                let x = simulate(&l, Costs::default()).unwrap();
                let y = simulate(&lower(&chain), Costs::default()).unwrap();
                assert_eq!(x.timeline, y.timeline, "{kind} p={p} m={m}");
            }
        }
    }

    #[test]
    fn fsdp_actions_pass_through() {
        let mut s = generate(ScheduleKind::GPipe, 2, 1, 1).unwrap();
        s.actions[0].insert(0, Action::new(0, ActionKind::Unshard, None));
        s.actions[0].push(Action::new(0, ActionKind::ReduceGrad, None));
        let l = lower(&s);
        assert_eq!(
            labels(&l.actions[0]),
            [
                "0UNSHARD",
                "0F0",
                "0SEND_F0",
                "0RECV_B0",
                "0B0",
                "0REDUCE_GRAD"
            ]
        );
        validate(&l).unwrap();
    }
}
