//! Rendezvous and group creation: how ranks find each other and build process groups.
//!
//! Every rank listens on one TCP port, publishes `host:port` in the store, and connects to
//! the members of each group it joins (the higher rank dials the lower one; each connection
//! opens with the run secret, the group's key and the dialer's rank). Groups are created by
//! every rank of the world in the same order, as `torch.distributed.new_group` requires.

use crate::comm::cpu::{link::Link, CpuGroup};
use crate::comm::work::lock;
use crate::comm::{CommError, ProcessGroup, StoreClient, StoreServer};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const CONN_MAGIC: &[u8; 8] = b"LKCONN01";

/// Which engine runs the collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Deterministic Rust collectives over TCP; CUDA tensors are staged through host memory.
    Cpu,
    /// NCCL on CUDA devices (feature `nccl`).
    Nccl,
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
    /// Address this rank listens on for peers (`127.0.0.1` unless multi-node).
    pub listen_host: String,
    /// Which process-group implementation the world uses.
    pub backend: Backend,
    /// CUDA device for the NCCL backend (usually `LOCAL_RANK`).
    pub device: usize,
    /// How long rendezvous and any single wait inside a collective may take.
    pub timeout: Duration,
    /// Names this run's shared-memory slots (`/dev/shm/lockstep-{shm_tag}-…`); a launcher
    /// that sets it removes what ranks that died mid-operation left behind.
    pub shm_tag: String,
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
            shm_tag: format!("p{}", std::process::id()),
        }
    }
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

/// Wraps a process group in another that delegates to it (a [`crate::comm::FaultyGroup`], a
/// [`crate::comm::CountingGroup`]): see [`World::set_group_wrapper`].
pub type GroupWrapper = Arc<dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> + Send + Sync>;

/// The wrapper a world applies to the groups it hands out, with the world group wrapped once
/// (so every caller of [`World::group`] shares one wrapped group and its state).
struct Wrapping {
    wrap: GroupWrapper,
    world: Arc<dyn ProcessGroup>,
}

/// Incoming peer connections not yet claimed by a group, keyed by (group key, dialer rank).
struct Router {
    waiting: Mutex<HashMap<(String, usize), TcpStream>>,
    arrived: Condvar,
}

/// This process's membership in a run: its rank, the store, and the world group.
pub struct World {
    rank: usize,
    size: usize,
    opts: InitOptions,
    store: Arc<StoreClient>,
    router: Arc<Router>,
    groups_created: AtomicU64,
    world: Arc<dyn ProcessGroup>,
    /// What every group handed out goes through, if anything (fault injection).
    wrapping: Mutex<Option<Wrapping>>,
    /// The store, when this rank hosts it (external launch, rank 0).
    _hosted_store: Option<StoreServer>,
}

impl World {
    /// Joins a run: connects to the store, publishes this rank's address and builds the world
    /// group.
    pub fn init(opts: InitOptions) -> Result<World, CommError> {
        Self::init_hosting(opts, None)
    }

