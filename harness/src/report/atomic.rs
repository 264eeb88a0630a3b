//! Atomic file replacement: a reader sees the old file, the complete new one, or nothing.

use super::ReportError;
use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` via a temporary file in the same directory: write, fsync,
/// rename over `path`, fsync the directory. On any error the temporary file is removed and
/// `path` is untouched, so a half-written report can never be mistaken for a finished one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ReportError> {
    let io = |source| ReportError::Io {
        path: path.to_owned(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let prefix = format!(
        ".{}.",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    let mut tmp = tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(io)?;
    tmp.write_all(bytes).map_err(io)?;
    // The temporary file is created 0600; a report is for everyone who can read the
    // directory (CI artifact uploaders, other users of the machine), like any file cargo
    // writes under target/.
    {
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file()
            .set_permissions(std::fs::Permissions::from_mode(0o644))
            .map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    tmp.persist(path).map_err(|e| io(e.error))?;
    // Make the rename itself durable. Opening a directory for fsync is not possible on every
    // platform; the file is complete either way, so failure here is not an error.
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::write_atomic;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn reports_are_readable_by_everyone() {
        let dir = tempfile::tempdir().expect("scratch dir");
        let path = dir.path().join("report.json");
        write_atomic(&path, b"{}").expect("written");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o644, "{mode:o}");
    }
}
