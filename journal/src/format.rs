//! The pure byte codec of the journal: segment headers, records, index
//! files, the state checkpoint and snapshot files. No I/O happens here; every
//! decoder takes arbitrary bytes, checks every length against the bytes it
//! has before using it, and never panics. `journal/FORMAT.md` is the
//! specification; this module is its implementation.

use crate::ids::{Lsn, PersistenceId, SequenceNr, WriterEpoch, MAX_PERSISTENCE_ID_LEN_BYTES};

/// Magic bytes at offset 0 of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"SHLJSEG\0";
/// Magic bytes at offset 0 of every index file.
pub const INDEX_MAGIC: [u8; 8] = *b"SHLJIDX\0";
/// Magic bytes at offset 0 of the state checkpoint file.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"SHLJCHK\0";
/// Magic bytes at offset 0 of every snapshot file.
pub const SNAPSHOT_MAGIC: [u8; 8] = *b"SHLJSNP\0";
/// The format version this crate writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Length of the segment file header, in bytes.
pub const SEGMENT_HEADER_LEN_BYTES: usize = 64;
/// Length of the fixed part of a record header, in bytes (the persistence id
/// and the payload follow it).
pub const RECORD_HEADER_LEN_BYTES: usize = 44;
/// File name suffix of segment files.
pub const SEGMENT_SUFFIX: &str = ".seg";
/// File name suffix of index files.
pub const INDEX_SUFFIX: &str = ".idx";
/// File name suffix of snapshot files.
pub const SNAPSHOT_SUFFIX: &str = ".snap";
/// File name suffix of temporary files (removed on open).
pub const TMP_SUFFIX: &str = ".tmp";
/// File name of the state checkpoint.
pub const CHECKPOINT_NAME: &str = "journal.state";
/// Name of the snapshot table (FORMAT.md, "Snapshot table").
pub const SNAPSHOT_TABLE_NAME: &str = "snapshots.tbl";
/// Bytes of one slot of the snapshot table.
pub const TABLE_SLOT_BYTES: usize = 256;
/// Bytes of one id's pair of slots in the snapshot table.
pub const TABLE_PAIR_BYTES: usize = 2 * TABLE_SLOT_BYTES;
/// The largest encoded snapshot a table slot holds (a slot adds its
/// length, a write serial and a CRC32C: 16 bytes); a larger one gets a
/// file of its own.
pub const TABLE_SNAPSHOT_MAX_BYTES: usize = TABLE_SLOT_BYTES - 16;

/// The kind of a record (byte 42 of the record header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordKind {
    /// An event appended by the caller (kind byte 0).
    Event,
    /// A deletion marker: every event of the persistence id with a sequence
    /// number at most the record's sequence number is deleted (kind byte 1).
    Deletion,
}

impl RecordKind {
    fn to_byte(self) -> u8 {
        match self {
            RecordKind::Event => 0,
            RecordKind::Deletion => 1,
        }
    }

    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(RecordKind::Event),
            1 => Some(RecordKind::Deletion),
            _ => None,
        }
    }
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// File name of the segment whose first record has LSN `first_lsn`.
pub fn segment_name(first_lsn: Lsn) -> String {
    format!("{:020}{SEGMENT_SUFFIX}", first_lsn.0)
}

/// File name of the index of segment `first_lsn`.
pub fn index_name(first_lsn: Lsn) -> String {
    format!("{:020}{INDEX_SUFFIX}", first_lsn.0)
}

/// Parses a segment or index file name back to the segment id; `None` for
/// other names.
pub fn parse_numbered_name(name: &str, suffix: &str) -> Option<Lsn> {
    let stem = name.strip_suffix(suffix)?;
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    stem.parse().ok().map(Lsn)
}

/// The decoded segment file header (FORMAT.md, "Segment header").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Segment id: the LSN of the segment's first record.
    pub segment_id: Lsn,
    /// The epoch of the writer that created the segment.
    pub writer_epoch: WriterEpoch,
    /// The size the segment was created with, in bytes.
    pub segment_size_bytes: u64,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_ms: u64,
}

/// Why a segment header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    /// The file is shorter than the 64-byte header.
    #[error("file is {len_bytes} bytes, shorter than the 64-byte header")]
    TooShort {
        /// The file's length, in bytes.
        len_bytes: u64,
    },
    /// The header is all zero bytes (a segment whose header never reached
    /// the disk).
    #[error("header is all zero bytes")]
    Zeroed,
    /// The first 8 bytes are not the segment magic.
    #[error("wrong magic bytes")]
    BadMagic,
    /// The format version is not one this crate reads.
    #[error("unsupported format version {version} (this build reads version 1)")]
    UnsupportedVersion {
        /// The version found in the header.
        version: u32,
    },
    /// The header's CRC32C does not match its bytes.
    #[error("header checksum mismatch")]
    BadChecksum,
    /// The header's length field is not 64.
    #[error("header length field is {len_bytes}, expected 64")]
    BadLength {
        /// The header length found, in bytes.
        len_bytes: u32,
    },
}

