//! Links lockstep-harness's test and example binaries against libtorch (link arguments do
//! not propagate from lockstep-core, so each crate that builds executables repeats this).

fn main() {
    lockstep_linkage::link_libtorch();
}
