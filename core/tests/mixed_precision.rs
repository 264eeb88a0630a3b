//! DDP under a mixed-precision policy: bitwise repeatable; bitwise equal to the independent
//! mixed-precision reference, which catches a wrong half type, reduce dtype or half master
//! (and to plain DDP under an all-fp32 policy); close to fp32 DDP within the bf16 row of the
//! dtype table yet visibly not fp32; BatchNorm computed and kept in fp32; clear errors for
//! policies and models it cannot run.

use crate::common;

use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, Ddp, DdpError, DdpFault, DdpOptions};
use lockstep_core::mixed_reference::{mixed_precision_reference, HalfType};
use lockstep_core::precision::{
    cast_buffers, low_precision_params, CastInputs, Chain, MixedPrecision, PrecisionError,
};
use lockstep_core::record::{RunRecord, RunSpec};
use lockstep_core::train::{train, OptimizerConfig, StepHooks, TrainConfig, TrainError};
use lockstep_harness::parity::{
    compare, Comparison, Override, Quantity, Tolerance, TolerancePolicy,
};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, LayerHooks, LayerKind, LayerSpec, Model, ModelError};
use tch::{Kind, Tensor};

const STEPS: usize = 4;

fn config(ctx: &RankCtx, model: &str, mp: Option<&MixedPrecision>) -> TrainConfig {
    let (config, dtype) = match mp {
        Some(p) => (format!("ddp-{}", p.label()), format!("{}-mixed", p.label())),
        None => ("ddp".to_owned(), "fp32".to_owned()),
    };
    TrainConfig {
        spec: RunSpec {
            model: model.into(),
            config,
            world_size: ctx.world_size(),
            backend: "cpu".into(),
            dtype,
            steps: STEPS,
            seed: 0,
        },
        optimizer: OptimizerConfig::default(),
        data_ranks: vec![ctx.rank()],
        record_grads: true,
        probe: None,
    }
}

/// One DDP run of `model` on this rank, under `mp` when given.
fn ddp_run(ctx: &RankCtx, model: &str, mp: Option<MixedPrecision>) -> RunRecord {
    ddp_run_steps(ctx, model, mp, STEPS)
}

/// As [`ddp_run`], for `steps` steps.
fn ddp_run_steps(
    ctx: &RankCtx,
    model: &str,
    mp: Option<MixedPrecision>,
    steps: usize,
) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let mut cfg = config(ctx, model, mp.as_ref());
    cfg.spec.steps = steps;
    let opts = DdpOptions {
        mixed_precision: mp,
        ..DdpOptions::default()
    };
    train_ddp(m.as_ref(), ctx.group(), &cfg, opts).expect("ddp run")
}

fn assert_passes(c: &Comparison) {
    assert!(c.passed, "{}", c.diagnosis.clone().unwrap_or_default());
}

fn assert_finite(run: &RunRecord) {
    assert!(
        run.losses.iter().all(|l| l.is_finite()),
        "losses {:?}",
        run.losses
    );
    assert!(
        run.grad_norms.iter().all(|g| g.is_finite()),
        "grad norms {:?}",
        run.grad_norms
    );
}

/// Every recorded parameter and gradient is fp32: the optimizer and the record never see
/// the low-precision copies.
fn assert_all_fp32(run: &RunRecord) {
    for p in &run.params {
        assert_eq!(p.dtype, DType::F32, "parameter `{}`", p.name);
    }
    for step in run.grads.iter().flatten() {
        for g in step {
            assert_eq!(g.dtype, DType::F32, "gradient `{}`", g.name);
        }
    }
}

/// The (model, world size) cells the bf16 DDP tests run at world 2; each adds one at 4.
const BF16_CELLS_AT_2: &[(&str, usize)] = &[
    ("nested", 2),
    ("transformer", 2),
    ("transformer_bn", 2),
    ("mlp", 2),
    ("gpt", 2),
];