impl SegmentHeader {
    /// Encodes the header into its 64 bytes.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN_BYTES] {
        let mut b = [0u8; SEGMENT_HEADER_LEN_BYTES];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(SEGMENT_HEADER_LEN_BYTES as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.segment_id.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.writer_epoch.0.to_le_bytes());
        b[32..40].copy_from_slice(&self.segment_size_bytes.to_le_bytes());
        b[40..48].copy_from_slice(&self.created_ms.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes the header at the start of `bytes`.
    ///
    /// # Errors
    /// A [`HeaderError`] naming the first check that failed, in the order
    /// length, all-zero, magic, version, length field, checksum. A version
    /// other than this build's is [`HeaderError::UnsupportedVersion`] only
    /// when the header's own checksum holds (every version keeps the
    /// magic, version and header length first and the header's CRC32C in
    /// its last 4 bytes), and [`HeaderError::BadChecksum`] otherwise: a
    /// flipped bit in the version field is damage, not a newer format.
    pub fn decode(bytes: &[u8]) -> Result<Self, HeaderError> {
        let Some(b) = bytes.get(..SEGMENT_HEADER_LEN_BYTES) else {
            return Err(HeaderError::TooShort {
                len_bytes: bytes.len() as u64,
            });
        };
        if b.iter().all(|&x| x == 0) {
            return Err(HeaderError::Zeroed);
        }
        if b[0..8] != SEGMENT_MAGIC {
            return Err(HeaderError::BadMagic);
        }
        let version = u32_at(b, 8).unwrap_or(0);
        if version != FORMAT_VERSION {
            return Err(if checksum_of_any_version_holds(bytes) {
                HeaderError::UnsupportedVersion { version }
            } else {
                HeaderError::BadChecksum
            });
        }
        let len = u32_at(b, 12).unwrap_or(0);
        if len as usize != SEGMENT_HEADER_LEN_BYTES {
            return Err(HeaderError::BadLength { len_bytes: len });
        }
        let crc = u32_at(b, 60).unwrap_or(0);
        if crc32c::crc32c(&b[0..60]) != crc {
            return Err(HeaderError::BadChecksum);
        }
        Ok(SegmentHeader {
            segment_id: Lsn(u64_at(b, 16).unwrap_or(0)),
            writer_epoch: WriterEpoch(u64_at(b, 24).unwrap_or(0)),
            segment_size_bytes: u64_at(b, 32).unwrap_or(0),
            created_ms: u64_at(b, 40).unwrap_or(0),
        })
    }
}

/// The fields of a record to encode.
#[derive(Debug, Clone, Copy)]
pub struct RecordFields<'a> {
    /// The record's LSN.
    pub lsn: Lsn,
    /// Event: its sequence number; deletion marker: delete up to this.
    pub sequence_nr: SequenceNr,
    /// The writer epoch the record was appended with.
    pub writer_epoch: WriterEpoch,
    /// Append time, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// Event or deletion marker.
    pub kind: RecordKind,
    /// The persistence id's UTF-8 bytes (1..=1024).
    pub persistence_id: &'a [u8],
}

/// Total encoded length of a record, in bytes.
pub fn record_len_bytes(persistence_id_len: usize, payload_len: usize) -> u64 {
    (RECORD_HEADER_LEN_BYTES + persistence_id_len) as u64 + payload_len as u64
}

/// Encodes the record header and the persistence id into `out` (cleared
/// first) and returns the CRC32C over header, id and `payload`; the payload
/// itself is not copied. The CRC is already stored in `out[4..8]`.
pub fn encode_record_head(fields: &RecordFields<'_>, payload: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&fields.lsn.0.to_le_bytes());
    out.extend_from_slice(&fields.sequence_nr.0.to_le_bytes());
    out.extend_from_slice(&fields.writer_epoch.0.to_le_bytes());
    out.extend_from_slice(&fields.timestamp_ms.to_le_bytes());
    out.extend_from_slice(&(fields.persistence_id.len() as u16).to_le_bytes());
    out.push(fields.kind.to_byte());
    out.push(0);
    out.extend_from_slice(fields.persistence_id);
    let crc = crc32c::crc32c(&out[0..4]);
    let crc = crc32c::crc32c_append(crc, &out[8..]);
    let crc = crc32c::crc32c_append(crc, payload);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
}

/// One record, borrowed from the segment bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordView<'a> {
    /// Offset of the record's first byte in its segment.
    pub offset: u64,
    /// Encoded length (header + id + payload), in bytes.
    pub len_bytes: u64,
    /// The record's LSN.
    pub lsn: Lsn,
    /// Event: its sequence number; deletion marker: deleted up to this.
    pub sequence_nr: SequenceNr,
    /// The writer epoch it was appended with.
    pub writer_epoch: WriterEpoch,
    /// Append time, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// Event or deletion marker.
    pub kind: RecordKind,
    /// The persistence id's bytes (validated UTF-8, 1..=1024 bytes).
    pub persistence_id: &'a [u8],
    /// The payload.
    pub payload: &'a [u8],
}

/// Why the bytes at an offset are not a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// Fewer bytes remain than a record header, and they are not all zero.
    #[error("partial record header")]
    PartialHeader,
    /// The header's lengths point past the end of the segment.
    #[error("record length runs past the end of the segment")]
    PastEnd,
    /// The persistence id length is 0 or above 1024.
    #[error("persistence id length out of range")]
    BadIdLength,
    /// The kind byte or the reserved byte has an unknown value.
    #[error("unknown record kind")]
    BadKind,
    /// The CRC32C does not match.
    #[error("record checksum mismatch")]
    BadChecksum,
    /// The persistence id is not UTF-8.
    #[error("persistence id is not UTF-8")]
    BadId,
}

/// The outcome of decoding at one offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decoded<'a> {
    /// A valid record.
    Record(RecordView<'a>),
    /// Unwritten space: the header (or whatever is left) is all zeros.
    End,
    /// Not a valid record.
    Invalid(RecordError),
}

/// Decodes the record starting at `offset` in `seg` (a whole segment's
/// bytes). Never panics; never reads beyond `seg`.
pub fn decode_record(seg: &[u8], offset: u64) -> Decoded<'_> {
    let Ok(start) = usize::try_from(offset) else {
        return Decoded::Invalid(RecordError::PastEnd);
    };
    let Some(rest) = seg.get(start..) else {
        return Decoded::Invalid(RecordError::PastEnd);
    };
    let Some(h) = rest.get(..RECORD_HEADER_LEN_BYTES) else {
        if rest.iter().all(|&b| b == 0) {
            return Decoded::End;
        }
        return Decoded::Invalid(RecordError::PartialHeader);
    };
    if h.iter().all(|&b| b == 0) {
        return Decoded::End;
    }
    let payload_len = u32_at(h, 0).unwrap_or(0) as usize;
    let crc = u32_at(h, 4).unwrap_or(0);
    let id_len = u16_at(h, 40).unwrap_or(0) as usize;
    if id_len == 0 || id_len > MAX_PERSISTENCE_ID_LEN_BYTES {
        return Decoded::Invalid(RecordError::BadIdLength);
    }
    let Some(kind) = RecordKind::from_byte(h[42]) else {
        return Decoded::Invalid(RecordError::BadKind);
    };
    if h[43] != 0 {
        return Decoded::Invalid(RecordError::BadKind);
    }
    let total = RECORD_HEADER_LEN_BYTES + id_len + payload_len;
    let Some(whole) = rest.get(..total) else {
        return Decoded::Invalid(RecordError::PastEnd);
    };
    let c = crc32c::crc32c(&whole[0..4]);
    let c = crc32c::crc32c_append(c, &whole[8..]);
    if c != crc {
        return Decoded::Invalid(RecordError::BadChecksum);
    }
    let id = &whole[RECORD_HEADER_LEN_BYTES..RECORD_HEADER_LEN_BYTES + id_len];
    if std::str::from_utf8(id).is_err() {
        return Decoded::Invalid(RecordError::BadId);
    }
    Decoded::Record(RecordView {
        offset,
        len_bytes: total as u64,
        lsn: Lsn(u64_at(h, 8).unwrap_or(0)),
        sequence_nr: SequenceNr(u64_at(h, 16).unwrap_or(0)),
        writer_epoch: WriterEpoch(u64_at(h, 24).unwrap_or(0)),
        timestamp_ms: u64_at(h, 32).unwrap_or(0),
        kind,
        persistence_id: id,
        payload: &whole[RECORD_HEADER_LEN_BYTES + id_len..],
    })
}

