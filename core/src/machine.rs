//! The facts about this process's libtorch that a numerical verdict can depend on, recorded
//! next to every verdict: the CPU capability ATen dispatches its kernels to (AVX-512 kernels
//! round some reductions differently from AVX2 or the scalar `DEFAULT` ones), the intra-op
//! thread count (a parallel reduction splits its sum by thread), and the libtorch version.
//! Two reports that disagree on these may disagree on bits without any bug.

use serde::{Deserialize, Serialize};

/// Where a run's numbers were computed: what [`environment`] reads from libtorch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Environment {
    /// `at::get_cpu_capability()`, what `torch.backends.cpu.get_cpu_capability()` returns
    /// (`AVX512`, `AVX2`, `DEFAULT`...; the `ATEN_CPU_CAPABILITY` variable lowers it), or
    /// `unknown (why)` when the bridge could not say.
    pub cpu_capability: String,
    /// libtorch's intra-op thread count in this process (`tch::get_num_threads()`).
    pub intra_op_threads: usize,
    /// The libtorch the binary was built against (read from the wheel at build time;
    /// `unknown` when it could not be read).
    pub libtorch_version: String,
    /// The GPU side, recorded when this process computed on CUDA: two CUDA reports that
    /// differ in GPU model, driver, CUDA, cuDNN, NCCL or the numerics switches may differ in
    /// bits without a bug. Absent on CPU runs (and in reports written before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuEnvironment>,
}

impl std::fmt::Display for Environment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CPU capability {}, {} intra-op thread{}, libtorch {}",
            self.cpu_capability,
            self.intra_op_threads,
            if self.intra_op_threads == 1 { "" } else { "s" },
            self.libtorch_version
        )?;
        if let Some(gpu) = &self.gpu {
            write!(f, "; {gpu}")?;
        }
        Ok(())
    }
}

/// The CPU capability ATen dispatches to (see [`Environment::cpu_capability`]).
pub fn cpu_capability() -> Result<String, crate::AutogradError> {
    crate::autograd::cpu_capability()
}

/// This process's [`Environment`], read now (the thread count is whatever the caller set),
/// with its GPU side once the process prepared itself to compute on CUDA
/// ([`make_cuda_deterministic`]); a CPU process never touches the driver here.
pub fn environment() -> Environment {
    Environment {
        cpu_capability: cpu_capability().unwrap_or_else(|e| format!("unknown ({e})")),
        intra_op_threads: usize::try_from(tch::get_num_threads()).unwrap_or(0),
        libtorch_version: env!("LOCKSTEP_LIBTORCH_VERSION").to_owned(),
        gpu: COMPUTES_ON_CUDA
            .load(std::sync::atomic::Ordering::Relaxed)
            .then(GpuEnvironment::read),
    }
}

/// Set by [`make_cuda_deterministic`]: this process computes on CUDA, so its reports record
/// the GPU side of their [`Environment`].
static COMPUTES_ON_CUDA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// libtorch's global switches that decide whether a CUDA run repeats bit for bit and which
/// arithmetic its matrix products use (`at::globalContext()`, what `torch.backends.*` and
/// `torch.use_deterministic_algorithms` set in Python). They have no effect on CPU kernels
/// except `deterministic_algorithms`, which also fills fresh `empty` tensors with NaN so a read
/// of uninitialized memory cannot pass unnoticed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Numerics {
    /// Ops without a deterministic kernel raise an error naming the op (instead of running
    /// atomics whose order varies), e.g. `index_add_` or embedding backward on CUDA.
    pub deterministic_algorithms: bool,
    /// cuDNN picks only deterministic algorithms.
    pub deterministic_cudnn: bool,
    /// cuDNN autotuning: picks kernels by timing, so two runs can pick differently.
    pub benchmark_cudnn: bool,
    /// TF32 matrix products (inputs rounded to a 10-bit mantissa): not fp32 arithmetic, so
    /// an fp32 verdict needs it off unless asked for (`--tf32`).
    pub tf32_matmul: bool,
    /// TF32 in cuDNN convolutions (PyTorch's default is on).
    pub tf32_cudnn: bool,
}

