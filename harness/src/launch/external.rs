//! `lockstep matrix`, `lockstep run` and `ParityTest` as ONE RANK EACH under an external
//! launcher (torchrun `--no-python`, `srun`, a script setting `RANK`, `WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`): every process runs the same driver in the same order, so
//! every rank reaches the same launches; a launch does not fork, it joins a run with
//! [`World::from_env_for`] (labelled with the launch, so a rank that took another path is
//! named) and runs its rank's body once in this process.
//!
//! Ranks may sit on hosts that share no filesystem, so what a launch hands back goes through
//! the run's store ([`RunStore`]), never through files: while a body runs, the record and
//! digest "files" of [`super::hand_back::hand_back_json`] are store keys named after the
//! scratch file (whose name `scratch_path` makes the same on every rank); after the body,
//! every rank publishes its outcome with the keys it wrote, reads every rank's outcome and
//! every key into memory, and only then does the launch end (rank 0, which hosts the store,
//! never leaves while another rank still reads). Every rank therefore holds the same records
//! and judges identically.
//!
//! A rank's failure ends the whole external run: its communicators may be broken, and the
//! ranks could not agree on what to run next. Every rank learns the failing rank (the first
//! to fail, by a store counter) and its message from the store, every later launch returns
//! at once without joining ([`stopped`]), and the driver stops with that message.

use super::failed::{one_line, RunFailed};
use super::hand_back::{begin_store_body, end_store_body, receive_handed_back, RankError};
use super::lock;
use crate::RankCtx;
use lockstep_core::comm::flight;
use lockstep_core::comm::{Backend, ExternalLaunch, RunStore, World};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// The external launch this process is a rank of, or why its launcher variables are
/// unusable; `Ok(None)` when no external launcher started it.
static DETECTED: OnceLock<Result<Option<ExternalLaunch>, String>> = OnceLock::new();

/// The failure that stopped the external run, once one did.
static STOPPED: Mutex<Option<RunFailed>> = Mutex::new(None);

/// Scratch names given so far: every rank names them in the same order.
static SCRATCH: AtomicU64 = AtomicU64::new(0);

/// Whether an external launcher started this process: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`
/// and `MASTER_PORT` are all set, and neither Lockstep's launcher (`LOCKSTEP_RANK`) nor a
/// parity test's re-execution (`LOCKSTEP_PARITY_LAUNCH`) started it. Plain `cargo test` and
/// a plain `lockstep matrix` set none of these and are unaffected. `Err` names a launcher
/// variable that is set but malformed.
pub fn detect() -> Result<Option<&'static ExternalLaunch>, String> {
    DETECTED
        .get_or_init(|| {
            let launched_by_lockstep = std::env::var_os("LOCKSTEP_RANK").is_some()
                || super::self_exec::serving().is_some();
            let all_set = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
                .iter()
                .all(|v| std::env::var_os(v).is_some());
            if launched_by_lockstep || !all_set {
                return Ok(None);
            }
            ExternalLaunch::from_env()
                .map(Some)
                .map_err(|e| format!("external launch: {e}"))
        })
        .as_ref()
        .map(Option::as_ref)
        .map_err(Clone::clone)
}

/// The external launch this process is a rank of, if any (malformed variables count as none:
/// the CLI reports them through [`detect`] before running anything).
pub fn launch() -> Option<&'static ExternalLaunch> {
    detect().ok().flatten()
}

/// Why a run of `world_size` ranks cannot run under this external launch, if it cannot (its
/// rows are skipped with this reason).
pub fn world_blocker(world_size: usize) -> Option<String> {
    let launch = launch()?;
    (launch.world_size != world_size).then(|| {
        format!(
            "the external launch has WORLD_SIZE={}; world size {world_size} needs a launch of \
             its own",
            launch.world_size
        )
    })
}

/// The failure that stopped this external run, if one did: nothing runs after it.
pub fn stopped() -> Option<RunFailed> {
    lock(&STOPPED).clone()
}

/// Records `failed` as what stopped the run and returns it.
fn stop(failed: RunFailed) -> RunFailed {
    lock(&STOPPED).get_or_insert(failed).clone()
}

/// A scratch path every rank names alike (a store key in disguise), under an external launch.
pub fn scratch_path(tag: &str) -> Option<PathBuf> {
    launch()?;
    let n = SCRATCH.fetch_add(1, Ordering::AcqRel);
    Some(std::env::temp_dir().join(format!("lockstep-ext-{tag}-{n}.json")))
}

