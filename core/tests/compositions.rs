//! Compositions on a named mesh against single device and against the simpler composition
//! each reduces to: FSDP×TP equals TP×DDP bit for bit (a reduce-scatter's elements are the
//! all-reduce's), PP×FSDP equals PP×DP, EP×FSDP equals EP with replicated dense parameters;
//! every one agrees with single device (within the tolerances this file states); per-step collective counts are the hand-computed ones; planted seam
//! bugs are caught; meshes that do not fit are refused before any rank starts.

use crate::common;

use lockstep_core::comm::DType;
use lockstep_core::compose::{
    check_composition, train_composed, ComposedFault, Composition, CompositionError, DataParallel,
    SeamFault,
};
use lockstep_core::pipeline::ScheduleKind;
use lockstep_core::record::RunRecord;
use lockstep_core::train::{single_device_reference, OptimizerConfig};
use lockstep_harness::parity::{compare, Override, Tolerance, TolerancePolicy};
use lockstep_harness::RankCtx;
use lockstep_models::zoo;
use std::collections::BTreeMap;

const STEPS: usize = 3;

fn run(ctx: &RankCtx, model: &str, c: Composition, fault: Option<SeamFault>) -> RunRecord {
    let m = zoo::build(model, 0, ctx.rank()).expect("model");
    let cfg = common::train_config(ctx, model, "composed", "fp32", STEPS);
    train_composed(
        m.as_ref(),
        ctx.world(),
        &cfg,
        c,
        fault.map(ComposedFault::Seam),
    )
    .expect("composed run")
}

fn single(model: &str, world: usize) -> RunRecord {
    let m = zoo::build(model, 0, 0).expect("model");
    single_device_reference(m.as_ref(), world, STEPS, OptimizerConfig::default(), true)
        .expect("reference")
}

fn fsdp_tp(tp: usize) -> Composition {
    Composition::TensorData {
        tp,
        data: DataParallel::Shard,
    }
}

fn pipeline(tp: usize, data: DataParallel) -> Composition {
    Composition::Pipeline {
        cp: 1,
        ep: 1,
        pp: 2,
        tp,
        data,
        schedule: ScheduleKind::OneFOneB,
        min_data: 1,
        checkpoint_every: None,
    }
}

/// PyTorch's pipeline-test tolerance, which pipelines are held to against single device
/// (microbatch accumulation reorders sums; see the matrix's `pp.*` rows).
fn pipeline_policy() -> TolerancePolicy {
    let ov = Override::new(
        Tolerance::new(1e-5, 4e-5),
        "a pipeline accumulates microbatch gradients where one process differentiates the \
         global batch at once",
    )
    .expect("override");
    // Keyed by the runs' configuration name (`RunSpec.config`, see `run`).
    TolerancePolicy::dtype_table(DType::F32).with_override("composed", ov)
}

fn assert_agree(what: &str, run: &RunRecord, reference: &RunRecord, policy: &TolerancePolicy) {
    let c = compare(run, reference, policy);
    assert!(c.passed, "{what}: {}", c.diagnosis.unwrap_or_default());
}

fn assert_differs(what: &str, run: &RunRecord, reference: &RunRecord) {
    let c = compare(run, reference, &TolerancePolicy::dtype_table(DType::F32));
    assert!(!c.passed, "{what}: the planted bug was not caught");
}

/// FSDP×TP on the 2-D mesh [dp=2, tp=2] equals TP with DDP over dp bit for bit, and agrees
/// with single device.
#[test]
fn fsdp_x_tp_equals_tp_x_ddp_bitwise() {
    let cases: Vec<&str> = vec!["gpt", "gpt_moe"];
    crate::common::each_case(
        "fsdp_x_tp_equals_tp_x_ddp_bitwise",
        cases,
        |&model: &&str| {
            lockstep_harness::run(4, |ctx| {
                let sharded = run(ctx, model, fsdp_tp(2), None);
                let replicated = run(
                    ctx,
                    model,
                    Composition::TensorData {
                        tp: 2,
                        data: DataParallel::Replicate,
                    },
                    None,
                );
                if ctx.rank() == 0 {
                    assert_agree(
                        "fsdp×tp vs tp×ddp",
                        &sharded,
                        &replicated,
                        &TolerancePolicy::bitwise(DType::F32),
                    );
                    assert_agree(
                        "fsdp×tp vs single",
                        &sharded,
                        &single(model, 4),
                        &TolerancePolicy::dtype_table(DType::F32),
                    );
                }
            });
        },
    );
}

