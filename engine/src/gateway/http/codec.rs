//! The incremental HTTP/1.1 request decoder (sans-IO).
//!
//! ```text
//! bytes from the socket ──feed(now)──► RequestDecoder ──next_request()──► Request
//!                                            │
//!                                            └── pending() ──► "headers incomplete since T"
//! ```
//!
//! The decoder owns one receive buffer. Each call to
//! [`RequestDecoder::next_request`] returns the next complete request
//! (request line, headers and body, parsed with `httparse`), `Ok(None)` when
//! more bytes are needed, or an [`HttpError`] that carries the status code to
//! answer with; after an error the decoder is poisoned and the connection
//! must be closed after that answer (what follows the bad bytes cannot be
//! framed).
//!
//! Framing (RFC 9112 section 6):
//! - the body length is `Content-Length`; a request with neither
//!   `Content-Length` nor `Transfer-Encoding` has an empty body;
//! - chunked request bodies are **not supported**: any `Transfer-Encoding`
//!   is answered `411 Length Required` ("send Content-Length");
//!   `Transfer-Encoding` together with `Content-Length` is `400` (the
//!   request-smuggling case of RFC 9112 section 6.3);
//! - several `Content-Length` values must all be equal, else `400`.
//!
//! Limits (all checked before anything is allocated for an untrusted
//! length):
//! - the request line plus headers may take at most
//!   [`CodecLimits::max_header_bytes`] (default 8 KiB) and
//!   [`CodecLimits::max_headers`] lines (default 64), else `431`;
//! - a `Content-Length` above [`CodecLimits::max_body_bytes`] (default
//!   1 MiB) is `413`, answered as soon as the headers are read;
//! - the buffer therefore never holds more than one partial request
//!   (headers + body) plus what the caller fed after it; the connection task
//!   bounds the latter by reading only when it has room.
//!
//! Slow clients: the decoder records when the first byte of the current
//! partial request arrived ([`RequestDecoder::pending`]); the connection
//! task compares it with its header and body deadlines and answers `408`.
//! Only the client's own slowness counts: bytes of a request that came
//! with an earlier one start its clock when the connection task starts
//! waiting for the rest ([`RequestDecoder::start_clock`]), so a complete
//! request held back behind the task's in-flight limit never times out.
//!
//! Keep-alive: HTTP/1.1 keeps the connection open unless `Connection:
//! close`; HTTP/1.0 closes unless `Connection: keep-alive`.

use std::time::Duration;

use thiserror::Error;

/// Default for [`CodecLimits::max_header_bytes`]: 8 KiB.
pub const DEFAULT_MAX_HEADER_BYTES: usize = 8 * 1024;
/// Default for [`CodecLimits::max_headers`]: 64 header lines.
pub const DEFAULT_MAX_HEADERS: usize = 64;
/// Default for [`CodecLimits::max_body_bytes`] (`max_body_size`): 1 MiB.
pub const DEFAULT_MAX_BODY_BYTES: usize = 1024 * 1024;
/// Upper bound of [`CodecLimits::max_headers`] (the size of the header array
/// `httparse` fills, on the stack).
pub const MAX_HEADERS_LIMIT: usize = 128;

/// Limits of one connection's decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodecLimits {
    /// Most bytes of request line plus headers (including the blank line),
    /// in bytes. Default 8 KiB ([`DEFAULT_MAX_HEADER_BYTES`]). Over it: `431`.
    pub max_header_bytes: usize,
    /// Most header lines, count. Default 64; at most [`MAX_HEADERS_LIMIT`]
    /// (larger values are clamped). Over it: `431`.
    pub max_headers: usize,
    /// Largest accepted body (`max_body_size`), in bytes. Default 1 MiB
    /// ([`DEFAULT_MAX_BODY_BYTES`]). Over it: `413`.
    pub max_body_bytes: usize,
}

impl Default for CodecLimits {
    fn default() -> Self {
        CodecLimits {
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
        }
    }
}

