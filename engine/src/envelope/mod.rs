//! Wire types and framing, shared by the native client protocol and the
//! node-to-node transport.
//!
//! ```text
//! frame := len: u32 LE (bytes of body, at most MAX_FRAME_SIZE_BYTES) | body
//! body  := an rkyv 0.8 archive (unaligned, little-endian, 32-bit offsets)
//! ```
//!
//! A received body is validated once with bytecheck ([`rkyv::access`]) and
//! then read in place (archived fields are borrowed from the receive buffer;
//! payload bytes are never decoded). A length over the maximum or a body that
//! fails validation is a [`FrameError`]: the connection that sent it is
//! closed, nothing else is affected.

use rkyv::{Archive, Deserialize, Serialize};
use thiserror::Error;

mod client_wire;
mod cluster;

pub use client_wire::{ArchivedClientFrame, ClientFrame};
pub use cluster::{
    decode_frame_body, ArchivedControlFrame, ArchivedDataFrame, ArchivedHello, ControlFrame,
    DataFrame, Hello, HelloAck, Lane, WireCoordinatorEvent, WireCoordinatorMsg, WireMember,
    WireRegion, WireRegionMsg, WireRegionStats,
};

/// Default and maximum frame body size, in bytes (16 MiB).
pub const MAX_FRAME_SIZE_BYTES: usize = 16 << 20;

/// Length of the frame length prefix, in bytes.
pub const FRAME_HEADER_BYTES: usize = 4;

/// Version of the node-to-node protocol; a peer with another version is
/// refused at the handshake. 6: a region's `Register` names the shards it
/// is still stopping after a `HandOff`; 5: `DataFrame::Forward` carries the time left
/// to its ask deadline, reply statuses `Unavailable` (7), `TooLarge` (8)
/// and `JournalUnavailable` (9); 4: cluster name and id, journal identity
/// and durable types in the handshake, the `Identity` control frame; 3: the
/// coordinator event `ShardUnallocated` (remember entities) in replicated
/// coordinator state; 2: control frames for cluster-wide sharding stats
/// (`StatsRequest`/`StatsReply`); 1: the first release.
pub const PROTOCOL_VERSION: u32 = 6;

/// Errors from decoding a frame. Each is a protocol error that closes the
/// connection it arrived on.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The length prefix announces more than the maximum frame size.
    #[error("frame of {len_bytes} bytes exceeds the maximum of {max_bytes} bytes")]
    TooLarge {
        /// Announced body length, in bytes.
        len_bytes: u64,
        /// The limit, in bytes.
        max_bytes: u64,
    },
    /// The body is not a valid archive of the expected type.
    #[error("invalid frame body: {0}")]
    Invalid(String),
}

/// Errors from encoding a frame.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The encoded body is larger than the maximum frame size.
    #[error("encoded frame of {len_bytes} bytes exceeds the maximum of {max_bytes} bytes")]
    TooLarge {
        /// Encoded length, in bytes.
        len_bytes: u64,
        /// The limit, in bytes.
        max_bytes: u64,
    },
    /// rkyv failed to serialize.
    #[error("serialize: {0}")]
    Serialize(String),
}

/// Finds the next complete frame at the start of `buf`.
///
/// Returns `Ok(None)` when more bytes are needed, `Ok(Some(body_len))` when
/// `buf[4..4 + body_len]` is a complete body.
///
/// # Errors
/// [`FrameError::TooLarge`] when the prefix exceeds `max_frame_bytes`
/// (checked before anything is allocated for it).
pub fn next_frame(buf: &[u8], max_frame_bytes: usize) -> Result<Option<usize>, FrameError> {
    let Some(hdr) = buf.get(..FRAME_HEADER_BYTES) else {
        return Ok(None);
    };
    let len = u32::from_le_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]) as usize;
    if len > max_frame_bytes {
        return Err(FrameError::TooLarge {
            len_bytes: len as u64,
            max_bytes: max_frame_bytes as u64,
        });
    }
    if buf.len() - FRAME_HEADER_BYTES < len {
        return Ok(None);
    }
    Ok(Some(len))
}

/// Appends one frame (length prefix + archive of `value`) to `out`.
///
/// # Errors
/// [`EncodeError`] when serialization fails or the body exceeds
/// [`MAX_FRAME_SIZE_BYTES`]; `out` is then left as it was.
pub fn encode_frame<T>(value: &T, out: &mut Vec<u8>) -> Result<(), EncodeError>
where
    T: for<'a> rkyv::Serialize<
        rkyv::api::high::HighSerializer<
            Vec<u8>,
            rkyv::ser::allocator::ArenaHandle<'a>,
            rkyv::rancor::Error,
        >,
    >,
{
    let start = out.len();
    out.extend_from_slice(&[0u8; FRAME_HEADER_BYTES]);
    let buf = std::mem::take(out);
    let mut buf = match rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(value, buf) {
        Ok(b) => b,
        Err(e) => return Err(EncodeError::Serialize(e.to_string())),
    };
    let len = buf.len() - start - FRAME_HEADER_BYTES;
    if len > MAX_FRAME_SIZE_BYTES {
        buf.truncate(start);
        *out = buf;
        return Err(EncodeError::TooLarge {
            len_bytes: len as u64,
            max_bytes: MAX_FRAME_SIZE_BYTES as u64,
        });
    }
    buf[start..start + FRAME_HEADER_BYTES].copy_from_slice(&(len as u32).to_le_bytes());
    *out = buf;
    Ok(())
}

