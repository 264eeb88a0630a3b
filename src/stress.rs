//! `lockstep stress`: runs a matrix selection again and again under injected load and counts
//! the hangs, so an intermittent deadlock is found by a command rather than by luck.
//!
//! The load is threefold: busy threads in this process (the launcher, competing with the
//! ranks for the cores), a random delay before every message each rank sends (set here and
//! inherited by every forked rank), and the matrix's own ranks, several per core. A run past
//! `--timeout` is a hang: the first one's whole account (every rank's flight recorder and the
//! desync diagnosis) is printed, and the command exits 1.

use crate::matrix::{self, Plan, RowStatus};
use lockstep_core::comm::cpu::chaos;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How hard and how long to stress.
#[derive(Clone, Debug)]
pub struct StressOptions {
    /// Times the whole selection runs.
    pub repeat: usize,
    /// Busy threads spinning in this process for the whole stress.
    pub busy_threads: usize,
    /// Longest random delay before every message a rank sends (zero: none).
    pub max_send_delay: Duration,
}

/// What a stress found.
#[derive(Debug, Default)]
pub struct StressOutcome {
    /// Iterations completed.
    pub iterations: usize,
    /// Launches and in-process runs over all iterations.
    pub runs: usize,
    /// Runs that outlived the timeout.
    pub hangs: usize,
    /// Runs that failed otherwise (crash, error).
    pub errors: usize,
    /// Comparisons that failed their parity check, over all iterations.
    pub parity_failures: usize,
    /// The first hang's (or else failure's) whole account.
    pub first_failure: Option<String>,
    /// Wall time.
    pub elapsed: Duration,
}

impl StressOutcome {
    /// Whether no run hung or failed (parity verdicts are the matrix's business).
    pub fn clean(&self) -> bool {
        self.hangs == 0 && self.errors == 0
    }

    /// The closing summary.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Some(f) = &self.first_failure {
            let _ = writeln!(out, "first failure:\n{f}\n");
        }
        let _ = writeln!(
            out,
            "stress: {}, {} in {:.1} s: hangs found = {}, other run errors = {}, parity failures = {}",
            lockstep_harness::report::plural(self.iterations, "iteration"),
            lockstep_harness::report::plural(self.runs, "run"),
            self.elapsed.as_secs_f64(),
            self.hangs,
            self.errors,
            self.parity_failures
        );
        out
    }
}

/// Spins until dropped.
struct BusyThreads {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyThreads {
    fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .filter_map(|i| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name(format!("lockstep-busy-{i}"))
                    .spawn(move || {
                        let mut x = i as u64;
                        while !stop.load(Ordering::Relaxed) {
                            x = std::hint::black_box(x.wrapping_mul(6364136223846793005) ^ 1);
                        }
                    })
                    .ok()
            })
            .collect();
        BusyThreads { stop, threads }
    }
}

impl Drop for BusyThreads {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs `plan` `opts.repeat` times under the load `opts` describes; `progress` gets one line
/// per iteration.
pub fn run(plan: &Plan, opts: &StressOptions, mut progress: impl FnMut(&str)) -> StressOutcome {
    let started = Instant::now();
    let _busy = BusyThreads::start(opts.busy_threads);
    // Forked ranks inherit this process's setting.
    chaos::set_max_delay(opts.max_send_delay);
    let mut outcome = StressOutcome::default();
    for i in 1..=opts.repeat {
        let result = matrix::run_quietly(plan);
        outcome.iterations = i;
        outcome.runs += result.runs;
        outcome.hangs += result.hung_runs;
        outcome.errors += result.failed_runs - result.hung_runs;
        let failures = result
            .rows
            .iter()
            .filter(|r| r.status == RowStatus::Fail)
            .count();
        outcome.parity_failures += failures;
        // The first hang, or else the first failed run, is the one worth reading.
        let failed = result
            .rows
            .iter()
            .find(|r| r.timed_out)
            .or_else(|| result.rows.iter().find(|r| r.status == RowStatus::Error));
        if let (None, Some(r)) = (&outcome.first_failure, failed) {
            outcome.first_failure = Some(format!(
                "{} {} (iteration {i}):\n{}",
                r.model,
                r.config,
                r.details.as_deref().or(r.note.as_deref()).unwrap_or("")
            ));
        }
        progress(&format!(
            "[{i}/{}] {} in {:.1} s: {} hung, {} failed, {}",
            opts.repeat,
            lockstep_harness::report::plural(result.runs, "run"),
            result.elapsed.as_secs_f64(),
            result.hung_runs,
            result.failed_runs - result.hung_runs,
            lockstep_harness::report::plural(failures, "parity failure")
        ));
    }
    chaos::set_max_delay(Duration::ZERO);
    outcome.elapsed = started.elapsed();
    outcome
}
