//! Tensor-parallel building blocks against the single-device computation, at TP sizes 1, 2
//! and 4: column- and row-parallel linears (with and without gathered outputs, parallel
//! inputs and sequence parallelism), the vocabulary-parallel embedding and cross-entropy,
//! a planted missing all-reduce, exact collective counts, the RNG tracker's streams and
//! parity-mode dropout, and rejected sizes.
//!
//! Outputs and gradients (inputs, and full weights reassembled with `unshard`) must agree
//! under the fp32 row of the tolerance table; masks must agree bit for bit.

use crate::common;

use anyhow::{bail, ensure, Context, Result};
use common::run;
use lockstep_core::comm::{
    CollectiveCount, CollectiveCounts, CountMap, CountingGroup, DType, OpKind, ReduceOp,
};
use lockstep_core::record::{CollectiveEntry, RunRecord, RunSpec};
use lockstep_core::tensor_parallel::{
    column_parallel_linear, row_parallel_linear, shard, unshard, vocab_parallel_cross_entropy,
    vocab_parallel_embedding, ColumnOptions, Reduction, RowOptions, TpGroup, TpLayerError,
};
use lockstep_harness::parity::Tolerance;
use lockstep_harness::RankCtx;
use lockstep_models::seed::seeded;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

const SEQ: i64 = 8;
const BATCH: i64 = 2;

/// A tensor every rank draws identically.
fn randn(seed: u64, shape: &[i64]) -> Tensor {
    seeded(seed, || Tensor::randn(shape, (Kind::Float, Device::Cpu)))
}

/// A fresh leaf copy requiring grad.
fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Whether `got` matches `want` under the fp32 tolerance table, with the worst element named
/// if not.
fn close(what: &str, got: &Tensor, want: &Tensor) -> Result<()> {
    ensure!(
        got.size() == want.size(),
        "{what}: shape {:?}, expected {:?}",
        got.size(),
        want.size()
    );
    let tol = Tolerance::for_dtype(DType::F32);
    let g = Vec::<f64>::try_from(&got.detach().to_kind(Kind::Double).reshape([-1]))?;
    let w = Vec::<f64>::try_from(&want.detach().to_kind(Kind::Double).reshape([-1]))?;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        ensure!(
            (a - b).abs() <= tol.allowed(*b),
            "{what}: element {i} is {a}, expected {b} (allowed {:e})",
            tol.allowed(*b)
        );
    }
    Ok(())
}

/// The slice of a full tensor rank `r` of `t` holds along `dim`.
fn part(full: &Tensor, dim: i64, r: usize, t: usize) -> Tensor {
    let len = full.size()[dim as usize] / t as i64;
    full.narrow(dim, r as i64 * len, len)
}

/// `x`'s gradient (zeros when backward never reached it).
fn grad(x: &Tensor) -> Tensor {
    let g = x.grad();
    if g.defined() {
        g
    } else {
        x.zeros_like()
    }
}

fn tp_group(ctx: &RankCtx) -> TpGroup {
    ctx.group()
}

