//! `lockstep sensitivity`: one collective call corrupted per run, over one configuration or the matrix.

use super::args::{FaultArgs, SelectionArgs, SensitivityArgs};
use super::{bad_input, matrix_options};
use anyhow::{Context, Result};
use std::process::ExitCode;

/// The analysis `faults` asks for, over `defaults` where it names nothing; `None` (after
/// saying why) for an unknown fault or a bad timeout.
pub(crate) fn sensitivity_options(
    faults: &FaultArgs,
    defaults: lockstep::sensitivity::SensitivityOptions,
) -> Option<lockstep::sensitivity::SensitivityOptions> {
    let mut opts = defaults;
    if !faults.faults.is_empty() {
        let mut kinds = Vec::new();
        for name in &faults.faults {
            // `perturb` alone: its ε is bisected anyway.
            let parsed = match name.as_str() {
                "perturb" => Ok(lockstep::comm::FaultKind::Perturb(1e-3)),
                other => other.parse(),
            };
            match parsed {
                Ok(kind) => kinds.push(kind),
                Err(e) => {
                    eprintln!("error: invalid option: --faults: {e}");
                    return None;
                }
            }
        }
        opts.kinds = kinds;
    }
    if !faults.site_steps.is_empty() {
        opts.site_steps.clone_from(&faults.site_steps);
    }
    opts.timeout = match std::time::Duration::try_from_secs_f64(faults.run_timeout) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!(
                "error: invalid option: --run-timeout {}: must be a positive number of seconds",
                faults.run_timeout
            );
            return None;
        }
    };
    Some(opts)
}

/// `lockstep sensitivity`: exit 0 when every math-changing fault (and every field bug the
/// configuration runs) was caught, 1 when one was missed, 2 on bad input or a configuration that cannot be analysed.
pub(crate) fn run_sensitivity(args: SensitivityArgs) -> Result<ExitCode> {
    use lockstep::sensitivity::SensitivityOptions;
    let selection = SelectionArgs {
        models: vec![args.model.clone()],
        configs: vec![args.config.clone()],
        world_sizes: vec![args.world_size],
        meshes: Vec::new(),
        steps: args.steps,
        seed: args.seed,
    };
    let (Some(mut opts), Some(analysis)) = (
        matrix_options(selection, args.timeout),
        sensitivity_options(&args.faults, SensitivityOptions::default()),
    ) else {
        return Ok(ExitCode::from(2));
    };
    opts.device = args
        .compute
        .device(lockstep_core::comm::Backend::Cpu)
        .unwrap_or_default();
    opts.tf32 = args.compute.tf32;
    if let Err(e) = lockstep::matrix::check_backend(&opts) {
        return Ok(bad_input(e));
    }
    lockstep::device::prepare_process(opts.device, opts.backend, opts.tf32)?;
    let bar = lockstep::matrix::progress_bar(1);
    let report = match lockstep::matrix::sensitivity(
        &args.model,
        &args.config,
        args.world_size,
        &opts,
        &analysis,
        &bar,
    ) {
        Ok(r) => r,
        Err(e) => {
            bar.finish_and_clear();
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    bar.finish_and_clear();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    if let Some(dir) = &args.out {
        report
            .write(dir)
            .context("writing the sensitivity report")?;
        eprintln!("report: {}", dir.join("sensitivity.json").display());
    }
    Ok(
        if report.misses(true).is_empty() && report.field_bugs_missed().is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        },
    )
}

/// `lockstep matrix --sensitivity`: exit 0 when every math-changing fault was caught at every
/// site of every configuration analysed, 1 otherwise, 2 on bad input.
pub(crate) fn run_matrix_sensitivity(
    opts: &lockstep::matrix::MatrixOptions,
    faults: &FaultArgs,
    out: &std::path::Path,
) -> Result<ExitCode> {
    use lockstep::matrix;
    let Some(analysis) = sensitivity_options(
        faults,
        lockstep::sensitivity::SensitivityOptions::math_changing(),
    ) else {
        return Ok(ExitCode::from(2));
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("error: output directory {}: {e}", out.display());
        return Ok(ExitCode::from(2));
    }
    let started = std::time::Instant::now();
    let bar = matrix::progress_bar(1);
    let entries = match matrix::sensitivity_matrix(opts, &analysis, &bar) {
        Ok(entries) => entries,
        Err(e) => {
            bar.finish_and_clear();
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    bar.finish_and_clear();
    print!("{}", matrix::render_sensitivity_matrix(&entries));
    println!(
        "matrix --sensitivity: {} in {:.1} s",
        lockstep_harness::report::plural(entries.len(), "configuration"),
        started.elapsed().as_secs_f64()
    );
    let path = out.join("sensitivity.json");
    std::fs::write(&path, serde_json::to_vec_pretty(&entries)?)
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("report: {}", path.display());
    Ok(if matrix::sensitivity_matrix_passed(&entries) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
