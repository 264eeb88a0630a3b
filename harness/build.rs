fn main() {
    lockstep_linkage::link_libtorch();
}