/// Column-parallel linear: output, input gradient and full weight/bias gradients equal the
/// single device's, with and without a gathered output and sequence parallelism.
#[test]
fn column_parallel_linear_matches_single_device() {
    let tp_values: Vec<usize> = vec![1, 2, 4];
    let gather_output_values: Vec<bool> = vec![false, true];
    let sequence_parallel_values: Vec<bool> = vec![false, true];
    let cases: Vec<(usize, bool, bool)> =
        crate::common::product3(&tp_values, &gather_output_values, &sequence_parallel_values);
    crate::common::each_case(
        "column_parallel_linear_matches_single_device",
        cases,
        |&(tp, gather_output, sequence_parallel): &(usize, bool, bool)| {
            run(tp, |ctx| -> Result<()> {
                let (r, group) = (ctx.rank(), tp_group(ctx));
                let (inp, out) = (6, 8);
                let x = randn(1, &[SEQ, BATCH, inp]);
                let w = randn(2, &[out, inp]);
                let b = randn(3, &[out]);
                let probe = randn(4, &[SEQ, BATCH, out]);

                // Single device: a loss weighting every output element differently.
                let (xr, wr, br) = (leaf(&x), leaf(&w), leaf(&b));
                let yr = xr.linear(&wr, Some(&br));
                (&yr * &probe).sum(Kind::Float).backward();

                let x_in = if sequence_parallel {
                    leaf(&part(&x, 0, r, tp))
                } else {
                    leaf(&x)
                };
                let (ws, bs) = (shard(&w, 0, r, tp)?, shard(&b, 0, r, tp)?);
                let opts = ColumnOptions {
                    gather_output,
                    sequence_parallel,
                    ..Default::default()
                };
                let y = column_parallel_linear(&x_in, &ws, Some(&bs), &group, opts)?;
                if gather_output {
                    // The full output on every rank: the loss is replicated, counted once.
                    close("output", &y, &yr)?;
                    (&y * &probe).sum(Kind::Float).backward();
                } else {
                    // This rank's output features: the loss is the sum of every rank's part.
                    close("output", &y, &part(&yr, 2, r, tp))?;
                    (&y * part(&probe, 2, r, tp)).sum(Kind::Float).backward();
                }
                let want_x = if sequence_parallel {
                    part(&xr.grad(), 0, r, tp)
                } else {
                    xr.grad()
                };
                close("input gradient", &grad(&x_in), &want_x)?;
                close(
                    "weight gradient",
                    &unshard(&grad(&ws), 0, &*group)?,
                    &wr.grad(),
                )?;
                close(
                    "bias gradient",
                    &unshard(&grad(&bs), 0, &*group)?,
                    &br.grad(),
                )?;
                Ok(())
            });
        },
    );
}

/// Row-parallel linear: output, input gradient and full weight/bias gradients equal the
/// single device's, with full or parallel inputs, with and without sequence parallelism.
#[test]
fn row_parallel_linear_matches_single_device() {
    let tp_values: Vec<usize> = vec![1, 2, 4];
    let input_is_parallel_values: Vec<bool> = vec![false, true];
    let sequence_parallel_values: Vec<bool> = vec![false, true];
    let cases: Vec<(usize, bool, bool)> = crate::common::product3(
        &tp_values,
        &input_is_parallel_values,
        &sequence_parallel_values,
    );
    crate::common::each_case(
        "row_parallel_linear_matches_single_device",
        cases,
        |&(tp, input_is_parallel, sequence_parallel): &(usize, bool, bool)| {
            run(tp, |ctx| -> Result<()> {
                let (r, group) = (ctx.rank(), tp_group(ctx));
                let (inp, out) = (8, 6);
                let x = randn(11, &[SEQ, BATCH, inp]);
                let w = randn(12, &[out, inp]);
                let b = randn(13, &[out]);
                let probe = randn(14, &[SEQ, BATCH, out]);

                let (xr, wr, br) = (leaf(&x), leaf(&w), leaf(&b));
                let yr = xr.linear(&wr, Some(&br));
                (&yr * &probe).sum(Kind::Float).backward();

                let x_in = if input_is_parallel {
                    leaf(&part(&x, 2, r, tp))
                } else {
                    leaf(&x)
                };
                let ws = shard(&w, 1, r, tp)?;
                let bias = leaf(&b);
                let opts = RowOptions {
                    input_is_parallel,
                    sequence_parallel,
                    ..Default::default()
                };
                let y = row_parallel_linear(&x_in, &ws, Some(&bias), &group, opts)?;
                if sequence_parallel {
                    // This rank's positions; the loss is the sum of every rank's part, and the bias,
                    // added on every rank's own positions, has a partial gradient.
                    close("output", &y, &part(&yr, 0, r, tp))?;
                    (&y * part(&probe, 0, r, tp)).sum(Kind::Float).backward();
                    group.all_reduce(&grad(&bias), ReduceOp::Sum)?;
                } else {
                    close("output", &y, &yr)?;
                    (&y * &probe).sum(Kind::Float).backward();
                }
                let want_x = if input_is_parallel {
                    part(&xr.grad(), 2, r, tp)
                } else {
                    xr.grad()
                };
                close("input gradient", &grad(&x_in), &want_x)?;
                close(
                    "weight gradient",
                    &unshard(&grad(&ws), 1, &*group)?,
                    &wr.grad(),
                )?;
                close("bias gradient", &grad(&bias), &br.grad())?;
                Ok(())
            });
        },
    );
}

