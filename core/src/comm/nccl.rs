//! The NCCL backend (cargo feature `nccl`): the engine for CUDA tensors on GPU runners.
//!
//! One NCCL communicator per [`NcclGroup`]. Group rank 0 creates the NCCL unique id and
//! publishes it through the rendezvous store; every member then joins with
//! `ncclCommInitRank` on its CUDA device. Collectives map one to one onto NCCL calls;
//! `all_to_all` with uneven splits is a grouped set of `ncclSend`/`ncclRecv`, and the barrier is
//! an all-reduce of one element.
//!
//! # Synchronization (interim scheme)
//!
//! The design enqueues NCCL work on libtorch's *current* stream, but the C++ bridge that hands
//! us that stream does not exist yet. Until it does, this backend is synchronized conservatively
//! instead, so it is correct whatever stream libtorch used:
//!
//! 1. before enqueuing, the whole device is synchronized (`torch::cuda::synchronize`), so every
//!    kernel libtorch issued that produces the inputs has finished;
//! 2. the NCCL call is enqueued on a stream the group owns, created on the device's *primary*
//!    context (the one libtorch's runtime API uses), and a CUDA event is recorded after it;
//! 3. the returned [`Work`] completes once that event has completed; it keeps the tensors alive
//!    until then, so libtorch's caching allocator cannot recycle memory NCCL still uses, and
//!    dropping an unfinished `Work` waits for it for the same reason.
//!
//! The cost: each new operation waits for everything already queued on the device, including
//! the previous collective, so collectives overlap with compute issued after them but not with
//! each other. Waiting polls the event and `ncclCommGetAsyncError`; an asynchronous NCCL error
//! (a peer died, a network failure) aborts the communicator and fails this and every later
//! operation of the group instead of hanging.
//!
//! Unlike the CPU backend, mismatched shapes across ranks are not detected here (NCCL has no
//! cheap way to compare them): they hang or produce garbage, and the flight recorder is what
//! explains them. Two ranks of one group must be on different GPUs (an NCCL rule).
//!
//! # Finding libnccl
//!
//! See [`nccl_version`] and `load_api`: cudarc's dynamic loader never tries `libnccl.so.2`, so
//! this module loads NCCL itself and calls it through its own table of entry points, using
//! cudarc's `nccl::sys` definitions for the ABI types and cudarc's driver API for contexts,
//! streams and events.
//!
//! This backend has been compiled but never run on a GPU: the machines that build it have none.

use crate::comm::flight::{self, OpState};
use crate::comm::work::lock;
use crate::comm::{
    CommError, Completion, DType, OpKind, ProcessGroup, ReduceOp, StoreClient, Work,
};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, TryLockError};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// NCCL's `ncclInProgress`: what `ncclCommGetAsyncError` reports while a non-blocking
/// operation is still running; not an error.
const NCCL_IN_PROGRESS: c_int = 7;

/// Bytes in an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
const UNIQUE_ID_BYTES: usize = 128;

// ---------------------------------------------------------------------------------------------
// Loading libnccl
// ---------------------------------------------------------------------------------------------

