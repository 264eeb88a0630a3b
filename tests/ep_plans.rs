//! Expert parallelism: the two dispatchers compute the same outputs and gradients, token
//! dropping at capacity matches one process with the same capacity, `gpt_moe` with sharded
//! experts matches single device, and a planted expert-gradient doubling is caught.

use crate::common;
use crate::judge;

use lockstep_core::comm::ReduceOp;
use lockstep_core::expert_parallel::{
    check_expert_plan, moe_forward, train_expert_parallel, Dispatcher, EpFault, EpOptions,
    ExpertParams, MoeConfig,
};
use lockstep_core::record::RunRecord;
use lockstep_harness::parity::Comparison;
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, Model, ModelError};
use std::collections::BTreeMap;
use tch::{Kind, Tensor};

const E: usize = 8;
const D: i64 = 6;
const N: i64 = 10;

/// `run` (gpt_moe, 3 steps) judged against one process on `world` ranks' batches by the fp64
/// arbiter, the matrix's judge for EP against single device (equal up to summation order).
fn against_single(run: &RunRecord, world: usize) -> Comparison {
    judge::judged_against_single(
        run,
        &|seed, rank| zoo::build("gpt_moe", seed, rank),
        world,
        3,
    )
}

fn cfg(capacity_factor: Option<f64>) -> MoeConfig {
    MoeConfig {
        num_experts: E,
        top_k: 2,
        capacity_factor,
        aux_loss_coef: 0.0,
    }
}

/// Every expert's parameters, drawn from one seed (the same on every rank).
fn experts() -> (Tensor, Vec<ExpertParams>) {
    lockstep_models::seed::seeded(7, || {
        let r =
            |s: &[i64]| Tensor::randn(s, (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
        let router = r(&[E as i64, D]);
        let experts = (0..E)
            .map(|_| ExpertParams {
                w1: r(&[12, D]),
                b1: r(&[12]),
                w2: r(&[D, 12]),
                b2: r(&[D]),
            })
            .collect();
        (router, experts)
    })
}

/// Rank `r`'s tokens: skewed so that some ranks send nothing to some experts.
fn tokens(rank: usize) -> Tensor {
    lockstep_models::seed::seeded(100 + rank as u64, || {
        Tensor::randn([N, D], (Kind::Float, tch::Device::Cpu))
            .f_mul_scalar(1.0 + rank as f64)
            .unwrap()
    })
    .set_requires_grad(true)
}

/// Output and the gradients of (tokens, router, every local expert's w1) after
/// `output.sum()` backward.
fn run_layer(ctx: &RankCtx, dispatcher: Dispatcher, capacity: Option<f64>) -> Vec<Tensor> {
    let ep = ctx.world_size();
    let per = E / ep;
    let (router, all) = experts();
    let local: Vec<ExpertParams> = all.into_iter().skip(ctx.rank() * per).take(per).collect();
    let x = tokens(ctx.rank());
    let out = moe_forward(
        &x,
        &router,
        &local,
        &cfg(capacity),
        Some(&ctx.group()),
        dispatcher,
    )
    .expect("moe");
    out.output.sum(Kind::Float).backward();
    let mut v = vec![out.output.detach(), x.grad(), router.grad()];
    v.extend(local.iter().map(|e| e.w1.grad()));
    v
}

#[test]
fn the_two_dispatchers_agree() {
    let ep_values: Vec<usize> = vec![2, 4];
    let capacity_values: Vec<Option<f64>> = vec![None, Some(1.0)];
    let cases: Vec<(usize, Option<f64>)> = crate::common::product(&ep_values, &capacity_values);
    crate::common::each_case(
        "the_two_dispatchers_agree",
        cases,
        |&(ep, capacity): &(usize, Option<f64>)| {
            lockstep_harness::run(ep, |ctx| {
                let a = run_layer(ctx, Dispatcher::AllToAll, capacity);
                let b = run_layer(ctx, Dispatcher::AllGather, capacity);
                for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        x.allclose(y, 1.3e-6, 1e-5, false),
                        "tensor {i} differs between dispatchers"
                    );
                }
            });
        },
    );
}

