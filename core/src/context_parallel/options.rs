//! Context parallelism's face: its options (the CP size, how keys and values reach the
//! queries, how the sequence is laid out over the ranks), the bugs it can plant on purpose,
//! and its error type.

use crate::compose::DataParallel;
use crate::failure::{split_failure_from, SplitFailure};

/// How each rank's queries meet the other ranks' keys and values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpDispatcher {
    /// Ring attention: key/value blocks passed around the CP group, one hop per step, each
    /// block's partial attention merged into the running one by its log-sum-exp (online
    /// softmax); backward passes the gradients back around the same ring.
    Ring,
    /// Every rank's keys and values all-gathered, each rank's queries attending to the whole
    /// sequence at once (backward reduce-scatters their gradients): the same computation
    /// another way.
    AllGather,
}

/// How a sequence's tokens are laid out over the CP ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SequenceLayout {
    /// Causal load balancing: the sequence cut into `2·cp` chunks, rank `i` holding chunks
    /// `i` and `2·cp − 1 − i`, so every rank does the same causal work.
    Balanced,
    /// Rank `i` holds the `i`-th of `cp` contiguous chunks (the last rank does the most
    /// causal work).
    Contiguous,
}

/// Bugs a context-parallel run can plant on purpose, each one reported in the wild; the
/// tests prove the checker catches every one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpFault {
    /// Each rank's attention sees its own shard of keys and values only (torchtitan#2808: a
    /// model's parallelize that shards the inputs by sequence but never applies CP to its
    /// attention).
    LocalAttentionOnly,
    /// The reported loss is not summed over the CP ranks (torchtitan#3280: the loss reduced
    /// over the tensor-parallel mesh only), so it is one shard's share.
    LossNotReducedOverCp,
    /// Labels shifted after the sequence was sharded (torchtitan#4544): each shard predicts
    /// its own next tokens, and the token at every shard boundary is lost.
    LabelsShiftedAfterSharding,
    /// The load-balanced chunks put back in rank order, as if the layout were contiguous: keys
    /// are masked by the wrong positions.
    ChunksInRankOrder,
    /// The online-softmax merge takes the block's maximum as the merged one, so the running
    /// sums are never rescaled to a common maximum.
    MergeWithBlockMax,
    /// Gradients averaged over the data ranks only, not over the CP ranks (each rank keeps
    /// its shard's part).
    GradsNotReducedOverCp,
    /// Gradients scaled by the data size instead of the CP size before the average over
    /// `dp × cp`: a factor taken from the wrong mesh dimension, invisible when the two sizes
    /// are equal, caught on a mesh where they differ.
    ScaledByDpSize,
    /// Positions taken from the index within the shard, not within the sequence.
    PositionsFromShard,
    /// CP × EP: expert gradients scaled as expert parallelism alone scales them (summed
    /// over the ranks holding the expert, divided by all of them), not by the CP size first:
    /// each shard's loss is its share of the sequence's mean, so the experts learn `cp` times
    /// too slowly.
    ExpertGradsNotScaledByCp,
    /// TP-sharded gradients summed over the data group before they are averaged over it (a
    /// composition's seam: the data dimension's reduction applied twice).
    ShardedGradsReducedOverDpTwice,
    /// Under EP with FSDP, the experts sharded over the data dimension with the dense
    /// parameters, so a gather assembles one expert from different ranks' experts.
    ExpertsShardedOverDp,
    /// CP × EP: each expert's summed gradient counted once per EP rank (pytorch#160285,
    /// Megatron-LM#5956: expert gradients `ep` times too large, the loss unchanged at step 0).
    ExpertGradsPerEpRank,
    /// The gradient norm (and so clipping) counts this rank's own experts only, not summed
    /// over the ranks holding the others (Megatron-LM#5916, #7165).
    NormOverOwnExperts,
    /// Ring attention's key/value blocks taken out of the graph once they leave their rank:
    /// the gradients other ranks' queries give them never come back (Megatron-LM#1464's
    /// attention backward; the forward is unchanged).
    KvGradsNotReturned,
    /// CP × TP: the column-parallel entry's backward all-reduce over TP skipped
    /// (torchtitan#4054, Megatron-LM#1528: replicated inputs' gradients left partial).
    TpInputGradNotReduced,
}

/// Context-parallel options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpOptions {
    /// Ranks each sequence is split over; the rest of the world is data-parallel replicas.
    pub cp: usize,
    /// Tensor parallelism inside each sequence shard (CP × TP, mesh `[dp, cp, tp]`, the
    /// model's own plan); 1 splits no layer.
    pub tp: usize,
    /// Expert parallelism beside CP (CP × EP): each mixture's experts spread over `ep`
    /// ranks carved out of `dp × cp` within a TP coordinate, as torchtitan borrows `ep`
    /// from `dp_shard × cp`; tokens of every shard dispatched to their experts. 1: experts
    /// replicated.
    pub ep: usize,
    /// How queries meet the other shards' keys and values.
    pub dispatcher: CpDispatcher,
    /// How the sequence is cut over the ranks.
    pub layout: SequenceLayout,
    /// The data dimension: parameters replicated (`Replicate`), or one FSDP unit sharded
    /// over `dp × cp` (`Shard`, as torchtitan shards over `dp_shard × cp`).
    pub data_parallel: DataParallel,
    /// A bug to plant (tests only).
    pub fault: Option<CpFault>,
}

impl CpOptions {
    /// Ring attention over `cp` ranks, load-balanced: torchtitan's default.
    pub fn ring(cp: usize) -> CpOptions {
        CpOptions {
            cp,
            tp: 1,
            ep: 1,
            dispatcher: CpDispatcher::Ring,
            layout: SequenceLayout::Balanced,
            data_parallel: DataParallel::Replicate,
            fault: None,
        }
    }
}

/// What a context-parallel run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CpError {
    /// The options or the model do not fit (found before any rank starts).
    #[error("context parallel: {0}")]
    Invalid(String),
    /// A part beside the sequence split (the TP plan, the experts) does not fit or failed,
    /// said as the composition runs: `CP × TP: …`, or at CP size 1 (FSDP × TP, TP × EP, EP
    /// under HSDP, trained by the same loop) without CP: `TP: …`.
    #[error("{0}")]
    Part(String),
    /// A collective, the model or autograd failed during the run.
    #[error(transparent)]
    Failed(Box<SplitFailure>),
}

split_failure_from!(CpError);