/// One rank's account of a launch, published after its body.
#[derive(Serialize, Deserialize)]
struct RankAccount {
    /// The body's error (or panic), if it failed.
    failed: Option<String>,
    /// The launch's timeout passed on this rank (its watchdog aborted its links and left its
    /// flight recorder under `flight/{rank}`).
    #[serde(default)]
    timed_out: bool,
    /// Its place among the run's failures (1: first).
    order: Option<i64>,
    /// The keys it handed back.
    keys: Vec<String>,
}

/// Runs `body` as this process's rank of a launch of `world_size` ranks labelled `label`,
/// then exchanges outcomes and handed-back values through the store (see the module doc).
/// A failure on any rank comes back, the same on every rank, and stops the run.
pub fn run(
    launch: &ExternalLaunch,
    world_size: usize,
    backend: Backend,
    label: &str,
    timeout: Duration,
    body: &(dyn Fn(&RankCtx) -> Result<(), RankError> + Sync),
) -> Result<(), RunFailed> {
    if let Some(failed) = stopped() {
        return Err(RunFailed {
            line: format!("not run: {}", failed.line),
            ..failed
        });
    }
    if let Some(reason) = world_blocker(world_size) {
        return Err(RunFailed::simple(reason));
    }
    // This process is a rank now: the ranks' thread rule, as a launched rank applies.
    crate::threads::use_rank_threads();
    let rank = launch.rank;
    let world = World::from_env_for(backend, label).map_err(|e| {
        stop(RunFailed::simple(format!(
            "rank {rank} could not join launch `{label}`: {e}"
        )))
    })?;
    let store = world.run_store();
    begin_store_body(store.clone());
    let ctx = RankCtx::new(world, launch.local_rank);
    let watchdog = Watchdog::start(store.clone(), (rank, world_size), label, timeout);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(&ctx)));
    let timed_out = watchdog.stop();
    let keys = end_store_body();
    let failed = match outcome {
        _ if timed_out => Some(format!(
            "timed out after {:.0} s (the launch's --timeout); its links were aborted",
            timeout.as_secs_f64()
        )),
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(panic) => Some(panic_text(panic.as_ref())),
    };
    let order = failed.as_ref().and_then(|_| store.add("failures", 1).ok());
    let mine = RankAccount {
        failed,
        timed_out,
        order,
        keys,
    };
    let published = serde_json::to_vec(&mine)
        .map_err(|e| e.to_string())
        .and_then(|json| {
            store
                .put(&format!("outcome/{rank}"), &json)
                .map_err(|e| e.to_string())
        });
    // Closing this rank's links now frees a peer blocked on it in a collective (it fails
    // with the lost rank) instead of waiting out the collective timeout.
    drop(ctx);
    if let Err(e) = published {
        return Err(stop(RunFailed::simple(format!(
            "rank {rank} could not publish its outcome of launch `{label}`: {e}"
        ))));
    }
    let outcomes = gather(&store, world_size, label).map_err(stop)?;
    if outcomes.iter().any(|o| o.timed_out) {
        return Err(stop(timeout_failure(&store, &outcomes, label, timeout)));
    }
    judge_outcomes(&outcomes, label).map_err(stop)?;
    receive(&store, &outcomes, rank, world_size, label).map_err(stop)
}

/// The launcher's watchdog for a rank with no launcher above it: past the launch's timeout it
/// leaves this rank's flight recorder in the store and aborts every link of the process, so
/// the body stuck in a collective returns (and every peer's with it) instead of waiting out
/// the collective timeout.
struct Watchdog {
    stop: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<bool>,
}

