//! The [`ProcessGroup`] collectives of [`NcclGroup`], one NCCL call each (an uneven
//! `all_to_all` is a grouped set of sends and receives, the barrier a one-element
//! all-reduce), with the dtype and reduction mappings and argument checks they need.
//!
//! Apart from the group's setup and launch path ([`super::group`]): this file only says what
//! each operation enqueues.

use super::api::{check, NcclApi};
use super::group::{NcclGroup, Seq};
use crate::comm::{CommError, DType, OpKind, ProcessGroup, ReduceOp, Work};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t};
use std::ffi::{c_int, c_void};
use tch::{Device, Kind, Tensor};

/// The NCCL datatype carrying `d` (booleans travel as bytes).
pub(super) fn nccl_dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::I32 => ncclDataType_t::ncclInt32,
        DType::U8 | DType::Bool => ncclDataType_t::ncclUint8,
    }
}

/// The NCCL reduction for `op` on `d`: `Avg` only for floats; on booleans `Sum`/`Max` are
/// logical or (max of 0/1 bytes) and `Min` is logical and.
fn nccl_op(op: ReduceOp, d: DType) -> Result<ncclRedOp_t, CommError> {
    if op == ReduceOp::Avg && !d.is_float() {
        return Err(CommError::InvalidArgument(format!(
            "reduce op avg needs a floating dtype, got {d}"
        )));
    }
    Ok(match (op, d) {
        (ReduceOp::Sum, DType::Bool) | (ReduceOp::Max, _) => ncclRedOp_t::ncclMax,
        (ReduceOp::Sum, _) => ncclRedOp_t::ncclSum,
        (ReduceOp::Avg, _) => ncclRedOp_t::ncclAvg,
        (ReduceOp::Min, _) => ncclRedOp_t::ncclMin,
    })
}

/// Whether the byte ranges `[a, a + a_len)` and `[b, b + b_len)` share memory.
fn overlaps(a: *const c_void, a_len: usize, b: *const c_void, b_len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// Number of elements in one dim-0 row of a tensor of this shape.
fn row_numel(shape: &[i64]) -> usize {
    shape.iter().skip(1).map(|&d| d.max(0) as usize).product()
}

/// One side's per-peer dim-0 row counts of an all_to_all: `given`, or dim 0 split evenly.
fn all_to_all_splits(
    given: &[usize],
    dim0: i64,
    what: &str,
    size: usize,
) -> Result<Vec<usize>, CommError> {
    let dim0 = dim0.max(0) as usize;
    if given.is_empty() {
        if dim0.checked_rem(size) != Some(0) {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all {what} dim 0 ({dim0}) is not divisible by group size {size}; \
                 pass explicit splits"
            )));
        }
        return Ok(vec![dim0 / size; size]);
    }
    if given.len() != size {
        return Err(CommError::InvalidArgument(format!(
            "all_to_all {what} splits has {} entries, one per rank ({size}) is needed",
            given.len()
        )));
    }
    let total: usize = given.iter().sum();
    if total != dim0 {
        return Err(CommError::InvalidArgument(format!(
            "all_to_all {what} splits {given:?} sum to {total} but {what} dim 0 is {dim0}"
        )));
    }
    Ok(given.to_vec())
}

/// A checked all_to_all, ready to enqueue: its buffers and what goes to and from each peer.
struct AllToAll {
    src: *mut c_void,
    dst: *mut c_void,
    /// Elements per dim-0 row.
    row: usize,
    /// Bytes per dim-0 row.
    row_bytes: usize,
    nccl_dt: ncclDataType_t,
    /// The group size: one send and one receive slot per peer.
    peers: usize,
    /// Per peer: the rows sent from the input.
    in_splits: Vec<usize>,
    /// Per peer: the rows received into the output.
    out_splits: Vec<usize>,
}

