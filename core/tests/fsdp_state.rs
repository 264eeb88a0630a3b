//! FSDP state dicts (full and sharded, saved as safetensors and loaded back bitwise),
//! gradient-norm clipping against the single-device reference, and gradient accumulation
//! under `no_sync` against DDP-style accumulation.

use lockstep_core::comm::ReduceOp;
use lockstep_core::fsdp::{Fsdp, FsdpError, FsdpOptions, ShardingStrategy, WrapPolicy};
use lockstep_core::record::RunSpec;
use lockstep_core::train::{train, Optimizer, OptimizerConfig, Sgd, StepHooks, TrainConfig};
use lockstep_harness::RankCtx;
use lockstep_models::{zoo, Model};
use std::path::PathBuf;
use tch::{Kind, Tensor};

fn opts(strategy: ShardingStrategy, wrap: WrapPolicy) -> FsdpOptions {
    FsdpOptions {
        strategy,
        wrap,
        ..FsdpOptions::default()
    }
}

/// A fresh directory every rank of this run agrees on (rank 0 picks the name).
fn scratch(ctx: &RankCtx, tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let id = Tensor::from_slice(&[i64::from(std::process::id()), i64::from(nanos)]);
    ctx.group().broadcast(&id, 0).expect("broadcast id");
    let dir = std::env::temp_dir().join(format!(
        "lockstep-fsdp-state-{tag}-{}-{}",
        id.int64_value(&[0]),
        id.int64_value(&[1])
    ));
    if ctx.rank() == 0 {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
    }
    ctx.group().barrier().expect("barrier");
    dir
}

/// A model of the run's seed (its batches derive from the seed) whose parameters are all
/// 0.25, so only a load can make them right.
fn scrambled(model: &str, rank: usize) -> Box<dyn Model> {
    let m = zoo::build(model, 0, rank).expect("model");
    tch::no_grad(|| {
        for (_, p) in m.named_parameters() {
            let _ = p.shallow_clone().fill_(0.25);
        }
    });
    m
}

fn zero_grads(m: &dyn Model) {
    for (_, p) in m.named_parameters() {
        p.shallow_clone().zero_grad();
    }
}

/// One training step through the hooks, on this rank's batch of step `step`.
fn step(ctx: &RankCtx, m: &dyn Model, fsdp: &mut Fsdp, opt: &mut dyn Optimizer, step: usize) {
    zero_grads(m);
    fsdp.before_forward(step).expect("unshard");
    let batch = m.input(ctx.rank(), step).expect("batch");
    m.loss_hooked(&batch, fsdp).expect("loss").backward();
    fsdp.sync_gradients(&[]).expect("reduce");
    assert!(fsdp.optimizer_step(opt, &[]).expect("step"));
}

fn assert_same(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    let names = |s: &[(String, Tensor)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(a), names(b), "{what}: keys");
    for ((n, x), (_, y)) in a.iter().zip(b) {
        assert!(x.equal(y), "{what}: `{n}` differs");
    }
}

/// Plain SGD (no momentum, so no optimizer state to checkpoint): a resumed run is the
/// uninterrupted run exactly.
fn sgd() -> Sgd {
    Sgd::new(0.01, 0.0)
}

