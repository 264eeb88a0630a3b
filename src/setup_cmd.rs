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
//!
//! And so that the dependencies build once, not twice (the CLI's build in the checkout, then
//! the crate's: `torch-sys`, `tch` and Lockstep itself take most of a first hour on 2 cores),
//! it makes the crate's build of them the checkout's, artifact for artifact:
//! - `.cargo/config.toml`: `[build] target-dir` = the checkout's `target/`;
//! - `Cargo.toml`: the checkout's `[profile.*]` sections, with Lockstep's own crates at the
//!   opt-level they have as workspace members (`[profile.dev.package."*"]` would otherwise
//!   apply to them), unless the crate has a profile of its own (then it says so);
//! - `Cargo.lock`: the checkout's, when the crate has none yet, so versions match.

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
    share_target_dir(&opts.dir, &lockstep, &mut report)?;
    write_build_rs(&opts.dir, &mut report)?;
    copy_lock_file(&opts.dir, &lockstep, &mut report)?;
    add_profiles(&manifest, &lockstep, &mut report)?;
    add_dependencies(opts, &manifest, &lockstep, &mut report)?;
    Ok(report)
}

/// `[build] target-dir` = the checkout's `target/` in `.cargo/config.toml` (after
/// [`write_config`]), unless a target directory is set already.
fn share_target_dir(
    dir: &Path,
    lockstep: &Path,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let path = dir.join(".cargo/config.toml");
    let text = std::fs::read_to_string(&path).map_err(io(&path))?;
    if text
        .lines()
        .any(|l| l.trim_start().starts_with("target-dir"))
    {
        return Ok(());
    }
    let target = lockstep.join("target");
    let line = format!(
        "target-dir = {}",
        toml_string(&target.display().to_string())
    );
    let updated = match text.lines().position(|l| l.trim() == "[build]") {
        Some(i) => {
            let mut lines: Vec<&str> = text.lines().collect();
            lines.insert(i + 1, &line);
            lines.join("\n") + "\n"
        }
        None => format!(
            "{text}# Lockstep's checkout builds its dependencies once for both (`lockstep setup`)\n\
             [build]\n{line}\n"
        ),
    };
    std::fs::write(&path, updated).map_err(io(&path))?;
    report.changes.push(format!(
        "{}: target-dir = {} (the dependencies are built once, shared with the checkout)",
        path.display(),
        target.display()
    ));
    Ok(())
}

/// The checkout's `Cargo.lock` for a crate without one: the same versions, so the same
/// artifacts.
fn copy_lock_file(dir: &Path, lockstep: &Path, report: &mut SetupReport) -> Result<(), SetupError> {
    let path = dir.join("Cargo.lock");
    if path.exists() {
        return Ok(());
    }
    let theirs = lockstep.join("Cargo.lock");
    std::fs::copy(&theirs, &path).map_err(io(&theirs))?;
    report.changes.push(format!(
        "{}: the checkout's, so versions match",
        path.display()
    ));
    Ok(())
}

/// Lockstep's crates: workspace members in the checkout, path dependencies of the user's
/// crate.
const MEMBERS: [&str; 5] = [
    "lockstep",
    "lockstep-core",
    "lockstep-harness",
    "lockstep-models",
    "lockstep-linkage",
];

/// The checkout's profile sections appended to the crate's manifest (with Lockstep's crates
/// at their member opt-level), unless the manifest has a profile already.
fn add_profiles(
    manifest: &Path,
    lockstep: &Path,
    report: &mut SetupReport,
) -> Result<(), SetupError> {
    let text = std::fs::read_to_string(manifest).map_err(io(manifest))?;
    if text.lines().any(|l| l.trim_start().starts_with("[profile")) {
        report.todo.push(format!(
            "{} has a [profile] of its own: left as it is; the dependencies build again \
             unless it matches the checkout's (see its Cargo.toml)",
            manifest.display()
        ));
        return Ok(());
    }
    let theirs_path = lockstep.join("Cargo.toml");
    let theirs = std::fs::read_to_string(&theirs_path).map_err(io(&theirs_path))?;
    let profiles = profile_sections(&theirs);
    let member_level = member_opt_level(&profiles);
    let mut added = String::from(
        "\n# The lockstep checkout's profile (written by `lockstep setup`): its build of the\n\
         # dependencies is reused as is.\n",
    );
    added.push_str(&profiles);
    if let Some(level) = member_level {
        for member in MEMBERS {
            added.push_str(&format!(
                "\n[profile.dev.package.{member}]\nopt-level = {level}\n"
            ));
        }
    }
    let sep = if text.ends_with('\n') { "" } else { "\n" };
    std::fs::write(manifest, format!("{text}{sep}{added}")).map_err(io(manifest))?;
    report.changes.push(format!(
        "{}: the checkout's [profile] sections",
        manifest.display()
    ));
    Ok(())
}

/// Every `[profile...]` section of a manifest, verbatim.
fn profile_sections(manifest: &str) -> String {
    let mut out = String::new();
    let mut inside = false;
    for line in manifest.lines() {
        let t = line.trim_start();
        if t.starts_with('[') {
            inside = t.starts_with("[profile");
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The `opt-level` of `[profile.dev]` in `profiles` (what workspace members build at).
fn member_opt_level(profiles: &str) -> Option<String> {
    let mut in_dev = false;
    for line in profiles.lines() {
        let t = line.trim();
        if t.starts_with('[') {
            in_dev = t == "[profile.dev]";
        } else if in_dev {
            if let Some(v) = t.strip_prefix("opt-level") {
                return Some(v.trim_start_matches([' ', '=']).trim().to_owned());
            }
        }
    }
    None
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

    #[test]
    fn the_checkouts_profile_is_copied_with_the_member_opt_level() {
        let manifest = "[package]\nname = \"x\"\n\n[profile.dev]\nopt-level = 1\n\n\
                        [profile.dev.package.\"*\"]\nopt-level = 2\n\n[[example]]\nname = \"e\"\n";
        let profiles = profile_sections(manifest);
        assert_eq!(
            profiles,
            "[profile.dev]\nopt-level = 1\n\n[profile.dev.package.\"*\"]\nopt-level = 2\n\n"
        );
        assert_eq!(member_opt_level(&profiles).as_deref(), Some("1"));
    }
}
