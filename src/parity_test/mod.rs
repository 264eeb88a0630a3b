//! The parity-test API: put your own model, or your own parallel training code, under test
//! from a plain `#[test]` run by `cargo nextest run`.
//!
//! A [`ParityTest`] names a model (a zoo model, or your type implementing
//! [`Model`]), the configurations under test (built-in ones such as
//! `ddp` or `fsdp.full_shard.per_layer`, or your own closure that trains the model on every
//! rank), the references they must agree with (`single`, `ddp`, or another configuration),
//! world sizes, steps, seed and tolerance policy. [`ParityTest::run`] launches one process
//! per rank for every run, compares every configuration with every reference, writes the
//! report set under `target/lockstep/<test>/` and returns a [`ParityOutcome`];
//! [`ParityTest::assert_parity`] fails the test with the parity engine's diagnosis (first
//! failing step, tensor, element and margin), or with the launcher's failure report when a
//! run crashed, hung or desynchronized.
//!
//! ```no_run
//! use lockstep::parity_test::{ParityTest, Reference};
//!
//! #[test]
//! fn nested_model_under_fsdp() {
//!     ParityTest::new("nested_model_under_fsdp")
//!         .zoo("nested")
//!         .config("ddp")
//!         .config("fsdp.full_shard.per_layer")
//!         .reference(Reference::Single)
//!         .world_sizes(&[2])
//!         .steps(3)
//!         .assert_parity();
//! }
//! ```

mod error;
mod outcome;
mod sensitivity;

pub use error::ParityTestError;
/// The dtype rows of [`Policy::DtypeTable`], here so a test needs one import path.
pub use lockstep_core::comm::DType;
/// The tolerance of [`ParityTest::tolerance_override`], here so a test needs one import path.
pub use lockstep_harness::parity::Tolerance;
pub use outcome::ParityOutcome;
pub use sensitivity::ParitySensitivity;

use crate::configs::{Against, Config, Judged};
use crate::runner::RecordResult;
use crate::runner::{self, ModelBuilder, RunFailed, RunSettings, TrainFn};
use lockstep_core::record::RunRecord;
use lockstep_core::train::{OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{compare, Comparison, Override, TolerancePolicy};
use lockstep_harness::report::{self, Report, RunError};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, Model, ModelError};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What a configuration is compared against.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reference {
    /// One process training on every rank's batch (the global batch): the mathematical
    /// ground truth, for models whose ranks do not differ by construction.
    Single,
    /// Lockstep's DDP at the same world size: the reference for models without a
    /// single-device twin, and for sharding that must reproduce DDP bit for bit.
    Ddp,
    /// Another configuration by name: a built-in one, or one this test defines.
    Config(String),
}

impl Reference {
    fn name(&self) -> &str {
        match self {
            Reference::Single => "single",
            Reference::Ddp => "ddp",
            Reference::Config(name) => name,
        }
    }
}

/// How a comparison judges values: the dtype table (PyTorch's `assert_close` defaults of
/// that dtype) or bitwise equality.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Each value within `atol + rtol·|expected|` of the table's row for this dtype.
    DtypeTable(DType),
    /// Every value identical, bit for bit.
    Bitwise,
}

/// A configuration under test.
enum TestConfig<'a> {
    /// One of Lockstep's own, by name.
    Builtin(Config),
    /// The user's training closure, run on every rank.
    Custom {
        name: String,
        train: Box<TrainFn<'a>>,
    },
}

impl TestConfig<'_> {
    fn name(&self) -> &str {
        match self {
            TestConfig::Builtin(c) => c.name(),
            TestConfig::Custom { name, .. } => name,
        }
    }
}

