//! The parity engine, its reports and report comparison, on hand-made records.

use lockstep_core::comm::DType;
use lockstep_core::consistency::{CrossRankCheck, CrossRankMismatch, StateKind};
use lockstep_core::record::{MemoryStats, NamedTensor, RunRecord, RunSpec};
use lockstep_harness::parity::{
    compare, looser_dtype, ulp_distance, Override, ParityError, Quantity, Reason, Tolerance,
    TolerancePolicy,
};
use lockstep_harness::report::{
    compare_reports, read_json, render_html, render_junit, render_markdown, write_all,
    write_atomic, write_json, Change, CompareOptions, Report, ReportError, RowTrend,
    SCHEMA_VERSION,
};
use std::time::Duration;

fn spec(config: &str) -> RunSpec {
    RunSpec {
        model: "nested".into(),
        config: config.into(),
        world_size: 2,
        backend: "cpu".into(),
        dtype: "fp32".into(),
        steps: 3,
        seed: 0,
    }
}

fn tensor(name: &str, dtype: DType, shape: &[i64], values: &[f64]) -> NamedTensor {
    NamedTensor {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        values: values.to_vec(),
    }
}

fn record(config: &str, losses: &[f64], params: Vec<NamedTensor>) -> RunRecord {
    RunRecord {
        spec: spec(config),
        losses: losses.to_vec(),
        grad_norms: vec![1.0; losses.len()],
        params,
        buffers: vec![],
        grads: None,
        memory: None,
        collectives: None,
        routing_min_gap: None,
        tokens_dropped: None,
        placements: Vec::new(),
        cross_rank: None,
    }
}

fn f32_policy() -> TolerancePolicy {
    TolerancePolicy::dtype_table(DType::F32)
}

/// The f64 value of the next f32 above `x`.
fn next_f32(x: f32) -> f64 {
    f64::from(f32::from_bits(x.to_bits() + 1))
}

// ---------------------------------------------------------------- tolerance math

#[test]
fn boundary_passes_exactly_and_fails_just_beyond() {
    // Reference 0: allowed is exactly atol (1e-5 for f32).
    let reference = record("ddp", &[0.0], vec![]);
    let at = compare(&record("fsdp", &[1e-5], vec![]), &reference, &f32_policy());
    assert!(at.passed, "{:?}", at.diagnosis);
    assert_eq!(at.losses.margin, 1.0);
    let beyond = compare(
        &record("fsdp", &[f64::next_up(1e-5)], vec![]),
        &reference,
        &f32_policy(),
    );
    assert!(!beyond.passed);
    assert!(beyond.losses.margin > 1.0);

    // The relative part, with values exactly representable: atol 0.5 + rtol 0.25 · |2| = 1.
    let ov = Override::new(Tolerance::new(0.25, 0.5), "exercise the rtol term").unwrap();
    let policy = f32_policy().with_override("fsdp", ov);
    let reference = record("ddp", &[2.0], vec![tensor("w", DType::F32, &[1], &[-2.0])]);
    let at = compare(
        &record("fsdp", &[3.0], vec![tensor("w", DType::F32, &[1], &[-3.0])]),
        &reference,
        &policy,
    );
    assert!(at.passed, "{:?}", at.diagnosis);
    assert_eq!(at.overall().margin, 1.0);
    let beyond = compare(
        &record(
            "fsdp",
            &[3.0],
            vec![tensor("w", DType::F32, &[1], &[f64::next_down(-3.0)])],
        ),
        &reference,
        &policy,
    );
    assert!(!beyond.passed);
    assert!(beyond.losses.passed && !beyond.params.passed);
    assert_eq!(
        beyond.override_reason.as_deref(),
        Some("exercise the rtol term")
    );
}

#[test]
fn looser_dtype_of_the_two_wins() {
    assert_eq!(looser_dtype(DType::F32, DType::BF16), DType::BF16);
    assert_eq!(looser_dtype(DType::F16, DType::F32), DType::F16);
    assert_eq!(looser_dtype(DType::F64, DType::I64), DType::F64);
    // A 1e-3 relative error fails in f32 but passes once either side is bf16.
    let reference = record(
        "ddp",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[1.0, 2.0])],
    );
    let f32_run = record(
        "tp",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[1.001, 2.0])],
    );
    assert!(!compare(&f32_run, &reference, &f32_policy()).passed);
    let bf16_run = record(
        "tp",
        &[1.0],
        vec![tensor("w", DType::BF16, &[2], &[1.001, 2.0])],
    );
    let c = compare(&bf16_run, &reference, &f32_policy());
    assert!(c.passed, "{:?}", c.diagnosis);
    assert_eq!(c.param_summaries[0].dtype, DType::BF16);
}

#[test]
fn bitwise_mode_catches_one_ulp_and_signed_zero() {
    let reference = record(
        "ddp",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[1.0, 0.0])],
    );
    let run = record(
        "ddp2",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[next_f32(1.0), 0.0])],
    );
    assert!(
        compare(&run, &reference, &f32_policy()).passed,
        "1 ULP is within the f32 tolerance"
    );
    let c = compare(&run, &reference, &TolerancePolicy::bitwise(DType::F32));
    assert!(!c.passed);
    let f = c.first_failure.expect("a failure point");
    assert_eq!(
        (f.quantity, f.tensor.as_deref(), f.index, f.ulp),
        (Quantity::Params, Some("w"), Some(0), 1)
    );
    assert_eq!(f.allowed, None);
    assert_eq!(c.params.max_ulp, 1);

    let signed = record(
        "ddp2",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[1.0, -0.0])],
    );
    let c = compare(&signed, &reference, &TolerancePolicy::bitwise(DType::F32));
    assert!(!c.passed, "-0 and +0 differ bit for bit");
    assert_eq!(c.params.max_ulp, 0, "but are 0 ULP apart");
    assert!(
        compare(
            &record("ddp2", &[1.0], reference.params.clone()),
            &reference,
            &TolerancePolicy::bitwise(DType::F32)
        )
        .passed
    );
}

#[test]
fn ulp_distances() {
    assert_eq!(ulp_distance(1.0, next_f32(1.0), DType::F32), 1);
    assert_eq!(
        ulp_distance(1.0, 1.0 + 2f64.powi(-7), DType::BF16),
        1,
        "next bf16 after 1.0"
    );
    assert_eq!(
        ulp_distance(1.0, 1.001, DType::BF16),
        0,
        "1.001 rounds to 1.0 in bf16"
    );
    assert_eq!(
        ulp_distance(1.0, 1.0 + 2f64.powi(-10), DType::F16),
        1,
        "next f16 after 1.0"
    );
    assert_eq!(ulp_distance(1.0, f64::next_up(1.0), DType::F64), 1);
    assert_eq!(
        ulp_distance(1.0, f64::next_up(1.0), DType::F32),
        0,
        "invisible in f32"
    );
    assert_eq!(ulp_distance(-1.0, -next_f32(1.0), DType::F32), 1);
    assert_eq!(ulp_distance(-1.0, 1.0, DType::F32), 2 * 0x3f80_0000);
    assert_eq!(ulp_distance(-1.0, 1.0, DType::BF16), 2 * 0x3f80);
    assert_eq!(ulp_distance(0.0, -0.0, DType::F32), 0);
    assert_eq!(ulp_distance(0.0, -0.0, DType::BF16), 0);
    assert_eq!(ulp_distance(0.0, -0.0, DType::F64), 0);
    let tiny = f64::from(f32::from_bits(1));
    assert_eq!(ulp_distance(tiny, -tiny, DType::F32), 2, "across zero");
    assert_eq!(ulp_distance(0.0, tiny, DType::F32), 1);
    assert_eq!(ulp_distance(f64::NAN, f64::NAN, DType::F32), u64::MAX);
    assert_eq!(ulp_distance(3.0, 7.0, DType::I64), 4);
}

