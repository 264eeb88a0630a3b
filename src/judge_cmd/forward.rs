//! Naming a forward or backward bug where it is: the recorder keeps every module's output at
//! chosen steps (step 0 by default) and the gradient backward brings to it, the references
//! keep the same, and the fp64 arbiter judges each output in the order the modules ran, then
//! each output's gradient in the order backward reached them. The first module whose output
//! leaves the envelope is where the forward went wrong; the first output whose gradient
//! leaves it is the input of the module whose backward went wrong (the one backward reached
//! just before). The parameters' and gradients' first failure is only where either showed
//! (a wrong bias in a middle layer is first seen at the output layer's gradient).

use lockstep_core::record::{NamedTensor, RunRecord};
use lockstep_harness::parity::{arbitrate, Comparison, ENVELOPE};
use serde_json::Value;

/// What a record kept of its modules at the chosen steps.
#[derive(Clone, Debug, Default)]
pub struct ModuleProbes {
    /// Their outputs, in execution order.
    pub outputs: Vec<NamedTensor>,
    /// The gradients backward brought to those outputs, in the order it reached them.
    pub output_grads: Vec<NamedTensor>,
}

/// A record's module outputs, in execution order (filled from its tensor file).
pub fn read_outputs(record: &Value) -> Vec<NamedTensor> {
    read_list(record, "activations")
}

/// The gradients a record's backward brought to its module outputs, in the order it reached
/// them (filled from its tensor file).
pub fn read_output_grads(record: &Value) -> Vec<NamedTensor> {
    read_list(record, "output_grads")
}

/// The tensors of a record's `field` list, in order; none when it has no such list.
fn read_list(record: &Value, field: &str) -> Vec<NamedTensor> {
    record
        .get(field)
        .and_then(Value::as_array)
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| serde_json::from_value(e.clone()).ok())
                .collect()
        })
        .unwrap_or_default()
}

/// What the module outputs (or their gradients) showed: the first one, in the order they
/// were recorded, out of its envelope.
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardFinding {
    /// The output's name: `step S, rank R: MODULE`.
    pub name: String,
    /// The one judged just before it, within its envelope (same step and rank): for
    /// gradients, the module whose backward produced the first bad one.
    pub previous: Option<String>,
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

/// What judging the module outputs (or their gradients) found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputJudgement {
    /// The steps at which at least one was judged.
    pub judged_steps: Vec<usize>,
    /// The first one out of its envelope, if any.
    pub first_bad: Option<ForwardFinding>,
}

/// Judges the run's module outputs against the references' (fp64 arbiter: the shadow's are
/// the float64 truth) and returns the first one in execution order out of its envelope.
/// Outputs the three do not all hold at the same shape (a tensor-parallel layer's local
/// shard, a module the references ran on a cast copy) are not judged.
pub fn judge_outputs(
    run: (&RunRecord, &[NamedTensor]),
    reference: (&RunRecord, &[NamedTensor]),
    shadow: (&RunRecord, &[NamedTensor]),
) -> OutputJudgement {
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
        return OutputJudgement::default();
    }
    let mut judged_steps: Vec<usize> = common.iter().filter_map(|t| step_of(&t.name)).collect();
    judged_steps.dedup();
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
    let first_bad = common.iter().enumerate().find_map(|(i, t)| {
        c.param_summaries
            .iter()
            .find(|s| s.name == t.name && !s.stats.passed)
            .map(|s| ForwardFinding {
                name: t.name.clone(),
                previous: i
                    .checked_sub(1)
                    .map(|j| common[j].name.clone())
                    .filter(|p| same_step_and_rank(p, &t.name)),
                margin: s.stats.margin,
                judged: common.len(),
            })
    });
    OutputJudgement {
        judged_steps,
        first_bad,
    }
}

/// Whether two entries (`step S, rank R: MODULE`) are of the same step and rank.
fn same_step_and_rank(a: &str, b: &str) -> bool {
    let prefix = |n: &str| n.split(": ").next().map(str::to_owned);
    prefix(a) == prefix(b)
}

/// The module an entry names (`step S, rank R: MODULE (call C)` → `MODULE (call C)`).
pub fn module_of(entry: &str) -> &str {
    entry.split_once(": ").map_or(entry, |(_, m)| m)
}

/// The step an entry names (`step S, rank R: MODULE` → S).
pub fn step_of(entry: &str) -> Option<usize> {
    entry.strip_prefix("step ")?.split(',').next()?.parse().ok()
}
