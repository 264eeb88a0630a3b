//! Integration tests of every `ProcessGroup` collective on the CPU backend, run on 1–4 ranks
//! against hand-computed results: every dtype and reduction, odd and empty sizes, both sides
//! of the 64 KiB small-message threshold, uneven all-to-all, non-contiguous tensors,
//! point-to-point ordering, overlapping async operations, and bitwise determinism under
//! injected delays.

use crate::common;

use anyhow::{ensure, Result};
use common::*;
use lockstep_core::comm::cpu::chaos;
use lockstep_core::comm::{DType, ProcessGroup, ReduceOp, Work};
use lockstep_core::CommError;
use rand::{Rng, SeedableRng};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Element counts exercised for every dtype: one, odd. (Empty tensors: `empty_tensors`.)
const SMALL_SIZES: [usize; 2] = [1, 7];

fn all_reduce_case(
    g: &dyn ProcessGroup,
    r: &mut Reference,
    op: ReduceOp,
    shape: &[i64],
) -> Result<()> {
    let (n, me, dtype) = (g.size(), g.rank(), r.dtype);
    let numel = shape.iter().product::<i64>() as usize;
    let what = format!("all_reduce {op} {dtype} {shape:?} on {n} ranks");
    let t = tensor(r.input(me, numel), shape, dtype);
    if !avg_valid(dtype) && op == ReduceOp::Avg {
        match g.all_reduce(&t, op) {
            Err(CommError::InvalidArgument(_)) => {}
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
        assert_tensor(
            &t,
            dtype,
            shape,
            r.input(me, numel),
            &format!("{what}: a rejected call modified the tensor"),
        );
        return Ok(());
    }
    g.all_reduce(&t, op)?;
    assert_tensor(&t, dtype, shape, &r.expected(op)[..numel], &what);
    Ok(())
}

/// Every dtype × every op (Avg on integers and bool must be rejected) × 1/7 elements and a
/// 2-D shape.
#[test]
fn all_reduce_every_dtype_and_op() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_reduce_every_dtype_and_op", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            for dtype in ALL_DTYPES {
                let mut r = Reference::new(dtype, n, 15);
                for op in ALL_OPS {
                    for numel in SMALL_SIZES {
                        all_reduce_case(g.as_ref(), &mut r, op, &[numel as i64])?;
                    }
                    all_reduce_case(g.as_ref(), &mut r, op, &[3, 5])?;
                }
            }
            Ok(())
        });
    });
}

/// Both sides of the 64 KiB threshold (exactly 64 KiB takes the direct path, one more
/// element the pairwise reduce-scatter + ring all-gather) and of the 256 KiB shared-memory
/// threshold, and large odd sizes that split unevenly over 2, 3 and 4 ranks, for every dtype
/// and op, on the default group and on a TCP-only group.
#[test]
fn all_reduce_large_and_threshold() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_reduce_large_and_threshold", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let tcp = tcp_world(ctx)?;
            let mut f32_ref = Reference::new(DType::F32, n, LARGE);
            for group in [&g, &tcp] {
                for numel in [
                    AT_THRESHOLD - 1,
                    AT_THRESHOLD,
                    AT_THRESHOLD + 1,
                    MID,
                    SHM_AT - 1,
                    SHM_AT,
                    LARGE,
                ] {
                    all_reduce_case(group.as_ref(), &mut f32_ref, ReduceOp::Sum, &[numel as i64])?;
                }
            }
            for dtype in ALL_DTYPES {
                let (mid, big) = (numel_for(dtype, 160_000), numel_for(dtype, 400_000));
                let mut r = Reference::new(dtype, n, big);
                for op in ALL_OPS {
                    all_reduce_case(g.as_ref(), &mut r, op, &[mid as i64])?;
                    all_reduce_case(g.as_ref(), &mut r, op, &[big as i64])?;
                    all_reduce_case(tcp.as_ref(), &mut r, op, &[big as i64])?;
                }
            }
            // 2-D, large: rows of 7.
            let mut r = Reference::new(DType::F64, n, 14_287 * 7);
            all_reduce_case(g.as_ref(), &mut r, ReduceOp::Sum, &[14_287, 7])?;
            all_reduce_case(tcp.as_ref(), &mut r, ReduceOp::Max, &[14_287, 7])?;
            Ok(())
        });
    });
}

fn all_gather_case(g: &dyn ProcessGroup, r: &Reference, shape: &[i64]) -> Result<()> {
    let (n, me, dtype) = (g.size(), g.rank(), r.dtype);
    let numel = shape.iter().product::<i64>() as usize;
    let input = tensor(r.input(me, numel), shape, dtype);
    let mut out_shape = shape.to_vec();
    out_shape[0] *= n as i64;
    let out = garbage(&out_shape, dtype);
    g.all_gather(&out, &input)?;
    let expected: Vec<f64> = (0..n)
        .flat_map(|q| r.input(q, numel).iter().copied())
        .collect();
    assert_tensor(
        &out,
        dtype,
        &out_shape,
        &expected,
        &format!("all_gather {dtype} {shape:?} on {n} ranks"),
    );
    assert_tensor(
        &input,
        dtype,
        shape,
        r.input(me, numel),
        "all_gather input must be untouched",
    );
    Ok(())
}

#[test]
fn all_gather_every_dtype_and_size() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_gather_every_dtype_and_size", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let tcp = tcp_world(ctx)?;
            for dtype in ALL_DTYPES {
                let (mid, big) = (numel_for(dtype, 160_000), numel_for(dtype, 400_000));
                let r = Reference::new(dtype, n, big);
                for numel in SMALL_SIZES {
                    all_gather_case(g.as_ref(), &r, &[numel as i64])?;
                }
                all_gather_case(g.as_ref(), &r, &[3, 5])?;
                all_gather_case(g.as_ref(), &r, &[mid as i64])?;
                all_gather_case(g.as_ref(), &r, &[big as i64])?;
                all_gather_case(tcp.as_ref(), &r, &[big as i64])?;
            }
            // The output crosses the thresholds at sizes that depend on the group size.
            let r = Reference::new(DType::F32, n, LARGE);
            for per_rank in [
                AT_THRESHOLD / n,
                AT_THRESHOLD / n + 1,
                SHM_AT / n - 1,
                SHM_AT / n,
                LARGE,
            ] {
                all_gather_case(g.as_ref(), &r, &[per_rank as i64])?;
            }
            Ok(())
        });
    });
}