#[test]
fn overrides_need_a_reason() {
    let tol = Tolerance::new(1e-5, 4e-5);
    assert_eq!(Override::new(tol, ""), Err(ParityError::MissingReason));
    assert_eq!(Override::new(tol, "  \n"), Err(ParityError::MissingReason));
    assert_eq!(Reason::new(""), Err(ParityError::MissingReason));
    assert!(matches!(
        Override::new(Tolerance::new(-1.0, 0.0), "why"),
        Err(ParityError::InvalidTolerance { .. })
    ));
    assert!(matches!(
        Override::new(Tolerance::new(f64::NAN, 0.0), "why"),
        Err(ParityError::InvalidTolerance { .. })
    ));
    // Nor can a file smuggle one in.
    let blank = r#"{"tolerance": {"rtol": 1e-5, "atol": 4e-5}, "reason": ""}"#;
    assert!(serde_json::from_str::<Override>(blank).is_err());
    let missing = r#"{"tolerance": {"rtol": 1e-5, "atol": 4e-5}}"#;
    assert!(serde_json::from_str::<Override>(missing).is_err());
    let good = r#"{"tolerance": {"rtol": 1e-5, "atol": 4e-5}, "reason": "pipeline grads", "only": ["grads"]}"#;
    let ov: Override = serde_json::from_str(good).unwrap();
    assert_eq!(ov.reason(), "pipeline grads");
    assert!(ov.applies_to(Quantity::Grads) && !ov.applies_to(Quantity::Loss));
}

#[test]
fn override_scoped_to_grads_leaves_losses_strict() {
    let ov = Override::new(Tolerance::new(0.0, 1.0), "pipeline tests loosen gradients")
        .unwrap()
        .only(&[Quantity::Grads]);
    let policy = f32_policy().with_override("pp", ov);
    let mut reference = record("ddp", &[1.0], vec![]);
    reference.grads = Some(vec![vec![tensor("g", DType::F32, &[1], &[0.0])]]);
    let mut run = record("pp", &[1.5], vec![]);
    run.grads = Some(vec![vec![tensor("g", DType::F32, &[1], &[0.5])]]);
    let c = compare(&run, &reference, &policy);
    assert!(c.grads.as_ref().is_some_and(|g| g.passed));
    assert!(!c.losses.passed);
}

#[test]
fn first_failing_step_and_tensor() {
    let params = |w3: f64| {
        vec![
            tensor("a.weight", DType::F32, &[2], &[1.0, 2.0]),
            tensor("b.weight", DType::F32, &[2, 2], &[1.0, 2.0, 3.0, w3]),
        ]
    };
    let grads = |bad: f64| {
        (0..4)
            .map(|s| {
                vec![tensor(
                    "a.bias",
                    DType::F32,
                    &[2],
                    &[if s == 1 { bad } else { 0.0 }, 0.0],
                )]
            })
            .collect::<Vec<_>>()
    };
    let mut reference = record("ddp", &[4.0, 3.0, 2.0, 1.0], params(4.0));
    reference.grads = Some(grads(0.0));
    let mut run = record("fsdp", &[4.0, 3.0, 2.5, 1.0], params(4.5));
    run.grads = Some(grads(0.25));
    let c = compare(&run, &reference, &f32_policy());
    assert!(!c.passed);
    let first = c.first_failure.clone().unwrap();
    assert_eq!(
        (
            first.quantity,
            first.step,
            first.tensor.as_deref(),
            first.index
        ),
        (Quantity::Grads, Some(1), Some("a.bias"), Some(0))
    );
    let loss = c.losses.first_failure.clone().unwrap();
    assert_eq!((loss.step, loss.actual, loss.expected), (Some(2), 2.5, 2.0));
    let param = c.params.first_failure.clone().unwrap();
    assert_eq!(
        (param.step, param.tensor.as_deref(), param.index),
        (None, Some("b.weight"), Some(3))
    );
    assert_eq!(c.losses.max_abs_err, 0.5);
    assert_eq!(c.losses.max_rel_err, 0.25);
    let steps_passed: Vec<bool> = c.steps.iter().map(|s| s.passed).collect();
    assert_eq!(steps_passed, [true, false, false, true]);
    let diagnosis = c.diagnosis.unwrap();
    assert!(
        diagnosis.starts_with("first failure: gradient of `a.bias` at step 1, element [0]: "),
        "{diagnosis}"
    );
    // The loss first fails at step 2, after the culprit: named next.
    assert!(
        diagnosis.contains("; then loss at step 2: 2.5 vs reference 2"),
        "{diagnosis}"
    );
    let b = &c.param_summaries[1];
    let f = b.stats.first_failure.as_ref().unwrap();
    assert_eq!(f.element.as_deref(), Some(&[1, 1][..]), "flat 3 in [2, 2]");
    assert!(c.param_summaries[0].stats.passed && !c.param_summaries[1].stats.passed);
}

#[test]
fn structural_mismatch_is_diagnosed() {
    let reference = record(
        "ddp",
        &[1.0, 1.0, 1.0],
        vec![
            tensor("a", DType::F32, &[2], &[1.0, 2.0]),
            tensor("b", DType::F32, &[2, 2], &[0.0; 4]),
            tensor("c", DType::F32, &[1], &[0.0]),
        ],
    );
    let mut run = record(
        "fsdp",
        &[1.0, 1.0],
        vec![
            tensor("a", DType::F32, &[2], &[1.0, 2.0]),
            tensor("b", DType::F32, &[4], &[0.0; 4]),
            tensor("extra", DType::F32, &[1], &[0.0]),
        ],
    );
    run.spec.model = "moe".into();
    let c = compare(&run, &reference, &f32_policy());
    assert!(!c.passed);
    let all = c.structural.join("\n");
    for needle in [
        "model `moe`",
        "2 loss steps but the reference 3",
        "`b` has shape [4]",
        "`c` is in the reference but missing",
        "`extra` is in the run but not",
    ] {
        assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
    }
    assert!(
        c.first_failure.is_none(),
        "the values that line up all match"
    );
    assert!(c.diagnosis.unwrap().starts_with("structural mismatch"));
    assert_eq!(c.steps.len(), 3);
    assert!(c.steps[2].loss.is_none() && !c.steps[2].passed);

    // Corrupt records: shape and value count disagree.
    let bad = record(
        "fsdp",
        &[1.0, 1.0, 1.0],
        vec![tensor("a", DType::F32, &[2], &[1.0, 2.0, 3.0])],
    );
    let c = compare(&bad, &reference, &f32_policy());
    assert!(
        c.structural.iter().any(|s| s.contains("holds 3 values")),
        "{:?}",
        c.structural
    );
}

