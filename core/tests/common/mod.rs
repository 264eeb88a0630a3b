//! Helpers shared by the collective and group integration tests: deterministic per-rank
//! inputs, locally computed expected reductions, and exact comparisons.

#![allow(dead_code)]

use lockstep_core::comm::{DType, ProcessGroup, ReduceOp};
use lockstep_core::CommError;
use lockstep_harness::{RankCtx, RankResult};
use std::sync::Arc;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Every dtype collectives accept.
pub const ALL_DTYPES: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool,
];

/// Every reduction.
pub const ALL_OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

/// f32 elements in exactly 64 KiB: the largest message of the direct (small) algorithms.
pub const AT_THRESHOLD: usize = (64 << 10) / 4;
/// f32 elements in 160 KB: TCP pairwise reduce-scatter / ring / chain algorithms.
pub const MID: usize = 40_009;
/// f32 elements in exactly 256 KiB: the smallest message of the shared-memory path.
pub const SHM_AT: usize = (256 << 10) / 4;
/// A large odd f32 count (400 KB), splitting unevenly over 2, 3 and 4 ranks.
pub const LARGE: usize = 100_003;

/// An odd element count of about `bytes` bytes of `dtype`.
pub fn numel_for(dtype: DType, bytes: usize) -> usize {
    (bytes / dtype.size()) | 1
}

/// A group of the whole world whose collectives never use shared memory (the TCP algorithms
/// at every size). Every rank must call it at the same point.
pub fn tcp_world(ctx: &RankCtx) -> Result<Arc<dyn ProcessGroup>, CommError> {
    // `LOCKSTEP_SHM` is read when a group is created; this only affects this rank's process.
    let previous = std::env::var("LOCKSTEP_SHM").ok();
    std::env::set_var("LOCKSTEP_SHM", "0");
    let all: Vec<usize> = (0..ctx.world_size()).collect();
    let group = ctx.world().new_group(&all);
    match previous {
        Some(v) => std::env::set_var("LOCKSTEP_SHM", v),
        None => std::env::remove_var("LOCKSTEP_SHM"),
    }
    Ok(group?.expect("every rank is a member"))
}

/// Runs `body` on `world_size` ranks with a timeout short enough that a hang fails the test
/// quickly instead of eating the suite's time budget.
pub fn run<F, R>(world_size: usize, body: F)
where
    F: Fn(&RankCtx) -> R,
    R: RankResult,
{
    lockstep_harness::Run::new(world_size)
        .timeout(Duration::from_secs(120))
        .run(body);
}

/// Whether `Avg` is accepted for `dtype`.
pub fn avg_valid(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
}

/// A tensor of `dtype` holding `vals` (which must be representable in it) with `shape`.
pub fn tensor(vals: &[f64], shape: &[i64], dtype: DType) -> Tensor {
    Tensor::from_slice(vals)
        .to_kind(dtype.kind())
        .reshape(shape)
}

/// A 1-D tensor of `dtype` holding `vals`.
pub fn tensor1(vals: &[f64], dtype: DType) -> Tensor {
    tensor(vals, &[vals.len() as i64], dtype)
}

/// A zero-filled tensor.
pub fn zeros(shape: &[i64], dtype: DType) -> Tensor {
    Tensor::zeros(shape, (dtype.kind(), Device::Cpu))
}

/// A tensor filled with a recognizable garbage value (so untouched outputs are noticed).
pub fn garbage(shape: &[i64], dtype: DType) -> Tensor {
    let v = match dtype {
        DType::Bool => 1.0,
        DType::U8 => 77.0,
        _ => -77.0,
    };
    Tensor::full(shape, v, (dtype.kind(), Device::Cpu))
}

/// Every element as f64, in row-major order of the tensor's logical shape.
pub fn values(t: &Tensor) -> Vec<f64> {
    let flat = t.to_kind(Kind::Double).contiguous().reshape([-1]);
    Vec::<f64>::try_from(&flat).expect("tensor to Vec<f64>")
}

