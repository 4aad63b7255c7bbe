//! The native client protocol front (length-prefixed rkyv frames with a
//! request id, pipelined): the connection task, the decoding of client
//! frames, and the front's bookkeeping (open connections, requests without
//! an answer, counters by entity type for `/metrics`).
//!
//! A connection is read in batches; every complete frame in a batch is
//! handled at once (pipelining), the responses are queued in the
//! connection's [`Outbox`] and written together. A request whose payload
//! exceeds `requests.max_message_size_bytes` is answered `TooLarge` (the
//! same limit as the HTTP front's and the node-to-node wire's, so a
//! request's fate never depends on where its entity lives). A frame longer
//! than that limit plus the envelope overhead is answered with a
//! `TooLarge` frame with request id 0 (its request id was not read), and
//! the connection is closed after the frame is written and its input
//! drained for at most [`LINGER`]. Any other protocol error (a body that
//! fails validation) closes that connection only, with a logged reason; a
//! bad entity type or id gets an error response. A connection accepted
//! while the core already has `requests.max_native_connections_per_core`
//! open gets one `Unavailable` frame with request id 0 and is closed.

use crate::runtime::limited;
use std::rc::Rc;
use std::time::{Duration, Instant};

use monoio::io::Splitable;
use monoio::net::TcpStream;

use super::port::{ConnId, DataPort};
use super::{FrontCounters, Fronts, UNKNOWN_TYPE_LABEL};
use crate::envelope::{
    access, encode_frame, ArchivedClientFrame, ClientFrame, FrameError, ServerFrame, Status,
    MAX_FRAME_SIZE_BYTES,
};
use crate::status::CoordinatorCommand;
use crate::transport::{self, FrameReader, Outbox, OUTBOX_HIGH_WATER_BYTES};

/// How long the input of a connection closed for an oversized frame is
/// read and discarded, so that the client reads the `TooLarge` frame
/// instead of a reset.
pub const LINGER: Duration = Duration::from_secs(2);
/// Most bytes discarded during that linger.
const LINGER_MAX_BYTES: usize = 64 << 20;
/// How long a connection refused for the connection limit is read and
/// discarded after its `Unavailable` frame (shorter than [`LINGER`]: a
/// storm of refused connections should not pile up).
const REFUSE_LINGER: Duration = Duration::from_millis(500);
/// Most refused connections of one core discarding their input at once
/// (count): each holds a descriptor for up to [`REFUSE_LINGER`], which the
/// connection limit does not count, so a flood of refused connections
/// would otherwise use up the descriptors the limit was fitted to leave
/// (`NodeConfig::fit_connection_limits`). Past it, a refused connection
/// gets its frame and is closed at once.
const MAX_LINGERING_REFUSALS: usize = 32;
/// Most bytes discarded from a refused connection: a whole request frame
/// (a client that wrote one before reading gets the frame, not a reset).
const REFUSE_LINGER_MAX_BYTES: usize = MAX_FRAME_SIZE_BYTES;
/// Most distinct type names the native front remembers for its latency
/// labels (a client can send any name; unknown ones are labelled
/// `_unknown` when answered).
const MAX_NATIVE_TYPE_NAMES: usize = 256;

/// A native request without an answer yet.
struct InFlight {
    started: Instant,
    /// Index in [`NativeState::types`], or `usize::MAX` when not
    /// remembered.
    type_index: usize,
}

/// The native front's state on one data executor (part of [`Fronts`]).
#[derive(Default)]
pub(in crate::gateway) struct NativeState {
    /// Open native connections and their output queues.
    conns: crate::FastMap<ConnId, Rc<Outbox>>,
    /// Requests, latencies and connections.
    pub(in crate::gateway) counters: FrontCounters,
    /// Requests without an answer, by (connection, request id).
    in_flight: crate::FastMap<(ConnId, u64), InFlight>,
    /// The type names seen, for the latency labels (at most
    /// [`MAX_NATIVE_TYPE_NAMES`]).
    types: Vec<String>,
    /// Refused connections discarding their input now (count, at most
    /// [`MAX_LINGERING_REFUSALS`]).
    refusing: usize,
}

impl NativeState {
    pub(super) fn opened(&mut self, conn: ConnId, outbox: Rc<Outbox>) {
        self.conns.insert(conn, outbox);
        self.counters.accepted += 1;
        self.counters.open += 1;
    }

    pub(super) fn closed(&mut self, conn: ConnId) {
        self.conns.remove(&conn);
        self.in_flight.retain(|(c, _), _| *c != conn);
        self.counters.open = self.counters.open.saturating_sub(1);
    }

