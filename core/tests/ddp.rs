//! DDP against the references, and the checker catching DDP's classic bugs.

use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, Ddp, DdpFault, DdpOptions, MarkedReduction};
use lockstep_core::record::{RunRecord, RunSpec};
use lockstep_core::train::{single_device_reference, OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{compare, Comparison, Quantity, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::zoo;
use std::collections::HashSet;
use std::sync::Arc;
use tch::Tensor;

const STEPS: usize = 4;

fn config(ctx: &RankCtx, model: &str, config: &str, record_grads: bool) -> TrainConfig {
    TrainConfig {
        spec: RunSpec {
            model: model.into(),
            config: config.into(),
            world_size: ctx.world_size(),
            backend: "cpu".into(),
            dtype: "fp32".into(),
            steps: STEPS,
            seed: 0,
        },
        optimizer: OptimizerConfig::default(),
        data_ranks: vec![ctx.rank()],
        record_grads,
        probe: None,
    }
}

/// One DDP run of `model` on this rank.
fn ddp_run(ctx: &RankCtx, model: &str, opts: DdpOptions, record_grads: bool) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = config(ctx, model, "ddp", record_grads);
    train_ddp(m.as_ref(), ctx.group(), &cfg, opts).expect("ddp run")
}

fn reference(ctx: &RankCtx, model: &str, record_grads: bool) -> RunRecord {
    let m = zoo::build(model, 0, 0).expect("model");
    single_device_reference(
        m.as_ref(),
        ctx.world_size(),
        STEPS,
        OptimizerConfig::default(),
        record_grads,
    )
    .expect("reference")
}

fn fp32() -> TolerancePolicy {
    TolerancePolicy::dtype_table(DType::F32)
}

fn assert_passes(c: &Comparison) {
    assert!(c.passed, "{}", c.diagnosis.clone().unwrap_or_default());
}

#[test]
fn ddp_matches_single_device() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt", "gpt_moe"];
    let world_values: Vec<usize> = vec![1, 2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "ddp_matches_single_device",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let run = ddp_run(ctx, model, DdpOptions::default(), false);
                if ctx.rank() == 0 {
                    assert_passes(&compare(&run, &reference(ctx, model, false), &fp32()));
                }
            });
        },
    );
}

#[test]
fn ddp_is_bitwise_repeatable_whatever_the_buckets() {
    let cases: Vec<&str> = vec!["nested", "transformer", "moe", "transformer_bn"];
    crate::common::each_case(
        "ddp_is_bitwise_repeatable_whatever_the_buckets",
        cases,
        |&model: &&str| {
            lockstep_harness::run(4, |ctx| {
                let first = ddp_run(ctx, model, DdpOptions::default(), true);
                let again = ddp_run(ctx, model, DdpOptions::default(), true);
                // Tiny buckets and no overlap change only when and how often collectives run.
                let small = DdpOptions {
                    bucket_cap_bytes: 64,
                    overlap: false,
                    ..DdpOptions::default()
                };
                let rebucketed = ddp_run(ctx, model, small, true);
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                assert_passes(&compare(&again, &first, &bitwise));
                assert_passes(&compare(&rebucketed, &first, &bitwise));
            });
        },
    );
}

#[test]
fn buckets_respect_the_cap_and_reverse_order() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("nested", 0, ctx.rank()).expect("model");
        let opts = DdpOptions {
            bucket_cap_bytes: 200,
            ..DdpOptions::default()
        };
        let ddp = Ddp::new(m.as_ref(), ctx.group(), opts).expect("ddp");
        let buckets = ddp.buckets();
        assert!(buckets.len() > 1, "{buckets:?}");
        assert_eq!(
            buckets[0][0], "module.3.bias",
            "last parameter first: {buckets:?}"
        );
        let all: usize = buckets.iter().map(Vec::len).sum();
        assert_eq!(all, m.named_parameters().len());
    });
}

