//! Turning options into a [`Plan`]: selection by name pattern, world sizes, validation
//! before anything runs, and the output directory.

use super::*;

/// What the user asked for; [`plan`] validates it.
#[derive(Clone, Debug)]
pub struct MatrixOptions {
    /// Model name patterns (exact or with `*`); empty means every zoo model.
    pub models: Vec<String>,
    /// Configuration name patterns; empty means every configuration.
    pub configs: Vec<String>,
    /// World sizes; empty means [`DEFAULT_WORLD_SIZE`].
    pub world_sizes: Vec<usize>,
    /// Training steps per run.
    pub steps: usize,
    /// The run seed every model and batch derives from.
    pub seed: u64,
    /// Longest one launch may take before it is declared hung.
    pub timeout: Duration,
    /// Record per-step gradients, so a failure names the first step and tensor that drifted
    /// (not just the final parameters).
    pub record_grads: bool,
    /// A bug planted to show the matrix catches it (checker tests only): in every DDP run,
    /// or a published bug's mechanism in every loop that has it.
    pub fault: Option<crate::runner::PlantedFault>,
    /// Run a cell's launched configurations in one launch each (subtests); `false` gives
    /// every run a launch of its own (`--isolated`, slower, for bisecting a suspect run).
    pub subtests: bool,
    /// The backend the launched ranks use (`--backend`); [`check_backend`] refuses NCCL
    /// before anything runs when this build or machine cannot run it.
    pub backend: lockstep_core::comm::Backend,
    /// Exec every rank as a fresh `lockstep rank` process instead of forking (`--exec-ranks`;
    /// always so under NCCL). One launch per run: no subtests.
    pub exec_ranks: bool,
    /// Where runs compute (`--device`; NCCL always on CUDA, [`crate::device`]).
    pub device: crate::device::ComputeDevice,
    /// Allow TF32 matrix products on CUDA (`--tf32`): not fp32 arithmetic, judged by the same
    /// arbiter to measure what it costs.
    pub tf32: bool,
    /// Write every quantity the fp64 arbiter judges (row, step, quantity, tensor, both
    /// distances, scale) to this CSV file (`--arbiter-log`): how the envelope's constants are
    /// measured (docs/parity.md).
    pub arbiter_log: Option<PathBuf>,
}

impl Default for MatrixOptions {
    fn default() -> Self {
        MatrixOptions {
            models: Vec::new(),
            configs: Vec::new(),
            world_sizes: Vec::new(),
            steps: 5,
            seed: 0,
            timeout: Duration::from_secs(300),
            record_grads: true,
            fault: None,
            subtests: true,
            backend: lockstep_core::comm::Backend::Cpu,
            exec_ranks: false,
            device: crate::device::ComputeDevice::Cpu,
            tf32: false,
            arbiter_log: None,
        }
    }
}

