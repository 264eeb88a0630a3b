//! Why a launch produced no record ([`RunFailed`]): the launcher's whole account kept for the
//! reports, with the one line a table shows.

use crate::LaunchError;

/// Why a run produced no record: its own failure, kept whole for the reports.
#[derive(Clone, Debug)]
pub struct RunFailed {
    /// What failed, in one line.
    pub line: String,
    /// Everything the launcher reported.
    pub details: String,
    /// Whether the run outlived its timeout (a hang), rather than failing.
    pub timed_out: bool,
}

impl RunFailed {
    /// A failure whose one line is the whole story (nothing was launched).
    pub fn simple(text: impl Into<String>) -> Self {
        let line = text.into();
        RunFailed {
            details: line.clone(),
            line,
            timed_out: false,
        }
    }
}

impl std::fmt::Display for RunFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.details)
    }
}

impl std::error::Error for RunFailed {}

/// A failed launch as a [`RunFailed`] carrying the launcher's whole account.
pub fn launch_failed(e: LaunchError) -> RunFailed {
    let details = e.to_string();
    RunFailed {
        line: one_line(&details),
        details,
        timed_out: matches!(e, LaunchError::Timeout(_)),
    }
}

/// The launcher's failure report runs over many lines; tables get its first one and the
/// first line naming a rank's message.
pub fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("launch failed").to_owned();
    match lines.find(|l| l.contains("failed") || l.contains("error")) {
        Some(detail) if detail != first => format!("{first} {detail}"),
        _ => first,
    }
}
