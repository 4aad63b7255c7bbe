//! The coordinator's journal on the control core.
//!
//! Every node owns one journal (`shardline-journal`) in
//! `{data_dir}/control`, written only by its control executor. While this
//! node runs the ShardCoordinator singleton, each coordinator (one per entity
//! type) appends its events ([`CoordinatorEvent`]) under the persistence id
//! `coordinator|{type}` ([`persistence_id`]), with the writer epoch of its
//! incarnation.
//!
//! An incarnation starts by recovering ([`ControlJournal::recover`]): the
//! node's own control journal and every other `*/control` directory under
//! the data root (the parent of `data_dir`, shared by the nodes of one
//! machine) whose `data_dir` records this node's cluster (name and id, see
//! [`super::identity`]), the others read-only
//! ([`shardline_journal::JournalReader`]). Journals of another cluster are
//! never read.
//! The journal whose records carry the highest writer epoch holds the newest
//! state. The new incarnation takes a writer epoch above every epoch found
//! ([`next_epoch`]) and appends a *takeover* record (the full state plus the
//! recorded config, [`ControlJournal::begin`]) before any event, so its own
//! journal is sufficient from then on. A state record is also saved as a
//! journal snapshot every [`SNAPSHOT_EVERY_EVENTS`] events.
//!
//! Fencing: within one directory the journal refuses appends whose epoch is
//! below the highest recorded for the id (an earlier incarnation on the same
//! node, `AppendError::Fenced`). Across directories (a zombie coordinator on
//! another node appending to its own journal), recovery ignores every
//! journal but the one with the highest epoch, so the zombie's late appends
//! never count.
//!
//! Byte layout of a record payload (all integers little-endian):
//!
//! ```text
//! region   = addr_len u16, addr (UTF-8), uid u64, core u16
//! event    = tag u8 (1..=7), fields:
//!            1 ShardRegionRegistered       region
//!            2 ShardRegionProxyRegistered  region
//!            3 ShardRegionTerminated       region
//!            4 ShardRegionProxyTerminated  region
//!            5 ShardHomeAllocated          shard u32, region, generation u64
//!            6 ShardHomeDeallocated        shard u32, generation u64
//!            7 ShardUnallocated            shard u32
//! state    = tag u8 (0x40), version u8 (2), number_of_shards u32,
//!            hash_len u16, hash name (UTF-8), last_generation u64,
//!            regions u32 × (region, shards u32 × (shard u32, generation u64)),
//!            proxies u32 × region,
//!            unallocated u32 × shard u32        (version 2 only)
//! ```
//!
//! Version 1 state records (written before remember entities' unallocated
//! shards were recorded) are still read, with no unallocated shards.
//!
//! A snapshot's bytes are a `state` record.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use shardline_core::ids::{Address, MemberUid, RegionId, ShardId, UniqueAddress};
use shardline_core::sharding::{CoordinatorEvent, CoordinatorState, Generation};
use shardline_journal::{
    AppendError, DurabilityWatcher, Journal, JournalOptions, JournalReader, Lsn, OpenError,
    PersistenceId, Recovery, ReplayError, SequenceNr, SnapshotError, WriterEpoch,
};

/// Events between two snapshots of a coordinator's state (count).
pub const SNAPSHOT_EVERY_EVENTS: u64 = 500;

/// Segment size of the control journal, in bytes (4 MiB: tens of
/// thousands of coordinator events).
pub const CONTROL_SEGMENT_SIZE_BYTES: u64 = 4 << 20;

const TAG_STATE: u8 = 0x40;
const STATE_VERSION: u8 = 2;

/// What a coordinator's journal records about the cluster's config; a
/// coordinator whose config disagrees refuses to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// `number_of_shards` of the entity type (count).
    pub number_of_shards: u32,
    /// Name of the shard-id hash (`SHARD_ID_HASH_NAME`).
    pub hash_name: String,
}

/// Errors of the coordinator journal.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorJournalError {
    /// The control journal could not be opened.
    #[error("cannot open the control journal {dir}: {source}")]
    Open {
        /// Its directory.
        dir: PathBuf,
        /// Why.
        source: OpenError,
    },
    /// An append was refused (fenced by a newer incarnation, poisoned, I/O).
    #[error("coordinator journal append refused: {0}")]
    Append(#[from] AppendError),
    /// A snapshot could not be saved.
    #[error("coordinator snapshot refused: {0}")]
    Snapshot(#[from] SnapshotError),
    /// A journal could not be replayed.
    #[error("cannot replay the coordinator journal in {dir}: {source}")]
    Replay {
        /// Its directory.
        dir: PathBuf,
        /// Why.
        source: ReplayError,
    },
    /// A record's payload does not decode.
    #[error("corrupt coordinator record in {dir}: {reason}")]
    Corrupt {
        /// The journal's directory.
        dir: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The journal records another `number_of_shards` or shard-id hash
    /// than this node is configured with.
    #[error(
        "the coordinator journal in {dir} records number_of_shards = {recorded_shards} and hash \
         {recorded_hash:?}, but this node is configured with number_of_shards = \
         {configured_shards} and hash {configured_hash:?}; refusing to start the coordinator \
         (number_of_shards is fixed for the life of a cluster)"
    )]
    ConfigMismatch {
        /// The journal's directory.
        dir: PathBuf,
        /// Recorded number of shards.
        recorded_shards: u32,
        /// Configured number of shards.
        configured_shards: u32,
        /// Recorded hash name.
        recorded_hash: String,
        /// Configured hash name.
        configured_hash: String,
    },
    /// The entity type name does not make a valid persistence id.
    #[error("invalid coordinator persistence id for type {0:?}")]
    BadTypeName(String),
    /// No incarnation was begun for the type ([`ControlJournal::begin`]).
    #[error("no coordinator incarnation begun for type {0:?}")]
    NotBegun(String),
    /// The database (PostgreSQL backend) refused (schema too new, bad
    /// data); unavailability is retried, not returned.
    #[error("coordinator journal: {0}")]
    Database(super::pg::PgError),
}

/// The persistence id of `type_name`'s coordinator: `coordinator|{type}`.
///
/// # Errors
/// [`CoordinatorJournalError::BadTypeName`] when the id is not valid
/// (empty or too long).
pub fn persistence_id(type_name: &str) -> Result<PersistenceId, CoordinatorJournalError> {
    PersistenceId::new(&format!("coordinator|{type_name}"))
        .map_err(|_| CoordinatorJournalError::BadTypeName(type_name.to_string()))
}

