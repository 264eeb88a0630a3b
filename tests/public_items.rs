//! Every public function of `lockstep-core` is run by some row of the default matrix, or the
//! project says why not.
//!
//! `ci/coverage` runs the default matrix under an instrumented build and then this test with
//! `LOCKSTEP_LCOV` set to its line report: the test maps every `pub fn` of `core/src` to
//! whether the matrix executed it and writes the result to [`SNAPSHOT`] (committed). Without
//! the variable (as in `ci/test`), the test checks that snapshot against today's sources:
//!
//! - every `pub fn` of `core/src` is in it (a new one is unmeasured: rerun `ci/coverage`);
//! - every item in it still exists (a removed or renamed one is stale: rerun it);
//! - every item the matrix does not reach matches a reason in [`REASONS`];
//! - every reason still matches an unreached item (no reason outlives its code).
//!
//! An item is `file::Type::name` (`ddp.rs::Ddp::new`) or `file::name` for a free function,
//! the file relative to `core/src`. Functions in `#[cfg(test)]` modules are not items.

use crate::common;

use lockstep::matrix::matches;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The last measurement: `reached <item>` or `unreached <item>` per line.
const SNAPSHOT: &str = "ci/public-items.txt";
/// Why an item no row reaches is fine: `<pattern> | <reason>` per line (`*` matches any run
/// of characters; `#` starts a comment).
const REASONS: &str = "ci/unreached-reasons.txt";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A `pub fn` of `core/src` and the line its signature starts on.
#[derive(Debug)]
struct Item {
    id: String,
    file: PathBuf,
    line: usize,
}

/// The type an `impl` line at column 0 implements methods on (`None` for a trait impl, whose
/// methods are the trait's, not `pub fn`s).
fn impl_type(line: &str) -> Option<String> {
    let mut rest = line.strip_prefix("impl")?;
    if rest.starts_with('<') {
        let mut depth = 0;
        let end = rest.char_indices().find_map(|(i, c)| {
            match c {
                '<' => depth += 1,
                '>' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(i)
        })?;
        rest = &rest[end + 1..];
    }
    if rest.contains(" for ") {
        return None;
    }
    let name: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Every `pub fn` of `core/src`, outside `#[cfg(test)]` modules.
fn public_items() -> Vec<Item> {
    let src = root().join("core/src");
    let mut files = Vec::new();
    common::rust_files(&src, &mut files);
    let mut items = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).expect("a readable source file");
        let rel = file.strip_prefix(&src).expect("under core/src");
        let rel = rel.to_string_lossy().replace('\\', "/");
        let lines: Vec<&str> = text.lines().collect();
        let mut ty: Option<String> = None;
        let mut skip_until: Option<String> = None;
        for (i, line) in lines.iter().enumerate() {
            if let Some(end) = &skip_until {
                if line == end {
                    skip_until = None;
                }
                continue;
            }
            if line.trim() == "#[cfg(test)]" {
                let next = lines[i + 1..].iter().find(|l| !l.trim().is_empty());
                if let Some(next) = next.filter(|l| l.trim_start().starts_with("mod ")) {
                    if next.trim_end().ends_with('{') {
                        let indent = &next[..next.len() - next.trim_start().len()];
                        skip_until = Some(format!("{indent}}}"));
                    }
                }
                continue;
            }
            if line.starts_with("impl") {
                ty = impl_type(line);
            } else if *line == "}" {
                ty = None;
            }
            if let Some(after) = line.trim_start().strip_prefix("pub fn ") {
                let name: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect();
                let id = match &ty {
                    Some(t) if line.starts_with("    ") => format!("{rel}::{t}::{name}"),
                    _ => format!("{rel}::{name}"),
                };
                items.push(Item {
                    id,
                    file: file.clone(),
                    line: i + 1,
                });
            }
        }
    }
    items
}

