//! Expert parallelism: mixture-of-experts layers whose experts are sharded over an `ep`
//! group ([`moe`]), and the training loop that applies it to the zoo's `gpt_moe` ([`run`]).
//!
//! The gradient rule: expert parameters get gradients only from the token-choices routed to
//! them, brought back by the dispatchers' backward. They are reduced over the
//! expert-data-parallel group only (the ranks holding the same experts: `world / ep` of
//! them), never over `ep`; for a data-parallel objective (the mean over every rank's loss)
//! the sum over that group is divided by the world size, as dense gradients are averaged.

pub mod moe;
pub mod run;

pub use moe::{
    moe_forward, route, Dispatcher, ExpertParams, MoeConfig, MoeError, MoeOutput, Routing,
};
pub use run::{check_expert_plan, train_expert_parallel, EpFault, EpOptions};
