//! Every rank checked: planted bugs that leave rank 0's numbers untouched (or touched late)
//! but make one rank's state differ from what another rank must hold bit for bit. Each is
//! caught after one step, by the cross-rank digest check, with a message naming the tensor,
//! the ranks and the step.

use lockstep::core::ddp::{Ddp, DdpOptions};
use lockstep::core::pipeline::{train_pipeline, PipelineFault, PipelineOptions};
use lockstep::core::tensor_parallel::{train_tensor_parallel, TpOptions};
use lockstep::core::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep::harness::RankCtx;
use lockstep::models::{zoo, LayerHooks, Model};
use lockstep::parity_test::ParityTest;
use lockstep::runner::{run_launched, zoo_builder, RunSettings, TrainFn};
use tch::Tensor;

/// DDP whose optimizer step, on rank 1 only, leaves `skipped` out: the classic "rank-local
/// parameter list" bug. Rank 0's record is exactly right.
struct SkipsOnRankOne {
    ddp: Ddp,
    rank: usize,
    skipped: String,
}

impl StepHooks for SkipsOnRankOne {
    fn before_forward(&mut self, step: usize) -> Result<(), TrainError> {
        self.ddp.before_forward(step)
    }
    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        self.ddp.layer_hooks()
    }
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        self.ddp.sync_gradients(grads)
    }
    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        if self.rank != 1 {
            return Ok(false);
        }
        let stepped: Vec<(String, Tensor)> = params
            .iter()
            .filter(|(name, _)| *name != self.skipped)
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        optimizer.step(&stepped)?;
        Ok(true)
    }
}

#[test]
fn a_rank_one_only_optimizer_bug_fails_a_one_step_test_naming_rank_one() {
    let outcome = ParityTest::new("cross_rank_rank_one_optimizer")
        .zoo("mlp")
        .custom_config("skips_on_rank1", |ctx, model, cfg| {
            let skipped = model.named_parameters()[0].0.clone();
            let ddp =
                Ddp::new(model, ctx.group(), DdpOptions::default()).map_err(|e| e.to_string())?;
            let mut hooks = SkipsOnRankOne {
                ddp,
                rank: ctx.rank(),
                skipped,
            };
            train(model, cfg, &mut hooks, Some(ctx.group().as_ref())).map_err(|e| e.to_string())
        })
        .world_sizes(&[2])
        .steps(1)
        .run()
        .expect("the parity test runs");
    assert!(!outcome.passed(), "{}", outcome.summary());
    let summary = outcome.summary();
    let first = zoo::build("mlp", 0, 0).expect("mlp").named_parameters()[0]
        .0
        .clone();
    assert!(summary.contains(&format!("`{first}`")), "{summary}");
    assert!(summary.contains("rank 1"), "{summary}");
    assert!(summary.contains("after step 0"), "{summary}");
}

/// Runs `train` at world `world` on zoo model `model` and returns the cross-rank verdict's
/// mismatch text (the launcher's comparison of every rank's digest).
fn cross_rank_mismatch(model: &str, world: usize, train: &TrainFn<'_>) -> Option<String> {
    let settings = RunSettings {
        steps: 1,
        ..RunSettings::default()
    };
    let record = run_launched(
        model,
        "planted",
        "fp32",
        world,
        &zoo_builder(model),
        train,
        &settings,
    )
    .expect("the run completes");
    let check = record.cross_rank.expect("every rank's digest was compared");
    assert!(check.compared > 0, "nothing was compared");
    check.mismatch.map(|m| m.to_string())
}

#[test]
fn tied_copies_that_drift_apart_across_pipeline_stages_are_caught() {
    let pipeline = |fault: Option<PipelineFault>| {
        move |ctx: &RankCtx, model: &dyn Model, cfg: &TrainConfig| {
            let opts = PipelineOptions {
                fault: fault.clone(),
                ..PipelineOptions::default()
            };
            train_pipeline(model, ctx.world(), cfg, &opts)
                .map(|run| run.record)
                .map_err(|e| e.to_string())
        }
    };
    assert_eq!(cross_rank_mismatch("gpt", 2, &pipeline(None)), None);
    let text = cross_rank_mismatch("gpt", 2, &pipeline(Some(PipelineFault::SkipTiedReduce)))
        .expect("the tied copies differ");
    let tied = zoo::build("gpt", 0, 0).expect("gpt").tags().shared;
    let names: Vec<String> = tied.iter().map(|g| g.canonical.clone()).collect();
    assert!(
        names.iter().any(|n| text.contains(&format!("`{n}`"))),
        "{text} names none of {names:?}"
    );
    assert!(
        text.contains("after step 0") && text.contains("rank 1"),
        "{text}"
    );
}

#[test]
fn a_tp_replicated_norm_that_differs_across_tp_ranks_is_caught() {
    let tp = |perturb: bool| {
        move |ctx: &RankCtx, model: &dyn Model, cfg: &TrainConfig| {
            if perturb && ctx.rank() == 1 {
                // One ULP on one element of a norm's weight: a rank built from another seed.
                let (_, norm) = model
                    .named_parameters()
                    .into_iter()
                    .find(|(n, _)| n.contains("norm") && n.ends_with("weight"))
                    .ok_or("gpt has no norm weight")?;
                tch::no_grad(|| {
                    let first = norm.view([-1]).narrow(0, 0, 1);
                    let bumped = Tensor::from_slice(&[f32::from_bits(
                        (first.double_value(&[0]) as f32).to_bits() + 1,
                    )]);
                    first.shallow_clone().copy_(&bumped);
                });
            }
            let opts = TpOptions {
                tp: 2,
                sequence_parallel: false,
                data_parallel: Default::default(),
                fault: None,
            };
            train_tensor_parallel(model, ctx.world(), cfg, &opts).map_err(|e| e.to_string())
        }
    };
    assert_eq!(cross_rank_mismatch("gpt", 2, &tp(false)), None);
    // Named at the norm as training starts: after step 0 the difference has spread into
    // tensors computed from it (on some CPUs `pos_embeddings.weight`, observed first).
    let text = cross_rank_mismatch("gpt", 2, &tp(true)).expect("the norms differ");
    assert!(text.contains("norm") && text.contains("rank 1"), "{text}");
    assert!(text.contains("as step 0 starts"), "{text}");
}
