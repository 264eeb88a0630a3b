//! Links lockstep-core's binaries against libtorch and compiles the autograd bridge
//! (`cpp/bridge.cpp`) against the same libtorch that torch-sys uses.

use std::path::PathBuf;

fn main() {
    lockstep_linkage::link_libtorch();
    lockstep_linkage::export_libtorch_version();
    println!("cargo:rerun-if-changed=cpp/bridge.cpp");
    println!("cargo:rerun-if-env-changed=LOCKSTEP_CXX11_ABI");

    let Some(lib) = lockstep_linkage::libtorch_lib_dir() else {
        panic!("libtorch not found: run ci/setup-libtorch (LIBTORCH is unset)");
    };
    let root = lib.join("..");
    let include = root.join("include");
    // torch 2.13's wheels are built with the new C++ ABI, as is torch-sys's own shim.
    let abi = std::env::var("LOCKSTEP_CXX11_ABI").unwrap_or_else(|_| "1".into());

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("cpp/bridge.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false);
    // The bridge only forwards to libtorch's autograd: in a debug build its C++ is compiled
    // unoptimized, which takes a third of the time on the cold build's longest path
    // (docs/design.md, "CI"); release builds optimize it as cc does by default.
    if std::env::var("PROFILE").as_deref() == Ok("debug") {
        build.opt_level(0);
    }

    if std::env::var_os("CARGO_FEATURE_NCCL").is_some() {
        build.define("LOCKSTEP_CUDA", None);
        // The CUDA runtime headers come from the `nvidia-cuda-runtime` wheel installed next to
        // torch; c10's CUDA headers include them.
        for dir in cuda_include_dirs(&root) {
            build.include(dir);
        }
        println!("cargo:rustc-link-lib=c10_cuda");
    }
    build.compile("lockstep_bridge");

    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=torch_cpu");
    println!("cargo:rustc-link-lib=c10");
    println!("cargo:rustc-link-lib=stdc++");
}

/// CUDA runtime header directories: `$CUDA_HOME/include` if set, else the wheel's `nvidia/*`.
fn cuda_include_dirs(torch_root: &std::path::Path) -> Vec<PathBuf> {
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let mut dirs = Vec::new();
    if let Ok(home) = std::env::var("CUDA_HOME") {
        dirs.push(PathBuf::from(home).join("include"));
    }
    let nvidia = torch_root.join("../nvidia");
    for sub in ["cu13", "cuda_runtime"] {
        let dir = nvidia.join(sub).join("include");
        if dir.join("cuda_runtime_api.h").exists() {
            dirs.push(dir);
        }
    }
    // The runtime wheel lacks `crt/host_defines.h` (it ships with nvcc); triton's wheel, a torch
    // dependency, carries the CUDA headers including it. Searched last, only to fill that gap.
    let triton = torch_root.join("../triton/backends/nvidia/include");
    if triton.join("crt/host_defines.h").exists() {
        dirs.push(triton);
    }
    if dirs.is_empty() {
        println!("cargo:warning=CUDA runtime headers not found; the bridge's CUDA stream accessor will not compile");
    }
    dirs
}
