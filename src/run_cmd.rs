//! `lockstep run`: one zoo model × one configuration at one world size, optionally started
//! from a PyTorch state dict (`--init`), writing the initial and final full state dicts under
//! PyTorch's names (`--save-init`, `--save-final`) and the per-step losses and gradient norms.
//!
//! Everything a user can get wrong (model, configuration, world size, every key of a
//! checkpoint, output directories) is checked before any rank starts, and nothing is written
//! then; state files are written atomically. A checkpoint `--save-final` wrote from `single`
//! or the DDP configurations carries the optimizer state and step, and a run started from it
//! continues exactly as an uninterrupted run would (docs/checkpoints.md says why the sharded
//! configurations do not).

use crate::checkpoint::{self, CheckpointError, OptimizerState};
use crate::configs::{Config, Precision};
use crate::runner::{self, RunSettings, TrainFn};
use lockstep_core::ddp::Ddp;
use lockstep_core::record::RunRecord;
use lockstep_core::train::{no_sync, train_from, OptimizerConfig, TrainConfig, TrainStart};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, Model, ModelError, ParamTags};
use serde::Serialize;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// What `lockstep run` was asked to do.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// Zoo model name.
    pub model: String,
    /// Configuration name (as `lockstep matrix --list` prints them).
    pub config: String,
    /// Ranks (for `single`: how many ranks' batches form the global batch).
    pub world_size: usize,
    /// Steps to train.
    pub steps: usize,
    /// Run seed; `None`: the checkpoint's when continuing one, else 0.
    pub seed: Option<u64>,
    /// A state dict (safetensors, PyTorch names) every rank starts from.
    pub init: Option<PathBuf>,
    /// Use only `init`'s weights: start at step 0 with a fresh optimizer even when it carries
    /// an optimizer state.
    pub restart: bool,
    /// Where to write the initial full state dict.
    pub save_init: Option<PathBuf>,
    /// Where to write the final full state dict (and its optimizer state next to it).
    pub save_final: Option<PathBuf>,
    /// How long the launch may take before it counts as hung.
    pub timeout: Duration,
    /// Where the run computes (`--device`; [`crate::device`]): on CUDA the ranks are exec'd,
    /// each on its GPU (round robin), and checkpoints are refused for now.
    pub device: crate::device::ComputeDevice,
    /// Allow TF32 on CUDA (`--tf32`).
    pub tf32: bool,
}

/// Why `lockstep run` stopped: bad input (nothing ran, nothing was written) or a failure
/// after the checks.
#[derive(Debug, thiserror::Error)]
pub enum RunCmdError {
    /// Bad input: an unknown name, a world size the configuration cannot use, a checkpoint
    /// that does not fit (each bad key named). Nothing ran and nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// The run itself failed (a rank's error, a crash, a hang).
    #[error("run failed: {0}")]
    Failed(String),
    /// Writing a state file failed.
    #[error("saving: {0}")]
    Save(#[source] Box<CheckpointError>),
}

impl RunCmdError {
    /// The process exit code: 2 for bad input, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            RunCmdError::Invalid(_) => 2,
            RunCmdError::Failed(_) | RunCmdError::Save(_) => 1,
        }
    }
}

/// What one `lockstep run` did: `--json` prints it as one object.
#[derive(Clone, Debug, Serialize)]
pub struct RunOutcome {
    /// The zoo model trained.
    pub model: String,
    /// The configuration it trained under.
    pub config: String,
    /// Ranks (for `single`, ranks' batches per step).
    pub world_size: usize,
    /// The run seed batches derived from.
    pub seed: u64,
    /// Index of the first step trained (0, or the step a continued checkpoint ended at).
    pub start_step: usize,
    /// Steps trained.
    pub steps: usize,
    /// Global loss per step trained.
    pub losses: Vec<f64>,
    /// Global gradient norm per step trained (after synchronization).
    pub grad_norms: Vec<f64>,
    /// The checkpoint the run started from.
    pub init: Option<PathBuf>,
    /// Whether the run continued `init`'s optimizer state (at its step).
    pub resumed: bool,
    /// Where the initial state dict was written.
    pub saved_init: Option<PathBuf>,
    /// Where the final state dict was written.
    pub saved_final: Option<PathBuf>,
    /// Where the final optimizer state was written (next to `saved_final`).
    pub saved_optimizer_state: Option<PathBuf>,
    /// Things a user should know (a seed that differs from the checkpoint's...).
    pub notes: Vec<String>,
    /// Where the numbers were computed (CPU capability, intra-op threads, libtorch), as
    /// every report records it.
    pub environment: lockstep_harness::report::Environment,
}