#[test]
fn ddp_bf16_is_bitwise_repeatable() {
    let cases: Vec<(&str, usize)> = [BF16_CELLS_AT_2, [("transformer", 4)].as_slice()].concat();
    crate::common::each_case(
        "ddp_bf16_is_bitwise_repeatable",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let first = ddp_run(ctx, model, Some(MixedPrecision::bf16()));
                let again = ddp_run(ctx, model, Some(MixedPrecision::bf16()));
                assert_finite(&first);
                assert_all_fp32(&first);
                assert_passes(&compare(
                    &again,
                    &first,
                    &TolerancePolicy::bitwise(DType::BF16),
                ));
            });
        },
    );
}

/// A policy whose `param_dtype` is fp32 runs every piece of the machinery (swap, casts,
/// buckets in `reduce_dtype`, fp32 write-back) with nothing to round: it must be plain DDP,
/// bit for bit.
#[test]
fn fp32_policy_is_bitwise_plain_ddp() {
    let cases: Vec<&str> = vec!["transformer_bn", "gpt"];
    crate::common::each_case(
        "fp32_policy_is_bitwise_plain_ddp",
        cases,
        |&model: &&str| {
            lockstep_harness::run(2, |ctx| {
                let fp32_policy = MixedPrecision {
                    param_dtype: Kind::Float,
                    ..MixedPrecision::bf16()
                };
                let policy_run = ddp_run(ctx, model, Some(fp32_policy));
                let plain = ddp_run(ctx, model, None);
                assert_passes(&compare(
                    &policy_run,
                    &plain,
                    &TolerancePolicy::bitwise(DType::F32),
                ));
            });
        },
    );
}

/// The independent reference ([`mixed_precision_reference`]): PyTorch's mixed-precision DDP
/// step spelled out rank by rank on one process, with its own casts (no policy code shared
/// with DDP). DDP under the preset must match it bit for bit, BatchNorm's running statistics
/// (rank 0's, broadcast before every forward) included: this pins every gradient and
/// parameter, which no tolerance against fp32 could (see
/// [`ddp_bf16_tracks_fp32_within_the_bf16_row`]).
fn reference(model: &str, world: usize, half: HalfType) -> RunRecord {
    let m = zoo::build(model, 0, 0).expect("model");
    mixed_precision_reference(
        m.as_ref(),
        half,
        world,
        STEPS,
        OptimizerConfig::default(),
        true,
    )
    .expect("mixed-precision reference")
}

#[test]
fn ddp_is_bitwise_the_independent_mixed_precision_reference() {
    let models = [
        ("nested", 2),
        ("transformer", 2),
        ("transformer_bn", 2),
        ("mlp", 2),
        ("gpt", 2),
        ("gpt_moe", 2),
        ("gpt", 4),
    ];
    let halves = [HalfType::Bf16, HalfType::Fp16];
    crate::common::each_case(
        "ddp_is_bitwise_the_independent_mixed_precision_reference",
        crate::common::product(&models, &halves),
        |&((model, world), half)| {
            let policy = match half {
                HalfType::Bf16 => MixedPrecision::bf16(),
                HalfType::Fp16 => MixedPrecision::fp16(),
            };
            lockstep_harness::run(world, |ctx| {
                let run = ddp_run(ctx, model, Some(policy));
                if ctx.rank() == 0 {
                    let expected = reference(model, world, half);
                    assert_passes(&compare(
                        &run,
                        &expected,
                        &TolerancePolicy::bitwise(DType::F32),
                    ));
                }
            });
        },
    );
}

