//! Which parameters go into which FSDP unit: the wrap policy picks groups of layers, each
//! group becomes a unit owning the parameters only it uses; everything else (tied parameters
//! used by several units, parameters of no wrapped layer) stays in the root unit, the
//! smallest unit enclosing every use — as PyTorch's nested wrapping leaves it in the parent.

use super::FsdpError;
use lockstep_models::{LayerKind, LayerSpec, ParamTags};
use std::collections::{BTreeSet, HashMap};

/// Which modules get their own FSDP unit (flat parameter).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WrapPolicy {
    /// The whole model is one root unit.
    Root,
    /// Every layer of `Model::layers` with parameters is a unit ("wrap everything").
    PerLayer,
    /// Every layer of these kinds is a unit (PyTorch's `ModuleWrapPolicy`, e.g. the
    /// transformer blocks).
    ByKind(Vec<LayerKind>),
    /// Consecutive layers are grouped into a unit until it holds at least this many
    /// parameters (PyTorch's `size_based_auto_wrap_policy`); a smaller remainder stays in the
    /// root.
    MinParams(i64),
    /// Units named explicitly, each a list of layer names (`Model::layers` names). A layer
    /// may be wrapped once; a parameter used by layers of two units is rejected.
    Explicit(Vec<Vec<String>>),
}

/// A unit as the policy chose it, before its flat parameter exists.
pub(super) struct PlannedUnit {
    pub name: String,
    pub layers: Vec<usize>,
    pub params: Vec<String>,
}

/// Plans the units for `managed` parameters (canonical names, `named_parameters` order):
/// the root first (possibly without parameters), then one per layer group in forward order.
/// Layers in `isolate` (BatchNorm under mixed precision, which must compute in fp32) always
/// get a unit of their own, whatever the policy.
pub(super) fn plan_units(
    policy: &WrapPolicy,
    layers: &[LayerSpec],
    tags: &ParamTags,
    managed: &[(String, i64)],
    isolate: &[usize],
) -> Result<Vec<PlannedUnit>, FsdpError> {
    let planner = Planner {
        layers,
        tags,
        numel: managed.iter().map(|(n, k)| (n.as_str(), *k)).collect(),
    };
    let groups = planner.policy_groups(policy)?;
    let groups = if isolate.is_empty() {
        groups
    } else {
        planner.isolate(groups, isolate)
    };
    let mut units = planner.units(&groups);
    planner.assign_params(policy, &groups, managed, &mut units)?;
    Ok(units)
}

/// What every planning step reads: the layers and which of their parameters FSDP manages.
struct Planner<'a> {
    layers: &'a [LayerSpec],
    tags: &'a ParamTags,
    /// Managed parameters (canonical names) and their element counts.
    numel: HashMap<&'a str, i64>,
}

