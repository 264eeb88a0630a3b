//! [`ParityTest::sensitivity`]: the test's own verdict, proved able to fail. Every
//! configuration of the test (built-in or a closure of yours) runs once per site × fault with
//! one collective call corrupted, and is judged against the test's references exactly as
//! [`ParityTest::run`] judges it.

use super::{ParityTest, ParityTestError, Prepared, TestConfig, WorldRuns};
use crate::runner::RecordResult;
use crate::runner::{RunFailed, RunSettings};
use crate::sensitivity::{
    analyse, Judgement, Miss, SensitivityOptions, SensitivityReport, Subject,
};
use indicatif::ProgressBar;
use lockstep_core::record::RunRecord;
use std::cell::RefCell;

/// What [`ParityTest::sensitivity`] found: one analysis per configuration and world size.
#[derive(Clone, Debug)]
pub struct ParitySensitivity {
    /// The test's name.
    pub name: String,
    /// One per configuration × world size, in the test's order.
    pub reports: Vec<SensitivityReport>,
}

impl ParitySensitivity {
    /// Every fault the test did not notice (or could not place), the math-changing kinds
    /// only when `math_only`, with the analysis it belongs to.
    pub fn misses(&self, math_only: bool) -> Vec<(&SensitivityReport, Miss<'_>)> {
        self.reports
            .iter()
            .flat_map(|r| r.misses(math_only).into_iter().map(move |m| (r, m)))
            .collect()
    }

    /// Whether every math-changing fault (skip, double, zero, wrong peer, permuted chunks,
    /// stale) was caught wherever it changed something.
    pub fn all_math_faults_caught(&self) -> bool {
        self.misses(true).is_empty()
    }
}

impl std::fmt::Display for ParitySensitivity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "sensitivity of parity test `{}`", self.name)?;
        for r in &self.reports {
            writeln!(f)?;
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// One configuration of a parity test at one world size, as the analysis sees it.
struct TestSubject<'s, 'a> {
    test: &'s ParityTest<'a>,
    prepared: &'s Prepared<'s>,
    config: &'s TestConfig<'a>,
    world: usize,
    runs: RefCell<WorldRuns>,
}

impl Subject for TestSubject<'_, '_> {
    fn config(&self) -> String {
        self.config.name().to_owned()
    }
    fn model(&self) -> String {
        self.prepared.model_name.to_owned()
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn settings(&self) -> RunSettings {
        self.test.settings.clone()
    }
    fn run(&self, settings: &RunSettings) -> Result<RunRecord, RunFailed> {
        self.test
            .run_one(self.config.name(), self.prepared, self.world, settings)
    }
    fn judge(&self, run: &Result<RunRecord, RunFailed>) -> Judgement {
        if let Err(e) = run {
            return Judgement::RunFailed(e.clone());
        }
        let name = self.config.name().to_owned();
        let mut runs = self.runs.borrow_mut();
        let saved: Option<RecordResult> = runs.records.insert(name.clone(), run.clone());
        let judged = self
            .test
            .judge_config(self.prepared, self.config, self.world, &runs);
        if let Some(saved) = saved {
            runs.records.insert(name, saved);
        }
        for j in judged {
            match j {
                Ok(c) if c.passed => {}
                Ok(c) => {
                    let first = c
                        .first_failure
                        .as_ref()
                        .map(ToString::to_string)
                        .or_else(|| c.structural.first().cloned())
                        .unwrap_or_else(|| "failed".into());
                    return Judgement::Failed(format!("{} vs {}: {first}", c.config, c.reference));
                }
                Err(e) => {
                    return Judgement::Failed(format!(
                        "{} vs {}: {}",
                        e.config, e.reference, e.message
                    ))
                }
            }
        }
        Judgement::Passed
    }
}

impl ParityTest<'_> {
    /// Proves the test can fail: [`ParityTest::sensitivity_with`] with the default analysis
    /// (every fault kind at the calls of steps 0 and 1, a 20 s timeout per faulted run).
    pub fn sensitivity(self) -> Result<ParitySensitivity, ParityTestError> {
        self.sensitivity_with(&SensitivityOptions::default())
    }

    /// For every configuration at every world size: a dry run records its collective calls,
    /// then each site × fault of `opts` runs once with that one call corrupted, judged against
    /// the test's references as [`ParityTest::run`] judges it (see [`crate::sensitivity`]).
    /// Writes `sensitivity.json` and `sensitivity.md` under `<out>/sensitivity/`. `Err` when
    /// the test cannot run, or a configuration fails its checks without a fault.
    pub fn sensitivity_with(
        self,
        opts: &SensitivityOptions,
    ) -> Result<ParitySensitivity, ParityTestError> {
        // Faults are planted in forked ranks only (exec'd ranks take no fault plan).
        if !lockstep_harness::fork_is_safe_here() {
            return Err(ParityTestError::NotForkSafe);
        }
        let prepared = self.prepare()?;
        let mut reports = Vec::new();
        for &world in &self.world_sizes {
            let runs = self.reference_runs(&prepared, world);
            let subjects = self.configs.iter().map(|config| TestSubject {
                test: &self,
                prepared: &prepared,
                config,
                world,
                runs: RefCell::new(WorldRuns {
                    records: runs.records.clone(),
                    single_f64: runs.single_f64.clone(),
                    spread: runs.spread.clone(),
                }),
            });
            for subject in subjects {
                reports.push(analyse(&subject, opts, &ProgressBar::hidden())?);
            }
        }
        let dir = self
            .out_dir
            .clone()
            .unwrap_or_else(|| super::default_out_dir(&self.name))
            .join("sensitivity");
        let result = ParitySensitivity {
            name: self.name.clone(),
            reports,
        };
        write(&result, &dir).map_err(|reason| ParityTestError::OutDir {
            path: dir.clone(),
            reason: reason.to_string(),
        })?;
        Ok(result)
    }
}

/// `sensitivity.json` (every analysis) and `sensitivity.md` (the tables) in `dir`.
fn write(result: &ParitySensitivity, dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let json = serde_json::to_vec_pretty(&result.reports)?;
    std::fs::write(dir.join("sensitivity.json"), json)?;
    std::fs::write(
        dir.join("sensitivity.md"),
        format!("```text\n{result}```\n"),
    )
}
