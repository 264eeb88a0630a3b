//! Random numbers under tensor parallelism: Megatron's RNG tracker, and a parity mode that
//! draws exactly the bits a single device would.
//!
//! # Two streams
//!
//! | region | stream | why |
//! | --- | --- | --- |
//! | replicated activations (after a row-parallel reduction, residual stream, embeddings) | [`Stream::Shared`] | every rank holds the same tensor and must drop the same elements, or the replicas drift apart |
//! | TP-sharded activations (attention probabilities split by heads, a column-parallel output) | [`Stream::PerRank`] | each rank holds different elements; independent masks keep the shards' dropout independent, as one device's would be |
//! | sequence-parallel shards (LayerNorm/dropout on sequence chunks) | [`Stream::PerRank`] | different positions on every rank |
//!
//! Every seed is a deterministic function of (base seed, step, call-site key) — plus the TP
//! rank for [`Stream::PerRank`], whose base is offset by it as Megatron offsets its
//! model-parallel seed — so a run repeats bit for bit, and no call's draw depends on how many
//! numbers earlier calls consumed. A key must name its call site uniquely within a step
//! (e.g. `layers.3.attn.dropout`, with the micro-batch if there are several).
//!
//! # Parity mode
//!
//! Megatron's per-rank masks are a different random sample from a single device's: training
//! is statistically equivalent but not numerically comparable. In parity mode
//! ([`RngTracker::parity_dropout`]) every rank instead draws the *full* mask a single device
//! draws for the unsplit activation (from the shared stream: same seed everywhere) and keeps
//! the slice its shard covers; [`RngTracker::single_device_dropout`] draws the same full
//! masks on a single device. A parallel run with dropout then matches its single-device
//! reference bit for bit in the masks, at the cost of drawing full-size masks on every rank.
//!
//! Masks are drawn as `torch.nn.functional.dropout` draws them on the CPU (a Bernoulli
//! `1 − p` tensor of the activation's shape and dtype, divided by `1 − p`) from libtorch's
//! global generator, seeded and locked through [`lockstep_models::seed::seeded`].

use super::layers::TensorParallelError;
use lockstep_models::seed::seeded;
use tch::Tensor;

type Result<T> = std::result::Result<T, TensorParallelError>;

/// What Megatron adds to the base seed for its model-parallel (per-rank) stream.
const PER_RANK_OFFSET: u64 = 2718;

/// Which stream a draw comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The same on every rank of the TP group: for replicated regions.
    Shared,
    /// Different on every TP rank (seeded by base + 2718 + TP rank): for sharded regions.
    PerRank,
}

/// Megatron's RNG tracker without hidden state: seeds per (stream, step, key), so ranks that
/// agree on the base seed and the step agree on every shared draw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RngTracker {
    base_seed: u64,
    tp_rank: usize,
    step: u64,
}

/// A splitmix64 finalizer: spreads nearby inputs (ranks, steps) over the whole seed space.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a of the key: stable across Rust versions and platforms (std's hasher is not
/// guaranteed to be).
fn key_hash(key: &str) -> u64 {
    key.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01B3)
    })
}

fn check_p(p: f64) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(TensorParallelError::Invalid(format!(
            "dropout probability has to be between 0 and 1, got {p}"
        )))
    }
}

/// The scaled mask `torch.nn.functional.dropout` multiplies by, for `shape` and `kind`,
/// drawn from libtorch's generator seeded at `seed`.
fn draw_mask(seed: u64, p: f64, shape: &[i64], like: &Tensor) -> Result<Tensor> {
    let mask = seeded(seed, || -> std::result::Result<Tensor, tch::TchError> {
        let mut noise = Tensor::f_empty(shape, (like.kind(), like.device()))?;
        let _ = noise.f_bernoulli_float_(1.0 - p)?;
        Ok(noise)
    })?;
    Ok(mask.f_div_scalar(1.0 - p)?)
}

/// `x` times `mask`, with dropout's edge cases as libtorch has them (`p = 0`: `x` itself, no
/// draw; `p = 1`: zeros).
fn apply_dropout(x: &Tensor, p: f64, mask: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
    check_p(p)?;
    if p == 0.0 || x.numel() == 0 {
        return Ok(x.shallow_clone());
    }
    if p == 1.0 {
        return Ok(x.f_mul(&x.f_zeros_like()?)?);
    }
    Ok(x.f_mul(&mask()?)?)
}

