//! Two hosts under real torchrun: two network namespaces joined by a veth pair (private
//! addresses, loopback up inside), two ranks each, world 4, CPU backend, no `LOCKSTEP_HOST`.
//! Proves that the published addresses are reachable, that shared memory is chosen per
//! host, that Lockstep's store coexists with torchrun's, that `LOCKSTEP_THREADS` (not
//! `OMP_NUM_THREADS`) sets a rank's threads, and that a wrong secret is diagnosed within
//! the rendezvous timeout; and that `lockstep matrix` run as one rank per process under
//! torchrun on both hosts gives the verdicts of the same matrix run on one host. Skipped,
//! with the reason printed, where namespaces cannot be made (not root, no `ip`) or torch is
//! not installed.

use lockstep_core::comm::{DType, ReduceOp};
use lockstep_core::ddp::{train_ddp, DdpOptions};
use lockstep_core::record::RunSpec;
use lockstep_core::train::{single_device_reference, OptimizerConfig, TrainConfig};
use lockstep_harness::parity::{compare, TolerancePolicy};
use lockstep_harness::Run;
use lockstep_models::zoo;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use tch::Tensor;

/// The rank body torchrun starts on both hosts.
const BODY: &str = "two_hosts::world4_body";
/// Set (to `1`) in the two-host launches: the body then expects two hosts.
const TWO_HOSTS: &str = "LOCKSTEP_TEST_TWO_HOSTS";
/// Where `ci/setup-libtorch` installed the torch wheel (overridable).
const TORCH_DEFAULT: &str = "/root/.cache/lockstep/torch-2.13.0";
/// torchrun's own store (`MASTER_PORT`); Lockstep's goes on the next port.
const MASTER_PORT: &str = "29500";
/// Bound on every torchrun invocation of the rank body, in seconds.
const LAUNCH_BOUND: &str = "60";
/// Bound on the torchrun invocation of the matrix and on its single-host twin, in seconds.
const MATRIX_BOUND: &str = "300";

/// World 4: collectives across and within hosts, a DDP-vs-single check. Under plain nextest
/// it is an ordinary local run of 4 ranks on one host.
#[test]
fn world4_body() {
    Run::new(4)
        .test_name(BODY)
        .timeout(Duration::from_secs(120))
        .run(|ctx| {
            let two_hosts = std::env::var_os(TWO_HOSTS).is_some();
            let world = ctx.world();
            // Every published address is dialable: never the unspecified address.
            for r in 0..4 {
                let addr = world.peer_address(r).unwrap_or_default();
                assert!(!addr.starts_with("0.0.0.0"), "rank {r} published {addr}");
                if two_hosts {
                    assert!(addr.starts_with("10.77.0."), "rank {r} published {addr}");
                }
            }
            // Shared memory per host identity: the pair on this host shares it, the world
            // spans two hosts.
            let mine = if ctx.rank() < 2 { [0, 1] } else { [2, 3] };
            assert!(world.shares_host(&mine));
            assert_eq!(world.shares_host(&[0, 1, 2, 3]), !two_hosts);
            // LOCKSTEP_THREADS (default 1) applies in external mode, whatever OMP says.
            assert_eq!(
                tch::get_num_threads() as usize,
                lockstep_harness::threads::rank_threads()
            );

            let t = Tensor::from_slice(&[ctx.rank() as f32 + 1.0, 5.0]);
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
            assert_eq!(Vec::<f32>::try_from(&t)?, vec![10.0, 20.0]);
            // A large all-reduce (shared memory within a host, TCP across).
            let host = world
                .new_groups(&[vec![0, 1], vec![2, 3]], "host")?
                .expect("every rank is on a host");
            let big = Tensor::full(
                [1 << 17],
                ctx.rank() as f64,
                (tch::Kind::Float, tch::Device::Cpu),
            );
            host.all_reduce(&big, ReduceOp::Sum)?;
            let want = if ctx.rank() < 2 { 1.0 } else { 5.0 };
            assert_eq!(big.double_value(&[12345]), want);
            ctx.group().all_reduce(&big, ReduceOp::Sum)?;
            assert_eq!(big.double_value(&[0]), 12.0);

            // DDP against the single-device reference.
            let model = zoo::build("mlp", 0, ctx.rank()).expect("model");
            let cfg = TrainConfig {
                spec: RunSpec {
                    model: "mlp".into(),
                    config: "ddp".into(),
                    world_size: ctx.world_size(),
                    backend: "cpu".into(),
                    dtype: "fp32".into(),
                    steps: 3,
                    seed: 0,
                },
                optimizer: OptimizerConfig::default(),
                data_ranks: vec![ctx.rank()],
                record_grads: false,
                probe: None,
            };
            let run = train_ddp(model.as_ref(), ctx.group(), &cfg, DdpOptions::default())?;
            if ctx.rank() == 0 {
                let single = zoo::build("mlp", 0, 0).expect("model");
                let reference = single_device_reference(
                    single.as_ref(),
                    ctx.world_size(),
                    3,
                    OptimizerConfig::default(),
                    false,
                )?;
                let c = compare(&run, &reference, &TolerancePolicy::dtype_table(DType::F32));
                assert!(c.passed, "{}", c.diagnosis.clone().unwrap_or_default());
            }
            println!("two-hosts body: rank {} done", ctx.rank());
            Ok::<(), Box<dyn std::error::Error>>(())
        });
}

