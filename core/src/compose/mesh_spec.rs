//! A device mesh described as data, the way torchtitan's `ParallelDims` takes it:
//! `pp=2,dp_replicate=2,dp_shard=2,cp=2,tp=2` (with `ep` borrowed from the data dimensions),
//! turned into the [`Composition`] that trains it, or refused naming what does not fit.
//!
//! Dimensions left out are 1, except the data dimension: with neither `dp_replicate` nor
//! `dp_shard` given, `dp_shard` takes the rest of the world (torchtitan's `dp_shard = -1`),
//! so the mesh runs at every world size it fits. With either given, the mesh is the whole
//! world: its product is the world size it runs at.
//!
//! The data dimension follows torchtitan: `dp_shard` > 1 (or the rest) shards parameters
//! (FSDP), `dp_replicate` > 1 replicates them (DDP), both is HSDP.

use super::data_parallel::DataParallel;
use super::plan::Composition;
use crate::pipeline::ScheduleKind;
use std::fmt;
use std::str::FromStr;

/// The dimensions a mesh may name, in torchtitan's order (outermost first).
pub const MESH_DIMENSIONS: [&str; 6] = ["pp", "dp_replicate", "dp_shard", "cp", "tp", "ep"];

/// One mesh: the size of every dimension (`None` for a data dimension left to the rest).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MeshSpec {
    /// Pipeline stages.
    pub pp: usize,
    /// Replicas of the data dimension (DDP, or HSDP's replicate dimension).
    pub dp_replicate: usize,
    /// Ranks parameters are sharded over; `None`: the rest of the world.
    pub dp_shard: Option<usize>,
    /// Ranks each sequence is split over (context parallelism).
    pub cp: usize,
    /// Ranks each layer is split over (tensor parallelism).
    pub tp: usize,
    /// Ranks each MoE layer's experts are spread over, borrowed from the data dimensions.
    pub ep: usize,
}

/// Why a mesh description cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MeshError {
    /// The text is not a mesh description.
    #[error("mesh `{text}`: {why}")]
    Syntax {
        /// The description as given.
        text: String,
        /// What is wrong with it.
        why: String,
    },
    /// The mesh does not fit the world size.
    #[error("mesh {mesh}: {why}")]
    World {
        /// The mesh, as its description.
        mesh: String,
        /// What does not fit.
        why: String,
    },
}

impl FromStr for MeshSpec {
    type Err = MeshError;

    /// Parses `name=size` pairs separated by commas, each name one of [`MESH_DIMENSIONS`]
    /// at most once, each size a positive integer.
    fn from_str(text: &str) -> Result<MeshSpec, MeshError> {
        let syntax = |why: String| MeshError::Syntax {
            text: text.to_owned(),
            why,
        };
        let mut sizes: [Option<usize>; 6] = [None; 6];
        for part in text.split(',').map(str::trim) {
            let Some((name, size)) = part.split_once('=') else {
                return Err(syntax(format!(
                    "`{part}` is not `dimension=size` (dimensions: {})",
                    MESH_DIMENSIONS.join(", ")
                )));
            };
            let (name, size) = (name.trim(), size.trim());
            let Some(d) = MESH_DIMENSIONS.iter().position(|n| *n == name) else {
                return Err(syntax(format!(
                    "unknown dimension `{name}` (dimensions: {})",
                    MESH_DIMENSIONS.join(", ")
                )));
            };
            let size: usize = match size.parse() {
                Ok(s) if s > 0 => s,
                _ => {
                    return Err(syntax(format!(
                        "the size of `{name}` must be a positive integer, not `{size}`"
                    )))
                }
            };
            if sizes[d].replace(size).is_some() {
                return Err(syntax(format!("`{name}` is given twice")));
            }
        }
        let [pp, dp_replicate, dp_shard, cp, tp, ep] = sizes;
        Ok(MeshSpec {
            pp: pp.unwrap_or(1),
            dp_replicate: dp_replicate.unwrap_or(1),
            dp_shard: if dp_replicate.is_some() {
                Some(dp_shard.unwrap_or(1))
            } else {
                dp_shard
            },
            cp: cp.unwrap_or(1),
            tp: tp.unwrap_or(1),
            ep: ep.unwrap_or(1),
        })
    }
}

impl fmt::Display for MeshSpec {
    /// The description back, every dimension above 1 (and a given `dp_shard`) in order.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .sizes()
            .into_iter()
            .filter_map(|(name, size)| match (name, size) {
                ("dp_shard", Some(s)) if self.dp_replicate > 1 || s > 1 => {
                    Some(format!("{name}={s}"))
                }
                (_, Some(s)) if s > 1 => Some(format!("{name}={s}")),
                _ => None,
            })
            .collect();
        if parts.is_empty() {
            return f.write_str("dp_shard=1");
        }
        f.write_str(&parts.join(","))
    }
}

