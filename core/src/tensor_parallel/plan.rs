//! What a plan (rules by module-path pattern, as torchtitan's `parallelize_module` plans are
//! written: [`lockstep_models::plan`]) makes of each parameter — and the check, before any
//! rank starts, that the plan fits the model and the TP size.

use lockstep_models::plan::{matches_module, ParallelPlan, ParallelStyle, PlanRule};
use lockstep_models::Model;
use std::collections::BTreeMap;

/// A plan's style, under the name tensor parallelism has always used.
pub type TpStyle = ParallelStyle;
/// One rule of a plan.
pub type TpRule = PlanRule;
/// A parallelization plan (the model's own, [`Model::parallel_plan`], or one a user passes).
pub type TpPlan = ParallelPlan;

/// Where one parameter lives under a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Whole and identical on every rank; its gradient is complete on every rank.
    Replicated,
    /// Whole on every rank, gradient partial (sequence shards): summed over TP.
    PartialGrad,
    /// Split along `dim` into equal contiguous chunks, rank r holding chunk r.
    Shard {
        /// The split dimension of the parameter tensor.
        dim: i64,
    },
}

/// Why a plan cannot apply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TpPlanError {
    /// A rule whose pattern matches nothing (usually a typo in the path).
    #[error(
        "tensor-parallel plan: pattern `{pattern}` matches no module of model `{model}`; its \
         modules with parameters are: {}",
        modules.join(", ")
    )]
    NoMatch {
        /// The rule's pattern.
        pattern: String,
        /// The model's zoo name.
        model: String,
        /// Every module path of the model that holds parameters (what patterns match), so
        /// a typo can be fixed from the message.
        modules: Vec<String>,
    },
    /// A parameter's split dimension does not divide by the TP size.
    #[error(
        "tensor-parallel plan: `{param}` ({style:?}) has {size} along dimension {dim}, which \
         does not divide by the tensor-parallel size {tp}"
    )]
    Indivisible {
        /// The parameter's full name.
        param: String,
        /// The style that would split it.
        style: TpStyle,
        /// The dimension to split.
        dim: i64,
        /// The parameter's extent along `dim`.
        size: i64,
        /// The tensor-parallel group size.
        tp: usize,
    },
    /// Attention heads must split whole across the TP ranks.
    #[error("tensor-parallel plan: layers.*.attention: {heads} attention heads do not divide by the tensor-parallel size {tp}")]
    Heads {
        /// The model's attention head count.
        heads: i64,
        /// The tensor-parallel group size.
        tp: usize,
    },
    /// The model (named) offers no plan for this and none was passed.
    #[error("tensor-parallel plan: model `{0}` has no parallel plan (it offers none through Model::parallel_plan and none was passed)")]
    Unsupported(String),
    /// Two rules place one tensor (a tied parameter under two names) differently.
    #[error("tensor-parallel plan: `{param}` is placed two ways ({first:?} and {second:?}) by rules naming it under different paths")]
    Conflict {
        /// The parameter's canonical name.
        param: String,
        /// The first placement.
        first: Placement,
        /// The other.
        second: Placement,
    },
    /// The requested TP size is zero or does not divide the world size.
    #[error("tensor-parallel plan: size {0} is not a positive divisor of the world")]
    Size(usize),
}

/// The placement a rule's style gives a parameter called `leaf` (`weight`, `bias`...).
fn placement_of(style: ParallelStyle, leaf: &str, sequence_parallel: bool) -> Placement {
    match (style, leaf) {
        (ParallelStyle::Colwise, _) | (ParallelStyle::Vocab, "weight") => {
            Placement::Shard { dim: 0 }
        }
        (ParallelStyle::Rowwise, "weight") => Placement::Shard { dim: 1 },
        // Under SP the bias is added to this rank's sequence shard only.
        (ParallelStyle::Rowwise, _) | (ParallelStyle::Sequence, _) if sequence_parallel => {
            Placement::PartialGrad
        }
        _ => Placement::Replicated,
    }
}

