//! What a failed launch reports: which rank, how it ended, its message and output, and on a
//! hang every rank's flight recorder.

use std::fmt::Write as _;
use std::time::Duration;

/// How one rank's process ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankEnd {
    /// Exited with code 0.
    Success,
    /// Exited with this non-zero code (a rank whose body failed exits non-zero).
    ExitCode(i32),
    /// Killed by this signal number from outside the launcher (a crash, the OOM killer...).
    Signal(i32),
    /// Killed by the launcher because another rank failed first.
    KilledByLauncher,
    /// Killed by the launcher when the run timed out.
    TimedOut,
}

impl std::fmt::Display for RankEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RankEnd::Success => write!(f, "exited successfully"),
            RankEnd::ExitCode(c) => write!(f, "exited with code {c}"),
            RankEnd::Signal(s) => write!(f, "was killed by signal {s} ({})", signal_name(*s)),
            RankEnd::KilledByLauncher => {
                write!(f, "was stopped by the launcher after another rank failed")
            }
            RankEnd::TimedOut => write!(f, "was still running at the timeout"),
        }
    }
}

/// The conventional name of a signal number.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGUSR1 => "SIGUSR1",
        _ => "unknown signal",
    }
}

/// Everything known about one rank after the launch.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// The rank, 0-based, as in `RANK`.
    pub rank: usize,
    /// How its process ended.
    pub end: RankEnd,
    /// The rank's own account of its failure (panic message or returned error).
    pub message: Option<String>,
    /// The last bytes (at most 16 KiB) the rank wrote to stdout.
    pub stdout_tail: String,
    /// The last bytes (at most 16 KiB) the rank wrote to stderr.
    pub stderr_tail: String,
    /// The rendered flight recorder, collected on a timeout.
    pub flight: Option<String>,
}

/// A failed launch, rank by rank.
#[derive(Clone, Debug)]
pub struct FailureReport {
    /// The rank that failed first (none for a timeout).
    pub failed_rank: Option<usize>,
    /// Every rank's report, in rank order.
    pub ranks: Vec<RankReport>,
    /// The timeout that expired, when the launch failed by timing out.
    pub timeout: Option<Duration>,
    /// On a timeout, what the ranks' flight recorders say together: the desync (a rank
    /// inside a collective its peers never issued), a mismatch, or that they agree.
    pub diagnosis: Vec<String>,
}

impl FailureReport {
    /// The report of the rank that failed first.
    pub fn first_failure(&self) -> Option<&RankReport> {
        self.failed_rank.and_then(|r| self.ranks.get(r))
    }
}

fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines.len().saturating_sub(n);
    lines[start..]
        .iter()
        .map(|l| format!("    {l}\n"))
        .collect()
}

impl std::fmt::Display for FailureReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = String::new();
        if let Some(r) = self.first_failure() {
            let _ = writeln!(out, "rank {} {}", r.rank, r.end);
            if let Some(m) = &r.message {
                let _ = writeln!(out, "  {m}");
            }
            let _ = writeln!(out, "  stderr of rank {} (last lines):", r.rank);
            out.push_str(&last_lines(&r.stderr_tail, 20));
        }
        if let Some(t) = self.timeout {
            let live: Vec<String> = self
                .ranks
                .iter()
                .filter(|r| r.end == RankEnd::TimedOut)
                .map(|r| r.rank.to_string())
                .collect();
            let _ = writeln!(
                out,
                "timed out after {:.1} s; ranks still running: {}",
                t.as_secs_f64(),
                live.join(", ")
            );
            for line in &self.diagnosis {
                let _ = writeln!(out, "  diagnosis: {line}");
            }
            for r in &self.ranks {
                let _ = writeln!(out, "  flight recorder of rank {} ({}):", r.rank, r.end);
                match &r.flight {
                    Some(text) => out.push_str(text),
                    None => out.push_str("    (no dump: the rank did not answer)\n"),
                }
            }
        }
        for r in &self.ranks {
            if Some(r.rank) != self.failed_rank && self.timeout.is_none() {
                let _ = writeln!(out, "  rank {} {}", r.rank, r.end);
            }
        }
        f.write_str(out.trim_end())
    }
}

/// Why a launch did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A rank failed; the others were stopped.
    #[error("{0}")]
    RankFailed(FailureReport),
    /// The run outlived its timeout.
    #[error("{0}")]
    Timeout(FailureReport),
    /// A rank's process could not be started.
    #[error("cannot start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank whose process failed to start.
        rank: usize,
        /// The executable the launcher tried to run.
        program: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The launch itself was misconfigured.
    #[error("{0}")]
    Invalid(String),
}

impl LaunchError {
    /// The per-rank report, for failures that have one.
    pub fn report(&self) -> Option<&FailureReport> {
        match self {
            LaunchError::RankFailed(r) | LaunchError::Timeout(r) => Some(r),
            _ => None,
        }
    }
}
