//! The fp64 arbiter: a run is judged by how far it is from the same training in float64,
//! measured against how far the fp32 reference itself is from it.
//!
//! For every compared quantity `q` (each step's loss and gradient norm, each step's gradient
//! tensors, each final parameter and buffer) the run passes where
//!
//! ```text
//! d(run, ref64) ≤ K · d(ref32, ref64) + floor(ref64)
//! ```
//!
//! `ref32` is the reference the run stands in for (the single-device run, the microbatched
//! run) and `ref64` its float64 shadow: the same initial values, batches and discrete
//! decisions, trained in float64. `d(ref32, ref64)` is the rounding noise a correct fp32
//! execution of this training carries at this step and tensor, on this machine (measured on
//! `ref32` and, where given, on other correct fp32 executions of it: the largest counts, see
//! [`arbitrate_with_spread`]), so the bound
//! follows the noise wherever training amplifies it (a summed loss growing by orders of
//! magnitude, momentum compounding a one-ULP difference) and tightens wherever it does not.
//! No per-model or per-step tolerance exists. `d` is the largest elementwise distance of a
//! tensor; per step, `d(ref32, ref64)` is never taken below what it was for the same quantity
//! at an earlier step (a reference that lands near float64 by chance at one step, as a
//! single number such as a gradient norm can, does not make the envelope collapse); `floor` is [`Envelope::floor_ulps`] units of fp32 rounding (2⁻²⁴) of the tensor's
//! largest fp64 magnitude, for quantities the fp32 reference happens to get exactly. The
//! constants were chosen from measurements across models, steps, seeds, world sizes and CPU
//! capabilities (docs/parity.md, "The fp64 arbiter").

use super::comparison::{
    location, unravel, Comparison, FailurePoint, ParamSummary, ScalarDiff, Stats, StepComparison,
};
use super::envelope::{ArbiterSummary, Envelope, EnvelopePoint, StepEnvelope};
use super::tolerance::{ulp_distance, Mode, Quantity};
use super::verdict::{conclude, fold_summaries, structural_mismatches, Against, Measured};
use lockstep_core::comm::DType;
use lockstep_core::record::{NamedTensor, RunRecord};
use std::collections::HashMap;
use std::io::Write;

/// Every judged quantity's distances, one line each, for measuring the envelope
/// (`lockstep matrix --arbiter-log FILE`); `None` to keep nothing.
pub type ArbiterLog<'a> = Option<&'a mut dyn Write>;

/// One quantity's values on the three sides, and in the other correct fp32 runs.
struct Sides<'a> {
    run: &'a [f64],
    ref32: &'a [f64],
    ref64: &'a [f64],
    /// The same quantity in each fp32 variant that has it with the shadow's shape.
    spread: Vec<&'a [f64]>,
}

/// The verdict on one quantity.
struct Verdict {
    point: EnvelopePoint,
    /// `d(ref32, ref64)` at this step alone (what the measurement log keeps).
    raw_reference: f64,
    scale: f64,
    worst: usize,
    passed: bool,
}

/// The largest `|a − b|` over the elements where both references are finite, and its index.
fn max_distance(a: &[f64], b: &[f64], judged: &[bool]) -> (f64, usize) {
    let mut worst = (0.0, 0);
    for (i, ((&x, &y), &judge)) in a.iter().zip(b).zip(judged).enumerate() {
        if !judge {
            continue;
        }
        let d = if x == y {
            0.0
        } else if x.is_finite() {
            (x - y).abs()
        } else {
            f64::INFINITY
        };
        if d > worst.0 {
            worst = (d, i);
        }
    }
    worst
}

/// Where a reference is not finite (an fp32 overflow float64 does not have, a diverged
/// training) there is no noise to measure: the run must then be what the fp32 reference is
/// (NaN where it is NaN, the same infinity). Returns the first element where it is not.
fn non_finite_mismatch(sides: &Sides<'_>, judged: &[bool]) -> Option<usize> {
    (0..sides.run.len()).find(|&i| {
        let (run, ref32) = (sides.run[i], sides.ref32[i]);
        let same = run.to_bits() == ref32.to_bits() || (run.is_nan() && ref32.is_nan());
        !(judged[i] || same)
    })
}

