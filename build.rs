//! Links the `lockstep` CLI and its tests against libtorch, and exports the libtorch version
//! the binary was built with (see `lockstep_linkage::export_libtorch_version`).

fn main() {
    lockstep_linkage::link_libtorch();
    lockstep_linkage::export_libtorch_version();
}
