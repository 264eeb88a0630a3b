//! Everything about a pipeline run that is decided before any rank starts — and so can be
//! rejected before any rank starts: the schedule and its rules, the partition, the dataflow
//! between stages, the lowered and validated action lists, a deadlock-free simulation, and
//! which ranks hold each parameter. Every rank derives the same plan from the same inputs.

use super::dataflow::{probe, Dataflow, StageFlow};
use super::error::PipelineError;
use super::microbatch;
use super::options::{PipelineOptions, ScheduleChoice};
use super::partition::{param_counts, partition_layers};
use super::schedule::{self, Costs, Schedule, Simulation};
use lockstep_models::{LayerSpec, Model, ParamTags};
use std::collections::BTreeSet;
use std::ops::Range;

/// A validated pipeline for one model at one world size.
#[derive(Clone, Debug)]
pub struct PipelinePlan {
    /// Pipeline ranks `p` (world size / data-parallel replicas).
    pub ranks: usize,
    /// Data-parallel replicas of the whole pipeline (1 for a pure pipeline).
    pub data_parallel: usize,
    /// Microbatches per step (`m`), from the schedule.
    pub microbatches: usize,
    /// Per stage: its layers.
    pub stages: Vec<Range<usize>>,
    /// Per stage: its pipeline rank.
    pub stage_ranks: Vec<usize>,
    /// The dataflow at the first microbatch's size.
    pub dataflow: Dataflow,
    /// What crosses between stages under this partition (the edges sends and receives use).
    pub flow: StageFlow,
    /// Lowered (communication inserted) and validated.
    pub schedule: Schedule,
    /// The lowered schedule simulated with unit costs: proof it does not deadlock.
    pub simulation: Simulation,
    /// Canonical parameter names, as `named_parameters` lists them.
    pub params: Vec<String>,
    /// Per parameter: the pipeline ranks whose stages use it (all of them for a parameter
    /// no layer lists).
    pub holders: Vec<BTreeSet<usize>>,
    /// Why this pipeline cannot equal a single-device run with the same microbatch order bit
    /// for bit, if it cannot.
    pub bitwise_blocker: Option<String>,
}

impl PipelinePlan {
    /// The data ranks (reference ranks) replica `d` trains on: its contiguous share.
    pub fn data_ranks(&self, replica: usize, world_size: usize) -> Vec<usize> {
        let per = world_size / self.data_parallel;
        (replica * per..(replica + 1) * per).collect()
    }

    /// The pipeline rank owning parameter `i` (the lowest holder): its gradient and value
    /// are the ones recorded.
    pub fn owner(&self, i: usize) -> usize {
        self.holders[i].iter().next().copied().unwrap_or(0)
    }
}

/// Builds and checks the plan for `model` on `world_size` ranks.
pub fn plan_pipeline(
    model: &dyn Model,
    world_size: usize,
    opts: &PipelineOptions,
) -> Result<PipelinePlan, PipelineError> {
    let dp = opts.data_parallel;
    if dp == 0 || world_size == 0 || !world_size.is_multiple_of(dp) {
        return Err(PipelineError::InvalidPlan(format!(
            "world size {world_size} does not divide into {dp} data-parallel replicas"
        )));
    }
    let p = world_size / dp;
    let generated = schedule_for(opts, p, world_size)?;
    let m = generated.microbatches;
    if opts.checkpoint_every == Some(0) {
        return Err(PipelineError::InvalidPlan(
            "checkpointing every 0 layers: give k ≥ 1".into(),
        ));
    }
    let layers = model.layers();
    let counts = param_counts(model);
    let stages = partition_layers(
        &layers,
        generated.stage_ranks.len(),
        &opts.partition,
        &|name| counts.get(name).copied().unwrap_or(0),
    )?;
    let per = world_size / dp;
    let data = microbatch::split(model, &(0..per).collect::<Vec<_>>(), 0, m)?;
    let dataflow = probe(model, &data.batches[0])?;
    let flow = StageFlow::new(&dataflow, &stages);
    let mut with_edges = generated;
    with_edges.edges = flow.edges.iter().map(|e| (e.from, e.to)).collect();
    let lowered = schedule::lower(&with_edges);
    schedule::validate(&lowered)?;
    let simulation = schedule::simulate(&lowered, Costs::default())?;

    let tags = model.tags();
    let params: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let stage_ranks = lowered.stage_ranks.clone();
    let usage = ParamUsage {
        layers: &layers,
        stages: &stages,
        tags: &tags,
    };
    let holders = usage.holders(&params, &stage_ranks);
    let bitwise_blocker = usage.bitwise_blocker(&params, &flow, dp);
    Ok(PipelinePlan {
        ranks: p,
        data_parallel: dp,
        microbatches: m,
        stages,
        stage_ranks,
        dataflow,
        flow,
        schedule: lowered,
        simulation,
        params,
        holders,
        bitwise_blocker,
    })
}