/// A parity test under construction: see the [module documentation](self).
pub struct ParityTest<'a> {
    name: String,
    model_name: Option<String>,
    build: Option<Box<ModelBuilder<'a>>>,
    configs: Vec<TestConfig<'a>>,
    /// Names asked for that are not built in (an error when the test runs).
    unknown: Vec<String>,
    /// Meshes that cannot be trained, with why (an error when the test runs).
    bad_meshes: Vec<String>,
    references: Vec<Reference>,
    world_sizes: Vec<usize>,
    settings: RunSettings,
    policy: Option<Policy>,
    overrides: Vec<(String, Tolerance, String)>,
    out_dir: Option<PathBuf>,
}

impl<'a> ParityTest<'a> {
    /// A test called `name` (use the test function's name: the report set goes to
    /// `target/lockstep/<name>/`). Defaults: reference `single`, world size 2, 3 steps, seed
    /// 0, SGD (lr 0.01, momentum 0.9), the fp64 arbiter against single, a 120 s timeout per launch.
    pub fn new(name: &str) -> Self {
        ParityTest {
            name: name.to_owned(),
            model_name: None,
            build: None,
            configs: Vec::new(),
            unknown: Vec::new(),
            bad_meshes: Vec::new(),
            references: Vec::new(),
            world_sizes: vec![2],
            settings: RunSettings::default(),
            policy: None,
            overrides: Vec::new(),
            out_dir: None,
        }
    }

    /// Tests zoo model `name` (`lockstep matrix --list` names them).
    pub fn zoo(mut self, name: &str) -> Self {
        let owned = name.to_owned();
        self.model_name = Some(owned.clone());
        self.build = Some(Box::new(move |seed, rank| zoo::build(&owned, seed, rank)));
        self
    }

    /// Tests your own model: `build(seed, rank)` makes one rank's instance. Every rank and
    /// the reference call it, so parameters must depend on the seed only: draw them inside
    /// `lockstep::models::seed::seeded(seed::param_seed(seed), || ...)`, which seeds libtorch
    /// and holds a lock so another test's thread cannot draw in between (a bare
    /// `tch::manual_seed` can be interleaved under `cargo test`). `Model::input(rank, step)`
    /// must give every process the same batch for the same rank and step: draw it inside
    /// `seed::seeded(seed::batch_seed(seed, rank, step), || ...)`.
    pub fn model<M, F>(mut self, name: &str, build: F) -> Self
    where
        M: Model + 'static,
        F: Fn(u64, usize) -> Result<M, ModelError> + Sync + 'a,
    {
        self.model_name = Some(name.to_owned());
        self.build = Some(Box::new(move |seed, rank| {
            build(seed, rank).map(|m| Box::new(m) as Box<dyn Model>)
        }));
        self
    }

    /// Adds built-in configuration `name` (`ddp`, `fsdp.full_shard.per_layer`, `tp.2`...;
    /// `lockstep matrix --list` prints them all). An unknown name fails the test, listing
    /// the known ones.
    pub fn config(mut self, name: &str) -> Self {
        match Config::by_name(name) {
            Some(c) => self.configs.push(TestConfig::Builtin(c)),
            None => self.unknown.push(name.to_owned()),
        }
        self
    }

    /// Adds your own device mesh, described as torchtitan describes it
    /// (`"pp=2,dp_shard=2,tp=2"`, `"cp=2,tp=2"`; dimensions pp, dp_replicate, dp_shard, cp,
    /// tp, ep): its row `mesh.<sizes>`, built from its parts, judged like any configuration.
    /// A mesh that fixes its size (dp_shard or dp_replicate given) sets the world size to
    /// it; call [`world_sizes`](Self::world_sizes) after to choose others. A mesh that cannot
    /// be parsed fails the test, naming why; one the model or world cannot take is refused
    /// like any configuration, naming the size that does not divide.
    pub fn mesh(mut self, description: &str) -> Self {
        let parsed = description
            .parse::<lockstep_core::compose::MeshSpec>()
            .map(|mesh| (mesh, crate::configs::mesh_config(&mesh)));
        match parsed {
            Ok((mesh, config)) => {
                if let Some(world) = mesh.world() {
                    self.world_sizes = vec![world];
                }
                self.configs.push(TestConfig::Builtin(config));
            }
            Err(e) => self.bad_meshes.push(e.to_string()),
        }
        self
    }