impl Watchdog {
    fn start(
        store: RunStore,
        (rank, world_size): (usize, usize),
        label: &str,
        timeout: Duration,
    ) -> Watchdog {
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let label = label.to_owned();
        let thread = std::thread::spawn(move || {
            match stopped.recv_timeout(timeout) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                // Stopped (or the run's side went away): the body ended in time.
                _ => return false,
            }
            // The recorder first: aborting adds the failed operations to it.
            if let Ok(json) = serde_json::to_vec(&flight::snapshot()) {
                let _ = store.put(&format!("flight/{rank}"), &json);
            }
            // Every rank's watchdog fires about now: let each take its recorder before any
            // abort turns its pending collective into a failed one.
            let deadline = std::time::Instant::now() + FLIGHT_GRACE;
            while std::time::Instant::now() < deadline
                && !(0..world_size).all(|r| store.check(&format!("flight/{r}")).unwrap_or(false))
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            lockstep_core::comm::cpu::link::abort_all(&format!(
                "aborted by rank {rank}'s watchdog: launch `{label}` passed its timeout of {:.0} s",
                timeout.as_secs_f64()
            ));
            if stopped.recv_timeout(STUCK_GRACE).is_ok() {
                return true;
            }
            // Aborting freed no collective: the body is stuck outside communication and
            // will not return. Report for it, then end the process (nothing else can).
            let message = format!(
                "stuck outside any collective: launch `{label}` passed its timeout of {:.0} s \
                 and aborting this rank's links did not end it",
                timeout.as_secs_f64()
            );
            let outcome = RankAccount {
                failed: Some(message.clone()),
                timed_out: true,
                order: store.add("failures", 1).ok(),
                keys: Vec::new(),
            };
            if let Ok(json) = serde_json::to_vec(&outcome) {
                let _ = store.put(&format!("outcome/{rank}"), &json);
            }
            eprintln!("error: rank {rank} {message}; exiting");
            std::process::exit(1)
        });
        Watchdog { stop, thread }
    }

    /// Stops the watchdog; whether it fired.
    fn stop(self) -> bool {
        let _ = self.stop.send(());
        self.thread.join().unwrap_or(true)
    }
}

/// How long a watchdog waits for the other ranks' flight recorders before it aborts links.
const FLIGHT_GRACE: Duration = Duration::from_millis(1500);

/// How long a watchdog that aborted its rank's links waits for the body to return before it
/// concludes the body is stuck outside communication.
const STUCK_GRACE: Duration = Duration::from_secs(2);

/// The failure of a launch whose timeout passed: every rank that published its flight
/// recorder shown, with the desync diagnosis over all of them (as the launcher's timeout
/// report has it).
fn timeout_failure(
    store: &RunStore,
    outcomes: &[RankAccount],
    label: &str,
    timeout: Duration,
) -> RunFailed {
    let late: Vec<usize> = (0..outcomes.len())
        .filter(|&r| outcomes[r].timed_out)
        .collect();
    let dumps: Vec<Option<Vec<flight::OpRecord>>> = (0..outcomes.len())
        .map(|r| {
            let key = format!("flight/{r}");
            let present = store.check(&key).unwrap_or(false);
            present
                .then(|| store.get(&key).ok())
                .flatten()
                .and_then(|bytes| serde_json::from_slice(&bytes).ok())
        })
        .collect();
    let line = format!(
        "launch `{label}` timed out after {:.0} s on rank(s) {late:?}",
        timeout.as_secs_f64()
    );
    let mut details = format!("{line}\n");
    for d in flight::diagnose(&dumps) {
        details.push_str(&format!("diagnosis: {d}\n"));
    }
    for (r, dump) in dumps.iter().enumerate() {
        match dump {
            Some(records) => details.push_str(&format!(
                "rank {r} flight recorder:\n{}\n",
                flight::render(records)
            )),
            None => details.push_str(&format!("rank {r}: no flight recorder\n")),
        }
    }
    RunFailed {
        line: one_line(&line),
        details,
        timed_out: true,
    }
}

