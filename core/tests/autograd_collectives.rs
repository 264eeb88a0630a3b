//! Differentiable collectives on world sizes 1–4: forward equals the single-process
//! computation, the gradient equals the single-process gradient of the same math (fp64), and
//! a central finite difference of the parallel objective matches the analytic gradient.

use lockstep_core::autograd::{collectives as c, engine, AutogradError};
use lockstep_core::comm::{ProcessGroup, ReduceOp};
use std::sync::Arc;
use tch::{Device, Kind, Tensor};

type Group = Arc<dyn ProcessGroup>;
const TOL: f64 = 1e-12;

fn data(seed: i64, shape: &[i64]) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Double, Device::Cpu))
}

fn leaf(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let err = (got - want).abs().max().double_value(&[]);
    let scale = want.abs().max().double_value(&[]).max(1.0);
    assert!(
        err <= tol * scale,
        "{what}: max abs error {err:e} (tolerance {:e})\n got {got}\nwant {want}",
        tol * scale
    );
}

/// One differentiable collective under test, described by its single-process math.
struct Case {
    /// Whether every rank holds the same input (then its gradient is the full one).
    replicated_input: bool,
    /// Whether the loss is the same on every rank (counted once) or a per-rank term (summed).
    replicated_loss: bool,
    /// Rank `r`'s input at world size `w`.
    input: fn(usize, usize) -> Tensor,
    /// The collective.
    parallel: fn(&Tensor, &Group) -> Result<Tensor, AutogradError>,
    /// Rank `r`'s loss from its output.
    local_loss: fn(&Tensor, usize, usize) -> Tensor,
    /// Every rank's output computed in one process from every rank's input.
    reference: fn(&[Tensor], usize) -> Vec<Tensor>,
}

fn weights(seed: i64, y: &Tensor) -> Tensor {
    data(seed, &y.size())
}

/// Per-rank loss with rank-specific weights: a nonlinear, rank-dependent function of `y`.
fn rank_loss(y: &Tensor, r: usize, _w: usize) -> Tensor {
    (y.tanh() * weights(1000 + r as i64, y)).sum(Kind::Double)
}

/// Replicated loss: the same function on every rank.
fn shared_loss(y: &Tensor, _r: usize, _w: usize) -> Tensor {
    (y.tanh() * weights(999, y)).sum(Kind::Double)
}

fn check(case: &Case, group: &Group) -> Result<(), AutogradError> {
    let (r, w) = (group.rank(), group.size());
    let x = leaf(&(case.input)(r, w));
    let y = (case.parallel)(&x, group)?;
    let loss = (case.local_loss)(&y, r, w);
    engine::backward(&[&loss], &[None], false)?;
    let got_grad = x.grad();

    // Single-process reference.
    let xs: Vec<Tensor> = if case.replicated_input {
        vec![leaf(&(case.input)(0, w))]
    } else {
        (0..w).map(|k| leaf(&(case.input)(k, w))).collect()
    };
    let ys = (case.reference)(&xs, w);
    let total = if case.replicated_loss {
        (case.local_loss)(&ys[0], 0, w)
    } else {
        (0..w)
            .map(|k| (case.local_loss)(&ys[k], k, w))
            .fold(Tensor::zeros([], (Kind::Double, Device::Cpu)), |a, b| a + b)
    };
    total.backward();
    assert_close("forward", &y, &ys[r], TOL);
    let mine = if case.replicated_input { 0 } else { r };
    assert_close("gradient", &got_grad, &xs[mine].grad(), TOL);

    finite_difference(case, group, &x, &got_grad)
}

/// Central differences of the parallel objective (sum of per-rank losses, or the replicated
/// loss once) at three elements of each owner's input.
fn finite_difference(
    case: &Case,
    group: &Group,
    x: &Tensor,
    grad: &Tensor,
) -> Result<(), AutogradError> {
    let (r, w) = (group.rank(), group.size());
    let h = 1e-6;
    let objective = |xp: &Tensor| -> Result<f64, AutogradError> {
        let _g = tch::no_grad_guard();
        let y = (case.parallel)(xp, group)?;
        let l = (case.local_loss)(&y, r, w).reshape([1]).copy();
        if !case.replicated_loss {
            group.all_reduce(&l, ReduceOp::Sum)?;
        }
        Ok(l.double_value(&[0]))
    };
    let owners: Vec<Option<usize>> = if case.replicated_input {
        vec![None]
    } else {
        (0..w).map(Some).collect()
    };
    let n = x.numel() as i64;
    for owner in owners {
        let mine = owner.is_none_or(|o| o == r);
        for idx in [0, n / 2, n - 1] {
            let shifted = |delta: f64| {
                let xp = x.detach().copy();
                if mine {
                    let _ = xp.view([-1]).get(idx).f_add_scalar_(delta);
                }
                xp
            };
            let jp = objective(&shifted(h))?;
            let jm = objective(&shifted(-h))?;
            if mine {
                let fd = (jp - jm) / (2.0 * h);
                let g = grad.view([-1]).double_value(&[idx]);
                assert!(
                    (fd - g).abs() <= 1e-6 * g.abs().max(1.0),
                    "finite difference at {idx}: {fd} vs {g}"
                );
            }
        }
    }
    Ok(())
}

