//! `lockstep judge`: the verdict on a recorded job (its headline, each failure's account,
//! also on the CI job page) and exit code.

use super::bad_input;
use super::write_step_summary;
use lockstep::judge_cmd::{judge, verdict, JudgeOptions};
use std::process::ExitCode;

/// Exit 0 when the job passed, 1 when a check failed (the reports are written), 2 on bad
/// input (nothing written).
pub(crate) fn run_judge(opts: JudgeOptions) -> ExitCode {
    match judge(&opts) {
        Ok(judged) => {
            for note in &judged.notes {
                println!("note: {note}");
            }
            print!("{}", verdict::terminal(&judged.report, &judged.files));
            write_step_summary(&verdict::step_summary(&judged.report, &judged.files));
            match judged.report.passed() {
                true => ExitCode::SUCCESS,
                false => ExitCode::FAILURE,
            }
        }
        Err(e) => bad_input(e),
    }
}