/// Train 2 steps, save the full state on rank 0, load it into a fresh wrapper (another
/// layout and another initialization), train 2 more: bitwise the uninterrupted 4 steps.
#[test]
fn full_state_dict_round_trips_bitwise() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "full_state_dict_round_trips_bitwise",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let dir = scratch(ctx, "full");
                let layouts = [
                    (
                        opts(ShardingStrategy::FullShard, WrapPolicy::Root),
                        opts(ShardingStrategy::FullShard, WrapPolicy::Root),
                    ),
                    (
                        opts(ShardingStrategy::FullShard, WrapPolicy::PerLayer),
                        opts(ShardingStrategy::NoShard, WrapPolicy::Root),
                    ),
                ];
                for (i, (save_opts, load_opts)) in layouts.into_iter().enumerate() {
                    let what = format!("{model} {save_opts:?} -> {load_opts:?}");
                    let m = zoo::build(model, 0, ctx.rank()).expect("model");
                    let mut fsdp =
                        Fsdp::new(m.as_ref(), ctx.group(), save_opts.clone()).expect("fsdp");
                    let mut opt = sgd();
                    for s in 0..4 {
                        step(ctx, m.as_ref(), &mut fsdp, &mut opt, s);
                    }
                    let uninterrupted = fsdp.full_state_dict().expect("state");
                    drop(fsdp);

                    let m = zoo::build(model, 0, ctx.rank()).expect("model");
                    let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), save_opts).expect("fsdp");
                    let mut opt = sgd();
                    for s in 0..2 {
                        step(ctx, m.as_ref(), &mut fsdp, &mut opt, s);
                    }
                    let saved = fsdp.full_state_dict().expect("state");
                    // The gathered state is what the model holds once unsharded.
                    fsdp.unshard().expect("unshard");
                    let model_state: Vec<(String, Tensor)> = m
                        .named_parameters()
                        .into_iter()
                        .chain(m.named_buffers())
                        .collect();
                    assert_same(&saved, &model_state, &what);
                    let path = dir.join(format!("full{i}.safetensors"));
                    fsdp.save_full(&path).expect("save_full");
                    assert!(
                        path.exists(),
                        "every rank returns once rank 0 wrote the file"
                    );
                    drop(fsdp);

                    let fresh = scrambled(model, ctx.rank());
                    let mut loaded =
                        Fsdp::new(fresh.as_ref(), ctx.group(), load_opts).expect("fsdp");
                    assert!(!loaded.full_state_dict().expect("state")[0]
                        .1
                        .equal(&saved[0].1));
                    loaded.load_full(&path).expect("load_full");
                    assert_same(&loaded.full_state_dict().expect("state"), &saved, &what);
                    let mut opt = sgd();
                    for s in 2..4 {
                        step(ctx, fresh.as_ref(), &mut loaded, &mut opt, s);
                    }
                    assert_same(
                        &loaded.full_state_dict().expect("state"),
                        &uninterrupted,
                        &format!("{what}: resumed vs uninterrupted"),
                    );
                    // The file is a plain model state file too.
                    if ctx.rank() == 0 {
                        let mut plain = zoo::build(model, 2, 0).expect("model");
                        plain
                            .load(&path)
                            .expect("Model::load reads save_full's file");
                        let state: Vec<(String, Tensor)> = plain
                            .named_parameters()
                            .into_iter()
                            .chain(plain.named_buffers())
                            .collect();
                        assert_same(&state, &saved, &what);
                    }
                }
                ctx.group().barrier().expect("barrier");
                if ctx.rank() == 0 {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            });
        },
    );
}

