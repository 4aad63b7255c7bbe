//! The `[requests]` table: how long a request may wait for its answer and
//! how large a message the cluster carries. Both are checked at the front a
//! request arrives on, so that a request's fate never depends on where its
//! entity lives (see `docs/interfaces.md`, "Limits").

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::envelope::MAX_FRAME_SIZE_BYTES;

/// Bytes a forwarded message's frame needs besides its payload: the type
/// name and entity id (at most 255 bytes each), the archive's fixed part
/// and alignment (in bytes; generous).
pub const ENVELOPE_OVERHEAD_BYTES: u64 = 1024;

/// The largest message (payload) the node-to-node wire can carry, in bytes:
/// the frame limit ([`MAX_FRAME_SIZE_BYTES`], 16 MiB) less
/// [`ENVELOPE_OVERHEAD_BYTES`]. Upper bound and default of
/// [`RequestsConfig::max_message_size_bytes`].
pub const MAX_MESSAGE_SIZE_BYTES: u64 = MAX_FRAME_SIZE_BYTES as u64 - ENVELOPE_OVERHEAD_BYTES;

/// Default of [`RequestsConfig::ask_timeout_ms`]: 12 s.
pub const DEFAULT_ASK_TIMEOUT_MS: u64 = 12_000;

/// Default of [`RequestsConfig::frame_timeout_ms`]: 15 s (the HTTP
/// front's `http.body_timeout_ms` default).
pub const DEFAULT_FRAME_TIMEOUT_MS: u64 = 15_000;

/// Default of [`RequestsConfig::max_native_connections_per_core`] (the
/// HTTP front's `http.max_connections_per_core` default).
pub const DEFAULT_MAX_NATIVE_CONNECTIONS_PER_CORE: u32 = 10_000;

/// Default of [`RequestsConfig::send_timeout_ms`]: 60 s (nginx's
/// `send_timeout` default).
pub const DEFAULT_SEND_TIMEOUT_MS: u64 = 60_000;

/// How long the HTTP front waits past a request's ask deadline before it
/// answers `504` itself (in ms): time for a "not delivered" answer from a
/// buffer or from another node to arrive first.
pub const ANSWER_GRACE_MS: u64 = 1_000;

/// Request deadlines and the message size limit (`[requests]` table; every
/// key optional).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RequestsConfig {
    /// The ask deadline of a client request, in milliseconds from its
    /// arrival at a front (HTTP or native). A request still waiting in a
    /// buffer (for a shard home, a hand-off, a recovery) at its deadline
    /// is removed and answered `Unavailable` (HTTP 503: not delivered,
    /// safe to retry); the deadline travels with a request forwarded to
    /// another node. The HTTP front answers `504` (outcome unknown) only
    /// for a request that got no answer by the deadline plus
    /// [`ANSWER_GRACE_MS`], i.e. one that may have reached its entity.
    /// Default 12000; 100..=3600000.
    pub ask_timeout_ms: u64,
    /// The largest message payload the cluster accepts, in bytes. A larger
    /// request is refused at once by the front it arrives on: HTTP `413`,
    /// native protocol a `TooLarge` answer (a request frame over the limit
    /// plus [`ENVELOPE_OVERHEAD_BYTES`] gets a `TooLarge` frame with request
    /// id 0, then the connection is closed); the embedding API
    /// ([`crate::EntityRef::ask`], `tell`, and the typed ones) refuses it
    /// before sending it, wherever its entity lives. With an HTTP front
    /// (`http_address` set), `http.max_body_size_bytes` may not exceed it
    /// (without one, that key bounds nothing and is not compared). Default and maximum [`MAX_MESSAGE_SIZE_BYTES`]
    /// (16 MiB less 1 KiB, what a node-to-node frame carries); at least 1.
    pub max_message_size_bytes: u64,
    /// How long a request frame on the native port may take to arrive
    /// whole, in milliseconds from the read that brought its first byte.
    /// A connection whose frame is still incomplete then is closed (a
    /// client that stalls mid-frame would otherwise hold the connection
    /// and up to a frame's worth of buffer for ever). A connection with
    /// no partial frame waits for its next request without limit, as a
    /// pooled client connection does. Default 15000; 100..=3600000.
    pub frame_timeout_ms: u64,
    /// The most native-protocol client connections one data core keeps
    /// open (count). A connection accepted over it gets one frame with
    /// request id 0 and status `Unavailable` (not delivered: retry later
    /// or on another node) and is closed, so that a connection storm or
    /// leak cannot exhaust the process's file descriptors and starve the
    /// cluster port and the journal. The HTTP front has its own limit,
    /// `http.max_connections_per_core`. Default 10000; 1..=1000000.
    pub max_native_connections_per_core: u32,
    /// How long a client connection of either front (native or HTTP) may
    /// take none of its output, in milliseconds: a write that moves no
    /// byte for this long closes the connection (nginx's `send_timeout`,
    /// counted between two successive writes, so a slow reader that keeps
    /// taking bytes is not cut off). Without it, a client that stops
    /// reading would hold its connection, its queued responses (up to
    /// 32 MiB before the front stops reading it) and its socket for ever.
    /// Default 60000; 100..=3600000.
    pub send_timeout_ms: u64,
}

