//! PyTorch's `NestedWrappedModule` and `MixtureOfExperts` (FSDP tests): stacks of linears
//! whose loss is `output.sum()`.

use crate::layers::{path, Linear};
use crate::model::{Batch, LayerHooks, LayerKind, LayerSpec, LossReduction, Model, NoHooks};
use crate::seed;
use crate::store::{ParamStore, F32};
use crate::LayerRun;
use crate::ModelError;
use tch::Tensor;

/// `module.{i}` paths and (in, out) sizes, in forward order.
type Plan = &'static [(&'static str, i64, i64)];

const NESTED: Plan = &[
    ("module.0", 8, 4),
    ("module.1.0", 4, 16),
    ("module.1.1", 16, 16),
    ("module.2", 16, 4),
    ("module.3", 4, 8),
];

const MOE: Plan = &[
    ("module.0", 8, 12),
    ("module.1", 12, 23),
    ("module.2", 23, 12),
    ("module.3", 12, 8),
];

/// A chain of linears (no activations, as in PyTorch's test) fed `rand(4, 8)`.
#[derive(Debug)]
pub struct LinearChain {
    name: &'static str,
    rank: usize,
    seed: u64,
    plan: Plan,
    linears: Vec<Linear>,
    store: ParamStore,
    per_rank_expert: bool,
}

impl LinearChain {
    /// `NestedWrappedModule`: Linear(8,4) → [Linear(4,16) → Linear(16,16)] → Linear(16,4)
    /// → Linear(4,8), all drawn from the parameter seed in that order.
    pub fn nested(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        let mut store = ParamStore::default();
        let guard = seed::lock_seeded(seed::param_seed(run_seed));
        let mut linears = Vec::new();
        for (prefix, i, o) in NESTED {
            linears.push(Linear::new(&mut store, prefix, *i, *o, true)?);
        }
        drop(guard);
        Ok(LinearChain {
            name: "nested",
            rank,
            seed: run_seed,
            plan: NESTED,
            linears,
            store,
            per_rank_expert: false,
        })
    }

    /// `MixtureOfExperts`: Linear(8,12) → shared Linear(12,23) → expert Linear(23,12) →
    /// Linear(12,8). The expert is drawn from `42 + rank` (different on every rank), then
    /// the shared layer, then the outer linears, from the parameter seed: PyTorch's order.
    pub fn mixture_of_experts(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        let mut draws = ParamStore::default();
        let guard = seed::lock_seeded(seed::rank_param_seed(run_seed, rank));
        let expert = Linear::new(&mut draws, "module.2", 23, 12, true)?;
        guard.reseed(seed::param_seed(run_seed));
        let shared = Linear::new(&mut draws, "module.1", 12, 23, true)?;
        let first = Linear::new(&mut draws, "module.0", 8, 12, true)?;
        let last = Linear::new(&mut draws, "module.3", 12, 8, true)?;
        drop(guard);
        // Register in module order (names and state files follow the module, not the draws).
        let mut store = ParamStore::default();
        let linears = vec![first, shared, expert, last];
        for ((prefix, _, _), l) in MOE.iter().zip(&linears) {
            let _ = store.param(&path(prefix, "weight"), || Ok(l.weight.shallow_clone()))?;
            if let Some(b) = &l.bias {
                let _ = store.param(&path(prefix, "bias"), || Ok(b.shallow_clone()))?;
            }
        }
        for name in ["module.2.weight", "module.2.bias"] {
            store.tag_expert(name, 0);
            store.tag_rank_local(name);
        }
        Ok(LinearChain {
            name: "moe",
            rank,
            seed: run_seed,
            plan: MOE,
            linears,
            store,
            per_rank_expert: true,
        })
    }
}

impl Model for LinearChain {
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
        self.plan
            .iter()
            .map(|(prefix, _, _)| LayerSpec {
                name: (*prefix).to_owned(),
                kind: LayerKind::Linear,
                params: Linear::names(prefix, true),
            })
            .collect()
    }

    /// `rand(4, 8)` from the rank's batch seed (PyTorch's `get_input` at step 0).
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let x = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            Tensor::f_rand([4, 8], F32)
        })?;
        Ok(Batch {
            inputs: vec![x],
            target: None,
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// One layer per linear, input the hidden state.
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
                model: self.name.to_owned(),
                reason: "expected one input tensor".into(),
            })?
            .shallow_clone();
        for l in &self.linears {
            x = run.layer([x], |[x]| Ok(l.forward(&x)?))?;
        }
        Ok(x)
    }

    fn loss_reduction(&self) -> LossReduction {
        LossReduction::Sum
    }

    fn loss_of(&self, _batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        Ok(output.f_sum(output.kind())?)
    }

    fn single_device_reference_blocker(&self) -> Option<String> {
        self.per_rank_expert.then(|| {
            "its expert (module.2) is seeded per rank and never averaged, so no single \
             process holds every rank's model"
                .to_owned()
        })
    }
}
