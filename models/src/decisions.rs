//! Discrete decisions (top-k routing) that the fp64 arbiter's shadow reference must take
//! exactly as the fp32 reference took them.
//!
//! The arbiter measures rounding: how far the fp32 reference is from the same training in
//! float64. A router whose two best experts are nearly tied may pick differently in float64,
//! and the shadow would then measure a different training, not rounding. So the fp32
//! reference runs under [`recording`], which keeps every choice, and its shadow runs under
//! [`replaying`] that tape, which makes the same choices (gates are still computed in float64
//! from the shadow's own probabilities). Outside both, [`topk`] is plain `topk`: parallel runs
//! decide for themselves, and a near-tie that flips a choice there shows as a failure, which
//! the tape's smallest gap ([`DecisionTape::min_gap`]) helps explain.

use std::cell::RefCell;
use std::collections::VecDeque;
use tch::{TchError, Tensor};

/// The choices one run made, in the order it made them.
#[derive(Debug, Default)]
pub struct DecisionTape {
    choices: VecDeque<Tensor>,
    /// The smallest gap between the last chosen and the best unchosen probability over every
    /// decision taken (`f64::INFINITY` when there were none or every expert was chosen).
    pub min_gap: f64,
    /// Whether a replay ran out of recorded choices (the runs took different paths).
    pub exhausted: bool,
}

impl DecisionTape {
    /// How many decisions are recorded.
    pub fn len(&self) -> usize {
        self.choices.len()
    }

    /// Whether no decision is recorded.
    pub fn is_empty(&self) -> bool {
        self.choices.is_empty()
    }
}

enum TapeMode {
    Off,
    Record(DecisionTape),
    Replay(DecisionTape),
}

thread_local! {
    static TAPE: RefCell<TapeMode> = const { RefCell::new(TapeMode::Off) };
}

/// Puts `mode` on this thread's tape and gives the previous one back when dropped, so a
/// panic inside a recording or a replay cannot leave later `topk` calls replaying stale
/// choices.
struct TapeGuard {
    previous: Option<TapeMode>,
}

impl TapeGuard {
    fn install(mode: TapeMode) -> TapeGuard {
        TapeGuard {
            previous: Some(TAPE.with(|t| t.replace(mode))),
        }
    }

    /// Restores the previous mode and returns the tape this guard's mode ended with.
    fn finish(mut self) -> DecisionTape {
        let previous = self.previous.take().unwrap_or(TapeMode::Off);
        match TAPE.with(|t| t.replace(previous)) {
            TapeMode::Record(tape) | TapeMode::Replay(tape) => tape,
            TapeMode::Off => DecisionTape::default(),
        }
    }
}

impl Drop for TapeGuard {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            TAPE.with(|t| t.replace(previous));
        }
    }
}

/// Runs `f`, recording every [`topk`] decision it takes on this thread.
pub fn recording<R>(f: impl FnOnce() -> R) -> (R, DecisionTape) {
    let guard = TapeGuard::install(TapeMode::Record(DecisionTape {
        min_gap: f64::INFINITY,
        ..DecisionTape::default()
    }));
    let out = f();
    (out, guard.finish())
}

/// Runs `f`, making every [`topk`] decision as `tape` recorded it; returns what is left of the
/// tape (empty when both runs took the same decisions; `exhausted` when the replay asked for
/// more, or for one of another shape).
pub fn replaying<R>(tape: DecisionTape, f: impl FnOnce() -> R) -> (R, DecisionTape) {
    let guard = TapeGuard::install(TapeMode::Replay(tape));
    let out = f();
    (out, guard.finish())
}