#[test]
fn overlap_launches_every_bucket_during_backward() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
        let opts = DdpOptions {
            bucket_cap_bytes: 4096,
            ..DdpOptions::default()
        };
        let mut ddp = Ddp::new(m.as_ref(), ctx.group(), opts).expect("ddp");
        let buckets = ddp.buckets().len();
        assert!(buckets > 2, "{buckets} buckets");
        let batch = m.input(ctx.rank(), 0).expect("batch");
        m.loss(&batch).expect("loss").backward();
        assert_eq!(
            ddp.launched_buckets(),
            buckets,
            "every bucket launched from a backward hook"
        );
        ddp.finish_gradients().expect("sync");
        assert_eq!(ddp.launched_buckets(), 0, "ready for the next step");
    });
}

// ------------------------------------------------------------------ planted bugs

fn first_failure(c: &Comparison) -> (Quantity, Option<usize>, Option<String>) {
    let f = c.first_failure.as_ref().expect("a failure point");
    (f.quantity, f.step, f.tensor.clone())
}

#[test]
fn planted_sum_instead_of_average_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let faulty = DdpOptions {
            fault: Some(DdpFault::SumInsteadOfAverage),
            ..DdpOptions::default()
        };
        let run = ddp_run(ctx, "nested", faulty, false);
        if ctx.rank() == 0 {
            let c = compare(&run, &reference(ctx, "nested", false), &fp32());
            assert!(!c.passed);
            // Without per-step gradients the culprit seen is a final parameter; step 0's loss
            // is computed before any update, so the doubled gradient shows first among the
            // scalars in the step-0 gradient norm, named after it.
            assert_eq!(first_failure(&c).0, Quantity::Params, "{:?}", c.diagnosis);
            let derived = c.derived_failure.as_ref().expect("a derived scalar");
            assert_eq!(
                (derived.quantity, derived.step),
                (Quantity::GradNorm, Some(0))
            );
            let ratio = run.grad_norms[0] / reference(ctx, "nested", false).grad_norms[0];
            assert!(
                (ratio - 2.0).abs() < 1e-4,
                "sum over 2 ranks doubles the norm: {ratio}"
            );
        }
    });
}

#[test]
fn planted_unreduced_parameter_is_named() {
    lockstep_harness::run(2, |ctx| {
        let faulty = DdpOptions {
            fault: Some(DdpFault::SkipParameter("module.1.0.weight".into())),
            ..DdpOptions::default()
        };
        let run = ddp_run(ctx, "nested", faulty, true);
        if ctx.rank() == 0 {
            let c = compare(&run, &reference(ctx, "nested", true), &fp32());
            assert!(!c.passed);
            let grads = c.steps[0]
                .grads
                .as_ref()
                .expect("step 0 gradients compared");
            let culprit = grads.first_failure.as_ref().and_then(|f| f.tensor.clone());
            assert_eq!(
                culprit.as_deref(),
                Some("module.1.0.weight"),
                "{:?}",
                c.diagnosis
            );
        }
    });
}

#[test]
fn planted_missing_buffer_broadcast_is_caught() {
    for (fault, should_pass) in [(None, true), (Some(DdpFault::NoBufferBroadcast), false)] {
        lockstep_harness::run(2, |ctx| {
            let m = zoo::build("transformer", 0, ctx.rank()).expect("model");
            if ctx.rank() == 1 {
                // A rank that loaded a stale buffer: only a broadcast from rank 0 repairs it.
                let bias = m
                    .named_buffers()
                    .into_iter()
                    .find(|(n, _)| n == "vocab_bias")
                    .expect("vocab_bias");
                let _ = bias.1.shallow_clone().fill_(2.0);
            }
            let opts = DdpOptions {
                fault: fault.clone(),
                ..DdpOptions::default()
            };
            let cfg = config(ctx, "transformer", "ddp", false);
            let run = train_ddp(m.as_ref(), ctx.group(), &cfg, opts).expect("ddp");
            if ctx.rank() == 0 {
                let c = compare(&run, &reference(ctx, "transformer", false), &fp32());
                assert_eq!(c.passed, should_pass, "fault {fault:?}: {:?}", c.diagnosis);
            }
        });
    }
}

#[test]
fn planted_expert_reduction_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let correct = ddp_run(ctx, "moe", DdpOptions::default(), false);
        let faulty = DdpOptions {
            fault: Some(DdpFault::ReduceExperts),
            ..DdpOptions::default()
        };
        let run = ddp_run(ctx, "moe", faulty, false);
        if ctx.rank() == 0 {
            let c = compare(&run, &correct, &fp32());
            assert!(!c.passed);
            let failing: Vec<&str> = c
                .param_summaries
                .iter()
                .filter(|p| !p.stats.passed)
                .map(|p| p.name.as_str())
                .collect();
            assert!(
                failing.iter().any(|n| n.starts_with("module.2.")),
                "{failing:?}"
            );
        }
    });
}

