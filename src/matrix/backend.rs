//! `lockstep matrix --backend nccl`: what an NCCL matrix needs, checked before anything runs,
//! so a build or machine that cannot run it says why at once instead of failing every row.

use super::*;
use lockstep_core::comm::Backend;

/// Why the selected device and backend cannot run these world sizes here, every reason at
/// once; empty when they can ([`crate::device::blockers`]: CUDA for `--device cuda`; for NCCL
/// also this build's `nccl` feature and one GPU per rank of the largest world size, or under
/// an external launch this process's own GPU). Every configuration trains on CUDA: its
/// training code creates its tensors on its parameters' device (`tests/device_plumbing.rs`).
pub fn backend_blockers(
    device: crate::device::ComputeDevice,
    backend: Backend,
    world_sizes: &[usize],
) -> Vec<String> {
    let largest = world_sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(DEFAULT_WORLD_SIZE);
    let external = crate::runner::external::launch().map(|l| l.local_rank);
    crate::device::blockers(device, backend, largest, external)
}

/// Refuses `opts` before anything runs when its backend cannot run here
/// ([`backend_blockers`]): the CLI turns this into exit 2, like any other unusable input.
pub fn check_backend(opts: &MatrixOptions) -> Result<(), MatrixError> {
    let reasons = backend_blockers(opts.device, opts.backend, &opts.world_sizes);
    if reasons.is_empty() {
        return Ok(());
    }
    Err(MatrixError::BackendUnavailable {
        backend: match (opts.backend, opts.device) {
            (Backend::Nccl, _) => "the nccl backend",
            (Backend::Cpu, crate::device::ComputeDevice::Cuda) => "--device cuda",
            (Backend::Cpu, crate::device::ComputeDevice::Cpu) => "the cpu backend",
        },
        reasons,
    })
}