impl Default for RequestsConfig {
    fn default() -> Self {
        RequestsConfig {
            ask_timeout_ms: DEFAULT_ASK_TIMEOUT_MS,
            max_message_size_bytes: MAX_MESSAGE_SIZE_BYTES,
            frame_timeout_ms: DEFAULT_FRAME_TIMEOUT_MS,
            max_native_connections_per_core: DEFAULT_MAX_NATIVE_CONNECTIONS_PER_CORE,
            send_timeout_ms: DEFAULT_SEND_TIMEOUT_MS,
        }
    }
}

impl RequestsConfig {
    /// [`Self::ask_timeout_ms`] as a Duration.
    pub fn ask_timeout(&self) -> Duration {
        Duration::from_millis(self.ask_timeout_ms)
    }

    /// [`Self::frame_timeout_ms`] as a Duration.
    pub fn frame_timeout(&self) -> Duration {
        Duration::from_millis(self.frame_timeout_ms)
    }

    /// [`Self::send_timeout_ms`] as a Duration.
    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
    }

    /// The longest a request frame on the native port may be, in bytes
    /// (the message limit plus [`ENVELOPE_OVERHEAD_BYTES`]).
    pub fn max_request_frame_bytes(&self) -> usize {
        usize::try_from(self.max_message_size_bytes + ENVELOPE_OVERHEAD_BYTES)
            .unwrap_or(MAX_FRAME_SIZE_BYTES)
            .min(MAX_FRAME_SIZE_BYTES)
    }

    /// Checks value ranges and that `http_max_body` (the HTTP front's body
    /// limit, in bytes; `None` without an HTTP front, whose limit then
    /// bounds nothing) is within the message limit; `bad(key, reason)`
    /// builds the error.
    pub(super) fn validate(
        &self,
        http_max_body: Option<u64>,
        bad: impl Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        if !(100..=3_600_000).contains(&self.ask_timeout_ms) {
            return Err(bad(
                "requests.ask_timeout_ms",
                format!("{} is not in 100..=3600000", self.ask_timeout_ms),
            ));
        }
        if !(100..=3_600_000).contains(&self.frame_timeout_ms) {
            return Err(bad(
                "requests.frame_timeout_ms",
                format!("{} is not in 100..=3600000", self.frame_timeout_ms),
            ));
        }
        if !(100..=3_600_000).contains(&self.send_timeout_ms) {
            return Err(bad(
                "requests.send_timeout_ms",
                format!("{} is not in 100..=3600000", self.send_timeout_ms),
            ));
        }
        if !(1..=1_000_000).contains(&self.max_native_connections_per_core) {
            return Err(bad(
                "requests.max_native_connections_per_core",
                format!(
                    "{} is not in 1..=1000000",
                    self.max_native_connections_per_core
                ),
            ));
        }
        if self.max_message_size_bytes == 0 || self.max_message_size_bytes > MAX_MESSAGE_SIZE_BYTES
        {
            return Err(bad(
                "requests.max_message_size_bytes",
                format!(
                    "{} is not in 1..={MAX_MESSAGE_SIZE_BYTES} (a node-to-node frame carries at most {MAX_FRAME_SIZE_BYTES} bytes)",
                    self.max_message_size_bytes
                ),
            ));
        }
        if let Some(http_max_body) = http_max_body.filter(|b| *b > self.max_message_size_bytes) {
            return Err(bad(
                "http.max_body_size_bytes",
                format!(
                    "{http_max_body} exceeds requests.max_message_size_bytes ({}): a body the cluster cannot carry would be accepted",
                    self.max_message_size_bytes
                ),
            ));
        }
        Ok(())
    }
}