// ------------------------------------------------------------------ communication hook

#[test]
fn marked_parameters_are_also_reduced_in_their_group() {
    lockstep_harness::run(4, |ctx| {
        let mesh = ctx.mesh(&[("dp", 2), ("tp", 2)]).expect("mesh");
        let (dp, tp) = (mesh.group("dp").expect("dp"), mesh.group("tp").expect("tp"));
        let r = ctx.rank() as f64;
        let shared =
            Tensor::zeros([3], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let local =
            Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let hook = MarkedReduction::new().mark(tp.clone(), &["shared"]);
        let opts = DdpOptions {
            comm_hook: Some(Arc::new(hook)),
            ..DdpOptions::default()
        };
        let params = vec![
            ("shared".to_string(), shared.shallow_clone()),
            ("local".to_string(), local.shallow_clone()),
        ];
        let mut ddp =
            Ddp::from_parts(params, vec![], &HashSet::new(), dp.clone(), opts).expect("ddp");
        // d/dp of (r+1)·sum(p) is r+1 on every element.
        ((shared.sum(tch::Kind::Float) + local.sum(tch::Kind::Float)) * (r + 1.0)).backward();
        ddp.finish_gradients().expect("sync");
        // dp groups are {0,2} and {1,3}; tp groups {0,1} and {2,3}.
        let dp_avg = |rank: usize| match rank % 2 {
            0 => (1.0 + 3.0) / 2.0,
            _ => (2.0 + 4.0) / 2.0,
        };
        let local_expected = dp_avg(ctx.rank());
        let shared_expected = dp_avg(0) + dp_avg(1);
        assert_eq!(local.grad().double_value(&[0]), local_expected);
        assert_eq!(shared.grad().double_value(&[2]), shared_expected);
        let _ = (dp, tp);
    });
}

/// Collectives carry what they are for: a rank whose model differs fails DDP's construction
/// naming the tensor whose broadcast did not match, and two ranks that issue different
/// collectives (a gradient bucket against the loss average) are each told which tensors their
/// own call carried, not only `collective #N` and two shapes.
#[test]
fn collective_mismatches_name_the_tensors_their_calls_carried() {
    use lockstep_models::zoo::{Gpt, GptConfig};
    lockstep_harness::run(2, |ctx| {
        let ff_hidden = if ctx.rank() == 1 { 24 } else { 64 };
        let config = GptConfig {
            ff_hidden,
            ..GptConfig::ZOO
        };
        let model = Gpt::with_config(config, 0, ctx.rank(), false, 0.0).expect("model");
        let built = Ddp::new(&model, ctx.group(), DdpOptions::default());
        // The root sends; the receiver sees the mismatch.
        if ctx.rank() == 1 {
            let err = built
                .err()
                .expect("different models cannot start DDP")
                .to_string();
            assert!(
                err.contains("this rank's call carried rank 0's `layers.0.feed_forward.w1.weight`"),
                "{err}"
            );
        }
    });
    lockstep_harness::run(2, |ctx| {
        let group = ctx.group();
        let (label, result) = if ctx.rank() == 0 {
            let bucket = Tensor::zeros([16], (tch::Kind::Float, tch::Device::Cpu));
            let label = "DDP gradient bucket 0: `fc.weight`";
            let r = lockstep_core::comm::labelled(label, || {
                group.all_reduce(&bucket, lockstep_core::comm::ReduceOp::Avg)
            });
            (label, r)
        } else {
            let loss = Tensor::zeros([1], (tch::Kind::Double, tch::Device::Cpu));
            let label = "the step's loss, averaged over the ranks";
            let r = lockstep_core::comm::labelled(label, || {
                group.all_reduce(&loss, lockstep_core::comm::ReduceOp::Avg)
            });
            (label, r)
        };
        let err = result.expect_err("a mismatch").to_string();
        assert!(
            err.contains("collective #0")
                && err.contains(&format!("this rank's call carried {label}")),
            "{err}"
        );
    });
}
