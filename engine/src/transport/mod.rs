//! Sockets and framed connections over the executor's io_uring TCP streams.
//!
//! - [`listener`]: a listening socket built with socket2 (SO_REUSEADDR,
//!   SO_REUSEPORT so that every data core accepts its own client
//!   connections, TCP_NODELAY and buffer sizes inherited by accepted sockets).
//! - [`connect`]: an outbound connection with the same options.
//! - [`FrameReader`]: reads length-prefixed frames into one growing buffer
//!   (never allocating more than `max_frame_bytes` + header for an untrusted
//!   length) and hands out complete bodies in place.
//! - [`write_loop`]: the batched writer: everything queued for a connection
//!   while the executor ran goes out in one write.
//! - [`client_handshake`] / [`server_handshake`]: the node-to-node
//!   [`Hello`]/[`HelloAck`] exchange: protocol version, member address and
//!   uid, the sharding fingerprint (hash name + `number_of_shards`), the
//!   cluster name and id, the journal identity and whether the sender hosts
//!   durable types; a mismatch is refused with a reason on both sides
//!   (permanently, [`HelloAck::fatal`], for another cluster or a journal
//!   the members cannot share).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::rc::Rc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
use monoio::net::{TcpListener, TcpStream};
use thiserror::Error;

use crate::envelope::{
    decode_frame_body, encode_frame, next_frame, FrameError, FRAME_HEADER_BYTES,
};
use crate::envelope::{Hello, HelloAck};
use crate::runtime::LocalNotify;

/// Socket send/receive buffer size set on every connection, in bytes (1 MiB).
pub const SOCKET_BUFFER_BYTES: usize = 1 << 20;

/// How long a handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of a node-to-node connection.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A socket operation failed.
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent a bad frame.
    #[error("protocol: {0}")]
    Frame(#[from] FrameError),
    /// The peer closed the connection.
    #[error("connection closed")]
    Closed,
    /// The handshake did not finish in time.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The handshake was refused (by us or by the peer), with the reason.
    #[error("handshake refused: {0}")]
    Refused(String),
    /// The peer refused us for good ([`HelloAck::fatal`]): this node is not
    /// of its cluster (cluster name or id, journal identity).
    #[error("rejected by the cluster: {0}")]
    Rejected(String),
}

/// Binds a listening socket; with `reuse_port` several executors may bind the
/// same address and the kernel spreads connections between them.
///
/// # Errors
/// The socket error.
pub fn listener(addr: SocketAddr, reuse_port: bool) -> std::io::Result<TcpListener> {
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    if reuse_port {
        sock.set_reuse_port(true)?;
    }
    sock.set_nodelay(true)?;
    sock.set_send_buffer_size(SOCKET_BUFFER_BYTES)?;
    sock.set_recv_buffer_size(SOCKET_BUFFER_BYTES)?;
    sock.bind(&addr.into())?;
    sock.listen(1024)?;
    TcpListener::from_std(sock.into())
}

/// Sets TCP_NODELAY and the buffer sizes on a connected stream.
pub fn tune(stream: &TcpStream) {
    // SAFETY: the fd belongs to `stream`, which outlives this borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
    let s = socket2::SockRef::from(&fd);
    let _ = s.set_nodelay(true);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
}

