//! The single-device reference of a mixed-precision data-parallel run, written apart from
//! [`crate::precision`] on purpose.
//!
//! A DDP or FSDP run under a policy is otherwise judged against DDP under the same policy
//! code, so a preset that computes in the wrong half type, a reduction in the wrong dtype or
//! a master copy kept in half precision would move every such run alike and fail nothing.
//! This reference shares none of that code: it names its half type itself and spells out
//! PyTorch's mixed-precision DDP step for every rank in turn, in one process:
//!
//! 1. each rank's batch runs forward and backward with every parameter outside a BatchNorm
//!    layer swapped for a half copy of its fp32 master, and every layer's floating inputs
//!    cast to the dtype its parameters compute in (BatchNorm layers stay fp32, and read the
//!    running statistics rank 0 holds, as DDP broadcasts them before every forward);
//! 2. the ranks' gradients, widened to fp32, are summed in rank order and divided by the
//!    rank count once (the CPU backend's `Avg`, in fp32 as the policy's `reduce_dtype`);
//! 3. the fp32 masters take the optimizer step.
//!
//! On the CPU backend a correct DDP run under the policy equals it bit for bit; the
//! matrix's `ddp.bf16@N` and `ddp.fp16@N` rows hold it to that.

use crate::autograd::set_grad;
use crate::record::RunRecord;
use crate::train::{
    train_from, OptimizerConfig, StepHooks, StepLoss, TrainConfig, TrainError, TrainStart,
};
use lockstep_models::{LayerHooks, LayerKind, Model, ModelError};
use std::collections::BTreeSet;
use tch::{Kind, Tensor};

/// The half type a reference computes in, named here rather than taken from a policy
/// preset (a preset with the wrong dtype must not move its own reference).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HalfType {
    /// bfloat16: 8 exponent bits, 7 stored mantissa bits.
    Bf16,
    /// IEEE half: 5 exponent bits, 10 stored mantissa bits.
    Fp16,
}

impl HalfType {
    /// The libtorch dtype.
    pub fn kind(self) -> Kind {
        match self {
            HalfType::Bf16 => Kind::BFloat16,
            HalfType::Fp16 => Kind::Half,
        }
    }

    /// The reference's configuration name: `single.bf16`, `single.fp16`.
    pub fn reference_name(self) -> &'static str {
        match self {
            HalfType::Bf16 => "single.bf16",
            HalfType::Fp16 => "single.fp16",
        }
    }
}

/// Why a model has no mixed-precision reference, if it has none: parameters seeded per rank
/// (no one process holds every rank's model), or a forward that calls no layer hooks
/// (nothing could cast a layer's inputs).
pub fn mixed_reference_blocker(model: &dyn Model) -> Option<String> {
    if !model.tags().rank_local.is_empty() {
        return Some(
            "some parameters are seeded per rank and never averaged, so no single process \
             holds every rank's model"
                .into(),
        );
    }
    (!model.supports_layer_hooks()).then(|| {
        "its forward calls no layer hooks, so no layer's inputs can be cast to half precision"
            .into()
    })
}

/// Trains `model` for `steps` steps as `world_size` data-parallel ranks under mixed
/// precision in `half` (fp32 masters, fp32 gradient averaging, BatchNorm in fp32): see the
/// module documentation.
pub fn mixed_precision_reference(
    model: &dyn Model,
    half: HalfType,
    world_size: usize,
    steps: usize,
    optimizer: OptimizerConfig,
    record_grads: bool,
) -> Result<RunRecord, TrainError> {
    if let Some(reason) = mixed_reference_blocker(model) {
        return Err(TrainError::Model(ModelError::ReferenceUnsupported {
            model: model.name().to_owned(),
            reason,
        }));
    }
    if world_size == 0 {
        return Err(TrainError::InvalidConfig("world size 0".into()));
    }
    let name = half.reference_name();
    let mut cfg = TrainConfig::one_process(model, name, world_size, steps, optimizer, record_grads);
    cfg.spec.dtype = match half {
        HalfType::Bf16 => "bf16".into(),
        HalfType::Fp16 => "fp16".into(),
    };
    let mut strategy = RanksInTurn::new(model, half.kind());
    train_from(model, &cfg, &mut strategy, None, &TrainStart::default()).map(|(record, _)| record)
}

/// The reference's step: every data rank's forward and backward in turn, then the average.
struct RanksInTurn {
    half: Kind,
    /// Whether each parameter (in `named_parameters` order) computes in half precision.
    computes_in_half: Vec<bool>,
    /// Each layer's compute dtype, in layer order.
    layer_dtypes: Vec<Kind>,
}

impl RanksInTurn {
    fn new(model: &dyn Model, half: Kind) -> Self {
        let tags = model.tags();
        let layers = model.layers();
        // A parameter stays fp32 only when every layer that uses it is a BatchNorm.
        let mut half_use = BTreeSet::new();
        let mut listed = BTreeSet::new();
        for layer in &layers {
            for p in &layer.params {
                let canonical = tags.canonical(p).to_owned();
                if layer.kind != LayerKind::BatchNorm {
                    half_use.insert(canonical.clone());
                }
                listed.insert(canonical);
            }
        }
        let computes_in_half = model
            .named_parameters()
            .iter()
            .map(|(n, _)| half_use.contains(n) || !listed.contains(n))
            .collect();
        let layer_dtypes = layers
            .iter()
            .map(|l| match l.kind {
                LayerKind::BatchNorm => Kind::Float,
                _ => half,
            })
            .collect();
        RanksInTurn {
            half,
            computes_in_half,
            layer_dtypes,
        }
    }
}

