//! The binary form of [`ClusterMessage`]: compact, versioned, little-endian.
//!
//! ```text
//! message     = wire_version:u8 (=1) tag:u8 body
//! str         = len_bytes:u32 utf8[len_bytes]
//! uaddr       = address:str uid:u64
//! set<T>      = count:u32 T[count]
//! member      = uaddr status:u8 up_number:u32 roles:set<str>
//! gossip      = members:(count:u32 member[count])
//!               reachability:(count:u32 (observer:uaddr version:u64 set<uaddr>)[count])
//!               seen:set<uaddr>
//!               version:(count:u32 (uaddr counter:u64)[count])
//!               tombstones:set<uaddr>
//! tag 1 InitJoin{from}          2 InitJoinAck{from}     3 InitJoinNack{from}
//!     4 Join{from, roles}       5 Welcome{from,to,gossip}
//!     6 Gossip{from,to,gossip}  7 GossipStatus{from,to,version,seen}
//!     8 Heartbeat{from,to,sequence_nr:u64}  9 HeartbeatRsp{from,to,sequence_nr:u64}
//!    10 Downed{from,to}        11 HandOverToMe{from,to}  12 HandOverDone{from,to}
//! ```
//!
//! Decoding checks every count against the bytes that remain before it
//! allocates (each element needs a known minimum of bytes), so hostile input
//! cannot make it allocate more than a small multiple of its own size. The
//! whole input must be consumed.

use std::collections::{BTreeMap, BTreeSet};

use thiserror::Error;

use super::gossip::{Gossip, ObserverRecord, Reachability};
use super::member::{Member, MemberStatus};
use super::message::ClusterMessage;
use super::vclock::VectorClock;
use crate::ids::{Address, MemberUid, UniqueAddress};

/// The wire format version written in the first byte.
pub const WIRE_VERSION: u8 = 1;

const MIN_STR_BYTES: usize = 4;
const MIN_UADDR_BYTES: usize = MIN_STR_BYTES + 8;
const MIN_MEMBER_BYTES: usize = MIN_UADDR_BYTES + 1 + 4 + 4;
const MIN_RECORD_BYTES: usize = MIN_UADDR_BYTES + 8 + 4;
const MIN_CLOCK_ENTRY_BYTES: usize = MIN_UADDR_BYTES + 8;

/// Errors from [`decode`].
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended inside a field.
    #[error("truncated message: needed {needed_bytes} more bytes at offset {offset}")]
    Truncated {
        /// Offset of the field, in bytes.
        offset: usize,
        /// Bytes the field needs beyond the end.
        needed_bytes: usize,
    },
    /// The first byte names a format this build does not read.
    #[error("unsupported wire version {0} (this build reads {WIRE_VERSION})")]
    UnsupportedVersion(u8),
    /// Unknown message tag.
    #[error("unknown message tag {0}")]
    UnknownTag(u8),
    /// Unknown member status code.
    #[error("unknown member status code {0}")]
    UnknownStatus(u8),
    /// A string is not UTF-8.
    #[error("string at offset {offset} is not UTF-8")]
    NotUtf8 {
        /// Offset of the string's bytes.
        offset: usize,
    },
    /// A count or length is larger than the bytes left could hold.
    #[error("count {count} at offset {offset} exceeds the {remaining_bytes} bytes left")]
    LengthTooLarge {
        /// Offset of the count.
        offset: usize,
        /// The count read.
        count: u32,
        /// Bytes left after it.
        remaining_bytes: usize,
    },
    /// Bytes left after a complete message.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
}