/// The `k` largest of `probs` along the last dimension, highest first, with their indices
/// (`topk(k, -1, largest, sorted)`), or the recorded choice under [`replaying`].
pub fn topk(probs: &Tensor, k: i64) -> Result<(Tensor, Tensor), TchError> {
    let mut expected = probs.size();
    if let Some(last) = expected.last_mut() {
        *last = k;
    }
    let replayed = TAPE.with(|t| match &mut *t.borrow_mut() {
        TapeMode::Replay(tape) => match tape.choices.pop_front() {
            Some(idx) if idx.size() == expected => Some(Some(idx)),
            _ => {
                // Out of choices, or a decision of another shape: the runs took different
                // paths. Decide afresh and let the caller refuse the shadow.
                tape.exhausted = true;
                Some(None)
            }
        },
        _ => None,
    });
    if let Some(Some(idx)) = replayed {
        let idx = idx.f_to_device(probs.device())?;
        return Ok((probs.f_gather(-1, &idx, false)?, idx));
    }
    let (top, idx) = probs.f_topk(k, -1, true, true)?;
    TAPE.with(|t| -> Result<(), TchError> {
        if let TapeMode::Record(tape) = &mut *t.borrow_mut() {
            let experts = probs.size().last().copied().unwrap_or(0);
            if k < experts {
                let next = tch::no_grad(|| probs.f_topk(k + 1, -1, true, true))?.0;
                let gap = next
                    .f_narrow(-1, k - 1, 1)?
                    .f_sub(&next.f_narrow(-1, k, 1)?)?
                    .f_min()?
                    .f_double_value(&[])?;
                tape.min_gap = tape.min_gap.min(gap);
            }
            tape.choices.push_back(idx.f_detach_copy()?);
        }
        Ok(())
    })?;
    Ok((top, idx))
}

thread_local! {
    /// The capacity factor [`dropping`] set on this thread, and the choices dropped so far.
    static CAPACITY: RefCell<Option<(f64, usize)>> = const { RefCell::new(None) };
}

/// Runs `f` with token dropping at `capacity_factor` on this thread: every mixture that asks
/// [`kept`] drops the choices that overflow their expert, as an expert-parallel rank with that
/// factor does on its own tokens. Returns `f`'s result and how many (token, choice) pairs were
/// dropped. Dropping is a discrete decision taken from the choices alone, so a float64 shadow
/// replaying the choices ([`replaying`]) drops the same ones.
pub fn dropping<R>(capacity_factor: f64, f: impl FnOnce() -> R) -> (R, usize) {
    struct Restore(Option<(f64, usize)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            CAPACITY.with(|c| c.replace(self.0.take()));
        }
    }
    let restore = Restore(CAPACITY.with(|c| c.replace(Some((capacity_factor, 0)))));
    let out = f();
    let dropped = CAPACITY.with(|c| c.borrow().map_or(0, |(_, n)| n));
    drop(restore);
    (out, dropped)
}

/// Under [`dropping`], which of `choices` (`[..., k]` expert indices, tokens in row-major
/// order) fit their expert: a bool tensor of the same shape; `None` outside it (keep all).
///
/// The rule is GShard's and DeepSpeed's local capacity, written here apart from the expert-
/// parallel router so each checks the other: an expert takes `ceil(factor · tokens · k /
/// experts)` choices of this call's tokens; every token's first choice is served in token
/// order before any token's second, and so on.
pub fn kept(choices: &Tensor, num_experts: usize) -> Result<Option<Tensor>, TchError> {
    let Some((factor, _)) = CAPACITY.with(|c| *c.borrow()) else {
        return Ok(None);
    };
    let shape = choices.size();
    let k = shape.last().copied().unwrap_or(1).max(1) as usize;
    let flat: Vec<i64> = Vec::try_from(
        &choices
            .f_reshape([-1])?
            .f_to_device(tch::Device::Cpu)?
            .f_to_kind(tch::Kind::Int64)?,
    )?;
    let tokens = flat.len() / k;
    let slots = (factor * (tokens * k) as f64 / num_experts.max(1) as f64).ceil() as usize;
    let mut taken = vec![0usize; num_experts];
    let mut keep = vec![false; flat.len()];
    let mut dropped = 0;
    for rank_of_choice in 0..k {
        for token in 0..tokens {
            let at = token * k + rank_of_choice;
            let n = usize::try_from(flat[at])
                .ok()
                .and_then(|e| taken.get_mut(e))
                .ok_or_else(|| {
                    TchError::Shape(format!(
                        "routing choice {} is not one of {num_experts} experts",
                        flat[at]
                    ))
                })?;
            if *n < slots {
                *n += 1;
                keep[at] = true;
            } else {
                dropped += 1;
            }
        }
    }
    CAPACITY.with(|c| {
        if let Some((_, n)) = c.borrow_mut().as_mut() {
            *n += dropped;
        }
    });
    Ok(Some(
        Tensor::from_slice(&keep)
            .f_reshape(shape.as_slice())?
            .f_to_device(choices.device())?,
    ))
}