impl RngTracker {
    /// A tracker for TP rank `tp_rank` of a run seeded with `base_seed`, at step 0.
    pub fn new(base_seed: u64, tp_rank: usize) -> Self {
        RngTracker {
            base_seed,
            tp_rank,
            step: 0,
        }
    }

    /// The tracker a single-device reference uses: TP rank 0 of a group of one, so its shared
    /// draws (and [`RngTracker::single_device_dropout`]) equal every TP rank's.
    pub fn single_device(base_seed: u64) -> Self {
        Self::new(base_seed, 0)
    }

    /// Moves to training step `step`: every step draws fresh masks.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The current step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The TP rank whose per-rank stream this tracker draws.
    pub fn tp_rank(&self) -> usize {
        self.tp_rank
    }

    /// The seed of the draw at call site `key` on `stream` in the current step.
    pub fn seed(&self, stream: Stream, key: &str) -> u64 {
        let base = match stream {
            Stream::Shared => self.base_seed,
            Stream::PerRank => self
                .base_seed
                .wrapping_add(PER_RANK_OFFSET)
                .wrapping_add(self.tp_rank as u64),
        };
        // The stream tag keeps base + 2718 + r on the per-rank stream from colliding with a
        // shared stream whose base seed happens to equal it.
        let tag = match stream {
            Stream::Shared => 0,
            Stream::PerRank => 1,
        };
        mix(mix(mix(base) ^ self.step) ^ key_hash(key)) ^ tag
    }

    /// Runs `f` with libtorch's generator seeded for (`stream`, `key`) and locked: for draws
    /// other than dropout (e.g. noise a layer adds).
    pub fn fork<T>(&self, stream: Stream, key: &str, f: impl FnOnce() -> T) -> T {
        seeded(self.seed(stream, key), f)
    }

    /// Dropout of `x` (this rank's tensor, full or shard) with a mask from `stream`: Megatron's
    /// behaviour, statistically but not numerically the single device's for sharded regions.
    pub fn dropout(&self, x: &Tensor, p: f64, stream: Stream, key: &str) -> Result<Tensor> {
        let seed = self.seed(stream, key);
        apply_dropout(x, p, || draw_mask(seed, p, &x.size(), x))
    }

    /// Parity-mode dropout: draws the full mask a single device draws at `key` for an
    /// activation of `full_shape` (shared stream), keeps `slice` = `(dim, start, len)` of it
    /// (`None`: the whole mask, for a replicated activation) and applies it to `x`, which
    /// must have the slice's shape.
    pub fn parity_dropout(
        &self,
        x: &Tensor,
        p: f64,
        key: &str,
        full_shape: &[i64],
        slice: Option<(i64, i64, i64)>,
    ) -> Result<Tensor> {
        let mut want = full_shape.to_vec();
        let cut = match slice {
            Some((dim, start, len)) => {
                let rank = full_shape.len() as i64;
                let d = if dim < 0 { rank + dim } else { dim };
                let size = (0..rank)
                    .contains(&d)
                    .then(|| full_shape[d as usize])
                    .ok_or_else(|| {
                        TensorParallelError::Shape(format!(
                            "parity dropout: dimension {dim} does not exist in the full shape \
                             {full_shape:?}"
                        ))
                    })?;
                if start < 0 || len < 0 || start + len > size {
                    return Err(TensorParallelError::Shape(format!(
                        "parity dropout: slice {start}..{} of dimension {dim} is outside its \
                         size {size}",
                        start + len
                    )));
                }
                want[d as usize] = len;
                Some((d, start, len))
            }
            None => None,
        };
        if x.size() != want {
            return Err(TensorParallelError::Shape(format!(
                "parity dropout: input of shape {:?} is not the slice {slice:?} of the full \
                 shape {full_shape:?} (expected {want:?})",
                x.size()
            )));
        }
        let seed = self.seed(Stream::Shared, key);
        apply_dropout(x, p, || {
            let full = draw_mask(seed, p, full_shape, x)?;
            Ok(match cut {
                Some((d, start, len)) => full.f_narrow(d, start, len)?,
                None => full,
            })
        })
    }

    /// Single-device dropout with the full masks [`RngTracker::parity_dropout`] slices: what
    /// a reference model calls where the parallel model calls parity dropout with the same
    /// key and step.
    pub fn single_device_dropout(&self, x: &Tensor, p: f64, key: &str) -> Result<Tensor> {
        self.parity_dropout(x, p, key, &x.size(), None)
    }
}
