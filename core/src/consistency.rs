//! Cross-rank consistency: what every rank must hold bit for bit, checked after every step.
//!
//! A parity comparison reads rank 0's record. A rank that silently diverges (rank 1 alone
//! skipping a parameter in its optimizer step, a TP-replicated norm that differs across TP
//! ranks, a tied weight whose copies drift apart across pipeline stages) leaks into rank 0's
//! numbers late or never. So every training loop hands a [`StateProbe`] a digest of its state
//! after each optimizer step: each tensor's name, a *coordinate* and a hash of its bytes.
//! Two tensors with the same step, kind, name and coordinate, on any two ranks, must be
//! bitwise equal; [`check_digests`] compares every rank's digest and names the first pair
//! that is not.
//!
//! The coordinate says which copies are the same content: empty for a replicated tensor
//! (DDP's parameters, a TP-replicated norm, an expert under its global name, a tied weight on
//! every stage that holds it), `tp1` for rank 1's tensor-parallel shard, `shard0` for the
//! first flat FSDP shard. Ranks that hold different content under one name must say so in the
//! coordinate; ranks that must agree use the same one.
//!
//! The probe also carries the [`StepClock`] the loops tick at the start of every step, which
//! is how a fault injector knows which step a collective belongs to.

use crate::comm::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tch::Tensor;

/// The step a rank's training loop is in, shared with whoever needs it (a fault injector).
/// Before the first step it reads 0.
#[derive(Clone, Debug, Default)]
pub struct StepClock {
    step: Arc<AtomicUsize>,
}

impl StepClock {
    /// A clock at step 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The step the loop last started.
    pub fn current(&self) -> usize {
        self.step.load(Ordering::SeqCst)
    }

    /// Called by a training loop as step `step` starts.
    pub fn start(&self, step: usize) {
        self.step.store(step, Ordering::SeqCst);
    }
}

/// What a digest entry describes: parameters and optimizer state after a step, or the full
/// parameters a run ends with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateKind {
    /// A parameter (or this rank's shard of it) as the run's first step starts, before any
    /// update: ranks that begin from different values (another seed, a rank that perturbed
    /// its copy) are named at that tensor, before a step spreads the difference into others.
    Start,
    /// A parameter (or this rank's shard of it) after the step's optimizer update.
    Param,
    /// An optimizer state entry (momentum, Adam's moments) after the update.
    Optimizer,
    /// A full parameter as the run ends (after any gather), the view the record captures.
    Final,
    /// A parameter as the record a rank's training function returned reports it: a user's
    /// function is checked by what it reports, since only rank 0's record is compared with
    /// the references and no probe sees inside it.
    Reported,
}

impl std::fmt::Display for StateKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StateKind::Start | StateKind::Param => "parameter",
            StateKind::Optimizer => "optimizer state",
            StateKind::Final => "final parameter",
            StateKind::Reported => "reported parameter",
        })
    }
}

/// One tensor of one rank's state at one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DigestEntry {
    /// The step whose update produced it (for [`StateKind::Final`], the number of steps).
    pub step: usize,
    /// Parameter, optimizer state or final parameter.
    pub kind: StateKind,
    /// The tensor's name (a parameter's, or `<parameter>.<entry>` for optimizer state).
    pub name: String,
    /// Which copy of the content this is (see the module documentation); empty when
    /// replicated.
    pub coord: String,
    /// The tensor's shape.
    pub shape: Vec<i64>,
    /// The dtype its bytes were hashed in.
    pub dtype: DType,
    /// A hash of its bytes: equal tensors hash equal, and any differing bit changes it with
    /// overwhelming probability.
    pub hash: u64,
    /// The sum of its elements in f64, for a mismatch to show how far apart the copies are.
    #[serde(with = "crate::num")]
    pub sum: f64,
}

/// Everything one rank observed during one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankDigest {
    /// The rank that observed it.
    pub rank: usize,
    /// Its entries in observation order.
    pub entries: Vec<DigestEntry>,
}

/// A rank's collector of [`DigestEntry`]s, cheap to clone (clones add to the same digest):
/// the launcher gives one to the training configuration and takes the digest after the run.
#[derive(Clone, Debug, Default)]
pub struct StateProbe {
    rank: usize,
    entries: Arc<Mutex<Vec<DigestEntry>>>,
    clock: StepClock,
    /// Set while [`StateProbe::observe_start`] runs. Read in [`StateProbe::observe`], the one
    /// door every observation goes through, so a hand-written `observe_state` that records
    /// through `observe` directly is recorded as the start too, never as a second `Param`.
    starting: Arc<AtomicBool>,
}

