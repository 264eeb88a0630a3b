//! The compositions of the matrix (names with `_x_`: `fsdp_x_tp2`, `pp2_x_tp2_x_dp`...), as a
//! table like [`fsdp_configs`]. Each row is a [`Composition`] on a named mesh whose data
//! dimension takes the rest of the world, and is judged twice: against `single@N` (the fp64
//! arbiter, as every row against single), and
//! against the simpler configuration it reduces to where there is one — bit for bit where
//! the math allows (FSDP's reduce-scatter yields DDP's all-reduce elements), else the fp32
//! table through a recorded override.

use super::*;
use lockstep_core::compose::{check_composition, Composition, DataParallel, MeshSpec};
use lockstep_core::pipeline::ScheduleKind;
use std::sync::Mutex;

/// Why HSDP×TP's reference is `tp.2.hybrid_order`, not `tp.2`: printed by `--list`.
pub const HSDP_VS_DDP_REASON: &str = "HSDP averages each gradient (and the loss) within its \
     shard group and then across replicas, where tp.2 averages over all data ranks at once: \
     the same mean with another rounding. Its reference is tp.2.hybrid_order, tp.2 averaging \
     in HSDP's two stages on the same mesh, and against it HSDP×TP is bitwise";

/// One composition of the matrix.
#[derive(Clone, Debug)]
pub struct CompositionConfig {
    /// The name `--configs` patterns match (`fsdp_x_tp2`).
    pub name: &'static str,
    /// One line for `lockstep matrix --list`.
    pub description: &'static str,
    /// What runs.
    pub composition: Composition,
    /// The simpler configuration it reduces to, and how it is judged against it.
    pub reduces_to: Option<(&'static str, DdpCheck)>,
    /// Runs only as another composition's simpler configuration: not in [`Config::all`], so
    /// no pattern selects it and it has no rows of its own.
    pub reference_only: bool,
    /// The user's mesh this row was made from (`lockstep matrix --mesh`), whose sizes the
    /// world must fit; `None` for the catalog's own rows.
    pub mesh: Option<MeshSpec>,
}

impl CompositionConfig {
    /// Why this composition cannot run at `world_size` (the mesh does not fit), if it cannot.
    pub fn world_blocker(&self, world_size: usize) -> Option<String> {
        if let Some(e) = self.mesh.and_then(|m| m.world_blocker(world_size)) {
            return Some(e.to_string());
        }
        self.composition
            .mesh(world_size)
            .err()
            .map(|e| e.to_string())
    }

    /// Why it cannot run `model` at `world_size`, checked before anything is launched.
    pub fn model_blocker(&self, model: &dyn Model, world_size: usize) -> Option<String> {
        if let Some(reason) = model.single_device_reference_blocker() {
            return Some(format!("no single-device reference: {reason}"));
        }
        check_composition(model, world_size, self.composition)
            .err()
            .map(|e| e.to_string())
    }

    /// The configuration it reduces to (`None`: it is checked against single only).
    pub fn simpler(&self) -> Option<Config> {
        self.reduces_to.and_then(|(name, _)| Config::by_name(name))
    }

    /// Whether a pipeline runs (its mesh has a `pp` dimension).
    pub fn is_pipeline(&self) -> bool {
        matches!(self.composition, Composition::Pipeline { .. })
    }
}

/// Every composition, in row order.
pub fn composition_configs() -> &'static [CompositionConfig] {
    static TABLE: LazyLock<Vec<CompositionConfig>> = LazyLock::new(|| {
        let mut rows = tensor_data_rows();
        rows.extend(pipeline_rows());
        rows.extend(expert_data_rows());
        rows.extend(context_data_rows());
        rows
    });
    &TABLE
}

/// A 2-stage 1F1B pipeline composition with `tp`-way stages and the data dimension `data`.
fn one_f_one_b(tp: usize, data: DataParallel, min_data: usize) -> Composition {
    Composition::Pipeline {
        pp: 2,
        tp,
        cp: 1,
        ep: 1,
        data,
        schedule: ScheduleKind::OneFOneB,
        min_data,
        checkpoint_every: None,
    }
}