/// A request that cannot be served; each maps to one status code, and the
/// connection is closed after the answer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum HttpError {
    /// The bytes are not an HTTP/1.x request (`400`).
    #[error("malformed request: {0}")]
    Malformed(&'static str),
    /// Request line and headers exceed the limit (`431`).
    #[error("request headers exceed {limit} (bytes or lines)")]
    HeadersTooLarge {
        /// The limit that was exceeded (bytes, or lines when the line count
        /// was exceeded).
        limit: usize,
    },
    /// `Content-Length` exceeds `max_body_size` (`413`).
    #[error("request body of {len_bytes} bytes exceeds the limit of {max_bytes} bytes")]
    BodyTooLarge {
        /// The announced length, in bytes.
        len_bytes: u64,
        /// The limit, in bytes.
        max_bytes: usize,
    },
    /// A `Transfer-Encoding` body (chunked) was sent (`411`).
    #[error("Transfer-Encoding is not supported; send the body with Content-Length")]
    LengthRequired,
    /// An `Expect` header other than `100-continue` (`417`, RFC 9110
    /// section 10.1.1).
    #[error("unsupported Expect header (only 100-continue is supported)")]
    ExpectationFailed,
}

impl HttpError {
    /// The status code answered for this error: 400, 411, 413, 417 or 431.
    pub fn status_code(&self) -> u16 {
        match self {
            HttpError::Malformed(_) => 400,
            HttpError::ExpectationFailed => 417,
            HttpError::HeadersTooLarge { .. } => 431,
            HttpError::BodyTooLarge { .. } => 413,
            HttpError::LengthRequired => 411,
        }
    }
}

/// The request methods the fronts distinguish.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Method {
    /// `GET`.
    Get,
    /// `HEAD` (answered as `GET` without the body).
    Head,
    /// `POST`.
    Post,
    /// Any other (valid token) method; answered `405`.
    Other,
}

impl Method {
    fn parse(m: &str) -> Method {
        match m {
            "GET" => Method::Get,
            "HEAD" => Method::Head,
            "POST" => Method::Post,
            _ => Method::Other,
        }
    }
}

/// One complete request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The method.
    pub method: Method,
    /// The request target as sent (origin form: path and optional query),
    /// not yet percent-decoded.
    pub target: String,
    /// Whether the connection stays open after the response.
    pub keep_alive: bool,
    /// The body (`Content-Length` bytes, at most `max_body_bytes`).
    pub body: Vec<u8>,
}

/// What the current partial request is waiting for (see
/// [`RequestDecoder::pending`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pending {
    /// The request line or headers are incomplete since `since` (the time of
    /// the first byte of this request, as passed to `feed`).
    Headers {
        /// When the first byte of the request arrived.
        since: Duration,
    },
    /// The headers are complete; `remaining_bytes` of the body are missing
    /// since `since` (the time of the request's first byte).
    Body {
        /// When the first byte of the request arrived.
        since: Duration,
        /// Body bytes still expected, in bytes.
        remaining_bytes: usize,
    },
}

/// A parsed head waiting for its body.
#[derive(Debug, Clone)]
struct Head {
    method: Method,
    target: String,
    keep_alive: bool,
    /// Length of the head in the buffer (from `start`), in bytes.
    head_len: usize,
    body_len: usize,
}

/// The incremental request decoder of one connection. See the module docs
/// for framing, limits and timeouts.
///
/// Order of calls: [`feed`](Self::feed) what the socket returned, then call
/// [`next_request`](Self::next_request) until it returns `Ok(None)` (more
/// bytes needed) or an error (answer it, then close);
/// [`take_continue`](Self::take_continue) after each `Ok(None)` says whether
/// the client waits for a `100 Continue`.
#[derive(Debug)]
pub struct RequestDecoder {
    limits: CodecLimits,
    buf: Vec<u8>,
    /// Start of the current (unconsumed) request in `buf`.
    start: usize,
    /// How far from `start` the end-of-headers search has looked, in bytes.
    scanned: usize,
    /// When the first byte of the current request arrived.
    since: Option<Duration>,
    head: Option<Head>,
    continue_due: bool,
    poisoned: bool,
}

