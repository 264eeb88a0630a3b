//! Lockstep's references are PyTorch's arithmetic, bit for bit: the single-device reference
//! of `nested`, `mlp`, `transformer`, `gpt` and `gpt_moe` (world size 2, 5 steps, SGD with
//! momentum, one thread; `mlp` and `gpt` with Adam too) ends with exactly the per-step
//! losses and the parameters PyTorch 2.13's twins
//! (`examples/pytorch_twins.py train`) reach from the same state and batches, and the
//! vocabulary-parallel cross-entropy's loss and gradient are exactly those of PyTorch's own
//! `loss_parallel` on the same shards (`examples/pytorch_twins.py ce`, gloo ranks).
//!
//! Both need a Python with torch (`ci/setup-libtorch` installs one); without it they print
//! why and pass, as `tests/run_cli.rs`'s twin check does.

use crate::common;

use anyhow::{ensure, Context, Result};
use lockstep::checkpoint::{model_state_dict, save_model_state};
use lockstep_core::tensor_parallel::{vocab_parallel_cross_entropy, Reduction};
use lockstep_core::train::{single_device_reference, OptimizerConfig};
use lockstep_models::seed::seeded;
use lockstep_models::zoo;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// The models whose single-device reference the twins replay.
const MODELS: [&str; 5] = ["nested", "mlp", "transformer", "gpt", "gpt_moe"];
const WORLD: usize = 2;
const STEPS: usize = 5;
const SEED: u64 = 3;

