//! Training the zoo decoder under tensor (and sequence) parallelism on one rank: shards cut
//! from the full parameters every rank builds, the model's forward through `GptTp`'s hooks,
//! the vocabulary-parallel loss, partial gradients summed over TP, replicas averaged over
//! data parallelism, the optimizer on this rank's shards, and a record of full tensors.

use super::gpt::{GptTp, TpFault};
use super::plan::{Placement, TpPlan, TpPlanError};
use super::transformer::TransformerTp;
use crate::comm::{CollectiveCounts, CountingGroup, DeviceMesh, ProcessGroup, ReduceOp, World};
use crate::compose::{DataParallel, ShardError, ShardedUnit};
use crate::consistency::{observe_stepped, StateKind};
use crate::record::{CollectiveEntry, RunRecord};
use crate::train::{
    capture, clip_coefficient, grad_norm, scale_gradients, TrainConfig, TrainError,
};
use lockstep_models::zoo::{GptConfig, TransformerWithSharedParams};
use lockstep_models::{Batch, LayerHooks, LossReduction, Model, ModelError, NoHooks};
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use tch::Tensor;

/// How a tensor-parallel run is configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpOptions {
    /// Tensor-parallel size; the world is `tp × (world / tp)` data-parallel replicas.
    pub tp: usize,
    /// Megatron sequence parallelism: activations between blocks live on sequence shards.
    pub sequence_parallel: bool,
    /// How the data dimension (`world / tp` replicas) keeps parameters and reduces
    /// gradients: replicated (DDP), sharded (FSDP×TP) or hybrid-sharded (HSDP×TP).
    pub data_parallel: DataParallel,
    /// A planted bug (checker tests only).
    pub fault: Option<TpFault>,
}

