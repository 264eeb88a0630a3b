//! The versioned JSON: the machine-readable record of a matrix and the input of report
//! comparisons.

use super::{Report, ReportError, READABLE_SCHEMA_VERSIONS};
use std::path::Path;

/// The report as pretty JSON.
pub fn render_json(report: &Report) -> Result<String, ReportError> {
    let mut s = serde_json::to_string_pretty(report).map_err(ReportError::Serialize)?;
    s.push('\n');
    Ok(s)
}

/// Reads a report, checking `schema_version` before anything else so a report from another
/// version fails with that explanation rather than a confusing missing-field error.
pub fn read_json(path: &Path) -> Result<Report, ReportError> {
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Io {
        path: path.to_owned(),
        source,
    })?;
    parse_json(path, &text)
}

/// [`read_json`] of `text`, read from `path`.
pub(super) fn parse_json(path: &Path, text: &str) -> Result<Report, ReportError> {
    let json = |source| ReportError::Json {
        path: path.to_owned(),
        source,
    };
    let value: serde_json::Value = serde_json::from_str(text).map_err(json)?;
    let found = value
        .get("schema_version")
        .and_then(serde_json::Value::as_u64);
    if !found.is_some_and(|v| READABLE_SCHEMA_VERSIONS.iter().any(|&r| u64::from(r) == v)) {
        return Err(ReportError::UnsupportedSchema {
            path: path.to_owned(),
            found,
        });
    }
    serde_json::from_value(value).map_err(json)
}