/// Runs `pytorch_twins.py COMMAND DIR` and insists it succeeded.
fn twins(python: &str, site: &Option<PathBuf>, command: &str, dir: &Path) -> Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/pytorch_twins.py");
    let out = common::torch_python(python, site)
        .arg(&script)
        .arg(command)
        .arg(dir)
        .output()
        .context("run python")?;
    ensure!(
        out.status.success(),
        "pytorch_twins.py {command}: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

fn read(path: &Path) -> Result<HashMap<String, Tensor>> {
    Ok(Tensor::read_safetensors(path)
        .with_context(|| format!("read {}", path.display()))?
        .into_iter()
        .collect())
}

/// `None` when `got` and `want` hold the same bits (shape, dtype and every element, the sign
/// of zero included); otherwise what differs.
fn bit_difference(got: &Tensor, want: &Tensor) -> Option<String> {
    if got.size() != want.size() || got.kind() != want.kind() {
        return Some(format!(
            "{:?} {:?} against {:?} {:?}",
            got.kind(),
            got.size(),
            want.kind(),
            want.size()
        ));
    }
    let bits = |t: &Tensor| t.detach().contiguous().view_dtype(Kind::Int);
    if bits(got).equal(&bits(want)) {
        return None;
    }
    let diff = (got.detach().to_kind(Kind::Double) - want.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    Some(format!("differs, max |diff| {diff:e}"))
}

/// A trained reference: its per-step losses and its parameters after the last step.
type Trained = (Vec<f64>, Vec<(String, Tensor)>);

/// The Adam runs' learning rate (PyTorch's default betas and eps).
const ADAM_LR: f64 = 0.01;

/// Writes `name`'s initial state and every batch the reference trains on to `dir` under the
/// run's name (`name`, or `name+adam` with `adam`), then trains the reference; returns its
/// losses and the trained model's parameters.
fn lockstep_side(name: &str, adam: bool, dir: &Path) -> Result<Trained> {
    let model = zoo::build(name, SEED, 0)?;
    let run = if adam {
        format!("{name}+adam")
    } else {
        name.to_owned()
    };
    save_model_state(
        &dir.join(format!("{run}.init.safetensors")),
        &model_state_dict(model.as_ref()),
        name,
        0,
        None,
    )?;
    let mut batches = vec![
        ("steps".to_owned(), Tensor::from(STEPS as i64)),
        ("world_size".to_owned(), Tensor::from(WORLD as i64)),
    ];
    let optimizer = if adam {
        batches.push(("adam_lr".to_owned(), Tensor::from(ADAM_LR)));
        OptimizerConfig::adam(ADAM_LR)
    } else {
        OptimizerConfig::default()
    };
    for step in 0..STEPS {
        for rank in 0..WORLD {
            let batch = model.input(rank, step)?;
            for (k, t) in batch.inputs.iter().enumerate() {
                batches.push((format!("{step}.{rank}.input.{k}"), t.contiguous()));
            }
            if let Some(t) = &batch.target {
                batches.push((format!("{step}.{rank}.target"), t.contiguous()));
            }
        }
    }
    Tensor::write_safetensors(&batches, dir.join(format!("{run}.batches.safetensors")))?;
    let record = single_device_reference(model.as_ref(), WORLD, STEPS, optimizer, false)?;
    Ok((record.losses, model.named_parameters()))
}

#[test]
fn single_device_reference_is_pytorchs_arithmetic() -> Result<()> {
    let Some((python, site)) = common::python_with_torch() else {
        eprintln!("no Python with torch here (ci/setup-libtorch installs one): twins not trained");
        return Ok(());
    };
    // PyTorch's twin trains on one thread: so does the reference (reductions split across
    // threads round differently).
    tch::set_num_threads(1);
    let dir = std::env::temp_dir().join(format!("lockstep-twins-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // Every model with SGD (Lockstep's default), and two with Adam.
    let runs = MODELS
        .iter()
        .map(|m| (*m, false))
        .chain([("mlp", true), ("gpt", true)]);
    let mut ours = Vec::new();
    for (name, adam) in runs {
        let run = if adam {
            format!("{name}+adam")
        } else {
            name.to_owned()
        };
        ours.push((run, lockstep_side(name, adam, &dir)?));
    }
    twins(&python, &site, "train", &dir)?;

    let mut differences = Vec::new();
    for (name, (losses, params)) in ours {
        let theirs = read(&dir.join(format!("{name}.trained.safetensors")))?;
        let their_losses = Vec::<f32>::try_from(&theirs["losses"])?;
        ensure!(
            their_losses.len() == losses.len(),
            "{name}: {} PyTorch losses",
            their_losses.len()
        );
        for (step, (ours, theirs)) in losses.iter().zip(&their_losses).enumerate() {
            if ours.to_bits() != f64::from(*theirs).to_bits() {
                differences.push(format!(
                    "{name}: loss at step {step}: {ours:e} against PyTorch's {theirs:e}"
                ));
            }
        }
        ensure!(
            theirs.len() == params.len() + 1,
            "{name}: PyTorch has {} parameters, Lockstep {}",
            theirs.len() - 1,
            params.len()
        );
        for (key, p) in &params {
            let want = theirs
                .get(key)
                .with_context(|| format!("{name}: PyTorch has no `{key}`"))?;
            if let Some(d) = bit_difference(p, want) {
                differences.push(format!("{name}: {key}: {d}"));
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    ensure!(
        differences.is_empty(),
        "not PyTorch's bits:\n{}",
        differences.join("\n")
    );
    Ok(())
}

/// The vocabulary-parallel cross-entropy (mean and sum) on `tp` ranks: its loss and each
/// rank's logits gradient (of `1.7·loss`) hold exactly the bits PyTorch's `loss_parallel`
/// computes on the same shards over gloo.
#[test]
fn vocab_parallel_cross_entropy_is_loss_parallels_arithmetic_tp_1() {
    vocab_parallel_cross_entropy_is_loss_parallels_arithmetic(1);
}

/// [`vocab_parallel_cross_entropy_is_loss_parallels_arithmetic_tp_1`] split over two ranks.
#[test]
fn vocab_parallel_cross_entropy_is_loss_parallels_arithmetic_tp_2() {
    vocab_parallel_cross_entropy_is_loss_parallels_arithmetic(2);
}

fn vocab_parallel_cross_entropy_is_loss_parallels_arithmetic(tp: usize) {
    let Some((python, site)) = common::python_with_torch() else {
        eprintln!("no Python with torch here (ci/setup-libtorch installs one): not compared");
        return;
    };
    // One directory for the run: every rank process derives the same path.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pytorch-twins-ce-{tp}"));
    lockstep_harness::Run::new(tp)
        .timeout(Duration::from_secs(600))
        .run(|ctx| -> Result<()> {
            tch::set_num_threads(1);
            let rank = ctx.rank();
            let group = ctx.group();
            let (n, vocab) = (12, 16);
            let logits = seeded(41, || Tensor::randn([n, vocab], (Kind::Float, Device::Cpu))) * 3.0;
            // Targets in every rank's columns, the largest logit's column included.
            let target = Tensor::from_slice(&[0i64, 15, 4, 11, 7, 8, 3, 12, 1, 14, 5, 10]);
            let scale = 1.7;
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir)?;
                Tensor::write_safetensors(
                    &[
                        ("logits", logits.shallow_clone()),
                        ("target", target.shallow_clone()),
                        ("world", Tensor::from(tp as i64)),
                        ("scale", Tensor::from(scale)),
                    ],
                    dir.join("ce.inputs.safetensors"),
                )?;
                twins(&python, &site, "ce", &dir)?;
            }
            group.barrier()?;
            let theirs = read(&dir.join(format!("ce.torch.{rank}.safetensors")))?;
            let width = vocab / tp as i64;
            for (reduction, key) in [(Reduction::Mean, "mean"), (Reduction::Sum, "sum")] {
                let shard = logits
                    .narrow(1, rank as i64 * width, width)
                    .detach()
                    .copy()
                    .set_requires_grad(true);
                let loss = vocab_parallel_cross_entropy(
                    &shard,
                    &target,
                    rank as i64 * width,
                    &group,
                    reduction,
                )?;
                (&loss * scale).backward();
                for (what, got) in [("loss", loss.detach()), ("grad", shard.grad())] {
                    let want = &theirs[&format!("{key}.{what}")];
                    if let Some(d) = bit_difference(&got, want) {
                        anyhow::bail!("{key} {what} on rank {rank} of {tp}: {d}");
                    }
                }
            }
            Ok(())
        });
}
