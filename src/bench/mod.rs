//! `lockstep bench`: communication and start-up benchmarks. Speed targets are measured here,
//! never by timed assertions in tests.

mod pipeline;
pub use pipeline::{run_pipeline, PipelineBenchOptions, PipelineBenchResult};

use lockstep_core::comm::{ProcessGroup, ReduceOp};
use lockstep_core::CommError;
use lockstep_harness::{launch, LaunchError, LaunchOptions, RankCtx, RankSpawn};
use serde::Serialize;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// Why a benchmark could not produce figures.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("invalid benchmark option: {0}")]
    Invalid(String),
    #[error("benchmark ranks failed:\n{0}")]
    Launch(#[from] LaunchError),
    #[error("reading benchmark results: {0}")]
    Io(#[from] std::io::Error),
    #[error("parsing benchmark results: {0}")]
    Parse(#[from] serde_json::Error),
}

/// The collectives `bench comm` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BenchOp {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
}

impl BenchOp {
    /// nccl-tests' bus-bandwidth factor: what each rank's links carry relative to the message.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            BenchOp::AllReduce => 2.0 * (n - 1.0) / n,
            BenchOp::AllGather | BenchOp::ReduceScatter | BenchOp::AllToAll => (n - 1.0) / n,
            BenchOp::Broadcast => 1.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            BenchOp::AllReduce => "all_reduce",
            BenchOp::AllGather => "all_gather",
            BenchOp::ReduceScatter => "reduce_scatter",
            BenchOp::Broadcast => "broadcast",
            BenchOp::AllToAll => "all_to_all",
        }
    }
}

/// One measured point (one JSON line of `bench comm --json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct CommPoint {
    pub op: String,
    /// Message size as nccl-tests counts it (the full tensor; all-gather: the output).
    pub bytes: usize,
    pub world_size: usize,
    /// Mean seconds per operation (the slowest rank's).
    pub seconds: f64,
    pub algbw_gbps: f64,
    pub busbw_gbps: f64,
    pub iterations: usize,
}

/// What `bench comm` runs.
#[derive(Clone, Debug)]
pub struct CommBenchOptions {
    pub world_size: usize,
    pub backend: String,
    pub ops: Vec<BenchOp>,
    /// Message sizes in bytes (rounded to whole fp32 elements divisible by the world size).
    pub sizes: Vec<usize>,
    /// Seconds of timed work per point (more iterations for small messages).
    pub seconds_per_point: f64,
}

/// Runs the collectives benchmark on freshly launched ranks and returns every point.
pub fn run_comm(opts: &CommBenchOptions) -> Result<Vec<CommPoint>, BenchError> {
    if opts.world_size < 2 {
        return Err(BenchError::Invalid(
            "the communication benchmark needs --world-size 2 or more".into(),
        ));
    }
    if opts.backend != "cpu" {
        return Err(BenchError::Invalid(format!(
            "backend {:?}: this benchmark drives the cpu backend (nccl runs need GPUs and `--features nccl`)",
            opts.backend
        )));
    }
    let out = results_path("comm");
    let launch_opts = LaunchOptions {
        world_size: opts.world_size,
        timeout: Duration::from_secs(600),
        backend: opts.backend.clone(),
    };
    let body = |ctx: &RankCtx| -> Result<(), CommError> {
        let points = measure_comm(ctx, opts)?;
        if ctx.rank() == 0 {
            let lines: Vec<String> = points
                .iter()
                .filter_map(|p| serde_json::to_string(p).ok())
                .collect();
            std::fs::write(&out, lines.join("\n"))
                .map_err(|e| CommError::io("write results", e))?;
        }
        Ok(())
    };
    launch(
        &launch_opts,
        RankSpawn::Fork(&|info| rank_exit_code(info, &body)),
    )?;
    let text = std::fs::read_to_string(&out)?;
    let _ = std::fs::remove_file(&out);
    text.lines()
        .map(|l| serde_json::from_str(l).map_err(BenchError::from))
        .collect()
}

fn rank_exit_code(
    info: lockstep_harness::RankInfo,
    body: &dyn Fn(&RankCtx) -> Result<(), CommError>,
) -> i32 {
    lockstep_harness::execute_forked_rank(info, body)
}

