//! Expert parallelism: the functional building blocks of a mixture-of-experts layer whose
//! experts are sharded over an `ep` group, and the training loop applying them to the zoo's
//! `gpt_moe` ([`run`]).
//!
//! - **Routing** ([`router`]): softmax over `E` experts, top-k (highest first), gates
//!   renormalised over the chosen k — the zoo's `Moe` arithmetic — plus the Switch/GShard
//!   load-balancing loss `E · Σ_e f_e · P_e`.
//! - **Capacity**: each expert takes at most `ceil(factor · N · k / E)` choices of a rank's `N`
//!   tokens (local capacity: counted per rank, not over the group), filled first choices
//!   before second choices, token order within each. A dropped choice contributes nothing and
//!   its gate is lost, not renormalised onto the token's other choices (the token's output
//!   shrinks, as in Switch/GShard, where the residual carries it).
//! - **Dispatchers** ([`dispatch`]): all-to-all (each choice travels to its expert's rank and
//!   back through the differentiable all-to-all) and all-gather (every rank sees every token
//!   and routing, runs its experts, results are reduce-scattered home). They compute the same
//!   values; the tests hold them to each other and to one process holding every expert.
//! - **The layer** ([`moe`]): `Σ gate · expert(x)` over kept choices, added per token in
//!   increasing expert index; with one process and no capacity it is the zoo's dense layer
//!   bit for bit.
//! - **The gradient rule** ([`grads`]): expert gradients come only from the choices routed to
//!   each expert, are summed over the expert-data-parallel group (`world / ep` ranks holding
//!   the same experts) and never over `ep`, and for a mean-over-ranks objective are divided by
//!   the world size.

pub(crate) mod borrowed;
pub mod dispatch;
pub mod error;
pub mod experts;
pub mod grads;
pub mod moe;
pub mod options;
pub mod router;
pub mod run;

pub use dispatch::{
    combine, dispatch_all_gather, dispatch_all_to_all, run_all_local, DispatchPlan,
};
pub use error::MoeError;
pub use experts::{experts_per_rank, EpGroup, ExpertParams};
pub use grads::{ep_groups, expert_data_parallel_groups, reduce_expert_grads};
pub use moe::{moe_forward, Dispatcher, MoeConfig, MoeOutput};
pub use options::{EpError, EpFault, EpOptions};
pub use router::{capacity, check_top_k, keep_mask, load_balancing_loss, route, Routing};
pub use run::{
    check_expert_plan, check_expert_plan_with, train_expert_parallel,
    train_expert_parallel_with_plan,
};