/// Whether `config` can export and load its optimizer state: the configurations whose
/// every rank holds the whole model and steps it with one optimizer.
fn can_continue(config: Config) -> bool {
    matches!(
        config,
        Config::Single | Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder
    )
}

/// Why `config` cannot continue an optimizer state (for configurations that cannot).
fn why_not_continued(config: Config) -> String {
    let how = if config.is_fsdp() {
        "FSDP keeps each rank's optimizer state for its own parameter shard"
    } else if config.is_pipeline() {
        "each pipeline rank keeps the optimizer state of its own stages only"
    } else {
        "tensor-parallel, expert-parallel and composed ranks keep the optimizer state of their \
         own slices or shards of the weights"
    };
    format!(
        "{} cannot continue an optimizer state: {how}, and lockstep run does not gather or \
         split it (single, ddp, ddp.bf16, ddp.fp16 and ddp.hybrid_order can)",
        config.name()
    )
}

/// The configuration `opts` names, once the options that need no model are checked.
fn check_options(opts: &RunOptions) -> Result<Config, RunCmdError> {
    let invalid = RunCmdError::Invalid;
    let config = Config::by_name(&opts.config).ok_or_else(|| {
        let known: Vec<&str> = Config::all().into_iter().map(Config::name).collect();
        invalid(format!(
            "unknown config `{}`{}; known configs: {}",
            opts.config,
            crate::suggest::did_you_mean(&opts.config, &known),
            known.join(", ")
        ))
    })?;
    if opts.world_size == 0 {
        return Err(invalid("--world-size 0: must be at least 1".into()));
    }
    if let Some(refusal) = config.world_refusal(opts.world_size) {
        return Err(invalid(refusal));
    }
    for path in [&opts.save_init, &opts.save_final].into_iter().flatten() {
        check_writable(path)?;
    }
    if opts.device == crate::device::ComputeDevice::Cuda {
        if opts.init.is_some() || opts.save_init.is_some() || opts.save_final.is_some() {
            return Err(invalid(
                "checkpoints (--init, --save-init, --save-final) are not supported with \
                 --device cuda yet: their ranks fork on the CPU"
                    .into(),
            ));
        }
        let external = crate::runner::external::launch().map(|l| l.local_rank);
        let reasons = crate::device::blockers(
            opts.device,
            lockstep_core::comm::Backend::Cpu,
            opts.world_size,
            external,
        );
        if !reasons.is_empty() {
            return Err(invalid(format!(
                "--device cuda cannot run here: {}",
                reasons.join("; ")
            )));
        }
    }
    if let (Some(a), Some(b)) = (&opts.save_init, &opts.save_final) {
        if a == b {
            return Err(invalid(format!(
                "--save-init and --save-final both name {}: the final state would overwrite \
                 the initial one",
                a.display()
            )));
        }
    }
    Ok(config)
}