fn results_path(what: &str) -> PathBuf {
    let nonce: u64 = rand_nonce();
    std::env::temp_dir().join(format!(
        "lockstep-bench-{what}-{}-{nonce:x}.jsonl",
        std::process::id()
    ))
}

fn rand_nonce() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// Agrees on one value across ranks: the maximum.
fn max_across(group: &dyn ProcessGroup, value: f64) -> Result<f64, CommError> {
    let t = Tensor::from_slice(&[value]);
    group.all_reduce(&t, ReduceOp::Max)?;
    Ok(t.double_value(&[0]))
}

fn measure_comm(ctx: &RankCtx, opts: &CommBenchOptions) -> Result<Vec<CommPoint>, CommError> {
    let group = ctx.group();
    let n = ctx.world_size();
    let mut points = Vec::new();
    for &op in &opts.ops {
        for &bytes in &opts.sizes {
            // Gathers, scatters and all-to-all split the tensor evenly over the ranks.
            let elems = match op {
                BenchOp::AllReduce | BenchOp::Broadcast => (bytes / 4).max(1),
                _ => (bytes / 4).max(1).div_ceil(n) * n,
            };
            let run = prepare(op, elems, n, ctx.rank())?;
            for _ in 0..2 {
                run(group.as_ref())?;
            }
            let t0 = Instant::now();
            run(group.as_ref())?;
            let one = max_across(group.as_ref(), t0.elapsed().as_secs_f64())?;
            let iterations = ((opts.seconds_per_point / one.max(1e-7)) as usize).clamp(3, 20_000);
            group.barrier()?;
            let t0 = Instant::now();
            for _ in 0..iterations {
                run(group.as_ref())?;
            }
            let total = max_across(group.as_ref(), t0.elapsed().as_secs_f64())?;
            let seconds = total / iterations as f64;
            let size = elems * 4;
            let algbw = size as f64 / seconds / 1e9;
            points.push(CommPoint {
                op: op.name().into(),
                bytes: size,
                world_size: n,
                seconds,
                algbw_gbps: algbw,
                busbw_gbps: algbw * op.bus_factor(n),
                iterations,
            });
        }
    }
    Ok(points)
}

type Step = Box<dyn Fn(&dyn ProcessGroup) -> Result<(), CommError>>;

fn prepare(op: BenchOp, elems: usize, n: usize, rank: usize) -> Result<Step, CommError> {
    let opts = (Kind::Float, Device::Cpu);
    let full = Tensor::f_ones([elems as i64], opts)? * (rank as f64 + 1.0);
    let part = Tensor::f_ones([(elems / n) as i64], opts)?;
    Ok(match op {
        BenchOp::AllReduce => Box::new(move |g| g.all_reduce(&full, ReduceOp::Sum)),
        BenchOp::AllGather => Box::new(move |g| g.all_gather(&full, &part)),
        BenchOp::ReduceScatter => Box::new(move |g| g.reduce_scatter(&part, &full, ReduceOp::Sum)),
        BenchOp::Broadcast => Box::new(move |g| g.broadcast(&full, 0)),
        BenchOp::AllToAll => {
            let out = full.f_zeros_like()?;
            Box::new(move |g| g.all_to_all(&out, &full, &[], &[]))
        }
    })
}

/// How `bench spawn` starts ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum SpawnBenchMode {
    /// Fork the launcher (the harness's default on the CPU backend).
    Fork,
    /// Execute a fresh `lockstep` process per rank.
    Exec,
}

/// The result of `bench spawn`.
#[derive(Clone, Debug, Serialize)]
pub struct SpawnResult {
    pub world_size: usize,
    /// Median over the repeats: spawn, rendezvous, one all_reduce, every rank exited.
    pub seconds: f64,
    pub min_seconds: f64,
    pub max_seconds: f64,
    pub repeats: usize,
    pub mode: SpawnBenchMode,
}

/// The hidden subcommand a rank of `bench spawn --mode exec` runs.
pub const SPAWN_PROBE_COMMAND: &str = "__spawn-probe";