/// Tensor parallel over 2 ranks under FSDP or HSDP, and HSDP×TP's reference.
fn tensor_data_rows() -> Vec<CompositionConfig> {
    vec![
        CompositionConfig {
            name: "fsdp_x_tp2",
            description: "FSDP×TP on [dp, tp=2]: tensor parallel over 2 ranks, then the \
                          TP-local parameters one FSDP unit sharded over dp = N/2 (gathered \
                          before forward, gradients reduce-scattered)",
            composition: Composition::TensorData {
                tp: 2,
                data: DataParallel::Shard,
            },
            reduces_to: Some(("tp.2", DdpCheck::Bitwise)),
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "hsdp_x_tp2",
            description: "HSDP×TP on [dp_replicate=2, dp_shard, tp=2]: TP over 2 ranks, \
                          sharded within dp_shard = N/4, replicated across 2 (world 4 and up)",
            composition: Composition::TensorData {
                tp: 2,
                data: DataParallel::HybridShard { replicas: 2 },
            },
            reduces_to: Some(("tp.2.hybrid_order", DdpCheck::Bitwise)),
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "tp.2.hybrid_order",
            description: "tp.2 on [dp_replicate=2, dp_shard, tp=2] with every parameter \
                          replicated over the data dimension, gradients and losses averaged \
                          within dp_shard, then across the 2 replicas (HSDP's order): the \
                          bitwise reference of hsdp_x_tp2 (reference only: runs when it \
                          does)",
            composition: Composition::TensorData {
                tp: 2,
                data: DataParallel::HybridReplicate { replicas: 2 },
            },
            reduces_to: None,
            reference_only: true,
            mesh: None,
        },
    ]
}

/// A 2-stage 1F1B pipeline replicated, tensor parallel or sharded over the data dimension.
fn pipeline_rows() -> Vec<CompositionConfig> {
    vec![
        CompositionConfig {
            name: "pp2_x_dp",
            description: "PP×DP on [dp, pp=2]: a 2-stage 1F1B pipeline replicated over \
                          dp = N/2 ≥ 2, gradients all-reduced",
            composition: one_f_one_b(1, DataParallel::Replicate, 2),
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_tp2",
            description: "PP×TP on [dp, pp=2, tp=2]: a 2-stage 1F1B pipeline whose stages \
                          are tensor parallel over 2 ranks (vocabulary-parallel loss on the \
                          last), replicated over the rest (world 4 and up)",
            composition: one_f_one_b(2, DataParallel::Replicate, 1),
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_tp2_x_dp",
            description: "PP×TP×DP on [dp, pp=2, tp=2] with dp = N/4 ≥ 2 (world 8 and up)",
            composition: one_f_one_b(2, DataParallel::Replicate, 2),
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_fsdp",
            description: "PP×FSDP on [dp, pp=2]: each stage's parameters one unit sharded \
                          over dp = N/2 ≥ 2, driven by the schedule's UNSHARD before the \
                          first forward, REDUCE_GRAD and RESHARD after the last backward",
            composition: one_f_one_b(1, DataParallel::Shard, 2),
            reduces_to: Some(("pp2_x_dp", DdpCheck::Bitwise)),
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_tp2_x_fsdp.ac",
            description: "torchtitan's whole order on [dp, pp=2, tp=2], dp = N/4 ≥ 2 (world 8 \
                          and up): 2-stage 1F1B stages tensor parallel over 2 ranks, \
                          activations recomputed every layer in backward, each stage's \
                          TP-local parameters one FSDP unit over dp",
            composition: Composition::Pipeline {
                pp: 2,
                tp: 2,
                cp: 1,
                ep: 1,
                data: DataParallel::Shard,
                schedule: ScheduleKind::OneFOneB,
                min_data: 2,
                checkpoint_every: Some(1),
            },
            reduces_to: Some(("pp2_x_tp2_x_dp", DdpCheck::Bitwise)),
            reference_only: false,
            mesh: None,
        },
    ]
}

/// Expert parallel over 2 ranks with the dense parameters sharded.
fn expert_data_rows() -> Vec<CompositionConfig> {
    vec![CompositionConfig {
        name: "ep2_x_fsdp",
        description: "EP×FSDP on [edp, ep=2]: gpt_moe's experts spread over 2 ranks, \
                          the dense parameters one FSDP unit sharded over every rank",
        composition: Composition::ExpertData {
            ep: 2,
            data: DataParallel::Shard,
        },
        reduces_to: Some(("ep.2", DdpCheck::Bitwise)),
        reference_only: false,
        mesh: None,
    }]
}

