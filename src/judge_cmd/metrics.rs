//! Evaluation metrics a job reported between its training steps (`rec.metric(...)`, an
//! evaluation loss): each held to the arbiter's envelope against the same metric computed by
//! the references from their own state on the same batches. A job can train right and
//! report wrong (Hugging Face transformers PR #48167: the evaluation loss under context
//! parallelism reported as `cp_size` times the true one); no loss or gradient shows that.

use super::JudgeError;
use lockstep_core::comm::DType;
use lockstep_harness::parity::{Tolerance, ENVELOPE};
use serde::Deserialize;
use std::path::Path;

/// One reported value: metric `name` after `after` training steps.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct MetricPoint {
    /// The metric's name, as the job reported it.
    pub name: String,
    /// How many training steps came before it (0: before the first).
    pub after: usize,
    /// The value (NaN and infinities as Lockstep's JSON writes them).
    #[serde(with = "lockstep_core::num")]
    pub value: f64,
}

/// A record's reported metrics (none for a record from before they existed).
pub fn read(record: &serde_json::Value, file: &Path) -> Result<Vec<MetricPoint>, JudgeError> {
    match record.get("metrics") {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| JudgeError::Parse {
            path: file.to_owned(),
            detail: format!("`metrics`: {e}"),
        }),
    }
}

/// The value a record holds for `point`'s metric at its place, or bad input naming it.
fn value_in(points: &[MetricPoint], point: &MetricPoint, role: &str) -> Result<f64, JudgeError> {
    points
        .iter()
        .find(|p| p.name == point.name && p.after == point.after)
        .map(|p| p.value)
        .ok_or_else(|| {
            JudgeError::Mismatch(format!(
                "the job reported `{}` after {} steps and the {role} did not compute it: train \
                 the references with train_references(..., metrics={{\"{}\": fn}})",
                point.name, point.after, point.name
            ))
        })
}

/// What says a reported metric is wrong, in words (each fails the job): with a shadow, a
/// value further from float64 than `K ×` the fp32 reference's own distance (the largest it
/// had for this metric so far) plus the floor; without one, fp32's `assert_close` tolerance
/// around the reference. The first failing point of each metric.
pub fn findings(
    run: &[MetricPoint],
    reference: &[MetricPoint],
    shadow: Option<&[MetricPoint]>,
) -> Result<Vec<String>, JudgeError> {
    let mut found = Vec::new();
    // Each metric once, in the order the job first reported it.
    let mut names: Vec<&str> = Vec::new();
    for point in run {
        if !names.contains(&point.name.as_str()) {
            names.push(&point.name);
        }
    }
    for name in names {
        let mut series: Vec<&MetricPoint> = run.iter().filter(|p| p.name == name).collect();
        series.sort_by_key(|p| p.after);
        let mut truth = Vec::with_capacity(series.len());
        for point in &series {
            let fp32 = value_in(reference, point, "reference")?;
            let f64_value = match shadow {
                Some(shadow) => Some(value_in(shadow, point, "shadow")?),
                None => None,
            };
            truth.push((fp32, f64_value));
        }
        let largest = truth
            .iter()
            .filter_map(|(_, t)| *t)
            .fold(0.0_f64, |m, t| m.max(t.abs()));
        let mut noise = 0.0_f64;
        for (point, (fp32, f64_value)) in series.iter().zip(&truth) {
            let (expected, allowed, against) = match f64_value {
                Some(t) => {
                    noise = noise.max((fp32 - t).abs());
                    (*t, ENVELOPE.allowed(noise, largest), "float64")
                }
                None => (
                    *fp32,
                    Tolerance::for_dtype(DType::F32).allowed(*fp32),
                    "fp32",
                ),
            };
            let distance = (point.value - expected).abs();
            if distance.is_nan() || distance > allowed {
                let ratio = point.value / expected;
                let times = if ratio.is_finite() && (ratio - ratio.round()).abs() < 1e-6 {
                    format!(" ({} times the true value)", ratio.round())
                } else {
                    String::new()
                };
                found.push(format!(
                    "the job reported `{name}` = {} after {} steps, the references' {against} \
                     value is {expected}{times}: |run − {against}| {distance:.3e} > allowed \
                     {allowed:.3e}; the training is judged apart, so a metric computed or \
                     reduced wrong over the ranks shows here alone",
                    point.value, point.after
                ));
                break;
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn points(values: &[f64]) -> Vec<MetricPoint> {
        values
            .iter()
            .enumerate()
            .map(|(i, &value)| MetricPoint {
                name: "eval_loss".into(),
                after: i,
                value,
            })
            .collect()
    }

    #[test]
    fn a_metric_within_the_envelope_passes_and_one_twice_the_truth_is_named() {
        let truth = points(&[1.25, 1.0]);
        let reference = points(&[1.25 + 1e-7, 1.0 - 1e-7]);
        let run = points(&[1.25 + 3e-7, 1.0]);
        assert_eq!(
            findings(&run, &reference, Some(&truth)).unwrap(),
            Vec::<String>::new()
        );
        let doubled = points(&[2.5, 2.0]);
        let found = findings(&doubled, &reference, Some(&truth)).unwrap();
        assert_eq!(found.len(), 1);
        assert!(found[0].starts_with("the job reported `eval_loss` = 2.5 after 0 steps"));
        assert!(
            found[0].contains("(2 times the true value)"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn metrics_reported_in_turn_are_each_judged_once() {
        let mut run = points(&[2.5, 2.0]);
        let mut accuracy = points(&[0.5, 0.75]);
        for p in &mut accuracy {
            p.name = "accuracy".into();
        }
        // Reported in turn after each step: eval_loss, accuracy, eval_loss, accuracy.
        run = vec![
            run[0].clone(),
            accuracy[0].clone(),
            run[1].clone(),
            accuracy[1].clone(),
        ];
        let truth: Vec<MetricPoint> = points(&[1.25, 1.0])
            .into_iter()
            .chain(accuracy.clone())
            .collect();
        let found = findings(&run, &truth, Some(&truth)).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("`eval_loss`"), "{}", found[0]);
    }

    #[test]
    fn a_metric_the_references_did_not_compute_is_bad_input() {
        let run = points(&[1.0]);
        assert!(matches!(
            findings(&run, &[], None),
            Err(JudgeError::Mismatch(_))
        ));
    }
}