/// A validated matrix: what will run, in order.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Selected zoo models, in zoo order.
    pub models: Vec<String>,
    /// Selected configurations under test, in [`Config::all`] order.
    pub configs: Vec<Config>,
    /// World sizes, in the order given (duplicates dropped).
    pub world_sizes: Vec<usize>,
    /// Steps per run.
    pub steps: usize,
    /// Run seed.
    pub seed: u64,
    /// Per-launch timeout.
    pub timeout: Duration,
    /// Whether runs record per-step gradients.
    pub record_grads: bool,
    /// The planted bug, if any (see [`MatrixOptions::fault`]).
    pub fault: Option<crate::runner::PlantedFault>,
    /// Whether a cell's launched configurations share one launch (see [`MatrixOptions`]).
    pub subtests: bool,
    /// The backend launched ranks use (see [`MatrixOptions::backend`]).
    pub backend: lockstep_core::comm::Backend,
    /// Whether ranks are exec'd (see [`MatrixOptions::exec_ranks`]).
    pub exec_ranks: bool,
    /// Where runs compute (see [`MatrixOptions::device`]).
    pub device: crate::device::ComputeDevice,
    /// TF32 on CUDA (see [`MatrixOptions::tf32`]).
    pub tf32: bool,
    /// Where the arbiter's measurements go (see [`MatrixOptions::arbiter_log`]).
    pub arbiter_log: Option<PathBuf>,
    /// Per model: why it has no single-device reference, if it has none.
    pub(super) blockers: Vec<Option<String>>,
    /// Per model: why it has no independent mixed-precision reference
    /// ([`lockstep_core::mixed_reference::mixed_reference_blocker`]), if it has none.
    pub(super) mixed_blockers: Vec<Option<String>>,
    /// Per (model index, world size): how many fp32 variants of the single-device reference
    /// the model admits there ([`crate::spread::splits`]).
    pub(super) spread: BTreeMap<(usize, usize), usize>,
    /// Per (model index, world size, selected pipeline configuration): its validated plan,
    /// or why it cannot serve that model there (its rows are skipped with the reason).
    pub(super) pipeline_plans: PipelinePlans,
    /// Per (model index, world size, tensor/expert-parallel configuration or composition —
    /// selected, or the simpler configuration a selected composition reduces to): why it
    /// cannot serve that model there, if it cannot.
    pub(super) model_parallel_blockers: ModelParallelBlockers,
}

impl Plan {
    /// What every run of this plan shares (steps, seed, timeout, gradients recorded, the
    /// planted fault).
    pub fn settings(&self) -> crate::runner::RunSettings {
        crate::runner::RunSettings {
            steps: self.steps,
            seed: self.seed,
            timeout: self.timeout,
            record_grads: self.record_grads,
            optimizer: lockstep_core::train::OptimizerConfig::default(),
            fault: self.fault.clone(),
            backend: self.backend,
            exec_ranks: self.exec_ranks,
            device: self.device,
            tf32: self.tf32,
            faults: None,
        }
    }

    /// [`Plan::settings`] for the runs of `model`, with the optimizer the matrix trains it
    /// with ([`optimizer_for`]).
    pub fn settings_for(&self, model: &str) -> crate::runner::RunSettings {
        crate::runner::RunSettings {
            optimizer: optimizer_for(model),
            ..self.settings()
        }
    }

    /// Why configuration `config` does not run model `model` (an index into
    /// [`Plan::models`]) at `world_size`, if it does not: the world size, its pipeline plan,
    /// or its tensor/expert-parallel or composition blocker.
    pub fn blocker(&self, model: usize, world_size: usize, config: Config) -> Option<String> {
        if let Some(reason) = config.world_blocker(world_size) {
            return Some(reason);
        }
        if config.is_pipeline() {
            return match self.pipeline_plans.get(&(model, world_size, config)) {
                Some(Ok(_)) => None,
                Some(Err(reason)) => Some(reason.clone()),
                None => Some("not planned".into()),
            };
        }
        if config.model_parallel_config().is_some() || config.composition_config().is_some() {
            return match self
                .model_parallel_blockers
                .get(&(model, world_size, config))
            {
                Some(blocker) => blocker.clone(),
                None => Some("not planned".into()),
            };
        }
        None
    }

    /// How many training runs the plan performs (single-device ones included).
    pub fn run_count(&self) -> usize {
        let mut n = 0;
        for model in 0..self.models.len() {
            for &world in &self.world_sizes {
                let references: usize = self
                    .runs_per_cell(model, world)
                    .iter()
                    .map(|(_, runs)| runs)
                    .sum();
                n += references
                    + self.f64_runs(model, world)
                    + self.fsdp_launches(world).len()
                    + self.pipeline_launches(model, world).len()
                    + self
                        .microbatch_references(model, world)
                        .into_iter()
                        .map(|mb| 1 + usize::from(self.microbatch_needs_f64(model, world, mb)))
                        .sum::<usize>()
                    + self.mixed_references(model, world).len()
                    + 2 * self.dropping_references(model, world).len()
                    + self.ring_ordered_references(model, world).len()
                    + self.model_parallel_launches(model, world).len()
                    + self.simpler_references(model, world).len();
            }
        }
        n
    }

