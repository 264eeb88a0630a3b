//! The parity-test API from a user's side: a hand-written data-parallel loop passes, the
//! same loop with a planted bug fails naming the first failing tensor, failed runs carry the
//! launcher's report, bad specifications are refused before anything runs, and the report
//! set lands under `target/lockstep/<test>/`.

use lockstep::comm::ReduceOp;
use lockstep::core::train::{train, Optimizer, StepHooks, TrainConfig, TrainError};
use lockstep::harness::parity::Tolerance;
use lockstep::harness::RankCtx;
use lockstep::models::Model;
use lockstep::parity_test::{ParityTest, ParityTestError, Reference};
use std::time::Duration;
use tch::Tensor;

/// A user's own data parallelism: gradients averaged with one all-reduce each. With
/// `freeze_last`, the optimizer is handed every parameter but the last (a parameter left out
/// of the optimizer, a classic bug): the forward, the loss and the gradients stay right, only
/// the final value of that parameter is off.
struct HandWrittenDdp<'a> {
    ctx: &'a RankCtx,
    freeze_last: bool,
}

impl StepHooks for HandWrittenDdp<'_> {
    fn sync_gradients(&mut self, grads: &[(String, Tensor)]) -> Result<(), TrainError> {
        for (_, g) in grads {
            self.ctx.group().all_reduce(g, ReduceOp::Avg)?;
        }
        Ok(())
    }

    fn optimizer_step(
        &mut self,
        optimizer: &mut dyn Optimizer,
        params: &[(String, Tensor)],
    ) -> Result<bool, TrainError> {
        if !self.freeze_last {
            return Ok(false);
        }
        optimizer.step(&params[..params.len() - 1])?;
        Ok(true)
    }
}

fn hand_written_ddp(
    ctx: &RankCtx,
    model: &dyn Model,
    cfg: &TrainConfig,
    freeze_last: bool,
) -> Result<lockstep::core::record::RunRecord, String> {
    let group = ctx.group();
    let mut hooks = HandWrittenDdp { ctx, freeze_last };
    train(model, cfg, &mut hooks, Some(group.as_ref())).map_err(|e| e.to_string())
}

#[test]
fn a_user_config_is_judged_and_a_planted_bug_is_named() {
    let cases: Vec<(&str, bool)> = vec![
        ("correct", false),
        ("parameter_left_out_of_the_optimizer", true),
    ];
    crate::common::each_case(
        "a_user_config_is_judged_and_a_planted_bug_is_named",
        cases,
        |&(_, freeze_last): &(&str, bool)| {
            let name = format!("user_config_frozen_{freeze_last}");
            let outcome = ParityTest::new(&name)
                .zoo("mlp")
                .custom_config("my_ddp", move |ctx, model, cfg| {
                    hand_written_ddp(ctx, model, cfg, freeze_last)
                })
                .reference(Reference::Single)
                .reference(Reference::Ddp)
                .world_sizes(&[2])
                // One step: the bug shows only in the final parameters.
                .steps(1)
                .run()
                .expect("the parity test runs");
            let json = &outcome.files.json;
            assert!(
                json.ends_with(format!("lockstep/{name}/report.json")) && json.exists(),
                "{}",
                json.display()
            );
            for file in [
                &outcome.files.markdown,
                &outcome.files.junit,
                &outcome.files.html,
            ] {
                assert!(file.exists(), "{}", file.display());
            }
            assert_eq!(outcome.report.comparisons.len(), 2);
            if !freeze_last {
                outcome.assert_passed();
                // The same average in the same order as Lockstep's DDP: bitwise.
                let vs_ddp = &outcome.report.comparisons[1];
                assert_eq!(vs_ddp.reference, "ddp@2");
                assert_eq!(vs_ddp.overall().max_abs_err, 0.0);
                return;
            }
            assert!(!outcome.passed());
            let summary = outcome.summary();
            let frozen = lockstep::models::zoo::build("mlp", 0, 0)
                .expect("zoo mlp")
                .named_parameters()
                .pop()
                .expect("a parameter")
                .0;
            assert!(
                summary.contains(&format!(
                    "first failure: final value of `{frozen}`, element ["
                )) && summary.contains("FAILED my_ddp@2 against single@2")
                    && summary.contains("FAILED my_ddp@2 against ddp@2"),
                "{summary}"
            );
            let result = std::panic::catch_unwind(|| outcome.assert_passed());
            assert!(result.is_err(), "assert_passed must fail the test");
        },
    );
}

