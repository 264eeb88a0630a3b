//! Integration tests of sub-groups (`World::new_group` / `new_groups`) and `DeviceMesh`:
//! membership, rank numbering, collectives confined to their members, and errors.

use crate::common;

use anyhow::{ensure, Result};
use common::*;
use lockstep_core::comm::{DType, ProcessGroup, ReduceOp};
use lockstep_core::CommError;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

fn sum_of(t: &Tensor) -> f64 {
    values(t)[0]
}

/// Checks a group's identity and runs every collective in it, with results that depend on
/// exactly which global ranks are members (and in which order).
fn exercise_group(g: &Arc<dyn ProcessGroup>, members: &[usize], global: usize) -> Result<()> {
    let n = members.len();
    let me = members.iter().position(|&r| r == global).expect("member");
    ensure!(g.size() == n, "size {} != {n}", g.size());
    ensure!(
        g.rank() == me,
        "group rank {} != {me} for global rank {global} in {members:?}",
        g.rank()
    );
    ensure!(
        g.global_ranks() == members,
        "global_ranks {:?} != {members:?}",
        g.global_ranks()
    );
    ensure!(g.backend() == "cpu", "backend {}", g.backend());

    // all_reduce of the global rank (small and large).
    let t = Tensor::from_slice(&[global as f64 + 1.0]);
    g.all_reduce(&t, ReduceOp::Sum)?;
    let want: f64 = members.iter().map(|&r| r as f64 + 1.0).sum();
    ensure!(
        sum_of(&t) == want,
        "{}: all_reduce sum {} != {want}",
        g.name(),
        sum_of(&t)
    );
    let big = Tensor::full([LARGE as i64], global as f64, (Kind::Float, Device::Cpu));
    g.all_reduce(&big, ReduceOp::Max)?;
    let want_max = *members.iter().max().unwrap() as f64;
    ensure!(
        values(&big).iter().all(|&v| v == want_max),
        "{}: large all_reduce max",
        g.name()
    );

    // all_gather in group-rank order.
    let out = Tensor::zeros([2 * n as i64], (Kind::Int64, Device::Cpu));
    g.all_gather(
        &out,
        &Tensor::from_slice(&[global as i64, 10 * global as i64]),
    )?;
    let want: Vec<f64> = members
        .iter()
        .flat_map(|&r| [r as f64, 10.0 * r as f64])
        .collect();
    ensure!(
        values(&out) == want,
        "{}: all_gather {:?} != {want:?}",
        g.name(),
        values(&out)
    );

    // reduce_scatter: element k of every rank's input is 100 k + global rank.
    let input: Vec<f64> = (0..2 * n)
        .map(|k| 100.0 * k as f64 + global as f64)
        .collect();
    let out = Tensor::zeros([2], (Kind::Double, Device::Cpu));
    g.reduce_scatter(&out, &Tensor::from_slice(&input), ReduceOp::Sum)?;
    let rank_total: f64 = members.iter().map(|&r| r as f64).sum();
    let want: Vec<f64> = (2 * me..2 * me + 2)
        .map(|k| n as f64 * 100.0 * k as f64 + rank_total)
        .collect();
    ensure!(
        values(&out) == want,
        "{}: reduce_scatter {:?} != {want:?}",
        g.name(),
        values(&out)
    );

    // broadcast from the last group rank (a non-zero root).
    let root = n - 1;
    let t = Tensor::from_slice(&[global as i32; 3]);
    g.broadcast(&t, root)?;
    ensure!(
        values(&t) == vec![members[root] as f64; 3],
        "{}: broadcast from group rank {root}",
        g.name()
    );

    // all_to_all: group rank j receives (global, j) from everyone.
    let input: Vec<f64> = (0..n).map(|j| (global * 10 + j) as f64).collect();
    let out = Tensor::zeros([n as i64], (Kind::Double, Device::Cpu));
    g.all_to_all(&out, &Tensor::from_slice(&input), &[], &[])?;
    let want: Vec<f64> = members.iter().map(|&r| (r * 10 + me) as f64).collect();
    ensure!(
        values(&out) == want,
        "{}: all_to_all {:?} != {want:?}",
        g.name(),
        values(&out)
    );

    // send/recv around the group ring, addressed by group rank.
    if n > 1 {
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        g.send(&Tensor::from_slice(&[global as f32]), next, 5)?;
        let r = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        g.recv(&r, prev, 5)?;
        ensure!(
            sum_of(&r) == members[prev] as f64,
            "{}: recv from group rank {prev}",
            g.name()
        );
    }
    Ok(())
}

