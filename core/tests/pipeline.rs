//! Pipeline parallelism against single-device runs: every schedule over a grid of stages,
//! virtual stages and microbatches on the models a pipeline can serve, tied weights,
//! checkpointing and PP×DP; and the checker catching planted pipeline bugs.

use crate::common;

use lockstep_core::comm::DType;
use lockstep_core::pipeline::trace::chrome_trace;
use lockstep_core::pipeline::{
    microbatched_reference, plan_pipeline, train_pipeline, PipelineError, PipelineFault,
    PipelineOptions, PipelineRun, ScheduleChoice, ScheduleKind,
};
use lockstep_core::record::RunRecord;
use lockstep_core::train::{single_device_reference, OptimizerConfig};
use lockstep_harness::parity::{compare, Comparison, Override, Tolerance, TolerancePolicy};
use lockstep_harness::{LaunchError, RankCtx, Run};
use lockstep_models::zoo;
use std::time::Duration;
use tch::Tensor;

const STEPS: usize = 3;

fn train(ctx: &RankCtx, model: &str, opts: &PipelineOptions) -> Result<PipelineRun, String> {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "pp", "fp32", STEPS);
    train_pipeline(m.as_ref(), ctx.world(), &cfg, opts).map_err(|e: PipelineError| e.to_string())
}

fn pipeline(ctx: &RankCtx, model: &str, opts: &PipelineOptions) -> RunRecord {
    train(ctx, model, opts).expect("pipeline run").record
}

fn microbatched(model: &str, world: usize, m: usize) -> RunRecord {
    let built = zoo::build(model, 0, 0).expect("model");
    microbatched_reference(
        built.as_ref(),
        world,
        m,
        STEPS,
        OptimizerConfig::default(),
        true,
    )
    .expect("reference")
}

fn single(model: &str, world: usize) -> RunRecord {
    let built = zoo::build(model, 0, 0).expect("model");
    single_device_reference(
        built.as_ref(),
        world,
        STEPS,
        OptimizerConfig::default(),
        true,
    )
    .expect("reference")
}

fn opts(kind: ScheduleKind, v: usize, m: usize) -> PipelineOptions {
    PipelineOptions {
        schedule: ScheduleChoice::Builtin(kind),
        virtual_stages: v,
        microbatches: m,
        ..PipelineOptions::default()
    }
}

/// PyTorch's pipeline-test tolerance (rtol 1e-5, atol 4e-5), where bits cannot match.
fn pipeline_tolerance() -> TolerancePolicy {
    let ov = Override::new(
        Tolerance::new(1e-5, 4e-5),
        "microbatch accumulation and tied weights sum in another order",
    )
    .expect("override");
    TolerancePolicy::dtype_table(DType::F32).with_override("pp", ov)
}

fn assert_passes(c: &Comparison, what: &str) {
    assert!(
        c.passed,
        "{what}: {}",
        c.diagnosis.clone().unwrap_or_default()
    );
}

/// Models whose pipelines must equal the microbatched single-device run bit for bit: no tied
/// weight spans stages and no output feeds two stages.
const EXACT: [&str; 2] = ["nested", "mlp"];

/// Every schedule at world 2 (v = its default) and two microbatch counts on every model a
/// pipeline serves: bitwise against one process running the same microbatches in order where
/// the math allows (PyTorch's pipeline tolerance where tied weights sum in another order),
/// and within the fp32 table against the plain global batch over these 3 steps (the matrix's
/// 5 steps drift further on the transformer: see docs/pipeline.md).
#[test]
fn every_schedule_matches_single_device_at_world_2() {
    let kinds = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ];
    // gpt and transformer have 2 samples per rank: 4 is the most microbatches they allow.
    let cases = [
        ("nested", 4),
        ("nested", 6),
        ("mlp", 4),
        ("mlp", 6),
        ("gpt", 4),
        ("transformer", 4),
    ];
    crate::common::each_case(
        "every_schedule_matches_single_device_at_world_2",
        crate::common::product(&kinds, &cases),
        |&(kind, (model, m))| {
            lockstep_harness::run(2, |ctx| {
                let run = pipeline(ctx, model, &opts(kind, kind.default_virtual(), m));
                if ctx.rank() == 0 {
                    let what = format!("{model} {kind:?} m={m}");
                    let mb = microbatched(model, 2, m);
                    if EXACT.contains(&model) {
                        assert_passes(
                            &compare(&run, &mb, &TolerancePolicy::bitwise(DType::F32)),
                            &what,
                        );
                    } else {
                        assert_passes(&compare(&run, &mb, &pipeline_tolerance()), &what);
                    }
                    assert_passes(
                        &compare(&run, &single(model, 2), &pipeline_tolerance()),
                        &what,
                    );
                }
            });
        },
    );
}

