//! Launching one run's ranks: the choice of launch mode (forked ranks, the test binary
//! re-executed, this binary exec'd per rank, or one rank of an external launch), the rank
//! body they run (model check, fault plan, training, hand-back), and reading rank 0's record
//! back.

use super::builtin::train_builtin;
use super::hand_back::{
    attach_cross_rank, decode_record, hand_back_digest, hand_back_record, probe_for, read_record,
    take_handed_back, RankError,
};
use super::references::run_single;
use super::settings::{
    lockstep_program, run_spec, ModelBuilder, PlantedFault, RunFailed, RunSettings, TrainFn,
};
use crate::configs::{Config, Precision};
use lockstep_core::record::RunRecord;
use lockstep_core::train::TrainConfig;
use lockstep_harness::launch::{run_ranks, scratch_path, shares_one_launch};
use lockstep_harness::{RankCommand, RankCtx};
use lockstep_models::{zoo, Model, OnDevice};
use std::path::PathBuf;

/// Runs built-in configuration `config` of `model` (named `model_name` in the record) at
/// `world_size`: the single-device reference in this process, anything else in a fresh
/// launch of forked ranks.
pub fn run_config(
    model_name: &str,
    build: &ModelBuilder<'_>,
    config: Config,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    if config == Config::Single {
        return run_single(model_name, build, world_size, settings);
    }
    if let Some(refusal) = config.world_refusal(world_size) {
        return Err(RunFailed::simple(refusal));
    }
    let probe = build(settings.seed, 0).map_err(|e| RunFailed::simple(e.to_string()))?;
    if let Some(refusal) = config.refusal(model_name, probe.as_ref(), world_size) {
        return Err(RunFailed::simple(refusal));
    }
    drop(probe);
    if settings.execs_lockstep_ranks() {
        return run_exec(model_name, config, world_size, settings);
    }
    let dtype = config.precision().map_or("fp32", Precision::label);
    let train = |ctx: &RankCtx, model: &dyn Model, cfg: &TrainConfig| {
        train_builtin(config, ctx, model, cfg, settings)
    };
    run_launched(
        model_name,
        &config.at(world_size),
        dtype,
        world_size,
        build,
        &train,
        settings,
    )
}

/// One fresh launch of `world_size` forked ranks, each building its model and calling
/// `train`; rank 0's record is returned with `config` (a row name such as `ddp@2`) in its
/// spec. The closure's error, a crash or a hang becomes [`RunFailed`].
pub fn run_launched(
    model_name: &str,
    config: &str,
    dtype: &str,
    world_size: usize,
    build: &ModelBuilder<'_>,
    train: &TrainFn<'_>,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    let out = scratch_path(model_name, world_size);
    let spec = run_spec(model_name, config, world_size, dtype, settings);
    let body = |ctx: &RankCtx| -> Result<(), RankError> {
        let rank = ctx.rank();
        let built = on_rank_device(build(settings.seed, rank)?, settings, ctx)?;
        same_model_on_every_rank(ctx, built.as_ref(), settings)?;
        let probe = probe_for(rank);
        let mut cfg = TrainConfig {
            spec: spec.clone(),
            optimizer: settings.optimizer,
            data_ranks: vec![rank],
            record_grads: settings.record_grads,
            probe: probe.clone(),
        };
        let faults = super::faults::install_faults(ctx, settings, &mut cfg);
        let mut record = train(ctx, built.as_ref(), &cfg)?;
        faults.finish(&record)?;
        hand_back_digest(probe.as_ref(), &out)?;
        if rank == 0 {
            record.spec = spec.clone();
            hand_back_record(&record, &out)?;
        }
        Ok(())
    };
    let label = format!("{model_name}/{config}");
    let launched = run_ranks(&settings.rank_launch(world_size, &label, &out), &body);
    read_record(&out, launched, world_size)
}

