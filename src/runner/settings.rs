//! What every run of one comparison shares, and how a run fails: the settings, the model
//! builder and training closure types, and [`RunFailed`], the launcher's whole account of a
//! failed run.

use lockstep_core::comm::{Backend, FaultMode};
use lockstep_core::ddp::DdpFault;
use lockstep_core::field_bugs::FieldBug;
use lockstep_core::record::{RunRecord, RunSpec};
use lockstep_core::train::{OptimizerConfig, TrainConfig};
use lockstep_harness::launch::RankLaunch;
pub use lockstep_harness::launch::{launch_failed, one_line, RunFailed};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, Model, ModelError};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A bug planted on purpose to prove the matrix catches it (checker tests only).
#[derive(Clone, Debug, PartialEq)]
pub enum PlantedFault {
    /// DDP's own: planted in DDP runs (mixed precision included), which the other
    /// configurations are checked against.
    Ddp(DdpFault),
    /// A published bug's mechanism (docs/bugs.md), planted in every loop that has it.
    Field(FieldBug),
}

impl PlantedFault {
    /// The DDP fault, if this is one.
    pub fn ddp(&self) -> Option<DdpFault> {
        match self {
            PlantedFault::Ddp(f) => Some(f.clone()),
            PlantedFault::Field(_) => None,
        }
    }

    /// The field bug, if this is one.
    pub fn field(&self) -> Option<FieldBug> {
        match self {
            PlantedFault::Field(b) => Some(*b),
            PlantedFault::Ddp(_) => None,
        }
    }
}

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
    /// A planted bug (checker tests only).
    pub fault: Option<PlantedFault>,
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
    /// [`super::faults`]); applied to every group of every launched rank. Forked ranks only,
    /// one configuration per launch.
    pub faults: Option<FaultPlan>,
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
    /// launched by [`run_launched`](super::run_launched): under NCCL and `--exec-ranks` always, on CUDA when this
    /// process is the `lockstep` binary (elsewhere, in a user's parity test, the test binary
    /// re-runs itself as the ranks: [`super::self_exec`]).
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

/// A run's record, or why it has none: what every run of a matrix cell, a parity test or a
/// sensitivity analysis comes back as.
pub type RecordResult = Result<RunRecord, RunFailed>;

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
        backend: match config.starts_with("single") {
            true => "none",
            false => settings.backend.name(),
        }
        .into(),
        dtype: dtype.to_owned(),
        steps: settings.steps,
        seed: settings.seed,
    }
}

impl RunSettings {
    /// A launch of this run's ranks, named `label`, rank 0 handing its record back at `out`:
    /// the harness chooses the mode ([`lockstep_harness::launch::run_ranks`]).
    pub fn rank_launch<'a>(
        &self,
        world_size: usize,
        label: &'a str,
        out: &'a Path,
    ) -> RankLaunch<'a> {
        RankLaunch {
            world_size,
            timeout: self.timeout,
            backend: self.backend,
            label,
            out,
            fault_plan: self.faults.is_some(),
            cuda: self.computes_on_cuda(),
            exec: None,
        }
    }
}

/// The `lockstep` binary exec'd ranks run: `LOCKSTEP_BIN` if set, else this process's own
/// executable when it is `lockstep`.
pub(super) fn lockstep_program() -> Result<PathBuf, RunFailed> {
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

/// One run's fault plan: what every rank's injector does, and where each rank writes its log
/// (`<log_dir>/rank-<r>.json`, a `FaultLog`). Serializable, so exec'd ranks (`lockstep rank
/// --fault-plan`, how CUDA runs and `--exec-ranks` start) take it on their command line.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct FaultPlan {
    /// Record every call, or inject one fault at one site.
    pub mode: FaultMode,
    /// A directory the launching process created; each rank writes its log here.
    pub log_dir: PathBuf,
}

impl FaultPlan {
    /// Where rank `rank` writes its log.
    pub fn log_path(&self, rank: usize) -> PathBuf {
        fault_log_path(&self.log_dir, rank)
    }
}

/// Where rank `rank` of a plan logging to `dir` writes its log.
pub(super) fn fault_log_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}.json"))
}
