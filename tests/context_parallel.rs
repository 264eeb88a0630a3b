//! Context parallelism on the zoo decoders: ring attention and the all-gather dispatcher,
//! load-balanced and contiguous, at CP 2 and 4 (and CP 2 under data parallelism) against one
//! device by the fp64 arbiter; the single-device attention in the ring's merge order equal
//! to the plain one up to rounding; every planted bug caught; bad sizes refused before any
//! rank starts, naming what does not divide.

use crate::common;
use crate::judge;

use lockstep_core::compose::DataParallel;
use lockstep_core::context_parallel::{
    check_context_parallel, context_parallel_attention, ring_order_attention, shard_sequence,
    train_context_parallel, CpDispatcher, CpFault, CpOptions, SequenceLayout,
};
use lockstep_core::pipeline::PipelineFault;
use lockstep_core::record::RunRecord;
use lockstep_harness::parity::Comparison;
use lockstep_harness::RankCtx;
use lockstep_models::functional::causal_attention;
use lockstep_models::zoo;
use tch::{Device, Kind, Tensor};

const STEPS: usize = 3;

fn cp_run(ctx: &RankCtx, model: &str, opts: &CpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "cp", "fp32", STEPS);
    train_context_parallel(m.as_ref(), ctx.world(), &cfg, opts).expect("context-parallel run")
}

/// `run` judged against one process on `world` ranks' batches by the fp64 arbiter.
fn against_single(run: &RunRecord, model: &str, world: usize) -> Comparison {
    judge::judged_against_single(
        run,
        &|seed, rank| zoo::build(model, seed, rank),
        world,
        STEPS,
    )
}

/// `run` judged by the fp64 arbiter with `single.cpN` (one device, attention in the merge
/// order of a ring of `cp` ranks laid out as `layout`) as the envelope, around the single
/// device's float64 shadow: the matrix's edge from a ring row to `single.cpN`.
fn against_ring_ordered(
    run: &RunRecord,
    model: &str,
    world: usize,
    (cp, layout): (usize, SequenceLayout),
) -> Comparison {
    use lockstep_core::context_parallel::ring_ordered_reference;
    let built = zoo::build(model, 0, 0).expect("model");
    let ring_ordered = ring_ordered_reference(
        built.as_ref(),
        world,
        (cp, layout),
        STEPS,
        Default::default(),
        true,
    )
    .expect("single.cpN");
    judge::judged_within(
        run,
        &|seed, rank| zoo::build(model, seed, rank),
        world,
        STEPS,
        Some(ring_ordered),
    )
}

fn opts(cp: usize, dispatcher: CpDispatcher, layout: SequenceLayout) -> CpOptions {
    CpOptions {
        cp,
        tp: 1,
        ep: 1,
        dispatcher,
        layout,
        data_parallel: DataParallel::Replicate,
        fault: None,
    }
}

