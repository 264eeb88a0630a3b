//! "Did you mean": the closest known name to a mistyped one, shared by every place that
//! rejects a configuration or model name (`matrix --configs`, `run --config`,
//! `sensitivity --config`, `ParityTest::config`), so they all suggest the same way.

/// The known name closest to `name`, when one is close enough to be a likely typo: one edit
/// away (a transposition counts as one), a normalized Damerau–Levenshtein similarity of at
/// least 0.7, or `name` is a prefix of it.
pub fn closest<'a, S: AsRef<str>>(name: &str, known: &'a [S]) -> Option<&'a str> {
    let want = name.trim().to_ascii_lowercase();
    if want.is_empty() {
        return None;
    }
    known
        .iter()
        .map(AsRef::as_ref)
        .map(|k| {
            let score = strsim::normalized_damerau_levenshtein(&want, &k.to_ascii_lowercase());
            (k, score)
        })
        .filter(|(k, score)| {
            *score >= 0.7
                || strsim::damerau_levenshtein(&want, &k.to_ascii_lowercase()) <= 1
                || (want.len() >= 3 && k.starts_with(want.as_str()))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(k, _)| k)
}

/// `" (did you mean `x`?)"` for the closest known name, or nothing: appended to an
/// "unknown name" message.
pub fn did_you_mean<S: AsRef<str>>(name: &str, known: &[S]) -> String {
    match closest(name, known) {
        Some(k) if k != name => format!(" (did you mean `{k}`?)"),
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_gets_the_nearest_name_and_nonsense_gets_none() {
        let known = [
            "ddp",
            "fsdp.full_shard",
            "fsdp.full_shard.per_layer",
            "tp.2",
        ];
        assert_eq!(closest("fsdp.fulll_shard", &known), Some("fsdp.full_shard"));
        assert_eq!(
            closest("fsdp.full_shard.perlayer", &known),
            Some("fsdp.full_shard.per_layer")
        );
        assert_eq!(closest("dpp", &known), Some("ddp"));
        assert_eq!(closest("pipeline", &known), None);
        assert_eq!(
            did_you_mean("fsdp.fulll_shard", &known),
            " (did you mean `fsdp.full_shard`?)"
        );
        assert_eq!(did_you_mean("zzz", &known), "");
    }
}