/// With TP = 1, FSDP×TP is FSDP: its sharded unit equals DDP over the same ranks bit for
/// bit, on the decoder and on a model no TP plan knows.
#[test]
fn fsdp_x_tp_with_tp_one_equals_ddp_bitwise() {
    let cases: Vec<&str> = vec!["gpt", "nested"];
    crate::common::each_case(
        "fsdp_x_tp_with_tp_one_equals_ddp_bitwise",
        cases,
        |&model: &&str| {
            lockstep_harness::run(2, |ctx| {
                let sharded = run(ctx, model, fsdp_tp(1), None);
                let m = zoo::build(model, 0, ctx.rank()).expect("model");
                let cfg = common::train_config(ctx, model, "ddp", "fp32", STEPS);
                let ddp = lockstep_core::ddp::train_ddp(
                    m.as_ref(),
                    ctx.world().group(),
                    &cfg,
                    Default::default(),
                )
                .expect("ddp");
                if ctx.rank() == 0 {
                    assert_agree(
                        "fsdp×tp(tp=1) vs ddp",
                        &sharded,
                        &ddp,
                        &TolerancePolicy::bitwise(DType::F32),
                    );
                }
            });
        },
    );
}

/// PP×FSDP (each stage one unit sharded over dp through UNSHARD / REDUCE_GRAD / RESHARD)
/// equals PP×DP bit for bit, tied weights included, and agrees with single device.
#[test]
fn pp_x_fsdp_equals_pp_x_dp_bitwise() {
    let cases: Vec<&str> = vec!["gpt", "nested", "transformer"];
    crate::common::each_case(
        "pp_x_fsdp_equals_pp_x_dp_bitwise",
        cases,
        |&model: &&str| {
            lockstep_harness::run(4, |ctx| {
                let sharded = run(ctx, model, pipeline(1, DataParallel::Shard), None);
                let replicated = run(ctx, model, pipeline(1, DataParallel::Replicate), None);
                if ctx.rank() == 0 {
                    assert_agree(
                        "pp×fsdp vs pp×dp",
                        &sharded,
                        &replicated,
                        &TolerancePolicy::bitwise(DType::F32),
                    );
                    assert_agree(
                        "pp×fsdp vs single",
                        &sharded,
                        &single(model, 4),
                        &pipeline_policy(),
                    );
                }
            });
        },
    );
}

/// PP×TP on [dp=1, pp=2, tp=2] agrees with single device.
#[test]
fn pp_x_tp_agrees_with_single_device() {
    let cases: Vec<&str> = vec!["gpt", "gpt_moe"];
    crate::common::each_case(
        "pp_x_tp_agrees_with_single_device",
        cases,
        |&model: &&str| {
            lockstep_harness::run(4, |ctx| {
                let composed = run(ctx, model, pipeline(2, DataParallel::Replicate), None);
                if ctx.rank() == 0 {
                    assert_agree(
                        "pp×tp vs single",
                        &composed,
                        &single(model, 4),
                        &pipeline_policy(),
                    );
                }
            });
        },
    );
}

/// EP×FSDP (experts over ep, the dense parameters sharded over the world) equals EP with
/// replicated dense parameters bit for bit, and agrees with single device.
#[test]
fn ep_x_fsdp_equals_ep_bitwise() {
    let cases: Vec<(usize, usize)> = vec![(2, 2), (2, 4)];
    crate::common::each_case(
        "ep_x_fsdp_equals_ep_bitwise",
        cases,
        |&case: &(usize, usize)| {
            let (ep, world) = case;
            lockstep_harness::run(world, |ctx| {
                let sharded = run(
                    ctx,
                    "gpt_moe",
                    Composition::ExpertData {
                        ep,
                        data: DataParallel::Shard,
                    },
                    None,
                );
                let replicated = run(
                    ctx,
                    "gpt_moe",
                    Composition::ExpertData {
                        ep,
                        data: DataParallel::Replicate,
                    },
                    None,
                );
                if ctx.rank() == 0 {
                    assert_agree(
                        "ep×fsdp vs ep",
                        &sharded,
                        &replicated,
                        &TolerancePolicy::bitwise(DType::F32),
                    );
                    assert_agree(
                        "ep×fsdp vs single",
                        &sharded,
                        &single("gpt_moe", world),
                        &TolerancePolicy::dtype_table(DType::F32),
                    );
                }
            });
        },
    );
}

