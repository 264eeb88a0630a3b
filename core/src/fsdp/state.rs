//! State dicts and checkpoints, gradient-norm clipping and gradient accumulation without
//! synchronization (`no_sync`) for [`Fsdp`].
//!
//! * **Full state dict** ([`Fsdp::full_state_dict`]): every parameter under its PyTorch name
//!   (tied ones once, under the canonical name), gathered from the shards on **every rank**
//!   (PyTorch's `FULL_STATE_DICT` with `rank0_only=False`), then the buffers. Ignored
//!   (rank-local) parameters are this rank's own. [`Fsdp::save_full`] writes rank 0's as one
//!   safetensors file, readable by `Model::load` too. [`Fsdp::load_full`] loads such a file
//!   into any sharding layout (every rank reads the same file and keeps its slice), including
//!   the ignored parameters: a full checkpoint holds rank 0's experts only, so per-rank
//!   experts survive only a sharded checkpoint.
//! * **Sharded state dict** ([`Fsdp::sharded_state_dict`]): this rank's flat-parameter shards
//!   (`_fsdp_flat_param.<unit>`, padding included), its ignored parameters and the buffers,
//!   with metadata naming which element range of which parameter each shard holds.
//!   [`Fsdp::save_sharded`] writes `rank<r>.safetensors` and `rank<r>.json` (the metadata) per
//!   rank into one directory; [`Fsdp::load_sharded`] reads them back into a wrapper with the
//!   same layout (world size, strategy, units), bitwise.
//! * Loads check everything before changing anything: missing, misshaped or unexpected keys
//!   give [`FsdpError::StateMismatch`] naming them, a different layout
//!   [`FsdpError::ShardLayout`]. Ranks agree (one all-reduce of a failure flag) before any
//!   change, so a failure on one rank leaves every rank unchanged (the others return
//!   [`FsdpError::PeerFailed`]). Files are written to a temporary name and renamed, so a
//!   failed save never destroys an existing checkpoint.
//! * Checkpoint collectives are not training collectives: [`Fsdp::collective_counts`] does
//!   not count them, nor the one all-reduce of [`Fsdp::clip_grad_norm`].

use super::core::{Core, Gather};
use super::unit::Residency;
use super::{FsdpError, ShardingStrategy, FLAT_PARAM_NAME};
use crate::comm::ReduceOp;
use lockstep_models::Misshaped;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Where one parameter sits in its unit's flat parameter, and which part of it this rank's
/// shard holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedParamMeta {
    /// The parameter's PyTorch name.
    pub name: String,
    /// Its full shape.
    pub shape: Vec<i64>,
    /// Offset of its first element in the unit's flat parameter.
    pub flat_offset: i64,
    /// Its number of elements.
    pub numel: i64,
    /// The part in this rank's shard: `(start, end)` in the parameter's flattened elements
    /// and the offset in the shard where `start` sits. `None` if the shard holds none of it.
    pub in_shard: Option<(i64, i64, i64)>,
}

/// One unit's flat parameter and this rank's shard of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedUnitMeta {
    /// The unit (`root` or the wrapped layer).
    pub unit: String,
    /// The state key of this rank's shard (`_fsdp_flat_param.<unit index>`).
    pub key: String,
    /// Elements before padding.
    pub numel: i64,
    /// Elements after padding.
    pub padded: i64,
    /// Offset of this rank's shard in the flat parameter.
    pub shard_offset: i64,
    /// Elements in this rank's shard.
    pub shard_numel: i64,
    /// The parameters in flat order.
    pub params: Vec<ShardedParamMeta>,
}

/// The layout a sharded checkpoint was written with (the `rank<r>.json` file).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardedLayout {
    /// The rank that wrote it.
    pub rank: usize,
    /// Ranks in the group.
    pub world_size: usize,
    /// `FullShard`, `ShardGradOp` or `NoShard`.
    pub strategy: String,
    /// Every unit, in order.
    pub units: Vec<ShardedUnitMeta>,
    /// Ignored (rank-local) parameters, stored under their names.
    pub ignored: Vec<String>,
    /// Buffers, stored under their names.
    pub buffers: Vec<String>,
}

/// This rank's part of the model state: tensors by key, and the layout they belong to.
pub struct ShardedStateDict {
    /// `_fsdp_flat_param.<u>` shards (copies), ignored parameters, buffers.
    pub tensors: Vec<(String, Tensor)>,
    /// Names, offsets and shapes.
    pub layout: ShardedLayout,
}

