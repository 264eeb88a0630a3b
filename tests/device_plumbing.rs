//! Every configuration's training code creates its tensors on the device its parameters and
//! activations live on, so a run whose model `OnDevice` moved to `cuda:N` never mixes devices
//! (an NCCL group takes tensors on its own device only; a CPU tensor meeting a CUDA one fails
//! the op, or worse, a CPU fallback hides until the first GPU run). CI has no GPU, so the proof
//! here is a source scan of the non-test code under `core/src` and `models/src`: it fails on
//! every tensor created pinned to the CPU unless the site is on [`ALLOWED`] with its reason.
//!
//! What counts as pinned:
//! - `Device::Cpu` anywhere (an options tuple, a host copy, a default, a comparison);
//! - an identifier ending in `_CPU` (tch's `FLOAT_CPU`, `INT64_CPU`… options constants);
//! - a constant whose definition holds either of those (the models' `F32`), wherever it is used
//!   in its crate (imports aside);
//! - `Tensor::from_slice`, `f_from_slice`, `from_slice2`, `of_slice` or `Tensor::from(`, which
//!   create on the CPU, unless the same expression moves the result with `to_device`.
//!
//! Comments, string literals and `#[cfg(test)]` items are not scanned. An allowlist entry names a
//! file and a snippet of the flagged statement (not a line number, so edits elsewhere keep it
//! valid); it must match exactly one statement, and one that matches nothing is stale and fails
//! too, so the list only ever describes the code as it is.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The trees scanned, each its own crate (a constant's uses are looked for in its own crate).
const ROOTS: [&str; 2] = ["core/src", "models/src"];

/// A deliberate CPU site: where data leaves the training math (records, digests, checkpoints,
/// host-side reads), where a model is built or its batch generated before `OnDevice` moves it,
/// or where the host is the point (offloading, the CPU backend's staging).
struct Allowed {
    /// The file, relative to the repository root.
    file: &'static str,
    /// A piece of the flagged statement, whitespace-insensitive, distinctive in its file.
    snippet: &'static str,
    /// Why the CPU is right there.
    why: &'static str,
}

