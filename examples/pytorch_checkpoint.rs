//! A user's PyTorch checkpoint as the starting point of a Lockstep run, and the trained state
//! back out under the same names.
//!
//! The checkpoint is written the way `safetensors.torch.save_file(model.state_dict(), path)`
//! leaves it for the zoo's `nested` model, whose PyTorch twin is (examples/pytorch_twins.py):
//!
//! ```python
//! class NestedWrappedModule(nn.Module):
//!     def __init__(self):
//!         super().__init__()
//!         self.module = nn.Sequential(
//!             nn.Linear(8, 4),
//!             nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
//!             nn.Linear(16, 4),
//!             nn.Linear(4, 8),
//!         )
//! ```
//!
//! Lockstep then trains it under DDP on 2 ranks and on one process over the same global batch
//! (`lockstep run --init`), and the example checks that both started from exactly the user's
//! weights, agree with each other, and hand back a state dict the twin loads.
//!
//! ```sh
//! cargo run --example pytorch_checkpoint
//! cargo nextest run --example pytorch_checkpoint
//! ```

use lockstep::models::zoo;
use lockstep::run_cmd::{self, RunOptions, RunOutcome};
use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tch::{Kind, Tensor};

/// The twin's linears: module path, in_features, out_features.
const TWIN: [(&str, i64, i64); 5] = [
    ("module.0", 8, 4),
    ("module.1.0", 4, 16),
    ("module.1.1", 16, 16),
    ("module.2", 16, 4),
    ("module.3", 4, 8),
];
const WORLD_SIZE: usize = 2;
const STEPS: usize = 3;

/// What the example found.
struct Outcome {
    ddp: RunOutcome,
    single: RunOutcome,
    /// The loss of the user's weights on the first global batch, computed directly.
    first_loss: f64,
}

/// Writes the checkpoint a user's PyTorch training would have left: the twin's state dict
/// under its `state_dict()` names (values from the user's own initialization and training,
/// here a seeded draw), no Lockstep metadata.
fn write_user_checkpoint(path: &Path) -> Result<Vec<(String, Tensor)>, Box<dyn Error>> {
    tch::manual_seed(2024);
    let mut tensors = Vec::new();
    for (module, fan_in, fan_out) in TWIN {
        let bound = 1.0 / (fan_in as f64).sqrt();
        let f = (Kind::Float, tch::Device::Cpu);
        let weight = Tensor::f_empty([fan_out, fan_in], f)?.f_uniform_(-bound, bound)?;
        let bias = Tensor::f_empty([fan_out], f)?.f_uniform_(-bound, bound)?;
        tensors.push((format!("{module}.weight"), weight));
        tensors.push((format!("{module}.bias"), bias));
    }
    Tensor::write_safetensors(&tensors, path)?;
    Ok(tensors)
}

/// `lockstep run --model nested --config CONFIG --world-size 2 --steps 3 --init CHECKPOINT`,
/// saving the initial and final state dicts under `dir`.
fn run_from(config: &str, checkpoint: &Path, dir: &Path) -> Result<RunOutcome, Box<dyn Error>> {
    Ok(run_cmd::run(&RunOptions {
        model: "nested".into(),
        config: config.into(),
        world_size: WORLD_SIZE,
        steps: STEPS,
        seed: None,
        init: Some(checkpoint.to_owned()),
        restart: false,
        save_init: Some(dir.join(format!("{config}.init.safetensors"))),
        save_final: Some(dir.join(format!("{config}.final.safetensors"))),
        timeout: Duration::from_secs(120),
        device: Default::default(),
        tf32: false,
    })?)
}

/// The mean over ranks of the first step's loss with the user's weights, computed with the
/// zoo model directly (in fp32, as the training loop sums and divides it): what the run's
/// first recorded loss must be if it started from them.
fn first_global_loss(checkpoint: &Path) -> Result<f64, Box<dyn Error>> {
    let mut model = zoo::build("nested", 0, 0)?;
    model.load(checkpoint)?;
    let mut total = model.loss(&model.input(0, 0)?)?;
    for rank in 1..WORLD_SIZE {
        total = total.f_add(&model.loss(&model.input(rank, 0)?)?)?;
    }
    Ok(total.f_div_scalar(WORLD_SIZE as f64)?.f_double_value(&[])?)
}

