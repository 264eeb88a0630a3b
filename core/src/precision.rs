//! Mixed precision: the policy (PyTorch FSDP's `MixedPrecision`) and the pieces every
//! wrapper (DDP, FSDP) applies it with.
//!
//! A policy names three dtypes: parameters are *computed* in `param_dtype` (the fp32 master
//! copy stays the optimizer's), gradients are *reduced* in `reduce_dtype`, and floating-point
//! buffers are *kept* in `buffer_dtype`. BatchNorm layers stay in fp32 by default
//! (`keep_batchnorm_fp32`), as FSDP leaves `_BatchNorm` modules out of its policy: their
//! statistics over a small batch are where low precision hurts most.
//!
//! The pieces are small on purpose so each wrapper combines them its own way:
//!
//! - [`CastInputs`]: the [`LayerHooks`] that casts each layer's floating-point inputs to the
//!   dtype that layer computes in (a layer's output in bf16 feeds a BatchNorm in fp32 and
//!   the other way round), composable with a wrapper's own hooks through [`Chain`];
//! - [`low_precision_params`]: which parameters compute in `param_dtype`;
//! - [`cast_buffers`]: floating-point buffers to `buffer_dtype`, in place.

use lockstep_models::{LayerHooks, LayerKind, LayerSpec, Model, ModelError};
use std::collections::{BTreeSet, HashMap};
use tch::{Kind, TchError, Tensor};

/// What applying a mixed-precision policy can fail with.
#[derive(Debug, thiserror::Error)]
pub enum PrecisionError {
    /// A policy field holds a dtype that is not floating point: casting parameters or
    /// gradients to it would truncate them, and `Avg` reductions reject it.
    #[error(
        "mixed precision: `{field}` must be a floating-point dtype (f16, bf16, f32, f64), \
         got {dtype:?}"
    )]
    NotFloating {
        /// The policy field at fault (`param_dtype`, `reduce_dtype`, `buffer_dtype`).
        field: &'static str,
        /// The dtype it held.
        dtype: Kind,
    },
    /// The model cannot run hooks around its layers, so nothing could cast a layer's inputs
    /// to the dtype its parameters compute in (ops would see mixed dtypes and fail, or
    /// silently promote back to fp32).
    #[error(
        "mixed precision needs a model that supports layer hooks; model `{model}` does not \
         (it cannot cast each layer's inputs to its compute dtype)"
    )]
    LayerHooksUnsupported {
        /// The model's zoo name.
        model: String,
    },
    /// A hook was called for a layer the model's layer list does not have.
    #[error("mixed precision: layer index {index} out of range ({layers} layers)")]
    LayerOutOfRange {
        /// The index the model passed.
        index: usize,
        /// How many layers the hook was built for.
        layers: usize,
    },
    /// Mixed precision was asked of parameters without a model: no layer list says which
    /// layers compute in which dtype.
    #[error("mixed precision needs a model's layer list: {0}")]
    NoModel(String),
    /// A cast failed in libtorch.
    #[error("libtorch: {0}")]
    Torch(#[from] TchError),
}

/// Whether `kind` is a floating-point dtype a policy may name (the ones collectives reduce).
pub fn is_floating(kind: Kind) -> bool {
    matches!(
        kind,
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
    )
}

/// A mixed-precision policy, with PyTorch FSDP's `MixedPrecision` semantics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecision {
    /// The dtype parameters are cast to for forward and backward (gradients arrive in it).
    pub param_dtype: Kind,
    /// The dtype gradients are cast to before they are reduced across ranks.
    pub reduce_dtype: Kind,
    /// The dtype floating-point buffers are kept in.
    pub buffer_dtype: Kind,
    /// Compute BatchNorm layers in fp32 with fp32 parameters (and buffers), as FSDP does by
    /// default.
    pub keep_batchnorm_fp32: bool,
}

