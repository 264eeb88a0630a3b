//! When a unit is gathered and freed: the layer hooks around each wrapped layer's forward,
//! the gradient hooks that re-gather a unit for its backward and launch its reduce-scatter as
//! soon as its last gradient is complete, and the NaN refill that keeps a dropped wrapper's
//! freed parameters safe to touch.

use super::core::{Core, Gather};
use super::unit::Residency;
use super::{BackwardPrefetch, Fsdp, FsdpError, FsdpFault, ShardingStrategy};
use crate::autograd::{
    is_storage_freed, refill_storage, register_hook, register_post_accumulate_grad_hook, set_grad,
    AutogradError, HookHandle,
};
use crate::comm::work::lock;
use lockstep_models::{LayerHooks, ModelError};
use std::sync::{Arc, Mutex};
use tch::Tensor;

impl Core {
    pub(super) fn unshard_all(&mut self, purpose: Gather) -> Result<(), FsdpError> {
        for u in 0..self.units.len() {
            let kind = self.units[u].kind;
            self.unshard_unit(u, purpose, kind)?;
        }
        Ok(())
    }

    /// Gathers every unit in its compute dtype (before a forward that does not call the
    /// layer hooks, or the root before one that does). Under mixed precision, the fp32
    /// gradients the last record view left in `.grad` are dropped first, so backward
    /// produces fresh low-precision ones (accumulated ones from `no_sync` are kept).
    pub(super) fn unshard_for_forward(&mut self) -> Result<(), FsdpError> {
        self.swap_in_ignored()?;
        for unit in &self.units {
            if unit.compute_kind == unit.kind {
                continue;
            }
            for slot in &unit.slots {
                let g = slot.param.grad();
                if g.defined() && g.kind() != unit.compute_kind {
                    set_grad(&slot.param, None)?;
                }
            }
        }
        for u in 0..self.units.len() {
            if self.per_layer && !self.units[u].is_root() {
                continue;
            }
            let kind = self.units[u].compute_kind;
            self.unshard_unit(u, Gather::Params, kind)?;
        }
        Ok(())
    }

    /// Copies this rank's slice of the full parameters back into its shards.
    pub(super) fn write_back(&mut self) -> Result<(), FsdpError> {
        let _guard = tch::no_grad_guard();
        let world = self.shard_world as i64;
        let rank = self.shard_rank as i64;
        for unit in &self.units {
            let flat = unit.flatten(|s| Ok(s.param.f_detach()?.f_to_kind(unit.kind)?))?;
            let size = unit.padded / world;
            unit.shard
                .f_detach()?
                .f_copy_(&flat.f_narrow(0, rank * size, size)?)?;
        }
        Ok(())
    }

    /// The unit forward needs after unit `u` (`+1`) or backward needs after it (`-1`): the
    /// neighbour in forward order, the root excluded.
    pub(super) fn neighbour(&self, u: usize, forward: bool) -> Option<usize> {
        let v = if forward {
            u.checked_add(1)?
        } else {
            u.checked_sub(1)?
        };
        (v < self.units.len() && !self.units[v].is_root()).then_some(v)
    }

    /// A unit's layer is about to run.
    pub(super) fn pre_forward(&mut self, layer: usize) -> Result<(), FsdpError> {
        let Some(u) = self.unit_of_layer.get(layer).copied().flatten() else {
            return Ok(());
        };
        let kind = self.units[u].compute_kind;
        self.unshard_unit(u, Gather::Params, kind)?;
        if self.opts.forward_prefetch {
            if let Some(next) = self.neighbour(u, true) {
                self.prefetch(next)?;
            }
        }
        Ok(())
    }

    /// Whether unit `u` is freed between its forward and its backward.
    pub(super) fn reshards_after_forward(&self, u: usize) -> bool {
        matches!(
            self.opts.strategy,
            ShardingStrategy::FullShard | ShardingStrategy::HybridShard
        ) && self.opts.reshard_after_forward
            && self.sync_grads
            && !self.units[u].is_root()
    }

    /// A unit's layer ran; frees the unit after its last layer. Returns the unit whose
    /// pre-backward must run before this output's backward.
    pub(super) fn post_forward(&mut self, layer: usize) -> Result<Option<usize>, FsdpError> {
        let Some(u) = self.unit_of_layer.get(layer).copied().flatten() else {
            return Ok(None);
        };
        if self.units[u].layers.last() == Some(&layer) && self.reshards_after_forward(u) {
            self.reshard_unit(u)?;
        }
        Ok(Some(u))
    }

