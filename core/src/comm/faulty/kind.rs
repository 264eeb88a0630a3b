//! What to inject and where: the kinds of fault ([`FaultKind`]), the call one goes to
//! ([`FaultSite`]) and whether an injector injects at all ([`FaultMode`]).
//!
//! Apart from the injector because these are the plan a launcher writes and reads back
//! (serialized), with no tensors or groups in them.

use serde::{Deserialize, Serialize};

/// How a faulted call's result goes wrong. Each is a bug a real implementation has had.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// The call's result is dropped: the rank keeps what its tensor held before (a missed
    /// synchronization). A send cannot be skipped without leaving its receiver waiting, so
    /// sends are not skipped.
    Skip,
    /// The result is doubled (a sum where an average was meant, a reduction applied twice).
    Double,
    /// The result is all zeros (a buffer never filled, a wrong output tensor).
    Zero,
    /// Another rank's contribution stands where this one's belongs: an all-gather's or
    /// all-to-all's chunks rotated by one rank, a broadcast from root + 1 (on the one rank
    /// that holds that tensor), a receive answered by an earlier message from another peer.
    WrongPeer,
    /// Chunks in a swapped order: the first two chunks of an all-gather's or all-to-all's
    /// output exchanged, or of the input this rank contributes to a reduce-scatter.
    PermutedChunks,
    /// The result of the previous call on the same group with the same shape and dtype
    /// (last step's gradients, an earlier microbatch's activations).
    Stale,
    /// The result's largest-magnitude element multiplied by `1 + ε`: the smallest error a
    /// test can be asked to see.
    Perturb(f64),
    /// The result rounded through bfloat16 (a reduction run in low precision).
    Bf16Reduction,
}

impl FaultKind {
    /// The faults that change the mathematics (as opposed to the rounding, which
    /// [`FaultKind::Perturb`] and [`FaultKind::Bf16Reduction`] model): every parity test
    /// must catch these at every site where they change something.
    pub const MATH_CHANGING: [FaultKind; 6] = [
        FaultKind::Skip,
        FaultKind::Double,
        FaultKind::Zero,
        FaultKind::WrongPeer,
        FaultKind::PermutedChunks,
        FaultKind::Stale,
    ];

    /// Every kind, with `eps` for the perturbation.
    pub fn all(eps: f64) -> Vec<FaultKind> {
        let mut all = Self::MATH_CHANGING.to_vec();
        all.push(FaultKind::Perturb(eps));
        all.push(FaultKind::Bf16Reduction);
        all
    }

    /// The kind's name without its parameter (`perturb` for every ε), for table columns.
    pub fn label(&self) -> &'static str {
        match self {
            FaultKind::Skip => "skip",
            FaultKind::Double => "double",
            FaultKind::Zero => "zero",
            FaultKind::WrongPeer => "wrong_peer",
            FaultKind::PermutedChunks => "permuted",
            FaultKind::Stale => "stale",
            FaultKind::Perturb(_) => "perturb",
            FaultKind::Bf16Reduction => "bf16",
        }
    }

    /// Whether this is one of [`FaultKind::MATH_CHANGING`].
    pub fn changes_math(&self) -> bool {
        Self::MATH_CHANGING.contains(self)
    }
}

impl std::fmt::Display for FaultKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FaultKind::Perturb(eps) => write!(f, "perturb={eps:e}"),
            other => f.write_str(other.label()),
        }
    }
}

impl std::str::FromStr for FaultKind {
    type Err = String;
    /// `skip`, `double`, `zero`, `wrong_peer`, `permuted`, `stale`, `bf16`, `perturb=EPS`.
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(eps) = s.strip_prefix("perturb=") {
            return match eps.parse::<f64>() {
                Ok(e) if e.is_finite() && e != 0.0 => Ok(FaultKind::Perturb(e)),
                _ => Err(format!(
                    "perturb={eps}: ε must be a finite, non-zero number"
                )),
            };
        }
        Self::all(1e-3)
            .into_iter()
            .find(|k| k.label() == s && !matches!(k, FaultKind::Perturb(_)))
            .ok_or_else(|| {
                format!(
                    "unknown fault `{s}`; known: skip, double, zero, wrong_peer, permuted, \
                     stale, bf16, perturb=EPS"
                )
            })
    }
}

/// Where a fault goes: one call of one rank (see the [module documentation](super) for the
/// numbering).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FaultSite {
    /// The training step the rank's loop was in when it issued the call.
    pub step: usize,
    /// The call's position among this rank's data-carrying calls of that step, from 0.
    pub index: usize,
    /// The global rank that issued it.
    pub rank: usize,
}

impl std::fmt::Display for FaultSite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "step {} call {} rank {}",
            self.step, self.index, self.rank
        )
    }
}

/// What an injector does with the calls it sees.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum FaultMode {
    /// Alter nothing; log every call (the dry run that enumerates the sites).
    Record,
    /// Alter the call at `site` with `kind`; log every call too.
    Inject {
        /// The call to corrupt.
        site: FaultSite,
        /// How.
        kind: FaultKind,
    },
}