impl StateProbe {
    /// An empty probe for global rank `rank`, its clock at step 0.
    pub fn new(rank: usize) -> Self {
        StateProbe {
            rank,
            ..Self::default()
        }
    }

    /// The coordinate of content only this rank holds (a rank-local expert): compared with
    /// nothing but this rank's own other observations of it.
    pub fn rank_local(&self) -> String {
        format!("rank{}", self.rank)
    }

    /// The clock the training loop ticks through [`StateProbe::start_step`].
    pub fn clock(&self) -> StepClock {
        self.clock.clone()
    }

    /// Marks the start of step `step` (every training loop calls it first thing).
    pub fn start_step(&self, step: usize) {
        self.clock.start(step);
    }

    /// Runs `observe`, a loop's usual after-step observation, as the record of the state the
    /// run starts from: the parameters it reports are recorded as [`StateKind::Start`], its
    /// optimizer state left out (a run's state before its first update is its parameters).
    /// Every wrapper already knows which of its tensors are copies of which, so the start is
    /// checked by the same code, with the same coordinates, as every later step.
    pub fn observe_start<T>(&self, observe: impl FnOnce() -> T) -> T {
        self.starting.store(true, Ordering::SeqCst);
        let observed = observe();
        self.starting.store(false, Ordering::SeqCst);
        observed
    }

    /// Records `tensor` as copy `coord` of `name` at `step`.
    pub fn observe(
        &self,
        step: usize,
        kind: StateKind,
        name: &str,
        coord: &str,
        tensor: &Tensor,
    ) -> Result<(), crate::CommError> {
        let kind = match (self.starting.load(Ordering::SeqCst), kind) {
            (true, StateKind::Param) => StateKind::Start,
            (true, StateKind::Optimizer) => return Ok(()),
            (_, kind) => kind,
        };
        let entry = digest(step, kind, name, coord, tensor)?;
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(entry);
        Ok(())
    }

    /// Records the parameters a run reports at its end (`step`: the steps it ran) as
    /// [`StateKind::Reported`], each under the coordinate `coord` gives its name: every rank
    /// that reports a parameter must report the same values (a rank that reports none is
    /// compared with nothing).
    pub fn observe_reported(
        &self,
        step: usize,
        params: &[(String, Tensor)],
        coord: &dyn Fn(&str) -> String,
    ) -> Result<(), crate::CommError> {
        for (name, values) in params {
            self.observe(step, StateKind::Reported, name, &coord(name), values)?;
        }
        Ok(())
    }

    /// Records every tensor of `tensors`, each under the coordinate `coord` gives its name.
    pub fn observe_all(
        &self,
        step: usize,
        kind: StateKind,
        tensors: &[(String, Tensor)],
        coord: &dyn Fn(&str) -> String,
    ) -> Result<(), crate::CommError> {
        for (name, t) in tensors {
            if t.numel() > 0 {
                self.observe(step, kind, name, &coord(name), t)?;
            }
        }
        Ok(())
    }

    /// Records an optimizer's state after step `step`; each entry `<parameter>.<entry>` takes
    /// its parameter's coordinate (the longest parameter name that prefixes it).
    pub fn observe_optimizer(
        &self,
        step: usize,
        state: &[(String, Tensor)],
        params: &[(String, Tensor)],
        coord: &dyn Fn(&str) -> String,
    ) -> Result<(), crate::CommError> {
        for (name, t) in state {
            let owner = params
                .iter()
                .map(|(p, _)| p.as_str())
                .filter(|p| name.len() > p.len() && name.starts_with(p))
                .max_by_key(|p| p.len())
                .unwrap_or(name.as_str());
            if t.numel() > 0 {
                self.observe(step, StateKind::Optimizer, name, &coord(owner), t)?;
            }
        }
        Ok(())
    }

