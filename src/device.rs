//! Where a run computes (`--device cpu|cuda`), apart from how its ranks communicate
//! (`--backend cpu|nccl`).
//!
//! The two are separate because NCCL refuses two ranks on one GPU, yet a CI runner with one
//! GPU (or fewer GPUs than ranks) must still check every configuration on GPU kernels:
//! `--device cuda` on the CPU backend computes on CUDA, ranks spread over the GPUs round robin,
//! and their collectives are staged through host memory (the CPU backend copies any device's
//! tensors to the host and back, in its one documented order, so the bitwise rows keep their
//! meaning). `--backend nccl` always computes on CUDA, one GPU per rank.
//!
//! Every process that computes on CUDA runs with deterministic kernels, a fixed cuBLAS
//! workspace and TF32 off unless `--tf32` asks for it ([`lockstep_core::machine::Numerics`]).

use lockstep_core::comm::Backend;

/// Where a run's tensors live and its kernels run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ComputeDevice {
    /// libtorch's CPU kernels (the default; what CI runs).
    #[default]
    Cpu,
    /// CUDA: rank r on GPU `r % GPUs` on the CPU backend, on GPU `LOCAL_RANK` under NCCL; the
    /// single-device reference on GPU 0.
    Cuda,
}

impl ComputeDevice {
    /// The name `--device` takes and reports print.
    pub fn name(self) -> &'static str {
        match self {
            ComputeDevice::Cpu => "cpu",
            ComputeDevice::Cuda => "cuda",
        }
    }

    /// `--device`'s parser.
    pub fn parse(text: &str) -> Result<ComputeDevice, String> {
        match text {
            "cpu" => Ok(ComputeDevice::Cpu),
            "cuda" | "gpu" => Ok(ComputeDevice::Cuda),
            other => Err(format!("unknown device `{other}` (cpu or cuda)")),
        }
    }

    /// The device a run on `backend` computes on when `requested` (if any) was asked for:
    /// NCCL communicates CUDA tensors only, so it computes on CUDA, and asking it for the CPU
    /// is an error that says so.
    pub fn resolve(
        requested: Option<ComputeDevice>,
        backend: Backend,
    ) -> Result<ComputeDevice, String> {
        match (requested, backend) {
            (Some(ComputeDevice::Cpu), Backend::Nccl) => Err(
                "--backend nccl communicates CUDA tensors and so computes on CUDA: drop \
                 --device cpu (or use --backend cpu)"
                    .into(),
            ),
            (_, Backend::Nccl) => Ok(ComputeDevice::Cuda),
            (requested, Backend::Cpu) => Ok(requested.unwrap_or_default()),
        }
    }
}

/// The GPU a rank with `local_rank` computes on when `gpus` are visible: its own under NCCL
/// (one GPU per rank; too few is refused before anything runs), round robin on the CPU backend
/// (several ranks share a GPU).
pub fn rank_gpu(local_rank: usize, gpus: usize, backend: Backend) -> usize {
    match backend {
        Backend::Nccl => local_rank,
        Backend::Cpu => local_rank % gpus.max(1),
    }
}

/// The GPUs libtorch sees in this process.
pub fn visible_gpus() -> usize {
    usize::try_from(tch::Cuda::device_count()).unwrap_or(0)
}

/// The libtorch device rank `local_rank` computes on.
pub fn rank_device(device: ComputeDevice, backend: Backend, local_rank: usize) -> tch::Device {
    match ComputeDevice::resolve(Some(device), backend).unwrap_or(ComputeDevice::Cuda) {
        ComputeDevice::Cpu => tch::Device::Cpu,
        ComputeDevice::Cuda => tch::Device::Cuda(rank_gpu(local_rank, visible_gpus(), backend)),
    }
}

