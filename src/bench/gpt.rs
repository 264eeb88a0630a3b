//! The benchmark decoder: a GPT-style model of any size ([`GptDims`]) that the training
//! benchmarks (`bench step`, `bench pipeline`) train, and [`Clocked`], which notes when each
//! step starts.

use serde::Serialize;
use std::time::Instant;
use tch::{Device, Kind, Tensor};

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
pub(super) struct BenchGpt {
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
    /// The decoder with parameters drawn from `seed` (the same on every rank).
    pub(super) fn new(dims: GptDims, seed: u64, rank: usize) -> Result<Self, tch::TchError> {
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
pub(super) struct Clocked {
    pub(super) inner: Box<dyn lockstep_models::Model>,
    pub(super) starts: std::sync::Mutex<Vec<Instant>>,
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
    fn gpt_config(&self) -> Option<lockstep_models::zoo::GptConfig> {
        self.inner.gpt_config()
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
