//! Checkpoints under PyTorch's names, so Lockstep's state and a PyTorch twin's `state_dict()`
//! are interchangeable (docs/checkpoints.md).
//!
//! A **model state file** is a safetensors file holding the full state dict: every parameter
//! and buffer under its PyTorch module path, tied weights under every name that shares them
//! (as `state_dict()` lists them), so `model.load_state_dict(tensors)` takes it as it is. Its
//! header metadata records the model, the steps trained, and (for a file `lockstep run
//! --save-final` wrote from a run that could export it) the name of an **optimizer state
//! file** next to it: SGD's momentum buffers under `<parameter>.momentum_buffer` plus the
//! step, seed, world size, configuration and optimizer settings a continued run needs to
//! step exactly as an uninterrupted one.

pub mod safetensors;

use lockstep_core::record::{NamedTensor, RunRecord};
use lockstep_core::train::{OptimizerConfig, MOMENTUM_SUFFIX};
use lockstep_models::{Model, ModelError, ParamTags};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::Tensor;

/// Metadata key: the zoo model a state file was written from.
pub const MODEL_KEY: &str = "lockstep.model";
/// Metadata key: the training steps behind a state file's values (0 for an initial state).
pub const STEP_KEY: &str = "lockstep.step";
/// Metadata key: the optimizer state file (a name in the same directory) a run continues
/// with; absent when the state file carries no optimizer state.
pub const OPTIMIZER_FILE_KEY: &str = "lockstep.optimizer_state";
/// Metadata key of an optimizer state file: the run seed (batches derive from it).
pub const SEED_KEY: &str = "lockstep.seed";
/// Metadata key of an optimizer state file: the world size (the global batch's ranks).
pub const WORLD_SIZE_KEY: &str = "lockstep.world_size";
/// Metadata key of an optimizer state file: the configuration that wrote it.
pub const CONFIG_KEY: &str = "lockstep.config";
/// Metadata key of an optimizer state file: the optimizer and its settings (JSON).
pub const OPTIMIZER_KEY: &str = "lockstep.optimizer";

/// Everything reading, checking or writing a checkpoint can fail with; each names the file
/// and, for a state that does not fit, every offending key.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file could not be read or written.
    #[error("{what} {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// What was being done, e.g. `reading`, leading the message.
        what: &'static str,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// Not a well-formed safetensors file (truncated, bad header, bad metadata).
    #[error("{path}: not a usable safetensors file: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The state does not fit the model (missing, unexpected, misshaped or mistyped keys).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An optimizer state file does not fit the model's parameters.
    #[error(
        "{path}: optimizer state does not match model `{model}`: missing [{}]; misshaped [{}]; \
         unexpected [{}]",
        missing.join(", "),
        misshaped.join("; "),
        unexpected.join(", ")
    )]
    OptimizerMismatch {
        /// The optimizer state file.
        path: String,
        /// The model's zoo name.
        model: String,
        /// State keys the model's parameters need but the file lacks.
        missing: Vec<String>,
        /// Keys whose shape or dtype differs, each already described (`key: expected ..., found ...`).
        misshaped: Vec<String>,
        /// The file's keys no parameter has.
        unexpected: Vec<String>,
    },
    /// A tensor operation failed while converting values.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// Encoding a header failed.
    #[error("encoding a safetensors header: {0}")]
    Json(#[from] serde_json::Error),
}

/// What a model state file's metadata says about it (all absent in a file PyTorch wrote).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateInfo {
    /// The zoo model it was written from.
    pub model: Option<String>,
    /// Training steps behind its values.
    pub step: Option<usize>,
    /// Its optimizer state file, resolved against the state file's directory.
    pub optimizer_file: Option<PathBuf>,
}

