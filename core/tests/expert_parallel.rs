//! Expert-parallel building blocks (`lockstep_core::expert_parallel`): the all-to-all and
//! all-gather dispatchers agree, sharded experts equal one process holding every expert on
//! every rank's tokens, dropping at capacity matches an independent one-process reference
//! with the same (per-rank) rule, one process is the zoo's dense layer (routing and combine
//! bit for bit), the EP-doubled expert gradient is caught, and bad sizes are errors naming
//! them.
//!
//! Objective everywhere: rank `r` backpropagates its own `L_r = Σ out_r ⊙ w_r + aux_r`; the
//! data-parallel objective is the mean over ranks, so dense (router) gradients are averaged
//! over the world and expert gradients follow `reduce_expert_grads` (sum over the
//! expert-data-parallel group, divide by the world size). The one-process references
//! backpropagate that mean directly.

use crate::common;

use lockstep_core::comm::{ProcessGroup, ReduceOp};
use lockstep_core::expert_parallel::{
    capacity, combine, ep_groups, expert_data_parallel_groups, keep_mask, load_balancing_loss,
    moe_forward, reduce_expert_grads, route, DispatchPlan, Dispatcher, EpGroup, ExpertParams,
    MoeConfig, MoeOutput,
};
use lockstep_harness::RankCtx;
use lockstep_models::seed::seeded;
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

const E: usize = 8;
const K: i64 = 2;
const D: i64 = 16;
const H: i64 = 32;
const AUX: f64 = 0.01;
/// The fp32 row of the tolerance table (`torch.testing.assert_close` defaults).
const RTOL: f64 = 1.3e-6;
const ATOL: f64 = 1e-5;

fn cfg(capacity_factor: Option<f64>) -> MoeConfig {
    MoeConfig {
        num_experts: E,
        top_k: K,
        capacity_factor,
        aux_loss_coef: AUX,
    }
}

fn leaf(t: Tensor) -> Tensor {
    t.detach().set_requires_grad(true)
}

/// The router and every expert, drawn from one seed (identical on every rank and for every
/// call, so a reference gets its own copy). Expert 7's router row is tiny so that, with the
/// skewed tokens below, no token at all chooses it.
fn params() -> (Tensor, Vec<ExpertParams>) {
    seeded(7, || {
        let r = |s: &[i64], scale: f64| Tensor::randn(s, (Kind::Float, Device::Cpu)) * scale;
        let router = r(&[E as i64, D], 1.0);
        let _ = router
            .get(E as i64 - 1)
            .f_mul_scalar_(0.05)
            .expect("scale row");
        let experts = (0..E)
            .map(|_| ExpertParams {
                w1: leaf(r(&[H, D], 0.25)),
                b1: leaf(r(&[H], 0.1)),
                w2: leaf(r(&[D, H], 0.2)),
                b2: leaf(r(&[D], 0.1)),
            })
            .collect();
        (leaf(router), experts)
    })
}

/// Tokens on rank `r`.
fn tokens_on(rank: usize) -> i64 {
    12 + 3 * rank as i64
}

/// Rank `r`'s tokens: noise pulled towards the router rows of experts `2r mod 7` and
/// `2r + 1 mod 7`, so each rank sends most choices to two experts and nothing to several.
fn tokens(rank: usize) -> Tensor {
    let (router, _) = params();
    let router = router.detach();
    let unit = |e: i64| {
        let row = router.get(e % 7);
        &row / row.norm()
    };
    let pull = (unit(2 * rank as i64) + unit(2 * rank as i64 + 1)) * 2.5;
    seeded(100 + rank as u64, || {
        Tensor::randn([tokens_on(rank), D], (Kind::Float, Device::Cpu)) * 0.6 + pull
    })
}

/// Rank `r`'s loss weights `w_r`.
fn loss_weights(rank: usize) -> Tensor {
    seeded(200 + rank as u64, || {
        Tensor::randn([tokens_on(rank), D], (Kind::Float, Device::Cpu))
    })
}

/// Every rank's tokens concatenated in rank order, and the row where each rank's begin.
fn all_tokens(world: usize) -> (Tensor, Vec<i64>) {
    let mut starts = vec![0];
    for r in 0..world {
        starts.push(starts[r] + tokens_on(r));
    }
    let xs: Vec<Tensor> = (0..world).map(tokens).collect();
    (Tensor::cat(&xs, 0), starts)
}

