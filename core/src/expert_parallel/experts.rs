//! The experts of a mixture layer and their layout over an `ep` group: what the dispatchers,
//! the layer and the gradient rule all hold, so none of them needs another's module for it.

use super::error::MoeError;
use crate::comm::ProcessGroup;
use std::sync::Arc;
use tch::Tensor;

/// A group of ranks sharing the experts of a layer (the `ep` group).
pub type EpGroup = Arc<dyn ProcessGroup>;

/// One expert's parameters, `w2(gelu(w1 x + b1)) + b2` like the zoo's expert MLP; held by the
/// rank the layout assigns the expert to.
#[derive(Debug)]
pub struct ExpertParams {
    /// `[H, D]`.
    pub w1: Tensor,
    /// `[H]`.
    pub b1: Tensor,
    /// `[D, H]`.
    pub w2: Tensor,
    /// `[D]`.
    pub b2: Tensor,
}

impl ExpertParams {
    /// The expert on rows `x` (`[M, D]`, `M` may be 0), with the zoo's exact op sequence.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor, tch::TchError> {
        x.f_linear(&self.w1, Some(&self.b1))?
            .f_gelu("none")?
            .f_linear(&self.w2, Some(&self.b2))
    }

    /// The four parameters in a fixed order (`w1, b1, w2, b2`), for gradient reduction.
    pub fn tensors(&self) -> [&Tensor; 4] {
        [&self.w1, &self.b1, &self.w2, &self.b2]
    }
}

/// Experts each rank of an `ep` group holds; an error naming both sizes unless `ep` divides
/// `num_experts`.
pub fn experts_per_rank(num_experts: usize, ep: usize) -> Result<usize, MoeError> {
    if ep == 0 || num_experts == 0 || !num_experts.is_multiple_of(ep) {
        return Err(MoeError::Indivisible { num_experts, ep });
    }
    Ok(num_experts / ep)
}
