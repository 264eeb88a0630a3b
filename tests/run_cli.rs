//! `lockstep run`: state dicts under PyTorch's names in and out (bitwise round trip), every
//! kind of bad checkpoint refused with exit 2 before anything runs or is written, exact
//! continuation from a `--save-final` checkpoint (optimizer state included) for `single` and
//! `ddp`, the JSON object, and (when a Python with torch is at hand) the zoo's PyTorch twins
//! loading Lockstep's state and handing theirs back.

use crate::common;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Kind, Tensor};

struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn lockstep(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .arg("run")
        .args(args)
        .output()
        .expect("run the lockstep binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `lockstep run ARGS` and insists it succeeded.
fn ok(args: &[&str]) -> Output {
    let out = lockstep(args);
    assert_eq!(
        out.code,
        Some(0),
        "lockstep run {args:?} failed:\n{}\n{}",
        out.stdout,
        out.stderr
    );
    out
}

/// Runs `lockstep run ARGS --json` and returns its object.
fn json(args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.push("--json");
    let out = ok(&all);
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", out.stdout))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("lockstep-run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// A safetensors file's tensors by name (read through tch, independently of Lockstep's own
/// reader).
fn tensors(path: &Path) -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .into_iter()
        .collect()
}

/// The bytes of a tensor's values: equal bytes is bitwise equality (-0.0 and NaN included).
fn bytes(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

/// Same keys, dtypes, shapes and bits.
fn assert_same_state(a: &Path, b: &Path) {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(
        ta.keys().collect::<Vec<_>>(),
        tb.keys().collect::<Vec<_>>(),
        "{} and {} hold different keys",
        a.display(),
        b.display()
    );
    for (name, x) in &ta {
        let y = &tb[name];
        assert_eq!((x.kind(), x.size()), (y.kind(), y.size()), "{name}");
        assert!(
            bytes(x) == bytes(y),
            "{name} differs between {} and {}",
            a.display(),
            b.display()
        );
    }
}

fn floats(v: &serde_json::Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("`{key}` is not an array: {v}"))
        .iter()
        .map(|x| x.as_f64().expect("a number"))
        .collect()
}

#[test]
fn init_then_save_init_round_trips_bitwise() {
    let dir = scratch("round-trip");
    for model in ["nested", "transformer"] {
        // A state written by Lockstep, read back by a run whose own seed would draw other
        // weights, and written again: the same file, byte for byte (tied weights, the int64
        // buffer and the metadata included).
        let a = dir.join(format!("{model}.a.safetensors"));
        let b = dir.join(format!("{model}.b.safetensors"));
        ok(&[
            "--model",
            model,
            "--config",
            "single",
            "--steps",
            "0",
            "--seed",
            "3",
            "--save-init",
            s(&a),
        ]);
        ok(&[
            "--model",
            model,
            "--config",
            "single",
            "--steps",
            "0",
            "--seed",
            "9",
            "--init",
            s(&a),
            "--save-init",
            s(&b),
        ]);
        let (fa, fb) = (std::fs::read(&a).expect("a"), std::fs::read(&b).expect("b"));
        assert!(
            fa == fb,
            "{model}: --init then --save-init changed the file"
        );
        let fresh = dir.join(format!("{model}.seed9.safetensors"));
        ok(&[
            "--model",
            model,
            "--config",
            "single",
            "--steps",
            "0",
            "--seed",
            "9",
            "--save-init",
            s(&fresh),
        ]);
        assert!(
            std::fs::read(&fresh).expect("fresh") != fa,
            "{model}: seeds 3 and 9 drew the same weights, so the round trip proves nothing"
        );
    }
    // A file Lockstep did not write (no metadata, other values): every tensor comes back
    // bitwise under its name.
    let user = dir.join("user.safetensors");
    let mut written = tensors(&dir.join("nested.a.safetensors"));
    tch::manual_seed(7);
    for t in written.values_mut() {
        *t = Tensor::randn(t.size(), (Kind::Float, tch::Device::Cpu));
    }
    let list: Vec<(String, Tensor)> = written.into_iter().collect();
    Tensor::write_safetensors(&list, &user).expect("write the user's file");
    let back = dir.join("user.back.safetensors");
    ok(&[
        "--model",
        "nested",
        "--config",
        "ddp",
        "--world-size",
        "2",
        "--steps",
        "0",
        "--init",
        s(&user),
        "--save-init",
        s(&back),
    ]);
    assert_same_state(&user, &back);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shallow copy of a state dict, to edit one key of.
fn copy(state: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    state
        .iter()
        .map(|(k, t)| (k.clone(), t.shallow_clone()))
        .collect()
}

/// Writes `tensors` under `name` in `dir` through tch (as a PyTorch user's tools would).
fn write(dir: &Path, name: &str, tensors: &BTreeMap<String, Tensor>) -> PathBuf {
    let path = dir.join(name);
    let list: Vec<(&String, &Tensor)> = tensors.iter().collect();
    Tensor::write_safetensors(&list, &path).expect("write a checkpoint");
    path
}

#[test]
fn bad_checkpoints_exit_2_naming_each_key_and_write_nothing() {
    let dir = scratch("bad");
    let good = dir.join("good.safetensors");
    ok(&[
        "--model",
        "nested",
        "--config",
        "single",
        "--steps",
        "0",
        "--save-init",
        s(&good),
    ]);
    let base = tensors(&good);

    let mut missing = copy(&base);
    missing.remove("module.2.bias");
    let mut extra = copy(&base);
    extra.insert(
        "module.9.weight".into(),
        Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)),
    );
    let mut shape = copy(&base);
    shape.insert(
        "module.0.weight".into(),
        base["module.0.weight"].tr().contiguous(),
    );
    let mut dtype = copy(&base);
    dtype.insert(
        "module.1.0.bias".into(),
        base["module.1.0.bias"].to_kind(Kind::Double),
    );
    let mut several = copy(&base);
    several.remove("module.0.bias");
    several.remove("module.3.weight");
    several.insert(
        "head.weight".into(),
        base["module.3.weight"].shallow_clone(),
    );
    several.insert(
        "module.2.weight".into(),
        base["module.2.weight"].to_kind(Kind::Half),
    );
    let truncated = dir.join("truncated.safetensors");
    let full = std::fs::read(&good).expect("good bytes");
    std::fs::write(&truncated, &full[..full.len() - 100]).expect("truncate");
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a checkpoint at all").expect("garbage");

    let cases: Vec<(PathBuf, Vec<&str>)> = vec![
        (
            write(&dir, "missing.safetensors", &missing),
            vec!["missing [module.2.bias]"],
        ),
        (
            write(&dir, "extra.safetensors", &extra),
            vec!["unexpected [module.9.weight]"],
        ),
        (
            write(&dir, "shape.safetensors", &shape),
            vec!["module.0.weight: expected Float [4, 8], found Float [8, 4]"],
        ),
        (
            write(&dir, "dtype.safetensors", &dtype),
            vec!["module.1.0.bias: expected Float [16], found Double [16]"],
        ),
        (
            write(&dir, "several.safetensors", &several),
            vec![
                "module.0.bias",
                "module.3.weight",
                "head.weight",
                "module.2.weight: expected Float [4, 16], found Half [4, 16]",
            ],
        ),
        (truncated, vec!["truncated"]),
        (garbage, vec!["not a usable safetensors file"]),
    ];
    for (file, wanted) in cases {
        let init_out = dir.join("should-not-exist.init.safetensors");
        let final_out = dir.join("should-not-exist.final.safetensors");
        let out = lockstep(&[
            "--model",
            "nested",
            "--config",
            "ddp",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--init",
            s(&file),
            "--save-init",
            s(&init_out),
            "--save-final",
            s(&final_out),
        ]);
        assert_eq!(out.code, Some(2), "{}: {}", file.display(), out.stderr);
        assert!(
            out.stdout.is_empty(),
            "{}: something ran: {}",
            file.display(),
            out.stdout
        );
        assert!(
            out.stderr.contains(s(&file)),
            "{}: the file is not named: {}",
            file.display(),
            out.stderr
        );
        for w in wanted {
            assert!(
                out.stderr.contains(w),
                "{}: `{w}` not in: {}",
                file.display(),
                out.stderr
            );
        }
        assert!(
            !init_out.exists() && !final_out.exists(),
            "{}: a file was written",
            file.display()
        );
    }

    // An optimizer state file that lost a momentum buffer is refused the same way.
    let saved = dir.join("saved.safetensors");
    ok(&[
        "--model",
        "nested",
        "--config",
        "single",
        "--steps",
        "1",
        "--save-final",
        s(&saved),
    ]);
    let optim = dir.join("saved.optim.safetensors");
    let mut state = lockstep::checkpoint::safetensors::read(&optim).expect("optimizer state");
    state
        .tensors
        .retain(|(name, _)| name != "module.0.weight.momentum_buffer");
    lockstep::checkpoint::safetensors::write_atomic(&optim, &state.tensors, &state.metadata)
        .expect("rewrite the optimizer state");
    let out = lockstep(&[
        "--model",
        "nested",
        "--config",
        "single",
        "--init",
        s(&saved),
    ]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("saved.optim.safetensors")
            && out
                .stderr
                .contains("missing [module.0.weight.momentum_buffer]"),
        "{}",
        out.stderr
    );
    // So is one whose metadata (step, seed, optimizer) is gone.
    let bare: BTreeMap<String, Tensor> = state.tensors.into_iter().collect();
    write(&dir, "saved.optim.safetensors", &bare);
    let out = lockstep(&[
        "--model",
        "nested",
        "--config",
        "single",
        "--init",
        s(&saved),
    ]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr.contains("metadata lockstep.step is missing"),
        "{}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_names_and_sizes_exit_2_listing_what_is_known() {
    let cases: [(&[&str], &[&str]); 5] = [
        (
            &["--model", "resnet", "--config", "ddp"],
            &["unknown model `resnet`", "nested", "gpt_moe"],
        ),
        (
            &["--model", "nested", "--config", "zero3"],
            &["unknown config `zero3`", "single", "ddp", "fsdp.full_shard"],
        ),
        (
            &[
                "--model",
                "nested",
                "--config",
                "fsdp.hybrid_shard",
                "--world-size",
                "3",
            ],
            &["world size 3"],
        ),
        (
            &["--model", "moe", "--config", "single"],
            &["single cannot run model `moe`"],
        ),
        (
            &["--model", "nested", "--config", "ddp", "--world-size", "0"],
            &["--world-size 0"],
        ),
    ];
    for (args, wanted) in cases {
        let out = lockstep(args);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.stderr);
        for w in wanted {
            assert!(
                out.stderr.contains(w),
                "{args:?}: `{w}` not in: {}",
                out.stderr
            );
        }
    }
    // One state dict cannot start every rank of a model whose ranks differ by construction.
    let dir = scratch("moe");
    let same = dir.join("same.safetensors");
    let out = lockstep(&[
        "--model",
        "nested",
        "--config",
        "single",
        "--save-init",
        s(&same),
        "--save-final",
        s(&same),
    ]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(out.stderr.contains("would overwrite"), "{}", out.stderr);
    assert!(!same.exists());
    let state = dir.join("moe.safetensors");
    ok(&[
        "--model",
        "moe",
        "--config",
        "ddp",
        "--steps",
        "0",
        "--save-init",
        s(&state),
    ]);
    let out = lockstep(&["--model", "moe", "--config", "ddp", "--init", s(&state)]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("per-rank parameters (module.2.weight, module.2.bias)"),
        "{}",
        out.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// S1 steps with --save-final, then S2 more from that checkpoint, against S1 + S2 steps in
/// one go: the same losses and gradient norms, and the same final weights and momentum, bit
/// for bit.
fn assert_continuation_is_exact(model: &str, config: &str) {
    let dir = scratch(&format!("continue-{model}-{config}"));
    let (whole, first, second) = (
        dir.join("whole.safetensors"),
        dir.join("first.safetensors"),
        dir.join("second.safetensors"),
    );
    let common = [
        "--model",
        model,
        "--config",
        config,
        "--world-size",
        "2",
        "--seed",
        "5",
    ];
    let run = |steps: &str, extra: &[&str]| {
        let mut args = common.to_vec();
        args.extend(["--steps", steps]);
        args.extend(extra);
        json(&args)
    };
    let uninterrupted = run("4", &["--save-final", s(&whole)]);
    let head = run("2", &["--save-final", s(&first)]);
    // No --seed here: a continued run takes the checkpoint's.
    let mut args = vec![
        "--model",
        model,
        "--config",
        config,
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    args.extend(["--init", s(&first), "--save-final", s(&second)]);
    let tail = json(&args);

    assert_eq!(tail["start_step"], 2, "{tail}");
    assert_eq!(tail["resumed"], true, "{tail}");
    assert_eq!(tail["seed"], 5, "{tail}");
    let (all_losses, all_norms) = (
        floats(&uninterrupted, "losses"),
        floats(&uninterrupted, "grad_norms"),
    );
    let losses: Vec<f64> = [floats(&head, "losses"), floats(&tail, "losses")].concat();
    let norms: Vec<f64> = [floats(&head, "grad_norms"), floats(&tail, "grad_norms")].concat();
    assert_eq!(
        losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        all_losses.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{model} {config}: losses {losses:?} vs uninterrupted {all_losses:?}"
    );
    assert_eq!(
        norms.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        all_norms.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        "{model} {config}: grad norms {norms:?} vs uninterrupted {all_norms:?}"
    );
    assert_same_state(&whole, &second);
    assert_same_state(
        &dir.join("whole.optim.safetensors"),
        &dir.join("second.optim.safetensors"),
    );

    // The optimizer state is what makes it exact: restarting momentum from the same weights
    // takes another path.
    let restarted = dir.join("restarted.safetensors");
    let mut args = vec![
        "--model",
        model,
        "--config",
        config,
        "--world-size",
        "2",
        "--steps",
        "2",
    ];
    args.extend([
        "--init",
        s(&first),
        "--restart",
        "--save-final",
        s(&restarted),
    ]);
    let fresh = json(&args);
    assert_eq!(fresh["start_step"], 0, "{fresh}");
    let (restarted, whole) = (tensors(&restarted), tensors(&whole));
    assert!(
        restarted
            .iter()
            .any(|(name, t)| bytes(t) != bytes(&whole[name])),
        "{model} {config}: a fresh optimizer from the same weights reached the uninterrupted \
         run's weights, so the continuation check proves nothing about momentum"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn continuing_a_single_checkpoint_matches_the_uninterrupted_run_bitwise() {
    // The transformer has a tied weight and an int64 buffer: both must survive the trip.
    assert_continuation_is_exact("transformer", "single");
}

#[test]
fn continuing_a_ddp_checkpoint_matches_the_uninterrupted_run_bitwise() {
    assert_continuation_is_exact("nested", "ddp");
}

#[test]
fn continuing_a_mixed_precision_ddp_checkpoint_with_dropout_matches_bitwise() {
    // Dropout masks are keyed by step and bf16 compute casts fp32 masters: both resume.
    assert_continuation_is_exact("gpt_dropout", "ddp.bf16");
}

#[test]
fn sharded_configs_refuse_to_continue_an_optimizer_state_unless_restarted() {
    let dir = scratch("fsdp");
    let saved = dir.join("saved.safetensors");
    ok(&[
        "--model",
        "nested",
        "--config",
        "ddp",
        "--steps",
        "1",
        "--save-final",
        s(&saved),
    ]);
    let out = lockstep(&[
        "--model",
        "nested",
        "--config",
        "fsdp.full_shard",
        "--init",
        s(&saved),
    ]);
    assert_eq!(out.code, Some(2), "{}", out.stderr);
    assert!(
        out.stderr
            .contains("FSDP keeps each rank's optimizer state"),
        "{}",
        out.stderr
    );
    assert!(out.stderr.contains("--restart"), "{}", out.stderr);
    let fsdp_final = dir.join("fsdp.safetensors");
    let out = ok(&[
        "--model",
        "nested",
        "--config",
        "fsdp.full_shard",
        "--steps",
        "1",
        "--init",
        s(&saved),
        "--restart",
        "--save-final",
        s(&fsdp_final),
    ]);
    assert!(out.stdout.contains("note: --restart"), "{}", out.stdout);
    assert!(
        out.stdout.contains("the final state holds weights only"),
        "{}",
        out.stdout
    );
    assert!(fsdp_final.exists() && !dir.join("fsdp.optim.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn json_is_one_object_with_every_field() {
    let dir = scratch("json");
    let (init, fin) = (dir.join("init.safetensors"), dir.join("final.safetensors"));
    let v = json(&[
        "--model",
        "mlp",
        "--config",
        "ddp",
        "--world-size",
        "2",
        "--steps",
        "3",
        "--save-init",
        s(&init),
        "--save-final",
        s(&fin),
    ]);
    for key in [
        "model",
        "config",
        "world_size",
        "seed",
        "start_step",
        "steps",
        "losses",
        "grad_norms",
        "init",
        "resumed",
        "saved_init",
        "saved_final",
        "saved_optimizer_state",
        "notes",
    ] {
        assert!(v.get(key).is_some(), "`{key}` missing from {v}");
    }
    assert_eq!(v["model"], "mlp");
    assert_eq!(v["config"], "ddp");
    assert_eq!(v["world_size"], 2);
    assert_eq!(v["steps"], 3);
    assert_eq!(v["start_step"], 0);
    assert_eq!(v["resumed"], false);
    assert_eq!(floats(&v, "losses").len(), 3);
    assert!(floats(&v, "grad_norms")
        .iter()
        .all(|g| g.is_finite() && *g > 0.0));
    assert_eq!(v["saved_init"], s(&init));
    assert_eq!(v["saved_final"], s(&fin));
    assert_eq!(
        v["saved_optimizer_state"],
        s(&dir.join("final.optim.safetensors"))
    );
    // The optimizer state holds one momentum buffer per parameter, under PyTorch's entry name.
    let params = tensors(&fin);
    let momentum = tensors(&dir.join("final.optim.safetensors"));
    assert_eq!(
        momentum.keys().cloned().collect::<Vec<_>>(),
        params
            .keys()
            .map(|k| format!("{k}.momentum_buffer"))
            .collect::<Vec<_>>()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn twins(python: &str, site: &Option<PathBuf>, command: &str, dir: &Path) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/pytorch_twins.py");
    let mut cmd = Command::new(python);
    cmd.args(["-W", "ignore", s(&script), command, s(dir)]);
    if let Some(site) = site {
        cmd.env("PYTHONPATH", site);
    }
    let out = cmd.output().expect("run python");
    assert!(
        out.status.success(),
        "pytorch_twins.py {command}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn pytorch_twins_take_lockstep_state_and_hand_theirs_back() {
    let Some((python, site)) = common::python_with_torch() else {
        eprintln!("no Python with torch here (ci/setup-libtorch installs one): twin check not run");
        return;
    };
    let dir = scratch("twins");
    let models = [
        "nested",
        "transformer",
        "transformer_bn",
        "moe",
        "mlp",
        "gpt",
        "gpt_moe",
        "gpt_dropout",
    ];
    for model in models {
        let out = dir.join(format!("{model}.lockstep.safetensors"));
        ok(&[
            "--model",
            model,
            "--config",
            "ddp",
            "--world-size",
            "1",
            "--steps",
            "0",
            "--save-init",
            s(&out),
        ]);
    }
    // Every twin strict-loads Lockstep's state dict (keys, shapes and dtypes all match)...
    twins(&python, &site, "check", &dir);
    // ...and every state dict a twin writes starts a Lockstep run and comes back unchanged
    // (moe's per-rank expert aside: one state dict cannot start its ranks).
    twins(&python, &site, "write", &dir);
    for model in models.into_iter().filter(|m| *m != "moe") {
        let theirs = dir.join(format!("{model}.torch.safetensors"));
        let back = dir.join(format!("{model}.back.safetensors"));
        ok(&[
            "--model",
            model,
            "--config",
            "ddp",
            "--world-size",
            "1",
            "--steps",
            "0",
            "--init",
            s(&theirs),
            "--save-init",
            s(&back),
        ]);
        assert_same_state(&theirs, &back);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