/// What one side of a comparison produced, seen from one rank.
#[derive(Debug)]
struct Seen {
    output: Tensor,
    aux: Tensor,
    kept: Tensor,
    dropped: usize,
    /// `∂(mean of all ranks' losses)/∂x` for this rank's tokens.
    x_grad: Tensor,
    router_grad: Tensor,
    /// Every expert's `[w1, b1, w2, b2]` gradient, in expert order.
    expert_grads: Vec<[Tensor; 4]>,
}

/// The expert-parallel layout of a run: this rank's ep and expert-data-parallel groups.
struct Layout {
    world: usize,
    ep: EpGroup,
    edp: EpGroup,
}

fn layout(ctx: &RankCtx, ep: usize) -> Layout {
    let world = ctx.world_size();
    let eps = ep_groups(world, ep).expect("ep groups");
    let edps = expert_data_parallel_groups(world, ep).expect("edp groups");
    let ep_group = ctx.world().new_groups(&eps, "ep").expect("ep group");
    let edp_group = ctx.world().new_groups(&edps, "edp").expect("edp group");
    Layout {
        world,
        ep: ep_group.expect("member of an ep group"),
        edp: edp_group.expect("member of an edp group"),
    }
}

/// How expert gradients are reduced after each rank's backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExpertReduction {
    /// The rule: sum over the expert-data-parallel group, divide by the world size.
    Rule,
    /// Planted bug: expert gradients treated like data-parallel ones over their replicas
    /// (averaged over the expert-data-parallel group, i.e. divided by `world / ep`), so each
    /// ep rank's tokens count `ep` times: EP 2 doubles them.
    CountedPerEpRank,
}

/// Gathers every expert's gradients over the ep group (rank order = expert order).
fn gather_expert_grads(local: &[ExpertParams], ep: &EpGroup) -> Vec<[Tensor; 4]> {
    let per = local.len() as i64;
    let ep_size = ep.size() as i64;
    let gathered: Vec<Tensor> = (0..4)
        .map(|p| {
            let mine = Tensor::stack(
                &local
                    .iter()
                    .map(|e| e.tensors()[p].grad())
                    .collect::<Vec<_>>(),
                0,
            )
            .contiguous();
            let mut shape = mine.size();
            shape[0] = per * ep_size;
            let all = Tensor::zeros(&shape, (Kind::Float, Device::Cpu));
            ep.all_gather(&all, &mine).expect("gather expert grads");
            all
        })
        .collect();
    (0..per * ep_size)
        .map(|e| std::array::from_fn(|p| gathered[p].get(e)))
        .collect()
}

/// This rank's side of an expert-parallel run of the layer.
fn run_ep(
    ctx: &RankCtx,
    l: &Layout,
    dispatcher: Dispatcher,
    capacity_factor: Option<f64>,
    reduction: ExpertReduction,
) -> Seen {
    let (router, all) = params();
    let per = E / l.ep.size();
    let first = l.ep.rank() * per;
    let local: Vec<ExpertParams> = all.into_iter().skip(first).take(per).collect();
    let x = leaf(tokens(ctx.rank()));
    let out = moe_forward(
        &x,
        &router,
        &local,
        &cfg(capacity_factor),
        Some(&l.ep),
        dispatcher,
    )
    .expect("moe_forward");
    let loss = (&out.output * loss_weights(ctx.rank())).sum(Kind::Float) + &out.aux_loss;
    loss.backward();
    match reduction {
        ExpertReduction::Rule => {
            reduce_expert_grads(&local, &l.edp, l.world).expect("reduce expert grads")
        }
        ExpertReduction::CountedPerEpRank => {
            for t in local.iter().flat_map(ExpertParams::tensors) {
                l.edp.all_reduce(&t.grad(), ReduceOp::Avg).expect("avg");
            }
        }
    }
    let router_grad = router.grad();
    ctx.group()
        .all_reduce(&router_grad, ReduceOp::Avg)
        .expect("router grad");
    Seen {
        output: out.output.detach(),
        aux: out.aux_loss.detach(),
        kept: out.kept,
        dropped: out.tokens_dropped,
        x_grad: x.grad() / l.world as f64,
        router_grad,
        expert_grads: gather_expert_grads(&local, &l.ep),
    }
}

