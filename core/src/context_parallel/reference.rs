//! `single.cpN`: the single-device reference whose attention is computed as the ring
//! computes it. One process trains on the global batch, every module the model's own, except
//! that each query chunk is merged with its key chunks block by block, in the order the ring
//! brings them to the rank holding it ([`ring_order_attention`]). A ring row's attention is
//! then the reference's, bit for bit, block for block; what still differs is that a CP
//! rank's weight gradients are a GEMM over its own tokens, summed across ranks afterwards,
//! which no single-device order reproduces, so the rows are judged by the fp64 arbiter.

use super::attention::ring_order_attention;
use super::options::{CpDispatcher, CpError, CpOptions, SequenceLayout};
use super::run::check_context_parallel;
use crate::record::RunRecord;
use crate::train::{train, OptimizerConfig, StepHooks, TrainConfig, TrainError};
use lockstep_models::{LayerHooks, Model, ModelError};
use tch::Tensor;

/// The name of the reference for a ring over `cp` ranks laid out as `layout`: `single.cp2`
/// (load-balanced), `single.cp2.contiguous`.
pub fn ring_ordered_name(cp: usize, layout: SequenceLayout) -> String {
    match layout {
        SequenceLayout::Balanced => format!("single.cp{cp}"),
        SequenceLayout::Contiguous => format!("single.cp{cp}.contiguous"),
    }
}

/// `single.cpN`: one process over the `world_size` ranks' batches, attention in the merge
/// order of a ring over `cp` ranks laid out as `layout` (see the module docs). Refuses a
/// model context parallelism cannot split (its attention not through the hooks, a sequence
/// the layout's chunks do not divide).
pub fn ring_ordered_reference(
    model: &dyn Model,
    world_size: usize,
    (cp, layout): (usize, SequenceLayout),
    steps: usize,
    optimizer: OptimizerConfig,
    record_grads: bool,
) -> Result<RunRecord, CpError> {
    let opts = CpOptions {
        cp,
        tp: 1,
        ep: 1,
        dispatcher: CpDispatcher::Ring,
        layout,
        data_parallel: Default::default(),
        fault: None,
    };
    model.check_single_device_reference()?;
    check_context_parallel(model, world_size, &opts)?;
    let name = ring_ordered_name(cp, layout);
    let cfg = TrainConfig::one_process(model, &name, world_size, steps, optimizer, record_grads);
    let mut strategy = RingOrdered {
        hooks: RingOrderHooks { opts },
    };
    train(model, &cfg, &mut strategy, None).map_err(TrainError::into_strategy::<CpError>)
}

/// One process's step with the ring's attention order: the default forward and backward,
/// through [`RingOrderHooks`].
struct RingOrdered {
    hooks: RingOrderHooks,
}

impl StepHooks for RingOrdered {
    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        Some(&mut self.hooks)
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        Ok(())
    }
}

/// Every module the model's own but attention, which runs in the ring's merge order.
struct RingOrderHooks {
    opts: CpOptions,
}

impl LayerHooks for RingOrderHooks {
    fn attention(
        &mut self,
        _path: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        ring_order_attention(q, k, v, &self.opts).map_err(|e| ModelError::Hook(Box::new(e)))
    }
}
