//! Lockstep proves distributed training is numerically right: it runs each parallel
//! configuration on one process per rank and compares it against reference runs.
//!
//! This crate is the `lockstep` command line and the one place that re-exports the
//! workspace: [`comm`] (process groups and backends), [`harness`] (multi-rank launcher) and
//! [`models`] (the model zoo).
#![warn(missing_docs)]

pub mod bench;
pub mod checkpoint;
pub mod configs;
pub mod device;
pub mod env_report;
pub mod judge_cmd;
pub mod matrix;
pub mod parity_test;
pub mod run_cmd;
pub mod runner;
pub mod schedule;
pub mod sensitivity;
pub mod setup_cmd;
pub mod spread;
pub mod stress;
pub mod suggest;

pub use lockstep_core as core;
pub use lockstep_core::comm;
pub use lockstep_harness as harness;
pub use lockstep_models as models;
