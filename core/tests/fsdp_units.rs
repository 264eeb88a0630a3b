//! FSDP's per-unit lifecycle: wrap policies (and the errors for wraps that cannot work),
//! per-layer gather / free / re-gather with every prefetch mode against DDP bitwise, the
//! full-parameter peak that per-layer resharding buys, hybrid shard on a 2-D mesh, CPU
//! offload, `summon_full_params`, and the planted FSDP bugs the checker must catch.

use crate::common;

use lockstep_core::comm::DType;
use lockstep_core::ddp::{train_ddp, DdpOptions};
use lockstep_core::fsdp::{
    hybrid_mesh, train_fsdp, train_fsdp_hybrid, BackwardPrefetch, Fsdp, FsdpError, FsdpFault,
    FsdpOptions, ShardingStrategy, WrapPolicy,
};
use lockstep_core::record::RunRecord;
use lockstep_core::train::{single_device_reference, train, OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{compare, Comparison, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, LayerKind, Model};
use tch::Tensor;

const STEPS: usize = 3;

fn config(ctx: &RankCtx, model: &str, config: &str) -> TrainConfig {
    common::train_config(ctx, model, config, "fp32", STEPS)
}

fn ddp_run(ctx: &RankCtx, model: &str) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    train_ddp(
        m.as_ref(),
        ctx.group(),
        &config(ctx, model, "ddp"),
        DdpOptions::default(),
    )
    .expect("ddp run")
}

/// Trains with FSDP through its hooks and returns the record and the wrapper.
fn fsdp_run(ctx: &RankCtx, model: &str, opts: FsdpOptions) -> (RunRecord, Fsdp) {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), opts).expect("fsdp");
    let cfg = config(ctx, model, "fsdp");
    let record = train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
    (record, fsdp)
}

fn per_layer(strategy: ShardingStrategy) -> FsdpOptions {
    FsdpOptions {
        strategy,
        wrap: WrapPolicy::PerLayer,
        ..FsdpOptions::default()
    }
}

fn assert_passes(c: &Comparison, what: &str) {
    assert!(
        c.passed,
        "{what}: {}",
        c.diagnosis.clone().unwrap_or_default()
    );
}

fn assert_caught(c: &Comparison, what: &str) {
    assert!(!c.passed, "{what}: a planted bug must fail parity");
}

#[test]
fn zoo_models_call_the_layer_hooks() {
    for name in zoo::names() {
        let m = zoo::build(name, 0, 0).expect("model");
        assert!(
            m.supports_layer_hooks(),
            "{name}: FSDP per-layer units need them"
        );
    }
}

/// Every per-layer mode is the same math as DDP: gathering, freeing, re-gathering and
/// prefetching move parameters, never change them.
#[test]
fn per_layer_units_match_ddp_bitwise_in_every_mode() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "per_layer_units_match_ddp_bitwise_in_every_mode",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let ddp = ddp_run(ctx, model);
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                for strategy in [ShardingStrategy::FullShard, ShardingStrategy::ShardGradOp] {
                    for backward_prefetch in [
                        BackwardPrefetch::None,
                        BackwardPrefetch::Pre,
                        BackwardPrefetch::Post,
                    ] {
                        for forward_prefetch in [false, true] {
                            let opts = FsdpOptions {
                                backward_prefetch,
                                forward_prefetch,
                                ..per_layer(strategy)
                            };
                            let (run, _) = fsdp_run(ctx, model, opts);
                            let what = format!(
                                "{model} {strategy:?} {backward_prefetch:?} fwd={forward_prefetch}"
                            );
                            assert_passes(&compare(&run, &ddp, &bitwise), &what);
                        }
                    }
                }
                let no_reshard = FsdpOptions {
                    reshard_after_forward: false,
                    ..per_layer(ShardingStrategy::FullShard)
                };
                let (run, _) = fsdp_run(ctx, model, no_reshard);
                assert_passes(&compare(&run, &ddp, &bitwise), "no reshard after forward");
            });
        },
    );
}