/// Every dispatcher and layout at CP 2 and 4 (CP 2 at world 4: two replicas) passes against
/// one device, on the dense decoder and the mixture of experts; FSDP over `dp × cp` is
/// bitwise the replicated run (the same elements reduced in the same order).
#[test]
fn context_parallel_runs_equal_one_device() {
    let model_values: Vec<&str> = vec!["gpt", "gpt_moe"];
    let dispatcher_values: Vec<CpDispatcher> = vec![CpDispatcher::Ring, CpDispatcher::AllGather];
    let layout_values: Vec<SequenceLayout> =
        vec![SequenceLayout::Balanced, SequenceLayout::Contiguous];
    let sizes_values: Vec<(usize, usize)> = vec![(2, 2), (4, 4), (2, 4)];
    let cases: Vec<(&str, CpDispatcher, SequenceLayout, (usize, usize))> = crate::common::product(
        &crate::common::product3(&model_values, &dispatcher_values, &layout_values),
        &sizes_values,
    )
    .into_iter()
    .map(|((model, dispatcher, layout), sizes)| (model, dispatcher, layout, sizes))
    .collect();
    crate::common::each_case(
        "context_parallel_runs_equal_one_device",
        cases,
        |&(model, dispatcher, layout, sizes): &(
            &str,
            CpDispatcher,
            SequenceLayout,
            (usize, usize),
        )| {
            let (cp, world) = sizes;
            lockstep_harness::run(world, |ctx| {
                let run = cp_run(ctx, model, &opts(cp, dispatcher, layout));
                if ctx.rank() == 0 {
                    let c = against_single(&run, model, world);
                    assert!(
                        c.passed,
                        "cp {cp} at world {world} {dispatcher:?} {layout:?} on {model}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// Each planted bug makes the run differ from one device; the dp/cp factor mix-up only on a
/// mesh where the two sizes differ (cp 2 × dp 4), and is invisible where they are equal.
#[test]
fn planted_context_parallel_bugs_are_caught() {
    let cases: Vec<(CpFault, CpDispatcher, usize)> = vec![
        (CpFault::LocalAttentionOnly, CpDispatcher::Ring, 2),
        (CpFault::LossNotReducedOverCp, CpDispatcher::Ring, 2),
        (CpFault::LabelsShiftedAfterSharding, CpDispatcher::Ring, 2),
        (CpFault::ChunksInRankOrder, CpDispatcher::Ring, 2),
        (CpFault::ChunksInRankOrder, CpDispatcher::AllGather, 2),
        (CpFault::MergeWithBlockMax, CpDispatcher::Ring, 2),
        (CpFault::GradsNotReducedOverCp, CpDispatcher::Ring, 2),
        (CpFault::PositionsFromShard, CpDispatcher::AllGather, 2),
        (CpFault::ScaledByDpSize, CpDispatcher::Ring, 8),
    ];
    crate::common::each_case(
        "planted_context_parallel_bugs_are_caught",
        cases,
        |&case: &(CpFault, CpDispatcher, usize)| {
            let (fault, dispatcher, world) = case;
            lockstep_harness::run(world, |ctx| {
                let o = CpOptions {
                    fault: Some(fault),
                    ..opts(2, dispatcher, SequenceLayout::Balanced)
                };
                let run = cp_run(ctx, "gpt", &o);
                if ctx.rank() == 0 {
                    let c = against_single(&run, "gpt", world);
                    assert!(!c.passed, "{fault:?} under {dispatcher:?} was not caught");
                    assert!(c.first_failure.is_some(), "{:?}", c.diagnosis);
                }
            });
        },
    );
}

/// A factor taken from the wrong mesh dimension is the right one when the two sizes are
/// equal: cp 2 × dp 2 passes with it, which is why the mesh must be the user's own.
#[test]
fn the_factor_mix_up_hides_where_cp_and_dp_are_equal() {
    lockstep_harness::run(4, |ctx| {
        let o = CpOptions {
            fault: Some(CpFault::ScaledByDpSize),
            ..CpOptions::ring(2)
        };
        let run = cp_run(ctx, "gpt", &o);
        if ctx.rank() == 0 {
            assert!(against_single(&run, "gpt", 4).passed);
        }
    });
}

/// The single-device attention in the ring's merge order is the plain causal attention up
/// to rounding, under both layouts and several CP sizes.
#[test]
fn ring_order_attention_is_causal_attention() {
    let layout_values: Vec<SequenceLayout> =
        vec![SequenceLayout::Balanced, SequenceLayout::Contiguous];
    let cp_values: Vec<usize> = vec![1, 2, 4];
    let cases: Vec<(SequenceLayout, usize)> = crate::common::product(&layout_values, &cp_values);
    crate::common::each_case(
        "ring_order_attention_is_causal_attention",
        cases,
        |&(layout, cp): &(SequenceLayout, usize)| {
            let (q, k, v) = lockstep_models::seed::seeded(3, || {
                let r = || Tensor::randn([2, 3, 16, 4], (Kind::Double, Device::Cpu));
                (r(), r(), r())
            });
            let plain = causal_attention(&q, &k, &v).expect("plain");
            let o = CpOptions {
                layout,
                ..CpOptions::ring(cp)
            };
            let ring = ring_order_attention(&q, &k, &v, &o).expect("ring order");
            let err = (&plain - &ring).abs().max().double_value(&[]);
            assert!(err < 1e-12, "{layout:?} cp {cp}: {err}");
        },
    );
}

/// `single.cpN`'s attention is the ring's, bit for bit, in fp32: each rank's output of ring
/// attention over the CP group equals its shard of the single device's attention computed in
/// the ring's merge order, under both layouts at CP 2 and 4 (what makes `single.cpN` the
/// order-matched reference; its rows are judged by the arbiter only because the weight
/// gradients are summed across ranks afterwards).
#[test]
fn ring_attention_is_bitwise_the_ring_ordered_reference() {
    let layout_values: Vec<SequenceLayout> =
        vec![SequenceLayout::Balanced, SequenceLayout::Contiguous];
    let cp_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(SequenceLayout, usize)> = crate::common::product(&layout_values, &cp_values);
    crate::common::each_case(
        "ring_attention_is_bitwise_the_ring_ordered_reference",
        cases,
        |&(layout, cp): &(SequenceLayout, usize)| {
            lockstep_harness::run(cp, |ctx| {
                let (q, k, v) = lockstep_models::seed::seeded(5, || {
                    let r = || Tensor::randn([2, 3, 32, 8], (Kind::Float, Device::Cpu));
                    (r(), r(), r())
                });
                let o = CpOptions {
                    layout,
                    ..CpOptions::ring(cp)
                };
                let shard =
                    |t: &Tensor| shard_sequence(t, 2, layout, ctx.rank(), cp).expect("shard");
                let ring = context_parallel_attention(
                    &shard(&q),
                    &shard(&k),
                    &shard(&v),
                    &ctx.group(),
                    ctx.rank(),
                    &o,
                )
                .expect("ring");
                let reference = shard(&ring_order_attention(&q, &k, &v, &o).expect("ring order"));
                let bits = |t: &Tensor| -> Vec<u32> {
                    Vec::<f32>::try_from(t.flatten(0, -1))
                        .expect("values")
                        .iter()
                        .map(|x| x.to_bits())
                        .collect()
                };
                assert_eq!(bits(&ring), bits(&reference), "{layout:?} cp {cp}");
            });
        },
    );
}

/// `single.cpN` as a ring row's envelope (the matrix's edge): correct rings pass against
/// it under both layouts, at CP 2 and 4, on the dense decoder and the mixture; the merge
/// taking the block's maximum and chunks put back in rank order are caught against it.
#[test]
fn ring_rows_are_judged_against_the_ring_ordered_reference() {
    let cases: Vec<(&str, Option<CpFault>, SequenceLayout, usize)> = vec![
        ("gpt", None, SequenceLayout::Balanced, 4),
        ("gpt_moe", None, SequenceLayout::Balanced, 2),
        ("gpt", None, SequenceLayout::Contiguous, 2),
        ("gpt_moe", None, SequenceLayout::Contiguous, 4),
        (
            "gpt",
            Some(CpFault::MergeWithBlockMax),
            SequenceLayout::Balanced,
            2,
        ),
        (
            "gpt",
            Some(CpFault::ChunksInRankOrder),
            SequenceLayout::Balanced,
            4,
        ),
    ];
    crate::common::each_case(
        "ring_rows_are_judged_against_the_ring_ordered_reference",
        cases,
        |&case: &(&str, Option<CpFault>, SequenceLayout, usize)| {
            let (model, fault, layout, cp) = case;
            lockstep_harness::run(cp, |ctx| {
                let o = CpOptions {
                    fault,
                    ..opts(cp, CpDispatcher::Ring, layout)
                };
                let run = cp_run(ctx, model, &o);
                if ctx.rank() == 0 {
                    let c = against_ring_ordered(&run, model, cp, (cp, layout));
                    assert_eq!(c.passed, fault.is_none(), "{case:?}: {:?}", c.diagnosis);
                }
            });
        },
    );
}

/// Sizes that cannot split are refused before any rank starts, naming the dimension and the
/// size; models whose attention does not go through the hooks, or that drop out, too.
#[test]
fn bad_sizes_and_models_are_refused_before_any_rank_starts() {
    let gpt = zoo::build("gpt", 0, 0).expect("model");
    let e = check_context_parallel(gpt.as_ref(), 6, &CpOptions::ring(4))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("context-parallel size 4 does not divide world size 6"),
        "{e}"
    );
    // The zoo decoder's 8 tokens do not cut into 2 × 8 = 16 chunks.
    let e = check_context_parallel(gpt.as_ref(), 8, &CpOptions::ring(8))
        .unwrap_err()
        .to_string();
    assert!(e.contains("8 tokens") && e.contains("16 chunks"), "{e}");
    let mlp = zoo::build("mlp", 0, 0).expect("model");
    let e = check_context_parallel(mlp.as_ref(), 2, &CpOptions::ring(2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not compute its attention"), "{e}");
    // No `single.cpN` either: its attention is the ring's.
    let e = lockstep_core::context_parallel::ring_ordered_reference(
        mlp.as_ref(),
        2,
        (2, SequenceLayout::Balanced),
        1,
        Default::default(),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("does not compute its attention"), "{e}");
    let dropout = zoo::build("gpt_dropout", 0, 0).expect("model");
    let e = check_context_parallel(dropout.as_ref(), 2, &CpOptions::ring(2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("dropout"), "{e}");
}

/// FSDP over `dp × cp` (torchtitan's sharding beside CP) is bitwise the replicated CP run at
/// worlds 2, 4 and 8: its reduce-scatter yields the all-reduce's elements.
#[test]
fn fsdp_over_dp_and_cp_is_bitwise_the_replicated_run() {
    let cases: Vec<usize> = vec![2, 4, 8];
    crate::common::each_case(
        "fsdp_over_dp_and_cp_is_bitwise_the_replicated_run",
        cases,
        |&world: &usize| {
            lockstep_harness::run(world, |ctx| {
                let replicated = cp_run(ctx, "gpt", &CpOptions::ring(2));
                let sharded = cp_run(
                    ctx,
                    "gpt",
                    &CpOptions {
                        data_parallel: DataParallel::Shard,
                        ..CpOptions::ring(2)
                    },
                );
                if ctx.rank() == 0 {
                    assert_eq!(replicated.losses, sharded.losses);
                    let bits = |r: &RunRecord| -> Vec<(String, Vec<u64>)> {
                        r.params
                            .iter()
                            .map(|p| {
                                (
                                    p.name.clone(),
                                    p.values.iter().map(|v| v.to_bits()).collect(),
                                )
                            })
                            .collect()
                    };
                    assert_eq!(bits(&replicated), bits(&sharded));
                }
            });
        },
    );
}

/// CP × TP (mesh `[dp, cp, tp]`): the model's own TP plan inside each sequence shard, on
/// both decoders, at world 4 (cp 2 × tp 2) and world 8 (two replicas, replicated and FSDP
/// over `dp × cp`), passes against one device; the loss reduced over TP but not CP
/// (torchtitan#3280, found at TP = 2, CP = 2) is caught there.
#[test]
fn context_and_tensor_parallel_together_equal_one_device() {
    let model_values: Vec<&str> = vec!["gpt", "gpt_moe"];
    let case_values: Vec<(usize, DataParallel)> = vec![
        (4, DataParallel::Replicate),
        (8, DataParallel::Replicate),
        (8, DataParallel::Shard),
    ];
    let cases: Vec<(&str, (usize, DataParallel))> =
        crate::common::product(&model_values, &case_values);
    crate::common::each_case(
        "context_and_tensor_parallel_together_equal_one_device",
        cases,
        |&(model, case): &(&str, (usize, DataParallel))| {
            let (world, data_parallel) = case;
            lockstep_harness::run(world, |ctx| {
                let o = CpOptions {
                    tp: 2,
                    data_parallel,
                    ..CpOptions::ring(2)
                };
                let run = cp_run(ctx, model, &o);
                if ctx.rank() == 0 {
                    let c = against_single(&run, model, world);
                    assert!(
                        c.passed,
                        "cp 2 × tp 2 at world {world} ({data_parallel:?}) on {model}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// torchtitan#3280 at the shape it was reported in: TP = 2 and CP = 2, the loss reduced over
/// the TP ranks only, is caught.
#[test]
fn the_loss_reduced_over_tp_but_not_cp_is_caught() {
    lockstep_harness::run(4, |ctx| {
        let o = CpOptions {
            tp: 2,
            fault: Some(CpFault::LossNotReducedOverCp),
            ..CpOptions::ring(2)
        };
        let run = cp_run(ctx, "gpt", &o);
        if ctx.rank() == 0 {
            let c = against_single(&run, "gpt", 4);
            assert!(
                !c.passed,
                "the loss missing its CP reduction was not caught"
            );
        }
    });
}

/// HSDP beside CP (mesh `[dp_replicate, dp_shard, cp(, tp)]`): each replica's parameters
/// one FSDP unit over `dp_shard × cp`, replicated across `dp_replicate`, passes against one
/// device at world 8 (and with TP 2 inside, world 16); gradients left unreduced over CP are
/// still caught there.
#[test]
fn hybrid_sharding_beside_context_parallelism_equals_one_device() {
    let cases: Vec<(usize, usize, Option<CpFault>)> = vec![
        (8, 1, None),
        (16, 2, None),
        (8, 1, Some(CpFault::GradsNotReducedOverCp)),
    ];
    crate::common::each_case(
        "hybrid_sharding_beside_context_parallelism_equals_one_device",
        cases,
        |&case: &(usize, usize, Option<CpFault>)| {
            let (world, tp, fault) = case;
            lockstep_harness::run(world, |ctx| {
                let o = CpOptions {
                    tp,
                    data_parallel: DataParallel::HybridShard { replicas: 2 },
                    fault,
                    ..CpOptions::ring(2)
                };
                let run = cp_run(ctx, "gpt", &o);
                if ctx.rank() == 0 {
                    let c = against_single(&run, "gpt", world);
                    assert_eq!(
                        c.passed,
                        fault.is_none(),
                        "HSDP × cp 2 × tp {tp} at world {world}, {fault:?}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// CP × EP (gpt_moe's experts spread over `ep` ranks borrowed from `dp × cp`, every
/// shard's tokens dispatched to them): at cp 2 × ep 2 (world 4, EP within a CP group, and
/// world 8, EP across replicas), with TP 2 inside (world 8), and under HSDP (world 8) it
/// passes against one device. Expert gradients scaled as EP alone scales them (not by the
/// CP size) are caught.
#[test]
fn context_and_expert_parallel_together_equal_one_device() {
    let cases: Vec<(usize, usize, usize, DataParallel, Option<CpFault>)> = vec![
        (4, 1, 2, DataParallel::Replicate, None),
        (8, 1, 4, DataParallel::Shard, None),
        (8, 2, 2, DataParallel::Shard, None),
        (8, 1, 2, DataParallel::HybridShard { replicas: 2 }, None),
        (
            4,
            1,
            2,
            DataParallel::Replicate,
            Some(CpFault::ExpertGradsNotScaledByCp),
        ),
    ];
    crate::common::each_case(
        "context_and_expert_parallel_together_equal_one_device",
        cases,
        |&case: &(usize, usize, usize, DataParallel, Option<CpFault>)| {
            let (world, tp, ep, data_parallel, fault) = case;
            lockstep_harness::run(world, |ctx| {
                let o = CpOptions {
                    tp,
                    ep,
                    data_parallel,
                    fault,
                    ..CpOptions::ring(2)
                };
                let run = cp_run(ctx, "gpt_moe", &o);
                if ctx.rank() == 0 {
                    let c = against_single(&run, "gpt_moe", world);
                    assert_eq!(
                c.passed,
                fault.is_none(),
                "cp 2 × tp {tp} × ep {ep} at world {world} ({data_parallel:?}), {fault:?}: {}",
                c.diagnosis.unwrap_or_default()
            );
                    if fault.is_some() {
                        let first = c.first_failure.expect("a first failing tensor");
                        let tensor = first.tensor.as_deref().unwrap_or_default();
                        assert!(tensor.contains(".experts."), "{first:?}");
                    }
                }
            });
        },
    );
}

/// EP beside CP is refused before any rank starts when it does not divide `dp × cp` or the
/// experts, naming the sizes.
#[test]
fn expert_sizes_that_do_not_fit_beside_cp_are_refused() {
    let moe = zoo::build("gpt_moe", 0, 0).expect("model");
    let with_ep = |ep: usize| CpOptions {
        ep,
        ..CpOptions::ring(2)
    };
    let e = check_context_parallel(moe.as_ref(), 2, &with_ep(4))
        .unwrap_err()
        .to_string();
    assert!(e.contains("ep=4 borrows from dp × cp = 1 × 2 ranks"), "{e}");
    let e = check_context_parallel(moe.as_ref(), 6, &with_ep(3))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("8 experts do not divide over an expert-parallel group of 3"),
        "{e}"
    );
    let gpt = zoo::build("gpt", 0, 0).expect("model");
    let e = check_context_parallel(gpt.as_ref(), 4, &with_ep(2))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no mixture-of-experts layer"), "{e}");
}

/// A pipeline case's mesh beside its 2 stages: context, tensor and data parallel sizes.
type CpTpDp = (usize, usize, usize);

/// A two-stage 1F1B pipeline whose stages are split over `cp` ranks (and `tp` inside them),
/// `dp` replicas of it, with `fault` planted in the stages' CP hooks.
fn pp_cp_run(
    ctx: &RankCtx,
    model: &str,
    (cp, tp, dp): (usize, usize, usize),
    fault: Option<CpFault>,
) -> RunRecord {
    use lockstep_core::pipeline::{train_pipeline_with, PipelineOptions, StageParallel};
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "pp_cp", "fp32", STEPS);
    let opts = PipelineOptions {
        data_parallel: dp,
        ..PipelineOptions::default()
    };
    let within = StageParallel {
        tp,
        cp,
        ep: 1,
        cp_fault: fault,
        data: DataParallel::Replicate,
    };
    train_pipeline_with(m.as_ref(), ctx.world(), &cfg, &opts, within)
        .expect("PP × CP run")
        .record
}

/// PP × CP: each stage's CP ranks hold a shard of every microbatch's sequences (ring
/// attention across them, global positions, each microbatch's loss the shard's share) and
/// pass their own shard's activations to the next stage's rank of the same CP coordinate.
/// It passes against one device at pp 2 × cp 2 (world 4), with two replicas (world 8) and
/// with TP 2 inside (world 8); attention on the local shard only and positions from the
/// shard, planted in the stages, are caught.
#[test]
fn pipelines_split_by_context_parallelism_equal_one_device() {
    let cases: Vec<(CpTpDp, Option<CpFault>, bool)> = vec![
        ((2, 1, 1), None, true),
        ((2, 1, 2), None, true),
        ((2, 2, 1), None, true),
        ((2, 1, 1), Some(CpFault::LocalAttentionOnly), false),
        ((2, 1, 1), Some(CpFault::PositionsFromShard), false),
    ];
    crate::common::each_case(
        "pipelines_split_by_context_parallelism_equal_one_device",
        cases,
        |&case: &(CpTpDp, Option<CpFault>, bool)| {
            let ((cp, tp, dp), fault, passes) = case;
            let world = 2 * cp * tp * dp;
            lockstep_harness::run(world, |ctx| {
                let run = pp_cp_run(ctx, "gpt", (cp, tp, dp), fault);
                if ctx.rank() == 0 {
                    let c = against_single(&run, "gpt", world);
                    assert_eq!(
                        c.passed,
                        passes,
                        "pp 2 × cp {cp} × tp {tp} × dp {dp}, {fault:?}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// PP × EP: each stage's experts spread over `ep` ranks borrowed from its data group
/// (`dp × cp`), every microbatch's tokens (a sequence shard's under CP) dispatched to them.
/// On `gpt_moe` it passes against one device beside replicas (pp 2 × dp 2, world 4), CP
/// (pp 2 × cp 2, world 4), TP with replicas (world 8) and FSDP (world 8); expert gradients
/// divided by the world size, as EP alone divides them, instead of the stage's data group
/// are caught and named at an expert's gradient.
#[test]
fn pipelines_with_experts_spread_equal_one_device() {
    let cases: Vec<(CpTpDp, DataParallel, Option<PipelineFault>)> = vec![
        ((1, 1, 2), DataParallel::Replicate, None),
        ((2, 1, 1), DataParallel::Replicate, None),
        ((1, 2, 2), DataParallel::Replicate, None),
        ((2, 1, 2), DataParallel::Shard, None),
        (
            (1, 1, 2),
            DataParallel::Replicate,
            Some(PipelineFault::ExpertGradsScaledByWorld),
        ),
    ];
    crate::common::each_case(
        "pipelines_with_experts_spread_equal_one_device",
        cases,
        |case: &(CpTpDp, DataParallel, Option<PipelineFault>)| {
            use lockstep_core::pipeline::{train_pipeline_with, PipelineOptions, StageParallel};
            let ((cp, tp, dp), data, fault) = case.clone();
            let world = 2 * cp * tp * dp;
            lockstep_harness::run(world, |ctx| {
                let m = zoo::build("gpt_moe", 0, ctx.rank()).expect("model");
                let cfg = common::train_config(ctx, "gpt_moe", "pp_ep", "fp32", STEPS);
                let opts = PipelineOptions {
                    data_parallel: dp,
                    fault: fault.clone(),
                    ..PipelineOptions::default()
                };
                let within = StageParallel {
                    tp,
                    cp,
                    ep: 2,
                    cp_fault: None,
                    data,
                };
                let run = train_pipeline_with(m.as_ref(), ctx.world(), &cfg, &opts, within)
                    .expect("PP × EP run")
                    .record;
                if ctx.rank() == 0 {
                    let c = against_single(&run, "gpt_moe", world);
                    assert_eq!(
                        c.passed,
                        fault.is_none(),
                        "pp 2 × cp {cp} × tp {tp} × dp {dp} ({data:?}) × ep 2, {fault:?}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                    let expert = |p: &lockstep_core::record::TensorPlacement| {
                        p.tensor.contains(".experts.") && p.placement.contains("on ep rank")
                    };
                    assert!(run.placements.iter().any(expert), "{:?}", run.placements);
                    if fault.is_some() {
                        let first = c.first_failure.expect("a first failing tensor");
                        let tensor = first.tensor.as_deref().unwrap_or_default();
                        assert!(tensor.contains(".experts."), "{first:?}");
                    }
                }
            });
        },
    );
}
