//! A plan applied through module hooks: the model's own forward runs, and each module call it
//! makes (`linear`, `embedding`, `layer_norm`, `moe`, `dropout`, `cross_entropy`) is looked
//! up in the plan by its path and run as the parallel layer function of its style, with this
//! rank's shards of its parameters: [`column_parallel_linear`], [`row_parallel_linear`],
//! [`vocab_parallel_embedding`], [`vocab_parallel_cross_entropy`], the slice of a single
//! device's dropout mask, or the expert-parallel mixture of experts. Modules no rule names
//! run their plain op.

use super::layers::{
    column_parallel_linear, enter_column, row_parallel_linear, vocab_parallel_cross_entropy,
    vocab_parallel_embedding, ColumnOptions, Reduction, RowOptions, TpGroup,
};
use super::options::TpFault;
use super::plan::{ancestors, module_of};
use crate::autograd::collectives::scatter_to_sequence_parallel;
use crate::expert_parallel::moe::moe_forward_planted;
use crate::expert_parallel::{Dispatcher, ExpertParams, MoeConfig};
use lockstep_models::plan::{matches_module, ParallelPlan, ParallelStyle};
use lockstep_models::{LayerHooks, LayerSpec, ModelError, MoeSpec, NoHooks};
use std::collections::HashMap;
use tch::Tensor;

/// How the plan's [`ParallelStyle::Expert`] modules run when expert parallelism is on.
pub(crate) struct ExpertsParallel {
    pub group: TpGroup,
    pub dispatcher: Dispatcher,
    pub capacity_factor: Option<f64>,
    /// This rank's experts: `[first, first + per)` of every mixture.
    pub first: usize,
    pub per: usize,
    /// A planted off-by-one in the capacity check (checker tests only).
    pub extra_slot: bool,
}

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string().into())
}

/// The hooks that apply a plan on one rank.
pub(crate) struct PlanHooks {
    group: TpGroup,
    rank: usize,
    /// Every tensor this rank computes with, under every name it is used by (tied aliases
    /// included): shards where the plan splits, the model's own tensors elsewhere.
    params: HashMap<String, Tensor>,
    plan: ParallelPlan,
    fault: Option<TpFault>,
    experts: Option<ExpertsParallel>,
    /// Sequence parallelism: the layer whose input enters sequence shards.
    sp_entry: Option<usize>,
    /// Whether the hidden state currently lives on sequence shards.
    sharded: bool,
    /// The last column-parallel entry: (its input, the entered tensor), shared by the
    /// column-parallel linears that read the same input.
    entry: Option<(Tensor, Tensor)>,
}

impl PlanHooks {
    /// Hooks for TP rank `rank` of `group`, computing with `params` (canonical names; tied
    /// aliases from `aliases` are added) under `plan`, for a model with `layers`.
    pub(crate) fn new(
        group: TpGroup,
        rank: usize,
        params: &[(String, Tensor)],
        aliases: &[(String, String)],
        plan: ParallelPlan,
        layers: &[LayerSpec],
    ) -> Self {
        let mut by_name: HashMap<String, Tensor> = params
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        for (alias, canonical) in aliases {
            if let Some(t) = by_name.get(canonical).map(Tensor::shallow_clone) {
                by_name.insert(alias.clone(), t);
            }
        }
        let sp_entry = if plan.sequence_parallel {
            layers.iter().position(|l| {
                l.params.iter().any(|p| {
                    module_of(p).is_some_and(|m| {
                        plan.rules.iter().any(|r| {
                            r.style == ParallelStyle::Sequence
                                && ancestors(m).any(|a| matches_module(&r.pattern, a))
                        })
                    })
                })
            })
        } else {
            None
        };
        PlanHooks {
            group,
            rank,
            params: by_name,
            plan,
            fault: None,
            experts: None,
            sp_entry,
            sharded: false,
            entry: None,
        }
    }

    /// With a planted bug.
    pub(crate) fn with_fault(mut self, fault: Option<TpFault>) -> Self {
        self.fault = fault;
        self
    }

