//! Actions from PyTorch's text notation (`[stage][label][microbatch]`, e.g. `2F0`,
//! `1UNSHARD`, `3SEND_F1`), apart from the IR's types so the error type can name actions
//! without the IR depending back on it.

use super::error::ScheduleError;
use super::ir::{Action, ActionKind};
use std::str::FromStr;

impl FromStr for Action {
    type Err = ScheduleError;

    /// Parses PyTorch's `[stage][label][microbatch]`, e.g. `2F0`, `1UNSHARD`, `3SEND_F1`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let s = text.trim();
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return Err(ScheduleError::parse(
                text,
                "an action starts with its stage index, e.g. `0F1`",
            ));
        }
        let stage: usize = s[..digits]
            .parse()
            .map_err(|_| ScheduleError::parse(text, "the stage index is too large"))?;
        let rest = &s[digits..];
        if rest.starts_with("OVERLAP_F_B") || rest.starts_with('(') {
            return Err(ScheduleError::parse(
                text,
                "OVERLAP_F_B is not supported: list its F and B as two actions",
            ));
        }
        // Longest label first, so `SEND_F` is not read as something shorter.
        let mut kinds = ActionKind::ALL;
        kinds.sort_by_key(|k| std::cmp::Reverse(k.label().len()));
        let kind = kinds
            .into_iter()
            .find(|k| rest.starts_with(k.label()))
            .ok_or_else(|| {
                ScheduleError::parse(
                    text,
                    "unknown action label; expected one of F, B, I, W, SEND_F, RECV_F, SEND_B, \
                     RECV_B, UNSHARD, RESHARD, REDUCE_GRAD",
                )
            })?;
        let tail = &rest[kind.label().len()..];
        if !tail.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ScheduleError::parse(
                text,
                format!("`{tail}` after {kind} is not a microbatch index"),
            ));
        }
        let microbatch = match (kind.has_microbatch(), tail.is_empty()) {
            (true, true) => {
                return Err(ScheduleError::parse(
                    text,
                    format!("{kind} needs a microbatch index, e.g. `{stage}{kind}0`"),
                ))
            }
            (false, false) => {
                return Err(ScheduleError::parse(
                    text,
                    format!("{kind} takes no microbatch index"),
                ))
            }
            (true, false) => Some(
                tail.parse()
                    .map_err(|_| ScheduleError::parse(text, "the microbatch index is too large"))?,
            ),
            (false, true) => None,
        };
        Ok(Action {
            stage,
            kind,
            microbatch,
        })
    }
}
