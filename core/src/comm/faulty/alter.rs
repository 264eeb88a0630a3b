//! The faults' arithmetic: the value each [`FaultKind`] makes of a call's result (doubled,
//! zeroed, perturbed, rounded through bf16, chunks rotated or swapped, an earlier result in
//! its place), and the bit-for-bit comparison that says whether it changed anything.
//!
//! Apart from the wrapper ([`super::group`]) because these are tensor functions only; they
//! know nothing of groups or of when a call completes.

use super::kind::FaultKind;
use super::record::CallRecord;
use super::FaultInjector;
use crate::comm::{CommError, OpKind};
use tch::{Kind, Tensor};

/// A fault's result: the tensor that replaces the call's, and what changed.
pub(super) struct Altered {
    pub(super) value: Tensor,
    pub(super) detail: String,
}

/// The value `kind` makes of `current` (the call's completed result; for a send, its
/// payload). `saved` is the target's content before the call.
pub(super) fn alter(
    injector: &FaultInjector,
    kind: FaultKind,
    call: &CallRecord,
    current: &Tensor,
    saved: Option<&Tensor>,
    splits: &[usize],
) -> Result<Altered, CommError> {
    let current = current.f_detach()?;
    let n = call.group_size as i64;
    let missing = |what: &str| CommError::Failed(format!("fault {kind}: {what} was not kept"));
    let (value, detail) = match kind {
        FaultKind::Skip => (
            saved
                .ok_or_else(|| missing("the tensor before the call"))?
                .f_detach_copy()?,
            "the call's result dropped".to_owned(),
        ),
        FaultKind::Double => (current.f_mul_scalar(2)?, "the result doubled".to_owned()),
        FaultKind::Zero => (current.f_zeros_like()?, "the result zeroed".to_owned()),
        FaultKind::Bf16Reduction => (
            current
                .f_to_kind(Kind::BFloat16)?
                .f_to_kind(current.kind())?,
            "the result rounded through bf16".to_owned(),
        ),
        FaultKind::Perturb(eps) => perturbed(&current, eps)?,
        FaultKind::Stale => held(injector, kind, call)?,
        FaultKind::WrongPeer if call.op == OpKind::Recv => held(injector, kind, call)?,
        FaultKind::WrongPeer if call.op == OpKind::Broadcast => (
            saved
                .ok_or_else(|| missing("this rank's own tensor"))?
                .f_detach_copy()?,
            "root + 1's tensor (this rank's own) kept".to_owned(),
        ),
        FaultKind::WrongPeer => (
            reorder(&current, n, splits, |i| (i + 1) % n as usize)?,
            "chunks rotated by one rank".to_owned(),
        ),
        FaultKind::PermutedChunks => (
            reorder(&current, n, splits, |i| match i {
                0 => 1,
                1 => 0,
                i => i,
            })?,
            "the first two chunks swapped".to_owned(),
        ),
    };
    Ok(Altered { value, detail })
}

/// The kept result that stands in for `call`'s under `kind` (stale, or another peer's).
fn held(
    injector: &FaultInjector,
    kind: FaultKind,
    call: &CallRecord,
) -> Result<(Tensor, String), CommError> {
    let (source, value) = injector.held_for(kind, call).ok_or_else(|| {
        CommError::Failed(format!(
            "fault {kind}: no earlier result of this shape was kept"
        ))
    })?;
    let detail = format!(
        "the result of step {} call {} ({}) instead",
        source.step,
        source.index,
        source.describe()
    );
    Ok((value, detail))
}

/// `current` with its largest-magnitude element multiplied by `1 + eps`.
fn perturbed(current: &Tensor, eps: f64) -> Result<(Tensor, String), CommError> {
    let flat = current.f_reshape([-1])?.f_detach_copy()?;
    let at = flat.f_abs()?.f_argmax(None, false)?.f_int64_value(&[])?;
    let before = flat.f_double_value(&[at])?;
    // Computed in f64 and rounded once into the tensor's dtype: an ε below half an ULP of
    // the element leaves it as it was (reported as no change).
    let _ = flat.f_narrow(0, at, 1)?.f_fill_(before * (1.0 + eps))?;
    let after = flat.f_double_value(&[at])?;
    Ok((
        flat.f_reshape(current.size())?,
        format!("element {at} multiplied by 1 + {eps:e}: {before:e} -> {after:e}"),
    ))
}

/// `current`'s chunks (rows of dim 0 by `splits`, or `n` equal parts of its elements when no
/// splits are given) reassembled with chunk `order(i)` at position `i`.
fn reorder(
    current: &Tensor,
    n: i64,
    splits: &[usize],
    order: impl Fn(usize) -> usize,
) -> Result<Tensor, CommError> {
    let (source, lengths) = if splits.is_empty() {
        let flat = current.f_reshape([-1])?;
        let len = flat.size()[0] / n.max(1);
        (flat, vec![len; n as usize])
    } else {
        let rows: Vec<i64> = splits.iter().map(|&s| s as i64).collect();
        (current.shallow_clone(), rows)
    };
    let starts: Vec<i64> = lengths
        .iter()
        .scan(0, |at, &l| {
            let s = *at;
            *at += l;
            Some(s)
        })
        .collect();
    let chunks: Vec<Tensor> = (0..lengths.len())
        .map(|i| {
            let j = order(i).min(lengths.len() - 1);
            source.f_narrow(0, starts[j], lengths[j])
        })
        .collect::<Result<_, _>>()?;
    Ok(Tensor::f_cat(&chunks, 0)?.f_reshape(current.size())?)
}

/// `input` with its first two of `n` equal chunks (of its elements) exchanged.
pub(super) fn swap_first_chunks(input: &Tensor, n: i64) -> Result<Tensor, CommError> {
    reorder(&input.f_detach()?, n, &[], |i| match i {
        0 => 1,
        1 => 0,
        i => i,
    })
}

/// Whether two tensors hold the same bits (shape, dtype and every byte).
pub(super) fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool, CommError> {
    if a.size() != b.size() || a.kind() != b.kind() {
        return Ok(false);
    }
    let bytes = |t: &Tensor| -> Result<Vec<u8>, CommError> {
        let host = t
            .f_detach()?
            .f_to_device(tch::Device::Cpu)?
            .f_contiguous()?;
        let numel = host.numel();
        let mut out = vec![0u8; numel * host.kind().elt_size_in_bytes()];
        host.f_copy_data_u8(&mut out, numel)?;
        Ok(out)
    };
    Ok(bytes(a)? == bytes(b)?)
}
