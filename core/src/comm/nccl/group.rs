//! [`NcclGroup`]: joining a communicator through the store, checking tensors, and the one
//! launch path every operation goes through (device sync, group lock, flight recorder,
//! enqueue on the group's stream, completion event).
//!
//! Apart from the collectives themselves ([`super::collectives`]), which only describe what
//! to enqueue, and from the completion handles ([`super::completion`]).

use super::api::{api, check, cuda_error, synchronize_compute_stream, NcclApi, UNIQUE_ID_BYTES};
use super::communicator::{CommHandle, CommState, Shared};
use super::completion::NcclWork;
use crate::comm::flight::{self, OpState};
use crate::comm::work::lock;
use crate::comm::{CommError, DType, OpKind, ProcessGroup, StoreClient, Work};
use cudarc::driver::CudaContext;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclUniqueId};
use std::ffi::{c_char, c_int};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use tch::{Device, Tensor};

/// Which counter an operation's flight-recorder sequence number comes from.
pub(super) enum Seq {
    Collective,
    Send(usize),
    Recv(usize),
}

/// NCCL process group (one communicator per group).
///
/// Runs the [`ProcessGroup`] collectives on CUDA tensors of one device with NCCL; see the
/// [module documentation](super) for how it is synchronized with libtorch.
pub struct NcclGroup {
    pub(super) shared: Arc<Shared>,
    pub(super) rank: usize,
    pub(super) global_ranks: Vec<usize>,
    pub(super) device: usize,
}

