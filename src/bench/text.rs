//! The benchmarks' figures as the terminal shows them (`--json` prints the results
//! themselves): one renderer per `lockstep bench` mode, apart from the command line.

use super::{CommPoint, ParallelStepResult, PipelineBenchResult, SpawnResult, StepResult};
use lockstep_harness::report::plural;
use std::fmt::Write as _;

/// `bench comm`: one row per (collective, size).
pub fn comm_table(points: &[CommPoint]) -> String {
    let mut out = format!(
        "{:<15} {:>12} {:>6} {:>12} {:>12} {:>12}\n",
        "op", "bytes", "world", "latency", "algbw GB/s", "busbw GB/s"
    );
    for p in points {
        let _ = writeln!(
            out,
            "{:<15} {:>12} {:>6} {:>12} {:>12.3} {:>12.3}",
            p.op,
            p.bytes,
            p.world_size,
            format_seconds(p.seconds),
            p.algbw_gbps,
            p.busbw_gbps
        );
    }
    out
}

/// `bench spawn`: the launcher's start-up cost, one line.
pub fn spawn_line(r: &SpawnResult) -> String {
    format!(
        "spawn + rendezvous + first all_reduce, {} ({:?}): median {} (min {}, max {}, {})\n",
        plural(r.world_size, "rank"),
        r.mode,
        format_seconds(r.seconds),
        format_seconds(r.min_seconds),
        format_seconds(r.max_seconds),
        plural(r.repeats, "run")
    )
}

/// `bench pipeline`: step times and the measured bubble against the simulated ones.
pub fn pipeline_table(r: &PipelineBenchResult) -> String {
    let mut out = format!(
        "pipeline {} p={} v={} m={}, benchmark decoder ({} parameters), median of {}\n",
        r.schedule,
        r.stages,
        r.virtual_stages,
        r.microbatches,
        r.parameters,
        plural(r.steps, "step")
    );
    let differs = |d: f64| format!("measured differs by {:.1}%", 100.0 * d);
    let rows = [
        (
            "step time, pipeline",
            format_seconds(r.pipeline_seconds),
            String::new(),
        ),
        (
            "step time, one process on one core",
            format_seconds(r.single_seconds),
            String::new(),
        ),
        (
            "ratio pipeline / one process",
            format!("{:.2}", r.ratio),
            String::new(),
        ),
        (
            "bubble, measured",
            format!("{:.3}", r.measured_bubble),
            String::new(),
        ),
        (
            "bubble, simulated (unit costs)",
            format!("{:.3}", r.simulated_bubble),
            differs(r.bubble_relative_difference_unit_costs),
        ),
        (
            "bubble, simulated (measured costs)",
            format!("{:.3}", r.simulated_bubble_measured_costs),
            differs(r.bubble_relative_difference),
        ),
    ];
    for (what, value, note) in rows {
        let line = format!("  {what:<36} {value:>10}  {note}");
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// `bench step` under DDP and FSDP: one line.
pub fn step_line(r: &StepResult) -> String {
    format!(
        "one training step, {} ({} parameters), {} ranks, median of {}: ddp {}, fsdp full_shard \
         (root unit) {} ({:.2}x ddp), fsdp full_shard per layer {} ({:.2}x ddp)\n",
        r.model,
        r.parameters,
        r.world_size,
        r.steps,
        format_seconds(r.ddp_seconds),
        format_seconds(r.fsdp_seconds),
        r.ratio,
        format_seconds(r.fsdp_per_layer_seconds),
        r.per_layer_ratio
    )
}

/// `bench step --parallel tp|ep`: one row per configuration.
pub fn parallel_step_table(r: &ParallelStepResult) -> String {
    let mut out = format!(
        "one training step, {} ({} parameters), {}, median of {}; bytes and calls per step on rank 0\n",
        r.model,
        r.parameters,
        plural(r.world_size, "rank"),
        plural(r.steps, "step")
    );
    let _ = writeln!(
        out,
        "  {:<8} {:>10} {:>8} {:>12} {:>8}",
        "config", "step", "vs ddp", "bytes/step", "calls"
    );
    for run in &r.runs {
        let _ = writeln!(
            out,
            "  {:<8} {:>10} {:>7.2}x {:>12} {:>8.1}",
            run.config,
            format_seconds(run.seconds),
            run.ratio,
            format_bytes(run.bytes_per_step),
            run.calls_per_step
        );
    }
    out
}

/// Bytes in binary units (KiB, MiB) to three significant places.
pub fn format_bytes(b: f64) -> String {
    if b < 1024.0 {
        format!("{b:.0} B")
    } else if b < 1024.0 * 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

/// Seconds in the unit that reads best (µs, ms, s).
pub fn format_seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} us", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}
