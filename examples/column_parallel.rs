//! Your own parallel code under test: a tensor-parallel MLP written by hand (the first
//! linear split by output columns, the second by input rows, one all-reduce joining the
//! partial sums, as Megatron's column/row-parallel pair), checked against one process
//! training the plain MLP. The same code with a planted bug — the second layer's bias added
//! on every rank *before* the all-reduce, so it is counted once per rank — shows the failure
//! a user sees.
//!
//! ```sh
//! cargo run --example column_parallel      # prints both verdicts
//! cargo nextest run --example column_parallel
//! ```

use lockstep::core::autograd::collectives::reduce_from_parallel;
use lockstep::core::record::{NamedTensor, RunRecord};
use lockstep::core::tensor_parallel::unshard;
use lockstep::core::train::TrainConfig;
use lockstep::harness::RankCtx;
use lockstep::models::{seed, Batch, LayerKind, LayerSpec, Model, ModelError, ParamStore};
use lockstep::parity_test::{
    ParityOutcome, ParitySensitivity, ParityTest, ParityTestError, Reference,
};
use lockstep::sensitivity::SensitivityOptions;
use tch::{Kind, Tensor};

const IN: i64 = 8;
const HIDDEN: i64 = 16;
const OUT: i64 = 4;
const BATCH: i64 = 4;

/// `fc2(gelu(fc1(x)))` with an MSE loss: the single-device twin of the parallel version.
pub struct Mlp {
    store: ParamStore,
    seed: u64,
    rank: usize,
}

impl Mlp {
    /// Parameters from the run seed only: every rank and the reference hold the same ones.
    pub fn new(run_seed: u64, rank: usize) -> Result<Self, ModelError> {
        let mut store = ParamStore::default();
        let f = (Kind::Float, tch::Device::Cpu);
        let drawn = seed::seeded(seed::param_seed(run_seed), || {
            [
                ("fc1.weight", Tensor::randn([HIDDEN, IN], f) * 0.3),
                ("fc1.bias", Tensor::randn([HIDDEN], f) * 0.1),
                ("fc2.weight", Tensor::randn([OUT, HIDDEN], f) * 0.3),
                ("fc2.bias", Tensor::randn([OUT], f) * 0.1),
            ]
        });
        for (name, t) in drawn {
            let _handle = store.register_parameter(name, t);
        }
        Ok(Mlp {
            store,
            seed: run_seed,
            rank,
        })
    }

    fn param(&self, name: &str) -> Result<Tensor, ModelError> {
        self.store
            .get(name)
            .ok_or_else(|| ModelError::InvalidConfig {
                model: "mlp".into(),
                reason: format!("no parameter {name}"),
            })
    }
}

impl Model for Mlp {
    fn name(&self) -> &str {
        "mlp_twin"
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
        ["fc1", "fc2"]
            .map(|name| LayerSpec {
                name: name.into(),
                kind: LayerKind::Linear,
                params: vec![format!("{name}.weight"), format!("{name}.bias")],
            })
            .to_vec()
    }

    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let f = (Kind::Float, tch::Device::Cpu);
        let (x, y) = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            (
                Tensor::randn([BATCH, IN], f),
                Tensor::randn([BATCH, OUT], f),
            )
        });
        Ok(Batch {
            inputs: vec![x],
            target: Some(y),
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        let (w1, b1) = (self.param("fc1.weight")?, self.param("fc1.bias")?);
        let (w2, b2) = (self.param("fc2.weight")?, self.param("fc2.bias")?);
        let h = batch.inputs[0].f_linear(&w1, Some(&b1))?.f_gelu("none")?;
        Ok(h.f_linear(&w2, Some(&b2))?)
    }

    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        let target = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: "mlp".into(),
                reason: "no target".into(),
            })?;
        Ok(output.f_mse_loss(target, tch::Reduction::Mean)?)
    }
}