/// Context parallel over 2 ranks with the parameters sharded over `dp × cp`, with TP inside,
/// and inside a pipeline's stages.
fn context_data_rows() -> Vec<CompositionConfig> {
    vec![
        CompositionConfig {
            name: "cp2_x_tp2",
            description: "CP×TP on [dp, cp=2, tp=2]: cp.2 with each sequence shard split by \
                          the model's TP plan (loss parallel, scaled to the shard's share), \
                          replicated over the rest (world 4 and up): torchtitan#3280's shape",
            composition: Composition::ContextData {
                cp: 2,
                tp: 2,
                ep: 1,
                data: DataParallel::Replicate,
            },
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_cp2",
            description: "PP×CP on [dp, pp=2, cp=2]: a 2-stage 1F1B pipeline whose stages are \
                          computed by 2 CP ranks each (every microbatch cut along the \
                          sequence, ring attention inside the stage, activations sent \
                          shard to shard), replicated over the rest (world 4 and up)",
            composition: Composition::Pipeline {
                pp: 2,
                tp: 1,
                cp: 2,
                ep: 1,
                data: DataParallel::Replicate,
                schedule: ScheduleKind::OneFOneB,
                min_data: 1,
                checkpoint_every: None,
            },
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "pp2_x_ep2",
            description: "PP×EP on [dp, pp=2], ep=2 borrowed from each stage's data group: a \
                          2-stage 1F1B pipeline whose stages' experts are spread over 2 \
                          replicas, tokens dispatched inside the stage, expert gradients \
                          summed over their holders and divided by dp (world 4 and up; \
                          models with experts)",
            composition: Composition::Pipeline {
                pp: 2,
                tp: 1,
                cp: 1,
                ep: 2,
                data: DataParallel::Replicate,
                schedule: ScheduleKind::OneFOneB,
                min_data: 2,
                checkpoint_every: None,
            },
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "cp2_x_ep2",
            description: "CP×EP on [dp, cp=2], ep=2 borrowed from dp × cp: cp.2 with each \
                          mixture's experts spread over 2 ranks, every sequence shard's \
                          tokens dispatched to them, expert gradients summed over their \
                          holders and divided by dp (world 2 and up; models with experts)",
            composition: Composition::ContextData {
                cp: 2,
                tp: 1,
                ep: 2,
                data: DataParallel::Replicate,
            },
            reduces_to: None,
            reference_only: false,
            mesh: None,
        },
        CompositionConfig {
            name: "fsdp_x_cp2",
            description: "FSDP×CP on [dp, cp=2]: cp.2 (ring attention, load-balanced), every \
                      parameter one FSDP unit sharded over dp × cp (every rank), as \
                      torchtitan shards over dp_shard × cp; gradients scaled by cp and \
                      reduce-scattered",
            composition: Composition::ContextData {
                cp: 2,
                tp: 1,
                ep: 1,
                data: DataParallel::Shard,
            },
            reduces_to: Some(("cp.2", DdpCheck::Bitwise)),
            reference_only: false,
            mesh: None,
        },
    ]
}

/// Rows made from users' mesh descriptions, in the order they were first named. Each is
/// leaked once (a process names a handful), so [`CompositionId::get`] hands out `'static`
/// rows like the catalog's.
static MESH_ROWS: Mutex<Vec<&'static CompositionConfig>> = Mutex::new(Vec::new());

/// The rows made from mesh descriptions so far.
pub(super) fn mesh_rows() -> Vec<&'static CompositionConfig> {
    MESH_ROWS.lock().map(|r| r.clone()).unwrap_or_default()
}

/// The suffix of a mesh row's replicated twin (`mesh.dps2.cp2.ddp`).
const REPLICATED_TWIN: &str = ".ddp";

