//! PyTorch's `TransformerWithSharedParams` (FSDP tests): an `nn.Transformer` between an
//! embedding and an output projection that share one weight.

use crate::layers::{BatchNorm1d, DecoderLayer, EncoderLayer, LayerNorm, Linear};
use crate::model::{Batch, LayerHooks, LayerKind, LayerSpec, LossReduction, Model, NoHooks};
use crate::plan::{ParallelPlan, ParallelStyle};
use crate::seed;
use crate::store::{linear_weight, normal, ParamStore, F32};
use crate::LayerRun;
use crate::ModelError;
use tch::{Kind, Tensor};

const VOCAB: i64 = 23;
const D_MODEL: i64 = 16;
/// `nn.Transformer`'s default `nhead`: PyTorch's test does not pass one.
const HEADS: i64 = 8;
const FF: i64 = 8;
const LAYERS: usize = 2;
const BATCH: i64 = 2;

/// Embedding → `nn.Transformer` (2 + 2 layers, 8 heads, post-norm, dropout 0) → output projection
/// whose weight *is* the embedding's; optional `BatchNorm1d(2)` on the target embeddings.
#[derive(Debug)]
pub struct TransformerWithSharedParams {
    name: &'static str,
    rank: usize,
    seed: u64,
    embed: Tensor,
    encoder: Vec<EncoderLayer>,
    encoder_norm: LayerNorm,
    decoder: Vec<DecoderLayer>,
    decoder_norm: LayerNorm,
    output_bias: Tensor,
    vocab_bias: Tensor,
    long_buffer: Tensor,
    bn: Option<BatchNorm1d>,
    store: ParamStore,
}

impl TransformerWithSharedParams {
    /// Model width.
    pub const DIM: i64 = D_MODEL;
    /// Attention heads of every layer.
    pub const HEADS: i64 = HEADS;
    /// Feed-forward width: what a tensor-parallel plan splits.
    pub const FEED_FORWARD: i64 = FF;

    /// `batch_norm` adds PyTorch's optional `BatchNorm1d(2)` (zoo name `transformer_bn`).
    ///
    /// Draws in PyTorch's order: embedding, the encoder layer template (copied to every
    /// layer), the decoder template, Xavier over every matrix of the transformer, then the
    /// output projection (whose own weight draw is discarded by the tie).
    pub fn new(run_seed: u64, rank: usize, batch_norm: bool) -> Result<Self, ModelError> {
        let mut store = ParamStore::default();
        let guard = seed::lock_seeded(seed::param_seed(run_seed));
        let embed = store.param("embed_tokens.weight", || normal(&[VOCAB, D_MODEL]))?;
        let mut encoder = Vec::new();
        for i in 0..LAYERS {
            let prefix = format!("transformer.encoder.layers.{i}");
            if i > 0 {
                store.copying("transformer.encoder.layers.0", &prefix);
            }
            encoder.push(EncoderLayer::new(&mut store, &prefix, D_MODEL, HEADS, FF)?);
            store.stop_copying();
        }
        let encoder_norm = LayerNorm::new(&mut store, "transformer.encoder.norm", D_MODEL)?;
        let mut decoder = Vec::new();
        for i in 0..LAYERS {
            let prefix = format!("transformer.decoder.layers.{i}");
            if i > 0 {
                store.copying("transformer.decoder.layers.0", &prefix);
            }
            decoder.push(DecoderLayer::new(&mut store, &prefix, D_MODEL, HEADS, FF)?);
            store.stop_copying();
        }
        let decoder_norm = LayerNorm::new(&mut store, "transformer.decoder.norm", D_MODEL)?;
        store.xavier_reinit("transformer.")?;
        let _discarded = linear_weight(VOCAB, D_MODEL)?;
        let output_bias = store.param("output_proj.bias", || {
            crate::store::linear_bias(VOCAB, D_MODEL)
        })?;
        drop(guard);
        store.alias("embed_tokens.weight", "output_proj.weight");
        let vocab_bias = store.buffer("vocab_bias", Tensor::f_ones([D_MODEL], F32)?);
        let long_buffer = store.buffer(
            "long_buffer",
            Tensor::f_zeros([D_MODEL], (Kind::Int64, tch::Device::Cpu))?,
        );
        let bn = if batch_norm {
            Some(BatchNorm1d::new(&mut store, "bn", BATCH)?)
        } else {
            None
        };
        Ok(TransformerWithSharedParams {
            name: if batch_norm {
                "transformer_bn"
            } else {
                "transformer"
            },
            rank,
            seed: run_seed,
            embed,
            encoder,
            encoder_norm,
            decoder,
            decoder_norm,
            output_bias,
            vocab_bias,
            long_buffer,
            bn,
            store,
        })
    }

