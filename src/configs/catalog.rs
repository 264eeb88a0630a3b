//! The configurations the matrix knows: mixed-precision policies and [`Config`] (the FSDP
//! table is `fsdp.rs`, the others' beside it), with how each is judged against its
//! references.

use super::*;
use lockstep_core::compose::Composition;
use lockstep_core::context_parallel::{CpDispatcher, SequenceLayout};

/// A mixed-precision policy the matrix runs: the presets of [`MixedPrecision`] (low-precision
/// compute; fp32 gradient reduction and buffers; BatchNorm in fp32).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Precision {
    /// [`MixedPrecision::bf16`].
    Bf16,
    /// [`MixedPrecision::fp16`].
    Fp16,
}

impl Precision {
    /// Every policy, in row order.
    pub const ALL: [Precision; 2] = [Precision::Bf16, Precision::Fp16];

    /// The policy every rank trains under.
    pub fn policy(self) -> MixedPrecision {
        match self {
            Precision::Bf16 => MixedPrecision::bf16(),
            Precision::Fp16 => MixedPrecision::fp16(),
        }
    }

    /// The policy's label ([`MixedPrecision::label`]): the suffix of configuration names and
    /// the `dtype` of run specs.
    pub fn label(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The half type the policy is meant to compute in, named apart from [`Precision::policy`]
    /// so that the independent mixed-precision reference (`single.bf16`, `single.fp16`)
    /// does not move with a wrong preset.
    pub fn half_type(self) -> HalfType {
        match self {
            Precision::Bf16 => HalfType::Bf16,
            Precision::Fp16 => HalfType::Fp16,
        }
    }

    /// The policy judged against its independent mixed-precision reference
    /// ([`lockstep_core::mixed_reference`]): bitwise, as the reference spells out the CPU
    /// backend's rank-order `Avg`; on NCCL, whose all-reduce adds in its own order, the
    /// dtype table of the compute dtype with [`NCCL_MIXED_REFERENCE_REASON`].
    pub fn reference_policy(
        self,
        config: Config,
        world_size: usize,
        backend: lockstep_core::comm::Backend,
    ) -> Result<TolerancePolicy, String> {
        let bitwise = TolerancePolicy::bitwise(DType::F32);
        if backend != lockstep_core::comm::Backend::Nccl {
            return Ok(bitwise);
        }
        let dtype = match self {
            Precision::Bf16 => DType::BF16,
            Precision::Fp16 => DType::F16,
        };
        let row = config.at(world_size);
        let ov = Override::new(Tolerance::for_dtype(dtype), NCCL_MIXED_REFERENCE_REASON)
            .map_err(|e| format!("{row}: {e}"))?;
        Ok(bitwise.with_override(&row, ov))
    }

    /// The DDP reference configuration under this policy: `ddp.bf16`, `ddp.fp16`.
    pub fn ddp_name(self) -> &'static str {
        match self {
            Precision::Bf16 => "ddp.bf16",
            Precision::Fp16 => "ddp.fp16",
        }
    }
}

/// Why FSDP rows are held to the fp32 table against DDP on NCCL: the override reason in
/// those rows and reports.
pub const NCCL_FSDP_VS_DDP_REASON: &str = "on NCCL, FSDP's reduce-scatter and DDP's all-reduce \
     are different collectives whose ring or tree algorithms may add the ranks' gradients in \
     different orders (the CPU backend adds in rank order in both, which is what makes FSDP \
     bitwise equal to DDP there): judged under the dtype table of the row's compute dtype";

/// Why DDP under a policy is held to the dtype table, not bitwise, against its independent
/// mixed-precision reference on NCCL.
pub const NCCL_MIXED_REFERENCE_REASON: &str = "on NCCL the all-reduce adds the ranks' \
     gradients in its ring or tree order, not the rank order the reference spells out: \
     judged under the dtype table of the compute dtype";

/// `policy` with, on the NCCL backend, FSDP's bitwise rows against DDP turned into the
/// dtype table of the row's compute dtype with [`NCCL_FSDP_VS_DDP_REASON`] recorded.
pub fn with_backend_override(
    policy: Result<TolerancePolicy, String>,
    config: Config,
    reference: Config,
    world_size: usize,
    backend: lockstep_core::comm::Backend,
) -> Result<TolerancePolicy, String> {
    let policy = policy?;
    let row = config.at(world_size);
    let fsdp_vs_ddp = config.is_fsdp() && config.ddp_reference() == Some(reference);
    if backend == lockstep_core::comm::Backend::Nccl
        && fsdp_vs_ddp
        && policy.override_for(&row).is_none()
    {
        // A rounding difference in an fp32 master can flip a low-precision cast later, so
        // mixed-precision rows take their compute dtype's table.
        let dtype = match config.precision() {
            None => DType::F32,
            Some(Precision::Bf16) => DType::BF16,
            Some(Precision::Fp16) => DType::F16,
        };
        let ov = Override::new(Tolerance::for_dtype(dtype), NCCL_FSDP_VS_DDP_REASON)
            .map_err(|e| format!("{row}: {e}"))?;
        return Ok(policy.with_override(&row, ov));
    }
    Ok(policy)
}

