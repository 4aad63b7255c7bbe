//! Executors, cross-core rings and local notification.
//!
//! ```text
//!  thread "shardline-data-0" (pinned to core 0) ─ monoio runtime ─ gateway, region 0, entities
//!  thread "shardline-data-1" (pinned to core 1) ─ monoio runtime ─ gateway, region 1, entities
//!  thread "shardline-control" (shares a core)   ─ monoio runtime ─ transport, membership, coordinator
//!          ^                    │
//!          └── Ring<T> (bounded, one producer, one consumer, batched, spin-before-park)
//! ```
//!
//! Every executor is a monoio runtime on io_uring created with
//! `IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG` (the measured
//! decision in `docs/decisions/runtime.md`) plus monoio's timer driver.
//! Nothing is shared between executors but rings; state inside an executor is
//! `Rc<RefCell<_>>` and never crosses threads.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError, TrySendError};

pub mod log_limit;
pub(crate) use log_limit::limited;

/// Turns transparent huge pages off for this whole process
/// (`prctl(PR_SET_THP_DISABLE, 1)`, inherited by its children); the
/// `shardline node` command calls it first.
///
/// Why: mimalloc asks for huge pages on its arenas (`madvise(MADV_HUGEPAGE)`),
/// so the first touch of each fresh 2 MiB of heap zeroes 2 MiB in the page
/// fault. A data core's per-entity tables all double at the same entity
/// counts, and the faults of their new tables stalled the core for 20-60 ms
/// on a 2-vCPU VM (the demo's periodic spikes: `docs/node.md`, "The demo's
/// periodic spikes"). With 4 KiB pages the same memory is faulted in as it
/// is touched. A service embedding the engine decides for its own process
/// (the same switch is `MIMALLOC_ALLOW_THP=0` for mimalloc's heap alone).
///
/// Returns `Ok(true)` when the setting took, `Ok(false)` where the call does
/// not exist (not Linux).
///
/// # Errors
/// The `prctl` error (`EINVAL` from a kernel without the option).
pub fn disable_transparent_huge_pages() -> std::io::Result<bool> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: PR_SET_THP_DISABLE takes plain integer arguments and
        // touches no memory of ours.
        let rc = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(true)
    }
    #[cfg(not(target_os = "linux"))]
    {
        Ok(false)
    }
}

/// Raises this process's soft limit of open files (`RLIMIT_NOFILE`) to its
/// hard limit, as Go's runtime does at start since 1.19 and nginx's
/// `worker_rlimit_nofile` does: systemd starts services with a soft limit
/// of 1024 and a hard one of 524288, and every client connection, segment
/// file and lane is a descriptor. The `shardline node` command calls it; a
/// service embedding the engine decides for its own process.
///
/// Returns the (soft, hard) limits after the call.
///
/// # Errors
/// The `getrlimit`/`setrlimit` error.
pub fn raise_open_file_limit() -> std::io::Result<(u64, u64)> {
    let mut l = nofile_limit()?;
    if l.rlim_cur < l.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: l.rlim_max,
            rlim_max: l.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit, read by the call.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        l = raised;
    }
    Ok((l.rlim_cur, l.rlim_max))
}

/// This process's soft limit of open files (`RLIMIT_NOFILE`), or `None`
/// when it cannot be read or is unlimited.
pub fn open_file_limit() -> Option<u64> {
    nofile_limit()
        .ok()
        .map(|l| l.rlim_cur)
        .filter(|&soft| soft != libc::RLIM_INFINITY)
}

/// This process's `RLIMIT_NOFILE` (`getrlimit`).
fn nofile_limit() -> std::io::Result<libc::rlimit> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid rlimit for the call to fill.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l)
}

/// The concrete monoio runtime type every executor uses.
pub type Executor = monoio::Runtime<monoio::time::TimeDriver<monoio::IoUringDriver>>;

/// io_uring submission queue entries per executor.
pub const RING_ENTRIES: u32 = 1024;

/// Builds one executor (call on the thread that will run it).
///
/// # Errors
/// The I/O error from creating the io_uring instance (for example when the
/// kernel refuses io_uring).
pub fn build_executor() -> std::io::Result<Executor> {
    let mut urb = io_uring::IoUring::builder();
    urb.setup_coop_taskrun().setup_taskrun_flag();
    monoio::RuntimeBuilder::<monoio::IoUringDriver>::new()
        .uring_builder(urb)
        .with_entries(RING_ENTRIES)
        .enable_timer()
        .build()
}

