//! Executing one rank's actions of a lowered schedule for one step.
//!
//! Each (stage, microbatch) has a slot: the layer outputs it received (fresh leaves, so
//! its backward yields their gradients), the outputs it produced for other stages (with
//! their graph), its scaled loss on the last stage, and the gradients that came back. Stages
//! on the same rank hand tensors over in memory; between ranks every dataflow edge has its
//! own two-rank group per direction ([`Way`]), so each (edge, direction) is a FIFO of its own
//! and messages of different stage pairs cannot overtake each other. Consecutive sends and
//! receives run as one batch whose sends are waited for only at the end of the step, so no
//! schedule relies on buffered sends (NCCL's rendezvous; see `Executor::exchange`). An action whose inputs are missing is
//! an error naming it — the schedule, not the executor, decides the order.

use super::dataflow::{StageFlow, TensorMeta};
use super::edges::{EdgeGroups, Way};
use super::schedule::{Action, ActionKind};
use super::stage::{run_range, RangeOutput, RangeRun};
use super::trace::TraceEvent;
use super::PipelineError;
use crate::autograd::{self, GradOptions};
use crate::comm::p2p::{self, P2pKind, P2pOp};
use crate::comm::{ProcessGroup, Work};
use lockstep_models::{Batch, LayerHooks, Model};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tch::{Device, Kind, Tensor};

/// One step's data, the same on every rank of a pipeline.
pub(crate) struct StepData {
    pub batches: Vec<Batch>,
    pub scales: Vec<f64>,
    /// Per microbatch: every layer's output shape at that microbatch's size.
    pub metas: Vec<Arc<Vec<TensorMeta>>>,
}

/// What a W action needs: the graph kept by its I, or gradients already computed.
enum PendingWeight {
    Graph {
        outs: Vec<Tensor>,
        grads: Vec<Tensor>,
    },
    Computed(Vec<(usize, Tensor)>),
}

#[derive(Default)]
struct Slot {
    inputs: BTreeMap<usize, Tensor>,
    outputs: BTreeMap<usize, Tensor>,
    /// Detached outputs a checkpointed forward kept (segment and stage boundaries).
    saved: BTreeMap<usize, Tensor>,
    loss: Option<Tensor>,
    forwarded: bool,
    out_grads: BTreeMap<usize, Vec<Tensor>>,
    input_grads: Option<BTreeMap<usize, Tensor>>,
    pending_weight: Option<PendingWeight>,
}

/// What a checkpointed backward carries from one recomputed segment to the one before it.
struct SegmentGrads {
    /// Gradients sent back for layer outputs not yet differentiated (later stages' and
    /// later segments').
    pending: BTreeMap<usize, Vec<Tensor>>,
    /// The stage inputs' gradients so far, summed over segments.
    inputs: BTreeMap<usize, Tensor>,
    /// The parameters' gradients, one entry per segment that reached them.
    weights: Vec<(usize, Tensor)>,
}

impl SegmentGrads {
    /// The seeds of a segment: each captured output once per pending gradient it has.
    fn take_seeds(&mut self, captured: &BTreeMap<usize, Tensor>) -> Seeds {
        let mut outs = Vec::new();
        let mut grads: Vec<Option<Tensor>> = Vec::new();
        for (k, t) in captured {
            if let Some(gs) = self.pending.remove(k) {
                if t.requires_grad() {
                    for gr in gs {
                        outs.push(t.shallow_clone());
                        grads.push(Some(gr));
                    }
                }
            }
        }
        Seeds { outs, grads }
    }
}

/// A backward's starting tensors and their gradients (`None`: a loss, seeded with one).
struct Seeds {
    outs: Vec<Tensor>,
    grads: Vec<Option<Tensor>>,
}

/// A rank's view of the pipeline, fixed for the run.
pub(crate) struct Executor<'a> {
    pub model: &'a dyn Model,
    pub flow: &'a StageFlow,
    /// Per layer: the earlier layers its inputs depend on (checkpoint segments need it).
    pub deps: &'a [BTreeSet<usize>],
    pub output_deps: &'a BTreeSet<usize>,
    /// Stage index to pipeline rank.
    pub stage_ranks: &'a [usize],
    /// This process's pipeline rank.
    pub rank: usize,
    /// Where this rank's stages compute (their parameters' device): the tokens of empty
    /// edges are created there, as the edge groups take tensors on it.
    pub device: Device,
    /// The two-rank groups of every cross-rank edge this rank is on, one per way; the
    /// producer is group rank 0.
    pub edge_groups: &'a EdgeGroups,
    /// Per stage: the parameters a W action differentiates (canonical name index, tensor).
    pub stage_params: &'a [Vec<(usize, Tensor)>],
    /// Recompute every `k` layers in backward instead of keeping activations.
    pub checkpoint_every: Option<usize>,
    /// Planted bug: scale no microbatch loss.
    pub unscaled_loss: bool,
    /// Planted bug: the first stage feeds microbatch 1's inputs as microbatch 0 and back.
    pub swap_first_microbatches: bool,
    /// Planted bug: a recomputed segment's gradient of a saved boundary replaces the ones
    /// later segments already sent back instead of adding to them.
    pub overwrite_boundary_grads: bool,
    /// Hooks computing the stages' layers (tensor parallelism); `None`: the model's own.
    pub compute: Option<&'a RefCell<Box<dyn LayerHooks>>>,
    /// The last stage's loss of a microbatch's output (the vocabulary-parallel loss under
    /// tensor parallelism); `None`: the model's own.
    pub loss: Option<&'a LossFn<'a>>,
    /// What `UNSHARD`, `RESHARD` and `REDUCE_GRAD` do (FSDP over the data dimension);
    /// `None`: nothing.
    pub sharding: Option<&'a ShardingFn<'a>>,
}