    fn init_hosting(opts: InitOptions, hosted: Option<StoreServer>) -> Result<World, CommError> {
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {} is not in a world of size {}",
                opts.rank, opts.world_size
            )));
        }
        let store = Arc::new(StoreClient::connect(
            &opts.store_addr,
            &opts.secret,
            opts.timeout,
        )?);
        let listener = TcpListener::bind((opts.listen_host.as_str(), 0))
            .map_err(|e| CommError::io(format!("listen on {}", opts.listen_host), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("listener address", e))?
            .port();
        store.set(
            &format!("lockstep/addr/{}", opts.rank),
            format!("{}:{port}", opts.listen_host).as_bytes(),
        )?;
        let router = Arc::new(Router {
            waiting: Mutex::new(HashMap::new()),
            arrived: Condvar::new(),
        });
        let accept_router = router.clone();
        let secret = opts.secret.clone();
        std::thread::Builder::new()
            .name("lockstep-accept".into())
            .spawn(move || accept_loop(listener, &accept_router, &secret))
            .map_err(|e| CommError::io("spawn accept thread", e))?;
        let all: Vec<usize> = (0..opts.world_size).collect();
        let world = connect_group(&opts, &store, &router, "world", "world", &all)?;
        Ok(World {
            rank: opts.rank,
            size: opts.world_size,
            opts,
            store,
            router,
            groups_created: AtomicU64::new(0),
            world,
            wrapping: Mutex::new(None),
            _hosted_store: hosted,
        })
    }

    /// Joins a run started by torchrun, SLURM or any launcher that sets `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK` for the device). Rank 0 hosts the store
    /// on `MASTER_ADDR:MASTER_PORT`; the secret is `LOCKSTEP_SECRET` (empty if unset, which
    /// only protects against accidents, not other users). Peers listen on `LOCKSTEP_HOST`
    /// (default: `MASTER_ADDR` when it is loopback, else all interfaces' hostname address).
    pub fn from_env(backend: Backend) -> Result<World, CommError> {
        let var = |name: &str| {
            std::env::var(name).map_err(|_| {
                CommError::InvalidArgument(format!("environment variable {name} is not set"))
            })
        };
        let num = |name: &str| -> Result<usize, CommError> {
            var(name)?.parse().map_err(|_| {
                CommError::InvalidArgument(format!("{name} is not a non-negative integer"))
            })
        };
        let rank = num("RANK")?;
        let world_size = num("WORLD_SIZE")?;
        let local_rank = num("LOCAL_RANK").unwrap_or(0);
        let master = var("MASTER_ADDR")?;
        let port = num("MASTER_PORT")?;
        let secret = std::env::var("LOCKSTEP_SECRET").unwrap_or_default();
        let listen_host = std::env::var("LOCKSTEP_HOST").unwrap_or_else(|_| {
            if master == "localhost" || master.starts_with("127.") {
                "127.0.0.1".into()
            } else {
                "0.0.0.0".into()
            }
        });
        let store_addr = format!("{master}:{port}");
        let hosted = if rank == 0 {
            let bind = if listen_host.starts_with("127.") {
                format!("127.0.0.1:{port}")
            } else {
                format!("0.0.0.0:{port}")
            };
            Some(StoreServer::start(bind, &secret)?)
        } else {
            None
        };
        let opts = InitOptions {
            rank,
            world_size,
            store_addr,
            secret,
            listen_host,
            backend,
            device: local_rank,
            timeout: default_timeout(),
            shm_tag: format!("p{}", std::process::id()),
        };
        Self::init_hosting(opts, hosted)
    }

    /// This process's global rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the run.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The group of all ranks (through the group wrapper, when one is set).
    pub fn group(&self) -> Arc<dyn ProcessGroup> {
        match lock(&self.wrapping).as_ref() {
            Some(w) => w.world.clone(),
            None => self.world.clone(),
        }
    }

    /// Makes every group this world hands out from now on — [`World::group`], and each group
    /// [`World::new_group`], [`World::new_groups`] and so every [`crate::comm::DeviceMesh`]
    /// creates — go through `wrap`, so a launcher can put every collective of every
    /// parallelism under one wrapper (a fault injector) without changing the training code.
    /// Groups handed out earlier are not affected; a later call replaces the wrapper.
    pub fn set_group_wrapper(&self, wrap: GroupWrapper) {
        let world = wrap(self.world.clone());
        *lock(&self.wrapping) = Some(Wrapping { wrap, world });
    }

    /// Stops wrapping the groups handed out from now on.
    pub fn clear_group_wrapper(&self) {
        *lock(&self.wrapping) = None;
    }

    /// `group` through the wrapper, if one is set.
    fn wrapped(&self, group: Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> {
        match lock(&self.wrapping).as_ref() {
            Some(w) => (w.wrap)(group),
            None => group,
        }
    }

    /// The run's store, for user-level coordination.
    pub fn store(&self) -> &Arc<StoreClient> {
        &self.store
    }

    /// Which backend groups use.
    pub fn backend(&self) -> Backend {
        self.opts.backend
    }

    /// Creates a group of `ranks` (global ranks, in group-rank order). Every rank of the
    /// world must call this in the same order; non-members get `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        let groups = self.new_groups(&[ranks.to_vec()], "group")?;
        Ok(groups)
    }

    /// Creates several disjoint groups at once (e.g. one per mesh row) and returns the one
    /// this rank belongs to, if any. Every rank of the world must call it with the same list.
    pub fn new_groups(
        &self,
        partition: &[Vec<usize>],
        label: &str,
    ) -> Result<Option<Arc<dyn ProcessGroup>>, CommError> {
        let id = self.groups_created.fetch_add(1, Ordering::AcqRel);
        let mut seen = vec![false; self.size];
        for ranks in partition {
            if ranks.is_empty() {
                return Err(CommError::InvalidArgument(
                    "a group needs at least one rank".into(),
                ));
            }
            for &r in ranks {
                if r >= self.size {
                    return Err(CommError::InvalidArgument(format!(
                        "rank {r} in group {ranks:?} is outside the world of size {}",
                        self.size
                    )));
                }
                if std::mem::replace(&mut seen[r], true) {
                    return Err(CommError::InvalidArgument(format!(
                        "rank {r} appears twice in groups {partition:?}"
                    )));
                }
            }
        }
        let Some(ranks) = partition.iter().find(|g| g.contains(&self.rank)) else {
            return Ok(None);
        };
        let name = format!("{label}{ranks:?}").replace(' ', "");
        let key = format!("g{id}:{ranks:?}");
        let group = connect_group(&self.opts, &self.store, &self.router, &key, &name, ranks)?;
        Ok(Some(self.wrapped(group)))
    }
}

fn accept_loop(listener: TcpListener, router: &Router, secret: &str) {
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

fn connect_group(
    opts: &InitOptions,
    store: &StoreClient,
    router: &Router,
    key: &str,
    name: &str,
    ranks: &[usize],
) -> Result<Arc<dyn ProcessGroup>, CommError> {
    let me = ranks.iter().position(|&r| r == opts.rank).ok_or_else(|| {
        CommError::InvalidArgument(format!("rank {} is not in group {ranks:?}", opts.rank))
    })?;
    if opts.backend == Backend::Nccl {
        return connect_nccl(opts, store, key, name, me, ranks);
    }
    let deadline = Instant::now() + opts.timeout;
    let mut streams: Vec<Option<TcpStream>> = (0..ranks.len()).map(|_| None).collect();
    // Dial every lower rank first, then wait for the higher ranks to dial us.
    for (peer, &global) in ranks.iter().enumerate().take(me) {
        let addr = store.wait_get(&format!("lockstep/addr/{global}"), opts.timeout)?;
        let addr = String::from_utf8_lossy(&addr).into_owned();
        streams[peer] = Some(dial(&addr, &opts.secret, key, opts.rank, deadline)?);
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
                    seconds: opts.timeout.as_secs_f64(),
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
    let same_host = opts.listen_host.starts_with("127.")
        && std::env::var("LOCKSTEP_SHM").map_or(true, |v| v != "0");
    Ok(Arc::new(CpuGroup::new(
        name.to_owned(),
        me,
        ranks.to_vec(),
        links,
        opts.timeout,
        same_host.then_some(opts.shm_tag.as_str()),
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
