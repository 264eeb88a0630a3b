//! Functional forms of PyTorch modules the zoo and the parallel plans share, written op for
//! op as `torch.nn.functional` computes them, so a model here and its PyTorch twin round
//! identically.

use tch::{TchError, Tensor};

/// The weights of one `nn.MultiheadAttention` (packed `in_proj_weight` `[3E, E]`, its bias,
/// `out_proj`).
#[derive(Clone, Copy, Debug)]
pub struct AttentionWeights<'a> {
    /// `in_proj_weight`: the query, key and value projections stacked on dim 0.
    pub in_proj_weight: &'a Tensor,
    /// `in_proj_bias`: their biases, stacked the same way.
    pub in_proj_bias: &'a Tensor,
    /// `out_proj.weight`.
    pub out_proj_weight: &'a Tensor,
    /// `out_proj.bias`.
    pub out_proj_bias: &'a Tensor,
    /// Number of heads: `E` must divide by it.
    pub heads: i64,
}

/// `F.multi_head_attention_forward` as `nn.TransformerEncoderLayer`/`DecoderLayer` call it in
/// training (`need_weights=False`, no masks, dropout 0, sequence-first `(T, B, E)`):
///
/// - `memory = None` is self-attention (PyTorch's `q is k is v`): one packed linear
///   `[T, B, 3E]`, unflattened to `(3, T, B, E)` and made contiguous, as
///   `F._in_projection_packed` does;
/// - `memory = Some(m)` is encoder-decoder attention (`k is v`): the query through the first
///   `E` rows, key and value through one linear of the last `2E` rows, split the same way;
/// - heads `(B, H, T, E/H)` through `scaled_dot_product_attention`, then
///   `permute(2, 0, 1, 3).reshape(T·B, E)`, `out_proj` and a view back to `(T, B, E)`.
///
/// Every op is PyTorch's, in PyTorch's order, so forward and backward round as PyTorch's
/// module does (separate q/k/v linears or a hand-written softmax attention do not).
pub fn multi_head_attention(
    query: &Tensor,
    memory: Option<&Tensor>,
    w: AttentionWeights<'_>,
) -> Result<Tensor, TchError> {
    let (tgt_len, bsz, e) = match query.size()[..] {
        [a, b, c] => (a, b, c),
        ref s => {
            return Err(TchError::Shape(format!(
                "attention query must be (T, B, E), got {s:?}"
            )))
        }
    };
    if w.heads < 1 || e % w.heads != 0 {
        return Err(TchError::Shape(format!(
            "embedding dimension {e} does not split into {} heads",
            w.heads
        )));
    }
    let head_dim = e / w.heads;
    // `x.unflatten(-1, (n, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()`.
    let unpack = |proj: Tensor, n: i64| -> Result<Tensor, TchError> {
        proj.f_unflatten(-1, [n, e])?
            .f_unsqueeze(0)?
            .f_transpose(0, -2)?
            .f_squeeze_dim(-2)?
            .f_contiguous()
    };
    let (q, k, v) = match memory {
        None => {
            let proj = unpack(query.f_linear(w.in_proj_weight, Some(w.in_proj_bias))?, 3)?;
            (
                proj.f_select(0, 0)?,
                proj.f_select(0, 1)?,
                proj.f_select(0, 2)?,
            )
        }
        Some(memory) => {
            let ws = w.in_proj_weight.f_split_with_sizes([e, 2 * e], 0)?;
            let bs = w.in_proj_bias.f_split_with_sizes([e, 2 * e], 0)?;
            let q = query.f_linear(&ws[0], Some(&bs[0]))?;
            let kv = unpack(memory.f_linear(&ws[1], Some(&bs[1]))?, 2)?;
            (q, kv.f_select(0, 0)?, kv.f_select(0, 1)?)
        }
    };
    let bh = bsz * w.heads;
    let heads = |x: Tensor| -> Result<Tensor, TchError> {
        let len = x.size()[0];
        x.f_view([len, bh, head_dim])?
            .f_transpose(0, 1)?
            .f_view([bsz, w.heads, len, head_dim])
    };
    let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
    let out = Tensor::f_scaled_dot_product_attention::<Tensor>(
        &q, &k, &v, None, 0.0, false, None, false,
    )?;
    let out = out
        .f_permute([2, 0, 1, 3])?
        .f_reshape([bsz * tgt_len, e])?
        .f_linear(w.out_proj_weight, Some(w.out_proj_bias))?;
    out.f_view([tgt_len, bsz, e])
}

/// Causal softmax attention `softmax(q·kᵀ/√d, future masked)·v` over `(B, H, T, d)` heads,
/// every position attending to itself and the ones before it: the zoo decoder's attention
/// and [`crate::LayerHooks::attention`]'s default, so a plan that does not split the sequence
/// rounds exactly as the model alone.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor, TchError> {
    let t = q.size()[2];
    let hd = q.size()[3];
    let future = Tensor::f_ones([t, t], (tch::Kind::Bool, q.device()))?.f_triu(1)?;
    q.f_matmul(&k.f_transpose(-2, -1)?)?
        .f_mul_scalar(1.0 / (hd as f64).sqrt())?
        .f_masked_fill(&future, f64::NEG_INFINITY)?
        .f_softmax(-1, None)?
        .f_matmul(v)
}
