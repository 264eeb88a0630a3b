//! Host views of tensors: the CPU backend works on contiguous host bytes, staging CUDA or
//! strided tensors through a host copy and writing results back when the operation ends.

use crate::comm::{CommError, DType};
use tch::{Device, Tensor};

/// A tensor's host-side, contiguous stand-in for the duration of one operation.
pub struct Staged {
    user: Tensor,
    host: Tensor,
    copy_back: bool,
    pub dtype: DType,
}

// SAFETY: tch tensors are reference-counted handles that libtorch lets any thread use; the
// operation owning a `Staged` is the only code touching it while it runs.
unsafe impl Send for Staged {}

impl Staged {
    /// Stages `t`; `writes` says whether the operation's result must be copied back into it.
    pub fn new(t: &Tensor, writes: bool) -> Result<Self, CommError> {
        let dtype = DType::from_kind(t.kind())?;
        let on_host = t.device() == Device::Cpu && t.is_contiguous();
        let host = if on_host {
            t.shallow_clone()
        } else {
            t.f_to_device(Device::Cpu)?.f_contiguous()?
        };
        Ok(Staged {
            user: t.shallow_clone(),
            host,
            copy_back: writes && !on_host,
            dtype,
        })
    }

    /// Element count.
    pub fn numel(&self) -> usize {
        self.host.numel()
    }

    /// Byte length of the data.
    pub fn len(&self) -> usize {
        self.numel() * self.dtype.size()
    }

    /// Shape as the user passed it.
    pub fn shape(&self) -> Vec<i64> {
        self.user.size()
    }

    /// Start of the host bytes. Valid while `self` lives.
    pub fn ptr(&self) -> *mut u8 {
        self.host.data_ptr() as *mut u8
    }

    /// The host bytes, read-only.
    pub fn bytes(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: `host` is contiguous, on the CPU and alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len()) }
    }

    /// Copies the host result back into the user's tensor when it was staged.
    pub fn finish(self) -> Result<(), CommError> {
        if self.copy_back {
            let mut user = self.user;
            user.f_copy_(&self.host)?;
        }
        Ok(())
    }
}
