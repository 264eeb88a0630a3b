//! The bugs the field shipped, planted in Lockstep's own loops (`core/src/field_bugs.rs`,
//! docs/bugs.md): `lockstep matrix --fault NAME` fails each at step 0 in at least two row
//! families of the default matrix (a parallelism's own rows and the compositions that run its
//! code), the rows whose code lacks the mechanism still pass, and `lockstep sensitivity`
//! reports each bug caught where the configuration runs it and not applicable elsewhere.

use crate::common;
use std::path::Path;
use std::process::Command;

/// One field bug planted in the default matrix's rows at world 4.
#[derive(Debug)]
struct Planted {
    bug: &'static str,
    /// Configurations whose rows must fail (each against `single@4`).
    caught: &'static [&'static str],
    /// Configurations that do not run the mechanism's code: every row passes.
    untouched: &'static [&'static str],
    /// What the first failure names: a quantity (`loss`, `grad_norm`) or part of a tensor.
    first: &'static str,
    /// Whether the ranks' copies of a replicated tensor part too (the copy check names them).
    copies_part: bool,
}

const PLANTED: &[Planted] = &[
    Planted {
        bug: "expert-grads-per-ep-rank",
        caught: &["ep.2", "ep.4", "ep2_x_fsdp", "cp2_x_ep2", "pp2_x_ep2"],
        untouched: &["tp.2"],
        first: "experts.",
        copies_part: false,
    },
    Planted {
        bug: "norm-over-own-experts",
        caught: &["ep.2", "ep.4", "ep2_x_fsdp", "cp2_x_ep2"],
        untouched: &["tp.2"],
        first: "grad_norm",
        copies_part: false,
    },
    Planted {
        bug: "loss-not-reduced-over-cp",
        caught: &["cp.2", "cp.2.allgather", "fsdp_x_cp2", "cp2_x_tp2"],
        untouched: &["tp.2"],
        first: "loss",
        copies_part: false,
    },
    Planted {
        bug: "kv-grads-not-returned",
        caught: &["cp.2", "cp.4", "fsdp_x_cp2", "cp2_x_tp2", "pp2_x_cp2"],
        // The all-gather dispatcher sends no key/value block around a ring.
        untouched: &["cp.2.allgather"],
        first: "attention.w",
        copies_part: false,
    },
    Planted {
        bug: "tp-input-grad-not-reduced",
        caught: &[
            "tp.2",
            "tp.4",
            "fsdp_x_tp2",
            "hsdp_x_tp2",
            "cp2_x_tp2",
            "pp2_x_tp2",
        ],
        // Sequence parallelism enters its column-parallel layers sharded: no such reduction.
        untouched: &["tp.2.sp"],
        first: "norm.bias",
        copies_part: true,
    },
];

/// `lockstep matrix --fault` for `case` at world 4 on gpt and gpt_moe: its report's rows.
fn planted_rows(case: &Planted, out: &Path) -> Vec<serde_json::Value> {
    let configs: Vec<&str> = case.caught.iter().chain(case.untouched).copied().collect();
    let run = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["matrix", "--fault", case.bug, "--models", "gpt,gpt_moe"])
        .args(["--world-size", "4", "--configs", &configs.join(",")])
        .arg("--out")
        .arg(out)
        .output()
        .expect("run the lockstep binary");
    assert_eq!(
        run.status.code(),
        Some(1),
        "{}: the matrix must fail:\n{}",
        case.bug,
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("report.json")).expect("report.json"))
            .expect("report.json parses");
    report["comparisons"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Each field bug fails every row of the configurations that run its code, against one
/// device, at step 0 where it starts, in a parallelism's own rows and in compositions; the
/// configurations without that code pass.
#[test]
fn each_field_bug_is_caught_where_it_starts_in_two_row_families() {
    common::each_case("field_bugs", PLANTED, |case| {
        let dir = tempfile::tempdir().expect("scratch");
        let rows = planted_rows(case, dir.path());
        let of = |config: &str| -> Vec<&serde_json::Value> {
            let at_4 = format!("{config}@4");
            rows.iter()
                .filter(|r| r["config"] == at_4.as_str())
                .collect()
        };
        for config in case.caught {
            let against_single: Vec<_> = of(config)
                .into_iter()
                .filter(|r| r["reference"] == "single@4")
                .collect();
            assert!(
                !against_single.is_empty(),
                "{config}: no row against single"
            );
            for row in against_single {
                let first = &row["first_failure"];
                assert_eq!(row["passed"], false, "{config} {}: passed", row["model"]);
                assert_eq!(first["step"], 0, "{config}: not at step 0: {first}");
                let named = format!("{} {}", first["quantity"], first["tensor"]);
                assert!(
                    named.contains(case.first),
                    "{config}: the first failure names `{}`: {named}",
                    case.first
                );
                if case.copies_part {
                    let parted = &row["cross_rank"]["mismatch"];
                    assert!(
                        parted.is_object(),
                        "{config}: no copy parted: {}",
                        row["cross_rank"]
                    );
                }
            }
        }
        for config in case.untouched {
            let untouched = of(config);
            assert!(!untouched.is_empty(), "{config}: no row");
            for row in untouched {
                assert_eq!(row["passed"], true, "{config}: {}", row["first_failure"]);
            }
        }
        let families = |compositions: bool| {
            case.caught
                .iter()
                .any(|c| c.contains("_x_") == compositions)
        };
        assert!(
            families(false) && families(true),
            "{}: caught in one row family only",
            case.bug
        );
    });
}

/// `lockstep sensitivity` plants every field bug in the configuration's own loops and
/// reports each: caught where the configuration runs its code, not applicable where it does
/// not (every rank trained to the bits of the run without it).
#[test]
fn sensitivity_reports_the_field_bugs_a_configuration_runs() {
    let run = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["sensitivity", "--model", "gpt", "--config", "tp.2"])
        .args(["--world-size", "2", "--steps", "1", "--site-steps", "0"])
        .args(["--faults", "skip", "--json"])
        .output()
        .expect("run the lockstep binary");
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap_or_else(|e| {
        panic!(
            "sensitivity --json: {e}:\n{}",
            String::from_utf8_lossy(&run.stderr)
        )
    });
    let verdicts: Vec<(String, String)> = report["field_bugs"]
        .as_array()
        .expect("field_bugs")
        .iter()
        .map(|b| {
            (
                b["bug"].as_str().unwrap_or_default().to_owned(),
                b["verdict"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect();
    assert_eq!(verdicts.len(), 5, "{verdicts:?}");
    for (bug, verdict) in &verdicts {
        let want = match bug.as_str() {
            "tp-input-grad-not-reduced" => "caught",
            _ => "not_applicable",
        };
        assert_eq!(verdict, want, "{bug}: {verdicts:?}");
    }
}
