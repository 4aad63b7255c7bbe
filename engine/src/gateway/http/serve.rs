//! The HTTP/1.1 connection task on a data executor.
//!
//! Every data core binds `http_address` with SO_REUSEPORT ([`bind`]) and
//! accepts its own connections ([`start`]). A connection is read in batches;
//! each complete request is dispatched at once (pipelining): entity
//! requests go through [`DataPort::client_request`], the same routing path
//! as the native protocol, with the request's sequence number as its
//! request id; the region answers through the reply sink,
//! [`Fronts::reply`], which hands replies for HTTP connections to
//! [`deliver`]. Responses are put back in request order
//! by the connection's [`ResponseQueue`] and written in one batch.
//!
//! Bounds (per connection unless noted; the configurable ones come from
//! the `[http]` table of the node config, [`crate::config::HttpConfig`]):
//! - at most `max_connections_per_core` (default 10,000) open connections
//!   per core; more are answered `503` and closed;
//! - at most [`MAX_IN_FLIGHT`] pipelined requests without a response; the
//!   socket is not read while at the limit, nor while the output queue is
//!   over the core's high-water mark, so the receive buffer holds at most
//!   one partial request plus one read;
//! - a body over `max_body_size_bytes` (default 1 MiB) is answered `413`;
//! - a request's head must arrive within `header_timeout_ms` (default 5 s)
//!   of its first byte, and its body within `body_timeout_ms` (default
//!   15 s) of its first byte, else `408` and close; an idle keep-alive
//!   connection (no partial request and no response owed) is closed after
//!   `idle_timeout_ms` (default 60 s), counted from its last read or, when
//!   a response was owed at the deadline, from that deadline. These
//!   deadlines are checked by the core's periodic sweep (every 250 ms, or a
//!   quarter of the shortest of these timeouts when that is less), not by
//!   a timer per read, so they fire up to one sweep period late;
//! - an entity request carries an ask deadline of `requests.ask_timeout_ms`
//!   (default 12 s) from its arrival; while it waits in a buffer past that
//!   deadline it is removed and answered `503` (not delivered, safe to
//!   retry); one without any answer `requests::ANSWER_GRACE_MS` (1 s) after
//!   the deadline is answered `504` (it may have reached its entity: the
//!   outcome is unknown).
//!
//! Requests already received are dispatched before the socket is read
//! again, and the header and body clocks start only when the task waits
//! for bytes of an incomplete request, so a request held back behind
//! [`MAX_IN_FLIGHT`] is never answered `408`.
//!
//! Shutdown: while the node's stop drain runs (1 s), requests are answered
//! by the stopped core (`503 ShuttingDown`); when it ends, every complete
//! request still buffered and those readable within [`STOP_READ_WINDOW`]
//! (at most [`LINGER_MAX_BYTES`]) are answered `503`, then the connection
//! closes after its answers are written, with a lingering read of at most
//! [`STOP_LINGER`] so the client gets a close, not a reset.
//!
//! After a response that ends the connection (an error, `Connection:
//! close`), the write side is shut down and the remaining input is read and
//! discarded for at most [`LINGER`] (a "lingering close", as nginx does), so
//! that the client receives the response instead of a reset.

use crate::runtime::limited;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::Future;
use std::rc::Rc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use monoio::io::{AsyncReadRent, AsyncWriteRent, Splitable};
use monoio::net::{TcpListener, TcpStream};

use super::codec::{CodecLimits, Method, Pending, RequestDecoder};
use super::metrics::{
    new_latency_histogram, ConnectionCount, DeadLetterCount, LatencySeries, MetricsSnapshot,
    RegionValue, RequestCount,
};
use super::response::{Response, ResponseQueue, CONTINUE};
use super::route::Route;
use super::{admin_response, dispatch, error_response, Action};
use crate::config::NodeConfig;
use crate::envelope::Status;
use crate::gateway::port::{ConnId, DataPort};
use crate::gateway::{FrontCounters, Fronts, Published, UNKNOWN_TYPE_LABEL};
use crate::status::{CoordinatorCommand, NodeStatus};
use crate::transport::{self, Outbox, OUTBOX_HIGH_WATER_BYTES};

/// Most pipelined requests of one connection without a response (count).
pub const MAX_IN_FLIGHT: u64 = 256;
/// How long input is drained after the last response of a closing
/// connection.
pub const LINGER: Duration = Duration::from_secs(2);
/// Bytes read from the socket at a time.
const READ_BYTES: usize = 16 * 1024;
/// How long a read still has to complete once the node's stop drain
/// ended, and how long each read after it waits for more bytes.
const STOP_READ_GRACE: Duration = Duration::from_millis(20);
/// How long a connection still reads requests once the node's stop drain
/// ended (each is answered `503`).
const STOP_READ_WINDOW: Duration = Duration::from_millis(300);
/// The lingering close of a stopping node (it exits after
/// `EXIT_WRITE_WAIT`, 2 s, of the core).
const STOP_LINGER: Duration = Duration::from_millis(1000);
/// Most bytes discarded during a lingering close.
const LINGER_MAX_BYTES: usize = 1 << 20;
/// How often a core sweeps for expired reads and asks and publishes its
/// metrics (shorter when a configured timeout is under 1 s).
const SWEEP_PERIOD: Duration = Duration::from_millis(250);
/// How long a cluster-wide stats request waits for the other members.
const CLUSTER_STATS_TIMEOUT: Duration = Duration::from_secs(3);

