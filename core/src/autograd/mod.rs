//! The autograd bridge: what tch lacks and every parallelism needs from libtorch's autograd.
//!
//! tch exposes neither custom autograd functions, nor gradient hooks, nor backward with explicit
//! output gradients. Tensor and sequence parallel need custom backward passes around
//! collectives, FSDP needs hooks and in-place storage freeing, pipelines need backward from an
//! arbitrary stage output with the gradient received from the next stage. A small C++ bridge
//! (`core/cpp/bridge.cpp`, compiled against the same libtorch as torch-sys) provides them, and
//! this module exposes them as safe Rust:
//!
//! - [`function`]: custom functions with Rust forward and backward closures;
//! - [`hooks`]: gradient hooks and post-accumulate-grad hooks, removable through a handle;
//! - [`engine`]: `backward` with explicit gradients, `grad`, and setting `.grad`;
//! - [`storage`]: freeing a tensor's storage in place and refilling it later;
//! - [`scaled`]: in-place `add_`/`addcmul_`/`addcdiv_` with their scalar argument, for
//!   optimizer steps with PyTorch's rounding;
//! - [`collectives`]: differentiable collectives (Megatron's mapping table) on any
//!   [`ProcessGroup`](crate::comm::ProcessGroup);
//! - `current_cuda_stream` (feature `nccl`): libtorch's current stream, for NCCL work.
//!
//! # Safety rules of the bridge
//!
//! The public API is safe except [`storage::free_storage`]; these are the rules the
//! implementation keeps, and the reasons for the bounds users see:
//!
//! 1. **No unwinding across the boundary.** Every Rust callback the C++ side calls (forward is
//!    run in Rust, but backward closures, hooks and drop functions are called from C++) runs
//!    inside `catch_unwind`. A panic or an `Err` becomes an owned error payload the bridge
//!    throws as a C++ exception; libtorch's engine carries it to the caller of backward, and
//!    the bridge hands it back unchanged, so [`engine::backward`] returns the very
//!    [`AutogradError`] (a panic shows up as [`AutogradError::Panic`]). A panic inside a drop
//!    has no caller to go to: it is logged and swallowed.
//! 2. **State is dropped exactly once.** Closure state is owned by C++ from the moment it is
//!    handed over (on success or failure); it lives in the graph node (or hook list) and is
//!    dropped when that dies, whether or not backward ran. One-shot backward closures are
//!    consumed by the first backward, so their captures are freed at once.
//! 3. **Closures are `Send + 'static`.** For CUDA graphs libtorch runs backward on its device
//!    worker threads, and nodes may die on any thread.
//! 4. **Capture inputs, not outputs.** A backward closure holding one of its own function's
//!    outputs forms a cycle (output → node → closure → output) that leaks if backward never
//!    runs. Save outputs through [`function::ForwardCtx::save_for_backward`] instead: libtorch
//!    saves them without the cycle and checks they were not modified in place.
//! 5. **Tensor ownership is explicit.** Tensors crossing into C++ are borrowed and shallow-
//!    copied; tensors coming back are fresh heap objects owned by a [`tch::Tensor`].
//! 6. **Freed storage must not be touched.** [`storage::free_storage`] drops the memory but
//!    keeps the recorded size, so a refill always allocates the full size every alias needs.
//!    libtorch's kernels do not check for a missing allocation, hence the function is
//!    `unsafe`: nothing may compute on any alias between free and refill.

pub mod collectives;
pub mod engine;
mod ffi;
pub(crate) use ffi::{cpu_capability, cuda_versions, numerics, set_numerics, LkNumerics};
pub mod function;
pub mod hooks;
pub mod scaled;
pub mod storage;

pub use engine::{backward, grad, set_grad, GradOptions};
pub use function::{apply, apply_reentrant, BackwardCtx, ForwardCtx};
pub use hooks::{register_hook, register_post_accumulate_grad_hook, HookHandle};
pub use storage::{free_storage, is_storage_freed, refill_storage, storage_nbytes, version};

use crate::comm::CommError;
use std::fmt;

/// Where in the autograd bridge a user closure failed: tells a backward error's reader whose
/// code to look at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// A custom function's forward closure.
    Forward,
    /// A custom function's backward closure.
    Backward,
    /// A tensor gradient hook.
    Hook,
    /// A post-accumulate-grad hook.
    PostAccumulateGradHook,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Forward => "forward",
            Stage::Backward => "backward",
            Stage::Hook => "gradient hook",
            Stage::PostAccumulateGradHook => "post-accumulate-grad hook",
        })
    }
}

/// Everything the autograd bridge and the differentiable collectives can fail with.
#[derive(Debug, thiserror::Error)]
pub enum AutogradError {
    /// libtorch raised an error (shape mismatch, backward through a freed graph, ...).
    #[error("libtorch: {0}")]
    Torch(String),
    /// A user closure panicked; the panic was stopped at the bridge.
    #[error("{stage} closure panicked: {message}")]
    Panic {
        /// Which kind of closure panicked.
        stage: Stage,
        /// The panic message.
        message: String,
    },
    /// A user closure returned an error of its own.
    #[error("{0}")]
    Message(String),
    /// A one-shot backward closure was asked to run a second time (backward with
    /// `retain_graph`); use [`apply_reentrant`] for graphs that are backpropagated repeatedly.
    #[error("one-shot backward closure called again; use apply_reentrant with retain_graph")]
    BackwardReused,
    /// A closure returned the wrong number of tensors.
    #[error("{what}: expected {expected}, got {got}")]
    Arity {
        /// What was counted.
        what: &'static str,
        /// How many were expected.
        expected: usize,
        /// How many came back.
        got: usize,
    },
    /// An argument the bridge cannot work with (shape not divisible by the group size, ...).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A collective inside a differentiable collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A tch operation inside a closure failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

impl AutogradError {
    /// An error with a message, for closures that fail for reasons of their own.
    pub fn msg(message: impl fmt::Display) -> Self {
        AutogradError::Message(message.to_string())
    }

    pub(crate) fn panic(stage: Stage, payload: Box<dyn std::any::Any + Send>) -> Self {
        AutogradError::Panic {
            stage,
            message: ffi::panic_message(&payload),
        }
    }
}

/// libtorch's current CUDA stream on `device` (a `cudaStream_t`), so NCCL work is enqueued
/// where libtorch's kernels run and never races memory libtorch may recycle.
#[cfg(feature = "nccl")]
pub fn current_cuda_stream(device: usize) -> Result<*mut std::ffi::c_void, AutogradError> {
    let mut stream = std::ptr::null_mut();
    // SAFETY: the out pointer is valid for the call; the bridge catches every C++ exception.
    ffi::call(|st| unsafe { ffi::lk_current_cuda_stream(device as i64, &mut stream, st) })?;
    Ok(stream)
}