    /// Adds your own configuration: `train(ctx, model, cfg)` runs on every rank with the
    /// rank's context (`ctx.group()`, `ctx.world()` for sub-groups), its freshly built model
    /// and the training settings (`cfg.spec.steps` steps, `cfg.optimizer`, and
    /// `cfg.data_ranks`, the batches this rank would train on under data parallelism), and
    /// returns the run's [`RunRecord`] (rank 0's is compared): per-step mean losses and
    /// gradient norms, and the full final parameters under their model names. An `Err`
    /// fails the run with your message; a panic, crash or hang gets the launcher's report.
    pub fn custom_config<F>(mut self, name: &str, train: F) -> Self
    where
        F: Fn(&RankCtx, &dyn Model, &TrainConfig) -> Result<RunRecord, String> + Sync + 'a,
    {
        self.configs.push(TestConfig::Custom {
            name: name.to_owned(),
            train: Box::new(train),
        });
        self
    }

    /// Adds a reference every configuration is compared against (the default, when none is
    /// added, is [`Reference::Single`]).
    pub fn reference(mut self, reference: Reference) -> Self {
        self.references.push(reference);
        self
    }

    /// The world sizes to run at (each configuration and reference at each).
    pub fn world_sizes(mut self, sizes: &[usize]) -> Self {
        self.world_sizes = sizes.to_vec();
        self
    }

    /// Training steps per run.
    pub fn steps(mut self, steps: usize) -> Self {
        self.settings.steps = steps;
        self
    }

    /// The run seed (parameters and batches derive from it).
    pub fn seed(mut self, seed: u64) -> Self {
        self.settings.seed = seed;
        self
    }

    /// The optimizer every run steps with.
    pub fn optimizer(mut self, optimizer: OptimizerConfig) -> Self {
        self.settings.optimizer = optimizer;
        self
    }