fn describe(t: &Tensor) -> String {
    format!("{:?} {:?}", t.kind(), t.size())
}

fn checkpoint_err(path: &Path, reason: impl std::fmt::Display) -> FsdpError {
    FsdpError::Checkpoint {
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// Writes `tensors` to `path` through a temporary file renamed into place.
fn write_atomic(path: &Path, tensors: &[(String, Tensor)]) -> Result<(), FsdpError> {
    let tmp = tmp_path(path);
    let out: Vec<(&str, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.as_str(), t.f_to_device(Device::Cpu)?.f_contiguous()?)))
        .collect::<Result<_, FsdpError>>()?;
    Tensor::write_safetensors(&out, &tmp).map_err(|e| checkpoint_err(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| checkpoint_err(path, e))
}

fn tmp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp{}", std::process::id()));
    path.with_file_name(name)
}

fn read(path: &Path) -> Result<HashMap<String, Tensor>, FsdpError> {
    Ok(Tensor::read_safetensors(path)
        .map_err(|e| checkpoint_err(path, e))?
        .into_iter()
        .collect())
}

/// Checks `file` holds exactly `expected` (name, dtype, shape), tied aliases of `canonical`
/// names aside (accepted when equal to the canonical tensor).
fn check_keys(
    path: &Path,
    file: &HashMap<String, Tensor>,
    expected: &[(String, Kind, Vec<i64>)],
    canonical: impl Fn(&str) -> String,
) -> Result<(), FsdpError> {
    let mut missing = Vec::new();
    let mut misshaped = Vec::new();
    for (name, kind, shape) in expected {
        match file.get(name) {
            None => missing.push(name.clone()),
            Some(v) if v.kind() != *kind || &v.size() != shape => misshaped.push(Misshaped {
                name: name.clone(),
                expected: format!("{kind:?} {shape:?}"),
                found: describe(v),
            }),
            Some(_) => {}
        }
    }
    let mut unexpected = Vec::new();
    for (key, v) in file {
        if expected.iter().any(|(n, _, _)| n == key) {
            continue;
        }
        let canon = canonical(key);
        if canon != *key {
            // A PyTorch state dict repeats a tied weight under every name.
            match file.get(&canon) {
                Some(c) if c.size() == v.size() && c.kind() == v.kind() && c.equal(v) => {}
                _ => misshaped.push(Misshaped {
                    name: key.clone(),
                    expected: format!("equal to tied `{canon}`"),
                    found: describe(v),
                }),
            }
            continue;
        }
        unexpected.push(key.clone());
    }
    if missing.is_empty() && misshaped.is_empty() && unexpected.is_empty() {
        return Ok(());
    }
    unexpected.sort();
    Err(FsdpError::StateMismatch {
        path: path.display().to_string(),
        missing,
        misshaped,
        unexpected,
    })
}

impl Core {
    /// Every rank learns whether `local` failed anywhere (one all-reduce); a rank whose own
    /// part succeeded returns [`FsdpError::PeerFailed`] when another's failed.
    fn agree<T>(&self, what: &str, local: Result<T, FsdpError>) -> Result<T, FsdpError> {
        // On the compute device, not a shard's (offloaded shards live on the host): the
        // group reduces tensors where the training computes.
        let flag = Tensor::from_slice(&[f32::from(u8::from(local.is_err()))])
            .f_to_device(self.compute_device)?;
        self.all_reduce_world(&flag, ReduceOp::Max)?;
        let failed = flag.f_double_value(&[0])? > 0.0;
        match local {
            Ok(_) if failed => Err(FsdpError::PeerFailed(what.to_owned())),
            other => other,
        }
    }

    /// Unit `u`'s full flat parameter (padding included), gathered from the shards.
    fn full_flat(&mut self, u: usize) -> Result<Tensor, FsdpError> {
        let local = self.units[u].shard.f_detach()?;
        self.gather(u, &local, Gather::Checkpoint)
    }

