//! Cutting a model's ordered layer list into contiguous stages, and placing stages on ranks.
//!
//! The methods are DeepSpeed's `partition_method`s: `uniform` balances layer counts,
//! `parameters` balances trainable parameter counts, `type:REGEX` balances the layers whose
//! kind matches, and explicit split points cut where the user says. Balanced cuts minimise
//! the heaviest stage (ties: the stage with most layers), found exactly by dynamic
//! programming — layer lists are short.

use super::PipelineError;
use lockstep_models::{LayerKind, LayerSpec, Model};
use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::str::FromStr;

/// How layers are assigned to stages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionMethod {
    /// Balance the number of layers per stage.
    Uniform,
    /// Balance trainable parameter counts (a tied weight counts in every layer using it).
    Parameters,
    /// Balance the number of layers whose kind matches the regex (case-insensitive), e.g.
    /// `type:block` balances decoder blocks; other layers weigh nothing.
    Type(String),
    /// Stage `k + 1` starts at layer `splits[k]` (strictly increasing, inside the list).
    Splits(Vec<usize>),
}

impl fmt::Display for PartitionMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PartitionMethod::Uniform => write!(f, "uniform"),
            PartitionMethod::Parameters => write!(f, "parameters"),
            PartitionMethod::Type(re) => write!(f, "type:{re}"),
            PartitionMethod::Splits(s) => write!(
                f,
                "splits:{}",
                s.iter()
                    .map(|i| i.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

impl FromStr for PartitionMethod {
    type Err = PipelineError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = |reason: String| PipelineError::Partition(reason);
        match text {
            "uniform" => Ok(PartitionMethod::Uniform),
            "parameters" => Ok(PartitionMethod::Parameters),
            _ => {
                if let Some(re) = text.strip_prefix("type:") {
                    regex::Regex::new(re)
                        .map_err(|e| bad(format!("`{text}`: invalid regex: {e}")))?;
                    Ok(PartitionMethod::Type(re.to_owned()))
                } else if let Some(list) = text.strip_prefix("splits:") {
                    let splits = list
                        .split(',')
                        .map(|s| s.trim().parse::<usize>())
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| {
                            bad(format!("`{text}`: split points must be layer indices: {e}"))
                        })?;
                    Ok(PartitionMethod::Splits(splits))
                } else {
                    Err(bad(format!(
                        "unknown partition method `{text}`; known: uniform, parameters, \
                         type:REGEX, splits:I,J,..."
                    )))
                }
            }
        }
    }
}

/// The name a `type:` regex is matched against.
pub fn kind_name(kind: LayerKind) -> String {
    format!("{kind:?}")
}

/// Cuts `layers` into `stages` contiguous, non-empty ranges of layer indices.
/// `param_count(name)` gives a parameter's number of elements (for `parameters`).
pub fn partition_layers(
    layers: &[LayerSpec],
    stages: usize,
    method: &PartitionMethod,
    param_count: &dyn Fn(&str) -> i64,
) -> Result<Vec<Range<usize>>, PipelineError> {
    let n = layers.len();
    if stages == 0 {
        return Err(PipelineError::Partition(
            "a pipeline needs at least one stage".into(),
        ));
    }
    if n < stages {
        return Err(PipelineError::Partition(format!(
            "{stages} stages need at least {stages} layers; the model has {n}"
        )));
    }
    let weights: Vec<i64> = match method {
        PartitionMethod::Uniform => vec![1; n],
        PartitionMethod::Parameters => layers
            .iter()
            .map(|l| l.params.iter().map(|p| param_count(p)).sum())
            .collect(),
        PartitionMethod::Type(re) => {
            let re = regex::RegexBuilder::new(re)
                .case_insensitive(true)
                .build()
                .map_err(|e| PipelineError::Partition(format!("type:{re}: {e}")))?;
            let w: Vec<i64> = layers
                .iter()
                .map(|l| i64::from(re.is_match(&kind_name(l.kind))))
                .collect();
            if w.iter().sum::<i64>() == 0 {
                let kinds: Vec<String> = layers.iter().map(|l| kind_name(l.kind)).collect();
                return Err(PipelineError::Partition(format!(
                    "type:{re} matches no layer kind; the model's kinds are {}",
                    kinds.join(", ")
                )));
            }
            w
        }
        PartitionMethod::Splits(splits) => return explicit(n, stages, splits),
    };
    Ok(balanced(&weights, stages))
}

fn explicit(n: usize, stages: usize, splits: &[usize]) -> Result<Vec<Range<usize>>, PipelineError> {
    if splits.len() + 1 != stages {
        return Err(PipelineError::Partition(format!(
            "{stages} stages need {} split points, got {}",
            stages - 1,
            splits.len()
        )));
    }
    let mut bounds = vec![0];
    bounds.extend_from_slice(splits);
    bounds.push(n);
    for w in bounds.windows(2) {
        if w[0] >= w[1] {
            return Err(PipelineError::Partition(format!(
                "split points {splits:?} must be strictly increasing inside 1..{n} (every stage \
                 needs a layer)"
            )));
        }
    }
    Ok(bounds.windows(2).map(|w| w[0]..w[1]).collect())
}

