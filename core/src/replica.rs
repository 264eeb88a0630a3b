//! What every data-parallel wrapper (DDP, FSDP) does to a model replica before training:
//! treat tied parameters as the one tensor they are, and start every rank from rank 0's state.

use crate::comm::{CommError, ProcessGroup};
use std::collections::HashSet;
use tch::Tensor;

/// One entry per distinct tensor, first name wins: a tied weight listed under two names is
/// one tensor with one gradient, and must be reduced, sharded and stepped once.
pub fn distinct_parameters(params: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut seen = HashSet::new();
    params
        .into_iter()
        .filter(|(_, t)| seen.insert(t.data_ptr() as usize))
        .collect()
}

/// Copies rank 0's values into every rank's tensors, without recording autograd history.
pub fn broadcast_from_rank0<'a>(
    group: &dyn ProcessGroup,
    tensors: impl IntoIterator<Item = &'a Tensor>,
) -> Result<(), CommError> {
    let _guard = tch::no_grad_guard();
    for t in tensors {
        group.broadcast(t, 0)?;
    }
    Ok(())
}