/// One process holding every expert, on the concatenation of every rank's tokens,
/// backpropagating the mean of the ranks' losses; seen from `rank`.
/// The load-balancing loss is each rank's own (computed on its slice), as the ranks do.
fn run_one_process(rank: usize, world: usize) -> Seen {
    let (router, all) = params();
    let (x, starts) = all_tokens(world);
    let x = leaf(x);
    let out = moe_forward(
        &x,
        &router,
        &all,
        &MoeConfig {
            aux_loss_coef: 0.0,
            ..cfg(None)
        },
        None,
        Dispatcher::AllToAll,
    )
    .expect("one process");
    let weights = Tensor::cat(&(0..world).map(loss_weights).collect::<Vec<_>>(), 0);
    let mut aux = Tensor::zeros([], (Kind::Float, Device::Cpu));
    for r in 0..world {
        let slice = x.narrow(0, starts[r], starts[r + 1] - starts[r]);
        aux = aux
            .f_add(&(route(&slice, &router, K).expect("route").aux_loss * AUX))
            .expect("add");
    }
    let loss = ((&out.output * weights).sum(Kind::Float) + &aux) / world as f64;
    loss.backward();
    let own = |t: &Tensor| t.narrow(0, starts[rank], starts[rank + 1] - starts[rank]);
    let own_aux = route(&own(&x.detach()), &router.detach(), K)
        .expect("route")
        .aux_loss
        * AUX;
    Seen {
        output: own(&out.output.detach()),
        aux: own_aux,
        kept: own(&out.kept),
        dropped: 0,
        x_grad: own(&x.grad()),
        router_grad: router.grad(),
        expert_grads: all
            .iter()
            .map(|e| std::array::from_fn(|p| e.tensors()[p].grad()))
            .collect(),
    }
}

/// Largest `|a − b| − (atol + rtol·|b|)`: positive means outside the fp32 table.
fn excess(a: &Tensor, b: &Tensor) -> f64 {
    if a.numel() == 0 {
        return f64::NEG_INFINITY;
    }
    let bound = b.abs() * RTOL + ATOL;
    ((a - b).abs() - bound).max().double_value(&[])
}

fn assert_close(what: &str, a: &Tensor, b: &Tensor) {
    assert_eq!(a.size(), b.size(), "{what}: shapes differ");
    let over = excess(a, b);
    let worst = if a.numel() == 0 {
        0.0
    } else {
        (a - b).abs().max().double_value(&[])
    };
    assert!(
        over <= 0.0,
        "{what}: outside the fp32 table (max |diff| {worst:e})"
    );
}

fn same_bits(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && common::bits(a) == common::bits(b)
}

fn assert_bits(what: &str, a: &Tensor, b: &Tensor) {
    assert!(
        same_bits(a, b),
        "{what}: not bit for bit (max |diff| {:e})",
        (a - b).abs().max().double_value(&[])
    );
}

/// Compares everything but the drop count; `exact` demands equal bits.
fn compare(a: &Seen, b: &Seen, exact: bool) {
    let check = |what: &str, x: &Tensor, y: &Tensor| {
        if exact {
            assert_bits(what, x, y)
        } else {
            assert_close(what, x, y)
        }
    };
    assert!(a.kept.equal(&b.kept), "different choices kept");
    check("output", &a.output, &b.output);
    check("aux loss", &a.aux, &b.aux);
    check("input gradient", &a.x_grad, &b.x_grad);
    check("router gradient", &a.router_grad, &b.router_grad);
    assert_eq!(a.expert_grads.len(), b.expert_grads.len());
    for (e, (ga, gb)) in a.expert_grads.iter().zip(&b.expert_grads).enumerate() {
        for (p, name) in ["w1", "b1", "w2", "b2"].iter().enumerate() {
            check(&format!("expert {e} {name} gradient"), &ga[p], &gb[p]);
        }
    }
}

/// Choices each rank sends to each expert, `[world][E]`, gathered.
fn choice_counts(ctx: &RankCtx) -> Vec<Vec<i64>> {
    let (router, _) = params();
    let r = route(&tokens(ctx.rank()), &router, K).expect("route");
    let mine = r.experts.reshape([-1]).bincount::<Tensor>(None, E as i64);
    let all = Tensor::zeros([(ctx.world_size() * E) as i64], (Kind::Int64, Device::Cpu));
    ctx.group().all_gather(&all, &mine).expect("gather counts");
    let v: Vec<i64> = Vec::try_from(&all).expect("counts");
    v.chunks(E).map(<[i64]>::to_vec).collect()
}

