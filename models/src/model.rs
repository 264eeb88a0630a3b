//! The interface every zoo model offers, so one definition serves the references and every
//! parallel configuration: a plan reads names, layers and tags from here and never needs to
//! know which model it is wrapping.

use crate::store::ParamStore;
use crate::tags::ParamTags;
use crate::ModelError;
use std::path::Path;
use tch::Tensor;

/// One rank's batch at one step: what `forward` consumes and what `loss` scores against.
#[derive(Debug)]
pub struct Batch {
    /// Forward inputs, in the order the model's `forward` takes them.
    pub inputs: Vec<Tensor>,
    /// Targets for the loss, when the loss has any (`output.sum()` losses have none).
    pub target: Option<Tensor>,
}

/// How a loss reduces over the samples of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossReduction {
    /// The mean over samples (or over tokens, every sample having as many).
    Mean,
    /// The sum over samples.
    Sum,
}

/// What a layer computes; a pipeline partitioner balances and groups layers by kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerKind {
    /// `nn.Embedding` (token or position table).
    Embedding,
    /// `nn.Linear`.
    Linear,
    /// A parameter-free nonlinearity (ReLU...).
    Activation,
    /// `nn.LayerNorm`.
    LayerNorm,
    /// `nn.BatchNorm1d` (carries running-statistics buffers).
    BatchNorm,
    /// `nn.TransformerEncoderLayer` (self-attention + feed-forward, post-norm).
    EncoderLayer,
    /// `nn.TransformerDecoderLayer` (self-, cross-attention + feed-forward, post-norm).
    DecoderLayer,
    /// A pre-norm decoder-only block with a dense feed-forward.
    DecoderBlock,
    /// A pre-norm decoder-only block whose feed-forward is a mixture of experts.
    MoeDecoderBlock,
    /// The projection from hidden states to vocabulary logits.
    OutputProjection,
    /// Any other repeated block of a user's model (a residual MLP block, a convolution
    /// stage): wrapped as one FSDP unit by `fsdp.*.blocks`, like the transformer blocks.
    Block,
}

/// One entry of a model's ordered layer list (forward order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    /// The module path (`module.1.0`, `transformer.encoder.layers.0`...).
    pub name: String,
    /// What the layer computes.
    pub kind: LayerKind,
    /// The parameters this layer uses, by their module path. A tied parameter appears under
    /// its alias in the layer that uses it that way; [`ParamTags::shared`] maps it back.
    pub params: Vec<String>,
}

