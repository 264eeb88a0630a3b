//! The collective storm (`lockstep_harness::stress`) at world 4: every collective, sync and
//! async, on the overlapping `replicate` and `shard` groups of a 2 × 2 mesh and on the world,
//! sizes on both sides of the shared-memory threshold, random delays and busy threads, every
//! result checked exactly. The launcher's timeout is the watchdog: a hang fails the test with
//! every rank's flight recorder.
//!
//! `LOCKSTEP_SOAK_ITERATIONS=N` turns the CI-sized storm into a soak of N iterations.

use crate::common;

use lockstep_harness::stress::{collective_storm, StormOptions};
use std::time::Duration;

fn iterations(default: usize) -> usize {
    std::env::var("LOCKSTEP_SOAK_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn storm_on_overlapping_groups_world4() {
    let opts = StormOptions {
        iterations: iterations(200),
        ..StormOptions::default()
    };
    lockstep_harness::Run::new(4)
        .timeout(Duration::from_secs(120 + opts.iterations as u64 / 2))
        .run(move |ctx| {
            let stats = collective_storm(ctx, &opts)?;
            assert_eq!(stats.ops, opts.iterations * opts.ops_per_iteration);
            assert!(stats.async_ops > 0 && stats.shm_ops > 0, "{stats:?}");
            Ok::<(), lockstep_harness::stress::StormError>(())
        });
}

#[test]
fn storm_without_injected_load_world2() {
    let opts = StormOptions {
        iterations: 100,
        max_send_delay: Duration::ZERO,
        contention: false,
        seed: 7,
        ..StormOptions::default()
    };
    common::run(2, move |ctx| collective_storm(ctx, &opts).map(|_| ()));
}

fn lockstep(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .output()
        .expect("run lockstep")
}

/// `lockstep stress` repeats a selection under load: clean runs report zero hangs; a planted
/// hang (the last rank stalls before its first gradient reduction) is counted and shown
/// with every rank's flight recorder.
#[test]
fn stress_command_counts_hangs() {
    let base = [
        "stress",
        "--models",
        "nested",
        "--configs",
        "ddp",
        "--world-size",
        "2",
        "--steps",
        "1",
        "--repeat",
        "3",
    ];
    let clean = lockstep(&base);
    let stdout = String::from_utf8_lossy(&clean.stdout);
    assert_eq!(
        clean.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&clean.stderr)
    );
    assert!(
        stdout.contains("3 iterations") && stdout.contains("hangs found = 0"),
        "{stdout}"
    );

    let mut planted = base[..base.len() - 1].to_vec();
    planted.extend(["2", "--fault", "stall", "--timeout", "2"]);
    let hung = lockstep(&planted);
    let stdout = String::from_utf8_lossy(&hung.stdout);
    assert_eq!(hung.status.code(), Some(1), "{stdout}");
    // Two launches an iteration hang: `ddp` and its repeat.
    assert!(stdout.contains("hangs found = 4"), "{stdout}");
    assert!(
        stdout.contains("flight recorder of rank 1") && stdout.contains("desync on group world"),
        "{stdout}"
    );
}

/// The root cause of the hybrid-shard hang: a rank forked while another thread of the
/// launcher was starting or exiting inherited Rust's thread-registry lock held, so no thread
/// could ever start in it. The launcher now forks with no other thread of its own alive;
/// this checks that invariant over a matrix's launches (each with its store and output
/// threads) and its in-process references.
#[test]
fn matrix_forks_every_rank_from_a_single_threaded_launcher() {
    let out = std::env::temp_dir().join(format!("lockstep-fork-threads-{}", std::process::id()));
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "matrix",
            "--models",
            "nested,gpt",
            "--configs",
            "fsdp.hybrid_shard",
            "--world-size",
            "4",
            "--steps",
            "1",
            "--out",
        ])
        .arg(&out)
        .env("LOCKSTEP_TRACE_FORKS", "1")
        .output()
        .expect("run lockstep");
    let _ = std::fs::remove_dir_all(&out);
    let stderr = String::from_utf8_lossy(&run.stderr);
    let forks: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("lockstep: forking rank"))
        .collect();
    // nested and gpt: the ddp reference and hybrid shard share one launch (subtests), 4
    // ranks each.
    assert_eq!(forks.len(), 2 * 4, "{stderr}");
    for line in forks {
        assert!(line.ends_with(r#"from threads ["lockstep"]"#), "{line}");
    }
}
