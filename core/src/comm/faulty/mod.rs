//! Fault injection: wrap a group in a [`FaultyGroup`] and one collective call on one rank
//! comes back wrong, in a chosen way, so a parity test can prove it would notice.
//!
//! A parity test that never fails proves nothing. To show that a comparison is strong enough,
//! [`FaultInjector`] corrupts exactly one call — a *site* — and the test must then fail. A
//! site is `(step, index, rank)`: the training step the rank's loop was in (read from the
//! [`StepClock`] the loops tick), the position of the call among the data-carrying calls this
//! rank issued since that step started, counted over every group of the rank (one counter per
//! rank, shared by all its [`FaultyGroup`]s), and the global rank. Calls issued before the
//! first step (parameter broadcasts at wrap time) count as step 0, ahead of step 0's own.
//! Barriers carry no data and are not counted.
//!
//! **No fault can hang a run.** Every rank still takes part in the real collective with the
//! real shapes; the fault alters only what this rank ends up holding afterwards (or, for a
//! send, what it hands to the wire, and for [`FaultKind::PermutedChunks`] on a
//! reduce-scatter, the order of the chunks it contributes: a reduce-scatter's local result is
//! one chunk, so a swapped chunk order can only be realised on the input side).
//!
//! In [`FaultMode::Record`] nothing is altered and every call is logged ([`CallRecord`]), so
//! the sites of a run can be enumerated and then injected one at a time. Whether a fault
//! applies to a call is decided by one function, [`applicability`], which the injector uses at
//! run time and a planner can use on a recorded log to skip runs that could not inject.
//!
//! The files: what to inject where in `kind` ([`FaultKind`], [`FaultSite`], [`FaultMode`]),
//! what a rank saw and what became of its fault in `record` ([`CallRecord`], [`applicability`],
//! [`Injection`], [`FaultLog`]), the wrapper that runs each call and applies the fault in
//! `group` ([`FaultyGroup`]), and the faults' arithmetic in `alter`. This file holds the
//! per-rank [`FaultInjector`] they all report to: the call counter, the log and the results
//! kept for stale reads.

mod alter;
mod group;
mod kind;
mod record;

pub use group::FaultyGroup;
pub use kind::{FaultKind, FaultMode, FaultSite};
pub use record::{applicability, CallRecord, FaultLog, Injection};

use crate::comm::{CommError, DType, OpKind, ProcessGroup};
use crate::consistency::StepClock;
use record::{stale_source, wrong_peer_source};
use std::sync::{Arc, Mutex, PoisonError};
use tch::{Kind, Tensor};

/// A tensor an earlier call produced, kept for [`FaultKind::Stale`] and a receive's
/// [`FaultKind::WrongPeer`].
struct Held {
    call: CallRecord,
    value: Tensor,
}

struct State {
    /// The step the index counts in.
    step: usize,
    /// The next call's index.
    next: usize,
    calls: Vec<CallRecord>,
    injection: Option<Injection>,
    /// Earlier results, newest last (only while a fault that needs them is pending).
    held: Vec<Held>,
}

/// One rank's fault injector: the shared call counter, the log and the fault. Wrap every
/// group the rank uses with [`FaultInjector::wrap`] (a [`crate::comm::World`] does it for
/// every group it hands out once given [`FaultInjector::wrapper`]).
pub struct FaultInjector {
    rank: usize,
    mode: FaultMode,
    clock: StepClock,
    state: Mutex<State>,
}

impl FaultInjector {
    /// An injector for global rank `rank` reading steps from `clock`.
    pub fn new(rank: usize, mode: FaultMode, clock: StepClock) -> Arc<Self> {
        Arc::new(FaultInjector {
            rank,
            mode,
            clock,
            state: Mutex::new(State {
                step: 0,
                next: 0,
                calls: Vec::new(),
                injection: None,
                held: Vec::new(),
            }),
        })
    }

    /// `group` with every call going through this injector.
    pub fn wrap(self: &Arc<Self>, group: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
        Arc::new(FaultyGroup {
            inner: group,
            injector: self.clone(),
        })
    }

    /// A wrapper for [`crate::comm::World::set_group_wrapper`]: every group the world hands
    /// out afterwards goes through this injector.
    pub fn wrapper(self: &Arc<Self>) -> crate::comm::GroupWrapper {
        let me = self.clone();
        Arc::new(move |group| me.wrap(group))
    }