/// A parallel configuration the matrix knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Config {
    /// One process, every rank's batch, mean of the per-rank losses.
    Single,
    /// DistributedDataParallel over the CPU backend.
    Ddp,
    /// DDP under a mixed-precision policy: the reference of the FSDP configurations under
    /// the same policy.
    DdpMixed(Precision),
    /// DDP averaging every bucket in hybrid shard's two stages (within shard groups of
    /// `N / HYBRID_REPLICAS` ranks, then across the replicas): the bitwise reference of the
    /// hybrid FSDP configurations ([`HYBRID_VS_DDP_REASON`]). A reference only: not in
    /// [`Config::all`] (no `--configs` pattern selects it, so it never runs a repeat of its
    /// own), but [`Config::by_name`] finds it.
    DdpHybridOrder,
    /// One row of the FSDP table.
    Fsdp(FsdpId),
    /// One row of the pipeline table.
    Pipeline(PipelineId),
    /// One row of the tensor- and expert-parallel table.
    ModelParallel(ModelParallelId),
    /// One row of the compositions table.
    Composed(CompositionId),
}

impl Config {
    /// Every configuration, in the order rows are listed.
    pub fn all() -> Vec<Config> {
        let mut all = vec![Config::Single, Config::Ddp];
        all.extend(Precision::ALL.map(Config::DdpMixed));
        all.extend(Config::fsdp());
        all.extend((0..pipeline_configs().len()).map(|i| Config::Pipeline(PipelineId(i))));
        all.extend(
            (0..model_parallel_configs().len()).map(|i| Config::ModelParallel(ModelParallelId(i))),
        );
        all.extend(
            (0..composition_configs().len())
                .filter(|&i| !composition_configs()[i].reference_only)
                .map(|i| Config::Composed(CompositionId(i))),
        );
        let fixed = composition_configs().len();
        all.extend(
            mesh_rows()
                .iter()
                .enumerate()
                .filter(|(_, r)| !r.reference_only)
                .map(|(i, _)| Config::Composed(CompositionId(fixed + i))),
        );
        all
    }

    /// The FSDP configurations, in row order.
    pub fn fsdp() -> Vec<Config> {
        (0..fsdp_configs().len())
            .map(|i| Config::Fsdp(FsdpId(i)))
            .collect()
    }

    /// The configurations that only ever run as references of others, once, when a
    /// selected configuration needs them (`ddp.hybrid_order`, `tp.2.hybrid_order`): not in
    /// [`Config::all`], so no pattern selects them and they never run a repeat of their own.
    pub fn references_only() -> Vec<Config> {
        let mut out = vec![Config::DdpHybridOrder];
        out.extend(
            (0..composition_configs().len())
                .filter(|&i| composition_configs()[i].reference_only)
                .map(|i| Config::Composed(CompositionId(i))),
        );
        let fixed = composition_configs().len();
        out.extend(
            mesh_rows()
                .iter()
                .enumerate()
                .filter(|(_, r)| r.reference_only)
                .map(|(i, _)| Config::Composed(CompositionId(fixed + i))),
        );
        out
    }

    /// The configuration called `name` exactly, if any (reference-only ones included, so
    /// exec'd ranks and `lockstep run` can run them).
    pub fn by_name(name: &str) -> Option<Config> {
        let found = Config::all()
            .into_iter()
            .chain(Config::references_only())
            .find(|c| c.name() == name);
        // A mesh row's name is its mesh: registered the first time it is named.
        found.or_else(|| mesh_row_by_name(name))
    }

