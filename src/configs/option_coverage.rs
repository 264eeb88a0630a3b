//! Every public option of every parallelism runs in some row of the catalog.
//!
//! Each options struct is destructured without `..` and each enum matched without `_`, so a
//! new field or variant does not compile until it is listed here, and the test fails when no
//! configuration uses a listed choice. Choices no row can use say why, and which test drives
//! them instead.

use super::*;
use lockstep_core::compose::{Composition, DataParallel};
use lockstep_core::ddp::DdpOptions;
use lockstep_core::expert_parallel::{Dispatcher, EpOptions};
use lockstep_core::fsdp::{BackwardPrefetch, FsdpOptions, ShardingStrategy, WrapPolicy};
use lockstep_core::pipeline::{PartitionMethod, PipelineOptions, ScheduleChoice, ScheduleKind};
use std::collections::BTreeSet;

/// Choices no row of the matrix can make, each with the reason and where it is tested.
const NOT_IN_ROWS: &[(&str, &str)] = &[
    (
        "ddp.broadcast_buffers=false",
        "every rank then keeps its own BatchNorm statistics, which no reference has \
         (core/tests/ddp.rs)",
    ),
    (
        "ddp.comm_hook",
        "a user's extension point, replacing the reduction (tests/arbiter_sensitivity.rs, \
         core/tests/ddp.rs)",
    ),
    (
        "fsdp.wrap=Explicit",
        "names one model's layers (core/tests/fsdp_units.rs)",
    ),
    (
        "pipeline.partition=Splits",
        "names one model's layer counts (core/tests/pipeline.rs)",
    ),
    (
        "pipeline.schedule=Custom",
        "a schedule given as data (tests/schedule_cli.rs, core/tests/pipeline.rs)",
    ),
    (
        "cp.data=HybridShard",
        "HSDP beside CP needs dp_replicate × dp_shard × cp ≥ 8 ranks to mean anything, past \
         the default worlds 2 and 4: a user's mesh runs it (`--mesh \
         dp_replicate=2,dp_shard=2,cp=2`, tests/meshes.rs, tests/context_parallel.rs)",
    ),
    (
        "pp.data=HybridShard",
        "HSDP around a pipeline needs dp_replicate × dp_shard × pp ≥ 8 ranks, past the \
         default worlds: a user's mesh runs it (`--mesh pp=2,dp_replicate=2,dp_shard=2,cp=2`, \
         tests/meshes.rs)",
    ),
];

fn ddp_choices(o: DdpOptions, hierarchical: bool, used: &mut BTreeSet<String>) {
    let d = DdpOptions::default();
    let DdpOptions {
        bucket_cap_bytes,
        broadcast_buffers,
        overlap,
        comm_hook,
        fault: _,
        mixed_precision,
        reduction: _,
    } = o;
    // One bucket per model is what small models get under any cap; several need a small one.
    if bucket_cap_bytes < d.bucket_cap_bytes {
        used.insert("ddp.bucket_cap_bytes=small".into());
    }
    used.insert(format!("ddp.broadcast_buffers={broadcast_buffers}"));
    used.insert(format!("ddp.overlap={overlap}"));
    if comm_hook.is_some() {
        used.insert("ddp.comm_hook".into());
    }
    used.insert(format!("ddp.mixed_precision={}", mixed_precision.is_some()));
    used.insert(format!("ddp.hierarchical={hierarchical}"));
}

fn fsdp_choices(o: FsdpOptions, used: &mut BTreeSet<String>) {
    let FsdpOptions {
        strategy,
        reshard_after_forward,
        sync_module_states,
        wrap,
        backward_prefetch,
        forward_prefetch,
        offload_params,
        mixed_precision,
        fault: _,
    } = o;
    let strategy = match strategy {
        ShardingStrategy::FullShard => "FullShard",
        ShardingStrategy::ShardGradOp => "ShardGradOp",
        ShardingStrategy::NoShard => "NoShard",
        ShardingStrategy::HybridShard => "HybridShard",
    };
    let wrap = match wrap {
        WrapPolicy::Root => "Root",
        WrapPolicy::PerLayer => "PerLayer",
        WrapPolicy::ByKind(_) => "ByKind",
        WrapPolicy::MinParams(_) => "MinParams",
        WrapPolicy::Explicit(_) => "Explicit",
    };
    used.insert(format!("fsdp.wrap={wrap}"));
    used.insert(format!("fsdp.strategy={strategy}×wrap={wrap}"));
    used.insert(format!(
        "fsdp.reshard_after_forward={reshard_after_forward}"
    ));
    used.insert(format!("fsdp.sync_module_states={sync_module_states}"));
    let prefetch = match backward_prefetch {
        BackwardPrefetch::None => "None",
        BackwardPrefetch::Pre => "Pre",
        BackwardPrefetch::Post => "Post",
    };
    used.insert(format!("fsdp.backward_prefetch={prefetch}"));
    used.insert(format!("fsdp.forward_prefetch={forward_prefetch}"));
    used.insert(format!("fsdp.offload_params={offload_params}"));
    used.insert(format!(
        "fsdp.mixed_precision={}",
        mixed_precision.is_some()
    ));
}

