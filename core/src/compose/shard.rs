//! A set of parameters sharded over a data-parallel group as one flat buffer: the FSDP
//! (ZeRO-3) data dimension of a composition, where another parallelism already decided what
//! each rank computes with.
//!
//! The FSDP engine in `fsdp/` wraps a whole plain model (units per layer, hooks on every
//! parameter, state dicts). A composition cannot hand it a plain model: under tensor
//! parallelism a rank computes with TP shards that no model owns, a pipeline stage with part
//! of the model, expert parallelism with its own experts. So compositions shard the tensors
//! they compute with through this smaller type, applied in torchtitan's order (the other
//! parallelism first, then FSDP over what it left on the rank). The math is FSDP's: the flat
//! buffer is zero-padded to a multiple of the group size, rank `r` keeps chunk `r` as its
//! master copy (the optimizer steps it), [`ShardedUnit::unshard`] all-gathers it into the
//! compute tensors, [`ShardedUnit::reduce_grads`] reduce-scatters their accumulated
//! gradients with `Avg` (on the CPU backend the same elements, bit for bit, as DDP's
//! all-reduce) and, under hybrid sharding, all-reduces the shard across replicas.
//! [`ShardedUnit::reshard`] frees the compute tensors' memory until the next unshard.

use crate::autograd::{free_storage, is_storage_freed, refill_storage, set_grad, AutogradError};
use crate::comm::{CommError, ProcessGroup, ReduceOp};
use std::sync::Arc;
use tch::{Kind, Tensor};

/// What sharding a unit can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Freeing or refilling storage, or setting a gradient, failed.
    #[error(transparent)]
    Autograd(#[from] AutogradError),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The parameters cannot form one flat buffer.
    #[error("sharding unit `{unit}`: {reason}")]
    Invalid {
        /// The unit's name.
        unit: String,
        /// What is wrong.
        reason: String,
    },
}

/// Parameters sharded over a data-parallel group as one flat buffer (see the module docs).
pub struct ShardedUnit {
    name: String,
    /// The tensors the model computes with (leaves requiring gradients), in order.
    params: Vec<(String, Tensor)>,
    numels: Vec<i64>,
    padded: i64,
    /// This rank's chunk of the flat buffer: the master copy the optimizer steps.
    shard: Tensor,
    group: Arc<dyn ProcessGroup>,
    replicate: Option<Arc<dyn ProcessGroup>>,
    gathered: bool,
}

impl ShardedUnit {
    /// Shards `params` (fp32 leaves, the same shapes on every rank of `group`) over `group`,
    /// replicated across `replicate` under hybrid sharding. The unit starts sharded: the
    /// compute tensors' memory is freed until [`ShardedUnit::unshard`], so every step gathers
    /// alike (and collective counts are the same each step). Every rank of `group` and
    /// `replicate` must build the unit with the same shapes.
    pub fn new(
        name: &str,
        params: Vec<(String, Tensor)>,
        group: Arc<dyn ProcessGroup>,
        replicate: Option<Arc<dyn ProcessGroup>>,
    ) -> Result<ShardedUnit, ShardError> {
        let invalid = |reason: String| ShardError::Invalid {
            unit: name.to_owned(),
            reason,
        };
        if let Some((n, t)) = params.iter().find(|(_, t)| t.kind() != Kind::Float) {
            return Err(invalid(format!(
                "`{n}` is {:?}; a flat buffer holds fp32 parameters only",
                t.kind()
            )));
        }
        let numels: Vec<i64> = params.iter().map(|(_, t)| t.numel() as i64).collect();
        let total: i64 = numels.iter().sum();
        let ranks = group.size() as i64;
        let padded = (total as u64).div_ceil(ranks as u64).max(1) as i64 * ranks;
        let shard = tch::no_grad(|| -> Result<Tensor, ShardError> {
            let flat = Tensor::f_zeros([padded], (Kind::Float, tch::Device::Cpu))?;
            let mut offset = 0;
            for ((_, t), n) in params.iter().zip(&numels) {
                flat.f_narrow(0, offset, *n)?
                    .f_copy_(&t.f_detach()?.f_reshape([-1])?)?;
                offset += n;
            }
            let len = padded / ranks;
            Ok(flat
                .f_narrow(0, group.rank() as i64 * len, len)?
                .f_contiguous()?
                .f_detach_copy()?
                .set_requires_grad(true))
        })?;
        let mut unit = ShardedUnit {
            name: name.to_owned(),
            params,
            numels,
            padded,
            shard,
            group,
            replicate,
            gathered: true,
        };
        unit.reshard()?;
        Ok(unit)
    }

