//! What an fp64 arbiter verdict reports: its constants and the distances behind it, per
//! quantity and per step. Data only, read by the comparison that carries it and written by
//! the arbiter that measures it.

use lockstep_core::num;
use serde::{Deserialize, Serialize};

/// The arbiter's two global constants.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// How many times the fp32 reference's own distance to float64 a run may be.
    pub k: f64,
    /// The floor, in units of fp32 rounding (2⁻²⁴) of the quantity's largest fp64 magnitude.
    pub floor_ulps: f64,
}

/// fp32's unit roundoff (2⁻²⁴): the unit of the arbiter's floor.
const F32_ROUNDOFF: f64 = 5.960_464_477_539_063e-8;

impl Envelope {
    /// The floor for a quantity whose largest fp64 magnitude is `scale`.
    pub fn floor(&self, scale: f64) -> f64 {
        self.floor_ulps * F32_ROUNDOFF * scale
    }

    /// The largest distance to float64 a run may have where the fp32 reference's own is
    /// `reference_to_f64`: `K` times it plus the floor.
    pub fn allowed(&self, reference_to_f64: f64, scale: f64) -> f64 {
        self.k * reference_to_f64 + self.floor(scale)
    }
}

/// The constants every verdict uses (docs/parity.md gives the measurements behind them).
pub const ENVELOPE: Envelope = Envelope {
    k: 16.0,
    floor_ulps: 8.0,
};

/// The distances behind one arbiter verdict.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnvelopePoint {
    /// `d(run, ref64)`.
    #[serde(with = "num")]
    pub run_to_f64: f64,
    /// `d(ref32, ref64)`: the fp32 reference's own rounding noise here (the largest among it
    /// and the fp32 variants measured beside it, [`ArbiterSummary::spread_from`]), or the
    /// largest it had for this quantity at an earlier step if that is larger (rounding noise
    /// accumulates; a step where the reference lands close to float64 by chance must not
    /// make the envelope collapse).
    #[serde(with = "num")]
    pub reference_to_f64: f64,
    /// The floor added to `K · d(ref32, ref64)`.
    #[serde(with = "num")]
    pub floor: f64,
    /// `d(run, ref64) / (K · d(ref32, ref64) + floor)`: at most 1 passes.
    #[serde(with = "num")]
    pub margin: f64,
    /// The K the verdict used.
    #[serde(default = "default_k")]
    pub k: f64,
}

fn default_k() -> f64 {
    ENVELOPE.k
}

/// What a row judged by the arbiter reports beside its verdict: the constants and where it
/// came closest to its envelope.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ArbiterSummary {
    /// The constants the verdict used.
    pub constants: Envelope,
    /// The quantity with the largest margin (`loss at step 3`, `gradient of `w` at step 1`...).
    pub worst_at: String,
    /// Its distances.
    pub worst: EnvelopePoint,
    /// The step at which the fp32 reference left fp32's range (a non-finite loss, norm or
    /// gradient: the training diverged): that step, the later ones and the final state are
    /// not judged, since the reference no longer stands for the math there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unjudged_from: Option<usize>,
    /// Set when the run's trajectory left its envelope and the row was judged step by step
    /// from the run's own state instead (the step-local check, docs/parity.md): where the
    /// trajectory first left it and by what margin. The verdict and every figure beside it
    /// are then the step-local check's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trajectory_left: Option<String>,
    /// The other correct fp32 runs of the same training (`single.mb2@2`...) whose distance to
    /// float64 was measured beside the fp32 reference's: the noise of each quantity is the
    /// largest of them (see [`arbitrate_with_spread`](super::arbitrate_with_spread)). Empty when the reference was the only
    /// sample.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spread_from: Vec<String>,
}

/// One step's distances, each relative to its tensor's fp64 magnitude and the worst over the
/// step's quantities, so the report can plot how noise and run grow together.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepEnvelope {
    /// Largest `d(run, ref64) / scale` over the step's quantities.
    #[serde(with = "num")]
    pub run_to_f64: f64,
    /// Largest `d(ref32, ref64) / scale` over the step's quantities.
    #[serde(with = "num")]
    pub reference_to_f64: f64,
    /// Largest margin over the step's quantities.
    #[serde(with = "num")]
    pub margin: f64,
}

impl StepEnvelope {
    pub(super) fn fold(&mut self, p: &EnvelopePoint, scale: f64) {
        let rel = |d: f64| if scale > 0.0 { d / scale } else { d };
        self.run_to_f64 = self.run_to_f64.max(rel(p.run_to_f64));
        self.reference_to_f64 = self.reference_to_f64.max(rel(p.reference_to_f64));
        self.margin = self.margin.max(p.margin);
    }
}
