//! Expert parallelism beside context parallelism (CP × EP, with TP inside or not): each
//! mixture's experts spread over `ep` ranks borrowed from `dp × cp` within a TP coordinate
//! (torchtitan borrows `ep` from `dp_shard × cp`). The mixture is token-wise, so every
//! sequence shard's tokens are dispatched to their experts as a whole sequence's would be.
//!
//! The gradients follow from each shard's loss being its share of the sequence's mean: an
//! expert's local gradient is the sum of the contributions of the tokens dispatched to it;
//! summed over the ranks holding the same experts it is the sum over every shard of every
//! replica, so it is divided by the replicas (`dp`), not by all `dp × cp` holders' worth of
//! ranks as expert parallelism alone divides (there every rank's loss is a whole mean).

use super::options::{CpError, CpFault, CpOptions};
use crate::comm::{DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::expert_parallel::full_expert_tensors;
use crate::expert_parallel::Dispatcher;
use crate::tensor_parallel::hooks::ExpertsParallel;
use lockstep_models::Model;
use std::collections::HashMap;
use std::sync::Arc;
use tch::Tensor;

/// The expert-parallel part of a CP rank.
pub(super) struct CpExperts {
    /// The `ep` ranks one mixture's experts are spread over (tokens dispatched among them).
    group: Arc<dyn ProcessGroup>,
    /// The ranks holding this rank's experts (same EP and TP coordinates): an expert's
    /// gradient is summed over them.
    holders: Arc<dyn ProcessGroup>,
    /// This rank's place in `group`.
    rank: usize,
    ep: usize,
    /// Experts per rank.
    per: usize,
    /// The expert each expert parameter belongs to.
    expert_of: HashMap<String, usize>,
    /// Every parameter of the model (handles), for the shapes of the experts held elsewhere.
    named: Vec<(String, Tensor)>,
    /// What an expert's summed gradient is multiplied by: `1 / dp` (a planted fault's
    /// `1 / (dp · cp)`).
    scale: f64,
}

impl CpExperts {
    /// The EP part of this rank under `opts` (`None` at `ep` = 1); `experts` per mixture was
    /// checked to divide by `ep`, and `ep` to divide `dp × cp`.
    pub(super) fn new(
        model: &dyn Model,
        world: &World,
        opts: &CpOptions,
        experts: usize,
        counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
    ) -> Result<Option<CpExperts>, CpError> {
        let ep = opts.ep;
        if ep <= 1 {
            return Ok(None);
        }
        let data_cp = world.size() / opts.tp;
        // World ranks are laid out [data…, cp, tp]: the flat `dp × cp` index is the rank over
        // tp, and EP takes its innermost ranks.
        let mut dims = vec![("edp", data_cp / ep), ("ep", ep)];
        if opts.tp > 1 {
            dims.push(("tp", opts.tp));
        }
        let mesh = DeviceMesh::new(world, &dims)?;
        let dp = data_cp / opts.cp;
        let scale = match opts.fault {
            Some(CpFault::ExpertGradsNotScaledByCp) => 1.0 / data_cp as f64,
            _ => 1.0 / dp as f64,
        };
        Ok(Some(CpExperts {
            group: counted(mesh.group("ep")?),
            holders: counted(mesh.group("edp")?),
            rank: mesh.coordinate("ep")?,
            ep,
            per: experts / ep,
            expert_of: model
                .tags()
                .experts
                .iter()
                .map(|e| (e.name.clone(), e.expert))
                .collect(),
            named: model.named_parameters(),
            scale,
        }))
    }

    /// Whether this rank trains `name`: every dense parameter, and its own experts.
    pub(super) fn holds(&self, name: &str) -> bool {
        let first = self.rank * self.per;
        self.expert_of
            .get(name)
            .is_none_or(|&e| (first..first + self.per).contains(&e))
    }

    /// Whether `name` is an expert's parameter.
    pub(super) fn is_expert(&self, name: &str) -> bool {
        self.expert_of.contains_key(name)
    }

    /// How the plan's hooks run the mixtures: this rank's experts, all-to-all dispatch, no
    /// token dropped.
    pub(super) fn dispatch(&self) -> ExpertsParallel {
        ExpertsParallel {
            group: self.group.clone(),
            dispatcher: Dispatcher::AllToAll,
            capacity_factor: None,
            first: self.rank * self.per,
            per: self.per,
            extra_slot: false,
        }
    }

    /// Sums each expert gradient among `trained` over the ranks holding it and scales it by
    /// `1 / dp` (an expert no token reached this step gets a zero gradient, so every holder
    /// takes part).
    pub(super) fn reduce(&self, trained: &[(String, Tensor)]) -> Result<(), CpError> {
        for (_, t) in trained.iter().filter(|(n, _)| self.is_expert(n)) {
            let mut g = t.grad();
            if !g.defined() {
                g = t.f_zeros_like()?;
                crate::autograd::set_grad(t, Some(&g))
                    .map_err(|e| CpError::Invalid(format!("CP × EP: {e}")))?;
            }
            if self.holders.size() > 1 {
                self.holders.all_reduce(&g, ReduceOp::Sum)?;
            }
            let _ = g.f_mul_scalar_(self.scale)?;
        }
        Ok(())
    }

    /// Every parameter of the model from this rank's `local` values (dense ones and its own
    /// experts): each expert's broadcast over the EP group from the rank holding it.
    pub(super) fn full(
        &self,
        local: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>, CpError> {
        let mut mine: HashMap<String, Tensor> = local.into_iter().collect();
        let every = self
            .named
            .iter()
            .map(|(name, t)| match mine.remove(name) {
                Some(v) => Ok((name.clone(), v)),
                None => Ok((name.clone(), t.f_zeros_like()?)),
            })
            .collect::<Result<Vec<_>, CpError>>()?;
        full_expert_tensors(
            &every,
            &self.expert_of,
            self.per,
            self.rank,
            self.group.as_ref(),
        )
        .map_err(|e| CpError::Invalid(format!("CP × EP: {e}")))
    }

    /// Where expert parameter `name` lives, for the record (`None`: not an expert's).
    pub(super) fn placement(&self, name: &str) -> Option<String> {
        let e = *self.expert_of.get(name)?;
        Some(format!(
            "expert {e} on ep rank {} of {}, gradient summed over its {} holders",
            e / self.per,
            self.ep,
            self.holders.size()
        ))
    }
}