impl RequestDecoder {
    /// A decoder with these limits (`max_headers` clamped to
    /// [`MAX_HEADERS_LIMIT`]).
    pub fn new(mut limits: CodecLimits) -> Self {
        limits.max_headers = limits.max_headers.clamp(1, MAX_HEADERS_LIMIT);
        RequestDecoder {
            limits,
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            since: None,
            head: None,
            continue_due: false,
            poisoned: false,
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> &CodecLimits {
        &self.limits
    }

    /// Appends bytes received at `now` (time since the runtime's origin).
    /// The caller bounds how much it feeds before draining requests; the
    /// decoder holds at most one partial request plus the unconsumed input.
    pub fn feed(&mut self, bytes: &[u8], now: Duration) {
        if bytes.is_empty() || self.poisoned {
            return;
        }
        if self.start > 0 {
            // Drop consumed requests; moves at most one partial request.
            self.buf.drain(..self.start);
            self.start = 0;
        }
        if self.since.is_none() {
            self.since = Some(now);
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The caller is about to wait for bytes at `now` (time since the
    /// runtime's origin): a partial request left over from earlier reads
    /// whose clock has not started yet (see [`Self::pending`]) starts it
    /// now. Call it before [`Self::pending`] when no complete request is
    /// buffered; a no-op otherwise.
    pub fn start_clock(&mut self, now: Duration) {
        if self.since.is_none() && self.buffered_bytes() > 0 && !self.poisoned {
            self.since = Some(now);
        }
    }

    /// Bytes held and not yet returned as a request, in bytes.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Whether an error was returned (the connection must be closed).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// What the current partial request waits for, or `None` when no
    /// request is in progress: the buffer is empty, or it holds bytes that
    /// arrived with an earlier request and nobody waits for more of them
    /// yet. The header and body clocks measure the client's slowness only:
    /// they start at the first byte of a request fed on its own, or, for
    /// bytes that came with an earlier request, when the caller starts
    /// waiting for the rest ([`Self::start_clock`]) or feeds more.
    pub fn pending(&self) -> Option<Pending> {
        let since = self.since?;
        if self.poisoned {
            return None;
        }
        Some(match &self.head {
            None => Pending::Headers { since },
            Some(h) => Pending::Body {
                since,
                remaining_bytes: (h.head_len + h.body_len).saturating_sub(self.buffered_bytes()),
            },
        })
    }

    /// Whether the client sent `Expect: 100-continue` for the request whose
    /// body is now awaited; true once per request (the caller then writes
    /// `HTTP/1.1 100 Continue`).
    pub fn take_continue(&mut self) -> bool {
        std::mem::take(&mut self.continue_due)
    }

    /// Returns the next complete request, `Ok(None)` when more bytes are
    /// needed.
    ///
    /// # Errors
    /// An [`HttpError`] (400, 411, 413, 431) when the request cannot be
    /// served; the decoder is then poisoned and returns
    /// [`HttpError::Malformed`] on every later call.
    pub fn next_request(&mut self) -> Result<Option<Request>, HttpError> {
        if self.poisoned {
            return Err(HttpError::Malformed("connection already failed"));
        }
        match self.advance() {
            Ok(r) => Ok(r),
            Err(e) => {
                self.poisoned = true;
                self.continue_due = false;
                Err(e)
            }
        }
    }

    fn advance(&mut self) -> Result<Option<Request>, HttpError> {
        if self.head.is_none() {
            match self.parse_head()? {
                Some(h) => {
                    self.head = Some(h);
                }
                None => return Ok(None),
            }
        }
        let Some(h) = &self.head else {
            return Ok(None);
        };
        let total = h.head_len + h.body_len;
        if self.buffered_bytes() < total {
            return Ok(None);
        }
        let Some(h) = self.head.take() else {
            return Ok(None);
        };
        self.continue_due = false;
        let body_start = self.start + h.head_len;
        let body = self.buf[body_start..body_start + h.body_len].to_vec();
        self.start += total;
        self.scanned = 0;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
            self.since = None;
        } else {
            // The next request's bytes are already here: its clock starts
            // only when the caller waits for more of them
            // ([`Self::start_clock`]) or feeds more; a request held back
            // behind the caller's in-flight limit is never timed out.
            self.since = None;
        }
        Ok(Some(Request {
            method: h.method,
            target: h.target,
            keep_alive: h.keep_alive,
            body,
        }))
    }

    /// Finds the end of the head incrementally; parses it once complete.
    fn parse_head(&mut self) -> Result<Option<Head>, HttpError> {
        let data = &self.buf[self.start..];
        // RFC 9112 section 2.2: a server SHOULD ignore at least one empty
        // line received before the request line.
        let mut lead = 0;
        while lead < data.len() && lead < 4 && (data[lead] == b'\r' || data[lead] == b'\n') {
            lead += 1;
        }
        if lead == 4 && data.get(4).is_some_and(|b| *b == b'\r' || *b == b'\n') {
            return Err(HttpError::Malformed("empty lines instead of a request"));
        }
        if lead == data.len() {
            return Ok(None);
        }
        let limit = self.limits.max_header_bytes;
        // Fast path: a request whose head arrived whole with the first read
        // (the common case) is parsed once by `httparse`, without the
        // byte-wise search for the blank line below.
        if self.scanned == 0 {
            let window = &data[lead..data.len().min(limit + lead)];
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS_LIMIT];
            let mut req = httparse::Request::new(&mut headers[..self.limits.max_headers]);
            // Incomplete, or an error the full path reports with the same
            // status (it parses the same bytes again): the slow path below.
            if let Ok(httparse::Status::Complete(n)) = req.parse(window) {
                let buffered = data.len();
                let (head, continue_due) =
                    interpret(&req, lead + n, self.limits.max_body_bytes, buffered)?;
                if continue_due {
                    self.continue_due = true;
                }
                return Ok(Some(head));
            }
        }
        // Search for "\n\r\n" or "\n\n" from where the last search stopped,
        // so a client sending one byte at a time costs linear, not
        // quadratic, work.
        let from = self.scanned.saturating_sub(2).max(lead);
        let window_end = data.len().min(limit + lead);
        let mut end = None;
        let mut i = from;
        while i < window_end {
            if data[i] == b'\n' {
                if data.get(i + 1) == Some(&b'\n') {
                    end = Some(i + 2);
                    break;
                }
                if data.get(i + 1) == Some(&b'\r') && data.get(i + 2) == Some(&b'\n') {
                    end = Some(i + 3);
                    break;
                }
            }
            i += 1;
        }
        let Some(end) = end else {
            self.scanned = window_end;
            if data.len() - lead >= limit {
                return Err(HttpError::HeadersTooLarge { limit });
            }
            // Catch garbage early instead of waiting for a blank line.
            return check_partial(&data[lead..]);
        };
        if end - lead > limit {
            return Err(HttpError::HeadersTooLarge { limit });
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS_LIMIT];
        let headers = &mut headers[..self.limits.max_headers];
        let mut req = httparse::Request::new(headers);
        let head_bytes = &data[lead..end];
        match req.parse(head_bytes) {
            Ok(httparse::Status::Complete(n)) if n == head_bytes.len() => {}
            Ok(_) => return Err(HttpError::Malformed("incomplete or trailing bytes in head")),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(HttpError::HeadersTooLarge {
                    limit: self.limits.max_headers,
                })
            }
            Err(e) => return Err(HttpError::Malformed(parse_error_text(e))),
        }
        let buffered = self.buffered_bytes();
        let (head, continue_due) = interpret(&req, end, self.limits.max_body_bytes, buffered)?;
        if continue_due {
            self.continue_due = true;
        }
        Ok(Some(head))
    }
}

/// The request head from a complete `httparse` parse of `end` bytes:
/// method, target, keep-alive and body length (checked against
/// `max_body_bytes`), and whether a `100 Continue` is due (the client
/// expects one and the body is not in the `buffered_bytes` yet).
fn interpret(
    req: &httparse::Request<'_, '_>,
    end: usize,
    max_body_bytes: usize,
    buffered_bytes: usize,
) -> Result<(Head, bool), HttpError> {
    let (Some(method), Some(path), Some(version)) = (req.method, req.path, req.version) else {
        return Err(HttpError::Malformed("missing method, target or version"));
    };
    if !path.starts_with('/') {
        return Err(HttpError::Malformed(
            "request target must be in origin form (start with `/`)",
        ));
    }
    let mut keep_alive = version == 1;
    let mut content_length: Option<u64> = None;
    let mut expect_continue = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = parse_content_length(h.value)?;
            if content_length.is_some_and(|c| c != v) {
                return Err(HttpError::Malformed("conflicting Content-Length headers"));
            }
            content_length = Some(v);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            if req
                .headers
                .iter()
                .any(|h| h.name.eq_ignore_ascii_case("content-length"))
            {
                return Err(HttpError::Malformed(
                    "both Transfer-Encoding and Content-Length",
                ));
            }
            return Err(HttpError::LengthRequired);
        } else if h.name.eq_ignore_ascii_case("connection") {
            for token in h.value.split(|b| *b == b',') {
                let t = token.trim_ascii();
                if t.eq_ignore_ascii_case(b"close") {
                    keep_alive = false;
                } else if t.eq_ignore_ascii_case(b"keep-alive") && version == 0 {
                    keep_alive = true;
                }
            }
        } else if h.name.eq_ignore_ascii_case("expect") {
            if h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue") {
                expect_continue = true;
            } else {
                return Err(HttpError::ExpectationFailed);
            }
        }
    }
    let body_len = content_length.unwrap_or(0);
    if body_len > max_body_bytes as u64 {
        return Err(HttpError::BodyTooLarge {
            len_bytes: body_len,
            max_bytes: max_body_bytes,
        });
    }
    let body_len = body_len as usize;
    let head = Head {
        method: Method::parse(method),
        target: path.to_string(),
        keep_alive,
        head_len: end,
        body_len,
    };
    let continue_due =
        expect_continue && body_len > 0 && buffered_bytes < end + body_len && version == 1;
    Ok((head, continue_due))
}

