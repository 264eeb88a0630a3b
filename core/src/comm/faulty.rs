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

use crate::comm::{CommError, Completion, DType, OpKind, ProcessGroup, ReduceOp, Work};
use crate::consistency::StepClock;
use serde::{Deserialize, Serialize};
use std::sync::{Arc, Mutex, PoisonError};
use tch::{Kind, Tensor};

/// How a faulted call's result goes wrong. Each is a bug a real implementation has had.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The call's result is dropped: the rank keeps what its tensor held before (a missed
    /// synchronization). A send cannot be skipped without leaving its receiver waiting, so
    /// sends are not skipped.
    Skip,
    /// The result is doubled (a sum where an average was meant, a reduction applied twice).
    Double,
    /// The result is all zeros (a buffer never filled, a wrong output tensor).
    Zero,
    /// Another rank's contribution stands where this one's belongs: an all-gather's or
    /// all-to-all's chunks rotated by one rank, a broadcast from root + 1 (on the one rank
    /// that holds that tensor), a receive answered by an earlier message from another peer.
    WrongPeer,
    /// Chunks in a swapped order: the first two chunks of an all-gather's or all-to-all's
    /// output exchanged, or of the input this rank contributes to a reduce-scatter.
    PermutedChunks,
    /// The result of the previous call on the same group with the same shape and dtype
    /// (last step's gradients, an earlier microbatch's activations).
    Stale,
    /// The result's largest-magnitude element multiplied by `1 + ε`: the smallest error a
    /// test can be asked to see.
    Perturb(f64),
    /// The result rounded through bfloat16 (a reduction run in low precision).
    Bf16Reduction,
}

impl FaultKind {
    /// The faults that change the mathematics (as opposed to the rounding, which
    /// [`FaultKind::Perturb`] and [`FaultKind::Bf16Reduction`] model): every parity test
    /// must catch these at every site where they change something.
    pub const MATH_CHANGING: [FaultKind; 6] = [
        FaultKind::Skip,
        FaultKind::Double,
        FaultKind::Zero,
        FaultKind::WrongPeer,
        FaultKind::PermutedChunks,
        FaultKind::Stale,
    ];

    /// Every kind, with `eps` for the perturbation.
    pub fn all(eps: f64) -> Vec<FaultKind> {
        let mut all = Self::MATH_CHANGING.to_vec();
        all.push(FaultKind::Perturb(eps));
        all.push(FaultKind::Bf16Reduction);
        all
    }

    /// The kind's name without its parameter (`perturb` for every ε), for table columns.
    pub fn label(&self) -> &'static str {
        match self {
            FaultKind::Skip => "skip",
            FaultKind::Double => "double",
            FaultKind::Zero => "zero",
            FaultKind::WrongPeer => "wrong_peer",
            FaultKind::PermutedChunks => "permuted",
            FaultKind::Stale => "stale",
            FaultKind::Perturb(_) => "perturb",
            FaultKind::Bf16Reduction => "bf16",
        }
    }

    /// Whether this is one of [`FaultKind::MATH_CHANGING`].
    pub fn changes_math(&self) -> bool {
        Self::MATH_CHANGING.contains(self)
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultKind::Perturb(eps) => write!(f, "perturb={eps:e}"),
            other => f.write_str(other.label()),
        }
    }
}

impl std::str::FromStr for FaultKind {
    type Err = String;
    /// `skip`, `double`, `zero`, `wrong_peer`, `permuted`, `stale`, `bf16`, `perturb=EPS`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(eps) = s.strip_prefix("perturb=") {
            return match eps.parse::<f64>() {
                Ok(e) if e.is_finite() && e != 0.0 => Ok(FaultKind::Perturb(e)),
                _ => Err(format!(
                    "perturb={eps}: ε must be a finite, non-zero number"
                )),
            };
        }
        Self::all(1e-3)
            .into_iter()
            .find(|k| k.label() == s && !matches!(k, FaultKind::Perturb(_)))
            .ok_or_else(|| {
                format!(
                    "unknown fault `{s}`; known: skip, double, zero, wrong_peer, permuted, \
                     stale, bf16, perturb=EPS"
                )
            })
    }
}

