//! File access behind a small trait, so the journal's logic does not depend
//! on how bytes reach the disk. Three implementations:
//!
//! - [`MmapStorage`]: a directory of files; segments are preallocated with
//!   `posix_fallocate`, zero-filled in written-back chunks, made durable,
//!   then memory-mapped with `MAP_POPULATE` (prefaulted). Durability is `fdatasync` of the file.
//! - [`MemoryStorage`]: files in memory, shared by clones (a "directory"
//!   that survives closing and reopening a journal within one process).
//! - [`FaultyStorage`]: wraps another storage and injects `EIO` on write or
//!   sync and `ENOSPC` on segment preallocation, for tests.
//!
//! A direct-I/O implementation could replace `MmapStorage` behind the same
//! trait.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::ops::Deref;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use memmap2::{Mmap, MmapMut, MmapOptions};

/// Makes a segment's written bytes durable. Shared with the sync thread,
/// which calls it while the writer keeps writing.
pub trait SegmentSync: Send + Sync {
    /// Blocks until every byte written to the segment before the call is
    /// durable.
    ///
    /// # Errors
    /// The I/O error of the flush; the journal poisons itself on any.
    fn sync(&self) -> io::Result<()>;
}

/// A borrowed read view of a segment's bytes.
pub type SegmentView<'a> = Box<dyn Deref<Target = [u8]> + 'a>;

/// The bytes of a whole file, owned (see [`Storage::map_file`]).
pub type MappedFile = Box<dyn Deref<Target = [u8]> + Send + Sync>;

/// One segment file, open for reading, or for reading and writing.
pub trait SegmentFile: Send + Sync {
    /// The file's length, in bytes.
    fn len_bytes(&self) -> u64;
    /// A view of the file's bytes. For a file that another writer is
    /// appending to, bytes past the last complete record may change.
    fn view(&self) -> SegmentView<'_>;
    /// Copies `data` to `offset`.
    ///
    /// # Errors
    /// `InvalidInput` past the end; `PermissionDenied` on a read-only file;
    /// injected faults in [`FaultyStorage`].
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// A handle that makes this file's writes durable, for the sync thread.
    fn syncer(&self) -> Arc<dyn SegmentSync>;
}

/// A file read and written at offsets through one open handle: the
/// snapshot table (`journal/FORMAT.md`, "Snapshot table"). Reads and
/// writes may come from different threads.
pub trait TableFile: Send + Sync {
    /// The file's length, in bytes.
    ///
    /// # Errors
    /// The I/O error of reading the length.
    fn len_bytes(&self) -> io::Result<u64>;
    /// Reads into `buf` from `offset`; returns the bytes read, fewer than
    /// `buf.len()` only at the end of the file.
    ///
    /// # Errors
    /// The I/O error of the read.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize>;
    /// Writes `data` at `offset`, growing the file when it ends before.
    /// Durable after [`TableFile::sync`].
    ///
    /// # Errors
    /// `PermissionDenied` on a read-only handle; the I/O error of the
    /// write; injected faults in [`FaultyStorage`].
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Makes every write before the call durable (`fdatasync`: the data
    /// and the length).
    ///
    /// # Errors
    /// The I/O error of the flush.
    fn sync(&self) -> io::Result<()>;
}

/// A journal directory.
pub trait Storage: Send + Sync + std::fmt::Debug {
    /// Names of the files in the directory.
    ///
    /// # Errors
    /// The I/O error of listing the directory.
    fn list(&self) -> io::Result<Vec<String>>;
    /// Creates `name` with `size_bytes` bytes, preallocated, zeroed and
    /// prefaulted, open for writing. An existing file is replaced.
    ///
    /// # Errors
    /// `ENOSPC` (`StorageFull`) when the space cannot be preallocated, or
    /// another I/O error.
    fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>>;
    /// Opens an existing segment; writable when `writable`.
    ///
    /// # Errors
    /// `NotFound`, or another I/O error.
    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>>;
    /// Shortens `name` to `len_bytes` and makes that durable.
    ///
    /// # Errors
    /// The I/O error.
    fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()>;
    /// Reads a whole (small) file.
    ///
    /// # Errors
    /// `NotFound`, or another I/O error.
    fn read_file(&self, name: &str) -> io::Result<Vec<u8>>;

