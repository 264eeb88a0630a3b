//! A mixture-of-experts layer whose experts may live on other ranks: a top-k softmax router
//! (gates renormalised over the chosen k, as the zoo's `Moe`), an optional capacity per
//! expert with token dropping, the load-balancing auxiliary loss, and two dispatchers that
//! compute the same thing two ways — all-to-all (each token-choice travels to its expert's
//! rank and back) and all-gather (every rank sees every token and runs its experts on those
//! routed to them; the partial outputs are reduce-scattered home) — for cross-checking.
//!
//! Capacity is per expert over one rank's tokens (`ceil(factor · N · k / E)`), filled in
//! priority order: every token's first choice by token index, then second choices, and so
//! on; a dropped choice contributes nothing and its gate is not renormalised away. Outputs
//! are combined per token in increasing expert index, as the zoo's dense loop adds them.

use crate::autograd::collectives::{all_gather_sequence, all_to_all, reduce_scatter_sequence};
use crate::autograd::AutogradError;
use crate::comm::ProcessGroup;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// A group of ranks sharing the experts of a layer.
pub type EpGroup = Arc<dyn ProcessGroup>;

/// Everything the layer can fail with.
#[derive(Debug, thiserror::Error)]
pub enum MoeError {
    #[error("expert parallel: {num_experts} experts do not divide over an expert-parallel group of {ep}")]
    Indivisible { num_experts: usize, ep: usize },
    #[error("expert parallel: top_k {top_k} exceeds the {num_experts} experts")]
    TopK { top_k: i64, num_experts: usize },
    #[error("expert parallel: this rank holds {held} experts, the layout needs {needed}")]
    Experts { held: usize, needed: usize },
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    #[error(transparent)]
    Comm(#[from] crate::CommError),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// One expert's parameters: `w2(gelu(w1 x + b1)) + b2`.
#[derive(Debug)]
pub struct ExpertParams {
    pub w1: Tensor,
    pub b1: Tensor,
    pub w2: Tensor,
    pub b2: Tensor,
}

impl ExpertParams {
    fn forward(&self, x: &Tensor) -> Result<Tensor, tch::TchError> {
        x.f_linear(&self.w1, Some(&self.b1))?
            .f_gelu("none")?
            .f_linear(&self.w2, Some(&self.b2))
    }
}

/// The layer's shape and policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub top_k: i64,
    /// `None`: no limit (no token is dropped).
    pub capacity_factor: Option<f64>,
    pub aux_loss_coef: f64,
}

/// How token-choices reach the ranks holding their experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dispatcher {
    AllToAll,
    AllGather,
}

/// The router's decision for one rank's tokens.
#[derive(Debug)]
pub struct Routing {
    /// Softmax of the router logits, `[N, E]`.
    pub probs: Tensor,
    /// Chosen experts, `[N, k]`, highest probability first.
    pub experts: Vec<Vec<usize>>,
    /// Renormalised gates of the choices, `[N, k]` (differentiable).
    pub gates: Tensor,
    /// Whether each choice fits its expert's capacity.
    pub kept: Vec<Vec<bool>>,
    /// `E · Σ_e f_e · P_e` (f: share of choices routed to e; P: mean probability of e).
    pub aux_loss: Tensor,
}

/// Routes `x` (`[N, D]`) with `router_weight` (`[E, D]`).
pub fn route(x: &Tensor, router_weight: &Tensor, cfg: &MoeConfig) -> Result<Routing, MoeError> {
    let e = cfg.num_experts;
    if cfg.top_k < 1 || cfg.top_k as usize > e {
        return Err(MoeError::TopK {
            top_k: cfg.top_k,
            num_experts: e,
        });
    }
    let probs = x
        .f_linear::<Tensor>(router_weight, None)?
        .f_softmax(-1, None)?;
    let (top, idx) = probs.f_topk(cfg.top_k, -1, true, true)?;
    let gates = top.f_div(&top.f_sum_dim_intlist(-1, true, None)?)?;
    let n = x.size()[0] as usize;
    let k = cfg.top_k as usize;
    let flat: Vec<i64> = Vec::try_from(&idx.f_reshape([-1])?)?;
    let experts: Vec<Vec<usize>> = flat
        .chunks(k)
        .map(|c| c.iter().map(|&v| v as usize).collect())
        .collect();
    let capacity = cfg
        .capacity_factor
        .map(|f| (f * n as f64 * k as f64 / e as f64).ceil() as usize);
    let mut used = vec![0usize; e];
    let mut kept = vec![vec![false; k]; n];
    for choice in 0..k {
        for (t, row) in experts.iter().enumerate() {
            let ex = row[choice];
            if capacity.is_none_or(|c| used[ex] < c) {
                used[ex] += 1;
                kept[t][choice] = true;
            }
        }
    }
    let mut counts = vec![0f64; e];
    for row in &experts {
        for &ex in row {
            counts[ex] += 1.0;
        }
    }
    let fractions = Tensor::from_slice(&counts)
        .f_div_scalar((n * k) as f64)?
        .f_to_kind(Kind::Float)?;
    let mean_probs = probs.f_mean_dim(0, false, None)?;
    let aux_loss = fractions
        .f_mul(&mean_probs)?
        .f_sum(Kind::Float)?
        .f_mul_scalar(e as f64)?;
    Ok(Routing {
        probs,
        experts,
        gates,
        kept,
        aux_loss,
    })
}

