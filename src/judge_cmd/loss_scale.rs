//! A recorded loss off by a whole factor while the training is right: every gradient, every
//! gradient norm and every parameter within their envelopes, the loss a constant whole
//! multiple (or fraction) of the references' at every step. The ranks' losses were combined
//! the wrong way (`Recorder(loss_reduction=...)`), not trained wrong; the judge says so
//! rather than leave the reader to hunt a bug in the gradients.

use lockstep_core::record::RunRecord;
use lockstep_harness::parity::Comparison;

/// How close a ratio must be to a whole number (relatively) to be called one: the losses of
/// a correct job agree with its references' to far better than this.
const WHOLE: f64 = 1e-6;

/// The finding, in words, when `comparison` failed on its loss alone and the run's loss is
/// a whole multiple or fraction of the reference's at every step.
pub fn finding(comparison: &Comparison, run: &RunRecord, reference: &RunRecord) -> Option<String> {
    let training_within = comparison.grad_norms.passed
        && comparison.params.passed
        && comparison.grads.as_ref().is_none_or(|g| g.passed)
        && comparison
            .cross_rank
            .as_ref()
            .is_none_or(|c| c.mismatch.is_none());
    if comparison.passed || comparison.losses.passed || !training_within {
        return None;
    }
    let ratios: Vec<f64> = run
        .losses
        .iter()
        .zip(&reference.losses)
        .filter(|(_, r)| r.is_finite() && **r != 0.0)
        .map(|(a, r)| a / r)
        .collect();
    let first = *ratios.first()?;
    if !ratios
        .iter()
        .all(|r| (r - first).abs() <= WHOLE * first.abs())
    {
        return None;
    }
    let (factor, larger) = if first >= 1.0 {
        (first, true)
    } else {
        (1.0 / first, false)
    };
    let whole = factor.round();
    if whole < 2.0 || (factor - whole).abs() > WHOLE * whole {
        return None;
    }
    let (times, likely) = match larger {
        true => (
            format!("{whole} times"),
            "the ranks' losses were summed (loss_reduction=\"sum\") while each is its own \
             mean, or summed over ranks that share one loss (tensor parallelism)",
        ),
        false => (
            format!("1/{whole} of"),
            "the ranks' losses were averaged (loss_reduction=\"mean\", the default) while \
             each is its share of the global loss",
        ),
    };
    Some(format!(
        "loss: the recorded loss is {times} the references' at every one of the {} steps, \
         while every gradient, gradient norm and parameter is within its envelope: the \
         training is right and its loss was recorded wrong: {likely}; see docs/judge.md, \
         \"Which loss each rank holds\"",
        ratios.len()
    ))
}