    /// The whole of small file `name` (an index file), readable for as long
    /// as the returned value lives, even after the file is removed. The
    /// default reads it into memory ([`Storage::read_file`]);
    /// [`MmapStorage`] maps it read-only instead, so that its bytes are page
    /// cache the kernel may drop, not heap.
    ///
    /// # Errors
    /// The I/O error of opening, reading or mapping it.
    fn map_file(&self, name: &str) -> io::Result<MappedFile> {
        Ok(Box::new(self.read_file(name)?))
    }
    /// Replaces `name` with `bytes` atomically and durably (write a
    /// temporary file, sync it, rename it, sync the directory).
    ///
    /// # Errors
    /// The I/O error; the old contents are then still in place.
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()>;
    /// Creates or replaces `name` with `bytes`, without making it durable
    /// (see [`Storage::sync_file`]).
    ///
    /// # Errors
    /// The I/O error.
    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()>;
    /// Makes the contents of `name` durable (`fdatasync`: the data and the
    /// metadata needed to read it back); its directory entry is durable
    /// after [`Storage::sync_dir`].
    ///
    /// # Errors
    /// `NotFound`, or the I/O error of the flush.
    fn sync_file(&self, name: &str) -> io::Result<()>;
    /// [`Storage::write_file`] then [`Storage::sync_file`] of `name`; the
    /// directory storage does both through one open file, writing over the
    /// old contents in place (a file rewritten with the same length keeps
    /// its blocks, so the flush writes the data and no block map).
    ///
    /// # Errors
    /// The I/O error of the write or of the flush; `name` then holds
    /// unknown contents.
    fn write_file_synced(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.write_file(name, bytes)?;
        self.sync_file(name)
    }
    /// Renames `from` to `to` (replacing `to`). Durable after
    /// [`Storage::sync_dir`].
    ///
    /// # Errors
    /// The I/O error.
    fn rename(&self, from: &str, to: &str) -> io::Result<()>;
    /// Swaps the files `a` and `b` atomically (Linux `renameat2` with
    /// `RENAME_EXCHANGE`): both must exist; each name then holds the other's
    /// contents. Durable after [`Storage::sync_dir`]. A snapshot replaced
    /// this way reuses the old file as the next one's spare, so saving it
    /// again creates and frees no inode.
    ///
    /// # Errors
    /// `Unsupported` when the storage cannot (the default; the caller then
    /// renames), or the I/O error (`NotFound` when either is missing).
    fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        let _ = (a, b);
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Removes `name`. Durable after [`Storage::sync_dir`].
    ///
    /// # Errors
    /// The I/O error.
    fn remove(&self, name: &str) -> io::Result<()>;
    /// Makes creations, renames and removals in the directory durable.
    ///
    /// # Errors
    /// The I/O error.
    fn sync_dir(&self) -> io::Result<()>;
    /// Opens `name` for reads and writes at offsets ([`TableFile`]);
    /// `writable` creates it when missing (its directory entry is durable
    /// after [`Storage::sync_dir`]).
    ///
    /// # Errors
    /// `Unsupported` when the storage has no such files (the default: the
    /// journal then keeps every snapshot in a file of its own); `NotFound`
    /// when not `writable` and it does not exist; another I/O error.
    fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
        let _ = (name, writable);
        Err(io::ErrorKind::Unsupported.into())
    }
}

// ---------------------------------------------------------------- mmap

/// The production storage: a directory of memory-mapped files.
#[derive(Debug, Clone)]
pub struct MmapStorage {
    dir: PathBuf,
    zero_fill: bool,
}

impl MmapStorage {
    /// Uses `dir`, creating it when missing.
    ///
    /// # Errors
    /// The I/O error of creating the directory.
    pub fn new(dir: impl AsRef<Path>) -> io::Result<Self> {
        std::fs::create_dir_all(dir.as_ref())?;
        Ok(Self {
            dir: dir.as_ref().to_path_buf(),
            zero_fill: true,
        })
    }

