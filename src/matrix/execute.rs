//! Running a plan: references in process, parallel configurations in forked launches,
//! then the comparisons that make the rows.

use super::cell_runs::{run_cell, CellRuns, Progress, Tally};
use super::judge::{judge_cell, Cell};
use super::*;
use crate::runner::RecordResult;
use lockstep_harness::launch::background;
use std::sync::{Arc, Mutex};

/// The progress bar the CLI shows on stderr: drawn only on a terminal and only from this
/// thread (no ticker thread, so a forked rank never inherits a lock held by one).
pub fn progress_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{elapsed:>4} [{bar:30.cyan/blue}] {pos}/{len} runs  {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

/// Runs the plan: per model and world size the references the selected configurations need
/// (`Plan::runs_per_cell`: the single-device reference in process, fresh DDP launches fp32
/// and per mixed-precision policy), the FSDP launches, then the comparisons. Run
/// failures become `Error` rows; the matrix always finishes.
///
/// libtorch is set to one intra-op thread in this process (forked ranks must not inherit an
/// OpenMP pool); the references computed here run with the ranks' count
/// ([`lockstep_harness::threads`]), so no verdict depends on the machine's core count.
pub fn run(plan: &Plan, bar: &ProgressBar) -> MatrixResult {
    run_logged(plan, bar, true)
}

/// [`run`] with no progress output at all (for callers that repeat a matrix and report per
/// repetition, like `lockstep stress`).
pub fn run_quietly(plan: &Plan) -> MatrixResult {
    run_logged(plan, &ProgressBar::hidden(), false)
}

/// The rows and comparisons of the cells judged so far, in cell order, and the arbiter's log.
struct JudgedCells {
    result: MatrixResult,
    log: Option<std::io::BufWriter<std::fs::File>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Judging cell (`m`, `world`) from its `runs`, into `judged`, as a task that may run on
/// another thread.
fn judge_later(
    plan: Arc<Plan>,
    m: usize,
    world: usize,
    runs: CellRuns,
    judged: &Arc<Mutex<JudgedCells>>,
) -> impl FnOnce() + Send + 'static {
    let judged = Arc::clone(judged);
    move || {
        let cell = Cell {
            index: m,
            model: &plan.models[m],
            world,
            blocker: plan.blockers[m].as_deref(),
        };
        let mut judged = lock(&judged);
        let JudgedCells { result, log } = &mut *judged;
        judge_cell(&plan, &cell, &runs, result, log);
    }
}

fn run_logged(plan: &Plan, bar: &ProgressBar, log_runs: bool) -> MatrixResult {
    // This process forks every rank: one thread (`lockstep_harness::threads`); references
    // computed here take the ranks' count through `runner::in_process_reference`.
    lockstep_harness::threads::use_launcher_threads();
    let started = Instant::now();
    // A measurement aid: a log that cannot be created is reported and the matrix goes on.
    let arbiter_log =
        plan.arbiter_log
            .as_ref()
            .and_then(|path| match std::fs::File::create(path) {
                Ok(f) => Some(std::io::BufWriter::new(f)),
                Err(e) => {
                    eprintln!(
                        "lockstep: cannot write the arbiter log {}: {e}",
                        path.display()
                    );
                    None
                }
            });
    let mut tally = Tally {
        progress: Progress {
            bar,
            done: 0,
            total: plan.run_count(),
            log_runs,
        },
        result: MatrixResult::default(),
    };
    // Each cell is judged during the next cell's first launch, on the core its ranks leave
    // free (`lockstep_harness::launch::background`); rows keep the cells' order.
    let judged = Arc::new(Mutex::new(JudgedCells {
        result: MatrixResult::default(),
        log: arbiter_log,
    }));
    let shared_plan = Arc::new(plan.clone());
    // Under an external launch every rank judges in step with the others: nothing waits for
    // a launch.
    let external = crate::runner::external::launch().is_some();
    'cells: for m in 0..plan.models.len() {
        for &world in &plan.world_sizes {
            // Under an external launch only its WORLD_SIZE runs: the other sizes' rows are
            // skipped with that reason (`Config::world_blocker`), and nothing is launched.
            let runs = if crate::runner::external::world_blocker(world).is_some() {
                CellRuns::default()
            } else {
                run_cell(plan, m, world, &mut tally)
            };
            let judge = judge_later(Arc::clone(&shared_plan), m, world, runs, &judged);
            if external {
                judge();
            } else {
                background::defer(judge);
            }
            // A rank failed under an external launch: its communicators may be broken and
            // nothing more runs (`crate::external`); the caller reports it.
            if crate::runner::external::stopped().is_some() {
                break 'cells;
            }
        }
    }
    background::finish();
    let judged = &mut lock(&judged).result;
    tally.result.rows = std::mem::take(&mut judged.rows);
    tally.result.comparisons = std::mem::take(&mut judged.comparisons);
    bar.finish_and_clear();
    tally.result.elapsed = started.elapsed();
    tally.result
}

/// A cell run once, whose configuration under test can then be judged with its run replaced
/// (a faulted run, for a sensitivity analysis) by exactly the matrix's verdict.
pub(super) struct CellBaseline {
    plan: Plan,
    runs: CellRuns,
}

impl CellBaseline {
    /// Runs every run of cell (model 0 of `plan`, `world`) quietly.
    pub(super) fn run(plan: &Plan, world: usize) -> Self {
        let bar = ProgressBar::hidden();
        let mut tally = Tally {
            progress: Progress {
                bar: &bar,
                done: 0,
                total: 0,
                log_runs: false,
            },
            result: MatrixResult::default(),
        };
        let runs = run_cell(plan, 0, world, &mut tally);
        CellBaseline {
            plan: plan.clone(),
            runs,
        }
    }

    /// The matrix's rows for `config` at `world`, with `run` standing in for its own run when
    /// given.
    pub(super) fn rows(
        &mut self,
        config: Config,
        world: usize,
        run: Option<RecordResult>,
    ) -> Vec<Row> {
        let saved = match (run, self.runs.run_mut(config)) {
            (Some(run), Some(slot)) => Some(std::mem::replace(slot, run)),
            _ => None,
        };
        let cell = Cell {
            index: 0,
            model: &self.plan.models[0],
            world,
            blocker: self.plan.blockers[0].as_deref(),
        };
        let mut result = MatrixResult {
            rows: Vec::new(),
            comparisons: Vec::new(),
            runs: 0,
            failed_runs: 0,
            hung_runs: 0,
            elapsed: Duration::ZERO,
        };
        judge_cell(&self.plan, &cell, &self.runs, &mut result, &mut None);
        if let (Some(saved), Some(slot)) = (saved, self.runs.run_mut(config)) {
            *slot = saved;
        }
        result.rows.retain(|r| r.config == config.at(world));
        result.rows
    }
}
