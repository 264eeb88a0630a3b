//! What the suite's tests share across their processes: nextest runs every test in a process
//! of its own, so anything costly that several tests need (a Python that imported torch) is
//! kept outside them, named by everything it depends on and made under a file lock, so it is
//! made once per run and never used stale.

use crate::common::{digest, torch_version, FileLock};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// The source of the Python helpers a torch server runs: part of its name, so an edited
/// helper gets a server of its own.
const SERVER_SOURCE: &str = include_str!("support/torch_server.py");
const JOB_SOURCE: &str = include_str!("support/forked_job.py");

/// How long a torch server outlives its last job: long enough to carry it across a suite's
/// tests, short enough not to linger after.
const SERVER_IDLE_SECONDS: u64 = 30;

/// How long a client waits for a new server to import torch.
const SERVER_START: Duration = Duration::from_secs(180);

/// Runs a PyTorch job's `phases` (as `tests/support/forked_job.py` takes them: ranks forked
/// with torchrun's environment, in order) in a child of a Python that imported torch and
/// `preload` once, shared by every test of the run (`tests/support/torch_server.py`), from
/// the repository root with this process's environment and `path` ahead on `sys.path`.
/// `python` and `site` are what `common::python_with_torch` found. Its output is the job's
/// as a process would have given it.
pub fn torch_job(
    python: &str,
    site: &Option<PathBuf>,
    path: &[&Path],
    preload: &[&str],
    phases: &serde_json::Value,
    port: u16,
) -> Result<Output> {
    let mut conn = torch_server(python, site, path, preload)?;
    let scratch = tempfile::tempdir()?;
    let (stdout, stderr) = (scratch.path().join("stdout"), scratch.path().join("stderr"));
    let mut env: std::collections::BTreeMap<String, String> = std::env::vars().collect();
    // What a process the job starts (torch.compile's workers) needs to import torch.
    if let Some(python_path) = python_path(site, path)? {
        env.insert("PYTHONPATH".into(), python_path);
    }
    let request = serde_json::json!({
        "cwd": env!("CARGO_MANIFEST_DIR"),
        "env": env,
        "port": port,
        "phases": phases,
        "stdout": stdout,
        "stderr": stderr,
    });
    conn.write_all(format!("{request}\n").as_bytes())?;
    let mut reply = String::new();
    BufReader::new(&conn)
        .read_line(&mut reply)
        .context("read the torch server's reply")?;
    let status = serde_json::from_str::<serde_json::Value>(&reply)
        .ok()
        .and_then(|v| v["status"].as_i64())
        .with_context(|| format!("the torch server's reply {reply:?}"))?;
    Ok(Output {
        // A wait status: the exit code in the second byte.
        status: std::process::ExitStatus::from_raw(((status & 0xff) as i32) << 8),
        stdout: std::fs::read(&stdout).unwrap_or_default(),
        stderr: std::fs::read(&stderr).unwrap_or_default(),
    })
}

