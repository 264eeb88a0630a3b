//! Context parallelism: every sequence split over a group of ranks, as torchtitan's `cp`
//! mesh dimension does, with the model's own forward running on each rank's shard.
//!
//! - Attention is the only layer that mixes tokens: [`attention`] brings the other shards'
//!   keys and values to this rank's queries, by a ring (blocks passed one rank on per hop,
//!   partial results merged by their log-sum-exp, backward back around the same ring) or by
//!   an all-gather; [`layout`] says which chunks a rank holds (causal load balancing, or
//!   contiguous) and where they sit in the sequence.
//! - [`hooks`] give the positional embedding the global positions, route attention across
//!   the group, and make the loss each shard's share of the whole sequence's token mean;
//!   labels are shifted before the sequence is cut (the model's batch holds them shifted).
//! - [`run`] trains it: the replicated parameters' gradients summed over CP, averaged over
//!   the data ranks (`[dp, cp]` mesh, CP innermost).
//!
//! Every parallel configuration is judged against one device by the fp64 arbiter; a ring
//! row also against [`mod@reference`]'s `single.cpN`, one device whose attention runs in the
//! ring's merge order ([`ring_order_attention`]).

pub mod attention;
pub mod hooks;
pub mod layout;
pub mod options;
pub mod reference;
pub mod run;

pub use attention::{context_parallel_attention, ring_order_attention, CpAttentionError};
pub use hooks::CpHooks;
pub use layout::{chunk_count, chunks_of, layout_blocker, positions_of, shard_sequence};
pub use options::{CpDispatcher, CpError, CpFault, CpOptions, SequenceLayout};
pub use reference::{ring_ordered_name, ring_ordered_reference};
pub use run::{check_context_parallel, train_context_parallel};
