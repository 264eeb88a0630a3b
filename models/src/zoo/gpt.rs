//! A small GPT-style decoder for tensor, pipeline and expert parallelism: pre-norm blocks
//! with causal attention, a dense or mixture-of-experts feed-forward, and an output
//! projection tied to the token embedding.

use crate::layers::{path, LayerNorm, Linear};
use crate::model::{Batch, LayerHooks, LayerKind, LayerSpec, Model, MoeSpec, NoHooks};
use crate::plan::{ParallelPlan, ParallelStyle};
use crate::seed;
use crate::store::{normal, ParamStore};
use crate::LayerRun;
use crate::ModelError;
use tch::{Kind, TchError, Tensor};

/// Sizes of the decoder: the zoo's models use [`GptConfig::ZOO`]; benchmarks build the same
/// decoder larger. The model's parallel plan ([`Model::parallel_plan`]) is written against
/// its module names, so it applies at any size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GptConfig {
    /// Vocabulary size: what a vocabulary-parallel plan splits.
    pub vocab: i64,
    /// Model width.
    pub dim: i64,
    /// Attention heads: a tensor-parallel plan splits attention by whole heads.
    pub heads: i64,
    /// Decoder blocks.
    pub layers: usize,
    /// Tokens per sequence (and learned positions).
    pub seq: i64,
    /// Sequences per rank and step.
    pub batch: i64,
    /// Hidden width of the dense feed-forward.
    pub ff_hidden: i64,
    /// Experts of each mixture-of-experts layer.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: i64,
    /// Hidden width of each expert.
    pub expert_hidden: i64,
}

impl GptConfig {
    /// The zoo's `gpt`, `gpt_moe` and `gpt_dropout`: vocab 8, dim 16, 4 heads, 2 layers,
    /// 2 sequences of 8 tokens, top-2 of 8 experts — small enough for every parity test.
    pub const ZOO: GptConfig = GptConfig {
        vocab: 8,
        dim: 16,
        heads: 4,
        layers: 2,
        seq: 8,
        batch: 2,
        ff_hidden: 4 * 16,
        experts: 8,
        top_k: 2,
        expert_hidden: 2 * 16,
    };

    /// Why these sizes cannot build a decoder, if they cannot (every size positive, heads
    /// dividing the width, top-k within the experts).
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |reason: String| {
            Err(ModelError::InvalidConfig {
                model: "gpt".into(),
                reason,
            })
        };
        let sizes = [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("heads", self.heads),
            ("layers", self.layers as i64),
            ("seq", self.seq),
            ("batch", self.batch),
            ("ff_hidden", self.ff_hidden),
            ("experts", self.experts as i64),
            ("top_k", self.top_k),
            ("expert_hidden", self.expert_hidden),
        ];
        if let Some((name, v)) = sizes.iter().find(|(_, v)| *v < 1) {
            return bad(format!("{name} is {v}, must be at least 1"));
        }
        if self.dim % self.heads != 0 {
            return bad(format!(
                "dim {} is not a multiple of the {} heads",
                self.dim, self.heads
            ));
        }
        if self.top_k > self.experts as i64 {
            return bad(format!(
                "top_k {} exceeds the {} experts",
                self.top_k, self.experts
            ));
        }
        Ok(())
    }
}

/// Dropout of one forward: each sample's mask keys, the rate, and the layer drawing (sites
/// within a layer: 0 the embedding sum, 1 the attention probabilities, 2 the feed-forward's
/// hidden activations). Masks come from [`seed::dropout_mask`], per sample, so any split of
/// the batch draws the same ones; the module hooks apply them (a plan that splits the
/// activation keeps its slice of the full mask).
#[derive(Clone, Copy, Debug)]
struct Dropout<'a> {
    keys: &'a [i64],
    p: f64,
    layer: u64,
}

impl Dropout<'_> {
    /// `x` (B, ...) through the dropout hook at `path`, with the keep-masks of site `site`.
    fn apply(
        &self,
        m: &mut dyn LayerHooks,
        path: &str,
        x: &Tensor,
        site: u64,
    ) -> Result<Tensor, ModelError> {
        let (keys, layer, p) = (self.keys, self.layer, self.p);
        m.dropout(path, x, &|per_sample: &[i64]| {
            Ok(seed::dropout_mask(keys, layer, site, per_sample, p)?)
        })
    }
}