#[test]
fn a_failed_user_run_carries_the_launchers_report_error() {
    a_failed_user_run_carries_the_launchers_report(false);
}

/// [`a_failed_user_run_carries_the_launchers_report_error`] with a rank that hangs instead.
#[test]
fn a_failed_user_run_carries_the_launchers_report_hang() {
    a_failed_user_run_carries_the_launchers_report(true);
}

fn a_failed_user_run_carries_the_launchers_report(hang: bool) {
    let name = format!("user_config_fails_hang_{hang}");
    let outcome = ParityTest::new(&name)
        .zoo("mlp")
        .custom_config("broken", move |ctx, _model, _cfg| {
            if ctx.rank() == 1 {
                if hang {
                    std::thread::sleep(Duration::from_secs(600));
                }
                return Err("my loop gave up on rank 1".into());
            }
            // Rank 0 waits for rank 1 in a collective it never joins.
            let t = Tensor::from_slice(&[1.0f32]);
            ctx.group()
                .all_reduce(&t, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            Err("unreachable".into())
        })
        .timeout(Duration::from_secs(4))
        .run()
        .expect("the parity test runs");
    assert!(!outcome.passed());
    assert_eq!(outcome.report.errors.len(), 1);
    let summary = outcome.summary();
    assert!(
        summary.contains("ERROR broken@2 against single@2"),
        "{summary}"
    );
    if hang {
        assert!(summary.contains("timed out"), "{summary}");
    } else {
        assert!(summary.contains("my loop gave up on rank 1"), "{summary}");
    }
    assert!(outcome.files.json.exists());
}

#[test]
fn bad_specifications_are_refused_before_anything_runs() {
    let err = |t: ParityTest<'_>| t.run().expect_err("refused").to_string();
    let unknown = err(ParityTest::new("bad").zoo("mlp").config("fsdp.fulll_shard"));
    assert!(
        unknown
            .contains("unknown configuration `fsdp.fulll_shard` (did you mean `fsdp.full_shard`?)"),
        "{unknown}"
    );
    // `.unwrap()` on the error shows the whole message, not a bare variant name.
    let debug = format!(
        "{:?}",
        ParityTest::new("bad")
            .zoo("mlp")
            .config("dpp")
            .run()
            .expect_err("refused")
    );
    assert!(debug.contains("did you mean `ddp`?"), "{debug}");
    assert!(matches!(
        ParityTest::new("bad").config("ddp").run(),
        Err(ParityTestError::NoModel)
    ));
    assert!(matches!(
        ParityTest::new("bad").zoo("mlp").run(),
        Err(ParityTestError::NoConfig)
    ));
    let no_reason = err(ParityTest::new("bad")
        .zoo("mlp")
        .config("ddp")
        .tolerance_override("ddp", Tolerance::new(1e-4, 1e-4), " "));
    assert!(no_reason.contains("has no reason"), "{no_reason}");
    let stray = err(ParityTest::new("bad")
        .zoo("mlp")
        .config("ddp")
        .tolerance_override("fsdp.full_shard", Tolerance::new(1e-4, 1e-4), "why"));
    assert!(
        stray.contains("not a configuration of this test"),
        "{stray}"
    );
    let hybrid = err(ParityTest::new("bad")
        .zoo("mlp")
        .config("fsdp.hybrid_shard")
        .world_sizes(&[3]));
    assert!(
        hybrid.contains("fsdp.hybrid_shard cannot run at world size 3"),
        "{hybrid}"
    );
    let single = err(ParityTest::new("bad").zoo("moe").config("ddp"));
    assert!(
        single.contains("has no single-device reference") && single.contains("Reference::Ddp"),
        "{single}"
    );
    let mixed = err(ParityTest::new("bad").zoo("mlp").config("ddp.bf16"));
    assert!(mixed.contains("not compared with single"), "{mixed}");
    let zero = err(ParityTest::new("bad").zoo("mlp").config("ddp").steps(0));
    assert!(zero.contains("steps"), "{zero}");
    // A pair the catalog refuses is refused before spawn, with the message `lockstep run`
    // and the matrix use (the matrix skips the row with the same reason).
    let pipeline = err(ParityTest::new("bad")
        .zoo("mlp")
        .config("pp.interleaved_1f1b")
        .world_sizes(&[4]));
    let refusal = lockstep::configs::Config::by_name("pp.interleaved_1f1b")
        .expect("a built-in")
        .refusal(
            "mlp",
            lockstep::models::zoo::build("mlp", 0, 0)
                .expect("mlp")
                .as_ref(),
            4,
        )
        .expect("refused");
    assert!(pipeline.contains(&refusal), "{pipeline}\nvs\n{refusal}");
}

/// `assert_parity` panics at the caller's line (the user's test), not inside Lockstep.
#[test]
fn assert_parity_panics_at_the_callers_line() {
    use std::sync::{Arc, Mutex};
    let seen: Arc<Mutex<Option<(String, u32)>>> = Arc::default();
    let hook_seen = Arc::clone(&seen);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if let Some(loc) = info.location() {
            *hook_seen.lock().unwrap_or_else(|p| p.into_inner()) =
                Some((loc.file().to_owned(), loc.line()));
        }
    }));
    let first = line!();
    let result = std::panic::catch_unwind(|| {
        ParityTest::new("bad")
            .zoo("mlp")
            .config("dpp")
            .assert_parity();
    });
    let last = line!();
    std::panic::set_hook(previous);
    assert!(
        result.is_err(),
        "an unknown configuration must fail the test"
    );
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let (file, at) = seen.expect("the panic had a location");
    assert!(file.ends_with("parity_api.rs"), "{file}:{at}");
    // The `.assert_parity()` call's line, within the test: not a line of Lockstep's.
    assert!(
        first < at && at < last,
        "{file}:{at} not in {first}..{last}"
    );
}

