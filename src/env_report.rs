//! `lockstep env`: what this build and machine can run, for bug reports and CI logs.

use serde::Serialize;

/// The facts `lockstep env` prints.
#[derive(Debug, Serialize)]
pub struct EnvReport {
    /// This crate's version.
    pub lockstep_version: &'static str,
    /// The libtorch the binary was linked against, read at build time (`unknown` if unread).
    pub libtorch_version: String,
    /// The CPU capability libtorch's kernels dispatch to (`AVX512`, `AVX2`, `DEFAULT`...;
    /// `ATEN_CPU_CAPABILITY` lowers it), as `torch.backends.cpu.get_cpu_capability()` says.
    pub cpu_capability: String,
    /// The intra-op threads every rank and in-process reference computes with
    /// (`LOCKSTEP_THREADS`, default 1).
    pub intra_op_threads: usize,
    /// Whether libtorch sees a CUDA device (a CPU-only libtorch never does).
    pub cuda_available: bool,
    /// CUDA devices libtorch sees.
    pub gpu_count: i64,
    /// Whether libtorch can use cuDNN.
    pub cudnn_available: bool,
    /// `available (version)`, or why not.
    pub nccl: String,
    /// Process-group backends this build can run here (`cpu` always).
    pub backends: Vec<&'static str>,
    /// Available parallelism reported by the OS (1 if it cannot say).
    pub cpu_threads: usize,
    /// The GPU side: every GPU's name, the driver's and libtorch's CUDA, cuDNN, the cuBLAS
    /// workspace, and the numerics switches every process computing on CUDA sets
    /// (deterministic kernels, no cuDNN autotuning, TF32 off): what a CUDA report records.
    pub gpu: lockstep_core::machine::GpuEnvironment,
}

/// Probes libtorch and the optional NCCL backend; the CPU capability, thread count and
/// libtorch version are what every report records ([`lockstep_harness::report::environment`]).
pub fn collect() -> EnvReport {
    let mut backends = vec!["cpu"];
    let nccl = nccl_status(&mut backends);
    let environment = lockstep_harness::report::environment();
    EnvReport {
        lockstep_version: env!("CARGO_PKG_VERSION"),
        libtorch_version: environment.libtorch_version,
        cpu_capability: environment.cpu_capability,
        intra_op_threads: environment.intra_op_threads,
        cuda_available: tch::Cuda::is_available(),
        gpu_count: tch::Cuda::device_count(),
        cudnn_available: tch::Cuda::cudnn_is_available(),
        nccl,
        backends,
        cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        gpu: cuda_side(),
    }
}

/// The GPU facts as a CUDA run of this build would record them: read after applying the
/// switches every CUDA process runs with (`--device cuda`, NCCL; without `--tf32`).
fn cuda_side() -> lockstep_core::machine::GpuEnvironment {
    let mut gpu = lockstep_core::machine::GpuEnvironment::read();
    gpu.numerics = Some(lockstep_core::machine::Numerics::deterministic(false));
    if gpu.cublas_workspace == "unset" {
        gpu.cublas_workspace = format!(
            "unset here; CUDA runs set {}",
            lockstep_core::machine::CUDA_DETERMINISM_ENV[0].1
        );
    }
    gpu
}

#[cfg(feature = "nccl")]
fn nccl_status(backends: &mut Vec<&'static str>) -> String {
    match lockstep_core::comm::nccl::nccl_version() {
        Ok(v) if tch::Cuda::is_available() => {
            backends.push("nccl");
            format!("available ({v})")
        }
        Ok(v) => format!("library found ({v}) but no CUDA device"),
        Err(e) => format!("unavailable: {e}"),
    }
}

#[cfg(not(feature = "nccl"))]
fn nccl_status(_: &mut Vec<&'static str>) -> String {
    "not built (rebuild with --features nccl)".into()
}

impl std::fmt::Display for EnvReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "lockstep        {}", self.lockstep_version)?;
        writeln!(f, "libtorch        {}", self.libtorch_version)?;
        writeln!(f, "cpu capability  {}", self.cpu_capability)?;
        writeln!(f, "torch threads   {}", self.intra_op_threads)?;
        writeln!(f, "cuda available  {}", self.cuda_available)?;
        writeln!(f, "gpus            {}", self.gpu_count)?;
        writeln!(f, "cudnn           {}", self.cudnn_available)?;
        writeln!(f, "nccl            {}", self.nccl)?;
        writeln!(f, "backends        {}", self.backends.join(", "))?;
        writeln!(f, "cpu threads     {}", self.cpu_threads)?;
        let gpus = if self.gpu.gpus.is_empty() {
            "none".to_owned()
        } else {
            self.gpu.gpus.join(", ")
        };
        writeln!(f, "gpu models      {gpus}")?;
        writeln!(f, "driver cuda     {}", self.gpu.driver_cuda)?;
        writeln!(f, "runtime cuda    {}", self.gpu.cuda_runtime)?;
        writeln!(f, "cudnn version   {}", self.gpu.cudnn)?;
        writeln!(f, "cublas config   {}", self.gpu.cublas_workspace)?;
        match &self.gpu.numerics {
            Some(n) => write!(f, "cuda numerics   {n}"),
            None => write!(f, "cuda numerics   unknown"),
        }
    }
}