/// The user's tensor-parallel training of [`Mlp`] on every rank: each rank keeps a column
/// slice of `fc1` and the matching row slice of `fc2`, every rank sees the global batch
/// (each rank's batch in turn, as the reference does), and the run's record holds the full
/// parameters and gradients, gathered from the shards, under the twin's names.
/// `bias_before_reduce` plants the bug.
pub fn train_column_parallel(
    ctx: &RankCtx,
    model: &dyn Model,
    cfg: &TrainConfig,
    bias_before_reduce: bool,
) -> Result<RunRecord, String> {
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    let group = ctx.group();
    let (rank, world) = (ctx.rank() as i64, ctx.world_size() as i64);
    let slice = HIDDEN / world;
    let full = |name: &str| {
        model
            .store()
            .get(name)
            .ok_or_else(|| format!("no parameter {name}"))
    };
    // This rank's shards, as fresh leaves the optimizer steps.
    let leaf = |t: Tensor| t.detach().copy().set_requires_grad(true);
    let w1 = leaf(full("fc1.weight")?.narrow(0, rank * slice, slice));
    let b1 = leaf(full("fc1.bias")?.narrow(0, rank * slice, slice));
    let w2 = leaf(full("fc2.weight")?.narrow(1, rank * slice, slice));
    let b2 = leaf(full("fc2.bias")?);
    let params: Vec<(String, Tensor)> = [("fc1.weight", &w1), ("fc1.bias", &b1)]
        .into_iter()
        .chain([("fc2.weight", &w2), ("fc2.bias", &b2)])
        .map(|(n, t)| (n.to_owned(), t.shallow_clone()))
        .collect();
    // The dimension each parameter is split along (`None`: replicated).
    let split = [Some(0), Some(0), Some(1), None];
    let gather = |tensors: Vec<(String, Tensor)>| -> Result<Vec<NamedTensor>, String> {
        tensors
            .iter()
            .zip(split)
            .map(|((name, t), dim)| {
                let whole = match dim {
                    Some(d) => unshard(t, d, group.as_ref()).map_err(|e| fail(&e))?,
                    None => t.shallow_clone(),
                };
                NamedTensor::capture(name, &whole).map_err(|e| fail(&e))
            })
            .collect()
    };
    let mut optimizer = cfg.optimizer.build();
    let mut record = RunRecord::start(cfg.spec.clone(), cfg.record_grads);
    for step in 0..cfg.spec.steps {
        for (_, p) in &params {
            p.shallow_clone().zero_grad();
        }
        let mut total: Option<Tensor> = None;
        for data_rank in 0..ctx.world_size() {
            let batch = model.input(data_rank, step).map_err(|e| fail(&e))?;
            let h = batch.inputs[0].linear(&w1, Some(&b1)).gelu("none");
            let partial = h.linear::<&Tensor>(&w2, None);
            let out = if bias_before_reduce {
                reduce_from_parallel(&(partial + &b2), &group).map_err(|e| fail(&e))?
            } else {
                reduce_from_parallel(&partial, &group).map_err(|e| fail(&e))? + &b2
            };
            let target = batch.target.as_ref().ok_or("no target")?;
            let loss = out.mse_loss(target, tch::Reduction::Mean);
            total = Some(match total {
                Some(t) => t + loss,
                None => loss,
            });
        }
        let objective = total.ok_or("no batch")? / ctx.world_size() as f64;
        objective.backward();
        // Shard gradients are whole for their slice; `fc2.bias`'s is the same on every rank.
        let grads = gather(params.iter().map(|(n, p)| (n.clone(), p.grad())).collect())?;
        let norm: f64 = grads
            .iter()
            .flat_map(|g| g.values.iter())
            .map(|v| v * v)
            .sum::<f64>()
            .sqrt();
        record.losses.push(objective.double_value(&[]));
        record.grad_norms.push(norm);
        if let Some(all) = record.grads.as_mut() {
            all.push(grads);
        }
        optimizer.step(&params).map_err(|e| fail(&e))?;
    }
    record.params = gather(params)?;
    Ok(record)
}