type GetVersionFn = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueIdFn = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRankFn = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int;
type CommFn = unsafe extern "C" fn(ncclComm_t) -> c_int;
type CommGetAsyncErrorFn = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int;
type GetErrorStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
type GetLastErrorFn = unsafe extern "C" fn(ncclComm_t) -> *const c_char;
type ReduceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type AllGatherFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type BroadcastFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type SendFn = unsafe extern "C" fn(
    *const c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type RecvFn = unsafe extern "C" fn(
    *mut c_void,
    usize,
    ncclDataType_t,
    c_int,
    ncclComm_t,
    cudaStream_t,
) -> c_int;
type GroupFn = unsafe extern "C" fn() -> c_int;

/// The NCCL entry points this backend uses, resolved from the library `load_api` opened.
///
/// Results are declared as `c_int` rather than cudarc's `ncclResult_t` enum so that a code a
/// newer NCCL adds can never be an invalid Rust enum value.
struct NcclApi {
    /// Where the library was found, for messages.
    path: String,
    get_version: GetVersionFn,
    get_unique_id: GetUniqueIdFn,
    comm_init_rank: CommInitRankFn,
    comm_destroy: CommFn,
    comm_abort: CommFn,
    comm_get_async_error: CommGetAsyncErrorFn,
    get_error_string: GetErrorStringFn,
    /// Added in NCCL 2.13; optional so older libraries still load.
    get_last_error: Option<GetLastErrorFn>,
    all_reduce: ReduceFn,
    reduce_scatter: ReduceFn,
    all_gather: AllGatherFn,
    broadcast: BroadcastFn,
    send: SendFn,
    recv: RecvFn,
    group_start: GroupFn,
    group_end: GroupFn,
}

/// Where libnccl may be, best first.
///
/// cudarc's loader (`cudarc::nccl::sys::culib`) tries `libnccl.so`, `libnccl.so.<cuda major>`
/// and a few historical names, but never `libnccl.so.2`, the name NCCL actually installs under
/// (its SONAME) and the only one the torch wheel ships. Pre-loading the library by full path
/// does not help: glibc matches a later `dlopen("libnccl.so")` against loaded objects by SONAME
/// or by the exact name they were opened with, and the library search path (LD_LIBRARY_PATH)
/// is fixed at process start, so cudarc would still fail, and it fails by panicking. So this
/// module opens the library itself and never calls cudarc's NCCL functions:
///
/// 1. `libnccl.so.2` by name: matches the copy libtorch_cuda already loaded through its RUNPATH
///    (so the process holds a single NCCL), else searches LD_LIBRARY_PATH and the system paths;
/// 2. the torch wheel's copy next to libtorch, `$LIBTORCH/../nvidia/nccl/lib/libnccl.so.2`,
///    with `LIBTORCH` read at run time and, failing that, as it was when this crate was built;
/// 3. `libnccl.so.2` in every LD_LIBRARY_PATH directory as it is now;
/// 4. cudarc's own candidate names (a system NCCL with its development symlink).
fn library_candidates() -> Vec<String> {
    let mut out = vec!["libnccl.so.2".to_owned()];
    let mut torch_dirs: Vec<String> = Vec::new();
    if let Ok(dir) = std::env::var("LIBTORCH") {
        torch_dirs.push(dir);
    }
    if let Some(dir) = option_env!("LIBTORCH") {
        torch_dirs.push(dir.to_owned());
    }
    for dir in torch_dirs {
        let path = std::path::Path::new(&dir).join("../nvidia/nccl/lib/libnccl.so.2");
        out.push(path.to_string_lossy().into_owned());
    }
    if let Ok(paths) = std::env::var("LD_LIBRARY_PATH") {
        for dir in paths.split(':').filter(|d| !d.is_empty()) {
            let path = std::path::Path::new(dir).join("libnccl.so.2");
            out.push(path.to_string_lossy().into_owned());
        }
    }
    out.extend(cudarc::get_lib_name_candidates("nccl"));
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| seen.insert(c.clone()));
    out
}

/// The text of the calling thread's last `dlopen`/`dlsym` error.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated thread-local string.
    let ptr = unsafe { libc::dlerror() };
    if ptr.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated (see above); copied before any other dl call.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    }
}

/// Resolves one symbol as a function pointer of type `$ty`, or returns a message naming it.
macro_rules! resolve {
    ($handle:expr, $path:expr, $name:literal, $ty:ty) => {{
        // SAFETY: `$handle` is a live handle from dlopen and the name is NUL-terminated.
        let ptr = unsafe { libc::dlsym($handle, $name.as_ptr()) };
        if ptr.is_null() {
            return Err(format!(
                "{} has no symbol {}: {}",
                $path,
                $name.to_string_lossy(),
                dl_error()
            ));
        }
        // SAFETY: the symbol is the NCCL function of that name, whose C signature `$ty`
        // restates (as cudarc's bindings do).
        unsafe { std::mem::transmute::<*mut c_void, $ty>(ptr) }
    }};
}

