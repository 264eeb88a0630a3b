//! What building, checking or simulating a schedule can fail with. Every message names the
//! rank, the action (in PyTorch's notation) and the rule, so a failing plan can be fixed
//! without reading the schedule by hand.

use super::ir::Action;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Everything a schedule can be rejected for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// A built-in schedule cannot be generated for this (ranks, virtual stages,
    /// microbatches): `rule` says which of the schedule's rules is broken.
    #[error("{schedule} {rule}")]
    InvalidConfig {
        /// The schedule's name (`interleaved_1f1b`).
        schedule: String,
        /// The broken rule, with the offending numbers.
        rule: String,
    },
    /// Text (an action, a schedule name, a CSV row) that does not parse.
    #[error("cannot parse `{text}`: {reason}")]
    Parse {
        /// The text as given.
        text: String,
        /// What was expected instead.
        reason: String,
    },
    /// The schedule breaks a rule of the IR (placement, exactly-once, ordering, matching
    /// sends and receives).
    #[error("invalid schedule: {0}")]
    Invalid(String),
    /// A receive would take a message meant for another microbatch: channels deliver in
    /// send order, so the data would land in the wrong microbatch.
    #[error(
        "rank {rank}: {action} would receive the message of {sent} (rank {sender}) on the \
         {channel} channel, which delivers in send order"
    )]
    Mismatch {
        /// The receiving rank.
        rank: usize,
        /// The receive (`1RECV_F0`).
        action: Action,
        /// The send whose message is at the head of the channel.
        sent: Action,
        /// The rank that sent it.
        sender: usize,
        /// Direction and edge (`forward 0→1`).
        channel: String,
    },
    /// No rank can advance, yet some have actions left.
    #[error("deadlock: {}", join_waits(.waits))]
    Deadlock {
        /// Every blocked rank, in rank order.
        waits: Vec<Wait>,
    },
}

/// One blocked rank in a deadlock: where it stopped and what it waits for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wait {
    /// The blocked rank.
    pub rank: usize,
    /// The action the rank cannot start.
    pub at: Action,
    /// The action that has not run (or whose message never arrived).
    pub waits_for: Action,
    /// The rank `waits_for` belongs to.
    pub on_rank: usize,
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} waits at {} for {} (rank {})",
            self.rank, self.at, self.waits_for, self.on_rank
        )
    }
}

fn join_waits(waits: &[Wait]) -> String {
    waits
        .iter()
        .map(Wait::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl ScheduleError {
    /// Shorthand for [`ScheduleError::InvalidConfig`].
    pub(crate) fn config(schedule: &str, rule: impl Into<String>) -> Self {
        ScheduleError::InvalidConfig {
            schedule: schedule.to_owned(),
            rule: rule.into(),
        }
    }

    /// Shorthand for [`ScheduleError::Parse`].
    pub(crate) fn parse(text: &str, reason: impl Into<String>) -> Self {
        ScheduleError::Parse {
            text: text.to_owned(),
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::ir::ActionKind;
    use super::*;

    #[test]
    fn deadlock_names_every_wait() {
        let a = |stage, kind, mb| Action::new(stage, kind, Some(mb));
        let e = ScheduleError::Deadlock {
            waits: vec![
                Wait {
                    rank: 0,
                    at: a(0, ActionKind::RecvB, 3),
                    waits_for: a(1, ActionKind::SendB, 3),
                    on_rank: 1,
                },
                Wait {
                    rank: 1,
                    at: a(1, ActionKind::RecvF, 4),
                    waits_for: a(0, ActionKind::SendF, 4),
                    on_rank: 0,
                },
            ],
        };
        assert_eq!(
            e.to_string(),
            "deadlock: rank 0 waits at 0RECV_B3 for 1SEND_B3 (rank 1); rank 1 waits at \
             1RECV_F4 for 0SEND_F4 (rank 0)"
        );
    }
}
