//! The GPU pipeline, checked where no GPU is: `ci/gpu --dry-run` must print every step of the
//! GPU job (and execute none), SLURM's variables must become the harness's, and
//! `lockstep matrix --backend nccl` must refuse before anything runs where it cannot run (no
//! `nccl` feature, too few GPUs) and refuse configurations that train on the CPU only. The
//! last test is the one
//! a multi-node GPU job runs on every rank; without GPUs it prints `SKIP:` and passes.

use lockstep_core::comm::ReduceOp;
use lockstep_harness::{Outcome, Run};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Variables that would turn a dry run into a multi-node rank, or change its GPU count.
const RANK_VARS: [&str; 15] = [
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DRY_RUN",
    "LOCKSTEP_GPUS",
    "LOCKSTEP_SECRET",
    "ARTIFACTS",
    "TORCHELASTIC_RUN_ID",
    "LOCKSTEP_MASTER_PORT",
];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "lockstep-gpu-pipeline-{tag}-{}",
        std::process::id()
    ))
}

/// `ci/gpu` with `args`, a clean environment but for `vars`, artifacts under `artifacts`.
fn ci_gpu(args: &[&str], vars: &[(&str, &str)], artifacts: &Path) -> Output {
    let mut cmd = Command::new(repo().join("ci/gpu"));
    cmd.args(args);
    for v in RANK_VARS {
        cmd.env_remove(v);
    }
    cmd.env("ARTIFACTS", artifacts).envs(vars.iter().copied());
    cmd.output().expect("ci/gpu runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn dry_run_prints_every_step_and_executes_none() {
    let artifacts = scratch("artifacts");
    for (args, vars) in [
        (&["--dry-run"][..], &[("LOCKSTEP_GPUS", "4")][..]),
        (&[][..], &[("LOCKSTEP_GPUS", "4"), ("DRY_RUN", "1")][..]),
    ] {
        let out = ci_gpu(args, vars, &artifacts);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        let art = artifacts.display().to_string();
        for expected in [
            "DRY RUN: every step is printed, none is executed",
            "$ ci/setup-libtorch",
            "$ cargo build --release --features nccl",
            "$ target/release/lockstep env",
            "gpu = { max-threads = 4 }",
            "$ cargo nextest run --workspace --features nccl --profile gpu --config-file \
             target/gpu/nextest.toml",
            "$ target/release/lockstep matrix --backend nccl --world-size 2,4 --out \
             target/lockstep/matrix-nccl",
            &format!("cp -r target/lockstep/matrix-nccl target/nextest/gpu/junit.xml {art}/"),
            "DRY RUN: 7 steps printed, none executed",
        ] {
            assert!(
                stdout.contains(expected),
                "missing {expected:?} in:\n{stdout}"
            );
        }
        assert!(
            !artifacts.exists(),
            "a dry run created {}",
            artifacts.display()
        );
    }
}

#[test]
fn slurm_variables_become_the_harness_variables() {
    let artifacts = scratch("slurm");
    let out = ci_gpu(
        &["--dry-run"],
        &[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[07-08,11],login1"),
            ("LOCKSTEP_SECRET", "shared"),
        ],
        &artifacts,
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    // scontrol, where present, expands the list itself; either way the first host is gpu07.
    for expected in [
        "RANK=5 WORLD_SIZE=8 LOCAL_RANK=1 (device cuda:1)",
        "MASTER_ADDR=gpu07 MASTER_PORT=29500 LOCKSTEP_BACKEND=nccl",
        "nccl_external_world_all_reduce",
        // Every rank runs the NCCL matrix as one rank of the world (rank 0 writes reports).
        "rank 5 of the NCCL matrix across nodes (world 8)",
        "matrix --backend nccl --out",
        "DRY RUN: 3 steps printed, none executed",
    ] {
        assert!(
            stdout.contains(expected),
            "missing {expected:?} in:\n{stdout}"
        );
    }
    // A rank keeps only its own log: the reports are rank 0's.
    assert!(
        !stdout.contains("keep the reports"),
        "rank 5 keeps no reports:\n{stdout}"
    );
}

#[test]
fn unknown_argument_is_bad_input() {
    let out = ci_gpu(&["--frobnicate"], &[], &scratch("bad"));
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unknown argument --frobnicate"));
}

#[test]
fn nextest_config_has_the_line_ci_gpu_rewrites() {
    let config = std::fs::read_to_string(repo().join(".config/nextest.toml"))
        .expect("read .config/nextest.toml");
    assert!(
        config.lines().any(|l| l == "gpu = { max-threads = 1 }"),
        "ci/gpu's sed expects the gpu test group on one line:\n{config}"
    );
    assert!(config.contains("[profile.gpu]"));
    assert!(config.contains("[[profile.gpu.overrides]]"));
}

#[test]
fn matrix_on_nccl_refuses_before_anything_runs() {
    if cfg!(feature = "nccl") && tch::Cuda::device_count() >= 2 {
        println!("SKIP: this machine can run the NCCL matrix (ci/gpu runs it)");
        return;
    }
    let out_dir = scratch("matrix");
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args(["matrix", "--backend", "nccl", "--world-size", "2"])
        .args(["--models", "mlp", "--configs", "ddp", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run lockstep");
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("the nccl backend cannot run this matrix here"),
        "{stderr}"
    );
    if !cfg!(feature = "nccl") {
        assert!(stderr.contains("no `nccl` feature"), "{stderr}");
    }
    if tch::Cuda::device_count() < 2 {
        assert!(stderr.contains("needs 2 GPUs"), "{stderr}");
    }
    assert!(!out_dir.exists(), "nothing may be written: {stderr}");
}

/// One rank of a world of any size, as `ci/gpu` starts it on every SLURM task (external
/// launch: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, LOCKSTEP_BACKEND=nccl);
/// launched locally it needs 2 GPUs. Each rank works on cuda:LOCAL_RANK.
#[test]
fn nccl_external_world_all_reduce() {
    let outcome = Run::new(2)
        .backend("nccl")
        .any_world_size()
        .test_name("nccl_external_world_all_reduce")
        .run(|ctx| {
            let device = ctx.device();
            assert_eq!(device, tch::Device::Cuda(ctx.local_rank()));
            let t = tch::Tensor::from_slice(&[ctx.rank() as f64 + 1.0]).to_device(device);
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
            let n = ctx.world_size() as f64;
            assert_eq!(
                t.to_device(tch::Device::Cpu).double_value(&[0]),
                n * (n + 1.0) / 2.0
            );
            Ok::<(), lockstep_core::CommError>(())
        });
    if let Outcome::Skipped(reason) = outcome {
        assert!(
            reason.contains("GPU") || reason.contains("nccl"),
            "{reason}"
        );
    }
}
