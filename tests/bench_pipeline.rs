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
        assert!((0.0..=1.0).contains(&f), "{r:?}");
    }
    assert!(r.bubble_relative_difference.is_finite(), "{r:?}");
    assert!(r.bubble_relative_difference_unit_costs.is_finite(), "{r:?}");
    // 1F1B, p = 2, m = 4: (p-1)/(m+p-1) = 1/5 with unit costs.
    assert!((r.simulated_bubble - 0.2).abs() < 1e-12, "{r:?}");
    assert!(r.pipeline_seconds > 0.0 && r.single_seconds > 0.0);
    let text = std::fs::read_to_string(&trace).expect("trace written");
    let _ = std::fs::remove_file(&trace);
    let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let events = v["traceEvents"].as_array().expect("events");
    let mut tracks: Vec<i64> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .filter_map(|e| e["tid"].as_i64())
        .collect();
    tracks.sort_unstable();
    assert_eq!(tracks, [0, 1], "exactly one thread_name track per rank");
    for (rank, stage) in [(0, "0"), (1, "1")] {
        for kind in ["F", "B"] {
            let n = events
                .iter()
                .filter(|e| {
                    e["ph"] == "X"
                        && e["tid"] == rank
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

fn lockstep(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run the lockstep binary")
}

/// The command itself (the benchmark decoder at its CLI size, m = 4, one timed step): one JSON
/// object with every figure, bubbles as fractions.
#[test]
fn the_command_prints_one_json_object() {
    let out = lockstep(&[
        "bench",
        "pipeline",
        "--schedule",
        "1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--steps",
        "1",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    assert_eq!(v["schedule"], "1f1b");
    assert_eq!(v["stages"], 2);
    assert_eq!(v["microbatches"], 4);
    for field in [
        "pipeline_seconds",
        "single_seconds",
        "ratio",
        "measured_bubble",
        "simulated_bubble",
        "simulated_bubble_measured_costs",
        "bubble_relative_difference",
        "bubble_relative_difference_unit_costs",
    ] {
        assert!(v[field].as_f64().is_some(), "{field} missing: {v}");
    }
    for field in ["measured_bubble", "simulated_bubble"] {
        let f = v[field].as_f64().unwrap_or(-1.0);
        assert!((0.0..=1.0).contains(&f), "{field}: {v}");
    }
}

/// Bad input exits 2 with a message naming the problem, before any rank starts.
#[test]
fn bad_input_exits_2_with_a_clear_message() {
    for (args, says) in [
        (vec!["--schedule", "nope"], "unknown schedule"),
        (
            vec![
                "--schedule",
                "interleaved-1f1b",
                "--stages",
                "4",
                "--virtual",
                "4",
            ],
            "16 stages need at least 16 layers",
        ),
        (
            vec![
                "--schedule",
                "interleaved-1f1b",
                "--stages",
                "2",
                "--microbatches",
                "3",
            ],
            "multiple of ranks",
        ),
        (vec!["--microbatches", "0"], "at least one microbatch"),
    ] {
        let mut all = vec!["bench", "pipeline"];
        all.extend(args.iter().copied());
        let out = lockstep(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