/// Checks everything, runs, writes the requested files and returns what happened.
pub fn run(opts: &RunOptions) -> Result<RunOutcome, RunCmdError> {
    let config = check_options(opts)?;
    let mut notes = Vec::new();
    let optimizer = OptimizerConfig::default();
    let resume = check_model_and_init(opts, config, optimizer, &mut notes)?;
    let seed = settle_seed(opts, resume.as_ref().map(|(_, state)| state), &mut notes);
    let start_step = resume.as_ref().map_or(0, |(_, s)| s.step);

    let init = opts.init.as_deref();
    let build = move |seed: u64, rank: usize| -> Result<Box<dyn Model>, ModelError> {
        let mut model = zoo::build(&opts.model, seed, rank)?;
        if let Some(path) = init {
            model.load(path)?;
        }
        Ok(model)
    };
    let tags = save_initial_state(opts, &build, seed, start_step)?;

    let settings = run_settings(opts, seed, optimizer);
    crate::device::prepare_process(opts.device, settings.backend, opts.tf32)
        .map_err(|e| RunCmdError::Failed(format!("setting CUDA's numerics: {e}")))?;
    let (optimizer_file, resume_state) = match resume {
        Some((file, state)) => (Some(file), state.tensors),
        None => (None, Vec::new()),
    };
    let (record, final_optimizer) = train(
        opts,
        config,
        &build,
        &settings,
        start_step,
        (optimizer_file.as_deref(), resume_state),
    )?;

    let saved_optimizer_state = match &opts.save_final {
        Some(path) => {
            let finished = FinishedRun {
                config,
                seed,
                start_step,
                optimizer,
                record: &record,
                tags: &tags,
            };
            save_final_state(opts, path, &finished, final_optimizer, &mut notes)?
        }
        None => None,
    };
    Ok(RunOutcome {
        environment: lockstep_harness::report::environment(),
        model: opts.model.clone(),
        config: config.name().to_owned(),
        world_size: opts.world_size,
        seed,
        start_step,
        steps: opts.steps,
        losses: record.losses,
        grad_norms: record.grad_norms,
        init: opts.init.clone(),
        resumed: optimizer_file.is_some() || start_step > 0,
        saved_init: opts.save_init.clone(),
        saved_final: opts.save_final.clone(),
        saved_optimizer_state,
        notes,
    })
}

/// Checks the model and `--init` on a probe built here; returns the optimizer state to continue.
fn check_model_and_init(
    opts: &RunOptions,
    config: Config,
    optimizer: OptimizerConfig,
    notes: &mut Vec<String>,
) -> Result<Option<(PathBuf, OptimizerState)>, RunCmdError> {
    let invalid = RunCmdError::Invalid;
    let mut probe = zoo::build(&opts.model, opts.seed.unwrap_or(0), 0).map_err(|e| match e {
        ModelError::UnknownModel { name, known } => invalid(format!(
            "unknown model `{name}`{}; known models: {}",
            crate::suggest::did_you_mean(&name, &known),
            known.join(", ")
        )),
        other => invalid(other.to_string()),
    })?;
    if let Some(refusal) = config.refusal(&opts.model, probe.as_ref(), opts.world_size) {
        return Err(invalid(refusal));
    }
    match &opts.init {
        Some(init) => check_init(opts, config, probe.as_mut(), init, optimizer, notes),
        None => Ok(None),
    }
}

/// Builds rank 0's starting model for its tags (naming the final state), saving `--save-init`.
fn save_initial_state(
    opts: &RunOptions,
    build: &runner::ModelBuilder<'_>,
    seed: u64,
    start_step: usize,
) -> Result<ParamTags, RunCmdError> {
    let initial = build(seed, 0).map_err(|e| RunCmdError::Invalid(e.to_string()))?;
    let tags = initial.tags();
    if let Some(path) = &opts.save_init {
        let state = checkpoint::model_state_dict(initial.as_ref());
        checkpoint::save_model_state(path, &state, &opts.model, start_step, None)
            .map_err(save_failed)?;
    }
    Ok(tags)
}

/// The launch settings `lockstep run` trains with (CPU backend, no faults, no gradients kept).
fn run_settings(opts: &RunOptions, seed: u64, optimizer: OptimizerConfig) -> RunSettings {
    RunSettings {
        steps: opts.steps,
        seed,
        timeout: opts.timeout,
        record_grads: false,
        optimizer,
        fault: None,
        backend: lockstep_core::comm::Backend::Cpu,
        exec_ranks: false,
        device: opts.device,
        tf32: opts.tf32,
        faults: None,
    }
}

/// What a finished run settled and produced that its final state files record.
struct FinishedRun<'a> {
    config: Config,
    seed: u64,
    start_step: usize,
    optimizer: OptimizerConfig,
    record: &'a RunRecord,
    tags: &'a ParamTags,
}