    /// With the plan's expert modules distributed over an expert-parallel group.
    pub(crate) fn with_experts(mut self, experts: ExpertsParallel) -> Self {
        self.experts = Some(experts);
        self
    }

    fn p(&self, name: &str) -> Result<&Tensor, ModelError> {
        self.params
            .get(name)
            .ok_or_else(|| hook_err(format!("parallel plan: no parameter `{name}`")))
    }

    /// This rank's weight and bias of the linear at `path` (the bias when the model has one).
    fn weights(
        &self,
        path: &str,
        bias: Option<&Tensor>,
    ) -> Result<(&Tensor, Option<&Tensor>), ModelError> {
        let w = self.p(&format!("{path}.weight"))?;
        let b = match bias {
            Some(_) => Some(self.p(&format!("{path}.bias"))?),
            None => None,
        };
        Ok((w, b))
    }

    /// The input of a column-parallel region: entered once per input tensor (q, k and v share
    /// one entry), all-gathered from sequence shards (and made batch first) under SP.
    fn enter(&mut self, x: &Tensor) -> Result<Tensor, ModelError> {
        if let Some((src, entered)) = &self.entry {
            if same_tensor(src, x) {
                return Ok(entered.shallow_clone());
            }
        }
        let entered = if self.fault == Some(TpFault::MissingBackwardAllReduce) && !self.sharded {
            x.shallow_clone()
        } else {
            let e = enter_column(x, &self.group, self.sharded).map_err(hook_err)?;
            if self.sharded {
                e.f_transpose(0, 1)?
            } else {
                e
            }
        };
        self.entry = Some((x.shallow_clone(), entered.shallow_clone()));
        Ok(entered)
    }

