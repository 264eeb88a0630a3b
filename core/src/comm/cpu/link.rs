//! One TCP connection to one peer of a group: a writer that never blocks the caller on large
//! payloads (a dedicated thread drains them, so ranks sending to each other cannot deadlock),
//! and a reader thread that files incoming messages into an inbox keyed by
//! (channel, sequence, tag), where the collective algorithms pick them up.

use super::wire::{Channel, Header, HEADER_LEN};
use crate::comm::work::{lock, Latch};
use crate::comm::CommError;
use std::collections::HashMap;
use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Payloads up to this size are written on the caller's thread (lowest latency); larger ones
/// go through the link's writer thread.
pub const INLINE_WRITE_MAX: usize = 64 << 10;

/// A received message.
pub struct Message {
    /// What the sender said about the message.
    pub header: Header,
    /// The payload bytes, in the header's dtype (possibly short: see `truncated`).
    pub data: Vec<u8>,
    /// The connection broke before the whole payload arrived; the header is still worth
    /// checking (a peer that gave up on a mismatched collective is named by it).
    pub truncated: bool,
}

type Key = (Channel, u64, u64);

#[derive(Default)]
struct InboxState {
    messages: HashMap<Key, Message>,
    closed: Option<String>,
}

/// Messages received from one peer, waiting to be claimed.
#[derive(Default)]
pub struct Inbox {
    state: Mutex<InboxState>,
    arrived: Condvar,
}

