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
//!   uid, and the sharding fingerprint (hash name + `number_of_shards`); a
//!   mismatch is refused with a reason on both sides.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::rc::Rc;
use std::time::Duration;

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
pub struct FrameReader {
    buf: Vec<u8>,
    pos: usize,
    max_frame_bytes: usize,
}

impl FrameReader {
    /// A reader refusing frames above `max_frame_bytes` (body length).
    pub fn new(max_frame_bytes: usize) -> Self {
        FrameReader {
            buf: Vec::with_capacity(64 * 1024),
            pos: 0,
            max_frame_bytes,
        }
    }

    /// Reads more bytes from `r`. Returns the number read (0 at end of stream).
    ///
    /// # Errors
    /// The read error.
    pub async fn fill<R: AsyncReadRent>(&mut self, r: &mut R) -> std::io::Result<usize> {
        if self.pos > 0 {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
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

    /// The bytes of a range returned by [`Self::next`].
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

/// Writes everything queued in `outbox`, one write per batch, until it is
/// closed or a write fails.
///
/// # Errors
/// The write error.
pub async fn write_loop<W: AsyncWriteRent>(w: &mut W, outbox: Rc<Outbox>) -> std::io::Result<()> {
    let res = write_all_queued(w, &outbox).await;
    outbox.finished.set(true);
    res
}

async fn write_all_queued<W: AsyncWriteRent>(w: &mut W, outbox: &Outbox) -> std::io::Result<()> {
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
        let (res, b) = w.write_all(spare).await;
        spare = b;
        spare.clear();
        if spare.capacity() > 4 << 20 {
            spare = Vec::with_capacity(64 * 1024);
        }
        res?;
    }
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
}

fn check_hello(h: &Hello, fp: &Fingerprint) -> Result<(), String> {
    if h.protocol_version != crate::envelope::PROTOCOL_VERSION {
        return Err(format!(
            "protocol version {} differs from ours ({})",
            h.protocol_version,
            crate::envelope::PROTOCOL_VERSION
        ));
    }
    if h.hash_name != fp.hash_name || h.number_of_shards != fp.number_of_shards {
        return Err(format!(
            "sharding fingerprint mismatch: peer {}/{} shards, ours {}/{} shards",
            h.hash_name, h.number_of_shards, fp.hash_name, fp.number_of_shards
        ));
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
            return Err(TransportError::Refused(ack.reason));
        }
        Ok(ack)
    };
    monoio::time::timeout(HANDSHAKE_TIMEOUT, fut)
        .await
        .unwrap_or(Err(TransportError::HandshakeTimeout))
}

/// The accepting side: reads a [`Hello`], checks it against `fp`, answers.
///
/// # Errors
/// [`TransportError::Refused`] when the hello does not match (the peer was
/// told why), [`TransportError::HandshakeTimeout`], I/O and frame errors.
pub async fn server_handshake(
    stream: &mut TcpStream,
    reader: &mut FrameReader,
    fp: &Fingerprint,
    me: (&str, u64),
) -> Result<Hello, TransportError> {
    let fut = async {
        let r = reader.read_frame(stream).await?;
        let hello: Hello = decode_frame_body(reader.body(r))?;
        let verdict = check_hello(&hello, fp);
        let ack = HelloAck {
            accepted: verdict.is_ok(),
            reason: verdict.clone().err().unwrap_or_default(),
            address: me.0.to_string(),
            uid: me.1,
        };
        write_frame(stream, &ack).await?;
        verdict.map_err(TransportError::Refused)?;
        Ok(hello)
    };
    monoio::time::timeout(HANDSHAKE_TIMEOUT, fut)
        .await
        .unwrap_or(Err(TransportError::HandshakeTimeout))
}