/// What a pending entity request needs for its response.
struct InFlight {
    head_only: bool,
    keep_alive: bool,
    type_name: String,
    started: Instant,
}

/// One HTTP connection's shared state (the connection task and
/// [`deliver`]).
pub(in crate::gateway) struct HttpConn {
    outbox: Rc<Outbox>,
    queue: RefCell<ResponseQueue>,
    asks: RefCell<HashMap<u64, InFlight>>,
    /// A response that ends the connection was written.
    closing: Cell<bool>,
    /// Wakes the reader when responses drain.
    drained: crate::runtime::LocalNotify,
    /// When the read in progress times out ([`far_future`] while not
    /// reading); checked by the core's sweep, which then wakes `expired`.
    /// (No timer per read: a timer entry per request cost more than the
    /// request's routing.)
    deadline: Cell<Instant>,
    /// Woken by the sweep when `deadline` passed.
    expired: crate::runtime::LocalNotify,
}

/// A deadline that never comes (100 years from `now`).
fn far_future(now: Instant) -> Instant {
    now + Duration::from_secs(100 * 365 * 24 * 3600)
}

impl HttpConn {
    /// Stores a response and writes what is in order.
    fn complete(&self, seq: u64, bytes: Vec<u8>, close: bool) {
        let mut q = self.queue.borrow_mut();
        if !q.complete(seq, bytes, close) {
            return;
        }
        let closed = q.drain_into(&mut self.outbox.buf.borrow_mut());
        drop(q);
        if closed {
            self.closing.set(true);
        }
        self.outbox.flush();
        self.drained.notify();
    }

    fn respond(&self, seq: u64, r: &Response, head_only: bool, keep_alive: bool) {
        let mut q = self.queue.borrow_mut();
        if q.is_next(seq) {
            // In order: encode straight into the output buffer.
            r.encode(head_only, keep_alive, &mut self.outbox.buf.borrow_mut());
            q.written_in_order(!keep_alive);
            drop(q);
            if !keep_alive {
                self.closing.set(true);
            }
            self.outbox.flush();
            self.drained.notify();
            return;
        }
        drop(q);
        let mut bytes = Vec::with_capacity(128 + r.body.len());
        r.encode(head_only, keep_alive, &mut bytes);
        self.complete(seq, bytes, !keep_alive);
    }
}

/// The HTTP front's state on one data executor (part of [`Fronts`]).
pub(in crate::gateway) struct HttpState {
    /// Open HTTP connections.
    pub(in crate::gateway) conns: HashMap<ConnId, Rc<HttpConn>>,
    /// Requests, latencies and connections.
    pub(in crate::gateway) metrics: FrontCounters,
    /// An entity request without any answer after this long is answered
    /// `504`: the ask timeout plus the answer grace.
    answer_timeout: Duration,
}

impl HttpState {
    pub(in crate::gateway) fn new(answer_timeout: Duration) -> HttpState {
        HttpState {
            conns: HashMap::new(),
            metrics: FrontCounters::default(),
            answer_timeout,
        }
    }
}

/// Hands an entity's answer to an HTTP connection of this executor.
/// Returns the payload back (and does nothing) when `conn` is not an HTTP
/// connection; called by [`Fronts::reply`] for every client reply.
pub(in crate::gateway) fn deliver(
    fronts: &Fronts,
    conn: ConnId,
    request_id: u64,
    status: Status,
    payload: Vec<u8>,
) -> Option<Vec<u8>> {
    let Some(c) = fronts.state().http.conns.get(&conn).cloned() else {
        return Some(payload);
    };
    let Some(f) = c.asks.borrow_mut().remove(&request_id) else {
        return None; // answered already (timed out)
    };
    let r = Response::from_status(status, payload);
    let micros = f.started.elapsed().as_micros().min(u128::from(u64::MAX)) as u64;
    // Unknown type names are not labels: a client could create any number.
    let label = if status == Status::UnknownEntityType {
        UNKNOWN_TYPE_LABEL
    } else {
        f.type_name.as_str()
    };
    {
        let mut h = fronts.state();
        h.http.metrics.record(label, r.code, Some(micros));
        h.dirty = true;
    }
    c.respond(request_id, &r, f.head_only, f.keep_alive);
    None
}