fn schedule_name(kind: ScheduleKind) -> &'static str {
    match kind {
        ScheduleKind::GPipe => "GPipe",
        ScheduleKind::OneFOneB => "OneFOneB",
        ScheduleKind::Interleaved1F1B => "Interleaved1F1B",
        ScheduleKind::LoopedBfs => "LoopedBfs",
        ScheduleKind::InterleavedZeroBubble => "InterleavedZeroBubble",
        ScheduleKind::Zbv => "Zbv",
        ScheduleKind::DualPipeV => "DualPipeV",
    }
}

fn pipeline_choices(o: PipelineOptions, used: &mut BTreeSet<String>) {
    let PipelineOptions {
        schedule,
        virtual_stages: _,
        microbatches: _,
        partition,
        checkpoint_every,
        data_parallel,
        fault: _,
    } = o;
    used.insert(match schedule {
        ScheduleChoice::Builtin(kind) => format!("pipeline.schedule={}", schedule_name(kind)),
        ScheduleChoice::Custom(_) => "pipeline.schedule=Custom".into(),
    });
    let partition = match partition {
        PartitionMethod::Uniform => "Uniform",
        PartitionMethod::Parameters => "Parameters",
        PartitionMethod::Type(_) => "Type",
        PartitionMethod::Splits(_) => "Splits",
    };
    used.insert(format!("pipeline.partition={partition}"));
    used.insert(format!(
        "pipeline.checkpoint={}",
        checkpoint_every.is_some()
    ));
    used.insert(format!("pipeline.data_parallel={}", data_parallel > 1));
}

fn data_name(data: DataParallel) -> &'static str {
    match data {
        DataParallel::Replicate => "Replicate",
        DataParallel::Shard => "Shard",
        DataParallel::HybridShard { .. } => "HybridShard",
        DataParallel::HybridReplicate { .. } => "HybridReplicate",
    }
}

fn expert_choices(o: EpOptions, used: &mut BTreeSet<String>) {
    let EpOptions {
        ep: _,
        dispatcher,
        capacity_factor,
        data_parallel,
        fault: _,
    } = o;
    let dispatcher = match dispatcher {
        Dispatcher::AllToAll => "AllToAll",
        Dispatcher::AllGather => "AllGather",
    };
    used.insert(format!("ep.dispatcher={dispatcher}"));
    used.insert(format!("ep.capacity={}", capacity_factor.is_some()));
    used.insert(format!("ep.data={}", data_name(data_parallel)));
}

fn composition_choices(c: Composition, used: &mut BTreeSet<String>) {
    match c {
        Composition::TensorData { data, .. } => {
            used.insert(format!("tp.data={}", data_name(data)));
        }
        Composition::Pipeline {
            tp,
            cp,
            ep,
            data,
            schedule,
            checkpoint_every,
            ..
        } => {
            used.insert(format!("pp.stage_tp={}", tp > 1));
            used.insert(format!("pp.stage_cp={}", cp > 1));
            used.insert(format!("pp.stage_ep={}", ep > 1));
            used.insert(format!("pp.data={}", data_name(data)));
            used.insert(format!("pipeline.schedule={}", schedule_name(schedule)));
            used.insert(format!(
                "pipeline.checkpoint={}",
                checkpoint_every.is_some()
            ));
        }
        Composition::ExpertData { data, .. } => {
            used.insert(format!("ep.data={}", data_name(data)));
        }
        Composition::ContextData { tp, ep, data, .. } => {
            used.insert(format!("cp.data={}", data_name(data)));
            used.insert(format!("cp.tp={}", tp > 1));
            used.insert(format!("cp.ep={}", ep > 1));
        }
    }
}