    /// The calls so far and the fault's outcome.
    pub fn log(&self) -> FaultLog {
        let state = self.lock();
        FaultLog {
            rank: self.rank,
            calls: state.calls.clone(),
            injection: state.injection.clone(),
            state_hash: None,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update leaves the state whole, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether earlier results must be kept: a fault on this rank that reads them, its site
    /// still to come.
    fn keeps_history(&self, state: &State) -> bool {
        match &self.mode {
            FaultMode::Inject { site, kind } => {
                matches!(kind, FaultKind::Stale | FaultKind::WrongPeer)
                    && site.rank == self.rank
                    && state.step <= site.step
                    && state.injection.is_none()
            }
            FaultMode::Record => false,
        }
    }

    /// Numbers and logs a call; returns its record, the fault to apply to it (when it is the
    /// site and the fault applies) and whether its result must be kept.
    fn begin(&self, group: &dyn ProcessGroup, op: OpKind, args: &Args<'_>) -> Ticket {
        let step = self.clock.current();
        let mut state = self.lock();
        if step != state.step {
            state.step = step;
            state.next = 0;
        }
        let call = CallRecord {
            step,
            index: state.next,
            rank: self.rank,
            op,
            group: group.name().to_owned(),
            group_rank: group.rank(),
            group_size: group.size(),
            peer: args.peer,
            shape: args.target.size(),
            dtype: dtype_name(args.target.kind()),
        };
        state.next += 1;
        let mut fault = None;
        if let FaultMode::Inject { site, kind } = &self.mode {
            if *site == call.site() && state.injection.is_none() {
                match applicability(*kind, &call, &state.calls) {
                    Ok(()) => fault = Some(*kind),
                    Err(reason) => {
                        state.injection = Some(Injection::NotApplicable {
                            call: call.clone(),
                            reason,
                        })
                    }
                }
            }
        }
        let keep = self.keeps_history(&state) && fault.is_none();
        state.calls.push(call.clone());
        Ticket { call, fault, keep }
    }

    /// Records the fault's outcome.
    fn outcome(&self, injection: Injection) {
        self.lock().injection = Some(injection);
    }

    /// Keeps `value` (a copy) as `call`'s result for later stale reads.
    fn hold(&self, call: &CallRecord, value: &Tensor) -> Result<(), CommError> {
        let value = value.f_detach_copy()?;
        let mut state = self.lock();
        state.held.retain(|h| {
            !(stale_source(call, &h.call) && h.call.op == call.op && h.call.peer == call.peer)
        });
        state.held.push(Held {
            call: call.clone(),
            value,
        });
        Ok(())
    }

    /// The newest kept result that can stand in for `call`'s under `kind`.
    fn held_for(&self, kind: FaultKind, call: &CallRecord) -> Option<(CallRecord, Tensor)> {
        let state = self.lock();
        state
            .held
            .iter()
            .rev()
            .find(|h| match kind {
                FaultKind::WrongPeer => wrong_peer_source(call, &h.call),
                _ => stale_source(call, &h.call),
            })
            .map(|h| (h.call.clone(), h.value.shallow_clone()))
    }
}

/// The dtype's short name (as [`DType`] prints it), or libtorch's for the others.
fn dtype_name(kind: Kind) -> String {
    DType::from_kind(kind).map_or_else(|_| format!("{kind:?}"), |d| d.to_string())
}

/// What [`FaultInjector::begin`] decided for one call.
struct Ticket {
    call: CallRecord,
    fault: Option<FaultKind>,
    keep: bool,
}

/// The tensors of one call, as a fault sees them.
struct Args<'a> {
    /// The tensor a fault alters (see [`CallRecord::shape`]).
    target: &'a Tensor,
    /// A reduce-scatter's input (its chunks are what [`FaultKind::PermutedChunks`] swaps).
    input: Option<&'a Tensor>,
    peer: Option<usize>,
    /// An all-to-all's output splits (rows per source rank); empty means equal.
    splits: &'a [usize],
}

impl<'a> Args<'a> {
    /// The arguments of a call whose only tensor of interest is `target`.
    fn of(target: &'a Tensor) -> Self {
        Args {
            target,
            input: None,
            peer: None,
            splits: &[],
        }
    }
}