/// Connects with a timeout.
///
/// # Errors
/// The connect error, or `TimedOut`.
pub async fn connect(addr: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    match monoio::time::timeout(timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            tune(&s);
            Ok(s)
        }
        Ok(Err(e)) => Err(e),
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// A receive buffer that yields complete frames.
///
/// The buffer is a [`BytesMut`]: [`Self::next_frame_bytes`] hands a frame
/// out as a [`Bytes`] view of the received bytes (no copy), which the
/// request's payload can share on its way to the entity. A view kept
/// (a buffered message) keeps its part of the buffer alive; once every view
/// is dropped the buffer's space is reused without a new allocation.
pub struct FrameReader {
    buf: BytesMut,
    pos: usize,
    max_frame_bytes: usize,
}

impl FrameReader {
    /// A reader refusing frames above `max_frame_bytes` (body length).
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameReader {
            buf: BytesMut::with_capacity(64 * 1024),
            pos: 0,
            max_frame_bytes,
        }
    }

    /// Drops the bytes of the frames already returned by [`Self::next_frame`].
    fn discard_consumed(&mut self) {
        if self.pos > 0 {
            let _ = self.buf.split_to(self.pos);
            self.pos = 0;
        }
    }

    /// Reads more bytes from `r`. Returns the number read (0 at end of stream).
    ///
    /// # Errors
    /// The read error.
    pub async fn fill<R: AsyncReadRent>(&mut self, r: &mut R) -> std::io::Result<usize> {
        self.discard_consumed();
        // Room for the frame being received (its length was checked against
        // the maximum by `next`), at least 16 KiB.
        let want = match next_frame(&self.buf, self.max_frame_bytes) {
            Ok(None) if self.buf.len() >= FRAME_HEADER_BYTES => {
                let len = u32::from_le_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]])
                    as usize;
                FRAME_HEADER_BYTES + len
            }
            _ => 0,
        };
        let need = want.max(self.buf.len() + 16 * 1024);
        if self.buf.capacity() < need {
            // Reuses the buffer's space when no view of it is left.
            self.buf.reserve(need - self.buf.len());
        }
        let len = self.buf.len();
        let cap = self.buf.capacity();
        let buf = std::mem::take(&mut self.buf);
        let (res, slice) = r
            .read(monoio::buf::IoBufMut::slice_mut(buf, len..cap))
            .await;
        self.buf = slice.into_inner();
        res
    }

    /// The next complete frame's body range, if one is buffered.
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] for a length over the maximum.
    pub fn next_frame(&mut self) -> Result<Option<Range<usize>>, FrameError> {
        match next_frame(&self.buf[self.pos..], self.max_frame_bytes)? {
            None => Ok(None),
            Some(len) => {
                let start = self.pos + FRAME_HEADER_BYTES;
                self.pos = start + len;
                Ok(Some(start..start + len))
            }
        }
    }

    /// The next complete frame's body, if one is buffered, as a view of the
    /// received bytes (shared, not copied).
    ///
    /// # Errors
    /// [`FrameError::TooLarge`] for a length over the maximum.
    pub fn next_frame_bytes(&mut self) -> Result<Option<Bytes>, FrameError> {
        self.discard_consumed();
        match next_frame(&self.buf, self.max_frame_bytes)? {
            None => Ok(None),
            Some(len) => {
                let mut frame = self.buf.split_to(FRAME_HEADER_BYTES + len);
                let _ = frame.split_to(FRAME_HEADER_BYTES);
                Ok(Some(frame.freeze()))
            }
        }
    }

    /// Bytes received and not yet returned as a frame (count): above 0
    /// once every complete frame was taken, a frame is partly received.
    pub fn pending_bytes(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes of a range returned by [`Self::next_frame`].
    pub fn body(&self, r: Range<usize>) -> &[u8] {
        &self.buf[r]
    }

    /// Reads until one complete frame is buffered and returns its range.
    ///
    /// # Errors
    /// [`TransportError::Closed`] at end of stream, I/O and frame errors.
    pub async fn read_frame<R: AsyncReadRent>(
        &mut self,
        r: &mut R,
    ) -> Result<Range<usize>, TransportError> {
        loop {
            if let Some(range) = self.next_frame()? {
                return Ok(range);
            }
            if self.fill(r).await? == 0 {
                return Err(TransportError::Closed);
            }
        }
    }
}

/// A connection whose queued output exceeds this stops being read until the
/// peer catches up, in bytes (the fronts' and the data lanes' back-pressure).
pub(crate) const OUTBOX_HIGH_WATER_BYTES: usize = 32 << 20;

/// A connection's queue of encoded frames waiting to be written, shared by
/// the tasks of one executor.
#[derive(Default)]
pub struct Outbox {
    /// Encoded frames.
    pub buf: RefCell<Vec<u8>>,
    /// Wakes the writer.
    pub notify: LocalNotify,
    /// Set when the connection is finished; the writer exits.
    pub closed: std::cell::Cell<bool>,
    /// Set by [`write_loop`] when it returned (everything queued before the
    /// close was written, or a write failed).
    pub finished: std::cell::Cell<bool>,
}

impl Outbox {
    /// Wakes the writer (after frames were appended to `buf`).
    pub fn flush(&self) {
        self.notify.notify();
    }

    /// Closes: the writer writes what is queued and exits.
    pub fn close(&self) {
        self.closed.set(true);
        self.notify.notify();
    }
}