/// Writes the final state dict to `path` and any optimizer state beside it; returns the latter.
fn save_final_state(
    opts: &RunOptions,
    path: &Path,
    run: &FinishedRun<'_>,
    final_optimizer: Option<OptimizerTensors>,
    notes: &mut Vec<String>,
) -> Result<Option<PathBuf>, RunCmdError> {
    let mut saved_optimizer_state = None;
    let end_step = run.start_step + opts.steps;
    let state = checkpoint::record_state_dict(run.record, run.tags).map_err(save_failed)?;
    let optimizer_name = match final_optimizer {
        Some(tensors) => {
            let file = checkpoint::optimizer_file_for(path);
            let saved = OptimizerState {
                step: end_step,
                seed: run.seed,
                world_size: opts.world_size,
                config: run.config.name().to_owned(),
                optimizer: run.optimizer,
                tensors,
            };
            checkpoint::save_optimizer_state(&file, &saved).map_err(save_failed)?;
            let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
            saved_optimizer_state = Some(file);
            name
        }
        None => {
            notes.push(format!(
                "{}: the final state holds weights only; --init from it starts at step 0 \
                 with a fresh optimizer",
                why_not_continued(run.config)
            ));
            None
        }
    };
    checkpoint::save_model_state(
        path,
        &state,
        &opts.model,
        end_step,
        optimizer_name.as_deref(),
    )
    .map_err(save_failed)?;
    Ok(saved_optimizer_state)
}

/// The run's seed: `--seed`, else the checkpoint's; notes where continuing differs from an
/// uninterrupted run (another seed, another world size).
fn settle_seed(
    opts: &RunOptions,
    resumed: Option<&OptimizerState>,
    notes: &mut Vec<String>,
) -> u64 {
    let seed = match (resumed, opts.seed) {
        (Some(state), Some(seed)) if seed != state.seed => {
            notes.push(format!(
                "--seed {seed} differs from the checkpoint's seed {}: the continued run sees \
                 other batches than an uninterrupted one",
                state.seed
            ));
            seed
        }
        (Some(state), None) => state.seed,
        (_, seed) => seed.unwrap_or(0),
    };
    if let Some(state) = resumed {
        if state.world_size != opts.world_size {
            notes.push(format!(
                "world size {} differs from the checkpoint's {}: the continued run's global \
                 batch differs from an uninterrupted one's",
                opts.world_size, state.world_size
            ));
        }
    }
    seed
}

/// An optimizer's state by entry name, as checkpoints hold it.
type OptimizerTensors = Vec<(String, tch::Tensor)>;

/// Trains `config`: the references in this process, DDP-style configurations continuing
/// `resume` (an optimizer state file for the ranks, the tensors for `single`), everything
/// else through the launcher. Returns the record and the final optimizer state when the
/// configuration can continue one.
fn train(
    opts: &RunOptions,
    config: Config,
    build: &runner::ModelBuilder<'_>,
    settings: &RunSettings,
    start_step: usize,
    resume: (Option<&Path>, OptimizerTensors),
) -> Result<(RunRecord, Option<OptimizerTensors>), RunCmdError> {
    // The ranks' thread count for the reference computed here; one thread in a process
    // that forks ranks (`lockstep_harness::threads`).
    if config == Config::Single {
        lockstep_harness::threads::use_rank_threads();
    } else {
        lockstep_harness::threads::use_launcher_threads();
    }
    if settings.computes_on_cuda() {
        // Exec'd ranks on their GPUs (no checkpoints: refused before anything ran).
        let record = if config == Config::Single {
            runner::run_single(&opts.model, build, opts.world_size, settings)
        } else {
            runner::run_config(&opts.model, build, config, opts.world_size, settings)
        }
        .map_err(|e| RunCmdError::Failed(e.to_string()))?;
        return Ok((record, None));
    }
    Ok(if config == Config::Single {
        let (record, state) = run_single(
            &opts.model,
            build,
            opts.world_size,
            settings,
            start_step,
            resume.1,
        )?;
        (record, Some(state))
    } else if can_continue(config) {
        let (record, state) = run_ddp(
            &opts.model,
            build,
            config,
            opts.world_size,
            settings,
            start_step,
            resume.0,
        )?;
        (record, Some(state))
    } else {
        let record = runner::run_config(&opts.model, build, config, opts.world_size, settings)
            .map_err(|e| RunCmdError::Failed(e.to_string()))?;
        (record, None)
    })
}

