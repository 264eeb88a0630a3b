//! The simulator: runs a schedule on idealised ranks to prove it cannot deadlock and to
//! measure its bubble exactly, before any real rank starts.
//!
//! Each rank runs its list strictly in order; an action starts when its rank is free and its
//! dependencies are met, and takes its [`Costs`] (communication takes no time). Unlowered,
//! `F(t,i)` waits for `F(s,i)` of every producer `s`; `B/I(s,i)` for `F(s,i)` and the B/I of
//! every consumer; `W` for its I. Lowered, dependencies across ranks go only through
//! messages: a receive waits for the matching send on every cross-rank edge (FIFO per edge
//! and direction), while dependencies within a rank stay direct. Times are integers, so the
//! bubble is an exact rational.

use super::error::{ScheduleError, Wait};
use super::ir::{Action, ActionKind, Schedule};
use super::validate::check_structure;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use ActionKind::{
    BackwardInput as I, BackwardWeight as W, Forward as F, FullBackward as B, RecvB, RecvF, SendB,
    SendF,
};

/// Time units per compute action; a full backward B costs `backward_input +
/// backward_weight`. The default (1, 1, 1) makes B = 2F, the usual assumption under which
/// GPipe and 1F1B have bubble (p-1)/(m+p-1) and zero bubble schedules can hide theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Costs {
    /// F.
    pub forward: u64,
    /// I (and the input half of B).
    pub backward_input: u64,
    /// W (and the weight half of B).
    pub backward_weight: u64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            forward: 1,
            backward_input: 1,
            backward_weight: 1,
        }
    }
}

impl Costs {
    /// How long `kind` takes: its cost for compute, 0 for everything else.
    pub fn of(&self, kind: ActionKind) -> u64 {
        match kind {
            F => self.forward,
            B => self.backward_input + self.backward_weight,
            I => self.backward_input,
            W => self.backward_weight,
            _ => 0,
        }
    }
}

/// One compute action as simulated: it runs over `[start, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The compute action.
    pub action: Action,
    /// When it starts.
    pub start: u64,
    /// When it ends (`start` + its cost).
    pub end: u64,
}

/// The simulated run of a schedule: when every compute action ran, and the bubble.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Simulation {
    /// The schedule's name.
    pub schedule: String,
    /// Pipeline ranks.
    pub ranks: usize,
    /// The costs simulated with.
    pub costs: Costs,
    /// Per rank, its compute actions in order with their times.
    pub timeline: Vec<Vec<Span>>,
    /// When the last action ends.
    pub makespan: u64,
    /// Per rank, time spent computing.
    pub busy: Vec<u64>,
    /// Total idle time over all ranks: `ranks × makespan − Σ busy`.
    pub idle: u64,
    /// The bubble `idle / (ranks × makespan)` in lowest terms: its numerator…
    pub bubble_numerator: u64,
    /// …and its denominator (1 for an empty schedule).
    pub bubble_denominator: u64,
    /// The same fraction as a float, for reports.
    pub bubble_fraction: f64,
}

impl Simulation {
    /// Whether the bubble equals `num / den` exactly.
    pub fn bubble_is(&self, num: u64, den: u64) -> bool {
        u128::from(self.bubble_numerator) * u128::from(den)
            == u128::from(num) * u128::from(self.bubble_denominator)
    }
}

/// The direction of a channel: activations go forward, gradients backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Dir {
    Forward,
    Backward,
}

/// A cross-rank edge's channel: `(producer, consumer, direction)`.
type Channel = (usize, usize, Dir);

/// A message in flight: the send that made it and when.
#[derive(Clone, Copy, Debug)]
struct Message {
    sent: Action,
    at: u64,
}

/// Why an action cannot start yet.
enum Blocked {
    /// It waits for `0` (an action on rank `1`).
    On(Action, usize),
}