fn reduce_scatter_case(
    g: &dyn ProcessGroup,
    r: &mut Reference,
    op: ReduceOp,
    out_shape: &[i64],
) -> Result<()> {
    let (n, me, dtype) = (g.size(), g.rank(), r.dtype);
    let m = out_shape.iter().product::<i64>() as usize;
    let mut in_shape = out_shape.to_vec();
    in_shape[0] *= n as i64;
    let what = format!("reduce_scatter {op} {dtype} out {out_shape:?} on {n} ranks");
    let input = tensor(r.input(me, n * m), &in_shape, dtype);
    let out = garbage(out_shape, dtype);
    if !avg_valid(dtype) && op == ReduceOp::Avg {
        match g.reduce_scatter(&out, &input, op) {
            Err(CommError::InvalidArgument(_)) => {}
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
        return Ok(());
    }
    g.reduce_scatter(&out, &input, op)?;
    assert_tensor(
        &out,
        dtype,
        out_shape,
        &r.expected(op)[me * m..(me + 1) * m],
        &what,
    );
    assert_tensor(
        &input,
        dtype,
        &in_shape,
        r.input(me, n * m),
        "reduce_scatter input must be untouched",
    );
    Ok(())
}

#[test]
fn reduce_scatter_every_dtype_and_op() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("reduce_scatter_every_dtype_and_op", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let tcp = tcp_world(ctx)?;
            for dtype in ALL_DTYPES {
                let big = numel_for(dtype, 100_000);
                let mut r = Reference::new(dtype, n, n * big);
                for op in ALL_OPS {
                    for m in SMALL_SIZES {
                        reduce_scatter_case(g.as_ref(), &mut r, op, &[m as i64])?;
                    }
                    reduce_scatter_case(g.as_ref(), &mut r, op, &[2, 3])?;
                    reduce_scatter_case(g.as_ref(), &mut r, op, &[big as i64])?;
                }
            }
            // The input crosses the thresholds at sizes that depend on the group size.
            let mut r = Reference::new(DType::F32, n, n * LARGE);
            for per_rank in [AT_THRESHOLD / n, SHM_AT / n - 1, SHM_AT / n, LARGE] {
                for op in [ReduceOp::Sum, ReduceOp::Avg] {
                    reduce_scatter_case(g.as_ref(), &mut r, op, &[per_rank as i64])?;
                    reduce_scatter_case(tcp.as_ref(), &mut r, op, &[per_rank as i64])?;
                }
            }
            Ok(())
        });
    });
}

fn broadcast_case(g: &dyn ProcessGroup, r: &Reference, shape: &[i64], root: usize) -> Result<()> {
    let (n, me, dtype) = (g.size(), g.rank(), r.dtype);
    let numel = shape.iter().product::<i64>() as usize;
    let t = if me == root {
        tensor(r.input(root, numel), shape, dtype)
    } else {
        garbage(shape, dtype)
    };
    g.broadcast(&t, root)?;
    let what = format!(
        "broadcast {dtype} {shape:?} from root {root} on {n} ranks ({})",
        g.name()
    );
    assert_tensor(&t, dtype, shape, r.input(root, numel), &what);
    Ok(())
}

/// Every root (including non-zero ones), every dtype, odd and large sizes on both sides of
/// the thresholds, and tensors spanning several 1 MiB pipeline segments.
#[test]
fn broadcast_every_root_dtype_and_size() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case(
        "broadcast_every_root_dtype_and_size",
        cases,
        |&n: &usize| {
            run(n, |ctx| -> Result<()> {
                let g = ctx.group();
                let tcp = tcp_world(ctx)?;
                for dtype in ALL_DTYPES {
                    let (mid, big) = (numel_for(dtype, 160_000), numel_for(dtype, 400_000));
                    let r = Reference::new(dtype, n, big);
                    for root in (0..n).rev() {
                        for numel in SMALL_SIZES {
                            broadcast_case(g.as_ref(), &r, &[numel as i64], root)?;
                        }
                        broadcast_case(g.as_ref(), &r, &[3, 5], root)?;
                    }
                    // Large: from the last rank (a non-zero root when n > 1).
                    broadcast_case(g.as_ref(), &r, &[mid as i64], n - 1)?;
                    broadcast_case(g.as_ref(), &r, &[big as i64], n - 1)?;
                }
                let r = Reference::new(DType::F32, n, 300_007);
                for root in (0..n).rev() {
                    for group in [&g, &tcp] {
                        for numel in [AT_THRESHOLD, AT_THRESHOLD + 1, SHM_AT - 1, SHM_AT] {
                            broadcast_case(group.as_ref(), &r, &[numel as i64], root)?;
                        }
                        // 1.2 MB: two pipeline segments, the last one partial.
                        broadcast_case(group.as_ref(), &r, &[300_007], root)?;
                    }
                }
                // 2.1 MB of bytes: three segments down the chain.
                let r = Reference::new(DType::U8, n, 2_100_001);
                broadcast_case(tcp.as_ref(), &r, &[2_100_001], n / 2)?;
                broadcast_case(g.as_ref(), &r, &[2_100_001], n / 2)?;
                Ok(())
            });
        },
    );
}

/// Value of row `k`, column `c` of the block rank `src` sends to rank `dst`.
fn a2a_value(src: usize, dst: usize, k: usize, c: usize) -> f64 {
    (src * 1_000_000 + dst * 100_000 + k * 2 + c) as f64
}