/// The routing is as uneven as the tests need: some rank sends nothing to some expert, and
/// expert 7 gets no token at all (its gradients must still come back, as zeros).
fn assert_uneven(ctx: &RankCtx) {
    let counts = choice_counts(ctx);
    if ctx.world_size() > 1 {
        assert!(
            counts.iter().flatten().any(|&c| c == 0),
            "routing is not uneven: {counts:?}"
        );
    }
    assert!(
        counts.iter().all(|row| row[E - 1] == 0),
        "expert 7 is chosen: {counts:?}"
    );
}

/// The two dispatchers compute the same outputs and the same gradients (input, router, every
/// expert's parameters), with and without a capacity limit, on uneven routing and uneven
/// batch sizes. They agree bit for bit: each expert sees the same rows in the same order, and
/// every slot's result is written by exactly one rank.
#[test]
fn all_to_all_and_all_gather_agree() {
    let ep_values: Vec<usize> = vec![2, 4];
    let capacity_factor_values: Vec<Option<f64>> = vec![None, Some(1.0), Some(0.5)];
    let cases: Vec<(usize, Option<f64>)> =
        crate::common::product(&ep_values, &capacity_factor_values);
    crate::common::each_case(
        "all_to_all_and_all_gather_agree",
        cases,
        |&(ep, capacity_factor): &(usize, Option<f64>)| {
            common::run(ep, |ctx| {
                assert_uneven(ctx);
                let l = layout(ctx, ep);
                let a = run_ep(
                    ctx,
                    &l,
                    Dispatcher::AllToAll,
                    capacity_factor,
                    ExpertReduction::Rule,
                );
                let b = run_ep(
                    ctx,
                    &l,
                    Dispatcher::AllGather,
                    capacity_factor,
                    ExpertReduction::Rule,
                );
                assert_eq!(a.dropped, b.dropped);
                compare(&a, &b, true);
                if capacity_factor == Some(0.5) {
                    let dropped = Tensor::from_slice(&[a.dropped as i64]);
                    ctx.group()
                        .all_reduce(&dropped, ReduceOp::Sum)
                        .expect("sum");
                    assert!(dropped.int64_value(&[0]) > 0, "capacity 0.5 drops nothing");
                }
            });
        },
    );
}

/// With no capacity limit, the sharded layer (on `ep`-rank groups, `world / ep` replicas)
/// equals one process holding every expert on the concatenation of every rank's tokens.
/// When the ep group is the world, outputs agree bit for bit: each expert sees the same rows
/// in the same order as in the one process. With replicas (`ep < world`) an expert sees only
/// its ep group's rows, a smaller matrix product whose rows libtorch may round differently
/// (about 1 ulp), so outputs agree within the fp32 table. Gradients agree within the table
/// (the router's and the replicated experts' are summed over ranks in another order).
#[test]
fn sharded_experts_match_one_process_on_all_tokens() {
    let sizes = [(1, 1), (2, 2), (4, 4), (1, 2), (2, 4)];
    let dispatchers = [Dispatcher::AllToAll, Dispatcher::AllGather];
    common::each_case(
        "sharded_experts_match_one_process_on_all_tokens",
        common::product(&sizes, &dispatchers),
        |&((ep, world), dispatcher)| {
            common::run(world, |ctx| {
                assert_uneven(ctx);
                let l = layout(ctx, ep);
                let sharded = run_ep(ctx, &l, dispatcher, None, ExpertReduction::Rule);
                let one = run_one_process(ctx.rank(), world);
                assert_eq!(sharded.dropped, 0);
                if ep == world {
                    assert_bits("output", &sharded.output, &one.output);
                }
                for g in &sharded.expert_grads[E - 1] {
                    assert!(
                        g.abs().max().double_value(&[]) == 0.0,
                        "unchosen expert 7 has a nonzero gradient"
                    );
                }
                compare(&sharded, &one, false);
            });
        },
    );
}

/// The zoo's dense `Moe::forward` (models/src/zoo/gpt.rs), restated with per-choice keep
/// flags: every expert runs on every token, gates are scattered to `[N, E]` (zero where not
/// chosen or dropped) and added in expert order. Returns the output and the probabilities.
fn dense_reference(
    x: &Tensor,
    router: &Tensor,
    experts: &[ExpertParams],
    kept: Option<&Tensor>,
) -> (Tensor, Tensor, Tensor) {
    let probs = x.linear::<Tensor>(router, None).softmax(-1, None);
    let (top, idx) = probs.topk(K, -1, true, true);
    let top = &top / top.sum_dim_intlist(-1, true, None);
    let top = match kept {
        Some(k) => top.f_mul(&k.to_kind(Kind::Float)).expect("mask gates"),
        None => top,
    };
    let gates = probs.zeros_like().scatter(-1, &idx, &top);
    let mut out = x.zeros_like();
    for (e, expert) in experts.iter().enumerate() {
        let g = gates.narrow(-1, e as i64, 1);
        out = out
            .f_add(&expert.forward(x).expect("expert").f_mul(&g).expect("gate"))
            .expect("add");
    }
    (out, probs, idx)
}

