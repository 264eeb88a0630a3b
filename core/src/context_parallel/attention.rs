//! Causal attention over a sequence split into chunks: the ring (key/value blocks passed
//! around the CP group, each block's partial result merged by its log-sum-exp), the
//! all-gather dispatcher (every key and value gathered, local queries attending at once), and
//! the single-device attention computed block by block in the ring's merge order
//! (`single.cpN`'s).
//!
//! A block's partial result is kept unnormalized as `(max, sum, acc)`: the row maximum of its
//! scores (detached: the result does not depend on it), `Σ exp(s − max)` and
//! `Σ exp(s − max)·v`. Two partial results merge by rescaling both to their common maximum,
//! and the output is `acc / sum` once every block is in. Query chunk `a` meets key chunk `b`
//! only when `b ≤ a` (a later chunk is wholly in its future), the diagonal block masked.

use super::layout::{chunk_count, chunks_of, positions_of};
use super::options::{CpDispatcher, CpFault, CpOptions, SequenceLayout};
use crate::autograd::collectives::{all_gather_sequence, all_to_all};
use crate::autograd::AutogradError;
use crate::comm::ProcessGroup;
use lockstep_models::functional::causal_attention;
use std::sync::Arc;
use tch::{Kind, TchError, Tensor};

/// What computing attention across the CP group can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CpAttentionError {
    /// A tensor op failed.
    #[error(transparent)]
    Torch(#[from] TchError),
    /// A differentiable collective failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
}

/// One block's (or several merged blocks') attention for a chunk of queries, unnormalized.
struct Partial {
    max: Tensor,
    sum: Tensor,
    acc: Tensor,
}

/// Queries `q` against one chunk of keys and values (`(B, H, c, d)` each); `diagonal`: the
/// keys are the queries' own chunk, so each query sees only the keys up to itself.
fn block(q: &Tensor, k: &Tensor, v: &Tensor, diagonal: bool) -> Result<Partial, TchError> {
    let (c, hd) = (q.size()[2], q.size()[3]);
    let mut scores = q
        .f_matmul(&k.f_transpose(-2, -1)?)?
        .f_mul_scalar(1.0 / (hd as f64).sqrt())?;
    if diagonal {
        let future = Tensor::f_ones([c, c], (Kind::Bool, q.device()))?.f_triu(1)?;
        scores = scores.f_masked_fill(&future, f64::NEG_INFINITY)?;
    }
    let max = scores.f_amax([-1].as_slice(), true)?.f_detach()?;
    let weights = scores.f_sub(&max)?.f_exp()?;
    Ok(Partial {
        sum: weights.f_sum_dim_intlist([-1].as_slice(), true, None)?,
        acc: weights.f_matmul(v)?,
        max,
    })
}

/// `running` and `next` merged (online softmax): both rescaled to their common maximum.
/// `block_max` plants [`CpFault::MergeWithBlockMax`]: the block's maximum taken as the
/// merged one, nothing rescaled.
fn merge(running: Option<Partial>, next: Partial, block_max: bool) -> Result<Partial, TchError> {
    let Some(run) = running else {
        return Ok(next);
    };
    if block_max {
        return Ok(Partial {
            sum: run.sum.f_add(&next.sum)?,
            acc: run.acc.f_add(&next.acc)?,
            max: next.max,
        });
    }
    let max = run.max.f_maximum(&next.max)?;
    let old = run.max.f_sub(&max)?.f_exp()?;
    let new = next.max.f_sub(&max)?.f_exp()?;
    Ok(Partial {
        sum: run.sum.f_mul(&old)?.f_add(&next.sum.f_mul(&new)?)?,
        acc: run.acc.f_mul(&old)?.f_add(&next.acc.f_mul(&new)?)?,
        max,
    })
}

/// The chunk `index` of length `len` along the sequence dimension (2) of `t`.
fn chunk(t: &Tensor, index: usize, len: i64) -> Result<Tensor, TchError> {
    t.f_narrow(2, index as i64 * len, len)
}

