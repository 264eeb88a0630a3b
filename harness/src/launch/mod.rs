//! Launching a run's ranks, in one place: [`run_ranks`] chooses the mode ([`mode`](self):
//! forked, the calling test re-run ([`self_exec`]), a command exec'd per rank, or this process
//! as one rank of torchrun/srun ([`external`])), [`hand_back`] brings rank 0's record and
//! every rank's state digest back (a file, or a store key), and [`RunFailed`] is what comes
//! back otherwise.
//!
//! This file is the parent side every mode but the external one shares: it starts one process
//! per rank, hosts the store, watches the ranks, and turns whatever went wrong into a report
//! that names the rank and says why.

pub mod background;
pub mod external;
mod failed;
pub mod hand_back;
mod mode;
mod scratch;
pub mod self_exec;

pub use failed::{launch_failed, one_line, RunFailed};
pub use hand_back::RankError;
pub use mode::{
    run_ranks, shares_one_launch, ExecCommand, RankBody, RankLaunch, NCCL_RUNS_MISSING,
};
pub use scratch::{scratch_dir, scratch_path};

use crate::error::{LaunchError, RankEnd, RankReport};
use lockstep_core::comm::flight::{self, OpRecord};
use lockstep_core::comm::StoreServer;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `m`'s guard, even after a thread panicked holding it: the launcher's shared state stays
/// readable for the report that follows.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Environment variables the launcher hands every rank.
pub mod env {
    /// The rank's global rank.
    pub const RANK: &str = "LOCKSTEP_RANK";
    /// Number of ranks.
    pub const WORLD_SIZE: &str = "LOCKSTEP_WORLD_SIZE";
    /// `host:port` of the launcher's store.
    pub const STORE: &str = "LOCKSTEP_STORE";
    /// The run's secret (also the store's).
    pub const SECRET: &str = "LOCKSTEP_SECRET";
    /// Directory where ranks leave flight-recorder dumps.
    pub const RUN_DIR: &str = "LOCKSTEP_RUN_DIR";
    /// The test a re-executed test binary must run as a rank.
    pub const TEST: &str = "LOCKSTEP_TEST";
    /// `cpu` or `nccl`.
    pub const BACKEND: &str = "LOCKSTEP_BACKEND";
    /// Echo every rank's output live, prefixed with its rank, when set to 1.
    pub const ECHO: &str = "LOCKSTEP_ECHO";
    /// Print the launcher's threads at every fork, when set to 1 (a fork must see only the
    /// launching thread: see `threads_start`).
    pub const TRACE_FORKS: &str = "LOCKSTEP_TRACE_FORKS";
}

/// How many bytes of each rank's output the launcher keeps for reports.
const TAIL_BYTES: usize = 16 << 10;
/// How often the launcher polls its ranks.
const POLL: Duration = Duration::from_millis(5);
/// How long ranks get to write their flight recorders after a timeout.
const DUMP_GRACE: Duration = Duration::from_secs(2);

/// What a rank's process runs: the program and arguments, before the launcher adds env.
#[derive(Clone, Debug)]
pub struct RankCommand {
    /// The executable, usually the current test binary.
    pub program: PathBuf,
    /// Its arguments, identical for every rank.
    pub args: Vec<String>,
    /// Extra environment variables; the launcher's own (`RANK`, the store...) are set after.
    pub env: Vec<(String, String)>,
}

/// Launch settings shared by tests and the CLI.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    /// Ranks to launch, one process each.
    pub world_size: usize,
    /// How long the whole run may take before every rank is stopped and its flight
    /// recorder collected.
    pub timeout: Duration,
    /// Process-group backend name handed to every rank (`cpu` or `nccl`).
    pub backend: String,
}

/// Last bytes of a stream, shared with the thread draining it.
#[derive(Clone, Default)]
struct Tail(Arc<Mutex<VecDeque<u8>>>);

impl Tail {
    fn text(&self) -> String {
        let buf = self.0.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&buf.iter().copied().collect::<Vec<u8>>()).into_owned()
    }
}