impl AllToAll {
    /// Posts every peer's send and receive inside one NCCL group on `stream`.
    fn enqueue(
        &self,
        api: &NcclApi,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> Result<(), CommError> {
        let (row, row_bytes, nccl_dt) = (self.row, self.row_bytes, self.nccl_dt);
        // SAFETY (whole block): offsets stay within the dense buffers (splits sum to
        // dim 0, checked by `all_to_all_async`), peers are ranks (< size, fits c_int), and
        // the buffers are kept alive by the returned Work.
        check(
            api,
            unsafe { (api.group_start)() },
            Some(comm),
            "ncclGroupStart",
        )?;
        let mut first_error = Ok(());
        let (mut in_off, mut out_off) = (0usize, 0usize);
        for peer in 0..self.peers {
            let (n_in, n_out) = (self.in_splits[peer], self.out_splits[peer]);
            if n_in > 0 && first_error.is_ok() {
                let buf = self.src.cast::<u8>().wrapping_add(in_off * row_bytes);
                let rc = unsafe {
                    (api.send)(buf.cast(), n_in * row, nccl_dt, peer as c_int, comm, stream)
                };
                first_error = check(api, rc, Some(comm), "ncclSend (all_to_all)");
            }
            if n_out > 0 && first_error.is_ok() {
                let buf = self.dst.cast::<u8>().wrapping_add(out_off * row_bytes);
                let rc = unsafe {
                    (api.recv)(
                        buf.cast(),
                        n_out * row,
                        nccl_dt,
                        peer as c_int,
                        comm,
                        stream,
                    )
                };
                first_error = check(api, rc, Some(comm), "ncclRecv (all_to_all)");
            }
            in_off += n_in;
            out_off += n_out;
        }
        // A group that was started must be ended, even after a failed call inside it.
        let end = check(
            api,
            unsafe { (api.group_end)() },
            Some(comm),
            "ncclGroupEnd",
        );
        first_error.and(end)
    }
}

impl ProcessGroup for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.global_ranks.len()
    }

    fn name(&self) -> &str {
        &self.shared.name
    }

    fn backend_group(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work, CommError> {
        let dtype = self.check_tensor(tensor, "tensor")?;
        let red = nccl_op(op, dtype)?;
        let count = tensor.numel();
        let ptr = tensor.data_ptr();
        self.launch(
            OpKind::AllReduce,
            Seq::Collective,
            vec![tensor.size()],
            Some(dtype),
            None,
            vec![tensor.shallow_clone()],
            |api, comm, stream| {
                if count == 0 {
                    return Ok(());
                }
                // SAFETY: `ptr` is a dense CUDA buffer of `count` elements on this device, kept
                // alive by the returned Work.
                let rc = unsafe {
                    (api.all_reduce)(ptr, ptr, count, nccl_dtype(dtype), red, comm, stream)
                };
                check(api, rc, Some(comm), "ncclAllReduce")
            },
        )
    }

    fn all_gather_async(&self, output: &Tensor, input: &Tensor) -> Result<Work, CommError> {
        let dtype = self.check_pair(output, input)?;
        let count = input.numel();
        let size = self.size();
        if output.numel() != size * count {
            return Err(CommError::InvalidArgument(format!(
                "all_gather output has {} elements but must hold group size {size} x input's {count}",
                output.numel()
            )));
        }
        let (src, dst) = (input.data_ptr(), output.data_ptr());
        let bytes = count * dtype.size();
        let in_place = dst.cast::<u8>().wrapping_add(self.rank * bytes) == src.cast::<u8>();
        if !in_place && overlaps(src, bytes, dst, size * bytes) {
            return Err(CommError::InvalidArgument(
                "all_gather input overlaps output (only input == output chunk `rank` is allowed)"
                    .into(),
            ));
        }
        self.launch(
            OpKind::AllGather,
            Seq::Collective,
            vec![input.size(), output.size()],
            Some(dtype),
            None,
            vec![output.shallow_clone(), input.shallow_clone()],
            |api, comm, stream| {
                if count == 0 {
                    return Ok(());
                }
                // SAFETY: dense CUDA buffers of `count` and `size * count` elements, kept alive
                // by the returned Work.
                let rc =
                    unsafe { (api.all_gather)(src, dst, count, nccl_dtype(dtype), comm, stream) };
                check(api, rc, Some(comm), "ncclAllGather")
            },
        )
    }

    fn reduce_scatter_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
    ) -> Result<Work, CommError> {
        let dtype = self.check_pair(output, input)?;
        let red = nccl_op(op, dtype)?;
        let count = output.numel();
        let size = self.size();
        if input.numel() != size * count {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter input has {} elements but must hold group size {size} x output's {count}",
                input.numel()
            )));
        }
        let (src, dst) = (input.data_ptr(), output.data_ptr());
        let bytes = count * dtype.size();
        let in_place = src.cast::<u8>().wrapping_add(self.rank * bytes) == dst.cast::<u8>();
        if !in_place && overlaps(src, size * bytes, dst, bytes) {
            return Err(CommError::InvalidArgument(
                "reduce_scatter output overlaps input (only output == input chunk `rank` is allowed)"
                    .into(),
            ));
        }
        self.launch(
            OpKind::ReduceScatter,
            Seq::Collective,
            vec![input.size(), output.size()],
            Some(dtype),
            None,
            vec![output.shallow_clone(), input.shallow_clone()],
            |api, comm, stream| {
                if count == 0 {
                    return Ok(());
                }
                // SAFETY: dense CUDA buffers of `size * count` and `count` elements, kept alive
                // by the returned Work.
                let rc = unsafe {
                    (api.reduce_scatter)(src, dst, count, nccl_dtype(dtype), red, comm, stream)
                };
                check(api, rc, Some(comm), "ncclReduceScatter")
            },
        )
    }

    fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work, CommError> {
        let dtype = self.check_tensor(tensor, "tensor")?;
        self.check_peer(root, "broadcast root")?;
        let count = tensor.numel();
        let ptr = tensor.data_ptr();
        self.launch(
            OpKind::Broadcast,
            Seq::Collective,
            vec![tensor.size()],
            Some(dtype),
            Some(root),
            vec![tensor.shallow_clone()],
            |api, comm, stream| {
                if count == 0 {
                    return Ok(());
                }
                // SAFETY: dense CUDA buffer of `count` elements kept alive by the Work; `root`
                // was checked to be a rank (< size, which fits c_int).
                let rc = unsafe {
                    (api.broadcast)(
                        ptr,
                        ptr,
                        count,
                        nccl_dtype(dtype),
                        root as c_int,
                        comm,
                        stream,
                    )
                };
                check(api, rc, Some(comm), "ncclBroadcast")
            },
        )
    }

    fn all_to_all_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
    ) -> Result<Work, CommError> {
        let dtype = self.check_pair(output, input)?;
        let size = self.size();
        let (in_shape, out_shape) = (input.size(), output.size());
        if in_shape.is_empty() || out_shape.is_empty() {
            return Err(CommError::InvalidArgument(
                "all_to_all needs tensors with at least one dimension (splits are on dim 0)".into(),
            ));
        }
        let row = row_numel(&in_shape);
        if row_numel(&out_shape) != row {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all rows differ: input {in_shape:?} has {row} elements per dim-0 row, \
                 output {out_shape:?} has {}",
                row_numel(&out_shape)
            )));
        }
        let in_splits = all_to_all_splits(input_splits, in_shape[0], "input", size)?;
        let out_splits = all_to_all_splits(output_splits, out_shape[0], "output", size)?;
        let (src, dst) = (input.data_ptr(), output.data_ptr());
        let row_bytes = row * dtype.size();
        if overlaps(
            src,
            input.numel() * dtype.size(),
            dst,
            output.numel() * dtype.size(),
        ) {
            return Err(CommError::InvalidArgument(
                "all_to_all input and output overlap; use separate buffers".into(),
            ));
        }
        let exchange = AllToAll {
            src,
            dst,
            row,
            row_bytes,
            nccl_dt: nccl_dtype(dtype),
            peers: size,
            in_splits,
            out_splits,
        };
        self.launch(
            OpKind::AllToAll,
            Seq::Collective,
            vec![in_shape, out_shape],
            Some(dtype),
            None,
            vec![output.shallow_clone(), input.shallow_clone()],
            |api, comm, stream| exchange.enqueue(api, comm, stream),
        )
    }

    /// `tag` is not used: NCCL has no tags, and messages between two ranks match in the order
    /// they were posted, which is the order the trait already guarantees.
    fn send_async(&self, tensor: &Tensor, dst: usize, _tag: u64) -> Result<Work, CommError> {
        let dtype = self.check_tensor(tensor, "tensor")?;
        self.check_peer(dst, "send destination")?;
        if dst == self.rank {
            return Err(CommError::InvalidArgument(format!(
                "send to itself (rank {dst}) would never be matched by NCCL; copy locally"
            )));
        }
        let count = tensor.numel();
        let ptr = tensor.data_ptr();
        self.launch(
            OpKind::Send,
            Seq::Send(dst),
            vec![tensor.size()],
            Some(dtype),
            Some(dst),
            vec![tensor.shallow_clone()],
            |api, comm, stream| {
                // SAFETY: dense CUDA buffer of `count` elements kept alive by the Work; `dst`
                // is a rank (< size, fits c_int).
                let rc = unsafe {
                    (api.send)(ptr, count, nccl_dtype(dtype), dst as c_int, comm, stream)
                };
                check(api, rc, Some(comm), "ncclSend")
            },
        )
    }

    /// `tag` is not used, as for [`NcclGroup::send_async`].
    fn recv_async(&self, tensor: &Tensor, src: usize, _tag: u64) -> Result<Work, CommError> {
        let dtype = self.check_tensor(tensor, "tensor")?;
        self.check_peer(src, "recv source")?;
        if src == self.rank {
            return Err(CommError::InvalidArgument(format!(
                "recv from itself (rank {src}) would never be matched by NCCL; copy locally"
            )));
        }
        let count = tensor.numel();
        let ptr = tensor.data_ptr();
        self.launch(
            OpKind::Recv,
            Seq::Recv(src),
            vec![tensor.size()],
            Some(dtype),
            Some(src),
            vec![tensor.shallow_clone()],
            |api, comm, stream| {
                // SAFETY: dense CUDA buffer of `count` elements kept alive by the Work; `src`
                // is a rank (< size, fits c_int).
                let rc = unsafe {
                    (api.recv)(ptr, count, nccl_dtype(dtype), src as c_int, comm, stream)
                };
                check(api, rc, Some(comm), "ncclRecv")
            },
        )
    }

    fn barrier_async(&self) -> Result<Work, CommError> {
        let token = Tensor::f_zeros([1], (Kind::Float, Device::Cuda(self.device)))?;
        let ptr = token.data_ptr();
        self.launch(
            OpKind::Barrier,
            Seq::Collective,
            vec![vec![1]],
            Some(DType::F32),
            None,
            vec![token],
            |api, comm, stream| {
                // SAFETY: a one-element f32 CUDA buffer kept alive by the Work.
                let rc = unsafe {
                    (api.all_reduce)(
                        ptr,
                        ptr,
                        1,
                        ncclDataType_t::ncclFloat32,
                        ncclRedOp_t::ncclSum,
                        comm,
                        stream,
                    )
                };
                check(api, rc, Some(comm), "ncclAllReduce (barrier)")
            },
        )
    }
}
