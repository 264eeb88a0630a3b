//! What a team keeps and what CI shows: the compact baseline `lockstep matrix` writes beside
//! its report, `lockstep compare` reading it on either side, `lockstep baseline update` as the
//! one way it changes, `--baseline` catching a regression in the matrix itself, and the short
//! terminal and job-page summaries (`--rows` for every row).

use std::path::Path;
use std::process::{Command, Output};

fn lockstep(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run the lockstep binary")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A small matrix (`gpt` and `mlp`, DDP and FSDP, world 2) into `out`, with `extra` flags.
fn small_matrix(out: &Path, extra: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut args = vec![
        "matrix",
        "--world-size",
        "2",
        "--configs",
        "ddp,fsdp.full_shard",
        "--models",
        "gpt,mlp",
        "--out",
        out.to_str().expect("utf-8"),
    ];
    args.extend(extra);
    lockstep(&args, env)
}

/// `lockstep baseline update KEPT --from FROM` with `extra` flags.
fn baseline_update(kept: &Path, from: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "baseline",
        "update",
        kept.to_str().expect("utf-8"),
        "--from",
        from.to_str().expect("utf-8"),
    ];
    args.extend(extra);
    lockstep(&args, &[])
}

/// The matrix prints its grid by model and configuration family, not every row (`--rows`
/// does), writes a baseline of every comparison beside the report, and appends a Markdown
/// summary to `GITHUB_STEP_SUMMARY`.
#[test]
fn the_matrix_summarizes_and_writes_a_baseline_and_a_job_summary() {
    let dir = tempfile::tempdir().expect("temp dir");
    let step_summary = dir.path().join("step-summary.md");
    std::fs::write(&step_summary, "earlier step\n").expect("seed the summary");
    let out = small_matrix(
        &dir.path().join("a"),
        &[],
        &[("GITHUB_STEP_SUMMARY", &step_summary)],
    );
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("model") && l.contains("ddp") && l.contains("fsdp")),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("gpt") && l.matches("2/2").count() == 2),
        "{stdout}"
    );
    assert!(
        !stdout.contains("single@2  "),
        "a row was printed:\n{stdout}"
    );
    assert!(stdout.contains("every row: --rows"), "{stdout}");
    let md = std::fs::read_to_string(&step_summary).expect("the job summary");
    assert!(
        md.starts_with("earlier step\n### ✅ Lockstep parity: 8 passed"),
        "{md}"
    );
    assert!(md.contains("| model | ddp | fsdp |"), "{md}");
    let baseline =
        std::fs::read_to_string(dir.path().join("a/baseline.jsonl")).expect("the baseline");
    let lines: Vec<&str> = baseline.lines().collect();
    assert!(
        lines[0].starts_with("{\"lockstep_baseline\":1"),
        "{baseline}"
    );
    assert_eq!(lines.len(), 1 + 8, "{baseline}");
    let mut sorted = lines[1..].to_vec();
    sorted.sort();
    assert_eq!(
        sorted,
        lines[1..],
        "one line per comparison, in a stable order"
    );

    let rows = small_matrix(&dir.path().join("b"), &["--rows"], &[]);
    let stdout = String::from_utf8_lossy(&rows.stdout);
    assert!(
        stdout.contains("fsdp.full_shard@2") && stdout.contains("single@2"),
        "{stdout}"
    );
    // The same runs give the same baseline, byte for byte.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("b/baseline.jsonl")).expect("baseline"),
        baseline
    );
}

