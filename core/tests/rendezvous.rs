//! Point-to-point under NCCL's rendezvous, proven on the CPU: in
//! [`PointToPoint::Rendezvous`] a send completes only once its receive is posted, so code that
//! relies on buffered sends hangs here as it would on NCCL with large messages.
//!
//! - the mode itself: a send stays pending until the peer posts its receive; two ranks that
//!   both send first fail naming the rendezvous (and pass buffered); a grouped batch with its
//!   sends listed first completes on both sides;
//! - every pipeline schedule at world 2, 4 and 8 with messages of about a megabyte runs under
//!   it and still equals the microbatched single-device run bit for bit.
//!
//! Every test of this binary wants rendezvous, so the pipeline tests set `LOCKSTEP_P2P` for
//! the ranks they launch (each nextest test is a process of its own).

use lockstep_core::comm::{
    batch_isend_irecv, CommError, DType, InitOptions, P2pKind, P2pOp, PointToPoint, StoreServer,
    World, P2P_VAR,
};
use lockstep_core::pipeline::{
    microbatched_reference, train_pipeline, PipelineOptions, ScheduleChoice, ScheduleKind,
};
use lockstep_core::train::OptimizerConfig;
use lockstep_harness::parity::{compare, TolerancePolicy};
use lockstep_models::zoo::MlpStack;

use crate::common;
use std::time::Duration;
use tch::{Kind, Tensor};

/// Runs `body` as rank 0 and rank 1 of a two-rank world (threads of this process) with the
/// given point-to-point mode and collective timeout; returns each rank's result.
fn two_ranks<R: Send + 'static>(
    p2p: PointToPoint,
    timeout: Duration,
    body: fn(&World) -> R,
) -> Vec<R> {
    let store = StoreServer::start("127.0.0.1:0", "secret").expect("store");
    let addr = store.addr().to_string();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut opts = InitOptions::local(rank, 2, addr, "secret");
                opts.p2p = p2p;
                opts.timeout = timeout;
                let world = World::init(opts).expect("world");
                body(&world)
            })
        })
        .collect();
    ranks
        .into_iter()
        .map(|r| r.join().expect("rank thread"))
        .collect()
}

/// 4 MiB of f32: far past any size a transport buffers.
const BIG: i64 = 1 << 20;

#[test]
fn a_send_completes_only_once_its_receive_is_posted() {
    let got = two_ranks(PointToPoint::Rendezvous, Duration::from_secs(30), |world| {
        let g = world.group();
        if world.rank() == 0 {
            let t = Tensor::arange(BIG, (Kind::Float, tch::Device::Cpu));
            let send = g.send_async(&t, 1, 7).expect("send");
            // Rank 1 posts its receive only after this barrier, so the send cannot be done.
            std::thread::sleep(Duration::from_millis(100));
            let pending = !send.is_completed();
            g.barrier().expect("barrier");
            send.wait()
                .expect("send completes once the receive is posted");
            pending
        } else {
            g.barrier().expect("barrier");
            let t = Tensor::zeros([BIG], (Kind::Float, tch::Device::Cpu));
            g.recv(&t, 0, 7).expect("recv");
            t.double_value(&[BIG - 1]) == (BIG - 1) as f64
        }
    });
    assert!(got[0], "the send completed before its receive was posted");
    assert!(got[1], "the receive got the wrong bytes");
}

/// Both ranks send (blocking) before they receive: the classic hang.
fn send_then_receive(world: &World) -> Result<(), CommError> {
    let g = world.group();
    let peer = 1 - world.rank();
    let out = Tensor::ones([BIG], (Kind::Float, tch::Device::Cpu));
    let inp = Tensor::zeros([BIG], (Kind::Float, tch::Device::Cpu));
    g.send(&out, peer, 0)?;
    g.recv(&inp, peer, 0)
}

#[test]
fn ranks_that_both_send_first_fail_under_rendezvous_naming_it() {
    let errors: Vec<String> = two_ranks(
        PointToPoint::Rendezvous,
        Duration::from_secs(2),
        send_then_receive,
    )
    .into_iter()
    .map(|r| {
        r.expect_err("both ranks sent first under rendezvous")
            .to_string()
    })
    .collect();
    // The first rank to time out names the rendezvous; the other may see it leave first.
    assert!(
        errors
            .iter()
            .any(|e| e.contains("rendezvous") && e.contains("post the receive")),
        "{errors:?}"
    );
}