/// One step's recorded collectives as (operation, group kind) → calls, the group kind being
/// the group's name before its member list (`dp`, `tp`, `pp-tied`...).
fn counts(record: &RunRecord, step: usize) -> BTreeMap<(String, String), u64> {
    let mut out = BTreeMap::new();
    for e in &record.collectives.as_ref().expect("collectives recorded")[step] {
        let kind = e.group.split('[').next().unwrap_or(&e.group).to_owned();
        *out.entry((e.op.clone(), kind)).or_default() += e.calls;
    }
    out
}

/// Calls per (operation, group kind).
type Counts = BTreeMap<(String, String), u64>;

/// One pipeline step's counts without the stage boundary's point-to-point traffic, and that
/// traffic: (the rest, sends, receives) on the `pp-edge` (activations) and `pp-grad`
/// (gradients) groups together.
fn boundary(record: &RunRecord, step: usize) -> (Counts, Option<u64>, Option<u64>) {
    let mut got = counts(record, step);
    let mut take = |op: &str| {
        let parts: Vec<u64> = ["pp-edge", "pp-grad"]
            .iter()
            .filter_map(|g| got.remove(&(op.to_owned(), (*g).to_owned())))
            .collect();
        (!parts.is_empty()).then(|| parts.iter().sum())
    };
    let sends = take("send");
    let recvs = take("recv");
    (got, sends, recvs)
}

fn expect(pairs: &[(&str, &str, u64)]) -> BTreeMap<(String, String), u64> {
    pairs
        .iter()
        .map(|(op, g, n)| (((*op).to_owned(), (*g).to_owned()), *n))
        .collect()
}

/// FSDP×TP, dense decoder (2 blocks) at [dp=2, tp=2]: the TP group's 13 all-reduces (see
/// tp_plans.rs), and on dp one all-gather (the unit before forward) and one reduce-scatter
/// (its gradients) — nothing else, every step.
#[test]
fn fsdp_x_tp_collective_counts_are_exact() {
    lockstep_harness::run(4, |ctx| {
        let record = run(ctx, "gpt", fsdp_tp(2), None);
        for step in 0..STEPS {
            assert_eq!(
                counts(&record, step),
                expect(&[
                    ("all_gather", "dp", 1),
                    ("all_reduce", "tp", 1 + 4 + 3 + 4 + 1),
                    ("reduce_scatter", "dp", 1),
                ]),
                "step {step}"
            );
        }
    });
}

/// PP×DP and PP×FSDP at [dp=2, pp=2], per step: PP×DP all-reduces each stage's flattened
/// gradients on dp once; PP×FSDP all-gathers the stage's unit at UNSHARD and reduce-scatters
/// it at REDUCE_GRAD on dp. On `gpt` the tied embedding adds one all-reduce among its two
/// holders; `nested` ties nothing. The stage boundary's sends and receives are counted too,
/// as many of each on both stages (activations one way, their gradients back), the same
/// every step.
#[test]
fn pp_x_data_collective_counts_are_exact() {
    let case_values: Vec<(&str, u64)> = vec![("nested", 0), ("gpt", 1)];
    let data_values: Vec<DataParallel> = vec![DataParallel::Replicate, DataParallel::Shard];
    let cases: Vec<((&str, u64), DataParallel)> =
        crate::common::product(&case_values, &data_values);
    crate::common::each_case(
        "pp_x_data_collective_counts_are_exact",
        cases,
        |&(case, data): &((&str, u64), DataParallel)| {
            let (model, tied) = case;
            lockstep_harness::run(4, |ctx| {
                let record = run(ctx, model, pipeline(1, data), None);
                let mut want = match data {
                    DataParallel::Shard => {
                        expect(&[("all_gather", "dp", 1), ("reduce_scatter", "dp", 1)])
                    }
                    _ => expect(&[("all_reduce", "dp", 1)]),
                };
                if tied > 0 {
                    want.insert(("all_reduce".into(), "pp-tied".into()), tied);
                }
                let (_, sends, _) = boundary(&record, 0);
                assert!(sends.is_some_and(|n| n > 0), "stage boundary sends counted");
                for step in 0..STEPS {
                    let (rest, s, r) = boundary(&record, step);
                    assert_eq!(rest, want, "step {step}");
                    assert_eq!((s, r), (sends, sends), "step {step}: sends and receives");
                }
            });
        },
    );
}

