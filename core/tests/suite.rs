//! `lockstep-core`'s integration tests, one test binary of modules (one link against libtorch
//! instead of one per file; docs/design.md, "CI"). Each module is a file beside this one;
//! nextest names a test `module::test`.

mod common;

mod autograd_bridge;
mod autograd_collectives;
mod collectives;
mod compositions;
mod ddp;
mod expert_parallel;
mod faulty;
mod fsdp_mixed_precision;
mod fsdp_state;
mod fsdp_units;
mod groups;
mod mixed_precision;
mod nccl;
mod pipeline;
mod rendezvous;
mod smoke;
mod store;
mod tensor_parallel;
mod train;
