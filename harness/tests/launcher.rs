//! Integration tests of the multi-rank launcher: what a failed, hung or mismatched run
//! reports, that no rank outlives the run, both spawn modes, skips, and external launch.
//!
//! Tests that count the test process's children hold [`serial`]'s guard; every other test
//! that starts processes holds [`parallel`]'s, so a child count never sees another test's
//! ranks when libtest runs them on threads of one process (nextest gives each its own).

use lockstep_core::comm::ReduceOp;
use lockstep_core::CommError;
use lockstep_harness::{FailureReport, LaunchError, Outcome, RankEnd, Run, SpawnMode};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// Set in the processes `external_launch_runs_body_in_process` starts itself.
const EXTERNAL: &str = "LOCKSTEP_TEST_EXTERNAL";

/// Long enough that a rank sleeping this long would blow every other bound in this file.
const LONG_SLEEP: Duration = Duration::from_secs(60);

/// Generous bound for "the run stopped when the first rank failed" (not a speed target:
/// the alternative is waiting for a 60 s sleep or the 300 s default timeout).
const PROMPT: Duration = Duration::from_secs(10);

/// Processes whose parent is this test process (zombies included), as (pid, stat line).
fn children() -> Vec<(i32, String)> {
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("read /proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // Fields after the parenthesized command: state, ppid, ...
        let Some(after) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let mut fields = after.split_whitespace();
        let _state = fields.next();
        if fields.next().and_then(|p| p.parse::<i32>().ok()) == Some(me) {
            out.push((pid, stat.trim().to_owned()));
        }
    }
    out
}

fn assert_no_children(context: &str) {
    let left = children();
    assert!(
        left.is_empty(),
        "{context}: processes left behind by the launcher: {left:#?}"
    );
}

/// The report of a run that must have failed with `RankFailed`.
fn rank_failed(result: Result<Outcome, LaunchError>) -> FailureReport {
    match result {
        Err(LaunchError::RankFailed(report)) => report,
        Err(other) => panic!("expected RankFailed, got another error: {other:?}\n{other}"),
        Ok(outcome) => panic!("expected RankFailed, the run succeeded: {outcome:?}"),
    }
}

/// Every rank other than `failed` was stopped by the launcher or had already succeeded.
fn assert_others_stopped(report: &FailureReport, failed: usize) {
    for r in &report.ranks {
        if r.rank != failed {
            assert!(
                matches!(r.end, RankEnd::KilledByLauncher | RankEnd::Success),
                "rank {} should have been stopped by the launcher, but it {:?}\n{report}",
                r.rank,
                r.end
            );
        }
    }
}

fn sleep_long() {
    std::thread::sleep(LONG_SLEEP);
}

// ---------------------------------------------------------------------------------------
// A rank fails: panic, returned error, exit code, signal.
// ---------------------------------------------------------------------------------------

/// Tests that start processes share this lock: the ones counting children take it alone.
static CHILDREN: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Held by a test that counts this process's children: no other test runs beside it.
fn serial() -> std::sync::RwLockWriteGuard<'static, ()> {
    CHILDREN.write().unwrap_or_else(|e| e.into_inner())
}

/// Held by a test that starts processes: any number at once, none beside a [`serial`] one.
fn parallel() -> std::sync::RwLockReadGuard<'static, ()> {
    CHILDREN.read().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn panicking_rank_is_named_and_stops_the_run() {
    let _guard = serial();
    let started = Instant::now();
    let result = Run::new(4).try_run(|ctx| {
        if ctx.rank() == 2 {
            panic!("rank two hit the distinctive failure 0xC0FFEE");
        }
        sleep_long();
    });
    let elapsed = started.elapsed();
    let report = rank_failed(result);
    let text = report.to_string();
    assert!(
        elapsed < PROMPT,
        "the run took {elapsed:?}: the launcher waited for the sleeping ranks\n{text}"
    );
    assert_eq!(report.failed_rank, Some(2), "{text}");
    assert_eq!(report.ranks.len(), 4, "{text}");
    assert!(report.timeout.is_none(), "{text}");
    let failed = report.first_failure().expect("first failure");
    assert_eq!(failed.rank, 2);
    assert_eq!(failed.end, RankEnd::ExitCode(101), "{text}");
    let message = failed.message.as_deref().unwrap_or_default();
    assert!(
        message.contains("rank two hit the distinctive failure 0xC0FFEE"),
        "message {message:?}\n{text}"
    );
    assert!(
        failed.stderr_tail.contains("0xC0FFEE"),
        "stderr tail {:?}",
        failed.stderr_tail
    );
    assert!(text.contains("rank 2"), "{text}");
    assert!(
        text.contains("rank two hit the distinctive failure 0xC0FFEE"),
        "{text}"
    );
    assert_others_stopped(&report, 2);
    assert_no_children("after a rank panicked");
}

