//! The judging edges: for a configuration at a world size, which references it is measured
//! against and how each verdict is reached. This is the one place that decides it: the
//! matrix makes one row per edge, `ParityTest` asks it how a pair is judged, and `--list`
//! prints it, so a (configuration, reference) pair gets one verdict everywhere.
//!
//! An edge names its reference ([`Against`]) and its judging ([`Judged`]): the pair's
//! tolerance policy ([`Config::policy_on`]: bitwise, or a table with a stated reason), or the
//! fp64 arbiter ([`Arbiter`]: the run's distance to a float64 shadow, within the envelope of
//! a correct fp32 run's distance). Which runs exist, and why a row is skipped on a model, is
//! the caller's: the edges depend on the configuration and the world size only.

use super::ModelParallelConfig;
use super::{dropping_reference_name, microbatched_name, CompositionConfig, Config, Precision};
use lockstep_core::comm::{Backend, DType};
use lockstep_core::context_parallel::{ring_ordered_name, SequenceLayout};
use lockstep_harness::parity::{Mode, TolerancePolicy};

/// A run a configuration is measured against: the row's reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Against {
    /// A fresh launch of the configuration itself: a reference must reproduce its own bits.
    Repeat,
    /// Another catalog configuration's run: `ddp` or a DDP variant reproducing FSDP's
    /// reduction, or the simpler configuration a composition reduces to.
    Config(Config),
    /// One process over the global batch (`single@N`): the mathematical ground truth.
    Single,
    /// The independent mixed-precision reference (`single.bf16@N`), sharing no policy code.
    Mixed(Precision),
    /// One process dropping the same token choices at this capacity factor
    /// (`single.cap<F>@N`).
    Dropping(f64),
    /// One process accumulating the pipeline's microbatches in its order (`single.mbM@N`).
    Microbatched(usize),
    /// One process computing attention in the merge order of a ring over `cp` ranks laid out
    /// as the row lays them (`single.cpN@N`, `single.cpN.contiguous@N`).
    RingOrdered(usize, SequenceLayout),
}

impl Against {
    /// The catalog configuration this reference is the run of (`single`, `ddp.bf16`...), if
    /// it is one.
    pub fn config_name(self) -> Option<&'static str> {
        match self {
            Against::Single => Some(Config::Single.name()),
            Against::Config(c) => Some(c.name()),
            _ => None,
        }
    }

    /// The reference's row name at `world_size` (`single@4`, `ddp.hybrid_order@4`...), for
    /// an edge of `config`.
    pub fn at(self, config: Config, world_size: usize) -> String {
        let name = match self {
            Against::Repeat => config.name().to_owned(),
            Against::Config(c) => c.name().to_owned(),
            Against::Single => Config::Single.name().to_owned(),
            Against::Mixed(p) => p.half_type().reference_name().to_owned(),
            Against::Dropping(f) => dropping_reference_name(f),
            Against::Microbatched(m) => microbatched_name(m),
            Against::RingOrdered(cp, layout) => ring_ordered_name(cp, layout),
        };
        format!("{name}@{world_size}")
    }
}

/// Which other correct fp32 runs widen an arbiter's envelope: the largest distance among
/// them counts as noise too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// None: the envelope run's noise alone (a mixed-precision envelope, a dropping
    /// reference's own pair).
    None,
    /// The single-device reference's fp32 variants and the reference itself, the envelope
    /// run excepted.
    VariantsAndSingle,
    /// The fp32 variants, the one that is the envelope run excepted.
    Variants,
}

/// The fp64 arbiter's inputs, by role.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arbiter {
    /// Whose float64 shadow the distances are measured to.
    pub shadow: Against,
    /// The correct fp32 run whose distance to the shadow is the envelope.
    pub envelope: Against,
    /// The runs that widen the envelope.
    pub spread: Spread,
    /// Where the shadow cannot exist (a model with no single-device reference), judge by the
    /// pair's policy instead of skipping the row.
    pub else_policy: bool,
}