/// Where a fault goes: one call of one rank (see the module documentation for the numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FaultSite {
    /// The training step the rank's loop was in when it issued the call.
    pub step: usize,
    /// The call's position among this rank's data-carrying calls of that step, from 0.
    pub index: usize,
    /// The global rank that issued it.
    pub rank: usize,
}

impl std::fmt::Display for FaultSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {} call {} rank {}",
            self.step, self.index, self.rank
        )
    }
}

/// What an injector does with the calls it sees.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FaultMode {
    /// Alter nothing; log every call (the dry run that enumerates the sites).
    Record,
    /// Alter the call at `site` with `kind`; log every call too.
    Inject {
        /// The call to corrupt.
        site: FaultSite,
        /// How.
        kind: FaultKind,
    },
}

/// One data-carrying call as a rank issued it: enough to name a site in a table and to decide
/// whether a fault applies to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The step the loop was in.
    pub step: usize,
    /// Its position in the step on this rank (see [`FaultSite::index`]).
    pub index: usize,
    /// The issuing global rank.
    pub rank: usize,
    /// The operation.
    pub op: OpKind,
    /// The group's name (`world`, `dp[0,2]`, `pp-edge[0,1]`).
    pub group: String,
    /// This rank's rank in the group.
    pub group_rank: usize,
    /// The group's size.
    pub group_size: usize,
    /// The broadcast root, the send's destination or the receive's source (group ranks).
    pub peer: Option<usize>,
    /// Shape of the tensor a fault alters: the in-place tensor of an all-reduce, broadcast,
    /// send or receive; the output of an all-gather, reduce-scatter or all-to-all.
    pub shape: Vec<i64>,
    /// Its element type (`f32`, `i64`, …).
    pub dtype: String,
}

impl CallRecord {
    /// The site this call is.
    pub fn site(&self) -> FaultSite {
        FaultSite {
            step: self.step,
            index: self.index,
            rank: self.rank,
        }
    }

    /// Elements of the altered tensor.
    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// A short description: `all_reduce world [719] f32`, with the peer for point to point
    /// and broadcast.
    pub fn describe(&self) -> String {
        let peer = match (self.op, self.peer) {
            (OpKind::Broadcast, Some(p)) => format!(" root {p}"),
            (OpKind::Send, Some(p)) => format!(" to {p}"),
            (OpKind::Recv, Some(p)) => format!(" from {p}"),
            _ => String::new(),
        };
        format!(
            "{} {}{peer} {:?} {}",
            self.op, self.group, self.shape, self.dtype
        )
    }

    fn is_float(&self) -> bool {
        matches!(self.dtype.as_str(), "f32" | "f64" | "bf16" | "f16")
    }

    /// Whether `other` is the same call in content (a site found again in another run).
    pub fn same_call(&self, other: &CallRecord) -> bool {
        self.op == other.op
            && self.group == other.group
            && self.shape == other.shape
            && self.dtype == other.dtype
            && self.peer == other.peer
    }
}

