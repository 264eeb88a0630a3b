//! Serde helpers for `f64` fields that may be NaN or infinite (a diverged loss, an error
//! against a zero reference). JSON has no such numbers and `serde_json` would silently write
//! `null`, losing the distinction; these write the strings `"NaN"`, `"inf"` and `"-inf"`
//! instead and read them back.

use serde::{Deserialize, Deserializer, Serializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum Repr {
    Num(f64),
    Text(String),
}

fn from_repr<E: serde::de::Error>(r: Repr) -> Result<f64, E> {
    match r {
        Repr::Num(x) => Ok(x),
        Repr::Text(t) => match t.as_str() {
            "NaN" | "nan" => Ok(f64::NAN),
            "inf" | "+inf" | "Infinity" => Ok(f64::INFINITY),
            "-inf" | "-Infinity" => Ok(f64::NEG_INFINITY),
            other => Err(E::custom(format!(
                "expected a number, \"NaN\", \"inf\" or \"-inf\", found {other:?}"
            ))),
        },
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
    from_repr(Repr::deserialize(d)?)
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

    /// Reads what [`serialize`] wrote; a missing field needs `#[serde(default)]`.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
        match Option::<Repr>::deserialize(d)? {
            Some(r) => from_repr(r).map(Some),
            None => Ok(None),
        }
    }
}

/// The same for `Vec<f64>` (a loss curve, a tensor's values).
pub mod vec {
    use super::*;
    use serde::ser::SerializeSeq;

    /// Writes every element as [`super::serialize`] does.
    pub fn serialize<S: Serializer>(xs: &[f64], s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(xs.len()))?;
        for x in xs {
            seq.serialize_element(&Wrapped(*x))?;
        }
        seq.end()
    }

    /// Reads what [`serialize`] wrote.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Vec::<Repr>::deserialize(d)?
            .into_iter()
            .map(from_repr)
            .collect()
    }

    struct Wrapped(f64);

    impl serde::Serialize for Wrapped {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            super::serialize(&self.0, s)
        }
    }
}