fn drain(
    stream: impl Read + Send + 'static,
    tail: Tail,
    echo: Option<(usize, &'static str)>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        while let Ok(n) = reader.read_until(b'\n', &mut line) {
            if n == 0 {
                break;
            }
            if let Some((rank, which)) = echo {
                eprint!("[rank {rank} {which}] {}", String::from_utf8_lossy(&line));
            }
            let mut buf = tail.0.lock().unwrap_or_else(|p| p.into_inner());
            buf.extend(line.iter().copied());
            while buf.len() > TAIL_BYTES {
                buf.pop_front();
            }
            line.clear();
        }
    })
}

struct RankProc {
    pid: libc::pid_t,
    stdout: Tail,
    stderr: Tail,
    drains: Vec<std::thread::JoinHandle<()>>,
    end: Option<RankEnd>,
}

impl RankProc {
    /// Non-blocking check; `Some` once the process ended.
    fn poll(&self) -> Option<RankEnd> {
        let mut status = 0;
        // SAFETY: waitpid on our own child.
        let r = unsafe { libc::waitpid(self.pid, &mut status, libc::WNOHANG) };
        match r {
            0 => None,
            r if r == self.pid => Some(decode_status(status)),
            _ => Some(RankEnd::ExitCode(-1)),
        }
    }

    fn kill(&mut self, why: RankEnd) {
        if self.end.is_none() {
            let mut status = 0;
            // SAFETY: kill and reap our own child.
            unsafe {
                libc::kill(self.pid, libc::SIGKILL);
                libc::waitpid(self.pid, &mut status, 0);
            }
            self.end = Some(why);
        }
    }
}

/// Kills every rank still running when the launcher returns or unwinds.
struct Ranks(Vec<RankProc>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for r in &mut self.0 {
            r.kill(RankEnd::KilledByLauncher);
        }
    }
}

fn decode_status(status: i32) -> RankEnd {
    if libc::WIFEXITED(status) {
        match libc::WEXITSTATUS(status) {
            0 => RankEnd::Success,
            code => RankEnd::ExitCode(code),
        }
    } else if libc::WIFSIGNALED(status) {
        RankEnd::Signal(libc::WTERMSIG(status))
    } else {
        RankEnd::ExitCode(-1)
    }
}

