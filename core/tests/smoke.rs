use lockstep_core::comm::ReduceOp;
use tch::Tensor;

#[test]
fn smoke_all_reduce() {
    lockstep_harness::run(4, |ctx| {
        let t = Tensor::from_slice(&[ctx.rank() as f32, 1.0]);
        ctx.group().all_reduce(&t, ReduceOp::Sum)?;
        assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![6.0, 4.0]);
        let big = Tensor::ones([1 << 20], (tch::Kind::Float, tch::Device::Cpu))
            * (ctx.rank() as f64 + 1.0);
        ctx.group().all_reduce(&big, ReduceOp::Sum)?;
        assert_eq!(
            big.sum(tch::Kind::Double).double_value(&[]),
            10.0 * (1 << 20) as f64
        );
        Ok::<(), lockstep_core::CommError>(())
    });
}

/// A table-driven test (`common::each_case`) runs every row even after one fails, and its
/// failure names each failed row with its parameters and its own message.
#[test]
fn each_case_runs_every_row_and_names_each_failure() {
    let visited = std::cell::Cell::new(0);
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        crate::common::each_case("table", [("a", 1), ("b", 2), ("c", 3)], |&(_, n)| {
            visited.set(visited.get() + 1);
            assert!(n == 2, "row {n} is off");
        })
    }));
    assert_eq!(visited.get(), 3, "every row runs");
    let panic = outcome.expect_err("two rows failed");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("2 of 3 cases failed"), "{message}");
    assert!(
        message.contains(r#"table::case ("a", 1): row 1 is off"#)
            && message.contains(r#"table::case ("c", 3): row 3 is off"#)
            && !message.contains(r#"("b", 2)"#),
        "{message}"
    );
}