/// Where and why a segment scan stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanStop {
    /// The segment ends cleanly: unwritten (zero) space or its exact end.
    Clean,
    /// An invalid record at `offset`.
    Invalid {
        /// Offset of the invalid bytes in the segment.
        offset: u64,
        /// Why they are invalid.
        reason: RecordError,
        /// Whether a valid record with a higher LSN follows later in the
        /// same segment (then this is corruption, not a torn tail).
        valid_record_after: bool,
        /// Offset just past the last non-zero byte of the segment.
        last_nonzero_end: u64,
    },
    /// A record whose LSN is not the expected next one.
    LsnGap {
        /// Offset of the record.
        offset: u64,
        /// The LSN expected.
        expected: Lsn,
        /// The LSN found.
        found: Lsn,
    },
}

/// The result of scanning a segment's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanSummary {
    /// Offset just past the last valid record (where appends continue).
    pub end_offset: u64,
    /// The LSN of the last valid record, if any.
    pub last_lsn: Option<Lsn>,
    /// How many valid records were read.
    pub records: u64,
    /// Why the scan stopped.
    pub stop: ScanStop,
}

/// Scans the records of a segment whose header decoded to `first_lsn`,
/// calling `on_record` for each valid one in order. Stops at the first
/// invalid record, at unwritten space, or at an LSN that does not follow
/// its predecessor. Never panics; runs in time linear in `seg.len()` plus,
/// after an invalid record, a search for a later valid record that checks
/// at most one candidate per byte offset (a candidate must have a plausible
/// LSN before its checksum is computed).
pub fn scan_records<'a>(
    seg: &'a [u8],
    first_lsn: Lsn,
    mut on_record: impl FnMut(&RecordView<'a>),
) -> ScanSummary {
    let mut offset = SEGMENT_HEADER_LEN_BYTES as u64;
    let mut expected = first_lsn;
    let mut records = 0u64;
    let mut last_lsn = None;
    loop {
        match decode_record(seg, offset) {
            Decoded::Record(r) => {
                if r.lsn != expected {
                    return ScanSummary {
                        end_offset: offset,
                        last_lsn,
                        records,
                        stop: ScanStop::LsnGap {
                            offset,
                            expected,
                            found: r.lsn,
                        },
                    };
                }
                on_record(&r);
                records += 1;
                last_lsn = Some(r.lsn);
                expected = Lsn(r.lsn.0.saturating_add(1));
                offset += r.len_bytes;
            }
            Decoded::End => {
                let last_nonzero_end = last_nonzero_end(seg);
                if last_nonzero_end <= offset {
                    return ScanSummary {
                        end_offset: offset,
                        last_lsn,
                        records,
                        stop: ScanStop::Clean,
                    };
                }
                // Zeros here but bytes later: a hole (e.g. a zeroed page).
                return ScanSummary {
                    end_offset: offset,
                    last_lsn,
                    records,
                    stop: ScanStop::Invalid {
                        offset,
                        reason: RecordError::PartialHeader,
                        valid_record_after: valid_record_after(seg, offset, expected),
                        last_nonzero_end,
                    },
                };
            }
            Decoded::Invalid(reason) => {
                return ScanSummary {
                    end_offset: offset,
                    last_lsn,
                    records,
                    stop: ScanStop::Invalid {
                        offset,
                        reason,
                        valid_record_after: valid_record_after(seg, offset, expected),
                        last_nonzero_end: last_nonzero_end(seg),
                    },
                };
            }
        }
    }
}

/// Offset just past the last non-zero byte of `seg` (at least the header
/// length).
///
/// The tail of a segment is usually megabytes of preallocated zeros (every
/// recovery, and every reader opening a live writer's journal, looks past
/// the last record), so it is scanned backwards 64 bytes at a time, OR-ing
/// eight words, and only the block holding the last non-zero byte is
/// looked at byte by byte (a 16 MiB zero tail: 0.2 ms instead of 4.2 ms
/// byte-wise, measured on the 2-vCPU development VM).
pub fn last_nonzero_end(seg: &[u8]) -> u64 {
    const BLOCK: usize = 64;
    let in_bytes = |s: &[u8]| s.iter().rposition(|&b| b != 0);
    let whole = seg.len() - seg.len() % BLOCK;
    let end = match in_bytes(&seg[whole..]) {
        Some(p) => whole + p + 1,
        None => {
            let mut end = 0;
            let mut at = whole;
            while at > 0 {
                let block = &seg[at - BLOCK..at];
                let any = block.chunks_exact(8).fold(0u64, |acc, w| {
                    acc | u64::from_ne_bytes(w.try_into().unwrap_or([0; 8]))
                });
                if any != 0 {
                    end = at - BLOCK + in_bytes(block).map_or(0, |p| p + 1);
                    break;
                }
                at -= BLOCK;
            }
            end
        }
    };
    end.max(SEGMENT_HEADER_LEN_BYTES.min(seg.len())) as u64
}