impl Numerics {
    /// What every process computing on CUDA runs with: deterministic kernels, no autotuning,
    /// TF32 only when `tf32` asks for it.
    pub fn deterministic(tf32: bool) -> Numerics {
        Numerics {
            deterministic_algorithms: true,
            deterministic_cudnn: true,
            benchmark_cudnn: false,
            tf32_matmul: tf32,
            tf32_cudnn: tf32,
        }
    }

    /// Sets these switches for this process (every thread, every device).
    pub fn apply(self) -> Result<(), crate::AutogradError> {
        crate::autograd::set_numerics(crate::autograd::LkNumerics {
            deterministic_algorithms: self.deterministic_algorithms.into(),
            deterministic_cudnn: self.deterministic_cudnn.into(),
            benchmark_cudnn: self.benchmark_cudnn.into(),
            tf32_cublas: self.tf32_matmul.into(),
            tf32_cudnn: self.tf32_cudnn.into(),
        })
    }

    /// The switches as they are now in this process.
    pub fn current() -> Result<Numerics, crate::AutogradError> {
        let n = crate::autograd::numerics()?;
        Ok(Numerics {
            deterministic_algorithms: n.deterministic_algorithms != 0,
            deterministic_cudnn: n.deterministic_cudnn != 0,
            benchmark_cudnn: n.benchmark_cudnn != 0,
            tf32_matmul: n.tf32_cublas != 0,
            tf32_cudnn: n.tf32_cudnn != 0,
        })
    }
}

impl std::fmt::Display for Numerics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = |b: bool| if b { "on" } else { "off" };
        write!(
            f,
            "deterministic algorithms {}, cuDNN deterministic {}, cuDNN benchmark {}, TF32 \
             matmul {}, TF32 cuDNN {}",
            on(self.deterministic_algorithms),
            on(self.deterministic_cudnn),
            on(self.benchmark_cudnn),
            on(self.tf32_matmul),
            on(self.tf32_cudnn)
        )
    }
}

/// Environment variables a process must have before it first uses CUDA for its runs to
/// repeat bit for bit: cuBLAS's fixed workspace (`:4096:8`, which PyTorch's deterministic
/// mode demands; without it cuBLAS may split a reduction differently run to run).
pub const CUDA_DETERMINISM_ENV: [(&str, &str); 1] = [("CUBLAS_WORKSPACE_CONFIG", ":4096:8")];

/// NCCL pinned to one algorithm and protocol, so a collective reduces in the same order in
/// every run (NCCL otherwise picks ring or tree, and a protocol, by size and topology).
pub const NCCL_DETERMINISM_ENV: [(&str, &str); 2] =
    [("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple")];

/// Sets [`CUDA_DETERMINISM_ENV`] (and, for NCCL, [`NCCL_DETERMINISM_ENV`]) in this process's
/// environment where the user has not set them, and applies [`Numerics::deterministic`]. Call
/// it before the first CUDA call of a process that computes on CUDA; exec'd children inherit
/// the variables.
pub fn make_cuda_deterministic(tf32: bool, nccl: bool) -> Result<Numerics, crate::AutogradError> {
    let nccl_env: &[(&str, &str)] = if nccl { &NCCL_DETERMINISM_ENV } else { &[] };
    for (key, value) in CUDA_DETERMINISM_ENV.iter().chain(nccl_env) {
        if std::env::var_os(key).is_none() {
            std::env::set_var(key, value);
        }
    }
    let numerics = Numerics::deterministic(tf32);
    numerics.apply()?;
    COMPUTES_ON_CUDA.store(true, std::sync::atomic::Ordering::Relaxed);
    Ok(numerics)
}

/// The GPU side of an [`Environment`]: the facts a CUDA verdict can depend on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEnvironment {
    /// Every visible GPU's name (`cuDeviceGetName`), in device order.
    pub gpus: Vec<String>,
    /// The driver's CUDA version (`cuDriverGetVersion`, e.g. `13.0`), or why it is unknown.
    pub driver_cuda: String,
    /// The CUDA runtime libtorch loads (e.g. `13.0`), `none` without one.
    pub cuda_runtime: String,
    /// The cuDNN libtorch loads (e.g. `9.13.0`), `none` without one.
    pub cudnn: String,
    /// The numerics switches in force when it was read.
    pub numerics: Option<Numerics>,
    /// The cuBLAS workspace setting (`CUBLAS_WORKSPACE_CONFIG`), `unset` without one.
    pub cublas_workspace: String,
}

