//! The top-k softmax router, the capacity rule and the load-balancing loss.
//!
//! Routing is computed exactly as the zoo's dense `Moe` computes it (router linear without
//! bias, softmax over experts, top-k highest first, gates renormalised over the chosen k), so a
//! layer built on it can match the zoo bit for bit.
//!
//! Capacity is decided here, on the tokens passed in (one rank's tokens: see [`keep_mask`]).

use super::error::MoeError;
use tch::{Kind, Tensor};

/// The router's decision for one batch of tokens; every tensor stays on the tokens' device.
#[derive(Debug)]
pub struct Routing {
    /// Softmax of the router logits, `[N, E]` (differentiable): the load-balancing loss needs
    /// every expert's probability, not only the chosen ones.
    pub probs: Tensor,
    /// Chosen experts, `[N, k]` int64, highest probability first (topk order).
    pub experts: Tensor,
    /// Gates of the choices, `[N, k]`, renormalised over the chosen k (differentiable); a
    /// choice later dropped at capacity keeps its gate here but contributes nothing.
    pub gates: Tensor,
    /// `E · Σ_e f_e · P_e` over these tokens (unscaled; differentiable through `P` only).
    pub aux_loss: Tensor,
}

/// Routes `x` (`[N, D]`) with `router_weight` (`[E, D]`) to `top_k` experts per token.
pub fn route(x: &Tensor, router_weight: &Tensor, top_k: i64) -> Result<Routing, MoeError> {
    let (xs, ws) = (x.size(), router_weight.size());
    if xs.len() != 2 || ws.len() != 2 || xs[1] != ws[1] {
        return Err(MoeError::Shape(format!(
            "tokens {xs:?} and router weight {ws:?} must be [N, D] and [E, D]"
        )));
    }
    let num_experts = ws[0] as usize;
    check_top_k(top_k, num_experts)?;
    let probs = x
        .f_linear::<Tensor>(router_weight, None)?
        .f_softmax(-1, None)?;
    let (top, experts) = lockstep_models::decisions::topk(&probs, top_k)?;
    let gates = top.f_div(&top.f_sum_dim_intlist(-1, true, None)?)?;
    let aux_loss = load_balancing_loss(&probs, &experts)?;
    Ok(Routing {
        probs,
        experts,
        gates,
        aux_loss,
    })
}

/// Rejects a `top_k` outside `1..=num_experts` (topk would fail deep inside libtorch).
pub fn check_top_k(top_k: i64, num_experts: usize) -> Result<(), MoeError> {
    if top_k < 1 || top_k as usize > num_experts {
        return Err(MoeError::TopK { top_k, num_experts });
    }
    Ok(())
}

/// The Switch/GShard load-balancing loss `E · Σ_e f_e · P_e`: `f_e` is the fraction of the
/// `N · k` token-choices routed to `e` (routing decisions, before any capacity dropping; not
/// differentiable), `P_e` the mean router probability of `e`. It is 1 under perfectly uniform
/// routing and grows as routing concentrates; with no tokens it is 0.
pub fn load_balancing_loss(probs: &Tensor, experts: &Tensor) -> Result<Tensor, MoeError> {
    let size = probs.size();
    if size.len() != 2 || experts.dim() != 2 || experts.size()[0] != size[0] {
        return Err(MoeError::Shape(format!(
            "probabilities {size:?} and choices {:?} must be [N, E] and [N, k]",
            experts.size()
        )));
    }
    let (n, e) = (size[0], size[1]);
    let choices = experts.numel().max(1) as f64;
    let counts = experts.f_reshape([-1])?.f_bincount::<Tensor>(None, e)?;
    let fractions = counts.f_to_kind(probs.kind())?.f_div_scalar(choices)?;
    let mean_probs = probs
        .f_sum_dim_intlist(0, false, probs.kind())?
        .f_div_scalar(n.max(1) as f64)?;
    Ok(fractions
        .f_mul(&mean_probs)?
        .f_sum(probs.kind())?
        .f_mul_scalar(e as f64)?)
}

/// Slots per expert: `ceil(capacity_factor · tokens · top_k / num_experts)`, `None` (no limit)
/// without a factor. `tokens` is the count the capacity is computed over (one rank's).
pub fn capacity(
    capacity_factor: Option<f64>,
    tokens: usize,
    top_k: usize,
    num_experts: usize,
) -> Result<Option<usize>, MoeError> {
    let Some(f) = capacity_factor else {
        return Ok(None);
    };
    if !f.is_finite() || f <= 0.0 {
        return Err(MoeError::CapacityFactor(f));
    }
    if num_experts == 0 {
        return Err(MoeError::TopK {
            top_k: top_k as i64,
            num_experts,
        });
    }
    Ok(Some(
        (f * tokens as f64 * top_k as f64 / num_experts as f64).ceil() as usize,
    ))
}

/// Which choices (`experts`: `[N, k]` int64) fit their expert's `capacity`, as a `[N, k]`
/// bool tensor on the choices' device.
///
/// Priority: every token's first choice in token order, then every token's second choice in
/// token order, and so on, so a token loses its second expert before any token loses its
/// first. Capacity counts only the tokens passed in: under expert parallelism each rank fills
/// its own `capacity` slots per expert with its own tokens (local capacity, as GShard's groups
/// and DeepSpeed do), which needs no communication and does not depend on the other ranks'
/// batches.
pub fn keep_mask(
    experts: &Tensor,
    num_experts: usize,
    capacity: Option<usize>,
) -> Result<Tensor, MoeError> {
    let size = experts.size();
    if size.len() != 2 {
        return Err(MoeError::Shape(format!("choices {size:?} must be [N, k]")));
    }
    let (n, k) = (size[0] as usize, size[1] as usize);
    let choices = host_i64(experts)?;
    let mut kept = vec![false; n * k];
    let mut used = vec![0usize; num_experts];
    for c in 0..k {
        for t in 0..n {
            let e = choices[t * k + c];
            let slot = usize::try_from(e)
                .ok()
                .and_then(|e| used.get_mut(e))
                .ok_or_else(|| {
                    MoeError::Shape(format!("choice {e} is not one of {num_experts} experts"))
                })?;
            if capacity.is_none_or(|cap| *slot < cap) {
                *slot += 1;
                kept[t * k + c] = true;
            }
        }
    }
    Ok(Tensor::from_slice(&kept)
        .f_reshape([n as i64, k as i64])?
        .f_to_device(experts.device())?)
}

/// A tensor's values as int64 on the host (routing metadata lives on the tokens' device).
pub(crate) fn host_i64(t: &Tensor) -> Result<Vec<i64>, MoeError> {
    let flat = t
        .f_reshape([-1])?
        .f_to_device(tch::Device::Cpu)?
        .f_to_kind(Kind::Int64)?;
    Ok(Vec::try_from(&flat)?)
}