/// Collectives per step with one unit per layer: full shard gathers every unit in forward
/// and every non-root unit again in backward; shard-grad-op gathers once.
#[test]
fn per_layer_collectives_are_counted() {
    lockstep_harness::run(2, |ctx| {
        for (strategy, regather) in [
            (ShardingStrategy::FullShard, true),
            (ShardingStrategy::ShardGradOp, false),
        ] {
            let (_, fsdp) = fsdp_run(ctx, "gpt", per_layer(strategy));
            let units = fsdp.units();
            let n = units.len();
            assert_eq!(units[0].0, "root");
            let non_root = n - 1;
            let c = fsdp.collective_counts();
            let per_step = n + if regather { non_root } else { 0 };
            assert_eq!(
                c.param_all_gathers,
                per_step * STEPS + n,
                "{strategy:?}: {n} units ({non_root} re-gathered), plus one gather each for the record"
            );
            assert_eq!(c.grad_reduce_scatters, n * STEPS, "{strategy:?}");
            assert_eq!(c.record_grad_all_gathers, n * STEPS, "{strategy:?}");
            assert_eq!(c.grad_all_reduces, 0);
        }
    });
}

/// With full shard and reshard-after-forward, at most the root, the unit running and the one
/// prefetched are gathered at once: peak ≤ shard + root + the two largest other units
/// (`nested` has no root unit, so there it is the "shard plus two largest units").
#[test]
fn peak_full_parameters_stay_within_two_units() {
    let cases: Vec<&str> = vec!["nested", "gpt", "transformer"];
    crate::common::each_case(
        "peak_full_parameters_stay_within_two_units",
        cases,
        |&model: &&str| {
            lockstep_harness::run(2, |ctx| {
                for (backward_prefetch, forward_prefetch) in [
                    (BackwardPrefetch::None, false),
                    (BackwardPrefetch::Pre, true),
                    (BackwardPrefetch::Post, false),
                ] {
                    let opts = FsdpOptions {
                        backward_prefetch,
                        forward_prefetch,
                        ..per_layer(ShardingStrategy::FullShard)
                    };
                    let (_, fsdp) = fsdp_run(ctx, model, opts);
                    let units = fsdp.units();
                    let mut bytes = fsdp.unit_full_bytes();
                    let root = if units[0].0 == "root" {
                        bytes.remove(0)
                    } else {
                        0
                    };
                    bytes.sort_unstable_by(|a, b| b.cmp(a));
                    let two_largest: usize = bytes.iter().take(2).sum();
                    let memory = fsdp.memory_stats();
                    let peak = memory.full_param_bytes_peak as usize;
                    let shard = fsdp.shard_bytes();
                    assert_eq!(memory.shard_bytes as usize, shard);
                    assert!(
                shard + peak <= shard + root + two_largest,
                "{model} {backward_prefetch:?} fwd={forward_prefetch}: peak {peak} > root {root} + two largest units {two_largest}"
            );
                    assert!(
                peak < memory.model_param_bytes as usize,
                "{model}: per-layer resharding must keep fewer than all parameters gathered"
            );
                }
                // Shard-grad-op keeps every unit from forward to backward: the whole model.
                let m = zoo::build(model, 0, ctx.rank()).expect("model");
                let cfg = config(ctx, model, "fsdp.shard_grad_op.per_layer");
                let record = train_fsdp(
                    m.as_ref(),
                    ctx.group(),
                    &cfg,
                    per_layer(ShardingStrategy::ShardGradOp),
                )
                .expect("run");
                let memory = record.memory.expect("train_fsdp records rank 0's memory");
                assert_eq!(memory.full_param_bytes_peak, memory.model_param_bytes);
            });
        },
    );
}

