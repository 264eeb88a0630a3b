//! How small a fault the fp64 arbiter catches: one gradient element, on one rank, at one step,
//! scaled by `1 + ε` before DDP averages it. Each zoo model with a single-device reference is
//! trained under plain DDP at world 2 with that fault for ε = 1e-7 … 1e-1 and judged against
//! `single@2`; the smallest ε caught is checked against the bound recorded in docs/parity.md
//! ("Sensitivity"). A change that makes the arbiter miss a fault it caught before fails here.

use lockstep::comm::{CommError, ProcessGroup, ReduceOp};
use lockstep::core::ddp::{train_ddp, CommHook, DdpOptions, GradBucket};
use lockstep::core::record::RunRecord;
use lockstep::core::train::TrainConfig;
use lockstep::harness::RankCtx;
use lockstep::models::Model;
use lockstep::parity_test::ParityTest;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The step whose gradient is perturbed (not the first: a fault at step 1 must survive the
/// optimizer's momentum into later steps' numbers too).
const FAULT_STEP: usize = 1;

/// DDP's own averaging (one all-reduce with `Avg` per bucket, as without a hook), after
/// scaling, on the last rank at [`FAULT_STEP`], the largest-magnitude element of the first
/// bucket by `1 + epsilon`.
struct ScaleOneElement {
    epsilon: f64,
    calls_on_first_bucket: AtomicUsize,
}

impl CommHook for ScaleOneElement {
    fn reduce(&self, bucket: &GradBucket<'_>, dp: &dyn ProcessGroup) -> Result<(), CommError> {
        if bucket.index == 0 {
            let step = self.calls_on_first_bucket.fetch_add(1, Ordering::SeqCst);
            if step == FAULT_STEP && dp.rank() == dp.size() - 1 {
                let flat = bucket.buffer;
                let worst = flat.abs().argmax(0, false).int64_value(&[]);
                let v = flat.double_value(&[worst]);
                let _ = flat.narrow(0, worst, 1).fill_(v * (1.0 + self.epsilon));
            }
        }
        dp.all_reduce(bucket.buffer, ReduceOp::Avg)
    }
}

fn faulty_ddp(
    epsilon: f64,
) -> impl Fn(&RankCtx, &dyn Model, &TrainConfig) -> Result<RunRecord, String> + Sync {
    move |ctx, model, cfg| {
        let hook = ScaleOneElement {
            epsilon,
            calls_on_first_bucket: AtomicUsize::new(0),
        };
        let opts = DdpOptions {
            comm_hook: Some(Arc::new(hook)),
            ..DdpOptions::default()
        };
        train_ddp(model, ctx.group(), cfg, opts).map_err(|e| e.to_string())
    }
}

/// The ε tried, smallest first.
const EPSILONS: [f64; 7] = [1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1];

#[test]
fn the_arbiter_catches_one_scaled_gradient_element() {
    let cases: Vec<(&str, f64)> = vec![
        ("nested", 1e-5),
        ("mlp", 1e-5),
        ("transformer", 1e-4),
        ("gpt", 1e-5),
        ("gpt_moe", 1e-5),
    ];
    crate::common::each_case(
        "the_arbiter_catches_one_scaled_gradient_element",
        cases,
        |&(model, bound): &(&str, f64)| {
            let name = format!("arbiter_sensitivity_{model}");
            let mut test = ParityTest::new(&name)
                .zoo(model)
                .world_sizes(&[2])
                .steps(5)
                .config("ddp");
            let labels: Vec<String> = EPSILONS
                .iter()
                .map(|e| format!("ddp.scaled.{e:e}"))
                .collect();
            for (label, &eps) in labels.iter().zip(&EPSILONS) {
                test = test.custom_config(label, faulty_ddp(eps));
            }
            let outcome = test.run().expect("the sensitivity test runs");
            let verdict = |label: &str| {
                let row = format!("{label}@2");
                outcome
                    .report
                    .comparisons
                    .iter()
                    .find(|c| c.config == row)
                    .map(|c| c.passed)
                    .unwrap_or_else(|| panic!("no comparison for {row}:\n{}", outcome.summary()))
            };
            assert!(
                verdict("ddp"),
                "plain DDP must pass:\n{}",
                outcome.summary()
            );
            let caught: Vec<f64> = labels
                .iter()
                .zip(&EPSILONS)
                .filter(|(label, _)| !verdict(label))
                .map(|(_, &e)| e)
                .collect();
            let smallest = caught.first().copied();
            println!("{model}: smallest epsilon caught {smallest:?} (caught: {caught:?})");
            // Detection is monotone: once caught, every larger fault is caught too.
            let expected: Vec<f64> = EPSILONS
                .iter()
                .copied()
                .filter(|&e| smallest.is_some_and(|s| e >= s))
                .collect();
            assert_eq!(
                caught, expected,
                "{model}: detection is not monotone in epsilon"
            );
            assert!(
        smallest.is_some_and(|s| s <= bound),
        "{model}: the arbiter caught epsilon >= {smallest:?} only; docs/parity.md records {bound:e}\n{}",
        outcome.summary()
    );
        },
    );
}
