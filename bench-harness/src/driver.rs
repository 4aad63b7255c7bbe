//! The load driver: one writer thread and one reader thread per connection.
//!
//! The writer takes requests from its [`RequestSource`], waits for their
//! intended send time (open loop) or for a free slot (closed loop), sends
//! them pipelined (at most `window` in flight) and flushes whenever it is
//! about to wait. The reader matches replies to the pending table by request
//! id and records them. A broken connection fails every request in flight
//! (`connection_lost`, never re-sent: delivery is at most once) and the
//! writer reconnects to the next address in the list; a connection that
//! answers nothing for `request_timeout` while requests wait is declared
//! dead the same way (`no_response`).
//!
//! Threading: the pending table and the [`Recorder`] of a connection sit
//! behind one mutex shared by its writer and reader (two threads, short
//! critical sections); the progress display takes the interval histogram
//! from it about once a second.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hdrhistogram::Histogram;

use crate::schedule::OpenLoopSchedule;
use crate::stats::{latency_histogram, ErrorKind, Recorder};
use crate::transport::{Connector, Reply, RequestSink};
use crate::workload::{OpKind, Request};

/// Open or closed loop.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LoopMode {
    /// Fixed schedule; this connection's share of the rate (requests/s).
    Open,
    /// Send as soon as a slot of the window is free.
    Closed,
}

/// Settings of one run of the driver.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Client addresses; connection `i` starts at `addresses[i % len]`.
    pub addresses: Vec<SocketAddr>,
    /// Open or closed loop.
    pub mode: LoopMode,
    /// Per connection: open-loop rate (requests/s, ignored when closed).
    pub rates_per_s: Vec<f64>,
    /// Per connection: most requests in flight (count, >= 1).
    pub windows: Vec<usize>,
    /// Per connection: most requests to send (count); `u64::MAX` = no cap.
    pub quotas: Vec<u64>,
    /// Warm-up before measurement (not in the summary).
    pub warmup: Duration,
    /// Measured part after the warm-up; `None` = until the sources end.
    pub duration: Option<Duration>,
    /// A connection with requests waiting and no reply for this long is
    /// declared dead.
    pub request_timeout: Duration,
    /// Keep the value of every successful counter reply (for the verifier).
    pub capture_values: bool,
}

/// A writer that could not connect to any address for this long gives up
/// and fails the run.
pub const UNREACHABLE_LIMIT: Duration = Duration::from_secs(30);

struct Pending {
    entity: u64,
    op: OpKind,
    intended_ns: u64,
}

struct ConnState {
    generation: u64,
    dead: bool,
    pending: HashMap<u64, Pending>,
    recorder: Recorder,
    last_reply_ns: u64,
    /// The writer sleeps until at most this many requests are in flight
    /// (`None`: it is not waiting). Waking it once per batch of replies
    /// rather than once per reply saves a futex call per request.
    wake_at: Option<usize>,
}

struct Conn {
    state: Mutex<ConnState>,
    slot_freed: Condvar,
    completed: AtomicU64,
    sent: AtomicU64,
}