/// The control journal directory under a node's `data_dir`.
pub fn control_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("control")
}

/// The writer epoch of a new coordinator incarnation: above every epoch
/// `recorded` in the journals, and at least the wall clock in milliseconds
/// since the Unix epoch (so it also grows when no journal is visible).
pub fn next_epoch(recorded: WriterEpoch, wall_clock_ms: u64) -> WriterEpoch {
    WriterEpoch(recorded.0.saturating_add(1).max(wall_clock_ms))
}

// ------------------------------------------------------------------ codec

fn put_region(out: &mut Vec<u8>, r: &RegionId) {
    let a = r.member.address.0.as_bytes();
    let len = u16::try_from(a.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&a[..usize::from(len)]);
    out.extend_from_slice(&r.member.uid.0.to_le_bytes());
    out.extend_from_slice(&r.core.to_le_bytes());
}

/// Encodes one event.
pub fn encode_event(e: &CoordinatorEvent) -> Vec<u8> {
    let mut out = Vec::with_capacity(48);
    match e {
        CoordinatorEvent::ShardRegionRegistered { region } => {
            out.push(1);
            put_region(&mut out, region);
        }
        CoordinatorEvent::ShardRegionProxyRegistered { proxy } => {
            out.push(2);
            put_region(&mut out, proxy);
        }
        CoordinatorEvent::ShardRegionTerminated { region } => {
            out.push(3);
            put_region(&mut out, region);
        }
        CoordinatorEvent::ShardRegionProxyTerminated { proxy } => {
            out.push(4);
            put_region(&mut out, proxy);
        }
        CoordinatorEvent::ShardHomeAllocated {
            shard,
            region,
            generation,
        } => {
            out.push(5);
            out.extend_from_slice(&shard.0.to_le_bytes());
            put_region(&mut out, region);
            out.extend_from_slice(&generation.0.to_le_bytes());
        }
        CoordinatorEvent::ShardUnallocated { shard } => {
            out.push(7);
            out.extend_from_slice(&shard.0.to_le_bytes());
        }
        CoordinatorEvent::ShardHomeDeallocated { shard, generation } => {
            out.push(6);
            out.extend_from_slice(&shard.0.to_le_bytes());
            out.extend_from_slice(&generation.0.to_le_bytes());
        }
    }
    out
}

/// Encodes a full state with the config it was recorded under.
pub fn encode_state(st: &CoordinatorState, cfg: &CoordinatorConfig) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + st.shards.len() * 12);
    out.push(TAG_STATE);
    out.push(STATE_VERSION);
    out.extend_from_slice(&cfg.number_of_shards.to_le_bytes());
    let h = cfg.hash_name.as_bytes();
    let hl = u16::try_from(h.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&hl.to_le_bytes());
    out.extend_from_slice(&h[..usize::from(hl)]);
    out.extend_from_slice(&st.last_generation.0.to_le_bytes());
    out.extend_from_slice(&(st.regions.len() as u32).to_le_bytes());
    for (r, shards) in &st.regions {
        put_region(&mut out, r);
        out.extend_from_slice(&(shards.len() as u32).to_le_bytes());
        for s in shards {
            let g = st.shards.get(s).map_or(0, |(_, g)| g.0);
            out.extend_from_slice(&s.0.to_le_bytes());
            out.extend_from_slice(&g.to_le_bytes());
        }
    }
    out.extend_from_slice(&(st.proxies.len() as u32).to_le_bytes());
    for p in &st.proxies {
        put_region(&mut out, p);
    }
    out.extend_from_slice(&(st.unallocated.len() as u32).to_le_bytes());
    for s in &st.unallocated {
        out.extend_from_slice(&s.0.to_le_bytes());
    }
    out
}

/// One decoded record payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CoordinatorRecord {
    /// An event.
    Event(CoordinatorEvent),
    /// A full state (takeover record or snapshot) and its config.
    State(CoordinatorState, CoordinatorConfig),
}

struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.b.len() < n {
            return Err(format!("truncated: need {n} bytes, {} left", self.b.len()));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, String> {
        let mut a = [0u8; 2];
        a.copy_from_slice(self.take(2)?);
        Ok(u16::from_le_bytes(a))
    }
    fn u32(&mut self) -> Result<u32, String> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }
    fn u64(&mut self) -> Result<u64, String> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn str(&mut self, len: usize) -> Result<String, String> {
        std::str::from_utf8(self.take(len)?)
            .map(str::to_string)
            .map_err(|e| format!("bad UTF-8: {e}"))
    }
    fn region(&mut self) -> Result<RegionId, String> {
        let len = usize::from(self.u16()?);
        let address = self.str(len)?;
        let uid = self.u64()?;
        let core = self.u16()?;
        Ok(RegionId {
            member: UniqueAddress {
                address: Address(address.into()),
                uid: MemberUid(uid),
            },
            core,
        })
    }
}

