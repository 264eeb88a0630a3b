//! Rendezvous: where each rank listens, what it publishes in the store ([`PeerInfo`]:
//! address, [`host_identity`], run label), and waiting until every rank has, naming the
//! ranks that never arrived.
//!
//! Apart from group connection ([`super::connect`]): this runs once per world, before any
//! group exists, and only talks to the store.

use super::options::{InitOptions, RENDEZVOUS_TIMEOUT_VAR};
use crate::comm::{CommError, StoreClient};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::time::Instant;

/// This process's host identity: machine id, boot id and network namespace. Two ranks with
/// the same identity can share memory; two network namespaces of one machine count as two
/// hosts (their loopback interfaces differ), and so do two boots of one machine image.
/// Where none of the three can be read, the identity is unique to this process, so shared
/// memory is never assumed.
pub fn host_identity() -> String {
    let read = |path: &str| {
        std::fs::read_to_string(path)
            .map(|s| s.trim().to_owned())
            .unwrap_or_default()
    };
    let mut machine = read("/etc/machine-id");
    if machine.is_empty() {
        machine = read("/var/lib/dbus/machine-id");
    }
    let boot = read("/proc/sys/kernel/random/boot_id");
    let net = std::fs::read_link("/proc/self/ns/net")
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    if machine.is_empty() && boot.is_empty() && net.is_empty() {
        return format!("process-{}", std::process::id());
    }
    format!("{machine}/{boot}/{net}")
}

/// What every rank publishes at rendezvous.
#[derive(Clone, Debug)]
pub(super) struct PeerInfo {
    /// `host:port` its peers dial.
    pub(super) addr: String,
    /// Its [`host_identity`].
    pub(super) host: String,
    /// Its [`InitOptions::run_label`].
    pub(super) label: String,
}

impl PeerInfo {
    pub(super) fn encode(&self) -> Vec<u8> {
        format!("{}\n{}\n{}", self.addr, self.host, self.label).into_bytes()
    }

    fn decode(bytes: &[u8]) -> PeerInfo {
        let text = String::from_utf8_lossy(bytes);
        let mut parts = text.splitn(3, '\n');
        let mut next = || parts.next().unwrap_or_default().to_owned();
        PeerInfo {
            addr: next(),
            host: next(),
            label: next(),
        }
    }
}

/// Where to listen and what to publish: `listen_host` if it names an address, else the
/// local end of the store connection (`local`), on loopback when that is loopback.
pub(super) fn listen_addresses(
    listen_host: &str,
    local: Option<SocketAddr>,
) -> Result<(SocketAddr, String), CommError> {
    let derived = || local.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |a| a.ip());
    let unspecified = |ip: IpAddr| match ip {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
    };
    let host = listen_host.trim();
    if host.is_empty() {
        let ip = derived();
        let bind = if ip.is_loopback() {
            ip
        } else {
            unspecified(ip)
        };
        return Ok((SocketAddr::new(bind, 0), ip.to_string()));
    }
    let bind = (host, 0)
        .to_socket_addrs()
        .map_err(|e| CommError::io(format!("resolve LOCKSTEP_HOST / listen host {host:?}"), e))?
        .next()
        .ok_or_else(|| {
            CommError::InvalidArgument(format!("listen host {host:?} resolves to nothing"))
        })?;
    if bind.ip().is_unspecified() {
        return Ok((bind, derived().to_string()));
    }
    Ok((bind, host.to_owned()))
}

/// Formats `host` and `port` as a dialable address (IPv6 literals in brackets).
pub(super) fn host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{host}:{port}"),
    }
}

/// Store key under which `rank` publishes its [`PeerInfo`].
pub(super) fn peer_key(opts: &InitOptions, rank: usize) -> String {
    format!("{}peer/{rank}", opts.namespace)
}

/// Waits until every rank has published its [`PeerInfo`], at most the rendezvous timeout;
/// past it, names the ranks that never arrived. Then checks every rank joined this run for
/// the same label.
pub(super) fn rendezvous(
    opts: &InitOptions,
    store: &StoreClient,
) -> Result<Vec<PeerInfo>, CommError> {
    let deadline = Instant::now() + opts.rendezvous_timeout;
    let mut peers = Vec::with_capacity(opts.world_size);
    for rank in 0..opts.world_size {
        let left = deadline.saturating_duration_since(Instant::now());
        match store.wait_get(&peer_key(opts, rank), left) {
            Ok(bytes) => peers.push(PeerInfo::decode(&bytes)),
            Err(CommError::Timeout { .. }) => {
                let mut missing = Vec::new();
                for r in rank..opts.world_size {
                    if !store.check(&peer_key(opts, r))? {
                        missing.push(r);
                    }
                }
                return Err(CommError::Timeout {
                    what: format!(
                        "rank(s) {missing:?} of {} to arrive at rendezvous (store {}): they did \
                         not start, crashed, could not reach the store or were refused by it \
                         (wrong LOCKSTEP_SECRET?); {RENDEZVOUS_TIMEOUT_VAR} sets this limit",
                        opts.world_size, opts.store_addr
                    ),
                    seconds: opts.rendezvous_timeout.as_secs_f64(),
                });
            }
            Err(e) => return Err(e),
        }
    }
    let mine = &opts.run_label;
    if let Some((rank, other)) = peers.iter().enumerate().find(|(_, p)| &p.label != mine) {
        return Err(CommError::InvalidArgument(format!(
            "rank {rank} joined this run ({}) for {:?} but rank {} joined it for {mine:?}: \
             every rank must run the same tests in the same order",
            opts.namespace, other.label, opts.rank
        )));
    }
    Ok(peers)
}