/// Runs an all_to_all where rank `src` sends `split(src, dst)` rows of `cols` columns to
/// `dst`, and checks every received row. `explicit`: pass split lists (else empty lists,
/// which requires equal splits).
fn all_to_all_case(
    g: &dyn ProcessGroup,
    dtype: DType,
    cols: usize,
    split: &dyn Fn(usize, usize) -> usize,
    explicit: bool,
) -> Result<()> {
    let (n, me) = (g.size(), g.rank());
    let in_splits: Vec<usize> = (0..n).map(|j| split(me, j)).collect();
    let out_splits: Vec<usize> = (0..n).map(|j| split(j, me)).collect();
    let block = |src: usize, dst: usize| -> Vec<f64> {
        (0..split(src, dst))
            .flat_map(|k| (0..cols).map(move |c| a2a_value(src, dst, k, c)))
            .collect()
    };
    let in_vals: Vec<f64> = (0..n).flat_map(|j| block(me, j)).collect();
    let expected: Vec<f64> = (0..n).flat_map(|j| block(j, me)).collect();
    let shape = |rows: usize| {
        if cols == 1 {
            vec![rows as i64]
        } else {
            vec![rows as i64, cols as i64]
        }
    };
    let in_shape = shape(in_splits.iter().sum());
    let out_shape = shape(out_splits.iter().sum());
    let input = tensor(&in_vals, &in_shape, dtype);
    let out = garbage(&out_shape, dtype);
    if explicit {
        g.all_to_all(&out, &input, &out_splits, &in_splits)?;
    } else {
        g.all_to_all(&out, &input, &[], &[])?;
    }
    let exp = values(&tensor1(&expected, dtype));
    let what = format!("all_to_all {dtype} in splits {in_splits:?} out splits {out_splits:?} explicit={explicit} on {n} ranks");
    assert_tensor(&out, dtype, &out_shape, &exp, &what);
    Ok(())
}

/// Equal splits from empty split lists, uneven splits including zeros, 2-D rows, and blocks
/// larger than 64 KiB. (All-zero splits, i.e. empty tensors, are in `empty_all_to_all`.)
#[test]
fn all_to_all_even_uneven_and_empty() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_to_all_even_uneven_and_empty", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let g = g.as_ref();
            // Equal splits, implicit and explicit.
            all_to_all_case(g, DType::F64, 2, &|_, _| 3, false)?;
            all_to_all_case(g, DType::F64, 2, &|_, _| 3, true)?;
            all_to_all_case(g, DType::I64, 1, &|_, _| 1, false)?;
            // Uneven with zeros: (src + 2 dst + 1) % 3 rows (no rank's tensors are all empty).
            let uneven = |s: usize, d: usize| (s + 2 * d + 1) % 3;
            all_to_all_case(g, DType::F64, 2, &uneven, true)?;
            all_to_all_case(g, DType::F32, 1, &uneven, true)?;
            all_to_all_case(g, DType::I64, 3, &uneven, true)?;
            // Only the diagonal, only off-diagonal.
            all_to_all_case(g, DType::F64, 2, &|s, d| if s == d { 2 } else { 0 }, true)?;
            if g.size() > 1 {
                all_to_all_case(
                    g,
                    DType::F64,
                    2,
                    &|s, d| if s == d { 0 } else { s + 1 },
                    true,
                )?;
            }
            // Large uneven blocks (up to ~480 KB), some zero.
            all_to_all_case(g, DType::F64, 1, &|s, d| 30_001 * ((s + d + 1) % 3), true)?;
            all_to_all_case(g, DType::F64, 2, &|_, _| 10_007, false)?;
            // Exact small values for the narrow dtypes.
            for dtype in [DType::BF16, DType::F16, DType::I32, DType::U8, DType::Bool] {
                let (n, me) = (g.size(), g.rank());
                let in_splits: Vec<usize> = (0..n).map(|j| uneven(me, j)).collect();
                let out_splits: Vec<usize> = (0..n).map(|j| uneven(j, me)).collect();
                let val = |src: usize, dst: usize, k: usize| -> f64 {
                    match dtype {
                        DType::Bool => f64::from(u8::from((src + dst + k) % 2 == 1)),
                        _ => (src * 16 + dst * 4 + k) as f64,
                    }
                };
                let block =
                    |src: usize, dst: usize| (0..uneven(src, dst)).map(move |k| val(src, dst, k));
                let input = tensor1(
                    &(0..n).flat_map(|j| block(me, j)).collect::<Vec<_>>(),
                    dtype,
                );
                let expected: Vec<f64> = (0..n).flat_map(|j| block(j, me)).collect();
                let out = garbage(&[expected.len() as i64], dtype);
                g.all_to_all(&out, &input, &out_splits, &in_splits)?;
                assert_tensor(
                    &out,
                    dtype,
                    &[expected.len() as i64],
                    &expected,
                    &format!("all_to_all {dtype} uneven"),
                );
            }
            Ok(())
        });
    });
}

/// Empty (0-element) tensors of every dtype, 1-D and with a zero-sized dim, through every
/// collective and send/recv. Each call is announced on stderr first, so a failure report
/// (which quotes the rank's stderr tail) names the call that crashed.
#[test]
fn empty_tensors() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("empty_tensors", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            let whiches = [
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "all_to_all",
                "send_recv",
            ];
            for which in whiches {
                for dtype in ALL_DTYPES {
                    for shape in [vec![0i64], vec![0, 4], vec![4, 0]] {
                        let what = format!("{which} of an empty {dtype} {shape:?} on {n} ranks");
                        eprintln!("rank {me}: {what}");
                        let mut big = shape.clone();
                        big[0] *= n as i64;
                        match which {
                            "all_reduce" => {
                                for op in ALL_OPS
                                    .into_iter()
                                    .filter(|&op| op != ReduceOp::Avg || avg_valid(dtype))
                                {
                                    let t = zeros(&shape, dtype);
                                    g.all_reduce(&t, op)?;
                                    assert_tensor(&t, dtype, &shape, &[], &what);
                                }
                            }
                            "all_gather" => {
                                let out = zeros(&big, dtype);
                                g.all_gather(&out, &zeros(&shape, dtype))?;
                                assert_tensor(&out, dtype, &big, &[], &what);
                            }
                            "reduce_scatter" => {
                                for op in ALL_OPS
                                    .into_iter()
                                    .filter(|&op| op != ReduceOp::Avg || avg_valid(dtype))
                                {
                                    let out = zeros(&shape, dtype);
                                    g.reduce_scatter(&out, &zeros(&big, dtype), op)?;
                                    assert_tensor(&out, dtype, &shape, &[], &what);
                                }
                            }
                            "broadcast" => {
                                for root in 0..n {
                                    let t = zeros(&shape, dtype);
                                    g.broadcast(&t, root)?;
                                    assert_tensor(&t, dtype, &shape, &[], &what);
                                }
                            }
                            "all_to_all" => {
                                let out = zeros(&shape, dtype);
                                if shape[0] == 0 {
                                    g.all_to_all(&out, &zeros(&shape, dtype), &[], &[])?;
                                    let splits = vec![0usize; n];
                                    g.all_to_all(&out, &zeros(&shape, dtype), &splits, &splits)?;
                                } else {
                                    // Rows of zero elements: 4 rows, split as evenly as possible.
                                    let splits: Vec<usize> =
                                        (0..n).map(|j| 4 / n + usize::from(j < 4 % n)).collect();
                                    g.all_to_all(&out, &zeros(&shape, dtype), &splits, &splits)?;
                                }
                                assert_tensor(&out, dtype, &shape, &[], &what);
                            }
                            _ => {
                                if n > 1 {
                                    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
                                    g.send(&zeros(&shape, dtype), next, 3)?;
                                    let r = zeros(&shape, dtype);
                                    g.recv(&r, prev, 3)?;
                                    assert_tensor(&r, dtype, &shape, &[], &what);
                                }
                            }
                        }
                    }
                }
                // Everyone still agrees on the sequence afterwards.
                still_in_step(g.as_ref(), &format!("empty {which}"))?;
            }
            Ok(())
        });
    });
}

