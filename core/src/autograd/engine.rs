//! Backward with explicit output gradients, `grad`, and setting `.grad` — what pipelines (a
//! stage's backward seeded with the gradient received from the next stage) and FSDP need.

use super::ffi;
use super::AutogradError;
use std::ffi::c_int;
use tch::Tensor;
use torch_sys::C_tensor;

/// Options of [`grad`], as `torch.autograd.grad`'s keyword arguments.
#[derive(Clone, Copy, Debug, Default)]
pub struct GradOptions {
    /// Keep the graph for another backward; `None` means "as `create_graph`".
    pub retain_graph: Option<bool>,
    /// Record the backward itself, for higher-order gradients.
    pub create_graph: bool,
    /// Return `None` for inputs the outputs do not depend on instead of failing.
    pub allow_unused: bool,
}

fn check_grads(outputs: usize, grads: usize) -> Result<(), AutogradError> {
    if outputs == grads {
        Ok(())
    } else {
        Err(AutogradError::Arity {
            what: "output gradients",
            expected: outputs,
            got: grads,
        })
    }
}

/// Backpropagates from `outputs`, seeding each with its gradient (`None`: ones, scalars only),
/// accumulating into the leaves' `.grad`. Errors of custom functions and hooks, panics
/// included, come back as `Err`.
pub fn backward(
    outputs: &[&Tensor],
    grad_outputs: &[Option<&Tensor>],
    retain_graph: bool,
) -> Result<(), AutogradError> {
    check_grads(outputs.len(), grad_outputs.len())?;
    let outs = ffi::ptrs(outputs);
    let grads = ffi::opt_ptrs(grad_outputs);
    // SAFETY: both arrays hold `outs.len()` borrowed (or null) tensors, alive across the call.
    ffi::call(|st| unsafe {
        ffi::lk_backward(
            outs.as_ptr(),
            outs.len(),
            grads.as_ptr(),
            c_int::from(retain_graph),
            0,
            st,
        )
    })
}

/// Gradients of `outputs` (seeded with `grad_outputs`) with respect to `inputs`, without
/// touching `.grad`; `None` for an input the outputs do not depend on (with `allow_unused`).
pub fn grad(
    outputs: &[&Tensor],
    inputs: &[&Tensor],
    grad_outputs: &[Option<&Tensor>],
    options: GradOptions,
) -> Result<Vec<Option<Tensor>>, AutogradError> {
    check_grads(outputs.len(), grad_outputs.len())?;
    let outs = ffi::ptrs(outputs);
    let grads = ffi::opt_ptrs(grad_outputs);
    let ins = ffi::ptrs(inputs);
    let mut results: Vec<*mut C_tensor> = vec![std::ptr::null_mut(); inputs.len()];
    let retain = options.retain_graph.map_or(-1, c_int::from);
    // SAFETY: arrays sized as passed; `results` receives owned tensors or null.
    let status = ffi::call(|st| unsafe {
        ffi::lk_grad(
            outs.as_ptr(),
            outs.len(),
            grads.as_ptr(),
            ins.as_ptr(),
            ins.len(),
            retain,
            c_int::from(options.create_graph),
            c_int::from(options.allow_unused),
            results.as_mut_ptr(),
            st,
        )
    });
    // SAFETY: each entry is null or an owned tensor from the bridge.
    let results: Vec<Option<Tensor>> = results
        .into_iter()
        .map(|p| unsafe { ffi::take_tensor(p) })
        .collect();
    status?;
    Ok(results)
}

/// Sets `tensor.grad` (or clears it with `None`): FSDP replaces full gradients by shards and
/// frees them; tch can only read `.grad`.
pub fn set_grad(tensor: &Tensor, grad: Option<&Tensor>) -> Result<(), AutogradError> {
    let g = grad.map_or(std::ptr::null(), |g| g.as_ptr());
    // SAFETY: borrowed tensors alive across the call.
    ffi::call(|st| unsafe { ffi::lk_set_grad(tensor.as_ptr(), g, st) })
}