    /// The selected FSDP configurations that run at `world_size`, in row
    /// order.
    pub(super) fn fsdp_launches(&self, world_size: usize) -> Vec<Config> {
        self.configs
            .iter()
            .copied()
            .filter(|&c| c.is_fsdp() && c.world_blocker(world_size).is_none())
            .collect()
    }

    /// The selected pipeline configurations that run model `model` at `world_size`, with
    /// their plans, in row order.
    pub(super) fn pipeline_launches(
        &self,
        model: usize,
        world_size: usize,
    ) -> Vec<(Config, &PipelinePlan)> {
        self.configs
            .iter()
            .filter_map(
                |&c| match self.pipeline_plans.get(&(model, world_size, c)) {
                    Some(Ok(plan)) => Some((c, plan)),
                    _ => None,
                },
            )
            .collect()
    }

    /// The selected tensor- and expert-parallel configurations and compositions that run
    /// model `model` at `world_size`, in row order.
    pub(super) fn model_parallel_launches(&self, model: usize, world_size: usize) -> Vec<Config> {
        self.configs
            .iter()
            .copied()
            .filter(|&c| self.runs_here(model, world_size, c))
            .collect()
    }

    /// The configurations the compositions launched at `world_size` reduce to that are not
    /// selected themselves: they run once, as references ([`Plan::needs`]).
    pub(super) fn simpler_references(&self, model: usize, world_size: usize) -> Vec<Config> {
        self.needs(model, world_size).simpler
    }

    /// Whether tensor/expert-parallel or composed configuration `c` runs model `model` at
    /// `world_size` (planned, and nothing blocks it).
    fn runs_here(&self, model: usize, world_size: usize, c: Config) -> bool {
        matches!(
            self.model_parallel_blockers.get(&(model, world_size, c)),
            Some(None)
        )
    }

    /// The distinct microbatch counts of model `model`'s one-replica pipeline launches at
    /// `world_size`, ascending: one `single.mbM` reference each ([`Plan::needs`]).
    pub(super) fn microbatch_references(&self, model: usize, world_size: usize) -> Vec<usize> {
        let mut m: Vec<usize> = self
            .needs(model, world_size)
            .microbatched
            .into_iter()
            .map(|(m, _)| m)
            .collect();
        m.sort_unstable();
        m
    }

    /// The capacity factors of model `model`'s expert-parallel launches at `world_size`, one
    /// `single.cap<F>` reference (and its float64 shadow) each, in first-use order.
    pub(super) fn dropping_references(&self, model: usize, world_size: usize) -> Vec<f64> {
        self.needs(model, world_size).dropping
    }

    /// The rings of model `model`'s ring rows at `world_size`, one `single.cpN` reference
    /// each, in first-use order.
    pub(super) fn ring_ordered_references(
        &self,
        model: usize,
        world_size: usize,
    ) -> Vec<(usize, lockstep_core::context_parallel::SequenceLayout)> {
        self.needs(model, world_size).ring_ordered
    }

    /// The policies whose independent single-device reference (`single.bf16`, `single.fp16`)
    /// model `model` runs at `world_size`: those whose selected DDP configuration runs
    /// there, on a model that admits the reference.
    pub(super) fn mixed_references(&self, model: usize, world_size: usize) -> Vec<Precision> {
        let needs = self.needs(model, world_size);
        Precision::ALL
            .into_iter()
            .filter(|p| needs.mixed.contains(p))
            .collect()
    }