/// Causal self-attention with separate q/k/v/o projections (so tensor parallelism can split
/// heads column-wise and the output row-wise). Heads are reshaped by head size (`-1` heads),
/// so column-split projections simply carry fewer local heads.
#[derive(Debug)]
struct Attention {
    wq: Linear,
    wk: Linear,
    wv: Linear,
    wo: Linear,
    head_dim: i64,
    path: String,
}

impl Attention {
    const PROJ: [&'static str; 4] = ["wq", "wk", "wv", "wo"];

    fn new(store: &mut ParamStore, prefix: &str, cfg: &GptConfig) -> Result<Self, TchError> {
        let d = cfg.dim;
        Ok(Attention {
            wq: Linear::new(store, &path(prefix, "wq"), d, d, true)?,
            wk: Linear::new(store, &path(prefix, "wk"), d, d, true)?,
            wv: Linear::new(store, &path(prefix, "wv"), d, d, true)?,
            wo: Linear::new(store, &path(prefix, "wo"), d, d, true)?,
            head_dim: d / cfg.heads,
            path: prefix.to_owned(),
        })
    }

    /// `x`: (B, T, D) (or whatever layout the hooks give the projections: their outputs are
    /// batch first).
    fn forward(
        &self,
        m: &mut dyn LayerHooks,
        x: &Tensor,
        drop: Option<Dropout<'_>>,
    ) -> Result<Tensor, ModelError> {
        let hd = self.head_dim;
        let q = self.wq.call(m, x)?;
        let (b, t) = (q.size()[0], q.size()[1]);
        let heads = |y: Tensor| y.f_view([b, t, -1, hd])?.f_transpose(1, 2);
        let q = heads(q)?;
        let k = heads(self.wk.call(m, x)?)?;
        let v = heads(self.wv.call(m, x)?)?;
        let attended = match drop {
            // Without dropout the attention is the hooks' (a context-parallel plan's ring).
            None => m.attention(&self.path, &q, &k, &v)?,
            Some(d) => {
                let future = Tensor::f_ones([t, t], (Kind::Bool, q.device()))?.f_triu(1)?;
                let scores = q
                    .f_matmul(&k.f_transpose(-2, -1)?)?
                    .f_mul_scalar(1.0 / (hd as f64).sqrt())?
                    .f_masked_fill(&future, f64::NEG_INFINITY)?;
                let probs = scores.f_softmax(-1, None)?;
                d.apply(m, &path(&self.path, "dropout"), &probs, 1)?
                    .f_matmul(&v)?
            }
        };
        let out = attended
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([b, t, -1])?;
        self.wo.call(m, &out)
    }
}

/// `w2(gelu(w1(x)))`: the dense feed-forward and each expert.
#[derive(Debug)]
struct Mlp {
    w1: Linear,
    w2: Linear,
    path: String,
}

impl Mlp {
    fn new(store: &mut ParamStore, prefix: &str, dim: i64, hidden: i64) -> Result<Self, TchError> {
        Ok(Mlp {
            w1: Linear::new(store, &path(prefix, "w1"), dim, hidden, true)?,
            w2: Linear::new(store, &path(prefix, "w2"), hidden, dim, true)?,
            path: prefix.to_owned(),
        })
    }

    fn names(prefix: &str) -> Vec<String> {
        let mut v = Linear::names(&path(prefix, "w1"), true);
        v.extend(Linear::names(&path(prefix, "w2"), true));
        v
    }

    /// An expert: plain ops (the mixture's hook decides where experts run).
    fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        self.w2.forward(&self.w1.forward(x)?.f_gelu("none")?)
    }

