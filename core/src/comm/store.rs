//! A TCP key-value store for rendezvous, as c10d's TCPStore: ranks publish their addresses,
//! exchange NCCL ids and count arrivals through it.
//!
//! Each connection opens with a handshake carrying the run's secret; a connection with the
//! wrong secret is refused and closed, so no foreign process joins a run. The server binds
//! 127.0.0.1 unless told otherwise.

use crate::comm::work::lock;
use crate::comm::CommError;
use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"LKSTORE1";
/// What the server answers first, so a client can tell a Lockstep store from any other
/// service listening on the port (torchrun's own TCPStore on `MASTER_PORT`).
const REPLY_MAGIC: &[u8; 8] = b"LKSTORE+";
const ACCEPTED: u8 = 0xA5;
const REFUSED: u8 = 0x5A;
/// How long a client waits for the server's handshake reply before deciding that what
/// listens there is not a Lockstep store (a foreign server usually waits for more input).
const HANDSHAKE_REPLY: Duration = Duration::from_secs(5);

#[derive(Clone, Copy)]
#[repr(u8)]
enum Cmd {
    Set = 1,
    Get = 2,
    Add = 3,
    CompareSet = 4,
    Delete = 5,
    Check = 6,
}

#[derive(Default)]
struct Table {
    values: HashMap<String, Vec<u8>>,
}

struct Shared {
    table: Mutex<Table>,
    changed: Condvar,
    stopping: AtomicBool,
}

/// The store's server side, hosted by the launcher (or rank 0 under an external launcher).
///
/// It can be bound before it serves ([`StoreServer::bind`], then [`StoreServer::serve`]):
/// a launcher that forks its ranks binds first, so the ranks know the address, and serves
/// once every rank is forked, so no store thread exists at a fork (a forked child inherits
/// every lock another thread holds at that instant, held forever). Clients that connect
/// before it serves wait in the listen backlog. Dropping it stops it and joins every one of
/// its threads, so none outlives it into the next launch's forks.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    secret: String,
    /// The listener until `serve` hands it to the accept thread.
    listener: Mutex<Option<TcpListener>>,
    /// The accept thread, once serving.
    accept: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// One thread per connection.
    threads: Arc<Mutex<Vec<std::thread::JoinHandle<()>>>>,
    /// A handle on every accepted connection, shut down on drop to end its thread.
    connections: Arc<Mutex<Vec<TcpStream>>>,
}

impl StoreServer {
    /// Binds `bind` (e.g. `127.0.0.1:0`) and serves clients that present `secret`.
    pub fn start(bind: impl ToSocketAddrs, secret: &str) -> Result<Self, CommError> {
        let server = Self::bind(bind, secret)?;
        server.serve()?;
        Ok(server)
    }

