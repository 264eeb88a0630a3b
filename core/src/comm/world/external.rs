//! Joining a run an external launcher started (torchrun, SLURM, a script): reading the
//! launcher's environment ([`ExternalLaunch`], [`torchelastic_in_env`]) and the store rank 0
//! hosts once per process.
//!
//! Apart from [`World`](super::World) because it only turns environment variables into
//! options and a store; [`World::from_env_for`](super::World::from_env_for) is the one
//! caller.

use crate::comm::work::lock;
use crate::comm::{CommError, StoreServer};
use std::net::IpAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Run number of the next [`super::World::from_env_for`] in this process.
pub(super) static EXTERNAL_RUNS: AtomicU64 = AtomicU64::new(0);

/// The store rank 0 hosts under an external launch: (bind address, secret, server). Kept
/// for the whole process, so a second run (the next test) never meets a closed or rebound
/// port; runs are kept apart by their key namespace.
static HOSTED: Mutex<Option<(String, String, Arc<StoreServer>)>> = Mutex::new(None);

pub(super) fn hosted_store(bind: &str, secret: &str) -> Result<Arc<StoreServer>, CommError> {
    let mut hosted = lock(&HOSTED);
    if let Some((b, s, server)) = hosted.as_ref() {
        if b == bind && s == secret {
            return Ok(server.clone());
        }
    }
    *hosted = None;
    let server = StoreServer::start(bind, secret).map_err(|e| match e {
        CommError::Io { source, .. } => CommError::io(
            format!(
                "store: bind {bind} (something else holds the store port; under torchrun \
                 Lockstep uses MASTER_PORT+1, LOCKSTEP_STORE_PORT chooses another)"
            ),
            source,
        ),
        other => other,
    })?;
    let server = Arc::new(server);
    *hosted = Some((bind.to_owned(), secret.to_owned(), server.clone()));
    Ok(server)
}

/// Environment variable naming the port of Lockstep's store under an external launch.
pub const STORE_PORT_VAR: &str = "LOCKSTEP_STORE_PORT";

/// What an external launcher (torchrun, SLURM, a script) told this process, read from the
/// environment: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default 0), `MASTER_ADDR`,
/// `MASTER_PORT`, `LOCKSTEP_SECRET` (default empty), `LOCKSTEP_HOST` (default: derived),
/// `LOCKSTEP_STORE_PORT` (default: `MASTER_PORT`, or `MASTER_PORT + 1` under torchrun,
/// whose own store holds `MASTER_PORT`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExternalLaunch {
    /// `RANK`.
    pub rank: usize,
    /// `WORLD_SIZE`.
    pub world_size: usize,
    /// `LOCAL_RANK`: the rank's device on its host.
    pub local_rank: usize,
    /// `MASTER_ADDR`: rank 0's host, where the store runs.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// The port Lockstep's store uses.
    pub store_port: u16,
    /// Whether torchrun (torchelastic) started this process (`TORCHELASTIC_*` is set).
    pub under_torchrun: bool,
    /// `LOCKSTEP_SECRET`.
    pub secret: String,
    /// `LOCKSTEP_HOST`, empty when unset (then derived from the store connection).
    pub listen_host: String,
}

impl ExternalLaunch {
    /// Reads the environment; a missing or malformed variable is named in the error.
    pub fn from_env() -> Result<Self, CommError> {
        Self::from_vars(|name| std::env::var(name).ok(), torchelastic_in_env())
    }

    /// As [`ExternalLaunch::from_env`], from any variable source (tests use a map).
    pub fn from_vars(
        var: impl Fn(&str) -> Option<String>,
        under_torchrun: bool,
    ) -> Result<Self, CommError> {
        let get = |name: &str| {
            var(name).ok_or_else(|| {
                CommError::InvalidArgument(format!("environment variable {name} is not set"))
            })
        };
        let num = |name: &str, text: String| -> Result<usize, CommError> {
            text.trim().parse().map_err(|_| {
                CommError::InvalidArgument(format!("{name}={text:?} is not a non-negative integer"))
            })
        };
        let port = |name: &str, text: String| -> Result<u16, CommError> {
            text.trim().parse().map_err(|_| {
                CommError::InvalidArgument(format!("{name}={text:?} is not a port number"))
            })
        };
        let rank = num("RANK", get("RANK")?)?;
        let world_size = num("WORLD_SIZE", get("WORLD_SIZE")?)?;
        let local_rank = match var("LOCAL_RANK") {
            Some(v) => num("LOCAL_RANK", v)?,
            None => 0,
        };
        let master_addr = get("MASTER_ADDR")?;
        let master_port = port("MASTER_PORT", get("MASTER_PORT")?)?;
        let store_port = match var(STORE_PORT_VAR).filter(|v| !v.trim().is_empty()) {
            Some(v) => port(STORE_PORT_VAR, v)?,
            None if under_torchrun => master_port.checked_add(1).ok_or_else(|| {
                CommError::InvalidArgument(format!(
                    "MASTER_PORT={master_port} leaves no port above it for Lockstep's store \
                     (torchrun's holds MASTER_PORT): set {STORE_PORT_VAR}"
                ))
            })?,
            None => master_port,
        };
        Ok(ExternalLaunch {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
            store_port,
            under_torchrun,
            secret: var("LOCKSTEP_SECRET").unwrap_or_default(),
            listen_host: var("LOCKSTEP_HOST").unwrap_or_default(),
        })
    }

    /// Where rank 0 binds the store: loopback when `MASTER_ADDR` is, else every interface.
    pub fn store_bind(&self) -> String {
        let loopback = self.master_addr == "localhost"
            || self
                .master_addr
                .parse::<IpAddr>()
                .is_ok_and(|ip| ip.is_loopback());
        let ip = if loopback { "127.0.0.1" } else { "0.0.0.0" };
        format!("{ip}:{}", self.store_port)
    }
}

/// Whether torchrun started this process: it sets `TORCHELASTIC_RUN_ID`,
/// `TORCHELASTIC_RESTART_COUNT` and other `TORCHELASTIC_*` variables in every worker.
pub fn torchelastic_in_env() -> bool {
    std::env::vars_os().any(|(k, _)| k.to_string_lossy().starts_with("TORCHELASTIC_"))
}