/// The contiguous cut of `weights` into `k` non-empty parts that minimises the heaviest part,
/// ties broken by the longest part, then by the earliest cut.
fn balanced(weights: &[i64], k: usize) -> Vec<Range<usize>> {
    let n = weights.len();
    let mut prefix = vec![0i64; n + 1];
    for (i, w) in weights.iter().enumerate() {
        prefix[i + 1] = prefix[i] + w;
    }
    // best[j][i]: the best (max weight, max length) splitting the first i layers into j parts.
    let inf = (i64::MAX, usize::MAX);
    let mut best = vec![vec![inf; n + 1]; k + 1];
    let mut cut = vec![vec![0usize; n + 1]; k + 1];
    best[0][0] = (0, 0);
    for j in 1..=k {
        for i in j..=n {
            for start in (j - 1)..i {
                let prev = best[j - 1][start];
                if prev == inf {
                    continue;
                }
                let cand = (prev.0.max(prefix[i] - prefix[start]), prev.1.max(i - start));
                // `<=`: on a tie the later cut wins, so earlier stages take the extra layer
                // (as DeepSpeed's uniform partition gives the residual to the first parts).
                if cand <= best[j][i] {
                    best[j][i] = cand;
                    cut[j][i] = start;
                }
            }
        }
    }
    let mut ranges = Vec::with_capacity(k);
    let mut end = n;
    for j in (1..=k).rev() {
        let start = cut[j][end];
        ranges.push(start..end);
        end = start;
    }
    ranges.reverse();
    ranges
}

/// Trainable element counts by every name a layer may list (aliases of tied weights too).
pub fn param_counts(model: &dyn Model) -> HashMap<String, i64> {
    let tags = model.tags();
    let counts: HashMap<String, i64> = model
        .named_parameters()
        .into_iter()
        .map(|(n, t)| (n, t.numel() as i64))
        .collect();
    let mut all = counts.clone();
    for g in &tags.shared {
        if let Some(&c) = counts.get(&g.canonical) {
            for a in &g.aliases {
                all.insert(a.clone(), c);
            }
        }
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layers(kinds: &[LayerKind], params: &[usize]) -> Vec<LayerSpec> {
        kinds
            .iter()
            .zip(params)
            .enumerate()
            .map(|(i, (k, &p))| LayerSpec {
                name: format!("l{i}"),
                kind: *k,
                params: (0..p).map(|j| format!("l{i}.p{j}")).collect(),
            })
            .collect()
    }

    #[test]
    fn uniform_balances_counts() {
        let l = layers(&[LayerKind::Linear; 5], &[1; 5]);
        let r = partition_layers(&l, 2, &PartitionMethod::Uniform, &|_| 1).unwrap();
        assert_eq!(r, vec![0..3, 3..5]);
        let r = partition_layers(&l, 5, &PartitionMethod::Uniform, &|_| 1).unwrap();
        assert_eq!(r.len(), 5);
    }

    #[test]
    fn parameters_balance_weights() {
        // Weights 10, 1, 1, 1, 10: the best 2-cuts keep each heavy layer apart (11 | 12 or
        // 12 | 11); on the tie the first stage takes the extra layer.
        let l = layers(&[LayerKind::Linear; 5], &[10, 1, 1, 1, 10]);
        let r = partition_layers(&l, 2, &PartitionMethod::Parameters, &|_| 1).unwrap();
        assert_eq!(r, vec![0..3, 3..5]);
        // 10, 1, 1, 10, 1, 1: only 10+1+1 | 10+1+1 reaches 12.
        let l = layers(&[LayerKind::Linear; 6], &[10, 1, 1, 10, 1, 1]);
        let r = partition_layers(&l, 2, &PartitionMethod::Parameters, &|_| 1).unwrap();
        assert_eq!(r, vec![0..3, 3..6]);
    }

    #[test]
    fn type_balances_matching_layers() {
        use LayerKind::*;
        let l = layers(
            &[
                Embedding,
                Embedding,
                DecoderBlock,
                DecoderBlock,
                LayerNorm,
                OutputProjection,
            ],
            &[1; 6],
        );
        let m: PartitionMethod = "type:decoderblock".parse().unwrap();
        let r = partition_layers(&l, 2, &m, &|_| 1).unwrap();
        assert_eq!(r.iter().filter(|r| r.contains(&2)).count(), 1);
        assert!(r[0].contains(&2) && r[1].contains(&3), "{r:?}");
        let none: PartitionMethod = "type:^conv".parse().unwrap();
        let e = partition_layers(&l, 2, &none, &|_| 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("matches no layer kind") && e.contains("DecoderBlock"),
            "{e}"
        );
    }

    #[test]
    fn explicit_splits_are_checked() {
        let l = layers(&[LayerKind::Linear; 4], &[1; 4]);
        let m: PartitionMethod = "splits:1,3".parse().unwrap();
        assert_eq!(
            partition_layers(&l, 3, &m, &|_| 1).unwrap(),
            vec![0..1, 1..3, 3..4]
        );
        let e = partition_layers(&l, 2, &m, &|_| 1).unwrap_err().to_string();
        assert!(e.contains("need 1 split points, got 2"), "{e}");
        let bad: PartitionMethod = "splits:2,2".parse().unwrap();
        assert!(partition_layers(&l, 3, &bad, &|_| 1).is_err());
        let e = partition_layers(&l, 5, &PartitionMethod::Uniform, &|_| 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("5 stages need at least 5 layers"), "{e}");
        assert!("nonsense".parse::<PartitionMethod>().is_err());
    }
}