/// How long the ranks wait for a missing outcome once another rank has reported a failure:
/// a rank that failed publishes its outcome at once, and its peers fail fast once it closes
/// its links, so a rank still silent after this died without reporting (killed, crashed).
const DEAD_RANK_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Every rank's outcome of launch `label`. With no failure reported, a missing outcome is
/// awaited up to the collective timeout (a rank may still be training); once some rank has
/// reported a failure, ranks still silent [`DEAD_RANK_GRACE`] later are named as dead.
fn gather(store: &RunStore, world_size: usize, label: &str) -> Result<Vec<RankAccount>, RunFailed> {
    let started = std::time::Instant::now();
    let mut outcomes: Vec<Option<RankAccount>> = (0..world_size).map(|_| None).collect();
    let mut failure_seen: Option<std::time::Instant> = None;
    loop {
        for (r, slot) in outcomes.iter_mut().enumerate() {
            let key = format!("outcome/{r}");
            if slot.is_some() || !store.check(&key).unwrap_or(false) {
                continue;
            }
            let bytes = store.get(&key).map_err(|e| {
                RunFailed::simple(format!("launch `{label}`: reading rank {r}'s outcome: {e}"))
            })?;
            let outcome: RankAccount = serde_json::from_slice(&bytes).map_err(|e| {
                RunFailed::simple(format!(
                    "launch `{label}`: rank {r}'s outcome is unreadable: {e}"
                ))
            })?;
            if outcome.failed.is_some() && failure_seen.is_none() {
                failure_seen = Some(std::time::Instant::now());
            }
            *slot = Some(outcome);
        }
        let missing: Vec<usize> = (0..world_size).filter(|&r| outcomes[r].is_none()).collect();
        if missing.is_empty() {
            return Ok(outcomes.into_iter().flatten().collect());
        }
        if failure_seen.is_some_and(|t| t.elapsed() >= DEAD_RANK_GRACE) {
            return Err(dead_ranks(&outcomes, &missing, label));
        }
        if started.elapsed() >= store.timeout() {
            return Err(RunFailed::simple(format!(
                "launch `{label}`: rank(s) {missing:?} never reported how their rank ended \
                 within the collective timeout ({:.0} s): still in a collective, or stalled",
                store.timeout().as_secs_f64()
            )));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The failure of a launch in which ranks `missing` died without reporting: they are named
/// first (the ranks that reported failed because they lost them), every reported failure
/// in the details.
fn dead_ranks(outcomes: &[Option<RankAccount>], missing: &[usize], label: &str) -> RunFailed {
    let line = format!(
        "rank(s) {missing:?} died in launch `{label}` or were cut off, without reporting \
         (killed, crashed or unreachable: no outcome {:.0} s after the first failure reported \
         by their peers)",
        DEAD_RANK_GRACE.as_secs_f64()
    );
    let mut details = format!("{line}\n");
    for (r, o) in outcomes.iter().enumerate() {
        if let Some(m) = o.as_ref().and_then(|o| o.failed.as_ref()) {
            details.push_str(&format!("rank {r}: {m}\n"));
        }
    }
    RunFailed {
        line: one_line(&line),
        details,
        timed_out: false,
    }
}

/// The launch's failure, if any rank failed: the first to fail named, every failing rank's
/// message in the details.
fn judge_outcomes(outcomes: &[RankAccount], label: &str) -> Result<(), RunFailed> {
    let failed: Vec<(usize, &RankAccount, &String)> = outcomes
        .iter()
        .enumerate()
        .filter_map(|(r, o)| o.failed.as_ref().map(|m| (r, o, m)))
        .collect();
    let Some(&(first, _, message)) = failed
        .iter()
        .min_by_key(|(r, o, _)| (o.order.unwrap_or(i64::MAX), *r))
    else {
        return Ok(());
    };
    let line = format!("rank {first} failed in launch `{label}`: {message}");
    let mut details = format!("{line}\n");
    for (r, _, m) in &failed {
        details.push_str(&format!("rank {r}: {m}\n"));
    }
    Err(RunFailed {
        line: one_line(&line),
        details,
        timed_out: false,
    })
}

/// Reads every key every rank handed back into this process, then waits until every rank
/// has (so rank 0, which hosts the store, never leaves while another still reads).
fn receive(
    store: &RunStore,
    outcomes: &[RankAccount],
    rank: usize,
    world_size: usize,
    label: &str,
) -> Result<(), RunFailed> {
    let fail = |e: &dyn std::fmt::Display| {
        RunFailed::simple(format!(
            "launch `{label}`: rank {rank} could not read what the ranks handed back: {e}"
        ))
    };
    let mut got = HashMap::new();
    for key in outcomes.iter().flat_map(|o| &o.keys) {
        got.insert(key.clone(), store.get(key).map_err(|e| fail(&e))?);
    }
    receive_handed_back(got);
    store
        .put(&format!("received/{rank}"), b"")
        .map_err(|e| fail(&e))?;
    for r in 0..world_size {
        store.get(&format!("received/{r}")).map_err(|e| fail(&e))?;
    }
    Ok(())
}

/// A panic's message.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    format!("panicked: {text}")
}