    /// Uses an existing `dir` without creating anything (for read-only
    /// access).
    ///
    /// # Errors
    /// `NotFound` when `dir` is not a directory.
    pub fn existing(dir: impl AsRef<Path>) -> io::Result<Self> {
        if !dir.as_ref().is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} is not a directory", dir.as_ref().display()),
            ));
        }
        Ok(Self {
            dir: dir.as_ref().to_path_buf(),
            zero_fill: true,
        })
    }

    /// Whether new segments are zero-filled (written with zeros and
    /// `fdatasync`ed) after `posix_fallocate`. Default true: later flushes
    /// then write data pages only, with no unwritten-extent conversion to
    /// commit; the price is writing each segment twice. False leaves the
    /// space as unwritten extents.
    pub fn with_zero_fill(mut self, zero_fill: bool) -> Self {
        self.zero_fill = zero_fill;
        self
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

/// Preallocates `size_bytes` for `file` with `posix_fallocate`.
///
/// # Errors
/// `ENOSPC` when the file system has not enough space, or another errno.
pub fn preallocate(file: &File, size_bytes: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(size_bytes)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
    // SAFETY: plain syscall on a valid, open file descriptor.
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

/// Bytes [`zero_fill`] writes and writes back at a time (256 KiB).
pub const ZERO_FILL_CHUNK_BYTES: usize = 256 << 10;

/// Writes zeros over the first `size_bytes` of `file` and `fdatasync`s it,
/// so that later writes through a mapping hit already allocated, written
/// blocks and a later `fdatasync` has no extent conversion to commit.
///
/// It goes [`ZERO_FILL_CHUNK_BYTES`] at a time, starting each chunk's
/// writeback (`sync_file_range`) and waiting for the chunk before: the
/// device queue never holds more than two chunks of zeros, so a journal's own
/// flushes running meanwhile (the spare segment is prepared while the
/// active one takes appends) wait behind at most that much, instead of
/// behind a whole segment's writeback. The final `fdatasync` then only
/// commits the metadata (extent conversions).
///
/// # Errors
/// The I/O error of writing or syncing.
pub fn zero_fill(file: &File, size_bytes: u64) -> io::Result<()> {
    let chunk = vec![0u8; ZERO_FILL_CHUNK_BYTES];
    let mut at = 0u64;
    let mut previous: Option<(u64, u64)> = None;
    while at < size_bytes {
        let n = (size_bytes - at).min(chunk.len() as u64);
        file.write_all_at(&chunk[..n as usize], at)?;
        // Start this chunk's writeback, then wait for the one before: at
        // most two chunks are queued at any time.
        write_back(file, at, n, false)?;
        if let Some((o, l)) = previous {
            write_back(file, o, l, true)?;
        }
        previous = Some((at, n));
        at += n;
    }
    file.sync_data()
}

/// Starts writeback of `len` bytes at `offset`, and waits for it to
/// complete when `wait` (data only: not a durability point, no metadata,
/// no cache flush).
#[cfg(target_os = "linux")]
fn write_back(file: &File, offset: u64, len: u64, wait: bool) -> io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Ok(());
    };
    let flags = if wait {
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER
    } else {
        libc::SYNC_FILE_RANGE_WRITE
    };
    // SAFETY: plain syscall on an open descriptor; no memory is passed.
    let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, flags) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn write_back(_file: &File, _offset: u64, _len: u64, _wait: bool) -> io::Result<()> {
    Ok(())
}

/// Lowers the calling thread's CPU priority (nice 10) and I/O priority
/// (best-effort class, lowest level), best effort: for the thread that
/// prepares the spare segment, whose work must not delay appends or
/// flushes. Not the idle I/O class: a scheduler may starve it for seconds
/// while anything else does I/O, and the next roll waits for the spare.
/// Errors (no permission) are ignored: the work is the same, only its
/// priority differs.
pub fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    {
        // ioprio_set(2): IOPRIO_WHO_PROCESS = 1 (a thread id), value =
        // class << 13 | level, IOPRIO_CLASS_BE = 2, level 7 the lowest
        // (linux/ioprio.h).
        const IOPRIO_WHO_PROCESS: libc::c_long = 1;
        const IOPRIO_LOW: libc::c_long = (2 << 13) | 7;
        // SAFETY: gettid, setpriority and ioprio_set take no pointers and
        // only change the calling thread's scheduling attributes.
        unsafe {
            let tid = libc::gettid();
            let _ = libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 10);
            let _ = libc::syscall(
                libc::SYS_ioprio_set,
                IOPRIO_WHO_PROCESS,
                libc::c_long::from(tid),
                IOPRIO_LOW,
            );
        }
    }
}

struct FileSync(Arc<File>);

impl SegmentSync for FileSync {
    fn sync(&self) -> io::Result<()> {
        self.0.sync_data()
    }
}

enum Map {
    Rw(MmapMut),
    Ro(Mmap),
    Empty,
}

struct MmapSegment {
    file: Arc<File>,
    map: Map,
}

