//! The model zoo by name: what a run spec's `model` field refers to.

mod gpt;
mod mlp;
mod nested;
mod transformer;

pub use gpt::{Gpt, GptConfig};
pub use mlp::MlpStack;
pub use nested::LinearChain;
pub use transformer::TransformerWithSharedParams;

use crate::{Model, ModelError};

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
    ("mlp_wide", |s, r| Ok(Box::new(MlpStack::wide(s, r)?))),
    ("gpt", |s, r| Ok(Box::new(Gpt::new(s, r, false)?))),
    ("gpt_moe", |s, r| Ok(Box::new(Gpt::new(s, r, true)?))),
    ("gpt_dropout", |s, r| {
        Ok(Box::new(
            Gpt::with_dropout(s, r, false, GPT_DROPOUT)?
                .with_max_grad_norm(GPT_DROPOUT_MAX_GRAD_NORM),
        ))
    }),
];

/// The dropout rate of `gpt_dropout`: high enough that a mask drawn wrongly cannot hide.
pub const GPT_DROPOUT: f64 = 0.1;

/// `gpt_dropout` trains as GPT recipes do, with gradient clipping: at this norm, below its
/// gradient norms (≈5.5), so every step of every configuration that trains it clips (FSDP's
/// sharded `clip_grad_norm`, the TP, EP and pipeline loops' clipping among them). Clipping
/// normalizes a gradient's scale away, so the zoo's other models stay unclipped to catch
/// divisor bugs.
pub const GPT_DROPOUT_MAX_GRAD_NORM: f64 = 2.0;

/// Every model name [`build`] accepts.
pub fn names() -> Vec<&'static str> {
    ZOO.iter().map(|(n, _)| *n).collect()
}

/// Builds model `name` for `rank` of a run seeded `seed`: every rank gets the same
/// parameters except those tagged rank-local.
///
/// ```
/// use lockstep_models::zoo;
///
/// // Two builds from one seed hold the same weights and draw the same batches: what lets a
/// // reference run and every rank of a parallel run train the same model.
/// let a = zoo::build("mlp", 7, 0)?;
/// let b = zoo::build("mlp", 7, 0)?;
/// let (loss_a, loss_b) = (a.loss(&a.input(0, 0)?)?, b.loss(&b.input(0, 0)?)?);
/// assert_eq!(loss_a.double_value(&[]), loss_b.double_value(&[]));
/// assert!(zoo::build("no_such_model", 7, 0).is_err());
/// # Ok::<(), lockstep_models::ModelError>(())
/// ```
pub fn build(name: &str, seed: u64, rank: usize) -> Result<Box<dyn Model>, ModelError> {
    match ZOO.iter().find(|(n, _)| *n == name) {
        Some((_, builder)) => builder(seed, rank),
        None => Err(ModelError::UnknownModel {
            name: name.to_owned(),
            known: names().into_iter().map(str::to_owned).collect(),
        }),
    }
}