/// World 4: every schedule with v = 1 on every model; the two-stages-per-rank ones need 8
/// stages, which only the transformer's 8 layers give.
#[test]
fn every_schedule_matches_single_device_at_world_4() {
    let cases: Vec<(ScheduleKind, usize, &str)> = vec![
        (ScheduleKind::GPipe, 1, "nested"),
        (ScheduleKind::OneFOneB, 1, "mlp"),
        (ScheduleKind::OneFOneB, 1, "gpt"),
        (ScheduleKind::GPipe, 1, "gpt_moe"),
        (ScheduleKind::Interleaved1F1B, 2, "transformer"),
        (ScheduleKind::LoopedBfs, 2, "transformer"),
        (ScheduleKind::InterleavedZeroBubble, 2, "transformer"),
        (ScheduleKind::Zbv, 2, "transformer"),
        (ScheduleKind::DualPipeV, 2, "transformer"),
    ];
    crate::common::each_case(
        "every_schedule_matches_single_device_at_world_4",
        cases,
        |&case: &(ScheduleKind, usize, &str)| {
            let (kind, v, model) = case;
            let m = 8;
            lockstep_harness::run(4, |ctx| {
                let run = pipeline(ctx, model, &opts(kind, v, m));
                if ctx.rank() == 0 {
                    let what = format!("{model} {kind:?} v={v}");
                    let mb = microbatched(model, 4, m);
                    let policy = if EXACT.contains(&model) {
                        TolerancePolicy::bitwise(DType::F32)
                    } else {
                        pipeline_tolerance()
                    };
                    assert_passes(&compare(&run, &mb, &policy), &what);
                }
            });
        },
    );
}

/// Partitions by parameters and by layer type, explicit splits, uneven microbatches (mlp's
/// 10 samples in 4) and PP×DP: all still the reference's math.
#[test]
fn partitions_microbatching_and_data_parallel_replicas_keep_the_math() {
    let cases: Vec<(&str, usize, usize, &str)> = vec![
        ("parameters", 1, 4, "mlp"),
        ("type:linear", 1, 4, "nested"),
        ("splits:1,2,4", 1, 4, "nested"),
        ("uniform", 1, 4, "mlp"),
        ("uniform", 2, 4, "gpt"),
    ];
    crate::common::each_case(
        "partitions_microbatching_and_data_parallel_replicas_keep_the_math",
        cases,
        |&case: &(&str, usize, usize, &str)| {
            let (partition, dp, world, model) = case;
            lockstep_harness::run(world, |ctx| {
                let o = PipelineOptions {
                    partition: partition.parse().expect("partition"),
                    data_parallel: dp,
                    ..opts(ScheduleKind::OneFOneB, 1, 2 * world / dp)
                };
                let run = pipeline(ctx, model, &o);
                if ctx.rank() == 0 {
                    let what = format!("{model} {partition} dp={dp}");
                    if dp == 1 && EXACT.contains(&model) {
                        let mb = microbatched(model, world, 2 * world / dp);
                        assert_passes(
                            &compare(&run, &mb, &TolerancePolicy::bitwise(DType::F32)),
                            &what,
                        );
                    }
                    assert_passes(
                        &compare(&run, &single(model, world), &pipeline_tolerance()),
                        &what,
                    );
                }
            });
        },
    );
}

