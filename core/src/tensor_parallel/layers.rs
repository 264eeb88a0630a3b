//! Tensor-parallel layers as functions of this rank's parameter shards and a TP group.
//!
//! Each function is the single-device layer with its parameters split across the group and
//! the differentiable collectives of [`crate::autograd::collectives`] placed where the split
//! sums or concatenates partial results; plans that apply them to models live elsewhere.
//! Every rank of the group must call the same functions in the same order with shards of the
//! same shapes (backward passes communicate too).

use crate::autograd::collectives::{
    all_gather_sequence, copy_to_parallel, gather_from_parallel, reduce_from_parallel,
    reduce_scatter_sequence, scatter_to_parallel,
};
use crate::autograd::{apply, AutogradError};
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use std::sync::Arc;
use tch::{Kind, Tensor};

/// The tensor-parallel group every layer function runs on.
pub type TpGroup = Arc<dyn ProcessGroup>;

/// Everything a tensor-parallel layer or sharding helper can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TpLayerError {
    /// A dimension that must be split evenly across the group is not a multiple of its size.
    #[error(
        "{what}: dimension {dim} of size {size} does not divide by the tensor-parallel size {tp}"
    )]
    Indivisible {
        /// Which tensor was being split.
        what: String,
        /// The dimension to split.
        dim: i64,
        /// The tensor's extent along `dim`.
        size: i64,
        /// The tensor-parallel group size.
        tp: usize,
    },
    /// Tensors whose shapes do not fit together (a weight shard that does not match the
    /// input, a dimension that does not exist, ...).
    #[error("{0}")]
    Shape(String),
    /// An argument outside its domain (a rank beyond the world, a dropout probability > 1).
    #[error("{0}")]
    Invalid(String),
    /// A differentiable collective or custom function failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A plain collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A libtorch operation failed.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

type Result<T> = std::result::Result<T, TpLayerError>;

/// How a column-parallel linear treats its input and output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ColumnOptions {
    /// Concatenate every rank's output features, so the caller gets the full output
    /// (otherwise the output stays split by features, ready for a row-parallel linear).
    pub gather_output: bool,
    /// The input arrives split along dim 0 (the sequence, Megatron's SP) and is all-gathered
    /// on entry; backward reduce-scatters its gradient back onto the sequence shards.
    pub sequence_parallel: bool,
    /// The input already went through [`enter_column`] (one entry shared by several
    /// column-parallel linears of the same input, as q, k and v share one): no collective.
    pub entered: bool,
}

/// How a row-parallel linear treats its input and output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowOptions {
    /// The input is already split by features (a column-parallel linear's output); otherwise
    /// it is full and this rank keeps its chunk of the last dimension.
    pub input_is_parallel: bool,
    /// Leave the output split along dim 0 (the sequence, Megatron's SP): the partial sums are
    /// reduce-scattered instead of all-reduced.
    pub sequence_parallel: bool,
    /// Under sequence parallelism, the partial output is batch first `(B, T, …)`: it is made
    /// sequence first before the reduce-scatter, so the result is the `(T/t, B, …)` shard.
    pub batch_first: bool,
}

/// How per-token losses become the loss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// The mean over tokens (`torch.nn.functional.cross_entropy`'s default).
    #[default]
    Mean,
    /// The sum over tokens.
    Sum,
}

/// `d` as a non-negative index into `t`'s dimensions, or an error naming both.
fn normalize_dim(t: &Tensor, dim: i64, what: &str) -> Result<i64> {
    let n = t.dim() as i64;
    let d = if dim < 0 { n + dim } else { dim };
    if n == 0 || d < 0 || d >= n {
        return Err(TpLayerError::Shape(format!(
            "{what}: dimension {dim} does not exist in a tensor of shape {:?}",
            t.size()
        )));
    }
    Ok(d)
}