    /// The unit's name, also the name the optimizer keys its shard's state by.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// This rank's master shard under the unit's name: what the optimizer steps.
    pub fn shard(&self) -> (String, Tensor) {
        (self.name.clone(), self.shard.shallow_clone())
    }

    /// Which copy of the content [`ShardedUnit::shard`] is, for the cross-rank check
    /// ([`crate::consistency`]): its shard index, the same on every replica of it.
    pub fn shard_coordinate(&self) -> String {
        if self.group.size() == 1 {
            String::new()
        } else {
            format!("shard{}/{}", self.group.rank(), self.group.size())
        }
    }

    /// Makes the compute tensors hold the current full values: one all-gather of the shards
    /// over the group (none if it is gathered already).
    pub fn unshard(&mut self) -> Result<(), ShardError> {
        if self.gathered {
            return Ok(());
        }
        let full = self.gather(&self.shard.f_detach()?)?;
        let _guard = tch::no_grad_guard();
        let mut offset = 0;
        for ((_, t), n) in self.params.iter().zip(&self.numels) {
            let part = full.f_narrow(0, offset, *n)?.f_view(t.size().as_slice())?;
            refill_storage(t, Some(&part))?;
            offset += n;
        }
        self.gathered = true;
        Ok(())
    }

    /// Frees the compute tensors' memory until the next [`ShardedUnit::unshard`]. Nothing may
    /// read them (forward, backward, a record) in between.
    pub fn reshard(&mut self) -> Result<(), ShardError> {
        for (_, t) in &self.params {
            if !is_storage_freed(t)? {
                // SAFETY: the unit owns these tensors' lifecycle: every reader (the
                // composition's forward and backward) runs between `unshard` and `reshard`,
                // and records read the shards through `full_values`.
                unsafe { free_storage(t)? };
            }
        }
        self.gathered = false;
        Ok(())
    }

    /// Reduces the gradients accumulated in the compute tensors into this rank's shard:
    /// reduce-scatter (`Avg`) over the group, then under hybrid sharding an all-reduce
    /// (`Avg`) across replicas; the shard's `.grad` is the result and the compute tensors'
    /// gradients are dropped. A parameter without a gradient contributes zeros.
    pub fn reduce_grads(&mut self) -> Result<(), ShardError> {
        let flat = Tensor::f_zeros([self.padded], (Kind::Float, tch::Device::Cpu))?;
        let mut offset = 0;
        for ((_, t), n) in self.params.iter().zip(&self.numels) {
            let g = t.grad();
            if g.defined() {
                flat.f_narrow(0, offset, *n)?.f_copy_(&g.f_reshape([-1])?)?;
            }
            offset += n;
        }
        let out = Tensor::f_empty([self.shard.numel() as i64], (Kind::Float, tch::Device::Cpu))?;
        if self.group.size() > 1 {
            self.group.reduce_scatter(&out, &flat, ReduceOp::Avg)?;
        } else {
            let mut out = out.shallow_clone();
            out.f_copy_(&flat)?;
        }
        if let Some(r) = &self.replicate {
            if r.size() > 1 {
                r.all_reduce(&out, ReduceOp::Avg)?;
            }
        }
        set_grad(&self.shard, Some(&out))?;
        for (_, t) in &self.params {
            set_grad(t, None)?;
        }
        Ok(())
    }

    /// Every compute tensor's full `value` of the shard (its data, or its `.grad`) gathered
    /// over the group: the record's view, read without touching the compute tensors (which
    /// may be freed). An undefined value reads as zeros.
    pub fn full_values(
        &self,
        value: impl Fn(&Tensor) -> Tensor,
    ) -> Result<Vec<(String, Tensor)>, ShardError> {
        let v = value(&self.shard);
        let local = if v.defined() {
            v.f_detach()?
        } else {
            self.shard.f_zeros_like()?
        };
        let full = self.gather(&local)?;
        let mut out = Vec::with_capacity(self.params.len());
        let mut offset = 0;
        for ((name, t), n) in self.params.iter().zip(&self.numels) {
            out.push((
                name.clone(),
                full.f_narrow(0, offset, *n)?.f_view(t.size().as_slice())?,
            ));
            offset += n;
        }
        Ok(out)
    }

    fn gather(&self, local: &Tensor) -> Result<Tensor, ShardError> {
        if self.group.size() == 1 {
            return Ok(local.f_contiguous()?.f_detach_copy()?);
        }
        let full = Tensor::f_empty([self.padded], (Kind::Float, tch::Device::Cpu))?;
        self.group.all_gather(&full, &local.f_contiguous()?)?;
        Ok(full)
    }
}
