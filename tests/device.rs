//! Computing on CUDA, checked where no GPU is: `--device cuda` refuses by name before anything
//! runs or is written, NCCL cannot be asked to compute on the CPU, the numerics switches every
//! CUDA process sets reach libtorch, and `lockstep env` reports the GPU side. (What only a GPU
//! can show is in docs/gpu.md, with the command that shows it.)

use lockstep_core::machine::{GpuEnvironment, Numerics};
use std::path::PathBuf;
use std::process::Command;

fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockstep-device-{tag}-{}", std::process::id()))
}

fn lockstep(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .output()
        .expect("run lockstep");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn matrix_on_cuda_without_a_gpu_refuses_before_anything_runs() {
    if tch::Cuda::device_count() > 0 {
        println!("SKIP: this machine has a GPU (the GPU check runs the CUDA matrix)");
        return;
    }
    let out_dir = scratch("matrix");
    let out_arg = out_dir.display().to_string();
    let (code, _, stderr) = lockstep(&[
        "matrix",
        "--device",
        "cuda",
        "--world-size",
        "2,4",
        "--models",
        "mlp",
        "--configs",
        "ddp",
        "--out",
        &out_arg,
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("the cuda backend cannot run this matrix here: no CUDA device"),
        "{stderr}"
    );
    assert!(!out_dir.exists(), "nothing may be written: {stderr}");
}

#[test]
fn nccl_cannot_be_asked_to_compute_on_the_cpu() {
    let out_dir = scratch("nccl-cpu");
    let out_arg = out_dir.display().to_string();
    let (code, _, stderr) = lockstep(&[
        "matrix",
        "--backend",
        "nccl",
        "--device",
        "cpu",
        "--models",
        "mlp",
        "--configs",
        "ddp",
        "--out",
        &out_arg,
    ]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("drop --device cpu"), "{stderr}");
    assert!(!out_dir.exists(), "nothing may be written: {stderr}");
}

#[test]
fn an_unknown_device_is_named() {
    let (code, _, stderr) = lockstep(&["matrix", "--device", "tpu", "--list"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("unknown device `tpu`"), "{stderr}");
}

/// The switches a CUDA process sets reach libtorch's global context (the same one CUDA
/// kernels read), and TF32 follows `--tf32`. This test changes this process's libtorch state:
/// it is the only test of this file that does.
#[test]
fn cuda_numerics_reach_libtorch() {
    let defaults = Numerics::current().expect("read the switches");
    assert!(
        !defaults.deterministic_algorithms && !defaults.benchmark_cudnn,
        "PyTorch's defaults: {defaults:?}"
    );
    let numerics =
        lockstep_core::machine::make_cuda_deterministic(false, true).expect("set the switches");
    assert_eq!(Numerics::current().expect("read"), numerics);
    assert!(numerics.deterministic_algorithms && numerics.deterministic_cudnn);
    assert!(!numerics.tf32_matmul && !numerics.tf32_cudnn && !numerics.benchmark_cudnn);
    assert_eq!(
        std::env::var("CUBLAS_WORKSPACE_CONFIG").as_deref(),
        Ok(":4096:8")
    );
    assert_eq!(std::env::var("NCCL_ALGO").as_deref(), Ok("Ring"));
    let with_tf32 = Numerics::deterministic(true);
    with_tf32.apply().expect("set");
    assert!(Numerics::current().expect("read").tf32_matmul);
    // Reports of this process now record the GPU side.
    let environment = lockstep_core::machine::environment();
    let gpu = environment
        .gpu
        .expect("a CUDA process records its GPU side");
    assert_eq!(gpu.cublas_workspace, ":4096:8");
    assert_eq!(gpu.numerics, Some(with_tf32));
    defaults.apply().expect("restore");
}

#[test]
fn env_reports_the_gpu_side() {
    let (code, stdout, stderr) = lockstep(&["env"]);
    assert_eq!(code, Some(0), "{stderr}");
    for line in [
        "gpu models",
        "driver cuda",
        "runtime cuda",
        "cudnn version",
        "cublas config",
    ] {
        assert!(stdout.contains(line), "`{line}` missing:\n{stdout}");
    }
    assert!(
        stdout.contains(
            "cuda numerics   deterministic algorithms on, cuDNN deterministic on, \
                         cuDNN benchmark off, TF32 matmul off, TF32 cuDNN off"
        ),
        "{stdout}"
    );
    let read = GpuEnvironment::read();
    if tch::Cuda::device_count() == 0 {
        assert!(read.gpus.is_empty(), "{read:?}");
    }
}