/// Why `device` with `backend` cannot run ranks up to `largest_world` here, every reason at
/// once (empty when it can): no CUDA for `--device cuda`; for NCCL also the `nccl` feature and
/// one GPU per rank (under an external launch, this process's own GPU). Checked before
/// anything runs or is written.
pub fn blockers(
    device: ComputeDevice,
    backend: Backend,
    largest_world: usize,
    external_local_rank: Option<usize>,
) -> Vec<String> {
    let mut reasons = Vec::new();
    if backend == Backend::Nccl && !cfg!(feature = "nccl") {
        reasons.push("this build has no `nccl` feature (rebuild with --features nccl)".into());
    }
    let device = match ComputeDevice::resolve(Some(device), backend) {
        Ok(device) => device,
        Err(why) => {
            reasons.push(why);
            return reasons;
        }
    };
    if device == ComputeDevice::Cpu {
        return reasons;
    }
    let found = visible_gpus();
    if backend != Backend::Nccl {
        if found == 0 {
            reasons.push(format!(
                "no CUDA device: libtorch {} sees 0 GPUs (no NVIDIA driver, no visible GPU, or \
                 a CPU-only libtorch)",
                env!("LOCKSTEP_LIBTORCH_VERSION")
            ));
        }
        return reasons;
    }
    if let Some(local_rank) = external_local_rank {
        if found <= local_rank {
            reasons.push(format!(
                "this rank (LOCAL_RANK={local_rank}) needs GPU cuda:{local_rank}, found {found} \
                 GPUs"
            ));
        }
    } else if found < largest_world {
        let share = if found > 0 {
            ": --device cuda on the CPU backend shares GPUs between ranks"
        } else {
            ""
        };
        reasons.push(format!(
            "needs {} (one per rank of world size {largest_world}; NCCL refuses two ranks on \
             one GPU), found {found}{share}",
            lockstep_harness::report::plural(largest_world, "GPU")
        ));
    }
    reasons
}

/// Makes this process compute deterministically on CUDA ([`make_cuda_deterministic`]) when
/// `device` is CUDA; nothing on the CPU. Call before the first CUDA call of the process.
///
/// [`make_cuda_deterministic`]: lockstep_core::machine::make_cuda_deterministic
pub fn prepare_process(
    device: ComputeDevice,
    backend: Backend,
    tf32: bool,
) -> Result<(), lockstep_core::AutogradError> {
    if device == ComputeDevice::Cuda || backend == Backend::Nccl {
        lockstep_core::machine::make_cuda_deterministic(tf32, backend == Backend::Nccl)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_computes_on_cuda_and_refuses_the_cpu() {
        assert_eq!(
            ComputeDevice::resolve(None, Backend::Nccl),
            Ok(ComputeDevice::Cuda)
        );
        assert!(
            ComputeDevice::resolve(Some(ComputeDevice::Cpu), Backend::Nccl)
                .is_err_and(|e| e.contains("drop --device cpu"))
        );
        assert_eq!(
            ComputeDevice::resolve(None, Backend::Cpu),
            Ok(ComputeDevice::Cpu)
        );
        assert_eq!(
            ComputeDevice::resolve(Some(ComputeDevice::Cuda), Backend::Cpu),
            Ok(ComputeDevice::Cuda)
        );
    }

    #[test]
    fn ranks_share_gpus_round_robin_on_the_cpu_backend_only() {
        let on_one: Vec<usize> = (0..4).map(|r| rank_gpu(r, 1, Backend::Cpu)).collect();
        assert_eq!(on_one, [0, 0, 0, 0]);
        let on_two: Vec<usize> = (0..4).map(|r| rank_gpu(r, 2, Backend::Cpu)).collect();
        assert_eq!(on_two, [0, 1, 0, 1]);
        let nccl: Vec<usize> = (0..4).map(|r| rank_gpu(r, 8, Backend::Nccl)).collect();
        assert_eq!(nccl, [0, 1, 2, 3]);
    }

    #[test]
    fn cuda_without_a_gpu_is_refused_by_name() {
        if visible_gpus() > 0 {
            return; // a GPU machine: nothing to refuse
        }
        let reasons = blockers(ComputeDevice::Cuda, Backend::Cpu, 4, None);
        assert_eq!(reasons.len(), 1, "{reasons:?}");
        assert!(reasons[0].contains("no CUDA device"), "{reasons:?}");
        assert!(blockers(ComputeDevice::Cpu, Backend::Cpu, 4, None).is_empty());
    }
}
