fn main() {
    lockstep_linkage::link_libtorch();
    lockstep_linkage::export_libtorch_version();
}
