//! Custom autograd functions whose forward and backward are Rust closures.
//!
//! The forward closure runs right away, in Rust, with gradient tracking off (as libtorch runs
//! a `torch::autograd::Function`'s forward); the bridge then attaches a graph node to its
//! outputs whose backward calls the backward closure. The backward closure lives in that node
//! and is dropped exactly once, when the node dies, whether or not backward ran.
//!
//! ```
//! use lockstep_core::autograd::{apply, engine};
//! use tch::{Kind, Tensor};
//! # fn main() -> Result<(), lockstep_core::autograd::AutogradError> {
//! let x = Tensor::ones([3], (Kind::Double, tch::Device::Cpu)).set_requires_grad(true);
//! // Forward: identity. Backward: double the gradient.
//! let y = apply(&[&x], |_ctx, xs| Ok(vec![xs[0].shallow_clone()]), |_ctx, grads| {
//!     Ok(vec![grads[0].as_ref().map(|g| g * 2.0)])
//! })?;
//! engine::backward(&[&y[0].sum(Kind::Double)], &[None], false)?;
//! assert_eq!(Vec::<f64>::try_from(x.grad()).unwrap(), [2.0, 2.0, 2.0]);
//! # Ok(()) }
//! ```

use super::ffi::{self, BackwardFn, CallbackError};
use super::{AutogradError, Stage};
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use tch::Tensor;
use torch_sys::C_tensor;

