//! The tensor-, expert- and context-parallel configurations of the matrix (`tp.*`, `ep.*`,
//! `cp.*`), as a table like [`fsdp_configs`]. Each is judged against `single@N` by the fp64
//! arbiter: a tensor-parallel group computes the global batch's loss exactly as one process,
//! except that sums split across ranks (the row-parallel reduction, the vocabulary-parallel
//! softmax) add in another order; expert parallelism trains data-parallel with experts
//! sharded; a context-parallel group splits each sequence, its attention merged block by
//! block (ring) or over gathered keys, its gradients summed over the shards.

use super::*;
use lockstep_core::context_parallel::{
    check_context_parallel, CpDispatcher, CpOptions, SequenceLayout,
};
use lockstep_core::expert_parallel::{check_expert_plan, Dispatcher, EpOptions};
use lockstep_core::tensor_parallel::check_plan;

/// Which parallelism a row of [`model_parallel_configs`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelParallelKind {
    /// Tensor parallelism of size `tp` (the rest of the world data-parallel replicas).
    Tensor {
        /// Tensor-parallel group size.
        tp: usize,
        /// Megatron sequence parallelism between blocks.
        sequence_parallel: bool,
    },
    /// Expert parallelism: each MoE layer's experts spread over `ep` ranks, every rank its
    /// own batch (data parallel).
    Expert {
        /// Ranks each layer's experts are spread over.
        ep: usize,
        /// How tokens reach their experts' ranks.
        dispatcher: Dispatcher,
    },
    /// Context parallelism: every sequence split over `cp` ranks (the rest data parallel).
    Context {
        /// Ranks each sequence is split over.
        cp: usize,
        /// How queries meet the other shards' keys and values.
        dispatcher: CpDispatcher,
        /// How the sequence is cut over the ranks.
        layout: SequenceLayout,
    },
}

/// One tensor- or expert-parallel configuration of the matrix.
#[derive(Clone, Debug)]
pub struct ModelParallelConfig {
    /// The name `--configs` patterns match and result files use.
    pub name: &'static str,
    /// One line for `lockstep matrix --list`.
    pub description: &'static str,
    /// What the configuration runs.
    pub kind: ModelParallelKind,
    /// Expert parallelism's capacity factor (`None`: no limit).
    pub capacity_factor: Option<f64>,
}

impl ModelParallelConfig {
    /// Why this configuration cannot run at `world_size`, if it cannot.
    pub fn world_blocker(&self, world_size: usize) -> Option<String> {
        match self.kind {
            ModelParallelKind::Tensor { tp, .. } => (!world_size.is_multiple_of(tp)).then(|| {
                format!("tensor-parallel size {tp} does not divide world size {world_size}")
            }),
            ModelParallelKind::Expert { ep, .. } => (!world_size.is_multiple_of(ep)).then(|| {
                format!("expert-parallel size {ep} does not divide world size {world_size}")
            }),
            ModelParallelKind::Context { cp, .. } => (!world_size.is_multiple_of(cp)).then(|| {
                format!("context-parallel size {cp} does not divide world size {world_size}")
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
                    data_parallel: Default::default(),
                    fault: None,
                },
            )
            .err()
            .map(|e| e.to_string()),
            ModelParallelKind::Expert { ep, dispatcher } => {
                check_expert_plan(model, world_size, &self.expert_options(ep, dispatcher))
                    .err()
                    .map(|e| e.to_string())
            }
            ModelParallelKind::Context { .. } => {
                let opts = self.context_options()?;
                check_context_parallel(model, world_size, &opts)
                    .err()
                    .map(|e| e.to_string())
            }
        }
    }

    /// The options every rank of a context-parallel row runs with (`None` for other rows).
    pub fn context_options(&self) -> Option<CpOptions> {
        match self.kind {
            ModelParallelKind::Context {
                cp,
                dispatcher,
                layout,
            } => Some(CpOptions {
                cp,
                tp: 1,
                ep: 1,
                dispatcher,
                layout,
                data_parallel: Default::default(),
                fault: None,
            }),
            _ => None,
        }
    }

    /// The capacity factor of an expert-parallel row and the name of the single-device
    /// reference it is judged against (`single.cap1` for factor 1): the reference that drops
    /// the choices over capacity of each rank's batch ([`dropping_reference_name`]); `None`
    /// without a capacity (judged against `single`).
    pub fn dropping_reference(&self) -> Option<(f64, String)> {
        self.capacity_factor
            .map(|f| (f, dropping_reference_name(f)))
    }

    /// The options every rank of an expert-parallel row runs with.
    pub fn expert_options(&self, ep: usize, dispatcher: Dispatcher) -> EpOptions {
        EpOptions {
            ep,
            dispatcher,
            capacity_factor: self.capacity_factor,
            data_parallel: Default::default(),
            fault: None,
        }
    }
}

/// The name of the single-device reference that drops tokens at `capacity_factor`:
/// `single.cap<F>` (`single.cap1`, `single.cap1.25`).
pub fn dropping_reference_name(capacity_factor: f64) -> String {
    format!("single.cap{capacity_factor}")
}

