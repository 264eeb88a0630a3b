//! A collective storm: random programs of every collective, sync and async, on overlapping
//! sub-groups of a `DeviceMesh`, with injected delays and CPU contention, every result
//! checked exactly. It exists to find the hangs that only show under load (two groups whose
//! work interleaves differently on every rank), so the launcher's timeout is its watchdog.
//!
//! Every rank draws the same program from the iteration's seed (ranks must issue each
//! group's collectives in the same order), but waits for its asynchronous work in its own
//! random order, sleeps for its own random times and may spin a busy thread: the timing of
//! every rank differs, the results must not.

use crate::RankCtx;
use lockstep_core::comm::cpu::chaos;
use lockstep_core::comm::{ProcessGroup, ReduceOp, Work};
use lockstep_core::CommError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

/// f32 elements of a message that takes the shared-memory path (256 KiB and more).
const SHM_ELEMS: usize = (256 << 10) / 4 + 3;
/// f32 elements of a message on the TCP large-message algorithms (64 KiB to 256 KiB).
const MID_ELEMS: usize = 40_009;

/// What one storm does.
#[derive(Clone, Debug)]
pub struct StormOptions {
    /// Iterations (each a random program of `ops_per_iteration` operations).
    pub iterations: usize,
    /// Operations per iteration, spread over the mesh's groups and the world.
    pub ops_per_iteration: usize,
    /// Seed of the programs (the same on every rank).
    pub seed: u64,
    /// Longest random delay injected before every message a rank sends.
    pub max_send_delay: Duration,
    /// Whether each rank spins a busy thread for a random part of every iteration.
    pub contention: bool,
}

impl Default for StormOptions {
    fn default() -> Self {
        StormOptions {
            iterations: 200,
            ops_per_iteration: 12,
            seed: 0,
            max_send_delay: Duration::from_micros(300),
            contention: true,
        }
    }
}

/// What a finished storm did on this rank.
#[derive(Clone, Debug, Default)]
pub struct StormStats {
    /// Operations issued and checked.
    pub ops: usize,
    /// Of which asynchronous.
    pub async_ops: usize,
    /// Of which large enough for shared memory.
    pub shm_ops: usize,
    /// Wall time of the storm.
    pub elapsed: Duration,
}

