//! What a parity test found: the report, where it was written, and the verdict in words.

use lockstep_harness::report::{Report, ReportFiles};
use std::fmt::Write as _;

/// The result of [`ParityTest::run`](super::ParityTest::run): every comparison and failed
/// run, and the report set written for them.
#[derive(Debug)]
pub struct ParityOutcome {
    /// The test's name.
    pub name: String,
    /// Every comparison and every failed run (the same report the files hold).
    pub report: Report,
    /// Where the report set was written.
    pub files: ReportFiles,
}

impl ParityOutcome {
    pub(super) fn new(name: String, report: Report, files: ReportFiles) -> Self {
        ParityOutcome {
            name,
            report,
            files,
        }
    }

    /// Whether every comparison passed and every run finished.
    pub fn passed(&self) -> bool {
        self.report.passed()
    }

    /// The verdict in words: one paragraph per failing comparison (configuration, reference,
    /// the engine's diagnosis with the first failing step, tensor, element and margin) and
    /// per failed run (the launcher's report), then where the report set is. Empty details
    /// when everything passed.
    pub fn summary(&self) -> String {
        let mut out = format!("parity test `{}`: {}\n", self.name, self.report.headline());
        for c in self.report.comparisons.iter().filter(|c| !c.passed) {
            let _ = writeln!(out, "\nFAILED {} against {}:", c.config, c.reference);
            // The engine's diagnosis starts with the first failing value.
            match (&c.diagnosis, &c.first_failure) {
                (Some(d), _) => {
                    let _ = writeln!(out, "  {d}");
                }
                (None, Some(f)) => {
                    let _ = writeln!(out, "  first failure: {f}");
                }
                (None, None) => {}
            }
            if let Some(reason) = &c.override_reason {
                let _ = writeln!(out, "  tolerance override: {reason}");
            }
        }
        for e in &self.report.errors {
            let _ = writeln!(
                out,
                "\nERROR {} against {}: {}\n{}",
                e.config, e.reference, e.message, e.details
            );
        }
        let _ = writeln!(
            out,
            "\nreport: {} (also report.json, junit.xml, report.html)",
            self.files.markdown.display()
        );
        out
    }

    /// Panics with [`ParityOutcome::summary`] unless the test passed; the panic points at
    /// the caller's line (the user's test), not into Lockstep.
    #[track_caller]
    pub fn assert_passed(&self) {
        if !self.passed() {
            panic!("{}", self.summary());
        }
    }
}