/// Checks `--init` against the model (`probe`, which it is loaded into) and, when it carries
/// an optimizer state that is to be continued, that state against the model and the
/// configuration; returns the optimizer state file and its contents when continuing.
fn check_init(
    opts: &RunOptions,
    config: Config,
    probe: &mut dyn Model,
    init: &Path,
    optimizer: OptimizerConfig,
    notes: &mut Vec<String>,
) -> Result<Option<(PathBuf, OptimizerState)>, RunCmdError> {
    let rank_local = probe.tags().rank_local;
    if !rank_local.is_empty() {
        return Err(RunCmdError::Invalid(format!(
            "model `{}` has per-rank parameters ({}): one state dict cannot start every rank",
            opts.model,
            rank_local.join(", ")
        )));
    }
    let info = checkpoint::load_model_state(probe, init)
        .map_err(|e| RunCmdError::Invalid(e.to_string()))?;
    match (&info.optimizer_file, opts.restart) {
        (Some(file), false) => {
            if !can_continue(config) {
                return Err(RunCmdError::Invalid(format!(
                    "{} carries an optimizer state to continue from, but {}; pass --restart \
                     to start from its weights at step 0 with a fresh optimizer",
                    init.display(),
                    why_not_continued(config)
                )));
            }
            let state = checkpoint::load_optimizer_state(file, &*probe)
                .map_err(|e| RunCmdError::Invalid(e.to_string()))?;
            if state.optimizer != optimizer {
                return Err(RunCmdError::Invalid(format!(
                    "{}: saved by optimizer {:?}, but this run steps with {optimizer:?}",
                    file.display(),
                    state.optimizer
                )));
            }
            Ok(Some((file.clone(), state)))
        }
        (Some(_), true) => {
            notes.push(format!(
                "--restart: starting from {}'s weights at step 0 with a fresh optimizer",
                init.display()
            ));
            Ok(None)
        }
        (None, _) => {
            if let Some(step) = info.step.filter(|&s| s > 0) {
                notes.push(format!(
                    "{} holds weights after {} but no optimizer state: starting at step 0 \
                     with a fresh optimizer",
                    init.display(),
                    lockstep_harness::report::plural(step, "step")
                ));
            }
            Ok(None)
        }
    }
}

fn save_failed(e: CheckpointError) -> RunCmdError {
    RunCmdError::Save(Box::new(e))
}