/// Whether `kind` can alter `call`, given the calls this rank issued before it (`earlier`, in
/// order): `Err` says why not. The injector decides by this at run time; a planner can decide
/// by it on a recorded log and skip runs that could not inject anything.
pub fn applicability(
    kind: FaultKind,
    call: &CallRecord,
    earlier: &[CallRecord],
) -> Result<(), String> {
    if call.numel() == 0 {
        return Err("the tensor is empty".into());
    }
    let chunked = matches!(
        call.op,
        OpKind::AllGather | OpKind::AllToAll | OpKind::ReduceScatter
    );
    match kind {
        FaultKind::Skip if call.op == OpKind::Send => Err(
            "a send has no local result, and not sending would leave its receiver waiting".into(),
        ),
        FaultKind::Skip | FaultKind::Zero => Ok(()),
        FaultKind::Double if call.dtype == "bool" => Err("a bool tensor cannot double".into()),
        FaultKind::Double => Ok(()),
        FaultKind::Perturb(_) | FaultKind::Bf16Reduction if !call.is_float() => {
            Err(format!("{} is not a floating-point type", call.dtype))
        }
        FaultKind::Bf16Reduction if call.dtype == "bf16" => {
            Err("the result is bf16 already".into())
        }
        FaultKind::Perturb(_) | FaultKind::Bf16Reduction => Ok(()),
        FaultKind::PermutedChunks | FaultKind::WrongPeer if chunked && call.group_size < 2 => {
            Err("a group of one rank has one chunk".into())
        }
        FaultKind::PermutedChunks if chunked => Ok(()),
        FaultKind::PermutedChunks => Err(format!("{} has no chunks to permute", call.op)),
        FaultKind::WrongPeer => match call.op {
            OpKind::AllGather | OpKind::AllToAll => Ok(()),
            OpKind::Broadcast => {
                let root = call.peer.unwrap_or(0);
                if call.group_size > 1
                    && call.group_rank != root
                    && call.group_rank == (root + 1) % call.group_size
                {
                    Ok(())
                } else {
                    Err(format!(
                        "only group rank {} holds root + 1's tensor",
                        (root + 1) % call.group_size.max(1)
                    ))
                }
            }
            OpKind::Recv => {
                if earlier.iter().any(|e| wrong_peer_source(call, e)) {
                    Ok(())
                } else {
                    Err("no message of this shape came from another peer on this group".into())
                }
            }
            OpKind::Send => Err("a send's peer is for its receiver to mistake".into()),
            op => Err(format!(
                "{op} combines every rank: there is no peer to mistake"
            )),
        },
        FaultKind::Stale => {
            if earlier.iter().any(|e| stale_source(call, e)) {
                Ok(())
            } else {
                Err("no earlier call on this group had this shape and dtype".into())
            }
        }
    }
}

/// Whether `earlier`'s tensor can stand in for `call`'s as a stale result.
fn stale_source(call: &CallRecord, earlier: &CallRecord) -> bool {
    earlier.group == call.group && earlier.shape == call.shape && earlier.dtype == call.dtype
}

/// Whether `earlier` is a receive from another peer that can answer `call` (a receive).
fn wrong_peer_source(call: &CallRecord, earlier: &CallRecord) -> bool {
    earlier.op == OpKind::Recv && earlier.peer != call.peer && stale_source(call, earlier)
}

/// What became of the fault an injector was asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Injection {
    /// The call's result was altered.
    Applied {
        /// The call.
        call: CallRecord,
        /// What changed (the perturbed element, the stale source, …).
        detail: String,
    },
    /// The fault applied but left every bit as it was (doubling zeros, skipping a broadcast
    /// on its root): nothing for a test to catch.
    NoChange {
        /// The call.
        call: CallRecord,
    },
    /// The fault cannot apply to this call ([`applicability`]'s reason).
    NotApplicable {
        /// The call.
        call: CallRecord,
        /// Why.
        reason: String,
    },
}

impl Injection {
    /// The call the fault was aimed at.
    pub fn call(&self) -> &CallRecord {
        match self {
            Injection::Applied { call, .. }
            | Injection::NoChange { call }
            | Injection::NotApplicable { call, .. } => call,
        }
    }
}

/// Everything one rank's injector saw: its calls in order and the fate of its fault.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultLog {
    /// The global rank.
    pub rank: usize,
    /// Every data-carrying call, in issue order.
    pub calls: Vec<CallRecord>,
    /// The injected fault's outcome: `None` in record mode, or when the site never came (on
    /// this rank, or at all).
    pub injection: Option<Injection>,
    /// A hash of the state this rank ended the run with, when the launcher adds one: two runs
    /// whose ranks all hash equal trained to the same bits, so a fault that changed none of
    /// them had no effect on the training.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_hash: Option<u64>,
}

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

/// A [`ProcessGroup`] that runs every call on the group it wraps and, at its injector's site,
/// alters the result afterwards (see the module documentation).
pub struct FaultyGroup {
    inner: Arc<dyn ProcessGroup>,
    injector: Arc<FaultInjector>,
}

impl FaultyGroup {
    /// `inner` wrapped by `injector` (usually through [`FaultInjector::wrap`]).
    pub fn new(inner: Arc<dyn ProcessGroup>, injector: Arc<FaultInjector>) -> Self {
        FaultyGroup { inner, injector }
    }

