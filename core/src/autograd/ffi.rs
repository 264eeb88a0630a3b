//! Raw declarations of the C++ bridge (`core/cpp/bridge.cpp`) and the glue that turns its
//! status reports and Rust callback failures into [`AutogradError`]s.
//!
//! Conventions shared with the C++ side: every `lk_*` function returns 0 on success and 1 on
//! failure with `lk_status` filled; tensors passed in are borrowed (`*const C_tensor`, i.e.
//! `at::Tensor*`), tensors passed out are fresh heap `at::Tensor`s this side owns through
//! [`tch::Tensor::from_ptr`]. Callbacks return 0/1 and never unwind.

use super::{AutogradError, Stage};
use std::any::Any;
use std::ffi::{c_char, c_int, c_long, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tch::Tensor;
use torch_sys::C_tensor;

/// Drop function for a piece of Rust state owned by C++.
pub(crate) type DropFn = unsafe extern "C" fn(*mut c_void);

/// A failure reported by an `lk_*` entry point.
#[repr(C)]
pub(crate) struct Status {
    pub message: *mut c_char,
    pub rust_error: *mut c_void,
}

/// A failure a Rust callback hands to C++: an owned payload and how to drop it, and the
/// error's text (`malloc`'d; C++ frees it), which survives where libtorch's engine rethrows
/// the exception as its own and the payload is lost.
#[repr(C)]
pub(crate) struct CallbackError {
    pub payload: *mut c_void,
    pub drop: Option<DropFn>,
    pub message: *mut c_char,
}

pub(crate) type BackwardFn = unsafe extern "C" fn(
    state: *mut c_void,
    saved: *mut *mut C_tensor,
    n_saved: usize,
    grads: *mut *mut C_tensor,
    n_grads: usize,
    needs_input_grad: *const u8,
    n_inputs: usize,
    out_vec: *mut c_void,
    err: *mut CallbackError,
) -> c_int;

pub(crate) type HookFn = unsafe extern "C" fn(
    state: *mut c_void,
    grad: *mut C_tensor,
    out_vec: *mut c_void,
    err: *mut CallbackError,
) -> c_int;

pub(crate) type PostAccFn = unsafe extern "C" fn(
    state: *mut c_void,
    tensor: *mut C_tensor,
    err: *mut CallbackError,
) -> c_int;

extern "C" {
    pub(crate) fn lk_free_string(s: *mut c_char);
    pub(crate) fn lk_cpu_capability(out: *mut *mut c_char, st: *mut Status) -> c_int;
    pub(crate) fn lk_set_numerics(want: *const LkNumerics, st: *mut Status) -> c_int;
    pub(crate) fn lk_get_numerics(out: *mut LkNumerics, st: *mut Status) -> c_int;
    pub(crate) fn lk_cuda_versions(
        cudart: *mut c_long,
        cudnn: *mut c_long,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_vec_push(vec: *mut c_void, t: *const C_tensor, st: *mut Status) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lk_function_apply(
        inputs: *const *const C_tensor,
        n_inputs: usize,
        outputs: *const *const C_tensor,
        n_outputs: usize,
        saved: *const *const C_tensor,
        n_saved: usize,
        non_differentiable: *const usize,
        n_non_differentiable: usize,
        materialize_grads: c_int,
        state: *mut c_void,
        backward: BackwardFn,
        drop: DropFn,
        results: *mut *mut C_tensor,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_backward(
        outputs: *const *const C_tensor,
        n_outputs: usize,
        grad_outputs: *const *const C_tensor,
        retain_graph: c_int,
        create_graph: c_int,
        st: *mut Status,
    ) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lk_grad(
        outputs: *const *const C_tensor,
        n_outputs: usize,
        grad_outputs: *const *const C_tensor,
        inputs: *const *const C_tensor,
        n_inputs: usize,
        retain_graph: c_int,
        create_graph: c_int,
        allow_unused: c_int,
        results: *mut *mut C_tensor,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_set_grad(t: *const C_tensor, grad: *const C_tensor, st: *mut Status) -> c_int;
    pub(crate) fn lk_register_hook(
        t: *const C_tensor,
        state: *mut c_void,
        hook: HookFn,
        drop: DropFn,
        handle_out: *mut *mut c_void,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_register_post_accumulate_grad_hook(
        t: *const C_tensor,
        state: *mut c_void,
        hook: PostAccFn,
        drop: DropFn,
        handle_out: *mut *mut c_void,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_hook_remove(
        handle: *mut c_void,
        removed: *mut c_int,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_hook_handle_free(handle: *mut c_void);
    pub(crate) fn lk_storage_free(
        t: *const C_tensor,
        released: *mut usize,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_storage_info(
        t: *const C_tensor,
        nbytes: *mut usize,
        freed: *mut c_int,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_storage_refill(
        t: *const C_tensor,
        src: *const C_tensor,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_tensor_version(
        t: *const C_tensor,
        version: *mut i64,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_add_scaled_(
        t: *const C_tensor,
        other: *const C_tensor,
        alpha: f64,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_addcmul_(
        t: *const C_tensor,
        a: *const C_tensor,
        b: *const C_tensor,
        value: f64,
        st: *mut Status,
    ) -> c_int;
    pub(crate) fn lk_addcdiv_(
        t: *const C_tensor,
        a: *const C_tensor,
        b: *const C_tensor,
        value: f64,
        st: *mut Status,
    ) -> c_int;
    #[cfg(feature = "nccl")]
    pub(crate) fn lk_current_cuda_stream(
        device: i64,
        stream: *mut *mut c_void,
        st: *mut Status,
    ) -> c_int;
}

impl Status {
    pub(crate) fn new() -> Self {
        Status {
            message: std::ptr::null_mut(),
            rust_error: std::ptr::null_mut(),
        }
    }

    /// Turns an entry point's return code and status into a result, taking ownership of
    /// whatever the status carries.
    pub(crate) fn check(mut self, rc: c_int) -> Result<(), AutogradError> {
        let err = self.take_error();
        match (rc, err) {
            (0, None) => Ok(()),
            (0, Some(e)) => Err(e),
            (_, Some(e)) => Err(e),
            (_, None) => Err(AutogradError::Torch(
                "bridge reported a failure without a message".into(),
            )),
        }
    }

    fn take_error(&mut self) -> Option<AutogradError> {
        if !self.rust_error.is_null() {
            // SAFETY: `rust_error` is a payload `error_payload` created from a
            // `Box<AutogradError>`; the C++ side gave up ownership when it put it here.
            let err = unsafe { Box::from_raw(self.rust_error.cast::<AutogradError>()) };
            self.rust_error = std::ptr::null_mut();
            return Some(*err);
        }
        if !self.message.is_null() {
            // SAFETY: a NUL-terminated string malloc'd by the bridge, freed once below.
            let msg = unsafe { CStr::from_ptr(self.message) }
                .to_string_lossy()
                .into_owned();
            // SAFETY: as above; nulled so Drop does not free it again.
            unsafe { lk_free_string(self.message) };
            self.message = std::ptr::null_mut();
            return Some(AutogradError::Torch(msg));
        }
        None
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        let _ = self.take_error();
    }
}

/// Calls an `lk_*` function with a fresh status and checks it.
pub(crate) fn call(f: impl FnOnce(*mut Status) -> c_int) -> Result<(), AutogradError> {
    let mut st = Status::new();
    let rc = f(&mut st);
    st.check(rc)
}

/// `at::get_cpu_capability()`: the CPU capability ATen dispatches its kernels to.
pub(crate) fn cpu_capability() -> Result<String, AutogradError> {
    let mut out: *mut c_char = std::ptr::null_mut();
    // SAFETY: `out` is a valid slot; on success the bridge fills it with a malloc'd string.
    call(|st| unsafe { lk_cpu_capability(&mut out, st) })?;
    if out.is_null() {
        return Err(AutogradError::Torch(
            "the bridge returned no CPU capability".into(),
        ));
    }
    // SAFETY: a NUL-terminated string malloc'd by the bridge, freed once right after.
    let text = unsafe { CStr::from_ptr(out) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: as above.
    unsafe { lk_free_string(out) };
    Ok(text)
}

/// `lk_numerics` of the bridge: libtorch's global numerics switches, one C int each.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LkNumerics {
    pub deterministic_algorithms: c_int,
    pub deterministic_cudnn: c_int,
    pub benchmark_cudnn: c_int,
    pub tf32_cublas: c_int,
    pub tf32_cudnn: c_int,
}

/// Sets libtorch's global numerics switches (`at::globalContext()`).
pub(crate) fn set_numerics(want: LkNumerics) -> Result<(), AutogradError> {
    // SAFETY: `want` is a valid struct for the duration of the call.
    call(|st| unsafe { lk_set_numerics(&want, st) })
}

/// Reads libtorch's global numerics switches.
pub(crate) fn numerics() -> Result<LkNumerics, AutogradError> {
    let mut out = LkNumerics::default();
    // SAFETY: `out` is a valid slot the bridge fills.
    call(|st| unsafe { lk_get_numerics(&mut out, st) })?;
    Ok(out)
}

/// The CUDA runtime and cuDNN versions libtorch loads (0 for each it lacks).
pub(crate) fn cuda_versions() -> Result<(i64, i64), AutogradError> {
    let (mut cudart, mut cudnn): (c_long, c_long) = (0, 0);
    // SAFETY: both slots are valid for the duration of the call.
    call(|st| unsafe { lk_cuda_versions(&mut cudart, &mut cudnn, st) })?;
    #[allow(clippy::useless_conversion)] // c_long is i64 on the 64-bit targets libtorch ships for
    Ok((i64::from(cudart), i64::from(cudnn)))
}

/// Drops a `Box<AutogradError>` payload the C++ side discarded.
unsafe extern "C" fn drop_error_payload(p: *mut c_void) {
    // Dropping an error cannot run user code that panics, but stay defensive.
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: created by `error_payload` from a `Box<AutogradError>`.
        drop(unsafe { Box::from_raw(p.cast::<AutogradError>()) });
    }));
}

/// Stores `err` in a callback's error slot and returns the failure code.
///
/// # Safety
/// `slot` must be the valid `lk_err*` the bridge passed to the callback.
pub(crate) unsafe fn report(slot: *mut CallbackError, err: AutogradError) -> c_int {
    let message = malloc_string(&err.to_string());
    let payload = Box::into_raw(Box::new(err)).cast::<c_void>();
    // SAFETY: guaranteed by the caller.
    unsafe {
        (*slot).payload = payload;
        (*slot).drop = Some(drop_error_payload);
        (*slot).message = message;
    }
    1
}

/// `text` as a NUL-terminated C string from `malloc`, for C++ to `free` (null if the
/// allocation fails: the message is then missing, never the error).
fn malloc_string(text: &str) -> *mut c_char {
    let bytes: Vec<u8> = text.bytes().filter(|&b| b != 0).collect();
    // SAFETY: a fresh allocation of len + 1 bytes, filled below before C++ reads it.
    let p = unsafe { libc::malloc(bytes.len() + 1) }.cast::<u8>();
    if !p.is_null() {
        // SAFETY: `p` holds len + 1 bytes and does not overlap `bytes`.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
            *p.add(bytes.len()) = 0;
        }
    }
    p.cast::<c_char>()
}

/// Runs a callback body, converting its error or panic into a failure code for C++.
///
/// # Safety
/// `slot` must be the valid `lk_err*` the bridge passed to the callback.
pub(crate) unsafe fn guard(
    stage: Stage,
    slot: *mut CallbackError,
    body: impl FnOnce() -> Result<(), AutogradError>,
) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => 0,
        // SAFETY: forwarded from the caller.
        Ok(Err(e)) => unsafe { report(slot, e) },
        // SAFETY: forwarded from the caller.
        Err(p) => unsafe { report(slot, AutogradError::panic(stage, p)) },
    }
}

/// Drops Rust state on behalf of C++, swallowing (and reporting) a panic: a destructor has no
/// caller to return an error to, and unwinding into C++ would abort.
pub(crate) fn drop_guarded<T>(stage: Stage, value: Box<T>) {
    if let Err(p) = catch_unwind(AssertUnwindSafe(move || drop(value))) {
        let msg = panic_message(&p);
        tracing::error!(%stage, "a Lockstep autograd closure panicked while being dropped: {msg}");
        eprintln!("lockstep: a {stage} closure panicked while being dropped: {msg}");
    }
}

/// The text of a panic payload.
pub(crate) fn panic_message(p: &Box<dyn Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Takes ownership of a tensor the bridge allocated (null: undefined / absent).
///
/// # Safety
/// `p` must be null or a fresh `at::Tensor*` allocated with `new` and owned by nobody else.
pub(crate) unsafe fn take_tensor(p: *mut C_tensor) -> Option<Tensor> {
    if p.is_null() {
        None
    } else {
        // SAFETY: guaranteed by the caller; tch frees it with `delete`.
        Some(unsafe { Tensor::from_ptr(p) })
    }
}

/// Appends (a shallow copy of) `t`, or an undefined tensor for `None`, to a C++ tensor list.
///
/// # Safety
/// `vec` must be the `variable_list*` the bridge passed to the callback.
pub(crate) unsafe fn push(vec: *mut c_void, t: Option<&Tensor>) -> Result<(), AutogradError> {
    let ptr = t.map_or(std::ptr::null(), |t| t.as_ptr());
    // SAFETY: `vec` is valid per the caller; `ptr` is null or a live tensor.
    call(|st| unsafe { lk_vec_push(vec, ptr, st) })
}

/// Borrowed pointers of a list of tensors, for the bridge.
pub(crate) fn ptrs(ts: &[&Tensor]) -> Vec<*const C_tensor> {
    ts.iter().map(|t| t.as_ptr()).collect()
}

/// Borrowed pointers of optional tensors (null for `None`).
pub(crate) fn opt_ptrs(ts: &[Option<&Tensor>]) -> Vec<*const C_tensor> {
    ts.iter()
        .map(|t| t.map_or(std::ptr::null(), |t| t.as_ptr()))
        .collect()
}
