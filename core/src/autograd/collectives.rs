//! Differentiable collectives: Megatron's tensor- and sequence-parallel mappings, plus the
//! expert-parallel all-to-all, on any [`ProcessGroup`].
//!
//! | function | forward | backward |
//! | --- | --- | --- |
//! | [`copy_to_parallel`] | identity | all-reduce (sum) |
//! | [`reduce_from_parallel`] | all-reduce (sum) | identity |
//! | [`scatter_to_parallel`] | keep own chunk of the last dim | all-gather on the last dim |
//! | [`gather_from_parallel`] | all-gather on the last dim | keep own chunk |
//! | [`scatter_to_sequence_parallel`] | keep own chunk of dim 0 | all-gather on dim 0 |
//! | [`all_gather_sequence`] | all-gather on dim 0 | reduce-scatter on dim 0 |
//! | [`reduce_scatter_sequence`] | reduce-scatter on dim 0 | all-gather on dim 0 |
//! | [`all_to_all`] | all-to-all, uneven splits | the reverse all-to-all |
//!
//! Every rank of the group must call the same functions in the same order (their backward
//! passes run collectives too). Chunks are equal: a split dimension must divide by the group
//! size. Backward passes are first-order (not themselves differentiable). Tensors are staged
//! as contiguous copies, so inputs are never modified.

use super::function::apply;
use super::AutogradError;
use crate::comm::{ProcessGroup, ReduceOp};
use std::sync::Arc;
use tch::Tensor;

type Group = Arc<dyn ProcessGroup>;

/// A contiguous copy of `t` (collectives work in place; the input must stay untouched).
fn fresh_copy(t: &Tensor) -> Result<Tensor, AutogradError> {
    let mut out = Tensor::f_empty(t.size(), (t.kind(), t.device()))?;
    out.f_copy_(t)?;
    Ok(out)
}

fn contiguous(t: &Tensor) -> Result<Tensor, AutogradError> {
    Ok(t.f_contiguous()?)
}

fn sum_all(group: &Group, t: &Tensor) -> Result<Tensor, AutogradError> {
    let out = fresh_copy(t)?;
    if group.size() > 1 {
        group.all_reduce(&out, ReduceOp::Sum)?;
    }
    Ok(out)
}

fn gather_dim0(group: &Group, t: &Tensor) -> Result<Tensor, AutogradError> {
    let input = contiguous(t)?;
    let mut shape = input.size();
    if shape.is_empty() {
        return Err(AutogradError::Invalid(
            "cannot gather a 0-dim tensor".into(),
        ));
    }
    shape[0] *= group.size() as i64;
    let out = Tensor::f_empty(&shape, (t.kind(), t.device()))?;
    group.all_gather(&out, &input)?;
    Ok(out)
}

fn chunk_len(t: &Tensor, dim: i64, world: usize) -> Result<i64, AutogradError> {
    let size = t.size();
    if size.is_empty() {
        return Err(AutogradError::Invalid("cannot split a 0-dim tensor".into()));
    }
    let d = if dim < 0 {
        size.len() as i64 + dim
    } else {
        dim
    } as usize;
    let n = size[d];
    if n % world as i64 != 0 {
        return Err(AutogradError::Invalid(format!(
            "dimension {dim} of size {n} does not divide by the group size {world}"
        )));
    }
    Ok(n / world as i64)
}

fn split_own(group: &Group, t: &Tensor, dim: i64) -> Result<Tensor, AutogradError> {
    let len = chunk_len(t, dim, group.size())?;
    let own = t.f_narrow(dim, group.rank() as i64 * len, len)?;
    fresh_copy(&own)
}

fn gather_last(group: &Group, t: &Tensor) -> Result<Tensor, AutogradError> {
    if t.dim() == 0 {
        return Err(AutogradError::Invalid(
            "cannot gather a 0-dim tensor".into(),
        ));
    }
    // Gather on dim 0 of the transposed tensor, then transpose back: rank r's block lands at
    // last-dim offsets r*d .. (r+1)*d.
    let last = t.dim() as i64 - 1;
    let transposed = t.f_transpose(0, last)?;
    let gathered = gather_dim0(group, &transposed)?;
    contiguous(&gathered.f_transpose(0, last)?)
}

fn reduce_scatter_dim0(group: &Group, t: &Tensor) -> Result<Tensor, AutogradError> {
    let len = chunk_len(t, 0, group.size())?;
    let input = contiguous(t)?;
    let mut shape = input.size();
    shape[0] = len;
    let out = Tensor::f_empty(&shape, (t.kind(), t.device()))?;
    group.reduce_scatter(&out, &input, ReduceOp::Sum)?;
    Ok(out)
}