/// The HTTP front of one data core, bound before the core starts.
pub(crate) struct HttpFront {
    /// Taken by the accept loop ([`start`]).
    listener: Option<TcpListener>,
    /// The executor's fronts (state and counters).
    fronts: Fronts,
    number_of_shards: u32,
    limits: CodecLimits,
    /// Time allowed for a request's line and headers, from its first byte.
    header_timeout: Duration,
    /// Time allowed for a whole request, from its first byte.
    body_timeout: Duration,
    /// An idle keep-alive connection is closed after this long.
    idle_timeout: Duration,
    /// Most open connections on this core (count).
    max_conns: usize,
    /// A connection whose output moves no byte for this long is closed
    /// (`requests.send_timeout_ms`).
    send_timeout: Duration,
}

/// Binds `http_address` (SO_REUSEPORT) for data core `core`, when the config
/// names one. A bind error is logged and the core runs without HTTP (the
/// node checked the address before starting its executors).
pub(crate) fn bind(config: &NodeConfig, core: u16, fronts: &Fronts) -> Option<HttpFront> {
    let addr = config.http_address?;
    match transport::listener(addr, true) {
        Ok(listener) => Some(HttpFront {
            listener: Some(listener),
            fronts: fronts.clone(),
            number_of_shards: config.number_of_shards,
            limits: CodecLimits {
                // Validated to at most 64 MiB, so it fits usize.
                max_body_bytes: usize::try_from(config.http.max_body_size_bytes)
                    .unwrap_or(usize::MAX),
                ..CodecLimits::default()
            },
            header_timeout: config.http.header_timeout(),
            body_timeout: config.http.body_timeout(),
            idle_timeout: config.http.idle_timeout(),
            max_conns: config.http.max_connections_per_core as usize,
            send_timeout: config.requests.send_timeout(),
        }),
        Err(e) => {
            tracing::error!(core, %addr, error = %e, "cannot bind http_address");
            None
        }
    }
}

