//! FSDP (one root unit, flat parameter) against DDP and the single-device reference, and the
//! checker catching a planted FSDP bug.

use crate::common;

use lockstep::configs::{fsdp_configs, FsdpLayout};
use lockstep_core::comm::{DType, ReduceOp};
use lockstep_core::ddp::{train_ddp, train_ddp_hierarchical, DdpOptions};
use lockstep_core::fsdp::{
    hybrid_mesh, train_fsdp, train_fsdp_hybrid, Fsdp, FsdpCallCounts, FsdpFault, FsdpOptions,
    ShardingStrategy, WrapPolicy,
};
use lockstep_core::precision::MixedPrecision;
use lockstep_core::record::RunRecord;
use lockstep_core::train::{
    single_device_reference, train, OptimizerConfig, StepHooks, TrainConfig,
};
use lockstep_harness::parity::{compare, Comparison, Quantity, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::zoo;
use tch::Tensor;

const STEPS: usize = 4;

const STRATEGIES: [ShardingStrategy; 3] = [
    ShardingStrategy::FullShard,
    ShardingStrategy::ShardGradOp,
    ShardingStrategy::NoShard,
];

fn config(ctx: &RankCtx, model: &str, config: &str) -> TrainConfig {
    common::train_config(ctx, model, config, "fp32", STEPS)
}

fn ddp_run(ctx: &RankCtx, model: &str) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = config(ctx, model, "ddp");
    train_ddp(m.as_ref(), ctx.group(), &cfg, DdpOptions::default()).expect("ddp run")
}

fn fsdp_run(ctx: &RankCtx, model: &str, opts: FsdpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let name = match opts.strategy {
        ShardingStrategy::FullShard => "fsdp.full_shard",
        ShardingStrategy::ShardGradOp => "fsdp.shard_grad_op",
        ShardingStrategy::NoShard => "fsdp.no_shard",
        ShardingStrategy::HybridShard => "fsdp.hybrid_shard",
    };
    let cfg = config(ctx, model, name);
    train_fsdp(m.as_ref(), ctx.group(), &cfg, opts).expect("fsdp run")
}

fn strategy(strategy: ShardingStrategy) -> FsdpOptions {
    FsdpOptions {
        strategy,
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

/// Every strategy and wrap policy against DDP on every rank, bitwise: the reduce-scatter (Avg) of an element
/// is the same rank-order sum and single division as DDP's all-reduce, and SGD's update of an
/// element is the same elementwise arithmetic whether it runs on a shard or a full tensor.
#[test]
fn fsdp_matches_ddp_bitwise() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "fsdp_matches_ddp_bitwise",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let ddp = ddp_run(ctx, model);
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                for s in STRATEGIES {
                    for wrap in [WrapPolicy::Root, WrapPolicy::PerLayer] {
                        let opts = FsdpOptions {
                            wrap: wrap.clone(),
                            ..strategy(s)
                        };
                        let run = fsdp_run(ctx, model, opts);
                        let what = format!("{model} {s:?} {wrap:?}");
                        assert_passes(&compare(&run, &ddp, &bitwise), &what);
                    }
                }
            });
        },
    );
}

/// DDP averaging in hybrid shard's order: within the shard groups of `shard` ranks, then
/// across the replicas, on the same mesh hybrid shard uses.
fn hierarchical_ddp_run(ctx: &RankCtx, model: &str, shard: usize, opts: DdpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let mesh = hybrid_mesh(ctx.world(), shard).expect("mesh");
    let cfg = config(ctx, model, "ddp.hybrid");
    train_ddp_hierarchical(m.as_ref(), &mesh, ctx.group(), &cfg, opts).expect("ddp run")
}

fn hybrid_run(ctx: &RankCtx, model: &str, shard: usize, opts: FsdpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = config(ctx, model, "fsdp.hybrid_shard");
    train_fsdp_hybrid(m.as_ref(), ctx.world(), ctx.group(), shard, &cfg, opts).expect("hybrid")
}

