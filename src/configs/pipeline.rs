//! The pipeline configurations of the matrix (`pp.*`), as a table like [`fsdp_configs`]:
//! each row names a schedule, its virtual stages, a partition method, checkpointing and
//! data-parallel replicas; microbatches are `2p` for `p` pipeline ranks (the issue's `m ≥ 2p`,
//! and a multiple of `p` as interleaved schedules need), except `pp.gpipe`'s `2p − 1`: every
//! zoo batch divides by `2p`, so without it no row would split a batch into microbatches of
//! different sizes, and a loss scale that ignores the sizes would change no number.
//!
//! Each `pp.*` row is judged twice: against `single@N` by the fp64 arbiter (a
//! pipeline accumulates microbatch gradients, one process computes the global batch at once:
//! the same sum in another order), and against `single.mbM@N` — one process running the same
//! `M` microbatches with the same loss scales, backward per microbatch in order — bit for bit
//! where the math allows. Where it does not (a tied weight used on two stages, a layer output
//! consumed on several stages, data-parallel averaging) the row is judged by the fp64 arbiter
//! around `single.mbM`'s own float64 shadow.

use super::*;
use lockstep_core::pipeline::{
    plan_pipeline, PipelineOptions, PipelinePlan, ScheduleChoice, ScheduleKind,
};

/// One pipeline configuration of the matrix.
#[derive(Clone, Debug)]
pub struct PipelineConfig {
    /// `pp.1f1b`, `pp.interleaved_1f1b`...
    pub name: &'static str,
    /// One line for `lockstep matrix --list`.
    pub description: &'static str,
    /// The built-in schedule it runs.
    pub schedule: ScheduleKind,
    /// Stages per rank.
    pub virtual_stages: usize,
    /// A `PartitionMethod` in its text form (`uniform`, `parameters`, `type:REGEX`).
    pub partition: &'static str,
    /// Activation recomputation every `k` layers of a stage; `None` keeps activations.
    pub checkpoint_every: Option<usize>,
    /// Data-parallel replicas (PP×DP).
    pub data_parallel: usize,
    /// `2p − 1` microbatches instead of `2p`: their sizes differ, so each microbatch's loss
    /// must be scaled by its own size (a mean-reduced loss), which equal splits never test.
    pub uneven_microbatches: bool,
}

/// The partition of `pp.1f1b.type`: balance transformer blocks and linears.
pub const PIPELINE_TYPE_PARTITION: &str = "type:block|encoderlayer|decoderlayer|^linear$";

impl PipelineConfig {
    /// Pipeline ranks at `world_size`, or why this configuration cannot run there.
    pub fn ranks(&self, world_size: usize) -> Result<usize, String> {
        if !world_size.is_multiple_of(self.data_parallel) || world_size / self.data_parallel < 2 {
            return Err(format!(
                "needs at least 2 pipeline ranks in each of {} replica(s); world size \
                 {world_size} does not give them",
                self.data_parallel
            ));
        }
        Ok(world_size / self.data_parallel)
    }

    /// Microbatches per step for `p` pipeline ranks.
    pub fn microbatches(&self, p: usize) -> usize {
        match self.uneven_microbatches {
            true => 2 * p - 1,
            false => 2 * p,
        }
    }

    /// The options every rank runs with at `world_size`.
    pub fn options(&self, world_size: usize) -> Result<PipelineOptions, String> {
        let p = self.ranks(world_size)?;
        Ok(PipelineOptions {
            schedule: ScheduleChoice::Builtin(self.schedule),
            virtual_stages: self.virtual_stages,
            microbatches: self.microbatches(p),
            partition: self.partition.parse().map_err(|e| format!("{e}"))?,
            checkpoint_every: self.checkpoint_every,
            data_parallel: self.data_parallel,
            fault: None,
        })
    }

    /// The validated plan for `model` at `world_size`, or why this configuration cannot
    /// serve it (the row is then skipped with the reason).
    pub fn plan(&self, model: &dyn Model, world_size: usize) -> Result<PipelinePlan, String> {
        if let Some(reason) = model.single_device_reference_blocker() {
            return Err(format!(
                "a pipeline splits the global batch into microbatches on every stage, which \
                 this model cannot match: {reason}"
            ));
        }
        let opts = self.options(world_size)?;
        plan_pipeline(model, world_size, &opts).map_err(|e| e.to_string())
    }
}