/// What a parallel wrapper runs around every layer of [`Model::layers`] during forward, so
/// it can act per layer without the model knowing it: FSDP gathers a unit's parameters
/// before its first layer and frees them after its last one (and registers its pre-backward
/// re-gather on the outputs); mixed precision casts each layer's inputs to the dtype that
/// layer computes in.
///
/// A model that supports hooks ([`Model::supports_layer_hooks`]) calls `pre_forward` and
/// `post_forward` exactly once per layer, in `layers()` order, with that layer's index, and
/// reads the layer's parameters only between the two calls. Nothing outside a layer may
/// depend on a side effect of running it (a hook may substitute its output instead).
pub trait LayerHooks {
    /// Before layer `index` runs: returns its inputs (the tensors it consumes from outside
    /// the layer, in a fixed order), possibly replaced (cast to another dtype). The default
    /// hands them on unchanged.
    fn pre_forward(
        &mut self,
        index: usize,
        inputs: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, ModelError> {
        let _ = index;
        Ok(inputs)
    }

    /// After layer `index` ran: returns its output, possibly replaced. The default hands it
    /// on unchanged.
    fn post_forward(&mut self, index: usize, output: Tensor) -> Result<Tensor, ModelError> {
        let _ = index;
        Ok(output)
    }

    /// Whether layer `index` runs here: `Some(output)` stands in for its result and its
    /// computation is skipped (a pipeline stage does not run the layers other stages hold;
    /// it substitutes what they sent, or a placeholder nothing of its own consumes). Called
    /// after `pre_forward` with the inputs it returned; `post_forward` still follows. The
    /// default runs every layer.
    fn substitute(
        &mut self,
        index: usize,
        inputs: &[Tensor],
    ) -> Result<Option<Tensor>, ModelError> {
        let _ = (index, inputs);
        Ok(None)
    }

    // Module-level hooks: a model calls these where its forward uses a parametrized module,
    // naming it by its module path and passing the parameters it would use. The defaults run
    // the plain op; a parallel plan's hooks run the module's parallel form instead, with this
    // rank's shards of the parameters (looked up by the path), so the model's own forward
    // runs under any plan. The path is what plan rules match.

    /// `x · weightᵀ + bias` for the linear at `path`.
    fn linear(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        Ok(x.f_linear(weight, bias)?)
    }

    /// The rows of `weight` at `ids`, for the embedding at `path`.
    fn embedding(
        &mut self,
        path: &str,
        ids: &Tensor,
        weight: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        Ok(Tensor::f_embedding(weight, ids, -1, false, false)?)
    }

    /// LayerNorm over the trailing dimensions of `weight`'s shape, for the norm at `path`.
    fn layer_norm(
        &mut self,
        path: &str,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        Ok(x.f_layer_norm(weight.size(), Some(weight), Some(bias), eps, false)?)
    }

    /// The mixture-of-experts module at `path` on `x`: `dense` is the model's own computation
    /// (every expert local); an expert-parallel plan runs the experts where they live instead.
    fn moe(
        &mut self,
        path: &str,
        x: &Tensor,
        spec: MoeSpec,
        dense: &dyn Fn(&Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let _ = (path, spec);
        dense(x)
    }

    /// Dropout at `path`: `x` times the mask `mask(per_sample_shape)` draws (batch first, one
    /// mask per sample, already scaled by `1 / (1 - p)`). A plan that splits `x` draws the
    /// full mask and keeps its slice, so the masks are a single device's.
    fn dropout(
        &mut self,
        path: &str,
        x: &Tensor,
        mask: &dyn Fn(&[i64]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        let mask = mask(&x.size()[1..])?;
        Ok(x.f_mul(&mask.f_to_kind(x.kind())?.f_to_device(x.device())?)?)
    }

    /// The positions of the `len` tokens of each sequence this rank computes, for the
    /// positional embedding: `0..len` by default; a context-parallel plan holds shards of the
    /// sequence and returns their global positions (rotary or learned embeddings must see
    /// where a token is in the whole sequence, not in the shard).
    fn positions(&mut self, len: i64, device: tch::Device) -> Result<Tensor, ModelError> {
        Ok(Tensor::f_arange(len, (tch::Kind::Int64, device))?)
    }

    /// Causal self-attention at `path` over heads `q`, `k`, `v` (`(B, H, T, d)`): every token
    /// attends to itself and the tokens before it ([`crate::functional::causal_attention`]).
    /// A context-parallel plan, holding shards of the sequence, brings the other shards' keys
    /// and values to this rank's queries (ring attention, or an all-gather).
    fn attention(
        &mut self,
        path: &str,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        Ok(crate::functional::causal_attention(q, k, v)?)
    }

    /// The mean cross-entropy of `logits` (`[N, V]`) against `target` (`[N]`), the logits
    /// coming from the module at `path`: a vocabulary-parallel plan computes it on this
    /// rank's vocabulary slice (loss parallel).
    fn cross_entropy(
        &mut self,
        path: &str,
        logits: &Tensor,
        target: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let _ = path;
        Ok(logits.f_cross_entropy_loss::<Tensor>(target, None, tch::Reduction::Mean, -100, 0.0)?)
    }
}

/// The shape of a mixture-of-experts module, as a plan distributing its experts needs it.
/// Its parameters follow one naming: `{path}.router.weight` (`[E, D]`, no bias) and
/// `{path}.experts.{e}.w1` / `.w2` (weight and bias) for expert `e`, computing
/// `w2(gelu(w1 x))` weighted by its renormalized top-k gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    /// Experts of the module.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: i64,
}

/// Hooks that change nothing: what plain [`Model::forward`] runs with.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoHooks;

impl LayerHooks for NoHooks {}

/// A zoo model: parameters and buffers under PyTorch's names, deterministic inputs, a loss,
/// and the structure plans need. Models never apply parallelism themselves.
pub trait Model: Send {
    /// The zoo name this model was built from (`nested`, `transformer`...).
    fn name(&self) -> &str;

    /// The rank this instance was built for (only per-rank parameters depend on it).
    fn rank(&self) -> usize;

    /// The run seed this instance was built from (parameters and batches derive from it).
    fn seed(&self) -> u64;

    /// Parameters and buffers, in PyTorch's registration order.
    fn store(&self) -> &ParamStore;

    /// The layers in forward order, for pipeline partitioning.
    fn layers(&self) -> Vec<LayerSpec>;

    /// Rank `rank`'s batch at step `step`, the same in every configuration and process.
    fn input(&self, rank: usize, step: usize) -> Result<Batch, ModelError>;

    /// The model's output on `batch`.
    fn forward(&self, batch: &Batch) -> Result<Tensor, ModelError>;

    /// Whether [`Model::forward_hooked`] calls its hooks around every layer of `layers()`.
    /// Wrappers that free parameters between layers (FSDP) rely on it and fall back to
    /// gathering everything before forward when it is `false`.
    fn supports_layer_hooks(&self) -> bool {
        false
    }

    /// The model's output on `batch`, calling `hooks` around every layer when
    /// [`Model::supports_layer_hooks`] (the default ignores them).
    fn forward_hooked(
        &self,
        batch: &Batch,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let _ = hooks;
        self.forward(batch)
    }

    /// Forward through `hooks` and loss on `batch`.
    fn loss_hooked(&self, batch: &Batch, hooks: &mut dyn LayerHooks) -> Result<Tensor, ModelError> {
        let output = self.forward_hooked(batch, hooks)?;
        self.loss_of_hooked(batch, &output, hooks)
    }

    /// [`Model::loss_of`] with its loss module called through `hooks`
    /// ([`LayerHooks::cross_entropy`]), so a vocabulary-parallel plan can compute it on
    /// split logits. The default ignores the hooks.
    fn loss_of_hooked(
        &self,
        batch: &Batch,
        output: &Tensor,
        hooks: &mut dyn LayerHooks,
    ) -> Result<Tensor, ModelError> {
        let _ = hooks;
        self.loss_of(batch, output)
    }

    /// The scalar loss of `output` on `batch` (PyTorch's `get_loss`).
    fn loss_of(&self, batch: &Batch, output: &Tensor) -> Result<Tensor, ModelError>;

    /// The gradient clipping its training recipe uses: every training loop scales the
    /// step's gradients by `max / (‖g‖ + 1e-6)` (rounded to fp32, as PyTorch's fp32
    /// `clip_grad_norm_` does) when that is below 1, `‖g‖` the global norm the record reports,
    /// before the optimizer steps. `None` (the default): no clipping.
    fn max_grad_norm(&self) -> Option<f64> {
        None
    }

    /// Why context parallelism cannot split this model's sequences, if it cannot: a model
    /// opts in by computing its positions and causal attention through
    /// [`LayerHooks::positions`] and [`LayerHooks::attention`], its loss through
    /// [`LayerHooks::cross_entropy`], its batch `(B, T)` tokens and targets shifted before the
    /// cut. Refused by default.
    fn context_parallel_blocker(&self) -> Option<String> {
        Some(format!(
            "{} does not compute its attention and positions through the layer hooks, so \
             context parallelism cannot split its sequence",
            self.name()
        ))
    }

    /// How [`Model::loss_of`] reduces over samples: a pipeline splitting a batch into
    /// microbatches scales each microbatch's loss by its share of a mean, or not at all for a
    /// sum, so the accumulated gradient is the full batch's.
    fn loss_reduction(&self) -> LossReduction {
        LossReduction::Mean
    }

    /// The dimension of every batch tensor (inputs and target) that indexes samples: where
    /// microbatches are split and merged (1 for sequence-first models).
    fn batch_dim(&self) -> i64 {
        0
    }

    /// Why a single-device reference (one process, every rank's batch) would compute
    /// something else than the parallel run, if it would: per-rank parameters or per-rank
    /// statistics. `None` means the reference is valid.
    fn single_device_reference_blocker(&self) -> Option<String> {
        None
    }

    /// The plan tensor, sequence and expert parallelism apply to this model when the user
    /// passes none (`None`: the model cannot be split; such configurations are refused). Its
    /// rules name the modules the forward passes to its hooks ([`LayerHooks::linear`]...).
    /// Wrappers forward it.
    fn parallel_plan(&self, sequence_parallel: bool) -> Option<crate::plan::ParallelPlan> {
        let _ = sequence_parallel;
        None
    }

    /// Forward and loss on `batch`: the scalar a training step differentiates.
    fn loss(&self, batch: &Batch) -> Result<Tensor, ModelError> {
        let output = self.forward(batch)?;
        self.loss_of(batch, &output)
    }

    /// Errors (naming the reason) when this model allows only a DDP reference.
    fn check_single_device_reference(&self) -> Result<(), ModelError> {
        match self.single_device_reference_blocker() {
            None => Ok(()),
            Some(reason) => Err(ModelError::ReferenceUnsupported {
                model: self.name().to_owned(),
                reason,
            }),
        }
    }

    /// Trainable parameters, tied ones once under their canonical name (as PyTorch's
    /// `named_parameters`). The tensors are the model's own (shallow handles).
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        self.store().named_parameters()
    }

    /// Buffers (running statistics, constants), as PyTorch's `named_buffers`.
    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        self.store().named_buffers()
    }