/// [0, 2] and [1, 3] in a 4-rank world: members get a group, non-members `None`; collectives
/// in both groups, interleaved with world collectives, stay inside their members.
#[test]
fn subgroups_even_and_odd_ranks() {
    run(4, |ctx| -> Result<()> {
        let world = ctx.world();
        let me = ctx.rank();
        let even = world.new_group(&[0, 2])?;
        let odd = world.new_group(&[1, 3])?;
        ensure!(
            even.is_some() == me.is_multiple_of(2),
            "rank {me}: membership of [0, 2]"
        );
        ensure!(
            odd.is_some() == (me % 2 == 1),
            "rank {me}: membership of [1, 3]"
        );
        let (g, members) = match (&even, &odd) {
            (Some(g), None) => (g, [0, 2]),
            (None, Some(g)) => (g, [1, 3]),
            _ => unreachable!(),
        };
        exercise_group(g, &members, me)?;
        // World collective between sub-group ones.
        let t = Tensor::from_slice(&[me as f32]);
        ctx.group().all_reduce(&t, ReduceOp::Sum)?;
        ensure!(sum_of(&t) == 6.0, "world all_reduce after sub-groups");
        exercise_group(g, &members, me)?;
        // Async in a sub-group overlapping a world collective.
        let sub = Tensor::from_slice(&[me as f64]);
        let w = g.all_reduce_async(&sub, ReduceOp::Sum)?;
        let t = Tensor::from_slice(&[1i64]);
        ctx.group().all_reduce(&t, ReduceOp::Sum)?;
        w.wait()?;
        ensure!(
            sum_of(&sub) == (members[0] + members[1]) as f64,
            "async sub-group all_reduce"
        );
        ensure!(
            sum_of(&t) == 4.0,
            "world all_reduce overlapping a sub-group one"
        );
        Ok(())
    });
}

/// Group rank order follows the list passed, not global rank order; a one-member group works
/// and every other rank gets `None`; new_groups hands each rank its own part.
#[test]
fn subgroup_rank_order_singletons_and_partitions() {
    run(4, |ctx| -> Result<()> {
        let world = ctx.world();
        let me = ctx.rank();
        let reversed = world.new_group(&[3, 1, 0])?;
        ensure!(
            reversed.is_some() == (me != 2),
            "rank {me}: membership of [3, 1, 0]"
        );
        if let Some(g) = &reversed {
            exercise_group(g, &[3, 1, 0], me)?;
        }
        let solo = world.new_group(&[1])?;
        ensure!(solo.is_some() == (me == 1), "rank {me}: membership of [1]");
        if let Some(g) = &solo {
            exercise_group(g, &[1], me)?;
        }
        let partition = vec![vec![2, 0], vec![3], vec![1]];
        let part = world
            .new_groups(&partition, "part")?
            .expect("every rank is in a part");
        let members = partition.iter().find(|p| p.contains(&me)).unwrap().clone();
        exercise_group(&part, &members, me)?;
        let partial = world.new_groups(&[vec![0, 1]], "partial")?;
        ensure!(
            partial.is_some() == (me < 2),
            "rank {me}: membership of partial partition"
        );
        if let Some(g) = &partial {
            exercise_group(g, &[0, 1], me)?;
        }
        Ok(())
    });
}

/// Sub-groups in 2- and 3-rank worlds.
#[test]
fn subgroups_in_small_worlds() {
    let cases: Vec<usize> = vec![2, 3];
    crate::common::each_case("subgroups_in_small_worlds", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let world = ctx.world();
            let me = ctx.rank();
            let members: Vec<usize> = if n == 2 { vec![1] } else { vec![2, 0] };
            let g = world.new_group(&members)?;
            ensure!(
                g.is_some() == members.contains(&me),
                "rank {me}: membership of {members:?}"
            );
            if let Some(g) = &g {
                exercise_group(g, &members, me)?;
            }
            let all = world
                .new_group(&(0..n).rev().collect::<Vec<_>>())?
                .expect("everyone is a member");
            exercise_group(&all, &(0..n).rev().collect::<Vec<_>>(), me)?;
            Ok(())
        });
    });
}