/// A connection to the running torch server for this interpreter, path and preload list,
/// started (under a file lock, so by one test only) when none is running. A server exits only
/// after 30 s without a connection, so the one returned is served.
fn torch_server(
    python: &str,
    site: &Option<PathBuf>,
    path: &[&Path],
    preload: &[&str],
) -> Result<UnixStream> {
    // What a server's imports depend on, beyond the interpreter and its path: the variables
    // torch reads when it is imported or first computes.
    let import_env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| {
            [
                "ATEN_", "OMP_", "MKL_", "TORCH_", "PYTORCH_", "CUDA_", "PYTHON",
            ]
            .iter()
            .any(|p| k.starts_with(p))
        })
        .collect();
    let key = digest(&[
        python.to_owned(),
        format!("{site:?}"),
        format!("{path:?}"),
        format!("{preload:?}"),
        format!("{import_env:?}"),
        format!("{:?}", torch_version(site)),
        SERVER_SOURCE.to_owned(),
        JOB_SOURCE.to_owned(),
    ]);
    // Unix socket paths are short (108 bytes): the system temp dir, not target/.
    let base = std::env::temp_dir().join(format!("lockstep-torch-{key}"));
    let socket = base.with_extension("sock");
    if let Ok(conn) = UnixStream::connect(&socket) {
        return Ok(conn);
    }
    let lock = base.with_extension("lock");
    let _lock = FileLock::take(&lock).with_context(|| format!("lock {}", lock.display()))?;
    if let Ok(conn) = UnixStream::connect(&socket) {
        return Ok(conn);
    }
    // A server that died without removing its socket leaves a file nobody listens on.
    let _ = std::fs::remove_file(&socket);
    let log = base.with_extension("log");
    let spec = serde_json::json!({"preload": preload, "idle_seconds": SERVER_IDLE_SECONDS});
    let server = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/torch_server.py");
    let mut cmd = crate::common::torch_python(python, site);
    if let Some(python_path) = python_path(site, path)? {
        cmd.env("PYTHONPATH", python_path);
    }
    let log_file = std::fs::File::create(&log)?;
    let mut child = cmd
        .arg(&server)
        .arg(&socket)
        .arg(spec.to_string())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(log_file.try_clone()?)
        .stderr(log_file)
        // A group of its own: it outlives this test, and nextest stops a test's group.
        .process_group(0)
        .spawn()
        .context("start the torch server")?;
    let start = Instant::now();
    loop {
        if let Ok(conn) = UnixStream::connect(&socket) {
            return Ok(conn);
        }
        if let Some(status) = child.try_wait()? {
            bail!(
                "the torch server exited ({status}) before listening:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        if start.elapsed() > SERVER_START {
            let _ = child.kill();
            bail!(
                "the torch server did not listen within {SERVER_START:?}:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `PYTHONPATH` for a job: `path`, then torch's `site`.
fn python_path(site: &Option<PathBuf>, path: &[&Path]) -> Result<Option<String>> {
    let mut entries: Vec<PathBuf> = path.iter().map(|p| p.to_path_buf()).collect();
    entries.extend(site.iter().cloned());
    if entries.is_empty() {
        return Ok(None);
    }
    let joined = std::env::join_paths(entries)?;
    Ok(Some(joined.into_string().map_err(|p| {
        anyhow::anyhow!("PYTHONPATH {p:?} is not UTF-8")
    })?))
}

/// Where the suite keeps what it shares across test processes: under cargo's own scratch
/// folder for integration tests (`target/tmp`), so `cargo clean` removes it.
fn fixture_root() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("fixtures")
}

/// A folder `build` fills once and every test after reads: `kind-key` under the suite's
/// fixture root, where `key` names every input of what `build` makes (a digest of them, so a
/// changed input is another folder and nothing is used stale). Built under a file lock into a
/// scratch folder and renamed into place whole, so a test killed mid-build leaves nothing a
/// later one would read. `build` says `false` when it could not make the fixture here (no
/// Python with torch): then `None`, and nothing is kept.
pub fn cached_dir(
    kind: &str,
    key: &str,
    build: impl FnOnce(&Path) -> Result<bool>,
) -> Result<Option<PathBuf>> {
    let root = fixture_root();
    std::fs::create_dir_all(&root)?;
    let dir = root.join(format!("{kind}-{key}"));
    if dir.is_dir() {
        return Ok(Some(dir));
    }
    let lock = root.join(format!("{kind}-{key}.lock"));
    let _lock = FileLock::take(&lock).with_context(|| format!("lock {}", lock.display()))?;
    if dir.is_dir() {
        return Ok(Some(dir));
    }
    let partial = root.join(format!("{kind}-{key}.partial"));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(&partial)?;
    if !build(&partial)? {
        let _ = std::fs::remove_dir_all(&partial);
        return Ok(None);
    }
    std::fs::rename(&partial, &dir)
        .with_context(|| format!("keep the fixture {}", dir.display()))?;
    Ok(Some(dir))
}

/// Copies the tree `from` into `to` (created if missing): a test's own copy of a shared
/// fixture, free to write beside it.
pub fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}

/// The text of every file under `dir` with one of `extensions`, in path order: a digest input
/// standing for a whole folder of sources.
pub fn sources(dir: &Path, extensions: &[&str]) -> Vec<(PathBuf, String)> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .is_some_and(|x| extensions.iter().any(|e| x == *e))
            {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                files.push((path, text));
            }
        }
    }
    files.sort();
    files
}