    /// The wrapped group.
    pub fn inner(&self) -> &Arc<dyn ProcessGroup> {
        &self.inner
    }

    /// Runs one call: numbers it, prepares the fault (a saved copy, a replaced input), issues
    /// it through `issue` (given the input to use in place of the caller's, if any), and
    /// arranges for the fault to be applied once the call completes.
    fn call(
        &self,
        op: OpKind,
        args: Args<'_>,
        issue: &dyn Fn(Option<&Tensor>) -> Result<Work, CommError>,
    ) -> Result<Work, CommError> {
        let ticket = self.injector.begin(self.inner.as_ref(), op, &args);
        if ticket.fault.is_none() && !ticket.keep {
            return issue(None);
        }
        let prepared = tch::no_grad(|| self.prepare(&ticket, &args))?;
        let work = issue(prepared.replacement.as_ref())?;
        let pending = Pending {
            injector: self.injector.clone(),
            ticket,
            target: args.target.shallow_clone(),
            saved: prepared.saved,
            replacement: prepared.replacement,
            splits: args.splits.to_vec(),
            input_changed: prepared.input_changed,
        };
        if work.is_completed() {
            work.wait()?;
            pending.finish()?;
            return Ok(Work::done(Ok(())));
        }
        Ok(Work::new(Arc::new(Faulted {
            work,
            pending: Mutex::new(Some(pending)),
            outcome: Mutex::new(None),
        })))
    }

    /// What must happen before the call is issued.
    fn prepare(&self, ticket: &Ticket, args: &Args<'_>) -> Result<Prepared, CommError> {
        let mut prepared = Prepared::default();
        let Some(kind) = ticket.fault else {
            if ticket.call.op == OpKind::Send {
                // A send's result is what it hands over: kept as the call is issued.
                self.injector.hold(&ticket.call, args.target)?;
            }
            return Ok(prepared);
        };
        let op = ticket.call.op;
        if matches!(kind, FaultKind::Skip)
            || (kind == FaultKind::WrongPeer && op == OpKind::Broadcast)
        {
            prepared.saved = Some(args.target.f_detach_copy()?);
        }
        if op == OpKind::Send {
            let payload = alter(&self.injector, kind, &ticket.call, args.target, None, &[])?;
            prepared.input_changed = Some(!same_bits(&payload.value, args.target)?);
            prepared.replacement = Some(payload.value);
        } else if op == OpKind::ReduceScatter && kind == FaultKind::PermutedChunks {
            if let Some(input) = args.input {
                let n = ticket.call.group_size as i64;
                let permuted = swap_first_chunks(input, n)?;
                prepared.input_changed = Some(!same_bits(&permuted, input)?);
                prepared.replacement = Some(permuted);
            }
        }
        Ok(prepared)
    }
}

/// What [`FaultyGroup::prepare`] set up.
#[derive(Default)]
struct Prepared {
    /// The target's contents before the call (restored by a skip).
    saved: Option<Tensor>,
    /// The input issued in place of the caller's (a send's altered payload, a reduce-scatter's
    /// permuted input); kept alive until the call completes.
    replacement: Option<Tensor>,
    /// For faults realised on the input side: whether the input actually changed.
    input_changed: Option<bool>,
}

/// A call issued, its fault still to apply.
struct Pending {
    injector: Arc<FaultInjector>,
    ticket: Ticket,
    target: Tensor,
    saved: Option<Tensor>,
    replacement: Option<Tensor>,
    splits: Vec<usize>,
    input_changed: Option<bool>,
}

impl Pending {
    /// Applies the fault to the completed call's result (or keeps the result for later
    /// stale reads) and records the outcome.
    fn finish(self) -> Result<(), CommError> {
        tch::no_grad(|| self.finish_inner())
    }

