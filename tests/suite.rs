//! The `lockstep` crate's integration tests, one test binary of modules (one link against
//! libtorch instead of one per file; docs/design.md, "CI"). Each module is a file beside this
//! one and reads as a test file of its own; nextest names a test `module::test`. The examples
//! that assert their outcome are modules here too (`example_*`), so `cargo nextest run`
//! covers them without linking each example.

#[path = "../core/tests/common/mod.rs"]
mod common;
mod fixtures;
mod judge;

mod arbiter_sensitivity;
mod baseline;
mod bench_pipeline;
mod bench_step;
mod browser;
mod compare_cli;
mod context_parallel;
mod cross_rank;
mod device;
mod device_plumbing;
mod environment;
mod ep_plans;
mod external_launch;
mod field_bugs;
mod fsdp;
mod gpu_pipeline;
mod judge_pytorch;
mod matrix;
mod meshes;
mod one_verdict;
mod parity_api;
mod public_items;
mod pytorch_twins;
mod quick_start;
mod run_cli;
mod schedule_cli;
mod sensitivity;
mod spread;
mod step_local;
mod stress;
mod tp_plans;
mod two_hosts;
mod user_plans;

// The examples' own tests (`cargo run --example NAME` still runs each as a program).
#[allow(dead_code)]
#[path = "../examples/column_parallel.rs"]
mod example_column_parallel;
#[allow(dead_code)]
#[path = "../examples/pytorch_checkpoint.rs"]
mod example_pytorch_checkpoint;
#[allow(dead_code)]
#[path = "../examples/user_model.rs"]
mod example_user_model;