    /// Every parameter (PyTorch names, `named_parameters` order, tied ones once; ignored ones
    /// as this rank holds them) then every buffer, as fresh full tensors. Collective: every
    /// rank must call it, and every rank gets the full state (one all-gather per unit).
    pub(super) fn full_state_dict(&mut self) -> Result<Vec<(String, Tensor)>, FsdpError> {
        let _guard = tch::no_grad_guard();
        let mut params: HashMap<String, Tensor> = HashMap::new();
        for u in 0..self.units.len() {
            let full = self.full_flat(u)?;
            for slot in &self.units[u].slots {
                let t = full
                    .f_narrow(0, slot.offset, slot.numel)?
                    .f_view(slot.param.size().as_slice())?
                    .f_detach_copy()?;
                params.insert(slot.name.clone(), t);
            }
        }
        for (name, t) in &self.ignored {
            params.insert(name.clone(), t.f_detach_copy()?);
        }
        let mut out = Vec::with_capacity(self.order.len() + self.buffers.len());
        for name in &self.order {
            if let Some(t) = params.remove(name) {
                out.push((name.clone(), t));
            }
        }
        for (name, b) in &self.buffers {
            out.push((name.clone(), b.f_detach_copy()?));
        }
        Ok(out)
    }

    /// Gathers the full state dict (collective) and writes it on rank 0 to `path`
    /// (safetensors, PyTorch names, the format `Model::save` writes). Every rank returns
    /// once the file is complete, or with an error if writing failed.
    pub(super) fn save_full(&mut self, path: &Path) -> Result<(), FsdpError> {
        let state = self.full_state_dict()?;
        let local = if self.global_rank() == 0 {
            write_atomic(path, &state)
        } else {
            Ok(())
        };
        self.agree("save_full", local)
    }

    /// What a full state dict must hold: (name, dtype, shape) of every parameter and buffer.
    fn full_keys(&self) -> Vec<(String, Kind, Vec<i64>)> {
        let slots = self
            .units
            .iter()
            .flat_map(|u| u.slots.iter().map(|s| (&s.name, &s.param)));
        slots
            .chain(self.ignored.iter().map(|(n, t)| (n, t)))
            .chain(self.buffers.iter().map(|(n, t)| (n, t)))
            .map(|(n, t)| (n.clone(), t.kind(), t.size()))
            .collect()
    }

    /// Loads a full state dict file (from [`Fsdp::save_full`] or `Model::save`) into this
    /// rank's shards, its ignored parameters and the buffers; full parameters currently
    /// gathered are updated too. Collective (one all-reduce to agree): every rank reads the
    /// same file. On any error nothing changes on any rank.
    pub(super) fn load_full(&mut self, path: &Path) -> Result<(), FsdpError> {
        let local = read(path).and_then(|file| {
            let tags = &self.tags;
            check_keys(path, &file, &self.full_keys(), |k| {
                tags.canonical(k).to_owned()
            })?;
            Ok(file)
        });
        let file = self.agree("load_full", local)?;
        let _guard = tch::no_grad_guard();
        let world = self.shard_world as i64;
        let rank = self.shard_rank as i64;
        for unit in &self.units {
            let device = unit.shard.device();
            let flat = unit.flatten(|s| Ok(file[&s.name].f_to_device(device)?))?;
            let size = unit.padded / world;
            unit.shard
                .f_detach()?
                .f_copy_(&flat.f_narrow(0, rank * size, size)?)?;
            if unit.residency == Residency::Unsharded {
                for slot in &unit.slots {
                    slot.param
                        .f_detach()?
                        .f_copy_(&file[&slot.name].f_to_kind(slot.param.kind())?)?;
                }
            }
        }
        for (name, t) in self.ignored.iter().chain(&self.buffers) {
            t.f_detach()?.f_copy_(&file[name])?;
        }
        Ok(())
    }

    /// This rank's layout: units, their shards and which parameter ranges each holds.
    pub(super) fn sharded_layout(&self) -> ShardedLayout {
        let rank = self.shard_rank as i64;
        let units = self
            .units
            .iter()
            .enumerate()
            .map(|(u, unit)| {
                let size = unit.padded / self.shard_world as i64;
                let (lo, hi) = (rank * size, (rank + 1) * size);
                let params = unit
                    .slots
                    .iter()
                    .map(|s| {
                        let start = s.offset.max(lo);
                        let end = (s.offset + s.numel).min(hi);
                        ShardedParamMeta {
                            name: s.name.clone(),
                            shape: s.param.size(),
                            flat_offset: s.offset,
                            numel: s.numel,
                            in_shard: (start < end)
                                .then(|| (start - s.offset, end - s.offset, start - lo)),
                        }
                    })
                    .collect();
                ShardedUnitMeta {
                    unit: unit.name.clone(),
                    key: format!("{FLAT_PARAM_NAME}.{u}"),
                    numel: unit.numel(),
                    padded: unit.padded,
                    shard_offset: lo,
                    shard_numel: size,
                    params,
                }
            })
            .collect();
        ShardedLayout {
            rank: self.global_rank(),
            world_size: self.global_size(),
            strategy: format!("{:?}", self.opts.strategy),
            units,
            ignored: self.ignored_param_names(),
            buffers: self.buffers.iter().map(|(n, _)| n.clone()).collect(),
        }
    }