/// The work of one spawn-benchmark rank: one all_reduce of one fp32.
pub fn spawn_probe(ctx: &RankCtx) -> Result<(), CommError> {
    let t = Tensor::from_slice(&[1.0f32]);
    ctx.group().all_reduce(&t, ReduceOp::Sum)
}

/// Measures spawn + rendezvous + first all_reduce, `repeats` times.
pub fn run_spawn(
    world_size: usize,
    repeats: usize,
    mode: SpawnBenchMode,
) -> Result<SpawnResult, BenchError> {
    if world_size == 0 || repeats == 0 {
        return Err(BenchError::Invalid(
            "world size and repeats must be at least 1".into(),
        ));
    }
    let opts = LaunchOptions {
        world_size,
        timeout: Duration::from_secs(120),
        backend: "cpu".into(),
    };
    let exe = std::env::current_exe()?;
    let command = |_| lockstep_harness::RankCommand {
        program: exe.clone(),
        args: vec![SPAWN_PROBE_COMMAND.into()],
        env: vec![],
    };
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t0 = Instant::now();
        match mode {
            SpawnBenchMode::Fork => launch(
                &opts,
                RankSpawn::Fork(&|info| rank_exit_code(info, &spawn_probe)),
            )?,
            SpawnBenchMode::Exec => launch(&opts, RankSpawn::Exec(&command))?,
        };
        times.push(t0.elapsed().as_secs_f64());
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    Ok(SpawnResult {
        world_size,
        seconds: sorted[sorted.len() / 2],
        min_seconds: sorted[0],
        max_seconds: sorted[sorted.len() - 1],
        repeats,
        mode,
    })
}

/// Dimensions of the decoder `bench step` trains (the zoo's `gpt` is fixed at dim 16, far too
/// small for a step to be more than launch and collective latency).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct GptDims {
    pub vocab: i64,
    pub dim: i64,
    pub heads: i64,
    pub layers: usize,
    /// Tokens per sequence.
    pub seq: i64,
    /// Sequences per rank and step.
    pub batch: i64,
}

impl GptDims {
    /// The size `bench step` uses by default: 3.3 M parameters, 256 tokens per rank (a DDP
    /// step takes about 0.1 s on one core).
    pub const BENCH: GptDims = GptDims {
        vocab: 512,
        dim: 256,
        heads: 8,
        layers: 4,
        seq: 32,
        batch: 8,
    };

    /// A decoder small enough for tests.
    pub const TINY: GptDims = GptDims {
        vocab: 16,
        dim: 16,
        heads: 2,
        layers: 1,
        seq: 4,
        batch: 2,
    };
}

/// One pre-norm decoder block's parameters, in registration order.
const BLOCK_PARAMS: [&str; 16] = [
    "attention_norm.weight",
    "attention_norm.bias",
    "attention.wq.weight",
    "attention.wq.bias",
    "attention.wk.weight",
    "attention.wk.bias",
    "attention.wv.weight",
    "attention.wv.bias",
    "attention.wo.weight",
    "attention.wo.bias",
    "ffn_norm.weight",
    "ffn_norm.bias",
    "feed_forward.w1.weight",
    "feed_forward.w1.bias",
    "feed_forward.w2.weight",
    "feed_forward.w2.bias",
];

/// A GPT-style decoder of any size for `bench step`: the zoo `gpt`'s structure (learned
/// positions, pre-norm causal attention, GELU MLP, tied output projection), with
/// [`GptDims`].
struct BenchGpt {
    dims: GptDims,
    rank: usize,
    seed: u64,
    params: Vec<(String, Tensor)>,
    /// Always empty: parameters live in `params` (the store's registration is crate-private).
    store: lockstep_models::ParamStore,
}

impl std::fmt::Debug for BenchGpt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BenchGpt")
            .field("dims", &self.dims)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