/// Every element of an f32 tensor as raw bits.
pub fn bits(t: &Tensor) -> Vec<u32> {
    let flat = t.contiguous().reshape([-1]);
    Vec::<f32>::try_from(&flat)
        .expect("tensor to Vec<f32>")
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// Per-rank test inputs: small integers (and halves for floats) that vary with rank and
/// position so that sum, max and min all differ, exactly representable in `dtype`. Includes
/// negative values for signed types, values near the top of u8 (sums wrap), values beyond
/// i32 for i64, and, for bf16/f16, one big value on rank 0 whose neighbours only survive if
/// the sum is accumulated in f32 and rounded once.
pub fn inputs(dtype: DType, rank: usize, numel: usize) -> Vec<f64> {
    (0..numel)
        .map(|i| {
            let base = ((rank * 7 + i * 3 + 1) % 11) as f64;
            let half = if (i + rank) % 2 == 1 { 0.5 } else { 0.0 };
            match dtype {
                DType::F32 | DType::F64 => base - 5.0 + half,
                DType::BF16 | DType::F16 if i % 7 == 6 => {
                    if rank == 0 {
                        if dtype == DType::BF16 {
                            256.0
                        } else {
                            2048.0
                        }
                    } else {
                        1.0
                    }
                }
                DType::BF16 | DType::F16 => base - 5.0 + half,
                DType::I64 if i.is_multiple_of(5) => base - 5.0 + (1u64 << 40) as f64,
                DType::I64 | DType::I32 => base - 5.0,
                DType::U8 if i % 4 == 3 => 240.0 + base,
                DType::U8 => base,
                DType::Bool => f64::from(u8::from((rank * 5 + i).is_multiple_of(3))),
            }
        })
        .collect()
}

/// What reducing `per_rank` (rank order) with `op` must give, as the result reads in f64:
/// floats accumulate in rank order (bf16/f16 in f32, rounded once), `Avg` divides once at
/// the end, integer sums wrap, bool sum/max is or and min is and.
pub fn reduce_expected(dtype: DType, op: ReduceOp, per_rank: &[Vec<f64>]) -> Vec<f64> {
    let n = per_rank.len();
    let numel = per_rank[0].len();
    let column = |i: usize| per_rank.iter().map(move |v| v[i]);
    match dtype {
        DType::F64 => (0..numel)
            .map(|i| {
                let mut xs = column(i);
                let first = xs.next().unwrap();
                let acc = xs.fold(first, |a, x| match op {
                    ReduceOp::Sum | ReduceOp::Avg => a + x,
                    ReduceOp::Max => a.max(x),
                    ReduceOp::Min => a.min(x),
                });
                if op == ReduceOp::Avg {
                    acc / n as f64
                } else {
                    acc
                }
            })
            .collect(),
        DType::F32 | DType::BF16 | DType::F16 => {
            let acc: Vec<f32> = (0..numel)
                .map(|i| {
                    let mut xs = column(i).map(|x| x as f32);
                    let first = xs.next().unwrap();
                    let acc = xs.fold(first, |a, x| match op {
                        ReduceOp::Sum | ReduceOp::Avg => a + x,
                        ReduceOp::Max => a.max(x),
                        ReduceOp::Min => a.min(x),
                    });
                    if op == ReduceOp::Avg {
                        acc / n as f32
                    } else {
                        acc
                    }
                })
                .collect();
            // Round once to the storage type, exactly as libtorch converts.
            values(&Tensor::from_slice(&acc).to_kind(dtype.kind()))
        }
        DType::I64 | DType::I32 | DType::U8 => (0..numel)
            .map(|i| {
                let wrap = |v: i64| match dtype {
                    DType::I32 => v as i32 as i64,
                    DType::U8 => v as u8 as i64,
                    _ => v,
                };
                let mut xs = column(i).map(|x| x as i64);
                let first = xs.next().unwrap();
                let acc = xs.fold(first, |a, x| match op {
                    ReduceOp::Sum => wrap(a.wrapping_add(x)),
                    ReduceOp::Max => a.max(x),
                    ReduceOp::Min => a.min(x),
                    ReduceOp::Avg => unreachable!("avg on integers"),
                });
                acc as f64
            })
            .collect(),
        DType::Bool => (0..numel)
            .map(|i| {
                let mut xs = column(i).map(|x| x != 0.0);
                let v = match op {
                    ReduceOp::Min => xs.all(|b| b),
                    _ => xs.any(|b| b),
                };
                f64::from(u8::from(v))
            })
            .collect(),
    }
}

fn preview(v: &[f64]) -> String {
    if v.len() <= 16 {
        format!("{v:?}")
    } else {
        format!("{:?}... ({} elements)", &v[..16], v.len())
    }
}

/// Asserts `actual` has `dtype`, `shape` and exactly the `expected` values.
pub fn assert_tensor(actual: &Tensor, dtype: DType, shape: &[i64], expected: &[f64], what: &str) {
    assert_eq!(actual.kind(), dtype.kind(), "{what}: dtype changed");
    assert_eq!(actual.size(), shape, "{what}: shape changed");
    let got = values(actual);
    assert_eq!(got.len(), expected.len(), "{what}: element count");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != expected[i]) {
        panic!(
            "{what}: element {i} is {} but should be {}\n  got:      {}\n  expected: {}",
            got[i],
            expected[i],
            preview(&got),
            preview(expected)
        );
    }
}

