//! The per-step shape handshake between stages: producers announce the shapes and dtypes
//! they will send on every cross-rank edge, consumers check them, before any activation moves.

use super::dataflow::{StageEdge, TensorMeta};
use super::edges::{EdgeGroups, Way};
use super::plan::PipelinePlan;
use super::PipelineError;
use crate::comm::{batch_isend_irecv, P2pKind, P2pOp};
use tch::{Device, Kind, Tensor};

const META_SLOTS: usize = 10;

fn kind_code(kind: Kind) -> i64 {
    match kind {
        Kind::Float => 1,
        Kind::Double => 2,
        Kind::Half => 3,
        Kind::BFloat16 => 4,
        Kind::Int64 => 5,
        Kind::Int => 6,
        Kind::Bool => 7,
        _ => 0,
    }
}

fn encode(metas: &[&TensorMeta]) -> Vec<i64> {
    let mut v = Vec::with_capacity(metas.len() * META_SLOTS);
    for m in metas {
        let mut slot = vec![-1i64; META_SLOTS];
        slot[0] = m.shape.len() as i64;
        slot[1] = kind_code(m.kind);
        for (j, d) in m.shape.iter().take(META_SLOTS - 2).enumerate() {
            slot[2 + j] = *d;
        }
        v.extend(slot);
    }
    v
}

/// Producers announce the shapes and dtypes of what they will send on every cross-rank edge;
/// consumers compare with what they expect and answer. A mismatch fails both sides with a
/// message naming the two stages, before any activation moves. Announcements, verdicts and
/// their receive buffers live on `device`, the stage's compute device: the edge groups are
/// the activations' (an NCCL group takes tensors on its own device only).
pub(super) fn handshake(
    plan: &PipelinePlan,
    rank: usize,
    groups: &EdgeGroups,
    metas: &[TensorMeta],
    device: Device,
    plant_wrong_shape: bool,
) -> Result<(), PipelineError> {
    let remote: Vec<_> = plan
        .flow
        .edges
        .iter()
        .filter(|e| plan.stage_ranks[e.from] != plan.stage_ranks[e.to])
        .collect();
    // Two batches (grouped point-to-point: no send waits for a receive this rank posts
    // later, as NCCL's rendezvous requires): announcements out and in, then verdicts back.
    let mut announced = Vec::new();
    let mut expected = Vec::new();
    for (n, e) in remote.iter().enumerate() {
        if e.layers.is_empty() {
            continue;
        }
        let encoded = encode(&e.layers.iter().map(|&k| &metas[k]).collect::<Vec<_>>());
        if plan.stage_ranks[e.from] == rank {
            let mut v = encoded;
            if plant_wrong_shape && n == 0 {
                v[2] += 1;
            }
            announced.push((*e, Tensor::from_slice(&v).f_to_device(device)?));
        } else if plan.stage_ranks[e.to] == rank {
            let got = Tensor::f_zeros([encoded.len() as i64], (Kind::Int64, device))?;
            expected.push((*e, encoded, got));
        }
    }
    let sends = announced.iter().map(|(e, t)| (*e, t));
    let receives = expected.iter().map(|(e, _, got)| (*e, got));
    swap(groups, rank, Way::Activations, sends, receives)?;

    let mut failure = None;
    let mut verdicts_out = Vec::new();
    for (e, expected, got) in &expected {
        let got: Vec<i64> = Vec::try_from(got)?;
        let ok = &got == expected;
        verdicts_out.push((
            *e,
            Tensor::from_slice(&[i64::from(ok)]).f_to_device(device)?,
        ));
        if !ok && failure.is_none() {
            failure = Some(PipelineError::ShapeMismatch {
                producer: e.from,
                consumer: e.to,
                announced: describe_metas(&e.layers, &got),
                expected: describe_metas(&e.layers, expected),
            });
        }
    }
    let verdicts_in: Vec<_> = announced
        .iter()
        .map(|(e, _)| Ok((*e, Tensor::f_zeros([1], (Kind::Int64, device))?)))
        .collect::<Result<_, PipelineError>>()?;
    let sends = verdicts_out.iter().map(|(e, t)| (*e, t));
    let receives = verdicts_in.iter().map(|(e, t)| (*e, t));
    swap(groups, rank, Way::Gradients, sends, receives)?;
    for (e, verdict) in &verdicts_in {
        if verdict.f_int64_value(&[0])? != 1 && failure.is_none() {
            failure = Some(PipelineError::ShapeMismatch {
                producer: e.from,
                consumer: e.to,
                announced: "(what this stage announced)".into(),
                expected: format!("what stage {} expects (see its error)", e.to),
            });
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Encoded shapes in words: `layer k: dtype#d [dims]` per layer.
fn describe_metas(layers: &[usize], values: &[i64]) -> String {
    layers
        .iter()
        .zip(values.chunks(META_SLOTS))
        .map(|(k, s)| {
            let dims: Vec<String> = s[2..2 + (s[0].max(0) as usize).min(META_SLOTS - 2)]
                .iter()
                .map(i64::to_string)
                .collect();
            format!("layer {k}: dtype#{} [{}]", s[1], dims.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// One grouped batch on the edges' `way` groups: `sends` to each edge's other end and
/// `receives` from it. On an activations group the producer is peer 0 and the consumer
/// peer 1; announcements go downstream (tag 0), verdicts come back upstream (tag 1).
fn swap<'e>(
    groups: &EdgeGroups,
    rank: usize,
    way: Way,
    sends: impl Iterator<Item = (&'e StageEdge, &'e Tensor)>,
    receives: impl Iterator<Item = (&'e StageEdge, &'e Tensor)>,
) -> Result<(), PipelineError> {
    let group = |e: &StageEdge| -> Result<_, PipelineError> {
        groups.get(&(e.from, e.to, way)).ok_or_else(|| {
            PipelineError::Execution(format!(
                "rank {rank} has no channel for the edge from stage {} to stage {}",
                e.from, e.to
            ))
        })
    };
    // Downstream (announcements): the producer sends to peer 1; upstream the other way.
    let (to, from, tag) = match way {
        Way::Activations => (1, 0, 0),
        Way::Gradients => (0, 1, 1),
    };
    let mut ops = Vec::new();
    for (e, tensor) in sends {
        ops.push(P2pOp {
            group: group(e)?.as_ref(),
            kind: P2pKind::Send,
            tensor,
            peer: to,
            tag,
        });
    }
    for (e, tensor) in receives {
        ops.push(P2pOp {
            group: group(e)?.as_ref(),
            kind: P2pKind::Recv,
            tensor,
            peer: from,
            tag,
        });
    }
    batch_isend_irecv(&ops)?;
    Ok(())
}