/// EP×FSDP at ep = world = 2 communicates exactly as EP with replicated dense parameters,
/// except that the dense parameters' per-parameter all-reduces on the world group become the
/// unit's one all-gather and one reduce-scatter there; the experts' all-to-alls are
/// untouched.
#[test]
fn ep_x_fsdp_collective_counts_are_exact() {
    lockstep_harness::run(2, |ctx| {
        let ep = |data| Composition::ExpertData { ep: 2, data };
        let sharded = run(ctx, "gpt_moe", ep(DataParallel::Shard), None);
        let replicated = run(ctx, "gpt_moe", ep(DataParallel::Replicate), None);
        let m = zoo::build("gpt_moe", 0, 0).expect("model");
        let tags = m.tags();
        let dense = m
            .named_parameters()
            .iter()
            .filter(|(n, _)| !tags.is_expert(n))
            .count() as u64;
        for step in 0..STEPS {
            let mut want = counts(&replicated, step);
            let key = ("all_reduce".to_owned(), "world".to_owned());
            assert_eq!(
                want.get(&key),
                Some(&dense),
                "EP all-reduces each dense parameter"
            );
            want.remove(&key);
            want.insert(("all_gather".into(), "world".into()), 1);
            want.insert(("reduce_scatter".into(), "world".into()), 1);
            assert_eq!(counts(&sharded, step), want, "step {step}");
        }
    });
}

/// The three seam bugs of the issue, each caught against single device.
#[test]
fn planted_seam_bugs_are_caught() {
    lockstep_harness::run(4, |ctx| {
        let twice = run(
            ctx,
            "gpt",
            fsdp_tp(2),
            Some(SeamFault::ShardedGradsReducedOverDpTwice),
        );
        let early = run(
            ctx,
            "nested",
            pipeline(1, DataParallel::Shard),
            Some(SeamFault::ReduceGradBeforeLastMicrobatch),
        );
        let experts = run(
            ctx,
            "gpt_moe",
            Composition::ExpertData {
                ep: 2,
                data: DataParallel::Shard,
            },
            Some(SeamFault::ExpertsShardedOverDp),
        );
        // On a model with a weight tied across stages too: the early REDUCE_GRAD's tied
        // all-reduce must not hang the schedule.
        let early_tied = run(
            ctx,
            "gpt",
            pipeline(1, DataParallel::Shard),
            Some(SeamFault::ReduceGradBeforeLastMicrobatch),
        );
        if ctx.rank() == 0 {
            assert_differs(
                "PP×FSDP early REDUCE_GRAD, tied",
                &early_tied,
                &single("gpt", 4),
            );
            assert_differs("TP shards reduced over dp twice", &twice, &single("gpt", 4));
            assert_differs("PP×FSDP early REDUCE_GRAD", &early, &single("nested", 4));
            assert_differs("experts sharded over dp", &experts, &single("gpt_moe", 4));
        }
    });
}

fn refused(model: &str, world: usize, c: Composition) -> String {
    let m = zoo::build(model, 0, 0).expect("model");
    match check_composition(m.as_ref(), world, c) {
        Ok(mesh) => panic!("{c:?} at world {world} was accepted as {mesh:?}"),
        Err(e) => e.to_string(),
    }
}