/// `numel` and `shape` helper: a 1-D shape of `numel` elements.
pub fn shape1(numel: usize) -> Vec<i64> {
    vec![numel as i64]
}

/// Every rank's inputs for one dtype (as [`inputs`] makes them) and, computed once per
/// operator, their reduction. Inputs and reductions are element-wise, so smaller tensors
/// use prefixes.
pub struct Reference {
    pub dtype: DType,
    per_rank: Vec<Vec<f64>>,
    reduced: Vec<(ReduceOp, Vec<f64>)>,
}

impl Reference {
    /// Inputs of `numel` elements for ranks `0..n`.
    pub fn new(dtype: DType, n: usize, numel: usize) -> Self {
        Reference {
            dtype,
            per_rank: (0..n).map(|r| inputs(dtype, r, numel)).collect(),
            reduced: Vec::new(),
        }
    }

    /// The first `numel` inputs of `rank`.
    pub fn input(&self, rank: usize, numel: usize) -> &[f64] {
        &self.per_rank[rank][..numel]
    }

    /// The reduction of every rank's inputs with `op`.
    pub fn expected(&mut self, op: ReduceOp) -> &[f64] {
        let i = match self.reduced.iter().position(|(o, _)| *o == op) {
            Some(i) => i,
            None => {
                let v = reduce_expected(self.dtype, op, &self.per_rank);
                self.reduced.push((op, v));
                self.reduced.len() - 1
            }
        };
        &self.reduced[i].1
    }
}

/// The training configuration a parallel test rank runs: `steps` steps of the default SGD on
/// this rank's batch of seed 0, every gradient recorded.
pub fn train_config(
    ctx: &RankCtx,
    model: &str,
    config: &str,
    dtype: &str,
    steps: usize,
) -> lockstep_core::train::TrainConfig {
    lockstep_core::train::TrainConfig {
        spec: lockstep_core::record::RunSpec {
            model: model.into(),
            config: config.into(),
            world_size: ctx.world_size(),
            backend: "cpu".into(),
            dtype: dtype.into(),
            steps,
            seed: 0,
        },
        optimizer: lockstep_core::train::OptimizerConfig::default(),
        data_ranks: vec![ctx.rank()],
        record_grads: true,
        probe: None,
    }
}

/// A zoo model behind a wrapper whose forward does not run the layer hooks (the trait's
/// default), as a user's own model might not.
pub struct Unhooked(pub Box<dyn lockstep_models::Model>);

impl lockstep_models::Model for Unhooked {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn seed(&self) -> u64 {
        self.0.seed()
    }
    fn store(&self) -> &lockstep_models::ParamStore {
        self.0.store()
    }
    fn layers(&self) -> Vec<lockstep_models::LayerSpec> {
        self.0.layers()
    }
    fn input(
        &self,
        rank: usize,
        step: usize,
    ) -> Result<lockstep_models::Batch, lockstep_models::ModelError> {
        self.0.input(rank, step)
    }
    fn forward(
        &self,
        batch: &lockstep_models::Batch,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.0.forward(batch)
    }
    fn loss_of(
        &self,
        batch: &lockstep_models::Batch,
        output: &Tensor,
    ) -> Result<Tensor, lockstep_models::ModelError> {
        self.0.loss_of(batch, output)
    }
}