/// Runs `ip` with `args`; the error is its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Two network namespaces joined by a veth pair, deleted on drop (also when a check fails).
struct TwoHosts {
    names: [String; 2],
}

impl TwoHosts {
    /// Hosts `10.77.0.1` and `10.77.0.2`; the namespaces are named after this process and
    /// `kind` (one lower-case letter or none: tests of one process get distinct names).
    fn create(kind: &str) -> Result<TwoHosts, String> {
        remove_orphans();
        let pid = std::process::id();
        let hosts = TwoHosts {
            names: [format!("lkst{pid}{kind}a"), format!("lkst{pid}{kind}b")],
        };
        let [a, b] = &hosts.names;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&[
            "-n", a, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", b,
        ])?;
        for (ns, addr) in [(a, "10.77.0.1/24"), (b, "10.77.0.2/24")] {
            ip(&["-n", ns, "addr", "add", addr, "dev", "veth0"])?;
            ip(&["-n", ns, "link", "set", "veth0", "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }
}

/// Deletes the namespaces of earlier runs of this test whose process is gone (killed before
/// its drop could run), so a hard kill never leaves them behind for long.
fn remove_orphans() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix("lkst")
            .and_then(|rest| rest.strip_suffix(['a', 'b']))
            .map(|rest| rest.trim_end_matches(|c: char| c.is_ascii_lowercase()))
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            // Deleting a namespace deletes its end of the veth pair, and so the pair.
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// What torchrun starts on every rank, bounded by `bound` seconds.
struct Ranks<'a> {
    program: std::ffi::OsString,
    args: Vec<String>,
    bound: &'a str,
}

impl Ranks<'_> {
    /// The rank body of this test binary.
    fn body() -> Ranks<'static> {
        Ranks {
            program: std::env::current_exe().expect("test binary").into(),
            args: [BODY, "--exact", "--nocapture", "--test-threads", "1"]
                .map(str::to_owned)
                .to_vec(),
            bound: LAUNCH_BOUND,
        }
    }
}

