//! Your own model under test: a small regressor that is not part of Lockstep's zoo, trained
//! under Lockstep's DDP and FSDP (full shard, one unit per layer) and compared with one
//! process training on the same global batch.
//!
//! ```sh
//! cargo run --example user_model      # runs the parity test and prints the verdict
//! cargo nextest run --example user_model
//! ```

use lockstep::models::{
    seed, Batch, LayerHooks, LayerKind, LayerRun, LayerSpec, Model, ModelError, NoHooks, ParamStore,
};
use lockstep::parity_test::{ParityOutcome, ParityTest, ParityTestError, Reference};
use tch::{Kind, Tensor};

/// Features per sample, hidden width, samples per rank and step.
const IN: i64 = 8;
const HIDDEN: i64 = 32;
const BATCH: i64 = 4;

/// `fc2(norm(relu(fc1(x))))`, mean squared error against a target: a model a user brings.
/// Parameters live in a [`ParamStore`] under PyTorch's names, so records, reports and
/// checkpoints use the names the user's PyTorch code would.
pub struct Regressor {
    store: ParamStore,
    seed: u64,
    rank: usize,
    fc1: (Tensor, Tensor),
    norm: (Tensor, Tensor),
    fc2: (Tensor, Tensor),
}

impl Regressor {
    /// Every rank draws the same parameters from the run seed (as DDP's initial broadcast
    /// would make them anyway); `rank` is remembered only for the record.
    pub fn new(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        let mut store = ParamStore::default();
        let (fc1, norm, fc2) = seed::seeded(seed::param_seed(run_seed), || {
            let f = (Kind::Float, tch::Device::Cpu);
            (
                (
                    Tensor::randn([HIDDEN, IN], f) * 0.3,
                    Tensor::zeros([HIDDEN], f),
                ),
                (Tensor::ones([HIDDEN], f), Tensor::zeros([HIDDEN], f)),
                (Tensor::randn([1, HIDDEN], f) * 0.2, Tensor::zeros([1], f)),
            )
        });
        let mut reg = |name: &str, t: Tensor| store.register_parameter(name, t);
        let fc1 = (reg("fc1.weight", fc1.0), reg("fc1.bias", fc1.1));
        let norm = (reg("norm.weight", norm.0), reg("norm.bias", norm.1));
        let fc2 = (reg("fc2.weight", fc2.0), reg("fc2.bias", fc2.1));
        Ok(Regressor {
            store,
            seed: run_seed,
            rank,
            fc1,
            norm,
            fc2,
        })
    }
}

impl Model for Regressor {
    fn name(&self) -> &str {
        "regressor"
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

    /// The layers FSDP may wrap one by one (`fsdp.full_shard.per_layer`).
    fn layers(&self) -> Vec<LayerSpec> {
        let layer = |name: &str, kind| LayerSpec {
            name: name.into(),
            kind,
            params: vec![format!("{name}.weight"), format!("{name}.bias")],
        };
        vec![
            layer("fc1", LayerKind::Linear),
            layer("norm", LayerKind::LayerNorm),
            layer("fc2", LayerKind::Linear),
        ]
    }

    /// Rank `rank`'s batch at `step`: the same in every process that asks.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let (x, y) = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            let f = (Kind::Float, tch::Device::Cpu);
            (Tensor::randn([BATCH, IN], f), Tensor::randn([BATCH, 1], f))
        });
        Ok(Batch {
            inputs: vec![x],
            target: Some(y),
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    /// Per-layer FSDP gathers each layer's parameters just before it runs: the model says it
    /// calls the hooks around every layer of `layers()`, in order.
    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// `forward`, each layer of `layers()` run between its hooks (`LayerRun` counts them).
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let mut run = LayerRun::new(hooks);
        let x = batch.inputs[0].shallow_clone();
        let h = run.layer([x], |[x]| Ok(x.f_linear(&self.fc1.0, Some(&self.fc1.1))?))?;
        let h = h.f_relu()?;
        let h = run.layer([h], |[h]| {
            Ok(h.f_layer_norm(
                [HIDDEN],
                Some(&self.norm.0),
                Some(&self.norm.1),
                1e-5,
                false,
            )?)
        })?;
        run.layer([h], |[h]| Ok(h.f_linear(&self.fc2.0, Some(&self.fc2.1))?))
    }

    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        let target = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: "regressor".into(),
                reason: "no target".into(),
            })?;
        Ok(output.f_mse_loss(target, tch::Reduction::Mean)?)
    }
}

/// DDP and FSDP (one unit per layer) at world sizes 2 and 4, each against one process.
pub fn check_regressor(test: &str) -> Result<ParityOutcome, ParityTestError> {
    ParityTest::new(test)
        .model("regressor", Regressor::new)
        .config("ddp")
        .config("fsdp.full_shard.per_layer")
        .reference(Reference::Single)
        .world_sizes(&[2, 4])
        .steps(3)
        .run()
}

fn main() -> Result<(), ParityTestError> {
    let outcome = check_regressor("user_model_example")?;
    print!("{}", outcome.summary());
    outcome.assert_passed();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regressor_matches_single_device_under_ddp_and_fsdp() {
        let outcome = check_regressor("regressor_matches_single_device_under_ddp_and_fsdp")
            .expect("the parity test runs");
        outcome.assert_passed();
        // 2 configurations × 1 reference × 2 world sizes.
        assert_eq!(outcome.report.comparisons.len(), 4);
        assert!(outcome
            .files
            .json
            .ends_with("lockstep/regressor_matches_single_device_under_ddp_and_fsdp/report.json"));
        assert!(outcome.files.json.exists() && outcome.files.markdown.exists());
    }
}
