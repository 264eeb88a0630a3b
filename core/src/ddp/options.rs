//! DDP's face: its options (bucket size, overlap, buffers, the reduction, a communication
//! hook, mixed precision), the bugs it can plant on purpose, and its error type.

use crate::comm::{CommError, DeviceMesh, ProcessGroup, ReduceOp};
use crate::precision::MixedPrecision;
use crate::wrapper_error::wrapper_error;
use std::collections::HashSet;
use std::sync::Arc;
use tch::{Kind, Tensor};

wrapper_error! {
/// What DDP can fail with.
pub enum DdpError {
    /// The model or its gradients do not fit DDP (e.g. a parameter with no gradient when its
    /// bucket is reduced).
    #[error("ddp: {0}")]
    Invalid(String),
}
}

/// A bug planted on purpose, to prove the parity checker catches it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DdpFault {
    /// Gradients summed across ranks instead of averaged (a divisor bug).
    SumInsteadOfAverage,
    /// This parameter's gradient is never reduced.
    SkipParameter(String),
    /// Buffers are never broadcast (neither at init nor before forward).
    NoBufferBroadcast,
    /// Rank-local (expert) parameters are averaged like the others.
    ReduceExperts,
    /// The group's last rank stops for good before its first gradient reduction (a rank
    /// stuck outside communication): the others wait in a collective it never issues, until
    /// the launcher's timeout shows the desync in the flight recorders.
    StallLastRank,
    /// A preset that computes in the wrong half type: bf16 policies compute in fp16 and
    /// fp16 policies in bf16 (inputs cast alike, so the run trains without an error).
    ComputeInOtherHalf,
    /// Low-precision gradients reduced in `param_dtype` instead of `reduce_dtype`.
    ReduceInComputeDtype,
    /// The fp32 master copy rounded to `param_dtype` before every forward: a master weight
    /// kept in half precision.
    HalfPrecisionMaster,
}

impl DdpFault {
    /// `policy` as a run carrying this fault trains under it: the policy-level bugs rewrite
    /// the preset; every other fault leaves it as it is.
    pub(super) fn planted_in(&self, policy: MixedPrecision) -> MixedPrecision {
        match self {
            DdpFault::ComputeInOtherHalf => MixedPrecision {
                param_dtype: match policy.param_dtype {
                    Kind::BFloat16 => Kind::Half,
                    Kind::Half => Kind::BFloat16,
                    other => other,
                },
                ..policy
            },
            DdpFault::ReduceInComputeDtype => MixedPrecision {
                reduce_dtype: policy.param_dtype,
                ..policy
            },
            _ => policy,
        }
    }
}

/// How DDP runs.
#[derive(Clone)]
pub struct DdpOptions {
    /// Largest bucket in bytes (PyTorch's default: 25 MiB).
    pub bucket_cap_bytes: usize,
    /// Broadcast rank 0's buffers before every forward.
    pub broadcast_buffers: bool,
    /// Launch bucket all-reduces from backward hooks instead of after backward.
    pub overlap: bool,
    /// Replaces the per-bucket all-reduce (runs after backward, in bucket order).
    pub comm_hook: Option<Arc<dyn CommHook>>,
    /// A planted bug, for checker tests only.
    pub fault: Option<DdpFault>,
    /// Train under this mixed-precision policy (see the module documentation); `None` is
    /// plain fp32 DDP. Needs a model that supports layer hooks.
    pub mixed_precision: Option<MixedPrecision>,
    /// How each bucket is averaged: one all-reduce over the whole group, or hybrid shard's
    /// two stages. A hierarchical reduction and a `comm_hook` (which replaces the reduction)
    /// are refused together.
    pub reduction: GradReduction,
}

/// How DDP averages a bucket over the data-parallel ranks.
///
/// Float addition is not associative, so the grouping of the sum is part of the result:
/// [`GradReduction::Flat`] is PyTorch DDP's default (one all-reduce, which the CPU backend
/// sums in rank order, `((g0+g1)+g2)+g3`), and [`GradReduction::Hierarchical`] is the
/// grouping hybrid-sharded FSDP uses (`(g0+g1)/2` and `(g2+g3)/2`, then their mean), the
/// reduction a PyTorch DDP communication hook over two process groups would do. With it DDP
/// is the bitwise reference of hybrid shard, as flat DDP is of full shard.
#[derive(Clone, Default)]
pub enum GradReduction {
    /// One all-reduce (`Avg`) of every bucket over the whole data-parallel group.
    #[default]
    Flat,
    /// Every bucket all-reduced (`Avg`) within this rank's shard group, from the backward
    /// hooks, then all-reduced (`Avg`) across the replicas after backward: elementwise
    /// exactly what hybrid shard's reduce-scatter within the shard group followed by its
    /// all-reduce across replicas computes (the CPU backend's reduce-scatter and all-reduce
    /// share one kernel, sum in rank order then divide once).
    Hierarchical {
        /// The ranks that would hold the shards of one replica.
        shard: Arc<dyn ProcessGroup>,
        /// The ranks holding the same shard in every replica.
        replicate: Arc<dyn ProcessGroup>,
    },
}