/// Transposed, strided and offset views: inputs are read in logical order and in-place
/// results are written back through the view.
#[test]
fn non_contiguous_tensors() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("non_contiguous_tensors", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            let nf = n as f64;
            let rank_sum = (n * (n - 1) / 2) as f64;
            let opts = (Kind::Float, Device::Cpu);

            // all_reduce in place on a transposed view: base[i][j] = 10 i + j + rank.
            let base = Tensor::arange(12, opts).reshape([3, 4]) + me as f64;
            let t = base.tr();
            assert!(!t.is_contiguous());
            g.all_reduce(&t, ReduceOp::Sum)?;
            let expected_base: Vec<f64> = (0..12).map(|k| nf * k as f64 + rank_sum).collect();
            assert_tensor(
                &base,
                DType::F32,
                &[3, 4],
                &expected_base,
                "all_reduce through a transposed view (storage)",
            );
            let expected_t: Vec<f64> = (0..4)
                .flat_map(|j| (0..3).map(move |i| nf * (4 * i + j) as f64 + rank_sum))
                .collect();
            assert_tensor(
                &t,
                DType::F32,
                &[4, 3],
                &expected_t,
                "all_reduce of a transposed view",
            );

            // all_reduce on a strided slice touches only its elements.
            let base = Tensor::zeros([15], opts) - 1.0;
            let strided = base.slice(0, 1, 15, 2);
            let mut s = strided.shallow_clone();
            let _ = s.fill_(me as f64 + 1.0);
            g.all_reduce(&strided, ReduceOp::Max)?;
            let expected: Vec<f64> = (0..15)
                .map(|i| if i % 2 == 1 { nf } else { -1.0 })
                .collect();
            assert_tensor(
                &base,
                DType::F32,
                &[15],
                &expected,
                "all_reduce max on a stride-2 slice",
            );

            // Contiguous view with a storage offset, large enough for the ring path.
            let base = Tensor::ones([LARGE as i64 + 10], opts) * (me as f64 + 1.0);
            let view = base.narrow(0, 5, LARGE as i64);
            g.all_reduce(&view, ReduceOp::Sum)?;
            let total = (n * (n + 1) / 2) as f64;
            let got = values(&base);
            ensure!(
                got[..5].iter().all(|&v| v == me as f64 + 1.0),
                "elements before the view changed"
            );
            ensure!(
                got[LARGE + 5..].iter().all(|&v| v == me as f64 + 1.0),
                "elements after the view changed"
            );
            ensure!(
                got[5..LARGE + 5].iter().all(|&v| v == total),
                "offset view not reduced"
            );

            // A large transposed view (staged host copy, shared-memory path) and a TCP-only group.
            let tcp = tcp_world(ctx)?;
            for group in [&g, &tcp] {
                let base = Tensor::arange(317 * 331, opts).reshape([317, 331]) + me as f64;
                let t = base.tr();
                group.all_reduce(&t, ReduceOp::Sum)?;
                let expected: Vec<f64> = (0..317 * 331).map(|k| nf * k as f64 + rank_sum).collect();
                assert_tensor(
                    &base,
                    DType::F32,
                    &[317, 331],
                    &expected,
                    "large all_reduce through a transposed view",
                );
            }

            // all_gather: transposed input, transposed (non-contiguous) output.
            let input = (Tensor::arange(12, opts).reshape([3, 4]) + 100.0 * me as f64).tr(); // [4, 3]
            let out_storage = Tensor::full([3, 4 * n as i64], -7.0, opts);
            let out = out_storage.tr(); // [4n, 3]
            assert!(!out.is_contiguous());
            g.all_gather(&out, &input)?;
            let expected: Vec<f64> = (0..n)
                .flat_map(|r| {
                    (0..4).flat_map(move |j| {
                        (0..3).map(move |i| (4 * i + j) as f64 + 100.0 * r as f64)
                    })
                })
                .collect();
            assert_tensor(
                &out,
                DType::F32,
                &[4 * n as i64, 3],
                &expected,
                "all_gather into a transposed output",
            );

            // reduce_scatter: transposed input [2n, 3], transposed output [2, 3].
            let in_storage =
                Tensor::arange(6 * n as i64, opts).reshape([3, 2 * n as i64]) * (me as f64 + 1.0);
            let input = in_storage.tr();
            let out_storage = Tensor::full([3, 2], -7.0, opts);
            let out = out_storage.tr();
            g.reduce_scatter(&out, &input, ReduceOp::Sum)?;
            let two_n = 2 * n;
            let expected: Vec<f64> = (2 * me..2 * me + 2)
                .flat_map(|row| (0..3).map(move |col| (col * two_n + row) as f64 * total))
                .collect();
            assert_tensor(
                &out,
                DType::F32,
                &[2, 3],
                &expected,
                "reduce_scatter with transposed input and output",
            );

            // broadcast from the last rank into transposed views.
            let root = n - 1;
            let storage = if me == root {
                Tensor::arange(20, opts).reshape([4, 5])
            } else {
                Tensor::full([4, 5], -3.0, opts)
            };
            let view = storage.tr();
            g.broadcast(&view, root)?;
            let expected: Vec<f64> = (0..20).map(|k| k as f64).collect();
            assert_tensor(
                &storage,
                DType::F32,
                &[4, 5],
                &expected,
                "broadcast into a transposed view",
            );

            // all_to_all with a transposed 2-D input: rows are logical rows.
            let input = (Tensor::arange(2 * n as i64 * 3, opts).reshape([3, 2 * n as i64])
                + 1000.0 * me as f64)
                .tr(); // [2n, 3]
            let out = Tensor::full([3, 2 * n as i64], -1.0, opts).tr();
            g.all_to_all(&out, &input, &[], &[])?;
            // Logical input row k of rank s, column c = c * 2n + k + 1000 s; rank me gets rows 2me, 2me+1 of each s.
            let expected: Vec<f64> = (0..n)
                .flat_map(|s| {
                    (2 * me..2 * me + 2).flat_map(move |k| {
                        (0..3).map(move |c| (c * two_n + k) as f64 + 1000.0 * s as f64)
                    })
                })
                .collect();
            assert_tensor(
                &out,
                DType::F32,
                &[2 * n as i64, 3],
                &expected,
                "all_to_all with transposed tensors",
            );

            // send/recv from and into transposed views.
            if n > 1 {
                let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
                let msg = (Tensor::arange(6, opts).reshape([2, 3]) + 10.0 * me as f64).tr();
                g.send(&msg, next, 0)?;
                let storage = Tensor::zeros([2, 3], opts);
                g.recv(&storage.tr(), prev, 0)?;
                let expected: Vec<f64> = (0..6).map(|k| k as f64 + 10.0 * prev as f64).collect();
                assert_tensor(
                    &storage,
                    DType::F32,
                    &[2, 3],
                    &expected,
                    "recv into a transposed view",
                );
            }
            Ok(())
        });
    });
}