    /// The dense feed-forward through the module hooks.
    fn forward_hooked(
        &self,
        m: &mut dyn LayerHooks,
        x: &Tensor,
        drop: Option<Dropout<'_>>,
    ) -> Result<Tensor, ModelError> {
        let mut h = self.w1.call(m, x)?.f_gelu("none")?;
        if let Some(d) = drop {
            h = d.apply(m, &path(&self.path, "dropout"), &h, 2)?;
        }
        self.w2.call(m, &h)
    }
}

/// Top-k of the experts (the zoo: top-2 of 8), gates renormalized over the chosen k.
/// Computed densely (every expert sees every token, weighted by a gate that is zero unless
/// chosen): the reference is exact and every expert always has a gradient, so collectives
/// never depend on routing.
#[derive(Debug)]
struct Moe {
    router: Linear,
    experts: Vec<Mlp>,
    top_k: i64,
    path: String,
}

impl Moe {
    fn new(store: &mut ParamStore, prefix: &str, cfg: &GptConfig) -> Result<Self, TchError> {
        let router = Linear::new(
            store,
            &path(prefix, "router"),
            cfg.dim,
            cfg.experts as i64,
            false,
        )?;
        let mut experts = Vec::new();
        for e in 0..cfg.experts {
            let p = path(prefix, &format!("experts.{e}"));
            experts.push(Mlp::new(store, &p, cfg.dim, cfg.expert_hidden)?);
            for name in Mlp::names(&p) {
                store.tag_expert(&name, e);
            }
        }
        Ok(Moe {
            router,
            experts,
            top_k: cfg.top_k,
            path: prefix.to_owned(),
        })
    }

    fn names(prefix: &str, experts: usize) -> Vec<String> {
        let mut v = Linear::names(&path(prefix, "router"), false);
        for e in 0..experts {
            v.extend(Mlp::names(&path(prefix, &format!("experts.{e}"))));
        }
        v
    }

    /// `x`: (B, T, D) (or any token-wise layout).
    fn dense(&self, x: &Tensor) -> Result<Tensor, TchError> {
        let probs = self.router.forward(x)?.f_softmax(-1, None)?;
        let (top, idx) = crate::decisions::topk(&probs, self.top_k)?;
        let top = top.f_div(&top.f_sum_dim_intlist(-1, true, None)?)?;
        // Choices over their expert's capacity (under `decisions::dropping`) get no gate.
        let top = match crate::decisions::kept(&idx, self.experts.len())? {
            Some(keep) => top.f_mul(&keep.f_to_kind(top.kind())?)?,
            None => top,
        };
        let gates = probs.f_zeros_like()?.f_scatter(-1, &idx, &top)?;
        let mut out = x.f_zeros_like()?;
        for (e, expert) in self.experts.iter().enumerate() {
            let g = gates.f_narrow(-1, e as i64, 1)?;
            out = out.f_add(&expert.forward(x)?.f_mul(&g)?)?;
        }
        Ok(out)
    }

    /// The mixture through its module hook (expert parallelism runs it distributed).
    fn forward(&self, m: &mut dyn LayerHooks, x: &Tensor) -> Result<Tensor, ModelError> {
        let spec = MoeSpec {
            experts: self.experts.len(),
            top_k: self.top_k,
        };
        m.moe(&self.path, x, spec, &|x: &Tensor| Ok(self.dense(x)?))
    }
}

#[derive(Debug)]
enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

#[derive(Debug)]
struct Block {
    attention_norm: LayerNorm,
    attention: Attention,
    ffn_norm: LayerNorm,
    ffn: Ffn,
}

impl Block {
    /// Pre-norm attention then feed-forward, each with its residual add.
    fn forward(
        &self,
        m: &mut dyn LayerHooks,
        h: &Tensor,
        drop: Option<Dropout<'_>>,
    ) -> Result<Tensor, ModelError> {
        let normed = self.attention_norm.call(m, h)?;
        let h = h.f_add(&self.attention.forward(m, &normed, drop)?)?;
        let normed = self.ffn_norm.call(m, &h)?;
        let ff = match &self.ffn {
            Ffn::Dense(mlp) => mlp.forward_hooked(m, &normed, drop)?,
            Ffn::Moe(moe) => moe.forward(m, &normed)?,
        };
        Ok(h.f_add(&ff)?)
    }
}