/// Sharded checkpoints: one file per rank, metadata naming each parameter's range, loaded
/// back bitwise (rank-local experts included).
#[test]
fn sharded_state_dict_round_trips_bitwise() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "moe"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "sharded_state_dict_round_trips_bitwise",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let dir = scratch(ctx, "sharded");
                for (i, o) in [
                    opts(ShardingStrategy::FullShard, WrapPolicy::PerLayer),
                    opts(ShardingStrategy::ShardGradOp, WrapPolicy::Root),
                    opts(ShardingStrategy::NoShard, WrapPolicy::Root),
                ]
                .into_iter()
                .enumerate()
                {
                    let what = format!("{model} {o:?}");
                    let m = zoo::build(model, 0, ctx.rank()).expect("model");
                    let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), o.clone()).expect("fsdp");
                    let mut opt = sgd();
                    for s in 0..4 {
                        step(ctx, m.as_ref(), &mut fsdp, &mut opt, s);
                    }
                    let uninterrupted = fsdp.full_state_dict().expect("state");
                    drop(fsdp);

                    let m = zoo::build(model, 0, ctx.rank()).expect("model");
                    let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), o.clone()).expect("fsdp");
                    let mut opt = sgd();
                    for s in 0..2 {
                        step(ctx, m.as_ref(), &mut fsdp, &mut opt, s);
                    }
                    let saved = fsdp.full_state_dict().expect("state");
                    let sharded = fsdp.sharded_state_dict().expect("sharded");
                    // The metadata covers exactly the shard's unpadded elements, in order.
                    assert_eq!(sharded.layout.world_size, world);
                    assert_eq!(sharded.layout.rank, ctx.rank());
                    for (u, unit) in sharded.layout.units.iter().enumerate() {
                        let (key, shard) = &sharded.tensors[u];
                        assert_eq!(key, &unit.key);
                        assert_eq!(shard.numel() as i64, unit.shard_numel);
                        let mut next = 0;
                        for p in &unit.params {
                            if let Some((start, end, at)) = p.in_shard {
                                assert_eq!(at, next, "{what}: `{}` contiguous", p.name);
                                assert_eq!(p.flat_offset + start, unit.shard_offset + at);
                                next += end - start;
                            }
                        }
                        let real = (unit.numel - unit.shard_offset).clamp(0, unit.shard_numel);
                        assert_eq!(next, real, "{what}: unit {}", unit.unit);
                    }
                    let ckpt = dir.join(format!("ckpt{i}"));
                    fsdp.save_sharded(&ckpt).expect("save_sharded");
                    for r in 0..world {
                        assert!(ckpt.join(format!("rank{r}.safetensors")).exists());
                        assert!(ckpt.join(format!("rank{r}.json")).exists());
                    }
                    drop(fsdp);

                    let fresh = scrambled(model, ctx.rank());
                    let mut loaded = Fsdp::new(fresh.as_ref(), ctx.group(), o).expect("fsdp");
                    // Gathered before the load: the load must refresh the full parameters too.
                    loaded.unshard().expect("unshard");
                    let counts = loaded.collective_counts();
                    loaded.load_sharded(&ckpt).expect("load_sharded");
                    assert_eq!(
                        loaded.collective_counts(),
                        counts,
                        "checkpoint gathers not counted"
                    );
                    assert_same(&loaded.full_state_dict().expect("state"), &saved, &what);
                    let params: Vec<(String, Tensor)> = fresh.named_parameters();
                    assert_same(
                        &params,
                        &saved[..params.len()],
                        &format!("{what}: model refreshed"),
                    );
                    let mut opt = sgd();
                    for s in 2..4 {
                        step(ctx, fresh.as_ref(), &mut loaded, &mut opt, s);
                    }
                    assert_same(
                        &loaded.full_state_dict().expect("state"),
                        &uninterrupted,
                        &format!("{what}: resumed vs uninterrupted"),
                    );
                }
                ctx.group().barrier().expect("barrier");
                if ctx.rank() == 0 {
                    let _ = std::fs::remove_dir_all(&dir);
                }
            });
        },
    );
}

