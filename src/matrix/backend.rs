//! `lockstep matrix --backend nccl`: what an NCCL matrix needs, checked before anything runs,
//! so a build or machine that cannot run it says why at once instead of failing every row.

use super::*;
use lockstep_core::comm::Backend;

/// Why the selected device and backend cannot run these world sizes here, every reason at
/// once; empty when they can ([`crate::device::blockers`]: CUDA for `--device cuda`; for NCCL
/// also this build's `nccl` feature and one GPU per rank of the largest world size, or under
/// an external launch this process's own GPU). Which configurations train on CUDA is
/// [`check_cuda_configs`]'s rule.
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
    let external = crate::external::launch().map(|l| l.local_rank);
    crate::device::blockers(device, backend, largest, external)
}

/// Whether `config` can train on CUDA under NCCL: the single-device reference, DDP and FSDP,
/// whose loops allocate on their parameters' device. Pipelines, tensor and expert
/// parallelism and the compositions keep CPU buffers (records, flat shards, routing) and run
/// on the CPU backend only.
pub fn runs_on_cuda(config: Config) -> bool {
    matches!(
        config,
        Config::Single
            | Config::Ddp
            | Config::DdpMixed(_)
            | Config::DdpHybridOrder
            | Config::Fsdp(_)
    )
}

/// The NCCL selection rule: every selected configuration must run on CUDA ([`runs_on_cuda`]);
/// the error names those that do not and the selection that works.
pub fn check_cuda_configs(
    device: crate::device::ComputeDevice,
    configs: &[Config],
) -> Result<(), MatrixError> {
    if device == crate::device::ComputeDevice::Cpu {
        return Ok(());
    }
    let cpu_only: Vec<&str> = configs
        .iter()
        .filter(|&&c| !runs_on_cuda(c))
        .map(|c| c.name())
        .collect();
    if cpu_only.is_empty() {
        return Ok(());
    }
    Err(MatrixError::BackendUnavailable {
        backend: "--device cuda",
        reasons: vec![format!(
            "{} run on the CPU backend only (their training loops keep CPU buffers); on NCCL \
             select the single-device reference, DDP and FSDP: --configs 'single,ddp*,fsdp.*'",
            cpu_only.join(", ")
        )],
    })
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
