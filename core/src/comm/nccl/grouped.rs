//! A batch of sends and receives over one or more NCCL groups issued as one NCCL group call
//! (`ncclGroupStart` … `ncclGroupEnd`), so no send of the batch waits for a receive the same
//! rank posts later: what [`crate::comm::p2p::batch_isend_irecv`] runs when every group is an
//! NCCL group.
//!
//! Apart from the single-group launch path ([`super::group`]) because it spans groups: one
//! wait for libtorch's compute stream, every group's lock taken in one order, one flight record per
//! operation, and one completion event per group's stream.

use super::api::{check, cuda_error, synchronize_compute_stream};
use super::collectives::nccl_dtype;
use super::communicator::CommState;
use super::completion::NcclWork;
use super::group::NcclGroup;
use crate::comm::flight::{self, OpState};
use crate::comm::work::lock;
use crate::comm::{CommError, DType, OpKind, Work};
use crate::comm::{P2pKind, P2pOp};
use cudarc::driver::CudaEvent;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t};
use std::ffi::c_int;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use tch::Tensor;

/// Issues `ops` (each on `groups[i]`, the NCCL group behind `ops[i].group`) as one NCCL
/// group call and returns one work per distinct group, each complete once that group's
/// share of the batch finished, with whether that share receives anything.
pub(crate) fn grouped_p2p(
    ops: &[P2pOp<'_>],
    groups: &[&NcclGroup],
) -> Result<Vec<(bool, Work)>, CommError> {
    let distinct = distinct_groups(groups);
    let device = distinct[0].device;
    let dtypes = check_batch(ops, groups, &distinct)?;
    let synced = distinct[0]
        .shared
        .ctx
        .bind_to_thread()
        .map_err(cuda_error("binding the primary context"))
        .and_then(|_| synchronize_compute_stream(device));
    let mut states: Vec<MutexGuard<'_, CommState>> =
        distinct.iter().map(|g| lock(&g.shared.state)).collect();
    for (g, state) in distinct.iter().zip(&states) {
        if let Some(reason) = &state.aborted {
            return Err(CommError::Nccl(format!(
                "group {}: the communicator was aborted after an earlier failure: {reason}",
                g.shared.name
            )));
        }
    }
    let index_of = |g: &NcclGroup| {
        distinct
            .iter()
            .position(|d| std::ptr::eq(*d, g))
            .unwrap_or(0)
    };
    let mut flight_ids = Vec::with_capacity(ops.len());
    for ((op, g), dtype) in ops.iter().zip(groups).zip(&dtypes) {
        let state = &mut states[index_of(g)];
        let (kind, seq) = match op.kind {
            P2pKind::Send => {
                state.send_seq[op.peer] += 1;
                (OpKind::Send, state.send_seq[op.peer])
            }
            P2pKind::Recv => {
                state.recv_seq[op.peer] += 1;
                (OpKind::Recv, state.recv_seq[op.peer])
            }
        };
        flight_ids.push(flight::record(
            &g.shared.name,
            seq,
            kind,
            vec![op.tensor.size()],
            Some(*dtype),
            Some(op.peer),
            crate::comm::label::current(),
        ));
    }
    let comms: Vec<ncclComm_t> = groups.iter().map(|g| states[index_of(g)].comm.0).collect();
    let enqueued = synced.and_then(|_| enqueue(ops, groups, &dtypes, &comms, &distinct));
    drop(states);
    let events = match enqueued {
        Ok(events) => events,
        Err(e) => {
            for id in flight_ids {
                flight::update(id, OpState::Failed(e.to_string()));
            }
            return Err(e);
        }
    };
    for id in &flight_ids {
        flight::update(*id, OpState::Started);
    }
    Ok(batch_works(ops, groups, &distinct, events, &flight_ids))
}

/// The distinct groups of a batch, in a fixed order (by address) so two batches lock them
/// alike.
fn distinct_groups<'g>(groups: &[&'g NcclGroup]) -> Vec<&'g NcclGroup> {
    let mut distinct: Vec<&NcclGroup> = Vec::new();
    for g in groups {
        if !distinct.iter().any(|d| std::ptr::eq(*d, *g)) {
            distinct.push(g);
        }
    }
    distinct.sort_by_key(|g| *g as *const NcclGroup as usize);
    distinct
}

