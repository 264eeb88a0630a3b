//! The one rule for libtorch's intra-op thread count: every rank computes with
//! [`rank_threads`], and so does every reference computed outside a rank (the single-device
//! reference of `lockstep matrix`, `lockstep run --config single`, the parity-test API), so
//! a verdict never depends on how many cores the machine that computed it has. A parallel
//! kernel splits its reductions by thread, so another count may round differently.

/// The environment variable that sets the count.
pub const THREADS_VAR: &str = "LOCKSTEP_THREADS";

/// Intra-op threads per rank and per in-process reference: `LOCKSTEP_THREADS`, default 1
/// (ranks already share the cores, and one thread keeps results independent of the core
/// count). A value that is not a positive integer counts as unset.
pub fn rank_threads() -> usize {
    std::env::var(THREADS_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(1)
}

/// Sets this process's libtorch to [`rank_threads`] and returns it: what a rank does first,
/// and what a process does before computing a reference itself. A process that forks ranks
/// afterwards must only do so at one thread (see [`forks_safely_after_reference`]).
pub fn use_rank_threads() -> usize {
    let n = rank_threads();
    tch::set_num_threads(i32::try_from(n).unwrap_or(i32::MAX));
    n
}

/// Sets this process's libtorch to one thread: what a process that forks ranks runs with.
/// A child forked after its parent ran a multi-threaded (OpenMP) kernel hangs in its first
/// parallel region (measured with PyTorch 2.13: `set_num_threads(2)`, a matmul, `fork`, a
/// matmul in the child never returns), so the launching process never starts a pool.
pub fn use_launcher_threads() {
    tch::set_num_threads(1);
}

/// Whether a process that forks ranks may compute a reference in process at
/// [`rank_threads`] first: only at one thread (no OpenMP pool for the children to inherit).
/// Otherwise the reference runs in a forked child of its own.
pub fn forks_safely_after_reference() -> bool {
    rank_threads() == 1
}
