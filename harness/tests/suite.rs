//! `lockstep-harness`'s integration tests, one test binary of modules (one link against
//! libtorch instead of one per file; docs/design.md, "CI").

mod hand_back;
mod launcher;
mod parity;