/// Whether some offset after `from` holds a valid record with an LSN at
/// least `min_lsn` (and not absurdly far beyond it).
fn valid_record_after(seg: &[u8], from: u64, min_lsn: Lsn) -> bool {
    let Ok(from) = usize::try_from(from) else {
        return false;
    };
    // A record takes at least RECORD_HEADER_LEN_BYTES + 1 bytes, so no more
    // than this many records fit after `from`.
    let max_records = (seg.len() / (RECORD_HEADER_LEN_BYTES + 1)) as u64 + 1;
    let max_lsn = min_lsn.0.saturating_add(max_records);
    let mut at = from + 1;
    while at + RECORD_HEADER_LEN_BYTES <= seg.len() {
        let lsn = u64_at(seg, at + 8).unwrap_or(0);
        if lsn >= min_lsn.0 && lsn <= max_lsn {
            if let Decoded::Record(_) = decode_record(seg, at as u64) {
                return true;
            }
        }
        at += 1;
    }
    false
}

/// Per persistence id summary of one sealed segment, stored in its index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexEntry {
    /// Highest writer epoch among this id's records in the segment.
    pub max_epoch: WriterEpoch,
    /// Highest event sequence number in the segment (0 when none).
    pub last_event_seq: SequenceNr,
    /// Highest deletion marker in the segment (0 when none).
    pub deleted_to: SequenceNr,
    /// The id's events in the segment, in order: (sequence number, offset).
    pub events: Vec<(SequenceNr, u32)>,
}

/// The decoded index file of a sealed segment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SegmentIndexFile {
    /// The segment's id (first LSN).
    pub segment_id: Lsn,
    /// The writer epoch from the segment header.
    pub writer_epoch: WriterEpoch,
    /// Offset just past the segment's last record.
    pub end_offset: u64,
    /// LSN of the last record (segment id - 1 when the segment is empty).
    pub last_lsn: Lsn,
    /// Number of records (events and deletion markers).
    pub records: u64,
    /// Per persistence id entries, sorted by id.
    pub entries: Vec<(PersistenceId, IndexEntry)>,
}

/// Why an index, checkpoint or snapshot file was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FileDecodeError {
    /// Wrong magic bytes.
    #[error("wrong magic bytes")]
    BadMagic,
    /// Unsupported format version.
    #[error("unsupported format version {0}")]
    UnsupportedVersion(u32),
    /// The CRC32C over the file does not match.
    #[error("checksum mismatch")]
    BadChecksum,
    /// A length field points past the end of the file, or fields are
    /// missing.
    #[error("truncated or malformed at byte {0}")]
    Malformed(u64),
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FileDecodeError> {
        let end = self
            .at
            .checked_add(n)
            .ok_or(FileDecodeError::Malformed(self.at as u64))?;
        let s = self
            .b
            .get(self.at..end)
            .ok_or(FileDecodeError::Malformed(self.at as u64))?;
        self.at = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, FileDecodeError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }
    fn u32(&mut self) -> Result<u32, FileDecodeError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self) -> Result<u64, FileDecodeError> {
        let s = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
    fn pid(&mut self) -> Result<PersistenceId, FileDecodeError> {
        let at = self.at as u64;
        let n = self.u16()? as usize;
        let s = self.take(n)?;
        PersistenceId::from_bytes(s).map_err(|_| FileDecodeError::Malformed(at))
    }
    fn remaining(&self) -> usize {
        self.b.len().saturating_sub(self.at)
    }
}

/// Whether a segment header of any format version holds its checksum: the
/// header length at offset 12 (at least 20 bytes, within `bytes`) and the
/// CRC32C of the header's bytes before its last 4 in those 4.
fn checksum_of_any_version_holds(bytes: &[u8]) -> bool {
    let Some(len) = u32_at(bytes, 12).and_then(|l| usize::try_from(l).ok()) else {
        return false;
    };
    if len < 20 || len > bytes.len() {
        return false;
    }
    u32_at(bytes, len - 4).is_some_and(|crc| crc32c::crc32c(&bytes[..len - 4]) == crc)
}

/// Checks magic, version and the trailing CRC32C of a small file and returns
/// the body between the 16-byte preamble and the CRC. A version other than
/// this build's is [`FileDecodeError::UnsupportedVersion`] only when the
/// trailing CRC holds (every version ends its small files with one), and
/// [`FileDecodeError::BadChecksum`] otherwise: a flipped bit in the version
/// field is damage, not a newer format.
fn open_checked<'a>(bytes: &'a [u8], magic: &[u8; 8]) -> Result<&'a [u8], FileDecodeError> {
    if bytes.len() < 20 {
        return Err(FileDecodeError::Malformed(bytes.len() as u64));
    }
    if bytes[0..8] != *magic {
        return Err(FileDecodeError::BadMagic);
    }
    let version = u32_at(bytes, 8).unwrap_or(0);
    let crc_at = bytes.len() - 4;
    let crc = u32_at(bytes, crc_at).unwrap_or(0);
    let crc_holds = crc32c::crc32c(&bytes[..crc_at]) == crc;
    if version != FORMAT_VERSION && crc_holds {
        return Err(FileDecodeError::UnsupportedVersion(version));
    }
    if !crc_holds {
        return Err(FileDecodeError::BadChecksum);
    }
    Ok(&bytes[16..crc_at])
}