/// Two parity tests in one test function, under any runner: under plain `cargo test` each
/// exec'd rank re-runs the test, passes through the first parity test and finds its launch
/// in the second.
#[test]
fn two_parity_tests_in_one_test_function() {
    ParityTest::new("two_parity_tests_in_one_test_function_a")
        .zoo("mlp")
        .config("ddp")
        .steps(1)
        .assert_parity();
    ParityTest::new("two_parity_tests_in_one_test_function_b")
        .zoo("mlp")
        .config("fsdp.full_shard")
        .steps(1)
        .assert_parity();
}

/// A model that builds different shapes on different ranks fails before training, on every
/// configuration, naming the first parameter that differs with both ranks' shapes (not as a
/// mismatched collective numbered by call).
#[test]
fn ranks_that_build_different_models_fail_before_training_naming_the_parameter() {
    use lockstep::models::zoo::{Gpt, GptConfig};
    let outcome = ParityTest::new("different_models_per_rank")
        .model("gpt_per_rank", |seed, rank| {
            let ff_hidden = if rank == 1 { 24 } else { 64 };
            let config = GptConfig {
                ff_hidden,
                ..GptConfig::ZOO
            };
            Gpt::with_config(config, seed, rank, false, 0.0)
        })
        .config("ddp")
        .config("fsdp.full_shard")
        .reference(Reference::Ddp)
        .world_sizes(&[2])
        .steps(1)
        .run()
        .expect("the parity test runs");
    assert!(!outcome.passed());
    assert!(!outcome.report.errors.is_empty());
    for e in &outcome.report.errors {
        assert!(
            e.message
                .contains("rank 1 built a different model than rank 0")
                && e.message.contains(
                    "parameter `layers.0.feed_forward.w1.weight` is f32[24, 16] on rank 1 but \
                     f32[64, 16] on rank 0"
                ),
            "{}",
            e.message
        );
    }
}