/// Invalid groups are rejected on every rank (and later groups still work).
#[test]
fn invalid_subgroups_error() {
    run(4, |ctx| -> Result<()> {
        let world = ctx.world();
        let me = ctx.rank();
        for (ranks, what) in [
            (vec![0, 4], "rank outside the world"),
            (vec![1, 1], "duplicate rank"),
            (vec![], "empty group"),
        ] {
            match world.new_group(&ranks) {
                Err(CommError::InvalidArgument(_)) => {}
                Ok(_) => panic!("new_group({ranks:?}) ({what}) succeeded"),
                Err(e) => {
                    panic!("new_group({ranks:?}) ({what}): expected InvalidArgument, got {e}")
                }
            }
        }
        match world.new_groups(&[vec![0, 1], vec![1, 2]], "overlap") {
            Err(CommError::InvalidArgument(_)) => {}
            other => panic!(
                "overlapping partition: expected InvalidArgument, got {:?}",
                other.map(|g| g.is_some())
            ),
        }
        let g = world.new_group(&[0, 1, 2, 3])?.expect("member");
        exercise_group(&g, &[0, 1, 2, 3], me)?;
        Ok(())
    });
}

/// A 2×2 mesh: `tp` groups are {0,1} and {2,3}, `dp` groups {0,2} and {1,3}; coordinates are
/// row-major; sums over each dimension and over both (in either order) are right.
#[test]
fn mesh_2x2_dp_tp() {
    run(4, |ctx| -> Result<()> {
        let me = ctx.rank();
        let mesh = ctx.mesh(&[("dp", 2), ("tp", 2)])?;
        ensure!(mesh.names() == ["dp", "tp"], "names {:?}", mesh.names());
        ensure!(
            mesh.size("dp")? == 2 && mesh.size("tp")? == 2,
            "dimension sizes"
        );
        ensure!(
            mesh.coordinate("dp")? == me / 2,
            "dp coordinate of rank {me}"
        );
        ensure!(
            mesh.coordinate("tp")? == me % 2,
            "tp coordinate of rank {me}"
        );
        let dp = mesh.group("dp")?;
        let tp = mesh.group("tp")?;
        let dp_members = [me % 2, me % 2 + 2];
        let tp_members = [me / 2 * 2, me / 2 * 2 + 1];
        ensure!(
            dp.rank() == mesh.coordinate("dp")?,
            "dp group rank equals dp coordinate"
        );
        ensure!(
            tp.rank() == mesh.coordinate("tp")?,
            "tp group rank equals tp coordinate"
        );
        exercise_group(&dp, &dp_members, me)?;
        exercise_group(&tp, &tp_members, me)?;

        let t = Tensor::from_slice(&[me as f32]);
        dp.all_reduce(&t, ReduceOp::Sum)?;
        ensure!(
            sum_of(&t) == [2.0, 4.0][me % 2],
            "dp sum on rank {me}: {}",
            sum_of(&t)
        );
        let t = Tensor::from_slice(&[me as f32]);
        tp.all_reduce(&t, ReduceOp::Sum)?;
        ensure!(
            sum_of(&t) == [1.0, 5.0][me / 2],
            "tp sum on rank {me}: {}",
            sum_of(&t)
        );
        for first_tp in [true, false] {
            let t = Tensor::from_slice(&[me as f32 + 1.0]);
            let (a, b) = if first_tp { (&tp, &dp) } else { (&dp, &tp) };
            a.all_reduce(&t, ReduceOp::Sum)?;
            b.all_reduce(&t, ReduceOp::Sum)?;
            ensure!(sum_of(&t) == 10.0, "2-D sum (tp first: {first_tp})");
        }
        // Async on both dimensions at once.
        let a = Tensor::from_slice(&[me as i64]);
        let b = Tensor::from_slice(&[me as i64]);
        let wa = dp.all_reduce_async(&a, ReduceOp::Max)?;
        let wb = tp.all_reduce_async(&b, ReduceOp::Min)?;
        wb.wait()?;
        wa.wait()?;
        ensure!(sum_of(&a) == (me % 2 + 2) as f64, "async dp max");
        ensure!(sum_of(&b) == (me / 2 * 2) as f64, "async tp min");
        match mesh.group("pp") {
            Err(CommError::InvalidArgument(msg)) => {
                ensure!(msg.contains("pp"), "unknown-dimension message: {msg}")
            }
            Err(e) => panic!("unknown mesh dimension: expected InvalidArgument, got {e}"),
            Ok(_) => panic!("unknown mesh dimension gave a group"),
        }
        Ok(())
    });
}