/// Decodes one record payload.
///
/// # Errors
/// A description when the bytes are truncated, have an unknown tag or
/// version, bad UTF-8, or trailing bytes. Never panics and never allocates
/// from a length it has not checked against the bytes present.
pub fn decode_record(bytes: &[u8]) -> Result<CoordinatorRecord, String> {
    let mut c = Cursor { b: bytes };
    let tag = c.u8()?;
    let rec = match tag {
        1 => CoordinatorRecord::Event(CoordinatorEvent::ShardRegionRegistered {
            region: c.region()?,
        }),
        2 => CoordinatorRecord::Event(CoordinatorEvent::ShardRegionProxyRegistered {
            proxy: c.region()?,
        }),
        3 => CoordinatorRecord::Event(CoordinatorEvent::ShardRegionTerminated {
            region: c.region()?,
        }),
        4 => CoordinatorRecord::Event(CoordinatorEvent::ShardRegionProxyTerminated {
            proxy: c.region()?,
        }),
        5 => {
            let shard = ShardId(c.u32()?);
            let region = c.region()?;
            let generation = Generation(c.u64()?);
            CoordinatorRecord::Event(CoordinatorEvent::ShardHomeAllocated {
                shard,
                region,
                generation,
            })
        }
        6 => {
            let shard = ShardId(c.u32()?);
            let generation = Generation(c.u64()?);
            CoordinatorRecord::Event(CoordinatorEvent::ShardHomeDeallocated { shard, generation })
        }
        7 => CoordinatorRecord::Event(CoordinatorEvent::ShardUnallocated {
            shard: ShardId(c.u32()?),
        }),
        TAG_STATE => {
            let v = c.u8()?;
            if v != 1 && v != STATE_VERSION {
                return Err(format!("unknown state version {v}"));
            }
            let number_of_shards = c.u32()?;
            let hl = usize::from(c.u16()?);
            let hash_name = c.str(hl)?;
            let mut st = CoordinatorState {
                last_generation: Generation(c.u64()?),
                ..CoordinatorState::default()
            };
            let regions = c.u32()?;
            for _ in 0..regions {
                let r = c.region()?;
                let n = c.u32()?;
                let set = st.regions.entry(r.clone()).or_default();
                for _ in 0..n {
                    let s = ShardId(c.u32()?);
                    let g = Generation(c.u64()?);
                    set.insert(s);
                    st.shards.insert(s, (r.clone(), g));
                }
            }
            let proxies = c.u32()?;
            for _ in 0..proxies {
                st.proxies.insert(c.region()?);
            }
            if v >= 2 {
                let unallocated = c.u32()?;
                for _ in 0..unallocated {
                    st.unallocated.insert(ShardId(c.u32()?));
                }
            }
            CoordinatorRecord::State(
                st,
                CoordinatorConfig {
                    number_of_shards,
                    hash_name,
                },
            )
        }
        t => return Err(format!("unknown record tag {t}")),
    };
    if !c.b.is_empty() {
        return Err(format!("{} trailing bytes", c.b.len()));
    }
    Ok(rec)
}

// --------------------------------------------------------------- recovery

/// What one journal directory holds for one coordinator.
#[derive(Debug, Clone, Default)]
struct JournalView {
    state: CoordinatorState,
    config: Option<CoordinatorConfig>,
    max_epoch: WriterEpoch,
    records: u64,
    last_timestamp_ms: u64,
}

/// Folds one journal's recovery of a coordinator (`highest`: the id's
/// highest sequence number in that journal). A coordinator appends its
/// records with sequence numbers one above the journal's highest, so they
/// must run without a gap from the snapshot to `highest`: anything else is
/// a damaged or missing snapshot whose covered records were removed, and
/// folding what is left would recover an older allocation state.
fn fold(
    dir: &Path,
    rec: Recovery,
    highest: SequenceNr,
) -> Result<JournalView, CoordinatorJournalError> {
    let corrupt = |reason: String| CoordinatorJournalError::Corrupt {
        dir: dir.to_path_buf(),
        reason,
    };
    super::check_history(
        rec.snapshot.as_ref().map_or(0, |s| s.sequence_nr.0),
        rec.events.iter().map(|r| r.sequence_nr.0),
        highest.0,
    )
    .map_err(|e| corrupt(format!("records are {e}")))?;
    let mut v = JournalView::default();
    if let Some(s) = rec.snapshot {
        match decode_record(&s.data).map_err(corrupt)? {
            CoordinatorRecord::State(st, cfg) => {
                v.state = st;
                v.config = Some(cfg);
            }
            CoordinatorRecord::Event(_) => {
                return Err(corrupt("snapshot holds an event, not a state".into()))
            }
        }
        v.max_epoch = s.writer_epoch;
        v.records += 1;
        v.last_timestamp_ms = s.timestamp_ms;
    }
    for r in rec.events {
        match decode_record(&r.payload)
            .map_err(|e| corrupt(format!("sequence nr {}: {e}", r.sequence_nr.0)))?
        {
            CoordinatorRecord::State(st, cfg) => {
                v.state = st;
                v.config = Some(cfg);
            }
            CoordinatorRecord::Event(e) => v.state.apply(&e),
        }
        v.max_epoch = v.max_epoch.max(r.writer_epoch);
        v.records += 1;
        v.last_timestamp_ms = v.last_timestamp_ms.max(r.timestamp_ms);
    }
    Ok(v)
}

/// What [`ControlJournal::recover`] found for one coordinator.
#[derive(Debug, Clone, Default)]
pub struct RecoveredCoordinator {
    /// The newest state (empty when no journal holds the id).
    pub state: CoordinatorState,
    /// The config recorded with it.
    pub config: Option<CoordinatorConfig>,
    /// The journal it came from (`None`: no journal holds the id).
    pub source: Option<PathBuf>,
    /// Records (snapshot + events) replayed from that journal (count).
    pub records: u64,
    /// The highest writer epoch found in any journal (0: none).
    pub highest_epoch: WriterEpoch,
    /// Journals that held the id (count).
    pub journals: usize,
    /// The writer epoch the recovery claimed for the new incarnation
    /// (PostgreSQL: the database fences every older one from the claim
    /// on); `None`: the caller picks one with [`next_epoch`].
    pub claimed_epoch: Option<WriterEpoch>,
    /// Whether it was read from the database (`[journal] backend =
    /// "postgres"`, see [`super::pg_control`]).
    pub from_database: bool,
}

// ------------------------------------------------------------ the journal

struct TypeLog {
    pid: PersistenceId,
    epoch: WriterEpoch,
    since_snapshot: u64,
}

/// The control core's journal: coordinator events of every entity type
/// whose coordinator runs on this node.
pub struct ControlJournal {
    journal: Journal,
    none: bool,
    dir: PathBuf,
    types: HashMap<String, TypeLog>,
    /// The node's data scope: only sibling control journals of its cluster
    /// are read (none without a scope).
    scope: Option<std::sync::Arc<super::DataScope>>,
}

