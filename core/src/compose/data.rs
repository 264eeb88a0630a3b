//! The data dimension as a layer stacked on a model-splitting parallelism (tensor, expert or
//! pipeline): whatever tensors the split leaves on a rank are either replicated (stepped as
//! they are, their gradients averaged by the split parallelism's reduce) or one FSDP unit
//! sharded over the dimension (gathered before compute, reduce-scattered after backward,
//! stepped as shards). The split parallelism's [`StepHooks`](crate::train::StepHooks) hand
//! their clip, optimizer step, state check and gathers to this layer, so the three share one
//! body for the data dimension, as torchtitan applies FSDP after TP, EP or the pipeline.

use crate::comm::CollectiveCounts;
use crate::consistency::StateProbe;
use crate::fsdp::{Fsdp, FsdpError};
use crate::train::{clip_coefficient, observe_stepped, scale_gradients, Optimizer, TrainError};
use std::cell::RefCell;
use tch::Tensor;

/// One rank's data dimension under a model-splitting parallelism (built by Lockstep's own
/// strategies; a strategy that has one hands it to the loop through
/// [`StepHooks::data_layer`](crate::train::StepHooks::data_layer)).
pub struct DataLayer {
    /// Stepped as they are: every tensor the split left when the dimension replicates; those
    /// the unit leaves out when it shards (an expert-parallel rank's experts).
    whole: Vec<(String, Tensor)>,
    /// Sharded: the rank's tensors as one FSDP unit over the dimension. In a cell because a
    /// pipeline's schedule drives it (gathers, frees, reduces) while the loop steps it.
    unit: Option<RefCell<Fsdp>>,
    /// Free the unit's parameters after the optimizer steps its shards (a pipeline's
    /// schedule frees them itself).
    reshard_after_step: bool,
}

impl DataLayer {
    /// A data dimension over `unit` (sharded) or none (replicated), with `whole` stepped as
    /// they are beside it.
    pub(crate) fn new(unit: Option<Fsdp>, whole: Vec<(String, Tensor)>) -> DataLayer {
        DataLayer {
            whole,
            unit: unit.map(RefCell::new),
            reshard_after_step: true,
        }
    }

    /// The same layer for a split whose schedule frees the unit's parameters itself.
    pub(crate) fn freed_by_schedule(mut self) -> DataLayer {
        self.reshard_after_step = false;
        self
    }

    /// The tensors stepped as they are (beside the unit, if any).
    pub(crate) fn whole(&self) -> &[(String, Tensor)] {
        &self.whole
    }

    /// The sharded unit, when the dimension shards.
    pub(crate) fn unit(&self) -> Option<&RefCell<Fsdp>> {
        self.unit.as_ref()
    }

    /// Gathers the unit's full parameters: before a forward, and before the record reads the
    /// model (so its tensors hold their trained values, never freed memory).
    pub(crate) fn gather(&self) -> Result<(), TrainError> {
        match &self.unit {
            Some(u) => u.borrow_mut().unshard().map_err(TrainError::strategy),
            None => Ok(()),
        }
    }

    /// Reduces the unit's full gradients into its shards (replicated tensors are the split
    /// parallelism's to reduce).
    pub(crate) fn reduce_gradients(&self) -> Result<(), FsdpError> {
        match &self.unit {
            Some(u) => u.borrow_mut().reduce_gradients(),
            None => Ok(()),
        }
    }

    /// What the optimizer steps, under the names its state is keyed by: the whole tensors,
    /// then the unit's shards.
    pub(crate) fn stepped(&self) -> Vec<(String, Tensor)> {
        let mut stepped: Vec<(String, Tensor)> = self
            .whole
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        if let Some(u) = &self.unit {
            stepped.extend(u.borrow().stepped());
        }
        stepped
    }

    /// Scales what the optimizer steps so the global norm `total` is at most `max_norm`.
    pub(crate) fn clip(&self, max_norm: f64, total: f64) -> Result<(), TrainError> {
        let grads: Vec<Tensor> = self.stepped().iter().map(|(_, t)| t.grad()).collect();
        scale_gradients(&grads, clip_coefficient(max_norm, total))
    }

    /// The optimizer step on what this rank steps; the unit's parameters are then freed
    /// until the next gather (unless the schedule frees them).
    pub(crate) fn step(&self, optimizer: &mut dyn Optimizer) -> Result<bool, TrainError> {
        optimizer.step(&self.stepped())?;
        if let (Some(u), true) = (&self.unit, self.reshard_after_step) {
            u.borrow_mut().reshard().map_err(TrainError::strategy)?;
        }
        Ok(true)
    }

    /// What was just stepped (and its optimizer state) for the cross-rank check: the whole
    /// tensors under `whole_coordinate`'s copy names, the unit's shards under `shard_prefix`
    /// (the split's coordinate, e.g. `tp0/2.`) and this shard's index.
    pub(crate) fn observe(
        &self,
        probe: &StateProbe,
        step: usize,
        optimizer: &dyn Optimizer,
        whole_coordinate: &dyn Fn(&str) -> String,
        shard_prefix: &str,
    ) -> Result<(), TrainError> {
        let unit = self.unit.as_ref().map(RefCell::borrow);
        let shards = unit.as_deref().map_or_else(Vec::new, Fsdp::stepped);
        let shard = unit
            .as_deref()
            .map_or_else(String::new, Fsdp::shard_coordinate);
        let coord = |name: &str| match shards.iter().any(|(n, _)| n == name) {
            true => format!("{shard_prefix}{shard}"),
            false => whole_coordinate(name),
        };
        Ok(observe_stepped(
            probe,
            step,
            &self.stepped(),
            optimizer,
            &coord,
        )?)
    }
}

/// What every model-splitting strategy of the one loop (TP, EP, and the CP loop that also
/// trains their compositions) holds alike: the tensors it trains, its data dimension over
/// them, and the counts of its collectives. A strategy hands it to the loop through
/// [`StepHooks::split_state`](crate::train::StepHooks::split_state), whose default methods
/// then zero, gather, step and count through it, written once for the three.
pub struct SplitState {
    /// What this rank trains: its shards, its experts, the dense parameters.
    pub(crate) trained: Vec<(String, Tensor)>,
    /// The data dimension over `trained`: replicated, or one FSDP unit sharded over it.
    pub(crate) data: DataLayer,
    /// Every collective the strategy's groups issue, taken per step for the record.
    pub(crate) counts: CollectiveCounts,
}

impl SplitState {
    /// The state of a strategy training `trained` under `data`, counting its collectives in
    /// `counts`.
    pub(crate) fn new(
        trained: Vec<(String, Tensor)>,
        data: DataLayer,
        counts: CollectiveCounts,
    ) -> SplitState {
        SplitState {
            trained,
            data,
            counts,
        }
    }
}
