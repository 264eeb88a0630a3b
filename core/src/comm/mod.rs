//! Communication: process groups, backends, rendezvous and diagnostics.
//!
//! Start with [`World`] (join a run), take groups from it or from a [`DeviceMesh`], and call
//! the [`ProcessGroup`] collectives. The CPU backend ([`cpu`]) is deterministic bit for bit;
//! the NCCL backend (feature `nccl`) drives GPUs.

pub mod counting;
pub mod cpu;
mod error;
pub mod flight;
mod group;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
mod store;
mod types;
pub(crate) mod work;
mod world;

pub use counting::{CollectiveCount, CollectiveCounts, CountMap, CountingGroup};
pub use error::CommError;
pub use group::ProcessGroup;
pub use mesh::DeviceMesh;
pub use store::{StoreClient, StoreServer};
pub use types::{DType, OpKind, ReduceOp};
pub use work::{Completion, Latch, Work};
pub use world::{default_timeout, Backend, InitOptions, World};
