//! The launcher's watchdog where no launcher is: `lockstep matrix` started as one rank per
//! process by an external launcher (here, two processes given `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT` on loopback, as torchrun would) with a rank that stalls
//! outside communication. Past the launch's `--timeout`, every rank leaves its flight
//! recorder in the store and aborts its links; rank 0 writes the desync diagnosis into the
//! report, and every process ends with exit code 1 instead of waiting out the collective
//! timeout.

use std::process::{Command, Stdio};

/// A loopback port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn a_stalled_rank_is_diagnosed_under_an_external_launch() {
    let dir = std::env::temp_dir().join(format!("lockstep-ext-watchdog-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = free_port().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let mut cmd = Command::new("timeout");
            cmd.args(["-k", "5", "120", env!("CARGO_BIN_EXE_lockstep"), "matrix"])
                .args(["--models", "mlp", "--configs", "ddp", "--world-size", "2"])
                .args([
                    "--steps",
                    "2",
                    "--fault",
                    "stall",
                    "--timeout",
                    "5",
                    "--out",
                ])
                .arg(dir.join(format!("out{rank}")))
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // Far longer than the launch timeout: the watchdog, not this, must end it.
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
    let outs: Vec<_> = ranks
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for a rank"))
        .collect();
    let text = |r: usize| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&outs[r].stdout),
            String::from_utf8_lossy(&outs[r].stderr)
        )
    };
    for (r, out) in outs.iter().enumerate() {
        // 1, not timeout's 124: the watchdog ended the rank.
        assert_eq!(out.status.code(), Some(1), "rank {r}:\n{}", text(r));
    }
    let zero = text(0);
    assert!(
        zero.contains("timed out after 5 s"),
        "rank 0 names the timeout:\n{zero}"
    );
    let report = std::fs::read_to_string(dir.join("out0/report.json")).expect("rank 0's report");
    assert!(
        report.contains("desync on group world: rank 0 inside collective"),
        "the report carries the desync diagnosis:\n{report}"
    );
    assert!(
        text(1).contains("stuck outside any collective"),
        "rank 1 says where it was:\n{}",
        text(1)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