const ALLOWED: &[Allowed] = &[
    // core: data leaving the training math.
    Allowed {
        file: "core/src/record.rs",
        snippet: ".f_to_device(tch::Device::Cpu)?\n.f_to_kind(tch::Kind::Double)?",
        why: "a record keeps host values for the host-side comparison",
    },
    Allowed {
        file: "core/src/consistency.rs",
        snippet: "let host = tensor",
        why: "a cross-rank digest hashes the tensor's bytes on the host",
    },
    Allowed {
        file: "core/src/replica.rs",
        snippet: "Vec::try_from(&all.f_to_device(tch::Device::Cpu)?)?",
        why: "the model check reads the gathered lengths and hashes on the host to compare them",
    },
    Allowed {
        file: "core/src/replica.rs",
        snippet: "Vec::try_from(&bytes.f_to_device(tch::Device::Cpu)?)?",
        why: "the model check decodes a rank's tensor descriptions (text) on the host",
    },
    Allowed {
        file: "models/src/decisions.rs",
        snippet: ".f_reshape([-1])?\n.f_to_device(tch::Device::Cpu)?",
        why: "the dropping reference's capacity scan reads routing choices on the host; its \
              mask goes back to their device",
    },
    Allowed {
        file: "core/src/expert_parallel/router.rs",
        snippet: "f_reshape([-1])?\n.f_to_device(tch::Device::Cpu)?",
        why: "the capacity scan reads routing choices on the host; its mask goes back to their \
              device",
    },
    Allowed {
        file: "core/src/fsdp/state.rs",
        snippet: "t.f_to_device(Device::Cpu)?.f_contiguous()?",
        why: "a checkpoint is written from host memory (safetensors)",
    },
    Allowed {
        file: "core/src/fsdp/mod.rs",
        snippet: "let master_device = if core.opts.offload_params",
        why: "offload_params keeps the master shards in host memory by design (FSDP's CPU \
              offload); gathers and reductions still run on the compute device",
    },
    // core: the communication layer's own host paths.
    Allowed {
        file: "core/src/comm/cpu/tensor.rs",
        snippet: "let on_host = t.device() == Device::Cpu",
        why: "a comparison: the CPU backend skips staging a tensor already on the host",
    },
    Allowed {
        file: "core/src/comm/cpu/tensor.rs",
        snippet: "t.f_to_device(Device::Cpu)?.f_contiguous()?",
        why: "the CPU backend stages any device's tensor through host memory and copies back",
    },
    Allowed {
        file: "core/src/comm/faulty/alter.rs",
        snippet: "let host = t",
        why: "the fault-injecting group compares two tensors' bytes on the host",
    },
    // models: built on the CPU, batches generated there; OnDevice moves both.
    Allowed {
        file: "models/src/store.rs",
        snippet: "const F32: (Kind, Device) = (Kind::Float, Device::Cpu)",
        why: "models are initialized on the CPU in fp32 (PyTorch's CPU draws); OnDevice moves \
              them",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "Tensor::f_empty([out_features, in_features], F32)",
        why: "initialization (Linear weight), moved by OnDevice",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "Tensor::f_empty([out_features], F32)",
        why: "initialization (Linear bias), moved by OnDevice",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "Tensor::f_empty(shape, F32)?.f_normal_(0.0, 1.0)",
        why: "initialization (normal), moved by OnDevice",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "Tensor::f_ones(shape, F32)",
        why: "initialization (ones), moved by OnDevice",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "Tensor::f_zeros(shape, F32)",
        why: "initialization (zeros), moved by OnDevice",
    },
    Allowed {
        file: "models/src/store.rs",
        snippet: "t.f_detach()?.f_to_device(Device::Cpu)?.f_contiguous()?",
        why: "saving a store writes host tensors (safetensors)",
    },
    Allowed {
        file: "models/src/layers.rs",
        snippet: "Tensor::f_empty([3 * dim, dim], F32)",
        why: "initialization (attention's in-projection), moved by OnDevice",
    },
    Allowed {
        file: "models/src/layers.rs",
        snippet: "\"num_batches_tracked\"",
        why: "initialization (a BatchNorm buffer), moved by OnDevice",
    },
    Allowed {
        file: "models/src/zoo/transformer.rs",
        snippet: "store.buffer(\"vocab_bias\", Tensor::f_ones([D_MODEL], F32)?)",
        why: "initialization (a buffer), moved by OnDevice",
    },
    Allowed {
        file: "models/src/zoo/transformer.rs",
        snippet: "\"long_buffer\"",
        why: "initialization (an int64 buffer), moved by OnDevice",
    },
    Allowed {
        file: "models/src/zoo/transformer.rs",
        snippet: "Tensor::f_arange(n, (Kind::Int64, tch::Device::Cpu))?",
        why: "a batch's token ids, generated on the host; OnDevice moves every batch",
    },
    Allowed {
        file: "models/src/zoo/gpt.rs",
        snippet: "let opts = (Kind::Int64, tch::Device::Cpu)",
        why: "a batch's tokens, drawn from the CPU generator; OnDevice moves every batch",
    },
    Allowed {
        file: "models/src/zoo/gpt.rs",
        snippet: "inputs.push(Tensor::from_slice(&keys))",
        why: "a batch's dropout keys, generated on the host; OnDevice moves every batch",
    },
    Allowed {
        file: "models/src/zoo/mlp.rs",
        snippet: "Tensor::f_rand([BATCH, self.sizes[0]], F32)",
        why: "a batch, drawn from the CPU generator; OnDevice moves every batch",
    },
    Allowed {
        file: "models/src/zoo/nested.rs",
        snippet: "Tensor::f_rand([4, 8], F32)",
        why: "a batch, drawn from the CPU generator; OnDevice moves every batch",
    },
    Allowed {
        file: "models/src/seed.rs",
        snippet: "tch::Tensor::f_rand(per_sample, (tch::Kind::Float, tch::Device::Cpu))",
        why: "dropout masks come from the CPU generator (the same bits on every device); the \
              dropout hook moves the mask to the activations' device",
    },
    Allowed {
        file: "models/src/device.rs",
        snippet: "OnDevice::placed(inner, Device::Cpu, Some(Kind::Double))",
        why: "the fp64 arbiter's shadow reference trains on the CPU by design",
    },
    Allowed {
        file: "models/src/device.rs",
        snippet: "if device != Device::Cpu || float_kind.is_some()",
        why: "a comparison: a model staying on the CPU in fp32 needs no move",
    },
    Allowed {
        file: "models/src/device.rs",
        snippet: "if self.device == Device::Cpu && self.float_kind.is_none()",
        why: "a comparison: a batch staying on the CPU in fp32 needs no move",
    },
];