/// A fresh random secret for one run.
pub fn new_secret() -> String {
    let bytes: [u8; 16] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Everything a rank needs to join the run the launcher hosts.
#[derive(Clone, Debug)]
pub struct RankInfo {
    /// This rank, 0-based.
    pub rank: usize,
    /// Ranks in the run.
    pub world_size: usize,
    /// `host:port` of the launcher's store.
    pub store: String,
    /// The run's random secret: the store rejects clients without it.
    pub secret: String,
    /// Where the rank writes its flight recorder when asked.
    pub run_dir: PathBuf,
    /// Process-group backend name (`cpu` or `nccl`).
    pub backend: String,
}

/// How the launcher starts each rank.
pub enum RankSpawn<'a> {
    /// Execute a program per rank (a fresh process image: required for CUDA, which cannot be
    /// used in a forked child of a process that touched it).
    Exec(&'a dyn Fn(usize) -> RankCommand),
    /// Fork the launcher per rank; the child runs the function and exits with the code it
    /// returns. About ten times faster to start than `Exec` (no second libtorch load).
    Fork(&'a dyn Fn(RankInfo) -> i32),
}

fn pipe() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two fresh descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(LaunchError::Invalid(format!(
            "pipe: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn spawn_rank(
    spawn: &RankSpawn<'_>,
    info: RankInfo,
) -> Result<(libc::pid_t, OwnedFd, OwnedFd), LaunchError> {
    let rank = info.rank;
    match spawn {
        RankSpawn::Exec(command) => {
            let spec = command(rank);
            let mut cmd = Command::new(&spec.program);
            cmd.args(&spec.args)
                .envs(spec.env.iter().map(|(k, v)| (k, v)))
                .env(env::RANK, rank.to_string())
                .env(env::WORLD_SIZE, info.world_size.to_string())
                .env(env::STORE, &info.store)
                .env(env::SECRET, &info.secret)
                .env(env::RUN_DIR, &info.run_dir)
                .env(env::BACKEND, &info.backend)
                .env("LOCAL_RANK", rank.to_string())
                .env_remove("RANK")
                .env_remove("WORLD_SIZE")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            // SAFETY: prctl is async-signal-safe; it asks the kernel to kill the rank if the
            // launcher dies, so no rank outlives a crashed or killed test.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let mut child = cmd.spawn().map_err(|e| LaunchError::Spawn {
                rank,
                program: spec.program.display().to_string(),
                source: e,
            })?;
            let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) else {
                return Err(LaunchError::Invalid("rank output pipes missing".into()));
            };
            Ok((
                child.id() as libc::pid_t,
                OwnedFd::from(out),
                OwnedFd::from(err),
            ))
        }
        RankSpawn::Fork(body) => {
            let (out_r, out_w) = pipe()?;
            let (err_r, err_w) = pipe()?;
            let parent = std::process::id() as libc::pid_t;
            if std::env::var(env::TRACE_FORKS).is_ok_and(|v| v == "1") {
                eprintln!(
                    "lockstep: forking rank {rank} from threads {:?}",
                    thread_names()
                );
            }
            // SAFETY: the child only redirects its output and runs the rank body in a process
            // of its own; it never returns into the caller's frames (it exits below).
            let pid = unsafe { libc::fork() };
            if pid < 0 {
                return Err(LaunchError::Spawn {
                    rank,
                    program: "fork".into(),
                    source: std::io::Error::last_os_error(),
                });
            }
            if pid == 0 {
                // SAFETY: plain syscalls in the fresh child.
                unsafe {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                    libc::dup2(out_w.as_raw_fd(), 1);
                    libc::dup2(err_w.as_raw_fd(), 2);
                }
                drop((out_r, out_w, err_r, err_w));
                if !threads_start() {
                    report_broken_fork(rank);
                    // SAFETY: leave at once; nothing of the launcher's may run here.
                    unsafe { libc::_exit(BROKEN_FORK_EXIT) }
                }
                let code = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(info)))
                    .unwrap_or(101);
                use std::io::Write;
                let _ = std::io::stdout().flush();
                let _ = std::io::stderr().flush();
                flush_coverage();
                // SAFETY: leave without running the launcher's atexit handlers or destructors.
                unsafe { libc::_exit(code) }
            }
            drop((out_w, err_w));
            Ok((pid, out_r, err_r))
        }
    }
}

/// Exit code of a forked rank that cannot start threads (see `threads_start`).
pub const BROKEN_FORK_EXIT: i32 = 86;

/// Whether this (freshly forked) process can start a thread. A child inherits every lock
/// another thread of its parent held at the instant of the fork, held forever. Rust's
/// runtime registers every starting and exiting thread under one process-wide lock (the
/// stack-guard registry of its stack-overflow handler), so a fork that lands while any other
/// thread of the launcher starts or exits gives a child in which no thread can ever start:
/// it would hang in rendezvous. The launcher forks with no other thread of its own alive;
/// this probe turns a fork from a process whose *other* threads (a user's) broke that
/// promise into a clear error instead of a hang.
fn threads_start() -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("lockstep-probe".into())
        .spawn(move || {
            let _ = tx.send(());
        });
    spawned.is_ok() && rx.recv_timeout(Duration::from_secs(5)).is_ok()
}

fn report_broken_fork(rank: usize) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr(),
        "lockstep rank {rank}: no thread can start in this forked process: another thread of \
         the launching process held a runtime lock at the fork (threads: {:?}). Launch from a \
         process with no other threads starting or exiting, or use exec mode \
         (LOCKSTEP_SPAWN=exec).",
        thread_names()
    );
}