/// Checks `path` (format, then every key against `model`) and loads it into `model` in
/// place; on any error `model` is unchanged and the error names each bad key.
pub fn load_model_state(model: &mut dyn Model, path: &Path) -> Result<StateInfo, CheckpointError> {
    let file = safetensors::read(path)?;
    model.load(path)?;
    let shown = path.display().to_string();
    let step = match file.metadata.get(STEP_KEY) {
        None => None,
        Some(s) => Some(s.parse().map_err(|_| CheckpointError::Malformed {
            path: shown.clone(),
            reason: format!("metadata {STEP_KEY} = `{s}` is not a step count"),
        })?),
    };
    let optimizer_file = file
        .metadata
        .get(OPTIMIZER_FILE_KEY)
        .map(|name| path.parent().unwrap_or_else(|| Path::new(".")).join(name));
    Ok(StateInfo {
        model: file.metadata.get(MODEL_KEY).cloned(),
        step,
        optimizer_file,
    })
}

/// `model`'s full state dict now: parameters, buffers, and every alias of a tied parameter
/// (a copy of it, right after it), as PyTorch's `state_dict()` lists them.
pub fn model_state_dict(model: &dyn Model) -> Vec<(String, Tensor)> {
    let tensors = model
        .named_parameters()
        .into_iter()
        .chain(model.named_buffers())
        .collect();
    with_aliases(tensors, &model.tags())
}

/// The final full state dict a run recorded (rank 0's parameters and buffers), with the
/// aliases `tags` names, as tensors of their recorded dtypes.
pub fn record_state_dict(
    record: &RunRecord,
    tags: &ParamTags,
) -> Result<Vec<(String, Tensor)>, CheckpointError> {
    let tensors = record
        .params
        .iter()
        .chain(&record.buffers)
        .map(|n| Ok((n.name.clone(), tensor_of(n)?)))
        .collect::<Result<Vec<_>, CheckpointError>>()?;
    Ok(with_aliases(tensors, tags))
}

/// A recorded tensor back in its own dtype (exact: records widen losslessly to f64).
fn tensor_of(n: &NamedTensor) -> Result<Tensor, CheckpointError> {
    Ok(Tensor::f_from_slice(&n.values)?
        .f_to_kind(n.dtype.kind())?
        .f_reshape(&n.shape)?)
}

fn with_aliases(tensors: Vec<(String, Tensor)>, tags: &ParamTags) -> Vec<(String, Tensor)> {
    let mut out = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let aliases: Vec<String> = tags
            .shared
            .iter()
            .filter(|g| g.canonical == name)
            .flat_map(|g| g.aliases.iter().cloned())
            .collect();
        out.push((name, t.shallow_clone()));
        out.extend(aliases.into_iter().map(|alias| (alias, t.shallow_clone())));
    }
    out
}

/// Writes a model state file (atomically) with its metadata: the model, the steps behind it
/// and, when a run can continue from it, its optimizer state file's name.
pub fn save_model_state(
    path: &Path,
    tensors: &[(String, Tensor)],
    model: &str,
    step: usize,
    optimizer_file: Option<&str>,
) -> Result<(), CheckpointError> {
    let mut metadata = BTreeMap::new();
    // What `safetensors.torch.save_file` records: tools read it as "PyTorch tensors".
    metadata.insert("format".to_owned(), "pt".to_owned());
    metadata.insert(MODEL_KEY.to_owned(), model.to_owned());
    metadata.insert(STEP_KEY.to_owned(), step.to_string());
    if let Some(name) = optimizer_file {
        metadata.insert(OPTIMIZER_FILE_KEY.to_owned(), name.to_owned());
    }
    safetensors::write_atomic(path, tensors, &metadata)
}

/// Where a continued run picks up: the optimizer's state and what the run that saved it was.
#[derive(Debug)]
pub struct OptimizerState {
    /// Steps trained before it (the continued run's first step index).
    pub step: usize,
    /// The run seed (batches derive from it).
    pub seed: u64,
    /// The world size (how many ranks' batches form a step's global batch).
    pub world_size: usize,
    /// The configuration that saved it.
    pub config: String,
    /// The optimizer and its settings.
    pub optimizer: OptimizerConfig,
    /// The optimizer's state tensors ([`lockstep_core::train::Optimizer::state`]).
    pub tensors: Vec<(String, Tensor)>,
}