/// Why a storm failed on this rank.
#[derive(Debug, thiserror::Error)]
pub enum StormError {
    /// A collective failed (a mismatch, a lost peer, a timeout).
    #[error("iteration {iteration}, operation {op} ({what}): {source}")]
    Comm {
        /// The storm iteration, 0-based.
        iteration: usize,
        /// The operation's index within the iteration.
        op: usize,
        /// The operation described (collective, group, size).
        what: String,
        /// The collective's own error.
        #[source]
        source: CommError,
    },
    /// A collective returned wrong values.
    #[error("iteration {iteration}, operation {op} ({what}): wrong result at element {index}: {got} instead of {want}")]
    WrongResult {
        /// The storm iteration, 0-based.
        iteration: usize,
        /// The operation's index within the iteration.
        op: usize,
        /// The operation described (collective, group, size).
        what: String,
        /// The first wrong element's flat index.
        index: usize,
        /// The value the collective produced.
        got: f32,
        /// The value every rank can compute locally.
        want: f32,
    },
    /// The world does not fit a 2 × (N/2) mesh.
    #[error("a collective storm needs an even world size of at least 2, not {0}")]
    WorldSize(usize),
    /// A tensor could not be built or read.
    #[error("tensor: {0}")]
    Tensor(#[from] tch::TchError),
}

/// The value rank `global` contributes at element `i` of operation `op` of `iteration`: small
/// integers, so every sum is exact whatever the order and any wrong chunk shows.
fn value(global: usize, iteration: usize, op: usize, i: usize) -> f32 {
    ((global * 131 + iteration * 17 + op * 7 + i) % 1021) as f32
}

fn values(global: usize, iteration: usize, op: usize, len: usize) -> Tensor {
    let v: Vec<f32> = (0..len).map(|i| value(global, iteration, op, i)).collect();
    Tensor::from_slice(&v)
}

/// Which collective, drawn per operation.
#[derive(Clone, Copy, Debug)]
enum StormOp {
    AllReduceSum,
    AllReduceMax,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    Barrier,
    SendRecvRing,
}

const KINDS: [StormOp; 8] = [
    StormOp::AllReduceSum,
    StormOp::AllReduceMax,
    StormOp::AllGather,
    StormOp::ReduceScatter,
    StormOp::Broadcast,
    StormOp::AllToAll,
    StormOp::Barrier,
    StormOp::SendRecvRing,
];

/// Reads an operation's result once its work completed: `Err((element, got, want))`.
type Check = Box<dyn FnOnce() -> Result<(), (usize, f32, f32)>>;

/// One issued operation: its work handles and how to check its result once they complete.
struct Pending {
    what: String,
    op: usize,
    works: Vec<Work>,
    check: Check,
}

/// Compares `got` to `want(i)` element by element.
fn expect(got: &Tensor, want: impl Fn(usize) -> f32) -> Result<(), (usize, f32, f32)> {
    let got = Vec::<f32>::try_from(&got.reshape([-1])).map_err(|_| (0, f32::NAN, f32::NAN))?;
    for (i, g) in got.iter().enumerate() {
        let w = want(i);
        if *g != w {
            return Err((i, *g, w));
        }
    }
    Ok(())
}

/// Runs the storm on this rank: the world laid out as `replicate × shard` (2 × N/2), the
/// two dimensions' overlapping groups and the world group all busy at once.
pub fn collective_storm(ctx: &RankCtx, opts: &StormOptions) -> Result<StormStats, StormError> {
    let n = ctx.world_size();
    if n < 2 || !n.is_multiple_of(2) {
        return Err(StormError::WorldSize(n));
    }
    let comm = |iteration, op, what: &str| {
        let what = what.to_owned();
        move |source| StormError::Comm {
            iteration,
            op,
            what,
            source,
        }
    };
    let mesh = ctx
        .mesh(&[("replicate", 2), ("shard", n / 2)])
        .map_err(comm(0, 0, "mesh"))?;
    let groups: Vec<Arc<dyn ProcessGroup>> = vec![
        mesh.group("replicate").map_err(comm(0, 0, "mesh"))?,
        mesh.group("shard").map_err(comm(0, 0, "mesh"))?,
        ctx.group(),
    ];
    chaos::set_max_delay(opts.max_send_delay);
    let started = Instant::now();
    let mut stats = StormStats::default();
    let result = (|| -> Result<(), StormError> {
        for iteration in 0..opts.iterations {
            storm_iteration(ctx.rank(), &groups, iteration, opts, &mut stats)?;
        }
        Ok(())
    })();
    chaos::set_max_delay(Duration::ZERO);
    result?;
    stats.elapsed = started.elapsed();
    Ok(stats)
}

fn storm_iteration(
    rank: usize,
    groups: &[Arc<dyn ProcessGroup>],
    iteration: usize,
    opts: &StormOptions,
    stats: &mut StormStats,
) -> Result<(), StormError> {
    // The program: the same on every rank.
    let mut program =
        StdRng::seed_from_u64(opts.seed ^ (iteration as u64).wrapping_mul(0x9E37_79B9));
    // This rank's own timing: waits, sleeps, contention.
    let mut local = StdRng::seed_from_u64(
        opts.seed ^ ((iteration as u64) << 20) ^ (rank as u64 + 1).wrapping_mul(0xA24B_AED4),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let spinner = (opts.contention && local.random_bool(0.5)).then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        })
    });
    let mut in_flight: Vec<Pending> = Vec::new();
    let mut outcome = Ok(());
    for op in 0..opts.ops_per_iteration {
        let g = &groups[program.random_range(0..groups.len())];
        let kind = KINDS[program.random_range(0..KINDS.len())];
        let len = match program.random_range(0..4) {
            0 => program.random_range(1..300),
            1 => MID_ELEMS,
            2 => SHM_ELEMS,
            _ => program.random_range(300..20_000),
        };
        let asynchronous = program.random_bool(0.5);
        let what = format!(
            "{kind:?} of {len} f32 on {} ({})",
            g.name(),
            if asynchronous { "async" } else { "sync" }
        );
        let issued = issue(g.as_ref(), kind, iteration, op, len, !asynchronous).map_err(|source| {
            StormError::Comm {
                iteration,
                op,
                what: what.clone(),
                source,
            }
        });
        let pending = match issued {
            Ok((works, check)) => Pending {
                what,
                op,
                works,
                check,
            },
            Err(e) => {
                outcome = Err(e);
                break;
            }
        };
        stats.ops += 1;
        stats.shm_ops += usize::from(len >= SHM_ELEMS);
        if asynchronous {
            stats.async_ops += 1;
            in_flight.push(pending);
        } else if let Err(e) = complete(pending, iteration) {
            outcome = Err(e);
            break;
        }
        if local.random_bool(0.2) {
            std::thread::sleep(Duration::from_micros(local.random_range(0..500)));
        }
    }
    // Wait for the asynchronous work in this rank's own order.
    while !in_flight.is_empty() {
        let i = local.random_range(0..in_flight.len());
        let p = in_flight.swap_remove(i);
        let r = complete(p, iteration);
        if outcome.is_ok() {
            outcome = r;
        }
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(s) = spinner {
        let _ = s.join();
    }
    outcome
}