    /// The mixture of experts at `path` with this rank's experts, tokens dispatched to the
    /// ranks holding their choices.
    fn expert_parallel(
        &self,
        ep: &ExpertsParallel,
        path: &str,
        x: &Tensor,
        spec: MoeSpec,
    ) -> Result<Tensor, ModelError> {
        let local = (ep.first..ep.first + ep.per)
            .map(|e| {
                let p = |s: &str| {
                    self.p(&format!("{path}.experts.{e}.{s}"))
                        .map(Tensor::shallow_clone)
                };
                Ok(ExpertParams {
                    w1: p("w1.weight")?,
                    b1: p("w1.bias")?,
                    w2: p("w2.weight")?,
                    b2: p("w2.bias")?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let dim = x.size().last().copied().unwrap_or(0);
        let config = MoeConfig {
            num_experts: spec.experts,
            top_k: spec.top_k,
            capacity_factor: ep.capacity_factor,
            aux_loss_coef: 0.0,
        };
        let out = moe_forward_planted(
            &x.f_reshape([-1, dim])?,
            self.p(&format!("{path}.router.weight"))?,
            &local,
            &config,
            Some(&ep.group),
            ep.dispatcher,
            ep.extra_slot,
        )
        .map_err(hook_err)?;
        Ok(out.output.f_reshape(x.size().as_slice())?)
    }
}

/// Whether `a` and `b` are the same tensor (same memory, shape and strides): the
/// column-parallel linears of one input share its entry.
fn same_tensor(a: &Tensor, b: &Tensor) -> bool {
    a.data_ptr() == b.data_ptr() && a.size() == b.size() && a.stride() == b.stride()
}

impl LayerHooks for PlanHooks {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        if index == 0 {
            self.sharded = false;
            self.entry = None;
        }
        if self.sp_entry != Some(index) || self.sharded {
            return Ok(inputs);
        }
        // Enter the sequence-parallel region: this rank keeps its positions, sequence first.
        let mut inputs = inputs;
        if let Some(first) = inputs.first_mut() {
            *first = scatter_to_sequence_parallel(
                &first.f_transpose(0, 1)?.f_contiguous()?,
                &self.group,
            )
            .map_err(hook_err)?;
            self.sharded = true;
        }
        Ok(inputs)
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }

    fn linear(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        match self.plan.style_of(path) {
            Some(ParallelStyle::Colwise | ParallelStyle::Vocab) => {
                let entered = self.enter(x)?;
                let (w, b) = self.weights(path, bias)?;
                let opts = ColumnOptions {
                    entered: true,
                    ..ColumnOptions::default()
                };
                column_parallel_linear(&entered, w, b, &self.group, opts).map_err(hook_err)
            }
            Some(ParallelStyle::Rowwise) => {
                self.entry = None;
                let (w, b) = self.weights(path, bias)?;
                let opts = RowOptions {
                    input_is_parallel: true,
                    sequence_parallel: self.sharded,
                    batch_first: true,
                };
                row_parallel_linear(x, w, b, &self.group, opts).map_err(hook_err)
            }
            // Unsplit: the plain op on this rank's copy (or the model's, if none was taken).
            _ => match self.weights(path, bias) {
                Ok((w, b)) => NoHooks.linear(path, x, w, b),
                Err(_) => NoHooks.linear(path, x, weight, bias),
            },
        }
    }

    fn embedding(
        &mut self,
        path: &str,
        ids: &Tensor,
        weight: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let local = self.params.get(&format!("{path}.weight")).unwrap_or(weight);
        if self.plan.style_of(path) == Some(ParallelStyle::Vocab) {
            let start = self.rank as i64 * local.size()[0];
            return vocab_parallel_embedding(ids, local, start, &self.group).map_err(hook_err);
        }
        NoHooks.embedding(path, ids, local)
    }

    fn layer_norm(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor, ModelError> {
        let w = self.params.get(&format!("{path}.weight")).unwrap_or(weight);
        let b = self.params.get(&format!("{path}.bias")).unwrap_or(bias);
        NoHooks.layer_norm(path, x, w, b, eps)
    }

    fn moe(
        &mut self,
        path: &str,
        x: &Tensor,
        spec: MoeSpec,
        dense: &dyn Fn(&Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        match (&self.experts, self.plan.style_of(path)) {
            (Some(ep), Some(ParallelStyle::Expert)) => self.expert_parallel(ep, path, x, spec),
            _ => dense(x),
        }
    }

    fn dropout(
        &mut self,
        path: &str,
        x: &Tensor,
        mask: &dyn Fn(&[i64]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let Some(ParallelStyle::ShardedDropout { dim }) = self.plan.style_of(path) else {
            return NoHooks.dropout(path, x, mask);
        };
        // The full mask a single device draws, this rank's slice of it (parity mode).
        let rank = x.dim() as i64;
        let d = if dim < 0 { rank + dim } else { dim };
        if d < 1 || d >= rank {
            return Err(hook_err(format!(
                "dropout `{path}`: dimension {dim} is not a per-sample dimension of {:?}",
                x.size()
            )));
        }
        let len = x.size()[d as usize];
        let mut per_sample = x.size()[1..].to_vec();
        per_sample[d as usize - 1] *= self.group.size() as i64;
        let slice = if self.fault == Some(TpFault::SameDropoutMask) {
            0
        } else {
            self.rank as i64
        };
        let mask = mask(&per_sample)?
            .f_narrow(d, slice * len, len)?
            .f_to_kind(x.kind())?
            .f_to_device(x.device())?;
        Ok(x.f_mul(&mask)?)
    }

    fn cross_entropy(
        &mut self,
        path: &str,
        logits: &Tensor,
        target: &Tensor,
    ) -> Result<Tensor, ModelError> {
        if self.plan.style_of(path) == Some(ParallelStyle::Vocab) {
            let start = self.rank as i64 * logits.size().last().copied().unwrap_or(0);
            return vocab_parallel_cross_entropy(
                logits,
                target,
                start,
                &self.group,
                Reduction::Mean,
            )
            .map_err(hook_err);
        }
        NoHooks.cross_entropy(path, logits, target)
    }
}
