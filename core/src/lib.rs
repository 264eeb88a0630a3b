//! Lockstep's core: the communication layer every parallelism is built on.
//!
//! `comm` holds process groups (a deterministic CPU backend over TCP and, behind the `nccl`
//! feature, NCCL), the rendezvous store, device meshes and the flight recorder that explains
//! hangs and desyncs. `autograd` bridges what tch lacks from libtorch's autograd (custom
//! functions, hooks, explicit-gradient backward, storage freeing) and builds the
//! differentiable collectives on it.
#![warn(missing_docs)]

pub mod autograd;
pub mod comm;
pub mod compose;
pub mod consistency;
pub mod context_parallel;
pub mod ddp;
pub mod expert_parallel;
pub mod failure;
pub mod field_bugs;
pub mod fsdp;
pub mod machine;
pub mod mixed_reference;
pub mod num;
pub mod parallelism;
pub mod pipeline;
pub mod precision;
pub mod record;
pub mod replica;
pub mod tensor_parallel;
pub mod train;
mod wrapper_error;

pub use autograd::AutogradError;
pub use comm::CommError;
pub use precision::{MixedPrecision, PrecisionError};