#[test]
fn wrap_policies_plan_the_expected_units() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
        let names = |opts: FsdpOptions| {
            let fsdp = Fsdp::new(m.as_ref(), ctx.group(), opts).expect("fsdp");
            fsdp.units().into_iter().map(|(n, _)| n).collect::<Vec<_>>()
        };
        let blocks = FsdpOptions {
            wrap: WrapPolicy::ByKind(vec![LayerKind::DecoderBlock]),
            ..FsdpOptions::default()
        };
        assert_eq!(names(blocks), ["root", "layers.0", "layers.1"]);
        let explicit = FsdpOptions {
            wrap: WrapPolicy::Explicit(vec![vec!["layers.0".into(), "layers.1".into()]]),
            ..FsdpOptions::default()
        };
        assert_eq!(names(explicit), ["root", "layers.0+layers.1"]);
        // Size-based: consecutive layers until a unit holds at least this many parameters.
        let min = FsdpOptions {
            wrap: WrapPolicy::MinParams(1000),
            ..FsdpOptions::default()
        };
        let fsdp = Fsdp::new(m.as_ref(), ctx.group(), min).expect("fsdp");
        let sizes = fsdp.flat_numels();
        assert!(sizes.len() > 2, "{:?}", fsdp.units());
        for ((name, _), (numel, _)) in fsdp.units().iter().zip(&sizes).skip(1) {
            assert!(*numel >= 1000, "unit {name} has {numel} < 1000 parameters");
        }
    });
}

#[test]
fn wraps_that_cannot_work_are_rejected_by_name() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
        let explicit = |units: &[&[&str]]| FsdpOptions {
            wrap: WrapPolicy::Explicit(
                units
                    .iter()
                    .map(|u| u.iter().map(|s| s.to_string()).collect())
                    .collect(),
            ),
            ..FsdpOptions::default()
        };
        let err = |opts| match Fsdp::new(m.as_ref(), ctx.group(), opts) {
            Ok(_) => panic!("must be rejected"),
            Err(e) => e,
        };
        let e = err(explicit(&[&["layers.0"], &["layers.1", "layers.0"]]));
        assert!(
            matches!(&e, FsdpError::WrappedTwice { layer, .. } if layer == "layers.0"),
            "{e}"
        );
        assert!(e.to_string().contains("wrapped twice"), "{e}");
        let e = err(explicit(&[&["tok_embeddings"], &["output"]]));
        match &e {
            FsdpError::SharedAcrossUnits {
                param,
                first,
                second,
            } => {
                assert_eq!(param, "tok_embeddings.weight");
                assert_eq!(
                    (first.as_str(), second.as_str()),
                    ("tok_embeddings", "output")
                );
            }
            other => panic!("expected SharedAcrossUnits, got {other}"),
        }
        let e = err(explicit(&[&["layers.9"]]));
        assert!(
            e.to_string().contains("layers.9") && e.to_string().contains("layers.0"),
            "names the unknown layer and the known ones: {e}"
        );
        let hybrid = FsdpOptions {
            strategy: ShardingStrategy::HybridShard,
            ..FsdpOptions::default()
        };
        assert!(err(hybrid).to_string().contains("Fsdp::new_hybrid"));
        // Nothing was broken by the refusals: a valid wrap still trains like DDP.
        let ddp = ddp_run(ctx, "gpt");
        let (run, _) = fsdp_run(ctx, "gpt", explicit(&[&["layers.0"], &["layers.1"]]));
        assert_passes(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "explicit",
        );
    });
}

#[test]
fn a_world_that_does_not_fit_the_hybrid_mesh_is_named() {
    lockstep_harness::run(2, |ctx| {
        let e = hybrid_mesh(ctx.world(), 3)
            .err()
            .expect("2 ranks do not split into groups of 3");
        let text = e.to_string();
        assert!(
            text.contains("world size 2") && text.contains("3"),
            "{text}"
        );
    });
}