/// Every hybrid-shard configuration of the matrix's FSDP table, at world 4 (2 replicas of 2),
/// against DDP whose reduction averages in hybrid shard's order, bit for bit: the CPU
/// backend's reduce-scatter and all-reduce share one kernel (rank-order sum, one division),
/// so averaging a bucket within the shard group and then across replicas computes every
/// element exactly as hybrid shard's reduce-scatter and replica all-reduce do. (Against flat
/// DDP the sums associate differently and the bits differ: `hybrid_shard_matches_ddp`.)
#[test]
fn hybrid_shard_matches_hierarchical_ddp_bitwise() {
    let cases: Vec<&str> = vec![
        "nested",
        "transformer",
        "transformer_bn",
        "mlp",
        "gpt",
        "moe",
    ];
    crate::common::each_case(
        "hybrid_shard_matches_hierarchical_ddp_bitwise",
        cases,
        |&model: &&str| {
            let world = 4;
            lockstep_harness::run(world, |ctx| {
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                let hybrids: Vec<_> = fsdp_configs()
                    .iter()
                    .filter(|f| matches!(f.layout, FsdpLayout::Hybrid { .. }))
                    .collect();
                assert!(hybrids.len() >= 2, "the table lost its hybrid rows");
                let shard = hybrids[0]
                    .layout
                    .shard_size(world)
                    .expect("fits")
                    .expect("hybrid");
                let ddp = hierarchical_ddp_run(ctx, model, shard, DdpOptions::default());
                // BatchNorm statistics are per rank under FSDP and rank 0's under DDP (which
                // broadcasts buffers), so `transformer_bn` agrees on rank 0, the rank the matrix
                // compares; every other model agrees on every rank.
                let judged = ctx.rank() == 0 || model != "transformer_bn";
                for f in hybrids {
                    assert_eq!(f.layout.shard_size(world), Ok(Some(shard)), "{}", f.name);
                    let run = hybrid_run(ctx, model, shard, f.options.clone());
                    if judged {
                        assert_passes(
                            &compare(&run, &ddp, &bitwise),
                            &format!("{model} {}", f.name),
                        );
                    }
                }
                // The order matters: flat DDP is not bitwise on the transformer (the motivating
                // case), which shows the comparison above can see a sum-order difference.
                if model == "transformer" {
                    let flat = ddp_run(ctx, model);
                    let run = hybrid_run(ctx, model, shard, hybrid_root());
                    assert!(!compare(&run, &flat, &bitwise).passed, "flat DDP bitwise?");
                }
            });
        },
    );
}

fn hybrid_root() -> FsdpOptions {
    FsdpOptions {
        strategy: ShardingStrategy::HybridShard,
        ..FsdpOptions::default()
    }
}

/// Other meshes: one replica per rank (shard groups of 1), one replica (shard = world), and
/// world 2 and 8, root and per-layer units, plus the bf16 policy (reduced in fp32 through
/// both stages); every one bitwise equal to hierarchical DDP on the same mesh.
#[test]
fn hybrid_shard_matches_hierarchical_ddp_on_every_mesh() {
    let model_values: Vec<&str> = vec!["nested", "transformer"];
    let mesh_values: Vec<(usize, usize)> = vec![(2, 1), (4, 1), (4, 4), (8, 2), (8, 4)];
    let cases: Vec<(&str, (usize, usize))> = crate::common::product(&model_values, &mesh_values);
    crate::common::each_case(
        "hybrid_shard_matches_hierarchical_ddp_on_every_mesh",
        cases,
        |&(model, mesh): &(&str, (usize, usize))| {
            let (world, shard) = mesh;
            lockstep_harness::run(world, |ctx| {
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                let ddp = hierarchical_ddp_run(ctx, model, shard, DdpOptions::default());
                for wrap in [WrapPolicy::Root, WrapPolicy::PerLayer] {
                    let opts = FsdpOptions {
                        wrap: wrap.clone(),
                        ..hybrid_root()
                    };
                    let run = hybrid_run(ctx, model, shard, opts);
                    let what = format!("{model} world {world} shard {shard} {wrap:?}");
                    assert_passes(&compare(&run, &ddp, &bitwise), &what);
                }
                if world == 4 {
                    let bf16 = MixedPrecision::bf16();
                    let ddp = hierarchical_ddp_run(
                        ctx,
                        model,
                        shard,
                        DdpOptions {
                            mixed_precision: Some(bf16),
                            ..DdpOptions::default()
                        },
                    );
                    let opts = FsdpOptions {
                        mixed_precision: Some(bf16),
                        wrap: WrapPolicy::PerLayer,
                        ..hybrid_root()
                    };
                    let run = hybrid_run(ctx, model, shard, opts);
                    assert_passes(&compare(&run, &ddp, &bitwise), &format!("{model} bf16"));
                }
            });
        },
    );
}