impl SegmentFile for MmapSegment {
    fn len_bytes(&self) -> u64 {
        self.view().len() as u64
    }
    fn view(&self) -> SegmentView<'_> {
        match &self.map {
            Map::Rw(m) => Box::new(&m[..]),
            Map::Ro(m) => Box::new(&m[..]),
            Map::Empty => Box::new(&[][..]),
        }
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let Map::Rw(m) = &mut self.map else {
            return Err(read_only("segment"));
        };
        let start = usize::try_from(offset).map_err(|_| past_end())?;
        let end = start.checked_add(data.len()).ok_or_else(past_end)?;
        m.get_mut(start..end)
            .ok_or_else(past_end)?
            .copy_from_slice(data);
        Ok(())
    }
    fn syncer(&self) -> Arc<dyn SegmentSync> {
        Arc::new(FileSync(self.file.clone()))
    }
}

/// The error of a write through a handle opened read-only (`what`: the
/// kind of file).
fn read_only(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!("{what} is open read-only"),
    )
}

fn past_end() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        "write past the end of the segment",
    )
}

fn map_file(file: File, writable: bool, populate: bool) -> io::Result<MmapSegment> {
    let len = file.metadata()?.len();
    let file = Arc::new(file);
    if len == 0 {
        return Ok(MmapSegment {
            file,
            map: Map::Empty,
        });
    }
    let len = usize::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidData, "file too large to map"))?;
    let mut opts = MmapOptions::new();
    opts.len(len);
    if populate {
        opts.populate();
    }
    // SAFETY: the journal is the only writer of its directory (one writer
    // per directory, enforced by the caller); readers of another writer's
    // directory only interpret bytes up to the last complete record and
    // validate every record's CRC, so concurrent appends past that point do
    // not change what they read. The file is never truncated while mapped
    // by this process.
    let map = unsafe {
        if writable {
            Map::Rw(opts.map_mut(&*file)?)
        } else {
            Map::Ro(opts.map(&*file)?)
        }
    };
    Ok(MmapSegment { file, map })
}

impl Storage for MmapStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir)? {
            let e = e?;
            if let Some(n) = e.file_name().to_str() {
                out.push(n.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(self.path(name))?;
        preallocate(&file, size_bytes)?;
        if self.zero_fill {
            zero_fill(&file, size_bytes)?;
        }
        Ok(Box::new(map_file(file, true, true)?))
    }

    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .open(self.path(name))?;
        Ok(Box::new(map_file(file, writable, false)?))
    }

    fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(self.path(name))?;
        file.set_len(len_bytes)?;
        file.sync_all()
    }

    fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
        std::fs::read(self.path(name))
    }
    fn map_file(&self, name: &str) -> io::Result<MappedFile> {
        let file = File::open(self.path(name))?;
        if file.metadata()?.len() == 0 {
            return Ok(Box::new(Vec::new()));
        }
        // SAFETY: index files are written whole under a temporary name and
        // renamed into place, never written or truncated afterwards; a
        // removal while mapped leaves the mapping valid. The map outlives
        // the descriptor, which is closed here (no descriptor per sealed
        // segment's index).
        let map = unsafe { Mmap::map(&file)? };
        Ok(Box::new(map))
    }

    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        let tmp = format!("{name}{}", crate::format::TMP_SUFFIX);
        {
            let mut f = File::create(self.path(&tmp))?;
            f.write_all(bytes)?;
            f.sync_all()?;
        }
        std::fs::rename(self.path(&tmp), self.path(name))?;
        self.sync_dir()
    }

    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        std::fs::write(self.path(name), bytes)
    }

    fn sync_file(&self, name: &str) -> io::Result<()> {
        File::open(self.path(name))?.sync_data()
    }

    fn write_file_synced(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        // No O_TRUNC: truncating frees the blocks and the write allocates
        // them again, which makes every flush write the block map too.
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.path(name))?;
        f.write_all(bytes)?;
        let len = bytes.len() as u64;
        if f.metadata()?.len() > len {
            f.set_len(len)?;
        }
        f.sync_data()
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        std::fs::rename(self.path(from), self.path(to))
    }

    fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let cstr = |p: PathBuf| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in a file name"))
        };
        let (a, b) = (cstr(self.path(a))?, cstr(self.path(b))?);
        // SAFETY: both paths are NUL-terminated strings that outlive the
        // call; renameat2 reads them and touches no other memory.
        let r = unsafe {
            libc::syscall(
                libc::SYS_renameat2,
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    fn remove(&self, name: &str) -> io::Result<()> {
        std::fs::remove_file(self.path(name))
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(writable)
            .create(writable)
            .truncate(false)
            .open(self.path(name))?;
        Ok(Box::new(FsTable { file, writable }))
    }
}

/// A [`TableFile`] of the directory storage: `pread`/`pwrite` on one open
/// file, flushed with `fdatasync`.
struct FsTable {
    file: File,
    writable: bool,
}

impl TableFile for FsTable {
    fn len_bytes(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(done)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        if !self.writable {
            return Err(read_only("table"));
        }
        self.file.write_all_at(data, offset)
    }
    fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

// ---------------------------------------------------------------- memory

type MemFile = Arc<Mutex<Vec<u8>>>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Files in memory. Clones share the same files, so a journal can be closed
/// and reopened on a clone. Nothing is ever lost: every write is "durable".
#[derive(Debug, Clone, Default)]
pub struct MemoryStorage {
    files: Arc<Mutex<BTreeMap<String, MemFile>>>,
}

impl MemoryStorage {
    /// An empty in-memory directory.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the bytes of `name` (for tests that corrupt files).
    /// Returns `None` when the file does not exist.
    pub fn with_file_mut<R>(&self, name: &str, f: impl FnOnce(&mut Vec<u8>) -> R) -> Option<R> {
        let file = lock(&self.files).get(name).cloned()?;
        let mut g = lock(&file);
        Some(f(&mut g))
    }

    fn get(&self, name: &str) -> io::Result<MemFile> {
        lock(&self.files)
            .get(name)
            .cloned()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_string()))
    }
}