impl GradReduction {
    /// Hybrid shard's reduction on a `[replicate, shard]` mesh (as
    /// [`hybrid_mesh`](crate::fsdp::hybrid_mesh) builds it), so DDP and hybrid shard use the
    /// very same groups.
    pub fn hierarchical(mesh: &DeviceMesh) -> Result<GradReduction, DdpError> {
        if mesh.names() != ["replicate", "shard"] {
            return Err(DdpError::Invalid(format!(
                "the hierarchical reduction needs a mesh with dimensions [replicate, shard], \
                 not [{}]",
                mesh.names().join(", ")
            )));
        }
        Ok(GradReduction::Hierarchical {
            shard: mesh.group("shard")?,
            replicate: mesh.group("replicate")?,
        })
    }

    /// A short name for diagnostics: `flat`, or `hierarchical(shard S x replicas R)`.
    pub fn label(&self) -> String {
        match self {
            GradReduction::Flat => "flat".into(),
            GradReduction::Hierarchical { shard, replicate } => format!(
                "hierarchical(shard {} x replicas {})",
                shard.size(),
                replicate.size()
            ),
        }
    }
}

impl Default for DdpOptions {
    fn default() -> Self {
        DdpOptions {
            bucket_cap_bytes: 25 << 20,
            broadcast_buffers: true,
            overlap: true,
            comm_hook: None,
            fault: None,
            mixed_precision: None,
            reduction: GradReduction::Flat,
        }
    }
}

impl std::fmt::Debug for DdpOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DdpOptions")
            .field("bucket_cap_bytes", &self.bucket_cap_bytes)
            .field("broadcast_buffers", &self.broadcast_buffers)
            .field("overlap", &self.overlap)
            .field("comm_hook", &self.comm_hook.is_some())
            .field("fault", &self.fault)
            .field("mixed_precision", &self.mixed_precision)
            .field("reduction", &self.reduction.label())
            .finish()
    }
}

/// One bucket as a communication hook sees it: the flat gradient buffer and where each
/// parameter's gradient lies in it.
pub struct GradBucket<'a> {
    /// The bucket's position in launch order, the same on every rank.
    pub index: usize,
    /// The flat gradients; the hook reduces it in place.
    pub buffer: &'a Tensor,
    /// (parameter name, offset, element count) of every gradient in `buffer`.
    pub entries: &'a [(String, usize, usize)],
}

/// Replaces DDP's reduction of one bucket. Called on every rank, in bucket order.
pub trait CommHook: Send + Sync {
    /// Reduces `bucket.buffer` in place over `dp` (and anything else the hook needs).
    fn reduce(&self, bucket: &GradBucket<'_>, dp: &dyn ProcessGroup) -> Result<(), CommError>;
}

/// The hook of a model split over more groups than data parallel: average every gradient
/// over the data-parallel group, then sum the gradients of parameters marked for another
/// group (tensor or context parallel) over that group as well.
pub struct MarkedReduction {
    marks: Vec<(Arc<dyn ProcessGroup>, HashSet<String>)>,
}

impl MarkedReduction {
    /// No marks yet: behaves like plain DDP.
    pub fn new() -> Self {
        MarkedReduction { marks: Vec::new() }
    }

    /// Marks `names` for an extra sum reduction over `group`.
    pub fn mark(mut self, group: Arc<dyn ProcessGroup>, names: &[&str]) -> Self {
        self.marks
            .push((group, names.iter().map(|n| (*n).to_owned()).collect()));
        self
    }
}

impl Default for MarkedReduction {
    fn default() -> Self {
        Self::new()
    }
}

impl CommHook for MarkedReduction {
    fn reduce(&self, bucket: &GradBucket<'_>, dp: &dyn ProcessGroup) -> Result<(), CommError> {
        dp.all_reduce(bucket.buffer, ReduceOp::Avg)?;
        for (group, names) in &self.marks {
            let slices: Vec<Tensor> = bucket
                .entries
                .iter()
                .filter(|(name, _, _)| names.contains(name))
                .map(|(_, offset, numel)| bucket.buffer.narrow(0, *offset as i64, *numel as i64))
                .collect();
            if slices.is_empty() {
                continue;
            }
            let packed = Tensor::f_cat(&slices, 0)?;
            group.all_reduce(&packed, ReduceOp::Sum)?;
            let mut offset = 0;
            for mut slice in slices {
                let n = slice.numel() as i64;
                slice.f_copy_(&packed.narrow(0, offset, n))?;
                offset += n;
            }
        }
        Ok(())
    }
}