/// The optimizer state file's name for model state file `path`: `final.safetensors` gets
/// `final.optim.safetensors`, next to it.
pub fn optimizer_file_for(path: &Path) -> PathBuf {
    let stem = path
        .file_stem()
        .map_or_else(|| "checkpoint".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}.optim.safetensors"))
}

/// Writes an optimizer state file (atomically).
pub fn save_optimizer_state(path: &Path, state: &OptimizerState) -> Result<(), CheckpointError> {
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_owned(), "pt".to_owned());
    metadata.insert(STEP_KEY.to_owned(), state.step.to_string());
    metadata.insert(SEED_KEY.to_owned(), state.seed.to_string());
    metadata.insert(WORLD_SIZE_KEY.to_owned(), state.world_size.to_string());
    metadata.insert(CONFIG_KEY.to_owned(), state.config.clone());
    metadata.insert(
        OPTIMIZER_KEY.to_owned(),
        serde_json::to_string(&state.optimizer)?,
    );
    safetensors::write_atomic(path, &state.tensors, &metadata)
}

/// Reads optimizer state file `path` and checks it against `model`'s parameters: with SGD
/// momentum, exactly one `<parameter>.momentum_buffer` of the parameter's shape and dtype per
/// parameter (none before the first step or without momentum).
pub fn load_optimizer_state(
    path: &Path,
    model: &dyn Model,
) -> Result<OptimizerState, CheckpointError> {
    let file = safetensors::read(path)?;
    let shown = path.display().to_string();
    let meta = |key: &str| -> Result<&String, CheckpointError> {
        file.metadata
            .get(key)
            .ok_or_else(|| CheckpointError::Malformed {
                path: shown.clone(),
                reason: format!("metadata {key} is missing (not a Lockstep optimizer state file?)"),
            })
    };
    let number = |key: &str| -> Result<u64, CheckpointError> {
        let text = meta(key)?;
        text.parse().map_err(|_| CheckpointError::Malformed {
            path: shown.clone(),
            reason: format!("metadata {key} = `{text}` is not a number"),
        })
    };
    let step = number(STEP_KEY)? as usize;
    let seed = number(SEED_KEY)?;
    let world_size = number(WORLD_SIZE_KEY)? as usize;
    let config = meta(CONFIG_KEY)?.clone();
    let optimizer: OptimizerConfig =
        serde_json::from_str(meta(OPTIMIZER_KEY)?).map_err(|e| CheckpointError::Malformed {
            path: shown.clone(),
            reason: format!("metadata {OPTIMIZER_KEY}: {e}"),
        })?;
    let OptimizerConfig::Sgd { momentum, .. } = optimizer else {
        return Err(CheckpointError::Malformed {
            path: shown,
            reason: "only SGD optimizer state can be continued".into(),
        });
    };
    let params: HashMap<String, Tensor> = model.named_parameters().into_iter().collect();
    let mut expected: BTreeMap<String, &Tensor> = BTreeMap::new();
    if momentum != 0.0 && step > 0 {
        for (name, t) in &params {
            expected.insert(format!("{name}{MOMENTUM_SUFFIX}"), t);
        }
    }
    let mut misshaped = Vec::new();
    let mut unexpected = Vec::new();
    for (key, t) in &file.tensors {
        match expected.remove(key) {
            None => unexpected.push(key.clone()),
            Some(p) if p.size() != t.size() || p.kind() != t.kind() => misshaped.push(format!(
                "{key}: expected {:?} {:?}, found {:?} {:?}",
                p.kind(),
                p.size(),
                t.kind(),
                t.size()
            )),
            Some(_) => {}
        }
    }
    let missing: Vec<String> = expected.into_keys().collect();
    if !missing.is_empty() || !misshaped.is_empty() || !unexpected.is_empty() {
        unexpected.sort();
        return Err(CheckpointError::OptimizerMismatch {
            path: shown,
            model: model.name().to_owned(),
            missing,
            misshaped,
            unexpected,
        });
    }
    Ok(OptimizerState {
        step,
        seed,
        world_size,
        config,
        optimizer,
        tensors: file.tensors,
    })
}