/// Arguments no rank could run are rejected on every rank, and the group stays usable.
#[test]
fn invalid_arguments_are_rejected() {
    let cases: Vec<usize> = vec![1, 3];
    crate::common::each_case("invalid_arguments_are_rejected", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            let f = |len: i64| Tensor::zeros([len], (Kind::Float, Device::Cpu));
            let invalid = |r: Result<(), CommError>, what: &str| match r {
                Err(CommError::InvalidArgument(_)) => Ok(()),
                other => Err(anyhow::anyhow!(
                    "{what}: expected InvalidArgument, got {other:?}"
                )),
            };
            invalid(
                g.all_gather(&f(3 * n as i64 + 1), &f(3)),
                "all_gather wrong output size",
            )?;
            invalid(
                g.reduce_scatter(&f(3), &f(3 * n as i64 + 1), ReduceOp::Sum),
                "reduce_scatter wrong input size",
            )?;
            invalid(
                g.all_gather(&zeros(&[3 * n as i64], DType::F64), &f(3)),
                "all_gather dtype mismatch",
            )?;
            invalid(g.broadcast(&f(3), n), "broadcast root out of range")?;
            invalid(
                g.all_to_all(&f(n as i64), &f(n as i64), &vec![1; n + 1], &vec![1; n + 1]),
                "all_to_all wrong split count",
            )?;
            invalid(
                g.all_to_all(&f(n as i64), &f(n as i64), &vec![2; n], &vec![2; n]),
                "all_to_all splits not summing to rows",
            )?;
            if n > 1 {
                invalid(
                    g.all_to_all(&f(n as i64 + 1), &f(n as i64 + 1), &[], &[]),
                    "all_to_all rows not divisible",
                )?;
            }
            invalid(g.send(&f(1), me, 0), "send to self")?;
            invalid(g.recv(&f(1), n, 0), "recv from outside the group")?;
            let c = Tensor::from_slice(&[1.0f32]).to_kind(Kind::ComplexFloat);
            ensure!(
                g.all_reduce(&c, ReduceOp::Sum).is_err(),
                "complex all_reduce accepted"
            );
            still_in_step(g.as_ref(), "rejected calls")?;
            Ok(())
        });
    });
}

/// The group still runs in step after `what`: a sum of the ranks' numbers comes out right.
fn still_in_step(g: &dyn ProcessGroup, what: &str) -> Result<()> {
    let (n, me) = (g.size(), g.rank());
    let t = Tensor::from_slice(&[me as i64]);
    g.all_reduce(&t, ReduceOp::Sum)?;
    ensure!(
        values(&t) == vec![(n * (n - 1) / 2) as f64],
        "all_reduce after {what}"
    );
    Ok(())
}

/// Rank `me`'s `m` values of the reduce-scatter (`op`) of the first `m × n` of `mine`.
fn reduce_scatter_prefix(
    group: &dyn ProcessGroup,
    mine: &[f32],
    m: usize,
    op: ReduceOp,
) -> Result<Tensor> {
    let out = Tensor::zeros([m as i64], (Kind::Float, Device::Cpu));
    group.reduce_scatter(&out, &Tensor::from_slice(&mine[..group.size() * m]), op)?;
    Ok(out)
}

/// A tensor of `numel` f32 values identifying (src, dst, idx); exact in f32.
fn p2p_message(src: usize, dst: usize, idx: usize, numel: usize) -> Tensor {
    let base = (src * 1_000_000 + dst * 100_000 + idx * 10_000) as f32;
    let v: Vec<f32> = (0..numel).map(|i| base + (i % 1000) as f32).collect();
    Tensor::from_slice(&v)
}

/// Small and > 64 KiB messages, interleaved. (Empty messages: `empty_send_recv`.)
const P2P_SIZES: [usize; 7] = [1, 7, LARGE, 3, 20_000, 250_001, 5];