    fn finish_inner(self) -> Result<(), CommError> {
        let call = &self.ticket.call;
        let Some(kind) = self.ticket.fault else {
            if self.ticket.keep && call.op != OpKind::Send {
                self.injector.hold(call, &self.target)?;
            }
            return Ok(());
        };
        if let Some(changed) = self.input_changed {
            // Realised on the input side (a send's payload, a reduce-scatter's chunk order).
            drop(self.replacement);
            self.injector.outcome(if changed {
                Injection::Applied {
                    call: call.clone(),
                    detail: format!("{kind} on the input this rank handed over"),
                }
            } else {
                Injection::NoChange { call: call.clone() }
            });
            return Ok(());
        }
        let altered = alter(
            &self.injector,
            kind,
            call,
            &self.target,
            self.saved.as_ref(),
            &self.splits,
        )?;
        let changed = !same_bits(&altered.value, &self.target)?;
        let injection = if changed {
            let mut target = self.target.shallow_clone();
            target.f_copy_(&altered.value)?;
            Injection::Applied {
                call: call.clone(),
                detail: altered.detail,
            }
        } else {
            Injection::NoChange { call: call.clone() }
        };
        self.injector.outcome(injection);
        Ok(())
    }
}

/// A fault's result: the tensor that replaces the call's, and what changed.
struct Altered {
    value: Tensor,
    detail: String,
}

/// The value `kind` makes of `current` (the call's completed result; for a send, its
/// payload). `saved` is the target's content before the call.
fn alter(
    injector: &FaultInjector,
    kind: FaultKind,
    call: &CallRecord,
    current: &Tensor,
    saved: Option<&Tensor>,
    splits: &[usize],
) -> Result<Altered, CommError> {
    let current = current.f_detach()?;
    let n = call.group_size as i64;
    let missing = |what: &str| CommError::Failed(format!("fault {kind}: {what} was not kept"));
    let (value, detail) = match kind {
        FaultKind::Skip => (
            saved
                .ok_or_else(|| missing("the tensor before the call"))?
                .f_detach_copy()?,
            "the call's result dropped".to_owned(),
        ),
        FaultKind::Double => (current.f_mul_scalar(2)?, "the result doubled".to_owned()),
        FaultKind::Zero => (current.f_zeros_like()?, "the result zeroed".to_owned()),
        FaultKind::Bf16Reduction => (
            current
                .f_to_kind(Kind::BFloat16)?
                .f_to_kind(current.kind())?,
            "the result rounded through bf16".to_owned(),
        ),
        FaultKind::Perturb(eps) => perturbed(&current, eps)?,
        FaultKind::Stale => held(injector, kind, call)?,
        FaultKind::WrongPeer if call.op == OpKind::Recv => held(injector, kind, call)?,
        FaultKind::WrongPeer if call.op == OpKind::Broadcast => (
            saved
                .ok_or_else(|| missing("this rank's own tensor"))?
                .f_detach_copy()?,
            "root + 1's tensor (this rank's own) kept".to_owned(),
        ),
        FaultKind::WrongPeer => (
            reorder(&current, n, splits, |i| (i + 1) % n as usize)?,
            "chunks rotated by one rank".to_owned(),
        ),
        FaultKind::PermutedChunks => (
            reorder(&current, n, splits, |i| match i {
                0 => 1,
                1 => 0,
                i => i,
            })?,
            "the first two chunks swapped".to_owned(),
        ),
    };
    Ok(Altered { value, detail })
}

/// The kept result that stands in for `call`'s under `kind` (stale, or another peer's).
fn held(
    injector: &FaultInjector,
    kind: FaultKind,
    call: &CallRecord,
) -> Result<(Tensor, String), CommError> {
    let (source, value) = injector.held_for(kind, call).ok_or_else(|| {
        CommError::Failed(format!(
            "fault {kind}: no earlier result of this shape was kept"
        ))
    })?;
    let detail = format!(
        "the result of step {} call {} ({}) instead",
        source.step,
        source.index,
        source.describe()
    );
    Ok((value, detail))
}

