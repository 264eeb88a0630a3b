//! Build-script helper shared by every Lockstep crate that produces binaries or tests.
//!
//! Link arguments do not propagate from a library to its dependents, so each crate that
//! links an executable calls [`link_libtorch`] from its own `build.rs`. It gives binaries an
//! rpath to libtorch (nobody has to set `LD_LIBRARY_PATH`) and forces `libtorch_cuda` into the
//! binary with `--no-as-needed` (otherwise `--as-needed` drops it and CUDA is never found).
#![warn(missing_docs)]

use std::path::PathBuf;

/// Where libtorch's shared libraries live, as the build sees it.
///
/// Reads `DEP_TCH_LIBTORCH_LIB` (set for direct dependents of `torch-sys`) and falls back to
/// `$LIBTORCH/lib`, which `.cargo/config.toml` points at the repository's `.libtorch` link.
pub fn libtorch_lib_dir() -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        return Some(PathBuf::from(dir));
    }
    std::env::var("LIBTORCH")
        .ok()
        .map(|root| PathBuf::from(root).join("lib"))
}

/// Emits the rpath and `--no-as-needed` link arguments for this crate's binaries and tests.
pub fn link_libtorch() {
    let Some(lib) = libtorch_lib_dir() else {
        println!("cargo:warning=libtorch not found: run ci/setup-libtorch (LIBTORCH is unset)");
        return;
    };
    // Resolve the repository's `.libtorch` link so the rpath survives a moved checkout.
    let lib = lib.canonicalize().unwrap_or(lib);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// Exposes the linked libtorch's version to the crate as `env!("LOCKSTEP_LIBTORCH_VERSION")`
/// (read from the wheel's `version.py`; `unknown` when it cannot be found).
pub fn export_libtorch_version() {
    let version = libtorch_lib_dir()
        .and_then(|lib| std::fs::read_to_string(lib.join("../version.py")).ok())
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("__version__ = "))
                .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=LOCKSTEP_LIBTORCH_VERSION={version}");
}