impl MixedPrecision {
    /// bf16 compute, fp32 reduction and buffers, BatchNorm in fp32: the usual policy on
    /// hardware with bf16 (its exponent range needs no loss scaling).
    pub fn bf16() -> Self {
        MixedPrecision {
            param_dtype: Kind::BFloat16,
            reduce_dtype: Kind::Float,
            buffer_dtype: Kind::Float,
            keep_batchnorm_fp32: true,
        }
    }

    /// fp16 compute, fp32 reduction and buffers, BatchNorm in fp32.
    pub fn fp16() -> Self {
        MixedPrecision {
            param_dtype: Kind::Half,
            ..Self::bf16()
        }
    }

    /// Errors naming the first field whose dtype is not floating point.
    pub fn validate(&self) -> Result<(), PrecisionError> {
        for (field, dtype) in [
            ("param_dtype", self.param_dtype),
            ("reduce_dtype", self.reduce_dtype),
            ("buffer_dtype", self.buffer_dtype),
        ] {
            if !is_floating(dtype) {
                return Err(PrecisionError::NotFloating { field, dtype });
            }
        }
        Ok(())
    }

    /// A short name for configuration names and reports: `bf16` and `fp16` for the presets,
    /// else `p<param>-r<reduce>-b<buffer>` (and `-bnlow` when BatchNorm is not kept in
    /// fp32), so two different policies never share a label.
    pub fn label(&self) -> String {
        if *self == Self::bf16() {
            return "bf16".into();
        }
        if *self == Self::fp16() {
            return "fp16".into();
        }
        let mut label = format!(
            "p{}-r{}-b{}",
            short(self.param_dtype),
            short(self.reduce_dtype),
            short(self.buffer_dtype)
        );
        if !self.keep_batchnorm_fp32 {
            label.push_str("-bnlow");
        }
        label
    }

    /// The dtype a layer of `kind` computes in: fp32 for BatchNorm when it is kept in fp32,
    /// `param_dtype` otherwise.
    pub fn compute_dtype(&self, kind: LayerKind) -> Kind {
        if kind == LayerKind::BatchNorm && self.keep_batchnorm_fp32 {
            Kind::Float
        } else {
            self.param_dtype
        }
    }
}

fn short(kind: Kind) -> String {
    match kind {
        Kind::Half => "fp16".into(),
        Kind::BFloat16 => "bf16".into(),
        Kind::Float => "fp32".into(),
        Kind::Double => "fp64".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// The layer hooks of a policy: before layer `i` runs, every floating-point input is cast to
/// the dtype layer `i` computes in ([`MixedPrecision::compute_dtype`]), so its parameters and
/// inputs agree whatever the previous layer produced. Integer inputs (token indices) pass
/// unchanged, and so do outputs. The cast is differentiable: the input gradient flows back in
/// the producer's dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct CastInputs {
    dtypes: Vec<Kind>,
}

impl CastInputs {
    /// Hooks for a model whose layers are `layers` (its [`Model::layers`]), under `policy`
    /// (validated here).
    pub fn new(layers: &[LayerSpec], policy: &MixedPrecision) -> Result<Self, PrecisionError> {
        policy.validate()?;
        Ok(CastInputs {
            dtypes: layers
                .iter()
                .map(|l| policy.compute_dtype(l.kind))
                .collect(),
        })
    }

    /// Hooks for `model`; errors when the model does not call layer hooks (nothing would
    /// cast its inputs).
    pub fn for_model(model: &dyn Model, policy: &MixedPrecision) -> Result<Self, PrecisionError> {
        policy.validate()?;
        if !model.supports_layer_hooks() {
            return Err(PrecisionError::LayerHooksUnsupported {
                model: model.name().to_owned(),
            });
        }
        Self::new(&model.layers(), policy)
    }

    /// The dtype layer `index` computes in, if the model has that layer.
    pub fn compute_dtype(&self, index: usize) -> Option<Kind> {
        self.dtypes.get(index).copied()
    }
}

impl LayerHooks for CastInputs {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let dtype = self.compute_dtype(index).ok_or_else(|| {
            ModelError::Hook(Box::new(PrecisionError::LayerOutOfRange {
                index,
                layers: self.dtypes.len(),
            }))
        })?;
        inputs
            .into_iter()
            .map(|x| {
                if is_floating(x.kind()) && x.kind() != dtype {
                    Ok(x.f_to_kind(dtype)?)
                } else {
                    Ok(x)
                }
            })
            .collect()
    }

    fn post_forward(&mut self, _index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        Ok(output)
    }
}