/// Validates `body` as an archived `T` and returns it, read in place.
///
/// # Errors
/// [`FrameError::Invalid`] when bytecheck rejects the body.
pub fn access<T>(body: &[u8]) -> Result<&T::Archived, FrameError>
where
    T: Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<
        rkyv::api::high::HighValidator<'a, rkyv::rancor::Error>,
    >,
{
    // rkyv's release-build error carries no detail ("failed without error
    // information ..."): name what was expected and how much came instead.
    rkyv::access::<T::Archived, rkyv::rancor::Error>(body).map_err(|_| {
        FrameError::Invalid(format!(
            "{} bytes that are not a valid {} (a malformed or foreign frame)",
            body.len(),
            std::any::type_name::<T>()
                .rsplit("::")
                .next()
                .unwrap_or("frame")
        ))
    })
}

// ===== native client protocol =====

/// A frame from a node to a client.
#[derive(Debug, Clone, PartialEq, Eq, Archive, Serialize, Deserialize)]
#[rkyv(attr(allow(missing_docs)))]
pub struct ServerFrame {
    /// The request's id.
    pub request_id: u64,
    /// A [`Status`] code (`Status as u8`).
    pub status: u8,
    /// The entity's reply, or a reason text on errors.
    pub payload: Vec<u8>,
}

/// The outcome of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[non_exhaustive]
#[repr(u8)]
pub enum Status {
    /// The entity handled the message; the payload is its reply.
    Ok = 0,
    /// No entity type of that name is hosted in the cluster.
    UnknownEntityType = 1,
    /// The entity id (or type name) is empty, too long or not UTF-8.
    InvalidEntityId = 2,
    /// A bounded buffer on the way was full; retry later. Not delivered.
    BufferFull = 3,
    /// No answer in time, and the message may have reached its entity: the
    /// outcome is unknown (a retry may apply it twice). Messages known not
    /// to have been delivered are answered [`Status::Unavailable`] instead.
    TimedOut = 4,
    /// The entity failed while handling the message.
    EntityFailed = 5,
    /// The node is leaving; retry on another node. Not delivered.
    ShuttingDown = 6,
    /// The journal backend cannot be reached (e.g. the PostgreSQL database
    /// is down): the durable command was not applied, or its outcome is
    /// unknown when the database went away during its commit; retry later
    /// (HTTP 503 with `Retry-After`).
    JournalUnavailable = 9,
    /// Not delivered, safe to retry: the shard's home is unreachable (the
    /// link to it is backing off or broke before the message was written),
    /// the home was removed from the cluster, the node is leaving, the
    /// request's ask deadline passed while it waited in a buffer, or its
    /// durable entity stopped (hand-off, node stop) before it handled the
    /// message (stashed behind a recovery read that did not finish).
    Unavailable = 7,
    /// The message is larger than the largest message the cluster carries
    /// (`max_message_size_bytes`); a retry can never succeed. Not delivered.
    TooLarge = 8,
}

impl Status {
    /// Whether the engine knows the message was not handed to its entity
    /// (so a retry cannot apply it twice): `BufferFull`, `ShuttingDown`,
    /// `Unavailable`, `TooLarge`, and the refusals before routing
    /// (`UnknownEntityType`, `InvalidEntityId`).
    pub fn not_delivered(self) -> bool {
        matches!(
            self,
            Status::UnknownEntityType
                | Status::InvalidEntityId
                | Status::BufferFull
                | Status::ShuttingDown
                | Status::Unavailable
                | Status::TooLarge
        )
    }

    /// Decodes a wire status code; unknown codes map to `None`.
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::UnknownEntityType,
            2 => Status::InvalidEntityId,
            3 => Status::BufferFull,
            4 => Status::TimedOut,
            5 => Status::EntityFailed,
            6 => Status::ShuttingDown,
            9 => Status::JournalUnavailable,
            7 => Status::Unavailable,
            8 => Status::TooLarge,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_at_unaligned_offsets() {
        let mut out = vec![7u8]; // an odd prefix: archives must not need alignment
        let f = ClientFrame::Request {
            request_id: 9,
            type_name: b"echo".to_vec(),
            entity_id: b"a".to_vec(),
            payload: b"hello".to_vec(),
        };
        encode_frame(&f, &mut out).unwrap();
        let len = next_frame(&out[1..], MAX_FRAME_SIZE_BYTES)
            .unwrap()
            .unwrap();
        let body = &out[1 + 4..1 + 4 + len];
        let a = access::<ClientFrame>(body).unwrap();
        match a {
            ArchivedClientFrame::Request {
                request_id,
                payload,
                ..
            } => {
                assert_eq!(request_id.to_native(), 9);
                assert_eq!(payload.as_slice(), b"hello");
            }
            _ => panic!("wrong variant"),
        }
    }

    #[test]
    fn refuses_oversized_prefix_and_garbage() {
        let buf = u32::MAX.to_le_bytes();
        assert!(matches!(
            next_frame(&buf, MAX_FRAME_SIZE_BYTES),
            Err(FrameError::TooLarge { .. })
        ));
        assert!(next_frame(&[1, 0], MAX_FRAME_SIZE_BYTES).unwrap().is_none());
        let e = match access::<ClientFrame>(&[0xff; 13]) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("garbage accepted"),
        };
        assert_eq!(
            e,
            "invalid frame body: 13 bytes that are not a valid ClientFrame (a malformed or foreign frame)"
        );
        assert!(access::<ClientFrame>(&[]).is_err());
    }
}