/// Everything a tensor-parallel run can fail with.
#[derive(Debug, thiserror::Error)]
pub enum TpError {
    /// The plan does not fit the model or the TP size.
    #[error(transparent)]
    Plan(#[from] TpPlanError),
    /// A parallel layer could not be built from the model's layer.
    #[error(transparent)]
    Layers(#[from] super::layers::TensorParallelError),
    /// The run cannot go ahead as configured (a sequence length the TP size does not divide, a
    /// batch without its target).
    #[error("tensor parallel: {0}")]
    Invalid(String),
    /// Building or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The training loop failed.
    #[error(transparent)]
    Train(#[from] TrainError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] crate::CommError),
    /// A differentiable collective's autograd bridge failed.
    #[error(transparent)]
    Autograd(#[from] crate::AutogradError),
    /// Sharding the data dimension (FSDP×TP) failed.
    #[error(transparent)]
    Shard(#[from] ShardError),
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
}

/// Checks, before any rank starts, that the plan for `model` fits `world_size` ranks at TP
/// size `opts.tp`; returns every parameter's placement.
pub fn check_plan(
    model: &dyn Model,
    world_size: usize,
    opts: &TpOptions,
) -> Result<HashMap<String, Placement>, TpError> {
    if opts.tp == 0 || world_size == 0 || !world_size.is_multiple_of(opts.tp) {
        return Err(TpPlanError::Size(opts.tp).into());
    }
    let plan = TpPlan::for_model(model.name(), opts.sequence_parallel)?;
    opts.data_parallel
        .dims(world_size / opts.tp)
        .map_err(|e| TpError::Invalid(e.to_string()))?;
    if opts.sequence_parallel {
        let seq = model.input(0, 0)?.inputs.first().map_or(0, |t| t.size()[1]);
        if seq % opts.tp as i64 != 0 {
            return Err(TpError::Invalid(format!(
                "sequence parallelism splits the {seq} positions of a sequence, which do not \
                 divide by the tensor-parallel size {}",
                opts.tp
            )));
        }
    }
    let heads = decoder_config(model)?.map(|c| c.heads);
    Ok(plan
        .placements(model, opts.tp, heads)?
        .into_iter()
        .collect())
}

/// The sizes of a decoder whose plan splits attention heads and the vocabulary (`None` for
/// the transformer, whose plan splits its feed-forward only): read from the model, so the
/// zoo's decoder at any size fits, and a decoder that does not report them is refused.
fn decoder_config(model: &dyn Model) -> Result<Option<GptConfig>, TpError> {
    if model.name() == "transformer" {
        return Ok(None);
    }
    match model.gpt_config() {
        Some(config) => Ok(Some(config)),
        None => Err(TpPlanError::Unsupported(format!(
            "{} (it does not report its decoder sizes: Model::gpt_config)",
            model.name()
        ))
        .into()),
    }
}

/// The groups of a tensor-parallel run on its mesh (`[dp, tp]`, or
/// `[dp_replicate, dp_shard, tp]` under hybrid sharding), every one counted.
struct TpMesh {
    tp: Arc<dyn ProcessGroup>,
    /// The group the data dimension shards over (or all-reduces over, replicated).
    dp: Arc<dyn ProcessGroup>,
    /// Hybrid sharding: the group shards are replicated across.
    replicate: Option<Arc<dyn ProcessGroup>>,
    /// This rank's TP rank.
    rank: usize,
    /// The data-parallel replica this rank trains for (its index in the data dimension).
    replica: usize,
}

impl TpMesh {
    fn new(world: &World, opts: &TpOptions, counts: &CollectiveCounts) -> Result<TpMesh, TpError> {
        let dp = world.size() / opts.tp;
        let mut dims = opts
            .data_parallel
            .dims(dp)
            .map_err(|e| TpError::Invalid(e.to_string()))?;
        dims.push(("tp", opts.tp));
        let mesh = DeviceMesh::new(world, &dims)?;
        let counted = |g: Arc<dyn ProcessGroup>| -> Arc<dyn ProcessGroup> {
            Arc::new(CountingGroup::new(g, counts.clone()))
        };
        let (dp_group, replicate) = match opts.data_parallel {
            DataParallel::HybridShard { .. } | DataParallel::HybridReplicate { .. } => (
                counted(mesh.group("dp_shard")?),
                Some(counted(mesh.group("dp_replicate")?)),
            ),
            _ => (counted(mesh.group("dp")?), None),
        };
        Ok(TpMesh {
            tp: counted(mesh.group("tp")?),
            dp: dp_group,
            replicate,
            rank: mesh.coordinate("tp")?,
            replica: world.rank() / opts.tp,
        })
    }

    /// Averages `t` over the whole data dimension.
    fn average_over_data(&self, t: &Tensor) -> Result<(), TpError> {
        if self.dp.size() > 1 {
            self.dp.all_reduce(t, ReduceOp::Avg)?;
        }
        if let Some(r) = &self.replicate {
            if r.size() > 1 {
                r.all_reduce(t, ReduceOp::Avg)?;
            }
        }
        Ok(())
    }
}

/// Trains `model` (the zoo `gpt` or `gpt_moe`, built whole on every rank) under tensor
/// parallelism for `cfg.spec.steps` steps. Each TP group trains on the concatenation of its
/// replica's share of the world's data ranks, so the objective is the reference's. The data
/// dimension follows `opts.data_parallel`: under FSDP×TP the tensors a rank computes with
/// (its TP shards and replicated parameters) are one [`ShardedUnit`] over `dp`, gathered
/// before forward, their gradients reduce-scattered after backward and freed after the
/// optimizer steps the shards (TP → FSDP, torchtitan's order).
pub fn train_tensor_parallel(
    model: &dyn Model,
    world: &World,
    cfg: &TrainConfig,
    opts: &TpOptions,
) -> Result<RunRecord, TpError> {
    let world_size = world.size();
    // A TP group of one splits nothing: no plan is applied and the model computes its own
    // layers and loss (as torchtitan skips parallelizing at degree 1), so FSDP×TP at TP = 1
    // is FSDP and DDP×TP at TP = 1 is DDP.
    let identity = opts.tp == 1;
    let placements = if identity {
        opts.data_parallel
            .dims(world_size)
            .map_err(|e| TpError::Invalid(e.to_string()))?;
        HashMap::new()
    } else {
        check_plan(model, world_size, opts)?
    };
    let tp = opts.tp;
    let dp = world_size / tp;
    let counts = CollectiveCounts::new();
    let groups = TpMesh::new(world, opts, &counts)?;
    let tp_group = groups.tp.clone();
    let rank = groups.rank;

    let trained = local_parameters(model, &placements, rank, tp)?;
    let params = by_name(&trained);
    let mut unit = match opts.data_parallel {
        DataParallel::Replicate | DataParallel::HybridReplicate { .. } => None,
        DataParallel::Shard | DataParallel::HybridShard { .. } => {
            let sharded: Vec<(String, Tensor)> = trained
                .iter()
                .map(|(n, t)| (n.clone(), t.shallow_clone()))
                .collect();
            Some(ShardedUnit::new(
                "tp_local",
                sharded,
                groups.dp.clone(),
                groups.replicate.clone(),
            )?)
        }
    };
    let layer_names: Vec<String> = model.layers().into_iter().map(|l| l.name).collect();
    // The decoder splits its vocabulary (loss parallel); the transformer only its
    // feed-forward layers, so its logits are whole and the model's own loss applies.
    let decoder = if identity {
        None
    } else {
        decoder_config(model)?
    };
    let vocab_parallel = decoder.is_some();
    let vocab = decoder.map_or(0, |c| c.vocab);
    let gpt_dropout = if model.name() == "gpt_dropout" {
        lockstep_models::zoo::GPT_DROPOUT
    } else {
        0.0
    };
    let dropout_keys: Rc<RefCell<Vec<i64>>> = Rc::default();
    let mut hooks: Box<dyn LayerHooks> = if identity {
        Box::new(NoHooks)
    } else if let Some(config) = decoder {
        Box::new(GptTp {
            group: tp_group.clone(),
            tp,
            rank,
            params,
            layer_names,
            config,
            sequence_parallel: opts.sequence_parallel,
            fault: opts.fault,
            experts_parallel: None,
            dropout: gpt_dropout,
            dropout_keys: dropout_keys.clone(),
        })
    } else {
        Box::new(TransformerTp {
            group: tp_group.clone(),
            params,
            layer_names,
            dim: TransformerWithSharedParams::DIM,
            heads: TransformerWithSharedParams::HEADS,
            missing_backward_all_reduce: opts.fault == Some(TpFault::MissingBackwardAllReduce),
        })
    };
    let per = world_size / dp;
    let data_ranks: Vec<usize> = (groups.replica * per..(groups.replica + 1) * per).collect();
    let mut optimizer = cfg.optimizer.build();
    let mut record = RunRecord::start(cfg.spec.clone(), cfg.record_grads);
    let mut collectives = Vec::with_capacity(cfg.spec.steps);
    let coordinate = |name: &str| tp_coordinate(&placements, name, rank, tp);
    for step in 0..cfg.spec.steps {
        if let Some(probe) = &cfg.probe {
            probe.start_step(step);
        }
        for (_, t) in &trained {
            t.shallow_clone().zero_grad();
        }
        let _ = counts.take();
        if let Some(u) = unit.as_mut() {
            u.unshard()?;
        }
        let batch = global_batch(model, &data_ranks, step)?;
        if gpt_dropout > 0.0 {
            let keys = batch
                .inputs
                .get(1)
                .ok_or_else(|| TpError::Invalid("the batch carries no dropout keys".into()))?;
            *dropout_keys.borrow_mut() = Vec::<i64>::try_from(keys)?;
        }
        let output = model.forward_hooked(&batch, hooks.as_mut())?;
        let loss = if vocab_parallel {
            let target = batch
                .target
                .as_ref()
                .ok_or_else(|| TpError::Invalid("the batch has no target".into()))?;
            vocab_parallel_loss(&output, target, vocab, rank, &tp_group)?
        } else {
            // The reference averages the data ranks' losses: a summed loss over their
            // concatenated batches is divided by their number (a mean is already that).
            let loss = model.loss_of(&batch, &output)?;
            match model.loss_reduction() {
                LossReduction::Mean => loss,
                LossReduction::Sum => loss.f_div_scalar(data_ranks.len() as f64)?,
            }
        };
        loss.f_backward()?;
        // Gradients of parameters used on sequence shards are partial: sum them over TP.
        for (name, t) in &trained {
            if placements.get(name) == Some(&Placement::PartialGrad)
                && opts.fault != Some(TpFault::SkipSequenceGradReduce)
            {
                tp_group.all_reduce(&t.grad(), ReduceOp::Sum)?;
            }
        }
        if opts.fault == Some(TpFault::ShardedGradsReducedOverDpTwice) && dp > 1 {
            for (name, t) in &trained {
                if matches!(placements.get(name), Some(Placement::Shard { .. })) {
                    groups.dp.all_reduce(&t.grad(), ReduceOp::Sum)?;
                }
            }
        }
        let full_grads = match unit.as_mut() {
            None => {
                // One average over dp, or hybrid shard's two stages (HybridReplicate).
                for (_, t) in &trained {
                    groups.average_over_data(&t.grad())?;
                }
                collectives.push(CollectiveEntry::from_counts(counts.take()));
                full_tensors(&trained, &placements, tp_group.as_ref(), |t| t.grad())?
            }
            Some(u) => {
                u.reduce_grads()?;
                collectives.push(CollectiveEntry::from_counts(counts.take()));
                let local = u.full_values(|t| t.grad())?;
                full_tensors(
                    &local,
                    &placements,
                    tp_group.as_ref(),
                    Tensor::shallow_clone,
                )?
            }
        };
        let norm = grad_norm(&full_grads)?;
        record.grad_norms.push(norm);
        if let Some(all) = record.grads.as_mut() {
            all.push(capture(&full_grads)?);
        }
        if let Some(max_norm) = model.max_grad_norm() {
            // What the optimizer steps: the local tensors' gradients, or the unit's shard.
            let coef = clip_coefficient(max_norm, norm);
            match unit.as_ref() {
                None => scale_gradients(
                    trained
                        .iter()
                        .map(|(_, t)| t.grad())
                        .collect::<Vec<_>>()
                        .iter(),
                    coef,
                )?,
                Some(u) => scale_gradients([&u.shard().1.grad()], coef)?,
            }
        }
        let value = Tensor::from_slice(&[loss.f_double_value(&[])?]);
        groups.average_over_data(&value)?;
        record.losses.push(value.f_double_value(&[0])?);
        match unit.as_mut() {
            None => optimizer.step(&trained)?,
            Some(u) => {
                optimizer.step(&[u.shard()])?;
                // Freed until the next step's gather.
                u.reshard()?;
            }
        }
        if let Some(probe) = &cfg.probe {
            match unit.as_ref() {
                None => observe_stepped(probe, step, &trained, optimizer.as_ref(), &coordinate)?,
                Some(u) => {
                    let tp_part = if tp > 1 {
                        format!("tp{rank}/{tp}.")
                    } else {
                        String::new()
                    };
                    let coord = |_: &str| format!("{tp_part}{}", u.shard_coordinate());
                    observe_stepped(probe, step, &[u.shard()], optimizer.as_ref(), &coord)?;
                }
            }
        }
    }
    if let Some(u) = unit.as_mut() {
        // Gathered again, so the tensors this rank computed with (the model's own
        // replicated parameters among them) hold their trained values, never freed memory.
        u.unshard()?;
    }
    if let Some(probe) = &cfg.probe {
        probe.observe_all(cfg.spec.steps, StateKind::Final, &trained, &coordinate)?;
    }
    let _ = counts.take();
    let params = tch::no_grad(|| -> Result<_, TpError> {
        match &unit {
            None => full_tensors(
                &trained,
                &placements,
                tp_group.as_ref(),
                Tensor::shallow_clone,
            ),
            Some(u) => full_tensors(
                &u.full_values(Tensor::shallow_clone)?,
                &placements,
                tp_group.as_ref(),
                Tensor::shallow_clone,
            ),
        }
    })?;
    record.params = capture(&params)?;
    record.buffers = capture(&model.named_buffers())?;
    record.collectives = Some(collectives);
    Ok(record)
}

/// The tensors this rank computes with under `placements`: each split parameter's shard
/// along its dimension (a fresh leaf), every other parameter the model's own (a handle), in
/// `named_parameters` order.
pub(crate) fn local_parameters(
    model: &dyn Model,
    placements: &HashMap<String, Placement>,
    rank: usize,
    tp: usize,
) -> Result<Vec<(String, Tensor)>, super::layers::TensorParallelError> {
    model
        .named_parameters()
        .into_iter()
        .map(|(name, t)| {
            let local = match placements.get(&name) {
                Some(Placement::Shard { dim }) => super::layers::shard(&t, *dim, rank, tp)?,
                _ => t.shallow_clone(),
            };
            Ok((name, local))
        })
        .collect()
}

/// Which copy of TP-local tensor `name` this rank holds ([`crate::consistency`]): its TP
/// shard, or none when every TP rank holds it whole (norms, row-parallel biases).
pub(crate) fn tp_coordinate(
    placements: &HashMap<String, Placement>,
    name: &str,
    rank: usize,
    tp: usize,
) -> String {
    match placements.get(name) {
        Some(Placement::Shard { .. }) => format!("tp{rank}/{tp}"),
        _ => String::new(),
    }
}

/// Handles to `params` by name: what the TP hooks compute with.
pub(crate) fn by_name(params: &[(String, Tensor)]) -> HashMap<String, Tensor> {
    params
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect()
}

/// The decoder's mean loss from TP rank `rank`'s vocabulary slice of the logits (loss
/// parallel: the full logits never exist), over a `vocab`-token vocabulary split evenly
/// across `group`.
pub(crate) fn vocab_parallel_loss(
    logits: &Tensor,
    target: &Tensor,
    vocab: i64,
    rank: usize,
    group: &Arc<dyn ProcessGroup>,
) -> Result<Tensor, super::layers::TensorParallelError> {
    let tp = group.size() as i64;
    super::layers::vocab_parallel_cross_entropy(
        &logits.f_reshape([-1, vocab / tp])?,
        &target.f_reshape([-1])?,
        rank as i64 * vocab / tp,
        group,
        super::layers::Reduction::Mean,
    )
}

/// The replica's batch: its data ranks' batches concatenated along the batch dimension.
fn global_batch(model: &dyn Model, ranks: &[usize], step: usize) -> Result<Batch, TpError> {
    let batches = ranks
        .iter()
        .map(|&r| model.input(r, step))
        .collect::<Result<Vec<_>, _>>()?;
    let dim = model.batch_dim();
    let arity = batches.first().map_or(0, |b| b.inputs.len());
    let inputs = (0..arity)
        .map(|k| {
            Tensor::f_cat(
                &batches.iter().map(|b| &b.inputs[k]).collect::<Vec<_>>(),
                dim,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let targets: Vec<&Tensor> = batches.iter().filter_map(|b| b.target.as_ref()).collect();
    let target = if targets.is_empty() {
        None
    } else {
        Some(Tensor::f_cat(&targets, dim)?)
    };
    Ok(Batch { inputs, target })
}

/// Full tensors from this rank's parameters: shards gathered over TP, the rest as they are.
fn full_tensors(
    trained: &[(String, Tensor)],
    placements: &HashMap<String, Placement>,
    group: &dyn ProcessGroup,
    value: impl Fn(&Tensor) -> Tensor,
) -> Result<Vec<(String, Tensor)>, TpError> {
    trained
        .iter()
        .map(|(name, t)| {
            let v = value(t);
            let v = if v.defined() { v } else { t.f_zeros_like()? };
            let full = match placements.get(name) {
                Some(Placement::Shard { dim }) => super::layers::unshard(&v, *dim, group)?,
                _ => v,
            };
            Ok((name.clone(), full))
        })
        .collect()
}
