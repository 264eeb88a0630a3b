//! `bench step` through the library with a tiny decoder: the result's shape, never its speed.
//! Run with `cargo nextest run --test bench_step` (each test launches ranks several times).

use lockstep::bench::{self, GptDims, StepBenchOptions, StepParallel};

#[test]
fn step_bench_reports_both_wrappers_and_the_ratio() {
    let r = bench::run_step(&StepBenchOptions {
        world_size: 2,
        model: "gpt".into(),
        dims: GptDims::TINY,
        steps: 2,
        ..StepBenchOptions::default()
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

/// `--parallel tp|ep` on the tiny decoder: DDP first, then the parallel configurations (TP with
/// and without SP; EP with the all-to-all dispatcher), every figure present and positive, and
/// DDP's bytes exactly one gradient all-reduce of every parameter plus the 8-byte loss average.
#[test]
fn parallel_step_reports_ddp_and_the_parallel_runs() {
    let cases: Vec<StepParallel> = vec![StepParallel::Tp, StepParallel::Ep];
    crate::common::each_case(
        "parallel_step_reports_ddp_and_the_parallel_runs",
        cases,
        |&parallel: &StepParallel| {
            let r = bench::run_parallel_step(&StepBenchOptions {
                world_size: 2,
                model: "gpt".into(),
                dims: GptDims::TINY,
                steps: 2,
                parallel,
            })
            .unwrap();
            let json = serde_json::to_value(&r).unwrap();
            for field in [
                "model",
                "parallel",
                "world_size",
                "parameters",
                "steps",
                "runs",
            ] {
                assert!(json.get(field).is_some(), "{field} missing: {json}");
            }
            let (model, name, configs) = match parallel {
                StepParallel::Tp => ("gpt", "tp", vec!["ddp", "tp", "tp+sp"]),
                _ => ("gpt_moe", "ep", vec!["ddp", "ep"]),
            };
            assert_eq!(json["model"], model);
            assert_eq!(json["parallel"], name);
            assert_eq!(json["world_size"], 2);
            assert_eq!(json["steps"], 2);
            let runs = json["runs"].as_array().unwrap();
            let got: Vec<&str> = runs.iter().map(|r| r["config"].as_str().unwrap()).collect();
            assert_eq!(got, configs, "{json}");
            for run in runs {
                for field in ["seconds", "ratio", "bytes_per_step", "calls_per_step"] {
                    let v = run[field].as_f64().unwrap_or(-1.0);
                    assert!(v > 0.0 && v.is_finite(), "{field}: {run}");
                }
                let listed: u64 = run["collectives"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| e["bytes"].as_u64().unwrap())
                    .sum();
                assert!(listed > 0, "{run}");
            }
            assert_eq!(runs[0]["ratio"].as_f64(), Some(1.0));
            let ddp = &r.runs[0];
            assert_eq!(ddp.bytes_per_step, (4 * r.parameters + 8) as f64, "{json}");
            assert!(r.parameters > 0);
        },
    );
}

/// Bad input is refused before any rank starts: a world of one, experts that ep does not
/// divide, heads that tp does not divide, a model the plan does not fit.
#[test]
fn parallel_step_refuses_bad_input() {
    let tiny = |parallel, world_size, model: &str| StepBenchOptions {
        world_size,
        model: model.into(),
        dims: GptDims::TINY,
        steps: 1,
        parallel,
    };
    for (opts, says) in [
        (tiny(StepParallel::Tp, 1, "gpt"), "--world-size 2 or more"),
        (tiny(StepParallel::Ep, 1, "gpt"), "--world-size 2 or more"),
        (tiny(StepParallel::Ep, 3, "gpt"), "4 experts do not divide"),
        (
            tiny(StepParallel::Tp, 3, "gpt"),
            "2 attention heads do not divide",
        ),
        (
            tiny(StepParallel::Ep, 2, "nested"),
            "no mixture-of-experts layer",
        ),
        (tiny(StepParallel::Tp, 2, "mlp"), "has no parallel plan"),
    ] {
        let err = bench::run_parallel_step(&opts).unwrap_err();
        assert!(matches!(err, bench::BenchError::Invalid(_)), "{err}");
        assert!(err.to_string().contains(says), "{err}");
    }
}

fn lockstep(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run the lockstep binary")
}

/// The command: bad input exits 2 with the reason, before any rank starts.
#[test]
fn the_command_exits_2_on_bad_input() {
    for (args, says) in [
        (
            vec!["--parallel", "tp", "--world-size", "1"],
            "--world-size 2",
        ),
        (
            vec!["--parallel", "ep", "--world-size", "3"],
            "8 experts do not divide",
        ),
        (
            vec!["--parallel", "tp", "--world-size", "3"],
            "8 attention heads do not divide",
        ),
    ] {
        let out = lockstep(&[&["bench", "step"], args.as_slice()].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
