//! A zoo model on another device or in another float dtype: the NCCL backend's ranks train on
//! their GPU, and the fp64 arbiter's shadow reference trains in float64.
//!
//! Every model is built on the CPU in fp32 (initialization draws the same numbers as PyTorch
//! there), then [`OnDevice`] moves (or widens) its parameters and buffers in place — the
//! tensors keep their identity, so tied weights stay tied and every handle a training loop
//! holds sees the move — and moves every batch it hands out. The model's forward creates what
//! it needs on its inputs' device and in its inputs' dtype.

use crate::model::{Batch, LayerHooks, LayerSpec, LossReduction, Model};
use crate::store::ParamStore;
use crate::ModelError;
use tch::{Device, Kind, Tensor};

/// `inner` with its parameters, buffers and batches on `device` (and, for the fp64 shadow,
/// with every floating-point tensor widened to `float_kind`).
pub struct OnDevice {
    inner: Box<dyn Model>,
    device: Device,
    float_kind: Option<Kind>,
}

impl OnDevice {
    /// Moves `inner`'s parameters and buffers to `device` (a no-op on the CPU).
    pub fn new(inner: Box<dyn Model>, device: Device) -> Result<OnDevice, ModelError> {
        OnDevice::placed(inner, device, None)
    }

    /// `inner` trained in float64 on the CPU: every floating-point parameter, buffer and batch
    /// tensor widened (integer tensors, such as token ids, untouched). The fp64 arbiter's shadow
    /// reference: the same initial values and batches as the fp32 reference, with rounding
    /// errors some nine orders of magnitude smaller.
    pub fn in_f64(inner: Box<dyn Model>) -> Result<OnDevice, ModelError> {
        OnDevice::placed(inner, Device::Cpu, Some(Kind::Double))
    }

    fn placed(
        inner: Box<dyn Model>,
        device: Device,
        float_kind: Option<Kind>,
    ) -> Result<OnDevice, ModelError> {
        let placed = OnDevice {
            inner,
            device,
            float_kind,
        };
        if device != Device::Cpu || float_kind.is_some() {
            let _guard = tch::no_grad_guard();
            for (_, mut t) in placed
                .inner
                .store()
                .named_parameters()
                .into_iter()
                .chain(placed.inner.store().named_buffers())
            {
                let moved = placed.place(&t)?;
                t.f_set_data(&moved)?;
            }
        }
        Ok(placed)
    }

    /// `t` on this device, widened when it is floating point and a float kind is set.
    fn place(&self, t: &Tensor) -> Result<Tensor, tch::TchError> {
        let t = t.f_to_device(self.device)?;
        match self.float_kind {
            Some(kind) if t.is_floating_point() && t.kind() != kind => t.f_to_kind(kind),
            _ => Ok(t),
        }
    }

    /// The device it computes on.
    pub fn device(&self) -> Device {
        self.device
    }

    fn moved(&self, batch: Batch) -> Result<Batch, ModelError> {
        if self.device == Device::Cpu && self.float_kind.is_none() {
            return Ok(batch);
        }
        Ok(Batch {
            inputs: batch
                .inputs
                .iter()
                .map(|t| self.place(t))
                .collect::<Result<_, _>>()?,
            target: batch.target.map(|t| self.place(&t)).transpose()?,
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
    fn max_grad_norm(&self) -> Option<f64> {
        self.inner.max_grad_norm()
    }
    fn batch_dim(&self) -> i64 {
        self.inner.batch_dim()
    }
    fn single_device_reference_blocker(&self) -> Option<String> {
        self.inner.single_device_reference_blocker()
    }
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<crate::plan::ParallelPlan> {
        self.inner.parallel_plan(sequence_parallel)
    }
    /// The wrapped model's answer: it routes its attention and positions through the hooks
    /// wherever it computes (the default would refuse every model placed on a device).
    fn context_parallel_blocker(&self) -> Option<String> {
        self.inner.context_parallel_blocker()
    }
    fn loss_of_hooked(
        &self,
        batch: &Batch,
        output: &Tensor,
        hooks: &mut dyn crate::LayerHooks,
    ) -> Result<Tensor, ModelError> {
        self.inner.loss_of_hooked(batch, output, hooks)
    }
}
