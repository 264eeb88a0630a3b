//! `FaultyGroup`: each fault kind does what it says on a 2-rank group, only on the rank it
//! targets, and never hangs a run (every rank still takes part in every collective).

use crate::common;

use anyhow::{ensure, Context, Result};
use common::run;
use lockstep_core::comm::{
    FaultInjector, FaultKind, FaultMode, FaultSite, Injection, OpKind, ReduceOp,
};
use lockstep_core::consistency::StepClock;
use lockstep_harness::RankCtx;
use std::sync::Arc;
use tch::{Kind, Tensor};

/// An injector for `rank` aiming `kind` at call `index` of step 0 on `target`.
fn inject(rank: usize, target: usize, index: usize, kind: FaultKind) -> Arc<FaultInjector> {
    let site = FaultSite {
        step: 0,
        index,
        rank: target,
    };
    FaultInjector::new(rank, FaultMode::Inject { site, kind }, StepClock::new())
}

fn values(t: &Tensor) -> Vec<f64> {
    let flat = t.to_kind(Kind::Double).reshape([-1]);
    (0..flat.numel() as i64)
        .map(|i| flat.double_value(&[i]))
        .collect()
}

fn f32s(v: &[f32]) -> Tensor {
    Tensor::from_slice(v)
}

/// What the injector said became of its fault.
fn outcome(inj: &FaultInjector) -> &'static str {
    match inj.log().injection {
        Some(Injection::Applied { .. }) => "applied",
        Some(Injection::NoChange { .. }) => "no change",
        Some(Injection::NotApplicable { .. }) => "n/a",
        None => "none",
    }
}

/// Proves the two ranks are still in step: a clean all-reduce on the unwrapped group.
fn in_step(ctx: &RankCtx) -> Result<()> {
    let t = f32s(&[1.0]);
    ctx.group().all_reduce(&t, ReduceOp::Sum)?;
    ensure!(values(&t) == [2.0], "ranks out of step after a fault");
    Ok(())
}

/// One all-reduce of `[r+1, 2(r+1), 3(r+1)]` (sum `[3, 6, 9]`) through an injector aiming
/// `kind` at rank 1's first call; returns this rank's result and the injector.
fn all_reduce_with(ctx: &RankCtx, kind: FaultKind) -> Result<(Vec<f64>, Arc<FaultInjector>)> {
    let r = ctx.rank();
    let inj = inject(r, 1, 0, kind);
    let group = inj.wrap(ctx.group());
    let x = (r + 1) as f32;
    let t = f32s(&[x, 2.0 * x, 3.0 * x]);
    group.all_reduce(&t, ReduceOp::Sum)?;
    in_step(ctx)?;
    Ok((values(&t), inj))
}

#[test]
fn all_reduce_faults_alter_only_the_target_rank() {
    run(2, |ctx| -> Result<()> {
        let r = ctx.rank();
        let cases: [(FaultKind, [f64; 3], &str); 7] = [
            (FaultKind::Skip, [2.0, 4.0, 6.0], "applied"),
            (FaultKind::Double, [6.0, 12.0, 18.0], "applied"),
            (FaultKind::Zero, [0.0, 0.0, 0.0], "applied"),
            (FaultKind::Perturb(0.5), [3.0, 6.0, 13.5], "applied"),
            (FaultKind::WrongPeer, [3.0, 6.0, 9.0], "n/a"),
            (FaultKind::PermutedChunks, [3.0, 6.0, 9.0], "n/a"),
            // The first call of a run has nothing earlier to be stale with.
            (FaultKind::Stale, [3.0, 6.0, 9.0], "n/a"),
        ];
        for (kind, faulted, fate) in cases {
            let (got, inj) = all_reduce_with(ctx, kind)?;
            let want = if r == 1 { faulted } else { [3.0, 6.0, 9.0] };
            ensure!(got == want, "{kind} on rank {r}: {got:?}, want {want:?}");
            let want_fate = if r == 1 { fate } else { "none" };
            ensure!(
                outcome(&inj) == want_fate,
                "{kind} on rank {r}: {}",
                outcome(&inj)
            );
        }
        // bf16: the sum 3.3 is not a bf16 number; rank 1 gets it rounded.
        let inj = inject(r, 1, 0, FaultKind::Bf16Reduction);
        let t = f32s(&[1.1 + r as f32 * 1.1]);
        inj.wrap(ctx.group()).all_reduce(&t, ReduceOp::Sum)?;
        let exact = f32s(&[1.1]) + f32s(&[2.2]);
        let rounded = exact.to_kind(Kind::BFloat16).to_kind(Kind::Float);
        let want = if r == 1 {
            values(&rounded)
        } else {
            values(&exact)
        };
        ensure!(values(&t) == want, "bf16 on rank {r}: {:?}", values(&t));
        ensure!(
            values(&rounded) != values(&exact),
            "3.3 must not be a bf16 number"
        );
        Ok(())
    });
}