/// A decoder-only transformer: pre-norm layers, learned positions, LayerNorm, tied output
/// projection; dense GELU MLP or a top-k mixture of experts. Sized by a [`GptConfig`] (the
/// zoo's: vocab 8, dim 16, 4 heads, 2 layers, top-2 of 8 experts).
#[derive(Debug)]
pub struct Gpt {
    config: GptConfig,
    rank: usize,
    seed: u64,
    moe: bool,
    /// Dropout rate of the embedding sum, attention probabilities and dense feed-forward
    /// hidden activations (0: none, and inputs carry no mask keys).
    dropout: f64,
    tok_embeddings: Tensor,
    pos_embeddings: Tensor,
    blocks: Vec<Block>,
    norm: LayerNorm,
    store: ParamStore,
    /// The recipe's gradient clipping ([`Model::max_grad_norm`]); `None` for the zoo's
    /// decoders but `gpt_dropout`.
    max_grad_norm: Option<f64>,
}

impl Gpt {
    /// Builds the dense (`moe = false`) or mixture-of-experts decoder; every parameter is
    /// drawn from the run's parameter seed, so experts are the same on every rank (expert
    /// parallelism shards them, it does not re-seed them).
    pub fn new(run_seed: u64, rank: usize, moe: bool) -> Result<Self, ModelError> {
        Self::with_dropout(run_seed, rank, moe, 0.0)
    }

    /// The decoder with dropout `p` (`gpt_dropout`): batches carry each sample's mask keys
    /// as a second input, so every parallel configuration draws the same masks.
    pub fn with_dropout(run_seed: u64, rank: usize, moe: bool, p: f64) -> Result<Self, ModelError> {
        Self::with_config(GptConfig::ZOO, run_seed, rank, moe, p)
    }

    /// The decoder at any size (benchmarks train it far larger than the zoo's): the same
    /// parameter names, draws in the same order, and the same inputs, scaled to `config`.
    pub fn with_config(
        config: GptConfig,
        run_seed: u64,
        rank: usize,
        moe: bool,
        p: f64,
    ) -> Result<Self, ModelError> {
        config.check()?;
        let c = config;
        let mut store = ParamStore::default();
        let guard = seed::lock_seeded(seed::param_seed(run_seed));
        let tok_embeddings = store.param("tok_embeddings.weight", || normal(&[c.vocab, c.dim]))?;
        let pos_embeddings = store.param("pos_embeddings.weight", || normal(&[c.seq, c.dim]))?;
        let mut blocks = Vec::new();
        for i in 0..c.layers {
            let p = format!("layers.{i}");
            let attention_norm = LayerNorm::new(&mut store, &path(&p, "attention_norm"), c.dim)?;
            let attention = Attention::new(&mut store, &path(&p, "attention"), &c)?;
            let ffn_norm = LayerNorm::new(&mut store, &path(&p, "ffn_norm"), c.dim)?;
            let ffn = if moe {
                Ffn::Moe(Moe::new(&mut store, &path(&p, "moe"), &c)?)
            } else {
                Ffn::Dense(Mlp::new(
                    &mut store,
                    &path(&p, "feed_forward"),
                    c.dim,
                    c.ff_hidden,
                )?)
            };
            blocks.push(Block {
                attention_norm,
                attention,
                ffn_norm,
                ffn,
            });
        }
        let norm = LayerNorm::new(&mut store, "norm", c.dim)?;
        drop(guard);
        store.alias("tok_embeddings.weight", "output.weight");
        Ok(Gpt {
            config,
            rank,
            seed: run_seed,
            moe,
            dropout: p,
            tok_embeddings,
            pos_embeddings,
            blocks,
            norm,
            store,
            max_grad_norm: None,
        })
    }

    /// The same decoder trained with gradient clipping at `max_norm`.
    pub fn with_max_grad_norm(mut self, max_norm: f64) -> Self {
        self.max_grad_norm = Some(max_norm);
        self
    }