/// The three mixed-precision bugs no row caught before the independent reference, each
/// planted in DDP: a preset computing in the other half type, gradients reduced in the
/// compute dtype, a master weight kept in half precision. Each fails bitwise against the
/// reference, naming the first tensor that differs.
#[test]
fn mixed_precision_bugs_fail_against_the_independent_reference() {
    let fault_values: Vec<DdpFault> = vec![
        DdpFault::ComputeInOtherHalf,
        DdpFault::ReduceInComputeDtype,
        DdpFault::HalfPrecisionMaster,
    ];
    let half_values: Vec<HalfType> = vec![HalfType::Bf16, HalfType::Fp16];
    let cases: Vec<(DdpFault, HalfType)> = crate::common::product(&fault_values, &half_values);
    crate::common::each_case(
        "mixed_precision_bugs_fail_against_the_independent_reference",
        cases,
        |(fault, half): &(DdpFault, HalfType)| {
            let (fault, half) = (fault.clone(), *half);
            let policy = match half {
                HalfType::Bf16 => MixedPrecision::bf16(),
                HalfType::Fp16 => MixedPrecision::fp16(),
            };
            lockstep_harness::run(2, |ctx| {
                let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
                let opts = DdpOptions {
                    mixed_precision: Some(policy),
                    fault: Some(fault.clone()),
                    ..DdpOptions::default()
                };
                let run = train_ddp(
                    m.as_ref(),
                    ctx.group(),
                    &config(ctx, "gpt", Some(&policy)),
                    opts,
                )
                .expect("ddp run");
                if ctx.rank() == 0 {
                    let c = compare(
                        &run,
                        &reference("gpt", 2, half),
                        &TolerancePolicy::bitwise(DType::F32),
                    );
                    assert!(!c.passed, "{fault:?} under {half:?} was not caught");
                    let first = c.first_failure.as_ref().expect("a first failure");
                    assert!(first.tensor.is_some(), "{fault:?}: {first:?}");
                }
            });
        },
    );
}

/// DDP-bf16 against fp32 DDP, judged by the bf16 row of the engine's dtype table.
///
/// What is judged: the loss and the gradient norm of every step, the series the engine
/// judges in the policy's scalar dtype (bf16 here, the precision the run computes them in).
/// Not judged here: final parameters and per-step gradients. Element by element, a bf16
/// backward has no error bound relative to each value (cross-entropy's `p − y` and sums with
/// cancellation: transformer gradients differ from fp32 by up to ~5 % of their largest
/// element at step 0), and a parameter's error after SGD is relative to its update, not to
/// its value; both are pinned bit for bit against the hand-rolled step instead.
///
/// Horizon: `STEPS` steps, except the transformers, compared over their first step only —
/// their fp32 training itself is unstable at PyTorch's lr 0.01 / momentum 0.9 with a summed
/// loss (loss 11 → 16 → 27 over the first steps, gradient norm ~100), which amplifies any
/// perturbation, fp32 reordering included; only the first step measures precision.
#[test]
fn ddp_bf16_tracks_fp32_within_the_bf16_row() {
    let cases: Vec<(&str, usize)> = [BF16_CELLS_AT_2, [("gpt", 4)].as_slice()].concat();
    crate::common::each_case(
        "ddp_bf16_tracks_fp32_within_the_bf16_row",
        cases,
        |&(model, world): &(&str, usize)| {
            let steps = if model.starts_with("transformer") {
                1
            } else {
                STEPS
            };
            lockstep_harness::run(world, |ctx| {
                let bf16 = ddp_run_steps(ctx, model, Some(MixedPrecision::bf16()), steps);
                let fp32 = ddp_run_steps(ctx, model, None, steps);
                if ctx.rank() != 0 {
                    return;
                }
                assert_finite(&bf16);
                let c = compare(&bf16, &fp32, &bf16_row(model, &bf16, world));
                assert!(c.losses.passed, "losses: {:?}", c.losses.first_failure);
                assert!(
                    c.grad_norms.passed,
                    "gradient norms: {:?}",
                    c.grad_norms.first_failure
                );
                let bitwise = compare(&bf16, &fp32, &TolerancePolicy::bitwise(DType::F32));
                assert!(!bitwise.passed, "bf16 policy changed nothing on `{model}`");
                assert_ne!(bf16.losses[0], fp32.losses[0], "step-0 loss identical");
            });
        },
    );
}

