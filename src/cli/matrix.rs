//! `lockstep matrix` and `lockstep stress`: options from flags, the run, the report and its exit code.

use super::args::{MatrixArgs, StressArgs};
use super::sensitivity::run_matrix_sensitivity;
use super::{bad_input, matrix_options, write_step_summary};
use anyhow::Result;
use lockstep_harness::report::{
    compare_reports, plural, read_report_or_baseline, CompareOptions, Report,
};
use std::process::ExitCode;

/// `lockstep matrix`: exit 0 when everything passed, 1 when a parity check or a run failed,
/// 2 when the input was unusable (nothing ran).
pub(crate) fn run_matrix(args: MatrixArgs) -> Result<ExitCode> {
    use lockstep::matrix;
    if args.list {
        return Ok(match matrix::render_list(args.selection.seed) {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => bad_input(e),
        });
    }
    // Under torchrun/srun this process is one rank (`lockstep::runner::external`).
    let external = match lockstep::runner::external::detect() {
        Ok(external) => external,
        Err(e) => return Ok(bad_input(e)),
    };
    let opts = match matrix_run_options(&args, external) {
        Ok(opts) => opts,
        Err(code) => return Ok(code),
    };
    if args.sensitivity {
        if let Err(e) = matrix::check_backend(&opts) {
            return Ok(bad_input(e));
        }
        lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
        return run_matrix_sensitivity(&opts, &args.faults, &args.out);
    }
    // The baseline is read before anything runs: a bad one loses no run.
    let baseline = match args.baseline.as_deref().map(read_report_or_baseline) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(e)) => return Ok(bad_input(format!("--baseline: {e}"))),
    };
    // Only rank 0 of an external launch writes reports (the others may share its disk).
    let reporting = external.is_none_or(|l| l.rank == 0);
    let plan = match matrix::check_backend(&opts)
        .and_then(|()| matrix::plan(&opts))
        .and_then(|plan| {
            if reporting {
                matrix::prepare_out_dir(&args.out)?;
            }
            Ok(plan)
        }) {
        Ok(plan) => plan,
        Err(e) => return Ok(bad_input(e)),
    };
    // The references run in this process: on CUDA they need the same numerics as the ranks.
    lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
    if let (Some(launch), false) = (external, reporting) {
        return Ok(external_rank_summary(launch, &matrix::run_quietly(&plan)));
    }
    let bar = matrix::progress_bar(plan.run_count());
    let result = matrix::run(&plan, &bar);
    report_matrix(&result, &args, baseline.as_ref())
}

/// The matrix's options from the command line (an external launch's world size when none
/// is given), or the exit code of the bad input that prevents them.
pub(crate) fn matrix_run_options(
    args: &MatrixArgs,
    external: Option<&lockstep_core::comm::ExternalLaunch>,
) -> Result<lockstep::matrix::MatrixOptions, ExitCode> {
    let mut selection = args.selection.clone();
    if let Some(launch) = external {
        if let Some(refused) = external_refusal(args) {
            return Err(bad_input(format!(
                "{refused} has no external mode yet (under torchrun/srun every process is one rank)"
            )));
        }
        if selection.world_sizes.is_empty() {
            selection.world_sizes = vec![launch.world_size];
        }
    }
    let mut opts = matrix_options(selection, args.timeout).ok_or(ExitCode::from(2))?;
    opts.fault = args.fault.clone();
    opts.subtests = !args.isolated;
    opts.backend = args.backend;
    opts.device = args.compute.device(args.backend).map_err(bad_input)?;
    opts.tf32 = args.compute.tf32;
    opts.exec_ranks = args.exec_ranks;
    opts.arbiter_log = args.arbiter_log.clone();
    if let Some(mode) = args.p2p {
        // Every rank reads it when it joins; forked and exec'd ranks inherit it.
        std::env::set_var(lockstep_core::comm::P2P_VAR, mode.name());
    }
    lockstep_core::comm::PointToPoint::from_env().map_err(|e| bad_input(e.to_string()))?;
    Ok(opts)
}

