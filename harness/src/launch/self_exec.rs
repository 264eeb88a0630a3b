//! Parity tests under plain `cargo test`: ranks started by re-executing the test binary.
//!
//! Forking a rank from a process in which other threads run (libtest's other tests) can hand
//! the child a lock held forever, so where fork is not safe
//! ([`crate::fork_is_safe_here`]) a launch of forked ranks becomes a launch of
//! exec'd ones: each rank is the test binary re-run with the test's exact name
//! (`NAME --exact --nocapture --test-threads 1`), told by [`LAUNCH`] which launch of the
//! test it is a rank of. The re-run test executes the same code from the start; every launch
//! it reaches before its own is skipped (no process is started, no reference computed), and
//! at its own it joins the launcher's run as a rank and exits. A parity test the re-run
//! reaches before the one holding its launch passes with an empty report (the launcher
//! judges it), so a test may hold several `assert_parity` calls. Launches are named by what
//! they run and how many launches of that name the test made before, so a rank finds its
//! launch as long as the test makes the same launches in the same order when re-run: a test
//! that asserts a parity test *fails* and then runs another, or chooses what to run from an
//! outcome, does not (its rank fails saying so: run it under nextest, or split it).
//!
//! Slower than fork (each rank loads libtorch afresh: about 0.4 s of CPU per rank here).

use super::failed::{launch_failed, RunFailed};
use super::hand_back::RankError;
use super::{launch, LaunchOptions, RankCommand, RankSpawn};
use crate::RankCtx;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

/// Whether this exec'd rank found its launch (checked when the process exits).
static MATCHED: AtomicBool = AtomicBool::new(false);
/// Registers [`exit_unmatched`] once per exec'd rank.
static AT_EXIT: Once = Once::new();

/// Runs when an exec'd rank's process exits: a rank that re-ran its whole test without
/// finding its launch would otherwise exit 0 as if it had served, leaving its peers waiting
/// at rendezvous; it exits 3 with why instead.
extern "C" fn exit_unmatched() {
    if MATCHED.load(Ordering::SeqCst) {
        return;
    }
    let want = serving().unwrap_or_default();
    eprintln!(
        "lockstep: this exec'd rank re-ran its test and never reached launch `{want}`: the \
         test made different launches when re-run (does it choose what to run from a run's \
         outcome?); run it with `cargo nextest run`, where ranks are forked"
    );
    // SAFETY: `_exit` ends the process at once; nothing after it runs.
    unsafe { libc::_exit(3) }
}

/// Set in an exec'd rank's environment: the name of the launch (`label#n`) it belongs to.
pub const LAUNCH: &str = "LOCKSTEP_PARITY_LAUNCH";
/// Set in an exec'd rank's environment: where rank 0 writes its record (the launcher's
/// scratch path, which the re-run test cannot derive itself).
pub const RECORD: &str = "LOCKSTEP_PARITY_RECORD";

/// Set in an exec'd rank's environment: the launcher's pid and test name, from which
/// [`scratch_file`] names the files the launcher shares with its ranks.
pub const OWNER: &str = "LOCKSTEP_PARITY_OWNER";

thread_local! {
    /// How many launches of each label this thread (one test) has made so far.
    static LAUNCHES: RefCell<HashMap<String, usize>> = RefCell::new(HashMap::new());
    /// How many scratch files of each tag this thread (one test) has named so far.
    static SCRATCH: RefCell<HashMap<String, usize>> = RefCell::new(HashMap::new());
}

/// This launcher's pid and test (thread) name: what [`OWNER`] carries to its ranks.
fn owner() -> String {
    format!(
        "{}/{}",
        std::process::id(),
        std::thread::current().name().unwrap_or("main")
    )
}

/// A scratch file a launch's ranks write and its launcher reads (rank 0's optimizer state,
/// say): the same path in the launcher and in every exec'd rank re-running its test, since
/// it is named from the launcher's pid and test and how many files of `tag` the test named
/// before; unique per process, test thread and call.
pub fn scratch_file(tag: &str, ext: &str) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let n = SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        let n = s.entry(tag.to_owned()).or_insert(0);
        *n += 1;
        *n - 1
    });
    let owner = match serving() {
        Some(_) => std::env::var(OWNER).unwrap_or_else(|_| owner()),
        None => owner(),
    };
    // `DefaultHasher::new()` has fixed keys: every process hashes the owner alike.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    owner.hash(&mut h);
    std::env::temp_dir().join(format!("lockstep-{tag}-{:016x}-{n}.{ext}", h.finish()))
}

/// The next launch name for `label` on this thread: `label#0`, `label#1`, ...
fn next_name(label: &str) -> String {
    LAUNCHES.with(|l| {
        let mut l = l.borrow_mut();
        let n = l.entry(label.to_owned()).or_insert(0);
        let name = format!("{label}#{n}");
        *n += 1;
        name
    })
}

