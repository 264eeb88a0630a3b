//! What one training run leaves behind for the parity engine: per-step losses and gradient
//! norms, and the final full parameters (per-step gradients on request).
//!
//! Every parallel configuration and every reference produces the same record, so comparing
//! any two runs is one function, whatever produced them.

use crate::comm::DType;
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// A tensor captured by name, exactly: values widened to `f64` (lossless for every float dtype
/// we train in) with the original dtype kept so comparisons can count ULPs in it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NamedTensor {
    /// Parameter or capture-point name, the key comparisons match on.
    pub name: String,
    /// The tensor's dtype before widening; ULP distances are counted in it.
    pub dtype: DType,
    /// The tensor's shape; `values` holds it flattened in row-major order.
    pub shape: Vec<i64>,
    /// NaN and infinities survive JSON as strings (a diverged run must stay readable).
    #[serde(with = "crate::num::vec")]
    pub values: Vec<f64>,
}

impl NamedTensor {
    /// Captures `t` (any device, any layout) under `name`.
    pub fn capture(name: &str, t: &Tensor) -> Result<Self, crate::CommError> {
        let dtype = DType::from_kind(t.kind())?;
        let flat = t
            .f_detach()?
            .f_to_device(tch::Device::Cpu)?
            .f_to_kind(tch::Kind::Double)?
            .f_contiguous()?
            .f_view([-1])?;
        let values = Vec::<f64>::try_from(&flat)?;
        Ok(NamedTensor {
            name: name.to_owned(),
            dtype,
            shape: t.size(),
            values,
        })
    }
}

/// Identity of a run: what was trained, how, on how many ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// Model zoo name (e.g. `nested`, `transformer`, `moe`).
    pub model: String,
    /// Parallel configuration name (e.g. `single`, `ddp`, `fsdp.full_shard`).
    pub config: String,
    /// Ranks whose batches the run trains on (a reference run keeps the world size it
    /// stands in for, on one process).
    pub world_size: usize,
    /// Process-group backend name (`cpu` or `nccl`).
    pub backend: String,
    /// Precision policy name (e.g. `fp32`, `bf16-mixed`).
    pub dtype: String,
    /// Optimizer steps taken; per-step vectors in the record have this length.
    pub steps: usize,
    /// The run seed every rank derives its initialization and data from.
    pub seed: u64,
}

/// The outcome of one run, comparable against any other run of the same model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    /// What was run; two records compare only if their models match.
    pub spec: RunSpec,
    /// Global loss per step: the mean of every rank's loss.
    #[serde(with = "crate::num::vec")]
    pub losses: Vec<f64>,
    /// Global gradient norm (L2 over every parameter, shared ones counted once) per step,
    /// measured after gradient synchronization and before the optimizer step.
    #[serde(with = "crate::num::vec")]
    pub grad_norms: Vec<f64>,
    /// Every full parameter after the last step, in the model's parameter order.
    pub params: Vec<NamedTensor>,
    /// Every buffer after the last step (BatchNorm statistics, constants): ranks must agree on
    /// them too, and a missing buffer broadcast shows only here.
    #[serde(default)]
    pub buffers: Vec<NamedTensor>,
    /// Full gradients per step, when requested.
    pub grads: Option<Vec<Vec<NamedTensor>>>,
    /// Memory the parallel wrapper measured on rank 0 (FSDP: full-parameter bytes), when it
    /// measures any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryStats>,
    /// Collectives issued per step (calls and bytes per operation and group), when the run
    /// counted them: shows what a configuration costs on the wire, and that it did not
    /// communicate more than designed. Absent from reports written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collectives: Option<Vec<Vec<CollectiveEntry>>>,
    /// For a float64 shadow of a reference that routes tokens: the smallest gap, over every
    /// top-k decision the fp32 reference took, between the last chosen and the best unchosen
    /// probability. A run that fails near such a tie may have routed a token differently, which
    /// its diagnosis then says.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "crate::num::opt"
    )]
    pub routing_min_gap: Option<f64>,
    /// For a reference that drops tokens at a capacity (`single.cap<F>`): how many (token,
    /// choice) pairs it dropped over the run, so a report shows its row exercised dropping.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_dropped: Option<u64>,
    /// Under a parallel plan (tensor, expert parallelism): where each tensor lived, so a
    /// report shows what the plan split rather than leaving a user to trust it did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub placements: Vec<TensorPlacement>,
    /// What the launcher found comparing every rank's state digest (see
    /// [`crate::consistency`]): absent for a reference or a run whose launcher did not check.
    /// A mismatch fails the run whatever rank 0's numbers say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_rank: Option<crate::consistency::CrossRankCheck>,
}

