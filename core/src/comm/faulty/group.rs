//! [`FaultyGroup`]: the [`ProcessGroup`] wrapper that numbers each call through its
//! injector, issues it on the wrapped group, and applies the fault once the call completes
//! (at once for a blocking call, on the first wait or completed poll for an asynchronous one).
//!
//! Apart from the injector ([`super::FaultInjector`]), which only counts and logs, and from
//! the faults' arithmetic ([`super::alter`]).

use super::alter::{alter, same_bits, swap_first_chunks};
use super::kind::FaultKind;
use super::record::Injection;
use super::{Args, FaultInjector, Ticket};
use crate::comm::{CommError, Completion, OpKind, ProcessGroup, ReduceOp, Work};
use std::sync::{Arc, Mutex, PoisonError};
use tch::Tensor;

/// A [`ProcessGroup`] that runs every call on the group it wraps and, at its injector's site,
/// alters the result afterwards (see the [module documentation](super)).
pub struct FaultyGroup {
    pub(super) inner: Arc<dyn ProcessGroup>,
    pub(super) injector: Arc<FaultInjector>,
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