    /// The digest so far.
    pub fn digest(&self) -> RankDigest {
        RankDigest {
            rank: self.rank,
            entries: self
                .entries
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// The digest entry of one tensor: its bytes (on the CPU, contiguous) hashed.
fn digest(
    step: usize,
    kind: StateKind,
    name: &str,
    coord: &str,
    tensor: &Tensor,
) -> Result<DigestEntry, crate::CommError> {
    let dtype = DType::from_kind(tensor.kind())?;
    let host = tensor
        .f_detach()?
        .f_to_device(tch::Device::Cpu)?
        .f_contiguous()?;
    let numel = host.numel();
    let mut bytes = vec![0u8; numel * tensor.kind().elt_size_in_bytes()];
    host.f_copy_data_u8(&mut bytes, numel)?;
    let mut hasher = std::hash::DefaultHasher::new();
    hasher.write(&bytes);
    let sum = host
        .f_to_kind(tch::Kind::Double)?
        .f_sum(tch::Kind::Double)?
        .f_double_value(&[])?;
    Ok(DigestEntry {
        step,
        kind,
        name: name.to_owned(),
        coord: coord.to_owned(),
        shape: tensor.size(),
        dtype,
        hash: hasher.finish(),
        sum,
    })
}

/// What the cross-rank check of one run found: how much it compared, and the first pair of
/// copies that differ.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CrossRankCheck {
    /// Ranks whose digests were compared.
    pub ranks: usize,
    /// Tensors (per step) held by more than one rank, hence compared.
    pub compared: usize,
    /// The earliest mismatch, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mismatch: Option<CrossRankMismatch>,
}

/// Two ranks whose copies of one tensor must be bitwise equal and are not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CrossRankMismatch {
    /// The step after which they differ.
    pub step: usize,
    /// Parameter, optimizer state or final parameter.
    pub kind: StateKind,
    /// The tensor's name.
    pub name: String,
    /// Its coordinate (empty when replicated).
    pub coord: String,
    /// Every rank holding this copy, in rank order.
    pub holders: Vec<usize>,
    /// The ranks that agree with the lowest holder.
    pub agreeing: Vec<usize>,
    /// The ranks that differ from the lowest holder.
    pub differing: Vec<usize>,
    /// The lowest holder's element sum and the first differing rank's.
    #[serde(with = "crate::num::vec")]
    pub sums: Vec<f64>,
    /// Shapes, when they differ.
    pub shapes: Vec<Vec<i64>>,
}

impl std::fmt::Display for CrossRankMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let which = if self.coord.is_empty() {
            String::new()
        } else {
            format!(" (copy {})", self.coord)
        };
        let ranks = |r: &[usize]| r.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let when = match self.kind {
            StateKind::Final => "at the end of the run".to_owned(),
            StateKind::Reported => "in the records the ranks returned".to_owned(),
            StateKind::Start => format!("as step {} starts, before any update", self.step),
            _ => format!("after step {}", self.step),
        };
        write!(
            f,
            "{} `{}`{which} differs across ranks {when}: rank{} {} differ{} from rank{} {} \
             (every rank holding it must hold the same bits)",
            self.kind,
            self.name,
            if self.differing.len() > 1 { "s" } else { "" },
            ranks(&self.differing),
            if self.differing.len() > 1 { "" } else { "s" },
            if self.agreeing.len() > 1 { "s" } else { "" },
            ranks(&self.agreeing),
        )?;
        if self.shapes.len() == 2 && self.shapes[0] != self.shapes[1] {
            write!(f, "; shapes {:?} vs {:?}", self.shapes[0], self.shapes[1])
        } else if self.sums.len() == 2 {
            write!(f, "; element sums {:e} vs {:e}", self.sums[0], self.sums[1])
        } else {
            Ok(())
        }
    }
}

