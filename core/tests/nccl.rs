//! NCCL backend tests. They need one GPU per rank and a build with `--features nccl`;
//! elsewhere they print `SKIP: ...` and pass. [`gpus_to_myself`] (and the nextest `gpu` group) keep
//! two GPU tests from sharing devices.

use lockstep_core::comm::ReduceOp;
use lockstep_harness::{Outcome, Run};
use tch::{Kind, Tensor};

fn on_gpus(
    world: usize,
    body: impl Fn(&lockstep_harness::RankCtx) -> Result<(), lockstep_core::CommError>,
) -> Outcome {
    Run::new(world).backend("nccl").run(body)
}

/// Holds every GPU for this test: tests in other processes wait too (under plain `cargo test`
/// as under nextest).
fn gpus_to_myself() -> crate::common::FileLock {
    let path = std::env::temp_dir().join("lockstep-gpu-tests.lock");
    crate::common::FileLock::take(&path).unwrap_or_else(|e| panic!("lock {}: {e}", path.display()))
}

#[test]
fn nccl_all_reduce_sums_on_every_gpu() {
    let _gpus = gpus_to_myself();
    let outcome = on_gpus(2, |ctx| {
        let t = Tensor::from_slice(&[ctx.rank() as f32 + 1.0, 2.0]).to_device(ctx.device());
        ctx.group().all_reduce(&t, ReduceOp::Sum)?;
        assert_eq!(
            Vec::<f32>::try_from(&t.to_device(tch::Device::Cpu)).unwrap_or_default(),
            vec![3.0, 4.0]
        );
        Ok(())
    });
    if let Outcome::Skipped(reason) = outcome {
        assert!(
            reason.contains("GPU") || reason.contains("nccl"),
            "{reason}"
        );
    }
}

#[test]
fn nccl_gather_scatter_and_uneven_all_to_all() {
    let _gpus = gpus_to_myself();
    let outcome = on_gpus(2, |ctx| {
        let (rank, dev) = (ctx.rank() as f64, ctx.device());
        let g = ctx.group();
        let input = Tensor::full([2], rank, (Kind::Float, dev));
        let gathered = Tensor::zeros([4], (Kind::Float, dev));
        g.all_gather(&gathered, &input)?;
        let expect = Tensor::from_slice(&[0f32, 0.0, 1.0, 1.0]).to_device(dev);
        assert!(gathered.equal(&expect));
        let shard = Tensor::zeros([2], (Kind::Float, dev));
        g.reduce_scatter(
            &shard,
            &Tensor::ones([4], (Kind::Float, dev)),
            ReduceOp::Sum,
        )?;
        assert!(shard.equal(&Tensor::full([2], 2.0, (Kind::Float, dev))));
        // Rank 0 sends 1 row to rank 1; rank 1 sends 2 rows to rank 0.
        let (send, recv) = if ctx.rank() == 0 {
            (vec![1, 1], vec![1, 2])
        } else {
            (vec![2, 2], vec![1, 2])
        };
        let rows: usize = send.iter().sum();
        let out_rows: usize = recv.iter().sum();
        let input = Tensor::full([rows as i64], rank, (Kind::Float, dev));
        let output = Tensor::zeros([out_rows as i64], (Kind::Float, dev));
        g.all_to_all(&output, &input, &recv, &send)?;
        let expect = Tensor::from_slice(&[0f32, 1.0, 1.0]).to_device(dev);
        assert!(output.equal(&expect), "rank {} got {output:?}", ctx.rank());
        Ok(())
    });
    if let Outcome::Skipped(reason) = outcome {
        assert!(
            reason.contains("GPU") || reason.contains("nccl"),
            "{reason}"
        );
    }
}
