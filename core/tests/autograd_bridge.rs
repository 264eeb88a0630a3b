//! The autograd bridge on one process: custom functions, hooks, explicit-gradient backward,
//! storage free/refill, drop-exactly-once on every path, panics as errors, and no leaks.

use lockstep_core::autograd::{
    self as ag, apply, apply_reentrant, engine, hooks, storage, AutogradError, GradOptions, Stage,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tch::{Device, Kind, Tensor};

/// Deterministic pseudo-random data that does not touch the global RNG (tests run in
/// parallel threads, and reseeding a shared generator would race).
fn randn(seed: i64, shape: &[i64]) -> Tensor {
    let n: i64 = shape.iter().product();
    let idx = Tensor::arange(n, (Kind::Double, Device::Cpu));
    ((idx * 0.731 + seed as f64 * 1.37).sin() * 1.9).reshape(shape)
}

fn leaf(seed: i64, shape: &[i64]) -> Tensor {
    randn(seed, shape).set_requires_grad(true)
}

fn assert_close(got: &Tensor, want: &Tensor) {
    let err = (got - want).abs().max().double_value(&[]);
    assert!(
        err <= 1e-12,
        "max abs error {err:e}\n got {got}\nwant {want}"
    );
}

fn sum(t: &Tensor) -> Tensor {
    t.sum(Kind::Double)
}

/// Counts drops of the value it is captured in.
struct DropCounter(Arc<AtomicUsize>);
impl Drop for DropCounter {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn counter() -> (Arc<AtomicUsize>, DropCounter) {
    let n = Arc::new(AtomicUsize::new(0));
    (n.clone(), DropCounter(n))
}

fn identity(
    x: &Tensor,
    backward: impl FnOnce(Option<Tensor>) -> Option<Tensor> + Send + 'static,
) -> Tensor {
    let mut out = apply(
        &[x],
        |_ctx, xs| Ok(vec![xs[0].shallow_clone()]),
        move |_ctx, mut grads| Ok(vec![backward(grads.remove(0))]),
    )
    .expect("apply");
    out.remove(0)
}

#[test]
fn identity_forward_three_backwards() {
    // Pass-through, scaled, and no gradient at all.
    let x = leaf(0, &[4]);
    let y = identity(&x, |g| g);
    assert_close(&y, &x);
    engine::backward(&[&sum(&(&y * 2.0))], &[None], false).unwrap();
    assert_close(
        &x.grad(),
        &Tensor::full([4], 2.0, (Kind::Double, Device::Cpu)),
    );

    let x = leaf(0, &[4]);
    let y = identity(&x, |g| g.map(|g| g * 3.0));
    engine::backward(&[&sum(&y)], &[None], false).unwrap();
    assert_close(
        &x.grad(),
        &Tensor::full([4], 3.0, (Kind::Double, Device::Cpu)),
    );

    let x = leaf(0, &[4]);
    let w = leaf(1, &[4]);
    let y = identity(&x, |_| None);
    engine::backward(&[&sum(&(&y * &w))], &[None], false).unwrap();
    assert!(!x.grad().defined(), "no gradient must reach x");
    assert_close(&w.grad(), &x.detach());
}

/// y = t², t = x·w, with a custom square inside a larger graph; two outputs, one of them not
/// differentiable.
fn custom_square_and_argmax(t: &Tensor) -> (Tensor, Tensor) {
    let mut out = apply(
        &[t],
        |ctx, xs| {
            ctx.save_for_backward(&[xs[0]]);
            let sq = xs[0] * xs[0];
            let idx = xs[0].argmax(None, false);
            ctx.mark_non_differentiable(1);
            Ok(vec![sq, idx])
        },
        |ctx, grads| {
            let t = &ctx.saved()[0];
            assert!(
                grads[1].is_none()
                    || grads[1]
                        .as_ref()
                        .is_some_and(|g| g.sum(Kind::Double).double_value(&[]) == 0.0)
            );
            Ok(vec![grads[0].as_ref().map(|g| g * t * 2.0)])
        },
    )
    .unwrap();
    let idx = out.pop().unwrap();
    (out.pop().unwrap(), idx)
}

#[test]
fn custom_op_inside_a_graph_matches_plain_tch() {
    let (x, w) = (leaf(2, &[3, 5]), leaf(3, &[3, 5]));
    let t = &x * &w;
    let (y, idx) = custom_square_and_argmax(&t);
    assert!(!idx.requires_grad());
    assert_eq!(idx.kind(), Kind::Int64);
    let loss = sum(&(y.sin() + &x * 0.5));
    engine::backward(&[&loss], &[None], false).unwrap();

    let (xr, wr) = (leaf(2, &[3, 5]), leaf(3, &[3, 5]));
    let tr = &xr * &wr;
    let lr = sum(&((&tr * &tr).sin() + &xr * 0.5));
    lr.backward();
    assert_close(&x.grad(), &xr.grad());
    assert_close(&w.grad(), &wr.grad());
}

#[test]
fn several_inputs_outputs_and_none_gradients() {
    let (a, b) = (leaf(4, &[3]), leaf(5, &[3]));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let out = apply(
        &[&a, &b],
        |ctx, xs| {
            ctx.set_materialize_grads(false);
            ctx.save_for_backward(&[xs[0], xs[1]]);
            Ok(vec![xs[0] * xs[1], xs[0] + xs[1]])
        },
        move |ctx, grads| {
            seen2
                .lock()
                .unwrap()
                .extend(grads.iter().map(Option::is_some));
            assert!(ctx.needs_input_grad(0) && ctx.needs_input_grad(1));
            let (a, b) = (&ctx.saved()[0], &ctx.saved()[1]);
            let g = grads[0].as_ref().unwrap();
            Ok(vec![Some(g * b), Some(g * a)])
        },
    )
    .unwrap();
    // Only the product is used: the sum's gradient is undefined.
    engine::backward(&[&sum(&out[0])], &[None], false).unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![true, false]);
    assert_close(&a.grad(), &b.detach());
    assert_close(&b.grad(), &a.detach());
}

#[test]
fn wrong_gradient_count_is_an_error() {
    let x = leaf(6, &[2]);
    let y = apply(
        &[&x],
        |_c, xs| Ok(vec![xs[0] * 2.0]),
        |_c, _g| Ok(vec![None, None]),
    )
    .unwrap();
    let err = engine::backward(&[&sum(&y[0])], &[None], false).unwrap_err();
    assert!(
        matches!(
            err,
            AutogradError::Arity {
                expected: 1,
                got: 2,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn hooks_observe_and_replace() {
    // Observe on a non-leaf, replace on a leaf.
    let x = leaf(7, &[4]);
    let h = &x * 3.0;
    let observed = Arc::new(Mutex::new(None));
    let obs = observed.clone();
    let _keep = hooks::register_hook(&h, move |g| {
        *obs.lock().unwrap() = Some(g.copy());
        Ok(None)
    })
    .unwrap();
    let doubler = hooks::register_hook(&x, |g| Ok(Some(g * 2.0))).unwrap();
    let w = randn(8, &[4]);
    engine::backward(&[&sum(&(&h * &w))], &[None], false).unwrap();
    assert_close(observed.lock().unwrap().as_ref().unwrap(), &w);
    assert_close(&x.grad(), &(&w * 6.0));

    // Removed: the next backward accumulates the plain gradient.
    assert!(doubler.remove().unwrap());
    let _ = x.grad().zero_();
    engine::backward(&[&sum(&(&x * &w))], &[None], false).unwrap();
    assert_close(&x.grad(), &w);
}

#[test]
fn hook_removal_after_the_tensor_died() {
    let (n, guard) = counter();
    let handle = {
        let x = leaf(9, &[2]);
        hooks::register_hook(&x, move |_| {
            let _ = &guard;
            Ok(None)
        })
        .unwrap()
    };
    assert_eq!(n.load(Ordering::SeqCst), 1, "hook dropped with its tensor");
    assert!(!handle.remove().unwrap());
}

#[test]
fn post_accumulate_grad_hook_sees_the_complete_gradient() {
    let x = leaf(10, &[3]);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let (n, guard) = counter();
    let handle = hooks::register_post_accumulate_grad_hook(&x, move |p| {
        let _ = &guard;
        s.lock().unwrap().push(p.grad().copy());
        // FSDP-style: consume the gradient and clear it.
        ag::set_grad(p, None)
    })
    .unwrap();
    // x is used twice: the hook must fire once, after both contributions (2 + 3).
    engine::backward(&[&sum(&(&x * 2.0 + &x * 3.0))], &[None], false).unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_close(
        &seen.lock().unwrap()[0],
        &Tensor::full([3], 5.0, (Kind::Double, Device::Cpu)),
    );
    assert!(!x.grad().defined(), "the hook cleared .grad");
    // Non-leaves are refused.
    let err = hooks::register_post_accumulate_grad_hook(&(&x * 1.0), |_| Ok(())).unwrap_err();
    assert!(matches!(err, AutogradError::Torch(_)), "{err}");
    assert!(handle.remove().unwrap());
    assert_eq!(n.load(Ordering::SeqCst), 1, "removed hook dropped once");
    engine::backward(&[&sum(&(&x * 2.0))], &[None], false).unwrap();
    assert_eq!(seen.lock().unwrap().len(), 1, "removed hook does not fire");
}

#[test]
fn explicit_gradient_backward_equals_the_dot_product_trick() {
    let (x, w) = (leaf(11, &[3, 4]), leaf(12, &[4, 2]));
    let g = randn(13, &[3, 2]);
    let y = x.matmul(&w).tanh();
    engine::backward(&[&y], &[Some(&g)], false).unwrap();

    let (xr, wr) = (leaf(11, &[3, 4]), leaf(12, &[4, 2]));
    sum(&(xr.matmul(&wr).tanh() * &g)).backward();
    assert_close(&x.grad(), &xr.grad());
    assert_close(&w.grad(), &wr.grad());

    // grad(): same numbers, .grad untouched, unused inputs are None with allow_unused.
    let (x2, unused) = (leaf(11, &[3, 4]), leaf(14, &[2]));
    let y2 = x2.matmul(&w.detach()).tanh();
    let opts = GradOptions {
        allow_unused: true,
        ..GradOptions::default()
    };
    let gs = engine::grad(&[&y2], &[&x2, &unused], &[Some(&g)], opts).unwrap();
    assert_close(gs[0].as_ref().unwrap(), &xr.grad());
    assert!(gs[1].is_none());
    assert!(!x2.grad().defined());
    // Without allow_unused that is an error, not a crash.
    let y3 = x2.matmul(&w.detach()).tanh();
    assert!(engine::grad(&[&y3], &[&unused], &[Some(&g)], GradOptions::default()).is_err());
    // Mismatched counts are caught before libtorch.
    assert!(matches!(
        engine::backward(&[&y3], &[], false),
        Err(AutogradError::Arity { .. })
    ));
}

#[test]
fn drop_exactly_once_on_every_path() {
    let make = |x: &Tensor, guard: DropCounter| {
        apply(
            &[x],
            |_c, xs| Ok(vec![xs[0] * 2.0]),
            move |_c, g| {
                let _ = &guard;
                Ok(vec![g[0].as_ref().map(|g| g * 2.0)])
            },
        )
        .unwrap()
    };
    // No backward.
    let (n, guard) = counter();
    let y = make(&leaf(0, &[2]), guard);
    assert_eq!(n.load(Ordering::SeqCst), 0);
    drop(y);
    assert_eq!(n.load(Ordering::SeqCst), 1, "no backward");

    // After backward: the one-shot closure is consumed by it.
    let (n, guard) = counter();
    let x = leaf(0, &[2]);
    let y = make(&x, guard);
    engine::backward(&[&sum(&y[0])], &[None], false).unwrap();
    assert_eq!(n.load(Ordering::SeqCst), 1, "after backward");
    drop(y);
    assert_eq!(
        n.load(Ordering::SeqCst),
        1,
        "after backward, then node gone"
    );

    // Under no_grad: no node survives the call.
    let (n, guard) = counter();
    let y = tch::no_grad(|| make(&leaf(0, &[2]), guard));
    assert!(!y[0].requires_grad());
    assert_eq!(n.load(Ordering::SeqCst), 1, "no_grad");

    // Inputs that do not require grad: same.
    let (n, guard) = counter();
    let _y = make(&randn(0, &[2]), guard);
    assert_eq!(n.load(Ordering::SeqCst), 1, "no input requires grad");

    // Panic in backward.
    let (n, guard) = counter();
    let x = leaf(0, &[2]);
    let y = apply(
        &[&x],
        |_c, xs| Ok(vec![xs[0] * 2.0]),
        move |_c, _g| {
            let _ = &guard;
            panic!("boom in backward")
        },
    )
    .unwrap();
    let err = engine::backward(&[&sum(&y[0])], &[None], false).unwrap_err();
    assert!(
        matches!(&err, AutogradError::Panic { stage: Stage::Backward, message } if message.contains("boom")),
        "{err}"
    );
    drop(y);
    assert_eq!(n.load(Ordering::SeqCst), 1, "panic in backward");

    // Forward fails or panics: the backward closure is dropped at once.
    let (n, guard) = counter();
    let err = apply(
        &[&leaf(0, &[2])],
        |_c, _xs| Err(AutogradError::msg("forward refused")),
        move |_c, g| {
            let _ = &guard;
            Ok(g)
        },
    )
    .unwrap_err();
    assert!(matches!(err, AutogradError::Message(_)));
    assert_eq!(n.load(Ordering::SeqCst), 1, "forward error");
    let (n, guard) = counter();
    let err = apply(
        &[&leaf(0, &[2])],
        |_c, _xs| panic!("forward boom"),
        move |_c, g| {
            let _ = &guard;
            Ok(g)
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            AutogradError::Panic {
                stage: Stage::Forward,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(n.load(Ordering::SeqCst), 1, "forward panic");

    // Invalid forward bookkeeping, caught by the bridge after the hand-over.
    let (n, guard) = counter();
    let err = apply(
        &[&leaf(0, &[2])],
        |ctx, xs| {
            ctx.mark_non_differentiable(3);
            Ok(vec![xs[0] * 1.0])
        },
        move |_c, g| {
            let _ = &guard;
            Ok(g)
        },
    )
    .unwrap_err();
    assert!(matches!(err, AutogradError::Invalid(_)), "{err}");
    assert_eq!(n.load(Ordering::SeqCst), 1, "invalid forward");
}

/// A backward run by tch (libtorch's own engine, not the bridge) loses the typed error, but
/// not its cause: the message says what the Rust callback failed with.
#[test]
fn a_callback_error_keeps_its_cause_outside_the_bridge() {
    let x = leaf(0, &[2]);
    let _h = hooks::register_post_accumulate_grad_hook(&x, |_| {
        Err(AutogradError::msg("lost rank 3: connection reset"))
    })
    .unwrap();
    let err = sum(&(&x * 2.0)).f_backward().unwrap_err().to_string();
    assert!(
        err.contains("error raised by a Lockstep Rust callback: lost rank 3: connection reset"),
        "{err}"
    );
}

#[test]
fn backward_errors_come_back_typed() {
    let x = leaf(0, &[2]);
    let y = apply(
        &[&x],
        |_c, xs| Ok(vec![xs[0] * 2.0]),
        |_c, _g| Err(AutogradError::msg("no gradient today")),
    )
    .unwrap();
    let err = engine::backward(&[&sum(&y[0])], &[None], false).unwrap_err();
    assert!(
        matches!(&err, AutogradError::Message(m) if m == "no gradient today"),
        "{err}"
    );

    // A panicking hook.
    let x = leaf(0, &[2]);
    let _h = hooks::register_hook(&x, |_| panic!("hook boom")).unwrap();
    let err = engine::backward(&[&sum(&(&x * 2.0))], &[None], false).unwrap_err();
    assert!(
        matches!(
            err,
            AutogradError::Panic {
                stage: Stage::Hook,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn reentrant_backward_with_retain_graph() {
    let x = leaf(15, &[3]);
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let (n, guard) = counter();
    let y = apply_reentrant(
        &[&x],
        |_ctx, xs| Ok(vec![xs[0] * 3.0]),
        move |_ctx, g| {
            let _ = &guard;
            c.fetch_add(1, Ordering::SeqCst);
            Ok(vec![g[0].as_ref().map(|g| g * 3.0)])
        },
    )
    .unwrap();
    let loss = sum(&y[0]);
    for _ in 0..3 {
        engine::backward(&[&loss], &[None], true).unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_close(
        &x.grad(),
        &Tensor::full([3], 9.0, (Kind::Double, Device::Cpu)),
    );
    drop((y, loss));
    assert_eq!(n.load(Ordering::SeqCst), 1);

    // The one-shot form refuses a second run instead of misbehaving.
    let x = leaf(15, &[3]);
    let y = apply(&[&x], |_c, xs| Ok(vec![xs[0] * 3.0]), |_c, g| Ok(g)).unwrap();
    let loss = sum(&y[0]);
    engine::backward(&[&loss], &[None], true).unwrap();
    let err = engine::backward(&[&loss], &[None], true).unwrap_err();
    assert!(matches!(err, AutogradError::BackwardReused), "{err}");
}

#[test]
fn storage_free_and_refill_keep_saved_tensors_valid() {
    // FSDP's pattern: a full parameter is used in forward (matmul saves it), freed, then
    // refilled with the same values before backward.
    let w = leaf(16, &[4, 3]);
    let x = leaf(17, &[2, 4]);
    let keep = w.detach().copy();
    let nbytes = storage::storage_nbytes(&w).unwrap();
    assert_eq!(nbytes, 4 * 3 * 8);
    let y = x.matmul(&w).sin();
    let version = storage::version(&w).unwrap();

    // SAFETY: nothing touches w (or y's saved copy of it) until the refill below.
    assert_eq!(unsafe { storage::free_storage(&w) }.unwrap(), nbytes);
    assert!(storage::is_storage_freed(&w).unwrap());
    // SAFETY: as above.
    assert_eq!(
        unsafe { storage::free_storage(&w) }.unwrap(),
        0,
        "second free releases nothing"
    );
    // Metadata stays usable.
    assert_eq!(w.size(), vec![4, 3]);
    assert!(w.requires_grad());

    storage::refill_storage(&w, Some(&keep)).unwrap();
    assert!(!storage::is_storage_freed(&w).unwrap());
    assert_eq!(
        storage::version(&w).unwrap(),
        version,
        "refill keeps the version"
    );
    engine::backward(&[&sum(&y)], &[None], false).unwrap();

    let (wr, xr) = (leaf(16, &[4, 3]), leaf(17, &[2, 4]));
    sum(&xr.matmul(&wr).sin()).backward();
    assert_close(&w.grad(), &wr.grad());
    assert_close(&x.grad(), &xr.grad());
    assert_close(&w.detach(), &wr.detach());

    // Refill without data allocates the full recorded size for every alias.
    let mut flat = randn(18, &[12]);
    let view = flat.narrow(0, 6, 6);
    // SAFETY: neither alias is used until the refill.
    unsafe { storage::free_storage(&view) }.unwrap();
    assert!(storage::is_storage_freed(&flat).unwrap());
    storage::refill_storage(&view, None).unwrap();
    let _ = flat.fill_(1.0);
    assert_eq!(view.sum(Kind::Double).double_value(&[]), 6.0);
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

fn one_iteration(i: usize) {
    let x = randn(i as i64, &[16, 16]).set_requires_grad(true);
    let w = randn(1, &[16, 16]).set_requires_grad(true);
    let h = hooks::register_hook(&x, |g| Ok(Some(g * 1.0))).unwrap();
    let p = hooks::register_post_accumulate_grad_hook(&w, |_| Ok(())).unwrap();
    let y = apply(
        &[&x, &w],
        |ctx, xs| {
            ctx.save_for_backward(&[xs[0], xs[1]]);
            Ok(vec![xs[0].matmul(xs[1])])
        },
        |ctx, g| {
            let (x, w) = (&ctx.saved()[0], &ctx.saved()[1]);
            let g = g[0].as_ref().unwrap();
            Ok(vec![Some(g.matmul(&w.tr())), Some(x.tr().matmul(g))])
        },
    )
    .unwrap();
    let keep = w.detach().copy();
    // SAFETY: refilled right away, before any use.
    unsafe { storage::free_storage(&w) }.unwrap();
    storage::refill_storage(&w, Some(&keep)).unwrap();
    let g = randn(2, &[16, 16]);
    engine::backward(&[&y[0]], &[Some(&g)], false).unwrap();
    if i.is_multiple_of(2) {
        h.remove().unwrap();
    }
    p.remove().unwrap();
    // An abandoned graph (no backward) every other iteration.
    let _ = apply(&[&x], |_c, xs| Ok(vec![xs[0] * 2.0]), |_c, g| Ok(g)).unwrap();
}

#[test]
fn ten_thousand_iterations_without_memory_growth() {
    for i in 0..500 {
        one_iteration(i);
    }
    let before = rss_bytes();
    for i in 0..10_000 {
        one_iteration(i);
    }
    let after = rss_bytes();
    let growth = after.saturating_sub(before);
    eprintln!("RSS before {before} after {after} growth {growth} bytes");
    // Each iteration allocates well over 4 KiB of tensors and closures: a leak of anything per
    // iteration would exceed this bound.
    assert!(
        growth < 4 << 20,
        "RSS grew by {growth} bytes over 10,000 iterations"
    );
}
