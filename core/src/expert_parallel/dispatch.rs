//! Getting token-choices to the ranks holding their experts and the results back, two ways
//! that compute the same thing (so each checks the other), plus the one-process path.
//!
//! Rank `r` of an `ep` group holds experts `[r·E/ep, (r+1)·E/ep)`. Every function returns the
//! expert output of every kept choice of this rank's tokens, ungated, as `[M, D]` rows in
//! [`DispatchPlan`] order; [`combine`] weights and adds them.
//!
//! Every rank runs the same collectives whatever the routing: each local expert runs even on
//! zero rows, so its output always carries a gradient history, every differentiable
//! collective's backward runs on every rank, and an expert that no token chose still gets a
//! (zero) gradient. Data-dependent participation would desynchronize the backward.

use super::error::MoeError;
use super::experts::{experts_per_rank, EpGroup, ExpertParams};
use super::router::host_i64;
use crate::autograd::collectives::{all_gather_sequence, all_to_all, reduce_scatter_sequence};
use tch::{Device, Kind, Tensor};

/// One rank's kept token-choices sorted by (expert, token): the order an expert sees its rows
/// in (tokens ascending, as in the concatenation of every rank's batch) and the order the
/// combine adds them in (each token's experts in increasing index, as the zoo's dense loop).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DispatchPlan {
    /// Token (row of `x`) of each kept choice.
    tokens: Vec<i64>,
    /// Position `t · k + c` of each kept choice in the flattened `[N, k]` routing tensors.
    positions: Vec<i64>,
    /// Kept choices per expert, `[E]` (contiguous runs of the sorted order).
    per_expert: Vec<usize>,
    /// Tokens and choices per token of the routing this plan was made from.
    n: usize,
    k: usize,
}

impl DispatchPlan {
    /// The plan of `experts` (`[N, k]` int64 choices) restricted to `kept` (`[N, k]` bool).
    pub fn new(experts: &Tensor, kept: &Tensor, num_experts: usize) -> Result<Self, MoeError> {
        let size = experts.size();
        if size.len() != 2 || kept.size() != size {
            return Err(MoeError::Shape(format!(
                "choices {size:?} and keep mask {:?} must both be [N, k]",
                kept.size()
            )));
        }
        let (n, k) = (size[0] as usize, size[1] as usize);
        let choices = host_i64(experts)?;
        let keep: Vec<bool> = host_i64(kept)?.iter().map(|&v| v != 0).collect();
        let mut slots: Vec<(usize, i64, i64)> = Vec::new();
        let mut per_expert = vec![0usize; num_experts];
        for (pos, (&e, &keep)) in choices.iter().zip(&keep).enumerate() {
            if !keep {
                continue;
            }
            let count = usize::try_from(e)
                .ok()
                .and_then(|e| per_expert.get_mut(e))
                .ok_or_else(|| {
                    MoeError::Shape(format!("choice {e} is not one of {num_experts} experts"))
                })?;
            *count += 1;
            slots.push((e as usize, (pos / k.max(1)) as i64, pos as i64));
        }
        slots.sort_unstable();
        Ok(DispatchPlan {
            tokens: slots.iter().map(|s| s.1).collect(),
            positions: slots.iter().map(|s| s.2).collect(),
            per_expert,
            n,
            k,
        })
    }

    /// Kept choices (rows of the dispatch).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether nothing is kept (the rank still joins every collective).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token (row of `x`) of each kept choice, in plan order.
    pub fn tokens(&self) -> &[i64] {
        &self.tokens
    }

    /// Position `t · k + c` of each kept choice in the flattened `[N, k]` routing tensors.
    pub fn positions(&self) -> &[i64] {
        &self.positions
    }

    /// Kept choices per expert, in expert order.
    pub fn per_expert(&self) -> &[usize] {
        &self.per_expert
    }

    /// Choices dropped at capacity.
    pub fn dropped(&self) -> usize {
        self.n * self.k - self.tokens.len()
    }
}

fn index(v: &[i64], device: Device) -> Result<Tensor, MoeError> {
    Ok(Tensor::from_slice(v).f_to_device(device)?)
}

/// Rows of `x` for experts `[first, first + experts.len())`, run as one batch per expert in the
/// plan's order, concatenated in expert order (every expert runs, even on no rows).
fn run_experts(
    rows: &Tensor,
    counts: &[usize],
    experts: &[ExpertParams],
) -> Result<Tensor, MoeError> {
    let mut outs = Vec::with_capacity(experts.len());
    let mut start = 0i64;
    for (expert, &count) in experts.iter().zip(counts) {
        outs.push(expert.forward(&rows.f_narrow(0, start, count as i64)?)?);
        start += count as i64;
    }
    Ok(Tensor::f_cat(&outs, 0)?)
}

