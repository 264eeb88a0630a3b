//! One pair, one verdict: `ParityTest` and `lockstep matrix` judge a configuration against a
//! reference through the same catalog row (`Config::policy_on`, the fp64 arbiter's envelope),
//! so the same runs get the same verdict, the same mode and the same errors from both.

use lockstep::parity_test::{ParityTest, Reference};
use lockstep_harness::report::Report;
use std::process::Command;

const CONFIGS: [&str; 5] = [
    "ddp",
    "fsdp.full_shard",
    "tp.2",
    "pp.1f1b",
    "fsdp.full_shard.bf16",
];

#[test]
fn parity_test_and_matrix_give_one_verdict() {
    let dir =
        Scratch(std::env::temp_dir().join(format!("lockstep-one-verdict-{}", std::process::id())));
    let mut test = ParityTest::new("one_verdict")
        .zoo("gpt")
        .reference(Reference::Single)
        .reference(Reference::Ddp)
        .world_sizes(&[2])
        .steps(2)
        .out_dir(dir.0.as_path().join("parity"));
    for config in CONFIGS {
        test = test.config(config);
    }
    let parity = test.run().expect("the parity test runs").report;

    let matrix_out = dir.0.as_path().join("matrix");
    let status = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["matrix", "--models", "gpt", "--configs", &CONFIGS.join(",")])
        .args(["--world-size", "2", "--steps", "2", "--out"])
        .arg(&matrix_out)
        .status()
        .expect("lockstep matrix starts");
    assert!(status.success(), "lockstep matrix failed: {status}");
    let bytes = std::fs::read(matrix_out.join("report.json")).expect("the matrix's report");
    let matrix: Report = serde_json::from_slice(&bytes).expect("a report");

    assert!(parity.errors.is_empty(), "{:?}", parity.errors);
    let mut compared = 0;
    for p in &parity.comparisons {
        // A configuration against itself is not a pair ParityTest forms.
        let Some(m) = matrix
            .comparisons
            .iter()
            .find(|m| m.config == p.config && m.reference == p.reference)
        else {
            continue;
        };
        let pair = format!("{} against {}", p.config, p.reference);
        assert_eq!(p.passed, m.passed, "{pair}: verdicts differ");
        assert_eq!(p.mode, m.mode, "{pair}: judged differently");
        assert_eq!(
            p.overall().max_abs_err,
            m.overall().max_abs_err,
            "{pair}: different runs or comparisons"
        );
        compared += 1;
    }
    // Every configuration against single, and the data-parallel ones against DDP.
    assert!(compared >= CONFIGS.len(), "only {compared} pairs in common");
}

/// A scratch directory removed when the test ends, however it ends.
struct Scratch(std::path::PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
