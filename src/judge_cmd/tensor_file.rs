//! A record whose tensors live beside it: `record.json` names a safetensors file
//! (`"tensor_file"`) and each of its tensors by key (`{"name", "key"}` in place of
//! `{"name", "dtype", "shape", "values"}`), so a recorder writes raw bytes in the tensors'
//! own dtypes instead of float64 JSON text. The values are read back widened to float64,
//! the dtype kept, as the inline form holds them.

use super::JudgeError;
use crate::checkpoint::safetensors;
use lockstep_core::record::NamedTensor;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use tch::Tensor;

/// Replaces every keyed tensor entry of `record` (parameters, buffers, every step's
/// gradients, module outputs and their gradients) by the inline tensor read from the record's tensor file, relative to `dir`.
/// A record without a tensor file is left as it is.
pub fn fill_values(record: &mut Value, dir: &Path) -> Result<(), JudgeError> {
    let Some(name) = record.get("tensor_file").and_then(Value::as_str) else {
        return Ok(());
    };
    let path = dir.join(name);
    let bad = |detail: String| JudgeError::Tensors {
        path: path.clone(),
        detail,
    };
    let file = safetensors::read(&path).map_err(|e| bad(e.to_string()))?;
    let tensors: HashMap<String, Tensor> = file.tensors.into_iter().collect();
    let mut entries: Vec<&mut Value> = Vec::new();
    if let Value::Object(fields) = record {
        for (field, value) in fields.iter_mut() {
            match (field.as_str(), value) {
                ("params" | "buffers" | "activations" | "output_grads", Value::Array(items)) => {
                    entries.extend(items.iter_mut())
                }
                ("grads", Value::Array(steps)) => {
                    for step in steps.iter_mut() {
                        if let Value::Array(items) = step {
                            entries.extend(items.iter_mut());
                        }
                    }
                }
                _ => {}
            }
        }
    }
    for entry in entries {
        let Some(key) = entry.get("key").and_then(Value::as_str) else {
            continue; // an inline tensor
        };
        let tensor = tensors
            .get(key)
            .ok_or_else(|| bad(format!("no tensor `{key}`, which the record names")))?;
        let name = entry.get("name").and_then(Value::as_str).unwrap_or(key);
        let inline =
            NamedTensor::capture(name, tensor).map_err(|e| bad(format!("`{key}`: {e}")))?;
        *entry = serde_json::to_value(inline).map_err(|e| bad(format!("`{key}`: {e}")))?;
    }
    Ok(())
}