/// Missing, misshaped and unexpected keys, a foreign layout and a missing rank file: typed
/// errors naming the problem, on every rank, and nothing changed.
#[test]
fn bad_checkpoints_fail_clearly_and_change_nothing() {
    lockstep_harness::run(2, |ctx| {
        let dir = scratch(ctx, "bad");
        let m = zoo::build("transformer", 0, ctx.rank()).expect("model");
        let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), FsdpOptions::default()).expect("fsdp");
        let mut opt = sgd();
        step(ctx, m.as_ref(), &mut fsdp, &mut opt, 0);
        let before = fsdp.full_state_dict().expect("state");
        let shards_before = fsdp.local_shards().expect("shards");
        let victim = before[1].0.clone();

        let write = |name: &str, state: Vec<(String, Tensor)>| {
            let path = dir.join(name);
            if ctx.rank() == 0 {
                Tensor::write_safetensors(&state, &path).expect("write");
            }
            ctx.group().barrier().expect("barrier");
            path
        };
        let unchanged = |fsdp: &mut Fsdp| {
            assert_same(
                &fsdp.full_state_dict().expect("state"),
                &before,
                "unchanged",
            );
            for (a, b) in fsdp
                .local_shards()
                .expect("shards")
                .iter()
                .zip(&shards_before)
            {
                assert!(a.equal(b));
            }
        };

        let missing = write(
            "missing.safetensors",
            before
                .iter()
                .filter(|(n, _)| *n != victim)
                .map(|(n, t)| (n.clone(), t.copy()))
                .collect(),
        );
        match fsdp.load_full(&missing) {
            Err(FsdpError::StateMismatch {
                missing,
                misshaped,
                unexpected,
                ..
            }) => {
                assert_eq!(missing, vec![victim.clone()]);
                assert!(misshaped.is_empty() && unexpected.is_empty());
            }
            other => panic!("missing key: {other:?}"),
        }
        unchanged(&mut fsdp);

        let mut bad = before
            .iter()
            .map(|(n, t)| (n.clone(), t.copy()))
            .collect::<Vec<_>>();
        bad[1].1 = Tensor::zeros([3], (Kind::Float, tch::Device::Cpu));
        bad.push((
            "not.a.param".into(),
            Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
        ));
        let misshaped = write("misshaped.safetensors", bad);
        let err = fsdp.load_full(&misshaped).expect_err("misshaped");
        let text = err.to_string();
        assert!(
            text.contains(&victim) && text.contains("not.a.param"),
            "{text}"
        );
        match err {
            FsdpError::StateMismatch {
                misshaped,
                unexpected,
                ..
            } => {
                assert_eq!(misshaped.len(), 1);
                assert_eq!(misshaped[0].name, victim);
                assert_eq!(unexpected, vec!["not.a.param".to_string()]);
            }
            other => panic!("misshaped key: {other:?}"),
        }
        unchanged(&mut fsdp);

        // A sharded checkpoint of another layout.
        let per_layer = dir.join("per_layer");
        {
            let m2 = zoo::build("transformer", 0, ctx.rank()).expect("model");
            let other = Fsdp::new(
                m2.as_ref(),
                ctx.group(),
                opts(ShardingStrategy::FullShard, WrapPolicy::PerLayer),
            )
            .expect("fsdp");
            other.save_sharded(&per_layer).expect("save");
        }
        match fsdp.load_sharded(&per_layer) {
            Err(FsdpError::ShardLayout { reason, .. }) => {
                assert!(reason.contains("units"), "{reason}")
            }
            other => panic!("layout: {other:?}"),
        }
        unchanged(&mut fsdp);

        // Rank 1's file is missing: rank 1 names it, rank 0 learns a peer failed.
        let ckpt = dir.join("ckpt");
        fsdp.save_sharded(&ckpt).expect("save");
        ctx.group().barrier().expect("barrier");
        if ctx.rank() == 1 {
            std::fs::remove_file(ckpt.join("rank1.safetensors")).expect("rm");
        }
        ctx.group().barrier().expect("barrier");
        match (ctx.rank(), fsdp.load_sharded(&ckpt)) {
            (0, Err(FsdpError::PeerFailed(what))) => assert_eq!(what, "load_sharded"),
            (1, Err(FsdpError::Checkpoint { path, .. })) => {
                assert!(path.ends_with("rank1.safetensors"))
            }
            (r, other) => panic!("rank {r}: {other:?}"),
        }
        unchanged(&mut fsdp);
        ctx.group().barrier().expect("barrier");
        if ctx.rank() == 0 {
            let _ = std::fs::remove_dir_all(&dir);
        }
    });
}

/// One rank-0 reference: every rank's batch, mean loss, full gradients.
fn reference_grads(model: &str, world: usize, step: usize) -> Vec<(String, Tensor)> {
    let m = zoo::build(model, 0, 0).expect("model");
    let mut loss = m.loss(&m.input(0, step).expect("batch")).expect("loss");
    for r in 1..world {
        let other = m.loss(&m.input(r, step).expect("batch")).expect("loss");
        loss = loss.f_add(&other).expect("add");
    }
    (loss / world as f64).backward();
    m.named_parameters()
        .into_iter()
        .map(|(n, p)| (n, p.grad().copy()))
        .collect()
}

fn norm(grads: &[(String, Tensor)]) -> f64 {
    grads
        .iter()
        .map(|(_, g)| {
            g.to_kind(Kind::Double)
                .square()
                .sum(Kind::Double)
                .double_value(&[])
        })
        .sum::<f64>()
        .sqrt()
}

fn close(a: &Tensor, b: &Tensor) -> bool {
    a.allclose(b, 1e-5, 1e-7, false)
}

