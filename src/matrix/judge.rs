//! Judging one matrix cell: a row per judging edge of each selected configuration
//! ([`Config::edges`]), the runs each edge reads, and the verdict that fills the row.

use super::cell_runs::CellRuns;
use super::*;
use crate::runner::RecordResult;

impl CellRuns {
    /// The fp32 run that reference `against` of `config` names.
    fn fp32(&self, config: Config, against: Against) -> Option<&RecordResult> {
        match against {
            Against::Repeat => self.reference(config, 1),
            Against::Config(c) => self.run_of(c),
            Against::Single => self.reference(Config::Single, 0),
            Against::Mixed(p) => self.mixed.iter().find(|(q, _)| *q == p).map(|(_, r)| r),
            Against::Dropping(f) => self.dropping_pair(f).map(|(fp32, _)| fp32),
            Against::Microbatched(m) => self.microbatched_pair(m).map(|(fp32, _)| fp32),
            Against::RingOrdered(cp, layout) => self
                .ring_ordered
                .iter()
                .find(|(ring, _)| *ring == (cp, layout))
                .map(|(_, r)| r),
        }
    }

    /// The float64 shadow of reference `against`, where it ran.
    fn shadow(&self, against: Against) -> Option<&RecordResult> {
        match against {
            Against::Single => self.single_f64.as_ref(),
            Against::Dropping(f) => self.dropping_pair(f).map(|(_, fp64)| fp64),
            Against::Microbatched(m) => self
                .microbatched_pair(m)
                .and_then(|(_, fp64)| fp64.as_ref()),
            _ => None,
        }
    }

    fn dropping_pair(&self, factor: f64) -> Option<&(RecordResult, RecordResult)> {
        self.dropping
            .iter()
            .find(|(g, _)| *g == factor)
            .map(|(_, p)| p)
    }

    fn microbatched_pair(&self, m: usize) -> Option<&(RecordResult, Option<RecordResult>)> {
        self.microbatched
            .iter()
            .find(|(n, _)| *n == m)
            .map(|(_, p)| p)
    }

    /// The fp64 arbiter's runs for an edge of `config`: the envelope run, the shadow, and the
    /// other correct fp32 runs that widen the envelope.
    fn arbiter(&self, config: Config, a: Arbiter) -> Judge<'_> {
        let envelope = self.fp32(config, a.envelope);
        let spread = match a.spread {
            Spread::None => Vec::new(),
            Spread::VariantsAndSingle => {
                let single = self.reference(Config::Single, 0);
                self.spread
                    .iter()
                    .chain(single.filter(|s| !same_run(Some(s), envelope)))
                    .collect()
            }
            Spread::Variants => self
                .spread
                .iter()
                .filter(|v| match (v, envelope) {
                    (Ok(v), Some(Ok(r))) => v.spec.config != r.spec.config,
                    _ => true,
                })
                .collect(),
        };
        Judge::Arbiter {
            fp32: envelope,
            fp64: self.shadow(a.shadow),
            spread,
        }
    }
}

/// Judges every selected configuration of one cell against each of its references (the
/// catalog's edges, [`Config::edges`]), pushing one row per edge (and the comparison behind
/// it) into `result`.
pub(super) fn judge_cell(
    plan: &Plan,
    cell: &Cell<'_>,
    runs: &CellRuns,
    result: &mut MatrixResult,
    log: &mut Option<std::io::BufWriter<std::fs::File>>,
) {
    let world = cell.world;
    for &config in &plan.configs {
        let run = runs.run_of(config);
        let blocked = plan.blocker(cell.index, world, config);
        for edge in config.edges(world) {
            let skip = blocked
                .clone()
                .or_else(|| plan.reference_blocker(cell.index, world, edge.against));
            let judge = resolve_edge(plan, cell, runs, config, edge);
            let log = log.as_mut().map(|w| w as &mut dyn std::io::Write);
            let reference = edge.against.at(config, world);
            let (r, c) = judge_row(plan, cell, config, reference, judge, skip, run, log);
            result.comparisons.extend(c);
            result.rows.push(r);
        }
    }
}

