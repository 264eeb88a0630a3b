//! [`CpuGroup`]: a process group of the CPU backend and its issue queue. Each collective is
//! checked and staged here, then runs as one job, one at a time in issue order, on the
//! group's worker thread (or inline on the caller's when nothing is queued).
//!
//! Apart from the algorithms the jobs run ([`super::algorithms`]) and from the
//! [`ProcessGroup`](crate::comm::ProcessGroup) surface built on these jobs
//! ([`super::process_group`]).

use super::exchange::{row_elems, Shared};
use super::link::Link;
use super::shm;
use super::tensor::Staged;
use crate::comm::flight::{self, OpState};
use crate::comm::work::{lock, Latch};
use crate::comm::{CommError, DType, OpKind, PointToPoint, ReduceOp, Work};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tch::Tensor;

type Job = Box<dyn FnOnce(&Shared, u64) -> Result<(), CommError> + Send>;

struct Queued {
    job: Job,
    seq: u64,
    latch: Arc<Latch>,
    flight_id: u64,
}

/// Runs a group's collectives one at a time, in issue order.
struct Executor {
    /// Held while issuing: assigns sequence numbers and keeps the queue in issue order.
    submit: Mutex<(u64, Option<mpsc::Sender<Queued>>)>,
    /// Jobs queued or running on the worker.
    pending: Arc<AtomicUsize>,
    /// Held while any job runs (worker or inline).
    running: Arc<Mutex<()>>,
}

/// A process group on the CPU backend. Create it through [`crate::comm::World`].
pub struct CpuGroup {
    pub(super) shared: Arc<Shared>,
    pub(super) global_ranks: Vec<usize>,
    exec: Executor,
    pub(super) send_seq: Vec<AtomicU64>,
    pub(super) recv_seq: Vec<AtomicU64>,
    /// When a send completes: at once, or once its receive is posted.
    pub(super) p2p: PointToPoint,
}

impl CpuGroup {
    /// Builds a group from established links (`links[rank]` is `None`).
    /// `p2p`: when its sends complete (see [`PointToPoint`]).
    /// `shm_run_tag`: set when every member runs on this machine, so large messages may use
    /// shared memory; slot names start with `/lockstep-{tag}-`, which lets a launcher remove
    /// the slots of ranks that died in the middle of an operation.
    pub(crate) fn new(
        name: String,
        rank: usize,
        global_ranks: Vec<usize>,
        links: Vec<Option<Link>>,
        timeout: Duration,
        shm_run_tag: Option<&str>,
        p2p: PointToPoint,
    ) -> Result<Self, CommError> {
        let size = global_ranks.len();
        let shm = shm_run_tag.map(|run| {
            let tag: String = name.chars().filter(char::is_ascii_alphanumeric).collect();
            let nonce: u32 = rand::random();
            Mutex::new(shm::ShmArea::new(
                format!("/lockstep-{run}-{}-{tag}-{nonce:08x}", std::process::id()),
                size,
            ))
        });
        let shared = Arc::new(Shared {
            name,
            rank,
            size,
            links,
            timeout,
            shm,
        });
        let (tx, rx) = mpsc::channel::<Queued>();
        let pending = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(Mutex::new(()));
        let (w_shared, w_pending, w_running) = (shared.clone(), pending.clone(), running.clone());
        std::thread::Builder::new()
            .name(format!("lockstep-pg-{}", shared.name))
            .spawn(move || {
                for q in rx {
                    flight::update(q.flight_id, OpState::Started);
                    let result = {
                        let _guard = lock(&w_running);
                        (q.job)(&w_shared, q.seq)
                    };
                    finish(q.flight_id, &q.latch, result);
                    w_pending.fetch_sub(1, Ordering::AcqRel);
                }
            })
            .map_err(|e| CommError::io("spawn group worker", e))?;
        Ok(CpuGroup {
            shared,
            global_ranks,
            exec: Executor {
                submit: Mutex::new((0, Some(tx))),
                pending,
                running,
            },
            send_seq: (0..size).map(|_| AtomicU64::new(0)).collect(),
            recv_seq: (0..size).map(|_| AtomicU64::new(0)).collect(),
            p2p,
        })
    }

