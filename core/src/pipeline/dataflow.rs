//! Which layer outputs each stage needs from earlier stages, learned by running the model
//! once rather than declared by it: models stay plain.
//!
//! The probe runs a forward in which every layer's output is replaced by a fresh leaf, then
//! asks autograd which leaves each layer's inputs (and the model's output) depend on. Code
//! between layers (the GPT's sum of token and position embeddings, the transformer's split of
//! one embedding call into source and target) is replayed by every stage that needs its
//! result, so a stage receives the *outputs* of earlier layers, not the inputs of its first
//! one. An output consumed two or more stages later (the transformer's target embedding,
//! used by the decoder) is sent straight to its consumer: FairScale's skip connections.
//! Integer outputs cannot carry gradients; they count as dependencies where a layer consumes
//! the very tensor. A dependency through a non-differentiable float operation would be
//! missed; a parity run shows it as a difference.

use super::PipelineError;
use crate::autograd::{self, GradOptions};
use lockstep_models::{Batch, LayerHooks, Model, ModelError};
use std::collections::BTreeSet;
use std::ops::Range;
use tch::{Device, Kind, Tensor};

/// A tensor's shape, dtype and device: what a receiver allocates (the handshake compares
/// shape and dtype; each rank keeps its own device).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    /// Full shape, batch dimension included.
    pub shape: Vec<i64>,
    /// Element type.
    pub kind: Kind,
    /// Where the probe's forward produced it: the stage's activations' device, on which
    /// receive buffers and stand-ins are created (an NCCL group receives into tensors on its
    /// own device only, and a CPU stand-in would meet CUDA activations).
    pub device: Device,
}

impl TensorMeta {
    /// The metadata of `t`.
    pub fn of(t: &Tensor) -> TensorMeta {
        TensorMeta {
            shape: t.size(),
            kind: t.kind(),
            device: t.device(),
        }
    }

    /// Whether the tensor can carry a gradient.
    pub fn is_float(&self) -> bool {
        is_float(self.kind)
    }

    /// A zero tensor of this shape and dtype on its device: a receive buffer, or the
    /// stand-in for an output nothing consumes.
    pub fn zeros(&self) -> Result<Tensor, tch::TchError> {
        Tensor::f_zeros(self.shape.as_slice(), (self.kind, self.device))
    }
}

impl std::fmt::Display for TensorMeta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}{:?}", self.kind, self.shape)
    }
}

pub(crate) fn is_float(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Float | Kind::Double | Kind::Half | Kind::BFloat16
    )
}

/// What one probe learned about a model at one microbatch size.
#[derive(Clone, Debug)]
pub struct Dataflow {
    /// Per layer: its output's shape and dtype.
    pub outputs: Vec<TensorMeta>,
    /// Per layer: the earlier layers whose outputs its inputs depend on directly.
    pub deps: Vec<BTreeSet<usize>>,
    /// The layers whose outputs the model's output depends on directly.
    pub output_deps: BTreeSet<usize>,
}

struct Probe {
    leaves: Vec<Tensor>,
    inputs: Vec<Vec<Tensor>>,
}

impl LayerHooks for Probe {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        if index != self.inputs.len() {
            return Err(ModelError::Hook(
                format!(
                    "layer {index} ran out of order (expected {})",
                    self.inputs.len()
                )
                .into(),
            ));
        }
        self.inputs
            .push(inputs.iter().map(Tensor::shallow_clone).collect());
        Ok(inputs)
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        let mut leaf = output.f_detach()?;
        let leaf = if is_float(leaf.kind()) {
            leaf.f_requires_grad_(true)?
        } else {
            leaf
        };
        self.leaves.push(leaf.shallow_clone());
        Ok(leaf)
    }
}

/// Runs `model` once on `batch` and records every layer's output and dependencies.
pub fn probe(model: &dyn Model, batch: &Batch) -> Result<Dataflow, PipelineError> {
    if !model.supports_layer_hooks() {
        return Err(PipelineError::InvalidPlan(format!(
            "model `{}` does not run its layers through hooks, so no stage can run a part of it",
            model.name()
        )));
    }
    let layers = model.layers().len();
    let mut p = Probe {
        leaves: Vec::with_capacity(layers),
        inputs: Vec::with_capacity(layers),
    };
    let output = model.forward_hooked(batch, &mut p)?;
    if p.leaves.len() != layers || p.inputs.len() != layers {
        return Err(PipelineError::InvalidPlan(format!(
            "model `{}` lists {layers} layers but its forward ran {}",
            model.name(),
            p.leaves.len()
        )));
    }
    let deps = (0..layers)
        .map(|j| depends_on(&p.inputs[j], &p.leaves[..j]))
        .collect::<Result<Vec<_>, _>>()?;
    let output_deps = depends_on(std::slice::from_ref(&output), &p.leaves)?;
    Ok(Dataflow {
        outputs: p.leaves.iter().map(TensorMeta::of).collect(),
        deps,
        output_deps,
    })
}