/// The runs edge `edge` of `config` is judged with, and how.
pub(super) fn resolve_edge<'r>(
    plan: &Plan,
    cell: &Cell<'_>,
    runs: &'r CellRuns,
    config: Config,
    edge: Edge,
) -> Judge<'r> {
    let policy = || Judge::Policy {
        policy: config.edge_policy(edge.against, cell.world, plan.backend),
        against: runs.fp32(config, edge.against),
    };
    match edge.judged {
        Judged::Policy => policy(),
        Judged::Arbiter(a) if a.else_policy && runs.shadow(a.shadow).is_none() => policy(),
        Judged::Arbiter(a) => runs.arbiter(config, a),
        Judged::BitwiseUnlessPlanBlocks(a) => {
            let planned = plan.pipeline_plans.get(&(cell.index, cell.world, config));
            let blocked = matches!(planned, Some(Ok(p)) if p.bitwise_blocker.is_some());
            match blocked && runs.fp32(config, a.envelope).is_some() {
                true => runs.arbiter(config, a),
                false => policy(),
            }
        }
    }
}

/// Whether `a` and `b` are the same run (both absent counts).
pub(super) fn same_run(a: Option<&RecordResult>, b: Option<&RecordResult>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => std::ptr::eq(a, b),
        (None, None) => true,
        _ => false,
    }
}

/// How a row is judged.
pub(super) enum Judge<'a> {
    /// Under a tolerance policy (bitwise, or a table with a reasoned override) against
    /// `against`.
    Policy {
        policy: Result<TolerancePolicy, String>,
        against: Option<&'a Result<RunRecord, RunFailed>>,
    },
    /// By the fp64 arbiter: the run's distance to `fp64` within the envelope of `fp32`'s,
    /// widened to the largest distance among the `spread` (other correct fp32 runs).
    Arbiter {
        fp32: Option<&'a Result<RunRecord, RunFailed>>,
        fp64: Option<&'a Result<RunRecord, RunFailed>>,
        spread: Vec<&'a Result<RunRecord, RunFailed>>,
    },
}

/// The matrix cell a row belongs to.
pub(super) struct Cell<'a> {
    /// The model's index in the plan.
    pub(super) index: usize,
    pub(super) model: &'a str,
    pub(super) world: usize,
    /// Why the model has no single-device reference, if it has none.
    pub(super) blocker: Option<&'a str>,
}

/// One row: its verdict and, when values were compared, the comparison behind it.
#[allow(clippy::too_many_arguments)]
pub(super) fn judge_row(
    plan: &Plan,
    cell: &Cell<'_>,
    config: Config,
    reference_name: String,
    judge: Judge<'_>,
    skip: Option<String>,
    run: Option<&Result<RunRecord, RunFailed>>,
    log: ArbiterLog<'_>,
) -> (Row, Option<Comparison>) {
    let mut r = empty_row(cell, config, reference_name, &judge, run);
    if let Some(reason) = skip {
        // No run: the configuration cannot run here at all.
        r.inapplicable = run.is_none();
        r.note = Some(reason);
        return (r, None);
    }
    if let Some(e) = first_failed_run(&judge, run) {
        r.status = RowStatus::Error;
        r.note = Some(e.line.clone());
        r.details = Some(e.details.clone());
        r.timed_out = e.timed_out;
        return (r, None);
    }
    let dropped = ok(judge.against()).and_then(|b| b.tokens_dropped);
    let c = match (judge, ok(run)) {
        (
            Judge::Policy {
                policy: Err(e),
                against,
            },
            Some(_),
        ) if ok(against).is_some() => {
            r.status = RowStatus::Error;
            r.note = Some(e);
            return (r, None);
        }
        (
            Judge::Policy {
                policy: Ok(p),
                against,
            },
            Some(a),
        ) if ok(against).is_some() => ok(against).map(|b| compare(a, b, &p)),
        (Judge::Arbiter { fp32, fp64, spread }, Some(a)) => match (ok(fp32), ok(fp64)) {
            (Some(b), Some(wide)) => {
                let spread: Vec<&RunRecord> =
                    spread.into_iter().filter_map(|o| ok(Some(o))).collect();
                let build = runner::zoo_builder(cell.model);
                let settings = plan.settings_for(cell.model);
                let launch = (&build as &runner::ModelBuilder<'_>, cell.world, &settings);
                let mut c = runner::arbiter_verdict(launch, a, (b, &spread, wide), log);
                // Named after the row: a simpler configuration's envelope keeps its own key.
                c.reference.clone_from(&r.reference);
                Some(c)
            }
            _ => None,
        },
        _ => None,
    };
    let Some(c) = c else {
        r.note = Some(not_run(cell));
        return (r, None);
    };
    record_verdict(&mut r, &c, dropped);
    (r, Some(c))
}

/// A row's record, when it has one.
pub(super) fn ok(o: Option<&Result<RunRecord, RunFailed>>) -> Option<&RunRecord> {
    o.and_then(|o| o.as_ref().ok())
}

impl<'a> Judge<'a> {
    /// The run the row is named against: the policy's reference, or the arbiter's envelope.
    fn against(&self) -> Option<&'a Result<RunRecord, RunFailed>> {
        match self {
            Judge::Policy { against, .. } => *against,
            Judge::Arbiter { fp32, .. } => *fp32,
        }
    }
}