/// With the same capacity, the sharded layer drops the same choices and computes the same
/// thing as one process holding every expert on each rank's tokens.
#[test]
fn sharded_experts_match_one_process_with_the_same_capacity() {
    let ep_values: Vec<usize> = vec![2, 4];
    let capacity_values: Vec<Option<f64>> = vec![None, Some(0.5)];
    let cases: Vec<(usize, Option<f64>)> = crate::common::product(&ep_values, &capacity_values);
    crate::common::each_case(
        "sharded_experts_match_one_process_with_the_same_capacity",
        cases,
        |&(ep, capacity): &(usize, Option<f64>)| {
            lockstep_harness::run(ep, |ctx| {
                let (router, all) = experts();
                let x = tokens(ctx.rank());
                let reference = moe_forward(
                    &x,
                    &router,
                    &all,
                    &cfg(capacity),
                    None,
                    Dispatcher::AllToAll,
                )
                .expect("single");
                let sharded = run_layer(ctx, Dispatcher::AllToAll, capacity);
                assert!(sharded[0].allclose(&reference.output.detach(), 1.3e-6, 1e-5, false));
                if capacity.is_some() {
                    assert!(
                        reference.tokens_dropped > 0,
                        "capacity 0.5 must drop something"
                    );
                }
            });
        },
    );
}

fn ep_run(ctx: &RankCtx, opts: &EpOptions) -> RunRecord {
    let m = zoo::build("gpt_moe", 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, "gpt_moe", "ep", "fp32", 3);
    train_expert_parallel(m.as_ref(), ctx.world(), &cfg, opts).expect("expert-parallel run")
}

fn opts(ep: usize, dispatcher: Dispatcher) -> EpOptions {
    EpOptions {
        ep,
        dispatcher,
        capacity_factor: None,
        data_parallel: Default::default(),
        fault: None,
    }
}

