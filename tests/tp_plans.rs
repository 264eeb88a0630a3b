//! Tensor-parallel plans applied to the zoo decoder: TP 1, 2 and 4 and TP with sequence
//! parallelism against single device (losses, gradients, final parameters), exact collective
//! counts per step, planted bugs caught, and bad plans rejected before any rank starts.

use crate::common;
use crate::judge;

use lockstep_core::record::RunRecord;
use lockstep_core::tensor_parallel::{
    check_plan, placements, train_tensor_parallel, TpFault, TpOptions, TpPlanError, TpRule, TpStyle,
};
use lockstep_harness::parity::Comparison;
use lockstep_harness::RankCtx;
use lockstep_models::zoo::{self, Gpt, GptConfig};
use lockstep_models::{Model, ModelError};
use std::collections::BTreeMap;

const STEPS: usize = 3;

fn tp_run(ctx: &RankCtx, model: &str, opts: &TpOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "tp", "fp32", STEPS);
    train_tensor_parallel(m.as_ref(), ctx.world(), &cfg, opts).expect("tensor-parallel run")
}

/// `run` judged against one process on `world` ranks' batches by the fp64 arbiter (the
/// matrix's judge for TP against single device: equal up to summation order only).
fn against_single(run: &RunRecord, model: &str, world: usize) -> Comparison {
    judge::judged_against_single(
        run,
        &|seed, rank| zoo::build(model, seed, rank),
        world,
        STEPS,
    )
}

fn opts(tp: usize, sequence_parallel: bool) -> TpOptions {
    TpOptions {
        tp,
        sequence_parallel,
        data_parallel: Default::default(),
        fault: None,
    }
}

/// Every TP size and SP on the decoders, at world 4 (TP × data-parallel replicas) and 2.
/// `gpt_dropout` (p = 0.1) runs in parity mode: each rank applies its slice of the mask one
/// process draws, so dropout > 0 is compared with single device like everything else.
#[test]
fn tensor_parallel_matches_single_device() {
    let model_values: Vec<&str> = vec!["gpt", "gpt_moe", "gpt_dropout"];
    let case_values: Vec<(usize, usize, bool)> = vec![
        (1, 2, false),
        (2, 2, false),
        (2, 4, false),
        (4, 4, false),
        (2, 2, true),
        (4, 4, true),
    ];
    let cases: Vec<(&str, (usize, usize, bool))> =
        crate::common::product(&model_values, &case_values);
    crate::common::each_case(
        "tensor_parallel_matches_single_device",
        cases,
        |&(model, case): &(&str, (usize, usize, bool))| {
            let (tp, world, sp) = case;
            lockstep_harness::run(world, |ctx| {
                let run = tp_run(ctx, model, &opts(tp, sp));
                if ctx.rank() == 0 {
                    let c = against_single(&run, model, world);
                    assert!(
                        c.passed,
                        "{model} tp={tp} sp={sp}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                    assert!(run.grads.as_ref().is_some_and(|g| g.len() == STEPS));
                }
            });
        },
    );
}

/// One step's calls per operation on the TP group.
fn counts(record: &RunRecord, step: usize) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    // The TP group's only: data-parallel replicas' reductions run on `dp`.
    for e in &record.collectives.as_ref().expect("collectives recorded")[step] {
        if e.group.starts_with("tp") {
            *out.entry(e.op.clone()).or_default() += e.calls;
        }
    }
    out
}

/// Hand-counted collectives of one step of the dense decoder (2 blocks) on the TP group:
/// forward — the embedding's all-reduce, one per row-parallel projection (wo, w2: 4), the
/// loss's three (max, target logit, sum of exps); backward — one per column-parallel entry
/// (q/k/v and w1 of 2 blocks: 4) and the output projection's (1). Nothing else.
#[test]
fn collective_counts_per_step_are_exact_without_sequence_parallelism() {
    lockstep_harness::run(2, |ctx| {
        let run = tp_run(ctx, "gpt", &opts(2, false));
        for step in 0..STEPS {
            let c = counts(&run, step);
            assert_eq!(
                c,
                BTreeMap::from([("all_reduce".to_owned(), 1 + 4 + 3 + 4 + 1)]),
                "step {step}"
            );
        }
        let bytes: u64 = run.collectives.as_ref().unwrap()[0]
            .iter()
            .filter(|e| e.op == "all_reduce")
            .map(|e| e.bytes)
            .sum();
        assert!(bytes > 0);
    });
}