/// Keep flags computed independently of the library: per rank's slice (capacity is local),
/// `ceil(factor · n · k / E)` slots per expert, first choices (token order) then second.
fn reference_keep(idx: &Tensor, starts: &[i64], factor: f64) -> Tensor {
    let choices: Vec<i64> = Vec::try_from(&idx.reshape([-1])).expect("choices");
    let k = K as usize;
    let mut kept = vec![false; choices.len()];
    for w in starts.windows(2) {
        let (lo, hi) = (w[0] as usize, w[1] as usize);
        let cap = (factor * ((hi - lo) * k) as f64 / E as f64).ceil() as usize;
        let mut used = [0usize; E];
        for c in 0..k {
            for t in lo..hi {
                let e = choices[t * k + c] as usize;
                if used[e] < cap {
                    used[e] += 1;
                    kept[t * k + c] = true;
                }
            }
        }
    }
    Tensor::from_slice(&kept).reshape(idx.size())
}

/// Dropping at capacity matches a one-process reference that applies the same rule on the
/// concatenation of every rank's tokens: capacity is counted per rank (each rank fills its
/// own slots per expert with its own tokens), so the reference applies it per rank's slice.
/// The reference is written independently (dense, zoo-style, its own keep loop): the same
/// choices are dropped, and outputs and gradients agree within the fp32 table.
#[test]
fn capacity_drops_match_one_process() {
    let ep_values: Vec<usize> = vec![1, 2, 4];
    let factor_values: Vec<f64> = vec![0.5, 1.0];
    let dispatcher_values: Vec<Dispatcher> = vec![Dispatcher::AllToAll, Dispatcher::AllGather];
    let cases: Vec<(usize, f64, Dispatcher)> =
        crate::common::product3(&ep_values, &factor_values, &dispatcher_values);
    crate::common::each_case(
        "capacity_drops_match_one_process",
        cases,
        |&(ep, factor, dispatcher): &(usize, f64, Dispatcher)| {
            common::run(ep, |ctx| {
                let l = layout(ctx, ep);
                let world = ep;
                let sharded = run_ep(ctx, &l, dispatcher, Some(factor), ExpertReduction::Rule);

                let (router, all) = params();
                let (x, starts) = all_tokens(world);
                let x = leaf(x);
                let probs_idx = dense_reference(&x.detach(), &router.detach(), &all, None).2;
                let kept = reference_keep(&probs_idx, &starts, factor);
                let (out, probs, idx) = dense_reference(&x, &router, &all, Some(&kept));
                let weights = Tensor::cat(&(0..world).map(loss_weights).collect::<Vec<_>>(), 0);
                let rank = ctx.rank();
                let mut aux = Tensor::zeros([], (Kind::Float, Device::Cpu));
                let mut own_aux = None;
                for r in 0..world {
                    let n = starts[r + 1] - starts[r];
                    let counts = idx
                        .narrow(0, starts[r], n)
                        .reshape([-1])
                        .bincount::<Tensor>(None, E as i64)
                        .to_kind(Kind::Float);
                    let f = counts / (n * K) as f64;
                    let p = probs.narrow(0, starts[r], n).mean_dim(0, false, None);
                    let aux_r = (f * p).sum(Kind::Float) * (E as f64 * AUX);
                    if r == rank {
                        own_aux = Some(aux_r.detach());
                    }
                    aux = aux.f_add(&aux_r).expect("add");
                }
                ((&out * weights).sum(Kind::Float) + &aux).backward();
                let own = |t: &Tensor| t.narrow(0, starts[rank], starts[rank + 1] - starts[rank]);
                let reference_dropped = own(&kept).logical_not().sum(Kind::Int64).int64_value(&[]);
                assert_eq!(sharded.dropped as i64, reference_dropped, "dropped counts");
                let reference = Seen {
                    output: own(&out.detach()),
                    aux: own_aux.expect("this rank's loss"),
                    kept: own(&kept),
                    dropped: reference_dropped as usize,
                    x_grad: own(&x.grad()) / world as f64,
                    router_grad: router.grad() / world as f64,
                    expert_grads: all
                        .iter()
                        .map(|e| std::array::from_fn(|p| e.tensors()[p].grad() / world as f64))
                        .collect(),
                };
                compare(&sharded, &reference, false);
                let total = Tensor::from_slice(&[sharded.dropped as i64]);
                ctx.group().all_reduce(&total, ReduceOp::Sum).expect("sum");
                if factor < 1.0 {
                    assert!(
                        total.int64_value(&[0]) > 0,
                        "capacity {factor} drops nothing"
                    );
                }
            });
        },
    );
}