/// Encodes a message (see the module doc for the layout).
///
/// # Panics
/// If a string or collection holds more than `u32::MAX` bytes or elements,
/// which no address, role or cluster comes near.
pub fn encode(message: &ClusterMessage) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64));
    w.u8(WIRE_VERSION);
    match message {
        ClusterMessage::InitJoin { from } => {
            w.u8(1);
            w.uaddr(from);
        }
        ClusterMessage::InitJoinAck { from } => {
            w.u8(2);
            w.uaddr(from);
        }
        ClusterMessage::InitJoinNack { from } => {
            w.u8(3);
            w.uaddr(from);
        }
        ClusterMessage::Join { from, roles } => {
            w.u8(4);
            w.uaddr(from);
            w.strs(roles);
        }
        ClusterMessage::Welcome { from, to, gossip } => {
            w.u8(5);
            w.uaddr(from);
            w.uaddr(to);
            w.gossip(gossip);
        }
        ClusterMessage::Gossip { from, to, gossip } => {
            w.u8(6);
            w.uaddr(from);
            w.uaddr(to);
            w.gossip(gossip);
        }
        ClusterMessage::GossipStatus {
            from,
            to,
            version,
            seen,
        } => {
            w.u8(7);
            w.uaddr(from);
            w.uaddr(to);
            w.clock(version);
            w.uaddrs(seen);
        }
        ClusterMessage::Heartbeat {
            from,
            to,
            sequence_nr,
        } => {
            w.u8(8);
            w.uaddr(from);
            w.uaddr(to);
            w.u64(*sequence_nr);
        }
        ClusterMessage::HeartbeatRsp {
            from,
            to,
            sequence_nr,
        } => {
            w.u8(9);
            w.uaddr(from);
            w.uaddr(to);
            w.u64(*sequence_nr);
        }
        ClusterMessage::Downed { from, to } => {
            w.u8(10);
            w.uaddr(from);
            w.uaddr(to);
        }
        ClusterMessage::HandOverToMe { from, to } => {
            w.u8(11);
            w.uaddr(from);
            w.uaddr(to);
        }
        ClusterMessage::HandOverDone { from, to } => {
            w.u8(12);
            w.uaddr(from);
            w.uaddr(to);
        }
    }
    w.0
}

/// Decodes one message that fills `bytes` exactly.
///
/// # Errors
/// [`DecodeError::UnsupportedVersion`] for another wire version,
/// [`DecodeError::UnknownTag`] / [`DecodeError::UnknownStatus`] for unknown
/// codes, [`DecodeError::Truncated`] when the input ends inside a field,
/// [`DecodeError::LengthTooLarge`] when a count cannot fit in the rest,
/// [`DecodeError::NotUtf8`] for a bad string and
/// [`DecodeError::TrailingBytes`] when bytes remain.
pub fn decode(bytes: &[u8]) -> Result<ClusterMessage, DecodeError> {
    let mut r = Reader { b: bytes, pos: 0 };
    let v = r.u8()?;
    if v != WIRE_VERSION {
        return Err(DecodeError::UnsupportedVersion(v));
    }
    let tag = r.u8()?;
    let msg = match tag {
        1 => ClusterMessage::InitJoin { from: r.uaddr()? },
        2 => ClusterMessage::InitJoinAck { from: r.uaddr()? },
        3 => ClusterMessage::InitJoinNack { from: r.uaddr()? },
        4 => ClusterMessage::Join {
            from: r.uaddr()?,
            roles: r.strs()?,
        },
        5 => ClusterMessage::Welcome {
            from: r.uaddr()?,
            to: r.uaddr()?,
            gossip: r.gossip()?,
        },
        6 => ClusterMessage::Gossip {
            from: r.uaddr()?,
            to: r.uaddr()?,
            gossip: r.gossip()?,
        },
        7 => ClusterMessage::GossipStatus {
            from: r.uaddr()?,
            to: r.uaddr()?,
            version: r.clock()?,
            seen: r.uaddrs()?,
        },
        8 => ClusterMessage::Heartbeat {
            from: r.uaddr()?,
            to: r.uaddr()?,
            sequence_nr: r.u64()?,
        },
        9 => ClusterMessage::HeartbeatRsp {
            from: r.uaddr()?,
            to: r.uaddr()?,
            sequence_nr: r.u64()?,
        },
        10 => ClusterMessage::Downed {
            from: r.uaddr()?,
            to: r.uaddr()?,
        },
        11 => ClusterMessage::HandOverToMe {
            from: r.uaddr()?,
            to: r.uaddr()?,
        },
        12 => ClusterMessage::HandOverDone {
            from: r.uaddr()?,
            to: r.uaddr()?,
        },
        t => return Err(DecodeError::UnknownTag(t)),
    };
    let rest = bytes.len() - r.pos;
    if rest != 0 {
        return Err(DecodeError::TrailingBytes(rest));
    }
    Ok(msg)
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).expect("length fits in u32"));
    }
    fn str(&mut self, s: &str) {
        self.len(s.len());
        self.0.extend_from_slice(s.as_bytes());
    }
    fn strs(&mut self, set: &BTreeSet<String>) {
        self.len(set.len());
        for s in set {
            self.str(s);
        }
    }
    fn uaddr(&mut self, u: &UniqueAddress) {
        self.str(&u.address.0);
        self.u64(u.uid.0);
    }
    fn uaddrs(&mut self, set: &BTreeSet<UniqueAddress>) {
        self.len(set.len());
        for u in set {
            self.uaddr(u);
        }
    }
    fn clock(&mut self, c: &VectorClock) {
        self.len(c.len());
        for (u, n) in c.entries() {
            self.uaddr(u);
            self.u64(n);
        }
    }
    fn gossip(&mut self, g: &Gossip) {
        self.len(g.members.len());
        for m in g.members.values() {
            self.uaddr(&m.unique_address);
            self.u8(m.status.code());
            self.u32(m.up_number);
            self.strs(&m.roles);
        }
        self.len(g.reachability.records.len());
        for (obs, rec) in &g.reachability.records {
            self.uaddr(obs);
            self.u64(rec.version);
            self.uaddrs(&rec.unreachable);
        }
        self.uaddrs(&g.seen);
        self.clock(&g.version);
        self.uaddrs(&g.tombstones);
    }
}