/// The global chunk ids whose keys rank `src` holds, as this run believes: its layout's, or
/// under [`CpFault::ChunksInRankOrder`] the contiguous order's (`2·src`, `2·src + 1`).
fn key_chunks(opts: &CpOptions, src: usize) -> Vec<usize> {
    match (opts.fault, opts.layout) {
        (Some(CpFault::ChunksInRankOrder), SequenceLayout::Balanced) => vec![2 * src, 2 * src + 1],
        _ => chunks_of(opts.layout, src, opts.cp),
    }
}

/// The key chunks query chunk `a` (held by rank `owner`) meets, in the ring's order: at hop
/// `t` the keys of rank `owner − t` arrive, their chunks in the order that rank holds them;
/// chunks after `a` are wholly in its future and skipped.
fn ring_order(opts: &CpOptions, owner: usize, a: usize) -> Vec<usize> {
    let cp = opts.cp;
    (0..cp)
        .flat_map(|hop| key_chunks(opts, (owner + cp - hop) % cp))
        .filter(|&b| b <= a)
        .collect()
}

/// Causal attention of this rank's queries over the whole sequence, its keys and values
/// reaching the other ranks by `opts.dispatcher` over `group` (the CP group, `rank` this
/// rank's place in it). `q`, `k`, `v`: `(B, H, T/cp, d)`, this rank's chunks in the order it
/// holds them.
pub fn context_parallel_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Arc<dyn ProcessGroup>,
    rank: usize,
    opts: &CpOptions,
) -> Result<Tensor, CpAttentionError> {
    if opts.fault == Some(CpFault::LocalAttentionOnly) || opts.cp == 1 {
        return Ok(causal_attention(q, k, v)?);
    }
    match opts.dispatcher {
        CpDispatcher::Ring => ring_attention(q, k, v, group, rank, opts),
        CpDispatcher::AllGather => all_gather_attention(q, k, v, group, rank, opts),
    }
}

/// Ring attention: at each hop this rank's queries meet the key/value block it holds, which
/// then moves one rank on (sent to `rank + 1`, received from `rank − 1`, a differentiable
/// exchange whose backward sends the gradient back the way it came).
fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Arc<dyn ProcessGroup>,
    rank: usize,
    opts: &CpOptions,
) -> Result<Tensor, CpAttentionError> {
    let cp = opts.cp;
    let mine = chunks_of(opts.layout, rank, cp);
    let len = q.size()[2] / mine.len() as i64;
    let block_max = opts.fault == Some(CpFault::MergeWithBlockMax);
    let mut partials: Vec<Option<Partial>> = mine.iter().map(|_| None).collect();
    let mut kv = Tensor::f_stack(&[k, v], 0)?;
    let (next, previous) = ((rank + 1) % cp, (rank + cp - 1) % cp);
    // Blocks whose keys are all in this rank's future (a contiguous layout's early ranks).
    let mut skipped: Vec<Tensor> = Vec::new();
    for hop in 0..cp {
        let src = (rank + cp - hop) % cp;
        let (keys, values) = (kv.get(0), kv.get(1));
        let held = key_chunks(opts, src);
        if held.iter().all(|&b| mine.iter().all(|&a| b > a)) {
            skipped.push(kv.shallow_clone());
        }
        for (i, &a) in mine.iter().enumerate() {
            let qa = chunk(q, i, len)?;
            for (j, b) in held.iter().copied().enumerate() {
                if b > a {
                    continue;
                }
                let part = block(
                    &qa,
                    &chunk(&keys, j, len)?,
                    &chunk(&values, j, len)?,
                    a == b,
                )?;
                partials[i] = Some(merge(partials[i].take(), part, block_max)?);
            }
        }
        if hop + 1 < cp {
            let split = |to: usize| (0..cp).map(|r| if r == to { 2 } else { 0 }).collect();
            let (send, receive): (Vec<usize>, Vec<usize>) = (split(next), split(previous));
            kv = all_to_all(&kv, group, &receive, &send)?;
            if opts.fault == Some(CpFault::KvGradsNotReturned) {
                // Planted: the received block leaves the graph, so its gradient stays here.
                kv = kv.f_detach()?;
            }
        }
    }
    let out = finish(partials)?;
    // Every rank must run the ring's backward exchanges, the same ones in the same order:
    // a block this rank skipped still passes its gradient (zero) back around the ring, so
    // it stays in the graph with a zero weight (adding exact zeros changes no value).
    match skipped.is_empty() {
        true => Ok(out),
        false => {
            let zero = Tensor::f_stack(&skipped, 0)?
                .f_sum(out.kind())?
                .f_mul_scalar(0.0)?;
            Ok(out.f_add(&zero)?)
        }
    }
}

