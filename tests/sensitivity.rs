//! Sensitivity analysis end to end: `ddp` on `mlp` at 2 ranks catches a skipped, doubled or
//! zeroed gradient all-reduce on either rank, and owns up to the one site whose fault passes
//! every check (rank 1's loss all-reduce, which only rank 1's own record reads: reported
//! inert, the training ending with the same bits on every rank); `ParityTest::sensitivity`
//! analyses a user's own closure the same way.

use lockstep::comm::{CallRecord, FaultKind, OpKind, ReduceOp};
use lockstep::core::train::{train, StepHooks, TrainError};
use lockstep::matrix::MatrixOptions;
use lockstep::parity_test::{ParityTest, Reference};
use lockstep::sensitivity::{SensitivityOptions, SensitivityReport, Verdict};
use std::time::Duration;
use tch::Tensor;

/// The analysis both tests run: skip, double and zero at the calls of the first step.
fn options() -> SensitivityOptions {
    SensitivityOptions {
        kinds: vec![FaultKind::Skip, FaultKind::Double, FaultKind::Zero],
        site_steps: vec![0],
        timeout: Duration::from_secs(30),
    }
}

/// The loss all-reduce: one f64.
fn is_loss(c: &CallRecord) -> bool {
    c.op == OpKind::AllReduce && c.dtype == "f64" && c.shape == [1]
}

/// The calls of training step 0 on each rank: those up to and including the first loss
/// all-reduce (whether or not the loop ticks the step clock, which numbers every call of an
/// unticked run in step 0).
fn first_step(report: &SensitivityReport, rank: usize) -> Vec<&lockstep::sensitivity::SiteResult> {
    let sites: Vec<_> = report
        .sites
        .iter()
        .filter(|s| s.site.rank == rank)
        .collect();
    let end = sites
        .iter()
        .position(|s| is_loss(&s.site))
        .expect("a loss all-reduce");
    sites[..=end].to_vec()
}

fn verdict<'a>(site: &'a lockstep::sensitivity::SiteResult, fault: &str) -> &'a Verdict {
    &site
        .faults
        .iter()
        .find(|f| f.fault == fault)
        .expect("tried")
        .verdict
}

#[test]
fn ddp_catches_faults_at_the_gradient_all_reduce_and_reports_a_site_without_effect() {
    let opts = MatrixOptions {
        steps: 2,
        ..MatrixOptions::default()
    };
    let bar = indicatif::ProgressBar::hidden();
    let report = lockstep::matrix::sensitivity("mlp", "ddp", 2, &opts, &options(), &bar)
        .expect("the analysis runs");
    let table = report.to_string();
    for rank in 0..2 {
        let step0 = first_step(&report, rank);
        let grads: Vec<_> = step0
            .iter()
            .filter(|s| s.site.op == OpKind::AllReduce && s.site.dtype == "f32")
            .collect();
        assert!(
            !grads.is_empty(),
            "no gradient all-reduce on rank {rank}:\n{table}"
        );
        for site in grads {
            for fault in ["skip", "double", "zero"] {
                assert!(
                    matches!(verdict(site, fault), Verdict::Caught { .. }),
                    "{fault} at {} {} not caught:\n{table}",
                    site.site.site(),
                    site.site.describe()
                );
            }
        }
        // Every fault of step 0 that changed a bit is caught, except on rank 1's loss
        // all-reduce: its result is only rank 1's recorded loss, which nothing compares, and
        // the training ends with the same bits on every rank: reported inert, not caught.
        for site in &step0 {
            for f in &site.faults {
                let without_effect = rank == 1 && is_loss(&site.site);
                match &f.verdict {
                    Verdict::Inert { .. } if without_effect => {}
                    v if without_effect => {
                        panic!(
                            "{} at {}: {v:?}, want inert:\n{table}",
                            f.fault,
                            site.site.site()
                        )
                    }
                    Verdict::Missed { .. } | Verdict::Inert { .. } | Verdict::Moved { .. } => {
                        panic!("{} at {} missed:\n{table}", f.fault, site.site.site())
                    }
                    _ => {}
                }
            }
        }
    }
    // Skipping the parameter broadcast on the rank that already holds the same parameters
    // changes no bit: reported as such, not as a catch or a miss.
    let broadcast = report
        .sites
        .iter()
        .find(|s| s.site.op == OpKind::Broadcast && s.site.rank == 1)
        .expect("DDP broadcasts the parameters");
    assert_eq!(verdict(broadcast, "skip"), &Verdict::Same, "{table}");
    assert!(
        table.contains("inert") && table.contains("all_reduce world [1] f64"),
        "{table}"
    );
}

