//! Freeing a tensor's memory in place and refilling it later, while autograd holds it.
//!
//! FSDP all-gathers full parameters for forward, frees them right after (autograd's saved
//! tensors still point at them), and all-gathers them again before backward. Freeing keeps the
//! storage object and its recorded size, so every alias — views, saved tensors, the parameter
//! itself — sees the memory come back on refill. Refilling with data does not bump the version
//! counter, so saved tensors stay valid for backward.
//!
//! Freeing is `unsafe`: while freed, the storage has no memory but keeps its size, and libtorch
//! does not check that before running kernels (typed accessors raise, but elementwise and
//! reduction kernels read the null pointer and crash). The caller — FSDP's unit, which owns the
//! full parameter — guarantees nothing computes on any alias until the refill.

use super::ffi;
use super::AutogradError;
use std::ffi::c_int;
use tch::Tensor;

/// Releases the memory of `tensor`'s storage (shared with all its aliases); returns the bytes
/// released (0 if it was already freed).
///
/// # Safety
/// Until [`refill_storage`] runs, no operation may read or write the data of `tensor` or of any
/// tensor sharing its storage (views, autograd's saved tensors — so no backward through them
/// either). Metadata (sizes, dtype, `requires_grad`, [`is_storage_freed`]) stays usable.
pub unsafe fn free_storage(tensor: &Tensor) -> Result<usize, AutogradError> {
    let mut released = 0usize;
    // SAFETY: borrowed tensor alive across the call; out pointer valid. The data-access
    // contract is the caller's.
    ffi::call(|st| unsafe { ffi::lk_storage_free(tensor.as_ptr(), &mut released, st) })?;
    Ok(released)
}

fn info(tensor: &Tensor) -> Result<(usize, bool), AutogradError> {
    let mut nbytes = 0usize;
    let mut freed: c_int = 0;
    // SAFETY: as above.
    ffi::call(|st| unsafe { ffi::lk_storage_info(tensor.as_ptr(), &mut nbytes, &mut freed, st) })?;
    Ok((nbytes, freed != 0))
}

/// Whether `tensor`'s storage is currently freed.
pub fn is_storage_freed(tensor: &Tensor) -> Result<bool, AutogradError> {
    info(tensor).map(|(_, freed)| freed)
}

/// The storage's recorded size in bytes (the size a refill allocates), freed or not.
pub fn storage_nbytes(tensor: &Tensor) -> Result<usize, AutogradError> {
    info(tensor).map(|(n, _)| n)
}

/// Re-allocates a freed storage at its recorded size (no-op if allocated) and, with `src`,
/// copies `src` into `tensor` without bumping its version counter — so tensors autograd saved
/// from it remain valid for backward. The new memory is uninitialized without `src`.
pub fn refill_storage(tensor: &Tensor, src: Option<&Tensor>) -> Result<(), AutogradError> {
    let s = src.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: borrowed tensors alive across the call.
    ffi::call(|st| unsafe { ffi::lk_storage_refill(tensor.as_ptr(), s, st) })
}

/// `tensor`'s version counter (bumped by every in-place change; autograd compares it for
/// saved tensors).
pub fn version(tensor: &Tensor) -> Result<i64, AutogradError> {
    let mut v = 0i64;
    // SAFETY: as above.
    ffi::call(|st| unsafe { ffi::lk_tensor_version(tensor.as_ptr(), &mut v, st) })?;
    Ok(v)
}