impl Conn {
    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Fails every pending request with `kind` and bumps the generation so the
/// old reader stops recording.
fn kill_locked(state: &mut ConnState, kind: ErrorKind, now_ns: u64) {
    state.dead = true;
    state.generation += 1;
    for (_, p) in state.pending.drain() {
        state
            .recorder
            .failure(p.entity, p.op, kind, p.intended_ns, now_ns);
    }
}

/// A snapshot for the progress display.
pub struct Progress {
    /// Completed requests, successes and errors (count).
    pub completed: u64,
    /// Successes since the previous snapshot (µs).
    pub interval: Histogram<u64>,
}

/// A running load.
pub struct Driver {
    conns: Vec<Arc<Conn>>,
    handles: Vec<JoinHandle<Result<()>>>,
    origin: Instant,
    stop: Arc<AtomicBool>,
}

/// What a finished run gives back.
pub struct Outcome {
    /// Everything recorded, all connections merged.
    pub recorder: Recorder,
    /// Requests sent (count, warm-up included).
    pub sent: u64,
    /// Wall time from origin to the end of the run.
    pub elapsed: Duration,
}

fn now_ns(origin: Instant) -> u64 {
    origin.elapsed().as_nanos() as u64
}

impl Driver {
    /// Starts one writer (and reader) per source. `origin` is time zero of
    /// the run; requests intended before `origin + warmup` are warm-up.
    pub fn start(
        config: DriverConfig,
        connector: Arc<dyn Connector>,
        sources: Vec<Box<dyn Iterator<Item = Result<Request>> + Send>>,
        origin: Instant,
        stop: Arc<AtomicBool>,
    ) -> Driver {
        let measure_start_ns = config.warmup.as_nanos() as u64;
        let config = Arc::new(config);
        let mut conns = Vec::new();
        let mut handles = Vec::new();
        for (index, source) in sources.into_iter().enumerate() {
            let conn = Arc::new(Conn {
                state: Mutex::new(ConnState {
                    generation: 0,
                    dead: true,
                    pending: HashMap::new(),
                    recorder: Recorder::new(measure_start_ns)
                        .capturing_values(config.capture_values),
                    last_reply_ns: 0,
                    wake_at: None,
                }),
                slot_freed: Condvar::new(),
                completed: AtomicU64::new(0),
                sent: AtomicU64::new(0),
            });
            conns.push(conn.clone());
            let (config, connector, stop) = (config.clone(), connector.clone(), stop.clone());
            handles.push(
                std::thread::Builder::new()
                    .name(format!("writer-{index}"))
                    .spawn(move || {
                        Writer {
                            index,
                            config,
                            connector,
                            conn,
                            origin,
                            stop,
                        }
                        .run(source)
                    })
                    .expect("spawn writer thread"),
            );
        }
        Driver {
            conns,
            handles,
            origin,
            stop,
        }
    }

    /// Whether every writer has finished.
    pub fn is_finished(&self) -> bool {
        self.handles.iter().all(|h| h.is_finished())
    }

    /// Asks every writer to stop sending (in-flight requests still drain).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Counts so far and the successes since the last call.
    pub fn progress(&self) -> Progress {
        let mut interval = latency_histogram(2);
        let mut completed = 0;
        for conn in &self.conns {
            completed += conn.completed.load(Ordering::Relaxed);
            let mut state = conn.lock();
            interval.add(&state.recorder.interval).expect("same bounds");
            state.recorder.interval.reset();
        }
        Progress {
            completed,
            interval,
        }
    }