/// Starts accepting HTTP connections on this executor (no-op for `None`);
/// returns the accept loop's stop notify and task, for
/// [`crate::runtime::stop_accepting`].
pub(crate) fn start<P: DataPort>(
    port: &P,
    front: Option<HttpFront>,
) -> Option<(crate::runtime::LocalNotify, monoio::task::JoinHandle<()>)> {
    let mut front = front?;
    let listener = front.listener.take()?;
    // Read deadlines are enforced by the sweep: at most a quarter of the
    // shortest timeout late.
    let sweep_period = SWEEP_PERIOD
        .min(front.header_timeout / 4)
        .min(front.idle_timeout / 4)
        .max(Duration::from_millis(5));
    let front = Rc::new(front);
    let fronts = front.fronts.clone();
    monoio::spawn(async move {
        loop {
            monoio::time::sleep(sweep_period).await;
            sweep(&fronts);
        }
    });
    let port = port.clone();
    let stop = crate::runtime::LocalNotify::default();
    let stop_accept = stop.clone();
    let task = monoio::spawn(async move {
        while let Some(r) = crate::runtime::accept_or_stop(&listener, &stop_accept).await {
            match r {
                Ok((stream, _)) => {
                    transport::tune(&stream);
                    let full = {
                        let mut h = front.fronts.state();
                        h.http.metrics.accepted += 1;
                        h.dirty = true;
                        let full = h.http.conns.len() >= front.max_conns;
                        if full {
                            h.http.metrics.refused += 1;
                        }
                        full
                    };
                    if full {
                        monoio::spawn(refuse(stream));
                    } else {
                        monoio::spawn(serve_http(port.clone(), front.clone(), stream));
                    }
                }
                Err(e) => {
                    limited!(warn, error = %e, "http accept failed");
                    monoio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        drop(listener);
    });
    Some((stop, task))
}

/// Answers `503` to a connection over the per-core limit and closes it.
async fn refuse(mut stream: TcpStream) {
    let mut out = Vec::new();
    Response::text(503, "too many connections on this core, retry later")
        .encode(false, false, &mut out);
    let (_, _) = monoio::io::AsyncWriteRentExt::write_all(&mut stream, out).await;
    let _ = stream.shutdown().await;
}

/// Answers expired asks with `504` and publishes this core's metrics.
fn sweep(fronts: &Fronts) {
    let (conns, answer_timeout): (Vec<Rc<HttpConn>>, Duration) = {
        let h = fronts.state();
        (
            h.http.conns.values().cloned().collect(),
            h.http.answer_timeout,
        )
    };
    let now = Instant::now();
    for c in conns {
        if now >= c.deadline.get() {
            c.expired.notify();
        }
        let expired: Vec<(u64, InFlight)> = {
            let mut asks = c.asks.borrow_mut();
            let keys: Vec<u64> = asks
                .iter()
                .filter(|(_, f)| f.started.elapsed() >= answer_timeout)
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter()
                .filter_map(|k| asks.remove(&k).map(|f| (k, f)))
                .collect()
        };
        for (seq, f) in expired {
            let r = Response::from_status(
                Status::TimedOut,
                format!(
                    "no reply within {} ms; it may have reached its entity",
                    answer_timeout.as_millis()
                )
                .into_bytes(),
            );
            {
                let mut h = fronts.state();
                h.http.metrics.record(&f.type_name, r.code, None);
                h.dirty = true;
            }
            c.respond(seq, &r, f.head_only, f.keep_alive);
        }
    }
    fronts.publish();
}

/// How a read of the connection task ended.
enum ReadEnd {
    /// The read completed.
    Done(std::io::Result<usize>, Vec<u8>),
    /// The sweep woke `expired` and the read was cancelled before any
    /// byte came (bytes that came first end it as [`ReadEnd::Done`]).
    Expired,
    /// The node's stop drain ended; no bytes came within [`STOP_READ_GRACE`]
    /// (the read was cancelled, its buffer dropped).
    Stopped,
}

/// Reads into `buf` until the read completes, `expired` is woken, or the
/// node's stop drain ended (`stop` closed; the read then gets
/// [`STOP_READ_GRACE`] more to complete, so bytes already on their way are
/// not lost with a cancelled read).
async fn read_or_expire<R: monoio::io::CancelableAsyncReadRent>(
    r: &mut R,
    buf: Vec<u8>,
    expired: &crate::runtime::LocalNotify,
    stop: &Outbox,
) -> ReadEnd {
    let canceller = monoio::io::Canceller::new();
    let mut read = std::pin::pin!(r.cancelable_read(buf, canceller.handle()));
    let mut wait = std::pin::pin!(expired.wait());
    let mut stopped = std::pin::pin!(stop.notify.wait());
    let mut woken = false;
    let first = std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready((res, b)) = read.as_mut().poll(cx) {
            return std::task::Poll::Ready(Some(ReadEnd::Done(res, b)));
        }
        if wait.as_mut().poll(cx).is_ready() {
            woken = true;
            return std::task::Poll::Ready(None);
        }
        // `stop` is only ever notified by its close.
        let _ = stopped.as_mut().poll(cx);
        if stop.closed.get() {
            return std::task::Poll::Ready(None);
        }
        std::task::Poll::Pending
    })
    .await;
    if let Some(end) = first {
        return end;
    }
    if woken {
        // Cancel the read and wait for its end instead of dropping it: bytes
        // the kernel put in the buffer before the cancel took effect are
        // kept (a dropped read lost them, and the connection's next request
        // with them).
        let _ = canceller.cancel();
        let (res, b) = read.await;
        return match res {
            Err(e) if e.raw_os_error() == Some(libc::ECANCELED) => ReadEnd::Expired,
            res => ReadEnd::Done(res, b),
        };
    }
    match monoio::time::timeout(STOP_READ_GRACE, read).await {
        Ok((res, b)) => ReadEnd::Done(res, b),
        Err(_) => ReadEnd::Stopped,
    }
}

/// Reads into `buf` with a deadline; `None` when the deadline passed.
async fn read_until<R: AsyncReadRent>(
    r: &mut R,
    buf: Vec<u8>,
    deadline: Instant,
) -> Option<(std::io::Result<usize>, Vec<u8>)> {
    let left = deadline.saturating_duration_since(Instant::now());
    monoio::time::timeout(left, r.read(buf)).await.ok()
}

/// What [`take_requests`] stopped at.
enum Taken {
    /// No complete request is buffered: read more.
    NeedBytes,
    /// The in-flight limit is reached: wait for responses first.
    Full,
    /// The connection ends after what was dispatched (`Connection: close`
    /// or a request that cannot be framed).
    Stop,
}

/// Dispatches the complete requests buffered in `decoder`, in order, up to
/// the in-flight limit. Requests already received are always served
/// before the socket is read again.
fn take_requests<P: DataPort>(
    port: &P,
    front: &Rc<HttpFront>,
    conn: &Rc<HttpConn>,
    conn_id: u64,
    decoder: &mut RequestDecoder,
) -> Taken {
    if decoder.is_poisoned() {
        return Taken::Stop;
    }
    // One clock read per batch of requests (and per READ_CLOCK_EVERY
    // requests of a long one): their read time, and the data plane's
    // current time while it handles them.
    let mut clock = crate::gateway::ReadClock::new();
    loop {
        if conn.queue.borrow().in_flight() >= MAX_IN_FLIGHT {
            return Taken::Full;
        }
        match decoder.next_request() {
            Ok(Some(req)) => {
                let now = clock.next();
                let keep_alive = req.keep_alive;
                handle(port, front, conn, conn_id, req, now, false);
                if !keep_alive {
                    return Taken::Stop;
                }
            }
            Ok(None) => {
                if decoder.take_continue() && conn.queue.borrow().in_flight() == 0 {
                    conn.outbox.buf.borrow_mut().extend_from_slice(CONTINUE);
                    conn.outbox.flush();
                }
                return Taken::NeedBytes;
            }
            Err(e) => {
                let seq = conn.queue.borrow_mut().begin();
                conn.respond(seq, &error_response(&e), false, false);
                return Taken::Stop;
            }
        }
    }
}

/// The node's stop drain ended while the connection was open: every
/// complete request already buffered, and those readable within
/// [`STOP_READ_WINDOW`] (at most [`LINGER_MAX_BYTES`]), is answered — an
/// entity request through the stopped core (`503 ShuttingDown`, not
/// delivered), anything else `503` directly — in order after the answers
/// still owed.
async fn answer_after_stop<R: AsyncReadRent, P: DataPort>(
    r: &mut R,
    buf: &mut Vec<u8>,
    port: &P,
    front: &Rc<HttpFront>,
    conn: &Rc<HttpConn>,
    conn_id: u64,
    decoder: &mut RequestDecoder,
) {
    let until = Instant::now() + STOP_READ_WINDOW;
    let mut read = 0usize;
    let mut answered = 0u64;
    loop {
        match decoder.next_request() {
            Ok(Some(req)) => {
                answered += 1;
                let keep_alive = req.keep_alive;
                // The core is stopped: an entity request is answered at
                // once (503, or 400/404 for a bad id or type), an admin
                // route 503.
                handle(port, front, conn, conn_id, req, Instant::now(), true);
                if !keep_alive {
                    break;
                }
            }
            Ok(None) => {
                if read >= LINGER_MAX_BYTES || Instant::now() >= until {
                    break;
                }
                let mut b = std::mem::take(buf);
                if b.capacity() == 0 {
                    b = Vec::with_capacity(READ_BYTES);
                }
                let wait = (Instant::now() + STOP_READ_GRACE).min(until);
                match read_until(r, b, wait).await {
                    Some((Ok(n), back)) if n > 0 => {
                        read += n;
                        // No clocks run any more: the time is not used.
                        decoder.feed(&back[..n], Duration::ZERO);
                        *buf = back;
                        buf.clear();
                    }
                    Some((_, back)) => {
                        *buf = back;
                        break;
                    }
                    None => break,
                }
            }
            Err(e) => {
                let seq = conn.queue.borrow_mut().begin();
                conn.respond(seq, &error_response(&e), false, false);
                break;
            }
        }
    }
    if answered > 0 {
        tracing::debug!(
            conn = conn_id,
            answered,
            "requests read after the stop drain answered"
        );
    }
}

/// Serves one HTTP connection until it closes, breaks the protocol or
/// times out.
async fn serve_http<P: DataPort>(port: P, front: Rc<HttpFront>, stream: TcpStream) {
    let peer = stream.peer_addr().ok();
    let outbox = Rc::new(Outbox::default());
    // What the core knows of this connection: closed by the core when its
    // stop drain ends (the connection then answers what it has read and
    // closes itself), `finished` once this task is done. Answers go through
    // [`deliver`] and the connection's own `outbox`.
    let signal = Rc::new(Outbox::default());
    let conn_id = port.open_conn(signal.clone());
    let conn = Rc::new(HttpConn {
        outbox: outbox.clone(),
        queue: RefCell::new(ResponseQueue::default()),
        asks: RefCell::new(HashMap::new()),
        closing: Cell::new(false),
        drained: Default::default(),
        deadline: Cell::new(far_future(Instant::now())),
        expired: Default::default(),
    });
    {
        let mut h = front.fronts.state();
        h.http.conns.insert(conn_id, conn.clone());
        h.dirty = true;
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (mut r, mut w) = stream.into_split();
    let wb = outbox.clone();
    let writer_done = Rc::new(crate::runtime::LocalNotify::default());
    let writer_flag = Rc::new(Cell::new(false));
    {
        let writer_done = writer_done.clone();
        let writer_flag = writer_flag.clone();
        let send_timeout = front.send_timeout;
        monoio::spawn(async move {
            let t = transport::SendTimeout {
                after: send_timeout,
                fd,
            };
            if let Err(e) = transport::client_writer(&mut w, wb, t).await {
                if e.kind() == std::io::ErrorKind::TimedOut {
                    limited!(info, front = "http", ?peer, error = %e, "client takes no responses (requests.send_timeout_ms); closing the connection");
                }
            }
            let _ = w.shutdown().await;
            writer_flag.set(true);
            writer_done.notify();
        });
    }
    let mut decoder = RequestDecoder::new(front.limits);
    let origin = Instant::now();
    let mut last_activity = Instant::now();
    let mut buf = Vec::with_capacity(READ_BYTES);
    let mut stop_reading = false;
    let mut eof = false;
    let mut stopped = false;
    'conn: loop {
        if conn.closing.get() || outbox.finished.get() {
            break;
        }
        if signal.closed.get() {
            stopped = true;
            break;
        }
        if stop_reading {
            // Wait for the remaining responses (bounded by the ask deadline
            // plus the answer grace, or by the node's stop drain).
            if conn.queue.borrow().in_flight() == 0 {
                break;
            }
            let _ = monoio::time::timeout(Duration::from_millis(50), conn.drained.wait()).await;
            continue;
        }
        // Back-pressure: no reading while the client does not take its
        // responses or too many requests are outstanding.
        while conn.queue.borrow().in_flight() >= MAX_IN_FLIGHT
            || outbox.buf.borrow().len() > OUTBOX_HIGH_WATER_BYTES
        {
            if conn.closing.get() || outbox.finished.get() {
                break 'conn;
            }
            if signal.closed.get() {
                stopped = true;
                break 'conn;
            }
            let _ = monoio::time::timeout(Duration::from_millis(5), conn.drained.wait()).await;
        }
        // Requests already received are served before the socket is read.
        match take_requests(&port, &front, &conn, conn_id, &mut decoder) {
            Taken::NeedBytes => {}
            Taken::Full => continue,
            Taken::Stop => {
                stop_reading = true;
                continue;
            }
        }
        // The header and body clocks of a request whose bytes came with an
        // earlier one start now, when the node waits for the rest.
        decoder.start_clock(Instant::now().saturating_duration_since(origin));
        let deadline = match decoder.pending() {
            Some(Pending::Headers { since }) => origin + since + front.header_timeout,
            Some(Pending::Body { since, .. }) => origin + since + front.body_timeout,
            None => last_activity + front.idle_timeout,
        };
        conn.deadline.set(deadline);
        let got = read_or_expire(&mut r, std::mem::take(&mut buf), &conn.expired, &signal).await;
        conn.deadline.set(far_future(deadline));
        let (res, b) = match got {
            ReadEnd::Done(res, b) => (res, b),
            ReadEnd::Stopped => {
                buf = Vec::with_capacity(READ_BYTES);
                stopped = true;
                break;
            }
            ReadEnd::Expired => {
                buf = Vec::with_capacity(READ_BYTES);
                if Instant::now() < deadline {
                    // A wake-up for an earlier deadline: read again.
                    continue;
                }
                if decoder.pending().is_some() {
                    let seq = conn.queue.borrow_mut().begin();
                    let resp = Response::text(408, "request not received in time");
                    conn.respond(seq, &resp, false, false);
                    stop_reading = true;
                    continue;
                }
                if conn.queue.borrow().in_flight() > 0 {
                    // Not idle: a response is still owed (a slow ask, or the
                    // cluster stats waiting for a member); idle time counts
                    // again from now.
                    last_activity = Instant::now();
                    continue;
                }
                break;
            }
        };
        buf = b;
        let n = match res {
            Ok(0) => {
                eof = true;
                stop_reading = true;
                continue;
            }
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(error = %e, "http read failed");
                break;
            }
        };
        let now = Instant::now();
        last_activity = now;
        decoder.feed(&buf[..n], now.saturating_duration_since(origin));
        buf.clear();
    }
    if stopped && !conn.closing.get() && !outbox.finished.get() && !eof && !stop_reading {
        // The node's stop drain ended: answer what was read or is readable
        // now, then close.
        answer_after_stop(
            &mut r,
            &mut buf,
            &port,
            &front,
            &conn,
            conn_id,
            &mut decoder,
        )
        .await;
    }
    // Lingering close: the writer flushes and shuts down the write side; the
    // input is drained so the client reads its last response, not a reset.
    {
        let mut h = front.fronts.state();
        h.http.conns.remove(&conn_id);
        h.dirty = true;
    }
    outbox.close();
    if !eof && (conn.closing.get() || stopped) {
        // A stopping node exits soon after its drain: linger less.
        let linger = if stopped { STOP_LINGER } else { LINGER };
        let until = Instant::now() + linger;
        let mut drained = 0;
        while !writer_flag.get() && Instant::now() < until {
            let _ = monoio::time::timeout(until - Instant::now(), writer_done.wait()).await;
        }
        let mut b = std::mem::take(&mut buf);
        if b.capacity() == 0 {
            // The buffer went with a read cancelled by a deadline.
            b = Vec::with_capacity(READ_BYTES);
        }
        while drained < LINGER_MAX_BYTES {
            match read_until(&mut r, b, until).await {
                Some((Ok(n), back)) if n > 0 => {
                    drained += n;
                    b = back;
                    b.clear();
                }
                _ => break,
            }
        }
    } else if stopped && !writer_flag.get() {
        // Stopping: the answers go out before the core exits.
        let _ = monoio::time::timeout(STOP_LINGER, writer_done.wait()).await;
    }
    port.close_conn(conn_id);
    signal.finished.set(true);
}

