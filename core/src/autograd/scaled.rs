//! In-place arithmetic with the scalar argument tch's generated API leaves out: what
//! `torch.optim`'s steps call (`param.add_(buf, alpha=-lr)`,
//! `exp_avg_sq.addcmul_(g, g, value=1-β2)`, `param.addcdiv_(m, denom, value=-step)`).
//!
//! libtorch's CPU kernels compute `self + alpha·other` as one fused multiply-add, so scaling
//! first and adding after rounds twice and drifts from PyTorch's bits; calling the very op
//! through the bridge is the only way to match them.

use super::{ffi, AutogradError};
use tch::Tensor;

/// `t.add_(other, alpha)`: `t += alpha·other` with libtorch's rounding.
pub fn add_scaled_(t: &Tensor, other: &Tensor, alpha: f64) -> Result<(), AutogradError> {
    // SAFETY: borrowed tensors alive across the call.
    ffi::call(|st| unsafe { ffi::lk_add_scaled_(t.as_ptr(), other.as_ptr(), alpha, st) })
}

/// `t.addcmul_(a, b, value)`: `t += value·a·b` with libtorch's rounding.
pub fn addcmul_(t: &Tensor, a: &Tensor, b: &Tensor, value: f64) -> Result<(), AutogradError> {
    // SAFETY: borrowed tensors alive across the call.
    ffi::call(|st| unsafe { ffi::lk_addcmul_(t.as_ptr(), a.as_ptr(), b.as_ptr(), value, st) })
}

/// `t.addcdiv_(a, b, value)`: `t += value·a/b` with libtorch's rounding.
pub fn addcdiv_(t: &Tensor, a: &Tensor, b: &Tensor, value: f64) -> Result<(), AutogradError> {
    // SAFETY: borrowed tensors alive across the call.
    ffi::call(|st| unsafe { ffi::lk_addcdiv_(t.as_ptr(), a.as_ptr(), b.as_ptr(), value, st) })
}
