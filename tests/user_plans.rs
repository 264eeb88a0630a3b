//! The `tiny_decoder` example's checks: a decoder written outside the zoo, against the public
//! API only, parallelized by its own plan under TP, TP+SP, FSDP×TP, PP×TP, EP and CP, each
//! against one process.

#[path = "../examples/tiny_decoder.rs"]
mod tiny_decoder;

#[test]
fn user_decoder_under_tp_sp_fsdp_and_pp_matches_single_device() {
    let outcome =
        tiny_decoder::check_tensor_parallel("user_decoder_tp").expect("the parity test runs");
    print!("{}", outcome.summary());
    outcome.assert_passed();
    // 5 configurations (one with the user's own plan) against single at world 4.
    assert_eq!(outcome.report.comparisons.len(), 5);
    assert!(outcome
        .report
        .comparisons
        .iter()
        .all(|c| c.passed && c.reference.starts_with("single")));
}

#[test]
fn user_moe_decoder_under_ep_matches_single_device() {
    let outcome =
        tiny_decoder::check_expert_parallel("user_decoder_ep").expect("the parity test runs");
    print!("{}", outcome.summary());
    outcome.assert_passed();
    assert_eq!(outcome.report.comparisons.len(), 2);
}

#[test]
fn user_decoders_under_context_parallelism_match_single_device() {
    for (test, moe) in [("user_decoder_cp", false), ("user_moe_decoder_cp", true)] {
        let outcome =
            tiny_decoder::check_context_parallel(test, moe).expect("the parity test runs");
        print!("{}", outcome.summary());
        outcome.assert_passed();
        // 4 configurations at world 4, each against single.
        assert_eq!(outcome.report.comparisons.len(), 4);
        assert!(outcome
            .report
            .comparisons
            .iter()
            .all(|c| c.passed && c.reference.starts_with("single")));
    }
}
