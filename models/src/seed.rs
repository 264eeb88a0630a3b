//! Seeds shared by every run: the same seed gives the same parameters and the same per-rank
//! batches, whichever parallel configuration consumes them.
//!
//! libtorch's generator is process-global, so every seeded draw goes through [`seeded`], which
//! holds a lock: two models built on two threads (as `cargo test` does) never interleave
//! their draws.

use std::sync::{Mutex, MutexGuard, PoisonError};

static RNG_LOCK: Mutex<()> = Mutex::new(());

/// The seed of rank `rank`'s data in a run seeded with `run_seed`, following PyTorch's FSDP
/// tests (rank data seeded `1 + rank` for run seed 0).
pub fn data_seed(run_seed: u64, rank: usize) -> u64 {
    run_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(1 + rank as u64)
}

/// The seed of rank `rank`'s batch at step `step`: step 0 is [`data_seed`] (PyTorch's tests
/// draw their single batch from it), later steps move to fresh, non-overlapping streams so
/// every step sees new data.
pub fn batch_seed(run_seed: u64, rank: usize, step: usize) -> u64 {
    data_seed(run_seed, rank).wrapping_add((step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// The seed of the parameters every rank shares (PyTorch's tests use 0 for run seed 0).
pub fn param_seed(run_seed: u64) -> u64 {
    run_seed
}

/// The seed of rank `rank`'s own (per-rank) parameters, e.g. `MixtureOfExperts`' expert,
/// which PyTorch seeds `42 + rank`.
pub fn rank_param_seed(run_seed: u64, rank: usize) -> u64 {
    run_seed.wrapping_add(42 + rank as u64)
}

/// Seeds libtorch's CPU (and CUDA) generators before drawing parameters or inputs.
///
/// Prefer [`seeded`], which also keeps other threads from drawing in between.
pub fn manual_seed(seed: u64) {
    tch::manual_seed(seed as i64);
}

/// Holds the draw lock for as long as the guard lives; [`reseed`] may be called meanwhile
/// to switch streams (as PyTorch's constructors do mid-way).
pub struct SeedGuard {
    _lock: MutexGuard<'static, ()>,
}

impl SeedGuard {
    /// Restarts libtorch's generator at `seed` while the lock is held.
    pub fn reseed(&self, seed: u64) {
        manual_seed(seed);
    }
}

/// Locks the generator and seeds it with `seed`.
pub fn lock_seeded(seed: u64) -> SeedGuard {
    // A panic while drawing leaves nothing half-written that a later draw depends on: the
    // next holder reseeds anyway.
    let lock = RNG_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    manual_seed(seed);
    SeedGuard { _lock: lock }
}

/// Runs `f` with libtorch's generator seeded at `seed` and no other thread drawing.
pub fn seeded<T>(seed: u64, f: impl FnOnce() -> T) -> T {
    let _guard = lock_seeded(seed);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_seeds_differ_and_repeat() {
        assert_eq!(data_seed(0, 0), 1);
        assert_eq!(data_seed(0, 3), 4);
        assert_eq!(batch_seed(0, 3, 0), 4);
        assert_ne!(batch_seed(0, 3, 1), batch_seed(0, 3, 0));
        assert_ne!(data_seed(1, 0), data_seed(0, 0));
        let draw = || tch::Tensor::rand([4], (tch::Kind::Float, tch::Device::Cpu));
        let a = seeded(7, draw);
        let b = seeded(7, draw);
        assert!(a.equal(&b));
    }
}