/// The bf16 row of the dtype table for losses and gradient norms, with the one recorded
/// exception: `nested`'s loss is `output.sum()` over 4×8 outputs that cancel (step-0 loss
/// ≈ 0.17 from terms of magnitude up to ~1), and a bf16 sum is accurate relative to the
/// magnitude of its terms, not to the sum. Its loss gets the bf16 rtol with
/// `atol = bf16 rtol × Σ|outputs|` (the fp32 model's step-0 outputs, averaged over ranks,
/// measured here rather than assumed).
fn bf16_row(model: &str, run: &RunRecord, world: usize) -> TolerancePolicy {
    let policy = TolerancePolicy::dtype_table(DType::BF16);
    if model != "nested" {
        return policy;
    }
    let bf16 = Tolerance::for_dtype(DType::BF16);
    let m = zoo::build(model, 0, 0).expect("model");
    let magnitude: f64 = (0..world)
        .map(|rank| {
            let batch = m.input(rank, 0).expect("batch");
            tch::no_grad(|| m.forward(&batch).expect("forward"))
                .abs()
                .sum(Kind::Double)
                .double_value(&[])
        })
        .sum::<f64>()
        / world as f64;
    let ov = Override::new(
        Tolerance::new(bf16.rtol, bf16.rtol * magnitude),
        &format!(
            "`nested` loss is output.sum() with cancellation: bf16 error is relative to \
             Σ|outputs| = {magnitude:.3} (measured), so atol = bf16 rtol × Σ|outputs|"
        ),
    )
    .expect("override")
    .only(&[Quantity::Loss]);
    policy.with_override(&run.spec.config, ov)
}

#[test]
fn ddp_fp16_runs_and_differs_from_fp32() {
    lockstep_harness::run(2, |ctx| {
        let fp16 = ddp_run(ctx, "transformer", Some(MixedPrecision::fp16()));
        let again = ddp_run(ctx, "transformer", Some(MixedPrecision::fp16()));
        let fp32 = ddp_run(ctx, "transformer", None);
        assert_finite(&fp16);
        assert_all_fp32(&fp16);
        assert_eq!(fp16.spec.config, "ddp-fp16");
        assert_passes(&compare(
            &again,
            &fp16,
            &TolerancePolicy::bitwise(DType::F16),
        ));
        let bitwise = compare(&fp16, &fp32, &TolerancePolicy::bitwise(DType::F32));
        assert!(!bitwise.passed, "fp16 policy changed nothing");
    });
}

// ------------------------------------------------------------------ BatchNorm in fp32

/// Records, per layer, the dtypes of the floating inputs the layer receives (after the
/// policy's casts) and, at the BatchNorm layer, the dtypes of two parameters.
struct Observer {
    layers: Vec<LayerSpec>,
    bn_weight: Tensor,
    embed: Tensor,
    inputs: Vec<(usize, Vec<Kind>)>,
    at_bn: Vec<(Kind, Kind)>,
}

impl LayerHooks for Observer {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let kinds = inputs
            .iter()
            .map(Tensor::kind)
            .filter(|k| matches!(k, Kind::Float | Kind::BFloat16 | Kind::Half))
            .collect();
        self.inputs.push((index, kinds));
        if self.layers[index].kind == LayerKind::BatchNorm {
            self.at_bn.push((self.bn_weight.kind(), self.embed.kind()));
        }
        Ok(inputs)
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }
}

/// DDP with an observer chained behind its own input casts, and the gradient dtypes seen
/// around its synchronization.
struct Observed {
    ddp: Ddp,
    hooks: Chain<CastInputs, Observer>,
    params: Vec<(String, Tensor)>,
    /// (name, dtype from backward, dtype after synchronization), every step.
    grads: Vec<(String, Kind, Kind)>,
}

impl StepHooks for Observed {
    fn before_forward(&mut self, step: usize) -> Result<(), TrainError> {
        self.ddp.before_forward(step)
    }