/// One CPU-pinned site the scan found.
#[derive(Clone, Debug)]
struct Finding {
    /// Relative to the repository root, `/`-separated.
    file: String,
    line: usize,
    /// What pinned it.
    what: String,
    /// The byte offset where its statement starts (two findings in one statement share it).
    statement: usize,
    /// The statement up to the end of the flagged expression, whitespace collapsed.
    context: String,
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn is_ident(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// `src` with every comment and the inside of every string and char literal replaced by
/// spaces (newlines kept), byte for byte: offsets and line numbers stay those of `src`.
fn blank(src: &str) -> Vec<u8> {
    let s = src.as_bytes();
    let mut out = s.to_vec();
    let wipe = |out: &mut Vec<u8>, from: usize, to: usize| {
        for b in &mut out[from..to.min(s.len())] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
    };
    let mut i = 0;
    while i < s.len() {
        let prev_ident = i > 0 && is_ident(s[i - 1]);
        if s[i..].starts_with(b"//") {
            let end = s[i..]
                .iter()
                .position(|&b| b == b'\n')
                .map_or(s.len(), |p| i + p);
            wipe(&mut out, i, end);
            i = end;
        } else if s[i..].starts_with(b"/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < s.len() {
                if s[j..].starts_with(b"/*") {
                    depth += 1;
                    j += 2;
                } else if s[j..].starts_with(b"*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            wipe(&mut out, i, j);
            i = j;
        } else if !prev_ident && (s[i] == b'r' || s[i..].starts_with(b"br")) && raw_start(s, i) {
            // r"…", r#"…"#, br"…": no escapes, closed by `"` and as many `#`.
            let mut j = i + if s[i] == b'b' { 2 } else { 1 };
            let hashes = s[j..].iter().take_while(|&&b| b == b'#').count();
            j += hashes + 1;
            let mut close = vec![b'"'];
            close.extend(std::iter::repeat_n(b'#', hashes));
            let end = find(s, j, &close).map_or(s.len(), |p| p + close.len());
            wipe(&mut out, j, end.saturating_sub(close.len()));
            i = end;
        } else if s[i] == b'"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != b'"' {
                j += if s[j] == b'\\' { 2 } else { 1 };
            }
            wipe(&mut out, i + 1, j);
            i = j + 1;
        } else if s[i] == b'\'' {
            // A char literal ('x', '\n', '\u{…}', a multi-byte char) or a lifetime / label.
            let end = if s.get(i + 1) == Some(&b'\\') {
                find(s, i + 3, b"'").map(|p| p + 1)
            } else {
                let width = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                (s.get(i + 1 + width) == Some(&b'\'')).then_some(i + 2 + width)
            };
            match end {
                Some(end) => {
                    wipe(&mut out, i + 1, end - 1);
                    i = end;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    out
}

/// Whether a raw string literal starts at `i` (`r` or `br`, any `#`, then `"`).
fn raw_start(s: &[u8], i: usize) -> bool {
    let j = i + if s[i] == b'b' { 2 } else { 1 };
    let hashes = s[j.min(s.len())..]
        .iter()
        .take_while(|&&b| b == b'#')
        .count();
    s.get(j + hashes) == Some(&b'"')
}

fn find(s: &[u8], from: usize, needle: &[u8]) -> Option<usize> {
    (from..=s.len().saturating_sub(needle.len())).find(|&p| s[p..].starts_with(needle))
}

/// The end of the bracketed group opening at `open` (just past its closing bracket).
fn close_of(code: &[u8], open: usize) -> usize {
    let mut depth = 0usize;
    for (j, &b) in code.iter().enumerate().skip(open) {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => {
                depth -= 1;
                if depth == 0 {
                    return j + 1;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Blanks every `#[cfg(test)]` item of `code` (attribute and item) and returns the names of
/// the out-of-line test modules (`#[cfg(test)] mod name;`).
fn strip_test_items(code: &mut [u8]) -> Vec<String> {
    const ATTR: &[u8] = b"#[cfg(test)]";
    let mut external = Vec::new();
    let mut from = 0;
    while let Some(at) = find(code, from, ATTR) {
        let mut j = at + ATTR.len();
        // Further attributes of the same item.
        loop {
            while j < code.len() && code[j].is_ascii_whitespace() {
                j += 1;
            }
            if code[j..].starts_with(b"#[") {
                j = close_of(code, j + 1);
            } else {
                break;
            }
        }
        let item = j;
        let mut depth = 0usize;
        let end = loop {
            match code.get(j) {
                None => break code.len(),
                Some(b'(' | b'[') => depth += 1,
                Some(b')' | b']') => depth = depth.saturating_sub(1),
                Some(b';') if depth == 0 => {
                    let head = String::from_utf8_lossy(&code[item..j]).into_owned();
                    let words: Vec<&str> = head.split_whitespace().collect();
                    if let Some(p) = words.iter().position(|w| *w == "mod") {
                        if let Some(name) = words.get(p + 1) {
                            external.push((*name).to_owned());
                        }
                    }
                    break j + 1;
                }
                Some(b'{') if depth == 0 => break close_of(code, j),
                _ => {}
            }
            j += 1;
        };
        for b in &mut code[at..end] {
            if *b != b'\n' {
                *b = b' ';
            }
        }
        from = end;
    }
    external
}

/// Where the statement holding offset `at` starts: after the nearest `;`, `{` or `}` before it.
fn statement_start(code: &[u8], at: usize) -> usize {
    code[..at]
        .iter()
        .rposition(|&b| matches!(b, b';' | b'{' | b'}'))
        .map_or(0, |p| p + 1)
}

/// Where the statement holding offset `at` ends: at its `;`, or at the `}` closing the block
/// it sits in.
fn statement_end(code: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    for (j, &b) in code.iter().enumerate().skip(at) {
        match b {
            b'{' => depth += 1,
            b'}' if depth == 0 => return j,
            b'}' => depth -= 1,
            b';' if depth == 0 => return j,
            _ => {}
        }
    }
    code.len()
}

/// The start of the line holding offset `at`.
fn line_start(code: &[u8], at: usize) -> usize {
    code[..at]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |p| p + 1)
}

/// Where the text an allowlist snippet is matched against starts, for the statement starting
/// at `start`: the beginning of its first line, or of the line opening its block when it is
/// the block's first statement (`if offload {`, `seeded(seed, || {`), so the snippet can name
/// what the site is for.
fn context_start(code: &[u8], start: usize) -> usize {
    if start > 0 && code[start - 1] == b'{' {
        return line_start(code, start - 1);
    }
    let first = code[start..]
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .map_or(start, |p| start + p);
    line_start(code, first)
}

/// Where the expression starting at `at` ends: at a `;` or `,` outside its brackets, or at the
/// bracket that closes one it sits in.
fn expression_end(code: &[u8], at: usize) -> usize {
    let mut depth = 0usize;
    for (j, &b) in code.iter().enumerate().skip(at) {
        match b {
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' if depth == 0 => return j,
            b')' | b']' | b'}' => depth -= 1,
            b';' | b',' if depth == 0 => return j,
            _ => {}
        }
    }
    code.len()
}

fn collapse(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Every identifier of `code` with its offset.
fn identifiers(code: &[u8]) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        if is_ident(code[i]) && (i == 0 || !is_ident(code[i - 1])) {
            let len = code[i..].iter().take_while(|&&b| is_ident(b)).count();
            if !code[i].is_ascii_digit() {
                if let Ok(word) = std::str::from_utf8(&code[i..i + len]) {
                    out.push((i, word));
                }
            }
            i += len;
        } else {
            i += 1;
        }
    }
    out
}

/// One source file, its test items blanked.
struct Source {
    file: String,
    raw: String,
    code: Vec<u8>,
}

impl Source {
    fn new(file: &str, raw: String) -> (Source, Vec<String>) {
        let mut code = blank(&raw);
        let external = strip_test_items(&mut code);
        let source = Source {
            file: file.to_owned(),
            raw,
            code,
        };
        (source, external)
    }

    fn finding(&self, at: usize, what: String) -> Finding {
        let statement = statement_start(&self.code, at);
        let (from, to) = (
            context_start(&self.code, statement),
            statement_end(&self.code, at),
        );
        Finding {
            file: self.file.clone(),
            line: self.code[..at].iter().filter(|&&b| b == b'\n').count() + 1,
            what,
            statement,
            context: collapse(&String::from_utf8_lossy(&self.raw.as_bytes()[from..to])),
        }
    }

    /// The constants this file defines pinned to the CPU (`const F32: … = (…, Device::Cpu);`).
    fn pinned_constants(&self) -> Vec<String> {
        let ids = identifiers(&self.code);
        let code = &self.code;
        let before = |at: usize| code[..at].iter().rev().find(|b| !b.is_ascii_whitespace());
        let after = |at: usize| code[at..].iter().find(|b| !b.is_ascii_whitespace());
        ids.windows(2)
            // A `const NAME:` item, not `const fn` or a `*const T` pointer type.
            .filter(|w| w[0].1 == "const" && before(w[0].0) != Some(&b'*'))
            .filter(|w| w[1].1 != "_" && after(w[1].0 + w[1].1.len()) == Some(&b':'))
            .filter_map(|w| {
                let (at, name) = w[1];
                let end = find(code, at, b";")?;
                let body = &code[at..end];
                let pinned = find(body, 0, b"Device::Cpu").is_some()
                    || identifiers(body).iter().any(|(_, id)| id.ends_with("_CPU"));
                pinned.then(|| name.to_owned())
            })
            .collect()
    }

    /// Every CPU-pinned site of this file; `constants` are its crate's pinned constants.
    fn scan(&self, constants: &BTreeSet<String>) -> Vec<Finding> {
        let code = &self.code;
        let mut out = Vec::new();
        let ids = identifiers(code);
        // `use` items (to their `;`): importing a constant creates nothing.
        let imports: Vec<(usize, usize)> = ids
            .iter()
            .filter(|(_, w)| *w == "use")
            .map(|&(at, _)| (at, find(code, at, b";").unwrap_or(code.len())))
            .collect();
        for (k, &(at, id)) in ids.iter().enumerate() {
            let path_before = at >= 2 && &code[at - 2..at] == b"::";
            let prev = k.checked_sub(1).map(|p| ids[p]);
            if id == "Cpu" && path_before && prev.is_some_and(|(p, w)| w == "Device" && p + 8 == at)
            {
                let start = at - "Device::".len();
                out.push(self.finding(start, "`Device::Cpu`".into()));
            } else if id.ends_with("_CPU") {
                out.push(self.finding(at, format!("the CPU options constant `{id}`")));
            } else if constants.contains(id) {
                let definition = prev.is_some_and(|(_, w)| w == "const");
                let import = imports.iter().any(|&(from, to)| from < at && at < to);
                // `DType::F32` is a variant of a type, not the constant.
                let variant = path_before
                    && prev.is_some_and(|(p, w)| {
                        p + w.len() + 2 == at && w.starts_with(|c: char| c.is_ascii_uppercase())
                    });
                if !definition && !import && !variant {
                    let what = format!("`{id}`, a constant pinned to the CPU");
                    out.push(self.finding(at, what));
                }
            } else if id == "Tensor" {
                let Some(&(call, name)) = ids.get(k + 1) else {
                    continue;
                };
                let creates = matches!(
                    name,
                    "from_slice"
                        | "f_from_slice"
                        | "from_slice2"
                        | "f_from_slice2"
                        | "of_slice"
                        | "from"
                );
                let after = &code[call + name.len()..];
                let called = after
                    .iter()
                    .find(|b| !b.is_ascii_whitespace())
                    .is_some_and(|&b| b == b'(');
                if creates && call == at + "Tensor::".len() && called {
                    let stop = expression_end(code, at);
                    let moved = find(&code[at..stop], 0, b"to_device").is_some();
                    if !moved {
                        let what = format!("`Tensor::{name}(` without a `to_device`");
                        out.push(self.finding(at, what));
                    }
                }
            }
        }
        out
    }
}

/// The out-of-line test module `name` declared in `file`: `name.rs` or `name/mod.rs` in the
/// directory that file's child modules live in.
fn test_module_files(file: &Path, name: &str) -> [PathBuf; 2] {
    let dir = file.parent().unwrap_or(Path::new("."));
    let stem = file.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let base = if matches!(stem, "mod" | "lib" | "main") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    [
        base.join(format!("{name}.rs")),
        base.join(name).join("mod.rs"),
    ]
}

/// Every CPU-pinned site of the non-test code under [`ROOTS`], and how many files were read.
fn scan_repository() -> (Vec<Finding>, usize) {
    let mut findings = Vec::new();
    let mut files_read = 0;
    for root in ROOTS {
        let mut files = Vec::new();
        common::rust_files(&repo().join(root), &mut files);
        let mut sources = Vec::new();
        let mut test_files = BTreeSet::new();
        for path in &files {
            let raw = std::fs::read_to_string(path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let rel = path
                .strip_prefix(repo())
                .expect("under the repository")
                .to_string_lossy()
                .replace('\\', "/");
            let (source, external) = Source::new(&rel, raw);
            for name in external {
                test_files.extend(test_module_files(path, &name));
            }
            sources.push((path.clone(), source));
        }
        sources.retain(|(path, _)| !test_files.contains(path));
        files_read += sources.len();
        let constants: BTreeSet<String> = sources
            .iter()
            .flat_map(|(_, s)| s.pinned_constants())
            .collect();
        for (_, source) in &sources {
            findings.extend(source.scan(&constants));
        }
    }
    (findings, files_read)
}

/// What is wrong with the scan's findings against `allowed`: unlisted sites, stale entries,
/// entries that match more than one statement. Empty when all is well.
fn check(findings: &[Finding], allowed: &[Allowed]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut covered = vec![false; findings.len()];
    for entry in allowed {
        if entry.why.trim().is_empty() {
            problems.push(format!(
                "allowlist entry {} `{}` gives no reason",
                entry.file, entry.snippet
            ));
        }
        let snippet = collapse(entry.snippet);
        let mut statements = BTreeMap::new();
        for (i, f) in findings.iter().enumerate() {
            if f.file == entry.file && f.context.contains(&snippet) {
                covered[i] = true;
                statements.insert(f.statement, f.line);
            }
        }
        match statements.len() {
            0 => problems.push(format!(
                "stale allowlist entry: {} `{}` matches no CPU-pinned site; remove it (or fix \
                 its snippet if the site only moved)",
                entry.file, entry.snippet
            )),
            1 => {}
            _ => problems.push(format!(
                "allowlist entry {} `{}` matches {} statements (lines {:?}); make its snippet \
                 distinctive, one entry per site",
                entry.file,
                entry.snippet,
                statements.len(),
                statements.values().collect::<Vec<_>>()
            )),
        }
    }
    for (f, ok) in findings.iter().zip(covered) {
        if !ok {
            problems.push(format!(
                "{}:{}: {} in `{}`: create it on the parameters' or activations' device (or \
                 move it with `to_device` in the same expression); a deliberate host copy goes \
                 on the allowlist in tests/device_plumbing.rs with its reason",
                f.file, f.line, f.what, f.context
            ));
        }
    }
    problems
}

#[test]
fn training_code_creates_no_tensor_pinned_to_the_cpu() {
    let (findings, files) = scan_repository();
    assert!(
        files > 50,
        "the scan read only {files} files under {ROOTS:?}: is the repository layout different?"
    );
    let problems = check(&findings, ALLOWED);
    assert!(
        problems.is_empty(),
        "{} device-plumbing problem(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// A file exercising every rule of the scan, with the findings it must produce.
const SAMPLE: &str = r####"
//! Device::Cpu in a doc comment is not code.
use crate::store::{HOST, ParamStore};
const HOST: (Kind, Device) = (Kind::Float, Device::Cpu);
fn moved(d: Device) -> R { let t = Tensor::from_slice(&[1.0]).f_to_device(d)?; }
fn chained(e: &Tensor) -> R { Ok(Tensor::from_slice(&kept)
    .f_reshape([2, 2])?
    .f_to_device(e.device())?) }
fn bare() -> R { let t = Tensor::from_slice(&[1.0]); }
fn pinned() -> R { Tensor::f_zeros([1], (Kind::Float, tch::Device::Cpu)) }
fn string() { let s = "Device::Cpu"; let r = r#"Tensor::from_slice(&x)"#; let c = '"'; }
fn kind() -> R { Tensor::f_zeros([1], tch::kind::FLOAT_CPU) }
fn uses() -> R { Tensor::f_ones([1], HOST) }
fn variant() -> DType { DType::HOST }
fn sent(g: &G, d: Device) -> R { g.send(&Tensor::from_slice(&v), 1, 0)?; d.f_to_device(d)?; }
fn lifetime<'a>(x: &'a Tensor) -> R { Tensor::from(1.0) }
fn other() { v.extend_from_slice(&w); MyDevice::Cpu; }
#[cfg(test)]
mod tests {
    fn t() { Tensor::f_zeros([1], (Kind::Float, Device::Cpu)); let s = "}"; }
}
#[cfg(test)]
#[allow(dead_code)]
fn helper() { Tensor::from_slice(&[1]); }
#[cfg(test)]
mod more;
fn after() -> R { Tensor::f_empty([1], (Kind::Float, Device::Cpu)) }
"####;

fn sample_findings() -> (Vec<Finding>, Vec<String>) {
    let (source, external) = Source::new("sample.rs", SAMPLE.to_owned());
    let constants = source.pinned_constants().into_iter().collect();
    (source.scan(&constants), external)
}

#[test]
fn the_scan_finds_every_kind_of_pinned_site_and_nothing_else() {
    let (findings, external) = sample_findings();
    let got: Vec<(usize, &str)> = findings.iter().map(|f| (f.line, f.what.as_str())).collect();
    assert_eq!(
        got,
        [
            (4, "`Device::Cpu`"),
            (9, "`Tensor::from_slice(` without a `to_device`"),
            (10, "`Device::Cpu`"),
            (12, "the CPU options constant `FLOAT_CPU`"),
            (13, "`HOST`, a constant pinned to the CPU"),
            (15, "`Tensor::from_slice(` without a `to_device`"),
            (16, "`Tensor::from(` without a `to_device`"),
            (27, "`Device::Cpu`"),
        ]
    );
    assert_eq!(external, ["more"]);
    let pinned = &findings[2];
    assert_eq!(
        pinned.context,
        "fn pinned() -> R { Tensor::f_zeros([1], (Kind::Float, tch::Device::Cpu))"
    );
}

#[test]
fn the_allowlist_fails_on_unlisted_stale_and_ambiguous_entries() {
    let (findings, _) = sample_findings();
    let everything: Vec<Allowed> = [
        "const HOST",
        "let t = Tensor::from_slice(&[1.0])",
        "tch::Device::Cpu",
        "FLOAT_CPU",
        "Tensor::f_ones([1], HOST)",
        "g.send(&Tensor::from_slice(&v)",
        "Tensor::from(1.0)",
        "Tensor::f_empty([1]",
    ]
    .into_iter()
    .map(|snippet| Allowed {
        file: "sample.rs",
        snippet,
        why: "sample",
    })
    .collect();
    assert_eq!(check(&findings, &everything), Vec::<String>::new());

    let stale = Allowed {
        file: "sample.rs",
        snippet: "Tensor::f_zeros([7]",
        why: "sample",
    };
    let ambiguous = Allowed {
        file: "sample.rs",
        snippet: "Device::Cpu",
        why: "sample",
    };
    let problems = check(&findings, &[stale, ambiguous]);
    assert!(problems[0].starts_with("stale allowlist entry: sample.rs `Tensor::f_zeros([7]`"));
    assert!(problems[1].contains("matches 3 statements"), "{problems:?}");
    // Everything not covered by `Device::Cpu` is reported with its line.
    assert!(problems[2].starts_with("sample.rs:9: `Tensor::from_slice(`"));
    assert_eq!(problems.len(), 2 + 5);
}