/// Every tensor- and expert-parallel configuration, in row order: TP, EP, CP, then TP with
/// sequence parallelism.
pub fn model_parallel_configs() -> &'static [ModelParallelConfig] {
    static TABLE: LazyLock<Vec<ModelParallelConfig>> = LazyLock::new(|| {
        let mut rows = vec![
            tensor(
                "tp.2",
                "tensor parallel over 2 ranks (the rest data parallel) by the model's own \
                 `parallel_plan` (the zoo decoders': vocabulary-parallel embedding and loss, \
                 attention split by heads, feed-forward column- then row-parallel)",
                2,
                false,
            ),
            tensor("tp.4", "tensor parallel over 4 ranks", 4, false),
        ];
        rows.extend(expert_configs());
        rows.extend(context_configs());
        rows.extend([tensor(
            "tp.2.sp",
            "tensor parallel over 2 ranks with sequence parallelism (LayerNorms on \
                 sequence shards, all-gather before and reduce-scatter after each block)",
            2,
            true,
        )]);
        rows
    });
    &TABLE
}

/// A tensor-parallel row.
fn tensor(
    name: &'static str,
    description: &'static str,
    tp: usize,
    sequence_parallel: bool,
) -> ModelParallelConfig {
    ModelParallelConfig {
        name,
        description,
        kind: ModelParallelKind::Tensor {
            tp,
            sequence_parallel,
        },
        capacity_factor: None,
    }
}

/// An expert-parallel row.
fn expert(
    name: &'static str,
    description: &'static str,
    ep: usize,
    dispatcher: Dispatcher,
    capacity_factor: Option<f64>,
) -> ModelParallelConfig {
    ModelParallelConfig {
        name,
        description,
        kind: ModelParallelKind::Expert { ep, dispatcher },
        capacity_factor,
    }
}

/// A context-parallel row.
fn context(
    name: &'static str,
    description: &'static str,
    cp: usize,
    dispatcher: CpDispatcher,
    layout: SequenceLayout,
) -> ModelParallelConfig {
    ModelParallelConfig {
        name,
        description,
        kind: ModelParallelKind::Context {
            cp,
            dispatcher,
            layout,
        },
        capacity_factor: None,
    }
}

/// The expert-parallel rows, in row order.
fn expert_configs() -> Vec<ModelParallelConfig> {
    vec![
        expert(
            "ep.2",
            "expert parallel over 2 ranks (gpt_moe: each MoE layer's 8 experts \
                          4 per rank, all-to-all dispatch; every rank its own batch)",
            2,
            Dispatcher::AllToAll,
            None,
        ),
        expert(
            "ep.4",
            "expert parallel over 4 ranks (2 experts per rank), all-to-all",
            4,
            Dispatcher::AllToAll,
            None,
        ),
        expert(
            "ep.2.allgather",
            "ep.2 with the all-gather dispatcher (every rank sees every token \
                          and runs its experts; results reduce-scattered home): the same \
                          computation another way",
            2,
            Dispatcher::AllGather,
            None,
        ),
        expert(
            "ep.2.capacity",
            "ep.2 with a capacity limit that never binds (factor 4 = experts / \
                          top-k: each expert takes at most one choice per token): the \
                          limit's bookkeeping runs and drops nothing",
            2,
            Dispatcher::AllToAll,
            Some(4.0),
        ),
        expert(
            "ep.2.drop",
            "ep.2 at capacity factor 1 (each expert takes ceil(N·k/E) of a \
                          rank's N tokens' choices): overflowing choices are dropped, \
                          judged against single.cap1, the single-device reference \
                          dropping the same choices of each rank's batch",
            2,
            Dispatcher::AllToAll,
            Some(1.0),
        ),
    ]
}

/// The context-parallel rows, in row order.
fn context_configs() -> Vec<ModelParallelConfig> {
    vec![
        context(
            "cp.2",
            "context parallel over 2 ranks (the rest data parallel): each sequence \
             cut into 4 chunks, rank i holding chunks i and 3 − i (causal load balancing), \
             ring attention (key/value blocks passed around, merged by log-sum-exp), \
             gradients summed over the shards",
            2,
            CpDispatcher::Ring,
            SequenceLayout::Balanced,
        ),
        context(
            "cp.2.allgather",
            "cp.2 with every shard's keys and values all-gathered, each \
             rank's queries attending at once: the same computation another way",
            2,
            CpDispatcher::AllGather,
            SequenceLayout::Balanced,
        ),
        context(
            "cp.2.contiguous",
            "cp.2 with each rank holding one contiguous half of the \
             sequence (no load balancing)",
            2,
            CpDispatcher::Ring,
            SequenceLayout::Contiguous,
        ),
        context(
            "cp.4",
            "context parallel over 4 ranks: 8 chunks, ring attention over 4 hops",
            4,
            CpDispatcher::Ring,
            SequenceLayout::Balanced,
        ),
        context(
            "cp.4.allgather",
            "cp.4 with all-gathered keys and values",
            4,
            CpDispatcher::AllGather,
            SequenceLayout::Balanced,
        ),
        context(
            "cp.4.contiguous",
            "cp.4 with contiguous quarters",
            4,
            CpDispatcher::Ring,
            SequenceLayout::Contiguous,
        ),
    ]
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
