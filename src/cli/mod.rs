//! The `lockstep` binary's own modules (the library's are beside this folder in `src/`): the
//! command line's types, and each command's glue from its arguments to the library.

pub(crate) mod args;
pub(crate) mod bench;
pub(crate) mod judge;
pub(crate) mod matrix;
pub(crate) mod sensitivity;
pub(crate) mod setup;

use std::process::ExitCode;

/// Prints `error: <e>` and gives bad input's exit code (nothing run).
/// Reports bad input on stderr and gives exit code 2 ("could not judge"), apart from a
/// failed run (1), so CI can tell them apart.
pub(crate) fn bad_input(e: impl std::fmt::Display) -> ExitCode {
    eprintln!("error: {e}");
    ExitCode::from(2)
}

/// The matrix options a selection describes; `None` (after saying why) for a timeout that is
/// not a positive number of seconds.
pub(crate) fn matrix_options(
    selection: args::SelectionArgs,
    timeout: f64,
) -> Option<lockstep::matrix::MatrixOptions> {
    let timeout = match std::time::Duration::try_from_secs_f64(timeout) {
        Ok(t) if !t.is_zero() => t,
        _ => {
            eprintln!(
                "error: invalid option: --timeout {timeout}: must be a positive number of seconds"
            );
            return None;
        }
    };
    Some(lockstep::matrix::MatrixOptions {
        models: selection.models,
        configs: selection.configs,
        world_sizes: selection.world_sizes,
        steps: selection.steps,
        seed: selection.seed,
        timeout,
        ..lockstep::matrix::MatrixOptions::default()
    })
}
