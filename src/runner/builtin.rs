//! The built-in configurations' rank body: from a catalog [`Config`] to the parallelism that
//! trains it, as data (`parallelism_of`), trained through core's one entry point
//! (`train_builtin`), and DDP's options per configuration.

use super::settings::{PlantedFault, RunSettings};
use crate::configs::{Config, ModelParallelKind, Precision};
use lockstep_core::ddp::{DdpOptions, GradReduction};
use lockstep_core::fsdp::hybrid_mesh;
use lockstep_core::parallelism::{train_parallel_planted, Parallelism};
use lockstep_core::record::{MemoryStats, RunRecord};
use lockstep_core::replica::distinct_parameters;
use lockstep_core::tensor_parallel::TpOptions;
use lockstep_core::train::TrainConfig;
use lockstep_harness::RankCtx;
use lockstep_models::Model;

/// One rank's training under built-in configuration `config` (not `single`): the
/// parallelism it names ([`parallelism_of`]) through core's one entry point. DDP's record
/// gains its memory figures, for scale next to FSDP's.
pub fn train_builtin(
    config: Config,
    ctx: &RankCtx,
    model: &dyn Model,
    cfg: &TrainConfig,
    settings: &RunSettings,
) -> Result<RunRecord, String> {
    let parallelism = parallelism_of(config, ctx, settings)?;
    let bug = settings.fault.as_ref().and_then(PlantedFault::field);
    let mut record = train_parallel_planted(model, ctx.world(), cfg, &parallelism, bug)
        .map_err(|e| format!("{}: {e}", config.name()))?;
    if let Parallelism::Ddp(_) = parallelism {
        record.memory = Some(replica_memory(model));
    }
    Ok(record)
}

/// The parallelism built-in configuration `config` names at this rank's world size: the
/// catalog's row read as core's [`Parallelism`]. A planted DDP fault goes into DDP runs only
/// (mixed precision included): the others are checked against DDP. A field bug is planted by
/// [`train_builtin`] in every loop that has its mechanism.
pub fn parallelism_of(
    config: Config,
    ctx: &RankCtx,
    settings: &RunSettings,
) -> Result<Parallelism, String> {
    let world_size = ctx.world_size();
    Ok(match config {
        Config::ModelParallel(id) => {
            let mp = id.get();
            match mp.kind {
                ModelParallelKind::Tensor {
                    tp,
                    sequence_parallel,
                } => Parallelism::Tensor(TpOptions {
                    tp,
                    sequence_parallel,
                    data_parallel: Default::default(),
                    fault: None,
                }),
                ModelParallelKind::Expert { ep, dispatcher } => {
                    Parallelism::Expert(mp.expert_options(ep, dispatcher))
                }
                ModelParallelKind::Context { .. } => Parallelism::Context(
                    mp.context_options()
                        .ok_or_else(|| format!("{}: not a context-parallel row", mp.name))?,
                ),
            }
        }
        Config::Composed(id) => Parallelism::Composed(id.get().composition),
        Config::Pipeline(id) => Parallelism::Pipeline(id.get().options(world_size)?),
        Config::Fsdp(id) => {
            let f = id.get();
            Parallelism::Fsdp {
                options: f.options.clone(),
                shard_size: f.layout.shard_size(world_size)?,
            }
        }
        Config::Single => {
            return Err("single is the in-process reference, not a launched configuration".into())
        }
        Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder => {
            Parallelism::Ddp(DdpOptions {
                fault: settings.fault.as_ref().and_then(PlantedFault::ddp),
                ..ddp_options(config, ctx)?
            })
        }
    })
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