/// An output path must name a file in an existing directory: found out before the run, not
/// after it.
fn check_writable(path: &Path) -> Result<(), RunCmdError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if path.file_name().is_none() || path.is_dir() {
        return Err(RunCmdError::Invalid(format!(
            "{}: not a file path",
            path.display()
        )));
    }
    if !dir.is_dir() {
        return Err(RunCmdError::Invalid(format!(
            "{}: directory {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    Ok(())
}

/// The single-device reference in this process from `start_step` with `optimizer_state`;
/// returns the record and the optimizer's final state.
fn run_single(
    model_name: &str,
    build: &runner::ModelBuilder<'_>,
    world_size: usize,
    settings: &RunSettings,
    start_step: usize,
    optimizer_state: Vec<(String, tch::Tensor)>,
) -> Result<(RunRecord, Vec<(String, tch::Tensor)>), RunCmdError> {
    let failed = |e: &dyn std::fmt::Display| RunCmdError::Failed(format!("single: {e}"));
    let model = build(settings.seed, 0).map_err(|e| failed(&e))?;
    model
        .check_single_device_reference()
        .map_err(|e| failed(&e))?;
    let cfg = TrainConfig {
        spec: runner::run_spec(
            model_name,
            &Config::Single.at(world_size),
            world_size,
            "fp32",
            settings,
        ),
        optimizer: settings.optimizer,
        data_ranks: (0..world_size).collect(),
        record_grads: settings.record_grads,
        probe: None,
    };
    let start = TrainStart {
        step: start_step,
        optimizer_state,
    };
    let (record, optimizer) =
        train_from(model.as_ref(), &cfg, &mut no_sync, None, &start).map_err(|e| failed(&e))?;
    let state = optimizer.state().map_err(|e| failed(&e))?;
    Ok((record, state))
}

/// A DDP-family run (`ddp`, `ddp.bf16`, `ddp.fp16`, `ddp.hybrid_order`) from `start_step`, every rank loading
/// the optimizer state from `optimizer_file` (when continuing); rank 0 hands its final
/// optimizer state back through a scratch file.
fn run_ddp(
    model_name: &str,
    build: &runner::ModelBuilder<'_>,
    config: Config,
    world_size: usize,
    settings: &RunSettings,
    start_step: usize,
    optimizer_file: Option<&Path>,
) -> Result<(RunRecord, Vec<(String, tch::Tensor)>), RunCmdError> {
    // Named the same in an exec'd rank re-running a test (`crate::self_exec`).
    let scratch = crate::runner::self_exec::scratch_file("run-optim", "safetensors");
    let train =
        |ctx: &RankCtx, model: &dyn Model, cfg: &TrainConfig| -> Result<RunRecord, String> {
            let optimizer_state = match optimizer_file {
                Some(file) => {
                    checkpoint::load_optimizer_state(file, model)
                        .map_err(|e| e.to_string())?
                        .tensors
                }
                None => Vec::new(),
            };
            let opts = runner::ddp_options(config, ctx)?;
            let group = ctx.group();
            let mut ddp = Ddp::new(model, group.clone(), opts).map_err(|e| e.to_string())?;
            let start = TrainStart {
                step: start_step,
                optimizer_state,
            };
            let (record, optimizer) =
                train_from(model, cfg, &mut ddp, Some(group.as_ref()), &start)
                    .map_err(|e| format!("{}: {e}", config.name()))?;
            if ctx.rank() == 0 {
                let state = optimizer.state().map_err(|e| e.to_string())?;
                checkpoint::safetensors::write_atomic(&scratch, &state, &Default::default())
                    .map_err(|e| e.to_string())?;
            }
            Ok(record)
        };
    let dtype = config.precision().map_or("fp32", Precision::label);
    let launched = runner::run_launched(
        model_name,
        &config.at(world_size),
        dtype,
        world_size,
        build,
        &train as &TrainFn<'_>,
        settings,
    );
    let state = launched
        .as_ref()
        .ok()
        .map(|_| checkpoint::safetensors::read(&scratch));
    let _ = std::fs::remove_file(&scratch);
    let record = launched.map_err(|e| RunCmdError::Failed(e.to_string()))?;
    let state = match state {
        Some(Ok(file)) => file.tensors,
        Some(Err(e)) => {
            return Err(RunCmdError::Failed(format!(
                "reading rank 0's optimizer state: {e}"
            )))
        }
        None => Vec::new(),
    };
    Ok((record, state))
}

/// The per-step table `lockstep run` prints, with where each state file went.
pub fn render(outcome: &RunOutcome) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} x {}@{}: {} from step {} (seed {}){}",
        outcome.model,
        outcome.config,
        outcome.world_size,
        lockstep_harness::report::plural(outcome.steps, "step"),
        outcome.start_step,
        outcome.seed,
        match (&outcome.init, outcome.resumed) {
            (Some(p), true) => format!(", continuing {}", p.display()),
            (Some(p), false) => format!(", from {}", p.display()),
            (None, _) => String::new(),
        }
    );
    let _ = writeln!(out, "computed with {}", outcome.environment);
    let _ = writeln!(out, "{:>6}  {:<24}  {:<24}", "step", "loss", "grad norm");
    for (i, (loss, norm)) in outcome.losses.iter().zip(&outcome.grad_norms).enumerate() {
        let _ = writeln!(
            out,
            "{:>6}  {:<24}  {:<24}",
            outcome.start_step + i,
            loss,
            norm
        );
    }
    if let Some(p) = &outcome.saved_init {
        let _ = writeln!(out, "initial state: {}", p.display());
    }
    if let Some(p) = &outcome.saved_final {
        let _ = writeln!(out, "final state: {}", p.display());
    }
    if let Some(p) = &outcome.saved_optimizer_state {
        let _ = writeln!(out, "optimizer state: {}", p.display());
    }
    for note in &outcome.notes {
        let _ = writeln!(out, "note: {note}");
    }
    out
}