/// A client connection's send timeout (`requests.send_timeout_ms`): how
/// long its peer may take no byte of its output, and the connection's
/// socket, whose send queue shows whether the peer takes bytes.
#[derive(Debug, Clone, Copy)]
pub struct SendTimeout {
    /// The longest time without progress.
    pub after: Duration,
    /// The connection's socket (kept open by the writer's half).
    pub fd: std::os::fd::RawFd,
}

/// Bytes in `fd`'s send queue not yet acknowledged by the peer
/// (`ioctl(TIOCOUTQ)`, `SIOCOUTQ` in tcp(7)), or `None` when the call
/// fails.
fn unacknowledged_bytes(fd: std::os::fd::RawFd) -> Option<i64> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ writes one int to the pointer, which is valid.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut n) };
    (rc == 0).then_some(i64::from(n))
}

/// Writes everything queued in `outbox`, one write per batch, until it is
/// closed or a write fails. With a `send_timeout`, the connection fails
/// with `ErrorKind::TimedOut` once a write has waited and the peer
/// acknowledged no byte of the socket's send queue for `after` (it stopped
/// reading, and its receive window closed; the queue is looked at every
/// quarter of `after` from a quarter into the wait, so this takes `after`
/// to 1.5 times it). A peer's kernel that acknowledges less often than
/// `after` is closed too: on loopback, a client whose receive buffer is
/// smaller than the 64 KiB segment size may acknowledge only the sender's
/// zero-window probes, whose interval doubles up to 2 minutes. This is
/// nginx's `send_timeout`, counted in the peer's progress rather than in
/// our write calls, because a write on a full socket waits until a third of
/// the kernel's send buffer (2 MiB here) drained, which a slow reader that
/// keeps taking bytes may need longer than `after` for. The pending write
/// is cancelled. [`Outbox::finished`] is set when it returns.
///
/// # Errors
/// The write error, or the timeout.
pub async fn write_loop<W: AsyncWriteRent>(
    w: &mut W,
    outbox: Rc<Outbox>,
    send_timeout: Option<SendTimeout>,
) -> std::io::Result<()> {
    let res = write_all_queued(w, &outbox, send_timeout).await;
    outbox.finished.set(true);
    res
}

async fn write_all_queued<W: AsyncWriteRent>(
    w: &mut W,
    outbox: &Outbox,
    send_timeout: Option<SendTimeout>,
) -> std::io::Result<()> {
    let mut spare: Vec<u8> = Vec::with_capacity(64 * 1024);
    loop {
        if outbox.buf.borrow().is_empty() {
            if outbox.closed.get() {
                return Ok(());
            }
            outbox.notify.wait().await;
            continue;
        }
        std::mem::swap(&mut *outbox.buf.borrow_mut(), &mut spare);
        let b = match send_timeout {
            None => {
                let (res, b) = w.write_all(spare).await;
                res?;
                b
            }
            Some(t) => write_all_within(w, spare, t).await?,
        };
        spare = b;
        spare.clear();
        if spare.capacity() > 4 << 20 {
            spare = Vec::with_capacity(64 * 1024);
        }
    }
}

/// Writes all of `buf`; a write that waited `t.after` while the peer
/// acknowledged nothing fails the connection (see [`write_loop`]).
async fn write_all_within<W: AsyncWriteRent>(
    w: &mut W,
    mut buf: Vec<u8>,
    t: SendTimeout,
) -> std::io::Result<Vec<u8>> {
    use monoio::buf::IoBuf;
    let len = buf.len();
    let mut written = 0;
    while written < len {
        let mut write = std::pin::pin!(w.write(buf.slice(written..len)));
        // The send queue at the last look and when it last went down; none
        // before the first look, a quarter of the timeout into the wait, so
        // that a write that does not wait costs no system call. Looking
        // every quarter catches acknowledgements that come in bursts.
        let tick = (t.after / 4).max(Duration::from_millis(10));
        let mut queued: Option<(i64, Instant)> = None;
        let (res, slice) = loop {
            monoio::select! {
                done = &mut write => break done,
                _ = monoio::time::sleep(tick) => {
                    let now = unacknowledged_bytes(t.fd);
                    match (queued, now) {
                        // First look, or the peer took bytes since the
                        // last one: wait on.
                        (None, Some(first)) => queued = Some((first, Instant::now())),
                        (Some((before, _)), Some(after)) if after < before => {
                            queued = Some((after, Instant::now()));
                        }
                        (Some((_, since)), Some(_)) if since.elapsed() < t.after => {}
                        _ => {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                format!(
                                    "the peer took no byte of its output for {} ms",
                                    t.after.as_millis()
                                ),
                            ))
                        }
                    }
                }
            }
        };
        buf = slice.into_inner();
        match res {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(buf)
}

