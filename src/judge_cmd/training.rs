//! Whether the job trains at all. A model that trains nothing (every gradient zero from dead
//! activations or a frozen trunk, a loss identically zero) does the same in its references,
//! so every comparison passes: the judge must say so itself.

use super::JudgeError;
use lockstep_core::record::RunRecord;

/// Parameters named in a finding before "and N more".
const MAX_NAMED: usize = 5;

/// What says the job did not train, in words (each fails it): its loss the same at every
/// step, its gradient norm zero at every step, or parameters not in `frozen` whose gradient
/// is zero at every recorded step. A name in `frozen` that is no parameter of the record is
/// bad input.
pub fn findings(run: &RunRecord, frozen: &[String]) -> Result<Vec<String>, JudgeError> {
    if let Some(unknown) = frozen
        .iter()
        .find(|f| !run.params.iter().any(|p| &p.name == *f))
    {
        return Err(JudgeError::Mismatch(format!(
            "the record lists `{unknown}` as frozen, but the model has no parameter of that \
             name (Recorder(frozen=[...]) takes names as model.named_parameters() gives them)"
        )));
    }
    let mut found = Vec::new();
    if let [first, rest @ ..] = run.losses.as_slice() {
        if !rest.is_empty() && rest.iter().all(|l| l.to_bits() == first.to_bits()) {
            found.push(format!(
                "the loss is {first} at every one of the {} steps: nothing the loss sees \
                 trains (a loss that does not depend on the parameters, an optimizer given \
                 none of them)",
                run.losses.len()
            ));
        }
    }
    let trainable = run
        .params
        .iter()
        .filter(|p| !frozen.contains(&p.name))
        .count();
    let norms_all_zero = !run.grad_norms.is_empty() && run.grad_norms.iter().all(|g| *g == 0.0);
    if norms_all_zero && trainable > 0 {
        found.push(format!(
            "the gradient norm is 0 at every one of the {} steps: no parameter gets a gradient \
             (dead activations, a loss that does not reach the parameters); if the whole model \
             is frozen on purpose, say so with Recorder(frozen=[...])",
            run.grad_norms.len()
        ));
    } else if let Some(still) = without_gradient(run, frozen) {
        found.push(still);
    }
    Ok(found)
}

/// The parameters (not frozen) whose recorded gradient is exactly zero at every step that
/// recorded one, named; `None` when there are none or no gradients were recorded.
fn without_gradient(run: &RunRecord, frozen: &[String]) -> Option<String> {
    let steps: Vec<_> = run
        .grads
        .as_ref()?
        .iter()
        .filter(|g| !g.is_empty())
        .collect();
    if steps.is_empty() {
        return None;
    }
    let still: Vec<&str> = run
        .params
        .iter()
        .map(|p| p.name.as_str())
        .filter(|name| !frozen.iter().any(|f| f == name))
        .filter(|name| {
            steps.iter().all(|step| {
                step.iter()
                    .filter(|g| g.name == *name)
                    .all(|g| g.values.iter().all(|v| *v == 0.0))
            })
        })
        .collect();
    if still.is_empty() {
        return None;
    }
    let mut named: Vec<String> = still
        .iter()
        .take(MAX_NAMED)
        .map(|n| format!("`{n}`"))
        .collect();
    if still.len() > MAX_NAMED {
        named.push(format!("and {} more", still.len() - MAX_NAMED));
    }
    Some(format!(
        "{} get a zero gradient at every recorded step, so they do not train (a detached \
         branch, dead activations, a layer the loss does not reach); if they are frozen on \
         purpose, say so with Recorder(frozen=[...])",
        named.join(", ")
    ))
}