#[test]
fn fsdp_matches_single_device() {
    let cases: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt"];
    crate::common::each_case("fsdp_matches_single_device", cases, |&model: &&str| {
        lockstep_harness::run(2, |ctx| {
            let run = fsdp_run(ctx, model, FsdpOptions::default());
            if ctx.rank() == 0 {
                let m = zoo::build(model, 0, 0).expect("model");
                let reference = single_device_reference(
                    m.as_ref(),
                    ctx.world_size(),
                    STEPS,
                    OptimizerConfig::default(),
                    true,
                )
                .expect("reference");
                let fp32 = TolerancePolicy::dtype_table(DType::F32);
                assert_passes(&compare(&run, &reference, &fp32), model);
            }
        });
    });
}

#[test]
fn experts_are_ignored_and_stay_per_rank() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "moe");
        let run = fsdp_run(ctx, "moe", FsdpOptions::default());
        assert_passes(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "moe",
        );
        let m = zoo::build("moe", 0, ctx.rank()).expect("model");
        let fsdp = Fsdp::new(m.as_ref(), ctx.group(), FsdpOptions::default()).expect("fsdp");
        assert_eq!(
            fsdp.ignored_param_names(),
            vec!["module.2.weight".to_string(), "module.2.bias".to_string()]
        );
        assert!(fsdp
            .flat_param_names()
            .iter()
            .all(|n| !n.starts_with("module.2.")));
        let values = |name: &str| {
            let p = run.params.iter().find(|p| p.name == name).expect(name);
            Tensor::from_slice(&p.values)
        };
        // The trained expert differs per rank: gather every rank's checksum.
        let local = values("module.2.weight")
            .sum(tch::Kind::Double)
            .reshape([1]);
        let all = Tensor::zeros([2], (tch::Kind::Double, tch::Device::Cpu));
        ctx.group().all_gather(&all, &local).expect("gather");
        assert_ne!(all.double_value(&[0]), all.double_value(&[1]));
        // Averaged parameters are identical on both ranks.
        let shared = values("module.1.weight");
        let max = shared.copy();
        ctx.group().all_reduce(&max, ReduceOp::Max).expect("max");
        assert!(max.equal(&shared));
    });
}

#[test]
fn planted_sum_instead_of_average_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let ddp = ddp_run(ctx, "nested");
        let faulty = FsdpOptions {
            fault: Some(FsdpFault::SumInsteadOfAverage),
            ..FsdpOptions::default()
        };
        let run = fsdp_run(ctx, "nested", faulty);
        let c = compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32));
        assert!(!c.passed, "a doubled gradient must fail parity");
        let f = c.first_failure.as_ref().expect("a failure point");
        assert!(
            f.tensor.is_some(),
            "the culprit is a tensor: {:?}",
            c.diagnosis
        );
        // Step 0's loss is computed before any update; the doubled gradient shows first
        // among the scalars in the step-0 gradient norm, named after the tensor.
        let d = c.derived_failure.as_ref().expect("a derived scalar");
        assert_eq!((d.quantity, d.step), (Quantity::GradNorm, Some(0)));
        let ratio = run.grad_norms[0] / ddp.grad_norms[0];
        assert!((ratio - 2.0).abs() < 1e-4, "sum over 2 ranks: {ratio}");
    });
}

#[test]
fn full_parameters_live_only_between_unshard_and_reshard() {
    lockstep_harness::run(4, |ctx| {
        for s in STRATEGIES {
            // mlp's sizes do not divide by 4: the flat parameter is padded.
            let m = zoo::build("mlp", 0, ctx.rank()).expect("model");
            let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), strategy(s)).expect("fsdp");
            let full: usize = m
                .named_parameters()
                .iter()
                .map(|(_, t)| t.numel() * 4)
                .sum();
            let numels = fsdp.flat_numels();
            assert_eq!(numels.len(), 1, "one root unit");
            let (numel, padded) = numels[0];
            assert_eq!(numel * 4, full);
            let shards = if s == ShardingStrategy::NoShard { 1 } else { 4 };
            assert_eq!(padded % shards, 0);
            assert!(padded - numel < shards);
            assert_eq!(fsdp.shard_bytes(), padded / shards * 4, "{s:?}");
            let sharded = s != ShardingStrategy::NoShard;
            assert_eq!(fsdp.is_unsharded(), !sharded, "{s:?} after construction");
            assert_eq!(fsdp.full_param_bytes(), if sharded { 0 } else { full });
            fsdp.before_forward(0).expect("unshard");
            assert_eq!(fsdp.full_param_bytes(), full);
            let batch = m.input(ctx.rank(), 0).expect("batch");
            m.loss_hooked(&batch, &mut fsdp).expect("loss").backward();
            let grads: Vec<(String, Tensor)> = m
                .named_parameters()
                .into_iter()
                .map(|(n, t)| (n, t.grad()))
                .collect();
            fsdp.sync_gradients(&grads).expect("reduce");
            assert_eq!(fsdp.full_param_bytes(), if sharded { 0 } else { full });
            assert_eq!(fsdp.full_param_bytes_peak(), full);
            fsdp.before_record().expect("unshard for the record");
            assert!(fsdp.is_unsharded());
        }
    });
}