    /// Unit `u`'s backward is about to run: its parameters must hold the gathered values.
    pub(super) fn pre_backward(&mut self, u: usize) -> Result<(), FsdpError> {
        let kind = self.units[u].compute_kind;
        if self.opts.fault == Some(FsdpFault::NoRegatherBeforeBackward)
            && self.units[u].residency == Residency::Sharded
        {
            let _guard = tch::no_grad_guard();
            for slot in &self.units[u].slots {
                if is_storage_freed(&slot.param)? {
                    let zeros = Tensor::f_zeros(slot.param.size(), (kind, self.compute_device))?;
                    refill_storage(&slot.param, Some(&zeros))?;
                }
            }
            self.units[u].residency = Residency::Unsharded;
            return Ok(());
        }
        self.unshard_unit(u, Gather::Params, kind)?;
        if self.opts.backward_prefetch == BackwardPrefetch::Pre {
            if let Some(next) = self.neighbour(u, false) {
                self.prefetch(next)?;
            }
        }
        Ok(())
    }

    /// One of unit `u`'s parameters has its complete gradient; after the last one, the unit's
    /// reduction is launched and its parameters freed.
    pub(super) fn param_grad_ready(&mut self, u: usize) -> Result<(), FsdpError> {
        let unit = &mut self.units[u];
        unit.ready += 1;
        if unit.ready < unit.slots.len() {
            return Ok(());
        }
        unit.ready = 0;
        if !self.sync_grads {
            return Ok(());
        }
        self.launch_reduce(u)?;
        if self.opts.backward_prefetch == BackwardPrefetch::Post {
            if let Some(next) = self.neighbour(u, false) {
                self.prefetch(next)?;
            }
        }
        self.reshard_unit(u)
    }
}

/// Registers the post-backward hook on every managed parameter.
pub(super) fn register_post_backward(
    core: &Arc<Mutex<Core>>,
) -> Result<Vec<HookHandle>, FsdpError> {
    let params: Vec<(usize, Tensor)> = lock(core)
        .units
        .iter()
        .enumerate()
        .flat_map(|(u, unit)| unit.slots.iter().map(move |s| (u, s.param.shallow_clone())))
        .collect();
    let mut handles = Vec::with_capacity(params.len());
    for (u, p) in params {
        let core = core.clone();
        handles.push(register_post_accumulate_grad_hook(&p, move |_| {
            let mut core = lock(&core);
            core.param_grad_ready(u).map_err(|e| {
                AutogradError::msg(format!(
                    "fsdp post-backward of unit `{}`: {e}",
                    core.units[u].name
                ))
            })
        })?);
    }
    Ok(handles)
}

fn hook_error(e: FsdpError) -> ModelError {
    ModelError::Hook(Box::new(e))
}

impl LayerHooks for Fsdp {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.core().pre_forward(index).map_err(hook_error)?;
        match &mut self.cast {
            Some(cast) => cast.pre_forward(index, inputs),
            None => Ok(inputs),
        }
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        let unit = self.core().post_forward(index).map_err(hook_error)?;
        if let Some(u) = unit {
            if output.requires_grad() {
                let core = self.core.clone();
                // The handle is dropped: the hook lives as long as this output's graph.
                register_hook(&output, move |_| {
                    let mut core = lock(&core);
                    core.pre_backward(u).map_err(|e| {
                        AutogradError::msg(format!(
                            "fsdp pre-backward of unit `{}`: {e}",
                            core.units[u].name
                        ))
                    })?;
                    Ok(None)
                })
                .map_err(|e| hook_error(e.into()))?;
            }
        }
        Ok(output)
    }
}

impl Drop for Fsdp {
    fn drop(&mut self) {
        for handle in self.post_backward.drain(..) {
            let _ = handle.remove();
        }
        let mut core = lock(&self.core);
        let _ = core.swap_out_ignored();
        for unit in &mut core.units {
            if let Some(p) = unit.pending_gather.take() {
                let _ = p.work.wait();
            }
            if let Some(p) = unit.pending_reduce.take() {
                let _ = p.work.wait();
            }
            if unit.residency == Residency::Unsharded {
                continue;
            }
            for slot in &unit.slots {
                if matches!(is_storage_freed(&slot.param), Ok(true))
                    && refill_storage(&slot.param, None).is_ok()
                {
                    let _guard = tch::no_grad_guard();
                    let _ = slot.param.shallow_clone().f_fill_(f64::NAN);
                }
            }
        }
    }
}