/// Casts every floating input of a layer to the dtype that layer computes in.
struct CastEachLayer<'a>(&'a [Kind]);

impl LayerHooks for CastEachLayer<'_> {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let dtype = *self.0.get(index).ok_or_else(|| {
            ModelError::Hook(
                format!(
                    "mixed-precision reference: layer hook called for layer {index} of {}",
                    self.0.len()
                )
                .into(),
            )
        })?;
        inputs
            .into_iter()
            .map(|x| match x.kind() {
                Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double if x.kind() != dtype => {
                    Ok(x.f_to_kind(dtype)?)
                }
                _ => Ok(x),
            })
            .collect()
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }
}

/// Every tensor in `to` takes the value of its counterpart in `from`, in place.
fn copy_values(to: &[(String, Tensor)], from: &[Tensor]) -> Result<(), TrainError> {
    tch::no_grad(|| {
        for ((_, t), v) in to.iter().zip(from) {
            t.shallow_clone().f_copy_(v)?;
        }
        Ok(())
    })
}

impl RanksInTurn {
    /// Before one rank's forward: every parameter's gradient cleared and its data a fresh
    /// copy of its fp32 master, in half precision where it computes in half.
    fn swap_in(&self, params: &[(String, Tensor)], masters: &[Tensor]) -> Result<(), TrainError> {
        tch::no_grad(|| {
            for (((_, p), master), &half) in params.iter().zip(masters).zip(&self.computes_in_half)
            {
                set_grad(p, None)?;
                let data = match half {
                    true => master.f_to_kind(self.half)?,
                    false => master.shallow_clone(),
                };
                p.shallow_clone().f_set_data(&data)?;
            }
            Ok(())
        })
    }
}

/// After one rank's backward: its gradients, widened to fp32, added to `sums` (rank order).
fn add_rank_gradients(
    params: &[(String, Tensor)],
    sums: &mut [Option<Tensor>],
) -> Result<(), TrainError> {
    tch::no_grad(|| {
        for ((_, p), sum) in params.iter().zip(sums.iter_mut()) {
            let g = p.grad();
            let g = match g.defined() {
                true => g.f_to_kind(Kind::Float)?,
                // A parameter this rank's batch did not reach adds zeros, as DDP's
                // zero-filled bucket slot does.
                false => Tensor::f_zeros(p.size(), (Kind::Float, p.device()))?,
            };
            *sum = Some(match sum.take() {
                Some(s) => s.f_add(&g)?,
                None => g,
            });
        }
        Ok(())
    })
}

/// After every rank: each parameter back on its fp32 master, with the ranks' summed gradient
/// divided once by their number (the CPU backend's `Avg`) as its `.grad`.
fn restore_averaged(
    params: &[(String, Tensor)],
    masters: &[Tensor],
    sums: Vec<Option<Tensor>>,
    ranks: usize,
) -> Result<(), TrainError> {
    tch::no_grad(|| {
        for (((_, p), master), sum) in params.iter().zip(masters).zip(sums) {
            p.shallow_clone().f_set_data(master)?;
            let sum = sum.ok_or_else(|| TrainError::InvalidConfig("no data rank".into()))?;
            let average = sum.f_div_scalar(ranks as f64)?.f_to_kind(master.kind())?;
            set_grad(p, Some(&average))?;
        }
        Ok(())
    })
}

impl StepHooks for RanksInTurn {
    fn forward_backward(
        &mut self,
        model: &dyn Model,
        data_ranks: &[usize],
        step: usize,
    ) -> Result<StepLoss, TrainError> {
        let params = model.named_parameters();
        let masters: Vec<Tensor> = params.iter().map(|(_, p)| p.detach()).collect();
        let buffers = model.named_buffers();
        let at_step_start: Vec<Tensor> = buffers.iter().map(|(_, b)| b.copy()).collect();
        let mut rank0_buffers: Option<Vec<Tensor>> = None;
        let mut sums: Vec<Option<Tensor>> = params.iter().map(|_| None).collect();
        let mut loss_sum = 0.0;
        let mut device = None;
        for &rank in data_ranks {
            // Every rank starts from the buffers rank 0 broadcast, as under DDP.
            copy_values(&buffers, &at_step_start)?;
            self.swap_in(&params, &masters)?;
            let batch = model.input(rank, step)?;
            let loss = model.loss_hooked(&batch, &mut CastEachLayer(&self.layer_dtypes))?;
            loss.f_backward()?;
            loss_sum += loss.f_double_value(&[])?;
            device = Some(loss.device());
            if rank0_buffers.is_none() {
                rank0_buffers = Some(buffers.iter().map(|(_, b)| b.copy()).collect());
            }
            add_rank_gradients(&params, &mut sums)?;
        }
        restore_averaged(&params, &masters, sums, data_ranks.len())?;
        copy_values(&buffers, &rank0_buffers.unwrap_or_default())?;
        let device =
            device.ok_or_else(|| TrainError::InvalidConfig("a step with no data rank".into()))?;
        Ok(StepLoss {
            value: loss_sum / data_ranks.len() as f64,
            device,
        })
    }

    fn sync_gradients(&mut self, _grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        Ok(())
    }
}
