//! Experts spread over ranks borrowed from another parallelism's data group, as torchtitan
//! borrows `ep` from `dp_shard × cp`: context parallelism's `dp × cp` (TP inside or not), or
//! a pipeline stage's data group. The model's other parameters stay with that parallelism;
//! each mixture's experts are spread over an `ep` group and every rank's tokens (a sequence
//! shard's, a microbatch's) are dispatched to them through the plan's hooks.
//!
//! An expert's local gradient is the sum of the contributions of the tokens dispatched to it.
//! Summed over the ranks holding the same experts it is the sum over every rank of the data
//! group, so it is scaled by what turns that sum into the data group's average gradient:
//! `1 / dp` under CP (each shard's loss is already its share of its replica's mean),
//! `1 / (data group size)` in a pipeline (whose shards carry the CP size in their loss).

use super::moe::Dispatcher;
use crate::comm::{ProcessGroup, ReduceOp};
use crate::failure::SplitFailure;
use crate::tensor_parallel::hooks::ExpertsParallel;
use lockstep_models::Model;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// One rank's experts, on ranks borrowed from a data group.
pub(crate) struct BorrowedExperts {
    /// The `ep` ranks one mixture's experts are spread over (tokens dispatched among them).
    group: Arc<dyn ProcessGroup>,
    /// The ranks holding this rank's experts: an expert's gradient is summed over them.
    holders: Arc<dyn ProcessGroup>,
    /// Experts per rank.
    per: usize,
    /// The expert each expert parameter belongs to.
    expert_of: HashMap<String, usize>,
    /// Every parameter of the model (handles), for the shapes of the experts held elsewhere.
    named: Vec<(String, Tensor)>,
    /// What an expert's summed gradient is multiplied by.
    scale: f64,
    /// The expert parameters this rank's EP group deals in (a pipeline stage's own; `None`:
    /// every one): the others' values are left as they are when assembling full tensors.
    scope: Option<std::collections::HashSet<String>>,
}

impl BorrowedExperts {
    /// `model`'s experts (`experts` per mixture, checked to divide by the size of `group`)
    /// spread over `group`, their gradients summed over `holders` and multiplied by `scale`.
    pub(crate) fn new(
        model: &dyn Model,
        group: Arc<dyn ProcessGroup>,
        holders: Arc<dyn ProcessGroup>,
        experts: usize,
        scale: f64,
    ) -> BorrowedExperts {
        BorrowedExperts {
            per: experts / group.size().max(1),
            group,
            holders,
            expert_of: model
                .tags()
                .experts
                .iter()
                .map(|e| (e.name.clone(), e.expert))
                .collect(),
            named: model.named_parameters(),
            scale,
            scope: None,
        }
    }

    /// The same experts, dealing only in the expert parameters among `names` (a pipeline
    /// stage's): the other stages' experts are assembled by their own EP groups.
    pub(crate) fn within(mut self, names: impl IntoIterator<Item = String>) -> BorrowedExperts {
        self.scope = Some(names.into_iter().collect());
        self
    }

    /// Whether this rank trains `name`: every parameter but the other ranks' experts.
    pub(crate) fn holds(&self, name: &str) -> bool {
        let first = self.group.rank() * self.per;
        self.expert_of
            .get(name)
            .is_none_or(|&e| (first..first + self.per).contains(&e))
    }

    /// Whether `name` is an expert's parameter.
    pub(crate) fn is_expert(&self, name: &str) -> bool {
        self.expert_of.contains_key(name)
    }

    /// How the plan's hooks run the mixtures: this rank's experts, all-to-all dispatch, no
    /// token dropped.
    pub(crate) fn dispatch(&self) -> ExpertsParallel {
        ExpertsParallel {
            group: self.group.clone(),
            dispatcher: Dispatcher::AllToAll,
            capacity_factor: None,
            first: self.group.rank() * self.per,
            per: self.per,
            extra_slot: false,
        }
    }

    /// Sums each expert gradient among `trained` over the ranks holding it and multiplies it
    /// by the scale (an expert no token reached gets a zero gradient, so every holder takes
    /// part).
    pub(crate) fn reduce(&self, trained: &[(String, Tensor)]) -> Result<(), SplitFailure> {
        for (_, t) in trained.iter().filter(|(n, _)| self.is_expert(n)) {
            let mut g = t.grad();
            if !g.defined() {
                g = t.f_zeros_like()?;
                crate::autograd::set_grad(t, Some(&g))?;
            }
            if self.holders.size() > 1 {
                self.holders.all_reduce(&g, ReduceOp::Sum)?;
            }
            let _ = g.f_mul_scalar_(self.scale)?;
        }
        Ok(())
    }

    /// Every parameter of the model from this rank's `local` values (what it trains; any
    /// other parameter is taken as zeros): each expert's broadcast over the EP group from the
    /// rank holding it.
    pub(crate) fn full(
        &self,
        local: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>, SplitFailure> {
        let mut mine: HashMap<String, Tensor> = local.into_iter().collect();
        let every = self
            .named
            .iter()
            .map(|(name, t)| match mine.remove(name) {
                Some(v) => Ok((name.clone(), v)),
                None => Ok((name.clone(), t.f_zeros_like()?)),
            })
            .collect::<Result<Vec<_>, SplitFailure>>()?;
        let in_scope: HashMap<String, usize> = self
            .expert_of
            .iter()
            .filter(|(n, _)| self.scope.as_ref().is_none_or(|s| s.contains(*n)))
            .map(|(n, &e)| (n.clone(), e))
            .collect();
        super::run::full_expert_tensors(
            &every,
            &in_scope,
            self.per,
            self.group.rank(),
            self.group.as_ref(),
        )
    }

    /// Where expert parameter `name` lives, for the record (`None`: not an expert's).
    pub(crate) fn placement(&self, name: &str) -> Option<String> {
        let e = *self.expert_of.get(name)?;
        Some(format!(
            "expert {e} on ep rank {} of {}, gradient summed over its {} holders",
            e / self.per,
            self.group.size(),
            self.holders.size()
        ))
    }
}
