//! A tensor-parallel plan: which parameters are sharded how, by module-path pattern, as
//! torchtitan's `parallelize_module` plans are written — and the check, before any rank
//! starts, that the plan fits the model and the TP size.

use lockstep_models::Model;
use std::collections::BTreeMap;

/// How one module's parameters are placed on the TP group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpStyle {
    /// Output features split (weight and bias dim 0): a column-parallel linear.
    Colwise,
    /// Input features split (weight dim 1; the bias stays whole, added after the reduction).
    Rowwise,
    /// Vocabulary rows split (an embedding, or a tied output projection: loss parallel).
    Vocab,
    /// Whole on every rank but run on sequence shards (LayerNorms, and under sequence
    /// parallelism anything token-wise: a row-parallel bias, replicated experts): its
    /// gradients are partial and summed over the TP group.
    Sequence,
}

/// One rule of a plan: a module-path pattern (`*` stands for one path segment, e.g.
/// `layers.*.attention.wq`) and its style.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpRule {
    /// Module path pattern; it must match at least one module of the model.
    pub pattern: String,
    /// How the matched modules' parameters are split.
    pub style: TpStyle,
}

/// A tensor-parallel plan for one model family.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TpPlan {
    /// The rules in order; a module matched by no rule stays replicated.
    pub rules: Vec<TpRule>,
    /// Hidden states between blocks live on sequence shards (Megatron's SP).
    pub sequence_parallel: bool,
}

/// Where one parameter lives under a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Whole and identical on every rank; its gradient is complete on every rank.
    Replicated,
    /// Whole on every rank, gradient partial (sequence shards): summed over TP.
    PartialGrad,
    /// Split along `dim` into equal contiguous chunks, rank r holding chunk r.
    Shard {
        /// The split dimension of the parameter tensor.
        dim: i64,
    },
}

/// Why a plan cannot apply.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TpPlanError {
    /// A rule whose pattern matches nothing (usually a typo in the path).
    #[error("tensor-parallel plan: pattern `{pattern}` matches no module of model `{model}`")]
    NoMatch {
        /// The rule's pattern.
        pattern: String,
        /// The model's zoo name.
        model: String,
    },
    /// A parameter's split dimension does not divide by the TP size.
    #[error(
        "tensor-parallel plan: `{param}` ({style:?}) has {size} along dimension {dim}, which \
         does not divide by the tensor-parallel size {tp}"
    )]
    Indivisible {
        /// The parameter's full name.
        param: String,
        /// The style that would split it.
        style: TpStyle,
        /// The dimension to split.
        dim: i64,
        /// The parameter's extent along `dim`.
        size: i64,
        /// The tensor-parallel group size.
        tp: usize,
    },
    /// Attention heads must split whole across the TP ranks.
    #[error("tensor-parallel plan: layers.*.attention: {heads} attention heads do not divide by the tensor-parallel size {tp}")]
    Heads {
        /// The model's attention head count.
        heads: i64,
        /// The tensor-parallel group size.
        tp: usize,
    },
    /// The model (named) has no TP plan.
    #[error("tensor-parallel plan: model `{0}` has no tensor-parallel implementation (zoo gpt, gpt_moe and transformer do)")]
    Unsupported(String),
    /// The requested TP size is zero or does not divide the world size.
    #[error("tensor-parallel plan: size {0} is not a positive divisor of the world")]
    Size(usize),
}

/// Whether the module path `module` matches `pattern` (`*` = exactly one segment).
pub fn matches_module(pattern: &str, module: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let m: Vec<&str> = module.split('.').collect();
    p.len() == m.len() && p.iter().zip(&m).all(|(a, b)| *a == "*" || a == b)
}

impl TpPlan {
    /// The plan of the zoo's decoder (`gpt`, `gpt_moe`): vocabulary-parallel token embedding
    /// and tied output projection (loss parallel), attention split by heads (q, k, v
    /// column-wise, output row-wise), the dense feed-forward column- then row-wise; under
    /// sequence parallelism every LayerNorm runs on sequence shards. `gpt_moe`'s experts stay
    /// replicated under TP (expert parallelism shards them).
    pub fn gpt(sequence_parallel: bool) -> TpPlan {
        let rule = |pattern: &str, style| TpRule {
            pattern: pattern.to_owned(),
            style,
        };
        let mut rules = vec![
            rule("tok_embeddings", TpStyle::Vocab),
            rule("layers.*.attention.wq", TpStyle::Colwise),
            rule("layers.*.attention.wk", TpStyle::Colwise),
            rule("layers.*.attention.wv", TpStyle::Colwise),
            rule("layers.*.attention.wo", TpStyle::Rowwise),
        ];
        if sequence_parallel {
            rules.push(rule("layers.*.attention_norm", TpStyle::Sequence));
            rules.push(rule("layers.*.ffn_norm", TpStyle::Sequence));
            rules.push(rule("norm", TpStyle::Sequence));
        }
        TpPlan {
            rules,
            sequence_parallel,
        }
    }