/// `current` with its largest-magnitude element multiplied by `1 + eps`.
fn perturbed(current: &Tensor, eps: f64) -> Result<(Tensor, String), CommError> {
    let flat = current.f_reshape([-1])?.f_detach_copy()?;
    let at = flat.f_abs()?.f_argmax(None, false)?.f_int64_value(&[])?;
    let before = flat.f_double_value(&[at])?;
    // Computed in f64 and rounded once into the tensor's dtype: an ε below half an ULP of
    // the element leaves it as it was (reported as no change).
    let _ = flat.f_narrow(0, at, 1)?.f_fill_(before * (1.0 + eps))?;
    let after = flat.f_double_value(&[at])?;
    Ok((
        flat.f_reshape(current.size())?,
        format!("element {at} multiplied by 1 + {eps:e}: {before:e} -> {after:e}"),
    ))
}

/// `current`'s chunks (rows of dim 0 by `splits`, or `n` equal parts of its elements when no
/// splits are given) reassembled with chunk `order(i)` at position `i`.
fn reorder(
    current: &Tensor,
    n: i64,
    splits: &[usize],
    order: impl Fn(usize) -> usize,
) -> Result<Tensor, CommError> {
    let (source, lengths) = if splits.is_empty() {
        let flat = current.f_reshape([-1])?;
        let len = flat.size()[0] / n.max(1);
        (flat, vec![len; n as usize])
    } else {
        let rows: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        (current.shallow_clone(), rows)
    };
    let starts: Vec<i64> = lengths
        .iter()
        .scan(0, |at, &l| {
            let s = *at;
            *at += l;
            Some(s)
        })
        .collect();
    let chunks: Vec<Tensor> = (0..lengths.len())
        .map(|i| {
            let j = order(i).min(lengths.len() - 1);
            source.f_narrow(0, starts[j], lengths[j])
        })
        .collect::<Result<_, _>>()?;
    Ok(Tensor::f_cat(&chunks, 0)?.f_reshape(current.size())?)
}

/// `input` with its first two of `n` equal chunks (of its elements) exchanged.
fn swap_first_chunks(input: &Tensor, n: i64) -> Result<Tensor, CommError> {
    reorder(&input.f_detach()?, n, &[], |i| match i {
        0 => 1,
        1 => 0,
        i => i,
    })
}

/// Whether two tensors hold the same bits (shape, dtype and every byte).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool, CommError> {
    if a.size() != b.size() || a.kind() != b.kind() {
        return Ok(false);
    }
    let bytes = |t: &Tensor| -> Result<Vec<u8>, CommError> {
        let host = t
            .f_detach()?
            .f_to_device(tch::Device::Cpu)?
            .f_contiguous()?;
        let numel = host.numel();
        let mut out = vec![0u8; numel * host.kind().elt_size_in_bytes()];
        host.f_copy_data_u8(&mut out, numel)?;
        Ok(out)
    };
    Ok(bytes(a)? == bytes(b)?)
}

/// An asynchronous call whose fault is applied when it is first waited on (or seen complete).
struct Faulted {
    work: Work,
    pending: Mutex<Option<Pending>>,
    outcome: Mutex<Option<Result<(), String>>>,
}

impl Faulted {
    /// Applies the pending fault once, after the wrapped work finished.
    fn settle(&self, finished: Result<(), CommError>) -> Result<(), CommError> {
        let pending = self
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let mut outcome = self.outcome.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = pending {
            let result = finished.and_then(|()| p.finish());
            *outcome = Some(result.as_ref().map(drop).map_err(ToString::to_string));
            return result;
        }
        match outcome.as_ref() {
            Some(Err(e)) => Err(CommError::Failed(e.clone())),
            _ => Ok(()),
        }
    }
}

impl Completion for Faulted {
    fn wait(&self) -> Result<(), CommError> {
        let finished = self.work.wait();
        self.settle(finished)
    }

    fn is_completed(&self) -> bool {
        if !self.work.is_completed() {
            return false;
        }
        // Done on the wire: apply the fault now, so a caller that polls sees the final value.
        let _ = self.settle(self.work.wait());
        true
    }
}

/// A blocking call's completion for [`FaultyGroup::call`].
fn done() -> Result<Work, CommError> {
    Ok(Work::done(Ok(())))
}

