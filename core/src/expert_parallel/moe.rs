//! The mixture-of-experts layer on one rank's tokens: route, drop at capacity, dispatch to the
//! experts wherever they live, combine `Σ gate · expert(x)` over the kept choices.
//!
//! With no capacity limit and one process holding every expert, the output equals the zoo's
//! dense `Moe::forward` bit for bit: same router arithmetic, each expert's rows in token order,
//! each token's contributions added in increasing expert index.

use super::dispatch::{
    combine, dispatch_all_gather, dispatch_all_to_all, run_all_local, DispatchPlan,
};
use super::router::{capacity, check_top_k, keep_mask, route, Routing};
use tch::Tensor;

pub use super::error::MoeError;
use super::experts::{experts_per_rank, EpGroup, ExpertParams};

/// The layer's shape and policy (the same on every rank of the group).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts of the layer, over all ranks.
    pub num_experts: usize,
    /// Experts each token is sent to.
    pub top_k: i64,
    /// Slots per expert are `ceil(factor · N · k / E)` of this rank's `N` tokens; `None`: no
    /// limit (no choice is dropped).
    pub capacity_factor: Option<f64>,
    /// Weight of the load-balancing loss in [`MoeOutput::aux_loss`].
    pub aux_loss_coef: f64,
}

/// How token-choices reach the ranks holding their experts (two ways, to cross-check).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatcher {
    /// Differentiable all-to-all there and back, uneven splits ([`dispatch_all_to_all`]).
    AllToAll,
    /// All-gather of every rank's tokens, reduce-scatter of the results
    /// ([`dispatch_all_gather`]).
    AllGather,
}

/// The layer's result on one rank.
#[derive(Debug)]
pub struct MoeOutput {
    /// `[N, D]`: `Σ` over this token's kept choices of `gate · expert(x)`.
    pub output: Tensor,
    /// `aux_loss_coef ·` the routing's load-balancing loss (add it to the objective).
    pub aux_loss: Tensor,
    /// (token, choice) pairs of this rank dropped at capacity (a token may lose one of its k).
    pub tokens_dropped: usize,
    /// The router's decision (unscaled loss in `routing.aux_loss`), for inspection.
    pub routing: Routing,
    /// `[N, k]` bool: which choices fit their expert's capacity.
    pub kept: Tensor,
}

/// The layer on this rank's tokens `x` (`[N, D]`) with router `router_weight` (`[E, D]`).
///
/// `local` are the experts this rank holds: with `group` `Some`, rank `r` holds
/// `[r·E/ep, (r+1)·E/ep)` and the dispatcher brings its tokens' choices to them; with `None`
/// this one process holds every expert (the dispatcher is ignored). Sizes are checked before
/// any collective, so a bad layout fails on every rank alike.
///
/// Every rank of `group` must call this together, and later run backward together (the
/// dispatchers' backward passes communicate).
pub fn moe_forward(
    x: &Tensor,
    router_weight: &Tensor,
    local: &[ExpertParams],
    cfg: &MoeConfig,
    group: Option<&EpGroup>,
    dispatcher: Dispatcher,
) -> Result<MoeOutput, MoeError> {
    moe_forward_planted(x, router_weight, local, cfg, group, dispatcher, false)
}

/// [`moe_forward`], with `planted_extra_slot` giving every expert one slot more than its
/// capacity ([`super::EpFault::CapacityOffByOne`], for checker tests).
pub(crate) fn moe_forward_planted(
    x: &Tensor,
    router_weight: &Tensor,
    local: &[ExpertParams],
    cfg: &MoeConfig,
    group: Option<&EpGroup>,
    dispatcher: Dispatcher,
    planted_extra_slot: bool,
) -> Result<MoeOutput, MoeError> {
    let e = cfg.num_experts;
    check_top_k(cfg.top_k, e)?;
    let ep = group.map_or(1, |g| g.size());
    let per = experts_per_rank(e, ep)?;
    if local.len() != per {
        return Err(MoeError::Experts {
            held: local.len(),
            needed: per,
        });
    }
    let rows = router_weight.size();
    if rows.first() != Some(&(e as i64)) {
        return Err(MoeError::Shape(format!(
            "router weight {rows:?} must have one row per each of the {e} experts"
        )));
    }
    let n = x.size().first().copied().unwrap_or(0) as usize;
    let cap = capacity(cfg.capacity_factor, n, cfg.top_k as usize, e)?;
    // A planted off-by-one in the capacity check: one slot more per expert.
    let cap = cap.map(|c| c + usize::from(planted_extra_slot));
    let routing = route(x, router_weight, cfg.top_k)?;
    let kept = keep_mask(&routing.experts, e, cap)?;
    let plan = DispatchPlan::new(&routing.experts, &kept, e)?;
    let ys = match (group, dispatcher) {
        (None, _) => run_all_local(x, &plan, local)?,
        (Some(g), Dispatcher::AllToAll) => dispatch_all_to_all(x, &plan, local, g)?,
        (Some(g), Dispatcher::AllGather) => dispatch_all_gather(x, &plan, local, g)?,
    };
    let output = combine(x, &routing.gates, &plan, &ys)?;
    Ok(MoeOutput {
        output,
        aux_loss: routing.aux_loss.f_mul_scalar(cfg.aux_loss_coef)?,
        tokens_dropped: plan.dropped(),
        routing,
        kept,
    })
}