/// The layer's result on one rank.
#[derive(Debug)]
pub struct MoeOutput {
    pub output: Tensor,
    /// `aux_loss_coef ·` the routing's auxiliary loss (add it to the objective).
    pub aux_loss: Tensor,
    pub tokens_dropped: usize,
}

/// One kept token-choice: (token, choice slot, expert).
type Slot = (usize, usize, usize);

fn kept_slots(r: &Routing) -> Vec<Slot> {
    let mut slots = Vec::new();
    for (t, row) in r.experts.iter().enumerate() {
        for (c, &ex) in row.iter().enumerate() {
            if r.kept[t][c] {
                slots.push((t, c, ex));
            }
        }
    }
    slots
}

fn index(v: &[usize]) -> Tensor {
    Tensor::from_slice(&v.iter().map(|&i| i as i64).collect::<Vec<_>>())
}

/// Adds `gate · y` of every slot into its token's row, tokens' choices in increasing expert
/// order. `ys[i]` is slot `i`'s expert output.
fn combine(x: &Tensor, routing: &Routing, slots: &[Slot], ys: &Tensor) -> Result<Tensor, MoeError> {
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| (slots[i].2, slots[i].0));
    let mut out = x.f_zeros_like()?;
    if order.is_empty() {
        return Ok(out);
    }
    let k = routing.gates.size()[1];
    let flat_gates = routing.gates.f_reshape([-1])?;
    // Group by expert: one index_add per expert keeps each token's sum in expert order.
    let mut start = 0;
    while start < order.len() {
        let ex = slots[order[start]].2;
        let end = order[start..]
            .iter()
            .position(|&i| slots[i].2 != ex)
            .map_or(order.len(), |p| start + p);
        let group: Vec<usize> = order[start..end].to_vec();
        let rows = index(&group);
        let tokens = index(&group.iter().map(|&i| slots[i].0).collect::<Vec<_>>());
        let gate_pos = Tensor::from_slice(
            &group
                .iter()
                .map(|&i| slots[i].0 as i64 * k + slots[i].1 as i64)
                .collect::<Vec<_>>(),
        );
        let g = flat_gates.f_index_select(0, &gate_pos)?.f_unsqueeze(1)?;
        let y = ys.f_index_select(0, &rows)?.f_mul(&g)?;
        out = out.f_index_add(0, &tokens, &y)?;
        start = end;
    }
    Ok(out)
}

/// The layer on this rank's tokens `x` (`[N, D]`). `local` are the experts this rank holds:
/// `[first, first + local.len())`; with `group` `None` this process holds every expert.
pub fn moe_forward(
    x: &Tensor,
    router_weight: &Tensor,
    local: &[ExpertParams],
    cfg: &MoeConfig,
    group: Option<&EpGroup>,
    dispatcher: Dispatcher,
) -> Result<MoeOutput, MoeError> {
    let ep = group.map_or(1, |g| g.size());
    let rank = group.map_or(0, |g| g.rank());
    if !cfg.num_experts.is_multiple_of(ep) {
        return Err(MoeError::Indivisible {
            num_experts: cfg.num_experts,
            ep,
        });
    }
    let per = cfg.num_experts / ep;
    if local.len() != per {
        return Err(MoeError::Experts {
            held: local.len(),
            needed: per,
        });
    }
    let first = rank * per;
    let routing = route(x, router_weight, cfg)?;
    let slots = kept_slots(&routing);
    let dropped = routing.experts.len() * cfg.top_k as usize - slots.len();
    let ys = match (group, dispatcher) {
        (None, _) => run_local(x, &slots, local, 0)?,
        (Some(g), Dispatcher::AllToAll) => dispatch_all_to_all(x, &slots, local, first, per, g)?,
        (Some(g), Dispatcher::AllGather) => {
            dispatch_all_gather(x, &routing, &slots, local, first, per, g)?
        }
    };
    let output = combine(x, &routing, &slots, &ys)?;
    Ok(MoeOutput {
        output,
        aux_loss: routing.aux_loss.f_mul_scalar(cfg.aux_loss_coef)?,
        tokens_dropped: dropped,
    })
}

/// Every slot's expert output when this process holds experts `[first, ..)` of them all.
fn run_local(
    x: &Tensor,
    slots: &[Slot],
    experts: &[ExpertParams],
    first: usize,
) -> Result<Tensor, MoeError> {
    let d = x.size()[1];
    let mut ys = Tensor::f_zeros([slots.len() as i64, d], (x.kind(), x.device()))?;
    for (j, expert) in experts.iter().enumerate() {
        let mine: Vec<usize> = (0..slots.len())
            .filter(|&i| slots[i].2 == first + j)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let rows = x.f_index_select(
            0,
            &index(&mine.iter().map(|&i| slots[i].0).collect::<Vec<_>>()),
        )?;
        ys = ys.f_index_add(0, &index(&mine), &expert.forward(&rows)?)?;
    }
    Ok(ys)
}

