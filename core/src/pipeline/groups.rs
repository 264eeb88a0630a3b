//! The pipeline's process groups on a rank (stage-to-stage, replicas, the stage's tensor
//! parallel group, every edge and every set of stages holding one tensor) and what travels
//! over them outside the schedule: the initial broadcast and the tied gradients' sum.

use super::edges::{EdgeGroups, Way};
use super::plan::PipelinePlan;
use super::strategy::grad_or_zeros;
use super::PipelineError;
use crate::comm::{DeviceMesh, ProcessGroup, ReduceOp, World};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use tch::Tensor;

/// The pipeline's groups on this rank: the stage-to-stage one (`pp`), the replicas' (`dp`),
/// the data group gradients and losses are averaged over (`dp`, or `dp × cp` under CP), the
/// stage's tensor- and context-parallel ones when split, and this rank's coordinates.
pub(super) struct PipelineMesh {
    pub(super) pp: Arc<dyn ProcessGroup>,
    pub(super) dp: Arc<dyn ProcessGroup>,
    pub(super) data: Arc<dyn ProcessGroup>,
    /// HSDP: the group the data group's shards are replicated across (`dp_replicate`).
    pub(super) replicate: Option<Arc<dyn ProcessGroup>>,
    pub(super) tp: Option<Arc<dyn ProcessGroup>>,
    pub(super) cp: Option<Arc<dyn ProcessGroup>>,
    pub(super) rank: usize,
    pub(super) replica: usize,
    pub(super) tp_rank: usize,
    pub(super) cp_rank: usize,
    /// PP × EP: the `ep` ranks of this rank's data group its stage's experts are spread over,
    /// and the ranks holding the same experts (the same place in every data group of this
    /// stage and TP coordinate, across HSDP's replicas).
    pub(super) experts: Option<(Arc<dyn ProcessGroup>, Arc<dyn ProcessGroup>)>,
}

impl PipelineMesh {
    /// `[dp, pp, cp, tp]` over `world`, the dimensions of size 1 among `cp` and `tp` left out
    /// (a plain pipeline keeps its historical two-dimensional mesh and group names); under
    /// HSDP `dp` is `dp_replicate × dp_shard` with `replicas` replicas. `counted` wraps the
    /// groups whose traffic the record counts.
    pub(super) fn new(
        world: &World,
        plan: &PipelinePlan,
        tp: usize,
        cp: usize,
        replicas: usize,
        ep: usize,
        counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
    ) -> Result<Self, PipelineError> {
        let (p, dp) = (plan.ranks, plan.data_parallel);
        let mut dims = vec![("dp", dp), ("pp", p)];
        if cp > 1 {
            dims.push(("cp", cp));
        }
        if tp > 1 {
            dims.push(("tp", tp));
        }
        let mesh = DeviceMesh::new(world, &dims)?;
        let dp_group = counted(mesh.group("dp")?);
        let layout = MeshLayout {
            p,
            cp,
            tp,
            replicas,
            shards: dp / replicas.max(1),
        };
        // A group per (replica, pp, tp) coordinate over the data ranks gradients reduce over
        // (`dp_shard × cp`: not adjacent in the mesh, so made from its partition directly),
        // and under HSDP one per (dp_shard, pp, cp, tp) across the replicas.
        let group_of = |partition: Vec<Vec<usize>>, name: &str| {
            world.new_groups(&partition, name)?.ok_or_else(|| {
                PipelineError::InvalidPlan(format!("rank {} is in no {name} group", world.rank()))
            })
        };
        let experts = if ep > 1 {
            let (groups, holders) = layout.expert_partitions(ep);
            Some((
                counted(group_of(groups, "pp-ep")?),
                counted(group_of(holders, "pp-ep-holders")?),
            ))
        } else {
            None
        };
        let data = if cp > 1 || replicas > 1 {
            counted(group_of(layout.data_partition(), "dp_cp")?)
        } else {
            dp_group.clone()
        };
        let replicate = if replicas > 1 {
            Some(counted(group_of(
                layout.replicate_partition(),
                "dp_replicate",
            )?))
        } else {
            None
        };
        let (cp_group, cp_rank) = match cp > 1 {
            true => (Some(counted(mesh.group("cp")?)), mesh.coordinate("cp")?),
            false => (None, 0),
        };
        let (tp_group, tp_rank) = match tp > 1 {
            true => (Some(counted(mesh.group("tp")?)), mesh.coordinate("tp")?),
            false => (None, 0),
        };
        Ok(PipelineMesh {
            pp: mesh.group("pp")?,
            dp: dp_group,
            data,
            replicate,
            tp: tp_group,
            cp: cp_group,
            rank: mesh.coordinate("pp")?,
            replica: mesh.coordinate("dp")?,
            tp_rank,
            cp_rank,
            experts,
        })
    }
}