/// Every operation checked before anything is issued (one device for the whole batch, a
/// peer of its group other than this rank, a tensor the group takes): their dtypes.
fn check_batch(
    ops: &[P2pOp<'_>],
    groups: &[&NcclGroup],
    distinct: &[&NcclGroup],
) -> Result<Vec<DType>, CommError> {
    let device = distinct[0].device;
    let mut dtypes = Vec::with_capacity(ops.len());
    for (op, g) in ops.iter().zip(groups) {
        if g.device != device {
            return Err(CommError::InvalidArgument(format!(
                "a grouped send/receive batch spans cuda:{device} and cuda:{} (groups {} and \
                 {}); one batch runs on one device",
                g.device, distinct[0].shared.name, g.shared.name
            )));
        }
        let what = match op.kind {
            P2pKind::Send => "send destination",
            P2pKind::Recv => "recv source",
        };
        g.check_peer(op.peer, what)?;
        if op.peer == g.rank {
            return Err(CommError::InvalidArgument(format!(
                "{what} is this rank ({}) in group {}: NCCL never matches it; copy locally",
                op.peer, g.shared.name
            )));
        }
        dtypes.push(g.check_tensor(op.tensor, "tensor")?);
    }
    Ok(dtypes)
}

/// Issues the batch as one NCCL group call (`comms[i]` the communicator of `ops[i]`'s group)
/// and records one completion event per distinct group on its stream.
fn enqueue(
    ops: &[P2pOp<'_>],
    groups: &[&NcclGroup],
    dtypes: &[DType],
    comms: &[ncclComm_t],
    distinct: &[&NcclGroup],
) -> Result<Vec<CudaEvent>, CommError> {
    let api = distinct[0].shared.api;
    // SAFETY: plain NCCL call; every started group is ended below.
    check(api, unsafe { (api.group_start)() }, None, "ncclGroupStart")?;
    let mut first_error = Ok(());
    for (((op, g), dtype), &comm) in ops.iter().zip(groups).zip(dtypes).zip(comms) {
        let stream: cudaStream_t = g.shared.stream.cu_stream().cast();
        let (ptr, count) = (op.tensor.data_ptr(), op.tensor.numel());
        let (dtype, peer) = (nccl_dtype(*dtype), op.peer as c_int);
        // SAFETY: dense CUDA buffers of `count` elements, kept alive by the works below
        // until the kernels finished; peers are ranks of their groups (< size, fit c_int).
        let rc = unsafe {
            match op.kind {
                P2pKind::Send => (api.send)(ptr, count, dtype, peer, comm, stream),
                P2pKind::Recv => (api.recv)(ptr, count, dtype, peer, comm, stream),
            }
        };
        if first_error.is_ok() {
            first_error = check(api, rc, Some(comm), "ncclSend/ncclRecv (grouped)");
        }
    }
    // A started group must be ended, even after a failed call inside it.
    // SAFETY: ends the group started above.
    let end = check(api, unsafe { (api.group_end)() }, None, "ncclGroupEnd");
    first_error.and(end)?;
    distinct
        .iter()
        .map(|g| {
            g.shared
                .stream
                .record_event(None)
                .map_err(cuda_error("recording the completion event"))
        })
        .collect()
}

/// One work per group: it keeps that group's tensors alive and completes its operations'
/// flight records (the first one carries the work; the others are marked with it), with
/// whether that group's share receives anything.
fn batch_works(
    ops: &[P2pOp<'_>],
    groups: &[&NcclGroup],
    distinct: &[&NcclGroup],
    events: Vec<CudaEvent>,
    flight_ids: &[u64],
) -> Vec<(bool, Work)> {
    distinct
        .iter()
        .zip(events)
        .map(|(g, event)| {
            let mine: Vec<usize> = (0..ops.len())
                .filter(|&i| std::ptr::eq(groups[i], *g))
                .collect();
            let keep: Vec<Tensor> = mine
                .iter()
                .map(|&i| ops[i].tensor.shallow_clone())
                .collect();
            let work = NcclWork {
                shared: Arc::clone(&g.shared),
                event,
                flight_id: flight_ids[mine[0]],
                what: format!(
                    "{} grouped send/receive operation(s) on group {}",
                    mine.len(),
                    g.shared.name
                ),
                keep_alive: Mutex::new(keep),
                outcome: Mutex::new(None),
                done: AtomicBool::new(false),
                also_completes: mine[1..].iter().map(|&i| flight_ids[i]).collect(),
            };
            let receives = mine.iter().any(|&i| ops[i].kind == P2pKind::Recv);
            (receives, Work::new(Arc::new(work)))
        })
        .collect()
}