#[test]
fn stale_returns_the_previous_same_shape_result_and_async_calls_are_faulted_on_wait() {
    run(2, |ctx| -> Result<()> {
        let r = ctx.rank();
        let inj = inject(r, 0, 2, FaultKind::Stale);
        let group = inj.wrap(ctx.group());
        let first = f32s(&[r as f32 + 1.0, 1.0]);
        group.all_reduce(&first, ReduceOp::Sum)?; // [3, 2]
        let other_shape = f32s(&[5.0]);
        group.all_reduce(&other_shape, ReduceOp::Sum)?; // [10], another shape
        let second = f32s(&[10.0 * (r as f32 + 1.0), 0.0]);
        group.all_reduce_async(&second, ReduceOp::Sum)?.wait()?; // [30, 0]
        let want = if r == 0 { [3.0, 2.0] } else { [30.0, 0.0] };
        ensure!(
            values(&second) == want,
            "stale on rank {r}: {:?}",
            values(&second)
        );
        ensure!(
            values(&other_shape) == [10.0],
            "a call before the site was altered"
        );
        let inj = inject(r, 1, 0, FaultKind::Double);
        let t = f32s(&[1.0]);
        let work = inj.wrap(ctx.group()).all_reduce_async(&t, ReduceOp::Sum)?;
        work.wait()?;
        let want = if r == 1 { 4.0 } else { 2.0 };
        ensure!(
            values(&t) == [want],
            "async double on rank {r}: {:?}",
            values(&t)
        );
        in_step(ctx)
    });
}

#[test]
fn chunked_collectives_rotate_swap_and_skip() {
    run(2, |ctx| -> Result<()> {
        let r = ctx.rank() as f32;
        let gather = |kind| -> Result<Vec<f64>> {
            let inj = inject(ctx.rank(), 1, 0, kind);
            let out = Tensor::full([4], -1.0, (Kind::Float, tch::Device::Cpu));
            let input = f32s(&[10.0 * r + 1.0, 10.0 * r + 2.0]);
            inj.wrap(ctx.group()).all_gather(&out, &input)?;
            in_step(ctx)?;
            Ok(values(&out))
        };
        let clean = [1.0, 2.0, 11.0, 12.0];
        let rank1 = |faulted: [f64; 4]| if ctx.rank() == 1 { faulted } else { clean };
        ensure!(gather(FaultKind::WrongPeer)? == rank1([11.0, 12.0, 1.0, 2.0]));
        ensure!(gather(FaultKind::PermutedChunks)? == rank1([11.0, 12.0, 1.0, 2.0]));
        ensure!(
            gather(FaultKind::Skip)? == rank1([-1.0; 4]),
            "skip leaves the output"
        );

        // All-to-all: rank r sends [10r, 10r + 1]; rank 1's chunks come back rotated.
        let inj = inject(ctx.rank(), 1, 0, FaultKind::WrongPeer);
        let out = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
        let input = f32s(&[10.0 * r, 10.0 * r + 1.0]);
        inj.wrap(ctx.group()).all_to_all(&out, &input, &[], &[])?;
        let want = if ctx.rank() == 1 {
            [11.0, 1.0]
        } else {
            [0.0, 10.0]
        };
        ensure!(values(&out) == want, "all_to_all: {:?}", values(&out));

        // Reduce-scatter: rank 1 contributes its two chunks swapped, so both results change.
        let inj = inject(ctx.rank(), 1, 0, FaultKind::PermutedChunks);
        let out = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
        // Rank 0 contributes [1, 2 | 3, 4], rank 1 [20, 40 | 60, 80] (swapped: [60, 80 | 20, 40]).
        let scale = if ctx.rank() == 0 { 1.0 } else { 20.0 };
        let input = f32s(&[scale, 2.0 * scale, 3.0 * scale, 4.0 * scale]);
        inj.wrap(ctx.group())
            .reduce_scatter(&out, &input, ReduceOp::Sum)?;
        let want = if ctx.rank() == 0 {
            [1.0 + 60.0, 2.0 + 80.0]
        } else {
            [3.0 + 20.0, 4.0 + 40.0]
        };
        ensure!(values(&out) == want, "reduce_scatter: {:?}", values(&out));
        in_step(ctx)
    });
}

