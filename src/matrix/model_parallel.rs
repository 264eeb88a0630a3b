//! The tensor- and expert-parallel configurations of the matrix (`tp.*`, `ep.*`), as a table
//! like [`fsdp_configs`]. Each is judged against `single@N` under the fp32 dtype table: a
//! tensor-parallel group computes the global batch's loss exactly as one process, except that
//! sums split across ranks (the row-parallel reduction, the vocabulary-parallel softmax) add
//! in another order; expert parallelism trains data-parallel with experts sharded.

use super::*;
use lockstep_core::tensor_parallel::check_plan;

/// Which parallelism a row of [`model_parallel_configs`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelParallelKind {
    /// Tensor parallelism of size `tp` (the rest of the world data-parallel replicas).
    Tensor { tp: usize, sequence_parallel: bool },
}

/// One tensor- or expert-parallel configuration of the matrix.
#[derive(Clone, Debug)]
pub struct ModelParallelConfig {
    pub name: &'static str,
    pub description: &'static str,
    pub kind: ModelParallelKind,
}

impl ModelParallelConfig {
    /// Why this configuration cannot run at `world_size`, if it cannot.
    pub fn world_blocker(&self, world_size: usize) -> Option<String> {
        match self.kind {
            ModelParallelKind::Tensor { tp, .. } => (!world_size.is_multiple_of(tp)).then(|| {
                format!("tensor-parallel size {tp} does not divide world size {world_size}")
            }),
        }
    }

    /// Why this configuration cannot run `model` at `world_size`, if it cannot: checked
    /// before anything is launched.
    pub fn model_blocker(&self, model: &dyn Model, world_size: usize) -> Option<String> {
        if let Some(reason) = model.single_device_reference_blocker() {
            return Some(format!("no single-device reference: {reason}"));
        }
        match self.kind {
            ModelParallelKind::Tensor {
                tp,
                sequence_parallel,
            } => check_plan(
                model,
                world_size,
                &TpOptions {
                    tp,
                    sequence_parallel,
                    fault: None,
                },
            )
            .err()
            .map(|e| e.to_string()),
        }
    }
}

/// Every tensor- and expert-parallel configuration, in row order.
pub fn model_parallel_configs() -> &'static [ModelParallelConfig] {
    static TABLE: LazyLock<Vec<ModelParallelConfig>> = LazyLock::new(|| {
        let tp = |name, description, tp, sequence_parallel| ModelParallelConfig {
            name,
            description,
            kind: ModelParallelKind::Tensor {
                tp,
                sequence_parallel,
            },
        };
        vec![
            tp(
                "tp.2",
                "tensor parallel over 2 ranks (the rest data parallel): vocabulary-parallel \
                 embedding and loss, attention split by heads, feed-forward column- then \
                 row-parallel",
                2,
                false,
            ),
            tp("tp.4", "tensor parallel over 4 ranks", 4, false),
            tp(
                "tp.2.sp",
                "tensor parallel over 2 ranks with sequence parallelism (LayerNorms on \
                 sequence shards, all-gather before and reduce-scatter after each block)",
                2,
                true,
            ),
        ]
    });
    &TABLE
}

/// Which tensor- or expert-parallel configuration: an index into [`model_parallel_configs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelParallelId(pub(super) usize);

impl ModelParallelId {
    /// The configuration's table row.
    pub fn get(self) -> &'static ModelParallelConfig {
        &model_parallel_configs()[self.0]
    }
}