/// `gpt_moe` with its experts sharded matches single device (losses, every gradient, final
/// parameters), with both dispatchers, at EP 2 and 4 (and EP 2 of world 4: 2 replicas).
#[test]
fn gpt_moe_with_sharded_experts_matches_single_device() {
    let case_values: Vec<(usize, usize)> = vec![(2, 2), (2, 4), (4, 4)];
    let dispatcher_values: Vec<Dispatcher> = vec![Dispatcher::AllToAll, Dispatcher::AllGather];
    let cases: Vec<((usize, usize), Dispatcher)> =
        crate::common::product(&case_values, &dispatcher_values);
    crate::common::each_case(
        "gpt_moe_with_sharded_experts_matches_single_device",
        cases,
        |&(case, dispatcher): &((usize, usize), Dispatcher)| {
            let (ep, world) = case;
            lockstep_harness::run(world, |ctx| {
                let run = ep_run(ctx, &opts(ep, dispatcher));
                if ctx.rank() == 0 {
                    let c = against_single(&run, world);
                    assert!(
                        c.passed,
                        "ep={ep} world={world}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// One step's recorded collectives as (operation, group) → (calls, bytes).
fn step_counts(record: &RunRecord, step: usize) -> BTreeMap<(String, String), (u64, u64)> {
    record.collectives.as_ref().expect("collectives recorded")[step]
        .iter()
        .map(|e| ((e.op.clone(), e.group.clone()), (e.calls, e.bytes)))
        .collect()
}

/// Hand-counted collectives of one `gpt_moe` step at ep = world = 2 (2 MoE layers; per rank
/// N = 2 × 8 = 16 tokens of width D = 16, top-2 of 8 experts, so M = 32 choices, no
/// capacity), per rank:
///
/// - dense gradients averaged over `world`: one all-reduce per non-expert parameter — token
///   and position embeddings (8 × 16 each), per layer two LayerNorms (2 × 16 each), q/k/v/o
///   (16 × 16 + 16 each) and the router (8 × 16), and the final LayerNorm: 2 + 2 × 13 + 2 = 30
///   calls of 2 848 floats = 11 392 bytes. Expert gradients: the expert-data-parallel group
///   has one rank, so none.
/// - all-to-all dispatcher on `ep`, per layer: the per-expert count exchange (8 int64 = 64
///   bytes), tokens out and results back, and both again in backward (5 calls). The rows this
///   rank receives (R) depend on routing, so bytes are 64 + 2 · (M + R) · D · 4 per layer on
///   a rank; over both ranks R sums to M's sum: 2 × (128 + 2 · 128 · 64) = 33 024 bytes.
/// - all-gather dispatcher on `ep`, per layer: all-gathers of the batch sizes (8 bytes), the
///   tokens (16 × 16 × 4 = 1 024), the routing table (32 int64 = 256) and, in backward, the
///   results' gradient (32 × 16 × 4 = 2 048); reduce-scatters of the results (2 × 32 × 16 × 4
///   = 4 096) and, in backward, the tokens' gradient (2 × 16 × 16 × 4 = 2 048).
#[test]
fn collective_counts_per_step_are_exact() {
    let cases: Vec<Dispatcher> = vec![Dispatcher::AllToAll, Dispatcher::AllGather];
    crate::common::each_case(
        "collective_counts_per_step_are_exact",
        cases,
        |&dispatcher: &Dispatcher| {
            lockstep_harness::run(2, |ctx| {
                let run = ep_run(ctx, &opts(2, dispatcher));
                let key = |op: &str, group: &str| (op.to_owned(), group.to_owned());
                let dense = (key("all_reduce", "world"), (30, 11_392));
                for step in 0..3 {
                    let mut got = step_counts(&run, step);
                    match dispatcher {
                        Dispatcher::AllGather => {
                            let want = BTreeMap::from([
                                dense.clone(),
                                (
                                    key("all_gather", "ep[0,1]"),
                                    (2 * 4, 2 * (8 + 1_024 + 256 + 2_048)),
                                ),
                                (
                                    key("reduce_scatter", "ep[0,1]"),
                                    (2 * 2, 2 * (4_096 + 2_048)),
                                ),
                            ]);
                            assert_eq!(got, want, "step {step}");
                        }
                        Dispatcher::AllToAll => {
                            let (calls, bytes) = got
                                .remove(&key("all_to_all", "ep[0,1]"))
                                .expect("all-to-all on the ep group");
                            assert_eq!(got, BTreeMap::from([dense.clone()]), "step {step}");
                            assert_eq!(calls, 2 * 5, "step {step}");
                            // Beyond the routing-independent part, whole rows of D floats both ways.
                            let fixed = 2 * (64 + 2 * 32 * 64);
                            assert!(
                                bytes >= fixed && (bytes - fixed) % (2 * 64) == 0,
                                "step {step}: {bytes} bytes"
                            );
                            let total = Tensor::from_slice(&[bytes as i64]);
                            ctx.group()
                                .all_reduce(&total, ReduceOp::Sum)
                                .expect("sum over ranks");
                            assert_eq!(total.int64_value(&[0]), 33_024, "step {step}");
                        }
                    }
                }
            });
        },
    );
}

/// `gpt_moe` at sizes other than the zoo's (6 experts, top-3, width 24, 6 heads): the run
/// reads them from the model, so EP 2 and 3 with both dispatchers match single device, and
/// an EP size that does not divide its experts is named with the model's own count.
#[test]
fn expert_parallel_reads_the_decoders_sizes() {
    let ep_values: Vec<usize> = vec![2, 3];
    let dispatcher_values: Vec<Dispatcher> = vec![Dispatcher::AllToAll, Dispatcher::AllGather];
    let cases: Vec<(usize, Dispatcher)> = crate::common::product(&ep_values, &dispatcher_values);
    crate::common::each_case(
        "expert_parallel_reads_the_decoders_sizes",
        cases,
        |&(ep, dispatcher): &(usize, Dispatcher)| {
            let config = zoo::GptConfig {
                vocab: 12,
                dim: 24,
                heads: 6,
                layers: 1,
                seq: 6,
                batch: 3,
                ff_hidden: 48,
                experts: 6,
                top_k: 3,
                expert_hidden: 12,
            };
            let build = |rank| zoo::Gpt::with_config(config, 0, rank, true, 0.0).expect("model");
            let e = check_expert_plan(&build(0), 4, &opts(4, dispatcher))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("6 experts do not divide over an expert-parallel group of 4"),
                "{e}"
            );
            lockstep_harness::run(ep, |ctx| {
                let m = build(ctx.rank());
                let cfg = common::train_config(ctx, "gpt_moe", "ep", "fp32", 3);
                let run = train_expert_parallel(&m, ctx.world(), &cfg, &opts(ep, dispatcher))
                    .expect("expert-parallel run");
                if ctx.rank() == 0 {
                    let resized_model =
                        |_: u64, rank: usize| -> Result<Box<dyn Model>, ModelError> {
                            Ok(Box::new(zoo::Gpt::with_config(config, 0, rank, true, 0.0)?))
                        };
                    let c = judge::judged_against_single(&run, &resized_model, ep, 3);
                    assert!(c.passed, "ep={ep}: {}", c.diagnosis.unwrap_or_default());
                }
            });
        },
    );
}

/// Expert gradients counted once per EP rank (reduced over `ep` as well) are caught.
#[test]
fn expert_gradients_reduced_over_ep_are_caught() {
    lockstep_harness::run(2, |ctx| {
        let o = EpOptions {
            fault: Some(EpFault::ExpertGradsReducedOverEp),
            ..opts(2, Dispatcher::AllToAll)
        };
        let run = ep_run(ctx, &o);
        if ctx.rank() == 0 {
            let c = against_single(&run, 2);
            assert!(!c.passed, "doubled expert gradients were not caught");
        }
    });
}

/// Capacity that drops tokens (factor 1: an expert takes a quarter of a rank's choices):
/// `gpt_moe` under expert parallelism matches `single.cap1`, the single-device reference
/// dropping the same choices of each rank's batch (which drops some: the row exercises
/// dropping), and not the reference that drops nothing; a capacity check off by one (an
/// expert takes one choice more) fails against it, naming a tensor.
#[test]
fn token_dropping_matches_the_dropping_reference_and_an_off_by_one_is_caught() {
    lockstep_harness::run(2, |ctx| {
        let each = |fault| EpOptions {
            capacity_factor: Some(1.0),
            fault,
            ..opts(2, Dispatcher::AllToAll)
        };
        let good = ep_run(ctx, &each(None));
        let bad = ep_run(ctx, &each(Some(EpFault::CapacityOffByOne)));
        if ctx.rank() != 0 {
            return;
        }
        let settings = lockstep::runner::RunSettings {
            steps: 3,
            seed: 0,
            record_grads: true,
            ..Default::default()
        };
        let build = |seed, rank| zoo::build("gpt_moe", seed, rank);
        let (fp32, fp64) = lockstep::matrix::dropping_reference(&build, 1.0, 2, &settings)
            .expect("the dropping reference");
        assert_eq!(fp32.spec.config, "single.cap1@2");
        let dropped = fp32.tokens_dropped.expect("the reference counts its drops");
        assert!(dropped > 0, "factor 1 dropped nothing");
        let judge = |run: &RunRecord| {
            lockstep_harness::parity::arbitrate(
                run,
                &fp32,
                &fp64,
                &lockstep_harness::parity::ENVELOPE,
                None,
            )
        };
        let c = judge(&good);
        assert!(c.passed, "{}", c.diagnosis.unwrap_or_default());
        assert!(
            !against_single(&good, 2).passed,
            "dropping {dropped} choices went unnoticed against the reference that drops none"
        );
        let c = judge(&bad);
        assert!(!c.passed, "the off-by-one capacity check was not caught");
        let first = c.first_failure.as_ref().expect("a first failure");
        assert!(first.tensor.is_some(), "{first:?}");
    });
}

#[test]
fn bad_expert_plans_are_rejected_before_any_rank_starts() {
    let moe = zoo::build("gpt_moe", 0, 0).expect("model");
    let e = check_expert_plan(moe.as_ref(), 3, &opts(3, Dispatcher::AllToAll))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("8 experts do not divide over an expert-parallel group of 3"),
        "{e}"
    );
    let e = check_expert_plan(moe.as_ref(), 4, &opts(3, Dispatcher::AllToAll))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not divide world size 4"), "{e}");
    let gpt = zoo::build("gpt", 0, 0).expect("model");
    let e = check_expert_plan(gpt.as_ref(), 2, &opts(2, Dispatcher::AllToAll))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no mixture-of-experts layer"), "{e}");
    let (router, all) = experts();
    let bad = MoeConfig {
        top_k: 9,
        ..cfg(None)
    };
    let e = moe_forward(&tokens(0), &router, &all, &bad, None, Dispatcher::AllToAll)
        .unwrap_err()
        .to_string();
    assert!(e.contains("top_k 9 exceeds the 8 experts"), "{e}");
}