impl NcclGroup {
    /// Group rank 0 creates the NCCL unique id and publishes it in the store under
    /// `{key}/nccl_id`; the others wait for it (`store.get`) and every member initializes the
    /// communicator on CUDA device `device`.
    ///
    /// Collective over the group: it returns once every member joined. `key` must be unique per
    /// group creation, or a member may pick up a stale id.
    pub fn connect(
        store: &StoreClient,
        key: &str,
        name: String,
        group_rank: usize,
        global_ranks: Vec<usize>,
        device: usize,
    ) -> Result<NcclGroup, CommError> {
        let size = global_ranks.len();
        if size == 0 || group_rank >= size {
            return Err(CommError::InvalidArgument(format!(
                "group {name}: rank {group_rank} is not within a group of {size} ranks"
            )));
        }
        if c_int::try_from(size).is_err() {
            return Err(CommError::InvalidArgument(format!(
                "group {name}: {size} ranks is more than NCCL supports"
            )));
        }
        let api = api()?;
        // cudarc's driver loader panics when libcuda is absent; ask first.
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CommError::Nccl(format!(
                "group {name}: the CUDA driver library (libcuda.so.1) cannot be loaded; \
                 is there a GPU and an NVIDIA driver on this machine?"
            )));
        }
        // The primary context: the one libtorch (through the runtime API) works in. Binding it
        // to this thread also makes `device` the runtime's current device, which is the device
        // ncclCommInitRank picks.
        let ctx = CudaContext::new(device).map_err(cuda_error("opening the primary context"))?;

        let id_key = format!("{key}/nccl_id");
        let id = if group_rank == 0 {
            let mut id = ncclUniqueId {
                internal: [0; UNIQUE_ID_BYTES],
            };
            // SAFETY: writes one ncclUniqueId.
            check(
                api,
                unsafe { (api.get_unique_id)(&mut id) },
                None,
                "ncclGetUniqueId",
            )?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| c.to_ne_bytes()[0]).collect();
            store.set(&id_key, &bytes)?;
            id
        } else {
            let bytes = store.get(&id_key)?;
            if bytes.len() != UNIQUE_ID_BYTES {
                return Err(CommError::Nccl(format!(
                    "group {name}: store key {id_key:?} holds {} bytes, not an NCCL unique id \
                     ({UNIQUE_ID_BYTES} bytes)",
                    bytes.len()
                )));
            }
            let mut id = ncclUniqueId {
                internal: [0; UNIQUE_ID_BYTES],
            };
            for (dst, src) in id.internal.iter_mut().zip(&bytes) {
                *dst = c_char::from_ne_bytes([*src]);
            }
            id
        };

        let stream = ctx
            .new_stream()
            .map_err(cuda_error("creating the NCCL stream"))?;
        ctx.bind_to_thread()
            .map_err(cuda_error("binding the primary context"))?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` receives the new communicator; size/rank were checked to fit c_int.
        let rc = unsafe { (api.comm_init_rank)(&mut comm, size as c_int, id, group_rank as c_int) };
        check(
            api,
            rc,
            None,
            &format!("ncclCommInitRank (group {name}, rank {group_rank} of {size}, cuda:{device})"),
        )?;
        Ok(NcclGroup {
            shared: Arc::new(Shared {
                name,
                api,
                ctx,
                stream,
                state: Mutex::new(CommState {
                    comm: CommHandle(comm),
                    aborted: None,
                    seq: 0,
                    send_seq: vec![0; size],
                    recv_seq: vec![0; size],
                }),
            }),
            rank: group_rank,
            global_ranks,
            device,
        })
    }

    /// The CUDA device this group's communicator runs on; tensors must live there.
    pub fn device(&self) -> usize {
        self.device
    }

    /// Checks that `t` can be handed to NCCL as one dense buffer on this group's device.
    pub(super) fn check_tensor(&self, t: &Tensor, what: &str) -> Result<DType, CommError> {
        let name = &self.shared.name;
        match t.device() {
            Device::Cuda(d) if d == self.device => {}
            Device::Cuda(d) => {
                return Err(CommError::InvalidArgument(format!(
                    "{what} is on cuda:{d} but NCCL group {name} runs on cuda:{}",
                    self.device
                )))
            }
            other => {
                return Err(CommError::InvalidArgument(format!(
                    "{what} is on {other:?}; the NCCL backend (group {name}) needs CUDA tensors on \
                     cuda:{} (use the cpu backend for host tensors)",
                    self.device
                )))
            }
        }
        if !t.is_contiguous() {
            return Err(CommError::InvalidArgument(format!(
                "{what} is not contiguous (NCCL reads and writes one dense buffer); pass \
                 .contiguous() and copy the result back"
            )));
        }
        DType::from_kind(t.kind())
    }

    /// Checks that `output` and `input` have the same dtype and returns it.
    pub(super) fn check_pair(&self, output: &Tensor, input: &Tensor) -> Result<DType, CommError> {
        let out = self.check_tensor(output, "output")?;
        let inp = self.check_tensor(input, "input")?;
        if out != inp {
            return Err(CommError::InvalidArgument(format!(
                "output is {out} but input is {inp}; they must match"
            )));
        }
        Ok(out)
    }

    /// Checks a peer or root rank.
    pub(super) fn check_peer(&self, peer: usize, what: &str) -> Result<(), CommError> {
        if peer >= self.size() {
            return Err(CommError::InvalidArgument(format!(
                "{what} {peer} is not a rank of group {} (size {})",
                self.shared.name,
                self.size()
            )));
        }
        Ok(())
    }

    /// Enqueues one operation: waits for libtorch's compute stream, takes the group lock (program order),
    /// records it in the flight recorder, runs `enqueue` on the group's stream and returns a
    /// `Work` that completes with the event recorded after it and keeps `keep` alive till then.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch<F>(
        &self,
        op: OpKind,
        seq: Seq,
        shapes: Vec<Vec<i64>>,
        dtype: Option<DType>,
        peer: Option<usize>,
        keep: Vec<Tensor>,
        enqueue: F,
    ) -> Result<Work, CommError>
    where
        F: FnOnce(&NcclApi, ncclComm_t, cudaStream_t) -> Result<(), CommError>,
    {
        let shared = &self.shared;
        // Outside the group lock, so a waiter can still take it to check for asynchronous
        // NCCL errors while the compute stream drains.
        // A failure is reported below, once the operation is in the flight recorder.
        let synced = shared
            .ctx
            .bind_to_thread()
            .map_err(cuda_error("binding the primary context"))
            .and_then(|_| synchronize_compute_stream(self.device));
        let mut state = lock(&shared.state);
        if let Some(reason) = &state.aborted {
            return Err(CommError::Nccl(format!(
                "group {}: the communicator was aborted after an earlier failure: {reason}",
                shared.name
            )));
        }
        let seq = match seq {
            Seq::Collective => {
                state.seq += 1;
                state.seq
            }
            Seq::Send(p) => {
                state.send_seq[p] += 1;
                state.send_seq[p]
            }
            Seq::Recv(p) => {
                state.recv_seq[p] += 1;
                state.recv_seq[p]
            }
        };
        let id = flight::record(
            &shared.name,
            seq,
            op,
            shapes,
            dtype,
            peer,
            crate::comm::label::current(),
        );
        let comm = state.comm.0;
        let enqueued = (|| {
            synced?; // the primary context is bound with it
            let stream: cudaStream_t = shared.stream.cu_stream().cast();
            enqueue(shared.api, comm, stream)?;
            shared
                .stream
                .record_event(None)
                .map_err(cuda_error("recording the completion event"))
        })();
        drop(state);
        match enqueued {
            Ok(event) => {
                flight::update(id, OpState::Started);
                Ok(Work::new(Arc::new(NcclWork {
                    shared: Arc::clone(shared),
                    event,
                    flight_id: id,
                    what: format!("{op} #{seq} on group {}", shared.name),
                    keep_alive: Mutex::new(keep),
                    outcome: Mutex::new(None),
                    done: AtomicBool::new(false),
                    also_completes: Vec::new(),
                })))
            }
            Err(e) => {
                flight::update(id, OpState::Failed(e.to_string()));
                Err(e)
            }
        }
    }
}