/// Several messages of different sizes (small and > 64 KiB) sent back to back to every
/// peer, before anyone receives, arrive in order with their tags; receives posted before the
/// sends and waited in reverse order still match in send order.
#[test]
fn send_recv_ordering() {
    let cases: Vec<usize> = vec![2, 3, 4];
    crate::common::each_case("send_recv_ordering", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            // Phase 1: blocking sends to every peer, then blocking receives.
            for dst in (0..n).filter(|&p| p != me) {
                for (idx, &numel) in P2P_SIZES.iter().enumerate() {
                    g.send(&p2p_message(me, dst, idx, numel), dst, 100 + idx as u64)?;
                }
            }
            for src in (0..n).filter(|&p| p != me) {
                for (idx, &numel) in P2P_SIZES.iter().enumerate() {
                    let r = Tensor::full([numel as i64], -1.0, (Kind::Float, Device::Cpu));
                    g.recv(&r, src, 100 + idx as u64)?;
                    ensure!(
                        r.equal(&p2p_message(src, me, idx, numel)),
                        "phase 1: message {idx} from rank {src} wrong"
                    );
                }
            }
            // Phase 2: post every receive first, then send, then wait in reverse order.
            let mut recvs: Vec<(usize, usize, Tensor, Work)> = Vec::new();
            for src in (0..n).filter(|&p| p != me) {
                for (idx, &numel) in P2P_SIZES.iter().enumerate() {
                    let r = Tensor::full([numel as i64], -1.0, (Kind::Float, Device::Cpu));
                    let w = g.recv_async(&r, src, idx as u64)?;
                    recvs.push((src, idx, r, w));
                }
            }
            let mut sends = Vec::new();
            for dst in (0..n).filter(|&p| p != me) {
                for (idx, &numel) in P2P_SIZES.iter().enumerate() {
                    sends.push(g.send_async(
                        &p2p_message(me, dst, 10 + idx, numel),
                        dst,
                        idx as u64,
                    )?);
                }
            }
            for (src, idx, r, w) in recvs.iter().rev() {
                w.wait()?;
                ensure!(w.is_completed(), "recv work not completed after wait");
                ensure!(
                    r.equal(&p2p_message(*src, me, 10 + idx, P2P_SIZES[*idx])),
                    "phase 2: message {idx} from rank {src} wrong"
                );
            }
            for s in sends {
                s.wait()?;
            }
            // Collectives still line up after point-to-point traffic.
            let t = Tensor::from_slice(&[1i32]);
            g.all_reduce(&t, ReduceOp::Sum)?;
            ensure!(values(&t) == vec![n as f64], "all_reduce after p2p");
            Ok(())
        });
    });
}

/// Ranks that all send large messages to each other before receiving do not deadlock, and
/// a sent tensor may be overwritten at once without changing what arrives.
#[test]
fn send_before_recv_does_not_deadlock() {
    let cases: Vec<usize> = vec![2, 4];
    crate::common::each_case("send_before_recv_does_not_deadlock", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            const BIG: usize = 1 << 20; // 4 MiB per message, far beyond socket buffers
            for dst in (0..n).filter(|&p| p != me) {
                let mut t = Tensor::full(
                    [BIG as i64],
                    (me * 10 + dst) as f64,
                    (Kind::Float, Device::Cpu),
                );
                g.send(&t, dst, 1)?;
                let _ = t.fill_(-5.0);
                g.send(&t, dst, 2)?;
                let _ = t.fill_(-9.0);
            }
            for src in (0..n).filter(|&p| p != me) {
                let r = Tensor::zeros([BIG as i64], (Kind::Float, Device::Cpu));
                g.recv(&r, src, 1)?;
                let want = (src * 10 + me) as f64;
                ensure!(
                    values(&r.min()) == vec![want] && values(&r.max()) == vec![want],
                    "first message from {src} wrong"
                );
                g.recv(&r, src, 2)?;
                ensure!(
                    values(&r.min()) == vec![-5.0] && values(&r.max()) == vec![-5.0],
                    "second message from {src} wrong"
                );
            }
            let t = Tensor::from_slice(&[1.0f32]);
            g.all_reduce(&t, ReduceOp::Sum)?;
            Ok(())
        });
    });
}

/// A receive whose tag (or size) does not match the message fails instead of delivering it.
#[test]
fn recv_with_mismatched_tag_errors() {
    let cases: Vec<usize> = vec![2, 3];
    crate::common::each_case("recv_with_mismatched_tag_errors", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let me = g.rank();
            let f = |v: &[f32]| Tensor::from_slice(v);
            if me == 0 {
                g.send(&f(&[1.0, 2.0, 3.0]), 1, 7)?;
                g.send(&f(&[4.0, 5.0, 6.0, 7.0]), 1, 8)?;
                g.send(&f(&[8.0, 9.0]), 1, 9)?;
            } else if me == 1 {
                let r = f(&[0.0; 3]);
                match g.recv(&r, 0, 70) {
                    Err(CommError::Mismatch(msg)) => ensure!(
                        msg.contains("tag"),
                        "mismatch message does not mention the tag: {msg}"
                    ),
                    other => {
                        panic!("recv with tag 70 for a tag-7 message: expected Mismatch, got {other:?}")
                    }
                }
                ensure!(
                    r.equal(&f(&[0.0; 3])),
                    "a mismatched recv wrote into the tensor"
                );
                let r = f(&[0.0; 5]);
                match g.recv(&r, 0, 8) {
                    Err(CommError::Mismatch(_)) => {}
                    other => panic!(
                    "recv of 5 elements for a 4-element message: expected Mismatch, got {other:?}"
                ),
                }
                let r = f(&[0.0; 2]);
                g.recv(&r, 0, 9)?;
                ensure!(r.equal(&f(&[8.0, 9.0])), "message after mismatches wrong");
            }
            let t = Tensor::from_slice(&[1.0f32]);
            g.all_reduce(&t, ReduceOp::Sum)?;
            ensure!(
                values(&t) == vec![g.size() as f64],
                "all_reduce after mismatched receives"
            );
            Ok(())
        });
    });
}

