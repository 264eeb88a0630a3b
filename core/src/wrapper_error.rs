//! The shape every data-parallel wrapper's error enum starts with (DDP's, FSDP's), declared
//! once. Kept apart from [`crate::failure`], which names FSDP's error: the wrappers' options
//! declare their errors with this macro, and would otherwise need the module that needs them.

/// Declares a wrapper's error enum: a failed collective, autograd bridge call, training
/// loop, libtorch call or mixed-precision policy, then the variants given (each with its
/// docs and `#[error]`).
macro_rules! wrapper_error {
    ($(#[$meta:meta])* $vis:vis enum $name:ident { $($own:tt)* }) => {
        $(#[$meta])*
        #[derive(Debug, thiserror::Error)]
        $vis enum $name {
            /// A collective failed.
            #[error(transparent)]
            Comm(#[from] $crate::comm::CommError),
            /// The autograd bridge failed: registering or running a hook, freeing or
            /// refilling storage, setting a gradient.
            #[error(transparent)]
            Autograd(#[from] $crate::autograd::AutogradError),
            /// The training loop failed.
            #[error(transparent)]
            Train(#[from] $crate::train::TrainError),
            /// A libtorch call failed.
            #[error("libtorch: {0}")]
            Torch(#[from] tch::TchError),
            /// The mixed-precision policy is invalid or cannot be applied to this model.
            #[error(transparent)]
            Precision(#[from] $crate::precision::PrecisionError),
            $($own)*
        }
    };
}

pub(crate) use wrapper_error;