fn start_from_pytorch_checkpoint(dir: &Path) -> Result<Outcome, Box<dyn Error>> {
    std::fs::create_dir_all(dir)?;
    let checkpoint = dir.join("user.safetensors");
    let user = write_user_checkpoint(&checkpoint)?;
    let ddp = run_from("ddp", &checkpoint, dir)?;
    let single = run_from("single", &checkpoint, dir)?;

    // Both runs started from exactly the user's tensors, under the user's names.
    for config in ["ddp", "single"] {
        let saved = Tensor::read_safetensors(dir.join(format!("{config}.init.safetensors")))?;
        assert_eq!(saved.len(), user.len(), "{config}: initial state's keys");
        for (name, t) in &user {
            let (_, s) = saved
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| format!("{config}: `{name}` missing from the initial state"))?;
            assert!(s.equal(t), "{config}: `{name}` is not the user's tensor");
        }
        // The final state dict has the twin's keys and shapes, so
        // `twin.load_state_dict(load_file(path))` takes it back, and training moved it.
        let trained = Tensor::read_safetensors(dir.join(format!("{config}.final.safetensors")))?;
        assert_eq!(trained.len(), user.len(), "{config}: final state's keys");
        for (name, t) in &user {
            let (_, f) = trained
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| format!("{config}: `{name}` missing from the final state"))?;
            assert_eq!(f.size(), t.size(), "{config}: `{name}`'s shape");
            assert!(!f.equal(t), "{config}: `{name}` did not train");
        }
    }
    let first_loss = first_global_loss(&checkpoint)?;
    Ok(Outcome {
        ddp,
        single,
        first_loss,
    })
}

/// Checks what the runs must show: the first loss is the user's weights' loss (bitwise on one
/// process, up to the all-reduce's rounding under DDP), and DDP tracks one process step by
/// step within fp32 rounding.
fn check(outcome: &Outcome) {
    assert_eq!(outcome.single.losses.len(), STEPS);
    assert_eq!(outcome.ddp.losses.len(), STEPS);
    assert_eq!(
        outcome.single.losses[0], outcome.first_loss,
        "single's first loss is the user's weights' loss"
    );
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * (1.0 + a.abs().max(b.abs()));
    assert!(
        close(outcome.ddp.losses[0], outcome.first_loss),
        "ddp's first loss {} vs the user's weights' loss {}",
        outcome.ddp.losses[0],
        outcome.first_loss
    );
    for (step, (d, s)) in outcome
        .ddp
        .losses
        .iter()
        .zip(&outcome.single.losses)
        .enumerate()
    {
        assert!(close(*d, *s), "step {step}: ddp loss {d} vs single {s}");
    }
}

fn scratch_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("lockstep-{tag}-{}", std::process::id()))
}

fn main() -> Result<(), Box<dyn Error>> {
    let dir = scratch_dir("pytorch-checkpoint-example");
    let outcome = start_from_pytorch_checkpoint(&dir)?;
    check(&outcome);
    println!(
        "nested from {}: first loss {} (the user's weights)",
        dir.join("user.safetensors").display(),
        outcome.first_loss
    );
    println!(
        "{:>4}  {:<22}  {:<22}",
        "step", "ddp@2 loss", "single@2 loss"
    );
    for (step, (d, s)) in outcome
        .ddp
        .losses
        .iter()
        .zip(&outcome.single.losses)
        .enumerate()
    {
        println!("{step:>4}  {d:<22}  {s:<22}");
    }
    println!(
        "trained state dicts (PyTorch names): {}, {}",
        dir.join("ddp.final.safetensors").display(),
        dir.join("single.final.safetensors").display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pytorch_state_dict_starts_ddp_and_single_and_comes_back_out() {
        let dir = scratch_dir("pytorch-checkpoint-test");
        let outcome = start_from_pytorch_checkpoint(&dir).expect("the runs complete");
        let _ = std::fs::remove_dir_all(&dir);
        check(&outcome);
    }
}