/// Every pipeline configuration, in row order.
pub fn pipeline_configs() -> &'static [PipelineConfig] {
    static TABLE: LazyLock<Vec<PipelineConfig>> = LazyLock::new(|| {
        let mut rows = schedule_rows();
        rows.extend(one_f_one_b_option_rows());
        rows
    });
    &TABLE
}

/// The plain row (uniform partition, no checkpointing, no data parallelism) others vary.
fn uniform_row(
    name: &'static str,
    description: &'static str,
    schedule: ScheduleKind,
    virtual_stages: usize,
) -> PipelineConfig {
    PipelineConfig {
        name,
        description,
        schedule,
        virtual_stages,
        partition: "uniform",
        checkpoint_every: None,
        data_parallel: 1,
        uneven_microbatches: false,
    }
}

/// One row per built-in schedule (GPipe's with uneven microbatches), uniform partition.
fn schedule_rows() -> Vec<PipelineConfig> {
    vec![
        PipelineConfig {
            uneven_microbatches: true,
            ..uniform_row(
                "pp.gpipe",
                "GPipe: every forward, then every backward; 2N-1 microbatches of unequal \
                 sizes (each loss scaled by its own size)",
                ScheduleKind::GPipe,
                1,
            )
        },
        uniform_row(
            "pp.1f1b",
            "1F1B: warm-up forwards, then one forward one backward",
            ScheduleKind::OneFOneB,
            1,
        ),
        uniform_row(
            "pp.interleaved_1f1b",
            "Interleaved 1F1B, 2 stages per rank placed loop-style",
            ScheduleKind::Interleaved1F1B,
            2,
        ),
        uniform_row(
            "pp.looped_bfs",
            "Looped BFS, 2 stages per rank: each local stage runs every microbatch in turn",
            ScheduleKind::LoopedBfs,
            2,
        ),
        uniform_row(
            "pp.interleaved_zb",
            "Interleaved zero bubble (ZB-H1), backward split into input (I) and weight (W) \
             gradients, 2 stages per rank",
            ScheduleKind::InterleavedZeroBubble,
            2,
        ),
        uniform_row(
            "pp.zbv",
            "ZBV zero bubble, 2 stages per rank placed V-style",
            ScheduleKind::Zbv,
            2,
        ),
        uniform_row(
            "pp.dualpipev",
            "DualPipeV, 2 stages per rank placed V-style",
            ScheduleKind::DualPipeV,
            2,
        ),
    ]
}

/// 1F1B under each partition method, checkpointing and data-parallel option.
fn one_f_one_b_option_rows() -> Vec<PipelineConfig> {
    vec![
        PipelineConfig {
            partition: "parameters",
            ..uniform_row(
                "pp.1f1b.parameters",
                "1F1B with stages balanced by parameter count",
                ScheduleKind::OneFOneB,
                1,
            )
        },
        PipelineConfig {
            partition: PIPELINE_TYPE_PARTITION,
            ..uniform_row(
                "pp.1f1b.type",
                "1F1B with stages balanced by transformer blocks and linears \
                 (type:REGEX partition)",
                ScheduleKind::OneFOneB,
                1,
            )
        },
        PipelineConfig {
            checkpoint_every: Some(2),
            ..uniform_row(
                "pp.1f1b.checkpoint",
                "1F1B with activation checkpointing every 2 layers (recomputed in backward)",
                ScheduleKind::OneFOneB,
                1,
            )
        },
        PipelineConfig {
            checkpoint_every: Some(1),
            ..uniform_row(
                "pp.1f1b.checkpoint_each",
                "1F1B recomputing every layer on its own: a saved boundary feeding several \
                 later segments (the transformer's encoder output, read by every decoder \
                 layer) gathers its gradient from each",
                ScheduleKind::OneFOneB,
                1,
            )
        },
        PipelineConfig {
            data_parallel: 2,
            ..uniform_row(
                "pp.1f1b.dp2",
                "PP×DP: 2 data-parallel replicas of a 1F1B pipeline (world 4 and up)",
                ScheduleKind::OneFOneB,
                1,
            )
        },
    ]
}

/// Which pipeline configuration: an index into [`pipeline_configs`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PipelineId(pub(super) usize);

impl PipelineId {
    /// The configuration's table row.
    pub fn get(self) -> &'static PipelineConfig {
        &pipeline_configs()[self.0]
    }
}

/// The name of the microbatched single-device reference with `m` microbatches.
pub fn microbatched_name(m: usize) -> String {
    format!("single.mb{m}")
}