    /// How long one launch may take before it is declared hung (its report then carries
    /// every rank's flight recorder and the desync diagnosis).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.settings.timeout = timeout;
        self
    }

    /// Judges every comparison with `policy` (which turns the fp64 arbiter off). Without it,
    /// anything against `single` is judged by the fp64 arbiter, other pairs of built-in
    /// configurations by the matrix's policy (FSDP against DDP bitwise) and everything else
    /// by the fp32 dtype table.
    pub fn policy(mut self, policy: Policy) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Holds configuration `config` to `tolerance` instead, for the stated `reason` (which
    /// is mandatory and printed in every report row it applies to): how a known, explained
    /// difference is recorded rather than hidden by a looser global tolerance.
    pub fn tolerance_override(mut self, config: &str, tolerance: Tolerance, reason: &str) -> Self {
        self.overrides
            .push((config.to_owned(), tolerance, reason.to_owned()));
        self
    }

    /// Computes on `device` (CUDA: every rank a re-run of the test on GPU `rank % GPUs`,
    /// collectives staged through host memory, the single-device reference on GPU 0, every
    /// CUDA process with deterministic kernels and TF32 off; docs/gpu.md). Refused before
    /// anything runs where it cannot run (no GPU).
    pub fn device(mut self, device: crate::device::ComputeDevice) -> Self {
        self.settings.device = device;
        self
    }

    /// Allows TF32 matrix products and convolutions on CUDA (off by default).
    pub fn tf32(mut self, tf32: bool) -> Self {
        self.settings.tf32 = tf32;
        self
    }

    /// Writes the report set to `dir` instead of `target/lockstep/<test>/`.
    pub fn out_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.out_dir = Some(dir.into());
        self
    }

    /// Runs every reference and configuration at every world size, compares, and writes the
    /// report set. `Err` means the test could not run as specified (nothing was launched);
    /// runs that fail or disagree are in the [`ParityOutcome`].
    pub fn run(self) -> Result<ParityOutcome, ParityTestError> {
        let started = Instant::now();
        let prepared = self.prepare()?;
        let out_dir = self.prepared_out_dir()?;
        let mut comparisons = Vec::new();
        let mut errors = Vec::new();
        for &world in &self.world_sizes {
            let runs = self.reference_runs(&prepared, world);
            for config in &self.configs {
                for judged in self.judge_config(&prepared, config, world, &runs) {
                    match judged {
                        Ok(c) => comparisons.push(c),
                        Err(e) => errors.push(e),
                    }
                }
            }
        }
        if crate::runner::self_exec::serving().is_some() {
            // An exec'd rank re-running its test passes this parity test by (its launches
            // were skipped; the launcher judges them) and writes no report, so the test
            // goes on to the parity test that holds its own launch.
            return Ok(ParityOutcome::new(
                self.name,
                Report::new(Vec::new()),
                report::ReportFiles::in_dir(&out_dir),
            ));
        }
        let report = Report::new(comparisons)
            .with_wall_time(started.elapsed())
            .with_errors(errors);
        let files = report::write_all(&report, &out_dir).map_err(|e| ParityTestError::OutDir {
            path: out_dir.clone(),
            reason: e.to_string(),
        })?;
        Ok(ParityOutcome::new(self.name, report, files))
    }

    /// Everything checked and decided before anything runs: the test is runnable, the
    /// references, and the policy of every pair not judged by the fp64 arbiter.
    fn prepare(&self) -> Result<Prepared<'_>, ParityTestError> {
        self.check()?;
        crate::device::prepare_process(
            self.settings.device,
            self.settings.backend,
            self.settings.tf32,
        )
        .map_err(|e| ParityTestError::Invalid(format!("setting CUDA's numerics: {e}")))?;
        let (Some(model_name), Some(build)) = (self.model_name.as_deref(), self.build.as_deref())
        else {
            return Err(ParityTestError::NoModel);
        };
        let references = if self.references.is_empty() {
            vec![Reference::Single]
        } else {
            self.references.clone()
        };
        let probe = build(self.settings.seed, 0).map_err(ParityTestError::Model)?;
        if references.contains(&Reference::Single) {
            if let Some(reason) = probe.single_device_reference_blocker() {
                return Err(ParityTestError::NoSingleDeviceReference {
                    model: model_name.to_owned(),
                    reason,
                });
            }
        }
        // Every built-in configuration and reference the catalog refuses on this model, with
        // the catalog's message, before anything is spawned.
        let builtins = self.configs.iter().filter_map(|c| match c {
            TestConfig::Builtin(config) => Some(*config),
            TestConfig::Custom { .. } => None,
        });
        let reference_configs = references.iter().filter_map(|r| Config::by_name(r.name()));
        for config in builtins.chain(reference_configs) {
            for &world in &self.world_sizes {
                if let Some(refusal) = config.refusal(model_name, probe.as_ref(), world) {
                    return Err(ParityTestError::Invalid(refusal));
                }
            }
        }
        drop(probe);
        // Every policy up front: a pair that cannot be judged fails before anything runs.
        // Pairs against `single` without a policy or override of the user's are judged by the
        // fp64 arbiter instead ([`ParityTest::arbiter_envelope`]).
        let mut policies = BTreeMap::new();
        for &world in &self.world_sizes {
            for config in &self.configs {
                for reference in &references {
                    if config.name() != reference.name()
                        && self.arbiter_envelope(config, reference, world).is_none()
                    {
                        let policy = self.policy_for(config, reference, world)?;
                        policies.insert(
                            (config.name().to_owned(), reference.name().to_owned(), world),
                            policy,
                        );
                    }
                }
            }
        }
        // Forked ranks must not inherit an OpenMP pool; references take the ranks' count
        // (`runner::in_process_reference`).
        lockstep_harness::threads::use_launcher_threads();
        Ok(Prepared {
            model_name,
            build,
            references,
            policies,
        })
    }

    /// The report directory, created and emptied of earlier reports.
    fn prepared_out_dir(&self) -> Result<PathBuf, ParityTestError> {
        let out_dir = self
            .out_dir
            .clone()
            .unwrap_or_else(|| default_out_dir(&self.name));
        if crate::runner::self_exec::serving().is_some() {
            // An exec'd rank writes no report: the launcher's directory stays as it is.
            return Ok(out_dir);
        }
        report::prepare_dir(&out_dir).map_err(|e| ParityTestError::OutDir {
            path: out_dir.clone(),
            reason: e.to_string(),
        })?;
        Ok(out_dir)
    }

    /// Every run at `world`: each reference and configuration once, the envelopes the fp64
    /// arbiter needs, and the float64 shadow when an arbiter judges anything.
    fn reference_runs(&self, prepared: &Prepared<'_>, world: usize) -> WorldRuns {
        let mut records: BTreeMap<String, RecordResult> = BTreeMap::new();
        let envelopes: Vec<&str> = self
            .configs
            .iter()
            .flat_map(|c| {
                prepared
                    .references
                    .iter()
                    .filter_map(|r| self.arbiter_envelope(c, r, world))
            })
            .collect();
        let wanted = prepared
            .references
            .iter()
            .map(|r| r.name())
            .chain(self.configs.iter().map(|c| c.name()))
            .chain(envelopes.iter().copied());
        for name in wanted {
            if records.contains_key(name) {
                continue;
            }
            let run = self.run_one(name, prepared, world, &self.settings);
            records.insert(name.to_owned(), run);
        }
        let single_f64 = (!envelopes.is_empty()).then(|| {
            runner::run_single_f64(prepared.model_name, prepared.build, world, &self.settings)
        });
        // The fp32 variants widen only an fp32 envelope, and only where the shadow ran.
        let spread = match &single_f64 {
            Some(Ok(_)) if envelopes.contains(&"single") => crate::spread::run_spread(
                prepared.model_name,
                prepared.build,
                world,
                &self.settings,
            ),
            _ => Vec::new(),
        };
        WorldRuns {
            records,
            single_f64,
            spread,
        }
    }

    /// `config` at `world` judged against every reference: a comparison per pair, or the
    /// failed run that prevented it.
    fn judge_config(
        &self,
        prepared: &Prepared<'_>,
        config: &TestConfig<'_>,
        world: usize,
        runs: &WorldRuns,
    ) -> Vec<Result<Comparison, RunError>> {
        let records = &runs.records;
        let mut out = Vec::new();
        for reference in &prepared.references {
            let (run_name, ref_name) = (config.name(), reference.name());
            if run_name == ref_name {
                continue;
            }
            let judged = match self.arbiter_envelope(config, reference, world) {
                Some(envelope) => self.judge_by_arbiter(
                    records,
                    (config, world, prepared.build),
                    envelope,
                    (runs.single_f64.as_ref(), &runs.spread),
                ),
                None => prepared
                    .policies
                    .get(&(run_name.to_owned(), ref_name.to_owned(), world))
                    .and_then(|policy| {
                        Some((records.get(run_name)?, records.get(ref_name)?, policy))
                    })
                    .map(|(run, against, policy)| match (run, against) {
                        (Ok(run), Ok(against)) => Ok(compare(run, against, policy)),
                        (Err(e), _) | (_, Err(e)) => Err(e.clone()),
                    }),
            };
            match judged {
                Some(Ok(c)) => out.push(Ok(c)),
                Some(Err(e)) => out.push(Err(RunError {
                    model: prepared.model_name.to_owned(),
                    config: format!("{run_name}@{world}"),
                    reference: format!("{ref_name}@{world}"),
                    message: e.line.clone(),
                    details: e.details.clone(),
                })),
                None => {}
            }
        }
        out
    }

    /// [`ParityTest::run`], then panics unless every comparison passed: the message names
    /// each failing comparison with its first failing step, tensor, element and margin (or
    /// the launcher's report of a failed run) and where the report set is.
    ///
    /// ```
    /// use lockstep::parity_test::ParityTest;
    ///
    /// // In a test, name it after the test function: reports go to target/lockstep/<name>/.
    /// ParityTest::new("doc_mlp_under_ddp")
    ///     .zoo("mlp")
    ///     .config("ddp")
    ///     .config("fsdp.full_shard")
    ///     .steps(2)
    ///     .assert_parity();
    /// ```
    #[track_caller]
    pub fn assert_parity(self) {
        match self.run() {
            Ok(outcome) => outcome.assert_passed(),
            Err(e) => panic!("parity test could not run: {e}"),
        }
    }

    /// Everything that makes the test unrunnable, found before anything is launched.
    fn check(&self) -> Result<(), ParityTestError> {
        if !self.bad_meshes.is_empty() {
            return Err(ParityTestError::Invalid(self.bad_meshes.join("; ")));
        }
        if !self.unknown.is_empty() {
            return Err(ParityTestError::UnknownConfig {
                names: self.unknown.clone(),
                known: Config::all().iter().map(|c| c.name().to_owned()).collect(),
            });
        }
        if self.configs.is_empty() {
            return Err(ParityTestError::NoConfig);
        }
        if self.settings.steps == 0 {
            return Err(ParityTestError::Invalid("steps must be at least 1".into()));
        }
        if self.world_sizes.is_empty() {
            return Err(ParityTestError::Invalid("no world size given".into()));
        }
        let largest = self.world_sizes.iter().copied().max().unwrap_or(1);
        let external = crate::runner::external::launch().map(|l| l.local_rank);
        let reasons = crate::device::blockers(
            self.settings.device,
            self.settings.backend,
            largest,
            external,
        );
        if !reasons.is_empty() {
            return Err(ParityTestError::Invalid(format!(
                "--device {} cannot run here: {}",
                self.settings.device.name(),
                reasons.join("; ")
            )));
        }
        let mut names: Vec<&str> = Vec::new();
        for c in &self.configs {
            if names.contains(&c.name()) {
                return Err(ParityTestError::Invalid(format!(
                    "configuration `{}` is added twice",
                    c.name()
                )));
            }
            names.push(c.name());
        }
        for r in &self.references {
            if let Reference::Config(name) = r {
                if !names.contains(&name.as_str()) && Config::by_name(name).is_none() {
                    return Err(ParityTestError::UnknownConfig {
                        names: vec![name.clone()],
                        known: Config::all().iter().map(|c| c.name().to_owned()).collect(),
                    });
                }
            }
        }
        for (config, _, reason) in &self.overrides {
            if !names.contains(&config.as_str()) {
                return Err(ParityTestError::Invalid(format!(
                    "tolerance override for `{config}`, which is not a configuration of this \
                     test (configurations: {})",
                    names.join(", ")
                )));
            }
            if reason.trim().is_empty() {
                return Err(ParityTestError::Invalid(format!(
                    "the tolerance override for `{config}` has no reason: say why the \
                     configuration may differ"
                )));
            }
        }
        for &world in &self.world_sizes {
            if world == 0 || world > crate::configs::MAX_WORLD_SIZE {
                return Err(ParityTestError::Invalid(format!(
                    "world size {world}: must be 1 to {}",
                    crate::configs::MAX_WORLD_SIZE
                )));
            }
            for c in &self.configs {
                if let TestConfig::Builtin(config) = c {
                    if let Some(refusal) = config.world_refusal(world) {
                        return Err(ParityTestError::Invalid(refusal));
                    }
                }
            }
        }
        Ok(())
    }

    /// Runs configuration or reference `name` at `world` under `settings`.
    fn run_one(
        &self,
        name: &str,
        prepared: &Prepared<'_>,
        world: usize,
        settings: &RunSettings,
    ) -> RecordResult {
        let (model_name, build) = (prepared.model_name, prepared.build);
        if let Some(TestConfig::Custom { train, .. }) =
            self.configs.iter().find(|c| c.name() == name)
        {
            // A user's function is checked across ranks by the record each rank returns.
            let checked = |ctx: &RankCtx, model: &dyn Model, cfg: &TrainConfig| {
                let record = train(ctx, model, cfg)?;
                if let Some(probe) = &cfg.probe {
                    let tags = model.tags();
                    let coord = |n: &str| {
                        if tags.is_rank_local(n) {
                            probe.rank_local()
                        } else {
                            String::new()
                        }
                    };
                    let reported = record
                        .params
                        .iter()
                        .map(|p| {
                            let values = tch::Tensor::f_from_slice(&p.values)?;
                            Ok((p.name.clone(), values.f_reshape(p.shape.as_slice())?))
                        })
                        .collect::<Result<Vec<_>, tch::TchError>>()
                        .map_err(|e| format!("reading the returned record: {e}"))?;
                    probe
                        .observe_reported(record.spec.steps, &reported, &coord)
                        .map_err(|e| format!("digesting the returned record: {e}"))?;
                }
                Ok(record)
            };
            return runner::run_launched(
                model_name,
                &format!("{name}@{world}"),
                "fp32",
                world,
                build,
                &checked,
                settings,
            );
        }
        match Config::by_name(name) {
            Some(config) => runner::run_config(model_name, build, config, world, settings),
            None => Err(RunFailed::simple(format!("unknown configuration `{name}`"))),
        }
    }

    /// Whether `config` is judged against `reference` at `world` by the fp64 arbiter, and if
    /// so whose noise is its envelope: the catalog's edge to `single` says
    /// ([`Config::edges`]: the single-device reference's own noise, or for a mixed-precision
    /// configuration its DDP reference under the same policy). Only against `single`, and
    /// only where the test set no policy or override of its own; a user's configuration is
    /// judged as DDP is.
    fn arbiter_envelope(
        &self,
        config: &TestConfig<'_>,
        reference: &Reference,
        world: usize,
    ) -> Option<&'static str> {
        if *reference != Reference::Single
            || self.policy.is_some()
            || self
                .overrides
                .iter()
                .any(|(name, _, _)| name == config.name())
        {
            return None;
        }
        match config {
            TestConfig::Builtin(c) => match c.edge_to(Against::Single, world)?.judged {
                Judged::Arbiter(a) => a.envelope.config_name(),
                _ => None,
            },
            TestConfig::Custom { .. } => Some(Config::Single.name()),
        }
    }

    /// `run_name`'s record judged by the fp64 arbiter around `envelope`'s noise. A model that
    /// cannot train in float64 (it builds fp32 tensors of its own in forward) is judged
    /// under the fp32 table instead, with that reason recorded in the comparison.
    fn judge_by_arbiter(
        &self,
        records: &BTreeMap<String, Result<RunRecord, RunFailed>>,
        (config, world, build): (&TestConfig<'_>, usize, &ModelBuilder<'_>),
        envelope: &str,
        (fp64, spread): (Option<&Result<RunRecord, RunFailed>>, &[RecordResult]),
    ) -> Option<Result<lockstep_harness::parity::Comparison, RunFailed>> {
        let run = match records.get(config.name())? {
            Ok(run) => run,
            Err(e) => return Some(Err(e.clone())),
        };
        let fp32 = match records.get(envelope)? {
            Ok(r) => r,
            Err(e) => return Some(Err(e.clone())),
        };
        match fp64? {
            Ok(wide) => {
                // The variants widen an fp32 envelope only; one that failed to train is
                // Lockstep's defect, and the row reports it.
                let spread = match envelope {
                    "single" => match crate::spread::trained(spread) {
                        Ok(spread) => spread,
                        Err(e) => return Some(Err(e.clone())),
                    },
                    _ => Vec::new(),
                };
                let launch = (build, world, &self.settings);
                Some(Ok(runner::arbiter_verdict(
                    launch,
                    run,
                    (fp32, &spread, wide),
                    None,
                )))
            }
            // Against the single-device run itself, under the table of the run's dtype,
            // with why in the comparison.
            Err(e) => {
                let single = match records.get("single")? {
                    Ok(r) => r,
                    Err(e) => return Some(Err(e.clone())),
                };
                let policy = match self.policy_for(config, &Reference::Single, world) {
                    Ok(p) => p,
                    Err(e) => return Some(Err(RunFailed::simple(e.to_string()))),
                };
                let dtype = policy.scalar_dtype();
                let reason = format!(
                    "the fp64 arbiter could not run ({}): judged under the {dtype} table",
                    e.line
                );
                match Override::new(Tolerance::for_dtype(dtype), &reason) {
                    Ok(ov) => {
                        let policy = policy.with_override(&run.spec.config, ov);
                        Some(Ok(compare(run, single, &policy)))
                    }
                    Err(e) => Some(Err(RunFailed::simple(e.to_string()))),
                }
            }
        }
    }

    /// The policy `config` is judged by against `reference` at `world`, with this test's
    /// overrides for `config`.
    fn policy_for(
        &self,
        config: &TestConfig<'_>,
        reference: &Reference,
        world: usize,
    ) -> Result<TolerancePolicy, ParityTestError> {
        let builtin_pair = match (config, Config::by_name(reference.name())) {
            (TestConfig::Builtin(c), Some(r)) => Some((*c, r)),
            _ => None,
        };
        let mut policy = match (self.policy, builtin_pair) {
            (Some(Policy::Bitwise), _) => TolerancePolicy::bitwise(DType::F32),
            (Some(Policy::DtypeTable(d)), _) => TolerancePolicy::dtype_table(d),
            (None, Some((c, r))) => c
                .policy_on(r, world, self.settings.backend)
                .map_err(|reason| ParityTestError::Invalid(reason.to_string()))?,
            (None, None) => TolerancePolicy::dtype_table(DType::F32),
        };
        for (name, tolerance, reason) in &self.overrides {
            if name == config.name() {
                let ov = Override::new(*tolerance, reason)
                    .map_err(|e| ParityTestError::Invalid(format!("override for `{name}`: {e}")))?;
                policy = policy.with_override(&format!("{name}@{world}"), ov);
            }
        }
        Ok(policy)
    }
}