    /// Issues a collective. `inline`: run on this thread when nothing is queued (blocking
    /// callers); otherwise queue it on the worker.
    fn issue(
        &self,
        op: OpKind,
        shapes: Vec<Vec<i64>>,
        dtype: Option<DType>,
        job: Job,
        inline: bool,
    ) -> Result<Work, CommError> {
        // What this rank's call carries, named in a mismatch error (the job may run on the
        // group's worker thread, where the caller's label is not in force).
        let label = crate::comm::label::current();
        let flight_label = label.clone();
        let job: Job = match label {
            Some(label) => Box::new(move |sh, seq| {
                job(sh, seq).map_err(|e| crate::comm::label::name_mismatch(e, &label))
            }),
            None => job,
        };
        let mut submit = lock(&self.exec.submit);
        let seq = submit.0;
        submit.0 += 1;
        let flight_id = flight::record(
            &self.shared.name,
            seq,
            op,
            shapes,
            dtype,
            None,
            flight_label,
        );
        let latch = Latch::new();
        if inline && self.exec.pending.load(Ordering::Acquire) == 0 {
            flight::update(flight_id, OpState::Started);
            let result = {
                let _guard = lock(&self.exec.running);
                job(&self.shared, seq)
            };
            drop(submit);
            finish(flight_id, &latch, result);
            return Ok(Work::new(latch));
        }
        let sender = submit
            .1
            .as_ref()
            .ok_or_else(|| CommError::InvalidArgument("group is shut down".into()))?;
        self.exec.pending.fetch_add(1, Ordering::AcqRel);
        sender
            .send(Queued {
                job,
                seq,
                latch: latch.clone(),
                flight_id,
            })
            .map_err(|_| CommError::InvalidArgument("group worker stopped".into()))?;
        Ok(Work::new(latch))
    }

    pub(super) fn check_root(&self, rank: usize, what: &str) -> Result<(), CommError> {
        if rank >= self.shared.size {
            return Err(CommError::InvalidArgument(format!(
                "{what} rank {rank} is outside group {} of size {}",
                self.shared.name, self.shared.size
            )));
        }
        Ok(())
    }

