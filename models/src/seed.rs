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

/// Holds the draw lock for as long as the guard lives; [`SeedGuard::reseed`] may be called meanwhile
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

/// The seeds that key each sample's dropout masks, carried with the batch as an int64
/// tensor: sample `i` of rank `rank`'s batch at `step`. Keys travel with their samples through
/// any concatenation or split along the batch dimension, so a microbatch, a data-parallel
/// rank or a tensor-parallel group draws exactly the masks one process draws for the same
/// samples.
pub fn sample_keys(run_seed: u64, rank: usize, step: usize, samples: usize) -> Vec<i64> {
    let base = batch_seed(run_seed, rank, step).wrapping_mul(0x2545_F491_4F6C_DD1D);
    (0..samples as u64)
        .map(|i| (base.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 1) as i64)
        .collect()
}

/// The dropout mask of a batch whose samples carry `keys`, at dropout site `site` of layer
/// `layer`: per sample, a keep-mask of `per_sample` shape drawn from that sample's own
/// stream, scaled by `1 / (1 - p)` as `torch.nn.functional.dropout` scales kept values;
/// stacked along dim 0. Any rank can draw the full mask and keep its slice (tensor
/// parallelism's parity mode).
pub fn dropout_mask(
    keys: &[i64],
    layer: u64,
    site: u64,
    per_sample: &[i64],
    p: f64,
) -> Result<tch::Tensor, tch::TchError> {
    let masks = keys
        .iter()
        .map(|&k| {
            let seed = (k as u64)
                .wrapping_mul(0x100_0000_01B3)
                .wrapping_add(layer.wrapping_mul(0x9E37_79B9))
                .wrapping_add(site);
            seeded(seed, || {
                tch::Tensor::f_rand(per_sample, (tch::Kind::Float, tch::Device::Cpu))?
                    .f_ge(p)?
                    .f_to_kind(tch::Kind::Float)?
                    .f_div_scalar(1.0 - p)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    tch::Tensor::f_stack(&masks, 0)
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
