//! Why a parity test could not run as specified (nothing was launched).

use std::path::PathBuf;

/// A parity test that cannot run as written: each variant names what to fix. Its `Debug` is
/// its message, so `.unwrap()` and `.expect(..)` in a test print what to fix.
#[derive(thiserror::Error)]
pub enum ParityTestError {
    /// Neither [`zoo`](super::ParityTest::zoo) nor [`model`](super::ParityTest::model) was
    /// called.
    #[error("no model: call .zoo(\"name\") or .model(\"name\", |seed, rank| ...)")]
    NoModel,
    /// No configuration under test.
    #[error("no configuration under test: call .config(\"ddp\") or .custom_config(...)")]
    NoConfig,
    /// A configuration name that is neither built in nor defined by the test.
    #[error(
        "unknown configuration {}; known built-in configurations: {}",
        names.iter().map(|n| format!("`{n}`{}", crate::suggest::did_you_mean(n, known))).collect::<Vec<_>>().join(", "),
        known.join(", ")
    )]
    UnknownConfig {
        /// The names asked for.
        names: Vec<String>,
        /// Every built-in name.
        known: Vec<String>,
    },
    /// The single-device reference was asked for a model that has none.
    #[error("model `{model}` has no single-device reference ({reason}): compare against Reference::Ddp instead")]
    NoSingleDeviceReference {
        /// The model's name.
        model: String,
        /// The model's own reason.
        reason: String,
    },
    /// The model builder failed.
    #[error("building the model: {0}")]
    Model(#[source] lockstep_models::ModelError),
    /// Any other setting out of range or inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// The report directory cannot be prepared or written.
    #[error("report directory {}: {reason}", path.display())]
    OutDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A sensitivity analysis plants its faults in forked ranks, which is unsafe in a
    /// multi-threaded `cargo test` run (plain parity tests exec their ranks there instead).
    #[error(
        "a sensitivity analysis forks one process per rank, which needs one test per process: \
         run it with `cargo nextest run`, or `cargo test -- --test-threads=1 --nocapture`"
    )]
    NotForkSafe,
    /// A sensitivity analysis could not run (a configuration fails without a fault, its dry
    /// run failed).
    #[error(transparent)]
    Sensitivity(Box<crate::sensitivity::SensitivityError>),
}

impl From<crate::sensitivity::SensitivityError> for ParityTestError {
    fn from(e: crate::sensitivity::SensitivityError) -> Self {
        ParityTestError::Sensitivity(Box::new(e))
    }
}

impl std::fmt::Debug for ParityTestError {
    /// The full message (as `Display`): a test's `.unwrap()` shows what to fix.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}
