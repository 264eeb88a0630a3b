//! Where the numbers were computed: `lockstep env`, `lockstep run` and every report record
//! libtorch's CPU capability (what `torch.backends.cpu.get_cpu_capability()` says, lowered by
//! `ATEN_CPU_CAPABILITY`), the intra-op thread count the ranks and references use
//! (`LOCKSTEP_THREADS`) and the libtorch version; and references computed outside a rank use
//! the ranks' thread count, also when that is more than one (a matrix must not hang then).

use lockstep::harness::report::{read_json, render_json, Report};
use std::path::{Path, PathBuf};
use std::process::Command;

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the `lockstep` binary with `env` set (and `LOCKSTEP_THREADS` /
/// `ATEN_CPU_CAPABILITY` removed unless `env` sets them, so the caller's shell cannot leak in).
fn lockstep(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lockstep"));
    cmd.args(args)
        .env_remove("LOCKSTEP_THREADS")
        .env_remove("ATEN_CPU_CAPABILITY");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the lockstep binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn ok(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = lockstep(args, env);
    assert_eq!(
        out.code,
        Some(0),
        "lockstep {args:?}:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("lockstep-env-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

#[test]
fn env_reports_the_cpu_capability_threads_and_libtorch() {
    let plain = json(&ok(&["env", "--json"], &[]));
    let capability = plain["cpu_capability"].as_str().expect("a capability");
    // ATen's names: DEFAULT, AVX2, AVX512 (x86), ZVECTOR, VSX, SVE256... never empty.
    assert!(
        !capability.is_empty()
            && capability
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit()),
        "{plain}"
    );
    assert_eq!(plain["intra_op_threads"], 1, "{plain}");
    // The wheel's version (`2.13.0+cu130`), read at build time.
    assert!(
        plain["libtorch_version"]
            .as_str()
            .is_some_and(|v| v.starts_with("2.13.0")),
        "{plain}"
    );

    let lowered = json(&ok(
        &["env", "--json"],
        &[
            ("ATEN_CPU_CAPABILITY", "default"),
            ("LOCKSTEP_THREADS", "3"),
        ],
    ));
    assert_eq!(lowered["cpu_capability"], "DEFAULT", "{lowered}");
    assert_eq!(lowered["intra_op_threads"], 3, "{lowered}");
    let text = ok(&["env"], &[("ATEN_CPU_CAPABILITY", "default")]).stdout;
    assert!(text.contains("cpu capability  DEFAULT"), "{text}");
    assert!(text.contains("torch threads   1"), "{text}");
}

/// The matrix's report set records the environment (JSON object, one line in Markdown and
/// HTML), and with `ATEN_CPU_CAPABILITY=default` says DEFAULT.
#[test]
fn reports_record_the_environment() {
    let scratch = Scratch::new("report");
    ok(
        &[
            "matrix",
            "--models",
            "nested",
            "--configs",
            "ddp",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--out",
            s(&scratch.0),
        ],
        &[("ATEN_CPU_CAPABILITY", "default")],
    );
    let report = read_json(&scratch.0.join("report.json")).expect("report");
    let env = report.environment.expect("the environment");
    assert_eq!(env.cpu_capability, "DEFAULT");
    assert_eq!(env.intra_op_threads, 1);
    assert!(env.libtorch_version.starts_with("2.13.0"), "{env:?}");
    let line = format!(
        "Computed with CPU capability DEFAULT, 1 intra-op thread, libtorch {}.",
        env.libtorch_version
    );
    let md = std::fs::read_to_string(scratch.0.join("report.md")).expect("md");
    assert_eq!(md.lines().nth(2), Some(line.as_str()), "{md}");
    let html = std::fs::read_to_string(scratch.0.join("report.html")).expect("html");
    assert!(html.contains(&line), "{html}");
}

/// A report written before the field existed (no `environment`) still reads, as `None`; a
/// report without one renders no environment line.
#[test]
fn reports_without_an_environment_still_read() {
    let scratch = Scratch::new("old");
    let report = Report::new(Vec::new());
    assert!(report.environment.is_some());
    let mut value: serde_json::Value =
        serde_json::from_str(&render_json(&report).expect("json")).expect("value");
    value
        .as_object_mut()
        .expect("object")
        .remove("environment")
        .expect("written");
    let path = scratch.0.join("old.json");
    std::fs::write(&path, value.to_string()).expect("write");
    let old = read_json(&path).expect("an old report reads");
    assert_eq!(old.environment, None);
    assert_eq!(old.environment_line(), None);
    let md = lockstep::harness::report::render_markdown(&old);
    assert!(!md.contains("Computed with"), "{md}");
}

/// `LOCKSTEP_THREADS=2`: the ranks compute with 2 threads and so does the single-device
/// reference, which the matrix then computes in a forked child (a process that forks ranks
/// must never run a multi-threaded kernel itself, or the ranks hang); the matrix finishes,
/// passes, and its report says 2. `lockstep run --config single` (which forks nothing)
/// computes in process with 2 threads.
#[test]
fn references_use_the_ranks_thread_count() {
    let scratch = Scratch::new("threads");
    let run = lockstep(
        &[
            "matrix",
            "--models",
            "nested",
            "--configs",
            "ddp,fsdp.full_shard",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--timeout",
            "60",
            "--out",
            s(&scratch.0),
        ],
        &[("LOCKSTEP_THREADS", "2")],
    );
    assert_eq!(run.code, Some(0), "{}\n{}", run.stdout, run.stderr);
    let report = read_json(&scratch.0.join("report.json")).expect("report");
    assert!(report.passed());
    assert_eq!(report.environment.expect("env").intra_op_threads, 2);
    let single = json(&ok(
        &[
            "run", "--model", "nested", "--config", "single", "--steps", "1", "--json",
        ],
        &[("LOCKSTEP_THREADS", "2")],
    ));
    assert_eq!(single["environment"]["intra_op_threads"], 2, "{single}");
}

/// Set in the re-runs of [`libtorch_cuda_is_loaded_where_a_driver_is_and_only_there`]: check
/// this process only, start no other.
const CUDA_PROBE_CHILD: &str = "LOCKSTEP_TEST_CUDA_PROBE_CHILD";

/// libtorch's CUDA half (`libtorch_cuda.so`) is loaded before `main` exactly where it can be
/// used (an NVIDIA driver is present), or where `LOCKSTEP_LOAD_CUDA=1` asks, and then
/// registered with libtorch as if linked (`tch::utils::has_cuda`); never with
/// `LOCKSTEP_LOAD_CUDA=0`. Linked into every binary, it cost each process 0.2 s and 400 MB on
/// a machine without a GPU (ci/linkage/src/load_torch_cuda.c).
#[test]
fn libtorch_cuda_is_loaded_where_a_driver_is_and_only_there() {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let torch_cpu = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| path.ends_with("/libtorch_cpu.so"))
        .map(PathBuf::from)
        .expect("libtorch_cpu.so is mapped");
    let cuda_half = torch_cpu.with_file_name("libtorch_cuda.so").is_file();
    let driver =
        Path::new("/proc/driver/nvidia/version").exists() || Path::new("/dev/nvidiactl").exists();
    let wanted = std::env::var("LOCKSTEP_LOAD_CUDA").ok();
    let expected = cuda_half
        && match wanted.as_deref() {
            Some("0") => false,
            Some("1") => true,
            _ => driver,
        };
    let loaded = maps.contains("/libtorch_cuda.so");
    let registered = std::panic::catch_unwind(tch::utils::version_cudart).is_ok_and(|v| v > 0);
    assert_eq!(
        (loaded, registered),
        (expected, expected),
        "libtorch_cuda.so (beside {}: {cuda_half}) loaded and registered, with \
         LOCKSTEP_LOAD_CUDA={wanted:?} and a driver: {driver}",
        torch_cpu.display()
    );
    if std::env::var_os(CUDA_PROBE_CHILD).is_some() {
        return;
    }
    for wanted in ["1", "0"] {
        let out = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "environment::libtorch_cuda_is_loaded_where_a_driver_is_and_only_there",
                "--exact",
                "--nocapture",
            ])
            .env("LOCKSTEP_LOAD_CUDA", wanted)
            .env(CUDA_PROBE_CHILD, "1")
            .output()
            .expect("re-run this test");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("1 passed"),
            "with LOCKSTEP_LOAD_CUDA={wanted}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