/// Runs `httparse` on an incomplete head to refuse garbage before the blank
/// line arrives (for example a binary frame sent to the HTTP port).
fn check_partial(data: &[u8]) -> Result<Option<Head>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS_LIMIT];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(data) {
        Ok(_) => Ok(None),
        // The line count is checked once the head is complete.
        Err(httparse::Error::TooManyHeaders) => Ok(None),
        Err(e) => Err(HttpError::Malformed(parse_error_text(e))),
    }
}

fn parse_error_text(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::HeaderName => "invalid header name",
        httparse::Error::HeaderValue => "invalid header value",
        httparse::Error::NewLine => "invalid line ending",
        httparse::Error::Status => "invalid status",
        httparse::Error::Token => "invalid method or token",
        httparse::Error::TooManyHeaders => "too many headers",
        httparse::Error::Version => "invalid HTTP version",
    }
}

/// `Content-Length = 1*DIGIT` (RFC 9110 section 8.6); at most 19 digits so
/// the value fits u64 without overflow.
fn parse_content_length(v: &[u8]) -> Result<u64, HttpError> {
    let v = v.trim_ascii();
    if v.is_empty() || v.len() > 19 || !v.iter().all(u8::is_ascii_digit) {
        return Err(HttpError::Malformed("invalid Content-Length"));
    }
    Ok(v.iter().fold(0u64, |acc, d| acc * 10 + u64::from(d - b'0')))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Duration = Duration::ZERO;

    fn dec() -> RequestDecoder {
        RequestDecoder::new(CodecLimits::default())
    }

    fn all(d: &mut RequestDecoder) -> Vec<Request> {
        let mut v = Vec::new();
        while let Some(r) = d.next_request().unwrap() {
            v.push(r);
        }
        v
    }

    #[test]
    fn simple_get_and_keep_alive_defaults() {
        let mut d = dec();
        d.feed(b"GET /health/live HTTP/1.1\r\nHost: x\r\n\r\n", T0);
        let r = d.next_request().unwrap().unwrap();
        assert_eq!(r.method, Method::Get);
        assert_eq!(r.target, "/health/live");
        assert!(r.keep_alive);
        assert!(r.body.is_empty());
        assert_eq!(d.buffered_bytes(), 0);
        assert_eq!(d.pending(), None);

        d.feed(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", T0);
        assert!(!d.next_request().unwrap().unwrap().keep_alive);
        d.feed(b"GET / HTTP/1.0\r\n\r\n", T0);
        assert!(!d.next_request().unwrap().unwrap().keep_alive);
        d.feed(b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", T0);
        assert!(d.next_request().unwrap().unwrap().keep_alive);
    }

    #[test]
    fn post_with_body_byte_by_byte_equals_all_at_once() {
        let req = b"POST /v1/entities/counter/a HTTP/1.1\r\nContent-Length: 5\r\n\r\nadd 1";
        let mut whole = dec();
        whole.feed(req, T0);
        let a = all(&mut whole);
        let mut bytewise = dec();
        let mut b = Vec::new();
        for (i, byte) in req.iter().enumerate() {
            bytewise.feed(std::slice::from_ref(byte), Duration::from_millis(i as u64));
            b.extend(all(&mut bytewise));
        }
        assert_eq!(a, b);
        assert_eq!(a.len(), 1);
        assert_eq!(a[0].body, b"add 1");
    }

    #[test]
    fn pipelined_requests_are_returned_in_order() {
        let mut d = dec();
        d.feed(
            b"POST /a HTTP/1.1\r\nContent-Length: 1\r\n\r\nxGET /b HTTP/1.1\r\n\r\nPOST /c HTTP/1.1\r\ncontent-length: 2\r\n\r\nyz",
            T0,
        );
        let v = all(&mut d);
        let targets: Vec<_> = v.iter().map(|r| r.target.as_str()).collect();
        assert_eq!(targets, ["/a", "/b", "/c"]);
        assert_eq!(v[2].body, b"yz");
    }

    #[test]
    fn leftover_bytes_are_clocked_from_the_wait_not_from_their_arrival() {
        let mut d = dec();
        d.feed(
            b"GET /a HTTP/1.1\r\n\r\nGET /b HTTP/1.1\r\n\r\nGET /c HT",
            Duration::from_secs(1),
        );
        assert_eq!(d.next_request().unwrap().unwrap().target, "/a");
        // Held back (the caller's in-flight limit): no clock runs.
        assert_eq!(d.pending(), None);
        d.start_clock(Duration::from_secs(30));
        // A complete request is buffered: the caller takes it first.
        assert_eq!(d.next_request().unwrap().unwrap().target, "/b");
        assert_eq!(d.pending(), None);
        d.start_clock(Duration::from_secs(40));
        assert!(d.next_request().unwrap().is_none());
        assert_eq!(
            d.pending(),
            Some(Pending::Headers {
                since: Duration::from_secs(40)
            })
        );
        d.feed(b"TP/1.1\r\n\r\n", Duration::from_secs(41));
        assert_eq!(d.next_request().unwrap().unwrap().target, "/c");
        assert_eq!(d.pending(), None);
    }

    #[test]
    fn pending_reports_headers_then_body_since_first_byte() {
        let mut d = dec();
        d.feed(b"POST /a HTTP/1.1\r\n", Duration::from_secs(3));
        assert!(d.next_request().unwrap().is_none());
        assert_eq!(
            d.pending(),
            Some(Pending::Headers {
                since: Duration::from_secs(3)
            })
        );
        d.feed(b"Content-Length: 4\r\n\r\nab", Duration::from_secs(9));
        assert!(d.next_request().unwrap().is_none());
        assert_eq!(
            d.pending(),
            Some(Pending::Body {
                since: Duration::from_secs(3),
                remaining_bytes: 2
            })
        );
        d.feed(b"cd", Duration::from_secs(10));
        assert!(d.next_request().unwrap().is_some());
        assert_eq!(d.pending(), None);
    }

    #[test]
    fn oversized_headers_are_431_without_a_blank_line() {
        let mut d = dec();
        d.feed(b"GET / HTTP/1.1\r\nX-Big: ", T0);
        let filler = vec![b'a'; 1024];
        let mut err = None;
        for _ in 0..16 {
            d.feed(&filler, T0);
            match d.next_request() {
                Ok(None) => {}
                Ok(Some(_)) => panic!("no request expected"),
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let e = err.expect("431 expected");
        assert_eq!(e.status_code(), 431);
        assert!(d.is_poisoned());
        assert!(d.buffered_bytes() <= DEFAULT_MAX_HEADER_BYTES + 1024 + 32);
    }

    #[test]
    fn too_many_header_lines_are_431() {
        let mut d = RequestDecoder::new(CodecLimits {
            max_headers: 4,
            ..CodecLimits::default()
        });
        d.feed(
            b"GET / HTTP/1.1\r\na: 1\r\nb: 1\r\nc: 1\r\nd: 1\r\ne: 1\r\n\r\n",
            T0,
        );
        assert_eq!(d.next_request().unwrap_err().status_code(), 431);
    }

    #[test]
    fn oversized_body_is_413_before_the_body_arrives() {
        let mut d = dec();
        d.feed(
            b"POST /v1/entities/echo/a HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n",
            T0,
        );
        let e = d.next_request().unwrap_err();
        assert_eq!(e.status_code(), 413);
        let mut d = dec();
        d.feed(
            b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            T0,
        );
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
        // Exactly the limit is fine.
        let mut d = RequestDecoder::new(CodecLimits {
            max_body_bytes: 3,
            ..CodecLimits::default()
        });
        d.feed(b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", T0);
        assert_eq!(d.next_request().unwrap().unwrap().body, b"abc");
    }

    #[test]
    fn chunked_is_411_and_smuggling_is_400() {
        let mut d = dec();
        d.feed(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 411);
        let mut d = dec();
        d.feed(
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            T0,
        );
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
        let mut d = dec();
        d.feed(
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            T0,
        );
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
        let mut d = dec();
        d.feed(b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
        let mut d = dec();
        d.feed(
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nz",
            T0,
        );
        assert_eq!(d.next_request().unwrap().unwrap().body, b"z");
    }

    #[test]
    fn garbage_is_400_early_and_poisons() {
        let mut d = dec();
        d.feed(b"\x00\x00\x00\x10binary", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
        assert!(d.next_request().is_err());
        assert_eq!(d.pending(), None);

        let mut d = dec();
        d.feed(b"GET /ok HTTP/1.1\r\n\r\nthis is not http\r\n\r\n", T0);
        assert!(d.next_request().unwrap().is_some());
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);

        let mut d = dec();
        d.feed(b"GET http://example.com/ HTTP/1.1\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);

        let mut d = dec();
        d.feed(b"GET / HTTP/2.0\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 400);
    }

    #[test]
    fn leading_empty_lines_are_ignored_but_bounded() {
        let mut d = dec();
        d.feed(b"\r\nGET / HTTP/1.1\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap().unwrap().target, "/");
        let mut d = dec();
        d.feed(b"\r\n\r\n\r\n", T0);
        assert!(d.next_request().is_err());
    }

    #[test]
    fn expect_continue_is_reported_once() {
        let mut d = dec();
        d.feed(
            b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
            T0,
        );
        assert!(d.next_request().unwrap().is_none());
        assert!(d.take_continue());
        assert!(!d.take_continue());
        d.feed(b"hi", T0);
        assert_eq!(d.next_request().unwrap().unwrap().body, b"hi");
        let mut d = dec();
        d.feed(b"POST / HTTP/1.1\r\nExpect: teapot\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap_err().status_code(), 417);
    }

    #[test]
    fn bare_lf_line_endings_are_accepted() {
        let mut d = dec();
        d.feed(b"POST /x HTTP/1.1\nContent-Length: 1\n\nq", T0);
        let r = d.next_request().unwrap().unwrap();
        assert_eq!((r.target.as_str(), r.body.as_slice()), ("/x", &b"q"[..]));
    }

    #[test]
    fn other_methods_are_parsed_as_other() {
        let mut d = dec();
        d.feed(b"DELETE /x HTTP/1.1\r\n\r\nHEAD /y HTTP/1.1\r\n\r\n", T0);
        assert_eq!(d.next_request().unwrap().unwrap().method, Method::Other);
        assert_eq!(d.next_request().unwrap().unwrap().method, Method::Head);
    }
}