/// What [`ParityTest::prepare`] decided: the model, the references, and the policy of every
/// (configuration, reference, world size) not judged by the fp64 arbiter.
struct Prepared<'t> {
    model_name: &'t str,
    build: &'t ModelBuilder<'t>,
    references: Vec<Reference>,
    policies: BTreeMap<(String, String, usize), TolerancePolicy>,
}

/// Every run at one world size, by configuration or reference name, and the float64 shadow
/// of the single-device reference when an arbiter needs it.
struct WorldRuns {
    records: BTreeMap<String, RecordResult>,
    single_f64: Option<RecordResult>,
    /// The single-device reference's fp32 variants ([`crate::spread`]).
    spread: Vec<RecordResult>,
}

/// `target/lockstep/<test>/`, next to the test binary's own target directory.
fn default_out_dir(test: &str) -> PathBuf {
    let safe: String = test
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    target_dir().join("lockstep").join(safe)
}

/// Cargo's target directory: `CARGO_TARGET_DIR` when set, else the `target` directory the
/// running test binary lives in (`target/debug/deps/…`), else `./target`.
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(dir);
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            exe.ancestors()
                .find(|a| a.file_name().is_some_and(|n| n == "target"))
                .map(PathBuf::from)
        })
        .unwrap_or_else(|| PathBuf::from("target"))
}