#[test]
fn ranks_that_both_send_first_pass_when_sends_are_buffered() {
    for result in two_ranks(
        PointToPoint::Buffered,
        Duration::from_secs(30),
        send_then_receive,
    ) {
        result.expect("buffered sends complete without the receiver");
    }
}

#[test]
fn a_grouped_batch_lists_its_send_first_on_both_sides_and_completes() {
    let got = two_ranks(PointToPoint::Rendezvous, Duration::from_secs(30), |world| {
        let g = world.group();
        let me = world.rank();
        let out = Tensor::full([BIG], me as f64 + 1.0, (Kind::Float, tch::Device::Cpu));
        let inp = Tensor::zeros([BIG], (Kind::Float, tch::Device::Cpu));
        batch_isend_irecv(&[
            P2pOp {
                group: g.as_ref(),
                kind: P2pKind::Send,
                tensor: &out,
                peer: 1 - me,
                tag: 3,
            },
            P2pOp {
                group: g.as_ref(),
                kind: P2pKind::Recv,
                tensor: &inp,
                peer: 1 - me,
                tag: 3,
            },
        ])
        .expect("batch");
        inp.double_value(&[0])
    });
    assert_eq!(got, vec![2.0, 1.0]);
}

#[test]
fn an_unknown_mode_is_refused_by_name() {
    let e = "eager".parse::<PointToPoint>().unwrap_err().to_string();
    assert!(e.contains(P2P_VAR) && e.contains("rendezvous"), "{e}");
}

/// Wide layers between narrow ones: every other stage boundary carries `WIDE` features, about
/// a megabyte per microbatch, with few parameters (a wide layer is fed by 3 features).
const WIDE: i64 = 1 << 16;
const SIZES: [i64; 11] = [7, WIDE, 3, WIDE, 3, WIDE, 3, WIDE, 3, WIDE, 3];
const STEPS: usize = 2;

/// Every schedule at world 2, 4 and 8 (two microbatches per stage rank) under rendezvous, with
/// messages of about a megabyte: it runs, and it is still the microbatched single-device run
/// bit for bit (an MLP has no tied weight and no output feeding two stages).
#[test]
fn every_schedule_runs_under_rendezvous_with_large_activations() {
    let kind_values: Vec<ScheduleKind> = vec![
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::LoopedBfs,
        ScheduleKind::InterleavedZeroBubble,
        ScheduleKind::Zbv,
        ScheduleKind::DualPipeV,
    ];
    let world_values: Vec<usize> = vec![2, 4, 8];
    let cases: Vec<(ScheduleKind, usize)> = crate::common::product(&kind_values, &world_values);
    crate::common::each_case(
        "every_schedule_runs_under_rendezvous_with_large_activations",
        cases,
        |&(kind, world): &(ScheduleKind, usize)| {
            // Inherited by the ranks the harness launches (this process is this test's alone).
            std::env::set_var(P2P_VAR, "rendezvous");
            let m = 2 * world;
            let opts = PipelineOptions {
                schedule: ScheduleChoice::Builtin(kind),
                virtual_stages: kind.default_virtual(),
                microbatches: m,
                ..PipelineOptions::default()
            };
            lockstep_harness::Run::new(world)
                .timeout(Duration::from_secs(240))
                .run(|ctx| {
                    let model = MlpStack::with_sizes("mlp_rendezvous", &SIZES, 0, ctx.rank())
                        .expect("model");
                    let cfg = common::train_config(ctx, "mlp_rendezvous", "pp", "fp32", STEPS);
                    let run =
                        train_pipeline(&model, ctx.world(), &cfg, &opts).expect("pipeline run");
                    if ctx.rank() == 0 {
                        let reference =
                            MlpStack::with_sizes("mlp_rendezvous", &SIZES, 0, 0).expect("model");
                        let mb = microbatched_reference(
                            &reference,
                            world,
                            m,
                            STEPS,
                            OptimizerConfig::default(),
                            true,
                        )
                        .expect("reference");
                        let c = compare(&run.record, &mb, &TolerancePolicy::bitwise(DType::F32));
                        assert!(
                            c.passed,
                            "{kind} at world {world}: {}",
                            c.diagnosis.unwrap_or_default()
                        );
                    }
                });
        },
    );
}