/// A user's data parallelism: each gradient averaged with an all-reduce of its own.
struct MyDdp<'a> {
    ctx: &'a lockstep::harness::RankCtx,
}

impl StepHooks for MyDdp<'_> {
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        for (_, g) in grads {
            self.ctx.group().all_reduce(g, ReduceOp::Avg)?;
        }
        Ok(())
    }
}

#[test]
fn parity_test_sensitivity_analyses_a_custom_closure() {
    let result = ParityTest::new("sensitivity_of_a_custom_closure")
        .zoo("mlp")
        .custom_config("my_ddp", |ctx, model, cfg| {
            let group = ctx.group();
            train(model, cfg, &mut MyDdp { ctx }, Some(group.as_ref())).map_err(|e| e.to_string())
        })
        .reference(Reference::Single)
        .steps(2)
        .sensitivity_with(&options())
        .expect("the analysis runs");
    assert_eq!(result.reports.len(), 1);
    let report = &result.reports[0];
    let table = result.to_string();
    assert!(table.contains("sensitivity of my_ddp@2 on mlp"), "{table}");
    let params = lockstep::models::zoo::build("mlp", 0, 0)
        .expect("zoo mlp")
        .named_parameters()
        .len();
    for rank in 0..2 {
        let step0 = first_step(report, rank);
        let grads: Vec<_> = step0.iter().filter(|s| s.site.dtype == "f32").collect();
        assert_eq!(grads.len(), params, "one all-reduce per gradient:\n{table}");
        for site in grads {
            for fault in ["skip", "double", "zero"] {
                assert!(
                    verdict(site, fault).caught(),
                    "{fault} at {} not caught:\n{table}",
                    site.site.site()
                );
            }
        }
    }
    // The analysis's files next to the test's reports.
    let json = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .ancestors()
        .find(|a| a.ends_with("target"))
        .expect("a target directory")
        .join("lockstep/sensitivity_of_a_custom_closure/sensitivity/sensitivity.json");
    assert!(json.exists(), "{}", json.display());
}

/// Every site's verdicts from `lockstep matrix --sensitivity ... extra`, as (site, fault,
/// verdict) lines.
fn cli_sensitivity(out: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_lockstep"))
        .args([
            "matrix",
            "--sensitivity",
            "--models",
            "mlp",
            "--configs",
            "ddp",
        ])
        .args([
            "--world-size",
            "2",
            "--steps",
            "2",
            "--faults",
            "skip,zero",
            "--out",
        ])
        .arg(out)
        .args(extra)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .status()
        .expect("run lockstep");
    assert!(status.success(), "lockstep matrix --sensitivity {extra:?}");
    let text = std::fs::read_to_string(out.join("sensitivity.json")).expect("sensitivity.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let mut lines = Vec::new();
    for site in json[0]["report"]["sites"].as_array().expect("sites") {
        for fault in site["faults"].as_array().expect("faults") {
            lines.push(format!(
                "{} {} {}",
                site["site"], fault["fault"], fault["verdict"]
            ));
        }
    }
    lines
}

/// Exec'd ranks (how CUDA runs start, `--device cuda`) take the fault plan on their command
/// line and find the forked ranks' verdicts at every site: the sensitivity analysis of a CUDA
/// matrix is the CPU one's, on CUDA.
#[test]
fn exec_d_ranks_take_the_fault_plan_and_give_the_forked_verdicts() {
    let dir = std::env::temp_dir().join(format!("lockstep-sens-exec-{}", std::process::id()));
    let forked = cli_sensitivity(&dir.join("forked"), &[]);
    let execd = cli_sensitivity(&dir.join("execd"), &["--exec-ranks"]);
    assert!(!forked.is_empty());
    assert!(
        forked
            .iter()
            .any(|l| l.contains("caught") || l.contains("Caught")),
        "{forked:#?}"
    );
    assert_eq!(forked, execd);
    let _ = std::fs::remove_dir_all(&dir);
}