/// Hybrid shard reduces in two stages: within a shard group, then across replicas. Its sums
/// associate differently from DDP's rank-order all-reduce ((g0+g1)+(g2+g3) against
/// ((g0+g1)+g2)+g3), so it is compared under the fp32 dtype table, not bitwise; with a
/// single replica it is full shard, and bitwise again.
#[test]
fn hybrid_shard_matches_ddp() {
    let cases: Vec<&str> = vec!["nested", "gpt", "mlp"];
    crate::common::each_case("hybrid_shard_matches_ddp", cases, |&model: &&str| {
        lockstep_harness::run(4, |ctx| {
            let ddp = ddp_run(ctx, model);
            let m = zoo::build(model, 0, ctx.rank()).expect("model");
            let opts = FsdpOptions {
                strategy: ShardingStrategy::HybridShard,
                wrap: WrapPolicy::PerLayer,
                ..FsdpOptions::default()
            };
            let cfg = config(ctx, model, "fsdp.hybrid_shard");
            let run =
                train_fsdp_hybrid(m.as_ref(), ctx.world(), ctx.group(), 2, &cfg, opts.clone())
                    .expect("hybrid");
            assert_passes(
                &compare(&run, &ddp, &TolerancePolicy::dtype_table(DType::F32)),
                "hybrid 2x2 vs ddp",
            );
            if ctx.rank() == 0 {
                let single = zoo::build(model, 0, 0).expect("model");
                let reference = single_device_reference(
                    single.as_ref(),
                    4,
                    STEPS,
                    OptimizerConfig::default(),
                    true,
                )
                .expect("reference");
                assert_passes(
                    &compare(&run, &reference, &TolerancePolicy::dtype_table(DType::F32)),
                    "hybrid vs single",
                );
            }
            let m = zoo::build(model, 0, ctx.rank()).expect("model");
            let one_replica =
                train_fsdp_hybrid(m.as_ref(), ctx.world(), ctx.group(), 4, &cfg, opts)
                    .expect("hybrid 1x4");
            assert_passes(
                &compare(&one_replica, &ddp, &TolerancePolicy::bitwise(DType::F32)),
                "hybrid 1x4 vs ddp",
            );
            // Shards are half the model's (2 ranks per shard group), replicas all-reduce them.
            let m = zoo::build(model, 0, ctx.rank()).expect("model");
            let mesh = hybrid_mesh(ctx.world(), 2).expect("mesh");
            let opts = FsdpOptions {
                strategy: ShardingStrategy::HybridShard,
                ..FsdpOptions::default()
            };
            let mut fsdp = Fsdp::new_hybrid(m.as_ref(), &mesh, opts).expect("hybrid");
            train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
            let c = fsdp.collective_counts();
            assert_eq!(c.grad_reduce_scatters, STEPS);
            assert_eq!(c.replica_grad_all_reduces, STEPS);
            let (numel, padded) = fsdp.flat_numels()[0];
            assert!(padded >= numel && padded % 2 == 0);
            assert_eq!(fsdp.shard_bytes(), padded / 2 * 4);
        });
    });
}

/// Offloading the master shards to the CPU changes where they live, not the math. (This
/// machine has no GPU: the compute device is the CPU too, so the copies are same-device.)
#[test]
fn cpu_offload_is_identical_to_no_offload() {
    lockstep_harness::run(2, |ctx| {
        for model in ["gpt", "mlp"] {
            let (plain, _) = fsdp_run(ctx, model, per_layer(ShardingStrategy::FullShard));
            let offload = FsdpOptions {
                offload_params: true,
                ..per_layer(ShardingStrategy::FullShard)
            };
            let (run, fsdp) = fsdp_run(ctx, model, offload);
            assert!(fsdp
                .local_shards()
                .expect("shards")
                .iter()
                .all(|s| s.device() == tch::Device::Cpu));
            assert_passes(
                &compare(&run, &plain, &TolerancePolicy::bitwise(DType::F32)),
                model,
            );
        }
    });
}

