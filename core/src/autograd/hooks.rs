//! Gradient hooks: observe or replace a tensor's gradient during backward, and run code once a
//! leaf's gradient is fully accumulated (FSDP's post-backward: reduce-scatter, then free).

use super::ffi::{self, CallbackError, HookFn, PostAccFn};
use super::{AutogradError, Stage};
use std::ffi::{c_int, c_void};
use std::ptr::NonNull;
use std::sync::Mutex;
use tch::Tensor;
use torch_sys::C_tensor;

type GradHook = Box<dyn FnMut(&Tensor) -> Result<Option<Tensor>, AutogradError> + Send>;
type PostAccHook = Box<dyn FnMut(&Tensor) -> Result<(), AutogradError> + Send>;

/// Removes a hook registered with [`register_hook`] or [`register_post_accumulate_grad_hook`].
///
/// Dropping the handle leaves the hook in place (as PyTorch's `RemovableHandle`); the hook's
/// closure is dropped when it is removed or when its tensor dies. The handle holds the tensor
/// weakly, so it never keeps a tensor (or its graph) alive.
pub struct HookHandle {
    raw: NonNull<c_void>,
}

// SAFETY: the handle is a weak tensor reference plus an id; the bridge's removal is
// thread-safe (libtorch's hook list is per tensor; post-accumulate tables are locked).
unsafe impl Send for HookHandle {}

impl HookHandle {
    /// Removes the hook; `Ok(false)` if its tensor (and so the hook) was already gone.
    pub fn remove(self) -> Result<bool, AutogradError> {
        let mut removed: c_int = 0;
        // SAFETY: `raw` is a live handle from the bridge; freed once in Drop.
        ffi::call(|st| unsafe { ffi::lk_hook_remove(self.raw.as_ptr(), &mut removed, st) })?;
        Ok(removed != 0)
    }
}

impl std::fmt::Debug for HookHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HookHandle")
            .field("raw", &self.raw)
            .finish()
    }
}

impl Drop for HookHandle {
    fn drop(&mut self) {
        // SAFETY: allocated by the bridge, freed exactly once here.
        unsafe { ffi::lk_hook_handle_free(self.raw.as_ptr()) };
    }
}

fn handle(raw: *mut c_void) -> Result<HookHandle, AutogradError> {
    NonNull::new(raw)
        .map(|raw| HookHandle { raw })
        .ok_or_else(|| AutogradError::Torch("bridge returned no hook handle".into()))
}

/// Registers `hook` on `tensor` (leaf or not; it must require grad). During backward it gets
/// the gradient flowing into `tensor`; returning `Some(g)` replaces it, `None` keeps it.
/// For a leaf, it runs before accumulation into `.grad`. An error or panic makes backward
/// return that error.
pub fn register_hook<F>(tensor: &Tensor, hook: F) -> Result<HookHandle, AutogradError>
where
    F: FnMut(&Tensor) -> Result<Option<Tensor>, AutogradError> + Send + 'static,
{
    let state: Box<Mutex<GradHook>> = Box::new(Mutex::new(Box::new(hook)));
    let mut raw = std::ptr::null_mut();
    // SAFETY: the bridge owns `state` from here on every path and drops it via `drop_grad_hook`.
    ffi::call(|st| unsafe {
        ffi::lk_register_hook(
            tensor.as_ptr(),
            Box::into_raw(state).cast(),
            grad_hook_trampoline as HookFn,
            drop_grad_hook,
            &mut raw,
            st,
        )
    })?;
    handle(raw)
}

/// Registers `hook` to run after `tensor`'s gradient was accumulated into `.grad` in a
/// backward; `tensor` must be a leaf that requires grad. The hook gets the tensor itself (read
/// or reset its `.grad`, e.g. with [`set_grad`](super::set_grad)).
pub fn register_post_accumulate_grad_hook<F>(
    tensor: &Tensor,
    hook: F,
) -> Result<HookHandle, AutogradError>
where
    F: FnMut(&Tensor) -> Result<(), AutogradError> + Send + 'static,
{
    let state: Box<Mutex<PostAccHook>> = Box::new(Mutex::new(Box::new(hook)));
    let mut raw = std::ptr::null_mut();
    // SAFETY: as in `register_hook`.
    ffi::call(|st| unsafe {
        ffi::lk_register_post_accumulate_grad_hook(
            tensor.as_ptr(),
            Box::into_raw(state).cast(),
            post_acc_trampoline as PostAccFn,
            drop_post_acc_hook,
            &mut raw,
            st,
        )
    })?;
    handle(raw)
}

unsafe extern "C" fn grad_hook_trampoline(
    state: *mut c_void,
    grad: *mut C_tensor,
    out_vec: *mut c_void,
    err: *mut CallbackError,
) -> c_int {
    // SAFETY: a fresh owned tensor (or null) from the bridge.
    let grad = unsafe { ffi::take_tensor(grad) };
    // SAFETY: the hook list owns `state` and outlives the call.
    let state = unsafe { &*state.cast::<Mutex<GradHook>>() };
    // SAFETY: `err` and `out_vec` are the bridge's slots for this call.
    unsafe {
        ffi::guard(Stage::Hook, err, || {
            let Some(grad) = grad else {
                return Ok(());
            };
            let mut hook = state.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(replacement) = hook(&grad)? {
                ffi::push(out_vec, Some(&replacement))?;
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn drop_grad_hook(state: *mut c_void) {
    // SAFETY: from `Box::into_raw` in `register_hook`, dropped once.
    ffi::drop_guarded(Stage::Hook, unsafe {
        Box::from_raw(state.cast::<Mutex<GradHook>>())
    });
}

unsafe extern "C" fn post_acc_trampoline(
    state: *mut c_void,
    tensor: *mut C_tensor,
    err: *mut CallbackError,
) -> c_int {
    // SAFETY: a fresh owned tensor from the bridge.
    let tensor = unsafe { ffi::take_tensor(tensor) };
    // SAFETY: the hook table owns `state` and keeps it alive during the call.
    let state = unsafe { &*state.cast::<Mutex<PostAccHook>>() };
    // SAFETY: `err` is the bridge's slot for this call.
    unsafe {
        ffi::guard(Stage::PostAccumulateGradHook, err, || {
            let Some(tensor) = tensor else {
                return Ok(());
            };
            let mut hook = state.lock().unwrap_or_else(|e| e.into_inner());
            hook(&tensor)
        })
    }
}

unsafe extern "C" fn drop_post_acc_hook(state: *mut c_void) {
    // SAFETY: from `Box::into_raw` in `register_post_accumulate_grad_hook`, dropped once.
    ffi::drop_guarded(Stage::PostAccumulateGradHook, unsafe {
        Box::from_raw(state.cast::<Mutex<PostAccHook>>())
    });
}