    fn layer_hooks(&mut self) -> Option<&mut dyn LayerHooks> {
        Some(&mut self.hooks)
    }

    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        let before: Vec<Kind> = grads.iter().map(|(_, g)| g.kind()).collect();
        self.ddp.sync_gradients(grads)?;
        for ((name, p), kind) in self.params.iter().zip(before) {
            self.grads.push((name.clone(), kind, p.grad().kind()));
        }
        Ok(())
    }
}

#[test]
fn batchnorm_is_computed_and_kept_in_fp32() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("transformer_bn", 0, ctx.rank()).expect("model");
        let policy = MixedPrecision::bf16();
        let low = low_precision_params(m.as_ref(), &policy);
        assert!(
            !low.contains("bn.weight") && !low.contains("bn.bias"),
            "{low:?}"
        );
        assert!(low.contains("embed_tokens.weight"), "{low:?}");
        let opts = DdpOptions {
            mixed_precision: Some(policy),
            ..DdpOptions::default()
        };
        let ddp = Ddp::new(m.as_ref(), ctx.group(), opts).expect("ddp");
        let cast = ddp.cast_inputs().expect("a policy has input casts").clone();
        let layers = m.layers();
        let bn = layers
            .iter()
            .position(|l| l.kind == LayerKind::BatchNorm)
            .expect("a BatchNorm layer");
        let param = |name: &str| {
            m.named_parameters()
                .into_iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| t)
                .expect(name)
        };
        let observer = Observer {
            layers: layers.clone(),
            bn_weight: param("bn.weight"),
            embed: param("embed_tokens.weight"),
            inputs: Vec::new(),
            at_bn: Vec::new(),
        };
        let mut observed = Observed {
            ddp,
            hooks: Chain(cast, observer),
            params: m.named_parameters(),
            grads: Vec::new(),
        };
        let cfg = config(ctx, "transformer_bn", Some(&policy));
        let run =
            train(m.as_ref(), &cfg, &mut observed, Some(ctx.group().as_ref())).expect("train");
        assert_finite(&run);
        assert_all_fp32(&run);

        let observer = &observed.hooks.1;
        assert_eq!(observer.at_bn.len(), STEPS, "BatchNorm ran once a step");
        for &(bn_weight, embed) in &observer.at_bn {
            assert_eq!(bn_weight, Kind::Float, "BatchNorm weight in forward");
            assert_eq!(
                embed,
                Kind::BFloat16,
                "embedding swapped to bf16 in forward"
            );
        }
        for (index, kinds) in &observer.inputs {
            let want = if *index == bn {
                Kind::Float
            } else {
                Kind::BFloat16
            };
            assert!(
                kinds.iter().all(|k| *k == want),
                "layer {} (`{}`) saw {kinds:?}, wants {want:?}",
                index,
                layers[*index].name
            );
        }
        assert!(
            observer
                .inputs
                .iter()
                .any(|(i, k)| *i == bn && !k.is_empty()),
            "the BatchNorm layer's input was seen"
        );
        for (name, from_backward, after_sync) in &observed.grads {
            let want = if name.starts_with("bn.") {
                Kind::Float
            } else {
                Kind::BFloat16
            };
            assert_eq!(*from_backward, want, "`{name}` gradient out of backward");
            assert_eq!(
                *after_sync,
                Kind::Float,
                "`{name}` gradient after the reduction"
            );
        }
        // BatchNorm's running statistics are fp32 buffers and stay so.
        for b in &run.buffers {
            if b.name.starts_with("bn.running") {
                assert_eq!(b.dtype, DType::F32, "{}", b.name);
            }
        }
    });
}

