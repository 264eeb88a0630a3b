//! One training run: a model × configuration × world size, either the single-device
//! reference in this process or a fresh launch of forked ranks training under a built-in
//! configuration or a user's own closure. `lockstep matrix`, `lockstep run` and the
//! parity-test API all run through here, so a run means the same thing everywhere.
//!
//! Rank 0 hands its [`RunRecord`] back through a temporary JSON file; a run that fails (a
//! rank's error, a crash, a hang past the timeout) comes back as [`RunFailed`] carrying the
//! launcher's whole account (flight recorders and the desync diagnosis on a timeout).

use crate::configs::{Config, ModelParallelKind, Precision};
use crate::cross_rank::{attach_cross_rank, hand_back_digest, probe_for};
use crate::rank_error::{hand_back_json, take_handed_back, RankError};
use lockstep_core::comm::Backend;
use lockstep_core::ddp::{train_ddp, DdpOptions, Fault, GradReduction};
use lockstep_core::expert_parallel::train_expert_parallel;
use lockstep_core::fsdp::{hybrid_mesh, train_fsdp, train_fsdp_hybrid};
use lockstep_core::pipeline::train_pipeline;
use lockstep_core::record::{MemoryStats, RunRecord, RunSpec};
use lockstep_core::replica::distinct_parameters;
use lockstep_core::tensor_parallel::{train_tensor_parallel, TpOptions};
use lockstep_core::train::{single_device_reference, OptimizerConfig, TrainConfig};
use lockstep_harness::{launch, LaunchError, LaunchOptions, RankCommand, RankCtx, RankSpawn};
use lockstep_models::{decisions, zoo, Model, ModelError, OnDevice};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Builds one rank's model from the run seed and the rank: every rank (and the reference)
/// calls it, so it must give every rank the same initial parameters for shared weights.
pub type ModelBuilder<'a> = dyn Fn(u64, usize) -> Result<Box<dyn Model>, ModelError> + Sync + 'a;

/// A training closure run on every rank of a launch: it receives the rank's context (its
/// process groups), its model and the training settings, trains, and returns the run's
/// record (rank 0's is the one kept). Built-in configurations are such closures too.
pub type TrainFn<'a> =
    dyn Fn(&RankCtx, &dyn Model, &TrainConfig) -> Result<RunRecord, String> + Sync + 'a;

/// What every run of one comparison shares.
#[derive(Clone, Debug)]
pub struct RunSettings {
    /// Training steps.
    pub steps: usize,
    /// Run seed: parameters and batches derive from it.
    pub seed: u64,
    /// How long a launch may take before it is declared hung.
    pub timeout: Duration,
    /// Keep every gradient of every step in the record.
    pub record_grads: bool,
    /// The optimizer every run steps with.
    pub optimizer: OptimizerConfig,
    /// A planted bug for DDP runs (checker tests only).
    pub fault: Option<Fault>,
    /// The backend launched ranks communicate over, recorded in every run's spec. NCCL runs
    /// exec their ranks (CUDA cannot live in a forked child), each on its `LOCAL_RANK`'s GPU,
    /// and the single-device reference on GPU 0.
    pub backend: Backend,
    /// Start ranks as fresh processes of the `lockstep` binary (`lockstep rank`) instead of
    /// forking the launcher: what NCCL needs (always on there); on the CPU backend it proves
    /// the exec'd path gives the forked path's bits. Built-in configurations of zoo models
    /// only.
    pub exec_ranks: bool,
    /// Where ranks and the single-device reference compute ([`crate::device`]): CUDA always
    /// under NCCL; on the CPU backend CUDA on request, ranks sharing GPUs round robin.
    pub device: crate::device::ComputeDevice,
    /// Allow TF32 matrix products on CUDA (`--tf32`); off, CUDA computes in fp32.
    pub tf32: bool,
    /// Record every collective call, or corrupt one (sensitivity analysis: see
    /// [`crate::faults`]); applied to every group of every launched rank. Forked ranks only,
    /// one configuration per launch.
    pub faults: Option<crate::faults::FaultPlan>,
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            steps: 3,
            seed: 0,
            timeout: Duration::from_secs(120),
            record_grads: true,
            optimizer: OptimizerConfig::default(),
            fault: None,
            backend: Backend::Cpu,
            exec_ranks: false,
            device: crate::device::ComputeDevice::Cpu,
            tf32: false,
            faults: None,
        }
    }
}