/// Several async operations in flight at once (and a blocking one issued behind them)
/// complete with the right results.
#[test]
fn async_ops_in_flight() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("async_ops_in_flight", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            let (n, me) = (g.size(), g.rank());
            let cases: Vec<(DType, ReduceOp, usize)> = vec![
                (DType::F32, ReduceOp::Sum, 7),
                (DType::F32, ReduceOp::Max, LARGE),
                (DType::I64, ReduceOp::Sum, 13),
                (DType::BF16, ReduceOp::Avg, 40_000),
            ];
            let tensors: Vec<Tensor> = cases
                .iter()
                .map(|&(d, _, len)| tensor1(&inputs(d, me, len), d))
                .collect();
            let mut works = Vec::new();
            for (t, &(_, op, _)) in tensors.iter().zip(&cases) {
                works.push(g.all_reduce_async(t, op)?);
            }
            let gin = tensor1(&inputs(DType::F64, me, 30_001), DType::F64);
            let gout = garbage(&[30_001 * n as i64], DType::F64);
            works.push(g.all_gather_async(&gout, &gin)?);
            let blocking = Tensor::from_slice(&[me as f32 + 0.5]);
            g.all_reduce(&blocking, ReduceOp::Min)?;
            ensure!(
                values(&blocking) == vec![0.5],
                "blocking all_reduce issued behind async ones"
            );
            let bcast = if me == n - 1 {
                tensor1(&inputs(DType::I32, n - 1, 9), DType::I32)
            } else {
                zeros(&[9], DType::I32)
            };
            works.push(g.broadcast_async(&bcast, n - 1)?);

            for w in works.iter().rev() {
                w.wait()?;
            }
            for w in &works {
                ensure!(w.is_completed(), "work not completed after wait");
                w.wait()?; // waiting again returns the same outcome
            }
            for (t, &(d, op, len)) in tensors.iter().zip(&cases) {
                let per_rank: Vec<Vec<f64>> = (0..n).map(|r| inputs(d, r, len)).collect();
                assert_tensor(
                    t,
                    d,
                    &[len as i64],
                    &reduce_expected(d, op, &per_rank),
                    &format!("async all_reduce {op} {d} [{len}]"),
                );
            }
            let expected: Vec<f64> = (0..n).flat_map(|r| inputs(DType::F64, r, 30_001)).collect();
            assert_tensor(
                &gout,
                DType::F64,
                &[30_001 * n as i64],
                &expected,
                "async all_gather",
            );
            assert_tensor(
                &bcast,
                DType::I32,
                &[9],
                &inputs(DType::I32, n - 1, 9),
                "async broadcast",
            );
            Ok(())
        });
    });
}

/// Random f32 values of wildly different magnitudes and signs, so the rounding of a sum
/// depends on the order of additions.
fn order_sensitive(rank: usize, len: usize) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5eed_0000 + rank as u64);
    (0..len)
        .map(|_| {
            let mantissa: f32 = rng.random_range(1.0..2.0);
            let exponent: i32 = rng.random_range(-12..=12);
            let sign = if rng.random_bool(0.5) { 1.0 } else { -1.0 };
            sign * mantissa * 10f32.powi(exponent)
        })
        .collect()
}

/// Bitwise determinism with random delays: 20 repetitions of all_reduce and reduce_scatter
/// (sum and avg) at sizes taking every path (direct ≤ 64 KiB, TCP pairwise + ring, shared
/// memory ≥ 256 KiB, and TCP at large sizes on a group without shared memory), each
/// bit-identical to a rank-order f32 sum computed locally from all-gathered inputs, and
/// reduce_scatter bit-identical to the matching slice of all_reduce.
#[test]
fn deterministic_under_random_delays() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("deterministic_under_random_delays", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            chaos::set_max_delay(Duration::from_micros(200));
            let g = ctx.group();
            let tcp = tcp_world(ctx)?;
            let (n, me) = (g.size(), g.rank());
            let len = LARGE;
            let mine = order_sensitive(me, len);
            // Everyone's inputs, exactly, via all_gather.
            let gathered = Tensor::zeros([(n * len) as i64], (Kind::Float, Device::Cpu));
            g.all_gather(&gathered, &Tensor::from_slice(&mine))?;
            let all = Vec::<f32>::try_from(&gathered)?;
            for r in 0..n {
                ensure!(
                    all[r * len..(r + 1) * len] == order_sensitive(r, len)[..],
                    "all_gather of rank {r}'s inputs"
                );
            }
            // Reference: rank order 0..n-1, one element at a time, in f32.
            let reference: Vec<f32> = (0..len)
                .map(|i| {
                    let mut acc = all[i];
                    for r in 1..n {
                        acc += all[r * len + i];
                    }
                    acc
                })
                .collect();
            if n >= 3 {
                // The inputs must make the order matter, or this test proves nothing.
                let reversed_differs = (0..len).any(|i| {
                    let mut acc = all[(n - 1) * len + i];
                    for r in (0..n - 1).rev() {
                        acc += all[r * len + i];
                    }
                    acc.to_bits() != reference[i].to_bits()
                });
                ensure!(reversed_differs, "inputs are not order-sensitive");
            }
            let ref_bits: Vec<u32> = reference.iter().map(|x| x.to_bits()).collect();
            let avg_bits: Vec<u32> = reference.iter().map(|x| (x / n as f32).to_bits()).collect();
            // bf16: accumulate the bf16 values in f32 in rank order, round once.
            let bf_inputs: Vec<Vec<f64>> = (0..n)
                .map(|r| {
                    values(
                        &Tensor::from_slice(&all[r * len..(r + 1) * len]).to_kind(Kind::BFloat16),
                    )
                })
                .collect();
            let bf_expected = reduce_expected(DType::BF16, ReduceOp::Sum, &bf_inputs);
            let sizes = [
                1000,
                AT_THRESHOLD,
                AT_THRESHOLD + 1,
                MID,
                SHM_AT - 1,
                SHM_AT,
                LARGE,
            ];
            let mut first: Option<Vec<u32>> = None;
            for rep in 0..20 {
                for (group, kind) in [(&g, "default"), (&tcp, "tcp-only")] {
                    for k in sizes {
                        let t = Tensor::from_slice(&mine[..k]);
                        group.all_reduce(&t, ReduceOp::Sum)?;
                        let got = bits(&t);
                        ensure!(got == ref_bits[..k], "rep {rep}, {kind} group: all_reduce of {k} elements differs from the rank-order sum");
                        if k == LARGE {
                            // Same bits as the first repetition (implied, but stated).
                            ensure!(
                                *first.get_or_insert_with(|| got.clone()) == got,
                                "rep {rep}: all_reduce bits changed"
                            );
                        }
                        // reduce_scatter of the first n*m elements: the same bits as the
                        // matching slice of the all_reduce just done.
                        let m = k / n;
                        let out = reduce_scatter_prefix(group.as_ref(), &mine, m, ReduceOp::Sum)?;
                        ensure!(bits(&out) == got[me * m..(me + 1) * m], "rep {rep}, {kind} group: reduce_scatter of {k} elements differs from all_reduce");
                    }
                    // Avg: the rank-order sum divided once, all_reduce and reduce_scatter alike.
                    for k in [AT_THRESHOLD, MID, LARGE] {
                        let t = Tensor::from_slice(&mine[..k]);
                        group.all_reduce(&t, ReduceOp::Avg)?;
                        let avg = bits(&t);
                        ensure!(avg == avg_bits[..k], "rep {rep}, {kind} group: all_reduce avg of {k} elements differs from sum / n");
                        let m = k / n;
                        let out = reduce_scatter_prefix(group.as_ref(), &mine, m, ReduceOp::Avg)?;
                        ensure!(
                        bits(&out) == avg[me * m..(me + 1) * m],
                        "rep {rep}, {kind} group: reduce_scatter avg differs from all_reduce avg"
                    );
                    }
                    // bf16, large.
                    let t = Tensor::from_slice(&mine).to_kind(Kind::BFloat16);
                    group.all_reduce(&t, ReduceOp::Sum)?;
                    ensure!(values(&t) == bf_expected, "rep {rep}, {kind} group: bf16 all_reduce differs from the f32 rank-order sum rounded once");
                }
            }
            chaos::set_max_delay(Duration::ZERO);
            Ok(())
        });
    });
}

