//! Running part of a plain model: the layers of one stage (or of one checkpoint segment),
//! with the outputs of every other layer substituted.
//!
//! The model's own forward runs, so the code between layers runs exactly as in one process;
//! layers outside the range are not computed: a layer whose output this range consumes
//! stands in with what its stage sent, any other with zeros of its shape. The forward ends
//! right before the first layer after the range, unless the range reaches the model's end
//! (then its output comes back for the loss).

use super::dataflow::TensorMeta;
use super::PipelineError;
use lockstep_models::{Batch, LayerHooks, Model, ModelError, MoeSpec, NoHooks};
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use tch::Tensor;

/// The sentinel a range run stops the forward with.
#[derive(Debug)]
struct RangeEnded;

impl std::fmt::Display for RangeEnded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the pipeline stage's last layer ran")
    }
}

impl std::error::Error for RangeEnded {}

/// What a range run needs.
pub(crate) struct RangeRun<'a> {
    /// The layers computed.
    pub range: Range<usize>,
    /// Outputs of layers outside the range that the range consumes (received leaves).
    pub supplied: &'a BTreeMap<usize, Tensor>,
    /// Every layer's output shape at this microbatch size, for stand-ins.
    pub metas: &'a [TensorMeta],
    /// Layers of the range whose outputs the caller wants back.
    pub capture: &'a BTreeSet<usize>,
    /// Hooks that compute the range's layers in place of the model's own (a stage's tensor
    /// parallelism); `None` runs the model's layers.
    pub compute: Option<&'a RefCell<Box<dyn LayerHooks>>>,
}

struct RangeHooks<'a> {
    run: &'a RangeRun<'a>,
    stop_at: Option<usize>,
    captured: BTreeMap<usize, Tensor>,
}

impl LayerHooks for RangeHooks<'_> {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        if self.stop_at == Some(index) {
            return Err(ModelError::Hook(Box::new(RangeEnded)));
        }
        Ok(inputs)
    }

    fn substitute(
        &mut self,
        index: usize,
        inputs: &[Tensor],
    ) -> Result<Option<Tensor>, ModelError> {
        if self.run.range.contains(&index) {
            return match self.run.compute {
                Some(hooks) => hooks.borrow_mut().substitute(index, inputs),
                None => Ok(None),
            };
        }
        if let Some(t) = self.run.supplied.get(&index) {
            return Ok(Some(t.shallow_clone()));
        }
        let meta = self.run.metas.get(index).ok_or_else(|| {
            ModelError::Hook(format!("layer {index} has no recorded output shape").into())
        })?;
        Ok(Some(meta.zeros()?))
    }

    fn linear(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().linear(path, x, weight, bias),
            None => NoHooks.linear(path, x, weight, bias),
        }
    }

    fn embedding(
        &mut self,
        path: &str,
        ids: &Tensor,
        weight: &Tensor,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().embedding(path, ids, weight),
            None => NoHooks.embedding(path, ids, weight),
        }
    }

    fn layer_norm(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().layer_norm(path, x, weight, bias, eps),
            None => NoHooks.layer_norm(path, x, weight, bias, eps),
        }
    }

    fn moe(
        &mut self,
        path: &str,
        x: &Tensor,
        spec: MoeSpec,
        dense: &dyn Fn(&Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().moe(path, x, spec, dense),
            None => dense(x),
        }
    }

    fn dropout(
        &mut self,
        path: &str,
        x: &Tensor,
        mask: &dyn Fn(&[i64]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().dropout(path, x, mask),
            None => NoHooks.dropout(path, x, mask),
        }
    }

    fn positions(&mut self, len: i64, device: tch::Device) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().positions(len, device),
            None => NoHooks.positions(len, device),
        }
    }

    fn attention(
        &mut self,
        path: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        match self.run.compute {
            Some(hooks) => hooks.borrow_mut().attention(path, q, k, v),
            None => NoHooks.attention(path, q, k, v),
        }
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        if self.run.capture.contains(&index) {
            self.captured.insert(index, output.shallow_clone());
        }
        Ok(output)
    }
}

/// The captured outputs, and the model's output when the range reaches the end.
pub(crate) struct RangeOutput {
    pub captured: BTreeMap<usize, Tensor>,
    pub output: Option<Tensor>,
}

/// Runs `run.range` of `model` on `batch`.
pub(crate) fn run_range(
    model: &dyn Model,
    batch: &Batch,
    run: &RangeRun<'_>,
) -> Result<RangeOutput, PipelineError> {
    let layers = run.metas.len();
    let stop_at = (run.range.end < layers).then_some(run.range.end);
    let mut hooks = RangeHooks {
        run,
        stop_at,
        captured: BTreeMap::new(),
    };
    let output = match model.forward_hooked(batch, &mut hooks) {
        Ok(out) => Some(out),
        Err(ModelError::Hook(e)) if e.is::<RangeEnded>() => None,
        Err(e) => return Err(e.into()),
    };
    if stop_at.is_none() && output.is_none() {
        return Err(PipelineError::InvalidPlan(
            "the model's forward ended before its last layer".into(),
        ));
    }
    Ok(RangeOutput {
        captured: hooks.captured,
        output: if stop_at.is_some() { None } else { output },
    })
}