impl GpuEnvironment {
    /// Reads the GPU side of this process: the driver through `libcuda.so.1` (no CUDA
    /// headers needed, and nothing fails on a machine without a driver: the fields say so),
    /// the runtime and cuDNN through libtorch.
    pub fn read() -> GpuEnvironment {
        let (cudart, cudnn) = crate::autograd::cuda_versions().unwrap_or((0, 0));
        let driver = driver::read();
        GpuEnvironment {
            gpus: driver.as_ref().map(|d| d.gpus.clone()).unwrap_or_default(),
            driver_cuda: match &driver {
                Ok(d) => cuda_version_text(d.version),
                Err(why) => format!("unknown ({why})"),
            },
            cuda_runtime: if cudart > 0 {
                cuda_version_text(cudart)
            } else {
                "none".into()
            },
            cudnn: if cudnn > 0 {
                format!("{}.{}.{}", cudnn / 10000, (cudnn / 100) % 100, cudnn % 100)
            } else {
                "none".into()
            },
            numerics: Numerics::current().ok(),
            cublas_workspace: std::env::var("CUBLAS_WORKSPACE_CONFIG")
                .unwrap_or_else(|_| "unset".into()),
        }
    }
}

impl std::fmt::Display for GpuEnvironment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gpus = if self.gpus.is_empty() {
            "no GPU".to_owned()
        } else {
            self.gpus.join(", ")
        };
        write!(
            f,
            "{gpus}, driver CUDA {}, runtime CUDA {}, cuDNN {}, cuBLAS workspace {}",
            self.driver_cuda, self.cuda_runtime, self.cudnn, self.cublas_workspace
        )?;
        if let Some(n) = &self.numerics {
            write!(f, ", {n}")?;
        }
        Ok(())
    }
}

/// `13000` → `13.0`: CUDA's version integers are `1000 * major + 10 * minor`.
fn cuda_version_text(v: i64) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// The CUDA driver API, opened at run time so a machine without a driver reads "no driver".
mod driver {
    use std::ffi::{c_char, c_int, CStr};

    /// What the driver says.
    pub struct Driver {
        pub version: i64,
        pub gpus: Vec<String>,
    }

    type CuInit = unsafe extern "C" fn(u32) -> c_int;
    type CuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
    type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
    type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
    type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;

    /// Opens `libcuda.so.1` (the copy already loaded, if any) and reads the version and names.
    pub fn read() -> Result<Driver, String> {
        // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast to the type the
        // CUDA driver API documents for it; the handle is never closed (the driver stays
        // loaded, as libtorch keeps it).
        unsafe {
            let handle = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            if handle.is_null() {
                return Err("no NVIDIA driver: libcuda.so.1 cannot be loaded".into());
            }
            let sym = |name: &CStr| {
                let p = libc::dlsym(handle, name.as_ptr());
                if p.is_null() {
                    Err(format!("libcuda.so.1 has no {}", name.to_string_lossy()))
                } else {
                    Ok(p)
                }
            };
            let init: CuInit = std::mem::transmute(sym(c"cuInit")?);
            let get_version: CuDriverGetVersion = std::mem::transmute(sym(c"cuDriverGetVersion")?);
            let count: CuDeviceGetCount = std::mem::transmute(sym(c"cuDeviceGetCount")?);
            let get: CuDeviceGet = std::mem::transmute(sym(c"cuDeviceGet")?);
            let name: CuDeviceGetName = std::mem::transmute(sym(c"cuDeviceGetName")?);
            let mut version: c_int = 0;
            if get_version(&mut version) != 0 {
                return Err("cuDriverGetVersion failed".into());
            }
            let mut gpus = Vec::new();
            let mut n: c_int = 0;
            if init(0) == 0 && count(&mut n) == 0 {
                for i in 0..n {
                    let mut dev: c_int = 0;
                    let mut buf = [0 as c_char; 256];
                    if get(&mut dev, i) == 0 && name(buf.as_mut_ptr(), 256, dev) == 0 {
                        gpus.push(CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned());
                    }
                }
            }
            Ok(Driver {
                version: i64::from(version),
                gpus,
            })
        }
    }
}