/// Recomputing activations in backward changes where values live, not what they are: every
/// 2 layers, no value consumed by two segments is split between them on the zoo's models
/// (checkpointing every layer splits the transformer's embedding output between its segment
/// and the encoder's, which re-associates that gradient's sum: not bitwise there).
#[test]
fn checkpointing_is_bitwise_equal_to_keeping_activations() {
    let cases: Vec<&str> = vec!["nested", "mlp", "gpt", "transformer"];
    crate::common::each_case(
        "checkpointing_is_bitwise_equal_to_keeping_activations",
        cases,
        |&model: &&str| {
            lockstep_harness::run(2, |ctx| {
                let plain = pipeline(ctx, model, &opts(ScheduleKind::OneFOneB, 1, 4));
                let checkpointed = pipeline(
                    ctx,
                    model,
                    &PipelineOptions {
                        checkpoint_every: Some(2),
                        ..opts(ScheduleKind::OneFOneB, 1, 4)
                    },
                );
                if ctx.rank() == 0 {
                    let c = compare(&checkpointed, &plain, &TolerancePolicy::bitwise(DType::F32));
                    assert_passes(&c, model);
                }
            });
        },
    );
}

/// The GPT's embedding is tied to its output head across the first and last stage: every
/// holder ends with the same bits, which are the recorded ones.
#[test]
fn tied_weights_end_identical_on_every_holding_stage() {
    let cases: Vec<usize> = vec![2, 4];
    crate::common::each_case(
        "tied_weights_end_identical_on_every_holding_stage",
        cases,
        |&world: &usize| {
            lockstep_harness::run(world, |ctx| {
                let m = zoo::build("gpt", 0, ctx.rank()).expect("model");
                let cfg = common::train_config(ctx, "gpt", "pp", "fp32", STEPS);
                let run = train_pipeline(
                    m.as_ref(),
                    ctx.world(),
                    &cfg,
                    &opts(ScheduleKind::OneFOneB, 1, 2 * world),
                )
                .expect("pipeline");
                let holders = &run.plan.holders[run
                    .plan
                    .params
                    .iter()
                    .position(|n| n == "tok_embeddings.weight")
                    .expect("tied")];
                assert_eq!(
                    holders.iter().copied().collect::<Vec<_>>(),
                    vec![0, world - 1]
                );
                let mine = m
                    .named_parameters()
                    .into_iter()
                    .find(|(n, _)| n == "tok_embeddings.weight")
                    .map(|(_, t)| t.detach().contiguous())
                    .expect("tied weight");
                let all = Tensor::zeros(
                    [world as i64 * mine.numel() as i64],
                    (tch::Kind::Float, tch::Device::Cpu),
                );
                ctx.group()
                    .all_gather(&all, &mine.view([-1]))
                    .expect("gather");
                let n = mine.numel() as i64;
                let first = all.narrow(0, 0, n);
                let last = all.narrow(0, (world as i64 - 1) * n, n);
                assert!(
                    first.equal(&last),
                    "the tied weight differs between its holders"
                );
                let recorded = run
                    .record
                    .params
                    .iter()
                    .find(|p| p.name == "tok_embeddings.weight")
                    .expect("recorded");
                let mine: Vec<f64> =
                    Vec::try_from(&mine.to_kind(tch::Kind::Double).view([-1])).expect("values");
                if holders.contains(&ctx.rank()) {
                    assert_eq!(recorded.values, mine);
                }
            });
        },
    );
}

/// Each planted bug must make the pipeline fail against its reference.
#[test]
fn planted_pipeline_bugs_are_caught() {
    let cases: Vec<PipelineFault> = vec![
        PipelineFault::SkipTiedReduce,
        PipelineFault::UnscaledLoss,
        PipelineFault::SwapMicrobatches,
    ];
    crate::common::each_case(
        "planted_pipeline_bugs_are_caught",
        cases,
        |fault: &PipelineFault| {
            lockstep_harness::run(2, |ctx| {
                let o = PipelineOptions {
                    fault: Some(fault.clone()),
                    ..opts(ScheduleKind::OneFOneB, 1, 4)
                };
                let run = pipeline(ctx, "gpt", &o);
                if ctx.rank() == 0 {
                    let c = compare(&run, &microbatched("gpt", 2, 4), &pipeline_tolerance());
                    assert!(!c.passed, "{fault:?} was not caught");
                }
            });
        },
    );
}