impl RunSettings {
    /// Whether ranks are exec'd rather than forked: always when they compute on CUDA (CUDA
    /// cannot be used in a forked child), on the CPU on request.
    pub fn execs_ranks(&self) -> bool {
        self.exec_ranks || self.computes_on_cuda()
    }

    /// Whether ranks are `lockstep rank` processes (the CLI's exec'd ranks) rather than
    /// launched by [`run_launched`]: under NCCL and `--exec-ranks` always, on CUDA when this
    /// process is the `lockstep` binary (elsewhere, in a user's parity test, the test binary
    /// re-runs itself as the ranks: [`crate::self_exec`]).
    pub fn execs_lockstep_ranks(&self) -> bool {
        self.exec_ranks
            || self.backend == Backend::Nccl
            || (self.computes_on_cuda() && lockstep_program().is_ok())
    }

    /// Whether runs compute on CUDA (`--device cuda`, or NCCL).
    pub fn computes_on_cuda(&self) -> bool {
        self.device == crate::device::ComputeDevice::Cuda || self.backend == Backend::Nccl
    }

    /// Where the single-device reference computes: GPU 0 when runs compute on CUDA, else the
    /// CPU.
    pub fn reference_device(&self) -> tch::Device {
        if self.computes_on_cuda() {
            tch::Device::Cuda(0)
        } else {
            tch::Device::Cpu
        }
    }

    /// The environment exec'd ranks get on top of this process's: cuBLAS's fixed workspace
    /// when they compute on CUDA, NCCL's pinned algorithm and protocol under NCCL
    /// ([`lockstep_core::machine`]); a variable the user set is kept as set.
    pub fn rank_env(&self) -> Vec<(String, String)> {
        use lockstep_core::machine::{CUDA_DETERMINISM_ENV, NCCL_DETERMINISM_ENV};
        let nccl: &[(&str, &str)] = if self.backend == Backend::Nccl {
            &NCCL_DETERMINISM_ENV
        } else {
            &[]
        };
        let cuda: &[(&str, &str)] = if self.computes_on_cuda() {
            &CUDA_DETERMINISM_ENV
        } else {
            &[]
        };
        cuda.iter()
            .chain(nccl)
            .map(|&(key, value)| {
                let value = std::env::var(key).unwrap_or_else(|_| value.to_owned());
                (key.to_owned(), value)
            })
            .collect()
    }
}

/// Why a run produced no record: its own failure, kept whole for the reports.
#[derive(Clone, Debug)]
pub struct RunFailed {
    /// What failed, in one line.
    pub line: String,
    /// Everything the launcher reported.
    pub details: String,
    /// Whether the run outlived its timeout (a hang), rather than failing.
    pub timed_out: bool,
}

impl RunFailed {
    /// A failure whose one line is the whole story (nothing was launched).
    pub fn simple(text: impl Into<String>) -> Self {
        let line = text.into();
        RunFailed {
            details: line.clone(),
            line,
            timed_out: false,
        }
    }
}

impl std::fmt::Display for RunFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.details)
    }
}

impl std::error::Error for RunFailed {}

/// The builder of zoo model `name`.
pub fn zoo_builder(
    name: &str,
) -> impl Fn(u64, usize) -> Result<Box<dyn Model>, ModelError> + Sync + '_ {
    move |seed, rank| zoo::build(name, seed, rank)
}

