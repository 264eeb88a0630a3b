//! Tolerance policies: when two numbers count as "the same" for a parity check.
//!
//! The default is PyTorch's `torch.testing.assert_close` table (a pair passes where
//! `|a − b| ≤ atol + rtol·|b|`), so a Lockstep verdict means what a PyTorch parity test's
//! verdict means. A bitwise mode exists for configurations that must be deterministic, and a
//! configuration may loosen its tolerance only with a written reason, so every relaxation is
//! visible in the report and in review.

use super::ParityError;
use lockstep_core::comm::DType;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Relative and absolute tolerance of one closeness check.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    /// Error allowed per unit of the reference's magnitude.
    pub rtol: f64,
    /// Error allowed regardless of magnitude (keeps values near zero comparable).
    pub atol: f64,
}

impl Tolerance {
    /// Exact equality: what integer and boolean tensors need.
    pub const EXACT: Tolerance = Tolerance {
        rtol: 0.0,
        atol: 0.0,
    };

    /// A tolerance; both parts must be finite and non-negative (checked where it is used in
    /// an [`Override`], the only place callers hand one in).
    pub const fn new(rtol: f64, atol: f64) -> Self {
        Tolerance { rtol, atol }
    }

    /// `torch.testing.assert_close`'s default for `dtype` (ANCHORS.md, "Tolerances").
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F16 => Tolerance::new(1e-3, 1e-5),
            DType::BF16 => Tolerance::new(1.6e-2, 1e-5),
            DType::F32 => Tolerance::new(1.3e-6, 1e-5),
            DType::F64 => Tolerance::new(1e-7, 1e-7),
            DType::I64 | DType::I32 | DType::U8 | DType::Bool => Tolerance::EXACT,
        }
    }

    /// The largest `|actual − expected|` that passes, given the reference value `expected`.
    pub fn allowed(&self, expected: f64) -> f64 {
        self.atol + self.rtol * expected.abs()
    }

    fn validate(&self) -> Result<(), ParityError> {
        let ok = |x: f64| x.is_finite() && x >= 0.0;
        if ok(self.rtol) && ok(self.atol) {
            Ok(())
        } else {
            Err(ParityError::InvalidTolerance {
                rtol: self.rtol,
                atol: self.atol,
            })
        }
    }
}

/// Orders dtypes by how loose their default tolerance is, so "the looser of the two wins"
/// is a comparison of ranks.
fn looseness(dtype: DType) -> u8 {
    match dtype {
        DType::BF16 => 5,
        DType::F16 => 4,
        DType::F32 => 3,
        DType::F64 => 2,
        DType::I64 | DType::I32 | DType::U8 | DType::Bool => 1,
    }
}

/// The dtype whose default tolerance is looser: comparing an fp32 run against a bf16 one
/// can only promise bf16 closeness.
pub fn looser_dtype(a: DType, b: DType) -> DType {
    if looseness(b) > looseness(a) {
        b
    } else {
        a
    }
}

/// How values are judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// `|a − b| ≤ atol + rtol·|b|` with the dtype table (or an override).
    Tolerance,
    /// Every value identical bit for bit (a signed zero counts; NaNs are equal whatever their
    /// payload, which the CPU chooses): for
    /// configurations promised to be deterministic against their reference.
    Bitwise,
    /// The fp64 arbiter ([`arbitrate`](super::arbitrate)): each quantity's distance to a
    /// float64 shadow of the reference, within a multiple of the fp32 reference's own.
    Arbiter,
}

/// What a value being compared is, so overrides can target, say, only gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Quantity {
    /// The global loss at each step.
    Loss,
    /// The global gradient norm at each step.
    GradNorm,
    /// The full parameters after the last step.
    Params,
    /// The full gradients at each step (when both runs recorded them).
    Grads,
}

impl Quantity {
    /// Every quantity, in the order the engine checks them.
    pub const ALL: [Quantity; 4] = [
        Quantity::Loss,
        Quantity::GradNorm,
        Quantity::Grads,
        Quantity::Params,
    ];
}

impl std::fmt::Display for Quantity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quantity::Loss => "loss",
            Quantity::GradNorm => "grad_norm",
            Quantity::Params => "params",
            Quantity::Grads => "grads",
        })
    }
}

/// A written justification. It can only be built non-empty, so an [`Override`] without one
/// cannot exist — in code or in a deserialized file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Reason(String);

impl Reason {
    /// A reason, or [`ParityError::MissingReason`] if `text` is blank.
    pub fn new(text: impl Into<String>) -> Result<Self, ParityError> {
        let text = text.into();
        if text.trim().is_empty() {
            Err(ParityError::MissingReason)
        } else {
            Ok(Reason(text))
        }
    }

    /// The justification as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for Reason {
    type Error = ParityError;
    fn try_from(text: String) -> Result<Self, ParityError> {
        Reason::new(text)
    }
}

impl From<Reason> for String {
    fn from(r: Reason) -> String {
        r.0
    }
}

/// A per-configuration replacement tolerance. It applies in place of the dtype table (and in
/// place of bitwise mode) for the quantities it names, and its reason is printed with every
/// verdict it influenced.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Override {
    tolerance: Tolerance,
    reason: Reason,
    /// Quantities it applies to; empty means all.
    #[serde(default)]
    only: Vec<Quantity>,
}