/// A dropped last SEND_B hangs the real run: the launcher times out and shows the flight
/// recorders, with the receive that never matched. (A dropped earlier one is caught sooner:
/// the next microbatch's message arrives with the wrong tag, an error naming both.)
#[test]
fn a_dropped_send_b_times_out_with_flight_recorders() {
    let result = Run::new(2).timeout(Duration::from_secs(8)).try_run(|ctx| {
        let o = PipelineOptions {
            fault: Some(PipelineFault::DropAction("1SEND_B3".into())),
            ..opts(ScheduleKind::OneFOneB, 1, 4)
        };
        train(ctx, "mlp", &o).map(|_| ())
    });
    let report = match result {
        Err(LaunchError::Timeout(report)) => report,
        Err(other) => panic!("expected a timeout, got {other}"),
        Ok(outcome) => panic!("a dropped SEND_B did not hang: {outcome:?}"),
    };
    let text = report.to_string();
    assert!(text.contains("flight recorder"), "{text}");
    assert!(text.to_lowercase().contains("recv"), "{text}");
}

/// The same dropped SEND_B in a schedule given as data is a deadlock the simulator names
/// before any rank starts.
#[test]
fn the_simulator_names_a_dropped_send_b_before_any_rank_starts() {
    let mut s = lockstep_core::pipeline::schedule::lower(
        &lockstep_core::pipeline::schedule::generate(ScheduleKind::OneFOneB, 2, 1, 4)
            .expect("1f1b"),
    );
    s.actions[1].retain(|a| a.to_string() != "1SEND_B3");
    let mlp = zoo::build("mlp", 0, 0).expect("model");
    let o = PipelineOptions {
        schedule: ScheduleChoice::Custom(s),
        ..PipelineOptions::default()
    };
    let e = plan_pipeline(mlp.as_ref(), 2, &o)
        .expect_err("accepted")
        .to_string();
    assert!(e.contains("1SEND_B3") || e.contains("RECV_B3"), "{e}");
}

/// Stages that disagree on the shapes between them fail on both sides, naming both stages,
/// before any activation moves.
#[test]
fn a_shape_mismatch_between_stages_is_an_error_naming_both() {
    let result = Run::new(2).timeout(Duration::from_secs(30)).try_run(|ctx| {
        let o = PipelineOptions {
            fault: Some(PipelineFault::WrongShape),
            ..opts(ScheduleKind::OneFOneB, 1, 4)
        };
        train(ctx, "mlp", &o).map(|_| ())
    });
    let report = match result {
        Err(LaunchError::RankFailed(report)) => report,
        Err(other) => panic!("expected a rank failure, got {other}"),
        Ok(outcome) => panic!("a shape mismatch passed: {outcome:?}"),
    };
    let text = report.to_string();
    assert!(text.contains("stage 0 and stage 1 disagree"), "{text}");
}

/// Plans that cannot work are rejected before any rank starts, naming the rule.
#[test]
fn bad_plans_are_rejected_before_any_rank_starts() {
    let mlp = zoo::build("mlp", 0, 0).expect("model");
    let gpt = zoo::build("gpt", 0, 0).expect("model");
    let err = |model: &dyn lockstep_models::Model, world: usize, o: PipelineOptions| {
        plan_pipeline(model, world, &o)
            .expect_err("accepted")
            .to_string()
    };
    let e = err(gpt.as_ref(), 4, opts(ScheduleKind::Interleaved1F1B, 2, 8));
    assert!(
        e.contains("8 stages need at least 8 layers; the model has 6"),
        "{e}"
    );
    let e = err(mlp.as_ref(), 2, opts(ScheduleKind::OneFOneB, 1, 11));
    assert!(
        e.contains("11 microbatches need at least 11 samples"),
        "{e}"
    );
    let e = err(mlp.as_ref(), 4, opts(ScheduleKind::Interleaved1F1B, 2, 6));
    assert!(e.contains("multiple"), "{e}");
    let e = err(
        mlp.as_ref(),
        3,
        PipelineOptions {
            data_parallel: 2,
            ..PipelineOptions::default()
        },
    );
    assert!(
        e.contains("does not divide into 2 data-parallel replicas"),
        "{e}"
    );
}

