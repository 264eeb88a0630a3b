//! One rank's action list as a schedule's order builds it: the builder the orders of
//! [`super::loop_orders`] and [`super::v_orders`] share, apart from the generator that picks
//! among them.

use super::ir::{Action, ActionKind};
use std::collections::HashMap;

/// One rank's action list under construction: hands out each stage's next microbatch per
/// counter (F; B and I share one, as both produce the input gradient; W), so every order
/// runs microbatches in increasing order by construction.
#[derive(Default)]
pub(super) struct RankOps {
    pub(super) actions: Vec<Action>,
    next: HashMap<(usize, u8), usize>,
}

impl RankOps {
    /// Appends `kind` on `stage` for the stage's next microbatch of that counter.
    pub(super) fn push(&mut self, stage: usize, kind: ActionKind) -> usize {
        let slot = self.next.entry((stage, Self::counter(kind))).or_insert(0);
        let mb = *slot;
        *slot += 1;
        self.actions.push(Action::mb(stage, kind, mb));
        mb
    }

    /// How many actions of `kind`'s counter `stage` has had so far.
    pub(super) fn count(&self, stage: usize, kind: ActionKind) -> usize {
        self.next
            .get(&(stage, Self::counter(kind)))
            .copied()
            .unwrap_or(0)
    }

    fn counter(kind: ActionKind) -> u8 {
        match kind {
            ActionKind::Forward => 0,
            ActionKind::FullBackward | ActionKind::BackwardInput => 1,
            _ => 2,
        }
    }
}
