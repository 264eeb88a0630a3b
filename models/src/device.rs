//! A zoo model on another device: the NCCL backend's ranks train on their GPU.
//!
//! Every model is built on the CPU (initialization draws the same numbers as PyTorch there),
//! then [`OnDevice`] moves its parameters and buffers in place — the tensors keep their
//! identity, so tied weights stay tied and every handle a training loop holds sees the move —
//! and moves every batch it hands out. The model's forward creates what it needs on its
//! inputs' device.

use crate::model::{Batch, LayerHooks, LayerSpec, LossReduction, Model};
use crate::store::ParamStore;
use crate::ModelError;
use tch::{Device, Tensor};

/// `inner` with its parameters, buffers and batches on `device`.
pub struct OnDevice {
    inner: Box<dyn Model>,
    device: Device,
}

impl OnDevice {
    /// Moves `inner`'s parameters and buffers to `device` (a no-op on the CPU).
    pub fn new(inner: Box<dyn Model>, device: Device) -> Result<OnDevice, ModelError> {
        if device != Device::Cpu {
            let _guard = tch::no_grad_guard();
            for (_, mut t) in inner
                .store()
                .named_parameters()
                .into_iter()
                .chain(inner.store().named_buffers())
            {
                let moved = t.f_to_device(device)?;
                t.f_set_data(&moved)?;
            }
        }
        Ok(OnDevice { inner, device })
    }

    /// The device it computes on.
    pub fn device(&self) -> Device {
        self.device
    }

    fn moved(&self, batch: Batch) -> Result<Batch, ModelError> {
        if self.device == Device::Cpu {
            return Ok(batch);
        }
        Ok(Batch {
            inputs: batch
                .inputs
                .iter()
                .map(|t| t.f_to_device(self.device))
                .collect::<Result<_, _>>()?,
            target: batch
                .target
                .map(|t| t.f_to_device(self.device))
                .transpose()?,
        })
    }
}

impl Model for OnDevice {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn seed(&self) -> u64 {
        self.inner.seed()
    }
    fn store(&self) -> &ParamStore {
        self.inner.store()
    }
    fn layers(&self) -> Vec<LayerSpec> {
        self.inner.layers()
    }
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        self.moved(self.inner.input(rank, step)?)
    }
    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.inner.forward(batch)
    }
    fn supports_layer_hooks(&self) -> bool {
        self.inner.supports_layer_hooks()
    }
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        self.inner.forward_hooked(batch, hooks)
    }
    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        self.inner.loss_of(batch, output)
    }
    fn loss_reduction(&self) -> LossReduction {
        self.inner.loss_reduction()
    }
    fn batch_dim(&self) -> i64 {
        self.inner.batch_dim()
    }
    fn single_device_reference_blocker(&self) -> Option<String> {
        self.inner.single_device_reference_blocker()
    }
    fn gpt_config(&self) -> Option<crate::zoo::GptConfig> {
        self.inner.gpt_config()
    }
}