/// Dispatches one request: answers at once, asks the entity, or starts an
/// admin task. After the node's stop drain (`stopped`) an admin route is
/// answered `503 ShuttingDown` instead (the entity request still goes to the
/// stopped core, which answers it at once).
fn handle<P: DataPort>(
    port: &P,
    front: &Rc<HttpFront>,
    conn: &Rc<HttpConn>,
    conn_id: u64,
    req: super::Request,
    now: Instant,
    stopped: bool,
) {
    let head_only = req.method == Method::Head;
    let keep_alive = req.keep_alive;
    let seq = conn.queue.borrow_mut().begin();
    match dispatch(req) {
        Action::Respond(r) => {
            record(&front.fronts, None, r.code);
            conn.respond(seq, &r, head_only, keep_alive);
        }
        Action::Ask {
            type_name,
            entity_id,
            payload,
        } => {
            conn.asks.borrow_mut().insert(
                seq,
                InFlight {
                    head_only,
                    keep_alive,
                    type_name: type_name.as_str().to_string(),
                    started: now,
                },
            );
            port.client_request(
                conn_id,
                seq,
                type_name.as_str().as_bytes(),
                entity_id.as_str().as_bytes(),
                payload.into(),
                now,
            );
        }
        Action::Admin(_) if stopped => {
            let resp =
                Response::from_status(Status::ShuttingDown, b"the node is shutting down".to_vec());
            record(&front.fronts, None, resp.code);
            conn.respond(seq, &resp, head_only, keep_alive);
        }
        Action::Admin(Route::Live) => {
            record(&front.fronts, None, 200);
            conn.respond(seq, &Response::text(200, "live"), head_only, keep_alive);
        }
        Action::Admin(route) => {
            let port = port.clone();
            let front = front.clone();
            let conn = conn.clone();
            monoio::spawn(async move {
                if route == Route::Metrics {
                    front.fronts.publish();
                }
                let cmd = match &route {
                    Route::Allocation => Some(CoordinatorCommand::Allocation),
                    Route::Rebalance { type_name } => Some(CoordinatorCommand::Rebalance {
                        type_name: type_name.as_ref().map(|t| t.as_str().to_string()),
                    }),
                    _ => None,
                };
                if let Some(cmd) = cmd {
                    let r = super::coordinator_admin_response(port.coordinator_admin(cmd).await);
                    record(&front.fronts, None, r.code);
                    conn.respond(seq, &r, head_only, keep_alive);
                    return;
                }
                let r = match port.node_status().await {
                    Some(status) if matches!(route, Route::ShardingStats { .. }) => {
                        sharding_stats(&port, &route, &status, front.number_of_shards).await
                    }
                    Some(status) => {
                        if let Route::ShardOf { entity_id, shards } = &route {
                            let shard = shardline_core::sharding::shard_id_of(
                                entity_id.as_str(),
                                front.number_of_shards.max(1),
                            );
                            let cached = port.cached_homes(shard);
                            super::shard_of_response(
                                entity_id,
                                *shards,
                                front.number_of_shards,
                                &status,
                                &cached,
                            )
                        } else {
                            admin_response(&route, &status, front.number_of_shards, || {
                                node_metrics(&front, &status)
                            })
                        }
                    }
                    None => Response::text(503, "the node's control executor did not answer"),
                };
                record(&front.fronts, None, r.code);
                conn.respond(seq, &r, head_only, keep_alive);
            });
        }
    }
}

