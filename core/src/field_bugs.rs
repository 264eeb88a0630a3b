//! Bugs the field shipped (docs/bugs.md) planted in Lockstep's own loops: each is one
//! mechanism, planted in every loop whose code has it, so that `lockstep matrix --fault NAME`
//! shows which rows of the default matrix catch it (every row family running that code) and
//! which pass (the rows that never run it). Checker tests only.
//!
//! Each parallelism keeps its own planted faults ([`TpFault`], [`EpFault`], [`CpFault`]); a
//! [`FieldBug`] names the one each loop plants for the same published mechanism.

use crate::context_parallel::CpFault;
use crate::expert_parallel::EpFault;
use crate::tensor_parallel::TpFault;

/// A published bug's mechanism, as Lockstep's loops would have it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FieldBug {
    /// Expert gradients counted once per EP rank: `ep` times too large while the loss looks
    /// right (pytorch#160285, Megatron-LM#5956).
    ExpertGradsPerEpRank,
    /// The gradient norm counts this rank's own experts only, so clipping is weakened
    /// (Megatron-LM#5916, #7165).
    NormOverOwnExperts,
    /// The loss each rank reports is its own sequence shard's share, not summed over CP
    /// (transformers#48167, torchtitan#3280).
    LossNotReducedOverCp,
    /// Ring attention's backward never returns the key/value gradients other ranks' queries
    /// give (Megatron-LM#1464).
    KvGradsNotReturned,
    /// The TP backward all-reduce of a replicated input's gradient skipped, so the layers
    /// below learn from one TP rank's partial sum (torchtitan#4054, Megatron-LM#1528).
    TpInputGradNotReduced,
}

impl FieldBug {
    /// Every field bug, in the order docs/bugs.md lists them.
    pub const ALL: [FieldBug; 5] = [
        FieldBug::ExpertGradsPerEpRank,
        FieldBug::NormOverOwnExperts,
        FieldBug::LossNotReducedOverCp,
        FieldBug::KvGradsNotReturned,
        FieldBug::TpInputGradNotReduced,
    ];

    /// The name `--fault` takes.
    pub fn name(self) -> &'static str {
        match self {
            FieldBug::ExpertGradsPerEpRank => "expert-grads-per-ep-rank",
            FieldBug::NormOverOwnExperts => "norm-over-own-experts",
            FieldBug::LossNotReducedOverCp => "loss-not-reduced-over-cp",
            FieldBug::KvGradsNotReturned => "kv-grads-not-returned",
            FieldBug::TpInputGradNotReduced => "tp-input-grad-not-reduced",
        }
    }

    /// The field bug named `name`, if any.
    pub fn named(name: &str) -> Option<FieldBug> {
        FieldBug::ALL.into_iter().find(|b| b.name() == name)
    }

    /// What tensor parallelism's own loop plants for it.
    pub fn tp(self) -> Option<TpFault> {
        match self {
            FieldBug::TpInputGradNotReduced => Some(TpFault::MissingBackwardAllReduce),
            _ => None,
        }
    }

    /// What expert parallelism's own loop plants for it.
    pub fn ep(self) -> Option<EpFault> {
        match self {
            FieldBug::ExpertGradsPerEpRank => Some(EpFault::ExpertGradsReducedOverEp),
            FieldBug::NormOverOwnExperts => Some(EpFault::NormOverOwnExperts),
            _ => None,
        }
    }

    /// What the context-parallel loop plants for it: the loop that also trains every
    /// composition of TP, CP and EP, and splits a pipeline stage by CP.
    pub fn cp(self) -> Option<CpFault> {
        Some(match self {
            FieldBug::ExpertGradsPerEpRank => CpFault::ExpertGradsPerEpRank,
            FieldBug::NormOverOwnExperts => CpFault::NormOverOwnExperts,
            FieldBug::LossNotReducedOverCp => CpFault::LossNotReducedOverCp,
            FieldBug::KvGradsNotReturned => CpFault::KvGradsNotReturned,
            FieldBug::TpInputGradNotReduced => CpFault::TpInputGradNotReduced,
        })
    }
}
