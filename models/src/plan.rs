//! Parallelization plans: which modules a parallelism splits and how, by module-path
//! pattern, as torchtitan's `parallelize_module` plans are written. A model offers its own
//! ([`crate::Model::parallel_plan`]) and a user may pass another; the model's forward runs
//! unchanged and the hooks of its module calls ([`crate::LayerHooks`]' module-level calls) apply the plan.
//! This crate only describes plans: applying them needs process groups and lives in
//! `lockstep-core`.

/// How the modules a rule matches are placed and computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParallelStyle {
    /// A linear split by output features (weight and bias dim 0): column-parallel; its
    /// output stays split by features (or by heads, for attention projections).
    Colwise,
    /// A linear split by input features (weight dim 1; the bias stays whole, added after the
    /// reduction): row-parallel; its input is a column-parallel output.
    Rowwise,
    /// Vocabulary rows split: on an embedding, a vocabulary-parallel lookup; on a linear
    /// (a tied output projection), logits split by vocabulary and the loss of that module's
    /// logits computed vocabulary-parallel (loss parallel).
    Vocab,
    /// Whole on every rank but run on sequence shards under sequence parallelism (norms,
    /// anything token-wise): gradients are partial and summed over the TP group.
    Sequence,
    /// A mixture-of-experts module whose experts are spread over the expert-parallel group
    /// (replicated when no expert parallelism runs).
    Expert,
    /// A dropout site whose activation is split along `dim` (of the activation, batch
    /// first): every rank draws the full mask a single device draws and keeps its slice.
    ShardedDropout {
        /// The activation dimension the split runs along (negative counts from the end).
        dim: i64,
    },
    /// Whole on every rank: the same as no rule (for overriding a broader pattern).
    Replicated,
}

/// One rule of a plan: a module-path pattern (`*` stands for one path segment, e.g.
/// `layers.*.attention.wq`) and its style.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRule {
    /// Module path pattern; it must match at least one module the model names.
    pub pattern: String,
    /// How the matched modules are split.
    pub style: ParallelStyle,
}

/// A parallelization plan: rules in order (the first match wins), whether hidden states
/// between blocks live on sequence shards, and the attention head count whole heads must
/// split by.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParallelPlan {
    /// The rules in order; a module matched by no rule stays replicated.
    pub rules: Vec<PlanRule>,
    /// Megatron's sequence parallelism: the hidden state enters sequence shards at the first
    /// layer holding a [`ParallelStyle::Sequence`] module and column-parallel entries
    /// all-gather it.
    pub sequence_parallel: bool,
    /// Attention heads of the column-split projections (checked to divide by the TP size).
    pub heads: Option<i64>,
}

impl ParallelPlan {
    /// An empty plan (every module replicated) with sequence parallelism on or off.
    pub fn new(sequence_parallel: bool) -> Self {
        ParallelPlan {
            rules: Vec::new(),
            sequence_parallel,
            heads: None,
        }
    }

    /// Adds a rule (builder style).
    pub fn rule(mut self, pattern: &str, style: ParallelStyle) -> Self {
        self.rules.push(PlanRule {
            pattern: pattern.to_owned(),
            style,
        });
        self
    }

    /// Declares the head count the attention projections split by.
    pub fn with_heads(mut self, heads: i64) -> Self {
        self.heads = Some(heads);
        self
    }

    /// The style of module `path`: the first matching rule's, if any.
    pub fn style_of(&self, path: &str) -> Option<ParallelStyle> {
        self.rules
            .iter()
            .find(|r| matches_module(&r.pattern, path))
            .map(|r| r.style)
    }

    /// Whether any rule splits something across a tensor-parallel group (experts and
    /// replicated rules do not).
    pub fn splits_tensors(&self) -> bool {
        self.rules
            .iter()
            .any(|r| !matches!(r.style, ParallelStyle::Expert | ParallelStyle::Replicated))
    }
}

/// Whether the module path `module` matches `pattern` (`*` = exactly one segment).
pub fn matches_module(pattern: &str, module: &str) -> bool {
    let p: Vec<&str> = pattern.split('.').collect();
    let m: Vec<&str> = module.split('.').collect();
    p.len() == m.len() && p.iter().zip(&m).all(|(a, b)| *a == "*" || a == b)
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

    #[test]
    fn first_rule_wins() {
        let plan = ParallelPlan::new(false)
            .rule("layers.0.w", ParallelStyle::Replicated)
            .rule("layers.*.w", ParallelStyle::Colwise);
        assert_eq!(plan.style_of("layers.0.w"), Some(ParallelStyle::Replicated));
        assert_eq!(plan.style_of("layers.1.w"), Some(ParallelStyle::Colwise));
        assert_eq!(plan.style_of("norm"), None);
    }
}