#[test]
fn nan_and_integers() {
    let reference = record(
        "ddp",
        &[1.0],
        vec![tensor("steps", DType::I64, &[1], &[7.0])],
    );
    let c = compare(
        &record(
            "x",
            &[f64::NAN],
            vec![tensor("steps", DType::I64, &[1], &[8.0])],
        ),
        &reference,
        &f32_policy(),
    );
    assert!(!c.losses.passed && c.losses.max_abs_err.is_infinite());
    assert!(!c.params.passed, "integers compare exactly");
    assert_eq!(c.params.max_ulp, 1);
}

// ---------------------------------------------------------------- reports

fn sample_comparisons() -> Vec<lockstep_harness::parity::Comparison> {
    let losses = [2.0, 1.5, 1.2, 1.0];
    let reference = record(
        "ddp",
        &losses,
        vec![tensor("w", DType::F32, &[2], &[0.5, -0.5])],
    );
    let good = record(
        "fsdp.full_shard",
        &[2.0, 1.5 + 1e-7, 1.2, 1.0 + 2e-7],
        vec![tensor("w", DType::F32, &[2], &[0.5, -0.5])],
    );
    let mut bad = record(
        "fsdp<&\"weird\">",
        &[2.0, 1.6, 1.4, f64::NAN],
        vec![tensor("w", DType::F32, &[2], &[0.5, -0.25])],
    );
    bad.grad_norms[2] = 0.0;
    let policy = f32_policy();
    vec![
        compare(&good, &reference, &policy),
        compare(&bad, &reference, &policy),
    ]
}

fn scratch(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(name).tempdir().unwrap()
}

#[test]
fn json_report_round_trips_with_schema_version() {
    let report = Report::new(sample_comparisons()).with_wall_time(Duration::from_millis(1500));
    let dir = scratch("json");
    let files = write_all(&report, dir.path()).unwrap();
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files.json).unwrap()).unwrap();
    assert_eq!(value["schema_version"], SCHEMA_VERSION);
    assert_eq!(value["wall_time_seconds"], 1.5);
    assert_eq!(value["summary"]["failed"], 1);
    assert_eq!(
        value["steps"].as_array().unwrap().len(),
        8,
        "2 comparisons x 4 steps"
    );
    assert_eq!(value["steps"][7]["loss"]["run"], "NaN");
    assert_eq!(value["steps"][7]["config"], "fsdp<&\"weird\">");
    assert_eq!(value["comparisons"][0]["param_summaries"][0]["name"], "w");
    let back = read_json(&files.json).unwrap();
    assert_eq!(back.comparisons, report.comparisons);
    assert!(back.steps[7].step.loss.as_ref().unwrap().run.is_nan());

    // A future layout is refused by name.
    let future = dir.path().join("future.json");
    std::fs::write(&future, r#"{"schema_version": 99}"#).unwrap();
    assert!(matches!(
        read_json(&future),
        Err(ReportError::UnsupportedSchema {
            found: Some(99),
            ..
        })
    ));
    // No temporary files left behind.
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "baseline.jsonl",
            "future.json",
            "junit.xml",
            "report.html",
            "report.json",
            "report.md"
        ]
    );
    let md = std::fs::read_to_string(files.markdown).unwrap();
    assert!(
        md.contains("| nested | fsdp.full_shard | ddp | pass |"),
        "{md}"
    );
    assert!(md.contains("fsdp<&\"weird\">") && md.contains("**FAIL**"));
}

#[test]
fn memory_figures_reach_every_report_and_old_reports_still_read() {
    let reference = record(
        "ddp",
        &[1.0],
        vec![tensor("w", DType::F32, &[2], &[0.5, -0.5])],
    );
    let mut sharded = reference.clone();
    sharded.spec.config = "fsdp.full_shard".into();
    sharded.memory = Some(MemoryStats {
        full_param_bytes_peak: 2048,
        shard_bytes: 512,
        model_param_bytes: 2048,
    });
    let with = compare(&sharded, &reference, &f32_policy());
    let without = compare(&reference, &reference, &f32_policy());
    assert_eq!(with.memory, sharded.memory);
    assert_eq!(without.memory, None);
    let report = Report::new(vec![with, without]);
    assert!(report.has_memory());
    let dir = scratch("memory");
    let files = write_all(&report, dir.path()).unwrap();
    let value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&files.json).unwrap()).unwrap();
    assert_eq!(
        value["comparisons"][0]["memory"]["full_param_bytes_peak"],
        2048
    );
    assert_eq!(value["comparisons"][0]["memory"]["shard_bytes"], 512);
    assert!(value["comparisons"][1].get("memory").is_none());
    assert_eq!(
        read_json(&files.json).unwrap().comparisons,
        report.comparisons
    );
    let md = std::fs::read_to_string(&files.markdown).unwrap();
    assert!(md.contains("peak full params (KiB) | shard (KiB)"), "{md}");
    assert!(md.contains("| 2.0 | 0.5 |"), "{md}");
    assert!(md.contains("| - | - |"), "{md}");
    let html = std::fs::read_to_string(&files.html).unwrap();
    assert!(
        html.contains("memory (rank 0): peak full params 2.0 KiB, shard 0.5 KiB"),
        "{html}"
    );

    // A report written before memory existed has no such field: it reads, and renders
    // without memory columns.
    let mut old = value.clone();
    old["comparisons"][0]
        .as_object_mut()
        .unwrap()
        .remove("memory");
    std::fs::write(&files.json, serde_json::to_string(&old).unwrap()).unwrap();
    let back = read_json(&files.json).unwrap();
    assert!(!back.has_memory());
    assert!(!render_markdown(&back).contains("KiB"));
    assert!(!render_html(&back).contains("KiB"));
}

#[test]
fn markdown_lists_each_override_reason_once_with_its_rows() {
    let reference = record("ddp", &[1.0], vec![tensor("w", DType::F32, &[1], &[0.5])]);
    let run = |config: &str| {
        let mut r = reference.clone();
        r.spec.config = config.into();
        r
    };
    let why = "two-stage reduction order";
    let policy = TolerancePolicy::bitwise(DType::F32)
        .with_override(
            "hybrid@2",
            Override::new(Tolerance::new(1e-6, 1e-5), why).unwrap(),
        )
        .with_override(
            "hybrid@4",
            Override::new(Tolerance::new(1e-6, 1e-5), why).unwrap(),
        );
    let report = Report::new(vec![
        compare(&run("hybrid@2"), &reference, &policy),
        compare(&run("hybrid@4"), &reference, &policy),
        compare(&run("plain@2"), &reference, &policy),
    ]);
    let junit = render_junit(&report);
    assert_eq!(
        junit
            .matches(&format!(
                "<system-out>tolerance override in force: {why}</system-out>"
            ))
            .count(),
        2,
        "{junit}"
    );
    roxmltree::Document::parse(&junit).unwrap();
    let md = render_markdown(&report);
    assert_eq!(md.matches(why).count(), 1, "{md}");
    assert!(
        md.contains(&format!(
            "- {why} (for nested / hybrid@2 vs ddp, nested / hybrid@4 vs ddp)"
        )),
        "{md}"
    );
}

