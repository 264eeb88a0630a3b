//! `lockstep setup`: makes a user's crate build and run parity tests, in one command.
//!
//! A crate that depends on `lockstep` needs two things the dependency cannot give it: the
//! build must find libtorch (`torch-sys` reads `LIBTORCH`), and the test binaries must find
//! `libtorch_cpu.so` when they run. Link arguments do not propagate from a library to its
//! dependents, so the crate links its own binaries with an rpath, from a `build.rs` calling
//! `lockstep_linkage::link_libtorch()` (the helper every crate of this workspace uses).
//! That was chosen over an rpath in `build.rustflags`: rustflags change the fingerprint of
//! every dependency, so `torch-sys` and `tch` would be rebuilt (minutes), and they are
//! dropped silently when `RUSTFLAGS` is set; a build script touches only the user's crate.
//!
//! The command writes (merging with what is there, never removing anything):
//! - `.cargo/config.toml`: `[env] LIBTORCH = "<libtorch>"`;
//! - `build.rs` calling `lockstep_linkage::link_libtorch()` (an existing `build.rs` that does
//!   not call it is left alone and reported: add the call yourself);
//! - `Cargo.toml`, through `cargo add`: `lockstep` and `tch` as dev-dependencies and
//!   `lockstep-linkage` as a build-dependency, unless already there.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the crate, the lockstep checkout and libtorch are.
#[derive(Clone, Debug)]
pub struct SetupOptions {
    /// The user's crate (the directory holding its `Cargo.toml`).
    pub dir: PathBuf,
    /// The lockstep checkout (holding `Cargo.toml` and `ci/linkage`).
    pub lockstep: PathBuf,
    /// libtorch's root (holding `lib/` and `include/`).
    pub libtorch: PathBuf,
    /// Run `cargo add` with `--offline` (the registry cache must hold `tch`).
    pub offline: bool,
}

/// Why the crate could not be set up; nothing half-done is left unreported.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The directory is not a crate.
    #[error("{} has no Cargo.toml: run `lockstep setup` in your crate (or pass --dir)", .0.display())]
    NotACrate(PathBuf),
    /// libtorch is not where it was said to be.
    #[error("no libtorch at {}: expected {}/lib/libtorch_cpu.so; pass --libtorch DIR or set LIBTORCH (the lockstep checkout's ci/setup-libtorch installs one)", .0.display(), .0.display())]
    NoLibtorch(PathBuf),
    /// The lockstep checkout is not where it was said to be.
    #[error("no lockstep checkout at {}: expected its Cargo.toml and ci/linkage; pass --lockstep DIR", .0.display())]
    NoLockstep(PathBuf),
    /// A file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `cargo add` failed.
    #[error("`cargo {}` failed: {message}", args.join(" "))]
    CargoAdd {
        /// Its arguments.
        args: Vec<String>,
        /// Its stderr.
        message: String,
    },
}

