//! The model zoo's error type.

/// A tensor whose shape or dtype in a file differs from the model's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Misshaped {
    /// The key in the file.
    pub name: String,
    /// The model's dtype and shape, e.g. `Float [4, 16]`.
    pub expected: String,
    /// The file's dtype and shape.
    pub found: String,
}

/// Everything building, feeding, saving or loading a model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `zoo::build` was asked for a name it does not know.
    #[error("unknown model `{name}`; known models: {}", known.join(", "))]
    UnknownModel {
        /// The name asked for.
        name: String,
        /// Every name the zoo builds, for the message.
        known: Vec<String>,
    },
    /// A state file does not fit the model: every offending key is named so a user can fix
    /// the file (or notice they loaded the wrong model) in one go.
    #[error(
        "{path}: state does not match model `{model}`: missing [{}]; misshaped [{}]; unexpected [{}]",
        missing.join(", "),
        misshaped.iter().map(|m| format!("{}: expected {}, found {}", m.name, m.expected, m.found)).collect::<Vec<_>>().join("; "),
        unexpected.join(", ")
    )]
    StateMismatch {
        /// The state file.
        path: String,
        /// The model it was loaded into.
        model: String,
        /// The model's keys the file lacks.
        missing: Vec<String>,
        /// Keys present in both but with another shape or dtype.
        misshaped: Vec<Misshaped>,
        /// The file's keys the model does not have.
        unexpected: Vec<String>,
    },
    /// A state file that cannot be read as safetensors (missing, truncated, another format):
    /// said in words, with the reader's own error kept, rather than as a bare libtorch failure.
    #[error(
        "{path}: cannot read it as safetensors (missing, truncated or another format): {reason}"
    )]
    UnreadableState {
        /// The state file.
        path: String,
        /// The reader's own error, in words.
        reason: String,
    },
    /// A state file stores a tied weight under two names with different values.
    #[error("{path}: tied weight `{alias}` differs from `{canonical}`, but they are one tensor")]
    TiedMismatch {
        /// The state file.
        path: String,
        /// The name the model stores the tied tensor under.
        canonical: String,
        /// The other name of the same tensor, whose value differs.
        alias: String,
    },
    /// The model cannot be compared against a single-device reference (per-rank parameters
    /// or per-rank statistics make "one process, global batch" a different computation).
    #[error("model `{model}` has no single-device reference: {reason}")]
    ReferenceUnsupported {
        /// The model's zoo name.
        model: String,
        /// Why its parallel run has no single-device equivalent.
        reason: String,
    },
    /// Sizes that cannot build the model (a width the heads do not divide, a zero size).
    #[error("model `{model}`: invalid sizes: {reason}")]
    InvalidConfig {
        /// The model's zoo name.
        model: String,
        /// Which size is wrong and why.
        reason: String,
    },
    /// A batch does not have the tensors this model consumes.
    #[error("model `{model}`: invalid batch: {reason}")]
    InvalidBatch {
        /// The model's zoo name.
        model: String,
        /// Which tensor is missing or wrong.
        reason: String,
    },
    /// A layer hook (a parallel wrapper acting between layers) failed; its error is kept.
    #[error("layer hook: {0}")]
    Hook(Box<dyn std::error::Error + Send + Sync>),
    /// A libtorch call failed (including safetensors I/O through tch).
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
