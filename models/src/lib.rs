//! Lockstep's model zoo: models defined once, with deterministic initialization and inputs,
//! which plans parallelize without the models knowing.
//!
//! Determinism starts here: every rank derives its seeds from one run seed, so a reference
//! run and a parallel run see the same weights and the same per-rank data.

pub mod seed;
