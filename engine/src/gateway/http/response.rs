//! Response encoding, the mapping from native [`Status`] values to HTTP
//! status codes, and the per-connection reorder queue that keeps pipelined
//! responses in request order.
//!
//! | native status | HTTP |
//! |---|---|
//! | `Ok` | `200 OK`, the entity's reply as the body |
//! | `UnknownEntityType` | `404 Not Found` |
//! | `InvalidEntityId` | `400 Bad Request` |
//! | `BufferFull` | `503 Service Unavailable`, `Retry-After: 1` |
//! | `TimedOut` | `504 Gateway Timeout` (the outcome is unknown) |
//! | `EntityFailed` | `500 Internal Server Error` |
//! | `ShuttingDown` | `503 Service Unavailable`, `Retry-After: 1` |
//! | `JournalUnavailable` | `503 Service Unavailable`, `Retry-After: 1` |
//! | `Unavailable` | `503 Service Unavailable`, `Retry-After: 1` (not delivered: safe to retry) |
//! | `TooLarge` | `413 Content Too Large` (a retry can never succeed) |
//!
//! `504` means the message may have reached its entity; every `503` and
//! the `413` mean it was not delivered.
//!
//! Every error response has a short `text/plain` body saying what was
//! wrong. Responses carry `Content-Length` (never chunked) and
//! `Connection: close` when the connection ends after them.

use std::collections::BTreeMap;
use std::io::Write as _;

use crate::envelope::Status;

/// Seconds sent in `Retry-After` with a `503`.
pub const RETRY_AFTER_SECS: u32 = 1;

/// `text/plain; charset=utf-8`.
pub const TEXT_PLAIN: &str = "text/plain; charset=utf-8";
/// `application/json`.
pub const APPLICATION_JSON: &str = "application/json";
/// The Prometheus text exposition format, version 0.0.4.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
/// Entity replies are opaque bytes.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// The reason phrase of a status code (RFC 9110 section 15); `""` for codes
/// the fronts never send.
pub fn reason_phrase(code: u16) -> &'static str {
    match code {
        100 => "Continue",
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        417 => "Expectation Failed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

/// The HTTP status code for a native protocol status (table in the module
/// docs).
pub fn status_code_of(status: Status) -> u16 {
    match status {
        Status::Ok => 200,
        Status::UnknownEntityType => 404,
        Status::InvalidEntityId => 400,
        Status::BufferFull => 503,
        Status::TimedOut => 504,
        Status::EntityFailed => 500,
        Status::ShuttingDown => 503,
        Status::JournalUnavailable => 503,
        Status::Unavailable => 503,
        Status::TooLarge => 413,
    }
}

/// One response before encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The status code.
    pub code: u16,
    /// The `Content-Type` value.
    pub content_type: &'static str,
    /// The body (omitted on the wire for `HEAD`, its length still sent).
    pub body: Vec<u8>,
    /// Adds `Retry-After: 1` (with `503`).
    pub retry_after: bool,
    /// The `Allow` header value (with `405`).
    pub allow: Option<&'static str>,
}

impl Response {
    /// A response with a body of the given type.
    pub fn new(code: u16, content_type: &'static str, body: Vec<u8>) -> Response {
        Response {
            code,
            content_type,
            body,
            retry_after: code == 503,
            allow: None,
        }
    }

    /// A plain-text response (errors: the body says what was wrong; a
    /// newline is appended).
    pub fn text(code: u16, msg: impl Into<String>) -> Response {
        let mut body = msg.into().into_bytes();
        body.push(b'\n');
        Response::new(code, TEXT_PLAIN, body)
    }

    /// A JSON response.
    pub fn json(code: u16, body: Vec<u8>) -> Response {
        Response::new(code, APPLICATION_JSON, body)
    }

    /// The response for an entity's answer: `200` with the reply as the
    /// body, or the mapped error code with the reason text.
    pub fn from_status(status: Status, payload: Vec<u8>) -> Response {
        let code = status_code_of(status);
        if code == 200 {
            return Response::new(200, OCTET_STREAM, payload);
        }
        let what = match status {
            Status::UnknownEntityType => "unknown entity type",
            Status::InvalidEntityId => "invalid entity id",
            Status::BufferFull => "buffer full, retry later",
            Status::TimedOut => "no answer in time; the outcome is unknown",
            Status::EntityFailed => "the entity failed",
            Status::ShuttingDown => "the node is shutting down, retry on another node",
            Status::JournalUnavailable => "journal unavailable, retry later",
            Status::Unavailable => "not delivered, safe to retry",
            Status::TooLarge => "message too large",
            Status::Ok => "ok",
        };
        let detail = String::from_utf8_lossy(&payload);
        if detail.is_empty() {
            Response::text(code, what)
        } else if detail.starts_with(what) {
            Response::text(code, detail)
        } else {
            Response::text(code, format!("{what}: {detail}"))
        }
    }

