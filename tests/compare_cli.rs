//! `lockstep compare` end to end: the built binary's table and exit code.

use lockstep::harness::parity::{compare, TolerancePolicy};
use lockstep::harness::report::{write_json, Report};
use lockstep_core::comm::DType;
use lockstep_core::record::{NamedTensor, RunRecord, RunSpec};
use std::path::{Path, PathBuf};
use std::process::Command;

fn report_with_error(err: f64) -> Report {
    let record = |config: &str, w: f64| RunRecord {
        spec: RunSpec {
            model: "nested".into(),
            config: config.into(),
            world_size: 2,
            backend: "cpu".into(),
            dtype: "fp32".into(),
            steps: 1,
            seed: 0,
        },
        losses: vec![1.0],
        grad_norms: vec![1.0],
        params: vec![NamedTensor {
            name: "w".into(),
            dtype: DType::F32,
            shape: vec![1],
            values: vec![w],
        }],
        buffers: vec![],
        grads: None,
        memory: None,
        collectives: None,
        routing_min_gap: None,
        tokens_dropped: None,
        placements: Vec::new(),
        cross_rank: None,
    };
    let policy = TolerancePolicy::dtype_table(DType::F32);
    Report::new(vec![compare(
        &record("ddp", err),
        &record("single", 0.0),
        &policy,
    )])
}

/// A fresh directory under the target's temp dir, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("lockstep-compare-{name}-{}", std::process::id()));
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

fn run(base: &Path, new: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .arg("compare")
        .arg(base)
        .arg(new)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn compare_exit_code_follows_regressions() {
    let dir = Scratch::new("cli");
    let base = dir.0.join("base.json");
    let grown = dir.0.join("grown.json");
    write_json(&report_with_error(1e-8), &base).unwrap();
    write_json(&report_with_error(1e-6), &grown).unwrap();

    let (code, stdout) = run(&base, &base, &[]);
    assert_eq!(code, Some(0), "{stdout}");
    assert!(stdout.contains("no regression"), "{stdout}");

    let (code, stdout) = run(&base, &grown, &[]);
    assert_eq!(code, Some(1), "{stdout}");
    assert!(
        stdout.contains("GREW") && stdout.contains("ddp"),
        "{stdout}"
    );

    let (code, stdout) = run(&base, &grown, &["--factor", "1000"]);
    assert_eq!(code, Some(0), "{stdout}");

    let (code, _) = run(&base, &dir.0.join("missing.json"), &[]);
    assert_eq!(
        code,
        Some(2),
        "an unreadable report is an error, not a regression"
    );
}

/// A report of one TP-like run (`fc0.weight` [4, 2], `fc1.weight` [1, 4], per-step gradients,
/// 2 steps) against its reference. With `bug`, the run lost an all-reduce in its backward:
/// `fc0.weight`'s gradient at step 0 is off in one element, which shows in that step's
/// gradient norm and in the final value, not in the loss.
fn tp_report(bug: bool) -> Report {
    let tensor = |name: &str, shape: &[i64], values: Vec<f64>| NamedTensor {
        name: name.into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        values,
    };
    let record = |config: &str, bug: bool| {
        let off = |v: f64, by: f64| if bug { v + by } else { v };
        let grads = (0..2)
            .map(|s| {
                let mut fc0 = vec![0.5; 8];
                if s == 0 {
                    fc0[7] = off(0.5, -0.25);
                }
                vec![
                    tensor("fc0.weight", &[4, 2], fc0),
                    tensor("fc1.weight", &[1, 4], vec![0.125; 4]),
                ]
            })
            .collect();
        let mut fc0 = vec![1.0; 8];
        fc0[7] = off(1.0, 0.25);
        RunRecord {
            spec: RunSpec {
                model: "mlp".into(),
                config: config.into(),
                world_size: 2,
                backend: "cpu".into(),
                dtype: "fp32".into(),
                steps: 2,
                seed: 0,
            },
            losses: vec![2.0, 1.5],
            grad_norms: vec![off(3.668, -0.243), 3.1],
            params: vec![
                tensor("fc0.weight", &[4, 2], fc0),
                tensor("fc1.weight", &[1, 4], vec![1.0; 4]),
            ],
            buffers: vec![],
            grads: Some(grads),
            memory: None,
            collectives: None,
            routing_min_gap: None,
            tokens_dropped: None,
            placements: Vec::new(),
            cross_rank: None,
        }
    };
    let policy = TolerancePolicy::dtype_table(DType::F32);
    Report::new(vec![compare(
        &record("tp.2@2", bug),
        &record("single@2", false),
        &policy,
    )])
}

#[test]
fn compare_lists_each_regressed_quantity_without_a_factor_from_zero() {
    let dir = Scratch::new("quantities");
    let (good, buggy) = (dir.0.join("good.json"), dir.0.join("buggy.json"));
    write_json(&tp_report(false), &good).unwrap();
    write_json(&tp_report(true), &buggy).unwrap();
    let (code, stdout) = run(&good, &buggy, &[]);
    assert_eq!(code, Some(1), "{stdout}");
    // Every quantity that regressed has its own line: the gradient norm and the culprit
    // tensor's gradient and final value; the loss and the healthy tensor did not move.
    for what in [
        "grad_norm",
        "gradient of `fc0.weight`",
        "final value of `fc0.weight`",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.contains(what))
            .unwrap_or_else(|| panic!("no line for {what}:\n{stdout}"));
        // Their base errors were exactly 0: no growth factor exists, only "new".
        assert!(line.contains("new (was 0)"), "{line}\n{stdout}");
    }
    assert!(!stdout.contains("fc1.weight"), "{stdout}");
    assert!(
        !stdout
            .lines()
            .any(|l| l.starts_with("  ") && l.contains("loss")),
        "{stdout}"
    );
    // No growth factor anywhere: every base was zero.
    assert!(
        !stdout
            .split_whitespace()
            .any(|w| w.ends_with('x') && w.starts_with(|c: char| c.is_ascii_digit())),
        "a growth factor from a zero base:\n{stdout}"
    );
    assert!(stdout.contains("CROSSED TOLERANCE"), "{stdout}");
}
