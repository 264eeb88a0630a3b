//! Fault plans in launched runs: what a rank body calls so that every group its training uses
//! goes through one [`FaultInjector`], and how the launching process reads back what each rank
//! saw. `lockstep sensitivity`, `ParityTest::sensitivity` and `lockstep matrix --sensitivity`
//! run through here.
//!
//! A rank body calls [`install_faults`] before training and [`FaultSession::finish`] after:
//!
//! ```text
//! let faults = install_faults(ctx, settings, &mut cfg);   // wraps the world's groups
//! let record = train(ctx, model, &cfg)?;
//! faults.finish(&record)?;                                 // this rank's log, for the parent
//! ```
//!
//! Without a plan in the settings both are no-ops and the configuration is left as it was.

use super::hand_back::{hand_back_json, RankError};
use super::settings::{fault_log_path, RunSettings};
use lockstep_core::comm::{FaultInjector, FaultLog};
use lockstep_core::consistency::StateProbe;
use lockstep_core::record::RunRecord;
use lockstep_core::train::TrainConfig;
use lockstep_harness::RankCtx;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A rank's injector while it trains; [`FaultSession::finish`] writes its log.
#[must_use = "call finish() after training so the launching process gets this rank's log"]
pub struct FaultSession {
    installed: Option<(Arc<FaultInjector>, PathBuf)>,
}

impl FaultSession {
    /// Writes this rank's log (its calls, what became of its fault, and a hash of the final
    /// state in `record`, this rank's record of the run) where the plan said. Nothing to do
    /// without a plan.
    pub fn finish(self, record: &RunRecord) -> Result<(), RankError> {
        let Some((injector, path)) = self.installed else {
            return Ok(());
        };
        let log = FaultLog {
            state_hash: Some(state_hash(record)),
            ..injector.log()
        };
        hand_back_json("the fault log", &path, &log)
    }
}

/// A hash of the final state in a rank's record: every parameter and buffer (names, shapes
/// and the bits of every value). Losses, norms and per-step gradients are left out: they are
/// what the rank measured, not what it trained to.
pub fn state_hash(record: &RunRecord) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for t in record.params.iter().chain(&record.buffers) {
        t.name.hash(&mut h);
        t.shape.hash(&mut h);
        for v in &t.values {
            v.to_bits().hash(&mut h);
        }
    }
    h.finish()
}

/// Puts every group this rank's world hands out from now on under one [`FaultInjector`]
/// following `settings.faults`, stepping with the clock of `cfg`'s state probe (created here
/// when the configuration has none, so the loops' `start_step` calls reach the injector).
/// Without a plan it does nothing.
pub fn install_faults(
    ctx: &RankCtx,
    settings: &RunSettings,
    cfg: &mut TrainConfig,
) -> FaultSession {
    let Some(plan) = &settings.faults else {
        return FaultSession { installed: None };
    };
    // The rank's state probe: the one the training loops tick (and report digests to).
    let probe = cfg.probe.get_or_insert_with(|| StateProbe::new(ctx.rank()));
    let injector = FaultInjector::new(ctx.rank(), plan.mode.clone(), probe.clock());
    ctx.world().set_group_wrapper(injector.wrapper());
    FaultSession {
        installed: Some((injector, plan.log_path(ctx.rank()))),
    }
}

/// Every rank's log from `dir` (those that wrote one: a rank that failed may not have), in
/// rank order, each file removed after reading.
pub fn read_logs(dir: &Path, world_size: usize) -> Vec<FaultLog> {
    (0..world_size)
        .filter_map(|rank| {
            let path = fault_log_path(dir, rank);
            let bytes = std::fs::read(&path).ok();
            let _ = std::fs::remove_file(&path);
            serde_json::from_slice(&bytes?).ok()
        })
        .collect()
}