/// One process holding every expert, with no capacity, is the zoo's dense layer on the zoo's
/// own `gpt_moe` parameters and shape (`[B, T, D]` flattened to `[N, D]`): routing (probs,
/// choices, gates) bit for bit, and so is the combine: fed the zoo's per-expert outputs (each
/// expert run on all N rows), it reproduces the zoo's output bit for bit. The layer itself
/// runs each expert on its routed rows only, and libtorch's CPU matrix product gives a row
/// different bits depending on how many rows are in the batch (about 1 ulp), so the layer's
/// output, and the gradients, agree within the fp32 table.
#[test]
fn one_process_is_the_zoo_dense_layer() {
    let model = lockstep_models::zoo::build("gpt_moe", 0, 0).expect("gpt_moe");
    let named = model.named_parameters();
    let p = |name: &str| {
        named
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.detach())
            .unwrap_or_else(|| panic!("no parameter {name}"))
    };
    let make = || {
        let router = leaf(p("layers.0.moe.router.weight"));
        let experts: Vec<ExpertParams> = (0..E)
            .map(|e| {
                let q = |s: &str| leaf(p(&format!("layers.0.moe.experts.{e}.{s}")));
                ExpertParams {
                    w1: q("w1.weight"),
                    b1: q("w1.bias"),
                    w2: q("w2.weight"),
                    b2: q("w2.bias"),
                }
            })
            .collect();
        (router, experts)
    };
    let input = seeded(11, || Tensor::randn([2, 8, D], (Kind::Float, Device::Cpu)));
    let weights = seeded(12, || Tensor::randn([2, 8, D], (Kind::Float, Device::Cpu)));

    let (router_a, experts_a) = make();
    let xa = leaf(input.shallow_clone());
    let (dense, probs, idx) = dense_reference(&xa, &router_a, &experts_a, None);
    (&dense * &weights).sum(Kind::Float).backward();

    let (router_b, experts_b) = make();
    let xb = leaf(input.shallow_clone());
    let flat = xb.reshape([-1, D]);
    let out: MoeOutput = moe_forward(
        &flat,
        &router_b,
        &experts_b,
        &MoeConfig {
            aux_loss_coef: 0.0,
            ..cfg(None)
        },
        None,
        Dispatcher::AllToAll,
    )
    .expect("moe_forward");
    let ours = out.output.reshape([2, 8, D]);
    (&ours * &weights).sum(Kind::Float).backward();

    let r = &out.routing;
    assert_bits("probs", &r.probs, &probs.reshape([-1, E as i64]));
    assert!(r.experts.equal(&idx.reshape([-1, K])), "choices differ");
    let top = probs.gather(-1, &idx, false);
    let zoo_gates = (&top / top.sum_dim_intlist(-1, true, None)).reshape([-1, K]);
    assert_bits("gates", &r.gates, &zoo_gates);

    // The combine, fed each kept choice's row of the zoo's all-rows expert output.
    let plan = DispatchPlan::new(&r.experts, &out.kept, E).expect("plan");
    let x2 = input.reshape([-1, D]);
    let mut rows = Vec::new();
    let mut start = 0;
    for (e, &count) in plan.per_expert().iter().enumerate() {
        let tokens = Tensor::from_slice(&plan.tokens()[start..start + count]);
        let all_rows = experts_a[e].forward(&x2).expect("expert");
        rows.push(all_rows.index_select(0, &tokens));
        start += count;
    }
    let combined = combine(&x2, &r.gates, &plan, &Tensor::cat(&rows, 0)).expect("combine");
    assert_bits(
        "combine of all-rows outputs",
        &combined,
        &dense.reshape([-1, D]),
    );

    assert_close("output", &ours, &dense);
    assert_close("input gradient", &xb.grad(), &xa.grad());
    assert_close("router gradient", &router_b.grad(), &router_a.grad());
    for (e, (a, b)) in experts_a.iter().zip(&experts_b).enumerate() {
        for (i, (ta, tb)) in a.tensors().iter().zip(b.tensors()).enumerate() {
            assert_close(&format!("expert {e} tensor {i}"), &tb.grad(), &ta.grad());
        }
    }
}