#[test]
fn summon_full_params_shows_and_writes_back() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
        let mut fsdp = Fsdp::new(
            m.as_ref(),
            ctx.group(),
            per_layer(ShardingStrategy::FullShard),
        )
        .expect("fsdp");
        let cfg = config(ctx, "gpt", "fsdp");
        train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
        fsdp.reshard().expect("reshard");
        let before = fsdp.full_state_dict().expect("state");
        let seen = fsdp
            .summon_full_params(false, || {
                let seen: Vec<(String, Tensor)> = m
                    .named_parameters()
                    .into_iter()
                    .map(|(n, t)| (n, t.detach().copy()))
                    .collect();
                tch::no_grad(|| {
                    for (_, p) in m.named_parameters() {
                        let _ = p.shallow_clone().fill_(7.0);
                    }
                });
                seen
            })
            .expect("summon");
        assert!(!fsdp.is_unsharded(), "summoned units are freed again");
        for (name, t) in &seen {
            let (_, b) = before.iter().find(|(n, _)| n == name).expect(name);
            assert!(
                t.equal(b),
                "{name}: summoned values are the full parameters"
            );
        }
        let unchanged = fsdp.full_state_dict().expect("state");
        for ((name, a), (_, b)) in before.iter().zip(&unchanged) {
            assert!(a.equal(b), "{name}: without writeback nothing changes");
        }
        fsdp.summon_full_params(true, || {
            tch::no_grad(|| {
                for (_, p) in m.named_parameters() {
                    let _ = p.shallow_clone().fill_(7.0);
                }
            })
        })
        .expect("summon with writeback");
        for (name, t) in fsdp.full_state_dict().expect("state") {
            if !m.named_buffers().iter().any(|(b, _)| *b == name) {
                assert_eq!(t.min().double_value(&[]), 7.0, "{name} written back");
                assert_eq!(t.max().double_value(&[]), 7.0, "{name} written back");
            }
        }
    });
}

#[test]
fn planted_wrong_shard_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "nested");
        let opts = FsdpOptions {
            fault: Some(FsdpFault::ReduceScatterWrongShard),
            ..FsdpOptions::default()
        };
        let m = zoo::build("nested", 0, ctx.rank()).expect("model");
        let run = train_fsdp(
            m.as_ref(),
            ctx.group(),
            &config(ctx, "nested", "fsdp"),
            opts,
        )
        .expect("run");
        assert_caught(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "wrong shard",
        );
    });
}

#[test]
fn planted_missing_regather_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "gpt");
        let opts = FsdpOptions {
            fault: Some(FsdpFault::NoRegatherBeforeBackward),
            ..per_layer(ShardingStrategy::FullShard)
        };
        let (run, _) = fsdp_run(ctx, "gpt", opts);
        assert_caught(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "no re-gather",
        );
        let c = compare(&run, &ddp, &TolerancePolicy::dtype_table(DType::F32));
        assert_caught(&c, "no re-gather (fp32 table)");
    });
}

#[test]
fn planted_reduced_expert_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "moe");
        let opts = FsdpOptions {
            fault: Some(FsdpFault::ReduceIgnored),
            ..FsdpOptions::default()
        };
        let m = zoo::build("moe", 0, ctx.rank()).expect("model");
        let run =
            train_fsdp(m.as_ref(), ctx.group(), &config(ctx, "moe", "fsdp"), opts).expect("run");
        let c = compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32));
        assert_caught(&c, "reduced expert");
        // The averaged expert gradient is what differs; the shared layers' are still DDP's.
        let grad = |r: &RunRecord, name: &str| {
            let all = r.grads.as_ref().expect("grads recorded");
            let g = all[0].iter().find(|g| g.name == name).expect(name);
            g.values.clone()
        };
        assert_ne!(grad(&run, "module.2.weight"), grad(&ddp, "module.2.weight"));
        assert_eq!(grad(&run, "module.1.weight"), grad(&ddp, "module.1.weight"));
    });
}

/// A model that does not call the layer hooks still trains correctly with per-layer units:
/// every unit is gathered before forward (and nothing freed until backward is done).
#[test]
fn an_unhooked_forward_gathers_every_unit_first() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "gpt");
        let m = common::Unhooked(zoo::build("gpt", 0, ctx.rank()).expect("model"));
        assert!(!m.supports_layer_hooks());
        let mut fsdp =
            Fsdp::new(&m, ctx.group(), per_layer(ShardingStrategy::FullShard)).expect("fsdp");
        let run = train(
            &m,
            &config(ctx, "gpt", "fsdp"),
            &mut fsdp,
            Some(ctx.group().as_ref()),
        )
        .expect("run");
        assert_passes(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "unhooked per layer",
        );
        let units = fsdp.units().len();
        assert_eq!(
            fsdp.collective_counts().param_all_gathers,
            units * (STEPS + 1)
        );
    });
}