/// `noise_so_far` is the envelope carried from earlier steps for this quantity (see
/// [`NoiseSoFar`]).
fn judge(sides: &Sides<'_>, env: &Envelope, noise_so_far: &NoiseSoFar) -> Verdict {
    let judged: Vec<bool> = sides
        .ref32
        .iter()
        .zip(sides.ref64)
        .map(|(a, b)| a.is_finite() && b.is_finite())
        .collect();
    let (mut run_to_f64, mut worst) = max_distance(sides.run, sides.ref64, &judged);
    if let Some(i) = non_finite_mismatch(sides, &judged) {
        (run_to_f64, worst) = (f64::INFINITY, i);
    }
    let (mut raw_reference, _) = max_distance(sides.ref32, sides.ref64, &judged);
    for variant in &sides.spread {
        // Where a variant overflowed it measured no rounding: only its finite elements count.
        let finite: Vec<bool> = judged
            .iter()
            .zip(variant.iter())
            .map(|(&j, v)| j && v.is_finite())
            .collect();
        raw_reference = raw_reference.max(max_distance(variant, sides.ref64, &finite).0);
    }
    let scale = sides
        .ref64
        .iter()
        .filter(|v| v.is_finite())
        .fold(0.0f64, |m, v| m.max(v.abs()));
    let reference_to_f64 = raw_reference.max(noise_so_far.at(scale));
    let floor = env.floor(scale);
    let allowed = env.allowed(reference_to_f64, scale);
    let passed = run_to_f64 <= allowed;
    let margin = if run_to_f64 == 0.0 {
        0.0
    } else if allowed == 0.0 {
        f64::INFINITY
    } else {
        run_to_f64 / allowed
    };
    Verdict {
        point: EnvelopePoint {
            run_to_f64,
            reference_to_f64,
            floor,
            margin,
            k: env.k,
        },
        raw_reference,
        scale,
        worst,
        passed,
    }
}

/// The fp32 reference's noise on one quantity at the steps judged so far. Rounding noise
/// accumulates, so a step where the reference lands near float64 by chance (a single number
/// such as a gradient norm can) must not make the envelope collapse; but values also shrink
/// or grow by orders of magnitude over training. The noise carried to a step is therefore the
/// smaller of the largest absolute noise seen and the largest relative noise seen at this
/// step's magnitude: it can neither outlast a shrinking quantity nor inflate a growing one.
#[derive(Clone, Copy, Debug, Default)]
struct NoiseSoFar {
    absolute: f64,
    relative: f64,
}

impl NoiseSoFar {
    fn at(&self, scale: f64) -> f64 {
        self.absolute.min(self.relative * scale)
    }

    fn observe(&mut self, noise: f64, scale: f64) {
        self.absolute = self.absolute.max(noise);
        if scale > 0.0 {
            self.relative = self.relative.max(noise / scale);
        }
    }
}

/// Where a quantity sits.
struct Site<'a> {
    quantity: Quantity,
    step: Option<usize>,
    tensor: Option<&'a str>,
    /// The tensor's shape, to name a failing element per dimension.
    shape: &'a [i64],
    dtype: DType,
}

/// Context shared by every quantity of one arbitration.
struct Judging<'a, 'w> {
    env: &'a Envelope,
    /// Per quantity and tensor, the fp32 reference's noise at the steps judged so far.
    noise_so_far: HashMap<(Quantity, String), NoiseSoFar>,
    worst: Option<(String, EnvelopePoint)>,
    log: ArbiterLog<'w>,
    row: String,
}

