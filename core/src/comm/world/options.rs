//! What a rank needs to join a run: [`InitOptions`], the [`Backend`] its groups use, and
//! the default timeouts (collective and rendezvous) with the variables that set them.
//!
//! Apart from [`World`](super::World) because these are plain settings, read by a launcher
//! or a test before any connection exists.

use crate::comm::CommError;
use std::time::Duration;

/// Which engine runs the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Deterministic Rust collectives over TCP; CUDA tensors are staged through host memory.
    Cpu,
    /// NCCL on CUDA devices (feature `nccl`).
    Nccl,
}

impl Backend {
    /// The backend's name as command lines, records and launchers spell it (what
    /// [`FromStr`](std::str::FromStr) reads back).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Nccl => "nccl",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s {
            "cpu" => Ok(Backend::Cpu),
            "nccl" => Ok(Backend::Nccl),
            other => Err(CommError::InvalidArgument(format!(
                "unknown backend {other:?}; expected cpu or nccl"
            ))),
        }
    }
}

/// What a rank needs to join a run.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// This rank, 0-based.
    pub rank: usize,
    /// Ranks in the run; every rank must pass the same value.
    pub world_size: usize,
    /// `host:port` of the store.
    pub store_addr: String,
    /// The run's secret, presented to the store and to every peer.
    pub secret: String,
    /// Address this rank listens on for peers and publishes to them. Empty: derived from the
    /// store connection (its local address, so peers on other hosts can reach it; loopback
    /// when the store is local). An unspecified address (`0.0.0.0`) listens everywhere and
    /// publishes the derived one.
    pub listen_host: String,
    /// Which process-group implementation the world uses.
    pub backend: Backend,
    /// CUDA device for the NCCL backend (usually `LOCAL_RANK`).
    pub device: usize,
    /// How long any single wait inside a collective (or a later group's creation) may take.
    pub timeout: Duration,
    /// How long joining may take: reaching the store, every rank arriving, the world group
    /// connecting. Short, so a rank that never comes is named quickly.
    pub rendezvous_timeout: Duration,
    /// Prefix of every store key this run uses, so several runs sharing one store (tests in
    /// one externally launched process) never see each other's keys.
    pub namespace: String,
    /// What this rank is running (a test name), published at rendezvous: ranks that joined
    /// one run for different tests fail with both names instead of mixing their messages.
    pub run_label: String,
    /// Names this run's shared-memory slots (`/dev/shm/lockstep-{shm_tag}-…`); a launcher
    /// that sets it removes what ranks that died mid-operation left behind.
    pub shm_tag: String,
    /// When a CPU-backend send completes: at once (buffered), or only once its receive is
    /// posted (NCCL's rendezvous), to prove on the CPU that nothing relies on buffering.
    pub p2p: PointToPoint,
}

/// When a send completes on the CPU backend.
///
/// NCCL's `ncclSend` completes only once the peer posted the matching `ncclRecv`: two ranks
/// that both send before they receive hang there as soon as the messages are too large for
/// NCCL to buffer. The CPU backend normally completes a send at once (it copies the bytes),
/// which hides such code; [`PointToPoint::Rendezvous`] gives it NCCL's rule, so a CPU run
/// proves the code never relies on buffered sends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PointToPoint {
    /// A send completes when its bytes are handed to the transport.
    #[default]
    Buffered,
    /// A send completes only once the receiver posted the matching receive.
    Rendezvous,
}

/// Environment variable choosing [`PointToPoint`] for every rank of a run: `buffered`
/// (the default) or `rendezvous`. Launched ranks inherit it.
pub const P2P_VAR: &str = "LOCKSTEP_P2P";

impl PointToPoint {
    /// The mode as [`P2P_VAR`] and command lines spell it.
    pub fn name(self) -> &'static str {
        match self {
            PointToPoint::Buffered => "buffered",
            PointToPoint::Rendezvous => "rendezvous",
        }
    }

    /// The mode [`P2P_VAR`] names; buffered when it is unset. A value that names no mode is
    /// an error, not a silent default: a run meant to prove rendezvous must not run buffered.
    pub fn from_env() -> Result<Self, CommError> {
        match std::env::var(P2P_VAR) {
            Ok(v) => v.parse(),
            Err(_) => Ok(PointToPoint::Buffered),
        }
    }
}

impl std::str::FromStr for PointToPoint {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, CommError> {
        match s.trim() {
            "buffered" | "" => Ok(PointToPoint::Buffered),
            "rendezvous" => Ok(PointToPoint::Rendezvous),
            other => Err(CommError::InvalidArgument(format!(
                "{P2P_VAR}={other:?} names no point-to-point mode; expected buffered or rendezvous"
            ))),
        }
    }
}

impl InitOptions {
    /// Options for `rank` of `world_size` on loopback with the CPU backend.
    pub fn local(
        rank: usize,
        world_size: usize,
        store_addr: impl Into<String>,
        secret: impl Into<String>,
    ) -> Self {
        InitOptions {
            rank,
            world_size,
            store_addr: store_addr.into(),
            secret: secret.into(),
            listen_host: "127.0.0.1".into(),
            backend: Backend::Cpu,
            device: 0,
            timeout: default_timeout(),
            rendezvous_timeout: default_rendezvous_timeout(),
            namespace: "lockstep/".into(),
            run_label: String::new(),
            shm_tag: format!("p{}", std::process::id()),
            p2p: PointToPoint::default(),
        }
    }
}

/// Environment variable for the rendezvous timeout, in seconds.
pub const RENDEZVOUS_TIMEOUT_VAR: &str = "LOCKSTEP_RENDEZVOUS_TIMEOUT_SECS";

/// The default rendezvous timeout: `LOCKSTEP_RENDEZVOUS_TIMEOUT_SECS` or 60 s. Separate from
/// the collective timeout so that a rank that never arrives (it crashed, has a wrong secret,
/// cannot reach the store) is named within a minute, not after half an hour.
pub fn default_rendezvous_timeout() -> Duration {
    std::env::var(RENDEZVOUS_TIMEOUT_VAR)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(60))
}

/// The default collective timeout: `LOCKSTEP_COMM_TIMEOUT_SECS` or 30 minutes. Launchers
/// detect hangs earlier and print every rank's flight recorder.
pub fn default_timeout() -> Duration {
    std::env::var("LOCKSTEP_COMM_TIMEOUT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .map(Duration::from_secs_f64)
        .unwrap_or(Duration::from_secs(1800))
}