/// What a run's record says it was.
pub fn run_spec(
    model: &str,
    config: &str,
    world_size: usize,
    dtype: &str,
    settings: &RunSettings,
) -> RunSpec {
    RunSpec {
        model: model.to_owned(),
        config: config.to_owned(),
        world_size,
        backend: match settings.backend {
            _ if config.starts_with("single") => "none",
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        }
        .into(),
        dtype: dtype.to_owned(),
        steps: settings.steps,
        seed: settings.seed,
    }
}

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
        if let Some(external) = crate::external::launch() {
            return run_external_rank(external, model_name, config, world_size, settings);
        }
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

/// The single-device reference over `world_size` ranks' batches, computed with the ranks'
/// thread count ([`in_process_reference`]).
pub fn run_single(
    model_name: &str,
    build: &ModelBuilder<'_>,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    in_process_reference(settings, &|| {
        let built = build(settings.seed, 0).map_err(|e| RunFailed::simple(e.to_string()))?;
        let built = OnDevice::new(built, settings.reference_device())
            .map_err(|e| RunFailed::simple(e.to_string()))?;
        let mut record = single_device_reference(
            &built,
            world_size,
            settings.steps,
            settings.optimizer,
            settings.record_grads,
        )
        .map_err(|e| RunFailed::simple(format!("single-device reference: {e}")))?;
        record.spec = run_spec(
            model_name,
            &Config::Single.at(world_size),
            world_size,
            "fp32",
            settings,
        );
        Ok(record)
    })
}

/// Computes a reference (`reference`, one process's training) with the ranks' intra-op
/// thread count ([`lockstep_harness::threads`]), so it never depends on the machine's core
/// count: in this process when that is fork-safe (one thread, the default; or exec'd ranks,
/// which nothing forks), else in a forked child of its own (a rank of a one-rank launch),
/// so this process, which forks ranks afterwards, never starts an OpenMP pool.
pub fn in_process_reference(
    settings: &RunSettings,
    reference: &(dyn Fn() -> Result<RunRecord, RunFailed> + Sync),
) -> Result<RunRecord, RunFailed> {
    if crate::external::launch().is_some() {
        return shared_reference(reference);
    }
    if lockstep_harness::threads::forks_safely_after_reference() || settings.execs_ranks() {
        // An exec'd rank of a parity test re-runs the test only to reach its own launch.
        if crate::self_exec::serving().is_some() {
            return Err(RunFailed::simple("not computed in an exec'd rank"));
        }
        lockstep_harness::threads::use_rank_threads();
        return reference();
    }
    let out = scratch_path("reference", 1);
    let body = |_: &RankCtx| -> Result<(), RankError> {
        let record = reference().map_err(|e| e.details)?;
        hand_back(&record, &out)
    };
    let launched = launch_forked(1, settings, "reference", &out, &body);
    read_record(&out, launched, 0)
}

/// `reference` computed once for every rank: under an external launch, rank 0 computes it
/// (at the ranks' thread count) and every rank receives its record through the store, so
/// every rank judges against the very same bits (hosts may differ in CPU and so in
/// rounding) and the other ranks' cores stay free; elsewhere it runs here.
pub fn shared_reference(
    reference: &(dyn Fn() -> Result<RunRecord, RunFailed> + Sync),
) -> Result<RunRecord, RunFailed> {
    let Some(launch) = crate::external::launch() else {
        return reference();
    };
    let out = scratch_path("reference", launch.world_size);
    let body = |ctx: &RankCtx| -> Result<(), RankError> {
        if ctx.rank() == 0 {
            let record = reference().map_err(|e| e.details)?;
            hand_back(&record, &out)?;
        }
        Ok(())
    };
    let launched = crate::external::run(
        launch,
        launch.world_size,
        Backend::Cpu,
        "reference",
        lockstep_core::comm::default_timeout(),
        &body,
    );
    read_record(&out, launched, 0)
}