/// The other ranks block in an all-reduce the panicking rank never enters: they lose their
/// peer and fail too (with "lost rank 2"), and the report must still blame the rank that
/// failed first. Repeated because the victims' exits race the culprit's.
#[test]
fn failure_is_blamed_on_the_culprit_not_the_ranks_that_lost_it() {
    let _guard = parallel();
    for attempt in 0..50 {
        let started = Instant::now();
        let result = Run::new(4).try_run(|ctx| {
            if ctx.rank() == 2 {
                panic!("rank two refused the all_reduce");
            }
            let t = Tensor::ones([4], (Kind::Float, Device::Cpu));
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
            sleep_long();
            Ok::<(), CommError>(())
        });
        let elapsed = started.elapsed();
        let report = rank_failed(result);
        let text = report.to_string();
        assert!(
            elapsed < PROMPT,
            "attempt {attempt}: the run took {elapsed:?}\n{text}"
        );
        let ends: Vec<_> = report.ranks.iter().map(|r| &r.end).collect();
        assert_eq!(
            report.failed_rank,
            Some(2),
            "attempt {attempt}: the report blames a rank that only lost the panicking rank 2 (ends {ends:?}):\n{text}"
        );
        let failed = report.first_failure().expect("first failure");
        assert_eq!(failed.end, RankEnd::ExitCode(101), "{text}");
        assert!(
            failed
                .message
                .as_deref()
                .unwrap_or_default()
                .contains("rank two refused the all_reduce"),
            "{text}"
        );
    }
}

#[test]
fn barrier_completes_on_every_rank() {
    let _guard = parallel();
    let result = Run::new(2).timeout(Duration::from_secs(20)).try_run(|ctx| {
        ctx.group().barrier()?;
        ctx.group().barrier()?;
        Ok::<(), CommError>(())
    });
    match result {
        Ok(Outcome::Passed(summary)) => assert!(
            summary.ranks.iter().all(|r| r.end == RankEnd::Success),
            "{summary:?}"
        ),
        Ok(other) => panic!("expected Passed, got {other:?}"),
        Err(e) => panic!("a barrier every rank enters failed:\n{e}"),
    }
}

/// What a rank prints must reach the report's output tails in the default (fork) mode under
/// plain `cargo test`, i.e. with libtest capturing the test thread's output.
#[test]
fn rank_output_reaches_the_report_tails() {
    let _guard = parallel();
    let result = Run::new(2).try_run(|ctx| {
        if ctx.rank() == 1 {
            println!("stdout line from rank one: 31337");
            eprintln!("stderr line from rank one: 42424");
            panic!("rank one stops after printing");
        }
        sleep_long();
    });
    let report = rank_failed(result);
    let text = report.to_string();
    assert_eq!(report.failed_rank, Some(1), "{text}");
    let r = &report.ranks[1];
    assert!(
        r.stdout_tail.contains("stdout line from rank one: 31337"),
        "println! output of rank 1 is missing from its stdout tail {:?}",
        r.stdout_tail
    );
    assert!(
        r.stderr_tail.contains("stderr line from rank one: 42424"),
        "eprintln! output of rank 1 is missing from its stderr tail {:?}",
        r.stderr_tail
    );
    assert!(text.contains("stderr line from rank one: 42424"), "{text}");
}

#[test]
fn rank_returning_error_exits_1_with_its_message() {
    let _guard = parallel();
    let started = Instant::now();
    let result = Run::new(2).try_run(|ctx| {
        if ctx.rank() == 1 {
            return Err(format!("checksum mismatch in shard {}", 4711));
        }
        sleep_long();
        Ok(())
    });
    let elapsed = started.elapsed();
    let report = rank_failed(result);
    let text = report.to_string();
    assert!(elapsed < PROMPT, "the run took {elapsed:?}\n{text}");
    assert_eq!(report.failed_rank, Some(1), "{text}");
    let failed = report.first_failure().expect("first failure");
    assert_eq!(failed.end, RankEnd::ExitCode(1), "{text}");
    let message = failed.message.as_deref().unwrap_or_default();
    assert!(
        message.contains("checksum mismatch in shard 4711"),
        "message {message:?}\n{text}"
    );
    assert!(text.contains("rank 1"), "{text}");
    assert!(text.contains("checksum mismatch in shard 4711"), "{text}");
    assert_others_stopped(&report, 1);
}

