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