/// A real run's timeline as Chrome trace JSON: one track per rank, every compute action.
#[test]
fn a_real_run_leaves_a_chrome_trace_with_one_track_per_rank() {
    let dir = std::env::temp_dir().join(format!("lockstep-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let d = dir.clone();
    lockstep_harness::run(2, move |ctx| {
        let run = train(ctx, "gpt", &opts(ScheduleKind::OneFOneB, 1, 4)).expect("run");
        let json = serde_json::to_vec(&run.traces).expect("json");
        std::fs::write(d.join(format!("rank{}.json", ctx.rank())), json).expect("write");
    });
    let mut traces = Vec::new();
    for r in 0..2 {
        let bytes = std::fs::read(dir.join(format!("rank{r}.json"))).expect("read");
        let mut t: Vec<lockstep_core::pipeline::trace::RankStepTrace> =
            serde_json::from_slice(&bytes).expect("parse");
        traces.append(&mut t);
    }
    let text = chrome_trace(&traces).to_string();
    let parsed: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let events = parsed["traceEvents"].as_array().expect("events");
    let tracks: Vec<_> = events.iter().filter(|e| e["ph"] == "M").collect();
    assert_eq!(tracks.len(), 2);
    let computes = events.iter().filter(|e| e["cat"] == "compute").count();
    // 2 stages × 4 microbatches × (F + B) × 3 steps.
    assert_eq!(computes, 2 * 4 * 2 * STEPS);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without recorded gradients each rank squares only the gradients it owns (no gather): the
/// norm must keep the bits of the norm of the gathered gradients, on models with tied weights
/// and with several stages per rank.
#[test]
fn the_norm_without_recorded_gradients_keeps_the_bits() {
    let cases: Vec<(&str, ScheduleKind, usize)> = vec![
        ("gpt", ScheduleKind::OneFOneB, 2),
        ("transformer", ScheduleKind::Interleaved1F1B, 2),
        ("mlp", ScheduleKind::GPipe, 4),
    ];
    crate::common::each_case(
        "the_norm_without_recorded_gradients_keeps_the_bits",
        cases,
        |&case: &(&str, ScheduleKind, usize)| {
            let (model, kind, world) = case;
            lockstep_harness::run(world, move |ctx| {
                let m = zoo::build(model, 0, ctx.rank()).expect("model");
                let o = opts(kind, kind.default_virtual(), 4);
                let mut cfg = common::train_config(ctx, model, "pp", "fp32", STEPS);
                let gathered = train_pipeline(m.as_ref(), ctx.world(), &cfg, &o).expect("run");
                let m = zoo::build(model, 0, ctx.rank()).expect("model");
                cfg.record_grads = false;
                let owned = train_pipeline(m.as_ref(), ctx.world(), &cfg, &o).expect("run");
                let bits = |r: &PipelineRun| -> Vec<u64> {
                    r.record.grad_norms.iter().map(|n| n.to_bits()).collect()
                };
                assert_eq!(
                    bits(&gathered),
                    bits(&owned),
                    "{model} {kind:?} world {world}"
                );
                assert_eq!(gathered.record.grad_norms.len(), STEPS);
            });
        },
    );
}

/// Recompute that overwrites, instead of adding to, the gradient of a saved boundary read by
/// several later segments: with every layer its own segment (`pp.1f1b.checkpoint_each`), the
/// transformer's encoder output feeds each decoder layer's segment, so the encoder's
/// gradients lose all but one decoder layer's share. Caught, and named by tensor.
#[test]
fn a_checkpoint_boundary_with_several_consumers_gathers_every_gradient() {
    lockstep_harness::run(2, |ctx| {
        let each = |fault: Option<PipelineFault>| PipelineOptions {
            fault,
            checkpoint_every: Some(1),
            ..opts(ScheduleKind::OneFOneB, 1, 4)
        };
        let good = pipeline(ctx, "transformer", &each(None));
        let bad = pipeline(
            ctx,
            "transformer",
            &each(Some(PipelineFault::OverwriteSavedBoundaryGrad)),
        );
        if ctx.rank() == 0 {
            let reference = microbatched("transformer", 2, 4);
            assert_passes(
                &compare(&good, &reference, &pipeline_tolerance()),
                "correct",
            );
            let c = compare(&bad, &reference, &pipeline_tolerance());
            assert!(
                !c.passed,
                "the overwritten boundary gradient was not caught"
            );
            // Named by tensor: the first failure, and among the failing gradients the
            // encoder's (upstream of the boundary).
            let first = c.first_failure.as_ref().expect("a first failure");
            assert!(first.tensor.is_some(), "{first:?}");
            let failing: Vec<&str> = c
                .grad_summaries
                .iter()
                .filter(|p| !p.stats.passed)
                .map(|p| p.name.as_str())
                .collect();
            assert!(
                failing.iter().any(|n| n.contains("encoder.layers.0.")),
                "{failing:?}"
            );
        }
    });
}