/// Opens libnccl (see `library_candidates`) and resolves every entry point. The library is
/// never closed: the function pointers live for the whole process.
fn load_api() -> Result<NcclApi, String> {
    let mut tried = Vec::new();
    for candidate in library_candidates() {
        let Ok(cname) = CString::new(candidate.as_str()) else {
            continue;
        };
        // SAFETY: dlopen with a NUL-terminated name; NCCL's initializers are safe to run.
        let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            tried.push(format!("{candidate} ({})", dl_error()));
            continue;
        }
        let path = candidate;
        // SAFETY: `handle` is live; a null result only means the symbol is absent.
        let last_error = unsafe { libc::dlsym(handle, c"ncclGetLastError".as_ptr()) };
        let get_last_error = if last_error.is_null() {
            None
        } else {
            // SAFETY: `ncclGetLastError` has this C signature.
            Some(unsafe { std::mem::transmute::<*mut c_void, GetLastErrorFn>(last_error) })
        };
        return Ok(NcclApi {
            get_version: resolve!(handle, path, c"ncclGetVersion", GetVersionFn),
            get_unique_id: resolve!(handle, path, c"ncclGetUniqueId", GetUniqueIdFn),
            comm_init_rank: resolve!(handle, path, c"ncclCommInitRank", CommInitRankFn),
            comm_destroy: resolve!(handle, path, c"ncclCommDestroy", CommFn),
            comm_abort: resolve!(handle, path, c"ncclCommAbort", CommFn),
            comm_get_async_error: resolve!(
                handle,
                path,
                c"ncclCommGetAsyncError",
                CommGetAsyncErrorFn
            ),
            get_error_string: resolve!(handle, path, c"ncclGetErrorString", GetErrorStringFn),
            get_last_error,
            all_reduce: resolve!(handle, path, c"ncclAllReduce", ReduceFn),
            reduce_scatter: resolve!(handle, path, c"ncclReduceScatter", ReduceFn),
            all_gather: resolve!(handle, path, c"ncclAllGather", AllGatherFn),
            broadcast: resolve!(handle, path, c"ncclBroadcast", BroadcastFn),
            send: resolve!(handle, path, c"ncclSend", SendFn),
            recv: resolve!(handle, path, c"ncclRecv", RecvFn),
            group_start: resolve!(handle, path, c"ncclGroupStart", GroupFn),
            group_end: resolve!(handle, path, c"ncclGroupEnd", GroupFn),
            path,
        });
    }
    Err(format!(
        "libnccl could not be loaded (install NCCL or the torch wheel's nvidia-nccl package, or \
         add its lib directory to LD_LIBRARY_PATH); tried: {}",
        tried.join("; ")
    ))
}

/// The process-wide NCCL entry points, loaded on first use.
fn api() -> Result<&'static NcclApi, CommError> {
    static API: OnceLock<Result<NcclApi, String>> = OnceLock::new();
    API.get_or_init(load_api)
        .as_ref()
        .map_err(|e| CommError::Nccl(e.clone()))
}

/// NCCL's version string if libnccl can be loaded (e.g. "2.29.7"), or an error saying why not.
///
/// Needs no GPU, so tools and tests can report which NCCL a GPU run would use, or why none
/// would be found, on any machine.
pub fn nccl_version() -> Result<String, CommError> {
    let api = api()?;
    let mut code: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    check(
        api,
        unsafe { (api.get_version)(&mut code) },
        None,
        "ncclGetVersion",
    )?;
    // NCCL encodes 2.9+ as major*10000 + minor*100 + patch, older ones as major*1000 + minor*100 + patch.
    let (major, minor, patch) = if code >= 10000 {
        (code / 10000, (code % 10000) / 100, code % 100)
    } else {
        (code / 1000, (code % 1000) / 100, code % 100)
    };
    Ok(format!("{major}.{minor}.{patch}"))
}

/// Turns an NCCL return code into a `CommError::Nccl` carrying NCCL's own description.
fn check(
    api: &NcclApi,
    code: c_int,
    comm: Option<ncclComm_t>,
    what: &str,
) -> Result<(), CommError> {
    if code == 0 {
        Ok(())
    } else {
        Err(CommError::Nccl(format!(
            "{what} failed: {}",
            describe(api, code, comm)
        )))
    }
}

/// NCCL's text for `code`, plus its last detailed error message when it has one.
fn describe(api: &NcclApi, code: c_int, comm: Option<ncclComm_t>) -> String {
    // SAFETY: ncclGetErrorString returns a static string (or null for unknown codes).
    let text = cstr(unsafe { (api.get_error_string)(code) });
    let mut out = format!("{} (code {code}, {})", text.unwrap_or_default(), api.path);
    if let Some(last) = api.get_last_error {
        // SAFETY: ncclGetLastError accepts any communicator or null and returns a string
        // owned by NCCL.
        let detail = cstr(unsafe { last(comm.unwrap_or(std::ptr::null_mut())) });
        if let Some(detail) = detail.filter(|d| !d.is_empty()) {
            out.push_str(": ");
            out.push_str(&detail);
        }
    }
    out
}

