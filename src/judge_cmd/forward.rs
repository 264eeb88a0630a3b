//! Naming a forward bug where it is: the recorder keeps every module's output at chosen steps
//! (step 0 by default), the references keep the same, and the fp64 arbiter judges each output
//! in the order the modules ran. The first module whose output leaves the envelope is where
//! the forward went wrong; the parameters' and gradients' first failure is only where it
//! showed (a wrong bias in a middle layer is first seen at the output layer's gradient).

use lockstep_core::record::{NamedTensor, RunRecord};
use lockstep_harness::parity::{arbitrate, Comparison, ENVELOPE};
use serde_json::Value;

/// A record's module outputs, in execution order (filled from its tensor file).
pub fn read_outputs(record: &Value) -> Vec<NamedTensor> {
    record
        .get("activations")
        .and_then(Value::as_array)
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| serde_json::from_value(e.clone()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// What the module outputs showed: the first one, in execution order, out of its envelope.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardFinding {
    /// The output's name: `step S, rank R: MODULE`.
    pub name: String,
    /// How far out: error over the allowed error.
    pub margin: f64,
    /// How many outputs were judged.
    pub judged: usize,
}

/// A record holding `tensors` as its final values and nothing else, so the arbiter judges
/// exactly them.
fn holding(like: &RunRecord, tensors: &[NamedTensor]) -> RunRecord {
    let mut r = like.clone();
    r.losses.clear();
    r.grad_norms.clear();
    r.params = tensors.to_vec();
    r.buffers.clear();
    r.grads = None;
    r.cross_rank = None;
    r.spec.steps = 0;
    r
}

/// Judges the run's module outputs against the references' (fp64 arbiter: the shadow's are
/// the float64 truth) and returns the first one in execution order out of its envelope.
/// Outputs the three do not all hold at the same shape (a tensor-parallel layer's local
/// shard, a module the references ran on a cast copy) are not judged. `None` when nothing
/// could be judged or everything passed.
pub fn first_bad_output(
    run: (&RunRecord, &[NamedTensor]),
    reference: (&RunRecord, &[NamedTensor]),
    shadow: (&RunRecord, &[NamedTensor]),
) -> Option<ForwardFinding> {
    let shape_of = |list: &[NamedTensor], name: &str| {
        list.iter()
            .find(|t| t.name == name)
            .map(|t| t.shape.clone())
    };
    let common: Vec<NamedTensor> = run
        .1
        .iter()
        .filter(|t| {
            shape_of(reference.1, &t.name).as_ref() == Some(&t.shape)
                && shape_of(shadow.1, &t.name).as_ref() == Some(&t.shape)
        })
        .cloned()
        .collect();
    if common.is_empty() {
        return None;
    }
    let pick = |list: &[NamedTensor]| -> Vec<NamedTensor> {
        common
            .iter()
            .filter_map(|t| list.iter().find(|x| x.name == t.name).cloned())
            .collect()
    };
    let c: Comparison = arbitrate(
        &holding(run.0, &common),
        &holding(reference.0, &pick(reference.1)),
        &holding(shadow.0, &pick(shadow.1)),
        &ENVELOPE,
        None,
    );
    common.iter().find_map(|t| {
        c.param_summaries
            .iter()
            .find(|s| s.name == t.name && !s.stats.passed)
            .map(|s| ForwardFinding {
                name: t.name.clone(),
                margin: s.stats.margin,
                judged: common.len(),
            })
    })
}
