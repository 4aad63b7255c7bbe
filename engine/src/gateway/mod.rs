//! The client-facing fronts of a data executor: the native binary protocol
//! ([`native`]) and HTTP/1.1 ([`http`]), both served by every data executor
//! on their shared addresses (SO_REUSEPORT: the kernel spreads connections
//! over the executors).
//!
//! The fronts reach the data plane through the port the node gives them
//! (`gateway::port::DataPort`: connection ids, entity requests, admin
//! gathers); the data plane answers through `Fronts::reply`, the reply
//! sink, which routes each answer to the connection's front. `Fronts` is
//! also the fronts' per-executor state (their connections and counters),
//! owned by the executor and passed as a handle: no thread-local.
//! Module dependencies run one way: `node` → `gateway` → `port`,
//! [`crate::status`], [`crate::transport`].

pub mod http;
pub mod native;
pub(crate) mod port;

pub use native::LINGER;

use std::cell::{RefCell, RefMut};
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

use crate::envelope::Status;
use crate::FastMap;

/// The `type` label of requests for entity types the cluster does not host.
const UNKNOWN_TYPE_LABEL: &str = "_unknown";

/// One front's counters on one executor, published to the node's
/// [`MetricsBoard`] for `/metrics`.
#[derive(Clone, Default)]
struct FrontCounters {
    /// Requests by entity type, then HTTP status code (count).
    requests: FastMap<String, FastMap<u16, u64>>,
    /// Request latency by entity type, in µs.
    latency: FastMap<String, Histogram<u64>>,
    /// Open connections (count).
    open: u64,
    /// Accepted connections since start (count).
    accepted: u64,
    /// Of those, connections refused at once for the per-core connection
    /// limit (count).
    refused: u64,
}

impl FrontCounters {
    fn record(&mut self, type_name: &str, code: u16, micros: Option<u64>) {
        // Look up before inserting: no allocation on the common path.
        match self.requests.get_mut(type_name) {
            Some(by_code) => *by_code.entry(code).or_insert(0) += 1,
            None => {
                self.requests
                    .insert(type_name.to_string(), [(code, 1)].into_iter().collect());
            }
        }
        if let Some(us) = micros {
            match self.latency.get_mut(type_name) {
                Some(h) => h.saturating_record(us.max(1)),
                None => {
                    let mut h = http::metrics::new_latency_histogram();
                    h.saturating_record(us.max(1));
                    self.latency.insert(type_name.to_string(), h);
                }
            }
        }
    }
}

/// What one executor publishes for `/metrics`: the counters of both fronts.
#[derive(Clone, Default)]
struct Published {
    http: FrontCounters,
    native: FrontCounters,
}

/// The fronts' published counters of every data executor of one node, by
/// executor index. Created by the node and shared by its executors; each
/// writes its own slot at most every sweep period (250 ms), `/metrics` reads
/// them all: never touched on the request path.
#[derive(Default)]
pub(crate) struct MetricsBoard {
    cores: Mutex<Vec<(u16, Arc<Mutex<Published>>)>>,
    /// The `fdatasync` latency of each data executor's local journal, by
    /// executor index (registered when the journal opens).
    journal_flush: Mutex<Vec<(u16, shardline_journal::FlushLatency)>>,
}

impl MetricsBoard {
    /// The `fdatasync` latency histograms (microseconds) of the data
    /// executors' local journals, by executor index (none for a
    /// PostgreSQL journal).
    fn journal_flush_micros(&self) -> Vec<(u16, hdrhistogram::Histogram<u64>)> {
        let v: Vec<(u16, shardline_journal::FlushLatency)> = self
            .journal_flush
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default();
        v.into_iter()
            .map(|(c, h)| (c, h.snapshot_micros()))
            .collect()
    }

    /// A copy of every executor's published counters, by executor index.
    fn snapshot(&self) -> Vec<(u16, Published)> {
        let slots: Vec<(u16, Arc<Mutex<Published>>)> =
            self.cores.lock().map(|v| v.clone()).unwrap_or_default();
        slots
            .into_iter()
            .filter_map(|(c, slot)| slot.lock().ok().map(|s| (c, s.clone())))
            .collect()
    }
}