impl Judging<'_, '_> {
    fn observe(&mut self, stats: &mut Stats, sides: &Sides<'_>, site: &Site<'_>) -> Verdict {
        let key = (site.quantity, site.tensor.unwrap_or_default().to_owned());
        let so_far = match site.step {
            Some(_) => self.noise_so_far.get(&key).copied().unwrap_or_default(),
            None => NoiseSoFar::default(),
        };
        let v = judge(sides, self.env, &so_far);
        if site.step.is_some() {
            let mut noise = so_far;
            noise.observe(v.raw_reference, v.scale);
            self.noise_so_far.insert(key, noise);
        }
        if self
            .worst
            .as_ref()
            .is_none_or(|(_, w)| v.point.margin > w.margin)
        {
            let at = location(site.quantity, site.tensor, site.step);
            self.worst = Some((at, v.point));
        }
        let actual = sides.run.get(v.worst).copied().unwrap_or(f64::NAN);
        let expected = sides.ref64.get(v.worst).copied().unwrap_or(f64::NAN);
        let ulp = ulp_distance(actual, expected, site.dtype);
        stats.compared += 1;
        stats.max_abs_err = stats.max_abs_err.max(v.point.run_to_f64);
        if expected != 0.0 && expected.is_finite() {
            stats.max_rel_err = stats.max_rel_err.max(v.point.run_to_f64 / expected.abs());
        }
        stats.max_ulp = stats.max_ulp.max(ulp);
        stats.margin = stats.margin.max(v.point.margin);
        if !v.passed {
            stats.passed = false;
            let failure = FailurePoint {
                quantity: site.quantity,
                step: site.step,
                tensor: site.tensor.map(str::to_owned),
                index: site.tensor.map(|_| v.worst),
                element: site.tensor.and_then(|_| unravel(v.worst, site.shape)),
                actual,
                expected,
                abs_err: v.point.run_to_f64,
                allowed: Some(self.env.k * v.point.reference_to_f64 + v.point.floor),
                ulp,
                dtype: site.dtype,
                envelope: Some(v.point),
            };
            if stats.first_failure.is_none() {
                stats.first_failure = Some(failure);
            }
        }
        if let Some(log) = self.log.as_mut() {
            // The log is a measurement aid: a failed write loses a line, never a verdict.
            let _ = writeln!(
                log,
                "{},{},{},{},{:e},{:e},{:e},{}",
                self.row,
                site.step.map_or("final".to_owned(), |s| s.to_string()),
                site.quantity,
                site.tensor.unwrap_or(""),
                v.point.run_to_f64,
                v.raw_reference,
                v.scale,
                sides.run.len()
            );
        }
        v
    }
}

impl Judging<'_, '_> {
    /// Judges one step's value of a scalar series (`series`: run, fp32 reference, float64
    /// shadow); `None` when a side has no value at that step.
    fn scalar(
        &mut self,
        stats: &mut Stats,
        (quantity, step): (Quantity, usize),
        series: [&Vec<f64>; 3],
        spread: &[&Vec<f64>],
        step_env: &mut StepEnvelope,
    ) -> Option<ScalarDiff> {
        let [a, b, c] = series;
        let (a, b, c) = (a.get(step)?, b.get(step)?, c.get(step)?);
        let sides = Sides {
            run: std::slice::from_ref(a),
            ref32: std::slice::from_ref(b),
            ref64: std::slice::from_ref(c),
            spread: spread
                .iter()
                .filter_map(|v| v.get(step).map(std::slice::from_ref))
                .collect(),
        };
        let site = Site {
            quantity,
            step: Some(step),
            tensor: None,
            shape: &[],
            dtype: DType::F32,
        };
        let v = self.observe(stats, &sides, &site);
        step_env.fold(&v.point, v.scale);
        Some(ScalarDiff {
            run: *a,
            reference: *c,
            abs_err: v.point.run_to_f64,
            rel_err: if *c != 0.0 {
                v.point.run_to_f64 / c.abs()
            } else {
                0.0
            },
            ulp: ulp_distance(*a, *c, DType::F32),
            margin: v.point.margin,
            passed: v.passed,
            envelope: Some(v.point),
        })
    }
}

/// The tensors of `list` by name.
fn by_name(list: &[NamedTensor]) -> HashMap<&str, &NamedTensor> {
    list.iter().map(|t| (t.name.as_str(), t)).collect()
}