/// Per source file of an lcov report, the execution count of each function by its first line.
fn lcov_functions(lcov: &str) -> BTreeMap<PathBuf, BTreeMap<usize, u64>> {
    let mut out: BTreeMap<PathBuf, BTreeMap<usize, u64>> = BTreeMap::new();
    let mut file = PathBuf::new();
    let mut line_of: BTreeMap<String, usize> = BTreeMap::new();
    for l in lcov.lines() {
        if let Some(path) = l.strip_prefix("SF:") {
            file = PathBuf::from(path);
            line_of.clear();
        } else if let Some(rest) = l.strip_prefix("FN:") {
            if let Some((line, name)) = rest.split_once(',') {
                line_of.insert(name.to_owned(), line.parse().unwrap_or(0));
            }
        } else if let Some(rest) = l.strip_prefix("FNDA:") {
            if let Some((count, name)) = rest.split_once(',') {
                if let Some(&line) = line_of.get(name) {
                    let n = out
                        .entry(file.clone())
                        .or_default()
                        .entry(line)
                        .or_default();
                    *n = (*n).max(count.parse().unwrap_or(0));
                }
            }
        }
    }
    out
}

/// Writes [`SNAPSHOT`] from an lcov report of the default matrix.
fn write_snapshot(lcov_path: &Path, items: &[Item]) {
    let lcov = std::fs::read_to_string(lcov_path).expect("LOCKSTEP_LCOV names a readable file");
    let functions = lcov_functions(&lcov);
    let mut text = String::from(
        "# Written by ci/coverage (tests/public_items.rs): whether the default matrix \
         executes each pub fn of core/src.\n",
    );
    for item in items {
        let counts = functions.get(&item.file);
        // The function's span starts at its signature (attributes aside).
        let reached = counts.is_some_and(|c| c.get(&item.line).is_some_and(|&n| n > 0));
        let state = if reached { "reached" } else { "unreached" };
        text.push_str(&format!("{state} {}\n", item.id));
    }
    std::fs::write(root().join(SNAPSHOT), text).expect("the snapshot is writable");
}

fn reasons() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(root().join(REASONS)).expect("ci/unreached-reasons.txt");
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (pattern, reason) = l
                .split_once(" | ")
                .unwrap_or_else(|| panic!("{REASONS}: `{l}` is not `<pattern> | <reason>`"));
            (pattern.trim().to_owned(), reason.trim().to_owned())
        })
        .collect()
}

/// What is wrong between today's `items`, a `snapshot` ([`SNAPSHOT`]'s text) and `reasons`:
/// one message per kind of problem, naming the functions (empty when all is well).
fn problems(items: &[&str], snapshot: &str, reasons: &[(String, String)]) -> Vec<String> {
    let mut measured: BTreeMap<&str, bool> = BTreeMap::new();
    let mut out = Vec::new();
    for l in snapshot.lines().filter(|l| !l.starts_with('#')) {
        match l.split_once(' ') {
            Some(("reached", id)) => measured.insert(id, true),
            Some(("unreached", id)) => measured.insert(id, false),
            _ => {
                out.push(format!(
                    "{SNAPSHOT}: `{l}` is not `reached|unreached <item>`"
                ));
                None
            }
        };
    }
    let current: BTreeSet<&str> = items.iter().copied().collect();
    let unmeasured: Vec<&str> = current
        .iter()
        .copied()
        .filter(|id| !measured.contains_key(id))
        .collect();
    if !unmeasured.is_empty() {
        out.push(format!(
            "public functions of core/src the last ci/coverage did not see (new or renamed: \
             rerun ci/coverage, which rewrites {SNAPSHOT}): {unmeasured:?}"
        ));
    }
    let stale: Vec<&str> = measured
        .keys()
        .copied()
        .filter(|id| !current.contains(id))
        .collect();
    if !stale.is_empty() {
        out.push(format!(
            "{SNAPSHOT} names functions core/src no longer has (rerun ci/coverage): {stale:?}"
        ));
    }
    let unreached: Vec<&str> = measured
        .iter()
        .filter(|(_, &reached)| !reached)
        .map(|(&id, _)| id)
        .collect();
    let unexplained: Vec<&str> = unreached
        .iter()
        .copied()
        .filter(|id| !reasons.iter().any(|(p, _)| matches(p, id)))
        .collect();
    if !unexplained.is_empty() {
        out.push(format!(
            "public functions of core no row of the default matrix runs, with no reason in \
             {REASONS} (give a row that runs them, remove them from the public API, or state \
             why not): {unexplained:?}"
        ));
    }
    let idle: Vec<&str> = reasons
        .iter()
        .filter(|(p, _)| !unreached.iter().any(|id| matches(p, id)))
        .map(|(p, _)| p.as_str())
        .collect();
    if !idle.is_empty() {
        out.push(format!(
            "reasons in {REASONS} that match no unreached function (the code is run now, or \
             gone): {idle:?}"
        ));
    }
    out
}