/// Under SP: all-gathers before and reduce-scatters after each block's attention and
/// feed-forward (2 blocks × 2 each way), the output's gather and the region entry's scatter
/// (whose backward gathers); all-reduces: the embedding, the loss's three, and one per
/// partial gradient (2 LayerNorms × 2 blocks + the final one, × weight and bias, and the two
/// row-parallel biases per block: 14).
#[test]
fn collective_counts_per_step_are_exact_with_sequence_parallelism() {
    lockstep_harness::run(2, |ctx| {
        let run = tp_run(ctx, "gpt", &opts(2, true));
        let expected = BTreeMap::from([
            ("all_reduce".to_owned(), 1 + 3 + 14),
            ("all_gather".to_owned(), (4 + 1) + (4 + 1)),
            ("reduce_scatter".to_owned(), 4 + (1 + 4)),
        ]);
        for step in 0..STEPS {
            assert_eq!(counts(&run, step), expected, "step {step}");
        }
    });
}

/// Each planted bug makes the run differ from single device.
#[test]
fn planted_tensor_parallel_bugs_are_caught() {
    let cases: Vec<(TpFault, bool, &str)> = vec![
        (TpFault::MissingBackwardAllReduce, false, "gpt"),
        (TpFault::SkipSequenceGradReduce, true, "gpt"),
        (TpFault::SameDropoutMask, false, "gpt_dropout"),
    ];
    crate::common::each_case(
        "planted_tensor_parallel_bugs_are_caught",
        cases,
        |&case: &(TpFault, bool, &str)| {
            let (fault, sp, model) = case;
            lockstep_harness::run(2, |ctx| {
                let o = TpOptions {
                    fault: Some(fault),
                    ..opts(2, sp)
                };
                let run = tp_run(ctx, model, &o);
                if ctx.rank() == 0 {
                    let c = against_single(&run, model, 2);
                    assert!(!c.passed, "{fault:?} was not caught");
                    // The diagnosis names the tensor that went wrong (with its step and element)
                    // before the loss or gradient norm it showed in.
                    let text = c.diagnosis.clone().unwrap_or_default();
                    let f = c.first_failure.as_ref().expect("a culprit");
                    assert!(f.tensor.is_some() && f.element.is_some(), "{text}");
                    assert!(text.starts_with("first failure: gradient of `"), "{text}");
                }
            });
        },
    );
}

/// Plans that cannot apply are rejected before any rank starts, naming what is wrong.
#[test]
fn bad_plans_are_rejected_before_any_rank_starts() {
    let gpt = zoo::build("gpt", 0, 0).expect("model");
    let e = check_plan(gpt.as_ref(), 3, &opts(3, false))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("4 attention heads do not divide by the tensor-parallel size 3"),
        "{e}"
    );
    let e = check_plan(gpt.as_ref(), 6, &opts(4, false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("size 4"), "{e}");
    let mlp = zoo::build("mlp", 0, 0).expect("model");
    let e = check_plan(mlp.as_ref(), 2, &opts(2, false))
        .unwrap_err()
        .to_string();
    assert!(e.contains("has no parallel plan"), "{e}");
    let mut plan = gpt.parallel_plan(false).expect("gpt's plan");
    plan.rules.push(TpRule {
        pattern: "layers.*.attention.wz".into(),
        style: TpStyle::Colwise,
    });
    let e = placements(&plan, gpt.as_ref(), 2).unwrap_err();
    assert!(matches!(e, TpPlanError::NoMatch { .. }), "{e}");
    assert!(e.to_string().contains("layers.*.attention.wz"), "{e}");
    // The message lists the module paths a pattern can match.
    assert!(e.to_string().contains("layers.0.attention.wq, "), "{e}");
    // Vocabulary 8 over 16 ranks does not divide.
    let mut plan = gpt.parallel_plan(false).expect("gpt's plan");
    plan.heads = Some(16);
    let e = placements(&plan, gpt.as_ref(), 16).unwrap_err().to_string();
    assert!(
        e.contains("does not divide by the tensor-parallel size 16"),
        "{e}"
    );
}