/// The total norm is the full model's gradient norm (tied parameters once), and clipping
/// scales every gradient as `clip_grad_norm_` does on the single-device reference.
#[test]
fn clip_grad_norm_matches_the_full_model() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "gpt"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "clip_grad_norm_matches_the_full_model",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                let reference = reference_grads(model, world, 0);
                let ref_norm = norm(&reference);
                for o in [
                    opts(ShardingStrategy::FullShard, WrapPolicy::PerLayer),
                    opts(ShardingStrategy::FullShard, WrapPolicy::Root),
                    opts(ShardingStrategy::NoShard, WrapPolicy::Root),
                ] {
                    for max_norm in [ref_norm * 0.5, ref_norm * 2.0] {
                        let what = format!("{model} {o:?} max {max_norm}");
                        let m = zoo::build(model, 0, ctx.rank()).expect("model");
                        let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), o.clone()).expect("fsdp");
                        zero_grads(m.as_ref());
                        fsdp.before_forward(0).expect("unshard");
                        m.loss_hooked(&m.input(ctx.rank(), 0).expect("batch"), &mut fsdp)
                            .expect("loss")
                            .backward();
                        fsdp.sync_gradients(&[]).expect("reduce");
                        let full: Vec<(String, Tensor)> = m
                            .named_parameters()
                            .into_iter()
                            .map(|(n, p)| (n, p.grad().copy()))
                            .collect();
                        let total = fsdp.clip_grad_norm(max_norm).expect("clip");
                        assert_eq!(fsdp.last_total_norm(), Some(total));
                        // Exactly the norm of the reduced full gradients, up to summation order.
                        let exact = norm(&full);
                        assert!(
                            (total - exact).abs() <= 1e-12 * exact,
                            "{what}: {total} vs {exact}"
                        );
                        assert!(
                            (total - ref_norm).abs() <= 1e-5 * ref_norm,
                            "{what}: {total} vs {ref_norm}"
                        );
                        let coef = (max_norm / (ref_norm + 1e-6)).min(1.0);
                        for ((n, g), (_, r)) in m.named_parameters().iter().zip(&reference) {
                            let g = g.grad();
                            assert!(close(&g, &(r * coef)), "{what}: clipped grad of `{n}`");
                        }
                        // The optimizer steps with the clipped shard gradients.
                        let mut opt = sgd();
                        fsdp.step(&mut opt).expect("step");
                        let state = fsdp.full_state_dict().expect("state");
                        let init = zoo::build(model, 0, 0).expect("model");
                        for ((n, p), (_, r)) in init.named_parameters().iter().zip(&reference) {
                            let expected = p - r * (0.01 * coef);
                            let got = &state.iter().find(|(k, _)| k == n).expect("param").1;
                            assert!(close(got, &expected), "{what}: stepped `{n}`");
                        }
                    }
                }
            });
        },
    );
}

/// Clipping inside `train` through the optimizer-step hook: the norm it clips with is the
/// norm the record reports.
#[test]
fn clipping_in_the_training_loop_uses_the_recorded_norm() {
    lockstep_harness::run(2, |ctx| {
        let m = zoo::build("mlp", 0, ctx.rank()).expect("model");
        let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), FsdpOptions::default()).expect("fsdp");
        fsdp.set_max_grad_norm(Some(1e-3));
        let cfg = TrainConfig {
            spec: RunSpec {
                model: "mlp".into(),
                config: "fsdp.clip".into(),
                world_size: 2,
                backend: "cpu".into(),
                dtype: "fp32".into(),
                steps: 3,
                seed: 0,
            },
            optimizer: OptimizerConfig::default(),
            data_ranks: vec![ctx.rank()],
            record_grads: false,
            probe: None,
        };
        let record = train(m.as_ref(), &cfg, &mut fsdp, Some(ctx.group().as_ref())).expect("run");
        let last = fsdp.last_total_norm().expect("clipped");
        let recorded = record.grad_norms[2];
        assert!(
            (last - recorded).abs() <= 1e-12 * recorded,
            "{last} vs {recorded}"
        );
    });
}

const MICRO: usize = 3;