/// The fronts' state on one data executor.
struct FrontState {
    http: http::serve::HttpState,
    native: native::NativeState,
    /// Counters changed since the last publish.
    dirty: bool,
    /// This executor's slot on the node's [`MetricsBoard`].
    slot: Arc<Mutex<Published>>,
    board: Arc<MetricsBoard>,
}

/// The fronts of one data executor: their shared state, and the reply sink
/// through which the data plane answers their requests. A cheap handle
/// (one `Rc`); single-threaded.
#[derive(Clone)]
pub(crate) struct Fronts(Rc<RefCell<FrontState>>);

impl Fronts {
    /// The fronts' state of data executor `core`, publishing to `board`.
    /// `answer_timeout` is how long an HTTP entity request waits for any
    /// answer before it is answered `504` (the ask timeout plus the answer
    /// grace).
    pub(crate) fn new(core: u16, board: Arc<MetricsBoard>, answer_timeout: Duration) -> Fronts {
        let slot = Arc::new(Mutex::new(Published::default()));
        if let Ok(mut v) = board.cores.lock() {
            v.retain(|(c, _)| *c != core);
            v.push((core, slot.clone()));
            v.sort_by_key(|(c, _)| *c);
        }
        Fronts(Rc::new(RefCell::new(FrontState {
            http: http::serve::HttpState::new(answer_timeout),
            native: native::NativeState::default(),
            dirty: false,
            slot,
            board,
        })))
    }

    fn state(&self) -> RefMut<'_, FrontState> {
        self.0.borrow_mut()
    }

    /// Registers the `fdatasync` latency of data executor `core`'s local
    /// journal on the node's board (`/metrics` shows it).
    pub(crate) fn set_journal_flush_latency(
        &self,
        core: u16,
        latency: shardline_journal::FlushLatency,
    ) {
        let board = self.state().board.clone();
        let mut v = match board.journal_flush.lock() {
            Ok(v) => v,
            Err(p) => p.into_inner(),
        };
        v.retain(|(c, _)| *c != core);
        v.push((core, latency));
        v.sort_by_key(|(c, _)| *c);
    }

    /// The reply sink: hands an answer of the data plane to the front
    /// connection `conn` of this executor (an HTTP response in request
    /// order, or a native response frame), and counts it. Says what became
    /// of it: written (the payload's buffer handed back for reuse), kept by
    /// the HTTP front, or dropped because `conn` is no open front
    /// connection (it closed, or it is a data lane's).
    pub(crate) fn reply(
        &self,
        conn: port::ConnId,
        request_id: u64,
        status: Status,
        payload: Vec<u8>,
    ) -> Delivered {
        if let Some(payload) = http::serve::deliver(self, conn, request_id, status, payload) {
            return native::deliver(self, conn, request_id, status, payload);
        }
        Delivered::Kept
    }

    /// Copies this executor's counters to its board slot when they changed.
    fn publish(&self) {
        let mut h = self.state();
        if !h.dirty {
            return;
        }
        h.dirty = false;
        h.http.metrics.open = h.http.conns.len() as u64;
        if let Ok(mut s) = h.slot.lock() {
            s.http.clone_from(&h.http.metrics);
            s.native.clone_from(&h.native.counters);
        };
    }
}

/// Requests of one socket read that share one clock read, in both fronts:
/// the read's time is theirs, and the data plane's current time while it
/// handles them. 32 requests take a few tens of µs, against timeouts of
/// ms.
const READ_CLOCK_EVERY: u32 = 32;

/// A front's clock for the requests of one socket read: read once at the
/// read, and again every [`READ_CLOCK_EVERY`] requests of a long one.
pub(crate) struct ReadClock {
    at: Instant,
    since: u32,
}

impl ReadClock {
    /// Reads the clock (at a socket read).
    pub(crate) fn new() -> ReadClock {
        ReadClock {
            at: Instant::now(),
            since: 0,
        }
    }

    /// The read time of the next request.
    pub(crate) fn next(&mut self) -> Instant {
        self.since += 1;
        if self.since > READ_CLOCK_EVERY {
            self.at = Instant::now();
            self.since = 1;
        }
        self.at
    }
}