    /// Whether the microbatched reference with `microbatches` needs its float64 shadow: some
    /// one-replica pipeline using it cannot be bitwise (its plan says why) and is judged by
    /// the fp64 arbiter instead.
    pub(super) fn microbatch_needs_f64(
        &self,
        model: usize,
        world_size: usize,
        microbatches: usize,
    ) -> bool {
        self.needs(model, world_size)
            .microbatched
            .contains(&(microbatches, true))
    }

    /// The runs beside the single-device reference's float64 shadow, where the cell needs it:
    /// the shadow and the fp32 variants that measure the spread with it.
    pub(super) fn f64_runs(&self, model: usize, world_size: usize) -> usize {
        usize::from(self.needs_f64(model, world_size)) + self.spread_runs(model, world_size)
    }

    /// How many fp32 variants the cell runs: those the model admits, where a row's envelope is
    /// widened by them (a mixed-precision row's envelope is its DDP reference's noise alone).
    pub(super) fn spread_runs(&self, model: usize, world_size: usize) -> usize {
        match self.needs(model, world_size).spread {
            true => self.spread.get(&(model, world_size)).copied().unwrap_or(0),
            false => 0,
        }
    }

    /// Whether the cell runs the single-device reference's float64 shadow: whenever a row is
    /// judged by the fp64 arbiter around it, on models that have a single-device reference.
    pub(super) fn needs_f64(&self, model: usize, world_size: usize) -> bool {
        self.needs(model, world_size).single_f64
    }

    /// The reference runs for model `model` at one world size, in run order: (configuration,
    /// runs) for `single`, `ddp`, each `ddp.<label>` and `ddp.hybrid_order`, those with no run
    /// left out. A selected one that runs here is a run under test, and its repeat a second
    /// run (its own row checks it); one that is not selected runs once when an edge of a
    /// selected configuration uses it ([`Plan::needs`]). FSDP launches come on top.
    pub(super) fn runs_per_cell(&self, model: usize, world_size: usize) -> Vec<(Config, usize)> {
        let needs = self.needs(model, world_size);
        let has_single = self.blockers[model].is_none();
        let mut cell = vec![Config::Single, Config::Ddp];
        cell.extend(Precision::ALL.map(Config::DdpMixed));
        cell.push(Config::DdpHybridOrder);
        cell.into_iter()
            .map(|c| {
                let under_test = self.configs.contains(&c)
                    && self.blocker(model, world_size, c).is_none()
                    && (c != Config::Single || has_single);
                let needed = match c {
                    Config::Single => needs.single,
                    _ => needs.configs.contains(&c),
                };
                let repeat = needs.repeats.contains(&c);
                (c, usize::from(under_test || needed) + usize::from(repeat))
            })
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

/// Whether `name` matches `pattern`: exact, or with `*` standing for any run of characters
/// (`ddp*`, `*moe`, `*`).
pub fn matches(pattern: &str, name: &str) -> bool {
    let Some((head, rest)) = pattern.split_once('*') else {
        return pattern == name;
    };
    let Some(mut tail) = name.strip_prefix(head) else {
        return false;
    };
    let parts: Vec<&str> = rest.split('*').collect();
    let Some((last, middle)) = parts.split_last() else {
        return true;
    };
    for part in middle {
        match tail.find(part) {
            Some(i) => tail = &tail[i + part.len()..],
            None => return false,
        }
    }
    tail.len() >= last.len() && tail.ends_with(last)
}

/// The items of `known` selected by `patterns` (all of them for no pattern), in `known`'s
/// order; the first pattern that selects nothing is returned as the error.
fn select<'a>(patterns: &[String], known: &[&'a str]) -> Result<Vec<&'a str>, String> {
    let patterns: Vec<&str> = patterns
        .iter()
        .flat_map(|p| p.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if patterns.is_empty() {
        return Ok(known.to_vec());
    }
    for p in &patterns {
        if !known.iter().any(|k| matches(p, k)) {
            return Err((*p).to_owned());
        }
    }
    Ok(known
        .iter()
        .copied()
        .filter(|k| patterns.iter().any(|p| matches(p, k)))
        .collect())
}