fn preamble(magic: &[u8; 8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(magic);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out
}

fn seal(mut out: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn put_pid(out: &mut Vec<u8>, pid: &PersistenceId) {
    out.extend_from_slice(&(pid.as_bytes().len() as u16).to_le_bytes());
    out.extend_from_slice(pid.as_bytes());
}

/// Writes an index file (FORMAT.md, "Index file") entry by entry, so that
/// a sealed segment's in-memory index is encoded straight from its
/// entries (see `SegmentIndex::encode_file`) with the same bytes as
/// [`SegmentIndexFile::encode`], which uses it too.
pub(crate) struct IndexFileWriter {
    out: Vec<u8>,
}

/// Bytes of an index entry apart from its id and its events: the id's
/// length (2), max epoch, last event and deletion sequence numbers (8
/// each) and the event count (4).
pub(crate) const INDEX_ENTRY_FIXED_BYTES: usize = 2 + 8 + 8 + 8 + 4;

/// Bytes of one event of an index entry: sequence number (8), offset (4).
pub(crate) const INDEX_EVENT_BYTES: usize = 12;

impl IndexFileWriter {
    /// Starts a file of `entries` entries (count) with these header fields;
    /// `capacity_bytes` is the whole file's size when known (0 otherwise),
    /// allocated at once.
    pub(crate) fn new(
        header: (Lsn, WriterEpoch, u64, Lsn, u64),
        entries: u32,
        capacity_bytes: usize,
    ) -> Self {
        let (segment_id, writer_epoch, end_offset, last_lsn, records) = header;
        let mut out = preamble(&INDEX_MAGIC);
        out.reserve(capacity_bytes.saturating_sub(out.len()));
        out.extend_from_slice(&segment_id.0.to_le_bytes());
        out.extend_from_slice(&writer_epoch.0.to_le_bytes());
        out.extend_from_slice(&end_offset.to_le_bytes());
        out.extend_from_slice(&last_lsn.0.to_le_bytes());
        out.extend_from_slice(&records.to_le_bytes());
        out.extend_from_slice(&entries.to_le_bytes());
        IndexFileWriter { out }
    }

    /// Bytes before the first entry, with the trailing checksum (4): what
    /// a file takes apart from its entries.
    pub(crate) const FRAME_BYTES: usize = 16 + 8 * 5 + 4 + 4;

    /// Appends the entry of `pid` (entries go in id order): `n` events,
    /// `events` in order.
    pub(crate) fn entry(
        &mut self,
        pid: &str,
        (max_epoch, last_event_seq, deleted_to): (WriterEpoch, SequenceNr, SequenceNr),
        n: u32,
        events: impl Iterator<Item = (SequenceNr, u32)>,
    ) {
        let out = &mut self.out;
        out.extend_from_slice(&(pid.len() as u16).to_le_bytes());
        out.extend_from_slice(pid.as_bytes());
        out.extend_from_slice(&max_epoch.0.to_le_bytes());
        out.extend_from_slice(&last_event_seq.0.to_le_bytes());
        out.extend_from_slice(&deleted_to.0.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        for (seq, off) in events {
            out.extend_from_slice(&seq.0.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
    }

    /// The file's bytes, checksum appended.
    pub(crate) fn finish(self) -> Vec<u8> {
        seal(self.out)
    }
}

impl SegmentIndexFile {
    /// Encodes the index file (FORMAT.md, "Index file").
    pub fn encode(&self) -> Vec<u8> {
        let mut w = IndexFileWriter::new(
            (
                self.segment_id,
                self.writer_epoch,
                self.end_offset,
                self.last_lsn,
                self.records,
            ),
            self.entries.len() as u32,
            0,
        );
        for (pid, e) in &self.entries {
            w.entry(
                pid.as_str(),
                (e.max_epoch, e.last_event_seq, e.deleted_to),
                e.events.len() as u32,
                e.events.iter().copied(),
            );
        }
        w.finish()
    }

    /// Decodes an index file's summary fields alone (magic, version and
    /// checksum checked), its entries left out (`entries` empty): what
    /// recovery keeps of a file it reads in place.
    ///
    /// # Errors
    /// As [`SegmentIndexFile::decode`] for the preamble, checksum and
    /// fields.
    pub(crate) fn decode_summary(bytes: &[u8]) -> Result<Self, FileDecodeError> {
        let body = open_checked(bytes, &INDEX_MAGIC)?;
        let mut c = Cursor { b: body, at: 0 };
        Ok(SegmentIndexFile {
            segment_id: Lsn(c.u64()?),
            writer_epoch: WriterEpoch(c.u64()?),
            end_offset: c.u64()?,
            last_lsn: Lsn(c.u64()?),
            records: c.u64()?,
            entries: Vec::new(),
        })
    }

    /// Decodes an index file.
    ///
    /// # Errors
    /// A [`FileDecodeError`] for a wrong magic, version, checksum or a
    /// length that runs past the end. Counts are checked against the bytes
    /// left before anything is allocated.
    pub fn decode(bytes: &[u8]) -> Result<Self, FileDecodeError> {
        let body = open_checked(bytes, &INDEX_MAGIC)?;
        let mut c = Cursor { b: body, at: 0 };
        let segment_id = Lsn(c.u64()?);
        let writer_epoch = WriterEpoch(c.u64()?);
        let end_offset = c.u64()?;
        let last_lsn = Lsn(c.u64()?);
        let records = c.u64()?;
        let n = c.u32()? as usize;
        // Each entry takes at least 2 + 1 + 8 + 8 + 8 + 4 bytes.
        if n > c.remaining() / 31 {
            return Err(FileDecodeError::Malformed(c.at as u64));
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let pid = c.pid()?;
            let max_epoch = WriterEpoch(c.u64()?);
            let last_event_seq = SequenceNr(c.u64()?);
            let deleted_to = SequenceNr(c.u64()?);
            let k = c.u32()? as usize;
            if k > c.remaining() / 12 {
                return Err(FileDecodeError::Malformed(c.at as u64));
            }
            let mut events = Vec::with_capacity(k);
            for _ in 0..k {
                events.push((SequenceNr(c.u64()?), c.u32()?));
            }
            entries.push((
                pid,
                IndexEntry {
                    max_epoch,
                    last_event_seq,
                    deleted_to,
                    events,
                },
            ));
        }
        if c.remaining() != 0 {
            return Err(FileDecodeError::Malformed(c.at as u64));
        }
        Ok(SegmentIndexFile {
            segment_id,
            writer_epoch,
            end_offset,
            last_lsn,
            records,
            entries,
        })
    }
}

/// Offset of an index file's first entry, in bytes: the 16-byte preamble,
/// five `u64` summary fields and the entry count.
pub(crate) const INDEX_ENTRIES_AT: usize = 16 + 5 * 8 + 4;

/// One entry of an index file read in place (FORMAT.md, "Index file"),
/// without allocating: what a sealed segment's index keeps in memory once
/// its file is durable is only where each entry starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexEntryView<'a> {
    /// The persistence id's bytes.
    pub(crate) pid: &'a [u8],
    /// Highest writer epoch among the id's records in the segment.
    pub(crate) max_epoch: WriterEpoch,
    /// Highest event sequence number in the segment (0 when none).
    pub(crate) last_event_seq: SequenceNr,
    /// Highest deletion marker in the segment (0 when none).
    pub(crate) deleted_to: SequenceNr,
    /// The events, 12 bytes each: sequence number `u64`, offset `u32`.
    events: &'a [u8],
}

impl IndexEntryView<'_> {
    /// Number of events.
    pub(crate) fn event_count(&self) -> usize {
        self.events.len() / INDEX_EVENT_BYTES
    }

    /// Event `i` (sequence number, offset in the segment); `i` below
    /// [`IndexEntryView::event_count`].
    pub(crate) fn event(&self, i: usize) -> (SequenceNr, u32) {
        let at = i * INDEX_EVENT_BYTES;
        (
            SequenceNr(u64_at(self.events, at).unwrap_or(0)),
            u32_at(self.events, at + 8).unwrap_or(0),
        )
    }

    /// The events with a sequence number at least `from`, in order (an
    /// entry lists them in increasing order: checked when the file is
    /// opened, see `recovery::events_in_order`).
    pub(crate) fn since(&self, from: SequenceNr) -> impl Iterator<Item = (SequenceNr, u32)> + '_ {
        let n = self.event_count();
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.event(mid).0 < from {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo..n).map(move |i| self.event(i))
    }
}

/// The entry count of index file `bytes` and where its entries end (the
/// trailing CRC's offset). Only the lengths are checked: the file's
/// checksum was checked when it was written or opened.
///
/// # Errors
/// [`FileDecodeError::Malformed`] when the file is shorter than its fixed
/// fields.
pub(crate) fn index_entries(bytes: &[u8]) -> Result<(u32, usize), FileDecodeError> {
    let end = bytes
        .len()
        .checked_sub(4)
        .filter(|&e| e >= INDEX_ENTRIES_AT)
        .ok_or(FileDecodeError::Malformed(bytes.len() as u64))?;
    let n = u32_at(bytes, INDEX_ENTRIES_AT - 4).ok_or(FileDecodeError::Malformed(0))?;
    Ok((n, end))
}

/// Reads the index entry at byte `at` of index file `bytes` whose entries
/// end at `end` (from [`index_entries`]); returns it and where the next
/// one starts. Every length is checked against `end`.
///
/// # Errors
/// [`FileDecodeError::Malformed`] when a length runs past `end` or the id
/// is empty.
pub(crate) fn index_entry_at(
    bytes: &[u8],
    at: usize,
    end: usize,
) -> Result<(IndexEntryView<'_>, usize), FileDecodeError> {
    let body = bytes
        .get(..end)
        .ok_or(FileDecodeError::Malformed(at as u64))?;
    let mut c = Cursor { b: body, at };
    let n = c.u16()? as usize;
    if n == 0 {
        return Err(FileDecodeError::Malformed(at as u64));
    }
    let pid = c.take(n)?;
    let max_epoch = WriterEpoch(c.u64()?);
    let last_event_seq = SequenceNr(c.u64()?);
    let deleted_to = SequenceNr(c.u64()?);
    let k = c.u32()? as usize;
    let len = k
        .checked_mul(INDEX_EVENT_BYTES)
        .ok_or(FileDecodeError::Malformed(c.at as u64))?;
    let events = c.take(len)?;
    Ok((
        IndexEntryView {
            pid,
            max_epoch,
            last_event_seq,
            deleted_to,
            events,
        },
        c.at,
    ))
}

/// Per persistence id state kept in the checkpoint (survives removal of the
/// segments that held it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PidCheckpoint {
    /// Highest event sequence number ever appended.
    pub last_seq: SequenceNr,
    /// Highest writer epoch ever recorded.
    pub max_epoch: WriterEpoch,
    /// Events up to this sequence number are deleted.
    pub deleted_to: SequenceNr,
}

/// The state checkpoint file (FORMAT.md, "Checkpoint").
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Checkpoint {
    /// Highest segment writer epoch seen in the directory.
    pub max_segment_epoch: WriterEpoch,
    /// Highest LSN of any removed segment (the next LSN is above it).
    pub removed_up_to_lsn: Lsn,
    /// Per persistence id state, sorted by id.
    pub pids: Vec<(PersistenceId, PidCheckpoint)>,
}

impl Checkpoint {
    /// Encodes the checkpoint.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = preamble(&CHECKPOINT_MAGIC);
        out.extend_from_slice(&self.max_segment_epoch.0.to_le_bytes());
        out.extend_from_slice(&self.removed_up_to_lsn.0.to_le_bytes());
        out.extend_from_slice(&(self.pids.len() as u32).to_le_bytes());
        for (pid, p) in &self.pids {
            put_pid(&mut out, pid);
            out.extend_from_slice(&p.last_seq.0.to_le_bytes());
            out.extend_from_slice(&p.max_epoch.0.to_le_bytes());
            out.extend_from_slice(&p.deleted_to.0.to_le_bytes());
        }
        seal(out)
    }

    /// Decodes the checkpoint's summary fields alone (checksum checked),
    /// its per-id state left out (`pids` empty): what a read-only view
    /// brought up to date needs when it read every segment the checkpoint
    /// covers.
    ///
    /// # Errors
    /// As [`Checkpoint::decode`] for the preamble, checksum and fields.
    pub(crate) fn decode_summary(bytes: &[u8]) -> Result<Self, FileDecodeError> {
        let body = open_checked(bytes, &CHECKPOINT_MAGIC)?;
        let mut c = Cursor { b: body, at: 0 };
        Ok(Checkpoint {
            max_segment_epoch: WriterEpoch(c.u64()?),
            removed_up_to_lsn: Lsn(c.u64()?),
            pids: Vec::new(),
        })
    }

    /// Decodes the checkpoint.
    ///
    /// # Errors
    /// A [`FileDecodeError`] as for [`SegmentIndexFile::decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, FileDecodeError> {
        let body = open_checked(bytes, &CHECKPOINT_MAGIC)?;
        let mut c = Cursor { b: body, at: 0 };
        let max_segment_epoch = WriterEpoch(c.u64()?);
        let removed_up_to_lsn = Lsn(c.u64()?);
        let n = c.u32()? as usize;
        if n > c.remaining() / 27 {
            return Err(FileDecodeError::Malformed(c.at as u64));
        }
        let mut pids = Vec::with_capacity(n);
        for _ in 0..n {
            let pid = c.pid()?;
            pids.push((
                pid,
                PidCheckpoint {
                    last_seq: SequenceNr(c.u64()?),
                    max_epoch: WriterEpoch(c.u64()?),
                    deleted_to: SequenceNr(c.u64()?),
                },
            ));
        }
        if c.remaining() != 0 {
            return Err(FileDecodeError::Malformed(c.at as u64));
        }
        Ok(Checkpoint {
            max_segment_epoch,
            removed_up_to_lsn,
            pids,
        })
    }
}