    fn block_names(&self, i: usize) -> Vec<String> {
        let p = format!("layers.{i}");
        let mut v = LayerNorm::names(&path(&p, "attention_norm"));
        for proj in Attention::PROJ {
            v.extend(Linear::names(&path(&p, &format!("attention.{proj}")), true));
        }
        v.extend(LayerNorm::names(&path(&p, "ffn_norm")));
        if self.moe {
            v.extend(Moe::names(&path(&p, "moe"), self.config.experts));
        } else {
            v.extend(Mlp::names(&path(&p, "feed_forward")));
        }
        v
    }
}

impl Gpt {
    /// The decoder's sizes.
    pub fn config(&self) -> GptConfig {
        self.config
    }

    /// The dropout rate (0 for `gpt` and `gpt_moe`).
    pub fn dropout(&self) -> f64 {
        self.dropout
    }

    /// The batch's per-sample mask keys when this model drops out (its second input).
    pub fn dropout_keys(&self, batch: &Batch) -> Result<Option<Vec<i64>>, ModelError> {
        if self.dropout <= 0.0 {
            return Ok(None);
        }
        let keys = batch
            .inputs
            .get(1)
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: "expected the samples' dropout keys as a second input".into(),
            })?;
        Ok(Some(Vec::<i64>::try_from(keys)?))
    }
}

impl Model for Gpt {
    fn name(&self) -> &str {
        match (self.moe, self.dropout > 0.0) {
            (true, _) => "gpt_moe",
            (false, true) => "gpt_dropout",
            (false, false) => "gpt",
        }
    }

    fn max_grad_norm(&self) -> Option<f64> {
        self.max_grad_norm
    }

