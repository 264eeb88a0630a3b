//! Pipeline parallelism against single-device runs: every schedule, partition, tied weights,
//! checkpointing and PP×DP, and the checker catching planted pipeline bugs.

mod common;

use lockstep_core::comm::DType;
use lockstep_core::pipeline::{
    microbatched_reference, train_pipeline, PartitionMethod, PipelineFault, PipelineOptions,
    ScheduleChoice, ScheduleKind,
};
use lockstep_core::record::RunRecord;
use lockstep_core::train::OptimizerConfig;
use lockstep_harness::parity::{compare, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::zoo;
use rstest::rstest;

const STEPS: usize = 5;

fn pipeline(ctx: &RankCtx, model: &str, opts: &PipelineOptions) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "pp", "fp32", STEPS);
    train_pipeline(m.as_ref(), ctx.world(), &cfg, opts)
        .expect("pipeline run")
        .record
}

fn microbatched(model: &str, world: usize, m: usize) -> RunRecord {
    let built = zoo::build(model, 0, 0).expect("model");
    microbatched_reference(built.as_ref(), world, m, STEPS, OptimizerConfig::default(), true)
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

/// Recomputing activations in backward changes where values live, not what they are: every
/// 2 layers, a value consumed by two segments is never split between them on the zoo's
/// models (checkpointing every layer splits the transformer's embedding output between its
/// segment and the encoder's, which re-associates that gradient's sum: not bitwise there).
#[rstest]
fn checkpointing_is_bitwise_equal_to_keeping_activations(
    #[values("nested", "mlp", "gpt", "transformer")] model: &str,
) {
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
            assert!(c.passed, "{model}: {}", c.diagnosis.unwrap_or_default());
        }
    });
}