/// A stage's loss of a microbatch: (batch, the model's output) to a scalar.
pub(crate) type LossFn<'a> = dyn Fn(&Batch, &Tensor) -> Result<Tensor, PipelineError> + 'a;

/// Runs one of FSDP's schedule actions (`UNSHARD`, `RESHARD`, `REDUCE_GRAD`) for a stage.
pub(crate) type ShardingFn<'a> = dyn Fn(&Action) -> Result<(), PipelineError> + 'a;

/// What a step produced on this rank.
pub(crate) struct StepOutcome {
    /// The sum of the scaled microbatch losses (the step objective) on the last stage's
    /// rank, 0 elsewhere.
    pub objective: f64,
    pub events: Vec<TraceEvent>,
}

/// Where a received tensor goes once its batch's receives finished.
enum Arrival {
    /// An empty edge's token: nowhere.
    Token,
    /// Layer `k`'s output, an input of (stage, microbatch).
    Input(usize, usize, usize),
    /// A gradient of layer `k`'s output, sent back to (stage, microbatch).
    OutputGrad(usize, usize, usize),
}

/// The one-element tensor an edge that carries no layer output sends, so every schedule's
/// dependencies hold: created on the stage's compute device, as everything sent is.
/// Sends of a batch of transfers: (group, peer, tag, tensor).
type Outgoing<'g> = Vec<(&'g dyn ProcessGroup, usize, u64, Tensor)>;

/// Receives of a batch of transfers: (group, peer, tag, buffer, where it goes).
type Incoming<'g> = Vec<(&'g dyn ProcessGroup, usize, u64, Tensor, Arrival)>;

/// Files each received tensor where it goes: a stage's input (a leaf, so its gradient is
/// kept), or one more gradient of a stage's output.
fn file_arrivals(
    incoming: Incoming<'_>,
    slots: &mut HashMap<(usize, usize), Slot>,
) -> Result<(), PipelineError> {
    for (_, _, _, t, arrival) in incoming {
        match arrival {
            Arrival::Token => {}
            Arrival::Input(stage, mb, k) => {
                slots
                    .entry((stage, mb))
                    .or_default()
                    .inputs
                    .insert(k, leaf(t)?);
            }
            Arrival::OutputGrad(stage, mb, k) => {
                slots
                    .entry((stage, mb))
                    .or_default()
                    .out_grads
                    .entry(k)
                    .or_default()
                    .push(t);
            }
        }
    }
    Ok(())
}

fn token(device: Device) -> Result<Tensor, tch::TchError> {
    Tensor::f_zeros([1], (Kind::Float, device))
}

