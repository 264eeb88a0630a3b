//! `lockstep matrix` end to end through the built binary (exit codes, messages, the report
//! set on disk), plus the library's name matching and planning.

use lockstep::harness::report::{read_json, SCHEMA_VERSION};
use lockstep::matrix::{self, Config, MatrixError, MatrixOptions};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A fresh directory under the system temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lockstep-matrix-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn lockstep(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run the lockstep binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn matrix_into(out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["matrix", "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    lockstep(&args)
}

#[test]
fn small_matrix_passes_and_writes_every_report() {
    let scratch = Scratch::new("small");
    let out = scratch.0.join("reports");
    let run = matrix_into(
        &out,
        &[
            "--models",
            "nested,mlp",
            "--configs",
            "single,ddp",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(
        run.code,
        Some(0),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    for row in [
        "single@2  single@2",
        "ddp@2     single@2",
        "ddp@2     ddp@2",
    ] {
        assert!(
            run.stdout.contains(row),
            "no `{row}` row in:\n{}",
            run.stdout
        );
    }
    assert!(run.stdout.contains("matrix: 8 runs in "), "{}", run.stdout);
    assert!(!run.stdout.contains("FAIL"), "{}", run.stdout);

    for file in matrix::REPORT_FILES {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    let raw: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(raw["schema_version"], SCHEMA_VERSION);
    let report = read_json(&out.join("report.json")).unwrap();
    assert!(report.passed());
    assert!(report.wall_time_seconds.is_some_and(|s| s > 0.0));
    // Per model: single vs single, ddp vs single, ddp vs ddp.
    assert_eq!(report.comparisons.len(), 6);
    let keys: Vec<(&str, &str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.model.as_str(), c.config.as_str(), c.reference.as_str()))
        .collect();
    assert!(keys.contains(&("mlp", "ddp@2", "single@2")));
    assert!(keys.contains(&("nested", "ddp@2", "ddp@2")));
    assert_eq!(report.steps.len(), 6 * 2);
    let junit = std::fs::read_to_string(out.join("junit.xml")).unwrap();
    assert!(junit.contains("<testsuite"), "{junit}");
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("ddp@2"), "{md}");
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("<html"), "{}", &html[..html.len().min(200)]);
}

#[test]
fn models_without_a_single_reference_get_ddp_rows_and_a_reason() {
    let scratch = Scratch::new("moe");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "moe",
            "--configs",
            "ddp*",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .contains("no single-device reference: its expert"),
        "{}",
        run.stdout
    );
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let keys: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    assert_eq!(keys, [("ddp@2", "ddp@2")]);
}

#[test]
fn list_prints_configs_and_models() {
    let run = lockstep(&["matrix", "--list"]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(run.stdout.contains("configs:"), "{}", run.stdout);
    for config in Config::ALL {
        assert!(
            run.stdout.contains(&format!("  {:<8}", config.name())),
            "{}",
            run.stdout
        );
    }
    for fsdp in [
        "fsdp.full_shard ",
        "fsdp.shard_grad_op ",
        "fsdp.no_shard ",
        "fsdp.full_shard.per_layer ",
    ] {
        assert!(run.stdout.contains(fsdp), "{fsdp} missing:\n{}", run.stdout);
    }
    assert!(run.stdout.contains("models:"), "{}", run.stdout);
    for model in lockstep::models::zoo::names() {
        assert!(
            run.stdout.contains(model),
            "{model} missing:\n{}",
            run.stdout
        );
    }
    assert!(
        run.stdout
            .contains("ddp + fsdp only (no single-device reference"),
        "{}",
        run.stdout
    );
}

/// Runs a matrix that must be refused, and checks the refusal: exit 2, the message names the
/// problem, and nothing that looks like a report is left in the output directory.
fn refused(extra: &[&str], out: &Path, expect: &[&str]) {
    let run = matrix_into(out, extra);
    assert_eq!(
        run.code,
        Some(2),
        "stdout:\n{}\nstderr:\n{}",
        run.stdout,
        run.stderr
    );
    for text in expect {
        assert!(
            run.stderr.contains(text),
            "`{text}` not in stderr:\n{}",
            run.stderr
        );
    }
    assert!(!out.join("report.json").exists(), "report.json was written");
}

#[test]
fn unknown_model_is_refused_with_the_known_names() {
    let scratch = Scratch::new("unknown-model");
    refused(
        &["--models", "nested,resnet"],
        &scratch.0,
        &["unknown model `resnet`", "nested", "gpt_moe"],
    );
}

#[test]
fn unknown_config_is_refused_with_the_known_names() {
    let scratch = Scratch::new("unknown-config");
    refused(
        &["--configs", "fsdp"],
        &scratch.0,
        &["unknown config `fsdp`", "single, ddp"],
    );
}

#[test]
fn world_size_zero_and_too_large_are_refused() {
    let scratch = Scratch::new("world");
    refused(
        &["--world-size", "2,0"],
        &scratch.0,
        &["invalid world size 0"],
    );
    refused(
        &["--world-size", "1000"],
        &scratch.0,
        &["invalid world size 1000"],
    );
}

#[test]
fn unwritable_out_dir_is_refused_before_running() {
    let scratch = Scratch::new("unwritable");
    let file = scratch.0.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    let out = file.join("reports");
    let run = matrix_into(&out, &["--models", "nested", "--world-size", "2"]);
    assert_eq!(run.code, Some(2), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stderr.contains("output directory") && run.stderr.contains("a-file"),
        "{}",
        run.stderr
    );
    // Refused before any run: no progress lines, no table.
    assert!(!run.stderr.contains("[1/"), "{}", run.stderr);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(!out.exists());
}

#[test]
fn stale_reports_are_removed_before_running() {
    let scratch = Scratch::new("stale");
    let stale = scratch.0.join("report.json");
    std::fs::write(&stale, b"{\"stale\": true}").unwrap();
    matrix::prepare_out_dir(&scratch.0).unwrap();
    assert!(!stale.exists());
    assert!(scratch.0.is_dir());
}

#[test]
fn patterns_match_exactly_or_by_glob() {
    assert!(matrix::matches("ddp", "ddp"));
    assert!(!matrix::matches("dd", "ddp"));
    assert!(matrix::matches("ddp*", "ddp"));
    assert!(matrix::matches("gpt*", "gpt_moe"));
    assert!(matrix::matches("*moe", "gpt_moe"));
    assert!(matrix::matches("*", "nested"));
    assert!(matrix::matches("t*_*n", "transformer_bn"));
    assert!(!matrix::matches("t*_*x", "transformer_bn"));
}

#[test]
fn plan_selects_expands_and_counts_runs() {
    let plan = matrix::plan(&MatrixOptions {
        models: vec!["gpt*".into(), "moe".into()],
        world_sizes: vec![2, 4, 2],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(plan.models, ["moe", "gpt", "gpt_moe"]);
    assert_eq!(plan.world_sizes, [2, 4]);
    assert_eq!(plan.configs, Config::ALL);
    // gpt and gpt_moe: 2 single + 2 ddp + 4 fsdp per world size; moe: 2 ddp + 4 fsdp.
    assert_eq!(plan.run_count(), 2 * (8 + 8 + 6));

    let fsdp_only = matrix::plan(&MatrixOptions {
        models: vec!["nested".into(), "moe".into()],
        configs: vec!["fsdp.*".into()],
        world_sizes: vec![2],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(fsdp_only.configs, Config::FSDP);
    // nested: 1 single + 1 ddp reference + 4 fsdp; moe: 1 ddp + 4 fsdp.
    assert_eq!(fsdp_only.run_count(), 6 + 5);

    let ddp_only = matrix::plan(&MatrixOptions {
        models: vec!["nested".into()],
        configs: vec!["ddp".into()],
        ..MatrixOptions::default()
    })
    .unwrap();
    assert_eq!(ddp_only.world_sizes, [matrix::DEFAULT_WORLD_SIZE]);
    // The single-device reference still runs once: ddp is compared against it.
    assert_eq!(ddp_only.run_count(), 3);

    let err = matrix::plan(&MatrixOptions {
        steps: 0,
        ..MatrixOptions::default()
    })
    .unwrap_err();
    assert!(matches!(err, MatrixError::InvalidOption(_)), "{err}");
}

#[test]
fn fsdp_configs_match_ddp_bitwise_and_single_within_tolerance() {
    let scratch = Scratch::new("fsdp");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested,mlp",
            "--configs",
            "fsdp.*",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    // Per model: one single-device and one DDP reference run, four FSDP launches.
    assert!(run.stdout.contains("matrix: 12 runs in "), "{}", run.stdout);
    assert!(!run.stdout.contains("FAIL"), "{}", run.stdout);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(report.passed());
    let keys: Vec<(&str, &str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.model.as_str(), c.config.as_str(), c.reference.as_str()))
        .collect();
    assert_eq!(keys.len(), 2 * 4 * 2, "{keys:?}");
    for model in ["nested", "mlp"] {
        for config in [
            "fsdp.full_shard@2",
            "fsdp.shard_grad_op@2",
            "fsdp.no_shard@2",
            "fsdp.full_shard.per_layer@2",
        ] {
            assert!(keys.contains(&(model, config, "ddp@2")), "{keys:?}");
            assert!(keys.contains(&(model, config, "single@2")), "{keys:?}");
            assert!(
                run.stdout.contains(&format!("{config} ")),
                "no {config} row:\n{}",
                run.stdout
            );
        }
    }
    // Against DDP the rows are bitwise: zero error everywhere.
    for c in report.comparisons.iter().filter(|c| c.reference == "ddp@2") {
        assert_eq!(c.overall().max_abs_err, 0.0, "{} {}", c.model, c.config);
    }
}

#[test]
fn fsdp_on_moe_is_checked_against_ddp_only() {
    let scratch = Scratch::new("fsdp-moe");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "moe",
            "--configs",
            "fsdp.full_shard,fsdp.no_shard",
            "--world-size",
            "2",
            "--steps",
            "2",
        ],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    let keys: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    assert_eq!(
        keys,
        [("fsdp.full_shard@2", "ddp@2"), ("fsdp.no_shard@2", "ddp@2")]
    );
}

#[test]
fn a_planted_divisor_bug_fails_the_matrix_with_a_report() {
    let scratch = Scratch::new("fault");
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--configs",
            "ddp",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--fault",
            "sum",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("FAIL nested ddp@2 vs single@2"),
        "{}",
        run.stdout
    );
    let report = read_json(&scratch.0.join("report.json")).unwrap();
    assert!(!report.passed());
    let failed: Vec<(&str, &str)> = report
        .comparisons
        .iter()
        .filter(|c| !c.passed)
        .map(|c| (c.config.as_str(), c.reference.as_str()))
        .collect();
    // Both DDP runs carry the bug, so only the single-device reference exposes it.
    assert_eq!(failed, [("ddp@2", "single@2")]);
}

#[test]
fn failed_runs_leave_no_report_behind() {
    let scratch = Scratch::new("timeout");
    std::fs::write(scratch.0.join("report.json"), b"{}").unwrap();
    // No launch finishes in a microsecond: every DDP run times out.
    let run = matrix_into(
        &scratch.0,
        &[
            "--models",
            "nested",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--timeout",
            "0.000001",
        ],
    );
    assert_eq!(run.code, Some(1), "{}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("ERROR"), "{}", run.stdout);
    assert!(run.stdout.contains("timed out"), "{}", run.stdout);
    assert!(
        run.stderr.contains("runs failed; no report was written"),
        "{}",
        run.stderr
    );
    for file in matrix::REPORT_FILES {
        assert!(!scratch.0.join(file).exists(), "{file} left behind");
    }
}
