//! FSDP under a mixed-precision policy against DDP under the same policy: units gathered in
//! bf16 / fp16 from fp32 shards, gradients reduced in the policy's reduce dtype, BatchNorm in
//! fp32 units of its own. The same casts of the same fp32 masters and the same rank-order
//! reduction make it bitwise equal to DDP's mixed precision, as in fp32.

use crate::common;

use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, DdpOptions};
use lockstep_core::fsdp::{
    train_fsdp, BackwardPrefetch, Fsdp, FsdpError, FsdpOptions, ShardingStrategy, WrapPolicy,
};
use lockstep_core::precision::{MixedPrecision, PrecisionError};
use lockstep_core::record::RunRecord;
use lockstep_core::train::TrainConfig;
use lockstep_harness::parity::{compare, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::zoo;
use tch::Kind;

const STEPS: usize = 3;

fn config(ctx: &RankCtx, model: &str, config: &str) -> TrainConfig {
    common::train_config(ctx, model, config, "bf16", STEPS)
}

fn ddp_run(ctx: &RankCtx, model: &str, mp: &MixedPrecision) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let opts = DdpOptions {
        mixed_precision: Some(*mp),
        ..DdpOptions::default()
    };
    train_ddp(m.as_ref(), ctx.group(), &config(ctx, model, "ddp"), opts).expect("ddp run")
}

fn fsdp_run(ctx: &RankCtx, model: &str, opts: FsdpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    train_fsdp(m.as_ref(), ctx.group(), &config(ctx, model, "fsdp"), opts).expect("fsdp run")
}

#[test]
fn fsdp_mixed_precision_matches_ddp_under_the_same_policy_bitwise() {
    let model_values: Vec<&str> = vec![
        "nested",
        "transformer",
        "mlp",
        "gpt",
        "transformer_bn",
        "moe",
        "gpt_moe",
    ];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "fsdp_mixed_precision_matches_ddp_under_the_same_policy_bitwise",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                for mp in [MixedPrecision::bf16(), MixedPrecision::fp16()] {
                    let ddp = ddp_run(ctx, model, &mp);
                    for (strategy, wrap) in [
                        (ShardingStrategy::FullShard, WrapPolicy::Root),
                        (ShardingStrategy::FullShard, WrapPolicy::PerLayer),
                        (ShardingStrategy::ShardGradOp, WrapPolicy::PerLayer),
                        (ShardingStrategy::NoShard, WrapPolicy::Root),
                    ] {
                        let opts = FsdpOptions {
                            strategy,
                            wrap: wrap.clone(),
                            backward_prefetch: BackwardPrefetch::Pre,
                            forward_prefetch: true,
                            mixed_precision: Some(mp),
                            ..FsdpOptions::default()
                        };
                        let run = fsdp_run(ctx, model, opts);
                        // BatchNorm's running statistics are per rank under FSDP (no buffer
                        // broadcast) and rank 0's under DDP: they agree on rank 0 only.
                        if model == "transformer_bn" && ctx.rank() != 0 {
                            continue;
                        }
                        let c = compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32));
                        assert!(
                            c.passed,
                            "{model} {} {strategy:?} {wrap:?}: {}",
                            mp.label(),
                            c.diagnosis.clone().unwrap_or_default()
                        );
                        assert!(run.losses.iter().all(|l| l.is_finite()));
                    }
                }
            });
        },
    );
}

/// The policy does something: a bf16 run is not the fp32 run, and the fp32 masters, the
/// optimizer's parameters and the recorded gradients stay fp32.
#[test]
fn mixed_precision_changes_the_numbers_not_the_masters() {
    lockstep_harness::run(2, |ctx| {
        let fp32 = fsdp_run(ctx, "gpt", FsdpOptions::default());
        let bf16 = fsdp_run(
            ctx,
            "gpt",
            FsdpOptions {
                mixed_precision: Some(MixedPrecision::bf16()),
                wrap: WrapPolicy::PerLayer,
                ..FsdpOptions::default()
            },
        );
        assert_ne!(fp32.losses, bf16.losses);
        for p in &bf16.params {
            assert_eq!(p.dtype, DType::F32, "{} is an fp32 master", p.name);
        }
        let m = zoo::build("transformer_bn", 0, ctx.rank()).expect("model");
        let opts = FsdpOptions {
            mixed_precision: Some(MixedPrecision::bf16()),
            ..FsdpOptions::default()
        };
        let fsdp = Fsdp::new(m.as_ref(), ctx.group(), opts).expect("fsdp");
        let units = fsdp.units();
        let bn: Vec<_> = units
            .iter()
            .filter(|(_, params)| params.iter().any(|p| p.starts_with("bn.")))
            .collect();
        assert_eq!(bn.len(), 1, "BatchNorm gets a unit of its own: {units:?}");
        assert!(bn[0].1.iter().all(|p| p.starts_with("bn.")), "{units:?}");
    });
}

#[test]
fn bad_policies_are_refused() {
    lockstep_harness::run(1, |ctx| {
        let m = zoo::build("nested", 0, 0).expect("model");
        let bad = MixedPrecision {
            reduce_dtype: Kind::Int,
            ..MixedPrecision::bf16()
        };
        let opts = FsdpOptions {
            mixed_precision: Some(bad),
            ..FsdpOptions::default()
        };
        match Fsdp::new(m.as_ref(), ctx.group(), opts) {
            Err(FsdpError::Precision(PrecisionError::NotFloating { field, .. })) => {
                assert_eq!(field, "reduce_dtype")
            }
            Err(other) => panic!("wrong error: {other}"),
            Ok(_) => panic!("an integer reduce dtype must be refused"),
        }
    });
}