/// The length of one of `tp` equal chunks of `t` along `dim`.
fn chunk(t: &Tensor, dim: i64, tp: usize, what: &str) -> Result<i64> {
    let d = normalize_dim(t, dim, what)?;
    let size = t.size()[d as usize];
    if tp == 0 || size % tp as i64 != 0 {
        return Err(TpLayerError::Indivisible {
            what: what.to_owned(),
            dim: d,
            size,
            tp,
        });
    }
    Ok(size / tp as i64)
}

fn expect_dims(t: &Tensor, dims: usize, what: &str) -> Result<()> {
    if t.dim() != dims {
        return Err(TpLayerError::Shape(format!(
            "{what} must have {dims} dimensions, got shape {:?}",
            t.size()
        )));
    }
    Ok(())
}

fn last_dim(t: &Tensor, what: &str) -> Result<i64> {
    t.size()
        .last()
        .copied()
        .ok_or_else(|| TpLayerError::Shape(format!("{what} must have at least one dimension")))
}

/// Checks the bias of a linear with `out` output features.
fn check_bias(bias: Option<&Tensor>, out: i64, what: &str) -> Result<()> {
    match bias {
        Some(b) if b.size() != [out] => Err(TpLayerError::Shape(format!(
            "{what} must have shape [{out}], got {:?}",
            b.size()
        ))),
        _ => Ok(()),
    }
}

/// Enters a column-parallel region: `copy_to_parallel` (identity forward, all-reduce of the
/// gradient backward) or, under sequence parallelism, `all_gather_sequence` of the dim-0
/// shards (reduce-scatter backward). Several column-parallel linears of one input share one
/// entry, so its gradient is reduced once.
pub fn enter_column(x: &Tensor, group: &TpGroup, sequence_parallel: bool) -> Result<Tensor> {
    if sequence_parallel {
        Ok(all_gather_sequence(x, group)?)
    } else {
        Ok(copy_to_parallel(x, group)?)
    }
}

/// A linear whose weight is split by output features (`weight_shard`: `[out/t, in]`, bias
/// `[out/t]`): every rank computes its slice of the output features from the full input.
///
/// Forward enters with `copy_to_parallel` (identity; its backward all-reduces the input
/// gradient, the sum of every rank's partial gradient) or, under sequence parallelism,
/// `all_gather_sequence` (the input arrives split along dim 0). With `gather_output` the
/// feature slices are concatenated, otherwise the output stays split for a row-parallel
/// linear.
pub fn column_parallel_linear(
    x: &Tensor,
    weight_shard: &Tensor,
    bias_shard: Option<&Tensor>,
    group: &TpGroup,
    opts: ColumnOptions,
) -> Result<Tensor> {
    expect_dims(weight_shard, 2, "column-parallel weight shard")?;
    let (out_local, inp) = (weight_shard.size()[0], weight_shard.size()[1]);
    if last_dim(x, "column-parallel input")? != inp {
        return Err(TpLayerError::Shape(format!(
            "column-parallel input of shape {:?} does not fit a weight shard of shape {:?} \
             (last dimension must be {inp})",
            x.size(),
            weight_shard.size()
        )));
    }
    check_bias(bias_shard, out_local, "column-parallel bias shard")?;
    let input = if opts.entered {
        x.shallow_clone()
    } else {
        enter_column(x, group, opts.sequence_parallel)?
    };
    let y = input.f_linear(weight_shard, bias_shard)?;
    if opts.gather_output {
        Ok(gather_from_parallel(&y, group)?)
    } else {
        Ok(y)
    }
}