/// Megatron's MLP, column- then row-parallel. `planted` builds the column side with an
/// identity instead of `copy_to_parallel`, so the backward lacks its all-reduce.
fn mlp(ctx: &RankCtx, sequence_parallel: bool, planted: bool) -> Result<()> {
    let (r, tp, group) = (ctx.rank(), ctx.world_size(), tp_group(ctx));
    let (dim, hidden) = (6, 8);
    let x = randn(21, &[SEQ, BATCH, dim]);
    let w1 = randn(22, &[hidden, dim]);
    let b1 = randn(23, &[hidden]);
    let w2 = randn(24, &[dim, hidden]);
    let b2 = randn(25, &[dim]);
    let probe = randn(26, &[SEQ, BATCH, dim]);

    let (xr, w1r, w2r) = (leaf(&x), leaf(&w1), leaf(&w2));
    let yr = xr.linear(&w1r, Some(&b1)).tanh().linear(&w2r, Some(&b2));
    (&yr * &probe).sum(Kind::Float).backward();

    let x_in = if sequence_parallel {
        leaf(&part(&x, 0, r, tp))
    } else {
        leaf(&x)
    };
    let (w1s, b1s, w2s) = (
        shard(&w1, 0, r, tp)?,
        shard(&b1, 0, r, tp)?,
        shard(&w2, 1, r, tp)?,
    );
    let h = if planted {
        x_in.linear(&w1s, Some(&b1s))
    } else {
        let opts = ColumnOptions {
            gather_output: false,
            sequence_parallel,
            ..Default::default()
        };
        column_parallel_linear(&x_in, &w1s, Some(&b1s), &group, opts)?
    };
    let opts = RowOptions {
        input_is_parallel: true,
        sequence_parallel,
        ..Default::default()
    };
    let y = row_parallel_linear(&h.tanh(), &w2s, Some(&b2), &group, opts)?;
    let (want_y, want_x, probe) = if sequence_parallel {
        let p = part(&probe, 0, r, tp);
        (part(&yr, 0, r, tp), part(&xr.grad(), 0, r, tp), p)
    } else {
        (yr.shallow_clone(), xr.grad(), probe)
    };
    close("output", &y, &want_y)?;
    (&y * &probe).sum(Kind::Float).backward();
    close(
        "first weight gradient",
        &unshard(&grad(&w1s), 0, &*group)?,
        &w1r.grad(),
    )?;
    close(
        "second weight gradient",
        &unshard(&grad(&w2s), 1, &*group)?,
        &w2r.grad(),
    )?;
    close("input gradient", &grad(&x_in), &want_x)
}

/// The MLP matches the single device end to end.
#[test]
fn column_then_row_parallel_mlp_matches_single_device() {
    let tp_values: Vec<usize> = vec![1, 2, 4];
    let sequence_parallel_values: Vec<bool> = vec![false, true];
    let cases: Vec<(usize, bool)> = crate::common::product(&tp_values, &sequence_parallel_values);
    crate::common::each_case(
        "column_then_row_parallel_mlp_matches_single_device",
        cases,
        |&(tp, sequence_parallel): &(usize, bool)| {
            run(tp, |ctx| mlp(ctx, sequence_parallel, false));
        },
    );
}