/// Judges every tensor of `ref64` present in all three lists; structural gaps (a tensor
/// missing or misshaped in the run or in the fp32 reference) go to `structural`.
fn judge_tensors(
    judging: &mut Judging<'_, '_>,
    lists: [&[NamedTensor]; 3],
    spread: &[&[NamedTensor]],
    at: (Quantity, Option<usize>, &str),
    structural: &mut Vec<String>,
    step_env: &mut StepEnvelope,
) -> (Stats, Vec<ParamSummary>) {
    let [run, ref32, ref64] = lists;
    let (quantity, step, what) = at;
    let (run, ref32) = (by_name(run), by_name(ref32));
    let spread: Vec<_> = spread.iter().map(|list| by_name(list)).collect();
    let mut total = Stats::default();
    let mut summaries = Vec::new();
    for want in ref64 {
        let name = want.name.as_str();
        let (Some(have), Some(mid)) = (run.get(name), ref32.get(name)) else {
            let side = if run.contains_key(name) {
                "the fp32 reference"
            } else {
                "the run"
            };
            structural.push(format!("{what}: `{name}` is missing from {side}"));
            total.passed = false;
            continue;
        };
        let sized = |t: &NamedTensor| t.shape == want.shape && t.values.len() == want.values.len();
        if !sized(have) || !sized(mid) {
            structural.push(format!(
                "{what}: `{name}` has shape {:?} in the run and {:?} in the fp32 reference but \
                 {:?} in the float64 shadow",
                have.shape, mid.shape, want.shape
            ));
            total.passed = false;
            continue;
        }
        let mut stats = Stats::default();
        let sides = Sides {
            run: &have.values,
            ref32: &mid.values,
            ref64: &want.values,
            spread: spread
                .iter()
                .filter_map(|list| list.get(name).copied().filter(|t| sized(t)))
                .map(|t| t.values.as_slice())
                .collect(),
        };
        let site = Site {
            quantity,
            step,
            tensor: Some(name),
            shape: &want.shape,
            dtype: have.dtype,
        };
        let v = judging.observe(&mut stats, &sides, &site);
        step_env.fold(&v.point, v.scale);
        total.merge(&stats);
        summaries.push(ParamSummary {
            name: want.name.clone(),
            dtype: have.dtype,
            shape: want.shape.clone(),
            stats,
        });
    }
    let ref64_names: std::collections::HashSet<&str> =
        ref64.iter().map(|t| t.name.as_str()).collect();
    for (side, names) in [("the run", &run), ("the fp32 reference", &ref32)] {
        for name in names.keys() {
            if !ref64_names.contains(name) {
                structural.push(format!(
                    "{what}: `{name}` is in {side} but not in the float64 shadow"
                ));
                total.passed = false;
            }
        }
    }
    (total, summaries)
}

/// The first step at which the fp32 reference has a non-finite loss, gradient norm or
/// gradient element, if any.
fn reference_overflow(ref32: &RunRecord) -> Option<usize> {
    let steps = ref32.losses.len().max(ref32.grad_norms.len());
    (0..steps).find(|&s| {
        let bad = |v: Option<&f64>| v.is_some_and(|v| !v.is_finite());
        bad(ref32.losses.get(s))
            || bad(ref32.grad_norms.get(s))
            || ref32
                .grads
                .as_ref()
                .and_then(|g| g.get(s))
                .is_some_and(|tensors| {
                    tensors
                        .iter()
                        .any(|t| t.values.iter().any(|v| !v.is_finite()))
                })
    })
}

/// Judges `run` by the fp64 arbiter: against `ref64` (the float64 shadow of `ref32`) with
/// `ref32`'s own distance to it as the noise envelope, under `env` ([`ENVELOPE`](super::ENVELOPE) unless
/// measuring). The result reads like any [`Comparison`] (mode [`Mode::Arbiter`]): errors are
/// distances to float64, margins are distance over envelope, and the first failure names the
/// step and tensor with both distances. `log` receives one line per judged quantity.
pub fn arbitrate(
    run: &RunRecord,
    ref32: &RunRecord,
    ref64: &RunRecord,
    env: &Envelope,
    log: ArbiterLog<'_>,
) -> Comparison {
    arbitrate_with_spread(run, ref32, &[], ref64, env, log)
}

/// [`arbitrate`] with the noise measured on more than one correct fp32 run: `spread` holds
/// other fp32 executions of the same training as `ref32` (another summation order, such as
/// the batch split into microbatches, with the same discrete decisions), and each
/// quantity's noise is the largest distance to `ref64` among `ref32` and them. One fp32
/// reference's distance is a single sample of how far correct fp32 arithmetic strays; where
/// training amplifies rounding, correct runs separate and the samples show it, so the
/// envelope widens by measurement rather than by a larger K. A quantity a variant lacks, or
/// has in another shape, is measured on the others.
pub fn arbitrate_with_spread(
    run: &RunRecord,
    ref32: &RunRecord,
    spread: &[&RunRecord],
    ref64: &RunRecord,
    env: &Envelope,
    log: ArbiterLog<'_>,
) -> Comparison {
    let mut arbitration = Arbitration::new(run, ref32, spread, ref64, env, log);
    let steps = (0..arbitration.step_count())
        .map(|step| arbitration.judge_step(step))
        .collect();
    let final_state = arbitration.judge_final_state();
    arbitration.finish(steps, final_state)
}