    fn embed_ids(&self, ids: &Tensor) -> Result<Tensor, ModelError> {
        Ok(Tensor::f_embedding(&self.embed, ids, -1, false, false)?)
    }
}

impl Model for TransformerWithSharedParams {
    fn name(&self) -> &str {
        self.name
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
        let mut layers = vec![LayerSpec {
            name: "embed_tokens".into(),
            kind: LayerKind::Embedding,
            params: vec!["embed_tokens.weight".into()],
        }];
        if self.bn.is_some() {
            layers.push(LayerSpec {
                name: "bn".into(),
                kind: LayerKind::BatchNorm,
                params: vec!["bn.weight".into(), "bn.bias".into()],
            });
        }
        for i in 0..LAYERS {
            let name = format!("transformer.encoder.layers.{i}");
            layers.push(LayerSpec {
                params: EncoderLayer::names(&name),
                name,
                kind: LayerKind::EncoderLayer,
            });
        }
        layers.push(LayerSpec {
            name: "transformer.encoder.norm".into(),
            kind: LayerKind::LayerNorm,
            params: LayerNorm::names("transformer.encoder.norm"),
        });
        for i in 0..LAYERS {
            let name = format!("transformer.decoder.layers.{i}");
            layers.push(LayerSpec {
                params: DecoderLayer::names(&name),
                name,
                kind: LayerKind::DecoderLayer,
            });
        }
        layers.push(LayerSpec {
            name: "transformer.decoder.norm".into(),
            kind: LayerKind::LayerNorm,
            params: LayerNorm::names("transformer.decoder.norm"),
        });
        layers.push(LayerSpec {
            name: "output_proj".into(),
            kind: LayerKind::OutputProjection,
            params: Linear::names("output_proj", true),
        });
        layers
    }

