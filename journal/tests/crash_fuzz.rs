//! Crash consistency, randomized. A storage that models what
//! is durable (segment data at its syncs, files at `sync_file` /
//! `write_file_durable`, directory entries at `sync_dir`), crash copies
//! taken at random storage operations on every thread and at random
//! points of a random run of appends, snapshots (table and file),
//! deletions, `maintain()` calls, waits and close/reopen.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::pid;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shardline_journal::storage::{
    MemoryStorage, SegmentFile, SegmentSync, SegmentView, Storage, TableFile,
};
use shardline_journal::{
    Durability, DurabilityWatcher, Journal, JournalOptions, Lsn, SequenceNr, WriterEpoch,
};

#[derive(Default)]
struct Inode {
    cur: Mutex<Vec<u8>>,
    durable: Mutex<Vec<u8>>,
}

enum NsOp {
    Set(String, Arc<Inode>),
    Remove(String),
    Rename(String, String),
    Exchange(String, String),
}

fn apply(m: &mut BTreeMap<String, Arc<Inode>>, op: &NsOp) {
    match op {
        NsOp::Set(n, i) => {
            m.insert(n.clone(), i.clone());
        }
        NsOp::Remove(n) => {
            m.remove(n);
        }
        NsOp::Rename(a, b) => {
            if let Some(i) = m.remove(a) {
                m.insert(b.clone(), i);
            }
        }
        NsOp::Exchange(a, b) => {
            if let (Some(x), Some(y)) = (m.get(a).cloned(), m.get(b).cloned()) {
                m.insert(a.clone(), y);
                m.insert(b.clone(), x);
            }
        }
    }
}

#[derive(Default)]
struct State {
    names: BTreeMap<String, Arc<Inode>>,
    durable: BTreeMap<String, Arc<Inode>>,
    pending: Vec<NsOp>,
}

impl State {
    fn push(&mut self, op: NsOp) {
        apply(&mut self.names, &op);
        self.pending.push(op);
    }
    fn sync_dir(&mut self) {
        for op in std::mem::take(&mut self.pending) {
            apply(&mut self.durable, &op);
        }
    }
}

struct CrashCopy {
    durable: Lsn,
    generation: usize,
    site: String,
    storage: MemoryStorage,
}

struct Hook {
    rng: Mutex<StdRng>,
    watcher: Mutex<Option<DurabilityWatcher>>,
    generation: AtomicU64,
    copies: Mutex<Vec<CrashCopy>>,
    prob: f64,
    max: usize,
    prefix_mode: bool,
}

#[derive(Clone)]
struct Sim {
    st: Arc<Mutex<State>>,
    hook: Arc<Hook>,
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sim")
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn nf(n: &str) -> io::Error {
    io::Error::new(io::ErrorKind::NotFound, n.to_string())
}

impl Sim {
    fn new(seed: u64, prob: f64, max: usize, prefix_mode: bool) -> Sim {
        Sim {
            st: Arc::default(),
            hook: Arc::new(Hook {
                rng: Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed)),
                watcher: Mutex::new(None),
                generation: AtomicU64::new(0),
                copies: Mutex::new(Vec::new()),
                prob,
                max,
                prefix_mode,
            }),
        }
    }

    /// Maybe takes a crash copy (always with `force`).
    fn crash(&self, site: &str, force: bool) {
        let h = &self.hook;
        let (take, k_seed) = {
            let mut r = lock(&h.rng);
            (force || r.gen_bool(h.prob), r.gen::<u64>())
        };
        if !take || lock(&h.copies).len() >= h.max {
            return;
        }
        let Some(durable) = lock(&h.watcher).as_ref().map(|w| w.durable_lsn()) else {
            return;
        };
        let generation = h.generation.load(Ordering::SeqCst) as usize;
        let st = lock(&self.st);
        let mut names = st.durable.clone();
        let k = if h.prefix_mode {
            (k_seed as usize) % (st.pending.len() + 1)
        } else {
            0
        };
        for op in &st.pending[..k] {
            apply(&mut names, op);
        }
        let storage = MemoryStorage::new();
        for (n, i) in &names {
            storage
                .write_file_durable(n, &lock(&i.durable).clone())
                .unwrap();
        }
        drop(st);
        let thread = std::thread::current().name().unwrap_or("?").to_string();
        lock(&h.copies).push(CrashCopy {
            durable,
            generation,
            site: format!("{site} on {thread} (prefix {k})"),
            storage,
        });
    }

    fn get(&self, n: &str) -> io::Result<Arc<Inode>> {
        lock(&self.st).names.get(n).cloned().ok_or_else(|| nf(n))
    }
}