    /// The name patterns and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Config::Single => "single",
            Config::Ddp => "ddp",
            Config::DdpMixed(p) => p.ddp_name(),
            Config::DdpHybridOrder => "ddp.hybrid_order",
            Config::Fsdp(id) => id.get().name,
            Config::Pipeline(id) => id.get().name,
            Config::ModelParallel(id) => id.get().name,
            Config::Composed(id) => id.get().name,
        }
    }

    /// The mixed-precision policy it trains under (`None`: fp32).
    pub fn precision(self) -> Option<Precision> {
        match self {
            Config::Single
            | Config::Ddp
            | Config::DdpHybridOrder
            | Config::Pipeline(_)
            | Config::ModelParallel(_)
            | Config::Composed(_) => None,
            Config::DdpMixed(p) => Some(p),
            Config::Fsdp(id) => id.get().precision,
        }
    }

    /// The DDP configuration an FSDP configuration is compared against (`ddp`, `ddp.bf16`,
    /// ...); `None` for the others.
    pub fn ddp_reference(self) -> Option<Config> {
        self.fsdp_config().map(FsdpConfig::ddp_reference)
    }

    /// Whether this is one of the FSDP configurations.
    pub fn is_fsdp(self) -> bool {
        matches!(self, Config::Fsdp(_))
    }

    /// The tensor- or expert-parallel table row (`None` for the others).
    pub fn model_parallel_config(self) -> Option<&'static ModelParallelConfig> {
        match self {
            Config::ModelParallel(id) => Some(id.get()),
            _ => None,
        }
    }

    /// Whether this is one of the pipeline configurations.
    pub fn is_pipeline(self) -> bool {
        matches!(self, Config::Pipeline(_))
    }

    /// The pipeline table row (`None` for the others).
    pub fn pipeline_config(self) -> Option<&'static PipelineConfig> {
        match self {
            Config::Pipeline(id) => Some(id.get()),
            _ => None,
        }
    }

    /// The FSDP table row (`None` for single and DDP).
    pub fn fsdp_config(self) -> Option<&'static FsdpConfig> {
        match self {
            Config::Fsdp(id) => Some(id.get()),
            Config::Single
            | Config::Ddp
            | Config::DdpMixed(_)
            | Config::DdpHybridOrder
            | Config::Pipeline(_)
            | Config::ModelParallel(_)
            | Config::Composed(_) => None,
        }
    }

    /// The composition table row (`None` for the others).
    pub fn composition_config(self) -> Option<&'static CompositionConfig> {
        match self {
            Config::Composed(id) => Some(id.get()),
            _ => None,
        }
    }

    /// The ring this configuration's attention runs on, as `(cp, layout)`: a context-parallel
    /// row or composition over more than one rank whose keys and values go around a ring
    /// (compositions ring load-balanced). `None` for the rest, the all-gather dispatcher
    /// among them (one softmax over the whole sequence, as `single` computes it).
    pub fn ring_attention(self) -> Option<(usize, SequenceLayout)> {
        let ring = match self {
            Config::ModelParallel(id) => match id.get().kind {
                ModelParallelKind::Context {
                    cp,
                    dispatcher: CpDispatcher::Ring,
                    layout,
                } => Some((cp, layout)),
                _ => None,
            },
            Config::Composed(id) => match id.get().composition {
                Composition::ContextData { cp, .. } | Composition::Pipeline { cp, .. } => {
                    Some((cp, SequenceLayout::Balanced))
                }
                _ => None,
            },
            _ => None,
        };
        ring.filter(|&(cp, _)| cp > 1)
    }

    /// The FSDP options this configuration runs with (`None` for single and DDP).
    pub fn fsdp_options(self) -> Option<FsdpOptions> {
        self.fsdp_config().map(|f| f.options.clone())
    }

    /// One line for `--list`: what runs, and what it is checked against (derived from the
    /// reference policy, so the two cannot disagree).
    pub fn description(self) -> String {
        match self {
            Config::Single => "single-device reference: one process trains on every rank's \
                               batch (the global batch); checked against a repeat of itself, \
                               bitwise"
                .into(),
            Config::Ddp => "DDP on the CPU backend, one forked process per rank; checked \
                            against single (fp64 arbiter) and a fresh repeat of itself \
                            (bitwise)"
                .into(),
            Config::DdpHybridOrder => format!(
                "DDP whose buckets are averaged as hybrid shard averages: within groups of \
                 N/{HYBRID_REPLICAS} ranks, then across the {HYBRID_REPLICAS} replicas; the \
                 reference of the fsdp.hybrid_shard* configs (reference only: runs when one \
                 of them does); checked through them"
            ),
            Config::DdpMixed(p) => format!(
                "DDP under the {label} mixed-precision policy ({label} compute, fp32 reduction \
                 and buffers, BatchNorm in fp32), one forked process per rank: the reference of \
                 the {label} FSDP configs; checked against a fresh repeat of itself (bitwise) \
                 and single.{label}, the independent mixed-precision reference (bitwise); no \
                 row against single (it is the envelope of those configs' rows there)",
                label = p.label()
            ),
            Config::ModelParallel(id) => match id.get().dropping_reference() {
                Some((_, name)) => format!(
                    "{}; checked against {name} (fp64 arbiter)",
                    id.get().description
                ),
                None => format!(
                    "{}; checked against single (fp64 arbiter)",
                    id.get().description
                ),
            },
            Config::Composed(id) if id.get().reference_only => id.get().description.to_owned(),
            Config::Composed(id) => {
                let c = id.get();
                let vs_single = "single (fp64 arbiter)";
                match c.reduces_to {
                    None => format!("{}; checked against {vs_single}", c.description),
                    Some((simpler, DdpCheck::Bitwise)) => format!(
                        "{}; checked against {vs_single} and {simpler} (bitwise)",
                        c.description
                    ),
                    Some((simpler, DdpCheck::DtypeTable { .. })) => format!(
                        "{}; checked against {vs_single} and {simpler} (fp64 arbiter with \
                         {simpler}'s noise as the envelope)",
                        c.description
                    ),
                }
            }
            Config::Pipeline(id) => {
                let p = id.get();
                // A configuration with unequal microbatches says its count itself.
                let count = match p.uneven_microbatches {
                    true => "",
                    false => "; microbatches 2p for p pipeline ranks",
                };
                format!(
                    "{}{count}; checked against single (fp64 arbiter) and single.mbM (one \
                     process, the same M microbatches in order: bitwise unless the plan names \
                     why not, then the fp64 arbiter around single.mbM's own float64 shadow)",
                    p.description
                )
            }
            Config::Fsdp(id) => {
                let f = id.get();
                let reference = f.ddp_reference().name();
                let vs_ddp = match f.vs_ddp {
                    DdpCheck::Bitwise => format!("{reference} (bitwise)"),
                    DdpCheck::DtypeTable { .. } => {
                        format!("{reference} (fp32 dtype table, a recorded tolerance override)")
                    }
                };
                match f.precision {
                    None => format!(
                        "{}; checked against {vs_ddp} and single (fp64 arbiter)",
                        f.description
                    ),
                    Some(_) => format!(
                        "{}; checked against {vs_ddp} and single (fp64 arbiter, with \
                         {reference}'s noise as the envelope)",
                        f.description
                    ),
                }
            }
        }
    }

    /// The row name at a world size (`ddp@4`): unique per world size in the report.
    pub fn at(self, world_size: usize) -> String {
        format!("{}@{world_size}", self.name())
    }

    /// Why this configuration cannot train `model` at `world_size`, if it cannot: the one
    /// check every entry point (the matrix's plan, `ParityTest`, `lockstep run`) makes
    /// before anything is spawned, so an impossible pair is refused with one message. An
    /// FSDP configuration that wraps per layer needs a model with layer hooks (without
    /// them every unit would be gathered before forward: silently not per layer).
    pub fn blocker(self, model: &dyn Model, world_size: usize) -> Option<String> {
        if let Some(reason) = self.world_blocker(world_size) {
            return Some(reason);
        }
        let per_layer = self
            .fsdp_config()
            .is_some_and(|f| matches!(f.options.wrap, WrapPolicy::PerLayer));
        if per_layer && !model.supports_layer_hooks() {
            return Some(format!(
                "{} gathers and frees one layer's unit at a time, which needs layer hooks: \
                 model `{}` does not implement `Model::supports_layer_hooks` and \
                 `Model::forward_hooked`, so every unit would be gathered before forward; \
                 implement them (see examples/user_model.rs) or use a configuration \
                 without `.per_layer`",
                self.name(),
                model.name()
            ));
        }
        if self == Config::Single {
            return model.single_device_reference_blocker();
        }
        if let Some(mp) = self.model_parallel_config() {
            return mp.model_blocker(model, world_size);
        }
        if let Some(p) = self.pipeline_config() {
            return p.plan(model, world_size).err();
        }
        if let Some(c) = self.composition_config() {
            return c.model_blocker(model, world_size);
        }
        None
    }

    /// The one message every entry point refuses this configuration at `world_size` with,
    /// before any model is built (the mesh or the schedule does not fit), or `None`.
    pub fn world_refusal(self, world_size: usize) -> Option<String> {
        self.world_blocker(world_size).map(|reason| {
            format!(
                "{} cannot run at world size {world_size}: {reason}",
                self.name()
            )
        })
    }

    /// The refusal every entry point prints for a pair [`Config::blocker`] rejects.
    pub fn refusal(self, model_name: &str, model: &dyn Model, world_size: usize) -> Option<String> {
        self.blocker(model, world_size).map(|reason| {
            format!(
                "{} cannot run model `{model_name}` at world size {world_size}: {reason}",
                self.name()
            )
        })
    }

    /// The policy this configuration is judged by against `reference` on `backend`: the
    /// catalog's policy with the backend's overrides (NCCL's FSDP-vs-DDP rows), the one
    /// every entry point uses so a pair gets one verdict.
    pub fn policy_on(
        self,
        reference: Config,
        world_size: usize,
        backend: lockstep_core::comm::Backend,
    ) -> Result<TolerancePolicy, String> {
        with_backend_override(
            self.policy(reference, world_size),
            self,
            reference,
            world_size,
            backend,
        )
    }

    /// Why this configuration cannot run at `world_size` (hybrid shard at an odd size), if
    /// it cannot: its rows are skipped with this reason and nothing is launched.
    /// Under an external launch, a world size other than its `WORLD_SIZE` is blocked too.
    pub fn world_blocker(self, world_size: usize) -> Option<String> {
        if let Some(reason) = crate::runner::external::world_blocker(world_size) {
            return Some(reason);
        }
        if let Some(p) = self.pipeline_config() {
            return p.ranks(world_size).err();
        }
        if let Some(m) = self.model_parallel_config() {
            return m.world_blocker(world_size);
        }
        if let Some(c) = self.composition_config() {
            return c.world_blocker(world_size);
        }
        if self == Config::DdpHybridOrder {
            return Config::hybrid_layout().shard_size(world_size).err();
        }
        self.fsdp_config()
            .and_then(|f| f.layout.shard_size(world_size).err())
    }

    /// The layout of the hybrid FSDP configurations, which `ddp.hybrid_order` mirrors.
    pub fn hybrid_layout() -> FsdpLayout {
        FsdpLayout::Hybrid {
            replicas: HYBRID_REPLICAS,
        }
    }

    /// The tolerance policy against `reference` at `world_size`: bitwise against a repeat of
    /// itself or against DDP (unless the FSDP row overrides it, with its reason). Against the
    /// single-device reference the matrix and `ParityTest` judge by the fp64 arbiter instead;
    /// the dtype table of the run's compute dtype is returned for callers that set a policy of
    /// their own. Records hold fp32 masters and fp32 gradients under every policy, so bitwise
    /// is over fp32 values.
    pub fn policy(self, reference: Config, world_size: usize) -> Result<TolerancePolicy, String> {
        match (self, reference) {
            (Config::DdpMixed(_), Config::Single) => Err(format!(
                "{} is not compared with single: {MIXED_VS_SINGLE_REASON}",
                self.name()
            )),
            (_, Config::Single) if self.precision().is_some() => {
                Ok(TolerancePolicy::dtype_table(match self.precision() {
                    Some(Precision::Fp16) => DType::F16,
                    _ => DType::BF16,
                }))
            }
            (Config::Composed(id), simpler) if id.get().simpler() == Some(simpler) => {
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                match id.get().reduces_to.map(|r| r.1) {
                    Some(DdpCheck::DtypeTable { reason }) => {
                        let ov = Override::new(Tolerance::for_dtype(DType::F32), reason)
                            .map_err(|e| format!("{}: {e}", self.name()))?;
                        Ok(bitwise.with_override(&self.at(world_size), ov))
                    }
                    _ => Ok(bitwise),
                }
            }
            (_, Config::Single) if self != Config::Single => {
                Ok(TolerancePolicy::dtype_table(DType::F32))
            }
            (Config::Fsdp(id), Config::Ddp | Config::DdpMixed(_) | Config::DdpHybridOrder) => {
                let bitwise = TolerancePolicy::bitwise(DType::F32);
                match id.get().vs_ddp {
                    DdpCheck::Bitwise => Ok(bitwise),
                    // Only fp32 configurations may override here, so the fp32 row of the
                    // table is the tolerance for every quantity (the NCCL override is added
                    // apart, by `with_backend_override`).
                    DdpCheck::DtypeTable { reason } => {
                        let ov = Override::new(Tolerance::for_dtype(DType::F32), reason)
                            .map_err(|e| format!("{}: {e}", self.name()))?;
                        Ok(bitwise.with_override(&self.at(world_size), ov))
                    }
                }
            }
            _ => Ok(TolerancePolicy::bitwise(DType::F32)),
        }
    }
}