/// The same composition with its sharded data dimension replicated (FSDP → DDP, HSDP → DDP
/// averaged in HSDP's two stages): bitwise equal to it, since the shards' reduce-scatter
/// yields the all-reduce's elements. `None` where the data dimension is not sharded.
fn replicated_twin(c: Composition) -> Option<Composition> {
    let replicated = |data: DataParallel| match data {
        DataParallel::Shard => Some(DataParallel::Replicate),
        DataParallel::HybridShard { replicas } => Some(DataParallel::HybridReplicate { replicas }),
        _ => None,
    };
    match c {
        Composition::TensorData { tp, data } => Some(Composition::TensorData {
            tp,
            data: replicated(data)?,
        }),
        // CP, pipelines and EP have no hybrid-order replication: FSDP only.
        Composition::ContextData {
            cp,
            tp,
            ep,
            data: DataParallel::Shard,
        } => Some(Composition::ContextData {
            cp,
            tp,
            ep,
            data: DataParallel::Replicate,
        }),
        Composition::Pipeline {
            data: DataParallel::Shard,
            pp,
            tp,
            cp,
            ep,
            schedule,
            min_data,
            checkpoint_every,
        } => Some(Composition::Pipeline {
            data: DataParallel::Replicate,
            pp,
            tp,
            cp,
            ep,
            schedule,
            min_data,
            checkpoint_every,
        }),
        Composition::ExpertData {
            ep,
            data: DataParallel::Shard,
        } => Some(Composition::ExpertData {
            ep,
            data: DataParallel::Replicate,
        }),
        _ => None,
    }
}

/// The matrix row of the user's `mesh` (`mesh.cp2.tp2`...), made and registered the first
/// time it is named, so `--configs`, `lockstep run` and exec'd ranks find it by name. A mesh
/// whose data dimension is sharded gets its replicated twin too (`<row>.ddp`, reference
/// only), and is judged against it bit for bit as well as against single. Whether the mesh
/// fits a world and a model is each run's check.
pub fn mesh_config(mesh: &MeshSpec) -> Config {
    let composition = mesh.parts();
    let name = mesh.row_name();
    if let Some(config) = mesh_row_named(&name) {
        return config;
    }
    let world = match mesh.world() {
        Some(w) => format!("{w} ranks"),
        None => "dp_shard the rest of the world".to_owned(),
    };
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let twin = replicated_twin(composition).map(|twin| CompositionConfig {
        name: leak(format!("{name}{REPLICATED_TWIN}")),
        description: leak(format!(
            "the mesh {mesh} with its data dimension replicated instead of sharded: the \
             bitwise reference of {name} (reference only: runs when it does)"
        )),
        composition: twin,
        reduces_to: None,
        reference_only: true,
        mesh: Some(*mesh),
    });
    let row = CompositionConfig {
        name: leak(name),
        description: leak(format!(
            "the mesh {mesh} ({world}), trained as {composition:?}"
        )),
        composition,
        reduces_to: twin.as_ref().map(|t| (t.name, DdpCheck::Bitwise)),
        reference_only: false,
        mesh: Some(*mesh),
    };
    let mut rows = MESH_ROWS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(twin) = twin {
        rows.push(Box::leak(Box::new(twin)));
    }
    rows.push(Box::leak(Box::new(row)));
    Config::Composed(CompositionId(composition_configs().len() + rows.len() - 1))
}

/// The registered mesh row (or replicated twin) called `name`, if any.
fn mesh_row_named(name: &str) -> Option<Config> {
    let rows = MESH_ROWS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let i = rows.iter().position(|r| r.name == name)?;
    Some(Config::Composed(CompositionId(
        composition_configs().len() + i,
    )))
}

/// The mesh row or replicated twin called `name`, registered from the mesh its name spells
/// when first named (`None`: not a mesh row's name, or a twin the mesh does not have).
pub(super) fn mesh_row_by_name(name: &str) -> Option<Config> {
    let mesh = name.strip_suffix(REPLICATED_TWIN).unwrap_or(name);
    mesh_config(&MeshSpec::from_row_name(mesh)?);
    mesh_row_named(name)
}

/// Registers the mesh rows among `names` (a `--configs` list: `mesh.pp2.cp2`...), so patterns
/// over [`Config::all`] find them; other names are left alone.
pub fn register_mesh_rows(names: &[String]) {
    for name in names {
        // A name that spells no mesh is not registered; the selection then names it as
        // unknown, listing the known rows.
        let _ = mesh_row_by_name(name);
    }
}

/// Which composition: an index into [`composition_configs`], then into the mesh rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CompositionId(pub(super) usize);

impl CompositionId {
    /// The composition's table row.
    pub fn get(self) -> &'static CompositionConfig {
        let table = composition_configs();
        match table.get(self.0) {
            Some(row) => row,
            None => mesh_rows()[self.0 - table.len()],
        }
    }
}