    /// Its attention, positions and loss go through the hooks; dropout masks are drawn per
    /// whole sequence, so `gpt_dropout` is refused.
    fn context_parallel_blocker(&self) -> Option<String> {
        (self.dropout > 0.0).then(|| {
            format!(
                "{} draws its dropout masks per whole sequence, which context parallelism \
                 does not split",
                self.name()
            )
        })
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn store(&self) -> &ParamStore {
        &self.store
    }

    fn layers(&self) -> Vec<LayerSpec> {
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
        for i in 0..self.blocks.len() {
            layers.push(LayerSpec {
                name: format!("layers.{i}"),
                kind: if self.moe {
                    LayerKind::MoeDecoderBlock
                } else {
                    LayerKind::DecoderBlock
                },
                params: self.block_names(i),
            });
        }
        layers.push(LayerSpec {
            name: "norm".into(),
            kind: LayerKind::LayerNorm,
            params: LayerNorm::names("norm"),
        });
        layers.push(LayerSpec {
            name: "output".into(),
            kind: LayerKind::OutputProjection,
            params: vec!["output.weight".into()],
        });
        layers
    }

    /// `batch` sequences of `seq + 1` tokens `(start + stride·i) mod vocab` (the zoo: two of
    /// 9, mod 8), start and stride ∈ {1, 3} drawn from the batch seed: predicting the next
    /// token is learnable from context. Inputs are the first `seq` tokens, targets the last.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let GptConfig {
            vocab, seq, batch, ..
        } = self.config;
        let opts = (Kind::Int64, tch::Device::Cpu);
        let (start, stride) = seed::seeded(seed::batch_seed(self.seed, rank, step), || {
            let start = Tensor::f_randint(vocab, [batch, 1], opts)?;
            let stride = Tensor::f_randint(2, [batch, 1], opts)?
                .f_mul_scalar(2)?
                .f_add_scalar(1)?;
            Ok::<_, TchError>((start, stride))
        })?;
        let tokens = Tensor::f_arange(seq + 1, opts)?
            .f_unsqueeze(0)?
            .f_mul(&stride)?
            .f_add(&start)?
            .f_remainder(vocab)?;
        let mut inputs = vec![tokens.f_narrow(1, 0, seq)?];
        if self.dropout > 0.0 {
            let keys = seed::sample_keys(self.seed, rank, step, batch as usize);
            inputs.push(Tensor::from_slice(&keys));
        }
        Ok(Batch {
            inputs,
            target: Some(tokens.f_narrow(1, 1, seq)?),
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// Layer inputs: the token ids, the position ids, then the hidden state (residual adds
    /// are inside each block; the sum of the two embeddings is between layers).
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let tokens = batch
            .inputs
            .first()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: "expected one token tensor".into(),
            })?;
        let t = tokens.size().get(1).copied().unwrap_or(0);
        let max = self.config.seq;
        if t == 0 || t > max {
            return Err(ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: format!("sequence length {t} outside 1..={max}"),
            });
        }
        let mut run = LayerRun::new(hooks);
        let tok = run.layer_hooked([tokens.shallow_clone()], |m, [tokens]| {
            m.embedding("tok_embeddings", &tokens, &self.tok_embeddings)
        })?;
        let pos = run.hooks().positions(t, tokens.device())?;
        let pos = run.layer_hooked([pos], |m, [pos]| {
            m.embedding("pos_embeddings", &pos, &self.pos_embeddings)
        })?;
        let keys = self.dropout_keys(batch)?;
        let drop = |layer: u64| {
            keys.as_deref().map(|keys| Dropout {
                keys,
                p: self.dropout,
                layer,
            })
        };
        let mut h = tok.f_add(&pos)?;
        if let Some(d) = drop(0) {
            h = d.apply(run.hooks(), "dropout", &h, 0)?;
        }
        for (i, block) in self.blocks.iter().enumerate() {
            h = run.layer_hooked([h], |m, [h]| block.forward(m, &h, drop(i as u64 + 1)))?;
        }
        let h = run.layer_hooked([h], |m, [h]| self.norm.call(m, &h))?;
        run.layer_hooked([h], |m, [h]| {
            m.linear("output", &h, &self.tok_embeddings, None)
        })
    }

    /// Next-token cross-entropy, mean over every token.
    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        self.loss_of_hooked(batch, output, &mut NoHooks)
    }

    /// The loss through the `output` module's cross-entropy hook (loss parallel under a
    /// vocabulary-parallel plan: `output` then holds this rank's vocabulary slice).
    fn loss_of_hooked(
        &self,
        batch: &Batch,
        output: &Tensor,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let target = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name().to_owned(),
                reason: "missing target tokens".into(),
            })?;
        let columns = output.size().last().copied().unwrap_or(self.config.vocab);
        hooks.cross_entropy(
            "output",
            &output.f_view([-1, columns])?,
            &target.f_reshape([-1])?,
        )
    }

    /// torchtitan's decoder plan: vocabulary-parallel token embedding and tied output
    /// projection (loss parallel), attention split by heads (q, k, v column-wise, output
    /// row-wise), the dense feed-forward column- then row-wise (its dropout sliced along the
    /// hidden features, the attention dropout along the heads); experts replicated (expert
    /// parallelism distributes them). Under sequence parallelism the norms (and, token-wise,
    /// the mixture of experts) run on sequence shards.
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<ParallelPlan> {
        use ParallelStyle::*;
        let mut plan = ParallelPlan::new(sequence_parallel)
            .with_heads(self.config.heads)
            .rule("tok_embeddings", Vocab)
            .rule("output", Vocab)
            .rule("layers.*.attention.wq", Colwise)
            .rule("layers.*.attention.wk", Colwise)
            .rule("layers.*.attention.wv", Colwise)
            .rule("layers.*.attention.wo", Rowwise);
        if self.dropout > 0.0 {
            plan = plan.rule("layers.*.attention.dropout", ShardedDropout { dim: 1 });
        }
        if self.moe {
            let style = if sequence_parallel { Sequence } else { Expert };
            plan = plan.rule("layers.*.moe", style);
        } else {
            plan = plan
                .rule("layers.*.feed_forward.w1", Colwise)
                .rule("layers.*.feed_forward.w2", Rowwise);
            if self.dropout > 0.0 {
                plan = plan.rule("layers.*.feed_forward.dropout", ShardedDropout { dim: -1 });
            }
        }
        if sequence_parallel {
            plan = plan
                .rule("layers.*.attention_norm", Sequence)
                .rule("layers.*.ffn_norm", Sequence)
                .rule("norm", Sequence);
        }
        Some(plan)
    }
}
