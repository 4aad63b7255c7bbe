//! One cluster per data directory: the `data_dir` lock, the data root's
//! identity and the cluster identity recorded in a node's data.
//!
//! ```text
//! {root}/shardline-root.id          data root identity (32 hex digits, random, made on first use)
//! {root}/{node}/lock                flock(2)-held for the life of the node's process; holds its pid
//! {root}/{node}/identity.toml       cluster_name = "...", cluster_id = "..." (once known)
//! ```
//!
//! `root` is the parent of the node's `data_dir`: the directory whose
//! `*/journal` and `*/control` journals the local journal reads when a
//! shard or the coordinator moves (see `docs/persistence.md`).
//!
//! - **Lock**: [`DataDirLock::acquire`] takes an exclusive, non-blocking
//!   `flock` on `{data_dir}/lock`; a second process (or a second node in
//!   the same process) on the same `data_dir` is refused with
//!   [`IdentityError::Locked`] naming the holder's pid. The kernel drops
//!   the lock when the process dies, so a kill -9 never leaves a stale lock.
//! - **Cluster identity**: a cluster has a name (`cluster_name`, config)
//!   and a random id (`cluster_id`) created by the first member that is the
//!   cluster's oldest Up member without having learned one, or taken from
//!   the id that member's data records (a whole-cluster restart keeps it).
//!   Every other member learns it at the handshake and records it. A node
//!   refuses to start on a `data_dir` recorded for another `cluster_name`
//!   (unless that node never learned a cluster id and its journals hold no
//!   event: it was refused at its first join, and the name is corrected),
//!   and stops when the cluster it joins has another id than the one its
//!   data records. The journals of a sibling `data_dir` are read only when
//!   its `identity.toml` records this node's cluster name and (known) id.
//!   With the PostgreSQL backend the database records each cluster
//!   name's id (`shardline_clusters`); a node adopts it at start
//!   ([`DataScope::use_database_cluster_id`]), so a cluster restarted onto
//!   empty `data_dir`s keeps its id, and a `data_dir` of another id is
//!   refused.
//! - **Journal identity**: `local:<data root id>` for the local journal
//!   ([`DataScope::journal_identity`]). Members exchange it at the handshake;
//!   a node with durable types on the local journal does not join members
//!   whose journal identity differs (they cannot read each other's events).

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// File name of the data root identity, in the data root.
pub const ROOT_ID_FILE: &str = "shardline-root.id";
/// File name of the lock, in a node's `data_dir`.
pub const LOCK_FILE: &str = "lock";
/// File name of the recorded cluster identity, in a node's `data_dir`.
pub const IDENTITY_FILE: &str = "identity.toml";

/// Errors of the data directory's lock and identity.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// Another process (or another node of this process) holds the
    /// `data_dir`'s lock.
    #[error(
        "data_dir {dir} is in use by another node (process {pid}); a data_dir belongs to one \
         running node (lock file {lock})",
        pid = holder.map_or_else(|| "unknown".to_string(), |p| p.to_string())
    )]
    Locked {
        /// The `data_dir`.
        dir: PathBuf,
        /// The lock file.
        lock: PathBuf,
        /// The holder's pid as recorded in the lock file, when readable.
        holder: Option<u32>,
    },
    /// The `data_dir` records another cluster name than the configured one.
    #[error(
        "data_dir {dir} belongs to cluster {recorded:?} ({file}), but this node is configured \
         with cluster_name = {configured:?}; refusing to start on another cluster's data \
         (use another data_dir, or the cluster_name the data was written by)"
    )]
    OtherCluster {
        /// The `data_dir`.
        dir: PathBuf,
        /// Its identity file.
        file: PathBuf,
        /// The recorded cluster name.
        recorded: String,
        /// The configured cluster name.
        configured: String,
    },
    /// The `data_dir` resolves to the filesystem root (`/tmp/..`, a link
    /// to `/`): it has no parent to be its data root.
    #[error(
        "key `data_dir`: {dir} resolves to the filesystem root; a data_dir needs a parent \
         directory to be its data root"
    )]
    DataDirIsRoot {
        /// The configured `data_dir`.
        dir: PathBuf,
    },
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The `data_dir` records another cluster id than the shared journal
    /// database records for the cluster's name.
    #[error(
        "data_dir {dir} belongs to the cluster {name:?} with id {recorded}, but the journal \
         database records id {database} for that cluster name; refusing to start on another \
         cluster's data (use a fresh data_dir, or another cluster_name)"
    )]
    OtherClusterId {
        /// The `data_dir`.
        dir: PathBuf,
        /// The cluster name.
        name: String,
        /// The id the `data_dir` records.
        recorded: String,
        /// The id the database records.
        database: String,
    },
    /// A file does not hold what it should.
    #[error("{path}: {reason}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> IdentityError + '_ {
    move |source| IdentityError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The `flock` on a node's `data_dir`, held until dropped (or the process