fn run(world: usize, case: Case) {
    lockstep_harness::Run::new(world)
        .timeout(std::time::Duration::from_secs(60))
        .run(move |ctx| check(&case, &ctx.group()));
}

fn chunk(t: &Tensor, dim: i64, k: usize, w: usize) -> Tensor {
    let d = if dim < 0 { t.dim() - 1 } else { dim as usize };
    let len = t.size()[d] / w as i64;
    t.narrow(dim, k as i64 * len, len)
}

#[test]
fn copy_to_parallel() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("copy_to_parallel", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: true,
                replicated_loss: false,
                input: |_, _| data(1, &[3, 4]),
                parallel: |x, g| c::copy_to_parallel(x, g),
                local_loss: rank_loss,
                reference: |xs, w| (0..w).map(|_| xs[0].shallow_clone()).collect(),
            },
        );
    });
}

#[test]
fn reduce_from_parallel() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("reduce_from_parallel", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: false,
                replicated_loss: true,
                input: |r, _| data(10 + r as i64, &[3, 4]),
                parallel: |x, g| c::reduce_from_parallel(x, g),
                local_loss: shared_loss,
                reference: |xs, w| {
                    let s = xs.iter().skip(1).fold(xs[0].shallow_clone(), |a, b| a + b);
                    (0..w).map(|_| s.shallow_clone()).collect()
                },
            },
        );
    });
}

#[test]
fn scatter_to_parallel() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("scatter_to_parallel", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: true,
                replicated_loss: false,
                input: |_, w| data(2, &[2, 3, 2 * w as i64]),
                parallel: |x, g| c::scatter_to_parallel(x, g),
                local_loss: rank_loss,
                reference: |xs, w| (0..w).map(|k| chunk(&xs[0], -1, k, w)).collect(),
            },
        );
    });
}

#[test]
fn gather_from_parallel() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("gather_from_parallel", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: false,
                replicated_loss: true,
                input: |r, _| data(20 + r as i64, &[2, 3, 2]),
                parallel: |x, g| c::gather_from_parallel(x, g),
                local_loss: shared_loss,
                reference: |xs, w| {
                    let full = Tensor::cat(xs, -1);
                    (0..w).map(|_| full.shallow_clone()).collect()
                },
            },
        );
    });
}

#[test]
fn scatter_to_sequence_parallel() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("scatter_to_sequence_parallel", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: true,
                replicated_loss: false,
                input: |_, w| data(3, &[2 * w as i64, 3]),
                parallel: |x, g| c::scatter_to_sequence_parallel(x, g),
                local_loss: rank_loss,
                reference: |xs, w| (0..w).map(|k| chunk(&xs[0], 0, k, w)).collect(),
            },
        );
    });
}

#[test]
fn all_gather_sequence() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_gather_sequence", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: false,
                replicated_loss: false,
                input: |r, _| data(30 + r as i64, &[2, 3]),
                parallel: |x, g| c::all_gather_sequence(x, g),
                local_loss: rank_loss,
                reference: |xs, w| {
                    let full = Tensor::cat(xs, 0);
                    (0..w).map(|_| full.shallow_clone()).collect()
                },
            },
        );
    });
}

#[test]
fn reduce_scatter_sequence() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("reduce_scatter_sequence", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: false,
                replicated_loss: false,
                input: |r, w| data(40 + r as i64, &[2 * w as i64, 3]),
                parallel: |x, g| c::reduce_scatter_sequence(x, g),
                local_loss: rank_loss,
                reference: |xs, w| {
                    let s = xs.iter().skip(1).fold(xs[0].shallow_clone(), |a, b| a + b);
                    (0..w).map(|k| chunk(&s, 0, k, w)).collect()
                },
            },
        );
    });
}

/// Rows rank `src` sends to rank `dst`: uneven, sometimes zero.
fn rows(src: usize, dst: usize) -> usize {
    (src + 2 * dst + 1) % 4
}

#[test]
fn all_to_all() {
    let cases: Vec<usize> = vec![1, 2, 3, 4];
    crate::common::each_case("all_to_all", cases, |&world: &usize| {
        run(
            world,
            Case {
                replicated_input: false,
                replicated_loss: false,
                input: |r, w| {
                    data(
                        50 + r as i64,
                        &[(0..w).map(|j| rows(r, j)).sum::<usize>() as i64, 2],
                    )
                },
                parallel: |x, g| {
                    let (r, w) = (g.rank(), g.size());
                    let input: Vec<usize> = (0..w).map(|j| rows(r, j)).collect();
                    let output: Vec<usize> = (0..w).map(|j| rows(j, r)).collect();
                    c::all_to_all(x, g, &output, &input)
                },
                local_loss: rank_loss,
                reference: |xs, w| {
                    (0..w)
                        .map(|dst| {
                            let parts: Vec<Tensor> = (0..w)
                                .map(|src| {
                                    let start: usize = (0..dst).map(|j| rows(src, j)).sum();
                                    xs[src].narrow(0, start as i64, rows(src, dst) as i64)
                                })
                                .collect();
                            Tensor::cat(&parts, 0)
                        })
                        .collect()
                },
            },
        );
    });
}