/// A linear whose weight is split by input features (`weight_shard`: `[out, in/t]`): every
/// rank multiplies its slice of the input features, and the partial products are summed.
///
/// A full input is first cut to this rank's feature chunk (`scatter_to_parallel`, whose
/// backward all-gathers). The partial sums are all-reduced (`reduce_from_parallel`) or,
/// under sequence parallelism, reduce-scattered along dim 0 (`reduce_scatter_sequence`).
/// The full `bias` (`[out]`) is added once, after the reduction, so it is not counted `t`
/// times: its gradient is complete on every rank, except under sequence parallelism, where
/// each rank adds it to its own positions and the gradients must be summed over the group.
pub fn row_parallel_linear(
    x: &Tensor,
    weight_shard: &Tensor,
    bias: Option<&Tensor>,
    group: &TpGroup,
    opts: RowOptions,
) -> Result<Tensor> {
    expect_dims(weight_shard, 2, "row-parallel weight shard")?;
    let (out, in_local) = (weight_shard.size()[0], weight_shard.size()[1]);
    let tp = group.size();
    let want = if opts.input_is_parallel {
        in_local
    } else {
        in_local * tp as i64
    };
    let have = last_dim(x, "row-parallel input")?;
    if have != want {
        return Err(TpLayerError::Shape(format!(
            "row-parallel input of shape {:?} does not fit a weight shard of shape {:?} \
             (last dimension must be {want}{})",
            x.size(),
            weight_shard.size(),
            if opts.input_is_parallel {
                ""
            } else {
                ", the full input features"
            }
        )));
    }
    check_bias(bias, out, "row-parallel bias")?;
    let input = if opts.input_is_parallel {
        x.shallow_clone()
    } else {
        scatter_to_parallel(x, group)?
    };
    let partial = input.f_linear::<Tensor>(weight_shard, None)?;
    let y = if opts.sequence_parallel {
        let partial = if opts.batch_first {
            partial.f_transpose(0, 1)?.f_contiguous()?
        } else {
            partial
        };
        chunk(&partial, 0, tp, "row-parallel output (sequence-parallel)")?;
        reduce_scatter_sequence(&partial, group)?
    } else {
        reduce_from_parallel(&partial, group)?
    };
    match bias {
        Some(b) => Ok(y.f_add(b)?),
        None => Ok(y),
    }
}

/// An embedding whose table is split by vocabulary rows (`weight_shard`: `[V/t, D]`, rows
/// `vocab_start..vocab_start + V/t` of the full table).
///
/// Ids outside this rank's range are looked up as row 0 and their vectors zeroed (so they
/// also get no gradient); the partial embeddings are all-reduced, each id contributing from
/// the one rank that owns it. Backward needs no communication.
pub fn vocab_parallel_embedding(
    ids: &Tensor,
    weight_shard: &Tensor,
    vocab_start: i64,
    group: &TpGroup,
) -> Result<Tensor> {
    expect_dims(weight_shard, 2, "vocab-parallel embedding shard")?;
    if !matches!(ids.kind(), Kind::Int64 | Kind::Int) {
        return Err(TpLayerError::Invalid(format!(
            "vocab-parallel embedding ids must be integers, got {:?}",
            ids.kind()
        )));
    }
    let rows = weight_shard.size()[0];
    let outside = ids
        .f_lt(vocab_start)?
        .f_logical_or(&ids.f_ge(vocab_start + rows)?)?;
    let local = ids.f_sub_scalar(vocab_start)?.f_masked_fill(&outside, 0)?;
    let looked_up = Tensor::f_embedding(weight_shard, &local, -1, false, false)?;
    let partial = looked_up.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
    Ok(reduce_from_parallel(&partial, group)?)
}

fn sum_over(group: &TpGroup, t: &Tensor, op: ReduceOp) -> std::result::Result<(), AutogradError> {
    if group.size() > 1 {
        group.all_reduce(t, op)?;
    }
    Ok(())
}

/// What the forward of [`vocab_parallel_cross_entropy`] leaves for backward, as PyTorch's
/// `loss_parallel` keeps it: this rank's columns of the log-softmax, and the negated one-hot
/// of the target on them (`grad_input`: -1 at the target's column on the rank that holds it,
/// 0 elsewhere).
struct CrossEntropySaved {
    log_softmax: Tensor,
    grad_input: Tensor,
}

