//! JUnit XML: one test case per model × config × reference, so CI dashboards show parity
//! failures next to ordinary test failures.

use super::Report;
use std::fmt::Write as _;

/// Escapes text for XML content and attributes, dropping the control characters XML 1.0
/// cannot carry at all (a stray one would make the whole file unparseable).
pub(crate) fn xml_escape(text: &str) -> String {
    let clean: String = text
        .chars()
        .filter(|&c| c == '\t' || c == '\n' || c == '\r' || c >= ' ')
        .collect();
    quick_xml::escape::escape(clean.as_str()).into_owned()
}

/// The JUnit document.
pub fn render_junit(report: &Report) -> String {
    let s = &report.summary;
    let time = report.wall_time_seconds.unwrap_or(0.0);
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let tests = s.comparisons + report.errors.len() + report.skipped.len();
    let _ = writeln!(
        out,
        "<testsuites name=\"lockstep parity\" tests=\"{tests}\" failures=\"{}\" errors=\"{}\" time=\"{time:.3}\">",
        s.failed,
        report.errors.len()
    );
    let _ = writeln!(
        out,
        "  <testsuite name=\"parity\" tests=\"{tests}\" failures=\"{}\" errors=\"{}\" skipped=\"{}\" time=\"{time:.3}\">",
        s.failed,
        report.errors.len(),
        report.skipped.len()
    );
    for c in &report.comparisons {
        let _ = write!(
            out,
            "    <testcase classname=\"{}\" name=\"{}\"",
            xml_escape(&format!("parity.{}", c.model)),
            xml_escape(&format!("{} vs {}", c.config, c.reference))
        );
        if c.passed {
            // A pass under a loosened tolerance says so, so CI dashboards show the reason too.
            match &c.override_reason {
                Some(r) => {
                    let _ = writeln!(
                        out,
                        ">\n      <system-out>{}</system-out>\n    </testcase>",
                        xml_escape(&format!("tolerance override in force: {r}"))
                    );
                }
                None => out.push_str("/>\n"),
            }
            continue;
        }
        out.push_str(">\n");
        let diagnosis = c.diagnosis.clone().unwrap_or_else(|| "failed".into());
        let mut details = diagnosis.clone();
        if let Some(r) = &c.override_reason {
            let _ = write!(details, "\ntolerance override in force: {r}");
        }
        for p in &c.structural {
            let _ = write!(details, "\n{p}");
        }
        let _ = writeln!(
            out,
            "      <failure message=\"{}\" type=\"parity\">{}</failure>",
            xml_escape(&diagnosis),
            xml_escape(&details)
        );
        out.push_str("    </testcase>\n");
    }
    for e in &report.errors {
        let _ = writeln!(
            out,
            "    <testcase classname=\"{}\" name=\"{}\">\n      <error message=\"{}\" type=\"run\">{}</error>\n    </testcase>",
            xml_escape(&format!("parity.{}", e.model)),
            xml_escape(&format!("{} vs {}", e.config, e.reference)),
            xml_escape(&e.message),
            xml_escape(&e.details)
        );
    }
    for k in &report.skipped {
        let _ = writeln!(
            out,
            "    <testcase classname=\"{}\" name=\"{}\">\n      <skipped message=\"{}\"/>\n    </testcase>",
            xml_escape(&format!("parity.{}", k.model)),
            xml_escape(&format!("{} vs {}", k.config, k.reference)),
            xml_escape(&k.reason)
        );
    }
    out.push_str("  </testsuite>\n</testsuites>\n");
    out
}