/// What `lockstep setup` did, one line per change (empty: everything was in place).
#[derive(Clone, Debug, Default)]
pub struct SetupReport {
    /// Each change made, in words.
    pub changes: Vec<String>,
    /// Things left for the user to do, in words.
    pub todo: Vec<String>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SetupError + '_ {
    move |source| SetupError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The libtorch this binary was built against (its build's `LIBTORCH`), if known.
pub fn built_libtorch() -> Option<PathBuf> {
    option_env!("LOCKSTEP_LIBTORCH_ROOT")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// The lockstep checkout this binary was built from.
pub fn built_checkout() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Sets up the crate in `opts.dir`; see the module documentation.
pub fn setup(opts: &SetupOptions) -> Result<SetupReport, SetupError> {
    let manifest = opts.dir.join("Cargo.toml");
    if !manifest.is_file() {
        return Err(SetupError::NotACrate(opts.dir.clone()));
    }
    // An absolute path is written as given (the same string the workspace built with keeps
    // torch-sys's build fresh); a relative one is resolved.
    let libtorch = if opts.libtorch.is_absolute() {
        opts.libtorch.clone()
    } else {
        opts.libtorch
            .canonicalize()
            .map_err(|_| SetupError::NoLibtorch(opts.libtorch.clone()))?
    };
    if !libtorch.join("lib/libtorch_cpu.so").is_file() {
        return Err(SetupError::NoLibtorch(opts.libtorch.clone()));
    }
    let lockstep = opts
        .lockstep
        .canonicalize()
        .map_err(|_| SetupError::NoLockstep(opts.lockstep.clone()))?;
    if !lockstep.join("ci/linkage/Cargo.toml").is_file() {
        return Err(SetupError::NoLockstep(opts.lockstep.clone()));
    }
    let mut report = SetupReport::default();
    write_config(&opts.dir, &libtorch, &mut report)?;
    write_build_rs(&opts.dir, &mut report)?;
    add_dependencies(opts, &manifest, &lockstep, &mut report)?;
    Ok(report)
}

/// `[env] LIBTORCH = "<libtorch>"` in `.cargo/config.toml`, merged into an existing file.
fn write_config(dir: &Path, libtorch: &Path, report: &mut SetupReport) -> Result<(), SetupError> {
    let cargo_dir = dir.join(".cargo");
    let path = cargo_dir.join("config.toml");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(&path)(e)),
    };
    let line = format!(
        "LIBTORCH = {}",
        toml_string(&libtorch.display().to_string())
    );
    let has_libtorch = text
        .lines()
        .any(|l| l.trim_start().starts_with("LIBTORCH") && l.contains('='));
    if has_libtorch {
        if !text.contains(&line) {
            report.todo.push(format!(
                "{} already sets LIBTORCH; left as it is (this lockstep uses {})",
                path.display(),
                libtorch.display()
            ));
        }
        return Ok(());
    }
    let updated = match text.lines().position(|l| l.trim() == "[env]") {
        Some(i) => {
            let mut lines: Vec<&str> = text.lines().collect();
            lines.insert(i + 1, &line);
            lines.join("\n") + "\n"
        }
        None => {
            let sep = if text.is_empty() || text.ends_with('\n') {
                ""
            } else {
                "\n"
            };
            format!(
                "{text}{sep}# libtorch for tch/torch-sys (written by `lockstep setup`)\n[env]\n{line}\n"
            )
        }
    };
    std::fs::create_dir_all(&cargo_dir).map_err(io(&cargo_dir))?;
    std::fs::write(&path, updated).map_err(io(&path))?;
    report.changes.push(format!(
        "{}: LIBTORCH = {}",
        path.display(),
        libtorch.display()
    ));
    Ok(())
}

/// A `build.rs` that gives the crate's binaries and tests an rpath to libtorch.
fn write_build_rs(dir: &Path, report: &mut SetupReport) -> Result<(), SetupError> {
    let path = dir.join("build.rs");
    match std::fs::read_to_string(&path) {
        Ok(text) if text.contains("link_libtorch") => Ok(()),
        Ok(_) => {
            report.todo.push(format!(
                "{} exists: add `lockstep_linkage::link_libtorch();` to its main (it links \
                 your tests with an rpath to libtorch)",
                path.display()
            ));
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::write(&path, BUILD_RS).map_err(io(&path))?;
            report.changes.push(format!(
                "{}: links binaries and tests with an rpath to libtorch",
                path.display()
            ));
            Ok(())
        }
        Err(e) => Err(io(&path)(e)),
    }
}

const BUILD_RS: &str = "\
//! Links this crate's binaries and tests with an rpath to libtorch (written by `lockstep \
setup`): link arguments do not propagate from the `lockstep` library to its dependents.

fn main() {
    lockstep_linkage::link_libtorch();
}
";

/// `lockstep` and `tch` as dev-dependencies and `lockstep-linkage` as a build-dependency,
/// through `cargo add`, unless the manifest names them already.
fn add_dependencies(
    opts: &SetupOptions,
    manifest: &Path,
    lockstep: &Path,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let text = std::fs::read_to_string(manifest).map_err(io(manifest))?;
    let names = |name: &str| {
        text.lines().any(|l| {
            let l = l.trim_start();
            l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}="))
        })
    };
    let mut adds: Vec<Vec<String>> = Vec::new();
    if !names("lockstep") {
        adds.push(vec![
            "--dev".into(),
            "lockstep".into(),
            "--path".into(),
            lockstep.display().to_string(),
        ]);
    }
    if !names("tch") {
        adds.push(vec!["--dev".into(), format!("tch@{TCH_VERSION}")]);
    }
    if !names("lockstep-linkage") {
        adds.push(vec![
            "--build".into(),
            "lockstep-linkage".into(),
            "--path".into(),
            lockstep.join("ci/linkage").display().to_string(),
        ]);
    }
    for add in adds {
        let mut args = vec!["add".to_owned(), "--manifest-path".into()];
        args.push(manifest.display().to_string());
        if opts.offline {
            args.push("--offline".into());
        }
        args.extend(add);
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let out = Command::new(cargo)
            .args(&args)
            .output()
            .map_err(io(manifest))?;
        if !out.status.success() {
            return Err(SetupError::CargoAdd {
                args,
                message: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            });
        }
        report
            .changes
            .push(format!("{}: cargo {}", manifest.display(), args.join(" ")));
    }
    Ok(())
}

/// The `tch` release the lockstep crate is built with (a user's crate must use the same:
/// its tensors cross the API).
const TCH_VERSION: &str = "0.26";

/// `s` as a TOML basic string.
fn toml_string(s: &str) -> String {
    let escaped: String = s
        .chars()
        .flat_map(|c| match c {
            '"' => vec!['\\', '"'],
            '\\' => vec!['\\', '\\'],
            c => vec![c],
        })
        .collect();
    format!("\"{escaped}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_is_merged_into_an_existing_env_section() {
        let dir = std::env::temp_dir().join(format!("lockstep-setup-{}", std::process::id()));
        let cargo = dir.join(".cargo");
        std::fs::create_dir_all(&cargo).expect("dir");
        std::fs::write(cargo.join("config.toml"), "[env]\nFOO = \"1\"\n").expect("write");
        let mut report = SetupReport::default();
        write_config(&dir, Path::new("/opt/torch"), &mut report).expect("merged");
        let text = std::fs::read_to_string(cargo.join("config.toml")).expect("read");
        assert_eq!(text, "[env]\nLIBTORCH = \"/opt/torch\"\nFOO = \"1\"\n");
        // A second run changes nothing.
        let mut again = SetupReport::default();
        write_config(&dir, Path::new("/opt/torch"), &mut again).expect("merged");
        assert!(again.changes.is_empty() && again.todo.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