struct MemSegment {
    file: MemFile,
    writable: bool,
}

struct MemView<'a>(MutexGuard<'a, Vec<u8>>);

impl Deref for MemView<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

struct NoopSync;

impl SegmentSync for NoopSync {
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}

impl SegmentFile for MemSegment {
    fn len_bytes(&self) -> u64 {
        lock(&self.file).len() as u64
    }
    fn view(&self) -> SegmentView<'_> {
        Box::new(MemView(lock(&self.file)))
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        if !self.writable {
            return Err(read_only("segment"));
        }
        let mut g = lock(&self.file);
        let start = usize::try_from(offset).map_err(|_| past_end())?;
        let end = start.checked_add(data.len()).ok_or_else(past_end)?;
        g.get_mut(start..end)
            .ok_or_else(past_end)?
            .copy_from_slice(data);
        Ok(())
    }
    fn syncer(&self) -> Arc<dyn SegmentSync> {
        Arc::new(NoopSync)
    }
}

impl Storage for MemoryStorage {
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(lock(&self.files).keys().cloned().collect())
    }
    fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>> {
        let len = usize::try_from(size_bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
        let file = Arc::new(Mutex::new(vec![0u8; len]));
        lock(&self.files).insert(name.to_string(), file.clone());
        Ok(Box::new(MemSegment {
            file,
            writable: true,
        }))
    }
    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(MemSegment {
            file: self.get(name)?,
            writable,
        }))
    }
    fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()> {
        let f = self.get(name)?;
        let len = usize::try_from(len_bytes)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size too large"))?;
        lock(&f).resize(len, 0);
        Ok(())
    }
    fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
        let f = self.get(name)?;
        let bytes = lock(&f).clone();
        Ok(bytes)
    }
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        lock(&self.files).insert(name.to_string(), Arc::new(Mutex::new(bytes.to_vec())));
        Ok(())
    }
    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.write_file_durable(name, bytes)
    }
    fn sync_file(&self, name: &str) -> io::Result<()> {
        self.get(name).map(|_| ())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let mut files = lock(&self.files);
        let f = files
            .remove(from)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, from.to_string()))?;
        files.insert(to.to_string(), f);
        Ok(())
    }
    fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        let mut files = lock(&self.files);
        let missing = |n: &str| io::Error::new(io::ErrorKind::NotFound, n.to_string());
        let fa = files.get(a).cloned().ok_or_else(|| missing(a))?;
        let fb = files.get(b).cloned().ok_or_else(|| missing(b))?;
        files.insert(a.to_string(), fb);
        files.insert(b.to_string(), fa);
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        lock(&self.files)
            .remove(name)
            .map(|_| ())
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, name.to_string()))
    }
    fn sync_dir(&self) -> io::Result<()> {
        Ok(())
    }
    fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
        let file = if writable {
            lock(&self.files)
                .entry(name.to_string())
                .or_insert_with(|| Arc::new(Mutex::new(Vec::new())))
                .clone()
        } else {
            self.get(name)?
        };
        Ok(Box::new(MemTable { file, writable }))
    }
}

