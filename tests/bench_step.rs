//! `bench step` through the library with a tiny decoder: the result's shape, never its speed.

use lockstep::bench::{self, GptDims, StepBenchOptions};

#[test]
fn step_bench_reports_both_wrappers_and_the_ratio() {
    let r = bench::run_step(&StepBenchOptions {
        world_size: 2,
        model: "gpt".into(),
        dims: GptDims::TINY,
        steps: 2,
    })
    .unwrap();
    let json = serde_json::to_value(&r).unwrap();
    for field in [
        "model",
        "world_size",
        "ddp_seconds",
        "fsdp_seconds",
        "ratio",
        "fsdp_per_layer_seconds",
        "per_layer_ratio",
    ] {
        assert!(json.get(field).is_some(), "{field} missing: {json}");
    }
    assert_eq!(json["model"], "gpt");
    assert_eq!(json["world_size"], 2);
    let ddp = json["ddp_seconds"].as_f64().unwrap();
    let fsdp = json["fsdp_seconds"].as_f64().unwrap();
    let ratio = json["ratio"].as_f64().unwrap();
    assert!(ddp > 0.0 && fsdp > 0.0, "{json}");
    assert!(
        (ratio - fsdp / ddp).abs() <= 1e-12 * ratio.abs().max(1.0),
        "{json}"
    );
    assert!(r.parameters > 0);
}

#[test]
fn step_bench_runs_zoo_models_and_refuses_bad_options() {
    let r = bench::run_step(&StepBenchOptions {
        world_size: 2,
        model: "nested".into(),
        steps: 1,
        ..StepBenchOptions::default()
    })
    .unwrap();
    assert_eq!(r.model, "nested");
    assert!(r.ddp_seconds > 0.0 && r.fsdp_seconds > 0.0);

    for bad in [
        StepBenchOptions {
            world_size: 1,
            ..StepBenchOptions::default()
        },
        StepBenchOptions {
            model: "nope".into(),
            ..StepBenchOptions::default()
        },
        StepBenchOptions {
            steps: 0,
            ..StepBenchOptions::default()
        },
    ] {
        let err = bench::run_step(&bad).unwrap_err();
        assert!(matches!(err, bench::BenchError::Invalid(_)), "{err}");
    }
}
