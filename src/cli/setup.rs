//! `lockstep setup`: a user's crate made ready to use Lockstep, and what was changed.

use super::bad_input;
use std::path::PathBuf;
use std::process::ExitCode;

/// Exit 0 with what was set up (or that nothing needed to be), 2 when no libtorch is known or
/// the crate cannot be set up.
pub(crate) fn run_setup(
    dir: PathBuf,
    libtorch: Option<PathBuf>,
    lockstep: Option<PathBuf>,
    offline: bool,
) -> ExitCode {
    use lockstep::setup_cmd;
    let Some(libtorch) = libtorch
        .or_else(|| std::env::var_os("LIBTORCH").map(PathBuf::from))
        .or_else(setup_cmd::built_libtorch)
    else {
        eprintln!("error: no libtorch known: pass --libtorch DIR or set LIBTORCH");
        return ExitCode::from(2);
    };
    let opts = setup_cmd::SetupOptions {
        dir,
        lockstep: lockstep.unwrap_or_else(setup_cmd::built_checkout),
        libtorch,
        offline,
    };
    match setup_cmd::setup(&opts) {
        Ok(report) => {
            for change in &report.changes {
                println!("set up: {change}");
            }
            for todo in &report.todo {
                println!("to do: {todo}");
            }
            if report.changes.is_empty() && report.todo.is_empty() {
                println!("already set up: nothing to change");
            }
        }
        Err(e) => return bad_input(e),
    }
    ExitCode::SUCCESS
}
