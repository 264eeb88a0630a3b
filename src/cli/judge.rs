//! `lockstep judge`: the verdict on a recorded job, its headline and exit code.

use super::bad_input;
use lockstep::judge_cmd::{judge, JudgeOptions};
use std::process::ExitCode;

/// Exit 0 when the job passed, 1 when a check failed (the reports are written), 2 on bad
/// input (nothing written).
pub(crate) fn run_judge(opts: JudgeOptions) -> ExitCode {
    match judge(&opts) {
        Ok(judged) => {
            for note in &judged.notes {
                println!("note: {note}");
            }
            println!("{}", judged.report.headline());
            println!("reports: {}", judged.files.markdown.display());
            match judged.report.passed() {
                true => ExitCode::SUCCESS,
                false => ExitCode::FAILURE,
            }
        }
        Err(e) => bad_input(e),
    }
}