fn exchange(
    group: &Group,
    t: &Tensor,
    send: &[usize],
    recv: &[usize],
) -> Result<Tensor, AutogradError> {
    let world = group.size();
    if send.len() != world || recv.len() != world {
        return Err(AutogradError::Invalid(format!(
            "all_to_all needs {world} input and output splits, got {} and {}",
            send.len(),
            recv.len()
        )));
    }
    let input = contiguous(t)?;
    let mut shape = input.size();
    if shape.is_empty() || shape[0] != send.iter().sum::<usize>() as i64 {
        return Err(AutogradError::Invalid(format!(
            "all_to_all input has {:?} rows, splits sum to {}",
            shape.first(),
            send.iter().sum::<usize>()
        )));
    }
    shape[0] = recv.iter().sum::<usize>() as i64;
    let out = Tensor::f_empty(&shape, (t.kind(), t.device()))?;
    group.all_to_all(&out, &input, recv, send)?;
    Ok(out)
}

/// Applies a one-input, one-output function whose forward and backward are non-differentiable
/// tensor maps. Absent gradients stay absent (nothing is communicated for them).
fn unary<F, B>(x: &Tensor, forward: F, backward: B) -> Result<Tensor, AutogradError>
where
    F: FnOnce(&Tensor) -> Result<Tensor, AutogradError>,
    B: FnOnce(&Tensor) -> Result<Tensor, AutogradError> + Send + 'static,
{
    let mut out = apply(
        &[x],
        |ctx, xs| {
            ctx.set_materialize_grads(false);
            Ok(vec![forward(xs[0])?])
        },
        move |_ctx, grads| {
            let _no_grad = tch::no_grad_guard();
            match grads.into_iter().next().flatten() {
                Some(g) => Ok(vec![Some(backward(&g)?)]),
                None => Ok(vec![None]),
            }
        },
    )?;
    out.pop()
        .ok_or_else(|| AutogradError::Torch("custom function returned no output".into()))
}

/// Enters a tensor-parallel region with a replicated input (Megatron's `f`): identity
/// forward; backward sums the gradients every rank computed for its shard of the work.
pub fn copy_to_parallel(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(x, |x| Ok(x.shallow_clone()), move |grad| sum_all(&g, grad))
}

/// Leaves a tensor-parallel region by summing partial results (Megatron's `g`, after a
/// row-parallel linear); the gradient of a replicated output passes through unchanged.
pub fn reduce_from_parallel(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    unary(x, |x| sum_all(group, x), fresh_copy)
}

/// Keeps this rank's chunk of the last dimension of a replicated input; backward all-gathers
/// the chunks' gradients back into the full last dimension.
pub fn scatter_to_parallel(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(
        x,
        |x| split_own(group, x, -1),
        move |grad| gather_last(&g, grad),
    )
}

/// Concatenates every rank's chunk along the last dimension (after a column-parallel linear
/// with `gather_output`); backward keeps this rank's chunk of the gradient.
pub fn gather_from_parallel(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(
        x,
        |x| gather_last(group, x),
        move |grad| split_own(&g, grad, -1),
    )
}

/// Keeps this rank's chunk of dim 0 (the sequence) of a replicated input; backward
/// all-gathers the gradient along dim 0.
pub fn scatter_to_sequence_parallel(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(
        x,
        |x| split_own(group, x, 0),
        move |grad| gather_dim0(&g, grad),
    )
}

/// Gathers the sequence (dim 0) from every rank before a tensor-parallel block; backward
/// reduce-scatters, since each rank's block contributes a partial gradient for every position.
pub fn all_gather_sequence(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(
        x,
        |x| gather_dim0(group, x),
        move |grad| reduce_scatter_dim0(&g, grad),
    )
}

/// Sums partial results and keeps this rank's chunk of the sequence (dim 0) after a
/// tensor-parallel block; backward all-gathers the gradient along dim 0.
pub fn reduce_scatter_sequence(x: &Tensor, group: &Group) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    unary(
        x,
        |x| reduce_scatter_dim0(group, x),
        move |grad| gather_dim0(&g, grad),
    )
}

/// Sends `input_splits[j]` rows (dim 0) of `x` to rank `j` and receives `output_splits[j]`
/// rows from rank `j` (expert dispatch and combine); backward sends the gradients back the way
/// they came. Splits may be uneven or zero.
pub fn all_to_all(
    x: &Tensor,
    group: &Group,
    output_splits: &[usize],
    input_splits: &[usize],
) -> Result<Tensor, AutogradError> {
    let g = group.clone();
    let (send, recv) = (input_splits.to_vec(), output_splits.to_vec());
    unary(
        x,
        |x| exchange(group, x, input_splits, output_splits),
        move |grad| exchange(&g, grad, &recv, &send),
    )
}
