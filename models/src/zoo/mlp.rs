//! A stack of linears with deliberately uneven sizes, so sharding on dim 0 leaves ragged
//! shards at every world size. `mlp` is small; `mlp_wide` is the same stack at widths whose
//! largest weight (≈270 KB) and flat parameter (≈300 KB) take the CPU backend's large-message
//! paths: past the direct algorithms (64 KiB) and past shared memory's threshold (256 KiB),
//! with odd sizes everywhere. (The pipelined broadcast's 1 MiB segments are left to
//! `core/tests/collectives.rs`: a model that large would dominate the matrix's time in records.)

use crate::layers::Linear;
use crate::model::{Batch, LayerHooks, LayerKind, LayerSpec, LossReduction, Model, NoHooks};
use crate::seed;
use crate::store::{ParamStore, F32};
use crate::LayerRun;
use crate::ModelError;
use tch::Tensor;

/// Feature sizes of `mlp`: 7 → 15 → 16 → 17 → 3 (odd, prime and one-off-power-of-two
/// widths).
const SIZES: [i64; 5] = [7, 15, 16, 17, 3];
/// Feature sizes of `mlp_wide`: 7 → 263 → 257 → 17 → 3 (≈74 K parameters; odd, prime and
/// one-past-a-power-of-two widths, so no split is even).
const WIDE_SIZES: [i64; 5] = [7, 263, 257, 17, 3];
const BATCH: i64 = 5;

/// `nn.Sequential(Linear(7,15), ReLU, Linear(15,16), ReLU, Linear(16,17), ReLU,
/// Linear(17,3))` regressing a fixed function of its input with a summed squared error.
#[derive(Debug)]
pub struct MlpStack {
    name: &'static str,
    sizes: Vec<i64>,
    rank: usize,
    seed: u64,
    linears: Vec<Linear>,
    store: ParamStore,
}

impl MlpStack {
    /// `mlp`: draws every linear, in forward order, from the run's parameter seed.
    pub fn new(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        Self::with_sizes("mlp", &SIZES, run_seed, rank)
    }

    /// `mlp_wide`: the same stack at widths that make every collective a large message.
    pub fn wide(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        Self::with_sizes("mlp_wide", &WIDE_SIZES, run_seed, rank)
    }

    /// A stack of `sizes.len() - 1` linears with ReLUs between them, named `name`: stacks of
    /// a user's own depth and width (e.g. wide layers whose activations make every pipeline
    /// message large). The first size must be at least the last (the target is a function of
    /// the first features).
    pub fn with_sizes(
        name: &'static str,
        sizes: &[i64],
        run_seed: u64,
        rank: usize,
    ) -> Result<Self, ModelError> {
        if sizes.len() < 2 || sizes[0] < sizes[sizes.len() - 1] {
            return Err(ModelError::InvalidConfig {
                model: name.into(),
                reason: format!(
                    "a stack needs at least two sizes, the first no smaller than the last (the \
                     target is a function of the first features); got {sizes:?}"
                ),
            });
        }
        let mut store = ParamStore::default();
        let guard = seed::lock_seeded(seed::param_seed(run_seed));
        let mut linears = Vec::new();
        for (i, w) in sizes.windows(2).enumerate() {
            linears.push(Linear::new(
                &mut store,
                &format!("layers.{}", 2 * i),
                w[0],
                w[1],
                true,
            )?);
        }
        drop(guard);
        Ok(MlpStack {
            name,
            sizes: sizes.to_vec(),
            rank,
            seed: run_seed,
            linears,
            store,
        })
    }
}

impl Model for MlpStack {
    fn name(&self) -> &str {
        self.name
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    fn layers(&self) -> Vec<LayerSpec> {
        let mut layers = Vec::new();
        for i in 0..self.linears.len() {
            let name = format!("layers.{}", 2 * i);
            layers.push(LayerSpec {
                params: Linear::names(&name, true),
                name,
                kind: LayerKind::Linear,
            });
            if i + 1 < self.linears.len() {
                layers.push(LayerSpec {
                    name: format!("layers.{}", 2 * i + 1),
                    kind: LayerKind::Activation,
                    params: Vec::new(),
                });
            }
        }
        layers
    }

    /// `x = rand(5, 7)` from the batch seed; the target is `sin` of the first three
    /// features, a smooth function the stack can fit.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let x = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            Tensor::f_rand([BATCH, self.sizes[0]], F32)
        })?;
        let target = x
            .f_narrow(1, 0, self.sizes[self.sizes.len() - 1])?
            .f_mul_scalar(3.0)?
            .f_sin()?;
        Ok(Batch {
            inputs: vec![x],
            target: Some(target),
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// One layer per linear and per ReLU, input the hidden state.
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let mut run = LayerRun::new(hooks);
        let mut x = batch
            .inputs
            .first()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name.into(),
                reason: "expected one input tensor".into(),
            })?
            .shallow_clone();
        for (i, l) in self.linears.iter().enumerate() {
            x = run.layer([x], |[x]| Ok(l.forward(&x)?))?;
            if i + 1 < self.linears.len() {
                x = run.layer([x], |[x]| Ok(x.f_relu()?))?;
            }
        }
        Ok(x)
    }

    fn loss_reduction(&self) -> LossReduction {
        LossReduction::Sum
    }

    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        let target = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name.into(),
                reason: "missing target".into(),
            })?;
        // In the target's precision (fp32) under a mixed-precision policy, as autocast
        // computes mse_loss: torch 2.11's backward refuses a bf16 output against an fp32
        // target, and 2.13 promotes the output to fp32 itself, so on 2.13 the bits are the
        // same either way.
        let output = if output.kind() == target.kind() {
            output.shallow_clone()
        } else {
            output.f_to_kind(target.kind())?
        };
        Ok(output.f_mse_loss(target, tch::Reduction::Sum)?)
    }
}
