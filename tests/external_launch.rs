//! `lockstep matrix` started as one rank per process by an external launcher (here, two
//! processes given `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` on loopback, as torchrun
//! would): the launcher's watchdog where no launcher is, and the exec'd-rank path (what NCCL
//! ranks run) judged like the forked matrix. Across two hosts: `tests/two_hosts.rs`.

use std::path::Path;
use std::process::{Command, Output, Stdio};

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Runs `lockstep matrix ARGS --out DIR/out{rank}` as ranks 0 and 1 of an external launch
/// on loopback (each bounded by 120 s); their outputs.
fn launch_two(dir: &Path, args: &[&str]) -> Vec<Output> {
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new("timeout");
            cmd.args(["-k", "5", "120", env!("CARGO_BIN_EXE_lockstep"), "matrix"])
                .args(args)
                .arg("--out")
                .arg(dir.join(format!("out{rank}")))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // Far longer than any launch timeout: a watchdog, not this, must end a hang.
                .env("LOCKSTEP_COMM_TIMEOUT_SECS", "600")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for var in [
                "LOCKSTEP_RANK",
                "LOCKSTEP_PARITY_LAUNCH",
                "TORCHELASTIC_RUN_ID",
            ] {
                cmd.env_remove(var);
            }
            cmd.spawn().expect("start a rank")
        })
        .collect();
    ranks
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for a rank"))
        .collect()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A rank stalled outside communication: past the launch's `--timeout` every rank leaves its
/// flight recorder in the store and aborts its links; rank 0 writes the desync diagnosis
/// into the report, and every process ends with exit code 1 instead of waiting out the
/// collective timeout.
#[test]
fn a_stalled_rank_is_diagnosed_under_an_external_launch() {
    let dir = std::env::temp_dir().join(format!("lockstep-ext-watchdog-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let args = [
        "--models",
        "mlp",
        "--configs",
        "ddp",
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    let stall = ["--fault", "stall", "--timeout", "5"];
    let outs = launch_two(&dir, &[&args[..], &stall[..]].concat());
    for (r, out) in outs.iter().enumerate() {
        // 1, not timeout's 124: the watchdog ended the rank.
        assert_eq!(out.status.code(), Some(1), "rank {r}:\n{}", text(out));
    }
    let zero = text(&outs[0]);
    assert!(
        zero.contains("timed out after 5 s"),
        "rank 0 names the timeout:\n{zero}"
    );
    let report = std::fs::read_to_string(dir.join("out0/report.json")).expect("rank 0's report");
    assert!(
        report.contains("desync on group world: rank 0 inside collective"),
        "the report carries the desync diagnosis:\n{report}"
    );
    let one = text(&outs[1]);
    assert!(
        one.contains("stuck outside any collective"),
        "rank 1 says where it was:\n{one}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every matrix row's (model config vs reference, verdict) in a complete report.
fn verdicts(report: &Path) -> Vec<(String, bool)> {
    let text = std::fs::read_to_string(report).expect("a report");
    let json: serde_json::Value = serde_json::from_str(&text).expect("report JSON");
    assert_eq!(json["complete"], true, "{text}");
    json["comparisons"]
        .as_array()
        .expect("comparisons")
        .iter()
        .map(|c| {
            let name = format!("{} {} vs {}", c["model"], c["config"], c["reference"]);
            (name, c["passed"] == true)
        })
        .collect()
}

/// `--exec-ranks` under an external launch: each process trains as an exec'd rank does (the
/// path NCCL ranks take, there on their GPU), and the verdicts are the forked matrix's.
#[test]
fn exec_ranks_under_an_external_launch_judge_as_the_matrix_does() {
    let dir = std::env::temp_dir().join(format!("lockstep-ext-exec-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let selection = [
        "--models",
        "gpt",
        "--configs",
        "ddp,fsdp.full_shard,tp.2,pp.1f1b",
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    let outs = launch_two(&dir, &[&selection[..], &["--exec-ranks"][..]].concat());
    for (r, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "rank {r}:\n{}", text(out));
    }
    let mut local = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    local
        .arg("matrix")
        .args(selection)
        .arg("--out")
        .arg(dir.join("local"));
    for var in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
        local.env_remove(var);
    }
    let local = local.output().expect("the single-host matrix");
    assert!(local.status.success(), "{}", text(&local));
    let here = verdicts(&dir.join("local/report.json"));
    assert!(here.len() >= 6, "{here:?}");
    assert_eq!(here, verdicts(&dir.join("out0/report.json")));
    let _ = std::fs::remove_dir_all(&dir);
}