/// Validates `opts` against the zoo: names, world sizes and steps. Builds each selected model
/// once (to learn whether it has a single-device reference and that it accepts the largest
/// rank of every world size); runs nothing.
pub fn plan(opts: &MatrixOptions) -> Result<Plan, MatrixError> {
    let zoo_names = zoo::names();
    let models = select(&opts.models, &zoo_names).map_err(|pattern| MatrixError::UnknownModel {
        pattern,
        known: zoo_names.iter().map(|s| (*s).to_owned()).collect(),
    })?;
    crate::configs::register_mesh_rows(&opts.configs);
    let all_configs = Config::all();
    let config_names: Vec<&str> = all_configs.iter().map(|c| c.name()).collect();
    let selected =
        select(&opts.configs, &config_names).map_err(|pattern| MatrixError::UnknownConfig {
            pattern,
            known: config_names.iter().map(|s| (*s).to_owned()).collect(),
        })?;
    let configs: Vec<Config> = all_configs
        .into_iter()
        .filter(|c| selected.contains(&c.name()))
        .collect();
    let world_sizes = checked_world_sizes(&opts.world_sizes)?;
    if opts.steps == 0 {
        return Err(MatrixError::InvalidOption(
            "--steps must be at least 1".into(),
        ));
    }
    if opts.timeout.is_zero() {
        return Err(MatrixError::InvalidOption(
            "--timeout must be positive".into(),
        ));
    }
    let mut blockers = Vec::with_capacity(models.len());
    let mut mixed_blockers = Vec::with_capacity(models.len());
    let mut spread = BTreeMap::new();
    for (m, name) in models.iter().enumerate() {
        let model = zoo::build(name, opts.seed, 0)?;
        for &w in &world_sizes {
            spread.insert((m, w), crate::spread::splits(model.as_ref(), w).len());
            // Every rank of the run must get a batch; a model that cannot serve rank w-1
            // cannot run at world size w.
            let last = zoo::build(name, opts.seed, w - 1)?;
            if let Err(e) = last.input(w - 1, 0) {
                return Err(MatrixError::InvalidWorldSize {
                    world_size: w,
                    reason: format!("model `{name}` cannot run on {w} ranks: {e}"),
                });
            }
        }
        blockers.push(model.single_device_reference_blocker());
        mixed_blockers.push(lockstep_core::mixed_reference::mixed_reference_blocker(
            model.as_ref(),
        ));
    }
    let pipeline_plans = pipeline_plans(&models, &world_sizes, &configs, opts.seed)?;
    let model_parallel_blockers =
        model_parallel_blockers(&models, &world_sizes, &configs, opts.seed)?;
    Ok(Plan {
        models: models.into_iter().map(str::to_owned).collect(),
        configs,
        world_sizes,
        steps: opts.steps,
        seed: opts.seed,
        timeout: opts.timeout,
        record_grads: opts.record_grads,
        fault: opts.fault.clone(),
        subtests: opts.subtests,
        backend: opts.backend,
        exec_ranks: opts.exec_ranks,
        device: opts.device,
        tf32: opts.tf32,
        arbiter_log: opts.arbiter_log.clone(),
        blockers,
        mixed_blockers,
        spread,
        pipeline_plans,
        model_parallel_blockers,
    })
}

/// Per (model index, world size, pipeline configuration): its plan, or why it cannot serve.
pub(super) type PipelinePlans = BTreeMap<(usize, usize, Config), Result<PipelinePlan, String>>;

/// Per (model index, world size, model-parallel configuration): why it cannot serve, if so.
pub(super) type ModelParallelBlockers = BTreeMap<(usize, usize, Config), Option<String>>;

