//! The in-process references a run is judged against: the single-device run, its float64
//! shadow, the teacher-forced references of the step-local check, and the fp64 arbiter's
//! verdict over them. Computed in the launching process with the ranks' thread count.

use super::hand_back::{hand_back_record, read_record, RankError};
use super::settings::{run_spec, ModelBuilder, RunFailed, RunSettings};
use crate::configs::Config;
use lockstep_core::comm::Backend;
use lockstep_core::record::RunRecord;
use lockstep_core::train::single_device_reference;
use lockstep_harness::launch::{run_ranks, scratch_path};
use lockstep_harness::RankCtx;
use lockstep_models::{decisions, Model, OnDevice};

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
    if super::external::launch().is_some() {
        return shared_reference(reference);
    }
    if lockstep_harness::threads::forks_safely_after_reference() || settings.execs_ranks() {
        // An exec'd rank of a parity test re-runs the test only to reach its own launch.
        if super::self_exec::serving().is_some() {
            return Err(RunFailed::simple("not computed in an exec'd rank"));
        }
        lockstep_harness::threads::use_rank_threads();
        return reference();
    }
    let out = scratch_path("reference", 1);
    let body = |_: &RankCtx| -> Result<(), RankError> {
        let record = reference().map_err(|e| e.details)?;
        hand_back_record(&record, &out)
    };
    let launched = run_ranks(&settings.rank_launch(1, "reference", &out), &body);
    read_record(&out, launched, 0)
}

/// `reference` computed once for every rank: under an external launch, rank 0 computes it
/// (at the ranks' thread count) and every rank receives its record through the store, so
/// every rank judges against the very same bits (hosts may differ in CPU and so in
/// rounding) and the other ranks' cores stay free; elsewhere it runs here.
pub fn shared_reference(
    reference: &(dyn Fn() -> Result<RunRecord, RunFailed> + Sync),
) -> Result<RunRecord, RunFailed> {
    let Some(launch) = super::external::launch() else {
        return reference();
    };
    let out = scratch_path("reference", launch.world_size);
    let body = |ctx: &RankCtx| -> Result<(), RankError> {
        if ctx.rank() == 0 {
            let record = reference().map_err(|e| e.details)?;
            hand_back_record(&record, &out)?;
        }
        Ok(())
    };
    let launched = super::external::run(
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
    if super::self_exec::serving().is_some() {
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
        && super::external::launch().is_none()
        && super::self_exec::serving().is_none();
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
pub(super) fn forced_reference_of(reference: &str, world_size: usize) -> Option<Option<usize>> {
    let name = reference.strip_suffix(&format!("@{world_size}"))?;
    if name == Config::Single.name() {
        return Some(None);
    }
    let m = name.strip_prefix("single.mb")?.parse().ok()?;
    Some(Some(m))
}
