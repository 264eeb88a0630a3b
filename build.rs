//! Links the `lockstep` CLI and its tests against libtorch, and exports the libtorch version
//! the binary was built with (see `lockstep_linkage::export_libtorch_version`).

fn main() {
    lockstep_linkage::link_libtorch();
    lockstep_linkage::export_libtorch_version();
    // `lockstep setup` points a user's crate at the libtorch this binary was built with.
    let root = lockstep_linkage::libtorch_lib_dir()
        .and_then(|lib| lib.canonicalize().ok())
        .and_then(|lib| lib.parent().map(std::path::Path::to_path_buf));
    if let Some(root) = root {
        println!("cargo:rustc-env=LOCKSTEP_LIBTORCH_ROOT={}", root.display());
    }
}