/// How an edge's verdict is reached.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Judged {
    /// Under the pair's tolerance policy: [`Config::policy_on`], or against the independent
    /// mixed-precision reference [`Precision::reference_policy`]; a pipeline against its
    /// microbatched reference is bitwise.
    Policy,
    /// By the fp64 arbiter.
    Arbiter(Arbiter),
    /// A one-replica pipeline against its microbatched reference: bitwise where the
    /// pipeline's plan (built per model) allows, else this arbiter.
    BitwiseUnlessPlanBlocks(Arbiter),
}

/// One judging edge of a configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Edge {
    /// What it is measured against.
    pub against: Against,
    /// How.
    pub judged: Judged,
}

impl Edge {
    fn policy(against: Against) -> Edge {
        Edge {
            against,
            judged: Judged::Policy,
        }
    }

    /// The arbiter around the single-device reference's shadow, with `envelope`'s noise and
    /// the spread.
    fn around_single(against: Against, envelope: Against, spread: Spread) -> Edge {
        Edge {
            against,
            judged: Judged::Arbiter(Arbiter {
                shadow: Against::Single,
                envelope,
                spread,
                else_policy: false,
            }),
        }
    }

    /// How the edge reads in `--list`: its reference and its judging.
    pub fn describe(&self, config: Config, world_size: usize) -> String {
        let how = match self.judged {
            Judged::Policy => {
                let policy = config.edge_policy(self.against, world_size, Backend::Cpu);
                policy_mode(policy.as_ref().ok(), &config.at(world_size)).to_owned()
            }
            Judged::Arbiter(a) => format!(
                "fp64 arbiter, envelope {}{}",
                a.envelope.at(config, world_size),
                match a.envelope {
                    Against::RingOrdered(..) => format!("; not bitwise: {NOT_BITWISE_RING}"),
                    _ => String::new(),
                }
            ),
            Judged::BitwiseUnlessPlanBlocks(_) => {
                "bitwise where the plan allows, else the fp64 arbiter".to_owned()
            }
        };
        format!("{} ({how})", self.against.at(config, world_size))
    }
}

/// Why a ring row cannot be bitwise against `single.cpN`, whose attention is its own block
/// for block: said in `--list` and in docs/context_parallel.md.
pub const NOT_BITWISE_RING: &str = "a CP rank's weight gradients are a GEMM over its own \
    tokens, summed across the ranks afterwards, which no single-device order reproduces";

/// How a row judged under `policy` is labelled: `bitwise` when every value must match bit for
/// bit for `row` (no override with a reason), `tolerance` otherwise (or when the policy could
/// not be built).
pub fn policy_mode(policy: Option<&TolerancePolicy>, row: &str) -> &'static str {
    match policy {
        Some(p) if p.mode() == Mode::Bitwise && p.override_for(row).is_none() => "bitwise",
        _ => "tolerance",
    }
}

