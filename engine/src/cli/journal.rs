//! `shardline journal verify DIR` and `shardline journal inspect DIR
//! [--persistence-id ID]`: offline tools for a journal directory (see
//! `journal/FORMAT.md`). Both read every segment in full and change
//! nothing. `shardline journal repair DIR --yes` cuts a corrupt journal at
//! its first corruption so that a node can open it again (records after the
//! cut are lost; run it only on a stopped node's journal).
//!
//! A node's journals are `{data_dir}/control` and `{data_dir}/journal/core-<n>`;
//! while a node runs it holds `{data_dir}/lock` (see
//! `persistence::identity`). `verify` (shared, read-only) and `repair`
//! (exclusive) take that lock for as long as they run and refuse a journal
//! whose node is running, however the path is written (it is resolved
//! first: `.`, `..`, links): a live
//! journal's record in progress reads as a torn tail or corruption, its
//! segments go while they are read, and a repair removed the running
//! node's next segment and poisoned its journal. `inspect` reads a live
//! journal, and says so first.

use std::io::Write;
use std::path::PathBuf;

use shardline_journal::format::RecordKind;
use shardline_journal::verify::{self, SegmentProblem};
use shardline_journal::{JournalReader, PersistenceId};

/// Arguments of `journal`.
#[derive(Debug, clap::Args)]
pub struct JournalArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: JournalCommand,
}

/// The `journal` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum JournalCommand {
    /// Check every segment, then open the journal read-only as a node's
    /// recovery would (its state checkpoint, indexes and snapshot table);
    /// exit 0 when the journal is usable (a torn tail is usable: opening
    /// cuts it), 1 when it is corrupt or does not open. Refuses the
    /// journal of a running node (`DATA_DIR/control`,
    /// `DATA_DIR/journal/core-N` while the node holds `DATA_DIR/lock`).
    Verify {
        /// The journal directory.
        dir: PathBuf,
    },
    /// Cut the journal at its first corruption (repair mode of the journal's
    /// recovery): every record after it is lost, stale segments are
    /// removed. Only for a journal no node has open (refuses a running
    /// node's, as `verify` does). Needs `--yes`.
    Repair {
        /// The journal directory.
        dir: PathBuf,
        /// Confirms that losing the records after the corruption is meant.
        #[arg(long)]
        yes: bool,
    },
    /// List records: `LSN SEQ KIND EPOCH TIMESTAMP_MS LEN PERSISTENCE_ID PAYLOAD`;
    /// a segment's records after a corrupt one are not listed. Exits 1
    /// (after `# CORRUPT: ...` lines) when `verify` would.
    Inspect {
        /// The journal directory.
        dir: PathBuf,
        /// Only this persistence id's records (and its latest snapshot).
        #[arg(long)]
        persistence_id: Option<String>,
    },
}