struct Sim<'a> {
    s: &'a Schedule,
    lowered: bool,
    present: HashSet<Action>,
    /// End time of every action run so far.
    done: HashMap<Action, u64>,
    /// The messages in flight on each channel.
    channels: BTreeMap<Channel, VecDeque<Message>>,
    producers: Vec<Vec<usize>>,
    consumers: Vec<Vec<usize>>,
}

/// Simulates `schedule` (lowered or not) with `costs`. Fails with
/// [`ScheduleError::Deadlock`] naming every blocked rank and what it waits for, with
/// [`ScheduleError::Mismatch`] when a receive would take another microbatch's message, and
/// with [`ScheduleError::Invalid`] for a malformed schedule or a message never received.
pub fn simulate(schedule: &Schedule, costs: Costs) -> Result<Simulation, ScheduleError> {
    simulate_costed(schedule, costs, &|a: &Action| costs.of(a.kind))
}

/// [`simulate`] with a cost per action, communication included (e.g. each stage's measured
/// F and B durations and the measured cost of a send from a real run, in microseconds): what
/// the schedule promises for stages that are not balanced. `costs` is only recorded in the
/// result; busy time and the bubble count compute actions only.
pub fn simulate_costed(
    schedule: &Schedule,
    costs: Costs,
    cost_of: &dyn Fn(&Action) -> u64,
) -> Result<Simulation, ScheduleError> {
    check_structure(schedule)?;
    let stages = schedule.stages();
    let mut sim = Sim {
        s: schedule,
        lowered: schedule.is_lowered(),
        present: schedule.actions.iter().flatten().copied().collect(),
        done: HashMap::new(),
        channels: BTreeMap::new(),
        producers: (0..stages).map(|t| schedule.producers(t)).collect(),
        consumers: (0..stages).map(|t| schedule.consumers(t)).collect(),
    };
    let ranks = schedule.ranks;
    let mut next = vec![0usize; ranks];
    let mut free = vec![0u64; ranks];
    let mut timeline: Vec<Vec<Span>> = vec![Vec::new(); ranks];
    loop {
        let mut progress = false;
        for (r, list) in schedule.actions.iter().enumerate() {
            while let Some(&a) = list.get(next[r]) {
                let Some(ready) = sim.ready(r, a)? else {
                    break;
                };
                let start = ready.max(free[r]);
                let end = start + cost_of(&a);
                sim.run(a, end);
                free[r] = end;
                if a.kind.is_compute() {
                    timeline[r].push(Span {
                        action: a,
                        start,
                        end,
                    });
                }
                next[r] += 1;
                progress = true;
            }
        }
        if (0..ranks).all(|r| next[r] == schedule.actions[r].len()) {
            break;
        }
        if !progress {
            return Err(sim.deadlock(&next));
        }
    }
    sim.check_drained()?;
    Ok(summarize(schedule, costs, timeline, &free))
}