/// The decoder at sizes other than the zoo's: 6 heads of width 4, vocabulary 12, 3 sequences
/// of 6 tokens, 6 experts (top-3) 12 wide.
fn resized(vocab: i64, heads: i64) -> GptConfig {
    GptConfig {
        vocab,
        dim: 24,
        heads,
        layers: 1,
        seq: 6,
        batch: 3,
        ff_hidden: 48,
        experts: 6,
        top_k: 3,
        expert_hidden: 12,
    }
}

/// Plans read the sizes from the model, not the zoo's: the decoder resized (dense and MoE)
/// under TP 2 and 3, with and without SP, matches single device.
#[test]
fn tensor_parallel_reads_the_decoders_sizes() {
    let moe_values: Vec<bool> = vec![false, true];
    let case_values: Vec<(usize, bool)> = vec![(2, false), (3, false), (2, true), (3, true)];
    let cases: Vec<(bool, (usize, bool))> = crate::common::product(&moe_values, &case_values);
    crate::common::each_case(
        "tensor_parallel_reads_the_decoders_sizes",
        cases,
        |&(moe, case): &(bool, (usize, bool))| {
            let (tp, sp) = case;
            let build = |rank| Gpt::with_config(resized(12, 6), 0, rank, moe, 0.0).expect("model");
            lockstep_harness::run(tp, |ctx| {
                let m = build(ctx.rank());
                let cfg = common::train_config(ctx, m.name(), "tp", "fp32", STEPS);
                let run = train_tensor_parallel(&m, ctx.world(), &cfg, &opts(tp, sp))
                    .expect("tensor-parallel run");
                if ctx.rank() == 0 {
                    let resized_model =
                        |_: u64, rank: usize| -> Result<Box<dyn Model>, ModelError> {
                            Ok(Box::new(Gpt::with_config(
                                resized(12, 6),
                                0,
                                rank,
                                moe,
                                0.0,
                            )?))
                        };
                    let c = judge::judged_against_single(&run, &resized_model, tp, STEPS);
                    assert!(
                        c.passed,
                        "moe={moe} tp={tp} sp={sp}: {}",
                        c.diagnosis.unwrap_or_default()
                    );
                }
            });
        },
    );
}

/// At sizes other than the zoo's, plan errors name the model's own sizes.
#[test]
fn plans_name_the_decoders_own_sizes() {
    let m = Gpt::with_config(resized(12, 6), 0, 0, false, 0.0).expect("model");
    let e = check_plan(&m, 4, &opts(4, false)).unwrap_err().to_string();
    assert!(
        e.contains(
            "layers.*.attention: 6 attention heads do not divide by the tensor-parallel size 4"
        ),
        "{e}"
    );
    let m = Gpt::with_config(resized(10, 4), 0, 0, false, 0.0).expect("model");
    let e = check_plan(&m, 4, &opts(4, false)).unwrap_err().to_string();
    assert!(
        e.contains("`tok_embeddings.weight`") && e.contains("has 10 along dimension 0"),
        "{e}"
    );
    // Sizes that cannot build a decoder at all are refused by the model.
    let e = Gpt::with_config(resized(12, 5), 0, 0, false, 0.0).unwrap_err();
    assert!(
        e.to_string()
            .contains("dim 24 is not a multiple of the 5 heads"),
        "{e}"
    );
}

/// The transformer's plan splits only its feed-forward layers (2 encoder + 2 decoder).
#[test]
fn transformer_feed_forward_tp_matches_single_device() {
    let cases: Vec<(usize, usize)> = vec![(2, 2), (2, 4), (4, 4)];
    crate::common::each_case(
        "transformer_feed_forward_tp_matches_single_device",
        cases,
        |&case: &(usize, usize)| {
            let (tp, world) = case;
            lockstep_harness::run(world, |ctx| {
                let run = tp_run(ctx, "transformer", &opts(tp, false));
                // One all-reduce per row-parallel forward and one per column-parallel backward, in
                // each of the 4 layers; nothing else touches the TP group.
                for step in 0..STEPS {
                    assert_eq!(
                        counts(&run, step),
                        BTreeMap::from([("all_reduce".to_owned(), 4 * 2)]),
                        "step {step}"
                    );
                }
                if ctx.rank() == 0 {
                    let c = against_single(&run, "transformer", world);
                    assert!(c.passed, "tp={tp}: {}", c.diagnosis.unwrap_or_default());
                }
            });
        },
    );
}