/// What a one-shot backward closure looks like once boxed.
type OnceBackward = Box<
    dyn FnOnce(&BackwardCtx, Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, AutogradError>
        + Send,
>;
/// What a re-entrant backward closure looks like once boxed.
type ManyBackward = Box<
    dyn FnMut(&BackwardCtx, Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, AutogradError>
        + Send,
>;

enum Backward {
    Once(Option<OnceBackward>),
    Many(ManyBackward),
}

/// The state the graph node owns.
struct State {
    backward: Mutex<Backward>,
    n_inputs: usize,
}

/// What a forward closure can tell the node besides its outputs.
///
/// Mirrors libtorch's `AutogradContext` in forward: tensors saved through it are checked for
/// in-place modification before backward and, unlike captured outputs, do not form a cycle.
#[derive(Default)]
pub struct ForwardCtx {
    saved: Vec<Tensor>,
    non_differentiable: Vec<usize>,
    materialize_grads: Option<bool>,
}

impl ForwardCtx {
    /// Saves tensors (inputs or outputs) for backward, where [`BackwardCtx::saved`] returns
    /// them in this order. Use this rather than capturing outputs in the backward closure.
    pub fn save_for_backward(&mut self, tensors: &[&Tensor]) {
        self.saved.extend(tensors.iter().map(|t| t.shallow_clone()));
    }

    /// Marks output `index` as not differentiable: it gets no gradient history, and its
    /// gradient reaches backward as `None` (or zeros when grads are materialized).
    pub fn mark_non_differentiable(&mut self, index: usize) {
        self.non_differentiable.push(index);
    }

    /// Whether absent output gradients reach backward as zeros (`true`, libtorch's default)
    /// or as `None` (cheaper when backward can skip them).
    pub fn set_materialize_grads(&mut self, materialize: bool) {
        self.materialize_grads = Some(materialize);
    }
}

/// What a backward closure gets besides the output gradients.
pub struct BackwardCtx {
    saved: Vec<Tensor>,
    needs_input_grad: Vec<bool>,
}

impl BackwardCtx {
    /// The tensors saved with [`ForwardCtx::save_for_backward`], in order.
    pub fn saved(&self) -> &[Tensor] {
        &self.saved
    }

    /// Whether input `index` needs a gradient in this backward, so work for others can be
    /// skipped (return `None` for them).
    pub fn needs_input_grad(&self, index: usize) -> bool {
        self.needs_input_grad.get(index).copied().unwrap_or(false)
    }
}

/// Applies a custom function whose backward runs at most once.
///
/// `forward` gets the inputs and returns the outputs (run without gradient tracking).
/// `backward` gets one gradient per output (`None` if undefined and not materialized) and must
/// return one per input (`None` for no gradient). Calling backward a second time through a
/// retained graph fails with [`AutogradError::BackwardReused`]; use [`apply_reentrant`] then.
/// Errors and panics of either closure come back as `Err` (from here, or from the backward
/// call).
pub fn apply<F, B>(
    inputs: &[&Tensor],
    forward: F,
    backward: B,
) -> Result<Vec<Tensor>, AutogradError>
where
    F: FnOnce(&mut ForwardCtx, &[&Tensor]) -> Result<Vec<Tensor>, AutogradError>,
    B: FnOnce(&BackwardCtx, Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, AutogradError>
        + Send
        + 'static,
{
    apply_with(inputs, forward, Backward::Once(Some(Box::new(backward))))
}

/// Applies a custom function whose backward may run many times (graphs backpropagated with
/// `retain_graph`). Calls are serialized; otherwise as [`apply`].
pub fn apply_reentrant<F, B>(
    inputs: &[&Tensor],
    forward: F,
    backward: B,
) -> Result<Vec<Tensor>, AutogradError>
where
    F: FnOnce(&mut ForwardCtx, &[&Tensor]) -> Result<Vec<Tensor>, AutogradError>,
    B: FnMut(&BackwardCtx, Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>, AutogradError>
        + Send
        + 'static,
{
    apply_with(inputs, forward, Backward::Many(Box::new(backward)))
}

fn apply_with<F>(
    inputs: &[&Tensor],
    forward: F,
    backward: Backward,
) -> Result<Vec<Tensor>, AutogradError>
where
    F: FnOnce(&mut ForwardCtx, &[&Tensor]) -> Result<Vec<Tensor>, AutogradError>,
{
    let state = Box::new(State {
        backward: Mutex::new(backward),
        n_inputs: inputs.len(),
    });
    let mut ctx = ForwardCtx::default();
    let outputs = catch_unwind(AssertUnwindSafe(|| {
        let _no_grad = tch::no_grad_guard();
        forward(&mut ctx, inputs)
    }));
    let outputs = match outputs {
        Ok(Ok(outputs)) => outputs,
        Ok(Err(e)) => {
            ffi::drop_guarded(Stage::Backward, state);
            return Err(e);
        }
        Err(p) => {
            ffi::drop_guarded(Stage::Backward, state);
            return Err(AutogradError::panic(Stage::Forward, p));
        }
    };
    if let Some(bad) = ctx.non_differentiable.iter().find(|&&i| i >= outputs.len()) {
        ffi::drop_guarded(Stage::Backward, state);
        return Err(AutogradError::Invalid(format!(
            "non-differentiable output {bad} of a function with {} outputs",
            outputs.len()
        )));
    }
    if outputs.iter().any(|t| !t.defined()) {
        ffi::drop_guarded(Stage::Backward, state);
        return Err(AutogradError::Invalid(
            "forward returned an undefined tensor".into(),
        ));
    }

    let in_ptrs = ffi::ptrs(inputs);
    let out_refs: Vec<&Tensor> = outputs.iter().collect();
    let out_ptrs = ffi::ptrs(&out_refs);
    let saved_refs: Vec<&Tensor> = ctx.saved.iter().collect();
    let saved_ptrs = ffi::ptrs(&saved_refs);
    let mut results: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); outputs.len()];
    let raw_state = Box::into_raw(state).cast::<c_void>();
    let materialize = ctx.materialize_grads.unwrap_or(true);
    // SAFETY: all pointer arrays live across the call; the bridge takes ownership of
    // `raw_state` on every path (dropping it through `drop_state`), and fills `results` with
    // owned tensors on success.
    let status = ffi::call(|st| unsafe {
        ffi::lk_function_apply(
            in_ptrs.as_ptr(),
            in_ptrs.len(),
            out_ptrs.as_ptr(),
            out_ptrs.len(),
            saved_ptrs.as_ptr(),
            saved_ptrs.len(),
            ctx.non_differentiable.as_ptr(),
            ctx.non_differentiable.len(),
            c_int::from(materialize),
            raw_state,
            backward_trampoline as BackwardFn,
            drop_state,
            results.as_mut_ptr(),
            st,
        )
    });
    // SAFETY: each entry is null or an owned tensor the bridge allocated for us.
    let wrapped: Vec<Option<Tensor>> = results
        .into_iter()
        .map(|p| unsafe { ffi::take_tensor(p) })
        .collect();
    status?;
    wrapped
        .into_iter()
        .map(|t| t.ok_or_else(|| AutogradError::Torch("bridge returned no output".into())))
        .collect()
}

/// Called by the graph node's backward.
unsafe extern "C" fn backward_trampoline(
    state: *mut c_void,
    saved: *mut *mut C_tensor,
    n_saved: usize,
    grads: *mut *mut C_tensor,
    n_grads: usize,
    needs_input_grad: *const u8,
    n_inputs: usize,
    out_vec: *mut c_void,
    err: *mut CallbackError,
) -> c_int {
    // Take ownership of every tensor first, so none leaks whatever happens next.
    // SAFETY: the bridge passes arrays of the given lengths holding fresh, owned tensors.
    let saved: Vec<Tensor> = (0..n_saved)
        .filter_map(|i| unsafe { ffi::take_tensor(*saved.add(i)) })
        .collect();
    // SAFETY: as above; null entries are undefined gradients.
    let grads: Vec<Option<Tensor>> = (0..n_grads)
        .map(|i| unsafe { ffi::take_tensor(*grads.add(i)) })
        .collect();
    // SAFETY: `n_inputs` flags.
    let needs: Vec<bool> = (0..n_inputs)
        .map(|i| unsafe { *needs_input_grad.add(i) } != 0)
        .collect();
    // SAFETY: `state` is the `State` this node owns; the node outlives this call.
    let state = unsafe { &*state.cast::<State>() };
    // SAFETY: `err` is the bridge's error slot.
    unsafe {
        ffi::guard(Stage::Backward, err, || {
            let ctx = BackwardCtx {
                saved,
                needs_input_grad: needs,
            };
            let mut backward = state.backward.lock().unwrap_or_else(|e| e.into_inner());
            let result = match &mut *backward {
                Backward::Once(slot) => {
                    let f = slot.take().ok_or(AutogradError::BackwardReused)?;
                    f(&ctx, grads)?
                }
                Backward::Many(f) => f(&ctx, grads)?,
            };
            if result.len() != state.n_inputs {
                return Err(AutogradError::Arity {
                    what: "gradients returned by backward",
                    expected: state.n_inputs,
                    got: result.len(),
                });
            }
            for g in &result {
                ffi::push(out_vec, g.as_ref())?;
            }
            Ok(())
        })
    }
}

/// Called by the bridge when the node (or a failed apply) drops the state.
unsafe extern "C" fn drop_state(state: *mut c_void) {
    // SAFETY: `state` came from `Box::into_raw` in `apply_with`, and is dropped once.
    ffi::drop_guarded(Stage::Backward, unsafe {
        Box::from_raw(state.cast::<State>())
    });
}