impl Config {
    /// The references this configuration is judged against at `world_size`, in row order,
    /// and how each is judged. The references themselves (`single`, the DDP variants) are
    /// judged against a repeat of themselves.
    pub fn edges(self, world_size: usize) -> Vec<Edge> {
        let single = |envelope, spread| Edge::around_single(Against::Single, envelope, spread);
        match self {
            Config::Single | Config::DdpHybridOrder => vec![Edge::policy(Against::Repeat)],
            Config::DdpMixed(p) => vec![
                Edge::policy(Against::Repeat),
                Edge::policy(Against::Mixed(p)),
            ],
            Config::Ddp => vec![
                single(Against::Single, Spread::VariantsAndSingle),
                Edge::policy(Against::Repeat),
            ],
            Config::Fsdp(id) => {
                let ddp = id.get().ddp_reference();
                // Mixed precision is judged around its own DDP reference's noise.
                let vs_single = match self.precision() {
                    None => single(Against::Single, Spread::VariantsAndSingle),
                    Some(_) => single(Against::Config(ddp), Spread::None),
                };
                vec![Edge::policy(Against::Config(ddp)), vs_single]
            }
            Config::ModelParallel(_) | Config::Composed(_) => {
                let mut edges = Vec::new();
                if let Some(simpler) = self
                    .composition_config()
                    .and_then(CompositionConfig::simpler)
                {
                    edges.push(self.edge_to_simpler(simpler, world_size));
                }
                let dropping = self
                    .model_parallel_config()
                    .and_then(ModelParallelConfig::dropping_reference);
                edges.push(match dropping {
                    // Capacity drops tokens: the reference that drops the same ones, with its
                    // own shadow.
                    Some((f, _)) => {
                        let reference = Against::Dropping(f);
                        Edge {
                            against: reference,
                            judged: Judged::Arbiter(Arbiter {
                                shadow: reference,
                                envelope: reference,
                                spread: Spread::None,
                                else_policy: false,
                            }),
                        }
                    }
                    None => single(Against::Single, Spread::VariantsAndSingle),
                });
                edges.extend(self.ring_edge());
                edges
            }
            Config::Pipeline(id) => {
                let mut edges = vec![single(Against::Single, Spread::VariantsAndSingle)];
                let pipeline = id.get();
                // Data-parallel replicas have no microbatched reference.
                if pipeline.data_parallel == 1 {
                    let m = pipeline
                        .ranks(world_size)
                        .map_or(0, |p| pipeline.microbatches(p));
                    let reference = Against::Microbatched(m);
                    edges.push(Edge {
                        against: reference,
                        judged: Judged::BitwiseUnlessPlanBlocks(Arbiter {
                            shadow: reference,
                            envelope: reference,
                            spread: Spread::Variants,
                            else_policy: false,
                        }),
                    });
                }
                edges
            }
        }
    }

    /// A ring row's edge to `single.cpN`, the single device computing attention in the
    /// ring's merge order: the fp64 arbiter around the single-device shadow (the ring order
    /// in float64 is attention's own to rounding), with `single.cpN`'s distance to it as the
    /// envelope ([`NOT_BITWISE_RING`] says why not bitwise).
    fn ring_edge(self) -> Option<Edge> {
        let (cp, layout) = self.ring_attention()?;
        Some(Edge::around_single(
            Against::RingOrdered(cp, layout),
            Against::RingOrdered(cp, layout),
            Spread::Variants,
        ))
    }

    /// The edge to the simpler configuration a composition reduces to: its policy, unless
    /// that overrides bitwise with a reason (equal by the math only up to summation order),
    /// then the arbiter with the simpler configuration's own noise as the envelope.
    fn edge_to_simpler(self, simpler: Config, world_size: usize) -> Edge {
        let against = Against::Config(simpler);
        match self.policy(simpler, world_size) {
            Ok(p) if p.override_for(&self.at(world_size)).is_some() => Edge {
                against,
                judged: Judged::Arbiter(Arbiter {
                    shadow: Against::Single,
                    envelope: against,
                    spread: Spread::VariantsAndSingle,
                    else_policy: true,
                }),
            },
            _ => Edge::policy(against),
        }
    }

    /// This configuration's edge to `against` at `world_size`, if the catalog judges the pair.
    pub fn edge_to(self, against: Against, world_size: usize) -> Option<Edge> {
        self.edges(world_size)
            .into_iter()
            .find(|e| e.against == against)
    }

    /// The tolerance policy of a [`Judged::Policy`] edge to `against` on `backend`.
    pub fn edge_policy(
        self,
        against: Against,
        world_size: usize,
        backend: Backend,
    ) -> Result<TolerancePolicy, String> {
        match against {
            Against::Repeat => self.policy_on(self, world_size, backend),
            Against::Config(c) => self.policy_on(c, world_size, backend),
            Against::Single => self.policy_on(Config::Single, world_size, backend),
            Against::Mixed(p) => p.reference_policy(self, world_size, backend),
            Against::Dropping(_) | Against::Microbatched(_) | Against::RingOrdered(..) => {
                Ok(TolerancePolicy::bitwise(DType::F32))
            }
        }
    }
}