    /// A request was read at `read_at`: its answer is counted by
    /// [`deliver`], with its latency from then.
    pub(super) fn begun(
        &mut self,
        conn: ConnId,
        request_id: u64,
        type_name: &[u8],
        read_at: Instant,
    ) {
        let type_index = match self.types.iter().position(|t| t.as_bytes() == type_name) {
            Some(i) => i,
            None if self.types.len() < MAX_NATIVE_TYPE_NAMES => {
                match std::str::from_utf8(type_name) {
                    Ok(t) => {
                        self.types.push(t.to_string());
                        self.types.len() - 1
                    }
                    Err(_) => usize::MAX,
                }
            }
            None => usize::MAX,
        };
        self.in_flight.insert(
            (conn, request_id),
            InFlight {
                started: read_at,
                type_index,
            },
        );
    }
}

/// When the frame a connection is receiving began to arrive, after a read
/// that left `partial` bytes of a frame not yet whole and `completed` one
/// or more frames (`since`: the answer before that read). A frame that
/// began in an earlier read and is still not whole keeps its start; one
/// that began in this read starts now (a read that completed a frame and
/// began the next); none without a partial frame.
fn frame_started(partial: bool, completed: bool, since: Option<Instant>) -> Option<Instant> {
    match (partial, since) {
        (false, _) => None,
        (true, Some(since)) if !completed => Some(since),
        (true, _) => Some(Instant::now()),
    }
}

/// Writes the answer of a native request to its connection, counting it by
/// type and mapped status code, with its latency. `false` when `conn` is no
/// open native connection (the answer is dropped).
pub(super) fn deliver(
    fronts: &Fronts,
    conn: ConnId,
    request_id: u64,
    status: Status,
    payload: Vec<u8>,
) -> super::Delivered {
    let outbox = {
        let mut guard = fronts.state();
        let h = &mut *guard;
        let n = &mut h.native;
        let Some(outbox) = n.conns.get(&conn).cloned() else {
            return super::Delivered::NoConnection;
        };
        if let Some(f) = n.in_flight.remove(&(conn, request_id)) {
            let micros = u64::try_from(f.started.elapsed().as_micros()).unwrap_or(u64::MAX);
            let code = super::http::status_code_of(status);
            // Unknown type names are not labels: a client could create any
            // number.
            let label = match n.types.get(f.type_index) {
                Some(t) if status != Status::UnknownEntityType => t.as_str(),
                _ => UNKNOWN_TYPE_LABEL,
            };
            n.counters.record(label, code, Some(micros));
            h.dirty = true;
        }
        outbox
    };
    super::Delivered::Written(write_frame(&outbox, request_id, status, payload))
}

/// Encodes one response frame into `outbox`, flushes it, and hands the
/// payload's buffer back (its bytes were copied into the frame).
fn write_frame(outbox: &Outbox, request_id: u64, status: Status, payload: Vec<u8>) -> Vec<u8> {
    let f = ServerFrame {
        request_id,
        status: status as u8,
        payload,
    };
    if let Err(e) = encode_frame(&f, &mut outbox.buf.borrow_mut()) {
        tracing::warn!(error = %e, "cannot encode response");
    }
    outbox.flush();
    f.payload
}