/// The float64 shadow of the single-device reference over `world_size` ranks' batches, in
/// this process on the CPU: the fp64 arbiter's yardstick. The fp32 reference runs again first
/// to record its discrete decisions (top-k routing), which the shadow then replays, so the
/// two differ by rounding alone.
pub fn run_single_f64(
    model_name: &str,
    build: &ModelBuilder<'_>,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    if crate::self_exec::serving().is_some() {
        return Err(RunFailed::simple("not computed in an exec'd rank"));
    }
    let train = |model: Box<dyn Model>| {
        single_device_reference(
            model.as_ref(),
            world_size,
            settings.steps,
            settings.optimizer,
            settings.record_grads,
        )
        .map_err(|e| RunFailed::simple(format!("single-device reference: {e}")))
    };
    shared_reference(&|| {
        let mut record = shadow_f64(build, settings.seed, settings.reference_device(), train)?;
        record.spec = run_spec(
            model_name,
            &format!("single.f64@{world_size}"),
            world_size,
            "fp64",
            settings,
        );
        Ok(record)
    })
}

/// Runs `train` on a fresh fp32 model on `device` (where the fp32 reference computes, so the
/// decisions are the ones its kernels take) recording its decisions, then on a fresh float64
/// model on the CPU replaying them, and returns the float64 record. Errors when the two took
/// a different number of decisions (the model's control flow depends on values, and the
/// shadow would not measure rounding).
pub fn shadow_f64(
    build: &ModelBuilder<'_>,
    seed: u64,
    device: tch::Device,
    train: impl Fn(Box<dyn Model>) -> Result<RunRecord, RunFailed>,
) -> Result<RunRecord, RunFailed> {
    shadow_pair(build, seed, device, train).map(|(_, wide)| wide)
}

/// [`shadow_f64`] keeping both records: the fp32 run that recorded the decisions, and its
/// float64 shadow.
pub fn shadow_pair(
    build: &ModelBuilder<'_>,
    seed: u64,
    device: tch::Device,
    train: impl Fn(Box<dyn Model>) -> Result<RunRecord, RunFailed>,
) -> Result<(RunRecord, RunRecord), RunFailed> {
    let fresh = || build(seed, 0).map_err(|e| RunFailed::simple(e.to_string()));
    let on_device = || {
        let model = fresh()?;
        if device == tch::Device::Cpu {
            return Ok(model);
        }
        let placed = OnDevice::new(model, device).map_err(|e| RunFailed::simple(e.to_string()))?;
        Ok(Box::new(placed) as Box<dyn Model>)
    };
    let (fp32, tape) = decisions::recording(|| on_device().and_then(&train));
    let fp32 = fp32?;
    let wide = OnDevice::in_f64(fresh()?).map_err(|e| {
        RunFailed::simple(format!("the float64 shadow cannot widen the model: {e}"))
    })?;
    let min_gap = (!tape.is_empty()).then_some(tape.min_gap);
    let (record, rest) = decisions::replaying(tape, || train(Box::new(wide)));
    let mut record = record.map_err(|e| RunFailed {
        line: format!("float64 shadow: {}", e.line),
        ..e
    })?;
    record.routing_min_gap = min_gap;
    if rest.exhausted || !rest.is_empty() {
        return Err(RunFailed::simple(
            "float64 shadow: the model took a different number of routing decisions in \
             float64 than in fp32",
        ));
    }
    Ok((fp32, record))
}

