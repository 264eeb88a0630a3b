//! The benchmark decoder: the zoo's GPT-style decoder ([`Gpt`]) at the size [`GptDims`] gives,
//! dense or mixture-of-experts, which the training benchmarks (`bench step`, `bench pipeline`)
//! train — the same model the tensor- and expert-parallel plans apply to — and [`Clocked`],
//! which notes when each step starts and what it communicated.

use lockstep_core::comm::{CollectiveCounts, CountMap};
use lockstep_models::zoo::{Gpt, GptConfig};
use serde::Serialize;
use std::sync::Mutex;
use std::time::Instant;
use tch::Tensor;

/// Dimensions of the decoder the training benchmarks train (the zoo's `gpt` is fixed at dim
/// 16, far too small for a step to be more than launch and collective latency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GptDims {
    /// Vocabulary size (embedding and tied output rows).
    pub vocab: i64,
    /// Hidden width; must divide by `heads`.
    pub dim: i64,
    /// Attention heads.
    pub heads: i64,
    /// Decoder blocks.
    pub layers: usize,
    /// Tokens per sequence.
    pub seq: i64,
    /// Sequences per rank and step.
    pub batch: i64,
    /// Experts of each mixture-of-experts layer (the `gpt_moe` variant, `--parallel ep`).
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: i64,
}

impl GptDims {
    /// The size the benchmarks use by default: 3.3 M parameters dense (a DDP step takes
    /// about 0.1 s on one core), 256 tokens per rank; the MoE variant has top-2 of 8 experts.
    pub const BENCH: GptDims = GptDims {
        vocab: 512,
        dim: 256,
        heads: 8,
        layers: 4,
        seq: 32,
        batch: 8,
        experts: 8,
        top_k: 2,
    };

    /// A decoder small enough for tests.
    pub const TINY: GptDims = GptDims {
        vocab: 16,
        dim: 16,
        heads: 2,
        layers: 1,
        seq: 4,
        batch: 2,
        experts: 4,
        top_k: 2,
    };

    /// The zoo decoder's sizes for these dimensions, with the zoo's proportions: a dense
    /// feed-forward 4 × dim wide, experts 2 × dim wide.
    pub fn config(&self) -> GptConfig {
        GptConfig {
            vocab: self.vocab,
            dim: self.dim,
            heads: self.heads,
            layers: self.layers,
            seq: self.seq,
            batch: self.batch,
            ff_hidden: 4 * self.dim,
            experts: self.experts,
            top_k: self.top_k,
            expert_hidden: 2 * self.dim,
        }
    }

    /// The benchmark decoder for `rank` of a run seeded `seed`: `gpt` (dense) or `gpt_moe`.
    pub(super) fn build(
        &self,
        seed: u64,
        rank: usize,
        moe: bool,
    ) -> Result<Gpt, lockstep_models::ModelError> {
        Gpt::with_config(self.config(), seed, rank, moe, 0.0)
    }
}

/// A model that notes the instant each step first asks for a batch: a training loop asks at
/// the start of every step (once per data rank it trains on), right after zeroing gradients
/// and the wrapper's pre-forward work, so consecutive instants bound exactly one whole
/// training step. With `counts` (the tally of counting groups the run communicates through)
/// it also takes the tally at each of those instants, so entry `i + 1` of `traffic` is what
/// step `i` communicated.
pub(super) struct Clocked {
    pub(super) inner: Box<dyn lockstep_models::Model>,
    pub(super) starts: Mutex<Vec<Instant>>,
    pub(super) counts: Option<CollectiveCounts>,
    pub(super) traffic: Mutex<Vec<CountMap>>,
    last_step: Mutex<Option<usize>>,
}

impl Clocked {
    /// `inner`, clocked; with `counts`, its traffic per step too.
    pub(super) fn new(
        inner: Box<dyn lockstep_models::Model>,
        counts: Option<CollectiveCounts>,
    ) -> Self {
        Clocked {
            inner,
            starts: Mutex::new(Vec::new()),
            counts,
            traffic: Mutex::new(Vec::new()),
            last_step: Mutex::new(None),
        }
    }

    /// Notes a step's start unless this step was noted already.
    fn note(&self, step: usize) {
        let Ok(mut last) = self.last_step.lock() else {
            return;
        };
        if *last == Some(step) {
            return;
        }
        *last = Some(step);
        if let Ok(mut starts) = self.starts.lock() {
            starts.push(Instant::now());
        }
        if let (Some(counts), Ok(mut traffic)) = (&self.counts, self.traffic.lock()) {
            traffic.push(counts.take());
        }
    }
}

impl lockstep_models::Model for Clocked {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn seed(&self) -> u64 {
        self.inner.seed()
    }
    fn store(&self) -> &lockstep_models::ParamStore {
        self.inner.store()
    }
    fn layers(&self) -> Vec<lockstep_models::LayerSpec> {
        self.inner.layers()
    }
    fn input(
        &self,
        rank: usize,
        step: usize,
    ) -> Result<lockstep_models::Batch, lockstep_models::ModelError> {
        self.note(step);
        self.inner.input(rank, step)
    }
    fn forward(
        &self,
        batch: &lockstep_models::Batch,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.inner.forward(batch)
    }
    fn supports_layer_hooks(&self) -> bool {
        self.inner.supports_layer_hooks()
    }
    fn forward_hooked(
        &self,
        batch: &lockstep_models::Batch,
        hooks: &mut dyn lockstep_models::LayerHooks,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.inner.forward_hooked(batch, hooks)
    }
    fn loss_of(
        &self,
        batch: &lockstep_models::Batch,
        output: &Tensor,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.inner.loss_of(batch, output)
    }
    fn single_device_reference_blocker(&self) -> Option<String> {
        self.inner.single_device_reference_blocker()
    }
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<lockstep_models::ParallelPlan> {
        self.inner.parallel_plan(sequence_parallel)
    }
    fn loss_of_hooked(
        &self,
        batch: &lockstep_models::Batch,
        output: &Tensor,
        hooks: &mut dyn lockstep_models::LayerHooks,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.inner.loss_of_hooked(batch, output, hooks)
    }
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.inner.named_parameters()
    }
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.inner.named_buffers()
    }
    fn tags(&self) -> lockstep_models::ParamTags {
        self.inner.tags()
    }
    fn num_parameters(&self) -> i64 {
        self.inner.num_parameters()
    }
}