impl Inbox {
    /// Takes the message with this key, waiting up to `timeout` for it.
    pub fn take(&self, key: Key, peer: usize, timeout: Duration) -> Result<Message, CommError> {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        loop {
            if let Some(m) = state.messages.remove(&key) {
                return Ok(m);
            }
            if let Some(reason) = &state.closed {
                return Err(CommError::PeerLost {
                    rank: peer,
                    reason: reason.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(CommError::Timeout {
                    what: format!("a message from rank {peer} (seq {}, tag {})", key.1, key.2),
                    seconds: timeout.as_secs_f64(),
                });
            }
            state = self
                .arrived
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Whether the message with this key has arrived.
    pub fn contains(&self, key: Key) -> bool {
        lock(&self.state).messages.contains_key(&key)
    }

    fn deliver(&self, message: Message) {
        let h = &message.header;
        // Point-to-point messages (and the notices of posted receives) match by order; their
        // tag is checked by the receiver.
        let tag = if h.channel == Channel::Collective {
            h.tag
        } else {
            0
        };
        let key = (h.channel, h.seq, tag);
        lock(&self.state).messages.insert(key, message);
        self.arrived.notify_all();
    }

    fn close(&self, reason: String) {
        let mut state = lock(&self.state);
        if state.closed.is_none() {
            state.closed = Some(reason);
        }
        self.arrived.notify_all();
    }
}

/// Bytes a queued write sends. `Borrowed` points into a tensor the issuing operation keeps
/// alive and unmodified until the write's latch completes.
pub enum Payload {
    /// Bytes the write owns (small or temporary buffers).
    Owned(Vec<u8>),
    /// Bytes in a live tensor: no copy, so the issuer must not touch it until the latch.
    Borrowed {
        /// Start of the bytes.
        ptr: *const u8,
        /// Length in bytes.
        len: usize,
    },
}

// SAFETY: a borrowed payload is only read by the writer thread while the issuing operation
// waits on the write's latch, which keeps the memory alive and unaliased by writes.
unsafe impl Send for Payload {}

impl Payload {
    fn bytes(&self) -> &[u8] {
        match self {
            Payload::Owned(v) => v,
            // An empty tensor's data pointer may be null, which no slice may hold.
            Payload::Borrowed { len: 0, .. } => &[],
            // SAFETY: see the `Send` impl; ptr/len describe live memory for the write's duration.
            Payload::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

struct WriteJob {
    header: [u8; HEADER_LEN],
    payload: Payload,
    done: Option<Arc<Latch>>,
}

/// The sending and receiving ends of one peer connection.
pub struct Link {
    /// The peer's rank within the group.
    pub peer: usize,
    stream: Arc<Mutex<TcpStream>>,
    queue: mpsc::Sender<WriteJob>,
    queued: Arc<AtomicUsize>,
    /// What the peer sent us.
    pub inbox: Arc<Inbox>,
    shutdown: TcpStream,
}

/// Every live link of this process, as what [`abort_all`] needs to end it: its inbox and a
/// handle on its socket. Links of dropped groups fall out as their inboxes go.
static LIVE: Mutex<Vec<(std::sync::Weak<Inbox>, TcpStream)>> = Mutex::new(Vec::new());

/// Ends every link of this process now: each inbox closes with `reason` (a collective
/// waiting on one fails with [`CommError::PeerLost`] carrying it) and each socket shuts down
/// (the peers see the connection close at once). A watchdog with no launcher above it (an
/// external launch) calls this when the run is past its timeout, so a rank stuck in a
/// collective returns instead of waiting out the collective timeout.
pub fn abort_all(reason: &str) {
    let mut live = lock(&LIVE);
    live.retain(|(inbox, _)| inbox.strong_count() > 0);
    for (inbox, socket) in live.iter() {
        if let Some(inbox) = inbox.upgrade() {
            inbox.close(reason.to_owned());
        }
        let _ = socket.shutdown(std::net::Shutdown::Both);
    }
}

impl Link {
    /// Starts the reader and writer threads on a connected, handshaken stream.
    pub fn start(
        stream: TcpStream,
        peer: usize,
        peer_global: usize,
        group: &str,
    ) -> Result<Link, CommError> {
        let io = |e| CommError::io(format!("link to rank {peer_global}"), e);
        stream.set_nodelay(true).map_err(io)?;
        let read_half = stream.try_clone().map_err(io)?;
        let shutdown = stream.try_clone().map_err(io)?;
        let stream = Arc::new(Mutex::new(stream));
        let inbox = Arc::new(Inbox::default());
        {
            let mut live = lock(&LIVE);
            live.retain(|(inbox, _)| inbox.strong_count() > 0);
            live.push((Arc::downgrade(&inbox), shutdown.try_clone().map_err(io)?));
        }
        let queued = Arc::new(AtomicUsize::new(0));
        let (queue, jobs) = mpsc::channel::<WriteJob>();

        let reader_inbox = inbox.clone();
        std::thread::Builder::new()
            .name(format!("lockstep-rx-{group}-{peer_global}"))
            .spawn(move || read_loop(read_half, &reader_inbox, peer_global))
            .map_err(io)?;

        let writer_stream = stream.clone();
        let writer_queued = queued.clone();
        let writer_inbox = inbox.clone();
        std::thread::Builder::new()
            .name(format!("lockstep-tx-{group}-{peer_global}"))
            .spawn(move || {
                for job in jobs {
                    let result = write_message(&writer_stream, &job.header, job.payload.bytes());
                    writer_queued.fetch_sub(1, Ordering::AcqRel);
                    if let Some(done) = job.done {
                        done.complete(result.map_err(|e| CommError::PeerLost {
                            rank: peer_global,
                            reason: format!("send failed: {e}"),
                        }));
                    }
                }
                writer_inbox.close("link closed".into());
            })
            .map_err(io)?;

        Ok(Link {
            peer,
            stream,
            queue,
            queued,
            inbox,
            shutdown,
        })
    }

    /// Sends a message. Small payloads with nothing queued ahead are written right away and
    /// return `None`; otherwise the write is queued and the returned latch completes once the
    /// bytes are handed to the kernel.
    pub fn send(&self, header: &Header, payload: Payload) -> Result<Option<Arc<Latch>>, CommError> {
        super::chaos::maybe_delay();
        let encoded = header.encode();
        let len = payload.bytes().len();
        if len <= INLINE_WRITE_MAX && self.queued.load(Ordering::Acquire) == 0 {
            return write_message(&self.stream, &encoded, payload.bytes())
                .map(|_| None)
                .map_err(|e| CommError::PeerLost {
                    rank: self.peer,
                    reason: format!("send failed: {e}"),
                });
        }
        let done = Latch::new();
        self.queued.fetch_add(1, Ordering::AcqRel);
        self.queue
            .send(WriteJob {
                header: encoded,
                payload,
                done: Some(done.clone()),
            })
            .map_err(|_| CommError::PeerLost {
                rank: self.peer,
                reason: "writer thread stopped".into(),
            })?;
        Ok(Some(done))
    }
}

impl Link {
    /// Waits until the writer thread holds no queued payload, so no borrowed memory is read
    /// after a failed operation returns. Always ends: the peer's reader thread keeps reading
    /// whatever its rank does, and a dead peer makes the write fail.
    pub fn drain(&self) {
        while self.queued.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Queued writes go out first: a send completes (buffered) before the writer thread
        // has written its bytes, and a rank may drop its groups (exit) right after it; cutting
        // the connection then would break the message its peer is still reading.
        self.drain();
        let _ = self.shutdown.shutdown(std::net::Shutdown::Both);
    }
}

fn write_message(
    stream: &Mutex<TcpStream>,
    header: &[u8; HEADER_LEN],
    payload: &[u8],
) -> std::io::Result<()> {
    let mut stream = lock(stream);
    if payload.len() <= INLINE_WRITE_MAX {
        // One syscall for small messages: the header and payload leave in one segment.
        let mut buf = Vec::with_capacity(HEADER_LEN + payload.len());
        buf.extend_from_slice(header);
        buf.extend_from_slice(payload);
        stream.write_all(&buf)
    } else {
        stream.write_all(header)?;
        stream.write_all(payload)
    }
}

fn read_loop(stream: TcpStream, inbox: &Inbox, peer_global: usize) {
    let mut reader = BufReader::with_capacity(256 << 10, stream);
    let reason = loop {
        let mut raw = [0u8; HEADER_LEN];
        if let Err(e) = reader.read_exact(&mut raw) {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof {
                format!("rank {peer_global} closed its connection (did it exit or crash?)")
            } else {
                format!("reading from rank {peer_global}: {e}")
            };
        }
        let Some(header) = Header::decode(&raw) else {
            break format!("rank {peer_global} sent bytes that are not a Lockstep message");
        };
        let mut data = super::pool::take(header.payload as usize);
        if let Err(e) = reader.read_exact(&mut data) {
            inbox.deliver(Message {
                header,
                data,
                truncated: true,
            });
            break format!("rank {peer_global}'s connection broke mid-message: {e}");
        }
        inbox.deliver(Message {
            header,
            data,
            truncated: false,
        });
    };
    inbox.close(reason);
}