/// What does not line up between the run, the fp32 reference and its float64 shadow, before
/// any value is judged.
fn arbiter_structural(run: &RunRecord, ref32: &RunRecord, ref64: &RunRecord) -> Vec<String> {
    let mut structural = structural_mismatches(run, ref32);
    structural.extend(
        structural_mismatches(ref32, ref64)
            .into_iter()
            .map(|s| format!("fp32 reference against its float64 shadow: {s}")),
    );
    if run.grads.is_none() && ref32.grads.is_some() {
        structural.push(
            "the references recorded per-step gradients but the run did not: its gradients \
             cannot be judged"
                .into(),
        );
    }
    structural
}

/// A step's (or the final state's) distances before any quantity is folded in.
fn empty_step_envelope() -> StepEnvelope {
    StepEnvelope {
        run_to_f64: 0.0,
        reference_to_f64: 0.0,
        margin: 0.0,
    }
}

/// One arbitration in progress: the records it weighs, the judging context, and what the
/// steps measured so far, shared by the per-step and the final-state passes of
/// [`arbitrate_with_spread`].
struct Arbitration<'a, 'w> {
    run: &'a RunRecord,
    ref32: &'a RunRecord,
    spread: &'a [&'a RunRecord],
    ref64: &'a RunRecord,
    judging: Judging<'a, 'w>,
    /// The first step at which the fp32 reference overflowed: nothing from it on is judged.
    overflowed: Option<usize>,
    structural: Vec<String>,
    losses: Stats,
    grad_norms: Stats,
    grads_total: Option<Stats>,
    grad_summaries: Vec<ParamSummary>,
}

