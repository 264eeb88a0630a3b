//! DDP's gradient buckets: packing gradients in backward order into flat buffers of one
//! reduction dtype, launching each bucket's all-reduce in index order, and unpacking the
//! averages back into the `.grad`s.

use super::options::*;
use crate::comm::{ProcessGroup, ReduceOp, Work};
use std::sync::Arc;
use tch::{Kind, Tensor};

pub(super) struct Bucket {
    /// Indices into `State::params`.
    pub(super) members: Vec<usize>,
    pub(super) entries: Vec<(String, usize, usize)>,
    /// What the bucket carries, named in a collective mismatch ([`bucket_label`]).
    pub(super) label: String,
    pub(super) flat: Tensor,
    pub(super) ready: usize,
    pub(super) work: Option<Work>,
}

/// What the backward hooks and the step share.
pub(super) struct State {
    pub(super) params: Vec<(String, Tensor)>,
    /// Bucket of each parameter (`None`: not reduced).
    pub(super) bucket_of: Vec<Option<usize>>,
    pub(super) buckets: Vec<Bucket>,
    pub(super) next_launch: usize,
    pub(super) op: ReduceOp,
    pub(super) group: Arc<dyn ProcessGroup>,
    /// The group each bucket's (first) all-reduce runs over: `group`, or the shard group of
    /// a hierarchical reduction.
    pub(super) bucket_group: Arc<dyn ProcessGroup>,
    /// Hierarchical reduction: the group each bucket is averaged over after the first.
    pub(super) replicate: Option<Arc<dyn ProcessGroup>>,
}

impl State {
    pub(super) fn pack(&mut self, b: usize) -> Result<(), DdpError> {
        let _guard = tch::no_grad_guard();
        let bucket = &mut self.buckets[b];
        for (&i, (name, offset, numel)) in bucket.members.iter().zip(&bucket.entries) {
            let grad = self.params[i].1.grad();
            if !grad.defined() {
                return Err(DdpError::Invalid(format!(
                    "parameter `{name}` has no gradient"
                )));
            }
            bucket
                .flat
                .narrow(0, *offset as i64, *numel as i64)
                .f_copy_(&grad.f_reshape([-1])?)?;
        }
        Ok(())
    }

    /// Launches every complete bucket whose predecessors are launched.
    pub(super) fn launch_ready(&mut self) -> Result<(), DdpError> {
        while self.next_launch < self.buckets.len() {
            let b = self.next_launch;
            if self.buckets[b].ready < self.buckets[b].members.len() {
                break;
            }
            self.pack(b)?;
            let label = &self.buckets[b].label;
            let work = crate::comm::labelled(label, || {
                self.bucket_group
                    .all_reduce_async(&self.buckets[b].flat, self.op)
            })?;
            self.buckets[b].work = Some(work);
            self.next_launch += 1;
        }
        Ok(())
    }

    pub(super) fn param_ready(&mut self, i: usize) -> Result<(), DdpError> {
        if let Some(b) = self.bucket_of[i] {
            self.buckets[b].ready += 1;
            self.launch_ready()?;
        }
        Ok(())
    }
}

/// What DDP's bucket `b` carries, for a collective mismatch: its gradients by name (the first
/// few, then how many more).
pub(super) fn bucket_label(b: usize, entries: &[(String, usize, usize)]) -> String {
    const SHOWN: usize = 3;
    let names: Vec<String> = entries
        .iter()
        .take(SHOWN)
        .map(|(n, _, _)| format!("`{n}`"))
        .collect();
    let more = entries.len().saturating_sub(SHOWN);
    let tail = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!("DDP gradient bucket {b}: {}{tail}", names.join(", "))
}

/// Packs parameters, last first, into buckets of one reduction dtype (`reduce_kind` of each
/// parameter index) and at most `cap` bytes of it (a single larger parameter gets a bucket
/// of its own).
pub(super) fn plan_buckets(
    params: &[(String, Tensor)],
    excluded: &dyn Fn(&str) -> bool,
    reduce_kind: &dyn Fn(usize) -> Kind,
    cap: usize,
) -> Result<Vec<Bucket>, DdpError> {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut bytes = 0;
    let mut kind = None;
    let close = |members: &mut Vec<usize>, buckets: &mut Vec<Bucket>| -> Result<(), DdpError> {
        if members.is_empty() {
            return Ok(());
        }
        let mut entries = Vec::new();
        let mut offset = 0;
        for &i in members.iter() {
            let numel = params[i].1.numel();
            entries.push((params[i].0.clone(), offset, numel));
            offset += numel;
        }
        let k = reduce_kind(members[0]);
        buckets.push(Bucket {
            members: std::mem::take(members),
            label: bucket_label(buckets.len(), &entries),
            entries,
            flat: Tensor::f_zeros([offset as i64], (k, params[0].1.device()))?,
            ready: 0,
            work: None,
        });
        Ok(())
    };
    for i in (0..params.len()).rev() {
        let (name, p) = &params[i];
        if excluded(name) {
            continue;
        }
        let k = reduce_kind(i);
        let size = p.numel() * k.elt_size_in_bytes();
        if !current.is_empty() && (kind != Some(k) || bytes + size > cap) {
            close(&mut current, &mut buckets)?;
            bytes = 0;
        }
        kind = Some(k);
        bytes += size;
        current.push(i);
    }
    close(&mut current, &mut buckets)?;
    Ok(buckets)
}