/// torchrun for node `node` in namespace `ns`, running `ranks`, with `env` added.
fn torchrun(ns: &str, node: usize, torch: &str, env: &[(&str, &str)], ranks: &Ranks) -> Command {
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", ranks.bound, "ip", "netns", "exec", ns])
        .args(["python3", "-m", "torch.distributed.run", "--no-python"])
        .args(["--nnodes", "2", "--nproc-per-node", "2"])
        .args(["--node-rank", &node.to_string()])
        .args(["--master-addr", "10.77.0.1", "--master-port", MASTER_PORT])
        .arg(&ranks.program)
        .args(&ranks.args)
        .env("PYTHONPATH", torch)
        .env(TWO_HOSTS, "1")
        // torchrun would set 1 itself; 2 shows that LOCKSTEP_THREADS, not OMP, decides.
        .env("OMP_NUM_THREADS", "2")
        .env("LOCKSTEP_COMM_TIMEOUT_SECS", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    scrub(&mut cmd);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Removes every variable of an enclosing launch (Lockstep's or an external one) from `cmd`.
fn scrub(cmd: &mut Command) {
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "LOCKSTEP_PARITY_LAUNCH",
        "LOCKSTEP_RANK",
        "LOCKSTEP_WORLD_SIZE",
        "LOCKSTEP_STORE",
        "LOCKSTEP_RUN_DIR",
        "LOCKSTEP_TEST",
        "LOCKSTEP_BACKEND",
        "LOCKSTEP_SPAWN",
        "LOCKSTEP_HOST",
        "LOCKSTEP_STORE_PORT",
        "LOCKSTEP_THREADS",
        "LOCKSTEP_RENDEZVOUS_TIMEOUT_SECS",
    ] {
        cmd.env_remove(var);
    }
}

/// Starts both nodes and waits for both; returns their outputs (node 0 first).
fn launch_both(
    hosts: &TwoHosts,
    torch: &str,
    env: [&[(&str, &str)]; 2],
    ranks: &Ranks,
) -> [Output; 2] {
    let children: Vec<_> = (0..2)
        .map(|node| {
            torchrun(&hosts.names[node], node, torch, env[node], ranks)
                .spawn()
                .expect("start torchrun")
        })
        .collect();
    let mut outs = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for torchrun"));
    let a = outs.next().expect("node 0");
    let b = outs.next().expect("node 1");
    [a, b]
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// torch's path and two fresh hosts named after `kind`, or `None` after printing why this
/// machine cannot run a two-host test (no torch, no namespaces: not root, no `ip`).
fn two_hosts_or_skip(kind: &str) -> Option<(String, TwoHosts)> {
    let torch = std::env::var("LOCKSTEP_TORCH_PYTHONPATH").unwrap_or_else(|_| TORCH_DEFAULT.into());
    if let Some(reason) = torch_missing(&torch) {
        println!("SKIP: {reason}");
        return None;
    }
    match TwoHosts::create(kind) {
        Ok(hosts) => Some((torch, hosts)),
        Err(e) => {
            println!("SKIP: cannot create network namespaces ({e})");
            None
        }
    }
}

/// Why this machine cannot run the two-host test, if it cannot.
fn torch_missing(torch: &str) -> Option<String> {
    let probe = std::path::Path::new(torch).join("torch/distributed/run.py");
    (!probe.exists()).then(|| format!("torch not found at {torch} (set LOCKSTEP_TORCH_PYTHONPATH)"))
}

#[test]
fn two_hosts_under_torchrun() {
    let Some((torch, hosts)) = two_hosts_or_skip("") else {
        return;
    };

    // World 4 across two hosts, torchrun's store on MASTER_PORT, no LOCKSTEP_HOST.
    let started = Instant::now();
    let [a, b] = launch_both(&hosts, &torch, [&[], &[]], &Ranks::body());
    let ok_time = started.elapsed();
    for (node, out) in [(0, &a), (1, &b)] {
        assert!(out.status.success(), "node {node} failed:\n{}", text(out));
    }
    for rank in 0..4 {
        let out = if rank < 2 { &a } else { &b };
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains(&format!("two-hosts body: rank {rank} done")),
            "rank {rank} did not finish:\n{}",
            text(out)
        );
    }
    println!(
        "world 4 on two hosts under torchrun: {:.1} s",
        ok_time.as_secs_f64()
    );

    // A wrong secret on host B: its ranks fail at once naming it; host A's name the
    // missing ranks within the rendezvous timeout.
    let rendezvous = [("LOCKSTEP_RENDEZVOUS_TIMEOUT_SECS", "6")];
    let started = Instant::now();
    let [a, b] = launch_both(
        &hosts,
        &torch,
        [
            &[rendezvous[0], ("LOCKSTEP_SECRET", "right")],
            &[rendezvous[0], ("LOCKSTEP_SECRET", "wrong")],
        ],
        &Ranks::body(),
    );
    let bad_time = started.elapsed();
    assert!(!a.status.success() && !b.status.success());
    let (ta, tb) = (text(&a), text(&b));
    assert!(tb.contains("wrong run secret"), "host B:\n{tb}");
    assert!(
        ta.contains("rank(s) [2, 3] of 4 to arrive at rendezvous"),
        "host A:\n{ta}"
    );
    assert!(
        bad_time < Duration::from_secs(40),
        "the wrong secret took {bad_time:?} to diagnose"
    );
    println!("wrong secret diagnosed in {:.1} s", bad_time.as_secs_f64());
}

/// The matrix selection run on two hosts and on one: every configuration family that runs
/// at world 4 on `gpt` (DDP, FSDP flat and hybrid, TP, a pipeline, a composition).
const MATRIX_ARGS: [&str; 8] = [
    "--configs",
    "ddp,fsdp.full_shard,fsdp.hybrid_shard,tp.2,pp.1f1b,fsdp_x_tp2",
    "--models",
    "gpt",
    "--world-size",
    "4",
    "--steps",
    "2",
];

/// `lockstep matrix` with `MATRIX_ARGS`, reports to `out`.
fn matrix_args(out: &std::path::Path) -> Vec<String> {
    let mut args = vec!["matrix".to_owned()];
    args.extend(MATRIX_ARGS.map(str::to_owned));
    args.extend(["--out".to_owned(), out.display().to_string()]);
    args
}

/// Every compared row of a matrix report (`model config vs reference`) with its verdict;
/// panics unless the report is complete and has no run errors.
fn verdicts(report: &std::path::Path) -> Vec<(String, bool)> {
    let text = std::fs::read_to_string(report)
        .unwrap_or_else(|e| panic!("reading {}: {e}", report.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("report JSON");
    assert_eq!(json["complete"], true, "{} is incomplete", report.display());
    assert_eq!(json["errors"].as_array().map(Vec::len), Some(0), "{text}");
    let rows = json["comparisons"].as_array().expect("comparisons");
    rows.iter()
        .map(|c| {
            let name = format!("{} {} vs {}", c["model"], c["config"], c["reference"]);
            (name, c["passed"] == true)
        })
        .collect()
}

/// `/dev/shm` entries of external ranks (`lockstep-p{pid}-…`).
fn shm_entries() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("lockstep-p"))
                .collect()
        })
        .unwrap_or_default()
}