/// Meshes that do not fit the world, and plans that cannot compose, are refused before any
/// rank starts, naming the dimensions.
#[test]
fn invalid_meshes_and_compositions_are_refused_before_spawn() {
    let msg = refused("gpt", 6, pipeline(2, DataParallel::Replicate));
    assert!(
        msg.contains("world size 6") && msg.contains("pp=2") && msg.contains("tp=2"),
        "{msg}"
    );
    let msg = refused(
        "gpt",
        4,
        Composition::Pipeline {
            cp: 1,
            ep: 1,
            pp: 2,
            tp: 2,
            data: DataParallel::Replicate,
            schedule: ScheduleKind::OneFOneB,
            min_data: 2,
            checkpoint_every: None,
        },
    );
    assert!(msg.contains("dp=1") && msg.contains("dp ≥ 2"), "{msg}");
    let msg = refused(
        "gpt",
        6,
        Composition::TensorData {
            tp: 2,
            data: DataParallel::HybridShard { replicas: 2 },
        },
    );
    assert!(
        msg.contains("dp_replicate") && msg.contains("3 ranks"),
        "{msg}"
    );
    let msg = refused("gpt", 4, fsdp_tp(3));
    assert!(
        msg.contains("world size 4") && msg.contains("tp=3"),
        "{msg}"
    );
    let msg = refused("nested", 4, fsdp_tp(2));
    assert!(msg.contains("nested"), "{msg}");
    let msg = refused(
        "gpt",
        4,
        Composition::Pipeline {
            cp: 1,
            ep: 1,
            pp: 2,
            tp: 1,
            data: DataParallel::Shard,
            schedule: ScheduleKind::Interleaved1F1B,
            min_data: 1,
            checkpoint_every: None,
        },
    );
    assert!(msg.contains("one stage per rank"), "{msg}");
    let msg = refused(
        "gpt",
        4,
        Composition::ExpertData {
            ep: 2,
            data: DataParallel::Shard,
        },
    );
    assert!(msg.contains("no mixture-of-experts layer"), "{msg}");
    let msg = refused("moe", 2, fsdp_tp(1));
    assert!(msg.contains("rank-local"), "{msg}");
    // The error type names which part refused.
    let m = zoo::build("gpt", 0, 0).expect("model");
    assert!(matches!(
        check_composition(m.as_ref(), 6, fsdp_tp(4)),
        Err(CompositionError::Mesh(_))
    ));
}

/// HSDP×TP on [dp_replicate=2, dp_shard=2, tp=2] and PP×TP×DP on [dp=2, pp=2, tp=2]: the
/// 3-D compositions at world 8 (8 ranks on this machine's cores: correctness, not speed)
/// agree with single device; HSDP adds one all-reduce across replicas to FSDP's per-step
/// all-gather and reduce-scatter on the shard group; and HSDP×TP is bitwise equal to TP with
/// replicated parameters averaged in HSDP's order (`DataParallel::HybridReplicate`), the
/// matrix's `tp.2.hybrid_order`.
#[test]
fn three_dimensional_compositions_at_world_8() {
    lockstep_harness::run(8, |ctx| {
        let hsdp = run(
            ctx,
            "gpt",
            Composition::TensorData {
                tp: 2,
                data: DataParallel::HybridShard { replicas: 2 },
            },
            None,
        );
        let pp_tp_dp = run(
            ctx,
            "gpt_moe",
            Composition::Pipeline {
                cp: 1,
                ep: 1,
                pp: 2,
                tp: 2,
                data: DataParallel::Replicate,
                schedule: ScheduleKind::OneFOneB,
                min_data: 2,
                checkpoint_every: None,
            },
            None,
        );
        let ordered = run(
            ctx,
            "gpt",
            Composition::TensorData {
                tp: 2,
                data: DataParallel::HybridReplicate { replicas: 2 },
            },
            None,
        );
        assert_agree(
            "hsdp×tp vs tp averaged in hsdp's order",
            &hsdp,
            &ordered,
            &TolerancePolicy::bitwise(DType::F32),
        );
        for step in 0..STEPS {
            assert_eq!(
                counts(&hsdp, step),
                expect(&[
                    ("all_gather", "dp_shard", 1),
                    ("all_reduce", "dp_replicate", 1),
                    ("all_reduce", "tp", 1 + 4 + 3 + 4 + 1),
                    ("reduce_scatter", "dp_shard", 1),
                ]),
                "step {step}"
            );
        }
        if ctx.rank() == 0 {
            assert_agree(
                "hsdp×tp vs single",
                &hsdp,
                &single("gpt", 8),
                &TolerancePolicy::dtype_table(DType::F32),
            );
            assert_agree(
                "pp×tp×dp vs single",
                &pp_tp_dp,
                &single("gpt_moe", 8),
                &pipeline_policy(),
            );
        }
    });
}