impl BenchGpt {
    fn new(dims: GptDims, seed: u64, rank: usize) -> Result<Self, tch::TchError> {
        let d = dims.dim;
        let opts = (Kind::Float, Device::Cpu);
        let params = lockstep_models::seed::seeded(seed, || {
            let normal = |shape: &[i64]| -> Result<Tensor, tch::TchError> {
                Tensor::f_randn(shape, opts)?.f_mul_scalar(0.02)
            };
            let mut params = vec![
                (
                    "tok_embeddings.weight".to_owned(),
                    normal(&[dims.vocab, d])?,
                ),
                ("pos_embeddings.weight".to_owned(), normal(&[dims.seq, d])?),
            ];
            for i in 0..dims.layers {
                for name in BLOCK_PARAMS {
                    let value = match name.rsplit_once('.').map_or("", |(m, _)| m) {
                        "attention_norm" | "ffn_norm" if name.ends_with("weight") => {
                            Tensor::f_ones([d], opts)?
                        }
                        _ if name.ends_with("bias") => {
                            let n = if name.starts_with("feed_forward.w1") {
                                4 * d
                            } else {
                                d
                            };
                            Tensor::f_zeros([n], opts)?
                        }
                        "feed_forward.w1" => normal(&[4 * d, d])?,
                        "feed_forward.w2" => normal(&[d, 4 * d])?,
                        _ => normal(&[d, d])?,
                    };
                    params.push((format!("layers.{i}.{name}"), value));
                }
            }
            params.push(("norm.weight".to_owned(), Tensor::f_ones([d], opts)?));
            params.push(("norm.bias".to_owned(), Tensor::f_zeros([d], opts)?));
            Ok::<_, tch::TchError>(params)
        })?;
        let params = params
            .into_iter()
            .map(|(n, t)| (n, t.set_requires_grad(true)))
            .collect();
        Ok(BenchGpt {
            dims,
            rank,
            seed,
            params,
            store: lockstep_models::ParamStore::default(),
        })
    }

    fn p(&self, name: &str) -> &Tensor {
        // Names come from this file only; a miss is a programming error caught by the tests.
        &self
            .params
            .iter()
            .find(|(n, _)| n == name)
            .unwrap_or_else(|| panic!("bench decoder has no parameter {name}"))
            .1
    }

    fn linear(&self, x: &Tensor, prefix: &str) -> Result<Tensor, tch::TchError> {
        x.f_linear(
            self.p(&format!("{prefix}.weight")),
            Some(self.p(&format!("{prefix}.bias"))),
        )
    }

    fn norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor, tch::TchError> {
        x.f_layer_norm(
            [self.dims.dim],
            Some(self.p(&format!("{prefix}.weight"))),
            Some(self.p(&format!("{prefix}.bias"))),
            1e-5,
            false,
        )
    }

    fn block(&self, h: &Tensor, i: usize) -> Result<Tensor, tch::TchError> {
        let p = |s: &str| format!("layers.{i}.{s}");
        let (b, t, d, heads) = (h.size()[0], h.size()[1], self.dims.dim, self.dims.heads);
        let hd = d / heads;
        let x = self.norm(h, &p("attention_norm"))?;
        let split = |y: Tensor| y.f_view([b, t, heads, hd])?.f_transpose(1, 2);
        let q = split(self.linear(&x, &p("attention.wq"))?)?;
        let k = split(self.linear(&x, &p("attention.wk"))?)?;
        let v = split(self.linear(&x, &p("attention.wv"))?)?;
        let future = Tensor::f_ones([t, t], (Kind::Bool, Device::Cpu))?.f_triu(1)?;
        let att = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(1.0 / (hd as f64).sqrt())?
            .f_masked_fill(&future, f64::NEG_INFINITY)?
            .f_softmax(-1, None)?
            .f_matmul(&v)?
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([b, t, d])?;
        let h = h.f_add(&self.linear(&att, &p("attention.wo"))?)?;
        let x = self.norm(&h, &p("ffn_norm"))?;
        let ff = self.linear(
            &self.linear(&x, &p("feed_forward.w1"))?.f_gelu("none")?,
            &p("feed_forward.w2"),
        )?;
        h.f_add(&ff)
    }
}

impl lockstep_models::Model for BenchGpt {
    fn name(&self) -> &str {
        "gpt"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn store(&self) -> &lockstep_models::ParamStore {
        &self.store
    }

    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        Vec::new()
    }

