//! What a rank hands back reaches the launching process bit for bit: the record in its binary
//! form, non-finite and signed-zero values included, and the JSON form users keep reading
//! both the numbers and the strings that stand for non-finite ones.

use lockstep_core::comm::DType;
use lockstep_core::record::{NamedTensor, RunRecord, RunSpec};
use lockstep_harness::launch::hand_back::{decode_record, hand_back_record, take_handed_back};

/// Values a run can produce that a lossy encoding would change: NaN, both infinities, a
/// subnormal, a negative zero, and a value decimal rendering must print to 17 digits.
fn awkward() -> Vec<f64> {
    vec![
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::MIN_POSITIVE / 4.0,
        -0.0,
        0.1 + 0.2,
        1.0,
    ]
}

fn record() -> RunRecord {
    let spec = RunSpec {
        model: "gpt".into(),
        config: "fsdp.full_shard@4".into(),
        world_size: 4,
        backend: "cpu".into(),
        dtype: "fp32".into(),
        steps: 7,
        seed: 3,
    };
    let mut record = RunRecord::start(spec, true);
    record.losses = awkward();
    record.grad_norms = awkward().into_iter().rev().collect();
    let tensor = |name: &str| NamedTensor {
        name: name.into(),
        dtype: DType::F32,
        shape: vec![7],
        values: awkward(),
    };
    record.params = vec![tensor("w"), tensor("b")];
    record.grads = Some(vec![vec![tensor("w")]; 2]);
    record.routing_min_gap = Some(f64::NAN);
    record
}

fn bits(xs: &[f64]) -> Vec<u64> {
    xs.iter().map(|x| x.to_bits()).collect()
}

fn assert_same_bits(got: &RunRecord, want: &RunRecord) {
    assert_eq!(got.spec, want.spec);
    assert_eq!(bits(&got.losses), bits(&want.losses));
    assert_eq!(bits(&got.grad_norms), bits(&want.grad_norms));
    for (g, w) in got.params.iter().zip(&want.params) {
        assert_eq!((&g.name, g.dtype, &g.shape), (&w.name, w.dtype, &w.shape));
        assert_eq!(bits(&g.values), bits(&w.values), "{}", g.name);
    }
    assert_eq!(got.params.len(), want.params.len());
    let grads = |r: &RunRecord| -> Vec<Vec<u64>> {
        r.grads
            .iter()
            .flatten()
            .flatten()
            .map(|t| bits(&t.values))
            .collect()
    };
    assert_eq!(grads(got), grads(want));
    assert_eq!(
        got.routing_min_gap.map(f64::to_bits),
        want.routing_min_gap.map(f64::to_bits)
    );
}

#[test]
fn a_handed_back_record_arrives_bit_for_bit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("record.cbor");
    let sent = record();
    hand_back_record(&sent, &out).expect("hand back");
    let bytes = take_handed_back(&out).expect("the record was handed back");
    assert!(!out.exists(), "taking a record removes its file");
    assert_same_bits(&decode_record(&bytes).expect("decode"), &sent);
    // Eight bytes a value, not a decimal rendering: the binary form is what makes it cheap.
    let json = serde_json::to_vec(&sent).expect("json");
    assert!(
        bytes.len() < json.len(),
        "{} vs {}",
        bytes.len(),
        json.len()
    );
}

#[test]
fn the_json_form_keeps_non_finite_values_and_reads_integers() {
    let sent = record();
    let json = serde_json::to_string(&sent).expect("json");
    assert!(
        json.contains(r#""NaN""#) && json.contains(r#""-inf""#),
        "{json}"
    );
    let back: RunRecord = serde_json::from_str(&json).expect("read back");
    assert_same_bits(&back, &sent);
    // Written by hand or by another tool: integers are numbers too, and `null` is no value.
    #[derive(serde::Deserialize)]
    struct Edited {
        #[serde(with = "lockstep_core::num::vec")]
        values: Vec<f64>,
        #[serde(with = "lockstep_core::num::opt")]
        gap: Option<f64>,
        #[serde(with = "lockstep_core::num")]
        one: f64,
    }
    let edited: Edited =
        serde_json::from_str(r#"{"values": [1, -2, "inf", 0.5], "gap": null, "one": "NaN"}"#)
            .expect("read the edited values");
    assert_eq!(bits(&edited.values[..2]), bits(&[1.0, -2.0]));
    assert_eq!(edited.values[2], f64::INFINITY);
    assert_eq!((edited.gap, edited.one.is_nan()), (None, true));
    let bad = json.replacen(r#""NaN""#, r#""nope""#, 1);
    let err = serde_json::from_str::<RunRecord>(&bad).expect_err("not a number");
    assert!(err.to_string().contains(r#"found "nope""#), "{err}");
}

#[test]
fn a_record_that_is_not_one_is_refused_with_a_reason() {
    let err = decode_record(b"{\"losses\": [1.0]}").expect_err("JSON is not the binary form");
    assert!(!err.to_string().is_empty());
    let err = decode_record(&[]).expect_err("nothing");
    assert!(!err.to_string().is_empty());
}