/// The workflow docs/matrix.md describes: the first baseline written on purpose, `compare`
/// reading it against a report or a baseline, a planted bug caught by `--baseline` (exit 1,
/// each regression named, on the terminal, in the page and in the job summary), and the
/// update that takes it in only when asked, saying what changed.
#[test]
fn a_kept_baseline_catches_a_regression_and_changes_only_on_purpose() {
    let dir = tempfile::tempdir().expect("temp dir");
    let kept = dir.path().join("repo/parity/baseline.jsonl");
    let kept_arg = kept.to_str().expect("utf-8");
    let good = dir.path().join("good");
    assert!(small_matrix(&good, &[], &[]).status.success());
    let update = baseline_update(&kept, &good, &[]);
    assert!(update.status.success(), "{}", text(&update));
    assert!(
        text(&update).contains("writing the first"),
        "{}",
        text(&update)
    );

    for new in [good.join("report.json"), good.join("baseline.jsonl")] {
        let same = lockstep(&["compare", kept_arg, new.to_str().expect("utf-8")], &[]);
        assert!(same.status.success(), "{}", text(&same));
        assert!(text(&same).contains("no regression"), "{}", text(&same));
    }

    let bad = dir.path().join("bad");
    let step_summary = dir.path().join("step-summary.md");
    let caught = small_matrix(
        &bad,
        &["--fault", "sum", "--baseline", kept_arg],
        &[("GITHUB_STEP_SUMMARY", &step_summary)],
    );
    assert_eq!(caught.status.code(), Some(1), "{}", text(&caught));
    let said = text(&caught);
    assert!(said.contains("regressed against the baseline:"), "{said}");
    assert!(said.contains("CROSSED TOLERANCE"), "{said}");
    let md = std::fs::read_to_string(&step_summary).expect("the job summary");
    assert!(md.contains("**Regressed against the baseline**"), "{md}");
    let page = std::fs::read_to_string(bad.join("report.html")).expect("the page");
    assert!(
        page.contains("regressed (CROSSED TOLERANCE"),
        "the page lists it first"
    );
    let compared = lockstep(
        &[
            "compare",
            kept_arg,
            bad.join("baseline.jsonl").to_str().expect("utf-8"),
        ],
        &[],
    );
    assert_eq!(compared.status.code(), Some(1), "{}", text(&compared));

    // Taken in only on purpose, saying what changed.
    let before = std::fs::read_to_string(&kept).expect("kept");
    let taken = baseline_update(&kept, &bad, &[]);
    assert!(taken.status.success(), "{}", text(&taken));
    assert!(text(&taken).contains("regressed)"), "{}", text(&taken));
    assert_ne!(std::fs::read_to_string(&kept).expect("kept"), before);
}

/// Bad input loses nothing: an unreadable `--baseline` stops the matrix before any run (exit
/// 2, no report), and an update from a run with errors is refused unless asked for, leaving
/// the kept baseline as it was.
#[test]
fn bad_baselines_and_incomplete_runs_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let junk = dir.path().join("junk.jsonl");
    std::fs::write(&junk, "{\"lockstep_baseline\":99}\n").expect("write");
    let out_dir = dir.path().join("out");
    let refused = small_matrix(
        &out_dir,
        &["--baseline", junk.to_str().expect("utf-8")],
        &[],
    );
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(
        text(&refused).contains("lockstep_baseline Some(99) is not supported"),
        "{}",
        text(&refused)
    );
    assert!(!out_dir.join("report.json").exists());

    let failed = dir.path().join("failed");
    let errored = lockstep(
        &[
            "matrix",
            "--world-size",
            "2",
            "--configs",
            "ddp",
            "--models",
            "mlp",
            "--fault",
            "stall",
            "--timeout",
            "3",
            "--out",
            failed.to_str().expect("utf-8"),
        ],
        &[],
    );
    assert_eq!(errored.status.code(), Some(1), "{}", text(&errored));
    let kept = dir.path().join("kept.jsonl");
    std::fs::write(&kept, "kept as it was\n").expect("write");
    let refused = baseline_update(&kept, &failed, &[]);
    assert_eq!(refused.status.code(), Some(2), "{}", text(&refused));
    assert!(text(&refused).contains("errored"), "{}", text(&refused));
    assert_eq!(
        std::fs::read_to_string(&kept).expect("kept"),
        "kept as it was\n"
    );
    std::fs::remove_file(&kept).expect("remove");
    let allowed = baseline_update(&kept, &failed, &["--allow-incomplete"]);
    assert!(allowed.status.success(), "{}", text(&allowed));
    let written = std::fs::read_to_string(&kept).expect("written");
    assert!(written.contains("\"status\":\"error\""), "{written}");
}
