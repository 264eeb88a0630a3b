//! Where a run's record is handed back: a temporary file named for the run, the file an
//! exec'd rank was told, or under an external launch a store key named alike on every rank.

use std::path::PathBuf;

/// Where the record of a run of `model` at `world_size` is handed back.
pub(super) fn scratch_path(model: &str, world_size: usize) -> PathBuf {
    // An exec'd rank writes where its launcher reads, whichever launch it computes this for.
    if let Some(path) = super::self_exec::record_path() {
        return path;
    }
    let safe: String = model
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    // Under an external launch the "file" is a store key, named alike on every rank.
    if let Some(path) = super::external::scratch_path(&format!("{safe}-{world_size}")) {
        return path;
    }
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    std::env::temp_dir().join(format!(
        "lockstep-run-{}-{safe}-{world_size}-{nonce:x}.json",
        std::process::id()
    ))
}