impl Override {
    /// An override for every quantity; fails without a non-empty `reason` or with a negative
    /// or non-finite tolerance.
    pub fn new(tolerance: Tolerance, reason: &str) -> Result<Self, ParityError> {
        tolerance.validate()?;
        Ok(Override {
            tolerance,
            reason: Reason::new(reason)?,
            only: Vec::new(),
        })
    }

    /// Restricts the override to `quantities` (e.g. only gradients, as PyTorch's pipeline
    /// tests loosen them to rtol 1e-5 / atol 4e-5).
    pub fn only(mut self, quantities: &[Quantity]) -> Self {
        self.only = quantities.to_vec();
        self
    }

    /// The replacement tolerance.
    pub fn tolerance(&self) -> Tolerance {
        self.tolerance
    }

    /// Why this configuration needs it.
    pub fn reason(&self) -> &str {
        self.reason.as_str()
    }

    /// Whether it governs `q`.
    pub fn applies_to(&self, q: Quantity) -> bool {
        self.only.is_empty() || self.only.contains(&q)
    }
}

/// How one value pair is judged: derived from the policy for a given configuration, quantity
/// and dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Check {
    /// Closeness under this tolerance.
    Close(Tolerance),
    /// Bit-for-bit identity.
    Bitwise,
}

/// The tolerance policy of a parity matrix: mode, the dtype of scalar series, and the
/// justified per-configuration overrides.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TolerancePolicy {
    mode: Mode,
    scalar_dtype: DType,
    #[serde(default)]
    overrides: BTreeMap<String, Override>,
}

impl TolerancePolicy {
    /// The dtype table; losses and gradient norms are judged as `scalar_dtype` (the precision
    /// the run computes them in, e.g. bf16 for a bf16 policy).
    pub fn dtype_table(scalar_dtype: DType) -> Self {
        TolerancePolicy {
            mode: Mode::Tolerance,
            scalar_dtype,
            overrides: BTreeMap::new(),
        }
    }

    /// Bit-for-bit identity everywhere (overrides still apply where given).
    pub fn bitwise(scalar_dtype: DType) -> Self {
        TolerancePolicy {
            mode: Mode::Bitwise,
            scalar_dtype,
            overrides: BTreeMap::new(),
        }
    }

    /// Adds an override for the configuration named `config` (a [`RunSpec::config`]).
    /// Replaces an earlier override of the same configuration.
    ///
    /// [`RunSpec::config`]: lockstep_core::record::RunSpec::config
    pub fn with_override(mut self, config: &str, ov: Override) -> Self {
        self.overrides.insert(config.to_owned(), ov);
        self
    }

    /// The policy's mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// The dtype losses and gradient norms are judged in.
    pub fn scalar_dtype(&self) -> DType {
        self.scalar_dtype
    }

    /// The override for `config`, if any.
    pub fn override_for(&self, config: &str) -> Option<&Override> {
        self.overrides.get(config)
    }

    /// How a `quantity` of `config` in `dtype` is judged.
    pub fn check(&self, config: &str, quantity: Quantity, dtype: DType) -> Check {
        if let Some(ov) = self.override_for(config).filter(|o| o.applies_to(quantity)) {
            return Check::Close(ov.tolerance);
        }
        match self.mode {
            Mode::Bitwise => Check::Bitwise,
            // No policy is built in arbiter mode (arbitrate takes no policy); the table is the
            // closest meaning should one be deserialized.
            Mode::Tolerance | Mode::Arbiter => Check::Close(Tolerance::for_dtype(dtype)),
        }
    }
}

/// Distance in units in the last place between `a` and `b` once both are rounded to `dtype`:
/// how many representable values lie between them. `+0` and `−0` are 0 apart; a NaN is
/// `u64::MAX` from everything (including another NaN). Integer dtypes count integer steps.
pub fn ulp_distance(a: f64, b: f64, dtype: DType) -> u64 {
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    match dtype {
        DType::F64 => ordered(a.to_bits(), 64).abs_diff(ordered(b.to_bits(), 64)) as u64,
        DType::F32 => ordered((a as f32).to_bits() as u64, 32)
            .abs_diff(ordered((b as f32).to_bits() as u64, 32)) as u64,
        DType::BF16 => ordered(half::bf16::from_f64(a).to_bits() as u64, 16)
            .abs_diff(ordered(half::bf16::from_f64(b).to_bits() as u64, 16))
            as u64,
        DType::F16 => ordered(half::f16::from_f64(a).to_bits() as u64, 16)
            .abs_diff(ordered(half::f16::from_f64(b).to_bits() as u64, 16))
            as u64,
        DType::I64 | DType::I32 | DType::U8 | DType::Bool => {
            let d = (a - b).abs().round();
            if d >= u64::MAX as f64 {
                u64::MAX
            } else {
                d as u64
            }
        }
    }
}

/// Maps IEEE sign-magnitude bits of a `width`-bit float to an integer that orders like the
/// float: positives keep their magnitude, negatives become its negation, and both zeros 0.
fn ordered(bits: u64, width: u32) -> i128 {
    let sign = 1u64 << (width - 1);
    let magnitude = (bits & (sign - 1)) as i128;
    if bits & sign != 0 {
        -magnitude
    } else {
        magnitude
    }
}
