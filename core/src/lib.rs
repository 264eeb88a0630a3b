//! Lockstep's core: the communication layer every parallelism is built on.
//!
//! `comm` holds process groups (a deterministic CPU backend over TCP and, behind the `nccl`
//! feature, NCCL), the rendezvous store, device meshes and the flight recorder that explains
//! hangs and desyncs.

pub mod comm;
pub mod record;
pub mod train;

pub use comm::CommError;