    /// Binds `bind` without serving yet: no thread is started until [`StoreServer::serve`].
    pub fn bind(bind: impl ToSocketAddrs, secret: &str) -> Result<Self, CommError> {
        let listener = TcpListener::bind(bind).map_err(|e| CommError::io("store: bind", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| CommError::io("store: local address", e))?;
        Ok(StoreServer {
            addr,
            shared: Arc::new(Shared {
                table: Mutex::new(Table::default()),
                changed: Condvar::new(),
                stopping: AtomicBool::new(false),
            }),
            secret: secret.to_owned(),
            listener: Mutex::new(Some(listener)),
            accept: Mutex::new(None),
            threads: Arc::new(Mutex::new(Vec::new())),
            connections: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Starts answering clients (once; later calls do nothing).
    pub fn serve(&self) -> Result<(), CommError> {
        let Some(listener) = lock(&self.listener).take() else {
            return Ok(());
        };
        let secret = self.secret.clone();
        let shared = self.shared.clone();
        let threads = self.threads.clone();
        let connections = self.connections.clone();
        let accept = std::thread::Builder::new()
            .name("lockstep-store".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if shared.stopping.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    if let Ok(handle) = stream.try_clone() {
                        lock(&connections).push(handle);
                    }
                    let shared = shared.clone();
                    let secret = secret.clone();
                    if let Ok(t) = std::thread::Builder::new()
                        .name("lockstep-store-conn".into())
                        .spawn(move || serve_client(stream, &shared, &secret))
                    {
                        lock(&threads).push(t);
                    }
                }
            })
            .map_err(|e| CommError::io("store: spawn accept thread", e))?;
        *lock(&self.accept) = Some(accept);
        Ok(())
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Reads a key directly, without a client (the launcher uses it to read rank reports).
    pub fn peek(&self, key: &str) -> Option<Vec<u8>> {
        lock(&self.shared.table).values.get(key).cloned()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        self.shared.changed.notify_all();
        // Wake the accept loop so it sees `stopping`, and join it first: then no connection
        // thread starts after the shutdowns below.
        if let Some(accept) = lock(&self.accept).take() {
            let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
            let _ = accept.join();
        }
        for c in lock(&self.connections).drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        let rest: Vec<_> = lock(&self.threads).drain(..).collect();
        for t in rest {
            let _ = t.join();
        }
    }
}

fn serve_client(stream: TcpStream, shared: &Shared, secret: &str) {
    let _ = stream.set_nodelay(true);
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut writer = BufWriter::new(stream);
    // Handshake: magic, then the secret; anything else is refused.
    let mut magic = [0u8; 8];
    if reader.read_exact(&mut magic).is_err() || &magic != MAGIC {
        return;
    }
    let Ok(offered) = read_bytes(&mut reader) else {
        return;
    };
    if offered != secret.as_bytes() {
        let _ = writer.write_all(REPLY_MAGIC);
        let _ = writer.write_all(&[REFUSED]);
        let _ = write_bytes(&mut writer, b"wrong run secret");
        let _ = writer.flush();
        return;
    }
    if writer
        .write_all(REPLY_MAGIC)
        .and_then(|_| writer.write_all(&[ACCEPTED]))
        .and_then(|_| writer.flush())
        .is_err()
    {
        return;
    }
    while let Ok(reply) = serve_request(&mut reader, shared) {
        if write_bytes(&mut writer, &reply)
            .and_then(|_| writer.flush())
            .is_err()
        {
            return;
        }
    }
}

/// Answers one request. Replies start with a status byte: 0 ok, 1 timeout, 2 error.
fn serve_request(reader: &mut impl Read, shared: &Shared) -> std::io::Result<Vec<u8>> {
    let mut cmd = [0u8; 1];
    reader.read_exact(&mut cmd)?;
    let key = String::from_utf8_lossy(&read_bytes(reader)?).into_owned();
    let a = read_bytes(reader)?;
    let b = read_bytes(reader)?;
    let mut timeout_ms = [0u8; 8];
    reader.read_exact(&mut timeout_ms)?;
    let timeout = Duration::from_millis(u64::from_le_bytes(timeout_ms));
    let mut table = lock(&shared.table);
    let ok = |v: &[u8]| [&[0u8][..], v].concat();
    let reply = match cmd[0] {
        c if c == Cmd::Set as u8 => {
            table.values.insert(key, a);
            shared.changed.notify_all();
            ok(&[])
        }
        c if c == Cmd::Get as u8 => {
            let deadline = Instant::now() + timeout;
            loop {
                if let Some(v) = table.values.get(&key) {
                    break ok(v);
                }
                let now = Instant::now();
                if now >= deadline || shared.stopping.load(Ordering::Relaxed) {
                    break vec![1];
                }
                table = shared
                    .changed
                    .wait_timeout(table, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
        c if c == Cmd::Add as u8 => {
            let delta =
                i64::from_le_bytes(a.get(..8).and_then(|s| s.try_into().ok()).unwrap_or([0; 8]));
            let current = table
                .values
                .get(&key)
                .and_then(|v| std::str::from_utf8(v).ok()?.parse::<i64>().ok())
                .unwrap_or(0);
            let next = current + delta;
            table.values.insert(key, next.to_string().into_bytes());
            shared.changed.notify_all();
            ok(&next.to_le_bytes())
        }
        c if c == Cmd::CompareSet as u8 => {
            // a = [0] (key must be absent) or [1] + expected value; b = desired.
            // Returns the value stored afterwards either way.
            let current = table.values.get(&key).cloned();
            let matches = match (a.split_first(), &current) {
                (Some((0, _)), None) => true,
                (Some((1, expected)), Some(v)) => v.as_slice() == expected,
                _ => false,
            };
            if matches {
                table.values.insert(key, b.clone());
                shared.changed.notify_all();
                ok(&b)
            } else {
                ok(&current.unwrap_or_default())
            }
        }
        c if c == Cmd::Delete as u8 => ok(&[u8::from(table.values.remove(&key).is_some())]),
        c if c == Cmd::Check as u8 => ok(&[u8::from(table.values.contains_key(&key))]),
        other => [&[2u8][..], format!("unknown command {other}").as_bytes()].concat(),
    };
    Ok(reply)
}

/// Reads the server's handshake reply: a Lockstep store answers with [`REPLY_MAGIC`] and
/// a status. Anything else (silence, a close, other bytes) means another service listens on
/// that port, which is named as such rather than reported as a wrong secret.
fn read_reply(reader: &mut impl Read, addr: SocketAddr) -> Result<(), CommError> {
    let mut magic = [0u8; 8];
    let mut status = [0u8; 1];
    if reader.read_exact(&mut magic).is_err()
        || &magic != REPLY_MAGIC
        || reader.read_exact(&mut status).is_err()
    {
        return Err(CommError::Store(format!(
            "{addr} is not a Lockstep store: it did not answer the Lockstep handshake (is \
             MASTER_PORT torchrun's own store? set LOCKSTEP_STORE_PORT to a free port)"
        )));
    }
    match status[0] {
        ACCEPTED => Ok(()),
        REFUSED => {
            let why = read_bytes(reader).unwrap_or_default();
            Err(CommError::Store(format!(
                "store at {addr} refused the connection: {}",
                String::from_utf8_lossy(&why)
            )))
        }
        other => Err(CommError::Store(format!(
            "store at {addr} answered the handshake with unknown status {other}"
        ))),
    }
}

fn read_bytes(reader: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    reader.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > 64 << 20 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "store value over 64 MiB",
        ));
    }
    let mut buf = vec![0u8; len];
    reader.read_exact(&mut buf)?;
    Ok(buf)
}

fn write_bytes(writer: &mut impl Write, bytes: &[u8]) -> std::io::Result<()> {
    writer.write_all(&(bytes.len() as u32).to_le_bytes())?;
    writer.write_all(bytes)
}

/// A connection to the store. Cheap to share: requests are serialized on one socket.
pub struct StoreClient {
    addr: SocketAddr,
    local: Option<SocketAddr>,
    conn: Mutex<(BufReader<TcpStream>, BufWriter<TcpStream>)>,
    timeout: Duration,
}

/// How much later than a request's own wait the store's reply may come before the client
/// gives up on it.
const REPLY_MARGIN: Duration = Duration::from_secs(10);

impl StoreClient {
    /// Connects to `addr`, retrying until `timeout` (the server may still be starting), and
    /// presents `secret`. A wrong secret gives [`CommError::Store`] saying it was refused.
    pub fn connect(
        addr: impl ToSocketAddrs,
        secret: &str,
        timeout: Duration,
    ) -> Result<Self, CommError> {
        let addrs: Vec<SocketAddr> = addr
            .to_socket_addrs()
            .map_err(|e| CommError::io("store: resolve address", e))?
            .collect();
        let addr = *addrs
            .first()
            .ok_or_else(|| CommError::Store("store address resolves to nothing".into()))?;
        let deadline = Instant::now() + timeout;
        let stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(CommError::io(format!("store: connect to {addr}"), e))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        stream
            .set_nodelay(true)
            .map_err(|e| CommError::io("store: nodelay", e))?;
        let read_half = stream
            .try_clone()
            .map_err(|e| CommError::io("store: clone socket", e))?;
        read_half
            .set_read_timeout(Some(HANDSHAKE_REPLY))
            .map_err(|e| CommError::io("store: set read timeout", e))?;
        let local = stream.local_addr().ok();
        let mut reader = BufReader::new(read_half);
        let mut writer = BufWriter::new(stream);
        let io = |e| CommError::io(format!("store: handshake with {addr}"), e);
        writer.write_all(MAGIC).map_err(io)?;
        write_bytes(&mut writer, secret.as_bytes()).map_err(io)?;
        writer.flush().map_err(io)?;
        read_reply(&mut reader, addr)?;
        reader
            .get_ref()
            .set_read_timeout(None)
            .map_err(|e| CommError::io("store: clear read timeout", e))?;
        Ok(StoreClient {
            addr,
            local,
            conn: Mutex::new((reader, writer)),
            timeout,
        })
    }

    /// Sets the default timeout of blocking gets (a client connected within a short
    /// rendezvous timeout keeps the longer collective one for its later gets).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The server's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// This end of the connection: the address of the interface that reaches the store,
    /// which is what a rank publishes for its peers when nothing else says otherwise.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.local
    }

    /// The default timeout of blocking gets.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn request(
        &self,
        cmd: Cmd,
        key: &str,
        a: &[u8],
        b: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, CommError> {
        let mut conn = lock(&self.conn);
        let (reader, writer) = &mut *conn;
        let io = |e| CommError::io(format!("store request for {key:?}"), e);
        // The server answers within the request's own wait; a reply later than that by
        // REPLY_MARGIN means the store is gone or cut off (a link down after rendezvous),
        // which must end in an error, never a wait without end.
        let reply_within = timeout
            .saturating_add(REPLY_MARGIN)
            .min(Duration::from_secs(u32::MAX as u64));
        reader
            .get_ref()
            .set_read_timeout(Some(reply_within))
            .map_err(io)?;
        writer.write_all(&[cmd as u8]).map_err(io)?;
        write_bytes(writer, key.as_bytes()).map_err(io)?;
        write_bytes(writer, a).map_err(io)?;
        write_bytes(writer, b).map_err(io)?;
        writer
            .write_all(&(timeout.as_millis() as u64).to_le_bytes())
            .map_err(io)?;
        writer.flush().map_err(io)?;
        let reply = read_bytes(reader).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => CommError::Timeout {
                what: format!(
                    "the store at {} to answer a request for {key:?} (unreachable, or its \
                     rank is gone)",
                    self.addr
                ),
                seconds: reply_within.as_secs_f64(),
            },
            _ => io(e),
        })?;
        match reply.split_first() {
            Some((0, rest)) => Ok(rest.to_vec()),
            Some((1, _)) => Err(CommError::Timeout {
                what: format!("store key {key:?}"),
                seconds: timeout.as_secs_f64(),
            }),
            Some((_, rest)) => Err(CommError::Store(String::from_utf8_lossy(rest).into_owned())),
            None => Err(CommError::Store("empty reply".into())),
        }
    }

