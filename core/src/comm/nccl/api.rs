//! Loading libnccl and calling it: the table of NCCL entry points this backend resolves
//! itself (cudarc's loader never tries `libnccl.so.2`), NCCL's error codes as
//! [`CommError`]s, and the two CUDA helpers every launch needs.
//!
//! Apart from the group because it is the only code that touches `dlopen` and NCCL's raw
//! ABI; everything above it calls NCCL through [`NcclApi`]'s function pointers.

use crate::comm::CommError;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;

/// NCCL's `ncclInProgress`: what `ncclCommGetAsyncError` reports while a non-blocking
/// operation is still running; not an error.
pub(super) const NCCL_IN_PROGRESS: c_int = 7;

/// Bytes in an `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
pub(super) const UNIQUE_ID_BYTES: usize = 128;

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
pub(super) struct NcclApi {
    /// Where the library was found, for messages.
    pub(super) path: String,
    pub(super) get_version: GetVersionFn,
    pub(super) get_unique_id: GetUniqueIdFn,
    pub(super) comm_init_rank: CommInitRankFn,
    pub(super) comm_destroy: CommFn,
    pub(super) comm_abort: CommFn,
    pub(super) comm_get_async_error: CommGetAsyncErrorFn,
    pub(super) get_error_string: GetErrorStringFn,
    /// Added in NCCL 2.13; optional so older libraries still load.
    pub(super) get_last_error: Option<GetLastErrorFn>,
    pub(super) all_reduce: ReduceFn,
    pub(super) reduce_scatter: ReduceFn,
    pub(super) all_gather: AllGatherFn,
    pub(super) broadcast: BroadcastFn,
    pub(super) send: SendFn,
    pub(super) recv: RecvFn,
    pub(super) group_start: GroupFn,
    pub(super) group_end: GroupFn,
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
pub(super) fn api() -> Result<&'static NcclApi, CommError> {
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
pub(super) fn check(
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
pub(super) fn describe(api: &NcclApi, code: c_int, comm: Option<ncclComm_t>) -> String {
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

/// Waits for every kernel libtorch queued on its current stream of `device` (the one the
/// inputs of an NCCL operation were computed on), and nothing else: NCCL operations still
/// pending on the groups' own streams (a send whose receive is not posted yet) must not block
/// the next one, or a rank that sends ahead (as the pipeline executor does) would hang as on
/// a buffered-send assumption. The caller binds the device's primary context.
pub(super) fn synchronize_compute_stream(device: usize) -> Result<(), CommError> {
    let stream = crate::autograd::current_cuda_stream(device).map_err(|e| {
        CommError::Nccl(format!(
            "reading libtorch's current stream on cuda:{device} before an NCCL call: {e}"
        ))
    })?;
    // SAFETY: a stream handle libtorch owns for the life of the process; the primary context
    // of its device is bound to this thread by the caller.
    unsafe { cudarc::driver::result::stream::synchronize(stream.cast()) }.map_err(|e| {
        CommError::Nccl(format!(
            "synchronizing libtorch's current stream on cuda:{device} before an NCCL call: {e}"
        ))
    })
}

/// A CUDA driver failure as a `CommError::Nccl`.
pub(super) fn cuda_error(what: &str) -> impl FnOnce(cudarc::driver::DriverError) -> CommError + '_ {
    move |e| CommError::Nccl(format!("CUDA driver error while {what}: {e}"))
}
