//! Shared-memory data path for ranks on one host.
//!
//! Over loopback TCP every byte is copied into and out of the kernel; through shared memory a
//! rank publishes its buffer once and every peer reads it directly. Each rank owns one POSIX
//! shared-memory slot per group, grown on demand; peers learn its name from the control
//! messages that separate the phases of an operation (sent over the group's TCP links, so
//! they still carry the operation's header and catch mismatched collectives). A slot's name is
//! unlinked as soon as every peer has mapped it, so a killed run leaves nothing in /dev/shm
//! except, at worst, a slot created in the instant before it died.

use crate::comm::CommError;
use std::ffi::CString;

/// A mapping of one rank's slot.
pub struct Mapping {
    pub name: String,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; access is sequenced by the group's executor and
// the control messages between phases.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Start of the mapped bytes.
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    fn map(name: &str, len: usize, create: bool) -> Result<Mapping, CommError> {
        let cname = CString::new(name)
            .map_err(|_| CommError::InvalidArgument(format!("bad shm name {name:?}")))?;
        let err = |what: &str| {
            CommError::io(
                format!("shared memory {what} {name}"),
                std::io::Error::last_os_error(),
            )
        };
        let flags = if create {
            libc::O_CREAT | libc::O_EXCL | libc::O_RDWR
        } else {
            libc::O_RDWR
        };
        // SAFETY: plain POSIX calls on a name we own; every result is checked.
        unsafe {
            let fd = libc::shm_open(cname.as_ptr(), flags, 0o600);
            if fd < 0 {
                return Err(err("open"));
            }
            if create && libc::ftruncate(fd, len as libc::off_t) != 0 {
                let e = err("resize");
                libc::close(fd);
                libc::shm_unlink(cname.as_ptr());
                return Err(e);
            }
            let ptr = libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            );
            libc::close(fd);
            if ptr == libc::MAP_FAILED {
                return Err(err("map"));
            }
            Ok(Mapping {
                name: name.to_owned(),
                ptr: ptr as *mut u8,
                len,
            })
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map` mapped.
        unsafe {
            libc::munmap(self.ptr as *mut libc::c_void, self.len.max(1));
        }
    }
}

/// This rank's slot and its mappings of the peers' slots, for one group.
pub struct ShmArea {
    prefix: String,
    generation: u64,
    own: Option<Mapping>,
    /// Whether `own`'s name still exists in /dev/shm.
    own_linked: bool,
    peers: Vec<Option<Mapping>>,
}

impl ShmArea {
    /// An empty area; `prefix` makes slot names unique to this process and group.
    pub fn new(prefix: String, size: usize) -> Self {
        ShmArea {
            prefix,
            generation: 0,
            own: None,
            own_linked: false,
            peers: (0..size).map(|_| None).collect(),
        }
    }

    /// This rank's slot, at least `len` bytes (a bigger one replaces a smaller one).
    pub fn own(&mut self, len: usize) -> Result<&Mapping, CommError> {
        let big_enough = self.own.as_ref().is_some_and(|m| m.len >= len);
        if !big_enough {
            self.unlink_own();
            self.generation += 1;
            // Grow geometrically so a series of slightly larger messages maps once.
            let len = len
                .max(self.own.as_ref().map_or(0, |m| m.len * 2))
                .max(1 << 20);
            let name = format!("{}-{}", self.prefix, self.generation);
            self.own = Some(Mapping::map(&name, len, true)?);
            self.own_linked = true;
        }
        self.own
            .as_ref()
            .ok_or_else(|| CommError::InvalidArgument("shared memory slot missing".into()))
    }

    /// The control payload announcing this rank's slot: its name and length.
    pub fn announce(&self) -> Vec<u8> {
        match &self.own {
            Some(m) => format!("{}\n{}", m.name, m.len).into_bytes(),
            None => Vec::new(),
        }
    }

    /// Maps (or keeps) peer `p`'s slot as announced.
    pub fn peer(&mut self, p: usize, announcement: &[u8]) -> Result<*mut u8, CommError> {
        let text = String::from_utf8_lossy(announcement);
        let (name, len) = text
            .split_once('\n')
            .and_then(|(n, l)| Some((n.to_owned(), l.parse::<usize>().ok()?)))
            .ok_or_else(|| {
                CommError::Mismatch(format!("rank {p} announced no shared-memory slot"))
            })?;
        let slot = self
            .peers
            .get_mut(p)
            .ok_or_else(|| CommError::InvalidArgument(format!("no peer {p}")))?;
        if slot.as_ref().is_none_or(|m| m.name != name) {
            *slot = Some(Mapping::map(&name, len, false)?);
        }
        slot.as_ref()
            .map(Mapping::ptr)
            .ok_or_else(|| CommError::InvalidArgument("peer slot missing".into()))
    }

    /// Removes this rank's slot name once every peer has mapped it.
    pub fn unlink_own(&mut self) {
        if self.own_linked {
            if let Some(m) = &self.own {
                if let Ok(c) = CString::new(m.name.as_str()) {
                    // SAFETY: unlinking a name this rank created.
                    unsafe {
                        libc::shm_unlink(c.as_ptr());
                    }
                }
            }
            self.own_linked = false;
        }
    }
}

impl Drop for ShmArea {
    fn drop(&mut self) {
        self.unlink_own();
    }
}