    /// `gpt` plus the dense feed-forward (`w1` column-wise, `w2` row-wise).
    pub fn gpt_dense(sequence_parallel: bool) -> TpPlan {
        let mut plan = TpPlan::gpt(sequence_parallel);
        for (pattern, style) in [
            ("layers.*.feed_forward.w1", TpStyle::Colwise),
            ("layers.*.feed_forward.w2", TpStyle::Rowwise),
        ] {
            plan.rules.push(TpRule {
                pattern: pattern.to_owned(),
                style,
            });
        }
        plan
    }

    /// `gpt` for the mixture-of-experts decoder: experts replicated; under sequence
    /// parallelism each rank routes its own positions, so the router's and experts' gradients
    /// are partial and summed over TP.
    pub fn gpt_moe(sequence_parallel: bool) -> TpPlan {
        let mut plan = TpPlan::gpt(sequence_parallel);
        if sequence_parallel {
            for pattern in [
                "layers.*.moe.router",
                "layers.*.moe.experts.*.w1",
                "layers.*.moe.experts.*.w2",
            ] {
                plan.rules.push(TpRule {
                    pattern: pattern.to_owned(),
                    style: TpStyle::Sequence,
                });
            }
        }
        plan
    }

    /// The plan of the zoo's encoder-decoder transformer: every encoder and decoder layer's
    /// feed-forward, `linear1` column-wise and `linear2` row-wise (attention, embedding and
    /// output stay whole).
    pub fn transformer() -> TpPlan {
        let rules = [
            ("transformer.encoder.layers.*.linear1", TpStyle::Colwise),
            ("transformer.encoder.layers.*.linear2", TpStyle::Rowwise),
            ("transformer.decoder.layers.*.linear1", TpStyle::Colwise),
            ("transformer.decoder.layers.*.linear2", TpStyle::Rowwise),
        ]
        .into_iter()
        .map(|(pattern, style)| TpRule {
            pattern: pattern.to_owned(),
            style,
        })
        .collect();
        TpPlan {
            rules,
            sequence_parallel: false,
        }
    }

    /// The plan for a zoo model by name, if it has one.
    pub fn for_model(model: &str, sequence_parallel: bool) -> Result<TpPlan, TpPlanError> {
        match model {
            "gpt" | "gpt_dropout" => Ok(TpPlan::gpt_dense(sequence_parallel)),
            "gpt_moe" => Ok(TpPlan::gpt_moe(sequence_parallel)),
            "transformer" if !sequence_parallel => Ok(TpPlan::transformer()),
            "transformer" => Err(TpPlanError::Unsupported(
                "transformer with sequence parallelism (its plan splits the feed-forward only)"
                    .into(),
            )),
            other => Err(TpPlanError::Unsupported(other.to_owned())),
        }
    }

    /// Every parameter's placement under this plan at TP size `tp`, checked: each pattern
    /// matches a module, each sharded dimension divides, attention heads divide (`heads`:
    /// the head count when the plan splits attention by heads).
    pub fn placements(
        &self,
        model: &dyn Model,
        tp: usize,
        heads: Option<i64>,
    ) -> Result<BTreeMap<String, Placement>, TpPlanError> {
        if tp == 0 {
            return Err(TpPlanError::Size(tp));
        }
        if let Some(heads) = heads.filter(|h| h % tp as i64 != 0) {
            return Err(TpPlanError::Heads { heads, tp });
        }
        let params = model.named_parameters();
        let mut out: BTreeMap<String, Placement> = params
            .iter()
            .map(|(n, _)| (n.clone(), Placement::Replicated))
            .collect();
        for rule in &self.rules {
            let mut matched = false;
            for (name, t) in &params {
                let Some((module, leaf)) = name.rsplit_once('.') else {
                    continue;
                };
                if !matches_module(&rule.pattern, module) {
                    continue;
                }
                matched = true;
                let placement = match (rule.style, leaf) {
                    (TpStyle::Colwise, _) | (TpStyle::Vocab, "weight") => {
                        Placement::Shard { dim: 0 }
                    }
                    (TpStyle::Rowwise, "weight") => Placement::Shard { dim: 1 },
                    // Under SP the bias is added to this rank's sequence shard only.
                    (TpStyle::Rowwise, _) if self.sequence_parallel => Placement::PartialGrad,
                    (TpStyle::Rowwise, _) => Placement::Replicated,
                    (TpStyle::Sequence, _) => Placement::PartialGrad,
                    (TpStyle::Vocab, _) => Placement::Replicated,
                };
                if let Placement::Shard { dim } = placement {
                    let size = t.size().get(dim as usize).copied().unwrap_or(0);
                    if size % tp as i64 != 0 {
                        return Err(TpPlanError::Indivisible {
                            param: name.clone(),
                            style: rule.style,
                            dim,
                            size,
                            tp,
                        });
                    }
                }
                out.insert(name.clone(), placement);
            }
            if !matched {
                return Err(TpPlanError::NoMatch {
                    pattern: rule.pattern.clone(),
                    model: model.name().to_owned(),
                });
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_one_segment_per_star() {
        assert!(matches_module(
            "layers.*.attention.wq",
            "layers.0.attention.wq"
        ));
        assert!(!matches_module(
            "layers.*.attention.wq",
            "layers.0.attention.wk"
        ));
        assert!(!matches_module("layers.*", "layers.0.attention"));
        assert!(matches_module("norm", "norm"));
    }
}