impl MeshSpec {
    /// Every dimension with its size, in torchtitan's order (`None`: the rest).
    pub fn sizes(&self) -> [(&'static str, Option<usize>); 6] {
        [
            ("pp", Some(self.pp)),
            ("dp_replicate", Some(self.dp_replicate)),
            ("dp_shard", self.dp_shard),
            ("cp", Some(self.cp)),
            ("tp", Some(self.tp)),
            ("ep", Some(self.ep)),
        ]
    }

    /// The matrix row name: `mesh.` and each dimension above 1 as `pp2`, `dpr2`, `dps2`,
    /// `cp2`, `tp2`, `ep2` (no `=` or `,`, which `--configs` patterns use).
    pub fn row_name(&self) -> String {
        fn short(name: &'static str) -> &'static str {
            match name {
                "dp_replicate" => "dpr",
                "dp_shard" => "dps",
                other => other,
            }
        }
        let mut name = String::from("mesh");
        for (dim, size) in self.sizes() {
            match (dim, size) {
                ("dp_shard", Some(s)) if self.dp_replicate > 1 || s > 1 => {
                    name.push_str(&format!(".dps{s}"))
                }
                (_, Some(s)) if s > 1 => name.push_str(&format!(".{}{s}", short(dim))),
                _ => {}
            }
        }
        if name == "mesh" {
            name.push_str(".dps1");
        }
        name
    }

    /// Parses a row name made by [`MeshSpec::row_name`] back (`None`: not a mesh row).
    pub fn from_row_name(name: &str) -> Option<MeshSpec> {
        let rest = name.strip_prefix("mesh.")?;
        let mut text = Vec::new();
        for part in rest.split('.') {
            let (dim, size) = ["dpr", "dps", "pp", "cp", "tp", "ep"]
                .iter()
                .find_map(|p| part.strip_prefix(p).map(|s| (*p, s)))?;
            let dim = match dim {
                "dpr" => "dp_replicate",
                "dps" => "dp_shard",
                other => other,
            };
            text.push(format!("{dim}={size}"));
        }
        let spec: MeshSpec = text.join(",").parse().ok()?;
        (spec.row_name() == name).then_some(spec)
    }

    /// The product of the dimensions that split the world (`ep` borrows from them), the
    /// data dimension counted only when given.
    pub fn fixed_ranks(&self) -> usize {
        self.pp * self.dp_replicate * self.dp_shard.unwrap_or(1) * self.cp * self.tp
    }

    /// The world size the mesh is (`None`: the data dimension takes the rest, any multiple
    /// of [`MeshSpec::fixed_ranks`]).
    pub fn world(&self) -> Option<usize> {
        self.dp_shard.map(|_| self.fixed_ranks())
    }

    /// Why the mesh cannot run at `world_size` (`None`: it fits), naming the sizes.
    pub fn world_blocker(&self, world_size: usize) -> Option<MeshError> {
        let fixed = self.fixed_ranks();
        let why = match self.world() {
            Some(w) if w != world_size => format!(
                "its dimensions multiply to {w} ranks, not the world size {world_size} (leave \
                 dp_shard and dp_replicate out to let the data dimension take the rest)"
            ),
            None if !world_size.is_multiple_of(fixed) => format!(
                "world size {world_size} does not divide by pp × cp × tp = {fixed}, so \
                 dp_shard cannot take the rest"
            ),
            _ => {
                let data = world_size / (self.pp * self.cp * self.tp);
                if self.ep > 1 && !(data * self.cp).is_multiple_of(self.ep) {
                    format!(
                        "ep={} borrows from the data and context dimensions, whose \
                         {data} × {} ranks do not divide by it",
                        self.ep, self.cp
                    )
                } else {
                    return None;
                }
            }
        };
        Some(MeshError::World {
            mesh: self.to_string(),
            why,
        })
    }

    /// The data dimension: FSDP over `dp_shard` (given or the rest: torchtitan's default),
    /// DDP over `dp_replicate` alone, HSDP over both.
    pub fn data_parallel(&self) -> DataParallel {
        match (self.dp_replicate, self.dp_shard) {
            (1, _) => DataParallel::Shard,
            (_, Some(1)) => DataParallel::Replicate,
            (replicas, _) => DataParallel::HybridShard { replicas },
        }
    }

    /// The composition that trains this mesh at `world_size` ([`MeshSpec::parts`]), or why
    /// it cannot: the mesh does not fit the world.
    pub fn composition(&self, world_size: usize) -> Result<Composition, MeshError> {
        match self.world_blocker(world_size) {
            Some(e) => Err(e),
            None => Ok(self.parts()),
        }
    }

    /// The composition built from the mesh's parts in torchtitan's order (pipeline stages,
    /// then CP and TP inside them, EP borrowed from the data and context dimensions, the data
    /// dimension last), at any world size it fits. Every combination of the six dimensions
    /// is built; what a model cannot take (sizes that do not divide) is refused by the
    /// composition's checks, naming the size.
    pub fn parts(&self) -> Composition {
        let data = self.data_parallel();
        if self.pp > 1 {
            return Composition::Pipeline {
                pp: self.pp,
                tp: self.tp,
                cp: self.cp,
                ep: self.ep,
                data,
                schedule: ScheduleKind::OneFOneB,
                min_data: 1,
                checkpoint_every: None,
            };
        }
        // EP over DDP or FSDP alone keeps its own loop (and its bits); beside cp or tp, and
        // under HSDP, the context-parallel loop trains it (at CP size 1 attention is the
        // plain one).
        if self.ep > 1 && self.cp == 1 && self.tp == 1 && !data.is_hybrid() {
            return Composition::ExpertData { ep: self.ep, data };
        }
        if self.cp > 1 || self.ep > 1 {
            return Composition::ContextData {
                cp: self.cp,
                tp: self.tp,
                ep: self.ep,
                data,
            };
        }
        Composition::TensorData { tp: self.tp, data }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptions_parse_print_and_name_rows_both_ways() {
        let m: MeshSpec = "pp=2,dp_replicate=2,dp_shard=2,cp=2,tp=2".parse().unwrap();
        assert_eq!(m.world(), Some(32));
        assert_eq!(m.to_string(), "pp=2,dp_replicate=2,dp_shard=2,cp=2,tp=2");
        assert_eq!(m.row_name(), "mesh.pp2.dpr2.dps2.cp2.tp2");
        assert_eq!(MeshSpec::from_row_name(&m.row_name()), Some(m));
        let rest: MeshSpec = "cp=2, tp=2".parse().unwrap();
        assert_eq!(rest.world(), None);
        assert_eq!(rest.row_name(), "mesh.cp2.tp2");
        assert_eq!(MeshSpec::from_row_name("mesh.cp2.tp2"), Some(rest));
        assert_eq!(MeshSpec::from_row_name("mesh.cp2.xx2"), None);
        assert_eq!(MeshSpec::from_row_name("fsdp_x_cp2"), None);
    }

    #[test]
    fn bad_descriptions_name_what_is_wrong() {
        let err = |t: &str| t.parse::<MeshSpec>().unwrap_err().to_string();
        assert!(err("cp=2,sp=2").contains("unknown dimension `sp`"));
        assert!(err("cp=0").contains("positive integer, not `0`"));
        assert!(err("cp=2,cp=4").contains("`cp` is given twice"));
        assert!(err("cp2").contains("is not `dimension=size`"));
    }

    #[test]
    fn meshes_that_do_not_fit_the_world_are_refused_naming_the_sizes() {
        let m: MeshSpec = "dp_shard=2,cp=2,tp=2".parse().unwrap();
        let e = m.composition(16).unwrap_err().to_string();
        assert!(
            e.contains("multiply to 8 ranks, not the world size 16"),
            "{e}"
        );
        let rest: MeshSpec = "cp=2,tp=2".parse().unwrap();
        let e = rest.composition(6).unwrap_err().to_string();
        assert!(
            e.contains("world size 6 does not divide by pp × cp × tp = 4"),
            "{e}"
        );
    }

    #[test]
    fn each_mesh_becomes_the_composition_built_from_its_parts() {
        let c = |t: &str, w: usize| t.parse::<MeshSpec>().unwrap().composition(w);
        assert_eq!(
            c("cp=2,tp=2", 8),
            Ok(Composition::ContextData {
                cp: 2,
                tp: 2,
                ep: 1,
                data: DataParallel::Shard
            })
        );
        assert_eq!(
            c("dp_replicate=2,dp_shard=2,tp=2", 8),
            Ok(Composition::TensorData {
                tp: 2,
                data: DataParallel::HybridShard { replicas: 2 }
            })
        );
        assert_eq!(
            c("dp_replicate=2,tp=2", 4),
            Ok(Composition::TensorData {
                tp: 2,
                data: DataParallel::Replicate
            })
        );
        assert_eq!(
            c("pp=2,cp=2,ep=2", 8),
            Ok(Composition::Pipeline {
                pp: 2,
                tp: 1,
                cp: 2,
                ep: 2,
                data: DataParallel::Shard,
                schedule: ScheduleKind::OneFOneB,
                min_data: 1,
                checkpoint_every: None,
            })
        );
        assert_eq!(
            c("dp_replicate=2,dp_shard=2,cp=2", 8),
            Ok(Composition::ContextData {
                cp: 2,
                tp: 1,
                ep: 1,
                data: DataParallel::HybridShard { replicas: 2 }
            })
        );
        assert_eq!(
            c("dp_replicate=2,dp_shard=2,ep=2", 4),
            Ok(Composition::ContextData {
                cp: 1,
                tp: 1,
                ep: 2,
                data: DataParallel::HybridShard { replicas: 2 }
            })
        );
        assert_eq!(
            c("dp_shard=2,ep=2", 2),
            Ok(Composition::ExpertData {
                ep: 2,
                data: DataParallel::Shard
            })
        );
        // ep borrows from dp × cp: 2 × 2 ranks here, so ep=4 fits where dp alone would not.
        assert_eq!(
            c("cp=2,tp=2,ep=4", 16),
            Ok(Composition::ContextData {
                cp: 2,
                tp: 2,
                ep: 4,
                data: DataParallel::Shard
            })
        );
        let e = c("cp=2,ep=3", 4).unwrap_err().to_string();
        assert!(
            e.contains("ep=3 borrows from the data and context dimensions"),
            "{e}"
        );
    }
}
