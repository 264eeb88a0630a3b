//! The zoo's encoder-decoder `transformer` under a tensor-parallel plan of its feed-forward
//! layers: every encoder and decoder layer is stood in for by the same post-norm math
//! (`nn.TransformerEncoderLayer` / `DecoderLayer`: multi-head attention replicated, packed
//! projections, no masks) with `linear1` column-parallel and `linear2` row-parallel. Embedding,
//! norms and the tied output projection stay whole and run as the model runs them.

use crate::autograd::collectives::{copy_to_parallel, reduce_from_parallel};
use crate::comm::ProcessGroup;
use lockstep_models::functional::{multi_head_attention, AttentionWeights};
use lockstep_models::{LayerHooks, ModelError};
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string().into())
}

/// The hooks: parameters (shards where the plan splits them), sizes, the TP group.
pub(crate) struct TransformerTp {
    pub group: Arc<dyn ProcessGroup>,
    pub params: HashMap<String, Tensor>,
    pub layer_names: Vec<String>,
    pub dim: i64,
    pub heads: i64,
    pub missing_backward_all_reduce: bool,
}

impl TransformerTp {
    fn p(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.params
            .get(name)
            .ok_or_else(|| hook_err(format!("tensor parallel: no parameter `{name}`")))
    }

    fn norm(&self, x: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        Ok(x.f_layer_norm(
            [self.dim],
            Some(self.p(&format!("{prefix}.weight"))?),
            Some(self.p(&format!("{prefix}.bias"))?),
            1e-5,
            false,
        )?)
    }

    /// `nn.MultiheadAttention` of `query` (T, B, E) over `memory` (S, B, E), replicated.
    /// The zoo's attention ([`multi_head_attention`], PyTorch's op for op), replicated: self-
    /// attention with `memory = None`, encoder-decoder attention over `memory` otherwise.
    fn attention(
        &self,
        query: &Tensor,
        memory: Option<&Tensor>,
        prefix: &str,
    ) -> Result<Tensor, ModelError> {
        Ok(multi_head_attention(
            query,
            memory,
            AttentionWeights {
                in_proj_weight: self.p(&format!("{prefix}.in_proj_weight"))?,
                in_proj_bias: self.p(&format!("{prefix}.in_proj_bias"))?,
                out_proj_weight: self.p(&format!("{prefix}.out_proj.weight"))?,
                out_proj_bias: self.p(&format!("{prefix}.out_proj.bias"))?,
                heads: self.heads,
            },
        )?)
    }

    fn feed_forward(&self, x: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        let x = if self.missing_backward_all_reduce {
            x.shallow_clone()
        } else {
            copy_to_parallel(x, &self.group).map_err(hook_err)?
        };
        let h = x
            .f_linear(
                self.p(&format!("{prefix}.linear1.weight"))?,
                Some(self.p(&format!("{prefix}.linear1.bias"))?),
            )?
            .f_relu()?;
        let y = h.f_linear::<Tensor>(self.p(&format!("{prefix}.linear2.weight"))?, None)?;
        Ok(reduce_from_parallel(&y, &self.group)
            .map_err(hook_err)?
            .f_add(self.p(&format!("{prefix}.linear2.bias"))?)?)
    }

    fn encoder(&self, x: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        let x = self.norm(
            &x.f_add(&self.attention(x, None, &format!("{prefix}.self_attn"))?)?,
            &format!("{prefix}.norm1"),
        )?;
        self.norm(
            &x.f_add(&self.feed_forward(&x, prefix)?)?,
            &format!("{prefix}.norm2"),
        )
    }

    fn decoder(&self, x: &Tensor, memory: &Tensor, prefix: &str) -> Result<Tensor, ModelError> {
        let x = self.norm(
            &x.f_add(&self.attention(x, None, &format!("{prefix}.self_attn"))?)?,
            &format!("{prefix}.norm1"),
        )?;
        let x = self.norm(
            &x.f_add(&self.attention(&x, Some(memory), &format!("{prefix}.multihead_attn"))?)?,
            &format!("{prefix}.norm2"),
        )?;
        self.norm(
            &x.f_add(&self.feed_forward(&x, prefix)?)?,
            &format!("{prefix}.norm3"),
        )
    }
}

impl LayerHooks for TransformerTp {
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
        if name.starts_with("transformer.encoder.layers.") {
            let [x] = inputs else {
                return Err(hook_err(format!("`{name}` expects one input")));
            };
            return Ok(Some(self.encoder(x, &name)?));
        }
        if name.starts_with("transformer.decoder.layers.") {
            let [x, memory] = inputs else {
                return Err(hook_err(format!("`{name}` expects (tgt, memory)")));
            };
            return Ok(Some(self.decoder(x, memory, &name)?));
        }
        Ok(None)
    }
}
