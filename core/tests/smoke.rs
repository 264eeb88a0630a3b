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