/// Every choice some row of the catalog makes.
fn used_choices() -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for config in Config::all().into_iter().chain(Config::references_only()) {
        if let Ok(o) = crate::runner::builtin_ddp_options(config) {
            ddp_choices(o, config == Config::DdpHybridOrder, &mut used);
        }
        if let Some(o) = config.fsdp_options() {
            fsdp_choices(o, &mut used);
        }
        if let Some(o) = config.pipeline_config().and_then(|p| p.options(4).ok()) {
            pipeline_choices(o, &mut used);
        }
        if let Some(c) = config.composition_config() {
            composition_choices(c.composition, &mut used);
        }
        if let Some(m) = config.model_parallel_config() {
            match m.kind {
                ModelParallelKind::Tensor {
                    sequence_parallel, ..
                } => {
                    used.insert(format!("tp.sequence_parallel={sequence_parallel}"));
                    used.insert("tp.data=Replicate".into());
                }
                ModelParallelKind::Expert { ep, dispatcher } => {
                    expert_choices(m.expert_options(ep, dispatcher), &mut used);
                }
                ModelParallelKind::Context {
                    dispatcher, layout, ..
                } => {
                    used.insert(format!("cp.dispatcher={dispatcher:?}"));
                    used.insert(format!("cp.layout={layout:?}"));
                    used.insert("cp.data=Replicate".into());
                    used.insert("cp.tp=false".into());
                    used.insert("cp.ep=false".into());
                }
            }
        }
    }
    used
}

/// Every choice the options offer, both sides of each switch.
fn every_choice() -> Vec<String> {
    let mut all: Vec<String> = Vec::new();
    let both = |name: &str| [format!("{name}=true"), format!("{name}=false")];
    all.push("ddp.bucket_cap_bytes=small".into());
    for name in [
        "ddp.broadcast_buffers",
        "ddp.overlap",
        "ddp.mixed_precision",
        "ddp.hierarchical",
        "fsdp.reshard_after_forward",
        "fsdp.sync_module_states",
        "fsdp.forward_prefetch",
        "fsdp.offload_params",
        "fsdp.mixed_precision",
        "pipeline.checkpoint",
        "pipeline.data_parallel",
        "pp.stage_tp",
        "pp.stage_cp",
        "pp.stage_ep",
        "cp.tp",
        "cp.ep",
        "tp.sequence_parallel",
        "ep.capacity",
    ] {
        all.extend(both(name));
    }
    all.push("ddp.comm_hook".into());
    let wraps = ["Root", "PerLayer", "ByKind", "MinParams"];
    for strategy in ["FullShard", "ShardGradOp", "NoShard", "HybridShard"] {
        for wrap in wraps {
            all.push(format!("fsdp.strategy={strategy}×wrap={wrap}"));
        }
    }
    all.push("fsdp.wrap=Explicit".into());
    for p in ["None", "Pre", "Post"] {
        all.push(format!("fsdp.backward_prefetch={p}"));
    }
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ] {
        all.push(format!("pipeline.schedule={}", schedule_name(kind)));
    }
    all.push("pipeline.schedule=Custom".into());
    for p in ["Uniform", "Parameters", "Type", "Splits"] {
        all.push(format!("pipeline.partition={p}"));
    }
    for d in ["AllToAll", "AllGather"] {
        all.push(format!("ep.dispatcher={d}"));
    }
    for d in ["Ring", "AllGather"] {
        all.push(format!("cp.dispatcher={d}"));
    }
    for l in ["Balanced", "Contiguous"] {
        all.push(format!("cp.layout={l}"));
    }
    for d in ["Replicate", "Shard", "HybridShard", "HybridReplicate"] {
        all.push(format!("tp.data={d}"));
    }
    for d in ["Replicate", "Shard"] {
        all.push(format!("ep.data={d}"));
    }
    for d in ["Replicate", "Shard", "HybridShard"] {
        all.push(format!("pp.data={d}"));
        all.push(format!("cp.data={d}"));
    }
    all
}

#[test]
fn every_public_option_of_every_parallelism_runs_in_some_row() {
    let used = used_choices();
    let exempt: BTreeSet<&str> = NOT_IN_ROWS.iter().map(|(c, _)| *c).collect();
    let missing: Vec<String> = every_choice()
        .into_iter()
        .filter(|c| !used.contains(c) && !exempt.contains(c.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "no configuration of the catalog makes these choices: {missing:?}"
    );
    // An exemption a row now covers is stale: drop it.
    let stale: Vec<&&str> = exempt.iter().filter(|c| used.contains(**c)).collect();
    assert!(stale.is_empty(), "exempted but used by a row: {stale:?}");
}