/// Spawns a thread named `name`, pins it to `core` when given and available,
/// builds an executor on it and runs `main` to completion.
///
/// # Errors
/// The error from spawning the thread.
pub fn spawn_executor<F, Fut>(
    name: String,
    core: Option<usize>,
    main: F,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + 'static,
{
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            if let Some(core) = core {
                let ids = core_affinity::get_core_ids().unwrap_or_default();
                if let Some(id) = ids.into_iter().find(|c| c.id == core) {
                    if !core_affinity::set_for_current(id) {
                        tracing::warn!(thread = %name, core, "could not pin executor");
                    }
                }
            }
            match build_executor() {
                Ok(mut rt) => rt.block_on(main()),
                Err(e) => tracing::error!(thread = %name, error = %e, "cannot build executor"),
            }
        })
}

/// How long a receiver spins on an empty ring before parking, by default
/// (20 µs): a message that arrives meanwhile is taken without the cost of a
/// cross-core wake-up (about 60-70 µs on the measured VM).
pub const DEFAULT_SPIN_BEFORE_PARK: Duration = Duration::from_micros(20);

struct Parker {
    parked: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Parker {
    fn unpark(&self) {
        if self.parked.swap(false, Ordering::SeqCst) {
            let w = self.waker.lock().map(|mut g| g.take()).unwrap_or(None);
            if let Some(w) = w {
                w.wake();
            }
        }
    }
}

/// Errors from sending into a ring.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RingSendError<T> {
    /// The ring is full; the message is handed back.
    #[error("ring full")]
    Full(T),
    /// The receiver is gone; the message is handed back.
    #[error("ring closed")]
    Closed(T),
}

/// The sending end of a bounded ring. Not `Clone`: one producer per ring.
pub struct RingSender<T> {
    tx: Sender<T>,
    parker: Arc<Parker>,
}

/// The receiving end of a bounded ring.
pub struct RingReceiver<T> {
    rx: Receiver<T>,
    parker: Arc<Parker>,
    spin: Duration,
}

/// A bounded ring of `capacity` messages with one producer and one consumer.
pub fn ring<T>(capacity: usize) -> (RingSender<T>, RingReceiver<T>) {
    let (tx, rx) = crossbeam_channel::bounded(capacity);
    let parker = Arc::new(Parker {
        parked: AtomicBool::new(false),
        waker: Mutex::new(None),
    });
    (
        RingSender {
            tx,
            parker: parker.clone(),
        },
        RingReceiver {
            rx,
            parker,
            spin: DEFAULT_SPIN_BEFORE_PARK,
        },
    )
}

impl<T> RingSender<T> {
    /// Enqueues one message without waking the receiver; call
    /// [`Self::wake`] after a batch.
    ///
    /// # Errors
    /// [`RingSendError`] hands the message back when full or closed.
    pub fn push(&self, msg: T) -> Result<(), RingSendError<T>> {
        self.tx.try_send(msg).map_err(|e| match e {
            TrySendError::Full(m) => RingSendError::Full(m),
            TrySendError::Disconnected(m) => RingSendError::Closed(m),
        })
    }

    /// Wakes the receiver if it is parked (cheap when it is not).
    pub fn wake(&self) {
        self.parker.unpark();
    }

    /// [`Self::push`] then [`Self::wake`].
    ///
    /// # Errors
    /// As [`Self::push`].
    pub fn send(&self, msg: T) -> Result<(), RingSendError<T>> {
        self.push(msg)?;
        self.wake();
        Ok(())
    }
}

impl<T> Clone for RingSender<T> {
    /// Cloning makes a second producer (used only for the low-rate admin
    /// injector, never on the data path).
    fn clone(&self) -> Self {
        RingSender {
            tx: self.tx.clone(),
            parker: self.parker.clone(),
        }
    }
}