/// Runs a client connection's writer (either front): [`write_loop`] with
/// `send_timeout`. When it fails, the socket is shut down so that the
/// connection's reader, which may be waiting for bytes that never come,
/// ends too.
///
/// # Errors
/// As [`write_loop`]: `ErrorKind::TimedOut` for the send timeout.
pub async fn client_writer<W: AsyncWriteRent>(
    w: &mut W,
    outbox: Rc<Outbox>,
    send_timeout: SendTimeout,
) -> std::io::Result<()> {
    let res = write_loop(w, outbox, Some(send_timeout)).await;
    if res.is_err() {
        shutdown_both(send_timeout.fd);
    }
    res
}

/// Shuts both directions of the socket `fd` down (`shutdown(2)`,
/// `SHUT_RDWR`): a read pending on it ends (0 bytes), so that a task
/// reading a connection whose writer gave up sees the end at once. The
/// caller must hold a half of the connection (the fd stays open).
pub fn shutdown_both(fd: std::os::fd::RawFd) {
    // SAFETY: the caller keeps the connection, so `fd` is open for this
    // borrow.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let _ = socket2::SockRef::from(&fd).shutdown(std::net::Shutdown::Both);
}

/// Writes one frame and waits until it is out (handshakes only).
async fn write_frame<W: AsyncWriteRent, T>(w: &mut W, value: &T) -> Result<(), TransportError>
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            Vec<u8>,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rkyv::rancor::Error,
        >,
    >,
{
    let mut out = Vec::new();
    encode_frame(value, &mut out).map_err(|e| TransportError::Refused(e.to_string()))?;
    let (res, _) = w.write_all(out).await;
    res?;
    Ok(())
}

/// What both sides of a handshake must agree on.
#[derive(Debug, Clone)]
pub struct Fingerprint {
    /// The shard hash's name.
    pub hash_name: String,
    /// Number of shards.
    pub number_of_shards: u32,
    /// The cluster's name (`cluster_name`).
    pub cluster_name: String,
    /// Where this node's durable state lives (`local:<data root id>` for
    /// the local journal; see `persistence::identity`).
    pub journal_identity: String,
    /// Whether this node hosts durable entity types.
    pub durable: bool,
}

impl Fingerprint {
    /// This node's [`Hello`] for a lane (`lane`, `target_core`) with the
    /// cluster id known now (`None`: not yet).
    pub fn hello(
        &self,
        me: (&str, u64),
        lane: crate::envelope::Lane,
        target_core: u16,
        cluster_id: Option<String>,
    ) -> Hello {
        Hello {
            protocol_version: crate::envelope::PROTOCOL_VERSION,
            address: me.0.to_string(),
            uid: me.1,
            lane: lane as u8,
            target_core,
            hash_name: self.hash_name.clone(),
            number_of_shards: self.number_of_shards,
            cluster_name: self.cluster_name.clone(),
            cluster_id: cluster_id.unwrap_or_default(),
            journal_identity: self.journal_identity.clone(),
            durable: self.durable,
        }
    }
}

/// Why a handshake was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The reason, sent to the peer.
    pub reason: String,
    /// Permanent: the peer is not of this cluster ([`HelloAck::fatal`]).
    pub fatal: bool,
}

impl Refusal {
    /// A permanent refusal.
    pub fn fatal(reason: String) -> Refusal {
        Refusal {
            reason,
            fatal: true,
        }
    }
}

/// The refusal of a connecting member (`peer`) whose journal identity
/// differs from the accepting member's while one side hosts durable types,
/// naming `journal.backend`. Both sides are named by role, not as "this
/// node": the refused member prints the accepting member's reason.
pub fn journal_mismatch(peer: &str, peer_journal: &str, own_journal: &str) -> String {
    format!(
        "journal mismatch: connecting member {peer} keeps its durable state in {peer_journal}, \
         the member it connected to in {own_journal}; with journal.backend = \"local\" a durable entity recovers only from the \
         journals under its node's data root, so members on different data roots (machines) \
         would start entities whose shard moved without their events. Refusing to join: put \
         every data_dir under one data root on one machine, or give every member the same \
         shared journal.backend"
    )
}

