//! `lockstep bench pipeline` on a tiny decoder: it runs, its figures are fractions, and its
//! Chrome trace has one track per rank with every rank's F and B actions. Speed targets are
//! measured by the benchmark itself, never asserted here.

use lockstep::bench::{run_pipeline, GptDims, PipelineBenchOptions};

#[test]
fn pipeline_bench_reports_bubbles_and_writes_a_trace() {
    let trace =
        std::env::temp_dir().join(format!("lockstep-bench-trace-{}.json", std::process::id()));
    let r = run_pipeline(&PipelineBenchOptions {
        schedule: "1f1b".into(),
        stages: 2,
        microbatches: 4,
        virtual_stages: None,
        steps: 2,
        dims: GptDims::TINY,
        trace: Some(trace.clone()),
    })
    .expect("bench");
    for f in [
        r.measured_bubble,
        r.simulated_bubble,
        r.simulated_bubble_measured_costs,
    ] {
        assert!((0.0..1.0).contains(&f), "{r:?}");
    }
    // 1F1B, p = 2, m = 4: (p-1)/(m+p-1) = 1/5 with unit costs.
    assert!((r.simulated_bubble - 0.2).abs() < 1e-12, "{r:?}");
    assert!(r.pipeline_seconds > 0.0 && r.single_seconds > 0.0);
    let text = std::fs::read_to_string(&trace).expect("trace written");
    let _ = std::fs::remove_file(&trace);
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let events = v["traceEvents"].as_array().expect("events");
    let tracks: Vec<_> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert_eq!(tracks.len(), 2, "one track per rank");
    for (rank, stage) in [(0, "0"), (1, "1")] {
        for kind in ["F", "B"] {
            let n = events
                .iter()
                .filter(|e| {
                    e["tid"] == rank
                        && e["name"]
                            .as_str()
                            .is_some_and(|s| s.starts_with(&format!("{stage}{kind}")))
                })
                .count();
            // 4 microbatches in each of the 2 timed steps.
            assert_eq!(n, 8, "rank {rank} {stage}{kind}");
        }
    }
}

#[test]
fn a_bad_schedule_is_a_clear_error() {
    let e = run_pipeline(&PipelineBenchOptions {
        schedule: "nope".into(),
        dims: GptDims::TINY,
        ..PipelineBenchOptions::default()
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("1f1b"), "{e}");
}