/// The fp64 arbiter's verdict on `run` (of `world_size` ranks): its trajectory against the
/// float64 shadow `fp64` within the noise of the fp32 reference `fp32` and its fp32
/// variants `spread` ([`crate::spread`]), and where that fails, the step-local check
/// ([`step_local_verdict`]). The matrix and `ParityTest` both judge through here, so an
/// arbiter row gets one verdict in both. `log` receives every judged distance.
pub fn arbiter_verdict(
    (build, world_size, settings): (&ModelBuilder<'_>, usize, &RunSettings),
    run: &RunRecord,
    (fp32, spread, fp64): (&RunRecord, &[&RunRecord], &RunRecord),
    log: lockstep_harness::parity::ArbiterLog<'_>,
) -> lockstep_harness::parity::Comparison {
    use lockstep_harness::parity::{arbitrate_with_spread, ENVELOPE};
    let trajectory = arbitrate_with_spread(run, fp32, spread, fp64, &ENVELOPE, log);
    if trajectory.passed {
        return trajectory;
    }
    step_local_verdict(build, world_size, settings, run, fp32, &trajectory).unwrap_or(trajectory)
}

/// A run whose trajectory left the fp64 arbiter's envelope against the single-device
/// `reference` (`trajectory` is that verdict), judged again step by step from its own state
/// (the step-local check, docs/parity.md): the comparison against the teacher-forced reference
/// and its float64 shadow when every step passes there, noting where the trajectory left its
/// envelope; `None` (the trajectory's verdict stands) when the step-local check fails too,
/// does not apply (another envelope, no per-step gradients, a structural or cross-rank
/// mismatch) or cannot run in this process (references that must fork; an external launch,
/// whose ranks must all judge the same records; an exec'd rank).
pub fn step_local_verdict(
    build: &ModelBuilder<'_>,
    world_size: usize,
    settings: &RunSettings,
    run: &RunRecord,
    reference: &RunRecord,
    trajectory: &lockstep_harness::parity::Comparison,
) -> Option<lockstep_harness::parity::Comparison> {
    use lockstep_harness::parity::{arbitrate, ENVELOPE};
    let in_process =
        lockstep_harness::threads::forks_safely_after_reference() || settings.execs_ranks();
    let microbatches = forced_reference_of(&reference.spec.config, world_size)?;
    let applies = run.grads.is_some()
        && trajectory.structural.is_empty()
        && trajectory
            .cross_rank
            .as_ref()
            .is_none_or(|x| x.mismatch.is_none())
        && in_process
        && crate::external::launch().is_none()
        && crate::self_exec::serving().is_none();
    if !applies {
        return None;
    }
    let (fp32, fp64) =
        step_local_references(build, world_size, microbatches, run, settings).ok()?;
    let mut local = arbitrate(run, &fp32, &fp64, &ENVELOPE, None);
    if !local.passed {
        return None;
    }
    let left = trajectory.arbiter.as_ref().map_or_else(String::new, |a| {
        format!("{} (margin {:.3})", a.worst_at, a.worst.margin)
    });
    if let Some(summary) = local.arbiter.as_mut() {
        summary.trajectory_left = Some(left);
    }
    Some(local)
}

/// The step-local references of `run` (a run of `world_size` ranks of `model_name`, with
/// per-step gradients): the single-device reference forced along the run's trajectory
/// ([`lockstep_core::train::teacher_forced_reference`]) in fp32 and its float64 shadow
/// (the fp32 forcing's routing decisions replayed). Judged by the fp64 arbiter, they hold each
/// step to one step of rounding from the run's own state.
pub fn step_local_references(
    build: &ModelBuilder<'_>,
    world_size: usize,
    microbatches: Option<usize>,
    run: &RunRecord,
    settings: &RunSettings,
) -> Result<(RunRecord, RunRecord), RunFailed> {
    let failed = |e: String| RunFailed::simple(format!("step-local reference: {e}"));
    let train = |model: Box<dyn Model>| match microbatches {
        None => lockstep_core::train::teacher_forced_reference(
            model.as_ref(),
            world_size,
            run,
            settings.optimizer,
        )
        .map_err(|e| failed(e.to_string())),
        Some(m) => lockstep_core::pipeline::teacher_forced_microbatched(
            model.as_ref(),
            world_size,
            m,
            run,
            settings.optimizer,
        )
        .map_err(|e| failed(e.to_string())),
    };
    shadow_pair(build, settings.seed, settings.reference_device(), train)
}

/// Which one-process reference a row held to `reference` (a record's config, such as
/// `single@2` or `single.mb3@2`) is forced along for the step-local check: `Some(None)` the
/// single-device one, `Some(Some(m))` the one of `m` microbatches, `None` neither (another
/// envelope, such as a mixed-precision DDP run's).
fn forced_reference_of(reference: &str, world_size: usize) -> Option<Option<usize>> {
    let name = reference.strip_suffix(&format!("@{world_size}"))?;
    if name == Config::Single.name() {
        return Some(None);
    }
    let m = name.strip_prefix("single.mb")?.parse().ok()?;
    Some(Some(m))
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
        let faults = crate::faults::install_faults(ctx, settings, &mut cfg);
        let mut record = train(ctx, built.as_ref(), &cfg)?;
        faults.finish(&record)?;
        hand_back_digest(probe.as_ref(), &out)?;
        if rank == 0 {
            record.spec = spec.clone();
            hand_back(&record, &out)?;
        }
        Ok(())
    };
    let label = format!("{model_name}/{config}");
    let launched = launch_forked(world_size, settings, &label, &out, &body);
    read_record(&out, launched, world_size)
}