    fn tags(&self) -> lockstep_models::ParamTags {
        lockstep_models::ParamTags::default()
    }

    fn num_parameters(&self) -> i64 {
        self.params.iter().map(|(_, t)| t.numel() as i64).sum()
    }

    fn layers(&self) -> Vec<lockstep_models::LayerSpec> {
        use lockstep_models::{LayerKind, LayerSpec};
        let mut layers = vec![
            LayerSpec {
                name: "tok_embeddings".into(),
                kind: LayerKind::Embedding,
                params: vec!["tok_embeddings.weight".into()],
            },
            LayerSpec {
                name: "pos_embeddings".into(),
                kind: LayerKind::Embedding,
                params: vec!["pos_embeddings.weight".into()],
            },
        ];
        for i in 0..self.dims.layers {
            layers.push(LayerSpec {
                name: format!("layers.{i}"),
                kind: LayerKind::DecoderBlock,
                params: BLOCK_PARAMS
                    .iter()
                    .map(|n| format!("layers.{i}.{n}"))
                    .collect(),
            });
        }
        layers.push(LayerSpec {
            name: "norm".into(),
            kind: LayerKind::LayerNorm,
            params: vec!["norm.weight".into(), "norm.bias".into()],
        });
        layers.push(LayerSpec {
            name: "output".into(),
            kind: LayerKind::OutputProjection,
            params: vec!["tok_embeddings.weight".into()],
        });
        layers
    }

    /// Random tokens from the batch seed.
    fn input(
        &self,
        rank: usize,
        step: usize,
    ) -> Result<lockstep_models::Batch, lockstep_models::ModelError> {
        let d = self.dims;
        let tokens = lockstep_models::seed::seeded(
            lockstep_models::seed::batch_seed(self.seed, rank, step),
            || Tensor::f_randint(d.vocab, [d.batch, d.seq + 1], (Kind::Int64, Device::Cpu)),
        )?;
        Ok(lockstep_models::Batch {
            inputs: vec![tokens.f_narrow(1, 0, d.seq)?],
            target: Some(tokens.f_narrow(1, 1, d.seq)?),
        })
    }

    fn forward(
        &self,
        batch: &lockstep_models::Batch,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.forward_hooked(batch, &mut lockstep_models::NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    fn forward_hooked(
        &self,
        batch: &lockstep_models::Batch,
        hooks: &mut dyn lockstep_models::LayerHooks,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        use lockstep_models::ModelError;
        let tokens = batch
            .inputs
            .first()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: "gpt".into(),
                reason: "expected one token tensor".into(),
            })?;
        let mut run = lockstep_models::LayerRun::new(hooks);
        let emb = self.p("tok_embeddings.weight");
        let tok = run.layer([tokens.shallow_clone()], |[x]| {
            Ok(Tensor::f_embedding(emb, &x, -1, false, false)?)
        })?;
        let positions = Tensor::f_arange(tokens.size()[1], (Kind::Int64, Device::Cpu))?;
        let pos = run.layer([positions], |[x]| {
            Ok(Tensor::f_embedding(
                self.p("pos_embeddings.weight"),
                &x,
                -1,
                false,
                false,
            )?)
        })?;
        let mut h = tok.f_add(&pos)?;
        for i in 0..self.dims.layers {
            h = run.layer([h], |[x]| Ok(self.block(&x, i)?))?;
        }
        let h = run.layer([h], |[x]| Ok(self.norm(&x, "norm")?))?;
        // The output projection is tied to the token embedding.
        run.layer([h], |[x]| Ok(x.f_linear::<Tensor>(emb, None)?))
    }

    fn loss_of(
        &self,
        batch: &lockstep_models::Batch,
        output: &Tensor,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        let target =
            batch
                .target
                .as_ref()
                .ok_or_else(|| lockstep_models::ModelError::InvalidBatch {
                    model: "gpt".into(),
                    reason: "missing target tokens".into(),
                })?;
        Ok(output
            .f_view([-1, self.dims.vocab])?
            .f_cross_entropy_loss::<Tensor>(
                &target.f_reshape([-1])?,
                None,
                tch::Reduction::Mean,
                -100,
                0.0,
            )?)
    }
}