/// The forward of [`vocab_parallel_cross_entropy`]: the loss and what backward needs.
fn cross_entropy_forward(
    logits: &Tensor,
    target: &Tensor,
    vocab_start: i64,
    group: &TpGroup,
    reduction: Reduction,
) -> std::result::Result<(Tensor, CrossEntropySaved), AutogradError> {
    let local_vocab = logits.size()[1];
    // 1. The global max of every row, subtracted for a stable exponential.
    let max = logits.f_amax([1], false)?.f_contiguous()?;
    sum_over(group, &max, ReduceOp::Max)?;
    let shifted = logits.f_sub(&max.f_unsqueeze(1)?)?;
    // 2. The target's shifted logit, from the one rank whose columns hold it.
    let outside = target
        .f_lt(vocab_start)?
        .f_logical_or(&target.f_ge(vocab_start + local_vocab)?)?;
    let local_target = target
        .f_sub_scalar(vocab_start)?
        .f_masked_fill(&outside, 0)?
        .f_unsqueeze(1)?;
    let picked = shifted
        .f_gather(1, &local_target, false)?
        .f_squeeze_dim(1)?
        .f_masked_fill(&outside, 0.0)?
        .f_contiguous()?;
    sum_over(group, &picked, ReduceOp::Sum)?;
    // 3. The sum of exponentials over the full vocabulary.
    let exp = shifted.f_exp()?;
    let sum_exp = exp
        .f_sum_dim_intlist(1, false, exp.kind())?
        .f_contiguous()?;
    sum_over(group, &sum_exp, ReduceOp::Sum)?;
    let log_sum_exp = sum_exp.f_log()?;
    // `-(shifted - lse)` is `lse - shifted` exactly: the per-token loss PyTorch's nll_loss
    // takes from the log-softmax.
    let per_token = log_sum_exp.f_sub(&picked)?;
    let loss = match reduction {
        Reduction::Mean => per_token.f_mean(per_token.kind())?,
        Reduction::Sum => per_token.f_sum(per_token.kind())?,
    };
    // PyTorch's `_log_softmax`: `shifted - log(sum_exp)` on this rank's columns.
    let log_softmax = shifted.f_sub(&log_sum_exp.f_unsqueeze(1)?)?;
    // `grad_input[arange, masked_target] = mask - 1.0` (`_nll_loss_and_log_softmax_backward`).
    let update = outside
        .f_to_kind(log_softmax.kind())?
        .f_sub_scalar(1.0)?
        .f_unsqueeze(1)?;
    let grad_input = log_softmax
        .f_zeros_like()?
        .f_scatter(1, &local_target, &update)?;
    Ok((
        loss,
        CrossEntropySaved {
            log_softmax,
            grad_input,
        },
    ))
}