    /// Appends the encoded response to `out`. With `head_only` the body is
    /// left out (its length is still announced); with `!keep_alive`
    /// `Connection: close` is added.
    pub fn encode(&self, head_only: bool, keep_alive: bool, out: &mut Vec<u8>) {
        // Hand-written (no formatting machinery): this runs per response.
        out.extend_from_slice(b"HTTP/1.1 ");
        push_decimal(out, u64::from(self.code));
        out.push(b' ');
        out.extend_from_slice(reason_phrase(self.code).as_bytes());
        out.extend_from_slice(b"\r\ncontent-type: ");
        out.extend_from_slice(self.content_type.as_bytes());
        out.extend_from_slice(b"\r\ncontent-length: ");
        push_decimal(out, self.body.len() as u64);
        out.extend_from_slice(b"\r\n");
        if self.retry_after {
            let _ = write!(out, "retry-after: {RETRY_AFTER_SECS}\r\n");
        }
        if let Some(a) = self.allow {
            let _ = write!(out, "allow: {a}\r\n");
        }
        if !keep_alive {
            out.extend_from_slice(b"connection: close\r\n");
        }
        out.extend_from_slice(b"\r\n");
        if !head_only {
            out.extend_from_slice(&self.body);
        }
    }
}

/// Appends `n` in ASCII decimal.
fn push_decimal(out: &mut Vec<u8>, mut n: u64) {
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[i..]);
}

/// The interim response sent when a client waits on `Expect: 100-continue`.
pub const CONTINUE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// Keeps pipelined responses in request order (RFC 9112 section 9.3.2):
/// each request takes a sequence number with [`begin`](Self::begin); its
/// encoded response is handed to [`complete`](Self::complete) whenever it is
/// ready; [`drain_into`](Self::drain_into) moves the ready prefix to the
/// output buffer.
///
/// Bounded by the caller: it stops reading requests while
/// [`in_flight`](Self::in_flight) is at its limit.
#[derive(Debug, Default)]
pub struct ResponseQueue {
    next_seq: u64,
    next_out: u64,
    ready: BTreeMap<u64, (Vec<u8>, bool)>,
}