/// The indices of `leaves` that `values` depend on: through autograd for float leaves, by
/// identity for the others.
fn depends_on(values: &[Tensor], leaves: &[Tensor]) -> Result<BTreeSet<usize>, PipelineError> {
    let mut found = BTreeSet::new();
    for (k, leaf) in leaves.iter().enumerate() {
        if !leaf.requires_grad()
            && values
                .iter()
                .any(|v| v.data_ptr() == leaf.data_ptr() && v.size() == leaf.size())
        {
            found.insert(k);
        }
    }
    let outs: Vec<&Tensor> = values.iter().filter(|v| v.requires_grad()).collect();
    let float_leaves: Vec<(usize, &Tensor)> = leaves
        .iter()
        .enumerate()
        .filter(|(_, l)| l.requires_grad())
        .collect();
    if outs.is_empty() || float_leaves.is_empty() {
        return Ok(found);
    }
    let ones = outs
        .iter()
        .map(|o| o.f_ones_like())
        .collect::<Result<Vec<_>, _>>()?;
    let grads = autograd::grad(
        &outs,
        &float_leaves.iter().map(|(_, l)| *l).collect::<Vec<_>>(),
        &ones.iter().map(Some).collect::<Vec<_>>(),
        GradOptions {
            retain_graph: Some(true),
            create_graph: false,
            allow_unused: true,
        },
    )?;
    for ((k, _), g) in float_leaves.iter().zip(grads) {
        if g.is_some() {
            found.insert(*k);
        }
    }
    Ok(found)
}

/// A dataflow edge between stages: the outputs of `layers` (all held by stage `from`) that
/// stage `to` consumes. Chain edges (`to = from + 1`) exist even when they carry nothing, so
/// every schedule's dependencies hold; such an edge carries a one-element token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageEdge {
    /// The producing stage.
    pub from: usize,
    /// The consuming stage (after `from`).
    pub to: usize,
    /// Layers whose outputs cross, in order; empty for a token-only chain edge.
    pub layers: Vec<usize>,
}

/// The stage-level view of a [`Dataflow`] under one partition.
#[derive(Clone, Debug)]
pub struct StageFlow {
    /// Per stage: its layer range.
    pub stages: Vec<Range<usize>>,
    /// Per layer: its stage.
    pub stage_of_layer: Vec<usize>,
    /// Sorted by `(from, to)`.
    pub edges: Vec<StageEdge>,
    /// Per stage: the layer outputs of its own that its later layers (or, on the last stage,
    /// the loss) consume.
    pub local_uses: Vec<BTreeSet<usize>>,
}

impl StageFlow {
    /// Derives edges from `flow` for `stages` (contiguous ranges covering every layer).
    pub fn new(flow: &Dataflow, stages: &[Range<usize>]) -> StageFlow {
        let layers = flow.outputs.len();
        let mut stage_of_layer = vec![0; layers];
        for (s, r) in stages.iter().enumerate() {
            for l in r.clone() {
                stage_of_layer[l] = s;
            }
        }
        let last = stages.len() - 1;
        let mut edges = Vec::new();
        let mut local_uses = vec![BTreeSet::new(); stages.len()];
        for (t, range) in stages.iter().enumerate() {
            let mut used: BTreeSet<usize> =
                range.clone().flat_map(|j| flow.deps[j].clone()).collect();
            if t == last {
                used.extend(flow.output_deps.iter().copied());
            }
            for from in 0..t {
                let carried: Vec<usize> = used
                    .iter()
                    .copied()
                    .filter(|&k| stage_of_layer[k] == from)
                    .collect();
                if !carried.is_empty() || from + 1 == t {
                    edges.push(StageEdge {
                        from,
                        to: t,
                        layers: carried,
                    });
                }
            }
            local_uses[t] = used
                .into_iter()
                .filter(|&k| stage_of_layer[k] == t)
                .collect();
        }
        edges.sort_by_key(|e| (e.from, e.to));
        StageFlow {
            stages: stages.to_vec(),
            stage_of_layer,
            edges,
            local_uses,
        }
    }

    /// The edges into stage `s`.
    pub fn inputs_of(&self, s: usize) -> impl Iterator<Item = &StageEdge> {
        self.edges.iter().filter(move |e| e.to == s)
    }

    /// The edges out of stage `s`.
    pub fn outputs_of(&self, s: usize) -> impl Iterator<Item = &StageEdge> {
        self.edges.iter().filter(move |e| e.from == s)
    }

    /// Why a pipeline cannot reproduce a single-device run with the same microbatch order
    /// bit for bit, if it cannot: a layer output whose gradient gathers contributions from
    /// two or more stages is summed in another order.
    pub fn fan_out_reason(&self, names: &[String]) -> Option<String> {
        for (k, name) in names.iter().enumerate() {
            let own = self.stage_of_layer.get(k).copied()?;
            let mut consumers = self.edges.iter().filter(|e| e.layers.contains(&k)).count();
            consumers += usize::from(self.local_uses[own].contains(&k));
            if consumers > 1 {
                return Some(format!(
                    "the output of `{name}` is consumed by {consumers} stages, so its gradient \
                     is a sum over stages in another order than one process's backward"
                ));
            }
        }
        None
    }
}
