//! What FSDP can fail with, in a file of its own: the options hold a wrap policy, and the
//! policy's planning fails with this error, so neither file needs the other.

use crate::wrapper_error::wrapper_error;
use lockstep_models::Misshaped;

wrapper_error! {
/// What FSDP can fail with.
pub enum FsdpError {
    /// The model cannot be wrapped as asked (mixed dtypes, parameters sharing storage...).
    #[error("fsdp: {0}")]
    Invalid(String),
    /// An explicit wrap names a layer the model does not have.
    #[error("fsdp: no layer `{layer}` to wrap; the model's layers: {}", known.join(", "))]
    UnknownLayer {
        /// The layer the wrap names.
        layer: String,
        /// The model's layer names, for the message.
        known: Vec<String>,
    },
    /// An explicit wrap puts one layer into two units.
    #[error("fsdp: layer `{layer}` wrapped twice: in unit `{first}` and in unit `{second}`")]
    WrappedTwice {
        /// The layer named twice.
        layer: String,
        /// The first unit that wraps it.
        first: String,
        /// The second unit that wraps it.
        second: String,
    },
    /// A parameter is used by modules of two different units (one flat parameter cannot live
    /// in two units): wrap both modules in one unit, or leave one unwrapped.
    #[error(
        "fsdp: parameter `{param}` is shared by `{first}` and `{second}`, which are wrapped in \
         different units; wrap them in one unit"
    )]
    SharedAcrossUnits {
        /// The shared parameter's name.
        param: String,
        /// One module using it.
        first: String,
        /// Another module using it, in a different unit.
        second: String,
    },
    /// A parameter had no gradient when gradients were reduced.
    #[error("fsdp: parameter `{0}` has no gradient")]
    MissingGrad(String),
    /// A checkpoint does not fit this wrapper: every missing, misshaped (wrong shape or dtype)
    /// and unexpected key is named. Nothing was loaded.
    #[error(
        "fsdp: {path}: state does not match: missing [{}]; misshaped [{}]; unexpected [{}]",
        missing.join(", "),
        misshaped.iter().map(|m| format!("{}: expected {}, found {}", m.name, m.expected, m.found)).collect::<Vec<_>>().join("; "),
        unexpected.join(", ")
    )]
    StateMismatch {
        /// The checkpoint file or directory.
        path: String,
        /// The wrapper's keys the checkpoint lacks.
        missing: Vec<String>,
        /// Keys present in both but with another shape or dtype.
        misshaped: Vec<Misshaped>,
        /// The checkpoint's keys the wrapper does not have.
        unexpected: Vec<String>,
    },
    /// A sharded checkpoint was written for another sharding layout (world size, strategy,
    /// wrap policy or model). Nothing was loaded.
    #[error("fsdp: {path}: sharded checkpoint layout differs: {reason}")]
    ShardLayout {
        /// The checkpoint directory.
        path: String,
        /// Which part of the layout differs.
        reason: String,
    },
    /// Reading or writing a checkpoint file failed.
    #[error("fsdp: {path}: {reason}")]
    Checkpoint {
        /// The file that failed.
        path: String,
        /// The underlying error, in words.
        reason: String,
    },
    /// Another rank failed the same collective checkpoint operation (its own error is
    /// reported there); this rank changed nothing.
    #[error("fsdp: {0} failed on another rank")]
    PeerFailed(String),
}
}