/// All-to-all: slots sorted by destination rank travel there, run, and travel back.
fn dispatch_all_to_all(
    x: &Tensor,
    slots: &[Slot],
    local: &[ExpertParams],
    first: usize,
    per: usize,
    group: &EpGroup,
) -> Result<Tensor, MoeError> {
    let ep = group.size();
    let d = x.size()[1];
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| (slots[i].2 / per, slots[i].2, slots[i].0));
    let mut send_counts = vec![0usize; ep];
    for &i in &order {
        send_counts[slots[i].2 / per] += 1;
    }
    // Everyone learns how many rows it receives from everyone.
    let counts = Tensor::from_slice(&send_counts.iter().map(|&c| c as i64).collect::<Vec<_>>());
    let all = Tensor::f_zeros([(ep * ep) as i64], (Kind::Int64, tch::Device::Cpu))?;
    group.all_gather(&all, &counts)?;
    let all: Vec<i64> = Vec::try_from(&all)?;
    let recv_counts: Vec<usize> = (0..ep)
        .map(|s| all[s * ep + group.rank()] as usize)
        .collect();
    let rows = x.f_index_select(
        0,
        &index(&order.iter().map(|&i| slots[i].0).collect::<Vec<_>>()),
    )?;
    let received = all_to_all(&rows, group, &recv_counts, &send_counts)?;
    // The experts of what arrives, exchanged the same way (integers: no gradient).
    let ids = Tensor::from_slice(&order.iter().map(|&i| slots[i].2 as f32).collect::<Vec<_>>());
    let got_ids = all_to_all(&ids.f_unsqueeze(1)?, group, &recv_counts, &send_counts)?;
    let got_ids: Vec<f32> = Vec::try_from(&got_ids.f_reshape([-1])?.f_detach()?)?;
    let n_recv = got_ids.len();
    let mut out = Tensor::f_zeros([n_recv as i64, d], (x.kind(), x.device()))?;
    for (j, expert) in local.iter().enumerate() {
        let mine: Vec<usize> = (0..n_recv)
            .filter(|&r| got_ids[r] as usize == first + j)
            .collect();
        if mine.is_empty() {
            continue;
        }
        let sel = index(&mine);
        out = out.f_index_add(
            0,
            &sel,
            &expert.forward(&received.f_index_select(0, &sel)?)?,
        )?;
    }
    let back = all_to_all(&out, group, &send_counts, &recv_counts)?;
    // Back in `order`; put every slot's result at its own index.
    let mut ys = Tensor::f_zeros([slots.len() as i64, d], (x.kind(), x.device()))?;
    if !order.is_empty() {
        ys = ys.f_index_add(0, &index(&order), &back)?;
    }
    Ok(ys)
}

/// All-gather: every rank gathers every rank's tokens and slots, runs its experts on the
/// slots routed to them, and the per-slot partial results are reduce-scattered home (one
/// rank contributes each slot: the sum is exact).
fn dispatch_all_gather(
    x: &Tensor,
    routing: &Routing,
    slots: &[Slot],
    local: &[ExpertParams],
    first: usize,
    per: usize,
    group: &EpGroup,
) -> Result<Tensor, MoeError> {
    let ep = group.size();
    let n = x.size()[0];
    let d = x.size()[1];
    let k = routing.gates.size()[1];
    let everyone = all_gather_sequence(&x.f_contiguous()?, group)?;
    // Slot table as `[N·k]` expert ids (−1 where dropped), gathered from every rank.
    let mut table = vec![-1f32; (n * k) as usize];
    for &(t, c, ex) in slots {
        table[t * k as usize + c] = ex as f32;
    }
    let table = Tensor::from_slice(&table);
    let all = Tensor::f_zeros([(ep as i64) * n * k], (Kind::Float, tch::Device::Cpu))?;
    group.all_gather(&all, &table)?;
    let all: Vec<f32> = Vec::try_from(&all)?;
    let mut partial = Tensor::f_zeros([ep as i64 * n * k, d], (x.kind(), x.device()))?;
    for (j, expert) in local.iter().enumerate() {
        let ex = (first + j) as f32;
        let mine: Vec<usize> = (0..all.len()).filter(|&s| all[s] == ex).collect();
        if mine.is_empty() {
            continue;
        }
        let tokens = index(&mine.iter().map(|&s| s / k as usize).collect::<Vec<_>>());
        let y = expert.forward(&everyone.f_index_select(0, &tokens)?)?;
        partial = partial.f_index_add(0, &index(&mine), &y)?;
    }
    let _ = per;
    // Back home: this rank's N·k slots, summed over ranks.
    let home = reduce_scatter_sequence(&partial, group)?;
    let positions: Vec<usize> = slots.iter().map(|&(t, c, _)| t * k as usize + c).collect();
    if positions.is_empty() {
        return Ok(Tensor::f_zeros([0, d], (x.kind(), x.device()))?);
    }
    Ok(home.f_index_select(0, &index(&positions))?)
}
