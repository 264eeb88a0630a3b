//! The failures each family of parallelisms shares, declared once. DDP's and FSDP's error
//! enums start with the wrappers' (the `wrapper_error` macro of `core/src/wrapper_error.rs`, a
//! declared shape, in a module of its own so the wrappers' options need nothing here); tensor,
//! expert and pipeline parallelism's hold the model-splitting ones as one boxed variant,
//! [`SplitFailure`] (`Failed`), converted into by the `split_failure_from` macro. Each then adds its own mistakes, so
//! a family's errors read alike and a new member's takes the same shape by construction.

use crate::autograd::AutogradError;
use crate::comm::CommError;
use crate::fsdp::FsdpError;
use crate::train::TrainError;
use lockstep_models::ModelError;

/// What any model-splitting run (tensor, expert or pipeline parallelism) can fail with
/// besides its own mistakes.
#[derive(Debug, thiserror::Error)]
pub enum SplitFailure {
    /// Building, splitting or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A differentiable collective's autograd bridge failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// The training loop failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// Sharding the data dimension (an FSDP unit over what the split left) failed.
    #[error(transparent)]
    Shard(#[from] FsdpError),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Lets `?` turn each of [`SplitFailure`]'s sources into error `$name`'s `Failed` variant.
macro_rules! split_failure_from {
    ($name:ident) => {
        $crate::failure::split_failure_from!(@each $name:
            lockstep_models::ModelError,
            $crate::comm::CommError,
            $crate::autograd::AutogradError,
            $crate::train::TrainError,
            $crate::fsdp::FsdpError,
            tch::TchError,
        );
    };
    (@each $name:ident: $($source:ty,)*) => {
        $(impl From<$source> for $name {
            fn from(e: $source) -> Self {
                $name::Failed(Box::new($crate::failure::SplitFailure::from(e)))
            }
        })*
        impl From<$crate::failure::SplitFailure> for $name {
            fn from(e: $crate::failure::SplitFailure) -> Self {
                $name::Failed(Box::new(e))
            }
        }
    };
}

pub(crate) use split_failure_from;