fn complete(p: Pending, iteration: usize) -> Result<(), StormError> {
    for w in &p.works {
        w.wait().map_err(|source| StormError::Comm {
            iteration,
            op: p.op,
            what: p.what.clone(),
            source,
        })?;
    }
    (p.check)().map_err(|(index, got, want)| StormError::WrongResult {
        iteration,
        op: p.op,
        what: p.what,
        index,
        got,
        want,
    })
}

/// Issues one operation, through the blocking call (`blocking`: it runs on this thread when
/// nothing is queued) or the asynchronous one (the caller waits, now or later); the returned
/// check reads the result once the work completed.
fn issue(
    g: &dyn ProcessGroup,
    kind: StormOp,
    iteration: usize,
    op: usize,
    len: usize,
    blocking: bool,
) -> Issued {
    let members = g.global_ranks().to_vec();
    let (size, me) = (g.size(), g.rank());
    let mine = members[me];
    let issuing = Issuing {
        g,
        iteration,
        op,
        len,
        blocking,
        members,
        size,
        me,
        mine,
    };
    match kind {
        StormOp::AllReduceSum => issuing.all_reduce(ReduceOp::Sum, |a, b| a + b),
        StormOp::AllReduceMax => issuing.all_reduce(ReduceOp::Max, f32::max),
        StormOp::AllGather => issuing.all_gather(),
        StormOp::ReduceScatter => issuing.reduce_scatter(),
        StormOp::Broadcast => issuing.broadcast(),
        StormOp::AllToAll => issuing.all_to_all(),
        StormOp::Barrier => Ok((
            vec![issuing.run(&|| g.barrier_async(), &|| g.barrier())?],
            Box::new(|| Ok(())) as Check,
        )),
        StormOp::SendRecvRing => issuing.send_recv_ring(),
    }
}

/// An issued operation's work handles and the check of its result, or why it could not be
/// issued.
type Issued = Result<(Vec<Work>, Check), CommError>;

/// The dtype and device of every storm tensor.
const F32S: (Kind, Device) = (Kind::Float, Device::Cpu);

/// One operation being issued: its group, where it sits in the storm and this rank's place
/// in the group, shared by every collective's issuing helper.
struct Issuing<'a> {
    g: &'a dyn ProcessGroup,
    iteration: usize,
    op: usize,
    /// f32 elements per rank.
    len: usize,
    /// Through the blocking call rather than the asynchronous one.
    blocking: bool,
    /// The group's members' global ranks.
    members: Vec<usize>,
    size: usize,
    /// This rank's rank in the group.
    me: usize,
    /// This rank's global rank.
    mine: usize,
}

