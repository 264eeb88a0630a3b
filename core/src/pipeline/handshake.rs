//! The per-step shape handshake between stages: producers announce the shapes and dtypes
//! they will send on every cross-rank edge, consumers check them, before any activation moves.

use super::dataflow::TensorMeta;
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
    let describe = |layers: &[usize], values: &[i64]| -> String {
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
    };
    // Two batches (grouped point-to-point: no send waits for a receive this rank posts
    // later, as NCCL's rendezvous requires): announcements out and in, then verdicts back.
    let group = |e: &super::dataflow::StageEdge, way: Way| -> Result<_, PipelineError> {
        groups.get(&(e.from, e.to, way)).ok_or_else(|| {
            PipelineError::Execution(format!(
                "rank {rank} has no channel for the edge from stage {} to stage {}",
                e.from, e.to
            ))
        })
    };
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
    let mut ops = Vec::new();
    for (e, t) in &announced {
        ops.push(P2pOp {
            group: group(e, Way::Activations)?.as_ref(),
            kind: P2pKind::Send,
            tensor: t,
            peer: 1,
            tag: 0,
        });
    }
    for (e, _, got) in &expected {
        ops.push(P2pOp {
            group: group(e, Way::Activations)?.as_ref(),
            kind: P2pKind::Recv,
            tensor: got,
            peer: 0,
            tag: 0,
        });
    }
    batch_isend_irecv(&ops)?;

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
                announced: describe(&e.layers, &got),
                expected: describe(&e.layers, expected),
            });
        }
    }
    let verdicts_in: Vec<_> = announced
        .iter()
        .map(|(e, _)| Ok((*e, Tensor::f_zeros([1], (Kind::Int64, device))?)))
        .collect::<Result<_, PipelineError>>()?;
    let mut ops = Vec::new();
    for (e, t) in &verdicts_out {
        ops.push(P2pOp {
            group: group(e, Way::Gradients)?.as_ref(),
            kind: P2pKind::Send,
            tensor: t,
            peer: 0,
            tag: 1,
        });
    }
    for (e, t) in &verdicts_in {
        ops.push(P2pOp {
            group: group(e, Way::Gradients)?.as_ref(),
            kind: P2pKind::Recv,
            tensor: t,
            peer: 1,
            tag: 1,
        });
    }
    batch_isend_irecv(&ops)?;
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