/// The hand-written parallel MLP at world sizes 2 and 4 against one process.
pub fn check_column_parallel(
    test: &str,
    planted_bug: bool,
) -> Result<ParityOutcome, ParityTestError> {
    ParityTest::new(test)
        .model("mlp_twin", Mlp::new)
        .custom_config("my_column_parallel", move |ctx, model, cfg| {
            train_column_parallel(ctx, model, cfg, planted_bug)
        })
        .reference(Reference::Single)
        .world_sizes(&[2, 4])
        .steps(3)
        .run()
}

/// Proves the parity test above can fail: every collective call of the first two steps of
/// the hand-written TP at world size 2 is corrupted in turn (skip, double, zero, wrong peer,
/// permuted chunks, stale result), one fault per run, each run judged as `.run()` judges it.
pub fn column_parallel_sensitivity(test: &str) -> Result<ParitySensitivity, ParityTestError> {
    ParityTest::new(test)
        .model("mlp_twin", Mlp::new)
        .custom_config("my_column_parallel", |ctx, model, cfg| {
            train_column_parallel(ctx, model, cfg, false)
        })
        .reference(Reference::Single)
        .world_sizes(&[2])
        .steps(3)
        .sensitivity_with(&SensitivityOptions {
            site_steps: vec![0, 1],
            ..SensitivityOptions::math_changing()
        })
}

fn main() -> Result<(), ParityTestError> {
    let good = check_column_parallel("column_parallel_example", false)?;
    print!("{}", good.summary());
    let buggy = check_column_parallel("column_parallel_example_planted_bug", true)?;
    print!("\nwith the planted bug:\n{}", buggy.summary());
    let sensitivity = column_parallel_sensitivity("column_parallel_example_sensitivity")?;
    print!("\n{sensitivity}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_written_column_parallel_mlp_correct() {
        hand_written_column_parallel_mlp(false);
    }

    #[test]
    fn hand_written_column_parallel_mlp_bias_added_before_the_all_reduce() {
        hand_written_column_parallel_mlp(true);
    }

    fn hand_written_column_parallel_mlp(planted_bug: bool) {
        let name = format!("hand_written_column_parallel_mlp_{planted_bug}");
        let outcome = check_column_parallel(&name, planted_bug).expect("the parity test runs");
        if !planted_bug {
            outcome.assert_passed();
            return;
        }
        assert!(!outcome.passed(), "the planted bug went unnoticed");
        let summary = outcome.summary();
        // The bias is counted once per rank from the first forward on: every value is off
        // from step 0, at both world sizes. The diagnosis names the first tensor off as
        // backward computes them, the planted bias's own gradient, with its element, before
        // the loss it shows in.
        assert!(
            summary.contains("FAILED my_column_parallel@2 against single@2")
                && summary.contains("FAILED my_column_parallel@4 against single@4"),
            "{summary}"
        );
        assert!(
            summary.contains("first failure: gradient of `fc2.bias` at step 0, element [")
                && summary.contains("; then loss at step 0: "),
            "{summary}"
        );
    }

    /// Every math-changing fault at every collective call the hand-written TP makes is
    /// caught by its parity test: the forward all-reduce, and the gathers that build the
    /// record.
    #[test]
    fn every_math_changing_fault_is_caught() {
        let result =
            column_parallel_sensitivity("column_parallel_sensitivity").expect("the analysis runs");
        let table = result.to_string();
        let misses: Vec<String> = result
            .misses(true)
            .into_iter()
            .map(|(report, miss)| format!("{} {} {}", report.config, miss.site.site(), miss.fault))
            .collect();
        assert!(misses.is_empty(), "missed: {misses:?}\n{table}");
        assert!(
            table.contains("sensitivity of my_column_parallel@2"),
            "{table}"
        );
    }
}
