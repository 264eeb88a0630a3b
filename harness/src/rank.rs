//! The rank side: what a re-executed test process (or a torchrun-launched one) does.

use crate::launch::{env, write_dump, RankInfo};
use lockstep_core::comm::{Backend, DeviceMesh, InitOptions, PointToPoint, ProcessGroup, World};
use lockstep_core::CommError;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// What a rank body may return: `()` or any `Result` whose error displays.
pub trait RankResult {
    /// `Err` with the message to report when the rank failed.
    fn into_outcome(self) -> Result<(), String>;
}

impl RankResult for () {
    fn into_outcome(self) -> Result<(), String> {
        Ok(())
    }
}

impl<E: std::fmt::Display> RankResult for Result<(), E> {
    fn into_outcome(self) -> Result<(), String> {
        self.map_err(|e| e.to_string())
    }
}

/// Everything a rank body gets: its identity, the world and its groups.
pub struct RankCtx {
    world: World,
    local_rank: usize,
}

impl RankCtx {
    /// Wraps an initialized world (used by the CLI's own rank processes).
    pub fn new(world: World, local_rank: usize) -> Self {
        RankCtx { world, local_rank }
    }

    /// This rank's global rank.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world.size()
    }

    /// This rank's index on its machine (its GPU).
    pub fn local_rank(&self) -> usize {
        self.local_rank
    }

    /// The group of all ranks.
    pub fn group(&self) -> Arc<dyn ProcessGroup> {
        self.world.group()
    }

    /// The world, for creating sub-groups.
    pub fn world(&self) -> &World {
        &self.world
    }

    /// A device mesh over the world.
    pub fn mesh(&self, dims: &[(&str, usize)]) -> Result<DeviceMesh, CommError> {
        DeviceMesh::new(&self.world, dims)
    }

    /// The device this rank computes on: its GPU under NCCL, else the CPU.
    pub fn device(&self) -> tch::Device {
        match self.world.backend() {
            Backend::Nccl => tch::Device::Cuda(self.local_rank),
            Backend::Cpu => tch::Device::Cpu,
        }
    }
}

/// How a rank process learned its place in the run.
pub(crate) struct RankEnv {
    opts: InitOptions,
    local_rank: usize,
    run_dir: Option<PathBuf>,
    external: bool,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

impl RankEnv {
    /// Set when this process is a rank the harness launched for test `name`.
    pub(crate) fn for_test(name: &str) -> Option<RankEnv> {
        if var(env::TEST)? != name {
            return None;
        }
        Self::from_launcher()
    }

    /// Set when this process is a rank the harness's `launch` executed (any command).
    pub(crate) fn from_launcher() -> Option<RankEnv> {
        let info = RankInfo {
            rank: var(env::RANK)?.parse().ok()?,
            world_size: var(env::WORLD_SIZE)?.parse().ok()?,
            store: var(env::STORE)?,
            secret: var(env::SECRET)?,
            run_dir: PathBuf::from(var(env::RUN_DIR)?),
            backend: var(env::BACKEND).unwrap_or_else(|| "cpu".into()),
        };
        let mut env = Self::from_info(&info);
        if let Some(local) = var("LOCAL_RANK").and_then(|v| v.parse().ok()) {
            env.local_rank = local;
            env.opts.device = local;
        }
        Some(env)
    }

    /// The rank described by the launcher (a forked child gets it directly).
    pub(crate) fn from_info(info: &RankInfo) -> RankEnv {
        let mut opts = InitOptions::local(
            info.rank,
            info.world_size,
            info.store.clone(),
            info.secret.clone(),
        );
        opts.backend = info.backend.parse().unwrap_or(Backend::Cpu);
        opts.device = info.rank;
        opts.shm_tag = crate::launch::shm_tag(&info.run_dir);
        RankEnv {
            opts,
            local_rank: info.rank,
            run_dir: Some(info.run_dir.clone()),
            external: false,
        }
    }

    /// Set when torchrun/SLURM-style variables describe this process (and the harness did not
    /// launch it); `label` (the test name) is checked against every other rank's.
    pub(crate) fn external(label: &str) -> Option<RankEnv> {
        if var(env::RANK).is_some() {
            return None;
        }
        for v in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"] {
            var(v)?;
        }
        let local_rank = var("LOCAL_RANK").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut opts = InitOptions::local(0, 1, String::new(), String::new());
        opts.run_label = label.to_owned();
        Some(RankEnv {
            opts,
            local_rank,
            run_dir: None,
            external: true,
        })
    }

    fn join(&self) -> Result<World, CommError> {
        if self.external {
            let backend = var(env::BACKEND)
                .map(|b| b.parse())
                .transpose()?
                .unwrap_or(Backend::Cpu);
            World::from_env_for(backend, &self.opts.run_label)
        } else {
            let mut opts = self.opts.clone();
            opts.p2p = PointToPoint::from_env()?;
            World::init(opts)
        }
    }
}

