//! Users' own meshes as data: `lockstep matrix --mesh cp=2,tp=2` and `ParityTest::mesh`
//! build the composition from its parts (torchtitan's description and order), judge it
//! against one device, at the mesh's own size when it fixes one; bad meshes are refused before
//! any rank starts, naming the dimension or the model size that does not fit, with nothing
//! written.

use lockstep::parity_test::ParityTest;
use std::path::Path;
use std::process::{Command, Output};

fn lockstep(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run lockstep")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The JSON rows `--json` printed.
fn rows(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// CP × TP with FSDP over the rest, at worlds 4 and 8, passes on both decoders against one
/// device and against one device computing attention in the ring's order (`single.cp2`),
/// and bit for bit against its replicated twin (`.ddp`: FSDP's reduce-scatter gives the
/// all-reduce's elements); the mesh is the only configuration run when given alone.
#[test]
fn a_mesh_given_on_the_command_line_is_its_own_row_and_passes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_dir = dir.path().join("report");
    let out = lockstep(&[
        "matrix",
        "--mesh",
        "cp=2,tp=2",
        "--world-size",
        "4,8",
        "--models",
        "gpt,gpt_moe",
        "--json",
        "--out",
        out_dir.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let rows = rows(&out);
    assert_eq!(rows.len(), 12, "{}", text(&out));
    for row in &rows {
        let config = row["config"].as_str().unwrap_or_default();
        assert!(config.starts_with("mesh.cp2.tp2@"), "{row}");
        assert_eq!(row["status"], "pass", "{row}");
        let reference = row["reference"].as_str().unwrap_or_default();
        if reference.starts_with("mesh.cp2.tp2.ddp@") {
            assert_eq!(row["max_abs_err"], 0.0, "bitwise against the twin: {row}");
        } else {
            assert!(
                reference.starts_with("single@") || reference.starts_with("single.cp2@"),
                "{row}"
            );
        }
    }
}

/// A mesh that fixes its size (dp_shard or dp_replicate given) runs at that size without
/// `--world-size`: CP × TP with FSDP, HSDP × TP, PP × CP with HSDP, EP over FSDP, CP × TP ×
/// EP with FSDP, EP under HSDP, PP × EP with FSDP, and the
/// whole 5-D mesh torchtitan composes at world 32 on the mixture of experts, its experts
/// spread over 4 ranks of each stage's `dp_shard × cp`. Each passes
/// against one device (with CP, also against `single.cp2`, attention in the ring's order),
/// and the sharded ones bit for bit against their replicated twins.
#[test]
fn a_mesh_that_fixes_its_size_runs_at_it() {
    for (mesh, world, model, references) in [
        ("dp_shard=2,cp=2,tp=2", 8, "gpt_moe", 3),
        ("dp_replicate=2,dp_shard=2,tp=2", 8, "gpt", 2),
        ("pp=2,dp_replicate=2,dp_shard=2,cp=2", 16, "gpt", 2),
        ("dp_shard=4,ep=2", 4, "gpt_moe", 2),
        ("dp_shard=2,cp=2,tp=2,ep=2", 8, "gpt_moe", 3),
        ("dp_replicate=2,dp_shard=2,ep=2", 4, "gpt_moe", 1),
        ("pp=2,dp_shard=2,ep=2", 4, "gpt_moe", 2),
        (
            "pp=2,dp_replicate=2,dp_shard=2,cp=2,tp=2,ep=4",
            32,
            "gpt_moe",
            2,
        ),
    ] {
        let dir = tempfile::tempdir().expect("temp dir");
        let out_dir = dir.path().join("report");
        let out = lockstep(&[
            "matrix",
            "--mesh",
            mesh,
            "--models",
            model,
            "--json",
            "--out",
            out_dir.to_str().expect("utf-8"),
        ]);
        assert!(out.status.success(), "{mesh}: {}", text(&out));
        let rows = rows(&out);
        assert_eq!(rows.len(), references, "{mesh}: {}", text(&out));
        for row in &rows {
            assert_eq!(row["world_size"], world, "{mesh}: {row}");
            assert_eq!(row["status"], "pass", "{mesh}: {row}");
        }
    }
}

/// Bad meshes exit 2 before any rank starts, naming what is wrong, and write no report.
#[test]
fn bad_meshes_are_refused_naming_what_does_not_fit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_dir = dir.path().join("report");
    let out = out_dir.to_str().expect("utf-8");
    for (args, want) in [
        (
            vec!["--mesh", "cp=2,sp=2"],
            "unknown dimension `sp` (dimensions: pp, dp_replicate, dp_shard, cp, tp, ep)",
        ),
        (vec!["--mesh", "cp=2,cp=4"], "`cp` is given twice"),
        (
            vec!["--mesh", "dp_shard=2,cp=2,tp=2", "--world-size", "16"],
            "multiply to 8 ranks, not the world size 16",
        ),
        (
            vec!["--mesh", "cp=2,tp=2", "--world-size", "6"],
            "world size 6 does not divide by pp × cp × tp = 4",
        ),
        (
            vec!["--mesh", "tp=3", "--world-size", "3", "--models", "gpt"],
            "4 attention heads do not divide by the tensor-parallel size 3",
        ),
        (
            vec!["--mesh", "cp=8", "--world-size", "8", "--models", "gpt"],
            "the sequence of 8 tokens does not divide into 2 × cp = 16 chunks",
        ),
        (
            vec!["--mesh", "ep=3", "--world-size", "3", "--models", "gpt_moe"],
            "8 experts do not divide over an expert-parallel group of 3",
        ),
        (
            vec!["--mesh", "cp=2,ep=3", "--world-size", "4"],
            "ep=3 borrows from the data and context dimensions, whose 2 × 2 ranks do not \
             divide by it",
        ),
        (
            vec!["--mesh", "pp=2,tp=2,ep=2", "--world-size", "4"],
            "ep=2 borrows from the data and context dimensions, whose 1 × 1 ranks do not \
             divide by it",
        ),
    ] {
        let mut all = vec!["matrix", "--out", out];
        all.extend(args.iter().copied());
        let got = lockstep(&all);
        assert_eq!(got.status.code(), Some(2), "{args:?}: {}", text(&got));
        assert!(text(&got).contains(want), "{args:?}: {}", text(&got));
        assert!(!Path::new(out).exists(), "{args:?} wrote a report");
    }
}

/// `ParityTest::mesh` takes the same description and judges the mesh's row; a mesh that
/// cannot be parsed fails the test naming why.
#[test]
fn parity_tests_take_a_mesh() {
    let dir = tempfile::tempdir().expect("temp dir");
    ParityTest::new("parity_tests_take_a_mesh")
        .zoo("gpt")
        .mesh("cp=2,tp=2")
        .world_sizes(&[4])
        .out_dir(dir.path())
        .assert_parity();
    ParityTest::new("parity_tests_take_an_expert_mesh")
        .zoo("gpt_moe")
        .mesh("cp=2,ep=2")
        .world_sizes(&[4])
        .out_dir(dir.path())
        .assert_parity();
    let e = ParityTest::new("a_mesh_misspelt")
        .zoo("gpt")
        .mesh("pp=2,cp=2,sp=2")
        .out_dir(dir.path())
        .run()
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(e.contains("unknown dimension `sp`"), "{e}");
}

/// `lockstep run` finds a mesh row by its name, as exec'd ranks do.
#[test]
fn a_mesh_row_runs_by_name() {
    let out = lockstep(&[
        "run",
        "--model",
        "gpt",
        "--config",
        "mesh.dps2.cp2",
        "--world-size",
        "4",
        "--steps",
        "2",
        "--json",
    ]);
    assert!(out.status.success(), "{}", text(&out));
}

/// Exec'd ranks (`--exec-ranks`, how the GPU check runs its families) rebuild a mesh row from
/// its name and train it: a model placed on its device keeps its CP opt-in (it was refused
/// once: the device wrapper answered CP's question with the default refusal).
#[test]
fn exec_d_ranks_run_a_mesh_row() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out_dir = dir.path().join("report");
    let out = lockstep(&[
        "matrix",
        "--mesh",
        "dp_shard=2,cp=2",
        "--exec-ranks",
        "--models",
        "gpt",
        "--json",
        "--out",
        out_dir.to_str().expect("utf-8"),
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let rows = rows(&out);
    // Against its twin, single@4 and single.cp2@4.
    assert_eq!(rows.len(), 3, "{}", text(&out));
    assert!(rows.iter().all(|r| r["status"] == "pass"), "{}", text(&out));
}
