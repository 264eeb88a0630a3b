//! `lockstep rank` (hidden): the body of one exec'd rank of a built-in configuration run.
//!
//! Forking ranks from the launcher is ten times faster to start, but CUDA cannot be used in
//! a forked child, so runs on the NCCL backend (and, on request, on the CPU backend:
//! `lockstep matrix --exec-ranks`) start every rank as a fresh process of this binary. Each
//! joins the run through the launcher's environment, builds its zoo model (on its GPU, the
//! one of its `LOCAL_RANK`, under NCCL), trains under the configuration, and rank 0 writes
//! its record where the launching process reads it back — exactly what a forked rank does.

use super::builtin::train_builtin;
use super::hand_back::RankError;
use super::hand_back::{hand_back_digest, hand_back_record, probe_for};
use super::settings::{run_spec, RunSettings};
use crate::configs::Config;
use crate::device::ComputeDevice;
use lockstep_core::comm::Backend;
use lockstep_core::train::{OptimizerConfig, TrainConfig};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, OnDevice};
use std::path::PathBuf;

/// What an exec'd rank is told on its command line (every rank the same).
#[derive(Clone, Debug, PartialEq)]
pub struct RankRun {
    /// The zoo model.
    pub model: String,
    /// The built-in configuration (not `single`).
    pub config: String,
    /// Training steps.
    pub steps: usize,
    /// Run seed.
    pub seed: u64,
    /// Keep every step's gradients in the record.
    pub record_grads: bool,
    /// The backend the ranks communicate over (NCCL: each rank trains on its GPU).
    pub backend: Backend,
    /// Where the rank computes (CUDA: rank r on GPU `r % GPUs`, or its own GPU under NCCL).
    pub device: ComputeDevice,
    /// Allow TF32 matrix products on CUDA.
    pub tf32: bool,
    /// Where rank 0 writes its record.
    pub out: PathBuf,
    /// The optimizer every rank steps with.
    pub optimizer: OptimizerConfig,
    /// A fault plan (sensitivity analysis): every rank's groups go through its injector and
    /// each rank writes its log where the plan says, as forked ranks do.
    pub faults: Option<super::settings::FaultPlan>,
}

impl RankRun {
    /// Rank `config` of zoo model `model` under `settings`, rank 0's record written to `out`.
    pub fn of(
        model: &str,
        config: Config,
        settings: &RunSettings,
        out: &std::path::Path,
    ) -> RankRun {
        RankRun {
            model: model.to_owned(),
            config: config.name().to_owned(),
            steps: settings.steps,
            seed: settings.seed,
            record_grads: settings.record_grads,
            backend: settings.backend,
            device: settings.device,
            tf32: settings.tf32,
            out: out.to_path_buf(),
            optimizer: settings.optimizer,
            faults: settings.faults.clone(),
        }
    }

    /// The arguments `lockstep` is exec'd with for this run.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            "rank".to_owned(),
            "--model".into(),
            self.model.clone(),
            "--config".into(),
            self.config.clone(),
            "--steps".into(),
            self.steps.to_string(),
            "--seed".into(),
            self.seed.to_string(),
            "--backend".into(),
            self.backend.name().into(),
            "--device".into(),
            self.device.name().into(),
            "--out".into(),
            self.out.display().to_string(),
        ];
        if self.tf32 {
            args.push("--tf32".into());
        }
        if self.record_grads {
            args.push("--record-grads".into());
        }
        if let Some(plan) = &self.faults {
            // A JSON value of the plan: what `--fault-plan` parses back.
            if let Ok(json) = serde_json::to_string(plan) {
                args.extend(["--fault-plan".into(), json]);
            }
        }
        if self.optimizer != OptimizerConfig::default() {
            // A JSON value of the enum: what `--optimizer` parses back, bit for bit.
            if let Ok(json) = serde_json::to_string(&self.optimizer) {
                args.extend(["--optimizer".into(), json]);
            }
        }
        args
    }

    /// One rank's work: build, move to its device, train, hand rank 0's record back.
    pub fn train(&self, ctx: &RankCtx) -> Result<(), RankError> {
        let config = Config::by_name(&self.config)
            .filter(|&c| c != Config::Single)
            .ok_or_else(|| RankError::NotLaunched(self.config.clone()))?;
        crate::device::prepare_process(self.device, self.backend, self.tf32)
            .map_err(|e| RankError::Train(format!("setting CUDA's numerics: {e}")))?;
        let device = crate::device::rank_device(self.device, self.backend, ctx.local_rank());
        let built = zoo::build(&self.model, self.seed, ctx.rank())?;
        let model = OnDevice::new(built, device)?;
        let settings = RunSettings {
            steps: self.steps,
            seed: self.seed,
            record_grads: self.record_grads,
            backend: self.backend,
            device: self.device,
            tf32: self.tf32,
            optimizer: self.optimizer,
            faults: self.faults.clone(),
            ..RunSettings::default()
        };
        let dtype = config
            .precision()
            .map_or("fp32", crate::configs::Precision::label);
        let spec = run_spec(
            &self.model,
            &config.at(ctx.world_size()),
            ctx.world_size(),
            dtype,
            &settings,
        );
        let probe = probe_for(ctx.rank());
        let mut cfg = TrainConfig {
            spec: spec.clone(),
            optimizer: settings.optimizer,
            data_ranks: vec![ctx.rank()],
            record_grads: self.record_grads,
            probe: probe.clone(),
        };
        let faults = super::faults::install_faults(ctx, &settings, &mut cfg);
        let mut record = train_builtin(config, ctx, &model, &cfg, &settings)?;
        faults.finish(&record)?;
        hand_back_digest(probe.as_ref(), &self.out)?;
        if ctx.rank() == 0 {
            record.spec = spec;
            hand_back_record(&record, &self.out)?;
        }
        Ok(())
    }
}

/// The entry point of `lockstep rank`: joins the launcher's run and trains; never returns.
pub fn rank_main(run: RankRun) -> ! {
    lockstep_harness::rank_main(move |ctx: &RankCtx| run.train(ctx))
}