/// Checks a connecting peer's [`Hello`] against this (the accepting)
/// node's fingerprint. The reason names both sides by role (connecting
/// member, the member it connected to): it is logged here and sent to the
/// peer, which prints it.
///
/// # Errors
/// A [`Refusal`] naming the mismatch: protocol version or sharding
/// fingerprint (transient), cluster name or journal identity (fatal).
pub fn check_hello(h: &Hello, fp: &Fingerprint) -> Result<(), Refusal> {
    if h.protocol_version != crate::envelope::PROTOCOL_VERSION {
        return Err(Refusal {
            reason: format!(
                "protocol version mismatch: connecting member {} speaks {}, the member it \
                 connected to {}",
                h.address,
                h.protocol_version,
                crate::envelope::PROTOCOL_VERSION
            ),
            fatal: false,
        });
    }
    if h.hash_name != fp.hash_name || h.number_of_shards != fp.number_of_shards {
        return Err(Refusal {
            reason: format!(
                "sharding fingerprint mismatch: connecting member {} has {}/{} shards, the member \
                 it connected to {}/{} shards",
                h.address, h.hash_name, h.number_of_shards, fp.hash_name, fp.number_of_shards
            ),
            fatal: false,
        });
    }
    if h.cluster_name != fp.cluster_name {
        return Err(Refusal::fatal(format!(
            "cluster name mismatch: connecting member {} is of cluster {:?}, the member it \
             connected to of {:?}",
            h.address, h.cluster_name, fp.cluster_name
        )));
    }
    if (h.durable || fp.durable) && h.journal_identity != fp.journal_identity {
        return Err(Refusal::fatal(journal_mismatch(
            &h.address,
            &h.journal_identity,
            &fp.journal_identity,
        )));
    }
    Ok(())
}

/// The connecting side: sends `hello`, waits for the [`HelloAck`].
///
/// # Errors
/// [`TransportError::Refused`] when the peer refused (with its reason),
/// [`TransportError::HandshakeTimeout`], I/O and frame errors.
pub async fn client_handshake(
    stream: &mut TcpStream,
    reader: &mut FrameReader,
    hello: &Hello,
) -> Result<HelloAck, TransportError> {
    let fut = async {
        write_frame(stream, hello).await?;
        let r = reader.read_frame(stream).await?;
        let ack: HelloAck = decode_frame_body(reader.body(r))?;
        if !ack.accepted {
            if ack.fatal {
                return Err(TransportError::Rejected(ack.reason));
            }
            return Err(TransportError::Refused(ack.reason));
        }
        Ok(ack)
    };
    monoio::time::timeout(HANDSHAKE_TIMEOUT, fut)
        .await
        .unwrap_or(Err(TransportError::HandshakeTimeout))
}