/// Serves one native client connection until it closes or breaks the
/// protocol.
pub(crate) async fn serve_client<P: DataPort>(port: P, fronts: Fronts, stream: TcpStream) {
    let peer = stream.peer_addr().ok();
    let limit = port.max_native_connections();
    // `Some(linger)` when the connection is refused.
    let refused = {
        let mut h = fronts.state();
        h.dirty = true;
        if h.native.conns.len() >= limit {
            h.native.counters.accepted += 1;
            h.native.counters.refused += 1;
            let linger = h.native.refusing < MAX_LINGERING_REFUSALS;
            h.native.refusing += usize::from(linger);
            Some(linger)
        } else {
            None
        }
    };
    if let Some(linger) = refused {
        refuse(stream, limit, linger).await;
        if linger {
            fronts.state().native.refusing -= 1;
        }
        return;
    }
    let outbox = Rc::new(Outbox::default());
    let conn = port.open_conn(outbox.clone());
    {
        let mut h = fronts.state();
        h.native.opened(conn, outbox.clone());
        h.dirty = true;
    }
    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
    let (mut r, mut w) = stream.into_split();
    let wb = outbox.clone();
    let send_timeout = port.send_timeout();
    monoio::spawn(async move {
        let t = transport::SendTimeout {
            after: send_timeout,
            fd,
        };
        if let Err(e) = transport::client_writer(&mut w, wb, t).await {
            if e.kind() == std::io::ErrorKind::TimedOut {
                limited!(info, front = "native", ?peer, error = %e, "client takes no responses (requests.send_timeout_ms); closing the connection");
            }
        }
    });
    let max_frame = port.max_request_frame_bytes();
    let mut reader = FrameReader::new(max_frame.min(MAX_FRAME_SIZE_BYTES));
    let mut linger = false;
    let frame_timeout = port.frame_timeout();
    // When the frame being received (not yet whole) began to arrive.
    let mut partial_since: Option<Instant> = None;
    loop {
        // Back-pressure: a client that does not read its responses is not read.
        if outbox.buf.borrow().len() > OUTBOX_HIGH_WATER_BYTES {
            let paused = Instant::now();
            while outbox.buf.borrow().len() > OUTBOX_HIGH_WATER_BYTES {
                // Closed, or the writer gave up (`requests.send_timeout_ms`,
                // a write error): nothing more will be taken from the queue.
                if outbox.closed.get() || outbox.finished.get() {
                    break;
                }
                monoio::time::sleep(Duration::from_millis(1)).await;
            }
            if outbox.finished.get() {
                break;
            }
            // The frame's clock stops while this side does not read: the
            // client is not late for bytes nobody asked for.
            if let Some(since) = &mut partial_since {
                *since += paused.elapsed();
            }
        }
        let filled = match partial_since {
            None => reader.fill(&mut r).await,
            Some(since) => {
                // Before the read takes the buffer.
                let pending = reader.pending_bytes();
                let left = (since + frame_timeout).saturating_duration_since(Instant::now());
                match monoio::time::timeout(left, reader.fill(&mut r)).await {
                    Ok(res) => res,
                    Err(_) => {
                        limited!(info,
                            ?peer,
                            pending_bytes = pending,
                            timeout_ms = frame_timeout.as_millis() as u64,
                            "request frame not received whole in time (requests.frame_timeout_ms); closing the connection"
                        );
                        break;
                    }
                }
            }
        };
        match filled {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                tracing::debug!(?peer, error = %e, "client read failed");
                break;
            }
        }
        let mut completed = false;
        let mut bad = None;
        // One clock read per read from the socket (and per
        // READ_CLOCK_EVERY requests of a long one), not per request: a
        // request's latency counts from the read that brought it, so the
        // requests before it in the same read are counted in it too, and
        // the data plane takes that time as the current one.
        let mut clock = super::ReadClock::new();
        loop {
            match reader.next_frame_bytes() {
                Ok(Some(body)) => {
                    completed = true;
                    let read_at = clock.next();
                    if let Err(e) = on_frame(&port, &fronts, &outbox, conn, &body, read_at) {
                        bad = Some(e);
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    bad = Some(e);
                    break;
                }
            }
        }
        if let Some(e) = bad {
            if let FrameError::TooLarge { .. } = e {
                // Also what an HTTP request sent to this port looks like.
                limited!(info, ?peer, error = %e, "request frame too large; answered TooLarge, closing the connection");
                let f = ServerFrame {
                    request_id: 0,
                    status: Status::TooLarge as u8,
                    payload: format!(
                        "{e} (requests.max_message_size_bytes plus {} bytes of envelope)",
                        crate::config::ENVELOPE_OVERHEAD_BYTES
                    )
                    .into_bytes(),
                };
                let _ = encode_frame(&f, &mut outbox.buf.borrow_mut());
                outbox.close();
                linger = true;
            } else {
                // Garbage from any client: one line per window.
                limited!(warn, ?peer, error = %e, "protocol error from client; closing the connection");
            }
            break;
        }
        if outbox.closed.get() || outbox.finished.get() {
            break;
        }
        partial_since = frame_started(reader.pending_bytes() > 0, completed, partial_since);
    }
    if linger {
        // The writer sends the TooLarge frame; the input (the rest of the
        // oversized frame) is discarded meanwhile, bounded in time and
        // bytes, so that closing does not reset the connection first.
        let until = Instant::now() + LINGER;
        let mut drained = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        while drained < LINGER_MAX_BYTES && Instant::now() < until {
            let left = until.saturating_duration_since(Instant::now());
            match monoio::time::timeout(left, monoio::io::AsyncReadRent::read(&mut r, buf)).await {
                Ok((Ok(n), b)) if n > 0 => {
                    drained += n;
                    buf = b;
                }
                _ => break,
            }
        }
    }
    port.close_conn(conn);
    let mut h = fronts.state();
    h.native.closed(conn);
    h.dirty = true;
}

