//! Where a launch's records are handed back: the scratch file each run's rank 0 writes and
//! its launcher reads (a store key under an external launch, the path an exec'd rank was
//! given), in a folder chosen for speed.

use std::path::{Path, PathBuf};

/// Where the record of a run of `model` at `world_size` is handed back.
pub fn scratch_path(model: &str, world_size: usize) -> PathBuf {
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
    scratch_dir().join(format!(
        "lockstep-run-{}-{safe}-{world_size}-{nonce:x}.cbor",
        std::process::id()
    ))
}

/// Where records are handed back: `LOCKSTEP_SCRATCH_DIR` if set; else `/dev/shm` when it has a
/// GiB free (a matrix hands back hundreds of megabytes of records, each read once: on a disk
/// filesystem, creating, writing and removing those files cost a twentieth of its time); else
/// the temporary directory. Containers often give `/dev/shm` 64 MB, hence the check.
pub fn scratch_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(dir) = std::env::var_os("LOCKSTEP_SCRATCH_DIR") {
            return PathBuf::from(dir);
        }
        let shm = Path::new("/dev/shm");
        if free_bytes(shm).is_some_and(|free| free >= 1 << 30) {
            return shm.to_owned();
        }
        std::env::temp_dir()
    })
    .clone()
}

/// The bytes an unprivileged process may still write under `dir`, if it is a writable
/// directory whose filesystem answers.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a valid C string and `stat` a plain struct statvfs fills.
    unsafe {
        if libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) != 0 {
            return None;
        }
        let mut stat: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c.as_ptr(), &mut stat) != 0 {
            return None;
        }
        Some(stat.f_bavail as u64 * stat.f_frsize as u64)
    }
}
