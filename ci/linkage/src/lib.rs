//! Build-script helper shared by every Lockstep crate that produces binaries or tests.
//!
//! Link arguments do not propagate from a library to its dependents, so each crate that
//! links an executable calls [`link_libtorch`] from its own `build.rs`. It gives binaries an
//! rpath to libtorch (nobody has to set `LD_LIBRARY_PATH`) and a constructor that loads
//! `libtorch_cuda` before `main` on machines with an NVIDIA driver (`load_torch_cuda.c`):
//! linked in, the CUDA stack cost every process 0.2 s and 400 MB on machines without a GPU.
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

/// Emits the rpath to libtorch and links the CUDA loader into this crate's binaries and tests.
pub fn link_libtorch() {
    let Some(lib) = libtorch_lib_dir() else {
        println!("cargo:warning=libtorch not found: run ci/setup-libtorch (LIBTORCH is unset)");
        return;
    };
    // Resolve the repository's `.libtorch` link so the rpath survives a moved checkout.
    let lib = lib.canonicalize().unwrap_or(lib);
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    link_cuda_loader();
}

/// Compiles `load_torch_cuda.c` and hands its object file to the linker as an argument: an
/// object named on the command line is always linked (an archive member is linked only when
/// something refers to it, and nothing refers to a constructor).
fn link_cuda_loader() {
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/src/load_torch_cuda.c");
    println!("cargo:rerun-if-changed={source}");
    let objects = cc::Build::new()
        .file(source)
        .warnings(true)
        .cargo_metadata(false)
        .compile_intermediates();
    for object in objects {
        println!("cargo:rustc-link-arg={}", object.display());
    }
    // dlopen lives in libc on glibc 2.34 and later; older ones need libdl.
    println!("cargo:rustc-link-arg=-ldl");
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