/// Answers a connection over the core's limit of `limit` native
/// connections: one frame with request id 0 and status `Unavailable`, then
/// the write side is shut down and, with `linger`, the input discarded for
/// at most [`REFUSE_LINGER`] (so that the client reads the frame, not a
/// reset), then the connection is closed.
async fn refuse(mut stream: TcpStream, limit: usize, linger: bool) {
    use monoio::io::{AsyncReadRent, AsyncWriteRent, AsyncWriteRentExt};
    let f = ServerFrame {
        request_id: 0,
        status: Status::Unavailable as u8,
        payload: format!(
            "too many native connections on this core ({limit}, requests.max_native_connections_per_core); retry later or on another node"
        )
        .into_bytes(),
    };
    let mut out = Vec::new();
    if encode_frame(&f, &mut out).is_err() {
        return;
    }
    let (r, _) = stream.write_all(out).await;
    if r.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    if !linger {
        return;
    }
    let until = Instant::now() + REFUSE_LINGER;
    let mut drained = 0usize;
    let mut buf = vec![0u8; 16 * 1024];
    while drained < REFUSE_LINGER_MAX_BYTES {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match monoio::time::timeout(left, stream.read(buf)).await {
            Ok((Ok(n), b)) if n > 0 => {
                drained += n;
                buf = b;
            }
            _ => break,
        }
    }
}

/// Handles one frame from a client. `Err` is a protocol error: the
/// connection is closed.
fn on_frame<P: DataPort>(
    port: &P,
    fronts: &Fronts,
    outbox: &Rc<Outbox>,
    conn: ConnId,
    body: &bytes::Bytes,
    read_at: Instant,
) -> Result<(), FrameError> {
    match access::<ClientFrame>(body)? {
        ArchivedClientFrame::Request {
            request_id,
            type_name,
            entity_id,
            payload,
        } => {
            let request_id = request_id.to_native();
            // Before the request is routed: its answer may come at once.
            fronts
                .state()
                .native
                .begun(conn, request_id, type_name.as_slice(), read_at);
            port.client_request(
                conn,
                request_id,
                type_name.as_slice(),
                entity_id.as_slice(),
                // A view of the received bytes: not copied.
                body.slice_ref(payload.as_slice()),
                read_at,
            );
        }
        ArchivedClientFrame::NodeStatus { request_id } => {
            let request_id = request_id.to_native();
            let (port, outbox) = (port.clone(), outbox.clone());
            monoio::spawn(async move {
                let (code, payload) = match port.node_status().await {
                    Some(status) => match serde_json::to_vec(&status) {
                        Ok(p) => (Status::Ok, p),
                        Err(e) => (Status::EntityFailed, e.to_string().into_bytes()),
                    },
                    None => (
                        Status::TimedOut,
                        b"control executor did not answer".to_vec(),
                    ),
                };
                // Not when the connection's writer is gone.
                if !outbox.finished.get() {
                    let _ = write_frame(&outbox, request_id, code, payload);
                }
            });
        }
        ArchivedClientFrame::CoordinatorAdmin {
            request_id,
            rebalance,
            type_name,
        } => {
            let request_id = request_id.to_native();
            let cmd = if *rebalance {
                let t = String::from_utf8_lossy(type_name.as_slice()).into_owned();
                CoordinatorCommand::Rebalance {
                    type_name: (!t.is_empty()).then_some(t),
                }
            } else {
                CoordinatorCommand::Allocation
            };
            let (port, outbox) = (port.clone(), outbox.clone());
            monoio::spawn(async move {
                let (code, payload) = match port.coordinator_admin(cmd).await {
                    Ok(json) => (Status::Ok, json),
                    Err((st, why)) => (st, why.into_bytes()),
                };
                // Not when the connection's writer is gone.
                if !outbox.finished.get() {
                    let _ = write_frame(&outbox, request_id, code, payload);
                }
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_keeps_the_start_of_its_first_byte_until_it_is_whole() {
        let t0 = Instant::now() - Duration::from_secs(5);
        // Nothing pending: no frame in transit, whatever came before.
        assert_eq!(frame_started(false, true, Some(t0)), None);
        assert_eq!(frame_started(false, false, None), None);
        // The same frame still incomplete after another read: its start.
        assert_eq!(frame_started(true, false, Some(t0)), Some(t0));
        // Frames completed and a new one begun in this read: it starts now.
        let s = frame_started(true, true, Some(t0)).expect("a frame");
        assert!(s > t0 + Duration::from_secs(4));
        // A first partial frame starts now.
        let s = frame_started(true, false, None).expect("a frame");
        assert!(s > t0 + Duration::from_secs(4));
    }
}