/// Where a pipeline's ranks sit on its mesh `[dp, pp, cp, tp]` (`dp` = `replicas × shards`
/// under HSDP), for the groups the mesh's own dimensions cannot give.
struct MeshLayout {
    p: usize,
    cp: usize,
    tp: usize,
    replicas: usize,
    shards: usize,
}

impl MeshLayout {
    /// The global rank at data index `d`, pipeline rank `r`, CP coordinate `c`, TP `t`.
    fn global(&self, d: usize, r: usize, c: usize, t: usize) -> usize {
        ((d * self.p + r) * self.cp + c) * self.tp + t
    }

    /// The data group of replica `q`, pipeline rank `r`, TP coordinate `t`: its
    /// `dp_shard × cp` ranks, CP innermost.
    fn data_ranks(&self, q: usize, r: usize, t: usize) -> Vec<usize> {
        (0..self.shards)
            .flat_map(|s| (0..self.cp).map(move |c| self.global(q * self.shards + s, r, c, t)))
            .collect()
    }

    /// Every (replica, pipeline rank, TP coordinate), in group-creation order.
    fn coordinates(&self) -> Vec<(usize, usize, usize)> {
        let (p, tp) = (self.p, self.tp);
        (0..self.replicas)
            .flat_map(|q| (0..p).flat_map(move |r| (0..tp).map(move |t| (q, r, t))))
            .collect()
    }

    /// The data groups, one per [`MeshLayout::coordinates`].
    fn data_partition(&self) -> Vec<Vec<usize>> {
        self.coordinates()
            .into_iter()
            .map(|(q, r, t)| self.data_ranks(q, r, t))
            .collect()
    }

    /// PP × EP: EP takes the innermost `ep` ranks of each data group; an expert's holders are
    /// the ranks at the same place in each EP group of the stage's data groups.
    fn expert_partitions(&self, ep: usize) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
        let groups = self
            .coordinates()
            .into_iter()
            .flat_map(|(q, r, t)| {
                let ranks = self.data_ranks(q, r, t);
                ranks.chunks(ep).map(<[usize]>::to_vec).collect::<Vec<_>>()
            })
            .collect();
        let tp = self.tp;
        let holders = (0..self.p)
            .flat_map(|r| (0..tp).flat_map(move |t| (0..ep).map(move |e| (r, t, e))))
            .map(|(r, t, e)| {
                (0..self.replicas)
                    .flat_map(|q| self.data_ranks(q, r, t).into_iter().skip(e).step_by(ep))
                    .collect()
            })
            .collect();
        (groups, holders)
    }

    /// HSDP: one group per (dp_shard, pp, cp, tp) coordinate across the replicas.
    fn replicate_partition(&self) -> Vec<Vec<usize>> {
        let (p, cp, tp) = (self.p, self.cp, self.tp);
        (0..self.shards)
            .flat_map(|s| {
                (0..p).flat_map(move |r| {
                    (0..cp).flat_map(move |c| (0..tp).map(move |t| (s, r, c, t)))
                })
            })
            .map(|(s, r, c, t)| {
                (0..self.replicas)
                    .map(|q| self.global(q * self.shards + s, r, c, t))
                    .collect()
            })
            .collect()
    }
}