impl std::fmt::Debug for ControlJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlJournal")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl ControlJournal {
    /// Opens (creating) `{data_dir}/control` with the node's durability
    /// policy.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::Open`] when the directory cannot be
    /// created or recovered.
    pub fn open(
        data_dir: &Path,
        durability: &crate::config::Durability,
    ) -> Result<ControlJournal, CoordinatorJournalError> {
        Self::open_dir(&control_dir(data_dir), durability)
    }

    /// Opens (creating) a control journal in `dir` (tests; nodes use
    /// [`Self::open`]).
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn open_dir(
        dir: &Path,
        durability: &crate::config::Durability,
    ) -> Result<ControlJournal, CoordinatorJournalError> {
        let durability = super::journal_durability(durability);
        let options = JournalOptions {
            durability,
            segment_size_bytes: CONTROL_SEGMENT_SIZE_BYTES,
            ..JournalOptions::default()
        };
        let (journal, report) =
            Journal::open(dir, options).map_err(|source| CoordinatorJournalError::Open {
                dir: dir.to_path_buf(),
                source,
            })?;
        if let Some(w) = super::recovery_warning(dir, &report) {
            tracing::warn!("{w}");
        }
        Ok(ControlJournal {
            journal,
            none: matches!(durability, shardline_journal::Durability::None),
            dir: dir.to_path_buf(),
            types: HashMap::new(),
            scope: None,
        })
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Sets the data scope whose cluster's sibling control journals
    /// recovery reads (nodes set it; without one only this journal is read).
    pub fn set_scope(&mut self, scope: std::sync::Arc<super::DataScope>) {
        self.scope = Some(scope);
    }

    /// Every other control journal of this node's cluster under the data
    /// root: `{root}/*/control` of the sibling `data_dir`s that record this
    /// cluster's name and id ([`super::DataScope::cluster_siblings`]),
    /// sorted. A control journal of another cluster is never read.
    fn foreign_dirs(&self) -> Vec<PathBuf> {
        let Some(scope) = &self.scope else {
            return Vec::new();
        };
        let own = std::fs::canonicalize(&self.dir).unwrap_or_else(|_| self.dir.clone());
        scope
            .cluster_siblings()
            .into_iter()
            .map(|n| n.join("control"))
            .filter(|p| p.is_dir())
            .filter(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()) != own)
            .collect()
    }

    /// Recovers `type_name`'s coordinator from this journal and every other
    /// control journal under the data root (read-only): the journal whose
    /// records carry the highest writer epoch wins (ties: the latest
    /// append time). A foreign journal that cannot be opened is skipped
    /// with a warning.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::ConfigMismatch`] when the winning state
    /// was recorded under another config than `expected`;
    /// [`CoordinatorJournalError::Replay`] / `Corrupt` when a journal that
    /// holds the id cannot be read.
    pub fn recover(
        &self,
        type_name: &str,
        expected: &CoordinatorConfig,
    ) -> Result<RecoveredCoordinator, CoordinatorJournalError> {
        let pid = persistence_id(type_name)?;
        let mut views: Vec<(PathBuf, JournalView)> = Vec::new();
        if self.journal.highest_sequence_nr(&pid).0 > 0 || self.snapshot_exists(&pid) {
            let rec =
                self.journal
                    .recover(&pid)
                    .map_err(|source| CoordinatorJournalError::Replay {
                        dir: self.dir.clone(),
                        source,
                    })?;
            let highest = self.journal.highest_sequence_nr(&pid);
            views.push((self.dir.clone(), fold(&self.dir, rec, highest)?));
        }
        for d in self.foreign_dirs() {
            let r = match JournalReader::open(&d) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(dir = %d.display(), error = %e, "cannot read control journal");
                    continue;
                }
            };
            let has =
                r.highest_sequence_nr(&pid).0 > 0 || r.load_snapshot(&pid).ok().flatten().is_some();
            if !has {
                continue;
            }
            let rec = r
                .recover(&pid)
                .map_err(|source| CoordinatorJournalError::Replay {
                    dir: d.clone(),
                    source,
                })?;
            let v = fold(&d, rec, r.highest_sequence_nr(&pid))?;
            views.push((d, v));
        }
        let highest_epoch = views
            .iter()
            .map(|(_, v)| v.max_epoch)
            .max()
            .unwrap_or(WriterEpoch(0));
        let journals = views.len();
        let best = views
            .into_iter()
            .max_by_key(|(_, v)| (v.max_epoch, v.last_timestamp_ms));
        let Some((dir, v)) = best else {
            return Ok(RecoveredCoordinator::default());
        };
        if let Some(cfg) = &v.config {
            if cfg != expected {
                return Err(CoordinatorJournalError::ConfigMismatch {
                    dir,
                    recorded_shards: cfg.number_of_shards,
                    configured_shards: expected.number_of_shards,
                    recorded_hash: cfg.hash_name.clone(),
                    configured_hash: expected.hash_name.clone(),
                });
            }
        }
        Ok(RecoveredCoordinator {
            state: v.state,
            config: v.config,
            source: Some(dir),
            records: v.records,
            highest_epoch,
            journals,
            claimed_epoch: None,
            from_database: false,
        })
    }

    fn snapshot_exists(&self, pid: &PersistenceId) -> bool {
        self.journal.load_snapshot(pid).ok().flatten().is_some()
    }

    /// Starts an incarnation of `type_name`'s coordinator with writer epoch
    /// `epoch`: appends the takeover record (`state` and `config`), so that
    /// this journal alone recovers the state from now on. Returns its LSN.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::Append`] with `AppendError::Fenced` when
    /// this journal already holds a higher epoch for the id (a newer
    /// incarnation), or any other append error.
    pub fn begin(
        &mut self,
        type_name: &str,
        epoch: WriterEpoch,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<Lsn, CoordinatorJournalError> {
        let pid = persistence_id(type_name)?;
        // Above the snapshot too: under durability "none" a power loss can
        // keep a snapshot (synced by the journal's meta thread) and lose
        // the records before it, and a takeover record numbered below the
        // snapshot would be hidden behind it at the next recovery.
        let saved = self
            .journal
            .load_snapshot(&pid)
            .ok()
            .flatten()
            .map_or(0, |s| s.sequence_nr.0);
        let seq = SequenceNr(self.journal.highest_sequence_nr(&pid).0.max(saved) + 1);
        let lsn = self
            .journal
            .append(&pid, seq, epoch, &encode_state(state, config))?;
        self.types.insert(
            type_name.to_string(),
            TypeLog {
                pid,
                epoch,
                since_snapshot: 0,
            },
        );
        Ok(lsn)
    }

    /// Appends one event of `type_name`'s current incarnation (begun with
    /// [`Self::begin`]) with writer epoch `epoch`. Returns its LSN; it is
    /// durable when [`Self::durable_lsn`] reaches it.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::NotBegun`]; `Append` with
    /// `AppendError::Fenced` when `epoch` is below the journal's highest for
    /// the id (a stale incarnation), or any other append error.
    pub fn append(
        &mut self,
        type_name: &str,
        epoch: WriterEpoch,
        event: &CoordinatorEvent,
    ) -> Result<Lsn, CoordinatorJournalError> {
        let t = self
            .types
            .get_mut(type_name)
            .ok_or_else(|| CoordinatorJournalError::NotBegun(type_name.to_string()))?;
        let seq = SequenceNr(self.journal.highest_sequence_nr(&t.pid).0 + 1);
        let lsn = self
            .journal
            .append(&t.pid, seq, epoch, &encode_event(event))?;
        t.since_snapshot += 1;
        Ok(lsn)
    }

    /// Whether [`SNAPSHOT_EVERY_EVENTS`] events were appended for
    /// `type_name` since its last snapshot (or its takeover record).
    pub fn snapshot_due(&self, type_name: &str) -> bool {
        self.types
            .get(type_name)
            .is_some_and(|t| t.since_snapshot >= SNAPSHOT_EVERY_EVENTS)
    }

    /// Saves `state` (the fold of every event appended so far) as the
    /// snapshot of `type_name`'s coordinator. Writes a small temporary
    /// file on the calling thread; the journal's meta thread makes it
    /// durable.
    ///
    /// # Errors
    /// [`CoordinatorJournalError::NotBegun`]; `Snapshot` when the journal
    /// refuses it (fenced, poisoned, I/O).
    pub fn save_snapshot(
        &mut self,
        type_name: &str,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<(), CoordinatorJournalError> {
        let t = self
            .types
            .get_mut(type_name)
            .ok_or_else(|| CoordinatorJournalError::NotBegun(type_name.to_string()))?;
        let seq = self.journal.highest_sequence_nr(&t.pid);
        self.journal
            .save_snapshot(&t.pid, seq, t.epoch, &encode_state(state, config))?;
        t.since_snapshot = 0;
        Ok(())
    }

    /// The writer epoch of `type_name`'s current incarnation, if begun.
    pub fn epoch(&self, type_name: &str) -> Option<WriterEpoch> {
        self.types.get(type_name).map(|t| t.epoch)
    }

    /// Forgets `type_name`'s incarnation (the coordinator stopped here).
    pub fn end(&mut self, type_name: &str) {
        self.types.remove(type_name);
    }

    /// The highest LSN that is durable under the policy (under "none": the
    /// highest appended).
    pub fn durable_lsn(&self) -> Lsn {
        if self.none {
            Lsn(self.journal.next_lsn().0.saturating_sub(1))
        } else {
            self.journal.durable_lsn()
        }
    }

    /// The journal's durability watcher (callbacks run on its sync thread).
    pub fn watcher(&self) -> DurabilityWatcher {
        self.journal.watcher()
    }

    /// Blocks until every appended record is durable (tests and shutdown).
    ///
    /// # Errors
    /// A description when they never will be (poisoned, closed).
    pub fn flush(&self) -> Result<(), String> {
        if self.none {
            return Ok(());
        }
        let last = Lsn(self.journal.next_lsn().0.saturating_sub(1));
        if last.0 == 0 {
            return Ok(());
        }
        self.journal.wait_durable(last).map_err(|e| e.to_string())
    }
}

// ------------------------------------------------------- the two backends

/// A node's coordinator journal: the local control journal
/// (`[journal] backend = "local"`), or the database
/// (`"postgres"`, [`super::pg_control::PgControlJournal`]). The control
/// executor calls only these; neither does database I/O on its thread.
#[derive(Debug)]
pub enum ControlStore {
    /// `{data_dir}/control`, recovered with the sibling `data_dir`s'.
    Local(Box<ControlJournal>),
    /// The cluster's PostgreSQL database.
    Postgres(super::pg_control::PgControlJournal),
}

/// How [`ControlStore::recover_start`] went.
#[derive(Debug)]
pub enum RecoveryStart {
    /// Finished at once (the local journal).
    Ready(Box<Result<RecoveredCoordinator, CoordinatorJournalError>>),
    /// Under way on the database's thread: the outcome comes from
    /// [`ControlStore::take_recovered`] after the control executor's wake.
    Pending,
}

impl ControlStore {
    /// Starts recovering `type_name`'s coordinator (see
    /// [`ControlJournal::recover`] and
    /// [`super::pg_control::PgControlJournal::recover_start`]).
    pub fn recover_start(
        &mut self,
        type_name: &str,
        expected: &CoordinatorConfig,
    ) -> RecoveryStart {
        match self {
            ControlStore::Local(j) => {
                RecoveryStart::Ready(Box::new(j.recover(type_name, expected)))
            }
            ControlStore::Postgres(j) => match j.recover_start(type_name, expected) {
                Ok(()) => RecoveryStart::Pending,
                Err(e) => RecoveryStart::Ready(Box::new(Err(e))),
            },
        }
    }

    /// Whether a recovery of `type_name` is under way.
    pub fn is_recovering(&self, type_name: &str) -> bool {
        match self {
            ControlStore::Local(_) => false,
            ControlStore::Postgres(j) => j.is_recovering(type_name),
        }
    }

    /// Recoveries finished since the last call (the database only).
    pub fn take_recovered(
        &mut self,
    ) -> Vec<(
        String,
        Result<RecoveredCoordinator, CoordinatorJournalError>,
    )> {
        match self {
            ControlStore::Local(_) => Vec::new(),
            ControlStore::Postgres(j) => j.take_recovered(),
        }
    }

    /// Appends the database refused since the last call, `(type, why)`
    /// (the local journal refuses at [`Self::append`] instead).
    pub fn take_refused(&mut self) -> Vec<(String, String)> {
        match self {
            ControlStore::Local(_) => Vec::new(),
            ControlStore::Postgres(j) => j.take_refused(),
        }
    }

    /// Starts an incarnation: its takeover record. Returns its LSN.
    ///
    /// # Errors
    /// As [`ControlJournal::begin`].
    pub fn begin(
        &mut self,
        type_name: &str,
        epoch: WriterEpoch,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<Lsn, CoordinatorJournalError> {
        match self {
            ControlStore::Local(j) => j.begin(type_name, epoch, state, config),
            ControlStore::Postgres(j) => j.begin(type_name, epoch, state, config),
        }
    }

    /// Appends one event of the current incarnation (the database writes
    /// it with the epoch the incarnation began with). Returns its LSN.
    ///
    /// # Errors
    /// As [`ControlJournal::append`].
    pub fn append(
        &mut self,
        type_name: &str,
        epoch: WriterEpoch,
        event: &CoordinatorEvent,
    ) -> Result<Lsn, CoordinatorJournalError> {
        match self {
            ControlStore::Local(j) => j.append(type_name, epoch, event),
            ControlStore::Postgres(j) => j.append(type_name, event),
        }
    }

    /// Whether a snapshot of `type_name` is due.
    pub fn snapshot_due(&self, type_name: &str) -> bool {
        match self {
            ControlStore::Local(j) => j.snapshot_due(type_name),
            ControlStore::Postgres(j) => j.snapshot_due(type_name),
        }
    }

    /// Saves a snapshot of `type_name`'s coordinator.
    ///
    /// # Errors
    /// As [`ControlJournal::save_snapshot`].
    pub fn save_snapshot(
        &mut self,
        type_name: &str,
        state: &CoordinatorState,
        config: &CoordinatorConfig,
    ) -> Result<(), CoordinatorJournalError> {
        match self {
            ControlStore::Local(j) => j.save_snapshot(type_name, state, config),
            ControlStore::Postgres(j) => j.save_snapshot(type_name, state, config),
        }
    }

    /// The writer epoch of `type_name`'s current incarnation, if begun.
    pub fn epoch(&self, type_name: &str) -> Option<WriterEpoch> {
        match self {
            ControlStore::Local(j) => j.epoch(type_name),
            ControlStore::Postgres(j) => j.epoch(type_name),
        }
    }

    /// Forgets `type_name`'s incarnation (or its recovery under way).
    pub fn end(&mut self, type_name: &str) {
        match self {
            ControlStore::Local(j) => j.end(type_name),
            ControlStore::Postgres(j) => j.end(type_name),
        }
    }

    /// The highest LSN with an outcome (see the backends'
    /// `durable_lsn`); the database reports refusals before it moves.
    pub fn durable_lsn(&self) -> Lsn {
        match self {
            ControlStore::Local(j) => j.durable_lsn(),
            ControlStore::Postgres(j) => j.durable_lsn(),
        }
    }

    /// Has `wake` notified once `lsn` is durable (the local journal's sync
    /// thread; the database's thread notifies after every outcome anyway).
    pub fn notify_when_durable(&self, lsn: Lsn, wake: std::sync::Arc<super::DurableWake>) {
        if let ControlStore::Local(j) = self {
            j.watcher().on_durable(lsn, move |_| wake.notify());
        }
    }

    /// Why the journal is unusable now (the database unreachable), if it
    /// is.
    pub fn health(&self) -> Option<String> {
        match self {
            ControlStore::Local(_) => None,
            ControlStore::Postgres(j) => j.health(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Durability as CfgDurability, DurabilityName};
    use proptest::prelude::*;
    use shardline_core::sharding::{
        CoordinatorEffect, CoordinatorMsg, CoordinatorSettings, LeastShardAllocationStrategy,
        MembershipEvent, ShardCoordinator,
    };
    use std::time::Duration;

    const NONE: CfgDurability = CfgDurability::Named(DurabilityName::None);
    const ALWAYS: CfgDurability = CfgDurability::Named(DurabilityName::Always);

    fn cfg(n: u32) -> CoordinatorConfig {
        CoordinatorConfig {
            number_of_shards: n,
            hash_name: shardline_core::sharding::SHARD_ID_HASH_NAME.to_string(),
        }
    }

    #[test]
    fn a_journal_whose_records_do_not_run_to_its_highest_is_corrupt_not_folded() {
        let pid = persistence_id("counter").expect("pid");
        let state = |seq: u64| shardline_journal::Record {
            lsn: Lsn(seq),
            persistence_id: pid.clone(),
            sequence_nr: SequenceNr(seq),
            writer_epoch: WriterEpoch(1),
            timestamp_ms: seq,
            payload: encode_state(&CoordinatorState::default(), &cfg(12)),
        };
        let dir = Path::new("/nowhere");
        let whole = Recovery {
            snapshot: None,
            events: vec![state(1), state(2), state(3)],
        };
        assert!(fold(dir, whole.clone(), SequenceNr(3)).is_ok());
        // A gap: records 2..=4 of a snapshot that is gone were removed.
        let gap = Recovery {
            snapshot: None,
            events: vec![state(1), state(5)],
        };
        let err = fold(dir, gap, SequenceNr(5)).expect_err("gap");
        assert!(err.to_string().contains("not contiguous"), "{err}");
        // Short: the journal holds sequence number 5, what is left ends at 3.
        let err = fold(dir, whole, SequenceNr(5)).expect_err("short");
        assert!(
            err.to_string().contains("reaches sequence number 3 of 5"),
            "{err}"
        );
    }

    fn member(n: u64) -> UniqueAddress {
        UniqueAddress {
            address: Address(format!("127.0.0.1:{}", 7100 + n).into()),
            uid: MemberUid(n * 1000 + 7),
        }
    }

    fn rid(n: u64) -> RegionId {
        RegionId {
            member: member(n),
            core: (n % 3) as u16,
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Up(u64),
        Remove(u64),
        Register(u64),
        Proxy(u64),
        Get(u64, u32),
        Ack(u32, u64),
        Stopped(u32, u64),
        Tick(u64),
        Shutdown(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..5).prop_map(Op::Up),
            (1u64..5).prop_map(Op::Remove),
            (1u64..5).prop_map(Op::Register),
            (5u64..7).prop_map(Op::Proxy),
            ((1u64..5), (0u32..12)).prop_map(|(r, s)| Op::Get(r, s)),
            ((0u32..12), (1u64..5)).prop_map(|(s, r)| Op::Ack(s, r)),
            ((0u32..12), (1u64..5)).prop_map(|(s, r)| Op::Stopped(s, r)),
            (1u64..70).prop_map(Op::Tick),
            (1u64..5).prop_map(Op::Shutdown),
        ]
    }

    /// Drives a coordinator (remembering entities or not) with `ops`,
    /// returning it and its persisted events.
    fn run(ops: Vec<Op>, remember: bool) -> (ShardCoordinator, Vec<CoordinatorEvent>) {
        let mut now = Duration::ZERO;
        let mut c = ShardCoordinator::new(
            CoordinatorSettings {
                remember_entities: remember,
                ..CoordinatorSettings::default()
            },
            Box::new(LeastShardAllocationStrategy::default()),
            now,
        );
        let mut events = Vec::new();
        for o in ops {
            let gen_of = |c: &ShardCoordinator, s: u32| {
                c.state()
                    .shards
                    .get(&ShardId(s))
                    .map(|x| x.1)
                    .unwrap_or_default()
            };
            match o {
                Op::Up(m) => c.handle_membership(now, MembershipEvent::MemberUp(member(m))),
                Op::Remove(m) => {
                    c.handle_membership(now, MembershipEvent::MemberRemoved(member(m)))
                }
                Op::Register(r) => c.handle_message(
                    now,
                    CoordinatorMsg::Register {
                        region: rid(r),
                        hosted: vec![],
                        stopping: vec![],
                    },
                ),
                Op::Proxy(r) => {
                    c.handle_message(now, CoordinatorMsg::RegisterProxy { proxy: rid(r) })
                }
                Op::Get(r, s) => c.handle_message(
                    now,
                    CoordinatorMsg::GetShardHome {
                        region: rid(r),
                        shard: ShardId(s),
                    },
                ),
                Op::Ack(s, r) => {
                    let generation = gen_of(&c, s);
                    c.handle_message(
                        now,
                        CoordinatorMsg::BeginHandOffAck {
                            shard: ShardId(s),
                            generation,
                            region: rid(r),
                        },
                    )
                }
                Op::Stopped(s, r) => {
                    let generation = gen_of(&c, s);
                    c.handle_message(
                        now,
                        CoordinatorMsg::ShardStopped {
                            shard: ShardId(s),
                            generation,
                            region: rid(r),
                        },
                    )
                }
                Op::Tick(secs) => {
                    now += Duration::from_secs(secs);
                    c.handle_timeout(now)
                }
                Op::Shutdown(r) => {
                    c.handle_message(now, CoordinatorMsg::GracefulShutdownReq { region: rid(r) })
                }
            }
            for e in c.drain_effects() {
                if let CoordinatorEffect::Persist(ev) = e {
                    events.push(ev);
                }
            }
        }
        (c, events)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

        // The core's fold property, through the real journal: events
        // appended (with snapshots in between), journal closed and
        // reopened, recovered state == the coordinator's state.
        #[test]
        fn journal_recovered_coordinator_equals_original(
            ops in proptest::collection::vec(op(), 1..120),
            snapshot_at in 0usize..40,
            remember in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path().join("node-1").join("control");
            let (c, events) = run(ops, remember);
            {
                let mut j = ControlJournal::open_dir(&d, &NONE).unwrap();
                let epoch = WriterEpoch(5);
                j.begin("counter", epoch, &CoordinatorState::default(), &cfg(12)).unwrap();
                let mut st = CoordinatorState::default();
                for (i, e) in events.iter().enumerate() {
                    j.append("counter", epoch, e).unwrap();
                    st.apply(e);
                    if i + 1 == snapshot_at {
                        j.save_snapshot("counter", &st, &cfg(12)).unwrap();
                    }
                }
            }
            let j = ControlJournal::open_dir(&d, &NONE).unwrap();
            let r = j.recover("counter", &cfg(12)).unwrap();
            prop_assert_eq!(&r.state, c.state());
            prop_assert_eq!(r.highest_epoch, WriterEpoch(5));
            let recovered = ShardCoordinator::recover_state(
                CoordinatorSettings::default(),
                Box::new(LeastShardAllocationStrategy::default()),
                r.state.clone(),
                Duration::ZERO,
            );
            prop_assert_eq!(recovered.state(), c.state());
        }

        #[test]
        fn decode_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_record(&bytes);
        }
    }

    #[test]
    fn records_round_trip() {
        let (c, events) = run(
            vec![
                Op::Up(1),
                Op::Up(2),
                Op::Register(1),
                Op::Register(2),
                Op::Proxy(5),
                Op::Get(1, 3),
                Op::Get(2, 4),
                Op::Get(1, 5),
                // Remember entities: member 2's shard is recorded as
                // unallocated (member 1 is the only other and it is
                // removed too, so nothing takes it).
                Op::Remove(1),
                Op::Remove(2),
            ],
            true,
        );
        assert!(events.len() >= 6);
        assert!(events
            .iter()
            .any(|e| matches!(e, CoordinatorEvent::ShardUnallocated { .. })));
        assert_eq!(c.state().unallocated.len(), 3);
        for e in &events {
            assert_eq!(
                decode_record(&encode_event(e)),
                Ok(CoordinatorRecord::Event(e.clone()))
            );
        }
        let bytes = encode_state(c.state(), &cfg(12));
        assert_eq!(
            decode_record(&bytes),
            Ok(CoordinatorRecord::State(c.state().clone(), cfg(12)))
        );
        for cut in 0..bytes.len() {
            assert!(decode_record(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn version_1_state_records_are_still_read() {
        let (c, _) = run(
            vec![
                Op::Up(1),
                Op::Register(1),
                Op::Proxy(5),
                Op::Get(1, 3),
                Op::Get(1, 4),
            ],
            false,
        );
        // A version 1 record is a version 2 record without the trailing
        // unallocated list.
        let mut bytes = encode_state(c.state(), &cfg(12));
        assert_eq!(bytes[1], STATE_VERSION);
        bytes[1] = 1;
        bytes.truncate(bytes.len() - 4);
        assert_eq!(
            decode_record(&bytes),
            Ok(CoordinatorRecord::State(c.state().clone(), cfg(12)))
        );
    }

    #[test]
    fn a_takeover_after_its_records_were_lost_is_numbered_after_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("n1").join("control");
        {
            let mut j = ControlJournal::open_dir(&d, &ALWAYS).unwrap();
            j.begin(
                "counter",
                WriterEpoch(1),
                &CoordinatorState::default(),
                &cfg(12),
            )
            .unwrap();
            let ev = CoordinatorEvent::ShardRegionRegistered { region: rid(1) };
            j.append("counter", WriterEpoch(1), &ev).unwrap();
            let mut st = CoordinatorState::default();
            st.apply(&ev);
            j.save_snapshot("counter", &st, &cfg(12)).unwrap();
        }
        // What a power loss under durability "none" can leave: the
        // snapshot (at 2) without the records (every segment gone).
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let n = e.file_name().to_string_lossy().to_string();
            if n.ends_with(".seg") || n.ends_with(".idx") {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        let mut j = ControlJournal::open_dir(&d, &ALWAYS).unwrap();
        let r = j.recover("counter", &cfg(12)).unwrap();
        assert_eq!(r.highest_epoch, WriterEpoch(1));
        j.begin("counter", WriterEpoch(2), &r.state, &cfg(12))
            .unwrap();
        drop(j);
        let j = ControlJournal::open_dir(&d, &ALWAYS).unwrap();
        let r = j.recover("counter", &cfg(12)).unwrap();
        assert_eq!(
            r.highest_epoch,
            WriterEpoch(2),
            "the takeover record is hidden behind the snapshot"
        );
    }

    #[test]
    fn a_stale_incarnation_is_fenced_by_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("n1").join("control");
        let mut j = ControlJournal::open_dir(&d, &ALWAYS).unwrap();
        let ev = CoordinatorEvent::ShardRegionRegistered { region: rid(1) };
        j.begin(
            "counter",
            WriterEpoch(10),
            &CoordinatorState::default(),
            &cfg(12),
        )
        .unwrap();
        j.append("counter", WriterEpoch(10), &ev).unwrap();
        // A newer incarnation takes over in the same journal.
        j.begin(
            "counter",
            WriterEpoch(11),
            &CoordinatorState::default(),
            &cfg(12),
        )
        .unwrap();
        // The old one's late append is refused.
        let err = j.append("counter", WriterEpoch(10), &ev).unwrap_err();
        assert!(
            matches!(
                err,
                CoordinatorJournalError::Append(AppendError::Fenced { .. })
            ),
            "{err}"
        );
        // An incarnation that starts with an epoch below the recorded one
        // is refused too.
        let err = j
            .begin(
                "counter",
                WriterEpoch(9),
                &CoordinatorState::default(),
                &cfg(12),
            )
            .unwrap_err();
        assert!(matches!(
            err,
            CoordinatorJournalError::Append(AppendError::Fenced { .. })
        ));
        j.flush().unwrap();
        assert_eq!(next_epoch(WriterEpoch(11), 3), WriterEpoch(12));
        assert_eq!(next_epoch(WriterEpoch(11), 500), WriterEpoch(500));
    }

    /// Two nodes of one data root: node 1's coordinator (epoch 10) is
    /// replaced by node 2's (epoch 20), which recovers node 1's state
    /// read-only. A zombie append of node 1 afterwards is ignored by the
    /// next recovery (its epoch is lower), from either directory.
    #[test]
    fn recovery_takes_the_newest_journal_of_the_data_root() {
        let root = tempfile::tempdir().unwrap();
        let d1 = root.path().join("node-1").join("control");
        let d2 = root.path().join("node-2").join("control");
        let mut j1 = ControlJournal::open_dir(&d1, &NONE).unwrap();
        let mut j2 = ControlJournal::open_dir(&d2, &NONE).unwrap();
        // Both nodes of one cluster (a third, of another cluster, is never
        // read).
        let scope = |n: &str, id: &str| {
            let s = super::super::DataScope::open(&root.path().join(n), "c").unwrap();
            s.learn_cluster_id(id, "peer").unwrap();
            std::sync::Arc::new(s)
        };
        j1.set_scope(scope("node-1", "one"));
        j2.set_scope(scope("node-2", "one"));
        let d3 = root.path().join("node-3").join("control");
        let mut j3 = ControlJournal::open_dir(&d3, &NONE).unwrap();
        j3.set_scope(scope("node-3", "other"));
        j3.begin(
            "counter",
            WriterEpoch(1_000),
            &CoordinatorState::default(),
            &cfg(12),
        )
        .unwrap();
        let alloc = |s: u32, r: u64, g: u64| CoordinatorEvent::ShardHomeAllocated {
            shard: ShardId(s),
            region: rid(r),
            generation: Generation(g),
        };
        j1.begin(
            "counter",
            WriterEpoch(10),
            &CoordinatorState::default(),
            &cfg(12),
        )
        .unwrap();
        let mut st = CoordinatorState::default();
        for e in [
            CoordinatorEvent::ShardRegionRegistered { region: rid(1) },
            alloc(1, 1, 100),
            alloc(2, 1, 101),
        ] {
            j1.append("counter", WriterEpoch(10), &e).unwrap();
            st.apply(&e);
        }
        // Node 2 takes over: recovers node 1's journal read-only.
        let r = j2.recover("counter", &cfg(12)).unwrap();
        assert_eq!(r.state, st);
        assert_eq!(r.source.as_deref(), Some(d1.as_path()));
        assert_eq!(r.records, 4);
        assert_eq!(r.highest_epoch, WriterEpoch(10));
        let e2 = next_epoch(r.highest_epoch, 20);
        j2.begin("counter", e2, &r.state, &cfg(12)).unwrap();
        let e = alloc(3, 1, 102);
        j2.append("counter", e2, &e).unwrap();
        st.apply(&e);
        // The zombie on node 1 appends on: its journal accepts (another
        // directory), but recovery ignores it.
        j1.append("counter", WriterEpoch(10), &alloc(4, 1, 102))
            .unwrap();
        for j in [&j1, &j2] {
            let r = j.recover("counter", &cfg(12)).unwrap();
            assert_eq!(r.state, st, "from {}", j.dir().display());
            assert_eq!(r.source.as_deref(), Some(d2.as_path()));
            assert_eq!(r.journals, 2);
            assert_eq!(r.highest_epoch, WriterEpoch(20));
        }
        // Node 2's journal alone is sufficient (node 1's directory gone).
        drop(j1);
        std::fs::remove_dir_all(&d1).unwrap();
        assert_eq!(j2.recover("counter", &cfg(12)).unwrap().state, st);
    }

    #[test]
    fn a_config_that_disagrees_with_the_journal_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("node-1").join("control");
        {
            let mut j = ControlJournal::open_dir(&d, &NONE).unwrap();
            j.begin(
                "counter",
                WriterEpoch(3),
                &CoordinatorState::default(),
                &cfg(12),
            )
            .unwrap();
        }
        let j = ControlJournal::open_dir(&d, &NONE).unwrap();
        assert!(j.recover("counter", &cfg(12)).is_ok());
        let err = j.recover("counter", &cfg(24)).unwrap_err();
        match &err {
            CoordinatorJournalError::ConfigMismatch {
                recorded_shards,
                configured_shards,
                ..
            } => assert_eq!((*recorded_shards, *configured_shards), (12, 24)),
            other => panic!("unexpected {other}"),
        }
        assert!(err.to_string().contains("number_of_shards = 12"));
        let other_hash = CoordinatorConfig {
            number_of_shards: 12,
            hash_name: "fnv".into(),
        };
        assert!(matches!(
            j.recover("counter", &other_hash),
            Err(CoordinatorJournalError::ConfigMismatch { .. })
        ));
        // Another type is unaffected.
        assert!(j.recover("echo", &cfg(24)).unwrap().source.is_none());
    }
}
