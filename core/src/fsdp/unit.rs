//! One FSDP unit: the parameters it owns, flattened into one padded flat parameter of which
//! this rank keeps one shard, and where that unit stands in the gather / free cycle.

use super::FsdpError;
use crate::comm::Work;
use tch::{Kind, Tensor};

/// One managed parameter's place in its unit's flat parameter.
pub(super) struct Slot {
    pub name: String,
    /// The model's own tensor (the "view" the flat parameter is copied into).
    pub param: Tensor,
    pub offset: i64,
    pub numel: i64,
}

/// An all-gather of a unit's flat parameter in flight (prefetch), with the buffers it
/// reads and writes kept alive until it completes.
pub(super) struct PendingGather {
    pub work: Work,
    pub full: Tensor,
    pub _local: Tensor,
}

/// A gradient reduction in flight, with its buffers.
pub(super) struct PendingReduce {
    pub work: Work,
    /// This rank's reduced gradient shard once `work` completes (the whole flat gradient for
    /// `NoShard`).
    pub shard: Tensor,
    pub _flat: Tensor,
}

/// Where a unit's full parameters are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Residency {
    /// Freed: only the shard holds values.
    Sharded,
    /// An all-gather is in flight (prefetched); the parameters are not usable yet.
    Gathering,
    /// The model's parameters hold the full current values.
    Unsharded,
}

/// One FSDP unit: one flat parameter, sharded over the group.
pub(super) struct Unit {
    /// `root`, or the wrapped layer(s) it covers.
    pub name: String,
    /// Indices into `Model::layers()` of the layers it wraps (empty for the root).
    pub layers: Vec<usize>,
    pub slots: Vec<Slot>,
    /// The master (shard) dtype.
    pub kind: Kind,
    /// The dtype parameters are gathered in for forward and backward.
    pub compute_kind: Kind,
    /// The dtype gradients are reduced in.
    pub reduce_kind: Kind,
    /// Elements after padding (a multiple of the sharding world size).
    pub padded: i64,
    /// This rank's master copy of its part of the flat parameter.
    pub shard: Tensor,
    pub residency: Residency,
    pub pending_gather: Option<PendingGather>,
    /// Bytes of full parameters this unit holds while gathered (or gathering).
    pub alive_bytes: usize,
    /// Parameters whose gradient is complete in the current backward.
    pub ready: usize,
    /// The gradient reduction launched this step (post-backward), not yet finished.
    pub pending_reduce: Option<PendingReduce>,
    /// Whether this step's gradient reduction was launched.
    pub reduced: bool,
}

impl Unit {
    /// The unit's parameters (chosen by `pick`) flattened, concatenated and zero-padded.
    pub fn flatten(
        &self,
        pick: impl Fn(&Slot) -> Result<Tensor, FsdpError>,
    ) -> Result<Tensor, FsdpError> {
        let mut parts = Vec::with_capacity(self.slots.len() + 1);
        let mut numel = 0;
        for slot in &self.slots {
            numel += slot.numel;
            parts.push(pick(slot)?.f_reshape([-1])?);
        }
        if self.padded > numel {
            // The padding takes the last part's dtype and device (the flat tensor is one
            // tensor there); a unit with nothing to pad after has nothing to say where.
            let last = parts.last().ok_or_else(|| {
                FsdpError::Invalid("a unit without tensors has nothing to flatten".into())
            })?;
            let padding = Tensor::f_zeros([self.padded - numel], (last.kind(), last.device()))?;
            parts.push(padding);
        }
        Ok(Tensor::f_cat(&parts, 0)?)
    }

    /// Elements before padding.
    pub fn numel(&self) -> i64 {
        self.slots.iter().map(|s| s.numel).sum()
    }

    /// Bytes of the full parameters in `kind`.
    pub fn full_bytes(&self, kind: Kind) -> usize {
        self.numel() as usize * kind.elt_size_in_bytes()
    }

    /// Whether this is the root unit (it wraps no layer of its own).
    pub fn is_root(&self) -> bool {
        self.layers.is_empty()
    }
}