impl Planner<'_> {
    /// The managed parameters (canonical names) a layer lists.
    fn layer_params(&self, l: &LayerSpec) -> BTreeSet<String> {
        l.params
            .iter()
            .map(|p| self.tags.canonical(p).to_owned())
            .filter(|p| self.numel.contains_key(p.as_str()))
            .collect()
    }

    /// The layer groups the policy wraps, each a unit (before isolation).
    fn policy_groups(&self, policy: &WrapPolicy) -> Result<Vec<Vec<usize>>, FsdpError> {
        let layers = self.layers;
        Ok(match policy {
            WrapPolicy::Root => Vec::new(),
            WrapPolicy::PerLayer => (0..layers.len())
                .filter(|&l| !self.layer_params(&layers[l]).is_empty())
                .map(|l| vec![l])
                .collect(),
            WrapPolicy::ByKind(kinds) => (0..layers.len())
                .filter(|&l| {
                    kinds.contains(&layers[l].kind) && !self.layer_params(&layers[l]).is_empty()
                })
                .map(|l| vec![l])
                .collect(),
            WrapPolicy::MinParams(min) => self.min_params_groups(*min),
            WrapPolicy::Explicit(units) => explicit_groups(units, layers)?,
        })
    }

    /// `MinParams`: consecutive layers with parameters, cut once a group holds `min`.
    fn min_params_groups(&self, min: i64) -> Vec<Vec<usize>> {
        let mut groups = Vec::new();
        let mut current = Vec::new();
        let mut count = 0;
        for (l, layer) in self.layers.iter().enumerate() {
            let own: i64 = self
                .layer_params(layer)
                .iter()
                .map(|p| self.numel[p.as_str()])
                .sum();
            if own == 0 {
                continue;
            }
            current.push(l);
            count += own;
            if count >= min {
                groups.push(std::mem::take(&mut current));
                count = 0;
            }
        }
        groups
    }

    /// Takes the `isolate` layers out of their groups and gives each with parameters its own.
    fn isolate(&self, groups: Vec<Vec<usize>>, isolate: &[usize]) -> Vec<Vec<usize>> {
        let mut rest: Vec<Vec<usize>> = groups
            .into_iter()
            .map(|g| {
                g.into_iter()
                    .filter(|l| !isolate.contains(l))
                    .collect::<Vec<_>>()
            })
            .filter(|g| !g.is_empty())
            .collect();
        rest.extend(
            isolate
                .iter()
                .filter(|&&l| !self.layer_params(&self.layers[l]).is_empty())
                .map(|&l| vec![l]),
        );
        rest.sort_by_key(|g| g.first().copied());
        rest
    }

    /// The root unit, then one unit per group, all still without parameters.
    fn units(&self, groups: &[Vec<usize>]) -> Vec<PlannedUnit> {
        std::iter::once(PlannedUnit {
            name: "root".into(),
            layers: Vec::new(),
            params: Vec::new(),
        })
        .chain(groups.iter().map(|group| {
            PlannedUnit {
                name: unit_name(
                    &group
                        .iter()
                        .map(|&l| self.layers[l].name.clone())
                        .collect::<Vec<_>>(),
                ),
                layers: group.clone(),
                params: Vec::new(),
            }
        }))
        .collect()
    }

    /// Puts each managed parameter in the one unit using it, else in the root.
    fn assign_params(
        &self,
        policy: &WrapPolicy,
        groups: &[Vec<usize>],
        managed: &[(String, i64)],
        units: &mut [PlannedUnit],
    ) -> Result<(), FsdpError> {
        let layers = self.layers;
        // Which groups use each parameter.
        let mut users: HashMap<String, BTreeSet<usize>> = HashMap::new();
        for (g, group) in groups.iter().enumerate() {
            for &l in group {
                for p in self.layer_params(&layers[l]) {
                    users.entry(p).or_default().insert(g);
                }
            }
        }
        for (name, _) in managed {
            let target = match users
                .get(name)
                .map(|s| s.iter().copied().collect::<Vec<_>>())
            {
                Some(gs) if gs.len() == 1 => gs[0] + 1,
                Some(gs) if gs.len() > 1 && matches!(policy, WrapPolicy::Explicit(_)) => {
                    let module = |g: usize| {
                        groups[g]
                            .iter()
                            .map(|&l| &layers[l])
                            .find(|l| l.params.iter().any(|p| self.tags.canonical(p) == name))
                            .map_or_else(String::new, |l| l.name.clone())
                    };
                    return Err(FsdpError::SharedAcrossUnits {
                        param: name.clone(),
                        first: module(gs[0]),
                        second: module(gs[1]),
                    });
                }
                _ => 0,
            };
            units[target].params.push(name.clone());
        }
        Ok(())
    }
}

/// `Explicit`: the named layers' indices per unit, each layer wrapped at most once.
fn explicit_groups(
    units: &[Vec<String>],
    layers: &[LayerSpec],
) -> Result<Vec<Vec<usize>>, FsdpError> {
    let index: HashMap<&str, usize> = layers
        .iter()
        .enumerate()
        .map(|(i, l)| (l.name.as_str(), i))
        .collect();
    let mut owner: HashMap<usize, usize> = HashMap::new();
    let mut groups = Vec::new();
    for (u, names) in units.iter().enumerate() {
        let mut group = Vec::new();
        for name in names {
            let Some(&l) = index.get(name.as_str()) else {
                return Err(FsdpError::UnknownLayer {
                    layer: name.clone(),
                    known: layers.iter().map(|l| l.name.clone()).collect(),
                });
            };
            if let Some(&first) = owner.get(&l) {
                return Err(FsdpError::WrappedTwice {
                    layer: name.clone(),
                    first: unit_name(&units[first]),
                    second: unit_name(names),
                });
            }
            owner.insert(l, u);
            group.push(l);
        }
        group.sort_unstable();
        groups.push(group);
    }
    Ok(groups)
}

/// A unit's name from the layers it wraps.
fn unit_name(layers: &[String]) -> String {
    layers.join("+")
}