struct View<'a>(MutexGuard<'a, Vec<u8>>);
impl Deref for View<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

struct SimSeg {
    ino: Arc<Inode>,
    sim: Sim,
    writable: bool,
}

struct SimSync {
    ino: Arc<Inode>,
    sim: Sim,
}

impl SegmentSync for SimSync {
    fn sync(&self) -> io::Result<()> {
        self.sim.crash("before segment sync", false);
        {
            let _st = lock(&self.sim.st);
            let c = lock(&self.ino.cur).clone();
            *lock(&self.ino.durable) = c;
        }
        self.sim.crash("after segment sync", false);
        Ok(())
    }
}

impl SegmentFile for SimSeg {
    fn len_bytes(&self) -> u64 {
        lock(&self.ino.cur).len() as u64
    }
    fn view(&self) -> SegmentView<'_> {
        Box::new(View(lock(&self.ino.cur)))
    }
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        if !self.writable {
            return Err(io::ErrorKind::PermissionDenied.into());
        }
        let mut g = lock(&self.ino.cur);
        let s = offset as usize;
        g.get_mut(s..s + data.len())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?
            .copy_from_slice(data);
        Ok(())
    }
    fn syncer(&self) -> Arc<dyn SegmentSync> {
        Arc::new(SimSync {
            ino: self.ino.clone(),
            sim: self.sim.clone(),
        })
    }
}

struct SimTable {
    ino: Arc<Inode>,
    sim: Sim,
}