#[test]
fn junit_parses_with_one_case_per_comparison() {
    let report = Report::new(sample_comparisons());
    let xml = render_junit(&report);
    let doc = roxmltree::Document::parse(&xml).expect("well-formed JUnit");
    assert_eq!(doc.root_element().tag_name().name(), "testsuites");
    let cases: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name("testcase"))
        .collect();
    assert_eq!(cases.len(), 2);
    assert_eq!(cases[0].attribute("name"), Some("fsdp.full_shard vs ddp"));
    assert_eq!(cases[1].attribute("name"), Some("fsdp<&\"weird\"> vs ddp"));
    let failures: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name("failure"))
        .collect();
    assert_eq!(failures.len(), 1);
    let message = failures[0].attribute("message").unwrap();
    // No per-step gradients: the final value is the first failing tensor, and the loss that
    // failed before it is said to have.
    assert!(
        message.contains("first failure: final value of `w`, element [1]")
            && message.contains("the first failing scalar came earlier: loss at step 1"),
        "{message}"
    );
}

/// The page opens offline and overview first: a grid whose every cell links to its detail,
/// each comparison's two charts drawn in the page or carried as data for the page's one
/// inline script, nothing fetched from anywhere.
#[test]
fn html_is_self_contained_overview_first_with_charts() {
    let report = Report::new(sample_comparisons()).with_wall_time(Duration::from_secs(2));
    let html = render_html(&report);
    let doc = roxmltree::Document::parse_with_options(
        &html,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .expect("the page is well-formed");
    let class_is = |n: &roxmltree::Node, class: &str| n.attribute("class") == Some(class);
    // The overview comes before any detail.
    let first = |pred: &dyn Fn(&roxmltree::Node) -> bool| {
        doc.descendants().position(|n| pred(&n)).expect("present")
    };
    let grid = first(&|n| n.has_tag_name("table") && class_is(n, "grid"));
    let details = first(&|n| n.has_tag_name("details"));
    assert!(grid < details, "the grid comes first");
    // Every cell links to a detail that exists.
    let links: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("td"))
        .filter(|td| td.attribute("class").is_some_and(|c| c.starts_with("s-")))
        .filter_map(|td| td.first_element_child())
        .filter_map(|a| a.attribute("href"))
        .collect();
    assert_eq!(links.len(), 2, "one cell per configuration: {links:?}");
    for link in &links {
        let id = link.trim_start_matches('#');
        assert!(
            doc.descendants()
                .any(|n| n.has_tag_name("details") && n.attribute("id") == Some(id)),
            "{link} leads nowhere"
        );
    }
    // Two charts per comparison: inline SVG, or data the script draws.
    let svgs: Vec<_> = doc
        .descendants()
        .filter(|n| n.has_tag_name("svg"))
        .collect();
    for svg in &svgs {
        assert!(svg.descendants().any(|n| n.has_tag_name("polyline")));
        assert!(svg.descendants().any(|n| n.has_tag_name("title")));
    }
    let data: Vec<serde_json::Value> = doc
        .descendants()
        .filter_map(|n| n.attribute("data-chart"))
        .map(|d| serde_json::from_str(d).expect("chart data is JSON"))
        .collect();
    for d in &data {
        assert!(d["p"].as_array().is_some_and(|s| !s.is_empty()), "{d}");
    }
    assert_eq!(svgs.len() + data.len(), 4, "loss and error per step, twice");
    let titles: Vec<String> = doc
        .descendants()
        .filter(|n| n.has_tag_name("summary"))
        .map(|n| n.descendants().filter_map(|t| t.text()).collect())
        .collect();
    assert!(
        titles.iter().any(|t| t.contains("fsdp<&\"weird\">")),
        "{titles:?}"
    );
    assert_eq!(
        doc.descendants()
            .filter(|n| n.has_tag_name("script"))
            .count(),
        1
    );
    for external in ["http:", "https:", "src=", "url(", "<link", "@import"] {
        assert!(!html.contains(external), "external reference {external:?}");
    }
    assert!(
        doc.descendants()
            .filter_map(|n| n.attribute("href"))
            .all(|h| h.starts_with('#')),
        "every link stays in the page"
    );
}

#[test]
fn failed_write_leaves_no_file() {
    let dir = scratch("atomic");
    let missing = dir.path().join("no/such/dir/report.json");
    let report = Report::new(sample_comparisons());
    let err = write_json(&report, &missing).unwrap_err();
    assert!(matches!(err, ReportError::Io { .. }), "{err}");
    assert!(!missing.exists());
    assert!(write_all(&report, &dir.path().join("absent")).is_err());

    // The target is a directory: the rename fails and the temporary file is cleaned up.
    let blocked = dir.path().join("report.json");
    std::fs::create_dir(&blocked).unwrap();
    std::fs::write(blocked.join("keep"), "x").unwrap();
    assert!(write_atomic(&blocked, b"{}").is_err());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        ["report.json"],
        "only the pre-existing directory remains"
    );

    // A successful write replaces the old content whole.
    let target = dir.path().join("out.md");
    std::fs::write(&target, "old").unwrap();
    write_atomic(&target, b"new").unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "new");
}

// ---------------------------------------------------------------- report comparison

/// A comparison of `config` whose only error is `err` in the final parameter.
fn with_error(config: &str, err: f64) -> lockstep_harness::parity::Comparison {
    let reference = record(
        "ddp",
        &[1.0, 1.0],
        vec![tensor("w", DType::F32, &[1], &[0.0])],
    );
    let run = record(
        config,
        &[1.0, 1.0],
        vec![tensor("w", DType::F32, &[1], &[err])],
    );
    compare(&run, &reference, &f32_policy())
}

fn status_of(result: &lockstep_harness::report::ReportComparison, config: &str) -> RowTrend {
    result
        .rows
        .iter()
        .find(|r| r.config == config)
        .map(|r| r.status)
        .unwrap()
}