/// A row-parallel pair whose backward misses its all-reduce computes the right output and
/// weight gradients, but wrong input gradients: the comparison catches it.
#[test]
fn missing_backward_all_reduce_is_caught() {
    let cases: Vec<usize> = vec![2, 4];
    crate::common::each_case(
        "missing_backward_all_reduce_is_caught",
        cases,
        |&tp: &usize| {
            run(tp, |ctx| -> Result<()> {
                match mlp(ctx, false, true) {
                    Ok(()) => bail!("the planted missing all-reduce went unnoticed"),
                    Err(e) => {
                        let msg = e.to_string();
                        ensure!(
                            msg.starts_with("input gradient"),
                            "expected only the input gradient to differ, got: {msg}"
                        );
                        Ok(())
                    }
                }
            });
        },
    );
}

/// The vocabulary-parallel embedding equals a full lookup, for ids in every rank's range,
/// and so does the full table's gradient.
#[test]
fn vocab_parallel_embedding_matches_single_device() {
    let cases: Vec<usize> = vec![1, 2, 4];
    crate::common::each_case(
        "vocab_parallel_embedding_matches_single_device",
        cases,
        |&tp: &usize| {
            run(tp, |ctx| -> Result<()> {
                let (r, group) = (ctx.rank(), tp_group(ctx));
                let (vocab, dim) = (16, 5);
                let w = randn(31, &[vocab, dim]);
                // Every id once, some twice (their gradients accumulate), in a scrambled order.
                let ids = Tensor::from_slice(&[
                    3i64, 15, 0, 8, 12, 7, 1, 9, 14, 4, 11, 2, 6, 13, 10, 5, 15, 0, 8, 8,
                ])
                .reshape([4, 5]);
                let probe = randn(32, &[4, 5, dim]);

                let wr = leaf(&w);
                let yr = Tensor::embedding(&wr, &ids, -1, false, false);
                (&yr * &probe).sum(Kind::Float).backward();

                let ws = shard(&w, 0, r, tp)?;
                let start = r as i64 * vocab / tp as i64;
                let y = vocab_parallel_embedding(&ids, &ws, start, &group)?;
                close("output", &y, &yr)?;
                (&y * &probe).sum(Kind::Float).backward();
                close(
                    "weight gradient",
                    &unshard(&grad(&ws), 0, &*group)?,
                    &wr.grad(),
                )
            });
        },
    );
}

/// The vocabulary-parallel cross-entropy equals libtorch's cross-entropy on the full logits
/// (mean and sum), and its gradient, scaled by an incoming gradient other than one, equals
/// the full logits' gradient on every rank's columns.
#[test]
fn vocab_parallel_cross_entropy_matches_single_device() {
    let tp_values: Vec<usize> = vec![1, 2, 4];
    let reduction_values: Vec<Reduction> = vec![Reduction::Mean, Reduction::Sum];
    let cases: Vec<(usize, Reduction)> = crate::common::product(&tp_values, &reduction_values);
    crate::common::each_case(
        "vocab_parallel_cross_entropy_matches_single_device",
        cases,
        |&(tp, reduction): &(usize, Reduction)| {
            run(tp, |ctx| -> Result<()> {
                let (r, group) = (ctx.rank(), tp_group(ctx));
                let (n, vocab) = (12, 16);
                let logits = randn(41, &[n, vocab]) * 3.0;
                // Targets in every rank's columns, the largest logit's column included.
                let target = Tensor::from_slice(&[0i64, 15, 4, 11, 7, 8, 3, 12, 1, 14, 5, 10]);
                let torch_reduction = match reduction {
                    Reduction::Mean => tch::Reduction::Mean,
                    Reduction::Sum => tch::Reduction::Sum,
                };

                let lr = leaf(&logits);
                let loss_r =
                    lr.cross_entropy_loss::<Tensor>(&target, None, torch_reduction, -100, 0.0);
                (&loss_r * 1.7).backward();

                let ls = leaf(&part(&logits, 1, r, tp));
                let start = r as i64 * vocab / tp as i64;
                let loss = vocab_parallel_cross_entropy(&ls, &target, start, &group, reduction)?;
                ensure!(
                    loss.dim() == 0,
                    "the loss is a scalar, got {:?}",
                    loss.size()
                );
                close("loss", &loss, &loss_r)?;
                (&loss * 1.7).backward();
                close("logits gradient", &grad(&ls), &part(&lr.grad(), 1, r, tp))
            });
        },
    );
}