/// `GET /v1/sharding/{type}/stats`: this node's regions and every other Up
/// member's, gathered over the control lanes (404 when this node has no
/// region of the type; 503 when the control executor does not answer).
async fn sharding_stats<P: DataPort>(
    port: &P,
    route: &Route,
    status: &NodeStatus,
    number_of_shards: u32,
) -> Response {
    let Route::ShardingStats { type_name } = route else {
        return admin_response(route, status, number_of_shards, Default::default);
    };
    if !status
        .regions
        .iter()
        .any(|r| r.type_name == type_name.as_str())
    {
        return admin_response(route, status, number_of_shards, Default::default);
    }
    match port
        .cluster_stats(type_name.as_str(), status, CLUSTER_STATS_TIMEOUT)
        .await
    {
        Some(stats) => super::sharding_stats_response(type_name, &stats),
        None => Response::text(503, "the node's control executor did not answer"),
    }
}

/// Counts a response of the HTTP front that no entity gave (no latency).
fn record(fronts: &Fronts, type_name: Option<&str>, code: u16) {
    let mut h = fronts.state();
    h.http.metrics.record(type_name.unwrap_or(""), code, None);
    h.dirty = true;
}

/// Builds the metrics snapshot of this node: both fronts' counters every
/// core published (merged), the regions' figures from the node status, and
/// the `fdatasync` latency of every data core's journal.
fn node_metrics(front: &HttpFront, status: &NodeStatus) -> MetricsSnapshot {
    let mut m = MetricsSnapshot::default();
    let board = front.fronts.state().board.clone();
    let cores: Vec<(u16, Published)> = board.snapshot();
    type Requests = std::collections::BTreeMap<(&'static str, String, u16), u64>;
    type Latency = std::collections::BTreeMap<(&'static str, String), Histogram<u64>>;
    let mut requests: Requests = Default::default();
    let mut latency: Latency = Default::default();
    for (core, p) in &cores {
        for (front_name, cm) in [("http", &p.http), ("native", &p.native)] {
            for (t, by_code) in &cm.requests {
                for (code, n) in by_code {
                    *requests.entry((front_name, t.clone(), *code)).or_insert(0) += n;
                }
            }
            for (t, h) in &cm.latency {
                let merged = latency
                    .entry((front_name, t.clone()))
                    .or_insert_with(new_latency_histogram);
                let _ = merged.add(h);
            }
            m.connections.push(ConnectionCount {
                front: front_name,
                core: *core,
                open: cm.open,
                accepted: cm.accepted,
                refused: cm.refused,
            });
        }
    }
    m.connections.sort_by_key(|c| (c.front, c.core));
    m.requests = requests
        .into_iter()
        .map(|((front, type_name, code), count)| RequestCount {
            front,
            type_name,
            code,
            count,
        })
        .collect();
    m.request_latency = latency
        .into_iter()
        .map(|((front, type_name), micros)| LatencySeries {
            front,
            type_name,
            micros,
        })
        .collect();
    region_metrics(&mut m, &status.regions);
    m.journal_flush_micros = board.journal_flush_micros();
    m
}

/// Adds the per-region series of `regions` (one entry per type and core) to
/// `m`. Dead letters get one series per (type, reason), summed over cores;
/// a stateless worker pool's refusals count under `worker_queue_full`.
fn region_metrics(m: &mut MetricsSnapshot, regions: &[crate::status::RegionStatusView]) {
    let mut dead_letters: std::collections::BTreeMap<(String, String), u64> =
        std::collections::BTreeMap::new();
    for r in regions {
        let v = |value: u64| RegionValue {
            type_name: r.type_name.clone(),
            core: r.core,
            value,
        };
        m.buffered_messages.push(v(r.buffered as u64));
        m.shards.push(v(r.shards.len() as u64));
        m.active_entities.push(v(r.entities as u64));
        m.messages_delivered.push(v(r.messages_delivered));
        m.hand_offs_begun.push(v(r.hand_offs_begun));
        m.hand_offs_completed.push(v(r.hand_offs_completed));
        if let Some(w) = &r.worker {
            m.worker_activations.push(v(w.activations as u64));
            m.worker_activations_max
                .push(v(w.max_activations_seen as u64));
            m.worker_queued.push(v(w.queued as u64));
            m.worker_executed.push(v(w.executed_locally));
        }
        // One series per (type, reason): the cores' counts are summed.
        for (reason, count) in &r.dead_letter_reasons {
            *dead_letters
                .entry((r.type_name.clone(), reason.clone()))
                .or_insert(0) += *count;
        }
        if let Some(w) = r.worker.as_ref().filter(|w| w.rejected > 0) {
            *dead_letters
                .entry((r.type_name.clone(), "worker_queue_full".to_string()))
                .or_insert(0) += w.rejected;
        }
    }
    m.dead_letters.extend(
        dead_letters
            .into_iter()
            .map(|((type_name, reason), count)| DeadLetterCount {
                type_name,
                reason,
                count,
            }),
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gateway::http::metrics::write_prometheus;
    use crate::status::RegionStatusView;

    fn region(core: u16, reasons: &[(&str, u64)], rejected: Option<u64>) -> RegionStatusView {
        let mut v: RegionStatusView = serde_json::from_value(serde_json::json!({
            "type_name": "counter",
            "core": core,
            "proxy": false,
            "registered": true,
            "shards": {},
            "entities": 0,
            "messages_delivered": 0,
            "entities_activated": 0,
            "dead_letters": reasons.iter().map(|(_, n)| n).sum::<u64>(),
            "buffered": 0,
            "hand_offs_begun": 0,
            "hand_offs_completed": 0,
        }))
        .expect("a region status");
        v.dead_letter_reasons = reasons.iter().map(|(r, n)| (r.to_string(), *n)).collect();
        v.worker = rejected.map(|rejected| crate::status::WorkerPoolStatus {
            max_local_workers: 2,
            core_limit: 1,
            activations: 0,
            max_activations_seen: 1,
            queued: 0,
            executed_locally: 0,
            created: 1,
            collected: 1,
            rejected,
        });
        v
    }

    #[test]
    fn dead_letters_are_one_series_per_type_and_reason_summed_over_cores() {
        let regions = [
            region(0, &[("buffer_full", 2), ("shutting_down", 1)], None),
            region(1, &[("buffer_full", 3)], Some(4)),
        ];
        let mut m = MetricsSnapshot::default();
        region_metrics(&mut m, &regions);
        let got: Vec<(&str, &str, u64)> = m
            .dead_letters
            .iter()
            .map(|d| (d.type_name.as_str(), d.reason.as_str(), d.count))
            .collect();
        assert_eq!(
            got,
            vec![
                ("counter", "buffer_full", 5),
                ("counter", "shutting_down", 1),
                ("counter", "worker_queue_full", 4)
            ]
        );
        let text = write_prometheus(&m);
        assert!(
            text.contains(
                "shardline_dead_letters_total{type=\"counter\",reason=\"buffer_full\"} 5\n"
            ),
            "{text}"
        );
        assert_eq!(
            text.matches("shardline_dead_letters_total{type=\"counter\",reason=\"buffer_full\"}")
                .count(),
            1,
            "{text}"
        );
    }
}