#[test]
fn compare_flags_growth_crossing_and_vanishing() {
    let base = Report::new(vec![
        with_error("grows", 1e-8),
        with_error("crosses", 5e-6),
        with_error("vanishes", 0.0),
        with_error("steady", 1e-7),
        with_error("fixed", 1.0),
    ]);
    let new = Report::new(vec![
        with_error("grows", 1e-6),
        with_error("crosses", 2e-5),
        with_error("steady", 3e-7),
        with_error("fixed", 0.0),
        with_error("added", 0.0),
    ]);
    let result = compare_reports(&base, &new, &CompareOptions::default()).unwrap();
    assert!(result.has_regression());
    assert_eq!(status_of(&result, "grows"), RowTrend::Grew);
    assert_eq!(status_of(&result, "crosses"), RowTrend::CrossedTolerance);
    assert_eq!(status_of(&result, "vanishes"), RowTrend::Vanished);
    assert_eq!(status_of(&result, "steady"), RowTrend::Ok);
    assert_eq!(status_of(&result, "fixed"), RowTrend::Fixed);
    assert_eq!(status_of(&result, "added"), RowTrend::Added);
    let grows = result.rows.iter().find(|r| r.config == "grows").unwrap();
    assert_eq!(grows.quantity, Some(Quantity::Params));
    assert!((grows.growth.unwrap() - 100.0).abs() < 1e-6);
    assert_eq!(result.regressions().count(), 3);
    let table = result.render_table();
    assert!(
        table.contains("GREW") && table.contains("VANISHED") && table.contains("CROSSED TOLERANCE"),
        "{table}"
    );
    assert!(table.contains("3 regressions"));
    // A looser factor lets the 100x growth through; crossing and vanishing stay.
    let loose = compare_reports(
        &base,
        &new,
        &CompareOptions {
            factor: 1000.0,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(status_of(&loose, "grows"), RowTrend::Ok);
    assert_eq!(loose.regressions().count(), 2);
}

#[test]
fn compare_identical_reports_passes() {
    let report = Report::new(sample_comparisons());
    let result = compare_reports(&report, &report, &CompareOptions::default()).unwrap();
    assert!(!result.has_regression(), "{}", result.render_table());
    assert!(result.render_table().contains("no regression"));
    let nan = result
        .rows
        .iter()
        .find(|r| r.config.contains("weird"))
        .unwrap();
    assert!(nan.regressed.is_empty(), "inf to inf is no growth");
}

#[test]
fn compare_growth_from_zero_uses_the_floor() {
    let base = Report::new(vec![with_error("noise", 0.0), with_error("real", 0.0)]);
    let new = Report::new(vec![with_error("noise", 1e-15), with_error("real", 1e-9)]);
    let result = compare_reports(&base, &new, &CompareOptions::default()).unwrap();
    assert_eq!(status_of(&result, "noise"), RowTrend::Ok);
    assert_eq!(status_of(&result, "real"), RowTrend::Grew);
    assert!(matches!(
        compare_reports(
            &base,
            &new,
            &CompareOptions {
                factor: f64::NAN,
                ..Default::default()
            }
        ),
        Err(ReportError::InvalidFactor(_))
    ));
    let dup = Report::new(vec![with_error("x", 0.0), with_error("x", 0.0)]);
    assert!(matches!(
        compare_reports(&dup, &new, &CompareOptions::default()),
        Err(ReportError::DuplicateComparison { which: "base", .. })
    ));
}

// ---------------------------------------------------------------- diagnoses name the culprit

/// A tensor-parallel-like model: `embed.weight` [2, 2], `fc0.weight` [4, 2], `fc1.weight`
/// [1, 4], two steps of per-step gradients, as the reference and as a run whose backward
/// lost an all-reduce: `fc0.weight`'s gradient at step 0 is off in element [3, 1] (flat 7),
/// which shows in that step's gradient norm (the loss at step 0, computed before any
/// update, is right) and in the final value.
fn tp_pair() -> (RunRecord, RunRecord) {
    let grads = |bad: f64| {
        (0..2)
            .map(|s| {
                let mut fc0 = vec![0.5; 8];
                if s == 0 {
                    fc0[7] = bad;
                }
                vec![
                    tensor("embed.weight", DType::F32, &[2, 2], &[0.25; 4]),
                    tensor("fc0.weight", DType::F32, &[4, 2], &fc0),
                    tensor("fc1.weight", DType::F32, &[1, 4], &[0.125; 4]),
                ]
            })
            .collect::<Vec<_>>()
    };
    let params = |w: f64| {
        let mut fc0 = vec![1.0; 8];
        fc0[7] = w;
        vec![
            tensor("embed.weight", DType::F32, &[2, 2], &[1.0; 4]),
            tensor("fc0.weight", DType::F32, &[4, 2], &fc0),
            tensor("fc1.weight", DType::F32, &[1, 4], &[1.0; 4]),
        ]
    };
    let mut reference = record("single@2", &[2.0, 1.5], params(1.0));
    reference.grads = Some(grads(0.5));
    reference.grad_norms = vec![3.668, 3.1];
    let mut run = record("my_tp@2", &[2.0, 1.5], params(1.25));
    run.grads = Some(grads(0.25));
    run.grad_norms = vec![3.425, 3.1];
    (run, reference)
}

#[test]
fn the_failing_tensor_its_element_and_step_come_first_then_the_derived_scalar() {
    let (run, reference) = tp_pair();
    let c = compare(&run, &reference, &f32_policy());
    assert!(!c.passed);
    let f = c.first_failure.clone().expect("a culprit");
    assert_eq!(
        (f.quantity, f.step, f.tensor.as_deref(), f.index),
        (Quantity::Grads, Some(0), Some("fc0.weight"), Some(7))
    );
    assert_eq!(f.element.as_deref(), Some(&[3, 1][..]));
    let d = c.derived_failure.clone().expect("the derived scalar");
    assert_eq!((d.quantity, d.step), (Quantity::GradNorm, Some(0)));
    let text = c.diagnosis.clone().expect("a diagnosis");
    assert!(
        text.starts_with(
            "first failure: gradient of `fc0.weight` at step 0, element [3,1]: 0.25 vs reference \
             0.5 (|Δ| 2.500e-1 > allowed "
        ),
        "{text}"
    );
    assert!(
        text.contains(" ULP in f32); then grad_norm at step 0: 3.425 vs reference 3.668"),
        "{text}"
    );
    // The per-parameter verdicts over the run: the culprit's gradients fail from step 0.
    let g = c
        .grad_summaries
        .iter()
        .find(|g| g.name == "fc0.weight")
        .unwrap();
    assert_eq!(g.stats.first_failure.as_ref().and_then(|f| f.step), Some(0));
    assert_eq!(g.stats.compared, 16, "8 elements over 2 steps");
    assert!(c
        .grad_summaries
        .iter()
        .filter(|g| g.name != "fc0.weight")
        .all(|g| g.stats.passed));
}

#[test]
fn within_a_step_gradients_count_in_backward_order_and_an_earlier_step_wins() {
    let (mut run, reference) = tp_pair();
    // `embed.weight` (first in model order) is off at step 0 too: backward computed
    // `fc0.weight`'s gradient first, so that one is the culprit, and tops the table.
    let grads = run.grads.as_mut().unwrap();
    grads[0][0].values[2] = 0.75;
    let c = compare(&run, &reference, &f32_policy());
    let f = c.first_failure.clone().unwrap();
    assert_eq!((f.tensor.as_deref(), f.step), (Some("fc0.weight"), Some(0)));
    let rows = lockstep_harness::report::param_rows(&c);
    let names: Vec<&str> = rows.iter().map(|r| r.name).collect();
    assert_eq!(names, ["fc0.weight", "embed.weight", "fc1.weight"]);
    // Off only at step 1, `fc0.weight` comes after `embed.weight`'s step-0 failure.
    let (mut run, _) = tp_pair();
    let grads = run.grads.as_mut().unwrap();
    grads[0][1].values[7] = 0.5;
    grads[1][1].values[7] = 0.25;
    grads[0][0].values[2] = 0.75;
    let c = compare(&run, &reference, &f32_policy());
    let f = c.first_failure.clone().unwrap();
    assert_eq!(
        (f.tensor.as_deref(), f.step, f.element.as_deref()),
        (Some("embed.weight"), Some(0), Some(&[1, 0][..]))
    );
}

#[test]
fn reports_carry_the_culprit_and_a_per_parameter_table() {
    let (run, reference) = tp_pair();
    let report = Report::new(vec![compare(&run, &reference, &f32_policy())]);
    let md = render_markdown(&report);
    assert!(
        md.contains("first failure: gradient of `fc0.weight` at step 0, element [3,1]"),
        "{md}"
    );
    assert!(md.contains("## Per parameter"), "{md}");
    assert!(
        md.contains("| parameter | gradient: first failure | gradient: max \\|Δ\\| |"),
        "{md}"
    );
    // The failing parameter first, whatever the model order; passing ones after it.
    let fc0 = md
        .find("| `fc0.weight` | step 0 at [3,1] | 2.500e-1 |")
        .expect(&md);
    let embed = md
        .find("| `embed.weight` | — | 0 | 0 | — | 0 | 0 |")
        .expect(&md);
    assert!(fc0 < embed, "{md}");
    assert!(md.contains("| FAIL at [3,1] | 2.500e-1 |"), "{md}");

    let json: serde_json::Value =
        serde_json::from_str(&lockstep_harness::report::render_json(&report).unwrap()).unwrap();
    let c = &json["comparisons"][0];
    assert_eq!(c["first_failure"]["element"], serde_json::json!([3, 1]));
    assert_eq!(c["derived_failure"]["quantity"], "grad_norm");
    assert_eq!(c["grad_summaries"][1]["name"], "fc0.weight");
    assert_eq!(c["grad_summaries"][1]["stats"]["first_failure"]["step"], 0);

    let html = render_html(&report);
    roxmltree::Document::parse_with_options(
        &html,
        roxmltree::ParsingOptions {
            allow_dtd: true,
            ..Default::default()
        },
    )
    .expect("well-formed");
    assert!(html.contains("first failure: gradient of `fc0.weight` at step 0, element [3,1]"));
    assert!(html.contains("<table class=\"params\">"), "{html}");
    assert!(
        html.contains("<tr class=\"fail\"><td>fc0.weight</td><td>step 0 at [3,1]</td>"),
        "{html}"
    );
}

#[test]
fn a_huge_per_parameter_table_is_capped_failing_rows_first() {
    let params = |last: f64| {
        (0..30)
            .map(|i| {
                let v = if i == 29 { last } else { 1.0 };
                tensor(&format!("layer{i}.weight"), DType::F32, &[1], &[v])
            })
            .collect::<Vec<_>>()
    };
    let c = compare(
        &record("ddp", &[1.0], params(2.0)),
        &record("single", &[1.0], params(1.0)),
        &f32_policy(),
    );
    let md = render_markdown(&Report::new(vec![c]));
    let culprit = md
        .find("| `layer29.weight` | n/a | n/a | n/a | FAIL at [0] |")
        .expect(&md);
    assert!(culprit < md.find("| `layer0.weight` |").expect(&md), "{md}");
    assert!(md.contains("… 10 more parameters, all passing"), "{md}");
    assert!(
        !md.contains("| `layer19.weight` |"),
        "capped at 20 rows: {md}"
    );
}

/// A cross-rank check over 2 ranks that found rank 1's `fc0.weight` different after step 1.
fn cross_rank_mismatch() -> CrossRankCheck {
    CrossRankCheck {
        ranks: 2,
        compared: 12,
        mismatch: Some(CrossRankMismatch {
            step: 1,
            kind: StateKind::Param,
            name: "fc0.weight".into(),
            coord: String::new(),
            holders: vec![0, 1],
            agreeing: vec![0],
            differing: vec![1],
            sums: vec![8.0, 8.25],
            shapes: vec![vec![4, 2], vec![4, 2]],
        }),
    }
}

#[test]
fn a_cross_rank_mismatch_fails_and_is_the_first_failure() {
    let (_, reference) = tp_pair();
    let mut run = reference.clone();
    run.spec.config = "my_tp@2".into();
    run.cross_rank = Some(cross_rank_mismatch());
    let c = compare(&run, &reference, &f32_policy());
    assert!(!c.passed, "rank 0's numbers are right, rank 1's are not");
    let text = c.diagnosis.clone().expect("a diagnosis");
    assert!(
        text.starts_with(
            "first failure: parameter `fc0.weight` differs across ranks after step 1: rank 1 \
             differs from rank 0"
        ),
        "{text}"
    );
    // With value failures too, the mismatch stays first and the values follow.
    let (mut buggy, _) = tp_pair();
    buggy.cross_rank = Some(cross_rank_mismatch());
    let text = compare(&buggy, &reference, &f32_policy())
        .diagnosis
        .unwrap();
    assert!(
        text.starts_with("first failure: parameter `fc0.weight` differs"),
        "{text}"
    );
    assert!(
        text.contains(
            ". rank 0 against the reference: gradient of `fc0.weight` at step 0, element [3,1]"
        ),
        "{text}"
    );

    let report = Report::new(vec![c]);
    let md = render_markdown(&report);
    assert!(
        md.contains(
            "cross-rank: MISMATCH: parameter `fc0.weight` differs across ranks after step 1"
        ),
        "{md}"
    );
    assert!(render_html(&report).contains("cross-rank: MISMATCH: parameter `fc0.weight`"));

    // A clean check passes and says what it covered.
    run.cross_rank = Some(CrossRankCheck {
        mismatch: None,
        ..cross_rank_mismatch()
    });
    let c = compare(&run, &reference, &f32_policy());
    assert!(c.passed, "{:?}", c.diagnosis);
    let report = Report::new(vec![c]);
    for text in [render_markdown(&report), render_html(&report)] {
        assert!(
            text.contains("cross-rank: 12 tensors compared across 2 ranks, all bitwise equal"),
            "{text}"
        );
    }
}

#[test]
fn compare_lists_every_regressed_quantity_and_no_factor_from_zero() {
    let (buggy, reference) = tp_pair();
    let mut good = reference.clone();
    good.spec.config = buggy.spec.config.clone();
    let policy = f32_policy();
    let base = Report::new(vec![compare(&good, &reference, &policy)]);
    let new = Report::new(vec![compare(&buggy, &reference, &policy)]);
    let result = compare_reports(&base, &new, &CompareOptions::default()).unwrap();
    let row = &result.rows[0];
    assert_eq!(row.status, RowTrend::CrossedTolerance);
    let regressed: Vec<&str> = row.regressed.iter().map(|d| d.what.as_str()).collect();
    for what in [
        "grad_norm",
        "gradient of `fc0.weight`",
        "final value of `fc0.weight`",
    ] {
        assert!(
            regressed.contains(&what),
            "{what} missing from {regressed:?}"
        );
    }
    assert!(
        !regressed.contains(&"loss"),
        "the loss did not move: {regressed:?}"
    );
    assert!(
        !regressed.contains(&"gradient of `embed.weight`"),
        "{regressed:?}"
    );
    // Every base error was exactly 0: no ratio exists.
    assert_eq!(row.growth, None);
    assert!(
        row.regressed.iter().all(|d| d.change.factor().is_none()),
        "{regressed:?}"
    );
    let table = result.render_table();
    assert_eq!(table.matches("new (was 0)").count(), 3, "{table}");
    assert!(!table.contains("e8x") && !table.contains("e9x"), "{table}");
    assert!(
        table.contains("  gradient of `fc0.weight`") || table.contains("gradient of `fc0.weight`")
    );
}

#[test]
fn compare_growth_factors_come_only_from_a_measurable_base() {
    // A subnormal base is noise even below the floor: no factor, "new".
    let base = Report::new(vec![with_error("sub", 1e-310), with_error("nan", 1e-6)]);
    let new = Report::new(vec![with_error("sub", 1e-6), with_error("nan", f64::NAN)]);
    let options = CompareOptions {
        zero_floor: 0.0,
        ..CompareOptions::default()
    };
    let result = compare_reports(&base, &new, &options).unwrap();
    let row = |config: &str| result.rows.iter().find(|r| r.config == config).unwrap();
    assert_eq!(row("sub").status, RowTrend::Grew);
    assert_eq!(row("sub").growth, None);
    assert!(matches!(row("sub").change, Some(Change::FromNoise { .. })));
    assert_eq!(row("nan").change, Some(Change::NonFinite));
    assert_eq!(row("nan").growth, None);
    let table = result.render_table();
    assert!(
        table.contains("new (was 1.000e-310)") && table.contains("now non-finite"),
        "{table}"
    );
}

// ---------------------------------------------------------------- the fp64 arbiter

mod arbiter {
    use super::*;
    use lockstep_harness::parity::{arbitrate, Envelope, Mode, ENVELOPE};

    /// A record with one loss per step and one final parameter.
    fn run(config: &str, losses: &[f64], w: &[f64], dtype: DType) -> RunRecord {
        record(
            config,
            losses,
            vec![tensor("w", dtype, &[w.len() as i64], w)],
        )
    }

    const EXACT: Envelope = Envelope {
        k: 16.0,
        floor_ulps: 0.0,
    };

    #[test]
    fn a_run_within_k_times_the_references_noise_passes_and_beyond_fails() {
        let ref64 = run("single.f64@2", &[1.0, 1.0], &[2.0, 3.0], DType::F64);
        // The fp32 reference is 1e-6 off float64 on the loss and the parameter.
        let ref32 = run(
            "single@2",
            &[1.0 + 1e-6, 1.0 + 1e-6],
            &[2.0, 3.0 + 1e-6],
            DType::F32,
        );
        let near = run(
            "ddp@2",
            &[1.0 - 1.5e-5, 1.0],
            &[2.0, 3.0 - 1.5e-5],
            DType::F32,
        );
        let c = arbitrate(&near, &ref32, &ref64, &EXACT, None);
        assert!(c.passed, "{:?}", c.diagnosis);
        assert_eq!(c.mode, Mode::Arbiter);
        assert_eq!(c.reference, "single@2", "named after the shadowed training");
        let far = run("ddp@2", &[1.0, 1.0], &[2.0, 3.0 + 1.7e-5], DType::F32);
        let c = arbitrate(&far, &ref32, &ref64, &EXACT, None);
        assert!(!c.passed);
        let f = c.first_failure.expect("a failure");
        assert_eq!(
            (f.quantity, f.tensor.as_deref(), f.index),
            (Quantity::Params, Some("w"), Some(1))
        );
        let e = f.envelope.expect("the distances");
        assert!((e.run_to_f64 - 1.7e-5).abs() < 1e-12 && (e.reference_to_f64 - 1e-6).abs() < 1e-12);
        let text = c.diagnosis.expect("a diagnosis");
        assert!(
            text.starts_with("first failure: final value of `w`, element [1]: |run − fp64|"),
            "{text}"
        );
        assert!(text.contains("|fp32 reference − fp64|"), "{text}");
    }

    #[test]
    fn the_arbiter_names_the_culprit_tensor_first_and_a_cross_rank_mismatch_before_it() {
        let (mut run, reference) = tp_pair();
        let mut ref64 = reference.clone();
        ref64.spec.config = "single.f64@2".into();
        let c = arbitrate(&run, &reference, &ref64, &ENVELOPE, None);
        assert!(!c.passed);
        let f = c.first_failure.clone().expect("a culprit");
        assert_eq!(
            (
                f.quantity,
                f.step,
                f.tensor.as_deref(),
                f.element.as_deref()
            ),
            (
                Quantity::Grads,
                Some(0),
                Some("fc0.weight"),
                Some(&[3, 1][..])
            )
        );
        let text = c.diagnosis.clone().expect("a diagnosis");
        assert!(
            text.starts_with(
                "first failure: gradient of `fc0.weight` at step 0, element [3,1]: |run − fp64| \
                 2.500e-1 > 1.600e1 × |fp32 reference − fp64| 0 + floor"
            ),
            "{text}"
        );
        assert!(text.contains("there 0.25 vs fp64 0.5 ("), "{text}");
        assert!(
            text.contains("; then grad_norm at step 0: |run − fp64|"),
            "{text}"
        );
        assert!(c
            .grad_summaries
            .iter()
            .any(|g| g.name == "fc0.weight" && !g.stats.passed));
        let md = render_markdown(&Report::new(vec![c]));
        assert!(md.contains("gradient: max \\|Δ\\| to fp64"), "{md}");

        run.cross_rank = Some(cross_rank_mismatch());
        let text = arbitrate(&run, &reference, &ref64, &ENVELOPE, None)
            .diagnosis
            .expect("a diagnosis");
        assert!(
            text.starts_with("first failure: parameter `fc0.weight` differs across ranks"),
            "{text}"
        );
        // A correct run whose ranks disagree fails under the arbiter too.
        let mut twin = reference.clone();
        twin.cross_rank = Some(cross_rank_mismatch());
        assert!(!arbitrate(&twin, &reference, &ref64, &ENVELOPE, None).passed);
    }

    #[test]
    fn the_floor_covers_what_the_reference_gets_exactly() {
        let ref64 = run("single.f64@2", &[1.0], &[1.0], DType::F64);
        let ref32 = run("single@2", &[1.0], &[1.0], DType::F32);
        // One fp32 ULP at 1.0 is 2^-23 = 2 units of 2^-24: inside a floor of 8, outside 0.
        let one_ulp = run("ddp@2", &[1.0], &[next_f32(1.0)], DType::F32);
        assert!(arbitrate(&one_ulp, &ref32, &ref64, &ENVELOPE, None).passed);
        assert!(!arbitrate(&one_ulp, &ref32, &ref64, &EXACT, None).passed);
    }

    #[test]
    fn the_envelope_never_falls_below_an_earlier_steps_noise() {
        let ref64 = run("single.f64@2", &[1.0, 1.0], &[1.0], DType::F64);
        // At step 1 the fp32 reference lands on float64 by chance.
        let ref32 = run("single@2", &[1.0 + 1e-6, 1.0], &[1.0], DType::F32);
        let ddp = run("ddp@2", &[1.0, 1.0 + 1e-5], &[1.0], DType::F32);
        let c = arbitrate(&ddp, &ref32, &ref64, &EXACT, None);
        assert!(c.passed, "{:?}", c.diagnosis);
        let step1 = c.steps[1]
            .loss
            .as_ref()
            .and_then(|l| l.envelope)
            .expect("step 1");
        assert!((step1.reference_to_f64 - 1e-6).abs() < 1e-12, "{step1:?}");
    }

    #[test]
    fn a_nan_run_fails_and_a_routing_near_tie_is_named() {
        let mut ref64 = run("single.f64@2", &[1.0], &[1.0], DType::F64);
        ref64.routing_min_gap = Some(3e-7);
        let ref32 = run("single@2", &[1.0 + 1e-7], &[1.0], DType::F32);
        let broken = run("ep.2@2", &[f64::NAN], &[1.0], DType::F32);
        let c = arbitrate(&broken, &ref32, &ref64, &ENVELOPE, None);
        assert!(!c.passed);
        let text = c.diagnosis.expect("a diagnosis");
        assert!(text.contains("loss at step 0"), "{text}");
        assert!(
            text.contains("near-tie") && text.contains("3.000e-7"),
            "{text}"
        );
    }

    #[test]
    fn where_a_reference_is_not_finite_the_run_must_be_what_the_fp32_reference_is() {
        // fp32 overflowed where float64 did not: no noise to measure there.
        let ref64 = run("single.f64@2", &[1.0], &[1e39, 1.0], DType::F64);
        let ref32 = run("single@2", &[1.0], &[f64::INFINITY, 1.0], DType::F32);
        let same = run("ddp@2", &[1.0], &[f64::INFINITY, 1.0], DType::F32);
        assert!(arbitrate(&same, &ref32, &ref64, &ENVELOPE, None).passed);
        let nan = run("ddp@2", &[1.0], &[f64::NAN, 1.0], DType::F32);
        let c = arbitrate(&nan, &ref32, &ref64, &ENVELOPE, None);
        assert!(
            !c.passed,
            "a NaN run passed against an overflowed reference"
        );
        assert_eq!(c.first_failure.and_then(|f| f.index), Some(0));
        // A reference whose loss is NaN has diverged: from there nothing is judged, and the
        // comparison says from which step.
        let ref64 = run("single.f64@2", &[f64::NAN], &[1.0], DType::F64);
        let ref32 = run("single@2", &[f64::NAN], &[1.0], DType::F32);
        let finite = run("ddp@2", &[2.0], &[1.0], DType::F32);
        let c = arbitrate(&finite, &ref32, &ref64, &ENVELOPE, None);
        assert_eq!(c.arbiter.and_then(|a| a.unjudged_from), Some(0));
    }

    #[test]
    fn steps_after_the_reference_overflows_are_not_judged() {
        let ref64 = run("single.f64@2", &[1.0, 1e40, 1e80], &[1e90], DType::F64);
        let ref32 = run(
            "single@2",
            &[1.0, f64::INFINITY, f64::NAN],
            &[f64::NAN],
            DType::F32,
        );
        let ddp = run("ddp@2", &[1.0, f64::NEG_INFINITY, 3.0], &[0.0], DType::F32);
        let c = arbitrate(&ddp, &ref32, &ref64, &ENVELOPE, None);
        assert!(c.passed, "{:?}", c.diagnosis);
        assert_eq!(c.steps.len(), 1);
        assert_eq!(c.arbiter.and_then(|a| a.unjudged_from), Some(1));
        // Before the overflow, a NaN run still fails.
        let broken = run("ddp@2", &[f64::NAN, 1.0, 1.0], &[0.0], DType::F32);
        assert!(!arbitrate(&broken, &ref32, &ref64, &ENVELOPE, None).passed);
    }

    #[test]
    fn a_run_without_the_references_gradients_is_a_structural_failure() {
        let mut ref64 = run("single.f64@2", &[1.0], &[1.0], DType::F64);
        let mut ref32 = run("single@2", &[1.0], &[1.0], DType::F32);
        let g = |d| vec![vec![tensor("w", d, &[1], &[0.5])]];
        ref64.grads = Some(g(DType::F64));
        ref32.grads = Some(g(DType::F32));
        let ddp = run("ddp@2", &[1.0], &[1.0], DType::F32);
        let c = arbitrate(&ddp, &ref32, &ref64, &ENVELOPE, None);
        assert!(!c.passed);
        assert!(
            c.structural.iter().any(|s| s.contains("gradients")),
            "{:?}",
            c.structural
        );
    }

    #[test]
    fn the_log_gets_one_line_per_judged_quantity() {
        let ref64 = run("single.f64@2", &[1.0, 1.0], &[1.0, 2.0], DType::F64);
        let ref32 = run("single@2", &[1.0, 1.0], &[1.0, 2.0], DType::F32);
        let mut log = Vec::new();
        let _ = arbitrate(&ref32, &ref32, &ref64, &ENVELOPE, Some(&mut log));
        let text = String::from_utf8(log).expect("utf-8");
        // Two steps × (loss, grad norm), then the final parameter.
        assert_eq!(text.lines().count(), 5, "{text}");
        assert!(
            text.lines()
                .all(|l| l.starts_with("nested,single@2,single@2,")),
            "{text}"
        );
    }
}

/// A second correct fp32 run that strays further from float64 than the reference widens the
/// envelope to its distance, and is named in the summary; without it the same run fails.
#[test]
fn the_arbiter_envelope_is_the_widest_of_the_correct_fp32_runs() {
    use lockstep_harness::parity::{arbitrate, arbitrate_with_spread, ENVELOPE};
    let w = |v: f64| vec![tensor("w", DType::F32, &[1], &[v])];
    let exact = record("single.f64@2", &[1.0], w(1.0));
    let reference = record("single@2", &[1.0], w(1.0 + 1e-6));
    let variant = record("single.mb2@2", &[1.0], w(1.0 - 4e-6));
    // 30e-6 from float64: beyond 16 × 1e-6 + floor, within 16 × 4e-6.
    let run = record("tp.2@2", &[1.0], w(1.0 + 30e-6));
    let alone = arbitrate(&run, &reference, &exact, &ENVELOPE, None);
    assert!(!alone.passed, "one sample's envelope must not hold the run");
    let spread = arbitrate_with_spread(&run, &reference, &[&variant], &exact, &ENVELOPE, None);
    assert!(spread.passed, "{:?}", spread.overall().first_failure);
    let summary = spread.arbiter.expect("an arbiter summary");
    assert_eq!(summary.spread_from, vec!["single.mb2@2".to_owned()]);
    // A variant that overflowed measured nothing: it leaves the envelope as it was.
    let overflowed = record("single.mb2@2", &[1.0], w(f64::INFINITY));
    let c = arbitrate_with_spread(&run, &reference, &[&overflowed], &exact, &ENVELOPE, None);
    assert!(!c.passed);
}

/// A passing arbiter row whose error columns are large (a value near zero: a tiny absolute
/// error is a huge ULP count) says, under the table, why the margin and not those columns is
/// the verdict; a report without such a row says nothing.
#[test]
fn a_passing_row_with_large_ulp_counts_is_explained() {
    use lockstep_harness::parity::{arbitrate, ENVELOPE};
    use lockstep_harness::report::LARGE_DISTANCES_NOTE;
    let near_zero = |config: &str, w: f64| {
        record(
            config,
            &[1.0, 1.0, 1.0],
            vec![tensor("b", DType::F32, &[1], &[w])],
        )
    };
    let ref64 = near_zero("single.f64@2", 1e-12);
    let ref32 = near_zero("single@2", 1e-12 + 1e-9);
    let run = near_zero("ddp@2", 1e-12 + 2e-9);
    let c = arbitrate(&run, &ref32, &ref64, &ENVELOPE, None);
    assert!(c.passed, "{:?}", c.diagnosis);
    assert!(c.overall().max_ulp >= 1000, "{}", c.overall().max_ulp);
    let report = Report::new(vec![c]);
    let md = render_markdown(&report);
    assert!(md.contains(LARGE_DISTANCES_NOTE), "{md}");
    assert!(render_html(&report).contains("the margin is the verdict"));
    let quiet = render_markdown(&Report::new(sample_comparisons()));
    assert!(!quiet.contains(LARGE_DISTANCES_NOTE), "{quiet}");
}
