//! Helpers for root tests that judge as the `lockstep` crate does (it is not a dependency of
//! the core crate's own tests).

#![allow(dead_code)]

/// Judges `run` against one process training `world` ranks' batches for `steps` steps, as
/// the matrix judges a pair that is equal only up to summation order (TP, EP, compositions
/// against single device): by the fp64 arbiter, within 16 times the fp32 reference's own
/// distance to its float64 shadow. A fixed fp32 tolerance cannot give such a pair one verdict
/// on every machine: the CPU kernels (`ATEN_CPU_CAPABILITY`) change the summation order and
/// with it how far both sides drift over the steps. `build(seed, rank)` builds the model the
/// run trained, from seed 0.
pub fn judged_against_single(
    run: &lockstep_core::record::RunRecord,
    build: &lockstep::runner::ModelBuilder<'_>,
    world: usize,
    steps: usize,
) -> lockstep_harness::parity::Comparison {
    judged_within(run, build, world, steps, None)
}

/// [`judged_against_single`] with `envelope` (another correct fp32 run of the same batches,
/// `single.cpN` say) in place of the single device's fp32 run as the envelope, still around
/// the single device's float64 shadow.
pub fn judged_within(
    run: &lockstep_core::record::RunRecord,
    build: &lockstep::runner::ModelBuilder<'_>,
    world: usize,
    steps: usize,
    envelope: Option<lockstep_core::record::RunRecord>,
) -> lockstep_harness::parity::Comparison {
    use lockstep::runner::{shadow_f64, RunFailed};
    use lockstep_core::train::{single_device_reference, OptimizerConfig};
    let train = |model: Box<dyn lockstep_models::Model>| {
        single_device_reference(
            model.as_ref(),
            world,
            steps,
            OptimizerConfig::default(),
            true,
        )
        .map_err(|e| RunFailed::simple(format!("single-device reference: {e}")))
    };
    let fp32 = envelope.unwrap_or_else(|| {
        train(build(0, 0).expect("the model builds")).expect("the fp32 reference")
    });
    let fp64 = shadow_f64(build, 0, tch::Device::Cpu, train).expect("the float64 shadow");
    lockstep_harness::parity::arbitrate(
        run,
        &fp32,
        &fp64,
        &lockstep_harness::parity::ENVELOPE,
        None,
    )
}
