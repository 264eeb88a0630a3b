//! Lockstep's model zoo: models defined once, with deterministic initialization and inputs,
//! which plans parallelize without the models knowing.
//!
//! Determinism starts here: every rank derives its seeds from one run seed, so a reference
//! run and a parallel run see the same weights and the same per-rank data. Parameter names
//! are the module paths PyTorch would give the equivalent `nn.Module`, so state files and
//! reports read the same on both sides.
#![warn(missing_docs)]

pub mod decisions;
mod device;
mod error;
pub mod functional;
mod layers;
pub mod model;
pub mod plan;
pub mod seed;
pub mod store;
pub mod tags;
pub mod zoo;

pub use device::OnDevice;
pub use error::{Misshaped, ModelError};
pub use model::{
    Batch, LayerHooks, LayerKind, LayerRun, LayerSpec, LossReduction, Model, MoeSpec, NoHooks,
};
pub use plan::{ParallelPlan, ParallelStyle, PlanRule};
pub use store::ParamStore;
pub use tags::{ExpertParam, ParamTags, SharedGroup};
