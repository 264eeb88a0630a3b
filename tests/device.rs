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

/// `lockstep WORDS EXTRA` must exit 2 (bad input) with `expected` in its message, and leave
/// nothing at `written`.
fn refuses(words: &str, extra: &[&str], expected: &str, written: &std::path::Path) {
    let args: Vec<&str> = words
        .split_whitespace()
        .chain(extra.iter().copied())
        .collect();
    let (code, _, stderr) = lockstep(&args);
    assert_eq!(code, Some(2), "{words}: {stderr}");
    assert!(stderr.contains(expected), "{words}: {stderr}");
    assert!(
        !written.exists(),
        "{words}: nothing may be written: {stderr}"
    );
}

#[test]
fn matrix_and_run_on_cuda_without_a_gpu_refuse_before_anything_runs() {
    if tch::Cuda::device_count() > 0 {
        println!("SKIP: this machine has a GPU (the GPU check runs the CUDA matrix)");
        return;
    }
    let out_dir = scratch("matrix");
    let out = out_dir.display().to_string();
    refuses(
        "matrix --device cuda --world-size 2,4 --models mlp --configs ddp --out",
        &[&out],
        "--device cuda cannot run this matrix here: no CUDA device",
        &out_dir,
    );
    refuses(
        "run --model mlp --config ddp --device cuda",
        &[],
        "--device cuda cannot run here: no CUDA device",
        &out_dir,
    );
    let saved = scratch("run-final.safetensors");
    refuses(
        "run --model mlp --config ddp --device cuda --save-final",
        &[&saved.display().to_string()],
        "not supported with --device cuda",
        &saved,
    );
}

#[test]
fn nccl_cannot_be_asked_to_compute_on_the_cpu() {
    let out_dir = scratch("nccl-cpu");
    let out = out_dir.display().to_string();
    refuses(
        "matrix --backend nccl --device cpu --models mlp --configs ddp --out",
        &[&out],
        "drop --device cpu",
        &out_dir,
    );
}

#[test]
fn sensitivity_on_cuda_without_a_gpu_is_refused_by_name() {
    if tch::Cuda::device_count() > 0 {
        println!("SKIP: this machine has a GPU");
        return;
    }
    let out_dir = scratch("sensitivity");
    let out = out_dir.display().to_string();
    refuses(
        "matrix --sensitivity --device cuda --models mlp --configs ddp --out",
        &[&out],
        "--device cuda cannot run this matrix here: no CUDA device",
        &out_dir,
    );
    refuses(
        "sensitivity --model mlp --config ddp --device cuda --out",
        &[&out],
        "--device cuda cannot run this matrix here: no CUDA device",
        &out_dir,
    );
}

