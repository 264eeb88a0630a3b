//! Rendezvous and group creation: how ranks find each other and build process groups.
//!
//! Every rank listens on one TCP port, publishes `host:port` and its host identity in the
//! store, waits (at most the rendezvous timeout) until every rank has, and connects to the
//! members of each group it joins (the higher rank dials the lower one; each connection
//! opens with the run secret, the group's key and the dialer's rank). Groups are created by
//! every rank of the world in the same order, as `torch.distributed.new_group` requires.
//!
//! The published address is one the peers can reach: `LOCKSTEP_HOST` if set, else the local
//! address of this rank's connection to the store (loopback when the store is local). A
//! group uses shared memory only when all its members publish the same host identity
//! (machine id, boot id and network namespace), whatever address they listen on.

use crate::comm::cpu::{link::Link, CpuGroup};
use crate::comm::work::lock;
use crate::comm::{CommError, ProcessGroup, StoreClient, StoreServer};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
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
struct PeerInfo {
    /// `host:port` its peers dial.
    addr: String,
    /// Its [`host_identity`].
    host: String,
    /// Its [`InitOptions::run_label`].
    label: String,
}

impl PeerInfo {
    fn encode(&self) -> Vec<u8> {
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
fn listen_addresses(
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
fn host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(ip) => SocketAddr::new(ip, port).to_string(),
        Err(_) => format!("{host}:{port}"),
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
    /// What every rank published at rendezvous, by rank.
    peers: Arc<Vec<PeerInfo>>,
    /// The store, when this rank hosts it (external launch, rank 0); shared by every run of
    /// the process (see [`World::from_env_for`]).
    _hosted_store: Option<Arc<StoreServer>>,
}

impl World {
    /// Joins a run: connects to the store, publishes this rank's address and builds the world
    /// group.
    pub fn init(opts: InitOptions) -> Result<World, CommError> {
        Self::init_hosting(opts, None)
    }

    fn init_hosting(
        opts: InitOptions,
        hosted: Option<Arc<StoreServer>>,
    ) -> Result<World, CommError> {
        if opts.world_size == 0 || opts.rank >= opts.world_size {
            return Err(CommError::InvalidArgument(format!(
                "rank {} is not in a world of size {}",
                opts.rank, opts.world_size
            )));
        }
        let store = StoreClient::connect(&opts.store_addr, &opts.secret, opts.rendezvous_timeout)
            .map_err(|e| match e {
                CommError::Io { context, source } => CommError::Io {
                    context: format!(
                        "{context} within the rendezvous timeout ({:.0} s, {RENDEZVOUS_TIMEOUT_VAR}; \
                         under an external launch rank 0 hosts the store)",
                        opts.rendezvous_timeout.as_secs_f64()
                    ),
                    source,
                },
                other => other,
            })?
            .with_timeout(opts.timeout);
        let store = Arc::new(store);
        let (bind, publish) = listen_addresses(&opts.listen_host, store.local_addr())?;
        let listener =
            TcpListener::bind(bind).map_err(|e| CommError::io(format!("listen on {bind}"), e))?;
        let port = listener
            .local_addr()
            .map_err(|e| CommError::io("listener address", e))?
            .port();
        let me = PeerInfo {
            addr: host_port(&publish, port),
            host: host_identity(),
            label: opts.run_label.clone(),
        };
        store.set(&peer_key(&opts, opts.rank), &me.encode())?;
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
        let peers = Arc::new(rendezvous(&opts, &store)?);
        let all: Vec<usize> = (0..opts.world_size).collect();
        let world = connect_group(
            &opts,
            &store,
            &router,
            &peers,
            opts.rendezvous_timeout,
            "world",
            "world",
            &all,
        )?;
        Ok(World {
            rank: opts.rank,
            size: opts.world_size,
            opts,
            store,
            router,
            groups_created: AtomicU64::new(0),
            world,
            wrapping: Mutex::new(None),
            peers,
            _hosted_store: hosted,
        })
    }

    /// Joins a run started by torchrun, SLURM or any launcher that sets `RANK`, `WORLD_SIZE`,
    /// `MASTER_ADDR`, `MASTER_PORT` (and `LOCAL_RANK` for the device): see [`ExternalLaunch`]
    /// for every variable. Same as [`World::from_env_for`] with an empty label.
    pub fn from_env(backend: Backend) -> Result<World, CommError> {
        Self::from_env_for(backend, "")
    }

    /// Joins the next run of an externally launched process, labelled `label` (the test
    /// name). Rank 0 hosts the store, once per process, on the store port; each call takes
    /// the process's next run number, and the run's keys live under it, so the tests of one
    /// process never see each other's keys (every rank must run the same tests in the same
    /// order; a rank that joins run `n` for another label fails naming both).
    pub fn from_env_for(backend: Backend, label: &str) -> Result<World, CommError> {
        let launch = ExternalLaunch::from_env()?;
        let hosted = if launch.rank == 0 {
            Some(hosted_store(&launch.store_bind(), &launch.secret)?)
        } else {
            None
        };
        let run = EXTERNAL_RUNS.fetch_add(1, Ordering::AcqRel);
        let opts = InitOptions {
            rank: launch.rank,
            world_size: launch.world_size,
            store_addr: host_port(&launch.master_addr, launch.store_port),
            secret: launch.secret.clone(),
            listen_host: launch.listen_host.clone(),
            backend,
            device: launch.local_rank,
            timeout: default_timeout(),
            rendezvous_timeout: default_rendezvous_timeout(),
            namespace: format!("lockstep/run{run}/"),
            run_label: label.to_owned(),
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

    /// Whether every rank of `ranks` runs on this rank's host (same [`host_identity`]): what
    /// decides that a group may use shared memory.
    pub fn shares_host(&self, ranks: &[usize]) -> bool {
        let mine = &self.peers[self.rank].host;
        ranks
            .iter()
            .all(|&r| self.peers.get(r).is_some_and(|p| &p.host == mine))
    }

    /// The address rank `rank` published for its peers (`host:port`), if it is in the world.
    pub fn peer_address(&self, rank: usize) -> Option<&str> {
        self.peers.get(rank).map(|p| p.addr.as_str())
    }

    /// The run's store, for user-level coordination.
    pub fn store(&self) -> &Arc<StoreClient> {
        &self.store
    }

    /// This run's corner of the store: bytes put and got under the run's own key prefix,
    /// gets bounded by the collective timeout. Outlives the world (it holds its own handle to
    /// the store connection), so ranks can exchange what a run produced after its groups
    /// are gone (records, failures), across hosts that share no filesystem.
    pub fn run_store(&self) -> RunStore {
        RunStore {
            store: self.store.clone(),
            namespace: self.opts.namespace.clone(),
            timeout: self.opts.timeout,
        }
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
        let group = connect_group(
            &self.opts,
            &self.store,
            &self.router,
            &self.peers,
            self.opts.timeout,
            &key,
            &name,
            ranks,
        )?;
        Ok(Some(self.wrapped(group)))
    }
}

/// Largest value [`RunStore::put`] accepts: the store's frame limit.
pub const RUN_STORE_MAX_VALUE: usize = 64 << 20;

/// Why a [`RunStore`] operation failed.
#[derive(Debug, thiserror::Error)]
pub enum RunStoreError {
    /// The value is larger than the store carries in one frame.
    #[error("store key {key:?}: {bytes} bytes is over the store's {max}-byte limit")]
    TooLarge {
        /// The run-relative key.
        key: String,
        /// The value's size.
        bytes: usize,
        /// [`RUN_STORE_MAX_VALUE`].
        max: usize,
    },
    /// The store could not be reached, refused, or the key did not appear in time.
    #[error("store key {key:?} of run {namespace}: {source}")]
    Comm {
        /// The run-relative key.
        key: String,
        /// The run's key prefix.
        namespace: String,
        /// The store's error.
        #[source]
        source: CommError,
    },
}

/// Bytes under one run's key prefix in the store ([`World::run_store`]): what ranks on
/// different hosts hand each other (rank 0's record, every rank's digest and outcome).
#[derive(Clone)]
pub struct RunStore {
    store: Arc<StoreClient>,
    namespace: String,
    timeout: Duration,
}

impl RunStore {
    /// Sets run-relative `key` to `value`.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), RunStoreError> {
        if value.len() > RUN_STORE_MAX_VALUE {
            return Err(RunStoreError::TooLarge {
                key: key.to_owned(),
                bytes: value.len(),
                max: RUN_STORE_MAX_VALUE,
            });
        }
        self.store
            .set(&self.full(key), value)
            .map_err(|source| self.err(key, source))
    }

    /// The value of run-relative `key`, waiting for it at most the collective timeout.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, RunStoreError> {
        self.store
            .wait_get(&self.full(key), self.timeout)
            .map_err(|source| self.err(key, source))
    }

    /// Whether run-relative `key` is set, without waiting.
    pub fn check(&self, key: &str) -> Result<bool, RunStoreError> {
        self.store
            .check(&self.full(key))
            .map_err(|source| self.err(key, source))
    }

    /// Adds `delta` to the counter at run-relative `key` and returns its new value: gives
    /// events on different ranks one order (which rank failed first).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, RunStoreError> {
        self.store
            .add(&self.full(key), delta)
            .map_err(|source| self.err(key, source))
    }

    /// How long [`RunStore::get`] waits.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The run's key prefix (`lockstep/run{n}/` under an external launch).
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn full(&self, key: &str) -> String {
        format!("{}x/{key}", self.namespace)
    }

    fn err(&self, key: &str, source: CommError) -> RunStoreError {
        RunStoreError::Comm {
            key: key.to_owned(),
            namespace: self.namespace.clone(),
            source,
        }
    }
}

/// Store key under which `rank` publishes its [`PeerInfo`].
fn peer_key(opts: &InitOptions, rank: usize) -> String {
    format!("{}peer/{rank}", opts.namespace)
}

/// Waits until every rank has published its [`PeerInfo`], at most the rendezvous timeout;
/// past it, names the ranks that never arrived. Then checks every rank joined this run for
/// the same label.
fn rendezvous(opts: &InitOptions, store: &StoreClient) -> Result<Vec<PeerInfo>, CommError> {
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

/// Run number of the next [`World::from_env_for`] in this process.
static EXTERNAL_RUNS: AtomicU64 = AtomicU64::new(0);

/// The store rank 0 hosts under an external launch: (bind address, secret, server). Kept
/// for the whole process, so a second run (the next test) never meets a closed or rebound
/// port; runs are kept apart by their key namespace.
static HOSTED: Mutex<Option<(String, String, Arc<StoreServer>)>> = Mutex::new(None);

fn hosted_store(bind: &str, secret: &str) -> Result<Arc<StoreServer>, CommError> {
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

#[allow(clippy::too_many_arguments)]
fn connect_group(
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