/// The accepting side: reads a [`Hello`], checks it against `fp` and then
/// with `check` (the cluster id, which changes while the node runs),
/// answers with this node's identity (`me`: address, uid, cluster id).
///
/// # Errors
/// [`TransportError::Refused`] when the hello does not match (the peer was
/// told why), [`TransportError::HandshakeTimeout`], I/O and frame errors.
pub async fn server_handshake(
    stream: &mut TcpStream,
    reader: &mut FrameReader,
    fp: &Fingerprint,
    me: (&str, u64),
    check: impl FnOnce(&Hello) -> Result<Option<String>, Refusal>,
) -> Result<Hello, TransportError> {
    let fut = async {
        let r = reader.read_frame(stream).await?;
        let hello: Hello = decode_frame_body(reader.body(r))?;
        let verdict = check_hello(&hello, fp).and_then(|()| check(&hello));
        let (accepted, reason, fatal, cluster_id) = match &verdict {
            Ok(id) => (true, String::new(), false, id.clone().unwrap_or_default()),
            Err(r) => (false, r.reason.clone(), r.fatal, String::new()),
        };
        let ack = HelloAck {
            accepted,
            reason,
            fatal,
            address: me.0.to_string(),
            uid: me.1,
            cluster_id,
            journal_identity: fp.journal_identity.clone(),
        };
        write_frame(stream, &ack).await?;
        verdict.map_err(|r| TransportError::Refused(r.reason))?;
        Ok(hello)
    };
    monoio::time::timeout(HANDSHAKE_TIMEOUT, fut)
        .await
        .unwrap_or(Err(TransportError::HandshakeTimeout))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(request_id: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let f = crate::envelope::ServerFrame {
            request_id,
            status: 0,
            payload: payload.to_vec(),
        };
        encode_frame(&f, &mut out).expect("encode");
        out
    }

    fn payload_of(body: &[u8]) -> (u64, Vec<u8>) {
        let f = crate::envelope::access::<crate::envelope::ServerFrame>(body).expect("frame");
        (f.request_id.to_native(), f.payload.as_slice().to_vec())
    }

    #[test]
    fn frames_are_views_of_the_received_bytes_and_outlive_later_reads() {
        let mut wire = frame(1, b"first");
        wire.extend(frame(2, b"second"));
        let split = wire.len() - 3;
        let mut reader = FrameReader::new(1 << 20);
        let mut input: &[u8] = &wire[..split];
        assert_eq!(
            crate::api::block_on(reader.fill(&mut input)).expect("read"),
            split
        );
        let first = reader
            .next_frame_bytes()
            .expect("frame")
            .expect("one frame");
        assert_eq!(payload_of(&first), (1, b"first".to_vec()));
        // The second frame is incomplete: nothing yet.
        assert!(reader.next_frame_bytes().expect("no error").is_none());
        let mut rest: &[u8] = &wire[split..];
        assert_eq!(
            crate::api::block_on(reader.fill(&mut rest)).expect("read"),
            3
        );
        let second = reader
            .next_frame_bytes()
            .expect("frame")
            .expect("second frame");
        assert_eq!(payload_of(&second), (2, b"second".to_vec()));
        // The first view still reads its own bytes after the buffer moved on.
        assert_eq!(payload_of(&first), (1, b"first".to_vec()));
        assert!(reader.next_frame_bytes().expect("no error").is_none());
    }

    #[test]
    fn a_too_large_length_is_refused_before_anything_is_allocated_for_it() {
        let mut wire = frame(1, &[7u8; 64]);
        wire.truncate(FRAME_HEADER_BYTES);
        let mut reader = FrameReader::new(32);
        let mut input: &[u8] = &wire;
        crate::api::block_on(reader.fill(&mut input)).expect("read");
        assert!(matches!(
            reader.next_frame_bytes(),
            Err(FrameError::TooLarge { .. })
        ));
    }

    fn fp(journal: &str, durable: bool) -> Fingerprint {
        Fingerprint {
            hash_name: "h".into(),
            number_of_shards: 10,
            cluster_name: "c".into(),
            journal_identity: journal.into(),
            durable,
        }
    }

    #[test]
    fn journal_identities_must_agree_when_either_side_is_durable() {
        let hello = |journal: &str, durable: bool| {
            fp(journal, durable).hello(("127.0.0.1:1", 3), crate::envelope::Lane::Control, 0, None)
        };
        // Same journal: always accepted.
        assert_eq!(
            check_hello(&hello("local:a", true), &fp("local:a", true)),
            Ok(())
        );
        // Different journals, nothing durable: accepted.
        assert_eq!(
            check_hello(&hello("local:a", false), &fp("local:b", false)),
            Ok(())
        );
        // Either side durable: refused for good, naming journal.backend.
        for (theirs, ours) in [(true, false), (false, true), (true, true)] {
            let r = check_hello(&hello("local:a", theirs), &fp("local:b", ours)).unwrap_err();
            assert!(r.fatal, "{r:?}");
            assert!(r.reason.contains("journal.backend"), "{}", r.reason);
            assert!(r.reason.contains("local:a") && r.reason.contains("local:b"));
        }
        // Another cluster name: refused for good.
        let mut h = hello("local:a", false);
        h.cluster_name = "other".into();
        let r = check_hello(&h, &fp("local:a", false)).unwrap_err();
        assert!(r.fatal && r.reason.contains("cluster name"), "{r:?}");
        // Another shard count: refused, not for good (as before).
        let mut h = hello("local:a", false);
        h.number_of_shards = 11;
        let r = check_hello(&h, &fp("local:a", false)).unwrap_err();
        assert!(!r.fatal);
        // Each side's value is named by its role, so that the refused
        // member, which prints the reason, does not read its own value as
        // the other's.
        assert!(
            r.reason.contains("connecting member 127.0.0.1:1 has ")
                && r.reason.contains("/11 shards, the member it connected to "),
            "{}",
            r.reason
        );
    }
}