/// Where one tensor of a run lived under its parallel plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPlacement {
    /// The parameter's canonical name.
    pub tensor: String,
    /// How it was held: `replicated`, `shard(dim 0) over tp`, `expert on ep rank 1`...
    pub placement: String,
}

impl RunRecord {
    /// A record about to be filled by a run of `spec.steps` steps: every training loop
    /// starts from the same empty record (per-step gradients kept only when asked).
    pub fn start(spec: RunSpec, record_grads: bool) -> RunRecord {
        RunRecord {
            losses: Vec::with_capacity(spec.steps),
            grad_norms: Vec::with_capacity(spec.steps),
            spec,
            params: Vec::new(),
            buffers: Vec::new(),
            grads: record_grads.then(Vec::new),
            memory: None,
            collectives: None,
            routing_min_gap: None,
            tokens_dropped: None,
            placements: Vec::new(),
            cross_rank: None,
        }
    }
}

/// One step's tally of one operation on one group, as a flat row (JSON maps cannot have the
/// tuple keys [`CollectiveCounts`](crate::comm::CollectiveCounts) uses).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveEntry {
    /// Operation name (`all_reduce`, `all_gather`, ...).
    pub op: String,
    /// Group name (`tp[0,1]`, `world`, ...).
    pub group: String,
    /// Times the operation was issued in the step.
    pub calls: u64,
    /// Bytes of the tensors this rank handed to those calls (see `comm::counting`).
    pub bytes: u64,
}

impl CollectiveEntry {
    /// Rows from a tally taken with [`CollectiveCounts::take`](crate::comm::CollectiveCounts::take),
    /// in the tally's (operation, group) order.
    pub fn from_counts(counts: crate::comm::CountMap) -> Vec<CollectiveEntry> {
        counts
            .into_iter()
            .map(|((op, group), c)| CollectiveEntry {
                op,
                group,
                calls: c.calls,
                bytes: c.bytes,
            })
            .collect()
    }
}

/// What a sharding wrapper knows about its memory on one rank, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryStats {
    /// The most bytes of full (unsharded) parameters alive at once.
    pub full_param_bytes_peak: u64,
    /// Bytes of this rank's parameter shards (alive between steps).
    pub shard_bytes: u64,
    /// Bytes of the model's parameters unsharded (what DDP keeps on every rank).
    pub model_param_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diverged_run_survives_json() {
        let record = RunRecord {
            spec: RunSpec {
                model: "m".into(),
                config: "ddp".into(),
                world_size: 2,
                backend: "cpu".into(),
                dtype: "fp32".into(),
                steps: 2,
                seed: 0,
            },
            losses: vec![1.5, f64::NAN],
            grad_norms: vec![f64::INFINITY, f64::NEG_INFINITY],
            params: vec![NamedTensor {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![2],
                values: vec![f64::NAN, -0.0],
            }],
            buffers: vec![],
            grads: None,
            memory: None,
            collectives: None,
            routing_min_gap: None,
            tokens_dropped: None,
            placements: Vec::new(),
            cross_rank: None,
        };
        let text = serde_json::to_string(&record).expect("serialize");
        let back: RunRecord = serde_json::from_str(&text).expect("parse");
        assert!(back.losses[1].is_nan());
        assert_eq!(back.grad_norms, vec![f64::INFINITY, f64::NEG_INFINITY]);
        assert!(back.params[0].values[0].is_nan());
        assert!(back.params[0].values[1].is_sign_negative());
    }
}