/// Errors of `journal`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalCliError {
    /// The directory could not be read.
    #[error("cannot read journal {dir}: {source}")]
    Read {
        /// The directory.
        dir: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--persistence-id` is not a valid persistence id.
    #[error("invalid --persistence-id: {0}")]
    BadPersistenceId(#[from] shardline_journal::PersistenceIdError),
    /// Writing the output failed.
    #[error("cannot write output: {0}")]
    Io(#[from] std::io::Error),
    /// `repair` without `--yes`.
    #[error("repair loses every record after the first corruption: run `shardline journal verify` first, stop the node, and add --yes")]
    NotConfirmed,
    /// The journal could not be opened read-only for a reason that is not
    /// damage (an I/O error such as a permission, or a file of a newer
    /// format version): `verify` says nothing about its state then.
    #[error("cannot open journal {dir} read-only (not a sign of damage)")]
    Open {
        /// The directory.
        dir: PathBuf,
        /// The journal's error.
        source: shardline_journal::OpenError,
    },
    /// The journal belongs to a node that is running (it holds the
    /// `data_dir`'s lock): `verify` and `repair` read a stopped node's
    /// journal.
    #[error(
        "journal {dir} is open by a running node: {source}; stop the node first (verify and \
         repair read a stopped node's journal)"
    )]
    InUse {
        /// The journal directory.
        dir: PathBuf,
        /// The lock's error, naming the node's pid.
        source: Box<crate::persistence::IdentityError>,
    },
    /// The lock of the node the journal belongs to could not be taken for
    /// another reason than a running node (a permission, an I/O error).
    #[error("cannot lock the data_dir of journal {dir}: {source}")]
    Lock {
        /// The journal directory.
        dir: PathBuf,
        /// The lock's error.
        source: Box<crate::persistence::IdentityError>,
    },
    /// The journal could not be opened even in repair mode.
    #[error("cannot repair journal {dir}: {source}")]
    Repair {
        /// The directory.
        dir: PathBuf,
        /// The journal's error.
        source: shardline_journal::OpenError,
    },
}

/// Runs a `journal` subcommand, writing its report to `out`. Returns
/// whether the journal is usable (`repair` always returns true).
///
/// # Errors
/// [`JournalCliError::Read`] when the directory cannot be listed or a
/// segment cannot be opened; [`JournalCliError::Open`] when `verify`
/// cannot open it read-only for a reason that is not damage (an I/O error,
/// a newer format version); [`JournalCliError::Io`] when writing fails.
pub fn run(args: &JournalArgs, out: &mut impl Write) -> Result<bool, JournalCliError> {
    match &args.command {
        JournalCommand::Verify { dir } => {
            let _lock = stopped_node(dir, false)?;
            verify_cmd(dir, out)
        }
        JournalCommand::Repair { dir, yes } => {
            if !yes {
                return Err(JournalCliError::NotConfirmed);
            }
            let _lock = stopped_node(dir, true)?;
            repair_cmd(dir, *yes, out).map(|()| true)
        }
        JournalCommand::Inspect {
            dir,
            persistence_id,
        } => {
            if let Some(data_dir) = node_data_dir(dir) {
                if let Err(e @ crate::persistence::IdentityError::Locked { .. }) =
                    crate::persistence::DataDirLock::acquire_shared(&data_dir)
                {
                    writeln!(
                        out,
                        "# note: {e}; its newest record may be in progress and its segments \
                         may go while they are read"
                    )?;
                }
            }
            inspect_cmd(dir, persistence_id.as_deref(), out)
        }
    }
}

/// The node `data_dir` that journal directory `dir` belongs to, by the
/// layout (`{data_dir}/control`, `{data_dir}/journal/core-<n>`) of its
/// resolved path (`.`, `..` and links followed), when that directory has a
/// lock file: `None` for a journal elsewhere (a copy), or a directory that
/// does not exist.
fn node_data_dir(dir: &std::path::Path) -> Option<PathBuf> {
    let dir = std::fs::canonicalize(dir).ok()?;
    let name = dir.file_name()?.to_str()?;
    let parent = dir.parent()?;
    let data_dir = if name == "control" {
        parent.to_path_buf()
    } else if name.starts_with("core-") && parent.file_name()? == "journal" {
        parent.parent()?.to_path_buf()
    } else {
        return None;
    };
    data_dir
        .join(crate::persistence::LOCK_FILE)
        .is_file()
        .then_some(data_dir)
}

/// Takes the lock of the node `dir` belongs to (see [`node_data_dir`]),
/// `exclusive` or shared (read-only), so that no node starts on the
/// journal meanwhile; `None` for a journal of no node.
///
/// # Errors
/// [`JournalCliError::InUse`] when the node is running;
/// [`JournalCliError::Lock`] when the lock cannot be taken otherwise.
fn stopped_node(
    dir: &std::path::Path,
    exclusive: bool,
) -> Result<Option<crate::persistence::DataDirLock>, JournalCliError> {
    use crate::persistence::{DataDirLock, IdentityError};
    let Some(data_dir) = node_data_dir(dir) else {
        return Ok(None);
    };
    let lock = if exclusive {
        DataDirLock::acquire(&data_dir)
    } else {
        DataDirLock::acquire_shared(&data_dir)
    };
    lock.map(Some).map_err(|source| {
        let (dir, source) = (dir.to_path_buf(), Box::new(source));
        match *source {
            IdentityError::Locked { .. } => JournalCliError::InUse { dir, source },
            _ => JournalCliError::Lock { dir, source },
        }
    })
}

fn repair_cmd(dir: &PathBuf, yes: bool, out: &mut impl Write) -> Result<(), JournalCliError> {
    if !yes {
        return Err(JournalCliError::NotConfirmed);
    }
    if !dir.is_dir() {
        return Err(JournalCliError::Read {
            dir: dir.clone(),
            source: std::io::ErrorKind::NotFound.into(),
        });
    }
    let options = shardline_journal::JournalOptions {
        recovery: shardline_journal::RecoveryMode::Repair,
        segment_size_bytes: crate::persistence::SEGMENT_SIZE_BYTES,
        durability: shardline_journal::Durability::Always,
        ..shardline_journal::JournalOptions::default()
    };
    let (journal, report) = shardline_journal::Journal::open(dir, options).map_err(|source| {
        JournalCliError::Repair {
            dir: dir.clone(),
            source,
        }
    })?;
    drop(journal);
    writeln!(out, "journal {}", dir.display())?;
    for r in &report.repairs {
        writeln!(
            out,
            "{} segment {} at offset {}: {}",
            if r.removed_file { "removed" } else { "cut" },
            r.file,
            r.offset,
            r.problem
        )?;
    }
    if let Some(t) = &report.torn_tail {
        writeln!(out, "torn tail cut: {t:?}")?;
    }
    writeln!(
        out,
        "kept {} records of {} persistence ids in {} segments; {} repair(s)",
        report.records,
        report.persistence_ids,
        report.segments,
        report.repairs.len()
    )?;
    Ok(())
}

fn verify_cmd(dir: &PathBuf, out: &mut impl Write) -> Result<bool, JournalCliError> {
    let report = verify::verify_dir(dir).map_err(|source| JournalCliError::Read {
        dir: dir.clone(),
        source,
    })?;
    // What the segments' scan does not cover: the state checkpoint, the
    // segment indexes and the snapshot table, read as a recovery reads
    // them (a damaged journal.state fails every durable entity of a core).
    let open_problem = open_read_only(dir)?
        .err()
        .map(|e| format!("opening it read-only: {e}"));
    let opened = open_problem.is_none();
    writeln!(out, "journal {}", dir.display())?;
    let mut torn = Vec::new();
    let mut corrupt = Vec::new();
    for s in &report.segments {
        let epoch = s
            .writer_epoch
            .map_or_else(|| "-".to_string(), |e| e.0.to_string());
        let state = match &s.problem {
            None => "ok".to_string(),
            Some(SegmentProblem::TornTail {
                offset,
                bytes,
                kind,
            }) => {
                torn.push(format!(
                    "segment {} offset {offset} ({bytes} bytes, {kind}; cut on open)",
                    s.file
                ));
                format!("torn tail at offset {offset}")
            }
            Some(SegmentProblem::Corrupt { offset, kind }) => {
                corrupt.push(format!("segment {} offset {offset}: {kind}", s.file));
                format!("CORRUPT at offset {offset}")
            }
            Some(SegmentProblem::Stale { epoch, newer_epoch }) => {
                corrupt.push(format!(
                    "segment {} offset 0: stale writer epoch {epoch} after epoch {newer_epoch}",
                    s.file
                ));
                "STALE".to_string()
            }
            Some(SegmentProblem::Overlap { expected }) => {
                corrupt.push(format!(
                    "segment {} offset 0: overlaps earlier segments (next LSN {expected})",
                    s.file
                ));
                "OVERLAP".to_string()
            }
        };
        writeln!(
            out,
            "segment {} epoch {epoch} records {} bytes {} file_bytes {} index {} {state}",
            s.file,
            s.records,
            s.record_bytes,
            s.file_len_bytes,
            if s.has_index { "yes" } else { "no" },
        )?;
    }
    writeln!(
        out,
        "segments {} records {} persistence_ids {} bytes {}",
        report.segments.len(),
        report.records,
        report.persistence_ids,
        report.record_bytes
    )?;
    if torn.is_empty() {
        writeln!(out, "torn tail: none")?;
    }
    for t in &torn {
        writeln!(out, "torn tail: {t}")?;
    }
    corrupt.extend(open_problem);
    if corrupt.is_empty() {
        writeln!(out, "corruption: none")?;
    }
    for c in &corrupt {
        writeln!(out, "corruption: {c}")?;
    }
    let usable = report.usable() && opened;
    writeln!(out, "result: {}", if usable { "usable" } else { "CORRUPT" })?;
    Ok(usable)
}

/// Opens `dir` read-only, as a recovery opens it (checkpoint, indexes,
/// snapshot table). Called before anything is printed, so that nothing is
/// reported of a journal this build cannot read or the machine does not
/// let it read: those failures are [`JournalCliError::Open`]; damage is
/// the inner `Err`, for the caller to report.
fn open_read_only(
    dir: &PathBuf,
) -> Result<Result<JournalReader, shardline_journal::OpenError>, JournalCliError> {
    match JournalReader::open(dir) {
        Err(e) if !is_damage(&e) => Err(JournalCliError::Open {
            dir: dir.clone(),
            source: e,
        }),
        other => Ok(other),
    }
}

/// Whether a read-only open failed because of what the files hold
/// (corruption, a stale or overlapping segment, a damaged checkpoint,
/// index or table), as opposed to the machine (an I/O error: a
/// permission, a vanished file) or a newer build's format (a file whose
/// version differs while its checksum holds; a flipped version bit fails
/// the checksum and is damage).
fn is_damage(e: &shardline_journal::OpenError) -> bool {
    use shardline_journal::{OpenError, RecoveryError};
    !matches!(
        e,
        OpenError::Io { .. }
            | OpenError::Recovery(RecoveryError::Io { .. })
            | OpenError::Recovery(RecoveryError::UnsupportedVersion { .. })
    )
}

fn preview(payload: &[u8]) -> String {
    const MAX: usize = 48;
    let shown = &payload[..payload.len().min(MAX)];
    let more = if payload.len() > MAX { "..." } else { "" };
    if shown.iter().all(|b| (0x20..0x7f).contains(b)) {
        format!("{:?}{more}", String::from_utf8_lossy(shown))
    } else {
        let hex: String = shown.iter().map(|b| format!("{b:02x}")).collect();
        format!("0x{hex}{more}")
    }
}

fn inspect_cmd(
    dir: &PathBuf,
    persistence_id: Option<&str>,
    out: &mut impl Write,
) -> Result<bool, JournalCliError> {
    let filter = persistence_id.map(PersistenceId::new).transpose()?;
    let storage = shardline_journal::storage::MmapStorage::existing(dir).map_err(|source| {
        JournalCliError::Read {
            dir: dir.clone(),
            source,
        }
    })?;
    // Opened once: for the asked id's snapshot, and to fail on what the
    // segments' scan does not see.
    let opened = open_read_only(dir)?;
    let mut io_result = Ok(());
    let mut shown = 0u64;
    writeln!(
        out,
        "# lsn seq kind epoch timestamp_ms len persistence_id payload"
    )?;
    verify::for_each_record(&storage, |_, r| {
        if io_result.is_err() {
            return;
        }
        if let Some(p) = &filter {
            if r.persistence_id != p.as_bytes() {
                return;
            }
        }
        shown += 1;
        let kind = match r.kind {
            RecordKind::Event => "event",
            RecordKind::Deletion => "delete-to",
        };
        io_result = writeln!(
            out,
            "{} {} {kind} {} {} {} {} {}",
            r.lsn,
            r.sequence_nr,
            r.writer_epoch,
            r.timestamp_ms,
            r.payload.len(),
            String::from_utf8_lossy(r.persistence_id),
            preview(r.payload)
        );
    })
    .map_err(|source| JournalCliError::Read {
        dir: dir.clone(),
        source,
    })?;
    io_result?;
    writeln!(out, "# {shown} records")?;
    // A segment's listing stops at its first bad record: say where, and
    // fail.
    let report = verify::verify(&storage).map_err(|source| JournalCliError::Read {
        dir: dir.clone(),
        source,
    })?;
    let mut usable = report.usable();
    for s in &report.segments {
        match &s.problem {
            Some(SegmentProblem::Corrupt { offset, kind }) => writeln!(
                out,
                "# CORRUPT: segment {} offset {offset}: {kind}; its records after that offset are not listed",
                s.file
            )?,
            Some(SegmentProblem::Stale { epoch, newer_epoch }) => writeln!(
                out,
                "# CORRUPT: segment {}: stale writer epoch {epoch} after epoch {newer_epoch}",
                s.file
            )?,
            Some(SegmentProblem::Overlap { expected }) => writeln!(
                out,
                "# CORRUPT: segment {}: overlaps earlier segments (next LSN {expected})",
                s.file
            )?,
            _ => {}
        }
    }
    match opened {
        Err(e) => {
            usable = false;
            writeln!(out, "# CORRUPT: the journal does not open read-only: {e}")?;
        }
        Ok(reader) => {
            if let Some(p) = &filter {
                match reader.load_snapshot(p) {
                    Ok(Some(s)) => writeln!(
                        out,
                        "# snapshot of {p} at seq {} (epoch {}, {} bytes): {}",
                        s.sequence_nr,
                        s.writer_epoch,
                        s.data.len(),
                        preview(&s.data)
                    )?,
                    Ok(None) => writeln!(out, "# no snapshot of {p}")?,
                    Err(e) => writeln!(out, "# snapshot of {p} unreadable: {e}")?,
                }
            }
        }
    }
    Ok(usable)
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_journal::{Durability, Journal, JournalOptions, SequenceNr, WriterEpoch};

    fn sample(dir: &std::path::Path) {
        let opts = JournalOptions {
            segment_size_bytes: 4096,
            durability: Durability::Always,
            ..JournalOptions::default()
        };
        let (mut j, _) = Journal::open(dir, opts).unwrap();
        let p = PersistenceId::new("counter|a").unwrap();
        for seq in 1..=100 {
            j.append(&p, SequenceNr(seq), WriterEpoch(0), b"add 1")
                .unwrap();
        }
        j.save_snapshot(&p, SequenceNr(50), WriterEpoch(0), b"50")
            .unwrap();
        j.close().unwrap();
    }

    fn run_to_string(command: JournalCommand) -> (bool, String) {
        let mut out = Vec::new();
        let ok = run(&JournalArgs { command }, &mut out).unwrap();
        (ok, String::from_utf8(out).unwrap())
    }

    #[test]
    fn verify_and_repair_refuse_a_running_nodes_journal_and_inspect_says_so() {
        let root = tempfile::tempdir().unwrap();
        let data_dir = root.path().join("node-1");
        let core = data_dir.join("journal").join("core-0");
        std::fs::create_dir_all(&core).unwrap();
        std::fs::create_dir_all(data_dir.join("control")).unwrap();
        sample(&core);
        // A running node holds its data_dir's lock.
        let lock = crate::persistence::DataDirLock::acquire(&data_dir).unwrap();
        let pid = format!("process {}", std::process::id());
        // However the path is written: `..`, a link.
        let dotted = data_dir
            .join("journal")
            .join("..")
            .join("journal")
            .join("core-0");
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&core, &link).unwrap();
        for command in [
            JournalCommand::Verify { dir: core.clone() },
            JournalCommand::Verify { dir: dotted },
            JournalCommand::Verify { dir: link },
            JournalCommand::Verify {
                dir: data_dir.join("control"),
            },
            JournalCommand::Repair {
                dir: core.clone(),
                yes: true,
            },
        ] {
            let mut out = Vec::new();
            let err = run(&JournalArgs { command }, &mut out).unwrap_err();
            assert!(matches!(err, JournalCliError::InUse { .. }), "{err}");
            assert!(err.to_string().contains(&pid), "{err}");
            assert!(out.is_empty());
        }
        let inspect = || JournalCommand::Inspect {
            dir: core.clone(),
            persistence_id: None,
        };
        let (ok, text) = run_to_string(inspect());
        assert!(ok, "{text}");
        assert!(text.starts_with("# note: data_dir"), "{text}");
        assert!(text.contains(&pid), "{text}");
        // The node stopped: verify gives its verdict, inspect no note.
        drop(lock);
        let (ok, text) = run_to_string(JournalCommand::Verify { dir: core.clone() });
        assert!(ok && text.contains("result: usable"), "{text}");
        let (_, text) = run_to_string(inspect());
        assert!(!text.contains("# note"), "{text}");
    }

    #[test]
    fn verify_reports_usable_then_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let (ok, text) = run_to_string(JournalCommand::Verify {
            dir: dir.path().to_path_buf(),
        });
        assert!(ok, "{text}");
        assert!(text.contains("records 100 persistence_ids 1"), "{text}");
        assert!(text.contains("result: usable"));
        // Flip a byte inside the first segment's second record (records
        // are 44 + 9 + 5 = 58 bytes, so it starts at 64 + 58 = 122).
        let first = dir.path().join("00000000000000000001.seg");
        let mut b = std::fs::read(&first).unwrap();
        b[64 + 60 + 20] ^= 0xff;
        std::fs::write(&first, b).unwrap();
        let (ok, text) = run_to_string(JournalCommand::Verify {
            dir: dir.path().to_path_buf(),
        });
        assert!(!ok, "{text}");
        assert!(
            text.contains("corruption: segment 00000000000000000001.seg offset 122"),
            "{text}"
        );
        assert!(text.contains("result: CORRUPT"));
        // Inspect lists what is before the corruption, says so, and fails.
        let (ok, text) = run_to_string(JournalCommand::Inspect {
            dir: dir.path().to_path_buf(),
            persistence_id: None,
        });
        assert!(!ok, "{text}");
        assert!(text.contains("1 1 event 0 "), "{text}");
        assert!(
            text.contains("# CORRUPT: segment 00000000000000000001.seg offset 122"),
            "{text}"
        );
    }

    #[test]
    fn verify_says_a_newer_format_is_not_damage() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        // A state checkpoint of format version 99 (a newer build's: its
        // checksum holds).
        let mut b = shardline_journal::format::CHECKPOINT_MAGIC.to_vec();
        b.extend_from_slice(&99u32.to_le_bytes());
        b.extend_from_slice(&[0; 12]);
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        let state = dir.path().join(shardline_journal::format::CHECKPOINT_NAME);
        std::fs::write(&state, b).unwrap();
        let mut out = Vec::new();
        let e = run(
            &JournalArgs {
                command: JournalCommand::Verify {
                    dir: dir.path().to_path_buf(),
                },
            },
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(e, JournalCliError::Open { .. }), "{e}");
        assert!(e.to_string().contains("not a sign of damage"), "{e}");
        let cause = std::error::Error::source(&e)
            .expect("the open error")
            .to_string();
        assert!(cause.contains("format version 99"), "{cause}");
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        // Inspect too.
        let mut out = Vec::new();
        let e = run(
            &JournalArgs {
                command: JournalCommand::Inspect {
                    dir: dir.path().to_path_buf(),
                    persistence_id: None,
                },
            },
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(e, JournalCliError::Open { .. }), "{e}");
        assert!(out.is_empty(), "{}", String::from_utf8_lossy(&out));
        // The same file with a flipped version bit (the checksum fails):
        // damage, reported as corruption.
        let mut b = std::fs::read(&state).unwrap();
        b[8..12].copy_from_slice(&1u32.to_le_bytes());
        b[9] ^= 1;
        std::fs::write(&state, b).unwrap();
        let (ok, text) = run_to_string(JournalCommand::Verify {
            dir: dir.path().to_path_buf(),
        });
        assert!(!ok, "{text}");
        assert!(text.contains("result: CORRUPT"), "{text}");
    }

    #[test]
    fn verify_and_inspect_fail_on_a_damaged_state_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let state = dir.path().join(shardline_journal::format::CHECKPOINT_NAME);
        std::fs::write(&state, [0x5a; 100]).unwrap();
        let (ok, text) = run_to_string(JournalCommand::Verify {
            dir: dir.path().to_path_buf(),
        });
        assert!(!ok, "{text}");
        assert!(
            text.contains("corruption: opening it read-only: "),
            "{text}"
        );
        assert!(text.contains("result: CORRUPT"), "{text}");
        let (ok, text) = run_to_string(JournalCommand::Inspect {
            dir: dir.path().to_path_buf(),
            persistence_id: None,
        });
        assert!(!ok, "{text}");
        assert!(
            text.contains("# CORRUPT: the journal does not open"),
            "{text}"
        );
    }

    #[test]
    fn repair_needs_yes_then_cuts_at_the_corruption_and_the_journal_opens_again() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let first = dir.path().join("00000000000000000001.seg");
        let mut b = std::fs::read(&first).unwrap();
        b[64 + 60 + 20] ^= 0xff;
        std::fs::write(&first, b).unwrap();
        // A full scan on open, as for an active segment (sealed ones are
        // otherwise checked on replay).
        let strict = JournalOptions {
            segment_size_bytes: 4096,
            verify_all_on_open: true,
            ..JournalOptions::default()
        };
        assert!(Journal::open(dir.path(), strict.clone()).is_err());
        let mut out = Vec::new();
        let err = run(
            &JournalArgs {
                command: JournalCommand::Repair {
                    dir: dir.path().to_path_buf(),
                    yes: false,
                },
            },
            &mut out,
        )
        .unwrap_err();
        assert!(matches!(err, JournalCliError::NotConfirmed), "{err}");
        let (ok, text) = run_to_string(JournalCommand::Repair {
            dir: dir.path().to_path_buf(),
            yes: true,
        });
        assert!(ok);
        assert!(
            text.contains("segment 00000000000000000001.seg at offset 122"),
            "{text}"
        );
        let (ok, text) = run_to_string(JournalCommand::Verify {
            dir: dir.path().to_path_buf(),
        });
        assert!(ok, "{text}");
        // The first record survives; the strict open of a node works again.
        let (j, report) = Journal::open(dir.path(), strict).unwrap();
        assert!(report.records >= 1, "{report:?}");
        j.close().unwrap();
    }

    #[test]
    fn inspect_lists_records_and_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        sample(dir.path());
        let (ok, text) = run_to_string(JournalCommand::Inspect {
            dir: dir.path().to_path_buf(),
            persistence_id: Some("counter|a".into()),
        });
        assert!(ok, "{text}");
        assert!(!text.contains("CORRUPT"), "{text}");
        assert!(text.contains("1 1 event 0 "), "{text}");
        assert!(text.contains("# 100 records"), "{text}");
        assert!(text.contains("# snapshot of counter|a at seq 50"), "{text}");
        let (_, text) = run_to_string(JournalCommand::Inspect {
            dir: dir.path().to_path_buf(),
            persistence_id: Some("nobody".into()),
        });
        assert!(text.contains("# 0 records"), "{text}");
    }
}