/// Every query chunk's output, `acc / sum`, concatenated in the order they were given.
fn finish(partials: Vec<Option<Partial>>) -> Result<Tensor, CpAttentionError> {
    let outs = partials
        .into_iter()
        .flatten()
        .map(|p| p.acc.f_div(&p.sum))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&outs, 2)?)
}

/// The all-gather dispatcher: every rank's keys and values gathered and put back in sequence
/// order, this rank's queries attending to all of them under the causal mask of their global
/// positions (one softmax, as a single device computes it).
fn all_gather_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    group: &Arc<dyn ProcessGroup>,
    rank: usize,
    opts: &CpOptions,
) -> Result<Tensor, CpAttentionError> {
    let (cp, layout) = (opts.cp, opts.layout);
    let mine = chunks_of(layout, rank, cp);
    let len = q.size()[2] / mine.len() as i64;
    let seq = len * chunk_count(layout, cp) as i64;
    let kv = Tensor::f_stack(&[k, v], 0)?.f_unsqueeze(0)?;
    let gathered = all_gather_sequence(&kv, group)?;
    // Global chunk g sits on its owner's row of `gathered`, at the owner's index for it.
    let mut placed: Vec<(usize, Tensor)> = Vec::new();
    for src in 0..cp {
        let block = gathered.get(src as i64);
        for (j, g) in key_chunks(opts, src).into_iter().enumerate() {
            placed.push((g, block.f_narrow(3, j as i64 * len, len)?));
        }
    }
    placed.sort_by_key(|(g, _)| *g);
    let parts: Vec<Tensor> = placed.into_iter().map(|(_, t)| t).collect();
    let whole = Tensor::f_cat(&parts, 3)?;
    let (keys, values) = (whole.get(0), whole.get(1));
    let device = q.device();
    let query_positions =
        Tensor::from_slice(&positions_of(layout, rank, cp, seq)).f_to_device(device)?;
    let key_positions = Tensor::f_arange(seq, (Kind::Int64, device))?;
    let future = key_positions
        .f_unsqueeze(0)?
        .f_gt_tensor(&query_positions.f_unsqueeze(1)?)?;
    let hd = q.size()[3];
    Ok(q.f_matmul(&keys.f_transpose(-2, -1)?)?
        .f_mul_scalar(1.0 / (hd as f64).sqrt())?
        .f_masked_fill(&future, f64::NEG_INFINITY)?
        .f_softmax(-1, None)?
        .f_matmul(&values)?)
}

/// Single-device causal attention over the whole sequence (`(B, H, T, d)`) computed as the
/// ring computes it: each query chunk merged with its key chunks block by block, in the
/// order the ring brings them to the rank holding it (`single.cpN`'s attention).
pub fn ring_order_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &CpOptions,
) -> Result<Tensor, CpAttentionError> {
    let chunks = chunk_count(opts.layout, opts.cp);
    let len = q.size()[2] / chunks as i64;
    let mut outs: Vec<Option<Tensor>> = (0..chunks).map(|_| None).collect();
    for owner in 0..opts.cp {
        for a in chunks_of(opts.layout, owner, opts.cp) {
            let qa = chunk(q, a, len)?;
            let mut running = None;
            for b in ring_order(opts, owner, a) {
                let part = block(&qa, &chunk(k, b, len)?, &chunk(v, b, len)?, a == b)?;
                running = Some(merge(running, part, false)?);
            }
            outs[a] = Some(finish(vec![running])?);
        }
    }
    let outs: Vec<Tensor> = outs.into_iter().flatten().collect();
    Ok(Tensor::f_cat(&outs, 2)?)
}