#[test]
fn buffers_follow_buffer_dtype_except_batchnorm() {
    let m = zoo::build("transformer_bn", 0, 0).expect("model");
    let policy = MixedPrecision {
        buffer_dtype: Kind::BFloat16,
        ..MixedPrecision::bf16()
    };
    let cast = cast_buffers(m.as_ref(), &policy).expect("cast");
    assert_eq!(
        cast,
        ["vocab_bias"],
        "only the float buffer outside BatchNorm"
    );
    let kind = |name: &str| {
        m.named_buffers()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.kind())
            .expect(name)
    };
    assert_eq!(kind("vocab_bias"), Kind::BFloat16);
    assert_eq!(
        kind("long_buffer"),
        Kind::Int64,
        "integer buffers untouched"
    );
    assert_eq!(kind("bn.running_mean"), Kind::Float);
    assert_eq!(kind("bn.num_batches_tracked"), Kind::Int64);
}

#[test]
fn ddp_reduces_low_precision_gradients_in_reduce_dtype() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("transformer_bn", 0, ctx.rank()).expect("model");
        let policy = MixedPrecision {
            reduce_dtype: Kind::BFloat16,
            ..MixedPrecision::bf16()
        };
        let opts = DdpOptions {
            mixed_precision: Some(policy),
            ..DdpOptions::default()
        };
        let ddp = Ddp::new(m.as_ref(), ctx.group(), opts).expect("ddp");
        let dtypes = ddp.bucket_dtypes();
        let buckets = ddp.buckets();
        for (names, kind) in buckets.iter().zip(&dtypes) {
            let bn = names.iter().any(|n| n.starts_with("bn."));
            let want = if bn { Kind::Float } else { Kind::BFloat16 };
            assert_eq!(*kind, want, "bucket {names:?}");
            assert!(
                names.iter().all(|n| n.starts_with("bn.") == bn),
                "a bucket holds one reduction dtype: {names:?}"
            );
        }
        assert!(dtypes.contains(&Kind::Float) && dtypes.contains(&Kind::BFloat16));
    });
}

// ------------------------------------------------------------------ refusals

#[test]
fn integer_policy_is_refused_naming_the_field() {
    lockstep_harness::run(2, |ctx| {
        for (field, policy) in [
            (
                "param_dtype",
                MixedPrecision {
                    param_dtype: Kind::Int64,
                    ..MixedPrecision::bf16()
                },
            ),
            (
                "reduce_dtype",
                MixedPrecision {
                    reduce_dtype: Kind::Int,
                    ..MixedPrecision::bf16()
                },
            ),
            (
                "buffer_dtype",
                MixedPrecision {
                    buffer_dtype: Kind::Uint8,
                    ..MixedPrecision::bf16()
                },
            ),
        ] {
            let m = zoo::build("nested", 0, ctx.rank()).expect("model");
            let cfg = config(ctx, "nested", Some(&policy));
            let opts = DdpOptions {
                mixed_precision: Some(policy),
                ..DdpOptions::default()
            };
            match train_ddp(m.as_ref(), ctx.group(), &cfg, opts) {
                Err(e @ DdpError::Precision(PrecisionError::NotFloating { field: f, .. })) => {
                    assert_eq!(f, field);
                    assert!(e.to_string().contains(field), "{e}");
                }
                other => panic!("{field}: expected a NotFloating error, got {other:?}"),
            }
        }
    });
}

#[test]
fn model_without_layer_hooks_is_refused() {
    lockstep_harness::run(2, |ctx| {
        let m = common::Unhooked(zoo::build("nested", 0, ctx.rank()).expect("model"));
        assert!(!m.supports_layer_hooks());
        let opts = DdpOptions {
            mixed_precision: Some(MixedPrecision::bf16()),
            ..DdpOptions::default()
        };
        match Ddp::new(&m, ctx.group(), opts) {
            Err(e @ DdpError::Precision(PrecisionError::LayerHooksUnsupported { .. })) => {
                assert!(e.to_string().contains("nested"), "{e}");
            }
            Err(other) => panic!("expected LayerHooksUnsupported, got {other}"),
            Ok(_) => panic!("expected LayerHooksUnsupported, got a DDP"),
        }
        // Nothing was touched: the model is still fp32.
        assert!(m
            .named_parameters()
            .iter()
            .all(|(_, p)| p.kind() == Kind::Float));
    });
}