    /// Waits for every writer and merges what they recorded.
    ///
    /// # Errors
    /// The first writer error (a malformed trace line, an unusable address).
    pub fn join(self) -> Result<Outcome> {
        let mut first_error = None;
        for handle in self.handles {
            match handle.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                Err(_) => {
                    first_error.get_or_insert(anyhow::anyhow!("a writer thread panicked"));
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let end_ns = now_ns(self.origin);
        let mut merged: Option<Recorder> = None;
        let mut sent = 0;
        for conn in self.conns {
            sent += conn.sent.load(Ordering::Relaxed);
            let mut state = conn.lock();
            let measure_start = state.recorder.measure_start_ns;
            let mut recorder = std::mem::replace(&mut state.recorder, Recorder::new(measure_start));
            recorder.close_windows(end_ns);
            match merged.as_mut() {
                None => merged = Some(recorder),
                Some(m) => m.merge(recorder),
            }
        }
        let recorder = merged.context("no connection was started")?;
        Ok(Outcome {
            recorder,
            sent,
            elapsed: Duration::from_nanos(end_ns),
        })
    }
}

struct Writer {
    index: usize,
    config: Arc<DriverConfig>,
    connector: Arc<dyn Connector>,
    conn: Arc<Conn>,
    origin: Instant,
    stop: Arc<AtomicBool>,
}

enum Slot {
    Free,
    Dead,
}

impl Writer {
    fn now(&self) -> u64 {
        now_ns(self.origin)
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Connects to the next reachable address, starting with `*address`;
    /// returns `Ok(None)` when asked to stop or past `give_up_ns` first.
    ///
    /// # Errors
    /// When no address accepted a connection for [`UNREACHABLE_LIMIT`].
    fn connect(
        &self,
        address: &mut usize,
        give_up_ns: u64,
    ) -> Result<Option<Box<dyn RequestSink>>> {
        let addresses = &self.config.addresses;
        let mut failures = 0usize;
        let down_since = Instant::now();
        loop {
            if self.stopping() || self.now() > give_up_ns {
                return Ok(None);
            }
            if down_since.elapsed() > UNREACHABLE_LIMIT {
                anyhow::bail!(
                    "connection {}: no node reachable at {:?} for {:?}",
                    self.index,
                    addresses,
                    UNREACHABLE_LIMIT
                );
            }
            let addr = addresses[*address % addresses.len()];
            match self.connector.connect(addr) {
                Ok((sink, mut source)) => {
                    let generation = {
                        let mut state = self.conn.lock();
                        state.dead = false;
                        state.last_reply_ns = self.now();
                        state.generation
                    };
                    let conn = self.conn.clone();
                    let origin = self.origin;
                    std::thread::Builder::new()
                        .name(format!("reader-{}", self.index))
                        .spawn(move || loop {
                            let reply = source.recv();
                            let now = now_ns(origin);
                            let mut state = conn.lock();
                            if state.generation != generation {
                                return;
                            }
                            match reply {
                                Ok(reply) => record_reply(&conn, &mut state, reply, now),
                                Err(_) => {
                                    kill_locked(&mut state, ErrorKind::ConnectionLost, now);
                                    conn.slot_freed.notify_all();
                                    return;
                                }
                            }
                        })
                        .expect("spawn reader thread");
                    return Ok(Some(sink));
                }
                Err(_) => {
                    *address += 1;
                    failures += 1;
                    if failures >= addresses.len() {
                        failures = 0;
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
        }
    }

    /// Waits until fewer than `window` requests are in flight. Flushes
    /// before waiting.
    fn acquire(&self, sink: &mut Box<dyn RequestSink>, window: usize) -> Slot {
        let mut flushed = false;
        let mut state = self.conn.lock();
        loop {
            if state.dead {
                return Slot::Dead;
            }
            if state.pending.len() < window {
                return Slot::Free;
            }
            if !flushed {
                drop(state);
                if sink.flush().is_err() {
                    let mut state = self.conn.lock();
                    kill_locked(&mut state, ErrorKind::ConnectionLost, self.now());
                    return Slot::Dead;
                }
                flushed = true;
                state = self.conn.lock();
                continue;
            }
            let now = self.now();
            let silent_ns = now.saturating_sub(state.last_reply_ns);
            if silent_ns >= self.config.request_timeout.as_nanos() as u64 {
                kill_locked(&mut state, ErrorKind::NoResponse, now);
                return Slot::Dead;
            }
            // Wake when a quarter of the window is free (at least one slot).
            state.wake_at = Some(window - (window / 4).max(1));
            let (next, _) = self
                .conn
                .slot_freed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner());
            state = next;
            state.wake_at = None;
        }
    }

    fn run(self, mut source: Box<dyn Iterator<Item = Result<Request>> + Send>) -> Result<()> {
        let config = self.config.clone();
        let window = config.windows[self.index].max(1);
        let quota = config.quotas[self.index];
        let measure_start_ns = config.warmup.as_nanos() as u64;
        let end_ns = config
            .duration
            .map(|d| measure_start_ns + d.as_nanos() as u64)
            .unwrap_or(u64::MAX);
        let schedule = match config.mode {
            LoopMode::Open => Some(OpenLoopSchedule::new(0, config.rates_per_s[self.index])),
            LoopMode::Closed => None,
        };
        let give_up_ns = end_ns.saturating_add(config.request_timeout.as_nanos() as u64);
        let mut address = self.index;
        let mut sink: Option<Box<dyn RequestSink>> = None;
        let mut request_id = 0u64;
        let mut index = 0u64;
        let mut unflushed = 0usize;
        let mut next: Option<Request> = None;
        'send: while index < quota && !self.stopping() {
            let intended = match schedule {
                Some(s) => {
                    let t = s.send_time_ns(index);
                    if t >= end_ns {
                        break;
                    }
                    t
                }
                None => 0,
            };
            if next.is_none() {
                next = match source.next() {
                    None => break,
                    Some(Ok(r)) => Some(r),
                    Some(Err(e)) => {
                        self.stop.store(true, Ordering::SeqCst);
                        return Err(e);
                    }
                };
            }
            if schedule.is_some() {
                loop {
                    let now = self.now();
                    if now >= intended || self.stopping() {
                        break;
                    }
                    if unflushed > 0 {
                        if let Some(s) = sink.as_mut() {
                            let _ = s.flush();
                        }
                        unflushed = 0;
                        continue;
                    }
                    std::thread::sleep(Duration::from_nanos((intended - now).min(50_000_000)));
                }
            } else if self.now() >= end_ns {
                break;
            }
            // A connection with a free slot.
            let s = loop {
                if sink.is_none() {
                    match self.connect(&mut address, give_up_ns) {
                        Ok(Some(s)) => sink = Some(s),
                        Ok(None) => break 'send,
                        Err(e) => {
                            self.stop.store(true, Ordering::SeqCst);
                            return Err(e);
                        }
                    }
                }
                let s = sink.as_mut().expect("connected above");
                match self.acquire(s, window) {
                    Slot::Free => break s,
                    Slot::Dead => {
                        self.conn.slot_freed.notify_all();
                        sink = None;
                        unflushed = 0;
                        address += 1;
                    }
                }
            };
            let request = next.take().expect("taken above");
            let intended = if schedule.is_some() {
                intended
            } else {
                self.now()
            };
            request_id += 1;
            self.conn.lock().pending.insert(
                request_id,
                Pending {
                    entity: request.entity,
                    op: request.op,
                    intended_ns: intended,
                },
            );
            let entity_id = request.entity.to_string();
            self.conn.sent.fetch_add(1, Ordering::Relaxed);
            index += 1;
            if s.send(
                request_id,
                request.op.type_name(),
                &entity_id,
                request.op.payload(),
            )
            .is_err()
            {
                kill_locked(&mut self.conn.lock(), ErrorKind::ConnectionLost, self.now());
                sink = None;
                address += 1;
                continue;
            }
            unflushed += 1;
            if unflushed >= 64 {
                if s.flush().is_err() {
                    kill_locked(&mut self.conn.lock(), ErrorKind::ConnectionLost, self.now());
                    sink = None;
                    address += 1;
                }
                unflushed = 0;
            }
        }
        // Drain what is in flight.
        if let Some(s) = sink.as_mut() {
            if s.flush().is_err() {
                kill_locked(&mut self.conn.lock(), ErrorKind::ConnectionLost, self.now());
            }
        }
        let mut state = self.conn.lock();
        loop {
            if state.pending.is_empty() || state.dead {
                break;
            }
            let now = self.now();
            if now.saturating_sub(state.last_reply_ns) >= config.request_timeout.as_nanos() as u64 {
                kill_locked(&mut state, ErrorKind::NoResponse, now);
                break;
            }
            state.wake_at = Some(0);
            state = self
                .conn
                .slot_freed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Stop the reader from recording anything that arrives late.
        state.generation += 1;
        state.dead = true;
        Ok(())
    }
}

fn record_reply(conn: &Conn, state: &mut ConnState, reply: Reply, now: u64) {
    state.last_reply_ns = now;
    let Some(p) = state.pending.remove(&reply.request_id) else {
        return;
    };
    conn.completed.fetch_add(1, Ordering::Relaxed);
    if state.wake_at.is_some_and(|w| state.pending.len() <= w) {
        state.wake_at = None;
        conn.slot_freed.notify_one();
    }
    let error = match reply.error {
        Some(kind) => Some(kind),
        None if reply.payload.starts_with(b"error:") => Some(ErrorKind::EntityError),
        None => match p.op {
            OpKind::Echo => (reply.payload != p.op.payload()).then_some(ErrorKind::BadReply),
            OpKind::CounterAdd | OpKind::CounterGet => {
                crate::verify::parse_counter_value(&reply.payload)
                    .is_none()
                    .then_some(ErrorKind::BadReply)
            }
        },
    };
    if error.is_none() && p.op != OpKind::Echo {
        if let (Some(values), Some(v)) = (
            state.recorder.values.as_mut(),
            crate::verify::parse_counter_value(&reply.payload),
        ) {
            values.insert(p.entity, v);
        }
    }
    match error {
        None => state.recorder.success(p.entity, p.op, p.intended_ns, now),
        Some(kind) => state
            .recorder
            .failure(p.entity, p.op, kind, p.intended_ns, now),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::fake::{FakeConnector, FakeNode};
    use crate::workload::{KeyDist, OpMix, RequestSource, Workload};

    fn sources(
        n: usize,
        entities: u64,
        op: &str,
    ) -> Vec<Box<dyn Iterator<Item = Result<Request>> + Send>> {
        let w = Workload::Synthetic {
            entities,
            dist: KeyDist::Uniform,
        };
        let ops = OpMix::parse(op).unwrap();
        (0..n)
            .map(|i| {
                Box::new(RequestSource::new(&w, &ops, 1, i as u64, n as u64).unwrap())
                    as Box<dyn Iterator<Item = Result<Request>> + Send>
            })
            .collect()
    }

    fn config(n: usize, mode: LoopMode, quota: u64) -> DriverConfig {
        DriverConfig {
            addresses: vec!["127.0.0.1:1".parse().unwrap()],
            mode,
            rates_per_s: vec![20_000.0; n],
            windows: vec![16; n],
            quotas: vec![quota; n],
            warmup: Duration::ZERO,
            duration: Some(Duration::from_secs(60)),
            request_timeout: Duration::from_secs(5),
            capture_values: false,
        }
    }

    #[test]
    fn closed_loop_counts_every_request_and_acks_every_add() {
        let node = Arc::new(FakeNode::default());
        let d = Driver::start(
            config(2, LoopMode::Closed, 500),
            Arc::new(FakeConnector(node)),
            sources(2, 50, "counter-add"),
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        );
        let out = d.join().unwrap();
        assert_eq!(out.sent, 1000);
        assert_eq!(out.recorder.ok, 1000);
        assert_eq!(out.recorder.histogram.len(), 1000);
        assert_eq!(
            out.recorder.adds.values().map(|c| c.acked).sum::<u64>(),
            1000
        );
    }

    #[test]
    fn open_loop_sends_the_scheduled_count() {
        let node = Arc::new(FakeNode::default());
        let mut cfg = config(1, LoopMode::Open, u64::MAX);
        cfg.rates_per_s = vec![2_000.0];
        cfg.duration = Some(Duration::from_millis(100));
        let d = Driver::start(
            cfg,
            Arc::new(FakeConnector(node)),
            sources(1, 10, "echo"),
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        );
        let out = d.join().unwrap();
        // 2000/s for 100 ms: requests 0..200 are intended before the end.
        assert_eq!(out.sent, 200);
        assert_eq!(out.recorder.ok, 200);
    }

    #[test]
    fn a_broken_connection_fails_in_flight_requests_and_reconnects() {
        let node = Arc::new(FakeNode::default().breaking_after(100));
        let d = Driver::start(
            config(1, LoopMode::Closed, 1000),
            Arc::new(FakeConnector(node)),
            sources(1, 10, "counter-add"),
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        );
        let out = d.join().unwrap();
        let r = &out.recorder;
        assert_eq!(out.sent, 1000);
        let lost = r
            .errors
            .get(&ErrorKind::ConnectionLost)
            .copied()
            .unwrap_or(0);
        assert!(
            lost > 0,
            "some requests were in flight when connections broke"
        );
        assert_eq!(r.ok + lost, 1000);
        let ambiguous: u64 = r.adds.values().map(|c| c.ambiguous).sum();
        assert_eq!(ambiguous, lost);
    }

    #[test]
    fn refused_requests_are_errors_by_kind() {
        let node = Arc::new(FakeNode::default().refusing("3"));
        let d = Driver::start(
            config(1, LoopMode::Closed, 400),
            Arc::new(FakeConnector(node)),
            sources(1, 4, "echo"),
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        );
        let r = d.join().unwrap().recorder;
        let refused = r.errors[&ErrorKind::BufferFull];
        assert!(refused > 50 && r.ok + refused == 400, "{refused}");
        // Entity 3 was never reached; which window is the longest is not
        // asserted here: a success's window is its latency, and a stall of
        // this thread on a loaded machine before entity 3's first request
        // made entity 0's first success the longer one (CI saw it).
        // `stats::tests` checks the choice with fixed times.
        assert!(r.longest_unreachable.is_some());
    }

    #[test]
    fn trace_errors_stop_the_run_with_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.lis");
        std::fs::write(&path, "1 1 0 0\n2 1 0 1\nnot a line\n").unwrap();
        let w = Workload::Trace { path };
        let ops = OpMix::parse("echo").unwrap();
        let source: Box<dyn Iterator<Item = Result<Request>> + Send> =
            Box::new(RequestSource::new(&w, &ops, 1, 0, 1).unwrap());
        let d = Driver::start(
            config(1, LoopMode::Closed, u64::MAX),
            Arc::new(FakeConnector(Arc::new(FakeNode::default()))),
            vec![source],
            Instant::now(),
            Arc::new(AtomicBool::new(false)),
        );
        let error = format!("{:#}", d.join().err().unwrap());
        assert!(error.contains("bad.lis:3"), "{error}");
    }
}