/// Processes whose command line mentions `marker`.
fn processes_with(marker: &str) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(marker))
        .collect()
}

#[test]
fn matrix_under_torchrun_on_two_hosts() {
    let Some((torch, hosts)) = two_hosts_or_skip("m") else {
        return;
    };
    let lockstep = env!("CARGO_BIN_EXE_lockstep");
    let scratch = std::env::temp_dir().join(format!("lockstep-two-hosts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let (local_out, node_out) = (
        scratch.join("local"),
        [scratch.join("n0"), scratch.join("n1")],
    );
    let shm_before = shm_entries();

    // The same selection on one host, as every user runs it.
    let started = Instant::now();
    let mut local = Command::new("timeout");
    local
        .args(["-k", "5", MATRIX_BOUND, lockstep])
        .args(matrix_args(&local_out))
        .stdin(Stdio::null());
    scrub(&mut local);
    let local = local.output().expect("run lockstep matrix");
    let local_time = started.elapsed();
    assert!(
        local.status.success(),
        "single-host matrix:\n{}",
        text(&local)
    );

    // One rank per process, two per host, under torchrun; each node's --out is its own.
    let per_node: Vec<Ranks> = node_out
        .iter()
        .map(|out| Ranks {
            program: lockstep.into(),
            args: matrix_args(out),
            bound: MATRIX_BOUND,
        })
        .collect();
    let started = Instant::now();
    let children: Vec<_> = (0..2)
        .map(|node| {
            torchrun(&hosts.names[node], node, &torch, &[], &per_node[node])
                .spawn()
                .expect("start torchrun")
        })
        .collect();
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for torchrun"))
        .collect();
    let external_time = started.elapsed();
    for (node, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {node} failed:\n{}", text(out));
    }
    let (a, b) = (
        String::from_utf8_lossy(&outs[0].stdout),
        String::from_utf8_lossy(&outs[1].stdout),
    );
    assert!(
        a.contains("11 passed, 0 failed"),
        "rank 0 prints the table:\n{a}"
    );
    assert!(
        a.contains("lockstep matrix rank 1 of 4: passed"),
        "rank 1's one line:\n{a}"
    );
    for rank in [2, 3] {
        let line = format!("lockstep matrix rank {rank} of 4: passed");
        assert!(b.contains(&line), "rank {rank}'s one line:\n{b}");
    }
    assert!(!b.contains("PASS"), "only rank 0 prints the table:\n{b}");
    assert!(!node_out[1].exists(), "only rank 0 writes reports");

    // Identical verdicts, row by row.
    let here = verdicts(&local_out.join("report.json"));
    let there = verdicts(&node_out[0].join("report.json"));
    assert_eq!(here.len(), 11, "{here:?}");
    assert_eq!(here, there, "the two-host matrix judged differently");

    // Nothing left behind: processes, shared memory, namespaces.
    let marker = scratch.display().to_string();
    let left = processes_with(&marker);
    assert!(left.is_empty(), "processes left: {left:?}");
    let leaked: Vec<String> = shm_entries()
        .difference(&shm_before)
        .filter(|n| {
            let pid = n["lockstep-p".len()..]
                .split('-')
                .next()
                .unwrap_or_default();
            !std::path::Path::new("/proc").join(pid).exists()
        })
        .cloned()
        .collect();
    assert!(leaked.is_empty(), "/dev/shm entries left: {leaked:?}");
    let names = hosts.names.clone();
    drop(hosts);
    let listed = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip");
    let listed = String::from_utf8_lossy(&listed.stdout);
    for ns in &names {
        assert!(!listed.contains(ns.as_str()), "namespace {ns} left");
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!(
        "matrix on one host: {:.1} s; on two hosts under torchrun: {:.1} s; {} identical verdicts",
        local_time.as_secs_f64(),
        external_time.as_secs_f64(),
        here.len()
    );
}

/// The value of `var` in process `pid`'s environment.
fn env_of(pid: &str, var: &str) -> Option<String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    let prefix = format!("{var}=");
    environ
        .split(|&b| b == 0)
        .map(String::from_utf8_lossy)
        .find_map(|kv| kv.strip_prefix(&prefix).map(str::to_owned))
}

/// The pid of the process whose command line mentions `marker` and whose `RANK` is `rank`.
fn rank_pid(marker: &str, rank: usize) -> Option<String> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|pid| pid.parse::<u32>().is_ok())
        .find(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(marker)
                && !cmdline.contains("torch.distributed.run")
                && env_of(pid, "RANK").as_deref() == Some(&rank.to_string())
        })
}