/// What became of a reply handed to [`Fronts::reply`].
#[derive(Debug)]
pub(crate) enum Delivered {
    /// Written to its native connection; the payload's buffer is handed
    /// back (empty it before reuse).
    Written(Vec<u8>),
    /// Taken by the HTTP front (a response waiting for its turn), or its
    /// request was answered already (timed out).
    Kept,
    /// No open front connection has this id: dropped.
    NoConnection,
}

#[cfg(test)]
impl Delivered {
    /// Whether a front took the reply.
    pub(crate) fn delivered(&self) -> bool {
        !matches!(self, Delivered::NoConnection)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::{access, next_frame, ServerFrame, FRAME_HEADER_BYTES};
    use crate::transport::Outbox;

    /// The frames in `buf`: (request id, status byte, payload).
    fn frames(buf: &[u8]) -> Vec<(u64, u8, Vec<u8>)> {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(len) = next_frame(&buf[at..], 1 << 20).expect("a frame") {
            let body = &buf[at + FRAME_HEADER_BYTES..at + FRAME_HEADER_BYTES + len];
            let f = access::<ServerFrame>(body).expect("a server frame");
            out.push((
                f.request_id.to_native(),
                f.status,
                f.payload.as_slice().to_vec(),
            ));
            at += FRAME_HEADER_BYTES + len;
        }
        out
    }

    #[test]
    fn the_reply_sink_writes_native_answers_to_their_connection_and_counts_them() {
        let board = Arc::new(MetricsBoard::default());
        let fronts = Fronts::new(3, board.clone(), Duration::from_secs(13));
        let (a, b) = (Rc::new(Outbox::default()), Rc::new(Outbox::default()));
        {
            let mut h = fronts.state();
            h.native.opened(7, a.clone());
            h.native.opened(8, b.clone());
            h.native.begun(7, 1, b"echo", std::time::Instant::now());
            h.native
                .begun(7, 2, b"nosuchtype", std::time::Instant::now());
        }
        assert!(fronts.reply(7, 1, Status::Ok, b"hi".to_vec()).delivered());
        assert!(fronts
            .reply(7, 2, Status::UnknownEntityType, b"no".to_vec())
            .delivered());
        // Not a front connection of this executor (e.g. a data lane's), or
        // closed: dropped, and said so.
        assert!(!fronts.reply(9, 1, Status::Ok, b"lost".to_vec()).delivered());
        assert_eq!(
            frames(&a.buf.borrow()),
            vec![
                (1, Status::Ok as u8, b"hi".to_vec()),
                (2, Status::UnknownEntityType as u8, b"no".to_vec())
            ]
        );
        assert!(
            b.buf.borrow().is_empty(),
            "nothing for the other connection"
        );
        fronts.state().native.closed(8);
        assert!(!fronts.reply(8, 5, Status::Ok, Vec::new()).delivered());

        // Published to the node's board, by executor; unknown types are
        // one label.
        assert!(board.snapshot()[0].1.native.requests.is_empty());
        fronts.publish();
        let snap = board.snapshot();
        assert_eq!(snap.len(), 1);
        let (core, p) = &snap[0];
        assert_eq!(*core, 3);
        assert_eq!(p.native.requests["echo"][&200], 1);
        assert_eq!(
            p.native.requests[UNKNOWN_TYPE_LABEL].values().sum::<u64>(),
            1
        );
        assert!(!p.native.requests.contains_key("nosuchtype"));
        assert_eq!((p.native.accepted, p.native.open), (2, 1));
        assert_eq!(p.native.latency["echo"].len(), 1);
    }

    #[test]
    fn each_node_has_its_own_board() {
        let (one, two) = (
            Arc::new(MetricsBoard::default()),
            Arc::new(MetricsBoard::default()),
        );
        let f1 = Fronts::new(0, one.clone(), Duration::from_secs(1));
        let _f2 = Fronts::new(0, two.clone(), Duration::from_secs(1));
        let o = Rc::new(Outbox::default());
        {
            let mut h = f1.state();
            h.native.opened(1, o);
            h.dirty = true;
        }
        f1.publish();
        assert_eq!(one.snapshot()[0].1.native.accepted, 1);
        assert_eq!(two.snapshot()[0].1.native.accepted, 0);
    }
}