/// The planted bug is caught: expert gradients averaged over their replicas as if they were
/// data-parallel (each ep rank's tokens counted again, `ep` times too large: EP 2 doubles
/// them) differ from one process, while the rule's agree.
#[test]
fn expert_grads_reduced_over_ep_are_caught() {
    let cases: Vec<(usize, usize)> = vec![(2, 2), (2, 4)];
    crate::common::each_case(
        "expert_grads_reduced_over_ep_are_caught",
        cases,
        |&(ep, world): &(usize, usize)| {
            common::run(world, |ctx| {
                let l = layout(ctx, ep);
                let one = run_one_process(ctx.rank(), world);
                let right = run_ep(ctx, &l, Dispatcher::AllToAll, None, ExpertReduction::Rule);
                compare(&right, &one, false);
                let wrong = run_ep(
                    ctx,
                    &l,
                    Dispatcher::AllToAll,
                    None,
                    ExpertReduction::CountedPerEpRank,
                );
                let mut caught = false;
                for (gw, gr) in wrong.expert_grads.iter().zip(&right.expert_grads) {
                    for (w, r) in gw.iter().zip(gr) {
                        assert_bits("doubled gradient", w, &(r * ep as f64));
                    }
                }
                for (gw, go) in wrong.expert_grads.iter().zip(&one.expert_grads) {
                    for (w, o) in gw.iter().zip(go) {
                        caught |= excess(w, o) > 0.0;
                    }
                }
                assert!(
                    caught,
                    "expert gradients counted per ep rank were not caught"
                );
            });
        },
    );
}

/// A rank with no tokens still joins every collective (forward and backward) with both
/// dispatchers, and the other rank's result is unchanged.
#[test]
fn a_rank_without_tokens_still_joins() {
    let cases: Vec<Dispatcher> = vec![Dispatcher::AllToAll, Dispatcher::AllGather];
    crate::common::each_case(
        "a_rank_without_tokens_still_joins",
        cases,
        |&dispatcher: &Dispatcher| {
            common::run(2, |ctx| {
                let l = layout(ctx, 2);
                let (router, all) = params();
                let local: Vec<ExpertParams> =
                    all.into_iter().skip(ctx.rank() * 4).take(4).collect();
                let x = leaf(if ctx.rank() == 0 {
                    tokens(0)
                } else {
                    Tensor::zeros([0, D], (Kind::Float, Device::Cpu))
                });
                let out = moe_forward(&x, &router, &local, &cfg(None), Some(&l.ep), dispatcher)
                    .expect("moe_forward");
                (out.output.sum(Kind::Float) + &out.aux_loss).backward();
                reduce_expert_grads(&local, &l.edp, l.world).expect("reduce");
                assert!(x.grad().defined(), "the input has a gradient");
                assert_eq!(x.grad().size(), x.size());
                for t in local.iter().flat_map(ExpertParams::tensors) {
                    assert!(t.grad().defined(), "every expert has a gradient");
                }
                if ctx.rank() == 0 {
                    let (router, all) = params();
                    let one = moe_forward(&tokens(0), &router, &all, &cfg(None), None, dispatcher)
                        .expect("one process");
                    assert_bits("output", &out.output, &one.output);
                }
            });
        },
    );
}

