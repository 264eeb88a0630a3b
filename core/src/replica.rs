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

/// [`broadcast_from_rank0`] of named tensors: a rank that reaches a broadcast with another
/// shape or dtype fails naming the tensor (the collective carries its name as its label).
pub fn broadcast_named_from_rank0<'a>(
    group: &dyn ProcessGroup,
    tensors: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
) -> Result<(), CommError> {
    let _guard = tch::no_grad_guard();
    for (name, t) in tensors {
        crate::comm::labelled(&format!("rank 0's `{name}`"), || group.broadcast(t, 0))?;
    }
    Ok(())
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

/// Why ranks cannot start training together.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    /// Ranks built models whose tensors differ by name, shape or dtype: every collective
    /// after this would pair different tensors (or hang), so nothing trains.
    #[error(
        "rank {rank} built a different model than rank 0 (every rank must build the same \
         parameter and buffer names, shapes and dtypes): {difference}"
    )]
    Mismatch {
        /// The lowest rank that differs from rank 0.
        rank: usize,
        /// The first tensor that differs, named, with both ranks' shapes and dtypes.
        difference: String,
    },
    /// Exchanging the models' descriptions failed.
    #[error("comparing the ranks' models: {0}")]
    Comm(#[from] CommError),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// One line per parameter, then per buffer: kind, name, dtype, shape.
fn describe_tensors(params: &[(String, Tensor)], buffers: &[(String, Tensor)]) -> String {
    let mut out = String::new();
    for (kind, list) in [("parameter", params), ("buffer", buffers)] {
        for (name, t) in list {
            // The wire's spelling (`f32[24, 8]`), as collective mismatches print it.
            let dtype = crate::comm::DType::from_kind(t.kind())
                .map_or_else(|_| format!("{:?}", t.kind()), |d| d.to_string());
            out.push_str(&format!("{kind}\t{name}\t{dtype}{:?}\n", t.size()));
        }
    }
    out
}

/// The first line where `theirs` (rank `rank`'s description) and `ours` (rank 0's) differ,
/// as a sentence naming the tensor.
fn first_difference(rank: usize, theirs: &str, ours: &str) -> String {
    let split = |l: &str| -> (String, String, String) {
        let mut parts = l.splitn(3, '\t');
        let kind = parts.next().unwrap_or_default().to_owned();
        let name = parts.next().unwrap_or_default().to_owned();
        let what = parts.next().unwrap_or_default().to_owned();
        (kind, name, what)
    };
    let (a, b): (Vec<&str>, Vec<&str>) = (theirs.lines().collect(), ours.lines().collect());
    for i in 0..a.len().max(b.len()) {
        match (a.get(i).map(|l| split(l)), b.get(i).map(|l| split(l))) {
            (Some(x), Some(y)) if x == y => continue,
            (Some((kind, name, what)), Some((k0, n0, w0))) if name == n0 && kind == k0 => {
                return format!("{kind} `{name}` is {what} on rank {rank} but {w0} on rank 0");
            }
            (Some((kind, name, what)), Some((k0, n0, w0))) => {
                return format!(
                    "{kind} #{i} is `{name}` ({what}) on rank {rank} but `{n0}` ({w0}, a \
                     {k0}) on rank 0"
                );
            }
            (Some((kind, name, what)), None) => {
                return format!("rank {rank} has {kind} `{name}` ({what}) that rank 0 does not");
            }
            (None, Some((kind, name, what))) => {
                return format!("rank {rank} lacks {kind} `{name}` ({what}) that rank 0 has");
            }
            (None, None) => break,
        }
    }
    "the descriptions differ".into()
}

/// Checks, before any wrapper's collective, that every rank of `group` holds tensors of the
/// same names, shapes and dtypes (`params`, then `buffers`), so that a model built
/// differently on some rank fails here, naming the tensor, rather than later as a
/// mismatched collective. Every rank returns the same verdict.
///
/// Costs one all-gather of two integers, plus two broadcasts of the descriptions when they
/// differ. Tensors are created on `device`, where the group's backend takes them.
pub fn check_same_tensors(
    group: &dyn ProcessGroup,
    params: &[(String, Tensor)],
    buffers: &[(String, Tensor)],
    device: tch::Device,
) -> Result<(), ReplicaError> {
    use std::hash::{Hash, Hasher};
    let size = group.size();
    if size < 2 {
        return Ok(());
    }
    let mine = describe_tensors(params, buffers);
    let mut hasher = std::hash::DefaultHasher::new();
    mine.hash(&mut hasher);
    let summary = [mine.len() as i64, hasher.finish() as i64];
    let local = Tensor::f_from_slice(&summary)?.f_to_device(device)?;
    let all = Tensor::f_zeros([2 * size as i64], (tch::Kind::Int64, device))?;
    group.all_gather(&all, &local)?;
    let all: Vec<i64> = Vec::try_from(&all.f_to_device(tch::Device::Cpu)?)?;
    let Some(rank) = (1..size).find(|&r| all[2 * r..2 * r + 2] != all[0..2]) else {
        return Ok(());
    };
    // Every rank fetches rank 0's and the first differing rank's descriptions, so every rank
    // names the same tensor.
    let fetch = |root: usize| -> Result<String, ReplicaError> {
        let len = all[2 * root];
        let bytes = match group.rank() == root {
            true => Tensor::f_from_slice(mine.as_bytes())?.f_to_device(device)?,
            false => Tensor::f_zeros([len], (tch::Kind::Uint8, device))?,
        };
        group.broadcast(&bytes, root)?;
        let bytes: Vec<u8> = Vec::try_from(&bytes.f_to_device(tch::Device::Cpu)?)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    let ours = fetch(0)?;
    let theirs = fetch(rank)?;
    Err(ReplicaError::Mismatch {
        rank,
        difference: first_difference(rank, &theirs, &ours),
    })
}

#[cfg(test)]
mod tests {
    use super::first_difference;

    #[test]
    fn the_first_difference_names_the_tensor() {
        let ours = "parameter\ta.weight\tf32[4, 2]\nparameter\ta.bias\tf32[4]\n";
        let shape = "parameter\ta.weight\tf32[3, 2]\nparameter\ta.bias\tf32[4]\n";
        assert_eq!(
            first_difference(1, shape, ours),
            "parameter `a.weight` is f32[3, 2] on rank 1 but f32[4, 2] on rank 0"
        );
        let extra = format!("{ours}buffer\tbn.mean\tf32[4]\n");
        assert_eq!(
            first_difference(2, &extra, ours),
            "rank 2 has buffer `bn.mean` (f32[4]) that rank 0 does not"
        );
        assert_eq!(
            first_difference(1, "parameter\ta.weight\tf32[4, 2]\n", ours),
            "rank 1 lacks parameter `a.bias` (f32[4]) that rank 0 has"
        );
        let renamed = "parameter\ta.w\tf32[4, 2]\nparameter\ta.bias\tf32[4]\n";
        assert!(first_difference(1, renamed, ours).contains("`a.w`"));
    }
}
