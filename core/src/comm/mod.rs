//! Communication: process groups, backends, rendezvous and diagnostics.
//!
//! Start with [`World`] (join a run), take groups from it or from a [`DeviceMesh`], and call
//! the [`ProcessGroup`] collectives. The CPU backend ([`cpu`]) is deterministic bit for bit;
//! the NCCL backend (feature `nccl`) drives GPUs.
//!
//! Two ranks joining one run and summing a tensor. Each rank is normally its own process
//! (the harness launches them); two threads of one process work the same way:
//!
//! ```
//! use lockstep_core::comm::{InitOptions, ReduceOp, StoreServer, World};
//! use tch::Tensor;
//!
//! let store = StoreServer::start("127.0.0.1:0", "secret").unwrap();
//! let addr = store.addr().to_string();
//! let ranks: Vec<_> = (0..2)
//!     .map(|rank| {
//!         let addr = addr.clone();
//!         std::thread::spawn(move || {
//!             let world = World::init(InitOptions::local(rank, 2, addr, "secret")).unwrap();
//!             let t = Tensor::from_slice(&[rank as f32 + 1.0]);
//!             world.group().all_reduce(&t, ReduceOp::Sum).unwrap();
//!             t.double_value(&[0])
//!         })
//!     })
//!     .collect();
//! for rank in ranks {
//!     assert_eq!(rank.join().unwrap(), 3.0);
//! }
//! ```

pub mod counting;
pub mod cpu;
mod error;
pub mod faulty;
pub mod flight;
mod group;
mod label;
mod mesh;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod p2p;
mod p2p_op;
mod store;
mod types;
pub(crate) mod work;
mod world;

pub use counting::{CollectiveCount, CollectiveCounts, CountMap, CountingGroup};
pub use error::CommError;
pub use faulty::{
    applicability, CallRecord, FaultInjector, FaultKind, FaultLog, FaultMode, FaultSite,
    FaultyGroup, Injection,
};
pub use group::ProcessGroup;
pub use label::labelled;
pub use mesh::DeviceMesh;
pub use p2p::{batch_isend_irecv, post_batch, P2pKind, P2pOp, Posted};
pub use store::{StoreClient, StoreServer};
pub use types::{DType, OpKind, ReduceOp};
pub use work::{Completion, Latch, Work};
pub use world::{
    default_rendezvous_timeout, default_timeout, host_identity, torchelastic_in_env, Backend,
    ExternalLaunch, GroupWrapper, InitOptions, PointToPoint, RunStore, RunStoreError, World,
    P2P_VAR, RENDEZVOUS_TIMEOUT_VAR, RUN_STORE_MAX_VALUE, STORE_PORT_VAR,
};
