//! Compositions of parallelisms on one named [`DeviceMesh`](crate::comm::DeviceMesh): tensor
//! parallelism with FSDP or HSDP, pipelines whose stages are tensor-parallel and whose
//! replicas are DDP or FSDP, expert parallelism with FSDP over the rest.
//!
//! Each composition is applied in torchtitan's order: the model-splitting parallelism first
//! (pipeline stages, TP shards, EP experts), activation checkpointing next, and the data
//! dimension last, over whatever tensors the earlier ones left on the rank. The data
//! dimension is a [`DataParallel`]: replicated (DDP's all-reduce), sharded (the FSDP engine
//! over the rank's tensors, [`Fsdp::over_tensors`](crate::fsdp::Fsdp::over_tensors)), or
//! hybrid-sharded (HSDP).
//!
//! [`Composition`] describes one as data; [`Composition::mesh`] lays out its named dimensions
//! for a world size, and [`check_composition`] refuses, before any rank starts, a world the
//! mesh does not fit or a plan that cannot compose, naming the dimensions.
//! [`train_composed`] runs it through the parallelisms' own training loops, which take the
//! data dimension as an option. [`MeshSpec`] is a user's mesh as torchtitan describes it
//! (`pp=2,dp_shard=2,cp=2,tp=2`), turned into the composition that trains it.

pub mod data;
mod data_parallel;
mod mesh_spec;
mod plan;
mod run;

pub use data_parallel::{DataParallel, HybridMeshError};
pub use mesh_spec::{MeshError, MeshSpec, MESH_DIMENSIONS};
pub use plan::{check_composition, Composition, CompositionError, SeamFault};
pub use run::{train_composed, ComposedFault};