/// Groups between stages that exchange activations and gradients (by edge and way) and
/// among the stages that hold one tied weight (by holder set), created in the same order on
/// every rank.
pub(super) type StageGroups = (EdgeGroups, BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>);

/// The edge and tied-weight groups of `plan`, one per (replica, coordinate inside the stage:
/// `inner` = cp · tp ranks compute each stage).
pub(super) fn pipeline_groups(
    world: &World,
    plan: &PipelinePlan,
    inner: usize,
    counted: &dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup>,
) -> Result<StageGroups, PipelineError> {
    let (p, dp) = (plan.ranks, plan.data_parallel);
    let global = |d: usize, r: usize, t: usize| (d * p + r) * inner + t;
    let mut edge_groups = HashMap::new();
    for e in &plan.flow.edges {
        let (a, b) = (plan.stage_ranks[e.from], plan.stage_ranks[e.to]);
        if a == b {
            continue;
        }
        let partition: Vec<Vec<usize>> = (0..dp)
            .flat_map(|d| (0..inner).map(move |t| vec![global(d, a, t), global(d, b, t)]))
            .collect();
        for (way, name) in [(Way::Activations, "pp-edge"), (Way::Gradients, "pp-grad")] {
            if let Some(g) = world.new_groups(&partition, name)? {
                edge_groups.insert((e.from, e.to, way), counted(g));
            }
        }
    }
    let mut holder_sets: Vec<Vec<usize>> = plan
        .holders
        .iter()
        .filter(|h| h.len() > 1)
        .map(|h| h.iter().copied().collect())
        .collect();
    holder_sets.sort();
    holder_sets.dedup();
    let mut holder_groups = BTreeMap::new();
    for set in &holder_sets {
        let partition: Vec<Vec<usize>> = (0..dp)
            .flat_map(|d| (0..inner).map(move |t| set.iter().map(|&r| global(d, r, t)).collect()))
            .collect();
        if let Some(g) = world.new_groups(&partition, "pp-tied")? {
            holder_groups.insert(set.clone(), counted(g));
        }
    }
    Ok((edge_groups, holder_groups))
}

/// A tied weight starts from its lowest holder's value; replicas (`replicas`, when the
/// pipeline has several) from replica 0's.
pub(super) fn broadcast_initial(
    plan: &PipelinePlan,
    named: &[(String, Tensor)],
    held: &[usize],
    holder_groups: &BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
    replicas: Option<&dyn ProcessGroup>,
) -> Result<(), PipelineError> {
    let _guard = tch::no_grad_guard();
    for &i in held {
        if let Some(g) = holder_groups.get(&holder_set(plan, i)) {
            g.broadcast(&named[i].1, 0)?;
        }
    }
    if let Some(group) = replicas {
        for &i in held {
            group.broadcast(&named[i].1, 0)?;
        }
    }
    Ok(())
}

/// The ranks holding parameter `i` (several for a tied weight), as its group's key.
pub(super) fn holder_set(plan: &PipelinePlan, i: usize) -> Vec<usize> {
    plan.holders[i].iter().copied().collect()
}

/// Tied weights: every holder of each held tied weight ends with the sum of every holder's
/// part of its gradient (nothing with the planted `skip` fault).
pub(super) fn reduce_tied_parts(
    plan: &PipelinePlan,
    held: &[usize],
    named: &[(String, Tensor)],
    holder_groups: &BTreeMap<Vec<usize>, Arc<dyn ProcessGroup>>,
    skip: bool,
) -> Result<(), PipelineError> {
    for &i in held {
        let (name, t) = &named[i];
        let g = grad_or_zeros(t)?;
        if let Some(group) = holder_groups.get(&holder_set(plan, i)).filter(|_| !skip) {
            group
                .all_reduce(&g, ReduceOp::Sum)
                .map_err(|e| PipelineError::Execution(format!("reducing tied `{name}`: {e}")))?;
        }
    }
    Ok(())
}
