//! The data dimension every composition stacks on its model-splitting parallelisms, in a
//! file of its own: each parallelism's options name it, and the compositions build those
//! options, so it cannot live with the compositions without the two needing each other.

/// A hybrid data dimension whose ranks do not split into its replicas.
#[derive(Debug, thiserror::Error)]
#[error(
    "hybrid sharding needs {replicas} replicas (dp_replicate) of equal shard groups \
     (dp_shard), but the data dimension has {data} ranks"
)]
pub struct HybridMeshError {
    /// The replicas asked for.
    pub replicas: usize,
    /// The data dimension's ranks.
    pub data: usize,
}

/// How the data dimension of a composition reduces gradients and keeps parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DataParallel {
    /// Every rank keeps whole parameters; gradients are all-reduced (`Avg`), as DDP does.
    #[default]
    Replicate,
    /// FSDP: parameters are sharded over the data dimension, gathered for compute, and
    /// gradients reduce-scattered (`Avg`) into the shards.
    Shard,
    /// HSDP: sharded within groups of `data / replicas` ranks and replicated across
    /// `replicas` of them (gradients reduce-scattered, then all-reduced across replicas).
    HybridShard {
        /// Replicas of the shard group.
        replicas: usize,
    },
    /// Replicated like [`DataParallel::Replicate`], but every gradient averaged the way
    /// [`DataParallel::HybridShard`] averages it: within groups of `data / replicas` ranks,
    /// then across the `replicas` (on the same `dp_replicate × dp_shard` mesh), so HSDP is
    /// bitwise equal to it where a flat all-reduce would add the ranks in another order.
    /// Losses are averaged the same two-stage way.
    HybridReplicate {
        /// Replicas of the averaging group.
        replicas: usize,
    },
}

impl DataParallel {
    /// The data dimension's mesh dimensions for `data` ranks: `dp`, or `dp_replicate` and
    /// `dp_shard` under hybrid sharding (outermost first).
    pub fn dims(self, data: usize) -> Result<Vec<(&'static str, usize)>, HybridMeshError> {
        match self {
            DataParallel::Replicate | DataParallel::Shard => Ok(vec![("dp", data)]),
            DataParallel::HybridShard { replicas } | DataParallel::HybridReplicate { replicas } => {
                if replicas == 0 || !data.is_multiple_of(replicas) {
                    return Err(HybridMeshError { replicas, data });
                }
                Ok(vec![
                    ("dp_replicate", replicas),
                    ("dp_shard", data / replicas),
                ])
            }
        }
    }

    /// How many replicas the data dimension's shards have (1 unless hybrid).
    pub fn replicas(self) -> usize {
        match self {
            DataParallel::HybridShard { replicas } | DataParallel::HybridReplicate { replicas } => {
                replicas
            }
            _ => 1,
        }
    }

    /// `ddp`, `fsdp`, `hsdp` or `ddp.hybrid_order`, for messages and names.
    pub fn label(self) -> &'static str {
        match self {
            DataParallel::Replicate => "ddp",
            DataParallel::Shard => "fsdp",
            DataParallel::HybridShard { .. } => "hsdp",
            DataParallel::HybridReplicate { .. } => "ddp.hybrid_order",
        }
    }

    /// Whether the data dimension is a `dp_replicate × dp_shard` mesh (hybrid sharding, or
    /// replication averaged in its order).
    pub fn is_hybrid(self) -> bool {
        matches!(
            self,
            DataParallel::HybridShard { .. } | DataParallel::HybridReplicate { .. }
        )
    }
}
