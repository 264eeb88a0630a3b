//! Tensor (and sequence) parallelism as functional building blocks: layers that take this
//! rank's parameter shards and a TP group, a vocabulary-parallel loss, sharding helpers, and
//! an RNG tracker whose parity mode reproduces a single device's dropout masks.
//!
//! Communication per call, on a TP group of size `t` (all-reduces are skipped when `t = 1`;
//! all-gathers and reduce-scatters still run there, as copies):
//!
//! | function | forward | backward |
//! | --- | --- | --- |
//! | [`column_parallel_linear`] | none (`copy_to_parallel`) | all-reduce of the input gradient |
//! | … with `sequence_parallel` | all-gather of the sequence (dim 0) | reduce-scatter of the input gradient |
//! | … with `gather_output` | + all-gather of the output features | + none (keeps own chunk) |
//! | [`row_parallel_linear`] | all-reduce of the partial output | none |
//! | … with `sequence_parallel` | reduce-scatter of the partial output (dim 0) | all-gather of the output gradient |
//! | … without `input_is_parallel` | + none (keeps own feature chunk) | + all-gather of the input gradient |
//! | [`vocab_parallel_embedding`] | all-reduce of the partial embeddings | none |
//! | [`vocab_parallel_cross_entropy`] | three all-reduces of `[N]` (max, target logit, sum of exps) | none |
//! | [`shard`] | none | — |
//! | [`unshard`] | all-gather (no autograd) | — |
//!
//! A column-parallel linear followed by a row-parallel one (`input_is_parallel`) is
//! Megatron's MLP: one all-reduce forward, one backward. To see what code communicates,
//! wrap its group in a [`CountingGroup`](crate::comm::CountingGroup).
//!
//! Errors come in three layers, one name family: [`TpPlanError`] (a plan that does not fit
//! the model or the size, found before any rank starts, comparable in tests), [`TpLayerError`]
//! (a parallel layer or sharding helper at run time) and [`TpError`] (a run, wrapping both).

pub mod hooks;
pub mod layers;
pub mod options;
pub mod plan;
pub mod run;

pub use layers::{
    check_divisible, column_parallel_linear, enter_column, row_parallel_linear, shard, unshard,
    vocab_parallel_cross_entropy, vocab_parallel_embedding, ColumnOptions, Reduction, RowOptions,
    TpGroup, TpLayerError,
};

pub use options::{TpError, TpFault, TpOptions};
pub use plan::{placements, Placement, TpPlan, TpPlanError, TpRule, TpStyle};
pub use run::{
    check_plan, check_plan_with, model_plan, train_tensor_parallel, train_tensor_parallel_with_plan,
};
