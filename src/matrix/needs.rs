//! Which references a cell runs, read from the judging edges ([`Config::edges`]) of the
//! selected configurations that run there: a reference runs when, and only when, a row uses
//! it. The rows and the runs come from the same edges, so no row names a reference that did
//! not run for a reason other than the model's own.

use super::*;
use lockstep_core::context_parallel::SequenceLayout;

/// What one cell (model × world size) must run beside its configurations under test.
#[derive(Debug, Default)]
pub(super) struct CellNeeds {
    /// The single-device fp32 reference.
    pub(super) single: bool,
    /// Its float64 shadow.
    pub(super) single_f64: bool,
    /// Its fp32 variants, which widen an envelope.
    pub(super) spread: bool,
    /// Reference configurations (`ddp`, `ddp.<policy>`, `ddp.hybrid_order`) used as a
    /// reference by another configuration's edge.
    pub(super) configs: Vec<Config>,
    /// Configurations whose repeat is a row (the selected references).
    pub(super) repeats: Vec<Config>,
    /// The simpler configurations compositions reduce to, not selected themselves.
    pub(super) simpler: Vec<Config>,
    /// Policies whose independent mixed-precision reference runs.
    pub(super) mixed: Vec<Precision>,
    /// Capacity factors whose dropping reference (and its shadow) runs.
    pub(super) dropping: Vec<f64>,
    /// Microbatch counts whose microbatched reference runs, and whether its shadow does.
    pub(super) microbatched: Vec<(usize, bool)>,
    /// Rings whose ring-ordered reference (`single.cpN`) runs, as `(cp, layout)`.
    pub(super) ring_ordered: Vec<(usize, SequenceLayout)>,
}

impl CellNeeds {
    fn push<T: PartialEq>(list: &mut Vec<T>, item: T) {
        if !list.contains(&item) {
            list.push(item);
        }
    }

    /// The fp32 run `against` names, for an edge of `config`.
    fn fp32(&mut self, plan: &Plan, config: Config, against: Against) {
        match against {
            Against::Repeat => Self::push(&mut self.repeats, config),
            Against::Single => self.single = true,
            Against::Config(c) if c.is_reference_family() => Self::push(&mut self.configs, c),
            Against::Config(c) if !plan.configs.contains(&c) => Self::push(&mut self.simpler, c),
            Against::Config(_) => {}
            Against::Mixed(p) => Self::push(&mut self.mixed, p),
            Against::Dropping(f) => Self::push(&mut self.dropping, f),
            Against::Microbatched(m) => self.microbatched(m, false),
            Against::RingOrdered(cp, layout) => Self::push(&mut self.ring_ordered, (cp, layout)),
        }
    }

    fn microbatched(&mut self, m: usize, shadow: bool) {
        match self.microbatched.iter_mut().find(|(n, _)| *n == m) {
            Some((_, f64)) => *f64 |= shadow,
            None => self.microbatched.push((m, shadow)),
        }
    }

    /// The runs an arbiter edge of `config` reads.
    fn arbiter(&mut self, plan: &Plan, config: Config, a: Arbiter) {
        self.fp32(plan, config, a.envelope);
        match a.shadow {
            Against::Single => self.single_f64 = true,
            Against::Microbatched(m) => self.microbatched(m, true),
            // A dropping reference always runs with its shadow.
            _ => {}
        }
        match a.spread {
            Spread::None => {}
            Spread::Variants => self.spread = true,
            Spread::VariantsAndSingle => {
                self.spread = true;
                self.single = true;
            }
        }
    }
}

impl Config {
    /// Whether this configuration runs in a cell's reference list (the single-device run
    /// and the DDP variants: run in process or in a fresh launch each, with a repeat when
    /// selected), rather than as a launched configuration.
    pub(super) fn is_reference_family(self) -> bool {
        matches!(
            self,
            Config::Single | Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder
        )
    }
}

impl Plan {
    /// Why reference `against` cannot serve model `model` at `world_size`, if it cannot: a
    /// simpler configuration that does not run the model there, a model with no
    /// mixed-precision reference.
    pub(super) fn reference_blocker(
        &self,
        model: usize,
        world_size: usize,
        against: Against,
    ) -> Option<String> {
        match against {
            Against::Config(c) => c
                .world_blocker(world_size)
                .or_else(|| {
                    self.model_parallel_blockers
                        .get(&(model, world_size, c))
                        .cloned()
                        .flatten()
                })
                .map(|reason| format!("{}: {reason}", c.name())),
            Against::Mixed(_) => self.mixed_blockers[model].clone(),
            _ => None,
        }
    }

    /// Everything model `model`'s rows at `world_size` read beside the runs under test: the
    /// edges of every selected configuration that runs there, to references that can serve
    /// it. A model with no single-device reference runs none of it (its rows against it are
    /// skipped with the model's reason).
    pub(super) fn needs(&self, model: usize, world_size: usize) -> CellNeeds {
        let mut needs = CellNeeds::default();
        for &config in &self.configs {
            if self.blocker(model, world_size, config).is_some() {
                continue;
            }
            for edge in config.edges(world_size) {
                if self
                    .reference_blocker(model, world_size, edge.against)
                    .is_some()
                {
                    continue;
                }
                match edge.judged {
                    Judged::Policy => needs.fp32(self, config, edge.against),
                    Judged::Arbiter(a) => needs.arbiter(self, config, a),
                    Judged::BitwiseUnlessPlanBlocks(a) => {
                        let planned = self.pipeline_plans.get(&(model, world_size, config));
                        match planned {
                            Some(Ok(p)) if p.bitwise_blocker.is_some() => {
                                needs.arbiter(self, config, a)
                            }
                            _ => needs.fp32(self, config, edge.against),
                        }
                    }
                }
            }
        }
        if self.blockers[model].is_some() {
            needs.single = false;
            needs.single_f64 = false;
            needs.spread = false;
            needs.repeats.retain(|&c| c != Config::Single);
        }
        needs
    }
}