/// Asserts one step's counts are exactly `want` (operation, calls, bytes) on `group`.
fn expect_counts(
    what: &str,
    got: CountMap,
    group: &str,
    want: &[(OpKind, u64, u64)],
) -> Result<()> {
    let want: CountMap = want
        .iter()
        .map(|&(op, calls, bytes)| {
            (
                (op.to_string(), group.to_owned()),
                CollectiveCount { calls, bytes },
            )
        })
        .collect();
    ensure!(got == want, "{what}: counted {got:?}, expected {want:?}");
    Ok(())
}

/// The counting group sees exactly the designed collectives: one all-reduce per row-parallel
/// forward (bytes = elements × 4) and per column-parallel backward, none extra; under SP one
/// all-gather and one reduce-scatter each way; three small all-reduces for the loss; and
/// blocking and asynchronous calls alike.
#[test]
fn counting_group_counts_exactly() {
    let cases: Vec<usize> = vec![2, 4];
    crate::common::each_case("counting_group_counts_exactly", cases, |&tp: &usize| {
        run(tp, |ctx| -> Result<()> {
            let r = ctx.rank();
            let counts = CollectiveCounts::new();
            let group: TpGroup = Arc::new(CountingGroup::new(ctx.group(), counts.clone()));
            let name = group.name().to_owned();
            let (dim, hidden) = (6, 8);
            let x = leaf(&randn(51, &[SEQ, BATCH, dim]));
            let w1 = shard(&randn(52, &[hidden, dim]), 0, r, tp)?;
            let w2 = shard(&randn(53, &[dim, hidden]), 1, r, tp)?;
            let out_bytes = (SEQ * BATCH * dim * 4) as u64;

            // Column-parallel forward: nothing. Row-parallel forward: one all-reduce.
            let h = column_parallel_linear(&x, &w1, None, &group, ColumnOptions::default())?;
            expect_counts("column forward", counts.take(), &name, &[])?;
            let row = RowOptions {
                input_is_parallel: true,
                sequence_parallel: false,
                ..Default::default()
            };
            let y = row_parallel_linear(&h, &w2, None, &group, row)?;
            expect_counts(
                "row forward",
                counts.take(),
                &name,
                &[(OpKind::AllReduce, 1, out_bytes)],
            )?;
            // Backward: the row side passes gradients through, the column side all-reduces.
            y.sum(Kind::Float).backward();
            expect_counts(
                "backward",
                counts.take(),
                &name,
                &[(OpKind::AllReduce, 1, out_bytes)],
            )?;

            // Sequence parallel: one all-gather in, one reduce-scatter out, and the reverse.
            let xs = leaf(&part(&randn(51, &[SEQ, BATCH, dim]), 0, r, tp));
            let sp_col = ColumnOptions {
                gather_output: false,
                sequence_parallel: true,
                ..Default::default()
            };
            let h = column_parallel_linear(&xs, &w1, None, &group, sp_col)?;
            let sp_row = RowOptions {
                input_is_parallel: true,
                sequence_parallel: true,
                ..Default::default()
            };
            let y = row_parallel_linear(&h, &w2, None, &group, sp_row)?;
            let shard_bytes = out_bytes / tp as u64;
            expect_counts(
                "sequence-parallel forward",
                counts.take(),
                &name,
                &[
                    (OpKind::AllGather, 1, shard_bytes),
                    (OpKind::ReduceScatter, 1, out_bytes),
                ],
            )?;
            y.sum(Kind::Float).backward();
            expect_counts(
                "sequence-parallel backward",
                counts.take(),
                &name,
                &[
                    (OpKind::AllGather, 1, shard_bytes),
                    (OpKind::ReduceScatter, 1, out_bytes),
                ],
            )?;

            // Embedding: one all-reduce forward, none backward. Loss: three all-reduces of [N]
            // forward, none backward.
            let table = shard(&randn(54, &[16, dim]), 0, r, tp)?;
            let ids = Tensor::from_slice(&[1i64, 5, 9, 13]);
            let e = vocab_parallel_embedding(&ids, &table, r as i64 * 16 / tp as i64, &group)?;
            expect_counts(
                "embedding forward",
                counts.take(),
                &name,
                &[(OpKind::AllReduce, 1, 4 * 6 * 4)],
            )?;
            e.sum(Kind::Float).backward();
            expect_counts("embedding backward", counts.take(), &name, &[])?;
            let logits = leaf(&randn(55, &[4, 16 / tp as i64]));
            let loss = vocab_parallel_cross_entropy(
                &logits,
                &Tensor::from_slice(&[0i64, 3, 7, 15]),
                r as i64 * 16 / tp as i64,
                &group,
                Reduction::Mean,
            )?;
            expect_counts(
                "loss forward",
                counts.take(),
                &name,
                &[(OpKind::AllReduce, 3, 3 * 4 * 4)],
            )?;
            loss.backward();
            expect_counts("loss backward", counts.take(), &name, &[])?;

            // Blocking and asynchronous forms count once each; a barrier carries no bytes.
            let t = Tensor::ones([10], (Kind::Float, Device::Cpu));
            group.all_reduce(&t, ReduceOp::Sum)?;
            group.all_reduce_async(&t, ReduceOp::Sum)?.wait()?;
            group.barrier()?;
            let before = counts.snapshot();
            expect_counts(
                "direct calls",
                counts.take(),
                &name,
                &[(OpKind::AllReduce, 2, 80), (OpKind::Barrier, 1, 0)],
            )?;
            ensure!(counts.take().is_empty(), "take() must reset the counts");
            ensure!(
                t.double_value(&[0]) == (tp * tp) as f64,
                "the wrapped group must still reduce"
            );

            // The tally goes into a run record as flat rows that survive JSON.
            let entries = CollectiveEntry::from_counts(before);
            ensure!(entries.len() == 2 && entries[0].op == "all_reduce" && entries[0].calls == 2);
            let mut record = RunRecord::start(spec(), false);
            record.collectives = Some(vec![entries]);
            let back: RunRecord = serde_json::from_str(&serde_json::to_string(&record)?)?;
            ensure!(back == record, "collectives must survive JSON");
            Ok(())
        });
    });
}