/// A row of `config` against `reference_name` in `cell`, judged as `judge` says, before any
/// verdict (skipped until one is reached).
pub(super) fn empty_row(
    cell: &Cell<'_>,
    config: Config,
    reference_name: String,
    judge: &Judge<'_>,
    run: Option<&Result<RunRecord, RunFailed>>,
) -> Row {
    let row_name = config.at(cell.world);
    let mode = match judge {
        Judge::Arbiter { .. } => "arbiter",
        Judge::Policy { policy, .. } => policy_mode(policy.as_ref().ok(), &row_name),
    };
    Row {
        model: cell.model.to_owned(),
        config: row_name,
        reference: reference_name,
        world_size: cell.world,
        status: RowStatus::Skip,
        mode,
        max_abs_err: None,
        max_ulp: None,
        margin: None,
        memory: ok(run).and_then(|r| r.memory),
        note: None,
        details: None,
        arbiter: None,
        timed_out: false,
        inapplicable: false,
    }
}

/// The first run a row reads that failed: the run itself, its reference, the shadow, a
/// spread run.
pub(super) fn first_failed_run<'a>(
    judge: &Judge<'a>,
    run: Option<&'a Result<RunRecord, RunFailed>>,
) -> Option<&'a RunFailed> {
    let (extra, spread) = match judge {
        Judge::Policy { .. } => (None, &[][..]),
        Judge::Arbiter { fp64, spread, .. } => (*fp64, &spread[..]),
    };
    [run, judge.against(), extra]
        .into_iter()
        .flatten()
        .chain(spread.iter().copied())
        .find_map(|o| o.as_ref().err())
}

/// `r` with the verdict of comparison `c`: status, worst errors, and a note saying where it
/// first failed, why a tolerance was overridden, whether the step-local check decided it,
/// and how many token choices the reference dropped.
pub(super) fn record_verdict(r: &mut Row, c: &Comparison, dropped: Option<u64>) {
    let overall = c.overall();
    r.status = if c.passed {
        RowStatus::Pass
    } else {
        RowStatus::Fail
    };
    r.max_abs_err = Some(overall.max_abs_err);
    r.max_ulp = Some(overall.max_ulp);
    r.margin = Some(overall.margin);
    r.arbiter.clone_from(&c.arbiter);
    let found = short_failure(c);
    r.note = match (found, &c.override_reason) {
        (Some(f), Some(o)) => Some(format!("{f}; {OVERRIDE}: {o}")),
        (None, Some(o)) => Some(format!("{OVERRIDE}: {o}")),
        (found, None) => found,
    };
    if let Some(left) = c.arbiter.as_ref().and_then(|a| a.trajectory_left.as_ref()) {
        r.note = Some(format!(
            "step-local: the trajectory left its envelope at {left}; every step is within \
             the envelope from the run's own state"
        ));
    }
    if let Some(n) = dropped {
        // Says the row exercised dropping (the run must have dropped the same choices).
        let said = format!("{} dropped {n} token choices", r.reference);
        r.note = Some(match r.note.take() {
            Some(note) => format!("{note}; {said}"),
            None => said,
        });
    }
}

/// Why a row has nothing to compare: no single-device reference, or a run that never ran.
pub(super) fn not_run(cell: &Cell<'_>) -> String {
    match cell.blocker {
        Some(reason) => format!("{NO_SINGLE}: {reason}"),
        None => "not run".into(),
    }
}