/// Fails this rank, naming the first tensor that differs, when the ranks built models with
/// different parameter or buffer names, shapes or dtypes: checked before any wrapper's first
/// collective, which would otherwise fail as an anonymous mismatched call (or hang). Not
/// under a fault plan, whose sites number the training's calls.
pub(super) fn same_model_on_every_rank(
    ctx: &RankCtx,
    model: &dyn Model,
    settings: &RunSettings,
) -> Result<(), RankError> {
    if settings.faults.is_some() {
        return Ok(());
    }
    let params = model.named_parameters();
    let device = lockstep_core::train::parameters_device(&params).unwrap_or(tch::Device::Cpu);
    let buffers = model.named_buffers();
    lockstep_core::replica::check_same_tensors(ctx.group().as_ref(), &params, &buffers, device)
        .map_err(|e| RankError::Train(e.to_string()))
}

/// `model` on the device its rank computes on: itself on the CPU; on CUDA moved to GPU
/// `rank % GPUs` after the process set CUDA's numerics ([`crate::device`]).
pub(super) fn on_rank_device(
    model: Box<dyn Model>,
    settings: &RunSettings,
    ctx: &RankCtx,
) -> Result<Box<dyn Model>, RankError> {
    if !settings.computes_on_cuda() {
        return Ok(model);
    }
    crate::device::prepare_process(settings.device, settings.backend, settings.tf32)
        .map_err(|e| RankError::Train(format!("setting CUDA's numerics: {e}")))?;
    let device = crate::device::rank_device(settings.device, settings.backend, ctx.local_rank());
    Ok(Box::new(OnDevice::new(model, device)?))
}

/// Runs built-in configurations `configs` (none of them `single`) of one model at
/// `world_size` in ONE launch, one after another with a barrier between them (PyTorch's
/// `run_subtests`): the ranks start once instead of once per configuration, which is most of
/// a small model's run time. Every configuration builds a fresh model, so none sees another's
/// state.
///
/// Rank 0 hands a configuration's record back only after the barrier that ends it, so a
/// record proves every rank finished that configuration. When the launch fails (an error, a
/// crash, a hang), the configurations with records keep them, the first one without is the
/// one that failed (it gets the launcher's whole account, flight recorders included), and
/// those after it, which never ran, run in launches of their own. A failure costs no rerun
/// and loses nothing.
pub fn run_configs_together(
    model_name: &str,
    build: &ModelBuilder<'_>,
    configs: &[Config],
    world_size: usize,
    settings: &RunSettings,
) -> Vec<Result<RunRecord, RunFailed>> {
    // A fault plan numbers one configuration's calls: each runs in a launch of its own.
    if configs.len() < 2
        || configs.contains(&Config::Single)
        || settings.execs_ranks()
        || settings.faults.is_some()
        || !shares_one_launch()
    {
        return configs
            .iter()
            .map(|&c| run_config(model_name, build, c, world_size, settings))
            .collect();
    }
    let outs: Vec<PathBuf> = (0..configs.len())
        .map(|i| scratch_path(&format!("{model_name}-{i}"), world_size))
        .collect();
    let body = |ctx: &RankCtx| -> Result<(), RankError> {
        let rank = ctx.rank();
        for (&config, out) in configs.iter().zip(&outs) {
            let built = build(settings.seed, rank)?;
            same_model_on_every_rank(ctx, built.as_ref(), settings)?;
            let dtype = config.precision().map_or("fp32", Precision::label);
            let spec = run_spec(
                model_name,
                &config.at(world_size),
                world_size,
                dtype,
                settings,
            );
            let probe = probe_for(rank);
            let cfg = TrainConfig {
                spec: spec.clone(),
                optimizer: settings.optimizer,
                data_ranks: vec![rank],
                record_grads: settings.record_grads,
                probe: probe.clone(),
            };
            let mut record = train_builtin(config, ctx, built.as_ref(), &cfg, settings)?;
            hand_back_digest(probe.as_ref(), out)?;
            // No rank starts the next configuration's collectives while another is still
            // in this one's, and past this point every rank has finished this one.
            ctx.group().barrier().map_err(|source| RankError::Comm {
                what: format!("barrier after {}", config.name()),
                source,
            })?;
            if rank == 0 {
                record.spec = spec;
                hand_back_record(&record, out)?;
            }
        }
        Ok(())
    };
    let label = format!("{model_name}/subtests@{world_size}");
    let launch = settings.rank_launch(world_size, &label, &outs[0]);
    let mut failure = run_ranks(&launch, &body).err();
    let mut records: Vec<Option<RunRecord>> = outs
        .iter()
        .map(|out| {
            let mut record = take_handed_back(out).and_then(|bytes| decode_record(&bytes).ok());
            attach_cross_rank(record.as_mut(), out, world_size);
            record
        })
        .collect();
    // A launch that failed after every configuration's barrier (past its timeout, or a
    // crash on the way out) did not end cleanly: the last configuration carries it.
    if failure.is_some() && records.iter().all(Option::is_some) {
        if let Some(last) = records.last_mut() {
            *last = None;
        }
    }
    let mut results = Vec::with_capacity(configs.len());
    for (&config, record) in configs.iter().zip(records) {
        results.push(match (record, failure.take()) {
            (Some(record), failure_after) => {
                failure = failure_after;
                Ok(record)
            }
            // The first configuration without a record is where the launch failed.
            (None, Some(failed)) => Err(failed),
            // A configuration after the failing one never ran, or the launch succeeded
            // but a record did not come back: run it alone.
            (None, None) => run_config(model_name, build, config, world_size, settings),
        });
    }
    results
}