/// Two sets of layer hooks run as nested wrappers: `.0` is the outer one (its `pre_forward`
/// runs first, its `post_forward` last), `.1` the inner one: how a test puts an observer
/// behind a wrapper's hooks (FSDP calls its [`CastInputs`] from its own hooks instead).
#[derive(Clone, Debug, Default)]
pub struct Chain<A, B>(pub A, pub B);

impl<A: LayerHooks, B: LayerHooks> LayerHooks for Chain<A, B> {
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let inputs = self.0.pre_forward(index, inputs)?;
        self.1.pre_forward(index, inputs)
    }

    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        let output = self.1.post_forward(index, output)?;
        self.0.post_forward(index, output)
    }

    fn substitute(
        &mut self,
        index: usize,
        inputs: &[Tensor],
    ) -> Result<Option<Tensor>, ModelError> {
        match self.0.substitute(index, inputs)? {
            Some(stand_in) => Ok(Some(stand_in)),
            None => self.1.substitute(index, inputs),
        }
    }
}

/// The parameters (canonical names, as [`Model::named_parameters`] lists them) that compute
/// in `param_dtype` under `policy`: every parameter, except — when BatchNorm is kept in fp32 —
/// those used by BatchNorm layers only. A parameter no layer lists computes in low precision.
pub fn low_precision_params(model: &dyn Model, policy: &MixedPrecision) -> BTreeSet<String> {
    let tags = model.tags();
    // For each canonical parameter: whether some layer using it computes in low precision.
    let mut low_use: HashMap<String, bool> = HashMap::new();
    for layer in model.layers() {
        let fp32 = layer.kind == LayerKind::BatchNorm && policy.keep_batchnorm_fp32;
        for name in &layer.params {
            let entry = low_use
                .entry(tags.canonical(name).to_owned())
                .or_insert(false);
            *entry |= !fp32;
        }
    }
    model
        .named_parameters()
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| low_use.get(name).copied().unwrap_or(true))
        .collect()
}