/// Cross-entropy of logits split by vocabulary (`logits_shard`: `[N, V/t]`, columns
/// `vocab_start..vocab_start + V/t` of the full logits) against `target` (`[N]`, int64,
/// full-vocabulary ids): the loss parallel of Megatron, the full logits never assembled.
///
/// Forward all-reduces three `[N]` vectors: the max logit (for stability), the target's
/// logit (found on exactly one rank) and the sum of exponentials; the loss per token is
/// `log(sum exp) − target logit` (both shifted by the max). Backward is local and is
/// PyTorch's `loss_parallel` backward op for op: `(one_hot_neg + exp(log_softmax)) · g`,
/// `g` the incoming gradient (divided by `N` for [`Reduction::Mean`]) on this rank's
/// columns; it needs no communication.
pub fn vocab_parallel_cross_entropy(
    logits_shard: &Tensor,
    target: &Tensor,
    vocab_start: i64,
    group: &TpGroup,
    reduction: Reduction,
) -> Result<Tensor> {
    expect_dims(logits_shard, 2, "vocab-parallel logits shard")?;
    let n = logits_shard.size()[0];
    if target.size() != [n] || target.kind() != Kind::Int64 {
        return Err(TpLayerError::Shape(format!(
            "vocab-parallel cross-entropy target must be int64 of shape [{n}], got {:?} of \
             shape {:?}",
            target.kind(),
            target.size()
        )));
    }
    if !logits_shard.is_floating_point() {
        return Err(TpLayerError::Invalid(format!(
            "vocab-parallel cross-entropy logits must be floating point, got {:?}",
            logits_shard.kind()
        )));
    }
    let mut out = apply(
        &[logits_shard],
        |ctx, xs| {
            let (loss, saved) =
                cross_entropy_forward(xs[0], target, vocab_start, group, reduction)?;
            ctx.save_for_backward(&[&saved.log_softmax, &saved.grad_input]);
            Ok(vec![loss])
        },
        // Backward, beside its forward, in PyTorch's `loss_parallel` order: the incoming
        // gradient divided by the token count (mean), then `(grad_input + exp(log_softmax)) *
        // grad_output`. No communication.
        move |ctx, grads| {
            let _no_grad = tch::no_grad_guard();
            let [log_softmax, grad_input] = ctx.saved() else {
                return Err(AutogradError::msg(
                    "vocab-parallel cross-entropy: expected the log-softmax and the one-hot saved",
                ));
            };
            let incoming = match grads.into_iter().next().flatten() {
                Some(g) => g,
                None => return Ok(vec![None]),
            };
            let grad_output = match reduction {
                Reduction::Mean => {
                    // `total_weight = (target != ignore_index).sum().to(x)`: every token here.
                    let total_weight =
                        Tensor::f_scalar_tensor(n as f64, (incoming.kind(), incoming.device()))?;
                    incoming.f_div(&total_weight)?
                }
                Reduction::Sum => incoming,
            };
            let grad = grad_input
                .f_add(&log_softmax.f_exp()?)?
                .f_mul(&grad_output)?;
            Ok(vec![Some(grad)])
        },
    )?;
    out.pop().ok_or_else(|| {
        TpLayerError::Invalid("vocab-parallel cross-entropy returned no output".into())
    })
}

/// This rank's chunk of `t` along `dim` (chunk `rank` of `world` equal chunks), as a fresh
/// contiguous leaf that owns its memory (requiring grad when `t` is floating point): what a
/// rank trains when a full parameter is split for tensor parallelism.
pub fn shard(t: &Tensor, dim: i64, rank: usize, world: usize) -> Result<Tensor> {
    if rank >= world {
        return Err(TpLayerError::Invalid(format!(
            "shard: rank {rank} is outside a tensor-parallel group of size {world}"
        )));
    }
    let len = chunk(t, dim, world, "shard")?;
    let d = normalize_dim(t, dim, "shard")?;
    let _no_grad = tch::no_grad_guard();
    let part = t.f_detach()?.f_narrow(d, rank as i64 * len, len)?;
    let mut out = Tensor::f_empty(part.size(), (part.kind(), part.device()))?;
    out.f_copy_(&part)?;
    Ok(if out.is_floating_point() {
        out.set_requires_grad(true)
    } else {
        out
    })
}

/// The full tensor whose chunks along `dim` are the group's shards, in rank order (no
/// autograd): for recording full parameters and gradients of a tensor-parallel run.
pub fn unshard(shard: &Tensor, dim: i64, group: &dyn ProcessGroup) -> Result<Tensor> {
    let d = normalize_dim(shard, dim, "unshard")?;
    let _no_grad = tch::no_grad_guard();
    // Gather along dim 0 of the tensor with `d` moved first, then move it back: rank r's
    // chunk lands at offsets r·len .. (r+1)·len of dimension `d`.
    let input = shard.f_detach()?.f_transpose(0, d)?.f_contiguous()?;
    let mut shape = input.size();
    shape[0] *= group.size() as i64;
    let gathered = Tensor::f_empty(&shape, (input.kind(), input.device()))?;
    group.all_gather(&gathered, &input)?;
    Ok(gathered.f_transpose(0, d)?.f_contiguous()?)
}

/// Checks that `t`'s dimension `dim` divides by the TP size, naming both if not: for callers
/// validating shapes before any rank communicates.
pub fn check_divisible(t: &Tensor, dim: i64, tp: usize, what: &str) -> Result<i64> {
    chunk(t, dim, tp, what)
}