    pub(super) fn all_reduce_job(
        &self,
        tensor: &Tensor,
        op: ReduceOp,
        inline: bool,
    ) -> Result<Work, CommError> {
        let t = Staged::new(tensor, true)?;
        if op == ReduceOp::Avg && !t.dtype.is_float() {
            return Err(CommError::InvalidArgument(format!(
                "all_reduce avg needs a floating-point tensor, got {}",
                t.dtype
            )));
        }
        let (shape, dtype) = (t.shape(), t.dtype);
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.all_reduce(&t, op, seq))?;
            }
            t.finish()
        });
        self.issue(OpKind::AllReduce, vec![shape], Some(dtype), job, inline)
    }

    pub(super) fn all_gather_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        self.check_pair(&out, &inp, OpKind::AllGather, out.numel(), inp.numel())?;
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.all_gather(&out, &inp, seq))?;
            out.finish()
        });
        self.issue(OpKind::AllGather, shapes, Some(dtype), job, inline)
    }

    pub(super) fn reduce_scatter_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        op: ReduceOp,
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        self.check_pair(&out, &inp, OpKind::ReduceScatter, inp.numel(), out.numel())?;
        if op == ReduceOp::Avg && !inp.dtype.is_float() {
            return Err(CommError::InvalidArgument(format!(
                "reduce_scatter avg needs a floating-point tensor, got {}",
                inp.dtype
            )));
        }
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.reduce_scatter(&out, &inp, op, seq))?;
            out.finish()
        });
        self.issue(OpKind::ReduceScatter, shapes, Some(dtype), job, inline)
    }

    /// Checks dtypes match and `big` holds exactly `size` times `small` elements.
    fn check_pair(
        &self,
        out: &Staged,
        inp: &Staged,
        op: OpKind,
        big: usize,
        small: usize,
    ) -> Result<(), CommError> {
        if out.dtype != inp.dtype {
            return Err(CommError::InvalidArgument(format!(
                "{op}: output is {} but input is {}",
                out.dtype, inp.dtype
            )));
        }
        if big != small * self.shared.size {
            return Err(CommError::InvalidArgument(format!(
                "{op} in group {} of size {}: the larger tensor must hold size × {small} = {} elements, it holds {big} (output {:?}, input {:?})",
                self.shared.name,
                self.shared.size,
                small * self.shared.size,
                out.shape(),
                inp.shape()
            )));
        }
        Ok(())
    }

    pub(super) fn broadcast_job(
        &self,
        tensor: &Tensor,
        root: usize,
        inline: bool,
    ) -> Result<Work, CommError> {
        self.check_root(root, "broadcast root")?;
        let t = Staged::new(tensor, self.shared.rank != root)?;
        let (shape, dtype) = (t.shape(), t.dtype);
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.broadcast(&t, root, seq))?;
            }
            t.finish()
        });
        self.issue(OpKind::Broadcast, vec![shape], Some(dtype), job, inline)
    }

    pub(super) fn all_to_all_job(
        &self,
        output: &Tensor,
        input: &Tensor,
        output_splits: &[usize],
        input_splits: &[usize],
        inline: bool,
    ) -> Result<Work, CommError> {
        let (out, inp) = (Staged::new(output, true)?, Staged::new(input, false)?);
        if out.dtype != inp.dtype {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: output is {} but input is {}",
                out.dtype, inp.dtype
            )));
        }
        let n = self.shared.size;
        let splits = |given: &[usize], t: &Staged, which: &str| -> Result<Vec<usize>, CommError> {
            let rows = t.shape().first().copied().unwrap_or(1).max(0) as usize;
            let splits = if given.is_empty() {
                if !rows.is_multiple_of(n) {
                    return Err(CommError::InvalidArgument(format!(
                        "all_to_all: {which} has {rows} rows, not divisible by group size {n}; pass explicit splits"
                    )));
                }
                vec![rows / n; n]
            } else {
                given.to_vec()
            };
            if splits.len() != n {
                return Err(CommError::InvalidArgument(format!(
                    "all_to_all: {} {which} splits given for a group of size {n}",
                    splits.len()
                )));
            }
            if splits.iter().sum::<usize>() != rows {
                return Err(CommError::InvalidArgument(format!(
                    "all_to_all: {which} splits {splits:?} sum to {}, but the {which} has {rows} rows",
                    splits.iter().sum::<usize>()
                )));
            }
            Ok(splits)
        };
        let out_splits = splits(output_splits, &out, "output")?;
        let in_splits = splits(input_splits, &inp, "input")?;
        let me = self.shared.rank;
        if row_elems(&out.shape()) != row_elems(&inp.shape()) || out_splits[me] != in_splits[me] {
            return Err(CommError::InvalidArgument(format!(
                "all_to_all: rows of output {:?} and input {:?} must match, and this rank's own split must be equal in both ({} vs {})",
                out.shape(),
                inp.shape(),
                out_splits[me],
                in_splits[me]
            )));
        }
        let (shapes, dtype) = (vec![inp.shape(), out.shape()], inp.dtype);
        let job: Job = Box::new(move |sh, seq| {
            sh.abort_on_error(sh.all_to_all(&out, &inp, &out_splits, &in_splits, seq))?;
            out.finish()
        });
        self.issue(OpKind::AllToAll, shapes, Some(dtype), job, inline)
    }

    pub(super) fn barrier_job(&self, inline: bool) -> Result<Work, CommError> {
        let job: Job = Box::new(move |sh, seq| {
            if sh.size > 1 {
                sh.abort_on_error(sh.barrier(seq))
            } else {
                Ok(())
            }
        });
        self.issue(OpKind::Barrier, vec![], None, job, inline)
    }
}

pub(super) fn finish(flight_id: u64, latch: &Latch, result: Result<(), CommError>) {
    flight::update(
        flight_id,
        match &result {
            Ok(()) => OpState::Completed,
            Err(e) => OpState::Failed(e.to_string()),
        },
    );
    latch.complete(result);
}

impl Drop for CpuGroup {
    fn drop(&mut self) {
        // Closing the queue ends the worker once queued work is done.
        lock(&self.exec.submit).1 = None;
    }
}
