//! The zoo decoder (`gpt`, `gpt_moe`) under a tensor-parallel plan, through layer hooks: the
//! model's own forward runs, and the hooks stand in for the layers the plan splits — the
//! vocabulary-parallel embedding, every decoder block (attention split by heads, the dense
//! feed-forward column- then row-parallel, LayerNorms on sequence shards under SP), and the
//! tied output projection, which returns this rank's vocabulary slice of the logits (loss
//! parallel: the full logits never exist). The block math is the zoo's, per head and per
//! feature: only where sums are split across ranks does the order of additions change.

use crate::autograd::collectives::{
    all_gather_sequence, copy_to_parallel, reduce_from_parallel, reduce_scatter_sequence,
    scatter_to_sequence_parallel,
};
use crate::comm::ProcessGroup;
use lockstep_models::zoo::GptConfig;
use lockstep_models::{LayerHooks, ModelError};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// A planted tensor-parallel bug (checker tests only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpFault {
    /// The column-parallel entry passes gradients through without the all-reduce, as a
    /// row-parallel pair whose backward lacks its reduction.
    MissingBackwardAllReduce,
    /// Sequence-parallel LayerNorm gradients are not summed over the TP group.
    SkipSequenceGradReduce,
    /// Every TP rank applies the first rank's slice of a split activation's dropout mask
    /// (ranks drawing the same mask where they must differ).
    SameDropoutMask,
    /// FSDP×TP: TP-sharded parameters' gradients are also summed over the data dimension
    /// before FSDP's reduce-scatter averages them there (reduced over `dp` twice).
    ShardedGradsReducedOverDpTwice,
}

/// What the hooks need: the TP group, this rank's parameters (shards where the plan splits
/// them, the model's own tensors elsewhere) and the model's sizes.
pub(crate) struct GptTp {
    pub group: Arc<dyn ProcessGroup>,
    pub tp: usize,
    pub rank: usize,
    /// Every parameter this rank computes with, by canonical name.
    pub params: HashMap<String, Tensor>,
    pub layer_names: Vec<String>,
    /// The decoder's sizes (heads, width, vocabulary, experts), read from the model.
    pub config: GptConfig,
    pub sequence_parallel: bool,
    pub fault: Option<TpFault>,
    /// The mixture-of-experts layers' experts sharded over an `ep` group instead of
    /// replicated (expert parallelism).
    pub experts_parallel: Option<ExpertsParallel>,
    /// Dropout rate (`gpt_dropout`); masks are the single-device ones, sliced (parity mode).
    pub dropout: f64,
    /// The current batch's per-sample mask keys, set by the training loop before forward.
    pub dropout_keys: Rc<RefCell<Vec<i64>>>,
}

/// How `GptTp` runs the mixture-of-experts layers under expert parallelism.
pub(crate) struct ExpertsParallel {
    pub group: Arc<dyn ProcessGroup>,
    pub dispatcher: crate::expert_parallel::Dispatcher,
    pub config: crate::expert_parallel::MoeConfig,
    /// This rank's experts: `[first, first + per)`.
    pub first: usize,
    pub per: usize,
}

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string().into())
}

impl GptTp {
    fn p(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.params
            .get(name)
            .ok_or_else(|| hook_err(format!("tensor parallel: no parameter `{name}`")))
    }

    /// `x` times this rank's slice (along `dim`, `x`'s own size there) of the full dropout
    /// mask one process draws for `full` per-sample shape at (`layer`, `site`): parity mode.
    fn dropout(
        &self,
        x: &Tensor,
        layer: usize,
        site: u64,
        full: &[i64],
        dim: i64,
    ) -> Result<Tensor, ModelError> {
        if self.dropout <= 0.0 {
            return Ok(x.shallow_clone());
        }
        let keys = self.dropout_keys.borrow();
        let mask =
            lockstep_models::seed::dropout_mask(&keys, layer as u64 + 1, site, full, self.dropout)?;
        let len = x.size()[dim as usize];
        let slice = if self.fault == Some(TpFault::SameDropoutMask) {
            0
        } else {
            self.rank as i64
        };
        let mask = mask
            .f_narrow(dim, slice * len, len)?
            .f_to_kind(x.kind())?
            .f_to_device(x.device())?;
        Ok(x.f_mul(&mask)?)
    }

    fn vocab_start(&self) -> i64 {
        self.rank as i64 * self.config.vocab / self.tp as i64
    }

    /// Enters a column-parallel region from a replicated input.
    fn enter(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        if self.fault == Some(TpFault::MissingBackwardAllReduce) {
            return Ok(x.shallow_clone());
        }
        copy_to_parallel(x, &self.group).map_err(hook_err)
    }