/// The distinct world sizes asked for (the default when none), each checked.
fn checked_world_sizes(asked: &[usize]) -> Result<Vec<usize>, MatrixError> {
    let mut world_sizes = Vec::new();
    let asked = if asked.is_empty() {
        &[DEFAULT_WORLD_SIZE][..]
    } else {
        asked
    };
    for &w in asked {
        if w == 0 {
            return Err(MatrixError::InvalidWorldSize {
                world_size: 0,
                reason: "a run needs at least one rank".into(),
            });
        }
        if w > MAX_WORLD_SIZE {
            return Err(MatrixError::InvalidWorldSize {
                world_size: w,
                reason: format!(
                    "ranks are processes on this host; at most {MAX_WORLD_SIZE} are supported"
                ),
            });
        }
        if !world_sizes.contains(&w) {
            world_sizes.push(w);
        }
    }
    Ok(world_sizes)
}

/// Per (model, world size, selected pipeline configuration that the size admits): its plan
/// for that model, or why it cannot serve it.
fn pipeline_plans(
    models: &[&str],
    world_sizes: &[usize],
    configs: &[Config],
    seed: u64,
) -> Result<PipelinePlans, MatrixError> {
    let mut pipeline_plans = BTreeMap::new();
    for (m, name) in models.iter().enumerate() {
        for &w in world_sizes {
            for &c in configs.iter().filter(|c| c.is_pipeline()) {
                let Some(p) = c.pipeline_config() else {
                    continue;
                };
                if c.world_blocker(w).is_some() {
                    continue;
                }
                let model = zoo::build(name, seed, 0)?;
                pipeline_plans.insert((m, w, c), p.plan(model.as_ref(), w));
            }
        }
    }
    Ok(pipeline_plans)
}

/// Per (model, world size, tensor/expert-parallel configuration or composition, selected or
/// the simpler configuration a selected composition reduces to): why it cannot serve that
/// model there, if it cannot.
fn model_parallel_blockers(
    models: &[&str],
    world_sizes: &[usize],
    configs: &[Config],
    seed: u64,
) -> Result<ModelParallelBlockers, MatrixError> {
    let mut model_parallel_blockers = BTreeMap::new();
    for (m, name) in models.iter().enumerate() {
        for &w in world_sizes {
            // Compositions' simpler configurations run too (as references) when a
            // selected composition needs them.
            let simpler = configs
                .iter()
                .filter_map(|c| c.composition_config().and_then(CompositionConfig::simpler));
            let wanted: Vec<Config> = configs.iter().copied().chain(simpler).collect();
            for c in wanted {
                if c.world_blocker(w).is_some() || model_parallel_blockers.contains_key(&(m, w, c))
                {
                    continue;
                }
                if c.model_parallel_config().is_none() && c.composition_config().is_none() {
                    continue;
                }
                let model = zoo::build(name, seed, 0)?;
                model_parallel_blockers.insert((m, w, c), c.blocker(model.as_ref(), w));
            }
        }
    }
    Ok(model_parallel_blockers)
}

/// Creates `dir` and proves it writable with a probe file, before any run starts, and
/// removes report files a previous matrix left there (so none can pass for this run's).
pub fn prepare_out_dir(dir: &Path) -> Result<(), MatrixError> {
    report::prepare_dir(dir).map_err(|e| match e {
        ReportError::Io { source, .. } => MatrixError::OutDir {
            path: dir.to_owned(),
            source,
        },
        other => MatrixError::Report(other),
    })
}

/// The optimizer the matrix trains `model` with: SGD with momentum (gradient scale shows
/// through it, so divisor bugs cannot hide), except `gpt_dropout`, which trains as GPT
/// recipes do, with Adam (and gradient clipping, its `Model::max_grad_norm`): Adam's update
/// runs in every matrix, in every configuration that trains that model.
pub fn optimizer_for(model: &str) -> lockstep_core::train::OptimizerConfig {
    if model == "gpt_dropout" {
        lockstep_core::train::OptimizerConfig::adam(1e-3)
    } else {
        lockstep_core::train::OptimizerConfig::default()
    }
}