impl ResponseQueue {
    /// Reserves the next sequence number, for a request just read.
    pub fn begin(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// Whether `seq` is the next response to write with nothing waiting
    /// before it: the caller may write it straight to the output and call
    /// [`written_in_order`](Self::written_in_order) (no copy, no map).
    pub fn is_next(&self, seq: u64) -> bool {
        seq == self.next_out && seq < self.next_seq && self.ready.is_empty()
    }

    /// Records that the response [`is_next`](Self::is_next) allowed was
    /// written; with `close`, later responses are dropped.
    pub fn written_in_order(&mut self, close: bool) {
        self.next_out += 1;
        if close {
            self.ready.clear();
        }
    }

    /// Stores the encoded response of request `seq`; `close` marks that the
    /// connection ends after it. Unknown or repeated sequence numbers are
    /// ignored (returns false).
    pub fn complete(&mut self, seq: u64, bytes: Vec<u8>, close: bool) -> bool {
        if seq < self.next_out || seq >= self.next_seq || self.ready.contains_key(&seq) {
            return false;
        }
        self.ready.insert(seq, (bytes, close));
        true
    }

    /// Appends the responses that are next in order to `out`; returns true
    /// when one of them closes the connection (nothing after it is written).
    pub fn drain_into(&mut self, out: &mut Vec<u8>) -> bool {
        while let Some((bytes, close)) = self.ready.remove(&self.next_out) {
            self.next_out += 1;
            out.extend_from_slice(&bytes);
            if close {
                self.ready.clear();
                return true;
            }
        }
        false
    }

    /// Requests begun and not yet drained (count).
    pub fn in_flight(&self) -> u64 {
        self.next_seq - self.next_out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_mapping_matches_the_issue() {
        assert_eq!(status_code_of(Status::Ok), 200);
        assert_eq!(status_code_of(Status::UnknownEntityType), 404);
        assert_eq!(status_code_of(Status::InvalidEntityId), 400);
        assert_eq!(status_code_of(Status::BufferFull), 503);
        assert_eq!(status_code_of(Status::TimedOut), 504);
        assert_eq!(status_code_of(Status::EntityFailed), 500);
        assert_eq!(status_code_of(Status::ShuttingDown), 503);
        assert_eq!(status_code_of(Status::JournalUnavailable), 503);
        let r = Response::from_status(Status::JournalUnavailable, b"database down".to_vec());
        assert!(r.retry_after && r.code == 503, "{r:?}");
        assert_eq!(status_code_of(Status::Unavailable), 503);
        assert_eq!(status_code_of(Status::TooLarge), 413);
        let r = Response::from_status(Status::Unavailable, b"home node unreachable".to_vec());
        assert!(r.retry_after, "503 carries Retry-After");
        let r = Response::from_status(Status::TooLarge, Vec::new());
        assert!(!r.retry_after, "a retry of a 413 cannot succeed");
    }

    #[test]
    fn encodes_ok_and_errors() {
        let mut out = Vec::new();
        Response::from_status(Status::Ok, b"42".to_vec()).encode(false, true, &mut out);
        assert_eq!(
            out,
            b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: 2\r\n\r\n42"
        );
        let mut out = Vec::new();
        Response::from_status(Status::BufferFull, Vec::new()).encode(false, false, &mut out);
        let s = String::from_utf8(out).unwrap();
        assert!(s.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{s}");
        assert!(s.contains("retry-after: 1\r\n"));
        assert!(s.contains("connection: close\r\n"));
        assert!(s.ends_with("\r\n\r\nbuffer full, retry later\n"));
        let mut out = Vec::new();
        Response::text(404, "nope").encode(true, true, &mut out);
        let s = String::from_utf8(out).unwrap();
        assert!(s.ends_with("content-length: 5\r\n\r\n"), "{s}");
        let r = Response::from_status(Status::EntityFailed, b"panic: boom".to_vec());
        assert_eq!(r.code, 500);
        assert_eq!(r.body, b"the entity failed: panic: boom\n");
        let mut d = Vec::new();
        for n in [0u64, 7, 10, 1_048_576, u64::MAX] {
            d.clear();
            push_decimal(&mut d, n);
            assert_eq!(d, n.to_string().as_bytes());
        }
        // Every code the fronts send has a reason phrase.
        for c in [100, 200, 400, 404, 405, 408, 411, 413, 431, 500, 503, 504] {
            assert!(!reason_phrase(c).is_empty());
        }
    }

    #[test]
    fn queue_restores_request_order_and_stops_at_close() {
        let mut q = ResponseQueue::default();
        let a = q.begin();
        let b = q.begin();
        let c = q.begin();
        let d = q.begin();
        let mut out = Vec::new();
        assert!(q.complete(c, b"c".to_vec(), true));
        assert!(q.complete(b, b"b".to_vec(), false));
        assert!(!q.drain_into(&mut out));
        assert!(out.is_empty());
        assert!(!q.complete(b, b"again".to_vec(), false));
        assert!(q.complete(a, b"a".to_vec(), false));
        assert!(q.complete(d, b"d".to_vec(), false));
        assert!(q.drain_into(&mut out));
        assert_eq!(out, b"abc");
        assert!(!q.complete(99, Vec::new(), false));
    }

    #[test]
    fn in_order_fast_path_only_when_nothing_waits() {
        let mut q = ResponseQueue::default();
        let a = q.begin();
        let b = q.begin();
        assert!(q.is_next(a));
        assert!(!q.is_next(b));
        assert!(q.complete(b, b"b".to_vec(), false));
        assert!(!q.is_next(a), "b waits: a must go through the queue");
        assert!(q.complete(a, b"a".to_vec(), false));
        let mut out = Vec::new();
        q.drain_into(&mut out);
        assert_eq!(out, b"ab");
        let c = q.begin();
        assert!(q.is_next(c));
        q.written_in_order(false);
        assert_eq!(q.in_flight(), 0);
        let d = q.begin();
        assert!(!q.is_next(d + 1));
    }
}
