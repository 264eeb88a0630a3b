//! The expert gradient rule and the groups it needs.
//!
//! A world of `W` ranks is `W / ep` replicas of the expert layout. [`ep_groups`] are the
//! contiguous groups `[g·ep, (g+1)·ep)` whose ranks shard the experts between them; the
//! [`expert_data_parallel_groups`] are the ranks holding the *same* experts (the same position
//! in every ep group: `r, r + ep, r + 2·ep, …`, `W / ep` of them).
//!
//! An expert's parameters get gradients only from the token-choices routed to them, brought
//! back by the dispatchers' backward: after backward, the rank holding expert `e` already has
//! `Σ_{r ∈ its ep group} ∂L_r/∂θ_e`. The rest of the world's contributions sit on the other
//! replicas of `e`, so expert gradients are summed over the expert-data-parallel group only,
//! never over `ep` (that would add different experts together, or count each ep rank's
//! tokens again).
//!
//! Scaling for a data-parallel objective `L = (1/W) Σ_r L_r` (every rank backpropagates its own
//! `L_r`): dense (replicated) gradients are averaged over all `W` ranks, and expert gradients
//! are **summed over the expert-data-parallel group and divided by `W`** — not by the group's
//! size `W / ep`, which makes them `ep` times too large (EP 2 doubles them).

use super::error::MoeError;
use super::experts::{EpGroup, ExpertParams};
use crate::autograd::set_grad;
use crate::comm::ReduceOp;

fn check(world: usize, ep: usize) -> Result<(), MoeError> {
    if ep == 0 || world == 0 || !world.is_multiple_of(ep) {
        return Err(MoeError::World { world, ep });
    }
    Ok(())
}

/// The expert-parallel groups of a world: `[g·ep, (g+1)·ep)` for `g` in `0..world/ep`.
pub fn ep_groups(world: usize, ep: usize) -> Result<Vec<Vec<usize>>, MoeError> {
    check(world, ep)?;
    Ok((0..world / ep)
        .map(|g| (g * ep..(g + 1) * ep).collect())
        .collect())
}

/// The expert-data-parallel groups: ranks holding the same experts (`r, r + ep, …` for `r` in
/// `0..ep`), over which expert gradients are summed.
pub fn expert_data_parallel_groups(world: usize, ep: usize) -> Result<Vec<Vec<usize>>, MoeError> {
    check(world, ep)?;
    Ok((0..ep).map(|r| (r..world).step_by(ep).collect()).collect())
}

/// Applies the rule to this rank's experts after backward of its own loss `L_r`: sums every
/// expert gradient over `edp` (this rank's expert-data-parallel group) and divides by
/// `world_size`, giving the gradient of the mean of all ranks' losses. A parameter with no
/// gradient gets zeros first, so every rank runs the same collectives.
pub fn reduce_expert_grads(
    experts: &[ExpertParams],
    edp: &EpGroup,
    world_size: usize,
) -> Result<(), MoeError> {
    let replicas = edp.size();
    if world_size == 0 || !world_size.is_multiple_of(replicas) {
        return Err(MoeError::Shape(format!(
            "an expert-data-parallel group of {replicas} does not divide world size {world_size}"
        )));
    }
    for t in experts.iter().flat_map(ExpertParams::tensors) {
        let mut g = t.grad();
        if !g.defined() {
            g = t.f_zeros_like()?;
            set_grad(t, Some(&g))?;
        }
        let mut buf = if g.is_contiguous() {
            g.shallow_clone()
        } else {
            g.f_contiguous()?
        };
        if replicas > 1 {
            edp.all_reduce(&buf, ReduceOp::Sum)?;
        }
        let _ = buf.f_mul_scalar_(1.0 / world_size as f64)?;
        if !g.is_contiguous() {
            g.f_copy_(&buf)?;
        }
    }
    Ok(())
}