impl<T> RingReceiver<T> {
    /// Waits until at least one message is queued, then moves up to `max`
    /// messages into `out`. Returns `false` when every sender is gone and the
    /// ring is empty.
    ///
    /// # Cancel safety
    /// Cancel safe: messages are only taken in the poll that returns Ready.
    pub async fn recv_batch(&mut self, out: &mut Vec<T>, max: usize) -> bool {
        std::future::poll_fn(|cx| {
            let mut spun_since: Option<Instant> = None;
            loop {
                let mut got = 0;
                while got < max {
                    match self.rx.try_recv() {
                        Ok(m) => {
                            out.push(m);
                            got += 1;
                        }
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            return Poll::Ready(got > 0);
                        }
                    }
                }
                if got > 0 {
                    return Poll::Ready(true);
                }
                let start = *spun_since.get_or_insert_with(Instant::now);
                if start.elapsed() < self.spin {
                    std::hint::spin_loop();
                    continue;
                }
                if let Ok(mut g) = self.parker.waker.lock() {
                    *g = Some(cx.waker().clone());
                }
                self.parker.parked.store(true, Ordering::SeqCst);
                if !self.rx.is_empty() {
                    self.parker.parked.store(false, Ordering::SeqCst);
                    continue;
                }
                return Poll::Pending;
            }
        })
        .await
    }
}

/// A single-threaded notification: one waiter, many notifiers, on one
/// executor (used to wake a connection's writer task).
#[derive(Default, Clone)]
pub struct LocalNotify {
    inner: Rc<LocalNotifyInner>,
}

#[derive(Default)]
struct LocalNotifyInner {
    set: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl LocalNotify {
    /// Wakes the waiter (or makes its next wait return at once).
    pub fn notify(&self) {
        self.inner.set.set(true);
        if let Some(w) = self.inner.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits for a notification.
    ///
    /// # Cancel safety
    /// Cancel safe.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| {
            if self.inner.set.replace(false) {
                Poll::Ready(())
            } else {
                *self.inner.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// Accepts one connection on `listener`, or returns `None` once `stop` was
/// notified (the pending accept is cancelled).
///
/// An accept loop ends with this so that its executor can close the
/// listener while the executor still runs: monoio closes a socket by
/// queueing a close on the ring, which only happens if the executor turns
/// again, and a pending accept holds the listener open. A node that stops
/// (in process, [`crate::Node`] dropped) releases its addresses this way.
///
/// # Cancel safety
/// Cancel safe: a connection is either returned or not accepted.
pub async fn accept_or_stop(
    listener: &monoio::net::TcpListener,
    stop: &LocalNotify,
) -> Option<std::io::Result<(monoio::net::TcpStream, std::net::SocketAddr)>> {
    monoio::select! {
        r = listener.accept() => Some(r),
        _ = stop.wait() => None,
    }
}

/// Stops an accept loop started with a `stop` notify (see
/// [`accept_or_stop`]): notifies it, waits until the task (which owns the
/// listener) ended, then lets the executor turn once more so that the
/// listener's close reaches the kernel before the executor returns.
pub async fn stop_accepting(stop: &LocalNotify, task: monoio::task::JoinHandle<()>) {
    stop.notify();
    task.await;
    monoio::time::sleep(Duration::from_millis(1)).await;
}

#[cfg(test)]
mod tests {
    #[cfg(target_os = "linux")]
    #[test]
    fn transparent_huge_pages_are_off_after_the_call() {
        assert!(super::disable_transparent_huge_pages().unwrap());
        // SAFETY: PR_GET_THP_DISABLE takes no pointer.
        let got = unsafe { libc::prctl(libc::PR_GET_THP_DISABLE, 0, 0, 0, 0) };
        assert_eq!(got, 1);
    }

    use super::*;

    #[test]
    fn ring_wakes_a_parked_receiver_on_another_thread() {
        let (tx, mut rx) = ring::<u32>(4);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            for i in 0..10 {
                loop {
                    match tx.send(i) {
                        Ok(()) => break,
                        Err(RingSendError::Full(_)) => std::thread::yield_now(),
                        Err(RingSendError::Closed(_)) => panic!("closed"),
                    }
                }
            }
        });
        let mut rt = build_executor().expect("executor");
        let got = rt.block_on(async move {
            let mut out = Vec::new();
            while out.len() < 10 {
                if !rx.recv_batch(&mut out, 3).await {
                    break;
                }
            }
            out
        });
        t.join().unwrap();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn full_ring_hands_the_message_back() {
        let (tx, _rx) = ring::<u32>(1);
        tx.push(1).unwrap();
        assert!(matches!(tx.push(2), Err(RingSendError::Full(2))));
    }
}