#[test]
fn broadcast_and_point_to_point_faults() {
    run(2, |ctx| -> Result<()> {
        let r = ctx.rank();
        // Broadcast from 0: rank 1 is root + 1, so a wrong peer leaves it its own tensor; on
        // the root it cannot apply, and skipping on the root changes nothing.
        for (target, kind, want_fate) in [
            (1, FaultKind::WrongPeer, "applied"),
            (0, FaultKind::WrongPeer, "n/a"),
            (0, FaultKind::Skip, "no change"),
        ] {
            let inj = inject(r, target, 0, kind);
            let t = f32s(&[r as f32 + 7.0]);
            inj.wrap(ctx.group()).broadcast(&t, 0)?;
            let want = if r == 1 && want_fate == "applied" {
                8.0
            } else {
                7.0
            };
            ensure!(values(&t) == [want], "broadcast {kind}: {:?}", values(&t));
            if r == target {
                ensure!(outcome(&inj) == want_fate, "{kind}: {}", outcome(&inj));
            }
        }
        // Point to point: rank 0 sends [1, 2] then [3, 4].
        let exchange = |target: usize, kind: FaultKind| -> Result<Vec<f64>> {
            let inj = inject(r, target, 1, kind);
            let g = inj.wrap(ctx.group());
            let got = Tensor::full([2], -1.0, (Kind::Float, tch::Device::Cpu));
            for (i, msg) in [[1.0f32, 2.0], [3.0, 4.0]].iter().enumerate() {
                if r == 0 {
                    g.send(&f32s(msg), 1, i as u64)?;
                } else {
                    g.recv(&got, 0, i as u64)?;
                }
            }
            in_step(ctx)?;
            Ok(values(&got))
        };
        let on_1 = |v: Vec<f64>| if r == 1 { v } else { vec![-1.0, -1.0] };
        ensure!(
            exchange(0, FaultKind::Double)? == on_1(vec![6.0, 8.0]),
            "send double"
        );
        ensure!(
            exchange(0, FaultKind::Stale)? == on_1(vec![1.0, 2.0]),
            "send stale"
        );
        ensure!(
            exchange(1, FaultKind::Stale)? == on_1(vec![1.0, 2.0]),
            "recv stale"
        );
        ensure!(
            exchange(1, FaultKind::Zero)? == on_1(vec![0.0, 0.0]),
            "recv zero"
        );
        // A skipped receive keeps what the tensor held: here the first message.
        ensure!(
            exchange(1, FaultKind::Skip)? == on_1(vec![1.0, 2.0]),
            "recv skip"
        );
        Ok(())
    });
}

#[test]
fn record_mode_numbers_calls_per_step_across_every_group_of_the_world() {
    run(2, |ctx| -> Result<()> {
        let clock = StepClock::new();
        let inj = FaultInjector::new(ctx.rank(), FaultMode::Record, clock.clone());
        ctx.world().set_group_wrapper(inj.wrapper());
        let world = ctx.group();
        let sub = ctx
            .world()
            .new_group(&[0, 1])?
            .context("both ranks are members")?;
        let t = f32s(&[1.0, 2.0]);
        world.all_reduce(&t, ReduceOp::Sum)?; // step 0, call 0
        world.barrier()?; // not counted
        sub.broadcast(&t, 0)?; // step 0, call 1
        clock.start(1);
        sub.all_reduce(&f32s(&[1.0]), ReduceOp::Max)?; // step 1, call 0
        ctx.world().clear_group_wrapper();
        ctx.group().all_reduce(&t, ReduceOp::Sum)?; // not wrapped any more
        let log = inj.log();
        let seen: Vec<(usize, usize, OpKind, &str)> = log
            .calls
            .iter()
            .map(|c| (c.step, c.index, c.op, c.group.as_str()))
            .collect();
        ensure!(
            seen == [
                (0, 0, OpKind::AllReduce, "world"),
                (0, 1, OpKind::Broadcast, "group[0,1]"),
                (1, 0, OpKind::AllReduce, "group[0,1]"),
            ],
            "{seen:?}"
        );
        ensure!(log.injection.is_none() && log.calls[0].shape == [2]);
        ensure!(values(&t) == [4.0, 8.0], "record mode altered a result");
        Ok(())
    });
}

#[test]
fn fault_kinds_parse_and_print() {
    for kind in FaultKind::all(1e-3) {
        let text = kind.to_string();
        assert_eq!(text.parse::<FaultKind>(), Ok(kind), "{text}");
    }
    assert!("perturb=0".parse::<FaultKind>().is_err());
    assert!("flip".parse::<FaultKind>().is_err());
}