/// One process holds every expert: each expert runs on its kept rows, in plan order.
pub fn run_all_local(
    x: &Tensor,
    plan: &DispatchPlan,
    experts: &[ExpertParams],
) -> Result<Tensor, MoeError> {
    if experts.len() != plan.per_expert.len() {
        return Err(MoeError::Experts {
            held: experts.len(),
            needed: plan.per_expert.len(),
        });
    }
    width(x, plan)?;
    let rows = x.f_index_select(0, &index(&plan.tokens, x.device())?)?;
    run_experts(&rows, &plan.per_expert, experts)
}

/// The token width `D`, once `x` is checked to be the `[N, D]` the plan was made for.
fn width(x: &Tensor, plan: &DispatchPlan) -> Result<i64, MoeError> {
    match x.size()[..] {
        [n, d] if n as usize == plan.n => Ok(d),
        ref size => Err(MoeError::Shape(format!(
            "tokens {size:?} are not the [{}, D] the dispatch plan was made for",
            plan.n
        ))),
    }
}

/// Experts per rank, and this rank's first expert, for `num_experts` over `group`.
fn layout(num_experts: usize, group: &EpGroup, local: usize) -> Result<(usize, usize), MoeError> {
    let per = experts_per_rank(num_experts, group.size())?;
    if local != per {
        return Err(MoeError::Experts {
            held: local,
            needed: per,
        });
    }
    Ok((per, group.rank() * per))
}

/// All-to-all: every kept choice's token row travels to the rank holding its expert (uneven
/// splits: a rank may send nothing to another), the local experts run, and the results travel
/// back by the reverse all-to-all. Both exchanges are the differentiable [`all_to_all`], so the
/// backward sends output gradients to the experts and input gradients home the same way.
///
/// One small integer all-to-all first tells every rank how many rows it gets per (source,
/// local expert); rows arrive grouped by source rank, then expert, then token.
pub fn dispatch_all_to_all(
    x: &Tensor,
    plan: &DispatchPlan,
    local: &[ExpertParams],
    group: &EpGroup,
) -> Result<Tensor, MoeError> {
    let ep = group.size();
    let (per, _) = layout(plan.per_expert.len(), group, local.len())?;
    width(x, plan)?;
    let counts: Vec<i64> = plan.per_expert.iter().map(|&c| c as i64).collect();
    let dev = x.device();
    let counts = index(&counts, dev)?;
    let got = counts.f_zeros_like()?;
    group.all_to_all(&got, &counts, &[], &[])?;
    // got[s · per + j]: rows source s sends to local expert j.
    let got = host_i64(&got)?;
    let got: Vec<usize> = got.iter().map(|&c| c.max(0) as usize).collect();
    let send: Vec<usize> = plan
        .per_expert
        .chunks(per)
        .map(|c| c.iter().sum())
        .collect();
    let recv: Vec<usize> = got.chunks(per).map(|c| c.iter().sum()).collect();
    let rows = x.f_index_select(0, &index(&plan.tokens, dev)?)?;
    let received = all_to_all(&rows, group, &recv, &send)?;
    // Regroup by local expert (sources in rank order, so tokens in concatenation order).
    let mut offsets = vec![0usize; ep];
    for s in 1..ep {
        offsets[s] = offsets[s - 1] + recv[s - 1];
    }
    let mut order: Vec<i64> = Vec::with_capacity(recv.iter().sum());
    let mut per_local = vec![0usize; per];
    for (j, count) in per_local.iter_mut().enumerate() {
        for (s, &offset) in offsets.iter().enumerate() {
            let before: usize = got[s * per..s * per + j].iter().sum();
            let len = got[s * per + j];
            order.extend((offset + before..offset + before + len).map(|i| i as i64));
            *count += len;
        }
    }
    let mut inverse = vec![0i64; order.len()];
    for (pos, &row) in order.iter().enumerate() {
        inverse[row as usize] = pos as i64;
    }
    let grouped = received.f_index_select(0, &index(&order, dev)?)?;
    let outputs = run_experts(&grouped, &per_local, local)?;
    let outputs = outputs.f_index_select(0, &index(&inverse, dev)?)?;
    Ok(all_to_all(&outputs, group, &send, &recv)?)
}