fn spec() -> RunSpec {
    RunSpec {
        model: "gpt".into(),
        config: "tp".into(),
        world_size: 2,
        backend: "cpu".into(),
        dtype: "fp32".into(),
        steps: 1,
        seed: 0,
    }
}

/// Reports written before collectives were counted still read, and records that count none
/// write no such field.
#[test]
fn records_without_collectives_still_read() -> Result<()> {
    let text = serde_json::to_string(&RunRecord::start(spec(), false))?;
    ensure!(
        !text.contains("collectives"),
        "an absent field must not be written: {text}"
    );
    let mut counted = RunRecord::start(spec(), false);
    counted.collectives = Some(vec![vec![]]);
    let mut old: serde_json::Value = serde_json::to_value(&counted)?;
    old.as_object_mut()
        .context("a record is a JSON object")?
        .remove("collectives")
        .context("a counted record writes the field")?;
    let back: RunRecord = serde_json::from_value(old)?;
    ensure!(back.collectives.is_none());
    Ok(())
}

fn expect_err<T>(what: &str, r: std::result::Result<T, TpLayerError>, want: &str) -> Result<()> {
    match r {
        Ok(_) => bail!("{what}: accepted"),
        Err(e) => {
            let msg = e.to_string();
            ensure!(
                msg.contains(want),
                "{what}: message `{msg}` does not contain `{want}`"
            );
            Ok(())
        }
    }
}

