//! The model's own forward on a shard of the sequence: the layer hooks that give the
//! positional embedding the shard's global positions, run the attention across the CP group,
//! and turn the loss into this shard's share of the whole sequence's mean. Under CP × TP they
//! wrap the tensor-parallel plan's hooks: the plan runs every module on its shards (attention
//! gets this rank's heads), CP keeps the sequence's positions, attention and loss scaling.

use super::attention::context_parallel_attention;
use super::layout::positions_of;
use super::options::{CpFault, CpOptions};
use crate::comm::ProcessGroup;
use lockstep_models::{LayerHooks, ModelError, MoeSpec, NoHooks};
use std::sync::Arc;
use tch::Tensor;

/// A hook's failure as the model reports it.
fn hook_err(e: impl std::error::Error + Send + Sync + 'static) -> ModelError {
    ModelError::Hook(Box::new(e))
}

/// One rank's hooks under context parallelism.
pub struct CpHooks {
    /// What runs every module but attention and positions: a tensor-parallel plan's hooks
    /// (CP × TP), or the plain ops.
    inner: Box<dyn LayerHooks>,
    /// Whether `inner` is a plan, whose loss (loss parallel) is a mean to rescale.
    planned: bool,
    group: Arc<dyn ProcessGroup>,
    rank: usize,
    opts: CpOptions,
    /// Tokens in a whole sequence of this step.
    seq: i64,
    /// Tokens the whole step's loss averages over (every shard's, ignored ones left out).
    tokens: f64,
    /// Inside a pipeline stage: each loss call's tokens are counted over the CP group (one
    /// microbatch at a time) and the loss is multiplied by the CP size, so gradients averaged
    /// over `dp × cp` (the pipeline's data group) are the sum over the shards.
    in_pipeline: bool,
}

impl CpHooks {
    /// Hooks for this rank (`rank` in the CP `group`).
    pub fn new(group: Arc<dyn ProcessGroup>, rank: usize, opts: CpOptions) -> CpHooks {
        CpHooks {
            inner: Box::new(NoHooks),
            planned: false,
            group,
            rank,
            opts,
            seq: 0,
            tokens: 1.0,
            in_pipeline: false,
        }
    }

    /// These hooks inside a pipeline stage, whose sequences have `seq` tokens: the loss of
    /// each microbatch is its shard's share of that microbatch's mean (tokens counted over
    /// the CP group as it is computed), times the CP size.
    pub fn in_pipeline(mut self, seq: i64) -> CpHooks {
        self.seq = seq;
        self.in_pipeline = true;
        self
    }

    /// These hooks around `inner` (a tensor-parallel plan's): every module but the attention,
    /// positions and loss scaling runs through it.
    pub fn around(mut self, inner: Box<dyn LayerHooks>) -> CpHooks {
        self.inner = inner;
        self.planned = true;
        self
    }

    /// Sets the step's whole sequence length and the tokens its loss averages over.
    pub fn set_step(&mut self, seq: i64, tokens: f64) {
        self.seq = seq;
        self.tokens = tokens;
    }
}

impl LayerHooks for CpHooks {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        self.inner.pre_forward(index, inputs)
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        self.inner.post_forward(index, output)
    }

    fn substitute(
        &mut self,
        index: usize,
        inputs: &[Tensor],
    ) -> Result<Option<Tensor>, ModelError> {
        self.inner.substitute(index, inputs)
    }

    fn linear(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        self.inner.linear(path, x, weight, bias)
    }

    fn embedding(
        &mut self,
        path: &str,
        ids: &Tensor,
        weight: &Tensor,
    ) -> Result<Tensor, ModelError> {
        self.inner.embedding(path, ids, weight)
    }

    fn layer_norm(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor, ModelError> {
        self.inner.layer_norm(path, x, weight, bias, eps)
    }

    fn moe(
        &mut self,
        path: &str,
        x: &Tensor,
        spec: MoeSpec,
        dense: &dyn Fn(&Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        self.inner.moe(path, x, spec, dense)
    }

    fn dropout(
        &mut self,
        path: &str,
        x: &Tensor,
        mask: &dyn Fn(&[i64]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        self.inner.dropout(path, x, mask)
    }

    /// The shard's tokens' positions in the whole sequence.
    fn positions(&mut self, len: i64, device: tch::Device) -> Result<Tensor, ModelError> {
        if self.opts.cp == 1 {
            return self.inner.positions(len, device);
        }
        if self.opts.fault == Some(CpFault::PositionsFromShard) {
            return Ok(Tensor::f_arange(len, (tch::Kind::Int64, device))?);
        }
        let positions = positions_of(self.opts.layout, self.rank, self.opts.cp, self.seq);
        Ok(Tensor::from_slice(&positions).f_to_device(device)?)
    }

    fn attention(
        &mut self,
        path: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        if self.opts.cp == 1 {
            return self.inner.attention(path, q, k, v);
        }
        context_parallel_attention(q, k, v, &self.group, self.rank, &self.opts).map_err(hook_err)
    }

    /// The shard's summed cross-entropy over the step's token count: the CP ranks' shares
    /// sum to the whole sequence's mean (token counts, not shard means).
    /// Under CP × TP the plan's loss (loss parallel: the mean over this shard's tokens) is
    /// scaled by the shard's token count to the same share.
    fn cross_entropy(
        &mut self,
        path: &str,
        logits: &Tensor,
        target: &Tensor,
    ) -> Result<Tensor, ModelError> {
        // At CP size 1 the sequence is whole: the loss is the model's own (or its plan's).
        if self.opts.cp == 1 {
            return self.inner.cross_entropy(path, logits, target);
        }
        let counted = || -> Result<f64, ModelError> {
            Ok(target
                .f_ne(-100)?
                .f_sum(tch::Kind::Float)?
                .f_double_value(&[])?)
        };
        let (tokens, scale) = match self.in_pipeline {
            true => {
                let count = Tensor::from_slice(&[counted()?]).f_to_device(logits.device())?;
                self.group
                    .all_reduce(&count, crate::comm::ReduceOp::Sum)
                    .map_err(hook_err)?;
                (count.f_double_value(&[0])?, self.opts.cp as f64)
            }
            false => (self.tokens, 1.0),
        };
        if self.planned {
            let mean = self.inner.cross_entropy(path, logits, target)?;
            return Ok(mean.f_mul_scalar(counted()? / tokens * scale)?);
        }
        let sum =
            logits.f_cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Sum, -100, 0.0)?;
        let share = sum.f_div_scalar(tokens)?;
        Ok(match scale == 1.0 {
            true => share,
            false => share.f_mul_scalar(scale)?,
        })
    }
}