/// A model that notes the instant each step asks for its batch: the training loop asks once
/// per step (one data rank), right after zeroing gradients and the wrapper's pre-forward work,
/// so consecutive instants bound exactly one whole training step.
struct Clocked {
    inner: Box<dyn lockstep_models::Model>,
    starts: std::sync::Mutex<Vec<Instant>>,
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
        if let Ok(mut starts) = self.starts.lock() {
            starts.push(Instant::now());
        }
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

/// What `bench step` runs.
#[derive(Clone, Debug)]
pub struct StepBenchOptions {
    pub world_size: usize,
    /// `gpt` (the benchmark decoder, sized by `dims`) or any other zoo model name (as built).
    pub model: String,
    /// The decoder's size when `model` is `gpt`.
    pub dims: GptDims,
    /// Timed steps (after one warm-up step); the median is reported.
    pub steps: usize,
}

impl Default for StepBenchOptions {
    fn default() -> Self {
        StepBenchOptions {
            world_size: 2,
            model: "gpt".into(),
            dims: GptDims::BENCH,
            steps: 5,
        }
    }
}

/// The result of `bench step` (one JSON object with `--json`).
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct StepResult {
    pub model: String,
    pub world_size: usize,
    /// Median seconds per DDP training step (forward, backward, gradient sync, optimizer).
    pub ddp_seconds: f64,
    /// Median seconds per FSDP full-shard step (unshard, forward, backward, reduce-scatter,
    /// sharded optimizer step).
    pub fsdp_seconds: f64,
    /// `fsdp_seconds / ddp_seconds`.
    pub ratio: f64,
    /// Median seconds per FSDP full-shard step with one unit per layer, freed after its
    /// forward and re-gathered (prefetched) for backward: the configuration that saves memory.
    pub fsdp_per_layer_seconds: f64,
    /// `fsdp_per_layer_seconds / ddp_seconds`.
    pub per_layer_ratio: f64,
    /// Trainable parameters of the model.
    pub parameters: i64,
    /// Timed steps per run (the medians are over these).
    pub steps: usize,
}

/// Which data-parallel wrapper a step-benchmark run uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StepWrapper {
    Ddp,
    FsdpFullShard,
    FsdpPerLayer,
}

/// Times training steps under DDP and FSDP full shard on the CPU backend, each in a fresh
/// launch of `world_size` forked ranks (one libtorch thread each). A step is timed from one
/// step's batch request to the next one's on rank 0 (so it spans forward, backward, gradient
/// synchronization, the loss all-reduce, the optimizer step and FSDP's unshard before the
/// next forward); the first (warm-up) step is dropped and the median of the rest reported.
pub fn run_step(opts: &StepBenchOptions) -> Result<StepResult, BenchError> {
    if opts.world_size < 2 {
        return Err(BenchError::Invalid(
            "the step benchmark needs --world-size 2 or more".into(),
        ));
    }
    if opts.steps == 0 {
        return Err(BenchError::Invalid("--steps must be at least 1".into()));
    }
    let d = opts.dims;
    if opts.model == "gpt" && (d.dim % d.heads != 0 || d.layers == 0 || d.seq < 1) {
        return Err(BenchError::Invalid(format!(
            "decoder dims {d:?}: dim must be a multiple of heads, with at least one layer"
        )));
    }
    if opts.model != "gpt" && !lockstep_models::zoo::names().contains(&opts.model.as_str()) {
        return Err(BenchError::Invalid(format!(
            "unknown model `{}`; known: gpt (the benchmark decoder) and the zoo: {}",
            opts.model,
            lockstep_models::zoo::names().join(", ")
        )));
    }
    tch::set_num_threads(1);
    let (ddp, parameters) = time_steps(opts, StepWrapper::Ddp)?;
    let (fsdp, _) = time_steps(opts, StepWrapper::FsdpFullShard)?;
    let (per_layer, _) = time_steps(opts, StepWrapper::FsdpPerLayer)?;
    Ok(StepResult {
        model: opts.model.clone(),
        world_size: opts.world_size,
        ddp_seconds: ddp,
        fsdp_seconds: fsdp,
        ratio: fsdp / ddp,
        fsdp_per_layer_seconds: per_layer,
        per_layer_ratio: per_layer / ddp,
        parameters,
        steps: opts.steps,
    })
}