#[test]
fn every_public_function_of_core_is_run_by_a_row_or_says_why_not() {
    let items = public_items();
    if let Some(lcov) = std::env::var_os("LOCKSTEP_LCOV") {
        write_snapshot(Path::new(&lcov), &items);
    }
    let snapshot = std::fs::read_to_string(root().join(SNAPSHOT)).expect("ci/public-items.txt");
    let ids: Vec<&str> = items.iter().map(|i| i.id.as_str()).collect();
    let found = problems(&ids, &snapshot, &reasons());
    assert!(found.is_empty(), "{}", found.join("\n"));
}

/// The check itself, on a planted case: a public function no row runs and no reason covers
/// fails, by name; so do a new function never measured, a removed one still listed, and a
/// reason left behind by code that is now run.
#[test]
fn an_unreached_function_without_a_reason_fails_by_name() {
    let reason = |p: &str| (p.to_owned(), "a stated reason".to_owned());
    let items = ["a.rs::run", "a.rs::Tool::helper", "b.rs::new_api"];
    let snapshot = "reached a.rs::run\nunreached a.rs::Tool::helper\nunreached b.rs::new_api\n";
    let all_explained = [reason("a.rs::Tool::*"), reason("b.rs::*")];
    assert!(problems(&items, snapshot, &all_explained).is_empty());
    let found = problems(&items, snapshot, &[reason("a.rs::Tool::*")]).join("\n");
    assert!(
        found.contains("no reason") && found.contains("b.rs::new_api"),
        "{found}"
    );
    let found = problems(&items[..2], snapshot, &all_explained).join("\n");
    assert!(
        found.contains("no longer has") && found.contains("b.rs::new_api"),
        "{found}"
    );
    let found = problems(
        &[&items[..], &["c.rs::fresh"]].concat(),
        snapshot,
        &all_explained,
    );
    assert!(found.join("\n").contains("c.rs::fresh"), "{found:?}");
    let idle = [
        reason("a.rs::Tool::*"),
        reason("b.rs::*"),
        reason("a.rs::run"),
    ];
    let found = problems(&items, snapshot, &idle).join("\n");
    assert!(
        found.contains("match no unreached") && found.contains("a.rs::run"),
        "{found}"
    );
}

#[test]
fn items_are_named_by_file_type_and_function() {
    let items = public_items();
    let ids: BTreeSet<&str> = items.iter().map(|i| i.id.as_str()).collect();
    assert!(ids.contains("ddp/mod.rs::Ddp::new"), "{ids:#?}");
    assert!(ids.contains("mixed_reference.rs::mixed_precision_reference"));
    assert!(ids.contains("mixed_reference.rs::HalfType::kind"));
    // Test modules hold no items.
    assert!(!ids.iter().any(|id| id.contains("::tests::")));
    assert!(matches(
        "fsdp/state.rs::*",
        "fsdp/state.rs::Fsdp::state_dict"
    ));
    assert!(matches("*::no_sync", "fsdp/mod.rs::Fsdp::no_sync"));
    assert!(!matches("fsdp/mod.rs::*", "fsdp/state.rs::x"));
}
