//! The `lockstep` binary's own modules (the library's are beside this folder in `src/`): the
//! command line's types, and each command's glue from its arguments to the library.

pub(crate) mod args;
pub(crate) mod baseline;
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
    let (configs, world_sizes) = with_meshes(&selection)?;
    Some(lockstep::matrix::MatrixOptions {
        models: selection.models,
        configs,
        world_sizes,
        steps: selection.steps,
        seed: selection.seed,
        timeout,
        ..lockstep::matrix::MatrixOptions::default()
    })
}

/// The configurations and world sizes once the selection's `--mesh` descriptions are rows:
/// each mesh's row added to `--configs` (alone, the only rows), its own size the world size
/// when none is given; `None` (after saying why) for a mesh that cannot be parsed, is not
/// built, or does not fit a world size asked for.
fn with_meshes(selection: &args::SelectionArgs) -> Option<(Vec<String>, Vec<usize>)> {
    let mut configs = selection.configs.clone();
    let mut world_sizes = selection.world_sizes.clone();
    let mut own_sizes = Vec::new();
    let mut meshes = Vec::new();
    for text in &selection.meshes {
        let mesh = match text.parse::<lockstep_core::compose::MeshSpec>() {
            Ok(mesh) => mesh,
            Err(e) => {
                eprintln!("error: --mesh: {e}");
                return None;
            }
        };
        let config = lockstep::configs::mesh_config(&mesh);
        own_sizes.push(mesh.world());
        meshes.push((mesh, config));
        configs.push(config.name().to_owned());
    }
    if world_sizes.is_empty() && !own_sizes.is_empty() && own_sizes.iter().all(Option::is_some) {
        world_sizes = own_sizes.into_iter().flatten().collect();
        world_sizes.sort_unstable();
        world_sizes.dedup();
    }
    let sizes = match world_sizes.is_empty() {
        true => vec![lockstep::matrix::DEFAULT_WORLD_SIZE],
        false => world_sizes.clone(),
    };
    // Models named outright (no pattern) must fit the mesh: its refusal names the dimension
    // and the model's size that does not divide.
    let named: Vec<&String> = selection
        .models
        .iter()
        .filter(|m| !m.contains('*'))
        .collect();
    for (mesh, config) in &meshes {
        if let Some(e) = sizes.iter().find_map(|&w| mesh.world_blocker(w)) {
            eprintln!("error: --mesh: {e}");
            return None;
        }
        for name in &named {
            let Ok(model) = lockstep_models::zoo::build(name, selection.seed, 0) else {
                continue; // an unknown model is the matrix's to name
            };
            if let Some(refusal) = sizes
                .iter()
                .find_map(|&w| config.refusal(name, model.as_ref(), w))
            {
                eprintln!("error: --mesh {mesh}: {refusal}");
                return None;
            }
        }
    }
    Some((configs, world_sizes))
}

/// Appends `markdown` to the file `GITHUB_STEP_SUMMARY` names, when it is set (a GitHub
/// Actions step): the job page shows it. A summary that cannot be written is said, not fatal.
pub(crate) fn write_step_summary(markdown: &str) {
    use std::io::Write as _;
    let Some(path) = std::env::var_os("GITHUB_STEP_SUMMARY").filter(|p| !p.is_empty()) else {
        return;
    };
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(markdown.as_bytes()));
    if let Err(e) = written {
        eprintln!(
            "warning: GITHUB_STEP_SUMMARY ({}): {e}",
            std::path::Path::new(&path).display()
        );
    }
}