    /// `src = arange(12)` as 6×2 and `tgt = arange(8)` as 4×2 (sequence-first), as PyTorch's
    /// test, shifted by `7·rank + 11·step` (mod vocab) so ranks and steps see different
    /// tokens; rank 0 at step 0 gets PyTorch's exact batch.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError> {
        let shift = ((7 * rank + 11 * step) as i64) % VOCAB;
        let ids = |n: i64, t: i64| -> Result<Tensor, ModelError> {
            Ok(Tensor::f_arange(n, (Kind::Int64, tch::Device::Cpu))?
                .f_add_scalar(shift)?
                .f_remainder(VOCAB)?
                .f_view([t, BATCH])?)
        };
        let src = ids(12, 6)?;
        let tgt = ids(8, 4)?;
        Ok(Batch {
            target: Some(tgt.shallow_clone()),
            inputs: vec![src, tgt],
        })
    }

    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        self.forward_hooked(batch, &mut NoHooks)
    }

    fn supports_layer_hooks(&self) -> bool {
        true
    }

    /// Layer inputs: the embedding takes `[src_ids, tgt_ids]` (PyTorch calls `embed_tokens`
    /// on both; here it is one layer, run once) and outputs both embeddings concatenated
    /// along the sequence (dim 0), split again outside the layer; decoder layers take
    /// `[tgt, memory]`; every other layer its hidden state.
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let [src_ids, tgt_ids] = &batch.inputs[..] else {
            return Err(ModelError::InvalidBatch {
                model: self.name.to_owned(),
                reason: format!("expected (src, tgt), got {} inputs", batch.inputs.len()),
            });
        };
        let mut run = LayerRun::new(hooks);
        // Read from the ids, not from inside the layer: a pipeline stage that does not hold
        // the embedding substitutes its output without running it.
        let src_len = src_ids.size().first().copied();
        let embedded = run.layer(
            [src_ids.shallow_clone(), tgt_ids.shallow_clone()],
            |[src_ids, tgt_ids]| {
                let src = self.embed_ids(&src_ids)?;
                let tgt = self.embed_ids(&tgt_ids)?;
                Ok(Tensor::f_cat(&[src, tgt], 0)?)
            },
        )?;
        let (Some(src_len), Some(&total)) = (src_len, embedded.size().first()) else {
            return Err(ModelError::InvalidBatch {
                model: self.name.to_owned(),
                reason: "token ids must have a sequence dimension".into(),
            });
        };
        let src = embedded.f_narrow(0, 0, src_len)?;
        let src = (src + &self.vocab_bias).f_add(&self.long_buffer.f_to_kind(embedded.kind())?)?;
        let mut tgt = embedded.f_narrow(0, src_len, total - src_len)?;
        if let Some(bn) = &self.bn {
            tgt = run.layer([tgt], |[tgt]| Ok(bn.forward(&tgt)?))?;
        }
        let mut memory = src;
        for layer in &self.encoder {
            memory = run.layer_hooked([memory], |m, [memory]| layer.forward(m, &memory))?;
        }
        let memory = run.layer([memory], |[memory]| {
            Ok(self.encoder_norm.forward(&memory)?)
        })?;
        let mut x = tgt;
        for layer in &self.decoder {
            x = run.layer_hooked([x, memory.shallow_clone()], |m, [x, memory]| {
                layer.forward(m, &x, &memory)
            })?;
        }
        let x = run.layer([x], |[x]| Ok(self.decoder_norm.forward(&x)?))?;
        run.layer([x], |[x]| {
            Ok(x.f_linear(&self.embed, Some(&self.output_bias))?)
        })
    }

    fn loss_reduction(&self) -> LossReduction {
        LossReduction::Sum
    }

    /// Sequence-first: `(T, B)` ids.
    fn batch_dim(&self) -> i64 {
        1
    }

    /// Cross-entropy against the target tokens, summed (PyTorch's `get_loss`).
    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError> {
        let tgt = batch
            .target
            .as_ref()
            .ok_or_else(|| ModelError::InvalidBatch {
                model: self.name.to_owned(),
                reason: "missing target tokens".into(),
            })?;
        Ok(output.f_view([-1, VOCAB])?.f_cross_entropy_loss::<Tensor>(
            &tgt.f_view([-1])?,
            None,
            tch::Reduction::Sum,
            -100,
            0.0,
        )?)
    }

    /// Every encoder and decoder layer's feed-forward split, `linear1` column-wise and
    /// `linear2` row-wise (attention, embedding and the tied output stay whole; the model's
    /// own summed loss applies). No sequence-parallel plan, and none with BatchNorm.
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<ParallelPlan> {
        if sequence_parallel || self.bn.is_some() {
            return None;
        }
        let mut plan = ParallelPlan::new(false);
        for stack in ["encoder", "decoder"] {
            plan = plan
                .rule(
                    &format!("transformer.{stack}.layers.*.linear1"),
                    ParallelStyle::Colwise,
                )
                .rule(
                    &format!("transformer.{stack}.layers.*.linear2"),
                    ParallelStyle::Rowwise,
                );
        }
        Some(plan)
    }

    fn single_device_reference_blocker(&self) -> Option<String> {
        self.bn.as_ref().map(|_| {
            "BatchNorm normalizes with each rank's own batch statistics, which one process \
             over the global batch cannot reproduce"
                .to_owned()
        })
    }
}