/// Prints the matrix's account (the compact summary; every row with `--rows`; JSON lines
/// with `--json`), compares it with the baseline if one was given, writes its report set and
/// the CI job page's summary (`GITHUB_STEP_SUMMARY`), and gives the exit code: 0 passed, 1 a
/// row failed, a run failed, a comparison regressed or the external launch stopped.
pub(crate) fn report_matrix(
    result: &lockstep::matrix::MatrixResult,
    args: &MatrixArgs,
    baseline: Option<&Report>,
) -> Result<ExitCode> {
    let mut report = result.report();
    let mut unjudged = false;
    if let Some(base) = baseline {
        match compare_reports(base, &report, &CompareOptions::default()) {
            Ok(against) => report = report.with_regressions(&against),
            Err(e) => {
                eprintln!("error: comparing with the baseline: {e}");
                unjudged = true;
            }
        }
    }
    // What a person reads: every row with `--rows`, else the summary; on stderr when stdout
    // carries the JSON rows.
    let account = match args.rows {
        true => result.render_table() + &lockstep::matrix::render_regressions(&report.regressions),
        false => result.render_summary(&report.regressions, &args.out),
    };
    if args.json {
        for row in &result.rows {
            println!("{}", serde_json::to_string(row)?);
        }
        eprint!("{account}");
    } else {
        print!("{account}");
    }
    write_step_summary(&result.render_step_summary(&report.regressions, &args.out));
    match lockstep_harness::report::write_all(&report, &args.out) {
        Ok(files) if result.failed_runs > 0 => eprintln!(
            "report: {} (INCOMPLETE: {} of {} failed; their rows are errors)",
            files.json.display(),
            result.failed_runs,
            lockstep_harness::report::plural(result.runs, "run")
        ),
        Ok(files) => eprintln!("report: {}", files.json.display()),
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::FAILURE);
        }
    }
    if !report.regressions.is_empty() || unjudged {
        return Ok(ExitCode::FAILURE);
    }
    if let Some(stopped) = lockstep::runner::external::stopped() {
        eprintln!("error: the external launch stopped: {}", stopped.line);
        return Ok(ExitCode::FAILURE);
    }
    Ok(if result.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The matrix option that has no external mode yet, if `args` uses one. (`--backend nccl`
/// and `--exec-ranks` have one: every process trains as an exec'd rank would.)
pub(crate) fn external_refusal(args: &MatrixArgs) -> Option<&'static str> {
    args.sensitivity
        .then_some("`lockstep matrix --sensitivity`")
}

/// What a rank other than 0 of an external launch says of a matrix it ran with every other
/// rank: one line (rank 0 prints the table and writes the report), and the exit code every
/// rank shares, since every rank judged the same records.
pub(crate) fn external_rank_summary(
    launch: &lockstep_core::comm::ExternalLaunch,
    result: &lockstep::matrix::MatrixResult,
) -> ExitCode {
    if let Some(stopped) = lockstep::runner::external::stopped() {
        eprintln!(
            "error: rank {} of {}: the external launch stopped: {}",
            launch.rank, launch.world_size, stopped.line
        );
        return ExitCode::FAILURE;
    }
    let verdict = if result.passed() { "passed" } else { "FAILED" };
    println!(
        "lockstep matrix rank {} of {}: {verdict} ({}; rank 0 prints the table and writes the report)",
        launch.rank,
        launch.world_size,
        lockstep_harness::report::plural(result.rows.len(), "row")
    );
    if result.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `lockstep stress`: exit 0 when no run hung or failed, 1 otherwise, 2 on bad input.
pub(crate) fn run_stress(args: StressArgs) -> Result<ExitCode> {
    let Some(mut opts) = matrix_options(args.selection, args.timeout) else {
        return Ok(ExitCode::from(2));
    };
    opts.fault = args.fault;
    if args.repeat == 0 {
        eprintln!("error: invalid option: --repeat 0: must be at least 1");
        return Ok(ExitCode::from(2));
    }
    let plan = match lockstep::matrix::plan(&opts) {
        Ok(plan) => plan,
        Err(e) => return Ok(bad_input(e)),
    };
    let stress = lockstep::stress::StressOptions {
        repeat: args.repeat,
        busy_threads: args.busy_threads,
        max_send_delay: std::time::Duration::from_micros(args.send_delay_us),
    };
    eprintln!(
        "stress: {} per iteration, {}, {}, send delays up to {} us, timeout {:.0} s",
        plural(plan.run_count(), "run"),
        plural(stress.repeat, "iteration"),
        plural(stress.busy_threads, "busy thread"),
        args.send_delay_us,
        args.timeout
    );
    let outcome = lockstep::stress::run(&plan, &stress, |line| eprintln!("{line}"));
    print!("{}", outcome.render());
    Ok(if outcome.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