    /// Shared, expert and per-rank parameter groups.
    fn tags(&self) -> ParamTags {
        self.store().tags().clone()
    }

    /// Number of trainable scalars, tied ones counted once.
    fn num_parameters(&self) -> i64 {
        self.store().num_parameters()
    }

    /// Writes parameters and buffers to a safetensors file under PyTorch's names.
    fn save(&self, path: &Path) -> Result<(), ModelError> {
        self.store().save(path)
    }

    /// Loads parameters and buffers from a safetensors file, in place (tied parameters stay
    /// tied). Errors name every missing, misshaped or unexpected key and change nothing.
    fn load(&mut self, path: &Path) -> Result<(), ModelError> {
        let name = self.name().to_owned();
        self.store().load(path, &name)
    }
}

/// Runs a model's layers in `layers()` order between their hooks (how a model honours the
/// [`LayerHooks`] contract without counting indices by hand): the `i`-th call to
/// [`LayerRun::layer`] is layer `i`, so indices cannot drift from the layer list.
pub struct LayerRun<'a> {
    hooks: &'a mut dyn LayerHooks,
    next: usize,
}

impl<'a> LayerRun<'a> {
    /// Starts at layer 0, calling `hooks` around each layer.
    pub fn new(hooks: &'a mut dyn LayerHooks) -> Self {
        LayerRun { hooks, next: 0 }
    }