/// All-gather: every rank gathers every rank's tokens (padded to the largest batch) and kept
/// choices, runs its experts on the choices routed to them, and writes each result into that
/// choice's slot of a `[ep · N_max · k, D]` buffer; a reduce-scatter brings every rank its own
/// slots (exactly one rank wrote each, so the sum is exact). Differentiable through
/// [`all_gather_sequence`] (backward: reduce-scatter of token gradients) and
/// [`reduce_scatter_sequence`] (backward: all-gather of slot gradients).
pub fn dispatch_all_gather(
    x: &Tensor,
    plan: &DispatchPlan,
    local: &[ExpertParams],
    group: &EpGroup,
) -> Result<Tensor, MoeError> {
    let ep = group.size();
    let (_, first) = layout(plan.per_expert.len(), group, local.len())?;
    let (n, k) = (plan.n, plan.k);
    let d = width(x, plan)?;
    let dev = x.device();
    let sizes = Tensor::f_zeros([ep as i64], (Kind::Int64, dev))?;
    group.all_gather(&sizes, &index(&[n as i64], dev)?)?;
    let sizes = host_i64(&sizes)?;
    let n_max = sizes.iter().copied().max().unwrap_or(0).max(0) as usize;
    let padded = if n < n_max {
        let pad = Tensor::f_zeros([(n_max - n) as i64, d], (x.kind(), dev))?;
        Tensor::f_cat(&[x.shallow_clone(), pad], 0)?
    } else {
        x.f_contiguous()?
    };
    let everyone = all_gather_sequence(&padded, group)?;
    // Slot table: the expert of each kept choice, −1 elsewhere (dropped or padding).
    let mut table = vec![-1i64; n_max * k];
    for (&pos, e) in plan.positions.iter().zip(expert_of_slots(plan)) {
        table[pos as usize] = e as i64;
    }
    let all = Tensor::f_zeros([(ep * n_max * k) as i64], (Kind::Int64, dev))?;
    group.all_gather(&all, &index(&table, dev)?)?;
    let all = host_i64(&all)?;
    let mut slots: Vec<i64> = Vec::new();
    let mut counts = vec![0usize; local.len()];
    for (j, count) in counts.iter_mut().enumerate() {
        let e = (first + j) as i64;
        let mine = (0..all.len()).filter(|&s| all[s] == e).map(|s| s as i64);
        let before = slots.len();
        slots.extend(mine);
        *count = slots.len() - before;
    }
    // Slot s of rank r's table is token s / k of the gathered batch (r · N_max + t).
    let rows: Vec<i64> = slots.iter().map(|&s| s / k as i64).collect();
    let inputs = everyone.f_index_select(0, &index(&rows, dev)?)?;
    let outputs = run_experts(&inputs, &counts, local)?;
    let partial = Tensor::f_zeros([(ep * n_max * k) as i64, d], (x.kind(), dev))?.f_index_add(
        0,
        &index(&slots, dev)?,
        &outputs,
    )?;
    let home = reduce_scatter_sequence(&partial, group)?;
    Ok(home.f_index_select(0, &index(&plan.positions, dev)?)?)
}

/// The expert of every kept choice, in plan order.
fn expert_of_slots(plan: &DispatchPlan) -> impl Iterator<Item = usize> + '_ {
    plan.per_expert
        .iter()
        .enumerate()
        .flat_map(|(e, &c)| std::iter::repeat_n(e, c))
}

/// `Σ gate · y` per token: the expert outputs `ys` (`[M, D]`, plan order) weighted by their
/// gates (`[N, k]`) and added into a zero `[N, D]` in plan order, so each token adds its
/// experts' contributions in increasing expert index (as the zoo's dense loop does; on CPU the
/// additions run in index order). Always part of the graph, even with nothing kept, so every
/// rank's backward reaches the dispatch.
pub fn combine(
    x: &Tensor,
    gates: &Tensor,
    plan: &DispatchPlan,
    ys: &Tensor,
) -> Result<Tensor, MoeError> {
    width(x, plan)?;
    let dev = x.device();
    let gate = gates
        .f_reshape([-1])?
        .f_index_select(0, &index(&plan.positions, dev)?)?
        .f_unsqueeze(1)?;
    let weighted = ys.f_mul(&gate)?;
    Ok(x.f_zeros_like()?
        .f_index_add(0, &index(&plan.tokens, dev)?, &weighted)?)
}
