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
        )
    }
}

/// The CPU capability ATen dispatches to (see [`Environment::cpu_capability`]).
pub fn cpu_capability() -> Result<String, crate::AutogradError> {
    crate::autograd::cpu_capability()
}

/// This process's [`Environment`], read now (the thread count is whatever the caller set).
pub fn environment() -> Environment {
    Environment {
        cpu_capability: cpu_capability().unwrap_or_else(|e| format!("unknown ({e})")),
        intra_op_threads: usize::try_from(tch::get_num_threads()).unwrap_or(0),
        libtorch_version: env!("LOCKSTEP_LIBTORCH_VERSION").to_owned(),
    }
}