    /// Runs the next layer: `pre_forward` on `inputs`, `compute` on the inputs it returns
    /// (the only place the layer's parameters may be read), `post_forward` on the result.
    pub fn layer<const N: usize>(
        &mut self,
        inputs: [Tensor; N],
        compute: impl FnOnce([Tensor; N]) -> Result<Tensor, ModelError>,
    ) -> Result<Tensor, ModelError> {
        self.layer_hooked(inputs, |_, inputs| compute(inputs))
    }

    /// [`LayerRun::layer`] whose `compute` calls its modules through the hooks
    /// ([`LayerHooks::linear`]...), so a parallel plan can run them split.
    pub fn layer_hooked<const N: usize>(
        &mut self,
        inputs: [Tensor; N],
        compute: impl FnOnce(&mut dyn LayerHooks, [Tensor; N]) -> Result<Tensor, ModelError>,
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
        let output = match self.hooks.substitute(index, &inputs)? {
            Some(stand_in) => stand_in,
            None => compute(&mut *self.hooks, inputs)?,
        };
        self.hooks.post_forward(index, output)
    }

    /// The hooks, for module calls between layers (a dropout on the sum of two layers'
    /// outputs).
    pub fn hooks(&mut self) -> &mut dyn LayerHooks {
        &mut *self.hooks
    }
}