/// Bad sizes are errors naming them, raised before any collective on every rank (the
/// closing barrier would report a mismatch if one rank had entered a collective).
#[test]
fn bad_sizes_are_errors_naming_them() {
    common::run(3, |ctx| {
        let group: Arc<dyn ProcessGroup> = ctx.group();
        let (router, all) = params();
        let x = tokens(0);
        for dispatcher in [Dispatcher::AllToAll, Dispatcher::AllGather] {
            let local: Vec<ExpertParams> = all.iter().take(2).map(clone_expert).collect();
            let e = moe_forward(&x, &router, &local, &cfg(None), Some(&group), dispatcher)
                .expect_err("8 experts over 3 ranks")
                .to_string();
            assert!(
                e.contains("8 experts do not divide over an expert-parallel group of 3"),
                "{e}"
            );
        }
        let too_many = MoeConfig {
            top_k: 9,
            ..cfg(None)
        };
        let e = moe_forward(&x, &router, &all, &too_many, None, Dispatcher::AllToAll)
            .expect_err("top_k 9")
            .to_string();
        assert!(e.contains("top_k 9 exceeds the 8 experts"), "{e}");
        let e = route(&x, &router, 9).expect_err("top_k 9").to_string();
        assert!(e.contains("top_k 9 exceeds the 8 experts"), "{e}");
        let e = moe_forward(
            &x,
            &router,
            &all[..7],
            &cfg(None),
            None,
            Dispatcher::AllToAll,
        )
        .expect_err("7 of 8 experts")
        .to_string();
        assert!(e.contains("holds 7 experts, the layout needs 8"), "{e}");
        let e = moe_forward(
            &x,
            &router,
            &all,
            &cfg(Some(-1.0)),
            None,
            Dispatcher::AllToAll,
        )
        .expect_err("negative capacity")
        .to_string();
        assert!(e.contains("capacity factor -1"), "{e}");
        let e = ep_groups(4, 3).expect_err("3 over 4").to_string();
        assert!(
            e.contains("expert-parallel size 3 does not divide world size 4"),
            "{e}"
        );
        let e = expert_data_parallel_groups(6, 4)
            .expect_err("4 over 6")
            .to_string();
        assert!(e.contains("size 4 does not divide world size 6"), "{e}");
        let e = route(&x, &router.narrow(1, 0, 5), 2)
            .expect_err("router of 5 features")
            .to_string();
        assert!(e.contains("[12, 16]") && e.contains("[8, 5]"), "{e}");
        group.barrier().expect("no rank is inside a collective");
    });
}

fn clone_expert(e: &ExpertParams) -> ExpertParams {
    ExpertParams {
        w1: e.w1.shallow_clone(),
        b1: e.b1.shallow_clone(),
        w2: e.w2.shallow_clone(),
        b2: e.b2.shallow_clone(),
    }
}

/// The rules in isolation: group layouts, the capacity formula, priority order (first
/// choices before second, token order), and the load-balancing loss at its extremes.
#[test]
fn groups_capacity_priority_and_aux_loss_rules() {
    assert_eq!(
        ep_groups(8, 2).expect("groups"),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        expert_data_parallel_groups(8, 2).expect("groups"),
        vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7]]
    );
    assert_eq!(
        expert_data_parallel_groups(4, 4).expect("groups"),
        vec![vec![0], vec![1], vec![2], vec![3]]
    );
    assert_eq!(capacity(None, 10, 2, 8).expect("none"), None);
    assert_eq!(capacity(Some(1.0), 10, 2, 8).expect("cap"), Some(3));
    assert_eq!(capacity(Some(1.0), 16, 2, 8).expect("cap"), Some(4));
    assert_eq!(capacity(Some(0.5), 12, 2, 8).expect("cap"), Some(2));

    // Capacity 2 of 3 experts; choices [first, second] per token: t0 [0, 1], t1 [0, 2],
    // t2 [0, 1], t3 [1, 0]. First choices in token order: t0 and t1 fill expert 0, t2's is
    // dropped, t3 takes expert 1. Second choices: t0 fills expert 1, t1 takes expert 2, t2
    // and t3 find theirs full. Token 3's first choice beats token 2's second (choice-major).
    let experts = Tensor::from_slice(&[0i64, 1, 0, 2, 0, 1, 1, 0]).reshape([4, 2]);
    let kept = keep_mask(&experts, 3, Some(2)).expect("mask");
    let kept: Vec<bool> = Vec::try_from(&kept.reshape([-1])).expect("flags");
    assert_eq!(kept, [true, true, true, true, false, false, true, false]);

    // Uniform routing: loss 1. Everything on expert 0 with probability 1: loss E.
    let probs = Tensor::full([4, 4], 0.25, (Kind::Float, Device::Cpu));
    let spread = Tensor::from_slice(&[0i64, 1, 2, 3, 1, 0, 3, 2]).reshape([4, 2]);
    let uniform = load_balancing_loss(&probs, &spread).expect("aux");
    assert!((uniform.double_value(&[]) - 1.0).abs() < 1e-7);
    let onehot = Tensor::from_slice(&[1f32, 0.0, 0.0, 0.0])
        .reshape([1, 4])
        .repeat([4, 1]);
    let skewed = load_balancing_loss(&onehot, &Tensor::zeros([4, 1], (Kind::Int64, Device::Cpu)))
        .expect("aux");
    assert!((skewed.double_value(&[]) - 4.0).abs() < 1e-7);
}