/// The pid of rank `rank` (of the run whose command line mentions `marker`) once it has run
/// for 4 s (past rendezvous, training); panics if it does not start within 40 s.
fn training_rank(marker: &str, rank: usize) -> String {
    let deadline = Instant::now() + Duration::from_secs(40);
    let pid = loop {
        if let Some(pid) = rank_pid(marker, rank) {
            break pid;
        }
        assert!(Instant::now() < deadline, "rank {rank} never started");
        std::thread::sleep(Duration::from_millis(100));
    };
    std::thread::sleep(Duration::from_secs(4));
    pid
}

/// A rank killed on host B mid-run (SIGKILL: it reports nothing) is named by rank 0 on host
/// A, well within the 60 s collective timeout: its peers fail as its links close, and a rank
/// still silent a few seconds after the first reported failure is named as dead.
#[test]
fn a_killed_rank_is_named_by_the_other_host() {
    let Some((torch, hosts)) = two_hosts_or_skip("k") else {
        return;
    };
    let shm_before = shm_entries();
    // A seed no other test uses marks this run's processes.
    let seed = format!("{}", 7_000_000 + std::process::id() % 1_000_000);
    let ranks = Ranks {
        program: env!("CARGO_BIN_EXE_lockstep").into(),
        args: [
            "run", "--model", "gpt", "--config", "ddp", "--steps", "1000000",
        ]
        .map(str::to_owned)
        .into_iter()
        .chain(["--seed".to_owned(), seed.clone()])
        .collect(),
        bound: LAUNCH_BOUND,
    };
    let children: Vec<_> = (0..2)
        .map(|node| {
            torchrun(&hosts.names[node], node, &torch, &[], &ranks)
                .spawn()
                .expect("start torchrun")
        })
        .collect();
    // Rank 3 (host B), once it has run for a few seconds (past rendezvous, training).
    let marker = format!("--seed {seed}");
    let victim = training_rank(&marker, 3);
    let killed = Instant::now();
    let status = Command::new("kill")
        .args(["-9", &victim])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -9 {victim}");
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for torchrun"))
        .collect();
    let named_after = killed.elapsed();
    let a = text(&outs[0]);
    assert!(!outs[0].status.success(), "host A must fail:\n{a}");
    let line = a
        .lines()
        .find(|l| l.contains("died in launch"))
        .unwrap_or_else(|| panic!("host A does not name a dead rank:\n{a}"));
    assert!(
        line.contains("3]"),
        "the killed rank 3 is not named: {line}"
    );
    // Bounded by the collective timeout (60 s) it would otherwise wait out.
    assert!(
        named_after < Duration::from_secs(30),
        "named only after {named_after:?}:\n{a}"
    );
    assert!(
        rank_pid(&marker, 0).is_none() && rank_pid(&marker, 2).is_none(),
        "ranks left running"
    );
    let new_shm: Vec<String> = shm_entries().difference(&shm_before).cloned().collect();
    assert!(new_shm.is_empty(), "/dev/shm entries left: {new_shm:?}");
    println!(
        "killed rank 3 named on host A {:.1} s after the kill: {line}",
        named_after.as_secs_f64()
    );
}