/// Names of this process's threads (`/proc/self/task/*/comm`).
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .map(|dir| {
            dir.flatten()
                .map(|t| {
                    std::fs::read_to_string(t.path().join("comm"))
                        .unwrap_or_default()
                        .trim()
                        .to_owned()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Runs `world_size` ranks to completion. The first rank to fail stops the others; a run
/// past its timeout collects every rank's flight recorder and is killed.
pub fn launch(opts: &LaunchOptions, spawn: RankSpawn<'_>) -> Result<LaunchSummary, LaunchError> {
    if opts.world_size == 0 {
        return Err(LaunchError::Invalid("world size must be at least 1".into()));
    }
    let secret = new_secret();
    // Bound now, served once every rank is forked: no store thread exists at a fork.
    let store = StoreServer::bind("127.0.0.1:0", &secret)
        .map_err(|e| LaunchError::Invalid(format!("cannot start the store: {e}")))?;
    let run_dir = RunDir::create()?;
    let echo = std::env::var(env::ECHO).is_ok_and(|v| v == "1");
    let started = Instant::now();
    // Start every rank before any output-draining or store thread exists, so no forked rank
    // can inherit a lock one of those threads held at the moment of the fork.
    let (mut ranks, pipes) = spawn_ranks(opts, &spawn, &store, &secret, run_dir.path())?;
    store
        .serve()
        .map_err(|e| LaunchError::Invalid(format!("cannot start the store: {e}")))?;
    for (rank, (r, (out, err))) in ranks.0.iter_mut().zip(pipes).enumerate() {
        r.drains = vec![
            drain(
                std::fs::File::from(out),
                r.stdout.clone(),
                echo.then_some((rank, "out")),
            ),
            drain(
                std::fs::File::from(err),
                r.stderr.clone(),
                echo.then_some((rank, "err")),
            ),
        ];
    }
    // Every rank is forked: the launching process's own work may run beside them.
    let deferred = background::start();
    let summary = watch(&mut ranks, &store, run_dir.path(), started, opts.timeout);
    background::join(deferred);
    summary
}

/// Each rank's stdout and stderr pipes, read by the drain threads once every rank started.
type RankPipes = Vec<(OwnedFd, OwnedFd)>;

/// Starts every rank (forked or exec'd), each with its output pipes.
fn spawn_ranks(
    opts: &LaunchOptions,
    spawn: &RankSpawn<'_>,
    store: &StoreServer,
    secret: &str,
    run_dir: &Path,
) -> Result<(Ranks, RankPipes), LaunchError> {
    let mut ranks = Ranks(Vec::with_capacity(opts.world_size));
    let mut pipes = Vec::with_capacity(opts.world_size);
    for rank in 0..opts.world_size {
        let info = RankInfo {
            rank,
            world_size: opts.world_size,
            store: store.addr().to_string(),
            secret: secret.to_owned(),
            run_dir: run_dir.to_owned(),
            backend: opts.backend.clone(),
        };
        let (pid, out, err) = spawn_rank(spawn, info)?;
        ranks.0.push(RankProc {
            pid,
            stdout: Tail::default(),
            stderr: Tail::default(),
            drains: Vec::new(),
            end: None,
        });
        pipes.push((out, err));
    }
    Ok((ranks, pipes))
}

/// Watches the ranks until every one succeeded, one failed (the others are stopped and the
/// culprit named), or the timeout passed (every rank's flight recorder is dumped first).
fn watch(
    ranks: &mut Ranks,
    store: &StoreServer,
    run_dir: &Path,
    started: Instant,
    timeout: Duration,
) -> Result<LaunchSummary, LaunchError> {
    let deadline = started + timeout;
    loop {
        let mut running = 0;
        let mut first_failure = None;
        for (rank, r) in ranks.0.iter_mut().enumerate() {
            if r.end.is_some() {
                continue;
            }
            match r.poll() {
                Some(end) => {
                    if end != RankEnd::Success && first_failure.is_none() {
                        first_failure = Some(rank);
                    }
                    r.end = Some(end);
                }
                None => running += 1,
            }
        }
        if first_failure.is_some() {
            settle(ranks, store);
            let culprit = culprit(ranks, store);
            stop_all(ranks, RankEnd::KilledByLauncher);
            return Err(LaunchError::RankFailed(reports(
                ranks,
                store,
                Some(culprit),
                None,
            )));
        }
        if running == 0 {
            let elapsed = started.elapsed();
            let rank_reports = reports(ranks, store, None, None);
            return Ok(LaunchSummary {
                elapsed,
                ranks: rank_reports.ranks,
            });
        }
        if Instant::now() >= deadline {
            request_dumps(ranks);
            let dumps = wait_for_dumps(ranks, run_dir);
            // A rank that ended meanwhile says how (SIGUSR1's default action kills a rank that
            // had not yet installed its dump handler: it was stuck before joining the run).
            for r in ranks.0.iter_mut().filter(|r| r.end.is_none()) {
                r.end = r.poll();
            }
            stop_all(ranks, RankEnd::TimedOut);
            let mut report = reports(ranks, store, None, Some(dumps));
            report.timeout = Some(timeout);
            return Err(LaunchError::Timeout(report));
        }
        std::thread::sleep(POLL);
    }
}

/// How a successful launch went.
#[derive(Debug)]
pub struct LaunchSummary {
    /// From the first spawn to the last rank's exit.
    pub elapsed: Duration,
    /// Every rank's report (all successes), in rank order.
    pub ranks: Vec<RankReport>,
}

/// How long the launcher lets near-simultaneous rank endings arrive before judging a failure.
const SETTLE: Duration = Duration::from_millis(50);
/// How long a rank that already reported its failure gets to finish exiting.
const SETTLE_REPORTED: Duration = Duration::from_millis(1000);

/// Records every rank that ends within [`SETTLE`] of the first failure, and waits (briefly)
/// for ranks that reported a failure to the store to exit, so their exit status is known.
fn settle(ranks: &mut Ranks, store: &StoreServer) {
    let start = Instant::now();
    loop {
        for r in ranks.0.iter_mut().filter(|r| r.end.is_none()) {
            r.end = r.poll();
        }
        let reported_alive = ranks.0.iter().enumerate().any(|(rank, r)| {
            r.end.is_none() && store.peek(&format!("lockstep/failed/{rank}")).is_some()
        });
        let elapsed = start.elapsed();
        if elapsed >= SETTLE && (!reported_alive || elapsed >= SETTLE_REPORTED) {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The rank that failed first. A rank whose error says it lost a peer ("lost rank N") is a
/// consequence, not a cause. Among the causes, a rank that died without reporting (a signal,
/// `exit`) comes first, then the earliest reported failure (a store-side counter orders them).
fn culprit(ranks: &Ranks, store: &StoreServer) -> usize {
    let facts: Vec<(usize, bool, Option<i64>, bool)> = ranks
        .0
        .iter()
        .enumerate()
        .filter_map(|(rank, r)| {
            let message = store.peek(&format!("lockstep/failed/{rank}"));
            let ended_badly = r.end.as_ref().is_some_and(|e| *e != RankEnd::Success);
            if message.is_none() && !ended_badly {
                return None;
            }
            let lost = message.is_some_and(|m| String::from_utf8_lossy(&m).contains("lost rank"));
            let order = store
                .peek(&format!("lockstep/failed_order/{rank}"))
                .and_then(|o| String::from_utf8_lossy(&o).parse().ok());
            Some((rank, lost, order, ended_badly))
        })
        .collect();
    facts
        .iter()
        .min_by_key(|(rank, lost, order, _)| (*lost, order.is_some(), order.unwrap_or(0), *rank))
        .map_or(0, |f| f.0)
}

fn stop_all(ranks: &mut Ranks, why: RankEnd) {
    for r in &mut ranks.0 {
        r.kill(why.clone());
    }
}

fn request_dumps(ranks: &Ranks) {
    for r in &ranks.0 {
        if r.end.is_none() {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(r.pid, libc::SIGUSR1);
            }
        }
    }
}

fn dump_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank{rank}.flight.json"))
}

fn wait_for_dumps(ranks: &Ranks, dir: &Path) -> Vec<Option<Vec<OpRecord>>> {
    let until = Instant::now() + DUMP_GRACE;
    loop {
        let dumps: Vec<Option<Vec<OpRecord>>> = (0..ranks.0.len())
            .map(|rank| {
                let text = std::fs::read(dump_path(dir, rank)).ok()?;
                serde_json::from_slice(&text).ok()
            })
            .collect();
        let all = dumps
            .iter()
            .zip(&ranks.0)
            .all(|(d, r)| d.is_some() || r.end.is_some());
        if all || Instant::now() >= until {
            return dumps;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn reports(
    ranks: &mut Ranks,
    store: &StoreServer,
    failed: Option<usize>,
    dumps: Option<Vec<Option<Vec<OpRecord>>>>,
) -> crate::error::FailureReport {
    let mut out = Vec::new();
    for (rank, r) in ranks.0.iter_mut().enumerate() {
        for d in r.drains.drain(..) {
            let _ = d.join();
        }
        out.push(RankReport {
            rank,
            end: r.end.clone().unwrap_or(RankEnd::KilledByLauncher),
            message: store
                .peek(&format!("lockstep/failed/{rank}"))
                .map(|m| String::from_utf8_lossy(&m).into_owned()),
            stdout_tail: r.stdout.text(),
            stderr_tail: r.stderr.text(),
            flight: dumps
                .as_ref()
                .and_then(|d| d.get(rank).cloned().flatten())
                .map(|records| flight::render(&records)),
        });
    }
    crate::error::FailureReport {
        failed_rank: failed,
        ranks: out,
        timeout: None,
        diagnosis: dumps.map(|d| flight::diagnose(&d)).unwrap_or_default(),
    }
}

/// Where a run's ranks drop their flight-recorder dumps; removed when the launch ends.
struct RunDir(PathBuf);

impl RunDir {
    fn create() -> Result<Self, LaunchError> {
        let nonce: u64 = rand::random();
        let dir =
            std::env::temp_dir().join(format!("lockstep-run-{}-{nonce:016x}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| LaunchError::Invalid(format!("cannot create {}: {e}", dir.display())))?;
        Ok(RunDir(dir))
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
        remove_shm_slots(&shm_tag(&self.0));
    }
}

/// The tag of a run's shared-memory slot names, derived from its run directory.
pub(crate) fn shm_tag(run_dir: &Path) -> String {
    let name = run_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    name.rsplit('-').next().unwrap_or_default().to_owned()
}

/// Removes slots a run's ranks left in /dev/shm (a rank killed in the middle of a
/// shared-memory collective never unlinks its slot).
fn remove_shm_slots(tag: &str) {
    if tag.is_empty() {
        return;
    }
    let prefix = format!("lockstep-{tag}-");
    if let Ok(entries) = std::fs::read_dir("/dev/shm") {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

/// Writes this process's flight recorder where the launcher looks for it (rank side), as
/// JSON: the launcher renders every rank's and compares them to name a desync.
pub(crate) fn write_dump(dir: &Path, rank: usize) {
    let Ok(text) = serde_json::to_vec(&flight::snapshot()) else {
        return;
    };
    let path = dump_path(dir, rank);
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(tmp, path);
    }
}

/// Under a coverage build (`cargo llvm-cov` sets `cfg(coverage)`), writes this forked rank's
/// profile before `_exit` skips the handler that would: without it, nothing a forked rank
/// executes would count towards the coverage docs/matrix.md reports.
#[cfg(coverage)]
fn flush_coverage() {
    extern "C" {
        fn __llvm_profile_write_file() -> i32;
    }
    // SAFETY: the profile runtime is linked into every coverage build; writing the profile
    // has no precondition.
    unsafe {
        __llvm_profile_write_file();
    }
}

/// Nothing to flush outside coverage builds.
#[cfg(not(coverage))]
fn flush_coverage() {}
