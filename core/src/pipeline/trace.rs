//! Measured timelines of real pipeline runs: every action's begin and end on every rank, as
//! Chrome-trace JSON (one track per rank; open in `chrome://tracing` or Perfetto), and the
//! bubble fraction they show.

use serde::{Deserialize, Serialize};

/// One executed action on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// The action in PyTorch's notation (`1F3`, `0SEND_B2`).
    pub action: String,
    /// F, B, I or W (communication otherwise).
    pub compute: bool,
    /// Wall-clock microseconds since the Unix epoch (ranks on one host share the clock).
    pub begin_us: u64,
    /// How long the action took, in microseconds.
    pub duration_us: u64,
}

/// One rank's events over one step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStepTrace {
    /// The global rank that recorded the events.
    pub rank: usize,
    /// The training step, 0-based.
    pub step: usize,
    /// The rank's actions in the order they began.
    pub events: Vec<TraceEvent>,
}

/// Chrome's trace-event format: complete (`X`) events, `pid` 0, `tid` the rank, times in
/// microseconds from the earliest event; thread-name metadata labels each track `rank N`.
pub fn chrome_trace(traces: &[RankStepTrace]) -> serde_json::Value {
    let origin = traces
        .iter()
        .flat_map(|t| t.events.iter().map(|e| e.begin_us))
        .min()
        .unwrap_or(0);
    let mut events = Vec::new();
    let mut ranks: Vec<usize> = traces.iter().map(|t| t.rank).collect();
    ranks.sort_unstable();
    ranks.dedup();
    for r in &ranks {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": r,
            "args": { "name": format!("rank {r}") }
        }));
    }
    for t in traces {
        for e in &t.events {
            events.push(serde_json::json!({
                "name": e.action,
                "cat": if e.compute { "compute" } else { "comm" },
                "ph": "X",
                "pid": 0,
                "tid": t.rank,
                "ts": e.begin_us - origin,
                "dur": e.duration_us,
                "args": { "step": t.step },
            }));
        }
    }
    serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" })
}

/// The measured bubble of one step: per rank, the time not spent computing between the
/// step's first begin and last end over every rank, summed, over ranks × that span.
pub fn measured_bubble(step: &[&RankStepTrace]) -> Option<f64> {
    let begin = step
        .iter()
        .flat_map(|t| t.events.iter().map(|e| e.begin_us))
        .min()?;
    let end = step
        .iter()
        .flat_map(|t| t.events.iter().map(|e| e.begin_us + e.duration_us))
        .max()?;
    let span = end.saturating_sub(begin) as f64;
    if span <= 0.0 || step.is_empty() {
        return None;
    }
    let busy: f64 = step
        .iter()
        .flat_map(|t| {
            t.events
                .iter()
                .filter(|e| e.compute)
                .map(|e| e.duration_us as f64)
        })
        .sum();
    Some(1.0 - busy / (span * step.len() as f64))
}