struct MemTable {
    file: MemFile,
    writable: bool,
}

impl TableFile for MemTable {
    fn len_bytes(&self) -> io::Result<u64> {
        Ok(lock(&self.file).len() as u64)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let g = lock(&self.file);
        let start = usize::try_from(offset).unwrap_or(usize::MAX).min(g.len());
        let n = buf.len().min(g.len() - start);
        buf[..n].copy_from_slice(&g[start..start + n]);
        Ok(n)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if !self.writable {
            return Err(read_only("table"));
        }
        let mut g = lock(&self.file);
        let start = usize::try_from(offset).map_err(|_| past_end())?;
        let end = start.checked_add(data.len()).ok_or_else(past_end)?;
        if g.len() < end {
            g.resize(end, 0);
        }
        g[start..end].copy_from_slice(data);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        Ok(())
    }
}

// ---------------------------------------------------------------- faults

/// Switches for [`FaultyStorage`]; shared, so a test can flip them while a
/// journal runs.
#[derive(Debug, Default)]
pub struct Faults {
    /// Every segment sync fails with `EIO` while set.
    pub fail_sync: AtomicBool,
    /// Every segment write fails with `EIO` while set.
    pub fail_write: AtomicBool,
    /// Every segment creation fails with `ENOSPC` while set.
    pub fail_preallocate: AtomicBool,
    /// Count of syncs that succeeded.
    pub syncs: AtomicU64,
    /// Every segment sync waits while set (a slow disk): it polls the flag
    /// every millisecond, then goes on.
    pub stall_sync: AtomicBool,
    /// [`Storage::open_table`] answers `Unsupported` while set (a storage
    /// without tables: the journal keeps a file per snapshot).
    pub no_tables: AtomicBool,
}

/// Wraps a storage and injects faults as [`Faults`] says.
#[derive(Debug, Clone)]
pub struct FaultyStorage<S> {
    inner: S,
    faults: Arc<Faults>,
}

impl<S: Storage> FaultyStorage<S> {
    /// Wraps `inner`; no fault is set.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            faults: Arc::new(Faults::default()),
        }
    }

    /// The shared fault switches.
    pub fn faults(&self) -> Arc<Faults> {
        self.faults.clone()
    }
}

struct FaultySegment {
    inner: Box<dyn SegmentFile>,
    faults: Arc<Faults>,
}

struct FaultySync {
    inner: Arc<dyn SegmentSync>,
    faults: Arc<Faults>,
}

fn eio() -> io::Error {
    io::Error::from_raw_os_error(libc::EIO)
}

impl SegmentSync for FaultySync {
    fn sync(&self) -> io::Result<()> {
        while self.faults.stall_sync.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.sync()?;
        self.faults.syncs.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl SegmentFile for FaultySegment {
    fn len_bytes(&self) -> u64 {
        self.inner.len_bytes()
    }
    fn view(&self) -> SegmentView<'_> {
        self.inner.view()
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.faults.fail_write.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.write_at(offset, data)
    }
    fn syncer(&self) -> Arc<dyn SegmentSync> {
        Arc::new(FaultySync {
            inner: self.inner.syncer(),
            faults: self.faults.clone(),
        })
    }
}

impl<S: Storage> Storage for FaultyStorage<S> {
    fn list(&self) -> io::Result<Vec<String>> {
        self.inner.list()
    }
    fn create_segment(&self, name: &str, size_bytes: u64) -> io::Result<Box<dyn SegmentFile>> {
        if self.faults.fail_preallocate.load(Ordering::SeqCst) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(Box::new(FaultySegment {
            inner: self.inner.create_segment(name, size_bytes)?,
            faults: self.faults.clone(),
        }))
    }
    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(FaultySegment {
            inner: self.inner.open_segment(name, writable)?,
            faults: self.faults.clone(),
        }))
    }
    fn truncate(&self, name: &str, len_bytes: u64) -> io::Result<()> {
        self.inner.truncate(name, len_bytes)
    }
    fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
        self.inner.read_file(name)
    }
    fn map_file(&self, name: &str) -> io::Result<MappedFile> {
        self.inner.map_file(name)
    }
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.write_file_durable(name, bytes)
    }
    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        if self.faults.fail_write.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.write_file(name, bytes)
    }
    fn sync_file(&self, name: &str) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.sync_file(name)
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.inner.rename(from, to)
    }
    fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        self.inner.exchange(a, b)
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.inner.remove(name)
    }
    fn sync_dir(&self) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.sync_dir()
    }
    fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
        if self.faults.no_tables.load(Ordering::SeqCst) {
            return Err(io::ErrorKind::Unsupported.into());
        }
        Ok(Box::new(FaultyTable {
            inner: self.inner.open_table(name, writable)?,
            faults: self.faults.clone(),
        }))
    }
}

