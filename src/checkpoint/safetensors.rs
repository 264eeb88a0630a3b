//! The safetensors file format, read and written here rather than through `tch`: Lockstep
//! needs the header's `__metadata__` (where a checkpoint records its step and optimizer
//! file, which PyTorch's loaders ignore) and errors that say what is wrong with a damaged
//! file (a truncated download, a header that lies about its sizes) instead of a bare parse
//! failure.
//!
//! Layout: an 8-byte little-endian header length `n`, `n` bytes of JSON mapping every
//! tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets into the data
//! that follows) plus an optional `"__metadata__"` map of strings, then the data.

use super::CheckpointError;
use std::collections::BTreeMap;
use std::path::Path;
use tch::{Kind, Tensor};

/// A safetensors file's tensors (in file order) and its string metadata.
#[derive(Debug, Default)]
pub struct SafetensorsFile {
    /// Every tensor, by name, in the order of their data in the file.
    pub tensors: Vec<(String, Tensor)>,
    /// The header's `__metadata__` (empty when absent).
    pub metadata: BTreeMap<String, String>,
}

/// The safetensors dtype code of `kind`, if the format has one.
fn dtype_code(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Double => "F64",
        Kind::Float => "F32",
        Kind::Half => "F16",
        Kind::BFloat16 => "BF16",
        Kind::Int64 => "I64",
        Kind::Int => "I32",
        Kind::Int16 => "I16",
        Kind::Int8 => "I8",
        Kind::Uint8 => "U8",
        Kind::Bool => "BOOL",
        _ => return None,
    })
}

/// The tensor kind of a safetensors dtype code, if libtorch has it.
fn kind_of(code: &str) -> Option<Kind> {
    Some(match code {
        "F64" => Kind::Double,
        "F32" => Kind::Float,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "I64" => Kind::Int64,
        "I32" => Kind::Int,
        "I16" => Kind::Int16,
        "I8" => Kind::Int8,
        "U8" => Kind::Uint8,
        "BOOL" => Kind::Bool,
        _ => return None,
    })
}

/// Reads and checks a whole safetensors file: every size and offset in the header must fit
/// the file exactly, so a truncated or padded file is refused, naming what is off.
pub fn read(path: &Path) -> Result<SafetensorsFile, CheckpointError> {
    let shown = path.display().to_string();
    let bad = |reason: String| CheckpointError::Malformed {
        path: shown.clone(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| CheckpointError::Io {
        path: shown.clone(),
        what: "reading",
        source: e,
    })?;
    let (header, data) = split_header(&bytes).map_err(&bad)?;
    let (metadata, mut entries) = parse_header(header).map_err(&bad)?;
    entries.sort_by_key(|(_, e)| e.begin);
    let mut expected_begin = 0usize;
    let mut tensors = Vec::with_capacity(entries.len());
    for (name, e) in entries {
        if e.begin != expected_begin {
            return Err(bad(format!(
                "tensor `{name}` starts at byte {} of the data, expected {expected_begin} (tensors \
                 overlap or leave a gap)",
                e.begin
            )));
        }
        let t = entry_tensor(&name, &e, data).map_err(&bad)?;
        tensors.push((name, t));
        expected_begin = e.end;
    }
    if expected_begin != data.len() {
        return Err(bad(format!(
            "the tensors hold {expected_begin} bytes of data but {} follow the header (trailing \
             bytes)",
            data.len()
        )));
    }
    Ok(SafetensorsFile { tensors, metadata })
}

/// Splits a file's bytes into its JSON header and its data, checking the length prefix.
fn split_header(bytes: &[u8]) -> Result<(&[u8], &[u8]), String> {
    let Some((len_bytes, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(format!(
            "{} bytes is too short for a safetensors file (truncated?)",
            bytes.len()
        ));
    };
    let header_len = u64::from_le_bytes(*len_bytes);
    let header_len = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= rest.len())
        .ok_or_else(|| {
            format!(
                "the header claims {header_len} bytes but only {} follow (truncated, or not a \
                 safetensors file)",
                rest.len()
            )
        })?;
    Ok(rest.split_at(header_len))
}

/// The header's string metadata and its checked tensor entries, in header order.
type ParsedHeader = (BTreeMap<String, String>, Vec<(String, Entry)>);

/// Parses the JSON header into its `__metadata__` strings and checked tensor entries.
fn parse_header(header: &[u8]) -> Result<ParsedHeader, String> {
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| format!("the header is not a JSON object: {e}"))?;
    let mut metadata = BTreeMap::new();
    let mut entries = Vec::new();
    for (name, value) in &header {
        if name == "__metadata__" {
            let map = value
                .as_object()
                .ok_or_else(|| "`__metadata__` is not an object".to_owned())?;
            for (k, v) in map {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("metadata `{k}` is not a string"))?;
                metadata.insert(k.clone(), v.to_owned());
            }
            continue;
        }
        entries.push((name.clone(), entry(name, value)?));
    }
    Ok((metadata, entries))
}