#[test]
fn an_unknown_device_is_named() {
    refuses(
        "matrix --device tpu --list",
        &[],
        "unknown device `tpu`",
        &scratch("none"),
    );
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

use crate::common;

/// A bundle as `ci/gpu-bundle` assembles it, around this build's `lockstep` (linked against
/// the checkout's libtorch rather than the bundle's 2.11), so the test suite runs the
/// bundle's `run` and summarizer. Its `CUDA_CONFIGS` is cut to one small family: `.ci/run`
/// builds the real 2.11 bundle and runs every family as a GPU host does.
fn bundle_around_this_build(dir: &std::path::Path, torch_version: &str) {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(dir.join("bin")).expect("bundle folder");
    std::fs::copy(env!("CARGO_BIN_EXE_lockstep"), dir.join("bin/lockstep")).expect("binary");
    for file in ["run", "judge", "summarize.py"] {
        std::fs::copy(repo.join("ci/bundle").join(file), dir.join(file)).expect("bundle file");
    }
    std::fs::write(
        dir.join("CUDA_CONFIGS"),
        "# one family, for the script's own test\ndp 60 2 single,ddp\n",
    )
    .expect("CUDA_CONFIGS");
    let probe = dir.join("python/lockstep_probe");
    std::fs::create_dir_all(&probe).expect("bundle python folder");
    for entry in std::fs::read_dir(repo.join("python/lockstep_probe")).expect("lockstep_probe") {
        let path = entry.expect("lockstep_probe entry").path();
        if path.extension().is_some_and(|e| e == "py") {
            std::fs::copy(&path, probe.join(path.file_name().expect("file name")))
                .expect("probe file");
        }
    }
    std::fs::create_dir_all(dir.join("examples")).expect("bundle examples folder");
    std::fs::copy(
        repo.join("examples/torch_fsdp2.py"),
        dir.join("examples/torch_fsdp2.py"),
    )
    .expect("FSDP2 example");
    std::fs::write(dir.join("TORCH_VERSION"), torch_version).expect("TORCH_VERSION");
}

#[test]
fn gpu_bundle_run_passes_its_cpu_part_here() {
    if tch::Cuda::device_count() > 0 {
        println!("SKIP: this machine has a GPU: the bundle's run checks it for real");
        return;
    }
    let Some((python, site)) = common::python_with_torch() else {
        println!("SKIP: no Python with torch here (ci/setup-libtorch installs one)");
        return;
    };
    let dir = scratch("bundle");
    let linked = env!("LOCKSTEP_LIBTORCH_VERSION");
    bundle_around_this_build(&dir, linked.split('+').next().unwrap_or(linked));
    let run = |out: &std::path::Path| {
        let mut cmd = Command::new(dir.join("run"));
        cmd.arg(out)
            .env("PYTHON", &python)
            .env("LOCKSTEP_GPU_MODELS", "mlp")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("LOCAL_RANK");
        if let Some(site) = &site {
            cmd.env("PYTHONPATH", site);
        }
        cmd.output().expect("run the bundle")
    };
    let out_dir = dir.join("out");
    let out = run(&out_dir);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("cuda: error: --device cuda cannot run this matrix here: no CUDA device"),
        "{stdout}"
    );
    assert!(
        stdout.contains("nccl: error: the nccl backend cannot run this matrix here"),
        "{stdout}"
    );
    assert!(stdout.contains("matrix-cpu: "), "{stdout}");
    // The GPU host's family ran here on the CPU, with exec'd ranks.
    assert!(stdout.contains("matrix-cuda-dp: "), "{stdout}");
    assert!(stdout.contains("--device cpu --exec-ranks"), "{stdout}");
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("judge-cpu") && l.contains(" ok ")),
        "the judge step passed on the CPU: {stdout}"
    );
    assert!(
        stdout.contains(" 0 failed, 0 run errors; bitwise repeat rows"),
        "{stdout}"
    );
    assert!(out_dir.join("summary.txt").is_file() && out_dir.join("env.json").is_file());
    assert!(
        !out_dir.join("matrix-cuda").exists(),
        "a refused matrix wrote its folder"
    );

    // A bundle linked against another torch than the host's refuses, naming both.
    std::fs::write(dir.join("TORCH_VERSION"), "2.11.0").expect("TORCH_VERSION");
    let out = run(&dir.join("other"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("linked against torch 2.11.0") && stderr.contains(linked),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_parity_test_on_cuda_without_a_gpu_is_refused_before_anything_runs() {
    if tch::Cuda::device_count() > 0 {
        println!("SKIP: this machine has a GPU");
        return;
    }
    let out_dir = scratch("parity-test");
    let err = lockstep::parity_test::ParityTest::new("on_cuda")
        .zoo("mlp")
        .config("ddp")
        .world_sizes(&[2])
        .device(lockstep::device::ComputeDevice::Cuda)
        .out_dir(&out_dir)
        .run()
        .expect_err("no GPU here");
    assert!(
        err.to_string()
            .contains("--device cuda cannot run here: no CUDA device"),
        "{err}"
    );
    assert!(!out_dir.exists(), "nothing may be written: {err}");
}