    fn layer_norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        Ok(x.f_layer_norm(
            [self.config.dim],
            Some(self.p(&format!("{prefix}.weight"))?),
            Some(self.p(&format!("{prefix}.bias"))?),
            1e-5,
            false,
        )?)
    }

    fn linear(&self, x: &Tensor, prefix: &str, bias: bool) -> Result<Tensor, ModelError> {
        let w = self.p(&format!("{prefix}.weight"))?;
        let b = if bias {
            Some(self.p(&format!("{prefix}.bias"))?)
        } else {
            None
        };
        Ok(x.f_linear(w, b)?)
    }

    /// Causal attention over this rank's heads; `x` (B, T, D) replicated, result (B, T, D/t)
    /// — this rank's heads, concatenated — before the row-parallel output projection.
    fn local_heads(&self, x: &Tensor, prefix: &str, layer: usize) -> Result<Tensor, ModelError> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let hd = self.config.dim / self.config.heads;
        let local = self.config.heads / self.tp as i64;
        let heads = |y: Tensor| y.f_view([b, t, local, hd])?.f_transpose(1, 2);
        let q = heads(self.linear(x, &format!("{prefix}.wq"), true)?)?;
        let k = heads(self.linear(x, &format!("{prefix}.wk"), true)?)?;
        let v = heads(self.linear(x, &format!("{prefix}.wv"), true)?)?;
        let future = Tensor::f_ones([t, t], (Kind::Bool, x.device()))?.f_triu(1)?;
        let scores = q
            .f_matmul(&k.f_transpose(-2, -1)?)?
            .f_mul_scalar(1.0 / (hd as f64).sqrt())?
            .f_masked_fill(&future, f64::NEG_INFINITY)?;
        let probs = self.dropout(
            &scores.f_softmax(-1, None)?,
            layer,
            1,
            &[self.config.heads, t, t],
            1,
        )?;
        Ok(probs
            .f_matmul(&v)?
            .f_transpose(1, 2)?
            .f_contiguous()?
            .f_view([b, t, local * hd])?)
    }

    /// The zoo's dense mixture of experts, replicated (every expert whole on every rank), or
    /// sharded over the expert-parallel group.
    fn moe(&self, x: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        if let Some(ep) = &self.experts_parallel {
            let local = (ep.first..ep.first + ep.per)
                .map(|e| {
                    let p = |s: &str| {
                        self.p(&format!("{prefix}.experts.{e}.{s}"))
                            .map(Tensor::shallow_clone)
                    };
                    Ok(crate::expert_parallel::ExpertParams {
                        w1: p("w1.weight")?,
                        b1: p("w1.bias")?,
                        w2: p("w2.weight")?,
                        b2: p("w2.bias")?,
                    })
                })
                .collect::<Result<Vec<_>, ModelError>>()?;
            let flat = x.f_reshape([-1, self.config.dim])?;
            let out = crate::expert_parallel::moe_forward(
                &flat,
                self.p(&format!("{prefix}.router.weight"))?,
                &local,
                &ep.config,
                Some(&ep.group),
                ep.dispatcher,
            )
            .map_err(hook_err)?;
            return Ok(out.output.f_reshape(x.size().as_slice())?);
        }
        let probs = self
            .linear(x, &format!("{prefix}.router"), false)?
            .f_softmax(-1, None)?;
        let (top, idx) = probs.f_topk(self.config.top_k, -1, true, true)?;
        let top = top.f_div(&top.f_sum_dim_intlist(-1, true, None)?)?;
        let gates = probs.f_zeros_like()?.f_scatter(-1, &idx, &top)?;
        let mut out = x.f_zeros_like()?;
        for e in 0..self.config.experts {
            let p = format!("{prefix}.experts.{e}");
            let h = self.linear(x, &format!("{p}.w1"), true)?.f_gelu("none")?;
            let y = self.linear(&h, &format!("{p}.w2"), true)?;
            let g = gates.f_narrow(-1, e as i64, 1)?;
            out = out.f_add(&y.f_mul(&g)?)?;
        }
        Ok(out)
    }

    fn is_moe(&self, i: usize) -> bool {
        self.params
            .contains_key(&format!("layers.{i}.moe.router.weight"))
    }

    /// One block, hidden state replicated (B, T, D).
    fn block(&self, i: usize, h: &Tensor) -> Result<Tensor, ModelError> {
        let prefix = format!("layers.{i}");
        let a = self.layer_norm(h, &format!("{prefix}.attention_norm"))?;
        let heads = self.local_heads(&self.enter(&a)?, &format!("{prefix}.attention"), i)?;
        let o = self.linear(&heads, &format!("{prefix}.attention.wo"), false)?;
        let o = reduce_from_parallel(&o, &self.group).map_err(hook_err)?;
        let o = o.f_add(self.p(&format!("{prefix}.attention.wo.bias"))?)?;
        let h = h.f_add(&o)?;
        let f = self.layer_norm(&h, &format!("{prefix}.ffn_norm"))?;
        let ff = if self.is_moe(i) {
            self.moe(&f, &format!("{prefix}.moe"))?
        } else {
            let x = self.enter(&f)?;
            let x = self
                .linear(&x, &format!("{prefix}.feed_forward.w1"), true)?
                .f_gelu("none")?;
            let t = x.size()[1];
            let x = self.dropout(&x, i, 2, &[t, self.config.ff_hidden], 2)?;
            let y = self.linear(&x, &format!("{prefix}.feed_forward.w2"), false)?;
            reduce_from_parallel(&y, &self.group)
                .map_err(hook_err)?
                .f_add(self.p(&format!("{prefix}.feed_forward.w2.bias"))?)?
        };
        Ok(h.f_add(&ff)?)
    }

    /// Sequence-first shard (T/t, B, D) to the full batch-first (B, T, D): all-gather whose
    /// backward reduce-scatters (summing every rank's partial gradient of each position).
    fn gather_seq(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        Ok(all_gather_sequence(x, &self.group)
            .map_err(hook_err)?
            .f_transpose(0, 1)?)
    }

    /// A partial (B, T, D) result to this rank's summed sequence shard (T/t, B, D).
    fn scatter_seq(&self, y: &Tensor) -> Result<Tensor, ModelError> {
        reduce_scatter_sequence(&y.f_transpose(0, 1)?.f_contiguous()?, &self.group)
            .map_err(hook_err)
    }

    /// One block under sequence parallelism: `x` is this rank's sequence shard (T/t, B, D).
    fn block_sp(&self, i: usize, x: &Tensor) -> Result<Tensor, ModelError> {
        let prefix = format!("layers.{i}");
        let a = self.layer_norm(x, &format!("{prefix}.attention_norm"))?;
        let heads = self.local_heads(&self.gather_seq(&a)?, &format!("{prefix}.attention"), i)?;
        let o = self.linear(&heads, &format!("{prefix}.attention.wo"), false)?;
        let o = self
            .scatter_seq(&o)?
            .f_add(self.p(&format!("{prefix}.attention.wo.bias"))?)?;
        let x = x.f_add(&o)?;
        let f = self.layer_norm(&x, &format!("{prefix}.ffn_norm"))?;
        let ff = if self.is_moe(i) {
            // Token-wise: each rank routes its own positions.
            self.moe(&f, &format!("{prefix}.moe"))?
        } else {
            let full = self.gather_seq(&f)?;
            let y = self
                .linear(&full, &format!("{prefix}.feed_forward.w1"), true)?
                .f_gelu("none")?;
            let t = y.size()[1];
            let y = self.dropout(&y, i, 2, &[t, self.config.ff_hidden], 2)?;
            let y = self.linear(&y, &format!("{prefix}.feed_forward.w2"), false)?;
            self.scatter_seq(&y)?
                .f_add(self.p(&format!("{prefix}.feed_forward.w2.bias"))?)?
        };
        Ok(x.f_add(&ff)?)
    }
}

