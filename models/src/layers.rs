//! Building blocks written with tch ops, registering their parameters under PyTorch's
//! module paths and drawing their initial values in PyTorch's order.

use crate::functional::{multi_head_attention, AttentionWeights};
use crate::model::LayerHooks;
use crate::store::{linear_bias, linear_weight, ones, xavier_uniform_, zeros, ParamStore, F32};
use crate::ModelError;
use tch::{TchError, Tensor};

/// Joins module paths the way PyTorch names submodules.
pub(crate) fn path(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}

/// `nn.Linear`.
#[derive(Debug)]
pub(crate) struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    /// The module path its hooks name it by.
    pub path: String,
}

impl Linear {
    pub fn new(
        store: &mut ParamStore,
        prefix: &str,
        in_features: i64,
        out_features: i64,
        bias: bool,
    ) -> Result<Self, TchError> {
        let weight = store.param(&path(prefix, "weight"), || {
            linear_weight(out_features, in_features)
        })?;
        let bias = if bias {
            Some(store.param(&path(prefix, "bias"), || {
                linear_bias(out_features, in_features)
            })?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            path: prefix.to_owned(),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_linear(&self.weight, self.bias.as_ref())
    }

    /// The linear through the module hooks (what a parallel plan may split).
    pub fn call(&self, m: &mut dyn LayerHooks, x: &Tensor) -> Result<Tensor, ModelError> {
        m.linear(&self.path, x, &self.weight, self.bias.as_ref())
    }

    pub fn names(prefix: &str, bias: bool) -> Vec<String> {
        let mut v = vec![path(prefix, "weight")];
        if bias {
            v.push(path(prefix, "bias"));
        }
        v
    }
}

/// `nn.LayerNorm(dim)` (eps 1e-5, affine).
#[derive(Debug)]
pub(crate) struct LayerNorm {
    pub weight: Tensor,
    pub bias: Tensor,
    dim: i64,
    path: String,
}

impl LayerNorm {
    pub fn new(store: &mut ParamStore, prefix: &str, dim: i64) -> Result<Self, TchError> {
        let weight = store.param(&path(prefix, "weight"), || ones(&[dim]))?;
        let bias = store.param(&path(prefix, "bias"), || zeros(&[dim]))?;
        Ok(LayerNorm {
            weight,
            bias,
            dim,
            path: prefix.to_owned(),
        })
    }

    /// The norm through the module hooks (sequence parallelism runs it on shards).
    pub fn call(&self, m: &mut dyn LayerHooks, x: &Tensor) -> Result<Tensor, ModelError> {
        m.layer_norm(&self.path, x, &self.weight, &self.bias, 1e-5)
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        x.f_layer_norm(
            [self.dim],
            Some(&self.weight),
            Some(&self.bias),
            1e-5,
            false,
        )
    }

    pub fn names(prefix: &str) -> Vec<String> {
        vec![path(prefix, "weight"), path(prefix, "bias")]
    }
}

/// `nn.BatchNorm1d(channels)` in training mode: batch statistics, running statistics
/// updated in place (momentum 0.1), `num_batches_tracked` counted.
#[derive(Debug)]
pub(crate) struct BatchNorm1d {
    pub weight: Tensor,
    pub bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
}

impl BatchNorm1d {
    pub fn new(store: &mut ParamStore, prefix: &str, channels: i64) -> Result<Self, TchError> {
        let weight = store.param(&path(prefix, "weight"), || ones(&[channels]))?;
        let bias = store.param(&path(prefix, "bias"), || zeros(&[channels]))?;
        let running_mean = store.buffer(&path(prefix, "running_mean"), zeros(&[channels])?);
        let running_var = store.buffer(&path(prefix, "running_var"), ones(&[channels])?);
        let num_batches_tracked = store.buffer(
            &path(prefix, "num_batches_tracked"),
            Tensor::f_zeros([], (tch::Kind::Int64, tch::Device::Cpu))?,
        );
        Ok(BatchNorm1d {
            weight,
            bias,
            running_mean,
            running_var,
            num_batches_tracked,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor, TchError> {
        tch::no_grad(|| {
            self.num_batches_tracked
                .shallow_clone()
                .f_add_scalar_(1)
                .map(|_| ())
        })?;
        x.f_batch_norm(
            Some(&self.weight),
            Some(&self.bias),
            Some(&self.running_mean),
            Some(&self.running_var),
            true,
            0.1,
            1e-5,
            false,
        )
    }
}

/// `nn.MultiheadAttention` (packed `in_proj_weight`, sequence-first layout `(T, B, E)`).
#[derive(Debug)]
pub(crate) struct MultiheadAttention {
    in_proj_weight: Tensor,
    in_proj_bias: Tensor,
    out_proj: Linear,
    heads: i64,
}

impl MultiheadAttention {
    pub fn new(
        store: &mut ParamStore,
        prefix: &str,
        dim: i64,
        heads: i64,
    ) -> Result<Self, TchError> {
        // PyTorch allocates the packed projection, builds out_proj (drawing its Linear
        // init), then re-draws the packed weight (Xavier) and zeroes both biases.
        let in_proj_weight = store.param(&path(prefix, "in_proj_weight"), || {
            Tensor::f_empty([3 * dim, dim], F32)
        })?;
        let in_proj_bias = store.param(&path(prefix, "in_proj_bias"), || zeros(&[3 * dim]))?;
        let out_proj = Linear::new(store, &path(prefix, "out_proj"), dim, dim, true)?;
        let fresh = store.is_fresh(&path(prefix, "in_proj_weight"));
        if fresh {
            xavier_uniform_(&in_proj_weight)?;
            if let Some(b) = &out_proj.bias {
                tch::no_grad(|| b.shallow_clone().f_zero_().map(|_| ()))?;
            }
        }
        Ok(MultiheadAttention {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            heads,
        })
    }

    pub fn names(prefix: &str) -> Vec<String> {
        let mut v = vec![path(prefix, "in_proj_weight"), path(prefix, "in_proj_bias")];
        v.extend(Linear::names(&path(prefix, "out_proj"), true));
        v
    }

    /// Self-attention of `x` (T, B, E) (PyTorch's `self_attn(x, x, x)`), or attention of
    /// `x` over `memory` (S, B, E) (`multihead_attn(x, memory, memory)`); no mask.
    pub fn forward(&self, x: &Tensor, memory: Option<&Tensor>) -> Result<Tensor, TchError> {
        let bias = self
            .out_proj
            .bias
            .as_ref()
            .ok_or_else(|| TchError::Shape("out_proj has no bias".into()))?;
        multi_head_attention(
            x,
            memory,
            AttentionWeights {
                in_proj_weight: &self.in_proj_weight,
                in_proj_bias: &self.in_proj_bias,
                out_proj_weight: &self.out_proj.weight,
                out_proj_bias: bias,
                heads: self.heads,
            },
        )
    }
}

/// The feed-forward of PyTorch's transformer layers: `linear2(relu(linear1(x)))`.
#[derive(Debug)]
pub(crate) struct FeedForward {
    linear1: Linear,
    linear2: Linear,
}

impl FeedForward {
    fn new(store: &mut ParamStore, prefix: &str, dim: i64, ff: i64) -> Result<Self, TchError> {
        Ok(FeedForward {
            linear1: Linear::new(store, &path(prefix, "linear1"), dim, ff, true)?,
            linear2: Linear::new(store, &path(prefix, "linear2"), ff, dim, true)?,
        })
    }

    fn forward(&self, m: &mut dyn LayerHooks, x: &Tensor) -> Result<Tensor, ModelError> {
        let h = self.linear1.call(m, x)?.f_relu()?;
        self.linear2.call(m, &h)
    }
}

/// `nn.TransformerEncoderLayer` (post-norm, ReLU, dropout 0).
#[derive(Debug)]
pub(crate) struct EncoderLayer {
    self_attn: MultiheadAttention,
    ff: FeedForward,
    norm1: LayerNorm,
    norm2: LayerNorm,
}

impl EncoderLayer {
    pub fn new(
        store: &mut ParamStore,
        prefix: &str,
        dim: i64,
        heads: i64,
        ff: i64,
    ) -> Result<Self, TchError> {
        Ok(EncoderLayer {
            self_attn: MultiheadAttention::new(store, &path(prefix, "self_attn"), dim, heads)?,
            ff: FeedForward::new(store, prefix, dim, ff)?,
            norm1: LayerNorm::new(store, &path(prefix, "norm1"), dim)?,
            norm2: LayerNorm::new(store, &path(prefix, "norm2"), dim)?,
        })
    }

    pub fn names(prefix: &str) -> Vec<String> {
        let mut v = MultiheadAttention::names(&path(prefix, "self_attn"));
        for sub in ["linear1", "linear2"] {
            v.extend(Linear::names(&path(prefix, sub), true));
        }
        for sub in ["norm1", "norm2"] {
            v.extend(LayerNorm::names(&path(prefix, sub)));
        }
        v
    }

    pub fn forward(&self, m: &mut dyn LayerHooks, x: &Tensor) -> Result<Tensor, ModelError> {
        let x = self
            .norm1
            .forward(&(x + self.self_attn.forward(x, None)?))?;
        Ok(self.norm2.forward(&(&x + self.ff.forward(m, &x)?))?)
    }
}

/// `nn.TransformerDecoderLayer` (post-norm, ReLU, dropout 0, no masks: PyTorch's test
/// calls `nn.Transformer(src, tgt)` without any).
#[derive(Debug)]
pub(crate) struct DecoderLayer {
    self_attn: MultiheadAttention,
    multihead_attn: MultiheadAttention,
    ff: FeedForward,
    norm1: LayerNorm,
    norm2: LayerNorm,
    norm3: LayerNorm,
}

impl DecoderLayer {
    pub fn new(
        store: &mut ParamStore,
        prefix: &str,
        dim: i64,
        heads: i64,
        ff: i64,
    ) -> Result<Self, TchError> {
        Ok(DecoderLayer {
            self_attn: MultiheadAttention::new(store, &path(prefix, "self_attn"), dim, heads)?,
            multihead_attn: MultiheadAttention::new(
                store,
                &path(prefix, "multihead_attn"),
                dim,
                heads,
            )?,
            ff: FeedForward::new(store, prefix, dim, ff)?,
            norm1: LayerNorm::new(store, &path(prefix, "norm1"), dim)?,
            norm2: LayerNorm::new(store, &path(prefix, "norm2"), dim)?,
            norm3: LayerNorm::new(store, &path(prefix, "norm3"), dim)?,
        })
    }

    pub fn names(prefix: &str) -> Vec<String> {
        let mut v = MultiheadAttention::names(&path(prefix, "self_attn"));
        v.extend(MultiheadAttention::names(&path(prefix, "multihead_attn")));
        for sub in ["linear1", "linear2"] {
            v.extend(Linear::names(&path(prefix, sub), true));
        }
        for sub in ["norm1", "norm2", "norm3"] {
            v.extend(LayerNorm::names(&path(prefix, sub)));
        }
        v
    }

    pub fn forward(
        &self,
        m: &mut dyn LayerHooks,
        x: &Tensor,
        memory: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let x = self
            .norm1
            .forward(&(x + self.self_attn.forward(x, None)?))?;
        let x = self
            .norm2
            .forward(&(&x + self.multihead_attn.forward(&x, Some(memory))?))?;
        Ok(self.norm3.forward(&(&x + self.ff.forward(m, &x)?))?)
    }
}