/// Compares every rank's digest: each (step, kind, name, coordinate) held by several ranks
/// must have one hash. Returns what was compared and the earliest mismatch (by step, then
/// kind, then the order the first rank observed the tensors in).
pub fn check_digests(digests: &[RankDigest]) -> CrossRankCheck {
    type Key<'a> = (usize, StateKind, usize, &'a str, &'a str);
    // Order of first observation per key, so the earliest mismatch is the one a loop saw
    // first (parameters in model order).
    let mut order: BTreeMap<(usize, StateKind, &str, &str), usize> = BTreeMap::new();
    let mut copies: BTreeMap<Key<'_>, Vec<(usize, &DigestEntry)>> = BTreeMap::new();
    for d in digests {
        for e in &d.entries {
            let next = order.len();
            let seen = *order
                .entry((e.step, e.kind, e.name.as_str(), e.coord.as_str()))
                .or_insert(next);
            copies
                .entry((e.step, e.kind, seen, e.name.as_str(), e.coord.as_str()))
                .or_default()
                .push((d.rank, e));
        }
    }
    let mut check = CrossRankCheck {
        ranks: digests.len(),
        ..CrossRankCheck::default()
    };
    for ((step, kind, _, name, coord), mut held) in copies {
        held.sort_by_key(|(rank, _)| *rank);
        held.dedup_by_key(|(rank, e)| (*rank, e.hash));
        let holders: Vec<usize> = held.iter().map(|(r, _)| *r).collect();
        let mut distinct = holders.clone();
        distinct.dedup();
        if distinct.len() < 2 && held.len() < 2 {
            continue;
        }
        check.compared += 1;
        let (_, first) = held[0];
        let same = |e: &DigestEntry| e.hash == first.hash && e.shape == first.shape;
        if held.iter().all(|(_, e)| same(e)) {
            continue;
        }
        if check.mismatch.is_none() {
            let other = held
                .iter()
                .find(|(_, e)| !same(e))
                .map(|(_, e)| *e)
                .unwrap_or(first);
            check.mismatch = Some(CrossRankMismatch {
                step,
                kind,
                name: name.to_owned(),
                coord: coord.to_owned(),
                holders: distinct,
                agreeing: held
                    .iter()
                    .filter(|(_, e)| same(e))
                    .map(|(r, _)| *r)
                    .collect(),
                differing: held
                    .iter()
                    .filter(|(_, e)| !same(e))
                    .map(|(r, _)| *r)
                    .collect(),
                sums: vec![first.sum, other.sum],
                shapes: vec![first.shape.clone(), other.shape.clone()],
            });
        }
    }
    check
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(rank: usize, values: &[(&str, &str, f32)]) -> RankDigest {
        let probe = StateProbe::new(rank);
        for (name, coord, v) in values {
            probe
                .observe(
                    0,
                    StateKind::Param,
                    name,
                    coord,
                    &Tensor::from_slice(&[*v, 1.0]),
                )
                .expect("observe");
        }
        probe.digest()
    }

    #[test]
    fn equal_replicas_pass_and_shards_are_not_compared() {
        let a = digest_of(0, &[("w", "", 1.0), ("s", "tp0", 5.0)]);
        let b = digest_of(1, &[("w", "", 1.0), ("s", "tp1", 6.0)]);
        let check = check_digests(&[a, b]);
        assert_eq!(check.mismatch, None);
        assert_eq!(check.compared, 1);
    }

    #[test]
    fn a_diverged_replica_is_named_with_its_rank_and_step() {
        let a = digest_of(0, &[("w", "", 1.0)]);
        let b = digest_of(1, &[("w", "", 1.0)]);
        let c = digest_of(2, &[("w", "", 1.5)]);
        let check = check_digests(&[a, b, c]);
        let m = check.mismatch.expect("a mismatch");
        assert_eq!((m.step, m.name.as_str()), (0, "w"));
        assert_eq!((m.agreeing, m.differing), (vec![0, 1], vec![2]));
        let text = check_digests(&[
            digest_of(0, &[("w", "", 1.0)]),
            digest_of(1, &[("w", "", 2.0)]),
        ])
        .mismatch
        .expect("a mismatch")
        .to_string();
        assert!(
            text.contains("parameter `w`") && text.contains("rank 1"),
            "{text}"
        );
        assert!(text.contains("after step 0"), "{text}");
    }

    #[test]
    fn a_start_that_differs_is_named_before_the_step_it_spreads_into() {
        // Rank 1 starts from another `norm`; after step 0 `emb` (observed first) differs too.
        let run = |rank: usize, norm: f32| {
            let probe = StateProbe::new(rank);
            let observe = |emb: f32, norm: f32| -> Result<(), crate::CommError> {
                for (name, v) in [("emb", emb), ("norm", norm)] {
                    probe.observe(0, StateKind::Param, name, "", &Tensor::from_slice(&[v]))?;
                }
                // Optimizer state that differs by rank: not part of the start.
                let m = Tensor::from_slice(&[rank as f32]);
                probe.observe(0, StateKind::Optimizer, "norm.m", "rank", &m)
            };
            probe.observe_start(|| observe(1.0, norm)).expect("observe");
            observe(1.0 + norm, norm + 1.0).expect("observe");
            probe.digest()
        };
        let (a, b) = (run(0, 1.0), run(1, 2.0));
        let starts = |d: &RankDigest| {
            d.entries
                .iter()
                .filter(|e| e.kind == StateKind::Start)
                .count()
        };
        assert_eq!((starts(&a), a.entries.len()), (2, 5));
        let m = check_digests(&[a, b]).mismatch.expect("a mismatch");
        assert_eq!((m.kind, m.name.as_str()), (StateKind::Start, "norm"));
        let text = m.to_string();
        assert!(
            text.contains("as step 0 starts, before any update"),
            "{text}"
        );
    }

    #[test]
    fn two_observations_on_one_rank_must_agree_too() {
        let probe = StateProbe::new(0);
        let t = Tensor::from_slice(&[1.0f32]);
        probe
            .observe(3, StateKind::Final, "w", "shard0", &t)
            .expect("observe");
        probe
            .observe(3, StateKind::Final, "w", "shard0", &(&t + 1.0))
            .expect("observe");
        let m = check_digests(&[probe.digest()])
            .mismatch
            .expect("a mismatch");
        assert_eq!(m.differing, vec![0]);
    }
}