struct Reader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], DecodeError> {
        let rest = self.b.len() - self.pos;
        if n > rest {
            return Err(DecodeError::Truncated {
                offset: self.pos,
                needed_bytes: n - rest,
            });
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// Reads a count whose elements take at least `min_bytes` each, and
    /// checks that they can fit in what is left.
    fn count(&mut self, min_bytes: usize) -> Result<usize, DecodeError> {
        let offset = self.pos;
        let count = self.u32()?;
        let remaining_bytes = self.b.len() - self.pos;
        let n = count as usize;
        if n.checked_mul(min_bytes)
            .is_none_or(|need| need > remaining_bytes)
        {
            return Err(DecodeError::LengthTooLarge {
                offset,
                count,
                remaining_bytes,
            });
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let n = self.count(1)?;
        let offset = self.pos;
        let bytes = self.take(n)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|_| DecodeError::NotUtf8 { offset })
    }
    fn strs(&mut self) -> Result<BTreeSet<String>, DecodeError> {
        let n = self.count(MIN_STR_BYTES)?;
        let mut out = BTreeSet::new();
        for _ in 0..n {
            out.insert(self.str()?);
        }
        Ok(out)
    }
    fn uaddr(&mut self) -> Result<UniqueAddress, DecodeError> {
        let address = Address(self.str()?.into());
        let uid = MemberUid(self.u64()?);
        Ok(UniqueAddress { address, uid })
    }
    fn uaddrs(&mut self) -> Result<BTreeSet<UniqueAddress>, DecodeError> {
        let n = self.count(MIN_UADDR_BYTES)?;
        let mut out = BTreeSet::new();
        for _ in 0..n {
            out.insert(self.uaddr()?);
        }
        Ok(out)
    }
    fn clock(&mut self) -> Result<VectorClock, DecodeError> {
        let n = self.count(MIN_CLOCK_ENTRY_BYTES)?;
        let mut c = VectorClock::new();
        for _ in 0..n {
            let u = self.uaddr()?;
            let v = self.u64()?;
            c.set(u, v);
        }
        Ok(c)
    }
    fn gossip(&mut self) -> Result<Gossip, DecodeError> {
        let n = self.count(MIN_MEMBER_BYTES)?;
        let mut members = BTreeMap::new();
        for _ in 0..n {
            let unique_address = self.uaddr()?;
            let code = self.u8()?;
            let status = MemberStatus::from_code(code).ok_or(DecodeError::UnknownStatus(code))?;
            let up_number = self.u32()?;
            let roles = self.strs()?;
            members.insert(
                unique_address.clone(),
                Member {
                    unique_address,
                    status,
                    roles,
                    up_number,
                },
            );
        }
        let n = self.count(MIN_RECORD_BYTES)?;
        let mut records = BTreeMap::new();
        for _ in 0..n {
            let obs = self.uaddr()?;
            let version = self.u64()?;
            let unreachable = self.uaddrs()?;
            records.insert(
                obs,
                ObserverRecord {
                    version,
                    unreachable,
                },
            );
        }
        let seen = self.uaddrs()?;
        let version = self.clock()?;
        let tombstones = self.uaddrs()?;
        Ok(Gossip {
            members,
            reachability: Reachability { records },
            seen,
            version,
            tombstones,
        })
    }
}
