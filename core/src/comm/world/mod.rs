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
//!
//! The files: what a rank needs to join (`options`: [`InitOptions`], [`Backend`], the
//! timeouts), publishing and collecting every rank's address (`rendezvous`), connecting a
//! group's members and building its backend (`connect`), joining a run an external launcher
//! started (`external`: [`ExternalLaunch`]), and the run's corner of the store
//! (`run_store`: [`RunStore`]). This file holds [`World`] itself, which ties them together
//! and hands out groups.

mod connect;
mod external;
mod options;
mod rendezvous;
mod run_store;

pub use external::{torchelastic_in_env, ExternalLaunch, STORE_PORT_VAR};
pub use options::{
    default_rendezvous_timeout, default_timeout, Backend, InitOptions, PointToPoint, P2P_VAR,
    RENDEZVOUS_TIMEOUT_VAR,
};
pub use rendezvous::host_identity;
pub use run_store::{RunStore, RunStoreError, RUN_STORE_MAX_VALUE};

use crate::comm::work::lock;
use crate::comm::{CommError, ProcessGroup, StoreClient, StoreServer};
use connect::{accept_loop, connect_group, Router};
use external::{hosted_store, EXTERNAL_RUNS};
use rendezvous::{host_port, listen_addresses, peer_key, rendezvous, PeerInfo};
use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Wraps a process group in another that delegates to it (a [`crate::comm::FaultyGroup`], a
/// [`crate::comm::CountingGroup`]): see [`World::set_group_wrapper`].
pub type GroupWrapper = Arc<dyn Fn(Arc<dyn ProcessGroup>) -> Arc<dyn ProcessGroup> + Send + Sync>;

/// The wrapper a world applies to the groups it hands out, with the world group wrapped once
/// (so every caller of [`World::group`] shares one wrapped group and its state).
struct Wrapping {
    wrap: GroupWrapper,
    world: Arc<dyn ProcessGroup>,
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
            p2p: PointToPoint::from_env()?,
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