/// A 3-D mesh with a size-1 dimension and a 1-D mesh over the whole world.
#[test]
fn mesh_3d_and_1d() {
    run(4, |ctx| -> Result<()> {
        let me = ctx.rank();
        let mesh = ctx.mesh(&[("pp", 1), ("dp", 2), ("tp", 2)])?;
        let pp = mesh.group("pp")?;
        ensure!(
            pp.size() == 1 && pp.global_ranks() == [me],
            "pp group of a size-1 dimension"
        );
        exercise_group(&pp, &[me], me)?;
        exercise_group(&mesh.group("dp")?, &[me % 2, me % 2 + 2], me)?;
        exercise_group(&mesh.group("tp")?, &[me / 2 * 2, me / 2 * 2 + 1], me)?;
        let flat = ctx.mesh(&[("dp", 4)])?;
        ensure!(flat.coordinate("dp")? == me, "1-D mesh coordinate");
        exercise_group(&flat.group("dp")?, &[0, 1, 2, 3], me)?;
        Ok(())
    });
}

fn expect_mesh_error(
    ctx: &lockstep_harness::RankCtx,
    dims: &[(&str, usize)],
    needle: &str,
) -> Result<()> {
    match ctx.mesh(dims) {
        Err(CommError::InvalidArgument(msg)) => {
            ensure!(
                msg.contains(needle),
                "mesh {dims:?}: message {msg:?} should mention {needle:?}"
            );
            Ok(())
        }
        Err(e) => panic!("mesh {dims:?}: expected InvalidArgument, got {e}"),
        Ok(_) => panic!("mesh {dims:?} accepted for world size {}", ctx.world_size()),
    }
}

/// A mesh that does not fit the world errors with a message naming the world size; duplicate
/// dimension names are rejected; the world stays usable.
#[test]
fn invalid_mesh_errors() {
    let cases: Vec<usize> = vec![2, 3, 4];
    crate::common::each_case("invalid_mesh_errors", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let ws = format!("world size {n}");
            expect_mesh_error(ctx, &[("dp", 2), ("tp", 2 + usize::from(n == 4))], &ws)?;
            expect_mesh_error(ctx, &[("dp", n + 1)], &ws)?;
            expect_mesh_error(ctx, &[("dp", n), ("tp", 0)], &ws)?;
            expect_mesh_error(ctx, &[], &ws)?;
            expect_mesh_error(ctx, &[("dp", 1), ("dp", n)], "dp")?;
            let t = Tensor::from_slice(&[1u8]);
            ctx.group().all_reduce(&t, ReduceOp::Sum)?;
            assert_tensor(
                &t,
                DType::U8,
                &[1],
                &[n as f64],
                "world all_reduce after mesh errors",
            );
            let mesh = ctx.mesh(&[("dp", n)])?;
            exercise_group(&mesh.group("dp")?, &(0..n).collect::<Vec<_>>(), ctx.rank())?;
            Ok(())
        });
    });
}

/// Barriers in sub-groups and mesh groups, between collectives of the world.
#[test]
fn barriers_in_subgroups_and_mesh() {
    run(4, |ctx| -> Result<()> {
        let me = ctx.rank();
        let mine = ctx.world().new_group(&[0, 2])?;
        let theirs = ctx.world().new_group(&[1, 3])?;
        let g = mine.or(theirs).expect("member of one");
        let mesh = ctx.mesh(&[("dp", 2), ("tp", 2)])?;
        for _ in 0..3 {
            g.barrier()?;
            mesh.group("tp")?.barrier()?;
            mesh.group("dp")?.barrier_async()?.wait()?;
            ctx.group().barrier()?;
            let t = Tensor::from_slice(&[me as f32]);
            g.all_reduce(&t, ReduceOp::Sum)?;
            ensure!(
                sum_of(&t) == [2.0, 4.0][me % 2],
                "sub-group all_reduce between barriers"
            );
        }
        Ok(())
    });
}
