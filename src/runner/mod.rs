//! Running one configuration: a model × configuration × world size, either the
//! single-device reference in this process or a launch of ranks training under a built-in
//! configuration or a user's own closure. `lockstep matrix`, `lockstep run`, `lockstep rank`
//! and the parity-test API all run through here, so a run means the same thing everywhere.
//!
//! How the ranks start (forked, the test re-run, `lockstep rank` exec'd, or this process as
//! one rank of torchrun/srun) and how rank 0's record comes back are the harness's
//! ([`lockstep_harness::launch`](mod@lockstep_harness::launch): `run_ranks` chooses the mode, `hand_back` carries the
//! results); this folder says what a run is. The layers, each using only those above it:
//!
//! | module | holds |
//! | --- | --- |
//! | [`settings`] | what every run of a comparison shares ([`RunSettings`], its [`FaultPlan`], the launch it asks the harness for), the model builder and training closure types |
//! | [`faults`] | the fault plan a rank body installs, and the logs read back |
//! | [`builtin`] | a catalog configuration's rank body: configuration → parallelism |
//! | [`references`] | the in-process references and the fp64 arbiter's verdict over them |
//! | [`rank_cmd`] | `lockstep rank`: one exec'd rank of a built-in configuration |
//! | [`launch`] | the rank body every launch runs (model check, fault plan, training, hand-back) for a configuration, a user's closure, or several configurations in one launch |
//!
//! Rank 0 hands its [`RunRecord`](lockstep_core::record::RunRecord) back (a scratch file in
//! CBOR, or the run's store); a run that fails (a rank's error, a crash, a hang past the
//! timeout) comes back as [`RunFailed`] carrying the launcher's whole account (flight
//! recorders and the desync diagnosis on a timeout).

pub mod builtin;
pub mod faults;
pub mod launch;
pub mod rank_cmd;
pub mod references;
pub mod settings;

/// The harness's launch layer under the names this crate has always used for it.
pub use lockstep_harness::launch::{external, hand_back, self_exec};

pub use builtin::{builtin_ddp_options, ddp_options, train_builtin, BUILTIN_DDP_BUCKET_BYTES};
pub use launch::{run_config, run_configs_together, run_launched};
pub use lockstep_harness::launch::{RankError, NCCL_RUNS_MISSING};
pub use references::{
    arbiter_verdict, in_process_reference, run_single, run_single_f64, shadow_f64, shadow_pair,
    shared_reference, step_local_references, step_local_verdict,
};
pub use settings::{
    launch_failed, one_line, run_spec, zoo_builder, FaultPlan, ModelBuilder, PlantedFault,
    RecordResult, RunFailed, RunSettings, TrainFn,
};