/// ends).
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    path: PathBuf,
}

impl DataDirLock {
    /// Creates `data_dir` if needed and locks `{data_dir}/lock` (exclusive,
    /// non-blocking), writing this process's pid into it.
    ///
    /// # Errors
    /// [`IdentityError::Locked`] when another open file description holds
    /// the lock (another process, or another node in this process), with
    /// the holder's pid; [`IdentityError::DataDirIsRoot`] when the
    /// directory resolves to the filesystem root (`/tmp/..`, a link to
    /// `/`): a `data_dir` needs a parent, its data root (the config check
    /// sees only the path's text); [`IdentityError::Io`] when the directory
    /// or file cannot be created.
    pub fn acquire(data_dir: &Path) -> Result<DataDirLock, IdentityError> {
        std::fs::create_dir_all(data_dir).map_err(io(data_dir))?;
        let resolved = std::fs::canonicalize(data_dir).map_err(io(data_dir))?;
        if resolved.parent().is_none() {
            return Err(IdentityError::DataDirIsRoot {
                dir: data_dir.to_path_buf(),
            });
        }
        let path = data_dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io(&path))?;
        flock(&mut file, libc::LOCK_EX, data_dir, &path)?;
        file.set_len(0).map_err(io(&path))?;
        file.rewind().map_err(io(&path))?;
        writeln!(file, "{}", std::process::id()).map_err(io(&path))?;
        file.sync_all().map_err(io(&path))?;
        Ok(DataDirLock { _file: file, path })
    }

    /// Takes a shared lock on `{data_dir}/lock`, opened read-only (a
    /// reader of a stopped node's data needs no write access), held until
    /// dropped: a node cannot start meanwhile (its exclusive lock is
    /// refused), other shared holders can. Writes nothing.
    ///
    /// # Errors
    /// [`IdentityError::Locked`] naming the holder's pid when a node (an
    /// exclusive holder) runs; [`IdentityError::Io`] when the file cannot
    /// be opened or locked.
    pub fn acquire_shared(data_dir: &Path) -> Result<DataDirLock, IdentityError> {
        let path = data_dir.join(LOCK_FILE);
        let mut file = File::open(&path).map_err(io(&path))?;
        flock(&mut file, libc::LOCK_SH, data_dir, &path)?;
        Ok(DataDirLock { _file: file, path })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Takes `flock` `kind` (`LOCK_EX` or `LOCK_SH`) on `file`, the lock file
/// `path` of `data_dir`, without waiting.
///
/// # Errors
/// [`IdentityError::Locked`] naming the holder's pid (as the file records
/// it) when another holder's lock conflicts; [`IdentityError::Io`] else.
fn flock(
    file: &mut File,
    kind: libc::c_int,
    data_dir: &Path,
    path: &Path,
) -> Result<(), IdentityError> {
    // SAFETY: flock on a file descriptor the caller owns.
    let r = unsafe { libc::flock(file.as_raw_fd(), kind | libc::LOCK_NB) };
    if r == 0 {
        return Ok(());
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
        let mut s = String::new();
        let _ = file.read_to_string(&mut s);
        return Err(IdentityError::Locked {
            dir: data_dir.to_path_buf(),
            lock: path.to_path_buf(),
            holder: s.trim().parse().ok(),
        });
    }
    Err(IdentityError::Io {
        path: path.to_path_buf(),
        source: err,
    })
}

/// The data root of a `data_dir`: its parent (`.` for a bare relative
/// name), made absolute when possible.
pub fn data_root(data_dir: &Path) -> PathBuf {
    let abs = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    match abs.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Reads the data root's identity, creating it (32 random hex digits)
/// on first use. Two nodes creating it at once agree: the file is written
/// to a temporary name and linked into place only if absent.
///
/// # Errors
/// [`IdentityError::Io`] when it cannot be read or written;
/// [`IdentityError::Corrupt`] when it holds something else than 32 hex
/// digits.
pub fn root_identity(root: &Path) -> Result<String, IdentityError> {
    let path = root.join(ROOT_ID_FILE);
    let read = |path: &Path| -> Result<String, IdentityError> {
        let s = std::fs::read_to_string(path).map_err(io(path))?;
        let id = s.trim().to_string();
        if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(IdentityError::Corrupt {
                path: path.to_path_buf(),
                reason: format!("expected 32 hex digits, found {:?}", truncate(&id)),
            });
        }
        Ok(id)
    };
    if path.exists() {
        return read(&path);
    }
    let id = random_id();
    let tmp = root.join(format!(".{ROOT_ID_FILE}.{}", std::process::id()));
    {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        writeln!(f, "{id}").map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    let linked = std::fs::hard_link(&tmp, &path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            if let Ok(d) = File::open(root) {
                let _ = d.sync_all();
            }
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(&path),
        Err(e) => Err(IdentityError::Io { path, source: e }),
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

/// 32 random hex digits (128 bits).
pub fn random_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// What a `data_dir` records about the cluster it belongs to
/// (`{data_dir}/identity.toml`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedIdentity {
    /// The cluster's name (`cluster_name` of the node that wrote it).
    pub cluster_name: String,
    /// The cluster's id, once the node learned it (absent before it first
    /// joined).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
}

/// Reads `{dir}/identity.toml`; `Ok(None)` when there is none.
///
/// # Errors
/// [`IdentityError::Io`] / [`IdentityError::Corrupt`] when it exists but
/// cannot be read or parsed.
pub fn read_identity(dir: &Path) -> Result<Option<RecordedIdentity>, IdentityError> {
    let path = dir.join(IDENTITY_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(IdentityError::Io { path, source: e }),
    };
    toml::from_str(&text)
        .map(Some)
        .map_err(|e| IdentityError::Corrupt {
            path,
            reason: e.to_string().trim_end().replace('\n', " "),
        })
}

/// Writes `{dir}/identity.toml` atomically (temporary file, fsync, rename).
///
/// # Errors
/// [`IdentityError::Io`].
pub fn write_identity(dir: &Path, id: &RecordedIdentity) -> Result<(), IdentityError> {
    let path = dir.join(IDENTITY_FILE);
    let tmp = dir.join(format!(".{IDENTITY_FILE}.tmp"));
    let text = toml::to_string(id).map_err(|e| IdentityError::Corrupt {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    {
        let mut f = File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(text.as_bytes()).map_err(io(&tmp))?;
        f.sync_all().map_err(io(&tmp))?;
    }
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The outcome of learning the cluster's id from a peer
/// ([`DataScope::learn_cluster_id`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Learned {
    /// The id was already known and is the same.
    Same,
    /// The id was not known; it is now, and recorded.
    Adopted,
    /// The peer belongs to another cluster; the reason says which.
    Conflict {
        /// What differs.
        reason: String,
        /// This node's data is the odd one: its `data_dir` records another
        /// cluster id and it had not joined yet (it must not join); false:
        /// this node is a member of its cluster and the peer is not.
        mine: bool,
    },
}

/// A node's data scope: its `data_dir`, data root and identities, shared
/// by the control executor (which learns the cluster id) and the data
/// cores (whose journals read sibling journals only of the same cluster).
#[derive(Debug)]
pub struct DataScope {
    data_dir: PathBuf,
    root: PathBuf,
    root_id: String,
    cluster_name: String,
    /// The id this `data_dir` recorded at start (`None`: fresh).
    recorded_id: Option<String>,
    /// The cluster's id, once known (confirmed or learned).
    cluster_id: Mutex<Option<String>>,
    /// Members seen whose journal identity differs from this node's:
    /// address → journal identity.
    unreadable: Mutex<BTreeMap<String, String>>,
    /// The identity of a shared journal backend (`postgres:…`), when the
    /// node keeps its durable state there instead of under the data root.
    shared_journal: Option<String>,
}

/// Whether the local journals of `data_dir` (the coordinator's `control`
/// journal and every data core's `journal/core-<n>`) hold no event: each is
/// absent or opens read-only with no record. A journal that cannot be read
/// counts as holding events.
fn holds_no_events(data_dir: &Path) -> bool {
    let empty = |dir: &Path| {
        !dir.exists()
            || shardline_journal::JournalReader::open(dir)
                .is_ok_and(|r| r.report().records == 0 && r.persistence_ids().is_empty())
    };
    if !empty(&data_dir.join("control")) {
        return false;
    }
    match std::fs::read_dir(data_dir.join("journal")) {
        Ok(cores) => cores.flatten().all(|c| empty(&c.path())),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

impl DataScope {
    /// Checks and records the identity of `data_dir` for a node of
    /// `cluster_name`: the data root's identity is read or created, and
    /// `{data_dir}/identity.toml` is read (written with the name when
    /// absent). The caller holds the [`DataDirLock`].
    ///
    /// A `data_dir` recorded for another cluster name is taken over (its
    /// identity written again with `cluster_name`) only when its node never
    /// learned a cluster id and its journals hold no event: then it never
    /// joined that cluster.
    ///
    /// # Errors
    /// [`IdentityError::OtherCluster`] when the `data_dir` records another
    /// cluster name and an id, or events; I/O and corruption errors of the
    /// files.
    pub fn open(data_dir: &Path, cluster_name: &str) -> Result<DataScope, IdentityError> {
        std::fs::create_dir_all(data_dir).map_err(io(data_dir))?;
        let data_dir = std::fs::canonicalize(data_dir).map_err(io(data_dir))?;
        let root = data_root(&data_dir);
        let root_id = root_identity(&root)?;
        let recorded = read_identity(&data_dir)?;
        let recorded_id = match recorded {
            Some(r) if r.cluster_name == cluster_name => r.cluster_id,
            // A data_dir whose node never learned a cluster id never joined
            // a cluster (the id is recorded before it serves: the oldest Up
            // member establishes it, the others learn it at the handshake),
            // so it holds nobody's data: a node refused at its first join
            // (a wrong cluster_name) starts again with the corrected one.
            Some(r) if r.cluster_id.is_some() || !holds_no_events(&data_dir) => {
                return Err(IdentityError::OtherCluster {
                    file: data_dir.join(IDENTITY_FILE),
                    dir: data_dir,
                    recorded: r.cluster_name,
                    configured: cluster_name.to_string(),
                })
            }
            _ => {
                write_identity(
                    &data_dir,
                    &RecordedIdentity {
                        cluster_name: cluster_name.to_string(),
                        cluster_id: None,
                    },
                )?;
                None
            }
        };
        Ok(DataScope {
            data_dir,
            root,
            root_id,
            cluster_name: cluster_name.to_string(),
            recorded_id,
            cluster_id: Mutex::new(None),
            unreadable: Mutex::new(BTreeMap::new()),
            shared_journal: None,
        })
    }

    /// Records that this node's durable state lives in a shared journal
    /// backend whose identity is `identity` (e.g. the PostgreSQL backend's
    /// `postgres:{system_identifier}/{database}`): it becomes the
    /// [`Self::journal_identity`] exchanged at the handshake, so every
    /// member must use the same database, wherever its data root is.
    pub fn use_shared_journal(&mut self, identity: String) {
        self.shared_journal = Some(identity);
    }

    /// The cluster id this `data_dir` recorded at start (`None`: fresh).
    pub fn recorded_cluster_id(&self) -> Option<&str> {
        self.recorded_id.as_deref()
    }

    /// Takes the cluster id `id` that the shared journal database records
    /// for this cluster's name (see [`crate::persistence::pg_control::cluster_id`])
    /// as the one this `data_dir` records: a fresh `data_dir` adopts it (and
    /// records it), so a whole cluster restarted onto empty `data_dir`s
    /// against the same database is the same cluster. The id still becomes
    /// known the usual way (established by the oldest member, or learned),
    /// and a cluster with another id is not joined.
    ///
    /// # Errors
    /// [`IdentityError::OtherClusterId`] when the `data_dir` records
    /// another id; [`IdentityError::Io`] when it cannot be recorded.
    pub fn use_database_cluster_id(&mut self, id: &str) -> Result<(), IdentityError> {
        match &self.recorded_id {
            Some(r) if r != id => Err(IdentityError::OtherClusterId {
                dir: self.data_dir.clone(),
                name: self.cluster_name.clone(),
                recorded: r.clone(),
                database: id.to_string(),
            }),
            Some(_) => Ok(()),
            None => {
                write_identity(
                    &self.data_dir,
                    &RecordedIdentity {
                        cluster_name: self.cluster_name.clone(),
                        cluster_id: Some(id.to_string()),
                    },
                )?;
                self.recorded_id = Some(id.to_string());
                Ok(())
            }
        }
    }

    /// The (canonical) `data_dir`.
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// The data root (the `data_dir`'s parent).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The data root's identity (32 hex digits).
    pub fn root_id(&self) -> &str {
        &self.root_id
    }

    /// The configured cluster name.
    pub fn cluster_name(&self) -> &str {
        &self.cluster_name
    }

    /// The journal identity exchanged at the handshake: `local:<root id>`
    /// (two members with the same one can read each other's journals), or
    /// the shared backend's identity ([`Self::use_shared_journal`]).
    pub fn journal_identity(&self) -> String {
        match &self.shared_journal {
            Some(id) => id.clone(),
            None => format!("local:{}", self.root_id),
        }
    }

    /// The cluster's id, once known.
    pub fn cluster_id(&self) -> Option<String> {
        self.cluster_id.lock().ok().and_then(|g| g.clone())
    }

    /// Makes this member the one that establishes the cluster's id (it is
    /// the oldest Up member and learned none): the id its data recorded,
    /// else a new random one; recorded in `identity.toml`. Returns it.
    ///
    /// # Errors
    /// [`IdentityError::Io`] when it cannot be recorded (the id is known
    /// in memory anyway).
    pub fn establish_cluster_id(&self) -> Result<String, IdentityError> {
        let id = {
            let mut g = self.cluster_id.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(id) = g.as_ref() {
                return Ok(id.clone());
            }
            let id = self.recorded_id.clone().unwrap_or_else(random_id);
            *g = Some(id.clone());
            id
        };
        self.record(&id)?;
        Ok(id)
    }

    /// Learns the cluster's id `id` from a peer (`address`).
    ///
    /// # Errors
    /// [`IdentityError::Io`] when an adopted id cannot be recorded.
    pub fn learn_cluster_id(&self, id: &str, address: &str) -> Result<Learned, IdentityError> {
        {
            let mut g = self.cluster_id.lock().unwrap_or_else(|e| e.into_inner());
            match g.as_deref() {
                Some(own) if own == id => return Ok(Learned::Same),
                Some(own) => {
                    return Ok(Learned::Conflict {
                        reason: format!(
                            "member {address} belongs to a cluster {:?} with id {id}, the member \
                             that checked it to the one with id {own}; two clusters must not \
                             share members",
                            self.cluster_name
                        ),
                        mine: false,
                    })
                }
                None => {}
            }
            if let Some(rec) = &self.recorded_id {
                if rec != id {
                    return Ok(Learned::Conflict {
                        reason: format!(
                            "data_dir {} belongs to the cluster {:?} with id {rec}, but member \
                             {address} is of a cluster with id {id}; refusing to join another \
                             cluster on this data (use a fresh data_dir to join it)",
                            self.data_dir.display(),
                            self.cluster_name
                        ),
                        mine: true,
                    });
                }
            }
            *g = Some(id.to_string());
        }
        self.record(id)?;
        Ok(Learned::Adopted)
    }

    fn record(&self, id: &str) -> Result<(), IdentityError> {
        if self.recorded_id.as_deref() == Some(id) {
            return Ok(());
        }
        write_identity(
            &self.data_dir,
            &RecordedIdentity {
                cluster_name: self.cluster_name.clone(),
                cluster_id: Some(id.to_string()),
            },
        )
    }

    /// Notes a member whose journal identity differs from this node's (its
    /// journal is not readable from here).
    pub fn note_unreadable(&self, address: &str, journal_identity: &str) {
        if let Ok(mut g) = self.unreadable.lock() {
            g.insert(address.to_string(), journal_identity.to_string());
        }
    }

    /// The members seen since start whose journals are not readable from
    /// this node (address → journal identity).
    pub fn unreadable(&self) -> BTreeMap<String, String> {
        self.unreadable
            .lock()
            .map(|g| g.clone())
            .unwrap_or_default()
    }

    /// Whether the sibling `data_dir` `dir` (under the same root) belongs
    /// to this node's cluster: its `identity.toml` records this cluster's
    /// name and id. Always false while the id is not known, and for a
    /// directory without a readable identity.
    pub fn same_cluster(&self, dir: &Path) -> bool {
        let Some(own) = self.cluster_id() else {
            return false;
        };
        match read_identity(dir) {
            Ok(Some(r)) => {
                r.cluster_name == self.cluster_name && r.cluster_id.as_deref() == Some(&own)
            }
            _ => false,
        }
    }

    /// The node directories under the root that belong to this cluster,
    /// this node's own excluded, sorted.
    pub fn cluster_siblings(&self) -> Vec<PathBuf> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .filter(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()) != self.data_dir)
            .filter(|p| self.same_cluster(p))
            .collect();
        out.sort();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_data_dir_that_resolves_to_the_root_is_refused_before_anything_is_written() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("to-root");
        std::os::unix::fs::symlink("/", &root).unwrap();
        for d in [root.clone(), PathBuf::from("/tmp/..")] {
            let e = DataDirLock::acquire(&d).unwrap_err();
            assert!(e.to_string().contains("filesystem root"), "{e}");
        }
        assert!(!Path::new("/").join(LOCK_FILE).exists());
    }

    #[test]
    fn a_second_lock_on_one_data_dir_is_refused_with_the_holders_pid() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("node-1");
        let l = DataDirLock::acquire(&d).unwrap();
        let e = DataDirLock::acquire(&d).unwrap_err();
        match &e {
            IdentityError::Locked { holder, .. } => assert_eq!(*holder, Some(std::process::id())),
            other => panic!("{other}"),
        }
        assert!(
            e.to_string().contains(&std::process::id().to_string()),
            "{e}"
        );
        drop(l);
        DataDirLock::acquire(&d).unwrap();
    }

    #[test]
    fn root_identity_is_made_once_and_kept() {
        let t = tempfile::tempdir().unwrap();
        let a = root_identity(t.path()).unwrap();
        assert_eq!(a.len(), 32);
        assert_eq!(root_identity(t.path()).unwrap(), a);
        std::fs::write(t.path().join(ROOT_ID_FILE), "nope\n").unwrap();
        assert!(matches!(
            root_identity(t.path()),
            Err(IdentityError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_shared_lock_keeps_a_node_out_and_a_node_keeps_it_out() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("n");
        drop(DataDirLock::acquire(&d).unwrap());
        let a = DataDirLock::acquire_shared(&d).unwrap();
        let b = DataDirLock::acquire_shared(&d).unwrap();
        assert!(matches!(
            DataDirLock::acquire(&d),
            Err(IdentityError::Locked { .. })
        ));
        drop((a, b));
        let node = DataDirLock::acquire(&d).unwrap();
        let e = DataDirLock::acquire_shared(&d).unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("process {}", std::process::id())),
            "{e}"
        );
        drop(node);
    }

    #[test]
    fn a_data_dir_with_events_but_no_cluster_id_keeps_its_name() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("n");
        DataScope::open(&d, "alpha").unwrap();
        // An event in a core's journal (its node crashed before it could
        // record the id, say): the data is alpha's, whatever the id.
        let core = d.join("journal").join("core-0");
        let (mut j, _) =
            shardline_journal::Journal::open(&core, shardline_journal::JournalOptions::default())
                .unwrap();
        let pid = shardline_journal::PersistenceId::new("counter|a").unwrap();
        j.append(
            &pid,
            shardline_journal::SequenceNr(1),
            shardline_journal::WriterEpoch(1),
            b"1",
        )
        .unwrap();
        j.close().unwrap();
        let e = DataScope::open(&d, "beta").unwrap_err();
        assert!(matches!(e, IdentityError::OtherCluster { .. }), "{e}");
        // Empty journals (a node that started and was refused) do not.
        std::fs::remove_dir_all(&core).unwrap();
        let (j, _) = shardline_journal::Journal::open(
            d.join("control"),
            shardline_journal::JournalOptions::default(),
        )
        .unwrap();
        j.close().unwrap();
        assert_eq!(DataScope::open(&d, "beta").unwrap().cluster_name(), "beta");
    }

    #[test]
    fn another_cluster_name_is_refused_and_ids_are_learned_once() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("n");
        // A data_dir that never learned a cluster id and holds no event
        // (a node refused at its first join) takes the name it is given.
        assert_eq!(DataScope::open(&d, "beta").unwrap().cluster_name(), "beta");
        let s = DataScope::open(&d, "alpha").unwrap();
        assert_eq!(s.cluster_id(), None);
        assert!(s.journal_identity().starts_with("local:"));
        assert_eq!(s.learn_cluster_id("x1", "peer").unwrap(), Learned::Adopted);
        // Once it learned an id, another name is refused.
        let e = DataScope::open(&d, "beta").unwrap_err();
        assert!(e.to_string().contains("\"alpha\""), "{e}");
        assert_eq!(s.learn_cluster_id("x1", "peer").unwrap(), Learned::Same);
        assert!(matches!(
            s.learn_cluster_id("x2", "peer").unwrap(),
            Learned::Conflict { mine: false, .. }
        ));
        // Restarted on the same data: the recorded id is established, and
        // another cluster's id is a conflict.
        let s2 = DataScope::open(&d, "alpha").unwrap();
        assert!(matches!(
            s2.learn_cluster_id("x3", "peer").unwrap(),
            Learned::Conflict { mine: true, .. }
        ));
        assert_eq!(s2.establish_cluster_id().unwrap(), "x1");
        // A sibling is of the cluster only with the same name and id.
        let sib = t.path().join("m");
        std::fs::create_dir_all(&sib).unwrap();
        assert!(s2.cluster_siblings().is_empty());
        write_identity(
            &sib,
            &RecordedIdentity {
                cluster_name: "alpha".into(),
                cluster_id: Some("x9".into()),
            },
        )
        .unwrap();
        assert!(s2.cluster_siblings().is_empty());
        write_identity(
            &sib,
            &RecordedIdentity {
                cluster_name: "alpha".into(),
                cluster_id: Some("x1".into()),
            },
        )
        .unwrap();
        assert_eq!(
            s2.cluster_siblings(),
            vec![std::fs::canonicalize(&sib).unwrap()]
        );
    }
}