/// Fails this rank, naming the first tensor that differs, when the ranks built models with
/// different parameter or buffer names, shapes or dtypes: checked before any wrapper's first
/// collective, which would otherwise fail as an anonymous mismatched call (or hang). Not
/// under a fault plan, whose sites number the training's calls.
fn same_model_on_every_rank(
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
fn on_rank_device(
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
        || crate::self_exec::serving().is_some()
        || (crate::external::launch().is_none() && crate::self_exec::execs_here().unwrap_or(true))
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
                hand_back(&record, out)?;
            }
        }
        Ok(())
    };
    let label = format!("{model_name}/subtests@{world_size}");
    let mut failure = launch_forked(world_size, settings, &label, &outs[0], &body).err();
    let mut records: Vec<Option<RunRecord>> = outs
        .iter()
        .map(|out| {
            let mut record = take_handed_back(out)
                .and_then(|bytes| serde_json::from_slice::<RunRecord>(&bytes).ok());
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
/// zoo model `model_name`; rank 0's record comes back through a scratch file as from forked
/// ranks.
fn run_exec(
    model_name: &str,
    config: Config,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    // What the rank's command line cannot carry is refused, never dropped: a planted fault
    // (DDP runs are where it goes) and an optimizer other than the default.
    if settings.fault.is_some()
        && matches!(
            config,
            Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder
        )
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
    let program = lockstep_program()?;
    let out = scratch_path(model_name, world_size);
    if out.to_str().is_none() {
        return Err(RunFailed::simple(format!(
            "exec'd ranks are told their record's path on the command line, and {} is not \
             UTF-8: set TMPDIR to a UTF-8 path",
            out.display()
        )));
    }
    let run = crate::rank_cmd::RankRun::of(model_name, config, settings, &out);
    let opts = LaunchOptions {
        world_size,
        timeout: settings.timeout,
        backend: match settings.backend {
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        }
        .into(),
    };
    let args = run.args();
    // cuBLAS picks reduction orders per call unless its workspace is fixed, NCCL its algorithm
    // by size: the bitwise repeat rows need the same bits from a fresh process.
    let env = settings.rank_env();
    let command = |_rank: usize| RankCommand {
        program: program.clone(),
        args: args.clone(),
        env: env.clone(),
    };
    let launched = launch(&opts, RankSpawn::Exec(&command))
        .map(drop)
        .map_err(launch_failed);
    read_record(&out, launched, world_size)
}

/// The `lockstep` binary exec'd ranks run: `LOCKSTEP_BIN` if set, else this process's own
/// executable when it is `lockstep`.
fn lockstep_program() -> Result<PathBuf, RunFailed> {
    if let Some(path) = std::env::var_os("LOCKSTEP_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()
        .map_err(|e| RunFailed::simple(format!("finding this executable: {e}")))?;
    if exe.file_stem().is_some_and(|s| s == "lockstep") {
        Ok(exe)
    } else {
        Err(RunFailed::simple(format!(
            "exec'd ranks run the lockstep binary, and {} is not it: set LOCKSTEP_BIN",
            exe.display()
        )))
    }
}

/// A failed launch as a [`RunFailed`] carrying the launcher's whole account.
pub(crate) fn launch_failed(e: LaunchError) -> RunFailed {
    let details = e.to_string();
    RunFailed {
        line: one_line(&details),
        details,
        timed_out: matches!(e, LaunchError::Timeout(_)),
    }
}

/// Rank 0's record from `out` (removed), unless the launch failed, with the comparison of
/// the `world_size` ranks' state digests.
fn read_record(
    out: &Path,
    launched: Result<(), RunFailed>,
    world_size: usize,
) -> Result<RunRecord, RunFailed> {
    let read = take_handed_back(out);
    let mut record = None;
    let checked = launched.and_then(|()| {
        let bytes = read.ok_or_else(|| {
            RunFailed::simple(format!(
                "reading rank 0's record: nothing was handed back at {}",
                out.display()
            ))
        })?;
        record = Some(serde_json::from_slice::<RunRecord>(&bytes).map_err(|e| {
            RunFailed::simple(format!(
                "rank 0's record is unreadable ({e}); a non-finite value (a diverged run) \
                 cannot be carried in RunRecord JSON"
            ))
        })?);
        Ok(())
    });
    attach_cross_rank(record.as_mut(), out, world_size);
    checked?;
    record.ok_or_else(|| RunFailed::simple("rank 0 handed back no record"))
}

/// Built-in `config` of zoo model `model_name` with this process as one rank of an external
/// launch, training as an exec'd rank does ([`crate::rank_cmd::RankRun::train`]): under
/// NCCL on its `LOCAL_RANK`'s GPU (this process was never forked, so CUDA is usable), on the
/// CPU under `--exec-ranks`. Rank 0's record comes back through the run's store.
fn run_external_rank(
    external: &lockstep_core::comm::ExternalLaunch,
    model_name: &str,
    config: Config,
    world_size: usize,
    settings: &RunSettings,
) -> Result<RunRecord, RunFailed> {
    if settings.fault.is_some() || settings.faults.is_some() {
        return Err(RunFailed::simple(
            "a planted fault or fault plan runs in forked ranks only, not in exec'd or \
             NCCL ranks",
        ));
    }
    let out = scratch_path(model_name, world_size);
    let run = crate::rank_cmd::RankRun::of(model_name, config, settings, &out);
    let body = |ctx: &RankCtx| run.train(ctx);
    let label = format!("{model_name}/{}", config.at(world_size));
    let launched = crate::external::run(
        external,
        world_size,
        settings.backend,
        &label,
        settings.timeout,
        &body,
    );
    read_record(&out, launched, world_size)
}

/// Rank 0's record, written where the launching process reads it back.
pub(crate) fn hand_back(record: &RunRecord, out: &Path) -> Result<(), RankError> {
    hand_back_json("the record", out, record)
}

/// Forks `world_size` ranks on the CPU backend, each running `body`; a failed launch comes
/// back with the launcher's whole account. An NCCL run is refused, not forked: CUDA cannot
/// be used in a forked child (built-in configurations exec their ranks instead: `run_exec`).
/// Where fork is not safe (a multi-threaded `cargo test`), the ranks are re-runs of the
/// calling test instead ([`crate::self_exec`]; `label` names the launch for them, `out` is
/// where rank 0 writes its record). Under an external launch (torchrun, srun) nothing is
/// started: this process runs `body` as its own rank ([`crate::external`]).
fn launch_forked(
    world_size: usize,
    settings: &RunSettings,
    label: &str,
    out: &Path,
    body: &(dyn Fn(&RankCtx) -> Result<(), RankError> + Sync),
) -> Result<(), RunFailed> {
    if settings.backend != Backend::Cpu {
        return Err(RunFailed::simple(NCCL_RUNS_MISSING));
    }
    if let Some(external) = crate::external::launch() {
        return crate::external::run(
            external,
            world_size,
            settings.backend,
            label,
            settings.timeout,
            body,
        );
    }
    if let Some(launched) = crate::self_exec::launch_without_fork(
        world_size,
        settings.timeout,
        label,
        out,
        settings.faults.is_some(),
        settings.computes_on_cuda(),
        body,
    ) {
        return launched;
    }
    let opts = LaunchOptions {
        world_size,
        timeout: settings.timeout,
        backend: "cpu".into(),
    };
    launch(
        &opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, body)),
    )
    .map(drop)
    .map_err(launch_failed)
}

/// Why a training closure (a user's configuration, or subtests sharing one launch) cannot
/// run on NCCL, for every refusal to say the same thing.
pub const NCCL_RUNS_MISSING: &str = "a training closure runs in forked ranks, and CUDA cannot \
     be used in a forked child: on NCCL only built-in configurations of zoo models run, in \
     exec'd ranks (see docs/gpu.md)";

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
    if let Some(mp) = config.model_parallel_config() {
        return match mp.kind {
            ModelParallelKind::Tensor {
                tp,
                sequence_parallel,
            } => train_tensor_parallel(
                model,
                ctx.world(),
                cfg,
                &TpOptions {
                    tp,
                    sequence_parallel,
                    data_parallel: Default::default(),
                    fault: None,
                },
            )
            .map_err(|e| named(&e)),
            ModelParallelKind::Expert { ep, dispatcher } => {
                train_expert_parallel(model, ctx.world(), cfg, &mp.expert_options(ep, dispatcher))
                    .map_err(|e| named(&e))
            }
        };
    }
    if let Some(c) = config.composition_config() {
        return lockstep_core::compose::train_composed(
            model,
            ctx.world(),
            cfg,
            c.composition,
            None,
        )
        .map_err(|e| named(&e));
    }
    if let Some(p) = config.pipeline_config() {
        let opts = p.options(world_size)?;
        return train_pipeline(model, ctx.world(), cfg, &opts)
            .map(|run| run.record)
            .map_err(|e| named(&e));
    }
    if let Some(f) = config.fsdp_config() {
        let opts = f.options.clone();
        let fsdp = match f.layout.shard_size(world_size)? {
            None => train_fsdp(model, ctx.group(), cfg, opts),
            Some(shard) => train_fsdp_hybrid(model, ctx.world(), ctx.group(), shard, cfg, opts),
        };
        return fsdp.map_err(|e| named(&e));
    }
    if config == Config::Single {
        return Err("single is the in-process reference, not a launched configuration".into());
    }
    let opts = DdpOptions {
        fault: settings.fault.clone(),
        ..ddp_options(config, ctx)?
    };
    let mut record = train_ddp(model, ctx.group(), cfg, opts).map_err(|e| named(&e))?;
    record.memory = Some(replica_memory(model));
    Ok(record)
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
fn replica_memory(model: &dyn Model) -> MemoryStats {
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

/// The launcher's failure report runs over many lines; tables get its first one and the
/// first line naming a rank's message.
pub fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or("launch failed").to_owned();
    match lines.find(|l| l.contains("failed") || l.contains("error")) {
        Some(detail) if detail != first => format!("{first} {detail}"),
        _ => first,
    }
}

fn scratch_path(model: &str, world_size: usize) -> PathBuf {
    // An exec'd rank writes where its launcher reads, whichever launch it computes this for.
    if let Some(path) = crate::self_exec::record_path() {
        return path;
    }
    let safe: String = model
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    // Under an external launch the "file" is a store key, named alike on every rank.
    if let Some(path) = crate::external::scratch_path(&format!("{safe}-{world_size}")) {
        return path;
    }
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "lockstep-run-{}-{safe}-{world_size}-{nonce:x}.json",
        std::process::id()
    ))
}
