//! The model's own forward on a shard of the sequence: the layer hooks that give the
//! positional embedding the shard's global positions, run the attention across the CP group,
//! and turn the loss into this shard's share of the whole sequence's mean.

use super::attention::context_parallel_attention;
use super::layout::positions_of;
use super::options::{CpFault, CpOptions};
use crate::comm::ProcessGroup;
use lockstep_models::{LayerHooks, ModelError};
use std::sync::Arc;
use tch::Tensor;

/// A hook's failure as the model reports it.
fn hook_err(e: impl std::error::Error + Send + Sync + 'static) -> ModelError {
    ModelError::Hook(Box::new(e))
}

/// One rank's hooks under context parallelism.
pub struct CpHooks {
    group: Arc<dyn ProcessGroup>,
    rank: usize,
    opts: CpOptions,
    /// Tokens in a whole sequence of this step.
    seq: i64,
    /// Tokens the whole step's loss averages over (every shard's, ignored ones left out).
    tokens: f64,
}

impl CpHooks {
    /// Hooks for this rank (`rank` in the CP `group`).
    pub fn new(group: Arc<dyn ProcessGroup>, rank: usize, opts: CpOptions) -> CpHooks {
        CpHooks {
            group,
            rank,
            opts,
            seq: 0,
            tokens: 1.0,
        }
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
        _index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        Ok(inputs)
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }

    /// The shard's tokens' positions in the whole sequence.
    fn positions(&mut self, len: i64, device: tch::Device) -> Result<Tensor, ModelError> {
        if self.opts.fault == Some(CpFault::PositionsFromShard) {
            return Ok(Tensor::f_arange(len, (tch::Kind::Int64, device))?);
        }
        let positions = positions_of(self.opts.layout, self.rank, self.opts.cp, self.seq);
        Ok(Tensor::from_slice(&positions).f_to_device(device)?)
    }

    fn attention(
        &mut self,
        _path: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        context_parallel_attention(q, k, v, &self.group, self.rank, &self.opts).map_err(hook_err)
    }

    /// The shard's summed cross-entropy over the step's token count: the CP ranks' shares
    /// sum to the whole sequence's mean (token counts, not shard means).
    fn cross_entropy(
        &mut self,
        _path: &str,
        logits: &Tensor,
        target: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let sum =
            logits.f_cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Sum, -100, 0.0)?;
        Ok(sum.f_div_scalar(self.tokens)?)
    }
}