/// A snapshot of one persistence id's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// The persistence id.
    pub persistence_id: PersistenceId,
    /// The sequence number of the last event the snapshot includes; replay
    /// resumes after it.
    pub sequence_nr: SequenceNr,
    /// The writer epoch that saved it.
    pub writer_epoch: WriterEpoch,
    /// Save time, milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    /// The snapshot's bytes (opaque to the journal).
    pub data: Vec<u8>,
}

impl Snapshot {
    /// Encodes the snapshot file (FORMAT.md, "Snapshot file").
    pub fn encode(&self) -> Vec<u8> {
        let mut out = preamble(&SNAPSHOT_MAGIC);
        put_pid(&mut out, &self.persistence_id);
        out.extend_from_slice(&self.sequence_nr.0.to_le_bytes());
        out.extend_from_slice(&self.writer_epoch.0.to_le_bytes());
        out.extend_from_slice(&self.timestamp_ms.to_le_bytes());
        out.extend_from_slice(&(self.data.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.data);
        seal(out)
    }

    /// Decodes a snapshot file.
    ///
    /// # Errors
    /// A [`FileDecodeError`] as for [`SegmentIndexFile::decode`].
    pub fn decode(bytes: &[u8]) -> Result<Self, FileDecodeError> {
        let body = open_checked(bytes, &SNAPSHOT_MAGIC)?;
        let mut c = Cursor { b: body, at: 0 };
        let persistence_id = c.pid()?;
        let sequence_nr = SequenceNr(c.u64()?);
        let writer_epoch = WriterEpoch(c.u64()?);
        let timestamp_ms = c.u64()?;
        let len = c.u64()?;
        if len != c.remaining() as u64 {
            return Err(FileDecodeError::Malformed(c.at as u64));
        }
        let data = c.take(c.remaining())?.to_vec();
        Ok(Snapshot {
            persistence_id,
            sequence_nr,
            writer_epoch,
            timestamp_ms,
            data,
        })
    }
}

/// What one slot of the snapshot table holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TableSlot {
    /// Never written (its length is 0).
    Empty,
    /// A snapshot whose encoding checks, and the slot's write serial (the
    /// table's writes count up: the higher serial is the newer write).
    Valid(Snapshot, u64),
    /// Bytes that do not decode: a write torn by a crash before the table
    /// was synced, or damage.
    Unreadable,
}