/// PP×TP on [dp=1, pp=2, tp=2], dense decoder: per microbatch (4 per step) each stage's TP
/// group runs its layers' all-reduces — the embedding's 1 on the first stage; per block 2
/// forward (row-parallel wo, w2) and 2 backward (the column-parallel entries of q/k/v and
/// w1); the output projection's backward 1 and the loss's 3 on the last stage. The tied
/// embedding adds one all-reduce per step among its holders; nothing runs on dp (size 1).
/// Across the stage boundary each microbatch's activation goes one way and its gradient
/// back, after the step's shape handshake (the shapes one way, the verdict back): 5 sends
/// and 5 receives on each stage.
#[test]
fn pp_x_tp_collective_counts_are_exact() {
    lockstep_harness::run(4, |ctx| {
        let record = run(ctx, "gpt", pipeline(2, DataParallel::Replicate), None);
        let m = zoo::build("gpt", 0, 0).expect("model");
        let plan = lockstep_core::pipeline::plan_pipeline(
            m.as_ref(),
            2,
            &lockstep_core::pipeline::PipelineOptions {
                microbatches: 4,
                ..Default::default()
            },
        )
        .expect("plan");
        let layers = m.layers();
        let pp_rank = (ctx.rank() / 2) % 2;
        let stage = plan.stage_ranks.iter().position(|&r| r == pp_rank).unwrap();
        let per_microbatch: u64 = plan.stages[stage]
            .clone()
            .map(|l| match layers[l].name.as_str() {
                "tok_embeddings" => 1,
                "output" => 1 + 3,
                n if n.starts_with("layers.") => 2 + 2,
                _ => 0,
            })
            .sum();
        let want = expect(&[
            ("all_reduce", "tp", 4 * per_microbatch),
            ("all_reduce", "pp-tied", 1),
        ]);
        for step in 0..STEPS {
            assert_eq!(
                boundary(&record, step),
                (want.clone(), Some(4 + 1), Some(4 + 1)),
                "rank {} step {step}",
                ctx.rank()
            );
        }
    });
}

/// torchtitan's whole order in one pipeline at world 8, on [dp=2, pp=2, tp=2]: each stage
/// tensor-parallel, activations recomputed every layer in backward, then its TP-local
/// parameters one FSDP unit over dp. Equal bit for bit to the same pipeline without
/// checkpointing (recomputation replays the forward exactly) and agreeing with single.
#[test]
fn pp_x_tp_x_fsdp_with_activation_checkpointing_at_world_8() {
    let composed = |checkpoint_every| Composition::Pipeline {
        cp: 1,
        ep: 1,
        pp: 2,
        tp: 2,
        data: DataParallel::Shard,
        schedule: ScheduleKind::OneFOneB,
        min_data: 2,
        checkpoint_every,
    };
    lockstep_harness::run(8, |ctx| {
        let checkpointed = run(ctx, "gpt", composed(Some(1)), None);
        let kept = run(ctx, "gpt", composed(None), None);
        if ctx.rank() == 0 {
            assert_agree(
                "pp×tp×fsdp with AC vs without",
                &checkpointed,
                &kept,
                &TolerancePolicy::bitwise(DType::F32),
            );
            assert_agree(
                "pp×tp×fsdp with AC vs single",
                &checkpointed,
                &single("gpt", 8),
                &pipeline_policy(),
            );
        }
    });
}
