//! The built-in configurations' rank body: from a catalog [`Config`] to the parallelism that
//! trains it (`train_builtin`), and DDP's options per configuration.

use super::settings::RunSettings;
use crate::configs::{Config, ModelParallelKind, Precision};
use lockstep_core::ddp::{train_ddp, DdpOptions, GradReduction};
use lockstep_core::expert_parallel::train_expert_parallel;
use lockstep_core::fsdp::{hybrid_mesh, train_fsdp, train_fsdp_hybrid};
use lockstep_core::pipeline::train_pipeline;
use lockstep_core::record::{MemoryStats, RunRecord};
use lockstep_core::replica::distinct_parameters;
use lockstep_core::tensor_parallel::{train_tensor_parallel, TpOptions};
use lockstep_core::train::TrainConfig;
use lockstep_harness::RankCtx;
use lockstep_models::Model;

/// One rank's training under built-in configuration `config` (not `single`). The planted
/// fault, if any, goes into DDP runs only (mixed precision included): the others are checked
/// against DDP.
pub fn train_builtin(
    config: Config,
    ctx: &RankCtx,
    model: &dyn Model,
    cfg: &TrainConfig,
    settings: &RunSettings,
) -> Result<RunRecord, String> {
    let world_size = ctx.world_size();
    let named = |e: &dyn std::fmt::Display| format!("{}: {e}", config.name());
    match config {
        Config::ModelParallel(id) => {
            let mp = id.get();
            match mp.kind {
                ModelParallelKind::Tensor {
                    tp,
                    sequence_parallel,
                } => {
                    let opts = TpOptions {
                        tp,
                        sequence_parallel,
                        data_parallel: Default::default(),
                        fault: None,
                    };
                    train_tensor_parallel(model, ctx.world(), cfg, &opts).map_err(|e| named(&e))
                }
                ModelParallelKind::Expert { ep, dispatcher } => {
                    let opts = mp.expert_options(ep, dispatcher);
                    train_expert_parallel(model, ctx.world(), cfg, &opts).map_err(|e| named(&e))
                }
            }
        }
        Config::Composed(id) => {
            let composition = id.get().composition;
            lockstep_core::compose::train_composed(model, ctx.world(), cfg, composition, None)
                .map_err(|e| named(&e))
        }
        Config::Pipeline(id) => {
            let opts = id.get().options(world_size)?;
            train_pipeline(model, ctx.world(), cfg, &opts)
                .map(|run| run.record)
                .map_err(|e| named(&e))
        }
        Config::Fsdp(id) => {
            let f = id.get();
            let opts = f.options.clone();
            let fsdp = match f.layout.shard_size(world_size)? {
                None => train_fsdp(model, ctx.group(), cfg, opts),
                Some(shard) => train_fsdp_hybrid(model, ctx.world(), ctx.group(), shard, cfg, opts),
            };
            fsdp.map_err(|e| named(&e))
        }
        Config::Single => {
            Err("single is the in-process reference, not a launched configuration".into())
        }
        Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder => {
            let opts = DdpOptions {
                fault: settings.fault.clone(),
                ..ddp_options(config, ctx)?
            };
            let mut record = train_ddp(model, ctx.group(), cfg, opts).map_err(|e| named(&e))?;
            record.memory = Some(replica_memory(model));
            Ok(record)
        }
    }
}

/// The bucket size of the built-in DDP configurations: small, so that every zoo model past
/// 8 KiB of parameters reduces in several buckets and the bucket boundaries run in every
/// matrix (PyTorch's 25 MiB default would give every zoo model one bucket). The CPU backend
/// reduces each element in rank order whatever the message, so the bits do not depend on it.
pub const BUILTIN_DDP_BUCKET_BYTES: usize = 8 << 10;

/// The options of DDP-family configuration `config` on this rank (no fault): its
/// mixed-precision policy, and for `ddp.hybrid_order` hybrid shard's reduction on the very
/// mesh hybrid shard builds (every rank must call it at the same point: the mesh creates
/// process groups). `lockstep matrix`, `lockstep run` and exec'd ranks all build DDP here.
pub fn ddp_options(config: Config, ctx: &RankCtx) -> Result<DdpOptions, String> {
    let named = |e: &dyn std::fmt::Display| format!("{}: {e}", config.name());
    let mut opts = builtin_ddp_options(config)?;
    if config == Config::DdpHybridOrder {
        let shard = Config::hybrid_layout()
            .shard_size(ctx.world_size())?
            .ok_or_else(|| named(&"the hybrid layout has no shard groups"))?;
        let mesh = hybrid_mesh(ctx.world(), shard).map_err(|e| named(&e))?;
        opts.reduction = GradReduction::hierarchical(&mesh).map_err(|e| named(&e))?;
    }
    Ok(opts)
}

/// [`ddp_options`] short of the process groups a hierarchical reduction needs (its
/// `reduction` is `Flat` here): what each built-in DDP configuration chooses, readable
/// without a launch.
pub fn builtin_ddp_options(config: Config) -> Result<DdpOptions, String> {
    if !matches!(
        config,
        Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder
    ) {
        return Err(format!("{}: not a DDP configuration", config.name()));
    }
    Ok(DdpOptions {
        mixed_precision: config.precision().map(Precision::policy),
        // The reference of hybrid shard reduces after backward, not from backward hooks:
        // the other DDP path, checked bitwise against every hybrid row.
        overlap: config != Config::DdpHybridOrder,
        reduction: GradReduction::Flat,
        bucket_cap_bytes: BUILTIN_DDP_BUCKET_BYTES,
        ..DdpOptions::default()
    })
}

/// DDP's memory figures, for scale next to FSDP's: every rank keeps the whole model's
/// parameters all the time, so peak and "shard" are both the model's parameter bytes (tied
/// parameters once; rank-local experts included, which FSDP ignores and does not count).
pub(super) fn replica_memory(model: &dyn Model) -> MemoryStats {
    let bytes: u64 = distinct_parameters(model.named_parameters())
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum();
    MemoryStats {
        full_param_bytes_peak: bytes,
        shard_bytes: bytes,
        model_param_bytes: bytes,
    }
}