/// One launch of `world_size` exec'd ranks (`lockstep rank`) training built-in `config` of
/// zoo model `model_name` (under an external launch, this process as one of them, training
/// as an exec'd rank does: [`super::rank_cmd::RankRun::train`]); rank 0's record comes back
/// as from forked ranks.
pub(super) fn run_exec(
    model_name: &str,
    config: Config,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    let external = super::external::launch().is_some();
    refuse_what_exec_cannot_carry(model_name, config, settings, external)?;
    let out = scratch_path(model_name, world_size);
    if out.to_str().is_none() && !external {
        return Err(RunFailed::simple(format!(
            "exec'd ranks are told their record's path on the command line, and {} is not \
             UTF-8: set TMPDIR to a UTF-8 path",
            out.display()
        )));
    }
    let run = super::rank_cmd::RankRun::of(model_name, config, settings, &out);
    let command = || -> Result<RankCommand, RunFailed> {
        Ok(RankCommand {
            program: lockstep_program()?,
            args: run.args(),
            // cuBLAS picks reduction orders per call unless its workspace is fixed, NCCL its
            // algorithm by size: the bitwise repeat rows need the same bits from a fresh
            // process.
            env: settings.rank_env(),
        })
    };
    let label = format!("{model_name}/{}", config.at(world_size));
    let launch = lockstep_harness::launch::RankLaunch {
        exec: Some(&command),
        ..settings.rank_launch(world_size, &label, &out)
    };
    let launched = run_ranks(&launch, &|ctx: &RankCtx| run.train(ctx));
    read_record(&out, launched, world_size)
}

/// What an exec'd rank's command line cannot carry is refused, never dropped: a planted
/// fault (DDP runs are where it goes; under an external launch a fault plan too, which
/// forked ranks only take), and a model outside the zoo.
fn refuse_what_exec_cannot_carry(
    model_name: &str,
    config: Config,
    settings: &RunSettings,
    external: bool,
) -> Result<(), RunFailed> {
    if external {
        if settings.fault.is_some() || settings.faults.is_some() {
            return Err(RunFailed::simple(
                "a planted fault or fault plan runs in forked ranks only, not in exec'd or \
                 NCCL ranks",
            ));
        }
        return Ok(());
    }
    let ddp = matches!(
        config,
        Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder
    );
    if matches!(&settings.fault, Some(PlantedFault::Ddp(_))) && ddp
        || matches!(&settings.fault, Some(PlantedFault::Field(_)))
    {
        return Err(RunFailed::simple(
            "a planted fault runs in forked ranks only (exec'd ranks take no fault)",
        ));
    }
    if !zoo::names().contains(&model_name) {
        return Err(RunFailed::simple(format!(
            "exec'd ranks (NCCL, --exec-ranks) build zoo models only; `{model_name}` is not one"
        )));
    }
    Ok(())
}