impl LayerHooks for GptTp {
    fn pre_forward(
        &mut self,
        _index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        Ok(inputs)
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }

    fn substitute(
        &mut self,
        index: usize,
        inputs: &[Tensor],
    ) -> Result<Option<Tensor>, ModelError> {
        let name = self
            .layer_names
            .get(index)
            .ok_or_else(|| hook_err(format!("no layer {index}")))?
            .clone();
        let first = inputs
            .first()
            .ok_or_else(|| hook_err(format!("layer `{name}` got no input")))?;
        match name.as_str() {
            "tok_embeddings" => Ok(Some(
                super::layers::vocab_parallel_embedding(
                    first,
                    self.p("tok_embeddings.weight")?,
                    self.vocab_start(),
                    &self.group,
                )
                .map_err(hook_err)?,
            )),
            "output" => {
                let h = if self.sequence_parallel {
                    self.gather_seq(first)?
                } else {
                    self.enter(first)?
                };
                Ok(Some(h.f_linear::<Tensor>(
                    self.p("tok_embeddings.weight")?,
                    None,
                )?))
            }
            n => match n
                .strip_prefix("layers.")
                .and_then(|i| i.parse::<usize>().ok())
            {
                Some(i) if self.sequence_parallel => {
                    let x = if i == 0 {
                        // Enter the sequence-parallel region: keep this rank's positions.
                        scatter_to_sequence_parallel(
                            &first.f_transpose(0, 1)?.f_contiguous()?,
                            &self.group,
                        )
                        .map_err(hook_err)?
                    } else {
                        first.shallow_clone()
                    };
                    Ok(Some(self.block_sp(i, &x)?))
                }
                Some(i) => Ok(Some(self.block(i, first)?)),
                None => Ok(None),
            },
        }
    }
}