/// Barriers (blocking and async) on their own and between collectives.
#[test]
fn barrier_orders_around_collectives() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("barrier_orders_around_collectives", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let g = ctx.group();
            for i in 0..5 {
                g.barrier()?;
                let t = Tensor::from_slice(&[i as f64 + g.rank() as f64]);
                g.all_reduce(&t, ReduceOp::Max)?;
                ensure!(
                    values(&t) == vec![(i + n - 1) as f64],
                    "all_reduce between barriers"
                );
            }
            g.barrier_async()?.wait()?;
            // An async barrier queued behind an async collective.
            let t = Tensor::from_slice(&[1i64]);
            let w = g.all_reduce_async(&t, ReduceOp::Sum)?;
            let b = g.barrier_async()?;
            b.wait()?;
            w.wait()?;
            ensure!(
                values(&t) == vec![n as f64],
                "all_reduce before an async barrier"
            );
            Ok(())
        });
    });
}

/// Runs one mismatched collective on a fresh group of the whole world: rank 0 runs `case`
/// with `mine` elements, the others with `others` (or the matching collective). Returns this
/// rank's result. The group is kept until every rank has its result (a world all_reduce), so
/// no rank sees its peer's group close instead of the mismatch.
fn mismatched_case(
    ctx: &lockstep_harness::RankCtx,
    case: &str,
    mine: usize,
    others: usize,
) -> Result<Result<(), CommError>> {
    let (n, me) = (ctx.world_size(), ctx.rank());
    let all: Vec<usize> = (0..n).collect();
    let f32s = |len: usize| Tensor::zeros([len as i64], (Kind::Float, Device::Cpu));
    let g = ctx.world().new_group(&all)?.expect("member");
    let len = if me == 0 { mine } else { others };
    let result = match case {
        "shape" => g.all_reduce(&f32s(len), ReduceOp::Sum),
        "dtype" if me == 0 => g.all_reduce(&zeros(&[mine as i64], DType::F64), ReduceOp::Sum),
        "dtype" => g.all_reduce(&f32s(mine), ReduceOp::Sum),
        "reduction" => g.all_reduce(
            &f32s(mine),
            if me == 0 {
                ReduceOp::Max
            } else {
                ReduceOp::Sum
            },
        ),
        _ if me == 0 => g.all_gather(&f32s(n * mine), &f32s(mine)),
        _ => g.all_reduce(&f32s(n * mine), ReduceOp::Sum),
    };
    ctx.group()
        .all_reduce(&Tensor::from_slice(&[1.0f32]), ReduceOp::Sum)?;
    drop(g);
    Ok(result)
}

fn expect_mismatch(
    result: Result<(), CommError>,
    me: usize,
    case: &str,
    mine: usize,
    others: usize,
) -> Result<()> {
    match result {
        Err(CommError::Mismatch(msg)) => {
            ensure!(msg.contains("rank"), "{case} mismatch ({mine} vs {others}): message names no rank: {msg}");
            Ok(())
        }
        other => panic!("rank {me}: {case} mismatch (rank 0: {mine} elements, others: {others}): expected Mismatch, got {other:?}"),
    }
}

/// Ranks that enter one collective with different shapes, dtypes, reductions or collectives
/// all fail with `Mismatch` (naming ranks) instead of hanging or returning garbage, on every
/// path: direct, TCP pairwise, shared memory, and one rank on each side of a threshold.
#[test]
fn mismatched_collectives_error() {
    let cases: Vec<usize> = vec![2, 3];
    crate::common::each_case("mismatched_collectives_error", cases, |&n: &usize| {
        run(n, |ctx| -> Result<()> {
            let me = ctx.rank();
            for (mine, others) in [
                (7, 8),
                (MID, MID + 1),
                (LARGE, LARGE + 1),
                (AT_THRESHOLD, SHM_AT),
                (SHM_AT, 7),
            ] {
                for case in ["shape", "dtype", "reduction", "collective"] {
                    if case == "collective" && mine == AT_THRESHOLD && n > 2 {
                        continue; // the ring all-gather: `mismatch_against_ring_all_gather`
                    }
                    let result = mismatched_case(ctx, case, mine, others)?;
                    expect_mismatch(result, me, case, mine, others)?;
                }
            }
            Ok(())
        });
    });
}

/// As above with rank 0 in an all-gather that takes the ring (64 KiB per rank, 3 ranks) while
/// ranks 1 and 2 all-reduce: every rank must fail with `Mismatch`. A hang here is the bug, so
/// the run's timeout is short.
#[test]
fn mismatch_against_ring_all_gather() {
    lockstep_harness::Run::new(3)
        .timeout(Duration::from_secs(10))
        .run(|ctx| -> Result<()> {
            let result = mismatched_case(ctx, "collective", AT_THRESHOLD, AT_THRESHOLD)?;
            expect_mismatch(
                result,
                ctx.rank(),
                "all_gather (ring) vs all_reduce",
                AT_THRESHOLD,
                AT_THRESHOLD,
            )
        });
}