/// The first rule naming `module` or one of its ancestors (a rule on a mixture of experts
/// places every parameter under it).
fn rule_for<'p>(plan: &'p ParallelPlan, module: &str) -> Option<&'p PlanRule> {
    plan.rules
        .iter()
        .find(|r| ancestors(module).any(|a| matches_module(&r.pattern, a)))
}

/// Every parameter's placement under `plan` at TP size `tp`, checked: each rule with
/// parameters matches a module (tied aliases count: `output` names the tied embedding), each
/// sharded dimension divides, attention heads divide.
pub fn placements(
    plan: &ParallelPlan,
    model: &dyn Model,
    tp: usize,
) -> Result<BTreeMap<String, Placement>, TpPlanError> {
    if tp == 0 {
        return Err(TpPlanError::Size(tp));
    }
    if let Some(heads) = plan.heads.filter(|h| *h % tp as i64 != 0) {
        return Err(TpPlanError::Heads { heads, tp });
    }
    let params = model.named_parameters();
    let tags = model.tags();
    let mut out: BTreeMap<String, Placement> = params
        .iter()
        .map(|(n, _)| (n.clone(), Placement::Replicated))
        .collect();
    // Every name a parameter is used under, with its tensor.
    let mut names: Vec<(String, &tch::Tensor)> =
        params.iter().map(|(n, t)| (n.clone(), t)).collect();
    for group in &tags.shared {
        if let Some((_, t)) = params.iter().find(|(n, _)| *n == group.canonical) {
            names.extend(group.aliases.iter().map(|a| (a.clone(), t)));
        }
    }
    let mut used = vec![false; plan.rules.len()];
    let mut placed: BTreeMap<String, Placement> = BTreeMap::new();
    for (name, t) in &names {
        let Some(module) = module_of(name) else {
            continue;
        };
        let Some(rule) = rule_for(plan, module) else {
            continue;
        };
        if let Some(i) = plan.rules.iter().position(|r| std::ptr::eq(r, rule)) {
            used[i] = true;
        }
        let leaf = name.rsplit('.').next().unwrap_or_default();
        let placement = placement_of(rule.style, leaf, plan.sequence_parallel);
        if let Placement::Shard { dim } = placement {
            let size = t.size().get(dim as usize).copied().unwrap_or(0);
            if size % tp as i64 != 0 {
                return Err(TpPlanError::Indivisible {
                    param: name.clone(),
                    style: rule.style,
                    dim,
                    size,
                    tp,
                });
            }
        }
        let canonical = tags.canonical(name).to_owned();
        match placed.get(&canonical) {
            Some(first) if *first != placement => {
                return Err(TpPlanError::Conflict {
                    param: canonical,
                    first: *first,
                    second: placement,
                })
            }
            _ => {
                placed.insert(canonical.clone(), placement);
                out.insert(canonical, placement);
            }
        }
    }
    // A rule for a parameter-free module (a dropout site) cannot be checked against names.
    let unused = plan
        .rules
        .iter()
        .zip(&used)
        .find(|(r, used)| !**used && !matches!(r.style, ParallelStyle::ShardedDropout { .. }));
    if let Some((rule, _)) = unused {
        let mut modules: Vec<String> = names
            .iter()
            .filter_map(|(n, _)| module_of(n).map(str::to_owned))
            .collect();
        modules.dedup();
        return Err(TpPlanError::NoMatch {
            pattern: rule.pattern.clone(),
            model: model.name().to_owned(),
            modules,
        });
    }
    Ok(out)
}

/// The module path of parameter `name` (`None` for a top-level parameter).
pub(crate) fn module_of(name: &str) -> Option<&str> {
    name.rsplit_once('.').map(|(m, _)| m)
}

/// `module` and every ancestor path of it, innermost first.
pub(crate) fn ancestors(module: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(module);
    std::iter::from_fn(move || {
        let cur = next?;
        next = cur.rsplit_once('.').map(|(a, _)| a);
        Some(cur)
    })
}
