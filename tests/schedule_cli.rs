//! `lockstep schedule`: the table, the simulated bubble against its closed form, the
//! validator's verdict, CSV import and export, and clear errors for bad input.

use std::process::Command;

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

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-schedule-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn one_f_one_b_prints_its_table_and_the_closed_form_bubble() {
    let run = lockstep(&[
        "schedule",
        "--schedule",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
    ]);
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("rank 3"), "{}", run.stdout);
    assert!(
        run.stdout.contains("simulated bubble: 3/11"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("(p-1)/(m+p-1) = 3/11"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("validator:        valid"),
        "{}",
        run.stdout
    );
}

#[test]
fn json_output_carries_the_exact_bubble_and_lowered_actions() {
    let run = lockstep(&[
        "schedule",
        "--schedule",
        "interleaved-1f1b",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--virtual",
        "2",
        "--json",
    ]);
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("JSON");
    assert_eq!(v["verdict"], "valid");
    // (p-1)/(v·m+p-1) = 1/9.
    assert_eq!(v["simulation"]["bubble_numerator"], 1);
    assert_eq!(v["simulation"]["bubble_denominator"], 9);
    let rank0: Vec<&str> = v["actions"][0]
        .as_array()
        .expect("actions")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert!(
        rank0.contains(&"0SEND_F0") && rank0.contains(&"0RECV_B0"),
        "{rank0:?}"
    );
}

#[test]
fn every_built_in_schedule_round_trips_through_csv() {
    let dir = scratch("roundtrip");
    for (name, stages, m) in [
        ("gpipe", "2", "4"),
        ("1f1b", "4", "8"),
        ("interleaved-1f1b", "2", "4"),
        ("looped-bfs", "2", "4"),
        ("interleaved-zb", "2", "4"),
        ("zbv", "2", "4"),
        ("dualpipev", "2", "4"),
    ] {
        let csv = dir.join(format!("{name}.csv"));
        let csv = csv.to_str().expect("path");
        let built = lockstep(&[
            "schedule",
            "--schedule",
            name,
            "--stages",
            stages,
            "--microbatches",
            m,
            "--export",
            csv,
            "--json",
        ]);
        assert_eq!(built.code, Some(0), "{name}: {}", built.stderr);
        let loaded = lockstep(&["schedule", "--csv", csv, "--json"]);
        assert_eq!(loaded.code, Some(0), "{name}: {}", loaded.stderr);
        let a: serde_json::Value = serde_json::from_str(&built.stdout).expect("JSON");
        let b: serde_json::Value = serde_json::from_str(&loaded.stdout).expect("JSON");
        assert_eq!(a["actions"], b["actions"], "{name}");
        assert_eq!(
            a["simulation"]["makespan"], b["simulation"]["makespan"],
            "{name}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_broken_csv_schedule_gets_the_validators_verdict_and_exit_1() {
    let dir = scratch("broken");
    let csv = dir.join("broken.csv");
    // Stage 1 runs B for microbatch 0 before its F.
    std::fs::write(&csv, "0F0,0B0\n1B0,1F0\n").expect("write");
    let run = lockstep(&["schedule", "--csv", csv.to_str().expect("path")]);
    assert_eq!(run.code, Some(1), "{}{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("1B0"), "{}", run.stdout);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_input_is_exit_2_naming_the_rule() {
    let run = lockstep(&["schedule", "--schedule", "nope"]);
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("1f1b"), "{}", run.stderr);
    let run = lockstep(&[
        "schedule",
        "--schedule",
        "interleaved-1f1b",
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--virtual",
        "2",
    ]);
    assert_eq!(run.code, Some(2));
    assert!(run.stderr.contains("multiple"), "{}", run.stderr);
}

/// Schedules take the `pp.*` configurations' spelling (`interleaved_1f1b`) and the hyphenated
/// one, and print the configuration spelling; `--pipeline-ranks` is `--stages` named for what
/// it is, and the old name still works.
#[test]
fn both_spellings_and_both_rank_options_are_accepted() {
    for (schedule, ranks_flag) in [
        ("interleaved_1f1b", "--pipeline-ranks"),
        ("interleaved-1f1b", "--stages"),
    ] {
        let run = lockstep(&[
            "schedule",
            "--schedule",
            schedule,
            ranks_flag,
            "2",
            "--microbatches",
            "4",
            "--json",
        ]);
        assert_eq!(run.code, Some(0), "{schedule} {ranks_flag}: {}", run.stderr);
        let v: serde_json::Value = serde_json::from_str(&run.stdout).expect("JSON");
        assert_eq!(v["schedule"], "interleaved_1f1b", "{}", run.stdout);
        assert_eq!(v["ranks"], 2, "{}", run.stdout);
    }
}