    /// Sets `key` to `value`, waking every waiter on it.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.request(Cmd::Set, key, value, &[], Duration::ZERO)
            .map(|_| ())
    }

    /// Returns `key`'s value, waiting up to the client's default timeout for it to be set.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, CommError> {
        self.wait_get(key, self.timeout)
    }

    /// Returns `key`'s value, waiting up to `timeout` for it to be set.
    pub fn wait_get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.request(Cmd::Get, key, &[], &[], timeout)
    }

    /// Waits until every key exists.
    pub fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        let deadline = Instant::now() + timeout;
        for key in keys {
            let left = deadline.saturating_duration_since(Instant::now());
            self.wait_get(key, left)?;
        }
        Ok(())
    }

    /// Adds `delta` to the integer stored at `key` (absent = 0) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let reply = self.request(Cmd::Add, key, &delta.to_le_bytes(), &[], Duration::ZERO)?;
        let bytes: [u8; 8] = reply
            .as_slice()
            .try_into()
            .map_err(|_| CommError::Store("malformed add reply".into()))?;
        Ok(i64::from_le_bytes(bytes))
    }

    /// Sets `key` to `desired` if it currently holds `expected` (`None`: if absent), and
    /// returns the value stored afterwards either way.
    pub fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> Result<Vec<u8>, CommError> {
        let expected = match expected {
            None => vec![0],
            Some(v) => [&[1u8][..], v].concat(),
        };
        self.request(Cmd::CompareSet, key, &expected, desired, Duration::ZERO)
    }

    /// Removes `key`; returns whether it existed.
    pub fn delete(&self, key: &str) -> Result<bool, CommError> {
        Ok(self.request(Cmd::Delete, key, &[], &[], Duration::ZERO)? == [1])
    }

    /// Whether `key` exists, without waiting.
    pub fn check(&self, key: &str) -> Result<bool, CommError> {
        Ok(self.request(Cmd::Check, key, &[], &[], Duration::ZERO)? == [1])
    }
}