static PANIC_MESSAGE: Mutex<Option<String>> = Mutex::new(None);

/// Store counter giving every rank failure its place in time.
const FAILURE_COUNTER: &str = "lockstep/failure_count";

/// Writes to the process's real stderr, bypassing libtest's output capture (which a forked
/// rank inherits and which nobody would ever print).
fn report_line(text: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// Runs `body` as a launched rank and returns the process exit code: 0 on success, 1 for a
/// returned error, 101 for a panic. The failure message also goes to the store so the
/// launcher can quote it exactly.
pub(crate) fn execute_rank<F, R>(rank_env: RankEnv, body: &F) -> i32
where
    F: Fn(&RankCtx) -> R + ?Sized,
    R: RankResult,
{
    let rank = rank_env.opts.rank;
    // The one thread rule (`crate::threads`), shared with in-process references.
    crate::threads::use_rank_threads();
    if let Some(dir) = &rank_env.run_dir {
        install_dump_handler(dir.clone(), rank);
    }
    std::panic::set_hook(Box::new(move |info| {
        let text = info.to_string();
        report_line(&format!("rank {rank} {text}"));
        *PANIC_MESSAGE.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
    }));
    let world = match rank_env.join() {
        Ok(w) => w,
        Err(e) => {
            report_line(&format!("lockstep rank {rank}: cannot join the run: {e}"));
            return 1;
        }
    };
    let store = world.store().clone();
    let ctx = RankCtx::new(world, rank_env.local_rank);
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(&ctx).into_outcome()));
    let (message, code) = match outcome {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => (format!("returned an error: {e}"), 1),
        Err(_) => {
            let text = PANIC_MESSAGE
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or_else(|| "panicked".into());
            (text, 101)
        }
    };
    report_line(&format!("lockstep rank {rank} failed: {message}"));
    // Recorded before this rank's connections close (the world drops after), so the launcher
    // can tell the rank that failed first from the ranks that then lost it.
    if let Ok(order) = store.add(FAILURE_COUNTER, 1) {
        let _ = store.set(
            &format!("lockstep/failed_order/{rank}"),
            order.to_string().as_bytes(),
        );
    }
    let _ = store.set(&format!("lockstep/failed/{rank}"), message.as_bytes());
    code
}

/// Runs `body` as an executed rank process and exits with its outcome.
pub(crate) fn run_rank<F, R>(rank_env: RankEnv, body: &F) -> !
where
    F: Fn(&RankCtx) -> R + ?Sized,
    R: RankResult,
{
    let code = execute_rank(rank_env, body);
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::process::exit(code)
}

/// Runs `body` in a process an external launcher started; panics on failure.
pub(crate) fn run_external<F, R>(rank_env: RankEnv, body: &F)
where
    F: Fn(&RankCtx) -> R + ?Sized,
    R: RankResult,
{
    // The same thread rule as a launched rank's (an external launcher may set
    // OMP_NUM_THREADS or nothing at all).
    crate::threads::use_rank_threads();
    let world = match rank_env.join() {
        Ok(w) => w,
        Err(e) => panic!("cannot join the externally launched run: {e}"),
    };
    let rank = world.rank();
    let ctx = RankCtx::new(world, rank_env.local_rank);
    if let Err(e) = body(&ctx).into_outcome() {
        panic!("rank {rank} failed: {e}");
    }
}

/// On SIGUSR1 (sent by the launcher at a timeout) write the flight recorder to the run dir.
fn install_dump_handler(dir: PathBuf, rank: usize) {
    if let Ok(mut signals) = signal_hook::iterator::Signals::new([signal_hook::consts::SIGUSR1]) {
        let _ = std::thread::Builder::new()
            .name("lockstep-dump".into())
            .spawn(move || {
                for _ in signals.forever() {
                    write_dump(&dir, rank);
                }
            });
    }
}

/// Runs `body` as the rank a forked launcher child was given, returning the exit code
/// (for [`crate::RankSpawn::Fork`] users outside tests, such as the CLI's benchmarks).
pub fn execute_forked_rank<F, R>(info: RankInfo, body: &F) -> i32
where
    F: Fn(&RankCtx) -> R + ?Sized,
    R: RankResult,
{
    execute_rank(RankEnv::from_info(&info), body)
}

/// Entry point for binaries (like the CLI) whose rank processes were started by
/// [`crate::launch()`]: joins the run and calls `body`, exiting with its outcome.
pub fn rank_main<F, R>(body: F) -> !
where
    F: Fn(&RankCtx) -> R,
    R: RankResult,
{
    match RankEnv::from_launcher() {
        Some(env) => run_rank(env, &body),
        None => {
            eprintln!("this process must be started by the Lockstep launcher");
            std::process::exit(2)
        }
    }
}