#[test]
fn rank_calling_exit_reports_its_exit_code() {
    let _guard = parallel();
    let started = Instant::now();
    let result = Run::new(2).try_run(|ctx| {
        if ctx.rank() == 1 {
            std::process::exit(7);
        }
        sleep_long();
    });
    let elapsed = started.elapsed();
    let report = rank_failed(result);
    let text = report.to_string();
    assert!(elapsed < PROMPT, "the run took {elapsed:?}\n{text}");
    assert_eq!(report.failed_rank, Some(1), "{text}");
    assert_eq!(report.ranks[1].end, RankEnd::ExitCode(7), "{text}");
    assert!(text.contains("rank 1 exited with code 7"), "{text}");
    assert_others_stopped(&report, 1);
}

#[test]
fn rank_killed_by_signal_is_reported_as_sigkill() {
    let _guard = serial();
    let started = Instant::now();
    let result = Run::new(2).try_run(|ctx| {
        if ctx.rank() == 0 {
            // SAFETY: kill(2) on this very rank process.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
        sleep_long();
    });
    let elapsed = started.elapsed();
    let report = rank_failed(result);
    let text = report.to_string();
    assert!(elapsed < PROMPT, "the run took {elapsed:?}\n{text}");
    assert_eq!(report.failed_rank, Some(0), "{text}");
    assert_eq!(
        report.ranks[0].end,
        RankEnd::Signal(libc::SIGKILL),
        "{text}"
    );
    assert_eq!(report.ranks[0].end, RankEnd::Signal(9));
    assert!(text.contains("rank 0"), "{text}");
    assert!(text.contains("SIGKILL"), "{text}");
    assert_others_stopped(&report, 0);
    assert_no_children("after a rank was killed by SIGKILL");
}

// ---------------------------------------------------------------------------------------
// A hang: the run times out and shows every rank's flight recorder.
// ---------------------------------------------------------------------------------------

#[test]
fn hang_times_out_with_every_flight_recorder() {
    let _guard = serial();
    let timeout = Duration::from_secs(3);
    let started = Instant::now();
    let result = Run::new(2).timeout(timeout).try_run(|ctx| {
        if ctx.rank() == 0 {
            let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
        } else {
            // Skips the collective rank 0 waits in.
            sleep_long();
        }
        Ok::<(), CommError>(())
    });
    let elapsed = started.elapsed();
    let report = match result {
        Err(LaunchError::Timeout(report)) => report,
        Err(other) => panic!("expected Timeout, got {other:?}\n{other}"),
        Ok(outcome) => panic!("expected Timeout, the run succeeded: {outcome:?}"),
    };
    let text = report.to_string();
    assert!(
        elapsed >= timeout,
        "timed out early, after {elapsed:?}\n{text}"
    );
    assert!(
        elapsed < timeout + PROMPT,
        "the timeout took {elapsed:?}\n{text}"
    );
    assert_eq!(report.timeout, Some(timeout), "{text}");
    assert_eq!(report.failed_rank, None, "{text}");
    assert_eq!(report.ranks.len(), 2, "{text}");
    for r in &report.ranks {
        assert_eq!(r.end, RankEnd::TimedOut, "rank {}\n{text}", r.rank);
        assert!(
            r.flight.is_some(),
            "rank {} left no flight recorder\n{text}",
            r.rank
        );
    }
    let flight0 = report.ranks[0].flight.as_deref().unwrap_or_default();
    let stuck = flight0
        .lines()
        .find(|l| l.contains("all_reduce"))
        .unwrap_or_else(|| panic!("rank 0's flight recorder has no all_reduce:\n{flight0}"));
    assert!(
        stuck.contains("Started"),
        "rank 0's all_reduce is not shown as Started: {stuck:?}\n{text}"
    );
    assert!(
        stuck.contains("[3]"),
        "rank 0's all_reduce does not show its shape: {stuck:?}"
    );
    let flight1 = report.ranks[1].flight.as_deref().unwrap_or_default();
    assert!(
        !flight1.contains("all_reduce"),
        "rank 1 never issued an all_reduce:\n{flight1}"
    );
    assert!(
        report.diagnosis.iter().any(|d| d
            .starts_with("desync on group world: rank 0 inside collective #0 all_reduce")
            && d.contains("which 1 never issued")),
        "the diagnosis does not name the desync: {:?}\n{text}",
        report.diagnosis
    );
    assert!(text.contains("diagnosis: desync on group world"), "{text}");
    assert!(text.contains("timed out"), "{text}");
    assert!(text.contains("flight recorder of rank 0"), "{text}");
    assert!(text.contains("flight recorder of rank 1"), "{text}");
    assert_no_children("after a timeout");
}

// ---------------------------------------------------------------------------------------
// Mismatched collectives fail at once, naming both ranks and both operations.
// ---------------------------------------------------------------------------------------

/// Runs a 2-rank body expected to fail with a collective mismatch, and checks the failing
/// rank's message names both ranks and contains every `needle`.
fn assert_mismatch<F>(body: F, needles: &[&str])
where
    F: Fn(&lockstep_harness::RankCtx) -> Result<(), CommError>,
{
    let started = Instant::now();
    let result = Run::new(2).timeout(Duration::from_secs(20)).try_run(body);
    let elapsed = started.elapsed();
    let report = match result {
        Err(LaunchError::RankFailed(report)) => report,
        Err(LaunchError::Timeout(report)) => {
            panic!("a mismatched collective hung instead of failing:\n{report}")
        }
        Err(other) => panic!("expected RankFailed, got {other:?}"),
        Ok(outcome) => panic!("a mismatched collective succeeded: {outcome:?}"),
    };
    let text = report.to_string();
    assert!(
        elapsed < PROMPT,
        "the mismatch took {elapsed:?} to surface\n{text}"
    );
    let failed = report.first_failure().expect("first failure");
    assert_eq!(failed.end, RankEnd::ExitCode(1), "{text}");
    let message = failed.message.as_deref().unwrap_or_default();
    assert!(message.contains("mismatch"), "message {message:?}");
    for needle in ["rank 0", "rank 1"].iter().chain(needles) {
        assert!(
            message.contains(needle),
            "the failing rank's message lacks {needle:?}: {message:?}"
        );
        assert!(
            text.contains(needle),
            "the report lacks {needle:?}:\n{text}"
        );
    }
}

#[test]
fn shape_mismatch_names_both_ranks_and_shapes() {
    let _guard = parallel();
    assert_mismatch(
        |ctx| {
            let n = if ctx.rank() == 0 { 4 } else { 8 };
            let t = Tensor::ones([n], (Kind::Float, Device::Cpu));
            ctx.group().all_reduce(&t, ReduceOp::Sum)
        },
        &["[4]", "[8]"],
    );
}

#[test]
fn dtype_mismatch_names_both_ranks_and_dtypes() {
    let _guard = parallel();
    assert_mismatch(
        |ctx| {
            let kind = if ctx.rank() == 0 {
                Kind::Float
            } else {
                Kind::Double
            };
            let t = Tensor::ones([4], (kind, Device::Cpu));
            ctx.group().all_reduce(&t, ReduceOp::Sum)
        },
        &["f32[4]", "f64[4]"],
    );
}

#[test]
fn op_mismatch_names_both_ranks_and_ops() {
    let _guard = parallel();
    assert_mismatch(
        |ctx| {
            let input = Tensor::ones([4], (Kind::Float, Device::Cpu));
            if ctx.rank() == 0 {
                ctx.group().all_reduce(&input, ReduceOp::Sum)
            } else {
                let output = Tensor::zeros([8], (Kind::Float, Device::Cpu));
                ctx.group().all_gather(&output, &input)
            }
        },
        &["all_reduce", "all_gather"],
    );
}

// ---------------------------------------------------------------------------------------
// Skips.
// ---------------------------------------------------------------------------------------

fn must_not_run(_: &lockstep_harness::RankCtx) {
    panic!("the body of a skipped run ran");
}

#[test]
fn too_few_gpus_skips_without_running() {
    let _guard = parallel();
    let result = Run::new(2).gpus(2).try_run(must_not_run);
    match result {
        Ok(Outcome::Skipped(reason)) => assert_eq!(reason, "needs 2 GPUs, found 0"),
        other => panic!("expected a skip, got {other:?}"),
    }
}

#[test]
fn nccl_backend_without_gpus_skips_without_running() {
    let _guard = parallel();
    let result = Run::new(2).backend("nccl").try_run(must_not_run);
    let reason = match result {
        Ok(Outcome::Skipped(reason)) => reason,
        other => panic!("expected a skip, got {other:?}"),
    };
    if cfg!(feature = "nccl") {
        assert_eq!(reason, "needs 2 GPUs, found 0");
    } else {
        assert!(
            reason.contains("NCCL") || reason.contains("nccl"),
            "skip reason {reason:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// Exec spawn mode.
// ---------------------------------------------------------------------------------------

#[test]
fn exec_mode_runs_every_rank() {
    let _guard = parallel();
    let result = Run::new(2)
        .timeout(Duration::from_secs(60))
        .spawn(SpawnMode::Exec)
        .try_run(|ctx| {
            let t = Tensor::from_slice(&[ctx.rank() as f32 + 1.0, 10.0]);
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
            assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![3.0, 20.0]);
            Ok::<(), CommError>(())
        });
    match result {
        Ok(Outcome::Passed(summary)) => {
            assert_eq!(summary.ranks.len(), 2);
            for r in &summary.ranks {
                assert_eq!(r.end, RankEnd::Success, "rank {}: {r:?}", r.rank);
            }
        }
        Ok(other) => panic!("expected Passed, got {other:?}"),
        Err(e) => panic!("exec-mode run failed:\n{e}"),
    }
}

#[test]
fn exec_mode_reports_a_panicking_rank() {
    let _guard = parallel();
    let started = Instant::now();
    let result = Run::new(2)
        .timeout(Duration::from_secs(60))
        .spawn(SpawnMode::Exec)
        .try_run(|ctx| {
            if ctx.rank() == 1 {
                println!("exec rank one prints before failing");
                panic!("exec rank one gave up: code 0xBAD");
            }
            sleep_long();
        });
    let elapsed = started.elapsed();
    let report = rank_failed(result);
    let text = report.to_string();
    assert!(elapsed < PROMPT, "the run took {elapsed:?}\n{text}");
    assert_eq!(report.failed_rank, Some(1), "{text}");
    let failed = report.first_failure().expect("first failure");
    assert_eq!(failed.end, RankEnd::ExitCode(101), "{text}");
    assert!(
        failed
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("exec rank one gave up: code 0xBAD"),
        "{text}"
    );
    assert!(text.contains("rank 1"), "{text}");
    assert!(text.contains("exec rank one gave up: code 0xBAD"), "{text}");
    assert!(
        failed
            .stdout_tail
            .contains("exec rank one prints before failing"),
        "stdout tail {:?}",
        failed.stdout_tail
    );
    assert_others_stopped(&report, 1);
}

// ---------------------------------------------------------------------------------------
// External (torchrun-style) launch.
// ---------------------------------------------------------------------------------------

#[test]
fn external_launch_runs_body_in_process() {
    let _guard = parallel();
    if std::env::var_os(EXTERNAL).is_some() {
        // A rank started by the parent below: RANK/WORLD_SIZE/MASTER_* describe the run.
        let expected_rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
        let pid = std::process::id();
        // Several runs in one process (as several tests would be): each gets its own key
        // namespace on the one store rank 0 keeps, so none sees another's addresses.
        for round in 0..3 {
            lockstep_harness::run(2, |ctx| {
                // External mode runs the body here, in this very process.
                assert_eq!(std::process::id(), pid, "the body ran in another process");
                assert_eq!(ctx.rank(), expected_rank);
                assert_eq!(ctx.world_size(), 2);
                // Nothing set LOCKSTEP_HOST: the published address is loopback's, reachable.
                let addr = ctx.world().peer_address(1 - ctx.rank()).unwrap_or_default();
                assert!(addr.starts_with("127.0.0.1:"), "peer published {addr}");
                assert!(ctx.world().shares_host(&[0, 1]));
                let t = Tensor::from_slice(&[ctx.rank() as f32 + 1.0, 5.0 + round as f32]);
                ctx.group().all_reduce(&t, ReduceOp::Sum)?;
                assert_eq!(
                    Vec::<f32>::try_from(&t).unwrap(),
                    vec![3.0, 10.0 + 2.0 * round as f32]
                );
                Ok::<(), CommError>(())
            });
        }
        // A test declaring another world size is skipped, not indexed out of bounds.
        let outcome = Run::new(4).run(|_ctx| -> Result<(), CommError> {
            panic!("a 4-rank body ran in a 2-rank launch")
        });
        match outcome {
            Outcome::Skipped(reason) => assert!(reason.contains("world size 4"), "{reason}"),
            Outcome::Passed(_) => panic!("the mismatched test was not skipped"),
        }
        println!("external rank {expected_rank} done");
        return;
    }

    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("pick a free port")
        .port();
    let exe = std::env::current_exe().expect("test binary");
    let mut pids = Vec::new();
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let mut cmd = Command::new(&exe);
        cmd.args([
            "launcher::external_launch_runs_body_in_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EXTERNAL, "1")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("LOCKSTEP_SECRET", "external-launch-test-secret")
        .env("LOCKSTEP_COMM_TIMEOUT_SECS", "30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        for var in [
            "LOCKSTEP_RANK",
            "LOCKSTEP_WORLD_SIZE",
            "LOCKSTEP_STORE",
            "LOCKSTEP_RUN_DIR",
            "LOCKSTEP_TEST",
            "LOCKSTEP_BACKEND",
            "LOCKSTEP_SPAWN",
        ] {
            cmd.env_remove(var);
        }
        let child = cmd.spawn().expect("spawn an external rank");
        pids.push(child.id() as libc::pid_t);
        let tx = tx.clone();
        std::thread::spawn(move || {
            let _ = tx.send((rank, child.wait_with_output()));
        });
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut outputs = Vec::new();
    while outputs.len() < 2 {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((rank, output)) => outputs.push((rank, output.expect("wait for an external rank"))),
            Err(_) => {
                for pid in &pids {
                    // SAFETY: kill(2) on our own (possibly already reaped) children.
                    unsafe {
                        libc::kill(*pid, libc::SIGKILL);
                    }
                }
                panic!("externally launched ranks did not finish within 90 s");
            }
        }
    }
    outputs.sort_by_key(|(rank, _)| *rank);
    for (rank, output) in &outputs {
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "external rank {rank} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
            output.status
        );
        assert!(
            stdout.contains(&format!("external rank {rank} done")),
            "external rank {rank} did not run the body:\nstdout:\n{stdout}\nstderr:\n{stderr}"
        );
    }
}

/// Work deferred to the next launch runs on a thread of its own while that launch's ranks are
/// alive, is joined before the launch returns, and keeps the order it was deferred in;
/// without a launch, `finish` runs it here.
#[test]
fn deferred_work_runs_beside_the_next_launch_in_order() {
    use lockstep_harness::launch::background;
    use std::sync::{Arc, Mutex};
    let _guard = serial();
    /// Each task that ran: its name, the thread it ran on, how many ranks were alive then.
    type Seen = Arc<Mutex<Vec<(&'static str, String, usize)>>>;
    let seen: Seen = Arc::default();
    let task = |name: &'static str| {
        let seen = Arc::clone(&seen);
        move || {
            let thread = std::thread::current().name().unwrap_or("").to_owned();
            let ranks = children().len();
            seen.lock().expect("seen").push((name, thread, ranks));
        }
    };
    let here = std::thread::current().name().unwrap_or("").to_owned();
    background::defer(task("first"));
    // Deferring another runs the first here, so they never run out of order.
    background::defer(task("second"));
    assert_eq!(seen.lock().expect("seen").len(), 1);
    let outcome = Run::new(2).run(|ctx| {
        ctx.group().barrier()?;
        // Held until the deferred task saw the ranks: a rank that exits at once would race it.
        std::thread::sleep(Duration::from_millis(300));
        Ok::<(), CommError>(())
    });
    assert!(matches!(outcome, Outcome::Passed(_)), "{outcome:?}");
    {
        let seen = seen.lock().expect("seen");
        assert_eq!(seen[0].0, "first");
        assert_eq!(seen[0].1, here);
        assert_eq!(seen[1].0, "second");
        assert_eq!(seen[1].1, "lockstep-deferred", "{seen:?}");
        assert_eq!(
            seen[1].2, 2,
            "the task ran while both ranks were alive: {seen:?}"
        );
    }
    background::defer(task("third"));
    background::finish();
    background::finish();
    let seen = seen.lock().expect("seen");
    assert_eq!(seen.len(), 3, "every task ran once: {seen:?}");
    assert_eq!((seen[2].0, seen[2].1.as_str()), ("third", here.as_str()));
    assert_no_children("after the launch");
}
