//! `lockstep matrix --backend nccl`: what an NCCL matrix needs, checked before anything runs,
//! so a build or machine that cannot run it says why at once instead of failing every row.

use super::*;
use lockstep_core::comm::Backend;

/// Why the selected backend cannot run these world sizes here, every reason at once; empty
/// when it can. The CPU backend always can. NCCL needs this build's `nccl` feature, one GPU
/// per rank of the largest world size (ranks use the device of their `LOCAL_RANK`; under an
/// external launch, this process's GPU only); which
/// configurations it can train is [`check_cuda_configs`]'s rule.
pub fn backend_blockers(backend: Backend, world_sizes: &[usize]) -> Vec<String> {
    if backend == Backend::Cpu {
        return Vec::new();
    }
    let mut reasons = Vec::new();
    if !cfg!(feature = "nccl") {
        reasons.push("this build has no `nccl` feature (rebuild with --features nccl)".into());
    }
    let needed = world_sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(DEFAULT_WORLD_SIZE);
    let found = tch::Cuda::device_count().max(0) as usize;
    if let Some(external) = crate::external::launch() {
        // One rank per process: this process needs only its own GPU.
        if found <= external.local_rank {
            reasons.push(format!(
                "this rank (LOCAL_RANK={}) needs GPU cuda:{}, found {found} GPUs",
                external.local_rank, external.local_rank
            ));
        }
        return reasons;
    }
    if found < needed {
        reasons.push(format!(
            "needs {needed} GPUs (one per rank of world size {needed}), found {found}"
        ));
    }
    reasons
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
pub fn check_cuda_configs(backend: Backend, configs: &[Config]) -> Result<(), MatrixError> {
    if backend == Backend::Cpu {
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
        backend: "nccl",
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
    let reasons = backend_blockers(opts.backend, &opts.world_sizes);
    if reasons.is_empty() {
        return Ok(());
    }
    Err(MatrixError::BackendUnavailable {
        backend: match opts.backend {
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        },
        reasons,
    })
}