/// A Python with torch, as `ci/setup-libtorch` installs it (PYTHONPATH into its cache), or
/// `None` when there is none on this machine.
pub fn python_with_torch() -> Option<(String, Option<std::path::PathBuf>)> {
    let cache = std::env::var_os("LOCKSTEP_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| std::path::PathBuf::from(d).join("lockstep"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|d| std::path::PathBuf::from(d).join(".cache/lockstep"))
        });
    let site = cache
        .map(|c| c.join("torch-2.13.0"))
        .filter(|d| d.join("torch").is_dir());
    let python = std::env::var("LOCKSTEP_PYTHON").unwrap_or_else(|_| "python3".into());
    // Importing torch takes seconds and every PyTorch test asks: a success is remembered in a
    // stamp named by the interpreter, the path and torch's own version file, so a changed or
    // removed torch is probed afresh.
    let stamp = std::env::temp_dir().join(format!(
        "lockstep-python-torch-{}.ok",
        digest(&(&python, &site, torch_version(&site)))
    ));
    if site.is_some() && stamp.is_file() {
        return Some((python, site));
    }
    let mut probe = std::process::Command::new(&python);
    probe.args(["-c", "import torch"]);
    if let Some(site) = &site {
        probe.env("PYTHONPATH", site);
    }
    let found = probe.output().map(|o| o.status.success()).unwrap_or(false);
    if found && site.is_some() {
        let _ = std::fs::write(&stamp, "import torch succeeded\n");
    }
    found.then_some((python, site))
}

/// `python` (as [`python_with_torch`] found it) with its torch on `PYTHONPATH` and Python's
/// warnings off (torch warns on import when NumPy is missing), ready for its arguments.
pub fn torch_python(python: &str, site: &Option<std::path::PathBuf>) -> std::process::Command {
    let mut cmd = std::process::Command::new(python);
    cmd.arg("-W").arg("ignore");
    if let Some(site) = site {
        cmd.env("PYTHONPATH", site);
    }
    cmd
}

/// Every `.rs` file under `dir`, sorted.
pub fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    let mut entries: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// Runs `check` on every case of a table-driven test in this one process, every case even
/// after one fails, and fails naming each case that did (`test::case` with its parameters)
/// and why. nextest starts a process per test and each pays libtorch's start-up (about a
/// quarter second here), more than most cases' own work: a table is one test, its cases
/// still named one by one.
pub fn each_case<C: std::fmt::Debug>(
    test: &str,
    cases: impl IntoIterator<Item = C>,
    check: impl Fn(&C),
) {
    let mut failed = Vec::new();
    let mut count = 0;
    for case in cases {
        count += 1;
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&case)));
        if let Err(panic) = outcome {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(a panic without a message)");
            failed.push(format!("{test}::case {case:?}: {why}"));
        }
    }
    assert!(count > 0, "{test}: no cases");
    assert!(
        failed.is_empty(),
        "{} of {count} cases failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// Every pair of `a` and `b`, `a` varying slowest (the order the tables' rows always had).
pub fn product<A: Clone, B: Clone>(a: &[A], b: &[B]) -> Vec<(A, B)> {
    a.iter()
        .flat_map(|x| b.iter().map(move |y| (x.clone(), y.clone())))
        .collect()
}

/// Every triple of `a`, `b` and `c`, `a` varying slowest.
pub fn product3<A: Clone, B: Clone, C: Clone>(a: &[A], b: &[B], c: &[C]) -> Vec<(A, B, C)> {
    product(&product(a, b), c)
        .into_iter()
        .map(|((x, y), z)| (x, y, z))
        .collect()
}

/// The text of torch's own `version.py` under `site`: what names "this torch" in a cache key.
pub fn torch_version(site: &Option<std::path::PathBuf>) -> Option<String> {
    let site = site.as_ref()?;
    std::fs::read_to_string(site.join("torch/version.py")).ok()
}

/// A short digest of `value` (fixed-key SipHash: the same in every process of this build), to
/// name a cache entry by everything it depends on.
pub fn digest<T: std::hash::Hash + ?Sized>(value: &T) -> String {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    value.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// An exclusive `flock` on a file, held until dropped (released by the kernel if the holder
/// dies, so a killed test never leaves it taken): tests in other processes wait for it too.
pub struct FileLock {
    _held: std::fs::File,
}

impl FileLock {
    /// Waits for the lock on `path` (created if missing).
    pub fn take(path: &std::path::Path) -> std::io::Result<FileLock> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // SAFETY: flock on a descriptor this function owns.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(FileLock { _held: file })
    }
}