/// `MICRO` micro-steps: the first `MICRO - 1` under `no_sync` issue no collective, the last
/// reduces the accumulated sums; bitwise what DDP-style accumulation (local sums, then one
/// all-reduce average per gradient) gives.
#[test]
fn no_sync_accumulates_like_ddp() {
    let model_values: Vec<&str> = vec!["nested", "transformer", "mlp", "moe"];
    let world_values: Vec<usize> = vec![2, 4];
    let cases: Vec<(&str, usize)> = crate::common::product(&model_values, &world_values);
    crate::common::each_case(
        "no_sync_accumulates_like_ddp",
        cases,
        |&(model, world): &(&str, usize)| {
            lockstep_harness::run(world, |ctx| {
                // Reference: accumulate locally, all-reduce (Avg) each shared gradient once.
                let r = zoo::build(model, 0, ctx.rank()).expect("model");
                let tags = r.tags();
                for k in 0..MICRO {
                    r.loss(&r.input(ctx.rank(), k).expect("batch"))
                        .expect("loss")
                        .backward();
                }
                let params = r.named_parameters();
                for (n, p) in &params {
                    if !tags.is_rank_local(n) {
                        ctx.group()
                            .all_reduce(&p.grad(), ReduceOp::Avg)
                            .expect("all-reduce");
                    }
                }
                let ref_grads: Vec<(String, Tensor)> = params
                    .iter()
                    .map(|(n, p)| (n.clone(), p.grad().copy()))
                    .collect();
                let mut opt = Sgd::new(0.01, 0.9);
                opt.step(&params).expect("step");
                let ref_state: Vec<(String, Tensor)> =
                    params.iter().map(|(n, p)| (n.clone(), p.copy())).collect();

                for o in [
                    opts(ShardingStrategy::FullShard, WrapPolicy::Root),
                    opts(ShardingStrategy::FullShard, WrapPolicy::PerLayer),
                    opts(ShardingStrategy::NoShard, WrapPolicy::Root),
                ] {
                    let what = format!("{model} {o:?}");
                    let m = zoo::build(model, 0, ctx.rank()).expect("model");
                    let mut fsdp = Fsdp::new(m.as_ref(), ctx.group(), o).expect("fsdp");
                    let mut opt = Sgd::new(0.01, 0.9);
                    zero_grads(m.as_ref());
                    fsdp.unshard().expect("unshard");
                    let before = fsdp.collective_counts();
                    fsdp.no_sync(|f| {
                        assert!(!f.requires_gradient_sync());
                        for k in 0..MICRO - 1 {
                            f.before_forward(k).expect("forward");
                            m.loss_hooked(&m.input(ctx.rank(), k).expect("batch"), f)
                                .expect("loss")
                                .backward();
                            f.sync_gradients(&[]).expect("no sync");
                        }
                        assert!(
                            f.optimizer_step(&mut opt, &[]).is_err(),
                            "{what}: step refused"
                        );
                    });
                    assert!(fsdp.requires_gradient_sync());
                    assert_eq!(
                        fsdp.collective_counts(),
                        before,
                        "{what}: no collective in no_sync"
                    );
                    fsdp.before_forward(MICRO - 1).expect("forward");
                    m.loss_hooked(&m.input(ctx.rank(), MICRO - 1).expect("batch"), &mut fsdp)
                        .expect("loss")
                        .backward();
                    fsdp.sync_gradients(&[]).expect("reduce");
                    let c = fsdp.collective_counts();
                    assert!(c.grad_reduce_scatters + c.grad_all_reduces > 0);
                    let grads: Vec<(String, Tensor)> = m
                        .named_parameters()
                        .into_iter()
                        .map(|(n, p)| (n, p.grad().copy()))
                        .collect();
                    assert_same(&grads, &ref_grads, &format!("{what}: accumulated grads"));
                    assert!(fsdp.optimizer_step(&mut opt, &[]).expect("step"));
                    let state = fsdp.full_state_dict().expect("state");
                    assert_same(
                        &state[..ref_state.len()],
                        &ref_state,
                        &format!("{what}: params"),
                    );
                }
            });
        },
    );
}