fn leaf(mut t: Tensor) -> Result<Tensor, tch::TchError> {
    if super::dataflow::is_float(t.kind()) {
        t.f_requires_grad_(true)
    } else {
        Ok(t)
    }
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

impl Executor<'_> {
    fn last_stage(&self) -> usize {
        self.flow.stages.len() - 1
    }

    fn float_layers(&self, layers: &[usize], metas: &[TensorMeta]) -> Vec<usize> {
        layers
            .iter()
            .copied()
            .filter(|&k| metas[k].is_float())
            .collect()
    }

    fn group(&self, from: usize, to: usize, way: Way) -> Result<&dyn ProcessGroup, PipelineError> {
        let group = self.edge_groups.get(&(from, to, way)).ok_or_else(|| {
            PipelineError::Execution(format!(
                "rank {} has no channel for the edge from stage {from} to stage {to}",
                self.rank
            ))
        })?;
        Ok(group.as_ref())
    }

    fn remote(&self, a: usize, b: usize) -> bool {
        self.stage_ranks[a] != self.stage_ranks[b]
    }

    /// Runs `actions` (this rank's list) for one step.
    pub fn run_step(
        &self,
        actions: &[Action],
        data: &StepData,
    ) -> Result<StepOutcome, PipelineError> {
        let mut slots: HashMap<(usize, usize), Slot> = HashMap::new();
        let mut objective = 0.0;
        let mut events = Vec::with_capacity(actions.len());
        let mut sends = Vec::new();
        let mut i = 0;
        while i < actions.len() {
            let begin = now_us();
            let t0 = Instant::now();
            // Consecutive sends and receives are one batch; see `exchange`.
            let n = actions[i..]
                .iter()
                .take_while(|a| a.kind.is_comm())
                .count()
                .max(1);
            let ran = &actions[i..i + n];
            if ran[0].kind.is_comm() {
                sends.extend(self.exchange(ran, data, &mut slots)?);
            } else {
                self.run_action(&ran[0], data, &mut slots, &mut objective)?;
            }
            for action in ran {
                if action.kind.is_compute() || action.kind.is_comm() {
                    events.push(TraceEvent {
                        action: action.to_string(),
                        compute: action.kind.is_compute(),
                        begin_us: begin,
                        duration_us: t0.elapsed().as_micros() as u64,
                    });
                }
            }
            i += n;
        }
        // Every send of the step is done once its receive was posted: the step ends here.
        p2p::wait_all(sends)?;
        for ((stage, mb), slot) in &slots {
            if slot.pending_weight.is_some() {
                return Err(PipelineError::Execution(format!(
                    "stage {stage} microbatch {mb}: the schedule ran I without its W"
                )));
            }
        }
        Ok(StepOutcome { objective, events })
    }

    fn run_action(
        &self,
        action: &Action,
        data: &StepData,
        slots: &mut HashMap<(usize, usize), Slot>,
        objective: &mut f64,
    ) -> Result<(), PipelineError> {
        let stage = action.stage;
        if stage >= self.stage_ranks.len() || self.stage_ranks[stage] != self.rank {
            return Err(PipelineError::Execution(format!(
                "rank {}: action {action} is for a stage this rank does not hold",
                self.rank
            )));
        }
        let Some(mb) = action.microbatch else {
            // UNSHARD / RESHARD / REDUCE_GRAD: FSDP's, when the data dimension is sharded.
            return match self.sharding {
                Some(run) => run(action),
                None => Ok(()),
            };
        };
        if mb >= data.batches.len() {
            return Err(PipelineError::Execution(format!(
                "rank {}: action {action} names microbatch {mb}, but the step has {}",
                self.rank,
                data.batches.len()
            )));
        }
        match action.kind {
            ActionKind::Forward => {
                let loss = self.forward(stage, mb, data, slots)?;
                *objective += loss;
            }
            ActionKind::SendF | ActionKind::RecvF | ActionKind::SendB | ActionKind::RecvB => {
                // `run_step` hands sends and receives to `exchange`, which keeps their works.
                return Err(self.missing(action, "a send or receive runs in a batch"));
            }
            ActionKind::FullBackward | ActionKind::BackwardInput => {
                let weight_later = action.kind == ActionKind::BackwardInput;
                self.backward(stage, mb, data, slots, weight_later)?;
            }
            ActionKind::BackwardWeight => {
                let slot = slots.entry((stage, mb)).or_default();
                let pending = slot
                    .pending_weight
                    .take()
                    .ok_or_else(|| self.missing(action, "its I has not run"))?;
                self.weight(stage, pending)?;
            }
            ActionKind::Unshard | ActionKind::Reshard | ActionKind::ReduceGrad => {}
        }
        Ok(())
    }

    /// Runs a run of consecutive communication actions as one batch of sends and receives
    /// (grouped point-to-point: one `ncclGroupStart` … `ncclGroupEnd` on NCCL), waits for
    /// its receives and files what arrived, and returns its sends, left running until the
    /// step ends. No schedule relies on buffered sends this way: under NCCL's rendezvous a
    /// send completes only once its receive is posted, and a rank that waited for its own
    /// sends before receiving would hang wherever two ranks send to each other first (1F1B's
    /// steady state, interleaved and V schedules). A receive waits only for sends that its
    /// peer posts before it, which the schedule's simulation (with sends that never block)
    /// proved always happens; each way of an edge has a group of its own ([`Way`]), so a
    /// pending send never holds a transfer the other way behind it.
    fn exchange(
        &self,
        actions: &[Action],
        data: &StepData,
        slots: &mut HashMap<(usize, usize), Slot>,
    ) -> Result<Vec<Work>, PipelineError> {
        let mut outgoing: Outgoing<'_> = Vec::new();
        let mut incoming: Incoming<'_> = Vec::new();
        for action in actions {
            let (mb, metas) = self.transfer_of(action, data)?;
            let at = (action.stage, mb);
            match action.kind {
                ActionKind::SendF => self.send_activations(action, at, slots, &mut outgoing)?,
                ActionKind::RecvF => self.receive_activations(at, metas, &mut incoming)?,
                ActionKind::SendB => {
                    self.send_gradients(action, at, metas, slots, &mut outgoing)?
                }
                ActionKind::RecvB => self.receive_gradients(at, metas, &mut incoming)?,
                _ => return Err(self.missing(action, "it is not a send or a receive")),
            }
        }
        let ops: Vec<P2pOp<'_>> = outgoing
            .iter()
            .map(|(group, peer, tag, tensor)| (group, peer, tag, tensor, P2pKind::Send))
            .chain(
                incoming
                    .iter()
                    .map(|(group, peer, tag, tensor, _)| (group, peer, tag, tensor, P2pKind::Recv)),
            )
            .map(|(group, peer, tag, tensor, kind)| P2pOp {
                group: *group,
                kind,
                tensor,
                peer: *peer,
                tag: *tag,
            })
            .collect();
        let posted = p2p::post_batch(&ops)?;
        p2p::wait_all(posted.receives)?;
        file_arrivals(incoming, slots)?;
        Ok(posted.sends)
    }

    /// A send or receive's microbatch and its layers' shapes, checked: the action names a
    /// microbatch of this step, of a stage this rank holds.
    fn transfer_of<'d>(
        &self,
        action: &Action,
        data: &'d StepData,
    ) -> Result<(usize, &'d [TensorMeta]), PipelineError> {
        let stage = action.stage;
        let Some(mb) = action.microbatch else {
            return Err(self.missing(action, "a send or receive names no microbatch"));
        };
        if stage >= self.stage_ranks.len() || self.stage_ranks[stage] != self.rank {
            return Err(PipelineError::Execution(format!(
                "rank {}: action {action} is for a stage this rank does not hold",
                self.rank
            )));
        }
        let metas = data.metas.get(mb).map(|m| m.as_slice()).ok_or_else(|| {
            PipelineError::Execution(format!(
                "rank {}: action {action} names microbatch {mb}, but the step has {}",
                self.rank,
                data.batches.len()
            ))
        })?;
        Ok((mb, metas))
    }

    /// `SEND_F`: the stage's outputs on every edge to another rank (a token on an empty edge).
    fn send_activations<'g>(
        &'g self,
        action: &Action,
        (stage, mb): (usize, usize),
        slots: &mut HashMap<(usize, usize), Slot>,
        outgoing: &mut Outgoing<'g>,
    ) -> Result<(), PipelineError> {
        let tag = mb as u64;
        let slot = slots.entry((stage, mb)).or_default();
        if !slot.forwarded {
            return Err(self.missing(action, "its forward has not run"));
        }
        for e in self
            .flow
            .outputs_of(stage)
            .filter(|e| self.remote(e.from, e.to))
        {
            let g = self.group(e.from, e.to, Way::Activations)?;
            if e.layers.is_empty() {
                outgoing.push((g, 1, tag, token(self.device)?));
            }
            for k in &e.layers {
                let t = slot
                    .outputs
                    .get(k)
                    .or_else(|| slot.saved.get(k))
                    .ok_or_else(|| {
                        self.missing(action, &format!("layer {k}'s output was not kept"))
                    })?;
                outgoing.push((g, 1, tag, t.f_detach()?.f_contiguous()?));
            }
        }
        Ok(())
    }

    /// `RECV_F`: a buffer for each input arriving from another rank.
    fn receive_activations<'g>(
        &'g self,
        (stage, mb): (usize, usize),
        metas: &[TensorMeta],
        incoming: &mut Incoming<'g>,
    ) -> Result<(), PipelineError> {
        let tag = mb as u64;
        for e in self
            .flow
            .inputs_of(stage)
            .filter(|e| self.remote(e.from, e.to))
        {
            let g = self.group(e.from, e.to, Way::Activations)?;
            if e.layers.is_empty() {
                incoming.push((g, 0, tag, token(self.device)?, Arrival::Token));
            }
            for &k in &e.layers {
                let buffer = metas[k].zeros()?;
                incoming.push((g, 0, tag, buffer, Arrival::Input(stage, mb, k)));
            }
        }
        Ok(())
    }

    /// `SEND_B`: the gradients of the stage's floating-point inputs, back to their senders.
    fn send_gradients<'g>(
        &'g self,
        action: &Action,
        (stage, mb): (usize, usize),
        metas: &[TensorMeta],
        slots: &mut HashMap<(usize, usize), Slot>,
        outgoing: &mut Outgoing<'g>,
    ) -> Result<(), PipelineError> {
        let tag = mb as u64;
        let grads = slots
            .entry((stage, mb))
            .or_default()
            .input_grads
            .as_ref()
            .ok_or_else(|| self.missing(action, "its backward has not run"))?;
        for e in self
            .flow
            .inputs_of(stage)
            .filter(|e| self.remote(e.from, e.to))
        {
            let g = self.group(e.from, e.to, Way::Gradients)?;
            let floats = self.float_layers(&e.layers, metas);
            if floats.is_empty() {
                outgoing.push((g, 0, tag, token(self.device)?));
            }
            for k in floats {
                let grad = grads
                    .get(&k)
                    .ok_or_else(|| self.missing(action, &format!("no gradient for layer {k}")))?;
                outgoing.push((g, 0, tag, grad.f_contiguous()?));
            }
        }
        Ok(())
    }

    /// `RECV_B`: a buffer for the gradient of each floating-point output sent to another rank.
    fn receive_gradients<'g>(
        &'g self,
        (stage, mb): (usize, usize),
        metas: &[TensorMeta],
        incoming: &mut Incoming<'g>,
    ) -> Result<(), PipelineError> {
        let tag = mb as u64;
        for e in self
            .flow
            .outputs_of(stage)
            .filter(|e| self.remote(e.from, e.to))
        {
            let g = self.group(e.from, e.to, Way::Gradients)?;
            let floats = self.float_layers(&e.layers, metas);
            if floats.is_empty() {
                incoming.push((g, 1, tag, token(self.device)?, Arrival::Token));
            }
            for k in floats {
                let buffer = metas[k].zeros()?;
                incoming.push((g, 1, tag, buffer, Arrival::OutputGrad(stage, mb, k)));
            }
        }
        Ok(())
    }

    fn missing(&self, action: &Action, why: &str) -> PipelineError {
        PipelineError::Execution(format!("rank {}: cannot run {action}: {why}", self.rank))
    }

    /// The layers of stage `s` whose outputs leave it (to other stages).
    fn exported(&self, stage: usize) -> BTreeSet<usize> {
        self.flow
            .outputs_of(stage)
            .flat_map(|e| e.layers.clone())
            .collect()
    }

    fn batch_for(&self, stage: usize, mb: usize, data: &StepData) -> usize {
        if self.swap_first_microbatches && stage == 0 && data.batches.len() > 1 && mb < 2 {
            1 - mb
        } else {
            mb
        }
    }

    /// F: returns the scaled loss's value on the last stage (0 elsewhere).
    fn forward(
        &self,
        stage: usize,
        mb: usize,
        data: &StepData,
        slots: &mut HashMap<(usize, usize), Slot>,
    ) -> Result<f64, PipelineError> {
        let action = Action {
            stage,
            kind: ActionKind::Forward,
            microbatch: Some(mb),
        };
        let metas = data.metas[mb].as_slice();
        let slot = slots.entry((stage, mb)).or_default();
        if slot.forwarded {
            return Err(self.missing(&action, "it already ran this step"));
        }
        for e in self.flow.inputs_of(stage) {
            for k in &e.layers {
                if !slot.inputs.contains_key(k) {
                    return Err(self.missing(
                        &action,
                        &format!(
                            "the output of layer {k} from stage {} has not arrived (a RECV_F or \
                             the producer's F is missing before it)",
                            e.from
                        ),
                    ));
                }
            }
        }
        let range = self.flow.stages[stage].clone();
        let is_last = stage == self.last_stage();
        let exported = self.exported(stage);
        let batch = &data.batches[self.batch_for(stage, mb, data)];
        let checkpointed = self.checkpoint_every.is_some();
        let capture: BTreeSet<usize> = if checkpointed {
            exported
                .union(&self.segment_boundaries(stage))
                .copied()
                .collect()
        } else {
            exported.clone()
        };
        let run = RangeRun {
            range,
            supplied: &slot.inputs,
            metas,
            capture: &capture,
            compute: self.compute,
        };
        // A checkpointed forward still records its graph and drops it at once (outputs are
        // detached below): kernels may choose another algorithm without gradients (CPU
        // attention does), and the recompute in backward must see the values this forward
        // produced, bit for bit.
        let out = run_range(self.model, batch, &run)?;
        let mut value = 0.0;
        if is_last {
            let output = out.output.ok_or_else(|| {
                self.missing(&action, "the last stage's forward returned no output")
            })?;
            let loss = self.scaled_loss(&data.batches[mb], &output, data.scales[mb])?;
            value = loss.f_double_value(&[])?;
            if !checkpointed {
                slot.loss = Some(loss);
            }
        }
        if checkpointed {
            slot.saved = out
                .captured
                .iter()
                .map(|(k, t)| Ok((*k, t.f_detach()?)))
                .collect::<Result<_, tch::TchError>>()?;
        } else {
            slot.outputs = out.captured;
        }
        slot.forwarded = true;
        // Stages on this rank get their inputs now; other ranks' at SEND_F.
        let handoff: Vec<(usize, usize, Tensor)> = self
            .flow
            .outputs_of(stage)
            .filter(|e| !self.remote(e.from, e.to))
            .flat_map(|e| e.layers.iter().map(move |&k| (e.to, k)))
            .map(|(to, k)| {
                let t = slot.outputs.get(&k).or_else(|| slot.saved.get(&k));
                match t {
                    Some(t) => Ok((to, k, leaf(t.f_detach()?)?)),
                    None => Err(PipelineError::Execution(format!(
                        "stage {stage} did not keep layer {k}'s output"
                    ))),
                }
            })
            .collect::<Result<_, _>>()?;
        for (to, k, t) in handoff {
            slots.entry((to, mb)).or_default().inputs.insert(k, t);
        }
        Ok(value)
    }

    fn scaled_loss(
        &self,
        batch: &Batch,
        output: &Tensor,
        scale: f64,
    ) -> Result<Tensor, PipelineError> {
        let loss = match self.loss {
            Some(f) => f(batch, output)?,
            None => self.model.loss_of(batch, output)?,
        };
        Ok(if self.unscaled_loss {
            loss
        } else {
            loss.f_mul_scalar(scale)?
        })
    }

    /// Checkpoint segments of stage `s`: consecutive runs of `k` layers.
    fn segments(&self, stage: usize) -> Vec<Range<usize>> {
        let r = self.flow.stages[stage].clone();
        let k = self.checkpoint_every.unwrap_or(r.len()).max(1);
        (r.start..r.end)
            .step_by(k)
            .map(|s| s..(s + k).min(r.end))
            .collect()
    }

    /// Layers of stage `s` whose outputs a later segment of the same stage consumes.
    fn segment_boundaries(&self, stage: usize) -> BTreeSet<usize> {
        let segments = self.segments(stage);
        let seg_of = |l: usize| segments.iter().position(|r| r.contains(&l));
        let mut keep = BTreeSet::new();
        let is_last = stage == self.last_stage();
        for (g, seg) in segments.iter().enumerate() {
            let mut used: BTreeSet<usize> =
                seg.clone().flat_map(|j| self.deps[j].clone()).collect();
            if is_last && g + 1 == segments.len() {
                used.extend(self.output_deps.iter().copied());
            }
            for k in used {
                if seg_of(k).is_some_and(|h| h < g) {
                    keep.insert(k);
                }
            }
        }
        keep
    }

    /// B (`weight_later = false`) or I (`true`).
    fn backward(
        &self,
        stage: usize,
        mb: usize,
        data: &StepData,
        slots: &mut HashMap<(usize, usize), Slot>,
        weight_later: bool,
    ) -> Result<(), PipelineError> {
        let kind = if weight_later {
            ActionKind::BackwardInput
        } else {
            ActionKind::FullBackward
        };
        let action = Action {
            stage,
            kind,
            microbatch: Some(mb),
        };
        let metas = data.metas[mb].as_slice();
        let mut slot = slots.remove(&(stage, mb)).unwrap_or_default();
        if !slot.forwarded {
            return Err(self.missing(&action, "its forward has not run"));
        }
        if slot.input_grads.is_some() {
            return Err(self.missing(&action, "its backward already ran"));
        }
        self.check_output_grads_arrived(&action, metas, &slot)?;
        let input_grads = if self.checkpoint_every.is_some() {
            self.recompute_backward(stage, mb, data, &mut slot, weight_later)?
        } else {
            self.graph_backward(&mut slot, weight_later)?
        };
        let complete = complete_input_grads(&slot, &input_grads)?;
        slot.outputs.clear();
        slot.loss = None;
        slot.out_grads.clear();
        self.hand_grads_to_local_producers(stage, mb, metas, &complete, slots);
        slot.input_grads = Some(complete);
        slots.insert((stage, mb), slot);
        Ok(())
    }

    /// Fails naming the first float output whose consumers have not all sent its gradient.
    fn check_output_grads_arrived(
        &self,
        action: &Action,
        metas: &[TensorMeta],
        slot: &Slot,
    ) -> Result<(), PipelineError> {
        let stage = action.stage;
        for e in self.flow.outputs_of(stage) {
            for k in self.float_layers(&e.layers, metas) {
                let arrived = slot.out_grads.get(&k).map_or(0, Vec::len);
                let expected = self
                    .flow
                    .outputs_of(stage)
                    .filter(|e| e.layers.contains(&k))
                    .count();
                if arrived < expected {
                    return Err(self.missing(
                        action,
                        &format!(
                            "the gradient of layer {k}'s output from stage {} has not arrived \
                             (a RECV_B or the consumer's backward is missing before it)",
                            e.to
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// B or I through the graph the forward kept (no checkpointing): the inputs' gradients.
    fn graph_backward(
        &self,
        slot: &mut Slot,
        weight_later: bool,
    ) -> Result<BTreeMap<usize, Tensor>, PipelineError> {
        let Seeds { outs, grads } = seeds(slot);
        let received: Vec<(usize, Tensor)> = slot
            .inputs
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(k, t)| (*k, t.shallow_clone()))
            .collect();
        let mut input_grads = BTreeMap::new();
        if !outs.is_empty() {
            if weight_later {
                input_grads = input_grads_keeping_graph(slot, outs, grads, &received)?;
            } else {
                let out_refs: Vec<&Tensor> = outs.iter().collect();
                let grad_refs: Vec<Option<&Tensor>> = grads.iter().map(|g| g.as_ref()).collect();
                autograd::backward(&out_refs, &grad_refs, false)?;
                for (k, t) in &received {
                    let g = t.grad();
                    if g.defined() {
                        input_grads.insert(*k, g);
                    }
                }
            }
        } else if weight_later {
            slot.pending_weight = Some(PendingWeight::Computed(Vec::new()));
        }
        Ok(input_grads)
    }

    /// Queues the gradients of inputs produced by stages on this rank (others' go at SEND_B).
    fn hand_grads_to_local_producers(
        &self,
        stage: usize,
        mb: usize,
        metas: &[TensorMeta],
        complete: &BTreeMap<usize, Tensor>,
        slots: &mut HashMap<(usize, usize), Slot>,
    ) {
        let local: Vec<(usize, usize)> = self
            .flow
            .inputs_of(stage)
            .filter(|e| !self.remote(e.from, e.to))
            .flat_map(|e| {
                self.float_layers(&e.layers, metas)
                    .into_iter()
                    .map(move |k| (e.from, k))
            })
            .collect();
        for (from, k) in local {
            if let Some(g) = complete.get(&k) {
                slots
                    .entry((from, mb))
                    .or_default()
                    .out_grads
                    .entry(k)
                    .or_default()
                    .push(g.shallow_clone());
            }
        }
    }

    /// Backward of a checkpointed stage: segments recomputed last to first, each seeded with
    /// the gradients later segments and stages sent back. Returns the inputs' gradients.
    fn recompute_backward(
        &self,
        stage: usize,
        mb: usize,
        data: &StepData,
        slot: &mut Slot,
        weight_later: bool,
    ) -> Result<BTreeMap<usize, Tensor>, PipelineError> {
        let metas = data.metas[mb].as_slice();
        let segments = self.segments(stage);
        let is_last = stage == self.last_stage();
        let batch = &data.batches[self.batch_for(stage, mb, data)];
        let mut acc = SegmentGrads {
            pending: std::mem::take(&mut slot.out_grads),
            inputs: BTreeMap::new(),
            weights: Vec::new(),
        };
        for (g, seg) in segments.iter().enumerate().rev() {
            let (out, fresh) = self.rerun_segment(seg, slot, batch, metas)?;
            let mut seeds = acc.take_seeds(&out.captured);
            if is_last && g + 1 == segments.len() {
                let output = out.output.ok_or_else(|| {
                    PipelineError::Execution(format!("stage {stage}: recompute returned no output"))
                })?;
                let loss = self.scaled_loss(&data.batches[mb], &output, data.scales[mb])?;
                seeds.outs.push(loss);
                seeds.grads.push(None);
            }
            if seeds.outs.is_empty() {
                continue;
            }
            self.differentiate_segment(stage, slot, &fresh, &seeds, &mut acc)?;
        }
        if weight_later {
            slot.pending_weight = Some(PendingWeight::Computed(acc.weights));
        } else {
            self.accumulate(stage, acc.weights)?;
        }
        Ok(acc.inputs)
    }

    /// Reruns a checkpoint segment on the inputs and fresh leaves of earlier saved boundaries.
    fn rerun_segment(
        &self,
        seg: &Range<usize>,
        slot: &Slot,
        batch: &Batch,
        metas: &[TensorMeta],
    ) -> Result<(RangeOutput, Vec<(usize, Tensor)>), PipelineError> {
        let mut supplied: BTreeMap<usize, Tensor> = slot
            .inputs
            .iter()
            .map(|(k, t)| (*k, t.shallow_clone()))
            .collect();
        let mut fresh = Vec::new();
        for (k, t) in &slot.saved {
            if *k < seg.start {
                let l = leaf(t.f_detach()?)?;
                fresh.push((*k, l.shallow_clone()));
                supplied.insert(*k, l);
            }
        }
        let capture: BTreeSet<usize> = seg.clone().collect();
        let run = RangeRun {
            range: seg.clone(),
            supplied: &supplied,
            metas,
            capture: &capture,
            compute: self.compute,
        };
        let out = run_range(self.model, batch, &run)?;
        Ok((out, fresh))
    }

    /// Differentiates a rerun segment's seeds for its leaves and the stage's parameters into `acc`.
    fn differentiate_segment(
        &self,
        stage: usize,
        slot: &Slot,
        fresh: &[(usize, Tensor)],
        seeds: &Seeds,
        acc: &mut SegmentGrads,
    ) -> Result<(), PipelineError> {
        let params = &self.stage_params[stage];
        let leaves: Vec<(usize, Tensor)> = slot
            .inputs
            .iter()
            .filter(|(_, t)| t.requires_grad())
            .map(|(k, t)| (*k, t.shallow_clone()))
            .chain(
                fresh
                    .iter()
                    .filter(|(_, t)| t.requires_grad())
                    .map(|(k, t)| (*k, t.shallow_clone())),
            )
            .collect();
        let mut wrt: Vec<&Tensor> = leaves.iter().map(|(_, t)| t).collect();
        wrt.extend(params.iter().map(|(_, p)| p));
        let got = autograd::grad(
            &seeds.outs.iter().collect::<Vec<_>>(),
            &wrt,
            &seeds.grads.iter().map(|g| g.as_ref()).collect::<Vec<_>>(),
            GradOptions {
                retain_graph: Some(false),
                create_graph: false,
                allow_unused: true,
            },
        )?;
        let (leaf_grads, param_grads) = got.split_at(leaves.len());
        for ((k, _), gr) in leaves.iter().zip(leaf_grads) {
            let Some(gr) = gr else { continue };
            if slot.inputs.contains_key(k) {
                let sum = match acc.inputs.remove(k) {
                    Some(prev) => prev.f_add(gr)?,
                    None => gr.shallow_clone(),
                };
                acc.inputs.insert(*k, sum);
            } else if self.overwrite_boundary_grads {
                acc.pending.insert(*k, vec![gr.shallow_clone()]);
            } else {
                acc.pending.entry(*k).or_default().push(gr.shallow_clone());
            }
        }
        for ((i, _), gr) in params.iter().zip(param_grads) {
            if let Some(gr) = gr {
                acc.weights.push((*i, gr.shallow_clone()));
            }
        }
        Ok(())
    }

    fn weight(&self, stage: usize, pending: PendingWeight) -> Result<(), PipelineError> {
        let grads = match pending {
            PendingWeight::Computed(g) => g,
            PendingWeight::Graph { outs, grads } => {
                let params = &self.stage_params[stage];
                if params.is_empty() {
                    return Ok(());
                }
                let got = autograd::grad(
                    &outs.iter().collect::<Vec<_>>(),
                    &params.iter().map(|(_, p)| p).collect::<Vec<_>>(),
                    &grads.iter().map(Some).collect::<Vec<_>>(),
                    GradOptions {
                        retain_graph: Some(false),
                        create_graph: false,
                        allow_unused: true,
                    },
                )?;
                params
                    .iter()
                    .zip(got)
                    .filter_map(|((i, _), g)| g.map(|g| (*i, g)))
                    .collect()
            }
        };
        self.accumulate(stage, grads)
    }

    /// Adds `grads` into the parameters' `.grad`, as autograd's accumulation would.
    fn accumulate(&self, stage: usize, grads: Vec<(usize, Tensor)>) -> Result<(), PipelineError> {
        let params = &self.stage_params[stage];
        for (i, g) in grads {
            let Some((_, p)) = params.iter().find(|(j, _)| *j == i) else {
                continue;
            };
            let current = p.grad();
            if current.defined() {
                let _ = current.shallow_clone().f_add_(&g)?;
            } else {
                // A fresh tensor, as autograd's accumulation stores: `g` may be a view, which
                // `.grad` must not be (zeroing it in place would fail).
                autograd::set_grad(p, Some(&g.f_detach_copy()?))?;
            }
        }
        Ok(())
    }
}

/// The tensors a backward starts from and their gradients: every exported output once per
/// gradient that came back, and the scaled loss (seeded with one).
fn seeds(slot: &Slot) -> Seeds {
    let mut outs = Vec::new();
    let mut grads = Vec::new();
    for (k, gs) in &slot.out_grads {
        if let Some(t) = slot.outputs.get(k) {
            if t.requires_grad() {
                for g in gs {
                    outs.push(t.shallow_clone());
                    grads.push(Some(g.shallow_clone()));
                }
            }
        }
    }
    if let Some(loss) = &slot.loss {
        outs.push(loss.shallow_clone());
        grads.push(None);
    }
    Seeds { outs, grads }
}

/// I without checkpointing: the inputs' gradients only, keeping the graph and seeds for W.
fn input_grads_keeping_graph(
    slot: &mut Slot,
    outs: Vec<Tensor>,
    grads: Vec<Option<Tensor>>,
    received: &[(usize, Tensor)],
) -> Result<BTreeMap<usize, Tensor>, PipelineError> {
    let mut input_grads = BTreeMap::new();
    let out_refs: Vec<&Tensor> = outs.iter().collect();
    let grad_refs: Vec<Option<&Tensor>> = grads.iter().map(|g| g.as_ref()).collect();
    let leaves: Vec<&Tensor> = received.iter().map(|(_, t)| t).collect();
    let got = if leaves.is_empty() {
        Vec::new()
    } else {
        autograd::grad(
            &out_refs,
            &leaves,
            &grad_refs,
            GradOptions {
                retain_graph: Some(true),
                create_graph: false,
                allow_unused: true,
            },
        )?
    };
    for ((k, _), g) in received.iter().zip(got) {
        if let Some(g) = g {
            input_grads.insert(*k, g);
        }
    }
    let grads = grads
        .into_iter()
        .zip(&outs)
        .map(|(g, o)| match g {
            Some(g) => Ok(g),
            None => o.f_ones_like(),
        })
        .collect::<Result<Vec<_>, _>>()?;
    slot.pending_weight = Some(PendingWeight::Graph { outs, grads });
    Ok(input_grads)
}

/// Every differentiable input's gradient: inputs off the loss's path get (and send) zeros.
fn complete_input_grads(
    slot: &Slot,
    input_grads: &BTreeMap<usize, Tensor>,
) -> Result<BTreeMap<usize, Tensor>, tch::TchError> {
    let mut complete = BTreeMap::new();
    for (k, t) in &slot.inputs {
        if t.requires_grad() {
            let g = match input_grads.get(k) {
                Some(g) => g.shallow_clone(),
                None => t.f_zeros_like()?,
            };
            complete.insert(*k, g);
        }
    }
    Ok(complete)
}