#[test]
fn collectives_per_step_are_counted() {
    lockstep_harness::run(2, |ctx| {
        for s in STRATEGIES {
            let m = zoo::build("nested", 0, ctx.rank()).expect("model");
            let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), strategy(s)).expect("fsdp");
            let cfg = config(ctx, "nested", "fsdp");
            train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
            let sharded = s != ShardingStrategy::NoShard;
            let per_step = usize::from(sharded);
            let expected = FsdpCallCounts {
                // One per forward, one more to rebuild full parameters for the record.
                param_all_gathers: per_step * (STEPS + 1),
                grad_reduce_scatters: per_step * STEPS,
                grad_all_reduces: usize::from(!sharded) * STEPS,
                record_grad_all_gathers: per_step * STEPS,
                replica_grad_all_reduces: 0,
            };
            assert_eq!(fsdp.collective_counts(), expected, "{s:?}");
        }
    });
}

/// The optimizer state lives on the shard: Adam's per-element state gives DDP's result too.
#[test]
fn adam_on_the_shard_matches_ddp_bitwise() {
    lockstep_harness::run(4, |ctx| {
        let mut cfg = config(ctx, "mlp", "ddp");
        cfg.optimizer = OptimizerConfig::adam(0.01);
        let m = zoo::build("mlp", 0, ctx.rank()).expect("model");
        let ddp = train_ddp(m.as_ref(), ctx.group(), &cfg, DdpOptions::default()).expect("ddp");
        let m = zoo::build("mlp", 0, ctx.rank()).expect("model");
        cfg.spec.config = "fsdp.full_shard".into();
        let run = train_fsdp(m.as_ref(), ctx.group(), &cfg, FsdpOptions::default()).expect("fsdp");
        assert_passes(
            &compare(&run, &ddp, &TolerancePolicy::bitwise(DType::F32)),
            "adam",
        );
    });
}

#[test]
fn dropping_a_resharded_wrapper_leaves_readable_nan_parameters() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("nested", 0, ctx.rank()).expect("model");
        let fsdp = Fsdp::new(m.as_ref(), ctx.group(), FsdpOptions::default()).expect("fsdp");
        assert!(!fsdp.is_unsharded());
        drop(fsdp);
        for (name, p) in m.named_parameters() {
            assert!(
                p.isnan().all().int64_value(&[]) == 1,
                "{name} refilled with NaN"
            );
        }
    });
}

#[test]
fn per_layer_units_keep_tied_parameters_in_the_root() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("transformer", 0, ctx.rank()).expect("model");
        let opts = FsdpOptions {
            wrap: WrapPolicy::PerLayer,
            ..FsdpOptions::default()
        };
        let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), opts).expect("fsdp");
        let units = fsdp.units();
        assert_eq!(units[0].0, "root");
        assert!(
            units[0].1.contains(&"embed_tokens.weight".to_string()),
            "the tied embedding / output projection is used by two layers: {units:?}"
        );
        assert!(units.len() > 4, "{units:?}");
        // Every parameter in exactly one unit.
        let mut names = fsdp.flat_param_names();
        let total = names.len();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), total);
        assert_eq!(total, m.named_parameters().len());
        for (numel, padded) in fsdp.flat_numels() {
            assert_eq!(padded % 2, 0);
            assert!(padded - numel < 2);
        }
        // Per step: one all-gather per unit in forward and one per non-root unit to re-gather
        // it for backward; one more per unit for the record. One reduce-scatter and record
        // gather per unit and step.
        let cfg = config(ctx, "transformer", "fsdp.full_shard");
        train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
        let n = units.len();
        let c = fsdp.collective_counts();
        assert_eq!(c.param_all_gathers, (2 * n - 1) * STEPS + n);
        assert_eq!(c.grad_reduce_scatters, n * STEPS);
        assert_eq!(c.record_grad_all_gathers, n * STEPS);
    });
}