/// The tensor entry `e` describes, once its shape, byte size and bounds fit `data`.
fn entry_tensor(name: &str, e: &Entry, data: &[u8]) -> Result<Tensor, String> {
    let numel = e
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(usize::try_from(d).ok()?))
        .ok_or_else(|| format!("tensor `{name}` has an impossible shape {:?}", e.shape))?;
    let want = numel.checked_mul(e.kind.elt_size_in_bytes());
    if want != Some(e.end - e.begin) {
        return Err(format!(
            "tensor `{name}` ({} {:?}) needs {} bytes but its offsets span {}",
            e.code,
            e.shape,
            want.map_or_else(|| "too many".to_owned(), |w| w.to_string()),
            e.end - e.begin
        ));
    }
    if e.end > data.len() {
        return Err(format!(
            "tensor `{name}` ends at byte {} of the data but the file holds only {} bytes of \
             data (truncated)",
            e.end,
            data.len()
        ));
    }
    Tensor::f_from_data_size(&data[e.begin..e.end], &e.shape, e.kind)
        .map_err(|err| format!("tensor `{name}`: {err}"))
}

/// One header entry, checked.
struct Entry {
    code: String,
    kind: Kind,
    shape: Vec<i64>,
    begin: usize,
    end: usize,
}

fn entry(name: &str, value: &serde_json::Value) -> Result<Entry, String> {
    let code = value
        .get("dtype")
        .and_then(|d| d.as_str())
        .ok_or_else(|| format!("tensor `{name}` has no dtype"))?;
    let kind =
        kind_of(code).ok_or_else(|| format!("tensor `{name}` has unsupported dtype {code}"))?;
    let shape = value
        .get("shape")
        .and_then(|s| s.as_array())
        .and_then(|dims| dims.iter().map(|d| d.as_i64()).collect::<Option<Vec<_>>>())
        .ok_or_else(|| format!("tensor `{name}` has no valid shape"))?;
    let offsets = value
        .get("data_offsets")
        .and_then(|o| o.as_array())
        .and_then(|o| match o.as_slice() {
            [b, e] => Some((b.as_u64()?, e.as_u64()?)),
            _ => None,
        })
        .and_then(|(b, e)| Some((usize::try_from(b).ok()?, usize::try_from(e).ok()?)))
        .filter(|(b, e)| b <= e)
        .ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
    Ok(Entry {
        code: code.to_owned(),
        kind,
        shape,
        begin: offsets.0,
        end: offsets.1,
    })
}

/// Writes `tensors` (in this order) and `metadata` to `path` atomically: into a temporary
/// file next to it, flushed, then renamed over it, so a reader never sees half a file and a
/// failed write leaves any earlier file in place.
pub fn write_atomic(
    path: &Path,
    tensors: &[(String, Tensor)],
    metadata: &BTreeMap<String, String>,
) -> Result<(), CheckpointError> {
    let shown = path.display().to_string();
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata)?);
    }
    let mut data = Vec::new();
    for (name, t) in tensors {
        let code = dtype_code(t.kind()).ok_or_else(|| CheckpointError::Malformed {
            path: shown.clone(),
            reason: format!(
                "tensor `{name}` has dtype {:?}, which safetensors cannot hold",
                t.kind()
            ),
        })?;
        let bytes = tensor_bytes(t)?;
        let begin = data.len();
        data.extend_from_slice(&bytes);
        header.insert(
            name.clone(),
            serde_json::json!({
                "dtype": code,
                "shape": t.size(),
                "data_offsets": [begin, data.len()],
            }),
        );
    }
    let mut header = serde_json::to_vec(&header)?;
    // Pad the header with spaces so the data starts 8-byte aligned, as the reference writer
    // does (readers that map the file rely on it).
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + header.len() + data.len());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    write_file_atomic(path, &out)
}

/// The raw bytes of `t` (CPU, contiguous, native byte order: little-endian on every platform
/// Lockstep builds for).
fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, CheckpointError> {
    let t = t
        .f_detach()?
        .f_to_device(tch::Device::Cpu)?
        .f_contiguous()?;
    let numel = t.numel();
    let mut bytes = vec![0u8; numel * t.kind().elt_size_in_bytes()];
    t.f_copy_data_u8(&mut bytes, numel)?;
    Ok(bytes)
}

/// Writes `bytes` to a temporary sibling of `path`, syncs it and renames it over `path`.
pub fn write_file_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    use std::io::Write;
    let shown = path.display().to_string();
    let io = |what: &'static str| {
        let shown = shown.clone();
        move |source| CheckpointError::Io {
            path: shown,
            what,
            source,
        }
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| CheckpointError::Malformed {
            path: shown.clone(),
            reason: "not a file path".into(),
        })?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{file_name}.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp).map_err(io("creating"))?;
        f.write_all(bytes).map_err(io("writing"))?;
        f.sync_all().map_err(io("syncing"))?;
        std::fs::rename(&tmp, path).map_err(io("renaming into place"))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
