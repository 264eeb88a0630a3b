//! Steps a job's loss scaler skipped: under fp16 a `GradScaler` finds overflowed gradients,
//! skips that step's update and lowers its scale. The recorder marks the step
//! (`skipped_steps`), the references replay the skip, and the judge sets the step's
//! gradients, gradient norm and gradients at module outputs aside: they are infinite by design, while its loss and every
//! later step (which shows whether the job really skipped the update) are judged as usual.

use super::forward::{step_of, ModuleProbes};
use lockstep_core::record::RunRecord;

/// Removes the gradients and gradient norm of every step in `skipped` from each record (the
/// norm set to 0 on every side, so the three agree), and says what was set aside; `None`
/// when nothing was skipped.
pub fn set_aside(records: &mut [&mut RunRecord], skipped: &[usize]) -> Option<String> {
    if skipped.is_empty() {
        return None;
    }
    for record in records.iter_mut() {
        for &step in skipped {
            if let Some(norm) = record.grad_norms.get_mut(step) {
                *norm = 0.0;
            }
            if let Some(grads) = record.grads.as_mut().and_then(|g| g.get_mut(step)) {
                grads.clear();
            }
        }
    }
    let steps: Vec<String> = skipped.iter().map(usize::to_string).collect();
    Some(format!(
        "the job's loss scaler skipped step{} {} (its gradients overflowed); the references \
         skipped {} too, and {} gradients are not compared",
        if skipped.len() == 1 { "" } else { "s" },
        steps.join(", "),
        if skipped.len() == 1 { "it" } else { "them" },
        if skipped.len() == 1 { "its" } else { "their" },
    ))
}

/// Removes the gradients recorded at module outputs during the skipped steps: scaled by a
/// scale that overflowed, they are no more comparable than the parameters' gradients.
pub fn set_aside_output_grads(probes: &mut ModuleProbes, skipped: &[usize]) {
    probes
        .output_grads
        .retain(|t| step_of(&t.name).is_none_or(|step| !skipped.contains(&step)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_core::record::RunSpec;

    fn record(norms: &[f64]) -> RunRecord {
        let spec = RunSpec {
            model: "mlp".into(),
            config: "ddp".into(),
            world_size: 2,
            backend: "gloo".into(),
            dtype: "fp16".into(),
            steps: norms.len(),
            seed: 0,
        };
        let mut r = RunRecord::start(spec, true);
        r.grad_norms = norms.to_vec();
        r.grads = Some(vec![Vec::new(); norms.len()]);
        r
    }

    #[test]
    fn a_skipped_steps_norms_agree_on_every_side_and_the_note_names_it() {
        let (mut run, mut reference) = (record(&[f64::NAN, 1.0]), record(&[f64::NAN, 1.0]));
        let note = set_aside(&mut [&mut run, &mut reference], &[0]);
        assert_eq!(run.grad_norms, vec![0.0, 1.0]);
        assert_eq!(reference.grad_norms, vec![0.0, 1.0]);
        assert!(note.is_some_and(|n| n.contains("skipped step 0")));
        assert!(set_aside(&mut [&mut run], &[]).is_none());
    }

    #[test]
    fn a_skipped_steps_gradients_at_module_outputs_are_set_aside() {
        let grad = |name: &str| -> lockstep_core::record::NamedTensor {
            serde_json::from_value(serde_json::json!({
                "name": name, "dtype": "F32", "shape": [1], "values": [0.0]
            }))
            .expect("a tensor")
        };
        let mut probes = ModuleProbes {
            outputs: Vec::new(),
            output_grads: vec![grad("step 0, rank 0: 3"), grad("step 1, rank 0: 3")],
        };
        set_aside_output_grads(&mut probes, &[0]);
        let names: Vec<&str> = probes
            .output_grads
            .iter()
            .map(|t| t.name.as_str())
            .collect();
        assert_eq!(names, ["step 1, rank 0: 3"]);
    }
}