/// `lockstep bench comm` as one rank per process under torchrun on both hosts: rank 0 prints
/// every point (world 4, positive bandwidth), the others one line each.
#[test]
fn bench_comm_across_hosts() {
    let Some((torch, hosts)) = two_hosts_or_skip("c") else {
        return;
    };
    let ranks = Ranks {
        program: env!("CARGO_BIN_EXE_lockstep").into(),
        args: ["bench", "comm", "--ops", "all_reduce,all_gather", "--json"]
            .into_iter()
            .chain(["--sizes", "4096,4194304", "--seconds", "0.3"])
            .map(str::to_owned)
            .collect(),
        bound: LAUNCH_BOUND,
    };
    let outs = launch_both(&hosts, &torch, [&[], &[]], &ranks);
    for (node, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {node} failed:\n{}", text(out));
    }
    let a = String::from_utf8_lossy(&outs[0].stdout);
    let points: Vec<serde_json::Value> = a
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON point"))
        .collect();
    assert_eq!(points.len(), 4, "rank 0's points:\n{a}");
    for p in &points {
        assert_eq!(p["world_size"], 4, "{p}");
        let busbw = p["busbw_gbps"].as_f64().unwrap_or(0.0);
        assert!(busbw > 0.0 && busbw.is_finite(), "{p}");
        println!(
            "across two hosts: {} {} B: busbw {busbw:.3} GB/s",
            p["op"], p["bytes"]
        );
    }
    assert!(a.contains("lockstep bench comm rank 1 of 4"), "{a}");
    let b = String::from_utf8_lossy(&outs[1].stdout);
    for rank in [2, 3] {
        assert!(
            b.contains(&format!("lockstep bench comm rank {rank} of 4")),
            "{b}"
        );
    }
}

/// The `ParityTest` torchrun starts on both hosts (under plain nextest, an ordinary parity
/// test on one host): DDP, hybrid-sharded FSDP and TP at world 4 against the single device
/// and DDP.
const PARITY_BODY: &str = "two_hosts::parity_test_body";

#[test]
fn parity_test_body() {
    let rank = std::env::var("RANK").unwrap_or_else(|_| "local".into());
    let out = std::env::temp_dir().join(format!(
        "lockstep-two-hosts-parity-{}-{rank}",
        std::process::id()
    ));
    let outcome = lockstep::parity_test::ParityTest::new("two_hosts_parity")
        .zoo("gpt")
        .config("ddp")
        .config("fsdp.hybrid_shard")
        .config("tp.2")
        .world_sizes(&[4])
        .steps(2)
        .out_dir(&out)
        .run()
        .expect("the parity test runs");
    outcome.assert_passed();
    let _ = std::fs::remove_dir_all(&out);
    println!(
        "parity body: rank {rank} judged {} comparisons, all passed",
        outcome.report.comparisons.len()
    );
}

/// `ParityTest` in a test binary started by torchrun on both hosts (one rank per process):
/// every rank runs the same test, judges the same records and passes.
#[test]
fn parity_test_across_hosts() {
    let Some((torch, hosts)) = two_hosts_or_skip("p") else {
        return;
    };
    let ranks = Ranks {
        program: std::env::current_exe().expect("test binary").into(),
        args: [PARITY_BODY, "--exact", "--nocapture", "--test-threads", "1"]
            .map(str::to_owned)
            .to_vec(),
        bound: LAUNCH_BOUND,
    };
    let outs = launch_both(&hosts, &torch, [&[], &[]], &ranks);
    for (node, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {node} failed:\n{}", text(out));
    }
    for rank in 0..4 {
        let stdout = String::from_utf8_lossy(&outs[rank / 2].stdout);
        assert!(
            stdout.contains(&format!("parity body: rank {rank} judged")),
            "rank {rank}:\n{stdout}"
        );
    }
}

