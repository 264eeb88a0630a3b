//! The `tiny_decoder` example's checks: a decoder written outside the zoo, against the public
//! API only, parallelized by its own plan under TP, TP+SP, FSDP×TP, PP×TP and EP, each
//! against one process.

#[path = "../examples/tiny_decoder.rs"]
mod tiny_decoder;

#[test]
fn user_decoder_under_tp_sp_fsdp_and_pp_matches_single_device() {
    let outcome =
        tiny_decoder::check_tensor_parallel("user_decoder_tp").expect("the parity test runs");
    print!("{}", outcome.summary());
    outcome.assert_passed();
    // 4 configurations against single at world 4 (FSDP×TP against tp.2 as well).
    assert!(outcome.report.comparisons.len() >= 4);
}

#[test]
fn user_moe_decoder_under_ep_matches_single_device() {
    let outcome =
        tiny_decoder::check_expert_parallel("user_decoder_ep").expect("the parity test runs");
    print!("{}", outcome.summary());
    outcome.assert_passed();
    assert!(outcome.report.comparisons.len() >= 2);
}