/// The result of a finished run: makespan, busy time and the bubble as an exact fraction.
fn summarize(
    schedule: &Schedule,
    costs: Costs,
    timeline: Vec<Vec<Span>>,
    free: &[u64],
) -> Simulation {
    let ranks = schedule.ranks;
    let makespan = free.iter().copied().max().unwrap_or(0);
    let busy: Vec<u64> = timeline
        .iter()
        .map(|spans| spans.iter().map(|x| x.end - x.start).sum())
        .collect();
    let total = ranks as u64 * makespan;
    let idle = total - busy.iter().sum::<u64>();
    let (num, den) = if total == 0 {
        (0, 1)
    } else {
        let g = gcd(idle, total);
        (idle / g, total / g)
    };
    Simulation {
        schedule: schedule.name.clone(),
        ranks,
        costs,
        timeline,
        makespan,
        busy,
        idle,
        bubble_numerator: num,
        bubble_denominator: den,
        bubble_fraction: num as f64 / den as f64,
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

impl Sim<'_> {
    /// The deadlock error: each stuck rank's next action (index `next[r]`) and what it awaits.
    fn deadlock(&self, next: &[usize]) -> ScheduleError {
        let mut waits = Vec::new();
        for (r, list) in self.s.actions.iter().enumerate() {
            if let Some(&a) = list.get(next[r]) {
                if let Err(Blocked::On(dep, on_rank)) = self.deps(a) {
                    waits.push(Wait {
                        rank: r,
                        at: a,
                        waits_for: dep,
                        on_rank,
                    });
                }
            }
        }
        ScheduleError::Deadlock { waits }
    }

    /// Fails when a channel still holds a message at the end of the step (never received).
    fn check_drained(&self) -> Result<(), ScheduleError> {
        if let Some(((p, c, dir), queue)) = self.channels.iter().find(|(_, q)| !q.is_empty()) {
            let m = queue[0].sent;
            let (from, to) = if *dir == Dir::Forward { (p, c) } else { (c, p) };
            return Err(ScheduleError::Invalid(format!(
                "rank {}: {m} is never received: the {} channel {from}→{to} still holds it at the \
                 end of the step",
                self.s.stage_ranks[m.stage],
                if *dir == Dir::Forward {
                    "forward"
                } else {
                    "backward"
                },
            )));
        }
        Ok(())
    }

    fn rank(&self, stage: usize) -> usize {
        self.s.stage_ranks[stage]
    }

    /// The end time of `a` if it has run.
    fn end(&self, a: Action) -> Option<u64> {
        self.done.get(&a).copied()
    }

    /// The end of the B or I of `(stage, mb)`, or the one to wait for.
    fn backward(&self, stage: usize, mb: usize) -> Result<u64, Blocked> {
        let (b, i) = (Action::mb(stage, B, mb), Action::mb(stage, I, mb));
        self.end(b).or_else(|| self.end(i)).ok_or_else(|| {
            let named = if self.present.contains(&i) { i } else { b };
            Blocked::On(named, self.rank(stage))
        })
    }

    fn need(&self, a: Action) -> Result<u64, Blocked> {
        self.end(a).ok_or(Blocked::On(a, self.rank(a.stage)))
    }

    /// When the direct dependencies of `a` are met (receives excluded), or what blocks it.
    fn deps(&self, a: Action) -> Result<u64, Blocked> {
        let Some(mb) = a.microbatch else {
            return Ok(0);
        };
        let s = a.stage;
        let local = |x: usize| !self.lowered || !self.s.is_remote(x, s);
        let mut t = 0;
        match a.kind {
            F => {
                for &p in self.producers[s].iter().filter(|&&p| local(p)) {
                    t = t.max(self.need(Action::mb(p, F, mb))?);
                }
                if self.lowered && self.producers[s].iter().any(|&p| !local(p)) {
                    t = t.max(self.need(Action::mb(s, RecvF, mb))?);
                }
            }
            B | I => {
                t = t.max(self.need(Action::mb(s, F, mb))?);
                for &c in self.consumers[s].iter().filter(|&&c| local(c)) {
                    t = t.max(self.backward(c, mb)?);
                }
                if self.lowered && self.consumers[s].iter().any(|&c| !local(c)) {
                    t = t.max(self.need(Action::mb(s, RecvB, mb))?);
                }
            }
            W => t = self.need(Action::mb(s, I, mb))?,
            SendF => t = self.need(Action::mb(s, F, mb))?,
            SendB => t = self.backward(s, mb)?,
            RecvF => {
                for &p in self.producers[s]
                    .iter()
                    .filter(|&&p| self.s.is_remote(p, s))
                {
                    let want = Action::mb(p, SendF, mb);
                    t = t.max(
                        self.head(p, s, Dir::Forward)
                            .ok_or(Blocked::On(want, self.rank(p)))?,
                    );
                }
            }
            RecvB => {
                for &c in self.consumers[s]
                    .iter()
                    .filter(|&&c| self.s.is_remote(s, c))
                {
                    let want = Action::mb(c, SendB, mb);
                    t = t.max(
                        self.head(s, c, Dir::Backward)
                            .ok_or(Blocked::On(want, self.rank(c)))?,
                    );
                }
            }
            _ => {}
        }
        Ok(t)
    }

    /// When the head message of a channel was sent, if there is one.
    fn head(&self, p: usize, c: usize, dir: Dir) -> Option<u64> {
        self.channels
            .get(&(p, c, dir))
            .and_then(|q| q.front())
            .map(|m| m.at)
    }

    /// `Some(time)` when `a` can start (its inputs are ready at `time`), `None` when it
    /// must wait; an error when a receive would take another microbatch's message.
    fn ready(&self, r: usize, a: Action) -> Result<Option<u64>, ScheduleError> {
        if let (RecvF | RecvB, Some(mb)) = (a.kind, a.microbatch) {
            for (key, queue) in self.inbound(a) {
                if let Some(m) = queue.and_then(|q| q.front()) {
                    if m.sent.microbatch != Some(mb) {
                        let (p, c, dir) = key;
                        return Err(ScheduleError::Mismatch {
                            rank: r,
                            action: a,
                            sent: m.sent,
                            sender: self.rank(m.sent.stage),
                            channel: match dir {
                                Dir::Forward => format!("forward {p}→{c}"),
                                Dir::Backward => format!("backward {c}→{p}"),
                            },
                        });
                    }
                }
            }
        }
        Ok(self.deps(a).ok())
    }

    /// The channels a receive takes from, with their queues (absent when nothing was sent).
    fn inbound(&self, a: Action) -> Vec<(Channel, Option<&VecDeque<Message>>)> {
        let s = a.stage;
        let keys: Vec<Channel> = match a.kind {
            RecvF => self.producers[s]
                .iter()
                .filter(|&&p| self.s.is_remote(p, s))
                .map(|&p| (p, s, Dir::Forward))
                .collect(),
            RecvB => self.consumers[s]
                .iter()
                .filter(|&&c| self.s.is_remote(s, c))
                .map(|&c| (s, c, Dir::Backward))
                .collect(),
            _ => Vec::new(),
        };
        keys.into_iter()
            .map(|k| (k, self.channels.get(&k)))
            .collect()
    }

    /// Records that `a` ran, ending at `end`: sends enqueue, receives dequeue.
    fn run(&mut self, a: Action, end: u64) {
        let s = a.stage;
        match a.kind {
            SendF => {
                for c in self.consumers[s].clone() {
                    if self.s.is_remote(s, c) {
                        let q = self.channels.entry((s, c, Dir::Forward)).or_default();
                        q.push_back(Message { sent: a, at: end });
                    }
                }
            }
            SendB => {
                for p in self.producers[s].clone() {
                    if self.s.is_remote(p, s) {
                        let q = self.channels.entry((p, s, Dir::Backward)).or_default();
                        q.push_back(Message { sent: a, at: end });
                    }
                }
            }
            RecvF | RecvB => {
                let keys: Vec<_> = self.inbound(a).into_iter().map(|(k, _)| k).collect();
                for k in keys {
                    if let Some(q) = self.channels.get_mut(&k) {
                        q.pop_front();
                    }
                }
            }
            _ => {}
        }
        self.done.entry(a).or_insert(end);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{generate, lower, ScheduleKind};
    use super::*;

    fn sim(kind: ScheduleKind, p: usize, v: usize, m: usize) -> Simulation {
        let s = lower(&generate(kind, p, v, m).unwrap());
        simulate(&s, Costs::default()).unwrap()
    }

    #[test]
    fn gpipe_and_1f1b_bubbles_are_exactly_p_minus_1_over_m_plus_p_minus_1() {
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
            for p in [2u64, 4, 8] {
                for m in [p, 2 * p, 4 * p] {
                    let x = sim(kind, p as usize, 1, m as usize);
                    assert!(
                        x.bubble_is(p - 1, m + p - 1),
                        "{kind} p={p} m={m}: {}/{}",
                        x.bubble_numerator,
                        x.bubble_denominator
                    );
                    assert_eq!(x.makespan, 3 * (m + p - 1));
                    assert!(x.busy.iter().all(|&b| b == 3 * m));
                }
            }
        }
    }

    #[test]
    fn interleaved_bubble_is_exactly_p_minus_1_over_vm_plus_p_minus_1() {
        for p in [2u64, 4, 8] {
            for m in [p, 2 * p, 4 * p] {
                let v = 2u64;
                let x = sim(
                    ScheduleKind::Interleaved1F1B,
                    p as usize,
                    v as usize,
                    m as usize,
                );
                assert!(
                    x.bubble_is(p - 1, v * m + p - 1),
                    "p={p} v={v} m={m}: {}/{}",
                    x.bubble_numerator,
                    x.bubble_denominator
                );
            }
        }
    }

    /// The closed forms do not depend on the default costs: with communication free they
    /// hold for any F, I, W.
    #[test]
    fn closed_forms_hold_under_other_costs() {
        let kinds = [
            ScheduleKind::GPipe,
            ScheduleKind::OneFOneB,
            ScheduleKind::Interleaved1F1B,
            ScheduleKind::LoopedBfs,
        ];
        for (forward, backward_input, backward_weight) in [(1, 1, 0), (2, 1, 1), (1, 3, 3)] {
            let costs = Costs {
                forward,
                backward_input,
                backward_weight,
            };
            for kind in kinds {
                let v = kind.default_virtual() as u64;
                for (p, m) in [(2u64, 4u64), (4, 8), (8, 8)] {
                    let s = lower(&generate(kind, p as usize, v as usize, m as usize).unwrap());
                    let x = simulate(&s, costs).unwrap();
                    assert!(
                        x.bubble_is(p - 1, v * m + p - 1),
                        "{kind} p={p} m={m} {costs:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn zero_bubble_schedules_beat_1f1b() {
        for p in [2usize, 4, 8] {
            for m in [2 * p, 4 * p] {
                let base = sim(ScheduleKind::OneFOneB, p, 1, m).bubble_fraction;
                let inter = sim(ScheduleKind::Interleaved1F1B, p, 2, m).bubble_fraction;
                for kind in [
                    ScheduleKind::InterleavedZeroBubble,
                    ScheduleKind::Zbv,
                    ScheduleKind::DualPipeV,
                ] {
                    let x = sim(kind, p, 2, m).bubble_fraction;
                    assert!(x < base, "{kind} p={p} m={m}: {x} vs 1f1b {base}");
                }
                let zb = sim(ScheduleKind::InterleavedZeroBubble, p, 2, m).bubble_fraction;
                assert!(zb < inter, "interleaved_zb p={p} m={m}: {zb} vs {inter}");
            }
        }
    }

    #[test]
    fn finds_a_deadlock_from_a_missing_send() {
        let mut s = lower(&generate(ScheduleKind::OneFOneB, 2, 1, 4).unwrap());
        s.actions[1].retain(|a| a.to_string() != "1SEND_B3");
        let e = simulate(&s, Costs::default()).unwrap_err();
        assert!(matches!(e, ScheduleError::Deadlock { .. }), "{e:?}");
        assert_eq!(
            e.to_string(),
            "deadlock: rank 0 waits at 0RECV_B3 for 1SEND_B3 (rank 1)"
        );
    }

    #[test]
    fn finds_a_deadlock_from_swapped_receives() {
        // Rank 1 waits for the gradient before it runs the forward that produces it.
        let mut s = lower(&generate(ScheduleKind::OneFOneB, 3, 1, 3).unwrap());
        let pos = |s: &Schedule, r: usize, l: &str| {
            s.actions[r]
                .iter()
                .position(|a| a.to_string() == l)
                .unwrap()
        };
        let (a, b) = (pos(&s, 1, "1RECV_F0"), pos(&s, 1, "1RECV_B0"));
        s.actions[1].swap(a, b);
        let e = simulate(&s, Costs::default()).unwrap_err().to_string();
        assert!(e.starts_with("deadlock: "), "{e}");
        assert!(
            e.contains("rank 1 waits at 1RECV_B0 for 2SEND_B0 (rank 2)"),
            "{e}"
        );
        assert!(
            e.contains("rank 2 waits at 2RECV_F0 for 1SEND_F0 (rank 1)"),
            "{e}"
        );
        assert!(
            e.contains("rank 0 waits at 0RECV_B0 for 1SEND_B0 (rank 1)"),
            "{e}"
        );
    }

    #[test]
    fn a_receive_for_the_wrong_microbatch_is_named() {
        let mut s = lower(&generate(ScheduleKind::GPipe, 2, 1, 3).unwrap());
        s.actions[0].retain(|a| a.to_string() != "0SEND_F0");
        let e = simulate(&s, Costs::default()).unwrap_err();
        assert!(matches!(e, ScheduleError::Mismatch { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("rank 1: 1RECV_F0 would receive the message of 0SEND_F1 (rank 0)"));
        assert!(e.contains("forward 0→1"), "{e}");
    }

    #[test]
    fn a_send_never_received_is_an_error() {
        let mut s = lower(&generate(ScheduleKind::GPipe, 2, 1, 2).unwrap());
        s.actions[0].retain(|a| a.to_string() != "0RECV_B1");
        // B of microbatch 1 on stage 0 then lacks its input: it deadlocks on its own list.
        let e = simulate(&s, Costs::default()).unwrap_err().to_string();
        assert!(
            e.contains("rank 0 waits at 0B1 for 0RECV_B1 (rank 0)"),
            "{e}"
        );
        let mut s = lower(&generate(ScheduleKind::GPipe, 2, 1, 2).unwrap());
        s.actions[1].push(Action::mb(1, SendB, 1));
        let e = simulate(&s, Costs::default()).unwrap_err().to_string();
        assert!(e.contains("rank 1: 1SEND_B1 is never received"), "{e}");
    }

    #[test]
    fn unlowered_deadlocks_name_compute_actions() {
        let mut s = generate(ScheduleKind::GPipe, 2, 1, 2).unwrap();
        // Rank 0 runs a backward before the forwards of rank 1 can see any input.
        let b = s.actions[0].remove(2);
        s.actions[0].insert(0, b);
        let e = simulate(&s, Costs::default()).unwrap_err().to_string();
        assert!(e.contains("rank 0 waits at 0B0 for 0F0 (rank 0)"), "{e}");
        assert!(e.contains("rank 1 waits at 1F0 for 0F0 (rank 0)"), "{e}");
    }

    #[test]
    fn costs_shape_the_timeline() {
        let c = Costs {
            forward: 2,
            backward_input: 3,
            backward_weight: 1,
        };
        assert_eq!(c.of(B), 4);
        assert_eq!(c.of(SendF), 0);
        let s = generate(ScheduleKind::GPipe, 2, 1, 2).unwrap();
        let x = simulate(&s, c).unwrap();
        // GPipe: (m+p-1)(F+B) with any costs.
        assert_eq!(x.makespan, 3 * 6);
        assert_eq!(
            x.timeline[1][0],
            Span {
                action: Action::mb(1, F, 0),
                start: 2,
                end: 4
            }
        );
        let json = serde_json::to_value(&x).unwrap();
        assert_eq!(json["bubble_numerator"], 1);
        assert_eq!(json["bubble_denominator"], 3);
    }
}