impl Issuing<'_> {
    /// Runs the operation through the blocking call (its work is then already done when it
    /// returns) or starts it asynchronously, as this operation was drawn.
    fn run(
        &self,
        start: &dyn Fn() -> Result<Work, CommError>,
        block: &dyn Fn() -> Result<(), CommError>,
    ) -> Result<Work, CommError> {
        if self.blocking {
            block().map(|()| Work::done(Ok(())))
        } else {
            start()
        }
    }

    /// This rank's values for the operation, `len` of them.
    fn own_values(&self, len: usize) -> Tensor {
        values(self.mine, self.iteration, self.op, len)
    }

    /// An all-reduce by `reduce`, checked against `combine` folded over the members' values.
    fn all_reduce(&self, reduce: ReduceOp, combine: fn(f32, f32) -> f32) -> Issued {
        let g = self.g;
        let t = self.own_values(self.len);
        let work = self.run(&|| g.all_reduce_async(&t, reduce), &|| {
            g.all_reduce(&t, reduce)
        })?;
        let (members, iteration, op) = (self.members.clone(), self.iteration, self.op);
        let check: Check = Box::new(move || {
            expect(&t, |i| {
                members
                    .iter()
                    .map(|&r| value(r, iteration, op, i))
                    .reduce(combine)
                    .unwrap_or(0.0)
            })
        });
        Ok((vec![work], check))
    }

    /// An all-gather, checked against every member's values in group order.
    fn all_gather(&self) -> Issued {
        let (g, len) = (self.g, self.len);
        let input = self.own_values(len);
        let out = Tensor::full([(len * self.size) as i64], -1.0, F32S);
        let work = self.run(&|| g.all_gather_async(&out, &input), &|| {
            g.all_gather(&out, &input)
        })?;
        let (members, iteration, op) = (self.members.clone(), self.iteration, self.op);
        let check: Check = Box::new(move || {
            let _keep = &input;
            expect(&out, |i| value(members[i / len], iteration, op, i % len))
        });
        Ok((vec![work], check))
    }

    /// A summing reduce-scatter, checked against the sum of the members' values of this
    /// rank's chunk.
    fn reduce_scatter(&self) -> Issued {
        let (g, len, me) = (self.g, self.len, self.me);
        let input = self.own_values(len * self.size);
        let out = Tensor::full([len as i64], -1.0, F32S);
        let work = self.run(
            &|| g.reduce_scatter_async(&out, &input, ReduceOp::Sum),
            &|| g.reduce_scatter(&out, &input, ReduceOp::Sum),
        )?;
        let (members, iteration, op) = (self.members.clone(), self.iteration, self.op);
        let check: Check = Box::new(move || {
            let _keep = &input;
            expect(&out, |i| {
                members
                    .iter()
                    .map(|&r| value(r, iteration, op, me * len + i))
                    .sum()
            })
        });
        Ok((vec![work], check))
    }

    /// A broadcast from a root that moves with the iteration and operation, checked against
    /// the root's values.
    fn broadcast(&self) -> Issued {
        let (g, iteration, op) = (self.g, self.iteration, self.op);
        let root = (iteration + op) % self.size;
        let t = if self.me == root {
            self.own_values(self.len)
        } else {
            Tensor::full([self.len as i64], -1.0, F32S)
        };
        let work = self.run(&|| g.broadcast_async(&t, root), &|| g.broadcast(&t, root))?;
        let root_global = self.members[root];
        let check: Check = Box::new(move || expect(&t, |i| value(root_global, iteration, op, i)));
        Ok((vec![work], check))
    }

    /// An all-to-all of uneven splits, checked against what every member sent this rank.
    fn all_to_all(&self) -> Issued {
        let (g, iteration, op, me, size) = (self.g, self.iteration, self.op, self.me, self.size);
        let len = self.len;
        // Uneven rows of width 3: rank s sends (s + d + op) % 3 (+ len / 3000) rows to d.
        let width = 3usize;
        let rows = |s: usize, d: usize| (s + d + op) % 3 + len / 3000;
        let in_splits: Vec<usize> = (0..size).map(|d| rows(me, d)).collect();
        let out_splits: Vec<usize> = (0..size).map(|s| rows(s, me)).collect();
        let cell = move |s: usize, d: usize, k: usize| -> f32 {
            ((s * 7 + d * 3 + k + op + iteration) % 997) as f32
        };
        let mut data = Vec::new();
        for (d, &r) in in_splits.iter().enumerate() {
            data.extend((0..r * width).map(|k| cell(me, d, k)));
        }
        let input = Tensor::from_slice(&data).reshape([-1, width as i64]);
        let total: usize = out_splits.iter().sum();
        let out = Tensor::full([total as i64, width as i64], -1.0, F32S);
        let work = self.run(
            &|| g.all_to_all_async(&out, &input, &out_splits, &in_splits),
            &|| g.all_to_all(&out, &input, &out_splits, &in_splits),
        )?;
        let mut want = Vec::new();
        for (s, &r) in out_splits.iter().enumerate() {
            want.extend((0..r * width).map(|k| cell(s, me, k)));
        }
        let check: Check = Box::new(move || {
            let _keep = &input;
            expect(&out, |i| want[i])
        });
        Ok((vec![work], check))
    }

    /// A send to the next rank of the group and a receive from the previous one (always
    /// asynchronous), checked against the previous rank's values; nothing in a group of one.
    fn send_recv_ring(&self) -> Issued {
        let (g, size, me) = (self.g, self.size, self.me);
        if size == 1 {
            return Ok((Vec::new(), Box::new(|| Ok(()))));
        }
        let (next, prev) = ((me + 1) % size, (me + size - 1) % size);
        let payload = self.own_values(self.len);
        let out = Tensor::full([self.len as i64], -1.0, F32S);
        let tag = self.op as u64;
        let sent = g.send_async(&payload, next, tag)?;
        let received = g.recv_async(&out, prev, tag)?;
        let (from, iteration, op) = (self.members[prev], self.iteration, self.op);
        let check: Check = Box::new(move || {
            let _keep = &payload;
            expect(&out, |i| value(from, iteration, op, i))
        });
        Ok((vec![sent, received], check))
    }
}