/// Sizes that do not split, and shards that do not fit their inputs, are refused with
/// messages naming the dimension and the sizes, before any rank communicates.
#[test]
fn bad_sizes_are_rejected() -> Result<()> {
    let t = Tensor::zeros([8, 4], (Kind::Float, Device::Cpu));
    expect_err(
        "shard 8 rows over 3",
        shard(&t, 0, 0, 3),
        "dimension 0 of size 8 does not divide by the tensor-parallel size 3",
    )?;
    expect_err(
        "shard 4 columns over 3",
        shard(&t, -1, 1, 3),
        "dimension 1 of size 4 does not divide by the tensor-parallel size 3",
    )?;
    expect_err("shard rank 2 of 2", shard(&t, 0, 2, 2), "rank 2")?;
    expect_err(
        "shard dim 2",
        shard(&t, 2, 0, 2),
        "dimension 2 does not exist",
    )?;
    let s = shard(&t, 1, 1, 2)?;
    ensure!(s.size() == [8, 2] && s.requires_grad() && s.is_leaf());
    Ok(())
}

/// Layers refuse shards that do not fit their inputs, and sequence-parallel outputs whose
/// sequence does not divide by the TP size, naming the shapes.
#[test]
fn bad_layer_shapes_are_rejected() {
    run(2, |ctx| -> Result<()> {
        let group = tp_group(ctx);
        let x = Tensor::zeros([3, 2, 6], (Kind::Float, Device::Cpu));
        let w = Tensor::zeros([4, 5], (Kind::Float, Device::Cpu));
        expect_err(
            "column shard of the wrong width",
            column_parallel_linear(&x, &w, None, &group, ColumnOptions::default()),
            "does not fit a weight shard of shape [4, 5] (last dimension must be 5)",
        )?;
        let b = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let w = Tensor::zeros([4, 6], (Kind::Float, Device::Cpu));
        expect_err(
            "column bias of the wrong size",
            column_parallel_linear(&x, &w, Some(&b), &group, ColumnOptions::default()),
            "must have shape [4], got [3]",
        )?;
        let w = Tensor::zeros([5, 4], (Kind::Float, Device::Cpu));
        expect_err(
            "row shard against a full input of the wrong width",
            row_parallel_linear(&x, &w, None, &group, RowOptions::default()),
            "last dimension must be 8, the full input features",
        )?;
        let w = Tensor::zeros([5, 3], (Kind::Float, Device::Cpu));
        let sp = RowOptions {
            input_is_parallel: false,
            sequence_parallel: true,
            ..Default::default()
        };
        expect_err(
            "sequence of 3 over 2 ranks",
            row_parallel_linear(&x, &w, None, &group, sp),
            "dimension 0 of size 3 does not divide by the tensor-parallel size 2",
        )?;
        let logits = Tensor::zeros([4, 8], (Kind::Float, Device::Cpu));
        expect_err(
            "target of the wrong length",
            vocab_parallel_cross_entropy(
                &logits,
                &Tensor::zeros([5], (Kind::Int64, Device::Cpu)),
                0,
                &group,
                Reduction::Sum,
            ),
            "shape [4], got Int64 of shape [5]",
        )?;
        expect_err(
            "float ids",
            vocab_parallel_embedding(&logits, &w, 0, &group),
            "ids must be integers",
        )?;
        Ok(())
    });
}
