//! Seeds shared by every run: the same seed gives the same parameters and the same per-rank
//! batches, whichever parallel configuration consumes them.

/// The seed of rank `rank`'s data in a run seeded with `run_seed`, following PyTorch's FSDP
/// tests (rank data seeded `1 + rank` for run seed 0).
pub fn data_seed(run_seed: u64, rank: usize) -> u64 {
    run_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(1 + rank as u64)
}

/// Seeds libtorch's CPU (and CUDA) generators before drawing parameters or inputs.
pub fn manual_seed(seed: u64) {
    tch::manual_seed(seed as i64);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_seeds_differ_and_repeat() {
        assert_eq!(data_seed(0, 0), 1);
        assert_eq!(data_seed(0, 3), 4);
        assert_ne!(data_seed(1, 0), data_seed(0, 0));
        manual_seed(7);
        let a = tch::Tensor::rand([4], (tch::Kind::Float, tch::Device::Cpu));
        manual_seed(7);
        let b = tch::Tensor::rand([4], (tch::Kind::Float, tch::Device::Cpu));
        assert!(a.equal(&b));
    }
}
