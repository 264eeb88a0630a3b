//! Connecting a group's members: the accept loop that routes incoming peer connections by
//! group key, the handshake (run secret, group key, dialer's rank), dialing lower ranks and
//! waiting for higher ones, and building the group on the chosen backend (CPU links and
//! shared memory, or NCCL).
//!
//! Apart from [`World`](super::World), which decides which groups exist, and from
//! rendezvous ([`super::rendezvous`]), which only finds the peers.

use super::options::{Backend, InitOptions};
use super::rendezvous::PeerInfo;
use crate::comm::cpu::{link::Link, CpuGroup};
use crate::comm::work::lock;
use crate::comm::{CommError, ProcessGroup, StoreClient};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const CONN_MAGIC: &[u8; 8] = b"LKCONN01";

/// Incoming peer connections not yet claimed by a group, keyed by (group key, dialer rank).
pub(super) struct Router {
    pub(super) waiting: Mutex<HashMap<(String, usize), TcpStream>>,
    pub(super) arrived: Condvar,
}

pub(super) fn accept_loop(listener: TcpListener, router: &Router, secret: &str) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
        let Some((key, from)) = read_handshake(&mut stream, secret) else {
            // Wrong secret or not a Lockstep peer: drop the connection.
            continue;
        };
        let _ = stream.set_read_timeout(None);
        lock(&router.waiting).insert((key, from), stream);
        router.arrived.notify_all();
    }
}

fn read_handshake(stream: &mut TcpStream, secret: &str) -> Option<(String, usize)> {
    let mut magic = [0u8; 8];
    stream.read_exact(&mut magic).ok()?;
    if &magic != CONN_MAGIC {
        return None;
    }
    let read_str = |s: &mut TcpStream| -> Option<String> {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).ok()?;
        let len = u32::from_le_bytes(len) as usize;
        if len > 4096 {
            return None;
        }
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).ok()?;
        String::from_utf8(buf).ok()
    };
    if read_str(stream)? != secret {
        return None;
    }
    let key = read_str(stream)?;
    let mut rank = [0u8; 8];
    stream.read_exact(&mut rank).ok()?;
    stream.write_all(&[1]).ok()?;
    Some((key, u64::from_le_bytes(rank) as usize))
}

fn dial(
    addr: &str,
    secret: &str,
    key: &str,
    my_rank: usize,
    deadline: Instant,
) -> Result<TcpStream, CommError> {
    let mut stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= deadline => {
                return Err(CommError::io(format!("connect to peer at {addr}"), e))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    };
    let io = |e| CommError::io(format!("handshake with peer at {addr}"), e);
    let mut hello = Vec::new();
    hello.extend_from_slice(CONN_MAGIC);
    for s in [secret, key] {
        hello.extend_from_slice(&(s.len() as u32).to_le_bytes());
        hello.extend_from_slice(s.as_bytes());
    }
    hello.extend_from_slice(&(my_rank as u64).to_le_bytes());
    stream.write_all(&hello).map_err(io)?;
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).map_err(io)?;
    Ok(stream)
}

#[allow(clippy::too_many_arguments)]
pub(super) fn connect_group(
    opts: &InitOptions,
    store: &StoreClient,
    router: &Router,
    peers: &[PeerInfo],
    within: Duration,
    key: &str,
    name: &str,
    ranks: &[usize],
) -> Result<Arc<dyn ProcessGroup>, CommError> {
    let me = ranks.iter().position(|&r| r == opts.rank).ok_or_else(|| {
        CommError::InvalidArgument(format!("rank {} is not in group {ranks:?}", opts.rank))
    })?;
    if opts.backend == Backend::Nccl {
        return connect_nccl(
            opts,
            store,
            &format!("{}{key}", opts.namespace),
            name,
            me,
            ranks,
        );
    }
    let deadline = Instant::now() + within;
    let mut streams: Vec<Option<TcpStream>> = (0..ranks.len()).map(|_| None).collect();
    // Dial every lower rank first, then wait for the higher ranks to dial us.
    for (peer, &global) in ranks.iter().enumerate().take(me) {
        let addr = &peers[global].addr;
        streams[peer] = Some(dial(addr, &opts.secret, key, opts.rank, deadline)?);
    }
    for (peer, &global) in ranks.iter().enumerate().skip(me + 1) {
        let mut waiting = lock(&router.waiting);
        loop {
            if let Some(s) = waiting.remove(&(key.to_owned(), global)) {
                streams[peer] = Some(s);
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    what: format!("rank {global} to connect for group {name}"),
                    seconds: within.as_secs_f64(),
                });
            }
            waiting = router
                .arrived
                .wait_timeout(waiting, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
    let mut links = Vec::with_capacity(ranks.len());
    for (peer, stream) in streams.into_iter().enumerate() {
        links.push(match stream {
            Some(s) => Some(Link::start(s, peer, ranks[peer], name)?),
            None => None,
        });
    }
    let mine = &peers[opts.rank].host;
    let same_host = ranks.iter().all(|&r| &peers[r].host == mine)
        && std::env::var("LOCKSTEP_SHM").map_or(true, |v| v != "0");
    Ok(Arc::new(CpuGroup::new(
        name.to_owned(),
        me,
        ranks.to_vec(),
        links,
        opts.timeout,
        same_host.then_some(opts.shm_tag.as_str()),
        opts.p2p,
    )?))
}

#[cfg(feature = "nccl")]
fn connect_nccl(
    opts: &InitOptions,
    store: &StoreClient,
    key: &str,
    name: &str,
    me: usize,
    ranks: &[usize],
) -> Result<Arc<dyn ProcessGroup>, CommError> {
    let group = crate::comm::nccl::NcclGroup::connect(
        store,
        key,
        name.to_owned(),
        me,
        ranks.to_vec(),
        opts.device,
    )?;
    Ok(Arc::new(group))
}

#[cfg(not(feature = "nccl"))]
fn connect_nccl(
    _: &InitOptions,
    _: &StoreClient,
    _: &str,
    _: &str,
    _: usize,
    _: &[usize],
) -> Result<Arc<dyn ProcessGroup>, CommError> {
    Err(CommError::Nccl(
        "this build has no NCCL backend: rebuild with `--features nccl`".into(),
    ))
}