/// The schedule the options choose, generated or checked against the pipeline's `p` ranks.
fn schedule_for(
    opts: &PipelineOptions,
    p: usize,
    world_size: usize,
) -> Result<Schedule, PipelineError> {
    let dp = opts.data_parallel;
    Ok(match &opts.schedule {
        ScheduleChoice::Builtin(kind) => {
            schedule::generate(*kind, p, opts.virtual_stages, opts.microbatches)?
        }
        ScheduleChoice::Custom(s) => {
            if s.ranks != p {
                return Err(PipelineError::InvalidPlan(format!(
                    "the schedule `{}` has {} ranks, but the pipeline has {p} ({world_size} \
                     ranks / {dp} replicas)",
                    s.name, s.ranks
                )));
            }
            s.clone()
        }
    })
}

/// Which stages use which parameter: what holders and the bitwise blocker both ask.
struct ParamUsage<'a> {
    layers: &'a [LayerSpec],
    stages: &'a [Range<usize>],
    tags: &'a ParamTags,
}

impl ParamUsage<'_> {
    /// Whether a layer of `stage` lists parameter `name` (canonical).
    fn stage_uses(&self, stage: &Range<usize>, name: &str) -> bool {
        (stage.start..stage.end).any(|l| {
            self.layers[l]
                .params
                .iter()
                .any(|q| self.tags.canonical(q) == name)
        })
    }

    /// Per parameter: the pipeline ranks whose stages use it (all of them when none does).
    fn holders(&self, params: &[String], stage_ranks: &[usize]) -> Vec<BTreeSet<usize>> {
        params
            .iter()
            .map(|name| {
                let using: BTreeSet<usize> = self
                    .stages
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| self.stage_uses(r, name))
                    .map(|(s, _)| stage_ranks[s])
                    .collect();
                if using.is_empty() {
                    stage_ranks.iter().copied().collect()
                } else {
                    using
                }
            })
            .collect()
    }

    /// Why the pipeline cannot match a single-device run bit for bit, if it cannot.
    fn bitwise_blocker(&self, params: &[String], flow: &StageFlow, dp: usize) -> Option<String> {
        let names: Vec<String> = self.layers.iter().map(|l| l.name.clone()).collect();
        let shared_stages = |name: &str| {
            self.stages
                .iter()
                .filter(|r| self.stage_uses(r, name))
                .count()
        };
        params
            .iter()
            .find(|n| shared_stages(n) > 1)
            .map(|n| {
                format!(
                    "`{n}` is used on several stages (a tied weight): its gradient is each stage's \
                     sum over microbatches, then summed across stages, where one process sums the \
                     two uses per microbatch"
                )
            })
            .or_else(|| flow.fan_out_reason(&names))
            .or_else(|| {
                params.iter().find(|n| shared_stages(n) == 0).map(|n| {
                    format!("`{n}` is used outside every layer, so each stage adds its own part")
                })
            })
            .or_else(|| {
                (dp > 1).then(|| "data-parallel replicas average their gradients".to_owned())
            })
    }
}