/// The veth link cut mid-training (no socket closes, nothing fails by itself): each rank's
/// watchdog ends the launch at `--timeout`; host A names host B's ranks as dead or cut off,
/// and host B's ranks end too (their store requests time out) instead of waiting forever.
#[test]
fn a_cut_link_is_diagnosed_on_both_hosts() {
    let Some((torch, hosts)) = two_hosts_or_skip("l") else {
        return;
    };
    let seed = format!("{}", 8_000_000 + std::process::id() % 1_000_000);
    let ranks = Ranks {
        program: env!("CARGO_BIN_EXE_lockstep").into(),
        args: [
            "run", "--model", "gpt", "--config", "ddp", "--steps", "1000000",
        ]
        .map(str::to_owned)
        .into_iter()
        .chain(["--timeout", "8", "--seed", &seed].map(str::to_owned))
        .collect(),
        bound: "150",
    };
    let env: &[(&str, &str)] = &[("LOCKSTEP_COMM_TIMEOUT_SECS", "20")];
    let children: Vec<_> = (0..2)
        .map(|node| {
            torchrun(&hosts.names[node], node, &torch, env, &ranks)
                .spawn()
                .expect("start torchrun")
        })
        .collect();
    let marker = format!("--seed {seed}");
    training_rank(&marker, 3);
    let cut = Instant::now();
    ip(&["-n", &hosts.names[1], "link", "set", "veth0", "down"]).expect("cut the link");
    let outs: Vec<Output> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("wait for torchrun"))
        .collect();
    let ended_after = cut.elapsed();
    let (a, b) = (text(&outs[0]), text(&outs[1]));
    assert!(!outs[0].status.success(), "host A must fail:\n{a}");
    let line = a
        .lines()
        .find(|l| l.contains("died in launch"))
        .unwrap_or_else(|| panic!("host A names no lost rank:\n{a}"));
    assert!(
        line.contains("[2, 3]"),
        "host B's ranks are not named: {line}"
    );
    // Host B's ranks ended by themselves (torchrun's failure, not the 150 s bound's 124).
    assert!(
        !outs[1].status.success() && outs[1].status.code() != Some(124),
        "host B:\n{b}"
    );
    assert!(
        rank_pid(&marker, 2).is_none() && rank_pid(&marker, 0).is_none(),
        "ranks left running"
    );
    println!(
        "cut link: both hosts ended {:.1} s after the cut; host A: {line}",
        ended_after.as_secs_f64()
    );
}

/// `lockstep bench step` as one rank per process under torchrun on both hosts: DDP and FSDP
/// steps timed across the hosts; rank 0 prints the times, the others one line each.
#[test]
fn bench_step_across_hosts() {
    let Some((torch, hosts)) = two_hosts_or_skip("s") else {
        return;
    };
    let ranks = Ranks {
        program: env!("CARGO_BIN_EXE_lockstep").into(),
        args: ["bench", "step", "--model", "mlp", "--steps", "3", "--json"]
            .map(str::to_owned)
            .to_vec(),
        bound: LAUNCH_BOUND,
    };
    let outs = launch_both(&hosts, &torch, [&[], &[]], &ranks);
    for (node, out) in outs.iter().enumerate() {
        assert!(out.status.success(), "node {node} failed:\n{}", text(out));
    }
    let a = String::from_utf8_lossy(&outs[0].stdout);
    let json: serde_json::Value = a
        .lines()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("rank 0 prints the times:\n{a}"));
    assert_eq!(json["world_size"], 4, "{json}");
    for field in ["ddp_seconds", "fsdp_seconds", "fsdp_per_layer_seconds"] {
        let v = json[field].as_f64().unwrap_or(-1.0);
        assert!(v > 0.0 && v.is_finite(), "{field}: {json}");
    }
    let b = String::from_utf8_lossy(&outs[1].stdout);
    for rank in [2, 3] {
        let line = format!("lockstep bench step rank {rank} of 4: done");
        assert!(b.contains(&line), "{b}");
    }
    println!(
        "bench step across two hosts (mlp, world 4): ddp {:.4} s, fsdp {:.4} s",
        json["ddp_seconds"], json["fsdp_seconds"]
    );
}
