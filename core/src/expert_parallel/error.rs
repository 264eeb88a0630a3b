//! What the expert-parallel building blocks can fail with: bad sizes are caught before any
//! collective runs, so every rank fails alike instead of hanging.

use crate::autograd::AutogradError;
use crate::CommError;

/// Everything routing, dispatch and the layer can fail with; size errors name the sizes.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    /// The experts cannot be split evenly over the expert-parallel group.
    #[error("expert parallel: {num_experts} experts do not divide over an expert-parallel group of {ep}")]
    Indivisible {
        /// Experts of the layer.
        num_experts: usize,
        /// Size of the expert-parallel group.
        ep: usize,
    },
    /// The expert-parallel size does not divide the world (no whole replicas).
    #[error("expert parallel: expert-parallel size {ep} does not divide world size {world}")]
    World {
        /// Ranks in the world.
        world: usize,
        /// Requested expert-parallel size.
        ep: usize,
    },
    /// A token cannot choose more experts than exist (or fewer than one).
    #[error("expert parallel: top_k {top_k} exceeds the {num_experts} experts (or is below 1)")]
    TopK {
        /// Requested choices per token.
        top_k: i64,
        /// Experts of the layer.
        num_experts: usize,
    },
    /// This rank was handed the wrong number of experts for its slice of the layout.
    #[error("expert parallel: this rank holds {held} experts, the layout needs {needed}")]
    Experts {
        /// Experts passed in.
        held: usize,
        /// `num_experts / ep`.
        needed: usize,
    },
    /// A capacity factor that is not a positive finite number.
    #[error("expert parallel: capacity factor {0} is not a positive finite number")]
    CapacityFactor(f64),
    /// Tensors whose shapes do not fit together.
    #[error("expert parallel: {0}")]
    Shape(String),
    /// A differentiable collective failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A plain collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// libtorch rejected an operation.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}
