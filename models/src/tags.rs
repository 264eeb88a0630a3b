//! Which parameters parallelisms must treat specially: tied ones (one tensor under several
//! module paths), expert ones (placeable on one rank) and rank-local ones (never reduced).
//! Data a model's store keeps and every parallelism reads.

/// Parameters used under several names (the tied embedding / output projection): one
/// tensor, one gradient (the sum of both uses), counted once in norms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedGroup {
    /// The name `named_parameters` and state files use (PyTorch keeps the first).
    pub canonical: String,
    /// The other module paths that refer to the same tensor.
    pub aliases: Vec<String>,
}

/// A parameter that belongs to one expert, which expert parallelism may place on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertParam {
    /// The parameter's module path.
    pub name: String,
    /// The expert's index within its layer.
    pub expert: usize,
}

/// Groups of parameters that parallelisms must treat specially.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParamTags {
    /// Tied parameters: one tensor under several module paths.
    pub shared: Vec<SharedGroup>,
    /// Parameters owned by one expert, which expert parallelism may place on one rank.
    pub experts: Vec<ExpertParam>,
    /// Parameters that differ on every rank by construction and must never be averaged
    /// across ranks (`MixtureOfExperts`' expert in PyTorch's tests).
    pub rank_local: Vec<String>,
}

impl ParamTags {
    /// Whether `name` is an expert parameter.
    pub fn is_expert(&self, name: &str) -> bool {
        self.experts.iter().any(|e| e.name == name)
    }

    /// Whether `name` differs per rank and must not be reduced.
    pub fn is_rank_local(&self, name: &str) -> bool {
        self.rank_local.iter().any(|n| n == name)
    }

    /// The canonical name of `name` (itself unless it is an alias of a tied parameter).
    pub fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.shared
            .iter()
            .find(|g| g.aliases.iter().any(|a| a == name))
            .map_or(name, |g| g.canonical.as_str())
    }
}