impl TableFile for SimTable {
    fn len_bytes(&self) -> io::Result<u64> {
        Ok(lock(&self.ino.cur).len() as u64)
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let g = lock(&self.ino.cur);
        let s = (offset as usize).min(g.len());
        let n = buf.len().min(g.len() - s);
        buf[..n].copy_from_slice(&g[s..s + n]);
        Ok(n)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut g = lock(&self.ino.cur);
        let s = offset as usize;
        if g.len() < s + data.len() {
            g.resize(s + data.len(), 0);
        }
        g[s..s + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn sync(&self) -> io::Result<()> {
        self.sim.crash("before table sync", false);
        let _st = lock(&self.sim.st);
        let c = lock(&self.ino.cur).clone();
        *lock(&self.ino.durable) = c;
        Ok(())
    }
}

impl Storage for Sim {
    fn list(&self) -> io::Result<Vec<String>> {
        Ok(lock(&self.st).names.keys().cloned().collect())
    }
    fn create_segment(&self, name: &str, size: u64) -> io::Result<Box<dyn SegmentFile>> {
        self.crash("create_segment", false);
        let ino = Arc::new(Inode {
            cur: Mutex::new(vec![0; size as usize]),
            durable: Mutex::new(vec![0; size as usize]),
        });
        lock(&self.st).push(NsOp::Set(name.to_string(), ino.clone()));
        Ok(Box::new(SimSeg {
            ino,
            sim: self.clone(),
            writable: true,
        }))
    }
    fn open_segment(&self, name: &str, writable: bool) -> io::Result<Box<dyn SegmentFile>> {
        Ok(Box::new(SimSeg {
            ino: self.get(name)?,
            sim: self.clone(),
            writable,
        }))
    }
    fn truncate(&self, name: &str, len: u64) -> io::Result<()> {
        let i = self.get(name)?;
        let _st = lock(&self.st);
        lock(&i.cur).resize(len as usize, 0);
        let c = lock(&i.cur).clone();
        *lock(&i.durable) = c;
        Ok(())
    }
    fn read_file(&self, name: &str) -> io::Result<Vec<u8>> {
        Ok(lock(&self.get(name)?.cur).clone())
    }
    fn write_file_durable(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.crash(&format!("write_file_durable {name}"), false);
        let ino = Arc::new(Inode {
            cur: Mutex::new(bytes.to_vec()),
            durable: Mutex::new(bytes.to_vec()),
        });
        let mut st = lock(&self.st);
        st.push(NsOp::Set(name.to_string(), ino));
        st.sync_dir();
        Ok(())
    }
    fn write_file(&self, name: &str, bytes: &[u8]) -> io::Result<()> {
        self.crash(&format!("write_file {name}"), false);
        let mut st = lock(&self.st);
        if let Some(i) = st.names.get(name) {
            *lock(&i.cur) = bytes.to_vec();
        } else {
            let ino = Arc::new(Inode {
                cur: Mutex::new(bytes.to_vec()),
                durable: Mutex::new(Vec::new()),
            });
            st.push(NsOp::Set(name.to_string(), ino));
        }
        Ok(())
    }
    fn sync_file(&self, name: &str) -> io::Result<()> {
        let i = self.get(name)?;
        let _st = lock(&self.st);
        let c = lock(&i.cur).clone();
        *lock(&i.durable) = c;
        Ok(())
    }
    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        self.crash(&format!("rename {from} {to}"), false);
        let mut st = lock(&self.st);
        if !st.names.contains_key(from) {
            return Err(nf(from));
        }
        st.push(NsOp::Rename(from.into(), to.into()));
        Ok(())
    }
    fn exchange(&self, a: &str, b: &str) -> io::Result<()> {
        self.crash(&format!("exchange {a} {b}"), false);
        let mut st = lock(&self.st);
        if !st.names.contains_key(a) {
            return Err(nf(a));
        }
        if !st.names.contains_key(b) {
            return Err(nf(b));
        }
        st.push(NsOp::Exchange(a.into(), b.into()));
        Ok(())
    }
    fn remove(&self, name: &str) -> io::Result<()> {
        self.crash(&format!("remove {name}"), false);
        let mut st = lock(&self.st);
        if !st.names.contains_key(name) {
            return Err(nf(name));
        }
        st.push(NsOp::Remove(name.into()));
        Ok(())
    }
    fn sync_dir(&self) -> io::Result<()> {
        self.crash("sync_dir", false);
        lock(&self.st).sync_dir();
        Ok(())
    }
    fn open_table(&self, name: &str, writable: bool) -> io::Result<Box<dyn TableFile>> {
        let mut st = lock(&self.st);
        let ino = match st.names.get(name) {
            Some(i) => i.clone(),
            None if writable => {
                let i = Arc::new(Inode::default());
                st.push(NsOp::Set(name.into(), i.clone()));
                i
            }
            None => return Err(nf(name)),
        };
        Ok(Box::new(SimTable {
            ino,
            sim: self.clone(),
        }))
    }
}

#[derive(Default, Clone)]
struct Stream {
    events: Vec<(u64, Lsn, Vec<u8>)>,
    deletes: Vec<(Lsn, u64)>,
    snaps: Vec<(u64, Vec<u8>)>,
}

impl Stream {
    fn last(&self) -> u64 {
        self.events.last().map_or(0, |e| e.0)
    }
}

fn options(durability: Durability, epoch: u64) -> JournalOptions {
    JournalOptions {
        segment_size_bytes: 4096,
        durability,
        writer_epoch: WriterEpoch(epoch),
        ..JournalOptions::default()
    }
}

/// Checks the journal recovered from `copy` against the model.
fn check_copy(
    copy: &CrashCopy,
    model: &BTreeMap<String, Stream>,
    known: &[HashMap<String, u64>],
    epoch: u64,
) -> Result<(), String> {
    let tag = format!(
        "crash at {} (durable {:?}, gen {})",
        copy.site, copy.durable, copy.generation
    );
    let (mut j, _) = Journal::open_with_storage(
        Arc::new(copy.storage.clone()),
        options(Durability::None, epoch),
    )
    .map_err(|e| format!("{tag}: open failed: {e}"))?;
    let d = copy.durable;
    for (name, s) in model {
        let p = pid(name);
        let rec = j
            .recover(&p)
            .map_err(|e| format!("{tag}: recover {name}: {e}"))?;
        let s_r = match &rec.snapshot {
            None => 0,
            Some(x) => {
                if !s
                    .snaps
                    .iter()
                    .any(|(q, dd)| *q == x.sequence_nr.0 && *dd == x.data)
                {
                    return Err(format!(
                        "{tag}: {name}: unknown snapshot {:?}",
                        x.sequence_nr
                    ));
                }
                x.sequence_nr.0
            }
        };
        let must = known
            .get(copy.generation.wrapping_sub(1))
            .and_then(|k| k.get(name))
            .copied()
            .unwrap_or(0);
        if copy.generation > 0 && s_r < must {
            return Err(format!(
                "{tag}: {name}: snapshot at {s_r}, below {must} made durable by a close"
            ));
        }
        let events = j
            .replay(&p, SequenceNr(1))
            .map_err(|e| format!("{tag}: replay {name}: {e}"))?;
        let hi = j.highest_sequence_nr(&p).0;
        let acked_hi = s
            .events
            .iter()
            .filter(|e| e.1 <= d)
            .map(|e| e.0)
            .max()
            .unwrap_or(0);
        let acked_del = s
            .deletes
            .iter()
            .filter(|e| e.0 <= d)
            .map(|e| e.1)
            .max()
            .unwrap_or(0);
        if hi < acked_hi {
            return Err(format!("{tag}: {name}: highest {hi} < durable {acked_hi}"));
        }
        // Events at or below the snapshot may be partly gone (their
        // segments removed); above it they are contiguous.
        let above: Vec<_> = events.iter().filter(|e| e.sequence_nr.0 > s_r).collect();
        let f = above.first().map_or(hi + 1, |e| e.sequence_nr.0);
        for (k, e) in above.iter().enumerate() {
            let n = e.sequence_nr.0;
            if n != f + k as u64 {
                return Err(format!(
                    "{tag}: {name}: gap before #{n} (from {f}, snapshot {s_r})"
                ));
            }
        }
        for e in &events {
            let n = e.sequence_nr.0;
            let want = s.events.iter().find(|x| x.0 == n);
            if want.map(|x| &x.2) != Some(&e.payload) {
                return Err(format!("{tag}: {name}: #{n} wrong payload"));
            }
            if n <= acked_del {
                return Err(format!(
                    "{tag}: {name}: #{n} replayed though deleted to {acked_del} durably"
                ));
            }
        }
        if above.last().map_or(hi, |e| e.sequence_nr.0) != hi {
            return Err(format!("{tag}: {name}: replay ends before highest {hi}"));
        }
        // Events before `f` are gone: covered by the recovered snapshot or
        // by a deletion the recovered journal knows of.
        if f > 1 && f - 1 > s_r {
            let probe = j
                .delete_to(&p, SequenceNr(f - 1), WriterEpoch(epoch))
                .map_err(|e| format!("{tag}: probe {name}: {e}"))?;
            if probe.is_some() {
                return Err(format!(
                    "{tag}: {name}: events 1..{} lost: snapshot at {s_r}, no deletion known \
                     (durable events to {acked_hi}, durable deletion to {acked_del})",
                    f - 1
                ));
            }
        }
    }
    let _ = j.close();
    Ok(())
}

fn run_case(seed: u64, prefix_mode: bool) -> Result<usize, String> {
    let mut rng = StdRng::seed_from_u64(seed);
    let sim = Sim::new(seed, 0.03, 40, prefix_mode);
    let durability = match rng.gen_range(0..3) {
        0 => Durability::None,
        1 => Durability::Always,
        _ => Durability::Interval(Duration::from_micros(300)),
    };
    let mut epoch = 1u64;
    let open = |sim: &Sim, epoch| {
        let (j, _) =
            Journal::open_with_storage(Arc::new(sim.clone()), options(durability, epoch)).unwrap();
        *lock(&sim.hook.watcher) = Some(j.watcher());
        j
    };
    let mut j = open(&sim, epoch);
    let ids: Vec<String> = (0..rng.gen_range(2..7))
        .map(|i| format!("id-{i}"))
        .collect();
    let mut model: BTreeMap<String, Stream> =
        ids.iter().map(|i| (i.clone(), Stream::default())).collect();
    let mut known: Vec<HashMap<String, u64>> = Vec::new();
    let mut serial = 0u64;
    let ops = rng.gen_range(100..400);
    for step in 0..ops {
        let name = ids[rng.gen_range(0..ids.len())].clone();
        let p = pid(&name);
        let s = model.get_mut(&name).unwrap();
        match rng.gen_range(0..100) {
            0..=49 => {
                let seq = s.last() + 1;
                let len = rng.gen_range(0..300);
                let payload: Vec<u8> = (0..len).map(|i| (i as u64 ^ seq ^ step) as u8).collect();
                let lsn = j
                    .append(&p, SequenceNr(seq), WriterEpoch(epoch), &payload)
                    .map_err(|e| format!("append: {e}"))?;
                s.events.push((seq, lsn, payload));
            }
            50..=61 => {
                let saved = s.snaps.last().map_or(0, |x| x.0);
                if s.last() > 0 {
                    let seq = rng.gen_range(saved.max(1)..=s.last());
                    serial += 1;
                    let big = rng.gen_bool(0.3);
                    let mut data = format!("{name}@{seq}#{serial}").into_bytes();
                    if big {
                        data.resize(6000, b'x');
                    }
                    j.save_snapshot(&p, SequenceNr(seq), WriterEpoch(epoch), &data)
                        .map_err(|e| format!("snapshot: {e}"))?;
                    s.snaps.push((seq, data));
                }
            }
            62..=69 => {
                let to = s.last().saturating_sub(rng.gen_range(0..4));
                if let Some(lsn) = j
                    .delete_to(&p, SequenceNr(to), WriterEpoch(epoch))
                    .map_err(|e| format!("delete: {e}"))?
                {
                    s.deletes.push((lsn, to));
                }
            }
            70..=84 => j.maintain(),
            85..=88 => {
                let last = Lsn(j.next_lsn().0 - 1);
                if last.0 > 0 {
                    j.wait_durable(last).map_err(|e| format!("wait: {e}"))?;
                }
            }
            89..=93 => std::thread::sleep(Duration::from_micros(rng.gen_range(0..1500))),
            94..=96 => sim.crash(&format!("main step {step}"), true),
            _ => {
                j.close().map_err(|e| format!("close: {e}"))?;
                known.push(
                    model
                        .iter()
                        .filter_map(|(k, v)| v.snaps.last().map(|x| (k.clone(), x.0)))
                        .collect(),
                );
                sim.hook.generation.fetch_add(1, Ordering::SeqCst);
                if rng.gen_bool(0.3) {
                    epoch += 1;
                }
                j = open(&sim, epoch);
            }
        }
    }
    j.close().map_err(|e| format!("final close: {e}"))?;
    known.push(
        model
            .iter()
            .filter_map(|(k, v)| v.snaps.last().map(|x| (k.clone(), x.0)))
            .collect(),
    );
    sim.hook.generation.fetch_add(1, Ordering::SeqCst);
    // The final state, after a clean close, as a crash copy with
    // everything durable.
    *lock(&sim.hook.watcher) = None;
    let final_copy = {
        let st = lock(&sim.st);
        let storage = MemoryStorage::new();
        for (n, i) in &st.names {
            storage
                .write_file_durable(n, &lock(&i.cur).clone())
                .unwrap();
        }
        CrashCopy {
            durable: Lsn(u64::MAX),
            generation: known.len(),
            site: "after the final close".into(),
            storage,
        }
    };
    check_copy(&final_copy, &model, &known, epoch)?;
    // The final snapshot of every id is exactly the last saved.
    {
        let (j, _) = Journal::open_with_storage(
            Arc::new(final_copy.storage.clone()),
            options(Durability::None, epoch),
        )
        .unwrap();
        for (name, s) in &model {
            let got = j
                .load_snapshot(&pid(name))
                .unwrap()
                .map(|x| (x.sequence_nr.0, x.data));
            // (Two saves at one sequence number, one in the table and one
            // in a file: either may be found.)
            let ok = match (&got, s.snaps.last()) {
                (None, None) => true,
                (Some(g), Some(l)) => g.0 == l.0 && s.snaps.iter().any(|x| x == g),
                _ => false,
            };
            if !ok {
                let hist: Vec<_> = s
                    .snaps
                    .iter()
                    .map(|(q, d)| {
                        (
                            *q,
                            d.len(),
                            String::from_utf8_lossy(&d[..d.len().min(16)]).to_string(),
                        )
                    })
                    .collect();
                return Err(format!(
                    "after close: {name}: snapshot {:?} != last saved; saves {hist:?}",
                    got.map(|g| (g.0, String::from_utf8_lossy(&g.1).to_string()))
                ));
            }
        }
        j.close().unwrap();
    }
    let copies = std::mem::take(&mut *lock(&sim.hook.copies));
    for c in &copies {
        check_copy(c, &model, &known, epoch)?;
    }
    Ok(copies.len())
}

fn cases(prefix_mode: bool) {
    let n: u64 = std::env::var("JOURNAL_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let base: u64 = std::env::var("JOURNAL_FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    let mut total = 0;
    let mut failures = Vec::new();
    for i in 0..n {
        let seed = base.wrapping_add(i);
        match run_case(seed, prefix_mode) {
            Ok(c) => total += c,
            Err(e) => failures.push(format!("seed {seed}: {e}")),
        }
    }
    eprintln!("{n} cases from seed {base}, {total} crash copies checked");
    assert!(
        failures.is_empty(),
        "{} failures:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn crash_copies_at_sync_points_lose_nothing_durable() {
    cases(false);
}

#[test]
fn crash_copies_with_any_prefix_of_directory_changes_lose_nothing_durable() {
    cases(true);
}