impl<'a, 'w> Arbitration<'a, 'w> {
    /// Starts an arbitration with what does not line up before any value is judged.
    fn new(
        run: &'a RunRecord,
        ref32: &'a RunRecord,
        spread: &'a [&'a RunRecord],
        ref64: &'a RunRecord,
        env: &'a Envelope,
        log: ArbiterLog<'w>,
    ) -> Self {
        let judging = Judging {
            env,
            noise_so_far: HashMap::new(),
            worst: None,
            log,
            row: format!(
                "{},{},{}",
                run.spec.model, run.spec.config, ref32.spec.config
            ),
        };
        let all_grads = run.grads.is_some() && ref32.grads.is_some() && ref64.grads.is_some();
        Arbitration {
            run,
            ref32,
            spread,
            ref64,
            judging,
            overflowed: reference_overflow(ref32),
            structural: arbiter_structural(run, ref32, ref64),
            losses: Stats::default(),
            grad_norms: Stats::default(),
            grads_total: all_grads.then(Stats::default),
            grad_summaries: Vec::new(),
        }
    }

    /// The steps to judge: the shadow's, up to the first the fp32 reference overflowed at.
    fn step_count(&self) -> usize {
        self.ref64
            .losses
            .len()
            .min(self.overflowed.unwrap_or(usize::MAX))
    }

    /// Judges everything recorded at `step`: the loss, the gradient norm and, when all three
    /// records have them, the gradients.
    fn judge_step(&mut self, step: usize) -> StepComparison {
        let (run, ref32, ref64, spread) = (self.run, self.ref32, self.ref64, self.spread);
        let mut step_env = empty_step_envelope();
        let loss = self.judging.scalar(
            &mut self.losses,
            (Quantity::Loss, step),
            [&run.losses, &ref32.losses, &ref64.losses],
            &spread.iter().map(|v| &v.losses).collect::<Vec<_>>(),
            &mut step_env,
        );
        let grad_norm = self.judging.scalar(
            &mut self.grad_norms,
            (Quantity::GradNorm, step),
            [&run.grad_norms, &ref32.grad_norms, &ref64.grad_norms],
            &spread.iter().map(|v| &v.grad_norms).collect::<Vec<_>>(),
            &mut step_env,
        );
        let mut passed = [&loss, &grad_norm]
            .into_iter()
            .all(|d| d.as_ref().is_some_and(|d| d.passed));
        let grads = self.judge_step_grads(step, &mut step_env);
        passed &= grads.as_ref().is_none_or(|g| g.passed);
        StepComparison {
            step,
            loss,
            grad_norm,
            grads,
            passed,
            envelope: Some(step_env),
        }
    }

    /// Judges one step's gradients tensor by tensor and folds them into the run's totals;
    /// `None` when a record has no gradients for `step`.
    fn judge_step_grads(&mut self, step: usize, step_env: &mut StepEnvelope) -> Option<Stats> {
        let (run, ref32, ref64) = (self.run, self.ref32, self.ref64);
        let (Some(a), Some(b), Some(c)) = (&run.grads, &ref32.grads, &ref64.grads) else {
            return None;
        };
        let (a, b, c) = (a.get(step)?, b.get(step)?, c.get(step)?);
        let what = format!("gradients at step {step}");
        let spread_grads: Vec<&[NamedTensor]> = self
            .spread
            .iter()
            .filter_map(|v| v.grads.as_ref()?.get(step).map(Vec::as_slice))
            .collect();
        let (stats, per_tensor) = judge_tensors(
            &mut self.judging,
            [a, b, c],
            &spread_grads,
            (Quantity::Grads, Some(step), &what),
            &mut self.structural,
            step_env,
        );
        fold_summaries(&mut self.grad_summaries, per_tensor);
        if let Some(total) = self.grads_total.as_mut() {
            total.merge(&stats);
        }
        Some(stats)
    }

    /// Judges the final parameters and buffers (none when the fp32 reference overflowed:
    /// its final state then measures no rounding).
    fn judge_final_state(&mut self) -> (Stats, Vec<ParamSummary>) {
        let state = |r: &RunRecord| -> Vec<NamedTensor> {
            r.params.iter().chain(&r.buffers).cloned().collect()
        };
        let (run_state, ref32_state, ref64_state) = match self.overflowed {
            None => (state(self.run), state(self.ref32), state(self.ref64)),
            Some(_) => (Vec::new(), Vec::new(), Vec::new()),
        };
        let spread_state: Vec<Vec<NamedTensor>> = self.spread.iter().map(|v| state(v)).collect();
        let spread_state: Vec<&[NamedTensor]> = spread_state.iter().map(Vec::as_slice).collect();
        let mut final_env = empty_step_envelope();
        judge_tensors(
            &mut self.judging,
            [&run_state, &ref32_state, &ref64_state],
            &spread_state,
            (Quantity::Params, None, "final parameters and buffers"),
            &mut self.structural,
            &mut final_env,
        )
    }

    /// The verdict, from the steps and the final state judged, with the arbiter's figures.
    fn finish(
        self,
        steps: Vec<StepComparison>,
        (params, param_summaries): (Stats, Vec<ParamSummary>),
    ) -> Comparison {
        // A near-tie in the reference's routing may explain a failure better than drift.
        let near_tie = self.ref64.routing_min_gap.map(|gap| {
            format!(
                "the reference routed tokens by top-k, its closest decision a probability gap \
                 of {}: if that is within the run's distance to float64, the run may have \
                 chosen another expert there (a near-tie flipped, not rounding drift)",
                super::fmt_num(gap)
            )
        });
        let measured = Measured {
            structural: self.structural,
            losses: self.losses,
            grad_norms: self.grad_norms,
            params,
            grads: self.grads_total,
            param_summaries,
            grad_summaries: self.grad_summaries,
            steps,
        };
        let against = Against {
            // The row is against the training the shadow stands for (`single@4`), whichever
            // fp32 run gave the envelope (a mixed-precision row's is its DDP reference).
            reference: self.ref64.spec.config.replace(".f64@", "@"),
            reference_spec: self.ref32.spec.clone(),
            mode: Mode::Arbiter,
            override_reason: None,
        };
        let mut summary = summary(self.judging.env, self.judging.worst, self.overflowed);
        summary.spread_from = self.spread.iter().map(|v| v.spec.config.clone()).collect();
        conclude(self.run, against, measured, near_tie, Some(summary))
    }
}

/// The arbiter's figures of a row: its constants, where it came closest to its envelope, and
/// from which step nothing was judged.
fn summary(
    env: &Envelope,
    worst: Option<(String, EnvelopePoint)>,
    unjudged_from: Option<usize>,
) -> ArbiterSummary {
    let (worst_at, worst) = worst.unwrap_or_else(|| {
        let none = EnvelopePoint {
            run_to_f64: 0.0,
            reference_to_f64: 0.0,
            floor: 0.0,
            margin: 0.0,
            k: env.k,
        };
        (String::new(), none)
    });
    ArbiterSummary {
        constants: *env,
        worst_at,
        worst,
        unjudged_from,
        trajectory_left: None,
        spread_from: Vec::new(),
    }
}