impl ProcessGroup for FaultyGroup {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn global_ranks(&self) -> &[usize] {
        self.inner.global_ranks()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work, CommError> {
        let args = Args::of(tensor);
        self.call(OpKind::AllReduce, args, &|_| {
            self.inner.all_reduce_async(tensor, op)
        })
    }
    fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, CommError> {
        self.call(OpKind::AllGather, Args::of(output), &|_| {
            self.inner.all_gather_async(output, input)
        })
    }
    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let args = Args {
            input: Some(input),
            ..Args::of(output)
        };
        self.call(OpKind::ReduceScatter, args, &|replaced| {
            self.inner
                .reduce_scatter_async(output, replaced.unwrap_or(input), op)
        })
    }
    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work, CommError> {
        let args = Args {
            peer: Some(root),
            ..Args::of(tensor)
        };
        self.call(OpKind::Broadcast, args, &|_| {
            self.inner.broadcast_async(tensor, root)
        })
    }
    fn all_to_all_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work, CommError> {
        let args = Args {
            splits: output_splits,
            ..Args::of(output)
        };
        self.call(OpKind::AllToAll, args, &|_| {
            self.inner
                .all_to_all_async(output, input, output_splits, input_splits)
        })
    }
    fn send_async(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<Work, CommError> {
        let args = Args {
            peer: Some(dst),
            ..Args::of(tensor)
        };
        self.call(OpKind::Send, args, &|replaced| {
            self.inner.send_async(replaced.unwrap_or(tensor), dst, tag)
        })
    }
    fn recv_async(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<Work, CommError> {
        let args = Args {
            peer: Some(src),
            ..Args::of(tensor)
        };
        self.call(OpKind::Recv, args, &|_| {
            self.inner.recv_async(tensor, src, tag)
        })
    }
    fn barrier_async(&self) -> Result<Work, CommError> {
        self.inner.barrier_async()
    }

    // The blocking forms go to the wrapped group's own blocking forms (a backend may
    // implement them apart from the asynchronous ones), then apply the fault.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<(), CommError> {
        self.call(OpKind::AllReduce, Args::of(tensor), &|_| {
            self.inner.all_reduce(tensor, op).and_then(|()| done())
        })?
        .wait()
    }
    fn all_gather(&self, output: &Tensor, input: &Tensor) -> Result<(), CommError> {
        self.call(OpKind::AllGather, Args::of(output), &|_| {
            self.inner.all_gather(output, input).and_then(|()| done())
        })?
        .wait()
    }
    fn reduce_scatter(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let args = Args {
            input: Some(input),
            ..Args::of(output)
        };
        self.call(OpKind::ReduceScatter, args, &|replaced| {
            self.inner
                .reduce_scatter(output, replaced.unwrap_or(input), op)
                .and_then(|()| done())
        })?
        .wait()
    }
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<(), CommError> {
        let args = Args {
            peer: Some(root),
            ..Args::of(tensor)
        };
        self.call(OpKind::Broadcast, args, &|_| {
            self.inner.broadcast(tensor, root).and_then(|()| done())
        })?
        .wait()
    }
    fn all_to_all(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<(), CommError> {
        let args = Args {
            splits: output_splits,
            ..Args::of(output)
        };
        self.call(OpKind::AllToAll, args, &|_| {
            self.inner
                .all_to_all(output, input, output_splits, input_splits)
                .and_then(|()| done())
        })?
        .wait()
    }
    fn send(&self, tensor: &Tensor, dst: usize, tag: u64) -> Result<(), CommError> {
        let args = Args {
            peer: Some(dst),
            ..Args::of(tensor)
        };
        self.call(OpKind::Send, args, &|replaced| {
            self.inner
                .send(replaced.unwrap_or(tensor), dst, tag)
                .and_then(|()| done())
        })?
        .wait()
    }
    fn recv(&self, tensor: &Tensor, src: usize, tag: u64) -> Result<(), CommError> {
        let args = Args {
            peer: Some(src),
            ..Args::of(tensor)
        };
        self.call(OpKind::Recv, args, &|_| {
            self.inner.recv(tensor, src, tag).and_then(|()| done())
        })?
        .wait()
    }
    fn barrier(&self) -> Result<(), CommError> {
        self.inner.barrier()
    }
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