    /// This rank's shards (copies), ignored parameters and buffers, with their layout. Local:
    /// no collective.
    pub(super) fn sharded_state_dict(&self) -> Result<ShardedStateDict, FsdpError> {
        let _guard = tch::no_grad_guard();
        let mut tensors = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            tensors.push((
                format!("{FLAT_PARAM_NAME}.{u}"),
                unit.shard.f_detach_copy()?,
            ));
        }
        for (name, t) in self.ignored.iter().chain(&self.buffers) {
            tensors.push((name.clone(), t.f_detach_copy()?));
        }
        Ok(ShardedStateDict {
            tensors,
            layout: self.sharded_layout(),
        })
    }

    fn shard_files(&self, dir: &Path) -> (PathBuf, PathBuf) {
        let r = self.global_rank();
        (
            dir.join(format!("rank{r}.safetensors")),
            dir.join(format!("rank{r}.json")),
        )
    }

    /// Writes this rank's sharded state dict into `dir` (created if needed) as
    /// `rank<r>.safetensors` and `rank<r>.json`. Collective (one all-reduce): every rank
    /// returns once every rank's files are complete, or with an error if any rank failed.
    pub(super) fn save_sharded(&self, dir: &Path) -> Result<(), FsdpError> {
        let local = (|| {
            std::fs::create_dir_all(dir).map_err(|e| checkpoint_err(dir, e))?;
            let state = self.sharded_state_dict()?;
            let (tensors, meta) = self.shard_files(dir);
            let json = serde_json::to_string_pretty(&state.layout)
                .map_err(|e| checkpoint_err(&meta, e))?;
            let tmp = tmp_path(&meta);
            std::fs::write(&tmp, json).map_err(|e| checkpoint_err(&tmp, e))?;
            write_atomic(&tensors, &state.tensors)?;
            std::fs::rename(&tmp, &meta).map_err(|e| checkpoint_err(&meta, e))
        })();
        self.agree("save_sharded", local)
    }

    /// Loads this rank's files from a [`Fsdp::save_sharded`] directory into the shards, the
    /// ignored parameters and the buffers, then re-gathers full parameters that are currently
    /// unsharded. The layout must be the one this wrapper has. Collective; on any error
    /// nothing changes on any rank.
    pub(super) fn load_sharded(&mut self, dir: &Path) -> Result<(), FsdpError> {
        let (tensors, meta) = self.shard_files(dir);
        let local = (|| {
            let json = std::fs::read_to_string(&meta).map_err(|e| checkpoint_err(&meta, e))?;
            let saved: ShardedLayout =
                serde_json::from_str(&json).map_err(|e| checkpoint_err(&meta, e))?;
            let ours = self.sharded_layout();
            if saved != ours {
                return Err(FsdpError::ShardLayout {
                    path: meta.display().to_string(),
                    reason: layout_difference(&saved, &ours),
                });
            }
            let file = read(&tensors)?;
            let mut expected: Vec<(String, Kind, Vec<i64>)> = self
                .units
                .iter()
                .enumerate()
                .map(|(u, unit)| {
                    (
                        format!("{FLAT_PARAM_NAME}.{u}"),
                        unit.kind,
                        unit.shard.size(),
                    )
                })
                .collect();
            for (n, t) in self.ignored.iter().chain(&self.buffers) {
                expected.push((n.clone(), t.kind(), t.size()));
            }
            check_keys(&tensors, &file, &expected, str::to_owned)?;
            Ok(file)
        })();
        let file = self.agree("load_sharded", local)?;
        {
            let _guard = tch::no_grad_guard();
            for (u, unit) in self.units.iter().enumerate() {
                unit.shard
                    .f_detach()?
                    .f_copy_(&file[&format!("{FLAT_PARAM_NAME}.{u}")])?;
            }
            for (name, t) in self.ignored.iter().chain(&self.buffers) {
                t.f_detach()?.f_copy_(&file[name])?;
            }
        }
        // Full parameters gathered before the load are stale: gather them again.
        for u in 0..self.units.len() {
            if self.units[u].residency == Residency::Unsharded {
                let kind = self.units[u]
                    .slots
                    .first()
                    .map_or(self.units[u].kind, |s| s.param.kind());
                // Refill from the new shards: drop the stale values' accounting and gather.
                self.release(u);
                self.unshard_unit(u, Gather::Checkpoint, kind)?;
            }
        }
        Ok(())
    }

    /// Clips gradients as `torch.distributed.fsdp.FullyShardedDataParallel.clip_grad_norm_`
    /// (L2): the total norm is `sqrt(Σ_ranks Σ shard grad² + Σ local grad²)`, where the
    /// sharded sum is all-reduced (each element of a flat parameter counted once, so tied
    /// parameters once; padding is zero) and the local sum — ignored (rank-local) parameters,
    /// and `NoShard` flat parameters, already identical on every rank — is added per rank, as
    /// PyTorch does (so with rank-local experts the norm may differ per rank). Every gradient
    /// (shard gradients, ignored parameters', and the model's full record-view `.grad`s) is
    /// multiplied by `max_norm / (total + 1e-6)` when that is below 1. Call after
    /// [`Fsdp::reduce_gradients`] (or the `sync_gradients` hook), before the step. Sums in
    /// f64. Returns the total norm (before clipping). Collective (one all-reduce).
    pub(super) fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64, FsdpError> {
        let _guard = tch::no_grad_guard();
        let sq = |g: &Tensor| -> Result<f64, FsdpError> {
            Ok(g.f_to_kind(Kind::Double)?
                .f_square()?
                .f_sum(Kind::Double)?
                .f_double_value(&[])?)
        };
        let mut sharded = 0.0;
        let mut local = 0.0;
        for unit in &self.units {
            let g = unit.shard.grad();
            if !g.defined() {
                continue;
            }
            if self.opts.strategy == ShardingStrategy::NoShard || self.shard_world == 1 {
                local += sq(&g)?;
            } else {
                sharded += sq(&g)?;
            }
        }
        for (_, t) in &self.ignored {
            let g = t.grad();
            if g.defined() {
                local += sq(&g)?;
            }
        }
        if self.shard_world > 1 {
            // On the compute device (offloaded shards live on the host).
            let t = Tensor::from_slice(&[sharded]).f_to_device(self.compute_device)?;
            self.group.all_reduce(&t, ReduceOp::Sum)?;
            sharded = t.f_double_value(&[0])?;
        }
        let total = (sharded + local).sqrt();
        let coef = crate::train::clip_coefficient(max_norm, total);
        if coef.is_some() {
            let mut grads: Vec<Tensor> = Vec::new();
            for unit in &self.units {
                grads.push(unit.shard.grad());
                grads.extend(unit.slots.iter().map(|s| s.param.grad()));
            }
            grads.extend(self.ignored.iter().map(|(_, t)| t.grad()));
            crate::train::scale_gradients(&grads, coef)?;
        }
        self.last_total_norm = Some(total);
        Ok(total)
    }
}

/// The first difference between two layouts, in words.
fn layout_difference(saved: &ShardedLayout, ours: &ShardedLayout) -> String {
    if saved.world_size != ours.world_size || saved.rank != ours.rank {
        return format!(
            "written by rank {} of {}, loading on rank {} of {}",
            saved.rank, saved.world_size, ours.rank, ours.world_size
        );
    }
    if saved.strategy != ours.strategy {
        return format!(
            "strategy {} here, {} in the file",
            ours.strategy, saved.strategy
        );
    }
    if saved.units.len() != ours.units.len() {
        return format!(
            "{} units here, {} in the file",
            ours.units.len(),
            saved.units.len()
        );
    }
    for (s, o) in saved.units.iter().zip(&ours.units) {
        if s != o {
            return format!(
                "unit `{}` differs from the file's unit `{}`",
                o.unit, s.unit
            );
        }
    }
    if saved.ignored != ours.ignored {
        return format!(
            "ignored parameters {:?} here, {:?} in the file",
            ours.ignored, saved.ignored
        );
    }
    format!(
        "buffers {:?} here, {:?} in the file",
        ours.buffers, saved.buffers
    )
}