/// Casts `model`'s floating-point buffers to `policy.buffer_dtype` in place (`set_data`, so
/// the model's own handles see the new dtype), except the buffers of BatchNorm layers when
/// BatchNorm is kept in fp32 (their layer computes in fp32 and reads them). Integer buffers
/// (counters, index tables) are never touched. Returns the names of the buffers cast.
pub fn cast_buffers(
    model: &dyn Model,
    policy: &MixedPrecision,
) -> Result<Vec<String>, PrecisionError> {
    policy.validate()?;
    let kept: Vec<String> = model
        .layers()
        .into_iter()
        .filter(|l| l.kind == LayerKind::BatchNorm && policy.keep_batchnorm_fp32)
        .map(|l| format!("{}.", l.name))
        .collect();
    let mut cast = Vec::new();
    for (name, buffer) in model.named_buffers() {
        let kind = buffer.kind();
        if !is_floating(kind) || kind == policy.buffer_dtype {
            continue;
        }
        if kept.iter().any(|prefix| name.starts_with(prefix.as_str())) {
            continue;
        }
        let data = tch::no_grad(|| buffer.f_to_kind(policy.buffer_dtype))?;
        buffer.shallow_clone().f_set_data(&data)?;
        cast.push(name);
    }
    Ok(cast)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(name: &str, kind: LayerKind, params: &[&str]) -> LayerSpec {
        LayerSpec {
            name: name.into(),
            kind,
            params: params.iter().map(|p| (*p).to_owned()).collect(),
        }
    }

    #[test]
    fn presets_validate_and_have_short_labels() {
        assert!(MixedPrecision::bf16().validate().is_ok());
        assert!(MixedPrecision::fp16().validate().is_ok());
        assert_eq!(MixedPrecision::bf16().label(), "bf16");
        assert_eq!(MixedPrecision::fp16().label(), "fp16");
        let custom = MixedPrecision {
            reduce_dtype: Kind::BFloat16,
            keep_batchnorm_fp32: false,
            ..MixedPrecision::bf16()
        };
        assert_eq!(custom.label(), "pbf16-rbf16-bfp32-bnlow");
    }

    #[test]
    fn integer_dtypes_are_rejected_by_field() {
        for (field, policy) in [
            (
                "param_dtype",
                MixedPrecision {
                    param_dtype: Kind::Int64,
                    ..MixedPrecision::bf16()
                },
            ),
            (
                "reduce_dtype",
                MixedPrecision {
                    reduce_dtype: Kind::Int,
                    ..MixedPrecision::bf16()
                },
            ),
            (
                "buffer_dtype",
                MixedPrecision {
                    buffer_dtype: Kind::Bool,
                    ..MixedPrecision::bf16()
                },
            ),
        ] {
            match policy.validate() {
                Err(e @ PrecisionError::NotFloating { field: f, .. }) => {
                    assert_eq!(f, field);
                    assert!(e.to_string().contains(field), "{e}");
                }
                other => panic!("{field}: {other:?}"),
            }
        }
    }

    #[test]
    fn cast_inputs_follows_each_layers_compute_dtype() {
        let layers = [
            layer("embed", LayerKind::Embedding, &["embed.weight"]),
            layer("bn", LayerKind::BatchNorm, &["bn.weight"]),
            layer("out", LayerKind::Linear, &["out.weight"]),
        ];
        let mut hooks = CastInputs::new(&layers, &MixedPrecision::bf16()).expect("hooks");
        let ids = Tensor::from_slice(&[1i64, 2]);
        let x = Tensor::from_slice(&[1.0f32, 2.0]);
        let out = hooks
            .pre_forward(0, vec![ids.shallow_clone(), x.shallow_clone()])
            .expect("pre");
        assert_eq!(out[0].kind(), Kind::Int64, "indices untouched");
        assert_eq!(out[1].kind(), Kind::BFloat16);
        let bn = hooks
            .pre_forward(1, vec![out[1].shallow_clone()])
            .expect("pre");
        assert_eq!(bn[0].kind(), Kind::Float, "BatchNorm in fp32");
        let low = MixedPrecision {
            keep_batchnorm_fp32: false,
            ..MixedPrecision::bf16()
        };
        let mut hooks_low = CastInputs::new(&layers, &low).expect("hooks");
        let bn = hooks_low.pre_forward(1, vec![x]).expect("pre");
        assert_eq!(bn[0].kind(), Kind::BFloat16);
        assert!(matches!(
            hooks.pre_forward(3, vec![]),
            Err(ModelError::Hook(_))
        ));
    }

    /// Records the order hooks run in.
    struct Log(&'static str, std::sync::Arc<std::sync::Mutex<Vec<String>>>);

    impl LayerHooks for Log {
        fn pre_forward(
            &mut self,
            index: usize,
            inputs: Vec<Tensor>,
        ) -> Result<Vec<Tensor>, ModelError> {
            if let Ok(mut log) = self.1.lock() {
                log.push(format!("pre {} {index}", self.0));
            }
            Ok(inputs)
        }

        fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
            if let Ok(mut log) = self.1.lock() {
                log.push(format!("post {} {index}", self.0));
            }
            Ok(output)
        }
    }

    #[test]
    fn chain_nests_outer_around_inner() {
        let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut chain = Chain(Log("outer", log.clone()), Log("inner", log.clone()));
        let _ = chain.pre_forward(0, vec![]).expect("pre");
        let _ = chain.post_forward(0, Tensor::from(1.0)).expect("post");
        let got = log.lock().expect("log").clone();
        assert_eq!(
            got,
            ["pre outer 0", "pre inner 0", "post inner 0", "post outer 0"]
        );
    }
}