/// Encodes snapshot encoding `encoded` as one table slot written with
/// `serial`: length `u32` LE | serial `u64` LE | the encoding | CRC32C
/// `u32` LE of everything before it | zeros to [`TABLE_SLOT_BYTES`].
/// `None` when `encoded` is empty or longer than
/// [`TABLE_SNAPSHOT_MAX_BYTES`].
pub(crate) fn encode_table_slot(encoded: &[u8], serial: u64) -> Option<[u8; TABLE_SLOT_BYTES]> {
    let n = encoded.len();
    if n == 0 || n > TABLE_SNAPSHOT_MAX_BYTES {
        return None;
    }
    let mut slot = [0u8; TABLE_SLOT_BYTES];
    slot[..4].copy_from_slice(&(n as u32).to_le_bytes());
    slot[4..12].copy_from_slice(&serial.to_le_bytes());
    slot[12..12 + n].copy_from_slice(encoded);
    let crc = crc32c::crc32c(&slot[..12 + n]);
    slot[12 + n..16 + n].copy_from_slice(&crc.to_le_bytes());
    Some(slot)
}

/// Decodes one table slot (`slot`: [`TABLE_SLOT_BYTES`] bytes, or fewer at
/// the end of the file, the rest taken as zeros).
pub(crate) fn decode_table_slot(slot: &[u8]) -> TableSlot {
    let len = u32_at(slot, 0).unwrap_or(0) as usize;
    if len == 0 {
        return TableSlot::Empty;
    }
    if len > TABLE_SNAPSHOT_MAX_BYTES || slot.len() < 16 + len {
        return TableSlot::Unreadable;
    }
    let crc = u32_at(slot, 12 + len).unwrap_or(0);
    if crc32c::crc32c(&slot[..12 + len]) != crc {
        return TableSlot::Unreadable;
    }
    let serial = u64::from_le_bytes(slot[4..12].try_into().unwrap_or([0; 8]));
    match Snapshot::decode(&slot[12..12 + len]) {
        Ok(s) => TableSlot::Valid(s, serial),
        Err(_) => TableSlot::Unreadable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_nonzero_end_matches_a_byte_scan() {
        let naive = |seg: &[u8]| {
            let end = seg.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
            end.max(SEGMENT_HEADER_LEN_BYTES.min(seg.len())) as u64
        };
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for len in [0usize, 1, 7, 63, 64, 65, 127, 128, 129, 1000, 4096, 4099] {
            let zeros = vec![0u8; len];
            assert_eq!(last_nonzero_end(&zeros), naive(&zeros), "zeros of {len}");
            for at in 0..len.min(300) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let mut seg = vec![0u8; len];
                let p = (x as usize) % len;
                seg[p] = (x >> 32) as u8 | 1;
                if at % 3 == 0 && p > 0 {
                    seg[p / 2] = 0xff;
                }
                assert_eq!(
                    last_nonzero_end(&seg),
                    naive(&seg),
                    "len {len}, byte at {p}"
                );
            }
        }
    }

    fn seg_with(records: &[(&str, u64, &[u8])], size: usize) -> Vec<u8> {
        let mut seg = vec![0u8; size];
        let h = SegmentHeader {
            segment_id: Lsn(1),
            writer_epoch: WriterEpoch(1),
            segment_size_bytes: size as u64,
            created_ms: 0,
        };
        seg[..64].copy_from_slice(&h.encode());
        let mut at = 64;
        let mut head = Vec::new();
        for (i, (pid, seq, payload)) in records.iter().enumerate() {
            let f = RecordFields {
                lsn: Lsn(i as u64 + 1),
                sequence_nr: SequenceNr(*seq),
                writer_epoch: WriterEpoch(1),
                timestamp_ms: 5,
                kind: RecordKind::Event,
                persistence_id: pid.as_bytes(),
            };
            encode_record_head(&f, payload, &mut head);
            seg[at..at + head.len()].copy_from_slice(&head);
            at += head.len();
            seg[at..at + payload.len()].copy_from_slice(payload);
            at += payload.len();
        }
        seg
    }

    #[test]
    fn header_roundtrip_and_checks() {
        let h = SegmentHeader {
            segment_id: Lsn(42),
            writer_epoch: WriterEpoch(7),
            segment_size_bytes: 4096,
            created_ms: 99,
        };
        let b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        assert_eq!(
            SegmentHeader::decode(&b[..10]),
            Err(HeaderError::TooShort { len_bytes: 10 })
        );
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(SegmentHeader::decode(&bad), Err(HeaderError::BadMagic));
        // A newer format: another version, its own checksum holding.
        let mut newer = b;
        newer[8] = 2;
        let crc = crc32c::crc32c(&newer[..60]);
        newer[60..64].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            SegmentHeader::decode(&newer),
            Err(HeaderError::UnsupportedVersion { version: 2 })
        );
        // A flipped bit in the version field: damage.
        let mut bad = b;
        bad[8] = 2;
        assert_eq!(SegmentHeader::decode(&bad), Err(HeaderError::BadChecksum));
        let mut bad = b;
        bad[20] ^= 1;
        assert_eq!(SegmentHeader::decode(&bad), Err(HeaderError::BadChecksum));
        assert_eq!(SegmentHeader::decode(&[0u8; 64]), Err(HeaderError::Zeroed));
    }

    #[test]
    fn scan_reads_records_and_stops_clean() {
        let seg = seg_with(&[("a", 1, b"x"), ("b", 1, b""), ("a", 2, b"yz")], 1024);
        let mut seen = Vec::new();
        let s = scan_records(&seg, Lsn(1), |r| {
            seen.push((
                r.persistence_id.to_vec(),
                r.sequence_nr.0,
                r.payload.to_vec(),
            ))
        });
        assert_eq!(s.records, 3);
        assert_eq!(s.stop, ScanStop::Clean);
        assert_eq!(s.last_lsn, Some(Lsn(3)));
        assert_eq!(seen[2], (b"a".to_vec(), 2, b"yz".to_vec()));
    }

    #[test]
    fn scan_flags_corruption_with_valid_records_after() {
        let mut seg = seg_with(
            &[("a", 1, b"xxxx"), ("a", 2, b"yyyy"), ("a", 3, b"z")],
            1024,
        );
        // Flip a payload byte of the first record.
        seg[64 + RECORD_HEADER_LEN_BYTES + 1] ^= 0x10;
        let s = scan_records(&seg, Lsn(1), |_| {});
        match s.stop {
            ScanStop::Invalid {
                offset,
                reason,
                valid_record_after,
                ..
            } => {
                assert_eq!(offset, 64);
                assert_eq!(reason, RecordError::BadChecksum);
                assert!(valid_record_after);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn scan_of_torn_last_record_is_tail() {
        let mut seg = seg_with(&[("a", 1, b"xxxx"), ("a", 2, b"yyyy")], 1024);
        let second = 64 + RECORD_HEADER_LEN_BYTES + 1 + 4;
        seg[second + RECORD_HEADER_LEN_BYTES + 2] = 0; // torn payload
        seg[second + RECORD_HEADER_LEN_BYTES + 3] = 0;
        let s = scan_records(&seg, Lsn(1), |_| {});
        assert_eq!(s.records, 1);
        assert!(matches!(
            s.stop,
            ScanStop::Invalid {
                valid_record_after: false,
                ..
            }
        ));
    }

    #[test]
    fn a_small_file_of_another_version_is_newer_only_when_its_crc_holds() {
        let c = Checkpoint {
            max_segment_epoch: WriterEpoch(3),
            removed_up_to_lsn: Lsn(7),
            pids: vec![],
        };
        let b = c.encode();
        assert_eq!(Checkpoint::decode(&b), Ok(c));
        // A flipped bit in the version field: damage.
        let mut bad = b.clone();
        bad[8] ^= 2;
        assert_eq!(Checkpoint::decode(&bad), Err(FileDecodeError::BadChecksum));
        // A newer build's file: another version, its CRC holding.
        let mut newer = b;
        newer[8..12].copy_from_slice(&2u32.to_le_bytes());
        let at = newer.len() - 4;
        let crc = crc32c::crc32c(&newer[..at]);
        newer[at..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            Checkpoint::decode(&newer),
            Err(FileDecodeError::UnsupportedVersion(2))
        );
    }

    #[test]
    fn index_checkpoint_snapshot_roundtrip() {
        let pid = PersistenceId::new("p").unwrap();
        let idx = SegmentIndexFile {
            segment_id: Lsn(1),
            writer_epoch: WriterEpoch(3),
            end_offset: 500,
            last_lsn: Lsn(9),
            records: 9,
            entries: vec![(
                pid.clone(),
                IndexEntry {
                    max_epoch: WriterEpoch(3),
                    last_event_seq: SequenceNr(9),
                    deleted_to: SequenceNr(2),
                    events: vec![(SequenceNr(1), 64), (SequenceNr(2), 100)],
                },
            )],
        };
        assert_eq!(SegmentIndexFile::decode(&idx.encode()), Ok(idx.clone()));
        let mut bad = idx.encode();
        bad[30] ^= 1;
        assert_eq!(
            SegmentIndexFile::decode(&bad),
            Err(FileDecodeError::BadChecksum)
        );
        let chk = Checkpoint {
            max_segment_epoch: WriterEpoch(2),
            removed_up_to_lsn: Lsn(7),
            pids: vec![(pid.clone(), PidCheckpoint::default())],
        };
        assert_eq!(Checkpoint::decode(&chk.encode()), Ok(chk));
        let snap = Snapshot {
            persistence_id: pid,
            sequence_nr: SequenceNr(4),
            writer_epoch: WriterEpoch(1),
            timestamp_ms: 3,
            data: b"state".to_vec(),
        };
        assert_eq!(Snapshot::decode(&snap.encode()), Ok(snap));
    }
}
