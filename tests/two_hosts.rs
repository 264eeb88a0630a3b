//! Two hosts under real torchrun: two network namespaces joined by a veth pair (private
//! addresses, loopback up inside), two ranks each, world 4, CPU backend, no `LOCKSTEP_HOST`.
//! Proves that the published addresses are reachable, that shared memory is chosen per
//! host, that Lockstep's store coexists with torchrun's, that `LOCKSTEP_THREADS` (not
//! `OMP_NUM_THREADS`) sets a rank's threads, and that a wrong secret is diagnosed within
//! the rendezvous timeout. Skipped, with the reason printed, where namespaces cannot be made
//! (not root, no `ip`) or torch is not installed.

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
const BODY: &str = "world4_body";
/// Set (to `1`) in the two-host launches: the body then expects two hosts.
const TWO_HOSTS: &str = "LOCKSTEP_TEST_TWO_HOSTS";
/// Where `ci/setup-libtorch` installed the torch wheel (overridable).
const TORCH_DEFAULT: &str = "/root/.cache/lockstep/torch-2.13.0";
/// torchrun's own store (`MASTER_PORT`); Lockstep's goes on the next port.
const MASTER_PORT: &str = "29500";
/// Bound on every torchrun invocation, in seconds.
const LAUNCH_BOUND: &str = "60";

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
    /// Hosts `10.77.0.1` and `10.77.0.2`; the namespaces are named after this process.
    fn create() -> Result<TwoHosts, String> {
        remove_orphans();
        let pid = std::process::id();
        let hosts = TwoHosts {
            names: [format!("lkst{pid}a"), format!("lkst{pid}b")],
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

/// torchrun for node `node` in namespace `ns`, running the rank body, with `env` added.
fn torchrun(ns: &str, node: usize, torch: &str, env: &[(&str, &str)]) -> Command {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = Command::new("timeout");
    cmd.args(["-k", "5", LAUNCH_BOUND, "ip", "netns", "exec", ns])
        .args(["python3", "-m", "torch.distributed.run", "--no-python"])
        .args(["--nnodes", "2", "--nproc-per-node", "2"])
        .args(["--node-rank", &node.to_string()])
        .args(["--master-addr", "10.77.0.1", "--master-port", MASTER_PORT])
        .arg(exe)
        .args([BODY, "--exact", "--nocapture", "--test-threads", "1"])
        .env("PYTHONPATH", torch)
        .env(TWO_HOSTS, "1")
        // torchrun would set 1 itself; 2 shows that LOCKSTEP_THREADS, not OMP, decides.
        .env("OMP_NUM_THREADS", "2")
        .env("LOCKSTEP_COMM_TIMEOUT_SECS", "60")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for var in [
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
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Starts both nodes and waits for both; returns their outputs (node 0 first).
fn launch_both(hosts: &TwoHosts, torch: &str, env: [&[(&str, &str)]; 2]) -> [Output; 2] {
    let children: Vec<_> = (0..2)
        .map(|node| {
            torchrun(&hosts.names[node], node, torch, env[node])
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

/// Why this machine cannot run the two-host test, if it cannot.
fn torch_missing(torch: &str) -> Option<String> {
    let probe = std::path::Path::new(torch).join("torch/distributed/run.py");
    (!probe.exists()).then(|| format!("torch not found at {torch} (set LOCKSTEP_TORCH_PYTHONPATH)"))
}

#[test]
fn two_hosts_under_torchrun() {
    let torch = std::env::var("LOCKSTEP_TORCH_PYTHONPATH").unwrap_or_else(|_| TORCH_DEFAULT.into());
    if let Some(reason) = torch_missing(&torch) {
        println!("SKIP: {reason}");
        return;
    }
    let hosts = match TwoHosts::create() {
        Ok(h) => h,
        Err(e) => {
            println!("SKIP: cannot create network namespaces ({e})");
            return;
        }
    };

    // World 4 across two hosts, torchrun's store on MASTER_PORT, no LOCKSTEP_HOST.
    let started = Instant::now();
    let [a, b] = launch_both(&hosts, &torch, [&[], &[]]);
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
