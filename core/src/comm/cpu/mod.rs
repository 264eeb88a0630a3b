//! The CPU backend: collectives in Rust over TCP, deterministic by construction.
//!
//! * **Transport**: one TCP connection per pair of group members (full mesh after
//!   rendezvous), loopback by default, any address for multi-node. See [`link`].
//! * **Order**: each group runs its collectives one at a time in issue order on a worker
//!   thread (`*_async` returns at once with a [`Work`]); a blocking call with nothing queued
//!   runs on the caller's thread to save a thread hop.
//! * **Algorithms**: messages up to [`SMALL_MESSAGE`] bytes use direct exchanges (one round
//!   trip). Larger all-gathers use a ring and larger broadcasts a pipelined chain. Reductions
//!   use a pairwise-exchange reduce-scatter (each rank receives its chunk from every peer and
//!   combines them in rank order) followed by a ring all-gather: the same bytes on the wire
//!   per rank as a ring reduce-scatter, but every element is summed in rank order, which a
//!   ring (whose partial sums start at a different rank for every chunk) cannot give.
//! * **Determinism**: the result's bits depend only on the inputs, never on timing, message
//!   size or chunking ([`reduce`]).
//! * **Safety net**: every message carries the sender's operation, dtype, reduction and shape;
//!   a mismatch fails with [`CommError::Mismatch`] naming both ranks.
//!
//! The files: [`CpuGroup`] and its issue queue in `group`, its [`ProcessGroup`] surface
//! (point to point included) in `process_group`, the algorithms of each collective in
//! `algorithms`, and the message and shared-memory primitives they are built from in
//! `exchange`; below those, the transport ([`link`], [`wire`]), the deterministic kernels
//! ([`reduce`]) and the shared-memory slots (`shm`).
//!
//! [`CommError::Mismatch`]: crate::comm::CommError::Mismatch
//! [`ProcessGroup`]: crate::comm::ProcessGroup
//! [`Work`]: crate::comm::Work

mod algorithms;
pub mod chaos;
mod exchange;
mod group;
pub mod link;
mod pool;
mod process_group;
pub mod reduce;
mod shm;
mod tensor;
pub mod wire;

pub use group::CpuGroup;

/// Messages up to this many bytes take the direct (latency-optimal) algorithms.
pub const SMALL_MESSAGE: usize = 64 << 10;
/// Messages from this many bytes go through shared memory when every peer is on this host.
pub const SHM_MESSAGE: usize = 256 << 10;