/// Copies a C string NCCL owns.
fn cstr(ptr: *const c_char) -> Option<String> {
    if ptr.is_null() {
        None
    } else {
        // SAFETY: NCCL returns NUL-terminated strings that stay valid during this call.
        Some(
            unsafe { CStr::from_ptr(ptr) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// `tch::Cuda::synchronize` without its panic: waits for every kernel on `device`, and returns
/// libtorch's error (e.g. an earlier asynchronous CUDA failure) instead of unwinding.
fn synchronize_device(device: usize) -> Result<(), CommError> {
    // SAFETY: plain libtorch C calls; the error string is owned by us and freed with free().
    unsafe {
        torch_sys::cuda::atc_synchronize(device as i64);
        let err = torch_sys::get_and_reset_last_err();
        if err.is_null() {
            return Ok(());
        }
        let text = CStr::from_ptr(err).to_string_lossy().into_owned();
        libc::free(err.cast());
        Err(CommError::Torch(tch::TchError::Torch(format!(
            "synchronizing cuda:{device} before an NCCL call: {text}"
        ))))
    }
}

/// A CUDA driver failure as a `CommError::Nccl`.
fn cuda_error(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CommError + '_ {
    move |e| CommError::Nccl(format!("CUDA driver error while {what}: {e}"))
}

// ---------------------------------------------------------------------------------------------
// The group
// ---------------------------------------------------------------------------------------------

/// A raw NCCL communicator; only ever used under `Shared::state`'s lock.
struct CommHandle(ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it are
// serialized, which the mutex around `CommState` guarantees.
unsafe impl Send for CommHandle {}

/// Mutable per-group state, behind one lock so that every rank enqueues in program order.
struct CommState {
    /// Null once aborted.
    comm: CommHandle,
    /// Why the communicator was aborted; every later operation fails with it.
    aborted: Option<String>,
    /// Collective sequence number (flight recorder).
    seq: u64,
    /// Point-to-point counters per peer (flight recorder): sends to, receives from.
    send_seq: Vec<u64>,
    recv_seq: Vec<u64>,
}

/// What pending work needs from its group; outlives the `NcclGroup` while work is pending.
struct Shared {
    name: String,
    api: &'static NcclApi,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    state: Mutex<CommState>,
}

impl Shared {
    /// Checks the communicator for an asynchronous error; on one, aborts it (so its kernels
    /// exit and the stream drains) and returns the reason. With `blocking == false` it gives
    /// up (returns `None`) when another thread holds the lock, e.g. while enqueuing.
    fn poll_async_error(&self, blocking: bool) -> Option<String> {
        let mut state = if blocking {
            lock(&self.state)
        } else {
            match self.state.try_lock() {
                Ok(guard) => guard,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return None,
            }
        };
        if let Some(reason) = &state.aborted {
            return Some(reason.clone());
        }
        let comm = state.comm.0;
        let mut code: c_int = 0;
        // SAFETY: `comm` is a live communicator (not aborted, under the lock).
        let rc = unsafe { (self.api.comm_get_async_error)(comm, &mut code) };
        let reason = if rc != 0 {
            format!(
                "ncclCommGetAsyncError failed: {}",
                describe(self.api, rc, Some(comm))
            )
        } else if code != 0 && code != NCCL_IN_PROGRESS {
            format!(
                "asynchronous NCCL error on group {}: {}",
                self.name,
                describe(self.api, code, Some(comm))
            )
        } else {
            return None;
        };
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `comm` is live; after this call it is never used again (nulled below).
        let abort_rc = unsafe { (self.api.comm_abort)(comm) };
        if abort_rc != 0 {
            tracing::warn!(group = %self.name, "ncclCommAbort failed with code {abort_rc}");
        }
        state.comm = CommHandle(std::ptr::null_mut());
        state.aborted = Some(reason.clone());
        Some(reason)
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        if state.comm.0.is_null() {
            return;
        }
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        // SAFETY: the communicator is live and no work references it any more (every `Work`
        // holds an `Arc<Shared>`).
        let rc = unsafe { (self.api.comm_destroy)(state.comm.0) };
        if rc != 0 {
            tracing::warn!(group = %self.name, "ncclCommDestroy failed: {}", describe(self.api, rc, None));
        }
        state.comm = CommHandle(std::ptr::null_mut());
    }
}

/// Which counter an operation's flight-recorder sequence number comes from.
enum Seq {
    Collective,
    Send(usize),
    Recv(usize),
}

/// NCCL process group (one communicator per group).
///
/// Runs the [`ProcessGroup`] collectives on CUDA tensors of one device with NCCL; see the
/// module documentation for how it is synchronized with libtorch.
pub struct NcclGroup {
    shared: Arc<Shared>,
    rank: usize,
    global_ranks: Vec<usize>,
    device: usize,
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
    fn check_tensor(&self, t: &Tensor, what: &str) -> Result<DType, CommError> {
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
    fn check_pair(&self, output: &Tensor, input: &Tensor) -> Result<DType, CommError> {
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
    fn check_peer(&self, peer: usize, what: &str) -> Result<(), CommError> {
        if peer >= self.size() {
            return Err(CommError::InvalidArgument(format!(
                "{what} {peer} is not a rank of group {} (size {})",
                self.shared.name,
                self.size()
            )));
        }
        Ok(())
    }

    /// Enqueues one operation: synchronizes the device, takes the group lock (program order),
    /// records it in the flight recorder, runs `enqueue` on the group's stream and returns a
    /// `Work` that completes with the event recorded after it and keeps `keep` alive till then.
    #[allow(clippy::too_many_arguments)]
    fn launch<F>(
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
        // NCCL errors while the device drains.
        // A failure is reported below, once the operation is in the flight recorder.
        let synced = synchronize_device(self.device);
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
            synced?;
            shared
                .ctx
                .bind_to_thread()
                .map_err(cuda_error("binding the primary context"))?;
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
                })))
            }
            Err(e) => {
                flight::update(id, OpState::Failed(e.to_string()));
                Err(e)
            }
        }
    }
}

/// The NCCL datatype carrying `d` (booleans travel as bytes).
fn nccl_dtype(d: DType) -> ncclDataType_t {
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

// ---------------------------------------------------------------------------------------------
// Completion
// ---------------------------------------------------------------------------------------------

/// An enqueued NCCL operation: done when the event recorded after it on the group's stream
/// completed. Holds the tensors so their memory outlives the kernels using it.
struct NcclWork {
    shared: Arc<Shared>,
    event: CudaEvent,
    flight_id: u64,
    what: String,
    keep_alive: Mutex<Vec<Tensor>>,
    /// The outcome once known; its lock also serializes concurrent waiters.
    outcome: Mutex<Option<Result<(), String>>>,
    done: AtomicBool,
}

impl NcclWork {
    /// Polls the event until it completes, failing on a CUDA error or an asynchronous NCCL
    /// error (which aborts the communicator so nothing spins forever).
    fn poll(&self) -> Result<(), CommError> {
        self.shared
            .ctx
            .bind_to_thread()
            .map_err(cuda_error("binding the primary context"))?;
        let mut spins = 0u32;
        loop {
            match self.event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    return Err(CommError::Nccl(format!(
                        "CUDA error while waiting for {}: {e}",
                        self.what
                    )))
                }
            }
            if let Some(reason) = self.shared.poll_async_error(false) {
                return Err(CommError::Nccl(format!("{} failed: {reason}", self.what)));
            }
            if spins < 1000 {
                spins += 1;
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }

    /// Waits once, records the outcome (flight recorder included) and releases the tensors.
    fn finish(&self) -> Result<(), String> {
        let mut outcome = lock(&self.outcome);
        if let Some(result) = outcome.as_ref() {
            return result.clone();
        }
        let result = self.poll().map_err(|e| e.to_string());
        match &result {
            Ok(()) => flight::update(self.flight_id, OpState::Completed),
            Err(e) => flight::update(self.flight_id, OpState::Failed(e.clone())),
        }
        lock(&self.keep_alive).clear();
        *outcome = Some(result.clone());
        self.done.store(true, Ordering::Release);
        result
    }
}

impl Completion for NcclWork {
    fn wait(&self) -> Result<(), CommError> {
        self.finish().map_err(CommError::Nccl)
    }

    fn is_completed(&self) -> bool {
        if self.done.load(Ordering::Acquire) {
            return true;
        }
        if self.shared.ctx.bind_to_thread().is_err() {
            return true; // `wait` reports the error
        }
        match self.event.try_is_complete() {
            Ok(false) => self.shared.poll_async_error(false).is_some(),
            Ok(true) | Err(_) => true,
        }
    }
}

impl Drop for NcclWork {
    /// Dropping unfinished work waits for it: NCCL may still read or write the tensors, and
    /// releasing them early would let libtorch's allocator hand that memory to other tensors.
    fn drop(&mut self) {
        if !self.done.load(Ordering::Acquire) {
            if let Err(e) = self.finish() {
                tracing::warn!("dropped NCCL work failed: {e}");
            }
        }
    }
}