/// A [`TableFile`] whose writes fail under `fail_write` and whose syncs
/// fail under `fail_sync`.
struct FaultyTable {
    inner: Box<dyn TableFile>,
    faults: Arc<Faults>,
}

impl TableFile for FaultyTable {
    fn len_bytes(&self) -> io::Result<u64> {
        self.inner.len_bytes()
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.inner.read_at(offset, buf)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        if self.faults.fail_write.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.write_at(offset, data)
    }
    fn sync(&self) -> io::Result<()> {
        if self.faults.fail_sync.load(Ordering::SeqCst) {
            return Err(eio());
        }
        self.inner.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mmap_segment_write_and_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let s = MmapStorage::new(dir.path()).unwrap();
        let mut seg = s.create_segment("a.seg", 8192).unwrap();
        assert_eq!(seg.len_bytes(), 8192);
        seg.write_at(100, b"hello").unwrap();
        assert!(seg.write_at(8190, b"toolong").is_err());
        seg.syncer().sync().unwrap();
        drop(seg);
        let ro = s.open_segment("a.seg", false).unwrap();
        assert_eq!(&ro.view()[100..105], b"hello");
        s.truncate("a.seg", 200).unwrap();
        assert_eq!(s.open_segment("a.seg", false).unwrap().len_bytes(), 200);
        s.write_file_durable("x", b"abc").unwrap();
        assert_eq!(s.read_file("x").unwrap(), b"abc");
        assert_eq!(
            s.list().unwrap(),
            vec!["a.seg".to_string(), "x".to_string()]
        );
    }

    #[test]
    fn write_file_synced_replaces_the_contents_in_place_at_any_length() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let s = MmapStorage::new(dir.path()).unwrap();
        s.write_file_synced("snap", b"0123456789").unwrap();
        assert_eq!(s.read_file("snap").unwrap(), b"0123456789");
        let ino = std::fs::metadata(dir.path().join("snap")).unwrap().ino();
        // Same length: rewritten in place (same inode, new bytes).
        s.write_file_synced("snap", b"abcdefghij").unwrap();
        assert_eq!(s.read_file("snap").unwrap(), b"abcdefghij");
        assert_eq!(
            std::fs::metadata(dir.path().join("snap")).unwrap().ino(),
            ino
        );
        // Shorter: the old tail is cut off; longer: it grows.
        s.write_file_synced("snap", b"xyz").unwrap();
        assert_eq!(s.read_file("snap").unwrap(), b"xyz");
        s.write_file_synced("snap", b"0123456789ABCDEF").unwrap();
        assert_eq!(s.read_file("snap").unwrap(), b"0123456789ABCDEF");
        // Through a faulty storage the injected failures apply.
        let f = FaultyStorage::new(s.clone());
        f.faults().fail_sync.store(true, Ordering::SeqCst);
        assert!(f.write_file_synced("snap", b"q").is_err());
    }

    #[test]
    fn faulty_storage_injects() {
        let s = FaultyStorage::new(MemoryStorage::new());
        let f = s.faults();
        f.fail_preallocate.store(true, Ordering::SeqCst);
        let e = s.create_segment("a", 10).err().unwrap();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC));
        f.fail_preallocate.store(false, Ordering::SeqCst);
        let mut seg = s.create_segment("a", 10).unwrap();
        f.fail_write.store(true, Ordering::SeqCst);
        assert_eq!(
            seg.write_at(0, b"x").unwrap_err().raw_os_error(),
            Some(libc::EIO)
        );
        f.fail_sync.store(true, Ordering::SeqCst);
        assert!(seg.syncer().sync().is_err());
    }
}
