//! Serde helpers for `f64` fields that may be NaN or infinite (a diverged loss, an error
//! against a zero reference). JSON has no such numbers and `serde_json` would silently write
//! `null`, losing the distinction; these write the strings `"NaN"`, `"inf"` and `"-inf"`
//! instead and read them back.
//!
//! In a binary format (one whose serializer is not human-readable: the CBOR a launched rank
//! hands its record back in) a `Vec<f64>` is written as one byte string of little-endian
//! values, bit for bit, so a record of many tensors is a copy rather than a decimal rendering
//! of every value. Readers accept either form whatever the format.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Serializer;
use std::fmt;

fn non_finite<E: de::Error>(t: &str) -> Result<f64, E> {
    match t {
        "NaN" | "nan" => Ok(f64::NAN),
        "inf" | "+inf" | "Infinity" => Ok(f64::INFINITY),
        "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
        other => Err(E::custom(format!(
            "expected a number, \"NaN\", \"inf\" or \"-inf\", found {other:?}"
        ))),
    }
}

/// Reads one value: a number, or one of the strings [`serialize`] writes for non-finite ones.
struct ValueVisitor;

impl<'de> Visitor<'de> for ValueVisitor {
    type Value = f64;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a number, \"NaN\", \"inf\" or \"-inf\"")
    }

    fn visit_f64<E: de::Error>(self, x: f64) -> Result<f64, E> {
        Ok(x)
    }

    fn visit_i64<E: de::Error>(self, x: i64) -> Result<f64, E> {
        Ok(x as f64)
    }

    fn visit_u64<E: de::Error>(self, x: u64) -> Result<f64, E> {
        Ok(x as f64)
    }

    fn visit_str<E: de::Error>(self, t: &str) -> Result<f64, E> {
        non_finite(t)
    }
}

/// Writes a finite value as a JSON number and a non-finite one as a string.
pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
    if x.is_nan() {
        s.serialize_str("NaN")
    } else if x.is_infinite() {
        s.serialize_str(if *x > 0.0 { "inf" } else { "-inf" })
    } else {
        s.serialize_f64(*x)
    }
}

/// Reads what [`serialize`] wrote.
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    d.deserialize_any(ValueVisitor)
}

/// The same for `Option<f64>`: `None` is `null`.
pub mod opt {
    use super::*;

    /// Writes `None` as `null`, a value as [`super::serialize`] does.
    pub fn serialize<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
        match x {
            Some(x) => super::serialize(x, s),
            None => s.serialize_none(),
        }
    }

    struct OptVisitor;

    impl<'de> Visitor<'de> for OptVisitor {
        type Value = Option<f64>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("null, a number, \"NaN\", \"inf\" or \"-inf\"")
        }

        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            super::deserialize(d).map(Some)
        }
    }

    /// Reads what [`serialize`] wrote; a missing field needs `#[serde(default)]`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        d.deserialize_option(OptVisitor)
    }
}

/// The same for `Vec<f64>` (a loss curve, a tensor's values).
pub mod vec {
    use super::*;
    use serde::ser::SerializeSeq;

    /// Writes every element as [`super::serialize`] does; in a binary format, the whole
    /// vector as one byte string of little-endian values.
    pub fn serialize<S: Serializer>(xs: &[f64], s: S) -> Result<S::Ok, S::Error> {
        if !s.is_human_readable() {
            let bytes: Vec<u8> = xs.iter().flat_map(|x| x.to_le_bytes()).collect();
            return s.serialize_bytes(&bytes);
        }
        let mut seq = s.serialize_seq(Some(xs.len()))?;
        for x in xs {
            seq.serialize_element(&Wrapped(*x))?;
        }
        seq.end()
    }

    /// One element of a sequence, read as [`super::deserialize`] reads a value.
    struct Element(f64);

    impl<'de> serde::Deserialize<'de> for Element {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            super::deserialize(d).map(Element)
        }
    }

    struct VecVisitor;

    impl<'de> Visitor<'de> for VecVisitor {
        type Value = Vec<f64>;

        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a sequence of numbers, or a byte string of little-endian f64 values")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
            while let Some(Element(x)) = seq.next_element()? {
                out.push(x);
            }
            Ok(out)
        }

        fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Self::Value, E> {
            if !bytes.len().is_multiple_of(8) {
                return Err(E::custom(format!(
                    "a byte string of f64 values has a multiple of 8 bytes, not {}",
                    bytes.len()
                )));
            }
            Ok(bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect())
        }
    }

    /// Reads what [`serialize`] wrote, in either form.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        d.deserialize_any(VecVisitor)
    }

    struct Wrapped(f64);

    impl serde::Serialize for Wrapped {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(&self.0, s)
        }
    }
}