#[derive(serde::Serialize, serde::Deserialize)]
struct StepTimes {
    seconds: Vec<f64>,
    parameters: i64,
}

/// One launch; returns the median step time and the parameter count.
fn time_steps(opts: &StepBenchOptions, wrapper: StepWrapper) -> Result<(f64, i64), BenchError> {
    use lockstep_core::ddp::{train_ddp, DdpOptions};
    use lockstep_core::fsdp::{train_fsdp, FsdpOptions, ShardingStrategy, WrapPolicy};
    use lockstep_core::record::RunSpec;
    use lockstep_core::train::{OptimizerConfig, TrainConfig};
    use lockstep_models::Model;

    let out = results_path("step");
    let seed = 0;
    let body = |ctx: &RankCtx| -> Result<(), String> {
        let rank = ctx.rank();
        let inner: Box<dyn Model> = if opts.model == "gpt" {
            Box::new(BenchGpt::new(opts.dims, seed, rank).map_err(|e| e.to_string())?)
        } else {
            lockstep_models::zoo::build(&opts.model, seed, rank).map_err(|e| e.to_string())?
        };
        let clocked = Clocked {
            inner,
            starts: std::sync::Mutex::new(Vec::new()),
        };
        let model: &dyn Model = &clocked;
        let cfg = TrainConfig {
            spec: RunSpec {
                model: opts.model.clone(),
                config: format!("{wrapper:?}"),
                world_size: ctx.world_size(),
                backend: "cpu".into(),
                dtype: "fp32".into(),
                // Warm-up, the timed steps, and one more whose batch request ends the last.
                steps: opts.steps + 2,
                seed,
            },
            optimizer: OptimizerConfig::default(),
            data_ranks: vec![rank],
            record_grads: false,
        };
        match wrapper {
            StepWrapper::Ddp => train_ddp(model, ctx.group(), &cfg, DdpOptions::default())
                .map(drop)
                .map_err(|e| format!("ddp: {e}"))?,
            StepWrapper::FsdpFullShard | StepWrapper::FsdpPerLayer => {
                let fsdp = FsdpOptions {
                    strategy: ShardingStrategy::FullShard,
                    wrap: if wrapper == StepWrapper::FsdpPerLayer {
                        WrapPolicy::PerLayer
                    } else {
                        WrapPolicy::Root
                    },
                    ..FsdpOptions::default()
                };
                train_fsdp(model, ctx.group(), &cfg, fsdp)
                    .map(drop)
                    .map_err(|e| format!("fsdp: {e}"))?
            }
        }
        if rank == 0 {
            let starts = clocked
                .starts
                .lock()
                .map_err(|_| "step clock poisoned".to_owned())?
                .clone();
            // Drop the warm-up step; the last instant only closes the last timed step.
            let seconds: Vec<f64> = starts
                .windows(2)
                .skip(1)
                .map(|w| (w[1] - w[0]).as_secs_f64())
                .collect();
            let times = StepTimes {
                seconds,
                parameters: model.num_parameters(),
            };
            let json = serde_json::to_vec(&times).map_err(|e| e.to_string())?;
            std::fs::write(&out, json).map_err(|e| format!("writing results: {e}"))?;
        }
        Ok(())
    };
    let launch_opts = LaunchOptions {
        world_size: opts.world_size,
        timeout: Duration::from_secs(600),
        backend: "cpu".into(),
    };
    let launched = launch(
        &launch_opts,
        RankSpawn::Fork(&|info| lockstep_harness::execute_forked_rank(info, &body)),
    );
    let read = std::fs::read(&out);
    let _ = std::fs::remove_file(&out);
    launched?;
    let times: StepTimes = serde_json::from_slice(&read?)?;
    let mut sorted = times.seconds;
    if sorted.is_empty() {
        return Err(BenchError::Invalid("no step times were recorded".into()));
    }
    sorted.sort_by(f64::total_cmp);
    Ok((sorted[sorted.len() / 2], times.parameters))
}
