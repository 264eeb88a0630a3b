//! Running one configuration: a model × configuration × world size, either the
//! single-device reference in this process or a launch of ranks training under a built-in
//! configuration or a user's own closure. `lockstep matrix`, `lockstep run`, `lockstep rank`
//! and the parity-test API all run through here, so a run means the same thing everywhere.
//!
//! The layers, each using only those above it:
//!
//! | module | holds |
//! | --- | --- |
//! | [`settings`] | what every run of a comparison shares ([`RunSettings`], its [`FaultPlan`]), the model builder and training closure types, [`RunFailed`] |
//! | [`hand_back`] | how a rank hands back its record, state digest and fault log (a file, or a store key under an external launch), [`RankError`] |
//! | [`faults`] | the fault plan a rank body installs, and the logs read back |
//! | [`fork`] | ranks for a closure: forked, the test re-run where fork is unsafe, or this process under an external launch |
//! | [`self_exec`] | ranks as re-runs of the calling test binary, where fork is not safe |
//! | [`external`] | this process as one rank of a torchrun/SLURM launch |
//! | [`scratch`] | where a run's record is handed back: a temporary file, an exec'd rank's file, a store key |
//! | [`builtin`] | a catalog configuration's rank body: configuration → parallelism |
//! | [`references`] | the in-process references and the fp64 arbiter's verdict over them |
//! | [`rank_cmd`] | `lockstep rank`: one exec'd rank of a built-in configuration |
//! | [`launch`] | the choice of launch mode (fork, re-run the test, exec this binary, external) and the rank body every mode runs |
//!
//! Rank 0 hands its [`RunRecord`](lockstep_core::record::RunRecord) back (a temporary JSON
//! file, or the run's store); a run that fails (a rank's error, a crash, a hang past the
//! timeout) comes back as [`RunFailed`] carrying the launcher's whole account (flight
//! recorders and the desync diagnosis on a timeout).

pub mod builtin;
pub mod external;
pub mod faults;
pub mod fork;
pub mod hand_back;
pub mod launch;
pub mod rank_cmd;
pub mod references;
pub mod scratch;
pub mod self_exec;
pub mod settings;

pub use builtin::{builtin_ddp_options, ddp_options, train_builtin, BUILTIN_DDP_BUCKET_BYTES};
pub use fork::NCCL_RUNS_MISSING;
pub use hand_back::RankError;
pub use launch::{run_config, run_configs_together, run_launched};
pub use references::{
    arbiter_verdict, in_process_reference, run_single, run_single_f64, shadow_f64, shadow_pair,
    shared_reference, step_local_references, step_local_verdict,
};
pub use settings::{
    launch_failed, one_line, run_spec, zoo_builder, FaultPlan, ModelBuilder, RecordResult,
    RunFailed, RunSettings, TrainFn,
};