/// The launch this process is an exec'd rank of, if it is one.
pub fn serving() -> Option<String> {
    std::env::var(LAUNCH).ok()
}

/// Where an exec'd rank's launcher reads rank 0's record, if this process is such a rank.
pub fn record_path() -> Option<PathBuf> {
    serving()?;
    std::env::var_os(RECORD).map(PathBuf::from)
}

/// Whether launches from this thread exec their ranks: exec wherever fork is not safe (a
/// multi-threaded `cargo test`). On a test's own thread `LOCKSTEP_SPAWN=exec|fork` decides
/// when set (a program's main thread, such as `lockstep matrix`, always forks: it has no
/// test to re-run).
pub fn execs_here() -> Result<bool, RunFailed> {
    let on_test_thread = std::thread::current().name().is_some_and(|n| n != "main");
    if !on_test_thread {
        return Ok(!crate::fork_is_safe_here());
    }
    match std::env::var("LOCKSTEP_SPAWN").ok().as_deref() {
        Some("exec") => Ok(true),
        Some("fork") => Ok(false),
        Some(other) => Err(RunFailed::simple(format!(
            "LOCKSTEP_SPAWN={other:?}: expected exec or fork"
        ))),
        None => Ok(!crate::fork_is_safe_here()),
    }
}

/// Why a launch was not made in an exec'd rank (it belongs to another launch).
const SKIPPED: &str = "skipped: this process is an exec'd rank of another launch";

/// Where fork is not safe, where ranks compute on CUDA (`cuda`), or in an exec'd rank, runs a
/// launch of `world_size` ranks named `label` without forking and returns its outcome; `None`
/// means fork (the caller does).
///
/// In the launcher: starts every rank as a re-run of this test ([`RECORD`] set to `out`).
/// In an exec'd rank: runs `body` as this rank when this is its launch (never returns),
/// else returns at once with the launch skipped.
pub fn launch_without_fork(
    world_size: usize,
    timeout: std::time::Duration,
    label: &str,
    out: &std::path::Path,
    faults: bool,
    cuda: bool,
    body: &(dyn Fn(&RankCtx) -> Result<(), RankError> + Sync),
) -> Option<Result<(), RunFailed>> {
    if let Some(want) = serving() {
        AT_EXIT.call_once(|| {
            // SAFETY: registers a plain `extern "C"` function with no captured state.
            unsafe {
                libc::atexit(exit_unmatched);
            }
        });
        if next_name(label) == want {
            MATCHED.store(true, Ordering::SeqCst);
            crate::rank_main(|ctx: &RankCtx| body(ctx));
        }
        return Some(Err(RunFailed::simple(SKIPPED)));
    }
    // CUDA cannot be used in a forked child: ranks computing on it are always exec'd.
    match execs_here() {
        Ok(false) if !cuda => return None,
        Ok(_) => {}
        Err(e) => return Some(Err(e)),
    }
    let name = next_name(label);
    Some(exec_launch(world_size, timeout, &name, out, faults))
}

/// Starts `world_size` re-runs of the current test as the ranks of launch `name`.
fn exec_launch(
    world_size: usize,
    timeout: std::time::Duration,
    name: &str,
    out: &std::path::Path,
    faults: bool,
) -> Result<(), RunFailed> {
    if faults {
        return Err(RunFailed::simple(
            "a fault plan (sensitivity analysis) runs in forked ranks only: run the test \
             with `cargo nextest run`, or `cargo test -- --test-threads=1 --nocapture`",
        ));
    }
    let test = std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .map(str::to_owned)
        .ok_or_else(|| {
            RunFailed::simple(
                "ranks are exec'd as re-runs of the running test, and this thread is not a \
                 test's (its name is not the test's): call the parity test from the test \
                 function's own thread, or run under `cargo nextest run`",
            )
        })?;
    let program = std::env::current_exe()
        .map_err(|e| RunFailed::simple(format!("cannot find the test binary: {e}")))?;
    let out = out.to_str().ok_or_else(|| {
        RunFailed::simple(format!(
            "exec'd ranks are told their record's path in the environment, and {} is not \
             UTF-8: set TMPDIR to a UTF-8 path",
            out.display()
        ))
    })?;
    let owner = owner();
    let command = |_rank: usize| RankCommand {
        program: program.clone(),
        args: vec![
            test.clone(),
            "--exact".into(),
            "--nocapture".into(),
            "--test-threads".into(),
            "1".into(),
        ],
        env: vec![
            (LAUNCH.to_owned(), name.to_owned()),
            (RECORD.to_owned(), out.to_owned()),
            (OWNER.to_owned(), owner.clone()),
        ],
    };
    let opts = LaunchOptions {
        world_size,
        timeout,
        backend: "cpu".into(),
    };
    launch(&opts, RankSpawn::Exec(&command))
        .map(drop)
        .map_err(launch_failed)
}
