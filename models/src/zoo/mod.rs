//! The model zoo by name: what a run spec's `model` field refers to.

mod gpt;
mod mlp;
mod nested;
mod transformer;

pub use gpt::Gpt;
pub use mlp::MlpStack;
pub use nested::LinearChain;
pub use transformer::TransformerWithSharedParams;

use crate::{LayerHooks, Model, ModelError};
use tch::Tensor;

type Builder = fn(u64, usize) -> Result<Box<dyn Model>, ModelError>;

const ZOO: &[(&str, Builder)] = &[
    ("nested", |s, r| Ok(Box::new(LinearChain::nested(s, r)?))),
    ("transformer", |s, r| {
        Ok(Box::new(TransformerWithSharedParams::new(s, r, false)?))
    }),
    ("transformer_bn", |s, r| {
        Ok(Box::new(TransformerWithSharedParams::new(s, r, true)?))
    }),
    ("moe", |s, r| {
        Ok(Box::new(LinearChain::mixture_of_experts(s, r)?))
    }),
    ("mlp", |s, r| Ok(Box::new(MlpStack::new(s, r)?))),
    ("gpt", |s, r| Ok(Box::new(Gpt::new(s, r, false)?))),
    ("gpt_moe", |s, r| Ok(Box::new(Gpt::new(s, r, true)?))),
];

/// Every model name [`build`] accepts.
pub fn names() -> Vec<&'static str> {
    ZOO.iter().map(|(n, _)| *n).collect()
}

/// Builds model `name` for `rank` of a run seeded `seed`: every rank gets the same
/// parameters except those tagged rank-local.
pub fn build(name: &str, seed: u64, rank: usize) -> Result<Box<dyn Model>, ModelError> {
    match ZOO.iter().find(|(n, _)| *n == name) {
        Some((_, builder)) => builder(seed, rank),
        None => Err(ModelError::UnknownModel {
            name: name.to_owned(),
            known: names().into_iter().map(str::to_owned).collect(),
        }),
    }
}

/// Runs a model's layers in `layers()` order between their hooks: the `i`-th call to
/// [`LayerRun::layer`] is layer `i`, so indices cannot drift from the layer list.
pub(crate) struct LayerRun<'a> {
    hooks: &'a mut dyn LayerHooks,
    next: usize,
}

impl<'a> LayerRun<'a> {
    pub(crate) fn new(hooks: &'a mut dyn LayerHooks) -> Self {
        LayerRun { hooks, next: 0 }
    }

    /// Runs the next layer: `pre_forward` on `inputs`, `compute` on the inputs it returns
    /// (the only place the layer's parameters may be read), `post_forward` on the result.
    pub(crate) fn layer<const N: usize>(
        &mut self,
        inputs: [Tensor; N],
        compute: impl FnOnce([Tensor; N]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let index = self.next;
        self.next += 1;
        let returned = self.hooks.pre_forward(index, inputs.into())?;
        let got = returned.len();
        let inputs: [Tensor; N] = returned.try_into().map_err(|_| {
            ModelError::Hook(
                format!("pre_forward of layer {index} returned {got} inputs, expected {N}").into(),
            )
        })?;
        let output = compute(inputs)?;
        self.hooks.post_forward(index, output)
    }
}
